#pragma once
/// \file detail/partition_failover.hpp
/// Failover of a partitioned transfer (issue 12, item 4), templated on the communicator only.
///
/// A clone rank that presumes sources failed withdraws their unverified groups and sends
/// every source one `partition_notice` per lost (source, round): the sources failed so far,
/// that source and round, and the lost layers. Every rank (that clone rank and each source)
/// keeps a `failover_ledger` per clone rank: the transfers to it by round (0: the plan's, r:
/// the replacements the r-th notice brought). A notice is applied alike on all of them: the
/// transfers it names, and only those, are replaced by transfers from live holders of the same
/// bytes (`make_failover_plan`), grouped as the plan's groups are. A source receives one clone
/// rank's notices in the order sent (one tag), so all ranks apply the same rounds. A
/// replacement group travels on its layer's tags after the source's own groups of that layer
/// (a source serves it only once it sent that layer), so the clone rank's receives, posted
/// after the original ones, match in order.
///
/// A source must still hold iteration k's bytes when asked to stand in for a failed holder,
/// so each clone rank acknowledges every layer it verified, and with failover a source's
/// layer counts as sent (may be overwritten) only once every clone rank that wants the layer
/// acknowledged it, or named this source failed. Nothing a clone rank sends makes a source
/// throw: an undecodable notice, one naming another clone rank, a request for a layer already
/// released, one reviving a failed source or naming no transfer of a failed source is dropped
/// and counted (`refused`).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "../communicator.hpp"
#include "../error.hpp"
#include "../holdings.hpp"
#include "../partition_groups.hpp"
#include "../roles.hpp"
#include "bytes.hpp"
#include "outbox.hpp"

namespace deepclone {

/// What failover of a partitioned transfer needs, alike on every rank: the sources'
/// holdings and the plan the groups came from, with the options and alignment they were made
/// with. Set in `partition_route::failover`.
struct partition_failover {
  const std::vector<holdings>& sources;
  const partition_plan& plan;
  partition_group_options options{};
  std::uint64_t alignment = 256;
  /// A clone rank presumes a source failed when none of its groups verified for this long
  /// while it still awaits some, once some source delivered (all quiet may only mean the
  /// sources are not at the fork yet). Longer than a source's slowest layer.
  std::chrono::nanoseconds presume_failed_after = std::chrono::seconds(5);
};

namespace detail {

/// A clone rank's word to the sources: "layer verified" (an acknowledgement), "these
/// sources failed; send me what `source` was to send me in `round`, of these layers", or
/// (sharing) "clone rank `source` does not forward me these layers; send them yourselves".
struct partition_notice {
  static constexpr std::uint32_t magic = 0x504E5433;  // "PNT3"
  enum class kind : std::uint32_t { layer_verified = 1, failover = 2, refetch = 3 };
  kind what = kind::layer_verified;
  std::uint32_t clone = 0;
  std::uint32_t source = 0, round = 0;  ///< failover: whose transfers of which ledger round are lost; refetch: the forwarding clone rank
  std::vector<std::uint32_t> layers;    ///< verified: the one layer; failover: the layers lost
  std::vector<char> failed;             ///< failover: 1 per source failed so far
  std::uint64_t transfer = 0;           ///< decoded: the transfer it was sent in (partition_route::transfer)

