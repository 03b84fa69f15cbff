// End-to-end clones on the in-process transport, split_even x every pipeline x
// reconstruction combination (the other shardings: test_clone_shardings.cpp), N in {1,2,3,4}
// sources and M in {1,2,3} clone ranks. The sources keep training (overwriting every tensor
// each iteration) while the clone is in flight; each clone rank must hold the state of the
// agreed iteration k bit for bit, optimizer slots and metadata included.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>

#include "../support/clone_run.hpp"  // clone_once, clone_all_sizes
#include "../support/replica.hpp"    // replica, small_settings
#include "clone_matrix.hpp"          // DEEPCLONE_PIPELINES

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <optional>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dc = deepclone;

namespace {

using dc::testing::replica;
using dc::testing::small_settings;
using dc::testing::clone_all_sizes;
using dc::testing::clone_once;

using comm = dc::inproc::communicator;

}  // namespace

TEST_CASE_TEMPLATE("clone equals the sources' state of iteration k (split_even)", E, DEEPCLONE_PIPELINES(dc::shard::split_even)) {
  clone_all_sizes<E>();
}

TEST_CASE("checksum::none still delivers the exact bytes") {
  clone_once<dc::engine<comm, dc::shard::split_even, dc::pipeline::window, dc::reconstruct::scatter_exchange, dc::checksum::none>>(3, 2, 0);
}

TEST_CASE("a source engine serves a second clone after the first one") {
  using E = dc::engine<comm>;
  const int n = 2, m = 1;
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world world(n + m);
  std::atomic<int> done{0};
  std::vector<std::uint64_t> ks;
  world.run([&](dc::inproc::communicator& c) {
    replica r;
    if (c.rank() < n) {
      E::source src(c, roles, r.state, small_settings::make<E::settings>());
      for (std::uint64_t step = 0; step < 1000; ++step) {
        r.iterate(&src, step);
        dc::barrier(c, roles.sources, 10);
        src.end_iteration(step);
        int d[2] = {done.load(), src.cloning() ? 1 : 0};  // agree, so that all sources stop together
        dc::allreduce_sum(c, roles.sources, std::span<int>(d, 2), 12);
        if (d[0] == 2 * n * n && d[1] == 0) break;
      }
      src.finish();
      CHECK(src.sessions_completed() == 2);
    } else {
      E::clone dst(c, roles, r.state, small_settings::make<E::settings>());
      std::vector<dc::progress> seen;
      dst.on_progress([&](const dc::progress& p) { seen.push_back(p); });
      for (int round = 0; round < 2; ++round) {
        seen.clear();
        dst.request();
        dst.wait();
        ks.push_back(*dst.fork_iteration());
        // The progress callback: each layer once, in the order they became ready, then the completion.
        const std::size_t L = r.state.describe().layer_count();
        REQUIRE(seen.size() == L + 1);
        std::vector<int> layers_seen(L, 0);
        for (std::size_t i = 0; i < L; ++i) {
          REQUIRE(seen[i].layer.has_value());
          ++layers_seen[*seen[i].layer];
          CHECK(seen[i].layers_ready == i + 1);
          CHECK(seen[i].iteration == ks.back());
          CHECK_FALSE(seen[i].complete);
          if (i) CHECK(seen[i].seconds >= seen[i - 1].seconds);
          if (i) CHECK(seen[i].bytes_ready > seen[i - 1].bytes_ready);
        }
        CHECK(std::all_of(layers_seen.begin(), layers_seen.end(), [](int x) { return x == 1; }));
        CHECK(seen.back().complete);
        CHECK_FALSE(seen.back().layer.has_value());
        CHECK(seen.back().bytes_ready == seen.back().bytes_total);
        CHECK(seen.back().bytes_total == r.state.describe().total_bytes());
        CHECK(seen.back().seconds == doctest::Approx(dst.report().readiness_s));
        replica want;
        want.become(ks.back());
        CHECK(r.bytes() == want.bytes());
        done += n;
      }
    }
  });
  REQUIRE(ks.size() == 2);
  CHECK(ks[1] > ks[0]);
}

namespace {
std::string printed_by(dc::progress_line& line, const std::vector<dc::progress>& events, std::FILE* f) {
  for (auto& p : events) line(p);
  std::fflush(f);
  std::rewind(f);
  std::string text;
  for (int ch; (ch = std::fgetc(f)) != EOF;) text += static_cast<char>(ch);
  return text;
}
dc::progress at(double s, std::size_t ready, bool complete = false) {
  dc::progress p;
  p.iteration = 7;
  p.layer = complete ? std::nullopt : std::optional<std::size_t>(ready - 1);
  p.layers_ready = ready;
  p.layer_count = 4;
  p.bytes_ready = ready * 1'000'000;
  p.bytes_total = 4'000'000;
  p.seconds = s;
  p.complete = complete;
  return p;
}
}  // namespace

TEST_CASE("progress_line: silent for a quick clone, one line per interval and the completion for a slow one") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  dc::progress_line quick("clone", f);
  CHECK(printed_by(quick, {at(0.1, 1), at(0.2, 2), at(0.3, 3), at(0.4, 4), at(0.5, 4, true)}, f).empty());
  std::fclose(f);

  f = std::tmpfile();
  REQUIRE(f);
  dc::progress_line slow("clone rank 0", f, 1.0, 0.5);
  auto text = printed_by(slow, {at(0.5, 1), at(1.2, 2), at(1.4, 3), at(1.8, 4), at(1.9, 4, true)}, f);
  std::fclose(f);
  CHECK(text ==
        "clone rank 0: iteration 7: 2/4 layers, 2.0 of 4.0 MB, 1.2 s\n"
        "clone rank 0: iteration 7: 4/4 layers, 4.0 of 4.0 MB, 1.8 s\n"
        "clone rank 0: iteration 7: 4/4 layers, 4.0 of 4.0 MB, 1.9 s, complete\n");
}

TEST_CASE("to_string(report): figures never measured read 'unmeasured', not nan") {
  dc::report r;
  r.sources.push_back({.rank = 0, .bytes_sent = 10, .hook_s = 0.5, .overhead_s = NAN, .normal_iteration_s = NAN,
                       .fork_iterations = 1, .failed = true});
  r.clones.push_back({.rank = 2, .bytes_from_sources = 10, .bytes_from_clones = 0, .readiness_s = NAN, .standby_s = 0.25,
                      .first_layer_s = 0});
  auto text = dc::to_string(r);
  CHECK(text.find("nan") == std::string::npos);
  CHECK(text.find("overhead unmeasured over 1 iteration(s) (normal iteration unmeasured) [failed]") != std::string::npos);
  CHECK(text.find("readiness unmeasured, standby 0.2500 s") != std::string::npos);
}
