#!/usr/bin/env python3
"""Runs bertkit's fuzz targets (`make fuzz`) and reports what each did.

Builds the fuzz binaries with cargo fuzz (libFuzzer; `--sanitizer none` works on stable Rust,
and safe Rust needs no address sanitizer to turn a memory error into a crash), writes the seed
corpora from the shared data folder (`fuzz-seeds`), then runs every target for SECONDS with
libFuzzer's limits: an input that takes over 1 s is a finding (`-timeout=1`), so is one that
makes the process use over 2 GiB (`-rss_limit_mb`) or allocate over 1 GiB at once
(`-malloc_limit_mb`). Corpora grow under fuzz/corpus/<target>/ and are kept between runs, so
runs add up; findings go to fuzz/artifacts/<target>/ (keep each in fuzz/regressions/<target>/
once fixed: `make test` replays them). Logs: fuzz/logs/<target>.log; the executions of every
run are summed in fuzz/logs/totals.json.

With fewer targets than `--jobs` (by default one per core), each target runs in several
processes at once, sharing its corpus, so that one target uses every core.

Prints a Markdown table per run (executions, speed, coverage, peak RSS, slowest input,
findings) for FUZZING.md. Exits 1 if any target found something.
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

FUZZ = Path(__file__).resolve().parent
ROOT = FUZZ.parent
TRIPLE = "x86_64-unknown-linux-gnu"


def targets():
    """The fuzz binaries named in fuzz/Cargo.toml."""
    text = (FUZZ / "Cargo.toml").read_text()
    return re.findall(r'^\[\[bin\]\]\s*\nname = "([^"]+)"', text, flags=re.M)


def build():
    subprocess.run(
        ["cargo", "fuzz", "build", "--sanitizer", "none", "--fuzz-dir", str(FUZZ)],
        cwd=ROOT,
        check=True,
    )
    subprocess.run(
        [
            "cargo",
            "run",
            "--quiet",
            "--locked",
            "-p",
            "bertkit-fuzz-targets",
            "--bin",
            "fuzz-seeds",
            "--",
            str(FUZZ / "seeds"),
        ],
        cwd=ROOT,
        check=True,
    )


def scratch_env():
    """The environment for a fuzz binary. Targets whose parser reads a file write each input
    to a scratch file under TMPDIR; on a disk file system, opening, truncating and closing it
    took over half of their time, so it goes to a RAM-backed folder where there is one."""
    env = dict(os.environ)
    shm = Path("/dev/shm")
    if "TMPDIR" not in env and shm.is_dir() and os.access(shm, os.W_OK):
        env["TMPDIR"] = str(shm)
    return env


TOTALS = FUZZ / "logs" / "totals.json"
TOTALS_LOCK = threading.Lock()


def totals():
    """Executions of every run so far, per target."""
    return json.loads(TOTALS.read_text()) if TOTALS.exists() else {}


def add_to_totals(target, executions):
    """Adds a finished run's executions (at once, so a run cut short loses only itself)."""
    with TOTALS_LOCK:
        all_runs = totals()
        all_runs[target] = all_runs.get(target, 0) + executions
        TOTALS.parent.mkdir(parents=True, exist_ok=True)
        partial = TOTALS.with_suffix(".json.partial")
        partial.write_text(json.dumps(all_runs, indent=1, sort_keys=True) + "\n")
        partial.replace(TOTALS)
        return all_runs[target]