  /// Layers travel as a bitmap, so a notice stays small (eager) at any layer count.
  static std::size_t max_size(std::size_t sources, std::size_t layers) { return 7 * 4 + 8 + sources + (layers + 7) / 8 + 8; }
  /// Sent in transfer `in` (a source drops the notices of another transfer).
  std::vector<std::byte> encode(std::size_t layer_count, std::uint64_t in) const {
    writer w;
    w.u32(magic), w.u64(in), w.u32(static_cast<std::uint32_t>(what)), w.u32(clone), w.u32(source), w.u32(round);
    w.u32(static_cast<std::uint32_t>(failed.size()));
    for (char f : failed) w.u8(f ? 1 : 0);
    std::vector<std::uint8_t> bits((layer_count + 7) / 8, 0);
    for (auto l : layers) bits.at(l / 8) |= static_cast<std::uint8_t>(1u << (l % 8));
    w.u32(static_cast<std::uint32_t>(bits.size()));
    for (auto b : bits) w.u8(b);
    return seal(w);
  }
  /// Refuses (errc::corrupt_message) a broken seal, another clone rank, a failure list not
  /// of `sources` entries, a source (refetch: a clone rank of `clones`, not the sender) out of
  /// range, a layer bitmap not of `layer_count` bits, an acknowledgement of other than one layer.
  static partition_notice decode(std::span<const std::byte> b, std::uint32_t clone, std::size_t sources, std::size_t layer_count,
                                 std::size_t clones = 0) {
    reader r(unseal(b, "partition notice"), "partition notice");
    if (r.u32() != magic) r.fail("bad magic word");
    partition_notice n;
    n.transfer = r.u64();
    const auto what = r.u32();
    if (what < 1 || what > 3) r.fail("unknown kind " + std::to_string(what));
    n.what = static_cast<kind>(what);
    if ((n.clone = r.u32()) != clone) r.fail("names clone rank " + std::to_string(n.clone) + ", sent by " + std::to_string(clone));
    n.source = r.u32();
    if (n.what != kind::refetch && n.source >= sources) r.fail("source " + std::to_string(n.source) + " of " + std::to_string(sources));
    if (n.what == kind::refetch && (n.source >= clones || n.source == clone))
      r.fail("forwarding clone rank " + std::to_string(n.source) + " of " + std::to_string(clones));
    n.round = r.u32();
    const auto failed = r.u32();
    if (failed != (n.what == kind::layer_verified ? 0 : sources)) r.fail("a failure list of " + std::to_string(failed) + " sources");
    for (std::uint32_t s = 0; s < failed; ++s) n.failed.push_back(r.u8() != 0);
    if (r.u32() != (layer_count + 7) / 8) r.fail("a layer bitmap of another size");
    for (std::uint32_t i = 0; i < (layer_count + 7) / 8; ++i)
      for (std::uint32_t bits = r.u8(), k = 0; bits; bits >>= 1, ++k)
        if (bits & 1u) {
          if (8 * i + k >= layer_count) r.fail("layer " + std::to_string(8 * i + k) + " of " + std::to_string(layer_count));
          n.layers.push_back(8 * i + k);
        }
    if (n.what == kind::layer_verified && n.layers.size() != 1) r.fail(std::to_string(n.layers.size()) + " layers acknowledged at once");
    r.expect_end();
    return n;
  }
};

/// Whether `b` is a sealed partition_notice of another transfer than `transfer` (an earlier
/// transfer on the same tags left it queued). Never throws.
inline bool notice_of_another_transfer(std::span<const std::byte> b, std::uint64_t transfer) noexcept {
  try {
    reader r(unseal(b, "partition notice"), "partition notice");
    return r.u32() == partition_notice::magic && r.u64() != transfer;
  } catch (...) {
    return false;
  }
}

/// The plan's transfers to one clone rank as the failovers so far changed them, by *round*:
/// round 0 is the plan's, round r the replacements the r-th notice brought. Every rank
/// applies that clone rank's notices in the same order, so all hold the same ledger, and a
/// notice names exactly the transfers lost: those of one failed source from one round, in
/// the layers whose groups had not verified (never bytes already verified).
class failover_ledger {
 public:
  failover_ledger(const partition_plan& plan, std::uint32_t clone) : clone_(clone) {
    rounds_.push_back(plan.only([&](auto& x) { return x.clone == clone; }));
  }
  /// The round the next notice's replacements will be.
  std::uint32_t next_round() const noexcept { return static_cast<std::uint32_t>(rounds_.size()); }
  /// Replaces the transfers `n` names by transfers from live holders (each range split evenly
  /// over them); returns them grouped, as round next_round(). Throws errc::source_failed,
  /// naming the bytes, where no live source holds them, and errc::invalid_argument for a
  /// notice that names no transfer (the ledger is then unchanged).
  partition_groups apply(const layout& global, const partition_failover& f, const partition_notice& n, std::uint32_t clones) {
    if (n.round >= rounds_.size() || !n.failed[n.source])
      throw error(errc::invalid_argument, "a failover notice for round " + std::to_string(n.round) + " of " + std::to_string(rounds_.size()) +
                                              " or a source it does not name failed");
    std::vector<char> in_layers(global.layer_count(), 0);
    for (auto l : n.layers) in_layers[l] = 1;
    auto lost = [&](const region_transfer& x) { return x.source == n.source && in_layers[x.layer]; };
    const auto replaced = rounds_[n.round].only(lost);
    if (replaced.transfers().empty()) throw error(errc::invalid_argument, "a failover notice that names no transfer");
    auto replacement = make_failover_plan(global, f.sources, replaced, std::vector<bool>(n.failed.begin(), n.failed.end()), f.alignment);
    rounds_[n.round] = rounds_[n.round].only([&](auto& x) { return !lost(x); });
    rounds_.push_back(std::move(replacement));
    return make_partition_groups(rounds_.back(), static_cast<std::uint32_t>(f.sources.size()), clones, f.options);
  }
  /// Sharing's fallback: the forwards of clone rank `n.source` to this ledger's clone rank in
  /// `n.layers` (each (forwarder, layer) asked once) sent by the live sources holding their
  /// bytes instead, as round next_round(); returned grouped. Throws like apply.
  partition_groups refetch(const layout& global, const partition_failover& f, const partition_notice& n, std::uint32_t clones) {
    std::vector<char> in_layers(global.layer_count(), 0);
    for (auto l : n.layers) {
      if (std::find(refetched_.begin(), refetched_.end(), std::pair{n.source, l}) != refetched_.end())
        throw error(errc::invalid_argument, "asks again for the forwards of layer " + std::to_string(l) + " from clone rank " + std::to_string(n.source));
      in_layers[l] = 1;
    }
    std::vector<region_transfer> lost;  // one pass over the forwards, after every check
    for (const auto& x : f.plan.forwards())
      if (x.source == n.source && x.clone == clone_ && in_layers[x.layer]) lost.push_back(x);
    if (lost.empty()) throw error(errc::invalid_argument, "a refetch notice that names no forward");
    auto replacement = make_refetch_plan(global, f.sources, lost, std::vector<bool>(n.failed.begin(), n.failed.end()), f.alignment);
    for (auto l : n.layers) refetched_.emplace_back(n.source, l);
    rounds_.push_back(std::move(replacement));
    return make_partition_groups(rounds_.back(), static_cast<std::uint32_t>(f.sources.size()), clones, f.options);
  }

