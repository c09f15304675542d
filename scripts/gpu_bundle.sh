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
#   MANIFEST                          commit, build host, and the newest glibc/libstdc++
#                                     symbol versions the binaries need
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
