#pragma once
/// \file partition_engine.hpp
/// `partition_engine<Comm, Agreement, Checksum, Memory>` forks a live job whose state is
/// partitioned (ZeRO, tensor or pipeline parallel: partition_job.hpp) while its sources
/// train on, as `engine` does for replicated state:
///
///   deepclone::partition_job job(roles, global_layout, source_holdings, clone_holdings);
///   using cloning = deepclone::partition_engine<Comm>;    // agreement::collective
///   cloning::source src(comm, job, my_parts);              // on a source rank: the hooks
///   cloning::clone  dst(comm, job, my_parts);              // on a clone rank
///   std::uint64_t k = dst.wait();                          // requests, then receives
///
/// The sources agree on the fork iteration k with the same agreement policies and messages
/// as the replicated engine (agreement.hpp, detail/source_agreement.hpp); clone ranks ask
/// the coordinator (source 0) as they do there. Each layer of k leaves as soon as it is
/// final (its after_update in k, or at once when the decision comes after it), through a
/// partition_sender on the fork's own block of tags; a source waits only in before_update
/// of a layer still in flight (the window rule). Templated on the communicator, the
/// agreement, the checksum and where the parts live (part_memory.hpp: host by default;
/// integrations/thrust.hpp's `thrust_staging` for device memory, staged through host
/// buffers); a rank's parts are byte spans, as partition_transfer.hpp takes them.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "agreement.hpp"
#include "checksum.hpp"
#include "communicator.hpp"
#include "detail/clone_request.hpp"
#include "detail/metadata_receive.hpp"
#include "detail/outbox.hpp"
#include "detail/partition_handshake.hpp"
#include "detail/source_agreement.hpp"
#include "detail/wire.hpp"
#include "error.hpp"
#include "metadata.hpp"
#include "part_memory.hpp"
#include "partition_declaration.hpp"
#include "partition_job.hpp"
#include "partition_transfer.hpp"
#include "report.hpp"

namespace deepclone {

namespace detail {

/// A partitioned engine's tags: the agreement's control tags from `base` (as the replicated
/// engine's), then one block per fork, rotating over `epochs` blocks so that bytes an
/// abandoned fork left queued meet only a fork `epochs` later, whose checks catch them. A
/// block is the transfer's `job.transfer_tags()`, then the metadata's header and blob.
struct partition_tags {
  int base = 0;
  long long block = 0;
  std::uint32_t epochs = 1;
  static constexpr long long metadata_tags = 2;

  /// Throws `unsupported` when not even one block fits below the communicator's tag bound.
  template <class Comm>
  static partition_tags fit(const Comm& c, int base, const partition_job& job, std::uint32_t wanted) {
    if (base < 0) throw error(errc::invalid_argument, "settings.tag_base is " + std::to_string(base) + "; tags must not be negative");
    const long long first = static_cast<long long>(base) + tag_epochs, block = job.transfer_tags() + metadata_tags;
    const long long fit = (static_cast<long long>(max_tag_of(c)) - first + 1) / block;
    if (fit < 1)
      throw error(errc::unsupported, "partitioned fork: " + std::to_string(job.global().layer_count()) + " layers need tags up to " +
                                         std::to_string(first + block - 1) + " from settings.tag_base " + std::to_string(base) +
                                         "; the communicator allows up to " + std::to_string(max_tag_of(c)));
    return {base, block, static_cast<std::uint32_t>(std::min<long long>(fit, std::max<std::uint32_t>(wanted, 1)))};
  }
  int transfer(std::uint32_t epoch) const { return static_cast<int>(base + tag_epochs + epoch * block); }
  /// The metadata's header and blob tags of block `epoch`, after the transfer's.
  int metadata_header(std::uint32_t epoch) const { return static_cast<int>(transfer(epoch) + block - metadata_tags); }
  int metadata_blob(std::uint32_t epoch) const { return metadata_header(epoch) + 1; }
};

/// `index` (roles::source_index or clone_index of this rank), or `invalid_argument` naming the role.
inline std::uint32_t index_in(std::optional<std::uint32_t> index, int rank, const char* role) {
  if (!index) throw error(errc::invalid_argument, "rank " + std::to_string(rank) + " is not a " + role + " in the job's roles");
  return *index;
}

/// Refuses (invalid_argument, naming the tensor) parts that do not fit `h`, before any fork.
template <class Span>
void check_parts(const layout& global, const holdings& h, const std::vector<Span>& parts, const std::string& who) {
  std::vector<std::uint64_t> sizes;
  for (const auto& p : parts) sizes.push_back(p.size());
  check_holdings_fit(global, h, sizes, who);
}

/// A peer's error code, where it names one; else `fallback`.
inline errc peer_code(std::uint32_t code, errc fallback) {
  return code >= static_cast<std::uint32_t>(errc::invalid_argument) && code <= static_cast<std::uint32_t>(errc::outside_hooks)
             ? static_cast<errc>(code)
             : fallback;
}

}  // namespace detail

template <class Comm, class Agreement = agreement::collective, class Checksum = checksum::mix64, part_memory Memory = host_memory>
class partition_engine {
  static_assert(point_to_point_communicator<Comm>,
                "deepclone::partition_engine: Comm must model point_to_point_communicator (communicator.hpp)");

