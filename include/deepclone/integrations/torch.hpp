#pragma once
/// \file integrations/torch.hpp
/// LibTorch: `at::Tensor` (= `torch::Tensor`) as a deepclone tensor, and
/// `deepclone::libtorch::module_state`, which turns a `torch::nn::Module` and its optimizer
/// (SGD with or without momentum, Adam, AdamW) into a deepclone state and updates it layer
/// by layer between the source hooks. Including this header is the opt-in; link the CMake
/// target `deepclone::torch`. Written against LibTorch's public C++ API; tested with
/// LibTorch 1.13.1 (Debian 12's libtorch-dev, CPU).
///
///   Net net;                                                    // any torch::nn::Module
///   torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
///   deepclone::libtorch::module_state ms(*net, opt);            // creates Adam's state now
///   cloning::source src(comm, roles, ms.state());
///   for (std::uint64_t step = 0; step < steps; ++step) {
///     opt.zero_grad(); loss(net->forward(x), y).backward(); allreduce_gradients();
///     ms.update_all(src);                 // per layer, last first: before_update, step, after_update
///     ms.state().metadata().step = step;  // and the data cursor, RNG, hyper-parameters
///     src.end_iteration(step);
///   }
///   // A clone: the same module and optimizer types, then
///   cloning::clone dst(comm, roles, ms.state()); dst.request(); dst.wait();
///   ms.restore();                         // buffers and step counters back into net and opt
///
/// What a layer holds (tensor names are the module's own, e.g. "features.0.weight"):
///  - every parameter of the layer's modules;
///  - the optimizer's slots of each parameter: "<p>.momentum_buffer" (SGD with momentum),
///    "<p>.exp_avg", "<p>.exp_avg_sq", "<p>.max_exp_avg_sq" (amsgrad) and "<p>.step"
///    (Adam, AdamW: LibTorch keeps the step counter as an `int64_t` in each parameter's
///    state, not as a tensor, so `module_state` mirrors it in a one-element int64 tensor);
///  - every buffer of the layer's modules (BatchNorm's running_mean, running_var,
///    num_batches_tracked), as a *mirror* tensor by default (see "Buffers" below).
///
/// Lazy optimizer state. LibTorch creates an optimizer's per-parameter state at the first
/// `step()`, so a source that has stepped and a clone that has not would have different
/// layouts. `module_state` creates every missing state up front, as the optimizer would:
/// Adam/AdamW exactly (step 0, zero moments), SGD's momentum buffer as zeros. LibTorch's
/// SGD instead sets the buffer to the first gradient; with zeros the first step computes
/// momentum·0 + (1 − dampening)·g, which is g bit for bit (up to the sign of a zero) for
/// the default dampening 0, and (1 − dampening)·g otherwise.
///
/// Buffers written in the forward pass. deepclone's rule for every registered tensor:
/// only the code between a layer's `before_update(l)` and `after_update(l)` may write it
/// (the window pipeline sends straight from the live bytes until the next
/// `before_update(l)`). BatchNorm breaks it: a training-mode forward pass writes its
/// running statistics. So by default a buffer is registered as a mirror that only
/// `update(l)` writes, between the hooks, by copying the live buffer into it; `restore()`
/// on a clone copies the mirrors back. The mirror of iteration k therefore holds the
/// running statistics as of the end of iteration k, which is what the clone must get.
/// `options::mirror_buffers = false` registers the live buffers instead: only for models
/// whose buffers are not written outside `update` (e.g. BatchNorm in eval mode).
///
/// Replicas must be equal. Data-parallel ranks see different samples, so their BatchNorm
/// statistics differ unless the trainer makes them equal (average them over the ranks, or
/// broadcast one rank's, as PyTorch's DDP does with `broadcast_buffers`): do it before
/// `update`, on the live buffers. `examples/torch_fork.cpp` averages them.

#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "../state.hpp"
#include "../tensor.hpp"

