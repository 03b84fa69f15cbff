#pragma once
/// \file clone.hpp
/// The clone engine: requests a fork, receives each piece straight into the clone's own
/// tensors, verifies it against its group header, forwards owned pieces to the other clone
/// ranks (scatter_exchange), and exposes per-layer readiness as soon as a layer is
/// complete. Use it through `engine<...>::clone` (engine.hpp).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "checksum.hpp"
#include "detail/clone_request.hpp"
#include "detail/clone_transfer.hpp"
#include "detail/metadata_receive.hpp"
#include "detail/peer_figures.hpp"
#include "detail/outbox.hpp"
#include "detail/replica_digests.hpp"
#include "detail/state_access.hpp"
#include "detail/wire.hpp"
#include "error.hpp"
#include "plan.hpp"
#include "report.hpp"
#include "roles.hpp"

namespace deepclone::detail {

/// What the clone engine takes from its engine's settings (engine.hpp makes it): the knobs
/// it reads, the plan of a layout, and the policies' names. With it the clone engine is
/// compiled once per communicator and checksum, whatever the sharding, pipeline,
/// reconstruction and agreement policies.
struct clone_config {  // every field set by engine.hpp from the settings
  std::chrono::nanoseconds timeout{}, failover_after{};
  int tag_base = 0;
  std::uint64_t max_metadata_bytes = 0;
  bool verify_replicas = false;
  /// The plan every rank computes for a layout (`engine<...>::make_plan` with the settings,
  /// which it owns).
  std::function<deepclone::plan(const layout&, const deepclone::roles&)> make_plan;
  /// The policies as a report names them (`engine<...>::describe`).
  std::string policies;
};

template <class Comm, class Checksum>
class clone_engine {
 public:
  /// Registers this rank as a clone rank that will receive into `state`, whose layout
  /// must equal the sources'. Throws `errc::invalid_argument` if this rank is not a clone
  /// rank in `r`, or for invalid roles.
  clone_engine(Comm& comm, deepclone::roles r, state_access& st, clone_config config)
      : comm_(comm), roles_(std::move(r)), state_(st), config_(std::move(config)), index_(index_in(roles_, comm_)) {}
  clone_engine(const clone_engine&) = delete;
  clone_engine& operator=(const clone_engine&) = delete;
  /// A clone rank that goes away mid-transfer tells the sources, which end the session
  /// at once instead of waiting for its acknowledgements until their timeout.
  ~clone_engine() {
    if (in_flight()) tell_sources_cancel(errc::cancelled);
    abandon();
    meta_.close(comm_);  // also the blob receives kept for forks given up
  }

  /// Asks the sources for a fork. Returns at once; the sources agree on the fork iteration
  /// while they train. Throws `errc::busy` while a request is in flight.
  void request() {
    if (in_flight())
      throw error(errc::busy, "clone rank " + std::to_string(index_) + ": request() while a clone is already in flight");
    abandon();
    layout_ = state_.describe();
    session_ = 0;
    summary_sent_ = false;
    for (std::size_t t = 0; t < layout_.tensor_count(); ++t)
      if (state_.space(t) != memory_space::host)
        throw error(errc::unsupported, "clone tensor '" + layout_.tensor(t).name + "' lives in device memory: the core engine receives into host memory");
    if (config_.verify_replicas && Checksum::id == checksum::none::id)
      throw error(errc::unsupported, "settings.verify_replicas needs a checksum policy; the engine uses checksum::none");
    plan_ = config_.make_plan(layout_, roles_);
    max_epochs_ = epochs_that_fit(comm_, config_.tag_base, layout_.layer_count(), ~std::uint32_t{0});
    request_.send(layout_.fingerprint(), plan_.key(), config_.verify_replicas ? flag_verify_replicas : 0u);
    t_request_ = clock::now();
    rearm_deadlines();
    standby_s_ = 0;
    ready_at_.assign(layout_.layer_count(), std::nullopt);
    told_.assign(layout_.layer_count(), 0);
    told_progress_ = {};
    told_progress_.layer_count = layout_.layer_count();
    told_progress_.bytes_total = layout_.total_bytes();
    phase_ = phase::requested;
  }

  /// Calls `f` from `wait`, `wait_layer` and `poll` as the clone progresses: once per layer
  /// as it becomes ready, then once when the clone is complete (see `deepclone::progress`).
  /// A progress line for clones that take long is its typical use. `f` runs on the thread
  /// that waits, between rounds of progress; an exception it throws propagates out of that
  /// call and leaves the clone in flight, as a timeout in the caller's own code would.
  void on_progress(std::function<void(const deepclone::progress&)> f) { on_progress_ = std::move(f); }

