#pragma once
/// \file metadata.hpp
/// The non-tensor part of a training state: what a clone needs to resume exactly where
/// the sources were at the end of the fork iteration.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "detail/bytes.hpp"

namespace deepclone {

/// Replicated training metadata. The sources' copy is captured at the end of the fork
/// iteration k, with `step` set to k; the clone resumes with iteration k+1.
struct metadata {
  std::uint64_t step = 0;                 ///< the iteration whose state this is
  std::uint64_t data_cursor = 0;          ///< position in the data loader
  std::vector<std::byte> rng;             ///< serialized RNG state(s)
  std::map<std::string, double> hyper;    ///< hyper-parameters (learning rate, momentum, ...)
  std::vector<std::byte> user;            ///< anything else, opaque to deepclone

  bool operator==(const metadata&) const = default;

  std::vector<std::byte> encode() const {
    detail::writer w;
    w.u64(step);
    w.u64(data_cursor);
    w.bytes(rng);
    w.u32(static_cast<std::uint32_t>(hyper.size()));
    for (auto& [k, v] : hyper) {
      w.str(k);
      w.f64(v);
    }
    w.bytes(user);
    return w.take();
  }
  static metadata decode(std::span<const std::byte> b) {
    detail::reader r(b, "metadata message");
    metadata m;
    m.step = r.u64();
    m.data_cursor = r.u64();
    auto rng = r.bytes();
    m.rng.assign(rng.begin(), rng.end());
    auto n = r.u32();
    if (n > r.remaining()) r.fail("hyper-parameter count exceeds the message");
    for (std::uint32_t i = 0; i < n; ++i) {
      auto k = r.str();
      m.hyper[k] = r.f64();
    }
    auto user = r.bytes();
    m.user.assign(user.begin(), user.end());
    r.expect_end();
    return m;
  }
};

}  // namespace deepclone
