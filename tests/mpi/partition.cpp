// The partitioned plan's groups moved over MPI (partition_transfer.hpp through the Boost.MPI
// adapter), one process per rank: ZeRO-1 N=4 -> M=2 replicated, ZeRO-3 N=4 -> ZeRO-3 M=2,
// TP2xDP2 -> TP1 on M=3, pipeline 2 stages x DP2 -> 2 stages and -> one stage on M=2, and
// randomised holdings (up to 4 sources and 3 clone ranks), each clone rank checking every byte
// it wants against the source pattern of its global position; also with the clone ranks
// sharing what several want (partition_sharing::exchange). Run on 7 ranks; ranks beyond a
// scenario's N + M sit it out. Sources send their layers last-first. Packed runs also travel
// gathered and scattered as MPI derived datatypes (the adapter's gathering_communicator), also
// where the adapter's piece size makes it stage them. Last, the partitioned engine
// (partition_engine.hpp): sources that train and agree on k in their own allreduce (or
// through the coordinator), clone ranks that fork twice and check every byte against the
// sources' of k, and the metadata against source 0's of k.
#include <deepclone/integrations/boost_mpi.hpp>
#include <deepclone/partition_engine.hpp>
#include <deepclone/partition_transfer.hpp>

#include <doctest/doctest.h>

#include <boost/mpi/communicator.hpp>

#include <algorithm>
#include <chrono>
#include <random>

#include "../partition/training.hpp"

namespace dc = deepclone;
using namespace partition_test;

namespace {

/// This rank's part of moving scenario `s`; a clone rank checks every byte it wants.
void run(dc::mpi::communicator& c, const scenario& s, const dc::partition_group_options& opt,
         dc::partition_sharing sharing = dc::partition_sharing::none) {
  const auto n = static_cast<std::uint32_t>(s.src.size()), m = static_cast<std::uint32_t>(s.dst.size());
  const auto roles = dc::roles::contiguous(n, m);
  const auto groups = dc::make_partition_groups(dc::make_partition_plan(s.lay, s.src, s.dst, 256, sharing), n, m, opt);
  const dc::partition_route route{roles, s.lay, groups, 100};
  const auto me = static_cast<std::uint32_t>(c.rank());
  if (me < n) {
    auto own = own_tensors(s.lay, s.src[me], true);
    const auto bytes = spans<const std::byte>(own);
    dc::partition_sender<dc::mpi::communicator> send(c, route, me, bytes);
    for (auto l = static_cast<std::uint32_t>(s.lay.layer_count()); l-- > 0;) send.send_layer(l);
    send.wait(std::chrono::seconds(60));
  } else if (me < n + m) {
    auto own = own_tensors(s.lay, s.dst[me - n], false);
    const auto bytes = spans<std::byte>(own);
    dc::partition_receiver<dc::mpi::communicator> receive(c, route, me - n, bytes);
    receive.wait(std::chrono::seconds(60));
    for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t)
      CHECK_MESSAGE(holds_pattern(s, me - n, own, t), "clone rank " << me - n << ", tensor " << t);
  }
  c.barrier();  // the next scenario's messages use the same tags
}

/// Clone rank `clone` receives everything `route` sends it and checks every byte.
void receive_and_check(dc::mpi::communicator& c, const dc::partition_route& route, const scenario& s, std::uint32_t clone) {
  auto own = own_tensors(s.lay, s.dst[clone], false);
  const auto bytes = spans<std::byte>(own);
  dc::partition_receiver<dc::mpi::communicator>(c, route, clone, bytes).wait(std::chrono::seconds(60));
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) CHECK_MESSAGE(holds_pattern(s, clone, own, t), "clone rank " << clone << ", tensor " << t);
}

constexpr int finished_tag = 60;  // clone rank -> source 0: the iterations it forked at

