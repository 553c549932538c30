# Sourced by the served benchmarks. start_server LOG COMMAND... runs COMMAND (a ttt-server with
# --port 0, perhaps behind taskset) in the background, its stderr to LOG, and waits up to 60 s for
# the port it prints: sets `server` (its pid) and `port`. If it exits first, or never prints one,
# prints LOG and exits.
start_server() {
  local log=$1
  shift
  "$@" 2> "$log" &
  server=$!
  port=""
  for _ in $(seq 600); do
    port=$(sed -n 's/.*serving model .* on port \([0-9]*\) .*/\1/p' "$log")
    [ -n "$port" ] && return
    kill -0 "$server" 2> /dev/null || break
    sleep 0.1
  done
  cat "$log"
  exit 1
}
