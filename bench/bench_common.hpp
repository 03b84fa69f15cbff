#pragma once
// Shared pieces of deepclone's benchmark: configuration, one rank's replica of a model's
// training state (tests/models/*.csv, scaled), the realistic source trainer, and the record
// of one measurement.
#include <deepclone/deepclone.hpp>
#include <deepclone/emulated_link.hpp>
#include <deepclone/inproc.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "models.hpp"  // tests/support/models.hpp: the one copy of the model layouts' loader

namespace bench {

using clock = std::chrono::steady_clock;
using link = deepclone::emulated_link<deepclone::inproc::communicator>;
inline double secs(clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

enum class work { wait, cpu };  // compute stands for accelerator work (timed wait) or is real CPU work

struct config {
  std::string models_dir, model = "bert_large", out_dir = ".", ckpt_dir = ".";
  double scale = 0.125;          // every tensor's element count is multiplied by this
  int sources = 4, clones = 2;
  double iteration_s = 0.5;      // forward + backward compute per iteration (the update comes on top)
  double fwd_fraction = 1.0 / 3; // share of the compute in the forward pass
  int warmup = 5;                // normal iterations before the fork request
  double link_gbs = 1.0;         // emulated per-rank link, full-scale GB/s (paced at link_gbs * scale)
  double latency_us = 20;
  double storage_gbs = 2.0;      // emulated storage, full-scale GB/s aggregate (checkpoint path)
  bool quick = false;            // smoke: few strategies
  bool cpu_runs = true;          // also run the CPU trainer for a subset
};

/// One rank's replica: its own tensors (no bytes are shared between ranks), grouped as
/// the layout says, plus a gradient scratch buffer the size of the largest tensor.
struct replica {
  std::vector<std::vector<float>> tensors;
  std::vector<char> is_slot, is_param;  // per flat tensor: optimizer slot / trained parameter
  deepclone::state<std::vector<float>> state;
  std::vector<float> grad;
  std::vector<std::size_t> layer_first, layer_end;
  std::vector<std::uint64_t> layer_bytes;
  std::uint64_t bytes = 0;

  replica(const deepclone::layout& lay, double scale, float init) {
    std::size_t biggest = 1;
    for (std::size_t t = 0; t < lay.tensor_count(); ++t) {
      auto& d = lay.tensor(t);
      auto n = static_cast<std::size_t>(std::ceil(static_cast<double>(d.bytes) / 4.0 * scale));
      tensors.emplace_back(std::max<std::size_t>(n, 1), init);  // value-initialised: pre-faulted
      auto& nm = d.name;
      bool slot = nm.size() > 9 && nm.compare(nm.size() - 9, 9, ".momentum") == 0;
      is_slot.push_back(slot);
      is_param.push_back(!slot && t + 1 < lay.tensor_count() && lay.layer_of(t + 1) == lay.layer_of(t) &&
                         lay.tensor(t + 1).name == nm + ".momentum");
      biggest = std::max(biggest, tensors.back().size());
      bytes += tensors.back().size() * 4;
    }
    grad.assign(biggest, 0.0f);
    std::size_t t = 0;
    for (std::size_t l = 0; l < lay.layer_count(); ++l) {
      std::vector<deepclone::named<std::vector<float>>> v;
      layer_first.push_back(t);
      std::uint64_t b = 0;
      for (auto& d : lay.layers()[l].tensors) {
        v.emplace_back(d.name, tensors[t]);
        b += tensors[t].size() * 4;
        ++t;
      }
      layer_end.push_back(t);
      layer_bytes.push_back(b);
      state.add_layer(lay.layers()[l].name, std::move(v));
    }
  }
  std::size_t layers() const { return layer_first.size(); }
};

/// Hooks for runs without deepclone (checkpoint strategies).
struct no_hooks {
  void before_update(std::size_t) {}
  void after_update(std::size_t) {}
  void end_iteration(std::uint64_t) {}
};

/// Bytes per second one thread sums over memory (calibrates the CPU trainer's work).
inline double& cpu_rate() {
  static double r = 2e9;
  return r;
}

inline float touch(const std::vector<float>& v, std::size_t bytes) {
  float s = 0;
  std::size_t n = std::min(v.size(), bytes / 4);
  std::size_t done = 0;
  while (done < bytes / 4) {
    for (std::size_t i = 0; i < n && done < bytes / 4; ++i, ++done) s += v[i];
    if (n == 0) break;
  }
  return s;
}

/// The realistic source trainer: forward and backward compute proportional to each
/// layer's bytes, then a real SGD-with-momentum update of each layer in backward order
/// (gradient written, momentum and weight read and written) between the hooks; the
/// sources stay in lockstep through an allreduce of two flags per iteration (the
/// gradient allreduce's traffic itself is not modelled).
struct trainer {
  replica& r;
  const config& cfg;
  work mode;
  double total_bytes;
  std::uint64_t step = 0;
  volatile float sink = 0;

  void compute(std::size_t layer, double share, clock::time_point& t) {
    double d = cfg.iteration_s * share * static_cast<double>(r.layer_bytes[layer]) / total_bytes;
    if (mode == work::wait) {
      t += std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(d));
      std::this_thread::sleep_until(t);
    } else {
      // A fixed amount of memory-touching work: d seconds at the calibrated single-thread rate.
      auto bytes = static_cast<std::size_t>(d * cpu_rate());
      sink = sink + touch(r.tensors[r.layer_first[layer]], bytes);
    }
  }

  void update(std::size_t l, std::uint64_t s) {
    const float lr = 1e-3f, mu = 0.9f, gs = 1e-4f * static_cast<float>((s % 7) + 1);
    for (std::size_t t = r.layer_first[l]; t < r.layer_end[l]; ++t) {
      if (!r.is_param[t]) {
        if (!r.is_slot[t]) r.tensors[t][0] += 1.0f;  // a buffer (e.g. running statistics)
        continue;
      }
      auto& w = r.tensors[t];
      auto& m = r.tensors[t + 1];
      float* g = r.grad.data();
      const std::size_t n = w.size();
      for (std::size_t i = 0; i < n; ++i) g[i] = gs * w[i] + gs;  // the gradient, in memory
      for (std::size_t i = 0; i < n; ++i) {
        m[i] = mu * m[i] + g[i];
        w[i] -= lr * m[i];
      }
    }
  }

  /// One iteration. `flags` go through the sources' per-iteration allreduce (fork / stop
  /// requests), done by `allreduce(flags)` after the updates: the in-process runs pass
  /// deepclone::allreduce_sum over point-to-point, the MPI runs MPI_Allreduce over the
  /// sources' communicator. Hooks may put a word into the allreduce and read the sum back
  /// (`contribute(flags)` / `learn(flags)`): where an agreement policy that rides on the
  /// trainer's allreduce (engine v2's agreement::collective) plugs in.
  template <class Allreduce, class Hooks>
  void iterate(Allreduce&& allreduce, Hooks& hooks, std::span<double> flags) {
    const std::size_t L = r.layers();
    auto t = clock::now();
    const double fwd = cfg.fwd_fraction, bwd = 1.0 - cfg.fwd_fraction;
    for (std::size_t l = 0; l < L; ++l) compute(l, fwd, t);
    t = clock::now();
    for (std::size_t l = L; l-- > 0;) {
      compute(l, bwd, t);
      hooks.before_update(l);
      update(l, step);
      hooks.after_update(l);
      t = clock::now();
    }
    if constexpr (requires { hooks.contribute(flags); }) hooks.contribute(flags);
    allreduce(flags);
    if constexpr (requires { hooks.learn(flags); }) hooks.learn(flags);
    r.state.metadata().step = step;
    r.state.metadata().data_cursor += 1024;
    hooks.end_iteration(step);
    ++step;
  }
  /// The in-process runs: the allreduce over point-to-point among `group`.
  template <class Comm, class Hooks>
  void iterate(Comm& comm, const std::vector<int>& group, Hooks& hooks, double flags[2]) {
    iterate([&](std::span<double> f) { deepclone::allreduce_sum(comm, std::span<const int>(group), f, 7); }, hooks,
            std::span<double>(flags, 2));
  }
};

/// One measurement: a strategy's figures.
struct record {
  std::string model, strategy, pipeline, reconstruction, link, trainer;
  int sources = 0, clones = 0;
  std::uint64_t state_bytes = 0;
  double scale = 1, iteration_s = 0, overhead_s = NAN, standby_s = 0, readiness_s = 0, first_layer_s = 0,
         agreement_s = 0, from_state_s = 0, bound_s = 0, bandwidth_Bps = 0, hook_s = 0;
  std::uint64_t max_source_bytes = 0, extra_source_bytes = 0, extra_clone_bytes = 0, file_bytes = 0;
  double process_peak_extra_bytes = 0;
  bool verified = false;
  double predicted_readiness_s = NAN, predicted_overhead_s = NAN;
  std::shared_ptr<deepclone::report> rep;  // deepclone rows: clone rank 0's report
};

}  // namespace bench
