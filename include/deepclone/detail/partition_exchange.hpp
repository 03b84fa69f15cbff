#pragma once
/// \file detail/partition_exchange.hpp
/// What clone ranks that share (partition_sharing::exchange) say to each other, with
/// failover on: a *farewell*, "I no longer forward to you nor await your forwards". A clone
/// rank says it when it gives up (refused by the handshake, timed out, cancelled) and when it
/// asked the sources for a forwarder's bytes instead (that forwarder was silent, or sent a
/// forward that failed its checksum); the peer then withdraws its forwards to it and asks the
/// sources for what it awaited from it. So one clone rank that does not forward leaves its
/// peers refetching from the sources instead of timing out. Templated on the communicator.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "../communicator.hpp"
#include "../partition_groups.hpp"
#include "../roles.hpp"
#include "bytes.hpp"
#include "outbox.hpp"
#include "../partition_declaration.hpp"
#include "wire.hpp"

namespace deepclone::detail {

/// A farewell from one clone rank to another (sealed; small, so an eager send), naming the
/// global layout by its declaration's fingerprint and the transfer (partition_route::
/// transfer), so that one left over from an earlier transfer on the same tags is not taken.
/// Not the plan's fingerprint: a peer that planned otherwise and was refused must still be
/// heard.
struct partition_farewell {
  static constexpr std::uint32_t magic = 0x50465732;  // "PFW2"
  std::uint32_t from = 0, to = 0;
  std::uint64_t layout_id = 0;  ///< global_declaration::fingerprint() of the global layout, xor the transfer
  static constexpr std::size_t size = 3 * 4 + 8 + 8;
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic), w.u32(from), w.u32(to), w.u64(layout_id);
    return seal(w);
  }
  /// Refuses (errc::corrupt_message) anything but a farewell from `from` to `to` for `layout_id`.
  static void check(std::span<const std::byte> b, std::uint32_t from, std::uint32_t to, std::uint64_t layout_id) {
    reader r(unseal(b, "partition farewell"), "partition farewell");
    if (r.u32() != magic) r.fail("bad magic word");
    if (r.u32() != from || r.u32() != to) r.fail("a farewell of other clone ranks");
    if (r.u64() != layout_id) r.fail("a farewell of another transfer");
    r.expect_end();
  }
};

/// One clone rank's farewells with the clone ranks it exchanges forwards with (both ways),
/// on the control tag (clone ranks send nothing else to each other there), and when it last
/// heard from each forwarder.
template <class Comm>
class exchange_peers {
 public:
  exchange_peers(Comm& c, const roles& ranks, const layout& global, const partition_groups& groups, std::uint32_t clone, int tag,
                 std::uint64_t transfer)
      : comm_(c), ranks_(ranks), clone_(clone), tag_(tag), layout_id_(global_declaration::of(global).fingerprint() ^ transfer),
        gone_(ranks.clone_count(), 0),
        said_(gone_),
        heard_(ranks.clone_count(), clock::now()) {
    std::vector<char> peer(ranks.clone_count(), 0);
    for (auto g : groups.forwarded_by_clone(clone)) peer[groups.forwards()[g].clone] = 1;
    for (auto g : groups.forwarded_to_clone(clone)) peer[groups.forwards()[g].source] = 1;
    for (std::uint32_t p = 0; p < peer.size(); ++p)
      if (peer[p]) post(incoming_.emplace_back(p));
  }
  exchange_peers(const exchange_peers&) = delete;
  exchange_peers& operator=(const exchange_peers&) = delete;
  ~exchange_peers() { cancel(); }

  /// The peers whose farewell arrived since the last call (a message that is no farewell
  /// of this transfer from that peer is dropped, and the receive posted again).
  std::vector<std::uint32_t> take_farewells() {
    std::vector<std::uint32_t> out;
    for (auto& in : incoming_) {
      if (in.taken) continue;
      const auto n = comm_.test(in.request);
      if (!n) continue;
      in.taken = true;
      try {
        partition_farewell::check(std::span<const std::byte>(in.bytes).first(*n), in.peer, clone_, layout_id_);
        if (!gone(in.peer)) out.push_back(in.peer);
        gone_[in.peer] = 1;
      } catch (const error&) {  // a peer's garbage, or a farewell of another transfer: listen again
        post(in);
      }
    }
    return out;
  }
  /// Whether peer `p` and this rank no longer exchange forwards: either said farewell.
  bool gone(std::uint32_t p) const { return gone_.at(p) != 0 || said_.at(p) != 0; }
  /// Tells peer `p` (once) that this rank no longer forwards to it nor awaits its forwards.
  void say_farewell(std::uint32_t p) {
    if (said_.at(p)) return;
    out_.send_owned(comm_, ranks_.clones.at(p), tag_, partition_farewell{clone_, p, layout_id_}.encode());
    said_[p] = 1;  // after the send: one that throws is said again
  }
  /// Says farewell to every peer (this rank gives up); never throws.
  void farewell_all() noexcept {
    for (const auto& in : incoming_) {
      try {
        say_farewell(in.peer);
      } catch (...) {
      }
    }
  }
  /// A forward of peer `p` verified here (its silence counts from now).
  void heard(std::uint32_t p) { heard_.at(p) = clock::now(); }
  /// The sources began to deliver: every forwarder's silence counts from now (none could
  /// forward before it got its bytes from the sources).
  void restart_clocks() { std::fill(heard_.begin(), heard_.end(), clock::now()); }
  clock::time_point last_heard(std::uint32_t p) const { return heard_.at(p); }
  /// Withdraws the farewell receives and the farewells not yet sent.
  void cancel() noexcept {
    for (auto& in : incoming_) {
      try {
        if (!in.taken) comm_.cancel(in.request);
      } catch (...) {
      }
      in.taken = true;
    }
    out_.cancel_all(comm_);
  }

 private:
  struct posted {
    explicit posted(std::uint32_t p) : peer(p) {}
    std::uint32_t peer;
    std::vector<std::byte> bytes = std::vector<std::byte>(partition_farewell::size);
    typename Comm::request_type request{};
    bool taken = false;
  };
  void post(posted& in) {
    in.taken = false;
    in.request = comm_.irecv(ranks_.clones.at(in.peer), tag_, std::span<std::byte>(in.bytes));
  }
  Comm& comm_;
  const roles& ranks_;
  std::uint32_t clone_;
  int tag_;
  std::uint64_t layout_id_;
  std::vector<char> gone_, said_;
  std::vector<clock::time_point> heard_;
  std::deque<posted> incoming_;  // a deque: receives write into its elements' buffers
  outbox<Comm> out_;
};

}  // namespace deepclone::detail
