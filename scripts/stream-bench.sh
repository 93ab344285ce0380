#!/usr/bin/env bash
# Streams measured beside tonic's streaming in one run: builds `bench`, the tonic
# server-streaming echo (`bench/tonic-stream`) and the practical limit (`bench/raw-stream`:
# length-delimited items on one TCP connection with no framework; each its own workspace) in
# release, then for each case (item size × streams on one connection) starts a server process
# and a client process per peer on 127.0.0.1, peers alternating, REPS times, and prints the
# median items per second and CPU per item (client CPU over the measured window plus the
# server's CPU per item it produced) with the ratios rpc/tonic, and the limit's (raw/tonic): a
# goal above the limit's ratio is out of any framework's reach on this machine. `raw-vec` is the
# same limit with the per-item work of the rpc and tonic programs added (a `Vec<u8>` per item on
# each side and a shared counter), the limit for any framework whose users stream such items. Optionally (BASE=<commit>) it re-runs a few unary cases of `bench` against
# the same program built from that commit, to show the unary path unchanged.
#
# Knobs: SIZES="32 4096" STREAMS="1 64" REPS=3 DURATION=3 WARMUP=1 PEERS="rpc tonic raw raw-vec"
#        BASE=afc122e (unset: no unary comparison; built in a temporary worktree into
#        BASE_TARGET_DIR, default target/stream-bench-base) or BASE_BIN=<a bench built from it>,
#        UNARY_CASES="32:1 32:256 4096:16" (payload:concurrency, one connection)
#        STREAM_WINDOW=<items> (the rpc client's ClientBuilder::stream_window; unset: its default)
#        CARGO_TARGET_DIR (default target/) for both programs.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
SIZES=${SIZES:-"32 4096"}
STREAMS=${STREAMS:-"1 64"}
REPS=${REPS:-3}
DURATION=${DURATION:-3}
WARMUP=${WARMUP:-1}
UNARY_CASES=${UNARY_CASES:-"32:1 32:256 4096:16"}
PEERS=${PEERS:-"rpc tonic raw raw-vec"}
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
target=${CARGO_TARGET_DIR:-$root/target}

