#pragma once
/// \file integrations/thrust.hpp
/// Device-side work written once with Thrust: it runs on Thrust's CUDA back-end on a GPU
/// (compile with nvcc) and on its CPP/OMP back-ends on the CPU (compile with any C++20
/// compiler and -DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP or _OMP).
///
///   - `thrust_checksum(ptr, bytes, policy)`: `checksum::mix64::compute` of bytes that live
///     where `policy` runs (device memory on the CUDA back-end), as one transform-reduce.
///     The value is bit for bit the host's, so a clone can verify a piece on the device.
///   - `segment`, `pack`, `unpack`, `shard_segments`: a shard that spans several tensors
///     gathered into one contiguous buffer (and scattered back) with Thrust copies.
///   - `thrust_staging`: the Memory policy (part_memory.hpp) of a partitioned transfer or
///     engine whose parts live in device memory, staged through host buffers.
///   - tensor adapters: `thrust::device_vector<T>` (memory_space::device when Thrust's
///     device system is CUDA, host otherwise) and `device_view(ptr, n)` for a raw device
///     pointer plus a length (a `raw_view` tagged memory_space::device).
///
/// Opt-in: include this header and link `deepclone::thrust_cpp` (CPU back-end) or
/// `deepclone::cuda` (nvcc). The core never includes it.

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include <thrust/copy.h>
#include <thrust/device_ptr.h>
#include <thrust/device_vector.h>
#include <thrust/execution_policy.h>
#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform_reduce.h>

#include "../checksum.hpp"
#include "../part_memory.hpp"
#include "../plan.hpp"
#include "../state.hpp"
#include "../tensor.hpp"


namespace deepclone {

/// The memory space of Thrust's device system in this translation unit.
inline constexpr memory_space thrust_device_space =
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
    memory_space::device;
#else
    memory_space::host;
#endif

namespace detail {

/// term(word i, i) for word i of [p, p + bytes); the tail word is zero-padded
/// little-endian, as on the host.
struct mix64_word_term {
  const unsigned char* p;
  std::uint64_t bytes;
  DEEPCLONE_HOST_DEVICE std::uint64_t operator()(std::uint64_t i) const {
    const std::uint64_t at = i * 8;
    std::uint64_t w = 0;
    if (at + 8 <= bytes && (reinterpret_cast<std::uintptr_t>(p) & 7u) == 0) {
      w = *reinterpret_cast<const std::uint64_t*>(p + at);  // aligned: one load (little-endian targets)
    } else {
      const std::uint64_t n = bytes - at < 8 ? bytes - at : 8;
      for (std::uint64_t k = 0; k < n; ++k) w |= static_cast<std::uint64_t>(p[at + k]) << (8 * k);
    }
    // The core's own term (host/device via config.hpp): device and host checksums are the
    // same function by construction.
    return checksum::mix64::term(w, i);
  }
};

}  // namespace detail

/// `checksum::mix64::compute` of the `bytes` bytes at `data`, computed where `policy`
/// runs: `thrust::device` (device memory on the CUDA back-end), `thrust::cuda::par.on(s)`
/// for a stream, `thrust::host`, ... Equal to the host computation on the same bytes.
template <class Policy>
std::uint64_t thrust_checksum(const void* data, std::size_t bytes, Policy&& policy) {
  const std::uint64_t words = (bytes + 7) / 8;
  std::uint64_t sum = 0;
  if (words != 0)
    sum = thrust::transform_reduce(policy, thrust::counting_iterator<std::uint64_t>(0),
                                   thrust::counting_iterator<std::uint64_t>(words),
                                   detail::mix64_word_term{static_cast<const unsigned char*>(data), bytes},
                                   std::uint64_t{0}, thrust::plus<std::uint64_t>());
  return checksum::mix64::finish(sum, bytes);
}
/// Same, on Thrust's device system.
inline std::uint64_t thrust_checksum(const void* data, std::size_t bytes) {
  return thrust_checksum(data, bytes, thrust::device);
}

/// Checksum policy for the engine that computes mix64 with Thrust (same id and value as
/// `checksum::mix64`, so sources and clones may mix the two).
template <class Policy = decltype(thrust::device)>
struct thrust_mix64 {
  static constexpr std::uint32_t id = checksum::mix64::id;
  static constexpr const char* name = "mix64";
  static std::uint64_t compute(std::span<const std::byte> b) noexcept {
    try {
      return thrust_checksum(b.data(), b.size(), Policy{});
    } catch (...) {
      return ~checksum::mix64::compute(b);  // cannot happen on the CPU back-ends; never verifies on failure
    }
  }
};

// --- Packing a shard that spans several tensors -----------------------------------------

/// A byte range of one tensor: `length` bytes at `data + offset` (device or host address,
/// wherever the Thrust policy in use runs).
struct segment {
  std::byte* data = nullptr;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

/// Total bytes of `segs`.
inline std::uint64_t packed_size(std::span<const segment> segs) noexcept {
  std::uint64_t n = 0;
  for (auto& s : segs) n += s.length;
  return n;
}

/// Gathers `segs`, in order, into the contiguous buffer `out` (at least packed_size bytes).
/// Returns the number of bytes written. Copies are enqueued on `policy` (e.g. a stream).
template <class Policy>
std::uint64_t pack(Policy&& policy, std::span<const segment> segs, std::byte* out) {
  std::uint64_t at = 0;
  for (auto& s : segs) {
    auto* src = reinterpret_cast<const unsigned char*>(s.data + s.offset);
    thrust::copy(policy, src, src + s.length, reinterpret_cast<unsigned char*>(out + at));
    at += s.length;
  }
  return at;
}
/// Scatters the contiguous buffer `in` back into `segs`, in order (the inverse of pack).
template <class Policy>
std::uint64_t unpack(Policy&& policy, const std::byte* in, std::span<const segment> segs) {
  std::uint64_t at = 0;
  for (auto& s : segs) {
    auto* src = reinterpret_cast<const unsigned char*>(in + at);
    thrust::copy(policy, src, src + s.length, reinterpret_cast<unsigned char*>(s.data + s.offset));
    at += s.length;
  }
  return at;
}

/// The segments source `source` sends for layer `layer` under `p`, in the plan's piece
/// order, read from `st`'s tensors: what `pack` gathers into one staging buffer.
template <tensor T>
std::vector<segment> shard_segments(const plan& p, state<T>& st, std::uint32_t source, std::size_t layer) {
  std::vector<segment> out;
  for (auto& q : p.pieces())
    if (q.source == source && q.layer == layer) out.push_back({st.bytes(q.tensor).data(), q.offset, q.length});
  return out;
}

// --- Partitioned parts in device memory --------------------------------------------------

/// The `Memory` policy (part_memory.hpp) of a partitioned transfer or engine whose parts
/// live in Thrust's device system: every message is staged through a host buffer. `gather`
/// copies the runs into one device staging buffer (one Thrust copy per run, on `Policy`)
/// and that buffer to the host in one transfer; a single run goes to the host directly.
/// `scatter` is the reverse. The staging buffer is kept for the next message. `Policy` must
/// be default-constructible and synchronous (`thrust::device`, the default: each algorithm
/// returns once done; not `par_nosync`, and no stream a default-constructed policy would
/// lose); the copies between host and device use the default stream. So the bytes are on
/// the host when `gather` returns and in the parts when `scatter` does. The trainer's update
/// of a layer must have completed before its after_update: on the CUDA back-end, synchronise
/// the training stream first.
template <class Policy = decltype(thrust::device)>
class thrust_staging {
 public:
  static constexpr bool host_addressable = false;

