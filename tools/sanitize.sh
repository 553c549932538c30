#!/usr/bin/env bash
# Runs every test of a GoogleTest binary under compute-sanitizer, one process a test, a few at a
# time, and prints a line a test: what the test and the tool said. One process a test keeps a
# slow test from hiding the others behind a timeout, and a failure from poisoning the CUDA
# context of the tests after it.
#
#   tools/sanitize.sh memcheck|racecheck|synccheck|initcheck BINARY [GTEST_FILTER]
#
# JOBS tests run at once (default 2: the tools slow each other on one GPU), each for at most
# TIMEOUT seconds (default 900). Logs go to LOGS (default sanitize-logs/TOOL), a file a test.
# COMPUTE_SANITIZER names the tool's executable (default: compute-sanitizer on PATH, else
# /usr/local/cuda/bin/compute-sanitizer). Exits 1 if any test failed, timed out or was reported.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  grep -m1 '^#   tools/sanitize.sh' "$0" | sed 's/^#   /usage: /' >&2
  exit 2
fi
tool=$1 binary=$2 filter=${3:-*}
export TOOL=$tool BINARY=$binary TIMEOUT=${TIMEOUT:-900} LOGS=${LOGS:-sanitize-logs/$tool}
sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
export SANITIZER=$sanitizer
mkdir -p "$LOGS"

# Full test names (Suite.Test, Prefix/Suite.Test/N), from the binary's own listing.
tests=$("$binary" --gtest_list_tests --gtest_filter="$filter" |
  awk '/^[^ ]/ { suite = $1 } /^  / { print suite $1 }')
if [[ -z $tests ]]; then
  echo "sanitize: no test of $binary matches '$filter'" >&2
  exit 2
fi

# One test: its log, then a line "RESULT name: what the tool said".
run_one() {
  local name=$1 log
  log="$LOGS/$(echo "$1" | tr '/' '_').log"
  local status=0
  timeout "$TIMEOUT" "$SANITIZER" --tool "$TOOL" --error-exitcode 99 "$BINARY" \
    --gtest_filter="$name" > "$log" 2>&1 || status=$?
  local summary
  summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1 | sed 's/^=* *//')
  local result=ok
  if [[ $status -eq 124 ]]; then
    result=timeout
  elif grep -q '^\[  FAILED  \]' "$log"; then
    result=failed
  elif [[ $status -ne 0 ]]; then
    result=reported
  fi
  echo "$result $name: ${summary:-no summary} (log: $log)"
}
export -f run_one

lines=$(echo "$tests" | xargs -P "${JOBS:-2}" -I{} bash -c 'run_one "$1"' _ {} | sort -k2)
echo "$lines"
total=$(echo "$lines" | wc -l)
clean=$(echo "$lines" | grep -c '^ok ' || true)
echo "sanitize: $tool on $(basename "$binary"): $clean of $total tests clean"
[[ $clean -eq $total ]]
