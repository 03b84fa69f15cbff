#pragma once
/// \file pipeline.hpp
/// Pipeline policies: when and from where a source sends its bytes of the fork iteration k.
///
/// A pipeline policy is a value in `settings.pipeline` that the source engine calls at four
/// points of a session (all optional except the first two):
///
///   void layer_final(context&, std::size_t l);     // l holds its bytes of k until before_update(l) of k + 1
///   bool may_overwrite(context&, std::size_t l);   // asked in before_update(l) until true (the engine
///                                                  // makes progress in between, within settings.timeout)
///   void fork_iteration_ended(context&);           // k ended: from now on its layers get overwritten
///   void progress(context&);                       // every round of session progress
///
/// and, optionally, `void begin(context&)` (a session starts), `bool pending(context&)` (it
/// holds sends back: the session is not delivered yet), `std::optional<std::span<const
/// std::byte>> bytes_of_k(context&, std::uint32_t piece)` (a copy of piece's bytes of k the
/// policy holds, for refetches; nullopt or absent: the live tensor until its layer is
/// released), `std::uint64_t reserve(
/// std::uint64_t bytes_of_source)` (host memory the engine allocates, touches and keeps for
/// it: `context::memory()`), `std::uint64_t max_piece_bytes() const` (pieces are cut to fit;
/// part of the plan), `bool moves(memory_space) const` (it can send tensors outside host
/// memory) and `std::uint64_t bytes_spilled() const`. The `context` is what the engine
/// offers: this source's pieces of a layer, posting data sends, headers, which sends are
/// done and which layers every clone rank verified. The engine keeps everything else
/// (agreement, refetches, acknowledgements, checksums, deadlines); a pipeline decides only
/// when bytes leave and from where, and when a layer may be overwritten.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "error.hpp"
#include "tensor.hpp"

namespace deepclone::pipeline {

/// What the source engine offers a pipeline policy during a session. Calls that wait or
/// touch a tensor may end the session (a timeout, a resized tensor, a clone's cancel):
/// check `active()` after them and return at once when it is false. The engine checks what
/// a policy passes: a layer, piece or clone index out of range, a piece posted under
/// another layer than its own, or a call after the session ended fails the session (the
/// clone ranks learn why) and throws `errc::invalid_argument`, naming the policy and the
/// rule, out of the hook that called the policy.
class context {
 public:
  /// One of this source's pieces of a layer: its bytes of k in the live tensor and the
  /// clone indices that receive it from this source.
  struct outgoing {
    std::uint32_t piece;
    std::span<const std::byte> live;
    memory_space space;
    std::vector<std::uint32_t> to;
  };
  /// A data send: `bytes` (the piece's bytes of k, wherever they are now) to clone index `to`.
  struct data_send {
    std::size_t layer;
    std::uint32_t piece;
    std::uint32_t to;
    std::span<const std::byte> bytes;
  };
  using request = std::size_t;

  virtual std::size_t layers() const = 0;
  virtual std::uint64_t fork_iteration() const = 0;
  /// Iteration k ended: every layer got layer_final, and layers are overwritten from now on.
  virtual bool fork_iteration_ended() const = 0;
  /// The session is still in flight.
  virtual bool active() const = 0;
  /// This source's share of the state (bytes), e.g. to size a buffer.
  virtual std::uint64_t bytes_of_source() const = 0;
  /// The host memory `reserve()` asked for, allocated and touched when the source was created.
  virtual std::span<std::byte> memory() = 0;

  /// This source's pieces of layer `l` in wire order (empty, and the session ended, when a
  /// tensor of `l` was resized).
  virtual std::vector<outgoing> pieces(std::size_t l) = 0;
  /// Records the checksum of piece's bytes of k (`bytes`: where they are sent from); call
  /// it for every piece before `send_headers`.
  virtual void summed(std::uint32_t piece, std::span<const std::byte> bytes) = 0;
  /// Posts a data send; the bytes must stay unchanged until `done` says so. A clone rank
  /// receives its pieces of a layer in `pieces()` order: post them in that order.
  virtual request post(const data_send& d) = 0;
  /// Sends this source's group headers of layer `l` (piece list and sums).
  virtual void send_headers(std::size_t l) = 0;
  virtual bool done(request r) = 0;
  /// Every data send of layer `l` posted so far completed.
  virtual bool sends_done(std::size_t l) = 0;
  /// Every refetched piece of `l` this source served (from bytes_of_k) completed.
  virtual bool refetches_done(std::size_t l) = 0;
  /// Every clone rank that receives part of layer `l` verified it.
  virtual bool verified(std::size_t l) const = 0;
  /// Clone index `clone` verified layer `l`.
  virtual bool verified_by(std::size_t l, std::uint32_t clone) const = 0;
  /// may_overwrite(l) returned true in this session: `l` no longer holds k.
  virtual bool released(std::size_t l) const = 0;
  /// Every send of the session completed and every clone rank verified every layer.
  virtual bool delivered() = 0;
  /// Makes session progress until `done()` holds; false if the session ended meanwhile
  /// (after settings.timeout without progress, the session fails saying `what`).
  virtual bool wait_until(const std::function<bool()>& done, const std::string& what) = 0;

