//! Attention on the CPU device: tiles of query rows and keys over the CPU's threads, the
//! forward with an online softmax and the backward, computing what the CUDA kernels do
//! (the FlashAttention-2 kernels' results are the plain ones').

#![allow(clippy::needless_range_loop)] // the CPU bodies index several buffers by one row/element index, as the CUDA source does

use super::{Attention, AttentionGrad, BwdScratch};
use crate::device::ops::on_cpu::{need, par_ranges, rd, wr, Shared};
use crate::device::{GpuError, Result};
use crate::math::{dot, exp_neg, sgemm};

/// Multiply-adds of an attention call below which it runs on one thread (starting threads
/// costs more than they save).
const PAR_WORK: usize = 1 << 22;

/// Multiply-adds of an attention over `tq` rows of width `qw` (the two products with each
/// key a row sees).
fn attention_work(
    tq: usize,
    qw: usize,
    span: &impl Fn(usize, usize) -> std::ops::Range<usize>,
) -> usize {
    (0..tq)
        .map(|r| span(r, 0).len() + span(r, 1).len())
        .sum::<usize>()
        * qw
        * 2
}

/// An attention launch's key spans as the device holds them: per query row
/// `[a.start, a.end, b.start, b.end]`, checked against the keys.
#[derive(Clone, Copy)]
struct Spans<'a>(&'a [i32]);

impl Spans<'_> {
    /// Row `row`'s first (`r` = 0) or second key span.
    fn span(&self, row: usize, r: usize) -> std::ops::Range<usize> {
        self.0[4 * row + 2 * r] as usize..self.0[4 * row + 2 * r + 1] as usize
    }

    /// The attention's tiles over `tq` query rows: consecutive rows that share their
    /// second span, at most 64.
    fn tiles(&self, tq: usize) -> Vec<std::ops::Range<usize>> {
        let mut tiles = Vec::new();
        let mut lo = 0;
        while lo < tq {
            let mut hi = lo + 1;
            while hi < tq && hi - lo < 64 && self.span(hi, 1) == self.span(lo, 1) {
                hi += 1;
            }
            tiles.push(lo..hi);
            lo = hi;
        }
        tiles
    }

    /// Query head `head` (of KV head `kh`) over `tile`, with the keys the tile's rows see.
    fn job(&self, tile: std::ops::Range<usize>, head: usize, kh: usize) -> Job {
        let a_lo = tile
            .clone()
            .map(|r| self.span(r, 0).start)
            .min()
            .unwrap_or(0);
        let a_hi = tile
            .clone()
            .map(|r| self.span(r, 0).end)
            .max()
            .unwrap_or(0)
            .max(a_lo);
        let b = self.span(tile.start, 1);
        let (ka, nk) = (a_hi - a_lo, a_hi - a_lo + b.len());
        Job {
            tile,
            head,
            kh,
            a_lo,
            ka,
            b,
            nk,
        }
    }
}

/// One (tile, head) of an attention: its query rows, query head and KV head, and the
/// keys its rows see: the union `a_lo..a_lo + ka` of their first spans and their shared
/// second span `b`, side by side as the `nk` columns of the tile's scores.
struct Job {
    tile: std::ops::Range<usize>,
    head: usize,
    kh: usize,
    a_lo: usize,
    ka: usize,
    b: std::ops::Range<usize>,
    nk: usize,
}

impl Job {
    /// The job's two key ranges: (first key, keys, first column in the scores).
    fn ranges(&self) -> [(usize, usize, usize); 2] {
        [
            (self.a_lo, self.ka, 0),
            (self.b.start, self.b.len(), self.ka),
        ]
    }
}

/// An `attention_fwd` launch's operands, which its jobs share.
struct FwdJobs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    spans: Spans<'a>,
    qh: usize,
    kvh: usize,
    hd: usize,
    out: Shared,
    lse: Shared,
}

