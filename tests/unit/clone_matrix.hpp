// The pipeline x reconstruction matrix of end-to-end clone tests over the in-process
// transport, shared by unit.clone (split_even) and unit.clone_shardings (the other shardings):
// two translation units, so that the sanitizer builds compile only the one they run.
#pragma once

#include <deepclone/deepclone.hpp>

namespace deepclone::testing {

template <class Shard, class Pipeline>
struct both_reconstructions {
  using direct = engine<inproc::communicator, Shard, Pipeline, reconstruct::direct>;
  using scatter = engine<inproc::communicator, Shard, Pipeline, reconstruct::scatter_exchange>;
};

}  // namespace deepclone::testing

/// Every pipeline, each with both reconstructions, for one sharding: a TEST_CASE_TEMPLATE list.
#define DEEPCLONE_PIPELINES(Shard)                                                                                  \
  ::deepclone::testing::both_reconstructions<Shard, ::deepclone::pipeline::window>::direct,                         \
      ::deepclone::testing::both_reconstructions<Shard, ::deepclone::pipeline::window>::scatter,                    \
      ::deepclone::testing::both_reconstructions<Shard, ::deepclone::pipeline::staged>::direct,                     \
      ::deepclone::testing::both_reconstructions<Shard, ::deepclone::pipeline::staged>::scatter,                    \
      ::deepclone::testing::both_reconstructions<Shard, ::deepclone::pipeline::blocking>::direct,                   \
      ::deepclone::testing::both_reconstructions<Shard, ::deepclone::pipeline::blocking>::scatter
