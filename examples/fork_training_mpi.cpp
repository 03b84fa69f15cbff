// deepclone's demo over MPI: ranks [0, N) of MPI_COMM_WORLD train the MLP of mlp.hpp
// data-parallel (gradients averaged among the sources); after a chosen step the clone ranks
// [N, N+M) fork them, receive the state of one agreed iteration k while the sources keep
// training, and train on with their own learning rate (gradients averaged among the clones).
// Source rank 0 prints both loss curves and the clone report. Every rank exits non-zero if
// a clone's state at the fork differs by a single bit from source rank 0's state of
// iteration k (tensors, momentum slots and metadata).
//
//   mpirun -np 6 [--oversubscribe] [--allow-run-as-root] fork_training_mpi
//          [--sources N] [--clones M] [--fork-at STEP] [--steps S] [--clone-lr X]
//          [--lr X] [--seed S] [--progress-us US]
//
// N + M must be the number of MPI ranks (default N = 4, M = the rest). The same trainer,
// data and group sizes as the in-process demo (examples/fork_training.cpp) give bitwise the
// same loss curves: deepclone::allreduce_sum adds in rank order whatever the transport.
//
// Messages of this program (besides the trainer's tags 2..3 and 10.. and deepclone's tags
// from 1000): tags 900..905 on MPI_COMM_WORLD, point-to-point between source rank 0 and
// the clone ranks, all small except the snapshot of iteration k that source rank 0 sends
// each clone rank after its training loop (the state, ~0.9 MB for the default model).
#include <deepclone/deepclone.hpp>
#include <deepclone/integrations/boost_mpi.hpp>

#include <boost/mpi/communicator.hpp>
#include <boost/mpi/environment.hpp>
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mlp.hpp"

namespace {

namespace dm = deepclone::mpi;
using engine = deepclone::engine<dm::communicator, deepclone::shard::split_even, deepclone::pipeline::window,
                                 deepclone::reconstruct::scatter_exchange>;
using tensor_t = std::vector<float>;
using source_t = engine::source<tensor_t>;
using clone_t = engine::clone<tensor_t>;

// This program's own point-to-point tags (below deepclone's tag_base of 1000, apart from
// the trainer's 2, 3 and 10 + 2 * layer).
constexpr int tag_go = 900;        ///< source rank 0 -> clones: the sources finished step fork_at
constexpr int tag_requested = 901; ///< clone -> source rank 0: request() returned
constexpr int tag_snapshot = 902;  ///< source rank 0 -> clones: its state of iteration k
constexpr int tag_result = 903;    ///< clone -> source rank 0: outcome of its bitwise check
constexpr int tag_curve = 904;     ///< clone rank N -> source rank 0: k, its losses, timing
constexpr int tag_report = 905;    ///< clone rank N -> source rank 0: deepclone::to_string(report)

struct options {
  mlp::config cfg;
  std::uint32_t sources = 4;
  std::optional<std::uint32_t> clones;  ///< default: the ranks left over
  std::uint64_t fork_at = 10;
  std::uint64_t steps = 30;
  double clone_lr = 0.02;
  std::uint64_t progress_us = 0;  ///< deepclone::mpi progress thread (needs MPI_THREAD_MULTIPLE)
  /// Our tensors are 8 to 263 KiB, below the library's 1 MiB default: as in the in-process
  /// demo, a lower split threshold makes tensors actually split over sources and clones.
  std::uint64_t split_threshold = 64 << 10;
};

const char* usage_text =
    "usage: mpirun -np N+M fork_training_mpi [--sources N] [--clones M] [--fork-at STEP] [--steps S]\n"
    "                                        [--clone-lr X] [--lr X] [--seed S] [--progress-us US]\n"
    "  ranks [0, N) are sources, [N, N+M) clones; N defaults to 4, M to the remaining ranks\n";

/// Parses the command line; returns an error message instead of exiting so that only
/// rank 0 prints it, after MPI is up.
std::string parse(int argc, char** argv, options& o) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") return "fork a live data-parallel MLP training job over MPI into clone ranks";
    if (i + 1 >= argc) return "missing value after " + a;
    std::string v = argv[++i];
    std::size_t used = 0;
    try {
      if (a == "--clone-lr" || a == "--lr") {
        double x = std::stod(v, &used);
        if (used != v.size()) return "not a number for " + a + ": '" + v + "'";
        (a == "--lr" ? o.cfg.lr : o.clone_lr) = x;
        continue;
      }
      if (v.empty() || v.front() == '-') return "not a non-negative integer for " + a + ": '" + v + "'";
      unsigned long long x = std::stoull(v, &used);
      if (used != v.size()) return "not a non-negative integer for " + a + ": '" + v + "'";
      if (a == "--sources") o.sources = static_cast<std::uint32_t>(x);
      else if (a == "--clones") o.clones = static_cast<std::uint32_t>(x);
      else if (a == "--fork-at") o.fork_at = x;
      else if (a == "--steps") o.steps = x;
      else if (a == "--seed") o.cfg.seed = x;
      else if (a == "--progress-us") o.progress_us = x;
      else return "unknown option " + a;
    } catch (const std::exception&) {
      return "not a valid value for " + a + ": '" + v + "'";
    }
  }
  return {};
}

