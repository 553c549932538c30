#!/usr/bin/env bash
# The served path against the engine alone: ttt-server on a random-weight preset, ttt-loadgen
# with N concurrent streams of T generated tokens over loopback, then ttt-bench's decode at batch
# N on the same model. Prints both JSON summaries.
#   bench/served.sh BUILD_DIR PRESET [STREAMS] [TOKENS] [REQUESTS]
set -euo pipefail
build="$1"; preset="$2"; streams="${3:-256}"; tokens="${4:-256}"; requests="${5:-$((2 * streams))}"
work=$(mktemp -d)
trap 'kill $server 2>/dev/null || true; rm -rf "$work"' EXIT
"$build/server/ttt-random-model" --preset "$preset" --out "$work/model"
"$build/server/ttt-server" --model "$work/model" --host 127.0.0.1 --port 0 --metrics-port -1 \
  --max-sequences $((streams + 16)) --max-waiting $((4 * streams)) 2> "$work/server.log" &
server=$!
port=""
for _ in $(seq 600); do
  port=$(sed -n 's/.*serving model .* on port \([0-9]*\) .*/\1/p' "$work/server.log")
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { cat "$work/server.log"; exit 1; }
# Warm up: CUDA graphs for the batch buckets are captured on first use.
"$build/client/ttt-loadgen" --server "127.0.0.1:$port" --concurrency "$streams" \
  --requests "$streams" --prompt-tokens fixed:16 --output-tokens fixed:32 --progress=false \
  > /dev/null
"$build/client/ttt-loadgen" --server "127.0.0.1:$port" --concurrency "$streams" \
  --requests "$requests" --prompt-tokens fixed:16 --output-tokens "fixed:$tokens" \
  --progress=false --json-out "$work/served.json" > /dev/null
echo "served: $(cat "$work/served.json" | tr -d '\n ')"
kill -TERM $server; wait $server || true
echo "engine: $("$build/bench/ttt-bench" --backend cuda --model "$work/model" --batch "$streams" \
  --offset 16 --steps 128)"
