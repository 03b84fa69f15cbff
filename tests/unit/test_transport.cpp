// Unit tests of the in-process transport (inproc::world / communicator) and of the group
// collectives built on any point-to-point communicator (collectives.hpp).
//
// Most tests drive several ranks' communicators from one thread: the transport is
// non-blocking, so a test can post, progress and cancel in a fixed order and every
// outcome is deterministic. world::run is used where ranks must block.
#include <doctest/doctest.h>

#include <deepclone/collectives.hpp>
#include <deepclone/detail/fork_messages.hpp>
#include <deepclone/detail/session_inbox.hpp>
#include <deepclone/detail/source_session.hpp>
#include <deepclone/plan.hpp>
#include <deepclone/reconstruct.hpp>
#include <deepclone/shard.hpp>
#include <deepclone/error.hpp>
#include <deepclone/inproc.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace dc = deepclone;
using dc::inproc::communicator;

namespace {

std::vector<std::byte> pattern(std::size_t n, int seed) {
  std::vector<std::byte> b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = std::byte(static_cast<std::uint8_t>((i * 131 + static_cast<std::size_t>(seed) * 7 + 1) % 251));
  return b;
}

std::span<const std::byte> cbytes(const std::vector<std::byte>& v) { return {v.data(), v.size()}; }
std::span<std::byte> wbytes(std::vector<std::byte>& v) { return {v.data(), v.size()}; }

template <class F>
std::optional<dc::errc> error_of(F&& f) {
  try {
    f();
  } catch (const dc::error& e) {
    return e.kind();
  }
  return std::nullopt;
}

constexpr std::size_t eager = communicator::eager_limit;

}  // namespace

TEST_CASE("inproc: messages with the same (source, tag) are received in send order") {
  dc::inproc::world w(3);
  auto c0 = w.comm(0), c1 = w.comm(1), c2 = w.comm(2);
  // Mixed eager and rendezvous sizes, all with tag 5 from rank 0, sent before any receive.
  std::vector<std::vector<std::byte>> msgs;
  std::vector<communicator::request_type> sends;
  for (int i = 0; i < 40; ++i) {
    std::size_t size = (i % 3 == 0) ? eager + 100 + static_cast<std::size_t>(i) : 10 + static_cast<std::size_t>(i);
    msgs.push_back(pattern(size, i));
  }
  for (auto& m : msgs) sends.push_back(c0.isend(1, 5, cbytes(m)));
  // Interleaved messages on another tag and from another rank must not disturb the order.
  auto other_tag = pattern(64, 100), other_rank = pattern(64, 101);
  auto s_tag = c0.isend(1, 6, cbytes(other_tag));
  auto s_rank = c2.isend(1, 5, cbytes(other_rank));

  // Receive tag 6 and rank 2's message first: they match their own queues.
  std::vector<std::byte> got6(64), got2(64);
  auto r6 = c1.irecv(0, 6, wbytes(got6));
  auto r2 = c1.irecv(2, 5, wbytes(got2));
  CHECK(c1.wait(r6) == 64);
  CHECK(c1.wait(r2) == 64);
  CHECK(got6 == other_tag);
  CHECK(got2 == other_rank);

  for (std::size_t i = 0; i < msgs.size(); ++i) {
    std::vector<std::byte> buf(eager + 200);
    auto r = c1.irecv(0, 5, wbytes(buf));
    auto n = c1.wait(r);
    REQUIRE(n == msgs[i].size());
    buf.resize(n);
    CHECK_MESSAGE(buf == msgs[i], "message " << i << " out of order");
  }
  for (auto& s : sends) CHECK(c0.wait(s) > 0);
  c0.wait(s_tag);
  c2.wait(s_rank);
}

TEST_CASE("inproc: receives posted before the sends match in posting order") {
  dc::inproc::world w(2);
  auto c0 = w.comm(0), c1 = w.comm(1);
  std::vector<std::vector<std::byte>> bufs(20, std::vector<std::byte>(2 * eager));
  std::vector<communicator::request_type> recvs;
  for (auto& b : bufs) recvs.push_back(c1.irecv(0, 9, wbytes(b)));
  std::vector<std::vector<std::byte>> msgs;
  for (int i = 0; i < 20; ++i) msgs.push_back(pattern(i % 2 ? 100 : eager + 1 + static_cast<std::size_t>(i), i));
  std::vector<communicator::request_type> sends;
  for (auto& m : msgs) sends.push_back(c0.isend(1, 9, cbytes(m)));
  for (int i = 0; i < 20; ++i) {
    auto n = c1.wait(recvs[static_cast<std::size_t>(i)]);
    REQUIRE(n == msgs[static_cast<std::size_t>(i)].size());
    CHECK(std::equal(msgs[static_cast<std::size_t>(i)].begin(), msgs[static_cast<std::size_t>(i)].end(),
                     bufs[static_cast<std::size_t>(i)].begin()));
  }
  for (auto& s : sends) c0.wait(s);
}

