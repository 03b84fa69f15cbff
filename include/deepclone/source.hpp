#pragma once
/// \file source.hpp
/// The source engine: the hooks a trainer calls around each layer's update, and the
/// layer-wise pipeline that sends this source's share of the state of the fork iteration.
/// The fork agreement's side of it is detail/source_agreement.hpp; one session's transfer
/// is detail/source_session.hpp. Use it through `engine<...>::source` (engine.hpp).

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cmath>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "agreement.hpp"
#include "checksum.hpp"
#include "detail/outbox.hpp"
#include "detail/session_inbox.hpp"
#include "detail/source_agreement.hpp"
#include "detail/source_pipeline_context.hpp"
#include "detail/source_session.hpp"
#include "detail/state_access.hpp"
#include "detail/wire.hpp"
#include "error.hpp"
#include "pipeline.hpp"
#include "plan.hpp"
#include "roles.hpp"

namespace deepclone::detail {

/// Whether pipeline policy `P` can send a tensor in memory space `m` (optional member
/// `moves`, e.g. `cuda::staged_device`; otherwise host memory only).
template <class P>
bool pipeline_moves(const P& p, memory_space m) {
  if constexpr (requires { { p.moves(m) } -> std::convertible_to<bool>; }) return p.moves(m);
  else return m == memory_space::host;
}

/// What the source engine takes from its engine's settings (engine.hpp makes it): the
/// pipeline and agreement policies' values, the knobs it reads and the plan of a layout.
/// With it the source engine is not templated on the sharding and reconstruction policies.
template <class Pipeline, class Agreement>
struct source_config {  // every field set by engine.hpp from the settings
  /// Owns the engine's settings, in which the two policy values below live (policies need
  /// not be copyable).
  std::shared_ptr<void> settings;
  Pipeline& pipeline;
  Agreement& agreement;
  std::chrono::nanoseconds timeout{}, failover_after{}, poll_interval{};
  std::uint64_t fork_lead = 0;
  int tag_base = 0;
  std::uint32_t tag_epochs = 0;
  bool check_writes = false;
  /// The plan every rank computes for a layout (`engine<...>::make_plan` over the same settings).
  std::function<deepclone::plan(const layout&, const deepclone::roles&)> make_plan;
};

template <class Comm, class Pipeline, class Checksum, class Agreement>
class source_engine : private source_agreement_host, private source_pipeline_host {
 public:
  using agreement_type = Agreement;

  /// Registers this rank as a source of `state`. The state must not change shape while
  /// the source exists. Throws `errc::invalid_argument` if this rank is not a source in
  /// `r`, or for invalid roles.
  source_engine(Comm& comm, deepclone::roles r, state_access& st, source_config<Pipeline, Agreement> config)
      : comm_(comm), roles_(std::move(r)), state_(st), config_(std::move(config)) {
    roles_.validate(comm_.size());
    auto idx = roles_.source_index(comm_.rank());
    if (!idx)
      throw error(errc::invalid_argument, "rank " + std::to_string(comm_.rank()) + " is not a source in the given roles");
    if (config_.fork_lead < 1) throw error(errc::invalid_argument, "settings.fork_lead must be at least 1");
    index_ = *idx;
    layout_ = state_.describe();
    plan_ = config_.make_plan(layout_, roles_);
    max_epochs_ = epochs_that_fit(comm_, config_.tag_base, layout_.layer_count(), ~std::uint32_t{0});
    const auto epochs = std::min(max_epochs_, std::max<std::uint32_t>(config_.tag_epochs, 1));
    agreement_.emplace(comm_, roles_, index_, layout_, plan_.key(),
                       source_agreement_params{Agreement::name, Agreement::trainer_collective, config_.fork_lead, base(), epochs,
                                               std::chrono::duration_cast<std::chrono::nanoseconds>(config_.failover_after)},
                       static_cast<source_agreement_host&>(*this), trailing_);
    for (std::size_t t = 0; t < layout_.tensor_count(); ++t)
      if (!pipeline_moves(config_.pipeline, state_.space(t)))
        throw error(errc::unsupported, "tensor '" + layout_.tensor(t).name +
                                           "' lives in device memory: the core engine sends host memory; use a device pipeline");
    updated_.assign(layout_.layer_count(), 0);
    // Allocated and touched here, before training: fresh memory's first touch is slow.
    if constexpr (requires(Pipeline& p) { { p.reserve(std::uint64_t{}) } -> std::convertible_to<std::uint64_t>; })  // const or not
      pipeline_mem_.assign(static_cast<std::size_t>(config_.pipeline.reserve(plan_.bytes_of_source(index_))), std::byte{0});
    if (config_.check_writes) written_sums_.assign(layout_.tensor_count(), std::nullopt);
    acks_needed_.assign(layout_.layer_count(), 0);
    {
      std::vector<std::vector<char>> receives(layout_.layer_count(), std::vector<char>(roles_.clone_count(), 0));
      for (auto& g : plan_.groups()) receives[g.layer][g.to] = 1;
      for (std::size_t l = 0; l < receives.size(); ++l)
        for (char c : receives[l]) acks_needed_[l] += static_cast<std::uint32_t>(c);
    }
    post_control();
  }
  source_engine(const source_engine&) = delete;
  source_engine& operator=(const source_engine&) = delete;
  ~source_engine() {
    try {
      finish();
    } catch (...) {
    }
    if (unwithdrawn_sends_) retained_buffers::get().keep(std::move(pipeline_mem_));
  }

