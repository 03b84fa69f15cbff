// Failover of the partitioned transfer (partition_transfer.hpp with route.failover;
// detail/partition_failover.hpp), in-process, one thread per rank. Live sources train on:
// each overwrites a layer as soon as it is reported sent, so a source that released a layer
// before every clone rank verified it would hand a clone rank garbage when asked to stand
// in for a failed holder, and the byte check below would see it. A source silent from the
// start, or dying after its first layer, is presumed failed and its groups come from its
// replicas, byte-exact; where no replica exists, the clone rank's error says so. Notices a
// clone rank sends that a source cannot serve are dropped and counted, never thrown.
#include <doctest/doctest.h>

#include <deepclone/fault_injection.hpp>
#include <deepclone/inproc.hpp>
#include <deepclone/partition_transfer.hpp>

#include <chrono>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "scenarios.hpp"

namespace dc = deepclone;
using namespace partition_test;
using namespace std::chrono_literals;

namespace {

constexpr int tag_base = 40;
using comm_t = dc::faulty<dc::inproc::communicator>;  // faults only where a test adds a rule

/// How a source behaves: sends every layer and trains on, never starts, or sends its last
/// layer and then dies (its sender destroyed, as a crash withdraws its sends).
enum class source_fate { live, silent, dies_after_one_layer };

struct outcome {
  std::vector<std::vector<std::vector<std::byte>>> dst;
  std::vector<std::exception_ptr> clone_errors, source_errors;
};

/// A live source: sends its layers last-first, then updates each (writes 0x00 over its part
/// of the layer) as soon as it is reported sent, then waits until done.
void run_source(comm_t& c, const dc::partition_route& route, std::uint32_t i, std::vector<std::vector<std::byte>>& own,
                source_fate fate, std::chrono::nanoseconds timeout) {
  const auto in = spans<const std::byte>(own);
  dc::partition_sender<comm_t> send(c, route, i, in);
  const auto layers = static_cast<std::uint32_t>(route.global.layer_count());
  for (auto l = layers; l-- > 0;) {
    send.send_layer(l);
    if (fate == source_fate::dies_after_one_layer) return;
  }
  for (auto l = layers; l-- > 0;) {
    send.wait_layer(l, timeout);
    for (std::size_t t = route.global.first_tensor(l); t < route.global.first_tensor(l) + route.global.layers()[l].tensors.size(); ++t)
      std::fill(own[t].begin(), own[t].end(), std::byte{0});
  }
  send.wait(timeout);
  CHECK(send.refused_notices() == 0);
}

/// How a clone rank behaves: receives, plans with other group options (the sources refuse
/// it), or never starts.
enum class clone_fate { live, misplanned, silent };

outcome run(const scenario& s, const std::vector<source_fate>& fates, std::chrono::nanoseconds presume, std::chrono::nanoseconds timeout = 20s,
            std::vector<dc::fault::rule> faults = {}, dc::partition_sharing sharing = dc::partition_sharing::none,
            std::vector<clone_fate> clone_fates = {}) {
  const auto n = static_cast<std::uint32_t>(s.src.size()), m = static_cast<std::uint32_t>(s.dst.size());
  const auto roles = dc::roles::contiguous(n, m);
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst, 256, sharing);
  const dc::partition_group_options opt{16, 256}, other{32, 512};
  const auto groups = dc::make_partition_groups(plan, n, m, opt), other_groups = dc::make_partition_groups(plan, n, m, other);
  const dc::partition_failover failover{s.src, plan, opt, 256, presume}, other_failover{s.src, plan, other, 256, presume};
  const dc::partition_route route{roles, s.lay, groups, tag_base, &failover}, other_route{roles, s.lay, other_groups, tag_base, &other_failover};
  clone_fates.resize(m, clone_fate::live);
  dc::inproc::world w(static_cast<int>(n + m));
  auto rules = std::make_shared<dc::fault::plan>();
  for (auto& f : faults) rules->add(f);
  std::vector<std::unique_ptr<comm_t>> comms;
  for (std::uint32_t r = 0; r < n + m; ++r) comms.push_back(std::make_unique<comm_t>(w.comm(static_cast<int>(r)), rules));
  std::vector<std::vector<std::vector<std::byte>>> src;
  outcome out;
  for (const auto& h : s.src) src.push_back(own_tensors(s.lay, h, true));
  for (const auto& h : s.dst) out.dst.push_back(own_tensors(s.lay, h, false));
  out.clone_errors.resize(m);
  out.source_errors.resize(n);
  std::vector<std::thread> threads;
  for (std::uint32_t i = 0; i < n; ++i)
    if (fates[i] != source_fate::silent)
      threads.emplace_back([&, i] {
        try {
          run_source(*comms[i], route, i, src[i], fates[i], timeout);
        } catch (...) {
          out.source_errors[i] = std::current_exception();
        }
      });
  for (std::uint32_t c = 0; c < m; ++c)
    threads.emplace_back([&, c] {
      if (clone_fates[c] == clone_fate::silent) return;
      try {
        const auto own = spans<std::byte>(out.dst[c]);
        dc::partition_receiver<comm_t> receive(*comms[n + c], clone_fates[c] == clone_fate::misplanned ? other_route : route, c, own);
        receive.wait(timeout);
      } catch (...) {
        out.clone_errors[c] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

std::string error_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

void check_all_exact(const scenario& s, const outcome& o) {
  for (std::size_t c = 0; c < s.dst.size(); ++c) {
    CHECK_MESSAGE(!o.clone_errors[c], "clone rank " << c << ": " << (o.clone_errors[c] ? error_text(o.clone_errors[c]) : ""));
    for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK_MESSAGE(holds_pattern(s, c, o.dst[c], t), "clone rank " << c << ", tensor " << t);
  }
  for (std::size_t i = 0; i < s.src.size(); ++i)
    CHECK_MESSAGE(!o.source_errors[i], "source " << i << ": " << (o.source_errors[i] ? error_text(o.source_errors[i]) : ""));
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("partition failover: with every source alive, sources that train on hand over byte-exact state") {
  const std::vector fates(4, source_fate::live);
  check_all_exact(tp2_dp2(), run(tp2_dp2(), fates, 5s));
  check_all_exact(zero1(), run(zero1(), fates, 5s));
}

TEST_CASE("partition failover: TP2xDP2, a tensor-parallel rank silent from the start; its twin stands in, byte-exact") {
  for (std::uint32_t dead = 0; dead < 4; ++dead) {
    CAPTURE(dead);
    std::vector fates(4, source_fate::live);
    fates[dead] = source_fate::silent;
    check_all_exact(tp2_dp2(), run(tp2_dp2(), fates, 500ms));
  }
}

TEST_CASE("partition failover: a source dies after its first layer; the rest of its groups come from its replica") {
  std::vector fates(4, source_fate::live);
  fates[2] = source_fate::dies_after_one_layer;
  check_all_exact(tp2_dp2(), run(tp2_dp2(), fates, 500ms));
  check_all_exact(pipeline_2x2(false), run(pipeline_2x2(false), fates, 500ms));
}

TEST_CASE("partition failover: ZeRO-1 with a source lost: its optimizer-slot partition has no replica, and the error says so") {
  std::vector fates(4, source_fate::live);
  fates[1] = source_fate::silent;
  const auto o = run(zero1(), fates, 500ms, 3s);
  for (std::size_t c = 0; c < 2; ++c) {
    REQUIRE(o.clone_errors[c]);
    try {
      std::rethrow_exception(o.clone_errors[c]);
    } catch (const dc::error& e) {
      CHECK(e.kind() == dc::errc::source_failed);
      CHECK(contains(e.what(), "no replica exists"));
      CHECK(contains(e.what(), "adam_m"));
      CHECK(contains(e.what(), "source 1"));
    }
  }
}

TEST_CASE("partition failover: a group that fails its checksum comes again from another holder; with none, the error says so") {
  // fc1's first data message from source 0 (rank 0) to clone rank 0 (rank 4), corrupted once.
  const dc::fault::rule corrupt{.action = dc::fault::kind::corrupt, .from = 0, .to = 4, .tag_lo = tag_base + 2};
  const std::vector fates(4, source_fate::live);
  check_all_exact(tp2_dp2(), run(tp2_dp2(), fates, 5s, 20s, {corrupt}));
  const auto o = run(zero1(), fates, 5s, 3s, {corrupt});  // source 0's fc1 group carries its slot partition
  REQUIRE(o.clone_errors[0]);
  try {
    std::rethrow_exception(o.clone_errors[0]);
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::corrupt_message);
    CHECK(contains(e.what(), "failed its checksum"));
    CHECK(contains(e.what(), "no replica exists"));
    CHECK(std::string(e.what()).rfind("deepclone:") == 0);  // one prefix, not two
  }
  CHECK_FALSE(o.clone_errors[1]);
}

TEST_CASE("partition failover: randomised holdings with a silent source: byte-exact, or refused where no replica exists") {
  std::mt19937_64 rng(77);
  auto pick = [&](std::uint64_t n) { return n ? rng() % n : 0; };
  int exact = 0, refused = 0;
  for (int round = 0; round < 10; ++round) {
    CAPTURE(round);
    const auto s = random_scenario(pick);
    const auto n = static_cast<std::uint32_t>(s.src.size());
    if (n < 2) continue;
    const auto dead = static_cast<std::uint32_t>(pick(n));
    std::vector fates(n, source_fate::live);
    fates[dead] = source_fate::silent;
    const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst);
    const auto o = run(s, fates, 600ms, 4s);
    for (std::uint32_t c = 0; c < s.dst.size(); ++c) {
      CAPTURE(c);
      const auto mine = plan.only([&](const dc::region_transfer& x) { return x.clone == c; });
      bool needs_dead = false, needs_live = false;
      for (const auto& x : mine.transfers()) (x.source == dead ? needs_dead : needs_live) = true;
      std::vector<bool> failed(n, false);
      failed[dead] = true;
      bool replicable = true;
      try {
        (void)dc::make_failover_plan(s.lay, s.src, mine, failed);
      } catch (const dc::error&) {
        replicable = false;
      }
      if (needs_dead && !needs_live) {  // nothing ever arrives here: silence is not presumed a failure
        REQUIRE(o.clone_errors[c]);
        CHECK(contains(error_text(o.clone_errors[c]), "did not arrive in time"));
      } else if (needs_dead && !replicable) {
        REQUIRE(o.clone_errors[c]);
        CHECK(contains(error_text(o.clone_errors[c]), "no replica exists"));
        ++refused;
      } else {
        CHECK_MESSAGE(!o.clone_errors[c], (o.clone_errors[c] ? error_text(o.clone_errors[c]) : ""));
        for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK_MESSAGE(holds_pattern(s, c, o.dst[c], t), "tensor " << t);
        exact += needs_dead;
      }
    }
  }
  CHECK(exact > 0);  // else the test would not test failover
  CHECK(refused > 0);
}

TEST_CASE("partition failover: notices a source cannot serve are dropped and counted, never thrown") {
  // Two replicated sources, one clone rank. After its hello the clone rank sends garbage on the
  // notice tag, then receives everything; afterwards it asks for a layer the sources already released.
  scenario s{two_layer_model(), {dc::holdings::replicated(two_layer_model()), dc::holdings::replicated(two_layer_model())},
             {dc::holdings::replicated(two_layer_model())}};
  const auto roles = dc::roles::contiguous(2, 1);
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst);
  const auto groups = dc::make_partition_groups(plan, 2, 1);
  const dc::partition_failover failover{s.src, plan};
  const dc::partition_route route{roles, s.lay, groups, tag_base, &failover};
  const int notice_tag = tag_base;  // the control tag
  dc::inproc::world w(3);
  auto c0 = w.comm(0), c1 = w.comm(1), c2 = w.comm(2);
  auto src0 = own_tensors(s.lay, s.src[0], true), src1 = own_tensors(s.lay, s.src[1], true), dst = own_tensors(s.lay, s.dst[0], false);
  const auto in0 = spans<const std::byte>(src0), in1 = spans<const std::byte>(src1);
  dc::partition_sender<dc::inproc::communicator> send0(c0, route, 0, in0), send1(c1, route, 1, in1);
  const std::vector<std::byte> garbage(40, std::byte{0x7F});
  using notice = dc::detail::partition_notice;
  const notice other{notice::kind::layer_verified, 5, 0, 0, {0}, {}};  // names another clone rank
  const auto other_bytes = other.encode(s.lay.layer_count(), 0);
  auto send_notice = [&](std::span<const std::byte> b) {
    auto r = c2.isend(0, notice_tag, b);
    (void)c2.wait(r);
  };
  const notice nobody{notice::kind::failover, 0, 1, 0, {0}, {0, 0}};  // source 1's transfers, but no source failed
  const notice no_forwarder{notice::kind::refetch, 0, 0, 0, {0}, {0, 0}};  // forwards of itself: there is no other clone rank
  {
    const auto out = spans<std::byte>(dst);
    dc::partition_receiver<dc::inproc::communicator> receive(c2, route, 0, out);  // its hello goes first
    send_notice(garbage);
    send_notice(other_bytes);
    send_notice(nobody.encode(s.lay.layer_count(), 0));
    send_notice(no_forwarder.encode(s.lay.layer_count(), 0));
    send0.send_all();
    send1.send_all();
    receive.wait(10s);
  }
  send0.wait(10s);
  send1.wait(10s);
  CHECK(send0.refused_notices() == 4);
  CHECK(contains(send0.last_refusal(), "forwarding clone rank 0 of 1"));
  const notice late{notice::kind::failover, 0, 1, 0, {1}, {0, 1}};  // source 1 "failed": its fc2 asked of source 0
  send_notice(late.encode(s.lay.layer_count(), 0));
  for (int i = 0; i < 1000 && send0.refused_notices() < 5; ++i) send0.progress(), std::this_thread::sleep_for(1ms);
  CHECK(send0.refused_notices() == 5);
  CHECK(contains(send0.last_refusal(), "already released"));
  CHECK(send1.refused_notices() == 0);
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK(holds_pattern(s, 0, dst, t));
}

TEST_CASE("partition failover: without route.failover, fail_over is refused with the reason") {
  const auto s = zero1();
  const auto roles = dc::roles::contiguous(4, 2);
  const auto groups = dc::make_partition_groups(dc::make_partition_plan(s.lay, s.src, s.dst), 4, 2);
  const dc::partition_route route{roles, s.lay, groups, tag_base};
  dc::inproc::world w(6);
  auto c = w.comm(4);
  auto dst = own_tensors(s.lay, s.dst[0], false);
  const auto out = spans<std::byte>(dst);
  dc::partition_receiver<dc::inproc::communicator> receive(c, route, 0, out);
  const std::vector<std::uint32_t> failed{1};
  try {
    receive.fail_over(failed);
    FAIL("failed over without failover");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::source_failed);
    CHECK(contains(e.what(), "no failover"));
  }
}

TEST_CASE("partition failover: a second failure asks again only what the newly failed source still owed") {
  // X is held by sources 0 and 1 only. Its sender's group arrives; that sender fails, then
  // the other holder of X: only X's verified bytes would need it, so nothing is refused.
  scenario s{{}, {}, {}};
  s.lay.add_layer({"a", {tensor("X", {16}), tensor("Y", {256})}});
  s.lay.add_layer({"b", {tensor("Z", {256})}});
  using parts = std::vector<dc::part>;
  const parts all{dc::part::whole()}, none{};
  s.src.assign(3, dc::holdings(3));
  s.src[0].of_tensor = {all, all, all};
  s.src[1].of_tensor = {all, all, none};
  s.src[2].of_tensor = {none, all, all};
  s.dst = {dc::holdings::replicated(s.lay)};
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst);
  std::uint32_t x_sender = 0;
  for (const auto& x : plan.transfers())
    if (x.tensor == 0) x_sender = x.source;
  const std::uint32_t other = 1 - x_sender;
  const auto roles = dc::roles::contiguous(3, 1);
  const auto groups = dc::make_partition_groups(plan, 3, 1);
  const dc::partition_failover failover{s.src, plan, {}, 256, 1h};
  const dc::partition_route route{roles, s.lay, groups, tag_base, &failover};
  dc::inproc::world w(4);
  std::vector<dc::inproc::communicator> comms{w.comm(0), w.comm(1), w.comm(2), w.comm(3)};
  std::vector<std::vector<std::vector<std::byte>>> src;
  for (const auto& h : s.src) src.push_back(own_tensors(s.lay, h, true));
  auto dst = own_tensors(s.lay, s.dst[0], false);
  std::vector<std::vector<std::span<const std::byte>>> in;
  for (auto& t : src) in.push_back(spans<const std::byte>(t));
  const auto out = spans<std::byte>(dst);
  std::vector<std::unique_ptr<dc::partition_sender<dc::inproc::communicator>>> send;
  for (std::uint32_t i = 0; i < 3; ++i) send.push_back(std::make_unique<dc::partition_sender<dc::inproc::communicator>>(comms[i], route, i, in[i]));
  dc::partition_receiver<dc::inproc::communicator> receive(comms[3], route, 0, out);
  send[x_sender]->send_layer(0);
  send[2]->send_layer(0);
  for (int i = 0; i < 1000 && !receive.layer_done(0); ++i) receive.progress(), send[2]->progress();
  const std::vector<std::uint32_t> first{x_sender}, second{other};
  receive.fail_over(first);
  CHECK_NOTHROW(receive.fail_over(second));
  send[2]->send_layer(1);
  bool done = false;
  for (int i = 0; i < 10000 && !done; ++i) send[2]->progress(), done = receive.progress();
  CHECK(done);
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK_MESSAGE(holds_pattern(s, 0, dst, t), "tensor " << t);
}

