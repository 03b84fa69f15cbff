#pragma once
/// \file fault_injection.hpp
/// A fault-injecting communicator decorator: `faulty<Comm>` wraps any
/// point_to_point_communicator (the in-process one, Boost.MPI, ...) and, driven by a
/// shared, thread-safe `fault::plan`, drops, corrupts, duplicates, delays, reorders or
/// truncates chosen messages, or silences a chosen rank from a chosen moment. Standard
/// library only; for tests and resilience experiments.
///
///   auto faults = std::make_shared<deepclone::fault::plan>();
///   faults->add({.action = deepclone::fault::kind::corrupt, .from = 0, .to = 2,
///                .tag_lo = 1016, .tag_hi = 1016, .first = 1});
///   deepclone::faulty<deepclone::inproc::communicator> comm(inner, faults);  // one per rank
///
/// Faults are applied on the *sending* side, in the sender's wrapper, so every rank that
/// should be subject to the plan must use a `faulty` communicator sharing the same plan.
/// Matching counts messages per rule in the order the sender posts them, so a rule that
/// names its sender is deterministic.
///
/// What each action does to a matching `isend`:
/// - drop: nothing is sent; the sender's request completes at once.
/// - corrupt: a private copy with the chosen bytes XOR-ed with `mask` is sent (the user's
///   buffer is never written).
/// - duplicate: the message is sent, then a second copy of it (the copy is owned by the
///   decorator, progressed and cancelled by it).
/// - delay: the message is held back for `hold`, then posted; the sender's request
///   completes only after that (its buffer stays in use, as with a slow network).
/// - reorder: the message is held until the next message matching the same rule has been
///   posted, then posted right after it (or after `hold`, if no such message comes; a
///   zero `hold` waits forever).
/// - truncate: only the first `keep` bytes are sent (default: half).
/// - silence (see `plan::silence`): from the chosen moment, every send of the rank
///   vanishes (completes at once, never delivered) and none of its receives completes.
///   Messages already handed to the inner transport before that moment may still arrive.
///
/// Held messages live in the sender's wrapper and are released when that rank next calls
/// into the communicator (any call; `wait_activity` sleeps no longer than the next
/// release). A wrapper destroyed while holding messages drops them.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "communicator.hpp"

namespace deepclone {

namespace fault {

enum class kind : int { drop = 0, corrupt, duplicate, delay, reorder, truncate, silence };
inline constexpr int kind_count = 7;
inline const char* kind_name(kind k) {
  static constexpr const char* names[kind_count] = {"drop", "corrupt", "duplicate", "delay", "reorder", "truncate", "silence"};
  const int i = static_cast<int>(k);
  return i >= 0 && i < kind_count ? names[i] : "?";
}

inline constexpr int any = -1;

/// Which messages a rule acts on and what it does to them.
struct rule {
  kind action = kind::drop;
  int from = any, to = any;       ///< sender / receiver rank (in the wrapped communicator), or any
  int tag_lo = any, tag_hi = any; ///< inclusive tag range; tag_hi == any means tag_lo only (any/any: every tag)
  std::size_t min_size = 0, max_size = std::numeric_limits<std::size_t>::max();  ///< inclusive
  std::uint64_t first = 1;  ///< act from the first-th matching message (1-based)...
  std::uint64_t times = 1;  ///< ...on this many consecutive matches (0: all from `first` on)
  /// corrupt: byte offsets to flip (negative: from the end; taken modulo the size).
  std::vector<std::int64_t> bytes{0};
  std::uint8_t mask = 0xFF;
  /// delay: how long; reorder: the longest hold when no later match comes (0: forever).
  std::chrono::nanoseconds hold = std::chrono::milliseconds(50);
  /// truncate: bytes kept (if >= the size: half the size is kept).
  std::size_t keep = std::numeric_limits<std::size_t>::max();

  bool matches(int f, int t, int tag, std::size_t size) const {
    if (from != any && from != f) return false;
    if (to != any && to != t) return false;
    if (tag_lo != any) {
      const int hi = tag_hi == any ? tag_lo : tag_hi;
      if (tag < tag_lo || tag > hi) return false;
    }
    return size >= min_size && size <= max_size;
  }
};

/// What the plan decided for one send.
struct decision {
  std::optional<rule> act;  ///< the action to apply (a copy of the rule)
  std::size_t rule_index = 0;
  bool releases_reordered = false;  ///< this send is a later match of a reorder rule holding a message
};

/// The shared, thread-safe fault plan: rules, silenced ranks and counters.
class plan {
 public:
  using clock = std::chrono::steady_clock;

