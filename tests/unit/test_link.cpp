// Unit tests of the link-emulating communicator decorator (emulated_link.hpp).
//
// No timing assertions that a slow machine could break: the model is checked with explicit
// times, the decorator with a fake clock (a request must not complete before the model's
// time, and must complete once the fake clock passes it), and the real-clock tests only
// check lower bounds (a paced message never completes *earlier* than the model says).
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>
#include <deepclone/emulated_link.hpp>
#include <deepclone/inproc.hpp>

#include <chrono>
#include <cstring>
#include <vector>

namespace dc = deepclone;
using namespace std::chrono_literals;

namespace {

/// A clock the test moves by hand.
struct fake_clock {
  using duration = std::chrono::nanoseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<fake_clock>;
  static constexpr bool is_steady = true;
  static inline time_point t{};
  static time_point now() noexcept { return t; }
};

using fake_link = dc::emulated_link<dc::inproc::communicator, fake_clock>;
using real_link = dc::emulated_link<dc::inproc::communicator>;

std::vector<std::byte> bytes(std::size_t n, int seed) {
  std::vector<std::byte> b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = std::byte(static_cast<std::uint8_t>(i * 7 + static_cast<std::size_t>(seed)));
  return b;
}

}  // namespace

TEST_CASE("link_model: start = max(ready, sender free, receiver free); done = start + b/B + latency") {
  using M = dc::link_model<fake_clock>;
  M m(3, dc::link_config{1e6, 1ms});  // 1 MB/s: 1000 bytes take 1 ms
  fake_clock::time_point t0{};
  CHECK(m.schedule(0, 1, 1000, t0) == t0 + 2ms);  // 1 ms on the wire + 1 ms latency
  // The sender's link is busy until 1 ms: a second message from rank 0 starts then.
  CHECK(m.schedule(0, 2, 1000, t0) == t0 + 3ms);
  // Rank 1's receive side is busy until 1 ms: a message from rank 2 waits for it.
  CHECK(m.schedule(2, 1, 3000, t0) == t0 + 5ms);
  // Full duplex: rank 1 can send while it receives.
  CHECK(m.schedule(1, 0, 1000, t0) == t0 + 2ms);
  // A message posted later than every link is free starts when posted.
  CHECK(m.schedule(1, 2, 1000, t0 + 100ms) == t0 + 102ms);
  // A message to oneself uses no link and costs only latency.
  CHECK(m.schedule(0, 0, 1 << 20, t0 + 200ms) == t0 + 201ms);
  CHECK(m.tx_free(0) == t0 + 2ms);
  CHECK(m.rx_free(2) == t0 + 101ms);

  // Latency only: a message matched later never overtakes one matched before it (match
  // times from different threads can reach the model a little out of order).
  M lat(2, dc::link_config{0, 1ms});
  CHECK(lat.schedule(0, 1, 100, t0 + 10ms) == t0 + 11ms);
  CHECK(lat.schedule(0, 1, 100, t0 + 5ms) == t0 + 11ms);
  CHECK(lat.tx_free(0) == t0 + 10ms);
}

TEST_CASE("link_model with backfill: a message takes the first gap free on both sides, pairs stay in order") {
  using M = dc::link_model<fake_clock>;
  fake_clock::time_point t0{};
  // Source 0 posts its whole stream at once, alternating clone ranks 2 and 3; then source 1
  // does the same. Busy-until (FIFO) queues source 1 behind everything source 0 booked on
  // the receive sides; backfill puts it into the gaps source 0 left.
  auto run = [&](bool backfill) {
    M m(4, dc::link_config{1e6, 0ms, backfill});  // 1000 bytes: 1 ms
    std::vector<fake_clock::time_point> done;
    for (int from : {0, 1})
      for (int k = 0; k < 4; ++k) done.push_back(m.schedule(from, 2 + (k + from) % 2, 1000, t0));
    return done;
  };
  const auto fifo = run(false), fill = run(true);
  CHECK(fifo[3] == t0 + 4ms);   // source 0: 1, 2, 3, 4 ms
  CHECK(fifo[7] == t0 + 8ms);   // source 1 after the receive sides' last booking
  CHECK(fill[3] == t0 + 4ms);   // source 0 unchanged
  CHECK(fill[4] == t0 + 1ms);   // source 1 -> 3 fills [0, 1 ms), free on both sides
  CHECK(fill[5] == t0 + 2ms);   // source 1 -> 2 fills [1, 2 ms)
  CHECK(fill[7] == t0 + 4ms);   // the whole exchange: 4 ms, the bound (4 ms per receive side)

  // Messages of one pair keep their order even where an earlier gap would fit.
  M m(3, dc::link_config{1e6, 1ms, true});
  CHECK(m.schedule(1, 2, 1000, t0 + 5ms) == t0 + 7ms);   // [5, 6 ms) + latency
  CHECK(m.schedule(0, 2, 2000, t0) == t0 + 3ms);         // [0, 2 ms): before the booking above
  CHECK(m.schedule(1, 2, 1000, t0) == t0 + 8ms);         // gap [2, 3 ms) fits, but after pair 1->2's [5, 6 ms)
  CHECK(m.schedule(0, 0, 1 << 20, t0) == t0 + 1ms);      // to oneself: latency only
  CHECK(m.tx_free(1) == t0 + 7ms);
  CHECK(m.rx_free(2) == t0 + 7ms);
}