TEST_CASE("partition failover: a source named failed withdraws its sends to that clone rank before it reports them done") {
  scenario s{{}, {}, {}};
  s.lay.add_layer({"a", {tensor("A", {2048}), tensor("B", {2048})}});
  s.src = {dc::holdings::replicated(s.lay), dc::holdings::replicated(s.lay)};
  s.dst = {dc::holdings::replicated(s.lay)};
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst);
  const dc::partition_group_options packed{1 << 20, 1 << 20, 0};  // every run packed: buffers the sender owns
  const auto groups = dc::make_partition_groups(plan, 2, 1, packed);
  const auto roles = dc::roles::contiguous(2, 1);
  const dc::partition_failover failover{s.src, plan, packed, 256, 1h};
  const dc::partition_route route{roles, s.lay, groups, tag_base, &failover};
  dc::inproc::world w(3);
  auto c0 = w.comm(0), c1 = w.comm(1), c2 = w.comm(2);
  auto a = own_tensors(s.lay, s.src[0], true), b = own_tensors(s.lay, s.src[1], true), d = own_tensors(s.lay, s.dst[0], false);
  const auto ia = spans<const std::byte>(a), ib = spans<const std::byte>(b);
  const auto od = spans<std::byte>(d);
  dc::partition_sender<dc::inproc::communicator> s1(c1, route, 1, ib);
  {
    dc::partition_sender<dc::inproc::communicator> s0(c0, route, 0, ia);
    dc::partition_receiver<dc::inproc::communicator> r(c2, route, 0, od);
    s0.send_layer(0);
    const std::vector<std::uint32_t> failed{0};
    r.fail_over(failed);  // before it took source 0's packed message (8 KiB: rendezvous)
    s1.send_layer(0);
    bool done = false;
    for (int i = 0; i < 10000 && !done; ++i) s1.progress(), done = r.progress();
    CHECK(done);
    for (int i = 0; i < 10000 && !s0.done(); ++i) std::this_thread::yield();
    CHECK(s0.done());
  }
  std::vector<std::byte> sink(8192);
  auto late = c2.irecv(0, tag_base + 2, sink);  // a later transfer on the same tags finds nothing of source 0's
  CHECK_FALSE(c2.test(late));
  c2.cancel(late);
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK(holds_pattern(s, 0, d, t));
}

