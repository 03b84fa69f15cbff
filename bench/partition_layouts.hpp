#pragma once
// Shared by the partitioned-state benchmarks (partition_bench.cpp in process,
// partition_bench_mpi.cpp under mpirun): bert_large's real layout with Adam's slots, scaled;
// its ZeRO-1 and TP2xDP2 holdings into replicated clone ranks; each rank's own tensors
// filled with the value of every element's global position, the check of a clone's, and
// the median of a figure's rounds.
#include <deepclone/holdings.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "models.hpp"  // tests/support/models.hpp

namespace partition_bench {

namespace dc = deepclone;

/// The model with Adam's slots, dimension 0 of every tensor divided by `divisor` (at least 1).
inline dc::layout scaled_model(const std::string& models_dir, const std::string& model, std::uint64_t divisor) {
  auto full = dc::testing::load_model(models_dir, model, dc::testing::optimizer::adam);
  std::vector<dc::layer_desc> layers = full.layers();
  for (auto& l : layers)
    for (auto& t : l.tensors) {
      t.shape[0] = std::max<std::int64_t>(1, t.shape[0] / static_cast<std::int64_t>(divisor));
      t.bytes = dc::dtype_size(t.type);
      for (auto x : t.shape) t.bytes *= static_cast<std::uint64_t>(x);
    }
  return dc::layout(std::move(layers));
}

inline bool is_slot(const std::string& name) { return name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq"); }
inline std::uint64_t elements(const dc::tensor_desc& d) { return d.bytes / dc::dtype_size(d.type); }

/// A layout's holdings on both sides and its name.
struct scenario {
  std::string name;
  std::vector<dc::holdings> src, dst;
};

/// ZeRO-1 over 4 sources: the slots of every tensor, concatenated in layout order, are one
/// flat buffer cut into 4 equal ranges; each rank holds its range's intersection with each
/// slot tensor (uneven, often empty). Parameters are replicated.
inline scenario zero1(const dc::layout& lay) {
  scenario s{"zero1", std::vector<dc::holdings>(4, dc::holdings(lay.tensor_count())), std::vector<dc::holdings>(2, dc::holdings::replicated(lay))};
  std::uint64_t total = 0;
  for (std::size_t t = 0; t < lay.tensor_count(); ++t)
    if (is_slot(lay.tensor(t).name)) total += elements(lay.tensor(t));
  std::uint64_t at = 0;  // the tensor's first element in the flat buffer
  for (std::size_t t = 0; t < lay.tensor_count(); ++t) {
    const auto& d = lay.tensor(t);
    for (std::uint64_t r = 0; r < 4; ++r) {
      if (!is_slot(d.name)) {
        s.src[r].of_tensor[t] = {dc::part::whole()};
        continue;
      }
      const auto lo = std::max(at, r * total / 4), hi = std::min(at + elements(d), (r + 1) * total / 4);
      if (lo < hi) s.src[r].of_tensor[t] = {dc::part::flat(lo - at, hi - at)};
    }
    if (is_slot(d.name)) at += elements(d);
  }
  return s;
}

/// How Megatron splits a tensor of the named layer over the tensor-parallel ranks.
enum class split { replicated, column, row };
inline split tp_split(const std::string& layer, const dc::tensor_desc& d) {
  if (layer.ends_with("self_attn") || layer.ends_with("linear1") || layer == "embeddings.word") return split::column;
  if ((layer.ends_with("out_proj") || layer.ends_with("linear2")) && d.shape.size() == 2) return split::row;
  return split::replicated;
}

/// Half `h` (0 or 1) of dimension `dim` of tensor `d`, as a box.
inline dc::part half_box(const dc::tensor_desc& d, std::size_t dim, std::uint64_t h) {
  std::vector<std::uint64_t> start(d.shape.size(), 0), count;
  for (auto x : d.shape) count.push_back(static_cast<std::uint64_t>(x));
  const auto n = count[dim];
  start[dim] = h * (n / 2);
  count[dim] = h ? n - n / 2 : n / 2;
  return dc::part::box(start, count);
}

/// Tensor parallel 2 x data parallel 2: sources 0,1 are the TP ranks of replica 0; 2,3 of replica 1.
inline scenario tp2dp2(const dc::layout& lay) {
  scenario s{"tp2dp2", std::vector<dc::holdings>(4, dc::holdings(lay.tensor_count())), std::vector<dc::holdings>(2, dc::holdings::replicated(lay))};
  for (std::size_t t = 0; t < lay.tensor_count(); ++t) {
    const auto& d = lay.tensor(t);
    const auto how = tp_split(lay.layers()[lay.layer_of(t)].name, d);
    for (std::uint64_t r = 0; r < 4; ++r)
      s.src[r].of_tensor[t] = {how == split::replicated ? dc::part::whole() : half_box(d, how == split::column ? 0 : 1, r % 2)};
  }
  return s;
}

/// Calls f(first global element, first local element, elements) for each contiguous run of
/// part `p` of tensor `d` (boxes: one run per row of the last dimension).
template <class F>
inline void for_runs(const dc::tensor_desc& d, const dc::part& p, F f) {
  const std::uint64_t local = p.local_offset / dc::dtype_size(d.type);
  if (p.kind == dc::part::shape_kind::whole) return f(std::uint64_t{0}, local, elements(d));
  if (p.kind == dc::part::shape_kind::flat) return f(p.begin, local, p.end - p.begin);
  const std::size_t last = d.shape.size() - 1;
  std::vector<std::uint64_t> idx(d.shape.size(), 0);
  for (std::uint64_t at = local;; at += p.count[last]) {
    std::uint64_t global = 0;
    for (std::size_t k = 0; k < d.shape.size(); ++k) global = global * static_cast<std::uint64_t>(d.shape[k]) + p.start[k] + idx[k];
    f(global, at, p.count[last]);
    std::size_t k = last;
    while (k-- > 0 && ++idx[k] == p.count[k]) idx[k] = 0;
    if (k == static_cast<std::size_t>(-1)) return;
  }
}

/// The value every copy of element `e` of tensor `t` holds.
inline std::uint32_t pattern(std::size_t t, std::uint64_t e) { return static_cast<std::uint32_t>((e + 1) * 2654435761u ^ (t * 40503u)); }

/// One rank's own tensors sized as its holdings say; sources filled with the pattern.
inline std::vector<std::vector<std::byte>> own_tensors(const dc::layout& lay, const dc::holdings& h, bool fill) {
  std::vector<std::vector<std::byte>> out(lay.tensor_count());
  for (std::size_t t = 0; t < lay.tensor_count(); ++t) {
    const auto& d = lay.tensor(t);
    const auto es = dc::dtype_size(d.type);
    std::uint64_t n = 0;
    for (const auto& p : h.of_tensor[t]) for_runs(d, p, [&](std::uint64_t, std::uint64_t l, std::uint64_t k) { n = std::max(n, (l + k) * es); });
    out[t].assign(n, std::byte{0xEE});  // value-initialised: pre-faulted
    if (!fill) continue;
    for (const auto& p : h.of_tensor[t])
      for_runs(d, p, [&](std::uint64_t g, std::uint64_t l, std::uint64_t k) {
        for (std::uint64_t i = 0; i < k; ++i) {
          const auto v = pattern(t, g + i);
          std::memcpy(out[t].data() + (l + i) * es, &v, std::min<std::size_t>(es, sizeof v));
        }
      });
  }
  return out;
}

/// Whether every byte a clone rank wants holds the pattern of its global position.
inline bool verify(const dc::layout& lay, const dc::holdings& h, const std::vector<std::vector<std::byte>>& own) {
  bool ok = true;
  for (std::size_t t = 0; t < lay.tensor_count() && ok; ++t) {
    const auto& d = lay.tensor(t);
    const auto es = dc::dtype_size(d.type);
    for (const auto& p : h.of_tensor[t])
      for_runs(d, p, [&](std::uint64_t g, std::uint64_t l, std::uint64_t k) {
        for (std::uint64_t i = 0; i < k && ok; ++i) {
          const auto v = pattern(t, g + i);
          ok = std::memcmp(own[t].data() + (l + i) * es, &v, std::min<std::size_t>(es, sizeof v)) == 0;
        }
      });
  }
  return ok;
}

template <class Byte>
inline std::vector<std::span<Byte>> spans(std::vector<std::vector<std::byte>>& ts) {
  std::vector<std::span<Byte>> out;
  for (auto& t : ts) out.emplace_back(t.data(), t.size());
  return out;
}

/// Bytes each source holds, and what it should send when every region is split evenly over
/// its holders: M x sum over tensors of held / replication factor (clone ranks replicated).
struct expectation {
  std::vector<std::uint64_t> held;
  std::vector<double> sent;
};
inline expectation expected(const dc::layout& lay, const scenario& s, bool shared) {
  const auto n = s.src.size();
  expectation e{std::vector<std::uint64_t>(n, 0), std::vector<double>(n, 0)};
  for (std::size_t t = 0; t < lay.tensor_count(); ++t) {
    std::vector<std::uint64_t> held(n, 0);
    std::uint64_t all = 0;
    for (std::size_t r = 0; r < n; ++r) {
      for (const auto& p : s.src[r].of_tensor[t]) for_runs(lay.tensor(t), p, [&](std::uint64_t, std::uint64_t, std::uint64_t k) { held[r] += k; });
      held[r] *= dc::dtype_size(lay.tensor(t).type);
      all += held[r];
    }
    const double replication = static_cast<double>(all) / static_cast<double>(lay.tensor(t).bytes);
    for (std::size_t r = 0; r < n; ++r) {
      e.held[r] += held[r];
      e.sent[r] += static_cast<double>(shared ? 1 : s.dst.size()) * static_cast<double>(held[r]) / replication;
    }
  }
  return e;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace partition_bench
