// Fault injection against every kind of message the engine sends (data, headers, exchange
// data and headers, request, decisions, metadata header and bytes, statuses, summaries),
// with each kind of fault (drop, corrupt, duplicate, delay, reorder, truncate), plus silenced
// ranks. Whatever happens, a clone either completes with the exact state of iteration k or
// fails with a deepclone::error within its timeout, never exposes wrong bytes as ready,
// and the sources train on to the end of their loop. The outcome table is printed at exit.
#include "harness.hpp"

using namespace faultharness;
using dc::fault::kind;
using dc::fault::rule;

namespace {

// N = 2 sources (ranks 0, 1), M = 2 clone ranks (2, 3), tag_base 1000.
constexpr int tb = 1000;
int layer_tag(int l, int which) { return tb + 16 + 4 * l + which; }  // 0 data, 1 header, 2 exch data, 3 exch header
// The first session's tag block (epoch 0) of the 3-layer base_spec: after the layer tags,
// metadata header, metadata, refetch data, refetch header (detail::session_tags).
int block_tag(int which) { return tb + 16 + 4 * 3 + which; }

struct target {
  const char* name;
  int from, to, tag;
};
const std::vector<target>& targets() {
  static const std::vector<target> t = {
      {"data(layer1)", 1, dc::fault::any, layer_tag(1, 0)},
      {"data(layer0,eager)", dc::fault::any, dc::fault::any, layer_tag(0, 0)},
      {"header(layer1)", 1, dc::fault::any, layer_tag(1, 1)},
      {"exchange-data", dc::fault::any, dc::fault::any, layer_tag(1, 2)},
      {"exchange-header", dc::fault::any, dc::fault::any, layer_tag(1, 3)},
      {"request", 2, 0, tb + 0},
      {"decision->clone", 0, 2, tb + 1},
      {"decision->source", 0, 1, tb + 1},
      {"meta-header", 0, 2, block_tag(0)},
      {"metadata", 0, 2, block_tag(1)},
      {"status", 1, 2, tb + 5},
      {"summary", 3, 2, tb + 6},
  };
  return t;
}

run_result one(const std::string& row, rule r, options o = {}) {
  auto faults = std::make_shared<dc::fault::plan>();
  faults->add(std::move(r));
  auto res = run(o, faults);
  table::get().add(row, res);
  return res;
}

void matrix(kind k, std::function<void(rule&)> tweak = nullptr) {
  for (auto& t : targets()) {
    rule r;
    r.action = k;
    r.from = t.from;
    r.to = t.to;
    r.tag_lo = t.tag;
    r.first = 1;
    r.times = 1;
    r.bytes = {-1};  // corrupt: the last byte (a piece's checksum in a header)
    if (tweak) tweak(r);
    CAPTURE(t.name);
    auto res = one(dc::fault::kind_name(k), r);
    MESSAGE(dc::fault::kind_name(k) << " " << t.name << ": " << outcome_of(res.clones[0]) << " / "
                                    << outcome_of(res.clones[1]) << " in " << res.seconds << " s; injected " << res.injected[static_cast<std::size_t>(k)] << "; "
                                    << res.clones[0].what << res.clones[1].what);
    check_invariants(res);
  }
}

}  // namespace

TEST_CASE("fault: control run without faults completes") {
  auto faults = std::make_shared<dc::fault::plan>();
  auto res = run({}, faults);
  table::get().add("none", res);
  check_invariants(res);
  for (auto& c : res.clones) {
    CHECK(c.completed);
    CHECK_MESSAGE(!c.report_code, c.report_what);
  }
  CHECK(faults->total_injected() == 0);
}

TEST_CASE("fault: drop") { matrix(kind::drop); }
TEST_CASE("fault: corrupt") { matrix(kind::corrupt); }
TEST_CASE("fault: duplicate") { matrix(kind::duplicate); }
TEST_CASE("fault: delay (short, under the timeout)") {
  matrix(kind::delay, [](rule& r) { r.hold = 100ms; });
}
TEST_CASE("fault: late (delay beyond the timeout)") {
  for (auto& t : {targets()[0], targets()[2], targets()[9]}) {
    rule r{.action = kind::delay, .from = t.from, .to = t.to, .tag_lo = t.tag};
    r.hold = 2500ms;
    auto res = one("late", r);
    INFO(t.name);
    check_invariants(res);
  }
}
TEST_CASE("fault: reorder") { matrix(kind::reorder, [](rule& r) { r.hold = 300ms; }); }
TEST_CASE("fault: truncate") { matrix(kind::truncate); }

