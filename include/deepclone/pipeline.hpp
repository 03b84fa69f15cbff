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
/// link: when a layer of the fork iteration is about to be overwritten while some clone
/// rank has not yet verified it, the bytes this source still owes for it are copied into a
/// spill buffer, and its remaining sends and refetches are served from there. Zero copies
/// when the network keeps up. Data sends are posted `inflight_bytes` at a time (so that a
/// layer about to be overwritten waits for at most that much already on the wire); the
/// buffer is at most this source's share of the state, or `spill_bytes` if less. When the
/// buffer is full the source waits for the layer, as `window` does.
struct spill {
  static constexpr kind value = kind::spill;
  static constexpr const char* name = "spill";
  std::uint64_t spill_bytes = std::uint64_t{1} << 40;
  std::uint64_t inflight_bytes = 32ull << 20;
};

/// Stop the world at the end of the fork iteration and send everything before training
/// resumes: the baseline the other two are measured against.
struct blocking {
  static constexpr kind value = kind::blocking;
  static constexpr const char* name = "blocking";
};

}  // namespace deepclone::pipeline
