// integrations/thrust.hpp on Thrust's CPP back-end: the same code nvcc builds for the GPU
// (tests/cuda), run by the CPU; thrust_staging also moves a partitioned transfer's parts.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>
#include <deepclone/integrations/thrust.hpp>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "../partition/transfer_run.hpp"

namespace dc = deepclone;

static_assert(THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_CUDA, "this test runs Thrust on the CPU");

namespace {
std::vector<std::byte> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937_64 g(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = std::byte(static_cast<std::uint8_t>(g()));
  return v;
}
}  // namespace

TEST_CASE("thrust_checksum equals checksum::mix64 on the same bytes") {
  auto buf = random_bytes((1 << 20) + 64, 1);
  for (std::size_t n : {0ul, 1ul, 7ul, 8ul, 9ul, 15ul, 16ul, 31ul, 32ul, 33ul, 255ul, 256ul, 1000ul, 4097ul, 65536ul + 5, 1ul << 20}) {
    for (std::size_t off : {0ul, 1ul, 3ul, 8ul}) {  // unaligned starts take the byte-wise path
      CAPTURE(n);
      CAPTURE(off);
      std::span<const std::byte> s(buf.data() + off, n);
      const auto want = dc::checksum::mix64::compute(s);
      CHECK(dc::thrust_checksum(s.data(), s.size(), thrust::device) == want);
      CHECK(dc::thrust_checksum(s.data(), s.size(), thrust::host) == want);
      CHECK(dc::thrust_checksum(s.data(), s.size()) == want);
      CHECK(dc::thrust_mix64<>::compute(s) == want);
    }
  }
  // thrust::device_vector storage
  thrust::device_vector<float> v(12345);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f - 7.f;
  auto bytes = dc::tensor_bytes(v);
  CHECK(dc::thrust_checksum(bytes.data(), bytes.size()) == dc::checksum::mix64::compute(bytes));
  // a flipped bit changes it
  auto before = dc::thrust_checksum(bytes.data(), bytes.size());
  bytes[777] ^= std::byte{0x10};
  CHECK(dc::thrust_checksum(bytes.data(), bytes.size()) != before);
  static_assert(dc::thrust_mix64<>::id == dc::checksum::mix64::id);
}

namespace {
struct dv_state {
  std::vector<thrust::device_vector<float>> t;
  dc::state<thrust::device_vector<float>> st;
  explicit dv_state(unsigned seed) {
    t.reserve(6);
    for (std::size_t n : {70000ul, 70000ul, 1001ul, 7ul, 33333ul, 0ul}) t.emplace_back(n);
    fill(seed);
    st.add_layer("embed", {{"weight", t[0]}, {"weight.momentum", t[1]}});
    st.add_layer("fc", {{"weight", t[2]}, {"bias", t[3]}, {"empty", t[5]}});
    st.add_layer("head", {{"weight", t[4]}});
  }
  void fill(unsigned seed) {
    for (std::size_t i = 0; i < t.size(); ++i) {
      auto b = dc::tensor_bytes(t[i]);
      auto r = random_bytes(b.size(), seed * 31 + static_cast<unsigned>(i));
      if (!b.empty()) std::memcpy(b.data(), r.data(), b.size());
    }
  }
  std::vector<std::byte> bytes() {
    std::vector<std::byte> out;
    for (auto& v : t) {
      auto b = dc::tensor_bytes(v);
      out.insert(out.end(), b.begin(), b.end());
    }
    return out;
  }
};
}  // namespace

