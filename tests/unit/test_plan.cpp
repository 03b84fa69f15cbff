// Unit tests of the plan (sharding x reconstruction policies), the layout, split_range and
// granule, the metadata encoding and the mix64 checksum. Pure functions: no threads here.
#include <doctest/doctest.h>

#include <deepclone/checksum.hpp>
#include <deepclone/error.hpp>
#include <deepclone/layout.hpp>
#include <deepclone/metadata.hpp>
#include <deepclone/plan.hpp>
#include <deepclone/reconstruct.hpp>
#include <deepclone/shard.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../support/models.hpp"
#include "../support/policies.hpp"  // tests/support is not on the include path (see report)

namespace dc = deepclone;

namespace {

constexpr std::uint32_t source_counts[] = {1, 2, 3, 4, 7};
constexpr std::uint32_t clone_counts[] = {1, 2, 3};

template <class S, class R>
struct combo {
  using shard = S;
  using recon = R;
};

// ---------------------------------------------------------------------------------------
// Random layouts: zero-byte tensors, odd sizes, every dtype, empty layers.

dc::layout random_layout(std::mt19937_64& rng, std::uint64_t max_elems = 20000) {
  auto pick = [&](std::uint64_t lo, std::uint64_t hi) { return std::uniform_int_distribution<std::uint64_t>(lo, hi)(rng); };
  std::vector<dc::layer_desc> layers;
  const auto nl = pick(0, 7);
  for (std::uint64_t l = 0; l < nl; ++l) {
    dc::layer_desc layer{"layer" + std::to_string(l), {}};
    const auto nt = pick(0, 3) == 0 ? 0 : pick(1, 5);  // about one layer in four is empty
    for (std::uint64_t t = 0; t < nt; ++t) {
      auto type = static_cast<dc::dtype>(pick(0, static_cast<std::uint64_t>(dc::dtype::bytes)));
      std::uint64_t count = 0;
      switch (pick(0, 9)) {
        case 0: count = 0; break;
        case 1: case 2: case 3: count = pick(1, 16); break;
        case 4: case 5: case 6: case 7: count = pick(17, 3000); break;
        default: count = pick(3001, max_elems); break;
      }
      std::vector<std::int64_t> shape{static_cast<std::int64_t>(count)};
      if (count % 3 == 0 && count) shape = {3, static_cast<std::int64_t>(count / 3)};
      layer.tensors.push_back({"t" + std::to_string(t), count * dc::dtype_size(type), type, shape});
    }
    layers.push_back(std::move(layer));
  }
  return dc::layout(std::move(layers));
}

// ---------------------------------------------------------------------------------------
// The checks every plan must pass.

struct piece_ref {
  std::uint32_t tensor;
  std::uint64_t offset, length;
  bool operator<(const piece_ref& o) const { return std::tie(tensor, offset) < std::tie(o.tensor, o.offset); }
};

/// Every byte of every tensor exactly once in `refs` (interval form).
void check_exactly_once(const dc::layout& lay, std::vector<piece_ref> refs, const std::string& who) {
  std::sort(refs.begin(), refs.end());
  std::size_t i = 0;
  for (std::uint32_t t = 0; t < lay.tensor_count(); ++t) {
    std::uint64_t at = 0;
    for (; i < refs.size() && refs[i].tensor == t; ++i) {
      if (refs[i].offset != at) {
        FAIL_CHECK(who << ": tensor " << t << " ('" << lay.tensor(t).name << "'): piece at " << refs[i].offset
                       << ", expected " << at << (refs[i].offset < at ? " (overlap)" : " (gap)"));
        return;
      }
      at += refs[i].length;
    }
    if (at != lay.tensor(t).bytes) {
      FAIL_CHECK(who << ": tensor " << t << " covered up to byte " << at << " of " << lay.tensor(t).bytes);
      return;
    }
  }
  if (i != refs.size()) FAIL_CHECK(who << ": pieces name tensors outside the layout");
}

/// The same, byte by byte: a counter per byte.
void check_exactly_once_bytes(const dc::layout& lay, const std::vector<piece_ref>& refs, const std::string& who) {
  std::vector<std::vector<std::uint8_t>> seen(lay.tensor_count());
  for (std::uint32_t t = 0; t < lay.tensor_count(); ++t) seen[t].assign(lay.tensor(t).bytes, 0);
  for (auto& r : refs) {
    if (r.tensor >= lay.tensor_count() || r.offset + r.length > lay.tensor(r.tensor).bytes) {
      FAIL_CHECK(who << ": piece outside its tensor");
      return;
    }
    for (std::uint64_t b = r.offset; b < r.offset + r.length; ++b) ++seen[r.tensor][b];
  }
  for (std::uint32_t t = 0; t < lay.tensor_count(); ++t) {
    auto bad = std::find_if(seen[t].begin(), seen[t].end(), [](std::uint8_t c) { return c != 1; });
    if (bad != seen[t].end()) {
      FAIL_CHECK(who << ": byte " << (bad - seen[t].begin()) << " of tensor " << t << " received " << int(*bad)
                     << " times");
      return;
    }
  }
}

template <class Shard>
void check_load_bound(const dc::plan& p, const dc::layout& lay, std::uint32_t n, const Shard& shard,
                      const dc::plan_options& opt) {
  const std::uint64_t S = lay.total_bytes();
  std::uint64_t max_load = 0, sum = 0;
  for (std::uint32_t s = 0; s < n; ++s) {
    max_load = std::max(max_load, p.bytes_of_source(s));
    sum += p.bytes_of_source(s);
  }
  CHECK(sum == S);
  const double mean = static_cast<double>(S) / n;
  if constexpr (std::is_same_v<Shard, dc::shard::split_even>) {
    std::uint64_t largest_unsplit = 0, max_granule = 0;
    for (std::uint32_t t = 0; t < lay.tensor_count(); ++t) {
      auto& d = lay.tensor(t);
      if (d.bytes == 0) continue;
      if (d.bytes < shard.threshold || n == 1) largest_unsplit = std::max(largest_unsplit, d.bytes);
      else max_granule = std::max(max_granule, dc::granule(d, opt.alignment));
    }
    CHECK_MESSAGE(static_cast<double>(max_load) <= mean + static_cast<double>(largest_unsplit + max_granule),
                  "split_even: max source load " << max_load << " > S/N " << mean << " + largest unsplit "
                                                 << largest_unsplit << " + granule " << max_granule << " (N=" << n
                                                 << ", threshold " << shard.threshold << ")");
  } else if constexpr (std::is_same_v<Shard, dc::shard::whole_tensor>) {
    std::uint64_t largest = 0;
    for (std::uint32_t t = 0; t < lay.tensor_count(); ++t) largest = std::max(largest, lay.tensor(t).bytes);
    CHECK_MESSAGE(static_cast<double>(max_load) <= mean + static_cast<double>(largest),
                  "whole_tensor: max load " << max_load << " > S/N " << mean << " + largest " << largest);
  } else if constexpr (std::is_same_v<Shard, dc::shard::layer_round_robin>) {
    std::vector<std::uint64_t> layers;
    for (std::size_t l = 0; l < lay.layer_count(); ++l) layers.push_back(lay.layer_bytes(l));
    std::sort(layers.rbegin(), layers.rend());
    const std::size_t take = (lay.layer_count() + n - 1) / n;
    const std::uint64_t bound = std::accumulate(layers.begin(), layers.begin() + static_cast<long>(take), std::uint64_t{0});
    CHECK_MESSAGE(max_load <= bound, "layer_round_robin: max load " << max_load << " > " << bound);
    // and the layers really go round-robin
    CHECK(std::all_of(p.pieces().begin(), p.pieces().end(), [&](auto& q) { return q.source == q.layer % n; }));
  } else {
    static_assert(std::is_same_v<Shard, dc::shard::single_root>);
    for (std::uint32_t s = 0; s < n; ++s) CHECK(p.bytes_of_source(s) == (s == shard.root ? S : 0));
  }
}

/// The built-in policy whose owners forward every piece they own (flat, owner -> all).
template <class Recon>
constexpr bool owner_forwards = std::is_same_v<Recon, dc::reconstruct::scatter_exchange>;

template <class Shard, class Recon>
void check_plan(const dc::plan& p, const dc::layout& lay, std::uint32_t n, std::uint32_t m, const Shard& shard,
                const Recon& recon, const dc::plan_options& opt, bool byte_level) {
  INFO("N=" << n << " M=" << m << " " << std::string(Shard::name) << "/" << std::string(Recon::name) << " alignment " << opt.alignment
            << " max_piece " << opt.max_piece_bytes << " tensors " << lay.tensor_count() << " S=" << lay.total_bytes());
  const std::uint64_t S = lay.total_bytes();
  // The key names everything the plan depends on.
  CHECK(p.key().sources == n);
  CHECK(p.key().clones == m);
  CHECK(p.key().shard_id == Shard::id);
  CHECK(p.key().shard_param == shard.param());
  CHECK(p.key().reconstruct_id == Recon::id);
  CHECK(p.key().reconstruct_param == recon.param());
  CHECK(p.key().alignment == opt.alignment);
  CHECK(p.key().max_piece_bytes == opt.max_piece_bytes);
  CHECK(p.layout() == lay);

  // Pieces: in range, aligned, bounded, each byte once over all pieces.
  std::vector<piece_ref> all;
  bool pieces_ok = true;
  for (auto& q : p.pieces()) {
    if (q.tensor >= lay.tensor_count()) {
      FAIL_CHECK("piece names tensor " << q.tensor);
      pieces_ok = false;
      continue;
    }
    auto& d = lay.tensor(q.tensor);
    const std::uint64_t g = dc::granule(d, opt.alignment);
    const std::uint64_t end = q.offset + q.length;
    const std::uint64_t align = opt.alignment ? opt.alignment : 1;
    bool ok = q.length > 0 && end <= d.bytes && q.layer == lay.layer_of(q.tensor) && q.source < n &&
              q.offset % dc::dtype_size(d.type) == 0 && q.offset % align == 0 && q.offset % g == 0 &&
              (end == d.bytes || (end % dc::dtype_size(d.type) == 0 && end % align == 0)) &&
              q.length <= std::max(opt.max_piece_bytes, g) &&
              (owner_forwards<Recon> ? q.owner < m : q.owner == dc::piece::all_clones);
    if (!ok) {
      FAIL_CHECK("bad piece: tensor " << q.tensor << " (" << dc::dtype_name(d.type) << ", " << d.bytes << " B) ["
                                      << q.offset << ", " << end << ") layer " << q.layer << " source " << q.source
                                      << " owner " << q.owner << " granule " << g);
      pieces_ok = false;
    }
    all.push_back({q.tensor, q.offset, q.length});
  }
  if (!pieces_ok) return;
  check_exactly_once(lay, all, "all pieces");

  // Groups: consistent with their pieces; one per (layer, kind, sender, receiver); wire order.
  // (Checked with plain conditions and one FAIL_CHECK per bad group: plans have many groups.)
  std::set<std::tuple<std::uint32_t, bool, std::uint32_t, std::uint32_t>> keys;
  for (std::uint32_t gi = 0; gi < p.groups().size(); ++gi) {
    auto& g = p.groups()[gi];
    std::string why;
    if (!keys.insert({g.layer, g.exchange, g.from, g.to}).second) why += " duplicate (layer, kind, from, to);";
    if (g.to >= m) why += " receiver out of range;";
    if (g.exchange ? (g.from >= m || g.from == g.to || !owner_forwards<Recon>) : g.from >= n) why += " bad sender;";
    if (g.pieces.empty()) why += " no pieces;";
    if (!std::is_sorted(g.pieces.begin(), g.pieces.end()) ||
        std::adjacent_find(g.pieces.begin(), g.pieces.end()) != g.pieces.end())
      why += " pieces not in increasing (wire) order;";
    std::uint64_t bytes = 0;
    for (auto pi : g.pieces) {
      if (pi >= p.pieces().size()) {
        why += " piece index out of range;";
        break;
      }
      auto& q = p.pieces()[pi];
      bytes += q.length;
      if (q.layer != g.layer) why += " piece of another layer;";
      if (g.exchange && q.owner != g.from) why += " forwarded by a clone rank that does not own it;";
      if (!g.exchange && (q.source != g.from || (q.owner != dc::piece::all_clones && q.owner != g.to)))
        why += " piece from another source or for another owner;";
    }
    if (g.bytes != bytes) why += " byte count differs from its pieces;";
    if (!why.empty())
      FAIL_CHECK("group " << gi << " (layer " << g.layer << (g.exchange ? " exchange " : " ") << g.from << " -> "
                          << g.to << "):" << why);
  }

  // The per-rank views list exactly the right groups (each once).
  std::map<std::pair<std::uint32_t, std::size_t>, std::multiset<std::uint32_t>> sent_want, sent_got, fwd_want, fwd_got;
  std::vector<std::multiset<std::uint32_t>> recv_want(m), recv_got(m);
  for (std::uint32_t gi = 0; gi < p.groups().size(); ++gi) {
    auto& g = p.groups()[gi];
    (g.exchange ? fwd_want : sent_want)[{g.from, g.layer}].insert(gi);
    if (g.to < m) recv_want[g.to].insert(gi);
  }
  for (std::uint32_t s = 0; s < n; ++s)
    for (std::size_t l = 0; l < lay.layer_count(); ++l)
      for (auto gi : p.sent_by_source(s, l)) sent_got[{s, l}].insert(gi);
  for (std::uint32_t c = 0; c < m; ++c) {
    for (std::size_t l = 0; l < lay.layer_count(); ++l)
      for (auto gi : p.forwarded_by_clone(c, l)) fwd_got[{c, l}].insert(gi);
    for (auto gi : p.received_by_clone(c)) recv_got[c].insert(gi);
  }
  CHECK(sent_want == sent_got);
  CHECK(fwd_want == fwd_got);
  CHECK(recv_want == recv_got);

  std::uint64_t from_sources_total = 0;
  for (std::uint32_t c = 0; c < m; ++c) {
    // Each byte reaches clone c exactly once, from sources and clone ranks together.
    std::vector<piece_ref> mine;
    std::set<std::uint32_t> from_a_source;  // pieces c receives straight from a source
    for (auto gi : p.received_by_clone(c)) {
      auto& g = p.groups()[gi];
      for (auto pi : g.pieces) {
        auto& q = p.pieces()[pi];
        mine.push_back({q.tensor, q.offset, q.length});
        if (!g.exchange) from_a_source.insert(pi);
      }
    }
    check_exactly_once(lay, mine, "clone " + std::to_string(c));
    if (byte_level) check_exactly_once_bytes(lay, mine, "clone " + std::to_string(c));

    // A clone forwards only pieces it received from a source.
    for (std::size_t l = 0; l < lay.layer_count(); ++l) {
      auto fwd = p.forwarded_by_clone(c, l);
      if (!owner_forwards<Recon>) CHECK(fwd.empty());
      for (auto gi : fwd) {
        auto& g = p.groups()[gi];
        CHECK(g.exchange);
        CHECK(g.from == c);
        CHECK(g.layer == l);
        for (auto pi : g.pieces)
          if (from_a_source.count(pi) != 1) FAIL_CHECK("clone " << c << " forwards piece " << pi << " it did not get from a source");
      }
    }
    const auto from_src = p.bytes_received_by_clone(c, false), from_cl = p.bytes_received_by_clone(c, true);
    CHECK(from_src + from_cl == S);
    if (!owner_forwards<Recon>) CHECK(from_cl == 0);
    from_sources_total += from_src;
  }
  // Bytes leaving the sources: every byte once per clone rank (direct), or once (scatter).
  std::uint64_t sent = 0;
  for (std::uint32_t s = 0; s < n; ++s) {
    sent += p.bytes_sent_by_source(s);
    if (!owner_forwards<Recon>) CHECK(p.bytes_sent_by_source(s) == p.bytes_of_source(s) * m);
  }
  CHECK(sent == from_sources_total);
  CHECK(sent == (owner_forwards<Recon> ? S : S * m));

  check_load_bound(p, lay, n, shard, opt);
}

bool same_plan(const dc::plan& a, const dc::plan& b) {
  if (!(a.pieces() == b.pieces()) || !(a.key() == b.key()) || a.groups().size() != b.groups().size()) return false;
  for (std::size_t i = 0; i < a.groups().size(); ++i) {
    auto& x = a.groups()[i];
    auto& y = b.groups()[i];
    if (x.layer != y.layer || x.from != y.from || x.to != y.to || x.exchange != y.exchange || x.pieces != y.pieces ||
        x.bytes != y.bytes)
      return false;
  }
  return true;
}

template <class Shard>
Shard random_shard(std::mt19937_64& rng, std::uint32_t n) {
  Shard s{};
  if constexpr (std::is_same_v<Shard, dc::shard::split_even>) {
    constexpr std::uint64_t thresholds[] = {0, 1, 100, 4096, 30000, 1u << 20};
    s.threshold = thresholds[rng() % std::size(thresholds)];
  } else if constexpr (std::is_same_v<Shard, dc::shard::single_root>) {
    s.root = static_cast<std::uint32_t>(rng() % n);
  }
  return s;
}
template <class Recon>
Recon random_recon(std::mt19937_64& rng) {
  Recon r{};
  if constexpr (std::is_same_v<Recon, dc::reconstruct::scatter_exchange>) {
    constexpr std::uint64_t thresholds[] = {0, 1, 100, 4096, 1u << 20};
    r.threshold = thresholds[rng() % std::size(thresholds)];
  }
  return r;
}

}  // namespace

