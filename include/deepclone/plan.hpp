#pragma once
/// \file plan.hpp
/// The plan: a pure, deterministic function of (layout, N, M, policies, options) saying
/// which byte range of which tensor each source sends to which clone rank, and what the
/// clone ranks forward to each other. Every rank computes the same plan, so no plan
/// travels: a clone rank knows exactly which messages will arrive from whom and posts its
/// receives straight into its tensors.

#include <algorithm>
#include <map>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "detail/bytes.hpp"
#include "error.hpp"
#include "layout.hpp"
#include "piece.hpp"
#include "reconstruct.hpp"

namespace deepclone {

/// Settings of the plan that are not policies.
struct plan_options {
  std::uint64_t alignment = 256;               ///< piece boundaries are multiples of this (and of the element size)
  std::uint64_t max_piece_bytes = 64ull << 20;  ///< larger pieces are cut (keeps messages < 2 GiB, pipelines exchange)
};

/// Everything the plan depends on besides the layout. Sources and clones compare keys
/// before any transfer; a difference is named field by field.
struct plan_key {
  std::uint32_t sources = 0, clones = 0;
  std::uint32_t shard_id = 0;
  std::uint64_t shard_param = 0;
  std::uint32_t reconstruct_id = 0;
  std::uint64_t reconstruct_param = 0;
  std::uint64_t alignment = 0, max_piece_bytes = 0;
  std::uint32_t checksum_id = 0;
  bool operator==(const plan_key&) const = default;

  void encode(detail::writer& w) const {
    w.u32(sources); w.u32(clones); w.u32(shard_id); w.u64(shard_param); w.u32(reconstruct_id);
    w.u64(reconstruct_param); w.u64(alignment); w.u64(max_piece_bytes); w.u32(checksum_id);
  }
  static plan_key decode(detail::reader& r) {
    plan_key k;
    k.sources = r.u32(); k.clones = r.u32(); k.shard_id = r.u32(); k.shard_param = r.u64();
    k.reconstruct_id = r.u32(); k.reconstruct_param = r.u64(); k.alignment = r.u64();
    k.max_piece_bytes = r.u64(); k.checksum_id = r.u32();
    return k;
  }
  /// "field: sources have X, clone has Y" for the first differing field.
  std::string difference(const plan_key& o) const {
    auto f = [](const char* n, std::uint64_t a, std::uint64_t b) {
      return std::string(n) + ": sources have " + std::to_string(a) + ", clone has " + std::to_string(b);
    };
    if (sources != o.sources) return f("number of sources", sources, o.sources);
    if (clones != o.clones) return f("number of clone ranks", clones, o.clones);
    if (shard_id != o.shard_id) return f("sharding policy id", shard_id, o.shard_id);
    if (shard_param != o.shard_param) return f("sharding policy setting", shard_param, o.shard_param);
    if (reconstruct_id != o.reconstruct_id) return f("reconstruction policy id", reconstruct_id, o.reconstruct_id);
    if (reconstruct_param != o.reconstruct_param) return f("reconstruction setting", reconstruct_param, o.reconstruct_param);
    if (alignment != o.alignment) return f("alignment", alignment, o.alignment);
    if (max_piece_bytes != o.max_piece_bytes) return f("max_piece_bytes", max_piece_bytes, o.max_piece_bytes);
    if (checksum_id != o.checksum_id) return f("checksum policy id", checksum_id, o.checksum_id);
    return {};
  }
};

/// Pieces that travel together from one sender to one clone rank for one layer: one
/// header message plus one data message per piece, in this order.
struct transfer_group {
  std::uint32_t layer = 0;
  std::uint32_t from = 0;  ///< source index, or clone index when `exchange`
  std::uint32_t to = 0;    ///< clone index
  bool exchange = false;   ///< clone-to-clone forward (scatter_exchange)
  std::vector<std::uint32_t> pieces;
  std::uint64_t bytes = 0;
};

class plan;
/// Computes the plan (defined below).
template <class Shard, class Reconstruct>
plan make_plan(const layout& lay, std::uint32_t sources, std::uint32_t clones, const Shard& shard,
               const Reconstruct& recon, const plan_options& opt = {}, std::uint32_t checksum_id = 0);

class plan {
 public:
  const deepclone::layout& layout() const noexcept { return layout_; }
  const plan_key& key() const noexcept { return key_; }
  const std::vector<piece>& pieces() const noexcept { return pieces_; }
  const std::vector<transfer_group>& groups() const noexcept { return groups_; }