namespace deepclone {

namespace libtorch {

/// The deepclone dtype of a LibTorch scalar type; `errc::unsupported` for the types
/// deepclone cannot describe (quantized, complex32, ...).
inline dtype to_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Bool: return dtype::boolean;
    case c10::ScalarType::Byte: return dtype::u8;
    case c10::ScalarType::Char: return dtype::i8;
    case c10::ScalarType::Short: return dtype::i16;
    case c10::ScalarType::Int: return dtype::i32;
    case c10::ScalarType::Long: return dtype::i64;
    case c10::ScalarType::Half: return dtype::f16;
    case c10::ScalarType::BFloat16: return dtype::bf16;
    case c10::ScalarType::Float: return dtype::f32;
    case c10::ScalarType::Double: return dtype::f64;
    case c10::ScalarType::ComplexFloat: return dtype::c64;
    case c10::ScalarType::ComplexDouble: return dtype::c128;
    default:
      throw error(errc::unsupported, std::string("at::Tensor of scalar type ") + c10::toString(t) +
                                         " has no deepclone dtype (supported: bool, uint8, int8, int16, int32, "
                                         "int64, float16, bfloat16, float32, float64, complex64, complex128)");
  }
}

/// Throws a `deepclone::error` naming `what` (a tensor name, or "at::Tensor") unless `t`
/// is a tensor whose bytes deepclone can read and write in place: defined, strided
/// (not sparse or MKL-DNN), contiguous, not lazily conjugated or negated, on the CPU or a
/// CUDA device, with storage.
inline void check_tensor(const at::Tensor& t, const std::string& what = "at::Tensor") {
  if (!t.defined()) throw error(errc::invalid_argument, what + " is undefined (a default-constructed at::Tensor)");
  if (t.layout() != c10::kStrided) {
    std::ostringstream s;
    s << what << " is not a strided tensor (layout " << t.layout()
      << "): sparse and MKL-DNN tensors have no contiguous bytes; convert with .to_dense() and register the result";
    throw error(errc::invalid_argument, s.str());
  }
  if (t.is_conj())
    throw error(errc::invalid_argument, what + " is lazily conjugated (.conj() sets a bit, the bytes are not "
                                               "conjugated): register t.resolve_conj()");
  if (t.is_neg())
    throw error(errc::invalid_argument, what + " is lazily negated (a view with the negative bit): register t.resolve_neg()");
  if (!t.is_contiguous()) {
    std::ostringstream s;
    s << what << " is not contiguous (sizes " << t.sizes() << ", strides " << t.strides()
      << "): register t.contiguous(), held at a stable address, and update that tensor in place";
    throw error(errc::invalid_argument, s.str());
  }
  if (!(t.device().is_cpu() || t.device().is_cuda()))
    throw error(errc::unsupported, what + " lives on " + t.device().str() + ": deepclone moves CPU and CUDA memory only");
  if (t.numel() > 0 && t.data_ptr() == nullptr) throw error(errc::invalid_argument, what + " has no storage");
}

}  // namespace libtorch

/// `at::Tensor` (and so `torch::Tensor`) is a deepclone tensor. It is a handle: deepclone
/// keeps a pointer to the handle object, so keep it at a stable address (module_state does)
/// and update the tensor in place (`add_`, `copy_`, the optimizers' steps), never by
/// assigning a new tensor to the handle. Every accessor checks the tensor
/// (`libtorch::check_tensor`) and throws a `deepclone::error` that says what is wrong.
template <>
struct tensor_traits<at::Tensor> {
  static std::byte* data(at::Tensor& t) {
    libtorch::check_tensor(t);
    return static_cast<std::byte*>(t.data_ptr());
  }
  static std::size_t size_bytes(const at::Tensor& t) {
    libtorch::check_tensor(t);
    return static_cast<std::size_t>(t.numel()) * t.element_size();
  }
  static dtype element_type(const at::Tensor& t) {
    libtorch::check_tensor(t);
    return libtorch::to_dtype(t.scalar_type());
  }
  static std::vector<std::int64_t> shape(const at::Tensor& t) {
    auto s = t.sizes();
    return {s.begin(), s.end()};
  }
  static memory_space space(const at::Tensor& t) {
    libtorch::check_tensor(t);
    return t.device().is_cuda() ? memory_space::device : memory_space::host;
  }
};

