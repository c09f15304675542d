//! The reference ops: plain Rust, rows split across threads for the heavy ops.

use super::{AttnSaved, Heads, KeySpan};
pub use crate::math::{axpy, dot, sgemm};

pub struct Cpu {
    threads: usize,
}

impl Cpu {
    pub fn new() -> Cpu {
        Cpu {
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
        }
    }

    pub fn with_threads(threads: usize) -> Cpu {
        Cpu {
            threads: threads.max(1),
        }
    }

    /// How the `gemm` crate may split a product of `work` multiply-adds.
    pub fn par(&self, work: usize) -> gemm::Parallelism {
        if self.threads > 1 && work >= (1 << 22) {
            gemm::Parallelism::Rayon(self.threads)
        } else {
            gemm::Parallelism::None
        }
    }
}

impl Default for Cpu {
    fn default() -> Self {
        Cpu::new()
    }
}

/// A raw pointer handed to worker threads that write disjoint parts of one buffer.
struct SendPtr(*mut f32);
unsafe impl Sync for SendPtr {}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The reference ops, over host f32 slices.
impl Cpu {
    /// `y[m,n] = x[m,k] · w[n,k]ᵀ`
    pub fn matmul(&self, x: &[f32], w: &[f32], y: &mut [f32], m: usize, k: usize, n: usize) {
        assert_eq!(
            (x.len(), w.len(), y.len()),
            (m * k, n * k, m * n),
            "matmul shapes"
        );
        // y (row-major m×n) = x (row-major m×k) · wᵀ, where wᵀ is w read with swapped strides.
        let (yp, xp, wp) = (y.as_mut_ptr(), x.as_ptr(), w.as_ptr());
        unsafe {
            sgemm(
                self.par(m * n * k),
                m,
                n,
                k,
                yp,
                n,
                1,
                false,
                xp,
                k,
                1,
                wp,
                1,
                k as isize,
            )
        };
    }

