#pragma once
/// \file holdings.hpp
/// Partitioned training state (ZeRO, FSDP, tensor and pipeline parallelism): which part of
/// each tensor of the *global* layout a rank holds or wants, and the pure plan that moves
/// every wanted byte from a source holding it, and its failover over the other holders.
/// This header is the planner only (issue 12: partition_groups.hpp groups and packs its
/// transfers, partition_declaration.hpp is what both sides prove before bytes move,
/// partition_transfer.hpp moves them, partition_engine.hpp forks a training job with them).
///
/// A rank declares, per global tensor, a list of parts, each stored densely in the rank's
/// own tensor from `local_offset` on: all of it (replicated), a flat element range of the
/// flattened tensor (ZeRO/FSDP, uneven sizes allowed) or a box (start and count per
/// dimension, as HDF5 and ADIOS2 select; tensor-parallel splits). No part: the rank holds
/// nothing of that tensor (another pipeline stage). Every part becomes byte *runs* of the
/// row-major global tensor; the plan intersects the sources' runs with the clones' runs.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "error.hpp"
#include "layout.hpp"
#include "piece.hpp"

namespace deepclone {

/// One part of a global tensor that a rank holds or wants.
struct part {
  enum class shape_kind { whole, flat, box };
  shape_kind kind = shape_kind::whole;
  std::uint64_t begin = 0, end = 0;                  ///< flat: elements [begin, end) of the flattened tensor
  std::vector<std::uint64_t> start, count;           ///< box: per dimension
  std::uint64_t local_offset = 0;                    ///< bytes into the rank's own tensor where the part starts

