#pragma once
/// \file mlp.hpp
/// A small but real data-parallel trainer for deepclone's example and tests: a multilayer
/// perceptron with hand-written forward pass, backward pass and SGD with momentum, trained
/// on deterministic synthetic data, its gradients averaged over the ranks of a group with
/// `deepclone::allreduce_sum`.
///
/// The same trainer runs in three roles, because the point of the example is to compare
/// them bit for bit:
///  - as a plain trainer (`no_hooks`): the reference run without any cloning;
///  - as a source: pass a `deepclone::engine<...>::source` (or anything with the same three
///    hooks) to `step`;
///  - as a clone: construct it with `start::empty`, let a `deepclone::engine<...>::clone`
///    fill `state()`, call `resume()`, then `step` over the clone ranks' group.
///
///   mlp::trainer t(cfg);
///   cloning::source src(comm, roles, t.state());
///   for (std::uint64_t s = 0; s < steps; ++s) t.step(comm, roles.sources, src);

#include <deepclone/deepclone.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace mlp {

/// Everything that must be equal on every rank of a run (sources and clones alike).
/// Learning rate and momentum are only the *initial* hyper-parameters: once training
/// starts they live in the state's metadata, so that a clone inherits them with the state
/// and can then change them (the whole point of forking).
struct config {
  /// Layer widths, input first. The default gives 4 dense layers of 2k to 66k parameters.
  std::vector<std::size_t> widths{64, 256, 256, 128, 16};
  std::size_t global_batch = 64;  ///< samples per iteration over the whole group
  std::uint64_t seed = 42;        ///< weight init, data, teacher and augmentation RNG
  double lr = 0.05;
  double momentum = 0.9;
};

/// Hooks for a run without cloning. A deepclone source has the same three members.
struct no_hooks {
  void before_update(std::size_t) noexcept {}
  void after_update(std::size_t) noexcept {}
  void end_iteration(std::uint64_t) noexcept {}
};

/// A non-owning reference to anything with the three source hooks (a deepclone source,
/// `no_hooks`, a wrapper). The trainer takes hooks through it rather than as a template
/// parameter so that its step is compiled once, not once per engine instantiation: the
/// demo instantiates many engines, and compile time matters on small build machines.
class hooks_ref {
 public:
  hooks_ref() : hooks_ref(none_) {}
  template <class H>
    requires(!std::is_same_v<std::remove_cvref_t<H>, hooks_ref>)
  hooks_ref(H& h)  // NOLINT(google-explicit-constructor): passing a source to step() should just work
      : obj_(&h),
        before_([](void* o, std::size_t l) { static_cast<H*>(o)->before_update(l); }),
        after_([](void* o, std::size_t l) { static_cast<H*>(o)->after_update(l); }),
        end_([](void* o, std::uint64_t s) { static_cast<H*>(o)->end_iteration(s); }) {}
  void before_update(std::size_t l) const { before_(obj_, l); }
  void after_update(std::size_t l) const { after_(obj_, l); }
  void end_iteration(std::uint64_t s) const { end_(obj_, s); }

 private:
  static inline no_hooks none_{};
  void* obj_;
  void (*before_)(void*, std::size_t);
  void (*after_)(void*, std::size_t);
  void (*end_)(void*, std::uint64_t);
};

/// A copy of a trainer's whole state (tensors in state order, metadata), for bitwise checks.
struct snapshot {
  std::vector<std::vector<float>> tensors;
  deepclone::metadata meta;
  bool operator==(const snapshot&) const = default;
};

/// First difference between two snapshots, compared as bytes (so -0.0f != 0.0f and a NaN
/// payload counts), or an empty string when they are bitwise equal.
inline std::string first_difference(const snapshot& a, const snapshot& b, const std::vector<std::string>& names = {}) {
  if (a.tensors.size() != b.tensors.size())
    return "tensor count " + std::to_string(a.tensors.size()) + " vs " + std::to_string(b.tensors.size());
  for (std::size_t t = 0; t < a.tensors.size(); ++t) {
    auto& x = a.tensors[t];
    auto& y = b.tensors[t];
    std::string name = t < names.size() ? names[t] : "tensor " + std::to_string(t);
    if (x.size() != y.size()) return name + ": " + std::to_string(x.size()) + " vs " + std::to_string(y.size()) + " elements";
    for (std::size_t i = 0; i < x.size(); ++i)
      if (std::memcmp(&x[i], &y[i], sizeof(float)) != 0)
        return name + "[" + std::to_string(i) + "]: " + std::to_string(x[i]) + " vs " + std::to_string(y[i]);
  }
  auto& m = a.meta;
  auto& n = b.meta;
  if (m.step != n.step) return "metadata step " + std::to_string(m.step) + " vs " + std::to_string(n.step);
  if (m.data_cursor != n.data_cursor)
    return "metadata data_cursor " + std::to_string(m.data_cursor) + " vs " + std::to_string(n.data_cursor);
  if (m.rng != n.rng) return "metadata rng state differs";
  if (m.hyper != n.hyper) return "metadata hyper-parameters differ";
  if (m.user != n.user) return "metadata user bytes differ";
  return {};
}

