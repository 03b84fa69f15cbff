// integrations/torch.hpp: at::Tensor traits, module_state (layout, lazy optimizer state,
// per-layer update, step counters, buffer mirrors) and a BatchNorm CNN forked in process.
#include <deepclone/deepclone.hpp>
#include <deepclone/integrations/torch.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dc = deepclone;
namespace lt = deepclone::libtorch;

namespace {

/// The errc and message of what `f` throws (a test fails if it throws something else).
template <class F>
std::pair<dc::errc, std::string> error_of(F&& f) {
  try {
    f();
  } catch (const dc::error& e) {
    return {static_cast<dc::errc>(e.code().value()), e.what()};
  }
  FAIL("no deepclone::error thrown");
  return {};
}

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto x = a.contiguous().cpu(), y = b.contiguous().cpu();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(4))),
        fc(register_module("fc", torch::nn::Linear(4 * 4 * 4, 3))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(bn->forward(conv->forward(x)));
    x = torch::max_pool2d(x, 2);
    return fc->forward(x.flatten(1));
  }
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
  torch::nn::Linear fc;
};
TORCH_MODULE(Net);

Net make_net(std::uint64_t seed) {
  torch::manual_seed(seed);
  return Net();
}

/// One training step's gradients on fixed data (the same for every model given the seed).
void backward(Net& net, int seed) {
  auto g = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed));
  auto x = at::randn({6, 1, 8, 8}, g);
  auto y = at::randint(0, 3, {6}, g, torch::kLong);
  auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
  loss.backward();
}

std::vector<std::string> names_of(dc::state<at::Tensor>& s) {
  std::vector<std::string> out;
  auto lay = s.describe();
  for (auto& l : lay.layers())
    for (auto& t : l.tensors) out.push_back(l.name + ":" + t.name);
  return out;
}

}  // namespace

TEST_CASE("torch.traits: dtype, size, shape and memory space of at::Tensor") {
  const std::vector<std::pair<c10::ScalarType, dc::dtype>> types{
      {torch::kBool, dc::dtype::boolean}, {torch::kUInt8, dc::dtype::u8},    {torch::kInt8, dc::dtype::i8},
      {torch::kInt16, dc::dtype::i16},    {torch::kInt32, dc::dtype::i32},   {torch::kInt64, dc::dtype::i64},
      {torch::kFloat16, dc::dtype::f16},  {torch::kBFloat16, dc::dtype::bf16}, {torch::kFloat32, dc::dtype::f32},
      {torch::kFloat64, dc::dtype::f64},  {torch::kComplexFloat, dc::dtype::c64}, {torch::kComplexDouble, dc::dtype::c128}};
  for (auto [st, expected] : types) {
    CAPTURE(c10::toString(st));
    at::Tensor t = torch::zeros({2, 3, 5}, torch::dtype(st));
    static_assert(dc::shaped_tensor<at::Tensor> && dc::placed_tensor<at::Tensor>);
    CHECK(dc::tensor_dtype(t) == expected);
    CHECK(dc::tensor_bytes(t).size() == 30 * dc::dtype_size(expected));
    CHECK(static_cast<void*>(dc::tensor_bytes(t).data()) == t.data_ptr());
    CHECK(dc::tensor_shape(t) == std::vector<std::int64_t>{2, 3, 5});
    CHECK(dc::tensor_space(t) == dc::memory_space::host);
  }
  // A contiguous slice is fine: its bytes start at its own offset in the storage.
  at::Tensor big = torch::arange(100, torch::kFloat32);
  at::Tensor tail = big.slice(0, 10, 20);
  CHECK(static_cast<void*>(dc::tensor_bytes(tail).data()) == static_cast<void*>(big.data_ptr<float>() + 10));
  // Zero-dimensional tensors (BatchNorm's num_batches_tracked) have shape [].
  at::Tensor scalar = torch::tensor(7, torch::kLong);
  CHECK(dc::tensor_shape(scalar).empty());
  CHECK(dc::tensor_bytes(scalar).size() == 8);
}

