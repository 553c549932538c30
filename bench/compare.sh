#!/usr/bin/env bash
# Compares ttt-bench across variants of the tree on one machine, in one run: the tree as it is
# ("base") and the tree with each patch applied (on its own, not stacked), each configuration run
# by every variant in turn, ROUNDS times (default 2). Machines differ by about 1%, so only
# variants timed in the same run compare to that. Each "--" starts a configuration: ttt-bench's
# arguments for one run of it (a run may time several: --batch 1,16).
#
#   bench/compare.sh OUT.json [PATCH...] -- TTT_BENCH_ARGS... [-- TTT_BENCH_ARGS...]...
#   bench/compare.sh bench/results/x.json a.patch b.patch -- --backend cuda --preset 1b --batch 1
#   bench/compare.sh x.json a.patch -- --preset 1b --batch 256 -- --preset 125m --batch 256
#
# Builds into build-compare/ (CMAKE_ARGS are added to its configuration), and writes OUT.json
# (bench/record.py): the commit (COMMIT overrides it), the machine, the command, the variants, and
# a run per variant and round with ttt-bench's results for every configuration. Prints step p50 /
# p99 a line each as the rounds run, then each variant's medians against the tree's
# (bench/summarize.py), by configuration.
# TARGETS (ninja targets, default bench/ttt-bench) are built for every variant; with KEEP=DIR each
# variant's binaries stay in DIR/VARIANT/ (so that its tests can run after), else they are removed.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  sed -n 's/^#   bench\/compare.sh OUT/usage: bench\/compare.sh OUT/p' "$0" | head -1 >&2
  exit 2
fi
out=$1
shift
patches=()
while [[ $# -gt 0 && $1 != -- ]]; do
  patches+=("$(realpath "$1")")
  shift
done
# Each configuration's arguments, kept whole as one string (joined by the unit separator, which
# no argument holds); none given: one of ttt-bench's defaults.
configurations=()
while [[ $# -gt 0 ]]; do
  shift  # The "--".
  arguments=()
  while [[ $# -gt 0 && $1 != -- ]]; do
    arguments+=("$1")
    shift
  done
  configurations+=("$(IFS=$'\x1f' && printf '%s' "${arguments[*]}")")
done
[[ ${#configurations[@]} -gt 0 ]] || configurations=("")
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build-compare
read -ra targets <<< "${TARGETS:-bench/ttt-bench}"
[[ " ${targets[*]} " == *" bench/ttt-bench "* ]] || targets+=(bench/ttt-bench)
if [[ -n ${KEEP:-} ]]; then
  bins=$(realpath -m "$KEEP")
  mkdir -p "$bins"
else
  bins=$(mktemp -d)
  trap 'rm -rf "$bins"' EXIT
fi

# shellcheck disable=SC2086  # CMAKE_ARGS is a list of arguments.
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} > /dev/null
build_as() {
  ninja -C "$build" "${targets[@]}" > "$bins/$1.build.log" 2>&1 ||
    { tail -30 "$bins/$1.build.log" >&2; return 1; }
  mkdir -p "$bins/$1"
  for target in "${targets[@]}"; do cp "$build/$target" "$bins/$1/"; done
}
# The files the patches touch are rebuilt for the base too: ninja goes by modification times, and
# a checkout copied over a kept build directory can carry them older than a variant's objects
# (the base would then be built with a patch's code).
for patch in "${patches[@]}"; do
  git -C "$root" apply --numstat "$patch" | cut -f3 | while read -r file; do
    touch -c "$root/$file"  # -c: a file the patch adds is not there yet.
  done
done
variants=(base)
build_as base
for patch in "${patches[@]}"; do
  name=$(basename "$patch" .patch)
  git -C "$root" apply "$patch"
  # The tree goes back to its own state even if the build fails.
  if ! build_as "$name"; then
    git -C "$root" apply -R "$patch"
    exit 1
  fi
  git -C "$root" apply -R "$patch"
  variants+=("$name")
done

runs=$bins/runs.jsonl
: > "$runs"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for variant in "${variants[@]}"; do
    for configuration in "${configurations[@]}"; do
      IFS=$'\x1f' read -ra arguments <<< "$configuration"
      "$bins/$variant/ttt-bench" "${arguments[@]}" || exit 1
    done | grep '^{' |
      VARIANT=$variant ROUND=$round python3 -c '
import json, os, sys
variant, run = os.environ["VARIANT"], int(os.environ["ROUND"])
results = [json.loads(line) for line in sys.stdin]
print(json.dumps({"variant": variant, "round": run, "results": results}))
for r in results:
    model, batch, p50, p99 = r["model"], r["batch"], r["step_ms_p50"], r["step_ms_p99"]
    how = ", staggered" if r.get("staggered") else ""
    print(f"{variant:>24} round {run}: {model} batch {batch}{how}: step p50 {p50:.4f} ms, "
          f"p99 {p99:.4f}", file=sys.stderr)' >> "$runs"
  done
done

command=""
for configuration in "${configurations[@]}"; do
  IFS=$'\x1f' read -ra arguments <<< "$configuration"
  command+="${command:+; }ttt-bench ${arguments[*]}"
done
COMMIT=${COMMIT:-$(git -C "$root" rev-parse HEAD 2>/dev/null || true)} \
  python3 "$root/bench/record.py" "$out" "$command" --runs "$runs" --variants "${variants[@]}"
echo "compare: wrote $out" >&2
python3 "$root/bench/summarize.py" "$out" >&2
