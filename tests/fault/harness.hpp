#pragma once
// A fork of N in-process sources into M clone ranks where every engine message goes
// through deepclone::faulty<inproc::communicator> sharing one fault::plan. The sources'
// own "training" collectives (an allreduce per iteration, as a gradient allreduce would
// be) use the raw communicator, so faults hit deepclone's traffic only.
//
// What is checked on every run, whatever the faults:
//  - a layer that wait_layer() reports ready holds exactly the bytes of iteration k (checked
//    at that moment), and so does the whole state when wait() returns;
//  - a clone that fails throws deepclone::error (never anything else) within the bound;
//  - the sources never throw from a hook and all run to the end of their loop.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>
#include <deepclone/fault_injection.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dc = deepclone;
using namespace std::chrono_literals;

namespace faultharness {

using fcomm = dc::faulty<dc::inproc::communicator>;
using cloning = dc::engine<fcomm>;  // split_even / window / scatter_exchange / mix64

struct tspec {
  std::string name;
  std::size_t bytes;
};
struct lspec {
  std::string name;
  std::vector<tspec> tensors;
};
using spec = std::vector<lspec>;

/// Three layers: small (eager) tensors, two large split tensors, a tail with a zero-byte
/// tensor. Sizes are not multiples of N, the alignment or 8.
inline spec base_spec() {
  return {{"fc0", {{"weight", 1200}, {"bias", 40}}},
          {"fc1", {{"weight", 200003}, {"weight.momentum", 200003}}},
          {"head", {{"weight", 28}, {"bias", 5}, {"empty", 0}}}};
}

inline std::uint8_t value(std::uint64_t step, std::size_t flat, std::size_t i) {
  return static_cast<std::uint8_t>((step * 31 + flat * 7 + i * 13 + (i >> 8)) % 251);
}

struct model {
  std::deque<std::vector<std::uint8_t>> tensors;  // stable addresses
  std::vector<std::size_t> first_flat;            // per layer
  dc::state<std::vector<std::uint8_t>> st;
  model(const spec& s, std::uint8_t fill) {
    for (auto& l : s) {
      first_flat.push_back(tensors.size());
      std::vector<dc::named<std::vector<std::uint8_t>>> named;
      for (auto& t : l.tensors) {
        tensors.emplace_back(t.bytes, fill);
        named.emplace_back(t.name, tensors.back());
      }
      st.add_layer(l.name, std::move(named));
    }
  }
  model(const model&) = delete;
  void update(std::size_t layer, std::uint64_t step) {
    auto& ts = st.layer_tensors(layer);
    for (std::size_t t = 0; t < ts.size(); ++t) {
      auto& d = *ts[t].ref;
      for (std::size_t i = 0; i < d.size(); ++i) d[i] = value(step, first_flat[layer] + t, i);
    }
  }
  bool layer_equals(std::size_t layer, std::uint64_t step) {
    auto& ts = st.layer_tensors(layer);
    for (std::size_t t = 0; t < ts.size(); ++t) {
      auto& d = *ts[t].ref;
      for (std::size_t i = 0; i < d.size(); ++i)
        if (d[i] != value(step, first_flat[layer] + t, i)) return false;
    }
    return true;
  }
  bool equals(std::uint64_t step) {
    for (std::size_t l = 0; l < st.layer_count(); ++l)
      if (!layer_equals(l, step)) return false;
    return true;
  }
};

inline cloning::settings small_settings(std::chrono::nanoseconds timeout = 1s) {
  cloning::settings s;
  s.timeout = timeout;
  s.shard.threshold = 64 * 1024;
  s.reconstruct.threshold = 16 * 1024;
  s.plan.max_piece_bytes = 64 * 1024;
  return s;
}

struct clone_result {
  std::optional<dc::errc> code;
  std::string what;
  bool completed = false;       ///< wait() returned
  bool bytes_ok = false;        ///< ... with the state of iteration k, metadata included
  int wrong_ready_layers = 0;   ///< layers reported ready holding other bytes: must stay 0
  std::optional<dc::errc> report_code;  ///< report() after completion
  std::string report_what;
  std::vector<dc::errc> failed_attempts;
  bool other_exception = false;
  double seconds = 0;
  std::optional<std::uint64_t> k;
};

struct run_result {
  std::vector<clone_result> clones;
  std::vector<std::uint64_t> source_steps, completed, failed;
  std::vector<std::string> source_exception;
  bool sources_stopped_on_signal = true;
  std::array<std::uint64_t, dc::fault::kind_count> injected{};
  double seconds = 0;
};

struct options {
  int n = 2, m = 2;
  spec source_spec = base_spec();
  std::function<spec(int)> clone_spec;  ///< default: the sources'
  cloning::settings settings = small_settings();
  std::size_t user_meta_bytes = 100;
  std::chrono::milliseconds source_start_delay{0};  ///< sources begin training this late
  std::chrono::milliseconds clone_start_delay{0};
  bool want_report = true;
  /// Runs on clone rank j's thread after request() (e.g. a second request: busy).
  std::function<void(int j, cloning::clone<std::vector<std::uint8_t>>&)> after_request;
  /// Runs on each source's thread before it starts (e.g. inject a stale message).
  std::function<void(int i, fcomm&)> before_sources;
  int attempts = 1;  ///< a clone rank that fails requests again, up to this many times in all
  std::chrono::milliseconds retry_pause{0};
  int extra_steps = 3;  ///< the sources train on this long after every clone finished
  std::chrono::seconds deadline{20};
};

inline run_result run(const options& o, std::shared_ptr<dc::fault::plan> faults) {
  run_result out;
  const int n = o.n, m = o.m;
  out.clones.resize(static_cast<std::size_t>(m));
  out.source_steps.resize(static_cast<std::size_t>(n));
  out.completed.resize(static_cast<std::size_t>(n));
  out.failed.resize(static_cast<std::size_t>(n));
  out.source_exception.resize(static_cast<std::size_t>(n));
  const auto roles = dc::roles::contiguous(n, m);
  std::atomic<int> clones_done{0};
  std::atomic<bool> hit_deadline{false};
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline = t0 + o.deadline;
  dc::inproc::world w(n + m);
  w.run([&](dc::inproc::communicator& raw) {
    fcomm comm(raw, faults);
    const int rank = raw.rank();
    if (rank < n) {
      const auto i = static_cast<std::size_t>(rank);
      // A hook that throws is recorded (a failure of the test) and training goes on, so
      // that the other sources are not left waiting in the allreduce.
      auto guard = [&](auto&& f) {
        try {
          f();
        } catch (const std::exception& e) {
          if (out.source_exception[i].empty()) out.source_exception[i] = e.what();
        }
      };
      std::this_thread::sleep_for(o.source_start_delay);
      model mdl(o.source_spec, 0);
      if (o.before_sources) o.before_sources(rank, comm);
      std::optional<cloning::source<std::vector<std::uint8_t>>> src;
      guard([&] { src.emplace(comm, roles, mdl.st, o.settings); });
      const std::size_t L = mdl.st.layer_count();
      int after = -1;
      for (std::uint64_t step = 0;; ++step) {
        for (std::size_t l = L; l-- > 0;) {  // backward order, as an optimizer does
          if (src) guard([&] { src->before_update(l); });
          mdl.update(l, step);
          if (src) guard([&] { src->after_update(l); });
        }
        auto& md = mdl.st.metadata();
        md.data_cursor = step * 10;
        md.user.assign(o.user_meta_bytes, std::byte(step & 0xff));
        int stop[2] = {clones_done.load() == m ? 1 : 0, std::chrono::steady_clock::now() > deadline ? 1 : 0};
        dc::allreduce_sum(raw, roles.sources, std::span<int>(stop), 10);
        if (src) guard([&] { src->end_iteration(step); });
        if (stop[1]) {
          hit_deadline = true;
          out.source_steps[i] = step + 1;
          break;
        }
        if (stop[0] && after < 0) after = o.extra_steps;
        if (after >= 0 && after-- == 0) {
          out.source_steps[i] = step + 1;
          break;
        }
      }
      if (src) {
        guard([&] { src->finish(); });
        out.completed[i] = src->sessions_completed();
        out.failed[i] = src->sessions_failed();
      }
    } else {
      const int j = rank - n;
      auto& res = out.clones[static_cast<std::size_t>(j)];
      std::this_thread::sleep_for(o.clone_start_delay);
      model mdl(o.clone_spec ? o.clone_spec(j) : o.source_spec, 0xA5);
      const auto c0 = std::chrono::steady_clock::now();
      try {
        cloning::clone dst(comm, roles, mdl.st, o.settings);
        for (int attempt = 1; attempt <= o.attempts; ++attempt) try {
          res.code.reset();
          res.what.clear();
          dst.request();
          if (o.after_request) o.after_request(j, dst);
          for (std::size_t l = 0; l < mdl.st.layer_count(); ++l) {
            dst.wait_layer(l);
            res.k = dst.fork_iteration();
            if (!res.k || !mdl.layer_equals(l, *res.k)) ++res.wrong_ready_layers;
          }
          dst.wait();
          res.completed = true;
          const auto k = dst.metadata().step;
          res.k = k;
          res.bytes_ok = mdl.equals(k) && dst.metadata().data_cursor == k * 10 &&
                         dst.metadata().user == std::vector<std::byte>(o.user_meta_bytes, std::byte(k & 0xff));
          break;
        } catch (const dc::error& e) {
          res.code = e.kind();
          res.what = e.what();
          res.failed_attempts.push_back(e.kind());
          std::this_thread::sleep_for(o.retry_pause);
        }
        res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
        ++clones_done;
        if (res.completed && o.want_report) {
          try {
            (void)dst.report();
          } catch (const dc::error& e) {
            res.report_code = e.kind();
            res.report_what = e.what();
          }
        }
      } catch (const std::exception& e) {
        res.other_exception = true;
        res.what = e.what();
        ++clones_done;
      }
    }
  });
  out.sources_stopped_on_signal = !hit_deadline.load();
  out.injected = faults->injected();
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

using dc::errc_name;  // the library's stable names

/// One clone rank's outcome as a word for the table.
inline std::string outcome_of(const clone_result& c) {
  if (c.other_exception) return "OTHER-EXCEPTION";
  if (c.wrong_ready_layers) return "WRONG-READY";
  if (c.completed) {
    if (!c.bytes_ok) return "WRONG-BYTES";
    return c.report_code ? std::string("completed(report:") + errc_name(*c.report_code) + ")" : "completed";
  }
  if (c.code) return errc_name(*c.code);
  return "?";
}

/// Outcomes per fault kind, printed at exit (the table of docs/reliability.md).
struct table {
  std::mutex mu;
  std::map<std::string, std::map<std::string, int>> rows;  // kind -> outcome -> clone ranks
  std::map<std::string, std::uint64_t> injected;           // kind -> faults injected
  std::map<std::string, int> runs;
  static table& get() {
    static table t;
    return t;
  }
  void add(const std::string& kind, const run_result& r) {
    std::lock_guard g(mu);
    ++runs[kind];
    for (auto& c : r.clones) ++rows[kind][outcome_of(c)];
    for (int k = 0; k < dc::fault::kind_count; ++k)
      injected[dc::fault::kind_name(static_cast<dc::fault::kind>(k))] += r.injected[static_cast<std::size_t>(k)];
  }
  ~table() {
    if (rows.empty()) return;
    std::printf("\n=== deepclone fault-injection outcomes (clone ranks per outcome) ===\n");
    std::printf("%-22s %5s  %s\n", "scenario", "runs", "outcomes");
    for (auto& [k, row] : rows) {
      std::string s;
      for (auto& [o, c] : row) s += (s.empty() ? "" : ", ") + o + " x" + std::to_string(c);
      std::printf("%-22s %5d  %s\n", k.c_str(), runs[k], s.c_str());
    }
    std::printf("faults injected by kind:");
    for (auto& [k, c] : injected) std::printf(" %s=%llu", k.c_str(), static_cast<unsigned long long>(c));
    std::printf("\n");
  }
};

/// The invariants every run must keep (see the top of this file).
inline void check_invariants(const run_result& r) {
  for (std::size_t j = 0; j < r.clones.size(); ++j) {
    auto& c = r.clones[j];
    INFO("clone " << j << ": " << outcome_of(c) << " " << c.what);
    CHECK(c.wrong_ready_layers == 0);
    CHECK_FALSE(c.other_exception);
    if (c.completed) CHECK(c.bytes_ok);
    else CHECK(c.code.has_value());
  }
  for (std::size_t i = 0; i < r.source_steps.size(); ++i) {
    INFO("source " << i << ": " << r.source_exception[i]);
    CHECK(r.source_exception[i] == "");
    CHECK(r.source_steps[i] == r.source_steps[0]);  // every source ran to the end of the loop
    CHECK(r.source_steps[i] > 0);
  }
  CHECK(r.sources_stopped_on_signal);
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace faultharness