TEST_CASE("torch.traits: clear errors for tensors deepclone cannot move in place") {
  at::Tensor undefined;
  auto e = error_of([&] { (void)dc::tensor_bytes(undefined); });
  CHECK(e.first == dc::errc::invalid_argument);
  CHECK(e.second.find("undefined") != std::string::npos);

  at::Tensor t = torch::ones({4, 3}).t();
  e = error_of([&] { (void)dc::tensor_bytes(t); });
  CHECK(e.first == dc::errc::invalid_argument);
  CHECK(e.second.find("not contiguous") != std::string::npos);
  CHECK(e.second.find(".contiguous()") != std::string::npos);

  at::Tensor sparse = torch::eye(3).to_sparse();
  e = error_of([&] { (void)dc::tensor_dtype(sparse); });
  CHECK(e.first == dc::errc::invalid_argument);
  CHECK(e.second.find("strided") != std::string::npos);

  at::Tensor conj = torch::ones({3}, torch::kComplexFloat).conj();
  REQUIRE(conj.is_conj());
  e = error_of([&] { (void)dc::tensor_bytes(conj); });
  CHECK(e.first == dc::errc::invalid_argument);
  CHECK(e.second.find("conjugated") != std::string::npos);
  CHECK(e.second.find("resolve_conj") != std::string::npos);

  at::Tensor q = torch::quantize_per_tensor(torch::ones({3}), 0.1, 0, torch::kQInt8);
  e = error_of([&] { (void)dc::tensor_dtype(q); });
  CHECK(e.first == dc::errc::unsupported);
  CHECK(e.second.find("QInt8") != std::string::npos);

  // A state refuses such a tensor when it is described (before any fork).
  dc::state<at::Tensor> s;
  s.add_layer("l", {{"w", t}});
  CHECK_THROWS_AS(s.describe(), dc::error);
}

TEST_CASE("torch.traits: CUDA tensors are device memory") {
  if (!torch::cuda::is_available()) {
    MESSAGE("skipped: this LibTorch has no CUDA device");
    return;
  }
  at::Tensor t = torch::zeros({16}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32));
  CHECK(dc::tensor_space(t) == dc::memory_space::device);
  CHECK(dc::tensor_bytes(t).size() == 64);
}

TEST_CASE("torch.module_state: layers, slots and up-front optimizer state match what LibTorch creates lazily") {
  auto layout_after_steps = [](auto make_opt, int steps) {
    Net net = make_net(1);
    auto opt = make_opt(*net);
    for (int i = 0; i < steps; ++i) {
      opt.zero_grad();
      backward(net, i);
      opt.step();
    }
    lt::module_state ms(*net, opt);
    return std::pair{ms.state().describe(), names_of(ms.state())};
  };
  SUBCASE("SGD with momentum") {
    auto make = [](torch::nn::Module& m) { return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)); };
    auto fresh = layout_after_steps(make, 0), stepped = layout_after_steps(make, 2);
    CHECK(fresh.first == stepped.first);
    CHECK(fresh.second == std::vector<std::string>{
                             "conv:conv.weight", "conv:conv.weight.momentum_buffer", "conv:conv.bias",
                             "conv:conv.bias.momentum_buffer", "bn:bn.weight", "bn:bn.weight.momentum_buffer",
                             "bn:bn.bias", "bn:bn.bias.momentum_buffer", "bn:bn.running_mean", "bn:bn.running_var",
                             "bn:bn.num_batches_tracked", "fc:fc.weight", "fc:fc.weight.momentum_buffer", "fc:fc.bias",
                             "fc:fc.bias.momentum_buffer"});
  }
  SUBCASE("plain SGD keeps no slots") {
    auto make = [](torch::nn::Module& m) { return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.1)); };
    auto fresh = layout_after_steps(make, 0);
    CHECK(fresh.first.tensor_count() == 9);  // 6 parameters, 3 buffers
  }
  SUBCASE("Adam: moments and the int64 step counter") {
    auto make = [](torch::nn::Module& m) { return torch::optim::Adam(m.parameters(), torch::optim::AdamOptions(1e-3)); };
    auto fresh = layout_after_steps(make, 0), stepped = layout_after_steps(make, 3);
    CHECK(fresh.first == stepped.first);
    auto& fc = fresh.first.layers()[2];
    REQUIRE(fc.tensors.size() == 8);
    CHECK(fc.tensors[1].name == "fc.weight.exp_avg");
    CHECK(fc.tensors[2].name == "fc.weight.exp_avg_sq");
    CHECK(fc.tensors[3].name == "fc.weight.step");
    CHECK(fc.tensors[3].type == dc::dtype::i64);
    CHECK(fc.tensors[3].bytes == 8);
  }
  SUBCASE("AdamW with amsgrad") {
    auto make = [](torch::nn::Module& m) {
      return torch::optim::AdamW(m.parameters(), torch::optim::AdamWOptions(1e-3).amsgrad(true));
    };
    auto fresh = layout_after_steps(make, 0), stepped = layout_after_steps(make, 2);
    CHECK(fresh.first == stepped.first);
    CHECK(fresh.first.layers()[2].tensors[3].name == "fc.weight.max_exp_avg_sq");
  }
}

