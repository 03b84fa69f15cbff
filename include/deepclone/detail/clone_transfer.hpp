#pragma once
/// \file detail/clone_transfer.hpp
/// The clone side of one session's transfer, templated on the communicator and the
/// checksum only: every receive of the plan posted up front straight into the clone's
/// tensors, each complete group verified against its header and the plan, a group that
/// fails asked again from another source, a failed source's groups asked from the others,
/// and this rank's forwards to the other clone ranks. The clone engine keeps the API, the
/// agreement, the metadata, the deadlines and the figures; it hands this component the
/// tensors' bytes as spans, so the transfer compiles once per transport and checksum, not
/// once per engine.
///
/// Errors are thrown as `deepclone::error`; the engine turns them into a failed clone
/// (receives withdrawn, sources told), so every call must run under its guard.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "../error.hpp"
#include "../layout.hpp"
#include "../plan.hpp"
#include "../roles.hpp"
#include "outbox.hpp"
#include "wire.hpp"

namespace deepclone::detail {

/// The transport's test, with a receive it failed (a peer's message larger than the
/// buffer) reported as `garbage` bytes: such a message fails verification like a corrupt one.
inline constexpr std::size_t garbage = ~std::size_t{0};
template <class Comm>
std::optional<std::size_t> test_or_garbage(Comm& comm, typename Comm::request_type& r) {
  try {
    return comm.test(r);
  } catch (const error&) {
    return garbage;
  }
}

template <class Comm, class Checksum>
class clone_transfer {
  using request_t = typename Comm::request_type;

 public:
  /// What one session's transfer is about: the plan and layout it follows, this rank's
  /// clone index, the session, its iteration and tag block, and each clone tensor's bytes
  /// (flat tensor index) as the receives are posted into them.
  struct session_info {
    const deepclone::plan* plan = nullptr;
    const deepclone::layout* layout = nullptr;
    std::uint32_t index = 0;
    std::uint64_t session = 0, k = 0;
    session_tags tags;
    std::vector<std::span<std::byte>> tensors;
  };

  /// `ctl` carries this rank's refetch requests (the engine owns it: its sends outlive a
  /// session); `tag_base` is the engine's control tag base.
  clone_transfer(Comm& comm, const deepclone::roles& roles, outbox<Comm>& ctl, int tag_base)
      : comm_(comm), roles_(roles), ctl_(ctl), tag_base_(tag_base) {}
  clone_transfer(const clone_transfer&) = delete;
  clone_transfer& operator=(const clone_transfer&) = delete;

  /// Starts the session's transfer: empty bookkeeping, every receive of the plan posted.
  void open(session_info s) {
    current_ = std::move(s);
    const std::size_t L = current_.layout->layer_count(), G = plan().groups().size();
    pending_.assign(L, 0);
    fwd_posted_.assign(G, false);
    fwd_waits_.assign(G, 0);
    for (std::size_t l = 0; l < L; ++l)
      for (auto g : plan().forwarded_by_clone(current_.index, l)) fwd_waits_[g] = plan().awaits(g).size();
    fwd_of_.assign(L, {});
    sums_.assign(plan().pieces().size(), 0);
    from_sources_ = from_clones_ = 0;
    failed_.assign(roles_.source_count(), 0);
    refetches_ = 0;
    any_source_delivered_ = false;
    post_plan_receives();
  }

  /// One round: tests every outstanding receive and forward, verifies complete groups.
  /// True if anything happened.
  bool progress() {
    bool any = false;
    for (auto& in : inbound_) any |= progress_group(in);
    return fwd_.poll(comm_) || any;
  }

  /// True once every group of layer `l` is verified here and this rank's forwards of it
  /// are posted and delivered; posts the forwards whose pieces are all verified.
  bool layer_done(std::size_t l) {
    const bool forwarded = post_forwards(l);
    return pending_[l] == 0 && forwarded &&
           std::all_of(fwd_of_[l].begin(), fwd_of_[l].end(), [&](std::size_t r) { return fwd_.done(comm_, r); });
  }