impl FwdJobs<'_> {
    /// One job: its scores in `sc` (scratch), their masked softmax and the log-sum-exp,
    /// and `O = P·V`; rows that see no key get 0 and a log-sum-exp of −∞.
    ///
    /// # Safety
    /// The operands hold the launch's extents, and no other job writes rows `j.tile` of
    /// head `j.head` in out and lse.
    unsafe fn run(&self, j: &Job, sc: &mut Vec<f32>) {
        let (qw, hd) = (self.qh * self.hd, self.hd);
        sc.clear();
        sc.resize(j.tile.len() * j.nk, 0.0);
        self.scores(j, sc);
        self.softmax(j, sc);
        self.values(j, sc);
        if j.nk == 0 {
            for r in j.tile.clone() {
                std::slice::from_raw_parts_mut(self.out.0.add(r * qw + j.head * hd), hd).fill(0.0);
                *self.lse.0.add(r * self.qh + j.head) = f32::NEG_INFINITY;
            }
        }
    }

    /// `S = Q·Kᵀ` over the job's keys, into `sc`.
    ///
    /// # Safety
    /// As for [`run`](Self::run).
    unsafe fn scores(&self, j: &Job, sc: &mut [f32]) {
        let (hd, qw, kw) = (self.hd, self.qh * self.hd, self.kvh * self.hd);
        let (rows, ka, nk, b) = (j.tile.len(), j.ka, j.nk, &j.b);
        let qp = self.q[j.tile.start * qw + j.head * hd..].as_ptr();
        if ka > 0 {
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
                self.k[j.a_lo * kw + j.kh * hd..].as_ptr(),
                1,
                kw as isize,
            );
        }
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
                self.k[b.start * kw + j.kh * hd..].as_ptr(),
                1,
                kw as isize,
            );
        }
    }

    /// Each row's scores scaled, the keys of the first range it may not see masked, and
    /// softmaxed in place; its log-sum-exp into lse (−∞ and a row of 0 for no key).
    ///
    /// # Safety
    /// As for [`run`](Self::run).
    unsafe fn softmax(&self, j: &Job, sc: &mut [f32]) {
        let scale = 1.0 / (self.hd as f32).sqrt();
        for (r, srow) in sc.chunks_exact_mut(j.nk).enumerate() {
            let own = self.spans.span(j.tile.start + r, 0);
            let mut max = f32::NEG_INFINITY;
            for (c, sv) in srow.iter_mut().enumerate() {
                if c >= j.ka || own.contains(&(j.a_lo + c)) {
                    *sv *= scale;
                    max = max.max(*sv);
                } else {
                    *sv = f32::NEG_INFINITY;
                }
            }
            let at = (j.tile.start + r) * self.qh + j.head;
            if max == f32::NEG_INFINITY {
                // No key: output 0, log-sum-exp −∞.
                srow.fill(0.0);
                *self.lse.0.add(at) = f32::NEG_INFINITY;
                continue;
            }
            srow.iter_mut().for_each(|sv| *sv = exp_neg(*sv - max));
            let sum: f32 = srow.iter().sum();
            let inv = 1.0 / sum;
            srow.iter_mut().for_each(|sv| *sv *= inv);
            *self.lse.0.add(at) = max + sum.ln();
        }
    }

    /// `O = P·V` into the job's rows of its head.
    ///
    /// # Safety
    /// As for [`run`](Self::run).
    unsafe fn values(&self, j: &Job, sc: &[f32]) {
        let (hd, qw, kw) = (self.hd, self.qh * self.hd, self.kvh * self.hd);
        let (rows, ka, nk, b) = (j.tile.len(), j.ka, j.nk, &j.b);
        let op = self.out.0.add(j.tile.start * qw + j.head * hd);
        if ka > 0 {
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
                self.v[j.a_lo * kw + j.kh * hd..].as_ptr(),
                kw as isize,
                1,
            );
        }
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
                self.v[b.start * kw + j.kh * hd..].as_ptr(),
                kw as isize,
                1,
            );
        }
    }
}

/// An `attention_bwd` launch's operands, which its threads share.
struct BwdJobs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dout: &'a [f32],
    out: &'a [f32],
    lse: &'a [f32],
    spans: Spans<'a>,
    qh: usize,
    kvh: usize,
    hd: usize,
    dq: Shared,
    dk: Shared,
    dv: Shared,
}

