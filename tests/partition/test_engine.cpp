// The partitioned engine (partition_engine.hpp) in-process: sources that train (every
// iteration rewrites each layer they hold, last layer first) and agree on the fork with
// agreement::collective (the trainer's per-iteration allreduce over the sources carries the
// word) or agreement::coordinator; clone ranks that ask, receive and check every byte they
// want against the sources' value of that byte in the agreed iteration k. Repeated forks on
// the same ranks, the collective placed mid-iteration (k in progress), a clone rank that
// gives up (its peers fail cleanly, the next fork is exact), refusals (global layout),
// hook-order rules and timeouts.
#include <doctest/doctest.h>

#include <deepclone/collectives.hpp>
#include <deepclone/inproc.hpp>
#include <deepclone/partition_engine.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "training.hpp"

namespace dc = deepclone;
using namespace partition_test;
using namespace std::chrono_literals;

namespace {

/// How `run` trains and forks.
struct run_options {
  dc::partition_sharing sharing = dc::partition_sharing::none;
  collective_at at = collective_at::boundary;
  int forks = 2;
};

struct outcome {
  std::vector<std::vector<std::uint64_t>> ks;  ///< per clone rank, the k of each fork
  std::vector<std::vector<bool>> exact;        ///< per clone rank and fork
  std::vector<std::uint64_t> completed, failed;  ///< per source
  std::vector<std::string> errors;
};

/// What a clone rank does in `run` instead of forking `o.forks` times with one clone object.
using clone_body = std::function<void(dc::inproc::communicator&, const dc::partition_job&, std::uint32_t, outcome&)>;

/// N sources training, M clone ranks forking `o.forks` times each with one clone object
/// (or running `body`).
template <class Engine>
outcome run(const scenario& s, const run_options& o, typename Engine::settings set = {}, clone_body body = {}) {
  const auto n = static_cast<std::uint32_t>(s.src.size()), m = static_cast<std::uint32_t>(s.dst.size());
  const auto r = dc::roles::contiguous(int(n), int(m));
  dc::partition_job job(r, s.lay, s.src, s.dst, {.sharing = o.sharing});
  dc::inproc::world w(int(n + m));
  outcome out{std::vector<std::vector<std::uint64_t>>(m), std::vector<std::vector<bool>>(m), std::vector<std::uint64_t>(n),
              std::vector<std::uint64_t>(n), {}};
  std::atomic<int> clones_done{0};
  std::mutex mu;
  std::vector<std::thread> ranks;
  const auto guarded = [&](auto body) {
    try {
      body();
    } catch (const std::exception& e) {
      std::lock_guard g(mu);
      out.errors.push_back(e.what());
    }
  };
  for (std::uint32_t i = 0; i < n; ++i)
    ranks.emplace_back([&, i] {
      guarded([&] {
        auto c = w.comm(int(i));
        trainer me(s, i);
        typename Engine::source src(c, job, me.parts(), set);
        train<Engine>(c, s, r, src, me, [&] { return clones_done.load() == int(m); }, o.at);
        src.finish();
        out.completed[i] = src.forks_completed(), out.failed[i] = src.forks_failed();
      });
    });
  for (std::uint32_t j = 0; j < m; ++j)
    ranks.emplace_back([&, j] {
      guarded([&] {
        auto c = w.comm(int(n + j));
        if (body) return body(c, job, j, out);
        auto own = own_tensors(s.lay, s.dst[j], false);
        auto parts = spans<std::byte>(own);
        typename Engine::clone dst(c, job, parts, set);
        for (int f = 0; f < o.forks; ++f) {
          for (auto& t : own) std::fill(t.begin(), t.end(), std::byte{0xEE});
          std::this_thread::sleep_for(3ms);  // the sources train meanwhile
          const auto k = dst.wait();
          out.ks[j].push_back(k), out.exact[j].push_back(exact(s, j, own, k));
        }
      });
      ++clones_done;
    });
  for (auto& t : ranks) t.join();
  return out;
}

void check_exact(const outcome& o, int forks) {
  for (const auto& e : o.errors) INFO(e);
  REQUIRE(o.errors.empty());
  for (std::size_t j = 0; j < o.ks.size(); ++j) {
    REQUIRE(o.ks[j].size() == std::size_t(forks));
    CHECK(o.ks[j] == o.ks[0]);  // every clone rank got the same iteration
    for (bool e : o.exact[j]) CHECK(e);
  }
  for (std::size_t f = 1; f < o.ks[0].size(); ++f) CHECK(o.ks[0][f] > o.ks[0][f - 1]);
  for (auto c : o.completed) CHECK(c == std::uint64_t(forks));
  for (auto f : o.failed) CHECK(f == 0);
}

using collective_engine = dc::partition_engine<dc::inproc::communicator>;
using coordinator_engine = dc::partition_engine<dc::inproc::communicator, dc::agreement::coordinator>;

}  // namespace

