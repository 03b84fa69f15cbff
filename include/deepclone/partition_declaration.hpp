#pragma once
/// \file partition_declaration.hpp
/// What both sides of a partitioned fork prove before a byte moves (issue 12 item 2). With
/// partitioned state the ranks' own tensors differ in size, so the replicated case's layout
/// check (every rank's own layout equal) no longer says anything: what must agree is the
/// *global* layout, every tensor's dtype and global shape. `global_declaration` is that
/// layout in a compact, sealed wire form with a fingerprint (a clone rank sends the
/// fingerprint; on a difference the sources send the declaration and the clone rank names
/// the first mismatching tensor). `check_holdings_fit` checks that a rank's holdings lie
/// inside its own tensors, so that the plan can never point a transfer outside one.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "detail/bytes.hpp"
#include "error.hpp"
#include "holdings.hpp"
#include "layout.hpp"
#include "tensor.hpp"

namespace deepclone {

/// The global layout as both sides must agree on it: per tensor (flat order) its layer,
/// qualified name ("layer.tensor"), dtype and global shape in elements.
struct global_declaration {
  struct tensor_entry {
    std::uint32_t layer = 0;
    std::string name;
    dtype type = dtype::bytes;
    std::vector<std::uint64_t> shape;
    bool operator==(const tensor_entry&) const = default;
  };
  std::vector<std::string> layers;
  std::vector<tensor_entry> tensors;
  bool operator==(const global_declaration&) const = default;

  static constexpr std::uint32_t magic = 0x44434744;  ///< "DCGD"
  static constexpr std::uint32_t version = 1;
  static constexpr std::uint32_t max_rank = 16;       ///< more dimensions than any framework allows

  static global_declaration of(const layout& global);
  /// The sealed wire form (detail::seal: an FNV-1a trailer checked before any field is
  /// read). Tensors are written layer by layer, as `of` and `decode` order them.
  std::vector<std::byte> encode() const {
    auto w = encode_body();
    return detail::seal(w);
  }
  /// Decodes a sealed declaration; throws `errc::corrupt_message` on anything malformed.
  static global_declaration decode(std::span<const std::byte> sealed);
  /// FNV-1a of the unsealed encoding: equal declarations have equal fingerprints.
  std::uint64_t fingerprint() const { return detail::fnv1a(encode_body().buffer()); }

