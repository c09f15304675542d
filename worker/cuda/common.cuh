// Shared by every family: warp and block reductions, bf16 loads and stores, the WMMA
// subset and the sm_80 primitives (mma.sync, ldmatrix, cp.async) under NVRTC.
// Included by kernels.cu, after the families above it.

#define FULL_MASK 0xffffffffu
// No <math.h> under NVRTC: infinity and the finiteness test from bits.
#define POS_INF __int_as_float(0x7f800000)
#define NEG_INF __int_as_float(0xff800000)
// Dynamic shared memory, sized by the launch (Kernel::dynamic_shared_bytes): on a GPU
// every such array starts at the block's dynamic shared memory; the host device
// (cuda_host.h) makes it a static of `bytes`.
#ifdef __CUDACC_RTC__
#define DYNAMIC_SHARED(name, bytes) extern __shared__ __align__(16) unsigned char name[]
#endif
__device__ __forceinline__ bool finite_f32(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Minimum and maximum of `v` over the lanes of a warp (every lane gets it); with `from` > 1
// over the lanes that differ in the bits from `from` up (lanes that hold the same value
// for every such bit pattern need no more).
__device__ __forceinline__ int warp_min_i(int v, int from = 1) {
    for (int o = 16; o >= from; o >>= 1) { const int w = __shfl_xor_sync(FULL_MASK, v, o); v = w < v ? w : v; }
    return v;
}
__device__ __forceinline__ int warp_max_i(int v, int from = 1) {
    for (int o = 16; o >= from; o >>= 1) { const int w = __shfl_xor_sync(FULL_MASK, v, o); v = w > v ? w : v; }
    return v;
}

// Sum of `v` over the block; `sh` holds 32 floats of shared memory. Every thread gets it.
__device__ float block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < warps ? sh[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) sh[0] = w;
    }
    __syncthreads();
    const float total = sh[0];
    __syncthreads();
    return total;
}

// Maximum of `v` over the block, and the smallest index that holds it.
__device__ void block_argmax(float v, int idx, float* shv, int* shi, float* out_v, int* out_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, o);
        const int oi = __shfl_xor_sync(FULL_MASK, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    if (lane == 0) { shv[warp] = v; shi[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? shv[lane] : NEG_INF;
        idx = lane < warps ? shi[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, v, o);
            const int oi = __shfl_xor_sync(FULL_MASK, idx, o);
            if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
        }
        if (lane == 0) { shv[0] = v; shi[0] = idx; }
    }
    __syncthreads();
    *out_v = shv[0];
    *out_i = shi[0];
    __syncthreads();
}

// Activations are f32 or bf16 (its bits in an unsigned short; the GPU target keeps its
// activations in bf16). Kernels that take either are templates over the storage type,
// computing in f32: `ld` widens (exact), `st` rounds to nearest even.
__device__ __forceinline__ unsigned short to_bf16(float x) {
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN stays a quiet NaN
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float ld(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float ld(const unsigned short* p, long i) { return __uint_as_float(((unsigned)p[i]) << 16); }
__device__ __forceinline__ void st(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(unsigned short* p, long i, float v) { p[i] = to_bf16(v); }

// e^x for x <= 0, flushed to 0 below 1e-30 as the CPU backend does (no subnormals).
__device__ __forceinline__ float exp_neg(float x) { return x < -69.0f ? 0.0f : expf(x); }

// ---------------------------------------------------------------------------------------
// Tensor cores: the subset of the WMMA API (nvcuda::wmma, mma.h) the kernels use, 16×16×16
// tiles of bf16 A and B with f32 accumulators. NVRTC ships no mma.h, so under NVRTC the
// same names are defined here over the compiler's WMMA built-ins that mma.h wraps (the
// layout codes are mma.h's: 0 row-major, 1 column-major; for mma, 2·[A col] + [B col]).
// The host device gets them from cuda_host.h. A fragment's elements are touched only
// through these calls.
#ifdef __CUDACC_RTC__
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
struct bf16 {};
enum layout_t { mem_row_major, mem_col_major };
template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment;
// Aligned to 8 bytes as mma.h's fragments are ("required for compiler implementation").
template <class Use, class Layout> struct __align__(8) fragment<Use, 16, 16, 16, bf16, Layout> { int x[4]; };
template <> struct __align__(8) fragment<accumulator, 16, 16, 16, float, void> { float x[8]; };
template <class L> struct is_col { enum { value = 0 }; };
template <> struct is_col<col_major> { enum { value = 1 }; };

__device__ __forceinline__ void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float v) {
    for (int i = 0; i < 8; ++i) f.x[i] = v;
}
template <class L> __device__ __forceinline__ void load_matrix_sync(fragment<matrix_a, 16, 16, 16, bf16, L>& f, const unsigned short* p, unsigned ldm) {
    __mma_bf16_m16n16k16_ld_a(f.x, (const int*)p, ldm, is_col<L>::value);
}
template <class L> __device__ __forceinline__ void load_matrix_sync(fragment<matrix_b, 16, 16, 16, bf16, L>& f, const unsigned short* p, unsigned ldm) {
    __mma_bf16_m16n16k16_ld_b(f.x, (const int*)p, ldm, is_col<L>::value);
}
__device__ __forceinline__ void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
    if (l == mem_col_major) __hmma_m16n16k16_ld_c_f32(f.x, p, ldm, 1);  // the built-ins take the layout as a constant
    else __hmma_m16n16k16_ld_c_f32(f.x, p, ldm, 0);
}
__device__ __forceinline__ void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
    if (l == mem_col_major) __hmma_m16n16k16_st_c_f32(p, (float*)f.x, ldm, 1);
    else __hmma_m16n16k16_st_c_f32(p, (float*)f.x, ldm, 0);
}
template <class LA, class LB>
__device__ __forceinline__ void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, bf16, LA>& a,
                                         const fragment<matrix_b, 16, 16, 16, bf16, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
    __mma_bf16_m16n16k16_mma_f32(d.x, a.x, b.x, c.x, 2 * is_col<LA>::value + is_col<LB>::value, 0);
}
}  // namespace wmma
#endif

// ---------------------------------------------------------------------------------------
// The sm_80 primitives of FlashAttention-2-class kernels, over inline PTX: mma.sync
// m16n8k16 (bf16 A row-major and B column-major, f32 accumulators), ldmatrix (x1/x2/x4,
// .trans) from shared memory, and 16-byte cp.async from global to shared memory with its
// commit/wait groups. Fragments are registers the kernel builds itself, in the layouts of
// the PTX ISA, which cuda/host/cuda_host.h spells out and emulates for the host device
// (there a cp.async destination is poisoned until the wait_group that covers it).
// cuda/test_kernels.cu checks the emulation against those layouts (worker/tests/primitives.rs).
#ifdef __CUDACC_RTC__
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// d = a · b + c; a: 4 registers (8 bf16), b: 2 (4 bf16), c and d: 4 f32 (d may be c).
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// `p`: this lane's row address (16 bytes, 16-byte aligned, shared memory).
__device__ __forceinline__ void ldmatrix_x1(unsigned (&r)[1], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x1_trans(unsigned (&r)[1], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// 16 bytes from global `src` to shared `dst` (both 16-byte aligned), asynchronously: .cg
// bypasses L1, .ca caches there. Visible to this thread after a wait covering its group.
__device__ __forceinline__ void cp_async_cg16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_ca16(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
#endif
