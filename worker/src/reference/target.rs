//! The reference target forward on host slices with the reference ops
//! ([`super::ops::Cpu`]): what the device target
//! ([`crate::models::target::device::DeviceTarget`]) and the CPU worker's taps are tested
//! against, and what is tested against transformers.

use dflash_shared::model_config::{Moe, TargetConfig};

use super::ops::Cpu;
use super::{Heads, KeySpan};
use crate::models::target::{Layer, Mlp, Swiglu, Target};

impl Target {
    /// Tapped hidden states of one sequence: `[tokens, taps × hidden]`, row-major.
    pub fn forward_taps(&self, tokens: &[u32]) -> Vec<f32> {
        self.forward_taps_timed(tokens, None)
    }

    /// [`forward_taps`](Self::forward_taps), adding each op's wall time to `times` when
    /// given (for `bench compute`).
    pub fn forward_taps_timed(&self, tokens: &[u32], mut times: Option<&mut OpTimes>) -> Vec<f32> {
        assert!(
            self.mapped.is_none(),
            "a target loaded for a device (Load::Mapped) has no host weights to compute with"
        );
        let c = &self.cfg;
        let (t, h) = (tokens.len(), c.hidden_size);
        let cpu = &Cpu::new();
        let mut x = Vec::with_capacity(t * h);
        for &tok in tokens {
            let tok = (tok as usize).min(c.vocab_size - 1);
            x.extend_from_slice(&self.embed[tok * h..(tok + 1) * h]);
        }
        let width = self.taps.len() * h;
        let mut out = vec![0f32; t * width];
        let s = &mut Scratch::new(c, t);
        for (li, l) in self.layers.iter().enumerate() {
            self.attention_block(cpu, l, &mut x, s, &mut times);
            self.mlp_block(cpu, l, &mut x, s, &mut times);
            for (ti, &tap) in self.taps.iter().enumerate() {
                if tap == li {
                    for r in 0..t {
                        out[r * width + ti * h..r * width + (ti + 1) * h]
                            .copy_from_slice(&x[r * h..(r + 1) * h]);
                    }
                }
            }
        }
        out
    }

    /// A layer's attention half on the residual stream `x` (`[t, hidden]`):
    /// `x += o_proj(attention(rope(norm(q)), rope(norm(k)), v))` of `ln1(x)`.
    fn attention_block(
        &self,
        cpu: &Cpu,
        l: &Layer,
        x: &mut [f32],
        s: &mut Scratch,
        times: &mut Option<&mut OpTimes>,
    ) {
        let c = &self.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let t = x.len() / h;
        let heads = Heads {
            q_heads: nh,
            kv_heads: nkv,
            head_dim: hd,
        };
        let eps = c.rms_norm_eps as f32;
        let Scratch {
            n1,
            q,
            k,
            v,
            att,
            o,
            positions,
            spans,
            ..
        } = s;
        timed(times, "rmsnorm", || cpu.rmsnorm(x, &l.ln1, n1, h, eps));
        timed(times, "matmul", || cpu.matmul(n1, &l.wq, q, t, h, nh * hd));
        timed(times, "matmul", || cpu.matmul(n1, &l.wk, k, t, h, nkv * hd));
        timed(times, "matmul", || cpu.matmul(n1, &l.wv, v, t, h, nkv * hd));
        if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
            let q0 = q.clone();
            timed(times, "rmsnorm", || cpu.rmsnorm(&q0, qn, q, hd, eps));
            let k0 = k.clone();
            timed(times, "rmsnorm", || cpu.rmsnorm(&k0, kn, k, hd, eps));
        }
        let (inv_freq, scale) = (&self.inv_freq, self.rope_scale);
        timed(times, "rope", || {
            cpu.rope(q, nh, hd, positions, inv_freq, scale, false)
        });
        timed(times, "rope", || {
            cpu.rope(k, nkv, hd, positions, inv_freq, scale, false)
        });
        timed(times, "attention", || {
            cpu.attention(q, k, v, att, spans, heads)
        });
        timed(times, "matmul", || cpu.matmul(att, &l.wo, o, t, nh * hd, h));
        timed(times, "residual", || {
            x.iter_mut().zip(o.iter()).for_each(|(a, b)| *a += b)
        });
    }

    /// A layer's MLP half on the residual stream `x`: `x += mlp(ln2(x))`, the MLP dense
    /// (`down(swiglu(gate, up))`) or a mixture of experts ([`moe`]).
    fn mlp_block(
        &self,
        cpu: &Cpu,
        l: &Layer,
        x: &mut [f32],
        s: &mut Scratch,
        times: &mut Option<&mut OpTimes>,
    ) {
        let c = &self.cfg;
        let h = c.hidden_size;
        let eps = c.rms_norm_eps as f32;
        timed(times, "rmsnorm", || {
            cpu.rmsnorm(x, &l.ln2, &mut s.n1, h, eps)
        });
        match (&l.mlp, &c.moe) {
            (Mlp::Dense(w), _) => swiglu_mlp(cpu, w, s, h, c.intermediate_size, times),
            (Mlp::Sparse { router, experts }, Some(m)) => timed(times, "moe", || {
                moe(cpu, m, router, experts, &s.n1, &mut s.o, h)
            }),
            (Mlp::Sparse { .. }, None) => unreachable!("a sparse layer of a dense config"),
        }
        timed(times, "residual", || {
            x.iter_mut().zip(s.o.iter()).for_each(|(a, b)| *a += b)
        });
    }
}

