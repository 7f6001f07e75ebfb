#!/usr/bin/env bash
# On a GPU machine, from a pack (bench/gpu/pack.sh, which copies this file): the fused CUDA
# kernels checked against their CPU twins, the optimiser step alone (composed and fused), then the whole
# side-by-side table beside PyTorch (side_by_side.sh, which also profiles a training pass per
# kernel; QUICK=1: phase 1 only; SIDE_SECONDS: its time limit, 420). EXTRA=1 adds the device
# pool's memory figures, and phase 1 with the pool keeping freed memory and with the optimiser
# updating in place (none yet run on a device).
# Usage: bash .gpu/kernels_check.sh   (OUT: where the logs go)
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/env.sh"
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
b=/tmp/bertkit
log() { echo "=== $(date -u +%T) $*"; }
log "environment"
$b --version
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
log "1 bertkit check kernels --device cuda"
timeout 180 $b check kernels --device cuda --dtype f32,bf16 > "$out/check.txt" 2>&1
echo "rc $? (lines not ok, of $(wc -l < "$out/check.txt"); all in check.txt)"
grep -v " ok$" "$out/check.txt"
# (side_by_side.sh profiles a training pass per kernel itself, step 3b.)
for optimizer in composed fused inplace; do
    log "2 the optimiser step alone: BERT-large, LAMB, bf16 model (f32 state), BERTKIT_CUDA_OPTIMIZER=$optimizer"
    BERTKIT_CUDA_OPTIMIZER=$optimizer timeout 120 $b bench optimizer --config large --dtype bf16 \
        --device cuda 2>&1 | tail -n 2
done
if [[ -n ${EXTRA:-} ]]; then
    # Not yet run on a device: the device pool's high-water mark against the plan, and phase 1
    # with the pool keeping freed memory (BERTKIT_CUDA_POOL_KEEP=1) against without.
    log "2b bench memory on the device (the pool's peak against the plan): phase 1 at micro-batch 64 and the recipe's 256, phase 2 at 8 and the recipe's 64 (bf16)"
    for shape in "phase1 20 64" "phase1 20 256" "phase2 80 8" "phase2 80 64"; do
        read -r records predictions micro <<< "$shape"
        timeout 120 $b bench memory --config "$here/data/pipelines/pretrain-phase1.toml" \
            --data "$here/data/records/$records" --preset large --precision bf16 --device cuda \
            --predictions "$predictions" --micro-batch "$micro" --steps 2 2>&1 | tail -n 1
    done
    log "2c phase 1, 12 steps: the pool keeping freed memory or not, the optimiser's update in place or not"
    for form in "0 fused" "1 fused" "0 inplace"; do
        read -r keep optimizer <<< "$form"
        rm -rf /tmp/keep-$keep
        sed -e "s|^output = .*|output = \"/tmp/keep-$keep\"|" \
            -e "s|^records = .*|records = [\"$here/data/records/phase1\"]|" \
            -e 's|^preset = .*|preset = "large"|' -e 's|^precision = .*|precision = "bf16"|' \
            "$here/data/pipelines/pretrain-phase1.toml" > /tmp/keep-$keep.toml
        BERTKIT_CUDA_POOL_KEEP=$keep BERTKIT_CUDA_OPTIMIZER=$optimizer timeout 120 $b pretrain \
            --config /tmp/keep-$keep.toml --no-eval --device cuda --max-steps 12 --micro-batch 64 \
            --global-batch 64 2>&1 | grep -E "a step|start-up" | sed "s/^/keep=$keep $optimizer: /"
    done
fi
log "3 the side-by-side table"
OUT=$out/side timeout "${SIDE_SECONDS:-420}" \
    bash "$here/side_by_side.sh" --bertkit "$b" --python python3 --data "$here/data"
echo "rc $?"
grep -h "checkpoint\|first step" "$out"/side/phase*.log 2>/dev/null
