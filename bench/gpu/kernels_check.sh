#!/usr/bin/env bash
# On a GPU machine, from a pack (bench/gpu/pack.sh, which copies this file): the fused CUDA
# kernels checked against their CPU twins (f32, bf16, f16), the optimiser step alone (composed
# and fused), then the whole side-by-side table beside PyTorch (side_by_side.sh, which also
# profiles a training pass per kernel; QUICK=1: phase 1 only; SIDE_SECONDS: its time limit,
# 480). EXTRA=1 adds the device pool's memory figures, and phase 1 with the pool keeping freed
# memory, the optimiser updating in place (its bucket, norm and parameters in one or two
# launches each), the lean feed-forward, the encoder's backward by hand
# (BERTKIT_CUDA_BACKWARD=tape), our embedding lookups (BERTKIT_CUDA_EMBEDDINGS=fused),
# attention in one pass over key tiles (BERTKIT_CUDA_ATTENTION=flash), our loss kernel
# (BERTKIT_CUDA_LOSS=fused) and, in fp16, the kernels' f16 forms (BERTKIT_CUDA_FP16=fused);
# none yet run on a device (bench/gpu/emulate ran their CUDA code on the CPU). ALL_ON=1 turns
# on, for the rest of the call, every setting whose kernels the check passes (and the pool
# keeping freed memory): with SIDE, the table for all of them at once. The EXTRA rows run
# without any setting the check failed (a row left with none of its own is skipped, saying
# so). PROFILE=1 adds ncu's
# time per kernel over two training passes (ncu_summary.py). SIDE=0 skips the side-by-side
# table (to split a long run into two device calls); OPTIMIZER=0 skips the optimiser step
# alone (2).
# Usage: bash .gpu/kernels_check.sh   (OUT: where the logs go)
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/env.sh"
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
b=/tmp/bertkit
log() { echo "=== $(date -u +%T) $*"; }
# BERT-large phase 1 for 12 steps at micro-batch 64 from the shipped recipe, in precision $2,
# writing nothing but its logs under /tmp/$1 (the settings come from the caller's environment).
phase1() {
    rm -rf "/tmp/$1"
    sed -e "s|^output = .*|output = \"/tmp/$1\"|" \
        -e "s|^records = .*|records = [\"$here/data/records/phase1\"]|" \
        -e 's|^preset = .*|preset = "large"|' -e "s|^precision = .*|precision = \"$2\"|" \
        "$here/data/pipelines/pretrain-phase1.toml" > "/tmp/$1.toml"
    timeout 120 $b pretrain --config "/tmp/$1.toml" --no-eval --no-checkpoints --device cuda \
        --max-steps 12 --micro-batch 64 --global-batch 64 2>&1
}
log "environment"
$b --version
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
log "1 bertkit check kernels --device cuda"
timeout 180 $b check kernels --device cuda --dtype f32,bf16,f16 > "$out/check.txt" 2>&1
check_rc=$?
echo "rc $check_rc (lines not ok, of $(wc -l < "$out/check.txt"); all in check.txt)"
grep -v " ok$" "$out/check.txt"
if [[ -n ${ALL_ON:-} ]]; then
    # ALL_ON=1: every setting whose kernels the check just passed (its line "to use them: ..."
    # names them, also when another setting's kernel failed; none when a kernel taken by
    # default failed), and the pool keeping freed memory, for the rest of the call.
    settings=$(sed -n 's/.*to use them: //p' "$out/check.txt")
    if [[ -n $settings ]]; then
        # shellcheck disable=SC2086
        export $settings BERTKIT_CUDA_POOL_KEEP=1
        log "ALL_ON: $settings BERTKIT_CUDA_POOL_KEEP=1"
    else
        log "ALL_ON: no setting passed (check rc $check_rc); the defaults stay"
    fi
fi
# The settings the check failed (its line "failed or not checked here, leave off: ..."; all
# of them when a kernel taken by default failed): the rows below run without them rather than
# spend the call on a kernel known wrong. `take VAR NAME` sets the shell variable NAME to "-"
# where VAR=$NAME failed, noting it in $dropped; `nothing_left VALUES...` then says a row is
# skipped when it dropped something and none of its own settings is left (it would repeat a
# row without them).
leave_off=" $(sed -n 's/.*leave off: //p' "$out/check.txt") "
take() {
    local value=${!2}
    if [[ $value != - && $leave_off == *" $1=$value "* ]]; then
        dropped+=" $1=$value"
        printf -v "$2" %s -
    fi
}
nothing_left() {
    [[ -z $dropped ]] && return 1
    local v
    for v in "$@"; do [[ $v != - && $v != 0 ]] && return 1; done
    echo "skipped (${dropped# } failed its check)"
}
# (side_by_side.sh profiles a training pass per kernel itself, step 3b.)
for optimizer in composed fused inplace; do
    [[ ${OPTIMIZER:-1} == 0 ]] && break
    log "2 the optimiser step alone: BERT-large, LAMB, bf16 model (f32 state), BERTKIT_CUDA_OPTIMIZER=$optimizer"
    BERTKIT_CUDA_OPTIMIZER=$optimizer timeout 120 $b bench optimizer --config large --dtype bf16 \
        --device cuda 2>&1 | tail -n 2
