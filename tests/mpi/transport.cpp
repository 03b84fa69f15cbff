// The MPI adapter on its own: byte messages, split messages, truncation, cancel, tags,
// collectives, threading checks, gathered and scattered messages. Run on 2 ranks.
#include <deepclone/integrations/boost_mpi.hpp>

#include <doctest/doctest.h>

#include <boost/mpi/communicator.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <vector>

namespace dm = deepclone::mpi;

namespace {
std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::byte>(x >> 24);
  }
  return v;
}
}  // namespace

TEST_CASE("mpi adapter: models the communicator concepts and reports MPI's bounds") {
  boost::mpi::communicator world;
  dm::communicator c(world);
  CHECK(c.rank() == world.rank());
  CHECK(c.size() == world.size());
  CHECK(c.max_tag() >= 32767);
  CHECK(dm::provided_thread_level() == dm::thread_level::multiple);
  CHECK_NOTHROW(dm::require_thread_level(dm::thread_level::serialized));
  dm::options bad;
  bad.max_message_bytes = 0;
  CHECK_THROWS_AS(dm::communicator(world, bad), deepclone::error);
  std::vector<double> v{1.0, static_cast<double>(c.rank())};
  c.allreduce_sum(v);
  CHECK(v[0] == c.size());
  CHECK(v[1] == c.size() * (c.size() - 1) / 2.0);
  c.barrier();
  CHECK_THROWS_AS(c.isend(c.size(), 0, {}), deepclone::error);
  CHECK_THROWS_AS(c.irecv(0, -1, {}), deepclone::error);
}

TEST_CASE("mpi adapter: bytes arrive intact, receive reports the count, buffer may be larger") {
  boost::mpi::communicator world;
  dm::communicator c(world);
  if (c.rank() > 1) return;
  const int peer = 1 - c.rank();
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{4096}, std::size_t{1} << 20}) {
    auto data = pattern(n, static_cast<unsigned>(n));
    if (c.rank() == 0) {
      auto r = c.isend(peer, 5, data);
      CHECK(c.wait(r) == n);
    } else {
      std::vector<std::byte> in(n + 100);
      auto r = c.irecv(peer, 5, in);
      REQUIRE(c.wait(r) == n);
      CHECK(std::equal(data.begin(), data.end(), in.begin()));
    }
  }
}

TEST_CASE("mpi adapter: split messages keep MPI's order, whatever order requests are tested in") {
  boost::mpi::communicator world;
  dm::options o;
  o.max_message_bytes = 1000;  // every message of >= 1000 bytes is split
  dm::communicator c(world, o);
  if (c.rank() > 1) return;
  const int peer = 1 - c.rank();
  // Sizes around the split points, and buffers larger than the messages (up to 5 chunks).
  const std::vector<std::size_t> sizes{999, 1000, 1001, 0, 3000, 2500, 10, 4999};
  std::vector<std::vector<std::byte>> data;
  for (std::size_t i = 0; i < sizes.size(); ++i) data.push_back(pattern(sizes[i], static_cast<unsigned>(i + 1)));
  for (int tag : {3, 4}) {
    if (c.rank() == 0) {
      std::vector<dm::communicator::request_type> rs;
      for (auto& d : data) rs.push_back(c.isend(peer, tag, d));
      for (std::size_t i = rs.size(); i-- > 0;) CHECK(c.wait(rs[i]) == data[i].size());
    } else {
      std::vector<std::vector<std::byte>> in(sizes.size(), std::vector<std::byte>(5000));
      std::vector<dm::communicator::request_type> rs;
      for (auto& b : in) rs.push_back(c.irecv(peer, tag, b));
      // tag 3: newest first; tag 4: oldest first
      for (std::size_t k = 0; k < rs.size(); ++k) {
        std::size_t i = tag == 3 ? rs.size() - 1 - k : k;
        REQUIRE(c.wait(rs[i]) == sizes[i]);
        CHECK(std::equal(data[i].begin(), data[i].end(), in[i].begin()));
      }
    }
  }
}

TEST_CASE("mpi adapter: a message larger than the receive buffer is a transport error, and later messages still match") {
  boost::mpi::communicator world;
  dm::options o;
  o.max_message_bytes = 1000;
  dm::communicator c(world, o);
  if (c.rank() > 1) return;
  const int peer = 1 - c.rank();
  auto big = pattern(2500, 7), small = pattern(1500, 8), tiny = pattern(50, 9);
  if (c.rank() == 0) {
    auto a = c.isend(peer, 9, big), b = c.isend(peer, 9, small), t = c.isend(peer, 10, tiny);
    c.wait(a);
    c.wait(b);
    c.wait(t);
  } else {
    std::vector<std::byte> in1(2000), in2(2000), in3(10);
    auto r1 = c.irecv(peer, 9, in1), r2 = c.irecv(peer, 9, in2), r3 = c.irecv(peer, 10, in3);
    try {
      c.wait(r1);
      FAIL("no error for a 2500-byte message into a 2000-byte buffer");
    } catch (const deepclone::error& e) {
      CHECK(e.kind() == deepclone::errc::transport);
      CHECK(std::string(e.what()).find("larger than the receive buffer") != std::string::npos);
    }
    REQUIRE(c.wait(r2) == small.size());
    CHECK(std::equal(small.begin(), small.end(), in2.begin()));
    CHECK_THROWS_AS(c.wait(r3), deepclone::error);  // 50 bytes into 10, unsplit path
  }
  world.barrier();
}

