// The clone side of the sources' metadata (detail/metadata_receive.hpp), both engines'
// component, over the in-process transport. Where the source sends every blob it announced
// (keep_aligned: the partitioned engine), a blob that a fork given up left behind, or that a
// stale header announced, never meets a later fork's receive (before, it did, and failed
// that fork, whose own blob then failed the next, on that tag block for good); a header
// announcing more than the limit is refused before anything is allocated.
#include <doctest/doctest.h>

#include <deepclone/checksum.hpp>
#include <deepclone/detail/metadata_receive.hpp>
#include <deepclone/inproc.hpp>

#include <chrono>
#include <deque>
#include <optional>
#include <vector>

namespace dc = deepclone;

namespace {

using receive = dc::detail::metadata_receive<dc::inproc::communicator, dc::checksum::mix64>;
const receive::tags tags{100, 101};
constexpr std::uint64_t limit = 1 << 20;

/// Source 0's side: sends the header and (unless told not to) the blob of `session`.
struct sender {
  dc::inproc::communicator c;
  std::deque<std::vector<std::byte>> kept;  // the bytes of every send, alive until the end
  std::deque<dc::inproc::communicator::request_type> sends;

  static dc::metadata of(std::uint64_t session) {
    dc::metadata m;
    m.step = session * 10, m.data_cursor = session;
    m.user.assign(static_cast<std::size_t>(session * 5), std::byte{7});  // each session's blob has its own size
    return m;
  }
  void header(std::uint64_t session, std::uint64_t bytes_announced = 0) {
    const auto blob = of(session).encode();
    const dc::detail::meta_header h{session, session * 10, bytes_announced ? bytes_announced : blob.size(), dc::checksum::mix64::compute(blob)};
    sends.push_back(c.isend(1, tags.header, kept.emplace_back(h.encode())));
  }
  void blob(std::uint64_t session) { sends.push_back(c.isend(1, tags.blob, kept.emplace_back(of(session).encode()))); }
};

/// Progresses `r` until its metadata arrived (or 2 s passed).
std::optional<dc::metadata> progress_until_done(receive& r, dc::inproc::communicator& c) {
  std::optional<dc::metadata> out;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (!r.done() && std::chrono::steady_clock::now() < until) r.progress(c, out);
  return out;
}

/// Source 0 (rank 0) and a clone rank (rank 1) whose metadata receive keeps blobs aligned.
struct two_ranks {
  dc::inproc::world w{2};
  sender s{w.comm(0), {}, {}};
  dc::inproc::communicator c = w.comm(1);
  receive r{true};
  ~two_ranks() { r.close(c); }
  /// Opens fork `session` (iteration session x 10) and progresses until its metadata arrived.
  std::optional<dc::metadata> fork(std::uint64_t session) {
    r.open(c, 0, tags, session, session * 10, limit);
    return progress_until_done(r, c);
  }
};

}  // namespace

TEST_CASE_FIXTURE(two_ranks, "metadata receive: a blob left by a fork given up after its header does not meet the next fork's receive") {
  s.header(1);
  r.open(c, 0, tags, 1, 10, limit);
  std::optional<dc::metadata> none;
  for (int i = 0; i < 100; ++i) r.progress(c, none);  // the header is taken, the blob receive posted
  CHECK_FALSE(r.done());
  r.open(c, 0, tags, 2, 20, limit);  // this rank gave up on fork 1; fork 2 begins
  s.blob(1);                         // fork 1's blob comes late
  s.header(2), s.blob(2);
  const auto got = progress_until_done(r, c);
  REQUIRE(got.has_value());
  CHECK(*got == sender::of(2));
}

TEST_CASE_FIXTURE(two_ranks, "metadata receive: the blob a stale header announced is drained, not taken for this fork's") {
  s.header(1), s.blob(1);  // a fork this rank never joined
  s.header(2), s.blob(2);
  const auto got = fork(2);
  REQUIRE(got.has_value());
  CHECK(*got == sender::of(2));
}

TEST_CASE_FIXTURE(two_ranks, "metadata receive: a header announcing more than the limit is refused before anything is allocated") {
  s.header(1, std::uint64_t{1} << 40);
  CHECK_THROWS_WITH_AS(fork(1), doctest::Contains("more than settings.max_metadata_bytes"), dc::error);
}
