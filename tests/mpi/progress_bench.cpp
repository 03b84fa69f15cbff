// Measures whether progress driven from deepclone's hooks moves a large window-pipeline
// transfer while the sources compute between hooks, versus the adapter's progress thread.
//   mpirun -np 2 progress_bench [--progress-us=0] [--mb=100] [--layers=8] [--compute-ms=4] [--reps=3]
// Rank 0 is the source (N=1), rank 1 the clone (M=1). Prints, per fork: the clone's
// readiness, the source's overhead (fork iterations minus as many normal ones), the number
// of source iterations the transfer spanned, and a normal iteration's duration.
#include "harness.hpp"

#include <boost/mpi/environment.hpp>

#include <cstdio>
#include <cstring>
#include <string>

namespace dc = deepclone;
namespace dm = deepclone::mpi;

int main(int argc, char** argv) {
  boost::mpi::environment env(argc, argv, boost::mpi::threading::multiple);
  long progress_us = 0, mb = 100, layers = 8, compute_ms = 4, reps = 3;
  for (int i = 1; i < argc; ++i) {
    auto arg = [&](const char* name, long& v) {
      std::size_t n = std::strlen(name);
      if (std::strncmp(argv[i], name, n) == 0) v = std::stol(argv[i] + n);
    };
    arg("--progress-us=", progress_us);
    arg("--mb=", mb);
    arg("--layers=", layers);
    arg("--compute-ms=", compute_ms);
    arg("--reps=", reps);
  }
  dm::options mo;
  mo.progress_interval = std::chrono::microseconds(progress_us);
  using cloning = dc::engine<dm::communicator, dc::shard::split_even, dc::pipeline::window, dc::reconstruct::direct>;
  std::vector<std::size_t> sizes(static_cast<std::size_t>(layers),
                                 static_cast<std::size_t>(mb) * 1000000 / 4 / static_cast<std::size_t>(layers) / 2);  // w + momentum
  const auto roles = dc::roles::contiguous(1, 1);
  int bad = 0;
  for (long rep = 0; rep < reps; ++rep) {
    MPI_Comm c;
    MPI_Comm_dup(MPI_COMM_WORLD, &c);
    dm::communicator comm(c, mo);
    harness::model md(sizes);
    cloning::settings s;
    if (comm.rank() == 0) {
      cloning::source<harness::tensor_t> src(comm, roles, md.st, s);
      harness::loop_options lo;
      lo.compute_per_layer = std::chrono::milliseconds(compute_ms);
      lo.sessions = 1;
      lo.fingerprint = false;
      harness::train(src, comm, roles, md, lo);
    } else {
      cloning::clone<harness::tensor_t> dst(comm, roles, md.st, s);
      std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // let the source settle into normal iterations
      dst.request();
      dst.wait();
      auto r = dst.report();
      const auto& f = r.sources.at(0);
      std::printf("progress=%s state=%.0f MB readiness=%.3f s agreement=%.3f s overhead=%.3f s hook=%.3f s fork_iterations=%u normal_iteration=%.3f s\n",
                  progress_us ? (std::to_string(progress_us) + "us-thread").c_str() : "hooks", r.state_bytes / 1e6, r.readiness_s,
                  r.agreement_s, f.overhead_s, f.hook_s, f.fork_iterations, f.normal_iteration_s);
      std::fflush(stdout);
    }
  }
  return bad;
}
