// The partitioned transfer with parts the host cannot address (part_memory.hpp): a staging
// Memory policy on the sources, on the clone ranks, or on both. Their parts lie behind
// sealed addresses (sealed_memory.hpp), so a read or write of a part by the transfer or the
// transport itself faults; only the policy reaches the bytes. Every clone byte is checked
// on the five layouts and randomised ones, with direct, packed and gathered messages (a
// host side's gathered message meets a staged side's contiguous buffer) and with sharing (a
// staged clone rank forwards); a corrupted message is refused before the policy writes a
// byte of it.
#include <doctest/doctest.h>

#include <deepclone/fault_injection.hpp>
#include <deepclone/inproc.hpp>
#include <deepclone/partition_transfer.hpp>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "transfer_run.hpp"

namespace dc = deepclone;
using namespace partition_test;
using namespace std::chrono_literals;

namespace {

/// Options under which the two-layer model's row-split runs are packed and gathered.
const dc::partition_group_options gather_small{4096, 1024 * 1024, 64};

/// `s` over the in-process transport with the gathering capability (a host side gathers
/// what a staged side takes contiguously), each side's parts in its Memory; returns how many
/// gathered sends and scattered receives the host sides posted.
template <class SourceMemory, class CloneMemory>
int check_staged(const scenario& s, const dc::partition_group_options& opt, dc::partition_sharing sharing) {
  auto used = std::make_shared<std::atomic<int>>(0);
  ranks_of<gathering_inproc> ranks(s, [&](dc::inproc::communicator c) { return gathering_inproc(std::move(c), used); });
  check_clones(s, transfer<gathering_inproc, SourceMemory, CloneMemory>(s, opt, ranks.comms, 10s, sharing));
  return used->load();
}

/// Every layout, then randomised holdings, under `opt`; returns check_staged's count, summed.
template <class SourceMemory, class CloneMemory>
int check_layouts(const dc::partition_group_options& opt, dc::partition_sharing sharing, int random_rounds) {
  int gathered = 0;
  for (const auto& s : {zero1(), zero3(), tp2_dp2(), pipeline_2x2(true), pipeline_2x2(false)})
    gathered += check_staged<SourceMemory, CloneMemory>(s, opt, sharing);
  std::mt19937_64 rng(41);
  auto pick = [&](std::uint64_t n) { return n ? rng() % n : 0; };
  for (int round = 0; round < random_rounds; ++round) {
    CAPTURE(round);
    gathered += check_staged<SourceMemory, CloneMemory>(random_scenario(pick), opt, sharing);
  }
  return gathered;
}

}  // namespace

TEST_CASE("staged parts: the transfer never touches them itself; every clone byte exact, whichever side stages") {
  using dc::host_memory;
  const auto none = dc::partition_sharing::none;
  for (const auto& opt : {dc::partition_group_options{}, dc::partition_group_options{16, 64}, gather_small}) {
    CAPTURE(opt.direct_min_bytes);
    const auto gathered = sealed_memory::gathers.load(), scattered = sealed_memory::scatters.load();
    // With gather_small, the host side's messages of runs travel gathered (or scattered):
    // wire-compatible with the staged side's contiguous buffers.
    const bool gathering = opt.direct_min_bytes == gather_small.direct_min_bytes;
    SUBCASE("staged sources, host clone ranks") {
      const auto scattered_receives = check_layouts<sealed_memory, host_memory>(opt, none, 4);
      CHECK(sealed_memory::gathers.load() > gathered);
      CHECK(sealed_memory::scatters.load() == scattered);
      if (gathering) CHECK(scattered_receives > 0);
    }
    SUBCASE("host sources, staged clone ranks") {
      const auto gathered_sends = check_layouts<host_memory, sealed_memory>(opt, none, 4);
      CHECK(sealed_memory::gathers.load() == gathered);
      CHECK(sealed_memory::scatters.load() > scattered);
      if (gathering) CHECK(gathered_sends > 0);
    }
    SUBCASE("both staged") {
      CHECK(check_layouts<sealed_memory, sealed_memory>(opt, none, 4) == 0);  // a staged side neither gathers nor scatters
    }
  }
}

TEST_CASE("staged parts with sharing: a staged clone rank forwards what it verified; every clone byte exact") {
  for (const auto& opt : {dc::partition_group_options{}, gather_small}) {
    CAPTURE(opt.direct_min_bytes);
    check_layouts<sealed_memory, sealed_memory>(opt, dc::partition_sharing::exchange, 4);
    check_layouts<dc::host_memory, sealed_memory>(opt, dc::partition_sharing::exchange, 2);
  }
}

TEST_CASE("staged parts: a corrupted message fails its checksum before the policy writes a byte of it") {
  const auto s = zero1();
  const int ranks = 6;
  const auto opt = dc::partition_group_options{16, 64};
  dc::inproc::world w(ranks);
  auto faults = std::make_shared<dc::fault::plan>();
  // Layer 0's data tag from source 0 (rank 0) to clone rank 0 (rank 4): its first message.
  faults->add({.action = dc::fault::kind::corrupt, .from = 0, .to = 4, .tag_lo = tag_base + 2});
  std::vector<std::unique_ptr<dc::faulty<dc::inproc::communicator>>> comms;
  std::vector<dc::faulty<dc::inproc::communicator>*> ptrs;
  for (int r = 0; r < ranks; ++r) ptrs.push_back(comms.emplace_back(std::make_unique<dc::faulty<dc::inproc::communicator>>(w.comm(r), faults)).get());
  const auto r = transfer<dc::faulty<dc::inproc::communicator>, dc::host_memory, sealed_memory>(s, opt, ptrs, 10s);
  REQUIRE(r.clone_errors[0]);
  try {
    std::rethrow_exception(r.clone_errors[0]);
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::corrupt_message);
    CHECK(std::string(e.what()).find("layer 'fc1' from source 0 to clone rank 0") != std::string::npos);
  }
  // The corrupted message's runs kept the clone rank's sentinel bytes.
  const auto groups = dc::make_partition_groups(dc::make_partition_plan(s.lay, s.src, s.dst), 4, 2, opt);
  const dc::partition_group* first = nullptr;
  for (const auto& g : groups.groups())
    if (g.layer == 0 && g.source == 0 && g.clone == 0) first = &g;
  REQUIRE(first);
  REQUIRE_FALSE(first->messages.empty());
  for (const auto& run : first->messages.front().runs) {
    const auto& t = r.dst[0][run.tensor];
    CHECK(std::all_of(t.begin() + static_cast<std::ptrdiff_t>(run.clone_offset), t.begin() + static_cast<std::ptrdiff_t>(run.clone_offset + run.length),
                      [](std::byte b) { return b == std::byte{0xEE}; }));
  }
}
