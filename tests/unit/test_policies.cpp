// Policies written as a user would, outside the library, run through the same end-to-end
// clone checks as the built-in ones (tests/support/clone_run.hpp) without any change of
// engine code: a relay-chain reconstruction (pieces travel hop by hop between neighbouring
// clone ranks), a sharding policy, a checksum policy and a pipeline that holds layers back
// and sends them in batches, counting the engine's calls to check the hook contract. The plan-level checks of these
// topologies (awaits, cycle and order refusals) are in unit.plan.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>
#include <deepclone/fault_injection.hpp>

#include "../support/clone_run.hpp"  // clone_once, clone_all_sizes
#include "../support/policies.hpp"   // relay_chain
#include "../support/replica.hpp"    // replica, small_settings

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace dc = deepclone;
using namespace std::chrono_literals;

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

/// What the batching pipeline saw, over every source and session of a test (sources run
/// as threads of one process).
struct hook_counts {
  std::atomic<int> sessions{0}, finals{0}, layers_sent{0}, ends{0}, asks{0}, violations{0};
};
hook_counts counted;

/// A user pipeline: holds the layers that became final and sends them `batch` at a time,
/// the rest when the fork iteration ends; a layer may be overwritten once its sends
/// completed and every clone rank verified it. It checks the engine's side of the hook
/// contract: layer_final once per layer and session, fork_iteration_ended once, after
/// every layer's layer_final; may_overwrite only for a layer that had its layer_final.
struct batching {
  static constexpr const char* name = "batching";
  std::size_t batch = 3;
  std::vector<std::size_t> held;
  std::vector<char> final_seen;

  void begin(dc::pipeline::context& c) {
    ++counted.sessions;
    if (c.memory().size() != reserved) ++counted.violations;  // reserve() below was honoured
    held.clear();
    final_seen.assign(c.layers(), 0);
  }
  void layer_final(dc::pipeline::context& c, std::size_t l) {
    ++counted.finals;
    if (std::exchange(final_seen.at(l), 1)) ++counted.violations;
    held.push_back(l);
    if (held.size() >= batch) flush(c);
  }
  void fork_iteration_ended(dc::pipeline::context& c) {
    ++counted.ends;
    if (std::count(final_seen.begin(), final_seen.end(), 1) != static_cast<long>(c.layers())) ++counted.violations;
    flush(c);
  }
  bool may_overwrite(dc::pipeline::context& c, std::size_t l) {
    ++counted.asks;
    if (!final_seen.at(l) || !held.empty()) ++counted.violations;
    return c.refetches_done(l) && c.sends_done(l) && c.verified(l);
  }
  bool pending(dc::pipeline::context&) const { return !held.empty(); }
  /// Non-const, as pipeline.hpp allows: the engine must still allocate it (it used to look
  /// for a const member only and silently gave such a pipeline no memory).
  static constexpr std::uint64_t reserved = 4096;
  std::uint64_t reserve(std::uint64_t) { return reserved; }

 private:
  void flush(dc::pipeline::context& c) {
    for (auto l : std::exchange(held, {}))
      if (c.active()) c.send_layer(l), ++counted.layers_sent;
  }
};

/// A user pipeline with a bug: it posts every piece naming the next layer (off by one), so
/// the last layer's sends name a layer the state does not have.
struct off_by_one {
  static constexpr const char* name = "off_by_one";
  void layer_final(dc::pipeline::context& c, std::size_t l) {
    for (auto& p : c.pieces(l)) {
      c.summed(p.piece, p.live);
      for (auto to : p.to) c.post({l + 1, p.piece, to, p.live});
    }
  }
  bool may_overwrite(dc::pipeline::context&, std::size_t) { return true; }
};

