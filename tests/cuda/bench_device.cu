// Short GPU benchmark (tests/cuda/gpu_check.sh runs it; ctest runs it with --quick):
//   1. D2H staging bandwidth: cudaMemcpy's peak (pinned and pageable) against the staging
//      ring (asynchronous, bounded) and the cuda::staged_device copy path the engine uses;
//   2. readiness of a clone of a reference model (bert_large by default) between two rank
//      groups on one GPU: 2 source ranks -> 2 clone ranks, threads of this process.
// Exit code 77 (skipped) when there is no usable GPU.
#include "check.hpp"

#include <deepclone/deepclone.hpp>
#include <deepclone/integrations/cuda.hpp>

#include <models.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace dc = deepclone;
using dc::cuda::check;

namespace bench {
/// A device tensor of any dtype: cudaMalloc'd bytes plus the layout's description.
struct dev_tensor {
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  dc::dtype type = dc::dtype::bytes;
  std::vector<std::int64_t> shape;
};
}  // namespace bench

template <>
struct deepclone::tensor_traits<bench::dev_tensor> {
  static std::byte* data(bench::dev_tensor& t) { return t.data; }
  static std::size_t size_bytes(const bench::dev_tensor& t) { return t.bytes; }
  static dtype element_type(const bench::dev_tensor& t) { return t.type; }
  static std::vector<std::int64_t> shape(const bench::dev_tensor& t) { return t.shape; }
  static memory_space space(const bench::dev_tensor&) { return memory_space::device; }
};

