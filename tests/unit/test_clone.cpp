// End-to-end clones on the in-process transport, for every sharding x pipeline x
// reconstruction combination, N in {1,2,3,4} sources and M in {1,2,3} clone ranks. The
// sources keep training (overwriting every tensor each iteration) while the clone is in
// flight; each clone rank must hold the state of the agreed iteration k bit for bit,
// optimizer slots and metadata included.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <optional>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dc = deepclone;

namespace {

std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

/// A replica of a training state made of raw byte tensors with varied dtypes and sizes:
/// a split-size weight, odd sizes, a zero-byte tensor, an optimizer slot per weight.
struct replica {
  std::vector<std::vector<float>> f32;
  std::vector<std::vector<double>> f64;
  std::vector<std::vector<std::uint8_t>> u8;
  dc::state<dc::raw_view<std::uint8_t>> state;
  std::vector<dc::raw_view<std::uint8_t>> views;

  replica() {
    f32 = {std::vector<float>(70000), std::vector<float>(70000), std::vector<float>(1001), std::vector<float>(1001),
           std::vector<float>(7), std::vector<float>(0), std::vector<float>(33333), std::vector<float>(33333)};
    f64 = {std::vector<double>(5000), std::vector<double>(3)};
    u8 = {std::vector<std::uint8_t>(12345)};
    auto view = [&](auto& v) {
      views.emplace_back(reinterpret_cast<std::uint8_t*>(v.data()), v.size() * sizeof(v[0]));
    };
    views.reserve(16);
    for (auto& v : f32) view(v);
    for (auto& v : f64) view(v);
    for (auto& v : u8) view(v);
    auto& w = views;
    state.add_layer("embed", {{"weight", w[0]}, {"weight.momentum", w[1]}});
    state.add_layer("fc1", {{"weight", w[2]}, {"weight.momentum", w[3]}, {"bias", w[4]}, {"empty", w[5]}});
    state.add_layer("norm", {{"running_mean", w[8]}, {"num_batches", w[9]}});
    state.add_layer("frozen", {{"table", w[10]}});
    state.add_layer("head", {{"weight", w[6]}, {"weight.momentum", w[7]}});
  }

