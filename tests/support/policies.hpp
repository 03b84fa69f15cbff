#pragma once
// Reconstruction and agreement policies written as a user would, outside the library, for
// the plan, clone and agreement tests: the engine runs them without any change of its own code.
#include <deepclone/agreement.hpp>
#include <deepclone/piece.hpp>
#include <deepclone/reconstruct.hpp>

#include <cstdint>
#include <vector>

namespace deepclone::testing {

/// A relay along the clone ranks: the sources send each byte once, to an owner (as
/// scatter_exchange picks them), and the owner's bytes travel hop by hop along the line
/// 0 - 1 - ... - M-1 in both directions, so each clone rank sends only to its neighbours
/// (what a torus or a chain of switches favours over the flat owner -> all).
struct relay_chain : reconstruct::scatter_exchange {
  static constexpr std::uint32_t id = 101;
  static constexpr const char* name = "relay_chain";
  std::vector<reconstruct::hop> forwards(std::uint32_t owner, std::uint32_t clones) const {
    std::vector<reconstruct::hop> out;
    for (std::uint32_t c = owner; c + 1 < clones; ++c) out.push_back({c, c + 1});
    for (std::uint32_t c = owner; c > 0; --c) out.push_back({c, c - 1});
    return out;
  }
};

/// A broken topology: the ring owner -> owner+1 -> ... (mod M). Every clone rank receives
/// every byte once, but with three or more clone ranks each rank's group for its successor
/// holds pieces it receives from its predecessor: the forwards wait on each other.
struct relay_ring : reconstruct::scatter_exchange {
  static constexpr std::uint32_t id = 102;
  static constexpr const char* name = "relay_ring";
  std::vector<reconstruct::hop> forwards(std::uint32_t owner, std::uint32_t clones) const {
    std::vector<reconstruct::hop> out;
    for (std::uint32_t i = 0; i + 1 < clones; ++i) out.push_back({(owner + i) % clones, (owner + i + 1) % clones});
    return out;
  }
};

/// A broken order: the hop out of the owner's neighbour is listed before the hop into it.
struct relay_out_of_order : reconstruct::scatter_exchange {
  static constexpr std::uint32_t id = 103;
  static constexpr const char* name = "relay_out_of_order";
  std::vector<reconstruct::hop> forwards(std::uint32_t owner, std::uint32_t clones) const {
    if (clones < 3) return relay_chain{}.forwards(owner, clones);
    const std::uint32_t a = (owner + 1) % clones, b = (owner + 2) % clones;
    std::vector<reconstruct::hop> out{{a, b}, {owner, a}};
    for (std::uint32_t c = 0; c < clones; ++c)
      if (c != owner && c != a && c != b) out.push_back({owner, c});
    return out;
  }
};

/// A user's agreement: fork only at iterations that are multiples of `period` (where, say,
/// an HPC code writes its simulation output), at least settings.fork_lead after the
/// iteration in which the coordinator held every request. The messaging is the engine's.
struct on_period {
  static constexpr const char* name = "on_period";
  static constexpr bool trainer_collective = false;
  std::uint64_t period = 5;
  void end_iteration(agreement::context& c, std::uint64_t step) const {
    if (!c.coordinator()) return c.follow(step);
    if (!c.requests_accepted()) return;
    const std::uint64_t earliest = step + c.fork_lead();
    c.fork_at((earliest + period - 1) / period * period);
  }
};

/// Broken agreements, each breaking one rule of agreement::context.
/// Forks at the iteration that just ended (its layers may already be overwritten).
struct fork_in_the_past {
  static constexpr const char* name = "fork_in_the_past";
  static constexpr bool trainer_collective = false;
  void end_iteration(agreement::context& c, std::uint64_t step) const {
    if (!c.coordinator()) return c.follow(step);
    if (c.requests_accepted()) c.fork_at(step);
  }
};
/// Every source acts as the coordinator.
struct everyone_decides {
  static constexpr const char* name = "everyone_decides";
  static constexpr bool trainer_collective = false;
  void end_iteration(agreement::context& c, std::uint64_t step) const {
    if (c.requests_accepted()) c.fork_at(step + 1);
  }
};
/// Decides without asking whether every clone rank's request is in hand.
struct decides_unasked {
  static constexpr const char* name = "decides_unasked";
  static constexpr bool trainer_collective = false;
  void end_iteration(agreement::context& c, std::uint64_t step) const {
    if (!c.coordinator()) return c.follow(step);
    c.fork_at(step + 1);
  }
};
/// Uses the trainer collective's fork (fork_untouched) at the end of an iteration, where
/// the sources are not in step.
struct untouched_at_end {
  static constexpr const char* name = "untouched_at_end";
  static constexpr bool trainer_collective = false;
  void end_iteration(agreement::context& c, std::uint64_t step) const {
    if (!c.coordinator()) return c.follow(step);
    if (c.requests_accepted()) c.fork_untouched();
  }
};

}  // namespace deepclone::testing