TEST_CASE("fault: a corrupt data piece with one source is fetched again from it, bitwise") {
  // With N = 1 there is no other source; the clone asks the same source once more (over the
  // refetch tags, which are not corrupted here) and completes with the state of iteration k.
  options o;
  o.n = 1;
  rule r{.action = kind::corrupt, .from = 0, .tag_lo = layer_tag(1, 0)};
  r.bytes = {0, 7, -1};
  auto res = one("corrupt-data-N1", r, o);
  check_invariants(res);
  for (auto& c : res.clones) CHECK_MESSAGE(c.completed, c.what);
}

TEST_CASE("fault: a data piece corrupt every time from the only source fails, naming layer, tensor and bytes") {
  options o;
  o.n = 1;
  auto faults = std::make_shared<dc::fault::plan>();
  for (int tag : {layer_tag(1, 0), block_tag(2)}) {  // the layer's data tag and the refetch data tag
    rule r{.action = kind::corrupt, .from = 0, .tag_lo = tag};
    r.times = 0;
    r.bytes = {0, 7, -1};
    faults->add(r);
  }
  auto res = run(o, faults);
  table::get().add("corrupt-data-N1-always", res);
  check_invariants(res);
  bool named = false;
  for (auto& c : res.clones)
    if (c.code == dc::errc::corrupt_message && contains(c.what, "layer 1 ('fc1') from source 0") &&
        contains(c.what, "tensor '") && contains(c.what, "bytes [") && contains(c.what, "failed its checksum"))
      named = true;
  CHECK_MESSAGE(named, res.clones[0].what << " | " << res.clones[1].what);
}

TEST_CASE("fault: every data message of a layer corrupt, from every source: the clone fails") {
  // The layer's data tag and the refetch data tag (failover), every time.
  auto faults = std::make_shared<dc::fault::plan>();
  for (int tag : {layer_tag(1, 0), block_tag(2)}) {
    rule r{.action = kind::corrupt, .tag_lo = tag};
    r.times = 0;
    r.bytes = {0, 7, -1};
    faults->add(r);
  }
  auto res = run({}, faults);
  table::get().add("corrupt-all-sources", res);
  check_invariants(res);
  for (auto& c : res.clones) {
    CHECK_FALSE(c.completed);
  }
  CHECK((res.clones[0].code == dc::errc::corrupt_message || res.clones[1].code == dc::errc::corrupt_message));
}

// ---------------------------------------------------------------------------------------
// Silenced ranks: a source or clone rank that stops talking (a crash, as the network sees it).

TEST_CASE("fault: a silenced source makes the clone fail with a timeout naming it") {
  for (std::uint64_t after : {0, 1, 3, 6}) {
    CAPTURE(after);
    auto faults = std::make_shared<dc::fault::plan>();
    faults->silence(1, after);
    auto res = run({}, faults);
    table::get().add("silence-source1", res);
    check_invariants(res);
    if (after == 0) {
      for (auto& c : res.clones) {
        INFO("what: [" << c.what << "]");
        CHECK(c.code == dc::errc::timeout);
        CHECK(contains(c.what, "source rank 1"));
      }
    }
  }
}

TEST_CASE("fault: a silenced coordinator: the clone times out waiting for the decision") {
  auto faults = std::make_shared<dc::fault::plan>();
  faults->silence(0);
  auto res = run({}, faults);
  table::get().add("silence-coordinator", res);
  check_invariants(res);
  for (auto& c : res.clones) {
    CHECK(c.code == dc::errc::timeout);
    CHECK(contains(c.what, "fork decision"));
  }
}

TEST_CASE("fault: a silenced clone rank: every clone rank ends in bounded time, none with wrong bytes") {
  for (std::uint64_t after : {0, 2}) {
    CAPTURE(after);
    auto faults = std::make_shared<dc::fault::plan>();
    faults->silence(3, after);
    auto res = run({}, faults);
    table::get().add("silence-clone", res);
    check_invariants(res);  // bounded time; a clone rank that completed holds iteration k bitwise
    // Silenced from the start, its request never reaches the coordinator: nobody forks.
    // Silenced later, it may still receive everything and complete (its own sends only
    // vanish), depending on timing: no outcome is asserted then beyond the invariants.
    if (after == 0)
      for (auto& c : res.clones) CHECK_FALSE(c.completed);
  }
}

TEST_CASE("fault: a source silenced mid-transfer by time") {
  auto faults = std::make_shared<dc::fault::plan>();
  faults->silence_at(1, std::chrono::steady_clock::now() + 30ms);
  auto res = run({}, faults);
  table::get().add("silence-source1-at", res);
  check_invariants(res);
}
