// Misuse of the engine raises the documented deepclone::error codes: bad roles, hooks out of
// order, a second request, queries before completion, and a clone whose layout or plan
// settings differ from the sources' (refused before any byte is written into the clone,
// while the sources keep training).
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>
#include <deepclone/detail/wire.hpp>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dc = deepclone;
using namespace std::chrono_literals;

// A tensor with a run-time dtype, so that one state can mix dtypes (the layout-mismatch
// tests change the dtype of one tensor only). Also exercises the traits customization point.
struct typed_tensor {
  std::vector<std::byte> data;
  dc::dtype type = dc::dtype::f32;
};
template <>
struct deepclone::tensor_traits<typed_tensor> {
  static std::byte* data(typed_tensor& t) { return t.data.data(); }
  static std::size_t size_bytes(const typed_tensor& t) { return t.data.size(); }
  static dtype element_type(const typed_tensor& t) { return t.type; }
};

namespace {

using cloning = dc::engine<dc::inproc::communicator>;
using vec = std::vector<float>;

template <class F>
std::optional<dc::errc> error_of(F&& f) {
  try {
    f();
  } catch (const dc::error& e) {
    return e.kind();
  }
  return std::nullopt;
}

/// A small float model: 3 layers, optimizer slot included. Not copyable (the state points
/// at the vectors).
struct small_model {
  vec w0 = vec(300), b0 = vec(10), w1 = vec(5000), m1 = vec(5000), w2 = vec(7);
  dc::state<vec> st;
  small_model() {
    st.add_layer("fc0", {{"weight", w0}, {"bias", b0}});
    st.add_layer("fc1", {{"weight", w1}, {"weight.momentum", m1}});
    st.add_layer("head", {{"weight", w2}});
  }
  small_model(const small_model&) = delete;
};

// ---------------------------------------------------------------------------------------
// A fork between N in-process sources and M clone ranks whose layouts may differ.

struct tspec {
  std::string name;
  std::size_t bytes;
  dc::dtype type = dc::dtype::f32;
};
struct lspec {
  std::string name;
  std::vector<tspec> tensors;
};
using spec = std::vector<lspec>;

spec base_spec() {
  return {{"fc0", {{"weight", 1200}, {"bias", 40}}},
          {"fc1", {{"weight", 20000}, {"weight.momentum", 20000}}},
          {"head", {{"weight", 28}, {"bias", 4}}}};
}

struct typed_model {
  std::deque<typed_tensor> tensors;  // stable addresses
  dc::state<typed_tensor> st;
  typed_model(const spec& s, std::uint8_t fill) {
    for (auto& l : s) {
      std::vector<dc::named<typed_tensor>> named;
      for (auto& t : l.tensors) {
        tensors.push_back({std::vector<std::byte>(t.bytes, std::byte{fill}), t.type});
        named.emplace_back(t.name, tensors.back());
      }
      st.add_layer(l.name, std::move(named));
    }
  }
  typed_model(const typed_model&) = delete;
  /// The sources' bytes after the update of `layer` in iteration `step`.
  static std::byte value(std::uint64_t step, std::size_t flat, std::size_t i) {
    return std::byte(static_cast<std::uint8_t>((step * 31 + flat * 7 + i) % 251));
  }
  void update(std::size_t layer, std::uint64_t step) {
    std::size_t flat = 0;
    for (std::size_t l = 0; l < st.layer_count(); ++l)
      for (std::size_t t = 0; t < st.layer_tensors(l).size(); ++t, ++flat)
        if (l == layer) {
          auto& d = st.layer_tensors(l)[t].ref->data;
          for (std::size_t i = 0; i < d.size(); ++i) d[i] = value(step, flat, i);
        }
  }
  bool equals_step(std::uint64_t step) {
    std::size_t flat = 0;
    for (auto& t : tensors) {
      for (std::size_t i = 0; i < t.data.size(); ++i)
        if (t.data[i] != value(step, flat, i)) return false;
      ++flat;
    }
    return true;
  }
  bool all_bytes(std::byte b) const {
    for (auto& t : tensors)
      for (auto x : t.data)
        if (x != b) return false;
    return true;
  }
};

struct outcome {
  std::vector<std::optional<dc::errc>> clone_code;
  std::vector<std::string> clone_what;
  std::vector<bool> sentinel_intact, clone_equals_fork_state;
  std::vector<std::uint64_t> source_steps, completed, failed;
  std::vector<std::string> source_exception;
  bool sources_stopped_on_signal = true;
};

constexpr std::byte sentinel{0xA5};

/// Runs N sources training (coupled each iteration by an allreduce over the sources, as
/// a gradient allreduce would) and M clone ranks that request a clone and wait for it.
/// The sources train until every clone rank is done (bounded by a deadline), then finish
/// normally. Every clone rank checks its tensors only after all sources have finished.
outcome fork_run(int n, int m, const spec& source_spec, std::function<spec(int)> clone_spec,
                 cloning::settings source_settings = {},
                 std::function<cloning::settings(int)> clone_settings = nullptr) {
  outcome out;
  out.clone_code.resize(static_cast<std::size_t>(m));
  out.clone_what.resize(static_cast<std::size_t>(m));
  out.sentinel_intact.resize(static_cast<std::size_t>(m));
  out.clone_equals_fork_state.resize(static_cast<std::size_t>(m));
  out.source_steps.resize(static_cast<std::size_t>(n));
  out.completed.resize(static_cast<std::size_t>(n));
  out.failed.resize(static_cast<std::size_t>(n));
  out.source_exception.resize(static_cast<std::size_t>(n));
  const auto roles = dc::roles::contiguous(n, m);
  std::atomic<int> clones_done{0}, sources_done{0};
  std::atomic<bool> hit_deadline{false};
  const auto deadline = std::chrono::steady_clock::now() + 15s;
  dc::inproc::world w(n + m);
  w.run([&](dc::inproc::communicator& comm) {
    const int rank = comm.rank();
    if (rank < n) {
      const auto i = static_cast<std::size_t>(rank);
      try {
        typed_model model(source_spec, 0);
        cloning::source src(comm, roles, model.st, source_settings);
        const std::size_t L = model.st.layer_count();
        for (std::uint64_t step = 0;; ++step) {
          for (std::size_t l = L; l-- > 0;) {  // backward order, as an optimizer does
            src.before_update(l);
            model.update(l, step);
            src.after_update(l);
          }
          model.st.metadata().data_cursor = step * 10;
          const bool late = std::chrono::steady_clock::now() > deadline;
          int stop[2] = {clones_done.load() == m ? 1 : 0, late ? 1 : 0};
          dc::allreduce_sum(comm, roles.sources, std::span<int>(stop), 10);
          src.end_iteration(step);
          if (stop[0] || stop[1]) {
            if (!stop[0]) hit_deadline = true;
            out.source_steps[i] = step + 1;
            break;
          }
        }
        src.finish();
        out.completed[i] = src.sessions_completed();
        out.failed[i] = src.sessions_failed();
      } catch (const std::exception& e) {
        out.source_exception[i] = e.what();
      }
      ++sources_done;
    } else {
      const auto j = static_cast<std::size_t>(rank - n);
      typed_model model(clone_spec(rank - n), std::to_integer<std::uint8_t>(sentinel));
      {
        cloning::settings s = clone_settings ? clone_settings(rank - n) : cloning::settings{};
        cloning::clone dst(comm, roles, model.st, s);
        try {
          dst.request();
          dst.wait();
          const auto k = dst.metadata().step;
          out.clone_equals_fork_state[j] = model.equals_step(k) && dst.metadata().data_cursor == k * 10;
        } catch (const dc::error& e) {
          out.clone_code[j] = e.kind();
          out.clone_what[j] = e.what();
        }
        ++clones_done;
      }
      // Only after every source finished: nothing may have been written, ever.
      while (sources_done.load() < n) std::this_thread::sleep_for(1ms);
      out.sentinel_intact[j] = model.all_bytes(sentinel);
    }
  });
  out.sources_stopped_on_signal = !hit_deadline.load();
  return out;
}

/// The sources of a refused clone trained on and finished normally, serving nothing.
void check_sources_unharmed(const outcome& o) {
  for (std::size_t i = 0; i < o.source_steps.size(); ++i) {
    INFO("source " << i);
    CHECK(o.source_exception[i] == "");
    CHECK(o.source_steps[i] > 0);
    CHECK(o.completed[i] == 0);
    CHECK(o.failed[i] == 0);
  }
  CHECK(o.sources_stopped_on_signal);
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

// ---------------------------------------------------------------------------------------
// Roles

TEST_CASE("errors: invalid roles are refused on both sides") {
  dc::inproc::world w(4);
  auto c0 = w.comm(0), c1 = w.comm(1), c3 = w.comm(3);
  small_model m;
  auto src = [&](dc::inproc::communicator& c, const dc::roles& r) {
    return error_of([&] { cloning::source s(c, r, m.st); });
  };
  auto cl = [&](dc::inproc::communicator& c, const dc::roles& r) {
    return error_of([&] { cloning::clone s(c, r, m.st); });
  };
  const dc::roles no_sources{{}, {1}}, no_clones{{0}, {}}, both{{0, 1}, {1, 2}}, outside{{0}, {1, 4}},
      negative{{-1, 0}, {1}}, twice{{0, 0}, {1}};
  for (auto* r : {&no_sources, &no_clones, &both, &outside, &negative, &twice}) {
    CHECK(src(c0, *r) == dc::errc::invalid_argument);
    CHECK(cl(c1, *r) == dc::errc::invalid_argument);
  }
  CHECK_THROWS_WITH_AS(cloning::source(c0, no_sources, m.st), doctest::Contains("N = 0"), dc::error);
  CHECK_THROWS_WITH_AS(cloning::clone(c1, no_clones, m.st), doctest::Contains("M = 0"), dc::error);
  CHECK_THROWS_WITH_AS(cloning::source(c0, both, m.st), doctest::Contains("rank 1"), dc::error);
  CHECK_THROWS_WITH_AS(cloning::source(c0, outside, m.st), doctest::Contains("outside the communicator"), dc::error);

  // A source on a clone rank (or on a rank in neither role), and a clone on a source rank.
  const auto good = dc::roles::contiguous(2, 1);  // sources 0, 1; clone 2; rank 3 unused
  CHECK(src(c3, good) == dc::errc::invalid_argument);
  CHECK(cl(c0, good) == dc::errc::invalid_argument);
  CHECK(cl(c3, good) == dc::errc::invalid_argument);
  auto c2 = w.comm(2);
  CHECK(src(c2, good) == dc::errc::invalid_argument);
  // ... while the right rank is accepted.
  CHECK(src(c0, good) == std::nullopt);
  CHECK(cl(c2, good) == std::nullopt);

  // fork_lead below one.
  cloning::settings s;
  s.fork_lead = 0;
  CHECK(error_of([&] { cloning::source x(c0, good, m.st, s); }) == dc::errc::invalid_argument);
}

// ---------------------------------------------------------------------------------------
// Hooks

TEST_CASE("errors: source hooks called out of order") {
  dc::inproc::world w(2);
  auto c0 = w.comm(0);
  small_model m;
  cloning::source src(c0, dc::roles::contiguous(1, 1), m.st);
  const auto hook_order = std::optional(dc::errc::hook_order);

  SUBCASE("after_update without before_update") {
    CHECK(error_of([&] { src.after_update(0); }) == hook_order);
    CHECK_THROWS_WITH_AS(src.after_update(2), doctest::Contains("without before_update(2)"), dc::error);
  }
  SUBCASE("after_update of another layer than the open one") {
    src.before_update(2);
    CHECK(error_of([&] { src.after_update(1); }) == hook_order);
    CHECK_NOTHROW(src.after_update(2));  // the error left the engine usable
  }
  SUBCASE("before_update twice") {
    src.before_update(1);
    CHECK(error_of([&] { src.before_update(1); }) == hook_order);
    CHECK(error_of([&] { src.before_update(0); }) == hook_order);
    CHECK_NOTHROW(src.after_update(1));
    CHECK_NOTHROW(src.end_iteration(0));
  }
  SUBCASE("the same layer updated twice in one iteration") {
    src.before_update(2);
    src.after_update(2);
    CHECK_THROWS_WITH_AS(src.before_update(2), doctest::Contains("updated twice"), dc::error);
    CHECK(error_of([&] { src.before_update(2); }) == hook_order);
    CHECK_NOTHROW(src.end_iteration(0));
    CHECK_NOTHROW(src.before_update(2));  // a new iteration
    CHECK_NOTHROW(src.after_update(2));
  }
  SUBCASE("end_iteration with an open layer") {
    src.before_update(0);
    CHECK(error_of([&] { src.end_iteration(0); }) == hook_order);
    src.after_update(0);
    CHECK_NOTHROW(src.end_iteration(0));
  }
  SUBCASE("end_iteration steps must increase by one") {
    CHECK_NOTHROW(src.end_iteration(5));  // the first step may be anything
    CHECK(error_of([&] { src.end_iteration(7); }) == hook_order);
    CHECK(error_of([&] { src.end_iteration(5); }) == hook_order);
    CHECK(error_of([&] { src.end_iteration(4); }) == hook_order);
    CHECK_NOTHROW(src.end_iteration(6));
  }
  SUBCASE("layer index out of range") {
    CHECK(error_of([&] { src.before_update(3); }) == hook_order);
    CHECK(error_of([&] { src.after_update(3); }) == hook_order);
    CHECK(error_of([&] { src.before_update(static_cast<std::size_t>(-1)); }) == hook_order);
    CHECK_THROWS_WITH_AS(src.before_update(3), doctest::Contains("only 3 layers"), dc::error);
  }
  SUBCASE("end_iteration after finish") {
    src.end_iteration(0);
    src.finish();
    CHECK(error_of([&] { src.end_iteration(1); }) == hook_order);
  }
  SUBCASE("a correct iteration raises nothing") {
    for (std::uint64_t step = 0; step < 3; ++step) {
      for (std::size_t l = 3; l-- > 0;) {
        CHECK_NOTHROW(src.before_update(l));
        CHECK_NOTHROW(src.after_update(l));
      }
      CHECK_NOTHROW(src.end_iteration(step));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Clone-side misuse (one thread: the clone's sources never run)

TEST_CASE("errors: a second request while a clone is in flight is busy") {
  dc::inproc::world w(2);
  auto c1 = w.comm(1);
  small_model m;
  cloning::clone dst(c1, dc::roles::contiguous(1, 1), m.st);
  dst.request();
  CHECK(error_of([&] { dst.request(); }) == dc::errc::busy);
  CHECK_THROWS_WITH_AS(dst.request(), doctest::Contains("already in flight"), dc::error);
  // After cancel() a new request is allowed.
  dst.cancel();
  CHECK(error_of([&] { dst.request(); }) == std::nullopt);
  CHECK(error_of([&] { dst.request(); }) == dc::errc::busy);
}

TEST_CASE("errors: metadata() and report() before completion are not_ready") {
  dc::inproc::world w(2);
  auto c1 = w.comm(1);
  small_model m;
  cloning::settings s;
  s.timeout = 2s;
  cloning::clone dst(c1, dc::roles::contiguous(1, 1), m.st, s);
  const auto not_ready = std::optional(dc::errc::not_ready);
  // Before any request.
  CHECK(error_of([&] { (void)dst.metadata(); }) == not_ready);
  CHECK(error_of([&] { (void)dst.report(); }) == not_ready);
  CHECK(error_of([&] { (void)dst.poll(); }) == not_ready);
  // Requested, but no source answers.
  dst.request();
  CHECK(error_of([&] { (void)dst.metadata(); }) == not_ready);
  CHECK(error_of([&] { (void)dst.report(); }) == not_ready);
  CHECK(dst.poll() == false);
  CHECK(dst.layer_ready(0) == false);
  CHECK_FALSE(dst.fork_iteration().has_value());
}

TEST_CASE("errors: a clone whose sources never answer times out, naming what is missing") {
  dc::inproc::world w(2);
  auto c1 = w.comm(1);
  small_model m;
  std::fill(m.w1.begin(), m.w1.end(), 42.0f);
  cloning::settings s;
  s.timeout = 300ms;
  cloning::clone dst(c1, dc::roles::contiguous(1, 1), m.st, s);
  dst.request();
  try {
    dst.wait();
    FAIL("wait() returned without sources");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::timeout);
    CHECK(contains(e.what(), "fork decision"));
  }
  // The failure sticks: poll() rethrows it.
  CHECK(error_of([&] { (void)dst.poll(); }) == dc::errc::timeout);
  CHECK(std::all_of(m.w1.begin(), m.w1.end(), [](float x) { return x == 42.0f; }));
}

// ---------------------------------------------------------------------------------------
// Refused clones: layout and plan mismatches

TEST_CASE("errors: matching layouts clone fine (control for the refusals below)") {
  auto o = fork_run(2, 2, base_spec(), [](int) { return base_spec(); });
  for (std::size_t j = 0; j < 2; ++j) {
    INFO("clone " << j << ": " << o.clone_what[j]);
    CHECK_FALSE(o.clone_code[j].has_value());
    CHECK(o.clone_equals_fork_state[j]);
    CHECK_FALSE(o.sentinel_intact[j]);
  }
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(o.source_exception[i] == "");
    CHECK(o.completed[i] == 1);
  }
  CHECK(o.sources_stopped_on_signal);
}

TEST_CASE("errors: a clone whose layout differs is refused before any byte is written") {
  struct variant {
    const char* what;
    std::function<void(spec&)> edit;
    std::vector<std::string> message_parts;
  };
  const std::vector<variant> variants = {
      {"an extra tensor", [](spec& s) { s[1].tensors.push_back({"bias", 400}); }, {"tensor count", "'fc1'", "2", "3"}},
      {"a missing tensor", [](spec& s) { s[2].tensors.pop_back(); }, {"tensor count", "'head'"}},
      {"a missing layer", [](spec& s) { s.pop_back(); }, {"layer count", "3", "2"}},
      {"a different tensor name", [](spec& s) { s[1].tensors[1].name = "weight.exp_avg"; },
       {"name", "'weight.momentum'", "'weight.exp_avg'"}},
      {"a different layer name", [](spec& s) { s[0].name = "conv0"; }, {"'fc0'", "'conv0'"}},
      {"a different size", [](spec& s) { s[1].tensors[0].bytes = 20004; },
       {"'fc1.weight'", "size", "20000 bytes", "20004 bytes"}},
      {"a different dtype", [](spec& s) { s[2].tensors[0].type = dc::dtype::i32; },
       {"'head.weight'", "dtype", "float32", "int32"}},
      {"two differences (the first is named)",
       [](spec& s) {
         s[2].tensors[0].type = dc::dtype::i32;
         s[0].tensors[1].bytes = 44;
       },
       {"'fc0.bias'", "40 bytes", "44 bytes"}},
  };
  for (auto& v : variants) {
    INFO("clone with " << v.what);
    auto clone_spec = base_spec();
    v.edit(clone_spec);
    auto o = fork_run(2, 1, base_spec(), [&](int) { return clone_spec; });
    CHECK(o.clone_code[0] == dc::errc::layout_mismatch);
    INFO("message: " << o.clone_what[0]);
    for (auto& part : v.message_parts) CHECK_MESSAGE(contains(o.clone_what[0], part), "missing '" << part << "'");
    if (v.what == std::string("two differences (the first is named)")) CHECK_FALSE(contains(o.clone_what[0], "head"));
    CHECK(o.sentinel_intact[0]);
    check_sources_unharmed(o);
  }
}

TEST_CASE("errors: one clone rank's differing layout refuses the whole clone group") {
  auto other = base_spec();
  other[1].tensors[0].bytes = 16000;
  auto o = fork_run(1, 2, base_spec(), [&](int j) { return j == 1 ? other : base_spec(); });
  for (std::size_t j = 0; j < 2; ++j) {
    INFO("clone " << j << ": " << o.clone_what[j]);
    CHECK(o.clone_code[j] == dc::errc::layout_mismatch);
    CHECK(o.sentinel_intact[j]);
  }
  CHECK(contains(o.clone_what[1], "'fc1.weight'"));  // the differing rank learns what differs
  CHECK(contains(o.clone_what[1], "16000 bytes"));
  CHECK(contains(o.clone_what[0], "clone rank 2"));  // the other one learns who differs (rank 1 + 1)
  check_sources_unharmed(o);
}

TEST_CASE("errors: a clone with different plan settings is refused with plan_mismatch") {
  struct variant {
    const char* what;
    std::function<void(cloning::settings&)> edit;
    const char* field;
  };
  const std::vector<variant> variants = {
      {"shard threshold", [](cloning::settings& s) { s.shard.threshold = 4096; }, "sharding policy setting"},
      {"reconstruct threshold", [](cloning::settings& s) { s.reconstruct.threshold = 1; }, "reconstruction setting"},
      {"alignment", [](cloning::settings& s) { s.plan.alignment = 64; }, "alignment"},
      {"max piece", [](cloning::settings& s) { s.plan.max_piece_bytes = 1 << 20; }, "max_piece_bytes"},
  };
  for (auto& v : variants) {
    INFO("clone with a different " << v.what);
    auto o = fork_run(2, 1, base_spec(), [](int) { return base_spec(); }, {}, [&](int) {
      cloning::settings s;
      s.timeout = 10s;
      v.edit(s);
      return s;
    });
    CHECK(o.clone_code[0] == dc::errc::plan_mismatch);
    INFO("message: " << o.clone_what[0]);
    CHECK(contains(o.clone_what[0], v.field));
    CHECK(o.sentinel_intact[0]);
    check_sources_unharmed(o);
  }
}

// ---------------------------------------------------------------------------------------
// Sources that stop before deciding

// design.md, Failure behaviour: "Sources that finish before even deciding answer pending
// requests at once (errc::source_failed)". The sources train, then finish() once the
// clone's request is sent; the clone requests only after both sources ended their last
// iteration, so no end_iteration can take the request (a request sent earlier may be
// served, and the clone then completes): the clone must fail with source_failed saying
// so, long before its 20 s timeout.
TEST_CASE("errors: sources that finish before deciding answer a pending request at once with source_failed") {
  const auto roles = dc::roles::contiguous(2, 1);
  std::atomic<bool> requested{false};
  std::atomic<int> trained{0};  // sources past their last end_iteration
  std::optional<dc::error> error;
  double seconds = 0;
  dc::inproc::world w(3);
  w.run([&](dc::inproc::communicator& comm) {
    small_model m;
    cloning::settings s;
    s.timeout = 20s;
    if (comm.rank() < 2) {
      cloning::source src(comm, roles, m.st, s);
      for (std::uint64_t step = 0; step < 3; ++step) {
        for (std::size_t l = 3; l-- > 0;) src.before_update(l), src.after_update(l);
        src.end_iteration(step);
      }
      ++trained;
      while (!requested) std::this_thread::sleep_for(1ms);
      src.finish();
      return;
    }
    cloning::clone dst(comm, roles, m.st, s);
    while (trained < 2) std::this_thread::sleep_for(1ms);
    const auto t0 = std::chrono::steady_clock::now();
    dst.request();
    requested = true;
    try {
      dst.wait();
    } catch (const dc::error& e) {
      error = e;
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  REQUIRE(error);
  const std::string what = error->what();
  INFO(what);
  CHECK(error->kind() == dc::errc::source_failed);
  CHECK(contains(what, "the sources finished training (last step 2) before they could serve this clone's request"));
  CHECK(seconds < 10);  // at once, not after settings.timeout (20 s)
}

TEST_CASE("errors: a coordinator's answers are checked: a stale acceptance is cancelled, a refusal naming a clone index out of range names no rank") {
  // Rank 0 plays a faulty coordinator by hand: it answers the clone's request first with an
  // acceptance of another request (a leftover: the clone must tell the sources to end that
  // session, which it never joins), then with a refusal of this request whose clone index is
  // out of range (garbage: the clone must not index its roles with it).
  namespace wire = dc::detail;
  dc::inproc::world w(2);
  auto c0 = w.comm(0), c1 = w.comm(1);
  small_model m;
  cloning::settings s;
  s.timeout = 2s;
  cloning::clone dst(c1, dc::roles::contiguous(1, 1), m.st, s);
  dst.request();
  std::vector<std::byte> in(wire::control_bytes);
  auto r = c0.irecv(1, s.tag_base + wire::tag_request, in);
  const auto req = wire::request_msg::decode(std::span<const std::byte>(in.data(), c0.wait(r)));
  auto send = [&](int tag, std::vector<std::byte> b) {
    auto q = c0.isend(1, s.tag_base + tag, std::span<const std::byte>(b));
    c0.wait(q);
  };
  wire::decision_msg stale;
  stale.session = 77;
  stale.nonce = req.nonce + 1;
  send(wire::tag_decision, stale.encode());
  const auto lay = m.st.describe().encode();
  wire::decision_msg refusal;
  refusal.status = wire::verdict::layout_differs;
  refusal.nonce = req.nonce;
  refusal.layout_bytes = lay.size();
  refusal.offending_clone = 999;
  send(wire::tag_decision, refusal.encode());
  send(wire::tag_layout, wire::layout_msg{req.nonce, lay}.encode());
  try {
    dst.wait();
    FAIL("wait() returned after a refusal");
  } catch (const dc::error& e) {
    CHECK(e.kind() == dc::errc::layout_mismatch);
    CHECK(contains(e.what(), "another clone rank"));
  }
  auto rc = c0.irecv(1, s.tag_base + wire::tag_cancel, in);
  const auto cancel = wire::cancel_msg::decode(std::span<const std::byte>(in.data(), c0.wait(rc)));
  CHECK(cancel.session == 77);
  CHECK(cancel.clone_index == 0);
}