TEST_CASE("partition failover with sharing: a silent or dying source's share comes from its twin, and the clone rank forwards it") {
  const auto s = tp2_dp2();  // three clone ranks wanting everything: each gets a third from the sources, the rest forwarded
  for (std::uint32_t lost = 0; lost < 4; ++lost) {
    CAPTURE(lost);
    std::vector fates(4, source_fate::live);
    fates[lost] = lost % 2 ? source_fate::silent : source_fate::dies_after_one_layer;
    check_all_exact(s, run(s, fates, 300ms, 20s, {}, dc::partition_sharing::exchange));
  }
}

TEST_CASE("partition failover with sharing: a clone rank the sources refuse says farewell; its peer gets those bytes from the sources") {
  // ZeRO-1 into M=2 replicated: each clone rank gets half of every byte from the sources and
  // the other half forwarded. Clone rank 1 planned with other group options: refused.
  const auto s = zero1();
  // Presuming silence would take 60 s, past the 20 s timeout: only the farewell gets clone rank 0 done.
  const auto o = run(s, std::vector(4, source_fate::live), 60s, 20s, {}, dc::partition_sharing::exchange, {clone_fate::live, clone_fate::misplanned});
  CHECK_MESSAGE(!o.clone_errors[0], (o.clone_errors[0] ? error_text(o.clone_errors[0]) : ""));
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK_MESSAGE(holds_pattern(s, 0, o.dst[0], t), "tensor " << t);
  REQUIRE(o.clone_errors[1]);
  CHECK_MESSAGE(contains(error_text(o.clone_errors[1]), "plan"), error_text(o.clone_errors[1]));
  for (std::size_t i = 0; i < 4; ++i) CHECK_MESSAGE(!o.source_errors[i], "source " << i << ": " << (o.source_errors[i] ? error_text(o.source_errors[i]) : ""));
}

