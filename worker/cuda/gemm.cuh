// The experts' grouped GEMM; dense GEMMs are cuBLAS's (worker/src/device/ops/gemm.rs).
// Included by kernels.cu, after the families above it.

// ---------------------------------------------------------------------------------------
// Mixture of experts: the grouped GEMM, one launch per projection for every expert.
// y[r, :] = x[src(r), :] · W_eᵀ for each routed row r of expert e (offsets[e] ≤ r <
// offsets[e + 1], moe_permute's order), W_e = w + e·n·k (`[n, k]`, a linear layer's
// weight), src(r) = rows[r] when gathering (gather > 0: x has `gather` rows, the normed
// tokens, so the gate+up projection reads them in place and no gathered copy is made),
// else r. The row counts never leave the device: the grid covers the most row tiles any
// routing of `pairs` rows can have (ceil(pairs / MOE_BM) + min(experts, pairs)) times
// ceil(n / MOE_BN) column tiles, CTA i taking row tile i / col_tiles; each CTA finds its
// expert and rows from the offsets (moe_gemm_tile), and those past the routing's tiles
// return at once.
#define MOE_BM 64
#define MOE_BN 128
#define MOE_BK 32
#define MOE_LD (MOE_BK + 8)  // row stride (elements): 80 bytes, 16-byte rows off the banks' period
#define MOE_STAGES 3
#define MOE_THREADS 128
// 3 stages × (64 + 128) rows × 40 bf16.
#define MOE_DYN_BYTES 46080

namespace moe_shared {
DYNAMIC_SHARED(moe_tiles, MOE_DYN_BYTES);
__shared__ int tile[3];  // expert (−1: none), first row, end row
}  // namespace moe_shared

// Expert e's rows [moe_first(e), moe_first(e) + moe_count(e)), clamped to [0, pairs).
__device__ __forceinline__ int moe_first(const int* offsets, int e, int pairs) {
    const int a = offsets[e];
    return a < 0 ? 0 : (a > pairs ? pairs : a);
}
__device__ __forceinline__ int moe_count(const int* offsets, int e, int pairs) {
    const int a = moe_first(offsets, e, pairs), b = offsets[e + 1];
    return b < a ? 0 : (b > pairs ? pairs : b) - a;
}

// Row tile mt of the routing (the experts' tiles in expert order, ceil(rows / MOE_BM)
// each) into tile[] as (expert, first row, end row), expert −1 past the last tile. By one
// whole warp: lane l sums the tiles of its run of experts, an inclusive scan over the lanes
// gives each run's first tile, and the lane whose run holds mt walks it.
__device__ __forceinline__ void moe_gemm_tile(int* tile, const int* offsets, int experts, int pairs, int mt) {
    const int lane = threadIdx.x & 31, per = (experts + 31) / 32;
    const int e0 = lane * per < experts ? lane * per : experts;
    const int e1 = e0 + per < experts ? e0 + per : experts;
    int mine = 0;
    for (int e = e0; e < e1; ++e) mine += (moe_count(offsets, e, pairs) + MOE_BM - 1) / MOE_BM;
    int incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += v;
    }
    const int total = __shfl_sync(FULL_MASK, incl, 31);
    if (lane == 0 && mt >= total) tile[0] = -1;
    if (mt >= incl - mine && mt < incl) {
        int first = incl - mine;
        for (int e = e0; e < e1; ++e) {
            const int c = moe_count(offsets, e, pairs), nt = (c + MOE_BM - 1) / MOE_BM;
            if (mt < first + nt) {
                const int a = moe_first(offsets, e, pairs);
                tile[0] = e;
                tile[1] = a + (mt - first) * MOE_BM;
                tile[2] = a + c;
                break;
            }
            first += nt;
        }
    }
}

// The CTA's tile (both grouped GEMMs): its row tile's (expert, first row, end row) into
// moe_shared::tile by the first warp, seen by all after the barrier; returns the column
// tile.
__device__ __forceinline__ int moe_gemm_begin(const int* offsets, int experts, int pairs, int n) {
    const int col_tiles = (n + MOE_BN - 1) / MOE_BN;
    if (threadIdx.x < 32) moe_gemm_tile(moe_shared::tile, offsets, experts, pairs, blockIdx.x / col_tiles);
    __syncthreads();
    return blockIdx.x % col_tiles;
}

// x's row for permuted row r: rows[r] clamped to x's `gather` rows when gathering, else r.
__device__ __forceinline__ int moe_source_row(const int* rows, int r, int gather) {
    if (gather <= 0) return r;
    const int src = rows[r];
    return src < 0 ? 0 : (src >= gather ? gather - 1 : src);
}