  /// Makes progress without blocking; true once the whole state is verified and in place.
  /// Applies the same deadlines and failover as `wait()`, so a clone that only polls also
  /// ends. Throws the clone's error if the clone failed.
  bool poll() {
    if (phase_ == phase::idle) throw error(errc::not_ready, "clone rank " + std::to_string(index_) + ": no request() was made");
    if (phase_ == phase::failed) throw error(failure_->code, failure_->what);
    advance();
    send_summary();
    return phase_ == phase::complete;
  }
  bool ready() { return poll(); }
  /// True once layer `l` is verified and in place (the forward pass may use it).
  bool layer_ready(std::size_t l) {
    poll();
    check_layer(l);
    return ready_at_[l].has_value();
  }
  /// Blocks until layer `l` is ready. Throws on failure or after `settings.timeout`
  /// without progress.
  void wait_layer(std::size_t l) {
    poll();
    check_layer(l);
    progress_until([&] { return ready_at_[l].has_value(); });
  }
  /// Blocks until the whole state (tensors and metadata) is verified and in place.
  void wait() {
    poll();
    progress_until([&] { return phase_ == phase::complete; });
  }
  /// Gives up the clone in flight: receives are withdrawn (no byte is written afterwards)
  /// and the sources are told to stop. A new request() may follow.
  void cancel() {
    if (in_flight()) {
      failure_ = failure{errc::cancelled, "clone rank " + std::to_string(index_) + " cancelled the clone"};
      tell_sources_cancel(errc::cancelled);
      abandon();
      phase_ = phase::failed;
    }
  }

  /// The sources' metadata of the fork iteration (step == k). Throws `errc::not_ready`
  /// before the clone is complete.
  const deepclone::metadata& metadata() const {
    if (phase_ != phase::complete) throw error(errc::not_ready, "metadata() before the clone is complete");
    return state_.metadata();
  }
  std::optional<std::uint64_t> fork_iteration() const {
    return phase_ == phase::receiving || phase_ == phase::complete ? std::optional(k_) : std::nullopt;
  }

  /// The clone's report. Waits (at most `settings.timeout`) for every source's figures and
  /// every other clone rank's summary; figures that never came are reported missing (a
  /// source as `failed`, a clone rank with NaN times), never as a failure of the clone,
  /// whose state is complete and verified. Throws `errc::not_ready` before completion.
  deepclone::report report() {
    if (phase_ != phase::complete) {
      poll();
      if (phase_ != phase::complete) throw error(errc::not_ready, "report() before the clone is complete");
    }
    await_figures();
    deepclone::report r;
    r.session = session_;
    r.iteration = k_;
    r.state_bytes = layout_.total_bytes();
    r.metadata_bytes = meta_.bytes();
    r.policies = config_.policies;
    r.agreement_s = agreement_s_;
    r.readiness_s = readiness_s_;
    r.standby_s = standby_s_;
    r.refetched_groups = transfer_.refetches();
    r.replicas_verified = digests_.verified();
    r.layer_ready_s.resize(ready_at_.size());
    for (std::size_t l = 0; l < ready_at_.size(); ++l) r.layer_ready_s[l] = *ready_at_[l];
    r.first_layer_s = ready_at_.empty() ? readiness_s_ : r.layer_ready_s[0];
    figures_.add_to(r, roles_, my_summary(), [&](std::uint32_t i) { return transfer_.failed(i); });
    return r;
  }

  const deepclone::plan& plan() const noexcept { return plan_; }
  std::uint32_t index() const noexcept { return index_; }

 private:
  /// This rank's clone index (members built from it need it before the constructor's body).
  static std::uint32_t index_in(const deepclone::roles& r, Comm& c) {
    r.validate(c.size());
    auto idx = r.clone_index(c.rank());
    if (!idx) throw error(errc::invalid_argument, "rank " + std::to_string(c.rank()) + " is not a clone rank in the given roles");
    return *idx;
  }
  /// report(): waits (at most settings.timeout) for every source's status and every other
  /// clone rank's summary. A source that failed (or was presumed failed: failover) may
  /// never send its figures.
  void await_figures() {
    const auto until = clock::now() + config_.timeout;
    idler<Comm> idle(comm_);
    for (;;) {
      idle.mark();
      guarded([&] { return progress(); });
      if (figures_.all_in([&](std::uint32_t i) { return transfer_.failed(i); }) || clock::now() >= until) return;
      idle.idle(until);
    }
  }
  enum class phase { idle, requested, receiving, complete, failed };

