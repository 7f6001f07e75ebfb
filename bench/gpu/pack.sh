#!/usr/bin/env bash
# Packs side_by_side.sh for a GPU machine reached through one call with a 64 MiB payload (the
# device tool): .gpu/ in the checkout (kept out of git through .git/info/exclude) with the CUDA
# build of bertkit (stripped, gzipped), the data prepare.sh makes, these scripts and run.sh.
# There, `bash .gpu/run.sh` runs the comparison (PyTorch and transformers installed there; the
# binary finds CUDA's libraries in PyTorch's nvidia packages) and prints the table;
# `bash .gpu/kernels_check.sh` runs the CUDA kernels' check and profile first, then the same.
#
# Usage: bench/gpu/pack.sh [MIRROR]      (MIRROR: the shared data folder, ../shared/data)
#   BIN=path  packs that CUDA binary instead of building one (make build-train FEATURES=cuda,
#   which needs nvcc: ../shared/cuda/setup-cuda-build.sh, then source ~/.cache/cuda-build/env.sh;
#   CUDA_COMPUTE_CAP=90 for H100/H200 is the default here).
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
cd "$repo"
mirror=$(readlink -f "${1:-../shared/data}")
gpu=$repo/.gpu
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
if [[ -z ${BIN:-} ]]; then
    make build-train FEATURES=cuda CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
    BIN=$(cargo metadata --no-deps --format-version 1 \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/cuda/release/bertkit
fi
rm -rf "$gpu" && mkdir -p "$gpu"
strip -o "$gpu/bertkit" "$BIN" && gzip -9 "$gpu/bertkit"
# The data stages are the binary's CPU part: any build makes the same records.
cpu_bin=$(cargo metadata --no-deps --format-version 1 \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/bertkit
[[ -x $cpu_bin ]] || cargo build --release --locked -p bertkit
bash bench/gpu/prepare.sh "$cpu_bin" "$mirror" "$gpu/data" > /dev/null
cp bench/gpu/side_by_side.sh bench/gpu/torch_peer.py bench/gpu/table.py bench/gpu/kernels_check.sh \
    bench/gpu/ncu_summary.py "$gpu/"
# What every script run there sources first: CUDA's libraries from PyTorch's nvidia packages,
# and the binary unpacked to /tmp/bertkit.
cat > "$gpu/env.sh" <<'ENV'
# shellcheck shell=bash
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for site in $(python3 -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null); do
    for lib in "$site"/cu13/lib "$site"/nccl/lib; do
        [[ -d $lib ]] && LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    done
done
export LD_LIBRARY_PATH PYTHONUNBUFFERED=1
gunzip -c "$here/bertkit.gz" > /tmp/bertkit && chmod +x /tmp/bertkit
ENV
cat > "$gpu/run.sh" <<'RUN'
#!/usr/bin/env bash
# On the GPU machine: bash .gpu/run.sh (OUT: where logs and results go; QUICK=1: phase 1 only).
# shellcheck disable=SC1091
source "$(dirname "$0")/env.sh"
exec bash "$here/side_by_side.sh" --bertkit /tmp/bertkit --python python3 --data "$here/data"
RUN
chmod +x "$gpu/run.sh"
du -sh "$gpu"
