// A LibTorch CNN with BatchNorm, trained data-parallel on N in-process ranks, forked into M
// clone ranks that train on with another learning rate while the sources keep training.
// Exits non-zero unless every clone rank holds, right after the fork, the sources' state of
// the fork iteration bit for bit: parameters, BatchNorm buffers, optimizer state (momentum
// or Adam moments and step counters) and metadata. With --clone-lr equal to --lr and as
// many clone ranks as sources, the clone's loss curve and final parameters must also equal
// the sources' bit for bit.
//
//   torch_fork [--sources N] [--clones M] [--fork-at STEP] [--steps S] [--lr X] [--clone-lr X]
//              [--optimizer sgd|adam|adamw] [--seed S]
//   mpirun -np N+M torch_fork --mpi 1 [--sources N --clones M ...]   (built with Boost.MPI)
// Under MPI every rank is a process: the clone sets verify_replicas, so it completes only if
// every source's whole replica of iteration k equals what it received, and with the same
// learning rate source rank 0 sends its loss curve to clone rank 0 to be compared bit for bit.
#include <deepclone/deepclone.hpp>
#include <deepclone/integrations/torch.hpp>
#ifdef DEEPCLONE_TORCH_FORK_MPI
#include <deepclone/integrations/boost_mpi.hpp>

#include <boost/mpi.hpp>
#endif

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

struct options {
  std::uint32_t sources = 4, clones = 2;
  std::uint64_t fork_at = 5, steps = 20, seed = 7;
  double lr = 0.05, clone_lr = 0.01;
  std::string optimizer = "sgd";
  bool mpi = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "torch_fork: %s\nusage: torch_fork [--sources N] [--clones M] [--fork-at STEP] [--steps S] [--lr X]\n"
               "                  [--clone-lr X] [--optimizer sgd|adam|adamw] [--seed S] [--mpi 1]\n",
               why.c_str());
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) usage("missing value after " + a);
    std::string v = argv[++i];
    try {
      if (a == "--sources") o.sources = static_cast<std::uint32_t>(std::stoul(v));
      else if (a == "--clones") o.clones = static_cast<std::uint32_t>(std::stoul(v));
      else if (a == "--fork-at") o.fork_at = std::stoull(v);
      else if (a == "--steps") o.steps = std::stoull(v);
      else if (a == "--seed") o.seed = std::stoull(v);
      else if (a == "--lr") o.lr = std::stod(v);
      else if (a == "--clone-lr") o.clone_lr = std::stod(v);
      else if (a == "--optimizer") o.optimizer = v;
      else if (a == "--mpi") o.mpi = v == "1";
      else usage("unknown option " + a);
    } catch (const std::logic_error&) {
      usage("bad value for " + a + ": '" + v + "'");
    }
  }
  if (o.sources == 0 || o.clones == 0 || o.sources > 16 || o.clones > 16) usage("--sources and --clones must be in [1, 16]");
  if (o.optimizer != "sgd" && o.optimizer != "adam" && o.optimizer != "adamw") usage("unknown --optimizer " + o.optimizer);
  if (o.fork_at + 4 >= o.steps) usage("--steps must exceed --fork-at + 4 (the fork lands at fork-at + 3)");
  return o;
}

// --- The model: two conv + BatchNorm blocks and an MLP head, on 1x12x12 images ----------
struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(8))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(16))),
        fc1(register_module("fc1", torch::nn::Linear(16 * 3 * 3, 32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 4))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1->forward(conv1->forward(x))), 2);
    x = torch::max_pool2d(torch::relu(bn2->forward(conv2->forward(x))), 2);
    return fc2->forward(torch::relu(fc1->forward(x.flatten(1))));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Cnn);

