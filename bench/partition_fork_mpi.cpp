// A live fork of partitioned state under mpirun (issue 12 item 7, issue 14): the sources
// train (compute as a timed wait, then every layer they hold rewritten last-first with values
// that name the iteration, then their per-iteration allreduce over MPI) while two clone ranks
// ask for the state at a fixed time, side by side in one run on the same state:
//   - "deepclone": partition_engine with agreement::collective (the fork word rides on the
//     sources' allreduce; the layers of k leave at the decision while the sources train on);
//   - "stop_the_world": the same plan's transfer (partition_transfer.hpp) at the next
//     iteration boundary after the request, the sources stopped until it is done;
//   - both also "_shared" (partition_sharing::exchange: the sources send each byte once,
//     the clone ranks forward it to each other, the stop-the-world one being the sharded
//     transfer with an allgather among the clone ranks);
//   - "checkpoint": at that boundary the sources save their share with fsync
//     (partition_checkpoint.hpp) and train on; the clone ranks then load every file cold.
// The peers learn of the request as a trainer would: source 0 tests for the clone ranks'
// requests right before the allreduce, which carries the flag. Per round the strategies run
// in an order rotated by the round. Figures per round (max over ranks): readiness (request ->
// the last clone rank verified every byte against the agreed iteration), request -> decision
// (deepclone: the fork agreed; peers: the boundary), held (the time a source spent in
// deepclone's hooks beyond their median per iteration, or stopped for the transfer or the
// save), and the iterations' median and slowest. Writes DIR/partition_fork_mpi.jsonl and
// prints a table of medians. Layouts: partition_layouts.hpp's ZeRO-1 and TP2xDP2
// (bert_large + Adam / --divisor) on N=4 sources into M=2 replicated clone ranks: 6 ranks.
// --progress-us X: the Boost.MPI adapter's progress thread (MPI moves a large send only while
// its sender calls into MPI; a trainer computing calls no hook). --link-gbs B: every rank's
// link paced to B GB/s (emulated_link over shm_fabric.hpp; the checkpoint's disk is real).
//
//   mpirun -np 6 build/bench/deepclone_partition_fork_mpi --divisor 8 --rounds 3 --progress-us 100 --out DIR
#include <deepclone/integrations/boost_mpi.hpp>
#include <deepclone/integrations/json.hpp>
#include <deepclone/partition_engine.hpp>

#include <boost/mpi/communicator.hpp>
#include <boost/mpi/environment.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "partition_checkpoint.hpp"
#include "shm_fabric.hpp"
#include "partition_layouts.hpp"

namespace {

namespace dc = deepclone;
using namespace partition_bench;
using clock_type = std::chrono::steady_clock;
/// Raw MPI, or MPI paced to emulated per-rank links (--link-gbs; shm_fabric.hpp).
using comm_t = dc::emulated_link<dc::mpi::communicator, clock_type, bench::shm_fabric>;
using engine_t = dc::partition_engine<comm_t, dc::agreement::collective>;

constexpr int tag_request = 7, tag_saved = 8;  // the peers' request and "saved" messages, below the transfers' tags
constexpr int tag_transfer = 100, tag_engine = 1000;

struct options {
  std::string models_dir = DEEPCLONE_MODELS_DIR, out_dir = ".", ckpt_dir;
  std::uint64_t divisor = 8;
  int rounds = 3, iterations = 8;
  double compute_s = 0.3, request_s = 0.5, progress_us = 0, link_gbs = 0, latency_us = 20;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--divisor") o.divisor = std::stoull(v);
    else if (a == "--rounds") o.rounds = std::stoi(v);
    else if (a == "--iterations") o.iterations = std::stoi(v);
    else if (a == "--compute") o.compute_s = std::stod(v);
    else if (a == "--request-at") o.request_s = std::stod(v);
    else if (a == "--progress-us") o.progress_us = std::stod(v);
    else if (a == "--link-gbs") o.link_gbs = std::stod(v);
    else if (a == "--latency-us") o.latency_us = std::stod(v);
    else if (a == "--out") o.out_dir = v;
    else if (a == "--models-dir") o.models_dir = v;
    else if (a == "--ckpt-dir") o.ckpt_dir = v;
    else throw std::invalid_argument("unknown option " + a);
  }
  if (o.ckpt_dir.empty()) o.ckpt_dir = o.out_dir;
  return o;
}

double since(clock_type::time_point a, clock_type::time_point b = clock_type::now()) { return std::chrono::duration<double>(b - a).count(); }

