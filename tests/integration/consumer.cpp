// A consumer of deepclone: forks a 2-source state into 2 clone ranks in process and checks
// the clone's bytes. Built by CTest against the source tree and against an installed copy.
#include <deepclone/deepclone.hpp>

#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

int main() {
  using cloning = deepclone::engine<deepclone::inproc::communicator>;
  const int n = 2, m = 2;
  const auto roles = deepclone::roles::contiguous(n, m);
  deepclone::inproc::world world(n + m);
  std::atomic<int> bad{0};
  std::atomic<int> requested{0};  // "the user forks now": the sources are still training then
  world.run([&](deepclone::inproc::communicator& comm) {
    std::vector<float> w(100000, 0.0f);
    deepclone::state<std::vector<float>> state;
    state.add_layer("fc", {{"weight", w}});
    if (comm.rank() < n) {
      cloning::source src(comm, roles, state);
      for (std::uint64_t step = 0; step < 20; ++step) {
        src.before_update(0);
        for (auto& x : w) x += 1.0f;  // after iteration k every weight is k + 1
        src.after_update(0);
        deepclone::barrier(comm, roles.sources, 1);  // stands for the gradient allreduce
        src.end_iteration(step);
        if (comm.rank() == 0 && step == 2)  // a loaded machine may start the clone threads late
          while (requested.load() < m) std::this_thread::yield();
      }
    } else {
      cloning::clone dst(comm, roles, state);
      dst.request();
      ++requested;
      dst.wait();
      const float expected = static_cast<float>(dst.metadata().step + 1);
      for (float x : w)
        if (x != expected) ++bad;
    }
  });
  std::printf("consumer: %s\n", bad ? "clone differs" : "clone identical");
  return bad ? 1 : 0;
}