  /// Call right before layer `layer` is updated. In the iteration after the fork iteration
  /// this is where the source waits, if the pipeline does not yet allow `layer` to be
  /// overwritten (window: its sends are still running or a clone rank did not verify it).
  void before_update(std::size_t layer) {
    hook_timer t(*this);
    check_layer(layer, "before_update");
    if (open_ >= 0)
      throw error(errc::hook_order, "before_update(" + std::to_string(layer) + ") while layer " + std::to_string(open_) +
                                        " is still being updated (missing after_update)");
    if (updated_[layer] == generation_)
      throw error(errc::hook_order, "layer " + std::to_string(layer) + " updated twice in iteration " + current_name() +
                                        " (missing end_iteration?)");
    if (config_.check_writes) check_untouched(layer);
    open_ = static_cast<long>(layer);
    if (session_ && session_->final[layer] && !session_->released[layer]) close_window(layer);
  }

  /// Call right after layer `layer` was updated. In the fork iteration this hands the
  /// layer to the pipeline (window, staged and spill start its transfer here).
  void after_update(std::size_t layer) {
    hook_timer t(*this);
    check_layer(layer, "after_update");
    if (open_ != static_cast<long>(layer))
      throw error(errc::hook_order, "after_update(" + std::to_string(layer) + ") without before_update(" +
                                        std::to_string(layer) + ")" +
                                        (open_ >= 0 ? " (layer " + std::to_string(open_) + " is open)" : ""));
    open_ = -1;
    updated_[layer] = generation_;
    if (config_.check_writes)
      for (std::size_t t = layout_.first_tensor(layer); t < layout_.end_tensor(layer); ++t) written_sums_[t] = host_sum(t);
    if (session_ && last_step_ && *last_step_ + 1 == session_->k)
      make_final(layer);
    else if (session_)
      poll_session_if_due();
  }

