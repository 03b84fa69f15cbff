#!/usr/bin/env bash
# Sanitizer builds of the tests (CI runs this after tests/run_all.sh): the unit tests and the
# in-process fault tests and the partitioned plan, transfer and engine with AddressSanitizer +
# UndefinedBehaviorSanitizer, the in-process tests (unit.transport, unit.clone, unit.agreement,
# unit.failover, fault.matrix, fault.reuse, fault.campaign, partition.transfer,
# partition.failover, partition.engine) with ThreadSanitizer.
# unit.clone, unit.failover and fault.matrix run subsets of their cases (doctest filters), and
# fault.campaign a few seeds (CAMPAIGN_ASAN_SEEDS, CAMPAIGN_TSAN_SEEDS; engine timeout 3 s).
# The builds take most of the time: they use Ninja where it is installed (CMake's Makefiles
# build the targets named on one command line one after another, each a single translation
# unit, so on one core) and line tables only (-g1: symbolized stacks, a quarter less compile).
# Usage: tests/sanitize.sh [asan|tsan|all]   (build dirs: build-asan, build-tsan)
set -euo pipefail
what=${1:-all}
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${JOBS:-$(nproc)}
clone_filter='-tc=*split_even*,checksum::none*,*second clone*'
# Seeds of fault.campaign: every engine instantiation, a silenced rank, a cancelling clone.
campaign_asan_seeds=${CAMPAIGN_ASAN_SEEDS:-1,2,7,8,22,24}
campaign_tsan_seeds=${CAMPAIGN_TSAN_SEEDS:-1,7,8,24}
run() { echo "+ $*"; "$@"; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# configure DIR FLAGS: a Debug build (line tables only) with FLAGS, in DIR; a DIR configured
# with another generator starts afresh.
configure() {
  local cache=$1/CMakeCache.txt
  if [[ -f $cache ]] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=${generator[1]:-${CMAKE_GENERATOR:-Unix Makefiles}}\$" "$cache"; then rm -rf "$1"; fi
  run cmake -S "$root" -B "$1" "${generator[@]}" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DDEEPCLONE_CUDA=OFF \
    -DDEEPCLONE_BUILD_BENCH=OFF -DDEEPCLONE_BUILD_EXAMPLES=OFF -DCMAKE_CXX_FLAGS="$2" >/dev/null
}

if [[ $what == asan || $what == all ]]; then
  b=$root/build-asan
  configure "$b" "-O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  units=(plan transport agreement errors training failover link spill)
  [[ -f /usr/include/xxhash.h ]] && units+=(xxhash)
  run cmake --build "$b" -j"$jobs" --target unit.clone fault.matrix fault.input fault.reuse fault.campaign partition.plan partition.transfer partition.failover partition.engine "${units[@]/#/unit.}"
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  for t in "${units[@]}"; do run "$b/tests/unit/unit.$t"; done
  run "$b/tests/partition/partition.plan"
  run "$b/tests/partition/partition.transfer"
  run "$b/tests/partition/partition.failover"
  run "$b/tests/partition/partition.engine"
  run "$b/tests/unit/unit.clone" "$clone_filter"
  run "$b/tests/fault/fault.matrix" -tc='*control*,*corrupt*,*silenced coordinator*'
  run "$b/tests/fault/fault.input" -tce='*64 MiB*'
  run "$b/tests/fault/fault.reuse"
  run env DEEPCLONE_CAMPAIGN_SEEDS="$campaign_asan_seeds" DEEPCLONE_CAMPAIGN_TIMEOUT_MS=3000 "$b/tests/fault/fault.campaign"
fi
if [[ $what == tsan || $what == all ]]; then
  b=$root/build-tsan
  configure "$b" "-O1 -fsanitize=thread -fno-omit-frame-pointer"
  run cmake --build "$b" -j"$jobs" --target unit.transport unit.clone unit.agreement unit.failover fault.matrix fault.reuse fault.campaign partition.transfer partition.failover partition.engine
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
  run "$b/tests/unit/unit.transport"
  run "$b/tests/partition/partition.transfer"
  run "$b/tests/partition/partition.failover"
  run "$b/tests/partition/partition.engine"
  run "$b/tests/unit/unit.agreement"
  run "$b/tests/unit/unit.clone" "$clone_filter"
  run "$b/tests/unit/unit.failover" -tc='*corrupted piece*,*verify_replicas: every*,*digest never*'
  run "$b/tests/fault/fault.matrix" -tc='*control*,*corrupt*,*duplicate*,*silenced source*'
  run "$b/tests/fault/fault.reuse" -tc='reuse:*,poll:*,hostile: oversized*'
  run env DEEPCLONE_CAMPAIGN_SEEDS="$campaign_tsan_seeds" DEEPCLONE_CAMPAIGN_TIMEOUT_MS=3000 "$b/tests/fault/fault.campaign"
fi
echo "sanitize: OK"