#define PLAN_COMBOS                                                                                            \
  combo<dc::shard::split_even, dc::reconstruct::direct>, combo<dc::shard::split_even, dc::reconstruct::scatter_exchange>, \
      combo<dc::shard::whole_tensor, dc::reconstruct::direct>,                                                 \
      combo<dc::shard::whole_tensor, dc::reconstruct::scatter_exchange>,                                       \
      combo<dc::shard::layer_round_robin, dc::reconstruct::direct>,                                            \
      combo<dc::shard::layer_round_robin, dc::reconstruct::scatter_exchange>,                                  \
      combo<dc::shard::single_root, dc::reconstruct::direct>,                                                  \
      combo<dc::shard::single_root, dc::reconstruct::scatter_exchange>

TEST_CASE_TEMPLATE("plan: model layouts, every byte reaches every clone rank exactly once, within the load bound", C,
                   PLAN_COMBOS) {
  using Shard = typename C::shard;
  using Recon = typename C::recon;
  for (auto& name : dc::testing::model_names())
    for (auto opt : {dc::testing::optimizer::none, dc::testing::optimizer::momentum, dc::testing::optimizer::adam}) {
      const auto lay = dc::testing::load_model(DEEPCLONE_MODELS_DIR, name, opt);
      REQUIRE(lay.tensor_count() > 0);
      INFO("model " << name << " optimizer " << static_cast<int>(opt));
      for (auto n : source_counts)
        for (auto m : clone_counts) {
          Shard shard{};
          if constexpr (std::is_same_v<Shard, dc::shard::single_root>) shard.root = n - 1;
          Recon recon{};
          dc::plan_options o{};
          auto p = dc::make_plan(lay, n, m, shard, recon, o);
          check_plan(p, lay, n, m, shard, recon, o, false);
        }
    }
}

