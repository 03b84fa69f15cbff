#pragma once
/// \file piece.hpp
/// A piece is the unit of transfer: one contiguous byte range of one tensor, sent by one
/// source. Sharding policies produce pieces; reconstruction policies say which clone
/// ranks receive each piece from its source.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "layout.hpp"

namespace deepclone {

struct piece {
  /// `owner` value meaning "every clone rank receives this piece from its source".
  static constexpr std::uint32_t all_clones = std::numeric_limits<std::uint32_t>::max();

  std::uint32_t tensor = 0;  ///< flat tensor index in the layout
  std::uint32_t layer = 0;
  std::uint64_t offset = 0;  ///< byte offset in the tensor
  std::uint64_t length = 0;  ///< bytes, > 0
  std::uint32_t source = 0;  ///< source index (0..N-1), not a communicator rank
  std::uint32_t owner = all_clones;  ///< clone index receiving it from the source
  bool operator==(const piece&) const = default;
};

/// Splitting granule of a tensor: pieces start at multiples of it, so a piece never cuts
/// an element in two and stays aligned for device copies and checksums.
inline std::uint64_t granule(const tensor_desc& t, std::uint64_t alignment) {
  std::uint64_t e = dtype_size(t.type);
  return std::lcm(alignment ? alignment : 1, e);
}

/// Splits [0, bytes) into at most `parts` consecutive non-empty ranges whose boundaries are
/// multiples of `g`; range i gets floor or ceil of the granules, the ceil going to the
/// ranges whose index, counted from `rotate`, is smallest (so repeated calls with a moving
/// `rotate` spread the remainders evenly). Returns (offset, length) pairs.
inline std::vector<std::pair<std::uint64_t, std::uint64_t>> split_range(std::uint64_t bytes, std::uint64_t parts,
                                                                          std::uint64_t g, std::uint64_t rotate = 0) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  if (bytes == 0 || parts == 0) return out;
  const std::uint64_t granules = (bytes + g - 1) / g;
  const std::uint64_t n = std::min(parts, granules);
  const std::uint64_t base = granules / n, extra = granules % n;
  std::uint64_t off = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    std::uint64_t gi = base + (((i + n - rotate % n) % n) < extra ? 1 : 0);
    std::uint64_t len = std::min(gi * g, bytes - off);
    out.emplace_back(off, len);
    off += len;
  }
  return out;
}

namespace detail {
/// Longest-processing-time greedy: items (flat tensor, bytes) largest first onto the
/// least-loaded bin (lowest index on ties). Deterministic; max load <= mean + largest item.
inline std::vector<std::uint32_t> lpt_assign(const std::vector<std::pair<std::uint32_t, std::uint64_t>>& items,
                                             std::vector<std::uint64_t>& loads) {
  std::vector<std::size_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return items[a].second > items[b].second; });
  std::vector<std::uint32_t> bin(items.size());
  for (auto i : order) {
    auto it = std::min_element(loads.begin(), loads.end());
    bin[i] = static_cast<std::uint32_t>(it - loads.begin());
    *it += items[i].second;
  }
  return bin;
}
}  // namespace detail

}  // namespace deepclone
