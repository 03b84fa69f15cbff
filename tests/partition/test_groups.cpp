// Transfer groups of the partitioned plan (partition_groups.hpp): grouping per (layer,
// source, clone rank) is deterministic and carries exactly the plan's bytes, message rules
// hold, the byte totals match the plan, pack/unpack move every byte to its place, and runs
// outside a tensor are refused before a byte is written.
#include <doctest/doctest.h>

#include <deepclone/partition_groups.hpp>

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "scenarios.hpp"

namespace dc = deepclone;
using namespace partition_test;

namespace {

/// (clone, tensor, global byte) -> (source, source offset, clone offset), byte by byte.
using byte_routes = std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint64_t>,
                             std::tuple<std::uint32_t, std::uint64_t, std::uint64_t>>;
std::uint64_t add_routes(byte_routes& m, const dc::region_transfer& r) {
  std::uint64_t duplicates = 0;
  for (std::uint64_t i = 0; i < r.length; ++i)
    duplicates += !m.emplace(std::tuple{r.clone, r.tensor, r.global + i}, std::tuple{r.source, r.source_offset + i, r.clone_offset + i}).second;
  return duplicates;
}

/// Each message follows the rules: a direct one is one run, long (or alone); a packed one
/// has several short runs; none exceeds the limit; all runs belong to their group.
void check_messages(const dc::partition_group& g, const dc::partition_group_options& opt) {
  std::uint64_t bytes = 0;
  for (const auto& m : g.messages) {
    std::uint64_t sum = 0;
    for (const auto& r : m.runs) {
      sum += r.length;
      CHECK(std::tie(r.layer, r.source, r.clone) == std::tie(g.layer, g.source, g.clone));
      if (m.packed) CHECK(r.length < opt.direct_min_bytes);
    }
    CHECK(sum == m.bytes);
    CHECK(m.bytes <= opt.max_message_bytes);
    CHECK(m.runs.size() == (m.packed ? m.runs.size() : 1u));
    if (m.packed) CHECK(m.runs.size() > 1);
    bytes += sum;
  }
  CHECK(bytes == g.bytes);
}

/// The groups carry exactly the plan's bytes, each once, routed as the plan routes them;
/// groups are in (layer, source, clone) order, one per triple; totals and indices agree.
void check_groups(const scenario& s, const dc::partition_group_options& opt) {
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst);
  const auto n = static_cast<std::uint32_t>(s.src.size()), m = static_cast<std::uint32_t>(s.dst.size());
  const auto groups = dc::make_partition_groups(plan, n, m, opt);
  byte_routes want, got;
  for (const auto& r : plan.transfers()) add_routes(want, r);
  std::uint64_t duplicates = 0;
  for (std::size_t i = 0; i < groups.groups().size(); ++i) {
    const auto& g = groups.groups()[i];
    if (i) CHECK(std::tie(groups.groups()[i - 1].layer, groups.groups()[i - 1].source, groups.groups()[i - 1].clone) <
                 std::tie(g.layer, g.source, g.clone));
    check_messages(g, opt);
    for (const auto& msg : g.messages)
      for (const auto& r : msg.runs) duplicates += add_routes(got, r);
  }
  CHECK(duplicates == 0);
  CHECK_MESSAGE(got == want, "the groups carry " << got.size() << " bytes, the plan " << want.size());
  for (std::uint32_t x = 0; x < n; ++x) {
    CHECK(groups.bytes_sent_by_source(x) == plan.bytes_sent_by_source(x));
    for (auto g : groups.sent_by_source(x)) CHECK(groups.groups()[g].source == x);
  }
  for (std::uint32_t c = 0; c < m; ++c) {
    CHECK(groups.bytes_received_by_clone(c) == plan.bytes_received_by_clone(c));
    for (auto g : groups.received_by_clone(c)) CHECK(groups.groups()[g].clone == c);
  }
}

std::vector<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t, std::size_t, std::uint64_t>> shape_of(const dc::partition_groups& gs) {
  std::vector<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t, std::size_t, std::uint64_t>> out;
  for (const auto& g : gs.groups())
    for (const auto& m : g.messages) out.emplace_back(g.layer, g.source, g.clone, m.runs.size(), m.runs.front().global);
  return out;
}

const dc::partition_group_options tiny{16, 64};  // small limits: cuts, packs and lone runs on the small model

}  // namespace

TEST_CASE("partition groups: ZeRO-1, TP2xDP2 and randomised layouts, exactly the plan's bytes, deterministic") {
  for (const auto& opt : {dc::partition_group_options{}, tiny, dc::partition_group_options{1, 1}}) {
    CAPTURE(opt.direct_min_bytes);
    check_groups(zero1(), opt);
    check_groups(tp2_dp2(), opt);
    std::mt19937_64 rng(12);
    auto pick = [&](std::uint64_t n) { return n ? rng() % n : 0; };
    for (int round = 0; round < 60; ++round) {
      CAPTURE(round);
      check_groups(random_scenario(pick), opt);
    }
  }
  const auto s = tp2_dp2();
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst);
  CHECK(shape_of(dc::make_partition_groups(plan, 4, 3, tiny)) == shape_of(dc::make_partition_groups(plan, 4, 3, tiny)));
}

