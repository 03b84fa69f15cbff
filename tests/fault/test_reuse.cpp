// The promise after the happy path (issue 10): repeated forks on the same ranks, clones
// that are cancelled, fail or vanish, hostile bytes, tensors written outside their hooks or
// resized. Each case is a regression test that failed before its fix. Every run checks that
// the sources never throw from a hook and train on, and every error is a deepclone::error
// whose what() reads "deepclone: <errc name>: ..." with the prefix once.
#include "harness.hpp"

#include <sys/resource.h>

using namespace faultharness;
using dc::fault::kind;
using dc::fault::rule;

namespace {

constexpr int tb = 1000;
constexpr int layers = 3;  // base_spec()
int layer_tag(int l, int which) { return tb + 16 + 4 * l + which; }  // first session's tag block
int block_tag(int which) { return tb + 16 + 4 * layers + which; }     // 0 meta header, 1 meta, 2/3 refetch data/header

using clone_t = cloning::clone<std::vector<std::uint8_t>>;
using source_t = cloning::source<std::vector<std::uint8_t>>;

/// What a source's trainer may do besides its updates (the forward pass of iteration `step`).
struct source_ctx {
  int i;
  std::uint64_t step;
  model& mdl;
  fcomm& comm;
  source_t* src;
};

struct world_options {
  int n = 2, m = 1;
  cloning::settings settings = small_settings();
  std::shared_ptr<dc::fault::plan> faults = std::make_shared<dc::fault::plan>();
  std::function<void(source_ctx&)> forward;                                   ///< before the updates
  std::function<bool(int i, std::uint64_t step, std::size_t l)> updates;      ///< default: every layer
  std::chrono::seconds deadline{30};
};

/// A clone rank's part: returns "" when it saw what it should, else what went wrong.
using clone_body = std::function<std::string(int j, fcomm& comm, const dc::roles& roles, model& mdl)>;

struct world_result {
  std::vector<std::string> source_thrown, clone_outcome;
  std::vector<std::uint64_t> completed, failed, refused;
  std::vector<std::optional<dc::failure>> last_error;
  bool deadline_hit = false;
};

/// N sources training until every clone body returned (then 3 more steps), M clone bodies.
world_result run_world(const world_options& o, const clone_body& body) {
  world_result out;
  out.source_thrown.resize(o.n);
  out.clone_outcome.resize(o.m);
  out.completed.resize(o.n);
  out.failed.resize(o.n);
  out.refused.resize(o.n);
  out.last_error.resize(o.n);
  const auto roles = dc::roles::contiguous(o.n, o.m);
  std::atomic<int> done{0};
  const auto deadline = std::chrono::steady_clock::now() + o.deadline;
  dc::inproc::world w(o.n + o.m);
  w.run([&](dc::inproc::communicator& raw) {
    fcomm comm(raw, o.faults);
    const int rank = raw.rank();
    if (rank >= o.n) {
      model mdl(base_spec(), 0xA5);
      auto& res = out.clone_outcome[rank - o.n];
      try {
        res = body(rank - o.n, comm, roles, mdl);
      } catch (const std::exception& e) {
        res = std::string("unexpected exception from the clone body: ") + e.what();
      }
      ++done;
      return;
    }
    model mdl(base_spec(), 0);
    auto guard = [&](auto&& f) {
      try {
        f();
      } catch (const std::exception& e) {
        if (out.source_thrown[rank].empty()) out.source_thrown[rank] = e.what();
      }
    };
    std::optional<source_t> src;
    guard([&] { src.emplace(comm, roles, mdl.st, o.settings); });
    int after = -1;
    for (std::uint64_t step = 0;; ++step) {
      source_ctx ctx{rank, step, mdl, comm, src ? &*src : nullptr};
      if (o.forward) o.forward(ctx);
      for (std::size_t l = mdl.st.layer_count(); l-- > 0;) {
        if (o.updates && !o.updates(rank, step, l)) continue;
        if (src) guard([&] { src->before_update(l); });
        mdl.update(l, step);
        if (src) guard([&] { src->after_update(l); });
      }
      mdl.st.metadata().data_cursor = step * 10;
      int stop[2] = {done.load() == o.m ? 1 : 0, std::chrono::steady_clock::now() > deadline ? 1 : 0};
      dc::allreduce_sum(raw, roles.sources, std::span<int>(stop), 10);
      if (src) guard([&] { src->end_iteration(step); });
      if (stop[1]) {
        out.deadline_hit = true;
        break;
      }
      if (stop[0] && after < 0) after = 3;
      if (after >= 0 && after-- == 0) break;
    }
    if (src) {
      guard([&] { src->finish(); });
      out.completed[rank] = src->sessions_completed();
      out.failed[rank] = src->sessions_failed();
      out.refused[rank] = src->sessions_refused();
      out.last_error[rank] = src->last_error();
    }
  });
  return out;
}

/// The world's invariants: sources never threw and ran to the end; every clone body passed.
void check_world(const world_result& r) {
  CHECK_FALSE(r.deadline_hit);
  for (std::size_t i = 0; i < r.source_thrown.size(); ++i) {
    INFO("source " << i);
    CHECK(r.source_thrown[i] == "");
  }
  for (std::size_t j = 0; j < r.clone_outcome.size(); ++j) {
    INFO("clone rank " << j);
    CHECK(r.clone_outcome[j] == "");
  }
}

/// "" when `e` reads "deepclone: <name of its code>: ..." with the prefix once.
std::string well_formed(const dc::error& e) {
  const std::string w = e.what(), want = std::string("deepclone: ") + dc::errc_name(e.kind()) + ": ";
  if (w.rfind(want, 0) != 0) return "message does not start with '" + want + "': " + w;
  if (w.find("deepclone: ", 1) != std::string::npos) return "doubled prefix: " + w;
  return "";
}

/// Requests and waits; "" if the clone holds iteration k exactly.
std::string clone_once(clone_t& dst, model& mdl) {
  try {
    dst.request();
    dst.wait();
  } catch (const dc::error& e) {
    return std::string("clone failed: ") + e.what();
  }
  const auto k = dst.metadata().step;
  if (!mdl.equals(k)) return "clone completed with bytes that are not iteration " + std::to_string(k);
  if (dst.metadata().data_cursor != k * 10) return "metadata of another iteration";
  return "";
}

/// Runs `f`, expecting a deepclone::error of `code` whose message contains every `parts`.
template <class F>
std::string expect_error(F&& f, dc::errc code, std::initializer_list<const char*> parts = {},
                         std::initializer_list<const char*> absent = {}) {
  try {
    f();
  } catch (const dc::error& e) {
    if (auto bad = well_formed(e); !bad.empty()) return bad;
    const std::string w = e.what();
    if (e.kind() != code) return std::string("expected ") + dc::errc_name(code) + ", got: " + w;
    for (auto p : parts)
      if (w.find(p) == std::string::npos) return std::string("message lacks '") + p + "': " + w;
    for (auto p : absent)
      if (w.find(p) != std::string::npos) return std::string("message should not say '") + p + "': " + w;
    return "";
  }
  return std::string("expected ") + dc::errc_name(code) + ", but it succeeded";
}

/// Tensor bytes of the whole clone state, for "nothing written after failure".
std::vector<std::uint8_t> snapshot(model& mdl) {
  std::vector<std::uint8_t> all;
  for (auto& t : mdl.tensors) all.insert(all.end(), t.begin(), t.end());
  return all;
}

}  // namespace

