#pragma once
/// \file detail/metadata_receive.hpp
/// The clone side of the sources' metadata of iteration k: the coordinator's header first,
/// whose announced length is checked against `settings.max_metadata_bytes` before anything
/// is allocated (a peer's garbage must not make the clone allocate without bound), then the
/// blob it announces, checked against the header's checksum. A header of an older session
/// on the same tag block is skipped. The blob carries no session: blobs match receives in
/// the order sent. Where the source never withdraws a metadata send (`keep_aligned`: the
/// partitioned engine's source sends it outside the fork's sends), every blob it sent must
/// meet a receive of its own: a stale header's blob is drained, and the blob receive of a
/// fork this rank gave up stays posted (parked) until its blob comes, rather than leaving
/// that blob for the next fork's receive (which would then fail, and leave its own for the
/// one after, and so on). Where the source withdraws it with its session (the replicated
/// engine), a parked receive could wait for a blob that never comes and take a later one:
/// there the receive is withdrawn too. Everything wrong with what arrives is thrown as
/// `errc::corrupt_message`; the clone engine turns it into one clean failure. Both engines'
/// clones use it: the replicated one on its session's tags, the partitioned one on its
/// fork's. Templated on the communicator and the checksum policy only.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <new>
#include <span>
#include <vector>

#include "../error.hpp"
#include "../metadata.hpp"
#include "clone_transfer.hpp"  // test_or_garbage
#include "outbox.hpp"
#include "wire.hpp"

namespace deepclone::detail {

template <class Comm, class Checksum>
class metadata_receive {
  using request_t = typename Comm::request_type;

 public:
  /// The header's tag and the blob's.
  struct tags {
    int header = 0, blob = 0;
  };
  /// `keep_aligned`: the source sends every blob it announced (see the file comment).
  explicit metadata_receive(bool keep_aligned = false) noexcept : keep_aligned_(keep_aligned) {}
  /// Posts the header's receive for session `session` (iteration `k`) from rank `from`.
  void open(Comm& c, int from, tags t, std::uint64_t session, std::uint64_t k, std::uint64_t max_bytes) {
    cancel(c);
    reap(c);
    from_ = from, tags_ = t, session_ = session, k_ = k, max_bytes_ = max_bytes;
    header_.post(c, from_, tags_.header, control_bytes);
  }
  /// One round: takes the header, then the blob. True if anything arrived; the decoded
  /// metadata is handed out once, in the round that completed it.
  bool progress(Comm& c, std::optional<metadata>& out) {
    reap(c);
    bool any = take_header(c);
    if (!posted_ || done_) return any;
    auto n = test_or_garbage(c, req_);
    if (!n) return any;
    done_ = true;
    if (*n != blob_.size() || Checksum::compute(blob_) != expect_->checksum)
      throw error(errc::corrupt_message, "metadata of iteration " + std::to_string(k_) + " failed its checksum");
    out = metadata::decode(blob_);
    return true;
  }
  bool done() const noexcept { return done_; }
  /// The blob's size (the report's metadata_bytes).
  std::size_t bytes() const noexcept { return blob_.size(); }
  /// Ends this fork's receive. Its header receive is withdrawn (a header that had arrived
  /// meanwhile has its blob drained); a blob receive still pending is parked, not withdrawn.
  void cancel(Comm& c) noexcept {
    if (posted_ && !done_) {
      if (keep_aligned_) park(std::move(req_), std::move(blob_));
      else try {
          c.cancel(req_);
        } catch (...) {
        }
    }
    posted_ = done_ = false;
    expect_.reset();
    if (auto b = header_.withdraw(c)) drain_blob_of(c, *b);
  }
  /// Withdraws every receive, the parked ones too (the owner goes away): no byte is written
  /// afterwards.
  void close(Comm& c) noexcept {
    cancel(c);
    for (auto& p : parked_) try {
        c.cancel(p.request);
      } catch (...) {
      }
    parked_.clear();
  }

 private:
  /// A blob receive kept posted for a blob this rank no longer wants: it keeps the blobs
  /// matched to their own receives.
  struct parked {
    request_t request;
    std::vector<std::byte> buffer;
  };
  void park(request_t&& r, std::vector<std::byte>&& b) noexcept {
    try {
      parked_.push_back({std::move(r), std::move(b)});
    } catch (...) {  // out of memory: leak the buffer rather than free it under a receive
      (void)new (std::nothrow) std::vector<std::byte>(std::move(b));
    }
  }
  /// A header (sealed, from source 0) this fork does not use: its blob is drained into a
  /// parked receive. The parked buffers stay within max_bytes in all: beyond, a blob is not
  /// drained (the fork that meets it fails as corrupt), so no peer makes this allocate
  /// without bound.
  void drain_blob_of(Comm& c, std::span<const std::byte> header) noexcept {
    if (!keep_aligned_) return;
    try {
      const auto h = meta_header::decode(header);
      std::uint64_t parked_bytes = 0;
      for (const auto& p : parked_) parked_bytes += p.buffer.size();
      if (h.bytes > max_bytes_ - std::min(max_bytes_, parked_bytes)) return;
      std::vector<std::byte> b(static_cast<std::size_t>(h.bytes));
      auto r = c.irecv(from_, tags_.blob, b);
      park(std::move(r), std::move(b));
    } catch (...) {  // garbage, or the transport failed: nothing to drain
    }
  }
  /// Forgets the parked receives that completed (or failed).
  void reap(Comm& c) noexcept {
    std::erase_if(parked_, [&](parked& p) {
      try {
        return c.test(p.request).has_value();
      } catch (...) {
        return true;
      }
    });
  }

  bool take_header(Comm& c) {
    auto b = header_.test(c);
    if (!b) return false;
    auto h = meta_header::decode(*b);
    if (h.session != session_) {  // a stale header of an older session on this tag block: its blob is drained
      drain_blob_of(c, *b);
      header_.post(c, from_, tags_.header, control_bytes);
      return true;
    }
    if (h.iteration != k_)
      throw error(errc::corrupt_message, "metadata header of session " + std::to_string(h.session) + " names iteration " +
                                             std::to_string(h.iteration) + ", expected " + std::to_string(k_));
    if (h.bytes > max_bytes_)
      throw error(errc::corrupt_message, "metadata header announces " + std::to_string(h.bytes) +
                                             " bytes, more than settings.max_metadata_bytes (" + std::to_string(max_bytes_) + ")");
    expect_ = h;
    blob_.assign(static_cast<std::size_t>(h.bytes), std::byte{0});
    req_ = c.irecv(from_, tags_.blob, blob_);
    posted_ = true;
    return true;
  }

  int from_ = 0;
  tags tags_;
  std::uint64_t session_ = 0, k_ = 0, max_bytes_ = 0;
  inbox_slot<Comm> header_;
  std::vector<std::byte> blob_;
  std::optional<meta_header> expect_;
  request_t req_{};
  bool posted_ = false, done_ = false;
  bool keep_aligned_ = false;
  std::deque<parked> parked_;  // receives still write into their buffers (which moves keep in place)
};

}  // namespace deepclone::detail
