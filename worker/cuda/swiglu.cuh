// SwiGLU: split and fused gate/up, forward and backward (worker/src/device/ops/swiglu.rs).
// Included by kernels.cu, after the families above it.

// out = silu(gate) * up
template <typename T> __device__ void swiglu_fwd_t(T* out, const T* gate, const T* up, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float g = ld(gate, i);
        const float s = 1.0f / (1.0f + expf(-g));
        st(out, i, g * s * ld(up, i));
    }
}
extern "C" __global__ void swiglu_fwd(float* out, const float* gate, const float* up, long n) { swiglu_fwd_t(out, gate, up, n); }
extern "C" __global__ void swiglu_fwd_bf16(unsigned short* out, const unsigned short* gate, const unsigned short* up, long n) { swiglu_fwd_t(out, gate, up, n); }

// SwiGLU over a fused gate/up projection: row r of `gu` is [gate (width) | up (width)] (one
// GEMM over the adjacent gate_proj and up_proj weights); out = silu(gate)·up, rows × width.
template <typename TO, typename TI> __device__ void swiglu_gu_fwd_t(TO* out, const TI* gu, int width, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = i / width, c = i - r * width;
        const long at = 2 * r * width + c;
        const float g = ld(gu, at);
        const float s = 1.0f / (1.0f + expf(-g));
        st(out, i, g * s * ld(gu, at + width));
    }
}
extern "C" __global__ void swiglu_gu_fwd(float* out, const float* gu, int width, long n) { swiglu_gu_fwd_t(out, gu, width, n); }
extern "C" __global__ void swiglu_gu_fwd_bf16(unsigned short* out, const unsigned short* gu, int width, long n) { swiglu_gu_fwd_t(out, gu, width, n); }
// f32 in, the result rounded to bf16: a GEMM's input, with no f32 copy and no cast pass.
extern "C" __global__ void swiglu_gu_fwd_to_bf16(unsigned short* out, const float* gu, int width, long n) { swiglu_gu_fwd_t(out, gu, width, n); }

// The backward of swiglu_gu_fwd: row r of dgu = [dgate | dup], written (not accumulated).
extern "C" __global__ void swiglu_gu_bwd(float* dgu, const float* dout, const float* gu, int width, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = i / width, c = i - r * width;
        const long at = 2 * r * width + c;
        const float g = gu[at], u = gu[at + width], d = dout[i];
        const float s = 1.0f / (1.0f + expf(-g));
        dgu[at + width] = d * g * s;
        dgu[at] = d * u * s * (1.0f + g * (1.0f - s));
    }
}