 public:
  using comm_type = Comm;
  using agreement_type = Agreement;
  using checksum_type = Checksum;
  using memory_type = Memory;

  /// Run-time settings; sources and clone ranks must use equal tag settings.
  struct settings {
    /// How the sources agree on the fork iteration (agreement.hpp); sources only.
    Agreement agreement{};
    /// agreement::coordinator: fork at (iteration in which the coordinator held every
    /// request) + fork_lead; the tolerated skew between sources, in iterations.
    std::uint64_t fork_lead = 2;
    /// Sources: the longest a hook waits for a layer in flight, and the longest a fork may
    /// stay unacknowledged after its iteration ended; then it fails (the clone ranks are
    /// told) and the source trains on. Clone ranks: the longest wait for the decision, and
    /// then for the transfer.
    std::chrono::nanoseconds timeout = std::chrono::seconds(60);
    /// Trainer-collective agreements: how long a source waits for the coordinator's decision.
    std::chrono::nanoseconds failover_after = std::chrono::seconds(10);
    /// Tags [tag_base, tag_base + 16 + tag_epochs x (job.transfer_tags() + 2)) are the engine's.
    int tag_base = 1000;
    /// Consecutive forks use different blocks of tags (fewer where the tag bound allows fewer).
    std::uint32_t tag_epochs = 16;
    /// Clone ranks: the largest metadata blob a source may announce (a larger announcement
    /// fails the fork as corrupt before anything is allocated).
    std::uint64_t max_metadata_bytes = std::uint64_t{1} << 30;
  };

  /// The sources' and clone ranks' plan key: what the coordinator compares before a fork
  /// (N, M, alignment, checksum, and whether failover is on, in `reconstruct_param`). The
  /// plan itself is compared pairwise by the transfer's handshake, which names a difference
  /// in holdings or group options.
  static plan_key key(const partition_job& job) {
    plan_key k;
    k.sources = static_cast<std::uint32_t>(job.ranks().source_count());
    k.clones = static_cast<std::uint32_t>(job.ranks().clone_count());
    k.alignment = job.options().alignment;
    k.reconstruct_param = job.options().failover ? 1 : 0;
    k.checksum_id = Checksum::id;
    return k;
  }

  class source;
  class clone;
};

/// A source rank: the trainer calls the hooks; the engine serves the forks agreed.
template <class Comm, class Agreement, class Checksum, part_memory Memory>
class partition_engine<Comm, Agreement, Checksum, Memory>::source final : private detail::source_agreement_host {
 public:
  /// `parts[t]`: this source's part of global tensor t, as its holdings declare; they are
  /// read while a fork is in flight, so they must stay where they are. Throws
  /// `invalid_argument` when this rank is not a source of `job`, for parts that do not fit
  /// its holdings, and for agreement::coordinator with a fork_lead of 0.
  source(Comm& comm, const partition_job& job, std::span<const std::span<const std::byte>> parts, settings s = {})
      : comm_(comm), job_(job), index_(detail::index_in(job.ranks().source_index(comm.rank()), comm.rank(), "source")), parts_(parts.begin(), parts.end()),
        s_(std::move(s)), tags_(detail::partition_tags::fit(comm, s_.tag_base, job, s_.tag_epochs)), key_(key(job)),
        updated_(job.global().layer_count(), 0) {
    job.ranks().validate(comm.size());
    detail::check_parts(job.global(), job.sources()[index_], parts_, "source " + std::to_string(index_));
    if (!Agreement::trainer_collective && s_.fork_lead == 0)
      throw error(errc::invalid_argument, "settings.fork_lead is 0: the other sources must learn the decision before iteration k starts");
    hellos_.emplace(comm_, job.ranks().clones, s_.tag_base + detail::tag_hello, detail::handshake_terms::of(job.global(), job.groups()));
    agreement_.emplace(comm_, job.ranks(), index_, job.global(), key_,
                       detail::source_agreement_params{Agreement::name, Agreement::trainer_collective, s_.fork_lead, s_.tag_base,
                                                       tags_.epochs, s_.failover_after},
                       static_cast<detail::source_agreement_host&>(*this), trailing_);
    agreement_->post();
    cancels_.resize(job.ranks().clone_count());
    post_cancels();
  }
  source(const source&) = delete;
  source& operator=(const source&) = delete;
  ~source() {
    try {
      finish();
    } catch (...) {  // a destructor must not throw; finish() failing means the transport did
    }
  }

