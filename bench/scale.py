#!/usr/bin/env python3
"""The data half at scale: `make data`'s chain on a diverse corpus of 1, 4 and 10 GB of XML.

For each size (bench/scale_corpus.py makes the corpus, deterministic; the largest is kept
between runs, and the generator's pseudo-words in WORK/vocab-cache):
  `bertkit pipeline` with make data's stages and parameters (pipelines/data.toml: 256 + 16
  zstd shards, records phase 1 and 2 at dupe 5, held-out records) downloads from the local
  mirror, formats, shards and writes records, once per thread count (RAYON_NUM_THREADS). Each
  step's wall and CPU seconds and peak resident set come from the pipeline's own report (its
  meter resets the process's high-water mark per step; "from" is the resident set the step
  started with: memory the allocator kept from earlier steps). Disk written: each output
  folder's size. To fit the disk, phase 1 runs first and its records are measured and deleted
  before phase 2 runs (the pipeline finds the earlier steps up to date); later thread counts
  reuse the downloaded files.
Then, with --baseline-gb, the same at that size on the repeated-chunk baseline (the same
pages and books with their own words: scale_corpus.py --real-words), so the cost of diverse
words shows side by side.
With --google-bert DIR: Google's create_pretraining_data.py (the peer, as in make
bench-records) and `bertkit records` (1 thread, --compat google and default) on a --slice-mb
slice of the diverse corpus's formatted text: per-CPU-second ratios on diverse text.

Writes WORK/results.json and prints the tables BENCHMARKS.md holds, and the projection for
full English Wikipedia (see project()).

Usage: bench/scale.py --bertkit target/release/bertkit --shared ../shared/data --work DIR
                      [--gb 1,4,10] [--threads 1,2] [--baseline-gb 1] [--google-bert DIR]
"""
import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STEP = re.compile(r"^  (\S.*?)\s+(done|up to date)\s+(.*) \(([0-9.]+) s, ([0-9.]+) CPU-s"
                  r"(?:, peak (\d+) MiB(?: from (\d+))?)?\)$")


