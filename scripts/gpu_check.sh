#!/usr/bin/env bash
# shellcheck disable=SC2317,SC2329  # the step functions are called by name (step_$NAME)
# One verdict for a GPU machine (see docs/gpus.md): does this build run there, and how fast?
#
#   scripts/gpu_check.sh [--emulated] [--out DIR] [PATH/TO/dflash-supervise]
#
# Steps, in this order, each under its own `timeout` (the limits below, GC_LIMITS_GPU and
# GC_LIMITS_EMULATED), the whole check within its mode's budget (GC_BUDGET_GPU: 360 s on a
# GPU, GC_BUDGET_EMULATED on the emulated stack; GPU_CHECK_BUDGET_S overrides it). The
# first three answer "does it run there and agree with the CPU" (at most 145 s), the
# fourth "how fast":
#   preflight       the GPU, driver and CUDA versions, MIG mode, clocks (nvidia-smi), what
#                   NVML reports, and which CUDA libraries a worker loads from where (the
#                   "GPU:" lines of a two-step run's worker logs), NVRTC and the PTX ISA;
#                   anything missing stops the check here (exit 2) with the reason. The
#                   kernels come from the bundle's kernel-cache/ (CUBINs made by
#                   scripts/gpu_bundle.sh for sm_80, sm_90 and sm_100): nothing compiles
#                   here when the GPU's architecture is one of those
#   parity          every kernel, the target forward and a drafter step against the CPU
#                   backend, on the GPU: the host_device test executable with
#                   DFLASH_TEST_DEVICE=cuda, one row per test; failures re-run once with
#                   CUDA_LAUNCH_BLOCKING=1
#   pipeline        a target and a drafter sharing GPU 0, with NVML telemetry (its fields
#                   asserted present)
#   throughput      tokens/s of a target worker and of a drafter worker, measured (20+
#                   steps after a warm-up) on random weights at Qwen3-8B's layer shapes
#                   (bench compute --target throughput:qwen3-8b), and each one's MFU beside
#                   the roofline model's for the same shapes (the bundle's roofline.json)
#   eval            τ of the drafter `pipeline` trained: speculative decoding on the GPU
#                   (eval --gpus 0, bf16) and on the CPU with the same prompts; the GPU's τ
#                   sane, its first tokens the CPU's where the CPU's top-2 logit margin
#                   exceeds the bf16 error bound (the rest reported as ties), its decode
#                   tokens/s
#   pipeline-nccl   the same pipeline with the drafter as a one-rank NCCL group
#   isolation       /proc/<pid>/maps of a live run: the supervisor maps NVML and no CUDA
#                   library, every worker maps the CUDA libraries and not NVML
#   bench-ops       single ops at Qwen3-8B shapes (bench compute --target ops:qwen3-8b):
#                   time, TFLOP/s and % of the bf16 peak per op
# Results go to DIR (default ./gpu-check-<UTC time>): results.json (one object: steps,
# preflight facts, parity rows, throughput rows, benchmark rows, isolation facts; written
# again after every step, so a check killed midway leaves what it measured, "complete":
# false), results.md (the tables, also printed), logs/ (each step's output), runs/ (the
# runs' logs and metrics), and kernel-cache/ (the kernels the workers loaded). Exit 0:
# every step passed; 1: one failed or did not run; 2: the check cannot run here.
#
# --emulated runs the same check over the emulated CUDA stack of the tests (libdflash_emu_
# cuda/cublas as libcuda, cuBLAS and NCCL; the fake NVML with one GPU; the host CPU as
# the device, so the shapes are tiny), to test this script before it meets a GPU
# (tests/tests/gpu_check.rs).
#
# The GPU machine may have no Rust: scripts/gpu_bundle.sh builds target/gpu-bundle here
# (release binaries, the parity executable, this script, the kernels' CUBINs, the roofline
# model) to carry there and run as `gpu-bundle/gpu_check.sh --out results`.
set -uo pipefail

# The budget of the whole check (s) and each step's limit, per mode, in the order the
# steps run. The limits add up to no more than the budget less GC_RESERVE_S (the parent's
# own work: starting, the results after each step); tests/tests/gpu_check.rs reads these
# lines and checks that, and that the GPU's budget is at most 360 s.
GC_RESERVE_S=15
GC_BUDGET_GPU=360
GC_LIMITS_GPU="preflight=45 parity=70 pipeline=30 throughput=70 eval=30 pipeline-nccl=25 isolation=15 bench-ops=60"
GC_BUDGET_EMULATED=720
GC_LIMITS_EMULATED="preflight=90 parity=150 pipeline=75 throughput=90 eval=75 pipeline-nccl=75 isolation=45 bench-ops=105"

SELF=$(readlink -f "$0")
HERE=$(dirname "$SELF")

usage() {
    sed -n '3,/^set -uo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//'
}

# ------------------------------------------------------------------------------------
# Shared by the parent and by each step (the script runs itself per step, under timeout).

py() { python3 "$GC_WORK/helper.py" "$@"; }

# The run options every pipeline of this check uses: one target and one drafter sharing
# GPU 0, the built-in demo data and tiny target. Over the emulated stack the batches are
# cut small (a drafter step of the default batch takes tens of seconds on the host) and
# hangs are judged leniently (a loaded CI machine).
run_options() {
    printf '%s\n' --target-gpus 0 --drafter-gpus 0 --data demo --metrics-interval 1s --gpu-sample-interval 200ms
    if [ "$GC_MODE" = emulated ]; then
        printf '%s\n' --token-budget 256 --max-seq-len 128 --max-anchors 4 --draft-layers 1 --block-size 4 --hang-timeout 300s
    fi
}

# supervise_run NAME STEPS [ARGS...]: one run into $GC_WORK/runs/NAME, its console in
# NAME.console; its logs and metrics are copied to $GC_OUT/runs/NAME. Returns its exit code.
supervise_run() {
    local name=$1 steps=$2 rc
    shift 2
    local dir="$GC_WORK/runs/$name"
    local -a opts
    mapfile -t opts < <(run_options)
    mkdir -p "$GC_WORK/runs"
    echo "\$ dflash-supervise ${opts[*]} --steps $steps $* --run-dir $dir"
    "$GC_SUP" "${opts[@]}" --steps "$steps" "$@" --run-dir "$dir" </dev/null >"$dir.console" 2>&1
    rc=$?
    echo "exit code $rc"
    tail -n 5 "$dir.console"
    keep_run "$name"
    return "$rc"
}

# What of a run comes back in the output folder (not its checkpoints or exported drafter).
keep_run() {
    local dir="$GC_WORK/runs/$1" dst="$GC_OUT/runs/$1"
    mkdir -p "$dst"
    cp -r "$dir/logs" "$dst/" 2>/dev/null
    for f in events.jsonl train.jsonl metrics.jsonl state.json supervisor.log; do
        [ -f "$dir/$f" ] && cp "$dir/$f" "$dst/"
    done
    [ -f "$dir.console" ] && cp "$dir.console" "$dst/console.txt"
    return 0
}

# ------------------------------------------------------------------------------------
# The steps. Each writes $GC_OUT/steps/NAME.json through the helper; the parent adds the
# time it took and treats a missing result (a crash, the timeout) as a failure.

step_preflight() {
    # nvidia-smi's XML has every fact in one call (a query of one unknown field would fail
    # the whole query on an older driver).
    if [ "$GC_MODE" = gpu ] && command -v nvidia-smi >/dev/null; then
        timeout 20 nvidia-smi -q -x >"$GC_WORK/nvidia-smi.xml" 2>"$GC_WORK/nvidia-smi.err" || echo "nvidia-smi failed: $(head -c 300 "$GC_WORK/nvidia-smi.err")"
    fi
    timeout 15 "$GC_SUP" gpus --json >"$GC_WORK/gpus.json" 2>"$GC_WORK/gpus.err"
    # Two steps of a tiny run: both workers open the GPU and print what they loaded from
    # where; NVRTC compiles the kernels into the kernel cache (used by every later step).
    supervise_run preflight 2
    py preflight "$?"
}

step_parity() {
    DFLASH_TEST_DEVICE=cuda py parity "$GC_PARITY" "$(( $(date +%s) + GC_STEP_LIMIT - 15 ))"
}

