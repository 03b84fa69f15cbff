#pragma once
/// \file fork_harness.hpp
/// Runs the MLP trainer of mlp.hpp on in-process ranks, with or without a fork, and keeps
/// what a bitwise check needs: the sources' state of the fork iteration, the clone's state
/// right after it completed, both loss curves, final states and the clone's report. Shared
/// by examples/fork_training.cpp and tests/unit/test_training.cpp so that the demo and the
/// tests exercise the same path.
///
/// Only the harness looks across ranks (after the threads are joined, or through the
/// atomics below that stand for "the user decides to fork now"); the ranks themselves
/// exchange nothing but messages.

#include <atomic>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mlp.hpp"

namespace mlp {

struct fork_options {
  config cfg;
  std::uint32_t sources = 4;    ///< N source ranks, communicator ranks [0, N)
  std::uint32_t clones = 2;     ///< M clone ranks, communicator ranks [N, N + M)
  std::uint64_t fork_at = 10;   ///< the clone ranks request the fork once the sources have finished this step
  std::uint64_t steps = 30;     ///< the sources train steps [0, steps); the clone continues to steps - 1 too
  double clone_lr = 0.02;       ///< the clone's learning rate after the fork
};

struct fork_result {
  std::uint64_t k = 0;                            ///< the agreed fork iteration
  std::vector<double> source_loss;                ///< per step, as source rank 0 saw it
  std::vector<std::optional<double>> clone_loss;  ///< per step; set for k+1 .. steps-1
  snapshot source_at_fork;                        ///< source rank 0, end of iteration k (metadata.step == k)
  std::vector<snapshot> clone_at_fork;            ///< each clone rank, right after wait(), before training
  std::vector<snapshot> source_final, clone_final;
  std::vector<std::string> names;                 ///< tensor names in state order
  deepclone::report report;                       ///< clone rank 0's report
  double first_layer_wait_s = 0;                  ///< clone rank 0: request() until wait_layer(0) returned
  double seconds = 0;                             ///< wall time of the whole run
};

/// A reference run without any cloning: N ranks train `steps` iterations.
struct plain_result {
  std::vector<double> loss;
  std::vector<snapshot> final_state;  ///< per rank
};

inline plain_result run_plain(const config& cfg, std::uint32_t ranks, std::uint64_t steps) {
  plain_result r;
  r.loss.resize(steps);
  r.final_state.resize(ranks);
  std::vector<int> group;
  for (std::uint32_t i = 0; i < ranks; ++i) group.push_back(static_cast<int>(i));
  deepclone::inproc::world world(static_cast<int>(ranks));
  world.run([&](deepclone::inproc::communicator& comm) {
    trainer t(cfg);
    for (std::uint64_t s = 0; s < steps; ++s) {
      double loss = t.step(comm, group);
      if (comm.rank() == 0) r.loss[s] = loss;
    }
    r.final_state[static_cast<std::size_t>(comm.rank())] = t.snap();
  });
  return r;
}

namespace detail {
/// Source hooks that also keep a copy of the state of the fork iteration: right before
/// end_iteration(k) every layer has had its update of iteration k and the metadata has
/// been written, which is exactly what the clone must end up holding.
template <class Source>
struct recording_hooks {
  Source& src;
  trainer& t;
  std::optional<snapshot>* keep;  // only on the rank that records
  void before_update(std::size_t l) { src.before_update(l); }
  void after_update(std::size_t l) { src.after_update(l); }
  void end_iteration(std::uint64_t step) {
    if (keep && src.fork_iteration() == step) *keep = t.snap();
    src.end_iteration(step);
  }
};
}  // namespace detail

/// N sources train while M clone ranks fork them after step `fork_at` and train on with
/// `clone_lr` over their own group. Throws what any rank threw (e.g. a clone failure).
template <class Engine>
fork_result run_fork(const fork_options& o, const typename Engine::settings& settings = {}) {
  if (o.sources == 0 || o.clones == 0) throw std::invalid_argument("run_fork: need at least one source and one clone rank");
  // Requests seen at the end of step fork_at + 1 fork at that step + fork_lead; the
  // sources must still be training then.
  const std::uint64_t expected_k = o.fork_at + 1 + settings.fork_lead;
  if (expected_k + 1 >= o.steps)
    throw std::invalid_argument("run_fork: --fork-at " + std::to_string(o.fork_at) + " forks at iteration " +
                                std::to_string(expected_k) + ", which needs at least " + std::to_string(expected_k + 2) +
                                " steps (have " + std::to_string(o.steps) + ")");
  const auto roles = deepclone::roles::contiguous(static_cast<int>(o.sources), static_cast<int>(o.clones));
  using tensor_t = std::vector<float>;
  using source_t = typename Engine::template source<tensor_t>;
  using clone_t = typename Engine::template clone<tensor_t>;

  fork_result r;
  r.source_loss.assign(o.steps, 0.0);
  r.clone_loss.assign(o.steps, std::nullopt);
  r.clone_at_fork.resize(o.clones);
  r.source_final.resize(o.sources);
  r.clone_final.resize(o.clones);
  std::optional<snapshot> at_fork;
  std::atomic<std::uint64_t> source_progress{0};  // steps finished by source rank 0
  std::atomic<std::uint32_t> requested{0};        // clone ranks that called request()
  std::atomic<bool> aborted{false};               // a rank threw: nobody waits for it any longer
  auto await = [&](auto done) {
    while (!done()) {
      if (aborted.load()) throw std::runtime_error("run_fork: another rank failed");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  };

  auto t0 = std::chrono::steady_clock::now();
  deepclone::inproc::world world(static_cast<int>(o.sources + o.clones));
  world.run([&](deepclone::inproc::communicator& comm) {
    try {
      const int rank = comm.rank();
      if (auto i = roles.source_index(rank)) {
        trainer t(o.cfg);
        source_t src(comm, roles, t.state(), settings);
        detail::recording_hooks<source_t> hooks{src, t, *i == 0 ? &at_fork : nullptr};
        for (std::uint64_t s = 0; s < o.steps; ++s) {
          double loss = t.step(comm, roles.sources, hooks);
          if (*i != 0) continue;
          r.source_loss[s] = loss;
          source_progress.store(s + 1);
          // "The user forks after step fork_at": the clone requests are in the coordinator's
          // mailbox before step fork_at + 1 ends, so k does not depend on thread timing.
          // If a clone rank failed, train on: the other sources wait for this one in the
          // allreduce, and the failure is rethrown once every rank is done.
          if (s == o.fork_at)
            while (requested.load() < o.clones && !aborted.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        src.finish();
        r.source_final[*i] = t.snap();
      } else {
        const auto j = *roles.clone_index(rank);
        trainer t(o.cfg, start::empty);
        clone_t dst(comm, roles, t.state(), settings);
        // A progress line for clones that take over a second ("clone rank 1: iteration 12: 3/5 layers, ...").
        dst.on_progress(deepclone::progress_line("clone rank " + std::to_string(j)));
        await([&] { return source_progress.load() > o.fork_at; });
        auto c0 = std::chrono::steady_clock::now();
        dst.request();
        requested.fetch_add(1);
        dst.wait_layer(0);  // a trainer with a layer-wise forward pass could start here
        if (j == 0) r.first_layer_wait_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
        dst.wait();
        r.clone_at_fork[j] = t.snap();
        const std::uint64_t k = *dst.fork_iteration();
        if (j == 0) r.k = k;
        // From here on the clone is an ordinary trainer over its own group, with its own
        // learning rate: the ablation the fork was made for.
        t.resume();
        t.metadata().hyper["lr"] = o.clone_lr;
        for (std::uint64_t s = k + 1; s < o.steps; ++s) {
          double loss = t.step(comm, roles.clones);
          if (j == 0) r.clone_loss[s] = loss;
        }
        r.clone_final[j] = t.snap();
        if (j == 0) r.report = dst.report();
      }
    } catch (...) {
      aborted.store(true);
      throw;
    }
  });
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!at_fork) throw std::runtime_error("run_fork: source rank 0 never reached the fork iteration");
  r.source_at_fork = std::move(*at_fork);
  trainer names(o.cfg, start::empty);
  r.names = names.tensor_names();
  return r;
}

}  // namespace mlp