  /// Groups source `s` sends when layer `l` is final.
  std::span<const std::uint32_t> sent_by_source(std::uint32_t s, std::size_t l) const { return by_source_[s][l]; }
  /// Groups clone `c` forwards once it holds its owned pieces of layer `l`.
  std::span<const std::uint32_t> forwarded_by_clone(std::uint32_t c, std::size_t l) const { return fwd_by_clone_[c][l]; }
  /// Every group clone `c` receives (from sources and from other clone ranks).
  std::span<const std::uint32_t> received_by_clone(std::uint32_t c) const { return recv_by_clone_[c]; }
  /// Groups that must be verified at clone rank `groups()[g].from` before it may forward
  /// group `g` (the groups that brought it g's pieces); empty for groups from sources.
  std::span<const std::uint32_t> awaits(std::uint32_t g) const { return awaits_[g]; }
  /// Forward groups that await group `g` (the inverse of `awaits`).
  std::span<const std::uint32_t> unblocks(std::uint32_t g) const { return unblocks_[g]; }

  /// Distinct tensor bytes source `s` is responsible for (each piece counted once).
  std::uint64_t bytes_of_source(std::uint32_t s) const {
    std::uint64_t b = 0;
    for (auto& q : pieces_)
      if (q.source == s) b += q.length;
    return b;
  }
  /// Bytes source `s` puts on the wire (a piece sent to several clone ranks counts each time).
  std::uint64_t bytes_sent_by_source(std::uint32_t s) const {
    std::uint64_t b = 0;
    for (auto& l : by_source_[s])
      for (auto g : l) b += groups_[g].bytes;
    return b;
  }
  std::uint64_t bytes_received_by_clone(std::uint32_t c, bool from_clones) const {
    std::uint64_t b = 0;
    for (auto g : recv_by_clone_[c])
      if (groups_[g].exchange == from_clones) b += groups_[g].bytes;
    return b;
  }

  template <class Shard, class Reconstruct>
  friend plan make_plan(const deepclone::layout&, std::uint32_t, std::uint32_t, const Shard&, const Reconstruct&,
                        const plan_options&, std::uint32_t);

 private:
  void group(std::uint32_t sources, std::uint32_t clones, const std::vector<std::vector<reconstruct::hop>>& hops_of);
  using group_ids = std::map<std::tuple<std::uint32_t, bool, std::uint32_t, std::uint32_t>, std::uint32_t>;
  std::uint32_t add_to_group(group_ids& ids, std::uint32_t layer, bool exchange, std::uint32_t from, std::uint32_t to,
                             std::uint32_t piece);
  void link_forwards();

