#!/usr/bin/env bash
# System calls per call: runs the benchmark's server and client (pinned to different cores, as
# scripts/bench.sh does) under `perf stat` with the kernel's syscall tracepoints and divides each
# count by the calls the server answered. Needs perf (Debian: linux-perf) and tracepoint access
# (root, or perf_event_paranoid <= -1).
#
#   scripts/syscalls.sh [PAYLOAD] [CONCURRENCY] [SECONDS]     defaults: 32 256 3
set -euo pipefail
cd "$(dirname "$0")/.."
payload=${1:-32} conc=${2:-256} secs=${3:-3}
command -v perf >/dev/null || { echo "perf not found (apt-get install linux-perf)" >&2; exit 2; }
cargo build --release --quiet -p examples --bin bench
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp target/release/bench "$work/bench"
events=raw_syscalls:sys_enter,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom,syscalls:sys_enter_write,syscalls:sys_enter_read,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_futex,syscalls:sys_enter_sched_yield
taskset -c 0 perf stat -x, -o "$work/server.perf" -e "$events" -- \
  "$work/bench" --mode server --addr 127.0.0.1:0 >"$work/server.out" &
for _ in $(seq 100); do grep -q addr= "$work/server.out" 2>/dev/null && break; sleep 0.1; done
addr=$(grep -o 'addr=[^ ]*' "$work/server.out" | cut -d= -f2)
taskset -c 1 perf stat -x, -o "$work/client.perf" -e "$events" -- \
  "$work/bench" --mode client --addr "$addr" --conns 1 --concurrency "$conc" --payload "$payload" \
  --duration "$secs" --warmup 0.5 --label syscalls >"$work/client.out"
# The server itself, not perf (which writes its counts when the server exits).
kill -TERM "$(grep -o 'pid=[0-9]*' "$work/server.out" | cut -d= -f2)"
wait
served=$(grep -o 'served=[0-9]*' "$work/server.out" | cut -d= -f2)
echo "payload=$payload conc=$conc calls=$served (every call the server answered, warm-up included)"
for side in client server; do
  awk -F, -v side="$side" -v n="$served" '
    $3 ~ /sys_enter/ { name=$3; sub(/.*sys_enter_?/, "", name); if (name == "") name = "all";
                       line = line sprintf(" %s=%.3f", name, $1 / n) }
    END { print side " syscalls per call:" line }' "$work/$side.perf"
done