  /// Right before layer `l` is updated: waits while a fork still reads it (at most
  /// settings.timeout; then that fork fails and the source trains on).
  void before_update(std::size_t l) {
    check_layer(l, "before_update");
    outside_update("before_update()");
    if (updated_[l])
      throw error(errc::hook_order, "before_update(" + std::to_string(l) + "): layer '" + job_.global().layers()[l].name +
                                        "' was updated in this iteration already (one update per layer and iteration)");
    if (session_ && session_->sent[l]) {
      const auto t0 = detail::clock::now();
      const auto id = session_->d.session;
      hold_until_sent(l);  // may end the fork (its last acknowledgement, or a timeout)
      const double held = std::chrono::duration<double>(detail::clock::now() - t0).count();
      if (session_) session_->held_s += held;
      else if (last_fork_.session == id) last_fork_.held_s += held;
    }
    touched_ = true, updating_ = l;
    order_.push_back(static_cast<std::uint32_t>(l));
  }
  /// Right after layer `l` was updated: in the fork iteration the layer leaves now. While a
  /// fork is in flight it also moves the fork's messages; otherwise it calls no transport
  /// (the hooks of an iteration without a fork cost a trainer next to nothing).
  void after_update(std::size_t l) {
    check_layer(l, "after_update");
    if (updating_ != l)
      throw error(errc::hook_order, "after_update(" + std::to_string(l) + ") without before_update(" + std::to_string(l) + ") first");
    updated_[l] = 1, updating_.reset();
    if (!session_) return;  // nothing in flight: what comes (requests, cancels, hellos) waits for end_iteration
    if (current() == session_->d.iteration) send(l);
    progress();
  }
  /// At the end of every iteration, steps increasing by one. A layer the fork iteration did
  /// not update is final too and leaves here. `m`: the trainer's metadata as of this step
  /// (data cursor, RNG, hyper-parameters, user bytes); source 0's of iteration k goes to
  /// every clone rank with the fork (its `step` is set to k). Only source 0 keeps a copy.
  void end_iteration(std::uint64_t step, const deepclone::metadata& m) {
    outside_update("end_iteration()");
    check_step(step);  // a refused call keeps k's metadata
    if (index_ == 0) meta_ = m;
    end_step(step);
  }
  /// Without metadata: the clone ranks receive only the step.
  void end_iteration(std::uint64_t step) {
    outside_update("end_iteration()");
    check_step(step);
    if (index_ == 0) meta_ = {};
    end_step(step);
  }
  /// Trainer-collective agreements (agreement.hpp): this source's word for the collective,
  /// between end_iteration and the next before_update (collective: 1 on the coordinator
  /// holding every accepted request, +2 on a source still serving a fork).
  std::uint64_t fork_word() {
    static_assert(Agreement::trainer_collective, "fork_word() belongs to a trainer-collective agreement (agreement::collective); "
                                                 "this engine's agreement decides in end_iteration");
    outside_update("fork_word()");
    progress();
    word_ = finished_ ? 0 : s_.agreement.word(*agreement_);
    return word_;
  }
  /// The sum of every source's fork_word() of this iteration (the same on every source);
  /// may start a fork, whose layers already final leave at once.
  void fork_agreed(std::uint64_t sum) {
    static_assert(Agreement::trainer_collective, "fork_agreed() belongs to a trainer-collective agreement "
                                                 "(agreement::collective); this engine's agreement decides in end_iteration");
    outside_update("fork_agreed()");
    const auto given = std::exchange(word_, 0);
    if (sum < given)
      throw error(errc::invalid_argument, "fork_agreed(" + std::to_string(sum) + ") on source " + std::to_string(index_) +
                                              ", whose fork_word() was " + std::to_string(given) +
                                              ": pass the sum of every source's fork_word() of this iteration");
    if (!finished_) s_.agreement.agreed(*agreement_, given, sum);
  }
  /// Ends this source's part: a fork in flight completes (or fails, and the clone ranks
  /// are told), waiting clone ranks learn that no fork will come. Called by the destructor.
  void finish() {
    if (finished_) return;
    finished_ = true;
    struct closing {  // withdraws every receive and control send, also when the end throws
      source& s;
      ~closing() {
        try {
          s.agreement_->stop();
        } catch (...) {  // the transport failed: the receives below are withdrawn regardless
        }
        for (auto& c : s.cancels_) c.cancel(s.comm_);
        s.hellos_->cancel();
        s.trailing_.wait_all(s.comm_, std::min<std::chrono::nanoseconds>(s.s_.timeout, std::chrono::seconds(1)));
        s.trailing_.clear(s.comm_);
      }
    } close{*this};
    if (!session_) agreement_->serve_raced_decision();
    if (session_ && (!last_ || *last_ < session_->d.iteration))
      fail_session(errc::source_failed, "source " + std::to_string(index_) + " finished training before the fork iteration " +
                                            std::to_string(session_->d.iteration));
    else if (session_ && !wait_until([&] { return !session_; }))
      fail_session(errc::timeout, "source " + std::to_string(index_) + ": the fork was not acknowledged within settings.timeout at finish()");
  }

