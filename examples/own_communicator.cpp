// A communicator written from scratch, as a user would for their own transport: the
// smallest adapter that keeps the contract of communicator.hpp. Ranks are threads; every
// send is copied into the receiver's mailbox at once (an "eager" transport, so sends
// complete immediately and `cancel` of a send has nothing to do). The program first checks
// the contract's run-time points on this communicator, then forks a 2-source state into 2
// clone ranks over it and checks the clone bit for bit. Exits non-zero on any failure.
#include <deepclone/deepclone.hpp>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace queue_transport {

struct message {
  std::vector<std::byte> bytes;
};
struct receive {
  std::byte* buffer;
  std::size_t capacity;
  int from, tag;
  bool matched = false, cancelled = false, too_large = false;
  std::size_t received = 0;
};

struct mailbox {
  std::mutex m;
  std::map<std::pair<int, int>, std::deque<message>> arrived;            // (sender, tag)
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<receive>>> posted;  // oldest first
};

class communicator {
 public:
  // (1) default-constructible and movable. `recv` is empty for a send (complete at once).
  struct request_type {
    std::shared_ptr<receive> recv;
    std::size_t sent = 0;
  };

  communicator(std::shared_ptr<std::vector<mailbox>> boxes, int rank) : boxes_(std::move(boxes)), rank_(rank) {}
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(boxes_->size()); }

  // (2) An eager send: the bytes are copied now, so the request is complete at once.
  request_type isend(int peer, int tag, std::span<const std::byte> data) {
    auto& box = at(peer, "isend");
    std::lock_guard lk(box.m);
    box.arrived[{rank_, tag}].push_back({{data.begin(), data.end()}});
    match(box, {rank_, tag});
    return {nullptr, data.size()};
  }
  request_type irecv(int peer, int tag, std::span<std::byte> buffer) {
    at(peer, "irecv");
    auto r = std::make_shared<receive>(receive{buffer.data(), buffer.size(), peer, tag});
    auto& box = own();
    std::lock_guard lk(box.m);
    box.posted[{peer, tag}].push_back(r);
    match(box, {peer, tag});
    return {r, 0};
  }
  // (4) Non-blocking; the same answer again once complete. (5) Too large: an error.
  std::optional<std::size_t> test(request_type& r) {
    if (!r.recv) return r.sent;
    std::lock_guard lk(own().m);
    if (r.recv->too_large)
      throw deepclone::error(deepclone::errc::transport, "message from rank " + std::to_string(r.recv->from) + " to rank " +
                                                             std::to_string(rank_) + " with tag " + std::to_string(r.recv->tag) +
                                                             " is larger than the receive buffer");
    if (r.recv->cancelled) return std::size_t{0};
    if (r.recv->matched) return r.recv->received;
    return std::nullopt;
  }
  // (9) Engines never call it; collectives.hpp does.
  std::size_t wait(request_type& r) {
    for (;;) {
      if (auto n = test(r)) return *n;
      std::this_thread::yield();
    }
  }
  // (6) Withdraws a pending receive; a completed or cancelled request is left as it is.
  void cancel(request_type& r) {
    if (!r.recv) return;
    auto& box = own();
    std::lock_guard lk(box.m);
    if (r.recv->matched || r.recv->cancelled) return;
    auto& q = box.posted[{r.recv->from, r.recv->tag}];
    std::erase(q, r.recv);
    r.recv->cancelled = true;
  }

 private:
  mailbox& own() { return (*boxes_)[static_cast<std::size_t>(rank_)]; }
  mailbox& at(int peer, const char* what) {
    // (8) Errors are deepclone::errors.
    if (peer < 0 || peer >= size())
      throw deepclone::error(deepclone::errc::invalid_argument, std::string(what) + ": no rank " + std::to_string(peer));
    return (*boxes_)[static_cast<std::size_t>(peer)];
  }
  // (3) Oldest posted receive takes the oldest message of (sender, tag). Called with the lock.
  static void match(mailbox& box, std::pair<int, int> key) {
    auto& msgs = box.arrived[key];
    auto& recvs = box.posted[key];
    while (!msgs.empty() && !recvs.empty()) {
      auto r = recvs.front();
      auto& m = msgs.front();
      if (m.bytes.size() > r->capacity) {
        r->too_large = true;
      } else {
        if (!m.bytes.empty()) std::memcpy(r->buffer, m.bytes.data(), m.bytes.size());
        r->received = m.bytes.size();
      }
      r->matched = true;
      msgs.pop_front();
      recvs.pop_front();
    }
  }

  std::shared_ptr<std::vector<mailbox>> boxes_;
  int rank_;
};

static_assert(deepclone::point_to_point_communicator<communicator>);

}  // namespace queue_transport

