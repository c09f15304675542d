//! Qwen3-MoE's sparse MLP on a [`Device`], with no host round
//! trip: the router's GEMM; the routing on the device (`moe_route`: softmax, top-k,
//! renormalisation); the routed (token, rank) pairs put in expert order (`moe_permute`:
//! one permutation, per-expert offsets, by three parallel launches); one grouped GEMM for
//! every expert's gate and up projections (`moe_gemm`, reading the normed tokens through
//! the permutation, so no gathered copy is made), one SwiGLU over the `[gate | up]` rows,
//! one grouped GEMM for the down projections; the weighted sum back to each token
//! (`moe_combine`, no atomics: each token sums its own rows in rank order). The per-expert
//! row counts stay on the device: the grouped GEMM's grid covers the most tiles any
//! routing can have, and each CTA reads its expert and rows from the offsets.

use dflash_shared::model_config::Moe;

use crate::device::ops::{moe_permute_scratch, Ops};
use crate::device::{Arena, DSlice, Device, Result};

/// A sparse layer's weights on the device: the router `[experts, hidden]`; every
/// expert's gate and up projections stacked as `[experts, 2·width, hidden]` (expert e's
/// gate rows, then its up rows) and its down projection as `[experts, hidden, width]`.
pub(super) struct Experts {
    pub(super) router: DSlice,
    pub(super) gate_up: DSlice,
    pub(super) down: DSlice,
    pub(super) experts: usize,
}

/// The sparse MLP's activations for `t` tokens (each `t × top_k` routed rows).
pub(super) struct MoeActs {
    /// Router logits `[t, experts]`.
    logits: DSlice,
    /// The routing: experts (i32) and weights (f32) `[t, top_k]`.
    idx: DSlice,
    wts: DSlice,
    /// Expert order: each expert's first row (i32, `experts + 1`), the token of each row
    /// and the row of each (token, rank) pair (i32, `t·k`).
    offsets: DSlice,
    rows: DSlice,
    slots: DSlice,
    /// The permutation's counts per chunk of pairs and expert (i32).
    scratch: DSlice,
    /// Routed rows: gate and up `[t·k, 2·width]`, SwiGLU `[t·k, width]`, outputs
    /// `[t·k, hidden]`.
    gu: DSlice,
    s: DSlice,
    y: DSlice,
}

impl MoeActs {
    pub(super) fn alloc(
        d: &mut dyn Device,
        arena: &mut Arena,
        m: &Moe,
        h: usize,
        t: usize,
        bf16: bool,
    ) -> Result<MoeActs> {
        let (k, mi, ne) = (
            m.num_experts_per_tok,
            m.moe_intermediate_size,
            m.num_experts,
        );
        let mut f = |n: usize, name: &str| arena.alloc_f32(d, n, name);
        let an = |n: usize| if bf16 { n.div_ceil(2) } else { n };
        Ok(MoeActs {
            logits: f(an(t * ne), "moe router logits")?,
            idx: f(t * k, "moe experts")?,
            wts: f(t * k, "moe weights")?,
            offsets: f(ne + 1, "moe offsets")?,
            rows: f(t * k, "moe permutation")?,
            slots: f(t * k, "moe slots")?,
            scratch: f(moe_permute_scratch(t * k, ne), "moe permutation counts")?,
            gu: f(an(t * k * 2 * mi), "moe gate+up")?,
            s: f(an(t * k * mi), "moe swiglu")?,
            y: f(an(t * k * h), "moe expert outputs")?,
        })
    }
}

/// Activations `range` (elements) of `s`: bf16 or f32.
fn elems(s: DSlice, range: std::ops::Range<usize>, bf16: bool) -> DSlice {
    s.sub(if bf16 { 2 } else { 4 }, range)
}

/// The sparse MLP of the `t` normed rows `n1` (`[t, h]`) into `o` (`[t, h]`), with
/// `m`'s routing and `w`'s experts, in the activations' type ([`Ops::act`]).
pub(super) fn sparse_mlp(
    ops: &mut Ops,
    m: &Moe,
    w: &Experts,
    a: &MoeActs,
    (n1, o): (DSlice, DSlice),
    t: usize,
    h: usize,
) -> Result<()> {
    let bf16 = ops.act16;
    let (ne, k, mi) = (w.experts, m.num_experts_per_tok, m.moe_intermediate_size);
    let n = t * k;
    let logits = elems(a.logits, 0..t * ne, bf16);
    let (idx, wts) = (a.idx.sub(4, 0..n), a.wts.sub(4, 0..n));
    let (rows, slots) = (a.rows.sub(4, 0..n), a.slots.sub(4, 0..n));
    let (gu, s, y) = (
        elems(a.gu, 0..n * 2 * mi, bf16),
        elems(a.s, 0..n * mi, bf16),
        elems(a.y, 0..n * h, bf16),
    );
    ops.matmul(
        ops.act_mat(n1, t, h),
        ops.act_mat(w.router, ne, h),
        ops.act_mat(logits, t, ne),
    )?;
    ops.moe_route(ops.act_mat(logits, t, ne), (idx, wts), k, m.norm_topk_prob)?;
    ops.moe_permute(idx, (a.offsets, rows, slots), a.scratch, n, k, ne)?;
    let n1 = elems(n1, 0..t * h, bf16);
    ops.moe_gemm(
        gu,
        n1,
        w.gate_up,
        a.offsets,
        Some((rows, t)),
        (n, ne),
        2 * mi,
        h,
    )?;
    ops.swiglu_gu(gu, s, mi)?;
    ops.moe_gemm(y, s, w.down, a.offsets, None, (n, ne), h, mi)?;
    let (out, y) = (ops.act_mat(o, t, h), ops.act_mat(y, n, h));
    ops.moe_combine(out, y, (wts, slots), k)
}