namespace libtorch {

/// Hooks that do nothing: `update_all(no_hooks{})` on a rank that is not a source (a
/// clone after its fork, a plain run).
struct no_hooks {
  void before_update(std::size_t) noexcept {}
  void after_update(std::size_t) noexcept {}
};

/// One layer given by the user: a name and the module paths (as `named_modules()` names
/// them, e.g. "features.0"; "" is the root module's own parameters) whose parameters and
/// buffers it holds. Submodules of a listed module are not included unless listed.
struct layer_group {
  std::string name;
  std::vector<std::string> modules;
};

struct options {
  /// Empty: one layer per module that directly holds parameters or buffers, in
  /// registration order (which must be the forward order; group them yourself if not).
  std::vector<layer_group> groups;
  /// Register buffers as mirrors written only in `update` (see the file comment).
  bool mirror_buffers = true;
  /// The layer name of the root module's own parameters and buffers.
  std::string root_name = "root";
};

/// A `torch::nn::Module` and its optimizer as a deepclone state, layer by layer, with the
/// per-layer update the source hooks wrap. Holds a reference to the optimizer and handles
/// to the module's tensors: keep both alive, and add no parameters to either afterwards.
/// Not copyable (the state points into it).
class module_state {
 public:
  module_state(torch::nn::Module& model, torch::optim::Optimizer& opt, options o = {}) : opt_(opt) {
    opt_kind_ = optimizer_kind(opt);
    auto groups = o.groups.empty() ? default_groups(model, o.root_name) : o.groups;
    if (groups.empty()) throw error(errc::invalid_argument, "libtorch::module_state: the module has no parameters or buffers");

    // Every module path, with the module itself (the root as "").
    std::map<std::string, torch::nn::Module*> by_path{{"", &model}};
    for (auto& item : model.named_modules("", /*include_self=*/false)) by_path[item.key()] = item.value().get();

    // Which optimizer parameter group holds each parameter (by TensorImpl).
    std::map<const void*, std::size_t> group_of;
    auto& pgs = opt.param_groups();
    for (std::size_t g = 0; g < pgs.size(); ++g)
      for (auto& p : pgs[g].params()) group_of[p.unsafeGetTensorImpl()] = g;

    std::map<const void*, bool> seen;
    for (auto& lg : groups) {
      layer ly;
      ly.name = lg.name;
      for (auto& path : lg.modules) {
        auto it = by_path.find(path);
        if (it == by_path.end())
          throw error(errc::invalid_argument, "libtorch::module_state: layer '" + lg.name + "' names module '" + path +
                                                  "', which the model does not have");
        const std::string prefix = path.empty() ? "" : path + ".";
        add_parameters(*it->second, prefix, group_of, seen, ly);
        add_buffers(*it->second, prefix, o.mirror_buffers, ly);
      }
      std::vector<named<at::Tensor>> tensors;
      for (auto& t : ly.tensors) tensors.emplace_back(t.first, *t.second);
      state_.add_layer(ly.name, std::move(tensors));
      layers_.push_back(std::move(ly));
    }
    for (auto& [impl, g] : group_of)
      if (!seen[impl])
        throw error(errc::invalid_argument, "libtorch::module_state: optimizer parameter group " + std::to_string(g) +
                                                " holds a tensor that is no parameter of the layers given");
    for (std::size_t i = 0; i < params_.size(); ++i) index_[params_[i].tensor.unsafeGetTensorImpl()] = i;
  }
  module_state(const module_state&) = delete;
  module_state& operator=(const module_state&) = delete;

