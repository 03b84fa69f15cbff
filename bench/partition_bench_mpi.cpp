// Partitioned state under mpirun (issue 12 item 3): the partitioned plan's groups moved by
// partition_transfer through the Boost.MPI adapter, one process per rank, with packed
// messages packed by deepclone ("packed": gather_min_average_bytes = 0) against the same
// messages gathered and scattered by MPI derived datatypes ("gathered": the default, runs
// averaging 1 KiB or more), the gathered ones with the clone ranks sharing what both want
// ("gathered_shared": partition_sharing::exchange, the sources sending each byte once),
// side by side in one run on the same state, and their peer: a
// resharding checkpoint ("checkpoint", partition_checkpoint.hpp: each source saves its share
// with fsync, a barrier, each clone rank loads every file cold; its "send calls" are the
// sources' save, for which they stop).
//
// The layouts are partition_bench.cpp's (bert_large + Adam, dimension 0 / --divisor, ZeRO-1
// and TP2xDP2 on N=4 sources into M=2 replicated clone ranks: run it on 6 ranks). Per round,
// every layout and both variants, in an order rotated by the round: a barrier, the sources
// send every layer last-first and wait, the clone ranks (receives posted before the barrier)
// wait and check every byte. Readiness: the barrier -> the last clone rank verified; send
// calls: the longest time a source spent inside send_layer (packing and checksums).
// The checkpoint's files go to --ckpt-dir (default: --out).
// Writes DIR/partition_mpi.jsonl (one line per round and variant) and prints a table of the
// medians.
//
//   mpirun -np 6 build/bench/deepclone_partition_bench_mpi --divisor 8 --rounds 5 --out DIR
#include <deepclone/integrations/boost_mpi.hpp>
#include <deepclone/integrations/json.hpp>
#include <deepclone/partition_transfer.hpp>

#include <boost/mpi/communicator.hpp>
#include <boost/mpi/environment.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "partition_checkpoint.hpp"
#include "partition_layouts.hpp"

namespace {

namespace dc = deepclone;
using namespace partition_bench;
using clock_type = std::chrono::steady_clock;

struct options {
  std::string models_dir = DEEPCLONE_MODELS_DIR, out_dir = ".", ckpt_dir;
  std::uint64_t divisor = 8;
  int rounds = 5;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--divisor") o.divisor = std::stoull(v);
    else if (a == "--rounds") o.rounds = std::stoi(v);
    else if (a == "--out") o.out_dir = v;
    else if (a == "--models-dir") o.models_dir = v;
    else if (a == "--ckpt-dir") o.ckpt_dir = v;
    else throw std::invalid_argument("unknown option " + a);
  }
  if (o.ckpt_dir.empty()) o.ckpt_dir = o.out_dir;
  return o;
}

/// One layout under one variant: its groups and this rank's tensors (the checkpoint: its
/// plan, and a clone rank's pre-faulted buffers for the files).
struct variant {
  std::string layout, name;
  scenario s;
  dc::partition_groups groups;
  std::vector<std::vector<std::byte>> own;
  std::optional<checkpoint_plan> checkpoint = {};
  std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> buffers = {};
};

struct figures {
  double readiness_s = 0, send_calls_s = 0;
  bool verified = true;
};

