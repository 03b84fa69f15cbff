// The partitioned-state planner (holdings.hpp), checked byte by byte against an independent
// brute-force model: for every rank, which global byte sits where in its own tensor, built
// by enumerating element indices (not through the planner's runs). Scenarios of issue 12
// (ZeRO-1, ZeRO-3 with uneven partitions, tensor x data parallel, pipeline stages), the
// refusals, and randomised holdings on both sides.
#include <doctest/doctest.h>

#include <deepclone/holdings.hpp>

#include <algorithm>
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

/// Every rank's brute-force map of tensor t (global byte -> offset in its own tensor).
std::vector<byte_map> maps_of(const dc::layout& lay, std::uint32_t t, const std::vector<dc::holdings>& ranks) {
  std::vector<byte_map> out;
  for (auto& h : ranks) out.push_back(brute_map(lay.tensor(t), h.of_tensor[t]));
  return out;
}

/// Every byte a clone rank wants arrives exactly once, at the right place, from a source
/// that holds it at the offset the transfer names; nothing unwanted arrives.
void check_transfers(const std::vector<dc::region_transfer>& transfers, const dc::layout& lay, const std::vector<dc::holdings>& src,
                     const std::vector<dc::holdings>& dst) {
  for (std::uint32_t t = 0; t < lay.tensor_count(); ++t) {
    CAPTURE(lay.tensor(t).name);
    const auto held = maps_of(lay, t, src), wanted = maps_of(lay, t, dst);
    std::vector<std::map<std::uint64_t, int>> got(dst.size());
    bool ok = true;
    for (auto& x : transfers) {
      if (x.tensor != t) continue;
      ok = ok && x.layer == lay.layer_of(t) && x.length > 0;
      for (std::uint64_t i = 0; i < x.length && ok; ++i) {
        auto s = held[x.source].find(x.global + i);
        auto c = wanted[x.clone].find(x.global + i);
        ok = s != held[x.source].end() && s->second == x.source_offset + i && c != wanted[x.clone].end() &&
             c->second == x.clone_offset + i;
        ++got[x.clone][x.global + i];
      }
    }
    CHECK_MESSAGE(ok, "a transfer reads a byte its source does not hold there, or writes one its clone does not want there");
    for (std::size_t c = 0; c < dst.size(); ++c) {
      CAPTURE(c);
      bool once = got[c].size() == wanted[c].size();
      for (auto& [g, n] : got[c]) once = once && n == 1;
      CHECK_MESSAGE(once, "clone rank " << c << " gets " << got[c].size() << " distinct bytes of " << wanted[c].size() << " wanted");
    }
  }
}

void check_plan(const dc::partition_plan& p, const dc::layout& lay, const std::vector<dc::holdings>& src,
                const std::vector<dc::holdings>& dst) {
  check_transfers(p.transfers(), lay, src, dst);
  CHECK(p.forwards().empty());  // partition_sharing::none
}

/// The failover plan keeps every transfer of a live source as it was, sends nothing from a
/// failed one, and still delivers every wanted byte exactly once from a holder.
void check_failover(const dc::partition_plan& before, const dc::partition_plan& after, const std::vector<bool>& failed,
                    const dc::layout& lay, const std::vector<dc::holdings>& src, const std::vector<dc::holdings>& dst) {
  check_transfers(after.transfers(), lay, src, dst);
  std::vector<dc::region_transfer> kept_before, kept_after;
  for (auto& x : before.transfers())
    if (!failed[x.source]) kept_before.push_back(x);
  for (auto& x : after.transfers()) {
    CHECK_MESSAGE(!failed[x.source], "source " << x.source << " failed but still sends");
    if (!failed[x.source]) kept_after.push_back(x);
  }
  auto less = [](const dc::region_transfer& a, const dc::region_transfer& b) {
    return std::tie(a.tensor, a.clone, a.global, a.source) < std::tie(b.tensor, b.clone, b.global, b.source);
  };
  // Every transfer a live source had before is still in the failover plan, unchanged.
  std::sort(kept_after.begin(), kept_after.end(), less);
  std::size_t missing = 0;
  for (auto& x : kept_before) {
    auto it = std::lower_bound(kept_after.begin(), kept_after.end(), x, less);
    missing += it == kept_after.end() || !(*it == x);
  }
  CHECK_MESSAGE(missing == 0, missing << " transfers of live sources changed or vanished");
}

