#pragma once
/// \file detail/fork_messages.hpp
/// The source side of the fork agreement's messages. The coordinator (source 0) holds one
/// request receive per clone rank and the newest request of each, answers every requester
/// with the decision (each with the nonce of its own request, so that a clone rank never
/// takes a decision that answers an older request) and sends the sources' layout with a
/// refusal. The other sources hold one receive for the coordinator's decision. Garbage is
/// dropped here. The policy (when to fork, what to refuse) stays in the source engine and
/// the agreement policy; this is only the messages. Templated on the communicator only.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "../error.hpp"
#include "../roles.hpp"
#include "outbox.hpp"
#include "wire.hpp"

namespace deepclone::detail {

template <class Comm>
class fork_messages {
 public:
  fork_messages() = default;
  /// `r` validated; `coordinator`: this source is source 0.
  fork_messages(const deepclone::roles& r, bool coordinator, int tag_base)
      : clones_(r.clones), coordinator_rank_(r.sources.at(0)), coordinator_(coordinator), base_(tag_base),
        requests_(coordinator ? r.clone_count() : 0), got_(coordinator ? r.clone_count() : 0) {}

  /// Posts the receives this source listens on that are not posted: the coordinator's
  /// request receives, or another source's decision receive.
  void post(Comm& c) {
    for (std::uint32_t j = 0; j < requests_.size(); ++j)
      if (!requests_[j].posted()) requests_[j].post(c, clones_[j], base_ + tag_request, control_bytes);
    if (!coordinator_ && !decision_.posted()) decision_.post(c, coordinator_rank_, base_ + tag_decision, control_bytes);
  }
  /// Withdraws every receive (the source finishes).
  void cancel(Comm& c) noexcept {
    for (auto& r : requests_) r.cancel(c);
    decision_.cancel(c);
  }

  // ---- the coordinator ----

  /// Takes every request (or withdrawal) that arrived; the newest request of each clone
  /// rank counts, a withdrawal cancels the request it names.
  void take_requests(Comm& c) {
    for (std::uint32_t j = 0; j < requests_.size(); ++j)
      while (auto b = requests_[j].test(c)) {
        take(j, *b);
        requests_[j].repost(c);
      }
  }
  /// Every clone rank's request is in hand.
  bool all_requested() const {
    return std::all_of(got_.begin(), got_.end(), [](auto& g) { return g.has_value(); });
  }
  /// The requests in hand, by clone index (nullopt: none from that clone rank).
  const std::vector<std::optional<request_msg>>& requests() const noexcept { return got_; }
  /// Sends `d` to every clone rank whose request is in hand, with that request's nonce,
  /// and clears the requests.
  void answer(Comm& c, outbox<Comm>& out, decision_msg d) {
    for (std::uint32_t j = 0; j < got_.size(); ++j) {
      if (!got_[j]) continue;
      d.nonce = got_[j]->nonce;
      out.send_owned(c, clones_[j], base_ + tag_decision, d.encode());
    }
    got_.assign(got_.size(), std::nullopt);
  }
  /// With a refusal: the sources' encoded layout, to every requester, so that it can name
  /// the difference.
  void send_layout(Comm& c, outbox<Comm>& out, const std::vector<std::byte>& layout) {
    for (std::uint32_t j = 0; j < got_.size(); ++j)
      if (got_[j]) out.send_owned(c, clones_[j], base_ + tag_layout, layout_msg{got_[j]->nonce, layout}.encode());
  }

  // ---- the other sources ----

  /// The coordinator's decision, if one arrived that decodes; the receive is then left
  /// unposted until `post` (the source takes the next decision when it is ready for it).
  /// Garbage is dropped and the receive posted again.
  std::optional<decision_msg> take_decision(Comm& c) {
    auto b = decision_.test(c);
    if (!b) return std::nullopt;
    try {
      return decision_msg::decode(*b);
    } catch (const error&) {  // a peer's garbage: wait for a real decision
    }
    decision_.repost(c);
    return std::nullopt;
  }
  bool decision_posted() const noexcept { return decision_.posted(); }

  // ---- both ----

  /// Sessions this source served or refused to serve, so that a duplicate or late decision
  /// naming one of them is not served again.
  bool seen(std::uint64_t session) const { return std::find(recent_.begin(), recent_.end(), session) != recent_.end(); }
  void remember(std::uint64_t session) {
    recent_.push_back(session);
    if (recent_.size() > max_recent) recent_.pop_front();
  }

 private:
  static constexpr std::size_t max_recent = 64;

  void take(std::uint32_t j, std::span<const std::byte> b) {
    try {
      auto m = request_msg::decode(b);
      if (m.clone_index != j) return;  // names another clone rank: garbage
      if (!(m.flags & flag_withdraw)) got_[j] = m;
      else if (got_[j] && got_[j]->nonce == m.nonce) got_[j].reset();
    } catch (const error&) {
    }
  }

  std::vector<int> clones_;
  int coordinator_rank_ = 0;
  bool coordinator_ = false;
  int base_ = 0;
  std::vector<inbox_slot<Comm>> requests_;       // one per clone rank
  std::vector<std::optional<request_msg>> got_;  // the newest request of each
  inbox_slot<Comm> decision_;                    // from the coordinator
  std::deque<std::uint64_t> recent_;
};

}  // namespace deepclone::detail
