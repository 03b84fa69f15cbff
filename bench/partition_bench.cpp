// Partitioned state (issue 12 item 7): how fast the partitioned plan's bytes reach the clone
// ranks, against the bound of the busiest link, and how the work spreads over the sources.
//
// A model's real layout (tests/models, bert_large by default) with Adam's two slots per
// parameter, every tensor's dimension 0 divided by --divisor (8: ~500 MB of global state),
// in two layouts a large trainer uses:
//   zero1   ZeRO-1 over N=4 data-parallel sources: parameters replicated, the slots one flat
//           buffer cut into 4 equal contiguous ranges (so a tensor is held by one rank, or
//           split unevenly over two) -> M=2 replicated clone ranks;
//   tp2dp2  tensor parallel 2 x data parallel 2 (Megatron's split of a transformer: QKV,
//           linear1 and the vocabulary embedding column-parallel along dim 0, their biases
//           too; out_proj and linear2 row-parallel along dim 1, their biases replicated;
//           the rest replicated; Adam's slots split as their parameter) -> TP1 on M=2.
// Every rank is a thread of the in-process transport; each rank's links are left as they are
// ("raw") or paced by emulated_link at --link-gbs full-scale GB/s (paced at link_gbs / divisor
// so that times match the full-size model), busy-until ("emulated", as every other bench) or
// with backfill ("emulated_backfill": a message takes the first gap free on both of its
// sides, as concurrent flows share a real network; see link_config). The sources send every
// layer's groups at a common start (the state is final: an iteration boundary) through
// partition_sender, the clone ranks receive and verify them through partition_receiver.
//
// Per round: readiness (common start -> last clone rank holds every byte, verified), the
// bound max over ranks of (bytes through its link, each direction) / B with B measured on the
// same transport in the same run, bytes sent per source against M x sum over tensors of
// (held / replication factor) -- or, with --sharing exchange (partition_sharing::exchange:
// the clone ranks forward to each other what several of them want), 1 x that sum -- and the
// time the sources spend inside send calls (packing, checksums). Every
// clone byte is checked against the value of its global position after each round.
// The peer, in the same run and on the same state (--peers checkpoint, the default; none):
// a resharding checkpoint as PyTorch DCP makes one. Each source saves its share with fsync,
// then every clone rank loads all of it cold (O_DIRECT) into its own layout; its readiness is
// save + load, and the sources stop for the save (section "peer" below).
// Writes DIR/partition.jsonl (one line per round), DIR/partition_summary.jsonl (median,
// min, max per layout and link or peer) and DIR/partition_table.md.
#include <deepclone/emulated_link.hpp>
#include <deepclone/inproc.hpp>
#include <deepclone/integrations/json.hpp>
#include <deepclone/partition_transfer.hpp>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "partition_checkpoint.hpp"
#include "partition_layouts.hpp"

