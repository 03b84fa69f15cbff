// The partitioned plan's bytes over a communicator (partition_transfer.hpp), in-process:
// one thread per rank, sources sending their layers last-first as a trainer updates them,
// every clone byte checked against the source pattern of its global position (ZeRO-1,
// ZeRO-3, TP2xDP2, pipeline 2 stages x DP2 into 2 stages and into one, randomised holdings, with the default and with tiny message limits); a corrupted
// message or checksum list is refused naming the group, silence times out naming it, a
// cancelled send's packed buffer outlives it where the transport cannot withdraw sends, and
// tags beyond the communicator's bound are refused before anything is posted.
#include <doctest/doctest.h>

#include <deepclone/emulated_link.hpp>
#include <deepclone/fault_injection.hpp>
#include <deepclone/inproc.hpp>
#include <deepclone/partition_transfer.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <span>
#include <exception>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "transfer_run.hpp"

namespace dc = deepclone;
using namespace partition_test;
using namespace std::chrono_literals;

namespace {

/// The error clone rank 0 of ZeRO-1 gets when `rule` acts on the sends of every rank.
std::string error_with(dc::fault::rule rule, std::chrono::nanoseconds timeout, dc::errc expected) {
  const auto s = zero1();
  const int ranks = 6;
  dc::inproc::world w(ranks);
  auto faults = std::make_shared<dc::fault::plan>();
  faults->add(rule);
  std::vector<std::unique_ptr<dc::faulty<dc::inproc::communicator>>> comms;
  std::vector<dc::faulty<dc::inproc::communicator>*> ptrs;
  for (int r = 0; r < ranks; ++r) ptrs.push_back(comms.emplace_back(std::make_unique<dc::faulty<dc::inproc::communicator>>(w.comm(r), faults)).get());
  const auto r = transfer(s, dc::partition_group_options{16, 64}, ptrs, timeout);
  REQUIRE(r.clone_errors[0]);
  try {
    std::rethrow_exception(r.clone_errors[0]);
  } catch (const dc::error& e) {
    CHECK(e.kind() == expected);
    return e.what();
  }
  return {};
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Options under which the two-layer model's row-split runs (128 and 256 bytes) are packed
/// and gathered.
const dc::partition_group_options gather_small{4096, 1024 * 1024, 64};

}  // namespace

TEST_CASE("partition transfer: ZeRO-1, ZeRO-3, TP2xDP2, pipeline x DP and randomised holdings arrive byte-exact, layers sent last-first") {
  for (const auto& opt : {dc::partition_group_options{}, dc::partition_group_options{16, 64}}) {
    CAPTURE(opt.direct_min_bytes);
    check_exact(zero1(), opt);
    check_exact(zero3(), opt);
    check_exact(tp2_dp2(), opt);
    check_exact(pipeline_2x2(true), opt);
    check_exact(pipeline_2x2(false), opt);
    std::mt19937_64 rng(21);
    auto pick = [&](std::uint64_t n) { return n ? rng() % n : 0; };
    for (int round = 0; round < 20; ++round) {
      CAPTURE(round);
      check_exact(random_scenario(pick), opt);
    }
  }
}

TEST_CASE("partition transfer: gathered messages (one checksum per run) arrive byte-exact, gathered or packed") {
  const auto tp = tp2_dp2();
  const auto groups = dc::make_partition_groups(dc::make_partition_plan(tp.lay, tp.src, tp.dst), 4, 3, gather_small);
  std::size_t gathered = 0;
  for (const auto& g : groups.groups())
    for (const auto& m : g.messages) gathered += m.gather;
  CHECK(gathered > 0);  // else this test would not test the gathered path
  SUBCASE("packed by deepclone on a transport without the capability") {
    check_exact(tp2_dp2(), gather_small);
    check_exact(zero1(), gather_small);
  }
  SUBCASE("gathered and scattered by the transport") {
    for (const auto& s : {tp2_dp2(), zero1()}) {
      auto used = std::make_shared<std::atomic<int>>(0);
      ranks_of<gathering_inproc> ranks(s, [&](dc::inproc::communicator c) { return gathering_inproc(std::move(c), used); });
      check_clones(s, transfer(s, gather_small, ranks.comms));
      CHECK(used->load() > 0);
    }
  }
}

TEST_CASE("partition transfer: gathered messages keep their path through emulated_link, paced by their total size") {
  const auto s = tp2_dp2();
  const auto ranks = static_cast<int>(s.src.size() + s.dst.size());
  constexpr double bandwidth = 50e6;  // bytes/s: each clone rank's link takes milliseconds
  dc::inproc::world w(ranks);
  auto used = std::make_shared<std::atomic<int>>(0);
  auto fabric = std::make_shared<dc::link_fabric<>>(ranks, dc::link_config{bandwidth, 0us});
  using link = dc::emulated_link<gathering_inproc>;
  std::vector<std::unique_ptr<link>> comms;
  std::vector<link*> ptrs;
  for (int r = 0; r < ranks; ++r) ptrs.push_back(comms.emplace_back(std::make_unique<link>(gathering_inproc(w.comm(r), used), fabric)).get());
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = transfer(s, gather_small, ptrs);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(used->load() > 0);  // the decorator offered the capability and the transfer took it
  std::uint64_t wanted = 0;
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) wanted += own_tensors(s.lay, s.dst[0], false)[t].size();
  CHECK(took >= static_cast<double>(wanted) / bandwidth);  // clone rank 0's link carried at least its bytes
  for (std::size_t c = 0; c < s.dst.size(); ++c) {
    CHECK_FALSE(r.clone_errors[c]);
    for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK_MESSAGE(holds_pattern(s, c, r.dst[c], t), "clone rank " << c << ", tensor " << t);
  }
}