TEST_CASE("torch.module_state: the step counters are the optimizer's") {
  Net net = make_net(2);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  lt::module_state ms(*net, opt);
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    backward(net, i);
    ms.update_all();
  }
  // The mirrored counter says 3 for every parameter, like the optimizer's own state.
  auto& fc_step = *ms.state().layer_tensors(2)[3].ref;
  CHECK(fc_step.item<std::int64_t>() == 3);
  for (auto& [key, st] : opt.state()) CHECK(static_cast<torch::optim::AdamParamState&>(*st).step() == 3);
  // restore() writes received counters (and buffers) back into the optimizer (and module).
  for (std::size_t l = 0; l < ms.layer_count(); ++l)
    for (auto& t : ms.state().layer_tensors(l))
      if (t.name.size() > 5 && t.name.substr(t.name.size() - 5) == ".step") t.ref->fill_(41);
  auto& mean_mirror = *ms.state().layer_tensors(1)[8].ref;
  REQUIRE(ms.state().layer_tensors(1)[8].name == "bn.running_mean");
  mean_mirror.fill_(0.5);
  ms.restore();
  for (auto& [key, st] : opt.state()) CHECK(static_cast<torch::optim::AdamParamState&>(*st).step() == 41);
  CHECK(torch::equal(net->bn->running_mean, torch::full({4}, 0.5)));
}

TEST_CASE("torch.module_state: per-layer updates equal optimizer.step() bit for bit") {
  auto check = [](auto make_opt, bool zero_sign_free) {
    Net a = make_net(3), b = make_net(3);
    auto opt_a = make_opt(*a);
    auto opt_b = make_opt(*b);
    lt::module_state ms(*b, opt_b);
    for (int i = 0; i < 4; ++i) {
      opt_a.zero_grad();
      opt_b.zero_grad();
      backward(a, i);
      backward(b, i);
      opt_a.step();
      ms.update_all();
    }
    auto pa = a->named_parameters(), pb = b->named_parameters();
    for (auto& item : pa) {
      CAPTURE(item.key());
      CHECK(bitwise_equal(item.value(), pb[item.key()]));
    }
    auto ba = a->named_buffers(), bb = b->named_buffers();
    for (auto& item : ba) CHECK(bitwise_equal(item.value(), bb[item.key()]));
    // The slots of each parameter, matched through the parameters' order.
    auto params_a = a->parameters(), params_b = b->parameters();
    REQUIRE(opt_a.state().size() == opt_b.state().size());
    for (std::size_t i = 0; i < params_a.size(); ++i) {
      std::ostringstream ka, kb;
      ka << params_a[i].unsafeGetTensorImpl();
      kb << params_b[i].unsafeGetTensorImpl();
      auto& sa = *opt_a.state().at(ka.str());
      auto& sb = *opt_b.state().at(kb.str());
      if (auto* x = dynamic_cast<torch::optim::SGDParamState*>(&sa)) {
        auto& y = dynamic_cast<torch::optim::SGDParamState&>(sb);
        // LibTorch's first momentum buffer is clone(g), ours 0·μ + g: equal values, and
        // bitwise equal unless g holds a negative zero.
        if (zero_sign_free) CHECK(torch::equal(x->momentum_buffer(), y.momentum_buffer()));
      } else {
        auto& x2 = dynamic_cast<torch::optim::AdamParamState&>(sa);
        auto& y2 = dynamic_cast<torch::optim::AdamParamState&>(sb);
        CHECK(x2.step() == y2.step());
        CHECK(bitwise_equal(x2.exp_avg(), y2.exp_avg()));
        CHECK(bitwise_equal(x2.exp_avg_sq(), y2.exp_avg_sq()));
      }
    }
  };
  SUBCASE("SGD momentum, nesterov, weight decay") {
    check([](torch::nn::Module& m) {
      return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-4));
    }, true);
  }
  SUBCASE("Adam") {
    check([](torch::nn::Module& m) { return torch::optim::Adam(m.parameters(), torch::optim::AdamOptions(1e-2)); }, true);
  }
}