  /// The "update" of layer l in iteration `step`: every byte becomes a function of
  /// (step, tensor, position), so any stale or misplaced byte is caught.
  void update(std::size_t l, std::uint64_t step) {
    for (auto& t : state.layer_tensors(l)) {
      auto b = dc::tensor_bytes(*t.ref);
      std::uint64_t salt = mix(std::hash<std::string>{}(t.name) ^ (l << 40) ^ (step * 0x9E3779B97F4A7C15ull));
      for (std::size_t i = 0; i < b.size(); i += 8) {
        const std::uint64_t word = mix(salt + i / 8);
        std::memcpy(b.data() + i, &word, std::min<std::size_t>(8, b.size() - i));
      }
    }
  }
  /// Trains one iteration the way a trainer does: layers in backward order. Layer 3 is
  /// frozen after step 2 (not updated), so its bytes at k come from an earlier iteration.
  template <class Src>
  void iterate(Src* src, std::uint64_t step) {
    for (std::size_t l = state.layer_count(); l-- > 0;) {
      if (l == 3 && step > 2) continue;
      if (src) src->before_update(l);
      update(l, step);
      if (src) src->after_update(l);
    }
    iterate_metadata(step);
  }
  void iterate_metadata(std::uint64_t step) {
    auto& m = state.metadata();
    m.data_cursor = step * 7 + 3;
    m.rng.assign(16, std::byte(step & 0xff));
    m.hyper["lr"] = 0.1 / static_cast<double>(step + 1);
    m.user.assign(100, std::byte(0x5a));
  }
  /// The state after iteration k, computed directly: every update overwrites a layer, so
  /// each layer holds the bytes of the last iteration <= k that updated it.
  void become(std::uint64_t k) {
    for (std::size_t l = 0; l < state.layer_count(); ++l) update(l, l == 3 ? std::min<std::uint64_t>(k, 2) : k);
    iterate_metadata(k);
  }
  std::vector<std::byte> bytes() {
    std::vector<std::byte> out;
    for (std::size_t t = 0; t < 11; ++t) {
      auto b = dc::tensor_bytes(views[t]);
      out.insert(out.end(), b.begin(), b.end());
    }
    return out;
  }
};

struct small_settings {
  template <class S>
  static S make() {
    S s;
    s.timeout = std::chrono::seconds(30);
    s.plan.max_piece_bytes = 96 * 1024;  // cut big pieces: exercises several messages per tensor
    if constexpr (requires { s.shard.threshold; }) s.shard.threshold = 64 * 1024;
    if constexpr (requires { s.reconstruct.threshold; }) s.reconstruct.threshold = 16 * 1024;
    if constexpr (requires { s.pipeline.staging_bytes; }) s.pipeline.staging_bytes = 200 * 1024;  // ring wraps
    return s;
  }
};

template <class Engine>
void clone_once(int n, int m, unsigned delay_ms) {
  using settings = typename Engine::settings;
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world world(n + m);
  std::atomic<int> clones_done{0};
  std::mutex mu;
  std::vector<std::vector<std::byte>> got(static_cast<std::size_t>(m));
  std::vector<dc::metadata> meta(static_cast<std::size_t>(m));
  std::vector<std::uint64_t> k(static_cast<std::size_t>(m));
  std::vector<dc::report> reports(static_cast<std::size_t>(m));
  world.run([&](dc::inproc::communicator& comm) {
    replica r;
    if (comm.rank() < n) {
      typename Engine::template source<dc::raw_view<std::uint8_t>> src(comm, roles, r.state, small_settings::make<settings>());
      int after = 0;
      for (std::uint64_t step = 0; step < 400 && after < 3; ++step) {
        r.iterate(&src, step);
        dc::barrier(comm, roles.sources, 10);  // the sources' gradient allreduce
        src.end_iteration(step);
        int done = clones_done.load();
        dc::allreduce_sum(comm, roles.sources, std::span<int>(&done, 1), 12);  // all stop together
        if (done == m * n) ++after;
      }
      src.finish();
      CHECK_MESSAGE(src.sessions_completed() == 1, "source " << comm.rank() << ": "
                                                   << (src.last_error() ? src.last_error()->what : "no session"));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      typename Engine::template clone<dc::raw_view<std::uint8_t>> dst(comm, roles, r.state, small_settings::make<settings>());
      dst.request();
      dst.wait_layer(0);
      dst.wait();
      auto rep = dst.report();
      auto j = static_cast<std::size_t>(comm.rank() - n);
      std::lock_guard g(mu);
      got[j] = r.bytes();
      meta[j] = dst.metadata();
      k[j] = rep.iteration;
      reports[j] = rep;
      clones_done += n;
    }
  });
  for (int j = 0; j < m; ++j) {
    CAPTURE(j);
    // The expected state of iteration k, replayed from scratch.
    replica want;
    want.become(k[j]);
    want.state.metadata().step = k[j];
    CHECK(k[j] == k[0]);
    CHECK(got[j] == want.bytes());
    CHECK(meta[j] == want.state.metadata());
    const auto& rep = reports[j];
    CHECK(rep.state_bytes == want.bytes().size());
    CHECK(rep.sources.size() == static_cast<std::size_t>(n));
    CHECK(rep.clones.size() == static_cast<std::size_t>(m));
    std::uint64_t received = 0;
    for (auto& c : rep.clones) received += c.bytes_from_sources + c.bytes_from_clones;
    CHECK(received == rep.state_bytes * static_cast<std::uint64_t>(m));
    std::uint64_t sent = 0;
    for (auto& s : rep.sources) sent += s.bytes_sent;
    std::uint64_t from_sources = 0;
    for (auto& c : rep.clones) from_sources += c.bytes_from_sources;
    CHECK(sent == from_sources);
    CHECK(rep.readiness_s >= rep.first_layer_s);
    CHECK(rep.layer_ready_s.size() == 5);
  }
}

template <class Engine>
void clone_all_sizes() {
  unsigned delay = 0;
  for (int n = 1; n <= 4; ++n)
    for (int m = 1; m <= 3; ++m) {
      CAPTURE(n);
      CAPTURE(m);
      clone_once<Engine>(n, m, delay);
      delay = (delay + 7) % 20;  // clones that ask while the sources are already well under way
    }
}

using comm = dc::inproc::communicator;
template <class Shard, class Pipeline>
struct both {
  using direct = dc::engine<comm, Shard, Pipeline, dc::reconstruct::direct>;
  using scatter = dc::engine<comm, Shard, Pipeline, dc::reconstruct::scatter_exchange>;
};

}  // namespace

