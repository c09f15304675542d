// Attention over key spans: the WMMA kernels and FlashAttention-2's forward and backward
// (worker/src/device/ops/attention.rs).
// Included by kernels.cu, after the families above it.

// ---------------------------------------------------------------------------------------
// Attention over explicit key spans, flash style on tensor cores: keys visited once with an
// online softmax, so the scores are never stored. Query row i sees keys [spans[4i],
// spans[4i+1]) and [spans[4i+2], spans[4i+3]) (a causal prefix, or for a DFlash block the
// context before its anchor and the block itself). q/out: [tq, qh·hd]; k/v: [tk, kvh·hd];
// lse: [tq, qh] (−inf for a row with no key, whose output is 0). hd <= 256.
//
// A block is one warp and ATTN_MMA_ROWS = 16 query rows of one head. Q (and in the
// backward dO) is staged in shared memory as bf16, keys and values 16 at a time, the head
// dims padded with zeros to a multiple of 16; every product is a 16×16×16 WMMA with bf16
// inputs and f32 accumulation. The softmax runs in f32 with two lanes per row (8 keys of a
// tile each); the probabilities (and in the backward dS) are rounded to bf16 for their
// product, as flash-attention does, while the row sums stay f32. Accumulators that
// outlive a tile (O) live in f32 shared memory, since which fragment element is which row
// is the GPU's secret. Static shared memory stays under the 48 KB a kernel may have
// without opting in. Grid: ceil(tq / 16) · qh blocks of 32 threads.
#define ATTN_MAX_HD 256
#define ATTN_MMA_ROWS 16
#define ATTN_MMA_LD (ATTN_MAX_HD + 8)   // bf16 rows: a multiple of 8 elements, off the banks' period
#define ATTN_MMA_OLD (ATTN_MAX_HD + 4)  // f32 rows: a multiple of 4

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, wmma::bf16, wmma::row_major> frag_a_row;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, wmma::bf16, wmma::col_major> frag_a_col;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, wmma::bf16, wmma::row_major> frag_b_row;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, wmma::bf16, wmma::col_major> frag_b_col;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> frag_acc;

// Rows [row0, row0 + 16) of head `h` of x (rows `w` apart, `n` rows in all) into a
// [16][ATTN_MMA_LD] bf16 tile, zero beyond `n`, beyond `hd`, and where `keep` says no.
template <typename T> __device__ __forceinline__ void attn_stage(unsigned short (*dst)[ATTN_MMA_LD], const T* x, int row0, int n, long w, int h, int hd, int hp, const float* keep) {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < 16 * hp; i += 32) {
        const int r = i / hp, d = i % hp, row = row0 + r;
        const bool in = row < n && d < hd && (keep == 0 || keep[r] != NEG_INF);
        dst[r][d] = in ? to_bf16(ld(x, row * w + (long)h * hd + d)) : (unsigned short)0;
    }
}

// The union of the spans of rows [first, first + 16) (of tq): [lo, hi) per span, written
// by lane 0 (lo > hi: no row has keys in that span). Called by the whole warp: lane l
// reads row first + l % 16, and the warp reduces (lanes l and l + 16 hold the same row).
__device__ __forceinline__ void attn_range(int* range, const int* spans, int first, int tq) {
    const int lane = threadIdx.x & 31, i = first + (lane & (ATTN_MMA_ROWS - 1));
    for (int r = 0; r < 2; ++r) {
        int lo = 0x7fffffff, hi = 0;
        if (i < tq) {
            const int a = spans[4 * i + 2 * r], b = spans[4 * i + 2 * r + 1];
            if (a < b) { lo = a; hi = b; }
        }
        lo = warp_min_i(lo);
        hi = warp_max_i(hi);
        if (lane == 0) {
            range[2 * r] = lo;
            range[2 * r + 1] = hi;
        }
    }
}

// attention_fwd_t's shared memory (no __shared__ in a template).
namespace attention_fwd_shared {
__shared__ __align__(32) unsigned short qs[ATTN_MMA_ROWS][ATTN_MMA_LD];
__shared__ __align__(32) unsigned short ks[16][ATTN_MMA_LD];
__shared__ __align__(32) unsigned short vs[16][ATTN_MMA_LD];
__shared__ __align__(32) float os[ATTN_MMA_ROWS][ATTN_MMA_OLD];
__shared__ __align__(32) float ss[ATTN_MMA_ROWS][16];
__shared__ __align__(32) unsigned short ps[ATTN_MMA_ROWS][16];
__shared__ float corr_s[ATTN_MMA_ROWS];
__shared__ float inv_s[ATTN_MMA_ROWS];
__shared__ int range[4];
}  // namespace attention_fwd_shared

template <typename T> __device__ void attention_fwd_t(T* out, float* lse, const T* q, const T* k, const T* v, const int* spans, int tq, int qh, int kvh, int hd) {
    using namespace attention_fwd_shared;
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.x % qh, first = (blockIdx.x / qh) * ATTN_MMA_ROWS;
    const int kh = head / (qh / kvh);
    const long qw = (long)qh * hd, kw = (long)kvh * hd;
    const int hp = (hd + 15) & ~15;
    const float scale = rsqrtf((float)hd);
    attn_stage(qs, q, first, tq, qw, head, hd, hp, (const float*)0);
    for (int i = lane; i < ATTN_MMA_ROWS * hp; i += 32) os[i / hp][i % hp] = 0.0f;
    attn_range(range, spans, first, tq);
    __syncwarp();
    // This lane's row of the block, and which 8 keys of a tile it scores.
    const int r = lane >> 1, part = lane & 1, row = first + r;
    const bool active = row < tq;
    float m = NEG_INF, l = 0.0f;
    for (int sp = 0; sp < 2; ++sp) {
        const int lo = range[2 * sp], hi = range[2 * sp + 1];
        const int mine_lo = active ? spans[4 * row + 2 * sp] : 0, mine_hi = active ? spans[4 * row + 2 * sp + 1] : 0;
        for (int t0 = lo; t0 < hi; t0 += 16) {
            attn_stage(ks, k, t0, hi, kw, kh, hd, hp, (const float*)0);
            attn_stage(vs, v, t0, hi, kw, kh, hd, hp, (const float*)0);
            __syncwarp();
            frag_acc s;
            wmma::fill_fragment(s, 0.0f);
            for (int c = 0; c < hp; c += 16) {
                frag_a_row a;
                frag_b_col b;  // Kᵀ: K's rows are its columns
                wmma::load_matrix_sync(a, &qs[0][c], ATTN_MMA_LD);
                wmma::load_matrix_sync(b, &ks[0][c], ATTN_MMA_LD);
                wmma::mma_sync(s, a, b, s);
            }
            wmma::store_matrix_sync(&ss[0][0], s, 16, wmma::mem_row_major);
            __syncwarp();
            // A row whose scores are all NaN (a NaN query) is skipped like a row without
            // keys: output 0, lse −inf, as the CPU backend's softmax gives it.
            float sv[8];
            unsigned valid = 0;
            float mt = NEG_INF;
            for (int e = 0; e < 8; ++e) {
                const int key = t0 + part * 8 + e;
                if (active && key >= mine_lo && key < mine_hi) valid |= 1u << e;
                sv[e] = (valid >> e) & 1u ? ss[r][part * 8 + e] * scale : NEG_INF;
                mt = fmaxf(mt, sv[e]);
            }
            mt = fmaxf(mt, __shfl_xor_sync(FULL_MASK, mt, 1));
            float corr = 1.0f, sum = 0.0f;
            if (mt != NEG_INF) {
                const float m_new = fmaxf(m, mt);
                corr = exp_neg(m - m_new);
                for (int e = 0; e < 8; ++e) {
                    const float p = (valid >> e) & 1u ? exp_neg(sv[e] - m_new) : 0.0f;
                    sum += p;
                    ps[r][part * 8 + e] = to_bf16(p);
                }
                m = m_new;
            } else {
                for (int e = 0; e < 8; ++e) ps[r][part * 8 + e] = 0;
            }
            sum += __shfl_xor_sync(FULL_MASK, sum, 1);
            l = l * corr + sum;
            if (part == 0) corr_s[r] = corr;
            __syncwarp();
            for (int i = lane; i < ATTN_MMA_ROWS * hp; i += 32) os[i / hp][i % hp] *= corr_s[i / hp];
            __syncwarp();
            frag_a_row pa;
            wmma::load_matrix_sync(pa, &ps[0][0], 16);
            for (int c = 0; c < hp; c += 16) {
                frag_b_row vb;
                frag_acc o;
                wmma::load_matrix_sync(vb, &vs[0][c], ATTN_MMA_LD);
                wmma::load_matrix_sync(o, &os[0][c], ATTN_MMA_OLD, wmma::mem_row_major);
                wmma::mma_sync(o, pa, vb, o);
                wmma::store_matrix_sync(&os[0][c], o, ATTN_MMA_OLD, wmma::mem_row_major);
            }
            __syncwarp();
        }
    }
    if (part == 0) inv_s[r] = l > 0.0f ? 1.0f / l : 0.0f;
    if (part == 0 && active) lse[(long)row * qh + head] = l > 0.0f ? m + logf(l) : NEG_INF;
    __syncwarp();
    for (int i = lane; i < ATTN_MMA_ROWS * hd; i += 32) {
        const int rr = i / hd, d = i % hd;
        if (first + rr < tq) st(out, (first + rr) * qw + (long)head * hd + d, os[rr][d] * inv_s[rr]);
    }
}
extern "C" __global__ void attention_fwd(float* out, float* lse, const float* q, const float* k, const float* v, const int* spans, int tq, int qh, int kvh, int hd) {
    attention_fwd_t(out, lse, q, k, v, spans, tq, qh, kvh, hd);
}
extern "C" __global__ void attention_fwd_bf16(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, const int* spans, int tq, int qh, int kvh, int hd) {
    attention_fwd_t(out, lse, q, k, v, spans, tq, qh, kvh, hd);
}

