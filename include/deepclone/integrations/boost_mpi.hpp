#pragma once
/// \file integrations/boost_mpi.hpp
/// The MPI transport: `deepclone::mpi::communicator` wraps a `boost::mpi::communicator`
/// (or a raw `MPI_Comm`) and models `point_to_point_communicator`,
/// `tag_bounded_communicator`, `collective_communicator` and `gathering_communicator`
/// (messages over several byte ranges as MPI derived datatypes). Including this header is the
/// opt-in; the core never includes it. Link the CMake target `deepclone::boost_mpi`.
///
///   boost::mpi::environment env(argc, argv);            // MPI_THREAD_SINGLE/FUNNELED is enough
///   boost::mpi::communicator world;
///   deepclone::mpi::communicator comm(world);           // collective: every rank constructs it
///   using cloning = deepclone::engine<deepclone::mpi::communicator>;
///
/// Bytes travel as `MPI_BYTE` through the C API (`MPI_Isend`/`MPI_Irecv` on the
/// underlying communicator), never through Boost.Serialization.
///
/// Large messages. A message of at least `options::max_message_bytes` (default 1 GiB, at
/// most INT_MAX) is split: its first `max_message_bytes` travel on the communicator with
/// the caller's tag, the rest on a private duplicate ("shadow") communicator with the same
/// tag, in pieces of `max_message_bytes` ended by a shorter (possibly empty) piece. The
/// receiver drains continuations with `MPI_Improbe`/`MPI_Imrecv` strictly in the order in
/// which its receives on that (source, tag) were posted, so MPI's non-overtaking rule holds
/// for split messages exactly as for whole ones, even when a receive buffer is larger than
/// the message it gets.
///
/// Threading. deepclone calls MPI only from the thread that calls its hooks (source) or
/// its request/wait/poll (clone), so it needs no more than the trainer itself:
/// `MPI_THREAD_FUNNELED` when that is the main thread, `MPI_THREAD_SERIALIZED` when it is
/// another thread that never calls MPI at the same time as the rest of the process. The
/// optional progress thread (`options::progress_interval`) calls MPI concurrently and
/// needs `MPI_THREAD_MULTIPLE`; the constructor checks it. `require_thread_level` checks
/// a level at start-up with a clear `deepclone::error`.
///
/// Cancel. Receives are cancelled with `MPI_Cancel` + `MPI_Wait`: a receive that already
/// matched completes instead (the bytes land before `cancel` returns, never after). Open
/// MPI (ob1, 4.x) does not cancel *sends* at all; a send whose receiver withdrew its
/// receive can then not complete. `cancel` of such a send waits `options::cancel_grace`
/// and then parks the request inside the communicator (tested on every later call; see
/// `parked_sends()`): the buffer must stay valid until it completes, which it does only if
/// the receiver posts a matching receive later. deepclone's engine cancels sends only when
/// a session failed or a clone withdrew.

#include <mpi.h>

#include <boost/mpi/communicator.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../communicator.hpp"
#include "../error.hpp"

namespace deepclone::mpi {

/// MPI's threading levels, in increasing order.
enum class thread_level : int { single = 0, funneled = 1, serialized = 2, multiple = 3 };

inline const char* thread_level_name(thread_level t) noexcept {
  switch (t) {
    case thread_level::single: return "MPI_THREAD_SINGLE";
    case thread_level::funneled: return "MPI_THREAD_FUNNELED";
    case thread_level::serialized: return "MPI_THREAD_SERIALIZED";
    case thread_level::multiple: return "MPI_THREAD_MULTIPLE";
  }
  return "unknown";
}

namespace detail {
inline thread_level from_mpi(int t) {
  if (t == MPI_THREAD_MULTIPLE) return thread_level::multiple;
  if (t == MPI_THREAD_SERIALIZED) return thread_level::serialized;
  if (t == MPI_THREAD_FUNNELED) return thread_level::funneled;
  return thread_level::single;
}
inline std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}
inline void check(int rc, const std::string& what) {
  if (rc != MPI_SUCCESS) throw error(errc::transport, what + ": " + error_string(rc));
}
/// As above, with the description built only on failure.
template <class F>
  requires std::is_invocable_r_v<std::string, F>
inline void check(int rc, F&& what) {
  if (rc != MPI_SUCCESS) throw error(errc::transport, what() + ": " + error_string(rc));
}
inline void require_initialized(const char* who) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin)
    throw error(errc::invalid_argument, std::string(who) + ": MPI is " + (fin ? "already finalized" : "not initialized") +
                                            " (create a boost::mpi::environment first, and keep it alive)");
}
}  // namespace detail