TEST_CASE("inproc: eager sends (<= 4096 bytes) complete at once and copy the buffer") {
  dc::inproc::world w(2);
  auto c0 = w.comm(0), c1 = w.comm(1);
  for (std::size_t size : {std::size_t{0}, std::size_t{1}, std::size_t{100}, eager}) {
    INFO("size " << size);
    auto data = pattern(size, 1);
    const auto sent = data;
    auto s = c0.isend(1, 1, cbytes(data));
    auto done = c0.test(s);  // no receive posted, no progress by rank 1
    REQUIRE(done.has_value());
    CHECK(*done == size);
    std::fill(data.begin(), data.end(), std::byte{0xEE});  // the sender may reuse its buffer now
    std::vector<std::byte> buf(size + 10, std::byte{0x11});
    auto r = c1.irecv(0, 1, wbytes(buf));
    CHECK(c1.wait(r) == size);
    CHECK(std::equal(sent.begin(), sent.end(), buf.begin()));
    CHECK(std::all_of(buf.begin() + static_cast<long>(size), buf.end(), [](std::byte b) { return b == std::byte{0x11}; }));
  }
}

TEST_CASE("inproc: rendezvous sends (> 4096 bytes) complete only after the receiver progresses") {
  dc::inproc::world w(2);
  auto c0 = w.comm(0), c1 = w.comm(1);
  for (bool recv_first : {false, true}) {
    INFO("receive posted " << (recv_first ? "before" : "after") << " the send");
    auto data = pattern(eager + 1, 2);
    std::vector<std::byte> buf(eager + 1);
    communicator::request_type r{};
    if (recv_first) r = c1.irecv(0, 3, wbytes(buf));
    auto s = c0.isend(1, 3, cbytes(data));
    CHECK_FALSE(c0.test(s).has_value());
    if (!recv_first) r = c1.irecv(0, 3, wbytes(buf));
    // Matched, but nobody on rank 1 has made progress yet: the send is still pending,
    // and it reads the live buffer (zero-copy) when the receiver copies.
    CHECK_FALSE(c0.test(s).has_value());
    CHECK_FALSE(c0.test(s).has_value());
    data[0] = std::byte{0x42};
    auto n = c1.test(r);  // the receiver's progress performs the copy
    REQUIRE(n.has_value());
    CHECK(*n == eager + 1);
    CHECK(buf[0] == std::byte{0x42});
    CHECK(std::equal(data.begin(), data.end(), buf.begin()));
    auto sn = c0.test(s);
    REQUIRE(sn.has_value());
    CHECK(*sn == eager + 1);
  }
}

TEST_CASE("inproc: a rendezvous send blocks its sender until the receiving thread progresses") {
  dc::inproc::world w(2);
  std::atomic<bool> send_done{false};
  std::atomic<bool> seen_pending{false};
  w.run([&](communicator& c) {
    if (c.rank() == 0) {
      auto data = pattern(1 << 20, 3);
      auto s = c.isend(1, 4, cbytes(data));
      c.wait(s);
      send_done = true;
    } else {
      std::vector<std::byte> buf(1 << 20);
      auto r = c.irecv(0, 4, wbytes(buf));
      // The send cannot complete before this rank copies; it has not yet.
      seen_pending = !send_done.load();
      CHECK(c.wait(r) == (1u << 20));
      CHECK(buf == pattern(1 << 20, 3));
    }
  });
  CHECK(seen_pending.load());
  CHECK(send_done.load());
}

TEST_CASE("inproc: a receive buffer larger than the message returns the byte count") {
  dc::inproc::world w(2);
  auto c0 = w.comm(0), c1 = w.comm(1);
  for (std::size_t size : {std::size_t{7}, eager + 5}) {
    auto data = pattern(size, 4);
    std::vector<std::byte> buf(size * 3, std::byte{0x77});
    auto r = c1.irecv(0, 2, wbytes(buf));
    auto s = c0.isend(1, 2, cbytes(data));
    CHECK(c1.wait(r) == size);
    CHECK(c0.wait(s) == size);
    CHECK(std::equal(data.begin(), data.end(), buf.begin()));
    CHECK(std::all_of(buf.begin() + static_cast<long>(size), buf.end(), [](std::byte b) { return b == std::byte{0x77}; }));
  }
}