// ---------------------------------------------------------------------------------------
// Attention forward in FlashAttention-2's structure, for bf16 or f32 q/k/v/out (f32 lse):
// the same contract as attention_fwd(_bf16) (spans, GQA, lse, a row with no key outputs 0
// with lse −inf), chosen by the host for head dims that are a multiple of 8 up to 128 with
// 16-byte aligned operands. With f32 activations (the drafter's) the threads round K and V
// to bf16 as they stage them, and Q as they load its fragments: the products are bf16 on
// tensor cores as in attention_fwd.
//
// A CTA is 4 warps × 16 query rows (FA2_ROWS) of one head. Its keys are visited in tiles
// of KT, each copied once into shared memory for all four warps with cp.async, double
// buffered (tile i + 1 is in flight while tile i is computed). Each warp keeps its Q
// fragments, its O accumulators and its rows' softmax statistics in registers for the
// whole loop: Q·Kᵀ and P·V are mma.sync m16n8k16 (bf16 in, f32 accumulators), K read
// with ldmatrix and V with ldmatrix.trans; the scores are scaled by log2(e)/√hd once, so
// the softmax is exp2; P goes from the S accumulators to A fragments in registers (the
// accumulator layout of two n-tiles is the A layout of one k-step). Masking: a tile that
// every row of the warp sees whole is not masked, one that no row sees is skipped.
// Grid: ceil(tq / 64) · qh CTAs of 128 threads, the last row block's first.
#define FA2_ROWS 64
#define FA2_THREADS 128
// Dynamic shared memory of the forward: 2 buffers × (K, V) × KT rows × (HD + 8) bf16,
// the largest over the head dims instantiated (HD 128: 8 · 64 · 136 bytes); a launch
// gives each instantiation its own (Kernel::dynamic_shared_bytes).
#define FA2_DYN_BYTES 69632

template <int HD> struct Fa2 {
    static constexpr int KT = 64;                   // keys per tile
    static constexpr int LD = HD + 8;               // row stride (elements): 16-byte rows, off the banks' period
    static constexpr int NK = HD / 16;              // k-steps of Q·Kᵀ
    static constexpr int ND = HD / 8;               // n-tiles of O
    static constexpr int NT = KT / 8;               // n-tiles of S
    static constexpr int SMEM_BYTES = 2 * 2 * KT * LD * 2;
    static_assert(SMEM_BYTES <= FA2_DYN_BYTES, "K and V tiles fit the shared buffer");
    static_assert(NK % 2 == 0 && ND % 2 == 0 && NT % 2 == 0, "fragments are taken in pairs");
};

// attention_fa2_fwd_t's shared memory (no __shared__ in a template).
namespace fa2_shared {
DYNAMIC_SHARED(kv_bytes, FA2_DYN_BYTES);
__shared__ int range_part[FA2_THREADS / 32][6];  // each warp's span summary (fa2_range_warp)
}  // namespace fa2_shared

// Two f32 to a bf16 pair (lo in the low half), round to nearest even, and 2^x flushed to 0
// below 2^-126: one instruction each on a GPU (cvt.rn.bf16x2.f32, ex2.approx.ftz), the same
// values by hand on the host device.
#ifdef __CUDACC_RTC__
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
#else
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) { return (unsigned)to_bf16(lo) | ((unsigned)to_bf16(hi) << 16); }
__device__ __forceinline__ float fast_exp2(float x) { return x < -126.0f ? 0.0f : exp2f(x); }
#endif

// Keys [start, end) of k and v (already at the head's columns; rows kw apart) into the
// tiles ks and vs (KT rows of LD), zeros beyond `end` and beyond `hd`, by all threads of the
// CTA: thread t copies the 16 bytes at column (t % CH)·8 of rows t / CH + j·RS with
// cp.async; a whole tile at the full head dim (the common case) with no check per copy.
template <int HD> __device__ __noinline__ void fa2_load_edge(unsigned short* kd, unsigned short* vd, const unsigned short* k, const unsigned short* v, long off, int key, int end, int c, long kw, int hd);
template <int HD> __device__ __forceinline__ void fa2_load(unsigned short* ks, unsigned short* vs, const unsigned short* k, const unsigned short* v, int start, int end, long kw, int hd) {
    constexpr int KT = Fa2<HD>::KT, LD = Fa2<HD>::LD, CH = HD / 8, RS = FA2_THREADS / CH, PASSES = KT / RS;
    static_assert(FA2_THREADS % CH == 0 && KT % RS == 0, "the CTA's threads cover a tile in whole passes");
    const int r0 = threadIdx.x / CH, c = (threadIdx.x % CH) * 8;
    const long off = (long)(start + r0) * kw + c;
    unsigned short* kd = ks + r0 * LD + c;
    unsigned short* vd = vs + r0 * LD + c;
    if (start + KT <= end && hd == HD) {
        for (int j = 0; j < PASSES; ++j) {
            cp_async_cg16(kd + j * RS * LD, k + off + j * RS * kw);
            cp_async_cg16(vd + j * RS * LD, v + off + j * RS * kw);
        }
    } else {
        fa2_load_edge<HD>(kd, vd, k, v, off, start + r0, end, c, kw, hd);
    }
}

// fa2_load's last tile of a span or a padded head dim, out of the main loop's way: each
// copy checked, zeros where there is nothing to copy.
template <int HD> __device__ __noinline__ void fa2_load_edge(unsigned short* kd, unsigned short* vd, const unsigned short* k, const unsigned short* v, long off, int key, int end, int c, long kw, int hd) {
    constexpr int KT = Fa2<HD>::KT, LD = Fa2<HD>::LD, CH = HD / 8, RS = FA2_THREADS / CH, PASSES = KT / RS;
    for (int j = 0; j < PASSES; ++j) {
        if (key + j * RS < end && c < hd) {
            cp_async_cg16(kd + j * RS * LD, k + off + j * RS * kw);
            cp_async_cg16(vd + j * RS * LD, v + off + j * RS * kw);
        } else {
            ((unsigned long long*)(kd + j * RS * LD))[0] = 0ull;
            ((unsigned long long*)(kd + j * RS * LD))[1] = 0ull;
            ((unsigned long long*)(vd + j * RS * LD))[0] = 0ull;
            ((unsigned long long*)(vd + j * RS * LD))[1] = 0ull;
        }
    }
}

