#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang++ (-fsanitize=fuzzer,address,undefined) and
# runs each for a bounded time. Usage: tests/fuzz/run_fuzz.sh [seconds per harness] [build dir]
set -euo pipefail
secs=${1:-20}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${2:-$root/build-fuzz}
cxx=${CLANGXX:-$(command -v clang++ || command -v clang++-14)}
mkdir -p "$out"
for h in decode plan; do
  "$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I "$root/include" "$here/fuzz_$h.cpp" -o "$out/fuzz_$h"
  mkdir -p "$out/corpus_$h"
  echo "== fuzz_$h: $secs s"
  "$out/fuzz_$h" -max_total_time="$secs" -print_final_stats=1 "$out/corpus_$h" 2>&1 | grep -E "stat::number_of_executed_units|Done|ERROR|SUMMARY|crash" || true
  test "${PIPESTATUS[0]}" -eq 0
done
echo "fuzz: OK"
