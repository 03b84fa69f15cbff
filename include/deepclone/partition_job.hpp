#pragma once
/// \file partition_job.hpp
/// What every rank of a partitioned fork knows alike (issue 12): the roles, the global
/// layout, what each source holds and each clone rank wants, and the plan and transfer
/// groups computed from them once. The partitioned engine (partition_engine.hpp) reuses one
/// job for every fork, so a trainer pays for planning once, not per fork; each fork only
/// picks its own block of tags (`route`).

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "detail/partition_failover.hpp"
#include "error.hpp"
#include "holdings.hpp"
#include "layout.hpp"
#include "partition_groups.hpp"
#include "partition_transfer.hpp"
#include "roles.hpp"

namespace deepclone {

/// How a partitioned job plans, alike on every rank.
struct partition_job_options {
  /// Shares of a range held by several sources are cut at multiples of this (and of the
  /// element size).
  std::uint64_t alignment = 256;
  /// `exchange`: clone ranks that want the same bytes forward each other their shares.
  partition_sharing sharing = partition_sharing::none;
  partition_group_options groups{};
  /// A failed or silent source's bytes come from the live holders of the same bytes, and a
  /// source keeps each layer until every clone rank that wants it acknowledged it. Off: a
  /// lost source fails the fork, and a source may overwrite a layer once its sends are done.
  bool failover = true;
  /// With failover: how long a clone rank waits on a silent source, once others deliver.
  std::chrono::nanoseconds presume_failed_after = std::chrono::seconds(5);
};

/// The plan of a partitioned fork, made once. Not copyable or movable: routes refer to it.
class partition_job {
 public:
  /// Throws `invalid_argument` (naming the side) for holdings of another number of ranks
  /// than `ranks` has, and whatever make_partition_plan refuses (an uncovered region, a
  /// part outside its tensor, ...), naming the tensor and the bytes.
  partition_job(roles ranks, layout global, std::vector<holdings> sources, std::vector<holdings> clones, partition_job_options o = {})
      : ranks_(std::move(ranks)), global_(std::move(global)), sources_(counted(std::move(sources), ranks_.source_count(), "sources")),
        clones_(counted(std::move(clones), ranks_.clone_count(), "clone ranks")), options_(o),
        plan_(make_partition_plan(global_, sources_, clones_, o.alignment, o.sharing)),
        groups_(make_partition_groups(plan_, ranks_.source_count(), ranks_.clone_count(), o.groups)) {
    if (o.failover) failover_.emplace(partition_failover{sources_, plan_, o.groups, o.alignment, o.presume_failed_after});
  }
  partition_job(const partition_job&) = delete;
  partition_job& operator=(const partition_job&) = delete;

  const roles& ranks() const noexcept { return ranks_; }
  const layout& global() const noexcept { return global_; }
  const std::vector<holdings>& sources() const noexcept { return sources_; }
  const std::vector<holdings>& clones() const noexcept { return clones_; }
  const partition_job_options& options() const noexcept { return options_; }
  const partition_plan& plan() const noexcept { return plan_; }
  const partition_groups& groups() const noexcept { return groups_; }
  /// The transfer of this plan on the tags from `tag_base` on (`transfer_tags()` of them),
  /// named `transfer` (partition_route::transfer).
  partition_route route(int tag_base, std::uint64_t transfer = 0) const {
    return {ranks_, global_, groups_, tag_base, failover_ ? &*failover_ : nullptr, transfer};
  }
  /// Tags one transfer uses: its control and refusal tags, then data and sums per layer.
  long long transfer_tags() const noexcept { return 2 + 2 * static_cast<long long>(global_.layer_count()); }

 private:
  static std::vector<holdings> counted(std::vector<holdings> h, std::size_t want, const char* side) {
    if (h.size() != want)
      throw error(errc::invalid_argument, "partition_job: holdings of " + std::to_string(h.size()) + " " + side + ", but the roles have " +
                                              std::to_string(want));
    return h;
  }

  roles ranks_;
  layout global_;
  std::vector<holdings> sources_, clones_;
  partition_job_options options_;
  partition_plan plan_;
  partition_groups groups_;
  std::optional<partition_failover> failover_;
};

}  // namespace deepclone