TEST_CASE("emulated_link: a message completes on both sides only once the model's time has passed (fake clock)") {
  fake_clock::t = {};
  dc::inproc::world w(2);
  auto fabric = std::make_shared<dc::link_fabric<fake_clock>>(2, dc::link_config{1e6, 0ns});
  fake_link a(w.comm(0), fabric), b(w.comm(1), fabric);
  auto out = bytes(100000, 1), in = std::vector<std::byte>(100000);  // 100 ms at 1 MB/s
  auto r = b.irecv(0, 5, in);
  auto s = a.isend(1, 5, out);
  CHECK_FALSE(b.test(r));  // the transport copied the bytes, but the link is still busy
  CHECK_FALSE(a.test(s));
  fake_clock::t += 99ms;
  CHECK_FALSE(b.test(r));
  CHECK_FALSE(a.test(s));
  fake_clock::t += 1ms;
  REQUIRE(b.test(r) == 100000u);
  CHECK(a.test(s) == 100000u);
  CHECK(in == out);
  // Tested again: still complete with the same size.
  CHECK(b.test(r) == 100000u);
}

TEST_CASE("emulated_link: messages on one link queue behind each other; a receive posted late starts the clock") {
  fake_clock::t = {};
  dc::inproc::world w(3);
  auto fabric = std::make_shared<dc::link_fabric<fake_clock>>(3, dc::link_config{1e6, 10ms});
  fake_link a(w.comm(0), fabric), b(w.comm(1), fabric), c(w.comm(2), fabric);
  auto out = bytes(50000, 2);
  std::vector<std::byte> in1(50000), in2(50000);
  // Two sends from rank 0 to different ranks: both share rank 0's link.
  auto s1 = a.isend(1, 1, out);
  auto s2 = a.isend(2, 1, out);
  fake_clock::t += 20ms;  // receives are posted 20 ms later: matching happens then
  auto r1 = b.irecv(0, 1, in1);
  auto r2 = c.irecv(0, 1, in2);
  // r1: 20 + 50 + 10 = 80 ms; r2 starts when rank 0's link frees at 70 ms: 130 ms.
  fake_clock::t = fake_clock::time_point{} + 79ms;
  CHECK_FALSE(b.test(r1));
  fake_clock::t = fake_clock::time_point{} + 80ms;
  CHECK(b.test(r1) == 50000u);
  CHECK(a.test(s1) == 50000u);
  fake_clock::t = fake_clock::time_point{} + 129ms;
  CHECK_FALSE(c.test(r2));
  CHECK_FALSE(a.test(s2));
  fake_clock::t = fake_clock::time_point{} + 130ms;
  CHECK(c.test(r2) == 50000u);
  CHECK(a.test(s2) == 50000u);
  CHECK(in1 == out);
  CHECK(in2 == out);
}

TEST_CASE("emulated_link: a cancelled receive does not take a later send's place") {
  fake_clock::t = {};
  dc::inproc::world w(2);
  auto fabric = std::make_shared<dc::link_fabric<fake_clock>>(2, dc::link_config{1e6, 0ns});
  fake_link a(w.comm(0), fabric), b(w.comm(1), fabric);
  std::vector<std::byte> in0(10000), in1(10000);
  auto dead = b.irecv(0, 3, in0);
  b.cancel(dead);
  auto out = bytes(10000, 3);
  auto r = b.irecv(0, 3, in1);
  auto s = a.isend(1, 3, out);
  CHECK_FALSE(b.test(r));
  fake_clock::t += 10ms;
  CHECK(b.test(r) == 10000u);
  CHECK(a.test(s) == 10000u);
  CHECK(in1 == out);
  CHECK(std::all_of(in0.begin(), in0.end(), [](std::byte x) { return x == std::byte{0}; }));
}