/// A fixed synthetic data set: images of noise plus one of four stripe patterns, labelled
/// by the pattern. Built once, read by every rank.
struct dataset {
  torch::Tensor x, y;
  static constexpr std::int64_t size = 4096;
  explicit dataset(std::uint64_t seed) {
    auto g = at::detail::createCPUGenerator(seed);
    y = at::randint(0, 4, {size}, g, torch::kLong);
    auto patterns = torch::zeros({4, 1, 12, 12});
    for (int c = 0; c < 4; ++c)
      for (int i = c; i < 12; i += 4) {
        if (c % 2) patterns[c].index_put_({0, torch::indexing::Slice(), i}, 1.0);
        else patterns[c].index_put_({0, i, torch::indexing::Slice()}, 1.0);
      }
    x = patterns.index_select(0, y) + 0.8 * at::randn({size, 1, 12, 12}, g);
  }
};

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, Cnn& net, double lr) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(lr));
  if (kind == "adamw")
    return std::make_unique<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(lr).weight_decay(1e-2));
  return std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
}

/// One rank's trainer: the model, its optimizer and their deepclone state.
struct rank_trainer {
  Cnn net;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<deepclone::libtorch::module_state> ms;
  std::uint64_t next = 0;

  rank_trainer(const options& o, std::uint64_t init_seed) {
    torch::manual_seed(init_seed);  // the global generator: construct ranks one at a time
    net = Cnn();
    opt = make_optimizer(o.optimizer, net, o.lr);
    ms = std::make_unique<deepclone::libtorch::module_state>(*net, *opt);
    auto& m = ms->state().metadata();
    m.hyper["lr"] = o.lr;
  }

  /// One data-parallel iteration over `group`, global batch 64. Gradients and BatchNorm
  /// statistics are averaged over the group layer by layer (sums in rank order:
  /// reproducible for a given group size), then each layer is updated between the hooks.
  template <class Comm, class Hooks>
  double step(Comm& comm, std::span<const int> group, const dataset& data, Hooks&& hooks) {
    const std::int64_t B = 64, G = static_cast<std::int64_t>(group.size());
    std::int64_t pos = 0;
    while (group[static_cast<std::size_t>(pos)] != comm.rank()) ++pos;
    auto& meta = ms->state().metadata();
    for (auto& g : opt->param_groups()) g.options().set_lr(meta.hyper.at("lr"));
    const std::int64_t lo = pos * B / G, hi = (pos + 1) * B / G;
    auto idx = (torch::arange(lo, hi, torch::kLong) + static_cast<std::int64_t>(meta.data_cursor)) % dataset::size;
    opt->zero_grad();
    auto loss = torch::nn::functional::cross_entropy(
                    net->forward(data.x.index_select(0, idx)), data.y.index_select(0, idx),
                    torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                static_cast<double>(B);
    loss.backward();
    for (std::size_t l = ms->layer_count(); l-- > 0;) {
      for (auto& p : ms->parameters(l)) {
        auto g = p.grad();
        deepclone::allreduce_sum(comm, group, std::span<float>(g.data_ptr<float>(), static_cast<std::size_t>(g.numel())), 10);
      }
      for (auto& b : ms->live_buffers(l))
        if (b.scalar_type() == torch::kFloat) {  // running_mean, running_var (num_batches_tracked is equal)
          deepclone::allreduce_sum(comm, group, std::span<float>(b.data_ptr<float>(), static_cast<std::size_t>(b.numel())), 12);
          b.div_(static_cast<double>(G));
        }
      ms->update(l, hooks);
    }
    double total = loss.item<double>();
    deepclone::allreduce_sum(comm, group, std::span<double>(&total, 1), 14);
    meta.step = next++;
    meta.data_cursor += static_cast<std::uint64_t>(B);
    return total;
  }
};

/// Everything a bitwise comparison needs, by name: parameters and buffers from the module,
/// the optimizer's slots and step counters from the optimizer itself (so `restore()` is
/// checked too), and the metadata.
struct snapshot {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  std::vector<std::int64_t> steps;
  deepclone::metadata meta;
};

snapshot take(rank_trainer& t) {
  snapshot s;
  for (auto& item : t.net->named_parameters()) s.tensors.emplace_back(item.key(), item.value().detach().clone());
  for (auto& item : t.net->named_buffers()) s.tensors.emplace_back(item.key(), item.value().clone());
  for (auto& item : t.net->named_parameters()) {
    std::ostringstream key;
    key << item.value().unsafeGetTensorImpl();
    auto it = t.opt->state().find(key.str());
    if (it == t.opt->state().end()) continue;
    auto& st = *it->second;
    if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(&st)) {
      s.tensors.emplace_back(item.key() + ".momentum_buffer", sgd->momentum_buffer().clone());
    } else if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(&st)) {
      s.tensors.emplace_back(item.key() + ".exp_avg", adam->exp_avg().clone());
      s.tensors.emplace_back(item.key() + ".exp_avg_sq", adam->exp_avg_sq().clone());
      s.steps.push_back(adam->step());
    } else if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(&st)) {
      s.tensors.emplace_back(item.key() + ".exp_avg", adamw->exp_avg().clone());
      s.tensors.emplace_back(item.key() + ".exp_avg_sq", adamw->exp_avg_sq().clone());
      s.steps.push_back(adamw->step());
    }
  }
  s.meta = t.ms->state().metadata();
  return s;
}