/// Scenario `s` through partition_engine: the sources train until every clone rank forked
/// `forks` times (source 0 hears it from each and checks that all got the same k's).
template <class Engine>
void fork_while_training(dc::mpi::communicator& c, const scenario& s, dc::partition_sharing sharing, collective_at at, int forks) {
  const auto n = static_cast<std::uint32_t>(s.src.size()), m = static_cast<std::uint32_t>(s.dst.size());
  const auto roles = dc::roles::contiguous(n, m);
  const dc::partition_job job(roles, s.lay, s.src, s.dst, {.sharing = sharing});
  const auto me = static_cast<std::uint32_t>(c.rank());
  std::vector<std::uint64_t> ks(static_cast<std::size_t>(forks) * m);  // source 0: every clone rank's; a clone rank: its own
  if (me < n) {
    trainer t(s, me);
    typename Engine::source src(c, job, t.parts());
    std::vector<dc::mpi::communicator::request_type> heard;
    for (std::uint32_t j = 0; me == 0 && j < m; ++j)
      heard.push_back(c.irecv(int(n + j), finished_tag, std::as_writable_bytes(std::span(ks).subspan(j * forks, forks))));
    std::vector<char> got(heard.size(), 0);
    const auto finished = [&] {
      for (std::size_t j = 0; j < heard.size(); ++j) got[j] = got[j] || c.test(heard[j]).has_value();
      return me == 0 && std::count(got.begin(), got.end(), 1) == std::ptrdiff_t(m);
    };
    train<Engine>(c, s, roles, src, t, finished, at);
    src.finish();
    CHECK(src.forks_completed() == std::uint64_t(forks));
    CHECK(src.forks_failed() == 0);
    for (std::uint32_t j = 1; me == 0 && j < m; ++j)
      CHECK_MESSAGE(std::equal(ks.begin(), ks.begin() + forks, ks.begin() + j * forks), "clone rank " << j << " forked at other iterations");
  } else if (me < n + m) {
    auto own = own_tensors(s.lay, s.dst[me - n], false);
    const auto parts = spans<std::byte>(own);
    typename Engine::clone dst(c, job, parts);
    for (int f = 0; f < forks; ++f) {
      for (auto& t : own) std::fill(t.begin(), t.end(), std::byte{0xEE});
      ks[f] = dst.wait();
      CHECK_MESSAGE(exact(s, me - n, own, ks[f]), "clone rank " << me - n << ", fork " << f << " at iteration " << ks[f]);
      CHECK_MESSAGE(dst.metadata() == fork_metadata(ks[f]), "clone rank " << me - n << ": not source 0's metadata of iteration " << ks[f]);
      if (f > 0) CHECK(ks[f] > ks[f - 1]);
    }
    auto r = c.isend(0, finished_tag, std::as_bytes(std::span(ks).first(forks)));
    c.wait(r);
  }
  c.barrier();
}

}  // namespace

TEST_CASE("partition engine over MPI: sources train and agree on k; every clone byte is theirs of k, fork after fork") {
  boost::mpi::communicator world;
  dc::mpi::communicator c(world);
  using collective = dc::partition_engine<dc::mpi::communicator>;
  using coordinator = dc::partition_engine<dc::mpi::communicator, dc::agreement::coordinator>;
  fork_while_training<collective>(c, tp2_dp2(), dc::partition_sharing::none, collective_at::boundary, 2);
  fork_while_training<collective>(c, zero1(), dc::partition_sharing::exchange, collective_at::after_first_update, 2);
  fork_while_training<coordinator>(c, pipeline_2x2(true), dc::partition_sharing::none, collective_at::none, 2);
}

TEST_CASE("partition transfer over MPI: ZeRO-1, ZeRO-3, TP2xDP2, pipeline x DP and randomised holdings, byte-exact") {
  boost::mpi::communicator world;
  REQUIRE(world.size() >= 7);
  dc::mpi::communicator c(world);
  // Default, tiny messages, and packed runs gathered as MPI datatypes (hindexed) from 64 and 4 bytes on.
  for (const auto& opt : {dc::partition_group_options{}, dc::partition_group_options{16, 64}, dc::partition_group_options{4096, 1 << 20, 64},
                          dc::partition_group_options{16, 64, 4}}) {
    run(c, zero1(), opt);
    run(c, zero3(), opt);
    run(c, tp2_dp2(), opt);
    run(c, pipeline_2x2(true), opt);
    run(c, pipeline_2x2(false), opt);
    std::mt19937_64 rng(5);  // the same scenarios on every rank
    auto pick = [&](std::uint64_t k) { return k ? rng() % k : 0; };
    for (int round = 0; round < 10; ++round) run(c, random_scenario(pick), opt);
  }
}

