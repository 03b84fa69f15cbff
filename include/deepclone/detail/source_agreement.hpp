#pragma once
/// \file detail/source_agreement.hpp
/// The source side of the fork agreement: what the source engine offers an agreement
/// policy (`agreement::context`), with every rule the context depends on checked, and the
/// agreement's own work — numbering sessions, deciding, following, refusing. It holds the
/// agreement's messages (fork_messages) and reaches into the source engine only through
/// `source_agreement_host`: whether a clone is served, the last ended and the newest
/// untouched iteration, and serving a decided session. Templated on the communicator only,
/// so every engine over one communicator shares one instantiation.

#include <chrono>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../agreement.hpp"
#include "../communicator.hpp"
#include "../error.hpp"
#include "../layout.hpp"
#include "../plan.hpp"
#include "../roles.hpp"
#include "fork_messages.hpp"
#include "outbox.hpp"
#include "wire.hpp"

namespace deepclone::detail {

/// The source engine as the agreement sees it.
class source_agreement_host {
 public:
  /// A session is agreed or in flight (no new fork then).
  virtual bool serving() const = 0;
  /// The iteration whose end_iteration ran last.
  virtual std::optional<std::uint64_t> last_iteration() const = 0;
  /// The newest iteration whose layers are all still untouched (trainer collectives).
  virtual std::uint64_t untouched_iteration() const = 0;
  /// Serves the decided session `d` (it is remembered as seen already).
  virtual void serve(const decision_msg& d) = 0;
  /// A fork this source could not serve (late decision, lost decision): counted as failed.
  virtual void fork_failed(failure f) = 0;
  /// The coordinator refused a clone rank's request: counted as refused.
  virtual void request_refused(failure f) = 0;

 protected:
  ~source_agreement_host() = default;
};

/// The parameters of one source's agreement, fixed at the source's construction.
struct source_agreement_params {
  const char* policy;                     ///< the agreement policy's name, for rule errors
  bool trainer_collective = false;        ///< the policy decides in a trainer collective
  std::uint64_t fork_lead = 1;            ///< settings.fork_lead
  int tag_base = 0;                       ///< settings.tag_base
  std::uint32_t epochs = 1;               ///< tag blocks that sessions rotate over
  std::chrono::nanoseconds failover_after{};  ///< how long join_untouched waits for the decision
};

template <class Comm>
class source_agreement final : public agreement::context {
 public:
  /// `index`: this source's index in `r`; `layout` and `key`: the sources' layout and plan
  /// key that requests must match; `trailing`: the engine's outbox for control messages.
  source_agreement(Comm& comm, const roles& r, std::uint32_t index, const layout& lay, const plan_key& key,
                   source_agreement_params p, source_agreement_host& host, outbox<Comm>& trailing)
      : comm_(comm), roles_(r), index_(index), layout_(lay), key_(key), p_(p), host_(host), trailing_(trailing),
        msgs_(r, index == 0, p.tag_base) {}

  // ---- agreement::context ----
  bool coordinator() const override { return index_ == 0; }
  std::uint32_t source_index() const override { return index_; }
  std::optional<std::uint64_t> last_iteration() const override { return host_.last_iteration(); }
  bool serving() const override { return host_.serving(); }
  std::uint64_t fork_lead() const override { return p_.fork_lead; }
  bool requests_accepted() override {
    may_decide("requests_accepted()", false);
    msgs_.take_requests(comm_);
    return accepted_requests();
  }
  void fork_at(std::uint64_t k) override {
    may_decide("fork_at()", true);
    if (k <= *host_.last_iteration())
      broke_rule("fork_at(" + std::to_string(k) + ") after end_iteration(" + std::to_string(*host_.last_iteration()) +
                 "): k must lie after the last ended iteration");
    decide(k);
  }
  void follow(std::uint64_t step) override {
    may_follow("follow()");
    auto d = msgs_.take_decision(comm_);
    if (!d) return;
    if (msgs_.seen(d->session)) {  // a duplicate of a decision served before
      post();
      return;
    }
    if (d->iteration <= step) refuse_late(*d, "only at the end of iteration " + std::to_string(step) + "; raise settings.fork_lead");
    else serve(*d);
  }
  void fork_untouched() override {
    in_collective("fork_untouched()");
    may_decide("fork_untouched()", true);
    decide(host_.untouched_iteration());
  }
  void join_untouched() override {
    in_collective("join_untouched()");
    may_follow("join_untouched()");
    auto d = await_decision();
    if (!d) {
      host_.fork_failed(failure{errc::timeout, "source " + std::to_string(index_) + ": the collective agreed to fork, but the "
                                               "coordinator's decision did not arrive within settings.failover_after"});
      return;
    }
    const auto last = *host_.last_iteration();
    const bool untouched = d->iteration == last + 1 || (d->iteration == last && host_.untouched_iteration() == last);
    if (untouched) serve(*d);
    else
      refuse_late(*d, "after the collective of iteration " + std::to_string(last + 1) +
                          ", when its layers were no longer untouched here (the sources' hooks differ)");
  }

