#!/usr/bin/env bash
# bertkit beside PyTorch + transformers on one GPU: the same work, shapes and device, in one
# run that fits the device tool's one call (about 6 minutes on an H100/H200), ending in one
# table of ratios (what BENCHMARKS.md records). Work, BERT-large in bf16 by default:
#   1. phase-1 pre-training steps (seq 128, micro-batch 64, 20 predictions a sequence), and
#      bertkit's again with AdamW, the peer's optimiser (the recipe's is LAMB);
#   2. the forward pass against transformers on the phase-1 weights (f32, no TF32);
#   3. inference (seq 128, batch 64, bf16);
#   4. phase-2 pre-training steps (seq 512, micro-batch 8, 80 predictions), from phase 1;
#   5. SQuAD fine-tuning steps (seq 384, batch 32) from the phase-1 weights;
#   6. GLUE MRPC fine-tuning steps (batch 32) from the same (bertkit on MRPC's real pairs,
#      unpadded; PyTorch on ids padded to 128, run_glue.py's default);
# and, for the record, where bertkit's training pass spends its time per kernel.
# bertkit's side runs its real commands on the demo records and the SQuAD split; PyTorch's is
# bench/gpu/torch_peer.py on random ids of the same shapes (masked-LM head on the masked
# positions only, as bertkit; AdamW, fused on CUDA, where bertkit's recipes run LAMB).
#
# Usage: bench/gpu/side_by_side.sh --bertkit BIN --python PY --data DIR
#   DIR: records/phase1 and records/phase2 (pipelines/demo.toml's), squad/train.json and
#   squad/dev.json (`bertkit split squad`), glue/MRPC, vocab.txt, pipelines/ (the recipes).
# Environment: DEVICE (cuda; cpu runs the plumbing on tiny shapes), MODEL (large; or a
# config.json), QUICK=1 (phase 1 only), PEER_RUNS (PyTorch's pre-training runs, 2), CLOCK
# (how the per-kernel profile times each call: events, the default, or synchronised; `bertkit
# bench kernels --clock`), OUT (where logs and results.jsonl go; default a temporary folder).
# `make bench-gpu` builds and prepares all of it; `bench/gpu/pack.sh` packs it for a machine
# reached through one call.
set -uo pipefail

bertkit= py=python3 data=
while (($#)); do
    case $1 in
        --bertkit) bertkit=$2; shift 2 ;;
        --python) py=$2; shift 2 ;;
        --data) data=$2; shift 2 ;;
        *) sed -n '2,26p' "$0"; exit 2 ;;
    esac
done
[[ -x $bertkit && -d $data ]] || { sed -n '2,26p' "$0"; exit 2; }
data=$(readlink -f "$data")
here=$(cd "$(dirname "$0")" && pwd)
device=${DEVICE:-cuda}
model=${MODEL:-large}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
results=$out/results.jsonl
: > "$results"
work=$(mktemp -d)
# Shapes: the recipes' on a GPU; tiny ones for a dry run on the CPU.
if [[ $device == cpu ]]; then
    p1_batch=4 p2_batch=2 squad_batch=4 glue_batch=4 steps=3 warmup=1 dtype=f32 squad_seq=128
else
    p1_batch=64 p2_batch=8 squad_batch=32 glue_batch=32 steps=12 warmup=4 dtype=bf16 squad_seq=384
fi
if [[ $model == large || $model == base ]]; then
    model_line="preset = \"$model\""
else
    model_line="config = \"$(readlink -f "$model")\""
