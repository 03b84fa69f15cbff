// agreement::collective on the in-process transport: the fork decision rides on the
// sources' own per-iteration allreduce (one extra element of their "gradient" buffer), so
// every source starts the session in the same iteration, at the newest iteration whose
// layers are all untouched. Each clone rank must hold that iteration's state bit for bit,
// for each pipeline, with and without a layer written before the collective (batch-norm
// statistics in the forward pass), and the calls refuse misuse naming the rule.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>
#include <deepclone/fault_injection.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../support/policies.hpp"  // on_period, the broken agreements
#include "../support/replica.hpp"   // replica, small_settings

namespace dc = deepclone;
using namespace std::chrono_literals;
using dc::testing::replica;
using dc::testing::small_settings;

namespace {

using comm = dc::inproc::communicator;
template <class Pipeline, class Reconstruct>
using collective_engine = dc::engine<comm, dc::shard::split_even, Pipeline, Reconstruct, dc::checksum::mix64, dc::agreement::collective>;

constexpr std::size_t norm_layer = 2;  // replica's "norm" layer: its statistics are written in the forward pass

struct outcome {
  std::vector<std::uint64_t> k;                 // per clone rank
  std::vector<std::vector<std::byte>> bytes;    // per clone rank, at the fork
  std::vector<dc::metadata> meta;
  std::optional<std::uint64_t> forked_in;       // source 0: the iteration whose collective started the session
  std::uint64_t sessions_completed = 0;
  std::uint64_t spilled = 0, share = 0;         // source 0: bytes_spilled() and its share of the state
  std::string policies;
};

/// One iteration of a data-parallel source: the forward pass (which, with `norm_in_forward`,
/// updates the norm layer between its hooks), the gradient allreduce carrying the fork
/// word, then the updates in backward order and end_iteration. Returns the allreduced
/// "stop" count the sources use to end together.
template <class Source>
int source_iteration(replica& r, Source& src, comm& c, const dc::roles& roles, std::uint64_t step, bool norm_in_forward,
                     int clones_done, std::optional<std::uint64_t>& forked_in) {
  if (norm_in_forward) {
    src.before_update(norm_layer);
    r.update(norm_layer, step);
    src.after_update(norm_layer);
  }
  double grads[3] = {1.0, static_cast<double>(src.fork_word()), static_cast<double>(clones_done)};
  dc::allreduce_sum(c, roles.sources, std::span<double>(grads, 3), 10);
  const bool was_cloning = src.cloning();
  src.fork_agreed(static_cast<std::uint64_t>(grads[1]));
  if (!was_cloning && src.cloning() && !forked_in) forked_in = step;
  for (std::size_t l = r.state.layer_count(); l-- > 0;) {
    if ((l == 3 && step > 2) || (l == norm_layer && norm_in_forward)) continue;
    src.before_update(l);
    r.update(l, step);
    src.after_update(l);
  }
  r.iterate_metadata(step);
  src.end_iteration(step);
  return static_cast<int>(grads[2]);
}

template <class Engine>
outcome fork_with_collective(int n, int m, bool norm_in_forward) {
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world world(n + m);
  std::atomic<int> clones_done{0};
  std::mutex mu;
  outcome o;
  o.k.resize(static_cast<std::size_t>(m));
  o.bytes.resize(static_cast<std::size_t>(m));
  o.meta.resize(static_cast<std::size_t>(m));
  world.run([&](comm& c) {
    replica r;
    if (c.rank() < n) {
      typename Engine::template source<dc::raw_view<std::uint8_t>> src(c, roles, r.state, small_settings::make<typename Engine::settings>());
      int after = 0;
      for (std::uint64_t step = 0; step < 2000 && after < 3; ++step) {
        std::optional<std::uint64_t> forked_in;
        if (source_iteration(r, src, c, roles, step, norm_in_forward, clones_done.load(), forked_in) == n * m) ++after;
        if (c.rank() == 0 && forked_in) o.forked_in = forked_in;
      }
      src.finish();
      if (c.rank() == 0) o.sessions_completed = src.sessions_completed(), o.spilled = src.bytes_spilled(), o.share = src.plan().bytes_of_source(0);
      CHECK_MESSAGE(src.sessions_completed() == 1, "source " << c.rank() << ": " << (src.last_error() ? src.last_error()->what : "no session"));
    } else {
      typename Engine::template clone<dc::raw_view<std::uint8_t>> dst(c, roles, r.state, small_settings::make<typename Engine::settings>());
      dst.request();
      dst.wait();
      auto rep = dst.report();
      const auto j = static_cast<std::size_t>(c.rank() - n);
      std::lock_guard g(mu);
      o.k[j] = *dst.fork_iteration();
      o.bytes[j] = r.bytes();
      o.meta[j] = dst.metadata();
      o.policies = rep.policies;
      ++clones_done;
    }
  });
  return o;
}

template <class Engine>
void check_collective_fork(bool norm_in_forward) {
  for (auto [n, m] : {std::pair{1, 1}, std::pair{3, 2}, std::pair{4, 3}}) {
    CAPTURE(n);
    CAPTURE(m);
    CAPTURE(norm_in_forward);
    auto o = fork_with_collective<Engine>(n, m, norm_in_forward);
    REQUIRE(o.forked_in.has_value());
    // k is the newest untouched iteration when the collective of iteration `forked_in` ran:
    // the one that had just ended, or (a layer already written in the forward pass) this one.
    const std::uint64_t k = norm_in_forward ? *o.forked_in : *o.forked_in - 1;
    CHECK(o.policies.find("/collective") != std::string::npos);
    // spill at a fork of an ended k: nothing has left yet and the next hooks overwrite the
    // layers, so the whole share is copied at the fork (design.md, spill).
    if constexpr (std::is_same_v<typename Engine::pipeline_type, dc::pipeline::spill>)
      if (!norm_in_forward) CHECK(o.spilled == o.share);
    for (std::size_t j = 0; j < o.k.size(); ++j) {
      CAPTURE(j);
      CHECK(o.k[j] == k);
      replica want;
      want.become(o.k[j]);
      want.state.metadata().step = o.k[j];
      CHECK(o.bytes[j] == want.bytes());
      CHECK(o.meta[j] == want.state.metadata());
    }
  }
}


// ---------------------------------------------------------------------------------------
// A fork through deepclone::faulty<>, for the agreement's failure cases: N sources train
// `replica` (the updates of clone_run.hpp), coupled by an allreduce over the sources that
// carries the fork word under agreement::collective; M clone bodies. The allreduce uses the
// raw communicator, so faults hit deepclone's messages only.

using fcomm = dc::faulty<comm>;
template <class Agreement, class Pipeline = dc::pipeline::window>
using faulty_engine = dc::engine<fcomm, dc::shard::split_even, Pipeline, dc::reconstruct::scatter_exchange,
                                 dc::checksum::mix64, Agreement>;
constexpr int tb = 1000;  // settings.tag_base

/// One iteration of one source, as the world saw it (agreement::collective only).
struct step_log {
  std::uint64_t word = 0, sum = 0;
  bool busy_before = false;  // cloning() when the collective ran
  bool started = false;      // fork_agreed() started a session
  double agreed_s = 0;       // time spent in fork_agreed()
};

struct world_result {
  std::vector<std::vector<step_log>> steps;  // per source, per iteration
  std::vector<std::uint64_t> completed, failed;
  std::vector<std::optional<dc::failure>> last_error;
  std::vector<std::string> clones;  // per clone rank: "" when it saw what it should
  bool deadline_hit = false;
};

template <class Engine>
struct world_options {
  using settings_t = typename Engine::settings;
  int n = 2, m = 1;
  settings_t settings = small_settings::make<settings_t>();
  std::shared_ptr<dc::fault::plan> faults = std::make_shared<dc::fault::plan>();
  bool source1_ahead = false;  // source 1 ends every iteration before source 0 does
  std::function<void(int i, std::uint64_t step, replica&)> before_collective;  // the trainer's code after end_iteration(step - 1)
  using clone_t = typename Engine::template clone<dc::raw_view<std::uint8_t>>;
  std::function<std::string(clone_t&, replica&)> clone_body;
  std::optional<settings_t> clone_settings;  // the clone ranks' settings, when not `settings`
};

/// "" when the clone holds iteration k (its fork iteration) bit for bit, metadata included.
std::string holds_fork_state(std::uint64_t k, const dc::metadata& meta, replica& r) {
  replica want;
  want.become(k);
  want.state.metadata().step = k;
  if (r.bytes() != want.bytes()) return "the clone's bytes are not those of iteration " + std::to_string(k);
  if (!(meta == want.state.metadata())) return "the clone's metadata is not that of iteration " + std::to_string(k);
  return "";
}
/// A clone body: request, wait, and check the bytes.
template <class Clone>
std::string clone_once(Clone& dst, replica& r) {
  try {
    dst.request();
    dst.wait();
  } catch (const dc::error& e) {
    return std::string("clone failed: ") + e.what();
  }
  return holds_fork_state(*dst.fork_iteration(), dst.metadata(), r);
}

template <class Engine>
step_log source_step(const world_options<Engine>& o, typename Engine::template source<dc::raw_view<std::uint8_t>>& src, comm& raw,
                     const dc::roles& roles, replica& r, std::uint64_t step, double (&g)[3]) {
  step_log s;
  if constexpr (Engine::agreement_type::trainer_collective) s.word = src.fork_word();
  g[0] = static_cast<double>(s.word);
  dc::allreduce_sum(raw, roles.sources, std::span<double>(g, 3), 10);
  if constexpr (Engine::agreement_type::trainer_collective) {
    s.sum = static_cast<std::uint64_t>(g[0]);
    s.busy_before = src.cloning();
    const auto t0 = std::chrono::steady_clock::now();
    src.fork_agreed(s.sum);
    s.agreed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    s.started = !s.busy_before && src.cloning();
  }
  r.iterate(&src, step);
  if (o.source1_ahead && raw.rank() == 1) src.end_iteration(step);
  if (o.source1_ahead) dc::barrier(raw, roles.sources, 20);
  if (!o.source1_ahead || raw.rank() != 1) src.end_iteration(step);
  return s;
}

template <class Engine>
world_result run_world(const world_options<Engine>& o) {
  world_result out;
  out.steps.resize(o.n);
  out.completed.resize(o.n);
  out.failed.resize(o.n);
  out.last_error.resize(o.n);
  out.clones.resize(o.m);
  const auto roles = dc::roles::contiguous(o.n, o.m);
  std::atomic<int> clones_done{0};
  const auto deadline = std::chrono::steady_clock::now() + 90s;
  dc::inproc::world world(o.n + o.m);
  world.run([&](comm& raw) {
    fcomm c(raw, o.faults);
    replica r;
    if (raw.rank() >= o.n) {
      typename world_options<Engine>::clone_t dst(c, roles, r.state, o.clone_settings.value_or(o.settings));
      out.clones[raw.rank() - o.n] = o.clone_body(dst, r);
      ++clones_done;
      return;
    }
    typename Engine::template source<dc::raw_view<std::uint8_t>> src(c, roles, r.state, o.settings);
    for (std::uint64_t step = 0, after = 0; after < 3; ++step) {
      if (o.before_collective) o.before_collective(raw.rank(), step, r);
      double g[3] = {0, static_cast<double>(clones_done.load()), std::chrono::steady_clock::now() > deadline ? 1.0 : 0.0};
      out.steps[raw.rank()].push_back(source_step(o, src, raw, roles, r, step, g));
      if (g[2] > 0) {
        out.deadline_hit = true;
        break;
      }
      if (g[1] == o.n * o.m) ++after;
    }
    src.finish();
    out.completed[raw.rank()] = src.sessions_completed();
    out.failed[raw.rank()] = src.sessions_failed();
    out.last_error[raw.rank()] = src.last_error();
  });
  return out;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE_TEMPLATE("agreement::collective: every clone rank holds iteration k bit for bit, k the newest untouched iteration", E,
                   collective_engine<dc::pipeline::window, dc::reconstruct::scatter_exchange>,
                   collective_engine<dc::pipeline::staged, dc::reconstruct::direct>,
                   collective_engine<dc::pipeline::blocking, dc::reconstruct::scatter_exchange>,
                   collective_engine<dc::pipeline::spill, dc::reconstruct::scatter_exchange>) {
  SUBCASE("collective before the updates, nothing written yet: k is the iteration that ended") { check_collective_fork<E>(false); }
  SUBCASE("a layer written in the forward pass: k is the iteration in progress") { check_collective_fork<E>(true); }
}

TEST_CASE("agreement::collective: misuse is refused naming the rule") {
  using E = collective_engine<dc::pipeline::window, dc::reconstruct::scatter_exchange>;
  const auto roles = dc::roles::contiguous(1, 1);
  dc::inproc::world world(2);
  world.run([&](comm& c) {
    if (c.rank() != 0) return;
    replica r;
    E::source src(c, roles, r.state);
    auto code_and_what = [](auto&& f) -> std::pair<std::optional<dc::errc>, std::string> {
      try {
        f();
      } catch (const dc::error& e) {
        return {e.kind(), e.what()};
      }
      return {std::nullopt, ""};
    };
    src.before_update(0);
    auto [inside, what_inside] = code_and_what([&] { (void)src.fork_word(); });
    CHECK(inside == dc::errc::hook_order);
    CHECK(what_inside.find("outside a layer's before_update/after_update") != std::string::npos);
    src.after_update(0);
    CHECK(src.fork_word() == 0);  // no clone asked
    auto [sum, what_sum] = code_and_what([&] { src.fork_agreed(1); });  // source 0 gave 0: the sum cannot be odd
    CHECK(sum == dc::errc::invalid_argument);
    CHECK(what_sum.find("pass the sum of every source's fork_word()") != std::string::npos);
    CHECK(src.fork_word() == 0);
    src.fork_agreed(0);
    CHECK_FALSE(src.cloning());
  });
}

// design.md, Fork agreement, coordinator: "If a source does learn it too late, it says so
// to the clone, which fails with errc::fork_agreement naming the source and the
// iterations; the sources keep training." Source 1 ends every iteration before source 0, so
// with fork_lead = 1 it learns the decision of source 0's end_iteration(j) only at its own
// end_iteration(j + 1) = k, every time. What the code does (the claim is only partly true):
// source 1 refuses with errc::fork_agreement in its last_error and tells the clone, but the
// clone treats that as a failed source and gets source 1's groups from source 0 (failover),
// so it completes bit for bit, source 1 marked failed in its report; it never sees
// errc::fork_agreement (clone_transfer::source_failed turns every code but layout_mismatch
// and outside_hooks into source_failed). With fork_lead = 2 the same skew is served.
TEST_CASE("agreement::coordinator: a source that learns the decision too late refuses it naming itself; fork_lead 2 serves") {
  using E = faulty_engine<dc::agreement::coordinator>;
  world_options<E> o;
  o.source1_ahead = true;
  o.settings.fork_lead = 1;
  o.clone_body = [](auto& dst, replica& r) {
    auto bad = clone_once(dst, r);
    return bad.empty() && !dst.report().sources.at(1).failed ? "source 1 not reported failed" : bad;
  };
  auto late = run_world(o);
  CHECK_FALSE(late.deadline_hit);  // the sources trained on to the end
  CHECK(late.clones[0] == "");
  CHECK(late.completed == std::vector<std::uint64_t>{1, 0});
  CHECK(late.failed == std::vector<std::uint64_t>{0, 1});
  REQUIRE(late.last_error[1]);
  CHECK(late.last_error[1]->code == dc::errc::fork_agreement);
  INFO(late.last_error[1]->what);
  CHECK(contains(late.last_error[1]->what, "source 1 (rank 1) received the decision to fork at iteration"));
  CHECK(contains(late.last_error[1]->what, "only at the end of iteration"));
  CHECK(contains(late.last_error[1]->what, "raise settings.fork_lead"));

  o.settings.fork_lead = 2;
  o.clone_body = [](auto& dst, replica& r) { return clone_once(dst, r); };
  auto served = run_world(o);
  CHECK_FALSE(served.deadline_hit);
  CHECK(served.clones[0] == "");
  CHECK(served.completed == std::vector<std::uint64_t>{1, 1});
  CHECK(served.failed == std::vector<std::uint64_t>{0, 0});
}

// design.md, agreement::collective: "every source adds 2 while it still serves an earlier
// clone, so the sources fork exactly when the sum is 1 - all of them in the same
// iteration". Every acknowledgement of the first session to source 1 is lost, so source 1
// serves it until settings.timeout (3 s) while the clone, complete, asks again at once:
// the coordinator is ready (1) while source 1 is busy (2). spill, so that the lost
// acknowledgements do not hold source 1 in before_update: it trains on, busy.
TEST_CASE("agreement::collective: a source still serving a clone adds 2; the next session starts only at a sum of 1") {
  using E = faulty_engine<dc::agreement::collective, dc::pipeline::spill>;
  world_options<E> o;
  o.settings.timeout = 3s;
  // The second request waits for source 1's 3 s timeout: the clone rank's own must be
  // longer, or the two race (seen failing once under load with both at 3 s).
  o.clone_settings = o.settings;
  o.clone_settings->timeout = 20s;
  o.faults->add({.action = dc::fault::kind::drop, .from = 2, .to = 1, .tag_lo = tb + 8, .times = 0});  // acks to source 1
  o.clone_body = [faults = o.faults](auto& dst, replica& r) {
    auto bad = clone_once(dst, r);
    faults->clear();  // the second session runs without faults
    return bad.empty() ? clone_once(dst, r) : "first clone: " + bad;
  };
  auto w = run_world(o);
  CHECK_FALSE(w.deadline_hit);
  CHECK(w.clones[0] == "");  // both clones bit for bit
  CHECK(w.completed == std::vector<std::uint64_t>{2, 1});
  CHECK(w.failed == std::vector<std::uint64_t>{0, 1});  // source 1's first session, by its timeout
  int coordinator_ready_while_source1_busy = 0, started = 0;
  for (std::size_t j = 0; j < std::min(w.steps[0].size(), w.steps[1].size()); ++j) {
    CAPTURE(j);
    const auto &a = w.steps[0][j], &b = w.steps[1][j];
    CHECK(a.sum == a.word + b.word);
    CHECK((a.word >= 2) == a.busy_before);  // +2 exactly while serving
    CHECK(b.word == (b.busy_before ? 2u : 0u));
    CHECK(a.started == b.started);     // both sources fork in the same iteration...
    if (a.started) CHECK(a.sum == 1);  // ...and only when the sum is 1
    started += a.started;
    if (a.word == 1 && b.word == 2) ++coordinator_ready_while_source1_busy;
  }
  CHECK(started == 2);
  CHECK(coordinator_ready_while_source1_busy > 0);  // the case under test happened
}

// design.md, agreement::collective: the other sources wait for the coordinator's decision
// "in fork_agreed (at most failover_after ...)". The decision to source 1 is dropped: it
// gives up after failover_after, says so in last_error (errc::timeout) and trains on; the
// clone presumes it failed (nothing arrives from it) and gets its groups from source 0.
TEST_CASE("agreement::collective: a source whose decision never comes waits at most failover_after; the clone fails over") {
  using E = faulty_engine<dc::agreement::collective>;
  world_options<E> o;
  o.settings.failover_after = 1s;  // settings.timeout stays 30 s
  o.faults->add({.action = dc::fault::kind::drop, .from = 0, .to = 1, .tag_lo = tb + 1, .times = 0});
  o.clone_body = [](auto& dst, replica& r) { return clone_once(dst, r); };
  auto w = run_world(o);
  CHECK_FALSE(w.deadline_hit);
  CHECK(w.clones[0] == "");
  CHECK(w.completed == std::vector<std::uint64_t>{1, 0});
  CHECK(w.failed == std::vector<std::uint64_t>{0, 1});
  REQUIRE(w.last_error[1]);
  CHECK(w.last_error[1]->code == dc::errc::timeout);
  CHECK(contains(w.last_error[1]->what, "the coordinator's decision did not arrive within settings.failover_after"));
  double waited = 0;
  for (auto& s : w.steps[1]) waited = std::max(waited, s.agreed_s);
  CHECK(waited >= 0.9);  // it did wait for the decision...
  CHECK(waited < 10);    // ...for failover_after (1 s), far from settings.timeout (30 s)
}

// design.md, agreement::collective: "The metadata of an ended k is the copy the
// coordinator takes at every end_iteration ... since the trainer may change it before the
// collective." Here the trainer moves its data cursor and learning rate after every
// end_iteration(j), before the collective; k is the iteration that ended (nothing is
// written before the collective), and the clone must get k's metadata as it was at
// end_iteration(k) (holds_fork_state compares it with replica::iterate_metadata(k)).
TEST_CASE("agreement::collective: the metadata of an ended k is the copy of end_iteration(k), not the trainer's later changes") {
  using E = faulty_engine<dc::agreement::collective>;
  world_options<E> o;
  o.before_collective = [](int, std::uint64_t, replica& r) {
    r.state.metadata().data_cursor += 1000000;
    r.state.metadata().hyper["lr"] = -1.0;
  };
  o.clone_body = [](auto& dst, replica& r) { return clone_once(dst, r); };
  auto w = run_world(o);
  CHECK_FALSE(w.deadline_hit);
  CHECK(w.clones[0] == "");
  CHECK(w.completed == std::vector<std::uint64_t>{1, 1});
}

// agreement.hpp: an agreement policy a user writes decides when to fork through
// agreement::context; the engine does the messaging. tests/support/policies.hpp's on_period
// forks only at multiples of 5 iterations, with source 1 ending every iteration first (the
// skew fork_lead 2 covers): every clone rank holds that iteration bit for bit.
TEST_CASE("agreement: a user-written policy (fork at multiples of a period) forks where it says, bit for bit") {
  using E = faulty_engine<dc::testing::on_period>;
  world_options<E> o;
  o.source1_ahead = true;
  o.m = 2;
  o.clone_body = [](auto& dst, replica& r) {
    auto bad = clone_once(dst, r);
    if (bad.empty() && *dst.fork_iteration() % 5 != 0) return "forked at iteration " + std::to_string(*dst.fork_iteration());
    return bad;
  };
  auto w = run_world(o);
  CHECK_FALSE(w.deadline_hit);
  CHECK(w.clones == std::vector<std::string>{"", ""});
  CHECK(w.completed == std::vector<std::uint64_t>{1, 1});
  CHECK(w.failed == std::vector<std::uint64_t>{0, 0});
}

/// The error end_iteration throws on source `i` with agreement `A` while a clone rank
/// requests (N = 2, M = 1), or "" if none; the clone gives up after 2 s.
template <class A>
std::string broken_agreement_error(int i) {
  using E = faulty_engine<A>;
  const auto roles = dc::roles::contiguous(2, 1);
  std::string what;
  std::atomic<bool> clone_done{false};
  dc::inproc::world world(3);
  world.run([&](comm& raw) {
    fcomm c(raw, std::make_shared<dc::fault::plan>());
    replica r;
    auto s = small_settings::make<typename E::settings>();
    s.timeout = 2s;
    if (raw.rank() == 2) {
      typename E::template clone<dc::raw_view<std::uint8_t>> dst(c, roles, r.state, s);
      try {
        dst.request();
        dst.wait();
      } catch (const dc::error&) {
      }
      clone_done = true;
      return;
    }
    typename E::template source<dc::raw_view<std::uint8_t>> src(c, roles, r.state, s);
    for (std::uint64_t step = 0; !clone_done; ++step) {
      r.iterate(&src, step);
      try {
        src.end_iteration(step);
      } catch (const dc::error& e) {
        if (raw.rank() == i && what.empty()) what = std::string(dc::errc_name(e.kind())) + ": " + e.what();
        if (raw.rank() == i) break;  // a trainer would stop here; the other source trains on
      }
      std::this_thread::sleep_for(1ms);
    }
  });
  return what;
}

TEST_CASE("agreement: a user-written policy that breaks a rule of agreement::context is refused naming the rule") {
  auto past = broken_agreement_error<dc::testing::fork_in_the_past>(0);
  INFO(past);
  CHECK(contains(past, "invalid_argument"));
  CHECK(contains(past, "agreement policy 'fork_in_the_past' on source 0 broke a rule"));
  CHECK(contains(past, "k must lie after the last ended iteration"));
  auto everyone = broken_agreement_error<dc::testing::everyone_decides>(1);
  INFO(everyone);
  CHECK(contains(everyone, "agreement policy 'everyone_decides' on source 1 broke a rule: requests_accepted() on source 1: "
                           "only the coordinator (source 0) decides"));
  auto unasked = broken_agreement_error<dc::testing::decides_unasked>(0);
  INFO(unasked);
  CHECK(contains(unasked, "without every clone rank's request"));
  auto at_end = broken_agreement_error<dc::testing::untouched_at_end>(0);
  INFO(at_end);
  CHECK(contains(at_end, "fork_untouched() outside a trainer collective"));
}
