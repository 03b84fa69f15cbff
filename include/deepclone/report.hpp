#pragma once
/// \file report.hpp
/// What a clone reports: the three metrics of docs/metrics.md, per-layer ready times and
/// per-rank byte counts; and what a clone rank of a partitioned fork reports of itself.
/// Times are seconds.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace deepclone {

/// A source's figures for one clone session, as it reported them.
struct source_figures {
  int rank = -1;
  std::uint64_t bytes_sent = 0;       ///< tensor bytes this source sent
  double hook_s = 0;                  ///< time spent inside deepclone's hooks for this session
  double overhead_s = NAN;            ///< fork iterations minus as many median normal iterations
  double normal_iteration_s = NAN;    ///< median iteration before the fork (NaN: none measured)
  std::uint32_t fork_iterations = 0;  ///< iterations from k until the last send completed
  bool failed = false;                ///< reported or presumed failed (failover); its figures may be missing
};

/// A clone rank's figures.
struct clone_figures {
  int rank = -1;
  std::uint64_t bytes_from_sources = 0, bytes_from_clones = 0;
  double readiness_s = 0, standby_s = 0, first_layer_s = 0;
};

/// One step of a clone's progress, handed to the clone's progress callback
/// (`clone::on_progress`): once per layer as it becomes verified and in place, in the order
/// they do, then once when the whole state (tensors, metadata) is complete.
struct progress {
  std::uint64_t iteration = 0;           ///< k: the fork iteration being received
  std::optional<std::size_t> layer;      ///< the layer that just became ready; none in the last call
  std::size_t layers_ready = 0, layer_count = 0;
  std::uint64_t bytes_ready = 0;         ///< tensor bytes of the ready layers
  std::uint64_t bytes_total = 0;         ///< tensor bytes of the state
  double seconds = 0;                    ///< since request()
  bool complete = false;                 ///< the whole state is verified: the last call of the session
};

/// What a clone rank of a partitioned fork reports of its last fork that completed
/// (`partition_engine::clone::report()`): its own figures. Times are seconds from its
/// request. Byte counts are of messages verified and in place; with no failover and no
/// sharing all of them come from the sources, and together they are `wanted_bytes`.
struct partition_report {
  std::uint64_t session = 0;
  std::uint64_t iteration = 0;           ///< k: the parts hold the sources' bytes at the end of iteration k
  std::uint64_t wanted_bytes = 0;        ///< bytes of the global state this clone rank wants
  std::uint64_t bytes_from_sources = 0;  ///< verified bytes sent by sources (failover replacements included)
  std::uint64_t bytes_from_clones = 0;   ///< verified bytes forwarded by other clone ranks (partition_sharing::exchange)
  std::uint64_t metadata_bytes = 0;      ///< source 0's encoded metadata of k (0 where none arrived)
  double agreement_s = 0;                ///< request until the fork decision arrived
  /// Request until wait() returned: every wanted byte verified and in place, and (with
  /// sharing, failover) this rank's forwards and acknowledgements delivered.
  double readiness_s = 0;
  /// Request until each layer's wanted bytes were verified and in place (about the
  /// decision's time for a layer this rank wants none of).
  std::vector<double> layer_ready_s;
  std::vector<std::uint32_t> failed_sources;        ///< sources presumed failed; their bytes came from other holders
  std::vector<std::uint32_t> refetched_forwarders;  ///< clone ranks whose forwards came from the sources instead
  std::size_t stale_groups = 0;  ///< groups an earlier fork left queued on these tags, dropped and received again
};

/// What a source of a partitioned fork reports of the last fork it served
/// (`partition_engine::source::last_fork()`): its cost to the trainer. Times are seconds.
struct partition_source_report {
  std::uint64_t session = 0;
  std::uint64_t iteration = 0;  ///< k
  bool completed = false;       ///< false: the fork failed (last_failure() says why); the source trained on
  double held_s = 0;            ///< its before_update hooks waited for layers still in flight (the window rule)
  double served_s = 0;          ///< from the decision until the fork ended here (acknowledged, or failed)
};

struct report {
  std::uint64_t session = 0;
  std::uint64_t iteration = 0;         ///< k: the clone holds the state at the end of iteration k
  std::uint64_t state_bytes = 0;       ///< tensor bytes of the state
  std::uint64_t metadata_bytes = 0;
  std::string policies;                ///< "shard/pipeline/reconstruct/checksum"
  double agreement_s = 0;              ///< request until the fork decision arrived
  double first_layer_s = 0;            ///< request until layer 0 was ready (the forward pass can start)
  double readiness_s = 0;              ///< request until the whole state was verified and in place
  double standby_s = 0;                ///< time this clone rank sat blocked in deepclone waits
  std::uint32_t refetched_groups = 0;  ///< transfer groups asked again from another source (failover)
  std::uint32_t replicas_verified = 0;  ///< sources whose replica digest equals the received state (verify_replicas)
  std::vector<double> layer_ready_s;   ///< request until each layer was ready
  std::vector<source_figures> sources;
  std::vector<clone_figures> clones;   ///< every clone rank, this one included