fi
log() { echo "=== $(date -u +%T) $*"; }
result() { echo "$1" >> "$results"; }
sample_memory() { # file: nvidia-smi's used MiB every 200 ms, in the background; prints its pid
    if command -v nvidia-smi >/dev/null 2>&1 && [[ $device == cuda* ]]; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$1" &
        echo $!
    fi
}
peak_mib() { [[ -s $1 ]] && sort -n "$1" | tail -n 1 || echo null; }
# The recipe with this run's model, records and dtype.
recipe() { # phase records [init]
    sed -e "s|^preset = .*|$model_line|" -e "s|^precision = .*|precision = \"$dtype\"|" \
        -e "s|^output = .*|output = \"$work/$1\"|" \
        -e "s|^records = .*|records = [\"$data/records/$2\"]|" \
        ${3:+-e "s|^init = .*|init = \"$3\"|"} \
        "$data/pipelines/pretrain-$1.toml" > "$work/$1.toml"
}
# Median seq/s of a run's steps after the warm-up (null when the run left no metrics: a
# failed run must not cost the table its other rows).
median_seq_per_s() {
    python3 -c 'import json,os,statistics,sys
path=sys.argv[1]
rows=[json.loads(l) for l in open(path) if l.strip()] if os.path.exists(path) else []
rows=[r for r in rows if "seq_per_s" in r][int(sys.argv[2]):]
print(round(statistics.median(r["seq_per_s"] for r in rows),2) if rows else "null")' "$1" "$2"
}
# Median windows/s of a fine-tuning run's steps after the warm-up (its metrics carry each
# step's time since the start; null as above).
median_windows_per_s() { # metrics warmup batch
    python3 -c 'import json,os,statistics,sys
path=sys.argv[1]
t=[json.loads(l)["seconds"] for l in open(path) if l.strip()] if os.path.exists(path) else []
d=[b-a for a,b in zip([0]+t,t)][int(sys.argv[2]):]
print(round(int(sys.argv[3])/statistics.median(d),2) if d else "null")' "$1" "$2" "$3"
}
pretrain() { # phase seq batch predictions [flags]
    local phase=$1 seq=$2 batch=$3 predictions=$4
    local pid mem=$work/$phase.mem
    pid=$(sample_memory "$mem")
    "$bertkit" pretrain --config "$work/$phase.toml" --no-eval --device "$device" \
        --max-steps "$steps" --micro-batch "$batch" --global-batch "$batch" "${@:5}" \
        > "$out/$phase.log" 2>&1
    local rc=$?
    [[ -n $pid ]] && kill "$pid"
    tail -n 4 "$out/$phase.log"
    # The pool's high-water mark of bytes in tensors (the run's last line on CUDA): what
    # torch's max_memory_allocated counts.
    local tensors
    tensors=$(sed -n 's/^device memory: \([0-9]*\) MiB.*/\1/p' "$out/$phase.log")
    result "{\"side\": \"bertkit\", \"work\": \"$phase\", \"rc\": $rc, \"seq_per_s\": $(median_seq_per_s "$work/$phase/metrics.jsonl" "$warmup"), \"peak_mib\": $(peak_mib "$mem"), \"tensors_mib\": ${tensors:-null}}"
    # PyTorch's process sampled by nvidia-smi the same way (its context, cuBLAS's workspace and
    # its caching allocator's spare counted as bertkit's are), beside its own counts. PEER_RUNS
    # times (2 by default): PyTorch's pace has moved by a fifth between calls on one machine
    # kind where bertkit's has not; its runs within a call say whether that is its own noise.
    # The table sets bertkit against PyTorch's fastest run.
    local run
    for ((run = 1; run <= ${PEER_RUNS:-2}; run++)); do
        mem=$work/torch-$phase.mem
        pid=$(sample_memory "$mem")
        "$py" "$here/torch_peer.py" pretrain --config "$model" --seq "$seq" --batch "$batch" \
            --predictions "$predictions" --steps "$steps" --warmup "$warmup" --dtype "$dtype" \
            --device "$device" 2>"$out/torch-$phase.err" > "$work/torch-$phase.json"
        [[ -n $pid ]] && kill "$pid"
        sed "s/^{/{\"side\": \"torch\", \"phase\": \"$phase\", \"run\": $run, \"peak_mib\": $(peak_mib "$mem"), /" \
            "$work/torch-$phase.json" >> "$results"
        tail -n 1 "$results"
    done
}

log "environment"
"$bertkit" --version
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

log "1 phase 1: seq 128, micro-batch $p1_batch, $steps steps ($dtype)"
recipe phase1 phase1
pretrain phase1 128 "$p1_batch" 20
checkpoint=$(ls -d "$work"/phase1/checkpoints/step-* 2>/dev/null | tail -n 1)

if [[ -z ${QUICK:-} ]]; then
    # PyTorch's peer steps with fused AdamW (one pass); the recipe's LAMB takes two and its
    # trust ratios: the same phase 1 with AdamW on bertkit's side, set against the same
    # PyTorch run, says what of the ratio is the optimiser.
    log "1b phase 1 with AdamW, PyTorch's optimiser (bertkit's side; the recipe runs LAMB)"
    sed -e 's|^rule = .*|rule = "adamw"|' -e "s|^output = .*|output = \"$work/phase1-adamw\"|" \
        "$work/phase1.toml" > "$work/phase1-adamw.toml"
    "$bertkit" pretrain --config "$work/phase1-adamw.toml" --no-eval --no-checkpoints \
        --device "$device" --max-steps "$steps" --micro-batch "$p1_batch" \
        --global-batch "$p1_batch" > "$out/phase1-adamw.log" 2>&1
    rc=$?
    tail -n 3 "$out/phase1-adamw.log"
    result "{\"side\": \"bertkit\", \"work\": \"phase1-adamw\", \"rc\": $rc, \"seq_per_s\": $(median_seq_per_s "$work/phase1-adamw/metrics.jsonl" "$warmup")}"
fi

if [[ -z ${QUICK:-} && -n $checkpoint ]]; then
    log "2 the forward pass against transformers on the phase-1 weights (f32, no TF32)"
    "$py" - "$work/ids.safetensors" "$checkpoint/config.json" <<'PY'