  /// Source `s` reported it cannot deliver (or was presumed failed): its groups are asked
  /// from the others. When none can, throws with the source's own code where it names a
  /// broken rule (a resized tensor, a write outside the hooks), else `source_failed`.
  void source_failed(std::uint32_t s, const std::string& why, errc code = errc::source_failed) {
    if (failed_[s]) return;
    failed_[s] = 1;
    if (code != errc::layout_mismatch && code != errc::outside_hooks) code = errc::source_failed;
    for (auto& in : inbound_)
      if (!in.verified && source_of(in) == s)
        refetch(in, "source " + std::to_string(s) + " (rank " + std::to_string(roles_.sources[s]) + ") failed: " + why, code);
  }

  /// Sources some unverified group here still waits for (1 per source index).
  std::vector<char> awaited_sources() const {
    std::vector<char> out(roles_.source_count(), 0);
    for (auto& in : inbound_)
      if (!in.verified)
        if (auto s = source_of(in)) out[*s] = 1;
    return out;
  }

  /// Up to four unverified groups, named by layer and sender, and how many more.
  std::string missing_groups() const {
    std::string out;
    int shown = 0;
    for (auto& in : inbound_) {
      if (in.verified) continue;
      auto& g = plan().groups()[in.group];
      if (shown++ < 4)
        out += (out.empty() ? "" : ", ") + std::string("layer ") + std::to_string(g.layer) + " from " +
               (g.exchange ? "clone rank " + std::to_string(roles_.clones[g.from]) : "source rank " + std::to_string(roles_.sources[g.from]));
    }
    if (shown > 4) out += " and " + std::to_string(shown - 4) + " more groups";
    return out;
  }

  /// Withdraws every receive and forward of the session: after it, no byte of a clone
  /// tensor is written by the transfer.
  void abandon() noexcept {
    for (auto& in : inbound_) withdraw(in);
    inbound_.clear();
    fwd_.clear(comm_);
  }

  /// The verified checksum of every piece of the plan (0 for pieces not received here).
  const std::vector<std::uint64_t>& sums() const noexcept { return sums_; }
  /// Sources that reported or were presumed failed (1 per source index).
  const std::vector<char>& failed() const noexcept { return failed_; }
  bool failed(std::uint32_t s) const { return failed_[s] != 0; }
  /// Whether any source delivered an intact group this session (failover presumes silent
  /// sources failed only then: all quiet may just mean they are not at k yet).
  bool any_source_delivered() const noexcept { return any_source_delivered_; }
  std::uint64_t bytes_from_sources() const noexcept { return from_sources_; }
  std::uint64_t bytes_from_clones() const noexcept { return from_clones_; }
  std::uint32_t refetches() const noexcept { return refetches_; }

 private:
  static constexpr std::uint32_t original = ~std::uint32_t{0};

  struct inbound {
    std::uint32_t group;
    std::uint32_t refetch_from = original;  ///< source index serving it again, if refetched
    std::vector<char> tried;                ///< sources that could not deliver it intact
    std::vector<std::uint64_t> expected;    ///< checksums announced by the first intact header
    bool short_piece = false;               ///< a data message shorter than its piece
    std::vector<std::byte> header;
    request_t header_req;
    bool header_done = false;
    std::vector<request_t> data;
    bool data_posted = true;                ///< false while a refetch waits for its header
    std::size_t data_done = 0;
    std::vector<bool> done;
    bool verified = false;
  };

  const deepclone::plan& plan() const { return *current_.plan; }
  std::span<std::byte> bytes_of(const piece& p) const { return current_.tensors[p.tensor].subspan(p.offset, p.length); }

  std::optional<std::size_t> test_or_garbage(request_t& r) { return detail::test_or_garbage(comm_, r); }