TEST_CASE("partition transfer over MPI with sharing: clone ranks forward what they verified, byte-exact") {
  boost::mpi::communicator world;
  dc::mpi::communicator c(world);
  for (const auto& opt : {dc::partition_group_options{}, dc::partition_group_options{4096, 1 << 20, 64}}) {
    for (const auto& s : {zero1(), zero3(), tp2_dp2(), pipeline_2x2(true), pipeline_2x2(false)}) run(c, s, opt, dc::partition_sharing::exchange);
    std::mt19937_64 rng(7);  // the same scenarios on every rank
    auto pick = [&](std::uint64_t k) { return k ? rng() % k : 0; };
    for (int round = 0; round < 10; ++round) run(c, random_scenario(pick), opt, dc::partition_sharing::exchange);
  }
}

TEST_CASE("partition transfer over MPI: gathered messages beyond the adapter's piece size travel packed and split") {
  boost::mpi::communicator world;
  dc::mpi::options small;
  small.max_message_bytes = 100;  // most gathered messages would be split: the adapter stages them
  dc::mpi::communicator c(world, small);
  run(c, tp2_dp2(), dc::partition_group_options{4096, 1 << 20, 64});
  run(c, zero1(), dc::partition_group_options{4096, 1 << 20, 64});
}

TEST_CASE("partition transfer over MPI: a silent tensor-parallel source fails over to its twin while the sources train on") {
  boost::mpi::communicator world;
  dc::mpi::communicator c(world);
  const auto s = tp2_dp2();
  const auto roles = dc::roles::contiguous(4, 3);
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst);
  const dc::partition_group_options opt{16, 256};
  const auto groups = dc::make_partition_groups(plan, 4, 3, opt);
  const dc::partition_failover failover{s.src, plan, opt, 256, std::chrono::milliseconds(500)};
  const auto me = static_cast<std::uint32_t>(c.rank());
  for (std::uint32_t dead : {1u, 2u}) {
    // Its own tags: the notices the clone ranks sent the silent rank stay unreceived.
    const dc::partition_route route{roles, s.lay, groups, 200 + 10 * static_cast<int>(dead), &failover};
    if (me < 4 && me != dead) {
      auto own = own_tensors(s.lay, s.src[me], true);
      const auto bytes = spans<const std::byte>(own);
      dc::partition_sender<dc::mpi::communicator> send(c, route, me, bytes);
      for (auto l = static_cast<std::uint32_t>(s.lay.layer_count()); l-- > 0;) send.send_layer(l);
      for (auto l = static_cast<std::uint32_t>(s.lay.layer_count()); l-- > 0;) {
        send.wait_layer(l, std::chrono::seconds(60));  // then the trainer updates the layer
        for (std::size_t t = s.lay.first_tensor(l); t < s.lay.first_tensor(l) + s.lay.layers()[l].tensors.size(); ++t)
          std::fill(own[t].begin(), own[t].end(), std::byte{0});
      }
      send.wait(std::chrono::seconds(60));
    } else if (me >= 4 && me < 7) {
      auto own = own_tensors(s.lay, s.dst[me - 4], false);
      const auto bytes = spans<std::byte>(own);
      dc::partition_receiver<dc::mpi::communicator> receive(c, route, me - 4, bytes);
      receive.wait(std::chrono::seconds(60));
      for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t)
        CHECK_MESSAGE(holds_pattern(s, me - 4, own, t), "clone rank " << me - 4 << ", tensor " << t << ", source " << dead << " silent");
    }
    c.barrier();
  }
}

