#pragma once
/// \file pipeline.hpp
/// Pipeline policies: when and from where a source sends the bytes of the fork iteration.
/// The source engine (source.hpp) implements all four; the policy value carries settings.

#include <cstdint>

namespace deepclone::pipeline {

enum class kind { window, staged, blocking, spill };

/// Send straight from the live tensors right after each layer's update in the fork
/// iteration; wait, if at all, only right before that layer is updated again. No extra
/// memory; the source stalls only if a layer's transfer outlasts almost a whole iteration.
struct window {
  static constexpr kind value = kind::window;
  static constexpr const char* name = "window";
};

/// Copy this source's pieces of each layer into a bounded staging ring right after the
/// update, then send from there: the tensor's window closes at once (what device memory
/// needs), at the price of a copy and `staging_bytes` of memory. Pieces are cut to fit.
struct staged {
  static constexpr kind value = kind::staged;
  static constexpr const char* name = "staged";
  std::uint64_t staging_bytes = 64ull << 20;
};

/// Send from the live tensors as `window` does, but never hold the trainer for a slow
/// link. During the fork iteration k, data sends from the tensors are posted at most
/// `inflight_bytes` at a time; once k ended, what is still queued is copied into a spill
/// buffer and posted from there, and a layer that is about to be overwritten while a clone
/// rank has not yet verified it has its owed bytes copied too (refetches are then served
/// from the copies). The source waits only for the sends already on the wire from a tensor
/// (at most `inflight_bytes`). Nothing is copied when the network keeps up. The buffer is
/// this source's share of the state, or `spill_bytes` if less, allocated (and touched) when
/// the source is created; when it is full the source waits for a layer as `window` does.
struct spill {
  static constexpr kind value = kind::spill;
  static constexpr const char* name = "spill";
  std::uint64_t spill_bytes = std::uint64_t{1} << 40;
  std::uint64_t inflight_bytes = 4ull << 20;
};

/// Stop the world at the end of the fork iteration and send everything before training
/// resumes: the baseline the other two are measured against.
struct blocking {
  static constexpr kind value = kind::blocking;
  static constexpr const char* name = "blocking";
};

}  // namespace deepclone::pipeline