TEST_CASE_TEMPLATE("plan: random layouts, every byte reaches every clone rank exactly once, within the load bound", C,
                   PLAN_COMBOS) {
  using Shard = typename C::shard;
  using Recon = typename C::recon;
  std::mt19937_64 rng(0xDEC10E + Shard::id * 16 + Recon::id);
  constexpr std::uint64_t alignments[] = {0, 1, 4, 48, 256};
  constexpr std::uint64_t max_pieces[] = {64ull << 20, 100000, 4096, 1000, 256, 7};
  for (int round = 0; round < 25; ++round) {
    const auto lay = random_layout(rng);
    for (auto n : source_counts)
      for (auto m : clone_counts) {
        dc::plan_options o;
        o.alignment = alignments[rng() % std::size(alignments)];
        o.max_piece_bytes = max_pieces[rng() % std::size(max_pieces)];
        auto shard = random_shard<Shard>(rng, n);
        auto recon = random_recon<Recon>(rng);
        INFO("round " << round);
        auto p = dc::make_plan(lay, n, m, shard, recon, o);
        check_plan(p, lay, n, m, shard, recon, o, lay.total_bytes() <= (256u << 10));
      }
  }
}

TEST_CASE_TEMPLATE("plan: deterministic (same inputs give identical pieces and groups)", C, PLAN_COMBOS) {
  using Shard = typename C::shard;
  using Recon = typename C::recon;
  std::mt19937_64 rng(77 + Shard::id * 16 + Recon::id);
  for (int round = 0; round < 10; ++round) {
    const auto lay = random_layout(rng);
    const auto copy = dc::layout(lay.layers());  // an equal layout built separately
    for (auto n : source_counts)
      for (auto m : clone_counts) {
        auto shard = random_shard<Shard>(rng, n);
        auto recon = random_recon<Recon>(rng);
        dc::plan_options o{256, 4096};
        auto a = dc::make_plan(lay, n, m, shard, recon, o);
        auto b = dc::make_plan(copy, n, m, shard, recon, o);
        CHECK(same_plan(a, b));
      }
  }
  const auto vgg = dc::testing::load_model(DEEPCLONE_MODELS_DIR, "vgg16", dc::testing::optimizer::momentum);
  auto a = dc::make_plan(vgg, 3, 2, Shard{}, Recon{});
  auto b = dc::make_plan(vgg, 3, 2, Shard{}, Recon{});
  CHECK(same_plan(a, b));
  // and the comparison itself can tell plans apart
  auto c = dc::make_plan(vgg, 3, 3, Shard{}, Recon{});
  CHECK_FALSE(same_plan(a, c));
}

