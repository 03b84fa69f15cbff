// Policies written as a user would, outside the library, run through the same end-to-end
// clone checks as the built-in ones (tests/support/clone_run.hpp) without any change of
// engine code: a relay-chain reconstruction (pieces travel hop by hop between neighbouring
// clone ranks), a sharding policy and a checksum policy. The plan-level checks of these
// topologies (awaits, cycle and order refusals) are in unit.plan.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>
#include <deepclone/fault_injection.hpp>

#include "../support/clone_run.hpp"  // clone_once, clone_all_sizes
#include "../support/policies.hpp"   // relay_chain
#include "../support/replica.hpp"    // replica, small_settings

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

namespace dc = deepclone;

namespace {

/// A user sharding policy: whole tensors, the largest first, each to the source that has
/// sent the fewest bytes so far, counting from the last source (so source N-1 leads).
struct largest_first {
  static constexpr std::uint32_t id = 201;
  static constexpr const char* name = "largest_first";
  std::uint64_t param() const { return 0; }
  std::vector<dc::piece> assign(const dc::layout& l, std::uint32_t sources, std::uint64_t) const {
    std::vector<std::uint32_t> order(l.tensor_count());
    for (std::uint32_t t = 0; t < order.size(); ++t) order[t] = t;
    std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return l.tensor(a).bytes > l.tensor(b).bytes; });
    std::vector<std::uint64_t> load(sources, 0);
    std::vector<dc::piece> out;
    for (auto t : order) {
      if (l.tensor(t).bytes == 0) continue;
      std::uint32_t s = sources - 1;
      for (std::uint32_t i = sources; i-- > 0;)
        if (load[i] < load[s]) s = i;
      load[s] += l.tensor(t).bytes;
      out.push_back({.tensor = t, .layer = static_cast<std::uint32_t>(l.layer_of(t)), .offset = 0,
                     .length = l.tensor(t).bytes, .source = s});
    }
    return out;
  }
};

/// A user checksum policy: FNV-1a over the bytes, then the length.
struct fnv1a {
  static constexpr std::uint32_t id = 202;
  static constexpr const char* name = "fnv1a";
  static std::uint64_t compute(std::span<const std::byte> b) noexcept {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (auto x : b) h = (h ^ static_cast<std::uint8_t>(x)) * 0x100000001b3ull;
    return (h ^ b.size()) * 0x100000001b3ull;
  }
};

using comm = dc::inproc::communicator;
using chain = dc::testing::relay_chain;

}  // namespace

TEST_CASE_TEMPLATE("a user-written relay chain clones bit for bit (N 1..4, M 1..4)", E,
                   dc::engine<comm, dc::shard::split_even, dc::pipeline::window, chain>,
                   dc::engine<comm, dc::shard::split_even, dc::pipeline::spill, chain>,
                   dc::engine<comm, dc::shard::split_even, dc::pipeline::staged, chain>) {
  dc::testing::clone_all_sizes<E>(4);
}

TEST_CASE("user-written sharding, reconstruction and checksum policies together clone bit for bit") {
  using E = dc::engine<comm, largest_first, dc::pipeline::blocking, chain, fnv1a>;
  for (int n : {1, 3})
    for (int m : {1, 3}) {
      CAPTURE(n);
      CAPTURE(m);
      dc::testing::clone_once<E>(n, m, 5);
    }
}

TEST_CASE("relay chain: a corrupted forward is fetched again from a source, and the next hop waits for it") {
  using fcomm = dc::faulty<comm>;
  using E = dc::engine<fcomm, dc::shard::split_even, dc::pipeline::window, chain>;
  const int n = 2, m = 3;
  const auto roles = dc::roles::contiguous(n, m);
  auto faults = std::make_shared<dc::fault::plan>();
  // The first exchange data message clone rank 0 sends to clone rank 1 (layer 0, 'embed':
  // tags tag_base + 16 + 4 * layer + 2 in the first session); rank 1 relays it to rank 2.
  const int exch_data_layer0 = 1000 + 16 + 2;
  faults->add({.action = dc::fault::kind::corrupt, .from = n, .to = n + 1, .tag_lo = exch_data_layer0, .min_size = 4096});
  dc::inproc::world world(n + m);
  std::atomic<int> done{0};
  std::mutex mu;
  std::vector<std::vector<std::byte>> got(m);
  std::vector<std::uint64_t> k(m);
  std::vector<std::uint32_t> refetched(m);
  world.run([&](comm& inner) {
    fcomm c(inner, faults);
    dc::testing::replica r;
    auto s = dc::testing::small_settings::make<E::settings>();
    if (c.rank() < n) {
      E::source src(c, roles, r.state, s);
      for (std::uint64_t step = 0; step < 400; ++step) {
        r.iterate(&src, step);
        dc::barrier(c, roles.sources, 10);
        src.end_iteration(step);
        int d = done.load();
        dc::allreduce_sum(c, roles.sources, std::span<int>(&d, 1), 12);
        if (d == m) break;
      }
      src.finish();
    } else {
      E::clone dst(c, roles, r.state, s);
      dst.request();
      dst.wait();
      auto rep = dst.report();
      const auto j = static_cast<std::size_t>(c.rank() - n);
      std::lock_guard g(mu);
      got[j] = r.bytes();
      k[j] = rep.iteration;
      refetched[j] = rep.refetched_groups;
      ++done;
    }
  });
  CHECK(refetched[1] >= 1);
  for (int j = 0; j < m; ++j) {
    CAPTURE(j);
    dc::testing::replica want;
    want.become(k[j]);
    CHECK(got[j] == want.bytes());
  }
}
