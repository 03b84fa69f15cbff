// libFuzzer harness: arbitrary bytes into every decoder of received messages (the
// partitioned state's declaration, checksum lists, notices, hellos and refusals included). A decoder
// may only return a value or throw deepclone::error; anything else (a crash, a sanitizer
// report, another exception) is a finding. The first byte picks the decoder; with its top
// bit set the bytes are sealed first (control messages end in a checksum of their bytes,
// which random input almost never matches), so that the fields behind the seal are fuzzed too.
#include <deepclone/deepclone.hpp>
#include <deepclone/detail/wire.hpp>
#include <deepclone/partition_declaration.hpp>
#include <deepclone/partition_transfer.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace dc = deepclone;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  std::span<const std::byte> raw(reinterpret_cast<const std::byte*>(data) + 1, size - 1);
  std::vector<std::byte> sealed;
  if (data[0] & 0x80) {
    dc::detail::writer w;
    w.buffer().assign(raw.begin(), raw.end());
    sealed = dc::detail::seal(w);
  }
  const bool seal = (data[0] & 0x80) && data[0] % 16 > 1;  // layouts and metadata are not sealed
  std::span<const std::byte> b = seal ? std::span<const std::byte>(sealed) : raw;
  try {
    switch ((data[0] & 0x7f) % 16) {
      case 0: { auto l = dc::layout::decode(b); (void)l.fingerprint(); (void)l.encode(); break; }
      case 1: {  // compared as bytes: a NaN hyper-parameter is never == itself
        auto m = dc::metadata::decode(b);
        if (dc::metadata::decode(m.encode()).encode() != m.encode()) __builtin_trap();
        break;
      }
      case 2: (void)dc::detail::request_msg::decode(b); break;
      case 3: (void)dc::detail::decision_msg::decode(b); break;
      case 4: { auto h = dc::detail::group_header::decode(b); if (h.encode().size() != b.size()) __builtin_trap(); break; }
      case 5: (void)dc::detail::meta_header::decode(b); break;
      case 6: (void)dc::detail::status_msg::decode(b); break;
      case 7: (void)dc::detail::summary_msg::decode(b); break;
      case 8: (void)dc::detail::cancel_msg::decode(b); break;
      case 9: { auto m = dc::detail::ack_msg::decode(b); if (m.encode().size() != b.size()) __builtin_trap(); break; }
      case 10: (void)dc::detail::refetch_msg::decode(b); break;
      case 11: (void)dc::detail::digest_msg::decode(b); break;
      case 12: (void)dc::detail::layout_msg::decode(b); break;
      case 13: {  // partitioned state: the global declaration both sides compare
        auto d = dc::global_declaration::decode(b);
        if (!(dc::global_declaration::decode(d.encode()) == d)) __builtin_trap();
        (void)d.fingerprint();
        break;
      }
      case 14: {  // partitioned state: a group's checksum list, for a group of 3 messages
        dc::partition_group g{1, 2, 0, std::vector<dc::partition_message>(3), 0};
        if (auto m = dc::detail::partition_sums::decode_for(b, g, 0); m.transfer == 0 && m.sums.size() != 3) __builtin_trap();
        break;
      }
      case 15: {  // partitioned state: a clone rank's notice (4 sources, 13 layers) and farewell, hello and judge, a refusal
        switch (size % 4) {
          case 0: {
            auto n = dc::detail::partition_notice::decode(b, 2, 4, 13, 3);  // 3 clone ranks: refetch notices too
            if (dc::detail::partition_notice::decode(n.encode(13, 0), 2, 4, 13, 3).layers != n.layers) __builtin_trap();
            break;
          }
          case 1: {
            (void)dc::detail::partition_hello::decode(b);
            dc::layout l;
            l.add_layer({"a", {dc::tensor_desc{"w", 16, dc::dtype::f32, {4}}}});
            const dc::partition_groups none{};
            (void)dc::detail::judge_hello(b, 0, dc::detail::handshake_terms::of(l, none), 0);  // a verdict, never an exception
            break;
          }
          case 3: dc::detail::partition_farewell::check(b, 1, 2, 7); break;
          default: (void)dc::detail::partition_refusal::decode(b);
        }
        break;
      }
    }
  } catch (const dc::error&) {
  }
  return 0;
}
