// The CUDA built-ins that worker/cuda/kernels.cu uses, for compiling it as plain C++ and
// running it on the CPU: the host device (worker/src/gpu/host.rs, cuda/host/runtime.cpp).
// Every thread of a block is live at once (a fiber with its own stack); `__syncthreads`
// is a real barrier over all of them and warp collectives exchange through a per-warp
// barrier, so a missing barrier or a wrong lane index shows up here as it would on a GPU.
// Blocks run one after another (shared memory is a function-local static: one block owns
// it at a time).
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

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
#define __align__(n) alignas(n)
#define __launch_bounds__(...)
// One block runs at a time, so a function-local static is that block's shared memory.
#define __shared__ static

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

// Atomics on plain memory, through std::atomic_ref (C++20).
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