TEST_CASE("partition engine: the trainer's collective agrees on k; every clone byte is the sources' of k, fork after fork") {
  struct named {
    const char* name;
    scenario s;
  };
  for (const auto& sc : {named{"zero1", zero1()}, named{"tp2_dp2", tp2_dp2()}, named{"zero3", zero3()},
                          named{"pipeline two stages", pipeline_2x2(true)}, named{"pipeline one stage", pipeline_2x2(false)}})
    for (auto sharing : {dc::partition_sharing::none, dc::partition_sharing::exchange}) {
      CAPTURE(sc.name);
      CAPTURE(int(sharing));
      check_exact(run<collective_engine>(sc.s, {.sharing = sharing, .forks = 2}), 2);
    }
}

TEST_CASE("partition engine: a collective after the first update forks at the iteration in progress") {
  // The layer updated before the collective leaves at once; the others after their updates.
  check_exact(run<collective_engine>(tp2_dp2(), {.at = collective_at::after_first_update, .forks = 3}), 3);
}

TEST_CASE("partition engine: agreement::coordinator forks fork_lead iterations ahead") {
  coordinator_engine::settings set;
  set.fork_lead = 2;
  check_exact(run<coordinator_engine>(zero1(), {.at = collective_at::none, .forks = 2}, set), 2);
  check_exact(run<coordinator_engine>(tp2_dp2(), {.sharing = dc::partition_sharing::exchange, .at = collective_at::none, .forks = 2}, set), 2);
}

namespace {

/// A replicated two-layer model on N=1 source and M=1 clone rank: the rules' tests.
scenario one_to_one() {
  scenario s{two_layer_model(), {}, {}};
  s.src.assign(1, dc::holdings::replicated(s.lay));
  s.dst.assign(1, dc::holdings::replicated(s.lay));
  return s;
}

/// Forks once with `own` as this clone rank's parts; the error's code if it fails.
template <class Engine>
std::optional<dc::errc> fork_once(dc::inproc::communicator& c, const dc::partition_job& job, const scenario& s, std::uint32_t j,
                                  std::vector<std::vector<std::byte>>& own, outcome& out, typename Engine::settings set = {}) {
  auto parts = spans<std::byte>(own);
  typename Engine::clone dst(c, job, parts, set);
  try {
    const auto k = dst.wait();
    out.ks[j].push_back(k), out.exact[j].push_back(exact(s, j, own, k));
    return std::nullopt;
  } catch (const dc::error& e) {
    out.errors.push_back(std::string("clone rank ") + std::to_string(j) + ": " + e.what());
    return e.kind();
  }
}

}  // namespace

TEST_CASE("partition engine: a clone rank that gives up fails its peers' fork cleanly; the next fork is exact") {
  // Clone rank 0 declares parts that do not fit its holdings: its receiver refuses them, it
  // tells the sources, they end the fork for every clone rank and train on.
  const auto s = tp2_dp2();
  std::mutex mu;
  std::vector<std::optional<dc::errc>> first(s.dst.size());
  const auto body = [&](dc::inproc::communicator& c, const dc::partition_job& job, std::uint32_t j, outcome& out) {
    auto own = own_tensors(s.lay, s.dst[j], false);
    auto bad = own;
    if (j == 0) bad[0].resize(bad[0].size() / 2);
    outcome mine{std::vector<std::vector<std::uint64_t>>(s.dst.size()), std::vector<std::vector<bool>>(s.dst.size()), {}, {}, {}};
    first[j] = fork_once<collective_engine>(c, job, s, j, bad, mine);
    const auto again = fork_once<collective_engine>(c, job, s, j, own, mine);
    std::lock_guard g(mu);
    out.ks[j] = mine.ks[j], out.exact[j] = mine.exact[j];
    if (again) out.errors.insert(out.errors.end(), mine.errors.begin(), mine.errors.end());
  };
  const auto o = run<collective_engine>(s, {}, {}, body);
  REQUIRE(first[0] == dc::errc::invalid_argument);
  for (const auto& e : o.errors) INFO(e);
  REQUIRE(o.errors.empty());
  for (std::size_t j = 0; j < o.ks.size(); ++j) {
    // A peer still receiving when the sources learnt of the give-up fails with `cancelled`;
    // one that had verified all its parts by then completed that fork, exactly.
    if (j > 0) CHECK((!first[j] || first[j] == dc::errc::cancelled));
    REQUIRE(o.ks[j].size() == (first[j] ? 1u : 2u));
    CHECK(o.ks[j].back() == o.ks[0].back());
    for (bool e : o.exact[j]) CHECK(e);
  }
  for (auto c : o.completed) CHECK(c == 1);
  for (auto f : o.failed) CHECK(f == 1);
}

