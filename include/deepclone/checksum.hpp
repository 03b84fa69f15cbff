#pragma once
/// \file checksum.hpp
/// Checksum policies for tensor bytes in flight. A policy is a type with
///   static constexpr std::uint32_t id;  static constexpr const char* name;
///   static std::uint64_t compute(std::span<const std::byte>) noexcept;
/// Sources and clones must use the same policy; the plan key carries its id.

#include <bit>
#include <cstdint>
#include <cstring>
#include <span>

#include "config.hpp"

namespace deepclone::checksum {

/// No checksum: every piece "verifies". For trusted links where every cycle counts.
struct none {
  static constexpr std::uint32_t id = 0;
  static constexpr const char* name = "none";
  static std::uint64_t compute(std::span<const std::byte>) noexcept { return 0; }
};

/// The default: a sum over 8-byte words of a strong 64-bit mix of (word, position),
/// plus the length. Why our own and not a library hash: a sum of independently mixed
/// words is associative and order-free, so a GPU computes the very same value with one
/// parallel transform-reduce (see integrations/thrust.hpp) while the CPU loop vectorises.
/// Any single flipped bit, swapped word or truncation changes it; it is not meant to
/// resist an adversary.
struct mix64 {
  static constexpr std::uint32_t id = 1;
  static constexpr const char* name = "mix64";

  /// The per-word term; `index` is the word's position in the piece.
  DEEPCLONE_HOST_DEVICE static constexpr std::uint64_t term(std::uint64_t word, std::uint64_t index) noexcept {
    std::uint64_t x = word ^ (index * 0x9E3779B97F4A7C15ull + 0xD1B54A32D192ED03ull);
    x ^= x >> 32;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 32;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 32;
    return x;
  }
  /// Finalisation with the byte length, so that trailing zero bytes are not invisible.
  DEEPCLONE_HOST_DEVICE static constexpr std::uint64_t finish(std::uint64_t sum, std::uint64_t length) noexcept {
    return term(sum, length ^ 0xA0761D6478BD642Full);
  }

  static std::uint64_t compute(std::span<const std::byte> b) noexcept {
    const std::size_t words = b.size() / 8;
    const std::byte* p = b.data();
    std::uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    std::size_t i = 0;
    for (; i + 4 <= words; i += 4) {
      std::uint64_t w[4];
      std::memcpy(w, p + i * 8, 32);
      s0 += term(w[0], i);
      s1 += term(w[1], i + 1);
      s2 += term(w[2], i + 2);
      s3 += term(w[3], i + 3);
    }
    for (; i < words; ++i) {
      std::uint64_t w;
      std::memcpy(&w, p + i * 8, 8);
      s0 += term(w, i);
    }
    if (std::size_t tail = b.size() % 8) {
      std::uint64_t w = 0;
      std::memcpy(&w, p + words * 8, tail);  // little-endian zero-padded last word
      s0 += term(w, words);
    }
    return finish(s0 + s1 + s2 + s3, b.size());
  }
};

/// Folds the checksums of a state's pieces, in plan order, into one 64-bit digest of the
/// whole state. Position-dependent (swapping two pieces' sums changes it); used to compare
/// replicas (settings.verify_replicas), whose pieces are checksummed anyway.
inline std::uint64_t fold_pieces(std::span<const std::uint64_t> sums) noexcept {
  std::uint64_t acc = 0;
  for (std::size_t i = 0; i < sums.size(); ++i) acc += mix64::term(sums[i], i);
  return mix64::finish(acc, sums.size());
}

}  // namespace deepclone::checksum
