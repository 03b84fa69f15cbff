#pragma once
/// \file detail/partition_handshake.hpp
/// Before any byte of a partitioned transfer moves, each clone rank proves to every source
/// that both planned the same transfer (issue 12, item 2): its *hello* carries the
/// fingerprints of its global declaration (layers, names, dtypes, global shapes:
/// partition_declaration.hpp) and of the groups it computed from everyone's holdings. A
/// source sends a clone rank nothing until that clone rank's hello matched its own plan; on a
/// difference it answers with a *refusal* (errc::layout_mismatch carrying the source's
/// declaration, from which the clone rank names the first differing tensor; errc::
/// plan_mismatch for other holdings or group options; errc::corrupt_message for a hello it
/// cannot read), serves that clone rank nothing, and trains on.
///
/// partition_engine's clone ranks also send a *request hello* with their fork request,
/// naming that request (`request_hellos`): a source that holds, when the fork is decided,
/// the request hello of every request the fork answers sends at once to the clone ranks whose
/// plan matched, before their hello on the fork's tags comes (a round trip later, taken only
/// at the source's next hook). That hello is still judged when it comes.

#include <algorithm>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../communicator.hpp"
#include "../error.hpp"
#include "../partition_declaration.hpp"
#include "../partition_groups.hpp"
#include "../roles.hpp"
#include "bytes.hpp"
#include "outbox.hpp"
#include "wire.hpp"

namespace deepclone::detail {

/// FNV-1a of every group (layer, source, clone rank, each message's flags and runs): ranks
/// that made the same plan with the same group options have the same fingerprint.
inline std::uint64_t groups_fingerprint(const partition_groups& groups) {
  writer w;
  for (const auto* list : {&groups.groups(), &groups.forwards()}) {
    w.u32(static_cast<std::uint32_t>(list->size()));
    for (const auto& g : *list) {
      w.u32(g.layer), w.u32(g.source), w.u32(g.clone), w.u32(static_cast<std::uint32_t>(g.messages.size()));
      for (const auto& m : g.messages) {
        w.u8(m.packed ? 1 : 0), w.u8(m.gather ? 1 : 0), w.u32(static_cast<std::uint32_t>(m.runs.size()));
        for (const auto& r : m.runs) w.u32(r.tensor), w.u64(r.global), w.u64(r.length), w.u64(r.source_offset), w.u64(r.clone_offset);
      }
    }
  }
  return fnv1a(w.buffer());
}

/// A clone rank's first message to every source: small (an eager send on any transport), so
/// it reaches the source even if the clone rank gives up at once.
struct partition_hello {
  static constexpr std::uint32_t magic = 0x50484C32;  // "PHL2"
  std::uint32_t clone = 0;
  std::uint64_t plan = 0;         ///< groups_fingerprint of the clone rank's groups
  std::uint64_t declaration = 0;  ///< global_declaration::fingerprint()

  static constexpr std::size_t size = 4 + 4 + 8 + 8 + 8;
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic), w.u32(clone), w.u64(plan), w.u64(declaration);
    return seal(w);
  }
  static partition_hello decode(std::span<const std::byte> b) {
    reader r(unseal(b, "partition hello"), "partition hello");
    if (r.u32() != magic) r.fail("bad magic word");
    partition_hello h;
    h.clone = r.u32(), h.plan = r.u64(), h.declaration = r.u64();
    r.expect_end();
    return h;
  }
};

/// A source's answer to a hello that does not match: why, as the error the clone rank throws.
/// A layout mismatch carries the source's declaration, from which the clone rank names the
/// first difference.
struct partition_refusal {
  static constexpr std::uint32_t magic = 0x50524632;  // "PRF2"
  static constexpr std::size_t max_text = 2000;
  std::uint32_t source = 0;
  errc code = errc::layout_mismatch;
  std::string text;
  std::uint64_t plan = 0;               ///< the refused hello's plan fingerprint (0: unreadable hello)
  std::vector<std::byte> declaration;   ///< layout_mismatch: the source's global_declaration::encode()

