#!/usr/bin/env bash
# On a GPU machine, from a pack (bench/gpu/pack.sh): the fused CUDA kernels checked against
# their CPU twins, where a training pass's time goes with the composed ops and with the fused
# kernels, then phase 1 with the fused kernels beside PyTorch (side_by_side.sh, QUICK=1).
# Usage: bash .gpu/kernels_check.sh   (OUT: where the logs go)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
for site in $(python3 -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null); do
    for lib in "$site"/cu13/lib "$site"/nccl/lib; do
        [[ -d $lib ]] && LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    done
done
export LD_LIBRARY_PATH PYTHONUNBUFFERED=1
gunzip -c "$here/bertkit.gz" > /tmp/bertkit && chmod +x /tmp/bertkit
b=/tmp/bertkit
log() { echo "=== $(date -u +%T) $*"; }
log "environment"
$b --version
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
log "1 bertkit check kernels --device cuda"
timeout 180 $b check kernels --device cuda --dtype f32,bf16 > "$out/check.txt" 2>&1
echo "rc $? (lines not ok, of $(wc -l < "$out/check.txt"); all in check.txt)"
grep -v " ok$" "$out/check.txt"
profile() { # kernels env
    log "2 bench kernels: BERT-large bf16, batch 64 x 128 ($1; BERTKIT_CUDA_KERNELS=$2)"
    BERTKIT_CUDA_KERNELS=$2 timeout 150 $b bench kernels --config large --batch 64 --seq 128 \
        --dtype bf16 --device cuda --passes 2 --kernels "$1" 2>&1 | tee "$out/profile-$2.txt"
    echo "rc ${PIPESTATUS[0]}"
}
profile fused fused
profile composed composed
log "3 phase 1 with the fused kernels beside PyTorch"
BERTKIT_CUDA_KERNELS=fused QUICK=1 OUT=$out/side timeout 240 \
    bash "$here/side_by_side.sh" --bertkit "$b" --python python3 --data "$here/data"
echo "rc $?"
tail -n 5 "$out/side/phase1.log" 2>/dev/null