  void check_layer(std::size_t l) const {
    if (l >= ready_at_.size())
      throw error(errc::invalid_argument, "layer " + std::to_string(l) + " of a state with " + std::to_string(ready_at_.size()) + " layers");
  }

  bool in_flight() const noexcept { return phase_ == phase::requested || phase_ == phase::receiving; }

  /// Blocks until `pred` holds, making progress; fails after `timeout` without progress.
  template <class Pred>
  void progress_until(Pred pred, bool count_standby = true) {
    auto t0 = clock::now();
    idler<Comm> idle(comm_);
    try {
      for (;;) {
        idle.mark();
        advance();
        if (pred()) break;
        idle.idle(std::min(deadline_, phase_ == phase::receiving ? stall_check_ : deadline_));
      }
    } catch (...) {
      if (count_standby) standby_s_ += seconds_since(t0);
      throw;
    }
    // Blocked time counts until the state was complete, not until this call noticed.
    if (count_standby) standby_s_ += seconds_since(t0, phase_ == phase::complete ? std::max(t0, t_complete_) : clock::now());
    send_summary();
  }

  void rearm_deadlines() {
    deadline_ = clock::now() + config_.timeout;
    stall_check_ = clock::now() + config_.failover_after;
  }

  /// One round of progress under the clone's deadlines (the one place they are applied,
  /// for `poll()` and every wait): presumes silent sources failed after
  /// `settings.failover_after` and fails after `settings.timeout` without progress.
  void advance() {
    if (guarded([&] { return progress(); })) rearm_deadlines();
    report_progress();  // also when completion came in a round that received nothing new (a digest check)
    const auto now = clock::now();
    if (phase_ == phase::receiving && now >= stall_check_) {
      guarded([&] { return failover_stalled(), true; });
      stall_check_ = now + config_.failover_after;
    }
    if (now >= deadline_ && in_flight())
      fail(errc::timeout, "clone rank " + std::to_string(index_) + ": nothing arrived for " +
                              std::to_string(std::chrono::duration<double>(config_.timeout).count()) + " s; still missing: " + missing());
  }

  /// Hands the layers that became ready since the last call, in the order they did, and the
  /// completion to the progress callback (each exactly once per session).
  void report_progress() {
    auto& p = told_progress_;  // running totals of what the callback was told this session
    if (!on_progress_ || p.complete) return;
    std::vector<std::size_t> fresh;
    for (std::size_t l = 0; l < ready_at_.size(); ++l)
      if (ready_at_[l] && !told_[l]) fresh.push_back(l);
    std::stable_sort(fresh.begin(), fresh.end(), [&](auto a, auto b) { return *ready_at_[a] < *ready_at_[b]; });
    p.iteration = fork_iteration().value_or(0);
    for (auto l : fresh) {
      told_[l] = 1;
      p.layer = l;
      ++p.layers_ready;
      p.bytes_ready += layout_.layer_bytes(l);
      p.seconds = *ready_at_[l];
      on_progress_(p);
    }
    if (phase_ == phase::complete) {
      p.layer.reset();
      p.seconds = readiness_s_;
      p.complete = true;
      on_progress_(p);
    }
  }

  /// Runs `f` (a round of progress, or failover) with any error it or the transport raises
  /// turned into a clean failure of the clone (receives withdrawn, sources told), never a
  /// half-abandoned session.
  template <class F>
  bool guarded(F f) {
    try {
      return f();
    } catch (const error& e) {
      if (phase_ == phase::failed) throw;
      fail(e.kind(), e.details());
    }
  }

  /// One round of progress; true if anything happened.
  bool progress() {
    check_tensors_in_place();
    bool any = progress_agreement();
    if (phase_ != phase::receiving && phase_ != phase::complete) return any;
    any |= poll_statuses();
    if (phase_ == phase::complete) return any;
    any |= progress_metadata();
    any |= transfer_.progress();
    any |= mark_ready_layers();
    send_acks();
    if (meta_.done() && std::all_of(ready_at_.begin(), ready_at_.end(), [](auto& r) { return r.has_value(); }) &&
        digests_.agree(checksum::fold_pieces(transfer_.sums()), k_, transfer_.failed())) {
      t_complete_ = clock::now();
      readiness_s_ = seconds_since(t_request_, t_complete_);
      phase_ = phase::complete;
      request_.joined(session_);
      poll_statuses();
    }
    return any;
  }

