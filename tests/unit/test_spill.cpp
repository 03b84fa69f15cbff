// pipeline::spill (issue 11, item 4): the sources never wait for a slow link. Over emulated
// links slow enough that a clone needs ~100 iterations' time, a spill source copies what it
// still owes of a layer before overwriting it and trains on; the clone is bitwise the state
// of k, the sources' own state is bitwise what training alone makes of it, and a piece
// corrupted on the wire is served again from the spill copy. No timing is asserted beyond
// "the sources ran on past k+1 while the transfer was in flight", which a window source
// cannot do (it waits at before_update of k+1 until every clone rank verified the layer).
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>
#include <deepclone/emulated_link.hpp>
#include <deepclone/fault_injection.hpp>
#include <deepclone/inproc.hpp>

#include "../support/replica.hpp"

#include <atomic>
#include <chrono>
#include <thread>

namespace dc = deepclone;
using dc::testing::replica;
using namespace std::chrono_literals;

namespace {

using link = dc::emulated_link<dc::inproc::communicator>;
using fcomm = dc::faulty<link>;
using spill_engine = dc::engine<fcomm, dc::shard::split_even, dc::pipeline::spill, dc::reconstruct::scatter_exchange>;

struct outcome {
  bool clone_bitwise = false, sources_bitwise = true;
  std::string clone_error;
  std::vector<std::uint64_t> spilled;  ///< per source
  dc::report rep;
};

/// N spill sources train (1 ms iterations) while M clone ranks fork over 5 MB/s links
/// (the ~0.9 MB replica takes ~0.2 s per clone rank); `faults` hits the engine's messages.
outcome fork_over_slow_links(int n, int m, spill_engine::settings s, std::shared_ptr<dc::fault::plan> faults) {
  outcome out;
  out.spilled.resize(static_cast<std::size_t>(n));
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world w(n + m);
  auto fabric = std::make_shared<dc::link_fabric<>>(n + m, dc::link_config{5e6, 0ns});
  std::atomic<int> done{0};
  w.run([&](dc::inproc::communicator& raw) {
    link paced(raw, fabric);
    fcomm c(paced, faults);
    replica r;
    if (raw.rank() < n) {
      replica expected;
      spill_engine::source src(c, roles, r.state, s);
      for (std::uint64_t step = 0;; ++step) {
        r.iterate(&src, step);
        expected.become(step);
        if (r.bytes() != expected.bytes()) out.sources_bitwise = false;
        src.end_iteration(step);
        int d[2] = {done.load(), src.cloning() ? 1 : 0};  // the trainer's own collective (unpaced)
        dc::allreduce_sum(raw, roles.sources, std::span<int>(d, 2), 12);
        if ((d[0] == m * n && d[1] == 0) || step > 20000) break;
        std::this_thread::sleep_for(1ms);
      }
      src.finish();
      out.spilled[static_cast<std::size_t>(raw.rank())] = src.bytes_spilled();
    } else {
      spill_engine::clone dst(c, roles, r.state, s);
      try {
        dst.request();
        dst.wait();
        replica want;
        want.become(*dst.fork_iteration());
        out.clone_bitwise = r.bytes() == want.bytes();
        if (raw.rank() == n) out.rep = dst.report();
      } catch (const dc::error& e) {
        out.clone_error = e.what();
      }
      ++done;
    }
  });
  return out;
}

spill_engine::settings slow_settings() {
  auto s = dc::testing::small_settings::make<spill_engine::settings>();
  s.pipeline.inflight_bytes = 64 * 1024;  // about one piece on the wire at a time
  return s;
}

}  // namespace

