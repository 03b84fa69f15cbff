#pragma once
/// \file partition_groups.hpp
/// How the partitioned plan's bytes travel (issue 12): its region_transfers grouped per
/// (layer, source, clone rank), each group cut into messages. A run of at least
/// `direct_min_bytes` is a message of its own, read straight from the source's tensor and
/// received straight into the clone's (zero copy, as replicated pieces travel); the group's
/// smaller runs are packed into one message (`pack` on the sender, `unpack` on the
/// receiver), because one message per small run costs far more than copying it twice
/// (docs/performance.md, "Partitioned transfers"). Over MPI a packed message is better sent
/// as one derived datatype over its runs where they average 1 KiB or more
/// (MPI_Type_create_hindexed was 1.0-3.5x faster than packing there, no faster below); the
/// messages are the unit for both. Pure and
/// deterministic, like the plan: every rank computes the same groups.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "error.hpp"
#include "holdings.hpp"
#include "layout.hpp"

namespace deepclone {

struct partition_group_options {
  /// Runs at least this long travel as their own message, zero copy (no CPU time or memory
  /// bandwidth taken from the training source). Measured under Open MPI, shared memory: one
  /// message per run was 3-550x slower than packing for runs of 8 KiB and less and overtook
  /// it at 32-64 KiB (quiet machine; 256 KiB under load): the default sits at that crossover.
  std::uint64_t direct_min_bytes = 64 * 1024;
  /// No message carries more (a longer run is cut, a packed message closes): keeps every
  /// count under MPI's 2 GiB limit and lets the receiver unpack one packed message while the
  /// sender packs the next (1 MiB messages beat one 16 MiB pack in 9 of 11 cases, up to 1.7x;
  /// 1 MiB runs moved within 7 % of 4 MiB runs).
  std::uint64_t max_message_bytes = 1024 * 1024;
  /// A packed message whose runs average at least this many bytes is marked `gather`: a
  /// gathering_communicator (the MPI adapter: MPI_Type_create_hindexed) moves it without
  /// packing on either side, since derived datatypes beat packing from 1 KiB runs on (1.9x
  /// at 4 KiB, 2.3x at 8 KiB; no faster below). Such a message carries one checksum per run,
  /// so neither side needs its bytes contiguous. 0: never.
  std::uint64_t gather_min_average_bytes = 1024;
};

/// One message of a group: a single run sent tensor to tensor (`packed` false), or several
/// runs packed one after the other in this order (`packed` true).
struct partition_message {
  std::vector<region_transfer> runs;
  std::uint64_t bytes = 0;
  bool packed = false;
  bool gather = false;  ///< packed, runs long enough to gather (options), one checksum per run
  /// How many checksums the message carries: one per run when gathered, else one.
  std::size_t sum_count() const noexcept { return gather ? runs.size() : 1; }
};

/// What one source sends one clone rank of one layer, as messages (direct ones first, in
/// tensor and global byte order, then the packed ones).
/// A forwarded group (partition_sharing::exchange) is what clone rank `source` forwards
/// clone rank `clone`: its runs' `source_offset`s lie in the forwarding clone rank's tensors.
struct partition_group {
  std::uint32_t layer = 0, source = 0, clone = 0;
  std::vector<partition_message> messages;
  std::uint64_t bytes = 0;
  bool forwarded = false;  ///< from clone rank `source`, not from a source
};

class partition_groups {
 public:
  /// Groups by layer ascending (the clone's forward order), then source, then clone rank.
  const std::vector<partition_group>& groups() const noexcept { return groups_; }
  /// Indices into groups() that source `s` sends / clone rank `c` receives, in that order.
  std::span<const std::uint32_t> sent_by_source(std::uint32_t s) const { return by_source_.at(s); }
  std::span<const std::uint32_t> received_by_clone(std::uint32_t c) const { return by_clone_.at(c); }
  std::uint64_t bytes_sent_by_source(std::uint32_t s) const { return source_bytes_.at(s); }
  std::uint64_t bytes_received_by_clone(std::uint32_t c) const { return clone_bytes_.at(c); }
  std::uint64_t messages_sent_by_source(std::uint32_t s) const {
    std::uint64_t n = 0;
    for (auto g : by_source_.at(s)) n += groups_[g].messages.size();
    return n;
  }
  /// The plan's forwards between clone ranks (partition_sharing::exchange), grouped alike
  /// per (layer, forwarding clone rank, receiving clone rank); indices into forwards() that
  /// clone rank `c` forwards / receives forwarded.
  const std::vector<partition_group>& forwards() const noexcept { return forwards_; }
  std::span<const std::uint32_t> forwarded_by_clone(std::uint32_t c) const { return forwarded_by_.at(c); }
  std::span<const std::uint32_t> forwarded_to_clone(std::uint32_t c) const { return forwarded_to_.at(c); }
  std::uint64_t bytes_forwarded_by_clone(std::uint32_t c) const {
    std::uint64_t n = 0;
    for (auto g : forwarded_by_.at(c)) n += forwards_[g].bytes;
    return n;
  }
  friend partition_groups make_partition_groups(const partition_plan&, std::uint32_t, std::uint32_t,
                                                const partition_group_options&);

