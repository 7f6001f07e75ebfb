#!/usr/bin/env bash
# Old (3abb402) and new (HEAD) release binaries alternated, 3 rounds: MiniLM-size pre-training
# steps (micro-batch 16, seq 128, AdamW, 12 steps, no checkpoints) and fixed-length inference.
set -euo pipefail
cd /tmp/bench
for round in 1 2 3; do
  for which in old new; do
    bin=/tmp/bench/bertkit-$which
    rm -rf /tmp/bench/run
    line=$($bin pretrain --config minilm.toml --max-steps 12 --no-checkpoints 2>/dev/null | grep -E "^step times|^steps " | tr '\n' ' ')
    echo "round $round $which pretrain: $line"
    $bin bench inference --model /work/shared/data/minilm --seq 128 --batch 8 --seconds 3 2>/dev/null | tail -1 | sed "s/^/round $round $which inference: /"
  done
done
