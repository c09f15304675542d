// The optimizer: gradient norm, AdamW, the weights' checksum, the gradient's scaling
// (worker/src/device/ops/adamw.rs).
// Included by kernels.cu, after the families above it.

// ---------------------------------------------------------------------------------------
// Optimizer: gradient norm and AdamW without a host sync. `sumsq` writes each block's
// share of the sum of g^2 and raises `nonfinite` on any NaN/inf; `sumsq_finish` adds the
// shares in block order. No float atomics: the same gradient gives the same norm to the
// bit on every rank, so ranks that clip by it keep bit-identical weights. `adamw` clips by
// the norm and updates, or leaves weights and moments untouched when `nonfinite` is set
// (the host learns a step later).

extern "C" __global__ void sumsq(double* partials, int* nonfinite, const float* g, long n) {
    __shared__ float sh[32];
    float s = 0.0f;
    int bad = 0;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float x = g[i];
        if (!finite_f32(x)) bad = 1;
        else s += x * x;
    }
    if (bad) atomicExch(nonfinite, 1);
    s = block_sum(s, sh);
    if (threadIdx.x == 0) partials[blockIdx.x] = (double)s;
}

// acc = partials[0] + partials[1] + ... in that order; grid 1.
extern "C" __global__ void sumsq_finish(double* acc, const double* partials, int blocks) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = 0.0;
    for (int b = 0; b < blocks; ++b) s += partials[b];
    *acc = s;
}

// The Adam step count, on the device: one more unless this step is skipped. Launched
// before `adamw`, which reads it for the bias corrections; grid 1.
extern "C" __global__ void adam_count(int* t, const int* nonfinite) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && !*nonfinite) *t += 1;
}

extern "C" __global__ void adamw(float* p, float* m, float* v, const float* g, long n, const double* sumsq_acc, const int* nonfinite, const int* t, float max_norm, float lr, float b1, float b2, float eps, float wd) {
    if (*nonfinite) return;
    const float norm = (float)sqrt(*sumsq_acc);
    const float clip = (max_norm > 0.0f && norm > max_norm) ? max_norm / norm : 1.0f;
    // Bias corrections 1 - beta^t, in double then rounded, as the CPU optimizer does.
    const float c1 = (float)(1.0 - pow((double)b1, (double)*t));
    const float c2 = (float)(1.0 - pow((double)b2, (double)*t));
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float gi = g[i] * clip;
        m[i] = b1 * m[i] + (1.0f - b1) * gi;
        v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
        const float mh = m[i] / c1, vh = v[i] / c2;
        p[i] -= lr * (mh / (sqrtf(vh) + eps) + wd * p[i]);
    }
}

// Checksum of the weights, the same on every rank with the same weights: the wrapping sum
// over i of splitmix64(bits(p[i]) << 32 | i), order-free, so any grid gives the same
// value. Accumulated into `acc` (zero it first). Mirrored by gpu::ops::params_hash.
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

extern "C" __global__ void params_hash(unsigned long long* acc, const float* p, long n) {
    unsigned long long s = 0;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        s += splitmix64(((unsigned long long)__float_as_uint(p[i]) << 32) ^ (unsigned long long)i);
    }
    atomicAdd(acc, s);
}

// y = alpha * x: the group's gradient sum that a collective left scaled into the step's
// average gradient (alpha = 1 / the group's weight), or copied (alpha = 1). One rounding,
// as the host's scaling of the same sum.
extern "C" __global__ void scale_f32(float* y, const float* x, long n, float alpha) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        y[i] = alpha * x[i];
    }
}
