#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs the Debian packages the tests need when they
# are missing (Debian 12, as root or through sudo; ninja-build for tests/sanitize.sh, which CI
# runs next), configures, builds and runs every test.
#   tests/run_all.sh [extra ctest arguments, e.g. -L unit]
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(doctest-dev libboost-mpi-dev libopenmpi-dev openmpi-bin libfmt-dev libthrust-dev libxxhash-dev nlohmann-json3-dev python3-matplotlib
          libtorch-dev ninja-build)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "run_all: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

build=${DEEPCLONE_BUILD_DIR:-build}
jobs=$(nproc)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDEEPCLONE_BUILD_TESTS=ON
cmake --build "$build" -j"$jobs"
# mpirun refuses root without these; CI runs as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir "$build" --output-on-failure -j"$jobs" "$@"
