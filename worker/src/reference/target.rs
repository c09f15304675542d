//! The reference target forward on host slices with the reference ops
//! ([`super::ops::Cpu`]): what the device target
//! ([`crate::models::target::device::DeviceTarget`]) and the CPU worker's taps are tested
//! against, and what is tested against transformers.

use dflash_shared::model_config::TargetConfig;

use super::ops::Cpu;
use super::{Heads, KeySpan};
use crate::models::target::{Layer, Target};

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

    /// A layer's MLP half on the residual stream `x`: `x += down(swiglu(gate, up))` of
    /// `ln2(x)`.
    fn mlp_block(
        &self,
        cpu: &Cpu,
        l: &Layer,
        x: &mut [f32],
        s: &mut Scratch,
        times: &mut Option<&mut OpTimes>,
    ) {
        let c = &self.cfg;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let t = x.len() / h;
        let eps = c.rms_norm_eps as f32;
        let Scratch {
            n1, o, g, u, act, ..
        } = s;
        timed(times, "rmsnorm", || cpu.rmsnorm(x, &l.ln2, n1, h, eps));
        timed(times, "matmul", || cpu.matmul(n1, &l.gate, g, t, h, inter));
        timed(times, "matmul", || cpu.matmul(n1, &l.up, u, t, h, inter));
        timed(times, "swiglu", || cpu.swiglu(g, u, act));
        timed(times, "matmul", || cpu.matmul(act, &l.down, o, t, inter, h));
        timed(times, "residual", || {
            x.iter_mut().zip(o.iter()).for_each(|(a, b)| *a += b)
        });
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