TEST_CASE("pack and unpack a shard spanning several tensors") {
  dv_state a(7), b(8);
  const auto lay = a.st.describe();
  dc::plan_options o;
  o.max_piece_bytes = 16 * 1024;
  for (std::uint32_t n : {1u, 2u, 3u}) {
    CAPTURE(n);
    auto p = dc::make_plan(lay, n, 2, dc::shard::split_even{}, dc::reconstruct::direct{}, o);
    std::uint64_t covered = 0;
    for (std::uint32_t s = 0; s < n; ++s)
      for (std::size_t l = 0; l < lay.layer_count(); ++l) {
        auto segs = dc::shard_segments(p, a.st, s, l);
        const auto size = dc::packed_size(segs);
        thrust::device_vector<std::byte> buf(size);
        auto* out = thrust::raw_pointer_cast(buf.data());
        CHECK(dc::pack(thrust::device, segs, out) == size);
        // the packed buffer is the segments' bytes back to back
        std::vector<std::byte> want;
        for (auto& g : segs) want.insert(want.end(), g.data + g.offset, g.data + g.offset + g.length);
        CHECK(std::memcmp(out, want.data(), size) == 0);
        CHECK(dc::thrust_checksum(out, size) == dc::checksum::mix64::compute(want));
        // scatter into the other replica's same ranges
        auto other = dc::shard_segments(p, b.st, s, l);
        CHECK(dc::unpack(thrust::device, out, std::span<const dc::segment>(other)) == size);
        covered += size;
      }
    CHECK(covered == lay.total_bytes());
    CHECK(b.bytes() == a.bytes());  // every source's shards together restore the whole state
    b.fill(99);
  }
}

TEST_CASE("tensor traits of thrust::device_vector and device views") {
  using V = thrust::device_vector<float>;
  static_assert(dc::tensor<V> && dc::placed_tensor<V>);
  static_assert(dc::thrust_device_space == dc::memory_space::host);  // CPP back-end: host memory
  V v(100);
  CHECK(dc::tensor_traits<V>::size_bytes(v) == 400);
  CHECK(dc::tensor_dtype(v) == dc::dtype::f32);
  CHECK(dc::tensor_space(v) == dc::memory_space::host);
  CHECK(dc::tensor_shape(v) == std::vector<std::int64_t>{100});
  CHECK(dc::tensor_bytes(v).data() == reinterpret_cast<std::byte*>(thrust::raw_pointer_cast(v.data())));
  thrust::device_vector<double> d(6);
  CHECK(dc::tensor_dtype(d) == dc::dtype::f64);

  auto raw = dc::device_view(thrust::raw_pointer_cast(v.data()), 100, {10, 10});
  CHECK(dc::tensor_space(raw) == dc::memory_space::device);  // a raw pointer is whatever the caller says it is
  CHECK(dc::tensor_shape(raw) == std::vector<std::int64_t>{10, 10});
  auto viaptr = dc::device_view(v.data(), 100);
  CHECK(dc::tensor_space(viaptr) == dc::thrust_device_space);

  // Device memory is refused by the core engine's host pipelines, with a clear error.
  dc::inproc::world w(2);
  w.run([&](dc::inproc::communicator& c) {
    if (c.rank() != 0) return;
    std::vector<dc::raw_view<float>> views{raw};
    dc::state<dc::raw_view<float>> st;
    st.add_layer("l", {{"w", views[0]}});
    using E = dc::engine<dc::inproc::communicator>;
    CHECK_THROWS_WITH_AS(E::source<dc::raw_view<float>>(c, dc::roles::contiguous(1, 1), st),
                         doctest::Contains("device memory"), dc::error);
  });
}