  /// Adds a rule; returns its index. Rules are tried in order; the first that fires wins.
  std::size_t add(rule r) {
    std::lock_guard lk(m_);
    rules_.push_back({std::move(r), 0});
    return rules_.size() - 1;
  }
  /// Silences `rank` once it has posted `after_sends` more sends from now (0: at once).
  void silence(int rank, std::uint64_t after_sends = 0) {
    std::lock_guard lk(m_);
    silenced_.push_back({rank, after_sends, std::nullopt, false});
  }
  /// Silences `rank` from time `at` on.
  void silence_at(int rank, clock::time_point at) {
    std::lock_guard lk(m_);
    silenced_.push_back({rank, 0, at, false});
  }
  /// Removes every rule and silence (counters are kept).
  void clear() {
    std::lock_guard lk(m_);
    rules_.clear();
    silenced_.clear();
  }

  /// Faults injected so far, by kind (silence: messages swallowed by a silenced rank).
  std::uint64_t injected(kind k) const {
    std::lock_guard lk(m_);
    return counts_[static_cast<std::size_t>(k)];
  }
  std::array<std::uint64_t, kind_count> injected() const {
    std::lock_guard lk(m_);
    return counts_;
  }
  std::uint64_t total_injected() const {
    std::lock_guard lk(m_);
    std::uint64_t s = 0;
    for (auto c : counts_) s += c;
    return s;
  }
  /// How many messages rule `i` matched so far (fired or not).
  std::uint64_t matched(std::size_t i) const {
    std::lock_guard lk(m_);
    return i < rules_.size() ? rules_[i].seen : 0;
  }

  // --- used by faulty<> ---
  /// True if `rank` is silenced now; `posting_send` counts a send toward an
  /// after_sends trigger.
  bool silenced(int rank, bool posting_send = false) {
    std::lock_guard lk(m_);
    bool out = false;
    for (auto& s : silenced_) {
      if (s.rank != rank) continue;
      if (!s.active) {
        if (s.at) s.active = clock::now() >= *s.at;
        else if (s.after == 0) s.active = true;
        else if (posting_send) --s.after;
      }
      out |= s.active;
    }
    return out;
  }
  void count(kind k, std::uint64_t n = 1) {
    std::lock_guard lk(m_);
    counts_[static_cast<std::size_t>(k)] += n;
  }
  decision on_send(int from, int to, int tag, std::size_t size) {
    std::lock_guard lk(m_);
    decision d;
    for (std::size_t i = 0; i < rules_.size(); ++i) {
      auto& e = rules_[i];
      if (!e.r.matches(from, to, tag, size)) continue;
      const std::uint64_t n = ++e.seen;
      const bool fires = n >= e.r.first && (e.r.times == 0 || n < e.r.first + e.r.times);
      if (!fires) {
        if (e.r.action == kind::reorder && n > e.r.first && !d.act) d.releases_reordered = true, d.rule_index = i;
        continue;
      }
      if (!d.act) {
        d.act = e.r;
        d.rule_index = i;
        d.releases_reordered = false;
        counts_[static_cast<std::size_t>(e.r.action)] += 1;
      }
    }
    return d;
  }

 private:
  struct entry {
    rule r;
    std::uint64_t seen;
  };
  struct silence_entry {
    int rank;
    std::uint64_t after;
    std::optional<clock::time_point> at;
    bool active;
  };
  mutable std::mutex m_;
  std::vector<entry> rules_;
  std::vector<silence_entry> silenced_;
  std::array<std::uint64_t, kind_count> counts_{};
};

}  // namespace fault

/// The decorator. One object per rank (like the communicator it wraps), not shared
/// between threads; the plan is shared.
template <point_to_point_communicator Comm>
class faulty {
  using inner_request = typename Comm::request_type;

  /// A message the decorator holds or owns (delayed, reordered, duplicate copies).
  struct held {
    int dest = 0, tag = 0;
    std::span<const std::byte> data;               ///< what to send (the user's or `copy`)
    std::shared_ptr<std::vector<std::byte>> copy;  ///< private bytes, when any
    std::optional<fault::plan::clock::time_point> release_at;
    std::optional<std::size_t> after_rule;  ///< reorder: released after the next match of this rule
    std::optional<inner_request> posted;
    bool cancelled = false;
    bool orphan = false;  ///< nobody holds a request for it (duplicate): the decorator tests it
    bool finished = false;
  };

