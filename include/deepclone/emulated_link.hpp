#pragma once
/// \file emulated_link.hpp
/// `emulated_link<Comm>`: a communicator decorator that paces every rank's sends and
/// receives to a configured per-rank link bandwidth and latency, so that ranks sharing one
/// machine (threads of the in-process transport, or MPI ranks on one node) behave as if each
/// had its own network link. It is an adapter, like any other communicator: the engine is
/// unchanged.
///
/// The model (`link_model`): every rank has a send side and a receive side (full duplex),
/// each with a timeline. A message of b bytes from rank s to rank r, matched (both its send
/// and its receive posted) at time t, starts (by default, busy-until) at
///     start = max(t, tx_free[s], rx_free[r])
/// occupies both sides for b / B, and completes at
///     done  = start + b / B + latency.
/// With `link_config::backfill` it starts instead at the first time >= t, and after the
/// previous message of the same pair, at which both sides are free for b / B (a gap left
/// between earlier bookings counts). Both the send and the receive request complete no
/// earlier than `done` (and no earlier than the inner transport completes them). Messages
/// between one pair are served in the order they were matched; busy-until also serves a
/// rank's link to all its messages in that order.
/// All ranks of a world share one `link_fabric`, which holds the timelines.
///
///   deepclone::inproc::world w(6);
///   auto fabric = std::make_shared<deepclone::link_fabric<>>(6, deepclone::link_config{1e9, 20us});
///   w.run([&](deepclone::inproc::communicator& c) {
///     deepclone::emulated_link<deepclone::inproc::communicator> link(c, fabric);
///     ... use `link` wherever a communicator is expected ...
///   });
///
/// Matching mirrors the rule every adapter keeps (communicator.hpp): per (sender, receiver,
/// tag), the n-th receive matches the n-th send. Wildcard receives are not supported (the
/// engine never uses them). A bandwidth of 0 and a latency of 0 make the decorator a plain
/// pass-through (the "raw" runs of a benchmark use the same type). Where the inner
/// communicator gathers and scatters (`gathering_communicator`), so does the decorator.
///
/// Standard library only.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "communicator.hpp"
#include "error.hpp"

namespace deepclone {

/// Per-rank link parameters (the same for every rank of a fabric).
struct link_config {
  double bandwidth = 0;                    ///< bytes per second, each direction; 0: unlimited
  std::chrono::nanoseconds latency{0};     ///< added to every message's completion
  /// false: a message starts after everything already booked on its two sides (busy
  /// until). true: in the first gap free on both sides, so a rank that posts a long stream
  /// at once does not hold a receive side idle between its own messages while others wait
  /// behind it (what a real network's concurrent flows avoid). Messages of one pair keep
  /// their order either way.
  bool backfill = false;
  bool unlimited() const noexcept { return bandwidth <= 0 && latency.count() == 0; }
};

namespace detail {
/// One side (send or receive) of one rank's link: the intervals booked on it, disjoint and
/// sorted, adjacent ones merged.
template <class TimePoint, class Duration>
class link_timeline {
 public:
  /// The end of the last booking or mark (the epoch when none).
  TimePoint busy_until() const { return busy_.empty() ? last_ : std::max(last_, std::prev(busy_.end())->second); }
  /// Busy-until without a booking: a message that takes no wire time still moves the side's
  /// "free from" to its start, so later messages do not start before it.
  void mark(TimePoint t) { last_ = std::max(last_, t); }
  /// The earliest t >= from such that [t, t + d) overlaps no booking.
  TimePoint first_gap(TimePoint from, Duration d) const {
    auto it = busy_.upper_bound(from);
    if (it != busy_.begin() && std::prev(it)->second > from) from = std::prev(it)->second;
    for (; it != busy_.end() && it->first < from + d; ++it) from = std::max(from, it->second);
    return from;
  }
  void book(TimePoint start, TimePoint end) {
    auto next = busy_.lower_bound(start);
    if (next != busy_.end() && next->first == end) {
      end = next->second;
      next = busy_.erase(next);
    }
    if (next != busy_.begin() && std::prev(next)->second == start) std::prev(next)->second = end;
    else busy_.emplace(start, end);
  }
  /// Drops bookings that ended before `t` (no later message can start before it).
  void forget_before(TimePoint t) {
    while (busy_.size() > 1 && busy_.begin()->second < t) busy_.erase(busy_.begin());
  }

 private:
  std::map<TimePoint, TimePoint> busy_;
  TimePoint last_{};
};
}  // namespace detail

/// The timelines of a world's links; pure, no clock: callers pass the times.
template <class Clock = std::chrono::steady_clock>
class link_model {
 public:
  using time_point = typename Clock::time_point;
  using duration = typename Clock::duration;

