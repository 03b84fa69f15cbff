// deepclone's strategies in the benchmark: every pipeline x reconstruction, plus the root
// broadcast (single_root + blocking + direct: one root sends everything to every clone
// rank while training stops, which is what Horovod's broadcast_parameters does).
// Kept in its own translation unit: each engine instantiation costs ~15 s of compile.
#include "bench_run.hpp"

namespace bench {
namespace {

template <class Engine>
record run_engine(context& c, typename Engine::settings settings, const std::string& strategy) {
  const int N = c.cfg.sources, M = c.cfg.clones;
  const auto roles = deepclone::roles::contiguous(N, M);
#include <type_traits>
  using source_t = typename Engine::template source<std::vector<float>>;
  using clone_t = typename Engine::template clone<std::vector<float>>;
  run_shared sh;
  sh.sample_clone.resize(static_cast<std::size_t>(M));
  sh.durations.resize(static_cast<std::size_t>(N));
  deepclone::report rep;
  double first_layer_wait = 0;
  const double rss0 = reset_peak_rss();
  const double S = static_cast<double>(c.lay.total_bytes());
  auto& reps = *c.reps;

  c.world->run([&](deepclone::inproc::communicator& inner) {
    link comm(inner, c.fabric);
    const int rank = comm.rank();
    auto& r = *reps[static_cast<std::size_t>(rank)];
    try {
      if (auto i = roles.source_index(rank)) {
        trainer tr{r, c.cfg, c.mode, S};
        source_t src(comm, roles, r.state, settings);
        struct hooks_t {
          source_t& src;
          trainer& tr;
          run_shared& sh;
          bool first;
          void before_update(std::size_t l) { src.before_update(l); }
          void after_update(std::size_t l) {
            src.after_update(l);
            if (first && !sh.have_first_final && src.fork_iteration() == tr.step) {
              sh.t_first_final = clock::now();
              sh.have_first_final = true;
            }
          }
          // agreement::collective: the fork word rides on the trainer's per-iteration allreduce
          // (flags[0]), which this trainer runs after its updates, before end_iteration.
          void contribute(std::span<double> f) {
            if constexpr (Engine::agreement_type::trainer_collective) f[0] = static_cast<double>(src.fork_word());
          }
          void learn(std::span<double> f) {
            if constexpr (Engine::agreement_type::trainer_collective) {
              const bool was = src.cloning();
              src.fork_agreed(static_cast<std::uint64_t>(f[0]));
              if (first && !was && !sh.have_first_final && src.fork_iteration() == tr.step) {  // k's layers are final now
                sh.t_first_final = clock::now();
                sh.have_first_final = true;
              }
            }
          }
          void end_iteration(std::uint64_t s) {
            if (first && src.fork_iteration() == s) {
              std::lock_guard lk(sh.m);
              sh.sample_source = sample(tr.r);
              sh.k = s;
            }
            src.end_iteration(s);
          }
        } hooks{src, tr, sh, *i == 0};
        auto last = clock::now();
        for (;;) {
          double flags[2] = {0, (*i == 0 && sh.clones_done.load() == M) || sh.aborted.load() ? 1.0 : 0.0};
          tr.iterate(comm, roles.sources, hooks, flags);
          if (sh.iteration_done(*i, tr.step, flags[1] > 0, M, c.cfg.warmup, last)) break;
        }
        src.finish();
        if constexpr (std::is_same_v<typename Engine::pipeline_type, deepclone::pipeline::spill>) {
          auto b = src.bytes_spilled(), seen = sh.max_spilled.load();
          while (b > seen && !sh.max_spilled.compare_exchange_weak(seen, b)) {
          }
        }
      } else {
        const auto j = *roles.clone_index(rank);
        for (auto& t : r.tensors) std::fill(t.begin(), t.end(), -1.0f);
        clone_t dst(comm, roles, r.state, settings);
        while (sh.progress0.load() < static_cast<std::uint64_t>(c.cfg.warmup)) std::this_thread::sleep_for(std::chrono::microseconds(50));
        auto t0 = clock::now();
        dst.request();
        sh.requested.fetch_add(1);
        dst.wait_layer(0);
        if (j == 0) first_layer_wait = secs(t0, clock::now());
        dst.wait();
        sh.sample_clone[j] = sample(r);
        auto rp = dst.report();
        if (j == 0) {
          rep = rp;
          sh.t_req = t0;
        }
        sh.clones_done.fetch_add(1);
      }
    } catch (...) {
      sh.aborted = true;
      throw;
    }
  });