impl BwdJobs<'_> {
    /// KV head `kh` over `tile`: for each query head that reads it, the probabilities and
    /// `dS` recomputed (`p` and `ds` are scratch), then the gradients added.
    ///
    /// # Safety
    /// The operands hold the launch's extents, and no other thread writes dk/dv of KV
    /// head `kh` or dq of the query heads that read it.
    unsafe fn tile(
        &self,
        kh: usize,
        tile: &std::ops::Range<usize>,
        p: &mut Vec<f32>,
        ds: &mut Vec<f32>,
    ) {
        let group = self.qh / self.kvh;
        let rows = tile.len();
        for head in kh * group..(kh + 1) * group {
            let j = self.spans.job(tile.clone(), head, kh);
            if j.nk == 0 {
                return;
            }
            p.clear();
            p.resize(rows * j.nk, 0.0);
            ds.clear();
            ds.resize(rows * j.nk, 0.0);
            self.scores(&j, p, ds);
            self.probs(&j, p, ds);
            self.grads(&j, p, ds);
        }
    }

    /// `S = Q·Kᵀ` into `p` and `dP = dO·Vᵀ` into `ds`, the key ranges side by side.
    ///
    /// # Safety
    /// As for [`tile`](Self::tile).
    unsafe fn scores(&self, j: &Job, p: &mut [f32], ds: &mut [f32]) {
        let (hd, qw, kw) = (self.hd, self.qh * self.hd, self.kvh * self.hd);
        let (rows, nk) = (j.tile.len(), j.nk);
        let qp = self.q[j.tile.start * qw + j.head * hd..].as_ptr();
        let gp = self.dout[j.tile.start * qw + j.head * hd..].as_ptr();
        for (ko, kn, col) in j.ranges() {
            if kn == 0 {
                continue;
            }
            sgemm(
                gemm::Parallelism::None,
                rows,
                kn,
                hd,
                p.as_mut_ptr().add(col),
                nk,
                1,
                false,
                qp,
                qw,
                1,
                self.k[ko * kw + j.kh * hd..].as_ptr(),
                1,
                kw as isize,
            );
            sgemm(
                gemm::Parallelism::None,
                rows,
                kn,
                hd,
                ds.as_mut_ptr().add(col),
                nk,
                1,
                false,
                gp,
                qw,
                1,
                self.v[ko * kw + j.kh * hd..].as_ptr(),
                1,
                kw as isize,
            );
        }
    }

    /// Per row, `P = exp(S·scale − lse)` in `p` and `dS = P∘(dP − rowsum(dO∘O))·scale` in
    /// `ds`, both 0 at the keys the row may not see (and for a row that sees none).
    fn probs(&self, j: &Job, p: &mut [f32], ds: &mut [f32]) {
        let (hd, qw, nk) = (self.hd, self.qh * self.hd, j.nk);
        let scale = 1.0 / (hd as f32).sqrt();
        for r in 0..j.tile.len() {
            let row = j.tile.start + r;
            let l = self.lse[row * self.qh + j.head];
            let (prow, drow) = (&mut p[r * nk..(r + 1) * nk], &mut ds[r * nk..(r + 1) * nk]);
            if l == f32::NEG_INFINITY {
                prow.fill(0.0);
                drow.fill(0.0);
                continue;
            }
            let at = row * qw + j.head * hd;
            let dd = dot(&self.dout[at..at + hd], &self.out[at..at + hd]);
            let own = self.spans.span(row, 0);
            for c in 0..nk {
                if c < j.ka && !own.contains(&(j.a_lo + c)) {
                    prow[c] = 0.0;
                    drow[c] = 0.0;
                } else {
                    let pc = exp_neg(prow[c] * scale - l);
                    prow[c] = pc;
                    drow[c] = pc * (drow[c] - dd) * scale;
                }
            }
        }
    }

    /// `dQ += dS·K`, `dK += dSᵀ·Q`, `dV += Pᵀ·dO`, a key range at a time.
    ///
    /// # Safety
    /// As for [`tile`](Self::tile).
    unsafe fn grads(&self, j: &Job, p: &[f32], ds: &[f32]) {
        let (hd, qw, kw) = (self.hd, self.qh * self.hd, self.kvh * self.hd);
        let (rows, nk) = (j.tile.len(), j.nk);
        let qp = self.q[j.tile.start * qw + j.head * hd..].as_ptr();
        let gp = self.dout[j.tile.start * qw + j.head * hd..].as_ptr();
        let dqo = self.dq.0.add(j.tile.start * qw + j.head * hd);
        for (ko, kn, col) in j.ranges() {
            if kn == 0 {
                continue;
            }
            sgemm(
                gemm::Parallelism::None,
                rows,
                hd,
                kn,
                dqo,
                qw,
                1,
                true,
                ds.as_ptr().add(col),
                nk,
                1,
                self.k[ko * kw + j.kh * hd..].as_ptr(),
                kw as isize,
                1,
            );
            sgemm(
                gemm::Parallelism::None,
                kn,
                hd,
                rows,
                self.dk.0.add(ko * kw + j.kh * hd),
                kw,
                1,
                true,
                ds.as_ptr().add(col),
                1,
                nk as isize,
                qp,
                qw as isize,
                1,
            );
            sgemm(
                gemm::Parallelism::None,
                kn,
                hd,
                rows,
                self.dv.0.add(ko * kw + j.kh * hd),
                kw,
                1,
                true,
                p.as_ptr().add(col),
                1,
                nk as isize,
                gp,
                qw as isize,
                1,
            );
        }
    }
}

