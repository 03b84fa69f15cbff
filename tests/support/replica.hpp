#pragma once
// A replica of a training state for the engine tests (unit.clone, unit.agreement): raw byte
// tensors with varied dtypes and sizes whose every byte is a function of (iteration,
// tensor, position), so any stale or misplaced byte of a clone is caught.
#include <deepclone/deepclone.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace deepclone::testing {

namespace dc = deepclone;

std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

/// A replica of a training state made of raw byte tensors with varied dtypes and sizes:
/// a split-size weight, odd sizes, a zero-byte tensor, an optimizer slot per weight.
struct replica {
  std::vector<std::vector<float>> f32;
  std::vector<std::vector<double>> f64;
  std::vector<std::vector<std::uint8_t>> u8;
  dc::state<dc::raw_view<std::uint8_t>> state;
  std::vector<dc::raw_view<std::uint8_t>> views;

  replica() {
    f32 = {std::vector<float>(70000), std::vector<float>(70000), std::vector<float>(1001), std::vector<float>(1001),
           std::vector<float>(7), std::vector<float>(0), std::vector<float>(33333), std::vector<float>(33333)};
    f64 = {std::vector<double>(5000), std::vector<double>(3)};
    u8 = {std::vector<std::uint8_t>(12345)};
    auto view = [&](auto& v) {
      views.emplace_back(reinterpret_cast<std::uint8_t*>(v.data()), v.size() * sizeof(v[0]));
    };
    views.reserve(16);
    for (auto& v : f32) view(v);
    for (auto& v : f64) view(v);
    for (auto& v : u8) view(v);
    auto& w = views;
    state.add_layer("embed", {{"weight", w[0]}, {"weight.momentum", w[1]}});
    state.add_layer("fc1", {{"weight", w[2]}, {"weight.momentum", w[3]}, {"bias", w[4]}, {"empty", w[5]}});
    state.add_layer("norm", {{"running_mean", w[8]}, {"num_batches", w[9]}});
    state.add_layer("frozen", {{"table", w[10]}});
    state.add_layer("head", {{"weight", w[6]}, {"weight.momentum", w[7]}});
  }

  /// The "update" of layer l in iteration `step`: every byte becomes a function of
  /// (step, tensor, position), so any stale or misplaced byte is caught.
  void update(std::size_t l, std::uint64_t step) {
    for (auto& t : state.layer_tensors(l)) {
      auto b = dc::tensor_bytes(*t.ref);
      std::uint64_t salt = mix(std::hash<std::string>{}(t.name) ^ (l << 40) ^ (step * 0x9E3779B97F4A7C15ull));
      for (std::size_t i = 0; i < b.size(); i += 8) {
        const std::uint64_t word = mix(salt + i / 8);
        std::memcpy(b.data() + i, &word, std::min<std::size_t>(8, b.size() - i));
      }
    }
  }
  /// Trains one iteration the way a trainer does: layers in backward order. Layer 3 is
  /// frozen after step 2 (not updated), so its bytes at k come from an earlier iteration.
  template <class Src>
  void iterate(Src* src, std::uint64_t step) {
    for (std::size_t l = state.layer_count(); l-- > 0;) {
      if (l == 3 && step > 2) continue;
      if (src) src->before_update(l);
      update(l, step);
      if (src) src->after_update(l);
    }
    iterate_metadata(step);
  }
  void iterate_metadata(std::uint64_t step) {
    auto& m = state.metadata();
    m.data_cursor = step * 7 + 3;
    m.rng.assign(16, std::byte(step & 0xff));
    m.hyper["lr"] = 0.1 / static_cast<double>(step + 1);
    m.user.assign(100, std::byte(0x5a));
  }
  /// The state after iteration k, computed directly: every update overwrites a layer, so
  /// each layer holds the bytes of the last iteration <= k that updated it.
  void become(std::uint64_t k) {
    for (std::size_t l = 0; l < state.layer_count(); ++l) update(l, l == 3 ? std::min<std::uint64_t>(k, 2) : k);
    iterate_metadata(k);
  }
  std::vector<std::byte> bytes() {
    std::vector<std::byte> out;
    for (std::size_t t = 0; t < 11; ++t) {
      auto b = dc::tensor_bytes(views[t]);
      out.insert(out.end(), b.begin(), b.end());
    }
    return out;
  }
};

struct small_settings {
  template <class S>
  static S make() {
    S s;
    s.timeout = std::chrono::seconds(30);
    s.plan.max_piece_bytes = 96 * 1024;  // cut big pieces: exercises several messages per tensor
    if constexpr (requires { s.shard.threshold; }) s.shard.threshold = 64 * 1024;
    if constexpr (requires { s.reconstruct.threshold; }) s.reconstruct.threshold = 16 * 1024;
    if constexpr (requires { s.pipeline.staging_bytes; }) s.pipeline.staging_bytes = 200 * 1024;  // ring wraps
    return s;
  }
};

}  // namespace deepclone::testing
