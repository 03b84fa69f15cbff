#pragma once
/// \file report.hpp
/// What a clone reports: the three metrics of docs/metrics.md, per-layer ready times and
/// per-rank byte counts. Times are seconds.

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
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
      << s.overhead_s << " s over " << s.fork_iterations << " iteration(s) (normal iteration " << s.normal_iteration_s
      << " s)" << (s.failed ? " [failed]" : "") << "\n";
  for (auto& c : r.clones)
    o << "  clone rank " << c.rank << ": received " << c.bytes_from_sources << " B from sources + "
      << c.bytes_from_clones << " B from clones, readiness " << c.readiness_s << " s, standby " << c.standby_s << " s\n";
  return o.str();
}

}  // namespace deepclone
