#pragma once
/// \file detail/source_session.hpp
/// One fork session on a source, templated on the communicator only: its identity and tag
/// block, the sends it posted (data per layer, refetches apart), which clone rank verified
/// which layer, the refetches it owes, the checksums of iteration k, and its figures; and
/// the sends that need only the plan (data pieces, group headers). The source engine keeps
/// what needs the tensors (which bytes, from where: the pipeline, refetches, digests) and
/// the hooks, so this compiles once per transport, not once per engine.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "../checksum.hpp"
#include "../plan.hpp"
#include "../roles.hpp"
#include "outbox.hpp"
#include "wire.hpp"

namespace deepclone::detail {

/// Pieces of layer `l` that source `source` sends, each with the groups (clone ranks) that
/// receive it, in increasing piece index (each group's wire order).
inline std::map<std::uint32_t, std::vector<std::uint32_t>> pieces_sent_by(const plan& p, std::uint32_t source, std::size_t l) {
  std::map<std::uint32_t, std::vector<std::uint32_t>> holders;
  for (auto g : p.sent_by_source(source, l))
    for (auto pi : p.groups()[g].pieces) holders[pi].push_back(g);
  return holders;
}

template <class Comm>
struct source_session {
  /// Where piece `pi`'s bytes of iteration k are now (the engine knows: a copy the pipeline
  /// holds, the live tensor until its layer is released), or nullopt when nowhere. A type
  /// erased function, so that what uses it compiles once per transport and checksum.
  using bytes_of_k_fn = std::function<std::optional<std::span<const std::byte>>(std::uint32_t pi)>;

  /// Session `id` at iteration `k` of source `source`, in tag block `tags`; `acks_needed`
  /// (per layer, the clone ranks that receive part of it; its size is the layer count) must
  /// outlive the session.
  source_session(const plan& p, const roles& r, std::uint32_t source, std::uint64_t id_, std::uint64_t k_, session_tags tags_,
                 const std::vector<std::uint32_t>& acks_needed)
      : id(id_), k(k_), tags(tags_), plan_(p), roles_(r), source_(source), acks_needed_(acks_needed) {
    const std::size_t layers = acks_needed.size();
    layer_reqs.resize(layers);
    final.assign(layers, false);
    acked.assign(r.clone_count(), std::vector<char>(layers, 0));
    acks.assign(layers, 0);
    released.assign(layers, false);
    refetch_reqs.resize(layers);
    refetch_queue.resize(r.clone_count());
    piece_sums.assign(p.pieces().size(), 0);
    summed.assign(p.pieces().size(), 0);
  }

  /// Posts one data send of layer `layer` (a group's piece) to clone index `to`.
  std::size_t post_data(Comm& c, std::size_t layer, std::uint32_t to, std::span<const std::byte> bytes) {
    auto r = out.send(c, roles_.clones[to], tags.layer(layer, false, false), bytes);
    layer_reqs[layer].push_back(r);
    bytes_sent += bytes.size();
    return r;
  }
  /// Sends one header per group of layer `l` this source sends: its pieces and their sums.
  void send_headers(Comm& c, std::size_t l) {
    std::map<std::uint32_t, group_header> headers;
    for (auto& [pi, gs] : pieces_sent_by(plan_, source_, l)) {
      auto& p = plan_.pieces()[pi];
      for (auto g : gs) {
        auto& h = headers.try_emplace(g, group_header{.session = id, .iteration = k, .layer = static_cast<std::uint32_t>(l), .from = source_, .pieces = {}})
                      .first->second;
        h.pieces.push_back({p.tensor, p.offset, p.length, piece_sums[pi]});
      }
    }
    for (auto& [g, h] : headers) out.send_owned(c, roles_.clones[plan_.groups()[g].to], tags.layer(l, false, true), h.encode());
  }
  /// Sends the queued refetched groups of clone index `j` whose layer is final in k, oldest
  /// first (the clone posted its receives in that order); a group of a layer not yet final
  /// waits. The engine checks beforehand that no tensor of those layers was resized.
  template <class Checksum>
  bool serve_refetches(Comm& c, std::uint32_t j, const bytes_of_k_fn& bytes_of_k) {
    bool any = false;
    auto& q = refetch_queue[j];
    while (!q.empty() && final[plan_.groups()[q.front()].layer]) {
      serve_group<Checksum>(c, j, plan_.groups()[q.front()], bytes_of_k);
      q.pop_front();
      any = true;
    }
    return any;
  }
  /// verify_replicas: checksums the pieces of layer `l` (final for iteration k, bytes from
  /// `bytes_of_k`) that this source did not already sum, and once every layer is done sends
  /// the folded digest of its whole replica to every clone rank.
  template <class Checksum>
  void digest_layer(Comm& c, std::size_t l, const bytes_of_k_fn& bytes_of_k) {
    for (auto pi : layer_pieces[l]) {
      if (summed[pi]) continue;
      piece_sums[pi] = Checksum::compute(*bytes_of_k(pi));
      summed[pi] = 1;
    }
    if (++layers_digested < acks.size()) return;
    digest_msg m{id, k, source_, checksum::fold_pieces(piece_sums)};
    for (int clone : roles_.clones) out.send_owned(c, clone, tags.base + tag_digest, m.encode());
  }

