#!/usr/bin/env bash
# The project's test command (README): formatting, lints, then every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

echo "== cargo test"
cargo test --workspace