  /// Call once at the end of every iteration with its step number; steps must increase by
  /// one. Here the fork decision is received and the metadata of the fork iteration sent.
  void end_iteration(std::uint64_t step) {
    hook_timer t(*this);
    if (open_ >= 0)
      throw error(errc::hook_order, "end_iteration(" + std::to_string(step) + ") while layer " + std::to_string(open_) +
                                        " is still being updated (missing after_update)");
    if (last_step_ && step != *last_step_ + 1)
      throw error(errc::hook_order, "end_iteration(" + std::to_string(step) + ") after end_iteration(" +
                                        std::to_string(*last_step_) + "): steps must increase by one");
    if (finished_) throw error(errc::hook_order, "end_iteration after finish()");
    last_step_ = step;
    ++generation_;
    if (session_ && step == session_->k) {
      for (std::size_t l = 0; l < layout_.layer_count() && session_; ++l)
        if (!session_->final[l]) make_final(l);  // layers not updated in k
      if (session_ && index_ == 0) send_metadata(state_.metadata());
      if (session_) pipeline_fork_iteration_ended();
    }
    // The iteration's duration, end to end, this hook included.
    auto now = clock::now();
    if (last_end_) {
      double d = seconds_since(*last_end_, now);
      if (session_ && step >= session_->k) session_->fork_durations.push_back(d);
      else if (!session_) {  // iterations between the decision and k count as neither
        normal_.push_back(d);
        if (normal_.size() > 32) normal_.pop_front();
      }
    }
    last_end_ = now;
    if (session_) poll_session();
    if (session_ && step < session_->k) session_->last_progress = now;  // waiting for k is not a stall
    if (session_) expired("no clone rank received or acknowledged anything (a clone rank may have vanished); the session was dropped");
    t.flush();
    if (session_ && step >= session_->k && delivered()) complete_session();
    if constexpr (Agreement::trainer_collective)  // should the next collective fork at this iteration,
      if (index_ == 0) fork_meta_ = state_.metadata(), fork_meta_->step = step;  // its metadata as it is now
    if constexpr (!Agreement::trainer_collective)
      if (!session_) config_.agreement.end_iteration(*agreement_, step);
    trailing_.poll(comm_);
    trailing_.compact();
  }

  /// A trainer-collective agreement (agreement::collective), first call: this source's word
  /// for the trainer's collective, a sum over the sources (see agreement.hpp). For
  /// `collective`: 1 on the coordinator when it holds every clone rank's accepted request
  /// (it takes them here, and refuses mismatched ones), +2 on a source still serving a
  /// clone, else 0; the sources fork when the sum is exactly 1.
  std::uint64_t fork_word() {
    static_assert(Agreement::trainer_collective, "fork_word() belongs to a trainer-collective agreement (agreement::collective); "
                                                 "this engine's agreement decides in end_iteration");
    hook_timer t(*this);
    check_outside_update("fork_word()");
    word_ = finished_ ? 0 : config_.agreement.word(*agreement_);
    return word_;
  }
  /// Second call: `sum` is the sum of every source's fork_word() of this iteration, the
  /// same on every source. When the policy forks here (collective: at a sum of 1), the
  /// session starts at the newest iteration whose layers are all untouched, and its final
  /// layers leave at once.
  void fork_agreed(std::uint64_t sum) {
    static_assert(Agreement::trainer_collective, "fork_agreed() belongs to a trainer-collective agreement "
                                                 "(agreement::collective); this engine's agreement decides in end_iteration");
    hook_timer t(*this);
    check_outside_update("fork_agreed()");
    const auto given = std::exchange(word_, 0);
    if (sum < given)
      throw error(errc::invalid_argument, "fork_agreed(" + std::to_string(sum) + ") on source " + std::to_string(index_) +
                                              ", whose fork_word() was " + std::to_string(given) +
                                              ": pass the sum of every source's fork_word() of this iteration");
    if (finished_) return;
    const bool was_serving = session_.has_value();
    config_.agreement.agreed(*agreement_, given, sum);
    if (session_ && !was_serving) send_final_layers();
  }

  /// Ends this source's participation: an in-flight transfer is completed (or fails with
  /// a status the clone sees), control receives are withdrawn. Called by the destructor.
  void finish() {
    if (finished_) return;
    finished_ = true;
    if (!session_) agreement_->serve_raced_decision();  // a decision that raced with the end of training
    if (session_) {
      if (!last_step_ || *last_step_ < session_->k)
        fail_session(errc::source_failed, "source " + std::to_string(index_) + " (rank " + std::to_string(comm_.rank()) +
                                              ") finished training at step " + (last_step_ ? std::to_string(*last_step_) : "none") +
                                              ", before the fork iteration " + std::to_string(session_->k));
      else if (progress_until([&] { return delivered(); }, "outstanding sends were not delivered within the timeout at finish()"))
        complete_session();
    }
    agreement_->stop();
    trailing_.wait_all(comm_, std::min<std::chrono::nanoseconds>(config_.timeout, std::chrono::seconds(1)));
    trailing_.clear(comm_);
  }

