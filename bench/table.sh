#!/usr/bin/env bash
# Runs the decode table's configurations (bench/decode-table.args, or the file named) on the tree
# as it is, each a bench/compare.sh run of its own (no patch, one round), and writes them as one
# record, whose rows `bench/summarize.py --table OUT.json` prints as bench/README.md's table has
# them. Each configuration's record is kept in OUT.d/ as soon as it ends, so a run cut short
# keeps the configurations it finished (run again on the same tree with the same OUT to go on).
#
#   bench/table.sh OUT.json [ARGS_FILE]
#   bench/table.sh bench/results/cuda-decode-v80-tree-h200.json
#
# CMAKE_ARGS, COMMIT, KEEP and TARGETS pass to compare.sh.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  grep -m1 '^#   bench/table.sh' "$0" | sed 's/^#   /usage: /' >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "$1")
configurations=${2:-$root/bench/decode-table.args}
parts=$out.d
mkdir -p "$parts"
n=0
while read -r line; do
  [[ -z $line || $line == \#* ]] && continue
  n=$((n + 1))
  part=$parts/$(printf %02d "$n").json
  [[ -s $part ]] && continue  # Finished by an earlier run.
  echo "table: configuration $n: ttt-bench $line" >&2
  # shellcheck disable=SC2086  # A line is a list of arguments.
  ROUNDS=1 "$root/bench/compare.sh" "$part" -- $line < /dev/null
done < "$configurations"

# One record: the first part's commit and machine, each configuration's command and runs.
python3 - "$out" "$parts" <<'PY'
import glob, json, os, sys
out, parts = sys.argv[1], sys.argv[2]
records = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(parts, "*.json")))]
first = records[0]
record = {key: first.get(key) for key in ("commit", "date", "gpu", "cpu", "cpu_cores")}
record["command"] = ("ttt-bench with each configuration below in turn, one run each, one "
                     "machine (bench/table.sh)")
record["configs"] = [{"command": r["command"], "runs": r["runs"]} for r in records]
with open(out, "w") as f:
    json.dump(record, f, indent=1)
print(f"table: wrote {out} ({len(records)} configurations)", file=sys.stderr)
PY
python3 "$root/bench/summarize.py" --table "$out"
