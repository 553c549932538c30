#!/usr/bin/env python3
"""Where one engine step's GPU time goes, from an Nsight Compute CSV.

Record the CSV on the GPU machine, then summarise it (the last step is the last run of kernels
starting with the embedding gather):

    ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv \\
        build-gpu/bench/ttt-bench --backend cuda --preset 1b --batch 256 --steps 1 --warmup 1 \\
        --offset 16 > step.csv
    bench/kernel_breakdown.py step.csv [STEP]

STEP picks another run of kernels by Python index (-2: the one before the last, such as the
prefill before a single decode step). Prints, per kernel name and grid size (so that products of
different shapes through the same kernel stay apart), the launches, the total and the mean
microseconds, largest first.
"""
import collections
import csv
import sys


def main(path, which=-1):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, row in enumerate(rows) if row and row[0] == "ID")
    header = rows[header_at]
    name_col, value_col = header.index("Kernel Name"), header.index("Metric Value")
    grid_col = header.index("Grid Size")
    kernels = [(row[name_col], row[grid_col], float(row[value_col].replace(",", "")))
               for row in rows[header_at + 1:] if len(row) > value_col]
    starts = [i for i, (name, _, _) in enumerate(kernels) if "EmbeddingGather" in name]
    if not starts:
        sys.exit("no embedding gather in the profile: not an engine step")
    bounds = starts + [len(kernels)]
    at = range(len(starts))[which]
    step = kernels[bounds[at]:bounds[at + 1]]
    totals = collections.defaultdict(lambda: [0, 0.0])
    for name, grid, ns in step:
        short = name.split("(")[0].replace("void ", "")
        totals[(short, grid)][0] += 1
        totals[(short, grid)][1] += ns
    step_ns = sum(ns for _, _, ns in step)
    print(f"{len(step)} kernels, {step_ns / 1e3:.1f} us")
    for (short, grid), (count, ns) in sorted(totals.items(), key=lambda item: -item[1][1]):
        print(f"{ns / 1e3:9.1f} us {100 * ns / step_ns:5.1f}% {count:4d} x {ns / count / 1e3:7.2f} us"
              f"  {short[:80]} {grid}")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else -1)
