#pragma once
/// \file detail/wire.hpp
/// The messages deepclone sends and their tags. Every message starts with a magic word
/// and names its session; data-carrying messages are described by a group header that
/// names each piece (tensor, byte range), the session, the iteration and a checksum.
/// Tensor bytes themselves travel bare, straight from source tensors into clone tensors.

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../communicator.hpp"
#include "../error.hpp"
#include "../plan.hpp"
#include "bytes.hpp"

namespace deepclone::detail {

inline constexpr std::uint32_t magic = 0x444C4E32;  // "DLN2"

/// Control tags relative to `settings::tag_base`. Every message on them is sealed (see
/// `seal`) and names its session or the request it answers, so a stale one is recognised
/// and skipped, never taken for the current one.
enum tag : int {
  tag_request = 0,      ///< clone -> coordinator source: a request, or its withdrawal
  tag_decision = 1,     ///< coordinator -> sources and clones
  tag_layout = 2,       ///< coordinator -> clone, with a refusal: the sources' layout
  tag_status = 5,       ///< source -> clone: done (with statistics) or failed (with reason)
  tag_summary = 6,      ///< clone -> clone: per-rank figures for the report
  tag_cancel = 7,       ///< clone -> sources: stop serving this session
  tag_ack = 8,          ///< clone -> sources: these layers are verified (the window may close)
  tag_refetch = 9,      ///< clone -> a source: send this group again (failover, corruption)
  tag_hello = 10,       ///< partitioned clone -> every source: its plan, with its request (request_hello)
  tag_digest = 12,      ///< source -> clone: the digest of its whole replica at iteration k
  tag_epochs = 16,      ///< then the sessions' tag blocks (session_tags)
};

/// The tags of one session's bulk messages. Tensor bytes travel bare (zero copy), so they
/// cannot name their session; instead consecutive sessions use different blocks of tags
/// (epochs): a message an abandoned session left queued on the transport (MPI keeps
/// unexpected eager messages, and Open MPI cannot cancel sends) can only meet the receives
/// of a session `epochs` sessions later, where verification still catches it. Block layout:
/// 4 tags per layer (data, header, exchange data, exchange header), then the metadata
/// header, the metadata, a refetch's data and a refetch's header.
struct session_tags {
  int base = 0;
  std::size_t layers = 0;
  std::uint32_t epoch = 0;
  static long long block_size(std::size_t layers) { return 4LL * static_cast<long long>(layers) + 4; }
  int at(long long offset) const {
    return static_cast<int>(base + tag_epochs + static_cast<long long>(epoch) * block_size(layers) + offset);
  }
  int layer(std::size_t l, bool exchange, bool header) const {
    return at(4LL * static_cast<long long>(l) + (exchange ? 2 : 0) + (header ? 1 : 0));
  }
  int meta_header() const { return at(4LL * static_cast<long long>(layers)); }
  int meta() const { return at(4LL * static_cast<long long>(layers) + 1); }
  int refetch_data() const { return at(4LL * static_cast<long long>(layers) + 2); }
  int refetch_header() const { return at(4LL * static_cast<long long>(layers) + 3); }
};

/// How many session tag blocks fit between `base` and the transport's tag bound, at most
/// `wanted`. Throws `errc::invalid_argument` for a negative base and `errc::unsupported`
/// when not even one block fits.
template <class Comm>
std::uint32_t epochs_that_fit(const Comm& c, int base, std::size_t layers, std::uint32_t wanted) {
  if (base < 0) throw error(errc::invalid_argument, "settings.tag_base is " + std::to_string(base) + "; tags must not be negative");
  const long long bound = max_tag_of(c), first = static_cast<long long>(base) + tag_epochs, block = session_tags::block_size(layers);
  const long long fit = bound >= first ? (bound - first + 1) / block : 0;
  if (fit < 1)
    throw error(errc::unsupported, std::to_string(layers) + " layers need message tags up to " + std::to_string(first + block - 1) +
                                       " from tag_base " + std::to_string(base) + ", but the communicator allows tags up to " +
                                       std::to_string(bound) + "; lower settings.tag_base or group layers");
  return static_cast<std::uint32_t>(std::min<long long>(fit, std::max<std::uint32_t>(wanted, 1)));
}

using deepclone::failure;

/// Fixed receive-buffer size of the small control messages (all fit, with room to spare;
/// a larger one is a peer's garbage and is dropped).
inline constexpr std::size_t control_bytes = 1024;
/// Largest layout message a refused clone accepts (its length comes from the wire).
inline constexpr std::uint64_t max_layout_bytes = 64u << 20;

inline void check_magic(reader& r) {
  if (r.u32() != magic) r.fail("bad magic word (not a deepclone message, or corrupt)");
}

/// Options a clone asks of the sources; the coordinator passes on the union of every clone
/// rank's options in its decision.
enum request_flag : std::uint32_t {
  flag_verify_replicas = 1,  ///< every source sends the digest of its whole replica (tag_digest)
  flag_withdraw = 2,         ///< not a request: the clone withdraws its request `nonce`
};
inline constexpr std::uint32_t known_flags = flag_verify_replicas | flag_withdraw;

struct request_msg {
  std::uint32_t clone_index = 0;
  std::uint64_t nonce = 0;  ///< unique per request; the decision that answers it echoes it
  std::uint64_t layout_fingerprint = 0;
  plan_key key;
  std::uint32_t flags = 0;
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic); w.u32(clone_index); w.u64(nonce); w.u64(layout_fingerprint);
    key.encode(w);
    w.u32(flags);
    return seal(w);
  }
  static request_msg decode(std::span<const std::byte> b) {
    reader r(unseal(b, "clone request"), "clone request");
    check_magic(r);
    request_msg m;
    m.clone_index = r.u32(); m.nonce = r.u64(); m.layout_fingerprint = r.u64();
    m.key = plan_key::decode(r);
    m.flags = r.u32();
    if (m.flags & ~known_flags) r.fail("unknown request flags " + std::to_string(m.flags));
    r.expect_end();
    return m;
  }
};