/// Whether some byte a clone rank wants, sent by a failed source in `p`, is held by no live source.
bool lost_without_replica(const dc::partition_plan& p, const std::vector<bool>& failed, const dc::layout& lay,
                          const std::vector<dc::holdings>& src) {
  for (auto& x : p.transfers()) {
    if (!failed[x.source]) continue;
    for (std::uint64_t i = 0; i < x.length; ++i) {
      bool held = false;
      for (std::uint32_t s = 0; s < src.size() && !held; ++s)
        held = !failed[s] && brute_map(lay.tensor(x.tensor), src[s].of_tensor[x.tensor]).count(x.global + i);
      if (!held) return true;
    }
  }
  return false;
}

}  // namespace

TEST_CASE("partition failover: a failed source's transfers move to its replicas; live sources keep theirs") {
  const auto [lay, src, dst] = tp2_dp2();  // sources 0,2 and 1,3 are replica twins
  const auto p = dc::make_partition_plan(lay, src, dst);
  for (std::uint32_t f = 0; f < 4; ++f) {
    CAPTURE(f);
    std::vector<bool> failed(4, false);
    failed[f] = true;
    const auto q = dc::make_failover_plan(lay, src, p, failed);
    check_failover(p, q, failed, lay, src, dst);
    // The failed source's TP shards come from its replica twin alone; only fc2.bias, held by
    // all four, is spread over the three live sources. Nothing is sent twice.
    const auto twin = (f + 2) % 4;
    std::uint64_t bias = 0, before = 0, after = 0;
    for (auto& x : p.transfers()) bias += x.source == f && lay.tensor(x.tensor).shape.size() == 1 && x.layer == 1 ? x.length : 0;
    for (std::uint32_t s = 0; s < 4; ++s) before += p.bytes_sent_by_source(s), after += q.bytes_sent_by_source(s);
    CHECK(after == before);
    CHECK(q.bytes_sent_by_source(twin) >= p.bytes_sent_by_source(twin) + p.bytes_sent_by_source(f) - bias);
  }
  std::vector<bool> both(4, false);
  both[0] = both[2] = true;  // a TP shard with neither replica left
  CHECK_THROWS_WITH_AS(dc::make_failover_plan(lay, src, p, both),
                       doctest::Contains("fc1.weight"), dc::error);
}

TEST_CASE("partition failover: ZeRO-1's parameters fail over; a slot partition held once has no replica, named") {
  const auto [lay, src, dst] = zero1();
  const auto p = dc::make_partition_plan(lay, src, dst);
  std::vector<bool> failed(4, false);
  failed[1] = true;
  try {
    (void)dc::make_failover_plan(lay, src, p, failed);
    FAIL("a slot partition only source 1 holds must be refused");
  } catch (const dc::error& e) {
    CHECK(e.code() == dc::errc::source_failed);
    const std::string what = e.what();
    CHECK_MESSAGE(what.find("adam_m") != std::string::npos, what);
    CHECK_MESSAGE(what.find("source 1") != std::string::npos, what);
    CHECK_MESSAGE(what.find("no replica") != std::string::npos, what);
  }
  // Clones that want only the replicated parameters lose nothing to source 1's failure.
  std::vector<dc::holdings> params(2, dc::holdings(lay.tensor_count()));
  for (std::uint32_t t = 0; t < lay.tensor_count(); ++t)
    if (!is_slot(lay.tensor(t).name)) params[t % 2].of_tensor[t] = {dc::part::whole()};
  const auto pp = dc::make_partition_plan(lay, src, params);
  check_failover(pp, dc::make_failover_plan(lay, src, pp, failed), failed, lay, src, params);
}

TEST_CASE("partition failover: a failover plan for holdings or a failure list of another size is refused") {
  const auto [lay, src, dst] = zero1();
  const auto p = dc::make_partition_plan(lay, src, dst);
  CHECK_THROWS_WITH_AS(dc::make_failover_plan(lay, src, p, std::vector<bool>(3, false)), doctest::Contains("3 sources"), dc::error);
}

TEST_CASE("partition failover: randomised holdings and failures, exactly once from a live holder or refused") {
  std::mt19937_64 rng(21);
  auto pick = [&](std::uint64_t n) { return n ? rng() % n : 0; };
  int replanned = 0, refused_rounds = 0;
  for (int round = 0; round < 80; ++round) {
    CAPTURE(round);
    const auto [lay, src, dst] = random_scenario(pick);
    const auto alignment = 1 + pick(8);
    const auto p = dc::make_partition_plan(lay, src, dst, alignment);
    std::vector<bool> failed(src.size(), false);
    for (auto k = 1 + pick(src.size() - 1); k-- > 0;) failed[pick(src.size())] = true;
    if (lost_without_replica(p, failed, lay, src)) {
      ++refused_rounds;
      CHECK_THROWS_WITH_AS(dc::make_failover_plan(lay, src, p, failed, alignment), doctest::Contains("no replica"), dc::error);
    } else {
      ++replanned;
      check_failover(p, dc::make_failover_plan(lay, src, p, failed, alignment), failed, lay, src, dst);
    }
  }
  CHECK(replanned > 10);  // both outcomes are exercised
  CHECK(refused_rounds > 10);
}

