// A single tensor over 2 GiB and over 4 GiB, cloned in process (one source, one clone rank,
// so that the test holds two copies of the tensor and no more): byte offsets and lengths
// past 2^31 and 2^32 in pieces, headers, checksums and the transport. The first case cuts
// the tensor into the default 64 MiB pieces; the second sends it as one piece and one
// message of more than 4 GiB. The clone must equal the source's iteration k bit for bit.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

namespace dc = deepclone;
using engine = dc::engine<dc::inproc::communicator>;
using bytes_t = std::vector<std::uint8_t>;

namespace {

constexpr std::uint64_t GiB = 1ull << 30;

/// The tensor's bytes before any update: a pattern in which every 4-byte word differs
/// from its neighbours, so that a piece landing at a wrong offset cannot go unnoticed.
std::uint8_t base_byte(std::uint64_t i) { return static_cast<std::uint8_t>((i * 0x9E3779B97F4A7C15ull) >> 56); }

/// The bytes each iteration writes: around every 2^31 boundary, the ends, and every 16 MiB.
std::vector<std::uint64_t> updated_positions(std::uint64_t size) {
  std::vector<std::uint64_t> p;
  for (std::uint64_t at : {0ull, 1ull, (1ull << 31) - 1, 1ull << 31, (1ull << 32) - 1, 1ull << 32, (1ull << 32) + 1})
    if (at < size) p.push_back(at);
  for (std::uint64_t at = 16ull << 20; at < size; at += 16ull << 20) p.push_back(at + 3);
  p.push_back(size - 1);
  std::sort(p.begin(), p.end());
  p.erase(std::unique(p.begin(), p.end()), p.end());
  return p;
}
std::uint8_t step_byte(std::uint64_t step, std::uint64_t pos) { return static_cast<std::uint8_t>(step * 31 + pos * 7 + 1); }

/// Forks one source into one clone rank; returns the first mismatching byte offset of the
/// big tensor (or ~0 when the clone equals iteration k), after checking the small one.
std::uint64_t clone_big(std::uint64_t size, dc::plan_options po) {
  const auto roles = dc::roles::contiguous(1, 1);
  const auto positions = updated_positions(size);
  engine::settings s;
  s.plan = po;
  s.timeout = std::chrono::seconds(180);
  std::atomic<bool> clone_done{false};
  std::uint64_t first_wrong = 0;
  std::uint64_t k = 0;
  dc::inproc::world world(2);
  world.run([&](dc::inproc::communicator& c) {
    bytes_t big(size), small_bytes(4000);
    dc::state<bytes_t> big_state;
    big_state.add_layer("embedding", {{"weight", big}});
    big_state.add_layer("head", {{"bias", small_bytes}});
    if (c.rank() == 0) {
      for (std::uint64_t i = 0; i < size; ++i) big[i] = base_byte(i);
      engine::source<bytes_t> src(c, roles, big_state, s);
      for (std::uint64_t step = 0; step < 100000 && !clone_done.load(); ++step) {
        src.before_update(1);
        for (std::size_t i = 0; i < small_bytes.size(); ++i) small_bytes[i] = step_byte(step, i);
        src.after_update(1);
        src.before_update(0);
        for (auto p : positions) big[p] = step_byte(step, p);
        src.after_update(0);
        src.end_iteration(step);
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      src.finish();
      CHECK(src.sessions_completed() == 1);
    } else {
      engine::clone<bytes_t> dst(c, roles, big_state, s);
      auto t0 = std::chrono::steady_clock::now();
      dst.request();
      dst.wait();
      k = dst.metadata().step;
      auto rep = dst.report();
      std::printf("  %llu B tensor, %zu pieces: readiness %.2f s (wall %.2f s)\n", static_cast<unsigned long long>(size),
                  dst.plan().pieces().size(), rep.readiness_s,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      clone_done = true;
      for (std::size_t i = 0; i < small_bytes.size(); ++i) REQUIRE(small_bytes[i] == step_byte(k, i));
      // Compare against iteration k without a third copy: the base pattern, then the
      // positions every iteration rewrites.
      first_wrong = ~0ull;
      std::size_t next = 0;
      for (std::uint64_t i = 0; i < size; ++i) {
        std::uint8_t want = base_byte(i);
        if (next < positions.size() && positions[next] == i) want = step_byte(k, positions[next++]);
        if (big[i] != want) {
          first_wrong = i;
          break;
        }
      }
    }
  });
  return first_wrong;
}

}  // namespace

TEST_CASE("large: a single tensor over 2 GiB, in 64 MiB pieces") {
  dc::plan_options po;  // defaults: 64 MiB pieces, so offsets run past 2^31
  CHECK(clone_big(2 * GiB + 4099, po) == ~0ull);
}

TEST_CASE("large: a single tensor over 4 GiB, as one piece and one message") {
  dc::plan_options po;
  po.max_piece_bytes = 8 * GiB;  // one piece of 4 GiB + 13 B: lengths past 2^32
  CHECK(clone_big(4 * GiB + 13, po) == ~0ull);
}