namespace {

namespace dc = deepclone;
using namespace partition_bench;
using clock_type = std::chrono::steady_clock;
using link = dc::emulated_link<dc::inproc::communicator>;
double secs(clock_type::time_point a, clock_type::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct options {
  std::string models_dir = DEEPCLONE_MODELS_DIR, model = "bert_large", out_dir = ".";
  std::uint64_t divisor = 8;  ///< every tensor's dimension 0 is divided by this
  double link_gbs = 1.0, latency_us = 20;
  int rounds = 3;
  std::vector<std::string> layouts{"zero1", "tp2dp2"}, links{"raw", "emulated", "emulated_backfill"};
  std::vector<std::string> sharing{"none", "exchange"};  ///< partition_sharing of each run (--sharing)
  bool checkpoint = true;  ///< also run the resharding checkpoint peer (--peers checkpoint|none)
  std::string ckpt_dir;    ///< where it writes (--ckpt-dir; default: --out)
};

/// What one round measured.
struct round_result {
  double readiness_s = 0, send_calls_s = 0;
  bool verified = true;
};

/// Runs one transfer of `s`: every rank on its own thread over `fabric`, a common start.
round_result run_round(const dc::layout& lay, const scenario& s, const dc::partition_route& route, std::shared_ptr<dc::link_fabric<>> fabric,
                       std::vector<std::vector<std::vector<std::byte>>>& src, std::vector<std::vector<std::vector<std::byte>>>& dst) {
  const auto n = s.src.size(), m = s.dst.size();
  for (auto& c : dst)
    for (auto& t : c) std::fill(t.begin(), t.end(), std::byte{0xEE});
  dc::inproc::world w(static_cast<int>(n + m));
  std::barrier start(static_cast<std::ptrdiff_t>(n + m));
  clock_type::time_point t0;
  std::vector<clock_type::time_point> done(m);
  std::vector<double> send_calls(n);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      link comm(w.comm(static_cast<int>(i)), fabric);
      const auto own = spans<const std::byte>(src[i]);
      dc::partition_sender<link> send(comm, route, static_cast<std::uint32_t>(i), own);
      start.arrive_and_wait();
      if (i == 0) t0 = clock_type::now();
      const auto c0 = clock_type::now();
      for (auto l = static_cast<std::uint32_t>(lay.layer_count()); l-- > 0;) send.send_layer(l);  // as a trainer's updates come
      send_calls[i] = secs(c0, clock_type::now());
      send.wait(std::chrono::minutes(5));
    });
  for (std::size_t c = 0; c < m; ++c)
    threads.emplace_back([&, c] {
      link comm(w.comm(static_cast<int>(n + c)), fabric);
      const auto own = spans<std::byte>(dst[c]);
      dc::partition_receiver<link> receive(comm, route, static_cast<std::uint32_t>(c), own);
      start.arrive_and_wait();
      receive.wait(std::chrono::minutes(5));
      done[c] = clock_type::now();
    });
  for (auto& t : threads) t.join();
  round_result r{secs(t0, *std::max_element(done.begin(), done.end())), *std::max_element(send_calls.begin(), send_calls.end()), true};
  for (std::size_t c = 0; c < m; ++c) r.verified = r.verified && verify(lay, s.dst[c], dst[c]);
  return r;
}

// ------------------------------------------------------------ peer: a resharding checkpoint
// (partition_checkpoint.hpp)

struct checkpoint_round {
  double save_s = 0, readiness_s = 0;
  std::string cold_read;
  bool verified = true;
};

/// One save and load: the sources save at a common start (the state is final), the clone ranks
/// load once every source has saved (a restart starts from a complete checkpoint).
checkpoint_round run_checkpoint_round(const dc::layout& lay, const scenario& s, const checkpoint_plan& cp,
                                      std::vector<std::vector<std::vector<std::byte>>>& src, std::vector<std::vector<std::vector<std::byte>>>& dst,
                                      std::vector<std::vector<std::byte*>>& files, std::vector<std::span<std::byte>> staging) {
  const auto n = s.src.size(), m = s.dst.size();
  for (auto& c : dst)
    for (auto& t : c) std::fill(t.begin(), t.end(), std::byte{0xEE});
  std::barrier start(static_cast<std::ptrdiff_t>(n + m)), saved(static_cast<std::ptrdiff_t>(n + m));
  clock_type::time_point t0, t_saved;
  std::vector<clock_type::time_point> done(m);
  std::vector<std::string> how(m);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      const auto own = spans<const std::byte>(src[i]);
      start.arrive_and_wait();
      save_checkpoint(lay, cp, static_cast<std::uint32_t>(i), own, staging[i]);
      saved.arrive_and_wait();
    });
  for (std::size_t c = 0; c < m; ++c)
    threads.emplace_back([&, c] {
      const auto own = spans<std::byte>(dst[c]);
      start.arrive_and_wait();
      if (c == 0) t0 = clock_type::now();
      saved.arrive_and_wait();
      if (c == 0) t_saved = clock_type::now();
      how[c] = load_checkpoint(lay, cp, own, files[c]);
      done[c] = clock_type::now();
    });
  for (auto& t : threads) t.join();
  checkpoint_round r{secs(t0, t_saved), secs(t0, *std::max_element(done.begin(), done.end())), how[0], true};
  for (std::size_t c = 0; c < m; ++c) r.verified = r.verified && verify(lay, s.dst[c], dst[c]);
  return r;
}