TEST_CASE("inproc: a message larger than the receive buffer is a transport error") {
  dc::inproc::world w(2);
  auto c0 = w.comm(0), c1 = w.comm(1);
  for (std::size_t size : {std::size_t{200}, eager + 200}) {
    INFO("size " << size);
    auto data = pattern(size, 5);
    std::vector<std::byte> buf(100, std::byte{0x33});
    auto r = c1.irecv(0, 7, wbytes(buf));
    auto s = c0.isend(1, 7, cbytes(data));
    CHECK(error_of([&] { c1.wait(r); }) == dc::errc::transport);
    CHECK_THROWS_WITH_AS(c1.test(r), doctest::Contains("larger than the receive buffer"), dc::error);
    // Nothing was written into the too-small buffer.
    CHECK(std::all_of(buf.begin(), buf.end(), [](std::byte b) { return b == std::byte{0x33}; }));
    if (size > eager) CHECK(error_of([&] { c0.wait(s); }) == dc::errc::transport);  // the sender learns too
    else CHECK(c0.wait(s) == size);                                                   // eager: already complete
  }
}

TEST_CASE("inproc: cancelling a pending receive") {
  dc::inproc::world w(2);
  auto c0 = w.comm(0), c1 = w.comm(1);
  for (std::size_t size : {std::size_t{16}, eager + 16}) {
    INFO("size " << size);
    SUBCASE("not yet matched") {
      std::vector<std::byte> stale(size, std::byte{0x5A});
      auto r = c1.irecv(0, 8, wbytes(stale));
      c1.cancel(r);
      auto t = c1.test(r);
      REQUIRE(t.has_value());
      CHECK(*t == 0);  // a cancelled receive completes with no bytes
      auto data = pattern(size, 6);
      auto s = c0.isend(1, 8, cbytes(data));
      // The send matches the next receive, never the cancelled one.
      std::vector<std::byte> fresh(size);
      auto r2 = c1.irecv(0, 8, wbytes(fresh));
      CHECK(c1.wait(r2) == size);
      CHECK(fresh == data);
      CHECK(c0.wait(s) == size);
      CHECK(std::all_of(stale.begin(), stale.end(), [](std::byte b) { return b == std::byte{0x5A}; }));
    }
    SUBCASE("matched but not yet copied") {
      std::vector<std::byte> stale(size, std::byte{0x5A});
      auto r = c1.irecv(0, 8, wbytes(stale));
      auto data = pattern(size, 7);
      auto s = c0.isend(1, 8, cbytes(data));  // matches r; the copy waits for rank 1's progress
      c1.cancel(r);
      CHECK(c1.test(r) == std::optional<std::size_t>(0));
      std::vector<std::byte> fresh(size);
      auto r2 = c1.irecv(0, 8, wbytes(fresh));
      CHECK(c1.wait(r2) == size);
      CHECK(fresh == data);
      CHECK(c0.wait(s) == size);
      CHECK(std::all_of(stale.begin(), stale.end(), [](std::byte b) { return b == std::byte{0x5A}; }));
    }
    SUBCASE("the send goes back to the head of its queue") {
      std::vector<std::byte> stale(size, std::byte{0x5A});
      auto r = c1.irecv(0, 8, wbytes(stale));
      auto first = pattern(size, 8), second = pattern(size, 9);
      auto s1 = c0.isend(1, 8, cbytes(first));  // matches r
      auto s2 = c0.isend(1, 8, cbytes(second));  // queued
      c1.cancel(r);
      std::vector<std::byte> a(size), b(size);
      auto ra = c1.irecv(0, 8, wbytes(a));
      auto rb = c1.irecv(0, 8, wbytes(b));
      c1.wait(ra);
      c1.wait(rb);
      CHECK(a == first);  // order kept despite the cancel
      CHECK(b == second);
      c0.wait(s1);
      c0.wait(s2);
      CHECK(std::all_of(stale.begin(), stale.end(), [](std::byte x) { return x == std::byte{0x5A}; }));
    }
  }
}