TEST_CASE("spill: over slow links the sources train on, the clone is bitwise k, and the spill was used") {
  for (auto [n, m] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{3, 2}}) {
    CAPTURE(n);
    CAPTURE(m);
    auto res = fork_over_slow_links(n, m, slow_settings(), std::make_shared<dc::fault::plan>());
    CHECK(res.clone_error == "");
    CHECK(res.clone_bitwise);
    CHECK(res.sources_bitwise);
    for (auto b : res.spilled) CHECK(b > 0);
    // A window source waits at before_update of k+1 until the layer is verified everywhere;
    // a spill source runs on while the ~0.2 s transfer is in flight.
    INFO(dc::to_string(res.rep));
    for (auto& f : res.rep.sources) CHECK(f.fork_iterations > 3);
  }
}

TEST_CASE("spill: a spill buffer too small for a layer makes the source wait instead, still bitwise") {
  auto s = slow_settings();
  s.pipeline.spill_bytes = 1;
  auto res = fork_over_slow_links(2, 1, s, std::make_shared<dc::fault::plan>());
  CHECK(res.clone_error == "");
  CHECK(res.clone_bitwise);
  CHECK(res.sources_bitwise);
  for (auto b : res.spilled) CHECK(b == 0);
}

TEST_CASE("spill: a piece corrupted on the wire after its layer was overwritten is served again from the spill copy") {
  // Layer 0 ("embed", updated last, ~0.56 MB) is final last and queued when k ends: its
  // third data message to the clone (~40 ms of link time after k) reaches it long after
  // the sources (1 ms iterations) overwrote layer 0 in k+1.
  auto faults = std::make_shared<dc::fault::plan>();
  const int layer0_data_tag = 1000 + 16 + 0;  // first session's tag block, layer 0, data
  faults->add({.action = dc::fault::kind::corrupt, .from = 0, .tag_lo = layer0_data_tag, .first = 3, .times = 1});
  auto res = fork_over_slow_links(1, 1, slow_settings(), faults);
  CHECK(res.clone_error == "");
  CHECK(res.clone_bitwise);
  CHECK(res.sources_bitwise);
  CHECK(res.spilled[0] > 0);
  CHECK(res.rep.refetched_groups >= 1);
}

TEST_CASE("spill: what is still queued when k ends leaves in the clone's forward order (send_order), or as final") {
  // The sources update layers last-first, so layer 0 ("embed", 0.56 MB, ~0.11 s at 5 MB/s)
  // is final last. With send_order::forward_pass the queue left at the end of k is sent
  // layer 0 first and the clone's forward pass can start before the rest arrived; with
  // as_final it leaves last. The link serialises a source's sends in the order posted, so
  // the order of the layers' ready times is not a matter of timing noise: layer 4 ("head",
  // 0.27 MB) is ~0.05 s of link time after or before layer 0.
  for (auto [n, m] : {std::pair{1, 1}, std::pair{2, 2}}) {
    CAPTURE(n);
    CAPTURE(m);
    for (auto order : {dc::pipeline::send_order::forward_pass, dc::pipeline::send_order::as_final}) {
      const bool forward = order == dc::pipeline::send_order::forward_pass;
      CAPTURE(forward);
      auto s = slow_settings();
      s.pipeline.order = order;
      auto res = fork_over_slow_links(n, m, s, std::make_shared<dc::fault::plan>());
      REQUIRE(res.clone_error == "");
      CHECK(res.clone_bitwise);
      CHECK(res.sources_bitwise);
      INFO(dc::to_string(res.rep));
      REQUIRE(res.rep.layer_ready_s.size() == 5);
      const auto& ready = res.rep.layer_ready_s;
      if (forward) {
        CHECK(ready[0] < ready[4]);
        CHECK(res.rep.first_layer_s < res.rep.readiness_s);
      } else {
        CHECK(ready[0] > ready[4]);
      }
    }
  }
}

namespace {

/// A communicator that counts the tests it is asked for; every call passes through.
template <class Comm>
struct counted {
  using request_type = typename Comm::request_type;
  Comm inner;
  std::shared_ptr<std::uint64_t> tests = std::make_shared<std::uint64_t>(0);