TEST_CASE("reuse: a duplicated message of one session is never taken by the next ones") {
  // N = 1: no other source could repair a stream left off by one.
  for (int tag : {layer_tag(0, 1), layer_tag(0, 0), layer_tag(1, 1), block_tag(0), tb + 1}) {
    CAPTURE(tag);
    world_options o;
    o.n = 1;
    o.faults->add({.action = kind::duplicate, .from = 0, .tag_lo = tag, .first = 1, .times = 1});
    auto r = run_world(o, [](int, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
      clone_t dst(comm, roles, mdl.st, small_settings());
      for (int round = 0; round < 4; ++round)
        if (auto bad = clone_once(dst, mdl); !bad.empty()) return "round " + std::to_string(round) + ": " + bad;
      return "";
    });
    check_world(r);
    CHECK(r.completed[0] == 4);
  }
}

TEST_CASE("reuse: after a cancel mid-transfer the next request on the same ranks succeeds") {
  world_options o;
  o.n = 1;
  auto r = run_world(o, [](int, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
    clone_t dst(comm, roles, mdl.st, small_settings());
    for (int round = 0; round < 3; ++round) {
      dst.request();
      dst.wait_layer(2);  // updated first: the other layers are still on their way
      dst.cancel();
      auto before = snapshot(mdl);
      std::this_thread::sleep_for(50ms);
      if (snapshot(mdl) != before) return "a clone tensor was written after cancel()";
      if (auto bad = clone_once(dst, mdl); !bad.empty()) return "round " + std::to_string(round) + ": " + bad;
    }
    return "";
  });
  check_world(r);
}