done
if [[ -n ${EXTRA:-} ]]; then
    # Not yet run on a device: the device pool's high-water mark against the plan, and phase 1
    # with the pool keeping freed memory (BERTKIT_CUDA_POOL_KEEP=1) against without.
    log "2b bench memory on the device (the pool's peak against the plan): phase 1 at micro-batch 64 and the recipe's 256, phase 2 at 8 and the recipe's 64 (bf16); then two micro-batches a step, and with checkpointing every layer (where the update makes the peak) the update by name and in place"
    for shape in "phase1 20 64 - - - 1 fused 0" "phase1 20 64 lean - - 1 fused 0" \
        "phase1 20 64 lean tape all 1 fused 0" "phase1 20 256 - - - 1 fused 0" \
        "phase2 80 8 - - - 1 fused 0" "phase2 80 8 lean tape all 1 fused 0" \
        "phase2 80 64 - - - 1 fused 0" "phase1 20 64 - - - 2 fused 0" \
        "phase1 20 8 - - - 1 fused 1" "phase1 20 8 - - - 1 inplace 1"; do
        read -r records predictions micro ffn backward more accumulation optimizer every <<< "$shape"
        # "all": the embedding lookups, the one-pass attention and the loss kernel too.
        embeddings=-; attention=-; loss=-
        [[ $more == all ]] && embeddings=fused && attention=flash && loss=fused
        dropped=
        take BERTKIT_CUDA_FEED_FORWARD ffn; take BERTKIT_CUDA_BACKWARD backward
        take BERTKIT_CUDA_EMBEDDINGS embeddings; take BERTKIT_CUDA_ATTENTION attention
        take BERTKIT_CUDA_LOSS loss; take BERTKIT_CUDA_OPTIMIZER optimizer
        echo -n "feed-forward $ffn, backward $backward, embeddings $embeddings, attention $attention, loss $loss, optimizer $optimizer${dropped:+ (without$dropped)}: "
        nothing_left "$ffn" "$backward" "$embeddings" "$attention" "$loss" "${optimizer/fused/-}" \
            && continue
        BERTKIT_CUDA_FEED_FORWARD=$ffn BERTKIT_CUDA_BACKWARD=$backward \
            BERTKIT_CUDA_EMBEDDINGS=$embeddings BERTKIT_CUDA_ATTENTION=$attention \
            BERTKIT_CUDA_LOSS=$loss BERTKIT_CUDA_OPTIMIZER=$optimizer timeout 120 $b bench memory \
            --config "$here/data/pipelines/pretrain-phase1.toml" \
            --data "$here/data/records/$records" --preset large --precision bf16 --device cuda \
            --predictions "$predictions" --micro-batch "$micro" --accumulation "$accumulation" \
            --checkpointing "$every" --steps 2 2>&1 | tail -n 1
    done
    log "2c phase 1, 12 steps: the pool keeping freed memory, the optimiser's update in place, the lean feed-forward, the backward by hand, the one-pass attention, then all of them without and with it"
    for form in "0 fused - - - - -" "1 fused - - - - -" "0 inplace - - - - -" \
        "0 fused lean - - - -" "0 fused - tape - - -" "0 fused - - - flash -" \
        "0 fused - - - - fused" "1 inplace lean tape fused - -" \
        "1 inplace lean tape fused flash fused"; do
        read -r keep optimizer ffn backward embeddings attention loss <<< "$form"
        dropped=
        take BERTKIT_CUDA_OPTIMIZER optimizer; take BERTKIT_CUDA_FEED_FORWARD ffn
        take BERTKIT_CUDA_BACKWARD backward; take BERTKIT_CUDA_EMBEDDINGS embeddings
        take BERTKIT_CUDA_ATTENTION attention; take BERTKIT_CUDA_LOSS loss
        label="keep=$keep $optimizer ffn=$ffn backward=$backward embeddings=$embeddings attention=$attention loss=$loss${dropped:+ (without$dropped)}"
        if why=$(nothing_left "$keep" "${optimizer/fused/-}" "$ffn" "$backward" "$embeddings" \
            "$attention" "$loss"); then
            echo "$label: $why"
            continue
        fi
        BERTKIT_CUDA_POOL_KEEP=$keep BERTKIT_CUDA_OPTIMIZER=$optimizer \
            BERTKIT_CUDA_FEED_FORWARD=$ffn BERTKIT_CUDA_BACKWARD=$backward \
            BERTKIT_CUDA_EMBEDDINGS=$embeddings BERTKIT_CUDA_ATTENTION=$attention \
            BERTKIT_CUDA_LOSS=$loss phase1 "keep-$keep" bf16 | grep -E "a step|start-up" \
            | sed "s|^|$label: |"
    done
