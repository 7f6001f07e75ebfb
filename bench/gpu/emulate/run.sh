#!/usr/bin/env bash
# Builds and runs the CPU emulation of bertkit's CUDA kernels written in plain CUDA C (check.cpp:
# the one-pass attention, the embedding lookup, the loss, the optimiser's in-place update):
# their indexing, tiling and synchronisation checked without a GPU, before a device run spends
# time on them. Needs g++ 10 or later (C++20), on Linux (the shim's threads switch by their own
# instructions on x86-64, by `swapcontext` elsewhere). Usage: bash bench/gpu/emulate/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$here/../../..
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
out=$dir/check
# (On x86-64 the binary is not marked for the CPU's shadow stack, which the shim's own switch
# between stacks would break where the system enforces it.)
flags=()
[[ $(uname -m) == x86_64 ]] && flags+=(-fcf-protection=none)
g++ -std=c++20 -O2 -fno-strict-aliasing ${flags[@]+"${flags[@]}"} -Wall -Wno-unknown-pragmas -I "$here/shim" \
    -I "$root/crates/kernels/src/cuda" -I "$root/crates/train/src" \
    -include "$here/shim/emulation.h" "$here/check.cpp" -o "$out"
"$out"