TEST_CASE("partition transfer: a corrupted message fails its checksum, naming the group and the tensor") {
  // Layer 0's data tag from source 0 (rank 0) to clone rank 0 (rank 4): its first message.
  const auto what = error_with({.action = dc::fault::kind::corrupt, .from = 0, .to = 4, .tag_lo = tag_base + 2}, 10s, dc::errc::corrupt_message);
  CHECK(contains(what, "failed its checksum"));
  CHECK(contains(what, "layer 'fc1' from source 0 to clone rank 0"));
  CHECK(contains(what, "tensor 'fc1."));
}

TEST_CASE("partition transfer: corrupted checksums are refused before they are read") {
  const auto what = error_with({.action = dc::fault::kind::corrupt, .from = 0, .to = 4, .tag_lo = tag_base + 3, .bytes = {5}},
                               10s, dc::errc::corrupt_message);
  CHECK(contains(what, "partition checksums"));
}

TEST_CASE("partition transfer: a silent source times out, naming the group still missing") {
  const auto what = error_with({.action = dc::fault::kind::drop, .from = 1, .to = 4, .times = 0}, 300ms, dc::errc::timeout);
  CHECK(contains(what, "from source 1 to clone rank 0"));
}

TEST_CASE("partition transfer: a source learns per layer when its sends completed, so it may update that layer") {
  // One source, one clone rank, everything replicated; fc1's weight (12 KiB) travels by
  // rendezvous in-process, so its send completes only once the clone rank received it.
  scenario s{two_layer_model(), {dc::holdings::replicated(two_layer_model())}, {dc::holdings::replicated(two_layer_model())}};
  dc::inproc::world w(2);
  const auto roles = dc::roles::contiguous(1, 1);
  const auto groups = dc::make_partition_groups(dc::make_partition_plan(s.lay, s.src, s.dst), 1, 1);
  const dc::partition_route route{roles, s.lay, groups, tag_base};
  auto src = own_tensors(s.lay, s.src[0], true), dst = own_tensors(s.lay, s.dst[0], false);
  const auto in = spans<const std::byte>(src);
  auto c0 = w.comm(0), c1 = w.comm(1);
  dc::partition_sender<dc::inproc::communicator> send(c0, route, 0, in);
  send.send_layer(1);
  CHECK(send.layer_sent(0));  // nothing of fc1 posted yet
  CHECK_FALSE(send.layer_sent(1));
  CHECK_THROWS_AS(send.layer_sent(2), dc::error);  // two layers
  try {
    send.wait_layer(1, 50ms);  // no receiver yet
    FAIL("waited for a send nobody received");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::timeout);
    CHECK(contains(e.what(), "sends of layer 'fc2'"));
  }
  std::thread clone([&] {
    const auto out = spans<std::byte>(dst);
    dc::partition_receiver<dc::inproc::communicator> receive(c1, route, 0, out);
    receive.wait(10s);
  });
  send.wait_layer(1, 10s);  // the trainer may update fc2 now, while fc1 has not even left
  src[s.lay.first_tensor(1)][0] = std::byte{0x5A};
  send.send_layer(0);
  send.wait(10s);
  clone.join();
  CHECK(send.done());
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK_MESSAGE(holds_pattern(s, 0, dst, t), "tensor " << t);
}

