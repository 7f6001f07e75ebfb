#!/usr/bin/env bash
# Builds and runs the CPU emulation of bertkit's CUDA kernels written in plain CUDA C (check.cpp:
# the one-pass attention, the embedding lookup, the loss, the optimiser's in-place update):
# their indexing, tiling and synchronisation checked without a GPU, before a device run spends
# time on them. Needs g++ 11 or later (C++20 <barrier>). Usage: bash bench/gpu/emulate/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$here/../../..
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
out=$dir/check
g++ -std=c++20 -O2 -fno-strict-aliasing -pthread -Wall -Wno-unknown-pragmas -I "$here/shim" \
    -I "$root/crates/model/src/kernels/cuda" -I "$root/crates/train/src" \
    -include "$here/shim/emulation.h" "$here/check.cpp" -o "$out"
"$out"