// k-block kb of the CTA's A rows (2 chunks of 16 bytes a thread) and B rows (4) into
// stage `s`: thread i copies column (i & 3)·8 of rows (i >> 2) + 32·j with cp.async. A
// row past the expert's (or a column past n) is a copy of one in range: A row i only
// reaches y's row i and B row j y's column j, which are not stored, so no zeros and no
// check per copy are needed. For whole k-blocks of a k that is a multiple of 8.
__device__ __forceinline__ void moe_gemm_load(unsigned short* s, const unsigned short* const (&a)[2], const unsigned short* const (&b)[4], int kb) {
    const int row = threadIdx.x >> 2, col = (threadIdx.x & 3) * 8, kc = kb * MOE_BK + col;
    unsigned short* as = s + row * MOE_LD + col;
    unsigned short* bs = s + (MOE_BM + row) * MOE_LD + col;
    for (int j = 0; j < 2; ++j) cp_async_cg16(as + j * 32 * MOE_LD, a[j] + kc);
    for (int j = 0; j < 4; ++j) cp_async_cg16(bs + j * 32 * MOE_LD, b[j] + kc);
}

// moe_gemm_load for the k-blocks past k's whole ones (the last one partial, or every one
// for a k that is no multiple of 8): element by element, zeros past k (they reach every
// output), stored by the threads.
__device__ __noinline__ void moe_gemm_load_edge(unsigned short* s, const unsigned short* a0, const unsigned short* a1, const unsigned short* b0, const unsigned short* b1, const unsigned short* b2, const unsigned short* b3, int kb, int k) {
    const int row = threadIdx.x >> 2, col = (threadIdx.x & 3) * 8, kc = kb * MOE_BK + col;
    const unsigned short* src[6] = {a0, a1, b0, b1, b2, b3};
    for (int j = 0; j < 6; ++j) {
        unsigned short* d = s + ((j < 2 ? 0 : MOE_BM) + row + 32 * (j < 2 ? j : j - 2)) * MOE_LD + col;
        for (int e = 0; e < 8; ++e) d[e] = kc + e < k ? src[j][kc + e] : (unsigned short)0;
    }
}

// One k-block of stage `s` into the warp's 32 × 64 accumulators: per k-step of 16, A
// by ldmatrix x4 (matrices 0..3: rows +0, +8 at columns +0, then +0, +8 at +8: the A
// fragment's registers) and B likewise (matrix i: rows nj·16 + 8·(i >> 1).. at columns
// 8·(i & 1)..; registers 0, 1 the fragment of n-tile 2nj, 2, 3 of 2nj + 1), 16 MMAs.
__device__ __forceinline__ void moe_gemm_block(float (&acc)[2][8][4], const unsigned short* s, int wm, int wn, int lane) {
    const unsigned short* as = s + (wm + (lane & 15)) * MOE_LD + (lane >> 4) * 8;
    const unsigned short* bs = s + (MOE_BM + wn + (lane & 7) + ((lane >> 4) << 3)) * MOE_LD + ((lane >> 3) & 1) * 8;
    for (int kk = 0; kk < MOE_BK; kk += 16) {
        unsigned af[2][4], bf[8][2];
        for (int mi = 0; mi < 2; ++mi) ldmatrix_x4(af[mi], as + mi * 16 * MOE_LD + kk);
        for (int nj = 0; nj < 4; ++nj) {
            unsigned r[4];
            ldmatrix_x4(r, bs + nj * 16 * MOE_LD + kk);
            bf[2 * nj][0] = r[0];
            bf[2 * nj][1] = r[1];
            bf[2 * nj + 1][0] = r[2];
            bf[2 * nj + 1][1] = r[3];
        }
        for (int mi = 0; mi < 2; ++mi)
            for (int ni = 0; ni < 8; ++ni) mma_m16n8k16_bf16(acc[mi][ni], af[mi], bf[ni], acc[mi][ni]);
    }
}