TEST_CASE("partition: replicated on both sides is today's case, each source sending about S*M/N") {
  const auto lay = two_layer_model();
  std::vector<dc::holdings> src(4, dc::holdings::replicated(lay)), dst(2, dc::holdings::replicated(lay));
  const auto p = dc::make_partition_plan(lay, src, dst, 4);
  check_plan(p, lay, src, dst);
  for (std::uint32_t s = 0; s < 4; ++s) CHECK(p.bytes_sent_by_source(s) == doctest::Approx(lay.total_bytes() * 2 / 4.0).epsilon(0.05));
}

TEST_CASE("partition: ZeRO-1 over N=4 (slots flat-partitioned, uneven) into M=2 replicated") {
  const auto [lay, src, dst] = zero1();
  std::uint64_t slot_bytes = 0;
  for (std::uint32_t t = 0; t < lay.tensor_count(); ++t) slot_bytes += is_slot(lay.tensor(t).name) ? lay.tensor(t).bytes : 0;
  const auto p = dc::make_partition_plan(lay, src, dst);
  check_plan(p, lay, src, dst);
  // Each source sends its own slot partition (to both clones) and a quarter of the replicated
  // parameters: held bytes / replication factor, per clone rank.
  for (std::uint32_t s = 0; s < 4; ++s) {
    std::uint64_t own_slots = 0;
    for (std::uint32_t t = 0; t < lay.tensor_count(); ++t)
      if (is_slot(lay.tensor(t).name)) own_slots += src[s].of_tensor[t][0].end * 4 - src[s].of_tensor[t][0].begin * 4;
    const double want = 2.0 * (own_slots + (lay.total_bytes() - slot_bytes) / 4.0);
    CHECK(p.bytes_sent_by_source(s) == doctest::Approx(want).epsilon(0.05));
  }
}

TEST_CASE("partition: ZeRO-3 N=4 into ZeRO-3 M=2, uneven flat partitions on both sides") {
  const auto [lay, src, dst] = zero3();
  const auto p = dc::make_partition_plan(lay, src, dst);
  check_plan(p, lay, src, dst);
  std::uint64_t sent = 0;
  for (std::uint32_t s = 0; s < 4; ++s) sent += p.bytes_sent_by_source(s);
  CHECK(sent == lay.total_bytes());  // every byte moves once: one holder, one wanter
}

TEST_CASE("partition: tensor parallel 2 x data parallel 2 (column and row splits) into TP1 on M=3") {
  // scenarios.hpp: fc1 column-parallel, fc2 row-parallel (its rows not contiguous).
  const auto [lay, src, dst] = tp2_dp2();
  const auto p = dc::make_partition_plan(lay, src, dst);
  check_plan(p, lay, src, dst);
  // Each source holds S/2 (+ the replicated bias) and shares it with its replica twin: it
  // sends about held / 2 to each of the 3 clone ranks.
  for (std::uint32_t s = 0; s < 4; ++s) CHECK(p.bytes_sent_by_source(s) == doctest::Approx(3.0 * lay.total_bytes() / 4).epsilon(0.05));
}

TEST_CASE("partition: pipeline 2 stages x data parallel 2 into 2 stages on M=2, and into one stage") {
  SUBCASE("two stages: each clone rank receives only its stage's layers, from that stage's sources") {
    const auto [lay, src, dst] = pipeline_2x2(true);
    const auto p = dc::make_partition_plan(lay, src, dst);
    check_plan(p, lay, src, dst);
    for (auto& x : p.transfers()) {
      CHECK(x.layer == x.clone);
      CHECK(x.source / 2 == x.clone);
    }
    CHECK(p.bytes_received_by_clone(0) == lay.layer_bytes(0));
  }
  SUBCASE("one stage: both clone ranks receive everything") {
    const auto [lay, src, dst] = pipeline_2x2(false);
    check_plan(dc::make_partition_plan(lay, src, dst), lay, src, dst);
  }
}

