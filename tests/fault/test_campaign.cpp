// A seeded, randomised fault campaign (issue 10, item 8). Each seed decides a whole run:
// N sources (1..4), M clone ranks (1..3), one of four engine instantiations, a random
// layered state, the plan settings, verify_replicas and check_writes or not, maybe a clone
// rank that cancels or whose layout is refused (a tensor 8 bytes longer, restored for the
// retry), and a fault plan of every kind (drop, corrupt, duplicate, delay, reorder, truncate, and a
// silenced rank) on every kind of message (layer data, header, exchange data and header,
// request, decision, layout, metadata header and bytes, status, summary, cancel, ack,
// refetch, refetch data and header, digest, or any message). Then, on the same ranks and with
// the same engines, the faults are switched off and every clone rank calls request() again.
//
// Invariants of every run (any violation fails the test and prints the seed, the whole
// configuration and the line that replays it):
//  1. each clone rank's first attempt ends bitwise exact (state and metadata of iteration k)
//     or with a deepclone::error (never another exception), within the attempt's bound;
//  2. no layer is reported ready (wait_layer) holding other bytes than those of iteration k;
//  3. nothing is written into a clone's tensors or metadata after its attempt ended (failed,
//     cancelled or completed): the tensors are snapshotted, the clone engine is kept alive and
//     the rank keeps making transport progress while the sources train (and send) on;
//  4. no source hook throws, every source runs to the end of its loop (no hang);
//  5. the fault-free retry completes bitwise exact on every clone rank, and its report()
//     succeeds (no message of the earlier session may be taken by the new one);
//  6. every source leaves the first attempt's session within 3 timeouts + 1 s of the last
//     clone rank's first attempt ending (the retry waits for that, bounded).
// Two more test cases: the checks themselves catch a stray write and a wrong byte (negative
// controls), and every message kind is seen on the tags the campaign targets (tag map).
//
// "silence" is a partition of one rank, from its n-th message on, in one or both directions
// (drop rules on every engine message from / to it; faulty<>'s own silence() cannot be lifted
// for the retry: receives posted while silenced never complete). It is counted as silence.
//
// Runs: the fixed CI seed list (fault.campaign); DEEPCLONE_CAMPAIGN_SEED=s replays one seed
// (verbose); DEEPCLONE_CAMPAIGN_SEEDS=1-6,9 a list; DEEPCLONE_CAMPAIGN_RUNS=n (from
// DEEPCLONE_CAMPAIGN_FIRST, default 1) a range, as fault.campaign_long does (1000 runs, label
// soak, only with `ctest -C soak`); DEEPCLONE_CAMPAIGN_TIMEOUT_MS (default 1000) the engines'
// timeout, raised under sanitizers; DEEPCLONE_CAMPAIGN_VERBOSE=1 one line per run.
//
// Findings on the engine of commit 4961b64, before the issue-10 fixes (CI seeds 1..60: 11
// runs violate, all in the fault-free retry; timing decides a few; replay each with
// DEEPCLONE_CAMPAIGN_SEED=<seed> build/tests/fault/fault.campaign). With 757cff8: none.
//  - item 1, the retry takes the earlier session's metadata header or metadata: seeds 5, 42,
//    55 ("metadata header of session s-1 ..., expected s"), 47 ("metadata ... failed its
//    checksum"), 60 (a stale exchange group header: "header names session s-1");
//  - item 1, the retry takes an earlier request's refusal: seeds 24, 26, 34, 35 (first attempt
//    refused for a mismatched layout, the layout restored, the retry still "layout_mismatch");
//  - item 1, the retry takes a failed session's statuses: seed 51 ("source 0 failed: layer 2
//    was not delivered ..."); the retry's report() times out on them: seed 60;
//  - item 5, a staged source never leaves a session whose acknowledgements were lost (a
//    silenced clone rank), so no retry is served: seed 20 (timeout on the fork decision).
//  No wrong byte, no wrong ready layer, no write after the end, no non-deepclone exception and
//  no throwing source hook in about 390 runs. Item 4 (an oversized control message) is out of
//  reach: faulty<> cannot enlarge a message.
#include "harness.hpp"

#include <algorithm>
#include <array>
#include <cinttypes>
#include <condition_variable>
#include <cstdlib>
#include <type_traits>
#include <typeinfo>

// Complete once the library puts a session's bulk messages in per-session tag blocks
// (issue 10, item 1: detail::session_tags); until then the tags are the fixed ones of
// detail/wire.hpp. The "campaign tag map" test case checks that every targeted kind is seen.
namespace deepclone::detail {
struct session_tags;
}
#include <set>
#include <sstream>