  /// Every receive of the plan, posted up front straight into the clone's tensors.
  void post_plan_receives() {
    auto mine = plan().received_by_clone(current_.index);
    inbound_.clear();
    inbound_.reserve(mine.size());
    for (auto g : mine) {
      auto& grp = plan().groups()[g];
      inbound& in = inbound_.emplace_back();
      in.group = g;
      in.tried.assign(roles_.source_count(), 0);
      post_group_receives(in, grp.exchange ? roles_.clones[grp.from] : roles_.sources[grp.from], grp.exchange, false);
      ++pending_[grp.layer];
    }
  }
  /// Posts the receives of `in`'s header and pieces from rank `from`, on the tags of a
  /// source's group or a forwarded one (`forwarded`). A refetch (`refetch`: `from` is a
  /// source serving the group again) posts only the header: its data receives follow once
  /// the header announced them (post_refetch_data).
  void post_group_receives(inbound& in, int from, bool forwarded, bool refetch) {
    auto& g = plan().groups()[in.group];
    in.header.assign(group_header::size_for(g.pieces.size()), std::byte{0});
    in.header_done = false;
    in.header_req = comm_.irecv(from, refetch ? current_.tags.refetch_header() : current_.tags.layer(g.layer, forwarded, true), in.header);
    in.data.clear();
    in.data_done = 0;
    in.data_posted = !refetch;
    if (!refetch)
      for (auto pi : g.pieces) in.data.push_back(comm_.irecv(from, current_.tags.layer(g.layer, forwarded, false), bytes_of(plan().pieces()[pi])));
    in.done.assign(in.data.size(), false);
  }
  /// A refetch's data receives are posted once its header announced the group's pieces: a
  /// source that refuses sends no data, and receives posted for it would take the data of
  /// the next group that source serves.
  void post_refetch_data(inbound& in) {
    in.data_posted = true;
    auto& g = plan().groups()[in.group];
    try {
      auto h = group_header::decode(in.header);
      if (h.session != current_.session || h.refused != refusal::none || h.pieces.size() != g.pieces.size()) return;
    } catch (const error&) {
      return;  // verification names the problem
    }
    for (auto pi : g.pieces)
      in.data.push_back(comm_.irecv(roles_.sources[in.refetch_from], current_.tags.refetch_data(), bytes_of(plan().pieces()[pi])));
    in.done.assign(in.data.size(), false);
  }

  bool progress_group(inbound& in) {
    if (in.verified) return false;
    bool any = false;
    if (!in.header_done)
      if (auto n = test_or_garbage(in.header_req)) {
        in.header.resize(*n == garbage ? 0 : *n);  // the seal covers exactly the bytes received
        in.header_done = any = true;
      }
    if (in.header_done && !in.data_posted) post_refetch_data(in);
    for (std::size_t i = 0; i < in.data.size(); ++i)
      if (!in.done[i])
        if (auto n = test_or_garbage(in.data[i])) {
          if (*n != plan().pieces()[plan().groups()[in.group].pieces[i]].length) in.short_piece = true;  // caught even without a checksum
          in.done[i] = true;
          ++in.data_done;
          any = true;
        }
    if (in.header_done && in.data_posted && in.data_done == in.data.size()) verify(in);
    return any;
  }

  /// Checks a complete group against the plan and its header. A group that fails is asked
  /// again from another source (every source holds every byte); only when no source can
  /// deliver it intact does the clone fail.
  void verify(inbound& in) {
    auto& g = plan().groups()[in.group];
    const bool refetched = in.refetch_from != original;
    if (auto problem = check(in)) {
      refetch(in, "layer " + std::to_string(g.layer) + " ('" + current_.layout->layers()[g.layer].name + "') from " + sender_name(in) + ": " + *problem,
              errc::corrupt_message);
      return;
    }
    in.verified = true;
    (g.exchange && !refetched ? from_clones_ : from_sources_) += g.bytes;
    if (!g.exchange || refetched) any_source_delivered_ = true;
    --pending_[g.layer];
    for (auto f : plan().unblocks(in.group)) --fwd_waits_[f];
    // Forget the request objects now: nothing of this group is outstanding.
    in.data.clear();
    in.header.clear();
  }

