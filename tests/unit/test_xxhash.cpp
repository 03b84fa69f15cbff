// The xxHash integration: checksum::xxh3 is exactly XXH3_64bits, catches a flipped bit, and
// works as the engine's checksum policy end to end (a clone bit for bit identical, a bit
// flipped in flight caught and fetched again). Sources on mix64 and a clone on xxh3 disagree
// on the plan key, so the clone is refused with plan_mismatch before any byte is written.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>
#include <deepclone/fault_injection.hpp>
#include <deepclone/integrations/xxhash.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dc = deepclone;
using namespace std::chrono_literals;

namespace {

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::vector<std::byte> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = std::byte(static_cast<std::uint8_t>(splitmix(seed + i / 8) >> (8 * (i % 8))));
  return v;
}

std::uint64_t xxh(std::span<const std::byte> b) { return dc::checksum::xxh3::compute(b); }

}  // namespace

TEST_CASE("checksum::xxh3 is a checksum policy with its own id") {
  using P = dc::checksum::xxh3;
  static_assert(dc::checksum_policy<P>);
  static_assert(P::id == 2);
  static_assert(P::id != dc::checksum::none::id && P::id != dc::checksum::mix64::id);
  static_assert(noexcept(P::compute(std::span<const std::byte>{})));
  CHECK(std::string(P::name) == "xxh3");
  using E = dc::engine<dc::inproc::communicator, dc::shard::split_even, dc::pipeline::window, dc::reconstruct::scatter_exchange, P>;
  CHECK(E::describe({}) == "split_even/window/scatter_exchange/xxh3");
}

TEST_CASE("checksum::xxh3 equals XXH3_64bits on known inputs") {
  // The published XXH3_64bits digest of the empty input (seed 0), independent of the library.
  CHECK(xxh({}) == 0x2D06800538D394C2ull);
  CHECK(xxh(std::span<const std::byte>(static_cast<const std::byte*>(nullptr), 0)) == 0x2D06800538D394C2ull);
  // Every length class of XXH3 (0, 1-3, 4-8, 9-16, 17-128, 129-240, long with a partial
  // stripe and a partial block), each at every misalignment 0..15 within a buffer.
  const auto buf = pattern(1 << 20, 42);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{4}, std::size_t{7},
                        std::size_t{8}, std::size_t{9}, std::size_t{15}, std::size_t{16}, std::size_t{17}, std::size_t{63},
                        std::size_t{127}, std::size_t{128}, std::size_t{129}, std::size_t{239}, std::size_t{240},
                        std::size_t{241}, std::size_t{1023}, std::size_t{1025}, std::size_t{4099}, std::size_t{65537},
                        std::size_t{(1 << 20) - 16}}) {
    for (std::size_t off = 0; off < 16; ++off) {
      CAPTURE(n);
      CAPTURE(off);
      const auto s = std::span<const std::byte>(buf).subspan(off, n);
      CHECK(xxh(s) == XXH3_64bits(s.data(), s.size()));
    }
  }
  // Alignment does not change the digest: the same bytes at another address hash alike.
  std::vector<std::byte> shifted(4099 + 5);
  std::memcpy(shifted.data() + 5, buf.data(), 4099);
  CHECK(xxh(std::span<const std::byte>(shifted).subspan(5)) == xxh(std::span<const std::byte>(buf).first(4099)));
}

TEST_CASE("checksum::xxh3 detects a flipped bit, a truncation and swapped words") {
  for (std::size_t n : {std::size_t{1}, std::size_t{13}, std::size_t{200}, std::size_t{4099}}) {
    CAPTURE(n);
    auto b = pattern(n, n);
    const auto want = xxh(b);
    for (std::size_t i = 0; i < n; i += (n > 64 ? 7 : 1)) {
      for (int bit = 0; bit < 8; ++bit) {
        b[i] ^= std::byte(1u << bit);
        CHECK(xxh(b) != want);
        b[i] ^= std::byte(1u << bit);
      }
    }
    CHECK(xxh(b) == want);
    CHECK(xxh(std::span<const std::byte>(b).first(n - 1)) != want);
    auto longer = b;
    longer.push_back(std::byte{0});  // a trailing zero byte is not invisible
    CHECK(xxh(longer) != want);
    if (n >= 16) {
      auto swapped = b;
      std::swap_ranges(swapped.begin(), swapped.begin() + 8, swapped.begin() + 8);
      CHECK(xxh(swapped) != want);
    }
  }
}

