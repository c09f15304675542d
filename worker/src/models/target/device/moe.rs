//! Qwen3-MoE's sparse MLP on a [`Device`](crate::device::Device): the router's GEMM on
//! the device; the routing (softmax, top-k, renormalisation) on the host from the
//! downloaded logits; the rows gathered in expert order (one permutation, per-expert
//! offsets) by one gather; per expert with rows, its gate, up and down projections as
//! GEMMs over its contiguous rows (a loop of launches on the existing GEMM path), one
//! SwiGLU over all of them; the weighted sum back to each row on the host.
//!
//! The host round trips (the logits down, the permutation up, the expert outputs down,
//! the sum up) make this the simplest correct route, not a fast one: the CPU device's
//! memory is the host's anyway, and on a GPU it is correct but synchronous per sparse
//! layer. Device-side routing and a weighted scatter are the GPU route's next step.

use dflash_shared::model_config::Moe;

use crate::device::ops::Ops;
use crate::device::{f32_bytes, f32_bytes_mut, u32_bytes, Arena, DSlice, Device, Result, Stream};

/// A sparse layer's weights on the device: the router `[experts, hidden]` and each
/// expert's gate, up (`[width, hidden]`) and down (`[hidden, width]`) projections.
pub(super) struct Experts {
    pub(super) router: DSlice,
    pub(super) experts: Vec<[DSlice; 3]>,
}

/// The sparse MLP's activations for `t` tokens (each `t × top_k` routed rows).
pub(super) struct MoeActs {
    /// The permutation: the token of each routed row, expert-major (u32).
    rows: DSlice,
    /// Router logits `[t, experts]`.
    logits: DSlice,
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
        let (k, mi) = (m.num_experts_per_tok, m.moe_intermediate_size);
        let mut f = |n: usize, name: &str| arena.alloc_f32(d, n, name);
        let an = |n: usize| if bf16 { n.div_ceil(2) } else { n };
        Ok(MoeActs {
            rows: f(t * k, "moe permutation")?,
            logits: f(an(t * m.num_experts), "moe router logits")?,
            xs: f(an(t * k * h), "moe routed rows")?,
            g: f(an(t * k * mi), "moe gate")?,
            u: f(an(t * k * mi), "moe up")?,
            s: f(an(t * k * mi), "moe swiglu")?,
            y: f(an(t * k * h), "moe expert outputs")?,
        })
    }
}

/// Where each token went: the routed rows' tokens and weights in expert order, and each
/// expert's first row (`offsets[e]..offsets[e + 1]` are expert `e`'s).
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub tokens: Vec<u32>,
    pub weights: Vec<f32>,
    pub offsets: Vec<usize>,
}

/// The routing of `logits` (`[t, experts]`, f32): per token the softmax (in f32, as
/// transformers computes it), the `top_k` most probable experts (the lower index first
/// among equals), their probabilities divided by their sum when `norm`.
pub fn route(logits: &[f32], experts: usize, top_k: usize, norm: bool) -> Routing {
    let mut chosen: Vec<Vec<(u32, f32)>> = vec![Vec::new(); experts];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for (tok, l) in logits.chunks_exact(experts).enumerate() {
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = l.iter().map(|v| (v - max).exp()).collect();
        let sum: f32 = e.iter().sum();
        order.clear();
        order.extend(0..experts);
        order.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
        let top = &order[..top_k.min(experts)];
        let top_sum: f32 = top.iter().map(|&i| e[i] / sum).sum();
        for &i in top {
            let p = e[i] / sum;
            chosen[i].push((tok as u32, if norm { p / top_sum } else { p }));
        }
    }
    let mut r = Routing {
        tokens: Vec::with_capacity(logits.len() / experts.max(1) * top_k),
        weights: Vec::new(),
        offsets: vec![0],
    };
    for c in chosen {
        for (tok, w) in c {
            r.tokens.push(tok);
            r.weights.push(w);
        }
        r.offsets.push(r.tokens.len());
    }
    r
}

/// Activations `range` (elements) of `s`: bf16 or f32.
fn elems(s: DSlice, range: std::ops::Range<usize>, bf16: bool) -> DSlice {
    s.sub(if bf16 { 2 } else { 4 }, range)
}