/// The mixture-of-experts kernels; `None` for the others.
///
/// # Safety
/// The kernel's buffers are this device's memory and do not alias ([`check_aliasing`]).
/// `attention_fwd` as GEMMs: consecutive query rows that share their second key span
/// (any 64 rows of a causal sequence; the rows of one DFlash block) form a tile, and
/// each (tile, head) is `S = Q·Kᵀ` over the union of the tile's keys, the keys a row may
/// not see masked, a softmax that keeps each row's log-sum-exp, and `O = P·V`. Tiles
/// are handed to the threads from a shared counter.
///
/// # Safety
/// As for [`Device::launch`]'s arms.
pub(super) unsafe fn attention_fwd(threads: usize, a: &Attention) -> Result<()> {
    let kernel = "attention_fwd";
    let (tq, qh, kvh, hd) = (a.tq, a.qh, a.kvh, a.hd);
    let (out, lse) = (wr::<f32>(a.out), wr::<f32>(a.lse));
    let (q, k, v, spans) = (
        rd::<f32>(a.q),
        rd::<f32>(a.k),
        rd::<f32>(a.v),
        rd::<i32>(a.spans),
    );
    let (qw, kw) = (qh * hd, kvh * hd);
    need(kernel, "q/out", q.len().min(out.len()), tq * qw)?;
    need(kernel, "lse", lse.len(), tq * qh)?;
    need(kernel, "spans", spans.len(), 4 * tq)?;
    let keys = k.len().min(v.len()) / kw.max(1);
    if spans[..4 * tq]
        .chunks_exact(2)
        .any(|r| r[0] < 0 || r[1] < r[0] || r[1] as usize > keys)
    {
        return Err(GpuError::Invalid(format!(
            "{}: a key span is empty-reversed or reaches past the {keys} keys",
            kernel
        )));
    }
    let spans = Spans(spans);
    let jobs: Vec<Job> = spans
        .tiles(tq)
        .iter()
        .flat_map(|t| (0..qh).map(move |h| spans.job(t.clone(), h, h / (qh / kvh))))
        .collect();
    let f = FwdJobs {
        q,
        k,
        v,
        spans,
        qh,
        kvh,
        hd,
        out: Shared(out.as_mut_ptr()),
        lse: Shared(lse.as_mut_ptr()),
    };
    let next = std::sync::atomic::AtomicUsize::new(0);
    let run = || {
        let mut sc: Vec<f32> = Vec::new();
        while let Some(j) = jobs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
            // SAFETY: the buffers were checked above; this job alone writes rows
            // `j.tile` of head `j.head` in out and lse.
            f.run(j, &mut sc);
        }
    };
    let threads = threads.min(jobs.len()).max(1);
    if threads == 1 || attention_work(tq, qw, &|r, i| spans.span(r, i)) < PAR_WORK {
        run();
    } else {
        // Each thread pulls jobs until none is left; where a thread cannot be started
        // (a thread limit), the calling thread pulls them instead.
        dflash_shared::threads::scoped((0..threads).map(|_| run));
    }
    Ok(())
}

