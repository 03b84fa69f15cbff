#pragma once
// Reconstruction policies written as a user would, outside the library, for the plan and
// clone tests: the engine runs them without any change of its own code.
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

}  // namespace deepclone::testing