/// `n` activations of `s` to the host, as f32.
fn download(ops: &mut Ops, s: DSlice, n: usize, bf16: bool) -> Result<Vec<f32>> {
    let mut out = vec![0f32; n];
    if bf16 {
        let mut bits = vec![0u8; n * 2];
        ops.dev
            .download(Stream::Compute, elems(s, 0..n, true), &mut bits)?;
        for (o, b) in out.iter_mut().zip(bits.chunks_exact(2)) {
            *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
        }
    } else {
        ops.dev.download(
            Stream::Compute,
            elems(s, 0..n, false),
            f32_bytes_mut(&mut out),
        )?;
    }
    Ok(out)
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
    let logits = elems(a.logits, 0..t * ne, bf16);
    ops.matmul_act(n1, w.router, logits, t, h, ne)?;
    let r = route(
        &download(ops, logits, t * ne, bf16)?,
        ne,
        k,
        m.norm_topk_prob,
    );
    let n = r.tokens.len();
    let rows = a.rows.sub(4, 0..n);
    ops.dev
        .upload(Stream::Compute, rows, u32_bytes(&r.tokens))?;
    let xs = elems(a.xs, 0..n * h, bf16);
    ops.embed(xs, n1, rows, n, h, t)?;
    let part = |s: DSlice, e: usize, width: usize| {
        elems(s, r.offsets[e] * width..r.offsets[e + 1] * width, bf16)
    };
    let busy: Vec<usize> = (0..ne)
        .filter(|&e| r.offsets[e + 1] > r.offsets[e])
        .collect();
    for &e in &busy {
        let ([gate, up, _], rows_e) = (w.experts[e], r.offsets[e + 1] - r.offsets[e]);
        ops.matmul_act(part(a.xs, e, h), gate, part(a.g, e, mi), rows_e, h, mi)?;
        ops.matmul_act(part(a.xs, e, h), up, part(a.u, e, mi), rows_e, h, mi)?;
    }
    let all = |s: DSlice| elems(s, 0..n * mi, bf16);
    ops.swiglu(all(a.g), all(a.u), all(a.s))?;
    for &e in &busy {
        let ([_, _, down], rows_e) = (w.experts[e], r.offsets[e + 1] - r.offsets[e]);
        ops.matmul_act(part(a.s, e, mi), down, part(a.y, e, h), rows_e, mi, h)?;
    }
    let y = download(ops, a.y, n * h, bf16)?;
    let mut sum = vec![0f32; t * h];
    for ((&tok, &wt), yr) in r.tokens.iter().zip(&r.weights).zip(y.chunks_exact(h)) {
        let out = &mut sum[tok as usize * h..(tok as usize + 1) * h];
        out.iter_mut().zip(yr).for_each(|(s, v)| *s += wt * v);
    }
    let o = elems(o, 0..t * h, bf16);
    if bf16 {
        let bits: Vec<u8> = sum
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        ops.dev.upload(Stream::Compute, o, &bits)
    } else {
        ops.dev.upload(Stream::Compute, o, f32_bytes(&sum))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_takes_the_top_k_in_expert_order_and_renormalises_when_asked() {
        // Token 0 prefers experts 2 then 0; token 1 prefers 1 then 2.
        let logits = [1.0, -1.0, 2.0, 0.0, /**/ 0.0, 3.0, 1.0, -2.0];
        let r = route(&logits, 4, 2, true);
        assert_eq!(
            r.tokens,
            vec![0, 1, 0, 1],
            "experts 0, 1, 2 (two tokens), 3"
        );
        assert_eq!(r.offsets, vec![0, 1, 2, 4, 4]);
        let p = |l: &[f32], i: usize| {
            let s: f32 = l.iter().map(|x| x.exp()).sum();
            l[i].exp() / s
        };
        let (a, b) = (p(&logits[..4], 0), p(&logits[..4], 2));
        assert!((r.weights[0] - a / (a + b)).abs() < 1e-6);
        assert!((r.weights[2] - b / (a + b)).abs() < 1e-6);
        // Without renormalisation: the softmax probabilities themselves.
        let plain = route(&logits, 4, 2, false);
        assert!((plain.weights[0] - a).abs() < 1e-6 && (plain.weights[2] - b).abs() < 1e-6);
        // Ties: the lower index first.
        let tie = route(&[0.0; 4], 4, 1, false);
        assert_eq!((tie.tokens, tie.offsets), (vec![0], vec![0, 1, 1, 1, 1]));
    }
}