enum class verdict : std::uint32_t { accepted = 1, layout_differs = 2, plan_differs = 3, stopped = 4 };

/// The nonces of the requests a fork answers, in clone order, as one word: a source holding
/// a message that names each request (partition_engine's request_hello) can tell whether
/// those are the requests the fork answers, not earlier ones.
inline std::uint64_t requests_digest(std::span<const std::uint64_t> nonces) {
  writer w;
  for (auto n : nonces) w.u64(n);
  return fnv1a(w.buffer());
}

struct decision_msg {
  verdict status = verdict::accepted;
  std::uint64_t session = 0;
  std::uint64_t iteration = 0;
  std::uint32_t epoch = 0;         ///< the session's tag block (session_tags)
  std::uint64_t nonce = 0;         ///< to a clone: the request it answers; to a source: requests_digest of those accepted
  std::uint64_t layout_bytes = 0;  ///< size of the layout message that follows a refusal
  std::uint32_t offending_clone = 0;
  plan_key key;  ///< the sources' key
  std::uint32_t flags = 0;  ///< the union of the clone ranks' request flags
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic); w.u32(static_cast<std::uint32_t>(status)); w.u64(session); w.u64(iteration); w.u32(epoch);
    w.u64(nonce); w.u64(layout_bytes); w.u32(offending_clone);
    key.encode(w);
    w.u32(flags);
    return seal(w);
  }
  static decision_msg decode(std::span<const std::byte> b) {
    reader r(unseal(b, "fork decision"), "fork decision");
    check_magic(r);
    decision_msg m;
    auto s = r.u32();
    if (s < 1 || s > 4) r.fail("unknown verdict " + std::to_string(s));
    m.status = static_cast<verdict>(s);
    m.session = r.u64(); m.iteration = r.u64(); m.epoch = r.u32();
    m.nonce = r.u64(); m.layout_bytes = r.u64(); m.offending_clone = r.u32();
    m.key = plan_key::decode(r);
    m.flags = r.u32();
    if (m.flags & ~known_flags) r.fail("unknown decision flags " + std::to_string(m.flags));
    if (m.layout_bytes > max_layout_bytes) r.fail("layout length " + std::to_string(m.layout_bytes) + " exceeds the limit");
    r.expect_end();
    return m;
  }
};

/// The sources' layout, sent with a refusal so that the clone can name the difference.
struct layout_msg {
  std::uint64_t nonce = 0;  ///< the request it answers
  std::vector<std::byte> layout;
  static std::size_t size_for(std::uint64_t layout_bytes) { return static_cast<std::size_t>(4 + 8 + 8 + layout_bytes + 8); }
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic); w.u64(nonce); w.bytes(layout);
    return seal(w);
  }
  static layout_msg decode(std::span<const std::byte> b) {
    reader r(unseal(b, "layout message"), "layout message");
    check_magic(r);
    layout_msg m;
    m.nonce = r.u64();
    auto l = r.bytes();
    m.layout.assign(l.begin(), l.end());
    r.expect_end();
    return m;
  }
};

