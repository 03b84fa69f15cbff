// libFuzzer harness: layouts derived from arbitrary bytes, N and M from the bytes, into
// make_plan with every sharding x reconstruction policy; checks that every byte of every
// tensor is covered exactly once, that pieces stay inside their tensor and layer, and
// that every clone rank receives every byte exactly once (from a source or a forward).
#include <deepclone/deepclone.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dc = deepclone;

namespace {
struct bytes_in {
  const std::uint8_t* p;
  std::size_t n;
  std::uint64_t take(int k) {
    std::uint64_t v = 0;
    for (int i = 0; i < k; ++i) {
      v = (v << 8) | (n ? *p : 0);
      if (n) ++p, --n;
    }
    return v;
  }
};

void check(const dc::plan& p, const dc::layout& lay, std::uint32_t m) {
  // Exactly-once coverage of each tensor by the pieces.
  std::vector<std::uint64_t> covered(lay.tensor_count(), 0);
  for (auto& q : p.pieces()) {
    if (q.tensor >= lay.tensor_count() || q.length == 0 || q.offset + q.length > lay.tensor(q.tensor).bytes ||
        q.layer != lay.layer_of(q.tensor))
      __builtin_trap();
    covered[q.tensor] += q.length;
  }
  for (std::size_t t = 0; t < lay.tensor_count(); ++t)
    if (covered[t] != lay.tensor(t).bytes) __builtin_trap();
  // Every clone rank receives each piece exactly once.
  for (std::uint32_t c = 0; c < m; ++c) {
    std::vector<int> got(p.pieces().size(), 0);
    for (auto g : p.received_by_clone(c))
      for (auto pi : p.groups()[g].pieces) ++got[pi];
    for (int x : got)
      if (x != 1) __builtin_trap();
  }
}

template <class Shard, class Recon>
void one(const dc::layout& lay, std::uint32_t n, std::uint32_t m, Shard s, Recon r, dc::plan_options o) {
  try {
    check(dc::make_plan(lay, n, m, s, r, o, 1), lay, m);
  } catch (const dc::error&) {
    // only invalid arguments may be refused
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  bytes_in in{data, size};
  const auto n = static_cast<std::uint32_t>(in.take(1) % 9 + 1);
  const auto m = static_cast<std::uint32_t>(in.take(1) % 7 + 1);
  dc::plan_options o;
  o.alignment = std::uint64_t{1} << (in.take(1) % 10);                // 1 .. 512
  o.max_piece_bytes = in.take(3) % (1u << 20) + 1;                     // 1 B .. 1 MiB
  const std::uint64_t threshold = in.take(3) % (1u << 21);
  const std::uint64_t rthreshold = in.take(3) % (1u << 21);
  dc::layout lay;
  const int layers = static_cast<int>(in.take(1) % 6);
  std::uint64_t total = 0;
  for (int l = 0; l < layers; ++l) {
    dc::layer_desc d{"l" + std::to_string(l), {}};
    const int tensors = static_cast<int>(in.take(1) % 5);
    for (int t = 0; t < tensors; ++t) {
      dc::tensor_desc td;
      td.name = "t" + std::to_string(t);
      td.type = static_cast<dc::dtype>(in.take(1) % (static_cast<int>(dc::dtype::bytes) + 1));
      const auto e = dc::dtype_size(td.type);
      td.bytes = in.take(3) % (1u << 22) / e * e;  // whole elements, up to 4 MiB
      total += td.bytes;
      d.tensors.push_back(td);
    }
    lay.add_layer(d);
  }
  if (total > (64u << 20) || o.max_piece_bytes * 4096 < total) return 0;  // keep each run cheap
  using namespace dc;
  one(lay, n, m, shard::split_even{threshold}, reconstruct::direct{}, o);
  one(lay, n, m, shard::split_even{threshold}, reconstruct::scatter_exchange{rthreshold}, o);
  one(lay, n, m, shard::whole_tensor{}, reconstruct::direct{}, o);
  one(lay, n, m, shard::whole_tensor{}, reconstruct::scatter_exchange{rthreshold}, o);
  one(lay, n, m, shard::layer_round_robin{}, reconstruct::scatter_exchange{rthreshold}, o);
  one(lay, n, m, shard::single_root{}, reconstruct::direct{}, o);
  return 0;
}