namespace detail {
/// splitmix64's finaliser: a stateless hash, so sample i of the data stream is the same
/// number on every rank and in every run, whoever computes it and in which order.
inline std::uint64_t mix(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline std::uint64_t hash(std::uint64_t a, std::uint64_t b, std::uint64_t c) noexcept { return mix(mix(mix(a) ^ b) ^ c); }
/// Uniform in [-1, 1) with 24 bits, exact in float.
inline float uniform(std::uint64_t h) noexcept { return static_cast<float>(h >> 40) * 0x1p-23f - 1.0f; }
}  // namespace detail

/// How a trainer's tensors start.
enum class start {
  fresh,  ///< seeded initial weights, zero momentum, metadata of a run that has not begun
  empty,  ///< every element NaN and no metadata: a clone's tensors before deepclone fills them,
          ///< so that a byte deepclone failed to write cannot pass for a correct one
};

class trainer {
 public:
  explicit trainer(const config& c, start how = start::fresh) : cfg_(c) {
    if (c.widths.size() < 2) throw std::invalid_argument("mlp::config: need at least an input and an output width");
    if (c.global_batch == 0) throw std::invalid_argument("mlp::config: global_batch must be positive");
    // Trainer tags are 10 + 2l and 11 + 2l per layer: stay below deepclone's tag_base.
    if (c.widths.size() > 400) throw std::invalid_argument("mlp::config: too many layers for the trainer's tag range");
    const std::size_t L = c.widths.size() - 1;
    // Reserved once: deepclone::state keeps pointers to these vectors.
    layers_.resize(L);
    for (std::size_t l = 0; l < L; ++l) {
      auto& ly = layers_[l];
      ly.in = c.widths[l];
      ly.out = c.widths[l + 1];
      ly.w.assign(ly.in * ly.out, 0.0f);
      ly.b.assign(ly.out, 0.0f);
      ly.vw.assign(ly.w.size(), 0.0f);
      ly.vb.assign(ly.b.size(), 0.0f);
      if (how == start::fresh) {
        // Glorot-uniform from a hash of (seed, layer, index): identical on every replica
        // without a broadcast, which keeps the reference run free of extra messages.
        const float limit = std::sqrt(6.0f / static_cast<float>(ly.in + ly.out));
        for (std::size_t i = 0; i < ly.w.size(); ++i) ly.w[i] = limit * detail::uniform(detail::hash(c.seed, 100 + l, i));
      } else {
        const float nan = std::numeric_limits<float>::quiet_NaN();
        for (auto* v : {&ly.w, &ly.b, &ly.vw, &ly.vb}) std::fill(v->begin(), v->end(), nan);
      }
      // Forward order, momentum slots included: a clone without them would not resume
      // the same optimisation trajectory.
      state_.add_layer("fc" + std::to_string(l), {{"weight", ly.w}, {"bias", ly.b},
                                                  {"weight.momentum", ly.vw}, {"bias.momentum", ly.vb}});
    }
    // The teacher defines the task and is fixed by the seed, like a data set on disk; it is
    // not training state, so it is not part of what deepclone moves.
    const std::size_t in = c.widths.front(), out = c.widths.back();
    teacher_.resize(in * out);
    const float scale = 3.0f / std::sqrt(static_cast<float>(in));
    for (std::size_t i = 0; i < teacher_.size(); ++i) teacher_[i] = scale * detail::uniform(detail::hash(c.seed, 1, i));
    if (how == start::fresh) {
      auto& m = state_.metadata();
      m.step = 0;
      m.data_cursor = 0;
      set_rng(detail::mix(c.seed ^ 0xA5A5A5A5ull));
      m.hyper["lr"] = c.lr;
      m.hyper["momentum"] = c.momentum;
    }
  }
  trainer(const trainer&) = delete;
  trainer& operator=(const trainer&) = delete;