TEST_CASE("clone of thrust::device_vector tensors through the core engine (CPP back-end)") {
  using comm = dc::inproc::communicator;
  using E = dc::engine<comm, dc::shard::split_even, dc::pipeline::staged, dc::reconstruct::scatter_exchange,
                       dc::thrust_mix64<>>;
  const int n = 2, m = 2;
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world world(n + m);
  std::atomic<int> done{0};
  std::mutex mu;
  std::vector<std::vector<std::byte>> got(m);
  std::vector<std::uint64_t> k(m);
  world.run([&](comm& c) {
    dv_state r(0);
    E::settings s;
    s.timeout = std::chrono::seconds(30);
    s.plan.max_piece_bytes = 64 * 1024;
    s.pipeline.staging_bytes = 100 * 1024;
    if (c.rank() < n) {
      E::source<thrust::device_vector<float>> src(c, roles, r.st, s);
      int after = 0;
      for (std::uint64_t step = 0; step < 400 && after < 3; ++step) {
        for (std::size_t l = r.st.layer_count(); l-- > 0;) {
          src.before_update(l);
          for (auto& t : r.st.layer_tensors(l))  // the "update": a Thrust transform on the tensor
            thrust::transform(thrust::device, t.ref->begin(), t.ref->end(), t.ref->begin(),
                              [step](float x) { return x * 0.5f + static_cast<float>(step); });
          src.after_update(l);
        }
        dc::barrier(c, roles.sources, 10);
        src.end_iteration(step);
        int d = done.load();
        dc::allreduce_sum(c, roles.sources, std::span<int>(&d, 1), 12);
        if (d == m * n) ++after;
      }
      src.finish();
      CHECK(src.sessions_completed() == 1);
    } else {
      E::clone<thrust::device_vector<float>> dst(c, roles, r.st, s);
      r.fill(1234);  // garbage that must be overwritten
      dst.request();
      dst.wait();
      std::lock_guard g(mu);
      got[c.rank() - n] = r.bytes();
      k[c.rank() - n] = dst.report().iteration;
      done += n;
    }
  });
  dv_state want(0);
  for (std::uint64_t step = 0; step <= k[0]; ++step)
    for (auto& v : want.t)
      thrust::transform(thrust::device, v.begin(), v.end(), v.begin(), [step](float x) { return x * 0.5f + static_cast<float>(step); });
  CHECK(k[0] == k[1]);
  CHECK(got[0] == want.bytes());
  CHECK(got[1] == want.bytes());
}

namespace {
/// A staged pipeline policy that provides its own staging memory and copy, like
/// cuda::staged_device, but with host memory: exercises staged_base's ring provider
/// customization point without a GPU.
struct mock_device_staging : dc::pipeline::staged_base<mock_device_staging> {
  static constexpr const char* name = "mock_device";
  mock_device_staging() { staging_bytes = 100 * 1024; }
  std::shared_ptr<std::vector<std::byte>> mem;
  std::shared_ptr<std::atomic<int>> device_copies = std::make_shared<std::atomic<int>>(0);
  bool moves(dc::memory_space) const { return true; }
  std::span<std::byte> staging(std::size_t n) {
    mem = std::make_shared<std::vector<std::byte>>(n);
    return *mem;
  }
  void copy(std::span<std::byte> to, std::span<const std::byte> from, dc::memory_space sp) {
    REQUIRE(to.size() == from.size());
    REQUIRE(to.data() >= mem->data());
    REQUIRE(to.data() + to.size() <= mem->data() + mem->size());
    std::memcpy(to.data(), from.data(), from.size());
    if (sp == dc::memory_space::device) ++*device_copies;
  }
};
}  // namespace

