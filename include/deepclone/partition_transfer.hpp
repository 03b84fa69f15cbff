#pragma once
/// \file partition_transfer.hpp
/// Moving the partitioned plan's bytes over a communicator (issue 12). A source sends its
/// groups (partition_groups.hpp) message by message: a direct run straight from its own
/// tensor (zero copy), short runs packed into one buffer (reused for a later message once
/// its send completed), or (a `gather` message on a
/// gathering_communicator) handed to the transport as they lie in its tensors; after each
/// group, a sealed list of the checksums (one per message, one per run of a gather message).
/// A clone rank receives a direct run straight into its own tensor, a packed message into a
/// buffer (checked, and only then unpacked, so a corrupt one writes nothing), a gathered one
/// (on a gathering_communicator) scattered into its runs of its own tensors, checked run by
/// run where it landed, as direct runs are. Nothing a peer sends lands outside a clone
/// tensor: every receive is posted into bounds-checked runs of exact size, and garbage sums
/// are refused before they are read.
///
/// With partition_sharing::exchange (holdings.hpp) the sources send each byte once, to one of
/// the clone ranks that want it, and that clone rank forwards it (detail/group_sender.hpp,
/// as a source sends) to the others once it verified that layer's groups from the sources;
/// a forwarded group is verified like a source's, on the same tags (from the forwarding
/// clone rank). With failover, what a clone rank does not forward (refused, gone, silent,
/// corrupt) comes from the sources instead (detail/partition_exchange.hpp); without, its
/// peers time out naming the forwarded group.
///
/// Each layer has its own pair of tags (data, sums) from `tag_base` on, so a source may send
/// its layers in any order (a trainer updates them last-first); within one layer, the
/// messages between one source and one clone rank match in the order sent (the
/// communicator's rule), which both sides walk alike. Sums, notices and farewells name the
/// transfer (partition_route::transfer), so that what an earlier transfer on the same tags
/// left queued is dropped (a group's bytes received again), not taken for this one's.
///
/// What this is today: the transfer from sources whose layers do not change until they are
/// reported sent (`layer_sent(l)` / `wait_layer(l)`: a trainer may train on and wait only
/// before it updates a layer still in flight), driven by `progress()` or `wait()`. With
/// `partition_route::failover` a source failed (or silent) is replaced by the live holders of
/// its bytes, a group that fails its checksum comes again from another holder
/// (detail/partition_failover.hpp), and a layer counts as sent only once every clone rank
/// that wants it acknowledged it. Before any byte moves, each clone rank proves to every
/// source that both planned the same transfer (detail/partition_handshake.hpp). The fork
/// point is agreed by partition_engine.hpp, which drives this per fork. The tags must
/// not overlap those of an engine, or of an earlier transfer whose messages may still be
/// unreceived (a silent source's notices), on the same communicator.
/// Parts in device memory are staged through host buffers by a `Memory` policy
/// (part_memory.hpp): every message then leaves from, and lands in, a host buffer.
/// Templated on the communicator, the checksum and that policy.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "checksum.hpp"
#include "communicator.hpp"
#include "detail/bytes.hpp"
#include "detail/group_sender.hpp"
#include "detail/outbox.hpp"
#include "detail/partition_exchange.hpp"
#include "detail/partition_failover.hpp"
#include "detail/partition_handshake.hpp"
#include "error.hpp"
#include "holdings.hpp"
#include "part_memory.hpp"
#include "partition_groups.hpp"
#include "roles.hpp"

