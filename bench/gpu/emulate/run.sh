#!/usr/bin/env bash
# Builds and runs the CPU emulation of the one-pass attention kernels (flash_check.cpp): their
# indexing, tiling and synchronisation checked without a GPU, before a device run spends time on
# them. Needs g++ 11 or later (C++20 <barrier>). Usage: bash bench/gpu/emulate/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
kernels=$here/../../../crates/model/src/kernels/cuda
out=${TMPDIR:-/tmp}/bertkit-flash-emulation
g++ -std=c++20 -O2 -pthread -Wall -Wno-unknown-pragmas -I "$here/shim" -I "$kernels" \
    -include "$here/shim/emulation.h" "$here/flash_check.cpp" -o "$out"
"$out"