TEST_CASE("reuse: a peer clone rank that cancels is named as such, and both ranks then succeed") {
  world_options o;
  o.n = 1;
  o.m = 2;
  // The first session's first message of layers 0-1 to clone rank 1 is held back, so that
  // clone rank 1 cannot complete before clone rank 0 cancels (under load it did: a race
  // the test lost, not the library). It arrives late, in the next session: skipped there.
  o.faults->add({.action = kind::delay, .from = 0, .to = 2, .tag_lo = layer_tag(0, 0), .tag_hi = layer_tag(1, 3),
                 .first = 1, .times = 1, .hold = 1500ms});
  auto r = run_world(o, [](int j, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
    clone_t dst(comm, roles, mdl.st, small_settings(3s));
    if (j == 0) {
      dst.request();
      dst.wait_layer(2);
      dst.cancel();
    } else {
      auto bad = expect_error([&] {
        dst.request();
        dst.wait();
      }, dc::errc::cancelled, {"peer clone rank"}, {"source 0 failed"});
      if (!bad.empty()) return bad;
    }
    return clone_once(dst, mdl);
  });
  check_world(r);
}

TEST_CASE("reuse: a clone engine that goes away mid-transfer does not hold the sources") {
  // Layer 1 is frozen on the sources (never updated: it keeps its initial zeros), so its
  // window never closes by itself; its bytes reach the first clone late.
  for (bool vanish : {false, true}) {
    CAPTURE(vanish);  // true: the clone rank is silenced first, so its goodbye never arrives
    world_options o;
    // Bounds with room for a loaded TSan build (CI saw the earlier 1 s/1.5 s/5 s bounds fail
    // once there): layer 1 is held 3 s, longer than layers 0 and 2 may take; the sources drop
    // the vanished session after 2 s without progress; the second clone waits up to 10 s
    // without progress, which covers that wait for the sources.
    o.settings = small_settings(2s);
    o.updates = [](int, std::uint64_t, std::size_t l) { return l != 1; };
    o.faults->add({.action = kind::delay, .to = 2, .tag_lo = layer_tag(1, 0), .first = 1, .times = 0, .hold = 3000ms});
    auto faults = o.faults;
    auto r = run_world(o, [&](int, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
      {
        clone_t first(comm, roles, mdl.st, small_settings(3s));
        first.request();
        first.wait_layer(2);
        if (first.layer_ready(1)) return "layer 1 arrived despite the delay: the test does not test";
        if (vanish) faults->silence(comm.rank());
      }
      faults->clear();
      clone_t second(comm, roles, mdl.st, small_settings(10s));
      try {
        second.request();
        second.wait();
      } catch (const dc::error& e) {
        return std::string("the next clone failed: ") + e.what();
      }
      const auto k = second.metadata().step;
      if (!mdl.layer_equals(0, k) || !mdl.layer_equals(2, k)) return "wrong bytes";
      for (auto& t : mdl.st.layer_tensors(1))
        if (std::any_of(t.ref->begin(), t.ref->end(), [](std::uint8_t b) { return b != 0; })) return "wrong bytes in the frozen layer";
      return "";
    });
    check_world(r);
    CHECK(r.failed[0] >= 1);
    CHECK(r.completed[0] == 1);
  }
}

