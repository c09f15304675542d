// Embedding gather, scatter-add of rows, bf16 <-> f32 casts, elementwise add, column copies
// (worker/src/device/ops/convert.rs).
// Included by kernels.cu, after the families above it.

// ---------------------------------------------------------------------------------------
// Embedding, casts, elementwise

// out[i, :] = table[min(ids[i], vocab - 1), :]; grid: rows.
template <typename T> __device__ void embed_gather_t(T* out, const T* table, const unsigned* ids, int h, int vocab) {
    const int row = blockIdx.x;
    unsigned id = ids[row];
    if (id >= (unsigned)vocab) id = vocab - 1;
    for (int j = threadIdx.x; j < h; j += blockDim.x) out[(long)row * h + j] = table[(long)id * h + j];
}
extern "C" __global__ void embed_gather(float* out, const float* table, const unsigned* ids, int h, int vocab) { embed_gather_t(out, table, ids, h, vocab); }
extern "C" __global__ void embed_gather_bf16(unsigned short* out, const unsigned short* table, const unsigned* ids, int h, int vocab) { embed_gather_t(out, table, ids, h, vocab); }

// dst[idx[i], :] += src[i, :] (rows of idx distinct); grid: rows of src.
extern "C" __global__ void scatter_add_rows(float* dst, const float* src, const unsigned* idx, int h) {
    const long row = blockIdx.x;
    const long to = idx[row];
    for (int j = threadIdx.x; j < h; j += blockDim.x) dst[to * h + j] += src[row * h + j];
}

// bf16 bits -> f32 (exact).
extern "C" __global__ void bf16_to_f32(float* out, const unsigned short* in, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = __uint_as_float(((unsigned)in[i]) << 16);
}

// f32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
extern "C" __global__ void f32_to_bf16(unsigned short* out, const float* in, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) out[i] = to_bf16(in[i]);
}

// x += y
template <typename T> __device__ void add_inplace_t(T* x, const T* y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) st(x, i, ld(x, i) + ld(y, i));
}
extern "C" __global__ void add_inplace(float* x, const float* y, long n) { add_inplace_t(x, y, n); }
extern "C" __global__ void add_inplace_bf16(unsigned short* x, const unsigned short* y, long n) { add_inplace_t(x, y, n); }

// dst[r, dst_off + j] = src[r, src_off + j] for j < width; grid: rows.
template <typename T> __device__ void copy_cols_t(T* dst, const T* src, int width, int dst_stride, int dst_off, int src_stride, int src_off) {
    const long r = blockIdx.x;
    for (int j = threadIdx.x; j < width; j += blockDim.x) dst[r * dst_stride + dst_off + j] = src[r * src_stride + src_off + j];
}
extern "C" __global__ void copy_cols(float* dst, const float* src, int width, int dst_stride, int dst_off, int src_stride, int src_off) {
    copy_cols_t(dst, src, width, dst_stride, dst_off, src_stride, src_off);
}
extern "C" __global__ void copy_cols_bf16(unsigned short* dst, const unsigned short* src, int width, int dst_stride, int dst_off, int src_stride, int src_off) {
    copy_cols_t(dst, src, width, dst_stride, dst_off, src_stride, src_off);
}