TEST_CASE("inproc: cancelling a pending send") {
  dc::inproc::world w(2);
  auto c0 = w.comm(0), c1 = w.comm(1);
  SUBCASE("unmatched rendezvous send is withdrawn") {
    auto withdrawn = pattern(eager + 10, 10), next = pattern(eager + 10, 11);
    auto s = c0.isend(1, 3, cbytes(withdrawn));
    c0.cancel(s);
    CHECK(c0.test(s) == std::optional<std::size_t>(0));
    auto s2 = c0.isend(1, 3, cbytes(next));
    std::vector<std::byte> buf(eager + 10);
    auto r = c1.irecv(0, 3, wbytes(buf));
    CHECK(c1.wait(r) == eager + 10);
    CHECK(buf == next);
    c0.wait(s2);
  }
  SUBCASE("matched rendezvous send is withdrawn, the receive matches the next send") {
    auto withdrawn = pattern(eager + 10, 12), next = pattern(eager + 10, 13);
    std::vector<std::byte> buf(eager + 10, std::byte{0x66});
    auto r = c1.irecv(0, 3, wbytes(buf));
    auto s = c0.isend(1, 3, cbytes(withdrawn));  // matched, not copied
    c0.cancel(s);
    CHECK(c0.test(s) == std::optional<std::size_t>(0));
    CHECK_FALSE(c1.test(r).has_value());  // the receive is pending again
    CHECK(std::all_of(buf.begin(), buf.end(), [](std::byte b) { return b == std::byte{0x66}; }));
    auto s2 = c0.isend(1, 3, cbytes(next));
    CHECK(c1.wait(r) == eager + 10);
    CHECK(buf == next);
    c0.wait(s2);
  }
  SUBCASE("a completed (eager) send cannot be withdrawn") {
    auto small = pattern(32, 14);
    auto s = c0.isend(1, 3, cbytes(small));
    c0.cancel(s);  // no effect: it completed when posted
    std::vector<std::byte> buf(32);
    auto r = c1.irecv(0, 3, wbytes(buf));
    CHECK(c1.wait(r) == 32);
    CHECK(buf == small);
  }
}

TEST_CASE("inproc: self-send") {
  dc::inproc::world w(1);
  auto c = w.comm(0);
  for (std::size_t size : {std::size_t{10}, eager * 3}) {
    auto data = pattern(size, 15);
    std::vector<std::byte> buf(size);
    auto s = c.isend(0, 11, cbytes(data));
    auto r = c.irecv(0, 11, wbytes(buf));
    CHECK(c.wait(r) == size);
    CHECK(c.wait(s) == size);
    CHECK(buf == data);
  }
}

TEST_CASE("inproc: invalid ranks") {
  CHECK(error_of([] { dc::inproc::world w(0); }) == dc::errc::invalid_argument);
  CHECK(error_of([] { dc::inproc::world w(-3); }) == dc::errc::invalid_argument);
  dc::inproc::world w(2);
  CHECK(w.size() == 2);
  CHECK(error_of([&] { w.comm(2); }) == dc::errc::invalid_argument);
  CHECK(error_of([&] { w.comm(-1); }) == dc::errc::invalid_argument);
  auto c = w.comm(0);
  CHECK(c.rank() == 0);
  CHECK(c.size() == 2);
  std::vector<std::byte> b(4);
  CHECK(error_of([&] { c.isend(2, 0, cbytes(b)); }) == dc::errc::invalid_argument);
  CHECK(error_of([&] { c.isend(-1, 0, cbytes(b)); }) == dc::errc::invalid_argument);
  CHECK(error_of([&] { c.irecv(2, 0, wbytes(b)); }) == dc::errc::invalid_argument);
  CHECK(error_of([&] { c.irecv(-1, 0, wbytes(b)); }) == dc::errc::invalid_argument);
  CHECK(error_of([&] { c.isend(1, 0, cbytes(b)); }) == std::nullopt);
}

TEST_CASE("inproc: whole-world barrier and allreduce_sum") {
  constexpr int K = 4;
  dc::inproc::world w(K);
  std::atomic<int> arrived{0};
  std::atomic<int> early{0};
  std::atomic<int> wrong{0};
  w.run([&](communicator& c) {
    for (int round = 0; round < 50; ++round) {
      ++arrived;
      c.barrier();
      // Everyone of this round has arrived before anyone leaves the barrier.
      if (arrived.load() < (round + 1) * K) ++early;
      std::vector<double> v{static_cast<double>(c.rank()), 1.0, static_cast<double>(round)};
      c.allreduce_sum(v);
      if (v != std::vector<double>{0 + 1 + 2 + 3, K, static_cast<double>(round * K)}) ++wrong;
      c.barrier();  // keeps the next round's increments out of this round's check
    }
  });
  CHECK(early.load() == 0);
  CHECK(wrong.load() == 0);
  CHECK(arrived.load() == 50 * K);
}

