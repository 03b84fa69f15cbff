#pragma once
/// \file part_memory.hpp
/// Where a partitioned rank's parts live, as the partitioned transfer reaches them: the
/// `Memory` policy of partition_sender, partition_receiver and partition_engine.
///
///   - `host_memory` (the default): the host addresses the parts. Messages leave from them
///     and land in them as they lie (zero copy where the plan allows, partition_groups.hpp).
///   - A staging policy (`host_addressable == false`; integrations/thrust.hpp's
///     `thrust_staging` for device memory): each message is gathered by the policy from the
///     parts into a host buffer, checksummed and sent from there; a clone rank receives it
///     into a host buffer, verifies it there, and only then has the policy scatter it into
///     its parts, so a corrupt message writes nothing. The transfer itself never touches a
///     staged part's bytes: it bounds-checks each run against the part's size, then hands
///     the run to the policy.
///
/// The bytes on the wire are the same either way, so a staged source serves a host clone
/// rank and the reverse; the policy is each rank's own choice, not part of the plan.
///
/// A policy is default-constructible (each sender and receiver holds its own) and has
///   - `static constexpr bool host_addressable`;
///   - `gather(runs, out)`: copies `runs` (spans of part bytes), in order, into the host
///     span `out` of exactly their total size;
///   - `scatter(in, runs)`: the reverse, from the host span `in` into `runs`.
/// Either may throw; a send that throws is not posted, a receive whose scatter throws fails
/// the transfer. Both run inside the hooks (a source's after_update sends the layer), so
/// they must see the layer's final bytes there: the trainer's update of a layer must have
/// completed (for a device: on the device, its stream synchronised) before its after_update.
/// A staged side needs host buffers for what it sends or receives: a clone rank posts its
/// receives at once, into buffers as large as the parts it wants.

#include <concepts>
#include <cstddef>
#include <cstring>
#include <span>

namespace deepclone {

/// What the partitioned transfer needs of a `Memory` policy (see the file comment).
template <class M>
concept part_memory = std::default_initializable<M> &&
    requires(M& m, std::span<const std::span<const std::byte>> from, std::span<std::byte> host_out,
             std::span<const std::byte> host_in, std::span<const std::span<std::byte>> to) {
      { M::host_addressable } -> std::convertible_to<bool>;
      m.gather(from, host_out);
      m.scatter(host_in, to);
    };

/// Parts in host memory: the transfer sends from and receives into them in place, and packs
/// short runs itself; `gather`/`scatter` are plain copies.
struct host_memory {
  static constexpr bool host_addressable = true;
  void gather(std::span<const std::span<const std::byte>> runs, std::span<std::byte> out) const noexcept {
    for (auto r : runs) {
      if (!r.empty()) std::memcpy(out.data(), r.data(), r.size());
      out = out.subspan(r.size());
    }
  }
  void scatter(std::span<const std::byte> in, std::span<const std::span<std::byte>> runs) const noexcept {
    for (auto r : runs) {
      if (!r.empty()) std::memcpy(r.data(), in.data(), r.size());
      in = in.subspan(r.size());
    }
  }
};
static_assert(part_memory<host_memory>);

}  // namespace deepclone
