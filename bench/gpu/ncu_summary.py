#!/usr/bin/env python3
"""Where the device's time goes, per kernel name, from `ncu --csv --print-units base --metrics
gpu__time_duration.sum` (one row per launch): each kernel's launches, total and mean time,
and its share, largest first. ncu replays kernels one at a time, so the figures are each
kernel's own time on an idle device (no overlap), not a timeline.

`--by-shape` keys each kernel by its launch's grid and block as well (ncu's "Grid Size" and
"Block Size" columns): the products of different shapes that one cuBLAS kernel name covers
apart (which of a layer's products is slow).

Usage: python3 ncu_summary.py ncu.csv [--top 40] [--passes 2] [--by-shape]
"""
import argparse
import collections
import csv
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--passes", type=int, default=1, help="passes profiled (figures are per pass)")
    ap.add_argument("--by-shape", action="store_true", help="a row per kernel and launch shape")
    args = ap.parse_args()
    with open(args.csv, newline="", errors="replace") as f:
        # ncu prints its own lines (==PROF== ...) before the table: start at the header.
        lines = [l for l in f if l.startswith('"')]
    rows = list(csv.DictReader(lines))
    if not rows or "Kernel Name" not in rows[0]:
        sys.exit(f"{args.csv}: no ncu CSV table found ({len(lines)} quoted lines)")
    total = collections.Counter()
    calls = collections.Counter()
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(unit, 1e-6)
        try:
            value = float(r["Metric Value"].replace(",", "")) * scale
        except ValueError:
            continue
        # Template arguments and parameter lists make one kernel many names: keep the stem.
        name = r["Kernel Name"].split("(")[0].split("<")[0].strip()
        if args.by_shape:
            name = f'{name} {r.get("Grid Size", "?")}x{r.get("Block Size", "?")}'.replace('"', "")
        total[name] += value
        calls[name] += 1
    grand = sum(total.values())
    n = max(args.passes, 1)
    width = 72 if args.by_shape else 48
    print(f"{'kernel':<{width}} {'launches':>9} {'ms':>9} {'us each':>9} {'share':>7}")
    for name, ms in total.most_common(args.top):
        print(f"{name[:width]:<{width}} {calls[name] // n:>9} {ms / n:>9.2f} "
              f"{1e3 * ms / calls[name]:>9.1f} {100 * ms / grand:>6.1f}%")
    print(f"{'all kernels':<{width}} {sum(calls.values()) // n:>9} {grand / n:>9.2f}")


if __name__ == "__main__":
    main()