 private:
  std::vector<partition_group> groups_, forwards_;
  std::vector<std::vector<std::uint32_t>> by_source_, by_clone_, forwarded_by_, forwarded_to_;
  std::vector<std::uint64_t> source_bytes_, clone_bytes_;
};

namespace detail {

/// The runs of one group as messages: long runs alone (cut at the message limit), short
/// runs packed up to the limit. A lone short run is sent alone: packing it would only copy.
inline std::vector<partition_message> group_messages(const std::vector<region_transfer>& runs,
                                                     const partition_group_options& opt) {
  std::vector<partition_message> direct, packed;
  for (const auto& r : runs) {
    if (r.length < opt.direct_min_bytes && r.length <= opt.max_message_bytes) {
      if (packed.empty() || packed.back().bytes + r.length > opt.max_message_bytes) packed.push_back({{}, 0, true});
      packed.back().runs.push_back(r);
      packed.back().bytes += r.length;
      continue;
    }
    for (std::uint64_t at = 0; at < r.length; at += opt.max_message_bytes) {
      auto cut = r;
      cut.global += at, cut.source_offset += at, cut.clone_offset += at;
      cut.length = std::min(opt.max_message_bytes, r.length - at);
      direct.push_back({{cut}, cut.length, false});
    }
  }
  for (auto& m : packed) {
    m.packed = m.runs.size() > 1;
    m.gather = m.packed && opt.gather_min_average_bytes && m.bytes / m.runs.size() >= opt.gather_min_average_bytes;
  }
  direct.insert(direct.end(), packed.begin(), packed.end());
  return direct;
}

}  // namespace detail

namespace detail {

/// `runs` grouped per (layer, from, to) in that order, each group's runs in (tensor, global
/// byte) order and cut into messages; `add(group)` receives each.
template <class Add>
void group_runs(std::vector<region_transfer> runs, const partition_group_options& opt, bool forwarded, Add add) {
  auto key = [](const region_transfer& r) { return std::tie(r.layer, r.source, r.clone, r.tensor, r.global); };
  std::sort(runs.begin(), runs.end(), [&](const auto& a, const auto& b) { return key(a) < key(b); });
  auto pair = [](const region_transfer& r) { return std::tie(r.layer, r.source, r.clone); };
  for (std::size_t i = 0; i < runs.size();) {
    std::size_t j = i;
    std::uint64_t bytes = 0;
    for (; j < runs.size() && pair(runs[j]) == pair(runs[i]); ++j) bytes += runs[j].length;
    const auto first = runs.begin() + static_cast<std::ptrdiff_t>(i), last = runs.begin() + static_cast<std::ptrdiff_t>(j);
    add(partition_group{runs[i].layer, runs[i].source, runs[i].clone, group_messages({first, last}, opt), bytes, forwarded});
    i = j;
  }
}

/// Refuses a run naming a sender or receiver outside the counts.
inline void check_ends(const std::vector<region_transfer>& runs, std::uint32_t senders, std::uint32_t clones, const char* from) {
  for (const auto& r : runs)
    if (r.source >= senders || r.clone >= clones)
      throw error(errc::invalid_argument, "partition groups: a transfer of tensor " + std::to_string(r.tensor) + " names " + from +
                                              " " + std::to_string(r.source) + " and clone rank " + std::to_string(r.clone) + " of " +
                                              std::to_string(senders) + " and " + std::to_string(clones));
}

}  // namespace detail

/// Groups the plan's transfers for `sources` sources and `clones` clone ranks (and its
/// forwards alike). Throws `errc::invalid_argument` for a transfer naming a source or clone
/// rank outside those counts, or options that could not cut a message (a zero message limit).
inline partition_groups make_partition_groups(const partition_plan& plan, std::uint32_t sources, std::uint32_t clones,
                                              const partition_group_options& opt = {}) {
  if (opt.max_message_bytes == 0) throw error(errc::invalid_argument, "partition groups: max_message_bytes must be above 0");
  detail::check_ends(plan.transfers(), sources, clones, "source");
  detail::check_ends(plan.forwards(), clones, clones, "forwarding clone rank");
  partition_groups out;
  out.by_source_.resize(sources), out.by_clone_.resize(clones), out.forwarded_by_.resize(clones), out.forwarded_to_.resize(clones);
  out.source_bytes_.assign(sources, 0), out.clone_bytes_.assign(clones, 0);
  detail::group_runs(plan.transfers(), opt, false, [&](partition_group&& g) {
    const auto i = static_cast<std::uint32_t>(out.groups_.size());
    out.by_source_[g.source].push_back(i), out.by_clone_[g.clone].push_back(i);
    out.source_bytes_[g.source] += g.bytes, out.clone_bytes_[g.clone] += g.bytes;
    out.groups_.push_back(std::move(g));
  });
  detail::group_runs(plan.forwards(), opt, true, [&](partition_group&& g) {
    const auto i = static_cast<std::uint32_t>(out.forwards_.size());
    out.forwarded_by_[g.source].push_back(i), out.forwarded_to_[g.clone].push_back(i);
    out.forwards_.push_back(std::move(g));
  });
  return out;
}

namespace detail {

/// The bytes of `run` in one side's own tensor, refusing a run that reaches outside it or a
/// tensor index the side does not have: nothing is ever read or written beyond a tensor.
template <class Byte>
std::span<Byte> run_bytes_checked(const layout& global, const region_transfer& r, std::uint64_t offset,
                                  std::span<const std::span<Byte>> tensors, const char* side) {
  auto name = [&] {
    return r.tensor < global.tensor_count() ? tensor_label(global, r.tensor) : "tensor " + std::to_string(r.tensor);
  };
  if (r.tensor >= tensors.size())
    throw error(errc::invalid_argument, std::string(side) + ": " + name() + " is not among its " + std::to_string(tensors.size()) + " tensors");
  const auto size = tensors[r.tensor].size();
  if (offset > size || r.length > size - offset)
    throw error(errc::invalid_argument, std::string(side) + ": " + name() + ": bytes [" + std::to_string(offset) + ", " +
                                            std::to_string(offset + r.length) + ") lie outside its own tensor of " +
                                            std::to_string(size) + " bytes");
  return tensors[r.tensor].subspan(static_cast<std::size_t>(offset), static_cast<std::size_t>(r.length));
}

inline std::uint64_t packed_size(std::span<const region_transfer> runs) {
  std::uint64_t n = 0;
  for (const auto& r : runs) n += r.length;
  return n;
}

}  // namespace detail

/// The source's own bytes of a direct run (what it sends as they are), bounds-checked.
/// `tensors[t]` is the source's own tensor t (flat index of the global layout).
inline std::span<const std::byte> source_run(const layout& global, const region_transfer& r,
                                             std::span<const std::span<const std::byte>> tensors) {
  return detail::run_bytes_checked<const std::byte>(global, r, r.source_offset, tensors, "source");
}
/// The clone rank's own bytes a direct run is received into, bounds-checked.
inline std::span<std::byte> clone_run(const layout& global, const region_transfer& r, std::span<const std::span<std::byte>> tensors) {
  return detail::run_bytes_checked<std::byte>(global, r, r.clone_offset, tensors, "clone rank");
}

/// Sender: copies `runs` from the source's own tensors into `out`, one after the other.
/// Throws `errc::invalid_argument` naming the tensor and bytes for a run outside its tensor
/// or an `out` of another size than the runs' bytes; nothing is written then.
inline void pack(const layout& global, std::span<const region_transfer> runs,
                 std::span<const std::span<const std::byte>> source_tensors,
                 std::span<std::byte> out) {
  if (out.size() != detail::packed_size(runs))
    throw error(errc::invalid_argument, "pack: a buffer of " + std::to_string(out.size()) + " bytes for runs of " +
                                            std::to_string(detail::packed_size(runs)) + " bytes");
  for (const auto& r : runs) source_run(global, r, source_tensors);  // every run checked before a byte moves
  std::size_t at = 0;
  for (const auto& r : runs) {
    const auto from = source_run(global, r, source_tensors);
    if (!from.empty()) std::memcpy(out.data() + at, from.data(), from.size());
    at += from.size();
  }
}

/// The runs of a packed message as slices of its packed bytes `packed` (of the message's
/// size: callers allocate or check it), in order.
template <class Byte>
std::vector<std::span<Byte>> packed_runs(const partition_message& m, std::span<Byte> packed) {
  std::vector<std::span<Byte>> out;
  std::size_t at = 0;
  for (const auto& r : m.runs) {
    out.push_back(packed.subspan(at, static_cast<std::size_t>(r.length)));
    at += static_cast<std::size_t>(r.length);
  }
  return out;
}

/// Receiver: copies a packed message `in` into the clone rank's own tensors. Throws like
/// `pack` (a message of another size than the runs is `errc::corrupt_message`); nothing is
/// written then.
inline void unpack(const layout& global, std::span<const region_transfer> runs, std::span<const std::byte> in,
                   std::span<const std::span<std::byte>> clone_tensors) {
  if (in.size() != detail::packed_size(runs))
    throw error(errc::corrupt_message, "unpack: a packed message of " + std::to_string(in.size()) + " bytes for runs of " +
                                           std::to_string(detail::packed_size(runs)) + " bytes");
  for (const auto& r : runs) clone_run(global, r, clone_tensors);
  std::size_t at = 0;
  for (const auto& r : runs) {
    const auto to = clone_run(global, r, clone_tensors);
    if (!to.empty()) std::memcpy(to.data(), in.data() + at, to.size());
    at += to.size();
  }
}

}  // namespace deepclone
