#!/usr/bin/env python3
"""Two `bertkit` binaries side by side on the records stage: CPU time of alternated runs.

For a change that should not move the records stage's speed (a refactor, a dependency bump):
both binaries run `bertkit records` on the same inputs, one after the other, --runs times each,
with RAYON_NUM_THREADS=1; reported per binary: the least and the median CPU time (user +
system of the child). Two modes: all inputs into one Parquet file, and a folder of shards into
one file per shard. The outputs of the two binaries are compared as data with pyarrow (they
must be equal unless the change meant to alter them).

Inputs: what `bench/records_throughput.py` leaves in its --work folder (formatted/ and
shards/train), so run that first.

Usage: bench/records_ab.py --before OLD/bertkit --after NEW/bertkit --vocab ../shared/data/minilm/vocab.txt
                           [--work target/bench-records] [--runs 21] [--dupe 2]
"""
import argparse
import os
import resource
import shutil
import statistics
import subprocess


def cpu_seconds(cmd, env):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--work", default="target/bench-records")
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--dupe", type=int, default=2)
    args = ap.parse_args()
    inputs = [os.path.join(args.work, "formatted", k) for k in ("wiki", "books")]
    shards = os.path.join(args.work, "shards", "train")
    out = os.path.join(args.work, "ab")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    binaries = {"before": args.before, "after": args.after}
    times = {(k, m): [] for k in binaries for m in ("file", "folder")}
    for _ in range(args.runs):
        for name, binary in binaries.items():
            common = ["--vocab", args.vocab, "--dupe-factor", str(args.dupe)]
            file_out = os.path.join(out, f"{name}.parquet")
            times[(name, "file")].append(cpu_seconds(
                [binary, "records", "--input", *inputs, "--output", file_out, *common], env))
            folder = os.path.join(out, f"{name}-folder")
            shutil.rmtree(folder, ignore_errors=True)
            times[(name, "folder")].append(cpu_seconds(
                [binary, "records", "--input", shards, "--output", folder, *common], env))
    for mode in ("file", "folder"):
        for name in binaries:
            t = sorted(times[(name, mode)])
            print(f"{mode:6} {name:6} least {t[0] * 1000:6.1f} ms  median "
                  f"{statistics.median(t) * 1000:6.1f} ms  ({len(t)} runs)")
    import pyarrow.parquet as pq
    pairs = [(os.path.join(out, "before.parquet"), os.path.join(out, "after.parquet"))]
    for f in sorted(os.listdir(os.path.join(out, "before-folder"))):
        if f.endswith(".parquet"):
            pairs.append((os.path.join(out, "before-folder", f), os.path.join(out, "after-folder", f)))
    same = all(pq.read_table(a).equals(pq.read_table(b)) for a, b in pairs)
    print(f"outputs equal as data ({len(pairs)} files): {same}")


if __name__ == "__main__":
    main()