cargo build --release --quiet -p examples --bin bench --target-dir "$target"
cargo build --release --quiet --manifest-path bench/tonic-stream/Cargo.toml --target-dir "$target"
cargo build --release --quiet --manifest-path bench/raw-stream/Cargo.toml --target-dir "$target"
work=$(mktemp -d)
servers=()
cleanup() {
  for p in "${servers[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
# Copies, so that a rebuild during the run cannot change the programs being measured.
cp "$target/release/bench" "$work/rpc"
cp "$target/release/tonic-stream" "$work/tonic"
cp "$target/release/raw-stream" "$work/raw"
# The same limit with a Vec<u8> per item on each side, as the other peers' programs stream.
printf '#!/bin/sh\nexec %q "$@" --items vec\n' "$work/raw" >"$work/raw-vec"
chmod +x "$work/raw-vec"

# start_server PROGRAM: starts it on a free port, sets $addr and $spid.
nserver=0
start_server() {
  # A file per server: the next one's output never mixes with (or is read as) the last one's.
  nserver=$((nserver + 1))
  out=$work/server.$nserver.out
  : >"$out"
  "$@" --mode server --addr 127.0.0.1:0 >"$out" &
  spid=$!
  servers+=("$spid")
  addr=
  for _ in $(seq 1 200); do
    addr=$(sed -n 's/^LISTENING .*addr=\([^ ]*\).*/\1/p' "$out")
    [[ -n $addr ]] && return 0
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.05
  done
  echo "server $* did not start" >&2
  exit 1
}

# stop_server: SIGTERM, wait (bounded), prints the SERVER line.
stop_server() {
  kill -TERM "$spid"
  for _ in $(seq 1 100); do
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.05
  done
  kill -KILL "$spid" 2>/dev/null || true
  wait "$spid" 2>/dev/null || true
  grep '^SERVER ' "$out" || echo "SERVER none"
}

runs=$work/streams.txt
: >"$runs"
for rep in $(seq 1 "$REPS"); do
  for size in $SIZES; do
    for s in $STREAMS; do
      for peer in $PEERS; do
        start_server "$work/$peer"
        extra=()
        [[ $peer == rpc && -n ${STREAM_WINDOW:-} ]] && extra=(--stream-window "$STREAM_WINDOW")
        line=$("$work/$peer" --mode client --addr "$addr" --streams "$s" --size "$size" \
          --duration "$DURATION" --warmup "$WARMUP" "${extra[@]}") || { echo "client $peer failed: $line" >&2; exit 1; }
        server=$(stop_server)
        echo "$line" "server_$(echo "$server" | tr ' ' '\n' | grep -E '^(items|cpu_s)=' | paste -sd' ' | sed 's/ / server_/')" | tee -a "$runs" >&2
      done
    done
  done
done

echo "$(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(uname -r); ${REPS} reps, ${DURATION} s + ${WARMUP} s warm-up; rpc stream window: ${STREAM_WINDOW:-default}"
python3 - "$runs" <<'PY'
import sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    f = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    items = float(f["items"])
    server = float(f["server_cpu_s"]) * 1e6 / max(float(f["server_items"]), 1)
    cpu = float(f["cpu_us_per_item"]) + server
    rows.setdefault((int(f["size"]), int(f["streams"])), {}).setdefault(f["peer"], []).append(
        (float(f["items_per_s"]), cpu, float(f["cpu_us_per_item"]), server))
limits = [p for p in ("raw", "raw-vec") if any(p in v for v in rows.values())]
print(f"{'size':>5} {'streams':>7} | {'rpc items/s':>12} {'tonic items/s':>13} {'ratio':>6} | "
      f"{'rpc µs/item':>11} {'tonic µs/item':>13} {'ratio':>6} | (client+server µs/item)")
for (size, s), peers in sorted(rows.items()):
    med = {p: [st.median(x[i] for x in v) for i in range(4)] for p, v in peers.items()}
    r, t = med.get("rpc"), med.get("tonic")
    if not r or not t:
        continue
    print(f"{size:>5} {s:>7} | {r[0]:>12.0f} {t[0]:>13.0f} {r[0]/t[0]:>5.2f}x | "
          f"{r[1]:>11.3f} {t[1]:>13.3f} {r[1]/t[1]:>6.2f} | "
          f"rpc {r[2]:.3f}+{r[3]:.3f}, tonic {t[2]:.3f}+{t[3]:.3f}")
if limits:
    print("the practical limits beside tonic (a goal near or above limit/tonic is at the edge of this machine):")
    print(f"{'size':>5} {'streams':>7} | {'limit':>7} {'items/s':>12} {'/tonic':>7} | "
          f"{'µs/item':>8} {'/tonic':>7} | (client+server µs/item)")
    for (size, s), peers in sorted(rows.items()):
        med = {p: [st.median(x[i] for x in v) for i in range(4)] for p, v in peers.items()}
        t = med.get("tonic")
        for p in limits:
            w = med.get(p)
            if not w or not t:
                continue
            print(f"{size:>5} {s:>7} | {p:>7} {w[0]:>12.0f} {w[0]/t[0]:>6.2f}x | "
                  f"{w[1]:>8.3f} {w[1]/t[1]:>7.2f} | {w[2]:.3f}+{w[3]:.3f}")
PY

if [[ -n ${BASE_BIN:-} ]]; then
  cp "$BASE_BIN" "$work/base"
  BASE=${BASE:-$BASE_BIN}
elif [[ -n ${BASE:-} ]]; then
  base_src=$work/base-src
  base_target=${BASE_TARGET_DIR:-$root/target/stream-bench-base}
  git worktree add --detach "$base_src" "$BASE" >/dev/null
  (cd "$base_src" && cargo build --release --quiet -p examples --bin bench --target-dir "$base_target")
  cp "$base_target/release/bench" "$work/base"
  git worktree remove --force "$base_src"
fi
if [[ -n ${BASE:-} ]]; then
  unary=$work/unary.txt
  : >"$unary"
  for rep in $(seq 1 "$REPS"); do
    for case in $UNARY_CASES; do
      for peer in base rpc; do
        start_server "$work/$peer"
        "$work/$peer" --mode client --addr "$addr" --payload "${case%%:*}" --concurrency "${case##*:}" \
          --duration "$DURATION" --warmup "$WARMUP" --label "$peer" --governance off \
          | tee -a "$unary" >&2
        stop_server >/dev/null
      done
    done
  done
  echo "unary, governance off: $BASE vs this tree"
  python3 - "$unary" <<'PY'
import sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    f = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    rows.setdefault((int(f["payload"]), int(f["conc"])), {}).setdefault(f["label"], []).append(
        (float(f["qps"]), float(f["p50_us"]), float(f["cpu_us_per_req"])))
print(f"{'payload':>7} {'conc':>5} | {'base qps':>10} {'now qps':>10} {'ratio':>6} | "
      f"{'base p50 µs':>11} {'now p50 µs':>10} | {'base cpu µs':>11} {'now cpu µs':>10}")
for (p, c), v in sorted(rows.items()):
    b = [st.median(x[i] for x in v["base"]) for i in range(3)]
    n = [st.median(x[i] for x in v["rpc"]) for i in range(3)]
    print(f"{p:>7} {c:>5} | {b[0]:>10.0f} {n[0]:>10.0f} {n[0]/b[0]:>5.2f}x | "
          f"{b[1]:>11.1f} {n[1]:>10.1f} | {b[2]:>11.2f} {n[2]:>10.2f}")
PY
fi
