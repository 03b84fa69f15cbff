// deepclone's main demo: N in-process source ranks train an MLP data-parallel; after a
// chosen step M clone ranks fork them and train on with another learning rate while the
// sources keep training. Prints both loss curves and the clone report, and exits non-zero
// if the clone's state at the fork differs by a single bit from the sources' state of the
// fork iteration (tensors, momentum slots and metadata).
//
//   fork_training [--sources N] [--clones M] [--fork-at STEP] [--steps S] [--clone-lr X]
//                 [--shard split_even|whole_tensor|layer_round_robin|single_root]
//                 [--pipeline window|staged|blocking] [--reconstruct direct|scatter_exchange]
//                 [--split-threshold BYTES] [--staging BYTES] [--lr X] [--seed S]
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "fork_harness.hpp"

namespace {

struct options {
  mlp::fork_options run;
  std::string shard = "split_even", pipeline = "window", reconstruct = "scatter_exchange";
  /// Our tensors are 8 to 263 KiB, all below the library's 1 MiB default, so the demo
  /// lowers the split threshold to show tensors actually split over sources and clones.
  std::uint64_t split_threshold = 64 << 10;
  /// Small enough that the staging ring really wraps around for this state.
  std::uint64_t staging = 256 << 10;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "fork_training: %s\n"
               "usage: fork_training [--sources N] [--clones M] [--fork-at STEP] [--steps S] [--clone-lr X]\n"
               "                     [--shard split_even|whole_tensor|layer_round_robin|single_root]\n"
               "                     [--pipeline window|staged|blocking] [--reconstruct direct|scatter_exchange]\n"
               "                     [--split-threshold BYTES] [--staging BYTES] [--lr X] [--seed S]\n",
               why.c_str());
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") usage("fork a live data-parallel MLP training into clone ranks");
    if (i + 1 >= argc) usage("missing value after " + a);
    std::string v = argv[++i];
    auto num = [&]() -> unsigned long long {
      try {
        std::size_t used = 0;
        auto x = std::stoull(v, &used);
        if (used != v.size() || v.front() == '-') throw std::invalid_argument(v);
        return x;
      } catch (const std::exception&) {
        usage("not a non-negative integer for " + a + ": '" + v + "'");
      }
    };
    auto real = [&]() -> double {
      try {
        std::size_t used = 0;
        double x = std::stod(v, &used);
        if (used != v.size()) throw std::invalid_argument(v);
        return x;
      } catch (const std::exception&) {
        usage("not a number for " + a + ": '" + v + "'");
      }
    };
    if (a == "--sources") o.run.sources = static_cast<std::uint32_t>(num());
    else if (a == "--clones") o.run.clones = static_cast<std::uint32_t>(num());
    else if (a == "--fork-at") o.run.fork_at = num();
    else if (a == "--steps") o.run.steps = num();
    else if (a == "--clone-lr") o.run.clone_lr = real();
    else if (a == "--lr") o.run.cfg.lr = real();
    else if (a == "--seed") o.run.cfg.seed = num();
    else if (a == "--shard") o.shard = v;
    else if (a == "--pipeline") o.pipeline = v;
    else if (a == "--reconstruct") o.reconstruct = v;
    else if (a == "--split-threshold") o.split_threshold = num();
    else if (a == "--staging") o.staging = num();
    else usage("unknown option " + a);
  }
  if (o.run.sources == 0 || o.run.sources > 64) usage("--sources must be in [1, 64]");
  if (o.run.clones == 0 || o.run.clones > 64) usage("--clones must be in [1, 64]");
  return o;
}

template <class T>
struct type_tag {
  using type = T;
};

// The policies are template parameters, so each string picks an engine instantiation.
// Each one costs several seconds of compile time, so by default the demo compiles the
// default engine and every variation of one policy at a time around it, plus the
// root-broadcast baseline: 8 of the 24 combinations. Configure with
// -DDEEPCLONE_EXAMPLE_ALL_POLICIES=ON to compile all 24 (several minutes on 2 cores).
namespace sh = deepclone::shard;
namespace pl = deepclone::pipeline;
namespace rc = deepclone::reconstruct;

template <class Shard, class Pipeline, class Reconstruct>
constexpr bool compiled_in() {
#ifdef DEEPCLONE_EXAMPLE_ALL_POLICIES
  return true;
#else
  constexpr int changed = !std::is_same_v<Shard, sh::split_even> + !std::is_same_v<Pipeline, pl::window> +
                          !std::is_same_v<Reconstruct, rc::scatter_exchange>;
  constexpr bool broadcast_baseline = std::is_same_v<Shard, sh::single_root> && std::is_same_v<Pipeline, pl::blocking> &&
                                      std::is_same_v<Reconstruct, rc::direct>;
  return changed <= 1 || broadcast_baseline;
#endif
}

template <class F>
int with_shard(const std::string& s, F&& f) {
  if (s == "split_even") return f(type_tag<sh::split_even>{});
  if (s == "whole_tensor") return f(type_tag<sh::whole_tensor>{});
  if (s == "layer_round_robin") return f(type_tag<sh::layer_round_robin>{});
  if (s == "single_root") return f(type_tag<sh::single_root>{});
  usage("unknown --shard '" + s + "'");
}
template <class F>
int with_pipeline(const std::string& s, F&& f) {
  if (s == "window") return f(type_tag<pl::window>{});
  if (s == "staged") return f(type_tag<pl::staged>{});
  if (s == "blocking") return f(type_tag<pl::blocking>{});
  usage("unknown --pipeline '" + s + "'");
}
template <class F>
int with_reconstruct(const std::string& s, F&& f) {
  if (s == "direct") return f(type_tag<rc::direct>{});
  if (s == "scatter_exchange") return f(type_tag<rc::scatter_exchange>{});
  usage("unknown --reconstruct '" + s + "'");
}