TEST_CASE("plan: max_piece_bytes cuts large pieces at granule boundaries") {
  dc::layout lay({{"big", {{"w", 10'000'000, dc::dtype::f32, {2'500'000}}, {"odd", 1'000'003, dc::dtype::u8, {1'000'003}}}}});
  for (std::uint64_t max_piece : {1ull << 20, 1'000'000ull, 4096ull, 300ull}) {
    dc::plan_options o{256, max_piece};
    auto p = dc::make_plan(lay, 2, 2, dc::shard::split_even{}, dc::reconstruct::direct{}, o);
    INFO("max_piece_bytes " << max_piece);
    std::uint64_t largest = 0;
    for (auto& q : p.pieces()) {
      largest = std::max(largest, q.length);
      CHECK(q.length <= max_piece);
      CHECK(q.offset % 256 == 0);
    }
    CHECK(largest > max_piece / 2);  // not cut needlessly small
    check_plan(p, lay, 2, 2, dc::shard::split_even{}, dc::reconstruct::direct{}, o, false);
  }
  // A limit below one granule yields pieces of exactly one granule (a piece never cuts a granule).
  dc::plan_options tiny{256, 100};
  auto p = dc::make_plan(lay, 1, 1, dc::shard::whole_tensor{}, dc::reconstruct::direct{}, tiny);
  for (auto& q : p.pieces()) CHECK((q.length == 256 || q.offset + q.length == lay.tensor(q.tensor).bytes));
}

TEST_CASE("plan: split_even splits tensors at the threshold, whole below it") {
  dc::layout lay({{"l0", {{"big", 4096, dc::dtype::f32, {1024}}, {"small", 4092, dc::dtype::f32, {1023}}}}});
  dc::shard::split_even s;
  s.threshold = 4096;
  auto p = dc::make_plan(lay, 4, 1, s, dc::reconstruct::direct{}, {256, 1 << 20});
  std::map<std::uint32_t, std::set<std::uint32_t>> sources_of;
  for (auto& q : p.pieces()) sources_of[q.tensor].insert(q.source);
  CHECK(sources_of[0].size() == 4);  // 4096 B = 16 granules over 4 sources
  CHECK(sources_of[1].size() == 1);  // below the threshold: whole
}

TEST_CASE("plan: scatter_exchange gives every clone rank a share when pieces are large") {
  dc::layout lay({{"l0", {{"w", 8 << 20, dc::dtype::f32, {2 << 20}}}}});
  auto p = dc::make_plan(lay, 2, 3, dc::shard::split_even{}, dc::reconstruct::scatter_exchange{});
  for (std::uint32_t c = 0; c < 3; ++c) {
    CHECK(p.bytes_received_by_clone(c, false) > 0);
    CHECK(p.bytes_received_by_clone(c, true) > 0);
    CHECK(!p.forwarded_by_clone(c, 0).empty());
  }
}

TEST_CASE("plan: empty layouts and zero-byte tensors make empty plans") {
  for (auto& lay : {dc::layout{}, dc::layout(std::vector<dc::layer_desc>{{"empty", {}}}),
                    dc::layout({{"zeros", {{"a", 0, dc::dtype::f32, {0}}, {"b", 0, dc::dtype::c128, {0, 5}}}}, {"none", {}}})}) {
    auto p = dc::make_plan(lay, 3, 2, dc::shard::split_even{}, dc::reconstruct::scatter_exchange{});
    CHECK(p.pieces().empty());
    CHECK(p.groups().empty());
    for (std::uint32_t c = 0; c < 2; ++c) CHECK(p.received_by_clone(c).empty());
    for (std::uint32_t s = 0; s < 3; ++s) CHECK(p.bytes_of_source(s) == 0);
  }
}

TEST_CASE("plan: invalid arguments") {
  const auto lay = dc::testing::load_model(DEEPCLONE_MODELS_DIR, "resnet50");
  auto code_of = [](auto&& f) -> std::optional<dc::errc> {
    try {
      f();
    } catch (const dc::error& e) {
      return e.kind();
    }
    return std::nullopt;
  };
  CHECK(code_of([&] { dc::make_plan(lay, 0, 1, dc::shard::split_even{}, dc::reconstruct::direct{}); }) ==
        dc::errc::invalid_argument);
  CHECK(code_of([&] { dc::make_plan(lay, 1, 0, dc::shard::split_even{}, dc::reconstruct::direct{}); }) ==
        dc::errc::invalid_argument);
  CHECK(code_of([&] { dc::make_plan(lay, 0, 0, dc::shard::whole_tensor{}, dc::reconstruct::scatter_exchange{}); }) ==
        dc::errc::invalid_argument);
  CHECK(code_of([&] { dc::make_plan(lay, 3, 1, dc::shard::single_root{3}, dc::reconstruct::direct{}); }) ==
        dc::errc::invalid_argument);
  CHECK(code_of([&] { dc::make_plan(lay, 3, 1, dc::shard::single_root{100}, dc::reconstruct::scatter_exchange{}); }) ==
        dc::errc::invalid_argument);
  CHECK(code_of([&] { dc::make_plan(lay, 3, 1, dc::shard::single_root{2}, dc::reconstruct::direct{}); }) == std::nullopt);
  CHECK(code_of([&] {
          dc::make_plan(lay, 2, 2, dc::shard::split_even{}, dc::reconstruct::direct{}, dc::plan_options{256, 0});
        }) == dc::errc::invalid_argument);
  // The error is a std::system_error whose code compares equal to the enum.
  try {
    dc::make_plan(lay, 0, 1, dc::shard::split_even{}, dc::reconstruct::direct{});
    FAIL("no exception");
  } catch (const std::system_error& e) {
    CHECK(e.code() == dc::errc::invalid_argument);
    CHECK(std::string(e.what()).find("N = 0") != std::string::npos);
  }
}

namespace {
/// A user-written reconstruction policy with a bug: each piece goes to one clone rank
/// (round robin) and nobody forwards it, so the other clone ranks would keep stale bytes.
struct owner_only {
  static constexpr std::uint32_t id = 90;
  static constexpr const char* name = "owner_only";
  std::uint64_t param() const { return 0; }
  std::vector<dc::piece> assign_owners(std::vector<dc::piece> pieces, const dc::layout&, std::uint32_t m, std::uint64_t) const {
    for (std::size_t i = 0; i < pieces.size(); ++i) pieces[i].owner = static_cast<std::uint32_t>(i % m);
    return pieces;
  }
  std::vector<dc::reconstruct::hop> forwards(std::uint32_t, std::uint32_t) const { return {}; }
};
}  // namespace