def sh(cmd, env=None, log=None):
    """Runs cmd, teeing its stdout into `log`; returns (wall s, CPU s of the child, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if log:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{res.stdout}{res.stderr[-5000:]}\n")
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, res.stdout


def du(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def corpus(args, gb, real_words):
    """The corpus folder for `gb` GB, generated unless already there with the same parameters."""
    name = f"corpus-{gb:g}gb" + ("-real" if real_words else "")
    out = os.path.join(args.work, name)
    stats_path = os.path.join(out, "corpus-stats.json")
    if os.path.exists(stats_path):
        stats = json.load(open(stats_path))
        if stats["gb"] == gb and stats["seed"] == args.seed and stats.get("real_words") == real_words:
            return out, stats
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, os.path.join(HERE, "scale_corpus.py"), "--shared", args.shared, "--bertkit",
           args.bertkit, "--out", out, "--gb", str(gb), "--seed", str(args.seed),
           "--vocab-cache", os.path.join(args.work, "vocab-cache")]
    if real_words:
        cmd.append("--real-words")
    print(f"== generating {name}", flush=True)
    wall, _, out_text = sh(cmd)
    print(out_text.strip().splitlines()[-1], f"({wall:.0f} s)", flush=True)
    return out, json.load(open(stats_path))


def pipeline(args, folder, threads, log):
    """make data's chain on `folder`'s corpus at `threads` threads: the steps and disk sizes."""
    base = open(os.path.join(folder, "pipeline.toml")).read()
    run_dir = os.path.join(folder, "run")
    for d in ("formatted", "shards", "records"):
        shutil.rmtree(os.path.join(run_dir, d), ignore_errors=True)
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    steps, disk = [], {}
    for phase in (1, 2):
        config = os.path.join(folder, f"pipeline-phase{phase}.toml")
        with open(config, "w") as f:
            f.write(base.replace("phases = [1, 2]", f"phases = [{phase}]"))
        wall, cpu, out = sh([args.bertkit, "pipeline", "--config", config, "--mirror",
                             os.path.join(folder, "mirror"), "--registry", os.path.join(folder, "registry.toml")],
                            env=env, log=log)
        for line in out.splitlines():
            m = STEP.match(line)
            if m and m.group(2) == "done":
                steps.append({"step": m.group(1).strip(), "summary": m.group(3),
                              "wall": float(m.group(4)), "cpu": float(m.group(5)),
                              "peak_mib": int(m.group(6)) if m.group(6) else None,
                              "start_mib": int(m.group(7)) if m.group(7) else None})
        if phase == 1:
            for d in ("raw", "formatted/wiki", "formatted/books", "shards"):
                disk[d] = du(os.path.join(run_dir, d))
        for d in (f"phase{phase}", f"phase{phase}-heldout"):
            disk[f"records/{d}"] = du(os.path.join(run_dir, "records", d))
            shutil.rmtree(os.path.join(run_dir, "records", d), ignore_errors=True)
    return steps, disk


def peer(args, folder, log):
    """Google's script and bertkit records on a slice of the corpus's formatted text."""
    work = os.path.join(args.work, "peer")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    slice_path = os.path.join(work, "slice.txt")
    want = int(args.slice_mb * 1e6)
    # Documents (blank-line separated) from the formatted wiki files, then the books, in order.
    with open(slice_path, "w", encoding="utf-8") as out:
        written = 0
        wiki_want = int(want * 0.85)
        for sub, limit in (("wiki", wiki_want), ("books", want)):
            d = os.path.join(folder, "run", "formatted", sub)
            for name in sorted(os.listdir(d)):
                if not name.endswith(".txt") or written >= limit:
                    continue
                with open(os.path.join(d, name), encoding="utf-8") as f:
                    for line in f:
                        out.write(line)
                        written += len(line.encode())
                        if written >= limit and line == "\n":
                            break
    mb = os.path.getsize(slice_path) / 1e6
    vocab = os.path.join(args.shared, "minilm", "vocab.txt")
    flags = ["--max_seq_length=128", "--max_predictions_per_seq=20", "--masked_lm_prob=0.15",
             "--short_seq_prob=0.1", "--random_seed=12345", f"--dupe_factor={args.peer_dupe}",
             "--do_lower_case=True"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, "peers/tensorflow_standin"),
                                                      os.path.abspath(args.google_bert)]))
    peer_out = os.path.join(work, "google.jsonl")
    print(f"== the peer on a {mb:.0f} MB slice (dupe {args.peer_dupe})", flush=True)
    wall, cpu, _ = sh([sys.executable, os.path.join(args.google_bert, "create_pretraining_data.py"),
                       f"--input_file={slice_path}", f"--output_file={peer_out}", f"--vocab_file={vocab}"] + flags,
                      env=env, log=log)
    instances = tokens = 0
    with open(peer_out) as f:
        for line in f:
            r = json.loads(line)
            instances += 1
            tokens += sum(r["input_mask"])
    os.remove(peer_out)
    rows = [{"run": "create_pretraining_data.py", "wall": wall, "cpu": cpu, "instances": instances,
             "tokens": tokens}]
    import pyarrow.parquet as pq
    common = ["--vocab", vocab, "--dupe-factor", str(args.peer_dupe), "--seed", "12345"]
    for name, extra in (("bertkit records --compat google", ["--compat", "google"]),
                        ("bertkit records (default mode)", [])):
        out = os.path.join(work, "records.parquet")
        wall, cpu, _ = sh([args.bertkit, "records", "--input", slice_path, "--output", out] + extra + common,
                          env=dict(os.environ, RAYON_NUM_THREADS="1"), log=log)
        lengths = pq.read_table(out, columns=["seq_len"]).column("seq_len").to_pylist()
        rows.append({"run": name + ", 1 thread", "wall": wall, "cpu": cpu, "instances": len(lengths),
                     "tokens": sum(lengths)})
        os.remove(out)
    return {"slice_mb": mb, "dupe": args.peer_dupe, "rows": rows}


def by_stage(steps):
    """Steps grouped as the stages of the projection."""
    stages = {}
    for s in steps:
        name = s["step"]
        key = ("download" if name.startswith("download") else "format wiki" if name == "format wiki"
               else "format books" if name == "format books" else "shard" if name == "shard"
               else "records phase 1" if name.startswith("records phase 1")
               else "records phase 2" if name.startswith("records phase 2") else name)
        g = stages.setdefault(key, {"wall": 0.0, "cpu": 0.0, "peak_mib": 0, "start_mib": 0})
        g["wall"] += s["wall"]
        g["cpu"] += s["cpu"]
        if s["peak_mib"] and s["peak_mib"] > g["peak_mib"]:
            g["peak_mib"], g["start_mib"] = s["peak_mib"], s["start_mib"] or 0
    return stages


FULL_XML_GB = 96.0   # enwiki 2024 pages-articles, uncompressed (~22 GB bz2)
FULL_BOOKS_FRACTION = 0.15


def project(results):
    """Full English Wikipedia on 16, 64 and 128 cores, from the largest size's measured rates.

    Per stage: CPU seconds per GB of XML at the largest size (1 thread), times 96 GB; spread
    over N cores with the serial fraction the 1 -> 2 thread wall times imply (Amdahl:
    f = 2 * T2 / T1 - 1, clamped to [0, 1]). Disk is not modelled here (see BENCHMARKS.md).
    """
    runs = [r for r in results["runs"] if not r["baseline"]]
    gb = max(r["gb"] for r in runs)
    one = next((r for r in runs if r["gb"] == gb and r["threads"] == 1), None)
    two = next((r for r in runs if r["gb"] == gb and r["threads"] == 2), None)
    if not one or not two:
        return None
    rows = []
    for stage, s1 in by_stage(one["steps"]).items():
        s2 = by_stage(two["steps"]).get(stage)
        if not s2 or stage == "download":
            continue
        cpu_per_gb = s1["cpu"] / gb
        serial = min(1.0, max(0.0, 2 * s2["wall"] / s1["wall"] - 1)) if s1["wall"] > 0 else 0.0
        row = {"stage": stage, "cpu_s_per_gb": cpu_per_gb, "serial_fraction": serial}
        for cores in (16, 64, 128):
            t1 = cpu_per_gb * FULL_XML_GB
            row[f"{cores}_cores_s"] = t1 * (serial + (1 - serial) / cores)
        rows.append(row)
    return {"from_gb": gb, "full_xml_gb": FULL_XML_GB, "rows": rows,
            "total": {f"{c}_cores_s": sum(r[f"{c}_cores_s"] for r in rows) for c in (16, 64, 128)}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bertkit", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--work", default="target/bench-scale")
    ap.add_argument("--gb", default="1,4,10", help="corpus sizes, GB of XML")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--baseline-gb", type=float, default=1.0, help="0: no repeated-chunk baseline")
    ap.add_argument("--google-bert", help="a google-research/bert checkout: the records peer")
    ap.add_argument("--slice-mb", type=float, default=100.0)
    ap.add_argument("--peer-dupe", type=int, default=2)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--keep", action="store_true", help="keep every corpus (default: the largest only)")
    args = ap.parse_args()
    args.work = os.path.abspath(args.work)
    os.makedirs(args.work, exist_ok=True)
    log = os.path.join(args.work, "log.txt")
    results_path = os.path.join(args.work, "results.json")
    results = {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    sizes = [float(g) for g in args.gb.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    plan = [(g, False) for g in sizes] + ([(args.baseline_gb, True)] if args.baseline_gb else [])
    for gb, baseline in plan:
        folder, stats = corpus(args, gb, baseline)
        for t in threads:
            print(f"== {'baseline ' if baseline else ''}{gb:g} GB, {t} thread(s)", flush=True)
            steps, disk = pipeline(args, folder, t, log)
            results["runs"].append({"gb": gb, "baseline": baseline, "threads": t, "corpus": stats,
                                    "steps": steps, "disk": disk})
            for name, s in by_stage(steps).items():
                print(f"  {name:<16} {s['wall']:8.1f} s {s['cpu']:8.1f} CPU-s  peak {s['peak_mib']} MiB "
                      f"(from {s['start_mib']})", flush=True)
            json.dump(results, open(results_path, "w"), indent=1)
        if args.google_bert and not baseline and gb == min(sizes):
            results["peer"] = peer(args, folder, log)
            for r in results["peer"]["rows"]:
                print(f"  {r['run']:<45} {r['cpu']:8.1f} CPU-s {r['tokens'] / r['cpu']:12.0f} tokens/CPU-s")
            json.dump(results, open(results_path, "w"), indent=1)
        if not args.keep and gb != max(sizes):
            shutil.rmtree(folder)
    results["projection"] = project(results)
    json.dump(results, open(results_path, "w"), indent=1)
    print(json.dumps(results["projection"], indent=1))
    print(f"results: {results_path}")


if __name__ == "__main__":
    main()
