// Both sides of a partitioned fork prove they agree (partition_declaration.hpp): the global
// declaration round-trips and fingerprints, a mismatch names the tensor and both values,
// holdings must fit a rank's own tensors, and the decoder survives hostile bytes (truncated,
// mutated, oversized counts) with a deepclone::error and bounded allocations.
#include <doctest/doctest.h>

#include <deepclone/partition_declaration.hpp>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "scenarios.hpp"

namespace dc = deepclone;
using namespace partition_test;

// The largest single allocation while `tracking` is set: the decoder must not allocate
// more than the bytes it is given suggest.
namespace {
bool tracking = false;
std::size_t largest = 0;
}  // namespace
void* operator new(std::size_t n) {
  if (tracking && n > largest) largest = n;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace {

void refused(const std::function<void()>& f, dc::errc kind, const std::string& needle) {
  try {
    f();
    FAIL("accepted; expected a refusal with: " << needle);
  } catch (const dc::error& e) {
    CHECK(e.kind() == kind);
    CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos, e.what());
  }
}

std::vector<std::byte> reseal(std::vector<std::byte> body) {
  dc::detail::writer w;
  w.buffer() = std::move(body);
  return dc::detail::seal(w);
}

/// Decodes hostile bytes: a deepclone::error or a declaration, never anything else, and
/// no allocation above 16 bytes per input byte (plus a little).
void decode_hostile(const std::vector<std::byte>& bytes) {
  largest = 0;
  tracking = true;
  try {
    (void)dc::global_declaration::decode(bytes);
  } catch (const dc::error& e) {
    tracking = false;
    CHECK(e.kind() == dc::errc::corrupt_message);
  }
  tracking = false;
  CHECK_MESSAGE(largest <= 16 * bytes.size() + 4096, "allocated " << largest << " bytes for " << bytes.size() << " input bytes");
}

dc::layout with_tensor(std::uint32_t layer, std::uint32_t index, dc::tensor_desc t) {
  auto layers = two_layer_model().layers();
  layers[layer].tensors[index] = std::move(t);
  return dc::layout(layers);
}

}  // namespace

TEST_CASE("declaration: round-trips, equal layouts agree, the fingerprint tells them apart") {
  const auto lay = two_layer_model();
  const auto d = dc::global_declaration::of(lay);
  REQUIRE(d.tensors.size() == 6);
  CHECK(d.tensors[3].name == "fc2.weight");
  CHECK(d.tensors[3].shape == dims_t{48, 64});
  CHECK(dc::global_declaration::decode(d.encode()) == d);
  CHECK(d.encode().size() < lay.encode().size() + 16);  // compact: no larger than the layout's own encoding
  CHECK_NOTHROW(dc::check_same_global(d, dc::global_declaration::of(two_layer_model()), "clone rank 0"));
  CHECK(d.fingerprint() == dc::global_declaration::of(two_layer_model()).fingerprint());
  CHECK(d.fingerprint() != dc::global_declaration::of(with_tensor(1, 0, tensor("weight", {64, 48}))).fingerprint());
}

TEST_CASE("declaration: a mismatch names the tensor and both values") {
  const auto src = dc::global_declaration::of(two_layer_model());
  auto clone = [&](dc::layout l) { return dc::global_declaration::of(l); };
  refused([&] { dc::check_same_global(src, clone(with_tensor(1, 0, tensor("weight", {64, 48}))), "clone rank 1"); },
          dc::errc::layout_mismatch, "global tensor 3 ('fc2.weight') shape: sources declare [48x64], clone rank 1 declares [64x48]");
  refused([&] { dc::check_same_global(src, clone(with_tensor(0, 1, tensor("bias", {128}, dc::dtype::f16))), "clone rank 0"); },
          dc::errc::layout_mismatch, "('fc1.bias') dtype: sources declare float32, clone rank 0 declares float16");
  refused([&] { dc::check_same_global(src, clone(with_tensor(0, 1, tensor("beta", {64}))), "clone rank 0"); },
          dc::errc::layout_mismatch, "name: sources declare 'fc1.bias', clone rank 0 declares 'fc1.beta'");
  auto fewer = two_layer_model().layers();
  fewer[1].tensors.pop_back();
  refused([&] { dc::check_same_global(src, clone(dc::layout(fewer)), "clone rank 2"); }, dc::errc::layout_mismatch,
          "tensor count: sources declare 6, clone rank 2 declares 5");
  auto inconsistent = tensor("weight", {64, 48});
  inconsistent.bytes -= 4;
  refused([&] { (void)clone(with_tensor(0, 0, inconsistent)); }, dc::errc::invalid_argument,
          "tensor 'fc1.weight' has 12284 bytes, its shape [64x48] of float32 has another size");
}