/// The threading level MPI was initialised with (MPI_Query_thread).
inline thread_level provided_thread_level() {
  detail::require_initialized("deepclone::mpi::provided_thread_level");
  int t = MPI_THREAD_SINGLE;
  detail::check(MPI_Query_thread(&t), "MPI_Query_thread");
  return detail::from_mpi(t);
}

/// Throws `errc::unsupported` unless MPI provides at least `needed`, naming both levels and
/// how to ask for more. Call it at start-up, after the environment is created.
inline void require_thread_level(thread_level needed, const std::string& why = "deepclone") {
  auto got = provided_thread_level();
  if (static_cast<int>(got) < static_cast<int>(needed))
    throw error(errc::unsupported,
                why + " needs " + thread_level_name(needed) + ", but MPI was initialised with " + thread_level_name(got) +
                    "; initialise with boost::mpi::environment env(argc, argv, boost::mpi::threading::" +
                    (needed == thread_level::multiple     ? "multiple"
                     : needed == thread_level::serialized ? "serialized"
                                                          : "funneled") +
                    ") or MPI_Init_thread");
}

/// How the adapter uses its communicator.
struct options {
  /// Messages of at least this many bytes are split (see the file comment). At most INT_MAX;
  /// tests lower it to exercise the split path with small messages.
  std::size_t max_message_bytes = std::size_t{1} << 30;
  /// Work on a private MPI_Comm_dup of the given communicator: deepclone's messages can then
  /// never meet the trainer's, whatever their tags. Off by default (tags >= settings.tag_base
  /// keep them apart); either way constructing the adapter is collective.
  bool duplicate = false;
  /// Non-zero: run a progress thread that calls into MPI every `progress_interval` while
  /// sends are outstanding, so rendezvous sends move while the trainer computes between
  /// hooks. Needs MPI_THREAD_MULTIPLE (checked).
  std::chrono::microseconds progress_interval{0};
  /// How long `cancel` of a send that MPI cannot cancel waits before parking it.
  std::chrono::microseconds cancel_grace{10000};
};

namespace detail {

struct op {
  bool is_send = false;
  int peer = 0, tag = 0;
  std::byte* buf = nullptr;
  std::size_t size = 0;      ///< send: message size; receive: buffer capacity
  std::vector<MPI_Request> reqs;  ///< send: every piece; receive: [0] the first piece
  // receive state
  bool may_split = false;    ///< receive with capacity >= chunk: may need continuations
  bool first_done = false;
  bool draining = false;     ///< first piece was full: continuations follow on the shadow comm
  MPI_Request cont = MPI_REQUEST_NULL;
  std::size_t cont_len = 0;
  std::vector<std::byte> overflow;  ///< a continuation that does not fit (truncation) lands here
  bool truncated = false;
  std::size_t received = 0;
  bool complete = false, cancelled = false;
  // gathered / scattered messages too large for one piece travel packed in `staging`
  std::vector<std::byte> staging;
  std::vector<std::span<std::byte>> scatter_to;  ///< a staged scattered receive: where its bytes go
  /// A scattered receive's datatype, kept until it completes: its status is read with it.
  MPI_Datatype type = MPI_DATATYPE_NULL;

