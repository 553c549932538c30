#!/usr/bin/env bash
# Installs the dependencies, builds, starts ttt-server on the bundled model and shows a streamed
# generation through ttt-client; the server then keeps serving until Ctrl-C (a graceful drain).
#   tools/run.sh [MODEL_DIR]
# The bundled model is for now a small test model with random weights and no tokenizer: it takes
# and returns token ids, and what it writes is noise.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh
model="${1:-tests/data/golden/small-linear-m64}"
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
echo "+ ttt-client generate --prompt-ids 1,72,101,108,108,111 --max-new-tokens 32 --print-ids"
$client generate --prompt-ids 1,72,101,108,108,111 --max-new-tokens 32 --print-ids --ignore-eos
echo "ttt-server is serving $model on port $port (metrics: http://localhost:$metrics_port/metrics); Ctrl-C stops it."
wait $server
