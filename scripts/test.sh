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

echo "== cargo doc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features --quiet

echo "== cargo test --all-features"
cargo test --workspace --all-features