// fa2_load for f32 k and v (the drafter's activations): read, rounded to bf16 and stored
// by the threads themselves (cp.async copies bytes, it does not convert), 8 values a copy.
template <int HD> __device__ __forceinline__ void fa2_load(unsigned short* ks, unsigned short* vs, const float* k, const float* v, int start, int end, long kw, int hd) {
    constexpr int KT = Fa2<HD>::KT, LD = Fa2<HD>::LD, CH = HD / 8, RS = FA2_THREADS / CH, PASSES = KT / RS;
    static_assert(FA2_THREADS % CH == 0 && KT % RS == 0, "the CTA's threads cover a tile in whole passes");
    const int r0 = threadIdx.x / CH, c = (threadIdx.x % CH) * 8;
    const long off = (long)(start + r0) * kw + c;
    for (int j = 0; j < PASSES; ++j) {
        unsigned* kd = (unsigned*)(ks + (r0 + j * RS) * LD + c);
        unsigned* vd = (unsigned*)(vs + (r0 + j * RS) * LD + c);
        const bool in = start + r0 + j * RS < end && c < hd;
        const float* kp = k + off + j * RS * kw;
        const float* vp = v + off + j * RS * kw;
        for (int e = 0; e < 4; ++e) {
            kd[e] = in ? pack_bf16(kp[2 * e], kp[2 * e + 1]) : 0u;
            vd[e] = in ? pack_bf16(vp[2 * e], vp[2 * e + 1]) : 0u;
        }
    }
}

// Two adjacent elements of q as a bf16 pair (f32 rounded once).
__device__ __forceinline__ unsigned fa2_pair(const unsigned short* p, long i) { return *(const unsigned*)(p + i); }
__device__ __forceinline__ unsigned fa2_pair(const float* p, long i) { return pack_bf16(p[i], p[i + 1]); }
// Store two adjacent outputs.
__device__ __forceinline__ void fa2_store(unsigned short* p, long i, float a, float b) { *(unsigned*)(p + i) = pack_bf16(a, b); }
__device__ __forceinline__ void fa2_store(float* p, long i, float a, float b) {
    p[i] = a;
    p[i + 1] = b;
}

// The key spans of a CTA's rows [first, first + FA2_ROWS) (of tq), summed up in parallel:
// per span the union's [lo, hi), and the intersection of the rows' first spans (the keys
// every row sees). fa2_range_warp: each lane holds its two rows' spans (`sp`, zeros for a
// row past tq), the warp reduces them (the four lanes of a row pair hold the same rows:
// lane bits 2 to 4 suffice) and lane 0 writes the warp's [lo, hi, lo, hi, ilo, ihi], lo
// > hi or ilo >= ihi where empty, to `part`. fa2_range: after a barrier, every thread
// combines the warps' into range[0..4] (each span's union, [0, 0) where empty) and
// range[4..6] (the intersection, [0, 0) where empty).
__device__ __forceinline__ void fa2_range_warp(int* part, const int (&sp)[2][4], const int (&row)[2], int tq) {
    int v[6] = {0x7fffffff, 0, 0x7fffffff, 0, 0, 0x7fffffff};
    for (int r = 0; r < 2; ++r) {
        for (int s = 0; s < 2; ++s) {
            const int a = sp[r][2 * s], b = sp[r][2 * s + 1];
            if (a < b) {
                v[2 * s] = a < v[2 * s] ? a : v[2 * s];
                v[2 * s + 1] = b > v[2 * s + 1] ? b : v[2 * s + 1];
            }
        }
        if (row[r] < tq) {
            v[4] = sp[r][0] > v[4] ? sp[r][0] : v[4];
            v[5] = sp[r][1] < v[5] ? sp[r][1] : v[5];
        }
    }
    v[0] = warp_min_i(v[0], 4);
    v[1] = warp_max_i(v[1], 4);
    v[2] = warp_min_i(v[2], 4);
    v[3] = warp_max_i(v[3], 4);
    v[4] = warp_max_i(v[4], 4);
    v[5] = warp_min_i(v[5], 4);
    if ((threadIdx.x & 31) == 0)
        for (int e = 0; e < 6; ++e) part[e] = v[e];
}
__device__ __forceinline__ void fa2_range(int (&range)[6], const int (*part)[6], int warps) {
    int v[6] = {0x7fffffff, 0, 0x7fffffff, 0, 0, 0x7fffffff};
    for (int w = 0; w < warps; ++w) {
        for (int s = 0; s < 2; ++s) {
            v[2 * s] = part[w][2 * s] < v[2 * s] ? part[w][2 * s] : v[2 * s];
            v[2 * s + 1] = part[w][2 * s + 1] > v[2 * s + 1] ? part[w][2 * s + 1] : v[2 * s + 1];
        }
        v[4] = part[w][4] > v[4] ? part[w][4] : v[4];
        v[5] = part[w][5] < v[5] ? part[w][5] : v[5];
    }
    for (int s = 0; s < 3; ++s) {
        const int lo = v[2 * s], hi = v[2 * s + 1];
        range[2 * s] = lo < hi ? lo : 0;
        range[2 * s + 1] = lo < hi ? hi : 0;
    }
}

// One tile for one warp: S = Q·Kᵀ, scaled to log2 units and, when MASKED, kept only for
// the keys [lo[r], hi[r]) (tile-local) of the lane's row r; the online softmax (running
// max m and partial sums l of the lane's two rows, O rescaled); then O += P·V.
template <int HD, bool MASKED> __device__ __forceinline__ void fa2_tile(float (&o)[Fa2<HD>::ND][4], float (&m)[2], float (&l)[2], const unsigned (&qa)[Fa2<HD>::NK][4], const unsigned short* ks, const unsigned short* vs, const int (&lo)[2], const int (&hi)[2], float sl2) {
    typedef Fa2<HD> F;
    constexpr int LD = F::LD;
    const int lane = threadIdx.x & 31, t = lane & 3;
    float s[F::NT][4];
    for (int nt = 0; nt < F::NT; ++nt) {
        for (int i = 0; i < 4; ++i) s[nt][i] = 0.0f;
        // ldmatrix x4: matrix i is keys nt·8.. of dims kc·16 + 8i..; registers 0, 1 are the B
        // fragment of k-step kc, registers 2, 3 that of kc + 1.
        for (int kc = 0; kc < F::NK; kc += 2) {
            unsigned b[4];
            ldmatrix_x4(b, ks + (nt * 8 + (lane & 7)) * LD + kc * 16 + (lane >> 3) * 8);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_m16n8k16_bf16(s[nt], qa[kc], b0, s[nt]);
            mma_m16n8k16_bf16(s[nt], qa[kc + 1], b1, s[nt]);
        }
    }
    // Element i of n-tile nt: the lane's row i >> 1 (g + 8·(i >> 1)), key nt·8 + 2t + (i & 1).
    // The maximum is taken of the raw scores (the scale is positive) and the scale folded
    // into the exponent: p = 2^(s·sl2 − m), one FFMA and one MUFU.
    float mt[2] = {NEG_INF, NEG_INF};
    if (MASKED) {
        for (int nt = 0; nt < F::NT; ++nt)
            for (int i = 0; i < 4; ++i) {
                const int key = nt * 8 + 2 * t + (i & 1), r = i >> 1;
                s[nt][i] = key >= lo[r] && key < hi[r] ? s[nt][i] : NEG_INF;
                mt[r] = fmaxf(mt[r], s[nt][i]);
            }
    } else {
        for (int nt = 0; nt < F::NT; ++nt)
            for (int i = 0; i < 4; ++i) mt[i >> 1] = fmaxf(mt[i >> 1], s[nt][i]);
    }
    // A row with no key so far keeps m = −inf; it subtracts 0 instead (every p and its
    // correction are then 0). A NaN score (a NaN query) is no maximum; its row's sum turns
    // NaN, and such a row is written as one without keys.
    float mu[2];
    for (int r = 0; r < 2; ++r) {
        mt[r] = fmaxf(mt[r], __shfl_xor_sync(FULL_MASK, mt[r], 1));
        mt[r] = fmaxf(mt[r], __shfl_xor_sync(FULL_MASK, mt[r], 2));
        const float mn = fmaxf(m[r], mt[r] * sl2);
        mu[r] = mn == NEG_INF ? 0.0f : mn;
        const float corr = fast_exp2(m[r] - mu[r]);
        m[r] = mn;
        l[r] *= corr;
        for (int dt = 0; dt < F::ND; ++dt) {
            o[dt][2 * r] *= corr;
            o[dt][2 * r + 1] *= corr;
        }
    }
    // P in A fragments: k-step j covers n-tiles 2j (registers 0, 1) and 2j + 1 (2, 3).
    unsigned pa[F::NT / 2][4];
    for (int nt = 0; nt < F::NT; ++nt) {
        float p[4];
        for (int i = 0; i < 4; ++i) {
            p[i] = fast_exp2(fmaf(s[nt][i], sl2, -mu[i >> 1]));
            l[i >> 1] += p[i];
        }
        pa[nt >> 1][2 * (nt & 1)] = pack_bf16(p[0], p[1]);
        pa[nt >> 1][2 * (nt & 1) + 1] = pack_bf16(p[2], p[3]);
    }
    // ldmatrix x4 .trans: matrix i is keys j·16 + 8·(i & 1).. of dims dt·8 + 8·(i >> 1)..;
    // registers 0, 1 are the B fragment of n-tile dt, registers 2, 3 that of dt + 1.
    for (int j = 0; j < F::NT / 2; ++j)
        for (int dt = 0; dt < F::ND; dt += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, vs + (j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dt * 8 + (lane >> 4) * 8);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_m16n8k16_bf16(o[dt], pa[j], b0, o[dt]);
            mma_m16n8k16_bf16(o[dt + 1], pa[j], b1, o[dt + 1]);
        }
}

