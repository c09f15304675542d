#!/usr/bin/env bash
# Build what scripts/gpu_check.sh needs on a GPU machine that has no Rust, into
# target/gpu-bundle: release dflash-supervise and dflash-worker, and the parity test
# executable (worker/tests/host_device.rs) as `host_device`. Carry target/gpu-bundle and
# run `scripts/gpu_check.sh target/gpu-bundle/dflash-supervise` there.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p dflash-supervisor -p dflash-worker
t=$(cargo test --release --locked -p dflash-worker --test host_device --no-run --message-format=json 2>/dev/null \
    | python3 -c "import json,sys; print([j['executable'] for j in map(json.loads, sys.stdin) if j.get('executable') and 'host_device' in j['executable']][-1])")
mkdir -p target/gpu-bundle
cp target/release/dflash-supervise target/release/dflash-worker target/gpu-bundle/
cp "$t" target/gpu-bundle/host_device
strip target/gpu-bundle/* 2>/dev/null || true
du -sh target/gpu-bundle
