#pragma once
/// \file roles.hpp
/// Which communicator ranks are sources and which are clone ranks. Both sides construct
/// the same roles; source index i is `sources[i]`, clone index j is `clones[j]`.

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "error.hpp"

namespace deepclone {

struct roles {
  std::vector<int> sources;  ///< communicator ranks of the N sources; sources[0] coordinates the fork
  std::vector<int> clones;   ///< communicator ranks of the M clone ranks

  /// Sources are ranks [first, first+n), clones the next m ranks.
  static roles contiguous(int n, int m, int first = 0) {
    roles r;
    for (int i = 0; i < n; ++i) r.sources.push_back(first + i);
    for (int i = 0; i < m; ++i) r.clones.push_back(first + n + i);
    return r;
  }

  std::uint32_t source_count() const noexcept { return static_cast<std::uint32_t>(sources.size()); }
  std::uint32_t clone_count() const noexcept { return static_cast<std::uint32_t>(clones.size()); }

  std::optional<std::uint32_t> source_index(int rank) const { return find(sources, rank); }
  std::optional<std::uint32_t> clone_index(int rank) const { return find(clones, rank); }

  /// Throws `errc::invalid_argument` naming the problem: N or M of zero, a rank outside
  /// the communicator, a rank listed twice or in both roles.
  void validate(int comm_size) const {
    if (sources.empty()) throw error(errc::invalid_argument, "roles: no source ranks (N = 0)");
    if (clones.empty()) throw error(errc::invalid_argument, "roles: no clone ranks (M = 0)");
    std::set<int> seen;
    for (auto* group : {&sources, &clones})
      for (int r : *group) {
        if (r < 0 || r >= comm_size)
          throw error(errc::invalid_argument, "roles: rank " + std::to_string(r) + " is outside the communicator of size " +
                                                  std::to_string(comm_size));
        if (!seen.insert(r).second)
          throw error(errc::invalid_argument, "roles: rank " + std::to_string(r) + " is listed twice (a rank is a source or a clone, once)");
      }
  }

 private:
  static std::optional<std::uint32_t> find(const std::vector<int>& v, int rank) {
    auto it = std::find(v.begin(), v.end(), rank);
    if (it == v.end()) return std::nullopt;
    return static_cast<std::uint32_t>(it - v.begin());
  }
};

}  // namespace deepclone
