#!/usr/bin/env bash
# Runs every test of a GoogleTest binary under compute-sanitizer, one process a test, a few at a
# time, and prints a line a test: what the test and the tool said. One process a test keeps a
# slow test from hiding the others behind a timeout, and a failure from poisoning the CUDA
# context of the tests after it.
#
#   tools/sanitize.sh memcheck|racecheck|synccheck|initcheck BINARY [GTEST_FILTER]
#
# JOBS tests run at once, job slot i on GPU i mod GPUS (default: the GPUs nvidia-smi lists). JOBS
# defaults to GPUS, a test a GPU: on one GPU the tools slow each other, and racecheck processes
# sharing an H200 have ended mid-test without a report (each was clean alone). Each test runs for at
# most TIMEOUT seconds (default 900). Logs go to LOGS (default sanitize-logs/TOOL), a file a
# test. COMPUTE_SANITIZER names the tool's executable (default: compute-sanitizer on PATH, else
# /usr/local/cuda/bin/compute-sanitizer). The tests run in their short form (TTT_SHORT_TESTS=1,
# unless set otherwise): the tools slow every kernel launch by orders of magnitude, and the long
# decode tests' first 40 steps already reach every kernel path.
# Exits 1 if any test failed, timed out or was reported.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  grep -m1 '^#   tools/sanitize.sh' "$0" | sed 's/^#   /usage: /' >&2
  exit 2
fi
tool=$1 binary=$2 filter=${3:-*}
export TOOL=$tool BINARY=$binary TIMEOUT=${TIMEOUT:-900} LOGS=${LOGS:-sanitize-logs/$tool}
default_sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
export SANITIZER=${COMPUTE_SANITIZER:-$default_sanitizer}
gpus=${GPUS:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)}
export GPUS=$gpus TTT_SHORT_TESTS=${TTT_SHORT_TESTS:-1}
jobs=${JOBS:-$((gpus > 0 ? gpus : 1))}
mkdir -p "$LOGS"

# Full test names (Suite.Test, Prefix/Suite.Test/N), from the binary's own listing.
tests=$("$binary" --gtest_list_tests --gtest_filter="$filter" |
  awk '/^[^ ]/ { suite = $1 } /^  / { print suite $1 }')
if [[ -z $tests ]]; then
  echo "sanitize: no test of $binary matches '$filter'" >&2
  exit 2
fi

# One test, on the GPU of its job slot: its log, then a line "RESULT name: what the tool said".
run_one() {
  local name=$1 log
  log="$LOGS/$(echo "$1" | tr '/' '_').log"
  if [[ $GPUS -gt 0 ]]; then export CUDA_VISIBLE_DEVICES=$((SLOT % GPUS)); fi
  local status=0 start=$SECONDS
  timeout "$TIMEOUT" "$SANITIZER" --tool "$TOOL" --error-exitcode 99 "$BINARY" \
    --gtest_filter="$name" > "$log" 2>&1 || status=$?
  local summary
  summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1 | sed 's/^=* *//')
  local result=ok
  if [[ $status -eq 124 ]]; then
    result=timeout
  elif grep -q '^\[  FAILED  \]' "$log"; then
    result=failed
  elif grep -q 'terminated before first instrumented API call' "$log" &&
    grep -q '^\[  PASSED  \] 1 test' "$log"; then
    summary="no CUDA call to check"  # A test of host code alone; the tool exits non-zero.
  elif [[ $status -ne 0 ]]; then
    result=reported
  fi
  echo "$result $name: ${summary:-no summary} ($((SECONDS - start)) s; log: $log)"
}
export -f run_one

echo "sanitize: $tool on $(echo "$tests" | wc -l) tests, $jobs at a time, GPUs: ${gpus}" >&2
# Each test's line as it ends, so that a run cut short still says what it found.
results=$(mktemp)
echo "$tests" |
  xargs -P "$jobs" --process-slot-var=SLOT -I{} bash -c 'run_one "$1"' _ {} | tee "$results"
total=$(wc -l < "$results")
clean=$(grep -c '^ok ' "$results" || true)
rm -f "$results"
echo "sanitize: $tool on $(basename "$binary"): $clean of $total tests clean"
[[ $clean -eq $total ]]