// ---------------------------------------------------------------------------------------
// End to end, in process: N sources train while M clone ranks fork; every rank's
// communicator is a fault-injecting decorator sharing one plan (empty: nothing injected).

namespace {

using fcomm = dc::faulty<dc::inproc::communicator>;
template <class Checksum>
using engine_with = dc::engine<fcomm, dc::shard::split_even, dc::pipeline::window, dc::reconstruct::scatter_exchange, Checksum>;

constexpr std::uint8_t sentinel = 0xA5;

/// Byte tensors of odd sizes (one split over the sources, one empty), in three layers.
struct model {
  std::vector<std::vector<std::uint8_t>> t;
  dc::state<std::vector<std::uint8_t>> state;
  explicit model(std::uint8_t fill) {
    for (std::size_t n : {300001u, 300001u, 4099u, 7u, 0u, 65537u}) t.emplace_back(n, fill);
    state.add_layer("embed", {{"weight", t[0]}, {"weight.momentum", t[1]}});
    state.add_layer("fc", {{"weight", t[2]}, {"bias", t[3]}, {"empty", t[4]}});
    state.add_layer("head", {{"weight", t[5]}});
  }
  model(const model&) = delete;
  /// Every byte is a function of (step, tensor, position): a stale or misplaced byte shows.
  void update(std::size_t l, std::uint64_t step) {
    for (auto& x : state.layer_tensors(l)) {
      const auto salt = splitmix(step * 1000003 + std::hash<std::string>{}(x.name) + (std::uint64_t{l} << 40));
      auto& v = *x.ref;
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::uint8_t>(splitmix(salt + i / 8) >> (8 * (i % 8)));
    }
    state.metadata().data_cursor = step * 7 + 3;
  }
  void become(std::uint64_t step) {
    for (std::size_t l = 0; l < state.layer_count(); ++l) update(l, step);
  }
  bool all(std::uint8_t b) const {
    for (auto& v : t)
      for (auto x : v)
        if (x != b) return false;
    return true;
  }
};

struct outcome {
  std::vector<std::optional<dc::errc>> code;
  std::vector<std::string> what;
  std::vector<std::vector<std::vector<std::uint8_t>>> got;
  std::vector<std::uint64_t> k, cursor;
  std::vector<dc::report> reports;
  std::vector<bool> sentinel_intact;
  std::vector<std::uint64_t> completed, failed;
  bool sources_stopped_on_signal = true;
};

template <class SourceEngine, class CloneEngine>
outcome fork_run(int n, int m, std::shared_ptr<dc::fault::plan> faults = std::make_shared<dc::fault::plan>()) {
  const auto roles = dc::roles::contiguous(n, m);
  const auto mm = static_cast<std::size_t>(m);
  outcome out;
  out.code.resize(mm);
  out.what.resize(mm);
  out.got.resize(mm);
  out.k.resize(mm);
  out.cursor.resize(mm);
  out.reports.resize(mm);
  out.sentinel_intact.resize(mm);
  out.completed.resize(static_cast<std::size_t>(n));
  out.failed.resize(static_cast<std::size_t>(n));
  std::atomic<int> clones_done{0}, sources_done{0};
  std::atomic<bool> hit_deadline{false};
  std::mutex mu;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  auto make = [](auto s) {
    s.timeout = 30s;                        // generous: the machine may be loaded
    s.failover_after = 2s;
    s.shard.threshold = 64 * 1024;          // the big tensors are split over the sources
    s.plan.max_piece_bytes = 96 * 1024;     // several pieces per tensor
    s.reconstruct.threshold = 16 * 1024;
    return s;
  };
  dc::inproc::world world(n + m);
  world.run([&](dc::inproc::communicator& inner) {
    fcomm comm(inner, faults);
    if (comm.rank() < n) {
      const auto i = static_cast<std::size_t>(comm.rank());
      model md(0);
      typename SourceEngine::template source<std::vector<std::uint8_t>> src(comm, roles, md.state,
                                                                            make(typename SourceEngine::settings{}));
      for (std::uint64_t step = 0;; ++step) {
        for (std::size_t l = md.state.layer_count(); l-- > 0;) {  // backward order, as an optimizer does
          src.before_update(l);
          md.update(l, step);
          src.after_update(l);
        }
        dc::barrier(inner, roles.sources, 10);  // the gradient allreduce
        src.end_iteration(step);
        int stop[2] = {clones_done.load() == m ? 1 : 0, std::chrono::steady_clock::now() > deadline ? 1 : 0};
        dc::allreduce_sum(inner, roles.sources, std::span<int>(stop), 12);  // all stop together
        if (stop[0] || stop[1]) {
          if (!stop[0]) hit_deadline = true;
          break;
        }
      }
      src.finish();
      out.completed[i] = src.sessions_completed();
      out.failed[i] = src.sessions_failed();
      ++sources_done;
    } else {
      const auto j = static_cast<std::size_t>(comm.rank() - n);
      model md(sentinel);
      {
        typename CloneEngine::template clone<std::vector<std::uint8_t>> dst(comm, roles, md.state,
                                                                           make(typename CloneEngine::settings{}));
        try {
          dst.request();
          dst.wait();
          std::lock_guard g(mu);
          out.reports[j] = dst.report();
          out.k[j] = dst.metadata().step;
          out.cursor[j] = dst.metadata().data_cursor;
          out.got[j] = md.t;
        } catch (const dc::error& e) {
          std::lock_guard g(mu);
          out.code[j] = e.kind();
          out.what[j] = e.what();
        }
        ++clones_done;
      }
      while (sources_done.load() < n) std::this_thread::sleep_for(1ms);
      out.sentinel_intact[j] = md.all(sentinel);
    }
  });
  out.sources_stopped_on_signal = !hit_deadline.load();
  return out;
}

void check_exact(const outcome& o) {
  for (std::size_t j = 0; j < o.k.size(); ++j) {
    CAPTURE(j);
    INFO("error: " << o.what[j]);
    REQUIRE_FALSE(o.code[j].has_value());
    model want(0);
    want.become(o.k[j]);
    CHECK(o.k[j] == o.k[0]);
    CHECK(o.got[j] == want.t);
    CHECK(o.cursor[j] == o.k[j] * 7 + 3);
    CHECK(o.reports[j].policies.find("/xxh3") != std::string::npos);
  }
  CHECK(o.sources_stopped_on_signal);
}

}  // namespace

