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
    # PyTorch's paces where it ran a work more than once (side_by_side.sh's PEER_RUNS): the
    # table sets bertkit against its fastest run and lists them all.
    paces = {}
    for r in rows:
        work = r.get("phase") or r.get("work")
        pace = r.get("seq_per_s") or r.get("windows_per_s")
        if r["side"] == "torch" and pace:
            paces.setdefault(work, []).append(pace)
            best = by.get(work, {}).get("torch", {})
            if pace < (best.get("seq_per_s") or best.get("windows_per_s") or 0):
                continue
        by.setdefault(work, {})[r["side"]] = r
    print("| work | bertkit | PyTorch + transformers | ratio |")
    print("|---|---:|---:|---:|")
    names = {
        "phase1": "phase 1 pre-training, seq/s",
        "phase1-adamw": "phase 1 with AdamW on both sides (the recipe: LAMB), seq/s",
        "phase2": "phase 2 pre-training, seq/s",
        "infer": "inference, seq/s",
        "squad": "SQuAD fine-tuning, windows/s",
        "glue": "GLUE MRPC fine-tuning, examples/s",
    }
    # A bertkit-only variant set against another work's PyTorch run.
    peer_of = {"phase1-adamw": "phase1"}
    for work, label in names.items():
        sides = dict(by.get(work, {}))
        if not sides:
            continue
        if work in peer_of:
            sides["torch"] = by.get(peer_of[work], {}).get("torch", {})
        ours = sides.get("bertkit", {}).get("seq_per_s")
        theirs = sides.get("torch", {}).get("seq_per_s") or sides.get("torch", {}).get("windows_per_s")
        ratio = f"{ours / theirs:.3f}" if ours and theirs else "–"
        runs = paces.get(peer_of.get(work, work), [])
        if len(runs) > 1:
            label += f" (PyTorch's fastest of {len(runs)} runs: {', '.join(f'{p:g}' for p in runs)})"
        print(f"| {label} | {ours if ours is not None else 'failed'} | {theirs if theirs is not None else 'failed'} | {ratio} |")
        # Memory measured alike on both sides: nvidia-smi's peak of each process's run
        # (context, workspaces, each allocator's spare and all), and the bytes in tensors
        # (bertkit's CUDA pool high-water mark; torch's max_memory_allocated). Ratios above 1
        # here: bertkit holds more.
        if work in peer_of:
            continue  # its memory is the work it varies
        what = label.split(",")[0]
        ours_side, theirs_side = sides.get("bertkit", {}), sides.get("torch", {})
        allocated = theirs_side.get("peak_bytes")
        for name, ours, theirs in [
            ("peak MiB, nvidia-smi", ours_side.get("peak_mib"), theirs_side.get("peak_mib")),
            (
                "peak MiB in tensors (pool high-water / torch max allocated)",
                ours_side.get("tensors_mib"),
                round(allocated / 2**20) if allocated else None,
            ),
        ]:
            if ours or theirs:
                ratio = f"{ours / theirs:.2f}x" if ours and theirs else ""
                show = lambda v: "–" if v is None else v  # noqa: E731
                print(f"| {what}, {name} | {show(ours)} | {show(theirs)} | {ratio} |")
    forward = by.get("forward", {}).get("both")
    if forward:
        print(f"| forward pass against transformers (f32, no TF32), max abs difference | {forward['max_abs_diff']:.2e} | | |")


if __name__ == "__main__":
    main(sys.argv[1])
