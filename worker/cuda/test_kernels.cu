// Test kernels of the sm_80 primitives that kernels.cu defines (mma_m16n8k16_bf16,
// ldmatrix_*, cp_async_*): not used by the worker. They are compiled after kernels.cu,
// in the same unit, both by the host device's build (cuda/host/runtime.cpp, which makes
// them launchable there by name: HostDevice::launch_args) and by NVRTC for sm_80/90/100
// in worker/tests/primitives.rs, which runs them on the host device against the fragment
// layouts of the PTX ISA written out independently in Rust. Every kernel's name starts
// with hdtest_.

// One m16n8k16 MMA per warp from raw fragments: lane L of warp w (w counted over the whole
// grid) takes a[4·(32w + L) ..][4], b[2·(32w + L) ..][2] and c[4·(32w + L) ..][4], and
// writes its d likewise. Which element is in which register is the caller's business.
extern "C" __global__ void hdtest_mma_raw(float* d, const unsigned* a, const unsigned* b, const float* c) {
    const long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned fa[4], fb[2];
    float fc[4], fd[4];
    for (int j = 0; j < 4; ++j) fa[j] = a[4 * t + j];
    for (int j = 0; j < 2; ++j) fb[j] = b[2 * t + j];
    for (int j = 0; j < 4; ++j) fc[j] = c[4 * t + j];
    mma_m16n8k16_bf16(fd, fa, fb, fc);
    for (int j = 0; j < 4; ++j) d[4 * t + j] = fd[j];
}

// ldmatrix of `variant` (0 x1, 1 x2, 2 x4, 3 x1.trans, 4 x2.trans, 5 x4.trans) over a
// 32-row tile of 8 bf16 per row (src, 256 elements) staged in shared memory: lane L
// points at row row_of_lane[L] and writes its registers to out[4L ..] (only as many as
// the variant loads). One warp.
__shared__ __align__(16) unsigned short hdtest_ldm_tile[32][8];
extern "C" __global__ void hdtest_ldmatrix(unsigned* out, const unsigned short* src, const int* row_of_lane, int variant) {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < 256; i += 32) hdtest_ldm_tile[i / 8][i % 8] = src[i];
    __syncwarp();
    const void* p = &hdtest_ldm_tile[row_of_lane[lane]][0];
    unsigned r[4] = {0, 0, 0, 0};
    if (variant == 0) {
        unsigned x[1];
        ldmatrix_x1(x, p);
        r[0] = x[0];
    } else if (variant == 1 || variant == 4) {
        unsigned x[2];
        if (variant == 1) ldmatrix_x2(x, p);
        else ldmatrix_x2_trans(x, p);
        r[0] = x[0], r[1] = x[1];
    } else if (variant == 3) {
        unsigned x[1];
        ldmatrix_x1_trans(x, p);
        r[0] = x[0];
    } else if (variant == 2) {
        ldmatrix_x4(r, p);
    } else {
        ldmatrix_x4_trans(r, p);
    }
    const int n = variant % 3 == 0 ? 1 : variant % 3 == 1 ? 2 : 4;
    for (int i = 0; i < n; ++i) out[4 * lane + i] = r[i];
}

