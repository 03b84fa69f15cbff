#pragma once
/// \file detail/peer_figures.hpp
/// What a clone rank hears from its peers about one session: each source's final status
/// (delivered, with its figures, or failed, with a code and a reason) and each other clone
/// rank's summary; and the report's per-rank rows built from them, missing ones marked so.
/// What a failed status means for the transfer (fail over, or give the clone up) stays with
/// the clone engine, which is handed every status as it arrives. Garbage and messages of
/// other sessions are dropped (`take_control`). Templated on the communicator only.

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "../report.hpp"
#include "../roles.hpp"
#include "outbox.hpp"
#include "wire.hpp"

namespace deepclone::detail {

template <class Comm>
class peer_figures {
 public:
  /// Posts the receives of every source's status and every other clone rank's summary
  /// for clone index `index`.
  void open(Comm& c, const roles& r, std::uint32_t index, int tag_base) {
    index_ = index;
    statuses_.assign(r.source_count(), std::nullopt);
    status_slots_.resize(r.source_count());
    for (std::uint32_t i = 0; i < r.source_count(); ++i) status_slots_[i].post(c, r.sources[i], tag_base + tag_status, control_bytes);
    summaries_.assign(r.clone_count(), std::nullopt);
    summaries_[index] = summary_msg{};  // this rank's own is built on demand
    summary_slots_.resize(r.clone_count());
    for (std::uint32_t j = 0; j < r.clone_count(); ++j)
      if (j != index) summary_slots_[j].post(c, r.clones[j], tag_base + tag_summary, control_bytes);
  }
  /// One round: every status and summary of `session` that arrived is kept, and each
  /// status is handed to `on_status(source index, status)`. True if anything arrived.
  template <class OnStatus>
  bool poll(Comm& c, std::uint64_t session, OnStatus on_status) {
    bool any = false;
    for (std::uint32_t i = 0; i < status_slots_.size(); ++i)
      if (auto s = take_control<status_msg>(c, status_slots_[i], session)) {
        any = true;
        statuses_[i] = *s;
        on_status(i, *s);
      }
    for (std::uint32_t j = 0; j < summary_slots_.size(); ++j) {
      if (j == index_) continue;
      if (auto m = take_control<summary_msg>(c, summary_slots_[j], session)) {
        any = true;
        summaries_[j] = *m;
      }
    }
    return any;
  }
  /// Every other clone rank's summary is in, and every source's status unless
  /// `failed(source index)` (a failed source may never send it).
  template <class Failed>
  bool all_in(Failed failed) const {
    for (auto& s : summaries_)
      if (!s) return false;
    for (std::uint32_t i = 0; i < statuses_.size(); ++i)
      if (!statuses_[i] && !failed(i)) return false;
    return true;
  }
  /// The report's rows: a source without a status is reported failed, a clone rank without
  /// a summary with NaN times; `mine` is this rank's own summary.
  template <class Failed>
  void add_to(report& r, const roles& ro, const summary_msg& mine, Failed failed) const {
    for (std::uint32_t i = 0; i < ro.source_count(); ++i) {
      if (!statuses_[i]) {
        source_figures f;
        f.rank = ro.sources[i];
        f.failed = true;
        r.sources.push_back(f);
        continue;
      }
      auto& s = *statuses_[i];
      r.sources.push_back(
          {ro.sources[i], s.bytes_sent, s.hook_s, s.overhead_s, s.normal_iteration_s, s.fork_iterations, s.code != 0 || failed(i)});
    }
    for (std::uint32_t j = 0; j < ro.clone_count(); ++j) {
      summary_msg s = j == index_ ? mine : summaries_[j].value_or(summary_msg{0, j, 0, 0, NAN, NAN, NAN});
      r.clones.push_back({ro.clones[j], s.bytes_from_sources, s.bytes_from_clones, s.readiness_s, s.standby_s, s.first_layer_s});
    }
  }
  /// Withdraws every receive.
  void cancel(Comm& c) noexcept {
    for (auto& s : status_slots_) s.cancel(c);
    for (auto& s : summary_slots_) s.cancel(c);
  }

 private:
  std::uint32_t index_ = 0;
  std::vector<inbox_slot<Comm>> status_slots_, summary_slots_;
  std::vector<std::optional<status_msg>> statuses_;
  std::vector<std::optional<summary_msg>> summaries_;
};

}  // namespace deepclone::detail