namespace {
/// Sends that never complete on their own and that cancel only parks, as Open MPI's: a
/// withdrawn send reports completion, yet still reads its buffer when a receive matches it.
/// Each clone rank's hello (from rank 4 + c) arrives once, on the control tag.
struct parked_sends {
  struct request_type {
    std::size_t id = 0;
    bool cancelled = false;
    std::optional<std::size_t> arrived;
  };
  std::vector<std::span<const std::byte>> sends;
  std::vector<std::vector<std::byte>> hellos;  // per clone rank, taken by the first receive
  int rank() const { return 0; }
  int size() const { return 8; }
  request_type isend(int, int, std::span<const std::byte> b) {
    sends.push_back(b);
    return {sends.size() - 1, false, std::nullopt};
  }
  request_type irecv(int from, int tag, std::span<std::byte> b) {
    const auto c = static_cast<std::size_t>(from - 4);
    if (tag != tag_base || c >= hellos.size() || hellos[c].empty() || hellos[c].size() > b.size()) return {};
    std::copy(hellos[c].begin(), hellos[c].end(), b.begin());
    request_type r{0, false, hellos[c].size()};
    hellos[c].clear();
    return r;
  }
  std::optional<std::size_t> test(request_type& r) {
    if (r.arrived) return r.arrived;
    return r.cancelled ? std::optional<std::size_t>(0) : std::nullopt;
  }
  void cancel(request_type& r) { r.cancelled = true; }
  std::vector<std::byte> deliver(std::size_t id) const { return {sends[id].begin(), sends[id].end()}; }
};
}  // namespace

TEST_CASE("partition transfer: after cancel, packed buffers a transport could not withdraw stay valid and are not reused") {
  const auto s = tp2_dp2();
  const auto n = static_cast<std::uint32_t>(s.src.size()), m = static_cast<std::uint32_t>(s.dst.size());
  const auto roles = dc::roles::contiguous(n, m);
  const auto groups = dc::make_partition_groups(dc::make_partition_plan(s.lay, s.src, s.dst), n, m, gather_small);
  const dc::partition_route route{roles, s.lay, groups, tag_base};
  auto src = own_tensors(s.lay, s.src[0], true);
  const auto own = spans<const std::byte>(src);
  parked_sends c;
  for (std::uint32_t k = 0; k < m; ++k)
    c.hellos.push_back(dc::detail::partition_hello{k, dc::detail::groups_fingerprint(groups), dc::global_declaration::of(s.lay).fingerprint()}.encode());
  std::vector<std::vector<std::byte>> sent;
  {
    dc::partition_sender<parked_sends> send(c, route, 0, own);
    send.send_all();
    REQUIRE(c.sends.size() > 10);  // the hellos came: the groups left (else nothing here is tested)
    for (std::size_t i = 0; i < c.sends.size(); ++i) sent.push_back(c.deliver(i));
    send.cancel();
    CHECK(send.done());     // every send reports completion once withdrawn...
    send.send_layer(1);     // ...yet a later message must not be packed into a parked one's buffer
  }
  // Freshly allocated memory of the same sizes would reuse a freed buffer.
  std::vector<std::vector<std::byte>> churn;
  for (const auto& b : sent) churn.emplace_back(b.size(), std::byte{0xEE});
  for (std::size_t i = 0; i < sent.size(); ++i) CHECK_MESSAGE(c.deliver(i) == sent[i], "send " << i);  // ASan: use after free
}

TEST_CASE("partition transfer: tags beyond the communicator's bound are refused before anything is posted") {
  const auto s = zero1();
  dc::inproc::world w(6);
  auto c = w.comm(4);
  const auto roles = dc::roles::contiguous(4, 2);
  const auto groups = dc::make_partition_groups(dc::make_partition_plan(s.lay, s.src, s.dst), 4, 2);
  auto dst = own_tensors(s.lay, s.dst[0], false);
  const auto own = spans<std::byte>(dst);
  const int base = std::numeric_limits<int>::max() - 2;  // the in-process transport's bound is INT_MAX
  try {
    dc::partition_receiver<dc::inproc::communicator> r(c, dc::partition_route{roles, s.lay, groups, base}, 0, own);
    FAIL("constructed with tags beyond INT_MAX");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::unsupported);
    CHECK(contains(e.what(), std::to_string(base) + " to 2147483650"));
  }
}

