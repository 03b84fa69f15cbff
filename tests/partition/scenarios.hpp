#pragma once
// Shared by the partition tests: layouts, the holdings of issue 12's scenarios (ZeRO-1,
// ZeRO-3, tensor x data parallel, pipeline x data parallel, randomised), and an independent element-by-element model of
// which global byte sits where in a rank's own tensor (not computed through the planner).
#include <deepclone/holdings.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace partition_test {

namespace dc = deepclone;
using dims_t = std::vector<std::uint64_t>;

inline dc::tensor_desc tensor(std::string name, dims_t dims, dc::dtype t = dc::dtype::f32) {
  dc::tensor_desc d{std::move(name), dc::dtype_size(t), t, {}};
  for (auto x : dims) {
    d.bytes *= x;
    d.shape.push_back(static_cast<std::int64_t>(x));
  }
  return d;
}

/// global byte -> local byte of one rank's tensor, enumerated element by element.
using byte_map = std::map<std::uint64_t, std::uint64_t>;
inline byte_map brute_map(const dc::tensor_desc& d, const std::vector<dc::part>& parts) {
  const std::uint64_t es = dc::dtype_size(d.type);
  dims_t dims;
  for (auto x : d.shape) dims.push_back(static_cast<std::uint64_t>(x));
  byte_map m;
  auto put = [&](std::uint64_t elem, std::uint64_t local) {
    for (std::uint64_t b = 0; b < es; ++b) m[elem * es + b] = local + b;
  };
  for (auto& p : parts) {
    if (p.kind == dc::part::shape_kind::whole)
      for (std::uint64_t e = 0; e < d.bytes / es; ++e) put(e, p.local_offset + e * es);
    else if (p.kind == dc::part::shape_kind::flat)
      for (std::uint64_t e = p.begin; e < p.end; ++e) put(e, p.local_offset + (e - p.begin) * es);
    else {
      const std::uint64_t n = std::accumulate(p.count.begin(), p.count.end(), std::uint64_t{1}, std::multiplies<>());
      for (std::uint64_t i = 0; i < n; ++i) {  // i: dense row-major index inside the box
        std::uint64_t rest = i, global = 0, stride = 1;
        dims_t idx(dims.size());
        for (std::size_t k = dims.size(); k-- > 0;) {
          idx[k] = rest % p.count[k];
          rest /= p.count[k];
        }
        for (std::size_t k = dims.size(); k-- > 0;) {
          global += (p.start[k] + idx[k]) * stride;
          stride *= dims[k];
        }
        put(global, p.local_offset + i * es);
      }
    }
  }
  return m;
}

/// Element range [b, e) of the flattened tensor split unevenly over `n` ranks (rank i gets
/// a share proportional to i + 1), as flat parts.
inline std::vector<dc::part> uneven_flat(const dc::tensor_desc& d, std::uint32_t n, std::uint32_t i) {
  const std::uint64_t elems = d.bytes / dc::dtype_size(d.type), total = n * (n + 1) / 2;
  std::uint64_t b = 0;
  for (std::uint32_t k = 0; k < i; ++k) b += elems * (k + 1) / total;
  const std::uint64_t e = i + 1 == n ? elems : b + elems * (i + 1) / total;
  return {dc::part::flat(b, e)};
}

inline dc::layout two_layer_model() {
  dc::layout l;
  l.add_layer({"fc1", {tensor("weight", {64, 48}), tensor("bias", {64}), tensor("weight.adam_m", {64, 48})}});
  l.add_layer({"fc2", {tensor("weight", {48, 64}), tensor("bias", {48}), tensor("weight.adam_m", {48, 64})}});
  return l;
}
inline bool is_slot(const std::string& name) { return name.find("adam") != std::string::npos; }

/// A global layout and what each source holds and each clone rank wants.
struct scenario {
  dc::layout lay;
  std::vector<dc::holdings> src, dst;
};

/// ZeRO-1 over N=4 (slots flat-partitioned, uneven; parameters replicated) into M=2 replicated.
inline scenario zero1() {
  scenario s{two_layer_model(), {}, {}};
  s.src.assign(4, dc::holdings(s.lay.tensor_count()));
  s.dst.assign(2, dc::holdings::replicated(s.lay));
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t)
    for (std::uint32_t r = 0; r < 4; ++r)
      s.src[r].of_tensor[t] = is_slot(s.lay.tensor(t).name) ? uneven_flat(s.lay.tensor(t), 4, r) : std::vector<dc::part>{dc::part::whole()};
  return s;
}

