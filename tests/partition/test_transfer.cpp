// The partitioned plan's bytes over a communicator (partition_transfer.hpp), in-process:
// one thread per rank, sources sending their layers last-first as a trainer updates them,
// every clone byte checked against the source pattern of its global position (ZeRO-1,
// TP2xDP2, randomised holdings, with the default and with tiny message limits); a corrupted
// message or checksum list is refused naming the group, silence times out naming it, and
// tags beyond the communicator's bound are refused before anything is posted.
#include <doctest/doctest.h>

#include <deepclone/fault_injection.hpp>
#include <deepclone/inproc.hpp>
#include <deepclone/partition_transfer.hpp>

#include <chrono>
#include <exception>
#include <limits>
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

constexpr int tag_base = 100;

/// Runs every source and clone rank of `s` on its own thread over `comms` (one per rank,
/// sources first); returns each clone rank's tensors and the first error of each clone rank.
template <class Comm>
struct run_result {
  std::vector<std::vector<std::vector<std::byte>>> dst;
  std::vector<std::exception_ptr> clone_errors;
};
template <class Comm>
run_result<Comm> transfer(const scenario& s, const dc::partition_group_options& opt, std::vector<Comm*> comms,
                          std::chrono::nanoseconds timeout = 10s) {
  const auto n = static_cast<std::uint32_t>(s.src.size()), m = static_cast<std::uint32_t>(s.dst.size());
  const auto roles = dc::roles::contiguous(n, m);
  const auto plan = dc::make_partition_plan(s.lay, s.src, s.dst);
  const auto groups = dc::make_partition_groups(plan, n, m, opt);
  const dc::partition_route route{roles, s.lay, groups, tag_base};
  std::vector<std::vector<std::vector<std::byte>>> src;
  run_result<Comm> out;
  for (const auto& h : s.src) src.push_back(own_tensors(s.lay, h, true));
  for (const auto& h : s.dst) out.dst.push_back(own_tensors(s.lay, h, false));
  out.clone_errors.resize(m);
  std::vector<std::thread> threads;
  for (std::uint32_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      const auto own = spans<const std::byte>(src[i]);
      dc::partition_sender<Comm> send(*comms[i], route, i, own);
      for (auto l = static_cast<std::uint32_t>(s.lay.layer_count()); l-- > 0;) send.send_layer(l);
      try {
        send.wait(timeout);
      } catch (const dc::error&) {  // a clone rank that gave up: the test checks the clone side
      }
    });
  for (std::uint32_t c = 0; c < m; ++c)
    threads.emplace_back([&, c] {
      try {
        const auto own = spans<std::byte>(out.dst[c]);
        dc::partition_receiver<Comm> receive(*comms[n + c], route, c, own);
        receive.wait(timeout);
      } catch (...) {
        out.clone_errors[c] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

void check_exact(const scenario& s, const dc::partition_group_options& opt) {
  const auto ranks = static_cast<int>(s.src.size() + s.dst.size());
  dc::inproc::world w(ranks);
  std::vector<dc::inproc::communicator> comms;
  for (int r = 0; r < ranks; ++r) comms.push_back(w.comm(r));
  std::vector<dc::inproc::communicator*> ptrs;
  for (auto& c : comms) ptrs.push_back(&c);
  const auto r = transfer(s, opt, ptrs);
  for (std::size_t c = 0; c < s.dst.size(); ++c) {
    CHECK_FALSE(r.clone_errors[c]);
    for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t)
      CHECK_MESSAGE(holds_pattern(s, c, r.dst[c], t), "clone rank " << c << ", tensor " << t);
  }
}

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

}  // namespace

TEST_CASE("partition transfer: ZeRO-1, TP2xDP2 and randomised holdings arrive byte-exact, layers sent last-first") {
  for (const auto& opt : {dc::partition_group_options{}, dc::partition_group_options{16, 64}}) {
    CAPTURE(opt.direct_min_bytes);
    check_exact(zero1(), opt);
    check_exact(tp2_dp2(), opt);
    std::mt19937_64 rng(21);
    auto pick = [&](std::uint64_t n) { return n ? rng() % n : 0; };
    for (int round = 0; round < 20; ++round) {
      CAPTURE(round);
      check_exact(random_scenario(pick), opt);
    }
  }
}

TEST_CASE("partition transfer: a corrupted message fails its checksum, naming the group and the tensor") {
  // Layer 0's data tag from source 0 (rank 0) to clone rank 0 (rank 4): its first message.
  const auto what = error_with({.action = dc::fault::kind::corrupt, .from = 0, .to = 4, .tag_lo = tag_base}, 10s, dc::errc::corrupt_message);
  CHECK(contains(what, "failed its checksum"));
  CHECK(contains(what, "layer 'fc1' from source 0 to clone rank 0"));
  CHECK(contains(what, "tensor 'fc1."));
}

TEST_CASE("partition transfer: corrupted checksums are refused before they are read") {
  const auto what = error_with({.action = dc::fault::kind::corrupt, .from = 0, .to = 4, .tag_lo = tag_base + 1, .bytes = {5}},
                               10s, dc::errc::corrupt_message);
  CHECK(contains(what, "partition checksums"));
}

TEST_CASE("partition transfer: a silent source times out, naming the group still missing") {
  const auto what = error_with({.action = dc::fault::kind::drop, .from = 1, .to = 4, .times = 0}, 300ms, dc::errc::timeout);
  CHECK(contains(what, "from source 1 to clone rank 0"));
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
    CHECK(contains(e.what(), std::to_string(base) + " to 2147483648"));
  }
}