TEST_CASE("collectives: allreduce_sum and barrier over a subgroup") {
  constexpr int K = 6;
  dc::inproc::world w(K);
  const std::vector<int> group{4, 1, 3};  // not sorted: group order decides the summation order
  const std::vector<int> others{0, 2, 5};
  std::atomic<int> wrong{0}, early{0}, arrived{0};
  std::atomic<int> group_calls{0};
  w.run([&](communicator& c) {
    const bool in_group = std::find(group.begin(), group.end(), c.rank()) != group.end();
    const auto& mine = in_group ? group : others;
    for (int round = 0; round < 30; ++round) {
      // Doubles: the sum must equal the left-to-right sum in group order, bit for bit.
      std::vector<double> v{0.1 * (c.rank() + 1) + round, 1e16, -1e16 + c.rank()};
      dc::allreduce_sum(c, std::span<const int>(mine), std::span<double>(v), 10);
      std::vector<double> want(3, 0.0);
      for (int r : mine) {
        want[0] += 0.1 * (r + 1) + round;
        want[1] += 1e16;
        want[2] += -1e16 + r;
      }
      if (std::memcmp(v.data(), want.data(), sizeof(double) * 3) != 0) ++wrong;
      // Integers, another tag.
      std::vector<std::int64_t> n{c.rank(), 1};
      dc::allreduce_sum(c, std::span<const int>(mine), std::span<std::int64_t>(n), 20);
      const std::int64_t rank_sum = std::accumulate(mine.begin(), mine.end(), std::int64_t{0});
      if (n[0] != rank_sum || n[1] != 3) ++wrong;
      if (in_group) {
        ++arrived;
        dc::barrier(c, std::span<const int>(group), 30);
        if (arrived.load() < (round + 1) * 3) ++early;
        dc::barrier(c, std::span<const int>(group), 30);
        ++group_calls;
      }
    }
  });
  CHECK(wrong.load() == 0);
  CHECK(early.load() == 0);
  CHECK(group_calls.load() == 30 * 3);
}

TEST_CASE("collectives: a rank outside the group is refused") {
  dc::inproc::world w(3);
  auto c = w.comm(2);
  const std::vector<int> group{0, 1};
  std::vector<double> v{1.0};
  CHECK(error_of([&] { dc::allreduce_sum(c, std::span<const int>(group), std::span<double>(v), 1); }) ==
        dc::errc::invalid_argument);
  CHECK(error_of([&] { dc::barrier(c, std::span<const int>(group), 1); }) == dc::errc::invalid_argument);
  // A group of one is its own sum.
  auto c0 = w.comm(0);
  const std::vector<int> solo{0};
  std::vector<double> x{2.5};
  dc::allreduce_sum(c0, std::span<const int>(solo), std::span<double>(x), 1);
  CHECK(x[0] == 2.5);
}

TEST_CASE("inproc: activity counts events; wait_activity wakes on one") {
  dc::inproc::world w(2);
  auto c0 = w.comm(0), c1 = w.comm(1);
  // An arriving message changes the receiver's activity.
  auto a1 = c1.activity();
  auto small = pattern(8, 1);
  auto s = c0.isend(1, 1, cbytes(small));
  CHECK(c1.activity() != a1);
  // With nothing happening, wait_activity returns after its timeout and nothing changed.
  auto a0 = c0.activity();
  c0.wait_activity(a0, std::chrono::microseconds(1000));
  CHECK(c0.activity() == a0);
  // A rendezvous send's completion is an event for the sender.
  auto big = pattern(eager * 2, 2);
  std::vector<std::byte> buf(eager * 2);
  auto sb = c0.isend(1, 2, cbytes(big));
  auto before = c0.activity();
  auto r = c1.irecv(0, 2, wbytes(buf));
  c1.wait(r);
  CHECK(c0.activity() != before);
  CHECK(c0.test(sb).has_value());
  std::vector<std::byte> sbuf(8);
  auto rs = c1.irecv(0, 1, wbytes(sbuf));
  c1.wait(rs);
  (void)s;

  // Across threads: a waiting rank wakes up when a message arrives (the timeout is only a
  // safety net; the check is that the event was observed, not how fast).
  std::atomic<bool> woke_with_event{false};
  std::atomic<bool> armed{false};
  w.run([&](communicator& c) {
    if (c.rank() == 1) {
      auto seen = c.activity();
      armed = true;  // rank 0 sends only after `seen` was read
      c.wait_activity(seen, std::chrono::seconds(20));
      woke_with_event = c.activity() != seen;
      std::vector<std::byte> b(8);
      auto rr = c.irecv(0, 60, wbytes(b));
      c.wait(rr);
    } else {
      while (!armed.load()) std::this_thread::yield();
      auto d = pattern(8, 3);
      auto ss = c.isend(1, 60, cbytes(d));
      c.wait(ss);
    }
  });
  CHECK(woke_with_event.load());
}