  /// The answer to this rank's request (detail::clone_request): begin, or fail with why.
  bool progress_agreement() {
    if (phase_ != phase::requested) return false;
    std::optional<request_answer> a;
    const bool any = request_.progress(a);
    if (!a) return any;
    const auto& d = a->decision;
    if (d.status == verdict::accepted) begin(d);
    else if (d.status == verdict::stopped)
      fail(errc::source_failed, "the sources finished training (last step " + std::to_string(d.iteration) +
                                    ") before they could serve this clone's request");
    else
      refused(d, a->sources_layout);
    return true;
  }

  /// Metadata: the coordinator's header, then the blob (detail::metadata_receive).
  bool progress_metadata() {
    std::optional<deepclone::metadata> m;
    const bool any = meta_.progress(comm_, m);
    if (m) state_.metadata() = std::move(*m);
    return any;
  }

  /// Layers whose groups are all verified (and, with forwarding, forwarded) become ready.
  bool mark_ready_layers() {
    bool any = false;
    for (std::size_t l = 0; l < ready_at_.size(); ++l) {
      if (ready_at_[l]) continue;
      if (transfer_.layer_done(l)) {
        ready_at_[l] = seconds_since(t_request_);
        unacked_.push_back(static_cast<std::uint32_t>(l));
        any = true;
      }
    }
    return any;
  }


  /// Receives are posted straight into the clone tensors: a tensor the user resized or
  /// moved since request() would be written outside its memory. Checked before every round
  /// of progress (in process, bytes land only inside `test`).
  void check_tensors_in_place() {
    if (phase_ != phase::receiving) return;
    state_.all_bytes(now_);
    if (now_.size() != posted_.size())
      fail(errc::layout_mismatch, "the clone's state holds " + std::to_string(now_.size()) + " tensors, not the " +
                                      std::to_string(posted_.size()) + " it held at request(); a clone's tensors must stay in place until wait() returns");
    for (std::size_t t = 0; t < posted_.size(); ++t) {
      if (now_[t].data() == posted_[t].data() && now_[t].size() == posted_[t].size()) continue;
      fail(errc::layout_mismatch, "clone tensor '" + layout_.layers()[layout_.layer_of(t)].name + "." + layout_.tensor(t).name +
                                  "' was resized or moved after request() (" + std::to_string(posted_[t].size()) + " -> " +
                                  std::to_string(now_[t].size()) + " bytes); a clone's tensors must stay in place until wait() returns");
    }
  }

  /// Nothing arrived for `settings.failover_after` while other sources did deliver: the
  /// silent senders are presumed failed (and told to stop), their groups asked elsewhere.
  void failover_stalled() {
    if (!transfer_.any_source_delivered()) return;  // all sources quiet: they may just not be at k yet
    // Only sources are presumed failed: a clone rank that does not forward fails the whole
    // clone by timeout (the clone group is one unit), since withdrawing its forward would
    // leave its send pending.
    auto silent = transfer_.awaited_sources();
    if (std::all_of(ready_at_.begin(), ready_at_.end(), [](auto& r) { return r.has_value(); }))
      for (std::uint32_t s = 0; s < silent.size(); ++s)
        if (digests_.awaited(s) && !transfer_.failed(s)) silent[s] = 1;  // delivered its share, but not its digest
    cancel_msg m{session_, index_, static_cast<std::uint32_t>(errc::source_failed)};  // "you are presumed failed"
    for (std::uint32_t s = 0; s < silent.size(); ++s)
      if (silent[s]) {
        ctl_.send_owned(comm_, roles_.sources[s], config_.tag_base + tag_cancel, m.encode());
        transfer_.source_failed(s, "nothing arrived from it for " +
                             std::to_string(std::chrono::duration<double>(config_.failover_after).count()) + " s");
      }
  }

  /// Tells every source which layers are now verified here (their windows may close).
  void send_acks() {
    while (!unacked_.empty()) {
      ack_msg m{session_, index_, {}};
      while (!unacked_.empty() && m.layers.size() < ack_msg::max_layers) {
        m.layers.push_back(unacked_.back());
        unacked_.pop_back();
      }
      auto b = m.encode();
      for (std::uint32_t s = 0; s < roles_.source_count(); ++s)
        if (!transfer_.failed(s)) ctl_.send_owned(comm_, roles_.sources[s], config_.tag_base + tag_ack, b);
    }
  }