std::string first_difference(const snapshot& a, const snapshot& b) {
  if (a.tensors.size() != b.tensors.size()) return "tensor count differs";
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    auto& [name, x] = a.tensors[i];
    auto& y = b.tensors[i].second;
    if (name != b.tensors[i].first) return "tensor order differs at " + name;
    if (x.sizes() != y.sizes() || x.scalar_type() != y.scalar_type() || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0)
      return name + " differs";
  }
  if (a.steps != b.steps) return "optimizer step counters differ";
  if (!(a.meta == b.meta)) return "metadata differs";
  return {};
}

#ifdef DEEPCLONE_TORCH_FORK_MPI
/// The same fork with one process per rank, over Boost.MPI.
int run_mpi(const options& o, int argc, char** argv) {
  boost::mpi::environment env(argc, argv, boost::mpi::threading::funneled);
  boost::mpi::communicator world;
  if (world.size() != static_cast<int>(o.sources + o.clones)) {
    if (world.rank() == 0) std::fprintf(stderr, "torch_fork: --mpi needs %u processes\n", o.sources + o.clones);
    return 2;
  }
  deepclone::mpi::communicator comm(world);
  using cloning = deepclone::engine<deepclone::mpi::communicator>;
  const auto roles = deepclone::roles::contiguous(static_cast<int>(o.sources), static_cast<int>(o.clones));
  const dataset data(o.seed);
  const int rank = world.rank();
  rank_trainer t(o, roles.source_index(rank) ? o.seed : o.seed + 1000 + static_cast<std::uint64_t>(rank));
  std::vector<double> loss(o.steps, 0);
  const bool same_lr = o.clone_lr == o.lr && o.clones == o.sources;
  constexpr int tag_curve = 500;  // below the engine's tag_base (1000)
  try {
    if (auto i = roles.source_index(rank)) {
      cloning::source src(comm, roles, t.ms->state());
      for (std::uint64_t s = 0; s < o.steps; ++s) {
        loss[s] = t.step(comm, roles.sources, data, src);
        src.end_iteration(s);
      }
      src.finish();
      if (*i == 0 && same_lr) world.send(roles.clones[0], tag_curve, loss.data(), static_cast<int>(loss.size()));
      if (*i == 0) std::printf("torch_fork --mpi: source rank 0 trained %llu steps, final loss %.6f\n",
                               static_cast<unsigned long long>(o.steps), loss.back());
      return 0;
    }
    const auto j = *roles.clone_index(rank);
    cloning::settings st;
    st.verify_replicas = true;  // every source confirms its replica of k equals what arrived
    cloning::clone dst(comm, roles, t.ms->state(), st);
    // A progress line for clones that take over a second ("clone rank 4: iteration 12: 3/5 layers, ...").
    dst.on_progress(deepclone::progress_line("clone rank " + std::to_string(rank)));
    dst.request();
    dst.wait();
    t.ms->restore();
    const std::uint64_t k = *dst.fork_iteration();
    t.next = k + 1;
    t.ms->state().metadata().hyper["lr"] = o.clone_lr;
    for (std::uint64_t s = k + 1; s < o.steps; ++s) loss[s] = t.step(comm, roles.clones, data, deepclone::libtorch::no_hooks{});
    if (j != 0) return 0;
    std::printf("torch_fork --mpi: clone rank %d forked at iteration %llu, verified against all %u source replicas "
                "(parameters, BatchNorm buffers, %s state%s, metadata); final loss %.6f\n%s",
                rank, static_cast<unsigned long long>(k), o.sources, t.ms->optimizer_name(),
                o.optimizer == "sgd" ? "" : " and step counters", loss.back(),
                deepclone::to_string(dst.report()).c_str());
    if (!same_lr) return 0;
    std::vector<double> theirs(o.steps);
    world.recv(roles.sources[0], tag_curve, theirs.data(), static_cast<int>(theirs.size()));
    for (std::uint64_t s = k + 1; s < o.steps; ++s)
      if (std::memcmp(&theirs[s], &loss[s], sizeof(double)) != 0) {
        std::printf("check: FAILED: same learning rate, yet the loss of step %llu differs: %.17g vs %.17g\n",
                    static_cast<unsigned long long>(s), theirs[s], loss[s]);
        return 1;
      }
    std::printf("check: same learning rate: the clone's loss curve (steps %llu-%llu) equals the sources' bit for bit\n",
                static_cast<unsigned long long>(k + 1), static_cast<unsigned long long>(o.steps - 1));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_fork --mpi: rank %d FAILED: %s\n", rank, e.what());
    return 1;
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  at::set_num_threads(1);  // one intra-op thread per rank: ranks are threads already
  if (o.mpi) {
#ifdef DEEPCLONE_TORCH_FORK_MPI
    return run_mpi(o, argc, argv);
#else
    usage("this build has no MPI (Boost.MPI was not found)");
#endif
  }
  using cloning = deepclone::engine<deepclone::inproc::communicator>;
  const auto roles = deepclone::roles::contiguous(static_cast<int>(o.sources), static_cast<int>(o.clones));
  const dataset data(o.seed);

  // Sources start from one seed; clone ranks from another, so that only the fork can make
  // them equal.
  std::vector<std::unique_ptr<rank_trainer>> ranks;
  for (std::uint32_t r = 0; r < o.sources + o.clones; ++r)
    ranks.push_back(std::make_unique<rank_trainer>(o, r < o.sources ? o.seed : o.seed + 1000 + r));
  const std::size_t layers = ranks[0]->ms->layer_count();
  std::uint64_t params = 0;
  for (auto& p : ranks[0]->net->parameters()) params += static_cast<std::uint64_t>(p.numel());
  std::printf("deepclone torch_fork: LibTorch %s, CNN (conv-bn-conv-bn-fc-fc, %llu parameters, %zu layers), %s\n",
              TORCH_VERSION, static_cast<unsigned long long>(params), layers, ranks[0]->ms->optimizer_name());
  std::printf("%u source ranks -> %u clone ranks in process; fork requested after step %llu; lr %g, clone lr %g\n\n",
              o.sources, o.clones, static_cast<unsigned long long>(o.fork_at), o.lr, o.clone_lr);

  std::vector<double> source_loss(o.steps, 0), clone_loss(o.steps, 0), source_final_loss;
  std::optional<snapshot> at_fork;
  std::vector<snapshot> cloned(o.clones);
  std::optional<snapshot> source_final, clone_final;
  deepclone::report report;
  std::uint64_t k = 0;
  std::atomic<std::uint64_t> progress{0};
  std::atomic<std::uint32_t> requested{0};
  std::atomic<bool> failed{false};

  deepclone::inproc::world world(static_cast<int>(o.sources + o.clones));
  try {
    world.run([&](deepclone::inproc::communicator& comm) {
      try {
        auto& t = *ranks[static_cast<std::size_t>(comm.rank())];
        if (auto i = roles.source_index(comm.rank())) {
          cloning::source src(comm, roles, t.ms->state());
          for (std::uint64_t s = 0; s < o.steps; ++s) {
            double loss = t.step(comm, roles.sources, data, src);
            if (*i == 0 && src.fork_iteration() == s) at_fork = take(t);
            src.end_iteration(s);
            if (*i != 0) continue;
            source_loss[s] = loss;
            progress = s + 1;
            if (s == o.fork_at)  // the clone requests are in before step fork_at + 1 ends
              while (requested.load() < o.clones && !failed.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
          }
          src.finish();
          if (*i == 0) source_final = take(t);
        } else {
          const auto j = *roles.clone_index(comm.rank());
          cloning::clone dst(comm, roles, t.ms->state());
          while (progress.load() <= o.fork_at && !failed.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
          dst.request();
          requested.fetch_add(1);
          dst.wait();
          t.ms->restore();  // BatchNorm buffers and step counters into the module and optimizer
          cloned[j] = take(t);
          k = *dst.fork_iteration();
          t.next = k + 1;
          t.ms->state().metadata().hyper["lr"] = o.clone_lr;  // the ablation the fork is for
          for (std::uint64_t s = k + 1; s < o.steps; ++s) {
            double loss = t.step(comm, roles.clones, data, deepclone::libtorch::no_hooks{});
            if (j == 0) clone_loss[s] = loss;
          }
          if (j == 0) {
            clone_final = take(t);
            report = dst.report();
          }
        }
      } catch (...) {
        failed = true;
        throw;
      }
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_fork: FAILED: %s\n", e.what());
    return 1;
  }

  std::printf(" step   source loss    clone loss\n");
  for (std::uint64_t s = 0; s < o.steps; ++s) {
    std::printf("%5llu  %12.6f", static_cast<unsigned long long>(s), source_loss[s]);
    if (s > k) std::printf("  %12.6f", clone_loss[s]);
    else if (s == k) std::printf("  <- fork: the clone starts from the state of this iteration");
    std::printf("\n");
  }
  std::printf("\n%s\n", deepclone::to_string(report).c_str());

  int bad = 0;
  if (!at_fork || at_fork->meta.step != k) {
    std::printf("check: FAILED: no snapshot of the sources at iteration %llu\n", static_cast<unsigned long long>(k));
    return 1;
  }
  std::uint64_t bytes = 0;
  for (auto& [n, x] : at_fork->tensors) bytes += x.nbytes();
  for (std::uint32_t j = 0; j < o.clones; ++j) {
    auto d = first_difference(*at_fork, cloned[j]);
    if (d.empty())
      std::printf("check: clone rank %u holds the sources' state of iteration %llu bit for bit (%zu tensors, %llu B: "
                  "parameters, BatchNorm buffers, %s state, %zu step counters, metadata)\n",
                  o.sources + j, static_cast<unsigned long long>(k), at_fork->tensors.size(),
                  static_cast<unsigned long long>(bytes), ranks[0]->ms->optimizer_name(), at_fork->steps.size());
    else {
      std::printf("check: FAILED: clone rank %u: %s\n", o.sources + j, d.c_str());
      ++bad;
    }
  }
  if (o.clone_lr == o.lr && o.clones == o.sources) {
    // Same learning rate, same group size: the clone must retrace the sources exactly.
    bool same = true;
    for (std::uint64_t s = k + 1; s < o.steps; ++s)
      if (std::memcmp(&source_loss[s], &clone_loss[s], sizeof(double)) != 0) same = false;
    auto a = *source_final, b = *clone_final;
    a.meta.hyper.clear();
    b.meta.hyper.clear();
    auto d = first_difference(a, b);
    if (same && d.empty())
      std::printf("check: same learning rate: the clone's loss curve (steps %llu-%llu) and final state equal the "
                  "sources' bit for bit\n",
                  static_cast<unsigned long long>(k + 1), static_cast<unsigned long long>(o.steps - 1));
    else {
      std::printf("check: FAILED: same learning rate, yet %s\n", same ? d.c_str() : "the loss curves differ");
      ++bad;
    }
  }
  std::printf("%s\n", bad ? "result: FAILED" : "result: OK");
  return bad ? 1 : 0;
}
