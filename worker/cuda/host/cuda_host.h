// The CUDA built-ins that worker/cuda/kernels.cu uses, for compiling it as plain C++ and
// running it on the CPU: the host device (worker/src/device/host.rs, cuda/host/runtime.cpp).
// Every thread of a block is live at once (a fiber with its own stack); `__syncthreads`
// is a real barrier over all of them and warp collectives exchange through a per-warp
// barrier, so a missing barrier or a wrong lane index shows up here as it would on a GPU.
// Blocks run one after another (shared memory is a static: one block owns it at a time),
// in a shuffled order, their threads resumed in a varying order, and every block starts
// with its shared memory poisoned (runtime.cpp: the schedule), so a kernel that works
// only in one order, or reads shared memory it did not write, fails here.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace hd {
extern thread_local uint3 thread_idx;
extern thread_local uint3 block_idx;
extern dim3 block_dim;
extern dim3 grid_dim;
// Block-wide barrier (threads that returned from the kernel no longer count).
void syncthreads();
// Every lane publishes `mine`; returns lane `src`'s value. All lanes of the warp take part.
uint64_t warp_exchange(uint64_t mine, int src);
// Every lane publishes `n` (at most 16) words; all[l·n + i] is then lane l's word i. All
// lanes of the warp take part (the tensor-core primitives below).
void warp_allgather(const uint32_t* mine, int n, uint32_t* all);
// Aborts, naming `what` and the launch, unless [p, p + bytes) lies inside the block's
// shared memory (`shared`) or outside it (`!shared`), aligned to `align` bytes.
void check_space(const void* p, size_t bytes, bool shared, size_t align, const char* what);
// cp.async of `bytes` from global `src` to shared `dst`, by the calling thread: its
// destination is poisoned now and written at the wait_group that covers it (see below).
void cp_async(void* dst, const void* src, int bytes, const char* what);
void cp_async_commit();
// Deliver the calling thread's oldest committed groups until at most `pending` remain.
void cp_async_wait(int pending);
}  // namespace hd

#define threadIdx (hd::thread_idx)
#define blockIdx (hd::block_idx)
#define blockDim (hd::block_dim)
#define gridDim (hd::grid_dim)
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
// One block runs at a time, so a static is that block's shared memory. All of them go in
// one section, which the launcher fills with 0xFF bytes before each block (runtime.cpp,
// poison_shared): on a GPU, shared memory starts as whatever the SM's last block left
// there, so a read of shared memory that this block did not write reads NaN here (as f32
// and as bf16; -1 as an integer), not zeros or the last block's values. GCC (12 at
// least) silently gives the statics of a template's instantiations no section, so a
// __shared__ variable inside a template is refused (GCC's name of an instantiated
// function ends in "[with T = ...]"; at namespace scope it is "top level"): kernels.cu
// declares a template's at namespace scope.
namespace hd {
constexpr bool in_template(std::string_view pretty_function) { return pretty_function.find("[with ") != std::string_view::npos; }
}  // namespace hd
#define __shared__                                                                                         \
    static_assert(!hd::in_template(__PRETTY_FUNCTION__), "__shared__ in a template: the host device cannot " \
                                                          "poison it; declare it at namespace scope");       \
    static __attribute__((section("hd_shared")))

// A kernel's dynamic shared memory (kernels.cu: `extern __shared__` on a GPU) is a static
// of the largest size a launch gives it, poisoned with the rest.
#define DYNAMIC_SHARED(name, bytes) static __attribute__((section("hd_shared"), aligned(16))) unsigned char name[bytes]

inline void __syncthreads() { hd::syncthreads(); }

namespace hd {
template <class T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "warp shuffle of a value wider than 8 bytes");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
inline T from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}
inline int lane_id() { return (int)(thread_idx.x & 31u); }
}  // namespace hd