TEST_CASE("partition: holdings that leave a region uncovered are refused, naming the tensor and the bytes") {
  const auto lay = two_layer_model();
  std::vector<dc::holdings> src(2, dc::holdings::replicated(lay)), dst(1, dc::holdings::replicated(lay));
  const auto t = 2u;  // fc1 weight.adam_m: sources hold elements [0, 100) and [200, end) only
  src[0].of_tensor[t] = {dc::part::flat(0, 100)};
  src[1].of_tensor[t] = {dc::part::flat(200, 64 * 48)};
  try {
    dc::make_partition_plan(lay, src, dst);
    FAIL("an uncovered region was accepted");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::invalid_argument);
    const std::string what = e.what();
    CHECK_MESSAGE(what.find("'fc1.weight.adam_m'") != std::string::npos, what);
    CHECK_MESSAGE(what.find("bytes [400, 800)") != std::string::npos, what);
  }
}

TEST_CASE("partition: parts outside the shape, declared twice, or for another tensor count are refused") {
  const auto lay = two_layer_model();
  auto refused = [&](std::vector<dc::holdings> src, std::vector<dc::holdings> dst, const std::string& needle) {
    try {
      dc::make_partition_plan(lay, src, dst);
      FAIL("accepted; expected a refusal with: " << needle);
    } catch (const dc::error& e) {
      CHECK(e.kind() == dc::errc::invalid_argument);
      CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos, e.what());
    }
  };
  const auto all = dc::holdings::replicated(lay);
  auto box_out = all;
  box_out.of_tensor[0] = {dc::part::box({60, 0}, {8, 48})};
  refused({box_out}, {all}, "exceeds dimension 0");
  auto box_rank = all;
  box_rank.of_tensor[0] = {dc::part::box({0}, {64})};
  refused({all}, {box_rank}, "a start and a count per dimension");
  auto twice = all;
  twice.of_tensor[1] = {dc::part::flat(0, 40), dc::part::flat(30, 64, 160)};
  refused({all}, {twice}, "clone rank 0: tensor 'fc1.bias': two parts cover the same global bytes");
  auto alias = all;
  alias.of_tensor[1] = {dc::part::flat(0, 32), dc::part::flat(32, 64, 64)};
  refused({alias}, {all}, "two parts cover the same bytes of its own tensor");
  refused({dc::holdings(2)}, {all}, "declares holdings for 2 tensors");
  auto flat_out = all;
  flat_out.of_tensor[4] = {dc::part::flat(0, 49)};
  refused({all}, {flat_out}, "is not within its 48 elements");
}

TEST_CASE("partition: randomised holdings on both sides, every wanted byte exactly once from a holder") {
  std::mt19937_64 rng(12);
  auto pick = [&](std::uint64_t n) { return n ? rng() % n : 0; };
  for (int round = 0; round < 60; ++round) {
    CAPTURE(round);
    const auto [lay, src, dst] = random_scenario(pick);
    check_plan(dc::make_partition_plan(lay, src, dst, 1 + pick(8)), lay, src, dst);
  }
}