def run(target, seconds, max_len, goal=None, worker=0, workers=1):
    """Runs one target for `seconds`, or until its executions over all runs reach `goal`;
    returns its figures from libFuzzer's log. A target may run in `workers` processes at once
    (this is number `worker`): they share its corpus folder, each takes its share of the
    executions left, and each writes its own log."""
    corpus = FUZZ / "corpus" / target
    artifacts = FUZZ / "artifacts" / target
    logs = FUZZ / "logs"
    for d in (corpus, artifacts, logs):
        d.mkdir(parents=True, exist_ok=True)
    before = set(artifacts.iterdir())
    binary = FUZZ / "target" / TRIPLE / "release" / target
    command = [
        str(binary),
        str(corpus),
        str(FUZZ / "seeds" / target),
        f"-max_total_time={seconds}",
        "-timeout=1",
        "-rss_limit_mb=2048",
        "-malloc_limit_mb=1024",
        f"-max_len={max_len}",
        "-report_slow_units=1",
        "-print_final_stats=1",
        f"-artifact_prefix={artifacts}/",
    ]
    if goal is not None:
        remaining = goal - totals().get(target, 0)
        share = -(-remaining // workers)
        if share <= 0:
            return None
        command.append(f"-runs={share}")
    log_path = logs / (f"{target}.log" if worker == 0 else f"{target}.{worker}.log")
    with open(log_path, "w") as log:
        status = subprocess.run(
            command, cwd=ROOT, env=scratch_env(), stdout=log, stderr=subprocess.STDOUT
        ).returncode
    log = log_path.read_text(errors="replace")

    def stat(name):
        m = re.findall(rf"stat::{name}:\s*(\d+)", log)
        return int(m[-1]) if m else 0

    coverage = re.findall(r"\bcov: (\d+) ft: (\d+)", log)
    # libFuzzer reports each new slowest input over -report_slow_units (1 s), and at the end
    # the slowest time in whole seconds.
    slow = [float(s) for s in re.findall(r"Slowest unit: (\d+(?:\.\d+)?) s", log)]
    slow += [float(stat("slowest_unit_time_sec"))] if stat("slowest_unit_time_sec") else []
    found = sorted(str(p.relative_to(ROOT)) for p in set(artifacts.iterdir()) - before)
    executions = stat("number_of_executed_units")
    return {
        "target": target,
        "status": status,
        "executions": executions,
        "all_runs": add_to_totals(target, executions),
        "per_second": stat("average_exec_per_sec"),
        "peak_rss_mb": stat("peak_rss_mb"),
        "coverage": int(coverage[-1][0]) if coverage else 0,
        "features": int(coverage[-1][1]) if coverage else 0,
        "corpus": sum(1 for _ in corpus.iterdir()),
        "slowest_s": max(slow) if slow else None,
        "findings": found,
    }


def merge(results):
    """One row per target from its processes' figures: executions and speeds add up, the
    rest is the largest seen (coverage: the processes share a corpus but each counts only what
    it ran)."""
    rows = {}
    for r in results:
        row = rows.get(r["target"])
        if row is None:
            rows[r["target"]] = dict(r, findings=list(r["findings"]))
            continue
        row["status"] = row["status"] or r["status"]
        row["executions"] += r["executions"]
        row["per_second"] += r["per_second"]
        row["all_runs"] = max(row["all_runs"], r["all_runs"])
        for key in ("peak_rss_mb", "coverage", "features", "corpus"):
            row[key] = max(row[key], r[key])
        slow = [x for x in (row["slowest_s"], r["slowest_s"]) if x is not None]
        row["slowest_s"] = max(slow) if slow else None
        row["findings"] = sorted(set(row["findings"]) | set(r["findings"]))
    return list(rows.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=60, help="per target (default 60)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="processes at once (default: one per core); with fewer targets than this, "
        "each target runs in several processes sharing its corpus",
    )
    parser.add_argument("--targets", default="", help="comma-separated (default: all)")
    parser.add_argument("--max-len", type=int, default=65536, help="largest input, bytes")
    parser.add_argument(
        "--executions",
        type=int,
        help="stop each target once its executions over all runs reach this (--seconds still caps a run)",
    )
    parser.add_argument("--no-build", action="store_true", help="use the binaries as built")
    args = parser.parse_args()

    names = [t for t in args.targets.split(",") if t] or targets()
    unknown = set(names) - set(targets())
    if unknown:
        sys.exit(f"error: no such target: {', '.join(sorted(unknown))}")
    if not args.no_build:
        build()

    # With more jobs than targets, each target runs in several processes (libFuzzer's own
    # parallel modes report no final statistics to count).
    workers = max(1, args.jobs // len(names))
    runs = [(t, w) for t in names for w in range(workers)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = pool.map(
            lambda tw: run(tw[0], args.seconds, args.max_len, args.executions, tw[1], workers),
            runs,
        )
        results = merge([r for r in done if r is not None])

    print(
        f"\n{datetime.date.today()}, {args.seconds} s per target, {args.jobs} at once"
        f"{f', {workers} processes per target' if workers > 1 else ''}\n"
    )
    print("| target | executions | exec/s | all runs | coverage (edges / features) | corpus | peak RSS MB | slowest input s | findings |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|")
    for r in results:
        slowest = f"{r['slowest_s']:.2f}" if r["slowest_s"] is not None else "< 1"
        findings = ", ".join(r["findings"]) or ("none" if r["status"] == 0 else f"exit {r['status']}")
        print(
            f"| {r['target']} | {r['executions']:,} | {r['per_second']:,} | {r['all_runs']:,} "
            f"| {r['coverage']:,} / {r['features']:,} | {r['corpus']:,} | {r['peak_rss_mb']:,} "
            f"| {slowest} | {findings} |"
        )
    bad = [r for r in results if r["status"] != 0 or r["findings"]]
    if bad:
        print(f"\n{len(bad)} target(s) found something: see fuzz/artifacts/ and fuzz/logs/", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