  void begin(const decision_msg& d) {
    session_ = d.session;
    k_ = d.iteration;
    agreement_s_ = seconds_since(t_request_);
    phase_ = phase::receiving;
    const std::size_t L = layout_.layer_count();
    tags_ = session_tags{config_.tag_base, L, d.epoch};
    if (d.epoch >= max_epochs_)
      fail(errc::corrupt_message, "the fork decision names tag block " + std::to_string(d.epoch) + ", beyond the " +
                                      std::to_string(max_epochs_) + " this communicator's tags allow");
    if (auto now = state_.describe(); !(now == layout_))
      fail(errc::layout_mismatch, "the clone's state changed between request() and the fork decision (" +
                                      first_difference(layout_, now, "then", "now").value_or("?") +
                                      "); a clone's tensors must stay in place until wait() returns");
    state_.all_bytes(posted_);  // as many as layout_ has: the state was just checked against it
    reset_transfer();
    figures_.open(comm_, roles_, index_, config_.tag_base);  // every source's status, every other clone rank's summary
    digests_.open(comm_, roles_.sources, config_.tag_base, (d.flags & flag_verify_replicas) != 0);
    meta_.open(comm_, roles_.sources[0], {tags_.meta_header(), tags_.meta()}, session_, k_, config_.max_metadata_bytes);
    transfer_.open({&plan_, &layout_, index_, session_, k_, tags_, posted_});
  }

  /// The session's transfer bookkeeping, empty.
  void reset_transfer() {
    const std::size_t L = layout_.layer_count();
    ready_at_.assign(L, std::nullopt);
    told_.assign(L, 0);
    unacked_.clear();
  }

  /// A peer clone rank gave up: the whole group fails for its reason. After a peer's timeout
  /// this rank says what it still misses too, since the peer's own list did not travel.
  [[noreturn]] void fail_with_peer(std::uint32_t source, const status_msg& s) {
    const auto cause = s.cause ? static_cast<errc>(s.cause) : errc::cancelled;
    std::string what = "clone rank " + std::to_string(roles_.clones[index_]) + ": the clone was given up by a peer clone rank (source " +
                       std::to_string(source) + " reports: " + s.reason + ")";
    if (cause == errc::timeout) what += "; still missing here: " + missing();
    fail(cause, what);
  }

  /// The peers' statuses and summaries; a source's failure is failed over (or, a peer clone
  /// rank's cancel, fails the whole group).
  bool poll_statuses() {
    bool any = figures_.poll(comm_, session_, [&](std::uint32_t i, const status_msg& s) {
      // A source that failed after the clone completed changes nothing: every byte is verified.
      if (s.code == 0 || phase_ == phase::complete) return;
      if (static_cast<errc>(s.code) == errc::cancelled) fail_with_peer(i, s);  // the whole group fails for the peer's reason
      transfer_.source_failed(i, s.reason, static_cast<errc>(s.code));
    });
    any |= digests_.poll(comm_, session_, k_);
    return any;
  }

  /// The sources refused the request: names the first difference from their layout `b`.
  [[noreturn]] void refused(const decision_msg& d, std::span<const std::byte> b) {
    auto theirs = decode_or_fail<deepclone::layout>(b);
    std::string who = clone_named(index_);
    if (d.status == verdict::plan_differs) {
      auto diff = d.key.difference(plan_.key());
      fail(errc::plan_mismatch, diff.empty() ? clone_named(d.offending_clone) + " uses plan settings that differ from the sources'"
                                             : who + ": " + diff);
    }
    auto diff = first_difference(theirs, layout_, "sources", who);
    fail(errc::layout_mismatch, diff ? *diff
                                     : clone_named(d.offending_clone) + "'s layout differs from the sources' (this rank's matches)");
  }
  /// A clone rank named by its index in a peer's message (which may be garbage: bounds-checked).
  std::string clone_named(std::uint32_t i) const {
    return i < roles_.clones.size() ? "clone rank " + std::to_string(roles_.clones[i]) : "another clone rank";
  }

  template <class M>
  M decode_or_fail(std::span<const std::byte> b) {
    try {
      return M::decode(b);
    } catch (const error& e) {
      fail(e.kind(), e.details());
    }
  }