namespace {

using namespace faultharness;
using dc::fault::kind;
using dc::fault::rule;

// ---------------------------------------------------------------------------------------
// Seeded randomness: splitmix64, so that a seed means the same configuration everywhere.
struct rng {
  std::uint64_t s;
  explicit rng(std::uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x243F6A8885A308D3ull) {}
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::uint64_t below(std::uint64_t n) { return n ? next() % n : 0; }
  int range(int lo, int hi) { return lo + static_cast<int>(below(static_cast<std::uint64_t>(hi - lo + 1))); }
  bool chance(int percent) { return below(100) < static_cast<std::uint64_t>(percent); }
  template <class T>
  const T& pick(const std::vector<T>& v) { return v[below(v.size())]; }
};

// ---------------------------------------------------------------------------------------
// The engines: a small fixed set (each instantiation costs ~15 s of compile).
using E0 = dc::engine<fcomm, dc::shard::split_even, dc::pipeline::window, dc::reconstruct::scatter_exchange>;
using E1 = dc::engine<fcomm, dc::shard::whole_tensor, dc::pipeline::staged, dc::reconstruct::direct>;
using E2 = dc::engine<fcomm, dc::shard::split_even, dc::pipeline::blocking, dc::reconstruct::scatter_exchange>;
using E3 = dc::engine<fcomm, dc::shard::layer_round_robin, dc::pipeline::window, dc::reconstruct::direct>;
constexpr int engine_count = 4;
const char* engine_name(int e) {
  static const char* n[engine_count] = {"split_even/window/scatter_exchange", "whole_tensor/staged/direct",
                                        "split_even/blocking/scatter_exchange", "layer_round_robin/window/direct"};
  return n[e];
}
bool engine_exchanges(int e) { return e == 0 || e == 2; }

// ---------------------------------------------------------------------------------------
// Message kinds and their tags (detail/wire.hpp): tag_base + offset; layer tags
// tag_base + 16 + 4 * layer + {0 data, 1 header, 2 exchange data, 3 exchange header}.
enum class msg : int {
  data, header, exch_data, exch_header, request, decision, layout, meta_header, metadata, status, summary, cancel, ack,
  refetch, refetch_data, refetch_header, digest, any_message
};
constexpr int msg_count = 18;
const char* msg_name(msg m) {
  static const char* n[msg_count] = {"data", "header", "exchange-data", "exchange-header", "request", "decision",
                                     "layout", "meta-header", "metadata", "status", "summary", "cancel", "ack",
                                     "refetch", "refetch-data", "refetch-header", "digest", "any-message"};
  return n[static_cast<int>(m)];
}
int control_offset(msg m) {
  switch (m) {
    case msg::request: return 0;
    case msg::decision: return 1;
    case msg::layout: return 2;
    case msg::meta_header: return 3;
    case msg::metadata: return 4;
    case msg::status: return 5;
    case msg::summary: return 6;
    case msg::cancel: return 7;
    case msg::ack: return 8;
    case msg::refetch: return 9;
    case msg::refetch_data: return 10;
    case msg::refetch_header: return 11;
    case msg::digest: return 12;
    default: return -1;
  }
}

template <class T, class = void>
inline constexpr bool complete_v = false;
template <class T>
inline constexpr bool complete_v<T, std::void_t<decltype(sizeof(T))>> = true;
/// Per-session tag blocks: the first attempt may use any of the first few.
constexpr std::uint32_t campaign_epochs = 8;
bool bulk_kind(msg m) {
  return m <= msg::exch_header || m == msg::meta_header || m == msg::metadata || m == msg::refetch_data ||
         m == msg::refetch_header;
}

const char* errc_str(dc::errc e) {
  switch (e) {
    case dc::errc::invalid_argument: return "invalid_argument";
    case dc::errc::hook_order: return "hook_order";
    case dc::errc::busy: return "busy";
    case dc::errc::layout_mismatch: return "layout_mismatch";
    case dc::errc::plan_mismatch: return "plan_mismatch";
    case dc::errc::timeout: return "timeout";
    case dc::errc::corrupt_message: return "corrupt_message";
    case dc::errc::fork_agreement: return "fork_agreement";
    case dc::errc::source_failed: return "source_failed";
    case dc::errc::cancelled: return "cancelled";
    case dc::errc::not_ready: return "not_ready";
    case dc::errc::unsupported: return "unsupported";
    case dc::errc::transport: return "transport";
    case dc::errc::replica_mismatch: return "replica_mismatch";
    default: return "errc(other)";
  }
}

// ---------------------------------------------------------------------------------------
// One run's configuration, a pure function of the seed.
struct fault_spec {
  kind action = kind::drop;
  msg what = msg::data;
  int layer = 0;  ///< layer messages
  int from = dc::fault::any, to = dc::fault::any;
  std::uint64_t first = 1, times = 1;  ///< times 0: every match from `first` on
  std::vector<std::int64_t> bytes{0};  ///< corrupt
  std::uint8_t mask = 0xFF;
  int hold_ms = 50;                    ///< delay; reorder (0: until the next match)
  std::size_t keep = std::numeric_limits<std::size_t>::max();  ///< truncate
};
struct partition_spec {
  int rank = 0;
  std::uint64_t out_after = 0, in_after = 0;  ///< 0: that direction stays open
};

struct config {
  std::uint64_t seed = 0;
  int n = 2, m = 2, engine = 0;
  spec layers;
  std::uint64_t shard_threshold = 64 * 1024, exchange_threshold = 16 * 1024, max_piece = 64 * 1024,
                staging = 64 * 1024;
  int tag_base = 1000;
  int failover_ms = 10000;
  bool verify = false;
  bool check_writes = false;  ///< settings.check_writes on the sources (where the engine has it)
  bool report_first = true;  ///< phase 1 also asks for report() after completing
  int cancel_rank = -1, cancel_after_layer = -1;  ///< that clone rank cancels after wait_layer(l) (-1: at once)
  int mismatch_rank = -1;  ///< that clone rank's first tensor is 8 bytes longer in the first attempt (refused)
  std::size_t user_meta_bytes = 100;
  std::vector<fault_spec> faults;
  std::optional<partition_spec> partition;

};

/// The tags message kind `m` (of `layer`, for layer messages) travels on.
template <class ST = dc::detail::session_tags>
std::vector<int> tags_of(msg m, int layer, const config& c) {
  const int b = c.tag_base;
  if constexpr (complete_v<ST>) {
    if (bulk_kind(m)) {
      std::vector<int> out;
      for (std::uint32_t e = 0; e < campaign_epochs; ++e) {
        ST t{b, c.layers.size(), e};
        const auto l = static_cast<std::size_t>(layer);
        switch (m) {
          case msg::data: out.push_back(t.layer(l, false, false)); break;
          case msg::header: out.push_back(t.layer(l, false, true)); break;
          case msg::exch_data: out.push_back(t.layer(l, true, false)); break;
          case msg::exch_header: out.push_back(t.layer(l, true, true)); break;
          case msg::meta_header: out.push_back(t.meta_header()); break;
          case msg::metadata: out.push_back(t.meta()); break;
          case msg::refetch_data: out.push_back(t.refetch_data()); break;
          case msg::refetch_header: out.push_back(t.refetch_header()); break;
          default: break;
        }
      }
      return out;
    }
  } else {
    if (m <= msg::exch_header) return {b + 16 + 4 * layer + static_cast<int>(m)};
  }
  return {b + control_offset(m)};
}

std::string describe(const config& c) {
  std::ostringstream o;
  o << "seed " << c.seed << ": N=" << c.n << " M=" << c.m << " engine=" << engine_name(c.engine) << " tag_base=" << c.tag_base
    << " shard.threshold=" << c.shard_threshold << " reconstruct.threshold=" << c.exchange_threshold
    << " max_piece=" << c.max_piece << " staging=" << c.staging << " failover_after=" << c.failover_ms << "ms"
    << " verify_replicas=" << c.verify << " check_writes=" << c.check_writes << " report_first=" << c.report_first << " user_meta=" << c.user_meta_bytes;
  if (c.cancel_rank >= 0) o << " cancel: clone " << c.cancel_rank << " after layer " << c.cancel_after_layer;
  if (c.mismatch_rank >= 0) o << " mismatched layout (first attempt): clone " << c.mismatch_rank;
  o << "\n  state:";
  for (auto& l : c.layers) {
    o << " " << l.name << "{";
    for (std::size_t i = 0; i < l.tensors.size(); ++i) o << (i ? "," : "") << l.tensors[i].bytes;
    o << "}";
  }
  if (c.partition)
    o << "\n  silence rank " << c.partition->rank << ": sends from message " << c.partition->out_after
      << ", receives from message " << c.partition->in_after << " (0: open)";
  for (auto& f : c.faults) {
    o << "\n  " << dc::fault::kind_name(f.action) << " " << msg_name(f.what);
    if (f.what <= msg::exch_header) o << "(layer " << f.layer << ")";
    o << " from " << (f.from == dc::fault::any ? std::string("any") : std::to_string(f.from)) << " to "
      << (f.to == dc::fault::any ? std::string("any") : std::to_string(f.to)) << " first " << f.first << " times "
      << (f.times ? std::to_string(f.times) : std::string("all"));
    if (f.action == kind::corrupt) {
      o << " bytes";
      for (auto b : f.bytes) o << " " << b;
      o << " mask 0x" << std::hex << int(f.mask) << std::dec;
    }
    if (f.action == kind::delay || f.action == kind::reorder) o << " hold " << f.hold_ms << "ms";
    if (f.action == kind::truncate)
      o << " keep " << (f.keep == std::numeric_limits<std::size_t>::max() ? std::string("half") : std::to_string(f.keep));
  }
  if (c.faults.empty() && !c.partition) o << "\n  no faults (control)";
  return o.str();
}

config make_config(std::uint64_t seed) {
  rng r(seed);
  config c;
  c.seed = seed;
  c.n = r.range(1, 4);
  c.m = r.range(1, 3);
  c.engine = static_cast<int>(r.below(engine_count));
  c.tag_base = r.chance(80) ? 1000 : 200;
  // A state of 1..4 layers, 0..3 tensors each (an empty layer, zero-byte tensors), eager
  // (<= 4 KiB) and rendezvous sizes, split and whole tensors; about 0.5 MB at most.
  static const std::vector<std::size_t> sizes = {0, 5, 40, 1200, 3001, 4096, 5000, 20000, 70001, 150003};
  const int layers = r.range(1, 4);
  for (int l = 0; l < layers; ++l) {
    lspec ls{"layer" + std::to_string(l), {}};
    const int tensors = r.chance(8) ? 0 : r.range(1, 3);
    for (int t = 0; t < tensors; ++t) ls.tensors.push_back({"t" + std::to_string(t), r.pick(sizes)});
    c.layers.push_back(std::move(ls));
  }
  c.shard_threshold = r.chance(50) ? 16 * 1024 : 64 * 1024;
  c.exchange_threshold = r.chance(50) ? 4 * 1024 : 16 * 1024;
  c.max_piece = r.chance(50) ? 16 * 1024 : 64 * 1024;
  c.staging = r.chance(50) ? 8 * 1024 : 64 * 1024;
  c.failover_ms = r.chance(50) ? 300 : 10000;
  c.verify = r.chance(30);
  c.report_first = r.chance(50);
  c.user_meta_bytes = r.pick(std::vector<std::size_t>{0, 100, 5000});
  if (r.chance(10)) {
    c.cancel_rank = r.range(0, c.m - 1);
    c.cancel_after_layer = r.range(-1, layers - 1);
  }

  const int world = c.n + c.m;
  auto source = [&] { return r.range(0, c.n - 1); };
  auto clone = [&] { return c.n + r.range(0, c.m - 1); };
  auto any_rank = [&] { return r.range(0, world - 1); };
  if (r.chance(15)) {  // a silenced rank
    partition_spec p;
    p.rank = any_rank();
    const int dirs = r.range(0, 2);  // 0 sends, 1 receives, 2 both
    if (dirs != 1) p.out_after = static_cast<std::uint64_t>(r.range(1, 10));
    if (dirs != 0) p.in_after = static_cast<std::uint64_t>(r.range(1, 10));
    c.partition = p;
  }
  const int rules = r.chance(5) ? 0 : (c.partition ? r.range(0, 1) : r.range(1, 3));
  for (int i = 0; i < rules; ++i) {
    fault_spec f;
    f.action = static_cast<kind>(r.below(6));  // drop .. truncate; silence is the partition above
    for (;;) {  // a message kind that this configuration sends (refetches and the layout may still not happen)
      f.what = static_cast<msg>(r.below(msg_count));
      if ((f.what == msg::exch_data || f.what == msg::exch_header) && (!engine_exchanges(c.engine) || c.m == 1)) continue;
      if (f.what == msg::summary && c.m == 1) continue;
      if (f.what == msg::digest && !c.verify) continue;
      break;
    }
    f.layer = r.range(0, layers - 1);
    const bool pin_from = r.chance(50), pin_to = r.chance(50);
    switch (f.what) {
      case msg::data: case msg::header: case msg::status: case msg::refetch_data: case msg::refetch_header: case msg::digest:
        if (pin_from) f.from = source();
        if (pin_to) f.to = clone();
        break;
      case msg::exch_data: case msg::exch_header: case msg::summary:
        if (pin_from) f.from = clone();
        if (pin_to) f.to = clone();
        break;
      case msg::request:
        if (pin_from) f.from = clone();
        f.to = 0;
        break;
      case msg::decision:
        f.from = 0;
        if (pin_to) f.to = r.range(1, world - 1);
        break;
      case msg::layout: case msg::meta_header: case msg::metadata:
        f.from = 0;
        if (pin_to) f.to = clone();
        break;
      case msg::cancel: case msg::ack: case msg::refetch:
        if (pin_from) f.from = clone();
        if (pin_to) f.to = source();
        break;
      case msg::any_message:
        if (pin_from) f.from = any_rank();
        break;
    }
    if (f.from != dc::fault::any && f.from == f.to) f.to = dc::fault::any;
    f.first = f.what == msg::any_message ? static_cast<std::uint64_t>(r.range(1, 40)) : static_cast<std::uint64_t>(r.range(1, 3));
    const auto t = r.below(100);
    f.times = t < 70 ? 1 : t < 88 ? static_cast<std::uint64_t>(r.range(2, 3)) : 0;
    switch (f.action) {
      case kind::corrupt:
        f.bytes.clear();
        for (int b = r.range(1, 3); b-- > 0;) f.bytes.push_back(static_cast<std::int64_t>(r.range(-64, 64)));
        f.mask = static_cast<std::uint8_t>(r.range(1, 255));
        break;
      case kind::delay: f.hold_ms = r.pick(std::vector<int>{10, 100, 400, 1500}); break;
      case kind::reorder: f.hold_ms = r.pick(std::vector<int>{0, 50, 300}); break;
      case kind::truncate: f.keep = r.pick(std::vector<std::size_t>{0, 1, 7, std::numeric_limits<std::size_t>::max()}); break;
      default: break;
    }
    c.faults.push_back(std::move(f));
  }
  c.check_writes = r.chance(20);  // drawn last: the draws above keep their meaning
  // Messages that only a failure sends: provoke it, so that the faults on them can fire.
  const std::size_t planned = c.faults.size();
  for (std::size_t i = 0; i < planned; ++i) {
    const auto w = c.faults[i].what;
    if (w == msg::refetch || w == msg::refetch_data || w == msg::refetch_header) {
      fault_spec f;  // a corrupt piece is fetched again
      f.action = kind::corrupt;
      f.what = msg::data;
      f.layer = r.range(0, layers - 1);
      f.bytes = {0};
      c.faults.push_back(f);
    } else if (w == msg::cancel && c.cancel_rank < 0) {
      c.cancel_rank = r.range(0, c.m - 1);
      c.cancel_after_layer = r.range(-1, layers - 1);
    } else if (w == msg::layout) {
      c.mismatch_rank = r.range(0, c.m - 1);
    }
  }
  if (c.mismatch_rank < 0 && r.chance(5)) c.mismatch_rank = r.range(0, c.m - 1);
  return c;
}

/// The fault plan of a configuration. The silence rules come first, so that they win over
/// any other rule and their firings can be counted from their match counts.
struct built_plan {
  std::shared_ptr<dc::fault::plan> plan = std::make_shared<dc::fault::plan>();
  std::vector<std::pair<std::size_t, std::uint64_t>> silence_rules;  ///< (rule index, first)
  std::vector<std::vector<std::size_t>> fault_rules;                 ///< rule indices per config fault (one per tag)
  std::vector<std::vector<std::size_t>> observers;                   ///< per message kind: rules that never fire
};
built_plan build_plan(const config& c, bool observe) {
  built_plan b;
  if (c.partition) {
    auto add = [&](bool out, std::uint64_t after) {
      rule r{.action = kind::drop};  // every tag: only engine messages go through faulty<>
      (out ? r.from : r.to) = c.partition->rank;
      r.first = after;
      r.times = 0;
      b.silence_rules.emplace_back(b.plan->add(r), after);
    };
    if (c.partition->out_after) add(true, c.partition->out_after);
    if (c.partition->in_after) add(false, c.partition->in_after);
  }
  for (auto& f : c.faults) {
    rule r{.action = f.action, .from = f.from, .to = f.to};
    r.first = f.first;
    r.times = f.times;
    r.bytes = f.bytes;
    r.mask = f.mask;
    r.hold = std::chrono::milliseconds(f.hold_ms);
    r.keep = f.keep;
    auto& idx = b.fault_rules.emplace_back();
    if (f.what == msg::any_message) {
      idx.push_back(b.plan->add(r));  // every tag
      continue;
    }
    for (int tag : tags_of(f.what, f.layer, c)) {
      r.tag_lo = tag;
      idx.push_back(b.plan->add(r));
    }
  }
  if (observe)  // rules that count their matches and never fire (after all others: they never act)
    for (int k = 0; k < msg_count; ++k) {
      auto& idx = b.observers.emplace_back();
      const auto m = static_cast<msg>(k);
      if (m == msg::any_message) continue;
      for (int l = 0; l < (k <= static_cast<int>(msg::exch_header) ? static_cast<int>(c.layers.size()) : 1); ++l)
        for (int tag : tags_of(m, l, c)) {
          rule r{.action = kind::drop, .tag_lo = tag};
          r.first = std::numeric_limits<std::uint64_t>::max();
          idx.push_back(b.plan->add(r));
        }
    }
  return b;
}
/// How often a rule with this `first`/`times` fired, given how often it matched (an
/// estimate where rules overlap: only the first firing rule acts on a message).
std::uint64_t fired(std::uint64_t seen, std::uint64_t first, std::uint64_t times) {
  if (seen < first) return 0;
  const std::uint64_t n = seen - first + 1;
  return times ? std::min(n, times) : n;
}

// ---------------------------------------------------------------------------------------
// One run.
struct attempt_result {
  std::string outcome = "?";  ///< completed, completed(report:x), an errc name, OTHER-EXCEPTION
  std::optional<dc::errc> code;
  std::string what;
  bool completed = false, bytes_ok = false;
  int wrong_ready_layers = 0;
  bool other_exception = false;
  bool written_after = false;
  std::string written_where;
  double seconds = 0;
  std::optional<std::uint64_t> k;
};
struct clone_outcome {
  attempt_result first, retry;
};
struct campaign_result {
  std::vector<clone_outcome> clones;
  std::vector<std::string> source_exception;
  std::vector<std::uint64_t> source_steps;
  bool hit_deadline = false;
  bool sources_busy_at_retry = false;
  std::array<std::uint64_t, dc::fault::kind_count> injected{};  ///< first attempt, silence separated from drop
  std::array<std::uint64_t, msg_count> by_message{};
  std::array<std::uint64_t, msg_count> observed{};  ///< with options_env::observe: messages seen per kind
  double seconds = 0;
  std::vector<std::string> violations;
};

/// Deliberate mistakes on clone rank 0, to show that the checks catch them (negative controls).
enum class sabotage { none, write_after_end, flip_after_complete };

struct options_env {
  std::chrono::milliseconds timeout{1000};
  bool verbose = false;
  sabotage sab = sabotage::none;
  bool observe = false;  ///< count every kind of message of the first attempt (campaign_result::observed)
};

/// A reusable barrier for the clone threads that keeps making transport progress while it
/// waits (so that a receive still posted after a failure would be seen writing).
struct pumping_barrier {
  explicit pumping_barrier(int n) : n_(n) {}
  template <class Pump>
  void arrive_and_wait(Pump pump) {
    std::uint64_t gen;
    {
      std::lock_guard g(mu_);
      gen = gen_;
      if (++arrived_ == n_) {
        arrived_ = 0;
        ++gen_;
        return;
      }
    }
    for (;;) {
      {
        std::lock_guard g(mu_);
        if (gen_ != gen) return;
      }
      pump();
      std::this_thread::sleep_for(1ms);
    }
  }
  std::mutex mu_;
  int n_, arrived_ = 0;
  std::uint64_t gen_ = 0;
};

template <class E>
typename E::settings settings_of(const config& c, const options_env& env) {
  typename E::settings s;
  s.timeout = env.timeout;
  s.failover_after = std::min<std::chrono::nanoseconds>(std::chrono::milliseconds(c.failover_ms), 10 * env.timeout);
  s.tag_base = c.tag_base;
  s.plan.max_piece_bytes = c.max_piece;
  if constexpr (requires { s.shard.threshold; }) s.shard.threshold = c.shard_threshold;
  if constexpr (requires { s.reconstruct.threshold; }) s.reconstruct.threshold = c.exchange_threshold;
  if constexpr (requires { s.pipeline.staging_bytes; }) s.pipeline.staging_bytes = c.staging;
  if constexpr (requires { s.check_writes; }) s.check_writes = c.check_writes;  // the model writes inside the hooks only
  return s;
}

template <class E>
campaign_result run_one(const config& c, const options_env& env) {
  using clone_t = typename E::template clone<std::vector<std::uint8_t>>;
  using source_t = typename E::template source<std::vector<std::uint8_t>>;
  campaign_result out;
  const int n = c.n, m = c.m;
  out.clones.resize(static_cast<std::size_t>(m));
  out.source_exception.resize(static_cast<std::size_t>(n));
  out.source_steps.resize(static_cast<std::size_t>(n));
  auto bp = build_plan(c, env.observe);
  auto faults = bp.plan;
  const auto roles = dc::roles::contiguous(n, m);
  const auto src_settings = settings_of<E>(c, env);
  auto clone_settings = src_settings;
  clone_settings.verify_replicas = c.verify;
  // Bounds: an attempt ends within attempt_bound; the whole run within deadline.
  const auto timeout = env.timeout;
  const auto attempt_bound = 10 * timeout + 3s;
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline = t0 + 4 * attempt_bound;

  std::atomic<int> clones_done{0};
  std::atomic<bool> hit_deadline{false};
  // Per source: in a session? and iterations completed (so the clones can wait for idle sources).
  std::vector<std::atomic<int>> src_busy(static_cast<std::size_t>(n));
  std::vector<std::atomic<std::uint64_t>> src_iter(static_cast<std::size_t>(n));
  for (auto& b : src_busy) b = 0;
  for (auto& i : src_iter) i = 0;
  pumping_barrier after_first(m), before_retry(m);
  std::atomic<bool> busy_at_retry{false};
  std::mutex mu;  // guards the fault counters below

  dc::inproc::world w(n + m);
  w.run([&](dc::inproc::communicator& raw) {
    fcomm comm(raw, faults);
    const int rank = raw.rank();
    if (rank < n) {
      const auto i = static_cast<std::size_t>(rank);
      auto guard = [&](auto&& f) {
        try {
          f();
        } catch (const std::exception& e) {
          if (out.source_exception[i].empty()) out.source_exception[i] = e.what();
        } catch (...) {
          if (out.source_exception[i].empty()) out.source_exception[i] = "a non-std exception";
        }
      };
      model mdl(c.layers, 0);
      std::optional<source_t> src;
      guard([&] { src.emplace(comm, roles, mdl.st, src_settings); });
      const std::size_t L = mdl.st.layer_count();
      int after = -1;
      for (std::uint64_t step = 0;; ++step) {
        for (std::size_t l = L; l-- > 0;) {
          if (src) guard([&] { src->before_update(l); });
          mdl.update(l, step);
          if (src) guard([&] { src->after_update(l); });
        }
        auto& md = mdl.st.metadata();
        md.data_cursor = step * 10;
        md.user.assign(c.user_meta_bytes, std::byte(step & 0xff));
        int stop[2] = {clones_done.load() == m ? 1 : 0, std::chrono::steady_clock::now() > deadline ? 1 : 0};
        dc::allreduce_sum(raw, roles.sources, std::span<int>(stop), 10);
        if (src) guard([&] { src->end_iteration(step); });
        src_busy[i] = src && src->cloning() ? 1 : 0;
        ++src_iter[i];
        if (stop[1]) {
          hit_deadline = true;
          out.source_steps[i] = step + 1;
          break;
        }
        if (stop[0] && after < 0) after = 3;
        if (after >= 0 && after-- == 0) {
          out.source_steps[i] = step + 1;
          break;
        }
        if (L == 0 || (step & 3) == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      if (src) guard([&] { src->finish(); });
      src_busy[i] = 0;
      return;
    }

    // ---- a clone rank ----
    const int j = rank - n;
    auto& res = out.clones[static_cast<std::size_t>(j)];
    model mdl(c.layers, 0xA5);
    std::optional<clone_t> dst;
    // Transport progress on this rank without touching the engine: the in-process transport
    // copies matched messages into posted receives whenever the rank tests any request.
    std::byte dummy_buf[1];
    auto dummy = raw.irecv(rank, 7, std::span<std::byte>(dummy_buf, 1));
    auto pump = [&] { (void)raw.test(dummy); };
    struct snapshot {
      std::vector<std::vector<std::uint8_t>> tensors;
      dc::metadata meta;
    };
    auto take_snapshot = [&] {
      snapshot s;
      for (auto& t : mdl.tensors) s.tensors.push_back(t);
      s.meta = mdl.st.metadata();
      return s;
    };
    auto compare = [&](const snapshot& s, attempt_result& a) {
      std::size_t flat = 0;
      for (std::size_t l = 0; l < mdl.st.layer_count(); ++l)
        for (auto& t : mdl.st.layer_tensors(l)) {
          auto& now = *t.ref;
          auto& then = s.tensors[flat];
          if (now != then) {
            std::size_t at = 0;
            while (at < now.size() && now[at] == then[at]) ++at;
            a.written_after = true;
            if (a.written_where.empty())
              a.written_where = "layer " + std::to_string(l) + " tensor '" + t.name + "' byte " + std::to_string(at);
          }
          ++flat;
        }
      if (!(mdl.st.metadata() == s.meta)) {
        a.written_after = true;
        if (a.written_where.empty()) a.written_where = "the metadata";
      }
    };
    // A mismatched layout in the first attempt: one tensor 8 bytes longer (restored before
    // the retry; the state refers to the vector, so the engine sees the new size).
    std::vector<std::uint8_t>* resized = nullptr;
    std::size_t resized_from = 0;
    if (j == c.mismatch_rank && !mdl.tensors.empty()) {
      resized = &mdl.tensors.front();
      resized_from = resized->size();
      resized->resize(resized_from + 8, 0xA5);
    }
    auto attempt = [&](attempt_result& a, bool first) {
      const auto a0 = std::chrono::steady_clock::now();
      try {
        if (!dst) dst.emplace(comm, roles, mdl.st, clone_settings);
        dst->request();
        const bool cancels = first && j == c.cancel_rank;
        if (cancels && c.cancel_after_layer < 0) dst->cancel();
        for (std::size_t l = 0; l < mdl.st.layer_count(); ++l) {
          dst->wait_layer(l);
          a.k = dst->fork_iteration();
          if (!a.k || !mdl.layer_equals(l, *a.k)) ++a.wrong_ready_layers;
          if (cancels && static_cast<int>(l) == c.cancel_after_layer) dst->cancel();
        }
        dst->wait();
        a.completed = true;
        if (first && j == 0 && env.sab == sabotage::flip_after_complete)
          for (auto& t : mdl.tensors)
            if (!t.empty()) {
              t[0] ^= 0x01;
              break;
            }
        const auto k = dst->metadata().step;
        a.k = k;
        a.bytes_ok = mdl.equals(k) && dst->metadata().data_cursor == k * 10 &&
                     dst->metadata().user == std::vector<std::byte>(c.user_meta_bytes, std::byte(k & 0xff));
        a.outcome = "completed";
        if (!first || c.report_first) {
          try {
            (void)dst->report();
          } catch (const dc::error& e) {
            a.outcome = std::string("completed(report:") + errc_str(e.kind()) + ")";
            a.what = e.what();
          }
        }
      } catch (const dc::error& e) {
        a.code = e.kind();
        a.what = e.what();
        a.outcome = errc_str(e.kind());
      } catch (const std::exception& e) {
        a.other_exception = true;
        a.what = std::string(typeid(e).name()) + ": " + e.what();
        a.outcome = "OTHER-EXCEPTION";
      } catch (...) {
        a.other_exception = true;
        a.what = "a non-std exception";
        a.outcome = "OTHER-EXCEPTION";
      }
      a.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - a0).count();
    };
    // Waits, making transport progress, until every source is out of any session for two
    // iterations in a row (bounded), and at least `at_least`: meanwhile the sources train
    // and send on.
    auto settle_window = [&](std::chrono::milliseconds at_least, std::chrono::nanoseconds bound) {
      const auto w0 = std::chrono::steady_clock::now();
      std::vector<std::uint64_t> idle_since(static_cast<std::size_t>(n), 0);
      bool idle = false;
      for (;;) {
        pump();
        const auto now = std::chrono::steady_clock::now();
        idle = true;
        for (int s = 0; s < n; ++s) {
          const auto it = src_iter[static_cast<std::size_t>(s)].load();
          if (src_busy[static_cast<std::size_t>(s)].load()) idle_since[static_cast<std::size_t>(s)] = it, idle = false;
          else if (it < idle_since[static_cast<std::size_t>(s)] + 2) idle = false;
        }
        if (now - w0 >= at_least && (idle || now - w0 >= bound)) break;
        std::this_thread::sleep_for(1ms);
      }
      return idle;
    };

    // Attempt 1, with faults.
    attempt(res.first, true);
    auto snap = take_snapshot();
    after_first.arrive_and_wait(pump);  // every clone rank's first attempt is over
    // Sabotage: a stray receive into a clone tensor, as a receive left posted after the end
    // would be; the transport fills it while this rank makes progress in the window below.
    std::byte stray[1]{};
    std::optional<dc::inproc::communicator::request_type> stray_recv, stray_send;
    if (j == 0 && env.sab == sabotage::write_after_end)
      for (auto& t : mdl.tensors)
        if (!t.empty()) {
          stray[0] = std::byte(t[0] ^ 0xFF);
          stray_recv = raw.irecv(rank, 8, std::span<std::byte>(reinterpret_cast<std::byte*>(t.data()), 1));
          stray_send = raw.isend(rank, 8, std::span<const std::byte>(stray, 1));
          break;
        }
    {
      const bool idle = settle_window(250ms, 3 * timeout + 1s);
      if (!idle) busy_at_retry = true;
    }
    compare(snap, res.first);
    if (resized) resized->resize(resized_from);
    if (stray_recv) {
      raw.cancel(*stray_recv);
      raw.cancel(*stray_send);
    }
    before_retry.arrive_and_wait([&] {
      pump();
    });
    if (j == 0) {
      std::lock_guard g(mu);
      // Phase-1 figures, then the faults off. Held (delayed, reordered) messages of the
      // first attempt may still be released later: late messages of an earlier session.
      auto inj = faults->injected();
      std::uint64_t silenced = 0;
      for (auto [idx, first] : bp.silence_rules) silenced += fired(faults->matched(idx), first, 0);
      inj[static_cast<std::size_t>(kind::drop)] -= std::min(silenced, inj[static_cast<std::size_t>(kind::drop)]);
      inj[static_cast<std::size_t>(kind::silence)] += silenced;
      out.injected = inj;
      for (std::size_t f = 0; f < c.faults.size(); ++f)
        for (auto idx : bp.fault_rules[f])
          out.by_message[static_cast<std::size_t>(c.faults[f].what)] +=
              fired(faults->matched(idx), c.faults[f].first, c.faults[f].times);
      for (std::size_t k = 0; k < bp.observers.size(); ++k)
        for (auto idx : bp.observers[k]) out.observed[k] += faults->matched(idx);
      faults->clear();
    }
    // A third rendezvous so that no clone rank retries before the faults are off.
    after_first.arrive_and_wait(pump);

    // Attempt 2: no faults, the same engine on the same ranks.
    attempt(res.retry, false);
    auto snap2 = take_snapshot();
    ++clones_done;
    {
      const auto w0 = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - w0 < 100ms) {
        pump();
        std::this_thread::sleep_for(1ms);
      }
    }
    compare(snap2, res.retry);
    raw.cancel(dummy);
    dst.reset();  // the engine goes before its communicator
  });
  out.hit_deadline = hit_deadline.load();
  out.sources_busy_at_retry = busy_at_retry.load();
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // ---- the invariants ----
  auto& v = out.violations;
  const double bound_s = std::chrono::duration<double>(attempt_bound).count();
  for (int j = 0; j < m; ++j) {
    auto& co = out.clones[static_cast<std::size_t>(j)];
    const std::string who = "clone rank " + std::to_string(j);
    for (int phase = 0; phase < 2; ++phase) {
      auto& a = phase ? co.retry : co.first;
      const std::string p = who + (phase ? " retry: " : " first attempt: ");
      if (a.other_exception) v.push_back(p + "threw something other than deepclone::error: " + a.what);
      if (a.wrong_ready_layers) v.push_back(p + std::to_string(a.wrong_ready_layers) + " layer(s) reported ready with wrong bytes");
      if (a.completed && !a.bytes_ok) v.push_back(p + "completed with wrong bytes (state or metadata of iteration " +
                                                  std::to_string(a.k.value_or(0)) + ")");
      if (a.seconds > bound_s) v.push_back(p + "took " + std::to_string(a.seconds) + " s (bound " + std::to_string(bound_s) + " s)");
      if (a.written_after) v.push_back(p + "clone tensors written after the attempt ended (" + a.written_where + ")");
    }
    if (!co.retry.completed) v.push_back(who + " retry without faults failed: " + co.retry.outcome + ": " + co.retry.what);
    else if (co.retry.outcome != "completed")
      v.push_back(who + " retry without faults: report() failed: " + co.retry.outcome + ": " + co.retry.what);
  }
  for (int i = 0; i < n; ++i) {
    auto& e = out.source_exception[static_cast<std::size_t>(i)];
    if (!e.empty()) v.push_back("source " + std::to_string(i) + " hook threw: " + e);
  }
  if (out.hit_deadline) v.push_back("the run hit its deadline (a hang)");
  if (out.sources_busy_at_retry)
    v.push_back("a source was still in a session " + std::to_string(std::chrono::duration<double>(3 * timeout + 1s).count()) +
                " s after every clone rank's first attempt had ended (a source session that does not end)");
  return out;
}

campaign_result run_config(const config& c, const options_env& env) {
  switch (c.engine) {
    case 0: return run_one<E0>(c, env);
    case 1: return run_one<E1>(c, env);
    case 2: return run_one<E2>(c, env);
    default: return run_one<E3>(c, env);
  }
}

// ---------------------------------------------------------------------------------------
// The campaign's table (the figures docs/reliability.md quotes).
struct campaign_table {
  int runs = 0, violating_runs = 0, busy_at_retry = 0;
  double seconds = 0;
  std::array<std::uint64_t, dc::fault::kind_count> injected{};
  std::array<std::uint64_t, msg_count> by_message{};
  std::map<std::string, int> first_outcomes, retry_outcomes, violation_kinds, engines;
  std::vector<std::uint64_t> violating_seeds;