 private:
  std::uint32_t clone_;
  std::vector<partition_plan> rounds_;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> refetched_;  // (forwarding clone rank, layer) asked of the sources
};

/// Refuses (errc::invalid_argument) failover holdings for another number of sources than the route's.
inline void check_sources(const partition_failover& f, const roles& ranks) {
  if (f.sources.size() != ranks.source_count())
    throw error(errc::invalid_argument, "partition_failover: holdings of " + std::to_string(f.sources.size()) + " sources, the route has " +
                                            std::to_string(ranks.source_count()));
}

/// The first two tags of a partitioned transfer, before its layers' (so that ranks whose
/// layouts differ still talk): the clone ranks' messages to the sources (hello,
/// acknowledgements, failover notices), and the sources' refusals.
inline int control_tag(int tag_base) { return tag_base; }
inline int refusal_tag(int tag_base) { return tag_base + 1; }

/// A source's side of failover: takes every clone rank's notices, records which clone ranks
/// acknowledged which layer, and computes the replacement groups it must send.
class source_failover {
 public:
  source_failover(const layout& global, const partition_failover& f, const partition_groups& groups, const roles& ranks, std::uint32_t source,
                  std::uint64_t transfer)
      : global_(global), failover_(f), source_(source), clones_(ranks.clone_count()), transfer_(transfer) {
    check_sources(f, ranks);
    wanted_.assign(global.layer_count(), std::vector<char>(clones_, 0));
    acked_ = wanted_;
    for (const auto& g : groups.groups()) wanted_[g.layer][g.clone] = 1;
    for (const auto& g : groups.forwards()) wanted_[g.layer][g.clone] = 1;  // the sources may be asked for forwarded bytes
    gone_.assign(clones_, 0);
    failed_.assign(clones_, std::vector<char>(f.sources.size(), 0));
    for (std::uint32_t c = 0; c < clones_; ++c) ledgers_.emplace_back(f.plan, c);
  }
  /// Takes notice `b` of clone rank `c`; true if it names this source failed (the sender
  /// then withdraws its sends to `c`). `released[l]`: layer l was reported sent (the trainer
  /// may have overwritten it), so no replacement of it can be served any more. Throws for a
  /// notice it refuses (the sender drops and counts it).
  bool take(std::uint32_t c, std::span<const std::byte> b, const std::vector<char>& released) {
    const auto n = partition_notice::decode(b, c, failover_.sources.size(), global_.layer_count(), clones_);
    if (n.transfer != transfer_) throw error(errc::corrupt_message, "a notice of another transfer (an earlier one on the same tags)");
    if (n.what == partition_notice::kind::layer_verified) {
      acked_[n.layers.front()][c] = 1;
      return false;
    }
    const bool was_gone = gone_[c];
    serve(c, n, released);
    return gone_[c] && !was_gone;
  }
  /// Replacement groups this source must send now: those of layers it sent its own groups
  /// of (`sent[l]`), so that they follow them on the layer's tags.
  std::vector<partition_group> take_ready(const std::vector<char>& sent) {
    std::vector<partition_group> out;
    std::erase_if(pending_, [&](partition_group& g) { return sent[g.layer] && (out.push_back(std::move(g)), true); });
    return out;
  }
  /// True once every clone rank that wants layer `l` acknowledged it or named this source failed.
  bool acknowledged(std::uint32_t l) const {
    for (std::size_t c = 0; c < clones_; ++c)
      if (wanted_[l][c] && !acked_[l][c] && !gone_[c]) return false;
    return true;
  }
  /// Clone rank `c` is served nothing more (its hello was refused, or it named this source
  /// failed): its acknowledgements are no longer awaited.
  void forget(std::uint32_t c) {
    gone_.at(c) = 1;
    std::erase_if(pending_, [&](const partition_group& g) { return g.clone == c; });
  }
  /// Whether clone rank `c` named this source failed (it expects nothing more from here).
  bool gone(std::uint32_t c) const { return gone_.at(c) != 0; }

