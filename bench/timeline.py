#!/usr/bin/env python3
"""Where a decode step's time goes, as the kernels ran: from `ttt-bench --timeline FILE`.

    bench/timeline.py FILE [--batch B] [--json] [--order N] [--first KERNEL]

ncu times each kernel alone; in a step, kernels overlap (programmatic dependent launch lets one
start while the one before it ends). So each kernel is charged only the time it adds to the
step: the part of its span that no earlier kernel of the step covers ("exposed"). The exposed
times and the gaps, when no kernel runs, add up to the step.

Prints, for each batch, the step (median over the recorded steps: its span, its gaps, the time
the GPU was busy, the time from its last kernel to the next step's first) and a table by kernel
name and grid size: instances a step, median span, median exposed time per instance, and exposed
time a step, largest first. With --json, the same as one JSON object a batch, which `bench/record.sh
OUT.json bench/timeline.py FILE --json` stores with the commit.
With --order N, also the median step's first N kernels as they started, each with its start,
end and exposed time: the chain of one layer, link by link. Steps that ran outside a graph
(ttt-bench --joining's steps with prompts) need --first: a step then starts at each kernel whose
name contains KERNEL (EmbeddingGather, the first of every step).

The file's rows whose stream is "host" are the host's CUDA calls over the same steps: the table
then ends with the host's time in them a step, by call, largest first (a step outside a graph
that leaves the GPU waiting is waiting for these).
"""
import argparse
import csv
import json
import signal
import statistics
import sys
from collections import defaultdict


def short(name):
    """The kernel's name without this project's namespaces."""
    for prefix in ("ttt::kernels::cuda::(anonymous namespace)::", "ttt::kernels::cuda::"):
        name = name.replace(prefix, "")
    return name


def steps_of(rows, first=None):
    """Rows grouped into steps: a graph launch's kernels share its launch id; or, given `first`,
    a step from each kernel whose name contains it to the next."""
    if first is not None:
        steps = []
        for r in sorted(rows, key=lambda r: r["start"]):
            if first in r["kernel"]:
                steps.append([])
            if steps:
                steps[-1].append(r)
        return steps
    by_launch = defaultdict(list)
    for r in rows:
        by_launch[r["launch"]].append(r)
    # A decode step is one graph launch of many kernels; lone launches (copies' kernels) are not.
    steps = [k for k in by_launch.values() if len(k) > 2]
    return sorted(steps, key=lambda k: min(r["start"] for r in k))


def exposed_times(kernels):
    """Each kernel's time not covered by the kernels that started before it, in start order;
    and the step's span and busy time."""
    kernels = sorted(kernels, key=lambda r: (r["start"], r["end"]))
    covered_to = kernels[0]["start"]
    exposed = []
    for r in kernels:
        exposed.append(max(0, r["end"] - max(r["start"], covered_to)))
        covered_to = max(covered_to, r["end"])
    span = covered_to - kernels[0]["start"]
    return kernels, exposed, span, sum(exposed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--batch", type=int, help="only this batch size")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object a batch instead of the table (for bench/record.sh)")
    parser.add_argument("--order", type=int, metavar="N",
                        help="also list the median step's first N kernels in start order")
    parser.add_argument("--first", metavar="KERNEL",
                        help="steps outside graphs: each starts at a kernel whose name has this")
    args = parser.parse_args()
    by_batch = defaultdict(list)
    calls_by_batch = defaultdict(list)
    with open(args.file, newline="") as f:
        for r in csv.DictReader(f):
            r["start"], r["end"] = int(r["start_ns"]), int(r["end_ns"])
            (calls_by_batch if r["stream"] == "host" else by_batch)[int(r["batch"])].append(r)
    for batch, rows in sorted(by_batch.items()):
        if args.batch is not None and batch != args.batch:
            continue
        steps = steps_of(rows, args.first)
        if not steps:
            print(f"batch {batch}: no step recorded", file=sys.stderr if args.json else sys.stdout)
            continue
        summary = summarise(batch, steps)
        summary["host_calls"] = summarise_calls(calls_by_batch[batch], len(steps))
        if args.json:
            print(json.dumps(summary))
        else:
            print_table(summary)
        if args.order:
            print_order(median_step(steps), args.order)