fi
if [[ -n ${EXTRA:-} ]]; then
    # Synchronised, each kernel call is timed between two synchronisations, and at each one
    # the pool hands freed memory back to the driver unless it keeps it; by events, the GPU's
    # own time with the host running ahead (one synchronisation a pass, as a training step).
    # The last four rows apart by those two.
    log "2e a training pass per kernel, BERT-large batch 64 x 128 bf16: as it is, the encoder's backward by hand, with the embedding lookups, the one-pass attention and the loss kernel too, then that with the pool keeping freed memory, each clock"
    for form in "- - - - 0 synchronised" "tape - - - 0 events" "tape fused flash fused 0 events" \
        "tape fused flash fused 0 synchronised" "tape fused flash fused 1 synchronised" \
        "tape fused flash fused 1 events"; do
        read -r backward embeddings attention loss keep clock <<< "$form"
        dropped=
        take BERTKIT_CUDA_BACKWARD backward; take BERTKIT_CUDA_EMBEDDINGS embeddings
        take BERTKIT_CUDA_ATTENTION attention; take BERTKIT_CUDA_LOSS loss
        echo "backward $backward, embeddings $embeddings, attention $attention, loss $loss, pool keep $keep, clock $clock${dropped:+ (without$dropped)}:"
        nothing_left "$backward" "$embeddings" "$attention" "$loss" "$keep" && continue
        BERTKIT_CUDA_POOL_KEEP=$keep BERTKIT_CUDA_BACKWARD=$backward \
            BERTKIT_CUDA_EMBEDDINGS=$embeddings \
            BERTKIT_CUDA_ATTENTION=$attention BERTKIT_CUDA_LOSS=$loss timeout 120 \
            $b bench kernels --config large --batch 64 --seq 128 --dtype bf16 --device cuda \
            --passes 2 --clock "$clock" 2>&1 | tail -n 14
    done
fi
if [[ -n ${EXTRA:-} ]]; then
    # fp16 (GPUs without bf16): candle's ops, as before, against the kernels' f16 forms.
    log "2f phase 1 in fp16, 12 steps: candle's ops, then the CUDA kernels' f16 forms"
    for fp16 in - fused; do
        dropped=
        take BERTKIT_CUDA_FP16 fp16
        if why=$(nothing_left "$fp16"); then
            echo "fp16 kernels fused: $why"
            continue
        fi
        BERTKIT_CUDA_FP16=$fp16 phase1 fp16 fp16 | grep -E "a step|start-up|loss" | tail -n 3 \
            | sed "s/^/fp16 kernels $fp16: /"
    done
fi
if [[ -n ${PROFILE:-} ]] && command -v ncu > /dev/null; then
    # Each kernel's own time (ncu replays them one by one: no overlap, no launch gaps) over
    # two training passes of a 2-layer BERT-large at phase 1's shape, the encoder's backward by
    # hand, the one-pass attention: which launches the layers, the autograd and the heads are made of.
    log "2d ncu: the kernels of two training passes, 2-layer BERT-large, batch 64 x 128, bf16"
    python3 -c 'import json,sys; json.dump({"architectures":["BertForPreTraining"],"model_type":"bert","vocab_size":30522,"hidden_size":1024,"num_hidden_layers":2,"num_attention_heads":16,"intermediate_size":4096,"hidden_act":"gelu","hidden_dropout_prob":0.1,"attention_probs_dropout_prob":0.1,"max_position_embeddings":512,"type_vocab_size":2,"initializer_range":0.02,"layer_norm_eps":1e-12}, open("/tmp/large2.json","w"))'
    BERTKIT_CUDA_BACKWARD=tape BERTKIT_CUDA_EMBEDDINGS=fused BERTKIT_CUDA_ATTENTION=flash \
        BERTKIT_CUDA_LOSS=fused timeout 300 ncu --clock-control none --csv --print-units base --metrics gpu__time_duration.sum \
        $b bench kernels --config /tmp/large2.json --batch 64 --seq 128 --dtype bf16 --device cuda \
        --passes 1 > "$out/ncu.csv" 2> "$out/ncu.err"
    echo "rc $?"
    python3 "$here/ncu_summary.py" "$out/ncu.csv" --passes 2 --top 45 || tail -n 5 "$out/ncu.err"
fi
if [[ ${SIDE:-1} == 0 ]]; then
    exit 0
fi
log "3 the side-by-side table"
OUT=$out/side timeout "${SIDE_SECONDS:-480}" \
    bash "$here/side_by_side.sh" --bertkit "$b" --python python3 --data "$here/data"
echo "rc $?"
grep -h "checkpoint\|first step" "$out"/side/phase*.log 2>/dev/null