  /// Sends layer `l` straight from the live tensors: every piece to each clone index that
  /// receives it, then the headers.
  void send_layer(std::size_t l) {
    auto ps = pieces(l);
    for (auto& p : ps) {
      summed(p.piece, p.live);
      for (auto to : p.to) post({l, p.piece, to, p.live});
    }
    if (active()) send_headers(l);
  }
  bool done(const std::vector<request>& rs) {
    return std::all_of(rs.begin(), rs.end(), [&](request r) { return done(r); });
  }

 protected:
  ~context() = default;
};

/// The order in which a pipeline sends bytes of k that are ready at the same time, across
/// layers (within a layer a clone rank receives pieces in `pieces()` order, always).
/// Sources update layers last-first, so in the order layers become final layer 0 leaves
/// last, and the clone's forward pass, which needs layer 0 first, gains nothing from the
/// layers that arrived before it.
enum class send_order : std::uint8_t {
  forward_pass,  ///< lowest layer first: the clone's `wait_layer(0)` returns first
  as_final,      ///< in the order the layers became final (the trainer's update order)
};

/// Send straight from the live tensors right after each layer's update in the fork
/// iteration; wait, if at all, only right before that layer is updated again, until its
/// sends completed and every clone rank verified it (so that a lost piece can still be
/// refetched from here). No extra memory; the source stalls only if a layer's transfer
/// outlasts almost a whole iteration.
struct window {
  static constexpr const char* name = "window";
  void layer_final(context& c, std::size_t l) { c.send_layer(l); }
  bool may_overwrite(context& c, std::size_t l) { return c.refetches_done(l) && c.sends_done(l) && c.verified(l); }
};

/// Stop the world at the end of the fork iteration and send everything before training
/// resumes: the baseline the others are measured against.
struct blocking {
  static constexpr const char* name = "blocking";
  void layer_final(context&, std::size_t) {}  // everything leaves at the end of k
  void fork_iteration_ended(context& c) {
    for (std::size_t l = 0; l < c.layers() && c.active(); ++l) c.send_layer(l);
    c.wait_until([&] { return c.delivered(); }, "the blocking transfer was not delivered and verified within the timeout");
  }
  bool may_overwrite(context& c, std::size_t l) { return c.refetches_done(l) && c.sends_done(l) && c.verified(l); }
};

/// The staged pipeline over a ring that `D` provides: copy this source's pieces of each
/// layer into a bounded staging ring right after the update, then send from there, so the
/// tensor's window closes at once (what device memory needs), at the price of a copy and
/// `staging_bytes` of memory. Pieces are cut to fit. `D` may provide the ring's memory and
/// the copy (`std::span<std::byte> staging(std::size_t)`, `void copy(std::span<std::byte>
/// to, std::span<const std::byte> from, memory_space)`, `bool moves(memory_space) const`:
/// e.g. `cuda::staged_device`, pinned memory and a copy stream); otherwise the ring is the
/// engine's host memory and the copy a memcpy.
template <class D>
struct staged_base {
  std::uint64_t staging_bytes = 64ull << 20;

  std::uint64_t max_piece_bytes() const { return staging_bytes; }
  std::uint64_t reserve(std::uint64_t bytes_of_source) const {
    if constexpr (provides_ring) return 0;
    else return ring_bytes(bytes_of_source);
  }
  void begin(context& c) {
    slots_.clear();
    if constexpr (provides_ring) ring_ = self().staging(static_cast<std::size_t>(ring_bytes(c.bytes_of_source())));
    else ring_ = c.memory();
  }
  void layer_final(context& c, std::size_t l) {
    for (auto& p : c.pieces(l)) {
      auto at = stage(c, p.live, p.space);
      if (!c.active()) return;  // the session failed while waiting for staging space
      c.summed(p.piece, at);
      for (auto to : p.to) slots_.back().reqs.push_back(c.post({l, p.piece, to, at}));
    }
    if (c.active()) c.send_headers(l);
  }
  void progress(context& c) {
    while (!slots_.empty() && c.done(slots_.front().reqs)) slots_.pop_front();
  }
  /// The copies are sent: only a refetch still reads the tensor.
  bool may_overwrite(context& c, std::size_t l) { return c.refetches_done(l); }

