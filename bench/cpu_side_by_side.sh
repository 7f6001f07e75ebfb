#!/usr/bin/env bash
# bertkit beside transformers on the CPU, in rounds (this machine kind is noisy: only figures
# from the same round compare): MiniLM-size pre-training steps, fixed-length inference, MRPC
# fine-tuning (20 steps + the dev evaluation) and SQuAD (10 training steps + the dev
# prediction), each bertkit build then the peer.
#
# Usage: bench/cpu_side_by_side.sh --python PY BERTKIT [BERTKIT ...]
#   PY: a Python with torch and transformers (the peers' README pins the versions).
#   BERTKIT: release binaries to compare (for example the branch point's and the work's).
# Needs `make demo` first (its phase-1 records) and `bertkit split squad` in SQUAD_SPLIT
# (default /tmp/squad-split; see BENCHMARKS.md, "Tasks: SQuAD"). ROUNDS (default 2) and
# SKIP (any of pretrain inference mrpc squad, space-separated) from the environment.
set -euo pipefail

[[ ${1:-} == --python ]] || { sed -n '2,12p' "$0"; exit 2; }
py=$2
shift 2
(($# > 0)) || { echo "error: no bertkit binary given" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
data=$repo/../shared/data
split=${SQUAD_SPLIT:-/tmp/squad-split}
work=$(mktemp -d)
# The peers write results/ beside themselves: run a copy, never the shared folder.
cp -r "$repo/../shared/peers/cpu" "$work/peers"
export BERTKIT_SHARED_DATA=$data
skip=" ${SKIP:-} "

sed -e "s|^output = .*|output = \"$work/pretrain\"|" \
    -e "s|^preset = .*|config = \"$data/minilm/config.json\"|" \
    -e 's|^rule = .*|rule = "adamw"|' -e 's|^lr = .*|lr = 1e-4|' \
    -e 's|^total_steps = .*|total_steps = 20|' \
    -e "s|\"out/demo/records/phase1\"|\"$repo/out/demo/records/phase1\"|" \
    -e '/^\[eval\]/,$d' "$repo/pipelines/tiny.toml" > "$work/minilm.toml"

median_step() { # metrics.jsonl -> median seconds per step
    python3 -c 'import json,statistics,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.strip()]
t=[r["seconds"] if "seconds" in r else None for r in rows]
if None in t:
    print("%.3f" % statistics.median(16/r["seq_per_s"] for r in rows if "seq_per_s" in r))
else:
    print("%.3f" % statistics.median(b-a for a,b in zip([0]+t,t)))' "$1"
}

for round in $(seq "${ROUNDS:-2}"); do
    echo "== round $round, $(date -u +%H:%M) UTC"
    if [[ $skip != *" pretrain "* ]]; then
        for bin in "$@"; do
            rm -rf "$work/pretrain"
            "$bin" pretrain --config "$work/minilm.toml" >/dev/null 2>&1
            echo "pretrain $bin: median step $(median_step "$work/pretrain/metrics.jsonl") s"
        done
        (cd "$work/peers" && "$py" pretrain_step_throughput.py --preset minilm --batch 16 \
            --head gathered --steps 20 2>&1 | grep "steps in" | sed 's/^/pretrain peer: /')
    fi
    if [[ $skip != *" inference "* ]]; then
        for bin in "$@"; do
            echo "inference $bin (seq batch runs seq/s p50 p90 p99 issue)"
            "$bin" bench inference --model "$data/minilm" --seq 128,384 --batch 1,8,32 \
                --seconds 3 2>&1 | tail -6
        done
        echo "inference peer"
        (cd "$work/peers" && "$py" inference_throughput.py --data "$data" --min-seconds 4 2>&1 \
            | grep "seq/s")
    fi
    if [[ $skip != *" mrpc "* ]]; then
        for bin in "$@"; do
            rm -rf "$work/mrpc"
            /usr/bin/time -f "mrpc $bin: wall %e s, peak RSS %M KB" "$bin" finetune glue \
                --task mrpc --model "$data/minilm" --data "$data/glue/MRPC" --epochs 3 \
                --lr 5e-5 --batch 32 --max-seq-length 128 --seed 42 --max-steps 20 \
                -o "$work/mrpc" 2>&1 | grep -E "^MRPC|wall"
        done
        (cd "$work/peers" && /usr/bin/time -f "mrpc peer: wall %e s, peak RSS %M KB" "$py" \
            mrpc_finetune.py --data "$data" --epochs 1 --max-train-examples 640 2>&1 \
            | grep -E "^epoch|wall")
    fi
    if [[ $skip != *" squad "* ]]; then
        for bin in "$@"; do
            rm -rf "$work/squad"
            /usr/bin/time -f "squad $bin: wall %e s, peak RSS %M KB" "$bin" finetune squad \
                --model "$data/minilm" --train "$split/train.json" --dev "$split/dev.json" \
                -o "$work/squad" --batch 16 --epochs 0.39783 --lr 1e-4 --warmup 0.1 --seed 42 \
                --max-steps 10 2>&1 | grep -E "windows/s|wall"
            echo "squad $bin: median training step $(median_step "$work/squad/metrics.jsonl") s"
        done
        (cd "$work/peers" && /usr/bin/time -f "squad peer: wall %e s, peak RSS %M KB" "$py" \
            squad_finetune.py --batch 16 --lr 1e-4 --epochs 2 --budget-min 1 2>&1 \
            | grep -E "estimate|wall")
        python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["result"]
print("squad peer: %.2f dev windows/s" % r["eval_feat_per_s"])' \
            "$work/peers/results/squad_b16_lr0.0001.json"
    fi
done
rm -rf "$work"
