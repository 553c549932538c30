#!/usr/bin/env bash
# The served path against the engine alone: ttt-server on a random-weight preset, ttt-loadgen
# with N concurrent streams of T generated tokens over loopback, then ttt-bench's decode at batch
# N on the same model, greedy and sampling at temperature 1 as the load generator's requests do.
# Prints the JSON summaries, and where the served time went: each request's time to the first
# token and in all, inside the server and outside it (ttt-loadgen's split), the server's engine
# steps (from its /metrics), how busy the machine's cores were during the run, and how the kernel
# scheduled the server's scheduler thread.
#   bench/served.sh BUILD_DIR PRESET [STREAMS] [TOKENS] [REQUESTS] [METRICS_PORT] [CONNECTIONS]
# TOKENS is a count, or a distribution as ttt-loadgen takes it (uniform:MIN:MAX); PROMPT_TOKENS, in
# the environment, the prompts' (fixed:16 unless set).
# REQUESTS defaults to 8 × STREAMS: with every request as long as the others, they come in waves,
# and two waves' figure moved ±6% between runs of one engine where eight came within 3%
# (bench/README.md, served v7).
# SERVER_CPUS / LOADGEN_CPUS (taskset lists, e.g. 0-7 and 8-15) keep the two on cores of their
# own, as when the clients run on other machines. SERVER (a ttt-server binary) overrides
# BUILD_DIR's, to compare two builds; SERVER_ARGS are added to its flags. SERVED_ONLY=1 leaves
# out the engine's runs.
set -euo pipefail
build="$1"; preset="$2"; streams="${3:-256}"; tokens="${4:-256}"; requests="${5:-$((8 * streams))}"
metrics_port="${6:-9464}"; connections="${7:-1}"
server_binary="${SERVER:-$build/server/ttt-server}"
server_cpus=(); [ -n "${SERVER_CPUS:-}" ] && server_cpus=(taskset -c "$SERVER_CPUS")
loadgen_cpus=(); [ -n "${LOADGEN_CPUS:-}" ] && loadgen_cpus=(taskset -c "$LOADGEN_CPUS")
output_tokens="$tokens"; [[ $tokens == *:* ]] || output_tokens="fixed:$tokens"
prompt_tokens="${PROMPT_TOKENS:-fixed:16}"
source "$(dirname "$0")/start_server.sh"
work=$(mktemp -d)
trap 'kill ${server:-} 2>/dev/null || true; rm -rf "$work"' EXIT
"$build/server/ttt-random-model" --preset "$preset" --out "$work/model"
# shellcheck disable=SC2086  # SERVER_ARGS is a list of flags.
start_server "$work/server.log" "${server_cpus[@]}" "$server_binary" --model "$work/model" \
  --host 127.0.0.1 --port 0 --metrics-port "$metrics_port" --max-sequences $((streams + 16)) \
  --max-waiting $((4 * streams)) ${SERVER_ARGS:-}
# Warm up: connections, threads, and whatever the engine did not prepare at start.
"$build/client/ttt-loadgen" --server "127.0.0.1:$port" --concurrency "$streams" \
  --requests "$streams" --prompt-tokens fixed:16 --output-tokens fixed:32 --progress=false \
  > /dev/null