/// `attention_bwd` from the saved log-sum-exp, as GEMMs over the forward's tiles: per
/// (tile, head) the probabilities are recomputed (`P = exp(S − lse)`), `dP = dO·Vᵀ`,
/// `dS = P∘(dP − rowsum(dO∘O))·scale`, then `dQ += dS·K`, `dK += dSᵀ·Q`, `dV += Pᵀ·dO`.
/// Work is split by KV head: each thread owns its KV heads' rows of dk and dv and the
/// dq of the query heads that read them, and adds into them tile after tile in order —
/// the same bits on every run.
///
/// # Safety
/// As for [`Device::launch`]'s arms.
pub(super) unsafe fn attention_bwd(threads: usize, g: &AttentionGrad) -> Result<()> {
    let kernel = "attention_bwd";
    let a = &g.fwd;
    let (tq, qh, kvh, hd) = (a.tq, a.qh, a.kvh, a.hd);
    let (dq, dk, dv) = (wr::<f32>(g.dq), wr::<f32>(g.dk), wr::<f32>(g.dv));
    let (dout, out, lse) = (rd::<f32>(g.dout), rd::<f32>(a.out), rd::<f32>(a.lse));
    let (q, k, v, spans) = (
        rd::<f32>(a.q),
        rd::<f32>(a.k),
        rd::<f32>(a.v),
        rd::<i32>(a.spans),
    );
    let (qw, kw) = (qh * hd, kvh * hd);
    need(
        kernel,
        "q/dq/dout/out",
        q.len().min(dq.len()).min(dout.len()).min(out.len()),
        tq * qw,
    )?;
    need(kernel, "lse", lse.len(), tq * qh)?;
    need(kernel, "spans", spans.len(), 4 * tq)?;
    let keys = k.len().min(v.len()).min(dk.len()).min(dv.len()) / kw.max(1);
    if spans[..4 * tq]
        .chunks_exact(2)
        .any(|r| r[0] < 0 || r[1] < r[0] || r[1] as usize > keys)
    {
        return Err(GpuError::Invalid(format!(
            "{}: a key span is reversed or reaches past the {keys} keys",
            kernel
        )));
    }
    let spans = Spans(spans);
    let tiles = spans.tiles(tq);
    let b = BwdJobs {
        q,
        k,
        v,
        dout,
        out,
        lse,
        spans,
        qh,
        kvh,
        hd,
        dq: Shared(dq.as_mut_ptr()),
        dk: Shared(dk.as_mut_ptr()),
        dv: Shared(dv.as_mut_ptr()),
    };
    let threads = if attention_work(tq, qw, &|r, i| spans.span(r, i)) < PAR_WORK {
        1
    } else {
        threads
    };
    par_ranges(threads, kvh, |khs| {
        let (mut p, mut ds) = (Vec::<f32>::new(), Vec::<f32>::new());
        for kh in khs {
            for tile in &tiles {
                // SAFETY: the buffers were checked above; dk/dv of KV head kh, and dq
                // of the query heads that read it, are this thread's alone.
                b.tile(kh, tile, &mut p, &mut ds);
            }
        }
    });
    Ok(())
}
/// `attention_bwd_prep`: per (row, head) `Σ_d dO∘O` and Q, dO rounded to bf16 (0 and
/// zeros where the row's lse is −inf); per 32 rows the union and intersection of each of
/// their two key spans (`[lo, hi)`, empty as `[0, 0)`).
///
/// # Safety
/// As for [`Device::launch`]'s arms.
pub(super) unsafe fn attention_prep(g: &AttentionGrad, s: &BwdScratch) -> Result<()> {
    let kernel = "attention_bwd_prep";
    let a = &g.fwd;
    let (dout, out, lse, q) = (
        rd::<f32>(g.dout),
        rd::<f32>(a.out),
        rd::<f32>(a.lse),
        rd::<f32>(a.q),
    );
    let (delta, q16, do16) = (wr::<f32>(s.delta), wr::<u16>(s.q16), wr::<u16>(s.do16));
    let (spans, tiles) = (rd::<i32>(a.spans), wr::<i32>(s.tiles));
    let (pairs, hd) = (a.tq * a.qh, a.hd);
    need(kernel, "delta/lse", delta.len().min(lse.len()), pairs)?;
    need(
        kernel,
        "dout/out/q",
        dout.len().min(out.len()).min(q.len()),
        pairs * hd,
    )?;
    need(kernel, "q16/do16", q16.len().min(do16.len()), pairs * hd)?;
    need(kernel, "spans", spans.len(), 4 * a.tq)?;
    need(kernel, "tiles", tiles.len(), a.tq.div_ceil(32) * 8)?;
    let bf = |x: f32| half::bf16::from_f32(x).to_bits();
    for i in 0..pairs {
        let r = i * hd..(i + 1) * hd;
        let keep = lse[i] != f32::NEG_INFINITY;
        delta[i] = if keep {
            crate::math::dot(&dout[r.clone()], &out[r.clone()])
        } else {
            0.0
        };
        for j in r {
            (q16[j], do16[j]) = if keep {
                (bf(q[j]), bf(dout[j]))
            } else {
                (0, 0)
            };
        }
    }
    for (t, v) in tiles[..a.tq.div_ceil(32) * 8]
        .chunks_exact_mut(8)
        .enumerate()
    {
        let rows = 32 * t..(32 * t + 32).min(a.tq);
        for sp in 0..2 {
            let span = |r: usize| (spans[4 * r + 2 * sp], spans[4 * r + 2 * sp + 1]);
            let seen = rows.clone().map(span).filter(|(x, y)| x < y);
            let (lo, hi) = seen.fold((i32::MAX, 0), |(l, h), (x, y)| (l.min(x), h.max(y)));
            let (ilo, ihi) = rows
                .clone()
                .map(span)
                .fold((0, i32::MAX), |(l, h), (x, y)| (l.max(x), h.min(y)));
            let norm = |x: i32, y: i32| if x < y { [x, y] } else { [0, 0] };
            v[2 * sp..2 * sp + 2].copy_from_slice(&norm(lo, hi));
            v[4 + 2 * sp..6 + 2 * sp].copy_from_slice(&norm(ilo, ihi));
        }
    }
    Ok(())
}