  /// True while a clone session is agreed or in flight.
  bool cloning() const noexcept { return session_.has_value(); }
  /// The fork iteration of the session in flight.
  std::optional<std::uint64_t> fork_iteration() const { return session_ ? std::optional(session_->k) : std::nullopt; }
  std::uint64_t sessions_completed() const noexcept { return completed_; }
  std::uint64_t sessions_failed() const noexcept { return failed_; }
  /// Requests the coordinator refused (a clone's layout or plan settings differ).
  std::uint64_t sessions_refused() const noexcept { return refused_; }
  /// pipeline::spill: bytes copied into the spill buffer so far, over all sessions (0 when
  /// the network kept up with the trainer).
  std::uint64_t bytes_spilled() const noexcept {
    if constexpr (requires(const Pipeline& p) { p.bytes_spilled(); }) return config_.pipeline.bytes_spilled();
    else return 0;
  }
  /// Why the last failed or refused session ended so (the source itself keeps training).
  const std::optional<failure>& last_error() const noexcept { return last_error_; }
  const deepclone::plan& plan() const noexcept { return plan_; }
  std::uint32_t index() const noexcept { return index_; }

 private:
  using session = source_session<Comm>;

  /// Adds the time spent in a hook to the session in flight.
  struct hook_timer {
    explicit hook_timer(source_engine& e) : e_(e), t0_(clock::now()) {}
    ~hook_timer() { flush(); }
    /// Books the time so far; called before a session ends inside the hook.
    void flush() {
      auto now = clock::now();
      if (e_.session_) e_.session_->hook_s += seconds_since(t0_, now);
      t0_ = now;
    }
    source_engine& e_;
    clock::time_point t0_;
  };

  // ---- the engine as the pipeline's context sees it (source_pipeline_host) ----

  std::uint64_t checksum_of(std::span<const std::byte> bytes) const override { return Checksum::compute(bytes); }
  bool progress_while_waiting(const std::function<bool()>& done, const std::string& what) override { return progress_until(done, what); }
  bool session_delivered() override { return delivered(); }
  /// The pipeline policy called the context against its rules (pipeline.hpp): the session
  /// fails (the clone ranks learn why at once) and the hook that called the pipeline throws.
  [[noreturn]] void pipeline_broke_rule(const std::string& what) override {
    const auto why = "pipeline policy '" + std::string(Pipeline::name) + "' on source " + std::to_string(index_) + " broke a rule: " + what;
    fail_session(errc::invalid_argument, why);
    throw error(errc::invalid_argument, why);
  }

  void check_layer(std::size_t layer, const char* hook) const {
    if (layer >= layout_.layer_count())
      throw error(errc::hook_order, std::string(hook) + "(" + std::to_string(layer) + "): the state has only " +
                                        std::to_string(layout_.layer_count()) + " layers");
  }
  std::string current_name() const { return last_step_ ? std::to_string(*last_step_ + 1) : "(first)"; }
  int base() const { return config_.tag_base; }

  void post_control() {
    if (!finished_) agreement_->post();
  }

  void check_outside_update(const char* call) const {
    if (open_ >= 0)
      throw error(errc::hook_order, std::string(call) + " while layer " + std::to_string(open_) +
                                        " is being updated: call it outside a layer's before_update/after_update");
  }

  // ---- the engine as the agreement sees it (source_agreement_host) ----

  bool serving() const override { return session_.has_value(); }
  std::optional<std::uint64_t> last_iteration() const override { return last_step_; }
  void fork_failed(failure f) override {
    last_error_ = std::move(f);
    ++failed_;
  }
  void request_refused(failure f) override {
    last_error_ = std::move(f);
    ++refused_;
  }
  /// The newest iteration whose layers are all untouched: the one that ended last, unless
  /// a layer was already updated in the one in progress.
  std::uint64_t untouched_iteration() const override {
    for (auto u : updated_)
      if (u == generation_) return *last_step_ + 1;
    return *last_step_;
  }

  /// A session agreed in the collective: the layers already final in k leave at once
  /// (every layer when k is the iteration that ended last), with k's metadata then.
  void send_final_layers() {
    const bool ended = session_->k == *last_step_;
    for (std::size_t l = 0; l < layout_.layer_count() && session_; ++l)
      if (!session_->final[l] && (ended || updated_[l] == generation_)) make_final(l);
    if (!session_ || !ended) return;
    if (index_ == 0) send_metadata(*std::exchange(meta_to_send_, std::nullopt));
    if (session_) pipeline_fork_iteration_ended();
  }