/// One entry of a group header.
struct piece_check {
  std::uint32_t tensor;
  std::uint64_t offset, length, checksum;
};

/// Why a source serves a refetched group without its pieces.
enum class refusal : std::uint32_t {
  none = 0,
  released = 1,  ///< the layer is already being overwritten with iteration k + 1
  changed = 2,   ///< `refused_tensor` no longer holds what it held at k: written outside its hooks
};

struct group_header {
  std::uint64_t session = 0, iteration = 0;
  std::uint32_t layer = 0, from = 0;
  refusal refused = refusal::none;  ///< refetch headers only
  std::uint32_t refused_tensor = 0;
  std::vector<piece_check> pieces;
  static std::size_t size_for(std::size_t n) { return 4 + 8 + 8 + 4 + 4 + 4 + 4 + 4 + n * 28 + 8; }
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic); w.u64(session); w.u64(iteration); w.u32(layer); w.u32(from);
    w.u32(static_cast<std::uint32_t>(refused)); w.u32(refused_tensor);
    w.u32(static_cast<std::uint32_t>(pieces.size()));
    for (auto& p : pieces) { w.u32(p.tensor); w.u64(p.offset); w.u64(p.length); w.u64(p.checksum); }
    return seal(w);
  }
  static group_header decode(std::span<const std::byte> b) {
    reader r(unseal(b, "group header"), "group header");
    check_magic(r);
    group_header h;
    h.session = r.u64(); h.iteration = r.u64(); h.layer = r.u32(); h.from = r.u32();
    auto why = r.u32();
    if (why > 2) r.fail("unknown refusal " + std::to_string(why));
    h.refused = static_cast<refusal>(why);
    h.refused_tensor = r.u32();
    auto n = r.u32();
    if (n > r.remaining() / 28) r.fail("piece count " + std::to_string(n) + " exceeds the message");
    for (std::uint32_t i = 0; i < n; ++i) {
      piece_check p;
      p.tensor = r.u32(); p.offset = r.u64(); p.length = r.u64(); p.checksum = r.u64();
      h.pieces.push_back(p);
    }
    r.expect_end();
    return h;
  }
};

struct meta_header {
  std::uint64_t session = 0, iteration = 0, bytes = 0, checksum = 0;
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic); w.u64(session); w.u64(iteration); w.u64(bytes); w.u64(checksum);
    return seal(w);
  }
  static meta_header decode(std::span<const std::byte> b) {
    reader r(unseal(b, "metadata header"), "metadata header");
    check_magic(r);
    meta_header m;
    m.session = r.u64(); m.iteration = r.u64(); m.bytes = r.u64(); m.checksum = r.u64();
    r.expect_end();
    return m;
  }
};

/// A source's last word on a session: its figures when it delivered everything, or why
/// it could not. Errors travel as (code, text) so that the clone rethrows them faithfully.
struct status_msg {
  std::uint64_t session = 0;
  std::uint32_t source_index = 0;
  std::uint32_t code = 0;  ///< 0: delivered; else a deepclone::errc
  std::uint64_t bytes_sent = 0;
  double hook_s = 0, overhead_s = 0, normal_iteration_s = 0;
  std::uint32_t fork_iterations = 0;
  std::uint32_t cause = 0;  ///< code != 0 because a clone rank gave up: that rank's own error code
  std::string reason;
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic); w.u64(session); w.u32(source_index); w.u32(code); w.u64(bytes_sent);
    w.f64(hook_s); w.f64(overhead_s); w.f64(normal_iteration_s); w.u32(fork_iterations); w.u32(cause);
    w.str(reason.substr(0, control_bytes / 2));
    return seal(w);
  }
  static status_msg decode(std::span<const std::byte> b) {
    reader r(unseal(b, "source status"), "source status");
    check_magic(r);
    status_msg m;
    m.session = r.u64(); m.source_index = r.u32(); m.code = r.u32(); m.bytes_sent = r.u64();
    m.hook_s = r.f64(); m.overhead_s = r.f64(); m.normal_iteration_s = r.f64(); m.fork_iterations = r.u32(); m.cause = r.u32();
    m.reason = r.str();
    r.expect_end();
    return m;
  }
};