/// Point-to-point bandwidth from rank 0 to rank 1 over `fabric` (best of 3, `bytes` each).
double probe_bandwidth(std::shared_ptr<dc::link_fabric<>> fabric, int ranks, std::size_t bytes) {
  std::vector<std::byte> out(bytes, std::byte{1}), in(bytes, std::byte{0});
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    dc::inproc::world w(ranks);
    double t = 0;
    std::thread receiver([&] {
      link comm(w.comm(1), fabric);
      const auto t0 = clock_type::now();
      auto r = comm.irecv(0, 7, in);
      comm.wait(r);
      t = secs(t0, clock_type::now());
    });
    link comm(w.comm(0), fabric);
    auto s = comm.isend(1, 7, out);
    comm.wait(s);
    receiver.join();
    best = std::max(best, static_cast<double>(bytes) / t);
  }
  return best;
}

std::vector<double> loadavg() {
  std::ifstream f("/proc/loadavg");
  std::vector<double> v(3, 0);
  f >> v[0] >> v[1] >> v[2];
  return v;
}

/// Everything about one layout that does not change between rounds.
struct setup {
  scenario s;
  std::string sharing;  ///< "none" or "exchange"
  dc::partition_plan plan;
  dc::partition_groups groups;
  double plan_s = 0;
  expectation expect;
  std::uint64_t busiest_link = 0;  ///< bytes through the busiest rank's link
};

/// The bytes through the busiest link, each direction on its own (full duplex): a source
/// sends its groups; a clone rank receives its groups and the forwards to it, and sends its
/// forwards.
std::uint64_t busiest_link(const dc::partition_groups& groups, std::uint32_t n, std::uint32_t m) {
  std::uint64_t busiest = 0;
  for (std::uint32_t r = 0; r < n; ++r) busiest = std::max(busiest, groups.bytes_sent_by_source(r));
  for (std::uint32_t c = 0; c < m; ++c) {
    std::uint64_t in = groups.bytes_received_by_clone(c);
    for (auto g : groups.forwarded_to_clone(c)) in += groups.forwards()[g].bytes;
    busiest = std::max({busiest, in, groups.bytes_forwarded_by_clone(c)});
  }
  return busiest;
}

setup prepare(const dc::layout& lay, scenario s, const std::string& sharing) {
  if (sharing != "none" && sharing != "exchange") throw std::invalid_argument("unknown sharing " + sharing);
  const auto mode = sharing == "exchange" ? dc::partition_sharing::exchange : dc::partition_sharing::none;
  const auto n = static_cast<std::uint32_t>(s.src.size()), m = static_cast<std::uint32_t>(s.dst.size());
  const auto t0 = clock_type::now();
  auto plan = dc::make_partition_plan(lay, s.src, s.dst, 256, mode);
  auto groups = dc::make_partition_groups(plan, n, m);
  const double plan_s = secs(t0, clock_type::now());
  auto e = expected(lay, s, mode == dc::partition_sharing::exchange);
  const auto busiest = busiest_link(groups, n, m);
  return {std::move(s), sharing, std::move(plan), std::move(groups), plan_s, std::move(e), busiest};
}

nlohmann::json row(const options& o, const dc::layout& lay, const setup& st, const std::string& link_name, double B, int round,
                   const round_result& r) {
  std::vector<std::uint64_t> sent, received, messages;
  for (std::uint32_t i = 0; i < st.s.src.size(); ++i) {
    sent.push_back(st.groups.bytes_sent_by_source(i));
    messages.push_back(st.groups.messages_sent_by_source(i));
  }
  for (std::uint32_t c = 0; c < st.s.dst.size(); ++c) received.push_back(st.groups.bytes_received_by_clone(c));
  const double bound = static_cast<double>(st.busiest_link) / B;
  return {{"model", o.model}, {"layout", st.s.name}, {"sharing", st.sharing}, {"divisor", o.divisor}, {"sources", st.s.src.size()},
          {"clones", st.s.dst.size()}, {"link", link_name}, {"round", round}, {"state_bytes", lay.total_bytes()}, {"held_bytes", st.expect.held},
          {"sent_bytes", sent}, {"expected_sent_bytes", st.expect.sent}, {"received_bytes", received}, {"messages", messages},
          {"bandwidth_Bps", B}, {"bound_s", bound}, {"readiness_s", r.readiness_s}, {"readiness_over_bound", r.readiness_s / bound},
          {"send_calls_s", r.send_calls_s}, {"plan_s", st.plan_s}, {"verified", r.verified}, {"loadavg", loadavg()}};
}