  /// Serves the decided session `d`: its bookkeeping and receives, the pipeline's begin,
  /// then the messages of it that clone ranks sent before this source got here.
  void serve(const decision_msg& d) override {
    if (index_ == 0 && last_step_ && d.iteration == *last_step_) meta_to_send_ = fork_meta_;  // taken at end_iteration(k)
    open_session(d);
    auto early = inbox_.open(comm_, roles_.clones, base(), d.session);  // arrived while the previous one was in flight
    if (!servable(d)) return;
    if constexpr (requires(Pipeline& p) { p.begin(pipe_ctx_); }) config_.pipeline.begin(pipe_ctx_);
    for (auto& m : early)
      if (session_) apply(m);
  }
  void open_session(const decision_msg& d) {
    const std::size_t L = layout_.layer_count();
    session_.emplace(plan_, roles_, index_, d.session, d.iteration, session_tags{base(), L, d.epoch}, acks_needed_);
    session_->digest = (d.flags & flag_verify_replicas) != 0;
    if (session_->digest) {
      session_->layer_pieces.resize(L);
      for (std::uint32_t pi = 0; pi < plan_.pieces().size(); ++pi) session_->layer_pieces[plan_.pieces()[pi].layer].push_back(pi);
    }
  }
  /// False (and the session failed, saying why) when this source cannot serve `d`: a tag
  /// block beyond the transport's tags, a state that changed shape, a replica to digest
  /// outside host memory.
  bool servable(const decision_msg& d) {
    if (d.epoch >= max_epochs_) {
      fail_session(errc::corrupt_message, "the fork decision names tag block " + std::to_string(d.epoch) + ", beyond the " +
                                              std::to_string(max_epochs_) + " this communicator's tags allow");
      return false;
    }
    // The tensors must still be where (and as large as) they were at construction.
    if (auto now = state_.describe(); !(now == layout_)) {
      fail_session(errc::layout_mismatch, "source " + std::to_string(index_) + "'s state changed since the source was created (" +
                                              first_difference(layout_, now, "then", "now").value_or("?") +
                                              "); the state must not change shape while the source exists");
      return false;
    }
    if (session_->digest)
      for (std::size_t t = 0; t < layout_.tensor_count(); ++t)
        if (state_.space(t) != memory_space::host) {
          fail_session(errc::unsupported, "settings.verify_replicas: source " + std::to_string(index_) + "'s tensor '" +
                                              layout_.tensor(t).name + "' is not in host memory, so its replica cannot be digested");
          return false;
        }
    return true;
  }

  /// True (and the session failed) when a tensor of layer `l` no longer has the size the
  /// plan was made for: it was resized, which the hooks' rules forbid.
  bool resized(std::size_t l) {
    for (std::size_t t = layout_.first_tensor(l); t < layout_.end_tensor(l); ++t) {
      const auto now = state_.bytes(t).size(), then = layout_.tensor(t).bytes;
      if (now == then) continue;
      fail_session(errc::layout_mismatch, "source " + std::to_string(index_) + "'s tensor '" + layout_.layers()[l].name + "." +
                                              layout_.tensor(t).name + "' holds " + std::to_string(now) + " bytes, not the " +
                                              std::to_string(then) + " it held when the source was created; the state "
                                              "must not change shape while the source exists");
      return true;
    }
    return false;
  }