 public:
  struct request_type {
    std::optional<inner_request> inner;
    std::shared_ptr<std::vector<std::byte>> copy;  ///< keeps a corrupted copy alive
    std::shared_ptr<held> h;                       ///< delayed / reordered send
    std::optional<std::size_t> immediate;          ///< completed at once (dropped, silenced send)
    bool never = false;                            ///< receive of a silenced rank
    bool is_recv = false;
  };

  faulty(Comm inner, std::shared_ptr<fault::plan> p) : inner_(std::move(inner)), plan_(std::move(p)) {}
  faulty(const faulty&) = delete;
  faulty& operator=(const faulty&) = delete;
  ~faulty() {
    for (auto& h : held_) {
      if (h->posted && !h->finished) try { inner_.cancel(*h->posted); } catch (...) {}
    }
  }

  Comm& inner() noexcept { return inner_; }
  fault::plan& faults() noexcept { return *plan_; }

  int rank() const { return static_cast<int>(inner_.rank()); }
  int size() const { return static_cast<int>(inner_.size()); }
  int max_tag() const
    requires tag_bounded_communicator<Comm>
  {
    return static_cast<int>(inner_.max_tag());
  }

  request_type isend(int dest, int tag, std::span<const std::byte> data) {
    pump();
    request_type r;
    if (plan_->silenced(rank(), true)) {
      plan_->count(fault::kind::silence);
      r.immediate = data.size();
      return r;
    }
    auto d = plan_->on_send(rank(), dest, tag, data.size());
    if (!d.act) r.inner = inner_.isend(dest, tag, data);
    else send_faulty(r, *d.act, d.rule_index, dest, tag, data);
    if (d.releases_reordered) release_after(d.rule_index);
    return r;
  }

  request_type irecv(int source, int tag, std::span<std::byte> buffer) {
    pump();
    request_type r;
    r.is_recv = true;
    if (plan_->silenced(rank())) {
      r.never = true;
      return r;
    }
    r.inner = inner_.irecv(source, tag, buffer);
    return r;
  }

  std::optional<std::size_t> test(request_type& r) {
    pump();
    if (r.immediate) return r.immediate;
    if (r.never) return std::nullopt;
    if (r.is_recv && plan_->silenced(rank())) return std::nullopt;
    if (r.h) {
      if (r.h->cancelled) return std::size_t{0};
      if (!r.h->posted) return std::nullopt;
      if (r.h->finished) return r.h->data.size();
      auto n = inner_.test(*r.h->posted);
      if (n) r.h->finished = true;
      return n;
    }
    if (r.inner) return inner_.test(*r.inner);
    return std::size_t{0};  // a default-constructed request
  }