TEST_CASE("inproc: world::run rethrows the first exception of a rank") {
  dc::inproc::world w(4);
  std::atomic<int> finished{0};
  try {
    w.run([&](communicator& c) {
      if (c.rank() == 3) throw std::runtime_error("rank 3 failed");
      if (c.rank() == 1) throw dc::error(dc::errc::timeout, "rank 1 failed");
      ++finished;
    });
    FAIL("run did not rethrow");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::timeout);  // rank 1's, the first in rank order
    CHECK(std::string(e.what()).find("rank 1 failed") != std::string::npos);
  } catch (const std::exception& e) {
    FAIL("rethrew another rank's exception: " << e.what());
  }
  CHECK(finished.load() == 2);  // the other ranks ran to the end
  // A run without exceptions returns normally, and the world can be used again.
  std::atomic<int> ran{0};
  CHECK_NOTHROW(w.run([&](communicator&) { ++ran; }));
  CHECK(ran.load() == 4);
  // A non-deepclone exception is rethrown as is.
  CHECK_THROWS_WITH_AS(w.run([](communicator& c) {
                         if (c.rank() == 2) throw std::logic_error("two");
                       }),
                       "two", std::logic_error);
}

// ---------------------------------------------------------------------------------------
// detail::outbox over a transport that cannot withdraw sends (Open MPI's ob1): the buffers
// of owned sends must outlive a cancel, since the transport may still read them later.
#include <deepclone/detail/outbox.hpp>

namespace {
/// Holds every send's span and "delivers" it whenever the test says so, like a parked MPI
/// send whose receiver posts a matching receive after the sender gave up on it.
struct uncancellable_sends {
  struct request_type {
    std::size_t id = 0;
  };
  std::vector<std::span<const std::byte>> sends;
  request_type isend(int, int, std::span<const std::byte> data) {
    sends.push_back(data);
    return {sends.size() - 1};
  }
  std::optional<std::size_t> test(request_type&) { return std::nullopt; }  // never completes
  void cancel(request_type&) {}                                           // cannot withdraw
  std::vector<std::byte> deliver(std::size_t id) const { return {sends[id].begin(), sends[id].end()}; }
};
}  // namespace

TEST_CASE("outbox: owned buffers of sends the transport could not withdraw stay valid after clear") {
  uncancellable_sends c;
  auto before = dc::detail::retained_send_bytes();
  std::vector<std::byte> expect = pattern(300, 5);
  {
    dc::detail::outbox<uncancellable_sends> out;
    out.send_owned(c, 1, 7, expect);
    out.clear(c);
    // Freshly allocated memory of the same size would reuse a freed buffer.
    std::vector<std::vector<std::byte>> churn(64, std::vector<std::byte>(300, std::byte{0xEE}));
    CHECK(c.deliver(0) == expect);  // ASan reports a use after free here if the buffer went
  }
  CHECK(c.deliver(0) == expect);
  CHECK(dc::detail::retained_send_bytes() >= before + 300);
}

// ---- engine components templated on the communicator only (detail/) ----