  /// The deepclone state: give it to the source or clone engine.
  deepclone::state<at::Tensor>& state() noexcept { return state_; }
  std::size_t layer_count() const noexcept { return layers_.size(); }
  const std::string& layer_name(std::size_t l) const { return layers_.at(l).name; }
  /// The parameters of layer `l` the optimizer updates (e.g. to all-reduce their gradients).
  std::vector<at::Tensor> parameters(std::size_t l) const {
    std::vector<at::Tensor> out;
    for (auto i : layers_.at(l).params) out.push_back(params_[i].tensor);
    return out;
  }
  /// The live buffers of layer `l` (what the forward pass writes), e.g. to average them
  /// over the data-parallel ranks before `update`.
  std::vector<at::Tensor> live_buffers(std::size_t l) const {
    std::vector<at::Tensor> out;
    for (auto& m : layers_.at(l).mirrors) out.push_back(m.live);
    return out;
  }

  /// Updates layer `l` between the hooks: `hooks.before_update(l)`, the optimizer's step
  /// for this layer's parameters only, the mirrors of its buffers and step counters,
  /// `hooks.after_update(l)`. Calling it for every layer once per iteration gives bit for
  /// bit the parameters and optimizer state of one `optimizer.step()` (each parameter's
  /// update depends only on its own gradient and state).
  template <class Hooks>
  void update(std::size_t l, Hooks&& hooks) {
    auto& ly = layers_.at(l);
    hooks.before_update(l);
    step_only(ly);
    {
      torch::NoGradGuard no_grad;
      for (auto& m : ly.mirrors) m.mirror->copy_(m.live);
    }
    for (auto i : ly.params) write_step(params_[i]);
    hooks.after_update(l);
  }
  /// `update(l)` for every layer, last layer first (the order backpropagation finishes them).
  template <class Hooks>
  void update_all(Hooks&& hooks) {
    for (std::size_t l = layers_.size(); l-- > 0;) update(l, hooks);
  }
  void update_all() { update_all(no_hooks{}); }

  /// On a clone, once the engine has filled the state (after `wait()`): copies the mirrored
  /// buffers into the module and the received step counters into the optimizer. Parameters
  /// and optimizer slots were received in place and need nothing.
  void restore() {
    torch::NoGradGuard no_grad;
    for (auto& ly : layers_)
      for (auto& m : ly.mirrors) m.live.copy_(*m.mirror);
    for (auto& p : params_) read_step(p);
  }

  /// "sgd", "adam" or "adamw".
  const char* optimizer_name() const noexcept {
    return opt_kind_ == kind::sgd ? "sgd" : opt_kind_ == kind::adam ? "adam" : "adamw";
  }

 private:
  enum class kind { sgd, adam, adamw };
  struct mirror {
    at::Tensor live;     ///< the module's buffer (shares its storage)
    at::Tensor* mirror;  ///< what the state holds
  };
  struct param {
    at::Tensor tensor;
    std::string name;
    std::size_t group;
    at::Tensor* step = nullptr;  ///< Adam/AdamW: the mirrored step counter
    std::string key;             ///< the optimizer's state key
  };
  struct layer {
    std::string name;
    std::vector<std::pair<std::string, at::Tensor*>> tensors;
    std::vector<std::size_t> params;  ///< indices into params_
    std::vector<mirror> mirrors;
  };

  static kind optimizer_kind(torch::optim::Optimizer& opt) {
    // AdamW first: it is no Adam, but test the most specific types anyway.
    if (dynamic_cast<torch::optim::AdamW*>(&opt)) return kind::adamw;
    if (dynamic_cast<torch::optim::Adam*>(&opt)) return kind::adam;
    if (dynamic_cast<torch::optim::SGD*>(&opt)) return kind::sgd;
    throw error(errc::unsupported, "libtorch::module_state supports torch::optim::SGD, Adam and AdamW; for another "
                                   "optimizer register its state tensors with deepclone::state yourself");
  }

  static std::vector<layer_group> default_groups(torch::nn::Module& model, const std::string& root) {
    std::vector<layer_group> out;
    if (!model.named_parameters(false).is_empty() || !model.named_buffers(false).is_empty()) out.push_back({root, {""}});
    for (auto& item : model.named_modules("", /*include_self=*/false)) {
      auto& m = *item.value();
      if (!m.named_parameters(false).is_empty() || !m.named_buffers(false).is_empty())
        out.push_back({item.key(), {item.key()}});
    }
    return out;
  }