# pipeline NAME STEPS [ARGS...]: a run, then its checks (train.jsonl, metrics.jsonl, the
# workers' logs, the ledger's audit).
pipeline() {
    local name=$1 steps=$2 rc
    shift 2
    supervise_run "$name" "$steps" "$@"
    rc=$?
    timeout 30 "$GC_SUP" ledger --run-dir "$GC_WORK/runs/$name" --json >"$GC_WORK/ledger-$name.json" 2>&1
    py pipeline "$name" "$rc" "$?" "$steps"
}

pipeline_steps() { if [ "$GC_MODE" = emulated ]; then echo 6; else echo 40; fi; }

step_pipeline() { pipeline pipeline "$(pipeline_steps)"; }
step_pipeline_nccl() { pipeline pipeline-nccl "$(pipeline_steps)" --collective nccl; }

# Tokens/s and MFU of a target worker and a drafter worker at Qwen3-8B's layer shapes
# (tiny ones on the emulated GPU), beside the roofline model's MFU for the same shapes.
step_throughput() {
    local preset=qwen3-8b
    [ "$GC_MODE" = emulated ] && preset=tiny
    echo "\$ dflash-supervise bench compute --target throughput:$preset --json"
    "$GC_SUP" bench compute --target "throughput:$preset" --json </dev/null >"$GC_WORK/throughput.json" 2>"$GC_WORK/throughput.err"
    local rc=$?
    cat "$GC_WORK/throughput.err"
    py throughput "$rc" "$GC_WORK/throughput.json" "$GC_WORK/throughput.err" "${GPU_CHECK_ROOFLINE:-$GC_HERE/roofline.json}"
}

step_isolation() {
    local dir="$GC_WORK/runs/isolation" i
    local -a opts
    mapfile -t opts < <(run_options)
    # Fed from stdin instead of the demo data.
    for i in "${!opts[@]}"; do [ "${opts[$i]}" = demo ] && opts[i]=-; done
    mkdir -p "$GC_WORK/runs"
    # An idle pipeline (stdin held open and empty) keeps every worker up while we look;
    # --time-limit ends it by itself should this step be killed.
    exec 3< <(exec sleep 600)
    local idle=$!
    "$GC_SUP" "${opts[@]}" --time-limit "$((GC_STEP_LIMIT + 30))s" --run-dir "$dir" <&3 >"$dir.console" 2>&1 &
    local sup=$!
    py isolation "$dir" "$sup" "$(( $(date +%s) + GC_STEP_LIMIT - 15 ))"
    kill -TERM "$sup" 2>/dev/null
    wait "$sup" 2>/dev/null
    kill "$idle" 2>/dev/null
    exec 3<&-
    keep_run isolation
}

step_eval() {
    local run="$GC_WORK/runs/pipeline" p="$GC_WORK/eval-prompts.jsonl" n=64
    [ "$GC_MODE" = emulated ] && n=8
    py eval-prompts "$p"
    local -a args=(eval --target "$run/target" --drafter "$run/drafter" --prompts "$p" --max-new-tokens "$n" --json)
    echo "\$ dflash-supervise ${args[*]} --gpus 0"
    "$GC_SUP" "${args[@]}" --gpus 0 </dev/null >"$GC_WORK/eval-gpu.json" 2>"$GC_WORK/eval-gpu.err"
    local rc_gpu=$?
    cat "$GC_WORK/eval-gpu.err"
    echo "\$ dflash-supervise ${args[*]}"
    "$GC_SUP" "${args[@]}" </dev/null >"$GC_WORK/eval-cpu.json" 2>"$GC_WORK/eval-cpu.err"
    local rc_cpu=$?
    py eval "$rc_gpu" "$rc_cpu" "$GC_WORK/eval-gpu.json" "$GC_WORK/eval-cpu.json" "$GC_WORK/eval-gpu.err"
}

step_bench_ops() {
    local preset=qwen3-8b
    [ "$GC_MODE" = emulated ] && preset=tiny
    echo "\$ dflash-supervise bench compute --target ops:$preset --json"
    "$GC_SUP" bench compute --target "ops:$preset" --json </dev/null >"$GC_WORK/bench-ops.json" 2>"$GC_WORK/bench-ops.err"
    local rc=$?
    cat "$GC_WORK/bench-ops.err"
    py bench-ops "$rc" "$GC_WORK/bench-ops.json" "$GC_WORK/bench-ops.err"
}

# ------------------------------------------------------------------------------------
# The parent.

# run_step NAME LIMIT_S: the step in a child process under timeout, within the budget.
run_step() {
    local name=$1 limit=$2 left t0
    left=$((GC_DEADLINE - $(date +%s)))
    if ((left < 20)); then
        py record "$name" skip "not run: the check's ${GC_BUDGET_S} s budget is spent"
        py report-step "$name"
        py assemble --partial "${GC_STEPS[@]}"
        return
    fi
    ((limit > left)) && limit=$left
    printf '== %-24s ' "$name"
    t0=$(date +%s.%N)
    # In the background, so that a signal to this script reaches the step (see on_signal).
    GC_STEP_LIMIT=$limit timeout -k 10 "$limit" "$SELF" --run-step "$name" >"$GC_OUT/logs/$name.log" 2>&1 &
    GC_STEP_PID=$! GC_STEP_NAME=$name
    wait "$GC_STEP_PID"
    local rc=$?
    GC_STEP_PID="" GC_STEP_NAME=""
    py finish-step "$name" "$rc" "$t0" "$limit"
    # What was measured so far, should the check be killed before the end.
    py assemble --partial "${GC_STEPS[@]}"
}

# SIGTERM/SIGINT/SIGHUP: stop the running step as its timeout would (timeout passes the
# signal to the step's process group, whose runs stop their workers), then say what was done.
GC_STEP_PID="" GC_STEP_NAME=""
on_signal() {
    trap - TERM INT HUP
    echo
    echo "gpu_check: stopped by a signal" >&2
    if [ -n "$GC_STEP_PID" ]; then
        kill -TERM "$GC_STEP_PID" 2>/dev/null
        local i
        for i in $(seq 1 30); do
            kill -0 "$GC_STEP_PID" 2>/dev/null || break
            sleep 0.5
        done
        # timeout leads its own process group: whatever is left of the step goes with it.
        kill -KILL -- "-$GC_STEP_PID" 2>/dev/null
        py record "$GC_STEP_NAME" fail "stopped by a signal while it ran"
    fi
    py assemble --stopped "${GC_STEPS[@]}"
    exit 1
}

# Without python3 or timeout nothing else can be said: a results.json by hand.
bare_exit() {
    local reason=$1
    echo "gpu_check: cannot run: $reason" >&2
    if [ -n "${GC_OUT:-}" ] && mkdir -p "$GC_OUT"; then
        printf '{"exit_code": 2, "verdict": "cannot run", "reason": "%s", "steps": [], "parity": [], "bench": []}\n' "${reason//\"/\'}" >"$GC_OUT/results.json"
    fi
    exit 2
}

# The first of the candidates that is an executable file.
first_exe() {
    local p
    for p in "$@"; do
        [ -f "$p" ] && [ -x "$p" ] && { echo "$p"; return 0; }
    done
    return 1
}

