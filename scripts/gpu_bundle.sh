#!/usr/bin/env bash
# Build here, where Rust is, everything scripts/gpu_check.sh needs on a GPU machine that has
# no Rust and no network, into target/gpu-bundle (at most 64 MiB, or this fails):
#
#   dflash-supervise, dflash-worker   release builds, stripped
#   host_device                       the parity tests (worker/tests/host_device.rs), which
#                                     gpu_check.sh runs with DFLASH_TEST_DEVICE=cuda
#   gpu_check.sh                      the check itself
#   emu/                              the emulated CUDA stack and the fake NVML, so that
#                                     `gpu_check.sh --emulated` tries the bundle here first
#   kernel-cache/                     the kernels compiled here by NVRTC for sm_80, sm_90
#                                     and sm_100 (CUBIN and PTX, named as the worker's
#                                     cache names them): gpu_check.sh seeds its cache with
#                                     them, so nothing compiles on an A100, H100/H200 or B200
#   roofline.json                     `bench kernels`' roofline model of those kernels at
#                                     Qwen3-8B's shapes: the MFU gpu_check.sh's throughput
#                                     step prints beside the one it measures
#   MANIFEST                          commit, build host, and the newest glibc/libstdc++
#                                     symbol versions the binaries need
#
# Needs NVRTC, cuobjdump and nvdisasm here (pip install nvidia-cuda-nvrtc
# nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, or DFLASH_NVRTC_LIB / DFLASH_CUOBJDUMP /
# DFLASH_NVDISASM).
#
# Then: scripts/gpu_bundle.sh && target/gpu-bundle/gpu_check.sh --emulated --out /tmp/x
# (here), copy target/gpu-bundle to the GPU machine, run `gpu-bundle/gpu_check.sh --out
# results` there and bring `results/` back (results.json, results.md, logs).
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-bundle
limit_mib=64

cargo build --release --locked -p dflash-supervisor -p dflash-worker -p dflash-emu-cuda -p dflash-emu-cublas -p dflash-fake-nvml
# cargo names the test executable by a hash: ask it which one it built.
parity=$(cargo test --release --locked -p dflash-worker --test host_device --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys; print([j["executable"] for j in map(json.loads, sys.stdin) if j.get("executable") and "host_device" in j["executable"]][-1])')

rm -rf "$out"
mkdir -p "$out/emu"
cp target/release/dflash-supervise target/release/dflash-worker "$out/"
cp "$parity" "$out/host_device"
cp target/release/libdflash_emu_cuda.so target/release/libdflash_emu_cublas.so target/release/libdflash_fake_nvml.so "$out/emu/"
cp scripts/gpu_check.sh "$out/"

# The kernels for every architecture the check may meet, compiled through the worker's
# own cache (DFLASH_KERNEL_CACHE) by `bench kernels`, which also models their roofline.
archs=sm_80,sm_90,sm_100
mkdir -p "$out/kernel-cache"
if ! DFLASH_KERNEL_CACHE="$PWD/$out/kernel-cache" target/release/dflash-supervise bench kernels --json --arch "$archs" \
    </dev/null >"$out/bench-kernels.json" 2>"$out/bench-kernels.err"; then
    echo "gpu_bundle: cannot compile the kernels for $archs: $(tail -n 3 "$out/bench-kernels.err")" >&2
    echo "gpu_bundle: (pip install nvidia-cuda-nvrtc nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)" >&2
    exit 1
fi
python3 - "$out" "$archs" <<'PY'
import glob, json, os, sys
out, archs = sys.argv[1], sys.argv[2].split(",")
report = json.load(open(os.path.join(out, "bench-kernels.json")))
for a in archs:
    have = {os.path.splitext(p)[1] for p in glob.glob(os.path.join(out, "kernel-cache", f"kernels-*-{a}-nvrtc*.*"))}
    if not {".cubin", ".ptx"} <= have:
        sys.exit(f"gpu_bundle: no CUBIN and PTX for {a} in {out}/kernel-cache (bench kernels made {sorted(have)})")
if not report.get("model"):
    sys.exit("gpu_bundle: bench kernels gave no roofline model")
json.dump({"nvrtc": report.get("nvrtc"), "cuobjdump": report.get("cuobjdump"), "model": report["model"]},
          open(os.path.join(out, "roofline.json"), "w"), indent=1)
PY
rm -f "$out/bench-kernels.json" "$out/bench-kernels.err"
# Release builds keep line tables (profile.release debug = 1): 4x the size, not needed there.
strip "$out/dflash-supervise" "$out/dflash-worker" "$out/host_device"
strip --strip-unneeded "$out"/emu/*.so

# The newest versioned glibc and libstdc++ symbols the binaries use: the GPU machine's
# must be at least these (`ldd --version` there), or nothing in the bundle starts.
newest() {
    objdump -T "$out"/dflash-* "$out/host_device" "$out"/emu/*.so 2>/dev/null | grep -o "$1[0-9.]*" | sort -Vu | tail -n 1
}
{
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), $(ldd --version 2>/dev/null | head -n 1)"
    echo "needs: $(newest GLIBC_), $(newest GLIBCXX_)"
    echo "kernels: $(cd "$out/kernel-cache" && printf '%s ' kernels-*.cubin)(NVRTC $(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["nvrtc"])' "$out/roofline.json"))"
} >"$out/MANIFEST"
cat "$out/MANIFEST"

size=$(du -sb "$out" | cut -f1)
mib=$(( (size + (1 << 20) - 1) >> 20 ))
du -ab "$out" | sort -n | awk '{ printf "%8.1f MiB  %s\n", $1 / 1048576, $2 }'
if ((mib > limit_mib)); then
    echo "gpu_bundle: $out is $mib MiB, over the $limit_mib MiB that can be carried" >&2
    exit 1
fi
echo "gpu_bundle: $out is $mib MiB (limit $limit_mib MiB)"