namespace {
/// Scenario `s` (N=4 -> M=2) in which clone rank 1 planned with layout `lay1`, clone holdings
/// `dst1` and groups `groups1` of its own. Checks that clone rank 0 gets every byte, clone
/// rank 1 none, and every source finishes, refusing clone rank 1; returns clone rank 1's error.
dc::error mismatched_clone(const scenario& s, const dc::layout& lay1, const std::vector<dc::holdings>& dst1, const dc::partition_groups& groups1) {
  const auto roles = dc::roles::contiguous(4, 2);
  const auto groups = dc::make_partition_groups(dc::make_partition_plan(s.lay, s.src, s.dst), 4, 2);
  const dc::partition_route route{roles, s.lay, groups, tag_base}, route1{roles, lay1, groups1, tag_base};
  dc::inproc::world w(6);
  std::vector<dc::inproc::communicator> comms;
  for (int r = 0; r < 6; ++r) comms.push_back(w.comm(r));
  std::vector<std::vector<std::vector<std::byte>>> src;
  for (const auto& h : s.src) src.push_back(own_tensors(s.lay, h, true));
  auto dst0 = own_tensors(s.lay, s.dst[0], false), dst1_own = own_tensors(lay1, dst1[1], false);
  const auto untouched = dst1_own;
  std::vector<char> refused(4, 0);
  std::optional<dc::error> error1;
  std::vector<std::thread> threads;
  for (std::uint32_t i = 0; i < 4; ++i)
    threads.emplace_back([&, i] {
      const auto own = spans<const std::byte>(src[i]);
      dc::partition_sender<dc::inproc::communicator> send(comms[i], route, i, own);
      send.send_all();
      send.wait(10s);
      refused[i] = send.refused(1) && !send.refused(0);
    });
  threads.emplace_back([&] {
    const auto own = spans<std::byte>(dst0);
    dc::partition_receiver<dc::inproc::communicator>(comms[4], route, 0, own).wait(10s);
  });
  threads.emplace_back([&] {
    const auto own = spans<std::byte>(dst1_own);
    try {
      dc::partition_receiver<dc::inproc::communicator>(comms[5], route1, 1, own).wait(10s);
    } catch (const dc::error& e) {
      error1 = e;
    }
  });
  for (auto& t : threads) t.join();
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK(holds_pattern(s, 0, dst0, t));
  CHECK(dst1_own == untouched);
  CHECK(refused == std::vector<char>(4, 1));
  REQUIRE(error1);
  return *error1;
}
}  // namespace

TEST_CASE("partition transfer: a clone rank that declares another global layout is refused before any byte moves, naming the tensor") {
  auto lay1 = dc::layout{};
  lay1.add_layer({"fc1", {tensor("weight", {64, 48}), tensor("bias", {64}), tensor("weight.adam_m", {64, 48})}});
  lay1.add_layer({"fc2", {tensor("weight", {48, 64}), tensor("bias", {47}), tensor("weight.adam_m", {48, 64})}});
  const std::vector<dc::holdings> src1(4, dc::holdings::replicated(lay1)), dst1(2, dc::holdings::replicated(lay1));
  const auto e = mismatched_clone(zero1(), lay1, dst1, dc::make_partition_groups(dc::make_partition_plan(lay1, src1, dst1), 4, 2));
  CHECK(e.kind() == dc::errc::layout_mismatch);
  CHECK(contains(e.what(), "global tensor 4 ('fc2.bias') shape: sources declare [48], clone rank 1 declares [47]"));
  CHECK(contains(e.what(), "refused by source"));
}

TEST_CASE("partition transfer: a clone rank that planned with other holdings is refused before any byte moves") {
  const auto s = zero1();
  auto src1 = s.src;
  src1[3] = src1[2];  // source 3 declared as holding source 2's slot partition: another plan
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t)
    if (is_slot(s.lay.tensor(t).name)) src1[2].of_tensor[t] = uneven_flat(s.lay.tensor(t), 4, 3);
  const auto e = mismatched_clone(s, s.lay, s.dst, dc::make_partition_groups(dc::make_partition_plan(s.lay, src1, s.dst), 4, 2));
  CHECK(e.kind() == dc::errc::plan_mismatch);
  CHECK(contains(e.what(), "planned different transfers"));
}