    /// Backward of [`matmul`](Self::matmul): `dx += dy · w` (if given), `dw += dyᵀ · x`
    /// (if given).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward(
        &self,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        dx: Option<&mut [f32]>,
        dw: Option<&mut [f32]>,
        m: usize,
        k: usize,
        n: usize,
    ) {
        assert_eq!(
            (dy.len(), x.len(), w.len()),
            (m * n, m * k, n * k),
            "matmul_backward shapes"
        );
        let par = self.par(m * n * k);
        if let Some(dx) = dx {
            assert_eq!(dx.len(), m * k);
            // dx (m×k) += dy (m×n) · w (n×k)
            unsafe {
                sgemm(
                    par,
                    m,
                    k,
                    n,
                    dx.as_mut_ptr(),
                    k,
                    1,
                    true,
                    dy.as_ptr(),
                    n,
                    1,
                    w.as_ptr(),
                    k as isize,
                    1,
                )
            };
        }
        if let Some(dw) = dw {
            assert_eq!(dw.len(), n * k);
            // dw (n×k) += dyᵀ (n×m) · x (m×k)
            unsafe {
                sgemm(
                    par,
                    n,
                    k,
                    m,
                    dw.as_mut_ptr(),
                    k,
                    1,
                    true,
                    dy.as_ptr(),
                    1,
                    n as isize,
                    x.as_ptr(),
                    k as isize,
                    1,
                )
            };
        }
    }

    /// RMSNorm of each row of width `d`; returns the reciprocal RMS of each row.
    pub fn rmsnorm(&self, x: &[f32], w: &[f32], y: &mut [f32], d: usize, eps: f32) -> Vec<f32> {
        let mut rstd = Vec::with_capacity(x.len() / d);
        for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            let ms = xr.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / d as f64;
            let r = (1.0 / (ms + eps as f64).sqrt()) as f32;
            for ((yi, xi), wi) in yr.iter_mut().zip(xr).zip(w) {
                *yi = xi * r * wi;
            }
            rstd.push(r);
        }
        rstd
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(
        &self,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        mut dw: Option<&mut [f32]>,
        d: usize,
    ) {
        for (row, ((dyr, xr), dxr)) in dy
            .chunks_exact(d)
            .zip(x.chunks_exact(d))
            .zip(dx.chunks_exact_mut(d))
            .enumerate()
        {
            let r = rstd[row];
            // g = dy * w; dx = r*g - x * r³ * mean(g*x)
            let gx: f32 = dyr
                .iter()
                .zip(w)
                .zip(xr)
                .map(|((a, b), c)| a * b * c)
                .sum::<f32>()
                / d as f32;
            for i in 0..d {
                dxr[i] += r * dyr[i] * w[i] - xr[i] * r * r * r * gx;
            }
            if let Some(dw) = dw.as_deref_mut() {
                for i in 0..d {
                    dw[i] += dyr[i] * xr[i] * r;
                }
            }
        }
    }

    /// Rotary embedding in place on rows of `heads × head_dim`, row `i` at `positions[i]`
    /// (Hugging Face's rotate-half convention), cos and sin times `scale` (YaRN's attention
    /// factor, else 1); `inverse` applies the transpose (the backward).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut [f32],
        heads: usize,
        head_dim: usize,
        positions: &[usize],
        inv_freq: &[f32],
        scale: f32,
        inverse: bool,
    ) {
        let half = head_dim / 2;
        let sign = if inverse { -1.0 } else { 1.0 };
        for (row, &pos) in x.chunks_exact_mut(heads * head_dim).zip(positions) {
            for (i, f) in inv_freq.iter().enumerate() {
                let (s, c) = (pos as f32 * f).sin_cos();
                let (s, c) = (s * sign * scale, c * scale);
                for h in 0..heads {
                    let base = h * head_dim;
                    let (x1, x2) = (row[base + i], row[base + i + half]);
                    row[base + i] = x1 * c - x2 * s;
                    row[base + i + half] = x2 * c + x1 * s;
                }
            }
        }
    }

    /// `out = silu(gate) * up`
    pub fn swiglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = g * sigmoid(*g) * u;
        }
    }

    pub fn swiglu_backward(
        &self,
        dout: &[f32],
        gate: &[f32],
        up: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    ) {
        for i in 0..dout.len() {
            let (g, u, d) = (gate[i], up[i], dout[i]);
            let s = sigmoid(g);
            dup[i] += d * g * s;
            dgate[i] += d * u * s * (1.0 + g * (1.0 - s));
        }
    }

    /// Masked softmax attention. q: `[tq, q_heads·hd]`, k/v: `[tk, kv_heads·hd]`,
    /// out: `[tq, q_heads·hd]`. Scale 1/√hd.
    pub fn attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
        spans: &[KeySpan],
        h: Heads,
    ) -> AttnSaved {
        let qw = h.q_heads * h.head_dim;
        let mut offsets = Vec::with_capacity(spans.len() * h.q_heads);
        let mut total = 0;
        for s in spans {
            for _ in 0..h.q_heads {
                offsets.push(total);
                total += s.len();
            }
        }
        let mut probs = vec![0f32; total];
        out.fill(0.0);
        // Each (tile, head) is two GEMMs over the union of the tile's keys, with the keys a
        // row may not see masked.
        let jobs: Vec<(std::ops::Range<usize>, usize)> = query_tiles(spans)
            .iter()
            .flat_map(|t| (0..h.q_heads).map(move |hh| (t.clone(), hh)))
            .collect();
        let outp = SendPtr(out.as_mut_ptr());
        let probsp = SendPtr(probs.as_mut_ptr());
        let work: usize = spans.iter().map(|s| s.len()).sum::<usize>() * qw;
        let threads = if work < (1 << 16) {
            1
        } else {
            self.threads.min(jobs.len()).max(1)
        };
        let a = AttnJobs {
            q,
            k,
            v,
            spans,
            h,
            offsets: &offsets,
        };
        let next = std::sync::atomic::AtomicUsize::new(0);
        let run = || {
            let (outp, probsp) = (&outp, &probsp);
            let mut sc = Vec::new();
            loop {
                let j = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((tile, head)) = jobs.get(j) else {
                    break;
                };
                // SAFETY: `out` and `probs` outlive the jobs, and each job writes only its
                // own rows' head of `out` and their probabilities for that head.
                unsafe { a.tile_head(a.keys(tile.clone(), *head), &mut sc, outp.0, probsp.0) };
            }
        };
        if threads <= 1 {
            run();
        } else {
            // Each thread pulls jobs until none is left; where a thread cannot be started
            // (a thread limit), the calling thread pulls them instead.
            dflash_shared::threads::scoped((0..threads).map(|_| run));
        }
        AttnSaved { probs, offsets }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        dout: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        saved: &AttnSaved,
        spans: &[KeySpan],
        h: Heads,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    ) {
        let (hd, qw, kw) = (h.head_dim, h.q_heads * h.head_dim, h.kv_heads * h.head_dim);
        let group = h.q_heads / h.kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut dp = Vec::new();
        for (qi, span) in spans.iter().enumerate() {
            for head in 0..h.q_heads {
                let n = span.len();
                if n == 0 {
                    continue;
                }
                let kvh = head / group;
                let off = saved.offsets[qi * h.q_heads + head];
                let p = &saved.probs[off..off + n];
                let go = &dout[qi * qw + head * hd..qi * qw + (head + 1) * hd];
                dp.clear();
                let mut pdp = 0.0;
                for (pj, kj) in p.iter().zip(span.keys()) {
                    let vrow = &v[kj * kw + kvh * hd..kj * kw + (kvh + 1) * hd];
                    axpy(
                        *pj,
                        go,
                        &mut dv[kj * kw + kvh * hd..kj * kw + (kvh + 1) * hd],
                    );
                    let d = dot(go, vrow);
                    dp.push(d);
                    pdp += pj * d;
                }
                let qv = &q[qi * qw + head * hd..qi * qw + (head + 1) * hd];
                for ((pj, dpj), kj) in p.iter().zip(&dp).zip(span.keys()) {
                    let ds = pj * (dpj - pdp) * scale;
                    if ds == 0.0 {
                        continue;
                    }
                    axpy(
                        ds,
                        &k[kj * kw + kvh * hd..kj * kw + (kvh + 1) * hd],
                        &mut dq[qi * qw + head * hd..qi * qw + (head + 1) * hd],
                    );
                    axpy(
                        ds,
                        qv,
                        &mut dk[kj * kw + kvh * hd..kj * kw + (kvh + 1) * hd],
                    );
                }
            }
        }
    }
}

