// deepclone's strategies in the MPI benchmark: every pipeline x reconstruction policy over
// comm_t (the Boost.MPI adapter, through emulated_link), and every agreement policy the
// engine has: the coordinator protocol (settings.fork_lead 2, or 1) and agreement::collective,
// whose word rides on the trainer's allreduce (flags[2]) through the hooks' contribute/learn.
// Kept in its own translation unit: each engine instantiation costs ~15 s of compile.
#include "bench_mpi.hpp"
#include <type_traits>

namespace bench::mpi {
namespace {

template <class Engine>
json run_engine(ctx& c, typename Engine::settings settings, clock::time_point origin) {
  using source_t = typename Engine::template source<std::vector<float>>;
  using clone_t = typename Engine::template clone<std::vector<float>>;
  auto& r = *c.rep;
  json mine;
  comm_t comm = c.comm();
  if (c.is_source()) {
    source_t src(comm, c.roles, r.state, settings);
    struct side_t final : source_side {
      source_t& src;
      replica& r;
      clock::time_point origin;
      json& out;
      std::uint64_t current = 0;  // the iteration now running
      bool first_seen = false;
      side_t(source_t& s, replica& rr, clock::time_point o, json& j) : src(s), r(rr), origin(o), out(j) {}
      void before_update(std::size_t l) override { src.before_update(l); }
      void after_update(std::size_t l) override {
        src.after_update(l);
        if (auto k = src.fork_iteration(); k && *k == current) {
          auto t = since(origin, clock::now());
          if (!first_seen) out["t_first_final"] = t, first_seen = true;
          if (l == 0) out["t_last_final"] = t;  // the last update of iteration k (backward order)
        }
      }
      void contribute(std::span<double> f) override {
        if constexpr (Engine::agreement_type::trainer_collective) f[2] = static_cast<double>(src.fork_word());
      }
      void learn(std::span<double> f) override {
        if constexpr (Engine::agreement_type::trainer_collective) {
          const bool was = src.cloning();
          src.fork_agreed(static_cast<std::uint64_t>(f[2]));
          if (!was && src.fork_iteration() == current) {  // k is this iteration, whose updates are all done
            auto t = since(origin, clock::now());
            out["t_first_final"] = t, first_seen = true;
            out["t_last_final"] = t;
          }
        }
      }
      void end_iteration(std::uint64_t s) override {
        if (auto k = src.fork_iteration(); k && *k == s) {
          out["k"] = s;
          out["sample"] = sample_hash(r);
        }
        src.end_iteration(s);
        current = s + 1;
      }
    } side(src, r, origin, mine);
    source_loop(c, side, origin, mine);
    src.finish();
    if constexpr (std::is_same_v<typename Engine::pipeline_type, deepclone::pipeline::spill>) mine["bytes_spilled"] = src.bytes_spilled();
  } else {
    clone_t dst(comm, c.roles, r.state, settings);
    for (auto& t : r.tensors) std::fill(t.begin(), t.end(), -1.0f);
    std::this_thread::sleep_until(origin + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(c.request_at_s)));
    auto t0 = clock::now();
    dst.request();
    dst.wait_layer(0);
    auto t1 = clock::now();
    dst.wait();
    auto t2 = clock::now();
    auto rep = dst.report();
    mine["t_req"] = since(origin, t0);
    mine["t_first_layer"] = since(origin, t1);
    mine["t_ready"] = since(origin, t2);
    mine["sample"] = sample_hash(r);
    mine["report"] = rep;
    clone_done(c);
  }
  return mine;
}

template <class P, class R, class A = deepclone::agreement::coordinator>
json run_policy(ctx& c, clock::time_point origin, std::uint64_t fork_lead) {
  using E = deepclone::engine<comm_t, deepclone::shard::split_even, P, R, deepclone::checksum::mix64, A>;
  typename E::settings s;
  s.timeout = std::chrono::seconds(120);
  s.fork_lead = fork_lead;
  if (c.cfg.poll_interval_ms >= 0)
    s.poll_interval = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double, std::milli>(c.cfg.poll_interval_ms));
  return run_engine<E>(c, s, origin);
}

}  // namespace

json run_deepclone_mpi(ctx& c, const std::string& p, const std::string& r, const std::string& agreement, clock::time_point origin) {
  namespace pl = deepclone::pipeline;
  namespace rc = deepclone::reconstruct;
  // Agreement policies: the coordinator protocol with its fork_lead ("coordinator" = the
  // default lead 2, "coordinator1" = lead 1) and agreement::collective (default policies only:
  // each engine instantiation costs ~15 s of compile).
  if (agreement == "collective") {
    if (p == "window" && r == "scatter_exchange")
      return run_policy<pl::window, rc::scatter_exchange, deepclone::agreement::collective>(c, origin, 2);
    if (p == "spill" && r == "scatter_exchange")
      return run_policy<pl::spill, rc::scatter_exchange, deepclone::agreement::collective>(c, origin, 2);
    throw std::invalid_argument("agreement::collective is benchmarked with window or spill / scatter_exchange only");
  }
  std::uint64_t lead = 2;
  if (agreement == "coordinator1") lead = 1;
  else if (agreement != "coordinator") throw std::invalid_argument("agreement policy " + agreement + " is not in this engine");
  if (p == "window" && r == "scatter_exchange") return run_policy<pl::window, rc::scatter_exchange>(c, origin, lead);
  if (p == "window" && r == "direct") return run_policy<pl::window, rc::direct>(c, origin, lead);
  if (p == "staged" && r == "scatter_exchange") return run_policy<pl::staged, rc::scatter_exchange>(c, origin, lead);
  if (p == "staged" && r == "direct") return run_policy<pl::staged, rc::direct>(c, origin, lead);
  if (p == "blocking" && r == "scatter_exchange") return run_policy<pl::blocking, rc::scatter_exchange>(c, origin, lead);
  if (p == "blocking" && r == "direct") return run_policy<pl::blocking, rc::direct>(c, origin, lead);
  if (p == "spill" && r == "scatter_exchange") return run_policy<pl::spill, rc::scatter_exchange>(c, origin, lead);
  throw std::invalid_argument("unknown deepclone policies " + p + "/" + r);
}

}  // namespace bench::mpi