// --- small MPI helpers on MPI_COMM_WORLD (Boost.MPI's environment sets MPI_ERRORS_RETURN) ---

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    throw std::runtime_error(std::string(what) + ": " + std::string(text, static_cast<std::size_t>(len)));
  }
}

/// Waits for a request without spinning at full speed: with more ranks than cores (the
/// README's --oversubscribe run) a rank idling in a blocking MPI call would take CPU time
/// from the ranks that train.
void wait_politely(MPI_Request& r, MPI_Status* st = MPI_STATUS_IGNORE) {
  int done = 0;
  for (unsigned spins = 0;; ++spins) {
    check(MPI_Test(&r, &done, st), "MPI_Test");
    if (done) return;
    if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(spins > 1024 ? 1000 : 50));
  }
}

void send_bytes(const void* data, std::size_t n, int dest, int tag) {
  if (n > static_cast<std::size_t>(INT_MAX)) throw std::length_error("fork_training_mpi: message above INT_MAX bytes");
  MPI_Request r;
  check(MPI_Isend(data, static_cast<int>(n), MPI_BYTE, dest, tag, MPI_COMM_WORLD, &r), "MPI_Isend");
  wait_politely(r);
}

/// Receives a message of unknown length from `source`.
std::vector<std::byte> recv_bytes(int source, int tag) {
  int flag = 0;
  MPI_Status st;
  for (unsigned spins = 0; !flag; ++spins) {
    check(MPI_Iprobe(source, tag, MPI_COMM_WORLD, &flag, &st), "MPI_Iprobe");
    if (!flag && spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(spins > 1024 ? 1000 : 50));
  }
  int n = 0;
  check(MPI_Get_count(&st, MPI_BYTE, &n), "MPI_Get_count");
  std::vector<std::byte> b(static_cast<std::size_t>(n));
  MPI_Request r;
  check(MPI_Irecv(b.data(), n, MPI_BYTE, source, tag, MPI_COMM_WORLD, &r), "MPI_Irecv");
  wait_politely(r);
  return b;
}

