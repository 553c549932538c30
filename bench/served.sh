#!/usr/bin/env bash
# The served path against the engine alone: ttt-server on a random-weight preset, ttt-loadgen
# with N concurrent streams of T generated tokens over loopback, then ttt-bench's decode at batch
# N on the same model, greedy and sampling at temperature 1 as the load generator's requests do.
# Prints the JSON summaries, and where the served time went: the server's engine steps (from its
# /metrics) and how busy the machine's cores were during the run.
#   bench/served.sh BUILD_DIR PRESET [STREAMS] [TOKENS] [REQUESTS] [METRICS_PORT] [CONNECTIONS]
set -euo pipefail
build="$1"; preset="$2"; streams="${3:-256}"; tokens="${4:-256}"; requests="${5:-$((2 * streams))}"
metrics_port="${6:-9464}"; connections="${7:-1}"
work=$(mktemp -d)
trap 'kill $server 2>/dev/null || true; rm -rf "$work"' EXIT
"$build/server/ttt-random-model" --preset "$preset" --out "$work/model"
"$build/server/ttt-server" --model "$work/model" --host 127.0.0.1 --port 0 \
  --metrics-port "$metrics_port" --max-sequences $((streams + 16)) \
  --max-waiting $((4 * streams)) 2> "$work/server.log" &
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

# Engine steps inside the server, from ttt_step_duration_seconds: "count sum" for decode steps,
# then for steps with prompt tokens.
steps() {
  exec 3<> "/dev/tcp/127.0.0.1/$metrics_port"
  printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3
  tr -d '\r' <&3 |
    awk '/^ttt_step_duration_seconds_(count|sum)\{phase="(decode|prefill)"\}/ {
           split($1, n, "{"); t[n[1] substr($1, index($1, "=") + 2, 1)] = $2 }
         END { printf "%d %.6f %d %.6f\n", t["ttt_step_duration_seconds_countd"],
                 t["ttt_step_duration_seconds_sumd"], t["ttt_step_duration_seconds_countp"],
                 t["ttt_step_duration_seconds_sump"] }'
  exec 3<&-
}
cpu() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8 }' /proc/stat; }
read -r decode_before decode_s_before prefill_before prefill_s_before < <(steps)
read -r busy_before total_before < <(cpu)
"$build/client/ttt-loadgen" --server "127.0.0.1:$port" --concurrency "$streams" \
  --connections "$connections" --requests "$requests" --prompt-tokens fixed:16 --output-tokens "fixed:$tokens" \
  --progress=false --json-out "$work/served.json" > /dev/null
read -r busy_after total_after < <(cpu)
read -r decode_after decode_s_after prefill_after prefill_s_after < <(steps)
served=$(tr -d '\n ' < "$work/served.json")
echo "served: $served"
awk -v d=$((decode_after - decode_before)) -v ds="$decode_s_after" -v ds0="$decode_s_before" \
  -v p=$((prefill_after - prefill_before)) -v ps="$prefill_s_after" -v ps0="$prefill_s_before" \
  -v b=$((busy_after - busy_before)) -v t=$((total_after - total_before)) \
  -v wall="$(echo "$served" | sed -n 's/.*"duration_s":\([0-9.e+-]*\).*/\1/p')" \
  'BEGIN { printf "server: %d decode steps of %.3f ms, %d with prompt tokens of %.3f ms (queued to collected); %.3f ms of wall time per step; cores busy %.0f%%\n",
           d, 1e3 * (ds - ds0) / d, p, p ? 1e3 * (ps - ps0) / p : 0, 1e3 * wall / (d + p), 100 * b / t }'
kill -TERM $server; wait $server || true
for temperature in 0 1; do
  echo "engine (temperature $temperature): $("$build/bench/ttt-bench" --backend cuda \
    --model "$work/model" --batch "$streams" --offset 16 --steps 128 --temperature $temperature)"
done