# The server's /metrics, read over bash's /dev/tcp.
snapshot() {
  exec 3<> "/dev/tcp/127.0.0.1/$metrics_port"
  printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3
  tr -d '\r' <&3 > "$1"
  exec 3<&-
}
cpu() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8 }' /proc/stat; }
# CPU seconds: the server's (user + system, from its /proc entry), and the load generator's
# (bash's `times`: this shell's finished children, second line; run here, not in a subshell).
server_cpu() { awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$server/stat"; }
children_cpu() { awk 'NR == 2 { for (i = 1; i <= 2; ++i) { split($i, t, /[ms]/); s += 60 * t[1] + t[2] } print s }' "$1"; }
# The scheduler thread as the kernel saw it: nanoseconds on a core and runnable but waiting for
# one (schedstat), and its context switches, voluntary (it blocked) and not (it was preempted).
# Like the /metrics snapshots, these span the load generator's start and end as well as its run.
scheduler_task=""
for task in /proc/$server/task/*; do
  [ "$(cat "$task/comm")" = ttt-scheduler ] && scheduler_task=$task
done
scheduler_counts() {
  [ -r "$scheduler_task/schedstat" ] || { echo 0 0 0 0; return; }
  read -r on_core runnable _ < "$scheduler_task/schedstat"
  awk -v c="$on_core" -v r="$runnable" '/^voluntary_ctxt_switches/ { v = $2 }
    /^nonvoluntary_ctxt_switches/ { n = $2 } END { print c, r, v, n }' "$scheduler_task/status"
}
snapshot "$work/before.prom"
scheduler_before=$(scheduler_counts)
read -r busy_before total_before < <(cpu)
server_cpu_before=$(server_cpu); times > "$work/times.before"
"${loadgen_cpus[@]}" "$build/client/ttt-loadgen" --server "127.0.0.1:$port" \
  --concurrency "$streams" --connections "$connections" --requests "$requests" --prompt-tokens "$prompt_tokens" --output-tokens "$output_tokens" \
  --progress=false --json-out "$work/served.json" > /dev/null
read -r busy_after total_after < <(cpu)
scheduler_after=$(scheduler_counts)
server_cpu_after=$(server_cpu); times > "$work/times.after"
snapshot "$work/after.prom"
served=$(tr -d '\n ' < "$work/served.json")
echo "served: $served"
# Each request's times by the server's account and the client's (ttt-loadgen's split).
/usr/bin/python3 -c 'import json, sys
s = json.loads(sys.argv[1])
p = lambda key: "%.1f / %.1f" % (s[key]["p50"], s[key]["p90"])
print("requests, as the client saw them (ms, p50 / p90): first token %s, the server'"'"'s part %s; "
      "outside the server %s before the first token, %s in all; %.2f tokens a message"
      % (p("ttft_ms"), p("server_ttft_ms"), p("ttft_outside_server_ms"),
         p("total_outside_server_ms"), s["tokens_per_message"]))' "$served"
wall=$(echo "$served" | sed -n 's/.*"duration_s":\([0-9.e+-]*\).*/\1/p')  # Seconds.
awk -v s="$server_cpu_before $server_cpu_after" -v l="$(children_cpu "$work/times.before") $(children_cpu "$work/times.after")" \
  -v wall="$wall" \
  -v server_cores="${SERVER_CPUS:-all}" -v loadgen_cores="${LOADGEN_CPUS:-all}" 'BEGIN {
    split(s, a); split(l, b)
    printf "cores used: the server %.2f (on cores %s), ttt-loadgen %.2f (on cores %s)\n",
      (a[2] - a[1]) / wall, server_cores, (b[2] - b[1]) / wall, loadgen_cores }'