#define DEEPCLONE_PIPELINES(Shard)                                                                                \
  both<Shard, dc::pipeline::window>::direct, both<Shard, dc::pipeline::window>::scatter,                          \
      both<Shard, dc::pipeline::staged>::direct, both<Shard, dc::pipeline::staged>::scatter,                      \
      both<Shard, dc::pipeline::blocking>::direct, both<Shard, dc::pipeline::blocking>::scatter

TEST_CASE_TEMPLATE("clone equals the sources' state of iteration k (split_even)", E, DEEPCLONE_PIPELINES(dc::shard::split_even)) {
  clone_all_sizes<E>();
}
TEST_CASE_TEMPLATE("clone equals the sources' state of iteration k (whole_tensor)", E, DEEPCLONE_PIPELINES(dc::shard::whole_tensor)) {
  clone_all_sizes<E>();
}
TEST_CASE_TEMPLATE("clone equals the sources' state of iteration k (layer_round_robin)", E,
                   DEEPCLONE_PIPELINES(dc::shard::layer_round_robin)) {
  clone_all_sizes<E>();
}
TEST_CASE_TEMPLATE("clone equals the sources' state of iteration k (single_root)", E, DEEPCLONE_PIPELINES(dc::shard::single_root)) {
  clone_all_sizes<E>();
}

TEST_CASE("checksum::none still delivers the exact bytes") {
  clone_once<dc::engine<comm, dc::shard::split_even, dc::pipeline::window, dc::reconstruct::scatter_exchange, dc::checksum::none>>(3, 2, 0);
}

TEST_CASE("a source engine serves a second clone after the first one") {
  using E = dc::engine<comm>;
  const int n = 2, m = 1;
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world world(n + m);
  std::atomic<int> done{0};
  std::vector<std::uint64_t> ks;
  world.run([&](dc::inproc::communicator& c) {
    replica r;
    if (c.rank() < n) {
      E::source src(c, roles, r.state, small_settings::make<E::settings>());
      for (std::uint64_t step = 0; step < 1000; ++step) {
        r.iterate(&src, step);
        dc::barrier(c, roles.sources, 10);
        src.end_iteration(step);
        int d[2] = {done.load(), src.cloning() ? 1 : 0};  // agree, so that all sources stop together
        dc::allreduce_sum(c, roles.sources, std::span<int>(d, 2), 12);
        if (d[0] == 2 * n * n && d[1] == 0) break;
      }
      src.finish();
      CHECK(src.sessions_completed() == 2);
    } else {
      E::clone dst(c, roles, r.state, small_settings::make<E::settings>());
      std::vector<dc::progress> seen;
      dst.on_progress([&](const dc::progress& p) { seen.push_back(p); });
      for (int round = 0; round < 2; ++round) {
        seen.clear();
        dst.request();
        dst.wait();
        ks.push_back(*dst.fork_iteration());
        // The progress callback: each layer once, in the order they became ready, then the completion.
        const std::size_t L = r.state.describe().layer_count();
        REQUIRE(seen.size() == L + 1);
        std::vector<int> layers_seen(L, 0);
        for (std::size_t i = 0; i < L; ++i) {
          REQUIRE(seen[i].layer.has_value());
          ++layers_seen[*seen[i].layer];
          CHECK(seen[i].layers_ready == i + 1);
          CHECK(seen[i].iteration == ks.back());
          CHECK_FALSE(seen[i].complete);
          if (i) CHECK(seen[i].seconds >= seen[i - 1].seconds);
          if (i) CHECK(seen[i].bytes_ready > seen[i - 1].bytes_ready);
        }
        CHECK(std::all_of(layers_seen.begin(), layers_seen.end(), [](int x) { return x == 1; }));
        CHECK(seen.back().complete);
        CHECK_FALSE(seen.back().layer.has_value());
        CHECK(seen.back().bytes_ready == seen.back().bytes_total);
        CHECK(seen.back().bytes_total == r.state.describe().total_bytes());
        CHECK(seen.back().seconds == doctest::Approx(dst.report().readiness_s));
        replica want;
        want.become(ks.back());
        CHECK(r.bytes() == want.bytes());
        done += n;
      }
    }
  });
  REQUIRE(ks.size() == 2);
  CHECK(ks[1] > ks[0]);
}

