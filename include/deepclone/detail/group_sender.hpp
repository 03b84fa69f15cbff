#pragma once
/// \file detail/group_sender.hpp
/// Sending partitioned groups (partition_groups.hpp) from one rank's own tensors: a direct
/// message straight from the tensor (zero copy), short runs packed into a buffer (reused for
/// a later message once its send completed), or (a `gather` message on a
/// gathering_communicator) handed to the transport as they lie; after each group, a sealed
/// list of its checksums. One place for it: a source sends its groups with it, and a clone
/// rank that shares (partition_sharing::exchange) forwards what it verified with it.
/// Templated on the communicator, the checksum and where the parts live (part_memory.hpp):
/// staged parts leave every message from a host buffer the policy gathered.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <new>
#include <span>
#include <string>
#include <vector>

#include "../communicator.hpp"
#include "../part_memory.hpp"
#include "../partition_groups.hpp"
#include "bytes.hpp"
#include "outbox.hpp"
#include "wire.hpp"

namespace deepclone::detail {

/// How many checksums group `g` carries: one per message, one per run of a gathered one.
inline std::size_t sum_count(const partition_group& g) {
  std::size_t n = 0;
  for (const auto& m : g.messages) n += m.sum_count();
  return n;
}

/// The spans message `m`'s checksums cover, given its bytes laid out contiguously: one per
/// run of a gathered message, else the whole (the rule `sum_count` counts).
template <class Byte>
std::vector<std::span<Byte>> checksummed_parts(const partition_message& m, std::span<Byte> contiguous) {
  return m.gather ? packed_runs(m, contiguous) : std::vector<std::span<Byte>>{contiguous};
}

/// Whether message `m` travels gathered on `Comm` (without packing) from or into parts in
/// `Memory`, or contiguously.
template <class Comm, class Memory = host_memory>
bool gathers(const partition_message& m) {
  return gathering_communicator<Comm> && Memory::host_addressable && m.gather;
}

/// One group's checksums in message order (one per run of a gathered message), naming the
/// group they belong to and the transfer that sent them (partition_route::transfer): a
/// group an earlier transfer on the same tags left queued is told apart by it.
struct partition_sums {
  static constexpr std::uint32_t magic = 0x50534D32;  // "PSM2"
  std::uint32_t layer = 0, source = 0, clone = 0;
  std::uint64_t transfer = 0;
  std::vector<std::uint64_t> sums;
  static std::size_t size_for(std::size_t messages) { return 5 * 4 + 8 + 8 * messages + 8; }
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic), w.u32(layer), w.u32(source), w.u32(clone), w.u64(transfer), w.u32(static_cast<std::uint32_t>(sums.size()));
    for (auto s : sums) w.u64(s);
    return seal(w);
  }
  /// Refuses (errc::corrupt_message) anything but the sums of `g`: another group, another
  /// message count, a broken seal. Sums of a transfer other than `transfer` are returned
  /// as they are (with no sums), whatever their group's shape: the caller drops them.
  static partition_sums decode_for(std::span<const std::byte> b, const partition_group& g, std::uint64_t transfer) {
    reader r(unseal(b, "partition checksums"), "partition checksums");
    if (r.u32() != magic) r.fail("bad magic word");
    partition_sums m;
    m.layer = r.u32(), m.source = r.u32(), m.clone = r.u32(), m.transfer = r.u64();
    if (m.layer != g.layer || m.source != g.source || m.clone != g.clone) r.fail("the sums of another group");
    if (m.transfer != transfer) return m;  // another transfer's: the caller drops it, whatever its shape
    const auto n = sum_count(g);
    if (r.u32() != n) r.fail("a checksum count other than the group's " + std::to_string(n));
    for (std::size_t i = 0; i < n; ++i) m.sums.push_back(r.u64());
    r.expect_end();
    return m;
  }
};

/// The tags of layer `l`: data at tag_base + 2 + 2l, sums one more (check_tags first).
inline int partition_tag(int tag_base, std::uint32_t l, bool sums) { return tag_base + 2 + 2 * static_cast<int>(l) + (sums ? 1 : 0); }