# Engine steps (ttt_step_duration_seconds and the GPU's ttt_step_device_seconds, by phase) and
# the scheduler thread's time by part of its loop (ttt_scheduler_seconds_total), as differences
# over the run.
awk -v b=$((busy_after - busy_before)) -v t=$((total_after - total_before)) \
  -v wall="$wall" -v sched="$scheduler_before $scheduler_after" '
  /^ttt_step_(duration|device)_seconds_(count|sum)\{|^ttt_scheduler_seconds_total\{/ ||
  /^ttt_(batch_size|time_to_first_token_seconds|request_queue_time_seconds)_(count|sum) / {
    v[$1] += (FILENAME == ARGV[1] ? -$2 : $2) }
  END {
    d = v["ttt_step_duration_seconds_count{phase=\"decode\"}"]
    p = v["ttt_step_duration_seconds_count{phase=\"prefill\"}"]
    printf "server: %d decode steps of %.3f ms (%.3f on the GPU), %d with prompt tokens of %.3f ms (%.3f on the GPU); %.3f ms of wall time per step; cores busy %.0f%%\n",
      d, 1e3 * v["ttt_step_duration_seconds_sum{phase=\"decode\"}"] / d,
      1e3 * v["ttt_step_device_seconds_sum{phase=\"decode\"}"] / d,
      p, p ? 1e3 * v["ttt_step_duration_seconds_sum{phase=\"prefill\"}"] / p : 0,
      p ? 1e3 * v["ttt_step_device_seconds_sum{phase=\"prefill\"}"] / p : 0,
      1e3 * wall / (d + p), 100 * b / t
    n = v["ttt_time_to_first_token_seconds_count"]
    printf "requests, as the server saw them: %.1f sequences a step; %.2f ms to the first token, %.2f of it waiting to join (means)\n",
      v["ttt_batch_size_sum"] / v["ttt_batch_size_count"],
      n ? 1e3 * v["ttt_time_to_first_token_seconds_sum"] / n : 0,
      n ? 1e3 * v["ttt_request_queue_time_seconds_sum"] / n : 0
    printf "scheduler thread, ms per step:"
    for (k in v) if (k ~ /^ttt_scheduler_seconds_total/) {
      split(k, q, "\""); printf " %s %.3f", q[2], 1e3 * v[k] / (d + p) }
    printf "\n"
    split(sched, c)
    printf "scheduler thread, per step: %.3f ms on a core, %.3f ms runnable waiting for one, %.2f voluntary and %.2f involuntary context switches\n",
      1e-6 * (c[5] - c[1]) / (d + p), 1e-6 * (c[6] - c[2]) / (d + p), (c[7] - c[3]) / (d + p),
      (c[8] - c[4]) / (d + p) }' "$work/before.prom" "$work/after.prom"
kill -TERM $server; wait $server || true
[ -z "${SERVED_ONLY:-}" ] || exit 0
# The engine alone at the same batch, with two steps in flight as the server drives it. Its
# tokens/s comes from the median step; every 16th step commits every sequence's window and takes
# about twice as long, so the sustained rate is the mean's (ttt-bench's 128 steps are whole
# windows). The served run commits a few windows in every step, as the engine's staggered
# offsets do (sequence b at 16 + b % 16): the ratios to the aligned median and mean are printed,
# and to the staggered median, the steps the server runs.
ratio() {  # LABEL ENGINE_JSON
  /usr/bin/python3 -c 'import json, sys
served, engine = json.loads(sys.argv[1]), json.loads(sys.argv[2])
rate, full = served["generated_tokens_per_s"], served["full_load"]["generated_tokens_per_s"]
print("served / %s: %.1f%% of its median step, %.1f%% of its mean; under full load %.1f%%, %.1f%%"
      % (sys.argv[3], 100 * rate / engine["tokens_per_s"], 100 * rate / engine["tokens_per_s_mean"],
         100 * full / engine["tokens_per_s"], 100 * full / engine["tokens_per_s_mean"]))' \
    "$served" "$2" "$1"
}
for temperature in 0 1; do
  engine=$("$build/bench/ttt-bench" --backend cuda --model "$work/model" --batch "$streams" \
    --offset 16 --steps 128 --steps_in_flight 2 --temperature $temperature)
  echo "engine (temperature $temperature): $engine"
  ratio "engine" "$engine"
done
# Staggered at temperature 1 too: the steps the server runs, sampling as its requests do.
for temperature in 0 1; do
  engine=$("$build/bench/ttt-bench" --backend cuda --model "$work/model" --batch "$streams" \
    --offset 16 --steps 128 --steps_in_flight 2 --temperature $temperature --staggered)
  echo "engine (temperature $temperature, staggered): $engine"
  ratio "staggered engine" "$engine"
done