  /// check_writes: the checksum of tensor `t`, or nullopt where it is not in host memory.
  std::optional<std::uint64_t> host_sum(std::size_t t) {
    if (state_.space(t) != memory_space::host) return std::nullopt;
    return checksum::mix64::compute(state_.bytes(t));
  }
  /// check_writes: throws `errc::outside_hooks` (and fails the session in flight) if a
  /// tensor of layer `l` changed since that layer's after_update in the previous iteration.
  void check_untouched(std::size_t l) {
    for (std::size_t t = layout_.first_tensor(l); t < layout_.end_tensor(l); ++t) {
      auto before = std::exchange(written_sums_[t], std::nullopt);
      if (!before || host_sum(t) == before) continue;
      std::string why = "tensor '" + layout_.layers()[l].name + "." + layout_.tensor(t).name + "' on source " +
                        std::to_string(index_) + " changed between after_update(" + std::to_string(l) + ") of iteration " +
                        (last_step_ ? std::to_string(*last_step_) : "(first)") + " and before_update(" + std::to_string(l) +
                        ") of iteration " + current_name() + ": only the code between a layer's before_update and "
                        "after_update may write its tensors (settings.check_writes)";
      if (session_) fail_session(errc::outside_hooks, why);
      throw error(errc::outside_hooks, why);
    }
  }

  /// Layer `l` holds its bytes of k until before_update(l) of k + 1: the pipeline decides
  /// what leaves now; with verify_replicas the layer is digested.
  void make_final(std::size_t l) {
    session_->final[l] = true;
    config_.pipeline.layer_final(pipe_ctx_, l);
    if (session_) digest_layer(l);
  }
  void pipeline_fork_iteration_ended() {
    if constexpr (requires(Pipeline& p) { p.fork_iteration_ended(pipe_ctx_); }) config_.pipeline.fork_iteration_ended(pipe_ctx_);
  }

  /// This source's pieces of layer `l` as the pipeline sees them (source_pipeline_host); empty
  /// (and the session failed) when a tensor of `l` was resized.
  std::vector<pipeline::context::outgoing> pieces_of(std::size_t l) override {
    std::vector<pipeline::context::outgoing> out;
    if (resized(l)) return out;
    for (auto& [pi, gs] : pieces_sent_by(plan_, index_, l)) {
      auto& p = plan_.pieces()[pi];
      auto& o = out.emplace_back(pipeline::context::outgoing{pi, state_.bytes(p.tensor).subspan(p.offset, p.length), state_.space(p.tensor), {}});
      for (auto g : gs) o.to.push_back(plan_.groups()[g].to);
    }
    return out;
  }
  /// verify_replicas: the session digests layer `l` (final for iteration k) unless a
  /// tensor of it was resized (which ends the session).
  void digest_layer(std::size_t l) {
    if (!session_->digest || (session_->layer_pieces[l].size() && resized(l))) return;
    session_->template digest_layer<Checksum>(comm_, l, bytes_of_k_);
  }

  /// Sends `m`, the metadata of iteration k, to every clone rank.
  void send_metadata(metadata m) {
    auto& s = *session_;
    m.step = s.k;
    s.meta = m.encode();
    meta_header h{s.id, s.k, s.meta.size(), Checksum::compute(s.meta)};
    for (int c : roles_.clones) {
      s.out.send_owned(comm_, c, s.tags.meta_header(), h.encode());
      s.out.send(comm_, c, s.tags.meta(), s.meta);
    }
  }

  /// One round of session progress: tests outstanding sends, lets the pipeline progress,
  /// takes layer acknowledgements, serves refetch requests and reacts to a clone's cancel.
  /// True if anything happened. May end the session (cancel).
  bool poll_session() {
    bool any = session_->out.poll(comm_);
    if constexpr (requires(Pipeline& p) { p.progress(pipe_ctx_); }) config_.pipeline.progress(pipe_ctx_);
    if (!session_) return true;
    for (auto& m : inbox_.poll(comm_)) {
      any = true;
      if (apply(m)) return true;
    }
    for (std::uint32_t j = 0; j < roles_.clone_count(); ++j) {
      any |= serve_refetches(j);
      if (!session_) return true;  // a resized tensor ended the session
    }
    if (any) session_->last_progress = clock::now();
    return any;
  }

  /// A round of session progress unless the last one was less than
  /// `settings.poll_interval` ago (the hooks that need not wait call this).
  void poll_session_if_due() {
    const auto now = clock::now();
    if (now < session_->next_poll) return;
    const auto room = clock::time_point::max() - now;  // an interval of nanoseconds::max() means "never"
    session_->next_poll = config_.poll_interval >= room ? clock::time_point::max()
                                                        : now + std::chrono::duration_cast<clock::duration>(config_.poll_interval);
    poll_session();
  }