TEST_CASE("torch.module_state: user grouping and errors") {
  Net net = make_net(4);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  lt::options o;
  o.groups = {{"features", {"conv", "bn"}}, {"head", {"fc"}}};
  lt::module_state ms(*net, opt, o);
  CHECK(ms.layer_count() == 2);
  CHECK(ms.state().layer_name(0) == "features");
  CHECK(ms.state().layer_tensors(0).size() == 7);
  CHECK(ms.parameters(0).size() == 4);
  CHECK(ms.live_buffers(0).size() == 3);

  lt::options bad;
  bad.groups = {{"features", {"conv", "nope"}}};
  auto e = error_of([&] { lt::module_state x(*net, opt, bad); });
  CHECK(e.first == dc::errc::invalid_argument);
  CHECK(e.second.find("'nope'") != std::string::npos);

  lt::options partial;  // the optimizer holds fc's parameters, which no layer names
  partial.groups = {{"features", {"conv", "bn"}}};
  e = error_of([&] { lt::module_state x(*net, opt, partial); });
  CHECK(e.first == dc::errc::invalid_argument);

  torch::optim::RMSprop rms(net->parameters(), torch::optim::RMSpropOptions(0.01));
  e = error_of([&] { lt::module_state x(*net, rms); });
  CHECK(e.first == dc::errc::unsupported);
  CHECK(e.second.find("SGD, Adam and AdamW") != std::string::npos);
}

// The rule behind the mirrors, checked by the engine itself (settings.check_writes): a
// training-mode forward pass writes BatchNorm's live statistics between after_update of one
// iteration and before_update of the next. Registered directly, they break the rule; as
// mirrors (the default) they do not.
TEST_CASE("torch.module_state: BatchNorm statistics are written only inside the hooks (check_writes)") {
  using cloning = dc::engine<dc::inproc::communicator>;
  auto train = [](bool mirror) -> std::optional<dc::errc> {
    Net net = make_net(5);
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
    lt::options o;
    o.mirror_buffers = mirror;
    lt::module_state ms(*net, opt, o);
    dc::inproc::world world(2);  // rank 1 would be a clone; none asks
    auto comm = world.comm(0);
    cloning::settings s;
    s.check_writes = true;
    cloning::source src(comm, dc::roles::contiguous(1, 1), ms.state(), s);
    try {
      for (std::uint64_t step = 0; step < 3; ++step) {
        opt.zero_grad();
        backward(net, static_cast<int>(step));
        ms.update_all(src);
        ms.state().metadata().step = step;
        src.end_iteration(step);
      }
    } catch (const dc::error& e) {
      CHECK(std::string(e.what()).find("bn.running_mean") != std::string::npos);
      return static_cast<dc::errc>(e.code().value());
    }
    return std::nullopt;
  };
  CHECK(train(true) == std::nullopt);
  auto e = train(false);
  REQUIRE(e.has_value());
  CHECK(*e == dc::errc::outside_hooks);
}