TEST_CASE("plan: a reconstruction that leaves a clone rank without some bytes is refused, naming rank and bytes") {
  const auto lay = dc::testing::load_model(DEEPCLONE_MODELS_DIR, "resnet50");
  // One clone rank: every piece reaches it, the plan is fine.
  CHECK_NOTHROW(dc::make_plan(lay, 2, 1, dc::shard::split_even{}, owner_only{}));
  try {
    dc::make_plan(lay, 2, 3, dc::shard::split_even{}, owner_only{});
    FAIL("a plan that leaves clone ranks stale was accepted");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::invalid_argument);
    const std::string what = e.what();
    CHECK_MESSAGE(what.find("owner_only") != std::string::npos, what);
    CHECK_MESSAGE(what.find("clone rank") != std::string::npos, what);
    CHECK_MESSAGE(what.find("never receives") != std::string::npos, what);
    CHECK_MESSAGE(what.find("bytes [") != std::string::npos, what);
  }
}

// User policies that break a piece's rules: the plan refuses them, naming the policy and
// the rule, instead of an engine indexing past its arrays or summing a layer in the wrong hook.
struct shard_layer_zero : dc::shard::split_even {  // every piece filed under layer 0
  static constexpr std::uint32_t id = 201;
  static constexpr const char* name = "shard_layer_zero";
  std::vector<dc::piece> assign(const dc::layout& l, std::uint32_t n, std::uint64_t a) const {
    auto out = split_even::assign(l, n, a);
    for (auto& q : out) q.layer = 0;
    return out;
  }
};
struct shard_extra_tensor : dc::shard::split_even {  // one more piece, of a tensor the layout lacks
  static constexpr std::uint32_t id = 202;
  static constexpr const char* name = "shard_extra_tensor";
  std::vector<dc::piece> assign(const dc::layout& l, std::uint32_t n, std::uint64_t a) const {
    auto out = split_even::assign(l, n, a);
    out.push_back({static_cast<std::uint32_t>(l.tensor_count()), 0, 0, 256, 0, dc::piece::all_clones});
    return out;
  }
};
struct owners_bad_source : dc::reconstruct::scatter_exchange {  // moves a piece to source N
  static constexpr std::uint32_t id = 203;
  static constexpr const char* name = "owners_bad_source";
  std::uint32_t sources = 0;
  std::vector<dc::piece> assign_owners(std::vector<dc::piece> p, const dc::layout& l, std::uint32_t m, std::uint64_t a) const {
    auto out = scatter_exchange::assign_owners(std::move(p), l, m, a);
    if (!out.empty()) out.back().source = sources;
    return out;
  }
};

template <class S, class R>
std::string plan_refusal(const dc::layout& lay, std::uint32_t n, std::uint32_t m, S s, R r) {
  try {
    dc::make_plan(lay, n, m, s, r);
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::invalid_argument);
    return e.what();
  }
  return "accepted";
}

TEST_CASE("plan: a piece filed under another layer, of a tensor beyond the layout or from a source beyond N is refused") {
  const auto lay = dc::testing::load_model(DEEPCLONE_MODELS_DIR, "resnet50");
  auto w = plan_refusal(lay, 2, 2, shard_layer_zero{}, dc::reconstruct::scatter_exchange{});
  CHECK_MESSAGE(w.find("shard_layer_zero") != std::string::npos, w);
  CHECK_MESSAGE(w.find("layer 0") != std::string::npos, w);
  CHECK_MESSAGE(w.find("belongs to layer") != std::string::npos, w);
  w = plan_refusal(lay, 2, 2, shard_extra_tensor{}, dc::reconstruct::scatter_exchange{});
  CHECK_MESSAGE(w.find("shard_extra_tensor") != std::string::npos, w);
  CHECK_MESSAGE(w.find("tensor " + std::to_string(lay.tensor_count())) != std::string::npos, w);
  owners_bad_source r;
  r.sources = 2;
  w = plan_refusal(lay, 2, 2, dc::shard::split_even{}, r);
  CHECK_MESSAGE(w.find("owners_bad_source") != std::string::npos, w);
  CHECK_MESSAGE(w.find("source 2 of 2") != std::string::npos, w);
}

TEST_CASE("plan: a user-written relay chain reaches every clone rank once, each forward awaiting what brought its pieces") {
  const auto lay = dc::testing::load_model(DEEPCLONE_MODELS_DIR, "resnet50");
  for (std::uint32_t m = 1; m <= 5; ++m) {
    CAPTURE(m);
    const auto p = dc::make_plan(lay, 3, m, dc::shard::split_even{}, dc::testing::relay_chain{});
    std::uint64_t from_sources = 0;
    for (std::uint32_t c = 0; c < m; ++c) {
      from_sources += p.bytes_received_by_clone(c, false);
      CHECK(p.bytes_received_by_clone(c, false) + p.bytes_received_by_clone(c, true) == lay.total_bytes());
    }
    CHECK(from_sources == lay.total_bytes());  // every byte leaves the sources once
    for (std::uint32_t gi = 0; gi < p.groups().size(); ++gi) {
      const auto& g = p.groups()[gi];
      if (!g.exchange) {
        CHECK(p.awaits(gi).empty());
        continue;
      }
      CHECK((g.to == g.from + 1 || g.to + 1 == g.from));  // neighbours only
      // It awaits exactly the groups clone g.from receives that hold its pieces.
      std::set<std::uint32_t> want;
      for (auto pi : g.pieces)
        for (auto r : p.received_by_clone(g.from)) {
          const auto& rg = p.groups()[r];
          if (std::find(rg.pieces.begin(), rg.pieces.end(), pi) != rg.pieces.end()) want.insert(r);
        }
      const auto a = p.awaits(gi);
      CHECK(std::set<std::uint32_t>(a.begin(), a.end()) == want);
      for (auto r : a) {
        const auto u = p.unblocks(r);
        CHECK(std::count(u.begin(), u.end(), gi) == 1);
      }
    }
  }
}

TEST_CASE("plan: forwards that wait on each other in a cycle are refused, naming the policy and the layer") {
  const auto lay = dc::testing::load_model(DEEPCLONE_MODELS_DIR, "resnet50");
  // Two clone ranks: the ring is one hop per piece, no cycle.
  CHECK_NOTHROW(dc::make_plan(lay, 2, 2, dc::shard::split_even{}, dc::testing::relay_ring{}));
  try {
    dc::make_plan(lay, 2, 3, dc::shard::split_even{}, dc::testing::relay_ring{});
    FAIL("a cyclic forwarding topology was accepted");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::invalid_argument);
    const std::string what = e.what();
    CHECK_MESSAGE(what.find("relay_ring") != std::string::npos, what);
    CHECK_MESSAGE(what.find("cycle") != std::string::npos, what);
    CHECK_MESSAGE(what.find("of layer") != std::string::npos, what);
  }
}

TEST_CASE("plan: a forward from a clone rank that does not hold the piece yet is refused") {
  const auto lay = dc::testing::load_model(DEEPCLONE_MODELS_DIR, "resnet50");
  CHECK_NOTHROW(dc::make_plan(lay, 2, 2, dc::shard::split_even{}, dc::testing::relay_out_of_order{}));
  try {
    dc::make_plan(lay, 2, 4, dc::shard::split_even{}, dc::testing::relay_out_of_order{});
    FAIL("a forward out of dependency order was accepted");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::invalid_argument);
    const std::string what = e.what();
    CHECK_MESSAGE(what.find("relay_out_of_order") != std::string::npos, what);
    CHECK_MESSAGE(what.find("does not hold the piece yet") != std::string::npos, what);
  }
}

