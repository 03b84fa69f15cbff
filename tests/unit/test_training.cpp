// A real data-parallel trainer (examples/mlp.hpp) forked by deepclone: the sources' own
// training is bitwise unaffected by a clone, the clone starts from exactly the state of
// iteration k (momentum slots and metadata included), and afterwards it trains on as its
// learning rate says.
#include <doctest/doctest.h>

#include <cstring>
#include <string>

#include "fork_harness.hpp"

namespace {

using comm_t = deepclone::inproc::communicator;
namespace sh = deepclone::shard;
namespace pl = deepclone::pipeline;
namespace rc = deepclone::reconstruct;

/// Smaller than the demo's model so the whole file runs in a few seconds, still with
/// layers of 0.5k to 16k parameters and tensors large enough to be split.
mlp::config small_model() {
  mlp::config c;
  c.widths = {32, 128, 128, 64, 8};
  c.global_batch = 24;
  c.seed = 7;
  c.lr = 0.05;
  c.momentum = 0.9;
  return c;
}

/// Low thresholds so that tensors really are split over sources and clone ranks, and a
/// staging ring smaller than the state so that it wraps.
template <class Engine>
typename Engine::settings small_settings() {
  typename Engine::settings s;
  if constexpr (requires { s.shard.threshold; }) s.shard.threshold = 16 << 10;
  if constexpr (requires { s.reconstruct.threshold; }) s.reconstruct.threshold = 16 << 10;
  if constexpr (requires { s.pipeline.staging_bytes; }) s.pipeline.staging_bytes = 16 << 10;
  return s;
}

mlp::fork_options small_run(std::uint32_t n, std::uint32_t m, double clone_lr) {
  mlp::fork_options o;
  o.cfg = small_model();
  o.sources = n;
  o.clones = m;
  o.fork_at = 3;  // requests seen at the end of step 4: k = 4 + fork_lead = 6
  o.steps = 16;
  o.clone_lr = clone_lr;
  return o;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

template <class Engine>
void check_clone_at_fork(const mlp::fork_options& o, const mlp::fork_result& r) {
  const auto st = small_settings<Engine>();
  CHECK(r.k == o.fork_at + 1 + st.fork_lead);
  // The harness's snapshot is the state of iteration k: equal to a reference run that
  // simply stops after iteration k.
  auto ref = mlp::run_plain(o.cfg, o.sources, r.k + 1);
  CHECK(mlp::first_difference(r.source_at_fork, ref.final_state[0], r.names) == "");
  CHECK(r.source_at_fork.meta.step == r.k);
  CHECK(r.source_at_fork.meta.data_cursor == (r.k + 1) * o.cfg.global_batch);
  // ... and the sources went on overwriting their tensors after k.
  CHECK(mlp::first_difference(r.source_final[0], r.source_at_fork) != "");
  // Momentum slots are live state, not zeros that would compare equal by accident.
  bool momentum_nonzero = false;
  for (float x : r.source_at_fork.tensors[2]) momentum_nonzero |= x != 0.0f;
  CHECK(momentum_nonzero);
  REQUIRE(r.clone_at_fork.size() == o.clones);
  for (std::uint32_t j = 0; j < o.clones; ++j) {
    INFO("clone rank index " << j);
    // Clone tensors started as NaN: every byte was written by deepclone, with the sources'
    // values of iteration k. Weights, biases, both momentum slots, step, cursor, RNG, hypers.
    CHECK(mlp::first_difference(r.clone_at_fork[j], r.source_at_fork, r.names) == "");
    CHECK(r.clone_at_fork[j].meta == r.source_at_fork.meta);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("training: the sources' own training is bitwise unaffected by a clone", P, pl::window, pl::staged,
                   pl::blocking) {
  using engine = deepclone::engine<comm_t, sh::split_even, P, rc::scatter_exchange>;
  const auto o = small_run(3, 2, 0.02);
  const auto plain = mlp::run_plain(o.cfg, o.sources, o.steps);
  const auto forked = mlp::run_fork<engine>(o, small_settings<engine>());
  CHECK(forked.report.iteration == forked.k);
  for (std::uint32_t i = 0; i < o.sources; ++i) {
    INFO("source " << i);
    CHECK(mlp::first_difference(forked.source_final[i], plain.final_state[i], forked.names) == "");
  }
  for (std::uint64_t s = 0; s < o.steps; ++s) {
    INFO("step " << s);
    CHECK(same_bits(forked.source_loss[s], plain.loss[s]));
  }
  check_clone_at_fork<engine>(o, forked);
}

TEST_CASE_TEMPLATE("training: the clone holds the sources' state of iteration k bit for bit", E,
                   deepclone::engine<comm_t, sh::whole_tensor, pl::window, rc::direct>,
                   deepclone::engine<comm_t, sh::layer_round_robin, pl::staged, rc::scatter_exchange>,
                   deepclone::engine<comm_t, sh::single_root, pl::blocking, rc::direct>) {
  for (auto [n, m] : {std::pair<std::uint32_t, std::uint32_t>{1, 2}, {2, 3}, {4, 1}}) {
    CAPTURE(n);
    CAPTURE(m);
    const auto o = small_run(n, m, 0.01);
    const auto r = mlp::run_fork<E>(o, small_settings<E>());
    check_clone_at_fork<E>(o, r);
  }
}

TEST_CASE("training: the clone trains on and diverges as its learning rate says") {
  using engine = deepclone::engine<comm_t>;

  SUBCASE("same learning rate and M == N: the clone's iterations are the sources' exactly") {
    const auto o = small_run(3, 3, small_model().lr);
    const auto r = mlp::run_fork<engine>(o, small_settings<engine>());
    check_clone_at_fork<engine>(o, r);
    for (std::uint64_t s = r.k + 1; s < o.steps; ++s) {
      INFO("step " << s);
      REQUIRE(r.clone_loss[s].has_value());
      CHECK(same_bits(*r.clone_loss[s], r.source_loss[s]));
    }
    for (std::uint32_t j = 0; j < o.clones; ++j) {
      INFO("clone rank index " << j);
      CHECK(mlp::first_difference(r.clone_final[j], r.source_final[j], r.names) == "");
    }
  }

  SUBCASE("another learning rate: the clone's weights differ, and both losses decrease") {
    const double clone_lr = 0.02;
    const auto o = small_run(3, 2, clone_lr);
    const auto r = mlp::run_fork<engine>(o, small_settings<engine>());
    check_clone_at_fork<engine>(o, r);
    CHECK(r.clone_final[0].meta.hyper.at("lr") == clone_lr);
    CHECK(r.source_final[0].meta.hyper.at("lr") == o.cfg.lr);
    CHECK(r.clone_final[0].meta.step == r.source_final[0].meta.step);
    for (std::size_t t = 0; t < r.names.size(); ++t) {
      INFO(r.names[t]);
      CHECK(std::memcmp(r.clone_final[0].tensors[t].data(), r.source_final[0].tensors[t].data(),
                        r.clone_final[0].tensors[t].size() * sizeof(float)) != 0);
    }
    // Every clone rank of the group holds the same replica.
    for (std::uint32_t j = 1; j < o.clones; ++j) CHECK(mlp::first_difference(r.clone_final[j], r.clone_final[0]) == "");
    // Losses: the sources' from the first step, the clone's from its first iteration k + 1.
    CHECK(r.source_loss.back() < 0.8 * r.source_loss.front());
    REQUIRE(r.clone_loss[r.k + 1].has_value());
    CHECK(*r.clone_loss.back() < 0.8 * *r.clone_loss[r.k + 1]);
    // Its first iteration starts from the sources' state, so it sees the sources' loss...
    CHECK(*r.clone_loss[r.k + 1] == doctest::Approx(r.source_loss[r.k + 1]).epsilon(1e-5));
    // ...and then goes its own way.
    CHECK(!same_bits(*r.clone_loss.back(), r.source_loss.back()));
  }
}