  /// Applies a message of the session in flight from a clone rank; true if it ended the
  /// session (a cancel).
  bool apply(const clone_message& m) {
    if (auto* c = std::get_if<cancel_msg>(&m.body)) {
      cancelled(m.from, *c);
      return true;
    }
    if (auto* a = std::get_if<ack_msg>(&m.body)) session_->acknowledged(m.from, a->layers);
    else if (auto* r = std::get_if<refetch_msg>(&m.body)) session_->refetch_asked(m.from, r->group);
    return false;
  }
  /// Clone index `j` gave up the session, or (failover) presumed this source failed: only
  /// this source is dropped then, the others serve on.
  void cancelled(std::uint32_t j, const cancel_msg& m) {
    const auto code = static_cast<errc>(m.code);
    const auto who = "clone rank " + std::to_string(roles_.clones[j]);
    if (code == errc::source_failed)
      fail_session(errc::source_failed, who + " presumed source " + std::to_string(index_) +
                                            " failed (nothing arrived from it in time) and dropped it from session " + std::to_string(session_->id));
    else
      fail_session(errc::cancelled,
                   who + " gave up session " + std::to_string(session_->id) +
                       (code == errc::cancelled ? std::string(" (cancelled)") : std::string(" (its error: ") + errc_name(code) + ")"),
                   m.code ? m.code : static_cast<std::uint32_t>(errc::cancelled));
  }

  /// Serves the refetches clone index `j` asked for whose layer is final in k (the session
  /// sends them: source_session::serve_refetches); first, a tensor of such a layer that was
  /// resized ends the session (true) before any byte is read.
  bool serve_refetches(std::uint32_t j) {
    for (auto g : session_->refetch_queue[j]) {
      const auto l = plan_.groups()[g].layer;
      if (!session_->final[l]) break;
      if (resized(l)) return true;
    }
    return session_->template serve_refetches<Checksum>(comm_, j, bytes_of_k_);
  }

  /// Where piece `pi`'s bytes of iteration k are: a copy the pipeline holds (spill), else
  /// the live tensor until its layer is released, else nowhere.
  std::optional<std::span<const std::byte>> bytes_of_k(std::uint32_t pi) {
    auto& p = plan_.pieces()[pi];
    if constexpr (requires(Pipeline& q) { { q.bytes_of_k(pipe_ctx_, pi) } -> std::same_as<std::optional<std::span<const std::byte>>>; })
      if (auto b = config_.pipeline.bytes_of_k(pipe_ctx_, pi)) return b;
    if (!session_->released[p.layer]) return state_.bytes(p.tensor).subspan(p.offset, p.length);
    return std::nullopt;
  }

  /// True when every send of the session completed and every clone rank verified every layer.
  bool delivered() {
    auto& s = *session_;
    if constexpr (requires(Pipeline& p) { { p.pending(pipe_ctx_) } -> std::convertible_to<bool>; })
      if (config_.pipeline.pending(pipe_ctx_)) return false;
    return s.out.all_done(comm_) && s.all_verified();
  }

  /// Before the trainer overwrites layer `l` again: progress until the pipeline allows it
  /// (window: its sends, refetches included, completed and every clone rank verified it,
  /// so that a piece lost elsewhere can still be served from here).
  void close_window(std::size_t l) {
    progress_until([&] { return config_.pipeline.may_overwrite(pipe_ctx_, l); },
           "layer " + std::to_string(l) + " was not released by the " + Pipeline::name +
               " pipeline (sent, verified or copied) within the timeout");
    if (session_) session_->released[l] = true;
  }

  /// Makes session progress until `done()` holds; false if the session ended meanwhile
  /// (cancelled, or failed after `settings.timeout` without progress).
  template <class Done>
  bool progress_until(Done done, const std::string& what) {
    idler<Comm> idle(comm_);
    for (;;) {
      idle.mark();
      if (!session_) return false;
      poll_session();
      if (!session_) return false;
      if (done()) return true;
      if (expired(what)) return false;
      idle.idle(session_->last_progress + config_.timeout);
    }
  }