template <class Engine>
int run(const options& o) {
  typename Engine::settings st;
  if constexpr (requires { st.shard.threshold; }) st.shard.threshold = o.split_threshold;
  if constexpr (requires { st.reconstruct.threshold; }) st.reconstruct.threshold = o.split_threshold;
  if constexpr (requires { st.pipeline.staging_bytes; }) st.pipeline.staging_bytes = o.staging;

  const auto& cfg = o.run.cfg;
  std::string arch;
  std::uint64_t params = 0;
  for (std::size_t l = 0; l < cfg.widths.size(); ++l) {
    arch += (l ? "-" : "") + std::to_string(cfg.widths[l]);
    if (l) params += cfg.widths[l] * (cfg.widths[l - 1] + 1);
  }
  std::printf("deepclone fork_training: %u source ranks -> %u clone ranks, in process\n", o.run.sources, o.run.clones);
  std::printf("model: MLP %s (tanh), %llu parameters, state %llu B with momentum; global batch %zu, seed %llu\n",
              arch.c_str(), static_cast<unsigned long long>(params), static_cast<unsigned long long>(8 * params),
              cfg.global_batch, static_cast<unsigned long long>(cfg.seed));
  std::printf("policies: %s (split threshold %llu B%s)\n", Engine::describe(st).c_str(),
              static_cast<unsigned long long>(o.split_threshold),
              std::is_same_v<typename Engine::pipeline_type, deepclone::pipeline::staged>
                  ? (", staging " + std::to_string(o.staging) + " B").c_str()
                  : "");
  std::printf("the clone ranks request a fork after step %llu; sources lr %g, clone lr %g; %llu steps\n\n",
              static_cast<unsigned long long>(o.run.fork_at), cfg.lr, o.run.clone_lr,
              static_cast<unsigned long long>(o.run.steps));

  mlp::fork_result r;
  try {
    r = mlp::run_fork<Engine>(o.run, st);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fork_training: FAILED: %s\n", e.what());
    return 1;
  }

  std::printf(" step   source loss    clone loss\n");
  for (std::uint64_t s = 0; s < o.run.steps; ++s) {
    std::printf("%5llu  %12.6f", static_cast<unsigned long long>(s), r.source_loss[s]);
    if (r.clone_loss[s]) std::printf("  %12.6f", *r.clone_loss[s]);
    else if (s == r.k) std::printf("  <- fork: the clone starts from the state of this iteration");
    std::printf("\n");
  }
  std::printf("\n%s", deepclone::to_string(r.report).c_str());
  std::printf("  clone rank %d could start its forward pass %.4f s after its request (layer 0 ready)\n",
              static_cast<int>(o.run.sources), r.first_layer_wait_s);
  std::printf("  whole run %.3f s\n\n", r.seconds);

  // The check the demo exists for: every clone rank, right after wait() and before its
  // first update, holds bit for bit what source rank 0 held at the end of iteration k.
  std::uint64_t bytes = 0;
  for (auto& t : r.source_at_fork.tensors) bytes += t.size() * sizeof(float);
  int bad = 0;
  if (r.source_at_fork.meta.step != r.k) {
    std::printf("check: FAILED: the sources' snapshot is of iteration %llu, the clone's fork is %llu\n",
                static_cast<unsigned long long>(r.source_at_fork.meta.step), static_cast<unsigned long long>(r.k));
    ++bad;
  }
  for (std::uint32_t j = 0; j < o.run.clones; ++j) {
    auto diff = mlp::first_difference(r.clone_at_fork[j], r.source_at_fork, r.names);
    int rank = static_cast<int>(o.run.sources + j);
    if (diff.empty())
      std::printf("check: clone rank %d holds the sources' state of iteration %llu bit for bit (%zu tensors, %llu B, "
                  "metadata: step %llu, data cursor %llu, rng, lr, momentum)\n",
                  rank, static_cast<unsigned long long>(r.k), r.source_at_fork.tensors.size(),
                  static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(r.clone_at_fork[j].meta.step),
                  static_cast<unsigned long long>(r.clone_at_fork[j].meta.data_cursor));
    else {
      std::printf("check: FAILED: clone rank %d differs from the sources' state of iteration %llu: %s\n", rank,
                  static_cast<unsigned long long>(r.k), diff.c_str());
      ++bad;
    }
  }
  std::printf("%s\n", bad ? "result: FAILED" : "result: OK");
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  return with_shard(o.shard, [&](auto shard_tag) {
    return with_pipeline(o.pipeline, [&](auto pipeline_tag) {
      return with_reconstruct(o.reconstruct, [&](auto reconstruct_tag) {
        using S = typename std::remove_cvref_t<decltype(shard_tag)>::type;
        using P = typename std::remove_cvref_t<decltype(pipeline_tag)>::type;
        using R = typename std::remove_cvref_t<decltype(reconstruct_tag)>::type;
        if constexpr (compiled_in<S, P, R>()) {
          return run<deepclone::engine<deepclone::inproc::communicator, S, P, R>>(o);
        } else {
          usage(o.shard + "/" + o.pipeline + "/" + o.reconstruct +
                " is not compiled into this build: it holds split_even/window/scatter_exchange, every variation of "
                "one policy from it, and single_root/blocking/direct (configure with "
                "-DDEEPCLONE_EXAMPLE_ALL_POLICIES=ON for all 24)");
          return 2;
        }
      });
    });
  });
}