  /// Once complete, tells the other clone ranks this rank's figures (for their reports).
  void send_summary() {
    if (phase_ != phase::complete || summary_sent_) return;
    summary_sent_ = true;
    auto s = my_summary().encode();
    for (std::uint32_t j = 0; j < roles_.clone_count(); ++j)
      if (j != index_) ctl_.send_owned(comm_, roles_.clones[j], config_.tag_base + tag_summary, s);
  }

  summary_msg my_summary() const {
    return {session_, index_, transfer_.bytes_from_sources(), transfer_.bytes_from_clones(), readiness_s_, standby_s_,
            ready_at_.empty() || !ready_at_[0] ? readiness_s_ : *ready_at_[0]};
  }

  std::string missing() const {
    if (phase_ == phase::requested)
      return request_.awaiting_layout() ? "the sources' layout from source rank " + std::to_string(roles_.sources[0]) + " (the request was refused)"
                                        : "the fork decision from source rank " + std::to_string(roles_.sources[0]);
    std::string out = transfer_.missing_groups();
    if (!meta_.done()) out += std::string(out.empty() ? "" : ", ") + "the metadata";
    for (std::uint32_t i = 0; i < roles_.source_count(); ++i)
      if (digests_.awaited(i) && !transfer_.failed(i))
        out += std::string(out.empty() ? "" : ", ") + "the replica digest of source rank " + std::to_string(roles_.sources[i]);
    if (out.empty()) out = "forwards to other clone ranks / source statuses";
    return out;
  }

  [[noreturn]] void fail(errc code, const std::string& what) {
    failure_ = failure{code, what};
    if (in_flight()) tell_sources_cancel(code);
    abandon();
    phase_ = phase::failed;
    throw error(code, what);
  }

  /// This rank gives up: before the decision its request is withdrawn, after it every
  /// source is told to end the session (and tells the other clone ranks why).
  void tell_sources_cancel(errc why) {
    if (phase_ == phase::receiving) return request_.cancel_session(session_, why);
    request_.withdraw();
  }

  /// Withdraws every receive and send of the session: after it, no byte of a clone tensor
  /// is written by deepclone.
  void abandon() noexcept {
    transfer_.abandon();
    meta_.cancel(comm_);
    request_.cancel();
    figures_.cancel(comm_);
    digests_.cancel(comm_);
    // Control messages (requests, cancels, summaries) are small; give them a moment.
    ctl_.wait_all(comm_, std::chrono::milliseconds(100));
    ctl_.clear(comm_);
  }

  Comm& comm_;
  deepclone::roles roles_;
  state_access& state_;  // the user's state, through its shell (engine<...>::clone<T>)
  clone_config config_;
  std::uint32_t index_ = 0;
  deepclone::layout layout_;
  deepclone::plan plan_;
  phase phase_ = phase::idle;
  std::optional<failure> failure_;
  std::uint64_t session_ = 0, k_ = 0;
  std::uint32_t max_epochs_ = 1;         // tag blocks this communicator's tags allow
  session_tags tags_;                    // the session's tag block
  std::vector<std::span<std::byte>> posted_;  // each tensor's bytes as the receives were posted
  std::vector<std::span<std::byte>> now_;     // ... and as check_tensors_in_place last saw them
  clock::time_point deadline_{}, stall_check_{};
  clock::time_point t_request_{}, t_complete_{};
  bool summary_sent_ = false;
  double agreement_s_ = 0, readiness_s_ = 0, standby_s_ = 0;

  outbox<Comm> ctl_;
  clone_request<Comm> request_{comm_, roles_, ctl_, config_.tag_base, index_};  // this rank's request and its answer
  metadata_receive<Comm, Checksum> meta_;  // the sources' metadata of iteration k
  peer_figures<Comm> figures_;           // every source's status, every other clone rank's summary
  replica_digests<Comm> digests_;        // verify_replicas
  std::vector<std::uint32_t> unacked_;   // ready layers not yet acknowledged to the sources
  std::vector<std::optional<double>> ready_at_;
  std::function<void(const deepclone::progress&)> on_progress_;
  std::vector<char> told_;               // layers handed to on_progress_ this session
  deepclone::progress told_progress_;    // ... and the totals of what it was told
  clone_transfer<Comm, Checksum> transfer_{comm_, roles_, ctl_, config_.tag_base};  // the session's groups
};

}  // namespace deepclone::detail
