//! A mixture of experts' routing (`cuda/moe.cuh`): the softmax top-k router, the
//! permutation of the routed pairs into expert order, the weighted sum back; their
//! arguments, their launches on [`Ops`], and their CPU bodies (the experts' grouped GEMM
//! between them is in `ops/gemm.rs`).

#![allow(clippy::needless_range_loop)] // the CPU bodies index several buffers by one row/element index, as the CUDA source does

use super::on_cpu::{need, rd, wr, Widened};
use super::{i32_of, row_block, DType, Mat, Ops, BLOCK};
use crate::device::{Arg, DSlice, Result};

/// The i32 elements of [`Ops::moe_permute`]'s scratch for `pairs` routed pairs over
/// `experts` experts: a count per chunk of pairs and expert.
pub fn moe_permute_scratch(pairs: usize, experts: usize) -> usize {
    pairs.div_ceil(MOE_CHUNK) * experts
}

/// Routed pairs per block of the permutation's count and place launches (`MOE_CHUNK`).
pub const MOE_CHUNK: usize = 256;

/// The routing's kernels, each with its arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Moe {
    /// Per token (grid: tokens, one warp each): the softmax of its router `logits`
    /// `[t, experts]`, the `top_k` largest (lower expert first among equals) into `idx`
    /// (i32 `[t, top_k]`, rank order) and their probabilities into `wts`, divided by their
    /// sum when `norm`.
    Route {
        act: DType,
        idx: DSlice,
        wts: DSlice,
        logits: DSlice,
        experts: usize,
        top_k: usize,
        norm: bool,
    },
    /// The permutation into expert order, first launch (grid: `ceil(pairs / MOE_CHUNK)`
    /// blocks): `counts[b, e]` (i32) the pairs of chunk b (`MOE_CHUNK` pairs) routed to
    /// expert e (`idx`, i32).
    Count {
        counts: DSlice,
        idx: DSlice,
        pairs: usize,
        experts: usize,
    },
    /// Second launch (one block): `offsets` (i32, `experts + 1`) from the counts, and
    /// `counts[b, e]` turned into chunk b's first row of expert e.
    Scan {
        offsets: DSlice,
        counts: DSlice,
        chunks: usize,
        experts: usize,
    },
    /// Third launch (a warp per chunk): `rows` (i32 token of each row, ascending within an
    /// expert) and `slots` (i32 row of each pair), from `first_rows` (MoeScan's counts).
    Place {
        rows: DSlice,
        slots: DSlice,
        idx: DSlice,
        first_rows: DSlice,
        pairs: usize,
        top_k: usize,
        experts: usize,
    },
    /// `out[t,:] = Σ_q wts[t,q] · y[slots[t,q],:]` (grid: tokens; `y` `[rows, h]`).
    Combine {
        act: DType,
        out: DSlice,
        y: DSlice,
        wts: DSlice,
        slots: DSlice,
        top_k: usize,
        h: usize,
    },
}

impl Moe {
    /// Bytes of dynamic shared memory: none for these kernels.
    pub fn dynamic_shared_bytes(&self) -> u32 {
        0
    }