TEST_CASE("partition groups: row-split runs of the TP2xDP2 plan are packed, long runs go direct") {
  const auto s = tp2_dp2();  // fc2.weight row-parallel: 128-byte runs per source row
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst);
  const auto groups = dc::make_partition_groups(plan, 4, 3, {256, 1 << 20});
  std::uint64_t packed = 0, direct = 0;
  for (const auto& g : groups.groups())
    for (const auto& m : g.messages) (m.packed ? packed : direct) += 1;
  CHECK(packed > 0);
  CHECK(direct > 0);
  std::uint64_t runs = 0;
  for (const auto& r : plan.transfers()) runs += r.source == 0;
  CHECK_MESSAGE(groups.messages_sent_by_source(0) * 2 < runs, groups.messages_sent_by_source(0) << " messages for " << runs << " runs");
}

namespace {

/// Moves every message of every group: direct runs tensor to tensor, packed ones through
/// pack and unpack; then every clone byte must be the source's byte of its global position.
void move_and_check(const scenario& s, const dc::partition_group_options& opt) {
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst);
  const auto groups = dc::make_partition_groups(plan, static_cast<std::uint32_t>(s.src.size()), static_cast<std::uint32_t>(s.dst.size()), opt);
  std::vector<std::vector<std::vector<std::byte>>> src, dst;
  for (const auto& h : s.src) src.push_back(own_tensors(s.lay, h, true));
  for (const auto& h : s.dst) dst.push_back(own_tensors(s.lay, h, false));
  for (const auto& g : groups.groups()) {
    const auto from = spans<const std::byte>(src[g.source]);
    const auto to = spans<std::byte>(dst[g.clone]);
    for (const auto& m : g.messages) {
      if (!m.packed) {
        const auto a = dc::source_run(s.lay, m.runs[0], from);
        std::copy(a.begin(), a.end(), dc::clone_run(s.lay, m.runs[0], to).begin());
        continue;
      }
      std::vector<std::byte> wire(m.bytes);
      dc::pack(s.lay, m.runs, from, wire);
      dc::unpack(s.lay, m.runs, wire, to);
    }
  }
  for (std::size_t c = 0; c < s.dst.size(); ++c)
    for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK_MESSAGE(holds_pattern(s, c, dst[c], t), "clone rank " << c << ", tensor " << t);
}

}  // namespace

TEST_CASE("partition groups: pack, unpack and direct runs deliver every byte, byte-exact") {
  for (const auto& opt : {dc::partition_group_options{}, tiny}) {
    move_and_check(zero1(), opt);
    move_and_check(tp2_dp2(), opt);
    std::mt19937_64 rng(7);
    auto pick = [&](std::uint64_t n) { return n ? rng() % n : 0; };
    for (int round = 0; round < 30; ++round) move_and_check(random_scenario(pick), opt);
  }
}

TEST_CASE("partition groups: a run outside a tensor is refused, naming it, and nothing is written") {
  const auto lay = two_layer_model();
  std::vector<std::vector<std::byte>> src(lay.tensor_count()), dst(lay.tensor_count());
  for (std::uint32_t t = 0; t < lay.tensor_count(); ++t) src[t].assign(lay.tensor(t).bytes, std::byte{1}), dst[t].assign(100, std::byte{0});
  const auto from = spans<const std::byte>(src);
  const auto to = spans<std::byte>(dst);
  // Two runs of fc1.bias (256 bytes): the second reaches past the clone's 100-byte tensor.
  std::vector<dc::region_transfer> runs{{1, 0, 0, 40, 0, 0, 0, 0}, {1, 0, 40, 80, 0, 0, 40, 40}};
  std::vector<std::byte> wire(120, std::byte{9});
  auto refused = [](auto&& f, dc::errc kind, const std::string& needle) {
    try {
      f();
      FAIL("accepted; expected a refusal with: " << needle);
    } catch (const dc::error& e) {
      CHECK(e.kind() == kind);
      CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos, e.what());
    }
  };
  refused([&] { dc::unpack(lay, runs, wire, to); }, dc::errc::invalid_argument, "clone rank: tensor 'fc1.bias': bytes [40, 120) lie outside its own tensor of 100 bytes");
  CHECK(dst[1] == std::vector<std::byte>(100, std::byte{0}));  // the first, valid run was not written either
  refused([&] { dc::unpack(lay, runs, std::span(wire).first(119), to); }, dc::errc::corrupt_message, "a packed message of 119 bytes for runs of 120");
  runs[1].source_offset = 250;
  refused([&] { dc::pack(lay, runs, from, wire); }, dc::errc::invalid_argument, "source: tensor 'fc1.bias': bytes [250, 330) lie outside its own tensor of 256 bytes");
  CHECK(wire == std::vector<std::byte>(120, std::byte{9}));
  refused([&] { dc::pack(lay, runs, from, std::span(wire).first(100)); }, dc::errc::invalid_argument, "a buffer of 100 bytes for runs of 120");
  runs[1] = {9, 0, 0, 8, 0, 0, 0, 0};
  refused([&] { dc::pack(lay, runs, from, std::span(wire).first(48)); }, dc::errc::invalid_argument, "tensor 9 is not among its 6 tensors");
  runs[1] = {1, 0, 0, 8, 0, 0, ~0ull - 2, 0};  // an offset whose end wraps around 64 bits
  refused([&] { dc::pack(lay, runs, from, std::span(wire).first(48)); }, dc::errc::invalid_argument, "lie outside its own tensor");
  const auto s = tp2_dp2();
  refused([&] { dc::make_partition_groups(dc::make_partition_plan(s.lay, s.src, s.dst), 3, 3); }, dc::errc::invalid_argument, "names source 3");
}