  /// The largest refusal a clone rank takes: room for a declaration up to twice its own.
  static std::size_t max_size(std::size_t own_declaration) { return max_text + 2 * own_declaration + 4096; }
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic), w.u32(source), w.u32(static_cast<std::uint32_t>(code)), w.str(text.substr(0, max_text)), w.u64(plan), w.bytes(declaration);
    return seal(w);
  }
  static partition_refusal decode(std::span<const std::byte> b) {
    reader r(unseal(b, "partition refusal"), "partition refusal");
    if (r.u32() != magic) r.fail("bad magic word");
    partition_refusal f;
    f.source = r.u32();
    const auto code = r.u32();
    if (code != static_cast<std::uint32_t>(errc::layout_mismatch) && code != static_cast<std::uint32_t>(errc::plan_mismatch) &&
        code != static_cast<std::uint32_t>(errc::corrupt_message))
      r.fail("unknown refusal code " + std::to_string(code));
    f.code = static_cast<errc>(code);
    f.text = r.str();
    f.plan = r.u64();
    const auto d = r.bytes();
    f.declaration.assign(d.begin(), d.end());
    r.expect_end();
    return f;
  }
  /// The error clone rank `who` throws for it: a layout mismatch names the first difference
  /// between the source's declaration and `own`.
  error as_error(const global_declaration& own, const std::string& who) const {
    std::string why = text;
    if (code == errc::layout_mismatch) {
      try {
        if (auto d = first_difference(global_declaration::decode(declaration), own, who)) why = "partitioned state: " + *d;
      } catch (const error&) {  // an unreadable declaration: the source's own words stand
      }
      why += " (the global shapes and dtypes must agree)";
    }
    return error(code, why + " (refused by source " + std::to_string(source) + ")");
  }
};

/// What a source holds to judge hellos by: its own declaration and plan fingerprint.
struct handshake_terms {
  std::vector<std::byte> declaration;  ///< global_declaration::of(global).encode()
  std::uint64_t declaration_fingerprint = 0, plan = 0;
  static handshake_terms of(const layout& global, const partition_groups& groups) {
    const auto d = global_declaration::of(global);
    return {d.encode(), d.fingerprint(), groups_fingerprint(groups)};
  }
};

/// Source `source`'s verdict on hello `h` of clone rank `clone`: nullopt when it matches
/// `own`, else the refusal to send back.
inline std::optional<partition_refusal> judge_hello(const partition_hello& h, std::uint32_t clone, const handshake_terms& own,
                                                    std::uint32_t source) {
  const std::string who = "clone rank " + std::to_string(clone);
  if (h.clone != clone)
    return partition_refusal{source, errc::corrupt_message, who + " sent the hello of clone rank " + std::to_string(h.clone), h.plan, {}};
  if (h.declaration != own.declaration_fingerprint)
    return partition_refusal{source, errc::layout_mismatch, who + " declares another global layout", h.plan, own.declaration};
  if (h.plan != own.plan)
    return partition_refusal{source, errc::plan_mismatch,
                             "partitioned state: source " + std::to_string(source) + " and " + who +
                                 " planned different transfers (plan fingerprints differ): every rank must pass the same holdings "
                                 "of every source and clone rank, and the same group options and alignment",
                             h.plan, {}};
  return std::nullopt;
}
/// As above, for `bytes`, the first message of clone rank `clone` (a refusal where it is no
/// hello). Never throws for what the clone rank sent.
inline std::optional<partition_refusal> judge_hello(std::span<const std::byte> bytes, std::uint32_t clone, const handshake_terms& own,
                                                    std::uint32_t source) {
  try {
    return judge_hello(partition_hello::decode(bytes), clone, own, source);
  } catch (const error& e) {
    return partition_refusal{source, errc::corrupt_message, "clone rank " + std::to_string(clone) + "'s first message is not a hello: " + e.details(), 0, {}};
  }
}

/// A clone rank's hello sent with its fork request, naming the request (request_msg::nonce).
struct request_hello {
  static constexpr std::uint32_t magic = 0x50524831;  // "PRH1"
  std::uint64_t nonce = 0;
  partition_hello hello;

  static constexpr std::size_t size = 4 + 8 + 4 + 8 + 8 + 8;
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic), w.u64(nonce), w.u32(hello.clone), w.u64(hello.plan), w.u64(hello.declaration);
    return seal(w);
  }
  static request_hello decode(std::span<const std::byte> b) {
    reader r(unseal(b, "request hello"), "request hello");
    if (r.u32() != magic) r.fail("bad magic word");
    request_hello h;
    h.nonce = r.u64(), h.hello.clone = r.u32(), h.hello.plan = r.u64(), h.hello.declaration = r.u64();
    r.expect_end();
    return h;
  }
};

/// A source's record of each clone rank's latest request hello: whether it matched this
/// source's plan, and which request it named. Garbage is dropped (and forgets that clone
/// rank's record). At most `max_per_poll` messages per clone rank and call.
template <class Comm>
class request_hellos {
 public:
  static constexpr int max_per_poll = 64;
  request_hellos(Comm& c, const std::vector<int>& clone_ranks, int tag, handshake_terms terms)
      : comm_(c), terms_(std::move(terms)), latest_(clone_ranks.size()) {
    for (auto rank : clone_ranks) slots_.emplace_back().post(comm_, rank, tag, request_hello::size + 64);
  }
  request_hellos(const request_hellos&) = delete;
  request_hellos& operator=(const request_hellos&) = delete;
  ~request_hellos() { cancel(); }

