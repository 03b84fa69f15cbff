#pragma once
/// \file engine.hpp
/// `engine<Comm, Shard, Pipeline, Reconstruct, Checksum, Agreement>` binds the compile-time policies
/// to a communicator type and gives the two roles: `engine<...>::source<T>` (hooks in the
/// trainer of a source rank) and `engine<...>::clone<T>` (on a clone rank).
///
///   using cloning = deepclone::engine<deepclone::inproc::communicator>;   // all defaults
///   cloning::source src(comm, roles, state);      // T deduced from deepclone::state<T>
///   cloning::clone  dst(comm, roles, clone_state);

#include <chrono>
#include <memory>
#include <string>

#include "agreement.hpp"
#include "checksum.hpp"
#include "clone.hpp"
#include "communicator.hpp"
#include "detail/state_access.hpp"
#include "pipeline.hpp"
#include "plan.hpp"
#include "policy.hpp"
#include "reconstruct.hpp"
#include "roles.hpp"
#include "shard.hpp"
#include "source.hpp"
#include "state.hpp"

namespace deepclone {

template <class Comm, class Shard = shard::split_even, class Pipeline = pipeline::window,
          class Reconstruct = reconstruct::scatter_exchange, class Checksum = checksum::mix64,
          class Agreement = agreement::coordinator>
class engine {
  static_assert(point_to_point_communicator<Comm>,
                "deepclone::engine: Comm must model point_to_point_communicator: rank(), size(), a movable and "
                "default-constructible request_type, isend/irecv over std::byte spans returning it, "
                "test(r) -> std::optional<std::size_t>, wait(r) -> std::size_t, cancel(r); the contract is in "
                "communicator.hpp and docs/communicator.md, a minimal adapter in examples/own_communicator.cpp");
  static_assert(detail::policy_check<Shard, Pipeline, Reconstruct, Checksum, Agreement>::ok,
                "deepclone::engine: a policy lacks a member (the message above names it; policy.hpp lists them)");

 public:
  using comm_type = Comm;
  using shard_type = Shard;
  using pipeline_type = Pipeline;
  using reconstruct_type = Reconstruct;
  using checksum_type = Checksum;
  using agreement_type = Agreement;

  /// Run-time settings: the policies' values plus engine-wide knobs. Sources and clones
  /// must use equal plan-relevant settings; a difference is refused with `plan_mismatch`.
  struct settings {
    Shard shard{};
    Pipeline pipeline{};
    Reconstruct reconstruct{};
    /// How the sources agree on the fork iteration (agreement.hpp); sources only.
    Agreement agreement{};
    plan_options plan{};
    /// Longest wait without progress before a clone fails or a source drops a session.
    std::chrono::nanoseconds timeout = std::chrono::seconds(60);
    /// A clone rank that receives nothing for this long while some sources do deliver
    /// presumes the silent ones failed and asks the others for their pieces. Keep it above
    /// a few iterations' time and below `timeout`.
    std::chrono::nanoseconds failover_after = std::chrono::seconds(10);
    /// Source side: the least time between two rounds of session progress that
    /// `after_update` makes on its own (tests for acknowledgements, refetches and sends).
    /// Every round is a few transport tests, each of which may enter the transport's
    /// progress engine (MPI: `opal_progress`, which yields the core to other processes on an
    /// oversubscribed node); a trainer calls `after_update` once per layer, so an unbounded
    /// rate puts hundreds of rounds into every iteration while a session is in flight. A hook
    /// that must wait (a layer not yet released) and `end_iteration` progress regardless.
    /// 0 (the default): a round in every `after_update`; `nanoseconds::max()`: never on its
    /// own. A sweep of 0, 1 and 5 ms under mpirun showed no gain beyond the rounds' spread
    /// (docs/performance.md), so the default stays what it was.
    std::chrono::nanoseconds poll_interval{0};
    /// agreement::coordinator (and user policies that read it from agreement::context): the
    /// coordinator forks at (iteration in which it saw every clone request) + fork_lead.
    /// Other sources must learn the decision before iteration k starts, so this is the
    /// tolerated skew between sources, in iterations.
    std::uint64_t fork_lead = 2;
    /// deepclone uses tags [tag_base, tag_base + 16 + tag_epochs * (4 * layers + 4)); keep
    /// the trainer's own messages on that communicator outside this range.
    int tag_base = 1000;
    /// Consecutive sessions use different blocks of tags for their bulk messages, so that
    /// bytes an abandoned or faulty session left queued on the transport are never taken
    /// by the next ones (only by the one `tag_epochs` sessions later, whose checks catch
    /// them). Fewer blocks are used when the transport's tag bound allows fewer.
    std::uint32_t tag_epochs = 16;
    /// Source side, for debugging a trainer: checks that nothing writes a layer's tensors
    /// between its `after_update` in one iteration and its `before_update` in the next
    /// (e.g. batch-norm statistics written in the forward pass), and throws
    /// `errc::outside_hooks` from `before_update` naming the tensor. Costs two checksum
    /// passes over the host-memory state per iteration.
    bool check_writes = false;
    /// Clone side: the largest metadata blob accepted (its length comes from the wire).
    std::uint64_t max_metadata_bytes = std::uint64_t{1} << 30;
    /// Clone side: also check that every source's replica equals the state received. Each
    /// source then checksums its whole replica of iteration k (not only its S/N share:
    /// one extra pass over S bytes per source, on the training thread, as layers become
    /// final) and sends the folded digest; `wait()` returns only when every source that did
    /// not fail sent a digest equal to the received state's, else `errc::replica_mismatch`
    /// names the divergent sources. Catches replicas that drifted apart (the per-piece
    /// checks cannot: each piece matches its own sender). Needs a checksum policy other
    /// than `checksum::none` and host-memory source tensors. Sources follow the request.
    bool verify_replicas = false;
  };

