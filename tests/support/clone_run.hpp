#pragma once
// One end-to-end clone on the in-process transport, checked bit for bit: N sources train
// (overwriting every tensor each iteration) while M clone ranks fork from them; each clone
// rank must hold the state of the agreed iteration k, optimizer slots and metadata
// included, and the report's byte counts must add up. Used by unit.clone (split_even with
// every built-in pipeline and reconstruction) and unit.policies (user-written policies).
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "replica.hpp"

namespace deepclone::testing {

template <class Engine>
void clone_once(int n, int m, unsigned delay_ms) {
  using settings = typename Engine::settings;
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world world(n + m);
  std::atomic<int> clones_done{0};
  std::mutex mu;
  std::vector<std::vector<std::byte>> got(static_cast<std::size_t>(m));
  std::vector<dc::metadata> meta(static_cast<std::size_t>(m));
  std::vector<std::uint64_t> k(static_cast<std::size_t>(m));
  std::vector<dc::report> reports(static_cast<std::size_t>(m));
  world.run([&](dc::inproc::communicator& comm) {
    replica r;
    if (comm.rank() < n) {
      typename Engine::template source<dc::raw_view<std::uint8_t>> src(comm, roles, r.state, small_settings::make<settings>());
      // Train until every source has seen every clone rank done (and three iterations more),
      // however slow the build (TSan, valgrind): a fixed step count raced slow clones. The
      // wall-clock cap only bounds a broken engine; the sources agree on it so they stop together.
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      int after = 0;
      for (std::uint64_t step = 0; after < 3; ++step) {
        r.iterate(&src, step);
        dc::barrier(comm, roles.sources, 10);  // the sources' gradient allreduce
        src.end_iteration(step);
        int seen[2] = {clones_done.load(), std::chrono::steady_clock::now() > give_up ? 1 : 0};
        dc::allreduce_sum(comm, roles.sources, std::span<int>(seen), 12);  // all stop together
        if (seen[1] > 0) break;
        if (seen[0] == m * n) ++after;
      }
      src.finish();
      CHECK_MESSAGE(src.sessions_completed() == 1, "source " << comm.rank() << ": "
                                                   << (src.last_error() ? src.last_error()->what : "no session"));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      typename Engine::template clone<dc::raw_view<std::uint8_t>> dst(comm, roles, r.state, small_settings::make<settings>());
      dst.request();
      dst.wait_layer(0);
      dst.wait();
      auto rep = dst.report();
      auto j = static_cast<std::size_t>(comm.rank() - n);
      std::lock_guard g(mu);
      got[j] = r.bytes();
      meta[j] = dst.metadata();
      k[j] = rep.iteration;
      reports[j] = rep;
      ++clones_done;  // the sources sum what each of them saw: m * n once all saw all
    }
  });
  for (int j = 0; j < m; ++j) {
    CAPTURE(j);
    // The expected state of iteration k, replayed from scratch.
    replica want;
    want.become(k[j]);
    want.state.metadata().step = k[j];
    CHECK(k[j] == k[0]);
    CHECK(got[j] == want.bytes());
    CHECK(meta[j] == want.state.metadata());
    const auto& rep = reports[j];
    CHECK(rep.state_bytes == want.bytes().size());
    CHECK(rep.sources.size() == static_cast<std::size_t>(n));
    CHECK(rep.clones.size() == static_cast<std::size_t>(m));
    std::uint64_t received = 0;
    for (auto& c : rep.clones) received += c.bytes_from_sources + c.bytes_from_clones;
    CHECK(received == rep.state_bytes * static_cast<std::uint64_t>(m));
    std::uint64_t sent = 0;
    for (auto& s : rep.sources) sent += s.bytes_sent;
    std::uint64_t from_sources = 0;
    for (auto& c : rep.clones) from_sources += c.bytes_from_sources;
    CHECK(sent == from_sources);
    CHECK(rep.readiness_s >= rep.first_layer_s);
    CHECK(rep.layer_ready_s.size() == 5);
    // The clone engine is shared by engines that differ in these policies: the report must
    // still name this engine's own.
    for (const char* name : {Engine::shard_type::name, Engine::pipeline_type::name, Engine::reconstruct_type::name})
      CHECK_MESSAGE(rep.policies.find(name) != std::string::npos, rep.policies << " lacks " << name);
  }
}

template <class Engine>
void clone_all_sizes(int max_m = 3) {
  unsigned delay = 0;
  for (int n = 1; n <= 4; ++n)
    for (int m = 1; m <= max_m; ++m) {
      CAPTURE(n);
      CAPTURE(m);
      clone_once<Engine>(n, m, delay);
      delay = (delay + 7) % 20;  // clones that ask while the sources are already well under way
    }
}

}  // namespace deepclone::testing