TEST_CASE("partition failover with sharing: a forward that fails its checksum comes from the sources instead") {
  const auto s = tp2_dp2();  // sources 0-3, clone ranks 4-6
  const dc::fault::rule corrupt{.action = dc::fault::kind::corrupt, .from = 5, .to = 4, .tag_lo = tag_base + 2};
  check_all_exact(s, run(s, std::vector(4, source_fate::live), 5s, 20s, {corrupt}, dc::partition_sharing::exchange));
}

TEST_CASE("partition failover with sharing: a clone rank that never starts is presumed silent; its peers get its forwards from the sources") {
  const auto s = tp2_dp2();
  const auto o = run(s, std::vector(4, source_fate::live), 300ms, 3s, {}, dc::partition_sharing::exchange,
                     {clone_fate::live, clone_fate::silent, clone_fate::live});
  for (std::uint32_t c : {0u, 2u}) {
    CHECK_MESSAGE(!o.clone_errors[c], "clone rank " << c << ": " << (o.clone_errors[c] ? error_text(o.clone_errors[c]) : ""));
    for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK_MESSAGE(holds_pattern(s, c, o.dst[c], t), "clone rank " << c << ", tensor " << t);
  }
  // The sources keep the layers clone rank 1 wants until they time out (a dead clone rank's limit).
  for (std::size_t i = 0; i < 4; ++i) CHECK(o.source_errors[i]);
}

TEST_CASE("partition failover with sharing: a clone rank that only receives forwards gets them from the sources when its forwarder never starts") {
  // One 64-byte tensor, one source, two clone ranks: the granule is the whole tensor, so one
  // clone rank gets it from the source and forwards it; the other only receives forwards.
  dc::layout lay;
  lay.add_layer({"only", {tensor("w", {16})}});
  const scenario s{lay, {dc::holdings::replicated(lay)}, {dc::holdings::replicated(lay), dc::holdings::replicated(lay)}};
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst, 256, dc::partition_sharing::exchange);
  REQUIRE(plan.forwards().size() == 1);
  const auto forwarder = plan.forwards()[0].source, other = 1 - forwarder;
  std::vector fates(2, clone_fate::live);
  fates[forwarder] = clone_fate::silent;
  const auto o = run(s, {source_fate::live}, 300ms, 3s, {}, dc::partition_sharing::exchange, fates);
  CHECK_MESSAGE(!o.clone_errors[other], (o.clone_errors[other] ? error_text(o.clone_errors[other]) : ""));
  CHECK(holds_pattern(s, other, o.dst[other], 0));
}