TEST_CASE("partition transfer: a clone rank with far more tensors is refused too, naming the difference") {
  auto lay1 = two_layer_model();
  std::vector<dc::tensor_desc> many;  // a declaration many times the sources' size: the hello stays small
  for (int i = 0; i < 200; ++i) many.push_back(tensor("a tensor with a long name, number " + std::to_string(i), {4}));
  lay1.add_layer({"extra", many});
  const std::vector<dc::holdings> src1(4, dc::holdings::replicated(lay1)), dst1(2, dc::holdings::replicated(lay1));
  const auto e = mismatched_clone(zero1(), lay1, dst1, dc::make_partition_groups(dc::make_partition_plan(lay1, src1, dst1), 4, 2));
  CHECK(e.kind() == dc::errc::layout_mismatch);
  CHECK(contains(e.what(), "tensor count: sources declare 6, clone rank 1 declares 206"));
}

TEST_CASE("partition transfer: sources whose declaration is too large to attach still refuse a clone rank that planned otherwise") {
  scenario big{two_layer_model(), {}, {}};
  std::vector<dc::tensor_desc> many;
  for (int i = 0; i < 200; ++i) many.push_back(tensor("a tensor with a long name, number " + std::to_string(i), {4}));
  big.lay.add_layer({"extra", many});
  big.src.assign(4, dc::holdings::replicated(big.lay));
  big.dst.assign(2, dc::holdings::replicated(big.lay));
  const auto small = two_layer_model();
  const std::vector<dc::holdings> src1(4, dc::holdings::replicated(small)), dst1(2, dc::holdings::replicated(small));
  const auto e = mismatched_clone(big, small, dst1, dc::make_partition_groups(dc::make_partition_plan(small, src1, dst1), 4, 2));
  CHECK(e.kind() == dc::errc::layout_mismatch);
  CHECK(contains(e.what(), "declares another global layout"));
  CHECK(contains(e.what(), "too large to attach"));
}

TEST_CASE("partition transfer with sharing: clone ranks forward what they verified; every clone byte exact") {
  const auto ex = dc::partition_sharing::exchange;
  for (const auto& opt : {dc::partition_group_options{}, dc::partition_group_options{16, 64}, gather_small}) {
    CAPTURE(opt.direct_min_bytes);
    check_exact(zero1(), opt, ex);
    check_exact(zero3(), opt, ex);
    check_exact(tp2_dp2(), opt, ex);
    check_exact(pipeline_2x2(true), opt, ex);
    check_exact(pipeline_2x2(false), opt, ex);
    std::mt19937_64 rng(23);
    auto pick = [&](std::uint64_t n) { return n ? rng() % n : 0; };
    for (int round = 0; round < 20; ++round) {
      CAPTURE(round);
      check_exact(random_scenario(pick), opt, ex);
    }
  }
}

TEST_CASE("partition transfer with sharing: a corrupted forward is refused naming the forwarding clone rank") {
  // ZeRO-1 into M=2 replicated: every forward goes between the clone ranks (ranks 4 and 5).
  const dc::fault::rule corrupt{.action = dc::fault::kind::corrupt, .from = 5, .to = 4, .tag_lo = tag_base + 2};  // layer 0's data
  const auto s = zero1();
  dc::inproc::world w(6);
  auto faults = std::make_shared<dc::fault::plan>();
  faults->add(corrupt);
  std::vector<std::unique_ptr<dc::faulty<dc::inproc::communicator>>> comms;
  std::vector<dc::faulty<dc::inproc::communicator>*> ptrs;
  for (int r = 0; r < 6; ++r) ptrs.push_back(comms.emplace_back(std::make_unique<dc::faulty<dc::inproc::communicator>>(w.comm(r), faults)).get());
  const auto r = transfer(s, dc::partition_group_options{16, 64}, ptrs, 2s, dc::partition_sharing::exchange);
  REQUIRE(r.clone_errors[0]);
  try {
    std::rethrow_exception(r.clone_errors[0]);
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::corrupt_message);
    CHECK_MESSAGE(contains(e.what(), "from clone rank 1 to clone rank 0"), e.what());
  }
}
