#!/usr/bin/env bash
# Runs a benchmark command and records its JSON lines with the commit, machine and command:
#   bench/record.sh bench/results/NAME.json build/bench/ttt-bench --model DIR --batch 1,16
# COMMIT=... overrides the commit recorded (for a copy of the tree without git history).
set -euo pipefail
out="$1"
shift
lines=$("$@")
echo "$lines"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
LINES="$lines" GPU="$gpu" COMMIT="${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" \
CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')" \
/usr/bin/python3 - "$out" "$*" <<'PY'
import json, os, sys, datetime
out, command = sys.argv[1], sys.argv[2]
record = {
    "commit": os.environ["COMMIT"],
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "gpu": os.environ["GPU"] or None,
    "cpu": os.environ["CPU"],
    "cpu_cores": os.cpu_count(),
    "command": command,
    "results": [json.loads(l) for l in os.environ["LINES"].splitlines() if l.startswith("{")],
}
with open(out, "w") as f:
    json.dump(record, f, indent=2)
    f.write("\n")
PY
