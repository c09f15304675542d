#!/usr/bin/env bash
# The checks to run on a GPU machine, in one go (see README, "GPU"):
#   1. parity: every CUDA kernel and the GPU target forward against the CPU backend, on the
#      GPU (the host_device test executable with DFLASH_TEST_DEVICE=cuda);
#   2. a short pipeline with a target and a drafter sharing GPU 0, NVML telemetry on, then
#      the same with --no-gpu-metrics: step time with and without telemetry; then the same
#      drafter as a one-rank NCCL group (--collective nccl: NCCL's communicator, bucketed
#      all-reduce and device-side apply; a one-GPU machine cannot run two ranks);
#   3. isolation: /proc/<pid>/maps of a running supervisor and its workers; the supervisor
#      maps no CUDA library (libcuda, libcudart, libcublas, libnvrtc) and maps NVML, no
#      worker maps NVML;
#   4. bench compute --json.
# With DFLASH_NVML_LIBRARY set (the fake NVML of the tests) only step 3 runs. Without a GPU
# it says so and exits 2.
#
#   scripts/gpu_check.sh [PATH/TO/dflash-supervise]     (default: target/gpu-bundle, then
#                                                       target/release, then target/debug)
# The GPU machine may have no Rust: scripts/gpu_bundle.sh builds target/gpu-bundle here
# (release binaries + the parity test executable) to carry there.
# Exit 0 when every check passes, 1 when one fails, 2 when it cannot run.
set -uo pipefail
cd "$(dirname "$0")/.."
sup=${1:-}
if [ -z "$sup" ]; then
    for p in target/gpu-bundle/dflash-supervise target/release/dflash-supervise target/debug/dflash-supervise; do [ -x "$p" ] && { sup=$p; break; }; done
fi
[ -x "${sup:-}" ] || { echo "gpu_check: dflash-supervise not found (build it, or pass its path)" >&2; exit 2; }
bindir=$(dirname "$sup")
fail=0
fake_nvml=${DFLASH_NVML_LIBRARY:+yes}
if [ -z "$fake_nvml" ] && [ ! -e /dev/nvidia0 ] && [ ! -d /proc/driver/nvidia/gpus ]; then
    echo "gpu_check: no NVIDIA GPU on this machine (no /dev/nvidia0, no /proc/driver/nvidia/gpus): nothing to check on a device"
    exit 2
fi

if [ -z "$fake_nvml" ]; then
    echo "== 1. parity on the GPU (kernels and target forward vs the CPU backend)"
    t=$(ls "$bindir"/host_device 2>/dev/null || ls -t target/release/deps/host_device-* target/debug/deps/host_device-* 2>/dev/null | grep -v '\.d$' | head -1)
    if [ -n "$t" ] && [ -x "$t" ]; then
        if DFLASH_TEST_DEVICE=cuda "$t" --test-threads 1 --nocapture 2>&1 | grep -E "max relative error|test result|panicked|FAILED"; then :; fi
        DFLASH_TEST_DEVICE=cuda "$t" --test-threads 1 >/dev/null 2>&1 || { echo "FAIL parity tests"; fail=1; }
    else
        echo "FAIL the host_device test executable is missing (scripts/gpu_bundle.sh)"; fail=1
    fi

    echo "== 2. pipeline: target and drafter sharing GPU 0, telemetry on vs --no-gpu-metrics"
    for mode in on off; do
        d=$(mktemp -d)/run
        extra=""; [ "$mode" = off ] && extra="--no-gpu-metrics"
        if "$sup" --target-gpus 0 --drafter-gpus 0 --data demo --steps 40 --run-dir "$d" $extra >"$d.out" 2>&1; then
            python3 - "$d/train.jsonl" "$mode" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