  link_model(int ranks, link_config cfg) : cfg_(cfg), tx_(static_cast<std::size_t>(ranks)), rx_(static_cast<std::size_t>(ranks)) {
    if (ranks <= 0) throw error(errc::invalid_argument, "link_model: needs at least one rank");
    if (cfg.bandwidth < 0) throw error(errc::invalid_argument, "link_model: negative bandwidth");
  }

  /// Time `bytes` take on one link (serialization only, no latency).
  duration wire_time(std::size_t bytes) const {
    if (cfg_.bandwidth <= 0) return duration::zero();
    return std::chrono::duration_cast<duration>(std::chrono::duration<double>(static_cast<double>(bytes) / cfg_.bandwidth));
  }

  /// Reserves the links for a message from `from` to `to` of `bytes`, matched at `ready`;
  /// returns the time it completes.
  time_point schedule(int from, int to, std::size_t bytes, time_point ready) {
    auto& tx = tx_.at(static_cast<std::size_t>(from));
    auto& rx = rx_.at(static_cast<std::size_t>(to));
    const auto latency = std::chrono::duration_cast<duration>(cfg_.latency);
    if (from == to) return ready + latency;  // a message to oneself uses no link
    const auto wire = wire_time(bytes);
    auto& pair_end = pair_end_[{from, to}];
    time_point start = cfg_.backfill ? common_gap(tx, rx, std::max(ready, pair_end), wire)
                                     : std::max({ready, tx.busy_until(), rx.busy_until()});
    if (wire > duration::zero()) {
      tx.book(start, start + wire);
      rx.book(start, start + wire);
    } else {
      tx.mark(start);
      rx.mark(start);
    }
    pair_end = start + wire;
    forget_before(ready);
    return start + wire + latency;
  }

  time_point tx_free(int r) const { return tx_.at(static_cast<std::size_t>(r)).busy_until(); }
  time_point rx_free(int r) const { return rx_.at(static_cast<std::size_t>(r)).busy_until(); }
  const link_config& config() const noexcept { return cfg_; }
  int size() const noexcept { return static_cast<int>(tx_.size()); }

 private:
  using timeline = detail::link_timeline<time_point, duration>;
  /// The first t >= from free for `wire` on both sides.
  static time_point common_gap(const timeline& tx, const timeline& rx, time_point from, duration wire) {
    for (;;) {
      const auto a = tx.first_gap(from, wire), b = rx.first_gap(a, wire);
      if (a == b) return a;
      from = b;
    }
  }
  /// Bookings that ended well before the newest match time cannot take a message any more
  /// (match times from different threads arrive a little out of order: keep a second).
  void forget_before(time_point ready) {
    horizon_ = std::max(horizon_, ready);
    if (++calls_ % 256) return;
    for (auto& t : tx_) t.forget_before(horizon_ - std::chrono::seconds(1));
    for (auto& t : rx_) t.forget_before(horizon_ - std::chrono::seconds(1));
  }

  link_config cfg_;
  std::vector<timeline> tx_, rx_;
  std::map<std::pair<int, int>, time_point> pair_end_;
  time_point horizon_{};
  std::uint64_t calls_ = 0;
};

namespace detail {
template <class Clock>
struct link_slot {
  using time_point = typename Clock::time_point;
  bool is_send = false;
  int from = 0, to = 0, tag = 0;
  std::size_t bytes = 0;                 ///< send size (receives: buffer size until matched)
  std::optional<time_point> done;        ///< set once matched
  /// The other side, once matched. Weak: each side is owned by its request, and two
  /// owning pointers would keep every matched pair alive forever.
  std::weak_ptr<link_slot> partner;
  bool finished = false;                 ///< reported complete or cancelled by its owner
};
}  // namespace detail

/// State shared by every rank of one world: the link model plus the matching queues that
/// tell each receive which send it pairs with. Thread-safe.
template <class Clock = std::chrono::steady_clock>
class link_fabric {
 public:
  using time_point = typename Clock::time_point;
  using slot = detail::link_slot<Clock>;
  using slot_ptr = std::shared_ptr<slot>;

  link_fabric(int ranks, link_config cfg) : model_(ranks, cfg), deadlines_(static_cast<std::size_t>(ranks)) {}

  const link_config& config() const noexcept { return model_.config(); }
  bool unlimited() const noexcept { return model_.config().unlimited(); }
  int size() const noexcept { return model_.size(); }