 private:
  static constexpr bool provides_ring = requires(D& d, std::size_t n) {
    { d.staging(n) } -> std::same_as<std::span<std::byte>>;
  };
  D& self() { return static_cast<D&>(*this); }
  std::uint64_t ring_bytes(std::uint64_t bytes_of_source) const {
    return std::max<std::uint64_t>(std::min(staging_bytes, bytes_of_source), 1);
  }
  /// Copies `src` into the ring as its newest slot, first waiting for the oldest staged
  /// sends while the ring is full. Returns the staged bytes.
  std::span<const std::byte> stage(context& c, std::span<const std::byte> src, memory_space from) {
    for (;;) {
      if (auto at = place(src.size())) {
        auto to = ring_.subspan(*at, src.size());
        if constexpr (provides_ring) self().copy(to, src, from);
        else if (!src.empty()) std::memcpy(to.data(), src.data(), src.size());
        slots_.push_back({*at, src.size(), {}});
        return to;
      }
      if (!c.wait_until([&] { return slots_.empty() || c.done(slots_.front().reqs); },
                        "staged sends did not complete within the timeout (staging ring full)"))
        return {};
      if (!slots_.empty()) slots_.pop_front();
    }
  }
  /// Where a slot of `len` bytes fits after the newest one (FIFO ring), if anywhere.
  std::optional<std::uint64_t> place(std::uint64_t len) const {
    const std::uint64_t cap = ring_.size();
    if (len > cap) throw error(errc::invalid_argument, "a piece is larger than the staging buffer (plan was cut wrongly)");
    if (slots_.empty()) return 0;
    const auto first = slots_.front().off, end = slots_.back().off + slots_.back().len;
    if (end > first || (end == first && slots_.back().len == 0)) {  // in use: [first, end)
      if (cap - end >= len) return end;
      if (first >= len) return 0;
    } else if (first - end >= len) {  // in use: [first, cap) and [0, end)
      return end;
    }
    return std::nullopt;
  }
  struct slot {
    std::uint64_t off, len;
    std::vector<context::request> reqs;
  };
  std::span<std::byte> ring_;
  std::deque<slot> slots_;
};

/// The staged pipeline with a host ring the engine allocates (see staged_base).
struct staged : staged_base<staged> {
  static constexpr const char* name = "staged";
};

/// Send from the live tensors as `window` does, but never hold the trainer for a slow
/// link. During the fork iteration k, data sends from the tensors are posted at most
/// `inflight_bytes` at a time; once k ended, what is still queued is copied into a spill
/// buffer and posted from there, and a layer that is about to be overwritten while a clone
/// rank has not yet verified it has its owed bytes copied too (refetches are then served
/// from the copies). The source waits only for the sends already on the wire from a tensor
/// (at most `inflight_bytes`). Nothing is copied when the network keeps up. The buffer is
/// this source's share of the state, or `spill_bytes` if less, allocated (and touched) when
/// the source is created; when it is full the source waits for a layer as `window` does.
struct spill {
  static constexpr const char* name = "spill";
  std::uint64_t spill_bytes = std::uint64_t{1} << 40;
  std::uint64_t inflight_bytes = 4ull << 20;
  /// The order of what is still queued when k ends (a layer that became final during k is
  /// sent at once, as far as `inflight_bytes` allows).
  send_order order = send_order::forward_pass;

  std::uint64_t reserve(std::uint64_t bytes_of_source) const { return std::min(spill_bytes, bytes_of_source); }
  /// Bytes copied into the spill buffer so far, over all sessions.
  std::uint64_t bytes_spilled() const noexcept { return bytes_spilled_; }

  void begin(context& c) {
    mem_ = c.memory();
    used_ = 0;
    queued_.clear();
    inflight_.clear();
    inflight_total_ = 0;
    copies_.clear();
    from_tensor_.assign(c.layers(), {});
    decided_.assign(c.layers(), none);
    in_forward_order_ = false;
  }
  void layer_final(context& c, std::size_t l) {
    for (auto& p : c.pieces(l)) {
      c.summed(p.piece, p.live);
      for (auto to : p.to) enqueue({l, p.piece, to, p.live});
    }
    if (!c.active()) return;
    c.send_headers(l);
    post_queued(c);
  }
  void fork_iteration_ended(context& c) { post_queued(c); }
  void progress(context& c) { post_queued(c); }
  bool pending(context&) const { return !queued_.empty(); }
  std::optional<std::span<const std::byte>> bytes_of_k(context&, std::uint32_t piece) const {
    if (auto it = copies_.find(piece); it != copies_.end()) return it->second;
    return std::nullopt;
  }

  /// Before layer `l` is overwritten: copy the pieces a clone rank has not verified yet
  /// (once) and then wait only for the sends already on the wire from the tensor; when
  /// the layer is verified everywhere or the buffer has no room, wait as `window` does.
  bool may_overwrite(context& c, std::size_t l) {
    if (decided_[l] == none) decided_[l] = spill_layer(c, l) ? copied : waits;
    if (!c.active()) return false;  // a resized tensor ended the session
    if (!c.done(from_tensor_[l]) || !c.refetches_done(l)) return false;
    if (decided_[l] == copied) return true;
    return std::none_of(queued_.begin(), queued_.end(), [&](auto& q) { return q.layer == l; }) && c.verified(l);
  }

