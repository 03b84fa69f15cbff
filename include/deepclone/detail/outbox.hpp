#pragma once
/// \file detail/outbox.hpp
/// Outstanding non-blocking requests of one engine, with the buffers they read from or
/// write into when the engine owns them (headers, control messages). One place that
/// tests, waits with a deadline, and cancels, so that no request outlives its buffer.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "../communicator.hpp"
#include "../error.hpp"

namespace deepclone::detail {

using clock = std::chrono::steady_clock;

inline double seconds_since(clock::time_point t0, clock::time_point t1 = clock::now()) {
  return std::chrono::duration<double>(t1 - t0).count();
}

/// True for a transport whose `cancel` always withdraws a pending send, so that its buffer
/// is free once `cancel` returns (the communicator declares `static constexpr bool
/// withdraws_sends = true`, as inproc's does). Open MPI's ob1 never withdraws a send.
template <class Comm>
inline constexpr bool withdraws_sends = requires { requires Comm::withdraws_sends; };

/// Buffers of sends that were cancelled while pending on a transport that may not withdraw
/// them: the transport reads such a buffer whenever the receiver posts a matching receive,
/// possibly after the engine that sent it is gone, so the buffer lives as long as the
/// process. Only failed or withdrawn sessions leave any: their headers, control messages,
/// metadata and (staged, spill pipelines) staging ring or spill buffer.
class retained_buffers {
 public:
  static retained_buffers& get() {
    static retained_buffers r;
    return r;
  }
  void keep(std::vector<std::byte>&& b) {
    if (b.empty()) return;
    std::lock_guard lock(m_);
    bytes_ += b.size();
    kept_.push_back(std::move(b));
  }
  std::size_t bytes() {
    std::lock_guard lock(m_);
    return bytes_;
  }

 private:
  std::mutex m_;
  std::vector<std::vector<std::byte>> kept_;
  std::size_t bytes_ = 0;
};
/// Bytes kept alive so far by `retained_buffers` (the cost of sends a transport could not withdraw).
inline std::size_t retained_send_bytes() { return retained_buffers::get().bytes(); }

template <class Comm>
class outbox {
 public:
  using request = typename Comm::request_type;

  /// Zero-copy send: `data` must stay valid until the request completes or is cancelled.
  std::size_t send(Comm& c, int dest, int tag, std::span<const std::byte> data) {
    entries_.push_back({c.isend(dest, tag, data), {}, false});
    ++pending_;
    return entries_.size() - 1;
  }
  /// Send of a buffer the outbox keeps alive until completion.
  std::size_t send_owned(Comm& c, int dest, int tag, std::vector<std::byte> data) {
    entry e{request{}, std::move(data), false};
    e.req = c.isend(dest, tag, std::span<const std::byte>(e.buffer));
    entries_.push_back(std::move(e));
    ++pending_;
    return entries_.size() - 1;
  }

  bool done(Comm& c, std::size_t i) {
    auto& e = entries_[i];
    if (e.done) return true;
    bool finished = false;
    try {
      finished = c.test(e.req).has_value();
    } catch (const error&) {  // the transport failed this send (e.g. the receiver's buffer was
      finished = true;        // too small): it is over; the receiving side reports the error
      ++failed_;
    }
    if (finished) {
      e.done = true;
      --pending_;
    }
    return e.done;
  }
  /// Sends the transport reported as failed (counted as done).
  std::size_t failed() const noexcept { return failed_; }
  /// Tests every pending request; true if any completed.
  bool poll(Comm& c) {
    bool any = false;
    for (std::size_t i = 0; i < entries_.size(); ++i)
      if (!entries_[i].done && done(c, i)) any = true;
    return any;
  }
  bool all_done(Comm& c) {
    if (pending_) poll(c);
    return pending_ == 0;
  }
  std::size_t pending() const noexcept { return pending_; }
  std::size_t size() const noexcept { return entries_.size(); }