namespace deepclone {

namespace detail {

/// "layer 1 from source 0 to clone rank 2": how errors name a group.
inline std::string group_label(const layout& global, const partition_group& g) {
  return "layer '" + global.layers().at(g.layer).name + "' from " + (g.forwarded ? "clone rank " : "source ") + std::to_string(g.source) +
         " to clone rank " + std::to_string(g.clone);
}

/// Throws `errc::unsupported` when a transfer of `layers` layers needs tags beyond the
/// communicator's bound: the control and refusal tags, then 2 per layer (data, sums).
template <class Comm>
void check_tags(const Comm& c, int tag_base, std::size_t layers) {
  const long long last = static_cast<long long>(tag_base) + 2LL * static_cast<long long>(layers) + 1;
  if (tag_base < 0 || last > max_tag_of(c))
    throw error(errc::unsupported, "partitioned transfer: " + std::to_string(layers) + " layers need tags " + std::to_string(tag_base) +
                                       " to " + std::to_string(last) + "; the communicator allows 0 to " + std::to_string(max_tag_of(c)));
}
}  // namespace detail

/// Where a transfer runs: the communicator's roles, the global layout, the groups every
/// rank computed alike, and the first of the 2 + 2 x layers tags it uses (the clone ranks'
/// hellos and notices, the sources' refusals, then per layer data and sums).
struct partition_route {
  const roles& ranks;
  const layout& global;
  const partition_groups& groups;
  int tag_base = 0;
  /// Set (alike on every rank): a failed source's groups come from the live holders of the
  /// same bytes, and a source keeps each layer until every clone rank that wants it
  /// acknowledged it (detail/partition_failover.hpp). Null: no failover, no acknowledgements.
  const partition_failover* failover = nullptr;
  /// Names this transfer in what it sends that may outlive it (each group's sums): a group
  /// an earlier transfer on the same tags left queued at a clone rank that gave up is
  /// dropped and received again, not taken for this one's. Give consecutive transfers on
  /// the same tags different ids (partition_engine uses its fork's session id).
  std::uint64_t transfer = 0;
};

/// A source's side: sends its groups from its own tensors (`tensors[t]`: its part of global
/// tensor t, as its holdings declare, where `Memory` reaches them). The tensors must not
/// change until `done()`.
template <class Comm, class Checksum = checksum::mix64, part_memory Memory = host_memory>
class partition_sender {
 public:
  partition_sender(Comm& c, partition_route route, std::uint32_t source, std::span<const std::span<const std::byte>> tensors)
      : comm_(c), route_(route), source_(source), out_(c, route_.global, route_.tag_base, route_.transfer, tensors), sent_(route_.global.layer_count(), 0),
        released_(route_.global.layer_count(), 0) {
    if (source >= route_.ranks.source_count())
      throw error(errc::invalid_argument, "partition_sender: source " + std::to_string(source) + " of " +
                                              std::to_string(route_.ranks.source_count()));
    const auto layers = route_.global.layer_count();
    detail::check_tags(comm_, route_.tag_base, layers);
    if (route_.failover) failover_.emplace(route_.global, *route_.failover, route_.groups, route_.ranks, source, route_.transfer);
    inbox_.emplace(comm_, route_.ranks, route_.global, route_.groups, source, detail::control_tag(route_.tag_base),
                   detail::refusal_tag(route_.tag_base), detail::partition_notice::max_size(route_.ranks.source_count(), layers));
  }
  partition_sender(const partition_sender&) = delete;
  partition_sender& operator=(const partition_sender&) = delete;
  /// Pending sends are withdrawn (cancel(): a no-op for those that completed); direct and
  /// gathered sends read the own tensors: keep those alive until done() where a clone rank
  /// may have withdrawn.
  ~partition_sender() { cancel(); }

  /// Sends every group of layer `l` this source serves (then, with failover, the groups of
  /// layer `l` it stands in for); a group to a clone rank whose hello has not come yet leaves
  /// once it came and matched (detail/partition_handshake.hpp). Every run is bounds-checked
  /// against the own tensors before the first byte leaves (errc::invalid_argument).
  void send_layer(std::uint32_t l) {
    for (auto gi : route_.groups.sent_by_source(source_)) {
      const auto& g = route_.groups.groups()[gi];
      if (g.layer != l || (failover_ && failover_->gone(g.clone)) || inbox_->refused(g.clone)) continue;
      if (inbox_->admitted(g.clone)) send_group(g);
      else held_.push_back(&g);
    }
    sent_.at(l) = 1;
    progress();
  }
  /// Takes the clone ranks' hellos (sending what waited for them) and, with failover, their
  /// notices, and sends the replacement groups asked of layers already sent (the other calls
  /// do this too). Never throws for what a clone rank sent: a notice it cannot serve is
  /// dropped and counted (refused_notices()), a hello that does not match is answered with
  /// a refusal and that clone rank is served nothing.
  void progress() {
    inbox_->poll([&](std::uint32_t c) { release_held(c); }, [&](std::uint32_t c, std::span<const std::byte> b) { take_notice(c, b); },
                 [&](std::span<const std::byte> b) { return detail::notice_of_another_transfer(b, route_.transfer); });
    if (failover_)
      for (const auto& g : failover_->take_ready(sent_)) send_group(g);
  }
  /// Clone rank `c`'s plan is known to match this source's (partition_engine: its request
  /// hello did): its groups leave from now on without waiting for its hello, which is still
  /// judged when it comes. Call before send_layer.
  void admit_in_advance(std::uint32_t c) { inbox_->presume(c); }
  /// Clone ranks' notices dropped (undecodable, or asking what this source cannot serve),
  /// and why the last one was.
  std::size_t refused_notices() const noexcept { return refused_notices_; }
  const std::string& last_refusal() const noexcept { return last_refusal_; }
  /// Whether clone rank `c`'s hello did not match this source's plan (it was told why).
  bool refused(std::uint32_t c) const { return inbox_->refused(c); }
  void send_all() {
    for (std::uint32_t l = 0; l < route_.global.layer_count(); ++l) send_layer(l);
  }
  /// True once every clone rank's hello was judged and every send posted so far completed
  /// (with failover: and every layer was acknowledged by every clone rank that wants it).
  bool done() {
    progress();
    for (std::uint32_t l = 0; l < sent_.size(); ++l)
      if (!layer_complete(l)) return false;
    return inbox_->settled();
  }
  /// True once every send of layer `l` posted so far completed (with failover: and every
  /// clone rank that wants the layer acknowledged it): from then on the trainer may
  /// overwrite the layer (a live fork's window rule: the sources train on while the bytes
  /// move, and wait only before updating a layer still in flight).
  bool layer_sent(std::uint32_t l) {
    if (l >= sent_.size())
      throw error(errc::invalid_argument, "partition_sender: layer " + std::to_string(l) + " of " + std::to_string(sent_.size()));
    progress();
    return layer_complete(l);
  }
  /// Blocks until done(); throws errc::timeout after `timeout`.
  void wait(std::chrono::nanoseconds timeout) { wait_until([&] { return done(); }, timeout, "sends"); }
  /// Blocks until layer_sent(l); throws errc::timeout after `timeout`, naming the layer.
  void wait_layer(std::uint32_t l, std::chrono::nanoseconds timeout) {
    const auto name = l < route_.global.layer_count() ? "'" + route_.global.layers()[l].name + "'" : std::to_string(l);
    wait_until([&] { return layer_sent(l); }, timeout, "sends of layer " + name);
  }
  /// Withdraws the sends still pending. Where the transport cannot withdraw them (Open MPI:
  /// a withdrawn send is only parked, and reads its buffer when a receive matches it later),
  /// the packed buffers of the sends still pending outlive the sender
  /// (detail::retained_buffers); none is reused.
  void cancel() noexcept {
    out_.cancel();
    if (inbox_) inbox_->cancel();
    held_.clear();
  }