/// Median, min and max of one figure over the rounds of one layout and link.
nlohmann::json spread(const std::vector<nlohmann::json>& rows, const char* key) {
  std::vector<double> v;
  for (const auto& r : rows) v.push_back(r[key].get<double>());
  return {{"median", median(v)}, {"min", *std::min_element(v.begin(), v.end())}, {"max", *std::max_element(v.begin(), v.end())}};
}

nlohmann::json summary(const std::vector<nlohmann::json>& rows) {
  const auto& f = rows.front();
  bool verified = true;
  for (const auto& r : rows) verified = verified && r["verified"].get<bool>();
  return {{"model", f["model"]}, {"layout", f["layout"]}, {"sharing", f["sharing"]}, {"link", f["link"]}, {"rounds", rows.size()},
          {"state_bytes", f["state_bytes"]},
          {"sent_bytes", f["sent_bytes"]}, {"expected_sent_bytes", f["expected_sent_bytes"]}, {"bound_s", spread(rows, "bound_s")},
          {"readiness_s", spread(rows, "readiness_s")}, {"readiness_over_bound", spread(rows, "readiness_over_bound")},
          {"send_calls_s", spread(rows, "send_calls_s")}, {"verified", verified}};
}

std::string table(const std::vector<nlohmann::json>& summaries) {
  std::ostringstream t;
  t.precision(3);
  t << "| link | layout | sharing | state MB | MB sent per source (expected) | readiness s (min-max) | bound s | readiness/bound | send calls s |\n"
    << "|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& s : summaries) {
    t << "| " << s["link"].get<std::string>() << " | " << s["layout"].get<std::string>() << " | " << s["sharing"].get<std::string>() << " | "
      << s["state_bytes"].get<double>() / 1e6 << " | ";
    for (std::size_t i = 0; i < s["sent_bytes"].size(); ++i)
      t << (i ? ", " : "") << s["sent_bytes"][i].get<double>() / 1e6 << " (" << s["expected_sent_bytes"][i].get<double>() / 1e6 << ")";
    const auto& r = s["readiness_s"];
    t << " | " << r["median"].get<double>() << " (" << r["min"].get<double>() << "-" << r["max"].get<double>() << ") | "
      << s["bound_s"]["median"].get<double>() << " | " << s["readiness_over_bound"]["median"].get<double>() << " | "
      << s["send_calls_s"]["median"].get<double>() << " |\n";
  }
  return t.str();
}

options parse(int argc, char** argv) {
  options o;
  auto list = [](const std::string& v) {
    std::vector<std::string> out;
    std::stringstream ss(v);
    for (std::string x; std::getline(ss, x, ',');) out.push_back(x);
    return out;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--model") o.model = v;
    else if (a == "--models-dir") o.models_dir = v;
    else if (a == "--divisor") o.divisor = std::stoull(v);
    else if (a == "--link-gbs") o.link_gbs = std::stod(v);
    else if (a == "--latency-us") o.latency_us = std::stod(v);
    else if (a == "--rounds") o.rounds = std::stoi(v);
    else if (a == "--layouts") o.layouts = list(v);
    else if (a == "--links") o.links = list(v);
    else if (a == "--sharing") o.sharing = list(v);
    else if (a == "--out") o.out_dir = v;
    else if (a == "--ckpt-dir") o.ckpt_dir = v;
    else if (a == "--peers" && (v == "checkpoint" || v == "none")) o.checkpoint = v == "checkpoint";
    else throw std::invalid_argument("unknown option " + a);
  }
  if (o.divisor == 0 || o.rounds < 1) throw std::invalid_argument("--divisor and --rounds must be positive");
  if (o.ckpt_dir.empty()) o.ckpt_dir = o.out_dir;
  return o;
}