    /// The kernel's symbol in the CUDA source.
    pub fn name(&self) -> &'static str {
        match *self {
            Moe::Route { act: a, .. } => a.pick("moe_route", "moe_route_bf16"),
            Moe::Count { .. } => "moe_count",
            Moe::Scan { .. } => "moe_scan",
            Moe::Place { .. } => "moe_place",
            Moe::Combine { act: a, .. } => a.pick("moe_combine", "moe_combine_bf16"),
        }
    }

    /// The arguments as the kernel's C parameters, in order: each buffer marked as the
    /// kernel reads it, writes it, or both; each scalar of its parameter's C type.
    pub fn args(&self) -> Vec<Arg> {
        use Arg::{R, RW, W};
        match *self {
            Moe::Route {
                idx,
                wts,
                logits,
                experts,
                top_k,
                norm,
                ..
            } => vec![
                W(idx),
                W(wts),
                R(logits),
                i32_of(experts),
                i32_of(top_k),
                i32_of(norm as usize),
            ],
            Moe::Count {
                counts,
                idx,
                pairs,
                experts,
            } => vec![W(counts), R(idx), i32_of(pairs), i32_of(experts)],
            Moe::Scan {
                offsets,
                counts,
                chunks,
                experts,
            } => vec![W(offsets), RW(counts), i32_of(chunks), i32_of(experts)],
            Moe::Place {
                rows,
                slots,
                idx,
                first_rows,
                pairs,
                top_k,
                experts,
            } => vec![
                W(rows),
                W(slots),
                R(idx),
                R(first_rows),
                i32_of(pairs),
                i32_of(top_k),
                i32_of(experts),
            ],
            Moe::Combine {
                out,
                y,
                wts,
                slots,
                top_k,
                h,
                ..
            } => vec![W(out), R(y), R(wts), R(slots), i32_of(top_k), i32_of(h)],
        }
    }

    /// One launch of each kernel (each of its symbols), all buffers `b`.
    pub fn every(b: DSlice) -> Vec<Moe> {
        let mut all = Vec::new();
        for act in [DType::F32, DType::Bf16] {
            all.extend([
                Moe::Route {
                    act,
                    idx: b,
                    wts: b,
                    logits: b,
                    experts: 1,
                    top_k: 1,
                    norm: false,
                },
                Moe::Combine {
                    act,
                    out: b,
                    y: b,
                    wts: b,
                    slots: b,
                    top_k: 1,
                    h: 1,
                },
            ]);
        }
        all.extend([
            Moe::Count {
                counts: b,
                idx: b,
                pairs: 1,
                experts: 1,
            },
            Moe::Scan {
                offsets: b,
                counts: b,
                chunks: 1,
                experts: 1,
            },
            Moe::Place {
                rows: b,
                slots: b,
                idx: b,
                first_rows: b,
                pairs: 1,
                top_k: 1,
                experts: 1,
            },
        ]);
        all
    }

    /// The f32 kernel a bf16 one runs as on the CPU, over `w`'s temporaries; `None` for a
    /// kernel that is f32 already.
    ///
    /// # Safety
    /// The kernel's buffers are the CPU device's memory.
    pub(crate) unsafe fn as_f32(&self, w: &mut Widened) -> Option<Moe> {
        let mut k = *self;
        match &mut k {
            Moe::Route { act, logits, .. } if *act == DType::Bf16 => {
                *logits = w.input(*logits);
                *act = DType::F32;
            }
            Moe::Combine { act, out, y, .. } if *act == DType::Bf16 => {
                (*out, *y) = (w.output(*out), w.input(*y));
                *act = DType::F32;
            }
            _ => return None,
        }
        Some(k)
    }

    /// The kernel on the CPU over `rows` (the launch's grid), f32 (a bf16 one runs as
    /// its f32 kernel).
    ///
    /// # Safety
    /// The buffers are the CPU device's memory, not aliased.
    pub(crate) unsafe fn run_cpu(&self, rows: usize, _threads: usize) -> Result<()> {
        match *self {
            Moe::Route {
                idx,
                wts,
                logits,
                experts,
                top_k,
                norm,
                ..
            } => moe_route(rows, (wr(idx), wr(wts)), rd(logits), experts, top_k, norm),
            Moe::Count {
                counts,
                idx,
                pairs,
                experts,
            } => moe_count(wr(counts), rd(idx), pairs, experts),
            Moe::Scan {
                offsets,
                counts,
                chunks,
                experts,
            } => moe_scan(wr(offsets), wr(counts), chunks, experts),
            Moe::Place {
                rows: order,
                slots,
                idx,
                first_rows,
                pairs,
                top_k,
                experts,
            } => moe_place(
                (wr(order), wr(slots)),
                (rd(idx), rd(first_rows)),
                pairs,
                top_k,
                experts,
            ),
            Moe::Combine {
                out,
                y,
                wts,
                slots,
                top_k,
                h,
                ..
            } => moe_combine(rows, wr(out), rd(y), rd(wts), rd(slots), top_k, h),
        }
    }
}

