#pragma once
/// \file policy.hpp
/// The policy concepts: what a type must offer to be a sharding, reconstruction, pipeline,
/// agreement or checksum policy of `deepclone::engine`. Each concept is the conjunction of
/// one small concept per member, and the engine checks those one by one, so a policy a
/// user writes that lacks a member fails to compile with a message naming that member and
/// saying what it is for (not a wall of unsatisfied constraints).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "agreement.hpp"
#include "layout.hpp"
#include "piece.hpp"
#include "pipeline.hpp"
#include "reconstruct.hpp"

namespace deepclone {

namespace policy_member {
/// `static constexpr std::uint32_t id`: part of the plan key, so that sources and clones
/// using different policies are refused before any byte moves.
template <class P>
concept id = requires {
  { P::id } -> std::convertible_to<std::uint32_t>;
};
/// `static constexpr const char* name`: used in reports and error messages.
template <class P>
concept name = requires {
  { P::name } -> std::convertible_to<const char*>;
};
/// `std::uint64_t param() const`: the policy's setting, part of the plan key.
template <class P>
concept param = requires(const P& p) {
  { p.param() } -> std::convertible_to<std::uint64_t>;
};
/// `std::vector<piece> assign(const layout&, std::uint32_t sources, std::uint64_t alignment) const`.
template <class P>
concept assign = requires(const P& p, const layout& l) {
  { p.assign(l, std::uint32_t{}, std::uint64_t{}) } -> std::same_as<std::vector<piece>>;
};
/// `std::vector<piece> assign_owners(std::vector<piece>, const layout&, std::uint32_t clones, std::uint64_t alignment) const`.
template <class P>
concept assign_owners = requires(const P& p, const layout& l, std::vector<piece> v) {
  { p.assign_owners(v, l, std::uint32_t{}, std::uint64_t{}) } -> std::same_as<std::vector<piece>>;
};
/// `std::vector<reconstruct::hop> forwards(std::uint32_t owner, std::uint32_t clones) const`.
template <class P>
concept forwards = requires(const P& p) {
  { p.forwards(std::uint32_t{}, std::uint32_t{}) } -> std::same_as<std::vector<reconstruct::hop>>;
};
/// `void layer_final(pipeline::context&, std::size_t layer)`: the layer holds its bytes of
/// the fork iteration until it is overwritten; send (or stage, or queue) what leaves now.
template <class P>
concept layer_final = requires(P& p, pipeline::context& c) {
  { p.layer_final(c, std::size_t{}) } -> std::same_as<void>;
};
/// `bool may_overwrite(pipeline::context&, std::size_t layer)`: may the trainer update the
/// layer again (asked until true, with progress in between)?
template <class P>
concept may_overwrite = requires(P& p, pipeline::context& c) {
  { p.may_overwrite(c, std::size_t{}) } -> std::convertible_to<bool>;
};
/// `static constexpr bool trainer_collective`: does the trainer's own collective carry the decision?
template <class P>
concept trainer_collective = requires {
  { P::trainer_collective } -> std::convertible_to<bool>;
};
/// `void end_iteration(agreement::context&, std::uint64_t step) const`: an agreement that
/// decides at the end of an iteration (trainer_collective = false).
template <class P>
concept decides_at_end = requires(const P& p, agreement::context& c) {
  { p.end_iteration(c, std::uint64_t{}) } -> std::same_as<void>;
};
/// `std::uint64_t word(agreement::context&) const`: this source's word for the trainer's collective.
template <class P>
concept word = requires(const P& p, agreement::context& c) {
  { p.word(c) } -> std::convertible_to<std::uint64_t>;
};
/// `void agreed(agreement::context&, std::uint64_t given, std::uint64_t sum) const`: the collective's sum.
template <class P>
concept agreed = requires(const P& p, agreement::context& c) {
  { p.agreed(c, std::uint64_t{}, std::uint64_t{}) } -> std::same_as<void>;
};
/// The hooks an agreement needs: `end_iteration`, or `word` and `agreed` when the trainer's
/// collective carries the decision.
template <class P>
constexpr bool agreement_hooks() {
  if constexpr (!trainer_collective<P>) return false;
  else if constexpr (P::trainer_collective) return word<P> && agreed<P>;
  else return decides_at_end<P>;
}
/// `static std::uint64_t compute(std::span<const std::byte>)`.
template <class P>
concept compute = requires(std::span<const std::byte> b) {
  { P::compute(b) } -> std::same_as<std::uint64_t>;
};
}  // namespace policy_member

/// Which source sends which bytes (shard.hpp).
template <class P>
concept sharding_policy = policy_member::id<P> && policy_member::name<P> && policy_member::param<P> && policy_member::assign<P>;
/// Which clone ranks receive each piece from its source, and how clone ranks forward (reconstruct.hpp).
template <class P>
concept reconstruction_policy = policy_member::id<P> && policy_member::name<P> && policy_member::param<P> &&
                                policy_member::assign_owners<P> && policy_member::forwards<P>;
/// When and from where a source sends the bytes of the fork iteration (pipeline.hpp).
template <class P>
concept pipeline_policy = policy_member::name<P> && policy_member::layer_final<P> && policy_member::may_overwrite<P>;
/// How the sources agree on the fork iteration (agreement.hpp).
template <class P>
concept agreement_policy = policy_member::name<P> && policy_member::trainer_collective<P> && policy_member::agreement_hooks<P>();
/// How a piece is checked on arrival (checksum.hpp).
template <class P>
concept checksum_policy = policy_member::id<P> && policy_member::name<P> && policy_member::compute<P>;

namespace detail {
/// Instantiated by the engine: one static_assert per member, each naming what is missing.
template <class Shard, class Pipeline, class Reconstruct, class Checksum, class Agreement>
struct policy_check {
  static_assert(policy_member::id<Shard>, "sharding policy: needs `static constexpr std::uint32_t id` (in the plan key)");
  static_assert(policy_member::name<Shard>, "sharding policy: needs `static constexpr const char* name` (reports, errors)");
  static_assert(policy_member::param<Shard>, "sharding policy: needs `std::uint64_t param() const` (its setting, in the plan key)");
  static_assert(policy_member::assign<Shard>,
                "sharding policy: needs `std::vector<piece> assign(const layout&, std::uint32_t sources, std::uint64_t "
                "alignment) const` (which source sends which byte range; every byte exactly once)");
  static_assert(policy_member::id<Reconstruct>, "reconstruction policy: needs `static constexpr std::uint32_t id` (in the plan key)");
  static_assert(policy_member::name<Reconstruct>, "reconstruction policy: needs `static constexpr const char* name` (reports, errors)");
  static_assert(policy_member::param<Reconstruct>,
                "reconstruction policy: needs `std::uint64_t param() const` (its setting, in the plan key)");
  static_assert(policy_member::assign_owners<Reconstruct>,
                "reconstruction policy: needs `std::vector<piece> assign_owners(std::vector<piece>, const layout&, "
                "std::uint32_t clones, std::uint64_t alignment) const` (the clone rank receiving each piece from its "
                "source, or piece::all_clones)");
  static_assert(policy_member::forwards<Reconstruct>,
                "reconstruction policy: needs `std::vector<reconstruct::hop> forwards(std::uint32_t owner, std::uint32_t "
                "clones) const` (the clone-to-clone hops of a piece sent to `owner` only, in dependency order; "
                "return {} when no piece has a single owner)");
  static_assert(policy_member::name<Pipeline>, "pipeline policy: needs `static constexpr const char* name` (reports, errors)");
  static_assert(policy_member::layer_final<Pipeline>,
                "pipeline policy: needs `void layer_final(pipeline::context&, std::size_t layer)` (called when the layer "
                "holds its bytes of the fork iteration: send, stage or queue them; see pipeline.hpp)");
  static_assert(policy_member::may_overwrite<Pipeline>,
                "pipeline policy: needs `bool may_overwrite(pipeline::context&, std::size_t layer)` (may the trainer "
                "update the layer again? asked in before_update until true; see pipeline.hpp)");
  static_assert(policy_member::id<Checksum>, "checksum policy: needs `static constexpr std::uint32_t id` (in the plan key)");
  static_assert(policy_member::name<Checksum>, "checksum policy: needs `static constexpr const char* name` (reports, errors)");
  static_assert(policy_member::compute<Checksum>,
                "checksum policy: needs `static std::uint64_t compute(std::span<const std::byte>)` (a piece's sum)");
  static_assert(policy_member::name<Agreement>, "agreement policy: needs `static constexpr const char* name` (reports, errors)");
  static_assert(policy_member::trainer_collective<Agreement>,
                "agreement policy: needs `static constexpr bool trainer_collective` (does the trainer's own "
                "collective carry the fork decision? see agreement.hpp)");
  static constexpr bool collective_kind = [] {
    if constexpr (policy_member::trainer_collective<Agreement>) return bool(Agreement::trainer_collective);
    else return false;
  }();
  static constexpr bool end_kind = policy_member::trainer_collective<Agreement> && !collective_kind;
  static_assert(!end_kind || policy_member::decides_at_end<Agreement>,
                "agreement policy (trainer_collective = false): needs `void end_iteration(agreement::context&, std::uint64_t "
                "step) const` (called at the end of each iteration served by no clone: the coordinator decides with "
                "fork_at, the others follow; see agreement.hpp)");
  static_assert(!collective_kind || policy_member::word<Agreement>,
                "agreement policy (trainer_collective = true): needs `std::uint64_t word(agreement::context&) const` (this "
                "source's word for the trainer's collective, a sum over the sources; see agreement.hpp)");
  static_assert(!collective_kind || policy_member::agreed<Agreement>,
                "agreement policy (trainer_collective = true): needs `void agreed(agreement::context&, std::uint64_t given, "
                "std::uint64_t sum) const` (the collective's sum, the same on every source: fork here; see agreement.hpp)");
  static constexpr bool ok = sharding_policy<Shard> && pipeline_policy<Pipeline> && reconstruction_policy<Reconstruct> &&
                             checksum_policy<Checksum> && agreement_policy<Agreement>;
};
}  // namespace detail

}  // namespace deepclone
