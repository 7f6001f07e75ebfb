#!/usr/bin/env python3
"""Peak memory of pre-training with and without activation checkpointing, on the CPU.

Runs `bertkit pretrain` for a few steps of BERT-base (12 layers, width 768) on the demo's
phase-1 records, once per setting of [train] activation_checkpointing (0 = off, 1 = every
layer, 4 = every fourth layer), in separate processes, and reports each one's peak resident
memory (ru_maxrss) and seconds per step. Dropout, data and seeds are the same, so the runs do
the same arithmetic; the tests check that their gradients are equal.

Usage: bench/train_memory.py --bertkit target/release/bertkit --records out/demo/records/phase1
                             [--micro-batch 8] [--steps 2] [--work target/bench-train]
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

TEMPLATE = """
output = "{output}"
[model]
preset = "base"
[data]
records = ["{records}"]
micro_batch = {micro}
max_predictions = 20
pad_multiple = 8
seed = 1
[optimizer]
rule = "lamb"
[schedule]
lr = 1e-4
warmup = 0.1
total_steps = 1000
[train]
global_batch = {micro}
precision = "f32"
device = "cpu"
checkpoint_every = 1000
seed = 1
activation_checkpointing = {every}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bertkit", required=True)
    ap.add_argument("--records", required=True)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--work", default="target/bench-train")
    args = ap.parse_args()
    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    print(f"BERT-base, micro-batch {args.micro_batch}, {args.steps} steps, f32, CPU")
    print(f"{'checkpointing':>14} {'peak RSS MiB':>13} {'s/step':>8} {'last loss':>10}")
    for every in [0, 1, 4]:
        config = os.path.join(work, f"every{every}.toml")
        with open(config, "w") as f:
            f.write(TEMPLATE.format(output=os.path.join(work, f"run{every}"), records=os.path.abspath(args.records),
                                    micro=args.micro_batch, every=every))
        # Each run in its own child, so RUSAGE_CHILDREN's max is this run's peak.
        code = ("import resource,subprocess,sys;"
                "r=subprocess.run(sys.argv[1:],stdout=subprocess.DEVNULL,stderr=subprocess.PIPE);"
                "sys.stderr.write(r.stderr.decode()[-2000:] if r.returncode else '');"
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss);sys.exit(r.returncode)")
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code, args.bertkit, "pretrain", "--config", config,
                              "--max-steps", str(args.steps)], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            sys.exit(out.stderr)
        peak_mib = int(out.stdout.strip()) / 1024
        with open(os.path.join(work, f"run{every}", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        per_step = sum(1.0 / r["seq_per_s"] * args.micro_batch for r in rows) / len(rows)
        label = "off" if every == 0 else f"every {every}"
        print(f"{label:>14} {peak_mib:>13.0f} {per_step:>8.2f} {rows[-1]['loss']:>10.4f}")


if __name__ == "__main__":
    main()