 private:
  enum decision : std::uint8_t { none, copied, waits };

  /// Posts queued data sends, in order. Sends from a tensor are posted while fewer than
  /// `inflight_bytes` of them are on the wire, so that a layer about to be overwritten
  /// waits for at most that much. Once k ended (its layers are overwritten from now on)
  /// what is still queued is copied to the spill buffer, where it may wait on the wire as
  /// long as the link needs, and posted at once.
  void post_queued(context& c) {
    std::erase_if(inflight_, [&](auto& f) {
      if (!c.done(f.first)) return false;
      inflight_total_ -= f.second;
      return true;
    });
    const bool k_ended = c.fork_iteration_ended();
    if (k_ended) put_in_order();
    while (!queued_.empty()) {
      auto& q = queued_.front();
      if (k_ended && !c.released(q.layer)) {
        if (auto b = copy(c, q.piece, q.bytes)) q.bytes = *b;
      }
      const bool live = !copies_.contains(q.piece);
      if (live && !inflight_.empty() && inflight_total_ + q.bytes.size() > inflight_bytes) break;
      auto r = c.post(q);
      if (live) {  // what must complete before the layer is overwritten
        from_tensor_[q.layer].push_back(r);
        inflight_.emplace_back(r, q.bytes.size());
        inflight_total_ += q.bytes.size();
      }
      queued_.pop_front();
    }
  }
  /// Queues a data send; once the queue is in forward order, at its place in that order.
  void enqueue(const context::data_send& d) {
    if (!in_forward_order_) return queued_.push_back(d);
    auto later = std::upper_bound(queued_.begin(), queued_.end(), d.layer, [](std::size_t l, auto& q) { return l < q.layer; });
    queued_.insert(later, d);
  }
  /// send_order::forward_pass: once k ended, what is queued leaves lowest layer first (a
  /// stable sort: each clone rank still gets a layer's pieces in `pieces()` order).
  void put_in_order() {
    if (order != send_order::forward_pass || in_forward_order_) return;
    std::stable_sort(queued_.begin(), queued_.end(), [](auto& a, auto& b) { return a.layer < b.layer; });
    in_forward_order_ = true;
  }
  /// Copies the pieces of `l` that a clone rank has not yet verified and serves them from
  /// the copies from now on. False, with nothing copied, when the layer is verified
  /// everywhere or the buffer has no room for all of them.
  bool spill_layer(context& c, std::size_t l) {
    if (c.verified(l)) return false;
    std::vector<context::outgoing> owed;
    std::uint64_t bytes = 0;
    for (auto& p : c.pieces(l))
      if (std::any_of(p.to.begin(), p.to.end(), [&](auto to) { return !c.verified_by(l, to); })) {
        if (!copies_.contains(p.piece)) bytes += p.live.size();
        owed.push_back(std::move(p));
      }
    if (!c.active() || used_ + bytes > mem_.size()) return false;
    for (auto& p : owed) copy(c, p.piece, p.live);
    for (auto& q : queued_)  // every queued send goes to a clone rank that has not verified its layer
      if (q.layer == l) q.bytes = copies_.at(q.piece);
    return true;
  }
  /// Piece's bytes of k in the spill buffer (copied from `live` now unless there already);
  /// nullopt when the buffer has no room.
  std::optional<std::span<const std::byte>> copy(context&, std::uint32_t piece, std::span<const std::byte> live) {
    if (auto it = copies_.find(piece); it != copies_.end()) return it->second;
    if (used_ + live.size() > mem_.size()) return std::nullopt;
    auto to = mem_.subspan(used_, live.size());
    if (!live.empty()) std::memcpy(to.data(), live.data(), live.size());
    used_ += live.size();
    bytes_spilled_ += live.size();
    return copies_.emplace(piece, to).first->second;
  }

  std::span<std::byte> mem_;
  std::uint64_t used_ = 0, bytes_spilled_ = 0, inflight_total_ = 0;
  std::deque<context::data_send> queued_;  // data sends not yet posted, in wire order
  std::vector<std::pair<context::request, std::uint64_t>> inflight_;  // posted from a tensor, with their bytes
  std::map<std::uint32_t, std::span<const std::byte>> copies_;         // pieces in the spill buffer
  std::vector<std::vector<context::request>> from_tensor_;             // per layer: posted from the tensor
  std::vector<decision> decided_;                                      // per layer: spilled at before_update?
  bool in_forward_order_ = false;                                      // queued_ is sorted by layer (put_in_order)
};

}  // namespace deepclone::pipeline