  // ---- the source engine's ----

  /// Posts the agreement's receives that are not posted (after a session ended, too).
  void post() { msgs_.post(comm_); }
  /// At finish(), other sources of a policy that decides at end_iteration: a decision that
  /// raced with the end of training is served (and then fails or completes as the engine
  /// finds the session).
  void serve_raced_decision() {
    if (coordinator() || p_.trainer_collective) return;
    if (auto d = msgs_.take_decision(comm_); d && !msgs_.seen(d->session)) serve(*d);
  }
  /// At finish(): clone ranks whose request already arrived learn at once that no fork will
  /// come (instead of waiting for their timeout); every receive is withdrawn.
  void stop() {
    if (coordinator()) {
      msgs_.take_requests(comm_);
      decision_msg d;
      d.status = verdict::stopped;
      d.iteration = host_.last_iteration().value_or(0);
      d.key = key_;
      msgs_.answer(comm_, trailing_, d);
    }
    msgs_.cancel(comm_);
  }

 private:
  /// The coordinator decides, once per fork, with every request in hand and accepted.
  void may_decide(const char* call, bool needs_requests) const {
    if (index_ != 0) broke_rule(std::string(call) + " on source " + std::to_string(index_) + ": only the coordinator (source 0) decides");
    common_rules(call);
    if (needs_requests && !msgs_.all_requested())
      broke_rule(std::string(call) + " without every clone rank's request (decide only when requests_accepted() is true)");
  }
  void may_follow(const char* call) const {
    if (index_ == 0) broke_rule(std::string(call) + " on the coordinator (source 0): it decides, the others follow");
    common_rules(call);
  }
  void common_rules(const char* call) const {
    if (host_.serving()) broke_rule(std::string(call) + " while a clone is served (check serving())");
    if (!host_.last_iteration()) broke_rule(std::string(call) + " before the first end_iteration");
  }
  /// The untouched iteration is the same on every source only at the trainer's collective,
  /// where all of them stand between the same two iterations.
  void in_collective(const char* call) const {
    if (!p_.trainer_collective)
      broke_rule(std::string(call) + " outside a trainer collective: the sources are in step only there "
                                     "(use it in agreed() of a trainer_collective policy; fork_at()/follow() elsewhere)");
  }
  [[noreturn]] void broke_rule(const std::string& what) const {
    throw error(errc::invalid_argument,
                "agreement policy '" + std::string(p_.policy) + "' on source " + std::to_string(index_) + " broke a rule: " + what);
  }

  /// Coordinator: true when every clone rank's request is in hand and matches this
  /// source's layout and plan; a mismatch is refused (every clone rank is told).
  bool accepted_requests() {
    if (!msgs_.all_requested()) return false;
    decision_msg d;
    d.key = key_;
    auto& got = msgs_.requests();
    for (std::uint32_t j = 0; j < got.size(); ++j) {
      if (got[j]->layout_fingerprint != layout_.fingerprint()) d.status = verdict::layout_differs;
      else if (!(got[j]->key == key_)) d.status = verdict::plan_differs;
      else continue;
      refuse(d, j);
      return false;
    }
    return true;
  }