/// Every round of one layout over one link; returns its rows.
std::vector<nlohmann::json> measure(const options& o, const dc::layout& lay, const setup& st, const std::string& link_name, std::ostream& jl) {
  const int ranks = static_cast<int>(st.s.src.size() + st.s.dst.size());
  dc::link_config cfg;
  if (link_name == "emulated" || link_name == "emulated_backfill")
    cfg = {o.link_gbs * 1e9 / static_cast<double>(o.divisor), std::chrono::nanoseconds(static_cast<long>(o.latency_us * 1e3)),
           link_name == "emulated_backfill"};
  else if (link_name != "raw") throw std::invalid_argument("unknown link " + link_name);
  auto fabric = std::make_shared<dc::link_fabric<>>(ranks, cfg);
  const double B = probe_bandwidth(fabric, ranks, std::min<std::size_t>(lay.total_bytes() / 4, std::size_t{128} << 20));
  const dc::roles roles = dc::roles::contiguous(static_cast<std::uint32_t>(st.s.src.size()), static_cast<std::uint32_t>(st.s.dst.size()));
  const dc::partition_route route{roles, lay, st.groups, 100};
  std::vector<std::vector<std::vector<std::byte>>> src, dst;
  for (const auto& h : st.s.src) src.push_back(own_tensors(lay, h, true));
  for (const auto& h : st.s.dst) dst.push_back(own_tensors(lay, h, false));
  std::vector<nlohmann::json> rows;
  for (int round = 0; round < o.rounds; ++round) {
    rows.push_back(row(o, lay, st, link_name, B, round, run_round(lay, st.s, route, fabric, src, dst)));
    jl << rows.back().dump() << "\n" << std::flush;
    std::cerr << st.s.name << " " << st.sharing << " " << link_name << " round " << round << ": readiness " << rows.back()["readiness_s"].get<double>()
              << " s, bound " << rows.back()["bound_s"].get<double>() << " s, verified " << rows.back()["verified"].get<bool>() << "\n";
  }
  return rows;
}

/// Every round of the checkpoint peer on one layout; returns its summary (rows go to `jl`).
nlohmann::json measure_checkpoint(const options& o, const dc::layout& lay, const setup& st, std::ostream& jl) {
  const auto cp = make_checkpoint_plan(lay, st.s, o.ckpt_dir);
  std::vector<std::vector<std::vector<std::byte>>> src, dst;
  for (const auto& h : st.s.src) src.push_back(own_tensors(lay, h, true));
  for (const auto& h : st.s.dst) dst.push_back(own_tensors(lay, h, false));
  std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> buffers;  // pre-faulted outside the rounds
  std::vector<std::span<std::byte>> staging;
  for (std::size_t i = 0; i < src.size(); ++i) {
    buffers.push_back(aligned_buffer(staging_bytes));
    staging.emplace_back(buffers.back().get(), staging_bytes);
  }
  std::vector<std::vector<std::byte*>> files(dst.size());
  for (auto& f : files)
    for (auto& b : file_buffers(cp)) f.push_back(buffers.emplace_back(std::move(b)).get());
  std::vector<nlohmann::json> rows;
  for (int round = 0; round < o.rounds; ++round) {
    const auto r = run_checkpoint_round(lay, st.s, cp, src, dst, files, staging);
    rows.push_back({{"model", o.model}, {"layout", st.s.name}, {"divisor", o.divisor}, {"sources", st.s.src.size()}, {"clones", st.s.dst.size()},
                    {"strategy", "checkpoint_reshard"}, {"round", round}, {"state_bytes", lay.total_bytes()}, {"file_bytes", cp.file_bytes},
                    {"save_s", r.save_s}, {"readiness_s", r.readiness_s}, {"cold_read", r.cold_read}, {"verified", r.verified}, {"loadavg", loadavg()}});
    jl << rows.back().dump() << "\n" << std::flush;
    std::cerr << st.s.name << " checkpoint round " << round << ": save " << r.save_s << " s, readiness " << r.readiness_s << " s, verified "
              << r.verified << "\n";
  }
  for (std::size_t i = 0; i < cp.file_bytes.size(); ++i) std::filesystem::remove(cp.path(i));
  bool verified = true;
  for (const auto& r : rows) verified = verified && r["verified"].get<bool>();
  const auto& f = rows.front();
  return {{"model", f["model"]}, {"layout", f["layout"]}, {"strategy", "checkpoint_reshard"}, {"rounds", rows.size()},
          {"state_bytes", f["state_bytes"]}, {"file_bytes", f["file_bytes"]}, {"save_s", spread(rows, "save_s")},
          {"readiness_s", spread(rows, "readiness_s")}, {"cold_read", f["cold_read"]}, {"verified", verified}};
}

