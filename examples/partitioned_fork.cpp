// Forking a partitioned training job into another layout (issue 12), in one process.
//
// The sources: a hand-written two-layer perceptron trained with tensor parallelism 2 x data
// parallelism 2 (4 ranks). fc1 is column-parallel (each TP rank holds half of its rows), fc2
// row-parallel (half of its columns; its partial outputs are summed over the TP pair); the
// momentum is ZeRO-1 partitioned: each data-parallel rank holds and updates half of its TP
// shard's momentum, and the updated parameter halves are gathered over the DP pair.
// The clones: 2 ranks that each want the whole model and its momentum (TP1, replicated).
//
// The sources run `partition_engine`'s hooks and agree on the fork iteration k in their own
// per-iteration allreduce (agreement::collective: one extra word, no skew to tolerate); the
// clone ranks ask and wait. Each layer of k leaves as soon as it is final (the plan splits
// bytes held by several sources over them; with --share the clone ranks forward each other
// what both want). The sources train on at once: the next step's passes only read the
// layers, and before a step updates a layer still in flight its before_update waits (the
// window rule). Each step's metadata (the data cursor, the hyper-parameters) goes with
// end_iteration; the clone ranks receive source 0's of k. The example prints what moved from
// where and each clone rank's report, checks every byte of every clone against the sources'
// state after step k (assembled here from this file's own index arithmetic, not through the
// library's) and its data cursor, and evaluates the clone's unpartitioned model against the
// sources' partitioned one. Exit status 1 on any difference.
#include <deepclone/collectives.hpp>
#include <deepclone/inproc.hpp>
#include <deepclone/partition_engine.hpp>

#include <algorithm>
#include <atomic>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace dc = deepclone;

namespace {

constexpr std::uint64_t in = 32, hidden = 64, out = 16, half = hidden / 2, batch = 8;
constexpr int tp_tag = 10, dp_tag = 20, agree_tag = 30;
constexpr std::uint64_t max_steps = 1000;

/// One tensor of the model: its global shape, the part a source (tp, dp) holds, and where
/// that source's local element i sits in the global tensor (this file's own arithmetic).
struct tensor_spec {
  const char* name;
  std::vector<std::uint64_t> shape;
  std::function<dc::part(std::uint64_t tp, std::uint64_t dp)> part;
  std::function<std::uint64_t(std::uint64_t i, std::uint64_t tp, std::uint64_t dp)> global;
  std::uint64_t local_size;
};

const std::vector<tensor_spec>& specs() {
  using P = dc::part;
  static const std::vector<tensor_spec> s{
      {"weight", {hidden, in}, [](auto tp, auto) { return P::box({tp * half, 0}, {half, in}); },
       [](auto i, auto tp, auto) { return tp * half * in + i; }, half * in},
      {"bias", {hidden}, [](auto tp, auto) { return P::box({tp * half}, {half}); }, [](auto i, auto tp, auto) { return tp * half + i; }, half},
      {"weight.momentum", {hidden, in}, [](auto tp, auto dp) { return P::flat(tp * half * in + dp * half * in / 2, tp * half * in + (dp + 1) * half * in / 2); },
       [](auto i, auto tp, auto dp) { return tp * half * in + dp * half * in / 2 + i; }, half * in / 2},
      {"bias.momentum", {hidden}, [](auto tp, auto dp) { return P::flat(tp * half + dp * half / 2, tp * half + (dp + 1) * half / 2); },
       [](auto i, auto tp, auto dp) { return tp * half + dp * half / 2 + i; }, half / 2},
      {"weight", {out, hidden}, [](auto tp, auto) { return P::box({0, tp * half}, {out, half}); },
       [](auto i, auto tp, auto) { return (i / half) * hidden + tp * half + i % half; }, out * half},
      {"bias", {out}, [](auto, auto) { return P::whole(); }, [](auto i, auto, auto) { return i; }, out},
      {"weight.momentum", {out, hidden}, [](auto tp, auto dp) { return P::box({dp * out / 2, tp * half}, {out / 2, half}); },
       [](auto i, auto tp, auto dp) { return (dp * out / 2 + i / half) * hidden + tp * half + i % half; }, out / 2 * half},
      {"bias.momentum", {out}, [](auto, auto dp) { return P::flat(dp * out / 2, (dp + 1) * out / 2); },
       [](auto i, auto, auto dp) { return dp * out / 2 + i; }, out / 2}};
  return s;
}
enum tensor_id { w1, b1, m_w1, m_b1, w2, b2, m_w2, m_b2, tensor_count };

dc::layout global_layout() {
  dc::layout l;
  std::array<std::vector<dc::tensor_desc>, 2> layers;
  for (int t = 0; t < tensor_count; ++t) {
    dc::tensor_desc d{specs()[t].name, 8, dc::dtype::f64, {}};
    for (auto x : specs()[t].shape) d.bytes *= x, d.shape.push_back(static_cast<std::int64_t>(x));
    layers[t / 4].push_back(d);
  }
  l.add_layer({"fc1", layers[0]});
  l.add_layer({"fc2", layers[1]});
  return l;
}

using tensors = std::vector<std::vector<double>>;

/// A TP x DP source: its parts of every tensor, one training step, the evaluation loss.
struct source_rank {
  std::uint64_t tp, dp;
  tensors own;
  std::array<int, 2> tp_group, dp_group;