  /// What is wrong with a complete group, if anything. Records the verified checksums,
  /// and the checksums an intact header of the group's first sender announced: bytes served
  /// again must equal what that sender held at iteration k.
  std::optional<std::string> check(inbound& in) {
    group_header h;
    try {
      h = group_header::decode(in.header);
    } catch (const error& e) {
      return e.details();
    }
    if (auto problem = check_header(in, h)) return problem;
    if (in.expected.empty() && !plan().groups()[in.group].exchange)
      for (auto& c : h.pieces) in.expected.push_back(c.checksum);
    if (in.short_piece) return "a data message was shorter than its piece (truncated)";
    return check_pieces(in, h);
  }
  /// What is wrong with a group's header: a source's refusal, or another session,
  /// iteration, layer, sender or piece list than the plan's.
  std::optional<std::string> check_header(const inbound& in, const group_header& h) {
    auto& g = plan().groups()[in.group];
    const bool refetched = in.refetch_from != original;
    const std::uint32_t from = refetched ? in.refetch_from : g.from;
    if (h.refused == refusal::changed && h.session == current_.session && h.refused_tensor < current_.layout->tensor_count())
      throw error(errc::outside_hooks, "source " + std::to_string(from) + " (rank " + std::to_string(roles_.sources[from]) + ") could not " +
                                           "serve tensor '" + tensor_name(h.refused_tensor) + "' again: it no longer holds what it held at "
                                           "iteration " + std::to_string(current_.k) + ", so it was written outside its layer's update hooks (only "
                                           "the code between a layer's before_update and after_update may write its tensors)");
    if (refetched && h.refused == refusal::released)
      return "source " + std::to_string(from) + " no longer holds iteration " + std::to_string(current_.k) + " of this layer";
    if (h.session != current_.session || h.iteration != current_.k || h.layer != g.layer || h.from != from || h.pieces.size() != g.pieces.size())
      return "header names session " + std::to_string(h.session) + ", iteration " + std::to_string(h.iteration) + ", layer " +
             std::to_string(h.layer) + ", " + std::to_string(h.pieces.size()) + " pieces; expected session " +
             std::to_string(current_.session) + ", iteration " + std::to_string(current_.k) + ", " + std::to_string(g.pieces.size()) + " pieces";
    for (std::size_t i = 0; i < g.pieces.size(); ++i) {
      auto& p = plan().pieces()[g.pieces[i]];
      if (h.pieces[i].tensor != p.tensor || h.pieces[i].offset != p.offset || h.pieces[i].length != p.length)
        return "header describes a different piece than the plan's " + range_name(p);
    }
    return std::nullopt;
  }
  /// Checksums the received pieces against the header (and, refetched, against what the
  /// first sender announced), recording the sums of the verified ones.
  std::optional<std::string> check_pieces(const inbound& in, const group_header& h) {
    auto& g = plan().groups()[in.group];
    const bool refetched = in.refetch_from != original;
    for (std::size_t i = 0; i < g.pieces.size(); ++i) {
      auto& p = plan().pieces()[g.pieces[i]];
      auto sum = Checksum::compute(std::span<const std::byte>(bytes_of(p)));
      if (sum != h.pieces[i].checksum) return range_name(p) + " failed its checksum at iteration " + std::to_string(current_.k);
      if (refetched && !in.expected.empty() && sum != in.expected[i])
        throw error(errc::outside_hooks, range_name(p) + " served again by source " + std::to_string(in.refetch_from) + " differs from what source " +
                                             std::to_string(g.from) + " sent for iteration " + std::to_string(current_.k) + ": the tensor was written "
                                             "outside its layer's update hooks (only the code between a layer's before_update and "
                                             "after_update may write its tensors; settings.check_writes on the sources finds the write), "
                                             "or the sources' replicas differ");
      sums_[g.pieces[i]] = sum;
    }
    return std::nullopt;
  }

  std::string tensor_name(std::size_t t) const {
    auto& l = *current_.layout;
    return l.layers()[l.layer_of(t)].name + "." + l.tensor(t).name;
  }
  std::string range_name(const piece& p) const {
    return "tensor '" + tensor_name(p.tensor) + "' bytes [" + std::to_string(p.offset) + ", " + std::to_string(p.offset + p.length) + ")";
  }
  std::string sender_name(const inbound& in) const {
    auto& g = plan().groups()[in.group];
    if (in.refetch_from != original)
      return "source " + std::to_string(in.refetch_from) + " (rank " + std::to_string(roles_.sources[in.refetch_from]) + ", refetch)";
    return g.exchange ? "clone rank " + std::to_string(roles_.clones[g.from])
                      : "source " + std::to_string(g.from) + " (rank " + std::to_string(roles_.sources[g.from]) + ")";
  }