template <int HD, typename T> __device__ void attention_fa2_fwd_t(T* out, float* lse, const T* q, const T* k, const T* v, const int* spans, int tq, int qh, int kvh, int hd) {
    using namespace fa2_shared;
    typedef Fa2<HD> F;
    constexpr int KT = F::KT, LD = F::LD;
    unsigned short* kv = (unsigned short*)kv_bytes;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // Row blocks longest first: the grid's first CTAs take the last rows, which in a causal
    // prefix (or DFlash blocks after a growing context) see the most keys, so the short
    // ones fill the tail of the grid. Any order is valid for any spans.
    const int row_blocks = (tq + FA2_ROWS - 1) / FA2_ROWS, rb = row_blocks - 1 - (int)(blockIdx.x / qh);
    if (rb < 0) return;  // a launch with more CTAs than row blocks (tq = 0: one CTA)
    const int head = blockIdx.x % qh, first = rb * FA2_ROWS;
    const int kh = head / (qh / kvh);
    const long qw = (long)qh * hd, kw = (long)kvh * hd;
    const float sl2 = rsqrtf((float)hd) * 1.4426950408889634f;
    const T* kh_k = k + (long)kh * hd;
    const T* kh_v = v + (long)kh * hd;
    // The lane's two rows (g and g + 8 of its warp's 16) and their spans; a row past tq
    // sees nothing.
    const int row[2] = {first + warp * 16 + g, first + warp * 16 + g + 8};
    int sp[2][4];
    for (int r = 0; r < 2; ++r)
        for (int e = 0; e < 4; ++e) sp[r][e] = row[r] < tq ? spans[4 * row[r] + e] : 0;
    fa2_range_warp(range_part[warp], sp, row, tq);
    // Q's A fragments, straight from global memory: register j of k-step kc holds row
    // g + 8·(j & 1), dims kc·16 + 8·(j >> 1) + 2t + {0, 1}.
    unsigned qa[F::NK][4];
    for (int kc = 0; kc < F::NK; ++kc)
        for (int j = 0; j < 4; ++j) {
            const int rr = row[j & 1], d = kc * 16 + 8 * (j >> 1) + 2 * t;
            qa[kc][j] = rr < tq && d < hd ? fa2_pair(q, rr * qw + (long)head * hd + d) : 0u;
        }
    float o[F::ND][4];
    for (int dt = 0; dt < F::ND; ++dt)
        for (int i = 0; i < 4; ++i) o[dt][i] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    __syncthreads();
    int range[6];
    fa2_range(range, range_part, FA2_THREADS / 32);
    const int lo0 = range[0], hi0 = range[1], lo1 = range[2], hi1 = range[3];
    const int n0 = (hi0 - lo0 + KT - 1) / KT, n = n0 + (hi1 - lo1 + KT - 1) / KT;
    // Tile i: keys [start, start + KT) ∩ [start, end).
    #define FA2_START(i) ((i) < n0 ? lo0 + (i) * KT : lo1 + ((i) - n0) * KT)
    #define FA2_END(i) ((i) < n0 ? hi0 : hi1)
    // The tiles of the first span that every row of the CTA sees whole, [ua, ub), are
    // visited first, in a loop with no mask; then the others. Step j visits tile
    // FA2_TILE(j).
    const bool whole = range[5] > range[4];
    const int ua_ = whole ? (range[4] - lo0 + KT - 1) / KT : 0, ub_ = whole ? (range[5] - lo0) / KT : 0;
    const int ua = ua_ < n0 ? ua_ : n0, ub = ub_ < ua ? ua : (ub_ < n0 ? ub_ : n0);
    const int nu = ub - ua;
    #define FA2_TILE(j) ((j) < nu ? ua + (j) : ((j) - nu < ua ? (j) - nu : (j)))
    // Issue tile j + 1's copies (tile 0's before the loops), then wait for tile j's.
    auto advance = [&](int j) {
        if (j + 1 < n) {
            unsigned short* nb = kv + ((j + 1) & 1) * 2 * KT * LD;
            const int nt = FA2_TILE(j + 1);
            fa2_load<HD>(nb, nb + KT * LD, kh_k, kh_v, FA2_START(nt), FA2_END(nt), kw, hd);
            cp_async_commit();
            cp_async_wait_group<1>();
        } else {
            cp_async_wait_group<0>();
        }
        __syncthreads();
    };
    if (n > 0) {
        fa2_load<HD>(kv, kv + KT * LD, kh_k, kh_v, FA2_START(FA2_TILE(0)), FA2_END(FA2_TILE(0)), kw, hd);
        cp_async_commit();
    }
    const int none[2] = {0, 0};
    for (int j = 0; j < nu; ++j) {
        advance(j);
        const unsigned short* ks = kv + (j & 1) * 2 * KT * LD;
        fa2_tile<HD, false>(o, m, l, qa, ks, ks + KT * LD, none, none, sl2);
        __syncthreads();
    }
    for (int j = nu; j < n; ++j) {
        advance(j);
        // Tile i holds keys [start, stop) of span union sp (0, then 1); a row sees those of
        // them in its own span sp (tile-local [lo, hi)), so a key that two spans' unions
        // share is counted by the tile of the row's span only, once.
        const int i = FA2_TILE(j);
        const int sp_i = i < n0 ? 0 : 1;
        const int start = FA2_START(i), end = FA2_END(i), stop = start + KT < end ? start + KT : end;
        const unsigned short* ks = kv + (j & 1) * 2 * KT * LD;
        int lo[2], hi[2];
        bool any = false;
        for (int r = 0; r < 2; ++r) {
            const int a = sp_i ? sp[r][2] : sp[r][0], b = sp_i ? sp[r][3] : sp[r][1];
            lo[r] = a - start;
            hi[r] = (b < stop ? b : stop) - start;
            any = any || (a < b && a < stop && start < b);
        }
        if (__any_sync(FULL_MASK, any)) fa2_tile<HD, true>(o, m, l, qa, ks, ks + KT * LD, lo, hi, sl2);
        __syncthreads();
    }
    #undef FA2_TILE
    #undef FA2_START
    #undef FA2_END
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
        if (t == 0 && row[r] < tq) lse[(long)row[r] * qh + head] = l[r] > 0.0f ? (m[r] + log2f(l[r])) * 0.6931471805599453f : NEG_INF;
    }
    // A row without keys (l = 0) or with a NaN sum is written as zeros.
    const bool kept[2] = {l[0] > 0.0f, l[1] > 0.0f};
    const float inv[2] = {kept[0] ? 1.0f / l[0] : 0.0f, kept[1] ? 1.0f / l[1] : 0.0f};
    for (int dt = 0; dt < F::ND; ++dt) {
        const int d = dt * 8 + 2 * t;
        if (d >= hd) continue;
        for (int r = 0; r < 2; ++r)
            if (row[r] < tq) fa2_store(out, row[r] * qw + (long)head * hd + d, kept[r] ? o[dt][2 * r] * inv[r] : 0.0f, kept[r] ? o[dt][2 * r + 1] * inv[r] : 0.0f);
    }
}
extern "C" __global__ void attention_fa2_fwd_hd32(float* out, float* lse, const float* q, const float* k, const float* v, const int* spans, int tq, int qh, int kvh, int hd) {
    attention_fa2_fwd_t<32>(out, lse, q, k, v, spans, tq, qh, kvh, hd);
}
extern "C" __global__ void attention_fa2_fwd_bf16_hd32(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, const int* spans, int tq, int qh, int kvh, int hd) {
    attention_fa2_fwd_t<32>(out, lse, q, k, v, spans, tq, qh, kvh, hd);
}
extern "C" __global__ void attention_fa2_fwd_hd64(float* out, float* lse, const float* q, const float* k, const float* v, const int* spans, int tq, int qh, int kvh, int hd) {
    attention_fa2_fwd_t<64>(out, lse, q, k, v, spans, tq, qh, kvh, hd);
}
extern "C" __global__ void attention_fa2_fwd_bf16_hd64(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, const int* spans, int tq, int qh, int kvh, int hd) {
    attention_fa2_fwd_t<64>(out, lse, q, k, v, spans, tq, qh, kvh, hd);
}
extern "C" __global__ void attention_fa2_fwd_hd128(float* out, float* lse, const float* q, const float* k, const float* v, const int* spans, int tq, int qh, int kvh, int hd) {
    attention_fa2_fwd_t<128>(out, lse, q, k, v, spans, tq, qh, kvh, hd);
}
extern "C" __global__ void attention_fa2_fwd_bf16_hd128(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, const int* spans, int tq, int qh, int kvh, int hd) {
    attention_fa2_fwd_t<128>(out, lse, q, k, v, spans, tq, qh, kvh, hd);
}

