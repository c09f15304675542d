// Mixture of experts: routing, the permutation into expert order, the weighted sum back
// (worker/src/device/ops/moe.rs; the grouped GEMM is in gemm.cuh).
// Included by kernels.cu, after the families above it.

// ---------------------------------------------------------------------------------------
// Mixture of experts (Qwen3-MoE's sparse MLP): routing, the permutation into expert order,
// the weighted sum back; the experts' grouped GEMM between them is further down (moe_gemm).

// Per token (grid: tokens, one warp each): the softmax of its router logits (f32), the
// top_k largest (the lower expert first among equals) into idx [t, top_k] in rank order,
// their probabilities into wts, divided by their sum when norm.
template <typename T> __device__ void moe_route_t(int* idx, float* wts, const T* logits, int experts, int top_k, int norm) {
    const long row = blockIdx.x;
    const int lane = threadIdx.x;
    const T* l = logits + row * experts;
    int* ri = idx + row * top_k;
    float* rw = wts + row * top_k;
    float m = NEG_INF;
    for (int e = lane; e < experts; e += 32) m = fmaxf(m, ld(l, e));
    m = warp_max(m);
    float s = 0.0f;
    for (int e = lane; e < experts; e += 32) s += expf(ld(l, e) - m);
    s = warp_sum(s);
    float top_sum = 0.0f;
    for (int j = 0; j < top_k; j++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int e = lane; e < experts; e += 32) {
            bool taken = false;
            for (int q = 0; q < j; q++) taken = taken || ri[q] == e;
            const float v = ld(l, e);
            if (!taken && (v > bv || (v == bv && e < bi))) { bv = v; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (bi >= experts) bi = 0;  // NaN logits: any expert, never one out of range
        const float p = expf(bv - m) / s;
        top_sum += p;
        if (lane == 0) { ri[j] = bi; rw[j] = p; }
        __syncwarp();
    }
    if (norm && lane == 0)
        for (int j = 0; j < top_k; j++) rw[j] = rw[j] / top_sum;
}
extern "C" __global__ void moe_route(int* idx, float* wts, const float* logits, int experts, int top_k, int norm) { moe_route_t(idx, wts, logits, experts, top_k, norm); }
extern "C" __global__ void moe_route_bf16(int* idx, float* wts, const unsigned short* logits, int experts, int top_k, int norm) { moe_route_t(idx, wts, logits, experts, top_k, norm); }

// The (token, rank) pairs of idx in expert order: offsets[e]..offsets[e + 1] are expert
// e's rows, rows[r] the token of row r (ascending within an expert), slots[p] the row of
// pair p. Three launches, each parallel, no atomics but on shared memory, the same result
// on every run: moe_count (grid: a block per MOE_CHUNK pairs) counts each chunk's pairs per
// expert into counts[b, e]; moe_scan (one block) turns the counts into the offsets and
// each chunk's first row per expert; moe_place (a warp per chunk) writes each pair's row,
// the chunk's pairs in order. Experts up to MOE_MAX_EXPERTS (the config's bound).
#define MOE_CHUNK 256
#define MOE_MAX_EXPERTS 4096
namespace moe_shared {
__shared__ int per_expert[MOE_MAX_EXPERTS];  // moe_count's counts, moe_place's next rows
}  // namespace moe_shared

// An expert id as the kernels use it: one out of range (NaN logits cannot make one;
// moe_route never writes one) is expert 0, so a row is never written out of bounds.
__device__ __forceinline__ int moe_expert(const int* idx, long p, int experts) {
    const int e = idx[p];
    return e >= 0 && e < experts ? e : 0;
}

extern "C" __global__ void moe_count(int* counts, const int* idx, int pairs, int experts) {
    using namespace moe_shared;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) per_expert[e] = 0;
    __syncthreads();
    const long first = (long)blockIdx.x * MOE_CHUNK;
    for (long p = first + threadIdx.x; p < first + MOE_CHUNK && p < pairs; p += blockDim.x) atomicAdd(&per_expert[moe_expert(idx, p, experts)], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[(long)blockIdx.x * experts + e] = per_expert[e];
}

// One block: per expert (a thread each, in turn), its total over the chunks; the offsets
// as the exclusive scan of the totals (warp 0: each lane a run of experts, a scan over the
// lanes); then counts[b, e] becomes chunk b's first row of expert e.
extern "C" __global__ void moe_scan(int* offsets, int* counts, int chunks, int experts) {
    using namespace moe_shared;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int total = 0;
        for (int b = 0; b < chunks; ++b) total += counts[(long)b * experts + e];
        per_expert[e] = total;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x, per = (experts + 31) / 32;
        const int e0 = lane * per < experts ? lane * per : experts;
        const int e1 = e0 + per < experts ? e0 + per : experts;
        int mine = 0;
        for (int e = e0; e < e1; ++e) mine += per_expert[e];
        int incl = mine;
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl += v;
        }
        int at = incl - mine;
        for (int e = e0; e < e1; ++e) {
            const int c = per_expert[e];
            offsets[e] = at;
            per_expert[e] = at;
            at += c;
        }
        if (lane == 31) offsets[experts] = incl;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        int at = per_expert[e];
        for (int b = 0; b < chunks; ++b) {
            const long i = (long)b * experts + e;
            const int c = counts[i];
            counts[i] = at;
            at += c;
        }
    }
}

// A warp per chunk: its pairs in windows of 32, each lane's row the next row of its
// expert plus the lanes before it with the same expert (a pass of shuffles); the last
// such lane moves the expert's next row past the window's.
extern "C" __global__ void moe_place(int* rows, int* slots, const int* idx, const int* first_rows, int pairs, int top_k, int experts) {
    using namespace moe_shared;
    const int lane = threadIdx.x;
    for (int e = lane; e < experts; e += 32) per_expert[e] = first_rows[(long)blockIdx.x * experts + e];
    __syncwarp();
    const long first = (long)blockIdx.x * MOE_CHUNK;
    for (long w = first; w < first + MOE_CHUNK && w < pairs; w += 32) {
        const long p = w + lane;
        const int ex = p < pairs ? moe_expert(idx, p, experts) : -1;
        int before = 0, same = 0;
        for (int j = 0; j < 32; ++j) {
            const int o = __shfl_sync(FULL_MASK, ex, j);
            same += o == ex;
            before += o == ex && j < lane;
        }
        if (ex >= 0) {
            const int row = per_expert[ex] + before;
            rows[row] = (int)(p / top_k);
            slots[p] = row;
        }
        __syncwarp();
        if (ex >= 0 && before == same - 1) per_expert[ex] += same;
        __syncwarp();
    }
}

// out[t, :] = sum over its ranks q of wts[t, q] * y[slots[t, q], :] (grid: tokens).
template <typename T> __device__ void moe_combine_t(T* out, const T* y, const float* wts, const int* slots, int top_k, int h) {
    const long t = blockIdx.x;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        float acc = 0.0f;
        for (int q = 0; q < top_k; q++) acc += wts[t * top_k + q] * ld(y, (long)slots[t * top_k + q] * h + j);
        st(out, t * h + j, acc);
    }
}
extern "C" __global__ void moe_combine(float* out, const float* y, const float* wts, const int* slots, int top_k, int h) { moe_combine_t(out, y, wts, slots, top_k, h); }
extern "C" __global__ void moe_combine_bf16(unsigned short* out, const unsigned short* y, const float* wts, const int* slots, int top_k, int h) { moe_combine_t(out, y, wts, slots, top_k, h); }
