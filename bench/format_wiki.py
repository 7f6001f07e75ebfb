#!/usr/bin/env python3
"""Benchmark of `bertkit format wiki`, side by side with its peers, in one run.

Peers: WikiExtractor 3.1.0 (PyPI `wikiextractor`, one process, default options) on the same
uncompressed XML, and `bzip2 -dc` decoding the same compressed files.

Measured (median of --repeat runs; wall time and CPU time of the child processes):
  1. parse + clean + sentence split on plain XML, one worker: MB/s of XML per CPU-second,
     against WikiExtractor's (issue floor: 20x);
  2. single-stream .bz2 end to end against `bzip2 -dc` alone (floor: within 25%);
  3. multistream .bz2 with T threads against T x the one-core `bzip2 -dc` rate (floor: 0.8).
Every bertkit variant must produce the same output (checked through the manifests' hashes).

Usage: bench/format_wiki.py --bertkit target/release/bertkit --chunk <enwiki chunk .bz2>
                            [--work DIR] [--scale 10] [--repeat 5]
Run through `make bench-format`, which builds the release binary and the WikiExtractor venv.
"""
import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_wiki_inputs  # noqa: E402


def timed(cmd, repeat, cleanup=None):
    """Runs cmd `repeat` times; returns (median wall s, median CPU s)."""
    walls, cpus = [], []
    for _ in range(repeat):
        if cleanup:
            cleanup()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        walls.append(wall)
        cpus.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    return statistics.median(walls), statistics.median(cpus)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bertkit", required=True)
    ap.add_argument("--chunk", required=True)
    ap.add_argument("--wikiextractor-python", default=os.path.join(os.path.dirname(__file__), ".venv/bin/python"))
    ap.add_argument("--work", default="target/bench-format")
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    work = os.path.abspath(args.work)
    inputs = os.path.join(work, "inputs")
    n = args.scale
    sys.argv = ["make_wiki_inputs", args.chunk, inputs, str(n)]
    make_wiki_inputs.main()
    xml1 = os.path.join(inputs, "enwiki.xml")
    xmln = os.path.join(inputs, f"enwiki-x{n}.xml")
    bz2n = os.path.join(inputs, f"enwiki-x{n}.xml.bz2")
    multin = os.path.join(inputs, f"enwiki-x{n}-multistream.xml.bz2")
    size1 = os.path.getsize(xml1) / 1e6
    sizen = os.path.getsize(xmln) / 1e6
    cores = os.cpu_count()

    rows = []
    outputs = {}

    def bertkit(name, path, threads, size):
        out = os.path.join(work, "out", name)

        def clean():
            shutil.rmtree(out, ignore_errors=True)

        cmd = [args.bertkit, "format", "wiki", "--input", path, "--output", out, "-q"]
        if threads:
            cmd += ["--threads", str(threads)]
        wall, cpu = timed(cmd, args.repeat, clean)
        with open(os.path.join(out, "wiki.manifest.json")) as f:
            outputs[name] = [o["sha256"] for o in json.load(f)["outputs"]]
        rows.append((name, size, wall, cpu))
        return wall, cpu

    # Peer 1: WikiExtractor on the plain chunk.
    wx_out = os.path.join(work, "wikiextractor")
    wx_wall, wx_cpu = timed(
        [args.wikiextractor_python, "-m", "wikiextractor.WikiExtractor", xml1, "-o", wx_out, "--processes", "1", "-q"],
        args.repeat,
        lambda: shutil.rmtree(wx_out, ignore_errors=True),
    )
    rows.append(("WikiExtractor 3.1.0, plain XML x1, 1 process", size1, wx_wall, wx_cpu))
    # Peer 2: bzip2 -dc alone.
    bz_wall, bz_cpu = timed(["bzip2", "-dc", "-k", bz2n], args.repeat)
    rows.append((f"bzip2 -dc, single-stream x{n}", sizen, bz_wall, bz_cpu))

    x1 = bertkit("bertkit plain XML x1, --threads 1", xml1, 1, size1)
    xn = bertkit(f"bertkit plain XML x{n}, --threads 1", xmln, 1, sizen)
    single = bertkit(f"bertkit single-stream bz2 x{n}, --threads {cores}", bz2n, cores, sizen)
    multi = {}
    for t in sorted({1, 2, cores}):
        multi[t] = bertkit(f"bertkit multistream bz2 x{n}, --threads {t}", multin, t, sizen)

    print(f"machine: {platform.node()}, {cores} cores, {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}")
    print(f"input: enwiki chunk {size1:.1f} MB of XML; x{n} = its pages repeated {n} times ({sizen:.1f} MB)")
    print(f"median of {args.repeat} runs\n")
    print("| run | MB of XML | wall s | CPU s | MB/s wall | MB per CPU-s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, size, wall, cpu in rows:
        print(f"| {name} | {size:.1f} | {wall:.3f} | {cpu:.3f} | {size / wall:.1f} | {size / cpu:.1f} |")

    wx_rate = size1 / wx_cpu
    bz_rate = sizen / bz_wall
    print("\n| check | measured | floor |")
    print("|---|---:|---:|")
    print(f"| plain XML x1, MB per CPU-s vs WikiExtractor | {size1 / x1[1] / wx_rate:.1f}x | 20x |")
    print(f"| plain XML x{n}, MB per CPU-s vs WikiExtractor | {sizen / xn[1] / wx_rate:.1f}x | 20x |")
    print(f"| single-stream bz2 wall / bzip2 -dc wall | {single[0] / bz_wall:.2f} | <= 1.25 |")
    for t, (wall, _) in multi.items():
        print(f"| multistream, {t} thread(s): rate / ({t} x bzip2 -dc rate) | {sizen / wall / (t * bz_rate):.2f} | >= 0.8 |")

    reference = outputs[f"bertkit plain XML x{n}, --threads 1"]
    same = all(v == reference for k, v in outputs.items() if f"x{n}" in k)
    print(f"\nidentical output across plain, single-stream and multistream x{n} at every thread count: {same}")
    if not same:
        sys.exit("outputs differ")


if __name__ == "__main__":
    main()