  op() = default;
  op(const op&) = delete;
  op& operator=(const op&) = delete;
  ~op() { free_type(); }
  void free_type() noexcept {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (type != MPI_DATATYPE_NULL && !finalized) MPI_Type_free(&type);
    type = MPI_DATATYPE_NULL;
  }
};
using op_ptr = std::shared_ptr<op>;

/// A committed datatype over byte ranges at their absolute addresses (an operation on it
/// starts at MPI_BOTTOM), freed when it goes out of scope: MPI keeps what a posted
/// operation still needs.
class byte_ranges {
 public:
  template <class Byte>
  explicit byte_ranges(std::span<const std::span<Byte>> runs) {
    std::vector<int> lengths;
    std::vector<MPI_Aint> at;
    for (auto r : runs) {
      if (r.empty()) continue;
      MPI_Aint a = 0;
      check(MPI_Get_address(r.data(), &a), "MPI_Get_address");
      lengths.push_back(static_cast<int>(r.size()));
      at.push_back(a);
    }
    check(MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(), at.data(), MPI_BYTE, &type_),
          "MPI_Type_create_hindexed");
    if (const int rc = MPI_Type_commit(&type_); rc != MPI_SUCCESS) {
      MPI_Type_free(&type_);
      check(rc, "MPI_Type_commit");
    }
  }
  byte_ranges(const byte_ranges&) = delete;
  byte_ranges& operator=(const byte_ranges&) = delete;
  ~byte_ranges() {
    if (type_ != MPI_DATATYPE_NULL) MPI_Type_free(&type_);
  }
  MPI_Datatype get() const noexcept { return type_; }
  /// Hands the datatype over (to an op that frees it once its receive completed).
  MPI_Datatype release() noexcept { return std::exchange(type_, MPI_DATATYPE_NULL); }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

template <class Byte>
std::size_t total_bytes(std::span<const std::span<Byte>> runs) {
  std::size_t n = 0;
  for (auto r : runs) n += r.size();
  return n;
}

struct shared {
  MPI_Comm comm = MPI_COMM_NULL;    ///< where first pieces travel
  MPI_Comm shadow = MPI_COMM_NULL;  ///< continuations of split messages; progress-thread probes
  bool owns_comm = false;
  int rank = 0, size = 0, tag_ub = 32767;
  std::size_t chunk = std::size_t{1} << 30;
  std::chrono::microseconds grace{10000};
  std::map<std::pair<int, int>, std::deque<op_ptr>> splitq;  ///< receives that may split, per (source, tag)
  std::vector<op_ptr> parked;                                ///< sends MPI could not cancel
  // progress thread
  std::thread progress;
  std::mutex m;
  std::condition_variable cv;
  std::atomic<long> sends_pending{0};
  std::atomic<bool> stop{false};
  std::chrono::microseconds interval{0};

  ~shared() {
    if (progress.joinable()) {
      stop = true;
      cv.notify_all();
      progress.join();
    }
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return;  // too late to free anything; MPI reclaimed it
    for (auto& p : parked)
      for (auto& r : p->reqs)
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
    if (shadow != MPI_COMM_NULL) MPI_Comm_free(&shadow);
    if (owns_comm && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }

  void run_progress() {
    while (!stop.load()) {
      if (sends_pending.load() <= 0) {
        std::unique_lock lk(m);
        cv.wait_for(lk, std::chrono::milliseconds(5), [&] { return stop.load() || sends_pending.load() > 0; });
        continue;
      }
      int flag = 0;
      MPI_Status st;
      // A probe that matches nothing still runs MPI's progress engine (opal_progress in
      // Open MPI). The shadow communicator carries only continuations; probing does not
      // consume them.
      MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, shadow, &flag, &st);
      std::this_thread::sleep_for(interval);
    }
  }
};

}  // namespace detail

/// One rank's endpoint over an MPI communicator. Cheap to copy; copies share the
/// duplicated communicators, the queues and the progress thread. Construct it on every
/// rank of the communicator (it duplicates the communicator: a collective call), after
/// MPI is initialised, and destroy it before MPI is finalised.
class communicator {
 public:
  /// A pending send or receive. Destroying an incomplete request does not cancel it: call
  /// `cancel` (the engines always do) before its buffer goes away.
  struct request_type {
    detail::op_ptr op;
  };

  explicit communicator(const boost::mpi::communicator& c, options o = {})
      : communicator(static_cast<MPI_Comm>(c), o) {}

