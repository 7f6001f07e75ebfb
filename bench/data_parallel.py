#!/usr/bin/env python3
"""Data-parallel training on one machine: the gradient all-reduce and what it costs a step.

1. The all-reduce of a model-sized f32 gradient bucket (BERT-base, BERT-large) between 2 local
   ranks: `mpirun -np 2 bertkit bench allreduce` (MPI_Allreduce through bertkit's reducer,
   the copies in and out of the tensor included) beside PyTorch's CPU data-parallel engine,
   `torch.distributed.all_reduce` over gloo, on a tensor of the same size; alternated rounds.
2. The step-time overhead at BERT-base size: the same global batch (micro-batch 2, 4 a step)
   on 1 process with 2 threads (accumulation 2) and on 2 ranks with 1 thread each
   (accumulation 1), from `metrics.jsonl`'s seconds per step (the first step left out).

Usage: bench/data_parallel.py --bertkit target/release/bertkit (built with --features mpi)
       --python PY (a Python with torch) --records out/demo/records/phase1 [--rounds 2]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

MPI = ["mpirun", "-np", "2", "--bind-to", "none", "-x", "RAYON_NUM_THREADS=1"]
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")

GLOO = r"""
import os, sys, time, torch, torch.distributed as dist
rank, n, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=2)
x = torch.empty(n)
times = []
for i in range(repeats + 1):
    x.fill_(rank + 1.0)
    dist.barrier()
    t = time.perf_counter()
    dist.all_reduce(x)
    if i:
        times.append(time.perf_counter() - t)
assert float(x.min()) == 3.0 and float(x.max()) == 3.0
if rank == 0:
    times.sort()
    print(times[len(times) // 2], times[0])
dist.destroy_process_group()
"""


def bertkit_allreduce(bertkit, config, repeats):
    out = subprocess.run(MPI + [bertkit, "bench", "allreduce", "--config", config,
                                "--repeats", str(repeats)],
                         env=ENV, check=True, capture_output=True, text=True).stdout
    m = re.search(r"bucket: (\d+) f32 .* median ([\d.]+) s, least ([\d.]+) s", out)
    return int(m.group(1)), float(m.group(2)), float(m.group(3))


def gloo_allreduce(python, n, repeats):
    procs = [subprocess.Popen([python, "-c", GLOO, str(r), str(n), str(repeats)],
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    median, least = map(float, outs[0].split())
    return median, least


def step_seconds(bertkit, records, ranks, threads, steps):
    with tempfile.TemporaryDirectory() as d:
        config = os.path.join(d, "base.toml")
        with open(config, "w") as f:
            f.write(f"""output = "{d}/run"
[model]
preset = "base"
[data]
records = ["{records}"]
micro_batch = 2
max_predictions = 20
[optimizer]
rule = "lamb"
[schedule]
lr = 1e-4
warmup = 0.1
total_steps = {steps}
[train]
global_batch = 4
precision = "f32"
device = "cpu"
checkpoint_every = 100000
seed = 1
""")
        args = [bertkit, "pretrain", "--config", config]
        if ranks == 1:
            cmd, env = args, dict(ENV, RAYON_NUM_THREADS=str(threads))
        else:
            cmd, env = MPI + args, ENV
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        rows = [json.loads(l) for l in open(f"{d}/run/metrics.jsonl")]
        return [4 / r["seq_per_s"] for r in rows[1:]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bertkit", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--records", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    print("all-reduce of an f32 gradient bucket, 2 local ranks (median s of each round's "
          f"{a.repeats} repeats; bus bandwidth = bytes/s x 2(n-1)/n = bytes/s for n = 2)")
    for config in ("base", "large"):
        ours, theirs = [], []
        for _ in range(a.rounds):
            n, median, _ = bertkit_allreduce(a.bertkit, config, a.repeats)
            ours.append(median)
            theirs.append(gloo_allreduce(a.python, n, a.repeats)[0])
        mb = n * 4 / 1e6
        o, t = min(ours), min(theirs)
        print(f"  {config}: {n} values ({mb:.0f} MB): bertkit (MPI) {o:.3f} s "
              f"({mb / 1e3 / o:.2f} GB/s), torch gloo {t:.3f} s ({mb / 1e3 / t:.2f} GB/s): "
              f"{t / o:.2f}x  [rounds: {ours} / {theirs}]")
    print(f"BERT-base pre-training steps, 4 sequences of the records a step, "
          f"{a.steps - 1} steps timed (median s/step)")
    one, two = [], []
    for _ in range(a.rounds):
        one.append(statistics.median(step_seconds(a.bertkit, a.records, 1, 2, a.steps)))
        two.append(statistics.median(step_seconds(a.bertkit, a.records, 2, 1, a.steps)))
    print(f"  1 process x 2 threads (accumulation 2): {min(one):.2f} s/step  {one}")
    print(f"  2 ranks x 1 thread (MPI, accumulation 1): {min(two):.2f} s/step  {two}")
    print(f"  2 ranks / 1 process: {min(two) / min(one):.2f}")


if __name__ == "__main__":
    sys.exit(main())
