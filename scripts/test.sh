#!/usr/bin/env bash
# The project's test command (README): installs what the tests need (etcd, ZooKeeper, protoc,
# prometheus, chromium and chromedriver, openapi-spec-validator) when it is missing, then checks
# formatting, lints and the API docs and runs every test of the workspace with every feature (the
# etcd and ZooKeeper tests start their own servers on free loopback ports).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
# The ZooKeeper registry's tests run Debian's ZooKeeper (its jar, on the JRE it brings).
[[ -e /usr/share/java/zookeeper.jar ]] && command -v java >/dev/null 2>&1 || need+=(zookeeper)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
# rpc-admin's Prometheus test scrapes a running server with a real Prometheus.
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
# rpc-admin's console test drives the web console in a real headless chromium through chromedriver.
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
# rpc-gateway's OpenAPI test validates the document with the standard validator (PyPI's
# openapi-spec-validator, installed below with pip, which Debian ships apart from python3).
need_validator=""
python3 -c "import openapi_spec_validator" >/dev/null 2>&1 || need_validator=1
if [[ -n $need_validator ]]; then
  python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
fi
if ((${#need[@]})); then
  echo "== installing ${need[*]}"
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [[ -n $need_validator ]]; then
  echo "== installing openapi-spec-validator"
  # A Debian python3 refuses system-wide pip installs (PEP 668): then into the user's site.
  python3 -m pip install -q openapi-spec-validator 2>/dev/null ||
    python3 -m pip install -q --user --break-system-packages openapi-spec-validator
fi
# Debian's etcd-server starts a system etcd on the default ports; the tests use their own.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
  echo "(a system etcd is running; the tests start their own on free ports)"
fi
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet zookeeper 2>/dev/null; then
  echo "(a system ZooKeeper is running; the tests start their own on free ports)"
fi
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
  echo "(a system prometheus is running; the test starts its own on a free port)"
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy --all-targets --all-features -- -D warnings"
cargo clippy --workspace --all-targets --all-features -- -D warnings

echo "== cargo doc of the libraries' API (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features --lib --quiet

echo "== cargo test --all-features"
cargo test --workspace --all-features --no-run
# The macro's compile-fail cases (rpc-macros/tests/ui.rs, one test) compile a project of their
# own in a target directory of their own: a minute or more of CPU, while most other tests wait on
# sockets, timers and child processes. They run beside the others rather than after them, and
# the others run four at a time rather than one per CPU, for the same reason; on a two-core
# machine this takes the run from about 3.5 minutes to about 2.
ui_log=$(mktemp)
trap 'rm -f "$ui_log"' EXIT
cargo test --workspace --all-features --test ui >"$ui_log" 2>&1 &
ui=$!
status=0
cargo test --workspace --all-features -- --test-threads=4 \
  --skip service_macro_rejects_what_it_cannot_generate || status=$?
ui_status=0
wait "$ui" || ui_status=$?
echo "== the service macro's compile-fail cases (rpc-macros/tests/ui.rs)"
cat "$ui_log"
# A filter that left the compile-fail test out of both runs would pass silently: it must have run.
if ((ui_status == 0)) && ! grep -q "test result: ok. 1 passed" "$ui_log"; then
  echo "the compile-fail test did not run" >&2
  ui_status=1
fi
((status == 0 && ui_status == 0))