  source_rank(std::uint64_t t, std::uint64_t d) : tp(t), dp(d), tp_group{int(2 * d), int(2 * d + 1)}, dp_group{int(t), int(t + 2)} {
    for (const auto& s : specs()) own.emplace_back(s.local_size, 0.0);
    for (int t2 : {w1, b1, w2, b2})  // the same initial value for a global element on every rank
      for (std::uint64_t i = 0; i < own[t2].size(); ++i) own[t2][i] = 0.1 * std::sin(1.0 + t2 + 0.37 * double(specs()[t2].global(i, tp, dp)));
  }
  /// Loss of a batch; with `grads`, also its gradients of this rank's parameters (one buffer).
  template <class Comm>
  double forward_backward(Comm& c, std::uint64_t seed, std::vector<double>* grads) {
    std::vector<double> x(batch * in), h(batch * half), y(batch * out, 0.0);
    for (std::uint64_t k = 0; k < x.size(); ++k) x[k] = std::cos(double(seed * 131 + k) * 0.7);
    for (std::uint64_t b = 0; b < batch; ++b)
      for (std::uint64_t j = 0; j < half; ++j) {
        double a = own[b1][j];
        for (std::uint64_t i = 0; i < in; ++i) a += own[w1][j * in + i] * x[b * in + i];
        h[b * half + j] = std::max(a, 0.0);
        for (std::uint64_t o = 0; o < out; ++o) y[b * out + o] += own[w2][o * half + j] * h[b * half + j];
      }
    dc::allreduce_sum(c, tp_group, std::span<double>(y), tp_tag);  // row-parallel fc2: sum the partial outputs
    double loss = 0;
    std::vector<double> dy(y.size());
    for (std::uint64_t k = 0; k < y.size(); ++k) {
      const double err = y[k] + own[b2][k % out] - std::sin(double(seed + k));
      loss += err * err / double(y.size());
      dy[k] = 2 * err / double(y.size() * 2);  // the mean over both DP ranks' batches
    }
    if (grads) backward(x, h, dy, *grads);
    return loss;
  }
  void backward(const std::vector<double>& x, const std::vector<double>& h, const std::vector<double>& dy, std::vector<double>& g) const {
    std::vector<double> gw1(half * in), gb1(half), gw2(out * half), gb2(out);
    for (std::uint64_t b = 0; b < batch; ++b)
      for (std::uint64_t j = 0; j < half; ++j) {
        double dh = 0;
        for (std::uint64_t o = 0; o < out; ++o) {
          gw2[o * half + j] += dy[b * out + o] * h[b * half + j];
          dh += own[w2][o * half + j] * dy[b * out + o];
        }
        if (h[b * half + j] <= 0) continue;
        gb1[j] += dh;
        for (std::uint64_t i = 0; i < in; ++i) gw1[j * in + i] += dh * x[b * in + i];
      }
    for (std::uint64_t k = 0; k < dy.size(); ++k) gb2[k % out] += dy[k];
    g.clear();
    for (auto* v : {&gw1, &gb1, &gw2, &gb2}) g.insert(g.end(), v->begin(), v->end());
  }
  /// Data-parallel step: gradients summed over the DP pair, each DP rank updates its half
  /// (ZeRO-1 momentum), the halves are gathered over the pair.
  /// `hooks.before_update(layer)` runs before the step first writes a layer (fc1: 0, fc2:
  /// 1), `hooks.after_update(layer)` once it wrote its last; the parts stay where they are.
  template <class Comm, class Hooks>
  void step(Comm& c, std::uint64_t s, Hooks& hooks) {
    std::vector<double> g;
    forward_backward(c, s * 2 + dp, &g);
    dc::allreduce_sum(c, dp_group, std::span<double>(g), dp_tag);
    std::uint64_t at = 0;
    for (auto [p, m] : {std::pair{w1, m_w1}, std::pair{b1, m_b1}, std::pair{w2, m_w2}, std::pair{b2, m_b2}}) {
      if (p == w1 || p == w2) hooks.before_update(std::size_t(p / 4));
      std::vector<double> updated(own[p].size(), 0.0);
      for (std::uint64_t i = 0; i < own[m].size(); ++i) {
        const auto pi = param_index(p, m, i);
        own[m][i] = 0.9 * own[m][i] + g[at + pi];
        updated[pi] = own[p][pi] - 0.05 * own[m][i];
      }
      dc::allreduce_sum(c, dp_group, std::span<double>(updated), dp_tag + 2);
      std::copy(updated.begin(), updated.end(), own[p].begin());
      at += own[p].size();
      if (p == b1 || p == b2) hooks.after_update(std::size_t(p / 4));
    }
  }
  /// The local index in parameter `p` of momentum element `i` (both local to this rank).
  std::uint64_t param_index(int p, int m, std::uint64_t i) const {
    const auto g = specs()[m].global(i, tp, dp);
    for (std::uint64_t k = 0;; ++k)  // small tensors: a scan keeps the arithmetic in one place
      if (specs()[p].global(k, tp, dp) == g) return k;
  }
};

/// A clone rank's evaluation of the whole model (TP1) on the batch the sources evaluated.
double evaluate_whole(const tensors& t, std::uint64_t seed) {
  double loss = 0;
  for (std::uint64_t b = 0; b < batch; ++b)
    for (std::uint64_t o = 0; o < out; ++o) {
      double y = t[b2][o];
      for (std::uint64_t j = 0; j < hidden; ++j) {
        double a = t[b1][j];
        for (std::uint64_t i = 0; i < in; ++i) a += t[w1][j * in + i] * std::cos(double(seed * 131 + b * in + i) * 0.7);
        y += t[w2][o * hidden + j] * std::max(a, 0.0);
      }
      const double err = y - std::sin(double(seed + b * out + o));
      loss += err * err / double(batch * out);
    }
  return loss;
}

/// Each tensor's bytes: what the sender reads and the receiver writes.
std::vector<std::span<const std::byte>> bytes_of(const tensors& ts) {
  std::vector<std::span<const std::byte>> s;
  for (const auto& t : ts) s.push_back(std::as_bytes(std::span(t)));
  return s;
}
std::vector<std::span<std::byte>> bytes_of(tensors& ts) {
  std::vector<std::span<std::byte>> s;
  for (auto& t : ts) s.push_back(std::as_writable_bytes(std::span(t)));
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  // --share: the sources send each byte once and the two clone ranks forward each other
  // what both want (partition_sharing::exchange), so each source sends half as much.
  const bool share = argc > 1 && std::string_view(argv[1]) == "--share";
  const auto lay = global_layout();
  const auto roles = dc::roles::contiguous(4, 2);
  std::vector<dc::holdings> src(4, dc::holdings(tensor_count)), dst(2, dc::holdings::replicated(lay));
  for (std::uint64_t r = 0; r < 4; ++r)
    for (int t = 0; t < tensor_count; ++t) src[r].of_tensor[t] = {specs()[t].part(r % 2, r / 2)};
  // Every rank plans alike, once; here the threads share one job.
  const dc::partition_job job(roles, lay, src, dst,
                              {.sharing = share ? dc::partition_sharing::exchange : dc::partition_sharing::none,
                               .groups = {.direct_min_bytes = 2048}});  // a small model: show both kinds of message
  using cloning = dc::partition_engine<dc::inproc::communicator>;
  const auto& groups = job.groups();

  dc::inproc::world w(6);
  tensors clone_state[2];
  std::vector<tensors> after_step[4];  // each source's own parts after every step
  std::vector<double> source_loss;     // the sources' evaluation loss after every step
  double clone_loss[2] = {0, 0}, wait_s[4] = {0, 0, 0, 0};
  std::uint64_t fork_k[2] = {0, 0};
  dc::partition_report reports[2];
  std::uint64_t cursor[2] = {0, 0};  // each clone rank's data cursor, from source 0's metadata of k
  std::atomic<int> clones_done{0};
  std::vector<std::thread> ranks;
  for (std::uint64_t r = 0; r < 4; ++r)
    ranks.emplace_back([&, r] {
      auto c = w.comm(int(r));
      source_rank me(r % 2, r / 2);
      cloning::source engine(c, job, bytes_of(std::as_const(me.own)));
      struct timed_hooks {  // the engine's layer hooks, timing the waits for layers in flight
        cloning::source& e;
        double waited = 0;
        void before_update(std::size_t l) {
          const auto t0 = std::chrono::steady_clock::now();
          e.before_update(l);
          waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
        void after_update(std::size_t l) { e.after_update(l); }
      } hooks{engine};
      for (std::uint64_t s = 0; s < max_steps; ++s) {
        me.step(c, s, hooks);
        dc::metadata m;  // what a clone needs to resume: where the data goes on, the hyper-parameters
        m.data_cursor = (s + 1) * 2;  // step s read samples 2s and 2s + 1
        m.hyper = {{"lr", 0.05}, {"momentum", 0.9}};
        engine.end_iteration(s, m);
        after_step[r].push_back(me.own);
        const double loss = me.forward_backward(c, 999, nullptr);  // every TP pair evaluates the same batch
        if (r == 0) source_loss.push_back(loss);
        // The trainer's own allreduce over the sources carries the fork word and the stop.
        std::uint64_t v[2] = {engine.fork_word(), std::uint64_t(clones_done.load() == 2)};
        dc::allreduce_sum(c, std::span<const int>(roles.sources), std::span<std::uint64_t>(v, 2), agree_tag);
        engine.fork_agreed(v[0]);
        if (v[1]) break;
      }
      engine.finish();
      wait_s[r] = hooks.waited;
    });
  for (std::uint32_t k = 0; k < 2; ++k)
    ranks.emplace_back([&, k] {
      auto c = w.comm(int(4 + k));
      for (int t = 0; t < tensor_count; ++t) clone_state[k].emplace_back(lay.tensor(t).bytes / 8, 0.0);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the sources train meanwhile
      cloning::clone engine(c, job, bytes_of(clone_state[k]));
      fork_k[k] = engine.wait();
      reports[k] = engine.report();
      cursor[k] = engine.metadata() ? engine.metadata()->data_cursor : 0;
      clone_loss[k] = evaluate_whole(clone_state[k], 999);
      ++clones_done;
    });
  for (auto& t : ranks) t.join();

  std::printf("what moved (bytes, messages direct+packed) from each source to each clone rank:\n");
  for (std::uint32_t k = 0; k < 2; ++k)
    for (std::uint32_t s = 0; s < 4; ++s) {
      std::uint64_t bytes = 0, direct = 0, packed = 0;
      for (const auto& g : groups.groups())
        if (g.source == s && g.clone == k)
          for (const auto& m : g.messages) bytes += m.bytes, (m.packed ? packed : direct) += 1;
      std::printf("  source %u (tp %u, dp %u) -> clone rank %u: %6llu bytes in %llu+%llu messages\n", s, s % 2, s / 2, k,
                  (unsigned long long)bytes, (unsigned long long)direct, (unsigned long long)packed);
    }
  for (const auto& g : groups.forwards()) {
    std::uint64_t direct = 0, packed = 0;
    for (const auto& m : g.messages) (m.packed ? packed : direct) += 1;
    std::printf("  clone rank %u forwards clone rank %u, of layer fc%u: %6llu bytes in %llu+%llu messages\n", g.source, g.clone, g.layer + 1,
                (unsigned long long)g.bytes, (unsigned long long)direct, (unsigned long long)packed);
  }
  for (std::uint32_t k = 0; k < 2; ++k) {
    const auto& r = reports[k];
    std::printf("clone rank %u: decision after %.1f ms, ready after %.1f ms (layers at %.1f and %.1f ms); %llu bytes from sources, "
                "%llu from clone ranks, of %llu wanted\n",
                k, r.agreement_s * 1e3, r.readiness_s * 1e3, r.layer_ready_s[0] * 1e3, r.layer_ready_s[1] * 1e3,
                (unsigned long long)r.bytes_from_sources, (unsigned long long)r.bytes_from_clones, (unsigned long long)r.wanted_bytes);
  }
  std::printf("the sources agreed to fork after step %llu and trained on during the transfer; waiting for a layer in flight\n"
              "before updating it took %.3f, %.3f, %.3f, %.3f ms\n",
              (unsigned long long)fork_k[0], wait_s[0] * 1e3, wait_s[1] * 1e3, wait_s[2] * 1e3, wait_s[3] * 1e3);
  const std::uint64_t k = fork_k[0];
  if (fork_k[1] != k || k >= source_loss.size()) return std::printf("the clone ranks did not fork at the same step\n"), 1;
  tensors at_fork(tensor_count);  // the global state after step k, by this file's own index arithmetic
  for (int t = 0; t < tensor_count; ++t) at_fork[t].assign(lay.tensor(t).bytes / 8, std::nan(""));
  for (std::uint64_t r = 0; r < 4; ++r)
    for (int t = 0; t < tensor_count; ++t)
      for (std::uint64_t i = 0; i < after_step[r][k][t].size(); ++i) at_fork[t][specs()[t].global(i, r % 2, r / 2)] = after_step[r][k][t][i];
  bool exact = true;
  for (std::uint32_t j = 0; j < 2; ++j)
    for (int t = 0; t < tensor_count; ++t)
      if (std::memcmp(clone_state[j][t].data(), at_fork[t].data(), at_fork[t].size() * 8) != 0) {
        std::printf("clone rank %u: %s.%s differs from the sources' state at the fork\n", j, t < 4 ? "fc1" : "fc2", specs()[t].name);
        exact = false;
      }
  std::printf("every byte of both clone ranks %s the sources' state after step %llu\n", exact ? "equals" : "does NOT equal",
              (unsigned long long)k);
  const bool resumes = cursor[0] == (k + 1) * 2 && cursor[1] == cursor[0];
  std::printf("the clone ranks' metadata: data cursor %llu and %llu (%s)\n", (unsigned long long)cursor[0], (unsigned long long)cursor[1],
              resumes ? "the sample after step k" : "NOT the sample after step k");
  const double loss = source_loss[k];
  std::printf("evaluation loss: sources (TP2 x DP2, partitioned) %.15f, clone ranks (TP1) %.15f %.15f\n", loss, clone_loss[0], clone_loss[1]);
  const bool same_model = std::abs(clone_loss[0] - loss) <= 1e-12 * std::abs(loss) && clone_loss[0] == clone_loss[1];
  if (!same_model) std::printf("the clone's model does not compute the sources' loss\n");
  return exact && same_model && resumes ? 0 : 1;
}
