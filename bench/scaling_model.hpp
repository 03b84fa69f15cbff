#pragma once
// An analytic, per-layer ("fluid") cost model of every strategy of the benchmark: predicts
// readiness and source overhead from link bandwidths, per-layer compute times and the
// fork-agreement rule, for any N and M. Calibrated with what a run measures (bandwidth B,
// normal iteration time); printed next to the measured figures, and extrapolated to
// 1024 nodes against a parallel file system.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace bench::model {

struct params {
  std::vector<double> layer_bytes;  // forward order
  double N = 4, M = 2;
  double B_s = 1e9, B_c = 1e9;      // per-rank link, bytes/s (sources, clones)
  double latency = 20e-6;
  double iteration_s = 0.5;         // a normal iteration, update included
  double fwd_fraction = 1.0 / 3;    // of the compute
  double update_fraction = 0.0;     // of the iteration spent in updates (spread over backward)
  double fork_lead = 2;             // deepclone: k = decision iteration + fork_lead
  double request_phase = 1.0;       // fraction of an iteration left when the request arrives
  double pfs_write = 2e9, pfs_read = 2e9;  // aggregate storage bandwidth, bytes/s
  double checksum_rate = 4e9;       // bytes/s a source checksums its share at
  double segment = 1 << 20;         // pipelined broadcast segment, bytes
};

struct prediction {
  double readiness_s = 0, overhead_s = 0, first_layer_s = 0;
};

inline double total(const params& p) {
  double s = 0;
  for (double b : p.layer_bytes) s += b;
  return s;
}

/// deepclone with the given pipeline ("window", "staged", "blocking", "spill") and reconstruction
/// ("scatter_exchange", "direct"); `single_root` models the root broadcast. Agreement:
/// the coordinator protocol (k = the iteration in which the coordinator saw every request
/// + fork_lead), or, with `collective`, engine v2's agreement on the trainer's allreduce
/// (every source learns k at the next allreduce: k is the next iteration).
inline prediction deepclone(const params& p, const std::string& pipeline, const std::string& recon, bool single_root = false,
                            bool collective = false) {
  const double S = total(p), it = p.iteration_s;
  const std::size_t L = p.layer_bytes.size();
  // State bytes per second the slowest link lets through: the sources' egress carries
  // S (scatter_exchange) or S*M (direct), spread over N (or 1) senders; each clone's
  // ingress carries S either way (from sources, or from sources and other clone ranks).
  const double senders = single_root ? 1.0 : p.N;
  const double copies = recon == "direct" ? p.M : 1.0;
  double rate = std::min(senders * p.B_s / copies, p.B_c);
  // scatter_exchange forwards a layer once its owner holds it: a store-and-forward step of
  // one layer's share, which pipelining over layers hides except for the last layer.
  // Coordinator: the request is seen at the end of iteration j (request_phase of an
  // iteration later), k = j + fork_lead starts fork_lead - 1 iterations after that.
  // Collective (engine v2) in a trainer that allreduces its gradients before the updates
  // (DDP order): the word rides on iteration j's allreduce, so k = j and the layers become
  // final in j's update phase, the last update_fraction of the iteration.
  const double to_k = collective ? (p.request_phase - 1) * it : (p.request_phase + p.fork_lead - 1) * it;
  const double bwd_start = to_k + p.fwd_fraction * (1 - p.update_fraction) * it;
  const double bwd_len = it - p.fwd_fraction * (1 - p.update_fraction) * it;
  prediction out;
  std::vector<double> release(L), done(L);
  double cum = 0;
  for (std::size_t i = 0; i < L; ++i) {  // backward order: last layer released first
    const std::size_t l = L - 1 - i;
    cum += p.layer_bytes[l];
    if (pipeline == "blocking") release[l] = to_k + it;
    else if (collective) release[l] = std::max(0.0, to_k + it - p.update_fraction * it * (1 - cum / S));
    else release[l] = bwd_start + bwd_len * cum / S;
  }
  double t = 0, stall = 0, spilled = 0;
  const double chk = p.layer_bytes.empty() ? 0 : 1.0 / p.checksum_rate;
  for (std::size_t i = 0; i < L; ++i) {
    const std::size_t l = L - 1 - i;  // sent in release order
    t = std::max(t, release[l]) + p.layer_bytes[l] / rate;
    done[l] = t + p.latency;
    if (pipeline == "window") stall = std::max(stall, done[l] - (release[l] + it));  // window closes at the next update
    if (done[l] > release[l] + it) spilled += p.layer_bytes[l] * copies / senders;   // spill: still owed when overwritten
  }
  double last = *std::max_element(done.begin(), done.end());
  if (recon == "scatter_exchange" && p.M > 1) {
    double biggest = *std::max_element(p.layer_bytes.begin(), p.layer_bytes.end());
    last += biggest / p.M / p.B_c;  // the last layer's forward among clone ranks
  }
  out.readiness_s = last + p.latency;
  out.first_layer_s = done[0] + (recon == "scatter_exchange" && p.M > 1 ? p.layer_bytes[0] / p.M / p.B_c : 0);
  const double share = single_root ? S * copies : S * copies / p.N;
  const double hooks = share / p.checksum_rate;
  if (pipeline == "blocking") out.overhead_s = (last - (to_k + it)) + hooks;
  else if (pipeline == "staged") out.overhead_s = hooks + S / p.N / 8e9 + std::max(0.0, stall);  // checksums + staging copy
  else if (pipeline == "spill") out.overhead_s = hooks + spilled / 8e9;  // checksums + copying what is still owed
  else out.overhead_s = hooks + std::max(0.0, stall);
  (void)chk;
  return out;
}