  void add(const config& c, const campaign_result& r) {
    ++runs;
    seconds += r.seconds;
    ++engines[engine_name(c.engine)];
    for (int k = 0; k < dc::fault::kind_count; ++k) injected[static_cast<std::size_t>(k)] += r.injected[static_cast<std::size_t>(k)];
    for (int k = 0; k < msg_count; ++k) by_message[static_cast<std::size_t>(k)] += r.by_message[static_cast<std::size_t>(k)];
    for (auto& co : r.clones) {
      ++first_outcomes[co.first.outcome];
      ++retry_outcomes[co.retry.outcome];
    }
    if (r.sources_busy_at_retry) ++busy_at_retry;
    if (!r.violations.empty()) {
      ++violating_runs;
      violating_seeds.push_back(c.seed);
      std::set<std::string> kinds;
      for (auto& v : r.violations) kinds.insert(kind_of(v));
      for (auto& k : kinds) ++violation_kinds[k];
    }
  }
  static std::string kind_of(const std::string& v) {
    for (const char* k : {"threw something other", "reported ready with wrong bytes", "completed with wrong bytes",
                          "written after the attempt ended", "retry without faults failed", "report() failed", "hook threw",
                          "still in a session", "deadline", "took"})
      if (v.find(k) != std::string::npos) {
        std::string s = k;
        if (v.find(" first attempt: ") != std::string::npos) s = "first attempt: " + s;
        else if (v.find(" retry: ") != std::string::npos) s = "retry: " + s;
        return s;
      }
    return v;
  }
  static std::string join(const std::map<std::string, int>& m) {
    std::string s;
    for (auto& [k, c] : m) s += (s.empty() ? "" : ", ") + k + " x" + std::to_string(c);
    return s.empty() ? "-" : s;
  }
  void print() const {
    std::printf("\n=== deepclone fault campaign ===\n");
    std::printf("runs %d (%.1f s), runs violating an invariant %d\n", runs, seconds, violating_runs);
    std::printf("engines: %s\n", join(engines).c_str());
    std::printf("faults injected by kind (first attempts):");
    std::uint64_t total = 0;
    for (int k = 0; k < dc::fault::kind_count; ++k) {
      std::printf(" %s=%llu", dc::fault::kind_name(static_cast<kind>(k)), static_cast<unsigned long long>(injected[static_cast<std::size_t>(k)]));
      total += injected[static_cast<std::size_t>(k)];
    }
    std::printf(" (total %llu)\n", static_cast<unsigned long long>(total));
    std::printf("faults by message kind (rule firings, silence not included):");
    for (int k = 0; k < msg_count; ++k)
      if (by_message[static_cast<std::size_t>(k)])
        std::printf(" %s=%llu", msg_name(static_cast<msg>(k)), static_cast<unsigned long long>(by_message[static_cast<std::size_t>(k)]));
    std::printf("\n");
    std::printf("first attempts (clone ranks): %s\n", join(first_outcomes).c_str());
    std::printf("fault-free retries (clone ranks): %s\n", join(retry_outcomes).c_str());
    std::printf("runs whose sources were still in a session when the retry began: %d\n", busy_at_retry);
    std::printf("invariant violations (runs): %s\n", join(violation_kinds).c_str());
    if (!violating_seeds.empty()) {
      std::printf("violating seeds:");
      for (auto s : violating_seeds) std::printf(" %llu", static_cast<unsigned long long>(s));
      std::printf("\n");
    }
    std::fflush(stdout);
  }
};

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

/// "1-6,9,12" -> {1..6, 9, 12}
std::vector<std::uint64_t> parse_seeds(const std::string& s) {
  std::vector<std::uint64_t> out;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, ',')) {
    if (part.empty()) continue;
    auto dash = part.find('-');
    if (dash == std::string::npos) out.push_back(std::stoull(part));
    else
      for (auto a = std::stoull(part.substr(0, dash)), b = std::stoull(part.substr(dash + 1)); a <= b; ++a) out.push_back(a);
  }
  return out;
}