  void poll() {
    for (std::uint32_t c = 0; c < slots_.size(); ++c)
      for (int taken = 0; taken < max_per_poll; ++taken) {
        auto b = slots_[c].test(comm_);
        if (!b) break;
        latest_[c].reset();
        try {
          const auto h = request_hello::decode(*b);
          latest_[c] = record{h.nonce, !judge_hello(h.hello, c, terms_, 0)};
        } catch (const error&) {  // garbage: no record
        }
        slots_[c].repost(comm_);
      }
  }
  /// The clone ranks a fork answering the requests that digest to `digest`
  /// (requests_digest) may be sent to at once: those whose request hello matched, when this
  /// source holds the request hello of every request the fork answers; else none.
  std::vector<std::uint32_t> admitted_for(std::uint64_t digest) {
    poll();
    std::vector<std::uint64_t> nonces;
    std::vector<std::uint32_t> matched;
    for (std::uint32_t c = 0; c < latest_.size(); ++c) {
      if (!latest_[c]) return {};
      nonces.push_back(latest_[c]->nonce);
      if (latest_[c]->matches) matched.push_back(c);
    }
    return requests_digest(nonces) == digest ? matched : std::vector<std::uint32_t>{};
  }
  void cancel() noexcept {
    for (auto& s : slots_) s.cancel(comm_);
  }

 private:
  struct record {
    std::uint64_t nonce = 0;
    bool matches = false;
  };
  Comm& comm_;
  handshake_terms terms_;
  std::vector<std::optional<record>> latest_;
  std::deque<inbox_slot<Comm>> slots_;  // a deque: posted buffers must not move
};

/// A source's messages from the clone ranks, one receive per clone rank on the control tag:
/// each clone rank's hello first (judged against this source's plan, a refusal sent back on a
/// difference), then its acknowledgements and failover notices. Every clone rank sends every
/// source a hello, and a source is done only once it judged them all, so that no hello is left
/// unreceived for a later transfer on the same tags. At most `max_per_poll` messages per clone
/// rank and call, so a clone rank that floods cannot hold the trainer.
template <class Comm>
class source_inbox {
 public:
  static constexpr int max_per_poll = 64;
  source_inbox(Comm& c, const roles& ranks, const layout& global, const partition_groups& groups, std::uint32_t source, int control_tag,
               int reply_tag, std::size_t notice_bytes)
      : comm_(c), clone_ranks_(ranks.clones), terms_(handshake_terms::of(global, groups)), source_(source), reply_tag_(reply_tag),
        state_(clone_ranks_.size(), state::waiting) {
    const auto bytes = std::max(partition_hello::size + 64, notice_bytes);
    for (auto rank : clone_ranks_) slots_.emplace_back().post(comm_, rank, control_tag, bytes);
  }
  source_inbox(const source_inbox&) = delete;
  source_inbox& operator=(const source_inbox&) = delete;
  ~source_inbox() { cancel(); }

  /// Takes the messages that arrived: `judged(c)` once clone rank c's hello was judged (see
  /// admitted()), `notice(c, bytes)` for each later message of an admitted clone rank. Before
  /// its hello, a message `leftover(bytes)` names (one an earlier transfer on the same tags
  /// left queued, such as a notice to a source that had given up) is dropped, not judged.
  template <class Judged, class Notice, class Leftover>
  void poll(Judged judged, Notice notice, Leftover leftover) {
    for (std::uint32_t c = 0; c < slots_.size(); ++c)
      for (int taken = 0; taken < max_per_poll; ++taken) {
        auto b = slots_[c].test(comm_);
        if (!b) break;
        const std::vector<std::byte> message(b->begin(), b->end());
        slots_[c].repost(comm_);  // first: whatever the callbacks throw, the next message is awaited
        const bool awaited = state_[c] == state::waiting || state_[c] == state::presumed;  // its hello is still to come
        if (awaited && leftover(std::span<const std::byte>(message))) continue;
        if (awaited) admit(c, message), judged(c);
        else if (state_[c] == state::admitted) notice(c, message);
      }
  }
  /// True once every clone rank's hello was judged (a refusal's send is not waited for: the
  /// refused clone rank may have given up already).
  bool settled() const {
    for (auto st : state_)
      if (st == state::waiting || st == state::presumed) return false;
    return true;
  }
  /// Clone rank `c`'s hello matched this source's plan, or is presumed to: it may be sent to.
  bool admitted(std::uint32_t c) const { return state_.at(c) == state::admitted || state_.at(c) == state::presumed; }
  /// Clone rank `c`'s plan is known to match (its request hello did): it may be sent to
  /// before its hello comes, which is still judged then.
  void presume(std::uint32_t c) {
    if (state_.at(c) == state::waiting) state_[c] = state::presumed;
  }
  /// Clone rank `c`'s hello did not match (it was told why): it is served nothing.
  bool refused(std::uint32_t c) const { return state_.at(c) == state::refused; }
  void cancel() noexcept {
    for (auto& s : slots_) s.cancel(comm_);
    replies_.cancel_all(comm_);
  }