  /// Waits until every request in `which` completes, or nothing completes for `timeout`.
  template <class Indices>
  bool wait(Comm& c, const Indices& which, std::chrono::nanoseconds timeout) {
    idler<Comm> idle(c);
    auto deadline = clock::now() + timeout;
    for (;;) {
      idle.mark();
      bool all = true, any = false;
      for (auto i : which) {
        if (entries_[i].done) continue;
        if (done(c, i)) any = true;
        else all = false;
      }
      if (all) return true;
      if (any) deadline = clock::now() + timeout;
      if (clock::now() >= deadline) return false;
      idle.idle(deadline);
    }
  }
  bool wait_all(Comm& c, std::chrono::nanoseconds timeout) {
    std::vector<std::size_t> all(entries_.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    return wait(c, all, timeout);
  }

  /// Cancels every pending request. Owned buffers of sends the transport may still read are
  /// kept alive (`retained_buffers`); true if such a send was pending, so that the caller
  /// keeps the buffers of its zero-copy sends alive too.
  bool cancel_all(Comm& c) noexcept {
    bool unwithdrawn = false;
    for (auto& e : entries_)
      if (!e.done) {
        std::optional<std::size_t> n;
        try {
          c.cancel(e.req);
          n = c.test(e.req);  // the byte count if it completed after all, 0 if withdrawn
        } catch (...) {
        }
        e.done = true;
        if (!withdraws_sends<Comm> && !(n && *n > 0)) {
          unwithdrawn = true;
          try { retained_buffers::get().keep(std::move(e.buffer)); } catch (...) {}  // bad_alloc: nothing better to do
        }
      }
    pending_ = 0;
    return unwithdrawn;
  }
  void clear(Comm& c) noexcept {
    cancel_all(c);
    entries_.clear();
  }
  /// Drops completed entries from the front (keeps indices of the rest stable only when
  /// called with no outstanding index kept elsewhere).
  void compact() {
    if (pending_ == 0) entries_.clear();
  }

 private:
  struct entry {
    request req;
    std::vector<std::byte> buffer;
    bool done;
  };
  std::vector<entry> entries_;
  std::size_t pending_ = 0;
  std::size_t failed_ = 0;
};

/// A posted receive into an owned buffer (control messages), re-postable.
template <class Comm>
class inbox_slot {
 public:
  void post(Comm& c, int src, int tag, std::size_t bytes) {
    src_ = src;
    tag_ = tag;
    buffer_.assign(bytes, std::byte{0});
    req_ = c.irecv(src, tag, std::span<std::byte>(buffer_));
    posted_ = true;
    received_ = 0;
  }
  /// Posts the receive again, from the same peer with the same tag and size.
  void repost(Comm& c) { post(c, src_, tag_, buffer_.size()); }
  /// The received bytes once complete, else an empty optional. A receive the transport
  /// failed (a peer's message larger than the buffer, say) completes with no bytes, which
  /// no decoder accepts: a peer's garbage is dropped here, never thrown at the caller.
  std::optional<std::span<const std::byte>> test(Comm& c) noexcept {
    if (!posted_) return std::nullopt;
    try {
      auto n = c.test(req_);
      if (!n) return std::nullopt;
      received_ = *n;
    } catch (...) {
      received_ = 0;
    }
    posted_ = false;
    return std::span<const std::byte>(buffer_.data(), received_);
  }
  bool posted() const noexcept { return posted_; }
  void cancel(Comm& c) noexcept { (void)withdraw(c); }
  /// Cancels the receive; if a message had already arrived (a cancel cannot undo a
  /// receive that matched), returns its bytes so the caller can still act on it. Control
  /// messages are never empty, so a completion of 0 bytes means "cancelled".
  std::optional<std::span<const std::byte>> withdraw(Comm& c) noexcept {
    if (!posted_) return std::nullopt;
    posted_ = false;
    try {
      c.cancel(req_);
      if (auto n = c.test(req_); n && *n > 0) {
        received_ = *n;
        return std::span<const std::byte>(buffer_.data(), *n);
      }
    } catch (...) {
    }
    return std::nullopt;
  }

 private:
  typename Comm::request_type req_{};
  std::vector<std::byte> buffer_;
  int src_ = 0, tag_ = 0;
  bool posted_ = false;
  std::size_t received_ = 0;
};

/// The control message of type `M` that `slot` received, if one arrived that names
/// `session`; garbage (undecodable, failed seal) and stale messages of older sessions are
/// dropped and the receive posted again.
template <class M, class Comm>
std::optional<M> take_control(Comm& c, inbox_slot<Comm>& slot, std::uint64_t session) {
  auto b = slot.test(c);
  if (!b) return std::nullopt;
  std::optional<M> m;
  try {
    m = M::decode(*b);
  } catch (const error&) {
  }
  if (m && m->session == session) return m;
  slot.repost(c);
  return std::nullopt;
}

}  // namespace deepclone::detail