TEST_CASE("declaration: holdings must fit the rank's own tensors") {
  const auto s = zero1();
  std::vector<std::uint64_t> own(s.lay.tensor_count());
  for (std::uint32_t r = 0; r < 4; ++r) {
    for (std::uint32_t t = 0; t < s.lay.tensor_count(); ++t) own[t] = brute_map(s.lay.tensor(t), s.src[r].of_tensor[t]).size();
    CHECK_NOTHROW(dc::check_holdings_fit(s.lay, s.src[r], own, "source " + std::to_string(r)));
  }
  auto h = s.src[3];  // fc1.weight.adam_m: source 3's flat partition, held densely
  const auto part_bytes = (h.of_tensor[2][0].end - h.of_tensor[2][0].begin) * 4, off = std::uint64_t{4};
  own[2] = part_bytes;
  CHECK_NOTHROW(dc::check_holdings_fit(s.lay, h, own, "clone rank 1"));
  h.of_tensor[2][0].local_offset = off;
  refused([&] { dc::check_holdings_fit(s.lay, h, own, "clone rank 1"); }, dc::errc::invalid_argument,
          "clone rank 1: tensor 'fc1.weight.adam_m': a part of " + std::to_string(part_bytes) + " bytes at local offset 4 ends beyond its own tensor of " +
              std::to_string(part_bytes) + " bytes");
  h.of_tensor[2][0].local_offset = ~0ull;  // an end that wraps around 64 bits
  refused([&] { dc::check_holdings_fit(s.lay, h, own, "clone rank 1"); }, dc::errc::invalid_argument, "at local offset 18446744073709551615");
  refused([&] { dc::check_holdings_fit(s.lay, h, std::vector<std::uint64_t>(5), "clone rank 1"); }, dc::errc::invalid_argument,
          "and 5 own tensors");
}

TEST_CASE("declaration: the decoder refuses truncated, mutated and oversized input with deepclone::error") {
  std::mt19937_64 rng(12);
  auto pick = [&](std::uint64_t n) { return n ? rng() % n : 0; };
  std::vector<std::vector<std::byte>> valid{dc::global_declaration::of(two_layer_model()).encode()};
  for (int i = 0; i < 10; ++i) valid.push_back(dc::global_declaration::of(random_scenario(pick).lay).encode());
  for (const auto& v : valid) {
    for (std::size_t n = 0; n < v.size(); ++n) decode_hostile({v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n)});
    const std::vector<std::byte> body(v.begin(), v.end() - 8);
    for (int round = 0; round < 300; ++round) {
      auto sealed = v, inner = body;  // a flipped byte in the sealed form; the same in the body, resealed
      sealed[pick(sealed.size())] ^= std::byte(static_cast<std::uint8_t>(1 + pick(255)));
      for (auto k = 1 + pick(3); k-- > 0;) inner[pick(inner.size())] = std::byte(static_cast<std::uint8_t>(pick(256)));
      CHECK_THROWS_AS(dc::global_declaration::decode(sealed), dc::error);
      decode_hostile(reseal(inner));
    }
  }
  // Counts far beyond the message: refused before anything is allocated for them.
  auto body_with = [](std::uint32_t layers, std::uint32_t tensors, std::uint8_t rank) {
    dc::detail::writer w;
    w.u32(dc::global_declaration::magic), w.u32(dc::global_declaration::version), w.u32(layers);
    w.str("fc1"), w.u32(tensors), w.str("w"), w.u8(10), w.u8(rank), w.u64(4), w.u64(4);
    return w.take();
  };
  CHECK_NOTHROW(dc::global_declaration::decode(reseal(body_with(1, 1, 2))));
  refused([&] { dc::global_declaration::decode(reseal(body_with(0xFFFFFFFF, 1, 2))); }, dc::errc::corrupt_message, "layer count 4294967295 exceeds the message");
  refused([&] { dc::global_declaration::decode(reseal(body_with(1, 0x7FFFFFFF, 2))); }, dc::errc::corrupt_message, "tensor count 2147483647 of layer 0");
  refused([&] { dc::global_declaration::decode(reseal(body_with(1, 1, 200))); }, dc::errc::corrupt_message, "tensor 'w': rank 200 exceeds");
  auto big = body_with(1, 1, 2);
  for (int i = 0; i < 8; ++i) big[big.size() - 1 - static_cast<std::size_t>(i)] = std::byte{0xFF};
  refused([&] { dc::global_declaration::decode(reseal(big)); }, dc::errc::corrupt_message, "shape overflows 64 bits");
  refused([&] { dc::global_declaration::decode(reseal({})); }, dc::errc::corrupt_message, "truncated");
  for (const auto& v : {body_with(0xFFFFFFFF, 1, 2), body_with(1, 0xFFFFFFFF, 2)}) decode_hostile(reseal(v));
}
