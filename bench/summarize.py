#!/usr/bin/env python3
"""Prints what a bench/compare.sh record says: for each configuration, each variant's medians.

    summarize.py RECORD.json

A line per (configuration, variant): the medians over the rounds of step p50 and p99 (ms) and of
tokens/s (the median step's and the mean step's), and step p50's change against the first variant,
the tree the others were applied to, with the host's time to queue a step; and the prefill's
tokens/s where ttt-bench timed one. Medians, because a round now and then lands on a slower moment
of the machine. Where ttt-bench reported the digest of the chosen tokens, the line also says whether
the variant chose the tree's tokens: a change meant to be exact should.

With --table, the rows of bench/README.md's decode table instead, from the first variant's
medians: model, batch, offset, tokens/s (median step, then mean step), step p50 / p99, and the
fraction of the memory floor.
"""
import argparse
import json
import signal
import statistics


def how_stepped(result):
    """The ttt-bench flags that change what a step is, as they read after the offset."""
    how = ""
    if result.get("staggered"):
        how += ", staggered"
    if result.get("joining"):
        how += f", {result['joining']} joining"
    if result.get("steps_in_flight", 1) > 1:
        how += f", {result['steps_in_flight']} in flight"
    if result.get("temperature"):
        how += f", temperature {result['temperature']:g}"
        if result.get("top_k"):
            how += f", top-k {result['top_k']}"
        if result.get("top_p", 1) < 1:
            how += f", top-p {result['top_p']:g}"
        if result.get("min_p"):
            how += f", min-p {result['min_p']:g}"
    return how


def model_name(result):
    """125m-linear-mamba -> 125m TTT-Linear."""
    preset, inner = result["model"].split("-")[:2]
    return f"{preset} TTT-{inner.capitalize() if inner != 'mlp' else 'MLP'}"


def median(results, field):
    return statistics.median(r[field] for r in results)


def rate(tokens_per_s):
    """As the table writes it: 3,632, then 12.1k."""
    return f"{tokens_per_s / 1000:.1f}k" if tokens_per_s >= 10000 else f"{tokens_per_s:,.0f}"


def print_table(configurations, variant):
    for (_, batch, offset, how, _), by_variant in configurations.items():
        results = by_variant.get(variant)
        if not results:
            continue
        tokens = median(results, "tokens_per_s")
        a_token = f" ({median(results, 'step_ms_p50'):.3f} ms a token)" if batch == 1 else ""
        # The CPU engine's results have no memory floor.
        floor = (f"{median(results, 'fraction_of_memory_floor') * 100:.1f}%"
                 if "fraction_of_memory_floor" in results[0] else "–")
        print(f"| {model_name(results[0])} | {batch} | {offset:,}{how} | {rate(tokens)}{a_token} "
              f"| {rate(median(results, 'tokens_per_s_mean'))} "
              f"| {median(results, 'step_ms_p50'):.2f} / {median(results, 'step_ms_p99'):.2f} "
              f"| {floor} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record")
    parser.add_argument("--table", action="store_true",
                        help="print the first variant's rows as bench/README.md's table has them")
    args = parser.parse_args()
    with open(args.record) as f:
        record = json.load(f)
    runs = list(record.get("runs", []))
    # Records put together by hand from several runs (v46-v48) hold each configuration's runs in
    # "configs".
    for config in record.get("configs", []):
        if isinstance(config, dict):
            runs += config.get("runs", [])
    if not runs or not all("variant" in run and "results" in run for run in runs):
        parser.error(f"{args.record} is not a bench/compare.sh record (no runs of variants)")
    # In the order they ran (older records do not list them).
    variants = record.get("variants") or list(dict.fromkeys(run["variant"] for run in runs))

    # (model, batch, offset, how, repeat) -> variant -> that configuration's results, a round
    # each. A configuration listed twice in one command (--batch 16,16) is two: repeat counts them.
    configurations = {}
    for run in runs:
        seen = {}
        for result in run["results"]:
            shape = (result["model"], result["batch"], result["offset"], how_stepped(result))
            seen[shape] = seen.get(shape, -1) + 1
            key = (*shape, seen[shape])
            configurations.setdefault(key, {}).setdefault(run["variant"], []).append(result)

    if args.table:
        print_table(configurations, variants[0])
        return
    print(record.get("command", ""))
    for (model, batch, offset, how, repeat), by_variant in configurations.items():
        again = f" (repeat {repeat})" if repeat else ""
        print(f"{model} batch {batch} offset {offset}{how}{again}:")
        base = base_digests = None
        for variant in variants:
            results = by_variant.get(variant)
            if not results:
                continue
            p50 = median(results, "step_ms_p50")
            change = "" if base is None else f" ({(p50 / base - 1) * 100:+.1f}%)"
            base = p50 if base is None else base
            digests = {r["tokens_digest"] for r in results if "tokens_digest" in r}
            tokens = ""
            if len(digests) > 1:
                tokens = ", tokens differ between rounds"
            elif digests and base_digests:
                tokens = ", the tree's tokens" if digests == base_digests else ", other tokens"
            base_digests = digests if base_digests is None else base_digests
            prefills = [r for r in results if "prefill_tokens_per_s" in r]
            prefill = (f", prefill {rate(median(prefills, 'prefill_tokens_per_s'))} tokens/s"
                       if prefills else "")
            # The host's time to queue a step: where it nears the step's, the host bounds the step
            # (bench/README.md v73), and a change to the kernels may not show in its p50.
            queued = (f", queued {median(results, 'launch_ms_p50'):.4f}"
                      if all("launch_ms_p50" in r for r in results) else "")
            print(f"  {variant:>24}: step p50 {p50:.4f} ms{change}{queued}, "
                  f"p99 {median(results, 'step_ms_p99'):.4f}, "
                  f"{rate(median(results, 'tokens_per_s'))} tokens/s "
                  f"(sustained {rate(median(results, 'tokens_per_s_mean'))}), "
                  f"{len(results)} round{'s' if len(results) != 1 else ''}{prefill}{tokens}")


if __name__ == "__main__":
    # Piped into `head`, it stops quietly once the reader has gone.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
