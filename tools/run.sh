#!/usr/bin/env bash
# Installs the dependencies, builds, starts ttt-server on the bundled model and shows a streamed
# generation through ttt-client; the server then keeps serving until Ctrl-C (a graceful drain).
#   tools/run.sh [MODEL_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh
model="${1:-models/ttt-linear-3m-en}"
port="${TTT_PORT:-50051}"
metrics_port="${TTT_METRICS_PORT:-9090}"
build/server/ttt-server --model "$model" --port "$port" --metrics-port "$metrics_port" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server' INT TERM
client="build/client/ttt-client --server localhost:$port"
for _ in $(seq 100); do
  $client --timeout 1 health >/dev/null 2>&1 && break
  sleep 0.2
done
echo "+ ttt-client generate --prompt 'And it came to pass' --max-new-tokens 200 --temperature 0.7 --top-p 0.9"
$client generate --prompt "And it came to pass" --max-new-tokens 200 --temperature 0.7 --top-p 0.9
echo "ttt-server is serving $model on port $port (metrics: http://localhost:$metrics_port/metrics); Ctrl-C stops it."
wait $server
