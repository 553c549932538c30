#!/usr/bin/env bash
# The serving path's own cost on the host: ttt-server on the smallest golden model (its CPU engine
# takes microseconds a step), so the tokens/s measure the gRPC path, the scheduler and the
# streams' hand-offs rather than the engine. ttt-loadgen runs STREAMS closed-loop streams of 16
# prompt tokens and 256 generated ones for 10 s over CONNECTIONS connections. Prints one JSON
# line: the load generator's summary, the server's threads mid-run and its CPU seconds.
#   bench/served_api.sh BUILD_DIR [STREAMS] [SLOTS] [CONNECTIONS]
# SERVER (a ttt-server binary) overrides BUILD_DIR's, to compare two builds.
set -euo pipefail
build="$1"; streams="${2:-256}"; slots="${3:-$streams}"; connections="${4:-1}"
server_binary="${SERVER:-$build/server/ttt-server}"
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/bench/start_server.sh"
work=$(mktemp -d)
trap 'kill ${server:-} 2>/dev/null || true; rm -rf "$work"' EXIT
start_server "$work/server.log" "$server_binary" --model "$root/tests/data/golden/tiny-linear-m" \
  --backend cpu --host 127.0.0.1 --port 0 --metrics-port -1 --max-sequences "$slots" \
  --max-waiting "$streams"
server_cpu() { awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$server/stat"; }
cpu_before=$(server_cpu)
"$build/client/ttt-loadgen" --server "127.0.0.1:$port" --concurrency "$streams" \
  --connections "$connections" --duration 10 --prompt-tokens fixed:16 \
  --output-tokens fixed:256 --progress=false --json-out "$work/loadgen.json" > /dev/null &
loadgen=$!
sleep 5
threads=$(ls "/proc/$server/task" | wc -l)
wait $loadgen
cpu_after=$(server_cpu)
python3 - "$work/loadgen.json" "$threads" "$cpu_before" "$cpu_after" "$streams" "$slots" \
  "$connections" <<'PY'
import json, sys
summary = json.load(open(sys.argv[1]))
print(json.dumps({"streams": int(sys.argv[5]), "slots": int(sys.argv[6]),
                  "connections": int(sys.argv[7]), "server_threads_mid_run": int(sys.argv[2]),
                  "server_cpu_seconds": round(float(sys.argv[4]) - float(sys.argv[3]), 2),
                  "loadgen": summary}))
PY