TEST_CASE("session_inbox: a clone's message of the next session is kept for it; one of a closed session and garbage are dropped") {
  using dc::detail::ack_msg;
  using dc::detail::cancel_msg;
  using dc::detail::refetch_msg;
  dc::inproc::world w(3);  // rank 0: a source; ranks 1, 2: clone ranks
  auto src = w.comm(0), c1 = w.comm(1), c2 = w.comm(2);
  const std::vector<int> clones{1, 2};
  const int base = 1000;
  dc::detail::session_inbox<communicator> inbox;
  CHECK(inbox.open(src, clones, base, 7).empty());
  dc::detail::outbox<communicator> out1, out2;
  out1.send_owned(c1, 0, base + dc::detail::tag_ack, ack_msg{7, 0, {3, 1}}.encode());
  out2.send_owned(c2, 0, base + dc::detail::tag_refetch, refetch_msg{8, 1, 5}.encode());    // session 8: one ahead
  out1.send_owned(c1, 0, base + dc::detail::tag_cancel, std::vector<std::byte>(40, std::byte{0x5A}));  // garbage
  auto got = inbox.poll(src);
  REQUIRE(got.size() == 1);
  CHECK(got[0].from == 0);
  REQUIRE(std::holds_alternative<ack_msg>(got[0].body));
  CHECK(std::get<ack_msg>(got[0].body).layers == std::vector<std::uint32_t>{3, 1});
  // Session 7 closes with a cancel of it matched but not yet taken: dropped; session 8's
  // refetch waits for session 8.
  out2.send_owned(c2, 0, base + dc::detail::tag_cancel, cancel_msg{7, 1, 0}.encode());
  inbox.close(src);
  auto early = inbox.open(src, clones, base, 8);
  REQUIRE(early.size() == 1);
  CHECK(early[0].from == 1);
  REQUIRE(std::holds_alternative<refetch_msg>(early[0].body));
  CHECK(std::get<refetch_msg>(early[0].body).group == 5);
  CHECK(inbox.poll(src).empty());
  inbox.close(src);
}

TEST_CASE("fork_messages: the newest request of each clone rank counts, a withdrawal cancels it, answers carry each request's nonce") {
  using dc::detail::decision_msg;
  using dc::detail::request_msg;
  dc::inproc::world w(4);  // ranks 0, 1: sources; ranks 2, 3: clone ranks
  auto s0 = w.comm(0), s1 = w.comm(1), c2 = w.comm(2), c3 = w.comm(3);
  const auto roles = dc::roles::contiguous(2, 2);
  const int base = 1000;
  dc::detail::fork_messages<communicator> coord(roles, true, base), other(roles, false, base);
  coord.post(s0);
  other.post(s1);
  dc::detail::outbox<communicator> out;
  auto request = [&](communicator& c, std::uint32_t j, std::uint64_t nonce, std::uint32_t flags) {
    out.send_owned(c, 0, base + dc::detail::tag_request, request_msg{j, nonce, 0, {}, flags}.encode());
  };
  request(c2, 0, 11, 0);
  request(c2, 0, 12, 0);                             // newer: replaces 11
  request(c3, 1, 21, 0);
  request(c3, 1, 21, dc::detail::flag_withdraw);     // withdrawn
  request(c3, 0, 99, 0);                             // names another clone rank: garbage
  coord.take_requests(s0);
  CHECK_FALSE(coord.all_requested());
  REQUIRE(coord.requests()[0]);
  CHECK(coord.requests()[0]->nonce == 12);
  CHECK_FALSE(coord.requests()[1]);
  request(c3, 1, 22, 0);
  coord.take_requests(s0);
  CHECK(coord.all_requested());
  decision_msg d;
  d.session = 5;
  d.iteration = 9;
  coord.answer(s0, out, d);
  out.send_owned(s0, 1, base + dc::detail::tag_decision, d.encode());
  CHECK_FALSE(coord.all_requested());  // answered: cleared
  for (auto [c, nonce] : {std::pair{&c2, 12ull}, std::pair{&c3, 22ull}}) {
    std::vector<std::byte> b(dc::detail::control_bytes);
    auto r = c->irecv(0, base + dc::detail::tag_decision, b);
    auto n = c->wait(r);
    auto got = decision_msg::decode(std::span<const std::byte>(b.data(), n));
    CHECK(got.nonce == nonce);
    CHECK(got.iteration == 9);
  }
  std::optional<decision_msg> seen_by_other;
  for (int i = 0; i < 100 && !seen_by_other; ++i) seen_by_other = other.take_decision(s1);
  REQUIRE(seen_by_other);
  CHECK(seen_by_other->session == 5);
  CHECK_FALSE(other.seen(5));
  other.remember(5);
  CHECK(other.seen(5));
  out.wait_all(s0, std::chrono::seconds(1));
  coord.cancel(s0);
  other.cancel(s1);
}