// The seeds CI runs (fault.campaign). A fixed list, so that a CI failure replays.
constexpr std::uint64_t ci_first_seed = 1, ci_seed_count = 60;

bool any_contains(const std::vector<std::string>& v, const std::string& part) {
  return std::any_of(v.begin(), v.end(), [&](const std::string& s) { return s.find(part) != std::string::npos; });
}

}  // namespace

TEST_CASE("fault: seeded campaign (random N, M, policies and faults, then a fault-free retry)") {
  options_env o;
  if (auto t = env("DEEPCLONE_CAMPAIGN_TIMEOUT_MS")) o.timeout = std::chrono::milliseconds(std::stoll(*t));
  o.verbose = env("DEEPCLONE_CAMPAIGN_VERBOSE").has_value();
  std::vector<std::uint64_t> seeds;
  if (auto s = env("DEEPCLONE_CAMPAIGN_SEED")) {
    seeds = {std::stoull(*s)};
    o.verbose = true;
  } else if (auto l = env("DEEPCLONE_CAMPAIGN_SEEDS")) {
    seeds = parse_seeds(*l);
  } else {
    std::uint64_t first = ci_first_seed, count = ci_seed_count;
    if (auto f = env("DEEPCLONE_CAMPAIGN_FIRST")) first = std::stoull(*f);
    if (auto r = env("DEEPCLONE_CAMPAIGN_RUNS")) count = std::stoull(*r);
    for (std::uint64_t s = first; s < first + count; ++s) seeds.push_back(s);
  }
  REQUIRE_FALSE(seeds.empty());
  const bool per_run_lines = o.verbose || seeds.size() <= 100;

  campaign_table table;
  for (auto seed : seeds) {
    const auto cfg = make_config(seed);
    if (o.verbose) std::printf("%s\n", describe(cfg).c_str());
    // A run that never ends (a wait that ignores its deadline) would otherwise be killed by
    // CTest without a word: name the seed and stop.
    std::mutex wd_mu;
    std::condition_variable wd_cv;
    bool wd_done = false;
    std::thread watchdog([&] {
      std::unique_lock lk(wd_mu);
      if (!wd_cv.wait_for(lk, 4 * (10 * o.timeout + 3s) + 30s, [&] { return wd_done; })) {
        std::printf("INVARIANT VIOLATED — replay: DEEPCLONE_CAMPAIGN_SEED=%llu tests/fault/fault.campaign\n%s\n"
                    "  - the run did not end (a hang); stopping\n",
                    static_cast<unsigned long long>(seed), describe(cfg).c_str());
        std::fflush(stdout);
        std::_Exit(3);
      }
    });
    auto r = run_config(cfg, o);
    {
      std::lock_guard lk(wd_mu);
      wd_done = true;
    }
    wd_cv.notify_all();
    watchdog.join();
    table.add(cfg, r);
    if (per_run_lines || !r.violations.empty()) {
      std::string firsts, retries;
      for (auto& co : r.clones) {
        firsts += (firsts.empty() ? "" : " ") + co.first.outcome;
        retries += (retries.empty() ? "" : " ") + co.retry.outcome;
      }
      std::printf("seed %llu: N=%d M=%d %s, %zu fault rule(s)%s: first [%s] retry [%s] %.2f s%s\n",
                  static_cast<unsigned long long>(seed), cfg.n, cfg.m, engine_name(cfg.engine), cfg.faults.size(),
                  cfg.partition ? " + silence" : "", firsts.c_str(), retries.c_str(), r.seconds,
                  r.violations.empty() ? "" : "  << VIOLATION");
    }
    if (o.verbose)
      for (std::size_t j = 0; j < r.clones.size(); ++j) {
        auto& co = r.clones[j];
        std::printf("  clone %zu first: %s %s (%.2f s)\n  clone %zu retry: %s %s (%.2f s)\n", j, co.first.outcome.c_str(),
                    co.first.what.c_str(), co.first.seconds, j, co.retry.outcome.c_str(), co.retry.what.c_str(), co.retry.seconds);
      }
    if (!r.violations.empty()) {
      std::ostringstream msg;
      msg << "INVARIANT VIOLATED — replay: DEEPCLONE_CAMPAIGN_SEED=" << seed << " tests/fault/fault.campaign"
          << (o.timeout != 1000ms ? " (with DEEPCLONE_CAMPAIGN_TIMEOUT_MS=" + std::to_string(o.timeout.count()) + ")" : "")
          << "\n" << describe(cfg) << "\n";
      for (auto& v : r.violations) msg << "  - " << v << "\n";
      for (std::size_t j = 0; j < r.clones.size(); ++j) {
        auto& co = r.clones[j];
        msg << "  clone " << j << " first: " << co.first.outcome << " " << co.first.what << "\n";
        msg << "  clone " << j << " retry: " << co.retry.outcome << " " << co.retry.what << "\n";
      }
      std::printf("%s", msg.str().c_str());
      std::fflush(stdout);
      CHECK_MESSAGE(r.violations.empty(), "seed " << seed << " violated an invariant (details above)");
    }
  }
  table.print();
  CHECK(table.violating_runs == 0);
}