  record out;
  out.rep = std::make_shared<deepclone::report>(rep);
  out.strategy = strategy;
  out.pipeline = Engine::pipeline_type::name;
  out.reconstruction = Engine::reconstruct_type::name;
  out.readiness_s = rep.max_readiness_s();
  out.first_layer_s = rep.first_layer_s;
  out.agreement_s = rep.agreement_s;
  double standby = 0;
  for (auto& cl : rep.clones) standby = std::max(standby, cl.standby_s);
  out.standby_s = standby;
  out.overhead_s = rep.max_overhead_s();
  out.hook_s = rep.max_hook_s();
  std::vector<double> normal;
  for (auto& s : rep.sources) {
    out.max_source_bytes = std::max(out.max_source_bytes, s.bytes_sent);
    if (!std::isnan(s.normal_iteration_s)) normal.push_back(s.normal_iteration_s);
  }
  out.iteration_s = median(normal);
  if constexpr (std::is_same_v<typename Engine::pipeline_type, deepclone::pipeline::staged>) {
    auto plan = Engine::make_plan(c.lay, roles, settings);
    std::uint64_t owned = 0;
    for (int i = 0; i < N; ++i) owned = std::max(owned, plan.bytes_of_source(static_cast<std::uint32_t>(i)));
    out.extra_source_bytes = std::min<std::uint64_t>(settings.pipeline.staging_bytes, owned);
  }
  if constexpr (std::is_same_v<typename Engine::pipeline_type, deepclone::pipeline::spill>) out.extra_source_bytes = sh.max_spilled.load();
  // Readiness counted from the moment the first layer of iteration k was final on source 0
  // (the earliest any byte of the clone's state could move).
  out.from_state_s = sh.have_first_final ? out.readiness_s - secs(sh.t_req, sh.t_first_final) : NAN;
  out.verified = true;
  for (auto& s : sh.sample_clone) out.verified = out.verified && s == sh.sample_source;
  out.process_peak_extra_bytes = peak_rss() - rss0;
  return out;
}

template <class P, class R, class A = deepclone::agreement::coordinator>
record run_policy(context& c, const std::string& name, bool verify_replicas = false) {
  using E = deepclone::engine<link, deepclone::shard::split_even, P, R, deepclone::checksum::mix64, A>;
  typename E::settings s;
  s.timeout = std::chrono::seconds(120);
  s.verify_replicas = verify_replicas;
  return run_engine<E>(c, s, name);
}

}  // namespace

record run_deepclone(context& c, const std::string& p, const std::string& r) {
  namespace pl = deepclone::pipeline;
  namespace rc = deepclone::reconstruct;
  if (p == "window" && r == "scatter_exchange") return run_policy<pl::window, rc::scatter_exchange>(c, "deepclone");
  if (p == "window" && r == "direct") return run_policy<pl::window, rc::direct>(c, "deepclone");
  if (p == "staged" && r == "scatter_exchange") return run_policy<pl::staged, rc::scatter_exchange>(c, "deepclone");
  if (p == "staged" && r == "direct") return run_policy<pl::staged, rc::direct>(c, "deepclone");
  if (p == "blocking" && r == "scatter_exchange") return run_policy<pl::blocking, rc::scatter_exchange>(c, "deepclone");
  if (p == "blocking" && r == "direct") return run_policy<pl::blocking, rc::direct>(c, "deepclone");
  if (p == "spill" && r == "scatter_exchange") return run_policy<pl::spill, rc::scatter_exchange>(c, "deepclone");
  if (p == "spill" && r == "direct") return run_policy<pl::spill, rc::direct>(c, "deepclone");
  throw std::invalid_argument("unknown deepclone policies " + p + "/" + r);
}

record run_deepclone_verified(context& c) {
  return run_policy<deepclone::pipeline::window, deepclone::reconstruct::scatter_exchange>(c, "deepclone+verify", true);
}

record run_deepclone_collective(context& c) {
  return run_policy<deepclone::pipeline::window, deepclone::reconstruct::scatter_exchange, deepclone::agreement::collective>(
      c, "deepclone+collective");
}

record run_root_broadcast(context& c) {
  using E = deepclone::engine<link, deepclone::shard::single_root, deepclone::pipeline::blocking, deepclone::reconstruct::direct>;
  typename E::settings s;
  s.timeout = std::chrono::seconds(120);
  return run_engine<E>(c, s, "root_broadcast");
}

}  // namespace bench