TEST_CASE("source_session: each clone rank's acknowledgement counts once, refetches only of groups the plan sends it, headers carry the sums") {
  // One source, two clone ranks, two layers, tensors split so that each clone rank gets its own groups.
  const dc::layout lay({{"a", {{"w", 64 << 10, dc::dtype::f32, {16 << 10}}}}, {"b", {{"w", 32 << 10, dc::dtype::f32, {8 << 10}}}}});
  const auto roles = dc::roles::contiguous(1, 2);
  const auto plan = dc::make_plan(lay, 1, 2, dc::shard::split_even{1024}, dc::reconstruct::scatter_exchange{1024}, dc::plan_options{});
  const std::vector<std::uint32_t> needed{2, 2};
  dc::detail::source_session<communicator> s(plan, roles, 0, 7, 3, dc::detail::session_tags{1000, 2, 0}, needed);

  s.acknowledged(0, {0, 0, 9});  // a duplicate and a layer out of range
  CHECK(s.acks == std::vector<std::uint32_t>{1, 0});
  CHECK_FALSE(s.verified(0));
  s.acknowledged(1, {0, 1});
  CHECK(s.verified(0));
  CHECK_FALSE(s.all_verified());
  s.acknowledged(0, {1});
  CHECK(s.all_verified());

  std::uint32_t to_clone0 = 0;
  while (plan.groups()[to_clone0].to != 0) ++to_clone0;
  s.refetch_asked(1, to_clone0);  // not a group the plan sends clone rank 1
  s.refetch_asked(0, static_cast<std::uint32_t>(plan.groups().size()));  // no such group
  CHECK(s.refetch_queue[1].empty());
  CHECK(s.refetch_queue[0].empty());
  s.refetch_asked(0, to_clone0);
  CHECK(s.refetch_queue[0] == std::deque<std::uint32_t>{to_clone0});

  dc::inproc::world w(3);
  auto src = w.comm(0);
  for (std::size_t pi = 0; pi < s.piece_sums.size(); ++pi) s.piece_sums[pi] = 1000 + pi;
  s.send_headers(src, 0);
  // A receive that completes within a bounded number of tests, or not at all.
  auto take = [](communicator& c, communicator::request_type& r) -> std::optional<std::size_t> {
    for (int i = 0; i < 1000; ++i)
      if (auto n = c.test(r)) return n;
    return std::nullopt;
  };
  std::size_t pieces = 0;
  for (int c = 1; c <= 2; ++c) {
    auto dst = w.comm(c);
    std::vector<std::byte> buf(4096);
    for (auto g : plan.sent_by_source(0, 0)) {
      if (roles.clones[plan.groups()[g].to] != c) continue;
      auto r = dst.irecv(0, s.tags.layer(0, false, true), buf);
      auto n = take(dst, r);
      REQUIRE(n);
      auto h = dc::detail::group_header::decode(std::span(buf).first(*n));
      CHECK(h.session == 7);
      CHECK(h.iteration == 3);
      CHECK(h.layer == 0);
      CHECK(h.from == 0);
      const auto& want = plan.groups()[g].pieces;
      REQUIRE(h.pieces.size() == want.size());
      for (std::size_t i = 0; i < h.pieces.size(); ++i) {
        const auto& p = plan.pieces()[want[i]];
        CHECK(h.pieces[i].tensor == p.tensor);
        CHECK(h.pieces[i].offset == p.offset);
        CHECK(h.pieces[i].length == p.length);
        CHECK(h.pieces[i].checksum == 1000 + want[i]);
      }
      pieces += h.pieces.size();
    }
    auto extra = dst.irecv(0, s.tags.layer(0, false, true), buf);  // one header per group, no more
    CHECK_FALSE(take(dst, extra));
    dst.cancel(extra);
  }
  CHECK(pieces > 0);
  CHECK(s.out.all_done(src));

  // A data send is booked under its layer and counted.
  std::vector<std::byte> data(100, std::byte{7}), got(100);
  auto dst = w.comm(roles.clones[1]);
  auto r = dst.irecv(0, s.tags.layer(1, false, false), got);
  const auto req = s.post_data(src, 1, 1, data);
  REQUIRE(take(dst, r) == std::optional<std::size_t>(100));
  CHECK(got == data);
  CHECK(s.layer_reqs[1] == std::vector<std::size_t>{req});
  CHECK(s.layer_reqs[0].empty());
  CHECK(s.bytes_sent == 100);
  CHECK(s.sends_done(src, s.layer_reqs[1]));

  s.fork_durations = {1.0, 1.5};
  s.hook_s = 0.25;
  const auto f = s.figures(0.5);
  CHECK(f.session == 7);
  CHECK(f.source_index == 0);
  CHECK(f.bytes_sent == 100);
  CHECK(f.hook_s == 0.25);
  CHECK(f.fork_iterations == 2);
  CHECK(f.normal_iteration_s == 0.5);
  CHECK(f.overhead_s == doctest::Approx(1.5));
  CHECK(std::isnan(s.figures(NAN).overhead_s));
}