  /// The key LibTorch's optimizers file a parameter's state under: the TensorImpl address
  /// as text in 1.13 (c10::guts::to_string); the address itself where the key type is a
  /// pointer.
  template <class Map>
  static auto state_key(const at::Tensor& p) {
    using key_type = typename std::remove_cvref_t<Map>::key_type;
    if constexpr (std::is_same_v<key_type, std::string>) {
      std::ostringstream s;
      s << p.unsafeGetTensorImpl();
      return s.str();
    } else {
      return key_type(p.unsafeGetTensorImpl());
    }
  }

  at::Tensor& hold(at::Tensor t) {
    held_.push_back(std::move(t));
    return held_.back();
  }

  /// The module's own parameters (not its children's) into `ly`, each with its optimizer
  /// state when an optimizer group holds it (`group_of`); `seen` refuses one in two layers.
  void add_parameters(torch::nn::Module& m, const std::string& prefix, const std::map<const void*, std::size_t>& group_of,
                      std::map<const void*, bool>& seen, layer& ly) {
    for (auto& item : m.named_parameters(/*recurse=*/false)) {
      const at::Tensor& p = item.value();
      const std::string name = prefix + item.key();
      if (seen[p.unsafeGetTensorImpl()])
        throw error(errc::invalid_argument, "libtorch::module_state: parameter '" + name + "' is in two layers");
      seen[p.unsafeGetTensorImpl()] = true;
      check_tensor(p, "parameter '" + name + "'");
      ly.tensors.push_back({name, &hold(p)});
      auto g = group_of.find(p.unsafeGetTensorImpl());
      if (g == group_of.end()) continue;  // not optimised (frozen): the parameter alone
      param pr{p, name, g->second, nullptr, {}};
      add_slots(pr, ly);
      params_.push_back(std::move(pr));
      ly.params.push_back(params_.size() - 1);
    }
  }
  /// The module's own buffers into `ly`: mirrored (a copy the update refreshes) or held.
  void add_buffers(torch::nn::Module& m, const std::string& prefix, bool mirror, layer& ly) {
    for (auto& item : m.named_buffers(/*recurse=*/false)) {
      const at::Tensor& b = item.value();
      const std::string name = prefix + item.key();
      check_tensor(b, "buffer '" + name + "'");
      if (mirror) {
        at::Tensor& copy = hold(b.detach().clone());
        ly.tensors.push_back({name, &copy});
        ly.mirrors.push_back({b, &copy});
      } else {
        ly.tensors.push_back({name, &hold(b)});
      }
    }
  }

  /// Creates the optimizer state of `p` if the optimizer has not yet, and registers its
  /// tensors in `ly`.
  void add_slots(param& p, layer& ly) {
    auto& st = opt_.state();
    auto key = state_key<decltype(st)>(p.tensor);
    p.key = key;
    auto& group_options = opt_.param_groups()[p.group].options();
    auto slot = [&](const at::Tensor& t, const std::string& suffix) {
      check_tensor(t, "optimizer state '" + p.name + "." + suffix + "'");
      ly.tensors.push_back({p.name + "." + suffix, &hold(t)});
    };
    auto zeros = [&] { return torch::zeros_like(p.tensor, at::MemoryFormat::Contiguous); };
    if (opt_kind_ == kind::sgd) return add_sgd_slot(group_options, key, zeros, slot);
    auto adam_like = [&](auto* options, auto* state_type) {
      using options_t = std::remove_pointer_t<decltype(options)>;
      using state_t = std::remove_pointer_t<decltype(state_type)>;
      auto* ao = dynamic_cast<options_t*>(&group_options);
      if (!ao) throw error(errc::unsupported, "libtorch::module_state: a parameter group with other options than its optimizer's");
      auto it = st.find(key);
      if (it == st.end()) {  // as Adam::step does at a parameter's first update
        auto s = std::make_unique<state_t>();
        s->step(0);
        s->exp_avg(zeros());
        s->exp_avg_sq(zeros());
        if (ao->amsgrad()) s->max_exp_avg_sq(zeros());
        st[key] = std::move(s);
        it = st.find(key);
      }
      auto& s = static_cast<state_t&>(*it->second);
      slot(s.exp_avg(), "exp_avg");
      slot(s.exp_avg_sq(), "exp_avg_sq");
      if (ao->amsgrad()) slot(s.max_exp_avg_sq(), "max_exp_avg_sq");
      p.step = &hold(torch::full({1}, static_cast<std::int64_t>(s.step()), torch::dtype(torch::kLong)));
      ly.tensors.push_back({p.name + ".step", p.step});
    };
    if (opt_kind_ == kind::adam)
      adam_like(static_cast<torch::optim::AdamOptions*>(nullptr), static_cast<torch::optim::AdamParamState*>(nullptr));
    else
      adam_like(static_cast<torch::optim::AdamWOptions*>(nullptr), static_cast<torch::optim::AdamWParamState*>(nullptr));
  }