main() {
    local mode=gpu out="" sup=""
    while [ $# -gt 0 ]; do
        case $1 in
            --emulated) mode=emulated ;;
            --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a directory" >&2; exit 2; }; out=$2; shift ;;
            --out=*) out=${1#--out=} ;;
            -h | --help) usage; exit 0 ;;
            -*) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
            *) sup=$1 ;;
        esac
        shift
    done
    out=${out:-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
    mkdir -p "$out" || { echo "gpu_check: cannot create $out" >&2; exit 2; }
    export GC_MODE=$mode GC_OUT
    GC_OUT=$(cd "$out" && pwd)
    local budget limits
    if [ "$mode" = emulated ]; then
        budget=$GC_BUDGET_EMULATED limits=$GC_LIMITS_EMULATED
    else
        budget=$GC_BUDGET_GPU limits=$GC_LIMITS_GPU
    fi
    export GC_BUDGET_S=${GPU_CHECK_BUDGET_S:-$budget}
    # The steps end by here, 5 s before the budget's end, for the last results.
    export GC_DEADLINE=$(($(date +%s) + GC_BUDGET_S - 5))
    command -v timeout >/dev/null || bare_exit "timeout (coreutils) not found"
    command -v python3 >/dev/null || bare_exit "python3 not found (it reads the runs' JSON)"

    # Results of an earlier check in the same folder go; the kernel cache stays.
    rm -rf "$GC_OUT/steps" "$GC_OUT/logs" "$GC_OUT/runs" "$GC_OUT/results.json" "$GC_OUT/results.md"
    mkdir -p "$GC_OUT/steps" "$GC_OUT/logs"
    export GC_WORK
    GC_WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
    trap 'rm -rf "$GC_WORK"' EXIT
    write_helper

    # The binaries: the bundle beside this script, else this checkout's builds (--emulated:
    # the workspace's debug build first, which the tests use and which has the emulated
    # stack beside it).
    local root t
    root=$(cd "$HERE/.." && pwd)
    if [ -z "$sup" ]; then
        t=$root/target
        if [ "$mode" = emulated ]; then
            sup=$(first_exe "$HERE/dflash-supervise" "$t/debug/dflash-supervise" "$t/release/dflash-supervise" "$t/gpu-bundle/dflash-supervise") || sup=""
        else
            sup=$(first_exe "$HERE/dflash-supervise" "$t/gpu-bundle/dflash-supervise" "$t/release/dflash-supervise" "$t/debug/dflash-supervise") || sup=""
        fi
    fi
    export GC_SUP="" GC_WORKER="" GC_PARITY="" GC_HERE=$HERE
    [ -n "$sup" ] && [ -x "$sup" ] && GC_SUP=$(readlink -f "$sup")
    local bindir=${GC_SUP%/*}
    [ -n "$GC_SUP" ] && GC_WORKER=$(first_exe "$bindir/dflash-worker") || GC_WORKER=""
    # The parity executable: the bundle's, else cargo's newest build of worker/tests/host_device.rs.
    local newest="" f
    for f in "$bindir"/deps/host_device-*; do
        [ -x "$f" ] && [ "${f%.d}" = "$f" ] && { [ -z "$newest" ] || [ "$f" -nt "$newest" ]; } && newest=$f
    done
    GC_PARITY=$(first_exe "$bindir/host_device" "$newest") || GC_PARITY=""

    local reason=""
    if [ -z "$GC_SUP" ]; then
        reason="dflash-supervise not found (scripts/gpu_bundle.sh, or pass its path)"
    elif [ -z "$GC_WORKER" ]; then
        reason="dflash-worker not found beside $GC_SUP"
    elif [ -z "$GC_PARITY" ]; then
        reason="the parity test executable (host_device) is not beside $GC_SUP nor in $bindir/deps (scripts/gpu_bundle.sh, or cargo test -p dflash-worker --test host_device --no-run)"
    fi
    [ -z "$reason" ] && reason=$(binaries_start)
    [ -z "$reason" ] && setup_device "$bindir"
    py facts-start "$mode" "$GC_SUP" "$GC_WORKER" "$GC_PARITY"
    # The steps, in order, and each one's limit (s).
    local -A limit
    local -a pairs
    local s
    read -ra pairs <<<"$limits"
    GC_STEPS=()
    local total=0
    for s in "${pairs[@]}"; do
        GC_STEPS+=("${s%%=*}")
        limit[${s%%=*}]=${s#*=}
        total=$((total + ${s#*=}))
    done
    if ((total + GC_RESERVE_S > GC_BUDGET_S)); then
        echo "gpu_check: the steps' limits ($total s) and ${GC_RESERVE_S} s for the script exceed the ${GC_BUDGET_S} s budget: the last steps get what is left" >&2
    fi
    if [ -n "$reason" ]; then
        py assemble --cannot "$reason" "${GC_STEPS[@]}"
        exit $?
    fi

    local steps=("${GC_STEPS[@]}")
    trap on_signal TERM INT HUP
    echo "gpu_check ($mode): $GC_SUP; results in $GC_OUT; budget $GC_BUDGET_S s"
    # A results.json from the start: every step still to run.
    py assemble --partial "${steps[@]}"
    run_step preflight "${limit[preflight]}"
    if py is-fatal preflight; then
        py assemble --cannot-from preflight "${steps[@]}"
        exit $?
    fi
    for s in "${steps[@]:1}"; do
        run_step "$s" "${limit[$s]}"
    done
    py assemble "${steps[@]}"
    exit $?
}

# Why one of the binaries does not start here, if one does not (a glibc or libstdc++ older
# than the build machine's: the bundle's MANIFEST says which it needs).
binaries_start() {
    local err
    err=$(timeout 60 "$GC_SUP" --version 2>&1 >/dev/null) || { echo "$GC_SUP does not run here: ${err:0:400}"; return; }
    err=$(timeout 60 "$GC_WORKER" --version 2>&1 >/dev/null) || { echo "$GC_WORKER does not run here: ${err:0:400}"; return; }
    err=$(timeout 60 "$GC_PARITY" --list 2>&1 >/dev/null) || { echo "$GC_PARITY does not run here: ${err:0:400}"; return; }
}

# The device the steps run on, set up in the environment; sets `reason` (main's) when it
# cannot be used.
setup_device() {
    local bindir=$1
    unset DFLASH_DEVICE DFLASH_TEST_DEVICE
    export DFLASH_KERNEL_CACHE="$GC_OUT/kernel-cache"
    # The bundle's CUBINs (scripts/gpu_bundle.sh): what is already there stays.
    mkdir -p "$DFLASH_KERNEL_CACHE"
    if [ -d "$GC_HERE/kernel-cache" ]; then
        cp -n "$GC_HERE"/kernel-cache/kernels-* "$DFLASH_KERNEL_CACHE/" 2>/dev/null
    fi
    ls "$DFLASH_KERNEL_CACHE" >"$GC_WORK/kernel-cache-before.txt" 2>/dev/null
    # Every step on the same GPU: NVML's index 0 is the supervisor's GPU 0.
    export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0
    if [ "$GC_MODE" = gpu ]; then
        if [ ! -e /dev/nvidia0 ] && [ ! -d /proc/driver/nvidia/gpus ]; then
            reason="no NVIDIA GPU on this machine (no /dev/nvidia0, no /proc/driver/nvidia/gpus); --emulated checks this script on the emulated stack"
        fi
        return 0
    fi
    # The emulated stack: target/<profile>/ of a workspace build, or the bundle's emu/.
    local d lib=""
    for d in "$bindir" "$bindir/emu"; do
        [ -f "$d/libdflash_emu_cuda.so" ] && [ -f "$d/libdflash_emu_cublas.so" ] && [ -f "$d/libdflash_fake_nvml.so" ] && { lib=$d; break; }
    done
    if [ -z "$lib" ]; then
        reason="the emulated CUDA stack (libdflash_emu_cuda.so, libdflash_emu_cublas.so, libdflash_fake_nvml.so) is not beside $GC_SUP: cargo build --workspace"
        return 0
    fi
    export DFLASH_CUDA_LIB="$lib/libdflash_emu_cuda.so" DFLASH_CUBLAS_LIB="$lib/libdflash_emu_cublas.so" DFLASH_NCCL_LIB="$lib/libdflash_emu_cuda.so"
    export DFLASH_NVML_LIBRARY="$lib/libdflash_fake_nvml.so" DFLASH_FAKE_NVML="$GC_WORK/nvml.json"
    # One GPU with every field the sampler reads, so the telemetry check has them all.
    cat >"$DFLASH_FAKE_NVML" <<'JSON'
{"driver": "emulated", "devices": [{"name": "Emulated GPU (fake NVML)", "uuid": "GPU-e0000000-0000-0000-0000-000000000000",
  "memory_total": 17179869184, "memory_used": 1073741824, "util_gpu": 50, "util_mem": 20, "power_mw": 300000,
  "power_limit_mw": 700000, "energy_mj": 5000, "temp_c": 50, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619,
  "pcie_tx_kbps": 100, "pcie_rx_kbps": 200, "ecc_corrected": 0, "ecc_uncorrected": 0, "throttle_mask": 0}]}
JSON
}

# The helper that reads what the runs wrote and writes the results (python3: JSON).
write_helper() {
    cat >"$GC_WORK/helper.py" <<'PY'
import glob, json, os, re, signal, subprocess, sys, time

OUT, WORK, MODE = os.environ["GC_OUT"], os.environ["GC_WORK"], os.environ.get("GC_MODE", "gpu")


def load(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def save(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
    os.replace(tmp, path)


def save_text(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def jsonl(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass  # a line cut off by a kill
    except OSError:
        pass
    return rows


def tail(path, n=8, width=400):
    try:
        with open(path, errors="replace") as f:
            lines = [l.rstrip("\n")[:width] for l in f]
    except OSError:
        return []
    return lines[-n:]


def step_file(name):
    return os.path.join(OUT, "steps", name + ".json")


def record(name, status, summary, details=None, quiet=False, **extra):
    d = {"name": name, "status": status, "summary": summary, "details": details or {}}
    d.update(extra)
    save(step_file(name), d)
    if not quiet:
        print(f"{name}: {status}: {summary}")
    return d


def run_dir(name):
    return os.path.join(WORK, "runs", name)


def log_lines(path):
    """A worker log's lines without their time and stream prefix."""
    out = []
    try:
        with open(path, errors="replace") as f:
            for l in f:
                m = re.match(r"^\S+ (?:stdout|stderr|supervisor) (.*)$", l.rstrip("\n"))
                out.append(m.group(1) if m else l.rstrip("\n"))
    except OSError:
        pass
    return out


LIB_KEYS = {"the NVIDIA driver (libcuda)": "driver", "cuBLAS": "cublas", "NVRTC (CUDA's run-time compiler)": "nvrtc", "NCCL": "nccl"}


def gpu_report(path):
    """What a worker printed when it opened its GPU: the device, each library's file and
    version, how the kernels were loaded."""
    lines = log_lines(path)
    for i, l in enumerate(lines):
        if l.startswith("GPU: "):
            rep = {"device": l[5:], "libraries": {}, "kernels": None, "lines": [l]}
            for m in lines[i + 1:]:
                if not m.startswith("  "):
                    break
                rep["lines"].append(m)
                key, _, rest = m.strip().partition(": ")
                if key == "kernels":
                    rep["kernels"] = rest
                elif key in LIB_KEYS:
                    mm = re.match(r"^(.*?) \((.*)\)$", rest)
                    if rest.startswith("not loaded"):
                        rep["libraries"][LIB_KEYS[key]] = {"path": None, "version": None, "error": rest}
                    else:
                        rep["libraries"][LIB_KEYS[key]] = {"path": mm.group(1) if mm else rest, "version": mm.group(2) if mm else None}
            return rep
    return None


def console_reason(name):
    """The line of a run's console that says why it failed."""
    lines = tail(run_dir(name) + ".console", 200, 1000)
    for pat in ("run failed:", "error:", "cannot", "panicked"):
        for l in reversed(lines):
            if pat in l:
                return l.strip()
    return lines[-1].strip() if lines else "no output"


def give_up(name):
    """A worker's permanent failure (exit 11: the GPU cannot be used), if any."""
    for e in jsonl(os.path.join(run_dir(name), "events.jsonl")):
        if e.get("event") == "give_up" and e.get("permanent"):
            return f"{e.get('worker')}: {e.get('last_exit')}"
    return None


# ---- facts ---------------------------------------------------------------------------

def cmd_facts_start(mode, sup, worker, parity):
    u = os.uname()
    version = ""
    if sup:
        try:
            version = subprocess.run([sup, "--version"], capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    save(os.path.join(WORK, "facts.json"), {
        "mode": mode, "host": u.nodename, "kernel": u.release, "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "binaries": {"supervise": sup or None, "worker": worker or None, "parity": parity or None, "version": version},
        "bundle_manifest": open(os.path.join(os.environ["GC_HERE"], "MANIFEST")).read().splitlines() if os.path.isfile(os.path.join(os.environ.get("GC_HERE", "/nonexistent"), "MANIFEST")) else None,
        "emulated": {k: os.environ[k] for k in ("DFLASH_CUDA_LIB", "DFLASH_CUBLAS_LIB", "DFLASH_NCCL_LIB", "DFLASH_NVML_LIBRARY") if k in os.environ} if mode == "emulated" else None,
    })


def smi_facts(path):
    """The first GPU of `nvidia-smi -q -x`: name, versions, MIG, clocks, memory, power."""
    import xml.etree.ElementTree as ET
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    g = root.find("gpu")

    def get(node, *paths):
        for p in paths:
            x = node.find(p) if node is not None else None
            if x is not None and (x.text or "").strip():
                return x.text.strip()
        return None

    f = {"source": "nvidia-smi", "driver_version": get(root, "driver_version"), "cuda_version": get(root, "cuda_version"), "gpus": get(root, "attached_gpus")}
    if g is not None:
        f.update({
            "name": get(g, "product_name"),
            "uuid": get(g, "uuid"),
            "pci_bus_id": get(g, "pci/pci_bus_id"),
            "mig_mode": get(g, "mig_mode/current_mig"),
            "persistence_mode": get(g, "persistence_mode"),
            "compute_mode": get(g, "compute_mode"),
            "memory_total": get(g, "fb_memory_usage/total"),
            "power_limit": get(g, "gpu_power_readings/current_power_limit", "power_readings/power_limit"),
            "performance_state": get(g, "performance_state"),
            "clocks": {
                "sm": get(g, "clocks/sm_clock"), "graphics": get(g, "clocks/graphics_clock"), "mem": get(g, "clocks/mem_clock"),
                "max_sm": get(g, "max_clocks/sm_clock"), "max_mem": get(g, "max_clocks/mem_clock"),
                "applications_graphics": get(g, "applications_clocks/graphics_clock"),
            },
            "clock_event_reasons_active": sorted(x.tag for x in (g.find("clocks_event_reasons") or g.find("clocks_throttle_reasons") or []) if (x.text or "").strip() == "Active"),
        })
    return f


def cmd_preflight(run_rc):
    run_rc = int(run_rc)
    facts = load(os.path.join(WORK, "facts.json"), {})
    smi = smi_facts(os.path.join(WORK, "nvidia-smi.xml")) if MODE == "gpu" else None
    nvml = load(os.path.join(WORK, "gpus.json"))
    d = run_dir("preflight")
    workers = {w: gpu_report(os.path.join(d, "logs", w + ".log")) for w in ("target-0", "drafter-0")}
    rep = workers.get("target-0") or workers.get("drafter-0")
    gpu = dict(smi) if smi else {"source": "NVML (fake)" if MODE == "emulated" else "NVML", "note": "no nvidia-smi" if MODE == "gpu" else "emulated: nvidia-smi has nothing to say"}
    if nvml and nvml.get("gpus"):
        g0 = nvml["gpus"][0]
        gpu.setdefault("name", g0.get("name"))
        gpu.setdefault("driver_version", nvml.get("driver"))
        gpu.setdefault("memory_total", g0.get("memory_total_bytes"))
        gpu.setdefault("mig_mode", "n/a" if MODE == "emulated" else None)
    # Clocks as the supervisor's NVML sampler saw them during the run.
    for m in jsonl(os.path.join(d, "metrics.jsonl")):
        gs = (m.get("gpu") or {}).get("gpus") or []
        if gs and gs[0].get("sm_clock_mhz"):
            gpu["nvml_clocks_mhz"] = {"sm": gs[0]["sm_clock_mhz"].get("max"), "mem": (gs[0].get("mem_clock_mhz") or {}).get("max")}
    if rep:
        cuda = re.search(r"driver for CUDA ([0-9.]+)", json.dumps(rep["libraries"].get("driver") or {}))
        gpu["worker_device"] = rep["device"]
        gpu["worker_driver_cuda"] = cuda.group(1) if cuda else None
    # The kernel cache: what the bundle brought, what was compiled here (nothing, when the
    # bundle has the GPU's architecture), and the entry of the architecture the workers
    # loaded (its NVRTC version and PTX ISA).
    cache = os.path.join(OUT, "kernel-cache")
    before = set(l.strip() for l in open(os.path.join(WORK, "kernel-cache-before.txt")) if l.strip()) if os.path.exists(os.path.join(WORK, "kernel-cache-before.txt")) else set()
    now = sorted(os.path.basename(p) for p in glob.glob(os.path.join(cache, "kernels-*")))
    loaded = re.search(r"(sm_\d+|compute_\d+)", (rep or {}).get("kernels") or "")
    nvrtc, ptx, arch = None, None, loaded.group(1) if loaded else None
    for p in sorted(glob.glob(os.path.join(cache, "kernels-*.ptx")), key=os.path.getmtime):
        m = re.search(r"-(sm_\d+|compute_\d+)-nvrtc([0-9.]+)\.ptx$", p)
        if not m or (arch and m.group(1) != arch):
            continue
        arch, nvrtc = m.group(1), m.group(2)
        try:
            with open(p) as f:
                for line in f:
                    if line.startswith(".version"):
                        ptx = line.split()[1]
                        break
        except OSError:
            pass
    worker_nvrtc = (((rep or {}).get("libraries") or {}).get("nvrtc") or {}).get("version")
    facts.update({"gpu": gpu, "nvml": nvml, "worker": rep, "workers_reporting": sorted(w for w, r in workers.items() if r),
                  "nvrtc_version": worker_nvrtc or nvrtc, "ptx_isa": ptx, "kernel_arch": arch,
                  "kernel_cache": {"from_bundle": sorted(before), "compiled_here": [f for f in now if f not in before], "nvrtc_of_entry": nvrtc}})
    save(os.path.join(WORK, "facts.json"), facts)
    fatal = give_up("preflight")
    if fatal:
        return record("preflight", "fail", f"the GPU cannot be used: {fatal}", facts, fatal=True)
    if not nvml or not nvml.get("gpus"):
        return record("preflight", "fail", "NVML reports no GPU: " + " ".join(tail(os.path.join(WORK, "gpus.err"), 2)), facts, fatal=True)
    missing = [w for w, r in workers.items() if not r]
    if run_rc != 0 or missing:
        why = console_reason("preflight") if run_rc != 0 else f"{', '.join(missing)} printed no 'GPU:' line (did it compute on its GPU?)"
        return record("preflight", "fail", f"a two-step run failed (exit {run_rc}): {why}", facts)
    libs = rep["libraries"]
    # NVRTC is needed only where the kernels are not in the cache (the bundle brings them).
    bad = [k for k in ("driver", "cublas") if not (libs.get(k) or {}).get("path")]
    if bad:
        return record("preflight", "fail", f"libraries not loaded: {', '.join(bad)}", facts, fatal=True)
    nvrtc_note = f"NVRTC {facts['nvrtc_version']}" if (libs.get("nvrtc") or {}).get("path") else "no NVRTC here (the kernels came from the cache)"
    summary = f"{gpu.get('name') or rep['device']}; driver {gpu.get('driver_version')}"
    summary += f" (CUDA {gpu.get('cuda_version') or gpu.get('worker_driver_cuda')}); MIG {gpu.get('mig_mode')}; {rep['kernels']}; {nvrtc_note}, PTX ISA {ptx}"
    kc = facts["kernel_cache"]
    summary += f"; kernels compiled here: {len(kc['compiled_here']) // 2}" + (f" (the bundle brought {len(kc['from_bundle']) // 2})" if kc["from_bundle"] else "")
    return record("preflight", "pass", summary, facts)


def cmd_is_fatal(name):
    sys.exit(0 if load(step_file(name), {}).get("fatal") else 1)


# ---- parity --------------------------------------------------------------------------

RESULT = re.compile(r"^test (\S+) \.\.\. (ok|FAILED|ignored.*)$")
START = re.compile(r"test (\S+) \.\.\. $")


def run_tests(exe, names, deadline, stderr_path):
    """Run `names` in one process, one at a time; yields (name, status, seconds) as each
    ends, from libtest's `test NAME ... ` (printed when a test starts) and its result.
    Returns (results, (the test running when the process ended, its seconds), exit code,
    stdout, whether the deadline killed it)."""
    err = open(stderr_path, "ab")
    err_from = err.tell()
    p = subprocess.Popen([exe, "--test-threads", "1", "--exact", *names], stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    buf, text, started, current, results = b"", [], {}, None, []
    os.set_blocking(p.stdout.fileno(), False)
    timed_out = False
    while True:
        if time.time() > deadline and not timed_out:
            timed_out = True
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            chunk = p.stdout.read()
        except (OSError, ValueError):
            chunk = None
        if chunk:
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                s = line.decode(errors="replace")
                text.append(s)
                m = RESULT.match(s)
                if m:
                    name, r = m.group(1), m.group(2)
                    t = max(0.0, time.time() - started.get(name, time.time()))
                    results.append((name, {"ok": "pass", "FAILED": "fail"}.get(r, "skip"), round(t, 3)))
                    current = None
            m = START.search(buf.decode(errors="replace"))
            if m and m.group(1) not in started:
                current = m.group(1)
                started[current] = time.time()
        elif p.poll() is not None:
            break
        else:
            time.sleep(0.02)
    if buf:
        text.append(buf.decode(errors="replace"))
    err.close()
    rc = p.wait()
    ran = round(time.time() - started[current], 3) if current else None
    with open(stderr_path, "rb") as f:
        f.seek(err_from)
        err_text = f.read().decode(errors="replace")
    return results, (current, ran), rc, "\n".join(text), err_text, timed_out


def failure_blocks(stdout):
    """libtest's '---- NAME stdout ----' sections: what each failed test printed."""
    out = {}
    for m in re.finditer(r"^---- (\S+) stdout ----\n(.*?)(?=^---- \S+ stdout ----|^failures:\s*$|\Z)", stdout, re.S | re.M):
        out[m.group(1)] = m.group(2).strip()
    return out


def essence(text, n=12):
    """The lines of a test's output that say why it failed (panic message first)."""
    lines = [l for l in text.splitlines() if l.strip()]
    for i, l in enumerate(lines):
        if "panicked at" in l:
            return "\n".join(lines[i:i + 3])[:1500]
    return "\n".join(lines[-n:])[:1500]


def cmd_parity(exe, deadline):
    deadline = float(deadline)
    listing = subprocess.run([exe, "--list"], capture_output=True, text=True, timeout=60)
    tests = [l[:-len(": test")] for l in listing.stdout.splitlines() if l.endswith(": test")]
    if not tests:
        return record("parity", "fail", f"{exe} --list gave no tests (exit {listing.returncode}): {listing.stderr.strip()[:300]}", {"exe": exe})
    rows = {t: {"name": t, "status": "skip", "seconds": None, "note": "not run"} for t in tests}
    errpath = os.path.join(OUT, "logs", "parity-stderr.txt")
    outpath = os.path.join(OUT, "logs", "parity-stdout.txt")
    remaining, outputs = list(tests), {}
    # A quarter of the time (45 s at most) is kept for re-running failures.
    first_deadline = deadline - min(45.0, 0.25 * max(0.0, deadline - time.time()))
    # One process for all (opening a GPU costs seconds); when one dies (an abort, a
    # segfault), its test is the one that killed it and the rest run in a new process.
    while remaining and time.time() < first_deadline:
        results, (crashed, ran), rc, stdout, stderr, timed_out = run_tests(exe, remaining, first_deadline, errpath)
        with open(outpath, "a") as f:
            f.write(stdout + "\n")
        outputs.update(failure_blocks(stdout))
        for name, status, secs in results:
            rows[name].update(status=status, seconds=secs, note="")
        done = {r[0] for r in results}
        if crashed:
            why = "timed out (the step's budget)" if timed_out else f"the test process died ({'signal ' + str(-rc) if rc < 0 else 'exit ' + str(rc)}) while it ran"
            rows[crashed].update(status="fail", seconds=ran, note=why, timed_out=timed_out)
            outputs[crashed] = "timed out" if timed_out else "\n".join(stderr.splitlines()[-15:])
            done.add(crashed)
        left = [t for t in remaining if t not in done]
        if left and not results and not crashed:
            for t in left:
                rows[t]["note"] = f"not run: the test executable exited ({rc}) first: " + " | ".join(stderr.splitlines()[-3:])[:600]
                rows[t]["status"] = "fail"
            break
        remaining = left
        if timed_out:
            break
    for r in rows.values():
        if r["status"] == "skip" and r["note"] == "not run":
            r["note"] = "not run: the step's time ran out"
    # Each failure once more, alone, with every launch synchronous: the error then names
    # the kernel that faulted, not a later call.
    for t in tests:
        r = rows[t]
        if r["status"] != "fail":
            continue
        r["output"] = essence(outputs.get(t, ""))
        left = deadline - time.time()
        if r.pop("timed_out", False) or left < 5:
            r["rerun"] = {"status": "skip", "note": "no time left"}
            continue
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
        t0 = time.time()
        try:
            p = subprocess.run([exe, "--exact", t, "--nocapture", "--test-threads", "1"], capture_output=True, text=True, env=env, timeout=min(120, left), start_new_session=True)
            ok = p.returncode == 0 and re.search(rf"^test {re.escape(t)} \.\.\. ok$", p.stdout, re.M) is not None
            r["rerun"] = {"status": "pass" if ok else "fail", "seconds": round(time.time() - t0, 3), "env": "CUDA_LAUNCH_BLOCKING=1", "output": essence(p.stdout + "\n" + p.stderr, 20)}
        except subprocess.TimeoutExpired:
            r["rerun"] = {"status": "fail", "seconds": round(time.time() - t0, 3), "env": "CUDA_LAUNCH_BLOCKING=1", "output": "timed out"}
    rows = [rows[t] for t in tests]
    n = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skip")}
    failed = [r["name"] for r in rows if r["status"] == "fail"]
    status = "pass" if n["pass"] > 0 and not failed and not n["skip"] else "fail"
    summary = f"{len(rows)} tests: {n['pass']} pass, {n['fail']} fail, {n['skip']} not run"
    if failed:
        again = {s: sum((r.get("rerun") or {}).get("status") == s for r in rows) for s in ("pass", "fail", "skip")}
        summary += f" ({', '.join(failed[:3])}{', ...' if len(failed) > 3 else ''}); again with CUDA_LAUNCH_BLOCKING=1: {again['fail']} fail, {again['pass']} pass"
        if again["skip"]:
            summary += f", {again['skip']} not re-run (no time)"
    record("parity", status, summary, {"exe": exe, "env": "DFLASH_TEST_DEVICE=cuda", "counts": n}, rows=rows)


# ---- pipelines -----------------------------------------------------------------------

REQUIRED_NVML = ["util_gpu_pct", "util_mem_pct", "mem_used_bytes", "mem_total_bytes", "power_w", "temp_c", "sm_clock_mhz", "mem_clock_mhz"]
OTHER_NVML = ["power_limit_w", "energy_j", "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s", "ecc_corrected_volatile", "ecc_uncorrected_volatile"]


def step_timing(rows):
    """ms per step and trained tokens/s, the first two steps (warm-up) left out."""
    if len(rows) < 4:
        return None, None
    span = (rows[-1]["t"] - rows[1]["t"]) / 1000.0
    steps = len(rows) - 2
    tokens = sum(r.get("tokens", 0) for r in rows[2:])
    return round(1000 * span / max(steps, 1), 2), round(tokens / max(span, 1e-9), 1)


def cmd_pipeline(name, rc, ledger_rc, want):
    rc, ledger_rc, want = int(rc), int(ledger_rc), int(want)
    kind = "nccl" if name == "pipeline-nccl" else "telemetry"
    d = run_dir(name)
    rows = [r for r in jsonl(os.path.join(d, "train.jsonl")) if "step" in r]
    windows = jsonl(os.path.join(d, "metrics.jsonl"))
    ms, tps = step_timing(rows)
    workers = {w: gpu_report(os.path.join(d, "logs", w + ".log")) for w in ("target-0", "drafter-0")}
    det = {"exit_code": rc, "steps": len(rows), "final_loss": rows[-1].get("loss") if rows else None, "ms_per_step": ms, "tokens_per_s": tps,
           "ledger_exit_code": ledger_rc, "ledger": load(os.path.join(WORK, f"ledger-{name}.json")),
           "workers_on_gpu": {w: (r or {}).get("device") for w, r in workers.items()}, "metrics_windows": len(windows)}
    problems = []
    if rc != 0:
        problems.append(f"exit {rc}: {console_reason(name)}")
    if len(rows) < want:
        problems.append(f"{len(rows)} of {want} steps in train.jsonl")
    if ledger_rc != 0:
        problems.append(f"the ledger's audit failed (exit {ledger_rc})")
    for w, r in workers.items():
        if not r:
            problems.append(f"{w} printed no 'GPU:' line")
    samples = [g for m in windows for g in ((m.get("gpu") or {}).get("gpus") or []) if (m.get("gpu") or {}).get("samples")]
    det["gpu_samples"] = sum((m.get("gpu") or {}).get("samples") or 0 for m in windows)
    cuda_mem = {}
    for m in windows:
        cuda_mem.update((m.get("pipeline") or {}).get("cuda_memory_by_worker") or {})
    det["cuda_memory_by_worker"] = cuda_mem
    if kind == "telemetry":
        present = {f: any(g.get(f) is not None for g in samples) for f in REQUIRED_NVML + OTHER_NVML}
        det["nvml_fields"] = present
        det["nvml_process_mem"] = next((g.get("process_mem_bytes") for g in reversed(samples) if g.get("process_mem_bytes")), None)
        det["throttle_reasons"] = sorted({r for g in samples for r in (g.get("throttle_reasons") or [])})
        det["xid_errors"] = sorted({x for g in samples for x in (g.get("xid_errors") or [])})
        if not samples:
            problems.append("no metrics window holds an NVML sample")
        missing = [f for f in REQUIRED_NVML if not present[f]]
        if samples and missing:
            problems.append("NVML fields missing: " + ", ".join(missing))
        if det["xid_errors"]:
            problems.append(f"XID errors: {det['xid_errors']}")
        # Targets report their device arena with their heartbeats (drafters do not yet).
        if "target-0" not in cuda_mem:
            problems.append("no CUDA memory figures from target-0")
    elif kind == "nccl":
        lines = log_lines(os.path.join(d, "logs", "drafter-0.log"))
        det["collective"] = next((l.split("gradients exchanged through ", 1)[1] for l in lines if "gradients exchanged through " in l), None)
        # The drafter says which NCCL it loaded ("  NCCL: PATH (VERSION)", on stderr).
        lib = next((m for m in (re.match(r"^\s*NCCL: (.*) \((.*)\)$", l) for l in lines) if m), None)
        det["nccl_library"] = {"path": lib.group(1), "version": lib.group(2)} if lib else None
        reduce = sorted(r.get("reduce_ms", 0) for r in rows[2:])
        det["reduce_ms_median"] = round(reduce[len(reduce) // 2], 3) if reduce else None
        if rc != 0 and "nccl" in console_reason(name).lower():
            problems.insert(0, "NCCL: " + console_reason(name) + (" (the emulated stack's NCCL is tests/emu-cuda's: not there yet?)" if MODE == "emulated" else " (pip install nvidia-nccl-cu13, or DFLASH_NCCL_LIB)"))
        elif rc == 0 and det["collective"] != "NCCL":
            problems.append(f"the drafter exchanged gradients through {det['collective']!r}, not NCCL")
    if problems:
        return record(name, "fail", "; ".join(problems), det)
    summary = f"{len(rows)} steps, {ms} ms/step, {tps} tokens/s, loss {det['final_loss']:.3f}"
    if kind == "telemetry":
        summary += f"; {det['gpu_samples']} NVML samples, fields present: {sum(present.values())}/{len(present)}"
    if kind == "nccl":
        summary += f"; all-reduce median {det['reduce_ms_median']} ms"
        if det["nccl_library"]:
            summary += f"; NCCL {det['nccl_library']['version']} from {det['nccl_library']['path']}"
    return record(name, "pass", summary, det)


# ---- isolation -----------------------------------------------------------------------

NVML = re.compile(r"libnvidia-ml|libdflash_fake_nvml")
CUDA = re.compile(r"libcuda\.so|libcudart|libcublas|libnvrtc|libnccl|libdflash_emu_cuda|libdflash_emu_cublas")
# NVRTC is mapped only where a worker compiled or found it: kernels from the cache need none.
NEEDED = {"driver": re.compile(r"libcuda\.so|libdflash_emu_cuda"), "cublas": re.compile(r"libcublas|libdflash_emu_cublas")}


def mapped(pid):
    libs = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for l in f:
                parts = l.split()
                if len(parts) >= 6 and parts[5].startswith("/"):
                    libs.add(parts[5])
    except OSError:
        return None
    return sorted(libs)


def cmd_isolation(d, sup_pid, deadline):
    deadline = float(deadline)
    sup_pid = int(sup_pid)
    # Every worker up, and each has opened its GPU (its "GPU:" line), before looking.
    state, ready = None, False
    while time.time() < deadline:
        state = load(os.path.join(d, "state.json"))
        ws = (state or {}).get("workers") or []
        if ws and all(w.get("state") == "running" for w in ws) and all(gpu_report(os.path.join(d, "logs", w["name"] + ".log")) for w in ws):
            ready = True
            break
        try:
            os.kill(sup_pid, 0)
        except OSError:
            break
        time.sleep(0.2)
    if not ready:
        return record("isolation", "fail", "the workers did not come up on the GPU: " + " | ".join(tail(d + ".console", 3)), {"state": state})
    time.sleep(1.5)  # the sampler takes a few NVML samples meanwhile
    det = {"supervisor": {"pid": sup_pid}, "workers": []}
    problems = []
    libs = mapped(sup_pid) or []
    det["supervisor"].update(nvml=[l for l in libs if NVML.search(l)], cuda=[l for l in libs if CUDA.search(l)])
    if det["supervisor"]["cuda"]:
        problems.append("the supervisor maps " + ", ".join(det["supervisor"]["cuda"]))
    if not det["supervisor"]["nvml"]:
        problems.append("the supervisor does not map NVML while sampling")
    for w in state["workers"]:
        libs = mapped(w["pid"]) or []
        row = {"name": w["name"], "pid": w["pid"], "nvml": [l for l in libs if NVML.search(l)], "cuda": [l for l in libs if CUDA.search(l)]}
        row["missing"] = [k for k, pat in NEEDED.items() if not any(pat.search(l) for l in libs)]
        det["workers"].append(row)
        if row["nvml"]:
            problems.append(f"{w['name']} maps NVML ({', '.join(row['nvml'])})")
        if row["missing"]:
            problems.append(f"{w['name']} maps no {', '.join(row['missing'])}")
    if problems:
        return record("isolation", "fail", "; ".join(problems), det)
    return record("isolation", "pass", f"supervisor maps {os.path.basename(det['supervisor']['nvml'][0])} and no CUDA library; "
                  + "; ".join(f"{r['name']} maps {len(r['cuda'])} CUDA libraries, no NVML" for r in det["workers"]), det)


# ---- benchmarks ----------------------------------------------------------------------

def last_json(path):
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for l in reversed(lines):
        try:
            v = json.loads(l)
            if isinstance(v, dict):
                return v
        except ValueError:
            pass
    return None


def cmd_eval_prompts(path):
    # Token-id prompts of 5 to 12 tokens inside the tiny target's vocabulary.
    with open(path, "w") as f:
        for i in range(8):
            f.write(json.dumps([(t * 41 + i * 7 + 3) % 500 for t in range(5 + i)]) + "\n")


TIE_REL = 0.04


def compare_first_tokens(gpu, cpu):
    """Each prompt's first token on the GPU against the CPU's, where the CPU's top-2 logit
    margin exceeds TIE_REL of its largest |logit|; the others are ties. A CPU report
    without margins (an older worker) compares every prompt."""
    out = {"bound_rel": TIE_REL, "compared": 0, "same": 0, "ties": [], "differ": []}
    for i, (a, b) in enumerate(zip(gpu, cpu)):
        margin, scale = b.get("first_margin"), b.get("first_logit_max_abs")
        if margin is not None and scale is not None and margin <= TIE_REL * scale:
            out["ties"].append({"prompt": i, "margin": margin, "bound": TIE_REL * scale, "gpu": a["tokens"][:1], "cpu": b["tokens"][:1]})
            continue
        out["compared"] += 1
        if a["tokens"][:1] == b["tokens"][:1]:
            out["same"] += 1
        else:
            out["differ"].append(i)
    return out


def cmd_eval(rc_gpu, rc_cpu, gpu_out, cpu_out, gpu_err):
    rc_gpu, rc_cpu = int(rc_gpu), int(rc_cpu)
    g, c = last_json(gpu_out), last_json(cpu_out)
    if not g:
        return record("eval", "fail", f"no report from eval --gpus 0 (exit {rc_gpu}): " + " | ".join(tail(gpu_err, 3)), {})
    keep = ("device", "prompts", "block_size", "max_new_tokens", "identical_to_greedy", "speculative_tokens_per_s", "greedy_tokens_per_s", "speedup")
    det = {"gpu": {k: g.get(k) for k in keep}, "gpu_tau": g.get("tau"), "cpu_exit_code": rc_cpu,
           "cpu": {k: c.get(k) for k in keep} if c else None, "cpu_tau": c.get("tau") if c else None}
    tau, bs = g["tau"], g["block_size"]
    sane = all(1 <= tau[d] <= bs and tau[d + "_ci95"][0] <= tau[d] <= tau[d + "_ci95"][1] for d in ("pooled", "mean_of_means"))
    # The first token is the prefill's argmax. The GPU computes in bf16: each logit within
    # TIE_REL / 2 of the row's largest |logit| of the CPU's (f32), the bound the parity
    # tests hold the bf16 target forward to, so where the CPU's top two are closer than
    # TIE_REL of it the GPU may pick the other: such a prompt is a tie, not compared.
    first = compare_first_tokens(g["per_prompt"], c["per_prompt"]) if c else None
    det["first_tokens"] = first
    det["same_first_tokens"] = bool(first) and not first["differ"]
    ok = rc_gpu in (0, 1) and g.get("device") == "gpu" and sane and rc_cpu == 0 and det["same_first_tokens"]
    said = "no CPU report" if not first else (f"{first['same']}/{first['compared']} as the CPU's" + (f", {len(first['ties'])} near-ties not compared" if first["ties"] else "")
                                               + (f", prompts {first['differ']} differ" if first["differ"] else ""))
    summary = (f"τ pooled {tau['pooled']:.3f} on the GPU" + (f", {c['tau']['pooled']:.3f} on the CPU" if c else "")
               + f"; {g['identical_to_greedy']}/{g['prompts']} prompts as greedy on the GPU; first tokens: {said}; "
               f"decode {g['speculative_tokens_per_s']:.0f} tokens/s speculative, {g['greedy_tokens_per_s']:.0f} greedy (speedup {g['speedup']:.2f}x)")
    record("eval", "pass" if ok else "fail", summary, det)


def cmd_bench_ops(rc, out, err):
    rc = int(rc)
    f = last_json(out)
    if not f:
        return record("bench-ops", "fail", f"no figures (exit {rc}): " + " | ".join(tail(err, 3)), {})
    rows = f.get("rows") or []
    bad = [r for r in rows if r.get("error")]
    det = {k: f.get(k) for k in ("device", "peak_bf16_tflops", "seconds", "preset")}
    status = "pass" if rc == 0 and rows and not bad else "fail"
    best = max((r for r in rows if r.get("tflops")), key=lambda r: r["tflops"], default=None)
    summary = f"{len(rows)} ops on {f.get('device')}, {len(bad)} failed"
    if bad:
        summary += ": " + "; ".join(f"{r['op']}: {r['error']}" for r in bad[:2])
    elif best:
        summary += f"; fastest {best['op']} ({best['shape']}) {best['tflops']:.3g} TFLOP/s" + (f", {best['pct_peak']:.1f} % of peak" if best.get("pct_peak") is not None else "")
    record("bench-ops", status, summary, det, rows=rows)


def roofline_mfu(model, role, preset):
    """The roofline model's MFU for `role` when it models the preset's shapes, and what
    it says about the match."""
    if not model:
        return None, "no roofline model (scripts/gpu_bundle.sh writes roofline.json beside this script)"
    sh = model.get("shapes") or {}
    same = all(sh.get(k) == preset.get(k) for k in ("hidden", "q_heads", "kv_heads", "head_dim", "intermediate"))
    if role == "target":
        same = same and sh.get("layers") == preset.get("model_layers")
        w = next((w for w in model.get("target_forward") or [] if w.get("name") == f"target forward, {preset.get('tokens')} tokens"), None)
    else:
        same = same and all(sh.get(a) == preset.get(b) for a, b in (("vocab", "vocab"), ("drafter_layers", "drafter_layers"), ("anchors", "anchors"),
                                                                   ("block", "block_size"), ("drafter_context", "tokens")))
        w = model.get("drafter_step")
    hw = (model.get("hardware") or {}).get("name")
    if not same or not w or w.get("mfu") is None:
        return None, f"the roofline models other shapes (Qwen3-8B on {hw})"
    return w["mfu"], f"{w.get('name')} on {hw}"


def cmd_throughput(rc, out, err, roofline):
    rc = int(rc)
    f = last_json(out)
    if not f:
        return record("throughput", "fail", f"no figures (exit {rc}): " + " | ".join(tail(err, 3)), {})
    model = (load(roofline) or {}).get("model") if roofline else None
    preset = f.get("preset") or {}
    rows, problems, parts = [], [], []
    for r in f.get("rows") or []:
        m, note = roofline_mfu(model, r["role"], preset)
        r = dict(r, modelled_mfu=m, modelled_note=note)
        rows.append(r)
        if r.get("error") or not (r.get("tokens_per_s") or 0) > 0:
            problems.append(f"{r['role']}: {r.get('error') or 'no tokens/s'}")
            continue
        pct = lambda v: "-" if v is None else f"{100 * v:.1f} %"
        whole = f" ({r['tokens_per_s_model']:,.0f} for all {r['model_layers']} layers)" if r["model_layers"] != r["layers"] else ""
        parts.append(f"{r['role']} {r['tokens_per_s']:,.0f} tokens/s{whole}, MFU {pct(r.get('mfu'))} (model {pct(m)})")
    roles = sorted(r["role"] for r in rows)
    if roles != ["drafter", "target"]:
        problems.append(f"rows for {roles}, not one per role")
    det = {"device": f.get("device"), "peak_bf16_tflops": f.get("peak_bf16_tflops"), "preset": preset, "seconds": f.get("seconds"),
           "roofline": roofline if model else None}
    if rc != 0 or problems:
        return record("throughput", "fail", f"exit {rc}: " + "; ".join(problems or [" | ".join(tail(err, 2))]), det, rows=rows)
    record("throughput", "pass", f"{f.get('device')}: " + "; ".join(parts), det, rows=rows)


# ---- the parent's bookkeeping ----------------------------------------------------------

def cmd_record(name, status, summary):
    record(name, status, summary, quiet=True)


def cmd_finish_step(name, rc, t0, limit):
    rc, secs = int(rc), round(time.time() - float(t0), 1)
    s = load(step_file(name))
    log = os.path.join(OUT, "logs", name + ".log")
    if rc in (124, 137):
        s = s or {"name": name, "details": {}}
        s.update(status="fail", summary=f"timed out after {limit} s" + (f" (its result so far: {s['summary']})" if s.get("summary") else ""))
    elif s is None:
        s = {"name": name, "status": "fail", "summary": f"ended (exit {rc}) without a result: " + " | ".join(tail(log, 3, 300)), "details": {}}
    s["seconds"] = secs
    save(step_file(name), s)
    print(f"{s['status']:<5} {secs:>6.1f} s  {s['summary'][:160]}")


def cmd_report_step(name):
    s = load(step_file(name), {})
    print(f"== {name:<24} {s.get('status', '?'):<5} {0:>6.1f} s  {s.get('summary', '')[:160]}")


def cell(v):
    return str(v).replace("|", "\\|").replace("\n", " ")


def fmt_num(v, spec):
    return "-" if v is None else format(v, spec)


def cmd_assemble(*args):
    args = list(args)
    cannot, stopped, partial = None, False, False
    if args and args[0] == "--partial":
        partial, args = True, args[1:]
    elif args and args[0] == "--stopped":
        stopped, args = True, args[1:]
    elif args and args[0] == "--cannot":
        cannot, args = args[1], args[2:]
    elif args and args[0] == "--cannot-from":
        cannot = load(step_file(args[1]), {}).get("summary")
        args = args[2:]
    facts = load(os.path.join(WORK, "facts.json"), {})
    steps = []
    for n in args:
        s = load(step_file(n))
        if s is None and partial:
            s = {"name": n, "status": "pending", "summary": "not run yet (the check was running when this was written)", "details": {}}
        elif s is None:
            s = record(n, "skip", "not run: the check cannot run here" if cannot else "not run: the check was stopped" if stopped else "not run", quiet=True)
        steps.append(s)
    parity = next((s.get("rows") for s in steps if s["name"] == "parity"), None) or []
    bench = next((s.get("rows") for s in steps if s["name"] == "bench-ops"), None) or []
    throughput = next((s.get("rows") for s in steps if s["name"] == "throughput"), None) or []
    iso = next((s.get("details") for s in steps if s["name"] == "isolation"), None)
    pre = next((s.get("details") for s in steps if s["name"] == "preflight"), None) or facts
    code = 2 if cannot else (0 if steps and all(s["status"] == "pass" for s in steps) else 1)
    verdict = {0: "pass", 1: "fail", 2: "cannot run"}[code]
    if partial:
        # Written after each step: a check killed midway leaves this.
        code, verdict = None, "incomplete"
    res = {"version": 1, "mode": MODE, "complete": not partial, "exit_code": code, "verdict": verdict,
           "reason": cannot or ("stopped by a signal" if stopped else "the check was still running (killed, if nothing newer came)" if partial else None),
           "started": facts.get("started"), "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "budget_s": int(os.environ.get("GC_BUDGET_S", "0")), "seconds": round(sum(s.get("seconds") or 0 for s in steps), 1),
           "preflight": pre, "steps": [{k: s.get(k) for k in ("name", "status", "seconds", "summary", "details")} for s in steps],
           "parity": parity, "throughput": throughput, "bench": bench, "isolation": iso}
    save(os.path.join(OUT, "results.json"), res)
    md = [f"# gpu_check ({MODE}): {verdict.upper()}" + ("" if partial else f" (exit {code})"), ""]
    if cannot:
        md += [f"cannot run: {cannot}", ""]
    g = (pre or {}).get("gpu") or {}
    if g:
        md += [f"GPU: {g.get('name') or g.get('worker_device')}; driver {g.get('driver_version')}; CUDA {g.get('cuda_version') or g.get('worker_driver_cuda')}; "
               f"MIG {g.get('mig_mode')}; NVRTC {pre.get('nvrtc_version')}; PTX ISA {pre.get('ptx_isa')}", ""]
    md += ["| step | status | seconds | details |", "|---|---|---:|---|"]
    md += [f"| {s['name']} | {s['status']} | {fmt_num(s.get('seconds'), '.1f')} | {cell(s['summary'])} |" for s in steps]
    if parity:
        md += ["", "| parity test | status | seconds | note |", "|---|---|---:|---|"]
        for r in parity:
            note = r.get("note") or ""
            if r.get("output"):
                note += " " + r["output"].splitlines()[-1][:200]
            if r.get("rerun"):
                note += f"; again with CUDA_LAUNCH_BLOCKING=1: {r['rerun']['status']}"
            md.append(f"| {r['name']} | {r['status']} | {fmt_num(r.get('seconds'), '.2f')} | {cell(note)} |")
    if throughput:
        md += ["", "| worker | tokens/s | tokens/s, whole model | ms/step | steps | TFLOP/s | MFU | modelled MFU | shape |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        pct = lambda v: "-" if v is None else f"{100 * v:.1f} %"
        for r in throughput:
            if r.get("error"):
                md.append(f"| {r['role']} | FAILED: {cell(r['error'])[:200]} | | | | | | | |")
            else:
                md.append(f"| {r['role']} | {fmt_num(r.get('tokens_per_s'), ',.0f')} | {fmt_num(r.get('tokens_per_s_model'), ',.0f')} ({r['model_layers']} layers) | "
                          f"{fmt_num((r.get('seconds_per_step') or 0) * 1e3, '.2f')} | {r['steps']} after {r['warmup_steps']} | {fmt_num(r.get('tflops'), '.4g')} | "
                          f"{pct(r.get('mfu'))} | {pct(r.get('modelled_mfu'))} | {cell(r['shape'])} |")
    if bench:
        md += ["", "| op | shape | ms | TFLOP/s | % bf16 peak |", "|---|---|---:|---:|---:|"]
        for r in bench:
            if r.get("error"):
                md.append(f"| {r['op']} | {cell(r['shape'])} | FAILED: {cell(r['error'])[:200]} | | |")
            else:
                md.append(f"| {r['op']} | {cell(r['shape'])} | {fmt_num(r['seconds'] * 1e3, '.3f')} | {fmt_num(r.get('tflops'), '.4g')} | {fmt_num(r.get('pct_peak'), '.1f')} |")
    md += ["", f"results: {os.path.join(OUT, 'results.json')}"]
    save_text(os.path.join(OUT, "results.md"), "\n".join(md) + "\n")
    if partial:
        return
    print("\n" + "\n".join(md))
    sys.exit(code)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    globals()["cmd_" + cmd.replace("-", "_")](*args)
PY
}

if [ "${1:-}" = --run-step ]; then
    # A child: one step (the parent set up the environment).
    step=${2:?}
    "step_${step//-/_}"
    exit $?
fi
main "$@"
