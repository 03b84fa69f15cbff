#pragma once
/// \file inproc.hpp
/// The in-process transport, deepclone's embedded default: K ranks as threads of one
/// process, each with its own communicator object. Ranks exchange real messages (a rank
/// never reads another rank's memory except through a matched send/receive), so the same
/// engine code runs here and over MPI.
///
/// Semantics follow MPI's rendezvous protocol for large messages: `isend` only announces
/// the buffer; the *receiving* rank copies the bytes when it next makes progress
/// (test/wait/cancel), and the send completes then. So a send from live tensors costs the
/// sender nothing, and a sender that must reuse its buffer waits for the receiver, exactly
/// the "window" a source engine has to respect on a real network. Messages of at most
/// `eager_limit` bytes are copied at send time and complete at once, as MPI's eager
/// protocol does for small messages.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "communicator.hpp"
#include "error.hpp"

namespace deepclone::inproc {

namespace detail {

enum : int { pending = 0, copying = 1, done = 2, cancelled = 3, truncated = 4 };

struct op {
  bool is_send;
  int owner;  ///< rank that posted it
  int peer;   ///< destination (send) or source (receive)
  int tag;
  const std::byte* from = nullptr;  ///< send buffer
  std::byte* to = nullptr;          ///< receive buffer
  std::size_t size = 0;
  std::size_t received = 0;
  std::vector<std::byte> eager;  ///< small sends are copied at once (MPI's eager protocol)
  std::atomic<int> status{pending};
};
using op_ptr = std::shared_ptr<op>;
using key = std::pair<int, int>;  // (sender, tag)

struct mailbox {
  std::mutex m;
  std::condition_variable cv;
  std::uint64_t activity = 0;             ///< bumped on every event for this rank
  std::map<key, std::deque<op_ptr>> sends;  ///< announced, unmatched sends to this rank
  std::map<key, std::deque<op_ptr>> recvs;  ///< posted, unmatched receives of this rank
  std::deque<std::pair<op_ptr, op_ptr>> matched;  ///< (send, receive) pairs to copy
};

struct hub {
  explicit hub(int n) : boxes(static_cast<std::size_t>(n)), size(n) {}
  std::vector<mailbox> boxes;
  int size;
  // whole-world collectives
  std::mutex cm;
  std::condition_variable ccv;
  int arrived = 0;
  std::uint64_t generation = 0;
  std::vector<double> accum, result;
};

inline void bump(mailbox& b) {
  ++b.activity;
  b.cv.notify_all();
}

inline bool erase_op(std::deque<op_ptr>& q, const op_ptr& o) {
  auto it = std::find(q.begin(), q.end(), o);
  if (it == q.end()) return false;
  q.erase(it);
  return true;
}

}  // namespace detail

/// One rank's endpoint. Cheap to copy; all copies of a rank share its mailbox.
class communicator {
 public:
  /// A pending send or receive. Destroying an incomplete request does not cancel it:
  /// call `cancel` (the engines always do) before its buffer goes away.
  struct request_type {
    detail::op_ptr op;
  };

  communicator(std::shared_ptr<detail::hub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return hub_->size; }
  int max_tag() const noexcept { return INT_MAX; }

  static constexpr std::size_t eager_limit = 4096;
  /// `cancel` always withdraws a pending send: its buffer is free once `cancel` returns
  /// (communicator contract, point 7).
  static constexpr bool withdraws_sends = true;

  request_type isend(int dest, int tag, std::span<const std::byte> data) {
    check_peer(dest, "isend");
    auto o = std::make_shared<detail::op>();
    o->is_send = true;
    o->owner = rank_;
    o->peer = dest;
    o->tag = tag;
    o->size = data.size();
    if (data.size() <= eager_limit) {
      o->eager.assign(data.begin(), data.end());
      o->from = o->eager.data();
      o->received = o->size;
      o->status = detail::done;
    } else {
      o->from = data.data();
    }
    auto& box = hub_->boxes[static_cast<std::size_t>(dest)];
    {
      std::lock_guard lk(box.m);
      auto& q = box.recvs[{rank_, tag}];
      if (!q.empty()) {
        box.matched.emplace_back(o, q.front());
        q.pop_front();
      } else {
        box.sends[{rank_, tag}].push_back(o);
      }
      detail::bump(box);
    }
    return {o};
  }

  request_type irecv(int source, int tag, std::span<std::byte> buffer) {
    check_peer(source, "irecv");
    auto o = std::make_shared<detail::op>();
    o->is_send = false;
    o->owner = rank_;
    o->peer = source;
    o->tag = tag;
    o->to = buffer.data();
    o->size = buffer.size();
    auto& box = own();
    {
      std::lock_guard lk(box.m);
      auto& q = box.sends[{source, tag}];
      if (!q.empty()) {
        box.matched.emplace_back(q.front(), o);
        q.pop_front();
      } else {
        box.recvs[{source, tag}].push_back(o);
      }
    }
    return {o};
  }

  /// Completes matched receives of this rank (the copies happen here), then reports
  /// whether `r` is complete and with how many bytes.
  std::optional<std::size_t> test(request_type& r) {
    progress();
    return finished(r);
  }

  std::size_t wait(request_type& r) {
    for (;;) {
      if (auto n = test(r)) return *n;
      auto& box = own();
      std::unique_lock lk(box.m);
      box.cv.wait(lk, [&] {
        return !box.matched.empty() || r.op->status.load() >= detail::done;
      });
    }
  }