TEST_CASE("poll: a clone that only polls fails over from a silent source") {
  world_options o;
  o.faults->silence(1);
  auto r = run_world(o, [](int, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
    auto s = small_settings(3s);
    s.failover_after = 300ms;
    clone_t dst(comm, roles, mdl.st, s);
    dst.request();
    const auto until = std::chrono::steady_clock::now() + 10s;
    try {
      while (!dst.poll()) {
        if (std::chrono::steady_clock::now() > until) return "poll() never completed nor failed";
        std::this_thread::sleep_for(1ms);
      }
    } catch (const dc::error& e) {
      return std::string("failed instead of failing over: ") + e.what();
    }
    return mdl.equals(dst.metadata().step) ? "" : "wrong bytes";
  });
  check_world(r);
}

TEST_CASE("outside hooks: a piece served again must be what it was at iteration k") {
  // A batch-norm-like mistake: the forward pass writes fc0.weight (layer 0, updated last).
  // Source 0's copy of it is corrupted on the wire, so the clone asks source 1 again; the
  // refetch request is delayed so that source 1 has run its next forward pass by then.
  for (bool verify : {false, true}) {
    CAPTURE(verify);
    world_options o;
    o.forward = [](source_ctx& c) {
      auto& t = c.mdl.tensors[0];
      for (std::size_t b = 0; b < t.size(); ++b) t[b] = value(c.step + 100, 0, b);
    };
    o.faults->add({.action = kind::corrupt, .from = 0, .tag_lo = layer_tag(0, 0), .first = 1, .times = 1});
    o.faults->add({.action = kind::delay, .from = 2, .tag_lo = tb + 9, .first = 1, .times = 0, .hold = 200ms});
    auto r = run_world(o, [&](int, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
      auto s = small_settings(3s);
      s.verify_replicas = verify;
      clone_t dst(comm, roles, mdl.st, s);
      return expect_error([&] {
        dst.request();
        dst.wait();
      }, dc::errc::outside_hooks, {"fc0.weight", "iteration", "before_update and after_update"});
    });
    check_world(r);
  }
}

TEST_CASE("outside hooks: settings.check_writes names the tensor and the rule") {
  for (bool write : {false, true}) {
    CAPTURE(write);
    world_options o;
    o.n = 1;
    o.settings.check_writes = true;
    if (write)
      o.forward = [](source_ctx& c) {
        if (c.step == 2) c.mdl.tensors[0][7] ^= 1;
      };
    auto r = run_world(o, [](int, fcomm&, const dc::roles&, model&) -> std::string {
      std::this_thread::sleep_for(100ms);
      return "";
    });
    if (!write) {
      check_world(r);
      continue;
    }
    INFO(r.source_thrown[0]);
    CHECK(contains(r.source_thrown[0], "deepclone: outside_hooks: "));
    CHECK(contains(r.source_thrown[0], "fc0.weight"));
    CHECK(contains(r.source_thrown[0], "after_update(0) of iteration 1 and before_update(0) of iteration 2"));
    CHECK(contains(r.source_thrown[0], "only the code between a layer's before_update and after_update may write its tensors"));
  }
}

TEST_CASE("hostile: a flipped length in the metadata header is a clean error, and the retry succeeds") {
  world_options o;
  // The top byte of the header's length field (after magic, session, iteration).
  o.faults->add({.action = kind::corrupt, .from = 0, .tag_lo = block_tag(0), .first = 1, .times = 1, .bytes = {27}, .mask = 0x40});
  auto r = run_world(o, [](int, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
    clone_t dst(comm, roles, mdl.st, small_settings(3s));
    const auto t0 = std::chrono::steady_clock::now();
    auto bad = expect_error([&] {
      dst.request();
      dst.wait();
    }, dc::errc::corrupt_message, {"metadata header"});
    if (!bad.empty()) return bad;
    if (std::chrono::steady_clock::now() - t0 > 2s) return "the failure took longer than the timeout";
    return clone_once(dst, mdl);
  });
  check_world(r);
  // Source 0 served both sessions. It counts the corrupted one as failed (the clone's
  // cancel), or as completed when the clone had acknowledged every layer before it read
  // the metadata header (the source's part was delivered); which, depends on timing.
  CHECK(r.completed[0] + r.failed[0] >= 2);
}

