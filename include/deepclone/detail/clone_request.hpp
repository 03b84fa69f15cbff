#pragma once
/// \file detail/clone_request.hpp
/// The clone side of the fork agreement: a clone rank's request to the coordinator and
/// its answer. Each request carries a fresh nonce, so a decision left over from an earlier
/// request or engine on the same ranks never answers this one; such a decision, if it
/// accepted a session this rank never joined, is cancelled at once so the sources do not
/// wait for this rank. A refusal is followed by the sources' layout (to name the
/// difference), whose size the refusal announces. Garbage is dropped and the receive
/// reposted: a peer's bytes never throw here. What an answer means (begin, fail) stays with
/// the clone engine. Templated on the communicator only.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include "../error.hpp"
#include "../plan.hpp"
#include "../roles.hpp"
#include "outbox.hpp"
#include "wire.hpp"

namespace deepclone::detail {

/// The coordinator's answer to this rank's request.
struct request_answer {
  decision_msg decision;                  ///< accepted, stopped, or a refusal
  std::vector<std::byte> sources_layout;  ///< a refusal's encoded layout of the sources
};

template <class Comm>
class clone_request {
 public:
  clone_request(Comm& c, const roles& r, outbox<Comm>& ctl, int tag_base, std::uint32_t index)
      : comm_(c), roles_(r), ctl_(ctl), tag_base_(tag_base), index_(index) {}

  /// Sends a new request (fresh nonce) and posts the receive of its answer.
  void send(std::uint64_t layout_fingerprint, const plan_key& key, std::uint32_t flags) {
    send(layout_fingerprint, key, flags, [](std::uint64_t) {});
  }
  /// As send(), first handing the new request's nonce to `announce` (partition_engine sends
  /// its request hellos there: ahead of the request, so that they are at the sources before
  /// any decision the request leads to, wherever the transport keeps a sender's order).
  template <class Announce>
  void send(std::uint64_t layout_fingerprint, const plan_key& key, std::uint32_t flags, Announce announce) {
    cancel();
    nonce_ = nonces_();
    announce(nonce_);
    request_msg m{index_, nonce_, layout_fingerprint, key, flags};
    ctl_.send_owned(comm_, coordinator(), tag_base_ + tag_request, m.encode());
    decision_.post(comm_, coordinator(), tag_base_ + tag_decision, control_bytes);
  }
  /// One round: true if anything arrived. The answer is handed out once, in the round that
  /// completed it (for a refusal, when the sources' layout followed).
  bool progress(std::optional<request_answer>& out) {
    if (awaiting_layout()) return take_layout(out);
    auto b = decision_.test(comm_);
    if (!b) return false;
    auto d = decode<decision_msg>(*b);
    if (!d || d->nonce != nonce_) {
      if (d && d->status == verdict::accepted && !has_joined(d->session)) cancel_session(d->session, errc::cancelled);
      decision_.repost(comm_);
      return true;
    }
    if (d->status == verdict::layout_differs || d->status == verdict::plan_differs) {
      refusal_ = d;
      post_layout();
    } else {
      out = request_answer{*d, {}};
    }
    return true;
  }
  /// True between a refusal and the sources' layout that follows it.
  bool awaiting_layout() const noexcept { return refusal_.has_value(); }

  /// Withdraws the request (before its decision): the coordinator drops it.
  void withdraw() {
    request_msg m{.clone_index = index_, .nonce = nonce_, .layout_fingerprint = 0, .key = {}, .flags = flag_withdraw};
    ctl_.send_owned(comm_, coordinator(), tag_base_ + tag_request, m.encode());
  }
  /// Tells every source to end `session` (this rank will not take part) and why.
  void cancel_session(std::uint64_t session, errc why) {
    cancel_msg m{session, index_, static_cast<std::uint32_t>(why)};
    for (int s : roles_.sources) ctl_.send_owned(comm_, s, tag_base_ + tag_cancel, m.encode());
  }
  /// Sessions this rank completed: a late duplicate of their decision must not cancel them.
  void joined(std::uint64_t session) {
    joined_.push_back(session);
    if (joined_.size() > 64) joined_.erase(joined_.begin());
  }
  /// Withdraws both receives: no answer is taken afterwards.
  void cancel() noexcept {
    decision_.cancel(comm_);
    layout_.cancel(comm_);
    refusal_.reset();
  }

 private:
  int coordinator() const { return roles_.sources[0]; }
  bool has_joined(std::uint64_t session) const { return std::find(joined_.begin(), joined_.end(), session) != joined_.end(); }
  void post_layout() { layout_.post(comm_, coordinator(), tag_base_ + tag_layout, layout_msg::size_for(refusal_->layout_bytes)); }

  bool take_layout(std::optional<request_answer>& out) {
    auto b = layout_.test(comm_);
    if (!b) return false;
    auto m = decode<layout_msg>(*b);
    if (!m || m->nonce != nonce_) {
      post_layout();  // garbage, or the layout of an older refusal
      return true;
    }
    out = request_answer{*refusal_, std::move(m->layout)};
    refusal_.reset();
    return true;
  }
  template <class M>
  static std::optional<M> decode(std::span<const std::byte> b) {
    try {
      return M::decode(b);
    } catch (const error&) {
      return std::nullopt;
    }
  }

  Comm& comm_;
  const roles& roles_;
  outbox<Comm>& ctl_;
  int tag_base_;
  std::uint32_t index_;
  std::uint64_t nonce_ = 0;
  /// Request nonces, unique across engines and processes: a decision left over from an
  /// earlier engine on the same ranks never answers this one's request.
  std::mt19937_64 nonces_{(std::uint64_t{std::random_device{}()} << 32) ^
                          static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count())};
  std::vector<std::uint64_t> joined_;
  inbox_slot<Comm> decision_, layout_;
  std::optional<decision_msg> refusal_;  ///< the refusal whose layout is awaited
};

}  // namespace deepclone::detail