// The buffer pattern under a real fork: BatchNorm writes its running statistics in every
// forward pass, i.e. while the window pipeline may still be sending the previous
// iteration's bytes; the mirrors are written only inside update(l). 2 sources -> 1 clone.
TEST_CASE("torch.fork: a BatchNorm CNN with Adam forks bit for bit in process") {
  using cloning = dc::engine<dc::inproc::communicator>;
  const int n = 2, m = 1;
  const auto roles = dc::roles::contiguous(n, m);
  const std::uint64_t steps = 12, request_after = 3;
  std::vector<Net> nets;
  for (int r = 0; r < n + m; ++r) nets.push_back(make_net(r < n ? 7 : 99));  // the clone starts elsewhere
  std::vector<std::unique_ptr<torch::optim::Adam>> opts;
  for (auto& net : nets) opts.push_back(std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-2)));
  std::vector<at::Tensor> at_fork, cloned;  // parameters, buffers, exp_avg of rank 0 / the clone
  std::vector<std::int64_t> steps_at_fork, steps_cloned;
  std::atomic<std::uint64_t> progress{0};
  std::atomic<bool> requested{false};
  std::uint64_t k = 0;

  auto collect = [](Net& net, torch::optim::Adam& opt, std::vector<at::Tensor>& out, std::vector<std::int64_t>& st) {
    for (auto& p : net->parameters()) out.push_back(p.detach().clone());
    for (auto& b : net->buffers()) out.push_back(b.clone());
    for (auto& p : net->parameters()) {
      std::ostringstream key;
      key << p.unsafeGetTensorImpl();
      auto& s = static_cast<torch::optim::AdamParamState&>(*opt.state().at(key.str()));
      out.push_back(s.exp_avg().clone());
      out.push_back(s.exp_avg_sq().clone());
      st.push_back(s.step());
    }
  };

  dc::inproc::world world(n + m);
  world.run([&](dc::inproc::communicator& comm) {
    const int rank = comm.rank();
    Net& net = nets[static_cast<std::size_t>(rank)];
    auto& opt = *opts[static_cast<std::size_t>(rank)];
    lt::module_state ms(*net, opt);
    if (rank < n) {
      cloning::source src(comm, roles, ms.state());
      for (std::uint64_t s = 0; s < steps; ++s) {
        opt.zero_grad();
        backward(net, static_cast<int>(100 * s) + rank);  // each rank its own samples
        for (std::size_t l = ms.layer_count(); l-- > 0;) {
          for (auto& p : ms.parameters(l)) {  // average gradients and buffers over the sources
            auto g = p.grad();
            dc::allreduce_sum(comm, roles.sources, std::span<float>(g.data_ptr<float>(), g.numel()), 10);
            g.div_(n);
          }
          for (auto& b : ms.live_buffers(l))
            if (b.scalar_type() == torch::kFloat) {
              dc::allreduce_sum(comm, roles.sources, std::span<float>(b.data_ptr<float>(), b.numel()), 12);
              b.div_(n);
            }
          ms.update(l, src);
        }
        ms.state().metadata().step = s;
        if (rank == 0 && src.fork_iteration() == s) collect(net, opt, at_fork, steps_at_fork);
        src.end_iteration(s);
        if (rank == 0) {
          progress = s + 1;
          if (s == request_after)
            while (!requested) std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      }
      src.finish();
    } else {
      cloning::clone dst(comm, roles, ms.state());
      while (progress.load() <= request_after) std::this_thread::sleep_for(std::chrono::microseconds(50));
      dst.request();
      requested = true;
      dst.wait();
      ms.restore();
      k = *dst.fork_iteration();
      collect(net, opt, cloned, steps_cloned);
    }
  });
  REQUIRE(!at_fork.empty());
  REQUIRE(at_fork.size() == cloned.size());
  CHECK(k > request_after);
  for (std::size_t i = 0; i < at_fork.size(); ++i) {
    CAPTURE(i);
    CHECK(bitwise_equal(at_fork[i], cloned[i]));
  }
  CHECK(steps_cloned == steps_at_fork);
  CHECK(steps_cloned.front() == static_cast<std::int64_t>(k + 1));
  // The running statistics really travelled: the clone's BatchNorm had its own before.
  CHECK(nets[2]->bn->num_batches_tracked.item<std::int64_t>() == static_cast<std::int64_t>(k + 1));
}