 private:
  /// Serves a failover notice of clone rank `c`. What bounds the work a clone rank can ask
  /// for: failed sources stay failed, and each notice removes transfers of a failed source
  /// from the ledger, adding transfers of live ones only.
  void serve(std::uint32_t c, const partition_notice& n, const std::vector<char>& released) {
    if (n.failed[source_]) return forget(c);  // presumed failed by this clone rank: it expects nothing more from here
    for (auto l : n.layers)
      if (released[l])
        throw error(errc::invalid_argument, "asks for layer '" + global_.layers()[l].name + "', which this source already released");
    for (std::size_t s = 0; s < n.failed.size(); ++s)
      if (failed_[c][s] && !n.failed[s]) throw error(errc::invalid_argument, "a failover notice that revives source " + std::to_string(s));
    auto groups = n.what == partition_notice::kind::refetch ? ledgers_[c].refetch(global_, failover_, n, clones_)
                                                            : ledgers_[c].apply(global_, failover_, n, clones_);
    failed_[c] = n.failed;
    for (auto gi : groups.sent_by_source(source_)) pending_.push_back(groups.groups()[gi]);
  }

  const layout& global_;
  const partition_failover& failover_;
  std::uint32_t source_, clones_;
  std::uint64_t transfer_;
  std::vector<std::vector<char>> wanted_, acked_;  // per layer, per clone rank
  std::vector<char> gone_;                        // clone ranks that named this source failed
  std::vector<std::vector<char>> failed_;          // per clone rank: the sources it named failed so far
  std::vector<failover_ledger> ledgers_;           // per clone rank
  std::vector<partition_group> pending_;           // replacement groups not sent yet
};

/// A group a clone rank lost: its source failed before it verified.
struct lost_group {
  std::uint32_t source = 0, round = 0, layer = 0;
};

/// A failover round's replacement groups, as the ledger round they belong to.
struct replacement_groups {
  std::uint32_t round = 0;
  partition_groups groups;
};

/// A clone rank's side of failover: acknowledges verified layers, and turns lost groups into
/// notices to the sources and the replacement groups it must receive.
template <class Comm>
class clone_failover {
 public:
  clone_failover(Comm& c, const layout& global, const partition_failover& f, const roles& ranks, std::uint32_t clone, int tag_base,
                 std::uint64_t transfer)
      : comm_(c), global_(global), failover_(f), clone_(clone), clones_(static_cast<std::uint32_t>(ranks.clone_count())),
        source_ranks_(ranks.sources), tag_(control_tag(tag_base)), transfer_(transfer), ledger_(f.plan, clone) {
    check_sources(f, ranks);
    failed_.assign(source_ranks_.size(), 0);
    acked_.assign(global.layer_count(), 0);
  }
  clone_failover(const clone_failover&) = delete;
  clone_failover& operator=(const clone_failover&) = delete;
  ~clone_failover() {
    outbox_.cancel_all(comm_);
    farewells_.cancel_all(comm_);
  }