TEST_CASE("a staged pipeline providing its own ring lets the source engine stage device tensors") {
  using comm = dc::inproc::communicator;
  using E = dc::engine<comm, dc::shard::split_even, mock_device_staging, dc::reconstruct::direct>;
  static_assert(dc::pipeline_policy<mock_device_staging>);
  const int n = 2, m = 1;
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world world(n + m);
  std::atomic<int> done{0};
  std::vector<std::byte> got;
  std::uint64_t k = 0;
  std::vector<int> staged(n, 0);
  world.run([&](comm& c) {
    dv_state r(0);
    // Views of the same memory, tagged as device memory on the sources (host on the clone).
    std::vector<dc::raw_view<float>> views;
    const auto space = c.rank() < n ? dc::memory_space::device : dc::memory_space::host;
    for (auto& t : r.t) views.emplace_back(thrust::raw_pointer_cast(t.data()), t.size(), std::vector<std::int64_t>{}, space);
    dc::state<dc::raw_view<float>> st;
    st.add_layer("embed", {{"weight", views[0]}, {"weight.momentum", views[1]}});
    st.add_layer("fc", {{"weight", views[2]}, {"bias", views[3]}, {"empty", views[5]}});
    st.add_layer("head", {{"weight", views[4]}});
    E::settings s;
    s.timeout = std::chrono::seconds(30);
    if (c.rank() < n) {
      E::source<dc::raw_view<float>> src(c, roles, st, s);
      int after = 0;
      for (std::uint64_t step = 0; step < 400 && after < 3; ++step) {
        for (std::size_t l = st.layer_count(); l-- > 0;) {
          src.before_update(l);
          for (auto& t : r.st.layer_tensors(l))
            thrust::transform(thrust::device, t.ref->begin(), t.ref->end(), t.ref->begin(),
                              [step](float x) { return x * 0.5f + static_cast<float>(step); });
          src.after_update(l);
        }
        dc::barrier(c, roles.sources, 10);
        src.end_iteration(step);
        int d = done.load();
        dc::allreduce_sum(c, roles.sources, std::span<int>(&d, 1), 12);
        if (d == m * n) ++after;
      }
      src.finish();
      CHECK(src.sessions_completed() == 1);
      staged[c.rank()] = s.pipeline.device_copies->load();
    } else {
      E::clone<dc::raw_view<float>> dst(c, roles, st, s);
      r.fill(1234);
      dst.request();
      dst.wait();
      got = r.bytes();
      k = dst.report().iteration;
      done += n;
    }
  });
  dv_state want(0);
  for (std::uint64_t step = 0; step <= k; ++step)
    for (auto& v : want.t)
      thrust::transform(thrust::device, v.begin(), v.end(), v.begin(), [step](float x) { return x * 0.5f + static_cast<float>(step); });
  CHECK(got == want.bytes());
  CHECK(staged[0] > 0);  // every piece went through the policy's copy
  CHECK(staged[1] > 0);
}

TEST_CASE("thrust_staging gathers runs into a host buffer and scatters them back, bit for bit") {
  thrust::device_vector<std::byte> dev(100000);
  const auto src = random_bytes(dev.size(), 5);
  thrust::copy(src.begin(), src.end(), dev.begin());
  auto* d = thrust::raw_pointer_cast(dev.data());
  dc::thrust_staging<> memory;
  for (const auto& cuts : std::vector<std::vector<std::pair<std::size_t, std::size_t>>>{
           {{0, 100000}}, {{7, 1}}, {{0, 0}}, {{10, 300}, {5000, 64}, {99990, 10}}, {{40000, 20000}, {0, 3}, {70000, 0}, {12, 999}}}) {
    CAPTURE(cuts.size());
    std::vector<std::span<const std::byte>> runs;
    std::vector<std::span<std::byte>> into;
    std::vector<std::byte> want;
    for (auto [at, n] : cuts) {
      runs.emplace_back(d + at, n);
      want.insert(want.end(), src.begin() + static_cast<std::ptrdiff_t>(at), src.begin() + static_cast<std::ptrdiff_t>(at + n));
    }
    std::vector<std::byte> host(want.size(), std::byte{0xEE});
    memory.gather(runs, host);
    CHECK(host == want);
    // Scatter them into a second device buffer at the same places: those bytes, nothing else.
    thrust::device_vector<std::byte> other(dev.size(), std::byte{0x11});
    for (auto [at, n] : cuts) into.emplace_back(thrust::raw_pointer_cast(other.data()) + at, n);
    memory.scatter(host, into);
    std::vector<std::byte> back(other.size());
    thrust::copy(other.begin(), other.end(), back.begin());
    std::vector<std::byte> expect(dev.size(), std::byte{0x11});
    for (auto [at, n] : cuts) std::copy_n(src.begin() + static_cast<std::ptrdiff_t>(at), n, expect.begin() + static_cast<std::ptrdiff_t>(at));
    CHECK(back == expect);
  }
}

TEST_CASE("a partitioned transfer between parts staged by thrust_staging arrives byte-exact (CPP back-end)") {
  using staged = dc::thrust_staging<>;
  for (const auto& opt : {dc::partition_group_options{}, dc::partition_group_options{16, 64}}) {
    for (const auto& s : {partition_test::zero1(), partition_test::tp2_dp2(), partition_test::pipeline_2x2(true)})
      partition_test::check_exact<staged, staged>(s, opt);
  }
}
