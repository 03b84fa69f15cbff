// Failover: every replicated byte is on all N sources, so a clone that gets a corrupt piece,
// hears that a source stopped, or hears nothing from a source asks another source and still
// completes bit for bit. Only when no source can deliver does it fail, with a clear error.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>

#include <atomic>
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

/// N sources train (coupled by a barrier) while M clone ranks fork. `stop_early`: source
/// index that calls finish() right after it learns k (then trains on without deepclone).
outcome run(int n, int m, std::shared_ptr<rule> r, std::optional<int> stop_early = {}) {
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
  auto o = run(3, 2, r, 2);
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
    return (data_tag(tag) || tag == base + 10) && bytes > 4096 ? action::corrupt : action::pass;
  });
  auto o = run(2, 1, r);
  REQUIRE(o.errors[0].has_value());
  CHECK(*o.errors[0] == dc::errc::corrupt_message);
}