TEST_CASE("fault: campaign checks: a fault-free run passes, and a stray write or a wrong byte is caught") {
  config c = make_config(1);
  c.n = 2;
  c.m = 2;
  c.engine = 0;
  c.layers = {{"l0", {{"w", 5000}, {"b", 40}}}, {"l1", {{"w", 70001}}}};
  c.faults.clear();
  c.partition.reset();
  c.cancel_rank = -1;
  c.mismatch_rank = -1;
  c.verify = false;
  options_env o;
  if (auto t = env("DEEPCLONE_CAMPAIGN_TIMEOUT_MS")) o.timeout = std::chrono::milliseconds(std::stoll(*t));
  auto show = [&](const campaign_result& r) {
    std::string s;
    for (auto& v : r.violations) s += v + "; ";
    return s;
  };
  {
    auto r = run_config(c, o);  // positive control: no faults, no mistakes, no violation
    CHECK_MESSAGE(r.violations.empty(), show(r));
  }
  {
    o.sab = sabotage::write_after_end;
    auto r = run_config(c, o);
    CHECK_MESSAGE(any_contains(r.violations, "clone rank 0 first attempt: clone tensors written after the attempt ended"), show(r));
  }
  {
    o.sab = sabotage::flip_after_complete;
    auto r = run_config(c, o);
    CHECK_MESSAGE(any_contains(r.violations, "clone rank 0 first attempt: completed with wrong bytes"), show(r));
  }
}

