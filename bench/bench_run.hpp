#pragma once
// The run context shared by every strategy, and the declarations of the strategies.
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "bench_common.hpp"

namespace bench {

struct context {
  config cfg;
  deepclone::layout lay;                          // scaled layout (what the replicas hold)
  std::vector<std::unique_ptr<replica>>* reps;    // N + M replicas: sources first
  deepclone::inproc::world* world;
  std::shared_ptr<deepclone::link_fabric<>> fabric;
  std::string link_name;                          // "raw" or "emulated"
  work mode = work::wait;
  double B = 0;                                   // measured point-to-point bandwidth, bytes/s
  bool emulated() const { return !fabric->unlimited(); }
};

/// Shared by a run's rank threads: the "user" starting the fork, and what only the
/// harness sees across ranks (sampled bytes for the correctness check, timestamps).
struct run_shared {
  std::atomic<std::uint64_t> progress0{0};  // iterations finished by source 0
  std::atomic<int> requested{0}, clones_done{0};
  std::atomic<bool> aborted{false};
  std::mutex m;
  std::vector<float> sample_source;               // source 0, state of iteration k
  std::vector<std::vector<float>> sample_clone;   // per clone rank, once ready
  std::vector<std::vector<double>> durations;     // per source, per iteration
  std::uint64_t k = 0;
  clock::time_point t_first_final{}, t_req{};     // first layer of k final (source 0); first request
  bool have_first_final = false;
  std::atomic<std::uint64_t> max_spilled{0};      // pipeline::spill: the most any source copied

  /// A source's bookkeeping after each iteration, the same for every strategy: records the
  /// iteration's duration; unless `stop`, source 0 publishes its progress and, at the end
  /// of the warm-up, holds until every clone rank has asked (so all strategies fork alike).
  /// Returns `stop`, for `if (sh.iteration_done(...)) break;`.
  bool iteration_done(std::size_t source, std::uint64_t step, bool stop, int clones, int warmup, clock::time_point& last) {
    durations[source].push_back(secs(last, clock::now()));
    if (stop) return true;
    if (source == 0) {
      progress0 = step;
      if (step == static_cast<std::uint64_t>(warmup))
        while (requested.load() < clones && !aborted.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    last = clock::now();
    return false;
  }
};

inline std::vector<float> sample(replica& r) {
  std::vector<float> s;
  for (auto& t : r.tensors) {
    s.push_back(t.front());
    s.push_back(t[t.size() / 2]);
    s.push_back(t.back());
  }
  s.push_back(static_cast<float>(r.state.metadata().step));
  return s;
}

inline double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

/// Resets the process's peak RSS (Linux) and returns the current RSS, in bytes.
inline double reset_peak_rss() {
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  std::ifstream s("/proc/self/status");
  std::string k;
  double v = 0;
  while (s >> k) {
    if (k == "VmRSS:") { s >> v; return v * 1024; }
  }
  return 0;
}
inline double peak_rss() {
  std::ifstream s("/proc/self/status");
  std::string k;
  double v = 0;
  while (s >> k) {
    if (k == "VmHWM:") { s >> v; return v * 1024; }
  }
  return 0;
}

record run_deepclone(context& c, const std::string& pipeline, const std::string& reconstruction);
/// deepclone window/scatter_exchange with settings.verify_replicas (the cost of the digests).
record run_deepclone_verified(context& c);
/// deepclone window/scatter_exchange with agreement::collective (the fork word rides on the
/// sources' per-iteration allreduce).
record run_deepclone_collective(context& c);
record run_root_broadcast(context& c);
record run_checkpoint(context& c, bool sharded);

}  // namespace bench