 private:
  template <class Done>
  void wait_until(Done done, std::chrono::nanoseconds timeout, const std::string& what) {
    detail::idler<Comm> idle(comm_);
    const auto until = std::chrono::steady_clock::now() + timeout;
    for (idle.mark(); !done(); idle.mark()) {
      if (std::chrono::steady_clock::now() >= until)
        throw error(errc::timeout, "partitioned transfer: source " + std::to_string(source_) + "'s " + what + " did not complete in time");
      idle.idle(until);
    }
  }
  /// Clone rank `c`'s hello was judged: the groups held for it leave now (admitted) or never
  /// (refused: with failover, its acknowledgements are no longer awaited either). A group
  /// whose send throws stays held, with the ones after it.
  void release_held(std::uint32_t c) {
    if (inbox_->refused(c)) {  // also sends already posted to it, had it been admitted in advance
      out_.withdraw([c](std::uint32_t to) { return to == c; });
      if (failover_) failover_->forget(c);
    }
    std::vector<const partition_group*> mine;
    std::erase_if(held_, [&](const partition_group* g) { return g->clone == c && (mine.push_back(g), true); });
    for (std::size_t i = 0; i < mine.size() && inbox_->admitted(c); ++i) {
      try {
        send_group(*mine[i]);
      } catch (...) {
        held_.insert(held_.end(), mine.begin() + static_cast<std::ptrdiff_t>(i), mine.end());
        throw;
      }
    }
  }
  /// A notice of admitted clone rank `c` (an acknowledgement or a failover request).
  void take_notice(std::uint32_t c, std::span<const std::byte> b) {
    try {
      if (!failover_) throw error(errc::invalid_argument, "a notice, but this transfer has no failover");
      if (failover_->take(c, b, released_)) out_.withdraw([c](std::uint32_t to) { return to == c; });
    } catch (const std::exception& e) {  // a clone rank's garbage, or a request no live source can serve
      ++refused_notices_;
      last_refusal_ = "clone rank " + std::to_string(c) + ": " + e.what();
    }
  }
  /// Whether layer `l` may be overwritten (layer_sent, without taking notices first); a
  /// send to a clone rank that named this source failed, or that was refused, was withdrawn
  /// and no longer counts.
  bool layer_complete(std::uint32_t l) {
    for (const auto* g : held_)
      if (g->layer == l) return false;
    if (!out_.layer_done(l, [&](std::uint32_t c) { return (failover_ && failover_->gone(c)) || inbox_->refused(c); })) return false;
    if (failover_ && !failover_->acknowledged(l)) return false;
    released_[l] = 1;
    return true;
  }
  void send_group(const partition_group& g) { out_.send(g, route_.ranks.clones.at(g.clone)); }