template <class T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    const int lane = hd::lane_id();
    const int base = lane & ~(width - 1);
    return hd::from_bits<T>(hd::warp_exchange(hd::to_bits(v), base + (src & (width - 1))));
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    const int lane = hd::lane_id();
    int src = lane ^ mask;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return hd::from_bits<T>(hd::warp_exchange(hd::to_bits(v), src));
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = hd::lane_id();
    const int src = ((lane & (width - 1)) + (int)delta) < width ? lane + (int)delta : lane;
    return hd::from_bits<T>(hd::warp_exchange(hd::to_bits(v), src));
}
template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = hd::lane_id();
    const int src = (lane & (width - 1)) >= (int)delta ? lane - (int)delta : lane;
    return hd::from_bits<T>(hd::warp_exchange(hd::to_bits(v), src));
}
// Votes: every lane contributes its bit, then reads them all.
inline unsigned __ballot_sync(unsigned, int pred) {
    unsigned bits = 0;
    const int lane = hd::lane_id();
    for (int src = 0; src < 32; ++src) {
        const uint64_t b = hd::warp_exchange(pred ? 1u : 0u, src);
        if (b) bits |= 1u << src;
    }
    (void)lane;
    return bits;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) { return __ballot_sync(m, pred) == 0xffffffffu; }
inline void __syncwarp(unsigned = 0xffffffffu) { (void)hd::warp_exchange(0, hd::lane_id()); }

// Atomics on plain memory, through std::atomic_ref (C++20). They land in the order the
// threads and blocks run, which the schedule varies from launch to launch (runtime.cpp),
// so the low bits of a float sum vary as on a GPU.
inline float atomicAdd(float* a, float v) { return std::atomic_ref<float>(*a).fetch_add(v); }
inline double atomicAdd(double* a, double v) { return std::atomic_ref<double>(*a).fetch_add(v); }
inline int atomicAdd(int* a, int v) { return std::atomic_ref<int>(*a).fetch_add(v); }
inline unsigned atomicAdd(unsigned* a, unsigned v) { return std::atomic_ref<unsigned>(*a).fetch_add(v); }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) { return std::atomic_ref<unsigned long long>(*a).fetch_add(v); }
inline int atomicExch(int* a, int v) { return std::atomic_ref<int>(*a).exchange(v); }
inline float atomicExch(float* a, float v) { return std::atomic_ref<float>(*a).exchange(v); }
inline int atomicOr(int* a, int v) { return std::atomic_ref<int>(*a).fetch_or(v); }
inline int atomicMax(int* a, int v) {
    std::atomic_ref<int> r(*a);
    int cur = r.load();
    while (cur < v && !r.compare_exchange_weak(cur, v)) {
    }
    return cur;
}
inline int atomicCAS(int* a, int cmp, int v) {
    std::atomic_ref<int>(*a).compare_exchange_strong(cmp, v);
    return cmp;
}

// Math intrinsics: the fast variants are the accurate ones here.
using std::fabs;
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// expf, logf, sincosf, __expf, __logf, ...: glibc's math.h declares them all.
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}

// bf16 and fp16 storage types with round-to-nearest-even conversions, as cuda_bf16.h and
// cuda_fp16.h give them (kernels.cu converts by hand; these are for kernels that use them).
struct __nv_bfloat16 {
    unsigned short x;
};
inline __nv_bfloat16 __float2bfloat16(float f) {
    const unsigned u = __float_as_uint(f);
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) r.x = (unsigned short)((u >> 16) | 0x40u);
    else r.x = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return r;
}
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float(((unsigned)b.x) << 16); }

