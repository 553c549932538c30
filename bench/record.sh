#!/usr/bin/env bash
# Runs a benchmark command and records its JSON lines with the commit, machine and command:
#   bench/record.sh bench/results/NAME.json build/bench/ttt-bench --model DIR --batch 1,16
# COMMIT=... overrides the commit recorded (for a copy of the tree without git history).
set -euo pipefail
out="$1"
shift
lines=$("$@")
echo "$lines"
echo "$lines" | python3 "$(dirname "$0")/record.py" "$out" "$*"