  Comm& comm_;
  partition_route route_;
  std::uint32_t source_;
  detail::group_sender<Comm, Checksum, Memory> out_;
  std::vector<char> sent_, released_;          // per layer: send_layer called; reported sent (may be overwritten)
  std::vector<const partition_group*> held_;   // groups to clone ranks whose hello has not come yet
  std::optional<detail::source_failover> failover_;
  std::optional<detail::source_inbox<Comm>> inbox_;  // constructed last: posts receives
  std::size_t refused_notices_ = 0;
  std::string last_refusal_;
};

/// A clone rank's side: receives every group it wants into its own tensors (`tensors[t]`:
/// its part of global tensor t, as its holdings declare), verifying each message. With
/// partition_sharing::exchange it also forwards its share to the other clone ranks wanting
/// it, straight from those tensors: keep them alive until progress() is true where a
/// transport cannot withdraw sends (as for a source's tensors), and give every transfer its
/// own tags (a forward to a clone rank that gave up stays parked there).
template <class Comm, class Checksum = checksum::mix64, part_memory Memory = host_memory>
class partition_receiver {
 public:
  partition_receiver(Comm& c, partition_route route, std::uint32_t clone, std::span<const std::span<std::byte>> tensors)
      : comm_(c), route_(route), clone_(clone), tensors_(tensors.begin(), tensors.end()), unverified_(route_.global.layer_count(), 0),
        from_sources_(unverified_), forwarded_(route_.groups.forwarded_by_clone(clone).size(), 0), quiet_since_(route_.ranks.source_count(), detail::clock::now()) {
    if (clone >= route_.ranks.clone_count())
      throw error(errc::invalid_argument, "partition_receiver: clone rank " + std::to_string(clone) + " of " +
                                              std::to_string(route_.ranks.clone_count()));
    detail::check_tags(comm_, route_.tag_base, route_.global.layer_count());
    if (route_.failover) failover_.emplace(comm_, route_.global, *route_.failover, route_.ranks, clone, route_.tag_base, route_.transfer);
    try {
      for (auto gi : route_.groups.received_by_clone(clone_)) post_group(route_.groups.groups()[gi], 0);
      for (auto gi : route_.groups.forwarded_to_clone(clone_)) post_group(route_.groups.forwards()[gi], 0);
      if (!route_.groups.forwarded_by_clone(clone_).empty()) {
        const std::vector<std::span<const std::byte>> own(tensors_.begin(), tensors_.end());
        forward_.emplace(comm_, route_.global, route_.tag_base, route_.transfer, own);
      }
      if (failover_) peers_.emplace(comm_, route_.ranks, route_.global, route_.groups, clone_, detail::control_tag(route_.tag_base), route_.transfer);
    } catch (...) {  // a run outside an own tensor: nothing stays posted
      cancel();
      throw;
    }
    // Last, once this rank can receive everything: the hello admits it at the sources.
    handshake_.emplace(comm_, route_.ranks, route_.global, route_.groups, clone, detail::control_tag(route_.tag_base),
                       detail::refusal_tag(route_.tag_base));
  }
  partition_receiver(const partition_receiver&) = delete;
  partition_receiver& operator=(const partition_receiver&) = delete;
  ~partition_receiver() { cancel(); }