  /// The state deepclone sees: layer l holds fc<l>'s weight, bias and their momentum slots.
  deepclone::state<std::vector<float>>& state() noexcept { return state_; }
  deepclone::metadata& metadata() noexcept { return state_.metadata(); }
  const deepclone::metadata& metadata() const noexcept { return state_.metadata(); }
  std::size_t layer_count() const noexcept { return layers_.size(); }
  const config& cfg() const noexcept { return cfg_; }
  /// The iteration the next `step` runs.
  std::uint64_t next_step() const noexcept { return next_; }

  /// Adopts the metadata a clone received (the state of iteration k): the next step is
  /// k + 1, and cursor, RNG and hyper-parameters are whatever the sources had.
  void resume() {
    if (metadata().rng.size() != sizeof(std::uint64_t) || !metadata().hyper.count("lr") || !metadata().hyper.count("momentum"))
      throw std::runtime_error("mlp::trainer::resume: the metadata is not an mlp trainer's (was the clone completed?)");
    next_ = metadata().step + 1;
  }

  /// One data-parallel iteration over `group` (this rank must be in it; every member calls
  /// step with the same group). Returns the global mean loss of the iteration, before its
  /// update. Gradients are averaged layer by layer in backward order, and each layer is
  /// updated right after its own allreduce, between `hooks.before_update(l)` and
  /// `hooks.after_update(l)`: that is the window deepclone's layer-wise pipeline relies on.
  template <class Comm>
  double step(Comm& comm, std::span<const int> group, hooks_ref hooks = {}) {
    const std::size_t G = group.size(), B = cfg_.global_batch, L = layers_.size();
    std::size_t pos = G;
    for (std::size_t i = 0; i < G; ++i)
      if (group[i] == comm.rank()) pos = i;
    if (pos == G) throw std::invalid_argument("mlp::trainer::step: rank " + std::to_string(comm.rank()) + " is not in the group");
    auto& m = metadata();
    // The global batch is cut by rank index, so which samples a rank sees depends only on
    // (cursor, group size, index), never on timing.
    const std::size_t lo = pos * B / G, hi = (pos + 1) * B / G, n = hi - lo;
    // The RNG is replicated: every rank draws the same augmentation seed each iteration,
    // and a clone continues the very same sequence because the RNG state is metadata.
    std::uint64_t rng = get_rng();
    const std::uint64_t aug = next_random(rng);

    // --- data: sample ids cursor + [lo, hi) of an infinite deterministic stream ---
    const std::size_t in = cfg_.widths.front(), out = cfg_.widths.back();
    acts_.resize(L + 1);
    acts_[0].assign(n * in, 0.0f);
    std::vector<float> target(n * out);
    for (std::size_t s = 0; s < n; ++s) {
      const std::uint64_t id = m.data_cursor + lo + s;
      float* x = &acts_[0][s * in];
      for (std::size_t j = 0; j < in; ++j) x[j] = detail::uniform(detail::hash(cfg_.seed, 2 + id, j));
      for (std::size_t o = 0; o < out; ++o) {
        float z = 0.0f;
        for (std::size_t j = 0; j < in; ++j) z += teacher_[o * in + j] * x[j];
        target[s * out + o] = std::sin(z);
      }
      // Input noise of this iteration's augmentation draw (labels stay clean).
      for (std::size_t j = 0; j < in; ++j) x[j] += 0.05f * detail::uniform(detail::hash(aug, lo + s, j));
    }

    // --- forward: tanh hidden layers, linear output ---
    for (std::size_t l = 0; l < L; ++l) {
      auto& ly = layers_[l];
      acts_[l + 1].assign(n * ly.out, 0.0f);
      for (std::size_t s = 0; s < n; ++s) {
        const float* a = &acts_[l][s * ly.in];
        float* z = &acts_[l + 1][s * ly.out];
        for (std::size_t o = 0; o < ly.out; ++o) {
          float acc = ly.b[o];
          const float* w = &ly.w[o * ly.in];
          for (std::size_t i = 0; i < ly.in; ++i) acc += w[i] * a[i];
          z[o] = l + 1 < L ? std::tanh(acc) : acc;
        }
      }
    }

    // --- loss 0.5 * |y - t|^2 and its gradient (y - t) for the local samples ---
    double loss = 0.0;
    std::vector<float> delta(n * out);
    for (std::size_t i = 0; i < n * out; ++i) {
      const float d = acts_[L][i] - target[i];
      delta[i] = d;
      loss += 0.5 * static_cast<double>(d) * static_cast<double>(d);
    }

    // --- backward, allreduce and update, last layer first ---
    const float inv_b = 1.0f / static_cast<float>(B);
    const float lr = static_cast<float>(m.hyper.at("lr"));
    const float mu = static_cast<float>(m.hyper.at("momentum"));
    std::vector<float> grad, prev;
    for (std::size_t l = L; l-- > 0;) {
      auto& ly = layers_[l];
      // One buffer per layer, [dW | db], summed over local samples in sample order.
      grad.assign(ly.w.size() + ly.b.size(), 0.0f);
      float* gw = grad.data();
      float* gb = grad.data() + ly.w.size();
      for (std::size_t s = 0; s < n; ++s) {
        const float* a = &acts_[l][s * ly.in];
        const float* d = &delta[s * ly.out];
        for (std::size_t o = 0; o < ly.out; ++o) {
          const float dv = d[o];
          float* row = gw + o * ly.in;
          for (std::size_t i = 0; i < ly.in; ++i) row[i] += dv * a[i];
          gb[o] += dv;
        }
      }
      // The error for the layer below needs this layer's weights *before* their update.
      if (l > 0) {
        prev.assign(n * ly.in, 0.0f);
        for (std::size_t s = 0; s < n; ++s) {
          const float* d = &delta[s * ly.out];
          float* p = &prev[s * ly.in];
          for (std::size_t o = 0; o < ly.out; ++o) {
            const float dv = d[o];
            const float* w = &ly.w[o * ly.in];
            for (std::size_t i = 0; i < ly.in; ++i) p[i] += w[i] * dv;
          }
          const float* a = &acts_[l][s * ly.in];  // tanh output of the layer below
          for (std::size_t i = 0; i < ly.in; ++i) p[i] *= 1.0f - a[i] * a[i];
        }
      }
      // allreduce_sum adds in rank order on the group's first rank: bitwise reproducible
      // for a given group size, which is what the fork checks rely on.
      deepclone::allreduce_sum(comm, group, std::span<float>(grad), grad_tag(l));
      hooks.before_update(l);
      for (std::size_t i = 0; i < ly.w.size(); ++i) {
        ly.vw[i] = mu * ly.vw[i] + gw[i] * inv_b;
        ly.w[i] -= lr * ly.vw[i];
      }
      for (std::size_t o = 0; o < ly.out; ++o) {
        ly.vb[o] = mu * ly.vb[o] + gb[o] * inv_b;
        ly.b[o] -= lr * ly.vb[o];
      }
      hooks.after_update(l);
      if (l > 0) delta.swap(prev);
    }

    deepclone::allreduce_sum(comm, group, std::span<double>(&loss, 1), loss_tag);
    // Metadata as of the end of this iteration, written before end_iteration: that hook is
    // where a source captures the metadata of the fork iteration.
    const std::uint64_t step = next_++;
    m.step = step;
    m.data_cursor += B;
    set_rng(rng);
    hooks.end_iteration(step);
    return loss / static_cast<double>(B);
  }

