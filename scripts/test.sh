#!/usr/bin/env bash
# The project's test command (the README's, and what CI runs).
# Builds every binary the end-to-end tests drive, then runs all tests.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo >/dev/null || { echo "scripts/test.sh: cargo not found; install Rust (https://rustup.rs)" >&2; exit 2; }

# The e2e tests run target/debug/dflash-supervise, dflash-worker and dflash-test-worker.
cargo build --workspace --locked

if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --locked --profile "${NEXTEST_PROFILE:-default}" "$@"
else
    echo "scripts/test.sh: cargo-nextest not installed; falling back to cargo test" >&2
    cargo test --workspace --locked "$@"
fi