TEST_CASE("partition engine: a clone rank that vanishes after its request costs the sources one timeout, not their training") {
  const auto s = zero1();
  collective_engine::settings set;
  set.timeout = 300ms;
  const auto body = [&](dc::inproc::communicator& c, const dc::partition_job& job, std::uint32_t j, outcome& out) {
    auto own = own_tensors(s.lay, s.dst[j], false);
    auto parts = spans<std::byte>(own);
    {
      collective_engine::clone gone(c, job, parts, set);
      gone.request();  // and never receives: the sources' fork fails after settings.timeout
    }
    std::this_thread::sleep_for(400ms);
    collective_engine::settings patient = set;
    patient.timeout = 20s;
    outcome mine{std::vector<std::vector<std::uint64_t>>(s.dst.size()), std::vector<std::vector<bool>>(s.dst.size()), {}, {}, {}};
    auto e = fork_once<collective_engine>(c, job, s, j, own, mine, patient);
    out.ks[j] = mine.ks[j], out.exact[j] = mine.exact[j];
    if (e) out.errors.insert(out.errors.end(), mine.errors.begin(), mine.errors.end());
  };
  const auto o = run<collective_engine>(s, {}, set, body);
  for (const auto& e : o.errors) INFO(e);
  REQUIRE(o.errors.empty());
  for (std::size_t j = 0; j < o.ks.size(); ++j) {
    REQUIRE(o.ks[j].size() == 1);
    CHECK(o.exact[j][0]);
  }
  for (auto c : o.completed) CHECK(c == 1);
  for (auto f : o.failed) CHECK(f >= 1);
}

TEST_CASE("partition engine: another global layout is refused naming the tensor; the sources train on") {
  const auto s = zero1();
  auto theirs = two_layer_model();
  dc::layout other;
  other.add_layer(theirs.layers()[0]);
  auto fc2 = theirs.layers()[1];
  fc2.tensors[0] = tensor("weight", {48, 65});
  other.add_layer(fc2);
  std::vector<std::string> why(s.dst.size());
  const auto body = [&](dc::inproc::communicator& c, const dc::partition_job&, std::uint32_t j, outcome&) {
    const std::vector<dc::holdings> want(s.dst.size(), dc::holdings::replicated(other));
    dc::partition_job mine(dc::roles::contiguous(int(s.src.size()), int(s.dst.size())), other, std::vector<dc::holdings>(s.src.size(), dc::holdings::replicated(other)), want);
    auto own = own_tensors(other, want[j], false);
    auto parts = spans<std::byte>(own);
    collective_engine::clone dst(c, mine, parts);
    try {
      dst.wait();
    } catch (const dc::error& e) {
      if (e.kind() == dc::errc::layout_mismatch) why[j] = e.what();
    }
  };
  const auto o = run<collective_engine>(s, {}, {}, body);
  REQUIRE(o.errors.empty());
  for (const auto& w : why) {
    INFO(w);
    CHECK(w.find("fc2") != std::string::npos);
    CHECK(w.find("weight") != std::string::npos);
  }
  CHECK(o.failed[0] >= 1);  // the coordinator counts the refused request
}

TEST_CASE("partition engine: the hooks' rules, and bounded waits") {
  const auto s = one_to_one();
  const dc::partition_job job(dc::roles::contiguous(1, 1), s.lay, s.src, s.dst);
  dc::inproc::world w(2);
  auto c0 = w.comm(0), c1 = w.comm(1);
  trainer me(s, 0);
  auto own = own_tensors(s.lay, s.dst[0], false);
  auto parts = spans<std::byte>(own);

  SUBCASE("steps increase by one; nothing between before_update and after_update") {
    collective_engine::source src(c0, job, me.parts());
    src.end_iteration(3);
    CHECK_THROWS_WITH_AS(src.end_iteration(5), doctest::Contains("steps must increase by one"), dc::error);
    src.before_update(1);
    CHECK_THROWS_WITH_AS(src.fork_word(), doctest::Contains("between before_update and after_update"), dc::error);
    src.after_update(1);
    CHECK_THROWS_WITH_AS(src.after_update(7), doctest::Contains("the global layout has 2 layers"), dc::error);
    CHECK_THROWS_AS(collective_engine::source(c1, job, me.parts()), dc::error);  // rank 1 is not a source
  }
  SUBCASE("a clone rank waits for the decision at most settings.timeout") {
    collective_engine::source src(c0, job, me.parts());  // never calls fork_word(): no decision
    collective_engine::settings set;
    set.timeout = 100ms;
    collective_engine::clone dst(c1, job, parts, set);
    CHECK_THROWS_WITH_AS(dst.wait(), doctest::Contains("no fork decision within settings.timeout"), dc::error);
  }
  SUBCASE("sources that finish answer a waiting clone rank at once") {
    collective_engine::source src(c0, job, me.parts());
    collective_engine::clone dst(c1, job, parts);
    dst.request();
    std::this_thread::sleep_for(10ms);
    src.finish();
    CHECK_THROWS_WITH_AS(dst.wait(), doctest::Contains("finished training"), dc::error);
  }
}