// ---------------------------------------------------------------------------------------
// granule and split_range

TEST_CASE("granule: lcm of the alignment and the element size") {
  auto g = [](dc::dtype t, std::uint64_t a) { return dc::granule({"x", 0, t, {}}, a); };
  CHECK(g(dc::dtype::f32, 256) == 256);
  CHECK(g(dc::dtype::c128, 256) == 256);
  CHECK(g(dc::dtype::c128, 24) == 48);
  CHECK(g(dc::dtype::f16, 3) == 6);
  CHECK(g(dc::dtype::f64, 1) == 8);
  CHECK(g(dc::dtype::u8, 0) == 1);
  CHECK(g(dc::dtype::c64, 0) == 8);
  CHECK(g(dc::dtype::bytes, 256) == 256);
}

TEST_CASE("split_range: examples") {
  using R = std::vector<std::pair<std::uint64_t, std::uint64_t>>;
  CHECK(dc::split_range(0, 3, 1).empty());
  CHECK(dc::split_range(10, 0, 1).empty());
  CHECK(dc::split_range(10, 3, 1) == R{{0, 4}, {4, 3}, {7, 3}});
  CHECK(dc::split_range(10, 3, 1, 1) == R{{0, 3}, {3, 4}, {7, 3}});
  CHECK(dc::split_range(10, 3, 1, 2) == R{{0, 3}, {3, 3}, {6, 4}});
  CHECK(dc::split_range(10, 3, 1, 3) == dc::split_range(10, 3, 1, 0));
  CHECK(dc::split_range(10, 1, 4) == R{{0, 10}});
  CHECK(dc::split_range(10, 5, 4) == R{{0, 4}, {4, 4}, {8, 2}});  // only 3 granules: 3 ranges, last short
  CHECK(dc::split_range(1000, 2, 256) == R{{0, 512}, {512, 488}});
}

TEST_CASE("split_range: random properties") {
  std::mt19937_64 rng(12345);
  for (int i = 0; i < 20000; ++i) {
    const std::uint64_t bytes = rng() % 5000, parts = rng() % 12, g = 1 + rng() % 300, rotate = rng() % 50;
    auto r = dc::split_range(bytes, parts, g, rotate);
    INFO("bytes " << bytes << " parts " << parts << " g " << g << " rotate " << rotate);
    if (bytes == 0 || parts == 0) {
      CHECK(r.empty());
      continue;
    }
    const std::uint64_t granules = (bytes + g - 1) / g, n = std::min(parts, granules);
    REQUIRE(r.size() == n);
    std::uint64_t at = 0;
    for (std::uint64_t k = 0; k < n; ++k) {
      CHECK(r[k].first == at);
      CHECK(r[k].second > 0);
      CHECK(r[k].first % g == 0);
      at += r[k].second;
      // floor or ceil of granules/n, the ceil going to indices rotate, rotate+1, ... (mod n)
      const std::uint64_t base = granules / n, extra = granules % n;
      const bool gets_ceil = ((k + n - rotate % n) % n) < extra;
      const std::uint64_t want = (base + (gets_ceil ? 1 : 0)) * g;
      if (k + 1 < n) CHECK(r[k].second == want);
      else CHECK(r[k].second == std::min(want, bytes - r[k].first));
    }
    CHECK(at == bytes);
  }
}

// ---------------------------------------------------------------------------------------
// layout

namespace {
dc::layout sample_layout() {
  return dc::layout({{"fc1", {{"weight", 400, dc::dtype::f32, {10, 10}}, {"bias", 40, dc::dtype::f32, {10}}}},
                     {"bn", {{"running_mean", 80, dc::dtype::f64, {10}}, {"count", 8, dc::dtype::i64, {}}}},
                     {"empty", {}},
                     {"fc2", {{"weight", 20, dc::dtype::f16, {2, 5}}, {"bias", 0, dc::dtype::c128, {0}}}}});
}
}  // namespace

TEST_CASE("layout: fingerprint equal for equal layouts, different when anything differs") {
  const auto a = sample_layout();
  const auto b = sample_layout();
  CHECK(a == b);
  CHECK(a.fingerprint() == b.fingerprint());
  CHECK(a.tensor_count() == 6);
  CHECK(a.layer_count() == 4);
  CHECK(a.total_bytes() == 548);
  CHECK(a.first_tensor(3) == 4);
  CHECK(a.end_tensor(2) == 4);
  CHECK(a.layer_of(5) == 3);

  auto variant = [&](auto edit) {
    auto layers = a.layers();
    edit(layers);
    return dc::layout(std::move(layers));
  };
  std::vector<std::pair<std::string, dc::layout>> changed = {
      {"layer name", variant([](auto& l) { l[1].name = "bn2"; })},
      {"tensor name", variant([](auto& l) { l[0].tensors[1].name = "Bias"; })},
      {"size", variant([](auto& l) { l[0].tensors[0].bytes = 404; })},
      {"dtype", variant([](auto& l) { l[0].tensors[0].type = dc::dtype::i32; })},
      {"shape", variant([](auto& l) { l[0].tensors[0].shape = {100}; })},
      {"shape rank", variant([](auto& l) { l[1].tensors[1].shape = {1}; })},
      {"extra tensor", variant([](auto& l) { l[2].tensors.push_back({"x", 4, dc::dtype::f32, {1}}); })},
      {"missing tensor", variant([](auto& l) { l[3].tensors.pop_back(); })},
      {"missing layer", variant([](auto& l) { l.erase(l.begin() + 2); })},
      {"tensor moved to next layer", variant([](auto& l) {
         l[2].tensors.push_back(l[1].tensors.back());
         l[1].tensors.pop_back();
       })},
      {"order", variant([](auto& l) { std::swap(l[0].tensors[0], l[0].tensors[1]); })},
  };
  std::set<std::uint64_t> prints{a.fingerprint()};
  for (auto& [what, lay] : changed) {
    INFO(what);
    CHECK_FALSE(lay == a);
    CHECK(lay.fingerprint() != a.fingerprint());
    CHECK(prints.insert(lay.fingerprint()).second);
    CHECK(dc::first_difference(a, lay).has_value());
  }
  CHECK_FALSE(dc::first_difference(a, b).has_value());
}

TEST_CASE("layout: encode/decode round trip") {
  std::mt19937_64 rng(4242);
  std::vector<dc::layout> lays{dc::layout{}, sample_layout()};
  for (auto& name : dc::testing::model_names()) lays.push_back(dc::testing::load_model(DEEPCLONE_MODELS_DIR, name, dc::testing::optimizer::adam));
  for (int i = 0; i < 50; ++i) lays.push_back(random_layout(rng));
  for (auto& lay : lays) {
    auto bytes = lay.encode();
    auto back = dc::layout::decode(bytes);
    CHECK(back == lay);
    CHECK(back.fingerprint() == lay.fingerprint());
    CHECK(back.tensor_count() == lay.tensor_count());
    CHECK(back.total_bytes() == lay.total_bytes());
    CHECK(back.encode() == bytes);
  }
}

