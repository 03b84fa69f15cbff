#pragma once
/// \file agreement.hpp
/// Agreement policies: how the N sources come to fork at the same iteration k.
///
/// An agreement policy is a type with
///   static constexpr const char* name;
///   static constexpr bool trainer_collective;   // does the trainer's own collective carry the decision?
///
/// `coordinator` needs nothing from the trainer; `collective` needs two calls around a
/// collective the trainer runs every iteration anyway, and forks without a lead.

namespace deepclone::agreement {

/// Source 0 (the coordinator) forks at k = j + `settings.fork_lead` once it holds every
/// clone rank's request at its end_iteration(j), and sends the decision to the other
/// sources, which must learn it before iteration k starts (by their end_iteration(k - 1);
/// a later one fails the session with `errc::fork_agreement`). The lead is the tolerated skew
/// between sources, in iterations; the clone waits for it (about fork_lead iterations).
struct coordinator {
  static constexpr const char* name = "coordinator";
  static constexpr bool trainer_collective = false;
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
};

}  // namespace deepclone::agreement
