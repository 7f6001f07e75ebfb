#!/usr/bin/env bash
# On a GPU machine, from a pack (bench/gpu/pack.sh, which copies this file): the fused CUDA
# kernels checked against their CPU twins (f32, bf16, f16), the optimiser step alone
# (OPTIMIZER=0 skips it), phase 1's and 2's steps, then the whole side-by-side table beside
# PyTorch (side_by_side.sh, which also profiles a training pass per kernel; QUICK=1: phase 1
# only; SIDE_SECONDS: its time limit, 480; SIDE=0 skips it). EXTRA=1 adds the device pool's
# memory against the plan (as built and with the lean feed-forward) and phase 1 in fp16.
# PROFILE=1 adds the sections (throughput, occupancy, stalls) of the attention's, a linear
# layer's end's and LayerNorm's kernels, and ncu's time per kernel over two optimiser steps and
# over two training passes (ncu_summary.py).
# Steps run in the order of what they decide (the end of the file): a call cut off by its time
# limit keeps what came first.
# Usage: bash .gpu/kernels_check.sh   (OUT: where the logs go)
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/env.sh"
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
# Everything this prints is also kept in $out (a device call returns only its output's tail;
# the files under $OUT come back whole).
exec > >(tee -a "$out/kernels_check.log") 2>&1
b=/tmp/bertkit
log() { echo "=== $(date -u +%T) $*"; }
# BERT-large phase 1 for 12 steps at micro-batch 64 from the shipped recipe, in precision $2,
# writing nothing but its logs under /tmp/$1 (the settings come from the caller's environment);
# phase 2 (seq 512, 80 predictions, micro-batch 8, from random weights) where $3 is phase2.
phase1() {
    local records=phase1 predictions=20 micro=64
    [[ ${3:-} == phase2 ]] && records=phase2 predictions=80 micro=8
    rm -rf "/tmp/$1"
    sed -e "s|^output = .*|output = \"/tmp/$1\"|" \
        -e "s|^records = .*|records = [\"$here/data/records/$records\"]|" \
        -e "s|^max_predictions = .*|max_predictions = $predictions|" \
        -e 's|^preset = .*|preset = "large"|' -e "s|^precision = .*|precision = \"$2\"|" \
        "$here/data/pipelines/pretrain-phase1.toml" > "/tmp/$1.toml"
    timeout 120 $b pretrain --config "/tmp/$1.toml" --no-eval --no-checkpoints --device cuda \
        --max-steps 12 --micro-batch $micro --global-batch $micro 2>&1
}
log "environment"
$b --version
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
log "1 bertkit check kernels --device cuda"
timeout 240 $b check kernels --device cuda --dtype f32,bf16,f16 > "$out/check.txt" 2>&1
echo "rc $? (lines not ok, of $(wc -l < "$out/check.txt"); all in check.txt)"
grep -v " ok$" "$out/check.txt"
optimizer_step() {
    local rule
    for rule in lamb adamw; do
        log "2 the optimiser step alone: BERT-large, $rule, bf16 model (f32 state)"
        timeout 120 $b bench optimizer --config large --rule "$rule" --dtype bf16 --device cuda \
            2>&1 | tail -n 2
    done
}
phase_steps() {
    log "2c phase 1 and 2, 12 steps each"
    phase1 row bf16 | grep -E "a step|start-up"
    phase1 row bf16 phase2 | grep -E "a step" | sed "s|^|phase 2: |"
}
side_by_side() {
    log "3 the side-by-side table"
    OUT="$out/side" timeout "${SIDE_SECONDS:-480}" \
        bash "$here/side_by_side.sh" --bertkit "$b" --python python3 --data "$here/data"
    echo "rc $?"
    grep -h "checkpoint\|first step" "$out"/side/phase*.log 2>/dev/null
}
# The optimiser step's kernels, each one's own time over two steps (`bench optimizer` runs one
# untimed, then --steps): beside its wall-clock update phase, what is host time.
optimizer_kernels() {
    local file=$out/ncu-optimizer.csv
    log "2d'' ncu: the optimiser step's kernels (LAMB, BERT-large, two steps)"
    timeout 120 ncu --clock-control none --csv --print-units base \
        --metrics gpu__time_duration.sum -k regex:'update_|trust_ratios|pieces_to_flat|squares|sum_partials' \
        $b bench optimizer --config large --dtype bf16 --device cuda --steps 1 > "$file" 2>&1
    python3 "$here/ncu_summary.py" "$file" --passes 2 --top 12 || tail -n 3 "$file"
}
memory() {
    log "2b bench memory on the device (the pool's peak against the plan): phase 1 at micro-batch 64, phase 2 at 8 (bf16)"
    local shape records predictions micro accumulation
    for shape in "phase1 20 64 1" "phase2 80 8 1"; do
        read -r records predictions micro accumulation <<< "$shape"
        timeout 120 $b bench memory --config "$here/data/pipelines/pretrain-phase1.toml" \
            --data "$here/data/records/$records" --preset large --precision bf16 --device cuda \
            --predictions "$predictions" --micro-batch "$micro" --accumulation "$accumulation" \
            --steps 2 2>&1 | tail -n 1
    done
    # Phase 2, six steps as built and with the lean feed-forward (its GELU recomputed, fewer
    # tensors kept, where the plan takes the full one on this GPU): what it costs in step time
    # and what it leaves of the pool's held peak.
    local form config
    for form in auto lean; do
        log "2b' phase 2, micro-batch 8, six steps, the feed-forward: $form"
        config=/tmp/pretrain-$form.toml
        sed "s|^\[train\]$|[train]\nfeed_forward = \"$form\"|" \
            "$here/data/pipelines/pretrain-phase1.toml" > "$config"
        timeout 120 $b bench memory --config "$config" --data "$here/data/records/phase2" \
            --preset large --precision bf16 --device cuda --predictions 80 --micro-batch 8 \
            --steps 6 2>&1 | tail -n 1
    done
    # Where the pool grows (BERTKIT_CUDA_POOL_TRACE=on: a line each time it takes 32 MiB or
    # more from the driver, at the op or stage), three steps: the whole trace in $out, its
    # last lines here.
    log "2b'' phase 2, micro-batch 8, three steps, the pool's growth traced"
    BERTKIT_CUDA_POOL_TRACE=on timeout 120 $b bench memory \
        --config "$here/data/pipelines/pretrain-phase1.toml" --data "$here/data/records/phase2" \
        --preset large --precision bf16 --device cuda --predictions 80 --micro-batch 8 \
        --steps 3 > "$out/pool-trace.txt" 2>&1
    grep -c '^pool:' "$out/pool-trace.txt"
    grep '^pool:' "$out/pool-trace.txt" | tail -n 12
}
fp16() {
    log "2f phase 1 in fp16, 12 steps (the kernels' f16 forms)"
    phase1 fp16 fp16 | grep -E "a step|start-up|loss" | tail -n 3
}
large2() {
    python3 -c 'import json,sys; json.dump({"architectures":["BertForPreTraining"],"model_type":"bert","vocab_size":30522,"hidden_size":1024,"num_hidden_layers":2,"num_attention_heads":16,"intermediate_size":4096,"hidden_act":"gelu","hidden_dropout_prob":0.1,"attention_probs_dropout_prob":0.1,"max_position_embeddings":512,"type_vocab_size":2,"initializer_range":0.02,"layer_norm_eps":1e-12}, open("/tmp/large2.json","w"))'
}
# Each kernel's own time (ncu replays them one by one: no overlap, no launch gaps) over two
# training passes of a 2-layer BERT-large at phase 1's shape: which launches the layers, the
# autograd and the heads are made of.
pass_kernels() {
    large2
    local pass file
    # Two training passes, then two inference passes (nothing tracked).
    for pass in training inference; do
        file=$out/ncu.csv
        [[ $pass == inference ]] && file=$out/ncu-inference.csv
        log "2d ncu: the kernels of two $pass passes, 2-layer BERT-large, batch 64 x 128, bf16"
        # shellcheck disable=SC2046
        timeout 300 ncu --clock-control none --csv --print-units base \
            --metrics gpu__time_duration.sum $b bench kernels --config /tmp/large2.json \
            --batch 64 --seq 128 --dtype bf16 --device cuda --passes 1 \
            $([[ $pass == inference ]] && echo --inference) > "$file" 2> "${file%.csv}.err"
        echo "rc $?"
        python3 "$here/ncu_summary.py" "$file" --passes 2 --top 45 || tail -n 5 "${file%.csv}.err"
        # The same launches by shape (grid x block): which of a layer's products is slow.
        echo "by launch shape:"
        python3 "$here/ncu_summary.py" "$file" --passes 2 --top 40 --by-shape | cut -c1-120
    done
}
# Why the costliest kernels take what they take (throughput, occupancy, stall reasons): the
# attention's, a linear layer's end's and LayerNorm's kernels over a 2-layer model's passes.
# Whole sections in the logs, the headlines in ncu-headlines.txt.
sections() {
    log "2d' ncu sections: the attention, a linear layer's end, LayerNorm, then the backward's kernels"
    large2
    timeout 120 ncu --clock-control none -k regex:'flash_|bias_act|layer_norm' \
        --launch-count 16 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis $b bench kernels --config /tmp/large2.json --batch 64 \
        --seq 128 --dtype bf16 --device cuda --passes 1 > "$out/ncu-sections.txt" 2>&1
    # The backward's own: what bounds them.
    timeout 120 ncu --clock-control none -k regex:'backward|delta' \
        --launch-count 16 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis $b bench kernels --config /tmp/large2.json --batch 64 \
        --seq 128 --dtype bf16 --device cuda --passes 1 >> "$out/ncu-sections.txt" 2>&1
    grep -hE "^  [a-z_]+.*Context|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Compute \(SM\) Throughput" \
        "$out/ncu-sections.txt" | cut -c1-110 > "$out/ncu-headlines.txt"
    echo "ncu headlines: $(wc -l < "$out/ncu-headlines.txt") lines in ncu-headlines.txt"
}
profile=
[[ -n ${PROFILE:-} ]] && command -v ncu > /dev/null && profile=1
[[ ${OPTIMIZER:-1} != 0 ]] && optimizer_step
phase_steps
[[ ${SIDE:-1} != 0 ]] && side_by_side
[[ -n $profile ]] && sections
if [[ -n ${EXTRA:-} ]]; then
    memory
    fp16
fi
[[ -n $profile ]] && pass_kernels
[[ -n $profile ]] && optimizer_kernels
exit 0
