//! The CPU backend: plain Rust, rows split across threads for the heavy ops.

use super::{AttnSaved, Backend, Heads, KeySpan};

pub struct Cpu {
    threads: usize,
}

impl Cpu {
    pub fn new() -> Cpu {
        Cpu { threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) }
    }

    pub fn with_threads(threads: usize) -> Cpu {
        Cpu { threads: threads.max(1) }
    }

    /// Run `f(row_range, chunk)` over `out` split into row blocks of `width`, on threads
    /// when the work is big enough to pay for them.
    fn par_rows(&self, out: &mut [f32], width: usize, work: usize, f: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync) {
        let rows = out.len().checked_div(width).unwrap_or(0);
        let threads = if work < (1 << 16) { 1 } else { self.threads.min(rows).max(1) };
        if threads <= 1 {
            f(0..rows, out);
            return;
        }
        let per = rows.div_ceil(threads);
        std::thread::scope(|s| {
            for (i, chunk) in out.chunks_mut(per * width).enumerate() {
                let f = &f;
                let start = i * per;
                s.spawn(move || f(start..start + chunk.len() / width, chunk));
            }
        });
    }
}

impl Default for Cpu {
    fn default() -> Self {
        Cpu::new()
    }
}

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y += a * x`
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl Backend for Cpu {
    fn matmul(&self, x: &[f32], w: &[f32], y: &mut [f32], m: usize, k: usize, n: usize) {
        debug_assert_eq!((x.len(), w.len(), y.len()), (m * k, n * k, m * n));
        self.par_rows(y, n, m * n * k, |rows, out| {
            for (r, yrow) in rows.zip(out.chunks_exact_mut(n)) {
                let xrow = &x[r * k..(r + 1) * k];
                for (j, yj) in yrow.iter_mut().enumerate() {
                    *yj = dot(xrow, &w[j * k..(j + 1) * k]);
                }
            }
        });
    }

    fn matmul_backward(&self, dy: &[f32], x: &[f32], w: &[f32], dx: Option<&mut [f32]>, dw: Option<&mut [f32]>, m: usize, k: usize, n: usize) {
        if let Some(dx) = dx {
            self.par_rows(dx, k, m * n * k, |rows, out| {
                for (r, dxrow) in rows.zip(out.chunks_exact_mut(k)) {
                    for j in 0..n {
                        let g = dy[r * n + j];
                        if g != 0.0 {
                            axpy(g, &w[j * k..(j + 1) * k], dxrow);
                        }
                    }
                }
            });
        }
        if let Some(dw) = dw {
            self.par_rows(dw, k, m * n * k, |cols, out| {
                for (j, dwrow) in cols.zip(out.chunks_exact_mut(k)) {
                    for r in 0..m {
                        let g = dy[r * n + j];
                        if g != 0.0 {
                            axpy(g, &x[r * k..(r + 1) * k], dwrow);
                        }
                    }
                }
            });
        }
    }

    fn rmsnorm(&self, x: &[f32], w: &[f32], y: &mut [f32], d: usize, eps: f32) -> Vec<f32> {
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

    fn rmsnorm_backward(&self, dy: &[f32], x: &[f32], w: &[f32], rstd: &[f32], dx: &mut [f32], mut dw: Option<&mut [f32]>, d: usize) {
        for (row, ((dyr, xr), dxr)) in dy.chunks_exact(d).zip(x.chunks_exact(d)).zip(dx.chunks_exact_mut(d)).enumerate() {
            let r = rstd[row];
            // g = dy * w; dx = r*g - x * r³ * mean(g*x)
            let gx: f32 = dyr.iter().zip(w).zip(xr).map(|((a, b), c)| a * b * c).sum::<f32>() / d as f32;
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

    fn rope(&self, x: &mut [f32], heads: usize, head_dim: usize, positions: &[usize], inv_freq: &[f32], inverse: bool) {
        let half = head_dim / 2;
        let sign = if inverse { -1.0 } else { 1.0 };
        for (row, &pos) in x.chunks_exact_mut(heads * head_dim).zip(positions) {
            for (i, f) in inv_freq.iter().enumerate() {
                let (s, c) = (pos as f32 * f).sin_cos();
                let s = s * sign;
                for h in 0..heads {
                    let base = h * head_dim;
                    let (x1, x2) = (row[base + i], row[base + i + half]);
                    row[base + i] = x1 * c - x2 * s;
                    row[base + i + half] = x2 * c + x1 * s;
                }
            }
        }
    }

    fn swiglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = g * sigmoid(*g) * u;
        }
    }

    fn swiglu_backward(&self, dout: &[f32], gate: &[f32], up: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
        for i in 0..dout.len() {
            let (g, u, d) = (gate[i], up[i], dout[i]);
            let s = sigmoid(g);
            dup[i] += d * g * s;
            dgate[i] += d * u * s * (1.0 + g * (1.0 - s));
        }
    }

    fn attention(&self, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32], spans: &[KeySpan], h: Heads) -> AttnSaved {
        let (hd, qw, kw) = (h.head_dim, h.q_heads * h.head_dim, h.kv_heads * h.head_dim);
        let group = h.q_heads / h.kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut offsets = Vec::with_capacity(spans.len() * h.q_heads);
        let mut total = 0;
        for s in spans {
            for _ in 0..h.q_heads {
                offsets.push(total);
                total += s.len();
            }
        }
        let mut probs = vec![0f32; total];
        // Split query rows across threads; each row's probabilities are disjoint.
        let work: usize = spans.iter().map(|s| s.len()).sum::<usize>() * qw;
        let threads = if work < (1 << 16) { 1 } else { self.threads.min(spans.len()).max(1) };
        let per = spans.len().div_ceil(threads.max(1)).max(1);
        std::thread::scope(|sc| {
            let mut out_rest: &mut [f32] = out;
            let mut probs_rest: &mut [f32] = &mut probs;
            for t in 0..threads {
                let lo = t * per;
                let hi = ((t + 1) * per).min(spans.len());
                if lo >= hi {
                    break;
                }
                let n_probs: usize = spans[lo..hi].iter().map(|s| s.len() * h.q_heads).sum();
                let (o_chunk, o_next) = std::mem::take(&mut out_rest).split_at_mut((hi - lo) * qw);
                let (p_chunk, p_next) = std::mem::take(&mut probs_rest).split_at_mut(n_probs);
                out_rest = o_next;
                probs_rest = p_next;
                sc.spawn(move || {
                    let mut p_off = 0;
                    for (qi, span) in (lo..hi).map(|i| (i, &spans[i])) {
                        let orow = &mut o_chunk[(qi - lo) * qw..(qi - lo + 1) * qw];
                        orow.fill(0.0);
                        for head in 0..h.q_heads {
                            let n = span.len();
                            let p = &mut p_chunk[p_off..p_off + n];
                            p_off += n;
                            if n == 0 {
                                continue;
                            }
                            let kvh = head / group;
                            let qv = &q[qi * qw + head * hd..qi * qw + (head + 1) * hd];
                            let mut max = f32::NEG_INFINITY;
                            for (pj, kj) in p.iter_mut().zip(span.keys()) {
                                *pj = dot(qv, &k[kj * kw + kvh * hd..kj * kw + (kvh + 1) * hd]) * scale;
                                max = max.max(*pj);
                            }
                            let mut sum = 0.0;
                            for pj in p.iter_mut() {
                                *pj = (*pj - max).exp();
                                sum += *pj;
                            }
                            let o = &mut orow[head * hd..(head + 1) * hd];
                            for (pj, kj) in p.iter_mut().zip(span.keys()) {
                                *pj /= sum;
                                axpy(*pj, &v[kj * kw + kvh * hd..kj * kw + (kvh + 1) * hd], o);
                            }
                        }
                    }
                });
            }
        });
        AttnSaved { probs, offsets }
    }

    fn attention_backward(&self, dout: &[f32], q: &[f32], k: &[f32], v: &[f32], saved: &AttnSaved, spans: &[KeySpan], h: Heads, dq: &mut [f32], dk: &mut [f32], dv: &mut [f32]) {
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
                    axpy(*pj, go, &mut dv[kj * kw + kvh * hd..kj * kw + (kvh + 1) * hd]);
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
                    axpy(ds, &k[kj * kw + kvh * hd..kj * kw + (kvh + 1) * hd], &mut dq[qi * qw + head * hd..qi * qw + (head + 1) * hd]);
                    axpy(ds, qv, &mut dk[kj * kw + kvh * hd..kj * kw + (kvh + 1) * hd]);
                }
            }
        }
    }
}