/// Checkpoint-restart through a parallel file system: rank 0 (or, sharded, every source
/// its 1/N) writes at the next iteration boundary while training waits, then every clone
/// rank reads all S bytes (M readers share the file system's read bandwidth).
inline prediction checkpoint(const params& p, bool sharded) {
  const double S = total(p), it = p.iteration_s;
  const double writers = sharded ? p.N : 1.0;
  const double w_rate = std::min(writers * p.B_s, p.pfs_write);
  const double write = S / w_rate;
  const double r_rate_per_clone = std::min(p.B_c, p.pfs_read / p.M);
  const double read = S / r_rate_per_clone;
  prediction out;
  out.overhead_s = write;
  out.readiness_s = p.request_phase * it + write + read;
  out.first_layer_s = p.request_phase * it + write + p.layer_bytes.front() / r_rate_per_clone;
  return out;
}

/// A pipelined broadcast over P ranks at the next iteration boundary, the large-message
/// algorithm of MPI_Bcast (Open MPI's tuned component: a segmented chain or a pipelined
/// binary tree, whichever is faster here): chain S/B + (P-2) seg/B, binary tree
/// 2 S/B + (log2 P - 1) 2 seg/B (an inner node sends every segment twice). Training
/// stops for the whole broadcast (data-parallel ranks wait for each other).
inline prediction broadcast(const params& p, double P) {
  const double S = total(p), B = std::min(p.B_s, p.B_c);
  prediction out;
  if (P < 2) return out;
  const double chain = S / B + std::max(0.0, P - 2) * p.segment / B + (P - 1) * p.latency;
  const double depth = std::ceil(std::log2(P));
  const double tree = 2 * S / B + std::max(0.0, depth - 1) * 2 * p.segment / B + depth * p.latency;
  const double t = std::min(chain, tree);
  out.overhead_s = t;
  out.readiness_s = p.request_phase * p.iteration_s + t;
  out.first_layer_s = p.request_phase * p.iteration_s + p.layer_bytes.front() / B;
  return out;
}

/// Stop-the-world sharded transfer at the next boundary: every source sends its 1/(N M)
/// slice to each clone rank (S/N out of each source), the clone ranks allgather (S into each).
inline prediction sharded(const params& p) {
  const double S = total(p);
  const double t = std::max(S / (p.N * p.B_s), p.M > 1 ? S / p.B_c : S / p.M / p.B_c) + 2 * p.latency;
  prediction out;
  out.overhead_s = t;
  out.readiness_s = p.request_phase * p.iteration_s + t;
  out.first_layer_s = out.readiness_s;
  return out;
}

/// The physical bound of the issue: max(S / (N B_s), S / B_c).
inline double bound(const params& p) {
  const double S = total(p);
  return std::max(S / (p.N * p.B_s), S / p.B_c);
}

}  // namespace bench::model
