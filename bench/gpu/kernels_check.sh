#!/usr/bin/env bash
# On a GPU machine, from a pack (bench/gpu/pack.sh, which copies this file): the fused CUDA
# kernels checked against their CPU twins (f32, bf16, f16), the optimiser step alone in its
# forms (OPTIMIZER=0 skips it, OPTIMIZER=all adds the composed and by-group forms), then the
# whole side-by-side table beside PyTorch (side_by_side.sh, which also profiles a training pass
# per kernel; QUICK=1: phase 1 only; SIDE_SECONDS: its time limit, 480; SIDE=0 skips it).
# ALL_ON=1 runs the table with every setting whose kernels the check passed. EXTRA=1 adds, for
# each row of `rows` (below: the settings still off by default, bench/gpu/emulate having run
# their CUDA code on the CPU) beside the defaults, phase 1's and 2's steps and a training and an
# inference pass per kernel (before the table), then the device pool's memory against the plan
# and fp16; the rows run without any setting the check failed (a row left with none of its own
# is skipped, saying so). PROFILE=1 adds the sections (throughput, occupancy, stalls) of the
# attention's and a linear layer's end's kernels, each form, and ncu's time per kernel over
# two optimiser steps and over two training passes (ncu_summary.py; with every setting the
# check passed).
# Steps run in the order of what they decide (the end of the file): a call cut off by its time
# limit keeps what came first.
# ROWS=REGEX: only the rows (below) whose settings or label match, beside the defaults.
# PASSES=0: the rows' phase 1 and 2 steps without their passes per kernel (a call that must
# fit every row, the memory rows and the check in its time); PASS_ROWS=REGEX with it: the
# passes of the rows that match it all the same (beside the defaults'), those whose kernels'
# times a step's cannot show. PASS_LONG=1: each row's passes also a training pass at phase 2's
# 8 x 512 (the kernels for long rows). MEMORY_ROWS=REGEX: only the memory rows whose settings
# match (beside the build's own). MEMORY_FIRST=1: the memory rows right after the check (and
# the optimiser's forms), before the rows' steps, for a call whose time may not reach them.
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
check_rc=$?
echo "rc $check_rc (lines not ok, of $(wc -l < "$out/check.txt"); all in check.txt)"
grep -v " ok$" "$out/check.txt"
# A kernel taken by default failed (or the check died: rc above 1, but not a timeout): the
# kept function handles (on by default, host code, not yet run on a GPU) would break every
# launch, so they are the first suspect. The check again with candle's lookup at every launch;
# where that finishes with no default kernel failing, the rest of the call runs with it,
# rather than spend the call on broken launches.
default_failed='a kernel taken by default failed'
if grep -q "$default_failed" "$out/check.txt" || ((check_rc > 1 && check_rc != 124)); then
    log "1b the check again with BERTKIT_CUDA_FUNCTIONS=lookup (candle's lookup at every launch)"
    BERTKIT_CUDA_FUNCTIONS=lookup timeout 240 $b check kernels --device cuda --dtype f32,bf16,f16 \
        > "$out/check-lookup.txt" 2>&1
    lookup_rc=$?
    echo "rc $lookup_rc (lines not ok, of $(wc -l < "$out/check-lookup.txt"); all in check-lookup.txt)"
    grep -v " ok$" "$out/check-lookup.txt"
    # (rc 1: some kernel failed; 124: the check did not finish, which proves nothing.)
    if ((lookup_rc <= 1)) && ! grep -q "$default_failed" "$out/check-lookup.txt"; then
        log "1b the kept function handles failed, the lookup passes: BERTKIT_CUDA_FUNCTIONS=lookup for the rest of the call"
        export BERTKIT_CUDA_FUNCTIONS=lookup
        mv "$out/check.txt" "$out/check-kept-functions.txt"
        cp "$out/check-lookup.txt" "$out/check.txt"
        check_rc=$lookup_rc
    fi