namespace {
using clk = std::chrono::steady_clock;
double since(clk::time_point t0) { return std::chrono::duration<double>(clk::now() - t0).count(); }

void bandwidth(std::size_t total, std::size_t ring_bytes, std::size_t piece) {
  std::byte* dev = nullptr;
  check(cudaMalloc(&dev, total), "cudaMalloc");
  check(cudaMemset(dev, 1, total), "cudaMemset");
  dc::cuda::pinned_buffer pinned(total);
  dc::cuda::stream s;
  dc::cuda::event a(true), b(true);
  float best = 1e30f;
  for (int i = 0; i < 3; ++i) {
    a.record(s);
    check(cudaMemcpyAsync(pinned.data(), dev, total, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync");
    b.record(s);
    b.synchronize();
    best = std::min(best, dc::cuda::event::elapsed_ms(a, b));
  }
  const double gb = static_cast<double>(total) / 1e9;
  const double peak = gb / (best / 1e3);
  std::vector<std::byte> pageable(total);
  auto t0 = clk::now();
  check(cudaMemcpy(pageable.data(), dev, total, cudaMemcpyDeviceToHost), "cudaMemcpy");
  const double pageable_bw = gb / since(t0);

  // The staging ring as a pipeline uses it: stage pieces, release the oldest when full.
  dc::cuda::staging_ring ring(ring_bytes);
  dc::cuda::stream train;
  double ring_bw = 0;
  for (int rep = 0; rep < 2; ++rep) {  // first round warms the ring's events
    t0 = clk::now();
    for (std::size_t off = 0; off < total; off += piece) {
      std::span<const std::byte> src(dev + off, std::min(piece, total - off));
      auto slot = ring.stage(src, train);
      while (!slot) {
        ring.release();  // a real source releases once the slot's sends completed
        slot = ring.stage(src, train);
      }
    }
    ring.clear();
    ring_bw = gb / since(t0);
  }
  // The engine's path: cuda::staged_device::copy, one piece at a time, the host waiting for each.
  dc::cuda::staged_device pol;
  pol.training_stream = train;
  auto mem = pol.staging(ring_bytes);
  t0 = clk::now();
  for (std::size_t off = 0, at = 0; off < total; off += piece) {
    const std::size_t len = std::min(piece, total - off);
    if (at + len > mem.size()) at = 0;
    pol.copy(mem.subspan(at, len), {dev + off, len}, dc::memory_space::device);
    at += len;
  }
  const double engine_bw = gb / since(t0);
  std::printf("D2H %.2f GB, pieces of %zu MiB, ring %zu MiB:\n", gb, piece >> 20, ring_bytes >> 20);
  std::printf("  cudaMemcpyAsync to pinned (peak) : %7.2f GB/s\n", peak);
  std::printf("  cudaMemcpy to pageable           : %7.2f GB/s\n", pageable_bw);
  std::printf("  staging_ring (async, bounded)    : %7.2f GB/s  (%.0f%% of peak)\n", ring_bw, 100 * ring_bw / peak);
  std::printf("  staged_device::copy (engine path): %7.2f GB/s  (%.0f%% of peak)\n", engine_bw, 100 * engine_bw / peak);
  cudaFree(dev);
}

void clone_model(const std::string& name) {
  const auto lay = dc::testing::load_model(DEEPCLONE_MODELS_DIR, name);
  using comm = dc::inproc::communicator;
  using cloning = dc::engine<comm, dc::shard::split_even, dc::cuda::staged_device, dc::reconstruct::scatter_exchange>;
  const int n = 2, m = 2;
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world world(n + m);
  std::atomic<int> done{0};
  std::mutex mu;
  std::vector<double> device_ready(m), host_ready(m), first_layer(m);
  dc::report rep;
  std::vector<double> normal_iter(n);
  world.run([&](comm& c) {
    check(cudaSetDevice(0), "cudaSetDevice");
    std::vector<bench::dev_tensor> ts;
    ts.reserve(lay.tensor_count());
    dc::state<bench::dev_tensor> st;
    for (auto& l : lay.layers()) {
      std::vector<dc::named<bench::dev_tensor>> named;
      for (auto& t : l.tensors) {
        bench::dev_tensor d{nullptr, static_cast<std::size_t>(t.bytes), t.type, t.shape};
        if (d.bytes) check(cudaMalloc(&d.data, d.bytes), "cudaMalloc");
        if (d.bytes) check(cudaMemset(d.data, c.rank() < n ? 1 : 0, d.bytes), "cudaMemset");
        ts.push_back(d);
        named.emplace_back(t.name, ts.back());
      }
      st.add_layer(l.name, std::move(named));
    }
    dc::cuda::stream train;
    cloning::settings s;
    s.timeout = std::chrono::seconds(120);
    s.pipeline.training_stream = train;
    s.pipeline.staging_bytes = 64ull << 20;
    if (c.rank() < n) {
      cloning::source<bench::dev_tensor> src(c, roles, st, s);
      for (std::uint64_t step = 0; step < 100000; ++step) {
        for (std::size_t l = st.layer_count(); l-- > 0;) {
          src.before_update(l);
          for (auto& t : st.layer_tensors(l))  // the "update": rewrite the layer on the training stream
            if (t.ref->bytes) check(cudaMemsetAsync(t.ref->data, static_cast<int>(step & 0xff), t.ref->bytes, train), "memset");
          src.after_update(l);
        }
        train.synchronize();
        dc::barrier(c, roles.sources, 10);
        src.end_iteration(step);
        int stop = done.load() == m * n && !src.cloning() ? 1 : 0;
        dc::allreduce_sum(c, roles.sources, std::span<int>(&stop, 1), 12);
        if (stop == n) break;  // every source, at the same step
      }
      src.finish();
    } else {
      dc::cuda::device_clone<cloning, bench::dev_tensor> dst(c, roles, st, s);
      auto t0 = clk::now();
      dst.request();
      dst.wait();
      const double on_device = since(t0);
      auto r = dst.report();
      std::lock_guard g(mu);
      const auto j = static_cast<std::size_t>(c.rank() - n);
      device_ready[j] = on_device;
      host_ready[j] = r.readiness_s;
      first_layer[j] = dst.device_ready_s().empty() ? 0 : dst.device_ready_s()[0].value_or(0);
      if (j == 0) rep = r;
      done += n;
    }
    for (auto& t : ts)
      if (t.data) cudaFree(t.data);
  });
  const double gb = static_cast<double>(rep.state_bytes) / 1e9;
  std::printf("clone of %s (%.2f GB, %zu layers), 2 source ranks -> 2 clone ranks on one GPU, %s:\n", name.c_str(), gb,
              lay.layer_count(), rep.policies.c_str());
  std::printf("  fork iteration %llu; agreement %.3f s\n", static_cast<unsigned long long>(rep.iteration), rep.agreement_s);
  for (int j = 0; j < m; ++j)
    std::printf("  clone rank %d: verified on host %.3f s, all layers on device %.3f s (layer 0 on device %.3f s), %.2f GB/s\n", j,
                host_ready[j], device_ready[j], first_layer[j], gb / device_ready[j]);
  for (auto& s : rep.sources)
    std::printf("  source rank %d: sent %.2f GB, hook time %.3f s, overhead %.3f s over %u fork iterations\n", s.rank,
                static_cast<double>(s.bytes_sent) / 1e9, s.hook_s, s.overhead_s, s.fork_iterations);
}
}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  auto g = dc::cuda::gpu_status();
  if (!g.usable) {
    std::printf("cuda.bench: SKIPPED (%s)\n", g.reason.c_str());
    return dctest::skip_code;
  }
  std::printf("cuda.bench on %s%s\n", g.reason.c_str(), quick ? " (quick)" : "");
  try {
    bandwidth(quick ? (256ull << 20) : (2ull << 30), 64ull << 20, 8ull << 20);
    clone_model(quick ? "mobilenet_v3_large" : "bert_large");
  } catch (const std::exception& e) {
    std::printf("cuda.bench: FAILED: %s\n", e.what());
    return 1;
  }
  return 0;
}
