// Forking a training job whose state lives in GPU memory (raw device pointers).
//
// Two source ranks train a small model whose weights and momentum buffers are cudaMalloc'd
// device arrays, updated by kernels on each rank's training stream. A clone rank asks for
// a fork while they train: each source stages its shard of every layer through pinned
// memory on a copy stream (cuda::staged_device; the training stream never waits), and the
// clone lands the bytes on its own device tensors (cuda::device_clone). All three ranks
// are threads of this process (in-process transport) sharing one GPU.
//
// Exit code 77 (skipped) when there is no usable GPU.
#include <deepclone/deepclone.hpp>
#include <deepclone/integrations/cuda.hpp>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <vector>

namespace dc = deepclone;
using dc::cuda::check;

__global__ void sgd_momentum(float* w, float* mom, std::size_t n, float lr, std::uint64_t step) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
    float g = 0.001f * static_cast<float>((i * 2654435761u + step * 40503u) % 1000) - 0.5f;  // stand-in gradient
    mom[i] = 0.9f * mom[i] + g;
    w[i] -= lr * mom[i];
  }
}

struct model {  // per rank: 4 layers, weight + momentum each, in device memory
  static constexpr std::size_t sizes[4] = {1 << 20, 1 << 18, 1 << 18, 1000};
  std::vector<float*> ptr;
  std::vector<dc::raw_view<float>> views;
  dc::state<dc::raw_view<float>> state;
  model() {
    views.reserve(8);
    for (std::size_t l = 0; l < 4; ++l)
      for (int t = 0; t < 2; ++t) {
        float* p = nullptr;
        check(cudaMalloc(&p, sizes[l] * sizeof(float)), "cudaMalloc");
        check(cudaMemset(p, 0, sizes[l] * sizeof(float)), "cudaMemset");
        ptr.push_back(p);
        views.push_back(dc::raw_view<float>(p, sizes[l], {}, dc::memory_space::device));  // a raw device pointer + length
      }
    for (std::size_t l = 0; l < 4; ++l)
      state.add_layer("layer" + std::to_string(l), {{"weight", views[2 * l]}, {"weight.momentum", views[2 * l + 1]}});
  }
  ~model() {
    for (auto* p : ptr) cudaFree(p);
  }
  void update(std::size_t l, std::uint64_t step, cudaStream_t s) {
    sgd_momentum<<<256, 256, 0, s>>>(ptr[2 * l], ptr[2 * l + 1], sizes[l], 0.01f, step);
  }
  std::vector<float> host() const {
    std::vector<float> out;
    for (std::size_t i = 0; i < ptr.size(); ++i) {
      std::vector<float> h(sizes[i / 2]);
      check(cudaMemcpy(h.data(), ptr[i], h.size() * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
      out.insert(out.end(), h.begin(), h.end());
    }
    return out;
  }
};

int main() {
  auto gpu = dc::cuda::gpu_status();
  if (!gpu.usable) {
    std::printf("cuda_fork: SKIPPED (%s)\n", gpu.reason.c_str());
    return 77;
  }
  using comm = dc::inproc::communicator;
  using cloning = dc::engine<comm, dc::shard::split_even, dc::cuda::staged_device>;
  const auto roles = dc::roles::contiguous(2, 1);  // ranks 0, 1: sources; rank 2: the clone
  dc::inproc::world world(3);
  std::atomic<bool> cloned{false};
  std::mutex mu;
  std::vector<std::vector<float>> snapshots(64);  // source 0's state after each step
  std::vector<float> clone_state;
  dc::report rep;
  world.run([&](comm& c) {
    check(cudaSetDevice(0), "cudaSetDevice");
    model m;
    dc::cuda::stream train;
    cloning::settings s;
    s.pipeline.training_stream = train;  // staging is ordered after this stream's updates
    s.pipeline.staging_bytes = 1 << 20;
    if (c.rank() < 2) {
      cloning::source<dc::raw_view<float>> src(c, roles, m.state, s);
      for (std::uint64_t step = 0; step < 64; ++step) {
        for (std::size_t l = 4; l-- > 0;) {  // backward order
          src.before_update(l);
          m.update(l, step, train);
          src.after_update(l);
        }
        train.synchronize();
        dc::barrier(c, roles.sources, 10);  // the gradient allreduce
        src.end_iteration(step);
        if (c.rank() == 0) snapshots[step] = m.host();
        bool stop = cloned.load() && !src.cloning();
        int st = stop ? 1 : 0;
        dc::allreduce_sum(c, roles.sources, std::span<int>(&st, 1), 12);
        if (st == 2) break;
      }
      src.finish();
    } else {
      dc::cuda::device_clone<cloning, dc::raw_view<float>> dst(c, roles, m.state, s);
      dst.request();
      dst.wait();  // every layer verified and on this rank's device
      std::lock_guard g(mu);
      rep = dst.report();
      clone_state = m.host();
      cloned = true;
    }
  });
  const bool equal = clone_state == snapshots.at(rep.iteration);
  std::printf("cuda_fork: GPU %s; forked at iteration %llu, %llu bytes, readiness %.3f s (first layer %.3f s): %s\n",
              gpu.reason.c_str(), static_cast<unsigned long long>(rep.iteration),
              static_cast<unsigned long long>(rep.state_bytes), rep.readiness_s, rep.first_layer_s,
              equal ? "clone equals the sources' state" : "MISMATCH");
  return equal ? 0 : 1;
}
