#pragma once
/// \file integrations/fmt.hpp
/// Opt-in fmt support: `fmt::format("{}", report)` prints the clone report, and `{:j}` prints
/// it as one JSON object (for logs and benchmark tooling). Link `deepclone::fmt`.

#include <fmt/format.h>

#include <cmath>
#include <string>

#include "../report.hpp"

namespace deepclone::detail {
/// JSON has no NaN: unmeasured figures become null.
inline std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{:.6f}", v) : std::string("null"); }
}  // namespace deepclone::detail

template <>
struct fmt::formatter<deepclone::report> {
  bool json = false;
  constexpr auto parse(format_parse_context& ctx) {
    auto it = ctx.begin();
    if (it != ctx.end() && *it == 'j') {
      json = true;
      ++it;
    }
    if (it != ctx.end() && *it != '}') throw format_error("deepclone::report: use {} or {:j}");
    return it;
  }
  template <class Ctx>
  auto format(const deepclone::report& r, Ctx& ctx) const {
    using deepclone::detail::json_number;
    if (!json) return fmt::format_to(ctx.out(), "{}", deepclone::to_string(r));
    auto out = fmt::format_to(ctx.out(),
                              R"({{"session":{},"iteration":{},"state_bytes":{},"metadata_bytes":{},"policies":"{}",)"
                              R"("agreement_s":{},"first_layer_s":{},"readiness_s":{},"standby_s":{},"max_overhead_s":{},"sources":[)",
                              r.session, r.iteration, r.state_bytes, r.metadata_bytes, r.policies, json_number(r.agreement_s),
                              json_number(r.first_layer_s), json_number(r.readiness_s), json_number(r.standby_s),
                              json_number(r.max_overhead_s()));
    for (std::size_t i = 0; i < r.sources.size(); ++i) {
      auto& s = r.sources[i];
      out = fmt::format_to(out, R"({}{{"rank":{},"bytes_sent":{},"hook_s":{},"overhead_s":{},"normal_iteration_s":{},"fork_iterations":{}}})",
                           i ? "," : "", s.rank, s.bytes_sent, json_number(s.hook_s), json_number(s.overhead_s),
                           json_number(s.normal_iteration_s), s.fork_iterations);
    }
    out = fmt::format_to(out, R"(],"clones":[)");
    for (std::size_t i = 0; i < r.clones.size(); ++i) {
      auto& c = r.clones[i];
      out = fmt::format_to(out, R"({}{{"rank":{},"bytes_from_sources":{},"bytes_from_clones":{},"readiness_s":{},"standby_s":{},"first_layer_s":{}}})",
                           i ? "," : "", c.rank, c.bytes_from_sources, c.bytes_from_clones, json_number(c.readiness_s),
                           json_number(c.standby_s), json_number(c.first_layer_s));
    }
    return fmt::format_to(out, "]}}");
  }
};