  /// SGD with momentum keeps one slot, created as SGD::step does at the first update.
  template <class Key, class Zeros, class Slot>
  void add_sgd_slot(torch::optim::OptimizerOptions& group_options, const Key& key, Zeros zeros, Slot slot) {
    auto* so = dynamic_cast<torch::optim::SGDOptions*>(&group_options);
    if (!so) throw error(errc::unsupported, "libtorch::module_state: an SGD parameter group without SGDOptions");
    if (so->momentum() == 0) return;  // plain SGD keeps no state
    auto& st = opt_.state();
    auto it = st.find(key);
    if (it == st.end()) {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(zeros());
      st[key] = std::move(s);
      it = st.find(key);
    }
    slot(static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer(), "momentum_buffer");
  }

  template <class F>
  void with_step_state(param& p, F&& f) {
    if (!p.step) return;
    auto& st = opt_.state();
    auto it = st.find(p.key);
    if (it == st.end())
      throw error(errc::invalid_argument, "libtorch::module_state: the optimizer dropped the state of '" + p.name + "'");
    if (opt_kind_ == kind::adam) f(static_cast<torch::optim::AdamParamState&>(*it->second));
    else f(static_cast<torch::optim::AdamWParamState&>(*it->second));
  }
  void write_step(param& p) {
    with_step_state(p, [&](auto& s) { p.step->template data_ptr<std::int64_t>()[0] = s.step(); });
  }
  void read_step(param& p) {
    with_step_state(p, [&](auto& s) { s.step(p.step->template data_ptr<std::int64_t>()[0]); });
  }

  /// optimizer.step() restricted to the parameters of `ly`: the others' gradients are
  /// hidden (LibTorch's optimizers skip a parameter whose gradient is undefined).
  void step_only(layer& ly) {
    if (ly.params.empty()) return;
    std::vector<std::pair<at::Tensor, at::Tensor>> hidden;
    for (auto& g : opt_.param_groups())
      for (auto& p : g.params()) {
        auto it = index_.find(p.unsafeGetTensorImpl());
        bool mine = it != index_.end() &&
                    std::find(ly.params.begin(), ly.params.end(), it->second) != ly.params.end();
        if (!mine && p.grad().defined()) {
          hidden.emplace_back(p, p.grad());
          p.mutable_grad() = at::Tensor();
        }
      }
    try {
      opt_.step();
    } catch (...) {
      for (auto& [p, g] : hidden) p.mutable_grad() = g;
      throw;
    }
    for (auto& [p, g] : hidden) p.mutable_grad() = g;
  }

  torch::optim::Optimizer& opt_;
  kind opt_kind_;
  std::deque<at::Tensor> held_;  ///< handles the state points to: a deque never moves them
  std::vector<param> params_;
  std::map<const void*, std::size_t> index_;
  std::vector<layer> layers_;
  deepclone::state<at::Tensor> state_;
};

}  // namespace libtorch
}  // namespace deepclone
