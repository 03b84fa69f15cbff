// agreement::collective on the in-process transport: the fork decision rides on the
// sources' own per-iteration allreduce (one extra element of their "gradient" buffer), so
// every source starts the session in the same iteration, at the newest iteration whose
// layers are all untouched. Each clone rank must hold that iteration's state bit for bit,
// for each pipeline, with and without a layer written before the collective (batch-norm
// statistics in the forward pass), and the calls refuse misuse naming the rule.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>

#include <atomic>
#include <mutex>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "../support/replica.hpp"  // replica, small_settings

namespace dc = deepclone;
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
