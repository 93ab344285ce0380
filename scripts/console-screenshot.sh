#!/usr/bin/env bash
# Makes docs/console.png, the README's picture of the web console: starts echo-server with its
# admin endpoint, keeps echo-client calling it (every 7th call answers a business error, each is
# held a few milliseconds, so the charts have rates, latencies and errors to draw), lets headless
# chromium load the console with the token in the fragment, and saves what it shows.
#
#   scripts/console-screenshot.sh [OUTPUT.png]     (default docs/console.png)
#
# Needs chromium (scripts/test.sh installs Debian's when it is missing). Every wait is bounded;
# the programs it starts are stopped on exit, however it exits.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/console.png}
token=console-screenshot

chromium=$(command -v chromium || true)
[[ -n $chromium ]] || { echo "needs chromium: apt-get install chromium (scripts/test.sh does)" >&2; exit 1; }

echo "== building echo-server and echo-client"
cargo build --quiet -p examples --bin echo-server --bin echo-client
bin=${CARGO_TARGET_DIR:-target}/debug

work=$(mktemp -d)
server_pid=""
client_pid=""
stop() {
  [[ -n $client_pid ]] && kill "$client_pid" 2>/dev/null || true
  if [[ -n $server_pid ]]; then
    # SIGTERM: the server drains and stops (bounded: killed after 10 s).
    kill -TERM "$server_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap stop EXIT

# Waits, at most 10 s, until FILE has a line starting with PREFIX, and prints the rest of it.
line_after() {
  local file=$1 prefix=$2 rest
  for _ in $(seq 100); do
    rest=$(sed -n "s/^$prefix //p" "$file" | head -n 1)
    if [[ -n $rest ]]; then echo "$rest"; return 0; fi
    sleep 0.1
  done
  echo "no '$prefix' line in 10 s; it printed:" >&2
  cat "$file" >&2
  return 1
}

echo "== starting echo-server with its admin endpoint"
"$bin/echo-server" --port 0 --fail-every 7 --delay-ms 3 \
  --admin 127.0.0.1:0 --admin-token "$token" >"$work/server.out" 2>&1 &
server_pid=$!
admin=$(line_after "$work/server.out" "admin on")
addr=$(line_after "$work/server.out" "listening on")
echo "server on $addr, admin on $admin"

echo "== calling it"
# At most 20000 calls or 60 s, whichever comes first; stopped once the picture is taken.
timeout 60 "$bin/echo-client" --endpoints "$addr" --calls 20000 --concurrency 4 --interval-ms 5 \
  >"$work/client.out" 2>&1 &
client_pid=$!
# The console's figures cover the last few seconds: wait (at most 10 s) until 500 calls are done.
for _ in $(seq 100); do
  (($(grep -c '^call ' "$work/client.out" || true) >= 500)) && break
  sleep 0.1
done
(($(grep -c '^call ' "$work/client.out" || true) >= 500)) || {
  echo "echo-client made fewer than 500 calls in 10 s; it printed:" >&2
  tail -n 20 "$work/client.out" >&2
  exit 1
}

echo "== screenshot of http://$admin/"
mkdir -p "$(dirname "$out")"
# --virtual-time-budget lets the page run 5 s of its own time (five polls, so the charts have
# lines) before the picture; --user-data-dir keeps this run apart from any other chromium.
timeout 60 "$chromium" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage \
  --user-data-dir="$work/profile" --hide-scrollbars --window-size=1400,1100 \
  --virtual-time-budget=5000 --screenshot="$out" "http://$admin/#token=$token" \
  >"$work/chromium.out" 2>&1 || { cat "$work/chromium.out" >&2; exit 1; }
[[ -s $out ]] || { echo "chromium wrote no $out" >&2; cat "$work/chromium.out" >&2; exit 1; }
echo "wrote $out"