  explicit communicator(MPI_Comm c, options o = {}) : s_(std::make_shared<detail::shared>()) {
    detail::require_initialized("deepclone::mpi::communicator");
    if (c == MPI_COMM_NULL) throw error(errc::invalid_argument, "deepclone::mpi::communicator: MPI_COMM_NULL");
    if (o.max_message_bytes == 0 || o.max_message_bytes > static_cast<std::size_t>(INT_MAX))
      throw error(errc::invalid_argument, "deepclone::mpi::options::max_message_bytes must be in [1, INT_MAX], got " +
                                              std::to_string(o.max_message_bytes));
    int inter = 0;
    detail::check(MPI_Comm_test_inter(c, &inter), "MPI_Comm_test_inter");
    if (inter)
      throw error(errc::invalid_argument,
                  "deepclone::mpi::communicator needs an intra-communicator; merge an inter-communicator (from "
                  "MPI_Comm_spawn or MPI_Comm_accept/connect) with MPI_Intercomm_merge first (see join_spawned)");
    if (o.progress_interval.count() > 0)
      require_thread_level(thread_level::multiple, "deepclone::mpi progress thread (options::progress_interval)");
    auto& s = *s_;
    if (o.duplicate) {
      detail::check(MPI_Comm_dup(c, &s.comm), "MPI_Comm_dup");
      s.owns_comm = true;
      MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN);
    } else {
      s.comm = c;
    }
    detail::check(MPI_Comm_dup(c, &s.shadow), "MPI_Comm_dup (shadow communicator)");
    MPI_Comm_set_errhandler(s.shadow, MPI_ERRORS_RETURN);
    detail::check(MPI_Comm_rank(s.comm, &s.rank), "MPI_Comm_rank");
    detail::check(MPI_Comm_size(s.comm, &s.size), "MPI_Comm_size");
    void* ub = nullptr;
    int flag = 0;
    detail::check(MPI_Comm_get_attr(s.comm, MPI_TAG_UB, &ub, &flag), "MPI_Comm_get_attr(MPI_TAG_UB)");
    if (flag && ub) s.tag_ub = *static_cast<int*>(ub);
    s.chunk = o.max_message_bytes;
    s.grace = o.cancel_grace;
    if (o.progress_interval.count() > 0) {
      s.interval = o.progress_interval;
      s.progress = std::thread([p = s_.get()] { p->run_progress(); });
    }
  }

  int rank() const noexcept { return s_->rank; }
  int size() const noexcept { return s_->size; }
  /// MPI_TAG_UB of the communicator (at least 32767 by the standard).
  int max_tag() const noexcept { return s_->tag_ub; }
  /// The communicator first pieces travel on (the given one, or its duplicate).
  MPI_Comm native() const noexcept { return s_->comm; }
  std::size_t max_message_bytes() const noexcept { return s_->chunk; }
  bool progress_thread() const noexcept { return s_->progress.joinable(); }
  /// Sends whose cancel MPI could not honour, still outstanding.
  std::size_t parked_sends() {
    reap_parked();
    return s_->parked.size();
  }

  request_type isend(int dest, int tag, std::span<const std::byte> data) {
    check_peer(dest, tag, "isend");
    auto o = send_op(dest, tag, data.size());
    post_send(*o, data);
    return {o};
  }

  request_type irecv(int source, int tag, std::span<std::byte> buffer) {
    check_peer(source, tag, "irecv");
    auto& s = *s_;
    auto o = std::make_shared<detail::op>();
    o->peer = source;
    o->tag = tag;
    o->buf = buffer.data();
    o->size = buffer.size();
    o->may_split = buffer.size() >= s.chunk;
    MPI_Request r = MPI_REQUEST_NULL;
    const std::size_t first = std::min(buffer.size(), s.chunk);
    detail::check(MPI_Irecv(o->buf, static_cast<int>(first), MPI_BYTE, source, tag, s.comm, &r),
                  [&] { return where("MPI_Irecv", false, source, tag, buffer.size()); });
    o->reqs.push_back(r);
    if (o->may_split) s.splitq[{source, tag}].push_back(o);
    return {o};
  }

  /// gathering_communicator: one message gathered from `runs`, as one
  /// MPI_Type_create_hindexed datatype over their addresses (no copy; faster than packing
  /// from 1 KiB runs on, docs/performance.md). A message that would be split (at least
  /// `max_message_bytes`) is packed and sent as `isend` sends it.
  request_type isend_gather(int dest, int tag, std::span<const std::span<const std::byte>> runs) {
    check_peer(dest, tag, "isend_gather");
    const auto total = detail::total_bytes(runs);
    auto o = send_op(dest, tag, total);
    if (total >= s_->chunk) {  // the op owns the packed bytes before any piece is posted
      o->staging.reserve(total);
      for (auto r : runs) o->staging.insert(o->staging.end(), r.begin(), r.end());
      post_send(*o, o->staging);
      return {o};
    }
    detail::byte_ranges type(runs);
    MPI_Request r = MPI_REQUEST_NULL;
    detail::check(MPI_Isend(MPI_BOTTOM, 1, type.get(), dest, tag, s_->comm, &r), [&] { return where("MPI_Isend (gathered)", true, dest, tag, total); });
    o->reqs.push_back(r);
    sends_posted();
    return {o};
  }
  /// gathering_communicator: one message scattered into `runs` (the datatype as in
  /// isend_gather); a message that may be split is received whole and scattered by `test`.
  request_type irecv_scatter(int source, int tag, std::span<const std::span<std::byte>> runs) {
    const auto total = detail::total_bytes(runs);
    if (total >= s_->chunk) {
      std::vector<std::byte> staged(total);
      auto req = irecv(source, tag, staged);
      req.op->staging = std::move(staged);
      req.op->scatter_to.assign(runs.begin(), runs.end());
      return req;
    }
    check_peer(source, tag, "irecv_scatter");
    auto o = std::make_shared<detail::op>();
    o->peer = source, o->tag = tag, o->size = total;
    detail::byte_ranges type(runs);
    MPI_Request r = MPI_REQUEST_NULL;
    detail::check(MPI_Irecv(MPI_BOTTOM, 1, type.get(), source, tag, s_->comm, &r),
                  [&] { return where("MPI_Irecv (scattered)", false, source, tag, total); });
    o->reqs.push_back(r);
    o->type = type.release();
    return {o};
  }

  /// The number of bytes received (a receive) or sent (a send) once complete; 0 for a
  /// cancelled request. Throws `errc::transport` on an MPI error or a message larger than
  /// the receive buffer.
  std::optional<std::size_t> test(request_type& r) {
    auto& o = require(r, "test");
    reap_parked();
    if (!o.complete) {
      if (o.is_send) test_send(o);
      else if (o.may_split) drain(o.peer, o.tag);
      else test_first(o);
    }
    if (!o.complete) return std::nullopt;
    if (o.truncated) throw truncation(o);
    scatter_staged(o);
    return o.cancelled ? 0 : o.received;
  }

  std::size_t wait(request_type& r) {
    unsigned spins = 0;
    for (;;) {
      if (auto n = test(r)) return *n;
      backoff(spins);
    }
  }

  /// Withdraws `r`; afterwards MPI no longer writes into a receive buffer. A receive
  /// that already matched is completed instead. See the file comment for sends.
  void cancel(request_type& r) {
    if (!r.op) return;
    auto& o = *r.op;
    if (!o.complete) {
      if (o.is_send) cancel_send(r.op);
      else cancel_recv(o);
    }
    scatter_staged(o);  // a staged scattered receive that completed lands now, never later
    o.scatter_to.clear();
  }

  // --- collective_communicator (whole communicator) ---
  void barrier() {
    MPI_Request r = MPI_REQUEST_NULL;
    detail::check(MPI_Ibarrier(s_->comm, &r), "MPI_Ibarrier");
    wait_native(r, "MPI_Ibarrier");
  }
  void allreduce_sum(std::span<double> v) {
    if (v.size() > static_cast<std::size_t>(INT_MAX)) throw error(errc::invalid_argument, "allreduce_sum: more than INT_MAX values");
    MPI_Request r = MPI_REQUEST_NULL;
    detail::check(MPI_Iallreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_SUM, s_->comm, &r),
                  "MPI_Iallreduce");
    wait_native(r, "MPI_Iallreduce");
  }

 private:
  std::shared_ptr<detail::op> send_op(int dest, int tag, std::size_t bytes) const {
    auto o = std::make_shared<detail::op>();
    o->is_send = true, o->peer = dest, o->tag = tag, o->size = bytes;
    return o;
  }
  /// Posts `data` as op `o`'s message: one piece, or split as the file comment says.
  void post_send(detail::op& o, std::span<const std::byte> data) {
    auto& s = *s_;
    o.buf = const_cast<std::byte*>(data.data());  // MPI_Isend takes void*; it only reads
    auto post = [&](MPI_Comm c, std::size_t off, std::size_t len) {
      MPI_Request r = MPI_REQUEST_NULL;
      detail::check(MPI_Isend(o.buf + off, static_cast<int>(len), MPI_BYTE, o.peer, o.tag, c, &r),
                    [&] { return where("MPI_Isend", true, o.peer, o.tag, len); });
      o.reqs.push_back(r);
    };
    if (data.size() < s.chunk) {
      post(s.comm, 0, data.size());
    } else {
      post(s.comm, 0, s.chunk);
      for (std::size_t off = s.chunk;; off += s.chunk) {
        std::size_t len = std::min(s.chunk, data.size() - off);
        post(s.shadow, off, len);
        if (len < s.chunk) break;  // the shorter (possibly empty) piece ends the message
      }
    }
    sends_posted();
  }
  void sends_posted() {
    if (!s_->progress.joinable()) return;
    ++s_->sends_pending;
    s_->cv.notify_all();
  }

  static void backoff(unsigned& spins) {
    if (spins < 64) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(spins < 512 ? 5 : 50));
    ++spins;
  }

  void wait_native(MPI_Request& r, const char* what) {
    unsigned spins = 0;
    for (;;) {
      int flag = 0;
      detail::check(MPI_Test(&r, &flag, MPI_STATUS_IGNORE), what);
      if (flag) return;
      backoff(spins);
    }
  }

  detail::op& require(request_type& r, const char* what) const {
    if (!r.op) throw error(errc::invalid_argument, std::string("deepclone::mpi::communicator::") + what + " of an empty request");
    return *r.op;
  }

  void check_peer(int peer, int tag, const char* what) const {
    if (peer < 0 || peer >= s_->size)
      throw error(errc::invalid_argument, std::string(what) + ": rank " + std::to_string(peer) + " outside a communicator of size " +
                                              std::to_string(s_->size));
    if (tag < 0 || tag > s_->tag_ub)
      throw error(errc::invalid_argument, std::string(what) + ": tag " + std::to_string(tag) + " outside [0, MPI_TAG_UB = " +
                                              std::to_string(s_->tag_ub) + "]");
  }

  std::string where(const char* call, bool send, int peer, int tag, std::size_t bytes) const {
    return std::string(call) + (send ? " to rank " : " from rank ") + std::to_string(peer) + " (tag " + std::to_string(tag) +
           ", " + std::to_string(bytes) + " bytes, on rank " + std::to_string(s_->rank) + ")";
  }

  error truncation(const detail::op& o) const {
    return error(errc::transport, "message from rank " + std::to_string(o.peer) + " to rank " + std::to_string(s_->rank) +
                                      " with tag " + std::to_string(o.tag) + " was larger than the receive buffer of " +
                                      std::to_string(o.size) + " bytes");
  }

  void test_send(detail::op& o) {
    int flag = 0;
    detail::check(MPI_Testall(static_cast<int>(o.reqs.size()), o.reqs.data(), &flag, MPI_STATUSES_IGNORE),
                  [&] { return where("MPI_Testall", true, o.peer, o.tag, o.size); });
    if (flag) finish_send(o);
  }
  void finish_send(detail::op& o) {
    o.complete = true;
    o.received = o.size;
    if (s_->progress.joinable()) --s_->sends_pending;
  }

  /// Tests the first (or only) piece of a receive.
  void test_first(detail::op& o) {
    if (o.first_done) return;
    int flag = 0;
    MPI_Status st;
    // Needs MPI_ERRORS_RETURN on the communicator to see a truncation here (Boost.MPI's
    // environment sets it on MPI_COMM_WORLD; duplicates inherit it); with
    // MPI_ERRORS_ARE_FATAL, MPI aborts the job instead.
    int rc = MPI_Test(&o.reqs[0], &flag, &st);
    if (rc != MPI_SUCCESS) {
      int cls = 0;
      MPI_Error_class(rc, &cls);
      if (cls == MPI_ERR_TRUNCATE) {
        o.first_done = o.complete = o.truncated = true;
        return;
      }
      detail::check(rc, [&] { return where("MPI_Test", false, o.peer, o.tag, o.size); });
    }
    if (!flag) return;
    first_completed(o, st);
  }

  /// Records a receive's first piece completing with status `st`: cancelled, complete, or
  /// (a full chunk of a message that may be split) waiting for its continuations.
  void first_completed(detail::op& o, const MPI_Status& st) {
    o.first_done = true;
    int cancelled = 0;
    MPI_Test_cancelled(&st, &cancelled);
    if (cancelled) {
      o.complete = o.cancelled = true;  // never matched: it holds no place in the split queue order
      return;
    }
    o.received = received_bytes(o, st);
    if (o.may_split && o.received == s_->chunk) o.draining = true;
    else o.complete = true;
  }

  /// Advances the receives that may split on (source, tag), oldest first: a later one
  /// may only take continuations after every earlier one has taken all of its own.
  void drain(int source, int tag) {
    auto it = s_->splitq.find({source, tag});
    if (it == s_->splitq.end()) return;
    auto& q = it->second;
    while (!q.empty()) {
      auto& o = *q.front();
      if (!o.complete) {
        test_first(o);
        if (o.draining) pull_continuations(o);
      }
      if (!o.complete) break;
      q.pop_front();
    }
    if (q.empty()) s_->splitq.erase(it);
  }

  void pull_continuations(detail::op& o) {
    auto& s = *s_;
    for (;;) {
      if (o.cont != MPI_REQUEST_NULL) {
        int flag = 0;
        MPI_Status st;
        detail::check(MPI_Test(&o.cont, &flag, &st), [&] { return where("MPI_Test (continuation)", false, o.peer, o.tag, o.size); });
        if (!flag) return;
        if (o.overflow.empty()) o.received += o.cont_len;
        if (o.cont_len < s.chunk) {  // the last piece
          o.draining = false;
          o.complete = true;
          return;
        }
        continue;
      }
      int flag = 0;
      MPI_Message msg = MPI_MESSAGE_NULL;
      MPI_Status st;
      detail::check(MPI_Improbe(o.peer, o.tag, s.shadow, &flag, &msg, &st),
                    [&] { return where("MPI_Improbe (continuation)", false, o.peer, o.tag, o.size); });
      if (!flag) return;
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      o.cont_len = static_cast<std::size_t>(count);
      std::byte* to = nullptr;
      if (!o.truncated && o.received + o.cont_len <= o.size) {
        to = o.buf + o.received;
      } else {  // larger than the buffer: drain it anyway, so the stream stays in step
        o.truncated = true;
        o.overflow.assign(std::max<std::size_t>(o.cont_len, 1), std::byte{0});
        to = o.overflow.data();
      }
      detail::check(MPI_Imrecv(to, count, MPI_BYTE, &msg, &o.cont), [&] { return where("MPI_Imrecv (continuation)", false, o.peer, o.tag, o.size); });
    }
  }

  void cancel_recv(detail::op& o) {
    if (!o.first_done) {
      MPI_Cancel(&o.reqs[0]);
      MPI_Status st;
      MPI_Wait(&o.reqs[0], &st);
      first_completed(o, st);
    }
    if (o.complete) return;
    // It matched a split message: its continuations are on their way (a sender never
    // withdraws them once the first piece matched). Take them, in queue order, so that
    // the bytes stop landing before cancel returns and later receives stay in step.
    unsigned spins = 0;
    while (!o.complete) {
      drain(o.peer, o.tag);
      if (!o.complete) backoff(spins);
    }
    o.cancelled = true;
  }

  /// Bytes a completed receive got: counted in its own datatype (a scattered receive's
  /// hindexed type, freed then) as MPI requires, else in bytes.
  static std::size_t received_bytes(detail::op& o, const MPI_Status& st) {
    if (o.type == MPI_DATATYPE_NULL) {
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      return static_cast<std::size_t>(count);
    }
    MPI_Count elements = 0;  // the type's basic elements are bytes
    MPI_Get_elements_x(&st, o.type, &elements);
    o.free_type();
    return elements == MPI_UNDEFINED ? 0 : static_cast<std::size_t>(elements);
  }

  /// A staged scattered receive completed (not cancelled, not truncated): its bytes go where
  /// the caller asked, once.
  static void scatter_staged(detail::op& o) {
    if (o.scatter_to.empty() || !o.complete || o.cancelled || o.truncated) return;
    std::size_t at = 0;
    for (auto to : o.scatter_to) {
      const auto n = std::min(to.size(), o.received - std::min(o.received, at));
      if (n) std::memcpy(to.data(), o.staging.data() + at, n);
      at += to.size();
    }
    o.scatter_to.clear();
  }

  void cancel_send(const detail::op_ptr& p) {
    auto& o = *p;
    // Withdraw the first piece; only if that worked may the continuations go too (the
    // receiver then never saw the message). Otherwise the message is delivered whole.
    bool first_withdrawn = false;
    if (o.reqs[0] != MPI_REQUEST_NULL) {
      MPI_Cancel(&o.reqs[0]);
      MPI_Status st;
      if (settle(o.reqs[0], &st)) {
        int c = 0;
        MPI_Test_cancelled(&st, &c);
        first_withdrawn = c != 0;
      }
    }
    bool all = o.reqs[0] == MPI_REQUEST_NULL;
    for (std::size_t i = 1; i < o.reqs.size() && all; ++i) {
      if (o.reqs[i] == MPI_REQUEST_NULL) continue;
      if (first_withdrawn) MPI_Cancel(&o.reqs[i]);
      all = settle(o.reqs[i], nullptr);
    }
    if (all) {
      finish_send(o);
      o.cancelled = true;
      return;
    }
    // MPI could not withdraw it (Open MPI never cancels sends): park it.
    o.cancelled = true;
    o.complete = true;  // for the caller it is over; the communicator keeps testing it
    if (s_->progress.joinable()) --s_->sends_pending;
    s_->parked.push_back(p);
  }

  /// Tests `r` until it completes or `grace` passes; true if it completed.
  bool settle(MPI_Request& r, MPI_Status* st) {
    auto deadline = std::chrono::steady_clock::now() + s_->grace;
    unsigned spins = 0;
    for (;;) {
      int flag = 0;
      MPI_Status tmp;
      MPI_Test(&r, &flag, st ? st : &tmp);
      if (flag) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      backoff(spins);
    }
  }

  void reap_parked() {
    auto& v = s_->parked;
    if (v.empty()) return;
    std::erase_if(v, [](const detail::op_ptr& p) {
      int flag = 0;
      MPI_Testall(static_cast<int>(p->reqs.size()), p->reqs.data(), &flag, MPI_STATUSES_IGNORE);
      return flag != 0;
    });
  }

  std::shared_ptr<detail::shared> s_;
};

