#pragma once
// Shared by the partitioned engine's tests (in-process and under mpirun): a source's trainer
// that rewrites every layer it holds each iteration (last layer first) with values that
// name the iteration, the sources' own allreduce that carries the fork word, and the check
// that a clone rank holds the sources' bytes of iteration k.
#include <deepclone/collectives.hpp>
#include <deepclone/metadata.hpp>
#include <deepclone/roles.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "scenarios.hpp"

namespace partition_test {

namespace dc = deepclone;

inline constexpr int trainer_tag = 50;  // the trainer's own allreduce, below the engine's tags

/// The value of global byte `g` of tensor `t` after iteration `it`'s update.
inline std::byte value(std::uint64_t t, std::uint64_t g, std::uint64_t it) { return std::byte(static_cast<std::uint8_t>(g * 31 + t * 7 + 1 + it * 13)); }

/// Source `r`'s metadata at the end of iteration `it` (its step is the engine's to set).
inline dc::metadata metadata_of(std::uint64_t it, std::uint32_t r) {
  dc::metadata m;
  m.data_cursor = it * 1000 + r;
  for (int i = 0; i < 8; ++i) m.rng.push_back(std::byte(static_cast<std::uint8_t>(it >> (8 * i))));
  m.hyper["lr"] = 1.0 / static_cast<double>(it + 1);
  m.user.assign(3, std::byte(static_cast<std::uint8_t>(r)));
  return m;
}

/// The metadata a clone rank receives with fork iteration `k`: source 0's, its step k.
inline dc::metadata fork_metadata(std::uint64_t k) {
  auto m = metadata_of(k, 0);
  m.step = k;
  return m;
}

/// Where the collective sits in the sources' iteration.
enum class collective_at { boundary, after_first_update, none };

/// One source rank's trainer: its own parts, rewritten per layer each iteration.
class trainer {
 public:
  trainer(const scenario& s, std::uint32_t r) : s_(s), rank_(r), own_(own_tensors(s.lay, s.src[r], false)) {
    for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) maps_.push_back(brute_map(s.lay.tensor(t), s.src[r].of_tensor[t]));
  }
  std::uint32_t rank() const { return rank_; }
  std::vector<std::vector<std::byte>>& own() { return own_; }
  std::vector<std::span<const std::byte>> parts() {
    std::vector<std::span<const std::byte>> p;
    for (auto& t : own_) p.emplace_back(t.data(), t.size());
    return p;
  }
  /// Layer `l`'s update of iteration `it`; false where this rank holds none of it (another stage).
  bool holds(std::size_t l) const {
    for (auto t = s_.lay.first_tensor(l); t < s_.lay.end_tensor(l); ++t)
      if (!maps_[t].empty()) return true;
    return false;
  }
  void update(std::size_t l, std::uint64_t it) {
    for (auto t = s_.lay.first_tensor(l); t < s_.lay.end_tensor(l); ++t)
      for (const auto& [g, local] : maps_[t]) own_[t][local] = value(t, g, it);
  }

 private:
  const scenario& s_;
  std::uint32_t rank_;  // the source index
  std::vector<std::vector<std::byte>> own_;
  std::vector<byte_map> maps_;
};

/// The sources' own allreduce of [fork word, stop], as a trainer runs one.
template <class Comm>
std::pair<std::uint64_t, std::uint64_t> trainer_allreduce(Comm& c, const dc::roles& r, std::uint64_t w, std::uint64_t done) {
  std::uint64_t v[2] = {w, done};
  dc::allreduce_sum(c, std::span<const int>(r.sources), std::span<std::uint64_t>(v, 2), trainer_tag);
  return {v[0], v[1]};
}

/// Trains, with the engine's hooks, until `finished()` on some source (or 60 s), the
/// decision to stop taken in the sources' allreduce so that all stop after the same
/// iteration. `at`: where the trainer's collective carries the fork word.
template <class Engine, class Comm, class Finished>
void train(Comm& c, const scenario& s, const dc::roles& r, typename Engine::source& src, trainer& me, Finished finished, collective_at at) {
  constexpr bool collective = Engine::agreement_type::trainer_collective;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (std::uint64_t it = 0;; ++it) {
    for (std::size_t l = s.lay.layer_count(); l-- > 0;) {
      if (me.holds(l)) {
        src.before_update(l);
        me.update(l, it);
        src.after_update(l);
      }
      if constexpr (collective)
        if (at == collective_at::after_first_update && l + 1 == s.lay.layer_count())
          src.fork_agreed(trainer_allreduce(c, r, src.fork_word(), 0).first);
    }
    src.end_iteration(it, metadata_of(it, me.rank()));
    std::uint64_t word = 0;
    if constexpr (collective)
      if (at == collective_at::boundary) word = src.fork_word();
    const auto [sum, stop] = trainer_allreduce(c, r, word, std::uint64_t(finished() || std::chrono::steady_clock::now() > deadline));
    if constexpr (collective)
      if (at == collective_at::boundary) src.fork_agreed(sum);
    if (stop) return;
  }
}

/// Whether every byte clone rank `j` wants holds the sources' value of iteration `k`.
inline bool exact(const scenario& s, std::size_t j, const std::vector<std::vector<std::byte>>& own, std::uint64_t k) {
  for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t)
    for (const auto& [g, local] : brute_map(s.lay.tensor(t), s.dst[j].of_tensor[t]))
      if (own[t][local] != value(t, g, k)) return false;
  return true;
}

}  // namespace partition_test
