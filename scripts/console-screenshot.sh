#!/usr/bin/env bash
# Makes docs/console.png, the README's picture of the web console: starts a local etcd, two
# echo-servers registered in it (every 7th call answers a business error, each is held a few
# milliseconds, so the charts have rates, latencies and errors to draw), writes a governance rule
# with rpcctl, keeps echo-client calling them with its admin endpoint on, kills one server with
# SIGKILL (so endpoint health and the events have something to say), lets headless chromium load
# the client's console with the token in the fragment, and saves what it shows.
#
#   scripts/console-screenshot.sh [OUTPUT.png]     (default docs/console.png)
#
# Needs chromium, etcd and protoc (scripts/test.sh installs Debian's when they are missing).
# Every wait is bounded; the programs it starts are stopped on exit, however it exits.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/console.png}
token=console-screenshot

chromium=$(command -v chromium || true)
[[ -n $chromium ]] || { echo "needs chromium: apt-get install chromium (scripts/test.sh does)" >&2; exit 1; }
command -v etcd >/dev/null || { echo "needs etcd: apt-get install etcd-server (scripts/test.sh does)" >&2; exit 1; }

echo "== building echo-server, echo-client and rpcctl (with etcd)"
cargo build --quiet -p examples -p rpcctl --features examples/etcd \
  --bin echo-server --bin echo-client --bin rpcctl
bin=${CARGO_TARGET_DIR:-target}/debug

work=$(mktemp -d)
pids=()
stop() {
  # SIGTERM: each program stops (the servers drain); anything left after 10 s is killed.
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
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

# Waits, at most 10 s, until echo-client has printed N call lines.
calls_done() {
  local n=$1
  for _ in $(seq 100); do
    (($(grep -c '^call ' "$work/client.out" || true) >= n)) && return 0
    sleep 0.1
  done
  echo "echo-client made fewer than $n calls in 10 s; it printed:" >&2
  tail -n 20 "$work/client.out" >&2
  return 1
}

echo "== starting etcd on free loopback ports"
read -r client_port peer_port < <(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1", 0)) for x in s]
print(*[x.getsockname()[1] for x in s])')
etcd --name console --data-dir "$work/etcd" \
  --listen-client-urls "http://127.0.0.1:$client_port" --advertise-client-urls "http://127.0.0.1:$client_port" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "console=http://127.0.0.1:$peer_port" >"$work/etcd.out" 2>&1 &
pids+=($!)
registry="etcd://127.0.0.1:$client_port"
for _ in $(seq 100); do "$bin/rpcctl" --registry "$registry" services >/dev/null 2>&1 && break; sleep 0.1; done

echo "== starting two echo-servers registered in it"
for n in 1 2; do
  "$bin/echo-server" --port 0 --fail-every 7 --delay-ms 3 --registry "$registry" \
    --registry-ttl-secs 5 >"$work/server$n.out" 2>&1 &
  pids+=($!)
  server_pid[$n]=$!
  line_after "$work/server$n.out" "listening on" >/dev/null
done

echo "== a governance rule, written with rpcctl"
cat >"$work/governance.toml" <<'TOML'
# The rule the console's editor shows: a deadline for echo, and the breaker tried in observe mode.
[defaults]
breaker_observe = true

[entries."echo.Echo.echo"]
timeout_ms = 800
retry_times = 1
TOML
"$bin/rpcctl" --registry "$registry" rules set governance "$work/governance.toml"

echo "== calling them, with the client's admin endpoint"
# At most 20000 calls or 60 s, whichever comes first; stopped once the picture is taken.
timeout 60 "$bin/echo-client" --registry "$registry" --calls 20000 --concurrency 4 --interval-ms 5 \
  --admin 127.0.0.1:0 --admin-token "$token" >"$work/client.out" 2>&1 &
pids+=($!)
admin=$(line_after "$work/client.out" "admin on")
calls_done 300
# One server dies without a word: the client's endpoint health and events show what it did.
kill -KILL "${server_pid[2]}"
# The console's figures cover the last few seconds: wait until 300 more calls are done.
calls_done 600
echo "client admin on $admin"

echo "== screenshot of http://$admin/"
mkdir -p "$(dirname "$out")"
# --virtual-time-budget lets the page run 5 s of its own time (five polls, so the charts have
# lines) before the picture; --user-data-dir keeps this run apart from any other chromium.
timeout 60 "$chromium" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage \
  --user-data-dir="$work/profile" --hide-scrollbars --window-size=1400,1320 \
  --virtual-time-budget=5000 --screenshot="$out" "http://$admin/#token=$token" \
  >"$work/chromium.out" 2>&1 || { cat "$work/chromium.out" >&2; exit 1; }
[[ -s $out ]] || { echo "chromium wrote no $out" >&2; cat "$work/chromium.out" >&2; exit 1; }
echo "wrote $out"
