#pragma once
// shm_fabric: the timelines of deepclone::emulated_link in POSIX shared memory, so that
// ranks in separate processes on one node (MPI ranks) share one link model, exactly as
// the threads of the in-process transport share a deepclone::link_fabric. Same matching
// rule (per (from, to, tag) the n-th receive pairs with the n-th send), same schedule
// (start = max(match time, tx_free[from], rx_free[to]), done = start + bytes/B + latency),
// same cancel semantics. Also paces the emulated storage of the checkpoint strategy (a
// per-client link and the file system's aggregate bandwidth, per direction).
//
// steady_clock is CLOCK_MONOTONIC, one clock for every process of a node, so time points
// taken in different processes compare. One process creates the segment, the others attach
// after a barrier; `reset` (between runs, with no traffic) forgets every slot.
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include <deepclone/emulated_link.hpp>

namespace bench {

class shm_fabric {
 public:
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;
  /// A slot's index and generation; generation 0 is "no slot" (unlimited links).
  struct slot_ptr {
    std::uint32_t idx = 0, gen = 0;
    explicit operator bool() const noexcept { return gen != 0; }
  };

  static constexpr int max_ranks = 64;
  static constexpr std::uint32_t slots = 1u << 17, keys = 1u << 16;

  /// An unlimited fabric with no segment: the decorator is a pass-through.
  explicit shm_fabric(int ranks) : ranks_(ranks) {}