  /// Every request in `reqs` (indices into `out`) completed.
  bool sends_done(Comm& c, const std::vector<std::size_t>& reqs) {
    return std::all_of(reqs.begin(), reqs.end(), [&](std::size_t r) { return out.done(c, r); });
  }

  /// Clone index `j` verified `layers` (each counted once; out-of-range layers ignored).
  void acknowledged(std::uint32_t j, const std::vector<std::uint32_t>& layers) {
    for (auto l : layers)
      if (l < acks.size() && !acked[j][l]) {
        acked[j][l] = 1;
        ++acks[l];
      }
  }
  /// Clone index `j` asked for group `g` again; ignored unless the plan sends `g` to `j`.
  void refetch_asked(std::uint32_t j, std::uint32_t g) {
    if (g < plan_.groups().size() && plan_.groups()[g].to == j) refetch_queue[j].push_back(g);
  }
  /// Every clone rank that receives part of layer `l` verified it.
  bool verified(std::size_t l) const { return acks[l] >= acks_needed_[l]; }
  bool all_verified() const {
    for (std::size_t l = 0; l < acks.size(); ++l)
      if (!verified(l)) return false;
    return true;
  }

  /// The completed session's figures, as this source reports them to the clone ranks: the
  /// overhead is the fork iterations' time beyond as many normal iterations.
  status_msg figures(double normal_iteration_s) const {
    status_msg m;
    m.session = id;
    m.source_index = source_;
    m.bytes_sent = bytes_sent;
    m.hook_s = hook_s;
    m.fork_iterations = static_cast<std::uint32_t>(fork_durations.size());
    m.normal_iteration_s = normal_iteration_s;
    double fork = 0;
    for (double d : fork_durations) fork += d;
    m.overhead_s = std::isnan(normal_iteration_s) || fork_durations.empty()
                       ? NAN
                       : fork - static_cast<double>(fork_durations.size()) * normal_iteration_s;
    return m;
  }

  std::uint64_t id = 0, k = 0;
  session_tags tags;
  clock::time_point last_progress = clock::now();
  clock::time_point next_poll{};                         // poll_session_if_due: no round before this
  outbox<Comm> out;
  std::vector<std::vector<std::size_t>> layer_reqs;      // data sends the pipeline posted, per layer
  std::vector<bool> final;                               // the pipeline had the layer's layer_final
  std::vector<std::byte> meta;                           // encoded metadata of iteration k
  std::vector<std::vector<char>> acked;                  // [clone][layer]
  std::vector<std::uint32_t> acks;                       // clone ranks that verified each layer
  std::vector<bool> released;                            // the trainer may overwrite the layer again
  std::vector<std::vector<std::size_t>> refetch_reqs;    // sends of refetched groups, per layer
  std::vector<std::deque<std::uint32_t>> refetch_queue;  // per clone rank, in arrival order
  std::vector<std::uint64_t> piece_sums;                 // checksums at iteration k of the pieces this source summed
  std::vector<char> summed;                              // ... which those are (sent, or digested)
  bool digest = false;                                   // verify_replicas: sum every piece, send the digest
  std::vector<std::vector<std::uint32_t>> layer_pieces;  // verify_replicas: pieces of each layer
  std::size_t layers_digested = 0;
  std::vector<double> fork_durations;
  double hook_s = 0;
  std::uint64_t bytes_sent = 0;

 private:
  /// Serves group `g` again to clone index `j`: its header, then its pieces. It is refused
  /// (a header without pieces) when some piece's bytes of k are gone (`released`), or when
  /// a piece this source summed at k no longer matches that sum (`changed`): the tensor was
  /// written outside its hooks, and serving it would ship iteration k + 1 as k.
  template <class Checksum>
  void serve_group(Comm& c, std::uint32_t j, const transfer_group& g, const bytes_of_k_fn& bytes_of_k) {
    group_header h{.session = id, .iteration = k, .layer = g.layer, .from = source_, .pieces = {}};
    std::vector<std::span<const std::byte>> from;
    for (auto pi : g.pieces)
      if (auto b = bytes_of_k(pi)) from.push_back(*b);
    if (from.size() < g.pieces.size()) h.refused = refusal::released;
    for (std::size_t i = 0; i < g.pieces.size() && h.refused == refusal::none; ++i) {
      auto& p = plan_.pieces()[g.pieces[i]];
      const auto sum = Checksum::compute(from[i]);
      if (summed[g.pieces[i]] && sum != piece_sums[g.pieces[i]]) h.refused = refusal::changed, h.refused_tensor = p.tensor;
      h.pieces.push_back({p.tensor, p.offset, p.length, sum});
    }
    if (h.refused != refusal::none) h.pieces.clear();
    for (std::size_t i = 0; i < h.pieces.size(); ++i) {
      refetch_reqs[g.layer].push_back(out.send(c, roles_.clones[j], tags.refetch_data(), from[i]));
      bytes_sent += h.pieces[i].length;
    }
    out.send_owned(c, roles_.clones[j], tags.refetch_header(), h.encode());
  }

  const plan& plan_;
  const roles& roles_;
  std::uint32_t source_;
  const std::vector<std::uint32_t>& acks_needed_;
};

}  // namespace deepclone::detail