  /// Tests the receives; a group whose messages and sums all arrived is verified and
  /// unpacked. With partition_sharing::exchange, forwards each layer's share to the other
  /// clone ranks once every group of that layer from the sources is verified. True once
  /// every group is, and every forward was received. Throws errc::corrupt_message naming
  /// the group and the tensor of a message whose bytes fail their checksum (nothing of a
  /// packed message is unpacked then).
  bool progress() {
    handshake_->check();
    bool all = true;
    for (auto& in : incoming_) all = (in.replaced || settle(in)) && all;
    if (!corrupt_.empty() || !corrupt_forwards_.empty()) ask_again_elsewhere();
    if (peers_) take_farewells();
    forward_verified();
    complete_ = all && forwards_done() && (!failover_ || failover_->flushed());  // the sources wait for the acknowledgements
    return complete_;
  }
  /// With failover: presumes failed the sources this rank still awaits that neither delivered
  /// a group nor were asked for one for `presume_failed_after`, once some source delivered one
  /// (wait() does this between rounds; a caller driving progress() itself calls it too).
  void presume_silent_failed() {
    if (!failover_ || (!any_delivered_ && !route_.groups.received_by_clone(clone_).empty())) return;  // forwards only: from the start
    const auto now = detail::clock::now();
    std::vector<std::uint32_t> silent, silent_forwarders;
    for (const auto& in : incoming_) {
      if (in.verified || in.replaced) continue;
      const auto s = in.group->source;
      const auto last = in.group->forwarded ? peers_->last_heard(s) : quiet_since_[s];
      if (now - last > route_.failover->presume_failed_after) add_once(in.group->forwarded ? silent_forwarders : silent, s);
    }
    if (!silent.empty()) fail_over(silent);
    for (auto f : silent_forwarders) refetch_from(f);
  }
  /// What has not arrived yet, for a timeout's message.
  std::string missing() {
    for (const auto& in : incoming_)
      if (!in.verified && !in.replaced) return detail::group_label(route_.global, *in.group);
    if (!forwards_done()) return "forwards of clone rank " + std::to_string(clone_) + " to the other clone ranks";
    return failover_ ? "acknowledgements to the sources" : "nothing";
  }
  /// True once every group of layer `l` arrived and was verified.
  bool layer_done(std::uint32_t l) const { return unverified_.at(l) == 0; }
  /// Groups an earlier transfer on the same tags had left queued, dropped (and received again).
  std::size_t stale_groups() const noexcept { return stale_groups_; }
  /// Bytes of the groups verified so far: sent by sources, and forwarded by clone ranks.
  struct verified_bytes {
    std::uint64_t from_sources = 0, from_clones = 0;
  };
  verified_bytes verified() const {
    verified_bytes v;
    for (const auto& in : incoming_)
      if (in.verified) (in.group->forwarded ? v.from_clones : v.from_sources) += in.group->bytes;
    return v;
  }
  /// Sources presumed failed (with failover), whose bytes come from other holders.
  std::vector<std::uint32_t> failed_sources() const {
    std::vector<std::uint32_t> out;
    for (std::uint32_t s = 0; failover_ && s < route_.ranks.source_count(); ++s)
      if (failover_->failed(s)) out.push_back(s);
    return out;
  }
  /// Clone ranks whose forwards this rank asked of the sources instead (sharing, failover).
  const std::vector<std::uint32_t>& refetched_forwarders() const noexcept { return refetched_forwarders_; }
  /// Presumes `sources` failed: withdraws the receives of their groups still missing, tells
  /// every source, and receives those groups' bytes from live holders instead
  /// (route.failover). Sources already presumed failed are skipped. Throws
  /// errc::source_failed naming the bytes where no live source holds them (no replica
  /// exists), or where the route has no failover.
  void fail_over(std::span<const std::uint32_t> sources) {
    const auto named = [](const std::vector<std::uint32_t>& in, std::uint32_t s) { return std::find(in.begin(), in.end(), s) != in.end(); };
    if (!failover_)
      throw error(errc::source_failed, "partitioned transfer: source " + std::to_string(sources.empty() ? 0 : sources.front()) +
                                           " failed, and this transfer has no failover (partition_route::failover)");
    for (auto s : sources)
      if (s >= route_.ranks.source_count())
        throw error(errc::invalid_argument, "partition_receiver::fail_over: source " + std::to_string(s) + " of " +
                                                std::to_string(route_.ranks.source_count()));
    std::vector<std::uint32_t> newly;  // a failed source's groups were all replaced when it failed
    for (auto s : sources)
      if (!failover_->failed(s) && !named(newly, s)) newly.push_back(s);
    if (newly.empty()) return;
    std::vector<incoming*> lost;
    std::vector<detail::lost_group> lost_groups;
    for (auto& in : incoming_)
      if (!in.verified && !in.replaced && !in.group->forwarded && named(newly, in.group->source)) {
        lost.push_back(&in);
        lost_groups.push_back({in.group->source, in.round, in.group->layer});
      }
    auto more = failover_->fail_over(newly, lost_groups);  // throws: nothing withdrawn
    for (auto* in : lost) {
      withdraw(*in);
      in->replaced = true;
      --unverified_[in->group->layer];
      if (in->gates_forwards) --from_sources_[in->group->layer];
    }
    for (auto& r : more) {
      const auto& kept = replacements_.emplace_back(std::move(r.groups));
      for (auto gi : kept.received_by_clone(clone_)) post_group(kept.groups()[gi], r.round);
    }
  }
  /// Blocks until progress() is true; throws errc::timeout after `timeout`, naming the first
  /// group still missing. The receives are withdrawn on any error.
  void wait(std::chrono::nanoseconds timeout) {
    detail::idler<Comm> idle(comm_);
    const auto until = std::chrono::steady_clock::now() + timeout;
    try {
      for (idle.mark(); !progress(); idle.mark()) {
        if (std::chrono::steady_clock::now() >= until) throw error(errc::timeout, "partitioned transfer: " + missing() + " did not arrive in time");
        presume_silent_failed();
        idle.idle(until);
      }
    } catch (...) {
      cancel();
      throw;
    }
  }
  /// Withdraws every pending receive (afterwards nothing more is written into the tensors)
  /// and every pending forward (where the transport cannot, those still read the tensors).
  void cancel() noexcept {
    for (auto& in : incoming_) withdraw(in);
    if (forward_) forward_->cancel();
    if (handshake_) handshake_->cancel();
    if (peers_ && !complete_) peers_->farewell_all();  // giving up: the peers ask the sources instead
  }