// ---------------------------------------------------------------------------------------
// Attention backward in FlashAttention-2's structure, for f32 activations (the drafter's)
// and f32 gradients, from the forward's lse: the same contract as attention_bwd (dq, dk,
// dv accumulate; a row with lse −inf takes no part), chosen by the host where the forward
// takes FlashAttention-2 (head dim a multiple of 8 up to 128, 16-byte aligned operands).
//
// First attention_bwd_prep, one warp per (row, head): D = Σ_d dO ∘ O, and Q and dO rounded
// to bf16 once (zeros, and D = 0, for a row with lse −inf, so it reaches no gradient);
// warp i < ceil(tq / 32) also sums up the key spans of rows 32i.. (per span the union's
// [lo, hi) and the intersection's: FA2B_SUMMARY ints). Then attention_fa2_bwd: a CTA owns
// FA2B_KEYS = 64 keys of one KV head (warp w the 16 keys 16w..), stages them once in
// shared memory (K, as bf16) and in registers (V's A fragments), and visits the tiles of
// BR query rows of every query head of its group that see any of its keys, as their
// summaries say: first those whose every row sees all 64 keys, in a loop with no mask,
// then the others, masked per row. Per tile (Q and dO copied in with cp.async) each warp
// computes, for its 16 keys: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (mma.sync m16n8k16, Q and dO read
// with ldmatrix), Pᵀ = exp2(Sᵀ·log2(e)/√hd − lse·log2(e)), dSᵀ = Pᵀ ∘ (dPᵀ − D)/√hd, then
// dV += Pᵀ·dO and dK += dSᵀ·Q (ldmatrix.trans) with the accumulators in registers for the
// whole loop: no atomics on dK or dV, each written once at the end. dSᵀ goes to shared
// memory as bf16, and the four warps compute dQ = dS·K for the tile (ldmatrix.trans for
// both), added to dq with f32 atomics (dq's rows are shared by every CTA of the head's
// keys). Grid: ceil(tk / 64) · kvh CTAs of 128 threads.
#define FA2B_KEYS 64
#define FA2B_SMEM_BYTES 40960
#define FA2B_GROUP 32   // query rows per span summary
#define FA2B_SUMMARY 8  // ints per summary: union lo, hi of span 0, of span 1; intersection's

template <int HD> struct Fa2b {
    static constexpr int BR = HD >= 128 ? 32 : 64;  // query rows per tile
    static constexpr int LD = HD + 8;               // K, Q, dO row stride (elements)
    static constexpr int SLD = BR + 8;              // dSᵀ row stride (elements)
    static constexpr int NK = HD / 16;              // k-steps over the head dim
    static constexpr int ND = HD / 8;               // n-tiles over the head dim
    static constexpr int NR = BR / 8;               // n-tiles over a tile's rows
    static constexpr int MT = BR / 16;              // m-tiles of dQ
    static constexpr int WPM = 4 / MT;              // warps per m-tile of dQ
    static constexpr int NDW = ND / WPM;            // dQ n-tiles per warp
    // Byte offsets in the shared buffer.
    static constexpr int K_OFF = 0;
    static constexpr int Q_OFF = K_OFF + FA2B_KEYS * LD * 2;
    static constexpr int DO_OFF = Q_OFF + BR * LD * 2;
    static constexpr int DS_OFF = DO_OFF + BR * LD * 2;
    static constexpr int L_OFF = DS_OFF + FA2B_KEYS * SLD * 2;  // lse·log2(e) per row (f32)
    static constexpr int D_OFF = L_OFF + BR * 4;                // D per row (f32)
    static constexpr int SP_OFF = D_OFF + BR * 4;               // spans per row (4 i32)
    static constexpr int BYTES = SP_OFF + BR * 16;
    static_assert(BYTES <= FA2B_SMEM_BYTES, "the tiles fit the shared buffer");
    static_assert(BR % FA2B_GROUP == 0 && BR / FA2B_GROUP <= 2, "a tile is one or two span summaries");
    static_assert(MT * WPM == 4 && NDW % 2 == 0 && NK % 2 == 0 && NR % 2 == 0, "the warps cover the tiles in pairs of fragments");
};

// 16- and 8-byte vectors of our own (one load or store each on a GPU).
struct __align__(16) fa2b_f4 { float x, y, z, w; };
struct __align__(16) fa2b_u4 { unsigned x, y, z, w; };
struct __align__(16) fa2b_i4 { int x, y, z, w; };
struct __align__(8) fa2b_f2 { float x, y; };

namespace fa2b_shared {
__shared__ __align__(16) unsigned char smem[FA2B_SMEM_BYTES];
}  // namespace fa2b_shared

extern "C" __global__ void attention_bwd_prep(float* delta, unsigned short* q16, unsigned short* do16, int* tiles, const float* dout, const float* out, const float* lse, const float* q, const int* spans, int tq, int qh, int hd) {
    const long i = (long)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (i < (long)tq * qh) {
        const long base = (i / qh) * (long)qh * hd + (i % qh) * (long)hd;
        const bool keep = lse[i] != NEG_INF;
        float s = 0.0f;
        for (int d = 2 * lane; d < hd; d += 64) {
            const float* o = out + base + d;
            const float* g = dout + base + d;
            const float* x = q + base + d;
            s += g[0] * o[0] + g[1] * o[1];
            *(unsigned*)(q16 + base + d) = keep ? pack_bf16(x[0], x[1]) : 0u;
            *(unsigned*)(do16 + base + d) = keep ? pack_bf16(g[0], g[1]) : 0u;
        }
        s = warp_sum(s);
        if (lane == 0) delta[i] = keep ? s : 0.0f;
    }
    if (i < (tq + FA2B_GROUP - 1) / FA2B_GROUP) {
        const int row = (int)i * FA2B_GROUP + lane;
        const bool in = row < tq;
        int v[FA2B_SUMMARY];
        for (int sp = 0; sp < 2; ++sp) {
            const int a = in ? spans[4 * row + 2 * sp] : 0, b = in ? spans[4 * row + 2 * sp + 1] : 0;
            const int lo = warp_min_i(in && a < b ? a : 0x7fffffff), hi = warp_max_i(in && a < b ? b : 0);
            const int ilo = warp_max_i(in ? a : 0), ihi = warp_min_i(in ? b : 0x7fffffff);
            v[2 * sp] = lo < hi ? lo : 0;
            v[2 * sp + 1] = lo < hi ? hi : 0;
            v[4 + 2 * sp] = ilo < ihi ? ilo : 0;
            v[4 + 2 * sp + 1] = ilo < ihi ? ihi : 0;
        }
        if (lane < FA2B_SUMMARY) {
            int x = v[0];
            for (int e = 1; e < FA2B_SUMMARY; ++e) x = lane == e ? v[e] : x;
            tiles[i * FA2B_SUMMARY + lane] = x;
        }
    }
}