  /// The session's own deadline: true (and the session failed, saying `what`) once nothing
  /// progressed for `settings.timeout`, so that no session outlives a clone rank that vanished.
  bool expired(const std::string& what) {
    if (clock::now() < session_->last_progress + config_.timeout) return false;
    fail_session(errc::timeout, what + " (nothing progressed for " +
                                    std::to_string(std::chrono::duration<double>(config_.timeout).count()) + " s)");
    return true;
  }

  void complete_session() {
    const auto m = session_->figures(median(normal_));
    for (int c : roles_.clones) trailing_.send_owned(comm_, c, base() + tag_status, m.encode());
    ++completed_;
    end_session();
  }

  void fail_session(errc code, const std::string& why, std::uint32_t cause = 0) {
    if (!session_) return;
    status_msg m;
    m.session = session_->id;
    m.source_index = index_;
    m.code = static_cast<std::uint32_t>(code);
    m.cause = cause;
    m.reason = why;
    for (int c : roles_.clones) trailing_.send_owned(comm_, c, base() + tag_status, m.encode());
    drop_session(failure{code, why});
  }

  void drop_session(failure f) {
    last_error_ = std::move(f);
    ++failed_;
    end_session();
  }

  void end_session() {
    if (session_->out.cancel_all(comm_)) {  // the transport may still read what zero-copy sends point at
      unwithdrawn_sends_ = true;
      retained_buffers::get().keep(std::move(session_->meta));
    }
    inbox_.close(comm_);  // a receive may have matched a message of the next session meanwhile: kept
    session_.reset();
    post_control();
  }

  static double median(const std::deque<double>& v) {
    if (v.empty()) return NAN;
    std::vector<double> x(v.begin(), v.end());
    std::nth_element(x.begin(), x.begin() + static_cast<long>(x.size() / 2), x.end());
    return x[x.size() / 2];
  }

  Comm& comm_;
  deepclone::roles roles_;
  state_access& state_;  // the user's state, through its shell (engine<...>::source<T>)
  source_config<Pipeline, Agreement> config_;
  std::uint32_t index_ = 0;
  deepclone::layout layout_;
  deepclone::plan plan_;
  std::vector<std::uint64_t> updated_;  // generation in which each layer was last updated
  /// The memory the pipeline reserved (staged: its ring; spill: its buffer), allocated once
  /// and kept across sessions. A send cancelled while pending on a transport that may not
  /// withdraw it can still read it (`unwithdrawn_sends_`): it then outlives the engine
  /// (`retained_buffers`).
  std::vector<std::byte> pipeline_mem_;
  typename session::bytes_of_k_fn bytes_of_k_ = [this](std::uint32_t pi) { return bytes_of_k(pi); };
  bool unwithdrawn_sends_ = false;
  std::vector<std::uint32_t> acks_needed_;  // clone ranks that receive something of each layer
  std::uint64_t generation_ = 1;
  long open_ = -1;
  std::optional<std::uint64_t> last_step_;
  std::optional<clock::time_point> last_end_;
  std::deque<double> normal_;
  std::optional<session> session_;
  std::optional<source_agreement<Comm>> agreement_;  // the fork agreement (made once layout and plan are known)
  outbox<Comm> trailing_;                         // control messages outliving sessions
  session_inbox<Comm> inbox_;                     // cancels, acknowledgements, refetches from clone ranks
  std::uint64_t completed_ = 0, failed_ = 0, refused_ = 0;
  std::uint32_t max_epochs_ = 1;                  // tag blocks that fit the communicator's tags
  std::vector<std::optional<std::uint64_t>> written_sums_;  // check_writes: tensor sums at after_update
  std::optional<failure> last_error_;
  bool finished_ = false;
  // agreement::collective
  std::uint64_t word_ = 0;                   // this iteration's fork_word()
  std::optional<metadata> fork_meta_;        // coordinator: metadata as of the last end_iteration
  std::optional<metadata> meta_to_send_;     // coordinator: ... of the session's k, when k had ended at the fork
  /// What the pipeline policy is offered; declared last, after every member it refers to.
  source_pipeline_context<Comm> pipe_ctx_{comm_, layout_, plan_, roles_, index_, session_, last_step_, pipeline_mem_,
                                          static_cast<source_pipeline_host&>(*this)};
};

}  // namespace deepclone::detail