impl Ops {
    /// The routing of the tokens' router `logits` (`[t, experts]`, of the activations'
    /// type): per token the `top_k` most probable experts into `idx` (i32 `[t, top_k]`, rank
    /// order) and their softmax probabilities into `wts` (f32), renormalised to sum to 1
    /// when `norm`.
    pub fn moe_route(
        &mut self,
        logits: Mat,
        (idx, wts): (DSlice, DSlice),
        top_k: usize,
        norm: bool,
    ) -> Result<()> {
        self.launch(
            Moe::Route {
                act: logits.dtype,
                idx,
                wts,
                logits: logits.buf,
                experts: logits.cols,
                top_k,
                norm,
            },
            logits.rows as u32,
            32,
        )
    }

    /// The `pairs` routed (token, rank) pairs of `idx` (i32, `top_k` per token) in expert
    /// order: `offsets` (i32 `[experts + 1]`), `rows` (the token of each row, i32,
    /// ascending within an expert) and `slots` (the row of each pair, i32). Three launches
    /// (count per chunk, scan, place), with `scratch` (i32, [`moe_permute_scratch`]
    /// elements) between them.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_permute(
        &mut self,
        idx: DSlice,
        (offsets, rows, slots): (DSlice, DSlice, DSlice),
        scratch: DSlice,
        pairs: usize,
        top_k: usize,
        experts: usize,
    ) -> Result<()> {
        let chunks = pairs.div_ceil(MOE_CHUNK);
        if chunks == 0 {
            return Ok(());
        }
        let counts = scratch.sub(4, 0..chunks * experts);
        self.launch(
            Moe::Count {
                counts,
                idx,
                pairs,
                experts,
            },
            chunks as u32,
            BLOCK,
        )?;
        self.launch(
            Moe::Scan {
                offsets,
                counts,
                chunks,
                experts,
            },
            1,
            BLOCK,
        )?;
        self.launch(
            Moe::Place {
                rows,
                slots,
                idx,
                first_rows: counts,
                pairs,
                top_k,
                experts,
            },
            chunks as u32,
            32,
        )
    }

    /// `out[t,:] = Σ_q wts[t,q] · y[slots[t,q],:]` for every token `t` of `out` (`[t, h]`;
    /// `y` `[rows, h]`, of the same type).
    pub fn moe_combine(
        &mut self,
        out: Mat,
        y: Mat,
        (wts, slots): (DSlice, DSlice),
        top_k: usize,
    ) -> Result<()> {
        let (t, h) = (out.rows, out.cols);
        y.check("moe_combine: y", y.rows, h, out.dtype)?;
        self.launch(
            Moe::Combine {
                act: out.dtype,
                out: out.buf,
                y: y.buf,
                wts,
                slots,
                top_k,
                h,
            },
            t as u32,
            row_block(h),
        )
    }
}

/// moe.cuh's `moe_route` for `rows` tokens: softmax, top-k by repeated argmax (lower
/// expert first among equals), probabilities renormalised over the chosen when `norm`.
fn moe_route(
    rows: usize,
    (idx, wts): (&mut [i32], &mut [f32]),
    logits: &[f32],
    experts: usize,
    top_k: usize,
    norm: bool,
) -> Result<()> {
    let kernel = "moe_route";
    need(kernel, "logits", logits.len(), rows * experts)?;
    need(kernel, "idx", idx.len(), rows * top_k)?;
    need(kernel, "wts", wts.len(), rows * top_k)?;
    for r in 0..rows {
        let l = &logits[r * experts..(r + 1) * experts];
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s: f32 = l.iter().map(|v| (v - m).exp()).sum();
        let (ri, rw) = (
            &mut idx[r * top_k..(r + 1) * top_k],
            &mut wts[r * top_k..(r + 1) * top_k],
        );
        let mut top_sum = 0f32;
        for j in 0..top_k {
            let mut best: Option<(usize, f32)> = None;
            for (e, &v) in l.iter().enumerate() {
                if ri[..j].contains(&(e as i32)) {
                    continue;
                }
                if best.is_none_or(|(_, bv)| v > bv) {
                    best = Some((e, v));
                }
            }
            let (e, v) = best.unwrap_or((0, f32::NAN));
            let p = (v - m).exp() / s;
            top_sum += p;
            (ri[j], rw[j]) = (e as i32, p);
        }
        if norm {
            rw.iter_mut().for_each(|w| *w /= top_sum);
        }
    }
    Ok(())
}

