#pragma once
/// \file detail/bytes.hpp
/// Little-endian encoding of the few structures that travel (layouts, headers, metadata),
/// with bounds-checked decoding: a truncated or corrupt message raises
/// `errc::corrupt_message` instead of reading past its end.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "../error.hpp"

namespace deepclone::detail {

class writer {
 public:
  void u8(std::uint8_t v) { buf_.push_back(std::byte{v}); }
  void u32(std::uint32_t v) { put(v); }
  void u64(std::uint64_t v) { put(v); }
  void i64(std::int64_t v) { put(static_cast<std::uint64_t>(v)); }
  void f64(double v) {
    std::uint64_t u;
    std::memcpy(&u, &v, sizeof u);
    put(u);
  }
  void bytes(std::span<const std::byte> b) {
    u64(b.size());
    buf_.insert(buf_.end(), b.begin(), b.end());
  }
  void str(std::string_view s) { bytes(std::as_bytes(std::span(s.data(), s.size()))); }
  std::vector<std::byte>& buffer() noexcept { return buf_; }
  std::vector<std::byte> take() noexcept { return std::move(buf_); }

 private:
  template <class U>
  void put(U v) {
    for (std::size_t i = 0; i < sizeof(U); ++i) buf_.push_back(std::byte(static_cast<std::uint8_t>(v >> (8 * i))));
  }
  std::vector<std::byte> buf_;
};

class reader {
 public:
  reader(std::span<const std::byte> b, std::string_view what) : b_(b), what_(what) {}
  std::uint8_t u8() { return static_cast<std::uint8_t>(take(1)[0]); }
  std::uint32_t u32() { return get<std::uint32_t>(); }
  std::uint64_t u64() { return get<std::uint64_t>(); }
  std::int64_t i64() { return static_cast<std::int64_t>(get<std::uint64_t>()); }
  double f64() {
    auto u = get<std::uint64_t>();
    double d;
    std::memcpy(&d, &u, sizeof d);
    return d;
  }
  std::span<const std::byte> bytes() {
    auto n = u64();
    if (n > remaining()) fail("length field " + std::to_string(n) + " exceeds the message");
    return take(static_cast<std::size_t>(n));
  }
  std::string str() {
    auto b = bytes();
    return {reinterpret_cast<const char*>(b.data()), b.size()};
  }
  std::size_t remaining() const noexcept { return b_.size() - pos_; }
  void expect_end() const {
    if (remaining() != 0) fail(std::to_string(remaining()) + " trailing bytes");
  }
  [[noreturn]] void fail(const std::string& why) const {
    throw error(errc::corrupt_message, std::string(what_) + ": " + why);
  }

 private:
  std::span<const std::byte> take(std::size_t n) {
    if (n > remaining()) fail("truncated (wanted " + std::to_string(n) + " bytes at offset " + std::to_string(pos_) + ")");
    auto s = b_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  template <class U>
  U get() {
    auto s = take(sizeof(U));
    U v = 0;
    for (std::size_t i = 0; i < sizeof(U); ++i) v |= static_cast<U>(static_cast<std::uint8_t>(s[i])) << (8 * i);
    return v;
  }
  std::span<const std::byte> b_;
  std::size_t pos_ = 0;
  std::string_view what_;
};

/// FNV-1a over a small buffer: used for fingerprints of layouts and settings, never for
/// tensor data (see checksum.hpp for that).
inline std::uint64_t fnv1a(std::span<const std::byte> b, std::uint64_t h = 14695981039346656037ull) noexcept {
  for (auto c : b) {
    h ^= static_cast<std::uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

/// Every control message ends in the FNV-1a of everything before it (`seal`), checked
/// before a single field is read (`unseal`): a flipped byte in a length, a count or a
/// session id is caught before the value is used, whatever the field.
inline std::vector<std::byte> seal(writer& w) {
  const std::uint64_t h = fnv1a(w.buffer());
  w.u64(h);
  return w.take();
}
inline std::span<const std::byte> unseal(std::span<const std::byte> b, std::string_view what) {
  if (b.size() < 8)
    throw error(errc::corrupt_message, std::string(what) + ": " + std::to_string(b.size()) + " bytes, too short for a deepclone message");
  auto body = b.first(b.size() - 8);
  reader tail(b.last(8), what);
  if (tail.u64() != fnv1a(body)) throw error(errc::corrupt_message, std::string(what) + ": message checksum mismatch (corrupt)");
  return body;
}

}  // namespace deepclone::detail