/// `s.o = down(swiglu(gate · s.n1, up · s.n1))` for the rows of `s.n1` (`[t, h]`, MLP
/// width `inter`).
fn swiglu_mlp(
    cpu: &Cpu,
    w: &Swiglu,
    s: &mut Scratch,
    h: usize,
    inter: usize,
    times: &mut Option<&mut OpTimes>,
) {
    let t = s.n1.len() / h;
    let Scratch {
        n1, o, g, u, act, ..
    } = s;
    let (g, u, act) = (
        &mut g[..t * inter],
        &mut u[..t * inter],
        &mut act[..t * inter],
    );
    timed(times, "matmul", || cpu.matmul(n1, &w.gate, g, t, h, inter));
    timed(times, "matmul", || cpu.matmul(n1, &w.up, u, t, h, inter));
    timed(times, "swiglu", || cpu.swiglu(g, u, act));
    timed(times, "matmul", || cpu.matmul(act, &w.down, o, t, inter, h));
}

/// Qwen3-MoE's sparse MLP of the rows of `x` (`[t, h]`) into `out`: per row, the softmax
/// of the router's logits, the `num_experts_per_tok` most probable experts (their
/// probabilities renormalised to sum to 1 when `norm_topk_prob`), and the sum of those
/// experts' SwiGLU MLPs of the row, each times its probability. Plainly: each expert runs
/// over the rows routed to it.
fn moe(
    cpu: &Cpu,
    m: &Moe,
    router: &[f32],
    experts: &[Swiglu],
    x: &[f32],
    out: &mut [f32],
    h: usize,
) {
    let (t, ne, mi) = (x.len() / h, m.num_experts, m.moe_intermediate_size);
    let mut logits = vec![0f32; t * ne];
    cpu.matmul(x, router, &mut logits, t, h, ne);
    // Per expert: (row, weight) of the rows routed to it.
    let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); ne];
    for (r, l) in logits.chunks_exact(ne).enumerate() {
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = l.iter().map(|v| ((v - max) as f64).exp()).collect();
        let sum: f64 = e.iter().sum();
        let mut order: Vec<usize> = (0..ne).collect();
        order.sort_by(|&a, &b| e[b].total_cmp(&e[a]));
        let top = &order[..m.num_experts_per_tok];
        let top_sum: f64 = top.iter().map(|&i| e[i] / sum).sum();
        for &i in top {
            let p = e[i] / sum;
            let w = if m.norm_topk_prob { p / top_sum } else { p };
            routed[i].push((r, w as f32));
        }
    }
    out.iter_mut().for_each(|o| *o = 0.0);
    for (w, rows) in experts.iter().zip(&routed) {
        let n = rows.len();
        if n == 0 {
            continue;
        }
        let xe: Vec<f32> = rows
            .iter()
            .flat_map(|&(r, _)| x[r * h..(r + 1) * h].iter().copied())
            .collect();
        let (mut g, mut u, mut a) = (vec![0f32; n * mi], vec![0f32; n * mi], vec![0f32; n * mi]);
        let mut y = vec![0f32; n * h];
        cpu.matmul(&xe, &w.gate, &mut g, n, h, mi);
        cpu.matmul(&xe, &w.up, &mut u, n, h, mi);
        cpu.swiglu(&g, &u, &mut a);
        cpu.matmul(&a, &w.down, &mut y, n, mi, h);
        for (&(r, wt), yr) in rows.iter().zip(y.chunks_exact(h)) {
            for (o, v) in out[r * h..(r + 1) * h].iter_mut().zip(yr) {
                *o += wt * v;
            }
        }
    }
}

/// One sequence's work buffers, reused by every layer, and its positions and causal key
/// spans.
struct Scratch {
    n1: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    act: Vec<f32>,
    positions: Vec<usize>,
    spans: Vec<KeySpan>,
}

impl Scratch {
    fn new(c: &TargetConfig, t: usize) -> Scratch {
        let (h, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        Scratch {
            n1: vec![0.0; t * h],
            q: vec![0.0; t * nh * hd],
            k: vec![0.0; t * nkv * hd],
            v: vec![0.0; t * nkv * hd],
            att: vec![0.0; t * nh * hd],
            o: vec![0.0; t * h],
            g: vec![0.0; t * inter],
            u: vec![0.0; t * inter],
            act: vec![0.0; t * inter],
            positions: (0..t).collect(),
            spans: (0..t)
                .map(|i| KeySpan {
                    a: 0..i + 1,
                    b: 0..0,
                })
                .collect(),
        }
    }
}

/// Wall time per op name, accumulated over calls.
#[derive(Debug, Default, Clone)]
pub struct OpTimes {
    pub secs: std::collections::BTreeMap<&'static str, f64>,
}

fn timed<R>(times: &mut Option<&mut OpTimes>, op: &'static str, f: impl FnOnce() -> R) -> R {
    match times {
        None => f(),
        Some(t) => {
            let t0 = std::time::Instant::now();
            let r = f();
            *t.secs.entry(op).or_default() += t0.elapsed().as_secs_f64();
            r
        }
    }
}