import json, sys, torch
from safetensors.torch import save_file
vocab = json.load(open(sys.argv[2]))["vocab_size"]
g = torch.Generator().manual_seed(1)
ids = torch.randint(5, vocab, (8, 128), generator=g)
mask = torch.ones_like(ids); mask[4:, 100:] = 0
types = torch.zeros_like(ids); types[:, 64:] = 1
save_file({"input_ids": ids, "attention_mask": mask, "token_type_ids": types * mask}, sys.argv[1])
PY
    "$bertkit" forward --model "$checkpoint" --input "$work/ids.safetensors" -o "$work/fwd.safetensors" \
        --device "$device" --dtype f32 --no-tf32 | tail -n 1
    "$py" "$here/torch_peer.py" forward --model "$checkpoint" --input "$work/ids.safetensors" \
        --bertkit "$work/fwd.safetensors" --device "$device" 2>"$out/torch-forward.err" \
        | sed 's/^{/{"side": "both", /' >> "$results"
    tail -n 1 "$results"

    log "3 inference: seq 128, batch $p1_batch ($dtype)"
    rows=$("$bertkit" bench inference --model "$checkpoint" --seq 128 --batch "$p1_batch" --dtype "$dtype" \
        --device "$device" --seconds 2 2>&1 | tail -n 1)
    echo "$rows"
    result "{\"side\": \"bertkit\", \"work\": \"infer\", \"seq_per_s\": $(echo "$rows" | awk '{print $4+0}')}"
    "$py" "$here/torch_peer.py" infer --config "$model" --seq 128 --batch "$p1_batch" --dtype "$dtype" \
        --steps 20 --warmup 5 --device "$device" 2>"$out/torch-infer.err" | sed 's/^{/{"side": "torch", /' >> "$results"
    tail -n 1 "$results"

    log "3b where a training pass's time goes, per kernel (seq 128, batch $p1_batch, $dtype, clock ${CLOCK:-events})"
    "$bertkit" bench kernels --config "$model" --batch "$p1_batch" --seq 128 --dtype "$dtype" \
        --device "$device" --passes 2 --clock "${CLOCK:-events}" 2>&1 | tail -n 16
    log "3c where an inference pass's time goes, per kernel (seq 128, batch $p1_batch, $dtype, clock ${CLOCK:-events})"
    "$bertkit" bench kernels --config "$model" --batch "$p1_batch" --seq 128 --dtype "$dtype" \
        --device "$device" --passes 2 --inference --clock "${CLOCK:-events}" 2>&1 | tail -n 12

    log "4 phase 2 from phase 1: seq 512, micro-batch $p2_batch"
    recipe phase2 phase2 "$work/phase1"
    # Nothing starts from phase 2: its 4 GB checkpoint is not written.
    pretrain phase2 512 "$p2_batch" 80 --no-checkpoints

    # 20 steps past the warm-up: the first GPU run's steps slowed from the 21st (issue 38), so
    # the steps after the 20th are reported on their own as well.
    squad_steps=$((steps + 20))
    log "5 SQuAD fine-tuning: seq $squad_seq, batch $squad_batch, $squad_steps steps"
    mkdir -p "$work/squad-model"
    cp "$checkpoint/config.json" "$checkpoint/model.safetensors" "$work/squad-model/"
    cp "$data/vocab.txt" "$work/squad-model/"
    "$bertkit" finetune squad --model "$work/squad-model" --train "$data/squad/train.json" \
        --output "$work/squad" --device "$device" --dtype "$dtype" --batch "$squad_batch" \
        --max-seq-length "$squad_seq" --max-steps "$squad_steps" > "$out/squad.log" 2>&1
    rc=$?
    grep -E "^squad:" "$out/squad.log"
    result "{\"side\": \"bertkit\", \"work\": \"squad\", \"rc\": $rc, \"seq_per_s\": $(median_windows_per_s "$work/squad/metrics.jsonl" "$warmup" "$squad_batch")}"
    echo "bertkit SQuAD windows/s, steps after the 20th: $(median_windows_per_s "$work/squad/metrics.jsonl" 20 "$squad_batch")"
    "$py" "$here/torch_peer.py" squad --config "$model" --seq "$squad_seq" --batch "$squad_batch" \
        --steps "$squad_steps" --warmup "$warmup" --dtype "$dtype" --device "$device" \
        2>"$out/torch-squad.err" | sed 's/^{/{"side": "torch", /' >> "$results"
    tail -n 1 "$results"

    log "6 GLUE MRPC fine-tuning: seq 128, batch $glue_batch, $squad_steps steps"
    "$bertkit" finetune glue --task mrpc --model "$work/squad-model" --data "$data/glue/MRPC" \
        -o "$work/mrpc" --device "$device" --dtype "$dtype" --batch "$glue_batch" \
        --max-seq-length 128 --max-steps "$squad_steps" > "$out/mrpc.log" 2>&1
    rc=$?
    grep -E "^MRPC:" "$out/mrpc.log"
    result "{\"side\": \"bertkit\", \"work\": \"glue\", \"rc\": $rc, \"seq_per_s\": $(median_windows_per_s "$work/mrpc/metrics.jsonl" "$warmup" "$glue_batch")}"
    "$py" "$here/torch_peer.py" glue --config "$model" --seq 128 --batch "$glue_batch" \
        --steps "$squad_steps" --warmup "$warmup" --dtype "$dtype" --device "$device" \
        2>"$out/torch-glue.err" | sed 's/^{/{"side": "torch", /' >> "$results"
    tail -n 1 "$results"
fi

log "the table ($results)"
python3 "$here/table.py" "$results"
rm -rf "$work"