TEST_CASE("hostile: a flipped layout length in a refusal allocates nothing large") {
  world_options o;
  // The refusal's layout_bytes field: magic, verdict, session, iteration, epoch, nonce.
  o.faults->add({.action = kind::corrupt, .from = 0, .tag_lo = tb + 1, .first = 1, .times = 1, .bytes = {4 + 4 + 8 + 8 + 4 + 8 + 3}, .mask = 0x10});
  auto r = run_world(o, [](int, fcomm& comm, const dc::roles& roles, model&) -> std::string {
    model other({{"other", {{"w", 10}}}}, 0);
    clone_t dst(comm, roles, other.st, small_settings());
    rusage before{}, after{};
    getrusage(RUSAGE_SELF, &before);
    std::string bad;
    try {
      dst.request();
      dst.wait();
      bad = "a mismatched clone completed";
    } catch (const dc::error& e) {
      bad = well_formed(e);
    }
    getrusage(RUSAGE_SELF, &after);
    if (after.ru_maxrss - before.ru_maxrss > 128 * 1024) return "peak memory grew by " + std::to_string(after.ru_maxrss - before.ru_maxrss) + " KiB";
    return bad;
  });
  check_world(r);
}

TEST_CASE("hostile: oversized and garbage control messages never reach a source hook") {
  world_options o;
  o.forward = [](source_ctx& c) {
    if (c.i != 1 || c.step != 1) return;
    std::vector<std::byte> junk(2048, std::byte{0x5a});  // twice a control receive buffer
    for (int tag : {tb + 5, tb + 12}) c.comm.inner().wait(*std::make_unique<dc::inproc::communicator::request_type>(
                                          c.comm.inner().isend(2, tag, std::span<const std::byte>(junk))));
  };
  auto r = run_world(o, [](int, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
    std::vector<std::byte> junk(2048, std::byte{0x5a}), small(40, std::byte{0x33});
    for (int s : roles.sources)
      for (int tag : {tb + 0, tb + 7, tb + 8, tb + 9})
        for (auto* b : {&junk, &small}) comm.inner().wait(*std::make_unique<dc::inproc::communicator::request_type>(
                                            comm.inner().isend(s, tag, std::span<const std::byte>(*b))));
    auto s = small_settings(3s);
    s.verify_replicas = true;
    clone_t dst(comm, roles, mdl.st, s);
    if (auto bad = clone_once(dst, mdl); !bad.empty()) return bad;
    return clone_once(dst, mdl);  // and the sources still listen: the garbage ack is long gone
  });
  check_world(r);
}

TEST_CASE("hostile: a truncated status or digest does not fail a complete clone") {
  for (int tag : {tb + 5, tb + 12}) {
    CAPTURE(tag);
    world_options o;
    o.faults->add({.action = kind::truncate, .from = 1, .tag_lo = tag, .first = 1, .times = 1, .keep = 10});
    auto r = run_world(o, [](int, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
      auto s = small_settings(2s);
      s.verify_replicas = true;
      s.failover_after = 300ms;
      clone_t dst(comm, roles, mdl.st, s);
      if (auto bad = clone_once(dst, mdl); !bad.empty()) return bad;
      try {
        auto rep = dst.report();
        if (rep.sources.size() != 2) return "report lists " + std::to_string(rep.sources.size()) + " sources";
      } catch (const dc::error& e) {
        return std::string("report() failed: ") + e.what();
      }
      return "";
    });
    check_world(r);
  }
}

