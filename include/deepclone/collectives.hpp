#pragma once
/// \file collectives.hpp
/// Collectives over a group of ranks, built on any point_to_point_communicator. deepclone
/// itself never needs them; they let a trainer average gradients among its own ranks (the
/// sources, or later the clone ranks) on the same communicator, with no MPI sub-communicator.
/// The sum is taken in rank order on the group's first rank, so every run with the same
/// inputs gives bitwise the same result (what a reproducibility check needs).

#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "communicator.hpp"
#include "error.hpp"

namespace deepclone {

/// Sums `data` element-wise over the ranks in `group` (each passes the same group, in the
/// same order, and the same size); every member receives the sum. Uses `tag` and `tag + 1`.
template <point_to_point_communicator Comm, class T>
  requires std::is_arithmetic_v<T>
void allreduce_sum(Comm& comm, std::span<const int> group, std::span<T> data, int tag) {
  const int me = comm.rank();
  std::size_t pos = group.size();
  for (std::size_t i = 0; i < group.size(); ++i)
    if (group[i] == me) pos = i;
  if (pos == group.size())
    throw error(errc::invalid_argument, "allreduce_sum: rank " + std::to_string(me) + " is not in the group");
  auto bytes = std::as_writable_bytes(data);
  if (pos == 0) {
    std::vector<T> other(data.size());
    for (std::size_t i = 1; i < group.size(); ++i) {
      auto r = comm.irecv(group[i], tag, std::as_writable_bytes(std::span<T>(other)));
      if (comm.wait(r) != bytes.size())
        throw error(errc::invalid_argument, "allreduce_sum: rank " + std::to_string(group[i]) + " sent a different size");
      for (std::size_t k = 0; k < data.size(); ++k) data[k] += other[k];
    }
    std::vector<typename Comm::request_type> sends;
    for (std::size_t i = 1; i < group.size(); ++i) sends.push_back(comm.isend(group[i], tag + 1, bytes));
    for (auto& s : sends) comm.wait(s);
  } else {
    auto s = comm.isend(group[0], tag, bytes);
    comm.wait(s);
    auto r = comm.irecv(group[0], tag + 1, bytes);
    comm.wait(r);
  }
}

/// Waits until every rank of `group` has called it (a barrier on the group).
template <point_to_point_communicator Comm>
void barrier(Comm& comm, std::span<const int> group, int tag) {
  std::uint8_t token = 0;
  allreduce_sum(comm, group, std::span<std::uint8_t>(&token, 1), tag);
}

}  // namespace deepclone
