#pragma once
// The peer of the partitioned rows, shared by partition_bench.cpp (in process) and
// partition_bench_mpi.cpp (under mpirun): a resharding checkpoint, as PyTorch DCP (or
// ByteCheckpoint) gets a partitioned state into another layout. Every source saves what it
// holds to its own file, each replicated region once (split over its holders, as DCP's
// deduplication does), with fsync; then every clone rank loads every file cold and puts each
// run where its own layout wants it. The save plan is the partitioned plan into one replicated
// reader; the clone ranks of the benchmarks' layouts are replicated, so each loads through
// that same plan.
#include <deepclone/partition_groups.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "partition_layouts.hpp"

namespace partition_bench {

/// The save's staging buffer and the load's read size.
inline constexpr std::size_t staging_bytes = std::size_t{8} << 20;

/// One aligned buffer of at least `bytes` (O_DIRECT needs 4 KiB alignment), pre-faulted.
inline std::unique_ptr<std::byte, decltype(&std::free)> aligned_buffer(std::size_t bytes) {
  void* p = nullptr;
  const std::size_t size = std::max<std::size_t>(4096, (bytes + 4095) / 4096 * 4096);
  if (::posix_memalign(&p, 4096, size) != 0) throw std::runtime_error("posix_memalign");
  std::memset(p, 0, size);
  return {static_cast<std::byte*>(p), &std::free};
}

/// The saved checkpoint's shape: each source's messages of the save plan, in file order.
struct checkpoint_plan {
  dc::partition_groups groups;
  std::vector<std::uint64_t> file_bytes;  ///< per source
  std::string dir;
  std::string path(std::size_t source) const { return dir + "/deepclone_partition_ckpt." + std::to_string(source); }
  template <class F>
  void for_messages(std::uint32_t source, F f) const {
    for (auto g : groups.sent_by_source(source))
      for (const auto& m : groups.groups()[g].messages) f(m);
  }
};

inline checkpoint_plan make_checkpoint_plan(const dc::layout& lay, const scenario& s, const std::string& dir) {
  for (const auto& h : s.dst)
    for (const auto& parts : h.of_tensor)
      if (parts.size() != 1 || parts[0].kind != dc::part::shape_kind::whole || parts[0].local_offset != 0)
        throw std::invalid_argument("the checkpoint peer loads replicated clone ranks only");
  const auto n = static_cast<std::uint32_t>(s.src.size());
  checkpoint_plan c{dc::make_partition_groups(dc::make_partition_plan(lay, s.src, {dc::holdings::replicated(lay)}), n, 1), {}, dir};
  for (std::uint32_t i = 0; i < n; ++i) c.file_bytes.push_back(c.groups.bytes_sent_by_source(i));
  return c;
}

/// Source `i` saves its share: packed through an 8 MiB staging buffer, fsync, and its pages
/// dropped so that a load reads the disk.
inline void save_checkpoint(const dc::layout& lay, const checkpoint_plan& cp, std::uint32_t i, std::span<const std::span<const std::byte>> own,
                     std::span<std::byte> staging) {
  const int fd = ::open(cp.path(i).c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + cp.path(i));
  std::size_t used = 0;
  auto flush = [&] {
    if (used && ::write(fd, staging.data(), used) != static_cast<ssize_t>(used)) throw std::runtime_error("short write to " + cp.path(i));
    used = 0;
  };
  cp.for_messages(i, [&](const dc::partition_message& m) {
    if (m.bytes > staging.size()) throw std::invalid_argument("a message larger than the checkpoint's staging buffer");
    if (used + m.bytes > staging.size()) flush();
    dc::pack(lay, m.runs, own, staging.subspan(used, static_cast<std::size_t>(m.bytes)));
    used += static_cast<std::size_t>(m.bytes);
  });
  flush();
  if (::fsync(fd) != 0) throw std::runtime_error("fsync of " + cp.path(i) + ": " + std::strerror(errno));
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

/// Reads source `i`'s whole file into `into` (O_DIRECT where the file system allows it, else
/// buffered after POSIX_FADV_DONTNEED); returns how it read.
inline std::string read_cold(const checkpoint_plan& cp, std::uint32_t i, std::byte* into) {
  int fd = ::open(cp.path(i).c_str(), O_RDONLY | O_DIRECT);
  const bool direct = fd >= 0;
  if (!direct) {
    if ((fd = ::open(cp.path(i).c_str(), O_RDONLY)) < 0) throw std::runtime_error("cannot open " + cp.path(i));
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  }
  const std::uint64_t size = cp.file_bytes[i];
  for (std::uint64_t at = 0; at < size; at += staging_bytes) {
    const auto want = std::min<std::uint64_t>(staging_bytes, size - at), ask = direct ? (want + 4095) / 4096 * 4096 : want;
    if (::pread(fd, into + at, static_cast<std::size_t>(ask), static_cast<off_t>(at)) < static_cast<ssize_t>(want))
      throw std::runtime_error("short read from " + cp.path(i) + ": " + std::strerror(errno));
  }
  ::close(fd);
  return direct ? "O_DIRECT" : "POSIX_FADV_DONTNEED";
}

/// Clone rank loads every source's file and places its runs.
inline std::string load_checkpoint(const dc::layout& lay, const checkpoint_plan& cp, std::span<const std::span<std::byte>> own,
                            std::span<std::byte*> files) {
  std::string how;
  for (std::uint32_t i = 0; i < cp.file_bytes.size(); ++i) {
    how = read_cold(cp, i, files[i]);
    std::uint64_t at = 0;
    cp.for_messages(i, [&](const dc::partition_message& m) {
      dc::unpack(lay, m.runs, {files[i] + at, static_cast<std::size_t>(m.bytes)}, own);
      at += m.bytes;
    });
  }
  return how;
}

/// A clone rank's pre-faulted buffers for every source's file (aligned for O_DIRECT).
inline std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> file_buffers(const checkpoint_plan& cp) {
  std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> out;
  for (auto bytes : cp.file_bytes) out.push_back(aligned_buffer(static_cast<std::size_t>(bytes)));
  return out;
}

}  // namespace partition_bench
