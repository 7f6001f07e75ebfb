#!/usr/bin/env bash
# `bertkit extract-features` beside transformers' feature-extraction pipeline on the CPU, on
# all-MiniLM-L6-v2, in rounds (only figures of the same round compare on this noisy machine):
# short lines (SQuAD dev questions) and long ones (SQuAD dev paragraphs, cut at 128 tokens),
# batch 32. bertkit runs twice per input: Google's JSON lines of the last layer (values
# rounded and printed, as extract_features.py writes them) and the npy folder of the last
# four layers; the peer keeps the last layer's vectors in memory and writes nothing.
#
# Usage: bench/extract_features.sh --python PY BERTKIT
#   PY: a Python with torch and transformers. ROUNDS (default 2), LINES (default 2000).
set -euo pipefail

[[ ${1:-} == --python ]] || { sed -n '2,10p' "$0"; exit 2; }
py=$2
bin=$3
repo=$(cd "$(dirname "$0")/.." && pwd)
data=$repo/../shared/data
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
lines=${LINES:-2000}
python3 - "$data/squad/dev-v1.1.json" "$work" "$lines" <<'PY'
import json, sys
squad, work, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
articles = json.load(open(squad, encoding="utf-8"))["data"]
paragraphs = [p for a in articles for p in a["paragraphs"]]
questions = [q["question"].strip() for p in paragraphs for q in p["qas"]]
contexts = [" ".join(p["context"].split()) for p in paragraphs]
open(f"{work}/short.txt", "w").write("\n".join(questions[:n]) + "\n")
open(f"{work}/long.txt", "w").write("\n".join(contexts[: n // 4]) + "\n")
PY
for round in $(seq "${ROUNDS:-2}"); do
    echo "== round $round, $(date -u +%H:%M) UTC"
    for input in short long; do
        "$bin" extract-features --model "$data/minilm" --input "$work/$input.txt" \
            -o "$work/f.jsonl" --layers -1 --batch-size 32 | sed "s|^|$input bertkit jsonl: |"
        "$bin" extract-features --model "$data/minilm" --input "$work/$input.txt" \
            -o "$work/npy" --format npy --batch-size 32 | sed "s|^|$input bertkit npy: |"
        "$py" "$repo/bench/extract_features_peer.py" "$data/minilm" "$work/$input.txt" \
            --batch 32 2>/dev/null | sed "s|^|$input peer: |"
    done
done