  /// Coordinator: decides to fork at iteration `k` and tells the other sources and every clone rank.
  void decide(std::uint64_t k) {
    decision_msg d;
    d.key = key_;
    d.session = session_base_ + ++decided_;
    d.epoch = static_cast<std::uint32_t>((decided_ - 1) % p_.epochs);
    d.iteration = k;
    std::vector<std::uint64_t> nonces;
    for (auto& g : msgs_.requests()) d.flags |= g->flags, nonces.push_back(g->nonce);
    d.nonce = requests_digest(nonces);  // the clone ranks get their own request's nonce instead
    for (std::uint32_t i = 1; i < roles_.source_count(); ++i)
      trailing_.send_owned(comm_, roles_.sources[i], p_.tag_base + tag_decision, d.encode());
    msgs_.answer(comm_, trailing_, d);
    serve(d);
  }
  void serve(const decision_msg& d) {
    msgs_.remember(d.session);
    host_.serve(d);
  }

  /// A decision this source can no longer serve (iteration k is past): the clone ranks are
  /// told, and fail cleanly.
  void refuse_late(const decision_msg& d, const std::string& when) {
    msgs_.remember(d.session);
    status_msg m;
    m.session = d.session;
    m.source_index = index_;
    m.code = static_cast<std::uint32_t>(errc::fork_agreement);
    m.reason = "source " + std::to_string(index_) + " (rank " + std::to_string(comm_.rank()) +
               ") received the decision to fork at iteration " + std::to_string(d.iteration) + " " + when;
    for (int c : roles_.clones) trailing_.send_owned(comm_, c, p_.tag_base + tag_status, m.encode());
    host_.fork_failed(failure{errc::fork_agreement, m.reason});
    post();
  }

  /// Coordinator: a clone rank's layout or plan differs; every clone rank is told, with
  /// the sources' layout so that it can name the difference.
  void refuse(decision_msg d, std::uint32_t offender) {
    auto lay = layout_.encode();
    d.layout_bytes = lay.size();
    d.offending_clone = offender;
    msgs_.send_layout(comm_, trailing_, lay);
    const bool layout = d.status == verdict::layout_differs;
    host_.request_refused(failure{layout ? errc::layout_mismatch : errc::plan_mismatch,
                                  "refused the request of clone rank " + std::to_string(roles_.clones[offender]) + ": its " +
                                      (layout ? "layout" : "plan settings") + " differ from the sources'"});
    msgs_.answer(comm_, trailing_, d);
  }

  /// The decision for the fork agreed now; a late decision of an earlier fork (one this
  /// source gave up waiting for) is skipped.
  std::optional<decision_msg> await_decision() {
    idler<Comm> idle(comm_);
    const auto deadline = clock::now() + p_.failover_after;
    for (;;) {
      idle.mark();
      if (auto d = msgs_.take_decision(comm_)) {
        post();
        if (d->status != verdict::accepted || msgs_.seen(d->session)) continue;
        if (d->iteration >= *host_.last_iteration()) return d;
        msgs_.remember(d->session);  // a decision of an earlier fork that came after this source gave up on it
        continue;
      }
      if (clock::now() >= deadline) return std::nullopt;
      idle.idle(deadline);
    }
  }

  Comm& comm_;
  const roles& roles_;
  std::uint32_t index_;
  const layout& layout_;
  const plan_key& key_;
  source_agreement_params p_;
  source_agreement_host& host_;
  outbox<Comm>& trailing_;
  fork_messages<Comm> msgs_;  // the requests and decisions
  std::uint64_t decided_ = 0;
  /// Session ids are unique across source engines (and processes), so that a stale message
  /// of an earlier engine on the same ranks is never taken for one of this engine's.
  std::uint64_t session_base_ = (std::uint64_t{std::random_device{}()} << 32) ^
                                static_cast<std::uint64_t>(clock::now().time_since_epoch().count() & 0xffff0000);
};

}  // namespace deepclone::detail
