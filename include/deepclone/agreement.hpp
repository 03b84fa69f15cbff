#pragma once
/// \file agreement.hpp
/// Agreement policies: how the N sources come to fork at the same iteration k.
///
/// An agreement policy decides *when* to fork; the source engine does the messaging (clone
/// requests, the decision to the other sources and to the clone ranks, refusals) and offers
/// it as an `agreement::context`. Two kinds of policy, told apart by `trainer_collective`:
///
/// - `trainer_collective = false` (e.g. `coordinator`): the engine calls
///     void end_iteration(agreement::context&, std::uint64_t step) const;
///   at the end of every iteration in which this source serves no clone. The coordinator
///   (source 0) decides there with `fork_at(k)`; the other sources `follow(step)` it.
/// - `trainer_collective = true` (e.g. `collective`): the trainer runs a collective over the
///   sources every iteration and lets it carry a word from each source (source.hpp,
///   `fork_word()`/`fork_agreed(sum)`); the engine calls
///     std::uint64_t word(agreement::context&) const;  // this source's word
///     void agreed(agreement::context&, std::uint64_t given, std::uint64_t sum) const;
///   (`given`: this source's word, `sum`: the sum of every source's word, the same on all)
///   and the policy forks in `agreed` with `fork_untouched()`/`join_untouched()`.
///
/// Every policy also has `static constexpr const char* name`. A policy is a member of the
/// engine's settings (`settings.agreement`), so it may carry its own parameters.

#include <cstdint>
#include <optional>
#include <string>

#include "error.hpp"

namespace deepclone::agreement {

/// What the source engine offers an agreement policy during one hook call.
class context {
 public:
  /// This source is source 0, the coordinator: it holds the clone ranks' requests and decides.
  virtual bool coordinator() const = 0;
  /// This source's index among the sources (0 is the coordinator).
  virtual std::uint32_t source_index() const = 0;
  /// The iteration whose end_iteration ran last (none before the first).
  virtual std::optional<std::uint64_t> last_iteration() const = 0;
  /// This source still serves a clone (a session agreed or in flight); no new fork then.
  virtual bool serving() const = 0;
  /// `settings.fork_lead`: the skew between sources the trainer declared, in iterations.
  virtual std::uint64_t fork_lead() const = 0;

  /// Coordinator: takes the clone requests that arrived; true when every clone rank's
  /// request is in hand and matches this source's layout and plan (a mismatched one is
  /// refused: every clone rank is told, and fails with layout_mismatch or plan_mismatch).
  virtual bool requests_accepted() = 0;
  /// Coordinator, after `requests_accepted()`: decides the fork at iteration `k`, which must
  /// lie after the last ended iteration (the layers of k are then still to be updated);
  /// tells the other sources and every clone rank, and starts serving it.
  virtual void fork_at(std::uint64_t k) = 0;
  /// Other sources: joins the coordinator's decision if one arrived, when its k lies after
  /// `step` (the iteration just ended); a later decision is refused with
  /// errc::fork_agreement, which the clone ranks are told.
  virtual void follow(std::uint64_t step) = 0;

  /// Coordinator, in `agreed` (trainer_collective policies only): forks at the newest iteration whose layers are all still
  /// untouched here (the last ended one, or the one in progress if a layer was already
  /// updated in it); its final layers leave at once.
  virtual void fork_untouched() = 0;
  /// Other sources, in `agreed` (trainer_collective policies only): waits (at most settings.failover_after) for the
  /// coordinator's decision of `fork_untouched` and serves it when its k is still untouched
  /// here; refused (errc::fork_agreement) when it is not, given up when it does not come.
  virtual void join_untouched() = 0;

 protected:
  ~context() = default;
};

/// Source 0 (the coordinator) forks at k = j + `settings.fork_lead` once it holds every
/// clone rank's request at its end_iteration(j), and sends the decision to the other
/// sources, which must learn it before iteration k starts (by their end_iteration(k - 1);
/// a later one fails the session with `errc::fork_agreement`). The lead is the tolerated skew
/// between sources, in iterations; the clone waits for it (about fork_lead iterations).
struct coordinator {
  static constexpr const char* name = "coordinator";
  static constexpr bool trainer_collective = false;
  void end_iteration(context& c, std::uint64_t step) const {
    if (!c.coordinator()) c.follow(step);
    else if (c.requests_accepted()) c.fork_at(step + c.fork_lead());
  }
};

/// The trainer's per-iteration collective carries the decision, so that every source
/// learns it in the same iteration and no skew need be tolerated. On every source, in the
/// same iteration, between end_iteration(j) and the first before_update of iteration j+1
/// (typically next to the gradient allreduce of iteration j+1):
///
///   auto w = src.fork_word();            // 1 on the coordinator holding every request, +2 on a
///                                        // source still serving a clone, else 0
///   ... add w to the trainer's allreduce (one extra element of the gradient buffer, or a
///       one-word allreduce over the sources) ...
///   src.fork_agreed(sum_of_w);           // the same sum on every source
///
/// The sum is a small integer, exact in any numeric type. When it is exactly 1 (the
/// coordinator is ready and no source is busy), the sources fork at the newest
/// iteration whose layers are all still untouched: k = j if no layer has been updated since
/// end_iteration(j) (every layer is sent at once), else k = j+1 (the layers already updated
/// in j+1, such as batch-norm statistics written in the forward pass, are sent at once, the
/// others as their updates end). The clone then waits only for the next collective.
struct collective {
  static constexpr const char* name = "collective";
  static constexpr bool trainer_collective = true;
  std::uint64_t word(context& c) const {
    const bool ready = c.coordinator() && !c.serving() && c.last_iteration() && c.requests_accepted();
    return (ready ? 1u : 0u) + (c.serving() ? 2u : 0u);
  }
  /// `given` is this source's word of the same iteration: the coordinator's bit 0 must
  /// survive the sum, or the trainer did not pass the sum of the words.
  void agreed(context& c, std::uint64_t given, std::uint64_t sum) const {
    if (c.coordinator() && (sum & 1) != (given & 1))
      throw error(errc::invalid_argument, "fork_agreed(" + std::to_string(sum) + ") on source 0, whose fork_word() was " +
                                              std::to_string(given) + ": pass the sum of every source's fork_word() of this iteration");
    if (sum != 1 || c.serving() || !c.last_iteration()) return;
    if (c.coordinator()) c.fork_untouched();
    else c.join_untouched();
  }
};

}  // namespace deepclone::agreement