  /// True while a fork is agreed or in flight.
  bool serving() const noexcept override { return session_.has_value(); }
  /// The fork iteration of the fork in flight.
  std::optional<std::uint64_t> fork_iteration() const { return session_ ? std::optional(session_->d.iteration) : std::nullopt; }
  std::uint64_t forks_completed() const noexcept { return completed_; }
  /// Forks this source served or was asked to serve that failed, and requests refused.
  std::uint64_t forks_failed() const noexcept { return failed_; }
  /// Why the last failed or refused fork ended so (the source itself trained on).
  const failure& last_failure() const noexcept { return last_failure_; }
  /// This source's figures of the last fork it served, completed or failed (empty before).
  const partition_source_report& last_fork() const noexcept { return last_fork_; }

 private:
  using sender_type = partition_sender<Comm, Checksum, Memory>;
  struct session {
    detail::decision_msg d;
    std::unique_ptr<sender_type> sender;
    std::vector<char> sent;  ///< per layer: handed to the sender
    std::size_t unsent = 0;
    bool metadata_due = false;  ///< source 0, until k ended and its metadata left: the fork is not done before
    detail::clock::time_point all_sent_at{};
    detail::clock::time_point decided_at = detail::clock::now();
    double held_s = 0;  ///< before_update waiting for layers in flight
  };

  std::uint64_t current() const { return last_ ? *last_ + 1 : 0; }
  /// end_iteration's rule: steps increase by one.
  void check_step(std::uint64_t step) const {
    if (last_ && step != *last_ + 1)
      throw error(errc::hook_order, "end_iteration(" + std::to_string(step) + ") after end_iteration(" + std::to_string(*last_) +
                                        "): steps must increase by one");
  }
  /// end_iteration, its step checked: the layers of k not updated, and k's metadata, leave.
  void end_step(std::uint64_t step) {
    const bool fork_iteration = session_ && step == session_->d.iteration;
    last_ = step, touched_ = false;
    std::fill(updated_.begin(), updated_.end(), 0);
    last_order_.swap(order_), order_.clear();
    for (std::size_t l = 0; fork_iteration && l < updated_.size() && session_; ++l) send(l);
    if (fork_iteration && session_) send_metadata();
    progress();
    if constexpr (!Agreement::trainer_collective)
      if (!session_) s_.agreement.end_iteration(*agreement_, step);
  }
  /// The hooks' order: a layer's update is closed by after_update before anything else.
  void outside_update(const char* call) const {
    if (updating_.has_value())
      throw error(errc::hook_order, std::string(call) + " between before_update and after_update: close the layer's update first");
  }
  void check_layer(std::size_t l, const char* hook) const {
    if (l >= updated_.size())
      throw error(errc::invalid_argument, std::string(hook) + "(" + std::to_string(l) + "): the global layout has " +
                                              std::to_string(updated_.size()) + " layers");
  }

  // ---- detail::source_agreement_host ----
  std::optional<std::uint64_t> last_iteration() const override { return last_; }
  std::uint64_t untouched_iteration() const override { return touched_ ? *last_ + 1 : *last_; }
  void fork_failed(failure f) override { ++failed_, last_failure_ = std::move(f); }
  void request_refused(failure f) override { ++failed_, last_failure_ = std::move(f); }
  /// Serves the decided fork `d`: its sender on the fork's tags; the layers already final in
  /// k leave at once (all of them when k ended last, those updated since when k is in progress).
  void serve(const detail::decision_msg& d) override {
    session_.emplace(session{d, nullptr, std::vector<char>(updated_.size(), 0), updated_.size(), index_ == 0, {}});
    if (d.epoch >= tags_.epochs)
      return fail_session(errc::plan_mismatch, "the decision names tag block " + std::to_string(d.epoch) + " of " +
                                                   std::to_string(tags_.epochs) + ": the sources' tag settings differ");
    // A raced decision at finish() is served unchecked by the agreement: k must be untouched here.
    if (!last_ || d.iteration < *last_ || (d.iteration == *last_ && touched_))
      return fail_session(errc::fork_agreement, "source " + std::to_string(index_) + " received the decision to fork at iteration " +
                                                    std::to_string(d.iteration) + " when its layers were no longer untouched");
    if (!guarded([&] {
          session_->sender = std::make_unique<sender_type>(comm_, job_.route(tags_.transfer(d.epoch), d.session), index_, parts_);
          for (auto c : hellos_->admitted_for(d.nonce)) session_->sender->admit_in_advance(c);  // no wait for their hellos
        }))
      return;
    if (std::find(early_cancels_.begin(), early_cancels_.end(), d.session) != early_cancels_.end())
      return fail_session(errc::cancelled, "a clone rank gave up on the fork before this source joined it");
    // In the order the trainer updates them (the last iteration's): each layer leaves before
    // the ones the trainer will wait for after it (the window rule), on links that serve
    // sends in the order posted.
    if (d.iteration == *last_ + 1)
      for (std::size_t i = 0; i < order_.size() && session_; ++i)
        if (updated_[order_[i]]) send(order_[i]);  // those updated so far in k
    if (d.iteration != *last_) return;
    for (std::size_t i = 0; i < last_order_.size() && session_; ++i) send(last_order_[i]);
    for (std::size_t l = 0; l < updated_.size() && session_; ++l) send(l);  // the layers it did not update
    if (session_) send_metadata();
  }
  /// Source 0: sends the metadata of k (its last end_iteration's, k having ended) to every
  /// clone rank, a sealed header (session, k, size, checksum) before the blob.
  void send_metadata() {
    if (!std::exchange(session_->metadata_due, false)) return;
    guarded([&] {
      auto m = meta_;
      m.step = session_->d.iteration;
      auto blob = m.encode();
      const detail::meta_header h{session_->d.session, session_->d.iteration, blob.size(), Checksum::compute(blob)};
      for (int c : job_.ranks().clones) {
        trailing_.send_owned(comm_, c, tags_.metadata_header(session_->d.epoch), h.encode());
        trailing_.send_owned(comm_, c, tags_.metadata_blob(session_->d.epoch), blob);
      }
    });
  }

