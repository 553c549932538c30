#!/usr/bin/env python3
"""Where a kernel's warps spend their time, from ncu's warp stall sampling per SASS instruction.

Record the CSV on the GPU machine (one launch of the kernel), then summarise it:

    ncu -k regex:SequenceStep --launch-skip 3 --launch-count 1 --section SourceCounters \\
        --section WarpStateStats --page source --print-source sass --csv \\
        build-gpu/bench/ttt-bench --backend cuda --preset 1b --batch 1 --offset 64 --steps 8 \\
        --single_sequence_kernel > source.csv
    bench/stall_regions.py source.csv [--range FIRST LAST ...]

A sample is a warp caught at an instruction, so a region's share of the samples is its share of
the warps' time. Prints the shares by stall reason, the innermost loops (a backward branch and
its body) with their mix of instructions, each grid barrier (a release fence and atomic, the
poll after it, and the block's sync once the poll ends), and the sum over any --range of
instruction addresses (the last hex digits suffice, as printed).
"""
import argparse
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
AFTER_SYNC = 7  # Instructions after a block sync where its waiting warps are sampled.


def read(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, row in enumerate(rows) if row[:2] == ["Address", "Source"])
    names = rows[header]
    index = {name: i for i, name in enumerate(names)}
    code = []
    for row in rows[header + 1:]:
        if len(row) < len(names):
            continue
        code.append({
            "address": int(row[0], 16),
            "text": row[1].strip(),
            "samples": int(row[index[SAMPLES]] or 0),
            "stalls": {name[len("stall_"):]: int(row[i] or 0) for name, i in index.items()
                       if name.startswith("stall_") and "Not Issued" not in name},
        })
    return code


def innermost_loops(code):
    at = {c["address"]: i for i, c in enumerate(code)}
    loops = []
    for i, c in enumerate(code):
        target = re.search(r"BRA (0x[0-9a-f]+)", c["text"])
        if target and at.get(int(target.group(1), 16), i + 1) <= i:
            loops.append((at[int(target.group(1), 16)], i))
    return [(a, b) for a, b in loops
            if not any(a <= c and d <= b for c, d in loops if (c, d) != (a, b))]


def grid_barriers(code):
    for i, c in enumerate(code):
        if not c["text"].startswith("ATOM") or ".GPU" not in c["text"]:
            continue
        first = i
        while first > 0 and not code[first - 1]["text"].startswith("MEMBAR"):
            first -= 1
        sync = next((j for j in range(i, min(i + 40, len(code))) if "BAR.SYNC" in code[j]["text"]),
                    None)
        if sync is not None:
            yield max(0, first - 1), min(len(code) - 1, sync + AFTER_SYNC)


def find(code, address):
    """The index of the instruction whose address ends in these hex digits."""
    for i, c in enumerate(code):
        if f"{c['address']:x}".endswith(address.lower()):
            return i
    raise SystemExit(f"no instruction at an address ending in {address}")


def total(code, first, last):
    return sum(c["samples"] for c in code[first:last + 1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--range", nargs=2, action="append", default=[], metavar=("FIRST", "LAST"))
    parser.add_argument("--loops", type=int, default=12, help="innermost loops to print")
    args = parser.parse_args()
    code = read(args.csv)
    all_samples = sum(c["samples"] for c in code)
    print(f"{all_samples} samples over {len(code)} instructions")

    reasons = {}
    for c in code:
        for reason, n in c["stalls"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    for reason, n in sorted(reasons.items(), key=lambda r: -r[1])[:10]:
        print(f"  {reason:20s} {100 * n / all_samples:5.1f}%")

    def show(name, first, last, extra=""):
        n = total(code, first, last)
        print(f"  {code[first]['address']:x}-{code[last]['address']:x} {name:14s} {n:8d} "
              f"{100 * n / all_samples:5.1f}%{extra}")

    print("innermost loops:")
    loops = sorted(innermost_loops(code), key=lambda loop: -total(code, *loop))
    for first, last in loops[:args.loops]:
        body = [c["text"] for c in code[first:last + 1]]
        mix = {op: sum(op in text for text in body) for op in ("FFMA", "HMMA", "LDS", "SYNCS")}
        show(f"{last - first + 1} instr", first, last,
             "  " + " ".join(f"{op} {n}" for op, n in mix.items() if n))
    print("grid barriers:")
    barriers = list(grid_barriers(code))
    for first, last in barriers:
        show("barrier", first, last)
    n = sum(total(code, first, last) for first, last in barriers)
    print(f"  all {len(barriers)}: {n} samples, {100 * n / all_samples:.1f}%")
    for first, last in args.range:
        show("range", find(code, first), find(code, last))


if __name__ == "__main__":
    main()
