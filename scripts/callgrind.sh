#!/usr/bin/env bash
# Instructions per call, counted by callgrind: the stable figure on a noisy machine, where
# wall-clock and CPU-time figures move 10-50 % between runs. Server and client of the echo
# benchmark each run in their own process under `valgrind --tool=callgrind`, on 127.0.0.1, over
# one connection with CONC calls in flight, and the client stops after a fixed number of calls
# (`--warmup 0 --requests N`), so a run does the same work however much valgrind slows it down.
#
# Start-up is cancelled by subtraction, not by a warm-up: each variant runs twice, with
# BASE_CALLS and with CALLS calls, and
#     instructions per call = (Ir(CALLS run) - Ir(BASE_CALLS run)) / (served(CALLS) - served(BASE_CALLS))
# per process, `served` being the server's own count. Process start, runtime, connect, the
# histograms' allocation and merge, and the shutdown are the same in both runs and drop out.
#
# Prints, per variant:
#   instructions_per_call client=<n> server=<n> total=<n> peer=<p> governance=<on|off|-> calls=<n>
# and, when raw is among the peers, each variant's ratio to raw of the same run.
#
# Knobs (environment):
#   PEERS="rpc raw"        what to measure: rpc (this worktree's bench program) and/or raw
#                          (peerbench's raw echo, built from $PEERBENCH)
#   GOVERNANCE="on off"    rpc variants: default options with a fallback (on) or no timeout,
#                          retry or breaker (off, RPC_BENCH_GOVERNANCE=off)
#   CALLS=200000 BASE_CALLS=20000 CONC=256 PAYLOAD=32 CONNS=1
#   SERVER_ARGS="..."      extra flags for the rpc server, e.g. "--inline-first-poll"
#   THREADS=<n>            tokio worker threads of both processes (default: tokio's, one per CPU)
#   SERVER_CPU=0 CLIENT_CPU=1  pinning with taskset, as scripts/bench.sh does; PIN=0 turns it off
#   BENCH=<path>           measure this bench binary instead of building this worktree's (for
#                          example one built from an older commit)
#   RAW=<path>             raw binary (default: built from $PEERBENCH into $PEERBENCH_TARGET_DIR)
#   OUT=<dir>              keep the callgrind files there (default: a temporary directory, removed)
#   ANNOTATE=<n>           also print, per side, the top n functions by exclusive and by
#                          inclusive instructions per call (differences of the two runs, from
#                          callgrind_annotate; scripts/callgrind_diff.py)
# Example: PEERS="raw rpc" ANNOTATE=25 OUT=/tmp/cg scripts/callgrind.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

PEERS=${PEERS:-"rpc raw"}
GOVERNANCE=${GOVERNANCE:-"on off"}
CALLS=${CALLS:-200000}
BASE_CALLS=${BASE_CALLS:-20000}
CONC=${CONC:-256}
PAYLOAD=${PAYLOAD:-32}
CONNS=${CONNS:-1}
THREADS=${THREADS:-}
PIN=${PIN:-1}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
ANNOTATE=${ANNOTATE:-0}
peerbench=${PEERBENCH:-$root/../shared/peerbench}

command -v valgrind >/dev/null || { echo "valgrind not found (apt-get install valgrind)" >&2; exit 2; }
(( CALLS > BASE_CALLS )) || { echo "CALLS ($CALLS) must be larger than BASE_CALLS ($BASE_CALLS)" >&2; exit 2; }

if [[ -n ${OUT:-} ]]; then
  work=$OUT
  mkdir -p "$work"
else
  work=$(mktemp -d)