  std::size_t wait(request_type& r) {
    for (;;) {
      if (auto n = test(r)) return *n;
      if constexpr (waitable_communicator<Comm>) {
        auto seen = inner_.activity();
        if (auto n = test(r)) return *n;
        inner_.wait_activity(seen, sleep_bound(std::chrono::milliseconds(5)));
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
  }

  void cancel(request_type& r) {
    if (r.h) {
      if (!r.h->posted) {
        r.h->cancelled = true;
        std::erase(held_, r.h);
      } else if (!r.h->finished) {
        inner_.cancel(*r.h->posted);
        r.h->finished = true;
      }
      return;
    }
    if (r.inner) inner_.cancel(*r.inner);
  }

  // --- waitable_communicator, when the inner one is ---
  std::uint64_t activity()
    requires waitable_communicator<Comm>
  {
    pump();
    return inner_.activity();
  }
  void wait_activity(std::uint64_t seen, std::chrono::microseconds d)
    requires waitable_communicator<Comm>
  {
    inner_.wait_activity(seen, sleep_bound(d));
    pump();
  }

  /// Messages the decorator holds now (delayed, reordered, duplicate copies in flight).
  std::size_t holding() const noexcept { return held_.size(); }

 private:
  /// Sends `data` as the matched rule `a` (rule number `rule`) says: dropped, corrupted,
  /// duplicated, held back (delay, reorder) or truncated.
  void send_faulty(request_type& r, const fault::rule& a, std::size_t rule, int dest, int tag, std::span<const std::byte> data) {
    switch (a.action) {
      case fault::kind::drop:
      case fault::kind::silence:
        r.immediate = data.size();
        break;
      case fault::kind::corrupt:
        r.copy = corrupted_copy(a, data);
        r.inner = inner_.isend(dest, tag, std::span<const std::byte>(*r.copy));
        break;
      case fault::kind::duplicate:
        r.inner = inner_.isend(dest, tag, data);
        send_duplicate(dest, tag, data);
        break;
      case fault::kind::delay:
      case fault::kind::reorder:
        r.h = hold(a, rule, dest, tag, data);
        break;
      case fault::kind::truncate:
        r.inner = inner_.isend(dest, tag, data.first(a.keep < data.size() ? a.keep : data.size() / 2));
        break;
    }
  }
  /// A copy of `data` with the rule's bytes (offsets modulo the size) XORed with its mask.
  static std::shared_ptr<std::vector<std::byte>> corrupted_copy(const fault::rule& a, std::span<const std::byte> data) {
    auto copy = std::make_shared<std::vector<std::byte>>(data.begin(), data.end());
    if (copy->empty()) return copy;
    const auto n = static_cast<std::int64_t>(copy->size());
    for (auto off : a.bytes) (*copy)[static_cast<std::size_t>(((off % n) + n) % n)] ^= std::byte{a.mask};
    return copy;
  }
  /// A second copy of `data`, sent at once; nobody holds its request (the decorator tests it).
  void send_duplicate(int dest, int tag, std::span<const std::byte> data) {
    auto h = std::make_shared<held>();
    h->dest = dest;
    h->tag = tag;
    h->copy = std::make_shared<std::vector<std::byte>>(data.begin(), data.end());
    h->data = *h->copy;
    h->orphan = true;
    h->posted = inner_.isend(dest, tag, h->data);
    held_.push_back(std::move(h));
  }
  /// A send held back until its time (delay) or the rule's next match (reorder).
  std::shared_ptr<held> hold(const fault::rule& a, std::size_t rule, int dest, int tag, std::span<const std::byte> data) {
    auto h = std::make_shared<held>();
    h->dest = dest;
    h->tag = tag;
    h->data = data;
    if (a.action == fault::kind::delay || a.hold.count() > 0) h->release_at = fault::plan::clock::now() + a.hold;
    if (a.action == fault::kind::reorder) h->after_rule = rule;
    held_.push_back(h);
    return h;
  }

  std::chrono::microseconds sleep_bound(std::chrono::microseconds d) const {
    auto now = fault::plan::clock::now();
    for (auto& h : held_)
      if (!h->posted && h->release_at) {
        auto left = std::chrono::duration_cast<std::chrono::microseconds>(*h->release_at - now);
        d = std::min(d, std::max(left, std::chrono::microseconds(0)));
      }
    return d;
  }

  void post(held& h) {
    if (plan_->silenced(rank(), true)) {  // released into a silence: vanishes
      plan_->count(fault::kind::silence);
      h.posted.reset();
      h.finished = true;
      h.cancelled = true;
      return;
    }
    h.posted = inner_.isend(h.dest, h.tag, h.data);
  }

  void release_after(std::size_t rule_index) {
    for (auto& h : held_)
      if (!h->posted && !h->cancelled && h->after_rule == rule_index) {
        post(*h);
        if (h->cancelled) h->finished = true;
      }
    tidy();
  }

  /// Releases held messages whose time has come; forgets finished ones.
  void pump() {
    if (held_.empty()) return;
    auto now = fault::plan::clock::now();
    for (auto& h : held_) {
      if (!h->posted && !h->cancelled && h->release_at && now >= *h->release_at) {
        post(*h);
      }
      if (h->orphan && h->posted && !h->finished) {
        try {
          if (inner_.test(*h->posted)) h->finished = true;
        } catch (...) {  // our own copy failed (e.g. truncated at the receiver): it is over
          h->finished = true;
        }
      }
    }
    tidy();
  }
  void tidy() {
    std::erase_if(held_, [](const std::shared_ptr<held>& h) {
      // Keep a held message until it is posted; keep orphans until their send completed.
      // A posted message someone holds a request for is tracked by that request.
      if (h->cancelled) return true;
      if (!h->posted) return false;
      return h->orphan ? h->finished : true;
    });
  }

  Comm inner_;
  std::shared_ptr<fault::plan> plan_;
  std::vector<std::shared_ptr<held>> held_;
};

}  // namespace deepclone