/// Broken user pipelines, one context rule each (pipeline.hpp). The first three post every
/// piece of a final layer with one field wrong; after_end waits until the session ended
/// (by its timeout: nothing arrives) and calls on.
enum class broken { piece, clone, layer, after_end };
template <broken B>
struct broken_rule {
  static constexpr const char* name = "broken_rule";
  void layer_final(dc::pipeline::context& c, std::size_t l) {
    if constexpr (B == broken::after_end) {
      c.wait_until([] { return false; }, "a condition that never holds");
      (void)c.sends_done(l);
    } else {
      for (auto& p : c.pieces(l)) {
        c.summed(p.piece, p.live);
        for (auto to : p.to)
          c.post({B == broken::layer ? (l == 0 ? 1 : 0) : l, B == broken::piece ? 1u << 30 : p.piece, B == broken::clone ? 7u : to, p.live});
      }
    }
  }
  bool may_overwrite(dc::pipeline::context&, std::size_t) { return true; }
};

using comm = dc::inproc::communicator;
using chain = dc::testing::relay_chain;

/// One source trains with pipeline policy `P` until a hook throws (at most 5000 steps);
/// one clone rank waits. Returns what each threw.
template <class P>
std::pair<std::optional<dc::error>, std::optional<dc::error>> broken_pipeline_run(std::chrono::nanoseconds source_timeout = 30s) {
  using E = dc::engine<comm, dc::shard::split_even, P, dc::reconstruct::scatter_exchange>;
  const auto roles = dc::roles::contiguous(1, 1);
  dc::inproc::world w(2);
  std::optional<dc::error> source_error, clone_error;
  w.run([&](comm& c) {
    dc::testing::replica r;
    auto s = dc::testing::small_settings::make<typename E::settings>();
    if (c.rank() == 0) {
      s.timeout = source_timeout;
      typename E::source src(c, roles, r.state, s);
      for (std::uint64_t step = 0; step < 5000 && !source_error; ++step) {
        try {
          r.iterate(&src, step);
          src.end_iteration(step);
        } catch (const dc::error& e) {
          source_error = e;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else {
      typename E::clone dst(c, roles, r.state, s);
      dst.request();
      try {
        dst.wait();
      } catch (const dc::error& e) {
        clone_error = e;
      }
    }
  });
  return {source_error, clone_error};
}

}  // namespace

TEST_CASE("a user pipeline that breaks the context's rules: a clear error in the hook, the clone fails at once, no write out of bounds") {
  auto [source_error, clone_error] = broken_pipeline_run<off_by_one>();
  REQUIRE(source_error);
  CHECK(source_error->kind() == dc::errc::invalid_argument);
  INFO(source_error->what());
  CHECK(std::string(source_error->what()).find("pipeline policy 'off_by_one'") != std::string::npos);
  CHECK(std::string(source_error->what()).find("context::post: layer 5, but the state has 5 layers") != std::string::npos);
  REQUIRE(clone_error);  // told by the source's failed session, not after its timeout
  INFO(clone_error->what());
  CHECK(std::string(clone_error->what()).find("off_by_one") != std::string::npos);
}

/// Checks one broken_rule run: the hook threw errc::invalid_argument naming the policy and
/// `rule`; with `clone_named`, the clone failed naming the policy (the source told it).
template <broken B>
void check_broken_rule(const std::string& rule, bool clone_named = true) {
  auto [source_error, clone_error] = broken_pipeline_run<broken_rule<B>>(B == broken::after_end ? 2s : 30s);
  REQUIRE(source_error);
  const std::string what = source_error->what();
  INFO(what);
  CHECK(source_error->kind() == dc::errc::invalid_argument);
  CHECK(what.find("pipeline policy 'broken_rule' on source 0 broke a rule: context::") != std::string::npos);
  CHECK(what.find(rule) != std::string::npos);
  REQUIRE(clone_error);
  const std::string clone_what = clone_error->what();
  INFO(clone_what);
  if (clone_named) CHECK(clone_what.find("broken_rule") != std::string::npos);
}

// design.md, Pipelines are hooks / pipeline.hpp: the engine checks every call of a pipeline
// policy against the context's rules; a broken one fails the session (the clone learns it
// at once) and the hook throws errc::invalid_argument naming the rule. off_by_one above
// reaches only the layer range check; these reach the others.
TEST_CASE("a user pipeline that breaks each other context rule is named with that rule") {
  SUBCASE("a piece index beyond the plan") { check_broken_rule<broken::piece>("context::post: piece 1073741824, but the plan has "); }
  SUBCASE("a clone index beyond M") { check_broken_rule<broken::clone>("context::post: clone index 7, but there are 1 clone ranks"); }
  SUBCASE("a piece posted under another (valid) layer") { check_broken_rule<broken::layer>("belongs to layer 4, not to layer 0"); }
  SUBCASE("a call after the session ended") {  // it ended by its timeout: the clone hears that, not the rule
    check_broken_rule<broken::after_end>("context::sends_done after the session ended", false);
  }
}

TEST_CASE_TEMPLATE("a user-written relay chain clones bit for bit (N 1..4, M 1..4)", E,
                   dc::engine<comm, dc::shard::split_even, dc::pipeline::window, chain>,
                   dc::engine<comm, dc::shard::split_even, dc::pipeline::spill, chain>,
                   dc::engine<comm, dc::shard::split_even, dc::pipeline::staged, chain>) {
  dc::testing::clone_all_sizes<E>(4);
}

TEST_CASE_TEMPLATE("a user-written batching pipeline clones bit for bit, and the engine keeps the hook contract", E,
                   dc::engine<comm, dc::shard::split_even, batching, dc::reconstruct::scatter_exchange>,
                   dc::engine<comm, dc::shard::split_even, batching, chain>) {
  counted.sessions = counted.finals = counted.layers_sent = counted.ends = counted.asks = counted.violations = 0;
  dc::testing::clone_all_sizes<E>(3);
  const int layers = static_cast<int>(dc::testing::replica{}.state.describe().layer_count());
  CHECK(counted.sessions > 0);
  CHECK(counted.violations == 0);
  CHECK(counted.finals == counted.sessions * layers);       // each layer once per session
  CHECK(counted.layers_sent == counted.sessions * layers);  // ... and sent once
  CHECK(counted.ends == counted.sessions);
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

/// A pipeline that cannot be copied (it owns a buffer, as a user's might): the engines take
/// the settings by value and never copy a policy.
struct move_only_window : dc::pipeline::window {
  static constexpr const char* name = "move_only_window";
  std::unique_ptr<std::uint64_t> owned = std::make_unique<std::uint64_t>(0);
};
static_assert(!std::is_copy_constructible_v<move_only_window>);

TEST_CASE("a pipeline policy that can only be moved clones bit for bit") {
  dc::testing::clone_once<dc::engine<dc::inproc::communicator, dc::shard::split_even, move_only_window>>(2, 2, 0);
}

// The engines are compiled once per communicator and the policies that shape their code
// (docs/design.md, "What is compiled per what"): not per tensor type, and not per sharding
// or reconstruction policy, which reach them only through the plan.
namespace compiled_per {
using comm = dc::inproc::communicator;
using plain = dc::engine<comm>;
using other_plan = dc::engine<comm, dc::shard::whole_tensor, dc::pipeline::window, dc::reconstruct::direct>;
using source_core = dc::detail::source_engine<comm, dc::pipeline::window, dc::checksum::mix64, dc::agreement::coordinator>;
using clone_core = dc::detail::clone_engine<comm, dc::checksum::mix64>;
static_assert(std::is_base_of_v<source_core, plain::source<std::vector<float>>>);
static_assert(std::is_base_of_v<source_core, plain::source<dc::raw_view<double>>>);
static_assert(std::is_base_of_v<source_core, other_plan::source<std::vector<float>>>);
static_assert(std::is_base_of_v<clone_core, plain::clone<std::vector<float>>>);
static_assert(std::is_base_of_v<clone_core, plain::clone<dc::raw_view<double>>>);
static_assert(std::is_base_of_v<clone_core, other_plan::clone<std::vector<float>>>);
static_assert(std::is_base_of_v<clone_core, dc::engine<comm, dc::shard::split_even, dc::pipeline::spill>::clone<std::vector<float>>>);
}  // namespace compiled_per