static_assert(point_to_point_communicator<communicator>);
static_assert(tag_bounded_communicator<communicator>);
static_assert(gathering_communicator<communicator>);
static_assert(collective_communicator<communicator>);

/// The "clone job started later" path, parent side: the N source ranks of `sources` (a
/// communicator holding exactly the sources, e.g. MPI_COMM_WORLD of the training job)
/// collectively start `clones` processes of `command` with `args` through MPI_Comm_spawn,
/// and return the merged intra-communicator: sources are ranks [0, N), clone ranks
/// [N, N + clones). Blocks the sources for the spawn itself (process start-up).
/// `oversubscribe` lets the spawned ranks share cores with the sources (single machine).
inline MPI_Comm spawn_clones(MPI_Comm sources, const std::string& command, std::vector<std::string> args, int clones,
                             bool oversubscribe = false, int root = 0) {
  detail::require_initialized("deepclone::mpi::spawn_clones");
  if (clones <= 0) throw error(errc::invalid_argument, "spawn_clones: need at least one clone rank");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  MPI_Info info = MPI_INFO_NULL;
  if (oversubscribe) {
    MPI_Info_create(&info);
    MPI_Info_set(info, "map_by", ":OVERSUBSCRIBE");
  }
  MPI_Comm inter = MPI_COMM_NULL;
  std::vector<int> codes(static_cast<std::size_t>(clones), MPI_SUCCESS);
  int rc = MPI_Comm_spawn(command.c_str(), argv.data(), clones, info, root, sources, &inter, codes.data());
  if (info != MPI_INFO_NULL) MPI_Info_free(&info);
  detail::check(rc, "MPI_Comm_spawn of " + std::to_string(clones) + " x '" + command + "'");
  for (int c : codes) detail::check(c, "MPI_Comm_spawn: a clone process failed to start");
  MPI_Comm merged = MPI_COMM_NULL;
  detail::check(MPI_Intercomm_merge(inter, /*high=*/0, &merged), "MPI_Intercomm_merge (sources)");
  MPI_Comm_free(&inter);
  return merged;
}

/// The child side of `spawn_clones`: in a process started by it, returns the merged
/// intra-communicator (this process's rank is N + its rank among the clones); returns
/// MPI_COMM_NULL in a process that was not spawned.
inline MPI_Comm join_spawned() {
  detail::require_initialized("deepclone::mpi::join_spawned");
  MPI_Comm parent = MPI_COMM_NULL;
  detail::check(MPI_Comm_get_parent(&parent), "MPI_Comm_get_parent");
  if (parent == MPI_COMM_NULL) return MPI_COMM_NULL;
  MPI_Comm merged = MPI_COMM_NULL;
  detail::check(MPI_Intercomm_merge(parent, /*high=*/1, &merged), "MPI_Intercomm_merge (clones)");
  return merged;  // the parent inter-communicator stays valid (MPI owns it)
}

}  // namespace deepclone::mpi
