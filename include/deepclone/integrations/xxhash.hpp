#pragma once
/// \file integrations/xxhash.hpp
/// Opt-in checksum policy backed by xxHash: `deepclone::checksum::xxh3`, for
/// `engine<Comm, Shard, Pipeline, Reconstruct, checksum::xxh3>`. Link `deepclone::xxhash`
/// (it brings the include directory of `xxhash.h`; Debian: libxxhash-dev). xxHash is used
/// header-only (`XXH_INLINE_ALL`): nothing to link, and no clash with a libxxhash that the
/// program may link for other reasons.
///
/// Why offer it: XXH3 is a widely deployed, well-maintained and externally tested hash (it
/// passes SMHasher), whereas `mix64` is deepclone's own construction (a sum of mixed words)
/// whose quality has only been checked by this project. Both detect any single flipped bit,
/// a truncation or a misplaced piece; XXH3 is the choice when that assurance should rest on
/// a library whose mixing has been studied by others. Neither resists an adversary.
///
/// Why it is not the default: XXH3 is a sequential streaming hash computed on the host. A
/// GPU cannot compute it with one parallel transform-reduce the way it computes `mix64`
/// (integrations/thrust.hpp), so tensors in device memory would have to be copied to the host
/// first. Use it for host-resident state where the stronger mixing is wanted.
///
/// Sources and clones must use the same policy: its id (2) is part of the plan key, so a
/// clone using `xxh3` against sources using `mix64` is refused with `errc::plan_mismatch`
/// before any byte is written.

#if !__has_include(<xxhash.h>)
#error "deepclone/integrations/xxhash.hpp needs <xxhash.h> (xxHash >= 0.8, Debian: apt-get install libxxhash-dev); link deepclone::xxhash or add its include directory"
#else
#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#define DEEPCLONE_DEFINED_XXH_INLINE_ALL
#endif
#include <xxhash.h>
#ifdef DEEPCLONE_DEFINED_XXH_INLINE_ALL
#undef XXH_INLINE_ALL
#undef DEEPCLONE_DEFINED_XXH_INLINE_ALL
#endif
#if !defined(XXH_VERSION_NUMBER) || XXH_VERSION_NUMBER < 800
#error "deepclone/integrations/xxhash.hpp needs xxHash >= 0.8.0 (XXH3_64bits is stable from 0.8.0 on)"
#endif

#include <cstddef>
#include <cstdint>
#include <span>

#include "../checksum.hpp"

namespace deepclone::checksum {

/// XXH3, 64-bit digest, seed 0: `XXH3_64bits(bytes, size)`. The digest is stable across
/// xxHash versions >= 0.8.0 and across platforms, so ranks built against different xxHash
/// releases agree. Host only (not `DEEPCLONE_HOST_DEVICE`); see the file comment.
struct xxh3 {
  static constexpr std::uint32_t id = 2;
  static constexpr const char* name = "xxh3";

  static std::uint64_t compute(std::span<const std::byte> b) noexcept {
    return static_cast<std::uint64_t>(XXH3_64bits(b.data(), b.size()));
  }
};

}  // namespace deepclone::checksum

#endif  // __has_include(<xxhash.h>)