  void gather(std::span<const std::span<const std::byte>> runs, std::span<std::byte> out) {
    auto* to = reinterpret_cast<unsigned char*>(out.data());
    if (runs.size() == 1) {
      const auto from = device_bytes(runs.front().data());
      thrust::copy(from, from + static_cast<std::ptrdiff_t>(runs.front().size()), to);
      return;
    }
    auto* stage = staged(out.size());
    for (auto r : runs) {
      const auto* from = reinterpret_cast<const unsigned char*>(r.data());
      thrust::copy(Policy{}, from, from + r.size(), stage);
      stage += r.size();
    }
    thrust::copy(stage_.begin(), stage_.begin() + static_cast<std::ptrdiff_t>(out.size()), to);
  }
  void scatter(std::span<const std::byte> in, std::span<const std::span<std::byte>> runs) {
    const auto* from = reinterpret_cast<const unsigned char*>(in.data());
    if (runs.size() == 1) {
      thrust::copy(from, from + in.size(), device_bytes(runs.front().data()));
      return;
    }
    staged(in.size());
    thrust::copy(from, from + in.size(), stage_.begin());
    const auto* stage = thrust::raw_pointer_cast(stage_.data());
    for (auto r : runs) {
      thrust::copy(Policy{}, stage, stage + r.size(), reinterpret_cast<unsigned char*>(r.data()));
      stage += r.size();
    }
  }

 private:
  static thrust::device_ptr<unsigned char> device_bytes(const std::byte* p) {
    return thrust::device_pointer_cast(reinterpret_cast<unsigned char*>(const_cast<std::byte*>(p)));
  }
  /// The staging buffer, at least `n` bytes (grown, never shrunk).
  unsigned char* staged(std::size_t n) {
    if (stage_.size() < n) stage_.resize(n);
    return thrust::raw_pointer_cast(stage_.data());
  }
  thrust::device_vector<unsigned char> stage_;
};
static_assert(part_memory<thrust_staging<>>);

// --- Tensor adapters ----------------------------------------------------------------------

/// A raw device pointer plus a length, as a tensor (the bytes stay where they are).
template <tensor_element T>
raw_view<T> device_view(T* data, std::size_t count, std::vector<std::int64_t> shape = {}) {
  return raw_view<T>(data, count, std::move(shape), memory_space::device);
}
template <tensor_element T>
raw_view<T> device_view(thrust::device_ptr<T> data, std::size_t count, std::vector<std::int64_t> shape = {}) {
  return raw_view<T>(thrust::raw_pointer_cast(data), count, std::move(shape), thrust_device_space);
}

/// `thrust::device_vector<T>`: its bytes live in Thrust's device system (device memory on
/// the CUDA back-end, host memory on CPP/OMP). Resizing it while an engine holds it is not
/// allowed (the address must stay put).
template <tensor_element T, class A>
struct tensor_traits<thrust::device_vector<T, A>> {
  static std::byte* data(thrust::device_vector<T, A>& v) {
    return reinterpret_cast<std::byte*>(thrust::raw_pointer_cast(v.data()));
  }
  static std::size_t size_bytes(const thrust::device_vector<T, A>& v) { return v.size() * sizeof(T); }
  static dtype element_type(const thrust::device_vector<T, A>&) { return element_dtype<T>::value; }
  static memory_space space(const thrust::device_vector<T, A>&) { return thrust_device_space; }
};

}  // namespace deepclone
