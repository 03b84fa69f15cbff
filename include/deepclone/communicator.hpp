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

/// Non-blocking point-to-point byte messages: what the engines need from a transport.
///
/// The contract. The concept checks the signatures and (1); the rest is what an adapter
/// must do at run time (docs/communicator.md explains each point; `inproc.hpp` and
/// `integrations/boost_mpi.hpp` are two adapters, `examples/own_communicator.cpp` a minimal
/// one written from scratch, with a run-time check of every point):
///  1. `request_type` is default-constructible and movable: the engines keep requests in
///     containers and default-construct them before posting. A default-constructed request
///     is never passed to `test` or `cancel`.
///  2. `isend(peer, tag, data)` and `irecv(peer, tag, buffer)` return at once. A send may
///     read `data` until it completes or is cancelled (zero-copy); a receive writes at most
///     `buffer.size()` bytes into `buffer`. Messages of 0 bytes are legal.
///  3. Matching is MPI's: a receive takes the oldest unmatched message from `peer` with
///     `tag`, and messages from one sender with one tag are received in the order sent,
///     whatever their sizes. Tags up to `max_tag()` (or 32767) work.
///  4. `test(r)` never blocks and moves the transport along (a transport whose bytes move
///     only when it is called, as MPI's rendezvous protocol does, moves them here): it
///     returns nothing while `r` is pending, and the number of bytes sent or received once
///     complete. Testing a completed request again returns the same value again.
///  5. A message larger than the receive buffer is an error, not a truncation: `test` of
///     that receive throws `deepclone::error` (`errc::transport`), naming sender, receiver
///     and tag; `test` of the send may complete or throw the same error.
///  6. `cancel(r)` withdraws a pending request; once it returns, the transport writes no
///     more into a receive's buffer. A receive that had already matched may complete
///     instead (its bytes land before `cancel` returns). `cancel` of a completed or already
///     cancelled request does nothing. After `cancel`, `test(r)` returns a value: 0 for a
///     withdrawn request, the byte count for one that completed (the engines tell the two
///     apart because they never send empty control messages).
///  7. Sends that the transport cannot withdraw (Open MPI's ob1 never cancels a send): the
///     adapter keeps such a request internally and keeps progressing it (see
///     boost_mpi.hpp's parked sends); the receiver may still get the message later, and
///     deepclone's receivers discard it by its session. The engines cancel sends only when
///     a clone session failed or was withdrawn, and then keep the buffers of the sends they
///     cancelled while pending alive to the end of the process (headers, control messages,
///     metadata and a staged pipeline's ring of each failed session), unless the
///     communicator declares `static constexpr bool withdraws_sends = true` (its `cancel`
///     always withdraws a pending send, as inproc's does).
///  8. Failures are `deepclone::error`s (`errc::transport` for the transport,
///     `errc::invalid_argument` for a peer outside the communicator); the engines turn them
///     into a failed clone session, never into a hung one.
///  9. `wait(r)` blocks until `r` completes. The engines never call it (they test with
///     their own deadlines, so a lost peer cannot hang them); the trainer-side collectives
///     of collectives.hpp do.
/// 10. One thread at a time calls a communicator object (the trainer's thread that calls
///     the hooks or the clone's `wait`); an adapter may run its own progress thread.
template <class C>
concept point_to_point_communicator =
    ranked_communicator<C> &&
    requires(C& c, int peer, int tag, std::span<const std::byte> out, std::span<std::byte> in,
             typename C::request_type& r) {
      typename C::request_type;
      requires std::movable<typename C::request_type>;
      requires std::default_initializable<typename C::request_type>;
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

/// Optional: one message over several byte ranges, gathered from them by the transport on
/// the sender and scattered into them on the receiver (MPI derived datatypes), instead of
/// deepclone packing them into a buffer and out again. On the wire it is the ranges' bytes
/// in order, exactly as if packed: the other side may send or receive it contiguously. The
/// list is read during the call; the ranges must stay valid until the request completes.
/// `test` reports the bytes sent or received, as for `isend`/`irecv`.
template <class C>
concept gathering_communicator =
    point_to_point_communicator<C> && requires(C& c, int peer, int tag, std::span<const std::span<const std::byte>> out,
                                               std::span<const std::span<std::byte>> in) {
      { c.isend_gather(peer, tag, out) } -> std::same_as<typename C::request_type>;
      { c.irecv_scatter(peer, tag, in) } -> std::same_as<typename C::request_type>;
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