namespace {
/// Decodes `b`: either a corrupt_message error or a layout whose canonical encoding is `b`.
/// Any other outcome (another exception, a non-canonical success) fails the test.
/// `canonical`: the encoding has a single form (no maps), so a decoded value re-encodes to `b`;
/// otherwise re-encoding and decoding again must give the same value.
template <class Decode>
void decode_or_corrupt(Decode decode, const std::vector<std::byte>& b, int& corrupt, int& decoded,
                       bool canonical = true) {
  try {
    auto v = decode(b);
    if (canonical) CHECK(v.encode() == b);
    else CHECK(decode(v.encode()) == v);
    ++decoded;
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::corrupt_message);
    ++corrupt;
  } catch (const std::exception& e) {
    FAIL_CHECK("decode threw a non-deepclone exception: " << e.what());
  }
}
}  // namespace

TEST_CASE("layout: decoding truncated or garbage bytes throws corrupt_message, never crashes") {
  const auto good = sample_layout().encode();
  auto decode = [](const std::vector<std::byte>& b) { return dc::layout::decode(b); };
  // Every truncation.
  for (std::size_t n = 0; n < good.size(); ++n) {
    INFO("prefix of " << n << " bytes");
    CHECK_THROWS_AS(dc::layout::decode(std::span(good).first(n)), dc::error);
    try {
      dc::layout::decode(std::span(good).first(n));
    } catch (const dc::error& e) {
      CHECK(e.kind() == dc::errc::corrupt_message);
    }
  }
  // Trailing bytes.
  auto longer = good;
  longer.push_back(std::byte{0});
  try {
    dc::layout::decode(longer);
    FAIL("trailing byte accepted");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::corrupt_message);
  }
  // Huge counts and lengths.
  auto huge = good;
  for (int i = 0; i < 4; ++i) huge[static_cast<std::size_t>(i)] = std::byte{0xFF};  // layer count 2^32-1
  CHECK_THROWS_WITH_AS(dc::layout::decode(huge), doctest::Contains("layer count"), dc::error);
  huge = good;
  for (int i = 4; i < 12; ++i) huge[static_cast<std::size_t>(i)] = std::byte{0xFF};  // first name length 2^64-1
  CHECK_THROWS_AS(dc::layout::decode(huge), dc::error);
  // An unknown dtype value.
  dc::layout one({{"l", {{"t", 4, dc::dtype::f32, {1}}}}});
  auto bad_type = one.encode();
  // layout: u32 layers, str "l" (8+1), u32 tensors, str "t" (8+1), u64 bytes, u8 dtype
  const std::size_t type_at = 4 + 9 + 4 + 9 + 8;
  REQUIRE(static_cast<dc::dtype>(bad_type[type_at]) == dc::dtype::f32);
  bad_type[type_at] = std::byte{200};
  CHECK_THROWS_WITH_AS(dc::layout::decode(bad_type), doctest::Contains("dtype"), dc::error);
  // Single bit flips anywhere, and random garbage.
  int corrupt = 0, decoded = 0;
  for (std::size_t bit = 0; bit < good.size() * 8; ++bit) {
    auto b = good;
    b[bit / 8] ^= std::byte(1u << (bit % 8));
    decode_or_corrupt(decode, b, corrupt, decoded);
  }
  std::mt19937_64 rng(99);
  for (int i = 0; i < 3000; ++i) {
    std::vector<std::byte> b(rng() % 64);
    for (auto& x : b) x = std::byte(static_cast<std::uint8_t>(rng() % 4 == 0 ? rng() : 0));  // mostly zeros: deeper parses
    decode_or_corrupt(decode, b, corrupt, decoded);
  }
  CHECK(corrupt > 0);
  CHECK(decoded > 0);  // e.g. flips inside names or shapes still decode (to a different layout)
}

TEST_CASE("layout: first_difference names the first differing tensor") {
  const auto a = sample_layout();
  auto edit = [&](auto f) {
    auto layers = a.layers();
    f(layers);
    return dc::layout(std::move(layers));
  };
  auto diff = [&](const dc::layout& b) { return dc::first_difference(a, b).value_or("<none>"); };

  auto size = diff(edit([](auto& l) { l[0].tensors[0].bytes = 404; }));
  CHECK(size.find("'fc1.weight'") != std::string::npos);
  CHECK(size.find("size") != std::string::npos);
  CHECK(size.find("400 bytes") != std::string::npos);
  CHECK(size.find("404 bytes") != std::string::npos);

  auto type = diff(edit([](auto& l) { l[1].tensors[0].type = dc::dtype::f32; }));
  CHECK(type.find("'bn.running_mean'") != std::string::npos);
  CHECK(type.find("dtype") != std::string::npos);
  CHECK(type.find("float64") != std::string::npos);
  CHECK(type.find("float32") != std::string::npos);

  auto name = diff(edit([](auto& l) { l[0].tensors[1].name = "b"; }));
  CHECK(name.find("'bias'") != std::string::npos);
  CHECK(name.find("'b'") != std::string::npos);
  CHECK(name.find("name") != std::string::npos);

  auto lname = diff(edit([](auto& l) { l[3].name = "head"; }));
  CHECK(lname.find("'fc2'") != std::string::npos);
  CHECK(lname.find("'head'") != std::string::npos);

  auto count = diff(edit([](auto& l) { l[1].tensors.push_back({"extra", 4, dc::dtype::f32, {1}}); }));
  CHECK(count.find("tensor count") != std::string::npos);
  CHECK(count.find("'bn'") != std::string::npos);
  CHECK(count.find("2") != std::string::npos);
  CHECK(count.find("3") != std::string::npos);

  auto layers = diff(edit([](auto& l) { l.push_back({"fc3", {}}); }));
  CHECK(layers.find("layer count") != std::string::npos);

  auto shape = diff(edit([](auto& l) { l[3].tensors[0].shape = {5, 2}; }));
  CHECK(shape.find("'fc2.weight'") != std::string::npos);
  CHECK(shape.find("[2x5]") != std::string::npos);
  CHECK(shape.find("[5x2]") != std::string::npos);

  // The first of two differences, in forward order.
  auto two = diff(edit([](auto& l) {
    l[3].tensors[0].bytes = 22;
    l[1].tensors[1].type = dc::dtype::u64;
  }));
  CHECK(two.find("'bn.count'") != std::string::npos);
  CHECK(two.find("fc2") == std::string::npos);

  // Whose is whose.
  auto named = dc::first_difference(a, edit([](auto& l) { l[0].tensors[0].bytes = 404; }), "sources", "clone rank 5");
  REQUIRE(named.has_value());
  CHECK(named->find("sources have 400 bytes") != std::string::npos);
  CHECK(named->find("clone rank 5 has 404 bytes") != std::string::npos);
}

// ---------------------------------------------------------------------------------------
// metadata

