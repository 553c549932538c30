#!/usr/bin/env python3
"""Writes a benchmark record: results with the commit, date, machine and command they came from.

    record.py OUT.json COMMAND < LINES
        one run: the JSON objects among LINES (a benchmark's output) as "results";
    record.py OUT.json COMMAND --runs RUNS.jsonl --variants NAME...
        variants timed in one run (bench/compare.sh): RUNS.jsonl's objects as "runs".

The commit is COMMIT's if set (for a copy of the tree without git history), else git's HEAD.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys


def output_of(*command):
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("command")
    parser.add_argument("--runs", help="a JSON object a line, one a variant and round")
    parser.add_argument("--variants", nargs="*", default=[])
    args = parser.parse_args()
    gpus = output_of("nvidia-smi", "--query-gpu=name", "--format=csv,noheader").splitlines()
    record = {
        "commit": os.environ.get("COMMIT") or output_of("git", "rev-parse", "HEAD") or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpus[0] if gpus else None,
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "command": args.command,
    }
    if args.runs:
        record["variants"] = args.variants
        with open(args.runs) as f:
            record["runs"] = [json.loads(line) for line in f]
    else:
        record["results"] = [json.loads(line) for line in sys.stdin if line.startswith("{")]
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
