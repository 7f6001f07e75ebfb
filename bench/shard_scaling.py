#!/usr/bin/env python3
"""Benchmark of `bertkit shard`: throughput and peak memory at 1x, 4x and 16x a base corpus.

The base corpus is the real fixtures (enwiki chunk + three Gutenberg books) formatted by
`bertkit format`, repeated until it is at least --base-mb MB, each copy's documents made
distinct by a marker on their first line ("[copy C doc D]"). Scale S is S times the base
(16x >= 2 GB with the default 128 MB base). Each copy is one input file.

In the same run, as peers on the same files:
  - `cat FILES > /dev/null`: the cost of reading the corpus once (the floor for any sharder);
  - `cat FILES | shuf -o /dev/null` (GNU shuf): an in-memory shuffle of the lines, the way NVIDIA's
    sharding script holds the corpus in memory; its peak RSS grows with the corpus.
Peak RSS comes from `/usr/bin/time -v` (Debian package `time`).

Usage: bench/shard_scaling.py --bertkit target/release/bertkit --shared ../shared/data
                              [--work target/bench-shard] [--base-mb 128] [--scales 1,4,16]
"""
import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time


def timed(cmd, stdout=subprocess.DEVNULL):
    """Runs cmd under /usr/bin/time -v; returns (wall s, peak RSS MB)."""
    t0 = time.perf_counter()
    res = subprocess.run(["/usr/bin/time", "-v"] + cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} failed:\n{res.stderr[-2000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr).group(1))
    return wall, rss_kb / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bertkit", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--work", default="target/bench-shard")
    ap.add_argument("--base-mb", type=int, default=128)
    ap.add_argument("--scales", default="1,4,16")
    ap.add_argument("--train-shards", type=int, default=64)
    ap.add_argument("--test-shards", type=int, default=8)
    args = ap.parse_args()
    if not os.path.exists("/usr/bin/time"):
        sys.exit("/usr/bin/time is missing: apt-get install time")
    work = os.path.abspath(args.work)
    scales = [int(s) for s in args.scales.split(",")]

    # The formatted fixtures.
    formatted = os.path.join(work, "formatted")
    wiki = os.path.join(args.shared, "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
    subprocess.run([args.bertkit, "format", "wiki", "--input", wiki, "--output", formatted + "/wiki", "-q"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([args.bertkit, "format", "books", "--input", os.path.join(args.shared, "gutenberg"),
                    "--output", formatted + "/books", "-q"], check=True, stdout=subprocess.DEVNULL)
    docs = []
    for sub, name in [("wiki", "wiki_00000.txt"), ("books", "books_00000.txt")]:
        with open(os.path.join(formatted, sub, name), encoding="utf-8") as f:
            docs += [d for d in f.read().split("\n\n") if d.strip()]
    copy_bytes = sum(len(d.encode()) + 2 for d in docs)
    per_base = math.ceil(args.base_mb * 1e6 / copy_bytes)
    copies = per_base * max(scales)

    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus, exist_ok=True)
    files = []
    for c in range(copies):
        path = os.path.join(corpus, f"copy_{c:05}.txt")
        files.append(path)
        if os.path.exists(path):
            continue
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            for i, d in enumerate(docs):
                first, _, rest = d.partition("\n")
                f.write(f"{first} [copy {c} doc {i}]\n{rest}\n\n" if rest else f"{first} [copy {c} doc {i}]\n\n")
        os.replace(path + ".tmp", path)

    print(f"machine: {platform.node()}, {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"base: the formatted fixtures ({len(docs)} documents, {copy_bytes / 1e6:.1f} MB) x {per_base} copies; "
          f"{args.train_shards} train + {args.test_shards} test shards, test fraction 0.1\n")
    print("| scale | corpus MB | documents | tool | wall s | MB/s | peak RSS MB | test fraction | "
          "train imbalance sentences / bytes |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---|")
    for s in scales:
        chosen = files[: per_base * s]
        mb = sum(os.path.getsize(p) for p in chosen) / 1e6
        out = os.path.join(work, f"out-{s}x")
        shutil.rmtree(out, ignore_errors=True)
        wall, rss = timed([args.bertkit, "shard", "--input"] + chosen + [
            "--output", out, "--num-train-shards", str(args.train_shards), "--num-test-shards",
            str(args.test_shards), "--test-fraction", "0.1", "--seed", "1", "-q"])
        with open(os.path.join(out, "shard.manifest.json")) as f:
            t = json.load(f)["totals"]
        print(f"| {s}x | {mb:.0f} | {t['documents']} | bertkit shard | {wall:.1f} | {mb / wall:.0f} | {rss:.0f} | "
              f"{t['test_fraction_achieved']:.4f} | {100 * t['train_sentence_imbalance']:.2f}% / "
              f"{100 * t['train_byte_imbalance']:.2f}% |")
        shutil.rmtree(out, ignore_errors=True)
        wall, rss = timed(["cat"] + chosen)
        print(f"| {s}x | {mb:.0f} | | cat (read once) | {wall:.1f} | {mb / wall:.0f} | {rss:.0f} | | |")
        # shuf reads one file: feed it all of them through cat (time -v reports the largest
        # process of the pipeline).
        wall, rss = timed(["sh", "-c", 'cat "$@" | shuf -o /dev/null', "sh"] + chosen)
        print(f"| {s}x | {mb:.0f} | | shuf (in memory) | {wall:.1f} | {mb / wall:.0f} | {rss:.0f} | | |")


if __name__ == "__main__":
    main()
