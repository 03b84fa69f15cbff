// CUDA tests of integrations/thrust.hpp and integrations/cuda.hpp, run on a GPU; without a
// usable GPU the executable reports SKIPPED and exits 77 (CTest SKIP_RETURN_CODE).
//   - device checksum (Thrust CUDA back-end) == host checksum on the same bytes;
//   - pack/unpack of a shard spanning several device tensors;
//   - thrust::device_vector traits report device memory;
//   - the staging ring never makes the training stream wait (shown with CUDA events);
//   - a clone of device tensors between in-process ranks, bitwise equal at the fork;
//   - a partitioned transfer between device parts staged by thrust_staging, byte-exact.
#include "check.hpp"

#include <deepclone/deepclone.hpp>
#include <deepclone/integrations/cuda.hpp>
#include <deepclone/integrations/thrust.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include <thrust/sequence.h>
#include <thrust/transform.h>

#include "../partition/scenarios.hpp"

namespace dc = deepclone;
using dc::cuda::check;

static_assert(THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA);
static_assert(dc::thrust_device_space == dc::memory_space::device);

namespace {

std::vector<std::byte> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937_64 g(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = std::byte(static_cast<std::uint8_t>(g()));
  return v;
}

__device__ std::uint64_t now_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
/// Busy-waits `ns` nanoseconds on the GPU, then fills `p` with `v`: a stand-in for a layer update.
__global__ void spin_then_fill(float* p, std::size_t n, float v, std::uint64_t ns) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    auto t0 = now_ns();
    while (now_ns() - t0 < ns) {
    }
  }
  __syncthreads();
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) p[i] = v;
}

struct step_update {
  float step;
  __host__ __device__ float operator()(float x) const { return x * 0.5f + step; }
};
struct init_value {
  float seed;
  __host__ __device__ float operator()(std::uint32_t i) const { return static_cast<float>(i % 1000) * 0.001f + seed; }
};