// d[16][8] (row-major) = a[16][16] (row-major) · B + c[16][8], the way an attention kernel
// does it: A staged in shared memory and loaded with ldmatrix.x4; B from bkn[16][8] (k, n;
// as V is stored) with ldmatrix.x2.trans when `b_kn`, else from bnk[8][16] (n, k; as K is
// stored, Kᵀ's columns) with ldmatrix.x2; the result scattered from the accumulator
// layout. One warp.
__shared__ __align__(16) unsigned short hdtest_a_tile[16][16];
__shared__ __align__(16) unsigned short hdtest_b_kn[16][8];
__shared__ __align__(16) unsigned short hdtest_b_nk[8][16];
extern "C" __global__ void hdtest_ldmatrix_mma(float* d, const unsigned short* a, const unsigned short* b, const float* c, int b_kn) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int i = lane; i < 256; i += 32) hdtest_a_tile[i / 16][i % 16] = a[i];
    for (int i = lane; i < 128; i += 32) {
        if (b_kn) hdtest_b_kn[i / 8][i % 8] = b[i];
        else hdtest_b_nk[i / 16][i % 16] = b[i];
    }
    __syncwarp();
    // A: matrix i = lane / 8 holds rows 8·(i & 1).., columns 8·(i >> 1)..; row lane % 8.
    const int mi = lane >> 3, mr = lane & 7;
    unsigned fa[4], fb[2];
    ldmatrix_x4(fa, &hdtest_a_tile[mr + 8 * (mi & 1)][8 * (mi >> 1)]);
    // B: matrix j = k 8j..8j+7 (lanes 0..15 give the addresses; the rest are not read).
    const int bl = lane & 15;
    if (b_kn) ldmatrix_x2_trans(fb, &hdtest_b_kn[bl][0]);
    else ldmatrix_x2(fb, &hdtest_b_nk[bl & 7][8 * (bl >> 3)]);
    float fc[4], fd[4];
    for (int i = 0; i < 4; ++i) fc[i] = c[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
    mma_m16n8k16_bf16(fd, fa, fb, fc);
    for (int i = 0; i < 4; ++i) d[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = fd[i];
}

// A two-stage cp.async pipeline of 64 threads: `tiles` tiles of 256 f32 from `in`, each
// thread copying 16 bytes of a tile, then every thread reading the 16 bytes that the next
// thread copied into out (after a barrier). `mode`: 0 as it should be (wait_group 1 before
// the barrier); 1 without the wait (a wait_all only at the end); 2 copies never committed
// before a wait_group 0 (which does not cover them; wait_all at the end); 3 one stage per
// tile with cp.async.ca and wait_all.
__shared__ __align__(16) float hdtest_stage[2][256];
extern "C" __global__ void hdtest_cp_async(float* out, const float* in, int tiles, int mode) {
    const int tid = threadIdx.x, peer = (tid + 1) & 63;
    if (mode == 3) {
        for (int t = 0; t < tiles; ++t) {
            cp_async_ca16(&hdtest_stage[0][4 * tid], &in[256L * t + 4 * tid]);
            cp_async_wait_all();
            __syncthreads();
            for (int e = 0; e < 4; ++e) out[256L * t + 4 * peer + e] = hdtest_stage[0][4 * peer + e];
            __syncthreads();
        }
        return;
    }
    cp_async_cg16(&hdtest_stage[0][4 * tid], &in[4 * tid]);
    if (mode != 2) cp_async_commit();
    for (int t = 0; t < tiles; ++t) {
        if (t + 1 < tiles) cp_async_cg16(&hdtest_stage[(t + 1) & 1][4 * tid], &in[256L * (t + 1) + 4 * tid]);
        if (mode != 2) cp_async_commit();
        if (mode == 0) cp_async_wait_group<1>();
        if (mode == 2) cp_async_wait_group<0>();
        __syncthreads();
        for (int e = 0; e < 4; ++e) out[256L * t + 4 * peer + e] = hdtest_stage[t & 1][4 * peer + e];
        __syncthreads();
    }
    cp_async_wait_all();
}

// The key-span summaries the attention kernels compute in parallel, for the 64 rows of
// CTA b (128 threads) of `spans` (tq rows): the FlashAttention-2 forward's (each lane's
// two rows loaded as that kernel loads them, fa2_range_warp, a barrier, fa2_range: 6 ints)
// at out[22·b ..], then attn_range's over each warp's 16 rows (the one-warp kernels' row
// blocks: 4 ints) at out[22·b + 6 + 4·warp ..].
__shared__ int hdtest_span_part[4][6];
__shared__ int hdtest_span_range[4][4];
extern "C" __global__ void hdtest_span_ranges(int* out, const int* spans, int tq) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const int first = blockIdx.x * FA2_ROWS;
    const int row[2] = {first + warp * 16 + g, first + warp * 16 + g + 8};
    int sp[2][4];
    for (int r = 0; r < 2; ++r)
        for (int e = 0; e < 4; ++e) sp[r][e] = row[r] < tq ? spans[4 * row[r] + e] : 0;
    fa2_range_warp(hdtest_span_part[warp], sp, row, tq);
    attn_range(hdtest_span_range[warp], spans, first + warp * 16, tq);
    __syncthreads();
    int range[6];
    fa2_range(range, hdtest_span_part, 4);
    if (threadIdx.x == 0)
        for (int e = 0; e < 6; ++e) out[22 * blockIdx.x + e] = range[e];
    if (lane == 0)
        for (int e = 0; e < 4; ++e) out[22 * blockIdx.x + 6 + 4 * warp + e] = hdtest_span_range[warp][e];
}