TEST_CASE("fault: campaign tag map: every message kind the campaign targets is seen on its tags") {
  // A fault-free session with exchange, verify_replicas, a report, and one corrupt piece (so
  // that a refetch happens): every kind but cancel and layout (failures only) must be seen.
  config c = make_config(1);
  c.n = 2;
  c.m = 2;
  c.engine = 0;
  c.layers = {{"l0", {{"w", 70001}, {"b", 40}}}, {"l1", {{"w", 150003}, {"m", 3001}}}};
  c.shard_threshold = 16 * 1024;
  c.exchange_threshold = 4 * 1024;
  c.partition.reset();
  c.cancel_rank = -1;
  c.mismatch_rank = -1;
  c.verify = true;
  c.report_first = true;
  fault_spec f;
  f.action = kind::corrupt;
  f.what = msg::data;
  f.layer = 1;
  f.from = 1;
  f.bytes = {0, 7};
  c.faults = {f};
  options_env o;
  if (auto t = env("DEEPCLONE_CAMPAIGN_TIMEOUT_MS")) o.timeout = std::chrono::milliseconds(std::stoll(*t));
  o.observe = true;
  auto r = run_config(c, o);
  auto seen = [](const campaign_result& x) {
    std::string s;
    for (int k = 0; k < msg_count; ++k)
      s += std::string(msg_name(static_cast<msg>(k))) + "=" + std::to_string(x.observed[static_cast<std::size_t>(k)]) + " ";
    for (auto& co : x.clones) s += "| " + co.first.outcome + " " + co.first.what + " ";
    return s;
  };
  INFO(seen(r));
  for (auto m : {msg::data, msg::header, msg::exch_data, msg::exch_header, msg::request, msg::decision, msg::meta_header,
                 msg::metadata, msg::status, msg::summary, msg::ack, msg::refetch, msg::refetch_data, msg::refetch_header,
                 msg::digest}) {
    CAPTURE(msg_name(m));
    CHECK(r.observed[static_cast<std::size_t>(m)] > 0);
  }
  CHECK(r.injected[static_cast<std::size_t>(kind::corrupt)] == 1);
  CHECK_MESSAGE(r.violations.empty(), (r.violations.empty() ? std::string() : r.violations.front()));
  // Cancel (a clone rank gives up after its first layer, while the metadata is held back)
  // and layout (a refused clone).
  fault_spec hold;
  hold.action = kind::delay;
  hold.what = msg::metadata;
  hold.from = 0;
  hold.hold_ms = 500;
  c.faults = {hold};
  c.verify = false;
  c.cancel_rank = 0;
  c.cancel_after_layer = 0;
  auto rc = run_config(c, o);
  INFO(seen(rc));
  CHECK(rc.observed[static_cast<std::size_t>(msg::cancel)] > 0);
  CHECK(rc.clones[0].first.code == dc::errc::cancelled);
  CHECK_MESSAGE(rc.violations.empty(), (rc.violations.empty() ? std::string() : rc.violations.front()));
  c.faults.clear();
  c.cancel_rank = -1;
  c.mismatch_rank = 1;
  auto rl = run_config(c, o);
  INFO(seen(rl));
  CHECK(rl.observed[static_cast<std::size_t>(msg::layout)] > 0);
  for (auto& co : rl.clones) CHECK(co.first.code == dc::errc::layout_mismatch);
  CHECK_MESSAGE(rl.violations.empty(), (rl.violations.empty() ? std::string() : rl.violations.front()));
}