  deepclone::layout layout_;
  plan_key key_;
  std::vector<piece> pieces_;
  std::vector<transfer_group> groups_;
  std::vector<std::vector<std::vector<std::uint32_t>>> by_source_, fwd_by_clone_;
  std::vector<std::vector<std::uint32_t>> recv_by_clone_, awaits_, unblocks_;
};

namespace detail {
/// The sharding policy's pieces with every piece above `max_piece_bytes` cut in consecutive
/// pieces of the same source at granule boundaries (messages stay below 2 GiB and the
/// pipelines interleave). Refuses a piece naming a source beyond N.
inline std::vector<piece> cut_pieces(const std::vector<piece>& sharded, const layout& lay, std::uint32_t sources,
                                     const plan_options& opt, const char* shard_name) {
  std::vector<piece> cut;
  for (auto& q : sharded) {
    if (q.source >= sources)
      throw error(errc::invalid_argument, std::string("sharding policy ") + shard_name + " named source " +
                                              std::to_string(q.source) + " of " + std::to_string(sources));
    if (q.length <= opt.max_piece_bytes) {
      cut.push_back(q);
      continue;
    }
    auto g = granule(lay.tensor(q.tensor), opt.alignment);
    auto per = std::max<std::uint64_t>(1, opt.max_piece_bytes / g);
    auto granules = (q.length + g - 1) / g;
    for (auto [off, len] : split_range(q.length, (granules + per - 1) / per, g)) {
      piece r = q;
      r.offset = q.offset + off;
      r.length = len;
      cut.push_back(r);
    }
  }
  return cut;
}

/// The policies' pieces, sorted by (tensor, offset), cover every byte of every tensor
/// exactly once, each filed under its tensor's layer, sent by a source below N to a clone
/// rank below M: the engines index their per-layer, per-source and per-clone bookkeeping
/// with these fields, and a piece under another layer would be summed and sent in the
/// wrong layer's hooks.
inline void check_pieces(const std::vector<piece>& pieces, const layout& lay, std::uint32_t sources, std::uint32_t clones,
                         const std::string& policies) {
  auto refuse = [&](const std::string& why) { throw error(errc::invalid_argument, "policies " + policies + " produced " + why); };
  std::size_t i = 0;
  for (std::uint32_t t = 0; t < lay.tensor_count(); ++t) {
    std::uint64_t at = 0;
    const auto layer = static_cast<std::uint32_t>(lay.layer_of(t));
    for (; i < pieces.size() && pieces[i].tensor == t; ++i) {
      auto& q = pieces[i];
      if (q.offset != at || q.length == 0 || (q.owner != piece::all_clones && q.owner >= clones))
        refuse("a gap, overlap or bad owner in tensor '" + lay.tensor(t).name + "' at byte " + std::to_string(at));
      if (q.layer != layer)
        refuse("a piece of tensor '" + lay.tensor(t).name + "' filed under layer " + std::to_string(q.layer) +
               "; the tensor belongs to layer " + std::to_string(layer));
      if (q.source >= sources) refuse("a piece of tensor '" + lay.tensor(t).name + "' sent by source " + std::to_string(q.source) + " of " + std::to_string(sources));
      at += q.length;
    }
    if (at != lay.tensor(t).bytes)
      refuse("pieces covering " + std::to_string(at) + " of " + std::to_string(lay.tensor(t).bytes) + " bytes of tensor '" + lay.tensor(t).name + "'");
  }
  if (i < pieces.size())
    refuse("a piece of tensor " + std::to_string(pieces[i].tensor) + ", but the layout has " + std::to_string(lay.tensor_count()) + " tensors");
}

/// Every clone rank receives every piece exactly once, from a source or forwarded by a
/// peer: covering each tensor once is not enough, since a reconstruction policy that
/// sends a piece to one clone rank and forwards it to none leaves the others stale.
inline void check_every_clone_receives_all(const plan& p, std::uint32_t clones, const std::string& policies) {
  std::vector<std::uint32_t> got(p.pieces().size());
  for (std::uint32_t c = 0; c < clones; ++c) {
    std::fill(got.begin(), got.end(), 0);
    for (auto g : p.received_by_clone(c))
      for (auto pi : p.groups()[g].pieces) ++got[pi];
    for (std::size_t pi = 0; pi < got.size(); ++pi) {
      if (got[pi] == 1) continue;
      const auto& q = p.pieces()[pi];
      throw error(errc::invalid_argument,
                  "policies " + policies + ": clone rank " + std::to_string(c) +
                      (got[pi] ? " receives twice" : " never receives") + " bytes [" + std::to_string(q.offset) + ", " +
                      std::to_string(q.offset + q.length) + ") of tensor '" + p.layout().tensor(q.tensor).name +
                      "' (every clone rank must receive every byte exactly once, from a source or forwarded)");
    }
  }
}

/// The hops of a piece owned by `owner` must each start at a clone rank that already holds
/// it (the owner, or the receiver of an earlier hop): a clone rank forwards only bytes it
/// has verified.
inline void check_hops(const std::vector<reconstruct::hop>& hops, std::uint32_t owner, std::uint32_t clones,
                       const std::string& policy) {
  std::vector<char> holds(clones, 0);
  holds[owner] = 1;
  for (auto h : hops) {
    if (h.from >= clones || h.to >= clones)
      throw error(errc::invalid_argument, "reconstruction policy " + policy + ": forward " + std::to_string(h.from) +
                                              " -> " + std::to_string(h.to) + " names a clone rank beyond the " +
                                              std::to_string(clones) + " there are");
    if (!holds[h.from])
      throw error(errc::invalid_argument,
                  "reconstruction policy " + policy + ": forward " + std::to_string(h.from) + " -> " + std::to_string(h.to) +
                      " of a piece owned by clone rank " + std::to_string(owner) + " starts at a clone rank that does not "
                      "hold the piece yet (forwards are listed in dependency order: a clone rank forwards only what it holds)");
    holds[h.to] = 1;
  }
}

/// A clone rank forwards a group once it holds every piece of it; groups that wait on each
/// other in a cycle would never leave. Kahn's algorithm over the forward groups.
inline void check_forwards_acyclic(const plan& p, const std::string& policy) {
  const auto n = static_cast<std::uint32_t>(p.groups().size());
  std::vector<std::size_t> waits(n);
  std::vector<std::uint32_t> ready;
  for (std::uint32_t g = 0; g < n; ++g)
    if ((waits[g] = p.awaits(g).size()) == 0) ready.push_back(g);
  std::size_t left = n;
  while (!ready.empty()) {
    auto g = ready.back();
    ready.pop_back();
    --left;
    for (auto f : p.unblocks(g))
      if (--waits[f] == 0) ready.push_back(f);
  }
  if (left == 0) return;
  const auto stuck = static_cast<std::uint32_t>(std::find_if(waits.begin(), waits.end(), [](auto w) { return w > 0; }) - waits.begin());
  const auto& g = p.groups()[stuck];
  throw error(errc::invalid_argument,
              "reconstruction policy " + policy + ": the forwards of layer " + std::to_string(g.layer) + " ('" +
                  p.layout().layers()[g.layer].name + "') wait on each other in a cycle (clone rank " + std::to_string(g.from) +
                  " -> " + std::to_string(g.to) + " is among them): a clone rank forwards a layer's group to a peer only "
                  "once it holds every piece of it, so no chain of forwards may lead back to where it started");
}
}  // namespace detail

/// Files piece `pi` into the group of (layer, sender, receiver) (`ids` finds it), creating
/// the group on its first piece; returns the group.
inline std::uint32_t plan::add_to_group(group_ids& ids, std::uint32_t layer, bool exchange, std::uint32_t from,
                                        std::uint32_t to, std::uint32_t pi) {
  auto [it, fresh] = ids.try_emplace({layer, exchange, from, to}, static_cast<std::uint32_t>(groups_.size()));
  if (fresh) {
    groups_.push_back({layer, from, to, exchange, {}, 0});
    awaits_.emplace_back();
    (exchange ? fwd_by_clone_[from][layer] : by_source_[from][layer]).push_back(it->second);
    recv_by_clone_[to].push_back(it->second);
  }
  auto& g = groups_[it->second];
  g.pieces.push_back(pi);
  g.bytes += pieces_[pi].length;
  return it->second;
}

/// Groups the pieces into messages per layer and (sender, receiver): from its source to
/// its owner (or to every clone rank), then along the owner's forwards `hops_of[owner]`.
/// A forward group awaits the groups that brought its pieces to its sender.
inline void plan::group(std::uint32_t sources, std::uint32_t clones, const std::vector<std::vector<reconstruct::hop>>& hops_of) {
  const std::size_t L = layout_.layer_count();
  by_source_.assign(sources, std::vector<std::vector<std::uint32_t>>(L));
  fwd_by_clone_.assign(clones, std::vector<std::vector<std::uint32_t>>(L));
  recv_by_clone_.assign(clones, {});
  group_ids ids;
  std::vector<std::uint32_t> via(clones);  // the group that brought the current piece to each clone rank
  for (std::uint32_t pi = 0; pi < pieces_.size(); ++pi) {
    const auto& q = pieces_[pi];
    if (q.owner == piece::all_clones) {
      for (std::uint32_t c = 0; c < clones; ++c) add_to_group(ids, q.layer, false, q.source, c, pi);
      continue;
    }
    via[q.owner] = add_to_group(ids, q.layer, false, q.source, q.owner, pi);
    for (auto h : hops_of[q.owner]) {
      const auto g = add_to_group(ids, q.layer, true, h.from, h.to, pi);
      auto& a = awaits_[g];
      if (a.empty() || a.back() != via[h.from]) a.push_back(via[h.from]);  // consecutive pieces share it
      via[h.to] = g;
    }
  }
  link_forwards();
}

/// `awaits` sorted and unique, and its inverse `unblocks`.
inline void plan::link_forwards() {
  unblocks_.assign(groups_.size(), {});
  for (std::uint32_t g = 0; g < groups_.size(); ++g) {
    auto& a = awaits_[g];
    std::sort(a.begin(), a.end());
    a.erase(std::unique(a.begin(), a.end()), a.end());
    for (auto d : a) unblocks_[d].push_back(g);
  }
}

/// Computes the plan. Deterministic: the same arguments give the same plan on every rank.
/// Throws `errc::invalid_argument` for N or M of zero, when a policy's pieces do not cover
/// every byte exactly once, when some clone rank would not receive every byte exactly once,
/// and for forwards out of dependency order or waiting on each other in a cycle.
template <class Shard, class Reconstruct>
plan make_plan(const layout& lay, std::uint32_t sources, std::uint32_t clones, const Shard& shard,
               const Reconstruct& recon, const plan_options& opt, std::uint32_t checksum_id) {
  if (sources == 0) throw error(errc::invalid_argument, "a clone needs at least one source (N = 0)");
  if (clones == 0) throw error(errc::invalid_argument, "a clone needs at least one clone rank (M = 0)");
  if (opt.max_piece_bytes == 0) throw error(errc::invalid_argument, "plan_options::max_piece_bytes must be > 0");
  plan p;
  p.layout_ = lay;
  p.key_ = {sources, clones, Shard::id, shard.param(), Reconstruct::id, recon.param(), opt.alignment,
            opt.max_piece_bytes, checksum_id};

  // 1. Which source sends which bytes.
  std::vector<piece> sharded = shard.assign(lay, sources, opt.alignment);
  // 2. Pieces above max_piece_bytes are cut.
  std::vector<piece> cut = detail::cut_pieces(sharded, lay, sources, opt, Shard::name);
  // 3. Which clone ranks receive each piece from its source.
  p.pieces_ = recon.assign_owners(std::move(cut), lay, clones, opt.alignment);
  std::sort(p.pieces_.begin(), p.pieces_.end(),
            [](const piece& a, const piece& b) { return std::tie(a.tensor, a.offset) < std::tie(b.tensor, b.offset); });

  detail::check_pieces(p.pieces_, lay, sources, clones, std::string(Shard::name) + "/" + Reconstruct::name);

  // 4. Group pieces into messages, as the reconstruction policy forwards them.
  const std::string policy = Reconstruct::name;
  std::vector<std::vector<reconstruct::hop>> hops_of(clones);  // per owner, asked once
  for (std::uint32_t o = 0; o < clones; ++o) {
    hops_of[o] = recon.forwards(o, clones);
    detail::check_hops(hops_of[o], o, clones, policy);
  }
  p.group(sources, clones, hops_of);
  detail::check_forwards_acyclic(p, policy);
  detail::check_every_clone_receives_all(p, clones, std::string(Shard::name) + "/" + Reconstruct::name);
  return p;
}

}  // namespace deepclone
