//! Qwen3-MoE's sparse MLP on a [`Device`](crate::device::Device): the router's GEMM;
//! the routing on the device (`moe_route`: softmax, top-k, renormalisation); the routed
//! (token, rank) pairs put in expert order (`moe_permute`: one permutation, per-expert
//! offsets); the rows gathered in that order by one gather; per expert with rows, its gate,
//! up and down projections as GEMMs over its contiguous rows, one SwiGLU over all of them;
//! the weighted sum back to each token (`moe_combine`, no atomics: each token sums its own
//! rows in rank order).
//!
//! A first step on the GPU: the per-expert GEMMs are a loop of launches on the existing
//! GEMM path, which needs each expert's row count on the host, so the offsets
//! (`experts + 1` i32) are copied to the host once per sparse layer (a synchronisation).
//! A grouped GEMM reading the offsets on the device would remove it.

use dflash_shared::model_config::Moe;

use crate::device::ops::Ops;
use crate::device::{i32_bytes_mut, Arena, DSlice, Device, Result, Stream};

/// A sparse layer's weights on the device: the router `[experts, hidden]` and each
/// expert's gate, up (`[width, hidden]`) and down (`[hidden, width]`) projections.
pub(super) struct Experts {
    pub(super) router: DSlice,
    pub(super) experts: Vec<[DSlice; 3]>,
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
    /// Routed rows: inputs and outputs `[t·k, hidden]`; gate, up, SwiGLU `[t·k, width]`.
    xs: DSlice,
    g: DSlice,
    u: DSlice,
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
            xs: f(an(t * k * h), "moe routed rows")?,
            g: f(an(t * k * mi), "moe gate")?,
            u: f(an(t * k * mi), "moe up")?,
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
/// `m`'s routing and `w`'s experts; activations bf16 when `bf16`.
#[allow(clippy::too_many_arguments)]
pub(super) fn sparse_mlp(
    ops: &mut Ops,
    m: &Moe,
    w: &Experts,
    a: &MoeActs,
    (n1, o): (DSlice, DSlice),
    t: usize,
    h: usize,
    bf16: bool,
) -> Result<()> {
    let (ne, k, mi) = (
        m.num_experts,
        m.num_experts_per_tok,
        m.moe_intermediate_size,
    );
    let n = t * k;
    let logits = elems(a.logits, 0..t * ne, bf16);
    let (idx, wts) = (a.idx.sub(4, 0..n), a.wts.sub(4, 0..n));
    let (rows, slots) = (a.rows.sub(4, 0..n), a.slots.sub(4, 0..n));
    ops.matmul_act(n1, w.router, logits, t, h, ne)?;
    ops.moe_route(logits, idx, wts, t, ne, k, m.norm_topk_prob)?;
    ops.moe_permute(idx, a.offsets, rows, slots, n, k, ne)?;
    let mut offsets = vec![0i32; ne + 1];
    ops.dev
        .download(Stream::Compute, a.offsets, i32_bytes_mut(&mut offsets))?;
    let at = |e: usize| offsets[e].clamp(0, n as i32) as usize;
    // The gather reads the permutation's i32 tokens as u32 ids: the same bits.
    ops.embed(elems(a.xs, 0..n * h, bf16), n1, rows, n, h, t)?;
    let part = |s: DSlice, e: usize, width: usize| {
        elems(s, at(e) * width..at(e + 1).max(at(e)) * width, bf16)
    };
    let busy: Vec<usize> = (0..ne).filter(|&e| at(e + 1) > at(e)).collect();
    for &e in &busy {
        let ([gate, up, _], rows_e) = (w.experts[e], at(e + 1) - at(e));
        ops.matmul_act(part(a.xs, e, h), gate, part(a.g, e, mi), rows_e, h, mi)?;
        ops.matmul_act(part(a.xs, e, h), up, part(a.u, e, mi), rows_e, h, mi)?;
    }
    let all = |s: DSlice| elems(s, 0..n * mi, bf16);
    ops.swiglu(all(a.g), all(a.u), all(a.s))?;
    for &e in &busy {
        let ([_, _, down], rows_e) = (w.experts[e], at(e + 1) - at(e));
        ops.matmul_act(part(a.s, e, mi), down, part(a.y, e, h), rows_e, mi, h)?;
    }
    let y = elems(a.y, 0..n * h, bf16);
    ops.moe_combine(elems(o, 0..t * h, bf16), y, wts, slots, t, k, h)
}
