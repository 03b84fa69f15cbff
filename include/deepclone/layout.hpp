#pragma once
/// \file layout.hpp
/// What a state looks like, without its bytes: ordered layers of named tensors. Sources
/// and clones compare layouts (by fingerprint, then in full) before a single byte is
/// written into a clone tensor, and the plan is a function of the layout.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "detail/bytes.hpp"
#include "tensor.hpp"

namespace deepclone {

/// One tensor of a layer: its name, size in bytes, element type and shape. Where it
/// lives (host or device) is not part of the layout: a host clone of a device source
/// is legitimate.
struct tensor_desc {
  std::string name;
  std::uint64_t bytes = 0;
  dtype type = dtype::bytes;
  std::vector<std::int64_t> shape;
  bool operator==(const tensor_desc&) const = default;
};

/// A layer: the unit of the layer-wise pipeline (updated, sent and made ready together).
struct layer_desc {
  std::string name;
  std::vector<tensor_desc> tensors;
  bool operator==(const layer_desc&) const = default;
};

/// Ordered layers in forward order. Tensors are numbered globally in that order
/// ("flat index"), which is how the plan and the wire name them.
class layout {
 public:
  layout() = default;
  explicit layout(std::vector<layer_desc> layers) : layers_(std::move(layers)) { index(); }

  void add_layer(layer_desc layer) {
    layers_.push_back(std::move(layer));
    index();
  }
  const std::vector<layer_desc>& layers() const noexcept { return layers_; }
  std::size_t layer_count() const noexcept { return layers_.size(); }
  std::size_t tensor_count() const noexcept { return flat_.size(); }
  /// Tensor by flat index.
  const tensor_desc& tensor(std::size_t flat) const { return layers_[flat_[flat].layer].tensors[flat_[flat].index]; }
  std::size_t layer_of(std::size_t flat) const { return flat_[flat].layer; }
  /// Flat index of the first tensor of `layer`; tensors of a layer are contiguous.
  std::size_t first_tensor(std::size_t layer) const { return first_[layer]; }
  std::size_t end_tensor(std::size_t layer) const { return first_[layer] + layers_[layer].tensors.size(); }
  std::uint64_t total_bytes() const noexcept { return total_; }
  std::uint64_t layer_bytes(std::size_t layer) const {
    std::uint64_t b = 0;
    for (auto& t : layers_[layer].tensors) b += t.bytes;
    return b;
  }

  /// Canonical encoding: what travels when a clone must be told the sources' layout.
  std::vector<std::byte> encode() const {
    detail::writer w;
    w.u32(static_cast<std::uint32_t>(layers_.size()));
    for (auto& l : layers_) {
      w.str(l.name);
      w.u32(static_cast<std::uint32_t>(l.tensors.size()));
      for (auto& t : l.tensors) {
        w.str(t.name);
        w.u64(t.bytes);
        w.u8(static_cast<std::uint8_t>(t.type));
        w.u32(static_cast<std::uint32_t>(t.shape.size()));
        for (auto d : t.shape) w.i64(d);
      }
    }
    return w.take();
  }
  static layout decode(std::span<const std::byte> b) {
    detail::reader r(b, "layout message");
    layout out;
    auto nl = r.u32();
    if (nl > r.remaining()) r.fail("layer count " + std::to_string(nl) + " exceeds the message");
    for (std::uint32_t i = 0; i < nl; ++i) {
      layer_desc l;
      l.name = r.str();
      auto nt = r.u32();
      if (nt > r.remaining()) r.fail("tensor count exceeds the message");
      for (std::uint32_t j = 0; j < nt; ++j) {
        tensor_desc t;
        t.name = r.str();
        t.bytes = r.u64();
        auto ty = r.u8();
        if (ty > static_cast<std::uint8_t>(dtype::boolean)) r.fail("unknown dtype " + std::to_string(ty));
        t.type = static_cast<dtype>(ty);
        auto nd = r.u32();
        if (nd > r.remaining() / 8) r.fail("shape rank exceeds the message");
        for (std::uint32_t k = 0; k < nd; ++k) t.shape.push_back(r.i64());
        l.tensors.push_back(std::move(t));
      }
      out.layers_.push_back(std::move(l));
    }
    r.expect_end();
    out.index();
    return out;
  }
  /// A 64-bit fingerprint of the canonical encoding: equal layouts have equal
  /// fingerprints; the full comparison (first_difference) names what differs.
  std::uint64_t fingerprint() const { return detail::fnv1a(encode()); }

  bool operator==(const layout& o) const { return layers_ == o.layers_; }

 private:
  struct where {
    std::size_t layer, index;
  };
  void index() {
    flat_.clear();
    first_.clear();
    total_ = 0;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      first_.push_back(flat_.size());
      for (std::size_t i = 0; i < layers_[l].tensors.size(); ++i) {
        flat_.push_back({l, i});
        total_ += layers_[l].tensors[i].bytes;
      }
    }
  }
  std::vector<layer_desc> layers_;
  std::vector<where> flat_;
  std::vector<std::size_t> first_;
  std::uint64_t total_ = 0;
};

namespace detail {
inline std::string shape_string(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i) out += 'x';  // not `(i ? "x" : "") + std::to_string(...)`: g++ 12 -O2 warns -Wrestrict on it
    out += std::to_string(s[i]);
  }
  return out + "]";
}
}  // namespace detail

/// The first difference between two layouts, as a sentence naming the layer and tensor,
/// or nullopt when they are equal. `a_name`/`b_name` say whose is whose ("sources").
inline std::optional<std::string> first_difference(const layout& a, const layout& b,
                                                   const std::string& a_name = "sources",
                                                   const std::string& b_name = "clone") {
  auto both = [&](const std::string& what, const std::string& x, const std::string& y) {
    return what + ": " + a_name + " have " + x + ", " + b_name + " has " + y;
  };
  std::size_t nl = std::min(a.layer_count(), b.layer_count());
  for (std::size_t l = 0; l < nl; ++l) {
    auto& la = a.layers()[l];
    auto& lb = b.layers()[l];
    std::string where = "layer " + std::to_string(l) + " ('" + la.name + "')";
    if (la.name != lb.name) return both(where + " name", "'" + la.name + "'", "'" + lb.name + "'");
    std::size_t nt = std::min(la.tensors.size(), lb.tensors.size());
    for (std::size_t t = 0; t < nt; ++t) {
      auto& ta = la.tensors[t];
      auto& tb = lb.tensors[t];
      std::string tw = "tensor '" + la.name + "." + ta.name + "'";
      if (ta.name != tb.name) return both(where + " tensor " + std::to_string(t) + " name", "'" + ta.name + "'", "'" + tb.name + "'");
      if (ta.bytes != tb.bytes) return both(tw + " size", std::to_string(ta.bytes) + " bytes", std::to_string(tb.bytes) + " bytes");
      if (ta.type != tb.type) return both(tw + " dtype", std::string(dtype_name(ta.type)), std::string(dtype_name(tb.type)));
      if (ta.shape != tb.shape) return both(tw + " shape", detail::shape_string(ta.shape), detail::shape_string(tb.shape));
    }
    if (la.tensors.size() != lb.tensors.size())
      return both(where + " tensor count", std::to_string(la.tensors.size()), std::to_string(lb.tensors.size()));
  }
  if (a.layer_count() != b.layer_count())
    return both("layer count", std::to_string(a.layer_count()), std::to_string(b.layer_count()));
  return std::nullopt;
}

}  // namespace deepclone
