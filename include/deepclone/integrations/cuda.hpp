#pragma once
/// \file integrations/cuda.hpp
/// CUDA runtime pieces for device tensors. Needs only the CUDA runtime API (cudart), so it
/// compiles with nvcc or with a host compiler given CUDA's include path; no kernel here.
///
///   - `cuda::gpu_status()`: is there a usable GPU? (cudaErrorInsufficientDriver, cudaErrorNoDevice,
///     ... are reported as "no usable GPU" so tests can say skipped).
///   - RAII `cuda::stream`, `cuda::event`, `cuda::pinned_buffer`.
///   - `cuda::staging_ring`: bounded, reused pinned host memory; `stage()` enqueues a D2H
///     copy on its own copy stream, ordered after the training stream with an event, so the
///     training stream never waits; `ready()` says when the bytes are on the host.
///   - `cuda::staged_device`: a staged pipeline policy for the source engine
///     (`engine<Comm, Shard, cuda::staged_device>`): device tensors are staged through the
///     pinned ring on the copy stream; the send starts when the copy has landed.
///   - `cuda::device_clone<Engine, D>`: a clone of device tensors: pieces land in a pinned
///     host mirror (verified there by the core clone engine), each layer goes to the device
///     on a copy stream as soon as it is verified, and a layer is ready when its bytes are
///     on the device (`stream_wait_layer` lets the clone's own stream wait without the host).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "../engine.hpp"
#include "../error.hpp"
#include "../pipeline.hpp"
#include "../state.hpp"
#include "../tensor.hpp"