/// The checkpoint peer next to deepclone's raw row of the same layout.
std::string checkpoint_table(const std::vector<nlohmann::json>& peers, const std::vector<nlohmann::json>& summaries) {
  std::ostringstream t;
  t.precision(3);
  t << "| layout | checkpoint: save s (sources stopped) | checkpoint: readiness s (min-max) | MB written per source | read | deepclone raw readiness s | checkpoint / deepclone |\n"
    << "|---|---|---|---|---|---|---|\n";
  for (const auto& p : peers) {
    const auto& r = p["readiness_s"];
    t << "| " << p["layout"].get<std::string>() << " | " << p["save_s"]["median"].get<double>() << " | " << r["median"].get<double>() << " ("
      << r["min"].get<double>() << "-" << r["max"].get<double>() << ") | ";
    for (std::size_t i = 0; i < p["file_bytes"].size(); ++i) t << (i ? ", " : "") << p["file_bytes"][i].get<double>() / 1e6;
    t << " | " << p["cold_read"].get<std::string>() << " | ";
    const auto raw = std::find_if(summaries.begin(), summaries.end(), [&](const nlohmann::json& s) {
      return s["layout"] == p["layout"] && s["link"] == "raw" && s["sharing"] == "none";
    });
    if (raw == summaries.end()) t << "- | - |\n";
    else {
      const double d = (*raw)["readiness_s"]["median"].get<double>();
      t << d << " | " << r["median"].get<double>() / d << "x |\n";
    }
  }
  return t.str();
}

}  // namespace

int main(int argc, char** argv) try {
  const auto o = parse(argc, argv);
  std::filesystem::create_directories(o.out_dir);
  if (o.checkpoint) std::filesystem::create_directories(o.ckpt_dir);
  const auto lay = scaled_model(o.models_dir, o.model, o.divisor);
  std::cerr << o.model << " + Adam, dimension 0 / " << o.divisor << ": " << lay.total_bytes() / 1e6 << " MB of global state, "
            << lay.tensor_count() << " tensors in " << lay.layer_count() << " layers\n";
  std::ofstream jl(o.out_dir + "/partition.jsonl"), sl(o.out_dir + "/partition_summary.jsonl");
  std::vector<nlohmann::json> summaries, peers;
  for (const auto& name : o.layouts) {
    if (name != "zero1" && name != "tp2dp2") throw std::invalid_argument("unknown layout " + name);
    std::optional<setup> st;
    for (const auto& sharing : o.sharing) {
      st.emplace(prepare(lay, name == "zero1" ? zero1(lay) : tp2dp2(lay), sharing));
      for (const auto& link_name : o.links) {
        summaries.push_back(summary(measure(o, lay, *st, link_name, jl)));
        sl << summaries.back().dump() << "\n";
      }
    }
    if (o.checkpoint && st) {
      peers.push_back(measure_checkpoint(o, lay, *st, jl));
      sl << peers.back().dump() << "\n";
    }
  }
  const auto tables = table(summaries) + (peers.empty() ? "" : "\n" + checkpoint_table(peers, summaries));
  std::ofstream(o.out_dir + "/partition_table.md") << tables;
  std::cout << tables;
  for (const auto& s : summaries)
    if (!s["verified"].get<bool>()) return 1;
  for (const auto& s : peers)
    if (!s["verified"].get<bool>()) return 1;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "partition_bench: " << e.what() << "\n";
  return 2;
}
