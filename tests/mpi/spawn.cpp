// The clone job started later: the sources (this program under `mpirun -np N`) train; at
// step 5 they start M clone processes of this same binary with MPI_Comm_spawn
// (deepclone::mpi::spawn_clones), the two groups are merged into one communicator (sources
// [0, N), clones [N, N+M)), and the clone proceeds as in the single-job (MPMD) setting.
// Exit status: non-zero on every rank of both groups if any rank saw a difference.
//   mpirun -np 2 --oversubscribe deepclone_mpi_spawn [--clones=M]
#include "harness.hpp"

#include <boost/mpi/environment.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <unistd.h>

namespace dc = deepclone;
namespace dm = deepclone::mpi;
using cloning = dc::engine<dm::communicator>;

int main(int argc, char** argv) {
  boost::mpi::environment env(argc, argv, boost::mpi::threading::funneled);
  dm::require_thread_level(dm::thread_level::funneled, "deepclone_mpi_spawn");
  int clones = 1;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--clones=", 9) == 0) clones = std::stoi(argv[i] + 9);

  MPI_Comm merged = dm::join_spawned();
  const bool is_clone = merged != MPI_COMM_NULL;
  int n = 0;
  if (!is_clone) {
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    // Train a few steps on the sources alone (gradients averaged with MPI_Allreduce).
    harness::model md(harness::default_sizes());
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    for (std::uint64_t step = 0; step < 5; ++step) {
      double g = harness::contribution(static_cast<std::uint32_t>(rank), step);
      MPI_Allreduce(MPI_IN_PLACE, &g, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
      for (std::size_t l = md.w.size(); l-- > 0;) md.update(l, step, g);
    }
    // A clone is wanted: start it now, while the sources hold their state.
    char exe[4096] = {0};
    ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    std::string self = len > 0 ? std::string(exe, static_cast<std::size_t>(len)) : std::string(argv[0]);
    auto t0 = std::chrono::steady_clock::now();
    merged = dm::spawn_clones(MPI_COMM_WORLD, self, {"--clones=" + std::to_string(clones)}, clones, /*oversubscribe=*/true);
    double spawn_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank == 0) std::printf("spawned %d clone rank(s) in %.2f s\n", clones, spawn_s);
    int size = 0;
    MPI_Comm_size(merged, &size);
    std::uint64_t k = ~0ull, fp = 0;
    int failed = 0;
    {
      dm::communicator comm(merged);
      const auto roles = dc::roles::contiguous(n, size - n);
      cloning::source<harness::tensor_t> src(comm, roles, md.st);
      auto r = harness::train(src, comm, roles, md, {});
      src.finish();
      if (r.k) k = *r.k, fp = r.fingerprint;
      failed = src.sessions_completed() == 1 ? 0 : 1;
      auto all = harness::gather(merged, k, fp);
      for (auto& p : all) failed |= p != all[0] || p.first == ~0ull;
      MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, merged);
      if (rank == 0) std::printf("sources: fork at k = %llu, clone %s\n", static_cast<unsigned long long>(k), failed ? "DIFFERS" : "identical");
    }
    MPI_Comm_free(&merged);
    return failed;
  }
  // A spawned clone rank.
  int size = 0, rank = 0, remote = 0;
  MPI_Comm_size(merged, &size);
  MPI_Comm_rank(merged, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &remote);  // the clone job's own world: the M clone ranks
  n = size - remote;
  std::uint64_t k = ~0ull, fp = 0;
  int failed = 0;
  {
    dm::communicator comm(merged);
    const auto roles = dc::roles::contiguous(n, remote);
    harness::model md(harness::default_sizes());
    cloning::clone<harness::tensor_t> dst(comm, roles, md.st);
    try {
      dst.request();
      dst.wait();
      k = dst.metadata().step;
      fp = md.fingerprint(k);
      auto rep = dst.report();
      if (rank == n)
        std::printf("clone: state of iteration %llu ready %.3f s after the request\n", static_cast<unsigned long long>(k), rep.readiness_s);
    } catch (const dc::error& e) {
      std::fprintf(stderr, "clone rank %d failed: %s\n", rank, e.what());
      failed = 1;
    }
    auto all = harness::gather(merged, k, fp);
    for (auto& p : all) failed |= p != all[0] || p.first == ~0ull;
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, merged);
  }
  MPI_Comm_free(&merged);
  return failed;
}