/// The word every element of the state is XORed with after iteration `it`'s update.
std::uint32_t stamp(std::uint64_t it) { return static_cast<std::uint32_t>((it + 1) * 0x9E3779B1u); }

/// `out` = `base` XOR stamp(it), word by word (the trainer's update, and a clone's expectation).
void stamped(std::span<std::byte> out, std::span<const std::byte> base, std::uint64_t it) {
  const auto s = stamp(it);
  std::size_t i = 0;
  for (; i + 4 <= base.size(); i += 4) {
    std::uint32_t w;
    std::memcpy(&w, base.data() + i, 4);
    w ^= s;
    std::memcpy(out.data() + i, &w, 4);
  }
  for (; i < base.size(); ++i) out[i] = base[i] ^ std::byte(static_cast<std::uint8_t>(s));
}

/// One layout on this rank: its jobs (without and with sharing), the pattern of its
/// holdings, and its live tensors.
struct layout_state {
  scenario s;
  dc::partition_job job, shared_job;
  checkpoint_plan checkpoint;
  std::vector<std::vector<std::byte>> base, live;
  std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> buffers;  // the checkpoint's staging, or a clone rank's files
  layout_state(const dc::layout& lay, scenario sc, std::uint32_t me, const std::string& ckpt_dir)
      : s(std::move(sc)), job(dc::roles::contiguous(4, 2), lay, s.src, s.dst),
        shared_job(dc::roles::contiguous(4, 2), lay, s.src, s.dst, {.sharing = dc::partition_sharing::exchange}),
        checkpoint(make_checkpoint_plan(lay, s, ckpt_dir)) {
    const bool source = me < 4;
    base = own_tensors(lay, source ? s.src[me] : s.dst[me - 4], true);
    live = base;
    if (source) buffers.push_back(aligned_buffer(staging_bytes));
    else buffers = file_buffers(checkpoint);
  }
  void update(std::size_t l, std::uint64_t it) {
    for (auto t = job.global().first_tensor(l); t < job.global().end_tensor(l); ++t) stamped(live[t], base[t], it);
  }
  bool holds(std::size_t l) const {
    for (auto t = job.global().first_tensor(l); t < job.global().end_tensor(l); ++t)
      if (!base[t].empty()) return true;
    return false;
  }
  /// A clone rank's check: every byte is the sources' of iteration k.
  bool exact(std::uint64_t k) const {
    std::vector<std::byte> want;
    for (std::size_t t = 0; t < base.size(); ++t) {
      want.resize(base[t].size());
      stamped(want, base[t], k);
      if (want != live[t]) return false;
    }
    return true;
  }
};

/// What one rank measured in one round.
struct measured {
  double request = 0, decision = 0, ready = 0, held = 0, median_iteration = 0, slowest_iteration = 0, k = 0, hooks = 0;
  bool ok = true;
};

/// What a source's training loop asks of a strategy.
struct strategy {
  virtual ~strategy() = default;
  virtual void before_update(std::size_t) {}
  virtual void after_update(std::size_t) {}
  virtual void end_iteration(std::uint64_t) {}
  virtual std::uint64_t word() { return 0; }
  /// The allreduce's sum of words; true once this source's part of the fork is over.
  virtual bool agreed(std::uint64_t sum, std::uint64_t k) = 0;
};

/// Trains `o.iterations` iterations and on until every source's part is over; the allreduce
/// carries [strategy word, over]. Fills the iteration figures.
void train(MPI_Comm sources, layout_state& st, strategy& s, const options& o, measured& m) {
  std::vector<double> its, held;
  bool over = false;
  const auto give_up = clock_type::now() + std::chrono::minutes(5);
  for (std::uint64_t it = 0;; ++it) {
    const auto t0 = clock_type::now();
    const auto held_before = m.held;
    std::this_thread::sleep_for(std::chrono::duration<double>(o.compute_s));  // forward and backward on an accelerator
    for (std::size_t l = st.job.global().layer_count(); l-- > 0;)
      if (st.holds(l)) {
        s.before_update(l);
        st.update(l, it);
        s.after_update(l);
      }
    s.end_iteration(it);
    std::uint64_t v[2] = {s.word(), over ? 1u : 0u};
    MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_UINT64_T, MPI_SUM, sources);
    over = s.agreed(v[0], it) || over;
    its.push_back(since(t0));
    held.push_back(m.held - held_before);
    if ((v[1] == 4 && static_cast<int>(it) + 1 >= o.iterations) || clock_type::now() > give_up) break;
  }
  m.hooks = median(held);  // what the strategy costs an iteration without a fork
  m.held -= m.hooks * static_cast<double>(held.size());
  m.median_iteration = median(its);
  m.slowest_iteration = *std::max_element(its.begin(), its.end());
  m.ok = over;
}