fi
server_pid=""
cleanup() {
  if [[ -n $server_pid ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  server_pid=""
  [[ -n ${OUT:-} ]] || rm -rf "$work"
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

# Binaries: copies, so that a rebuild during the run cannot change what is measured. Release
# builds keep line tables (profile.release.debug), so callgrind names functions and lines.
if [[ " $PEERS " == *" rpc "* ]]; then
  if [[ -z ${BENCH:-} ]]; then
    cargo build --release --quiet -p examples --bin bench --target-dir "$root/target"
    BENCH=$root/target/release/bench
  fi
  cp "$BENCH" "$work/bench"
fi
if [[ " $PEERS " == *" raw "* ]]; then
  if [[ -z ${RAW:-} ]]; then
    target=${PEERBENCH_TARGET_DIR:-$root/target/peerbench}
    (cd "$peerbench" && CARGO_TARGET_DIR=$target cargo build --release --quiet -p raw)
    RAW=$target/release/raw
  fi
  cp "$RAW" "$work/raw"
fi

# Command prefixes that pin each side to its CPU (taskset execs, so $! is valgrind's pid).
pin_server=()
pin_client=()
if [[ $PIN == 1 ]]; then
  pin_server=(taskset -c "$SERVER_CPU")
  pin_client=(taskset -c "$CLIENT_CPU")
fi

field() { # field KEY LINE
  local kv
  for kv in $2; do
    if [[ $kv == "$1="* ]]; then echo "${kv#*=}"; return; fi
  done
}

total_ir() { # total instructions of one callgrind file
  awk '/^(summary|totals):/ { print $2; exit }' "$1"
}

vg=(valgrind --tool=callgrind --quiet)
threads=()
[[ -n $THREADS ]] && threads=(--threads "$THREADS")

# run NAME PROGRAM GOVERNANCE REQUESTS: one server and one client under callgrind; leaves
# $work/NAME.{server,client}.cg and sets `served` to the server's count of calls.
run() {
  local name=$1 prog=$2 gov=$3 requests=$4
  local fifo=$work/$name.listening
  local extra=()
  # shellcheck disable=SC2206 # flags, split on spaces on purpose
  [[ $prog == bench ]] && extra=(${SERVER_ARGS:-})
  rm -f "$fifo"
  mkfifo "$fifo"
  "${pin_server[@]}" "${vg[@]}" --callgrind-out-file="$work/$name.server.cg" \
    --log-file="$work/$name.server.vg.log" \
    "$work/$prog" --mode server --addr 127.0.0.1:0 "${threads[@]}" "${extra[@]}" \
    >"$fifo" 2>"$work/$name.server.err" &
  server_pid=$!
  exec 3<"$fifo"
  local line addr=""
  while read -r line <&3; do
    if [[ $line == LISTENING* ]]; then addr=$(field addr "$line"); break; fi
  done
  [[ -n $addr ]] || { echo "$name: the server printed no LISTENING line" >&2; cat "$work/$name.server.err" >&2; exit 1; }
  local result
  result=$("${pin_client[@]}" env RPC_BENCH_GOVERNANCE="$gov" "${vg[@]}" --callgrind-out-file="$work/$name.client.cg" --log-file="$work/$name.client.vg.log" \
    "$work/$prog" --mode client --addr "$addr" --conns "$CONNS" --concurrency "$CONC" \
    --payload "$PAYLOAD" --warmup 0 --requests "$requests" --label callgrind "${threads[@]}" \
    2>"$work/$name.client.err" | grep '^RESULT ' || true)
  [[ -n $result ]] || { echo "$name: the client printed no RESULT line" >&2; cat "$work/$name.client.err" >&2; exit 1; }
  local errors
  errors=$(field errors "$result")
  [[ $errors == 0 ]] || { echo "$name: $errors calls failed: $result" >&2; exit 1; }
  kill -TERM "$server_pid"
  served=""
  while read -r line <&3; do
    if [[ $line == SERVER* ]]; then served=$(field served "$line"); fi
  done
  exec 3<&-
  wait "$server_pid" || true
  server_pid=""
  [[ -n $served ]] || { echo "$name: the server printed no SERVER line" >&2; exit 1; }
}

declare -A per_call
variants=()
for peer in $PEERS; do
  case $peer in
    rpc) govs=$GOVERNANCE ;;
    raw) govs="-" ;;
    *) echo "unknown peer $peer (rpc or raw)" >&2; exit 2 ;;
  esac
  for gov in $govs; do
    v=raw
    [[ $peer == rpc ]] && v=rpc-$gov
    variants+=("$v")
    envgov=$gov
    [[ $gov == - ]] && envgov=on
    prog=raw
    [[ $peer == rpc ]] && prog=bench
    run "$v.base" "$prog" "$envgov" "$BASE_CALLS"
    s1=$served
    run "$v.full" "$prog" "$envgov" "$CALLS"
    n=$(( served - s1 ))
    line="instructions_per_call"
    sum=0
    for side in client server; do
      a=$(total_ir "$work/$v.base.$side.cg")
      b=$(total_ir "$work/$v.full.$side.cg")
      ipc=$(( (b - a + n / 2) / n ))
      per_call[$v.$side]=$ipc
      sum=$(( sum + ipc ))
      line+=" $side=$ipc"
    done
    per_call[$v.total]=$sum
    echo "$line total=$sum peer=$peer governance=$gov calls=$n"
    if (( ANNOTATE > 0 )); then
      for side in client server; do
        python3 "$root/scripts/callgrind_diff.py" --groups --top "$ANNOTATE" --calls "$n" \
          --title "$v $side" "$work/$v.base.$side.cg" "$work/$v.full.$side.cg"
      done
    fi
  done
done

if [[ -n ${per_call[raw.total]:-} ]]; then
  for v in "${variants[@]}"; do
    [[ $v == raw ]] && continue
    printf 'ratio_to_raw client=%s server=%s total=%s variant=%s\n' \
      "$(awk -v a="${per_call[$v.client]}" -v b="${per_call[raw.client]}" 'BEGIN{printf "%.2f", a/b}')" \
      "$(awk -v a="${per_call[$v.server]}" -v b="${per_call[raw.server]}" 'BEGIN{printf "%.2f", a/b}')" \
      "$(awk -v a="${per_call[$v.total]}" -v b="${per_call[raw.total]}" 'BEGIN{printf "%.2f", a/b}')" "$v"
  done
fi
[[ -z ${OUT:-} ]] || echo "callgrind files: $work" >&2