TEST_CASE("a clone with checksum::xxh3 holds the sources' state of iteration k bit for bit") {
  using E = engine_with<dc::checksum::xxh3>;
  SUBCASE("3 sources, 2 clone ranks") { check_exact(fork_run<E, E>(3, 2)); }
  SUBCASE("2 sources, 3 clone ranks") { check_exact(fork_run<E, E>(2, 3)); }
}

TEST_CASE("checksum::xxh3 catches one bit flipped in flight; the piece comes again from another source") {
  using E = engine_with<dc::checksum::xxh3>;
  auto faults = std::make_shared<dc::fault::plan>();
  // The first large data message source 1 sends: one bit flipped (in a private copy).
  faults->add({.action = dc::fault::kind::corrupt, .from = 1, .tag_lo = 1016, .tag_hi = 1016 + 4 * 3,
               .min_size = 4097, .first = 1, .times = 1, .bytes = {12345}, .mask = 0x04});
  auto o = fork_run<E, E>(3, 2, faults);
  CHECK(faults->injected(dc::fault::kind::corrupt) == 1);
  check_exact(o);
  std::uint32_t refetched = 0;
  for (auto& r : o.reports) refetched += r.refetched_groups;
  CHECK(refetched >= 1);
}

TEST_CASE("sources on mix64 and a clone on xxh3 are refused with plan_mismatch") {
  auto o = fork_run<engine_with<dc::checksum::mix64>, engine_with<dc::checksum::xxh3>>(2, 1);
  INFO("message: " << o.what[0]);
  REQUIRE(o.code[0].has_value());
  CHECK(*o.code[0] == dc::errc::plan_mismatch);
  CHECK(o.what[0].find("checksum policy id") != std::string::npos);
  CHECK(o.sentinel_intact[0]);  // no byte was written into the clone
  for (std::size_t i = 0; i < o.completed.size(); ++i) {
    CAPTURE(i);
    CHECK(o.completed[i] == 0);
  }
  CHECK(o.sources_stopped_on_signal);  // the sources trained on and stopped normally
}