span = (rows[-1]["t"] - rows[1]["t"]) / 1000.0
steps = len(rows) - 2
tok = sum(r["tokens"] for r in rows[2:])
print(f"ok   telemetry {sys.argv[2]:>3}: {1000 * span / max(steps, 1):.1f} ms/step, {tok / max(span, 1e-9):.0f} tokens/s over {steps} steps")
PY
        else
            echo "FAIL pipeline (telemetry $mode):"; tail -5 "$d.out"; fail=1
        fi
    done

    echo "== 2b. the drafter as a one-rank NCCL group"
    d=$(mktemp -d)/run
    if "$sup" --target-gpus 0 --drafter-gpus 0 --collective nccl --data demo --steps 20 --run-dir "$d" >"$d.out" 2>&1; then
        python3 - "$d/train.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l]
ms = sorted(r.get("reduce_ms", 0) for r in rows[2:])
print(f"ok   NCCL one-rank group: {len(rows)} steps, final loss {rows[-1]['loss']:.3f}, all-reduce median {ms[len(ms) // 2] if ms else 0:.2f} ms")
PY
    elif grep -q "libnccl" "$d.out"; then
        echo "skip NCCL is not installed here: $(grep -o 'NCCL (libnccl.so.2) not found[^;]*' "$d.out" | head -1)"
    else
        echo "FAIL NCCL one-rank group:"; tail -5 "$d.out"; fail=1
    fi
fi

echo "== 3. isolation: which process maps which library"
run_dir=$(mktemp -d)/run
nvml_pattern='libnvidia-ml|fake_nvml'
cuda_pattern='libcuda\.|libcudart|libcublas|libnvrtc'

# An idle pipeline (stdin held open, empty) keeps every worker up while we look.
exec 3< <(exec sleep 30 2>/dev/null)
idle_pid=$!
"$sup" --gpus all --data - --time-limit 20s --gpu-sample-interval 200ms --run-dir "$run_dir" <&3 >/dev/null 2>"$run_dir.err" &
sup_pid=$!
for _ in $(seq 1 100); do
    if [ -f "$run_dir/state.json" ] && python3 - "$run_dir/state.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
sys.exit(0 if s["workers"] and all(w["state"] == "running" for w in s["workers"]) else 1)
PY
    then break; fi
    if ! kill -0 "$sup_pid" 2>/dev/null; then echo "gpu_check: the run ended early:" >&2; cat "$run_dir.err" >&2; kill "$idle_pid" 2>/dev/null; exit 2; fi
    sleep 0.1
done
sleep 1  # let the sampler take a few samples
if grep -Eq "$cuda_pattern" "/proc/$sup_pid/maps"; then
    echo "FAIL supervisor (pid $sup_pid) maps a CUDA library:"; grep -Eo "/[^ ]*($cuda_pattern)[^ ]*" "/proc/$sup_pid/maps" | sort -u; fail=1
else
    echo "ok   supervisor (pid $sup_pid) maps no CUDA library"
fi
if grep -Eq "$nvml_pattern" "/proc/$sup_pid/maps"; then
    echo "ok   supervisor maps NVML: $(grep -Eo "/[^ ]*($nvml_pattern)[^ ]*" "/proc/$sup_pid/maps" | sort -u | head -1)"
else
    echo "FAIL supervisor does not map NVML while sampling GPUs"; fail=1
fi
for pid in $(python3 -c "import json,sys; print(' '.join(str(w['pid']) for w in json.load(open(sys.argv[1]))['workers'] if w['pid']))" "$run_dir/state.json"); do
    if grep -Eq "$nvml_pattern" "/proc/$pid/maps"; then
        echo "FAIL worker pid $pid maps NVML"; fail=1
    else
        echo "ok   worker pid $pid maps no NVML"
    fi
done
kill -TERM "$sup_pid" 2>/dev/null; wait "$sup_pid" 2>/dev/null
kill "$idle_pid" 2>/dev/null

if [ -z "$fake_nvml" ]; then
    echo "== 4. bench compute"
    "$sup" bench compute --json || { echo "FAIL bench compute"; fail=1; }
fi
exit $fail