  /// Hands layer `l` of k to the sender (once).
  void send(std::size_t l) {
    if (session_->sent[l] || !guarded([&] { session_->sender->send_layer(static_cast<std::uint32_t>(l)); })) return;
    session_->sent[l] = 1;
    if (--session_->unsent == 0) session_->all_sent_at = detail::clock::now();
  }
  /// Runs `f` on the fork in flight; what it throws (the transport's failure, an allocation)
  /// fails the fork, never the trainer's hook. False then.
  template <class F>
  bool guarded(F f) {
    try {
      f();
      return true;
    } catch (const error& e) {
      fail_session(e.kind(), e.details());
    } catch (const std::exception& e) {
      fail_session(errc::transport, e.what());
    }
    return false;
  }

  /// One round: control sends, clone ranks' cancels, the fork's sends and notices; retires
  /// a fork once done, fails one unacknowledged for settings.timeout after its last layer left.
  void progress() {
    trailing_.poll(comm_);
    trailing_.compact();
    take_cancels();
    hellos_->poll();
    if (!session_ || session_->unsent > 0 || session_->metadata_due) {
      if (session_) guarded([&] { session_->sender->progress(); });
      return;
    }
    bool done = false;
    if (!guarded([&] { done = session_->sender->done(); })) return;
    if (done) {
      ++completed_;
      end_session(true);
    } else if (detail::clock::now() - session_->all_sent_at > s_.timeout) {
      fail_session(errc::timeout, "source " + std::to_string(index_) + ": the fork of iteration " + std::to_string(session_->d.iteration) +
                                      " was not acknowledged within settings.timeout");
    }
  }
  /// before_update of a layer in flight: waits until it may be overwritten.
  void hold_until_sent(std::size_t l) {
    const auto l32 = static_cast<std::uint32_t>(l);
    const auto layer_sent = [&] {
      bool sent = false;
      if (session_) guarded([&] { sent = session_->sender->layer_sent(l32); });
      return !session_ || sent;
    };
    if (!wait_until(layer_sent))
      fail_session(errc::timeout, "source " + std::to_string(index_) + ": layer '" + job_.global().layers()[l].name +
                                      "' was not acknowledged within settings.timeout; the source trains on");
  }
  /// Progresses until `ready()`; false after settings.timeout.
  template <class Ready>
  bool wait_until(Ready ready) {
    detail::idler<Comm> idle(comm_);
    const auto deadline = detail::clock::now() + s_.timeout;
    for (idle.mark(); !ready(); idle.mark()) {
      if (detail::clock::now() >= deadline) return false;
      progress();
      if (!ready()) idle.idle(deadline);
    }
    return true;
  }

  /// A clone rank that gave up on the fork in flight ends it for every clone rank.
  void post_cancels() {
    for (std::size_t j = 0; j < cancels_.size(); ++j)
      if (!cancels_[j].posted()) cancels_[j].post(comm_, job_.ranks().clones[j], s_.tag_base + detail::tag_cancel, detail::control_bytes);
  }
  void take_cancels() {
    for (std::uint32_t j = 0; j < cancels_.size(); ++j)
      while (auto b = cancels_[j].test(comm_)) {
        std::optional<detail::cancel_msg> m;
        try {
          m = detail::cancel_msg::decode(*b);
        } catch (const error&) {  // a peer's garbage
        }
        cancels_[j].repost(comm_);
        if (!m || m->clone_index != j) continue;
        if (session_ && m->session == session_->d.session)
          fail_session(errc::cancelled, "clone rank " + std::to_string(job_.ranks().clones[j]) + " gave up on the fork (" +
                                            errc_name(detail::peer_code(m->code, errc::cancelled)) + ")");
        else
          remember_cancel(m->session);  // a fork this source has not joined yet (a follower learns of it later)
      }
  }