def summarise(batch, steps):
    """The batch's median step (span, gaps) and its kernels by name and grid, largest first."""
    spans, gaps, busy_times = [], [], []
    per_kernel = defaultdict(lambda: {"span": [], "exposed": [], "per_step": []})
    for step in steps:
        kernels, exposed, span, busy = exposed_times(step)
        spans.append(span)
        gaps.append(span - busy)
        busy_times.append(busy)
        step_total = defaultdict(int)
        for r, e in zip(kernels, exposed):
            key = (r["kernel"], int(r["grid"]))
            per_kernel[key]["span"].append(r["end"] - r["start"])
            per_kernel[key]["exposed"].append(e)
            step_total[key] += e
        for key in per_kernel:
            per_kernel[key]["per_step"].append(step_total.get(key, 0))
    table = sorted(per_kernel.items(), key=lambda kv: -statistics.median(kv[1]["per_step"]))
    # From a step's last kernel to the next one's first: with steps queued ahead (two in flight),
    # the copies and the launch the GPU waits for between steps.
    between = [min(r["start"] for r in b) - max(r["end"] for r in a)
               for a, b in zip(steps, steps[1:])]
    return {
        "batch": batch,
        "steps_recorded": len(steps),
        "step_us": statistics.median(spans) / 1e3,
        "gaps_us": statistics.median(gaps) / 1e3,
        # The GPU's own work a step, whatever the host kept it waiting: where the host bounds the
        # step (a step with prompts, launched kernel by kernel), a change to the kernels shows
        # here and is lost in the step's span.
        "busy_us": statistics.median(busy_times) / 1e3,
        "between_steps_us": statistics.median(between) / 1e3 if between else None,
        "kernels_per_step": len(steps[0]),
        "kernels": [{
            "kernel": short(name),
            "grid": grid,
            "count_per_step": len(t["span"]) / len(steps),
            "span_us": statistics.median(t["span"]) / 1e3,
            "exposed_us": statistics.median(t["exposed"]) / 1e3,
            "exposed_per_step_us": statistics.median(t["per_step"]) / 1e3,
        } for (name, grid), t in table],
    }


def summarise_calls(calls, steps):
    """The host's CUDA calls by name: calls and microseconds a step (over the recorded steps),
    largest first."""
    by_name = defaultdict(lambda: [0, 0])
    for r in calls:
        by_name[r["kernel"]][0] += 1
        by_name[r["kernel"]][1] += r["end"] - r["start"]
    return [{"call": name, "count_per_step": count / steps, "us_per_step": ns / steps / 1e3}
            for name, (count, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1])]


def median_step(steps):
    """The step whose span is the median one."""
    by_span = sorted(steps, key=lambda k: exposed_times(k)[2])
    return by_span[len(by_span) // 2]


def print_order(step, n):
    """The step's first n kernels as they started: start and end from the step's start, span,
    and exposed time (what a chain of dependent kernels pays at each link)."""
    kernels, exposed, _, _ = exposed_times(step)
    t0 = kernels[0]["start"]
    print(f"{'start us':>9} {'end us':>8} {'span us':>8} {'exposed':>8}  kernel [grid]")
    for r, e in list(zip(kernels, exposed))[:n]:
        print(f"{(r['start'] - t0) / 1e3:9.2f} {(r['end'] - t0) / 1e3:8.2f} "
              f"{(r['end'] - r['start']) / 1e3:8.2f} {e / 1e3:8.2f}  "
              f"{short(r['kernel'])[:80]} [{r['grid']}]")


def print_table(s):
    between = s["between_steps_us"]
    print(f"batch {s['batch']}: {s['steps_recorded']} steps, step {s['step_us']:.1f} us "
          f"(median span), gaps {s['gaps_us']:.1f} us, busy {s['busy_us']:.1f} us, "
          f"{s['kernels_per_step']} kernels a step"
          + (f", {between:.1f} us between steps" if between is not None else ""))
    print(f"{'exposed/step us':>16} {'share':>6} {'count':>6} {'span us':>8} "
          f"{'exposed us':>10}  kernel [grid]")
    for k in s["kernels"]:
        per_step = k["exposed_per_step_us"]
        print(f"{per_step:16.1f} {per_step / s['step_us']:6.1%} {k['count_per_step']:6.1f} "
              f"{k['span_us']:8.2f} {k['exposed_us']:10.2f}  {k['kernel'][:90]} [{k['grid']}]")
    calls = s["host_calls"]
    if calls:
        print(f"host: {sum(c['us_per_step'] for c in calls):.1f} us a step in "
              f"{sum(c['count_per_step'] for c in calls):.0f} CUDA calls")
        print(f"{'us/step':>16} {'count':>13}  call")
        for c in calls[:12]:
            print(f"{c['us_per_step']:16.1f} {c['count_per_step']:13.1f}  {c['call']}")

if __name__ == "__main__":
    # Piped into `head`, it stops quietly once the reader has gone.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
