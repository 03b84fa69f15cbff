#!/usr/bin/env bash
# deepclone GPU check: builds and runs the CUDA tests, the CUDA example and a short
# benchmark on a machine with one GPU. Needs only nvcc, CMake (>= 3.21), ninja and a C++20
# host compiler: no Debian packages, no MPI, no Boost, no doctest (the CUDA tests carry
# their own tiny harness, tests/cuda/check.hpp; the rest of the test suite is skipped at
# configure time when doctest is absent). Takes well under 5 minutes on an H100/H200.
#
#   tests/cuda/gpu_check.sh                 # build in ./build-gpu-check, run, print figures
#   BUILD_DIR=/tmp/b CUDA_ARCH=80 tests/cuda/gpu_check.sh
#
# Exit status: 0 all passed; 1 a test failed or was skipped (no usable GPU) or the build failed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="${BUILD_DIR:-$root/build-gpu-check}"
arch="${CUDA_ARCH:-90}"              # sm_90: H100/H200; one architecture keeps nvcc fast
jobs="${JOBS:-$(nproc 2>/dev/null || echo 4)}"
log="$build/gpu_check.log"

if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /opt/cuda/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break; done
fi
command -v nvcc >/dev/null 2>&1 || { echo "gpu_check: nvcc not found (set PATH)"; exit 1; }
command -v cmake >/dev/null 2>&1 || { echo "gpu_check: cmake not found"; exit 1; }
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)

mkdir -p "$build"
exec > >(tee "$log") 2>&1
echo "== deepclone gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
nvcc --version | tail -n 2
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
start=$(date +%s)

echo "== configure (CUDA architectures: $arch)"
cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" -DCMAKE_CUDA_ARCHITECTURES="$arch" -DDEEPCLONE_CUDA=ON \
  -DDEEPCLONE_BUILD_TESTS=ON -DDEEPCLONE_BUILD_EXAMPLES=OFF -DDEEPCLONE_BUILD_BENCH=OFF -DDEEPCLONE_INSTALL=OFF \
  | grep -E "deepclone|CUDA|Error|error" || true

echo "== build (-j$jobs)"
cmake --build "$build" -j "$jobs" --target cuda.device cuda.bench example.cuda_fork
echo "   built in $(( $(date +%s) - start )) s"

echo "== ctest -L cuda-build"
set +e
( cd "$build" && ctest -L cuda-build --output-on-failure --timeout 300 ) | tee "$build/ctest.out"
rc=${PIPESTATUS[0]}
set -e
if grep -q "Skipped\|Not Run" "$build/ctest.out"; then
  echo "gpu_check: CUDA tests were SKIPPED: no usable GPU on this machine"
  exit 1
fi
[ "$rc" -eq 0 ] || { echo "gpu_check: CUDA tests FAILED"; exit 1; }

echo "== benchmark (D2H staging bandwidth; bert_large clone between two rank groups on one GPU)"
timeout 240 "$build/tests/cuda/cuda.bench"
echo "== gpu_check passed in $(( $(date +%s) - start )) s; log: $log"