/// The figures of this rank, reduced over the ranks.
figures reduced(double ready, double calls, bool ok) {
  figures f;
  MPI_Allreduce(&ready, &f.readiness_s, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(&calls, &f.send_calls_s, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  int mine = ok, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  f.verified = all != 0;
  return f;
}

/// One save and load of the checkpoint peer: sources save, a barrier, clone ranks load.
figures run_checkpoint_round(dc::mpi::communicator& c, const dc::layout& lay, variant& v) {
  const auto n = static_cast<std::uint32_t>(v.s.src.size()), me = static_cast<std::uint32_t>(c.rank());
  if (me >= n)
    for (auto& t : v.own) std::fill(t.begin(), t.end(), std::byte{0xEE});
  c.barrier();
  const auto t0 = clock_type::now();
  double ready = 0, save = 0;
  if (me < n) {
    save_checkpoint(lay, *v.checkpoint, me, spans<const std::byte>(v.own), {v.buffers.front().get(), staging_bytes});
    save = std::chrono::duration<double>(clock_type::now() - t0).count();
  }
  c.barrier();
  bool ok = true;
  if (me >= n) {
    std::vector<std::byte*> files;
    for (auto& b : v.buffers) files.push_back(b.get());
    load_checkpoint(lay, *v.checkpoint, spans<std::byte>(v.own), files);
    ready = std::chrono::duration<double>(clock_type::now() - t0).count();
    ok = verify(lay, v.s.dst[me - n], v.own);
  }
  return reduced(ready, save, ok);
}

/// One transfer of `v` on this rank; the figures are reduced over the ranks.
figures run_round(dc::mpi::communicator& c, const dc::layout& lay, variant& v) {
  if (v.checkpoint) return run_checkpoint_round(c, lay, v);
  const auto n = static_cast<std::uint32_t>(v.s.src.size()), me = static_cast<std::uint32_t>(c.rank());
  const auto roles = dc::roles::contiguous(n, static_cast<std::uint32_t>(v.s.dst.size()));
  const dc::partition_route route{roles, lay, v.groups, 100};
  double ready = 0, calls = 0;
  bool ok = true;
  if (me < n) {
    const auto bytes = spans<const std::byte>(v.own);
    dc::partition_sender<dc::mpi::communicator> send(c, route, me, bytes);
    c.barrier();
    const auto t0 = clock_type::now();
    for (auto l = static_cast<std::uint32_t>(lay.layer_count()); l-- > 0;) send.send_layer(l);
    calls = std::chrono::duration<double>(clock_type::now() - t0).count();
    send.wait(std::chrono::minutes(5));
  } else {
    for (auto& t : v.own) std::fill(t.begin(), t.end(), std::byte{0xEE});
    const auto bytes = spans<std::byte>(v.own);
    dc::partition_receiver<dc::mpi::communicator> receive(c, route, me - n, bytes);
    c.barrier();
    const auto t0 = clock_type::now();
    receive.wait(std::chrono::minutes(5));
    ready = std::chrono::duration<double>(clock_type::now() - t0).count();
    ok = verify(lay, v.s.dst[me - n], v.own);
  }
  return reduced(ready, calls, ok);
}

std::vector<variant> variants(const dc::layout& lay, std::uint32_t me, const std::string& ckpt_dir) {
  std::vector<variant> out;
  for (const std::string layout : {"zero1", "tp2dp2"})
    for (const std::string name : {"packed", "gathered", "gathered_shared", "checkpoint"}) {
      auto s = layout == "zero1" ? zero1(lay) : tp2dp2(lay);
      dc::partition_group_options opt;
      if (name == "packed") opt.gather_min_average_bytes = 0;
      const auto sharing = name == "gathered_shared" ? dc::partition_sharing::exchange : dc::partition_sharing::none;
      auto groups = dc::make_partition_groups(dc::make_partition_plan(lay, s.src, s.dst, 256, sharing), 4, 2, opt);
      const bool source = me < s.src.size();
      auto own = own_tensors(lay, source ? s.src[me] : s.dst[me - s.src.size()], source);
      auto& v = out.emplace_back(variant{layout, name, std::move(s), std::move(groups), std::move(own)});
      if (name != "checkpoint") continue;
      v.checkpoint = make_checkpoint_plan(lay, v.s, ckpt_dir);
      if (source) v.buffers.push_back(aligned_buffer(staging_bytes));  // the save's staging
      else v.buffers = file_buffers(*v.checkpoint);
    }
  return out;
}

std::uint64_t gathered_messages(const dc::partition_groups& g) {
  std::uint64_t n = 0;
  for (const auto& gr : g.groups())
    for (const auto& m : gr.messages) n += m.gather;
  return n;
}

}  // namespace

int main(int argc, char** argv) try {
  boost::mpi::environment env(argc, argv);
  boost::mpi::communicator world;
  const auto o = parse(argc, argv);
  if (world.size() != 6) throw std::invalid_argument("run on 6 ranks (4 sources, 2 clone ranks)");
  dc::mpi::communicator c(world);
  const auto lay = scaled_model(o.models_dir, "bert_large", o.divisor);
  auto vs = variants(lay, static_cast<std::uint32_t>(c.rank()), o.ckpt_dir);
  std::ofstream jl;
  if (c.rank() == 0) {
    std::filesystem::create_directories(o.out_dir);
    std::filesystem::create_directories(o.ckpt_dir);
    jl.open(o.out_dir + "/partition_mpi.jsonl");
  }
  std::map<std::string, std::vector<double>> ready, calls;
  bool verified = true;
  for (int round = 0; round < o.rounds; ++round)
    for (std::size_t k = 0; k < vs.size(); ++k) {
      auto& v = vs[(k + static_cast<std::size_t>(round)) % vs.size()];
      const auto f = run_round(c, lay, v);
      verified = verified && f.verified;
      ready[v.layout + " " + v.name].push_back(f.readiness_s);
      calls[v.layout + " " + v.name].push_back(f.send_calls_s);
      if (c.rank() != 0) continue;
      nlohmann::json j{{"model", "bert_large"}, {"layout", v.layout}, {"variant", v.name}, {"divisor", o.divisor}, {"round", round},
                       {"state_bytes", lay.total_bytes()}, {"gathered_messages", v.checkpoint ? 0 : gathered_messages(v.groups)},
                       {"readiness_s", f.readiness_s}, {"send_calls_s", f.send_calls_s}, {"verified", f.verified}, {"transport", "mpi"}};
      jl << j.dump() << "\n" << std::flush;
    }
  if (static_cast<std::size_t>(c.rank()) < vs.back().s.src.size()) std::filesystem::remove(vs.back().checkpoint->path(static_cast<std::size_t>(c.rank())));
  if (c.rank() == 0) {
    std::cout << "| layout, variant | readiness s (median of " << o.rounds << ") | min-max | send calls (checkpoint: save) s |\n|---|---|---|---|\n";
    for (auto& [key, r] : ready)
      std::cout << "| " << key << " | " << median(r) << " | " << *std::min_element(r.begin(), r.end()) << "-"
                << *std::max_element(r.begin(), r.end()) << " | " << median(calls[key]) << " |\n";
  }
  return verified ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "partition_bench_mpi: " << e.what() << "\n";
  return 2;
}