namespace {
std::string printed_by(dc::progress_line& line, const std::vector<dc::progress>& events, std::FILE* f) {
  for (auto& p : events) line(p);
  std::fflush(f);
  std::rewind(f);
  std::string text;
  for (int ch; (ch = std::fgetc(f)) != EOF;) text += static_cast<char>(ch);
  return text;
}
dc::progress at(double s, std::size_t ready, bool complete = false) {
  dc::progress p;
  p.iteration = 7;
  p.layer = complete ? std::nullopt : std::optional<std::size_t>(ready - 1);
  p.layers_ready = ready;
  p.layer_count = 4;
  p.bytes_ready = ready * 1'000'000;
  p.bytes_total = 4'000'000;
  p.seconds = s;
  p.complete = complete;
  return p;
}
}  // namespace

TEST_CASE("progress_line: silent for a quick clone, one line per interval and the completion for a slow one") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  dc::progress_line quick("clone", f);
  CHECK(printed_by(quick, {at(0.1, 1), at(0.2, 2), at(0.3, 3), at(0.4, 4), at(0.5, 4, true)}, f).empty());
  std::fclose(f);

  f = std::tmpfile();
  REQUIRE(f);
  dc::progress_line slow("clone rank 0", f, 1.0, 0.5);
  auto text = printed_by(slow, {at(0.5, 1), at(1.2, 2), at(1.4, 3), at(1.8, 4), at(1.9, 4, true)}, f);
  std::fclose(f);
  CHECK(text ==
        "clone rank 0: iteration 7: 2/4 layers, 2.0 of 4.0 MB, 1.2 s\n"
        "clone rank 0: iteration 7: 4/4 layers, 4.0 of 4.0 MB, 1.8 s\n"
        "clone rank 0: iteration 7: 4/4 layers, 4.0 of 4.0 MB, 1.9 s, complete\n");
}

TEST_CASE("to_string(report): figures never measured read 'unmeasured', not nan") {
  dc::report r;
  r.sources.push_back({.rank = 0, .bytes_sent = 10, .hook_s = 0.5, .overhead_s = NAN, .normal_iteration_s = NAN,
                       .fork_iterations = 1, .failed = true});
  r.clones.push_back({.rank = 2, .bytes_from_sources = 10, .bytes_from_clones = 0, .readiness_s = NAN, .standby_s = 0.25,
                      .first_layer_s = 0});
  auto text = dc::to_string(r);
  CHECK(text.find("nan") == std::string::npos);
  CHECK(text.find("overhead unmeasured over 1 iteration(s) (normal iteration unmeasured) [failed]") != std::string::npos);
  CHECK(text.find("readiness unmeasured, standby 0.2500 s") != std::string::npos);
}