/// An expert id as the kernels read it: one out of range is expert 0.
fn expert_of(e: i32, experts: usize) -> usize {
    if e >= 0 && (e as usize) < experts {
        e as usize
    } else {
        0
    }
}

/// moe.cuh's `moe_count`: the pairs of each chunk per expert, `counts[b, e]`.
fn moe_count(counts: &mut [i32], idx: &[i32], pairs: usize, experts: usize) -> Result<()> {
    let kernel = "moe_count";
    let chunks = pairs.div_ceil(MOE_CHUNK);
    need(kernel, "idx", idx.len(), pairs)?;
    need(kernel, "counts", counts.len(), chunks * experts)?;
    counts[..chunks * experts].fill(0);
    for (p, &e) in idx[..pairs].iter().enumerate() {
        counts[p / MOE_CHUNK * experts + expert_of(e, experts)] += 1;
    }
    Ok(())
}

/// moe.cuh's `moe_scan`: the offsets, and each chunk's first row per expert.
fn moe_scan(offsets: &mut [i32], counts: &mut [i32], chunks: usize, experts: usize) -> Result<()> {
    let kernel = "moe_scan";
    need(kernel, "offsets", offsets.len(), experts + 1)?;
    need(kernel, "counts", counts.len(), chunks * experts)?;
    let mut at = 0;
    for e in 0..experts {
        offsets[e] = at;
        for b in 0..chunks {
            let c = counts[b * experts + e];
            counts[b * experts + e] = at;
            at += c;
        }
    }
    offsets[experts] = at;
    Ok(())
}

/// moe.cuh's `moe_place`: each pair's row, the pairs of an expert in order.
fn moe_place(
    (order, slots): (&mut [i32], &mut [i32]),
    (idx, first_rows): (&[i32], &[i32]),
    pairs: usize,
    top_k: usize,
    experts: usize,
) -> Result<()> {
    let kernel = "moe_place";
    let chunk = MOE_CHUNK;
    need(kernel, "idx", idx.len(), pairs)?;
    need(kernel, "slots", slots.len(), pairs)?;
    need(
        kernel,
        "first_rows",
        first_rows.len(),
        pairs.div_ceil(chunk) * experts,
    )?;
    let mut next = vec![0i32; experts];
    for (p, &e) in idx[..pairs].iter().enumerate() {
        if p % chunk == 0 {
            next.copy_from_slice(&first_rows[p / chunk * experts..(p / chunk + 1) * experts]);
        }
        let e = expert_of(e, experts);
        let row = next[e].max(0) as usize;
        need(kernel, "rows", order.len(), row + 1)?;
        (order[row], slots[p]) = ((p / top_k.max(1)) as i32, row as i32);
        next[e] += 1;
    }
    Ok(())
}

/// moe.cuh's `moe_combine` for `rows` tokens.
fn moe_combine(
    rows: usize,
    out: &mut [f32],
    y: &[f32],
    wts: &[f32],
    slots: &[i32],
    top_k: usize,
    h: usize,
) -> Result<()> {
    let kernel = "moe_combine";
    need(kernel, "wts", wts.len(), rows * top_k)?;
    need(kernel, "slots", slots.len(), rows * top_k)?;
    need(kernel, "out", out.len(), rows * h)?;
    for t in 0..rows {
        for q in 0..top_k {
            let row = slots[t * top_k + q].max(0) as usize;
            need(kernel, "y", y.len(), (row + 1) * h)?;
        }
        for j in 0..h {
            let mut acc = 0f32;
            for q in 0..top_k {
                let row = slots[t * top_k + q] as usize;
                acc += wts[t * top_k + q] * y[row * h + j];
            }
            out[t * h + j] = acc;
        }
    }
    Ok(())
}