namespace {

int failures = 0;
void expect(bool ok, const char* what) {
  std::printf("  %s %s\n", ok ? "ok    " : "FAILED", what);
  if (!ok) ++failures;
}

/// The contract's run-time points that two ranks can show on their own.
template <class Comm>
void check_contract(Comm& a, Comm& b) {
  using deepclone::error;
  std::vector<std::byte> out(64, std::byte{7}), in(64), in2(64), small(8);
  auto s = a.isend(b.rank(), 5, out);
  auto r = b.irecv(a.rank(), 5, in);
  auto first = b.wait(r);
  expect(first == 64 && in[63] == std::byte{7}, "a message arrives whole");
  expect(b.test(r) == first && b.test(r) == first, "testing a completed receive again returns the same count");
  b.cancel(r);
  expect(b.test(r) == first, "cancel of a completed receive does nothing");
  a.wait(s);

  auto pending = b.irecv(a.rank(), 6, in);
  expect(!b.test(pending), "a receive without a message is pending");
  b.cancel(pending);
  expect(b.test(pending) == std::size_t{0}, "test after cancel of a pending receive returns 0");
  b.cancel(pending);
  expect(b.test(pending) == std::size_t{0}, "a second cancel does nothing");

  auto first_msg = std::vector<std::byte>(16, std::byte{1}), second_msg = std::vector<std::byte>(4, std::byte{2});
  auto s1 = a.isend(b.rank(), 7, first_msg);
  auto s2 = a.isend(b.rank(), 7, second_msg);
  auto r1 = b.irecv(a.rank(), 7, in);
  auto r2 = b.irecv(a.rank(), 7, in2);
  expect(b.wait(r1) == 16 && b.wait(r2) == 4, "messages of one sender and tag arrive in the order sent");
  a.wait(s1);
  a.wait(s2);

  auto big = a.isend(b.rank(), 8, out);
  auto tiny = b.irecv(a.rank(), 8, small);
  bool threw = false;
  try {
    b.wait(tiny);
  } catch (const error& e) {
    threw = e.code() == deepclone::errc::transport;
  }
  expect(threw, "a message larger than the receive buffer is a deepclone::error (errc::transport)");
  try {
    a.wait(big);
  } catch (const error&) {  // allowed by the contract
  }

  bool bad_peer = false;
  try {
    (void)a.isend(a.size(), 1, out);
  } catch (const error& e) {
    bad_peer = e.code() == deepclone::errc::invalid_argument;
  }
  expect(bad_peer, "a peer outside the communicator is a deepclone::error (errc::invalid_argument)");
  typename Comm::request_type unposted{};  // default-constructible, as the engines need
  (void)unposted;
}

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) return false;
  return true;
}

}  // namespace

int main() {
  using comm_t = queue_transport::communicator;
  const int n = 2, m = 2;
  auto boxes = std::make_shared<std::vector<queue_transport::mailbox>>(n + m);

  std::printf("own_communicator: the contract of communicator.hpp on a user-written transport\n");
  comm_t c0(boxes, 0), c1(boxes, 1);
  check_contract(c0, c1);
  std::printf("own_communicator: the same checks on deepclone::inproc\n");
  deepclone::inproc::world two(2);
  auto i0 = two.comm(0), i1 = two.comm(1);
  check_contract(i0, i1);

  // A fork over it: 2 sources train a 3-layer state, 2 clone ranks request after step 3.
  std::printf("own_communicator: forking 2 sources into 2 clone ranks over it\n");
  using cloning = deepclone::engine<comm_t>;
  const auto roles = deepclone::roles::contiguous(n, m);
  std::vector<std::thread> threads;
  std::vector<std::vector<float>> at_fork(3);
  std::vector<std::vector<std::vector<float>>> cloned(m);
  std::uint64_t k = 0;
  std::atomic<int> clones_requested{0};
  std::atomic<bool> failed{false};
  for (int rank = 0; rank < n + m; ++rank)
    threads.emplace_back([&, rank] {
      try {
        comm_t comm(boxes, rank);
        std::vector<std::vector<float>> w{std::vector<float>(300000), std::vector<float>(1000), std::vector<float>(50000)};
        deepclone::state<std::vector<float>> state;
        for (std::size_t l = 0; l < w.size(); ++l) state.add_layer("layer" + std::to_string(l), {{"weight", w[l]}});
        if (rank < n) {
          cloning::source src(comm, roles, state);
          for (std::uint64_t step = 0; step < 12; ++step) {
            for (std::size_t l = w.size(); l-- > 0;) {
              src.before_update(l);
              for (std::size_t i = 0; i < w[l].size(); ++i) w[l][i] = static_cast<float>(step * 1000 + l) + 1e-3f * static_cast<float>(i % 97);
              src.after_update(l);
            }
            state.metadata().step = step;
            if (rank == 0 && src.fork_iteration() == step) at_fork = w;
            deepclone::barrier(comm, roles.sources, 1);  // stands for the gradient allreduce
            src.end_iteration(step);
            if (rank == 0 && step == 3)
              while (clones_requested.load() < m && !failed) std::this_thread::yield();
          }
          src.finish();
        } else {
          cloning::clone dst(comm, roles, state);
          dst.request();
          ++clones_requested;
          dst.wait();
          k = dst.metadata().step;
          cloned[static_cast<std::size_t>(rank - n)] = w;
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "own_communicator: rank %d failed: %s\n", rank, e.what());
        failed = true;
      }
    });
  for (auto& t : threads) t.join();
  expect(!failed, "every rank finished without an error");
  for (int j = 0; j < m; ++j)
    expect(!failed && !at_fork[0].empty() && same_bits(cloned[static_cast<std::size_t>(j)], at_fork),
           ("clone rank " + std::to_string(n + j) + " holds the sources' state of iteration " + std::to_string(k) +
            " bit for bit").c_str());
  std::printf("%s\n", failures ? "result: FAILED" : "result: OK");
  return failures ? 1 : 0;
}