/// Sends groups from one rank's own tensors (`tensors[t]`: its part of global tensor t; the
/// runs' `source_offset`s lie in them) and keeps every send's request, per layer, with the
/// clone rank it goes to, and every buffer a send reads until it completed.
template <class Comm, class Checksum, part_memory Memory = host_memory>
class group_sender {
 public:
  /// `transfer`: the id its sums carry (partition_route::transfer).
  group_sender(Comm& c, const layout& global, int tag_base, std::uint64_t transfer, std::span<const std::span<const std::byte>> tensors)
      : comm_(c), global_(global), tag_base_(tag_base), transfer_(transfer), tensors_(tensors.begin(), tensors.end()),
        requests_(global.layer_count()) {}
  group_sender(const group_sender&) = delete;
  group_sender& operator=(const group_sender&) = delete;

  /// Sends group `g` to rank `to`: every run checked (errc::invalid_argument) and packed
  /// before the first byte leaves, then the messages and the sums on the layer's tags.
  void send(const partition_group& g, int to) {
    const int data = partition_tag(tag_base_, g.layer, false);
    partition_sums sums{g.layer, g.source, g.clone, transfer_, {}};
    std::vector<outgoing> out;
    for (const auto& m : g.messages) out.push_back(prepare(m, sums.sums));  // all checked and packed before any send
    auto& requests = requests_.at(g.layer);
    for (auto& o : out) {
      if (o.packed.empty())
        requests.push_back({post(to, data, o), g.clone});
      else
        post_lent(g, std::move(o.packed), true, [&] { return post(to, data, o); });  // o.bytes stay put
    }
    auto encoded = sums.encode();
    const std::span<const std::byte> sums_bytes(encoded);
    post_lent(g, std::move(encoded), false, [&] { return comm_.isend(to, data + 1, sums_bytes); });
  }
  /// True once every send of layer `l` completed, not counting those to clone ranks
  /// `skip(c)` names (withdrawn).
  template <class Skip>
  bool layer_done(std::uint32_t l, Skip skip) {
    for (auto& r : requests_.at(l))
      if (!comm_.test(r.request) && !skip(r.clone)) return false;
    return true;
  }
  /// Withdraws the pending sends to the clone ranks `to(c)` accepts. Where the transport cannot
  /// withdraw sends (Open MPI: a withdrawn send is only parked, and reads its buffer when a
  /// receive matches it later), their packed buffers outlive the sender (retained_buffers)
  /// and are not reused.
  template <class To>
  void withdraw(To to) noexcept {
    auto clone_of = [&](const lent& b) { return requests_[b.layer][b.request].clone; };
    for (auto& b : lent_) b.pending = to(clone_of(b)) && !completed(requests_[b.layer][b.request].request);
    for (auto& layer : requests_)
      for (auto& r : layer) {
        try {
          if (to(r.clone)) comm_.cancel(r.request);
        } catch (...) {
        }
      }
    if constexpr (!withdraws_sends<Comm>)
      for (auto& b : lent_) {
        if (!b.pending) continue;
        try {
          retained_buffers::get().keep(std::move(b.bytes));
        } catch (...) {  // out of memory: leak the buffer rather than free it under a send
          (void)new (std::nothrow) std::vector<std::byte>(std::move(b.bytes));
        }
        b.bytes = {}, b.pending = false;
      }
  }
  /// Withdraws every pending send (see withdraw) and forgets the buffers.
  void cancel() noexcept {
    withdraw([](std::uint32_t) { return true; });
    lent_.clear();
  }

 private:
  /// A posted send, and the clone rank it goes to.
  struct posted {
    typename Comm::request_type request;
    std::uint32_t clone = 0;
  };
  /// One message ready to go: its bytes (direct or packed), or its runs (gathered).
  struct outgoing {
    std::span<const std::byte> bytes;
    std::vector<std::span<const std::byte>> runs;
    std::vector<std::byte> packed;  ///< the packed copy `bytes` points into, if packed
  };
  /// A buffer a send reads: kept until requests_[layer][request] completes.
  struct lent {
    std::uint32_t layer = 0;
    std::size_t request = 0;
    std::vector<std::byte> bytes;
    bool packed = false;   ///< a packed message's (reused), else a group's sums
    bool pending = false;  ///< still in flight when withdraw() began
  };
  /// Packed buffers kept for reuse once their sends completed: a fresh page costs far more to
  /// touch than a copy into one already mapped (docs/performance.md, "Packed buffers are
  /// reused").
  static constexpr std::size_t max_spare_buffers = 32;