  static part whole(std::uint64_t local = 0) { return {shape_kind::whole, 0, 0, {}, {}, local}; }
  static part flat(std::uint64_t first, std::uint64_t last, std::uint64_t local = 0) {
    return {shape_kind::flat, first, last, {}, {}, local};
  }
  static part box(std::vector<std::uint64_t> first, std::vector<std::uint64_t> extent, std::uint64_t local = 0) {
    return {shape_kind::box, 0, 0, std::move(first), std::move(extent), local};
  }
};

/// What one rank holds (a source) or wants (a clone rank): parts per global tensor (flat
/// index of the global layout); an empty list means none of that tensor.
struct holdings {
  std::vector<std::vector<part>> of_tensor;
  explicit holdings(std::size_t tensors = 0) : of_tensor(tensors) {}
  /// Every tensor whole: today's replicated case.
  static holdings replicated(const layout& l) {
    holdings h(l.tensor_count());
    for (auto& p : h.of_tensor) p.push_back(part::whole());
    return h;
  }
};

/// A contiguous byte range of a global tensor and where it lies in a rank's own tensor.
struct byte_run {
  std::uint64_t global = 0, length = 0, local = 0;
  std::uint64_t global_end() const { return global + length; }
};

/// One transfer of the partitioned plan: `length` bytes of global tensor `tensor` from
/// `global` on, read by source `source` at `source_offset` of its own tensor and written
/// by clone rank `clone` at `clone_offset` of its own.
struct region_transfer {
  std::uint32_t tensor = 0, layer = 0;
  std::uint64_t global = 0, length = 0;
  std::uint32_t source = 0, clone = 0;
  std::uint64_t source_offset = 0, clone_offset = 0;
  bool operator==(const region_transfer&) const = default;
};

namespace detail {

/// "layer.tensor": tensor names repeat across layers ("weight"), so messages name both.
inline std::string qualified_name(const layout& l, std::size_t t) {
  return l.layers()[l.layer_of(t)].name + "." + l.tensor(t).name;
}
inline std::string tensor_label(const layout& l, std::uint32_t t) { return "tensor '" + qualified_name(l, t) + "'"; }

/// The global shape in elements (a tensor without a shape is one-dimensional).
inline std::vector<std::uint64_t> global_dims(const tensor_desc& d) {
  std::vector<std::uint64_t> dims;
  for (auto x : d.shape) dims.push_back(static_cast<std::uint64_t>(x));
  if (dims.empty()) dims.push_back(d.bytes / dtype_size(d.type));
  return dims;
}

/// The rows of a box (contiguous along the last dimension), merged where consecutive rows
/// are contiguous in the global tensor, as runs in bytes. Local bytes are dense, row-major.
inline void box_runs(const part& p, const std::vector<std::uint64_t>& dims, std::uint64_t esize, std::vector<byte_run>& out) {
  const std::size_t nd = dims.size();
  std::vector<std::uint64_t> stride(nd, 1);
  for (std::size_t d = nd - 1; d-- > 0;) stride[d] = stride[d + 1] * dims[d + 1];
  for (auto c : p.count)
    if (c == 0) return;
  std::vector<std::uint64_t> idx(nd, 0);  // over all dims but the last
  std::uint64_t local = p.local_offset;
  const std::uint64_t row = p.count[nd - 1] * esize;
  while (true) {
    std::uint64_t g = 0;
    for (std::size_t d = 0; d < nd; ++d) g += (p.start[d] + idx[d]) * stride[d];
    g *= esize;
    if (!out.empty() && out.back().global_end() == g && out.back().local + out.back().length == local)
      out.back().length += row;
    else
      out.push_back({g, row, local});
    local += row;
    std::size_t d = nd - 1;
    while (d-- > 0 && ++idx[d] == p.count[d]) idx[d] = 0;
    if (d == static_cast<std::size_t>(-1)) return;
  }
}

/// A part as byte runs of the global tensor, checked against the tensor's shape.
inline void part_runs(const layout& l, std::uint32_t t, const part& p, const std::string& who, std::vector<byte_run>& out) {
  const auto& d = l.tensor(t);
  const std::uint64_t es = dtype_size(d.type), elems = d.bytes / es;
  auto bad = [&](const std::string& why) {
    throw error(errc::invalid_argument, who + ": " + tensor_label(l, t) + ": " + why);
  };
  switch (p.kind) {
    case part::shape_kind::whole:
      if (d.bytes) out.push_back({0, d.bytes, p.local_offset});
      return;
    case part::shape_kind::flat:
      if (p.begin > p.end || p.end > elems)
        bad("flat range [" + std::to_string(p.begin) + ", " + std::to_string(p.end) + ") is not within its " +
            std::to_string(elems) + " elements");
      if (p.end > p.begin) out.push_back({p.begin * es, (p.end - p.begin) * es, p.local_offset});
      return;
    case part::shape_kind::box: {
      const auto dims = global_dims(d);
      if (p.start.size() != dims.size() || p.count.size() != dims.size())
        bad("a box needs a start and a count per dimension (" + std::to_string(dims.size()) + ")");
      for (std::size_t k = 0; k < dims.size(); ++k)
        if (p.start[k] > dims[k] || p.count[k] > dims[k] - p.start[k])
          bad("box start " + std::to_string(p.start[k]) + " + count " + std::to_string(p.count[k]) + " exceeds dimension " +
              std::to_string(k) + " (" + std::to_string(dims[k]) + ")");
      box_runs(p, dims, es, out);
      return;
    }
  }
}

/// All runs of one rank's parts of tensor t, sorted by global offset; refuses a rank that
/// declares a byte twice or two parts over the same bytes of its own tensor.
inline std::vector<byte_run> rank_runs(const layout& l, std::uint32_t t, const std::vector<part>& parts, const std::string& who) {
  std::vector<byte_run> runs;
  for (auto& p : parts) part_runs(l, t, p, who, runs);
  auto overlap = [&](auto key, const char* what) {
    std::sort(runs.begin(), runs.end(), [&](auto& a, auto& b) { return key(a) < key(b); });
    for (std::size_t i = 1; i < runs.size(); ++i)
      if (key(runs[i]) < key(runs[i - 1]) + runs[i - 1].length)
        throw error(errc::invalid_argument, who + ": " + tensor_label(l, t) + ": two parts cover the same " + what +
                                                " (bytes from " + std::to_string(key(runs[i])) + ")");
  };
  overlap([](const byte_run& r) { return r.local; }, "bytes of its own tensor");
  overlap([](const byte_run& r) { return r.global; }, "global bytes");
  return runs;
}

/// The run of `runs` (sorted, disjoint) that holds global byte `g`, or nullptr.
inline const byte_run* run_at(const std::vector<byte_run>& runs, std::uint64_t g) {
  auto it = std::upper_bound(runs.begin(), runs.end(), g, [](std::uint64_t x, const byte_run& r) { return x < r.global; });
  if (it == runs.begin()) return nullptr;
  --it;
  return g < it->global_end() ? &*it : nullptr;
}

/// Which source sends each byte of [first, last) of tensor t: cut at every source-run
/// boundary; each range goes to its holders not `excluded`, split evenly (granule-aligned,
/// rotating the remainder) when it has several. A range with no such holder goes to
/// `refuse(begin, end)`, which throws.
struct assigned_range {
  std::uint64_t begin = 0, end = 0;
  std::uint32_t source = 0;
};
template <class Refuse>
std::vector<assigned_range> assign_sources(std::uint64_t first, std::uint64_t last, const std::vector<std::vector<byte_run>>& src,
                                           const std::vector<bool>& excluded, std::uint64_t granule_bytes, std::uint64_t& rotate,
                                           Refuse refuse) {
  std::vector<std::uint64_t> cuts{first, last};
  for (auto& runs : src)
    for (auto& r : runs)
      for (auto c : {r.global, r.global_end()})
        if (c > first && c < last) cuts.push_back(c);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<assigned_range> out;
  for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
    const std::uint64_t b = cuts[i], e = cuts[i + 1];
    std::vector<std::uint32_t> holders;
    for (std::uint32_t s = 0; s < src.size(); ++s)
      if (!excluded[s] && run_at(src[s], b)) holders.push_back(s);
    if (holders.empty()) refuse(b, e);
    const auto parts = split_range(e - b, holders.size(), granule_bytes, rotate);
    rotate += parts.size();
    for (std::size_t k = 0; k < parts.size(); ++k)
      out.push_back({b + parts[k].first, b + parts[k].first + parts[k].second, holders[(k + rotate) % holders.size()]});
  }
  return out;
}

/// Every source's runs of tensor t.
inline std::vector<std::vector<byte_run>> source_runs(const layout& l, std::uint32_t t, const std::vector<holdings>& sources) {
  std::vector<std::vector<byte_run>> src(sources.size());
  for (std::uint32_t s = 0; s < sources.size(); ++s) src[s] = rank_runs(l, t, sources[s].of_tensor[t], "source " + std::to_string(s));
  return src;
}

inline std::string bytes_label(std::uint64_t b, std::uint64_t e) { return "bytes [" + std::to_string(b) + ", " + std::to_string(e) + ")"; }

/// Every clone rank's wanted runs of tensor t, and the sorted boundaries of all of them.
struct wanted_runs {
  std::vector<std::vector<byte_run>> of_clone;
  std::vector<std::uint64_t> cuts;
  wanted_runs(const layout& l, std::uint32_t t, const std::vector<holdings>& clones) {
    for (std::uint32_t c = 0; c < clones.size(); ++c) {
      of_clone.push_back(rank_runs(l, t, clones[c].of_tensor[t], "clone rank " + std::to_string(c)));
      for (const auto& r : of_clone.back()) cuts.push_back(r.global), cuts.push_back(r.global_end());
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  }
};

/// Sharing (partition_sharing::exchange) of the assigned range `r` of tensor t: cut at every
/// boundary of the clone ranks' wanted runs, so that each piece has one set W of clone ranks
/// wanting it; a piece several want is split over W (granule-aligned, rotating the
/// remainder), each share sent by the source to one member of W, which forwards it to the
/// others. A piece one clone rank wants goes to it alone.
inline void share_range(const assigned_range& r, std::uint32_t t, std::uint32_t layer, const std::vector<byte_run>& held,
                        const wanted_runs& want, std::uint64_t granule_bytes, std::uint64_t& rotate,
                        std::vector<region_transfer>& transfers, std::vector<region_transfer>& forwards) {
  std::vector<std::uint64_t> points{r.begin};
  for (auto it = std::upper_bound(want.cuts.begin(), want.cuts.end(), r.begin); it != want.cuts.end() && *it < r.end; ++it)
    points.push_back(*it);
  points.push_back(r.end);
  for (std::size_t i = 0; i + 1 < points.size(); ++i) {
    std::vector<std::pair<std::uint32_t, const byte_run*>> wanting;  // W, and each member's run
    for (std::uint32_t c = 0; c < want.of_clone.size(); ++c)
      if (const auto* run = run_at(want.of_clone[c], points[i])) wanting.emplace_back(c, run);
    if (wanting.empty()) continue;
    const auto shares = split_range(points[i + 1] - points[i], wanting.size(), granule_bytes, rotate);
    rotate += shares.size();
    for (std::size_t k = 0; k < shares.size(); ++k) {
      const auto b = points[i] + shares[k].first, n = shares[k].second;
      const auto& [first, run] = wanting[(k + rotate) % wanting.size()];
      const auto* h = run_at(held, b);
      transfers.push_back({t, layer, b, n, r.source, first, h->local + (b - h->global), run->local + (b - run->global)});
      for (const auto& [c, other] : wanting)
        if (c != first) forwards.push_back({t, layer, b, n, first, c, run->local + (b - run->global), other->local + (b - other->global)});
    }
  }
}

/// Moves transfers to the live holders of their bytes: the rule failover and refetch share.
class reassigner {
 public:
  reassigner(const layout& global, const std::vector<holdings>& sources, const std::vector<bool>& failed, std::uint64_t alignment)
      : global_(global), sources_(sources), failed_(failed), alignment_(alignment), runs_(global.tensor_count()) {
    if (failed.size() != sources.size())
      throw error(errc::invalid_argument, "partitioned failover: a failure list for " + std::to_string(failed.size()) +
                                              " sources, holdings of " + std::to_string(sources.size()));
  }
  /// Appends to `out` the transfers that carry `x`'s bytes to `x.clone` from the live sources
  /// holding them (each range split evenly over them); `no_replica(b, e)` throws for bytes
  /// no live source holds.
  template <class NoReplica>
  void operator()(const region_transfer& x, std::vector<region_transfer>& out, NoReplica no_replica) {
    if (runs_[x.tensor].empty()) runs_[x.tensor] = source_runs(global_, x.tensor, sources_);
    const auto& src = runs_[x.tensor];
    for (const auto& r : assign_sources(x.global, x.global + x.length, src, failed_, granule(global_.tensor(x.tensor), alignment_), rotate_,
                                        no_replica)) {
      const auto* held = run_at(src[r.source], r.begin);
      out.push_back({x.tensor, x.layer, r.begin, r.end - r.begin, r.source, x.clone, held->local + (r.begin - held->global),
                     x.clone_offset + (r.begin - x.global)});
    }
  }