/// Tensor parallel 2 x data parallel 2 into TP1 on M=3. Sources 0,1: TP ranks of replica 0;
/// 2,3: of replica 1. fc1 is column-parallel (split along dim 0 of [out, in]); fc2
/// row-parallel (split along dim 1: rows not contiguous), its bias replicated.
inline scenario tp2_dp2() {
  scenario s{two_layer_model(), {}, {}};
  s.src.assign(4, dc::holdings(s.lay.tensor_count()));
  s.dst.assign(3, dc::holdings::replicated(s.lay));
  for (std::uint32_t r = 0; r < 4; ++r) {
    const std::uint64_t tp = r % 2;
    for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) {
      const auto& d = s.lay.tensor(t);
      const dims_t dims{static_cast<std::uint64_t>(d.shape[0]), d.shape.size() > 1 ? static_cast<std::uint64_t>(d.shape[1]) : 1};
      auto& parts = s.src[r].of_tensor[t];
      if (d.shape.size() == 1)
        parts = s.lay.layer_of(t) == 0 ? std::vector<dc::part>{dc::part::box({tp * dims[0] / 2}, {dims[0] / 2})}
                                       : std::vector<dc::part>{dc::part::whole()};
      else if (s.lay.layer_of(t) == 0)
        parts = {dc::part::box({tp * dims[0] / 2, 0}, {dims[0] / 2, dims[1]})};
      else
        parts = {dc::part::box({0, tp * dims[1] / 2}, {dims[0], dims[1] / 2})};
    }
  }
  return s;
}

/// ZeRO-3 over N=4 into ZeRO-3 on M=2: every tensor flat-partitioned unevenly on both sides
/// (the clone ranks' shares reversed), so every byte has one holder and one wanter.
inline scenario zero3() {
  scenario s{two_layer_model(), {}, {}};
  s.src.assign(4, dc::holdings(s.lay.tensor_count()));
  s.dst.assign(2, dc::holdings(s.lay.tensor_count()));
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) {
    for (std::uint32_t r = 0; r < 4; ++r) s.src[r].of_tensor[t] = uneven_flat(s.lay.tensor(t), 4, r);
    for (std::uint32_t c = 0; c < 2; ++c) s.dst[c].of_tensor[t] = uneven_flat(s.lay.tensor(t), 2, 1 - c);
  }
  return s;
}

/// Pipeline 2 stages x data parallel 2 (sources 0,1 hold stage 0 = layer fc1, sources 2,3
/// stage 1) into M=2: with `two_stages`, clone rank c wants only stage c's layer; else both
/// clone ranks want everything (one stage).
inline scenario pipeline_2x2(bool two_stages) {
  scenario s{two_layer_model(), {}, {}};
  s.src.assign(4, dc::holdings(s.lay.tensor_count()));
  s.dst.assign(2, two_stages ? dc::holdings(s.lay.tensor_count()) : dc::holdings::replicated(s.lay));
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) {
    for (std::uint32_t r = 0; r < 4; ++r)
      if (s.lay.layer_of(t) == r / 2) s.src[r].of_tensor[t] = {dc::part::whole()};
    if (two_stages) s.dst[s.lay.layer_of(t)].of_tensor[t] = {dc::part::whole()};
  }
  return s;
}

/// A random partition of a tensor into `k` parts: whole, flat cuts, or boxes along one
/// dimension; each rank's parts stored densely one after the other.
inline std::vector<std::vector<dc::part>> random_partition(const dc::tensor_desc& d, std::uint32_t k,
                                                           const std::function<std::uint64_t(std::uint64_t)>& pick) {
  std::vector<std::vector<dc::part>> out(k);
  const std::uint64_t elems = d.bytes / dc::dtype_size(d.type);
  switch (pick(3)) {
    case 0: out[pick(k)].push_back(dc::part::whole()); break;
    case 1: {
      std::vector<std::uint64_t> cut{0, elems};
      for (std::uint32_t i = 1; i < k; ++i) cut.push_back(pick(elems + 1));
      std::sort(cut.begin(), cut.end());
      for (std::uint32_t i = 0; i + 1 < cut.size(); ++i) out[pick(k)].push_back(dc::part::flat(cut[i], cut[i + 1]));
      break;
    }
    default: {
      dims_t dims;
      for (auto x : d.shape) dims.push_back(static_cast<std::uint64_t>(x));
      const auto dim = pick(dims.size());
      for (std::uint64_t b = 0; b < dims[dim];) {
        const auto len = 1 + pick(dims[dim] - b);
        dims_t start(dims.size(), 0), count = dims;
        start[dim] = b;
        count[dim] = len;
        out[pick(k)].push_back(dc::part::box(start, count));
        b += len;
      }
    }
  }
  for (auto& parts : out) {
    std::uint64_t at = 0;
    for (auto& p : parts) {
      p.local_offset = at;
      at += brute_map(d, {p}).size();
    }
  }
  return out;
}