  typename Comm::request_type post(int to, int tag, const outgoing& o) {
    if constexpr (gathering_communicator<Comm>)
      if (!o.runs.empty()) return comm_.isend_gather(to, tag, o.runs);
    return comm_.isend(to, tag, o.bytes);
  }
  /// Posts the send `send()` of a buffer the sender owns: the buffer is in lent_ before the
  /// send reads it (its bytes do not move with it), and leaves again if the send fails.
  template <class Send>
  void post_lent(const partition_group& g, std::vector<std::byte>&& bytes, bool packed, Send send) {
    auto& requests = requests_.at(g.layer);
    lent_.push_back({g.layer, requests.size(), std::move(bytes), packed});
    try {
      requests.push_back({send(), g.clone});
    } catch (...) {
      lent_.pop_back();
      throw;
    }
  }
  /// Checks (and packs, unless it is gathered) message `m`; appends its checksums to `sums`.
  /// Staged parts: every message is gathered into a host buffer by the Memory policy.
  outgoing prepare(const partition_message& m, std::vector<std::uint64_t>& sums) {
    outgoing o;
    if constexpr (!Memory::host_addressable) {
      const auto runs = source_runs(m);  // all bounds-checked before the policy reads one
      o.packed = take_buffer(static_cast<std::size_t>(m.bytes));
      memory_.gather(runs, o.packed);
      o.bytes = o.packed;
    } else if (gathers<Comm>(m)) {
      o.runs = source_runs(m);
    } else if (m.packed) {
      o.packed = take_buffer(static_cast<std::size_t>(m.bytes));
      pack(global_, m.runs, tensors_, o.packed);
      o.bytes = o.packed;
    } else {
      o.bytes = source_run(global_, m.runs.front(), tensors_);
    }
    for (auto p : !o.runs.empty() ? o.runs : checksummed_parts(m, o.bytes)) sums.push_back(Checksum::compute(p));
    return o;
  }
  std::vector<std::span<const std::byte>> source_runs(const partition_message& m) const {
    std::vector<std::span<const std::byte>> out;
    for (const auto& r : m.runs) out.push_back(source_run(global_, r, tensors_));
    return out;
  }
  /// A buffer of `n` bytes: the smallest spare one large enough, else a new one.
  std::vector<std::byte> take_buffer(std::size_t n) {
    recycle();
    auto fit = spare_.end();
    for (auto it = spare_.begin(); it != spare_.end(); ++it)
      if (it->capacity() >= n && (fit == spare_.end() || it->capacity() < fit->capacity())) fit = it;
    if (fit == spare_.end()) return std::vector<std::byte>(n);
    auto b = std::move(*fit);
    spare_.erase(fit);
    b.resize(n);
    return b;
  }
  /// Moves the packed buffers of the oldest sends that completed to the spares (sends
  /// complete roughly in the order posted; one still pending holds back the ones behind it).
  void recycle() {
    while (!lent_.empty() && completed(requests_[lent_.front().layer][lent_.front().request].request)) {
      if (lent_.front().packed && lent_.front().bytes.capacity() > 0 && spare_.size() < max_spare_buffers)
        spare_.push_back(std::move(lent_.front().bytes));
      lent_.pop_front();
    }
  }
  /// Whether send `r` completed; a failed one counts as pending here (wait() reports it).
  bool completed(typename Comm::request_type& r) noexcept {
    try {
      return comm_.test(r).has_value();
    } catch (...) {
      return false;
    }
  }

  Comm& comm_;
  [[no_unique_address]] Memory memory_{};
  const layout& global_;
  int tag_base_;
  std::uint64_t transfer_;
  std::vector<std::span<const std::byte>> tensors_;
  std::vector<std::deque<posted>> requests_;   // per layer
  std::deque<lent> lent_;                     // packed messages and sums, alive until their sends complete
  std::vector<std::vector<std::byte>> spare_;  // buffers of completed sends, for reuse
};

}  // namespace deepclone::detail