namespace {

/// partition_sharing::exchange: the sources send every byte that any clone rank wants once
/// (to one of the clone ranks wanting it, from a source holding it there); each clone rank
/// gets every byte it wants exactly once, from a source or forwarded by a clone rank that
/// got it from a source (no chains), each read and written where the holdings put it.
void check_shared(const dc::partition_plan& p, const dc::layout& lay, const std::vector<dc::holdings>& src,
                  const std::vector<dc::holdings>& dst) {
  for (std::uint32_t t = 0; t < lay.tensor_count(); ++t) {
    CAPTURE(lay.tensor(t).name);
    const auto held = maps_of(lay, t, src), wanted = maps_of(lay, t, dst);
    std::vector<std::map<std::uint64_t, int>> got(dst.size()), from_source(dst.size());
    std::map<std::uint64_t, int> sent;
    bool ok = true;
    auto lands = [&](std::uint32_t c, std::uint64_t g, std::uint64_t at) {
      auto w = wanted[c].find(g);
      return w != wanted[c].end() && w->second == at;
    };
    for (const auto* list : {&p.transfers(), &p.forwards()})
      for (auto& x : *list)
        ok = ok && x.tensor < lay.tensor_count() && x.layer == lay.layer_of(x.tensor) && x.length > 0 && x.clone < dst.size() &&
             x.source < (list == &p.forwards() ? dst.size() : src.size());
    REQUIRE_MESSAGE(ok, "a transfer or forward names a tensor, layer, rank or length out of place");
    for (auto& x : p.transfers())
      for (std::uint64_t i = 0; x.tensor == t && i < x.length; ++i) {
        auto s = held[x.source].find(x.global + i);
        ok = ok && s != held[x.source].end() && s->second == x.source_offset + i && lands(x.clone, x.global + i, x.clone_offset + i);
        ++got[x.clone][x.global + i], ++from_source[x.clone][x.global + i], ++sent[x.global + i];
      }
    for (auto& x : p.forwards())
      for (std::uint64_t i = 0; x.tensor == t && i < x.length; ++i) {
        ok = ok && x.source != x.clone && from_source[x.source].count(x.global + i) && lands(x.source, x.global + i, x.source_offset + i) &&
             lands(x.clone, x.global + i, x.clone_offset + i);
        ++got[x.clone][x.global + i];
      }
    CHECK_MESSAGE(ok, "a transfer or forward reads a byte where its sender does not have it, or writes one where its clone does not want it");
    std::size_t union_bytes = 0;
    {
      std::map<std::uint64_t, int> any;
      for (auto& w : wanted)
        for (auto& [g, at] : w) any[g] = 1;
      union_bytes = any.size();
    }
    bool once = sent.size() == union_bytes;
    for (auto& [g, n] : sent) once = once && n == 1;
    CHECK_MESSAGE(once, "the sources send " << sent.size() << " distinct bytes for " << union_bytes << " wanted, or some twice");
    for (std::size_t c = 0; c < dst.size(); ++c) {
      bool exact = got[c].size() == wanted[c].size();
      for (auto& [g, n] : got[c]) exact = exact && n == 1;
      CHECK_MESSAGE(exact, "clone rank " << c << " gets " << got[c].size() << " distinct bytes of " << wanted[c].size() << " wanted");
    }
  }
}

}  // namespace

TEST_CASE("partition sharing: clone ranks wanting the same bytes share them, each source sending held / replication") {
  for (const auto& s : {zero1(), zero3(), tp2_dp2(), pipeline_2x2(true), pipeline_2x2(false)}) {
    const auto p = dc::make_partition_plan(s.lay, s.src, s.dst, 256, dc::partition_sharing::exchange);
    check_shared(p, s.lay, s.src, s.dst);
  }
  SUBCASE("replicated N=4 into M=2: each source sends S/4, each clone rank forwards S/2") {
    const auto lay = two_layer_model();
    std::vector<dc::holdings> src(4, dc::holdings::replicated(lay)), dst(2, dc::holdings::replicated(lay));
    const auto p = dc::make_partition_plan(lay, src, dst, 4, dc::partition_sharing::exchange);
    for (std::uint32_t s = 0; s < 4; ++s) CHECK(p.bytes_sent_by_source(s) == doctest::Approx(lay.total_bytes() / 4.0).epsilon(0.05));
    for (std::uint32_t c = 0; c < 2; ++c) CHECK(p.bytes_forwarded_by_clone(c) == doctest::Approx(lay.total_bytes() / 2.0).epsilon(0.05));
  }
  SUBCASE("TP2xDP2 into TP1 on M=3: each source sends held / 2, a third of what it sends without sharing") {
    const auto [lay, src, dst] = tp2_dp2();
    const auto shared = dc::make_partition_plan(lay, src, dst, 256, dc::partition_sharing::exchange);
    const auto alone = dc::make_partition_plan(lay, src, dst);
    for (std::uint32_t s = 0; s < 4; ++s)
      CHECK(shared.bytes_sent_by_source(s) == doctest::Approx(alone.bytes_sent_by_source(s) / 3.0).epsilon(0.05));
  }
  SUBCASE("ZeRO-3 into ZeRO-3: no byte is wanted twice, nothing is forwarded") {
    const auto [lay, src, dst] = zero3();
    CHECK(dc::make_partition_plan(lay, src, dst, 256, dc::partition_sharing::exchange).forwards().empty());
  }
}

TEST_CASE("partition sharing: randomised holdings on both sides, sources send each wanted byte once, every clone rank exact") {
  std::mt19937_64 rng(31);
  auto pick = [&](std::uint64_t n) { return n ? rng() % n : 0; };
  for (int round = 0; round < 60; ++round) {
    CAPTURE(round);
    const auto [lay, src, dst] = random_scenario(pick);
    check_shared(dc::make_partition_plan(lay, src, dst, 1 + pick(8), dc::partition_sharing::exchange), lay, src, dst);
  }
}
