// doctest main for tests run under mpirun: every rank runs every test case (a test case is
// collective over MPI_COMM_WORLD); the failure counts are summed over all ranks and every
// rank exits non-zero if any rank failed, so a failing rank fails the CTest test.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <boost/mpi/environment.hpp>
#include <mpi.h>

#include <cstdio>

int main(int argc, char** argv) {
  // The progress-thread tests need MPI_THREAD_MULTIPLE; the rest needs no more than FUNNELED.
  boost::mpi::environment env(argc, argv, boost::mpi::threading::multiple);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  if (rank != 0) ctx.setOption("minimal", true);  // rank 0 prints the summary; others only failures
  int failed = ctx.run();
  if (ctx.shouldExit()) return failed;
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any && rank == 0) std::fprintf(stderr, "deepclone mpi tests: a rank failed\n");
  return any ? 1 : 0;
}