  /// The shells: the only part of either role compiled per tensor type (the engines see
  /// the state through detail::state_access).
  template <tensor T>
  class source : private detail::state_access_holder<T>, public detail::source_engine<Comm, Pipeline, Checksum, Agreement> {
   public:
    source(Comm& comm, const deepclone::roles& r, deepclone::state<T>& st, settings s = {})
        : detail::state_access_holder<T>(st),
          detail::source_engine<Comm, Pipeline, Checksum, Agreement>(comm, r, this->access, source_config_of(std::move(s))) {}
  };

  template <tensor T>
  class clone : private detail::state_access_holder<T>, public detail::clone_engine<Comm, Checksum> {
   public:
    clone(Comm& comm, const deepclone::roles& r, deepclone::state<T>& st, settings s = {})
        : detail::state_access_holder<T>(st),
          detail::clone_engine<Comm, Checksum>(comm, r, this->access, clone_config_of(std::move(s))) {}
  };

  // Deduction guides, so that `cloning::source src(comm, roles, state);` deduces T from
  // deepclone::state<T>. g++ 12 deduces it from the constructors alone; clang 14 does not
  // deduce a member template of a class template without them.
  template <tensor T>
  source(Comm&, const deepclone::roles&, deepclone::state<T>&) -> source<T>;
  template <tensor T>
  source(Comm&, const deepclone::roles&, deepclone::state<T>&, settings) -> source<T>;
  template <tensor T>
  clone(Comm&, const deepclone::roles&, deepclone::state<T>&) -> clone<T>;
  template <tensor T>
  clone(Comm&, const deepclone::roles&, deepclone::state<T>&, settings) -> clone<T>;

  /// The plan every rank of this engine computes for `lay`. A pipeline with a piece limit
  /// (staged: its ring) has pieces cut to fit, so the plan depends on it too.
  static deepclone::plan make_plan(const layout& lay, const deepclone::roles& r, const settings& s) {
    plan_options o = s.plan;
    if constexpr (requires { { s.pipeline.max_piece_bytes() } -> std::convertible_to<std::uint64_t>; }) {
      const std::uint64_t a = o.alignment ? o.alignment : 1, cap = s.pipeline.max_piece_bytes() / a * a;
      if (cap == 0)
        throw error(errc::invalid_argument, std::string("pipeline::") + Pipeline::name +
                                                ": its piece limit (staging_bytes) must be at least the alignment");
      o.max_piece_bytes = std::min(o.max_piece_bytes, cap);
    }
    return deepclone::make_plan(lay, r.source_count(), r.clone_count(), s.shard, s.reconstruct, o, Checksum::id);
  }

  static std::string describe(const settings&) {
    std::string d = std::string(Shard::name) + "/" + Pipeline::name + "/" + Reconstruct::name + "/" + Checksum::name;
    if constexpr (Agreement::trainer_collective) d += std::string("/") + Agreement::name;
    return d;
  }

 private:
  /// What a source's engine takes from `s` (the source engine is not templated on the
  /// sharding and reconstruction policies). The settings move to the heap, where the engine's
  /// pipeline and agreement values and the plan function share them.
  static detail::source_config<Pipeline, Agreement> source_config_of(settings s) {
    auto held = std::make_shared<settings>(std::move(s));
    return {.settings = held, .pipeline = held->pipeline, .agreement = held->agreement, .timeout = held->timeout,
            .failover_after = held->failover_after, .poll_interval = held->poll_interval, .fork_lead = held->fork_lead,
            .tag_base = held->tag_base, .tag_epochs = held->tag_epochs, .check_writes = held->check_writes,
            .make_plan = plan_maker(held)};
  }
  /// What a clone rank's engine takes from `s` (the clone engine is templated on the
  /// communicator and the checksum policy only).
  static detail::clone_config clone_config_of(settings s) {
    auto held = std::make_shared<const settings>(std::move(s));
    return {.timeout = held->timeout, .failover_after = held->failover_after, .tag_base = held->tag_base,
            .max_metadata_bytes = held->max_metadata_bytes, .verify_replicas = held->verify_replicas,
            .make_plan = plan_maker(held), .policies = describe(*held)};
  }
  /// `make_plan` over settings `held` shares: how the engines compute the plan of a layout.
  static auto plan_maker(std::shared_ptr<const settings> held) {
    return [held = std::move(held)](const layout& lay, const deepclone::roles& r) { return make_plan(lay, r, *held); };
  }
};

}  // namespace deepclone