  /// Creates (`create`) or attaches to the segment `name`.
  shm_fabric(const std::string& name, int ranks, deepclone::link_config cfg, bool create) : ranks_(ranks), name_(name) {
    if (ranks > max_ranks) throw std::invalid_argument("shm_fabric: at most 64 ranks");
    if (cfg.backfill) throw std::invalid_argument("shm_fabric: busy-until links only (link_config::backfill is in-process)");
    int fd = ::shm_open(name.c_str(), create ? O_CREAT | O_RDWR | O_TRUNC : O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error("shm_open " + name + " failed");
    bytes_ = sizeof(header) + sizeof(slot) * slots + sizeof(key) * keys;
    if (create && ::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) throw std::runtime_error("ftruncate " + name);
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw std::runtime_error("mmap " + name);
    h_ = static_cast<header*>(p);
    slot_ = reinterpret_cast<slot*>(h_ + 1);
    key_ = reinterpret_cast<key*>(slot_ + slots);
    owner_ = create;
    if (create) {
      pthread_mutexattr_t a;
      pthread_mutexattr_init(&a);
      pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
      pthread_mutex_init(&h_->m, &a);
      h_->bandwidth = cfg.bandwidth;
      h_->latency_ns = cfg.latency.count();
      reset_locked();
    }
    cfg_ = {h_->bandwidth, std::chrono::nanoseconds(h_->latency_ns)};
  }
  ~shm_fabric() {
    if (h_) ::munmap(h_, bytes_);
    if (owner_) ::shm_unlink(name_.c_str());
  }
  shm_fabric(const shm_fabric&) = delete;

  bool unlimited() const noexcept { return cfg_.unlimited(); }
  int size() const noexcept { return ranks_; }
  const deepclone::link_config& config() const noexcept { return cfg_; }

  /// Forgets every slot and timeline. Only while no rank has traffic on this fabric.
  void reset() {
    if (!h_) return;
    lock l(h_);
    reset_locked();
  }

  slot_ptr post(bool is_send, int from, int to, int tag, std::size_t bytes, time_point now) {
    lock l(h_);
    std::uint32_t s = alloc();
    auto& x = slot_[s];
    x.is_send = is_send;
    x.from = from;
    x.to = to;
    x.tag = tag;
    x.bytes = bytes;
    key& k = find_key(from, to, tag);
    const int mine = is_send ? 0 : 1, other = 1 - mine;
    if (k.head[other] == 0) {
      push_back(k, mine, s);
    } else {
      std::uint32_t o = k.head[other];
      k.head[other] = slot_[o].next;
      if (k.head[other] == 0) k.tail[other] = 0;
      slot_[o].next = 0;
      match(is_send ? s : o, is_send ? o : s, now);
    }
    return {s, x.gen};
  }

  std::optional<time_point> done(const slot_ptr& p) {
    lock l(h_);
    auto& x = slot_[p.idx];
    if (x.gen != p.gen || !x.matched) return std::nullopt;
    return time_point(clock::duration(x.done_ns));
  }

  void finish(const slot_ptr& p, bool cancelled) {
    lock l(h_);
    auto& x = slot_[p.idx];
    if (x.gen != p.gen) return;
    if (!cancelled && !x.matched) {  // an eager send the transport completed: done for its owner, but on
      x.orphan = 1;                  // the model's wire it waits in its queue for the receive (freed then)
      return;
    }
    if (cancelled) {
      if (!x.matched) {
        unlink(find_key(x.from, x.to, x.tag), x.is_send ? 0 : 1, p.idx);
      } else if (x.partner_gen && slot_[x.partner].gen == x.partner_gen) {
        auto& o = slot_[x.partner];  // put the partner back at the head of its queue
        o.matched = 0;
        o.partner = o.partner_gen = 0;
        key& k = find_key(o.from, o.to, o.tag);
        const int side = o.is_send ? 0 : 1;
        o.next = k.head[side];
        k.head[side] = x.partner;
        if (k.tail[side] == 0) k.tail[side] = x.partner;
      }
    }
    release(p.idx);
  }

  /// Emulated storage: reserves `bytes` of `rank`'s storage link and of the file system's
  /// aggregate bandwidth; returns when the chunk completes in the model.
  time_point reserve_storage(int rank, std::size_t bytes, bool write, double B_link, double B_store) {
    lock l(h_);
    auto now = clock::now().time_since_epoch().count();
    auto& lf = h_->storage_link[write][rank];
    auto& sf = h_->store_free[write];
    auto start = std::max({now, lf, sf});
    auto dl = static_cast<std::int64_t>(static_cast<double>(bytes) / B_link * 1e9);
    auto ds = static_cast<std::int64_t>(static_cast<double>(bytes) / B_store * 1e9);
    lf = start + dl;
    sf = start + ds;
    return time_point(clock::duration(start + std::max(dl, ds)));
  }

 private:
  struct slot {
    std::uint32_t gen, next, partner, partner_gen;
    std::int32_t from, to, tag;
    std::uint8_t is_send, matched, orphan, pad;
    std::uint64_t bytes;
    std::int64_t done_ns;
  };
  struct key {
    std::int32_t from, to, tag, used;
    std::uint32_t head[2], tail[2];  // unmatched sends [0] and receives [1], oldest first
  };
  struct header {
    pthread_mutex_t m;
    double bandwidth;
    std::int64_t latency_ns;
    std::uint32_t free_head, next_gen;
    std::int64_t tx[max_ranks], rx[max_ranks];
    std::int64_t store_free[2], storage_link[2][max_ranks];
  };
  struct lock {
    header* h;
    explicit lock(header* x) : h(x) { pthread_mutex_lock(&h->m); }
    ~lock() { pthread_mutex_unlock(&h->m); }
  };

  void reset_locked() {
    std::memset(slot_, 0, sizeof(slot) * slots);
    std::memset(key_, 0, sizeof(key) * keys);
    for (std::uint32_t i = 1; i + 1 < slots; ++i) slot_[i].next = i + 1;  // slot 0 is "none"
    h_->free_head = 1;
    h_->next_gen = 1;
    std::fill(std::begin(h_->tx), std::end(h_->tx), 0);
    std::fill(std::begin(h_->rx), std::end(h_->rx), 0);
    h_->store_free[0] = h_->store_free[1] = 0;
    for (auto& a : h_->storage_link) std::fill(std::begin(a), std::end(a), 0);
  }
  std::uint32_t alloc() {
    std::uint32_t s = h_->free_head;
    if (s == 0) throw std::runtime_error("shm_fabric: out of slots (requests never finished?)");
    h_->free_head = slot_[s].next;
    auto& x = slot_[s];
    std::uint32_t g = h_->next_gen++;
    if (g == 0) g = h_->next_gen++;
    x = slot{};
    x.gen = g;
    return s;
  }
  void release(std::uint32_t s) {
    slot_[s].gen = 0;
    slot_[s].next = h_->free_head;
    h_->free_head = s;
  }
  key& find_key(int from, int to, int tag) {
    std::uint64_t hsh = (static_cast<std::uint64_t>(from) * 1000003u) ^ (static_cast<std::uint64_t>(to) * 7919u) ^
                        (static_cast<std::uint64_t>(tag) * 2654435761u);
    for (std::uint32_t i = 0; i < keys; ++i) {
      key& k = key_[(hsh + i) & (keys - 1)];
      if (!k.used) {
        k.used = 1;
        k.from = from;
        k.to = to;
        k.tag = tag;
        return k;
      }
      if (k.from == from && k.to == to && k.tag == tag) return k;
    }
    throw std::runtime_error("shm_fabric: key table full");
  }
  void push_back(key& k, int side, std::uint32_t s) {
    slot_[s].next = 0;
    if (k.tail[side]) slot_[k.tail[side]].next = s;
    else k.head[side] = s;
    k.tail[side] = s;
  }
  void unlink(key& k, int side, std::uint32_t s) {
    std::uint32_t prev = 0;
    for (std::uint32_t c = k.head[side]; c; prev = c, c = slot_[c].next) {
      if (c != s) continue;
      if (prev) slot_[prev].next = slot_[c].next;
      else k.head[side] = slot_[c].next;
      if (k.tail[side] == c) k.tail[side] = prev;
      return;
    }
  }
  void match(std::uint32_t send, std::uint32_t recv, time_point now) {
    auto& s = slot_[send];
    auto& r = slot_[recv];
    s.partner = recv;
    s.partner_gen = r.gen;
    r.partner = send;
    r.partner_gen = s.gen;
    r.bytes = s.bytes;
    std::int64_t t = now.time_since_epoch().count();
    std::int64_t end = t;
    if (s.from != s.to) {
      std::int64_t start = std::max({t, h_->tx[s.from], h_->rx[s.to]});
      end = start + (h_->bandwidth > 0 ? static_cast<std::int64_t>(static_cast<double>(s.bytes) / h_->bandwidth * 1e9) : 0);
      h_->tx[s.from] = h_->rx[s.to] = end;
    }
    s.done_ns = r.done_ns = end + h_->latency_ns;
    s.matched = r.matched = 1;
    if (s.orphan) release(send);  // its owner finished it before the match (eager): the slot is free now
    if (r.orphan) release(recv);
  }

  int ranks_;
  std::string name_;
  std::size_t bytes_ = 0;
  header* h_ = nullptr;
  slot* slot_ = nullptr;
  key* key_ = nullptr;
  bool owner_ = false;
  deepclone::link_config cfg_{};
};

}  // namespace bench