fi
# The settings the check failed (its line "failed or not checked here, leave off: ..."; all
# of them when a kernel taken by default failed): the rows below run without them rather than
# spend the call on a kernel known wrong. `row_settings VAR=VALUE...` keeps in $kept those of
# a row's own settings the check did not fail (the rest in $dropped) and succeeds when the row
# is to be skipped: it had some and none is left (it would repeat the defaults' row).
leave_off=" $(sed -n 's/.*leave off: //p' "$out/check.txt") "
row_settings() {
    local s
    kept=() dropped=
    for s in "$@"; do
        if [[ $leave_off == *" $s "* ]]; then dropped+=" $s"; else kept+=("$s"); fi
    done
    (($# > 0 && ${#kept[@]} == 0))
}
# Each row: the settings it adds to the defaults (none: the defaults), "|", its label: a new
# setting off by default gets a row here (and one with all of them) until a run turns it on.
# (The settings of 2026-11-27's rows passed on an H200 and are on by default.)
# ROWS=REGEX keeps the rows whose line matches it (and the defaults'): a call that cannot
# afford every row (each ~35 s: phase 1, a training and an inference pass).
rows() {
    all_rows | grep -E -- "^- |${ROWS:-.}"
}
all_rows() {
    # (The settings of 2026-11-27's rows passed on an H200 and are on by default; the evening's
    # run turned on the attention's straight kernels, ex2, pair forward and keep bits, the
    # sublayer ends' backward ahead and keep bits, the embeddings' end, the keyed dropout and
    # the linear layers' three; 2026-11-28's evening run LayerNorm's backward a warp a row, the
    # bias gradient's epilogue and sums in registers, the joins, the attention's joint
    # backward and vector delta, and the step without the bucket. The five forms still off then
    # are deleted (BENCHMARKS.md, 2026-12-02).) The pair forward against the asynchronous copies
    # of a block a query tile: a tie in the evening's runs (inference, phase 2), kept as a row.
    # A new setting gets a row of its own here, after the defaults.
    printf '%s\n' "- | the defaults" \
        "BERTKIT_CUDA_FLASH_FORWARD=single BERTKIT_CUDA_FLASH_COPIES=async | the attention's forward a block a query tile, its tiles copied asynchronously (not the pair forward)"
}
# ALL_ON=1: the side-by-side table with every setting whose kernels the check just passed (its
# line "to use them: ..." names them, also when another setting's kernel failed; none when a
# kernel taken by default failed). Only the table: the rows below compare against the defaults.
passed=$(sed -n 's/.*to use them: //p' "$out/check.txt")
side_settings=()
if [[ -n ${ALL_ON:-} ]]; then
    # shellcheck disable=SC2206
    side_settings=($passed)
    log "ALL_ON: the table with ${passed:-no setting (none off by default passed; check rc $check_rc): the defaults}"
fi
# The steps in the order the call spends them: what decides the defaults first (the optimiser's
# forms, phase 1 per row), then the table beside PyTorch, then what explains (the optimiser's
# kernels under ncu, memory, fp16, the kernels per pass, ncu's sections). A call cut off by its
# time limit keeps what came first; every step's output is in $out/kernels_check.log.
optimizer_forms() {
    # (The composed and by-group forms, the per-block ratios and the update an element at a
    # time were measured on 2026-11-27: BENCHMARKS.md; OPTIMIZER=all runs them again.)
    # Each form: the rule, then BERTKIT_CUDA_OPTIMIZER, _TRUST_RATIOS and _UPDATE ("-": unset).
    local forms=("lamb - - -" "adamw - - -")
    [[ ${OPTIMIZER:-1} == all ]] && forms=("lamb composed - -" "lamb by-name - -" \
        "lamb - per-block per-element" "lamb - - per-element" "adamw - - per-element" "${forms[@]}")
    local form rule optimizer ratios update
    for form in "${forms[@]}"; do
        read -r rule optimizer ratios update <<< "$form"
        log "2 the optimiser step alone: BERT-large, $rule, bf16 model (f32 state), BERTKIT_CUDA_OPTIMIZER=$optimizer BERTKIT_CUDA_TRUST_RATIOS=$ratios BERTKIT_CUDA_UPDATE=$update"
        if [[ $ratios != - && $leave_off == *" BERTKIT_CUDA_TRUST_RATIOS=$ratios "* ]] \
            || [[ $update != - && $leave_off == *" BERTKIT_CUDA_UPDATE=$update "* ]]; then
            echo "skipped (a setting of it failed its check)"
            continue
        fi
        BERTKIT_CUDA_OPTIMIZER=$optimizer BERTKIT_CUDA_TRUST_RATIOS=$ratios BERTKIT_CUDA_UPDATE=$update \
            timeout 120 $b bench optimizer --config large --rule "$rule" --dtype bf16 --device cuda \
            2>&1 | tail -n 2
    done
}
phase1_rows() {
    log "2c phase 1 and 2, 12 steps each: each row's settings beside the defaults"
    local row label
    while IFS='|' read -r row label; do
        row=${row% } label=${label# }; [[ $row == - ]] && row=
        # shellcheck disable=SC2086
        if row_settings $row; then echo "$label: skipped (${dropped# } failed its check)"; continue; fi
        label+=${dropped:+ (without$dropped)}
        (
            ((${#kept[@]})) && export "${kept[@]}"
            phase1 row bf16 | grep -E "a step|start-up" | sed "s|^|$label: |"
            phase1 row bf16 phase2 | grep -E "a step" | sed "s|^|$label, phase 2: |"
        )
    done < <(rows)
}
side_by_side() {
    log "3 the side-by-side table${side_settings[*]:+ with ${side_settings[*]}}"
    env "${side_settings[@]}" OUT="$out/side" timeout "${SIDE_SECONDS:-480}" \
        bash "$here/side_by_side.sh" --bertkit "$b" --python python3 --data "$here/data"
    echo "rc $?"
    grep -h "checkpoint\|first step" "$out"/side/phase*.log 2>/dev/null
}
# The optimiser step's kernels, each one's own time over two steps (`bench optimizer` runs one
# untimed, then --steps): beside its wall-clock update phase, what is host time. The defaults
# (2026-11-27: also the per-block ratios, the update an element at a time).
optimizer_kernels() {
    local file=$out/ncu-optimizer.csv
    log "2d'' ncu: the optimiser step's kernels (LAMB, BERT-large, two steps) with the defaults"
    timeout 120 ncu --clock-control none --csv --print-units base \
        --metrics gpu__time_duration.sum -k regex:'update_|trust_ratios|pieces_to_flat|squares|sum_partials' \
        $b bench optimizer --config large --dtype bf16 --device cuda --steps 1 > "$file" 2>&1
    python3 "$here/ncu_summary.py" "$file" --passes 2 --top 12 || tail -n 3 "$file"
}
memory() {
    # (The plan was refitted to five shapes on 2026-11-27; two of them check it.)
    log "2b bench memory on the device (the pool's peak against the plan), the defaults: phase 1 at micro-batch 64, phase 2 at 8 (bf16)"
    local shape records predictions micro accumulation
    for shape in "phase1 20 64 1" "phase2 80 8 1"; do
        read -r records predictions micro accumulation <<< "$shape"
        timeout 120 $b bench memory --config "$here/data/pipelines/pretrain-phase1.toml" \
            --data "$here/data/records/$records" --preset large --precision bf16 --device cuda \
            --predictions "$predictions" --micro-batch "$micro" --accumulation "$accumulation" \
            --steps 2 2>&1 | tail -n 1
    done
    # The pool's spare above its tensors at phase 2 (2,289 MiB with the flat gradient bucket
    # found at each step's end, 2026-11-27; 0.1 GiB without it, the default since 2026-11-28):
    # six steps as the build leaves it; with the bucket found anew at each step's end, and kept
    # from step to step; with the lean feed-forward (its GELU recomputed, ~0.75 GiB fewer
    # tensors at phase 2, where the plan takes the full one on this GPU): what each costs in
    # step time and tensors, and the pool's held peak it leaves (and its marks after each step).
    local setting word
    for setting in "" BERTKIT_BUCKET=flat BERTKIT_BUCKET=kept BERTKIT_CUDA_FEED_FORWARD=lean; do
        # (MEMORY_ROWS=REGEX keeps those whose settings match it, and the build's own.)
        if [[ -n $setting && ! $setting =~ ${MEMORY_ROWS:-.} ]]; then
            continue
        fi
        for word in $setting; do
            if [[ $leave_off == *" $word "* ]]; then
                echo "$setting: skipped ($word failed its check)"
                continue 2
            fi
        done
        log "2b' phase 2, micro-batch 8, six steps, ${setting:-as built}"
        # shellcheck disable=SC2086
        env $setting timeout 120 $b bench memory \
            --config "$here/data/pipelines/pretrain-phase1.toml" --data "$here/data/records/phase2" \
            --preset large --precision bf16 --device cuda --predictions 80 --micro-batch 8 \
            --steps 6 2>&1 | tail -n 1
    done
    # Where the pool grows (BERTKIT_CUDA_POOL_TRACE=on: a line each time it takes 32 MiB or
    # more from the driver, at the op or stage), three steps as built and with the bucket:
    # the whole trace in $out, its last lines here.
    for setting in "" BERTKIT_BUCKET=flat; do
        log "2b'' phase 2, micro-batch 8, three steps, the pool's growth traced, ${setting:-as built}"
        # shellcheck disable=SC2086
        env $setting BERTKIT_CUDA_POOL_TRACE=on timeout 120 $b bench memory \
            --config "$here/data/pipelines/pretrain-phase1.toml" --data "$here/data/records/phase2" \
            --preset large --precision bf16 --device cuda --predictions 80 --micro-batch 8 \
            --steps 3 > "$out/pool-trace${setting:+-${setting#*=}}.txt" 2>&1
        grep -c '^pool:' "$out/pool-trace${setting:+-${setting#*=}}.txt"
        grep '^pool:' "$out/pool-trace${setting:+-${setting#*=}}.txt" | tail -n 12
    done
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
# autograd and the heads are made of. With every new setting the check passed (the defaults'
# kernels were profiled on 2026-11-27): where the time goes once they are on.
pass_kernels() {
    large2
    local pass file
    # Two training passes, then two inference passes (nothing tracked): what each row's
    # kernels are made of.
    for pass in training inference; do
        file=$out/ncu.csv
        [[ $pass == inference ]] && file=$out/ncu-inference.csv
        log "2d ncu: the kernels of two $pass passes, 2-layer BERT-large, batch 64 x 128, bf16, with ${passed:-the defaults}"
        # shellcheck disable=SC2046,SC2086
        env $passed timeout 300 ncu --clock-control none --csv --print-units base \
            --metrics gpu__time_duration.sum $b bench kernels --config /tmp/large2.json \
            --batch 64 --seq 128 --dtype bf16 --device cuda --passes 1 \
            $([[ $pass == inference ]] && echo --inference) > "$file" 2> "${file%.csv}.err"
        echo "rc $?"
        python3 "$here/ncu_summary.py" "$file" --passes 2 --top 45 || tail -n 5 "${file%.csv}.err"
        # The same launches by shape (grid x block): which of a layer's products is slow. In
        # the log (a call brings back eight files; 2026-11-27's ninth, this list, stayed there).
        echo "by launch shape:"
        python3 "$here/ncu_summary.py" "$file" --passes 2 --top 40 --by-shape | cut -c1-120
    done
}
# By CUDA events (the GPU's own time, the host running ahead as in training).
pass_rows() {
    log "2e a training pass and an inference pass per kernel, BERT-large batch 64 x 128 bf16, each row's settings"
    local row label
    while IFS='|' read -r row label; do
        row=${row% } label=${label# }; [[ $row == - ]] && row=
        # shellcheck disable=SC2086
        if row_settings $row; then echo "$label: skipped (${dropped# } failed its check)"; continue; fi
        # (The optimiser's settings change nothing in a pass.)
        # shellcheck disable=SC2086
        if [[ -n $row && -z $(printf '%s\n' $row | grep -vE '^BERTKIT_CUDA_(TRUST_RATIOS|UPDATE)=') ]]; then
            echo "$label: no pass of its own (the optimiser's)"; continue
        fi
        echo "$label${dropped:+ (without$dropped)}:"
        env "${kept[@]}" timeout 120 $b bench kernels --config large --batch 64 --seq 128 \
            --dtype bf16 --device cuda --passes 2 2>&1 | tail -n 12 | head -n 11
        echo "$label${dropped:+ (without$dropped)}, inference:"
        env "${kept[@]}" timeout 120 $b bench kernels --config large --batch 64 --seq 128 \
            --dtype bf16 --device cuda --passes 2 --inference 2>&1 | tail -n 12 | head -n 11
        if [[ -n ${PASS_LONG:-} ]]; then
            echo "$label${dropped:+ (without$dropped)}, training at phase 2's 8 x 512:"
            env "${kept[@]}" timeout 120 $b bench kernels --config large --batch 8 --seq 512 \
                --dtype bf16 --device cuda --passes 2 2>&1 | tail -n 12 | head -n 11
        fi
    done < <(rows)
}
# Why the costliest kernels take what they take (throughput, occupancy, stall reasons): the
# attention's, a linear layer's end's and LayerNorm's kernels over a 2-layer model's passes,
# with every setting the check passed. Whole sections in the logs, the headlines in
# ncu-headlines.txt. (Each form these replaced was read on 2026-11-27: BENCHMARKS.md.)
sections() {
    log "2d' ncu sections: the attention, a linear layer's end, LayerNorm, then the backward's kernels, with ${passed:-the defaults}"
    large2
    # shellcheck disable=SC2086
    env $passed timeout 120 ncu --clock-control none -k regex:'flash_registers|bias_act|layer_norm' \
        --launch-count 16 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis $b bench kernels --config /tmp/large2.json --batch 64 \
        --seq 128 --dtype bf16 --device cuda --passes 1 > "$out/ncu-sections.txt" 2>&1
    # The backward's own (LayerNorm's backward at ~1.4 TB/s, 60 µs a BERT-large call, and the
    # attention's delta at ~1.1, by 2026-11-27's evening run: what bounds them).
    # shellcheck disable=SC2086
    env $passed timeout 120 ncu --clock-control none -k regex:'backward|delta' \
        --launch-count 16 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis $b bench kernels --config /tmp/large2.json --batch 64 \
        --seq 128 --dtype bf16 --device cuda --passes 1 >> "$out/ncu-sections.txt" 2>&1
    grep -hE "^  [a-z_]+.*Context|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Compute \(SM\) Throughput" \
        "$out/ncu-sections.txt" | cut -c1-110 > "$out/ncu-headlines.txt"
    echo "ncu headlines: $(wc -l < "$out/ncu-headlines.txt") lines in ncu-headlines.txt"
}
profile=
[[ -n ${PROFILE:-} ]] && command -v ncu > /dev/null && profile=1
[[ ${OPTIMIZER:-1} != 0 ]] && optimizer_forms
[[ -n ${EXTRA:-} && -n ${MEMORY_FIRST:-} ]] && memory
if [[ -n ${EXTRA:-} ]]; then
    phase1_rows
    if [[ ${PASSES:-1} != 0 ]]; then
        pass_rows
    elif [[ -n ${PASS_ROWS:-} ]]; then
        ROWS=$PASS_ROWS pass_rows
    fi
fi
[[ ${SIDE:-1} != 0 ]] && side_by_side
[[ -n $profile ]] && sections
if [[ -n ${EXTRA:-} ]]; then
    [[ -z ${MEMORY_FIRST:-} ]] && memory
    fp16
fi
[[ -n $profile ]] && pass_kernels
[[ -n $profile ]] && optimizer_kernels
exit 0