// Rows [row0, row0 + ROWS) of a bf16 x (at its head's columns, rows w apart) into a tile
// (ROWS × LD) with cp.async, by all threads: zeros beyond `end` and beyond `hd`; a whole
// tile at the full head dim with no check per copy.
template <int HD, int ROWS> __device__ __noinline__ void fa2b_load_edge(unsigned short* dst, const unsigned short* x, int row0, int end, long w, int hd);
template <int HD, int ROWS> __device__ __forceinline__ void fa2b_load(unsigned short* dst, const unsigned short* x, int row0, int end, long w, int hd) {
    constexpr int CH = HD / 8, RS = FA2_THREADS / CH, LD = Fa2b<HD>::LD;
    static_assert(FA2_THREADS % CH == 0 && ROWS % RS == 0, "the CTA's threads cover the tile in whole passes");
    if (row0 + ROWS <= end && hd == HD) {
        const int r0 = threadIdx.x / CH, c = (threadIdx.x % CH) * 8;
        for (int j = 0; j < ROWS / RS; ++j) cp_async_cg16(dst + (r0 + j * RS) * LD + c, x + (long)(row0 + r0 + j * RS) * w + c);
    } else {
        fa2b_load_edge<HD, ROWS>(dst, x, row0, end, w, hd);
    }
}
template <int HD, int ROWS> __device__ __noinline__ void fa2b_load_edge(unsigned short* dst, const unsigned short* x, int row0, int end, long w, int hd) {
    constexpr int CH = HD / 8, RS = FA2_THREADS / CH, LD = Fa2b<HD>::LD;
    const int r0 = threadIdx.x / CH, c = (threadIdx.x % CH) * 8;
    for (int j = 0; j < ROWS / RS; ++j) {
        const int r = r0 + j * RS;
        unsigned short* p = dst + r * LD + c;
        if (row0 + r < end && c < hd) {
            cp_async_cg16(p, x + (long)(row0 + r) * w + c);
        } else {
            ((unsigned long long*)p)[0] = 0ull;
            ((unsigned long long*)p)[1] = 0ull;
        }
    }
}

// K rows [k0, k0 + FA2B_KEYS) of a f32 k (at its head's columns, rows w apart), rounded to
// bf16, zeros beyond `end` and beyond `hd`.
template <int HD> __device__ __forceinline__ void fa2b_stage_k(unsigned short* dst, const float* x, int k0, int end, long w, int hd) {
    constexpr int CH = HD / 8, RS = FA2_THREADS / CH, LD = Fa2b<HD>::LD;
    const int r0 = threadIdx.x / CH, c = (threadIdx.x % CH) * 8;
    for (int j = 0; j < FA2B_KEYS / RS; ++j) {
        const int r = r0 + j * RS, row = k0 + r;
        const bool in = row < end && c < hd;
        const float* p = x + (long)row * w + c;
        const fa2b_f4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
        const fa2b_f4 a = in ? *(const fa2b_f4*)p : zero;
        const fa2b_f4 b = in ? *(const fa2b_f4*)(p + 4) : zero;
        fa2b_u4 u;
        u.x = pack_bf16(a.x, a.y);
        u.y = pack_bf16(a.z, a.w);
        u.z = pack_bf16(b.x, b.y);
        u.w = pack_bf16(b.z, b.w);
        *(fa2b_u4*)(dst + r * LD + c) = u;
    }
}

// Two adjacent f32 added atomically to global memory: one vector reduction on sm_90 and
// later (red.add.v2.f32), two scalar ones before.
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void fa2b_red2(float* p, float a, float b) { asm volatile("red.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory"); }
#else
__device__ __forceinline__ void fa2b_red2(float* p, float a, float b) {
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
}
#endif

// What the CTA's accumulators and its tile loop share.
template <int HD> struct Fa2bCta {
    float dka[Fa2b<HD>::ND][4], dva[Fa2b<HD>::ND][4];
    unsigned va[Fa2b<HD>::NK][4];
};

// One tile of BR query rows (from `first`, head `head`) for the CTA's 64 keys from k0:
// staged, then dK, dV (the CTA's registers) and dq (atomics). MASKED: each score kept only
// where its row's spans hold its key.
template <int HD, bool MASKED> __device__ __forceinline__ void fa2b_tile(Fa2bCta<HD>& c, float* dq, const float* delta, const unsigned short* q16, const unsigned short* do16, const float* lse, const int* spans, int first, int head, int k0, int tq, int qh, int hd, float sl2, float scale) {
    typedef Fa2b<HD> F;
    constexpr int LD = F::LD, SLD = F::SLD, BR = F::BR;
    using fa2b_shared::smem;
    const unsigned short* ks = (const unsigned short*)(smem + F::K_OFF);
    unsigned short* qs = (unsigned short*)(smem + F::Q_OFF);
    unsigned short* dos = (unsigned short*)(smem + F::DO_OFF);
    unsigned short* dss = (unsigned short*)(smem + F::DS_OFF);
    float* l2s = (float*)(smem + F::L_OFF);
    float* ds_ = (float*)(smem + F::D_OFF);
    int* sps = (int*)(smem + F::SP_OFF);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const long qw = (long)qh * hd;
    fa2b_load<HD, BR>(qs, q16 + (long)head * hd, first, tq, qw, hd);
    fa2b_load<HD, BR>(dos, do16 + (long)head * hd, first, tq, qw, hd);
    cp_async_commit();
    if (threadIdx.x < BR) {
        const int row = first + threadIdx.x;
        const float L = row < tq ? lse[(long)row * qh + head] : NEG_INF;
        l2s[threadIdx.x] = L == NEG_INF ? POS_INF : L * 1.4426950408889634f;
        ds_[threadIdx.x] = row < tq ? delta[(long)row * qh + head] : 0.0f;
        if (MASKED) {
            fa2b_i4 s = {0, 0, 0, 0};
            if (row < tq) s = *(const fa2b_i4*)(spans + 4 * row);
            ((fa2b_i4*)sps)[threadIdx.x] = s;
        }
    }
    cp_async_wait_group<0>();
    __syncthreads();
    // Sᵀ and dPᵀ: the warp's 16 keys × the tile's BR rows.
    float s[F::NR][4], dp[F::NR][4];
    for (int nt = 0; nt < F::NR; ++nt)
        for (int i = 0; i < 4; ++i) s[nt][i] = dp[nt][i] = 0.0f;
    for (int kc = 0; kc < F::NK; kc += 2) {
        // K's A fragments of k-steps kc and kc + 1 (ldmatrix x4: matrix i is keys
        // 8·(i & 1).., dims 8·(i >> 1)..).
        unsigned ka0[4], ka1[4];
        ldmatrix_x4(ka0, ks + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + kc * 16 + (lane >> 4) * 8);
        ldmatrix_x4(ka1, ks + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (kc + 1) * 16 + (lane >> 4) * 8);
        for (int nt = 0; nt < F::NR; ++nt) {
            unsigned b[4];
            ldmatrix_x4(b, qs + (nt * 8 + (lane & 7)) * LD + kc * 16 + (lane >> 3) * 8);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_m16n8k16_bf16(s[nt], ka0, b0, s[nt]);
            mma_m16n8k16_bf16(s[nt], ka1, b1, s[nt]);
            ldmatrix_x4(b, dos + (nt * 8 + (lane & 7)) * LD + kc * 16 + (lane >> 3) * 8);
            const unsigned c0[2] = {b[0], b[1]}, c1[2] = {b[2], b[3]};
            mma_m16n8k16_bf16(dp[nt], c.va[kc], c0, dp[nt]);
            mma_m16n8k16_bf16(dp[nt], c.va[kc + 1], c1, dp[nt]);
        }
    }
    // Element i of n-tile nt: key g + 8·(i >> 1) of the warp's, row nt·8 + 2t + (i & 1) of
    // the tile. Pᵀ and dSᵀ go to A fragments (k-step j: n-tiles 2j and 2j + 1), and dSᵀ
    // to shared memory for dQ.
    unsigned pa[F::NR / 2][4], dsa[F::NR / 2][4];
    const int key0 = k0 + warp * 16 + g;
    for (int nt = 0; nt < F::NR; ++nt) {
        const int col = nt * 8 + 2 * t;
        const fa2b_f2 L = *(const fa2b_f2*)(l2s + col), D = *(const fa2b_f2*)(ds_ + col);
        float p[4], ds[4];
        for (int i = 0; i < 4; ++i) {
            float x = s[nt][i];
            if (MASKED) {
                const int key = key0 + 8 * (i >> 1);
                const fa2b_i4 sp = ((const fa2b_i4*)sps)[col + (i & 1)];
                const bool in = (key >= sp.x && key < sp.y) || (key >= sp.z && key < sp.w);
                x = in ? x : NEG_INF;
            }
            p[i] = fast_exp2(fmaf(x, sl2, -((i & 1) ? L.y : L.x)));
            ds[i] = p[i] * (dp[nt][i] - ((i & 1) ? D.y : D.x)) * scale;
        }
        pa[nt >> 1][2 * (nt & 1)] = pack_bf16(p[0], p[1]);
        pa[nt >> 1][2 * (nt & 1) + 1] = pack_bf16(p[2], p[3]);
        const unsigned d01 = pack_bf16(ds[0], ds[1]), d23 = pack_bf16(ds[2], ds[3]);
        dsa[nt >> 1][2 * (nt & 1)] = d01;
        dsa[nt >> 1][2 * (nt & 1) + 1] = d23;
        *(unsigned*)(dss + (warp * 16 + g) * SLD + col) = d01;
        *(unsigned*)(dss + (warp * 16 + g + 8) * SLD + col) = d23;
    }
    // dV += Pᵀ·dO and dK += dSᵀ·Q (ldmatrix x4 .trans: matrix i is rows j·16 + 8·(i & 1)..
    // of dims dt·8 + 8·(i >> 1)..; registers 0, 1 are n-tile dt's B, 2, 3 dt + 1's).
    for (int j = 0; j < F::NR / 2; ++j)
        for (int dt = 0; dt < F::ND; dt += 2) {
            const int off = (j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dt * 8 + (lane >> 4) * 8;
            unsigned b[4];
            ldmatrix_x4_trans(b, dos + off);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_m16n8k16_bf16(c.dva[dt], pa[j], b0, c.dva[dt]);
            mma_m16n8k16_bf16(c.dva[dt + 1], pa[j], b1, c.dva[dt + 1]);
            ldmatrix_x4_trans(b, qs + off);
            const unsigned c0[2] = {b[0], b[1]}, c1[2] = {b[2], b[3]};
            mma_m16n8k16_bf16(c.dka[dt], dsa[j], c0, c.dka[dt]);
            mma_m16n8k16_bf16(c.dka[dt + 1], dsa[j], c1, c.dka[dt + 1]);
        }
    __syncthreads();
    // dQ of the tile = dS·K over the CTA's 64 keys: warp w takes m-tile w / WPM and
    // n-tiles (w % WPM)·NDW..; dS's A fragments from dSᵀ (keys × rows) with .trans.
    // Rows past tq and dims past hd add nothing and are not written.
    const int mt = warp / F::WPM, dt0 = (warp % F::WPM) * F::NDW;
    float acc[F::NDW][4];
    for (int dt = 0; dt < F::NDW; ++dt)
        for (int i = 0; i < 4; ++i) acc[dt][i] = 0.0f;
    for (int kc = 0; kc < FA2B_KEYS / 16; ++kc) {
        unsigned a[4];
        ldmatrix_x4_trans(a, dss + (kc * 16 + (lane >> 4) * 8 + (lane & 7)) * SLD + mt * 16 + ((lane >> 3) & 1) * 8);
        for (int dt = 0; dt < F::NDW; dt += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, ks + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (dt0 + dt) * 8 + (lane >> 4) * 8);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_m16n8k16_bf16(acc[dt], a, b0, acc[dt]);
            mma_m16n8k16_bf16(acc[dt + 1], a, b1, acc[dt + 1]);
        }
    }
    for (int r = 0; r < 2; ++r) {
        const int row = first + mt * 16 + g + 8 * r;
        if (row >= tq) continue;
        float* p = dq + (long)row * qw + (long)head * hd + dt0 * 8 + 2 * t;
        for (int dt = 0; dt < F::NDW; ++dt)
            if ((dt0 + dt) * 8 < hd) fa2b_red2(p + dt * 8, acc[dt][2 * r], acc[dt][2 * r + 1]);
    }
}