  /// Records a posted send (from -> to) or receive (to <- from) and matches it with the
  /// oldest unmatched opposite side of the same (from, to, tag).
  slot_ptr post(bool is_send, int from, int to, int tag, std::size_t bytes, time_point now) {
    auto s = std::make_shared<slot>();
    s->is_send = is_send;
    s->from = from;
    s->to = to;
    s->tag = tag;
    s->bytes = bytes;
    std::lock_guard lk(m_);
    auto k = std::make_tuple(from, to, tag);
    auto& other = is_send ? recvs_[k] : sends_[k];
    if (other.empty()) {
      (is_send ? sends_[k] : recvs_[k]).push_back(s);
    } else {
      auto o = other.front();
      other.pop_front();
      match(is_send ? s : o, is_send ? o : s, now);
    }
    return s;
  }

  /// The completion time of `s`, if matched.
  std::optional<time_point> done(const slot_ptr& s) {
    std::lock_guard lk(m_);
    return s->done;
  }

  /// The owner of `s` saw it complete (or cancelled it): forget its deadline. If it was
  /// cancelled before being matched, it leaves the matching queue; if it was matched but
  /// the partner still waits, the partner is put back at the head of its queue (as the
  /// transport itself does with a cancelled, matched-but-uncopied message).
  void finish(const slot_ptr& s, bool cancelled) {
    std::lock_guard lk(m_);
    if (s->finished) return;
    s->finished = true;
    int owner = s->is_send ? s->from : s->to;
    if (s->done) erase_deadline(owner, *s->done);
    if (!cancelled) return;
    auto k = std::make_tuple(s->from, s->to, s->tag);
    if (!s->done) {
      auto& q = s->is_send ? sends_[k] : recvs_[k];
      if (auto it = std::find(q.begin(), q.end(), s); it != q.end()) q.erase(it);
      return;
    }
    if (auto p = s->partner.lock(); p && !p->finished) {
      int powner = p->is_send ? p->from : p->to;
      erase_deadline(powner, *p->done);
      p->done.reset();
      p->partner.reset();
      (p->is_send ? sends_[k] : recvs_[k]).push_front(p);
    }
    s->partner.reset();
  }

  /// The earliest deadline of `rank` later than `now`, if any (so an idle rank wakes up
  /// when one of its messages completes).
  std::optional<time_point> next_deadline(int rank, time_point now) {
    std::lock_guard lk(m_);
    auto& d = deadlines_[static_cast<std::size_t>(rank)];
    auto it = d.upper_bound(now);
    if (it == d.end()) return std::nullopt;
    return *it;
  }

  /// The underlying model (tests inspect timelines through it).
  link_model<Clock> model() {
    std::lock_guard lk(m_);
    return model_;
  }

 private:
  void match(const slot_ptr& send, const slot_ptr& recv, time_point now) {
    send->partner = recv;
    recv->partner = send;
    recv->bytes = send->bytes;
    auto t = model_.schedule(send->from, send->to, send->bytes, now);
    send->done = recv->done = t;
    deadlines_[static_cast<std::size_t>(send->from)].insert(t);
    deadlines_[static_cast<std::size_t>(recv->to)].insert(t);
  }
  void erase_deadline(int rank, time_point t) {
    auto& d = deadlines_[static_cast<std::size_t>(rank)];
    if (auto it = d.find(t); it != d.end()) d.erase(it);
  }

  std::mutex m_;
  link_model<Clock> model_;
  std::map<std::tuple<int, int, int>, std::deque<slot_ptr>> sends_, recvs_;
  std::vector<std::multiset<time_point>> deadlines_;
};

/// The decorator. Models point_to_point_communicator, plus tag_bounded_communicator and
/// waitable_communicator where `Comm` does. Cheap to copy (copies share the fabric).
///
/// `Fabric` holds the shared timelines; `link_fabric` (the default) lives in one process,
/// for the threads of the in-process transport. Ranks in separate processes (MPI ranks
/// on one node) need a fabric they all see, e.g. one in shared memory (the benchmark's
/// `bench/shm_fabric.hpp`). A fabric provides: `slot_ptr` (a handle testable as bool),
/// `post(is_send, from, to, tag, bytes, now) -> slot_ptr`, `done(slot) ->
/// optional<time_point>`, `finish(slot, cancelled)`, `unlimited()`, `size()`, and, for a
/// waitable `Comm`, `next_deadline(rank, now)`; the semantics of `link_fabric`'s members.
template <point_to_point_communicator Comm, class Clock = std::chrono::steady_clock, class Fabric = link_fabric<Clock>>
class emulated_link {
 public:
  using inner_type = Comm;
  using fabric_type = Fabric;
  using time_point = typename Clock::time_point;