  /// The source currently expected to deliver `in`, if a source.
  std::optional<std::uint32_t> source_of(const inbound& in) const {
    if (in.refetch_from != original) return in.refetch_from;
    auto& g = plan().groups()[in.group];
    if (g.exchange) return std::nullopt;
    return g.from;
  }

  /// The source to ask for `in` again: the next one not yet asked (starting after its
  /// sender), else (bytes lost on the wire) one asked once already; none if all failed.
  std::optional<std::uint32_t> next_source(const inbound& in) const {
    auto& g = plan().groups()[in.group];
    const std::uint32_t n = roles_.source_count();
    const std::uint32_t first = g.exchange ? current_.index % n : (g.from + 1) % n;
    for (char limit = 1; limit <= 2; ++limit)
      for (std::uint32_t i = 0; i < n; ++i) {
        auto s = (first + i) % n;
        if (in.tried[s] < limit && !failed_[s]) return s;
      }
    return std::nullopt;
  }

  /// Withdraws `in`'s receives and asks another source for the group; throws `code` with
  /// `why` when no source can deliver it.
  void refetch(inbound& in, const std::string& why, errc code) {
    if (auto s = source_of(in)) ++in.tried[*s];
    withdraw(in);
    auto next = next_source(in);
    if (!next) throw error(code, why + "; no other source could deliver it (tried " + std::to_string(roles_.source_count()) + ")");
    refetch_msg m{current_.session, current_.index, in.group};
    ctl_.send_owned(comm_, roles_.sources[*next], tag_base_ + tag_refetch, m.encode());
    in.refetch_from = *next;
    in.short_piece = false;
    post_group_receives(in, roles_.sources[*next], false, true);
    ++refetches_;
  }

  /// Cancels `in`'s outstanding receives (the bytes already written stay unverified).
  void withdraw(inbound& in) noexcept {
    if (!in.header_done) try { comm_.cancel(in.header_req); } catch (...) {}
    for (std::size_t i = 0; i < in.data.size(); ++i)
      if (!in.done[i]) try { comm_.cancel(in.data[i]); } catch (...) {}
    in.header_done = true;
    std::fill(in.done.begin(), in.done.end(), true);
  }

  /// Posts this rank's forwards of layer `l` whose pieces are all verified here (the
  /// reconstruction policy's topology, in plan.hpp). True once all of them are posted.
  bool post_forwards(std::size_t l) {
    bool all = true;
    for (auto g : plan().forwarded_by_clone(current_.index, l)) {
      if (fwd_posted_[g]) continue;
      if (fwd_waits_[g] != 0) {
        all = false;
        continue;
      }
      fwd_posted_[g] = true;
      auto& grp = plan().groups()[g];
      int dest = roles_.clones[grp.to];
      group_header h{.session = current_.session, .iteration = current_.k, .layer = static_cast<std::uint32_t>(l), .from = current_.index, .pieces = {}};
      for (auto pi : grp.pieces) {
        auto& p = plan().pieces()[pi];
        fwd_of_[l].push_back(fwd_.send(comm_, dest, current_.tags.layer(l, true, false), bytes_of(p)));
        h.pieces.push_back({p.tensor, p.offset, p.length, sums_[pi]});
      }
      fwd_of_[l].push_back(fwd_.send_owned(comm_, dest, current_.tags.layer(l, true, true), h.encode()));
    }
    return all;
  }

  Comm& comm_;
  const deepclone::roles& roles_;
  outbox<Comm>& ctl_;
  int tag_base_;
  session_info current_;                         // the session being received (open())
  outbox<Comm> fwd_;                             // this rank's forwards to other clone ranks
  std::vector<inbound> inbound_;
  std::vector<std::uint64_t> sums_;
  std::vector<char> failed_;                     // sources that reported or were presumed failed
  std::vector<std::size_t> pending_;             // per layer: groups not yet verified here
  std::vector<std::size_t> fwd_waits_;           // per forward group of this rank: unverified groups it awaits
  std::vector<bool> fwd_posted_;                 // per group: this rank posted it (forward groups only)
  std::vector<std::vector<std::size_t>> fwd_of_;  // per layer: this rank's forward sends
  std::uint64_t from_sources_ = 0, from_clones_ = 0;
  std::uint32_t refetches_ = 0;
  bool any_source_delivered_ = false;
};

}  // namespace deepclone::detail