/// Tiles of consecutive query rows that share their second key range (a causal sequence:
/// any 64 rows; a DFlash block: its own rows).
fn query_tiles(spans: &[KeySpan]) -> Vec<std::ops::Range<usize>> {
    let mut tiles = Vec::new();
    let mut lo = 0;
    while lo < spans.len() {
        let mut hi = lo + 1;
        while hi < spans.len() && hi - lo < 64 && spans[hi].b == spans[lo].b {
            hi += 1;
        }
        tiles.push(lo..hi);
        lo = hi;
    }
    tiles
}

/// The keys of one (tile, head) job of [`Cpu::attention`]: the union `a_lo..a_lo + ka`
/// of the tile's rows' first key ranges and their shared second range `b`, side by side
/// as the `nk` columns of the tile's scores.
struct TileKeys {
    tile: std::ops::Range<usize>,
    head: usize,
    kvh: usize,
    a_lo: usize,
    ka: usize,
    b: std::ops::Range<usize>,
    nk: usize,
}

/// The operands of one [`Cpu::attention`], which its (tile, head) jobs share, and where
/// each (query row, head)'s probabilities start.
struct AttnJobs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    spans: &'a [KeySpan],
    h: Heads,
    offsets: &'a [usize],
}

impl AttnJobs<'_> {
    /// Head dimension, and the widths of a q row and a k/v row.
    fn widths(&self) -> (usize, usize, usize) {
        let h = self.h;
        (h.head_dim, h.q_heads * h.head_dim, h.kv_heads * h.head_dim)
    }

    /// The keys the rows of `tile` see, for query head `head`.
    fn keys(&self, tile: std::ops::Range<usize>, head: usize) -> TileKeys {
        let group = self.h.q_heads / self.h.kv_heads;
        let spans = &self.spans[tile.clone()];
        let a_lo = spans.iter().map(|s| s.a.start).min().unwrap_or(0);
        let a_hi = spans.iter().map(|s| s.a.end).max().unwrap_or(0).max(a_lo);
        let b = self.spans[tile.start].b.clone();
        let ka = a_hi - a_lo;
        TileKeys {
            nk: ka + b.len(),
            tile,
            head,
            kvh: head / group,
            a_lo,
            ka,
            b,
        }
    }

    /// One job: the tile's scores, their masked softmax (kept in `probs`), and the
    /// tile's rows of this head of `out`; `sc` is scratch.
    ///
    /// # Safety
    /// `out` and `probs` are the call's output and probabilities, and no other job writes
    /// this tile's rows of this head.
    unsafe fn tile_head(&self, t: TileKeys, sc: &mut Vec<f32>, out: *mut f32, probs: *mut f32) {
        if t.nk == 0 {
            return;
        }
        sc.clear();
        sc.resize(t.tile.len() * t.nk, 0.0);
        self.scores(&t, sc);
        unsafe {
            self.softmax(&t, sc, probs);
            self.values(&t, sc, out);
        }
    }

    /// `S[rows, nk] = Q[rows, hd] · K[keys, hd]ᵀ` (the two key ranges side by side).
    fn scores(&self, t: &TileKeys, sc: &mut [f32]) {
        let (hd, qw, kw) = self.widths();
        let (rows, ka, nk, kvh, b) = (t.tile.len(), t.ka, t.nk, t.kvh, &t.b);
        let qp = self.q[t.tile.start * qw + t.head * hd..].as_ptr();
        unsafe {
            sgemm(
                gemm::Parallelism::None,
                rows,
                ka,
                hd,
                sc.as_mut_ptr(),
                nk,
                1,
                false,
                qp,
                qw,
                1,
                self.k[t.a_lo * kw + kvh * hd..].as_ptr(),
                1,
                kw as isize,
            );
            if !b.is_empty() {
                sgemm(
                    gemm::Parallelism::None,
                    rows,
                    b.len(),
                    hd,
                    sc.as_mut_ptr().add(ka),
                    nk,
                    1,
                    false,
                    qp,
                    qw,
                    1,
                    self.k[b.start * kw + kvh * hd..].as_ptr(),
                    1,
                    kw as isize,
                );
            }
        }
    }

    /// Each row of the scores scaled, with the keys of the first range it may not see
    /// masked, and softmaxed in place; then copied into `probs` over the row's own keys.
    ///
    /// # Safety
    /// As [`tile_head`](Self::tile_head) for `probs`.
    unsafe fn softmax(&self, t: &TileKeys, sc: &mut [f32], probs: *mut f32) {
        let scale = 1.0 / (self.h.head_dim as f32).sqrt();
        let (ka, a_lo, b) = (t.ka, t.a_lo, &t.b);
        for (r, srow) in sc.chunks_exact_mut(t.nk).enumerate() {
            let span = &self.spans[t.tile.start + r];
            let mut max = f32::NEG_INFINITY;
            for (c, sv) in srow.iter_mut().enumerate() {
                let key = if c < ka { a_lo + c } else { b.start + c - ka };
                let allowed = if c < ka { span.a.contains(&key) } else { true };
                if allowed {
                    *sv *= scale;
                    max = max.max(*sv);
                } else {
                    *sv = f32::NEG_INFINITY;
                }
            }
            // Masked keys hold −∞ and become 0; a row with no key at all stays 0.
            if max == f32::NEG_INFINITY {
                srow.fill(0.0);
            } else {
                srow.iter_mut()
                    .for_each(|sv| *sv = crate::math::exp_neg(*sv - max));
                let sum: f32 = srow.iter().sum();
                let inv = 1.0 / sum;
                srow.iter_mut().for_each(|sv| *sv *= inv);
            }
            // This row's probabilities over its own keys, in KeySpan::keys order.
            let off = self.offsets[(t.tile.start + r) * self.h.q_heads + t.head];
            let dst = unsafe { std::slice::from_raw_parts_mut(probs.add(off), span.len()) };
            for (i, d) in dst.iter_mut().enumerate() {
                *d = if i < span.a.len() {
                    srow[span.a.start + i - a_lo]
                } else {
                    srow[ka + span.b.start + i - span.a.len() - b.start]
                };
            }
        }
    }

    /// `O[rows, hd] = P[rows, nk] · V[keys, hd]` into the tile's rows of this head.
    ///
    /// # Safety
    /// As [`tile_head`](Self::tile_head) for `out`.
    unsafe fn values(&self, t: &TileKeys, sc: &[f32], out: *mut f32) {
        let (hd, qw, kw) = self.widths();
        let (rows, ka, nk, kvh, b) = (t.tile.len(), t.ka, t.nk, t.kvh, &t.b);
        unsafe {
            let op = out.add(t.tile.start * qw + t.head * hd);
            sgemm(
                gemm::Parallelism::None,
                rows,
                hd,
                ka,
                op,
                qw,
                1,
                false,
                sc.as_ptr(),
                nk,
                1,
                self.v[t.a_lo * kw + kvh * hd..].as_ptr(),
                kw as isize,
                1,
            );
            if !b.is_empty() {
                sgemm(
                    gemm::Parallelism::None,
                    rows,
                    hd,
                    b.len(),
                    op,
                    qw,
                    1,
                    ka > 0,
                    sc.as_ptr().add(ka),
                    nk,
                    1,
                    self.v[b.start * kw + kvh * hd..].as_ptr(),
                    kw as isize,
                    1,
                );
            }
        }
    }
}
