#pragma once
/// \file reconstruct.hpp
/// Reconstruction policies: how the M clone ranks come to hold every byte. A policy owns
/// two decisions, and the plan (plan.hpp) checks both:
///
///   static constexpr std::uint32_t id;  static constexpr const char* name;
///   std::uint64_t param() const;        // its setting, part of the plan key
///   // Which clone rank receives each piece from its source: `owner` = a clone index, or
///   // piece::all_clones (every clone rank receives it from the source; no forwarding).
///   std::vector<piece> assign_owners(std::vector<piece>, const layout&, std::uint32_t clones,
///                                    std::uint64_t alignment) const;
///   // The forwarding topology: the clone-to-clone hops a piece sent to `owner` only takes,
///   // in dependency order (a hop's `from` is the owner or the `to` of an earlier hop).
///   std::vector<hop> forwards(std::uint32_t owner, std::uint32_t clones) const;
///
/// The plan refuses, naming the policy and the rule: a hop from a clone rank that does not
/// hold the piece yet, a clone rank that receives a byte twice or never, and forwards that
/// wait on each other in a cycle (a clone rank forwards a layer's group to a peer once it
/// holds every piece of that group). A user policy is any type with these members; see
/// tests/support/policies.hpp for a chain that relays pieces along the clone ranks (run by
/// unit.policies).

#include <cstdint>
#include <vector>

#include "piece.hpp"

namespace deepclone::reconstruct {

/// One clone-to-clone forward of a piece: clone rank `from` sends it to clone rank `to`.
struct hop {
  std::uint32_t from = 0, to = 0;
  bool operator==(const hop&) const = default;
};

/// Every clone rank receives every byte straight from the sources. Sources send S*M/N
/// bytes each; no traffic inside the clone group.
struct direct {
  static constexpr std::uint32_t id = 1;
  static constexpr const char* name = "direct";
  std::uint64_t param() const { return 0; }
  std::vector<piece> assign_owners(std::vector<piece> pieces, const layout&, std::uint32_t, std::uint64_t) const {
    for (auto& p : pieces) p.owner = piece::all_clones;
    return pieces;
  }
  /// No hops: every piece reaches every clone rank from its source (make_plan still asks,
  /// once per owner, like any policy).
  std::vector<hop> forwards(std::uint32_t, std::uint32_t) const { return {}; }
};

/// Each byte leaves the sources once, to one "owner" clone rank, which verifies it and
/// forwards it to the other clone ranks. A layer is forwarded as soon as the owner holds
/// all its owned pieces of that layer, so tensors complete layer by layer, not after the
/// last layer. Pieces of at least `threshold` bytes are split over the M clone ranks;
/// smaller ones go whole to the least-loaded clone rank.
struct scatter_exchange {
  static constexpr std::uint32_t id = 2;
  static constexpr const char* name = "scatter_exchange";
  std::uint64_t threshold = 1u << 20;

  std::uint64_t param() const { return threshold; }
  /// Flat: the owner sends to every other clone rank (one hop each, all at once).
  std::vector<hop> forwards(std::uint32_t owner, std::uint32_t clones) const {
    std::vector<hop> out;
    for (std::uint32_t c = 0; c < clones; ++c)
      if (c != owner) out.push_back({owner, c});
    return out;
  }
  std::vector<piece> assign_owners(std::vector<piece> pieces, const layout& l, std::uint32_t m,
                                   std::uint64_t alignment) const {
    std::vector<piece> out;
    std::vector<std::uint64_t> loads(m, 0);
    std::vector<std::pair<std::uint32_t, std::uint64_t>> small;  // (index into pieces, bytes)
    std::uint64_t rotate = 0;
    for (std::uint32_t i = 0; i < pieces.size(); ++i) {
      auto& p = pieces[i];
      if (p.length < threshold || m == 1) {
        small.emplace_back(i, p.length);
        continue;
      }
      auto g = granule(l.tensor(p.tensor), alignment);
      auto parts = split_range(p.length, m, g, rotate);
      rotate += ((p.length + g - 1) / g) % m;
      for (std::uint32_t c = 0; c < parts.size(); ++c) {
        piece q = p;
        q.offset = p.offset + parts[c].first;
        q.length = parts[c].second;
        q.owner = c;
        loads[c] += q.length;
        out.push_back(q);
      }
    }
    auto bins = deepclone::detail::lpt_assign(small, loads);
    for (std::size_t i = 0; i < small.size(); ++i) {
      piece q = pieces[small[i].first];
      q.owner = bins[i];
      out.push_back(q);
    }
    return out;
  }
};

}  // namespace deepclone::reconstruct