  /// Cancels of forks this source has not joined, the newest few: serve() ends such a fork at once.
  void remember_cancel(std::uint64_t session) {
    early_cancels_.push_back(session);
    if (early_cancels_.size() > 16) early_cancels_.erase(early_cancels_.begin());
  }

  /// The fork in flight fails: every clone rank is told why, its sends are withdrawn.
  void fail_session(errc code, const std::string& why) {
    detail::status_msg m;
    m.session = session_->d.session;
    m.source_index = index_;
    m.code = static_cast<std::uint32_t>(code);
    m.reason = why;
    try {
      for (int c : job_.ranks().clones) trailing_.send_owned(comm_, c, s_.tag_base + detail::tag_status, m.encode());
    } catch (...) {  // the transport failed: the clone ranks time out instead; the fork ends regardless
    }
    if (session_->sender) session_->sender->cancel();
    fork_failed(failure{code, why});
    end_session(false);
  }
  void end_session(bool completed) {
    last_fork_ = {session_->d.session, session_->d.iteration, completed, session_->held_s,
                  std::chrono::duration<double>(detail::clock::now() - session_->decided_at).count()};
    session_.reset();
    agreement_->post();
  }

  Comm& comm_;
  const partition_job& job_;
  std::uint32_t index_;
  std::vector<std::span<const std::byte>> parts_;
  settings s_;
  detail::partition_tags tags_;
  plan_key key_;
  std::vector<char> updated_;  ///< per layer: updated in the iteration in progress
  std::vector<std::uint32_t> order_, last_order_;  ///< the layers in the order updated: in the iteration in progress, in the last
  deepclone::metadata meta_;   ///< source 0: the trainer's metadata of its last end_iteration
  bool touched_ = false;       ///< a layer's update began in the iteration in progress
  std::optional<std::size_t> updating_;  ///< the layer between its before_update and after_update
  std::optional<std::uint64_t> last_;
  detail::outbox<Comm> trailing_;
  std::vector<detail::inbox_slot<Comm>> cancels_;  ///< one per clone rank
  std::vector<std::uint64_t> early_cancels_;        ///< remember_cancel
  std::optional<detail::request_hellos<Comm>> hellos_;  ///< each clone rank's latest request hello
  std::optional<detail::source_agreement<Comm>> agreement_;
  std::optional<session> session_;
  std::uint64_t word_ = 0, completed_ = 0, failed_ = 0;
  failure last_failure_{};
  partition_source_report last_fork_{};
  bool finished_ = false;
};

/// A clone rank: asks for a fork and receives its wanted parts of iteration k.
template <class Comm, class Agreement, class Checksum, part_memory Memory>
class partition_engine<Comm, Agreement, Checksum, Memory>::clone {
 public:
  /// `parts[t]`: this clone rank's part of global tensor t, as its holdings declare. Throws
  /// `invalid_argument` when this rank is not a clone rank of `job`, or for parts that do
  /// not fit its holdings.
  clone(Comm& comm, const partition_job& job, std::span<const std::span<std::byte>> parts, settings s = {})
      : comm_(comm), job_(job), index_(detail::index_in(job.ranks().clone_index(comm.rank()), comm.rank(), "clone rank")), parts_(parts.begin(), parts.end()),
        s_(std::move(s)), tags_(detail::partition_tags::fit(comm, s_.tag_base, job, s_.tag_epochs)),
        terms_(detail::handshake_terms::of(job.global(), job.groups())), request_(comm_, job.ranks(), trailing_, s_.tag_base, index_) {
    job.ranks().validate(comm.size());
    detail::check_parts(job.global(), job.clones()[index_], parts_, who());
  }
  clone(const clone&) = delete;
  clone& operator=(const clone&) = delete;
  /// A request not yet answered is withdrawn: the sources do not fork for this rank.
  ~clone() {
    if (requested_) request_.withdraw();
    request_.cancel();
    meta_in_.close(comm_);
    trailing_.wait_all(comm_, std::chrono::seconds(1));
    trailing_.clear(comm_);
  }