TEST_CASE("partition transfer over MPI: a clone rank that declares another global layout is refused before any byte moves") {
  boost::mpi::communicator world;
  dc::mpi::communicator c(world);
  const auto s = zero1();
  dc::layout other;  // fc2.bias is [47] instead of [48] on clone rank 1
  other.add_layer({"fc1", {tensor("weight", {64, 48}), tensor("bias", {64}), tensor("weight.adam_m", {64, 48})}});
  other.add_layer({"fc2", {tensor("weight", {48, 64}), tensor("bias", {47}), tensor("weight.adam_m", {48, 64})}});
  const std::vector<dc::holdings> other_src(4, dc::holdings::replicated(other)), other_dst(2, dc::holdings::replicated(other));
  const auto roles = dc::roles::contiguous(4, 2);
  const auto groups = dc::make_partition_groups(dc::make_partition_plan(s.lay, s.src, s.dst), 4, 2);
  const auto other_groups = dc::make_partition_groups(dc::make_partition_plan(other, other_src, other_dst), 4, 2);
  const dc::partition_route route{roles, s.lay, groups, 300}, other_route{roles, other, other_groups, 300};
  const auto me = static_cast<std::uint32_t>(c.rank());
  if (me < 4) {
    auto own = own_tensors(s.lay, s.src[me], true);
    const auto bytes = spans<const std::byte>(own);
    dc::partition_sender<dc::mpi::communicator> send(c, route, me, bytes);
    send.send_all();
    send.wait(std::chrono::seconds(60));
    CHECK(send.refused(1));
    CHECK_FALSE(send.refused(0));
  } else if (me == 4) {
    receive_and_check(c, route, s, 0);
  } else if (me == 5) {
    auto own = own_tensors(other, other_dst[1], false);
    const auto untouched = own;
    const auto bytes = spans<std::byte>(own);
    try {
      dc::partition_receiver<dc::mpi::communicator>(c, other_route, 1, bytes).wait(std::chrono::seconds(60));
      FAIL("a clone rank with another layout was served");
    } catch (const dc::error& e) {
      CHECK(e.kind() == dc::errc::layout_mismatch);
      CHECK(std::string(e.what()).find("('fc2.bias') shape: sources declare [48], clone rank 1 declares [47]") != std::string::npos);
    }
    CHECK(own == untouched);
  }
  c.barrier();
}

TEST_CASE("partition transfer over MPI with sharing and failover: a refused clone rank says farewell; its peer gets everything from the sources") {
  boost::mpi::communicator world;
  dc::mpi::communicator c(world);
  const auto s = zero1();  // M=2 replicated: half of every byte comes forwarded from the other clone rank
  const auto roles = dc::roles::contiguous(4, 2);
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst, 256, dc::partition_sharing::exchange);
  const dc::partition_group_options opt{16, 256}, other{32, 512};  // clone rank 1 plans with other options: refused
  const auto groups = dc::make_partition_groups(plan, 4, 2, opt), other_groups = dc::make_partition_groups(plan, 4, 2, other);
  // Presuming silence would take 120 s, past the 60 s timeout: only the farewell gets clone rank 0 done.
  const dc::partition_failover failover{s.src, plan, opt, 256, std::chrono::seconds(120)},
      other_failover{s.src, plan, other, 256, std::chrono::seconds(120)};
  const dc::partition_route route{roles, s.lay, groups, 400, &failover}, other_route{roles, s.lay, other_groups, 400, &other_failover};
  const auto me = static_cast<std::uint32_t>(c.rank());
  if (me < 4) {
    auto own = own_tensors(s.lay, s.src[me], true);
    const auto bytes = spans<const std::byte>(own);
    dc::partition_sender<dc::mpi::communicator> send(c, route, me, bytes);
    for (auto l = static_cast<std::uint32_t>(s.lay.layer_count()); l-- > 0;) send.send_layer(l);
    send.wait(std::chrono::seconds(60));
    CHECK(send.refused(1));
  } else if (me == 4) {
    receive_and_check(c, route, s, 0);
  } else if (me == 5) {
    auto own = own_tensors(s.lay, s.dst[1], false);
    const auto bytes = spans<std::byte>(own);
    try {
      dc::partition_receiver<dc::mpi::communicator>(c, other_route, 1, bytes).wait(std::chrono::seconds(60));
      FAIL("a clone rank that planned otherwise was served");
    } catch (const dc::error& e) {
      CHECK_MESSAGE(std::string(e.what()).find("plan") != std::string::npos, e.what());
    }
  }
  c.barrier();
}
