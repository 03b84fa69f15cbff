// End-to-end clones on the in-process transport for the shardings other than split_even
// (whole_tensor, layer_round_robin, single_root) x every pipeline x reconstruction, N in
// {1,2,3,4} sources and M in {1,2,3} clone ranks, as test_clone.cpp does for split_even: each
// clone rank must hold the state of the agreed iteration k bit for bit while the sources train
// on. A translation unit of its own, so that the sanitizer builds (which run split_even only)
// do not compile these eighteen engines.
#include <doctest/doctest.h>

#include <deepclone/deepclone.hpp>

#include "../support/clone_run.hpp"  // clone_all_sizes
#include "clone_matrix.hpp"          // DEEPCLONE_PIPELINES

namespace dc = deepclone;
using dc::testing::clone_all_sizes;

TEST_CASE_TEMPLATE("clone equals the sources' state of iteration k (whole_tensor)", E, DEEPCLONE_PIPELINES(dc::shard::whole_tensor)) {
  clone_all_sizes<E>();
}
TEST_CASE_TEMPLATE("clone equals the sources' state of iteration k (layer_round_robin)", E,
                   DEEPCLONE_PIPELINES(dc::shard::layer_round_robin)) {
  clone_all_sizes<E>();
}
TEST_CASE_TEMPLATE("clone equals the sources' state of iteration k (single_root)", E, DEEPCLONE_PIPELINES(dc::shard::single_root)) {
  clone_all_sizes<E>();
}
