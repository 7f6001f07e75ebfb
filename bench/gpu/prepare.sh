#!/usr/bin/env bash
# The data side_by_side.sh runs on, into DIR: the demo pipeline's phase-1 and phase-2 records
# (pipelines/demo.toml from MIRROR, the shared data layout), the offline SQuAD split of
# dev-v1.1, GLUE's MRPC, the bert-base-uncased vocabulary and the recipes (pipelines/). About
# 14 MB.
#
# Usage: bench/gpu/prepare.sh BERTKIT MIRROR DIR
set -euo pipefail
(($# == 3)) || { sed -n '2,6p' "$0"; exit 2; }
bertkit=$1 mirror=$2 dir=$3
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
"$bertkit" pipeline --config pipelines/demo.toml --mirror "$mirror" > /dev/null
rm -rf "$dir" && mkdir -p "$dir/records"
cp -r out/demo/records/phase1 out/demo/records/phase2 "$dir/records/"
"$bertkit" split squad --input "$mirror/squad/dev-v1.1.json" -o "$dir/squad" > /dev/null
mkdir -p "$dir/glue/MRPC" && cp "$mirror"/glue/MRPC/{train,dev}.tsv "$dir/glue/MRPC/"
cp "$mirror/minilm/vocab.txt" "$dir/"
cp -r pipelines "$dir/"
du -sh "$dir"
