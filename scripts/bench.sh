#!/usr/bin/env bash
# The performance table in one command: builds the project's benchmark program and runs it in
# ../shared/peerbench beside raw, tarpc and tonic (alternating, same machine, same run), then
# prints medians with ratios to raw and to tarpc. `rpc` runs governed (default options, a
# fallback registered), `rpc_nogov` without timeout, retries or breaker.
#
# PEERBENCH_TARGET_DIR: where the peers are built (default target/peerbench). Other knobs are
# peerbench's (see its README and run.sh), for example:
#   SETUPS=pinned PAYLOADS="32 4096" CONCS="1 16 256" CONNS="1 4" REPS=3 DURATION=5 scripts/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
peerbench=${PEERBENCH:-$root/../shared/peerbench}
[[ -x $peerbench/run.sh ]] || { echo "peerbench not found at $peerbench (set PEERBENCH)" >&2; exit 2; }

cargo build --release --quiet -p examples --bin bench --target-dir "$root/target"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Copies, so that a rebuild during the run cannot change the program being measured.
cp target/release/bench "$work/bench"
printf '#!/bin/sh\nRPC_BENCH_GOVERNANCE=off exec "%s/bench" "$@"\n' "$work" >"$work/bench-nogov"
chmod +x "$work/bench-nogov"

results=${RESULTS:-$work/runs.txt}
# Where the peers are built (peerbench's folder may be read-only).
export CARGO_TARGET_DIR=${PEERBENCH_TARGET_DIR:-$root/target/peerbench}
export PEER_rpc=$work/bench PEER_rpc_nogov=$work/bench-nogov
export PEERS=${PEERS:-"raw tarpc tonic rpc rpc_nogov"}
export SETUPS=${SETUPS:-pinned} CONNS=${CONNS:-1} RESULTS=$results
(cd "$peerbench" && ./run.sh >"$work/run.log") || { cat "$work/run.log" >&2; exit 1; }
echo "$(date -u +%Y-%m-%d), $(nproc) CPUs, $(uname -r); raw per-run lines: $results"
python3 "$root/scripts/bench_report.py" "$results"