// The subset of the WMMA API (CUDA's nvcuda::wmma, mma.h) that kernels.cu uses: 16×16×16
// tiles, bf16 A and B, f32 accumulators. Under NVRTC, kernels.cu defines the same names
// over the compiler's WMMA built-ins (mma.h is not among NVRTC's own headers). Here each
// thread of the warp holds the whole tile: a load is done by every lane from the memory
// as it is when that lane gets there, so a tile written by the warp and loaded without a
// __syncwarp in between loads the other lanes' parts unwritten, as it would on a GPU. A
// store is shared out between the lanes as on a GPU, so the stored tile is whole only
// after a __syncwarp. `mma_sync` computes in f32, k in order. Kernels touch a
// fragment only through these calls (their element layout is the GPU's secret).
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
// bf16 elements, as the kernels store them: the bits in an unsigned short.
struct bf16 {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment;
template <class Use, class Layout>
struct fragment<Use, 16, 16, 16, bf16, Layout> {
    float x[256];  // [row][col] of the tile, widened (exactly) from bf16
};
template <>
struct fragment<accumulator, 16, 16, 16, float, void> {
    float x[256];  // [row][col]
};

namespace detail {
inline float widen(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
// Element (r, c) of a tile at p: row-major rows ldm apart, or column-major columns.
template <class T>
inline T at(const T* p, int r, int c, unsigned ldm, bool col) { return col ? p[(long)c * ldm + r] : p[(long)r * ldm + c]; }
}  // namespace detail

inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float v) {
    for (float& e : f.x) e = v;
}
template <class Use, class Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, bf16, Layout>& f, const unsigned short* p, unsigned ldm) {
    const bool col = std::is_same<Layout, col_major>::value;
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = detail::widen(detail::at(p, r, c, ldm, col));
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = detail::at(p, r, c, ldm, l == mem_col_major);
}
// Each lane stores the 8 elements that it holds in the accumulator layout of sm_80's
// mma.m16n8k16 (rows l/4 and l/4 + 8, columns 2·(l%4) + {0, 1} and 8 more), so a lane
// that then reads the tile in any other order reads elements other lanes store.
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
    const int lane = hd::lane_id();
    for (int e = 0; e < 8; ++e) {
        const int r = lane / 4 + 8 * (e >> 2), c = 2 * (lane % 4) + (e & 1) + 8 * ((e >> 1) & 1);
        if (l == mem_col_major) p[(long)c * ldm + r] = f.x[r * 16 + c];
        else p[(long)r * ldm + c] = f.x[r * 16 + c];
    }
}
// d = a · b + c (d may be c).
template <class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, bf16, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, bf16, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
    float out[256];
    for (int r = 0; r < 16; ++r)
        for (int n = 0; n < 16; ++n) {
            float s = c.x[r * 16 + n];
            for (int k = 0; k < 16; ++k) s += a.x[r * 16 + k] * b.x[k * 16 + n];
            out[r * 16 + n] = s;
        }
    std::memcpy(d.x, out, sizeof out);
}
}  // namespace wmma

// ---------------------------------------------------------------------------------------
// The sm_80 tensor-core primitives that kernels.cu defines over inline PTX under NVRTC
// (mma.sync m16n8k16, ldmatrix, cp.async), with the fragment layouts of the PTX ISA
// ("Matrix Fragments for mma.m16n8k16 with floating point type"; "Warp-level matrix load
// instruction: ldmatrix"). Unlike the WMMA subset above, a fragment's layout is no secret
// here: the kernels build fragments by hand, so each lane holds exactly the registers it
// holds on a GPU and the warp's collective exchanges them (hd::warp_allgather), so a
// kernel that puts an element in the wrong lane or register computes a wrong product here
// as on a GPU. A 32-bit register holds two bf16, the lower-indexed element in its low half.
// groupID g = lane / 4, threadID_in_group t = lane % 4.
namespace hd {
inline uint16_t half_of(uint32_t w, int h) { return (uint16_t)(h ? w >> 16 : w & 0xffffu); }
inline float bf16_bits_to_f32(uint16_t b) { return __uint_as_float(((unsigned)b) << 16); }
}  // namespace hd

// d = a · b + c for a 16×16 A (row-major), a 16×8 B (column-major: "col"), f32 C and D.
// A: register j of lane (g, t) holds row g + 8·(j & 1), columns 2t + 8·(j >> 1) + {0, 1}.
// B: register j holds rows (k) 2t + 8·j + {0, 1} of column (n) g.
// C, D: element i holds row g + 8·(i >> 1), column 2t + (i & 1).
// Computed in f32, k in order from c (the products of bf16 are exact in f32). d may be c.
inline void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4]) {
    uint32_t mine[10], all[32 * 10];
    for (int j = 0; j < 4; ++j) mine[j] = a[j];
    for (int j = 0; j < 2; ++j) mine[4 + j] = b[j];
    for (int i = 0; i < 4; ++i) mine[6 + i] = __float_as_uint(c[i]);
    hd::warp_allgather(mine, 10, all);
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        const uint32_t* w = &all[l * 10];
        for (int j = 0; j < 4; ++j)
            for (int h = 0; h < 2; ++h) A[g + 8 * (j & 1)][2 * t + 8 * (j >> 1) + h] = hd::bf16_bits_to_f32(hd::half_of(w[j], h));
        for (int j = 0; j < 2; ++j)
            for (int h = 0; h < 2; ++h) B[2 * t + 8 * j + h][g] = hd::bf16_bits_to_f32(hd::half_of(w[4 + j], h));
        for (int i = 0; i < 4; ++i) C[g + 8 * (i >> 1)][2 * t + (i & 1)] = __uint_as_float(w[6 + i]);
    }
    const int g = hd::lane_id() >> 2, t = hd::lane_id() & 3;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        float s = C[row][col];
        for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
        d[i] = s;
    }
}