/// Times the calls it wraps into `held`.
struct held_timer {
  double& held;
  template <class F>
  auto operator()(F f) {
    const auto t0 = clock_type::now();
    struct add {
      double& h;
      clock_type::time_point t0;
      ~add() { h += since(t0); }
    } a{held, t0};
    return f();
  }
};

measured run_deepclone_source(engine_t::source& src, MPI_Comm sources, layout_state& st, const options& o, clock_type::time_point origin) {
  measured m;
  struct hooks final : strategy {
    engine_t::source& e;
    held_timer time;
    measured& m;
    clock_type::time_point origin;
    hooks(engine_t::source& s, measured& mm, clock_type::time_point o) : e(s), time{mm.held}, m(mm), origin(o) {}
    void before_update(std::size_t l) override { time([&] { e.before_update(l); }); }
    void after_update(std::size_t l) override { time([&] { e.after_update(l); }); }
    void end_iteration(std::uint64_t it) override { time([&] { e.end_iteration(it); }); }
    std::uint64_t word() override { return time([&] { return e.fork_word(); }); }
    bool agreed(std::uint64_t sum, std::uint64_t) override {
      const bool was = e.serving();
      const auto t = since(origin);  // the fork_agreed that starts the fork also posts k's sends
      time([&] { e.fork_agreed(sum); });
      if (!was && e.serving()) m.decision = t;
      return e.forks_completed() + e.forks_failed() > 0;
    }
  } h(src, m, origin);
  train(sources, st, h, o, m);
  src.finish();
  if (src.forks_completed() != 1) throw std::runtime_error("deepclone: the fork failed at a source: " + src.last_failure().what);
  return m;
}

/// The peers' sources: source 0 tests for both clone ranks' requests before the allreduce;
/// at the boundary where the flag says so, every source runs `stop` (timed as held).
template <class Stop>
measured run_peer_source(comm_t& c, MPI_Comm sources, layout_state& st, const options& o, clock_type::time_point origin, Stop stop) {
  measured m;
  struct hooks final : strategy {
    comm_t& c;
    measured& m;
    clock_type::time_point origin;
    Stop& stop;
    std::vector<MPI_Request> requests;
    std::byte sink[2]{};
    bool done = false;
    hooks(comm_t& cc, measured& mm, clock_type::time_point o, Stop& s) : c(cc), m(mm), origin(o), stop(s) {
      if (c.rank() == 0)
        for (int j = 0; j < 2; ++j) requests.push_back(MPI_REQUEST_NULL), MPI_Irecv(&sink[j], 1, MPI_BYTE, 4 + j, tag_request, MPI_COMM_WORLD, &requests.back());
    }
    std::uint64_t word() override {
      // MPI_Test per request: Open MPI's MPI_Testall checks before it progresses, so a
      // request that arrived during the compute would be seen one boundary late.
      int all = !done && !requests.empty();
      for (auto& r : requests) {
        int flag = 0;
        MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
        all = all && flag;
      }
      return all ? 1 : 0;
    }
    bool agreed(std::uint64_t sum, std::uint64_t k) override {
      if (sum == 0 || done) return done;
      m.decision = since(origin);
      const auto t0 = clock_type::now();
      stop(k);
      m.held = since(t0);
      requests.clear();
      return done = true;
    }
  } h(c, m, origin, stop);
  train(sources, st, h, o, m);
  return m;
}

/// A peer clone rank: asks at the fixed time, then `receive` (returns the agreed k).
template <class Receive>
measured run_peer_clone(layout_state& st, const options& o, clock_type::time_point origin, Receive receive) {
  measured m;
  std::this_thread::sleep_until(origin + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(o.request_s)));
  m.request = since(origin);
  std::byte one{1};
  MPI_Send(&one, 1, MPI_BYTE, 0, tag_request, MPI_COMM_WORLD);
  const auto k = receive();
  m.ready = since(origin);
  m.ok = st.exact(k);
  m.k = static_cast<double>(k);
  return m;
}