 private:
  detail::writer encode_body() const;
  static tensor_entry decode_tensor(detail::reader& r, std::uint32_t layer);
};

namespace detail {

inline std::string dims_string(const std::vector<std::uint64_t>& s) {
  std::vector<std::int64_t> v(s.begin(), s.end());
  return shape_string(v);
}

}  // namespace detail

/// The declaration of a layout. Throws `errc::invalid_argument` naming the tensor when its
/// size is not its shape's elements times its dtype's size: the plan cuts boxes by the shape
/// and whole tensors by the size, which must then be the same bytes.
inline global_declaration global_declaration::of(const layout& global) {
  global_declaration d;
  for (const auto& l : global.layers()) d.layers.push_back(l.name);
  for (std::size_t t = 0; t < global.tensor_count(); ++t) {
    const auto& desc = global.tensor(t);
    auto dims = detail::global_dims(desc);
    std::uint64_t bytes = dtype_size(desc.type);
    for (auto x : dims) bytes = x && bytes > UINT64_MAX / x ? 0 : bytes * x;
    if (bytes != desc.bytes || desc.bytes % dtype_size(desc.type))
      throw error(errc::invalid_argument, "global layout: tensor '" + detail::qualified_name(global, t) + "' has " +
                                              std::to_string(desc.bytes) + " bytes, its shape " + detail::dims_string(dims) +
                                              " of " + std::string(dtype_name(desc.type)) + " has another size");
    d.tensors.push_back({static_cast<std::uint32_t>(global.layer_of(t)), detail::qualified_name(global, t), desc.type, std::move(dims)});
  }
  return d;
}

/// magic, version, layer count, then per layer: its name, its tensor count and per tensor:
/// name, dtype (u8), rank (u8), the dimensions (u64 each).
inline detail::writer global_declaration::encode_body() const {
  detail::writer w;
  w.u32(magic), w.u32(version), w.u32(static_cast<std::uint32_t>(layers.size()));
  std::size_t t = 0;
  for (std::uint32_t l = 0; l < layers.size(); ++l) {
    const auto first = t;
    while (t < tensors.size() && tensors[t].layer == l) ++t;
    w.str(layers[l]), w.u32(static_cast<std::uint32_t>(t - first));
    for (auto i = first; i < t; ++i) {
      w.str(tensors[i].name), w.u8(static_cast<std::uint8_t>(tensors[i].type));
      w.u8(static_cast<std::uint8_t>(tensors[i].shape.size()));
      for (auto x : tensors[i].shape) w.u64(x);
    }
  }
  return w;
}

/// Every count is checked against what the message can still hold before anything is
/// allocated for it, so hostile bytes allocate no more than their own size suggests.
inline global_declaration global_declaration::decode(std::span<const std::byte> sealed) {
  detail::reader r(detail::unseal(sealed, "global declaration"), "global declaration");
  if (r.u32() != magic) r.fail("not a global declaration (magic)");
  if (const auto v = r.u32(); v != version) r.fail("version " + std::to_string(v) + ", expected " + std::to_string(version));
  const auto layer_count = r.u32();
  if (layer_count > r.remaining() / 12) r.fail("layer count " + std::to_string(layer_count) + " exceeds the message");
  global_declaration d;
  for (std::uint32_t l = 0; l < layer_count; ++l) {
    d.layers.push_back(r.str());
    const auto n = r.u32();
    if (n > r.remaining() / 10) r.fail("tensor count " + std::to_string(n) + " of layer " + std::to_string(l) + " exceeds the message");
    for (std::uint32_t i = 0; i < n; ++i) d.tensors.push_back(decode_tensor(r, l));
  }
  r.expect_end();
  return d;
}

inline global_declaration::tensor_entry global_declaration::decode_tensor(detail::reader& r, std::uint32_t layer) {
  tensor_entry e{layer, r.str(), dtype::bytes, {}};
  const auto type = r.u8();
  if (type > static_cast<std::uint8_t>(dtype::boolean)) r.fail("tensor '" + e.name + "': unknown dtype " + std::to_string(type));
  e.type = static_cast<dtype>(type);
  const auto rank = r.u8();
  if (rank > max_rank || rank > r.remaining() / 8) r.fail("tensor '" + e.name + "': rank " + std::to_string(rank) + " exceeds the message");
  std::uint64_t bytes = dtype_size(e.type);
  for (std::uint8_t k = 0; k < rank; ++k) {
    e.shape.push_back(r.u64());
    if (e.shape.back() && bytes > UINT64_MAX / e.shape.back()) r.fail("tensor '" + e.name + "': shape overflows 64 bits");
    bytes *= e.shape.back();
  }
  return e;
}

/// The first difference between the sources' declaration and a clone rank's, naming the
/// tensor and both values, or nullopt when they agree.
inline std::optional<std::string> first_difference(const global_declaration& sources, const global_declaration& clone,
                                                   const std::string& clone_name = "clone") {
  auto both = [&](const std::string& what, const std::string& x, const std::string& y) {
    return what + ": sources declare " + x + ", " + clone_name + " declares " + y;
  };
  const auto n = std::min(sources.tensors.size(), clone.tensors.size());
  for (std::size_t t = 0; t < n; ++t) {
    const auto &a = sources.tensors[t], &b = clone.tensors[t];
    const std::string tw = "global tensor " + std::to_string(t) + " ('" + a.name + "')";
    if (a.name != b.name) return both(tw + " name", "'" + a.name + "'", "'" + b.name + "'");
    if (a.layer != b.layer) return both(tw + " layer", std::to_string(a.layer), std::to_string(b.layer));
    if (a.type != b.type) return both(tw + " dtype", std::string(dtype_name(a.type)), std::string(dtype_name(b.type)));
    if (a.shape != b.shape) return both(tw + " shape", detail::dims_string(a.shape), detail::dims_string(b.shape));
  }
  if (sources.tensors.size() != clone.tensors.size())
    return both("tensor count", std::to_string(sources.tensors.size()), std::to_string(clone.tensors.size()));
  if (sources.layers != clone.layers)
    return both("layers", std::to_string(sources.layers.size()) + " layers", std::to_string(clone.layers.size()) + " layers, named otherwise");
  return std::nullopt;
}

/// Throws `errc::layout_mismatch` with the first difference; nothing has moved then.
inline void check_same_global(const global_declaration& sources, const global_declaration& clone, const std::string& clone_name) {
  if (auto d = first_difference(sources, clone, clone_name))
    throw error(errc::layout_mismatch, "partitioned state: " + *d + " (the global shapes and dtypes must agree)");
}

/// Checks that every part a rank declares lies inside its own tensor: `local_bytes[t]` is
/// the size of the rank's own tensor t. Throws `errc::invalid_argument` naming the rank,
/// tensor and bytes; also refuses parts outside the global shape (as the planner does).
inline void check_holdings_fit(const layout& global, const holdings& h, std::span<const std::uint64_t> local_bytes,
                               const std::string& who) {
  if (h.of_tensor.size() != global.tensor_count() || local_bytes.size() != global.tensor_count())
    throw error(errc::invalid_argument, who + ": holdings for " + std::to_string(h.of_tensor.size()) + " tensors and " +
                                            std::to_string(local_bytes.size()) + " own tensors; the global layout has " +
                                            std::to_string(global.tensor_count()));
  for (std::uint32_t t = 0; t < global.tensor_count(); ++t)
    for (const auto& p : h.of_tensor[t]) {
      std::vector<byte_run> runs;
      detail::part_runs(global, t, p, who, runs);
      std::uint64_t bytes = 0;
      for (const auto& r : runs) bytes += r.length;
      if (p.local_offset > local_bytes[t] || bytes > local_bytes[t] - p.local_offset)
        throw error(errc::invalid_argument, who + ": tensor '" + detail::qualified_name(global, t) + "': a part of " +
                                                std::to_string(bytes) + " bytes at local offset " + std::to_string(p.local_offset) +
                                                " ends beyond its own tensor of " + std::to_string(local_bytes[t]) + " bytes");
    }
}

}  // namespace deepclone