TEST_CASE("mpi adapter: cancel withdraws an unmatched receive; a later message goes to the next receive") {
  boost::mpi::communicator world;
  dm::communicator c(world);
  if (c.rank() > 1) return;
  const int peer = 1 - c.rank();
  auto d = pattern(100000, 3);
  if (c.rank() == 1) {
    std::vector<std::byte> a(100000), b(100000);
    auto ra = c.irecv(peer, 11, a);
    c.cancel(ra);
    CHECK(c.test(ra) == std::optional<std::size_t>(0));
    world.barrier();  // only now does rank 0 send
    auto rb = c.irecv(peer, 11, b);
    REQUIRE(c.wait(rb) == d.size());
    CHECK(std::equal(d.begin(), d.end(), b.begin()));
    CHECK(std::all_of(a.begin(), a.end(), [](std::byte x) { return x == std::byte{0}; }));
  } else {
    world.barrier();
    auto s = c.isend(peer, 11, d);
    CHECK(c.wait(s) == d.size());
  }
}

TEST_CASE("mpi adapter: cancel of a send nobody receives returns (parked), the rank goes on") {
  boost::mpi::communicator world;
  dm::options o;
  o.cancel_grace = std::chrono::milliseconds(5);
  dm::communicator c(world, o);
  if (c.rank() > 1) return;
  // 8 MiB: far above every eager limit, so the send waits for a receive that never comes.
  auto d = pattern(8 << 20, 4);
  if (c.rank() == 0) {
    auto s = c.isend(1, 12, d);
    c.cancel(s);
    CHECK(c.test(s).has_value());
    // Open MPI cannot cancel sends: it is parked; another MPI may have withdrawn it.
    MESSAGE("parked sends after cancel: " << c.parked_sends());
    world.barrier();
    // Rank 1 now takes it, so the parked request completes and the buffer is released.
    world.barrier();
    for (int i = 0; i < 1000 && c.parked_sends(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(c.parked_sends() == 0);
  } else {
    world.barrier();
    std::vector<std::byte> in(d.size());
    auto r = c.irecv(0, 12, in);
    std::size_t got = c.wait(r);
    world.barrier();
    // Either MPI withdrew the send (then nothing arrives and we must not wait) or it did not.
    CHECK((got == d.size() || got == 0));
  }
}

TEST_CASE("mpi adapter: progress thread needs and gets MPI_THREAD_MULTIPLE; transfers work with it") {
  boost::mpi::communicator world;
  dm::options o;
  o.progress_interval = std::chrono::microseconds(100);
  dm::communicator c(world, o);
  CHECK(c.progress_thread());
  if (c.rank() > 1) return;
  auto d = pattern(4 << 20, 5);
  if (c.rank() == 0) {
    auto s = c.isend(1, 13, d);
    CHECK(c.wait(s) == d.size());
  } else {
    std::vector<std::byte> in(d.size());
    auto r = c.irecv(0, 13, in);
    CHECK(c.wait(r) == d.size());
    CHECK(in == d);
  }
}

TEST_CASE("mpi adapter: gathered and scattered messages match contiguous ones, also beyond the piece size") {
  boost::mpi::communicator world;
  for (std::size_t piece : {std::size_t{1} << 30, std::size_t{1000}}) {  // one datatype; staged and split
    CAPTURE(piece);
    dm::options o;
    o.max_message_bytes = piece;
    dm::communicator c(world, o);
    const auto data = pattern(5000, 7);
    // Runs of 3000 + 1 + 1999 bytes, in reverse order in memory, with a gap.
    std::vector<std::byte> target(6000, std::byte{0});
    std::vector<std::span<std::byte>> runs{std::span(target).subspan(3000, 3000), std::span(target).subspan(100, 1),
                                           std::span(target).subspan(1000, 1999)};
    if (c.rank() == 0) {
      auto s1 = c.isend(1, 5, data);  // contiguous, received scattered
      std::vector<std::span<const std::byte>> gather{std::span(data).subspan(2000, 3000), std::span(data).subspan(0, 2000)};
      auto s2 = c.isend_gather(1, 6, gather);  // gathered, received contiguously
      c.wait(s1), c.wait(s2);
    } else {
      auto r1 = c.irecv_scatter(0, 5, runs);
      std::vector<std::byte> whole(5000);
      auto r2 = c.irecv(0, 6, whole);
      CHECK(c.wait(r1) == 5000);
      CHECK(c.wait(r2) == 5000);
      CHECK(std::equal(data.begin(), data.begin() + 3000, target.begin() + 3000));
      CHECK(target[100] == data[3000]);
      CHECK(std::equal(data.begin() + 3001, data.end(), target.begin() + 1000));
      CHECK(target[0] == std::byte{0});
      CHECK(std::equal(data.begin() + 2000, data.end(), whole.begin()));
      CHECK(std::equal(data.begin(), data.begin() + 2000, whole.begin() + 3000));
      // A cancelled scattered receive that never matched writes nothing, and reports 0.
      auto r3 = c.irecv_scatter(0, 7, runs);
      std::fill(target.begin(), target.end(), std::byte{0});
      c.cancel(r3);
      CHECK(c.test(r3) == std::optional<std::size_t>(0));
      CHECK(std::all_of(target.begin(), target.end(), [](std::byte b) { return b == std::byte{0}; }));
    }
    world.barrier();
  }
}