 private:
  struct incoming {
    const partition_group* group = nullptr;  ///< in route.groups or a failover's replacements
    bool replaced = false;                   ///< withdrawn: its source failed, replacement groups carry its bytes
    std::uint32_t round = 0;                 ///< the failover round that brought it (0: the plan's)
    bool gates_forwards = false;             ///< from a source, and this rank's forwards of its layer wait for it
    std::vector<typename Comm::request_type> data;
    std::vector<std::vector<std::byte>> packed;  // per message; empty for a direct one
    std::vector<std::byte> sums;
    typename Comm::request_type sums_request;
    bool verified = false;
    std::vector<typename Comm::request_type*> requests() {
      std::vector<typename Comm::request_type*> out{&sums_request};
      for (auto& r : data) out.push_back(&r);
      return out;
    }
  };

  /// Posts every receive of group `g` (of ledger round `round`: 0 for the plan's groups), from
  /// a source or, forwarded, from another clone rank. `refetched`: it carries bytes another
  /// clone rank did not forward (this rank forwards none of them, so its forwards do not wait).
  void post_group(const partition_group& g, std::uint32_t round, bool refetched = false) {
    auto& in = incoming_.emplace_back();
    in.group = &g;
    in.round = round;
    in.gates_forwards = !g.forwarded && !refetched;
    ++unverified_.at(g.layer);
    if (in.gates_forwards) ++from_sources_.at(g.layer);
    if (!g.forwarded) quiet_since_.at(g.source) = detail::clock::now();  // asked for more: silence counts from now
    for (const auto& m : g.messages) in.packed.emplace_back(lands_in_buffer(m) ? static_cast<std::size_t>(m.bytes) : 0);
    in.sums.resize(detail::partition_sums::size_for(detail::sum_count(g)));
    post_receives(in);
  }
  /// Posts the receives of group `in` (again, for a group an earlier transfer left queued).
  void post_receives(incoming& in) {
    const auto& g = *in.group;
    const int data = detail::partition_tag(route_.tag_base, g.layer, false);
    const int from = g.forwarded ? route_.ranks.clones.at(g.source) : route_.ranks.sources.at(g.source);
    in.data.clear();
    for (std::size_t i = 0; i < g.messages.size(); ++i) {
      const auto& m = g.messages[i];
      if constexpr (gathering_communicator<Comm>)
        if (detail::gathers<Comm, Memory>(m)) {
          in.data.push_back(comm_.irecv_scatter(from, data, clone_runs(m)));
          continue;
        }
      const auto into = lands_in_buffer(m) ? std::span<std::byte>(in.packed[i]) : clone_run(route_.global, m.runs.front(), tensors_);
      in.data.push_back(comm_.irecv(from, data, into));
    }
    in.sums_request = comm_.irecv(from, data + 1, std::span<std::byte>(in.sums));
  }

