#pragma once
// Running a partitioned transfer in-process (partition_transfer.hpp): one thread per rank,
// sources sending their layers last-first as a trainer updates them; and the in-process
// transport with the gathering capability. Each side's parts live where its Memory policy
// reaches them: sealed_memory's behind sealed addresses (sealed_memory.hpp), so a transfer
// that touched them itself would fault; any other policy's as they are.
#include <doctest/doctest.h>

#include <deepclone/inproc.hpp>
#include <deepclone/partition_transfer.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <type_traits>
#include <vector>

#include "scenarios.hpp"
#include "sealed_memory.hpp"

namespace partition_test {

namespace dc = deepclone;
using namespace std::chrono_literals;

constexpr int tag_base = 100;

/// The in-process transport plus the gathering capability, as MPI derived datatypes offer
/// it (by copying here: what is tested is the transfer's protocol, not the speed). Counts
/// the gathered sends and scattered receives, so a test can tell the path was taken.
class gathering_inproc {
 public:
  using inner_type = dc::inproc::communicator;
  struct request_type {
    inner_type::request_type inner;
    std::shared_ptr<std::vector<std::byte>> staging;  // the packed bytes in flight
    std::vector<std::span<std::byte>> scatter_to;     // a scattered receive's ranges
  };
  gathering_inproc(inner_type c, std::shared_ptr<std::atomic<int>> used) : c_(std::move(c)), used_(std::move(used)) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  request_type isend(int to, int tag, std::span<const std::byte> b) { return {c_.isend(to, tag, b), {}, {}}; }
  request_type irecv(int from, int tag, std::span<std::byte> b) { return {c_.irecv(from, tag, b), {}, {}}; }
  request_type isend_gather(int to, int tag, std::span<const std::span<const std::byte>> runs) {
    auto buf = std::make_shared<std::vector<std::byte>>();
    for (auto r : runs) buf->insert(buf->end(), r.begin(), r.end());
    ++*used_;
    return {c_.isend(to, tag, *buf), buf, {}};
  }
  request_type irecv_scatter(int from, int tag, std::span<const std::span<std::byte>> runs) {
    std::size_t n = 0;
    for (auto r : runs) n += r.size();
    auto buf = std::make_shared<std::vector<std::byte>>(n);
    ++*used_;
    return {c_.irecv(from, tag, *buf), buf, {runs.begin(), runs.end()}};
  }
  std::optional<std::size_t> test(request_type& r) {
    auto n = c_.test(r.inner);
    if (n && !r.scatter_to.empty()) {  // complete: scatter once
      std::size_t at = 0;
      for (auto to : r.scatter_to) std::memcpy(to.data(), r.staging->data() + at, to.size()), at += to.size();
      r.scatter_to.clear();
    }
    return n;
  }
  std::size_t wait(request_type& r) {
    for (;;)
      if (auto n = test(r)) return *n;
  }
  void cancel(request_type& r) {
    c_.cancel(r.inner);
    r.scatter_to.clear();
  }

 private:
  inner_type c_;
  std::shared_ptr<std::atomic<int>> used_;
};
static_assert(dc::gathering_communicator<gathering_inproc>);
static_assert(!dc::gathering_communicator<dc::inproc::communicator>);

/// Runs every source and clone rank of `s` on its own thread over `comms` (one per rank,
/// sources first), each side's parts where its Memory policy reaches them; returns each
/// clone rank's tensors and the first error of each clone rank.
template <class Comm>
struct run_result {
  std::vector<std::vector<std::vector<std::byte>>> dst;
  std::vector<std::exception_ptr> clone_errors;
};
template <class Comm, class SourceMemory = dc::host_memory, class CloneMemory = dc::host_memory>
run_result<Comm> transfer(const scenario& s, const dc::partition_group_options& opt, std::vector<Comm*> comms,
                          std::chrono::nanoseconds timeout = 10s, dc::partition_sharing sharing = dc::partition_sharing::none) {
  const auto n = static_cast<std::uint32_t>(s.src.size()), m = static_cast<std::uint32_t>(s.dst.size());
  const auto roles = dc::roles::contiguous(n, m);
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst, 256, sharing);
  const auto groups = dc::make_partition_groups(plan, n, m, opt);
  const dc::partition_route route{roles, s.lay, groups, tag_base};
  std::vector<std::vector<std::vector<std::byte>>> src;
  run_result<Comm> out;
  for (const auto& h : s.src) src.push_back(own_tensors(s.lay, h, true));
  for (const auto& h : s.dst) out.dst.push_back(own_tensors(s.lay, h, false));
  out.clone_errors.resize(m);
  std::vector<std::thread> threads;
  for (std::uint32_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      const auto own = parts_in<SourceMemory, const std::byte>(src[i]);
      dc::partition_sender<Comm, dc::checksum::mix64, SourceMemory> send(*comms[i], route, i, own.spans);
      for (auto l = static_cast<std::uint32_t>(s.lay.layer_count()); l-- > 0;) send.send_layer(l);
      try {
        send.wait(timeout);
      } catch (const dc::error&) {  // a clone rank that gave up: the test checks the clone side
      }
    });
  for (std::uint32_t c = 0; c < m; ++c)
    threads.emplace_back([&, c] {
      try {
        const auto own = parts_in<CloneMemory, std::byte>(out.dst[c]);
        dc::partition_receiver<Comm, dc::checksum::mix64, CloneMemory> receive(*comms[n + c], route, c, own.spans);
        receive.wait(timeout);
      } catch (...) {
        out.clone_errors[c] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return out;
}


/// One communicator per rank of a fresh in-process world, each `make(inproc communicator)`.
template <class Comm>
struct ranks_of {
  dc::inproc::world world;
  std::vector<std::unique_ptr<Comm>> owned;
  std::vector<Comm*> comms;
  template <class Make>
  ranks_of(const scenario& s, Make make) : world(static_cast<int>(s.src.size() + s.dst.size())) {
    for (int r = 0; r < world.size(); ++r) comms.push_back(owned.emplace_back(std::make_unique<Comm>(make(world.comm(r)))).get());
  }
};

/// Checks that every clone rank of `r` got every byte it wants of `s`, naming an error.
template <class Comm>
void check_clones(const scenario& s, const run_result<Comm>& r) {
  for (std::size_t c = 0; c < s.dst.size(); ++c) {
    if (r.clone_errors[c]) {
      try {
        std::rethrow_exception(r.clone_errors[c]);
      } catch (const std::exception& e) {
        FAIL_CHECK("clone rank " << c << ": " << e.what());
      }
    }
    for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t)
      CHECK_MESSAGE(holds_pattern(s, c, r.dst[c], t), "clone rank " << c << ", tensor " << t);
  }
}

/// Moves `s` in-process, each side's parts in its Memory, and checks every clone byte.
template <class SourceMemory = dc::host_memory, class CloneMemory = dc::host_memory>
void check_exact(const scenario& s, const dc::partition_group_options& opt, dc::partition_sharing sharing = dc::partition_sharing::none) {
  ranks_of<dc::inproc::communicator> ranks(s, [](dc::inproc::communicator c) { return c; });
  check_clones(s, transfer<dc::inproc::communicator, SourceMemory, CloneMemory>(s, opt, ranks.comms, 10s, sharing));
}

}  // namespace partition_test