  struct request_type {
    typename Comm::request_type inner{};
    typename Fabric::slot_ptr slot{};
    std::optional<std::size_t> got;  ///< the inner transport's completion, once seen
    bool reported = false;
  };

  emulated_link(Comm inner, std::shared_ptr<fabric_type> fabric) : inner_(std::move(inner)), fabric_(std::move(fabric)) {
    if (!fabric_) throw error(errc::invalid_argument, "emulated_link: no fabric");
    if (fabric_->size() != inner_.size())
      throw error(errc::invalid_argument, "emulated_link: the fabric has " + std::to_string(fabric_->size()) +
                                              " ranks, the communicator " + std::to_string(inner_.size()));
  }

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  int max_tag() const { return detail::max_tag_of(inner_); }
  Comm& inner() noexcept { return inner_; }
  const std::shared_ptr<fabric_type>& fabric() const noexcept { return fabric_; }

  request_type isend(int dest, int tag, std::span<const std::byte> data) {
    return paced(true, rank(), dest, tag, data.size(), [&] { return inner_.isend(dest, tag, data); });
  }
  request_type irecv(int source, int tag, std::span<std::byte> buffer) {
    return paced(false, source, rank(), tag, buffer.size(), [&] { return inner_.irecv(source, tag, buffer); });
  }

  std::optional<std::size_t> test(request_type& r) {
    if (!r.got) r.got = inner_.test(r.inner);
    if (!r.got) return std::nullopt;
    if (!r.slot || r.reported) return r.got;
    auto d = fabric_->done(r.slot);
    // An unmatched send the transport completed was buffered (eager): it is done locally.
    if (d && Clock::now() < *d) return std::nullopt;
    r.reported = true;
    fabric_->finish(r.slot, false);
    return r.got;
  }

  std::size_t wait(request_type& r) {
    if (!r.got) r.got = inner_.wait(r.inner);
    for (;;) {
      if (auto n = test(r)) return *n;
      auto d = fabric_->done(r.slot);
      if (!d) continue;
      if constexpr (std::is_same_v<Clock, std::chrono::steady_clock>) std::this_thread::sleep_until(*d);
      else std::this_thread::yield();
    }
  }

  void cancel(request_type& r) {
    if (!r.got) {
      inner_.cancel(r.inner);
      // A request the transport completed before the cancel took effect stays complete.
      r.got = std::size_t{0};
    }
    if (r.slot && !r.reported) {
      r.reported = true;
      fabric_->finish(r.slot, true);
    }
  }

  // --- gathering_communicator, where the inner one is: the ranges travel as one message of
  // their total size, paced as such (the partitioned transfer's gathered messages keep
  // their zero-copy path under emulation) ---
  request_type isend_gather(int dest, int tag, std::span<const std::span<const std::byte>> out)
    requires gathering_communicator<Comm>
  {
    return paced(true, rank(), dest, tag, total_bytes(out), [&] { return inner_.isend_gather(dest, tag, out); });
  }
  request_type irecv_scatter(int source, int tag, std::span<const std::span<std::byte>> in)
    requires gathering_communicator<Comm>
  {
    return paced(false, source, rank(), tag, total_bytes(in), [&] { return inner_.irecv_scatter(source, tag, in); });
  }

  // --- waitable_communicator, where the inner one is ---
  std::uint64_t activity()
    requires waitable_communicator<Comm>
  {
    return inner_.activity();
  }
  void wait_activity(std::uint64_t seen, std::chrono::microseconds d)
    requires waitable_communicator<Comm>
  {
    if (!fabric_->unlimited()) {
      auto now = Clock::now();
      if (auto next = fabric_->next_deadline(rank(), now)) {
        auto left = std::chrono::duration_cast<std::chrono::microseconds>(*next - now) + std::chrono::microseconds(1);
        d = std::min(d, left);
      }
    }
    inner_.wait_activity(seen, d);
  }

 private:
  /// A message of `bytes` from `from` to `to`, booked on the fabric (unless unlimited), then
  /// posted on the inner communicator by `post`.
  template <class Post>
  request_type paced(bool is_send, int from, int to, int tag, std::size_t bytes, Post post) {
    request_type r;
    if (!fabric_->unlimited()) r.slot = fabric_->post(is_send, from, to, tag, bytes, Clock::now());
    r.inner = post();
    return r;
  }
  template <class Range>
  static std::size_t total_bytes(std::span<const Range> ranges) {
    std::size_t n = 0;
    for (const auto& r : ranges) n += r.size();
    return n;
  }

  Comm inner_;
  std::shared_ptr<fabric_type> fabric_;
};

}  // namespace deepclone