  /// True once group `in` is verified and unpacked (now or before).
  bool settle(incoming& in) {
    if (in.verified) return true;
    std::optional<std::size_t> sums_bytes;
    bool arrived = false;
    try {
      sums_bytes = comm_.test(in.sums_request);
      arrived = sums_bytes.has_value();
      for (auto& r : in.data) arrived = comm_.test(r).has_value() && arrived;
    } catch (const error& e) {  // a message that does not fit its receive
      if (!in.group->forwarded) throw;
      const auto what = "partitioned transfer: " + detail::group_label(route_.global, *in.group) + ": " + e.details() +
                        " (do the clone ranks plan alike?)";
      if (!failover_) throw error(errc::corrupt_message, what);
      corrupt_forwards_.push_back({in.group->source, what});  // the sources send it instead (progress)
      return false;
    }
    if (!arrived) return false;
    if (!failover_) return accept(in, *sums_bytes);
    try {
      return accept(in, *sums_bytes);
    } catch (const error& e) {  // with failover, the group comes again from another holder (progress)
      if (e.kind() != errc::corrupt_message) throw;
      (in.group->forwarded ? corrupt_forwards_ : corrupt_).push_back({in.group->source, e.details()});
      return false;
    }
  }
  /// Verifies group `in`, whose messages and `sums_bytes` of sums arrived, then unpacks it.
  bool accept(incoming& in, std::size_t sums_bytes) {
    const auto& g = *in.group;
    const auto sums = detail::partition_sums::decode_for(std::span<const std::byte>(in.sums).first(sums_bytes), g, route_.transfer);
    if (sums.transfer != route_.transfer) {  // an earlier transfer's, left queued: this one's follows
      ++stale_groups_;
      post_receives(in);
      return false;
    }
    for (std::size_t i = 0, k = 0; i < g.messages.size(); k += g.messages[i].sum_count(), ++i)
      verify(g, i, in.packed[i], std::span<const std::uint64_t>(sums.sums).subspan(k, g.messages[i].sum_count()));
    for (std::size_t i = 0; i < g.messages.size(); ++i)
      if (lands_in_buffer(g.messages[i])) unpack_message(g.messages[i], in.packed[i]);
    in.verified = true;
    delivered(in);
    return true;
  }
  /// Groups that failed verification (with failover): their sources are presumed faulty for
  /// this rank and the groups asked from the other holders; with none, the checksum error
  /// stands, saying so.
  void ask_again_elsewhere() {
    for (const auto& c : std::exchange(corrupt_forwards_, {})) {
      try {
        refetch_from(c.source);
      } catch (const error& e) {
        if (e.kind() != errc::source_failed) throw;
        throw error(errc::corrupt_message, c.what + "; no source can send it instead: " + e.details());
      }
    }
    if (corrupt_.empty()) return;
    const auto found = std::move(corrupt_);
    corrupt_.clear();
    std::vector<std::uint32_t> sources;
    for (const auto& c : found) sources.push_back(c.source);
    try {
      fail_over(sources);
    } catch (const error& e) {
      if (e.kind() != errc::source_failed) throw;
      throw error(errc::corrupt_message, found.front().what + "; no other source can send it again: " + e.details());
    }
  }
  /// Group `in` verified: notes its sender alive, and acknowledges its layer once complete.
  void delivered(const incoming& in) {
    const auto& g = *in.group;
    if (g.forwarded && peers_) peers_->heard(g.source);
    if (!g.forwarded) {
      quiet_since_[g.source] = detail::clock::now();
      if (!any_delivered_) {  // silence counts from the first delivery: before it, all quiet may only mean not at k yet
        std::fill(quiet_since_.begin(), quiet_since_.end(), detail::clock::now());
        if (peers_) peers_->restart_clocks();  // no forwarder could forward before the sources delivered
      }
      any_delivered_ = true;
    }
    if (in.gates_forwards) --from_sources_[g.layer];
    if (--unverified_[g.layer] == 0 && failover_) failover_->acknowledge(g.layer);
  }
  /// partition_sharing::exchange: forwards this rank's share of each layer to the other clone
  /// ranks wanting it, once every group of that layer from the sources is verified (what it
  /// forwards is a part of those).
  void forward_verified() {
    const auto mine = route_.groups.forwarded_by_clone(clone_);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const auto& g = route_.groups.forwards()[mine[i]];
      if (from_sources_[g.layer] != 0 || forwarded_[i] || peer_gone(g.clone)) continue;
      forward_->send(g, route_.ranks.clones.at(g.clone));
      forwarded_[i] = 1;  // after the send: one that throws is tried again, never sent twice
    }
  }
  /// True once every forward of this rank was sent and received.
  bool forwards_done() {
    if (!forward_) return true;
    const auto mine = route_.groups.forwarded_by_clone(clone_);
    for (std::size_t i = 0; i < mine.size(); ++i)
      if (!forwarded_[i] && !peer_gone(route_.groups.forwards()[mine[i]].clone)) return false;
    for (std::uint32_t l = 0; l < route_.global.layer_count(); ++l)
      if (!forward_->layer_done(l, [&](std::uint32_t c) { return peer_gone(c); })) return false;
    return true;
  }
  bool peer_gone(std::uint32_t c) const { return peers_ && peers_->gone(c); }
  static void add_once(std::vector<std::uint32_t>& v, std::uint32_t x) {
    if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
  }
  /// Farewells of peers: no more forwards to them (those pending are withdrawn), and what
  /// this rank awaited from them comes from the sources.
  void take_farewells() {
    for (auto p : peers_->take_farewells()) refetch_from(p);
  }
  /// Sharing's fallback (with failover): the forwards of clone rank `forwarder` this rank
  /// still awaits come from the live sources holding their bytes instead, and the forwarder
  /// is told (a farewell). Throws errc::source_failed where no live source holds them.
  void refetch_from(std::uint32_t forwarder) {
    std::vector<incoming*> lost;
    std::vector<std::uint32_t> layers;
    for (auto& in : incoming_)
      if (in.group->forwarded && in.group->source == forwarder && !in.verified && !in.replaced) {
        lost.push_back(&in);
        add_once(layers, in.group->layer);
      }
    if (!lost.empty()) {
      auto more = failover_->refetch(forwarder, std::move(layers));  // throws: nothing withdrawn
      add_once(refetched_forwarders_, forwarder);
      const auto& kept = replacements_.emplace_back(std::move(more.groups));
      for (auto gi : kept.received_by_clone(clone_)) post_group(kept.groups()[gi], more.round, true);
      for (auto* in : lost) {  // once the replacements are posted and counted
        withdraw(*in);
        in->replaced = true;
        --unverified_[in->group->layer];
      }
    }
    if (!peers_->gone(forwarder)) peers_->say_farewell(forwarder);  // it no longer forwards to this rank, nor this rank to it
    if (forward_) forward_->withdraw([forwarder](std::uint32_t to) { return to == forwarder; });
  }
  /// Withdraws the receives of group `in` (cancel, or its source failed).
  void withdraw(incoming& in) noexcept {
    for (auto* r : in.requests()) {
      try {
        comm_.cancel(*r);
      } catch (...) {
      }
    }
  }
  /// Whether message `m` is received into a buffer and unpacked once verified: a packed
  /// one that the transport does not scatter, and every message into staged parts.
  static bool lands_in_buffer(const partition_message& m) {
    return !Memory::host_addressable || (m.packed && !detail::gathers<Comm, Memory>(m));
  }
  /// Copies the verified buffer `in` of message `m` into the own tensors (bounds-checked).
  void unpack_message(const partition_message& m, std::span<const std::byte> in) {
    if constexpr (Memory::host_addressable) {
      unpack(route_.global, m.runs, in, tensors_);
    } else {
      const auto runs = clone_runs(m);  // all bounds-checked before the policy writes one
      memory_.scatter(in, runs);
    }
  }
  /// Message i's bytes where they arrived: its buffer (packed or staged), one run in the own
  /// tensor (direct), or (gathered) each run in the own tensors.
  std::vector<std::span<std::byte>> arrived(const partition_message& m, std::span<std::byte> packed) {
    if (lands_in_buffer(m)) return detail::checksummed_parts(m, packed);
    if (!m.packed) return {clone_run(route_.global, m.runs.front(), tensors_)};
    return clone_runs(m);
  }
  void verify(const partition_group& g, std::size_t i, std::span<std::byte> packed, std::span<const std::uint64_t> sums) {
    const auto& m = g.messages[i];
    const auto parts = arrived(m, packed);
    for (std::size_t j = 0; j < parts.size(); ++j) {
      if (Checksum::compute(parts[j]) == sums[j]) continue;
      const auto& r = m.runs[m.gather ? j : 0];
      const auto what = m.packed && !m.gather ? std::to_string(m.runs.size()) + " packed runs, the first of " + detail::tensor_label(route_.global, r.tensor)
                                              : detail::bytes_label(r.global, r.global + r.length) + " of " + detail::tensor_label(route_.global, r.tensor);
      throw error(errc::corrupt_message, "partitioned transfer: message " + std::to_string(i) + " of " +
                                             detail::group_label(route_.global, g) + " (" + what + ") failed its checksum");
    }
  }
  std::vector<std::span<std::byte>> clone_runs(const partition_message& m) {
    std::vector<std::span<std::byte>> out;
    for (const auto& r : m.runs) out.push_back(clone_run(route_.global, r, tensors_));
    return out;
  }