 private:
  enum class state : char { waiting, presumed, admitted, refused };
  void admit(std::uint32_t c, std::span<const std::byte> b) {
    auto refusal = judge_hello(b, c, terms_, source_);
    state_[c] = refusal ? state::refused : state::admitted;
    if (!refusal) return;
    auto bytes = refusal->encode();
    if (bytes.size() > max_eager_refusal) {  // keep it eager: it must arrive even if this source is gone at once
      refusal->declaration.clear();
      refusal->text += " (the sources' declaration, " + std::to_string(terms_.declaration.size()) + " bytes, is too large to attach)";
      bytes = refusal->encode();
    }
    replies_.send_owned(comm_, clone_ranks_[c], reply_tag_, std::move(bytes));
  }
  /// Below the smallest eager limit of the transports here (4 KiB: inproc, Open MPI's shared
  /// memory), so a refusal is delivered when sent, whatever the source does next.
  static constexpr std::size_t max_eager_refusal = 3584;

  Comm& comm_;
  std::vector<int> clone_ranks_;
  handshake_terms terms_;
  std::uint32_t source_;
  int reply_tag_;
  std::vector<state> state_;
  std::deque<inbox_slot<Comm>> slots_;  // a deque: posted buffers must not move
  outbox<Comm> replies_;
};

/// A clone rank's side of the handshake: its hello to every source, and a receive per source
/// for a refusal.
template <class Comm>
class clone_handshake {
 public:
  clone_handshake(Comm& c, const roles& ranks, const layout& global, const partition_groups& groups, std::uint32_t clone, int control_tag,
                  int reply_tag)
      : comm_(c), clone_(clone), plan_(groups_fingerprint(groups)), declaration_(global_declaration::of(global)) {
    const auto hello = partition_hello{clone, plan_, declaration_.fingerprint()}.encode();
    const auto room = partition_refusal::max_size(declaration_.encode().size());
    for (auto rank : ranks.sources) slots_.emplace_back().post(comm_, rank, reply_tag, room);  // before any hello
    for (auto rank : ranks.sources) hellos_.send_owned(comm_, rank, control_tag, hello);
  }
  clone_handshake(const clone_handshake&) = delete;
  clone_handshake& operator=(const clone_handshake&) = delete;
  ~clone_handshake() { cancel(); }

  /// Throws the refusal a source sent, as its error (layout_mismatch naming the first
  /// difference, plan_mismatch or corrupt_message); a message that is no refusal, or the
  /// refusal of another plan's hello, is dropped (plan 0: a hello the source could not read).
  /// A message too large to receive here can only be a refusal carrying a declaration far
  /// larger than this rank's: a layout mismatch too.
  void check() {
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      auto b = slots_[s].test(comm_);
      if (!b) continue;
      if (b->empty())
        throw error(errc::layout_mismatch, "partitioned state: source " + std::to_string(s) + " refused clone rank " + std::to_string(clone_) +
                                               " with a global layout far larger than this rank's");
      std::optional<partition_refusal> f;
      try {
        f = partition_refusal::decode(*b);
      } catch (const error&) {
      }
      if (!f || (f->plan != plan_ && f->plan != 0)) {  // garbage, or the refusal of another transfer's hello
        slots_[s].repost(comm_);
        continue;
      }
      throw f->as_error(declaration_, "clone rank " + std::to_string(clone_));
    }
  }
  void cancel() noexcept {
    for (auto& s : slots_) s.cancel(comm_);
    hellos_.cancel_all(comm_);
  }

 private:
  Comm& comm_;
  std::uint32_t clone_;
  std::uint64_t plan_;
  global_declaration declaration_;
  outbox<Comm> hellos_;
  std::deque<inbox_slot<Comm>> slots_;  // per source (a deque: posted buffers must not move)
};

}  // namespace deepclone::detail
