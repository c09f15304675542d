// RMSNorm forward and backward (worker/src/device/ops/norm.rs).
// Included by kernels.cu, after the families above it.

// ---------------------------------------------------------------------------------------
// RMSNorm (one block per row)

// y = x · rstd · w, rstd = 1/sqrt(mean(x²) + eps) (y may be x)
__shared__ float rmsnorm_fwd_sh[32];  // rmsnorm_fwd_t's (no __shared__ in a template)
template <typename TY, typename T> __device__ void rmsnorm_fwd_t(TY* y, float* rstd, const T* x, const float* w, int d, float eps) {
    const long row = blockIdx.x;
    const T* xr = x + row * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += ld(xr, i) * ld(xr, i);
    ss = block_sum(ss, rmsnorm_fwd_sh);
    const float r = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) st(y, row * d + i, ld(xr, i) * r * w[i]);
    if (threadIdx.x == 0) rstd[row] = r;
}
extern "C" __global__ void rmsnorm_fwd(float* y, float* rstd, const float* x, const float* w, int d, float eps) { rmsnorm_fwd_t(y, rstd, x, w, d, eps); }
extern "C" __global__ void rmsnorm_fwd_bf16(unsigned short* y, float* rstd, const unsigned short* x, const float* w, int d, float eps) { rmsnorm_fwd_t(y, rstd, x, w, d, eps); }
// f32 in, y rounded to bf16: a GEMM's input, with no f32 copy and no cast pass.
extern "C" __global__ void rmsnorm_fwd_to_bf16(unsigned short* y, float* rstd, const float* x, const float* w, int d, float eps) { rmsnorm_fwd_t(y, rstd, x, w, d, eps); }

// The backward in two stages, with no atomics. rmsnorm_bwd: block b takes rows
// [b·rows_per_block, (b + 1)·rows_per_block) of `rows`, one after the other: dx +=
// r·dy·w − x·r³·mean(dy·w·x), and with `partials` its rows' share of the weight gradient,
// Σ dy·x·r, written (not added) to partials row b. Thread t owns columns t, t + blockDim,
// ... and keeps their shares in dynamic shared memory (d floats, launched with them; a
// thread touches only its own, so no barrier), which costs no registers whatever d is.
// A row wider than that memory holds keeps them in its partial row itself (global memory,
// still each thread's own columns; launched with no dynamic shared memory). Then
// rmsnorm_bwd_dw adds the partial rows' sum to dw.
#define RMSNORM_BWD_DYN_BYTES 49152  // rows up to 12288 wide, without opting in past 48 KB
DYNAMIC_SHARED(rmsnorm_bwd_acc, RMSNORM_BWD_DYN_BYTES);
extern "C" __global__ void rmsnorm_bwd(float* dx, float* partials, const float* dy, const float* x, const float* w, const float* rstd, int d, int rows, int rows_per_block) {
    __shared__ float sh[32];
    const bool in_shared = (long)d * 4 <= RMSNORM_BWD_DYN_BYTES;
    float* acc = in_shared ? (float*)rmsnorm_bwd_acc : partials + (long)blockIdx.x * d;
    if (partials)
        for (int i = threadIdx.x; i < d; i += blockDim.x) acc[i] = 0.0f;
    const long r0 = (long)blockIdx.x * rows_per_block;
    const long r1 = r0 + rows_per_block < (long)rows ? r0 + rows_per_block : (long)rows;
    for (long row = r0; row < r1; ++row) {
        const float* xr = x + row * d;
        const float* gr = dy + row * d;
        const float r = rstd[row];
        float gx = 0.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) gx += gr[i] * w[i] * xr[i];
        gx = block_sum(gx, sh) / (float)d;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            dx[row * d + i] += r * gr[i] * w[i] - xr[i] * r * r * r * gx;
            if (partials) acc[i] += gr[i] * xr[i] * r;
        }
    }
    if (partials && in_shared)
        for (int i = threadIdx.x; i < d; i += blockDim.x) partials[(long)blockIdx.x * d + i] = acc[i];
}

// dw[i] += Σ_b partials[b·d + i] over the `blocks` partial rows. A block sums 32 columns:
// lane l of warp w column 32·blockIdx + l over the rows w, w + warps, ...; then warp 0
// adds the warps' sums in warp order. A fixed order: the same bits every run. Grid:
// ceil(d / 32).
extern "C" __global__ void rmsnorm_bwd_dw(float* dw, const float* partials, int d, int blocks) {
    __shared__ float sh[32][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int i = blockIdx.x * 32 + lane;
    float s = 0.0f;
    if (i < d)
        for (int b = warp; b < blocks; b += warps) s += partials[(long)b * d + i];
    sh[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && i < d) {
        float t = 0.0f;
        for (int u = 0; u < warps; ++u) t += sh[u][lane];
        dw[i] += t;
    }
}