void send_string(const std::string& s, int dest, int tag) { send_bytes(s.data(), s.size(), dest, tag); }
std::string recv_string(int source, int tag) {
  auto b = recv_bytes(source, tag);
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

// --- the snapshot of iteration k as bytes: [count][per tensor: elements, floats][metadata] ---

std::vector<std::byte> encode(const mlp::snapshot& s) {
  std::vector<std::byte> out;
  auto put = [&](const void* p, std::size_t n) {
    auto* b = static_cast<const std::byte*>(p);
    out.insert(out.end(), b, b + n);
  };
  const std::uint64_t count = s.tensors.size();
  put(&count, sizeof count);
  for (auto& t : s.tensors) {
    const std::uint64_t n = t.size();
    put(&n, sizeof n);
    put(t.data(), n * sizeof(float));
  }
  auto meta = s.meta.encode();
  put(meta.data(), meta.size());
  return out;
}

mlp::snapshot decode(std::span<const std::byte> b) {
  std::size_t at = 0;
  auto get = [&](void* p, std::size_t n) {
    if (b.size() - at < n) throw std::runtime_error("fork_training_mpi: truncated snapshot message");
    std::memcpy(p, b.data() + at, n);
    at += n;
  };
  mlp::snapshot s;
  std::uint64_t count = 0;
  get(&count, sizeof count);
  if (count > b.size()) throw std::runtime_error("fork_training_mpi: corrupt snapshot message");
  s.tensors.resize(count);
  for (auto& t : s.tensors) {
    std::uint64_t n = 0;
    get(&n, sizeof n);
    if (n > (b.size() - at) / sizeof(float)) throw std::runtime_error("fork_training_mpi: truncated snapshot message");
    t.resize(n);
    get(t.data(), n * sizeof(float));
  }
  s.meta = deepclone::metadata::decode(b.subspan(at));
  return s;
}

/// Source hooks that also keep a copy of the state of the fork iteration on source rank 0:
/// right before end_iteration(k) every layer has had its update of iteration k and the
/// metadata has been written, which is exactly what every clone rank must end up holding.
struct recording_hooks {
  source_t& src;
  mlp::trainer& t;
  std::optional<mlp::snapshot>* keep;  // only on source rank 0
  void before_update(std::size_t l) { src.before_update(l); }
  void after_update(std::size_t l) { src.after_update(l); }
  void end_iteration(std::uint64_t step) {
    if (keep && src.fork_iteration() == step) *keep = t.snap();
    src.end_iteration(step);
  }
};

/// What clone rank N sends source rank 0 for the table.
struct curve_header {
  std::uint64_t k;
  double first_layer_wait_s;
  double seconds;
};

/// One rank's part of the demo. Returns this rank's failure count (0 = all well).
int run(const options& o, std::uint32_t clones) {
  const auto roles = deepclone::roles::contiguous(static_cast<int>(o.sources), static_cast<int>(clones));
  boost::mpi::communicator world;
  dm::options mo;
  mo.progress_interval = std::chrono::microseconds(o.progress_us);
  dm::communicator comm(world, mo);  // collective: every rank constructs it
  engine::settings st;
  st.shard.threshold = o.split_threshold;
  st.reconstruct.threshold = o.split_threshold;
  const int rank = comm.rank();
  const int clone0 = roles.clones.front();
  const auto t0 = std::chrono::steady_clock::now();
  auto since = [](auto t) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(); };

  if (auto i = roles.source_index(rank)) {
    // ---------------- source ranks ----------------
    mlp::trainer t(o.cfg);
    std::optional<mlp::snapshot> at_fork;
    std::vector<double> loss(o.steps, 0.0);
    {
      source_t src(comm, roles, t.state(), st);
      recording_hooks hooks{src, t, *i == 0 ? &at_fork : nullptr};
      for (std::uint64_t s = 0; s < o.steps; ++s) {
        loss[s] = t.step(comm, roles.sources, hooks);
        // "The user forks after step fork_at": source rank 0 tells the clone ranks, then
        // waits until each has called request(), so that the requests are (normally) in its
        // mailbox when step fork_at + 1 ends and k = fork_at + 1 + fork_lead, as in the
        // in-process demo. The other sources wait for it in the next allreduce. (If a
        // request arrives later, k is later; the check below holds for whatever k is.)
        if (*i == 0 && s == o.fork_at) {
          for (int c : roles.clones) send_bytes(nullptr, 0, c, tag_go);
          for (int c : roles.clones) recv_bytes(c, tag_requested);
        }
      }
      src.finish();  // completes a transfer still in flight
    }
    if (*i != 0) return 0;

    // Source rank 0: its snapshot of iteration k goes to every clone rank, which compares.
    // An empty message means "no snapshot" (the sources never served a fork).
    std::vector<std::byte> snap_bytes;
    if (at_fork) snap_bytes = encode(*at_fork);
    for (int c : roles.clones) send_bytes(snap_bytes.data(), snap_bytes.size(), c, tag_snapshot);

    auto head_bytes = recv_bytes(clone0, tag_curve);
    curve_header head{};
    std::vector<double> clone_loss;
    if (head_bytes.size() >= sizeof head) {
      std::memcpy(&head, head_bytes.data(), sizeof head);
      clone_loss.resize((head_bytes.size() - sizeof head) / sizeof(double));
      std::memcpy(clone_loss.data(), head_bytes.data() + sizeof head, clone_loss.size() * sizeof(double));
    }
    const std::string report = recv_string(clone0, tag_report);
    std::vector<std::string> results;
    for (int c : roles.clones) results.push_back(recv_string(c, tag_result));
    const double seconds = since(t0);

    std::printf(" step   source loss    clone loss\n");
    for (std::uint64_t s = 0; s < o.steps; ++s) {
      std::printf("%5llu  %12.6f", static_cast<unsigned long long>(s), loss[s]);
      const bool has_clone = s > head.k && s - head.k - 1 < clone_loss.size() && !clone_loss.empty();
      if (has_clone) std::printf("  %12.6f", clone_loss[s - head.k - 1]);
      else if (!clone_loss.empty() && s == head.k) std::printf("  <- fork: the clone starts from the state of this iteration");
      std::printf("\n");
    }
    std::printf("\n%s", report.c_str());
    if (!clone_loss.empty())
      std::printf("  clone rank %d could start its forward pass %.4f s after its request (layer 0 ready)\n", clone0,
                  head.first_layer_wait_s);
    std::printf("  whole run %.3f s (source rank 0)\n\n", seconds);

    int bad = 0;
    if (!at_fork) {
      std::printf("check: FAILED: source rank 0 never reached a fork iteration (no clone session was served)\n");
      ++bad;
    }
    for (std::size_t j = 0; j < results.size(); ++j) {
      std::printf("check: %s\n", results[j].c_str());
      if (results[j].rfind("clone rank", 0) != 0) ++bad;  // a success line starts with "clone rank"
    }
    std::fflush(stdout);
    return bad;
  }

  // ---------------- clone ranks ----------------
  const auto j = *roles.clone_index(rank);
  mlp::trainer t(o.cfg, mlp::start::empty);
  std::optional<mlp::snapshot> mine;
  std::optional<std::uint64_t> k;
  std::string failure;
  std::vector<double> loss;
  double first_layer_wait_s = 0;
  std::string report;
  {
    clone_t dst(comm, roles, t.state(), st);
    // A progress line for clones that take over a second ("clone rank 4: iteration 12: 3/5 layers, ...").
    dst.on_progress(deepclone::progress_line("clone rank " + std::to_string(rank)));
    recv_bytes(roles.sources.front(), tag_go);
    try {
      const auto c0 = std::chrono::steady_clock::now();
      dst.request();
      send_bytes(nullptr, 0, roles.sources.front(), tag_requested);
      dst.wait_layer(0);  // a trainer with a layer-wise forward pass could start here
      first_layer_wait_s = since(c0);
      dst.wait();
      mine = t.snap();
      k = dst.fork_iteration();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    // The clone group trains as one unit: train on only if every clone rank has the state.
    double failed = mine ? 0.0 : 1.0;
    deepclone::allreduce_sum(comm, roles.clones, std::span<double>(&failed, 1), 4);
    if (failed == 0.0) {
      // From here on an ordinary trainer over the clone ranks' group, with its own learning
      // rate: the ablation the fork was made for.
      t.resume();
      t.metadata().hyper["lr"] = o.clone_lr;
      for (std::uint64_t s = *k + 1; s < o.steps; ++s) loss.push_back(t.step(comm, roles.clones));
      if (j == 0) {
        try {
          report = deepclone::to_string(dst.report());
        } catch (const std::exception& e) {
          report = std::string("(no report: ") + e.what() + ")\n";
        }
      }
    } else if (failure.empty()) {
      failure = "another clone rank failed, so this one did not train on";
    }
  }
  if (j == 0) {
    curve_header head{k.value_or(0), first_layer_wait_s, 0.0};
    std::vector<std::byte> b(sizeof head + loss.size() * sizeof(double));
    std::memcpy(b.data(), &head, sizeof head);
    if (!loss.empty()) std::memcpy(b.data() + sizeof head, loss.data(), loss.size() * sizeof(double));
    send_bytes(b.data(), b.size(), roles.sources.front(), tag_curve);
    send_string(report.empty() ? "(no clone report: the clone failed)\n" : report, roles.sources.front(), tag_report);
  }

  // The check the demo exists for: right after wait() and before its first update this rank
  // held, bit for bit, what source rank 0 held at the end of iteration k.
  auto ref_bytes = recv_bytes(roles.sources.front(), tag_snapshot);
  std::string result;
  if (!failure.empty()) {
    result = "FAILED: clone rank " + std::to_string(rank) + ": " + failure;
  } else if (ref_bytes.empty()) {
    result = "FAILED: clone rank " + std::to_string(rank) + " has a state, but source rank 0 recorded no fork iteration";
  } else {
    try {
      auto ref = decode(ref_bytes);
      std::uint64_t bytes = 0;
      for (auto& x : ref.tensors) bytes += x.size() * sizeof(float);
      auto diff = mlp::first_difference(*mine, ref, t.tensor_names());
      if (ref.meta.step != *k)
        result = "FAILED: clone rank " + std::to_string(rank) + " forked at iteration " + std::to_string(*k) +
                 ", but source rank 0's snapshot is of iteration " + std::to_string(ref.meta.step);
      else if (!diff.empty())
        result = "FAILED: clone rank " + std::to_string(rank) + " differs from the sources' state of iteration " +
                 std::to_string(*k) + ": " + diff;
      else
        result = "clone rank " + std::to_string(rank) + " holds the sources' state of iteration " + std::to_string(*k) +
                 " bit for bit (" + std::to_string(ref.tensors.size()) + " tensors, " + std::to_string(bytes) +
                 " B, metadata: step " + std::to_string(mine->meta.step) + ", data cursor " +
                 std::to_string(mine->meta.data_cursor) + ", rng, lr, momentum)";
    } catch (const std::exception& e) {
      result = "FAILED: clone rank " + std::to_string(rank) + ": " + e.what();
    }
  }
  send_string(result, roles.sources.front(), tag_result);
  return result.rfind("clone rank", 0) == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  const std::string bad_args = parse(argc, argv, o);
  // deepclone calls MPI only from the thread that calls its hooks and request/wait, here the
  // main thread: MPI_THREAD_FUNNELED. The optional progress thread needs MPI_THREAD_MULTIPLE.
  const bool progress = bad_args.empty() && o.progress_us > 0;
  boost::mpi::environment env(argc, argv,
                              progress ? boost::mpi::threading::multiple : boost::mpi::threading::funneled);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  // Argument errors: rank 0 says why, every rank exits 2.
  std::string why = bad_args;
  const std::uint32_t clones = o.clones.value_or(size > static_cast<int>(o.sources) ? size - o.sources : 0);
  if (why.empty()) {
    const std::uint64_t expected_k = o.fork_at + 1 + engine::settings{}.fork_lead;
    if (o.sources == 0) why = "--sources must be at least 1";
    else if (clones == 0) why = "need at least one clone rank: run with more than --sources " + std::to_string(o.sources) + " ranks";
    else if (static_cast<std::uint64_t>(o.sources) + clones != static_cast<std::uint64_t>(size))
      why = "--sources " + std::to_string(o.sources) + " + --clones " + std::to_string(clones) + " must equal the " +
            std::to_string(size) + " MPI ranks (mpirun -np " + std::to_string(o.sources + clones) + ")";
    else if (expected_k + 1 >= o.steps)
      why = "--fork-at " + std::to_string(o.fork_at) + " forks at iteration " + std::to_string(expected_k) +
            ", which needs at least " + std::to_string(expected_k + 2) + " steps (have " + std::to_string(o.steps) + ")";
  }
  if (!why.empty()) {
    if (rank == 0) std::fprintf(stderr, "fork_training_mpi: %s\n%s", why.c_str(), usage_text);
    return 2;
  }

  int failures = 0;
  try {
    dm::require_thread_level(progress ? dm::thread_level::multiple : dm::thread_level::funneled, "fork_training_mpi");
    if (rank == 0) {
      const auto& cfg = o.cfg;
      std::string arch;
      std::uint64_t params = 0;
      for (std::size_t l = 0; l < cfg.widths.size(); ++l) {
        arch += (l ? "-" : "") + std::to_string(cfg.widths[l]);
        if (l) params += cfg.widths[l] * (cfg.widths[l - 1] + 1);
      }
      std::printf("deepclone fork_training_mpi: %u source ranks -> %u clone ranks, MPI (%d processes, %s%s)\n",
                  o.sources, clones, size, dm::thread_level_name(dm::provided_thread_level()),
                  progress ? (", progress thread every " + std::to_string(o.progress_us) + " us").c_str() : "");
      std::printf("model: MLP %s (tanh), %llu parameters, state %llu B with momentum; global batch %zu, seed %llu\n",
                  arch.c_str(), static_cast<unsigned long long>(params), static_cast<unsigned long long>(8 * params),
                  cfg.global_batch, static_cast<unsigned long long>(cfg.seed));
      std::printf("policies: %s (split threshold %llu B)\n", engine::describe({}).c_str(),
                  static_cast<unsigned long long>(o.split_threshold));
      std::printf("the clone ranks request a fork after step %llu; sources lr %g, clone lr %g; %llu steps\n\n",
                  static_cast<unsigned long long>(o.fork_at), cfg.lr, o.clone_lr,
                  static_cast<unsigned long long>(o.steps));
      std::fflush(stdout);
    }
    failures = run(o, clones);
  } catch (const std::exception& e) {
    // Something outside the clone's own error handling (a transport error in the trainer's
    // allreduce, ...): the other ranks may be blocked on this one, so end the whole job.
    std::fprintf(stderr, "fork_training_mpi: rank %d: FAILED: %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

  // Every rank exits non-zero if any rank saw a difference or a failure.
  int any = 0;
  MPI_Allreduce(&failures, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) std::printf("%s\n", any ? "result: FAILED" : "result: OK");
  return any ? 1 : 0;
}