namespace deepclone::cuda {

/// Throws `deepclone::error(errc::transport)` naming the call when `e` is not cudaSuccess.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw error(errc::transport, std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

/// Whether this process can use a GPU, and if not why.
struct gpu_info {
  bool usable = false;
  int devices = 0;
  cudaError_t code = cudaSuccess;
  std::string reason;  ///< why not usable; or the device's name when usable
};

/// Probes the CUDA runtime once: no driver, a driver too old for this runtime
/// (cudaErrorInsufficientDriver = 35), no device (cudaErrorNoDevice = 100), or a device
/// that cannot create a context all count as "no usable GPU".
inline gpu_info gpu_status() {
  gpu_info g;
  g.code = cudaGetDeviceCount(&g.devices);
  if (g.code != cudaSuccess || g.devices == 0) {
    if (g.code == cudaSuccess) g.code = cudaErrorNoDevice;
    g.devices = 0;
    g.reason = std::string("no usable GPU: ") + cudaGetErrorName(g.code) + " (" + cudaGetErrorString(g.code) + ")";
    (void)cudaGetLastError();
    return g;
  }
  g.code = cudaFree(nullptr);  // creates the context: catches unusable devices
  if (g.code != cudaSuccess) {
    g.reason = std::string("no usable GPU: ") + cudaGetErrorName(g.code) + " (" + cudaGetErrorString(g.code) + ")";
    (void)cudaGetLastError();
    return g;
  }
  cudaDeviceProp p{};
  int dev = 0;
  (void)cudaGetDevice(&dev);
  if (cudaGetDeviceProperties(&p, dev) == cudaSuccess) g.reason = p.name;
  g.usable = true;
  return g;
}

/// A CUDA stream that never synchronises implicitly with the legacy default stream.
class stream {
 public:
  stream() { check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
  ~stream() {
    if (s_) (void)cudaStreamDestroy(s_);
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  cudaStream_t get() const noexcept { return s_; }
  operator cudaStream_t() const noexcept { return s_; }
  void synchronize() const { check(cudaStreamSynchronize(s_), "cudaStreamSynchronize"); }

 private:
  cudaStream_t s_ = nullptr;
};

/// A CUDA event; timing is off unless asked for (cheaper to record and query).
class event {
 public:
  explicit event(bool timing = false) {
    check(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreate");
  }
  ~event() {
    if (e_) (void)cudaEventDestroy(e_);
  }
  event(event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  event& operator=(event&& o) noexcept {
    std::swap(e_, o.e_);
    return *this;
  }
  cudaEvent_t get() const noexcept { return e_; }
  operator cudaEvent_t() const noexcept { return e_; }
  void record(cudaStream_t s) { check(cudaEventRecord(e_, s), "cudaEventRecord"); }
  /// True once all work captured by the last record() has completed.
  bool done() const {
    auto r = cudaEventQuery(e_);
    if (r == cudaErrorNotReady) return false;
    check(r, "cudaEventQuery");
    return true;
  }
  void synchronize() const { check(cudaEventSynchronize(e_), "cudaEventSynchronize"); }
  /// Milliseconds between two timing events (both completed).
  static float elapsed_ms(const event& a, const event& b) {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a.e_, b.e_), "cudaEventElapsedTime");
    return ms;
  }

 private:
  cudaEvent_t e_ = nullptr;
};

/// Page-locked host memory (cudaHostAlloc): what makes D2H/H2D copies asynchronous and fast.
class pinned_buffer {
 public:
  pinned_buffer() = default;
  explicit pinned_buffer(std::size_t bytes) : n_(bytes) {
    if (bytes) check(cudaHostAlloc(&p_, bytes, cudaHostAllocPortable), "cudaHostAlloc");
  }
  ~pinned_buffer() {
    if (p_) (void)cudaFreeHost(p_);
  }
  pinned_buffer(pinned_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  pinned_buffer& operator=(pinned_buffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  std::byte* data() const noexcept { return static_cast<std::byte*>(p_); }
  std::size_t size() const noexcept { return n_; }
  std::span<std::byte> span() const noexcept { return {data(), n_}; }

 private:
  void* p_ = nullptr;
  std::size_t n_ = 0;
};

/// A bounded ring of pinned host memory that device bytes are staged through. FIFO:
/// slots are released oldest first. Not thread-safe (one per source rank).
///
///   auto slot = ring.stage(device_bytes, training_stream);  // returns at once
///   ... later: if (ring.ready(*slot)) send(slot->bytes); ... after the send: ring.release();
class staging_ring {
 public:
  struct slot {
    std::span<std::byte> bytes;  ///< where the copy lands (valid once ready)
    std::size_t id = 0;          ///< position in the ring's FIFO (internal)
  };

  explicit staging_ring(std::size_t capacity) : mem_(capacity) {}
  ~staging_ring() {
    try {
      clear();  // no copy may still write into the memory being freed
    } catch (...) {
    }
  }
  staging_ring(const staging_ring&) = delete;
  staging_ring& operator=(const staging_ring&) = delete;

  std::size_t capacity() const noexcept { return mem_.size(); }
  std::size_t in_use() const noexcept { return slots_.size(); }
  cudaStream_t copy_stream() const noexcept { return copy_; }
  std::span<std::byte> memory() const noexcept { return mem_.span(); }

  /// Enqueues a copy of `src` (device or host memory) into the ring, ordered after all
  /// work enqueued so far on `after` (the training stream), on the ring's copy stream.
  /// Neither the host nor `after` waits. Returns nullopt when the ring has no room:
  /// release() older slots first. Throws if `src` can never fit.
  std::optional<slot> stage(std::span<const std::byte> src, cudaStream_t after) {
    if (src.size() > mem_.size())
      throw error(errc::invalid_argument, "staging_ring: a piece of " + std::to_string(src.size()) +
                                              " bytes is larger than the ring (" + std::to_string(mem_.size()) + ")");
    auto at = place(src.size());
    if (!at) return std::nullopt;
    return stage_at(*at, src, after);
  }

  /// Enqueues the copy into a caller-chosen part of the ring's memory (for a caller that
  /// manages placement itself, like the core engine's staging ring).
  slot stage_at(std::size_t offset, std::span<const std::byte> src, cudaStream_t after) {
    entry e{offset, src.size(), take_event(), take_event()};
    e.after_update.record(after);  // the update of this layer was enqueued on `after` before us
    check(cudaStreamWaitEvent(copy_, e.after_update, 0), "cudaStreamWaitEvent");
    if (!src.empty())
      check(cudaMemcpyAsync(mem_.data() + offset, src.data(), src.size(), cudaMemcpyDefault, copy_), "cudaMemcpyAsync");
    e.copied.record(copy_);
    slots_.push_back(std::move(e));
    return {std::span<std::byte>(mem_.data() + offset, src.size()), next_id_ + slots_.size() - 1};
  }

  /// True once the slot's bytes are on the host.
  bool ready(const slot& s) const { return at(s).copied.done(); }
  /// Blocks the host until the slot's bytes are on the host.
  void wait(const slot& s) const { at(s).copied.synchronize(); }
  /// The event recorded after the slot's copy: a stream that must not overwrite the source
  /// bytes before the copy read them can cudaStreamWaitEvent on it.
  cudaEvent_t copied_event(const slot& s) const { return at(s).copied.get(); }
  /// Releases the oldest slot (its bytes may be overwritten by later stages).
  void release() {
    if (slots_.empty()) return;
    slots_.front().copied.synchronize();
    free_.push_back(std::move(slots_.front().after_update));
    free_.push_back(std::move(slots_.front().copied));
    slots_.pop_front();
    ++next_id_;
  }
  /// Releases every slot (waits for outstanding copies).
  void clear() {
    while (!slots_.empty()) release();
  }

 private:
  struct entry {
    std::size_t off, len;
    event after_update, copied;
  };
  const entry& at(const slot& s) const {
    if (s.id < next_id_ || s.id - next_id_ >= slots_.size()) throw error(errc::invalid_argument, "staging_ring: slot was released");
    return slots_[s.id - next_id_];
  }
  event take_event() {
    if (free_.empty()) return event{};
    event e = std::move(free_.back());
    free_.pop_back();
    return e;
  }
  std::optional<std::size_t> place(std::size_t len) const {
    const std::size_t cap = mem_.size();
    if (slots_.empty()) return 0;
    std::size_t first = slots_.front().off, end = slots_.back().off + slots_.back().len;
    if (end > first || (end == first && slots_.back().len == 0)) {
      if (cap - end >= len) return end;
      if (first >= len) return 0;
    } else if (first - end >= len) {
      return end;
    }
    return std::nullopt;
  }

  pinned_buffer mem_;
  stream copy_;
  std::deque<entry> slots_;
  std::vector<event> free_;
  std::size_t next_id_ = 0;
};

/// Staged pipeline policy for device tensors, for the core source engine:
///
///   using cloning = deepclone::engine<Comm, deepclone::shard::split_even, deepclone::cuda::staged_device>;
///   cloning::settings s;  s.pipeline.training_stream = my_stream;  s.pipeline.staging_bytes = 64 << 20;
///
/// Right after a layer's update (after_update in the fork iteration) the engine asks it to
/// stage each of this source's pieces: the copy runs on the policy's copy stream, ordered
/// after `training_stream` with an event (the training stream never waits), into pinned
/// memory that the engine uses as its bounded, reused staging ring; the piece is sent once
/// its copy has landed. Copies of the policy (copies of the settings a user makes) share one ring.
struct staged_device : pipeline::staged_base<staged_device> {
  static constexpr const char* name = "staged_device";
  // staging_bytes (from staged_base): size of the pinned staging ring; pieces are cut to fit
  // (part of the plan: sources and clones must agree on it).
  /// The stream the trainer's updates run on (nullptr: the legacy default stream).
  cudaStream_t training_stream = nullptr;

  bool moves(memory_space) const noexcept { return true; }
  /// The ring's pinned memory (allocated on first use, kept and reused by later sessions).
  std::span<std::byte> staging(std::size_t bytes) {
    if (!ring_ || ring_->capacity() < bytes) ring_ = std::make_shared<staging_ring>(bytes);
    return ring_->memory().first(bytes);
  }
  /// Copies `from` into `to` (inside the ring) on the copy stream, after the training
  /// stream's work so far, and returns once the bytes have landed. The host waits for the
  /// copy (the engine computes the piece's checksum and sends right after); the training
  /// stream does not.
  void copy(std::span<std::byte> to, std::span<const std::byte> from, memory_space) {
    auto mem = ring_->memory();
    auto slot = ring_->stage_at(static_cast<std::size_t>(to.data() - mem.data()), from, training_stream);
    ring_->wait(slot);
    ring_->release();
    ++copies_;
  }
  /// The copy stream (e.g. for a trainer that wants to order something after staging).
  cudaStream_t copy_stream() const noexcept { return ring_ ? ring_->copy_stream() : nullptr; }
  std::uint64_t copies() const noexcept { return copies_; }

 private:
  std::shared_ptr<staging_ring> ring_;
  std::uint64_t copies_ = 0;
};

/// Host stand-in for one clone tensor: same name, size, dtype and shape as the device
/// tensor, bytes in pinned host memory. The core clone engine receives and verifies here.
struct host_mirror {
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  dtype type = dtype::bytes;
  std::vector<std::int64_t> shape;
};

}  // namespace deepclone::cuda

namespace deepclone {
template <>
struct tensor_traits<cuda::host_mirror> {
  static std::byte* data(cuda::host_mirror& m) { return m.data; }
  static std::size_t size_bytes(const cuda::host_mirror& m) { return m.bytes; }
  static dtype element_type(const cuda::host_mirror& m) { return m.type; }
  static std::vector<std::int64_t> shape(const cuda::host_mirror& m) { return m.shape; }
  static memory_space space(const cuda::host_mirror&) { return memory_space::host; }
};
}  // namespace deepclone

namespace deepclone::cuda {

/// A clone whose tensors live on the device. Pieces are received and verified by the
/// core clone engine in a pinned host mirror of the state; as soon as a layer is verified
/// its tensors are copied to the device on a copy stream, and the layer counts as ready
/// when the copy has completed. The mirror costs one pinned copy of the state on the
/// clone rank (a rank that holds nothing else yet); it is freed with the object.
///
///   deepclone::cuda::device_clone<cloning, thrust::device_vector<float>> dst(comm, roles, device_state, s);
///   dst.request();
///   dst.stream_wait_layer(0, my_stream);   // the forward pass on my_stream may start
///   dst.wait();                            // every tensor on the device, metadata in place
template <class Engine, tensor D>
class device_clone {
  using Comm = typename Engine::comm_type;
  using settings_t = typename Engine::settings;

 public:
  device_clone(Comm& comm, const roles& r, state<D>& dev, settings_t s = {})
      : dev_(dev), layout_(dev.describe()) {
    std::size_t total = 0;
    for (std::size_t t = 0; t < layout_.tensor_count(); ++t) total += (layout_.tensor(t).bytes + 255) / 256 * 256;
    mem_ = pinned_buffer(total);
    mirrors_.reserve(layout_.tensor_count());
    std::size_t at = 0, flat = 0;
    for (std::size_t l = 0; l < layout_.layer_count(); ++l) {
      std::vector<named<host_mirror>> ts;
      auto& ld = layout_.layers()[l];
      for (auto& td : ld.tensors) {
        mirrors_.push_back({mem_.data() + at, static_cast<std::size_t>(td.bytes), td.type, td.shape});
        at += (td.bytes + 255) / 256 * 256;
        ++flat;
      }
      for (std::size_t i = 0; i < ld.tensors.size(); ++i) ts.emplace_back(ld.tensors[i].name, mirrors_[flat - ld.tensors.size() + i]);
      host_.add_layer(ld.name, std::move(ts));
    }
    for (std::size_t l = 0; l < layout_.layer_count(); ++l) events_.emplace_back();
    engine_ = std::make_unique<typename Engine::template clone<host_mirror>>(comm, r, host_, std::move(s));
  }
  ~device_clone() {
    engine_.reset();                          // withdraws receives into the mirror
    (void)cudaStreamSynchronize(copies_);     // and no copy reads it after it is freed
  }
  device_clone(const device_clone&) = delete;
  device_clone& operator=(const device_clone&) = delete;

  /// Asks the sources for a fork (see clone_engine::request). The device tensors must
  /// still have the layout they had when this object was made.
  void request() {
    auto now = dev_.describe();
    if (!(now == layout_))
      throw error(errc::layout_mismatch, "device_clone: the device state changed since the clone was created: " +
                                             first_difference(layout_, now, "then", "now").value_or("?"));
    enqueued_.assign(layout_.layer_count(), false);
    on_device_.assign(layout_.layer_count(), std::nullopt);
    meta_copied_ = false;
    t_request_ = clock::now();
    engine_->request();
  }

  /// Makes progress; true once every layer is on the device and the metadata in place.
  bool poll() {
    bool host_done = engine_->poll();
    pump();
    if (!host_done) return false;
    for (std::size_t l = 0; l < on_device_.size(); ++l)
      if (!on_device_[l]) return false;
    copy_metadata();
    return true;
  }
  bool ready() { return poll(); }
  /// True once layer `l`'s bytes are on the device.
  bool layer_ready(std::size_t l) {
    engine_->layer_ready(l);
    pump();
    return on_device_.at(l).has_value();
  }
  /// Blocks until layer `l` is verified and on the device.
  void wait_layer(std::size_t l) {
    engine_->wait_layer(l);
    pump();
    events_.at(l).synchronize();
    pump();
  }
  /// Blocks the host only until layer `l` is verified; then makes `s` wait (on the GPU)
  /// for its copy to the device, so work on `s` can be enqueued before the bytes land.
  void stream_wait_layer(std::size_t l, cudaStream_t s) {
    engine_->wait_layer(l);
    pump();
    check(cudaStreamWaitEvent(s, events_.at(l), 0), "cudaStreamWaitEvent");
  }
  /// Blocks until the whole state is on the device and the metadata in place.
  void wait() {
    for (std::size_t l = 0; l < layout_.layer_count(); ++l) {  // stream layers to the device as they verify
      engine_->wait_layer(l);
      pump();
    }
    engine_->wait();
    pump();
    for (auto& e : events_) e.synchronize();
    pump();
    copy_metadata();
  }
  void cancel() {
    engine_->cancel();
    copies_.synchronize();  // no copy to the device outlives a cancel
  }

  /// The core clone report (host-side readiness) ...
  deepclone::report report() { return engine_->report(); }
  /// ... and when each layer was on the device, in seconds since request().
  const std::vector<std::optional<double>>& device_ready_s() const noexcept { return on_device_; }
  const deepclone::metadata& metadata() const { return engine_->metadata(); }
  std::optional<std::uint64_t> fork_iteration() const { return engine_->fork_iteration(); }
  cudaStream_t copy_stream() const noexcept { return copies_; }
  const deepclone::plan& plan() const noexcept { return engine_->plan(); }

 private:
  /// Enqueues the host-to-device copy of every newly verified layer; notes completed ones.
  void pump() {
    std::size_t flat = 0;
    const bool all = engine_->poll();
    for (std::size_t l = 0; l < layout_.layer_count(); ++l) {
      const std::size_t n = layout_.layers()[l].tensors.size();
      if (!enqueued_[l] && (all || engine_->layer_ready(l))) {
        for (std::size_t i = 0; i < n; ++i) {
          auto dst = dev_.bytes(flat + i);
          auto& m = mirrors_[flat + i];
          if (m.bytes)
            check(cudaMemcpyAsync(dst.data(), m.data, m.bytes, cudaMemcpyDefault, copies_), "cudaMemcpyAsync (clone H2D)");
        }
        events_[l].record(copies_);
        enqueued_[l] = true;
      }
      if (enqueued_[l] && !on_device_[l] && events_[l].done())
        on_device_[l] = std::chrono::duration<double>(clock::now() - t_request_).count();
      flat += n;
    }
  }
  void copy_metadata() {
    if (meta_copied_) return;
    dev_.metadata() = engine_->metadata();
    meta_copied_ = true;
  }

  using clock = std::chrono::steady_clock;
  state<D>& dev_;
  layout layout_;
  pinned_buffer mem_;
  std::vector<host_mirror> mirrors_;
  state<host_mirror> host_;
  stream copies_;
  std::vector<event> events_;
  std::unique_ptr<typename Engine::template clone<host_mirror>> engine_;
  std::vector<bool> enqueued_;
  std::vector<std::optional<double>> on_device_;
  bool meta_copied_ = false;
  clock::time_point t_request_{};
};

}  // namespace deepclone::cuda