  /// Asks the coordinator for a fork (once per wait()).
  void request() {
    if (requested_) return;
    requested_at_ = detail::clock::now();
    trailing_.poll(comm_);
    trailing_.compact();
    // Its hello to every source first, naming the request: they send at once when the fork
    // is decided, without waiting for its hello on the fork's tags.
    request_.send(job_.global().fingerprint(), key(job_), 0, [&](std::uint64_t nonce) {
      const auto hello = detail::request_hello{nonce, {index_, terms_.plan, terms_.declaration_fingerprint}}.encode();
      for (int rank : job_.ranks().sources) trailing_.send_owned(comm_, rank, s_.tag_base + detail::tag_hello, hello);
    });
    requested_ = true;
  }
  /// Requests (if not done yet), waits for the decision and receives every part this rank
  /// wants of iteration k, verified; returns k. Throws deepclone::error naming what failed:
  /// a refusal (layout_mismatch naming the first difference, plan_mismatch), the sources'
  /// end of training, a source's failure without a replica, a timeout. The sources are told
  /// when this rank gives up, and train on; they end the fork for the clone ranks still
  /// receiving (errc::cancelled), while one that had verified all its parts has its k: the
  /// clone ranks do not commit as a group.
  std::uint64_t wait() {
    request();
    const auto d = await_decision();
    requested_ = false;
    partition_report r;
    r.session = d.session, r.iteration = d.iteration, r.agreement_s = seconds_since_request();
    try {
      if (d.epoch >= tags_.epochs)
        throw error(errc::plan_mismatch, who() + ": the sources chose tag block " + std::to_string(d.epoch) + " of " +
                                             std::to_string(tags_.epochs) + " (settings.tag_base or tag_epochs differ)");
      receive(d, r);
    } catch (const error& e) {
      request_.cancel_session(d.session, e.kind());
      throw;
    } catch (const std::exception& e) {  // a Memory policy's own failure (a device copy), or out of memory
      request_.cancel_session(d.session, errc::transport);
      throw error(errc::transport, who() + ": the fork of iteration " + std::to_string(d.iteration) + " failed: " + e.what());
    }
    request_.joined(d.session);
    report_ = std::move(r);
    metadata_ = std::exchange(arrived_metadata_, std::nullopt);
    return d.iteration;
  }
  /// This rank's figures of its last fork whose wait() returned (empty before the first).
  const partition_report& report() const noexcept { return report_; }
  /// Source 0's metadata of k (end_iteration(step, metadata)) of the last fork whose wait()
  /// returned; none where source 0 failed before sending it (the parts came from replicas).
  const std::optional<deepclone::metadata>& metadata() const noexcept { return metadata_; }

 private:
  std::string who() const { return "clone rank " + std::to_string(comm_.rank()); }

  detail::decision_msg await_decision() {
    detail::idler<Comm> idle(comm_);
    const auto deadline = detail::clock::now() + s_.timeout;
    for (;;) {
      idle.mark();
      std::optional<detail::request_answer> a;
      request_.progress(a);
      if (a) return accepted(*a);
      trailing_.poll(comm_);
      if (detail::clock::now() >= deadline) {
        request_.withdraw();
        request_.cancel();
        requested_ = false;
        throw error(errc::timeout, who() + ": no fork decision within settings.timeout (do the sources call their hooks, and "
                                           "fork_word()/fork_agreed() with a trainer-collective agreement?)");
      }
      idle.idle(deadline);
    }
  }
  /// The decision, if it accepted this request; else the error it means.
  detail::decision_msg accepted(const detail::request_answer& a) {
    const auto& d = a.decision;
    if (d.status == detail::verdict::accepted) return d;
    requested_ = false;
    if (d.status == detail::verdict::stopped)
      throw error(errc::source_failed, who() + ": the sources finished training (last step " + std::to_string(d.iteration) +
                                           ") before they could serve this request");
    const std::string offender = d.offending_clone < job_.ranks().clones.size()
                                     ? "clone rank " + std::to_string(job_.ranks().clones[d.offending_clone])
                                     : "another clone rank";
    if (d.status == detail::verdict::plan_differs) {
      if (d.key.reconstruct_param != key(job_).reconstruct_param)
        throw error(errc::plan_mismatch, who() + ": partition_job_options.failover is " + (d.key.reconstruct_param ? "on" : "off") +
                                             " at the sources and " + (d.key.reconstruct_param ? "off" : "on") + " here");
      const auto diff = d.key.difference(key(job_));
      throw error(errc::plan_mismatch, diff.empty() ? offender + " uses plan settings that differ from the sources'" : who() + ": " + diff);
    }
    std::optional<std::string> diff;
    try {
      diff = first_difference(layout::decode(a.sources_layout), job_.global(), "sources", who());
    } catch (const error&) {  // an unreadable layout: say only that it differs
    }
    throw error(errc::layout_mismatch, "partitioned state: " + diff.value_or(offender + "'s global layout differs from the sources' (this rank's matches)") +
                                           " (the global shapes and dtypes must agree)");
  }

  double seconds_since_request() const { return std::chrono::duration<double>(detail::clock::now() - requested_at_).count(); }

