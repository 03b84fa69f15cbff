// Failover: every replicated byte is on all N sources, so a clone that gets a corrupt piece,
// hears that a source stopped, or hears nothing from a source asks another source and still
// completes bit for bit. Only when no source can deliver does it fail, with a clear error.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <vector>

namespace dc = deepclone;

namespace {

/// What the test communicator does to a send: pass it, corrupt a private copy, or drop it.
enum class action { pass, corrupt, drop };
using rule = std::function<action(int from, int to, int tag, std::size_t bytes)>;

/// An inproc communicator whose sends go through `rule` (shared by all ranks).
class tampering {
 public:
  using request_type = dc::inproc::communicator::request_type;
  tampering(dc::inproc::communicator c, std::shared_ptr<rule> r) : c_(c), rule_(std::move(r)) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  int max_tag() const { return c_.max_tag(); }
  request_type isend(int dest, int tag, std::span<const std::byte> data) {
    switch ((*rule_)(c_.rank(), dest, tag, data.size())) {
      case action::pass: return c_.isend(dest, tag, data);
      case action::corrupt: {
        auto& copy = copies_->emplace_back(data.begin(), data.end());  // never the user's bytes
        copy[copy.size() / 2] ^= std::byte{0x10};
        return c_.isend(dest, tag, copy);
      }
      case action::drop: {
        request_type r{std::make_shared<dc::inproc::detail::op>()};
        r.op->is_send = true;
        r.op->status = dc::inproc::detail::done;
        return r;
      }
    }
    return {};
  }
  request_type irecv(int src, int tag, std::span<std::byte> b) { return c_.irecv(src, tag, b); }
  std::optional<std::size_t> test(request_type& r) { return c_.test(r); }
  std::size_t wait(request_type& r) { return c_.wait(r); }
  void cancel(request_type& r) { c_.cancel(r); }
  std::uint64_t activity() { return c_.activity(); }
  void wait_activity(std::uint64_t seen, std::chrono::microseconds d) { c_.wait_activity(seen, d); }

