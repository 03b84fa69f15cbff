// Compile-time probe for issue 11, item 2. Compiled only (no main), with
//   time g++ -std=c++20 -O2 -g -DNDEBUG -Iinclude -DDEEPCLONE_PROBE_TYPES=4 -c bench/compile/engine_types.cpp -o /dev/null
// DEEPCLONE_PROBE_TYPES (1 to 4): one engine over `inproc`, its source and clone driven for
// that many tensor types. DEEPCLONE_PROBE_ENGINES (1 to 4): that many engines over one tensor
// type, differing in their sharding and reconstruction policies only (window pipeline,
// coordinator agreement, mix64 checksums throughout). docs/performance.md, "Compile time of an
// engine instantiation", has the figures.
#include <cstdint>
#include <span>
#include <vector>

#include <deepclone/engine.hpp>
#include <deepclone/inproc.hpp>

#ifndef DEEPCLONE_PROBE_TYPES
#define DEEPCLONE_PROBE_TYPES 1
#endif
#ifndef DEEPCLONE_PROBE_ENGINES
#define DEEPCLONE_PROBE_ENGINES 1
#endif

namespace dc = deepclone;
using comm = dc::inproc::communicator;

template <class Engine, class T>
void drive(comm& c, const dc::roles& r, T& a, T& b) {
  dc::state<T> st;
  st.add_layer("fc", {{"weight", a}, {"bias", b}});
  if (r.source_index(c.rank())) {
    typename Engine::template source<T> src(c, r, st);
    src.before_update(0);
    src.after_update(0);
    src.end_iteration(0);
    src.finish();
  } else {
    typename Engine::template clone<T> dst(c, r, st);
    dst.request();
    dst.wait();
  }
}

// Explicit instantiations: the compiler generates every hook of both roles for each.
using first = dc::engine<comm>;
template void drive<first>(comm&, const dc::roles&, std::vector<float>&, std::vector<float>&);
#if DEEPCLONE_PROBE_TYPES >= 2
template void drive<first>(comm&, const dc::roles&, std::vector<double>&, std::vector<double>&);
#endif
#if DEEPCLONE_PROBE_TYPES >= 3
template void drive<first>(comm&, const dc::roles&, dc::raw_view<float>&, dc::raw_view<float>&);
#endif
#if DEEPCLONE_PROBE_TYPES >= 4
template void drive<first>(comm&, const dc::roles&, std::span<std::int32_t>&, std::span<std::int32_t>&);
#endif
#if DEEPCLONE_PROBE_ENGINES >= 2
template void drive<dc::engine<comm, dc::shard::whole_tensor>>(comm&, const dc::roles&, std::vector<float>&, std::vector<float>&);
#endif
#if DEEPCLONE_PROBE_ENGINES >= 3
template void drive<dc::engine<comm, dc::shard::split_even, dc::pipeline::window, dc::reconstruct::direct>>(
    comm&, const dc::roles&, std::vector<float>&, std::vector<float>&);
#endif
#if DEEPCLONE_PROBE_ENGINES >= 4
template void drive<dc::engine<comm, dc::shard::layer_round_robin, dc::pipeline::window, dc::reconstruct::direct>>(
    comm&, const dc::roles&, std::vector<float>&, std::vector<float>&);
#endif