/// One round of strategy `name` ("deepclone", "stop_the_world", "checkpoint"; the first two
/// with "_shared": partition_sharing::exchange, the sources sending each byte once).
measured run_round(std::string name, comm_t& c, MPI_Comm sources, layout_state& st, const options& o) {
  MPI_Barrier(MPI_COMM_WORLD);  // no traffic now: the link timelines start afresh
  if (c.rank() == 0) c.fabric()->reset();
  const bool shared = name.ends_with("_shared");
  if (shared) name.resize(name.size() - 7);
  const auto& job = shared ? st.shared_job : st.job;
  const auto me = static_cast<std::uint32_t>(c.rank());
  const bool source = me < 4;
  const auto& lay = st.job.global();
  if (!source)
    for (auto& t : st.live) std::fill(t.begin(), t.end(), std::byte{0xEE});
  std::vector<std::span<std::byte>> mine;
  for (auto& t : st.live) mine.emplace_back(t.data(), t.size());
  const std::vector<std::span<const std::byte>> held(mine.begin(), mine.end());
  // What each strategy sets up before the clock starts: deepclone's engines, the
  // stop-the-world clone ranks' receives.
  engine_t::settings set;
  set.tag_base = tag_engine;
  std::optional<engine_t::source> src;
  std::optional<engine_t::clone> dst;
  if (name == "deepclone" && source) src.emplace(c, job, held, set);
  if (name == "deepclone" && !source) dst.emplace(c, job, mine, set);
  std::optional<dc::partition_receiver<comm_t>> in;
  if (name == "stop_the_world" && !source) in.emplace(c, job.route(tag_transfer), me - 4, mine);
  MPI_Barrier(MPI_COMM_WORLD);
  const auto origin = clock_type::now();
  if (name == "deepclone") {
    if (source) return run_deepclone_source(*src, sources, st, o, origin);
    measured m;
    std::this_thread::sleep_until(origin + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(o.request_s)));
    m.request = since(origin);
    const auto k = dst->wait();
    m.ready = since(origin);
    m.ok = st.exact(k);
    m.k = static_cast<double>(k);
    return m;
  }
  if (name == "stop_the_world") {
    if (source)
      return run_peer_source(c, sources, st, o, origin, [&](std::uint64_t k) {
        dc::partition_sender<comm_t> out(c, job.route(tag_transfer), me, held);
        for (auto l = static_cast<std::uint32_t>(lay.layer_count()); l-- > 0;) out.send_layer(l);
        out.wait(std::chrono::minutes(2));
        if (me == 0)
          for (int j = 0; j < 2; ++j) MPI_Send(&k, 1, MPI_UINT64_T, 4 + j, tag_saved, MPI_COMM_WORLD);
      });
    std::uint64_t k = 0;
    return run_peer_clone(st, o, origin, [&] {
      in->wait(std::chrono::minutes(2));
      MPI_Recv(&k, 1, MPI_UINT64_T, 0, tag_saved, MPI_COMM_WORLD, MPI_STATUS_IGNORE);  // which iteration it was
      return k;
    });
  }
  if (source)
    return run_peer_source(c, sources, st, o, origin, [&](std::uint64_t k) {
      save_checkpoint(lay, st.checkpoint, me, held, {st.buffers.front().get(), staging_bytes});
      for (int j = 0; j < 2; ++j) MPI_Send(&k, 1, MPI_UINT64_T, 4 + j, tag_saved, MPI_COMM_WORLD);
    });
  return run_peer_clone(st, o, origin, [&] {
    std::uint64_t k = 0;
    for (int i = 0; i < 4; ++i) MPI_Recv(&k, 1, MPI_UINT64_T, i, tag_saved, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    std::vector<std::byte*> files;
    for (auto& b : st.buffers) files.push_back(b.get());
    load_checkpoint(lay, st.checkpoint, mine, files);
    return k;
  });
}

}  // namespace

