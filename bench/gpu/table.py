"""Prints side_by_side.sh's results.jsonl as one Markdown table: each work's figure on bertkit
and on PyTorch, and their ratio (above 1: bertkit is faster)."""

import json
import sys


def main(path):
    rows = []
    for line in open(path):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                # One broken row (a run that failed half-way) must not cost the others.
                print(f"(skipped an unreadable row: {line.strip()})")
    by = {}
    for r in rows:
        work = r.get("phase") or r.get("work")
        by.setdefault(work, {})[r["side"]] = r
    print("| work | bertkit | PyTorch + transformers | ratio |")
    print("|---|---:|---:|---:|")
    names = {
        "phase1": "phase 1 pre-training, seq/s",
        "phase2": "phase 2 pre-training, seq/s",
        "infer": "inference, seq/s",
        "squad": "SQuAD fine-tuning, windows/s",
        "glue": "GLUE MRPC fine-tuning, examples/s",
    }
    for work, label in names.items():
        sides = by.get(work, {})
        if not sides:
            continue
        ours = sides.get("bertkit", {}).get("seq_per_s")
        theirs = sides.get("torch", {}).get("seq_per_s") or sides.get("torch", {}).get("windows_per_s")
        ratio = f"{ours / theirs:.3f}" if ours and theirs else "–"
        print(f"| {label} | {ours if ours is not None else 'failed'} | {theirs if theirs is not None else 'failed'} | {ratio} |")
        mem_ours = sides.get("bertkit", {}).get("peak_mib")
        mem_theirs = sides.get("torch", {}).get("peak_bytes")
        if mem_ours or mem_theirs:
            theirs_mib = round(mem_theirs / 2**20) if mem_theirs else None
            print(f"| {label.split(',')[0]}, peak MiB (nvidia-smi / torch allocated) | {mem_ours} | {theirs_mib} | |")
    forward = by.get("forward", {}).get("both")
    if forward:
        print(f"| forward pass against transformers (f32, no TF32), max abs difference | {forward['max_abs_diff']:.2e} | | |")


if __name__ == "__main__":
    main(sys.argv[1])
