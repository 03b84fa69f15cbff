#pragma once
/// \file integrations/json.hpp
/// The clone report as JSON, through nlohmann-json (Debian: `nlohmann-json3-dev`). Including
/// this header is the opt-in; link the CMake target `deepclone::json`.
///
///   #include <deepclone/integrations/json.hpp>
///   nlohmann::json j = clone.report();          // to_json found by ADL
///   std::cout << j.dump() << "\n";               // one line, e.g. for a .jsonl file
///   auto back = j.get<deepclone::report>();      // and back (from_json)
///
/// Every field of `report`, `source_figures` and `clone_figures` appears under its C++
/// name; times are seconds. A figure that was not measured (NaN, e.g. the overhead of a
/// source that forked in its first iterations) is written as `null` and read back as NaN,
/// so the output is always valid JSON (JSON has no NaN).

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>

#include "../report.hpp"

namespace deepclone {

namespace detail::json {
/// A double as JSON: NaN and infinities become null.
inline nlohmann::json number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }
/// A double from JSON: null (or a missing key) becomes NaN.
inline double number(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::numeric_limits<double>::quiet_NaN();
  return it->get<double>();
}
}  // namespace detail::json

inline void to_json(nlohmann::json& j, const source_figures& s) {
  using detail::json::number;
  j = {{"rank", s.rank},
       {"bytes_sent", s.bytes_sent},
       {"hook_s", number(s.hook_s)},
       {"overhead_s", number(s.overhead_s)},
       {"normal_iteration_s", number(s.normal_iteration_s)},
       {"fork_iterations", s.fork_iterations},
       {"failed", s.failed}};
}
inline void from_json(const nlohmann::json& j, source_figures& s) {
  using detail::json::number;
  j.at("rank").get_to(s.rank);
  j.at("bytes_sent").get_to(s.bytes_sent);
  s.hook_s = number(j, "hook_s");
  s.overhead_s = number(j, "overhead_s");
  s.normal_iteration_s = number(j, "normal_iteration_s");
  j.at("fork_iterations").get_to(s.fork_iterations);
  j.at("failed").get_to(s.failed);
}

inline void to_json(nlohmann::json& j, const clone_figures& c) {
  using detail::json::number;
  j = {{"rank", c.rank},
       {"bytes_from_sources", c.bytes_from_sources},
       {"bytes_from_clones", c.bytes_from_clones},
       {"readiness_s", number(c.readiness_s)},
       {"standby_s", number(c.standby_s)},
       {"first_layer_s", number(c.first_layer_s)}};
}
inline void from_json(const nlohmann::json& j, clone_figures& c) {
  using detail::json::number;
  j.at("rank").get_to(c.rank);
  j.at("bytes_from_sources").get_to(c.bytes_from_sources);
  j.at("bytes_from_clones").get_to(c.bytes_from_clones);
  c.readiness_s = number(j, "readiness_s");
  c.standby_s = number(j, "standby_s");
  c.first_layer_s = number(j, "first_layer_s");
}

inline void to_json(nlohmann::json& j, const report& r) {
  using detail::json::number;
  auto layers = nlohmann::json::array();
  for (double t : r.layer_ready_s) layers.push_back(number(t));
  j = {{"session", r.session},
       {"iteration", r.iteration},
       {"state_bytes", r.state_bytes},
       {"metadata_bytes", r.metadata_bytes},
       {"policies", r.policies},
       {"agreement_s", number(r.agreement_s)},
       {"first_layer_s", number(r.first_layer_s)},
       {"readiness_s", number(r.readiness_s)},
       {"standby_s", number(r.standby_s)},
       {"refetched_groups", r.refetched_groups},
       {"replicas_verified", r.replicas_verified},
       {"layer_ready_s", std::move(layers)},
       {"sources", r.sources},
       {"clones", r.clones},
       {"max_readiness_s", number(r.max_readiness_s())},
       {"max_overhead_s", number(r.max_overhead_s())},
       {"max_hook_s", number(r.max_hook_s())}};
}
/// Reads what `to_json` wrote; the derived `max_*` keys are ignored (recomputed from the parts).
inline void from_json(const nlohmann::json& j, report& r) {
  using detail::json::number;
  j.at("session").get_to(r.session);
  j.at("iteration").get_to(r.iteration);
  j.at("state_bytes").get_to(r.state_bytes);
  j.at("metadata_bytes").get_to(r.metadata_bytes);
  j.at("policies").get_to(r.policies);
  r.agreement_s = number(j, "agreement_s");
  r.first_layer_s = number(j, "first_layer_s");
  r.readiness_s = number(j, "readiness_s");
  r.standby_s = number(j, "standby_s");
  j.at("refetched_groups").get_to(r.refetched_groups);
  j.at("replicas_verified").get_to(r.replicas_verified);
  r.layer_ready_s.clear();
  for (auto& t : j.at("layer_ready_s")) r.layer_ready_s.push_back(t.is_null() ? std::numeric_limits<double>::quiet_NaN() : t.get<double>());
  j.at("sources").get_to(r.sources);
  j.at("clones").get_to(r.clones);
}

}  // namespace deepclone