int main(int argc, char** argv) try {
  const auto o = parse(argc, argv);
  // A progress thread calls MPI beside the trainer's thread: that needs MPI_THREAD_MULTIPLE
  // (the adapter checks the level granted). An exception leaving env's scope aborts every
  // rank (Boost.MPI's abort_on_exception), so none waits in a collective for a failed one.
  boost::mpi::environment env(argc, argv, o.progress_us > 0 ? boost::mpi::threading::multiple : boost::mpi::threading::funneled);
  boost::mpi::communicator world;
  if (world.size() != 6) throw std::invalid_argument("run on 6 ranks (4 sources, 2 clone ranks)");
  dc::mpi::options mo;
  mo.progress_interval = std::chrono::microseconds(static_cast<long>(o.progress_us));
  dc::mpi::communicator base(world, mo);
  const auto me = static_cast<std::uint32_t>(base.rank());
  // The link fabric in shared memory: created by rank 0, attached by the others.
  std::shared_ptr<bench::shm_fabric> fabric = std::make_shared<bench::shm_fabric>(6);
  if (o.link_gbs > 0) {
    std::int64_t job = me == 0 ? static_cast<std::int64_t>(::getpid()) : 0;
    MPI_Bcast(&job, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
    const std::string name = "/deepclone_partition_fork_" + std::to_string(job);
    const dc::link_config lc{o.link_gbs * 1e9, std::chrono::nanoseconds(static_cast<long>(o.latency_us * 1e3))};
    if (me == 0) fabric = std::make_shared<bench::shm_fabric>(name, 6, lc, true);
    MPI_Barrier(MPI_COMM_WORLD);
    if (me != 0) fabric = std::make_shared<bench::shm_fabric>(name, 6, lc, false);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  comm_t c(base, fabric);
  MPI_Comm sources;
  MPI_Comm_split(MPI_COMM_WORLD, me < 4 ? 0 : 1, c.rank(), &sources);
  const auto lay = scaled_model(o.models_dir, "bert_large", o.divisor);
  std::ofstream jl;
  if (me == 0) {
    std::filesystem::create_directories(o.out_dir);
    std::filesystem::create_directories(o.ckpt_dir);
    jl.open(o.out_dir + "/partition_fork_mpi.jsonl");
  }
  const std::vector<std::string> names{"deepclone", "deepclone_shared", "stop_the_world", "stop_the_world_shared", "checkpoint"};
  std::map<std::string, std::vector<nlohmann::json>> rows;
  bool verified = true;
  for (const std::string layout : {"zero1", "tp2dp2"}) {
    layout_state st(lay, layout == "zero1" ? zero1(lay) : tp2dp2(lay), me, o.ckpt_dir);
    for (int round = 0; round < o.rounds; ++round)
      for (std::size_t i = 0; i < names.size(); ++i) {
        const auto& name = names[(i + static_cast<std::size_t>(round)) % names.size()];
        const auto m = run_round(name, c, sources, st, o);
        double mx[8] = {m.request, m.decision, m.ready, m.held, m.median_iteration, m.slowest_iteration, m.k, m.hooks}, red[8];
        MPI_Allreduce(mx, red, 8, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        int ok = m.ok, all = 0;
        MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        verified = verified && all;
        if (me != 0) continue;
        std::ifstream la("/proc/loadavg");
        double load = 0;
        la >> load;
        nlohmann::json j{{"model", "bert_large"}, {"layout", layout}, {"strategy", name}, {"divisor", o.divisor}, {"round", round},
                         {"state_bytes", lay.total_bytes()}, {"compute_s", o.compute_s}, {"request_s", red[0]},
                         {"request_to_decision_s", red[1] - red[0]}, {"decision_to_ready_s", red[2] - red[1]}, {"readiness_s", red[2] - red[0]}, {"held_s", red[3]}, {"hooks_per_iteration_s", red[7]},
                         {"k", red[6]}, {"median_iteration_s", red[4]}, {"slowest_iteration_s", red[5]}, {"verified", all != 0},
                         {"load_average", load}, {"transport", o.progress_us > 0 ? "mpi+progress_thread" : "mpi"}, {"progress_us", o.progress_us}, {"link_gbs", o.link_gbs}, {"latency_us", o.link_gbs > 0 ? o.latency_us : 0}};
        jl << j.dump() << "\n" << std::flush;
        rows[layout + " " + name].push_back(j);
      }
    if (me < 4) std::filesystem::remove(st.checkpoint.path(me));
  }
  if (me == 0) {
    auto med = [](const std::vector<nlohmann::json>& r, const char* k) {
      std::vector<double> v;
      for (const auto& j : r) v.push_back(j[k].get<double>());
      return median(v);
    };
    std::cout << "| layout, strategy | readiness s | request -> decision s | decision -> ready s | held s (max source) | iteration s (median; slowest) |\n"
                 "|---|---|---|---|---|---|\n";
    for (auto& [key, r] : rows)
      std::cout << "| " << key << " | " << med(r, "readiness_s") << " | " << med(r, "request_to_decision_s") << " | "
                << med(r, "decision_to_ready_s") << " | " << med(r, "held_s")
                << " | " << med(r, "median_iteration_s") << "; " << med(r, "slowest_iteration_s") << " |\n";
  }
  MPI_Comm_free(&sources);
  return verified ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "partition_fork_mpi: " << e.what() << "\n";
  return 2;
}