 private:
  dc::inproc::communicator c_;
  std::shared_ptr<rule> rule_;
  std::shared_ptr<std::list<std::vector<std::byte>>> copies_ = std::make_shared<std::list<std::vector<std::byte>>>();
};

using engine = dc::engine<tampering>;
constexpr int base = 1000;
bool data_tag(int tag) { return tag >= base + 16 && (tag - base - 16) % 4 == 0; }
bool header_tag(int tag) { return tag >= base + 16 && (tag - base - 16) % 4 == 1; }

struct model {
  std::vector<float> w = std::vector<float>(300000), m = std::vector<float>(300000), b = std::vector<float>(1000);
  dc::state<std::vector<float>> state;
  model() {
    state.add_layer("fc1", {{"weight", w}, {"weight.momentum", m}});
    state.add_layer("fc2", {{"bias", b}});
  }
  void update(std::size_t l, std::uint64_t step) {
    for (auto& t : state.layer_tensors(l))
      for (std::size_t i = 0; i < t.ref->size(); ++i) (*t.ref)[i] = static_cast<float>(step * 1000003 + i * 7 + l);
  }
};

struct outcome {
  std::vector<std::vector<float>> clone_w;
  std::vector<std::uint64_t> k;
  std::vector<dc::report> reports;
  std::vector<std::optional<dc::errc>> errors;
  std::vector<std::uint64_t> source_steps;
};

/// Options of a run beyond the tampering rule.
struct options {
  std::optional<int> stop_early;  ///< source that calls finish() right after it learns k
  bool verify_replicas = false;   ///< clone ranks ask for every source's replica digest
  std::optional<int> drifted;     ///< source whose replica differs in one bit of fc1.weight[0]
};

/// N sources train (coupled by a barrier) while M clone ranks fork. `stop_early`: source
/// index that calls finish() right after it learns k (then trains on without deepclone).
outcome run(int n, int m, std::shared_ptr<rule> r, options opt = {}) {
  const std::optional<int> stop_early = opt.stop_early;
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world world(n + m);
  std::atomic<int> finished{0};
  std::mutex mu;
  outcome out;
  out.clone_w.resize(static_cast<std::size_t>(m));
  out.k.resize(static_cast<std::size_t>(m));
  out.reports.resize(static_cast<std::size_t>(m));
  out.errors.resize(static_cast<std::size_t>(m));
  out.source_steps.resize(static_cast<std::size_t>(n));
  engine::settings s;
  s.timeout = std::chrono::seconds(20);  // generous: CI machines are loaded
  s.failover_after = std::chrono::milliseconds(1000);
  s.shard.threshold = 64 * 1024;
  s.verify_replicas = opt.verify_replicas;
  world.run([&](dc::inproc::communicator& inner) {
    tampering c(inner, r);
    model md;
    if (c.rank() < n) {
      engine::source<std::vector<float>> src(c, roles, md.state, s);
      bool hooked = true;
      std::uint64_t step = 0;
      for (int after = 0; step < 2000 && after < 5; ++step) {
        for (std::size_t l = 2; l-- > 0;) {
          if (hooked) src.before_update(l);
          md.update(l, step);
          if (opt.drifted && c.rank() == *opt.drifted && l == 0) md.w[0] = std::nextafter(md.w[0], 1e30f);
          if (hooked) src.after_update(l);
        }
        dc::barrier(inner, roles.sources, 10);
        if (hooked) src.end_iteration(step);
        if (hooked && stop_early && c.rank() == *stop_early && src.fork_iteration() && *src.fork_iteration() > step) {
          src.finish();  // this source leaves before the fork iteration
          hooked = false;
        }
        int done = finished.load();
        dc::allreduce_sum(inner, roles.sources, std::span<int>(&done, 1), 12);
        if (done == m * n) ++after;
      }
      out.source_steps[static_cast<std::size_t>(c.rank())] = step;
    } else {
      engine::clone<std::vector<float>> dst(c, roles, md.state, s);
      auto j = static_cast<std::size_t>(c.rank() - n);
      try {
        dst.request();
        dst.wait();
        auto rep = dst.report();
        std::lock_guard g(mu);
        out.clone_w[j] = md.w;
        out.k[j] = rep.iteration;
        out.reports[j] = rep;
      } catch (const dc::error& e) {
        std::lock_guard g(mu);
        out.errors[j] = e.kind();
        MESSAGE(std::string(e.what()));
      }
      finished += n;
    }
  });
  return out;
}

void check_exact(const outcome& o) {
  for (std::size_t j = 0; j < o.k.size(); ++j) {
    CAPTURE(j);
    REQUIRE_FALSE(o.errors[j].has_value());
    model want;
    want.update(0, o.k[j]);
    CHECK(o.clone_w[j] == want.w);
  }
}

}  // namespace

TEST_CASE("a corrupted piece is fetched again from another source") {
  std::atomic<int> corrupted{0};
  auto r = std::make_shared<rule>([&](int from, int, int tag, std::size_t bytes) {
    if (from == 1 && data_tag(tag) && bytes > 4096 && corrupted.fetch_add(1) == 0) return action::corrupt;
    return action::pass;
  });
  auto o = run(3, 2, r);
  CHECK(corrupted.load() >= 1);
  check_exact(o);
  std::uint32_t refetched = 0;
  for (auto& rep : o.reports) refetched += rep.refetched_groups;
  CHECK(refetched >= 1);
}

TEST_CASE("a corrupted header is fetched again from another source") {
  std::atomic<int> corrupted{0};
  auto r = std::make_shared<rule>([&](int from, int, int tag, std::size_t) {
    if (from == 0 && header_tag(tag) && corrupted.fetch_add(1) == 0) return action::corrupt;
    return action::pass;
  });
  auto o = run(2, 1, r);
  check_exact(o);
  CHECK(o.reports[0].refetched_groups >= 1);
}

TEST_CASE("a source that leaves before the fork iteration is replaced by the others") {
  auto r = std::make_shared<rule>([](int, int, int, std::size_t) { return action::pass; });
  auto o = run(3, 2, r, {.stop_early = 2});
  check_exact(o);
  CHECK(o.reports[0].refetched_groups >= 1);
}

