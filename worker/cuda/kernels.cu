// dflash-worker's CUDA kernels: one file per op family (cuda/<family>.cuh, beside its
// launches and CPU body in worker/src/device/ops/<family>.rs), included here in order.
//
// This source is compiled two ways, unmodified:
//   * by NVRTC at run time, for the GPU's compute capability (worker/src/device/nvrtc.rs;
//     the build expands these includes into one source, with #line directives);
//   * as C++ by the host compiler, with cuda/host/cuda_host.h supplying the CUDA built-ins,
//     for the host device that runs every kernel on the CPU in CI (worker/src/device/host.rs).
// So: inline PTX only inside the primitives of common.cuh under __CUDACC_RTC__ (which
// cuda_host.h emulates), no CUDA headers (bf16 is converted by hand, round-to-nearest-even;
// tensor cores through a WMMA subset defined in common.cuh, or through mma.sync, ldmatrix
// and cp.async), block sizes a multiple of 32,
// every warp collective with all 32 lanes present, and no __shared__ variable declared
// inside a template: a template's shared memory is declared at namespace scope (on a GPU
// the same thing: each kernel that uses it has its own, per block). The host device
// poisons shared memory before each block through a section that GCC does not give the
// statics of a template's instantiations; cuda_host.h refuses one.
//
// Layouts match the CPU backend (worker/src/device/cpu.rs): row-major f32 activations, a
// linear layer's weight [out, in]. Ops that the CPU backend accumulates into (`+=`)
// accumulate here. A family may use what the families before it define.

#include "common.cuh"
#include "convert.cuh"
#include "swiglu.cuh"
#include "moe.cuh"
#include "norm.cuh"
#include "rope.cuh"
#include "attention.cuh"
#include "loss.cuh"
#include "adamw.cuh"
#include "gemm.cuh"
