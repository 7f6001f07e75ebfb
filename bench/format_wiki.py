#!/usr/bin/env python3
"""Benchmark of `bertkit format wiki`, side by side with its peers, in one run.

Peers: WikiExtractor 3.1.0 (PyPI `wikiextractor`, one process, default options) on the same
uncompressed XML, and `bzip2 -dc` decoding the same compressed files.

Measured in rounds (each round runs every variant once; --repeat rounds); the table gives
medians of wall time and CPU time of the child processes, and each check is a ratio computed
within each round (runs seconds apart, so the shared machine's drift cancels), median over rounds:
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
import glob
import json
import re
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


def run_once(cmd, cleanup=None):
    """Runs cmd once; returns (wall s, CPU s of the child)."""
    if cleanup:
        cleanup()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(variants, repeat):
    """Runs every variant once per round, `repeat` rounds, so that drift in the machine's speed
    hits every variant alike. Returns {name: [(wall, CPU) per round]}."""
    times = {name: [] for name, _, _ in variants}
    for _ in range(repeat):
        for name, cmd, cleanup in variants:
            times[name].append(run_once(cmd, cleanup))
    return times


def median_of(rounds, index):
    return statistics.median(r[index] for r in rounds)


def compare_with_wikiextractor(wx_dir, bertkit_dir, top=10):
    """Text kept per article, bertkit vs WikiExtractor, for the largest articles.

    WikiExtractor writes <doc title=...> blocks; bertkit writes no titles, so a bertkit
    document is matched by the letters of its first sentence appearing at the start of the
    WikiExtractor article body. Returns rows (title, WikiExtractor chars, bertkit chars) and
    the totals over all articles both kept.
    """
    wx = "".join(open(f, encoding="utf-8").read() for f in sorted(glob.glob(os.path.join(wx_dir, "*", "wiki_*"))))
    docs = re.findall(r'<doc id="\d+"[^>]*title="([^"]*)">\n(.*?)</doc>', wx, re.S)
    ours = []
    for f in sorted(glob.glob(os.path.join(bertkit_dir, "wiki_*.txt"))):
        ours += [d for d in open(f, encoding="utf-8").read().split("\n\n") if d.strip()]

    def key(s):
        return re.sub(r"\W+", "", s)[:40]

    by_key = {key(d.split("\n")[0]): d for d in ours}
    rows = []
    for title, body in docs:
        body = body.split("\n", 1)[1] if "\n" in body else ""
        text = re.sub(r"\W+", "", body[:2000])
        match = next((d for k, d in by_key.items() if k and k in text), None)
        if match is not None:
            # Compare letters and digits only: the two tools lay out whitespace differently.
            rows.append((title, len(re.sub(r"\W+", "", body)), len(re.sub(r"\W+", "", match))))
    rows.sort(key=lambda r: -r[1])
    return rows[:top], sum(r[1] for r in rows), sum(r[2] for r in rows), len(rows), len(docs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bertkit", required=True)
    ap.add_argument("--chunk", required=True)
    ap.add_argument("--wikiextractor-python", default=os.path.join(os.path.dirname(__file__), ".venv/bin/python"))
    ap.add_argument("--work", default="target/bench-format")
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=7)
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

    variants = []  # (name, command, cleanup)
    sizes = {}
    bertkit_outputs = {}

    def rmtree(path):
        return lambda: shutil.rmtree(path, ignore_errors=True)

    wx_out = os.path.join(work, "wikiextractor")
    wx_name = "WikiExtractor 3.1.0, plain XML x1, 1 process"
    variants.append((wx_name, [args.wikiextractor_python, "-m", "wikiextractor.WikiExtractor", xml1, "-o", wx_out,
                               "--processes", "1", "-q"], rmtree(wx_out)))
    sizes[wx_name] = size1
    bz_name = f"bzip2 -dc, single-stream x{n}"
    variants.append((bz_name, ["bzip2", "-dc", "-k", bz2n], None))
    sizes[bz_name] = sizen

    def bertkit(name, path, threads, size):
        out = os.path.join(work, "out", name)
        cmd = [args.bertkit, "format", "wiki", "--input", path, "--output", out, "-q", "--threads", str(threads)]
        variants.append((name, cmd, rmtree(out)))
        sizes[name] = size
        bertkit_outputs[name] = out
        return name

    x1 = bertkit("bertkit plain XML x1, --threads 1", xml1, 1, size1)
    xn = bertkit(f"bertkit plain XML x{n}, --threads 1", xmln, 1, sizen)
    single = bertkit(f"bertkit single-stream bz2 x{n}, --threads {cores}", bz2n, cores, sizen)
    multi = {t: bertkit(f"bertkit multistream bz2 x{n}, --threads {t}", multin, t, sizen) for t in sorted({1, 2, cores})}

    rounds = measure(variants, args.repeat)
    results = {name: (median_of(r, 0), median_of(r, 1)) for name, r in rounds.items()}
    rows = [(name, sizes[name], *results[name]) for name, _, _ in variants]
    outputs = {}
    for name, out in bertkit_outputs.items():
        with open(os.path.join(out, "wiki.manifest.json")) as f:
            outputs[name] = [o["sha256"] for o in json.load(f)["outputs"]]

    def per_round(ratio):
        """Median over rounds of a ratio computed within each round."""
        return statistics.median(ratio(i) for i in range(args.repeat))

    def wall_of(name, i):
        return rounds[name][i][0]

    def cpu_of(name, i):
        return rounds[name][i][1]

    print(f"machine: {platform.node()}, {cores} cores, {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}")
    print(f"input: enwiki chunk {size1:.1f} MB of XML; x{n} = its pages repeated {n} times ({sizen:.1f} MB)")
    print(f"median of {args.repeat} rounds; each round runs every variant once, in table order\n")
    print("| run | MB of XML | wall s | CPU s | MB/s wall | MB per CPU-s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, size, wall, cpu in rows:
        print(f"| {name} | {size:.1f} | {wall:.3f} | {cpu:.3f} | {size / wall:.1f} | {size / cpu:.1f} |")

    print("\nChecks: each ratio is computed within a round (runs seconds apart), then the median "
          "over rounds is taken.")
    print("| check | measured | floor |")
    print("|---|---:|---:|")
    print(f"| plain XML x1, MB per CPU-s vs WikiExtractor | "
          f"{per_round(lambda i: cpu_of(wx_name, i) / cpu_of(x1, i)):.1f}x | 20x |")
    print(f"| plain XML x{n}, MB per CPU-s vs WikiExtractor | "
          f"{per_round(lambda i: (sizen / cpu_of(xn, i)) / (size1 / cpu_of(wx_name, i))):.1f}x | 20x |")
    print(f"| single-stream bz2 wall / bzip2 -dc wall | {per_round(lambda i: wall_of(single, i) / wall_of(bz_name, i)):.2f} "
          f"| <= 1.25 |")
    for t, name in multi.items():
        ratio = per_round(lambda i: wall_of(bz_name, i) / wall_of(name, i) / t)
        print(f"| multistream, {t} thread(s): rate / ({t} x bzip2 -dc rate) | {ratio:.2f} | >= 0.8 |")

    top, wx_total, bk_total, matched, wx_docs = compare_with_wikiextractor(
        wx_out, bertkit_outputs[x1])
    print(f"\ntext kept (letters and digits), bertkit vs WikiExtractor, largest articles "
          f"({matched} of WikiExtractor's {wx_docs} articles matched a bertkit document):")
    print("| article | WikiExtractor | bertkit | ratio |")
    print("|---|---:|---:|---:|")
    for title, wx_chars, bk_chars in top:
        print(f"| {title} | {wx_chars} | {bk_chars} | {bk_chars / wx_chars:.3f} |")
    print(f"| all matched articles | {wx_total} | {bk_total} | {bk_total / wx_total:.3f} |")

    reference = outputs[xn]
    same = all(v == reference for k, v in outputs.items() if f"x{n}" in k)
    print(f"\nidentical output across plain, single-stream and multistream x{n} at every thread count: {same}")
    if not same:
        sys.exit("outputs differ")


if __name__ == "__main__":
    main()