TEST_CASE("emulated_link: unlimited links are a pass-through") {
  dc::inproc::world w(2);
  auto fabric = std::make_shared<dc::link_fabric<>>(2, dc::link_config{});
  real_link a(w.comm(0), fabric), b(w.comm(1), fabric);
  auto out = bytes(8192, 4);
  std::vector<std::byte> in(8192);
  auto r = b.irecv(0, 1, in);
  auto s = a.isend(1, 1, out);
  CHECK(b.test(r) == 8192u);
  CHECK(a.test(s) == 8192u);
  CHECK(in == out);
  static_assert(dc::point_to_point_communicator<real_link>);
  static_assert(dc::waitable_communicator<real_link>);
  static_assert(dc::tag_bounded_communicator<real_link>);
}

TEST_CASE("emulated_link: with the real clock, wait() returns no earlier than the model's time") {
  dc::inproc::world w(2);
  auto fabric = std::make_shared<dc::link_fabric<>>(2, dc::link_config{50e6, 1ms});  // 1 MB: >= 21 ms
  auto out = bytes(1 << 20, 5);
  std::vector<std::byte> in(1 << 20);
  double send_s = 0, recv_s = 0;
  w.run([&](dc::inproc::communicator& c) {
    real_link l(c, fabric);
    auto t0 = std::chrono::steady_clock::now();
    if (c.rank() == 0) {
      auto s = l.isend(1, 9, out);
      l.wait(s);
      send_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } else {
      auto r = l.irecv(0, 9, in);
      CHECK(l.wait(r) == out.size());
      recv_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  });
  CHECK(in == out);
  CHECK(send_s >= 0.020);
  CHECK(recv_s >= 0.020);
}

TEST_CASE("emulated_link: a whole clone runs through the decorator, paced by the receiving links") {
  // 2 sources, 1 clone rank; 4 MiB of state at 200 MB/s per rank: the clone's one link
  // must carry all of it, so readiness is at least ~21 ms (the bound S/B).
  using link = real_link;
  using cloning = dc::engine<link>;
  const int N = 2, M = 1;
  auto roles = dc::roles::contiguous(N, M);
  dc::inproc::world w(N + M);
  auto fabric = std::make_shared<dc::link_fabric<>>(N + M, dc::link_config{200e6, 0ns});
  dc::report rep;
  std::vector<std::vector<float>> src_end(N), clone_end;
  std::atomic<bool> requested{false};
  w.run([&](dc::inproc::communicator& inner) {
    link c(inner, fabric);
    std::vector<std::vector<float>> t{std::vector<float>(512 * 1024, 1.0f), std::vector<float>(256 * 1024, 2.0f),
                                      std::vector<float>(256 * 1024, 3.0f)};
    dc::state<std::vector<float>> st;
    st.add_layer("a", {{"w", t[0]}});
    st.add_layer("b", {{"w", t[1]}, {"m", t[2]}});
    if (c.rank() < N) {
      cloning::source src(c, roles, st);
      for (std::uint64_t step = 0; step < 12; ++step) {
        for (std::size_t l = 2; l-- > 0;) {
          src.before_update(l);
          for (auto& x : l == 0 ? t[0] : t[1]) x += 1.0f;
          src.after_update(l);
        }
        src.end_iteration(step);
        if (step == 1)
          while (!requested.load()) std::this_thread::sleep_for(100us);
        std::this_thread::sleep_for(2ms);
      }
      src.finish();
    } else {
      for (auto& v : t) std::fill(v.begin(), v.end(), -1.0f);
      cloning::clone dst(c, roles, st);
      dst.request();
      requested = true;
      dst.wait();
      rep = dst.report();
      clone_end = t;
    }
  });
  const auto k = rep.iteration;
  // Every source added 1 per step to layers a and b's first tensor, k + 1 times.
  CHECK(clone_end[0][0] == 1.0f + static_cast<float>(k + 1));
  CHECK(clone_end[1][12345] == 2.0f + static_cast<float>(k + 1));
  CHECK(clone_end[2][7] == 3.0f);
  CHECK(rep.readiness_s >= 4.0 * (1 << 20) / 200e6);
}