// ldmatrix.sync.aligned.m8n8.xX(.trans).shared.b16: X 8×8 matrices of 16-bit elements, the
// rows of matrix i at the addresses of lanes 8i..8i+7 (16 bytes each, 16-byte aligned, in
// shared memory; other lanes' addresses are not read). Register i of lane (g, t) gets
// elements (g, 2t) and (g, 2t + 1) of matrix i, or with .trans (2t, g) and (2t + 1, g).
namespace hd {
inline void ldmatrix(unsigned* r, int x, bool trans, const void* p) {
    const uint64_t addr = (uint64_t)(uintptr_t)p;
    const uint32_t mine[2] = {(uint32_t)addr, (uint32_t)(addr >> 32)};
    uint32_t all[64];
    warp_allgather(mine, 2, all);
    const int g = lane_id() >> 2, t = lane_id() & 3;
    for (int i = 0; i < x; ++i) {
        const uint16_t* rows[8];
        for (int k = 0; k < 8; ++k) {
            const int l = 8 * i + k;
            rows[k] = (const uint16_t*)(uintptr_t)(all[2 * l] | ((uint64_t)all[2 * l + 1] << 32));
            check_space(rows[k], 16, true, 16, "ldmatrix's row address");
        }
        const uint16_t lo = trans ? rows[2 * t][g] : rows[g][2 * t];
        const uint16_t hi = trans ? rows[2 * t + 1][g] : rows[g][2 * t + 1];
        r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
}
}  // namespace hd
inline void ldmatrix_x1(unsigned (&r)[1], const void* p) { hd::ldmatrix(r, 1, false, p); }
inline void ldmatrix_x2(unsigned (&r)[2], const void* p) { hd::ldmatrix(r, 2, false, p); }
inline void ldmatrix_x4(unsigned (&r)[4], const void* p) { hd::ldmatrix(r, 4, false, p); }
inline void ldmatrix_x1_trans(unsigned (&r)[1], const void* p) { hd::ldmatrix(r, 1, true, p); }
inline void ldmatrix_x2_trans(unsigned (&r)[2], const void* p) { hd::ldmatrix(r, 2, true, p); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) { hd::ldmatrix(r, 4, true, p); }

// cp.async.{cg,ca}.shared.global [dst], [src], 16 and its groups, per thread as on a GPU:
// commit_group closes the thread's copies issued since its last commit into a group;
// wait_group N waits until at most the N most recent groups are still in flight;
// wait_all is commit_group then wait_group 0. Here a copy's 16 destination bytes are
// poisoned (0xFF: NaN as f32 and bf16) when it is issued and written only when a wait
// covers its group, so a read before the wait (or after a wait that does not cover it,
// or by another thread before a barrier) reads NaN. The source is read at issue. A thread
// that returns with copies not waited for aborts the launch.
inline void cp_async_cg16(void* dst, const void* src) { hd::cp_async(dst, src, 16, "cp.async.cg"); }
inline void cp_async_ca16(void* dst, const void* src) { hd::cp_async(dst, src, 16, "cp.async.ca"); }
inline void cp_async_commit() { hd::cp_async_commit(); }
template <int N>
inline void cp_async_wait_group() {
    static_assert(N >= 0, "cp.async.wait_group takes a non-negative constant");
    hd::cp_async_wait(N);
}
inline void cp_async_wait_all() {
    hd::cp_async_commit();
    hd::cp_async_wait(0);
}
