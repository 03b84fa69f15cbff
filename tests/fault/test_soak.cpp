// Soak: 1,000 clones in a row in one process (small state), from one pair of source
// engines to one clone engine that requests again and again. Memory (RSS from
// /proc/self/statm) and threads (/proc/self/task) must not grow. Label "soak".
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>

#include <atomic>
#include <cstdio>
#include <dirent.h>
#include <fstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace dc = deepclone;

namespace {
long rss_kib() {
  std::ifstream f("/proc/self/statm");
  long size = 0, resident = 0;
  f >> size >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}
int threads() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (auto* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}
}  // namespace

namespace {
struct soak_result {
  int completed = 0, thr_100 = 0, thr_end = 0;
  long rss_100 = 0, rss_end = 0;
  std::string error;
};

/// `clones` clones in a row from 2 sources to 1 clone rank.
soak_result soak(int clones) {
  using E = dc::engine<dc::inproc::communicator>;
  const int n = 2, m = 1;
  const auto roles = dc::roles::contiguous(n, m);
  dc::inproc::world world(n + m);
  std::atomic<bool> done{false};
  long rss_100 = 0, rss_end = 0;
  int thr_100 = 0, thr_end = 0, completed = 0;
  std::string error;
  world.run([&](dc::inproc::communicator& c) {
    std::vector<float> w0(20000), w1(3000), b(10);
    dc::state<std::vector<float>> st;
    st.add_layer("l0", {{"w", w0}});
    st.add_layer("l1", {{"w", w1}, {"b", b}});
    E::settings s;
    s.timeout = std::chrono::seconds(10);
    if (c.rank() < n) {
      E::source src(c, roles, st, s);
      for (std::uint64_t step = 0;; ++step) {
        for (std::size_t l = 2; l-- > 0;) {
          src.before_update(l);
          for (auto& t : st.layer_tensors(l)) std::fill(t.ref->begin(), t.ref->end(), float(step));
          src.after_update(l);
        }
        int stop = done.load() ? 1 : 0;
        dc::allreduce_sum(c, roles.sources, std::span<int>(&stop, 1), 10);
        src.end_iteration(step);
        if (stop) break;
      }
      src.finish();
    } else {
      E::clone dst(c, roles, st, s);
      try {
        for (int i = 1; i <= clones; ++i) {
          dst.request();
          dst.wait();
          if (w0[0] == float(*dst.fork_iteration()) && b[9] == float(*dst.fork_iteration())) ++completed;
          if (i == 100) rss_100 = rss_kib(), thr_100 = threads();
        }
      } catch (const dc::error& e) {
        error = std::to_string(completed + 1) + "th clone: " + e.what();
      }
      rss_end = rss_kib();
      thr_end = threads();
      done = true;  // also after a failure: the sources must not train forever
    }
  });
  return {completed, thr_100, thr_end, rss_100, rss_end, error};
}
}  // namespace

TEST_CASE("soak: 1000 clones in a row without growth in memory or threads") {
  const int clones = 1000;
  auto r = soak(clones);
  std::printf("soak: %d/%d clones verified; RSS after 100 clones %ld KiB, after %d: %ld KiB (growth %ld KiB); threads %d -> %d\n",
              r.completed, clones, r.rss_100, clones, r.rss_end, r.rss_end - r.rss_100, r.thr_100, r.thr_end);
  CHECK_MESSAGE(r.error.empty(), r.error);
  CHECK(r.completed == clones);
  CHECK(r.thr_end == r.thr_100);
  CHECK(r.rss_end - r.rss_100 < 2048);  // < 2 MiB over 900 clones
}

TEST_CASE("soak: three soaks side by side on an oversubscribed machine") {
  // Contention makes one source end a session a step after the other while the clone rank
  // already asks for the next one: that source then receives acknowledgements of session
  // i + 1 while it still closes session i, and must keep them for i + 1 (before the fix
  // they were dropped as stale, and the source waited for them until its timeout).
  const int clones = 1000;
  std::vector<soak_result> r(3);
  std::vector<std::thread> t;
  for (auto& x : r) t.emplace_back([&x] { x = soak(clones); });
  for (auto& x : t) x.join();
  for (auto& x : r) {
    std::printf("soak side by side: %d/%d clones verified\n", x.completed, clones);
    CHECK_MESSAGE(x.error.empty(), x.error);
    CHECK(x.completed == clones);
  }
}