  /// Largest runtime overhead over the sources (the job is as slow as its slowest rank).
  double max_overhead_s() const {
    double m = NAN;
    for (auto& s : sources)
      if (!std::isnan(s.overhead_s)) m = std::isnan(m) ? s.overhead_s : std::max(m, s.overhead_s);
    return m;
  }
  double max_hook_s() const {
    double m = 0;
    for (auto& s : sources) m = std::max(m, s.hook_s);
    return m;
  }
  /// Slowest clone rank's readiness.
  double max_readiness_s() const {
    double m = readiness_s;
    for (auto& c : clones) m = std::max(m, c.readiness_s);
    return m;
  }
};

namespace detail {
/// Seconds as text; a figure that was never measured (NaN) reads "unmeasured", not "nan".
inline std::string seconds_text(double s, int precision = 4) {
  if (std::isnan(s)) return "unmeasured";
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(precision);
  o << s << " s";
  return o.str();
}
}  // namespace detail

/// A plain-text rendering (integrations/fmt.hpp offers a formatter too).
inline std::string to_string(const report& r) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(4);
  o << "clone session " << r.session << " at iteration " << r.iteration << " (" << r.policies << ")\n"
    << "  state " << r.state_bytes << " B + metadata " << r.metadata_bytes << " B\n"
    << "  agreement " << r.agreement_s << " s, first layer " << r.first_layer_s << " s, readiness "
    << r.readiness_s << " s, standby " << r.standby_s << " s"
    << (r.refetched_groups ? ", " + std::to_string(r.refetched_groups) + " group(s) refetched" : std::string())
    << (r.replicas_verified ? ", " + std::to_string(r.replicas_verified) + " replica(s) verified" : std::string()) << "\n";
  for (auto& s : r.sources)
    o << "  source rank " << s.rank << ": sent " << s.bytes_sent << " B, hooks " << s.hook_s << " s, overhead "
      << detail::seconds_text(s.overhead_s) << " over " << s.fork_iterations << " iteration(s) (normal iteration "
      << detail::seconds_text(s.normal_iteration_s) << ")" << (s.failed ? " [failed]" : "") << "\n";
  for (auto& c : r.clones)
    o << "  clone rank " << c.rank << ": received " << c.bytes_from_sources << " B from sources + "
      << c.bytes_from_clones << " B from clones, readiness " << detail::seconds_text(c.readiness_s) << ", standby "
      << detail::seconds_text(c.standby_s) << "\n";
  return o.str();
}

/// One line of a clone's progress: "iteration 12: 3/5 layers, 120.4 of 335.0 MB, 1.2 s".
inline std::string to_string(const progress& p) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(1);
  o << "iteration " << p.iteration << ": " << p.layers_ready << "/" << p.layer_count << " layers, "
    << static_cast<double>(p.bytes_ready) / 1e6 << " of " << static_cast<double>(p.bytes_total) / 1e6 << " MB, "
    << p.seconds << " s" << (p.complete ? ", complete" : "");
  return o.str();
}

/// A progress callback (`clone::on_progress`) that prints a line for clones that take
/// long: nothing during the first `after_s` seconds, then at most one line per `every_s`,
/// and the completion line if it printed anything before. Quick clones stay silent.
class progress_line {
 public:
  explicit progress_line(std::string label = "clone", std::FILE* out = stderr, double after_s = 1.0, double every_s = 0.5)
      : label_(std::move(label)), out_(out), after_s_(after_s), every_s_(every_s) {}
  void operator()(const progress& p) {
    if (p.seconds < after_s_ && !printed_) return;
    if (!p.complete && printed_ && p.seconds < last_ + every_s_) return;
    if (p.complete && !printed_) return;
    std::fprintf(out_, "%s: %s\n", label_.c_str(), to_string(p).c_str());
    std::fflush(out_);
    printed_ = !p.complete;  // the next session starts quiet again
    last_ = p.seconds;
  }

 private:
  std::string label_;
  std::FILE* out_;
  double after_s_, every_s_, last_ = 0;
  bool printed_ = false;
};

}  // namespace deepclone