  /// Tells every live source that layer `l` is verified here (once).
  void acknowledge(std::uint32_t l) {
    if (acked_[l]) return;
    acked_[l] = 1;
    notify({partition_notice::kind::layer_verified, clone_, 0, 0, {l}, {}});
  }
  /// Marks `failed` sources failed and returns the groups that replace the `lost` ones (one
  /// notice per lost (source, round), every source told; the failed ones learn they are
  /// presumed failed). Throws errc::source_failed where no live source holds a byte this
  /// rank wants; nothing changes then.
  std::vector<replacement_groups> fail_over(std::span<const std::uint32_t> failed, std::span<const lost_group> lost) {
    auto now_failed = failed_;
    for (auto s : failed) now_failed.at(s) = 1;
    auto ledger = ledger_;
    std::vector<replacement_groups> out;
    std::vector<partition_notice> notices;
    for (const auto& n : notices_for(lost, now_failed)) {
      const auto round = ledger.next_round();
      out.push_back({round, ledger.apply(global_, failover_, n, clones_)});
      notices.push_back(n);
    }
    ledger_ = std::move(ledger), failed_ = std::move(now_failed);
    for (const auto& n : notices) notify(n);
    if (notices.empty())  // a failed source with nothing lost here still learns it is presumed failed
      for (auto s : failed) farewells_.send_owned(comm_, source_ranks_[s], tag_, farewell(s).encode(global_.layer_count(), transfer_));
    return out;
  }
  /// Sharing's fallback: asks the live sources for the forwards of clone rank `forwarder` to
  /// this rank in `layers` and returns the groups that carry them (one notice to every source).
  /// Throws errc::source_failed where no live source holds a byte of them; nothing changes then.
  replacement_groups refetch(std::uint32_t forwarder, std::vector<std::uint32_t> layers) {
    const partition_notice n{partition_notice::kind::refetch, clone_, forwarder, 0, std::move(layers), failed_};
    auto ledger = ledger_;
    replacement_groups out{ledger.next_round(), ledger.refetch(global_, failover_, n, clones_)};
    ledger_ = std::move(ledger);
    notify(n);
    return out;
  }
  bool failed(std::uint32_t s) const { return failed_.at(s) != 0; }
  /// True once every notice to a live source was sent (those sources wait for the
  /// acknowledgements; a failed one may never take its notices).
  bool flushed() { return outbox_.all_done(comm_); }

 private:
  /// One failover notice per lost (source, round), naming its layers, in a fixed order.
  std::vector<partition_notice> notices_for(std::span<const lost_group> lost, const std::vector<char>& failed) const {
    std::vector<partition_notice> out;
    for (const auto& g : lost) {
      auto same = [&](const partition_notice& n) { return n.source == g.source && n.round == g.round; };
      auto it = std::find_if(out.begin(), out.end(), same);
      if (it == out.end()) it = out.insert(out.end(), {partition_notice::kind::failover, clone_, g.source, g.round, {}, failed});
      if (std::find(it->layers.begin(), it->layers.end(), g.layer) == it->layers.end()) it->layers.push_back(g.layer);
    }
    return out;
  }
  partition_notice farewell(std::uint32_t s) const { return {partition_notice::kind::failover, clone_, s, 0, {}, failed_}; }
  /// Sends `n` to every source: live ones through the outbox `flushed()` waits for, failed
  /// ones through another.
  void notify(const partition_notice& n) {
    const auto bytes = n.encode(global_.layer_count(), transfer_);
    for (std::uint32_t s = 0; s < source_ranks_.size(); ++s) {
      if (!failed_[s]) outbox_.send_owned(comm_, source_ranks_[s], tag_, bytes);
      else if (n.what == partition_notice::kind::failover) farewells_.send_owned(comm_, source_ranks_[s], tag_, bytes);
    }
  }

  Comm& comm_;
  const layout& global_;
  const partition_failover& failover_;
  std::uint32_t clone_, clones_;
  std::vector<int> source_ranks_;
  int tag_;
  std::uint64_t transfer_;
  failover_ledger ledger_;
  std::vector<char> failed_, acked_;
  outbox<Comm> outbox_, farewells_;
};

}  // namespace detail
}  // namespace deepclone