TEST_CASE("metadata: encode/decode round trip") {
  std::mt19937_64 rng(7);
  for (std::size_t user_bytes : {std::size_t{0}, std::size_t{1}, std::size_t{1000}, std::size_t{3} << 20}) {
    dc::metadata m;
    m.step = 123456789012ull;
    m.data_cursor = 42;
    m.rng.resize(5000);
    for (auto& b : m.rng) b = std::byte(static_cast<std::uint8_t>(rng()));
    m.hyper = {{"lr", 0.1}, {"momentum", 0.9}, {"weight_decay", 1e-4}, {"", -0.0}, {"nan?", 1e308}};
    m.user.resize(user_bytes);
    for (auto& b : m.user) b = std::byte(static_cast<std::uint8_t>(rng()));
    auto back = dc::metadata::decode(m.encode());
    CHECK(back == m);
    CHECK(back.user.size() == user_bytes);
  }
  dc::metadata empty;
  CHECK(dc::metadata::decode(empty.encode()) == empty);
}

TEST_CASE("metadata: corrupt bytes throw corrupt_message") {
  dc::metadata m;
  m.step = 5;
  m.rng = {std::byte{1}, std::byte{2}};
  m.hyper = {{"lr", 0.5}};
  m.user = {std::byte{9}};
  const auto good = m.encode();
  for (std::size_t n = 0; n < good.size(); ++n) {
    INFO("prefix " << n);
    try {
      dc::metadata::decode(std::span(good).first(n));
      FAIL_CHECK("truncated metadata decoded");
    } catch (const dc::error& e) {
      CHECK(e.kind() == dc::errc::corrupt_message);
    }
  }
  auto longer = good;
  longer.push_back(std::byte{1});
  CHECK_THROWS_AS(dc::metadata::decode(longer), dc::error);
  auto huge = good;
  for (int i = 16; i < 24; ++i) huge[static_cast<std::size_t>(i)] = std::byte{0xFF};  // rng length 2^64-1
  try {
    dc::metadata::decode(huge);
    FAIL_CHECK("huge length accepted");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::corrupt_message);
  }
  // Bit flips and garbage: corrupt_message or a metadata that re-encodes to the same bytes.
  auto decode = [](const std::vector<std::byte>& b) { return dc::metadata::decode(b); };
  int corrupt = 0, decoded = 0;
  for (std::size_t bit = 0; bit < good.size() * 8; ++bit) {
    auto b = good;
    b[bit / 8] ^= std::byte(1u << (bit % 8));
    decode_or_corrupt(decode, b, corrupt, decoded, false);
  }
  std::mt19937_64 rng(3);
  for (int i = 0; i < 2000; ++i) {
    std::vector<std::byte> b(rng() % 80);
    for (auto& x : b) x = std::byte(static_cast<std::uint8_t>(rng() % 3 == 0 ? rng() : 0));
    decode_or_corrupt(decode, b, corrupt, decoded, false);
  }
  CHECK(corrupt > 0);
  CHECK(decoded > 0);
}

// ---------------------------------------------------------------------------------------
// checksum::mix64

namespace {
std::uint64_t mix(std::span<const std::byte> b) { return dc::checksum::mix64::compute(b); }
std::vector<std::byte> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::byte> b(n);
  for (auto& x : b) x = std::byte(static_cast<std::uint8_t>(rng()));
  return b;
}
}  // namespace

TEST_CASE("checksum mix64: equal bytes give equal sums, also unaligned and odd lengths") {
  std::mt19937_64 rng(1);
  for (std::size_t n : {0, 1, 3, 7, 8, 9, 15, 16, 31, 32, 33, 63, 100, 257, 4096, 10007}) {
    auto a = random_bytes(rng, n);
    const auto ref = mix(a);
    CHECK(mix(a) == ref);  // deterministic
    std::vector<std::byte> storage(n + 16);
    for (std::size_t shift = 0; shift < 8; ++shift) {
      if (n) std::memcpy(storage.data() + shift, a.data(), n);
      CHECK(mix(std::span<const std::byte>(storage.data() + shift, n)) == ref);
    }
  }
  // The four-lane loop and the tail give the same value as the definition: sum of terms.
  auto a = random_bytes(rng, 1003);
  std::uint64_t sum = 0;
  for (std::size_t w = 0; w * 8 < a.size(); ++w) {
    std::uint64_t word = 0;
    std::memcpy(&word, a.data() + w * 8, std::min<std::size_t>(8, a.size() - w * 8));
    sum += dc::checksum::mix64::term(word, w);
  }
  CHECK(mix(a) == dc::checksum::mix64::finish(sum, a.size()));
}

TEST_CASE("checksum mix64: any single bit flip changes the sum") {
  std::mt19937_64 rng(2);
  std::size_t flips = 0;
  for (std::size_t n : {1, 5, 8, 12, 31, 64, 129, 1000, 65536}) {
    auto a = random_bytes(rng, n);
    const auto ref = mix(a);
    const std::size_t bits = n * 8;
    // All bit positions of small buffers, 2000 random positions of large ones.
    const std::size_t tries = bits <= 8 * 1000 ? bits : 2000;
    for (std::size_t i = 0; i < tries; ++i) {
      const std::size_t bit = bits <= 8 * 1000 ? i : rng() % bits;
      a[bit / 8] ^= std::byte(1u << (bit % 8));
      CHECK_MESSAGE(mix(a) != ref, "flip of bit " << bit << " of " << n << " bytes not detected");
      a[bit / 8] ^= std::byte(1u << (bit % 8));
      ++flips;
    }
    CHECK(mix(a) == ref);
  }
  // All-zero buffers too (the weakest case for sums).
  std::vector<std::byte> z(200);
  const auto zref = mix(z);
  for (std::size_t bit = 0; bit < z.size() * 8; ++bit) {
    z[bit / 8] ^= std::byte(1u << (bit % 8));
    CHECK(mix(z) != zref);
    z[bit / 8] ^= std::byte(1u << (bit % 8));
  }
  CHECK(flips > 10000);
}

TEST_CASE("checksum mix64: word swaps, truncation and zero extension change the sum") {
  std::mt19937_64 rng(3);
  for (std::size_t n : {16, 17, 64, 100, 1024}) {
    auto a = random_bytes(rng, n);
    const auto ref = mix(a);
    const std::size_t words = n / 8;
    for (std::size_t i = 0; i < words; ++i)
      for (std::size_t j = i + 1; j < words; ++j) {
        auto b = a;
        std::swap_ranges(b.begin() + static_cast<long>(i * 8), b.begin() + static_cast<long>(i * 8 + 8),
                         b.begin() + static_cast<long>(j * 8));
        if (b == a) continue;  // identical words
        CHECK_MESSAGE(mix(b) != ref, "swap of words " << i << " and " << j);
      }
    // Byte swaps inside a word.
    auto c = a;
    std::swap(c[0], c[1]);
    if (c != a) CHECK(mix(c) != ref);
    // Every truncation.
    for (std::size_t k = 0; k < n; ++k) CHECK_MESSAGE(mix(std::span(a).first(k)) != ref, "truncated to " << k);
    // Zero extension, including within the last word.
    for (std::size_t extra = 1; extra <= 17; ++extra) {
      auto b = a;
      b.resize(n + extra, std::byte{0});
      CHECK_MESSAGE(mix(b) != ref, "zero-extended by " << extra);
    }
  }
  // Zero buffers of different lengths differ.
  std::set<std::uint64_t> zeros;
  for (std::size_t n = 0; n <= 64; ++n) CHECK(zeros.insert(mix(std::vector<std::byte>(n))).second);
}
