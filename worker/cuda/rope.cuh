// Rotary embedding (worker/src/device/ops/rope.rs).
// Included by kernels.cu, after the families above it.

// ---------------------------------------------------------------------------------------
// Rotary embedding (rotate-half), in place; row i at position pos[i]. grid: rows.
template <typename T> __device__ void rope_t(T* x, const int* pos, const float* inv_freq, int heads, int head_dim, float scale, int inverse) {
    const long row = blockIdx.x;
    const int half = head_dim / 2;
    const float p = (float)pos[row];
    for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
        const int h = t / half, i = t % half;
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        s *= scale;
        c *= scale;
        if (inverse) s = -s;
        T* base = x + row * (long)heads * head_dim + (long)h * head_dim;
        const float x1 = ld(base, i), x2 = ld(base, i + half);
        st(base, i, x1 * c - x2 * s);
        st(base, i + half, x2 * c + x1 * s);
    }
}
extern "C" __global__ void rope(float* x, const int* pos, const float* inv_freq, int heads, int head_dim, float scale, int inverse) { rope_t(x, pos, inv_freq, heads, head_dim, scale, inverse); }
extern "C" __global__ void rope_bf16(unsigned short* x, const int* pos, const float* inv_freq, int heads, int head_dim, float scale, int inverse) { rope_t(x, pos, inv_freq, heads, head_dim, scale, inverse); }