std::vector<std::byte> to_host(std::span<std::byte> dev) {
  std::vector<std::byte> h(dev.size());
  if (!h.empty()) check(cudaMemcpy(h.data(), dev.data(), dev.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return h;
}

}  // namespace

TEST("device checksum equals host checksum") {
  auto host = random_bytes((64u << 20) + 64, 3);
  thrust::device_vector<std::byte> dev(host.size());
  check(cudaMemcpy(thrust::raw_pointer_cast(dev.data()), host.data(), host.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
  const std::byte* d = thrust::raw_pointer_cast(dev.data());
  for (std::size_t n : {0ul, 1ul, 7ul, 8ul, 9ul, 255ul, 256ul, 4097ul, 1ul << 20, (1ul << 20) + 3, 64ul << 20}) {
    for (std::size_t off : {0ul, 1ul, 5ul, 8ul, 256ul}) {
      auto want = dc::checksum::mix64::compute(std::span<const std::byte>(host.data() + off, n));
      auto got = dc::thrust_checksum(d + off, n, thrust::device);
      CHECK_MSG(got == want, "n=%zu off=%zu", n, off);
    }
  }
  dc::cuda::stream s;
  CHECK(dc::thrust_checksum(d, 12345, thrust::cuda::par.on(s)) ==
        dc::checksum::mix64::compute(std::span<const std::byte>(host.data(), 12345)));
}

TEST("pack and unpack a shard spanning several device tensors") {
  std::vector<thrust::device_vector<float>> a, b;
  for (std::size_t n : {70000ul, 1001ul, 7ul, 33333ul}) {
    a.emplace_back(n);
    b.emplace_back(n, 0.f);
    thrust::transform(thrust::counting_iterator<std::uint32_t>(0), thrust::counting_iterator<std::uint32_t>(n), a.back().begin(),
                      init_value{static_cast<float>(n)});
  }
  dc::state<thrust::device_vector<float>> sa, sb;
  sa.add_layer("x", {{"w", a[0]}, {"m", a[1]}});
  sa.add_layer("y", {{"w", a[2]}, {"b", a[3]}});
  sb.add_layer("x", {{"w", b[0]}, {"m", b[1]}});
  sb.add_layer("y", {{"w", b[2]}, {"b", b[3]}});
  dc::plan_options o;
  o.max_piece_bytes = 16 * 1024;
  auto p = dc::make_plan(sa.describe(), 3, 2, dc::shard::split_even{}, dc::reconstruct::direct{}, o);
  for (std::uint32_t s = 0; s < 3; ++s)
    for (std::size_t l = 0; l < 2; ++l) {
      auto segs = dc::shard_segments(p, sa, s, l);
      thrust::device_vector<std::byte> buf(dc::packed_size(segs));
      auto* out = thrust::raw_pointer_cast(buf.data());
      CHECK(dc::pack(thrust::device, segs, out) == buf.size());
      std::vector<std::byte> want;
      for (auto& g : segs) {
        auto h = to_host({g.data + g.offset, g.length});
        want.insert(want.end(), h.begin(), h.end());
      }
      CHECK(to_host({out, buf.size()}) == want);
      CHECK(dc::thrust_checksum(out, buf.size()) == dc::checksum::mix64::compute(want));
      auto other = dc::shard_segments(p, sb, s, l);
      CHECK(dc::unpack(thrust::device, out, std::span<const dc::segment>(other)) == buf.size());
    }
  for (std::size_t t = 0; t < a.size(); ++t) CHECK(to_host(dc::tensor_bytes(a[t])) == to_host(dc::tensor_bytes(b[t])));
}

TEST("thrust::device_vector is a device tensor") {
  thrust::device_vector<float> v(10);
  CHECK(dc::tensor_space(v) == dc::memory_space::device);
  CHECK(dc::tensor_traits<thrust::device_vector<float>>::size_bytes(v) == 40);
  CHECK(dc::tensor_space(dc::device_view(v.data(), 10)) == dc::memory_space::device);
}

TEST("staging never makes the training stream wait") {
  const std::size_t n = 16u << 20;  // 64 MiB layer
  float *layer = nullptr, *other = nullptr;
  check(cudaMalloc(&layer, n * 4), "cudaMalloc");
  check(cudaMalloc(&other, n * 4), "cudaMalloc");
  dc::cuda::stream train;
  dc::cuda::staging_ring ring(n * 4);
  dc::cuda::event t0(true), t1(true), t2(true), b0(true), b1(true), copied(true);
  const std::uint64_t spin_ns = 30'000'000;  // 30 ms "update"
  // B alone: how long the next layer's work takes when nothing else runs.
  b0.record(train);
  spin_then_fill<<<64, 256, 0, train>>>(other, n, 2.f, spin_ns);
  b1.record(train);
  b1.synchronize();
  const float alone = dc::cuda::event::elapsed_ms(b0, b1);
  // A: update of `layer`; stage it right after (as after_update does); then B.
  t0.record(train);
  spin_then_fill<<<64, 256, 0, train>>>(layer, n, 1.f, spin_ns);
  t1.record(train);
  auto h0 = std::chrono::steady_clock::now();
  auto slot = ring.stage({reinterpret_cast<std::byte*>(layer), n * 4}, train);
  copied.record(ring.copy_stream());
  double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
  spin_then_fill<<<64, 256, 0, train>>>(other, n, 3.f, spin_ns);
  t2.record(train);
  CHECK(slot.has_value());
  CHECK_MSG(host_ms < 10, "stage() blocked the host for %.2f ms", host_ms);
  CHECK(!ring.ready(*slot));  // the update is still running: the copy is queued behind it
  t2.synchronize();
  copied.synchronize();
  const float a_end = dc::cuda::event::elapsed_ms(t0, t1), b_end = dc::cuda::event::elapsed_ms(t0, t2),
              copy_end = dc::cuda::event::elapsed_ms(t0, copied);
  std::printf("  update %.2f ms, next update alone %.2f ms / with staging %.2f ms, copy done at %.2f ms\n", a_end, alone,
              b_end - a_end, copy_end);
  CHECK_MSG(copy_end >= a_end, "the copy finished before the update it must follow");
  CHECK_MSG(b_end - a_end < alone * 1.2f + 1.f, "the training stream was slowed by staging");
  CHECK_MSG(copy_end < b_end, "the copy did not overlap the next update");
  CHECK(ring.ready(*slot));
  std::vector<float> got(n);
  std::memcpy(got.data(), slot->bytes.data(), n * 4);
  bool ones = true;
  for (float x : got) ones &= x == 1.f;
  CHECK_MSG(ones, "staged bytes are not the state after the update");
  ring.release();
  CHECK(ring.in_use() == 0);
  cudaFree(layer);
  cudaFree(other);
}

namespace {
struct device_replica {
  std::vector<thrust::device_vector<float>> t;
  dc::state<thrust::device_vector<float>> st;
  explicit device_replica(float seed) {
    t.reserve(6);
    for (std::size_t n : {300000ul, 300000ul, 1001ul, 7ul, 65536ul, 0ul}) {
      t.emplace_back(n);
      thrust::transform(thrust::counting_iterator<std::uint32_t>(0), thrust::counting_iterator<std::uint32_t>(n),
                        t.back().begin(), init_value{seed});
    }
    st.add_layer("embed", {{"weight", t[0]}, {"weight.momentum", t[1]}});
    st.add_layer("fc", {{"weight", t[2]}, {"bias", t[3]}, {"empty", t[5]}});
    st.add_layer("head", {{"weight", t[4]}});
  }
  std::vector<std::byte> bytes() {
    std::vector<std::byte> out;
    for (auto& v : t) {
      auto h = to_host(dc::tensor_bytes(v));
      out.insert(out.end(), h.begin(), h.end());
    }
    return out;
  }
};
}  // namespace

TEST("clone of device tensors between in-process ranks is bitwise equal at the fork") {
  using comm = dc::inproc::communicator;
  using E = dc::engine<comm, dc::shard::split_even, dc::cuda::staged_device, dc::reconstruct::scatter_exchange>;
  const int n = 2, m = 2;
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world world(n + m);
  std::atomic<int> done{0};
  std::mutex mu;
  std::vector<std::vector<std::byte>> got(m);
  std::vector<std::uint64_t> k(m);
  std::vector<bool> all_on_device(m);
  std::vector<std::uint64_t> completed(n);
  world.run([&](comm& c) {
    check(cudaSetDevice(0), "cudaSetDevice");
    device_replica r(1.f);
    dc::cuda::stream train;
    E::settings s;
    s.timeout = std::chrono::seconds(60);
    s.pipeline.staging_bytes = 256 * 1024;  // the ring wraps: pieces are cut to 256 KiB
    s.pipeline.training_stream = train;
    if (c.rank() < n) {
      E::source<thrust::device_vector<float>> src(c, roles, r.st, s);
      int after = 0;
      for (std::uint64_t step = 0; step < 400 && after < 3; ++step) {
        for (std::size_t l = r.st.layer_count(); l-- > 0;) {
          src.before_update(l);
          for (auto& t : r.st.layer_tensors(l))  // asynchronous on the training stream
            thrust::transform(thrust::cuda::par_nosync.on(train), t.ref->begin(), t.ref->end(), t.ref->begin(),
                              step_update{static_cast<float>(step)});
          src.after_update(l);
        }
        train.synchronize();  // the "allreduce" of the next iteration
        dc::barrier(c, roles.sources, 10);
        src.end_iteration(step);
        int d = done.load();
        dc::allreduce_sum(c, roles.sources, std::span<int>(&d, 1), 12);
        if (d == m * n) ++after;
      }
      src.finish();
      completed[c.rank()] = src.sessions_completed();
    } else {
      device_replica garbage(-5.f);
      dc::cuda::device_clone<E, thrust::device_vector<float>> dst(c, roles, garbage.st, s);
      dst.request();
      dst.stream_wait_layer(0, train);  // the clone's forward pass could be enqueued here
      dst.wait();
      bool on = true;
      for (auto& t : dst.device_ready_s()) on &= t.has_value();
      std::lock_guard g(mu);
      got[c.rank() - n] = garbage.bytes();
      k[c.rank() - n] = dst.report().iteration;
      all_on_device[c.rank() - n] = on;
      CHECK(dst.metadata().step == dst.report().iteration);
      done += n;
    }
  });
  device_replica want(1.f);
  for (std::uint64_t step = 0; step <= k[0]; ++step)
    for (auto& v : want.t) thrust::transform(v.begin(), v.end(), v.begin(), step_update{static_cast<float>(step)});
  auto w = want.bytes();
  std::printf("  fork iteration %llu\n", static_cast<unsigned long long>(k[0]));
  CHECK(completed[0] == 1 && completed[1] == 1);
  CHECK(k[0] == k[1]);
  CHECK(got[0] == w);
  CHECK(got[1] == w);
  CHECK(all_on_device[0] && all_on_device[1]);
}

TEST("a partitioned transfer between device parts staged by thrust_staging is byte-exact") {
  // ZeRO-1 over N=4 into M=2 replicated clone ranks, every part a device vector; small
  // message limits so that packed messages (several runs) are staged too.
  using comm = dc::inproc::communicator;
  using staged = dc::thrust_staging<>;
  const auto s = partition_test::zero1();
  const auto n = static_cast<std::uint32_t>(s.src.size()), m = static_cast<std::uint32_t>(s.dst.size());
  const auto roles = dc::roles::contiguous(n, m);
  const auto groups = dc::make_partition_groups(dc::make_partition_plan(s.lay, s.src, s.dst), n, m, dc::partition_group_options{16, 64});
  const dc::partition_route route{roles, s.lay, groups, 100};
  std::vector<std::vector<std::vector<std::byte>>> got(m);
  std::vector<std::string> errors(m);
  dc::inproc::world world(static_cast<int>(n + m));
  world.run([&](comm& c) {
    check(cudaSetDevice(0), "cudaSetDevice");
    const auto r = static_cast<std::uint32_t>(c.rank());
    const bool source = r < n;
    auto host = partition_test::own_tensors(s.lay, source ? s.src[r] : s.dst[r - n], source);
    std::vector<thrust::device_vector<std::byte>> dev;
    for (auto& t : host) dev.emplace_back(t.begin(), t.end());
    std::vector<std::span<std::byte>> parts;
    for (auto& d : dev) parts.emplace_back(thrust::raw_pointer_cast(d.data()), d.size());
    try {
      if (source) {
        const std::vector<std::span<const std::byte>> own(parts.begin(), parts.end());
        dc::partition_sender<comm, dc::checksum::mix64, staged> send(c, route, r, own);
        for (auto l = static_cast<std::uint32_t>(s.lay.layer_count()); l-- > 0;) send.send_layer(l);
        send.wait(std::chrono::seconds(60));
      } else {
        dc::partition_receiver<comm, dc::checksum::mix64, staged> receive(c, route, r - n, parts);
        receive.wait(std::chrono::seconds(60));
        for (std::size_t t = 0; t < dev.size(); ++t) thrust::copy(dev[t].begin(), dev[t].end(), host[t].begin());
        got[r - n] = std::move(host);
      }
    } catch (const std::exception& e) {
      if (!source) errors[r - n] = e.what();
    }
  });
  for (std::uint32_t c = 0; c < m; ++c) {
    if (!errors[c].empty()) std::printf("  clone rank %u: %s\n", c, errors[c].c_str());
    CHECK(errors[c].empty());
    for (std::uint32_t t = 0; t < s.lay.tensor_count() && errors[c].empty(); ++t) CHECK(partition_test::holds_pattern(s, c, got[c], t));
  }
}

int main() { return dctest::run_all("cuda.device"); }