TEST_CASE("a silent source is presumed failed after failover_after and its pieces come from the others") {
  auto r = std::make_shared<rule>([](int from, int, int tag, std::size_t) {
    return from == 1 && tag >= base + 16 ? action::drop : action::pass;
  });
  auto o = run(3, 1, r);
  check_exact(o);
  CHECK(o.reports[0].refetched_groups >= 1);
  for (auto steps : o.source_steps) CHECK(steps == o.source_steps[0]);  // all sources trained on together
}

TEST_CASE("when every source corrupts a piece, the clone fails clearly instead of holding wrong bytes") {
  auto r = std::make_shared<rule>([](int, int, int tag, std::size_t bytes) {
    return tag >= base + 16 && bytes > 4096 ? action::corrupt : action::pass;  // data and refetch data, any tag block
  });
  auto o = run(2, 1, r);
  REQUIRE(o.errors[0].has_value());
  CHECK(*o.errors[0] == dc::errc::corrupt_message);
}

TEST_CASE("verify_replicas: every source confirms the received state with the digest of its replica") {
  auto pass = std::make_shared<rule>([](int, int, int, std::size_t) { return action::pass; });
  auto o = run(3, 2, pass, {.verify_replicas = true});
  check_exact(o);
  for (auto& rep : o.reports) CHECK(rep.replicas_verified == 3);
  // Without the option no digest is asked for.
  auto plain = run(2, 1, pass);
  check_exact(plain);
  CHECK(plain.reports[0].replicas_verified == 0);
}

TEST_CASE("verify_replicas: a replica that drifted by one bit is named; without the option it goes unnoticed") {
  auto pass = std::make_shared<rule>([](int, int, int, std::size_t) { return action::pass; });
  // Source 2's fc1.weight[0] differs; that byte is sent by source 0 (split_even over 3), so
  // every piece still matches its own sender's checksum.
  auto unchecked = run(3, 1, pass, {.drifted = 2});
  check_exact(unchecked);
  auto o = run(3, 2, pass, {.verify_replicas = true, .drifted = 2});
  for (auto& e : o.errors) {
    REQUIRE(e.has_value());
    CHECK(*e == dc::errc::replica_mismatch);
  }
}

TEST_CASE("verify_replicas: a source that leaves before k is not waited for; the others confirm") {
  auto pass = std::make_shared<rule>([](int, int, int, std::size_t) { return action::pass; });
  auto o = run(3, 1, pass, {.stop_early = 2, .verify_replicas = true});
  check_exact(o);
  CHECK(o.reports[0].replicas_verified == 2);
}

TEST_CASE("verify_replicas: a source whose digest never arrives is presumed failed after failover_after") {
  auto r = std::make_shared<rule>([](int from, int, int tag, std::size_t) {
    return from == 1 && tag == base + 12 ? action::drop : action::pass;  // tag_digest
  });
  auto o = run(3, 1, r, {.verify_replicas = true});
  check_exact(o);
  CHECK(o.reports[0].replicas_verified == 2);
}

TEST_CASE("verify_replicas needs a checksum policy") {
  using plain = dc::engine<dc::inproc::communicator, dc::shard::split_even, dc::pipeline::window,
                           dc::reconstruct::direct, dc::checksum::none>;
  dc::inproc::world world(2);
  std::optional<dc::errc> got;
  world.run([&](dc::inproc::communicator& c) {
    if (c.rank() != 1) return;
    std::vector<float> w(16);
    dc::state<std::vector<float>> st;
    st.add_layer("l", {{"w", w}});
    plain::settings s;
    s.verify_replicas = true;
    plain::clone<std::vector<float>> dst(c, dc::roles::contiguous(1, 1), st, s);
    try {
      dst.request();
    } catch (const dc::error& e) {
      got = e.kind();
    }
  });
  REQUIRE(got.has_value());
  CHECK(*got == dc::errc::unsupported);
}
