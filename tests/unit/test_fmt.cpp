// The fmt integration: a report prints as text and as one JSON object with nulls for
// unmeasured figures.
#include <doctest/doctest.h>

#include <deepclone/integrations/fmt.hpp>

TEST_CASE("fmt prints a report as text and as JSON") {
  deepclone::report r;
  r.session = 3;
  r.iteration = 41;
  r.state_bytes = 1234;
  r.policies = "split_even/window/scatter_exchange/mix64";
  r.readiness_s = 0.5;
  r.sources.push_back({0, 617, 0.001, NAN, NAN, 2});
  r.sources.push_back({1, 617, 0.002, 0.01, 0.2, 1});
  r.clones.push_back({2, 600, 634, 0.5, 0.25, 0.1});
  const auto text = fmt::format("{}", r);
  CHECK(text.find("clone session 3 at iteration 41") != std::string::npos);
  const auto json = fmt::format("{:j}", r);
  CHECK(json.front() == '{');
  CHECK(json.back() == '}');
  CHECK(json.find(R"("iteration":41)") != std::string::npos);
  CHECK(json.find(R"("overhead_s":null)") != std::string::npos);
  CHECK(json.find(R"("max_overhead_s":0.010000)") != std::string::npos);
  CHECK(json.find(R"("bytes_from_clones":634)") != std::string::npos);
  CHECK(json.find("nan") == std::string::npos);
}