struct summary_msg {
  std::uint64_t session = 0;
  std::uint32_t clone_index = 0;
  std::uint64_t bytes_from_sources = 0, bytes_from_clones = 0;
  double readiness_s = 0, standby_s = 0, first_layer_s = 0;
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic); w.u64(session); w.u32(clone_index); w.u64(bytes_from_sources); w.u64(bytes_from_clones);
    w.f64(readiness_s); w.f64(standby_s); w.f64(first_layer_s);
    return seal(w);
  }
  static summary_msg decode(std::span<const std::byte> b) {
    reader r(unseal(b, "clone summary"), "clone summary");
    check_magic(r);
    summary_msg m;
    m.session = r.u64(); m.clone_index = r.u32(); m.bytes_from_sources = r.u64(); m.bytes_from_clones = r.u64();
    m.readiness_s = r.f64(); m.standby_s = r.f64(); m.first_layer_s = r.f64();
    r.expect_end();
    return m;
  }
};

struct cancel_msg {
  std::uint64_t session = 0;
  std::uint32_t clone_index = 0;
  std::uint32_t code = 0;  ///< why the clone rank gave up (a deepclone::errc)
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic); w.u64(session); w.u32(clone_index); w.u32(code);
    return seal(w);
  }
  static cancel_msg decode(std::span<const std::byte> b) {
    reader r(unseal(b, "cancel message"), "cancel message");
    check_magic(r);
    cancel_msg m;
    m.session = r.u64(); m.clone_index = r.u32(); m.code = r.u32();
    r.expect_end();
    return m;
  }
};

}  // namespace deepclone::detail

namespace deepclone::detail {

/// Layers a clone rank has verified; at most `max_layers` per message.
struct ack_msg {
  static constexpr std::size_t max_layers = 200;
  std::uint64_t session = 0;
  std::uint32_t clone_index = 0;
  std::vector<std::uint32_t> layers;
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic); w.u64(session); w.u32(clone_index); w.u32(static_cast<std::uint32_t>(layers.size()));
    for (auto l : layers) w.u32(l);
    return seal(w);
  }
  static ack_msg decode(std::span<const std::byte> b) {
    reader r(unseal(b, "layer acknowledgement"), "layer acknowledgement");
    check_magic(r);
    ack_msg m;
    m.session = r.u64(); m.clone_index = r.u32();
    auto n = r.u32();
    if (n > max_layers || n > r.remaining() / 4) r.fail("layer count " + std::to_string(n) + " exceeds the message");
    for (std::uint32_t i = 0; i < n; ++i) m.layers.push_back(r.u32());
    r.expect_end();
    return m;
  }
};

/// A source's digest of its whole replica at the fork iteration: the checksums of every
/// piece of the plan (not only the ones it sends), folded in plan order
/// (`checksum::fold_pieces`). Equal digests from every source mean the replicas agree.
struct digest_msg {
  std::uint64_t session = 0, iteration = 0;
  std::uint32_t source_index = 0;
  std::uint64_t digest = 0;
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic); w.u64(session); w.u64(iteration); w.u32(source_index); w.u64(digest);
    return seal(w);
  }
  static digest_msg decode(std::span<const std::byte> b) {
    reader r(unseal(b, "replica digest"), "replica digest");
    check_magic(r);
    digest_msg m;
    m.session = r.u64(); m.iteration = r.u64(); m.source_index = r.u32(); m.digest = r.u64();
    r.expect_end();
    return m;
  }
};

/// A clone rank asks a source to send one transfer group (by plan index) again.
struct refetch_msg {
  std::uint64_t session = 0;
  std::uint32_t clone_index = 0;
  std::uint32_t group = 0;
  std::vector<std::byte> encode() const {
    writer w;
    w.u32(magic); w.u64(session); w.u32(clone_index); w.u32(group);
    return seal(w);
  }
  static refetch_msg decode(std::span<const std::byte> b) {
    reader r(unseal(b, "refetch request"), "refetch request");
    check_magic(r);
    refetch_msg m;
    m.session = r.u64(); m.clone_index = r.u32(); m.group = r.u32();
    r.expect_end();
    return m;
  }
};

}  // namespace deepclone::detail
