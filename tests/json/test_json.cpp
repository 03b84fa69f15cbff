// The report as JSON (integrations/json.hpp): a real clone's report written and read back
// equal, every field under its C++ name, NaN written as null and read back as NaN, and the
// output one valid JSON line.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>
#include <deepclone/integrations/json.hpp>

#include <atomic>
#include <cmath>
#include <string>
#include <vector>

namespace dc = deepclone;

namespace {

/// A real fork in process: 2 sources, 2 clone ranks, three layers; returns clone rank 0's report.
dc::report fork_report() {
  using E = dc::engine<dc::inproc::communicator>;
  const auto roles = dc::roles::contiguous(2, 2);
  dc::report rep;
  std::atomic<int> done{0};
  dc::inproc::world world(4);
  world.run([&](dc::inproc::communicator& comm) {
    std::vector<std::vector<float>> t{std::vector<float>(300000, 1.0f), std::vector<float>(300000, 0.0f),
                                      std::vector<float>(1000, 2.0f), std::vector<float>(7, 3.0f)};
    dc::state<std::vector<float>> st;
    st.add_layer("embed", {{"weight", t[0]}, {"weight.momentum", t[1]}});
    st.add_layer("fc", {{"weight", t[2]}});
    st.add_layer("head", {{"bias", t[3]}});
    if (comm.rank() < 2) {
      E::source<std::vector<float>> src(comm, roles, st);
      for (std::uint64_t step = 0;; ++step) {
        for (std::size_t l = st.layer_count(); l-- > 0;) {
          src.before_update(l);
          for (auto& x : st.layer_tensors(l))
            for (auto& v : *x.ref) v += 0.5f;
          src.after_update(l);
        }
        // The sources agree on stopping (each reading `done` alone, one could leave while
        // the other waits in this collective forever: a hang seen once under load).
        int finished[1] = {done.load() == 2 && step >= 8 ? 1 : 0};
        dc::allreduce_sum(comm, roles.sources, std::span<int>(finished), 10);
        st.metadata().step = step;
        src.end_iteration(step);
        if (finished[0] == 2) break;
      }
      src.finish();
    } else {
      E::clone<std::vector<float>> dst(comm, roles, st);
      dst.request();
      dst.wait();
      auto r = dst.report();
      if (comm.rank() == 2) rep = r;
      done.fetch_add(1);
    }
  });
  return rep;
}

}  // namespace

TEST_CASE("a clone's report round-trips through JSON") {
  const dc::report r = fork_report();
  REQUIRE(r.clones.size() == 2);
  REQUIRE(r.sources.size() == 2);
  nlohmann::json j = r;
  for (auto* k : {"session", "iteration", "state_bytes", "metadata_bytes", "policies", "agreement_s", "first_layer_s",
                  "readiness_s", "standby_s", "refetched_groups", "replicas_verified", "layer_ready_s", "sources", "clones",
                  "max_readiness_s", "max_overhead_s", "max_hook_s"})
    CHECK_MESSAGE(j.contains(k), k);
  CHECK(j["policies"] == r.policies);
  CHECK(j["layer_ready_s"].size() == 3);
  CHECK(j["sources"][0]["bytes_sent"] == r.sources[0].bytes_sent);
  CHECK(j["clones"][1]["bytes_from_sources"] == r.clones[1].bytes_from_sources);
  CHECK(j["max_readiness_s"].get<double>() == r.max_readiness_s());

  const std::string line = j.dump();
  CHECK(line.find('\n') == std::string::npos);
  auto back = nlohmann::json::parse(line).get<dc::report>();
  CHECK(back.session == r.session);
  CHECK(back.iteration == r.iteration);
  CHECK(back.state_bytes == r.state_bytes);
  CHECK(back.policies == r.policies);
  CHECK(back.readiness_s == r.readiness_s);
  CHECK(back.layer_ready_s == r.layer_ready_s);
  REQUIRE(back.sources.size() == r.sources.size());
  for (std::size_t i = 0; i < r.sources.size(); ++i) {
    CHECK(back.sources[i].rank == r.sources[i].rank);
    CHECK(back.sources[i].bytes_sent == r.sources[i].bytes_sent);
    CHECK(back.sources[i].fork_iterations == r.sources[i].fork_iterations);
    CHECK((back.sources[i].overhead_s == r.sources[i].overhead_s ||
           (std::isnan(back.sources[i].overhead_s) && std::isnan(r.sources[i].overhead_s))));
  }
  REQUIRE(back.clones.size() == r.clones.size());
  CHECK(back.clones[1].readiness_s == r.clones[1].readiness_s);
  CHECK(nlohmann::json(back) == j);
}

TEST_CASE("figures that were not measured are null in JSON and NaN again when read") {
  dc::report r;
  r.policies = "split_even/window/scatter_exchange/mix64";
  r.layer_ready_s = {0.5, NAN};
  dc::source_figures s;
  s.rank = 0;
  s.overhead_s = NAN;
  s.normal_iteration_s = INFINITY;
  r.sources.push_back(s);
  nlohmann::json j = r;
  CHECK(j["sources"][0]["overhead_s"].is_null());
  CHECK(j["sources"][0]["normal_iteration_s"].is_null());
  CHECK(j["layer_ready_s"][1].is_null());
  CHECK(j["max_overhead_s"].is_null());
  const auto text = j.dump();
  CHECK(text.find("nan") == std::string::npos);
  auto back = nlohmann::json::parse(text).get<dc::report>();
  CHECK(std::isnan(back.sources[0].overhead_s));
  CHECK(std::isnan(back.layer_ready_s[1]));
  CHECK(back.layer_ready_s[0] == 0.5);
}
