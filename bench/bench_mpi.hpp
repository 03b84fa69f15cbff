#pragma once
// The MPI benchmark's shared pieces: one process per rank, the run context, the common
// source loop (the realistic trainer with its per-iteration MPI_Allreduce over the
// sources), the common clone side (ask at a fixed time), and what each rank reports.
#include <mpi.h>

#include <deepclone/integrations/boost_mpi.hpp>
#include <deepclone/integrations/json.hpp>

#include <algorithm>
#include <functional>
#include <optional>

#include "bench_common.hpp"
#include "shm_fabric.hpp"

namespace bench::mpi {

static_assert(std::is_same_v<clock::duration, std::chrono::nanoseconds>, "steady_clock counts nanoseconds here");

using json = nlohmann::json;
/// Every strategy's traffic goes through this: raw (a pass-through) or emulated links.
using comm_t = deepclone::emulated_link<deepclone::mpi::communicator, clock, shm_fabric>;

// Control tags on the plain communicator (below deepclone's tag_base 1000).
constexpr int tag_request = 50, tag_done = 51, tag_file = 60;
// Data tags of the stop-the-world peers (on comm_t).
constexpr int tag_bcast = 70, tag_shard = 71, tag_probe = 77, tag_gather = 80;  // tag_gather + source index

struct mpi_config : config {
  int rounds = 3;
  double request_at_s = 0;   // when clones ask, from the run's start; 0: (warmup + 0.5) measured iterations
  int tail = 2;              // iterations the sources go on after every clone is done
  std::size_t segment = 1u << 20;  // pipelined broadcast segment (emulated links)
  std::string only;          // comma-separated strategy names (default: all)
  std::string results_name = "results.jsonl";
  bool emulated = true;      // also run with emulated links
  double poll_interval_ms = -1;  // the engines' settings.poll_interval; < 0: the engine's default
  double progress_us = 0;        // deepclone::mpi::options::progress_interval; 0: no progress thread
};

struct ctx {
  mpi_config cfg;
  int rank = 0, size = 0, N = 0, M = 0;
  deepclone::roles roles;
  MPI_Comm world = MPI_COMM_WORLD, sources = MPI_COMM_NULL, root_clones = MPI_COMM_NULL;
  std::optional<deepclone::mpi::communicator> base;
  std::shared_ptr<shm_fabric> raw, emulated, fabric;
  replica* rep = nullptr;
  deepclone::layout lay;
  std::string link_name;
  double request_at_s = 0, B = 0;
  double storage_link = 0, storage_store = 0;  // emulated storage pacing (bytes/s); 0: raw
  std::string cold_read;                       // how the checkpoint's read was made cold

  bool is_source() const { return rank < N; }
  int source_index() const { return rank; }
  int clone_index() const { return rank - N; }
  comm_t comm() const { return comm_t(*base, fabric); }
};

/// Seconds since `origin` (a steady_clock time point shared by every process of the node).
inline double since(clock::time_point origin, clock::time_point t) { return secs(origin, t); }

/// A cheap fingerprint of a replica: 16 elements spread over every tensor plus the step.
inline std::uint64_t sample_hash(replica& r) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* p, std::size_t n) {
    auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  };
  for (auto& t : r.tensors)
    for (std::size_t i = 0; i < 16; ++i) mix(&t[(t.size() - 1) * i / 15], sizeof(float));
  auto step = r.state.metadata().step;
  mix(&step, sizeof step);
  return h;
}

/// What a source loop hands to a strategy.
struct source_side {
  virtual ~source_side() = default;
  virtual void before_update(std::size_t) {}
  virtual void after_update(std::size_t) {}
  virtual void end_iteration(std::uint64_t) {}
  /// Around the per-iteration allreduce (agreement::collective puts its word in flags[2]).
  virtual void contribute(std::span<double>) {}
  virtual void learn(std::span<double>) {}
  /// Called on every source right after the iteration in whose allreduce the fork request
  /// was seen (stop-the-world peers transfer here; deepclone does nothing).
  virtual void at_boundary(std::uint64_t /*k*/) {}
  virtual bool wants_boundary() const { return false; }
};

/// Runs the trainer on a source rank until the clones are done (and `tail` iterations
/// more). Source 0 tests for the clones' requests (tag_request) and completions (tag_done)
/// before each allreduce; the allreduce tells every source. Fills `out` with the
/// iteration durations and times.
void source_loop(ctx& c, source_side& side, clock::time_point origin, json& out);

/// A clone rank: waits until the fixed request time, sends the request message (for the
/// peers), runs `receive`, then reports completion to source 0.
struct clone_times {
  double t_req = 0, t_ready = 0, t_first_layer = NAN;
};

/// Sends the "done" message; every strategy's clone side ends with it.
void clone_done(ctx& c);

/// Gathers each rank's JSON object at rank 0 (empty array elsewhere).
json gather(ctx& c, const json& mine);

/// Runs strategy `name` on every rank (collective); rank 0 returns the composed record.
json run_deepclone_mpi(ctx& c, const std::string& pipeline, const std::string& recon, const std::string& agreement,
                       clock::time_point origin);

}  // namespace bench::mpi
