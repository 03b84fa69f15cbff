#pragma once
/// \file shard.hpp
/// Sharding policies: which source sends which bytes. Every source holds the same
/// replicated state, so any assignment is correct; the policy decides how evenly the
/// work spreads (aggregate bandwidth grows with N when it is even).
///
/// A sharding policy is a type with
///   static constexpr std::uint32_t id;  static constexpr const char* name;
///   std::uint64_t param() const;        // its setting, part of the plan key
///   std::vector<piece> assign(const layout&, std::uint32_t sources, std::uint64_t alignment) const;
/// returning pieces that cover every byte of every tensor exactly once, `owner` unset.

#include <algorithm>
#include <numeric>
#include <vector>

#include "error.hpp"
#include "piece.hpp"

namespace deepclone::shard {

namespace detail {
inline void whole(const layout& l, std::uint32_t t, std::uint32_t source, std::vector<piece>& out) {
  auto b = l.tensor(t).bytes;
  if (b) out.push_back({t, static_cast<std::uint32_t>(l.layer_of(t)), 0, b, source, piece::all_clones});
}
}  // namespace detail

/// The paper's scheme, improved: tensors of at least `threshold` bytes are split evenly
/// over all N sources (element- and alignment-aligned, longest part to the least-loaded source); smaller ones go
/// whole to the least-loaded source, largest first (the paper sends them round-robin).
/// Bound: bytes per source <= S/N + largest unsplit tensor + one granule.
struct split_even {
  static constexpr std::uint32_t id = 1;
  static constexpr const char* name = "split_even";
  std::uint64_t threshold = 1u << 20;

  std::uint64_t param() const { return threshold; }
  std::vector<piece> assign(const layout& l, std::uint32_t n, std::uint64_t alignment) const {
    std::vector<piece> out;
    std::vector<std::uint64_t> loads(n, 0);
    std::vector<std::pair<std::uint32_t, std::uint64_t>> small;
    for (std::uint32_t t = 0; t < l.tensor_count(); ++t) {
      auto& d = l.tensor(t);
      if (d.bytes == 0) continue;
      if (d.bytes < threshold || n == 1) {
        small.emplace_back(t, d.bytes);
        continue;
      }
      auto g = granule(d, alignment);
      // rotate = n-1 gives the short last range an extra granule when there are extras, so
      // all parts are within one granule of each other; the longest part then goes to the
      // least-loaded source, which keeps every load within one granule of the others (a
      // fixed part -> source mapping let the short tails pile up on one source).
      auto parts = split_range(d.bytes, n, g, n - 1);
      std::vector<std::uint32_t> by_load(n);
      std::iota(by_load.begin(), by_load.end(), 0u);
      std::stable_sort(by_load.begin(), by_load.end(), [&](auto a, auto b) { return loads[a] < loads[b]; });
      std::vector<std::size_t> by_len(parts.size());
      std::iota(by_len.begin(), by_len.end(), std::size_t{0});
      std::stable_sort(by_len.begin(), by_len.end(), [&](auto a, auto b) { return parts[a].second > parts[b].second; });
      for (std::size_t i = 0; i < parts.size(); ++i) {
        auto [off, len] = parts[by_len[i]];
        const std::uint32_t s = by_load[i];
        out.push_back({t, static_cast<std::uint32_t>(l.layer_of(t)), off, len, s, piece::all_clones});
        loads[s] += len;
      }
    }
    auto bins = deepclone::detail::lpt_assign(small, loads);
    for (std::size_t i = 0; i < small.size(); ++i) detail::whole(l, small[i].first, bins[i], out);
    return out;
  }
};

/// Whole tensors balanced by bytes (largest first onto the least-loaded source).
/// Bound: bytes per source <= S/N + largest tensor.
struct whole_tensor {
  static constexpr std::uint32_t id = 2;
  static constexpr const char* name = "whole_tensor";
  std::uint64_t param() const { return 0; }
  std::vector<piece> assign(const layout& l, std::uint32_t n, std::uint64_t) const {
    std::vector<std::pair<std::uint32_t, std::uint64_t>> items;
    for (std::uint32_t t = 0; t < l.tensor_count(); ++t) items.emplace_back(t, l.tensor(t).bytes);
    std::vector<std::uint64_t> loads(n, 0);
    auto bins = deepclone::detail::lpt_assign(items, loads);
    std::vector<piece> out;
    for (std::size_t i = 0; i < items.size(); ++i) detail::whole(l, items[i].first, bins[i], out);
    return out;
  }
};

/// Whole layers round-robin: layer i from source i mod N. Simple and locality-friendly,
/// but unbalanced when layer sizes differ.
/// Bound: bytes per source <= sum of the ceil(L/N) largest layers.
struct layer_round_robin {
  static constexpr std::uint32_t id = 3;
  static constexpr const char* name = "layer_round_robin";
  std::uint64_t param() const { return 0; }
  std::vector<piece> assign(const layout& l, std::uint32_t n, std::uint64_t) const {
    std::vector<piece> out;
    for (std::uint32_t t = 0; t < l.tensor_count(); ++t)
      detail::whole(l, t, static_cast<std::uint32_t>(l.layer_of(t) % n), out);
    return out;
  }
};

/// Everything from one source (the root broadcast baseline). Bytes on the root: S.
struct single_root {
  static constexpr std::uint32_t id = 4;
  static constexpr const char* name = "single_root";
  std::uint32_t root = 0;
  std::uint64_t param() const { return root; }
  std::vector<piece> assign(const layout& l, std::uint32_t n, std::uint64_t) const {
    if (root >= n)
      throw error(errc::invalid_argument, "shard::single_root: root " + std::to_string(root) + " but only " +
                                              std::to_string(n) + " sources");
    std::vector<piece> out;
    for (std::uint32_t t = 0; t < l.tensor_count(); ++t) detail::whole(l, t, root, out);
    return out;
  }
};

}  // namespace deepclone::shard