 private:
  const layout& global_;
  const std::vector<holdings>& sources_;
  const std::vector<bool>& failed_;
  std::uint64_t alignment_, rotate_ = 0;
  std::vector<std::vector<std::vector<byte_run>>> runs_;  // per tensor, computed when needed
};

}  // namespace detail

/// How clone ranks that want the same bytes get them.
enum class partition_sharing {
  /// Each from a source: a source sends such bytes once per clone rank wanting them.
  none,
  /// The sources send each byte once, to one of the clone ranks that want it, which forwards
  /// it to the others (the scatter_exchange of replicated state, per region): a source sends
  /// its held bytes / replication factor, whatever the number of clone ranks.
  exchange,
};

/// The partitioned plan: every byte each clone rank wants, from one source that holds it.
/// A byte several sources hold (data-parallel replicas) is sent by one of them, the
/// replicas splitting each such range evenly; all clone ranks that want a byte get it from
/// the same source, or (partition_sharing::exchange) one of them gets it from that source
/// and forwards it to the others. Deterministic: every rank computes the same plan from
/// the same holdings.
class partition_plan {
 public:
  /// What the sources send: `source` is a source index.
  const std::vector<region_transfer>& transfers() const noexcept { return transfers_; }
  /// What clone ranks forward to each other once they verified it (exchange only): `source`
  /// is the forwarding clone rank's index, `source_offset` the offset in its own tensor.
  const std::vector<region_transfer>& forwards() const noexcept { return forwards_; }
  std::uint64_t bytes_forwarded_by_clone(std::uint32_t c) const {
    std::uint64_t b = 0;
    for (auto& x : forwards_) b += x.source == c ? x.length : 0;
    return b;
  }
  std::uint64_t bytes_sent_by_source(std::uint32_t s) const {
    std::uint64_t b = 0;
    for (auto& x : transfers_) b += x.source == s ? x.length : 0;
    return b;
  }
  std::uint64_t bytes_received_by_clone(std::uint32_t c) const {
    std::uint64_t b = 0;
    for (auto& x : transfers_) b += x.clone == c ? x.length : 0;
    return b;
  }
  /// The transfers `keep` accepts, in this plan's order, without forwards (a failover round
  /// replaces part of a clone rank's transfers: detail/partition_failover.hpp).
  template <class Keep>
  partition_plan only(Keep keep) const {
    partition_plan p;
    for (const auto& x : transfers_)
      if (keep(x)) p.transfers_.push_back(x);
    return p;
  }
  /// This plan's transfers, then `more`'s, without forwards.
  partition_plan joined(const partition_plan& more) const {
    partition_plan p;
    p.transfers_ = transfers_;
    p.transfers_.insert(p.transfers_.end(), more.transfers_.begin(), more.transfers_.end());
    return p;
  }
  friend partition_plan make_partition_plan(const layout&, const std::vector<holdings>&, const std::vector<holdings>&,
                                            std::uint64_t, partition_sharing);
  friend partition_plan make_failover_plan(const layout&, const std::vector<holdings>&, const partition_plan&,
                                           const std::vector<bool>&, std::uint64_t);
  friend partition_plan make_refetch_plan(const layout&, const std::vector<holdings>&, std::span<const region_transfer>,
                                          const std::vector<bool>&, std::uint64_t);

