#!/usr/bin/env bash
# Two release binaries alternated, 3 rounds: MiniLM-size pre-training steps (micro-batch 16,
# seq 128, AdamW, 12 steps, no checkpoints; records of the first 3,000 lines of Emma) and
# fixed-length inference (MiniLM, seq 128, batch 8). The run of kernels-crate.txt compared
# 3abb402 (old) with the session's HEAD (new).
#
# Usage: kernels-crate.sh OLD_BERTKIT NEW_BERTKIT
# The shared data folder: BERTKIT_SHARED_DATA, default ../shared/data beside the repository.
set -euo pipefail
(($# == 2)) || { sed -n '2,8p' "$0"; exit 2; }
old=$(realpath "$1")
new=$(realpath "$2")
repo=$(cd "$(dirname "$0")/../../.." && pwd)
data=$(realpath "${BERTKIT_SHARED_DATA:-$repo/../shared/data}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
head -3000 "$data/gutenberg/austen-emma.txt" > emma.txt
"$new" records --input emma.txt --vocab "$data/minilm/vocab.txt" --output emma.parquet \
  --max-seq-length 128 > /dev/null
cat > minilm.toml <<EOF
output = "$work/run"
[model]
config = "$data/minilm/config.json"
[data]
records = ["$work/emma.parquet"]
micro_batch = 16
max_predictions = 20
[optimizer]
rule = "adamw"
[schedule]
lr = 1e-4
warmup = 0.1
total_steps = 1000
[train]
global_batch = 16
EOF
for round in 1 2 3; do
  for which in old new; do
    bin=${!which}
    rm -rf "$work/run"
    line=$("$bin" pretrain --config minilm.toml --max-steps 12 --no-checkpoints 2>/dev/null \
      | grep -E "^steps " | sed "s|$work/|WORK/|")
    echo "round $round $which pretrain: $line"
    "$bin" bench inference --model "$data/minilm" --seq 128 --batch 8 --seconds 3 2>/dev/null \
      | tail -1 | sed "s/^/round $round $which inference: /"
  done
done
