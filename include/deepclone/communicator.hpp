#pragma once
/// \file communicator.hpp
/// The communicator concepts. The engine needs only point-to-point byte messages with
/// tags and non-blocking requests; adapters exist for the in-process transport
/// (`inproc.hpp`) and Boost.MPI (`integrations/boost_mpi.hpp`). Anything else (raw MPI,
/// NCCL, a bandwidth-emulating or fault-injecting decorator) is another adapter.
///
/// Matching rule every adapter must keep (MPI's): messages between one sender and one
/// receiver with the same tag are received in the order they were sent.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <optional>
#include <span>
#include <thread>

namespace deepclone {

/// A communicator with ranks.
template <class C>
concept ranked_communicator = requires(const C& c) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
};

/// Non-blocking point-to-point byte messages. `isend` keeps reading `data` until the
/// request completes (zero-copy); `irecv` writes into `buffer` and completes with the
/// number of bytes received (at most buffer.size()). `cancel` withdraws a request that
/// has not completed; after it returns the buffer is no longer touched.
template <class C>
concept point_to_point_communicator =
    ranked_communicator<C> &&
    requires(C& c, int peer, int tag, std::span<const std::byte> out, std::span<std::byte> in,
             typename C::request_type& r) {
      typename C::request_type;
      requires std::movable<typename C::request_type>;
      { c.isend(peer, tag, out) } -> std::same_as<typename C::request_type>;
      { c.irecv(peer, tag, in) } -> std::same_as<typename C::request_type>;
      { c.test(r) } -> std::same_as<std::optional<std::size_t>>;
      { c.wait(r) } -> std::same_as<std::size_t>;
      { c.cancel(r) } -> std::same_as<void>;
    };

/// Optional: the largest tag the transport allows (MPI_TAG_UB). Without it, deepclone
/// assumes MPI's guaranteed minimum, 32767.
template <class C>
concept tag_bounded_communicator = requires(const C& c) {
  { c.max_tag() } -> std::convertible_to<int>;
};

/// Optional: a transport that can put the calling rank to sleep until something happens
/// for it (a message arrives, a send completes), instead of deepclone polling with
/// back-off. `activity()` is a counter that changes on every such event.
template <class C>
concept waitable_communicator = requires(C& c, std::uint64_t seen, std::chrono::microseconds d) {
  { c.activity() } -> std::convertible_to<std::uint64_t>;
  { c.wait_activity(seen, d) } -> std::same_as<void>;
};

/// Optional collectives over the whole communicator, for trainers and tests. The engine
/// never needs them: its fork agreement uses point-to-point messages only.
template <class C>
concept collective_communicator =
    point_to_point_communicator<C> && requires(C& c, std::span<double> v) {
      { c.barrier() } -> std::same_as<void>;
      { c.allreduce_sum(v) } -> std::same_as<void>;
    };

/// Optional: a communicator whose isend/irecv accept device pointers (CUDA-aware MPI).
/// Specialise to `true` for such an adapter.
template <class C>
inline constexpr bool accepts_device_memory = false;

namespace detail {

template <class C>
int max_tag_of(const C& c) {
  if constexpr (tag_bounded_communicator<C>) return static_cast<int>(c.max_tag());
  else return 32767;
}

/// Waits for "something to happen" on `c` while a progress loop has nothing to do:
/// sleeps on the transport where it can, else backs off from yielding to short sleeps.
template <class C>
class idler {
 public:
  explicit idler(C& c) : c_(c) { mark(); }
  /// Call before scanning requests, so an event during the scan is not missed.
  void mark() {
    if constexpr (waitable_communicator<C>) seen_ = c_.activity();
  }
  void progressed() { spins_ = 0; }
  void idle(std::chrono::steady_clock::time_point deadline) {
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return;
    if constexpr (waitable_communicator<C>) {
      auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
      c_.wait_activity(seen_, std::min(left, std::chrono::microseconds(20000)));
    } else {
      if (spins_ < 64) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(spins_ < 256 ? 20 : 200));
      ++spins_;
    }
  }

 private:
  C& c_;
  std::uint64_t seen_ = 0;
  unsigned spins_ = 0;
};

}  // namespace detail
}  // namespace deepclone