  Comm& comm_;
  partition_route route_;
  std::uint32_t clone_;
  std::vector<std::span<std::byte>> tensors_;
  [[no_unique_address]] Memory memory_{};
  std::size_t stale_groups_ = 0;
  std::vector<std::uint32_t> refetched_forwarders_;
  std::deque<incoming> incoming_;  // a deque: receives write into its elements' buffers, which must not move
  std::vector<std::uint32_t> unverified_;                    // per layer: groups not verified nor replaced
  std::vector<std::uint32_t> from_sources_;                  // per layer: of those, the ones this rank's forwards wait for (gates_forwards)
  std::vector<char> forwarded_;                              // per group this rank forwards (forwarded_by_clone): sent
  std::vector<detail::clock::time_point> quiet_since_;       // per source: its last group verified or posted
  bool any_delivered_ = false;
  struct corrupt_group {
    std::uint32_t source = 0;
    std::string what;
  };
  std::vector<corrupt_group> corrupt_;  // found by this progress(), asked elsewhere at its end
  std::deque<partition_groups> replacements_;                // failovers' groups (a deque: incoming_ points into them)
  std::optional<detail::clone_handshake<Comm>> handshake_;   // before failover_: the hello leaves first on the control tag
  std::optional<detail::clone_failover<Comm>> failover_;
  std::optional<detail::group_sender<Comm, Checksum, Memory>> forward_;  // partition_sharing::exchange: this rank's forwards
  std::optional<detail::exchange_peers<Comm>> peers_;           // sharing with failover: farewells between clone ranks
  std::vector<corrupt_group> corrupt_forwards_;                 // forwards that failed their checksum (source: the forwarder)
  bool complete_ = false;                                       // progress() was true: no farewells when cancelled
};

}  // namespace deepclone