  /// Withdraws `r`. A send whose bytes are being copied right now is waited for, so that
  /// after cancel returns the buffer is never touched again.
  void cancel(request_type& r) {
    auto& o = r.op;
    if (!o || o->status.load() >= detail::done) return;
    auto& box = hub_->boxes[static_cast<std::size_t>(o->is_send ? o->peer : o->owner)];
    {
      std::lock_guard lk(box.m);
      detail::key k = o->is_send ? detail::key{o->owner, o->tag} : detail::key{o->peer, o->tag};
      if (detail::erase_op(o->is_send ? box.sends[k] : box.recvs[k], o)) {
        o->status = detail::cancelled;
        return;
      }
      auto it = std::find_if(box.matched.begin(), box.matched.end(),
                             [&](auto& p) { return (o->is_send ? p.first : p.second) == o; });
      if (it != box.matched.end()) {
        // Put the partner back at the head of its queue: it was the oldest.
        if (o->is_send) box.recvs[k].push_front(it->second);
        else box.sends[k].push_front(it->first);
        box.matched.erase(it);
        o->status = detail::cancelled;
        return;
      }
    }
    // Being copied by the receiving rank right now: wait for the copy to finish.
    while (o->status.load() < detail::done) std::this_thread::yield();
  }

  // --- waitable_communicator ---
  std::uint64_t activity() {
    auto& box = own();
    std::lock_guard lk(box.m);
    return box.activity + box.matched.size();
  }
  void wait_activity(std::uint64_t seen, std::chrono::microseconds d) {
    auto& box = own();
    std::unique_lock lk(box.m);
    box.cv.wait_for(lk, d, [&] { return box.activity + box.matched.size() != seen; });
  }

  // --- collective_communicator (whole world) ---
  void barrier() {
    std::vector<double> none;
    allreduce_sum(none);
  }
  void allreduce_sum(std::span<double> v) {
    auto& h = *hub_;
    std::unique_lock lk(h.cm);
    if (h.arrived == 0) h.accum.assign(v.size(), 0.0);
    if (h.accum.size() != v.size()) throw error(errc::invalid_argument, "allreduce_sum: ranks passed different sizes");
    for (std::size_t i = 0; i < v.size(); ++i) h.accum[i] += v[i];
    auto gen = h.generation;
    if (++h.arrived == h.size) {
      h.result = std::move(h.accum);
      h.accum.clear();
      h.arrived = 0;
      ++h.generation;
      h.ccv.notify_all();
    } else {
      h.ccv.wait(lk, [&] { return h.generation != gen; });
    }
    std::copy(h.result.begin(), h.result.end(), v.begin());
  }

 private:
  detail::mailbox& own() { return hub_->boxes[static_cast<std::size_t>(rank_)]; }
  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= hub_->size)
      throw error(errc::invalid_argument, std::string(what) + ": rank " + std::to_string(peer) +
                                              " outside a world of " + std::to_string(hub_->size));
  }

  void progress() {
    auto& box = own();
    std::deque<std::pair<detail::op_ptr, detail::op_ptr>> work;
    {
      std::lock_guard lk(box.m);
      if (box.matched.empty()) return;
      work.swap(box.matched);
      for (auto& [s, r] : work) {
        if (s->status.load() != detail::done) s->status = detail::copying;
        r->status = detail::copying;
      }
    }
    for (auto& [s, r] : work) {
      bool fits = s->size <= r->size;
      if (fits && s->size) std::memcpy(r->to, s->from, s->size);
      r->received = fits ? s->size : 0;
      r->status = fits ? detail::done : detail::truncated;
      if (!s->eager.empty() || s->size == 0) continue;  // eager sends completed when posted
      s->received = s->size;
      auto& sbox = hub_->boxes[static_cast<std::size_t>(s->owner)];
      std::lock_guard lk(sbox.m);
      s->status = fits ? detail::done : detail::truncated;
      detail::bump(sbox);
    }
  }

  std::optional<std::size_t> finished(request_type& r) const {
    switch (r.op->status.load()) {
      case detail::done: return r.op->received;
      case detail::cancelled: return std::size_t{0};
      case detail::truncated:
        throw error(errc::transport, "message from rank " + std::to_string(r.op->is_send ? r.op->owner : r.op->peer) +
                                         " to rank " + std::to_string(r.op->is_send ? r.op->peer : r.op->owner) +
                                         " with tag " + std::to_string(r.op->tag) + " was larger than the receive buffer");
      default: return std::nullopt;
    }
  }

  std::shared_ptr<detail::hub> hub_;
  int rank_;
};

/// K in-process ranks. `run` starts one thread per rank with that rank's communicator,
/// joins them all and rethrows the first exception any rank threw.
class world {
 public:
  explicit world(int size) {
    if (size <= 0) throw error(errc::invalid_argument, "inproc::world needs at least one rank");
    hub_ = std::make_shared<detail::hub>(size);
  }
  int size() const noexcept { return hub_->size; }
  communicator comm(int rank) const {
    if (rank < 0 || rank >= hub_->size) throw error(errc::invalid_argument, "inproc::world: no rank " + std::to_string(rank));
    return communicator(hub_, rank);
  }

  template <class F>
  void run(F&& body) {
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size()));
    for (int r = 0; r < size(); ++r) {
      threads.emplace_back([&, r] {
        try {
          communicator c = comm(r);
          body(c);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

 private:
  std::shared_ptr<detail::hub> hub_;
};

static_assert(point_to_point_communicator<communicator>);
static_assert(waitable_communicator<communicator>);
static_assert(collective_communicator<communicator>);

}  // namespace deepclone::inproc