// The grouped GEMM on tensor cores (bf16 x, w and y, f32 accumulators, y rounded once).
// A CTA is 4 warps over a 64 × 128 tile of y (warp w: rows 32·(w & 1).., columns
// 64·(w >> 1)..; 2 × 8 m16n8k16 MMAs per k-step), k in blocks of 32 staged through shared
// memory by cp.async, 3 stages (two blocks in flight while one is computed); a k-block
// past k's whole ones is stored by the threads instead (moe_gemm_load_edge, a call out of
// the loop's way). Grid: see above; MOE_THREADS threads.
extern "C" __global__ void moe_gemm_bf16(unsigned short* y, const unsigned short* x, const unsigned short* w, const int* offsets, const int* rows, int gather, int experts, int pairs, int n, int k) {
    using namespace moe_shared;
    const int nt = moe_gemm_begin(offsets, experts, pairs, n);
    const int e = tile[0], r0 = tile[1], r1 = tile[2];
    if (e < 0) return;
    unsigned short* smem = (unsigned short*)moe_tiles;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wm = (warp & 1) * 32, wn = (warp >> 1) * 64;
    const unsigned short* we = w + (long)e * n * k;
    // The thread's source rows: A rows (i >> 2) + 32·j of the tile, B rows likewise; one
    // past the expert's rows reads its first row, one past n column 0 (see moe_gemm_load).
    const unsigned short* asrc[2];
    const unsigned short* bsrc[4];
    for (int j = 0; j < 2; ++j) {
        const int rr = r0 + (threadIdx.x >> 2) + 32 * j;
        asrc[j] = x + (long)moe_source_row(rows, rr < r1 ? rr : r0, gather) * k;
    }
    for (int j = 0; j < 4; ++j) {
        const int c = nt * MOE_BN + (threadIdx.x >> 2) + 32 * j;
        bsrc[j] = we + (long)(c < n ? c : 0) * k;
    }
    const int kblocks = (k + MOE_BK - 1) / MOE_BK, kwhole = (k & 7) == 0 ? k / MOE_BK : 0;
    constexpr int STAGE = (MOE_BM + MOE_BN) * MOE_LD;
    float acc[2][8][4];
    for (int mi = 0; mi < 2; ++mi)
        for (int ni = 0; ni < 8; ++ni)
            for (int i = 0; i < 4; ++i) acc[mi][ni][i] = 0.0f;
    // k-block kb into stage `st`: whole blocks by cp.async, the others element by element.
    auto load = [&](int st, int kb) {
        if (kb < kwhole) moe_gemm_load(smem + st * STAGE, asrc, bsrc, kb);
        else if (kb < kblocks) moe_gemm_load_edge(smem + st * STAGE, asrc[0], asrc[1], bsrc[0], bsrc[1], bsrc[2], bsrc[3], kb, k);
    };
    for (int s = 0; s < MOE_STAGES - 1; ++s) {
        load(s, s);
        cp_async_commit();
    }
    // Stage `rs` is computed while `ws` (the one computed last iteration: every thread
    // has passed the barrier since) is filled.
    int rs = 0, ws = MOE_STAGES - 1;
    for (int kb = 0; kb < kblocks; ++kb) {
        cp_async_wait_group<MOE_STAGES - 2>();
        __syncthreads();
        load(ws, kb + MOE_STAGES - 1);
        cp_async_commit();
        moe_gemm_block(acc, smem + rs * STAGE, wm, wn, lane);
        rs = rs + 1 == MOE_STAGES ? 0 : rs + 1;
        ws = ws + 1 == MOE_STAGES ? 0 : ws + 1;
    }
    cp_async_wait_all();
    // Element i of an accumulator: row g + 8·(i >> 1), column 2t + (i & 1) of its tile.
    const bool pairs_ok = (n & 1) == 0;
    for (int mi = 0; mi < 2; ++mi)
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + wm + mi * 16 + g + 8 * h;
            if (r >= r1) continue;
            unsigned short* yr = y + (long)r * n;
            for (int ni = 0; ni < 8; ++ni) {
                const int c = nt * MOE_BN + wn + ni * 8 + 2 * t;
                const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
                if (pairs_ok && c + 1 < n) {
                    *(unsigned*)(yr + c) = pack_bf16(v0, v1);
                } else {
                    if (c < n) yr[c] = to_bf16(v0);
                    if (c + 1 < n) yr[c + 1] = to_bf16(v1);
                }
            }
        }
}

// moe_gemm_bf16 for f32 x, w and y, exactly in f32 (CUDA cores): the same grid and tiles,
// thread i of the CTA computing column i of the tile for its rows, 8 rows at a time.
extern "C" __global__ void moe_gemm(float* y, const float* x, const float* w, const int* offsets, const int* rows, int gather, int experts, int pairs, int n, int k) {
    using namespace moe_shared;
    const int nt = moe_gemm_begin(offsets, experts, pairs, n);
    const int e = tile[0], r0 = tile[1], r1 = tile[2];
    const int c = nt * MOE_BN + threadIdx.x;
    if (e < 0 || c >= n) return;
    const float* wc = w + ((long)e * n + c) * k;
    const int end = r0 + MOE_BM < r1 ? r0 + MOE_BM : r1;
    for (int rb = r0; rb < end; rb += 8) {
        const float* xr[8];
        for (int j = 0; j < 8; ++j) xr[j] = x + (long)moe_source_row(rows, rb + j < end ? rb + j : rb, gather) * k;
        float acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
        for (int kk = 0; kk < k; ++kk) {
            const float wv = wc[kk];
            for (int j = 0; j < 8; ++j) acc[j] = fmaf(xr[j][kk], wv, acc[j]);
        }
        for (int j = 0; j < 8 && rb + j < end; ++j) y[(long)(rb + j) * n + c] = acc[j];
    }
}