 private:
  std::vector<region_transfer> transfers_, forwards_;
};

/// Computes the partitioned plan. Throws `errc::invalid_argument` naming the rank, tensor
/// and bytes for: holdings of another tensor count, a part outside its tensor's shape, a
/// rank declaring a byte twice, and a byte wanted by a clone rank that no source holds.
inline partition_plan make_partition_plan(const layout& global, const std::vector<holdings>& sources,
                                          const std::vector<holdings>& clones, std::uint64_t alignment = 256,
                                          partition_sharing sharing = partition_sharing::none) {
  if (sources.empty() || clones.empty()) throw error(errc::invalid_argument, "partitioned state: needs sources and clone ranks");
  auto check_count = [&](const holdings& h, const std::string& who) {
    if (h.of_tensor.size() != global.tensor_count())
      throw error(errc::invalid_argument, who + " declares holdings for " + std::to_string(h.of_tensor.size()) +
                                              " tensors; the global layout has " + std::to_string(global.tensor_count()));
  };
  for (std::uint32_t s = 0; s < sources.size(); ++s) check_count(sources[s], "source " + std::to_string(s));
  for (std::uint32_t c = 0; c < clones.size(); ++c) check_count(clones[c], "clone rank " + std::to_string(c));
  partition_plan p;
  std::uint64_t rotate = 0, share_rotate = 0;
  for (std::uint32_t t = 0; t < global.tensor_count(); ++t) {
    const auto src = detail::source_runs(global, t, sources);
    auto uncovered = [&](std::uint64_t b, std::uint64_t e) {
      throw error(errc::invalid_argument, "partitioned state: no source holds " + detail::bytes_label(b, e) + " of " +
                                              detail::tensor_label(global, t) +
                                              " (the sources' holdings must cover every byte of the global state)");
    };
    const auto granule_bytes = granule(global.tensor(t), alignment);
    const auto ranges = detail::assign_sources(0, global.tensor(t).bytes, src, std::vector<bool>(src.size(), false), granule_bytes, rotate,
                                               uncovered);
    const auto layer = static_cast<std::uint32_t>(global.layer_of(t));
    if (sharing == partition_sharing::exchange) {
      const detail::wanted_runs want(global, t, clones);
      for (const auto& r : ranges)
        detail::share_range(r, t, layer, src[r.source], want, granule_bytes, share_rotate, p.transfers_, p.forwards_);
      continue;
    }
    for (std::uint32_t c = 0; c < clones.size(); ++c)
      for (auto& want : detail::rank_runs(global, t, clones[c].of_tensor[t], "clone rank " + std::to_string(c))) {
        // The assigned ranges overlapping this wanted run (ranges are sorted and disjoint).
        auto it = std::upper_bound(ranges.begin(), ranges.end(), want.global,
                                   [](std::uint64_t x, const detail::assigned_range& r) { return x < r.end; });
        for (; it != ranges.end() && it->begin < want.global_end(); ++it) {
          const auto b = std::max(it->begin, want.global), e = std::min(it->end, want.global_end());
          const auto* held = detail::run_at(src[it->source], b);  // one run: the range lies within it
          p.transfers_.push_back({t, layer, b, e - b, it->source, c, held->local + (b - held->global),
                                  want.local + (b - want.global)});
        }
      }
  }
  return p;
}

/// Failover: `plan` with every transfer of a `failed` source sent instead by the live
/// sources that hold the same bytes (each range split evenly over them, as in the plan);
/// the transfers of live sources stay as they were, so what they already sent still counts.
/// Deterministic: every rank that knows the same failures computes the same plan. Throws
/// `errc::source_failed` naming the tensor, the bytes, the clone rank and the failed source
/// where no live source holds a byte a clone rank wants (no replica exists), and
/// `errc::invalid_argument` for holdings or a failure list of another source count.
inline partition_plan make_failover_plan(const layout& global, const std::vector<holdings>& sources, const partition_plan& plan,
                                         const std::vector<bool>& failed, std::uint64_t alignment = 256) {
  partition_plan p;
  detail::reassigner again(global, sources, failed, alignment);
  for (const auto& x : plan.transfers_) {
    if (x.source >= failed.size() || x.tensor >= global.tensor_count())
      throw error(errc::invalid_argument, "partitioned failover: a plan for other holdings (source or tensor out of range)");
    if (!failed[x.source]) {
      p.transfers_.push_back(x);
      continue;
    }
    again(x, p.transfers_, [&](std::uint64_t b, std::uint64_t e) {
      throw error(errc::source_failed, "partitioned state: " + detail::bytes_label(b, e) + " of " + detail::tensor_label(global, x.tensor) +
                                           ", wanted by clone rank " + std::to_string(x.clone) + ", came from source " +
                                           std::to_string(x.source) + ", which failed, and no live source holds them (no replica exists)");
    });
  }
  return p;
}

/// Sharing's fallback: `forwards` (of partition_plan::forwards(), whose `source` is the
/// forwarding clone rank) sent instead by the live sources that hold their bytes (each range
/// split evenly over them), to the clone rank each forward was for. Throws
/// `errc::source_failed` naming the bytes where no live source holds them.
inline partition_plan make_refetch_plan(const layout& global, const std::vector<holdings>& sources, std::span<const region_transfer> forwards,
                                        const std::vector<bool>& failed, std::uint64_t alignment = 256) {
  partition_plan p;
  detail::reassigner again(global, sources, failed, alignment);
  for (const auto& x : forwards) {
    if (x.tensor >= global.tensor_count()) throw error(errc::invalid_argument, "partitioned refetch: a forward of tensor " + std::to_string(x.tensor));
    again(x, p.transfers_, [&](std::uint64_t b, std::uint64_t e) {
      throw error(errc::source_failed, "partitioned state: " + detail::bytes_label(b, e) + " of " + detail::tensor_label(global, x.tensor) +
                                           ", wanted by clone rank " + std::to_string(x.clone) + ", were to be forwarded by clone rank " +
                                           std::to_string(x.source) + ", which did not, and no live source holds them (no replica exists)");
    });
  }
  return p;
}

}  // namespace deepclone
