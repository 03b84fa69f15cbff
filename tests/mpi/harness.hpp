#pragma once
// A small deterministic "trainer" for the MPI tests: layers with weights, biases and
// momentum slots (std::vector<float>), metadata that changes every step, and sources kept
// in step by a gradient allreduce over the source ranks (deepclone::allreduce_sum, tags
// below deepclone's tag_base). Every source applies bitwise the same update, so the state
// of iteration k is one well-defined byte string; `fingerprint` hashes it (tensors and
// metadata) independently of deepclone's own checksums.
#include <deepclone/deepclone.hpp>
#include <deepclone/integrations/boost_mpi.hpp>

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace harness {

namespace dc = deepclone;
using tensor_t = std::vector<float>;

/// Element counts of the layers' weights. One weight above 1 MiB exercises sharding and
/// scatter_exchange's split; odd sizes exercise alignment.
inline std::vector<std::size_t> default_sizes() { return {1000, 400001, 70001, 257}; }

struct model {
  std::vector<tensor_t> w, b, m;  // weight, bias, momentum of the weight
  dc::state<tensor_t> st;

  explicit model(const std::vector<std::size_t>& sizes) {
    w.reserve(sizes.size());  // the state keeps pointers: no reallocation
    b.reserve(sizes.size());
    m.reserve(sizes.size());
    for (std::size_t l = 0; l < sizes.size(); ++l) {
      w.emplace_back(sizes[l], 0.5f);
      b.emplace_back(sizes[l] % 97 + 3, 0.25f);
      m.emplace_back(sizes[l], 0.0f);
      st.add_layer("layer" + std::to_string(l), {{"weight", w[l]}, {"bias", b[l]}, {"weight.momentum", m[l]}});
    }
  }
  model(const model&) = delete;

  /// Layer l's update in iteration `step`, with the allreduced gradient scale g.
  void update(std::size_t l, std::uint64_t step, double g) {
    const float gs = static_cast<float>(g * 1e-3);
    auto& W = w[l];
    auto& M = m[l];
    for (std::size_t i = 0; i < W.size(); ++i) {
      float grad = gs + static_cast<float>((i * 7 + step) % 13) * 1e-4f;
      M[i] = 0.9f * M[i] + grad;
      W[i] -= 0.01f * M[i];
    }
    for (auto& x : b[l]) x = x * 0.999f + gs;
  }

  void end_step(std::uint64_t step) {
    auto& md = st.metadata();
    md.step = step;
    md.data_cursor = (step + 1) * 64;
    md.hyper["lr"] = 0.01;
    md.hyper["momentum"] = 0.9;
    md.rng.assign(16, std::byte{0});
    for (std::size_t i = 0; i < md.rng.size(); ++i) md.rng[i] = static_cast<std::byte>((step * 131 + i * 17) & 0xff);
    md.user.assign(3, static_cast<std::byte>(step & 0xff));
  }

  /// FNV-1a over every tensor byte and the encoded metadata with step = k.
  std::uint64_t fingerprint(std::uint64_t k) {
    std::uint64_t h = 1469598103934665603ull;
    auto mix = [&](std::span<const std::byte> s) {
      for (auto x : s) h = (h ^ static_cast<std::uint64_t>(x)) * 1099511628211ull;
    };
    auto lay = st.describe();
    for (std::size_t t = 0; t < lay.tensor_count(); ++t) mix(st.bytes(t));
    auto md = st.metadata();
    md.step = k;
    mix(md.encode());
    return h;
  }
};

/// The per-source contribution to the "gradient" of a step (summed over sources).
inline double contribution(std::uint32_t source, std::uint64_t step) { return 1.0 + 0.125 * source + 0.01 * step; }

/// What a source's training loop saw.
struct source_result {
  std::uint64_t steps = 0;              ///< iterations trained
  std::optional<std::uint64_t> k;       ///< the fork iteration it served
  std::uint64_t fingerprint = 0;        ///< of its state at the end of iteration k
  std::uint64_t completed = 0, failed = 0;
  std::optional<dc::detail::failure> last_error;  // (the core exposes a detail:: type here)
};

struct loop_options {
  std::uint64_t max_steps = 400;
  std::uint64_t sessions = 1;  ///< train until this many sessions completed on every source
  /// Extra per-step delay of this source (skew), and compute time between layer updates.
  std::function<std::chrono::microseconds(std::uint32_t source, std::uint64_t step)> delay;
  std::chrono::microseconds compute_per_layer{0};
  /// Stop right after the fork iteration k (a source that finishes while a clone is in flight).
  bool stop_after_fork = false;
  /// Stop as soon as any source learned of a fork (before k: the clone sees source_failed).
  bool stop_on_decision = false;
  /// Hash the state at k (a test check; benchmarks turn it off: it costs a pass over S).
  bool fingerprint = true;
};

inline void busy(std::chrono::microseconds d) {
  if (d.count() <= 0) return;
  auto end = std::chrono::steady_clock::now() + d;
  volatile double x = 1;
  while (std::chrono::steady_clock::now() < end) x = x * 1.0000001 + 1e-9;
}

/// A source rank's training loop. Layers are updated last to first (backward order).
template <class Source, class Comm>
source_result train(Source& src, Comm& comm, const dc::roles& roles, model& md, const loop_options& o) {
  source_result r;
  const std::uint32_t me = src.index();
  for (std::uint64_t step = 0;; ++step) {
    // The gradient allreduce; it also carries the stop votes (state after step - 1).
    bool done = src.sessions_completed() + src.sessions_failed() >= o.sessions;
    if (o.stop_after_fork) done = r.k && step > *r.k;
    if (o.stop_on_decision) done = src.cloning();
    constexpr bool collective = Source::agreement_type::trainer_collective;
    std::vector<double> g{contribution(me, step), done ? 1.0 : 0.0};
    if constexpr (collective) g.push_back(static_cast<double>(src.fork_word()));  // fused into the gradient allreduce
    dc::allreduce_sum(comm, std::span<const int>(roles.sources), std::span<double>(g), 10);
    const bool stop = o.stop_on_decision ? g[1] > 0 : g[1] == static_cast<double>(roles.source_count());
    if (stop || step >= o.max_steps) break;
    if constexpr (collective) {
      src.fork_agreed(static_cast<std::uint64_t>(g[2]));
      // Forked at the collective before any update of `step`: k is step - 1, untouched until now.
      if (auto k = src.fork_iteration(); k && *k + 1 == step && !r.k) {
        r.k = k;
        if (o.fingerprint) r.fingerprint = md.fingerprint(*k);
      }
    }
    if (o.delay) std::this_thread::sleep_for(o.delay(me, step));
    for (std::size_t l = md.w.size(); l-- > 0;) {
      busy(o.compute_per_layer);
      src.before_update(l);
      md.update(l, step, g[0]);
      src.after_update(l);
    }
    md.end_step(step);
    auto k = src.fork_iteration();
    if (k && *k == step) {
      r.k = k;
      if (o.fingerprint) r.fingerprint = md.fingerprint(step);
    }
    src.end_iteration(step);
    r.steps = step + 1;
  }
  r.completed = src.sessions_completed();
  r.failed = src.sessions_failed();
  r.last_error = src.last_error();
  return r;
}

/// Every rank's (k, fingerprint) pair, gathered on every rank of `comm`.
inline std::vector<std::pair<std::uint64_t, std::uint64_t>> gather(MPI_Comm comm, std::uint64_t k, std::uint64_t h) {
  int n = 0;
  MPI_Comm_size(comm, &n);
  std::uint64_t mine[2] = {k, h};
  std::vector<std::uint64_t> all(2 * static_cast<std::size_t>(n));
  MPI_Allgather(mine, 2, MPI_UINT64_T, all.data(), 2, MPI_UINT64_T, comm);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for (int i = 0; i < n; ++i) out.emplace_back(all[2 * i], all[2 * i + 1]);
  return out;
}

}  // namespace harness