  /// Receives this rank's parts of fork `d`, listening for a source's failure status; fills
  /// in `out` what the transfer did.
  void receive(const detail::decision_msg& d, partition_report& out) {
    const auto& r = job_.ranks();
    struct statuses {
      Comm& c;
      std::vector<detail::inbox_slot<Comm>> slots;
      ~statuses() {
        for (auto& s : slots) s.cancel(c);
      }
    } st{comm_, std::vector<detail::inbox_slot<Comm>>(r.source_count())};
    for (std::size_t i = 0; i < st.slots.size(); ++i) st.slots[i].post(comm_, r.sources[i], s_.tag_base + detail::tag_status, detail::control_bytes);
    struct metadata_guard {  // the metadata's receives are withdrawn however this ends
      Comm& c;
      detail::metadata_receive<Comm, Checksum>& m;
      ~metadata_guard() { m.cancel(c); }
    } mg{comm_, meta_in_};
    arrived_metadata_.reset();
    meta_in_.open(comm_, r.sources[0], {tags_.metadata_header(d.epoch), tags_.metadata_blob(d.epoch)}, d.session, d.iteration, s_.max_metadata_bytes);
    partition_receiver<Comm, Checksum, Memory> in(comm_, job_.route(tags_.transfer(d.epoch), d.session), index_, parts_);
    detail::idler<Comm> idle(comm_);
    const auto deadline = detail::clock::now() + s_.timeout;
    out.layer_ready_s.assign(job_.global().layer_count(), -1.0);
    bool parts = false;
    const auto complete = [&] {  // every wanted byte, and source 0's metadata unless it failed
      parts = in.progress();
      if (!meta_in_.done()) meta_in_.progress(comm_, arrived_metadata_);
      return parts && (meta_in_.done() || source_zero_failed(in));
    };
    for (idle.mark(); !complete(); idle.mark()) {
      note_ready_layers(in, out);
      for (std::uint32_t i = 0; i < st.slots.size(); ++i) take_status(st.slots[i], i, d.session, in);
      in.presume_silent_failed();
      trailing_.poll(comm_);
      if (detail::clock::now() >= deadline)
        throw error(errc::timeout, who() + ": the fork of iteration " + std::to_string(d.iteration) + ": " +
                                       (parts ? "source 0's metadata" : in.missing()) + " did not arrive within settings.timeout");
      idle.idle(deadline);
    }
    note_ready_layers(in, out);
    out.readiness_s = seconds_since_request();
    complete_report(in, out);
  }
  /// What the completed transfer `in` did, into `out`.
  void complete_report(const partition_receiver<Comm, Checksum, Memory>& in, partition_report& out) const {
    out.wanted_bytes = job_.groups().bytes_received_by_clone(index_);
    for (auto g : job_.groups().forwarded_to_clone(index_)) out.wanted_bytes += job_.groups().forwards()[g].bytes;
    const auto v = in.verified();
    out.bytes_from_sources = v.from_sources, out.bytes_from_clones = v.from_clones;
    out.failed_sources = in.failed_sources();
    out.refetched_forwarders = in.refetched_forwarders();
    out.stale_groups = in.stale_groups();
    out.metadata_bytes = meta_in_.done() ? meta_in_.bytes() : 0;
  }
  /// Whether source 0, which sends the metadata, was presumed failed (its bytes came from replicas).
  static bool source_zero_failed(const partition_receiver<Comm, Checksum, Memory>& in) {
    const auto f = in.failed_sources();
    return !f.empty() && f.front() == 0;
  }
  /// Stamps each layer whose wanted bytes all became verified since the last call.
  void note_ready_layers(const partition_receiver<Comm, Checksum, Memory>& in, partition_report& r) const {
    for (std::uint32_t l = 0; l < r.layer_ready_s.size(); ++l)
      if (r.layer_ready_s[l] < 0 && in.layer_done(l)) r.layer_ready_s[l] = seconds_since_request();
  }
  /// Source `i`'s status for fork `session` (garbage and other forks' are dropped): a source
  /// that cannot serve it is failed over to the other holders of its bytes (with failover;
  /// errc::source_failed where none holds them), a fork ended for every clone rank fails here.
  void take_status(detail::inbox_slot<Comm>& slot, std::uint32_t i, std::uint64_t session, partition_receiver<Comm, Checksum, Memory>& in) {
    while (auto b = slot.test(comm_)) {
      std::optional<detail::status_msg> m;
      try {
        m = detail::status_msg::decode(*b);
      } catch (const error&) {
      }
      slot.repost(comm_);
      if (!m || m->session != session || m->code == 0) continue;
      const auto code = detail::peer_code(m->code, errc::source_failed);
      if (code == errc::cancelled || !job_.options().failover)
        throw error(code, "source " + std::to_string(i) + ": " + m->reason);
      const std::uint32_t failed[] = {i};
      in.fail_over(failed);
    }
  }

  Comm& comm_;
  const partition_job& job_;
  std::uint32_t index_;
  std::vector<std::span<std::byte>> parts_;
  settings s_;
  detail::partition_tags tags_;
  detail::handshake_terms terms_;  ///< what its hellos prove
  detail::outbox<Comm> trailing_;
  detail::clone_request<Comm> request_;
  bool requested_ = false;
  detail::clock::time_point requested_at_{};
  partition_report report_{};
  detail::metadata_receive<Comm, Checksum> meta_in_{true};  ///< source 0's metadata of the fork in flight (source 0 never withdraws it)
  std::optional<deepclone::metadata> arrived_metadata_, metadata_;  ///< ... as it arrived; of the last fork returned
};

}  // namespace deepclone
