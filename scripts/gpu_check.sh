#!/usr/bin/env bash
# Isolation check on a GPU machine (or with the fake NVML): starts a short run on every GPU
# and reads /proc/<pid>/maps of the running supervisor and of each worker. The supervisor
# must map no CUDA library (libcuda, libcudart, libcublas, libnvrtc) and must map NVML when
# it samples GPUs; no worker may map NVML.
#
#   scripts/gpu_check.sh [PATH/TO/dflash-supervise]     (default: target/release, then debug)
# Exit 0 when the check passes, 1 when it fails, 2 when it cannot run.
set -uo pipefail
cd "$(dirname "$0")/.."
sup=${1:-}
if [ -z "$sup" ]; then
    for p in target/release/dflash-supervise target/debug/dflash-supervise; do [ -x "$p" ] && { sup=$p; break; }; done
fi
[ -x "${sup:-}" ] || { echo "gpu_check: dflash-supervise not found (build it, or pass its path)" >&2; exit 2; }
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
fail=0
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
exit $fail