  int rank() const { return inner.rank(); }
  int size() const { return inner.size(); }
  int max_tag() const { return dc::detail::max_tag_of(inner); }
  request_type isend(int to, int tag, std::span<const std::byte> b) { return inner.isend(to, tag, b); }
  request_type irecv(int from, int tag, std::span<std::byte> b) { return inner.irecv(from, tag, b); }
  std::optional<std::size_t> test(request_type& r) {
    ++*tests;
    return inner.test(r);
  }
  std::size_t wait(request_type& r) { return inner.wait(r); }
  void cancel(request_type& r) { inner.cancel(r); }
};

/// One source forks to one clone rank over `counted`; in the iterations between the
/// decision and k (a session in flight, no layer of k final yet) it counts the
/// `after_update` calls and those that tested the transport, and likewise the
/// `end_iteration` calls with a session in flight.
struct poll_count {
  std::uint64_t hooks = 0, hooks_that_tested = 0;
  std::uint64_t ends = 0, ends_that_tested = 0;
  bool clone_bitwise = false;
};
poll_count count_polls(std::chrono::nanoseconds interval) {
  using engine_t = dc::engine<counted<dc::inproc::communicator>>;
  poll_count out;
  const auto roles = dc::roles::contiguous(1, 1);
  dc::inproc::world w(2);
  w.run([&](dc::inproc::communicator& raw) {
    counted<dc::inproc::communicator> c{raw};
    replica r;
    auto s = dc::testing::small_settings::make<engine_t::settings>();
    s.poll_interval = interval;
    if (raw.rank() == 1) {
      engine_t::clone dst(c, roles, r.state, s);
      dst.request();
      dst.wait();
      replica want;
      want.become(*dst.fork_iteration());
      out.clone_bitwise = r.bytes() == want.bytes();
      return;
    }
    engine_t::source src(c, roles, r.state, s);
    for (std::uint64_t step = 0; step < 5000 && src.sessions_completed() + src.sessions_failed() == 0; ++step) {
      const bool before_k = src.cloning() && *src.fork_iteration() > step;
      for (std::size_t l = r.state.layer_count(); l-- > 0;) {
        if (l == 3 && step > 2) continue;  // as replica::iterate: layer 3 frozen after step 2
        src.before_update(l);
        r.update(l, step);
        const auto tests = *c.tests;
        src.after_update(l);
        if (!before_k) continue;
        ++out.hooks;
        if (*c.tests > tests) ++out.hooks_that_tested;
      }
      r.iterate_metadata(step);
      const bool in_session = src.cloning();
      const auto tests = *c.tests;
      src.end_iteration(step);
      if (in_session) {
        ++out.ends;
        if (*c.tests > tests) ++out.ends_that_tested;
      }
      std::this_thread::sleep_for(1ms);
    }
    src.finish();
  });
  return out;
}

}  // namespace

TEST_CASE("source hooks: after_update makes a round of session progress at most once per settings.poll_interval") {
  // Each round tests the transport (MPI: each test may enter opal_progress, which yields
  // the core on an oversubscribed node); a trainer calls after_update once per layer.
  auto every = count_polls(std::chrono::nanoseconds(0));
  CHECK(every.clone_bitwise);
  REQUIRE(every.hooks >= 4);  // at least one iteration (4 or 5 layers updated) lies between the decision and k (fork_lead 2)
  CHECK(every.hooks_that_tested == every.hooks);
  for (auto never : {std::chrono::nanoseconds(std::chrono::hours(1)), std::chrono::nanoseconds::max()}) {
    CAPTURE(never.count());
    auto rarely = count_polls(never);
    CHECK(rarely.clone_bitwise);
    REQUIRE(rarely.hooks >= 4);
    CHECK(rarely.hooks_that_tested <= 1);  // the session's first after_update only
    // end_iteration progresses every time regardless (that is where a session completes).
    REQUIRE(rarely.ends >= 2);
    CHECK(rarely.ends_that_tested == rarely.ends);
  }
}