/// A randomised layout (1 to 4 tensors of rank 1 to 3 over two layers) with random holdings
/// on both sides: `replicas` groups of sources each partitioning every tensor among its
/// members (whole, flat cuts or boxes along one dimension), clone ranks likewise or whole.
/// `pick(n)` returns a value in [0, n) (0 for n = 0).
inline scenario random_scenario(const std::function<std::uint64_t(std::uint64_t)>& pick) {
  scenario s;
  const auto tensors = 1 + pick(4);
  std::vector<dc::tensor_desc> ts;
  for (std::uint64_t i = 0; i < tensors; ++i) {
    dims_t dims;
    for (auto r = 1 + pick(3); r-- > 0;) dims.push_back(1 + pick(9));
    ts.push_back(tensor("t" + std::to_string(i), dims, pick(2) ? dc::dtype::f32 : dc::dtype::f16));
  }
  s.lay.add_layer({"a", {ts.begin(), ts.begin() + static_cast<std::ptrdiff_t>((tensors + 1) / 2)}});
  s.lay.add_layer({"b", {ts.begin() + static_cast<std::ptrdiff_t>((tensors + 1) / 2), ts.end()}});
  const auto n = static_cast<std::uint32_t>(1 + pick(4)), m = static_cast<std::uint32_t>(1 + pick(3));
  const auto replicas = static_cast<std::uint32_t>(1 + pick(n));
  s.src.assign(n, dc::holdings(s.lay.tensor_count()));
  s.dst.assign(m, dc::holdings(s.lay.tensor_count()));
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) {
    for (std::uint32_t g = 0; g < replicas; ++g) {
      std::vector<std::uint32_t> members;
      for (std::uint32_t r = g; r < n; r += replicas) members.push_back(r);
      auto parts = random_partition(s.lay.tensor(t), static_cast<std::uint32_t>(members.size()), pick);
      for (std::size_t i = 0; i < members.size(); ++i) s.src[members[i]].of_tensor[t] = parts[i];
    }
    auto wants = random_partition(s.lay.tensor(t), m, pick);
    for (std::uint32_t c = 0; c < m; ++c) s.dst[c].of_tensor[t] = pick(4) ? wants[c] : std::vector<dc::part>{dc::part::whole()};
  }
  return s;
}

/// One rank's own tensors, each byte the hash of (tensor, global byte) where the rank holds
/// it (sources), or a sentinel (clone ranks, before any byte arrives).
inline std::vector<std::vector<std::byte>> own_tensors(const dc::layout& lay, const dc::holdings& h, bool fill) {
  std::vector<std::vector<std::byte>> out(lay.tensor_count());
  for (std::uint32_t t = 0; t < lay.tensor_count(); ++t) {
    const auto m = brute_map(lay.tensor(t), h.of_tensor[t]);
    out[t].assign(m.size(), std::byte{0xEE});
    if (fill)
      for (const auto& [g, local] : m) out[t][local] = std::byte(static_cast<std::uint8_t>(g * 31 + t * 7 + 1));
  }
  return out;
}
template <class Byte>
std::vector<std::span<Byte>> spans(std::vector<std::vector<std::byte>>& ts) {
  std::vector<std::span<Byte>> out;
  for (auto& t : ts) out.emplace_back(t.data(), t.size());
  return out;
}

/// Whether every byte clone rank `c` wants holds the source pattern of its global position.
inline bool holds_pattern(const scenario& s, std::size_t c, const std::vector<std::vector<std::byte>>& own, std::uint32_t t) {
  for (const auto& [g, local] : brute_map(s.lay.tensor(t), s.dst[c].of_tensor[t]))
    if (own[t][local] != std::byte(static_cast<std::uint8_t>(g * 31 + t * 7 + 1))) return false;
  return true;
}

}  // namespace partition_test
