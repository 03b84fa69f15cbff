// Forks over MPI: sources are ranks [0, N), clone ranks [N, N+M) of MPI_COMM_WORLD (an
// MPMD-like single binary). Test cases named "policies:" use N+M = world size for every
// (N in 1..4, M in 1..2) that fits; "scenario:" cases need at least 3 ranks.
#include "harness.hpp"

#include <doctest/doctest.h>

#include <boost/mpi/communicator.hpp>

#include <chrono>
#include <cstdio>
#include <string>
#include <tuple>
#include <type_traits>

namespace dc = deepclone;
namespace dm = deepclone::mpi;
using harness::model;
using harness::tensor_t;

namespace {

template <class P, class R>
using engine_t = dc::engine<dm::communicator, dc::shard::split_even, P, R>;

int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

/// A fresh communicator per fork, so that nothing of one fork can reach the next. It is
/// deliberately never freed: deepclone leaves a few control messages unreceived (e.g. a
/// clone's cancel after the sources already dropped the session), and Open MPI hands
/// messages that arrive for a freed communicator to the next communicator that reuses its
/// context id, where a new engine (whose session ids restart at 1) would take them.
struct fresh_comm {
  MPI_Comm c = MPI_COMM_NULL;
  fresh_comm() {
    MPI_Comm_dup(MPI_COMM_WORLD, &c);
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
  }
};

template <class Engine>
typename Engine::settings test_settings() {
  typename Engine::settings s;
  s.timeout = std::chrono::seconds(20);
  if constexpr (std::is_same_v<typename Engine::pipeline_type, dc::pipeline::staged>) s.pipeline.staging_bytes = 256 << 10;
  return s;
}

struct clone_options {
  std::chrono::milliseconds before_wait{0};  ///< idle (no MPI calls) between request and wait
  std::vector<std::size_t> sizes = harness::default_sizes();
  bool verify_replicas = false;  ///< clone ranks ask every source for its replica's digest
};

struct outcome {
  std::uint64_t k = ~0ull, fingerprint = 0;
  std::optional<dc::error> err;
  harness::source_result src;
};

/// One fork with sources [0, n) and clones [n, n+m); every rank of the world takes part.
template <class Engine>
outcome fork_once(int n, int m, const harness::loop_options& lo, const clone_options& co = {},
                  dm::options mo = {}) {
  fresh_comm fc;
  dm::communicator comm(fc.c, mo);
  const auto roles = dc::roles::contiguous(n, m);
  auto s = test_settings<Engine>();
  s.verify_replicas = co.verify_replicas;
  outcome out;
  if (comm.rank() < n) {
    model md(harness::default_sizes());
    typename Engine::template source<tensor_t> src(comm, roles, md.st, s);
    out.src = harness::train(src, comm, roles, md, lo);
    src.finish();  // completes (or fails) a session still in flight
    out.src.completed = src.sessions_completed();
    out.src.failed = src.sessions_failed();
    out.src.last_error = src.last_error();
    if (out.src.k) out.k = *out.src.k, out.fingerprint = out.src.fingerprint;
  } else {
    model md(co.sizes);
    typename Engine::template clone<tensor_t> dst(comm, roles, md.st, s);
    try {
      dst.request();
      if (co.before_wait.count()) std::this_thread::sleep_for(co.before_wait);
      dst.wait();
      out.k = dst.metadata().step;
      out.fingerprint = md.fingerprint(out.k);
      auto rep = dst.report();
      CHECK(rep.iteration == out.k);
      CHECK(rep.state_bytes == md.st.describe().total_bytes());
      CHECK(rep.replicas_verified == (co.verify_replicas ? static_cast<std::uint32_t>(n) : 0u));
    } catch (const dc::error& e) {
      out.err = e;
    }
  }
  return out;
}

/// Checks that every source served the same k and every clone holds that state bitwise.
void expect_identical(const outcome& o, int n, const std::string& what) {
  INFO(what << " on world rank " << world_rank());
  if (o.err) FAIL_CHECK("clone failed: " << std::string(o.err->what()));
  auto all = harness::gather(MPI_COMM_WORLD, o.k, o.fingerprint);
  REQUIRE(static_cast<int>(all.size()) > n);
  const auto ref = all[0];
  CHECK(ref.first != ~0ull);
  for (std::size_t i = 0; i < all.size(); ++i) {
    INFO("rank " << i << (static_cast<int>(i) < n ? " (source)" : " (clone)") << ": k = " << all[i].first);
    CHECK(all[i].first == ref.first);
    CHECK(all[i].second == ref.second);
  }
}

template <class Engine>
void fork_and_check(int n, int m, const harness::loop_options& lo = {}, const clone_options& co = {}, dm::options mo = {}) {
  const std::string what = "N=" + std::to_string(n) + " M=" + std::to_string(m) + " " + Engine::describe({});
  auto t0 = std::chrono::steady_clock::now();
  auto o = fork_once<Engine>(n, m, lo, co, mo);
  if (world_rank() < n && (!o.src.k || o.src.failed))
    MESSAGE("source " << world_rank() << ": " << o.src.steps << " steps, " << o.src.completed << " completed, " << o.src.failed
                      << " failed" << (o.src.last_error ? ": " + o.src.last_error->what : std::string()));
  expect_identical(o, n, what);
  if (world_rank() == 0)
    std::printf("  %-60s %.2f s\n", what.c_str(), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

template <class P>
void both_reconstructions(int n, int m) {
  fork_and_check<engine_t<P, dc::reconstruct::direct>>(n, m);
  fork_and_check<engine_t<P, dc::reconstruct::scatter_exchange>>(n, m);
}

using default_engine = engine_t<dc::pipeline::window, dc::reconstruct::scatter_exchange>;

/// A source rank of a scenario: trains with `lo` until its sessions are done, then finishes.
harness::source_result serve(dm::communicator& comm, const dc::roles& roles, const default_engine::settings& s,
                             const harness::loop_options& lo) {
  model md(harness::default_sizes());
  default_engine::source<tensor_t> src(comm, roles, md.st, s);
  auto r = harness::train(src, comm, roles, md, lo);
  src.finish();
  return r;
}

/// Every rank's (k, state fingerprint) must equal every other's.
void expect_same_state(std::uint64_t k, std::uint64_t fp) {
  auto all = harness::gather(MPI_COMM_WORLD, k, fp);
  for (auto& p : all) {
    CHECK(p.first == all[0].first);
    CHECK(p.second == all[0].second);
  }
}

}  // namespace

TEST_CASE("policies: every pipeline and reconstruction policy, sources [0,N) and clones [N,N+M) of the world") {
  const int w = world_size();
  int runs = 0;
  for (int m = 1; m <= 2; ++m) {
    const int n = w - m;
    if (n < 1 || n > 4) continue;
    both_reconstructions<dc::pipeline::window>(n, m);
    both_reconstructions<dc::pipeline::staged>(n, m);
    both_reconstructions<dc::pipeline::blocking>(n, m);
    runs += 6;
  }
  CHECK(runs > 0);
}

TEST_CASE("policies: verify_replicas, every source confirms the received state with its replica's digest") {
  const int w = world_size();
  const int m = w >= 3 ? 2 : 1;
  clone_options co;
  co.verify_replicas = true;
  fork_and_check<engine_t<dc::pipeline::window, dc::reconstruct::scatter_exchange>>(w - m, m, {}, co);
  fork_and_check<engine_t<dc::pipeline::blocking, dc::reconstruct::direct>>(w - m, m, {}, co);
}

TEST_CASE("policies: agreement::collective, the fork word fused into the sources' gradient allreduce") {
  const int w = world_size();
  const int m = w >= 3 ? 2 : 1;
  using collective = dc::agreement::collective;
  fork_and_check<dc::engine<dm::communicator, dc::shard::split_even, dc::pipeline::window, dc::reconstruct::scatter_exchange,
                            dc::checksum::mix64, collective>>(w - m, m);
  fork_and_check<dc::engine<dm::communicator, dc::shard::split_even, dc::pipeline::staged, dc::reconstruct::direct,
                            dc::checksum::mix64, collective>>(w - m, m);
}

TEST_CASE("policies: split MPI messages (max_message_bytes below the piece size) keep every byte in place") {
  const int w = world_size();
  const int m = w >= 3 ? 2 : 1;
  dm::options mo;
  mo.max_message_bytes = 100003;  // pieces of the 1.6 MB weight travel as several MPI messages
  fork_and_check<engine_t<dc::pipeline::window, dc::reconstruct::scatter_exchange>>(w - m, m, {}, {}, mo);
  fork_and_check<engine_t<dc::pipeline::staged, dc::reconstruct::direct>>(w - m, m, {}, {}, mo);
}

TEST_CASE("scenario: sources with skewed timing agree on one fork iteration") {
  const int w = world_size();
  REQUIRE(w >= 3);
  harness::loop_options lo;
  // Source 0 (the coordinator) and the last source are late in different steps.
  const std::uint32_t last = static_cast<std::uint32_t>(w - 2);
  lo.delay = [last](std::uint32_t s, std::uint64_t step) {
    if (s == 0 && step % 3 == 0) return std::chrono::microseconds(12000);
    if (s == last && step % 2 == 1) return std::chrono::microseconds(20000);
    return std::chrono::microseconds(0);
  };
  for (int rep = 0; rep < 3; ++rep) {
    clone_options co;
    auto o = fork_once<default_engine>(w - 1, 1, lo, co);
    expect_identical(o, w - 1, "skewed sources, repetition " + std::to_string(rep));
  }
}

TEST_CASE("scenario: a clone whose layout differs gets layout_mismatch; the sources train on and serve the next request") {
  const int w = world_size();
  REQUIRE(w >= 3);
  const int m = 2, n = w - m;
  fresh_comm fc;
  dm::communicator comm(fc.c);
  const auto roles = dc::roles::contiguous(n, m);
  auto s = test_settings<default_engine>();
  std::uint64_t k = ~0ull, fp = 0;
  if (comm.rank() < n) {
    auto r = serve(comm, roles, s, {});
    CHECK(r.completed == 1);
    CHECK(r.failed == 0);
    REQUIRE(r.k.has_value());
    k = *r.k;
    fp = r.fingerprint;
  } else {
    {
      auto sizes = harness::default_sizes();
      if (comm.rank() == w - 1) sizes[2] += 1;  // the last clone rank's layer2 differs
      model bad(sizes);
      default_engine::clone<tensor_t> dst(comm, roles, bad.st, s);
      dst.request();
      try {
        dst.wait();
        FAIL_CHECK("a clone with a differing layout completed");
      } catch (const dc::error& e) {
        CHECK(e.kind() == dc::errc::layout_mismatch);
        std::string msg = e.what();
        INFO(msg);
        if (comm.rank() == w - 1) CHECK(msg.find("layer2") != std::string::npos);
      }
    }
    model good(harness::default_sizes());
    default_engine::clone<tensor_t> dst(comm, roles, good.st, s);
    dst.request();
    dst.wait();
    k = dst.metadata().step;
    fp = good.fingerprint(k);
  }
  expect_same_state(k, fp);
}

TEST_CASE("scenario: clones cancelled or destroyed mid-transfer leave nothing behind; the next requests succeed") {
  // Four sessions on one communicator: cancelled, completed, engine destroyed, completed.
  // Whatever the abandoned sessions left queued in MPI must not reach the later ones.
  const int w = world_size();
  REQUIRE(w >= 3);
  const int m = 2, n = w - m;
  fresh_comm fc;
  dm::communicator comm(fc.c);
  const auto roles = dc::roles::contiguous(n, m);
  auto s = test_settings<default_engine>();
  std::uint64_t k = ~0ull, fp = 0;
  if (comm.rank() < n) {
    harness::loop_options lo;
    lo.sessions = 4;
    lo.compute_per_layer = std::chrono::microseconds(500);
    auto r = serve(comm, roles, s, lo);
    CHECK(r.completed >= 2);
    REQUIRE(r.k.has_value());
    k = *r.k;
    fp = r.fingerprint;
  } else {
    model md(harness::default_sizes());
    auto abandon = [&](bool destroy) {
      std::optional<default_engine::clone<tensor_t>> dst(std::in_place, comm, roles, md.st, s);
      try {
        dst->request();
        dst->wait_layer(3);  // updated first: the other layers are still on their way
        if (!destroy) dst->cancel();
      } catch (const dc::error&) {  // the peer clone rank may have given up first
      }
      dst.reset();
    };
    auto complete = [&](default_engine::clone<tensor_t>& dst) {
      dst.request();
      dst.wait();
      k = dst.metadata().step;
      fp = md.fingerprint(k);
    };
    abandon(false);
    {
      default_engine::clone<tensor_t> dst(comm, roles, md.st, s);
      complete(dst);
    }
    abandon(true);
    default_engine::clone<tensor_t> dst(comm, roles, md.st, s);
    complete(dst);
  }
  expect_same_state(k, fp);
}

TEST_CASE("scenario: sources that finish their training loop while the clone is in flight complete it") {
  const int w = world_size();
  REQUIRE(w >= 3);
  harness::loop_options lo;
  lo.stop_after_fork = true;
  lo.compute_per_layer = std::chrono::microseconds(2000);
  clone_options co;
  co.before_wait = std::chrono::milliseconds(400);  // the clone makes no MPI progress meanwhile
  {
    auto o = fork_once<default_engine>(w - 2, 2, lo, co);
    expect_identical(o, w - 2, "stop after k, window/scatter_exchange");
    if (world_rank() < w - 2) CHECK(o.src.completed == 1);
  }
  {
    auto o = fork_once<engine_t<dc::pipeline::staged, dc::reconstruct::direct>>(w - 1, 1, lo, co);
    expect_identical(o, w - 1, "stop after k, staged/direct");
  }
}

TEST_CASE("scenario: sources that stop before the fork iteration fail the clone with source_failed, without hanging") {
  const int w = world_size();
  REQUIRE(w >= 3);
  harness::loop_options lo;
  lo.stop_on_decision = true;
  auto t0 = std::chrono::steady_clock::now();
  auto o = fork_once<default_engine>(w - 1, 1, lo);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (world_rank() == w - 1) {
    REQUIRE(o.err.has_value());
    INFO(std::string(o.err->what()));
    CHECK(o.err->kind() == dc::errc::source_failed);
    CHECK(took < 10.0);
  } else {
    CHECK(o.src.failed == 1);
    CHECK(o.src.completed == 0);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("scenario: with the progress thread (MPI_THREAD_MULTIPLE)") {
  const int w = world_size();
  REQUIRE(w >= 3);
  dm::options mo;
  mo.progress_interval = std::chrono::microseconds(200);
  harness::loop_options lo;
  lo.compute_per_layer = std::chrono::microseconds(1000);
  fork_and_check<default_engine>(w - 2, 2, lo, {}, mo);
  fork_and_check<engine_t<dc::pipeline::blocking, dc::reconstruct::direct>>(w - 1, 1, lo, {}, mo);
}