  /// A copy of the whole state, for bitwise comparisons.
  snapshot snap() const {
    snapshot s;
    for (auto& ly : layers_)
      for (auto* v : {&ly.w, &ly.b, &ly.vw, &ly.vb}) s.tensors.push_back(*v);
    s.meta = metadata();
    return s;
  }
  /// Names in state order ("fc0.weight", ...), for messages.
  std::vector<std::string> tensor_names() const {
    std::vector<std::string> out;
    for (std::size_t l = 0; l < layers_.size(); ++l)
      for (auto* t : {"weight", "bias", "weight.momentum", "bias.momentum"}) out.push_back("fc" + std::to_string(l) + "." + t);
    return out;
  }

  static constexpr int loss_tag = 2;  ///< uses 2 and 3
  static constexpr int grad_tag(std::size_t layer) { return 10 + 2 * static_cast<int>(layer); }

 private:
  struct layer {
    std::size_t in = 0, out = 0;
    std::vector<float> w, b, vw, vb;  // w is out x in, row-major
  };

  std::uint64_t get_rng() const {
    std::uint64_t r = 0;
    auto& b = metadata().rng;
    if (b.size() != sizeof r) throw std::runtime_error("mlp::trainer: the metadata holds no RNG state (call resume() on a clone)");
    std::memcpy(&r, b.data(), sizeof r);
    return r;
  }
  void set_rng(std::uint64_t r) {
    auto& b = metadata().rng;
    b.resize(sizeof r);
    std::memcpy(b.data(), &r, sizeof r);
  }
  static std::uint64_t next_random(std::uint64_t& state) noexcept {
    state += 0x9E3779B97F4A7C15ull;
    return detail::mix(state);
  }

  config cfg_;
  std::vector<layer> layers_;
  std::vector<float> teacher_;
  std::vector<std::vector<float>> acts_;
  deepclone::state<std::vector<float>> state_;
  std::uint64_t next_ = 0;
};

}  // namespace mlp