TEST_CASE("resize: a source tensor resized after the decision fails the clone, not the source") {
  world_options o;
  o.n = 1;
  o.forward = [](source_ctx& c) {
    if (c.src && c.src->fork_iteration() && c.mdl.tensors[2].size() == 200003) c.mdl.tensors[2].resize(100000);
  };
  auto r = run_world(o, [](int, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
    clone_t dst(comm, roles, mdl.st, small_settings(3s));
    return expect_error([&] {
      dst.request();
      dst.wait();
    }, dc::errc::layout_mismatch, {"fc1.weight", "must not change shape"});
  });
  check_world(r);
  REQUIRE(r.last_error[0]);
  CHECK(r.last_error[0]->code == dc::errc::layout_mismatch);
}

TEST_CASE("resize: a clone tensor resized after request() fails before a byte lands outside it") {
  for (std::size_t to : {std::size_t{100000}, std::size_t{400000}}) {
    CAPTURE(to);
    world_options o;  // fc1's bytes arrive late, so the resize surely comes first
    o.faults->add({.action = kind::delay, .to = 2, .tag_lo = layer_tag(1, 0), .first = 1, .times = 0, .hold = 300ms});
    auto r = run_world(o, [&](int, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
      clone_t dst(comm, roles, mdl.st, small_settings(3s));
      return expect_error([&] {
        dst.request();
        while (!dst.fork_iteration()) dst.poll();
        mdl.tensors[2].resize(to);
        dst.wait();
      }, dc::errc::layout_mismatch, {"fc1.weight", "resized or moved"});
    });
    check_world(r);
  }
}

TEST_CASE("resize: a tensor added to the clone's state after request() fails naming the count, not silently unfilled") {
  world_options o;  // fc1's bytes arrive late, so the change surely comes first
  o.faults->add({.action = kind::delay, .to = 2, .tag_lo = layer_tag(1, 0), .first = 1, .times = 0, .hold = 300ms});
  auto r = run_world(o, [&](int, fcomm& comm, const dc::roles& roles, model& mdl) -> std::string {
    std::vector<std::uint8_t> extra(64, 0);
    clone_t dst(comm, roles, mdl.st, small_settings(3s));
    return expect_error([&] {
      dst.request();
      while (!dst.fork_iteration()) dst.poll();
      mdl.st.add_layer("late", {{"w", extra}});
      dst.wait();
    }, dc::errc::layout_mismatch, {"tensors, not the", "at request()"});
  });
  check_world(r);
}

TEST_CASE("errors: a refused clone is visible on the sources and says what is missing") {
  world_options o;
  o.faults->add({.action = kind::drop, .from = 0, .tag_lo = tb + 2, .first = 1, .times = 1});  // the sources' layout
  auto r = run_world(o, [](int, fcomm& comm, const dc::roles& roles, model&) -> std::string {
    model other({{"other", {{"w", 10}}}}, 0);
    clone_t dst(comm, roles, other.st, small_settings());
    return expect_error([&] {
      dst.request();
      dst.wait();
    }, dc::errc::timeout, {"the sources' layout"}, {"the metadata"});
  });
  check_world(r);
  CHECK(r.refused[0] == 1);
  REQUIRE(r.last_error[0]);
  CHECK(r.last_error[0]->code == dc::errc::layout_mismatch);
}

TEST_CASE("errors: a negative tag_base is an invalid argument, not advice to lower it") {
  dc::inproc::world w(2);
  std::vector<std::string> bad(2);
  w.run([&](dc::inproc::communicator& raw) {
    fcomm comm(raw, std::make_shared<dc::fault::plan>());
    model mdl(base_spec(), 0);
    auto s = small_settings();
    s.tag_base = -5;
    const auto roles = dc::roles::contiguous(1, 1);
    bad[raw.rank()] = expect_error([&] {
      if (raw.rank() == 0) {
        source_t src(comm, roles, mdl.st, s);
      } else {
        clone_t dst(comm, roles, mdl.st, s);
        dst.request();
      }
    }, dc::errc::invalid_argument, {"tag_base"}, {"lower"});
  });
  CHECK(bad[0] == "");
  CHECK(bad[1] == "");
}
