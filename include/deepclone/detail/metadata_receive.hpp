#pragma once
/// \file detail/metadata_receive.hpp
/// The clone side of the sources' metadata of iteration k: the coordinator's header first,
/// whose announced length is checked against `settings.max_metadata_bytes` before anything
/// is allocated (a peer's garbage must not make the clone allocate without bound), then the
/// blob it announces, checked against the header's checksum. A header of an older session
/// on the same tag block is skipped. Everything wrong with what arrives is thrown as
/// `errc::corrupt_message`; the clone engine turns it into one clean failure. Both engines'
/// clones use it: the replicated one on its session's tags, the partitioned one on its
/// fork's. Templated on the communicator and the checksum policy only.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
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
  /// Posts the header's receive for session `session` (iteration `k`) from rank `from`.
  void open(Comm& c, int from, tags t, std::uint64_t session, std::uint64_t k, std::uint64_t max_bytes) {
    cancel(c);
    from_ = from, tags_ = t, session_ = session, k_ = k, max_bytes_ = max_bytes;
    header_.post(c, from_, tags_.header, control_bytes);
  }
  /// One round: takes the header, then the blob. True if anything arrived; the decoded
  /// metadata is handed out once, in the round that completed it.
  bool progress(Comm& c, std::optional<metadata>& out) {
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
  /// Withdraws both receives: no byte is written afterwards.
  void cancel(Comm& c) noexcept {
    if (posted_ && !done_) try {
        c.cancel(req_);
      } catch (...) {
      }
    posted_ = done_ = false;
    expect_.reset();
    header_.cancel(c);
  }

 private:
  bool take_header(Comm& c) {
    auto b = header_.test(c);
    if (!b) return false;
    auto h = meta_header::decode(*b);
    if (h.session != session_) {  // a stale header of an older session on this tag block
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
};

}  // namespace deepclone::detail
