// A message above INT_MAX bytes (3 GiB + 1) through the adapter's default split size.
#include <deepclone/integrations/boost_mpi.hpp>

#include <doctest/doctest.h>

#include <boost/mpi/communicator.hpp>

#include <vector>

namespace {
std::byte at(std::size_t i) { return static_cast<std::byte>((i >> 12) * 31 + (i & 0xff)); }
}  // namespace

TEST_CASE("mpi adapter: a 3 GiB message arrives whole (split into MPI messages below INT_MAX)") {
  boost::mpi::communicator world;
  deepclone::mpi::communicator c(world);
  if (c.rank() > 1) return;
  const std::size_t n = (std::size_t{3} << 30) + 1;
  std::vector<std::byte> buf(n);
  if (c.rank() == 0) {
    for (std::size_t i = 0; i < n; ++i) buf[i] = at(i);
    auto s = c.isend(1, 1, buf);
    CHECK(c.wait(s) == n);
  } else {
    auto r = c.irecv(0, 1, buf);
    REQUIRE(c.wait(r) == n);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) bad += buf[i] != at(i);
    CHECK(bad == 0);
  }
}