template <int HD> __device__ void attention_fa2_bwd_t(float* dq, float* dk, float* dv, const float* delta, const unsigned short* q16, const unsigned short* do16, const int* tiles, const float* lse, const float* k, const float* v, const int* spans, int tq, int tk, int qh, int kvh, int hd) {
    typedef Fa2b<HD> F;
    constexpr int BR = F::BR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int kh = blockIdx.x % kvh, k0 = (blockIdx.x / kvh) * FA2B_KEYS;
    const int k1 = k0 + FA2B_KEYS < tk ? k0 + FA2B_KEYS : tk;
    const int group = qh / kvh;
    const long kw = (long)kvh * hd;
    const float scale = rsqrtf((float)hd), sl2 = scale * 1.4426950408889634f;
    fa2b_stage_k<HD>((unsigned short*)(fa2b_shared::smem + F::K_OFF), k + (long)kh * hd, k0, tk, kw, hd);
    Fa2bCta<HD> c;
    // V's A fragments for the warp's 16 keys: register j of k-step kc holds key
    // g + 8·(j & 1), dims kc·16 + 8·(j >> 1) + 2t + {0, 1}.
    for (int kc = 0; kc < F::NK; ++kc)
        for (int j = 0; j < 4; ++j) {
            const int key = k0 + warp * 16 + g + 8 * (j & 1), d = kc * 16 + 8 * (j >> 1) + 2 * t;
            const float* p = v + (long)key * kw + (long)kh * hd + d;
            c.va[kc][j] = key < tk && d < hd ? pack_bf16(p[0], p[1]) : 0u;
        }
    for (int dt = 0; dt < F::ND; ++dt)
        for (int i = 0; i < 4; ++i) c.dka[dt][i] = c.dva[dt][i] = 0.0f;
    // Whether the rows of tile qt see any of the keys [k0, k1) (from their spans' unions;
    // may say yes for a key in a gap) and all 64 of them (every row through one span).
    const int tiles_q = (tq + BR - 1) / BR, groups = (tq + FA2B_GROUP - 1) / FA2B_GROUP;
    auto flags = [&](int qt, bool& any, bool& all) {
        any = false;
        all = k1 == k0 + FA2B_KEYS;
        bool all0 = all, all1 = all;
        for (int e = 0; e < BR / FA2B_GROUP; ++e) {
            const int gi = qt * (BR / FA2B_GROUP) + e;
            if (gi >= groups) break;
            const fa2b_i4 u = *(const fa2b_i4*)(tiles + (long)gi * FA2B_SUMMARY);
            const fa2b_i4 x = *(const fa2b_i4*)(tiles + (long)gi * FA2B_SUMMARY + 4);
            any = any || (u.x < k1 && k0 < u.y) || (u.z < k1 && k0 < u.w);
            all0 = all0 && x.x <= k0 && k1 <= x.y;
            all1 = all1 && x.z <= k0 && k1 <= x.w;
        }
        all = all0 || all1;
    };
    // The tiles every row of which sees all the keys, without masks; then the others.
    for (int it = 0; it < group * tiles_q; ++it) {
        bool any, all;
        flags(it % tiles_q, any, all);
        if (!all) continue;
        fa2b_tile<HD, false>(c, dq, delta, q16, do16, lse, spans, (it % tiles_q) * BR, kh * group + it / tiles_q, k0, tq, qh, hd, sl2, scale);
    }
    for (int it = 0; it < group * tiles_q; ++it) {
        bool any, all;
        flags(it % tiles_q, any, all);
        if (all || !any) continue;
        fa2b_tile<HD, true>(c, dq, delta, q16, do16, lse, spans, (it % tiles_q) * BR, kh * group + it / tiles_q, k0, tq, qh, hd, sl2, scale);
    }
    // dK and dV of the warp's keys: this CTA's alone.
    for (int dt = 0; dt < F::ND; ++dt) {
        const int d = dt * 8 + 2 * t;
        if (d >= hd) continue;
        for (int r = 0; r < 2; ++r) {
            const int key = k0 + warp * 16 + g + 8 * r;
            if (key >= tk) continue;
            const long i = (long)key * kw + (long)kh * hd + d;
            dk[i] += c.dka[dt][2 * r];
            dk[i + 1] += c.dka[dt][2 * r + 1];
            dv[i] += c.dva[dt][2 * r];
            dv[i + 1] += c.dva[dt][2 * r + 1];
        }
    }
}
extern "C" __global__ void attention_fa2_bwd_hd32(float* dq, float* dk, float* dv, const float* delta, const unsigned short* q16, const unsigned short* do16, const int* tiles, const float* lse, const float* k, const float* v, const int* spans, int tq, int tk, int qh, int kvh, int hd) {
    attention_fa2_bwd_t<32>(dq, dk, dv, delta, q16, do16, tiles, lse, k, v, spans, tq, tk, qh, kvh, hd);
}
extern "C" __global__ void attention_fa2_bwd_hd64(float* dq, float* dk, float* dv, const float* delta, const unsigned short* q16, const unsigned short* do16, const int* tiles, const float* lse, const float* k, const float* v, const int* spans, int tq, int tk, int qh, int kvh, int hd) {
    attention_fa2_bwd_t<64>(dq, dk, dv, delta, q16, do16, tiles, lse, k, v, spans, tq, tk, qh, kvh, hd);
}
extern "C" __global__ void attention_fa2_bwd_hd128(float* dq, float* dk, float* dv, const float* delta, const unsigned short* q16, const unsigned short* do16, const int* tiles, const float* lse, const float* k, const float* v, const int* spans, int tq, int tk, int qh, int kvh, int hd) {
    attention_fa2_bwd_t<128>(dq, dk, dv, delta, q16, do16, tiles, lse, k, v, spans, tq, tk, qh, kvh, hd);
}

// One 16×16 tile of a gradient in the backward: a · b (b: 16 rows of a staged tile, from
// its column), through the scratch tile, each element (i, j) then handed to add(i, j, x)
// by one lane. The warp syncs before the scratch is read and again before it is reused.
template <class FA, class Add> __device__ __forceinline__ void attn_grad_tile(const FA& a, const unsigned short* b, float (*scr)[16], Add add) {
    frag_b_row fb;
    frag_acc f;
    wmma::fill_fragment(f, 0.0f);
    wmma::load_matrix_sync(fb, b, ATTN_MMA_LD);
    wmma::mma_sync(f, a, fb, f);
    wmma::store_matrix_sync(&scr[0][0], f, 16, wmma::mem_row_major);
    __syncwarp();
    for (int i = threadIdx.x & 31; i < 256; i += 32) add(i >> 4, i & 15, scr[i >> 4][i & 15]);
    __syncwarp();
}

// Backward of attention_fwd from its saved lse (flash-attention-2 style): the
// probabilities are recomputed, never read back; dq += ..., dk += ..., dv += .... Same
// blocks as the forward. Per tile of 16 keys: S = Q·Kᵀ and dP = dO·Vᵀ, then per row
// P = exp(S·scale − lse) and dS = P ∘ (dP − D)·scale with D = Σ dO ∘ O (f32), then
// dQ += dS·K, dK += dSᵀ·Q and dV += Pᵀ·dO, 16 head dims at a time through a 16×16 f32
// scratch tile: dq's rows belong to this block alone (plain adds), keys are shared by
// many blocks (atomic adds). A row with lse −inf (no key, or a NaN query) takes no part:
// its Q and dO are staged as zeros, so a NaN in it reaches no key's gradient.
extern "C" __global__ void attention_bwd(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse, const float* q, const float* k, const float* v, const int* spans, int tq, int qh, int kvh, int hd) {
    __shared__ __align__(32) unsigned short qs[ATTN_MMA_ROWS][ATTN_MMA_LD];
    __shared__ __align__(32) unsigned short dos[ATTN_MMA_ROWS][ATTN_MMA_LD];
    __shared__ __align__(32) unsigned short ks[16][ATTN_MMA_LD];
    __shared__ __align__(32) unsigned short vs[16][ATTN_MMA_LD];
    __shared__ __align__(32) float ss[ATTN_MMA_ROWS][16];
    __shared__ __align__(32) float dps[ATTN_MMA_ROWS][16];
    __shared__ __align__(32) float scr[16][16];
    __shared__ __align__(32) unsigned short ps[ATTN_MMA_ROWS][16];
    __shared__ __align__(32) unsigned short dss[ATTN_MMA_ROWS][16];
    __shared__ float ls[ATTN_MMA_ROWS];
    __shared__ int range[4];
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.x % qh, first = (blockIdx.x / qh) * ATTN_MMA_ROWS;
    const int kh = head / (qh / kvh);
    const long qw = (long)qh * hd, kw = (long)kvh * hd;
    const int hp = (hd + 15) & ~15;
    const float scale = rsqrtf((float)hd);
    const int r = lane >> 1, part = lane & 1, row = first + r;
    const bool active = row < tq;
    // D of this lane's row (f32, from the f32 dO and O), its lse; then Q and dO staged.
    float D = 0.0f;
    const float L = active ? lse[(long)row * qh + head] : NEG_INF;
    if (active && L != NEG_INF)
        for (int d = part; d < hd; d += 2) D += dout[row * qw + (long)head * hd + d] * out[row * qw + (long)head * hd + d];
    D += __shfl_xor_sync(FULL_MASK, D, 1);
    if (part == 0) ls[r] = L;
    attn_range(range, spans, first, tq);
    __syncwarp();
    attn_stage(qs, q, first, tq, qw, head, hd, hp, ls);
    attn_stage(dos, dout, first, tq, qw, head, hd, hp, ls);
    __syncwarp();
    for (int sp = 0; sp < 2; ++sp) {
        const int lo = range[2 * sp], hi = range[2 * sp + 1];
        const int mine_lo = active ? spans[4 * row + 2 * sp] : 0, mine_hi = active ? spans[4 * row + 2 * sp + 1] : 0;
        for (int t0 = lo; t0 < hi; t0 += 16) {
            attn_stage(ks, k, t0, hi, kw, kh, hd, hp, (const float*)0);
            attn_stage(vs, v, t0, hi, kw, kh, hd, hp, (const float*)0);
            __syncwarp();
            frag_acc s, dp;
            wmma::fill_fragment(s, 0.0f);
            wmma::fill_fragment(dp, 0.0f);
            for (int c = 0; c < hp; c += 16) {
                frag_a_row a;
                frag_b_col b;
                wmma::load_matrix_sync(a, &qs[0][c], ATTN_MMA_LD);
                wmma::load_matrix_sync(b, &ks[0][c], ATTN_MMA_LD);
                wmma::mma_sync(s, a, b, s);
                wmma::load_matrix_sync(a, &dos[0][c], ATTN_MMA_LD);
                wmma::load_matrix_sync(b, &vs[0][c], ATTN_MMA_LD);
                wmma::mma_sync(dp, a, b, dp);
            }
            wmma::store_matrix_sync(&ss[0][0], s, 16, wmma::mem_row_major);
            wmma::store_matrix_sync(&dps[0][0], dp, 16, wmma::mem_row_major);
            __syncwarp();
            for (int e = 0; e < 8; ++e) {
                const int j = part * 8 + e, key = t0 + j;
                const bool valid = active && L != NEG_INF && key >= mine_lo && key < mine_hi;
                const float p = valid ? exp_neg(ss[r][j] * scale - L) : 0.0f;
                ps[r][j] = to_bf16(p);
                dss[r][j] = to_bf16(valid ? p * (dps[r][j] - D) * scale : 0.0f);
            }
            __syncwarp();
            frag_a_row ds_a;  // dS, for dQ
            frag_a_col dst_a;  // dSᵀ, for dK: dS stored row-major is dSᵀ column-major
            frag_a_col pt_a;   // Pᵀ, for dV
            wmma::load_matrix_sync(ds_a, &dss[0][0], 16);
            wmma::load_matrix_sync(dst_a, &dss[0][0], 16);
            wmma::load_matrix_sync(pt_a, &ps[0][0], 16);
            for (int c = 0; c < hp; c += 16) {
                // dQ rows first..first+15, dims c..c+15: this block's alone.
                attn_grad_tile(ds_a, &ks[0][c], scr, [&](int i, int j, float x) {
                    const int d = c + j;
                    if (first + i < tq && d < hd) dq[(first + i) * qw + (long)head * hd + d] += x;
                });
                // dK and dV of keys t0..t0+15: shared with other blocks.
                attn_grad_tile(dst_a, &qs[0][c], scr, [&](int i, int j, float x) {
                    const int key = t0 + i, d = c + j;
                    if (key < hi && d < hd && x != 0.0f) atomicAdd(&dk[key * kw + (long)kh * hd + d], x);
                });
                attn_grad_tile(pt_a, &dos[0][c], scr, [&](int i, int j, float x) {
                    const int key = t0 + i, d = c + j;
                    if (key < hi && d < hd && x != 0.0f) atomicAdd(&dv[key * kw + (long)kh * hd + d], x);
                });
            }
        }
    }
}
