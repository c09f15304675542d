//! The reference target forward on host slices with the reference ops
//! ([`super::ops::Cpu`]): what the device target
//! ([`crate::models::target::device::DeviceTarget`]) and the CPU worker's taps are tested
//! against, and what is tested against transformers.

use super::ops::Cpu;
use super::{Heads, KeySpan};
use crate::models::target::Target;

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
        let (t, h, hd) = (tokens.len(), c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let heads = Heads {
            q_heads: nh,
            kv_heads: nkv,
            head_dim: hd,
        };
        let eps = c.rms_norm_eps as f32;
        let cpu = &Cpu::new();
        let mut x = Vec::with_capacity(t * h);
        for &tok in tokens {
            let tok = (tok as usize).min(c.vocab_size - 1);
            x.extend_from_slice(&self.embed[tok * h..(tok + 1) * h]);
        }
        let positions: Vec<usize> = (0..t).collect();
        let spans: Vec<KeySpan> = (0..t)
            .map(|i| KeySpan {
                a: 0..i + 1,
                b: 0..0,
            })
            .collect();
        let width = self.taps.len() * h;
        let mut out = vec![0f32; t * width];
        let (mut n1, mut q, mut k, mut v) = (
            vec![0.0; t * h],
            vec![0.0; t * nh * hd],
            vec![0.0; t * nkv * hd],
            vec![0.0; t * nkv * hd],
        );
        let (mut att, mut o) = (vec![0.0; t * nh * hd], vec![0.0; t * h]);
        let (mut g, mut u, mut act) = (
            vec![0.0; t * c.intermediate_size],
            vec![0.0; t * c.intermediate_size],
            vec![0.0; t * c.intermediate_size],
        );
        for (li, l) in self.layers.iter().enumerate() {
            timed(&mut times, "rmsnorm", || {
                cpu.rmsnorm(&x, &l.ln1, &mut n1, h, eps)
            });
            timed(&mut times, "matmul", || {
                cpu.matmul(&n1, &l.wq, &mut q, t, h, nh * hd)
            });
            timed(&mut times, "matmul", || {
                cpu.matmul(&n1, &l.wk, &mut k, t, h, nkv * hd)
            });
            timed(&mut times, "matmul", || {
                cpu.matmul(&n1, &l.wv, &mut v, t, h, nkv * hd)
            });
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                let q0 = q.clone();
                timed(&mut times, "rmsnorm", || {
                    cpu.rmsnorm(&q0, qn, &mut q, hd, eps)
                });
                let k0 = k.clone();
                timed(&mut times, "rmsnorm", || {
                    cpu.rmsnorm(&k0, kn, &mut k, hd, eps)
                });
            }
            timed(&mut times, "rope", || {
                cpu.rope(
                    &mut q,
                    nh,
                    hd,
                    &positions,
                    &self.inv_freq,
                    self.rope_scale,
                    false,
                )
            });
            timed(&mut times, "rope", || {
                cpu.rope(
                    &mut k,
                    nkv,
                    hd,
                    &positions,
                    &self.inv_freq,
                    self.rope_scale,
                    false,
                )
            });
            timed(&mut times, "attention", || {
                cpu.attention(&q, &k, &v, &mut att, &spans, heads)
            });
            timed(&mut times, "matmul", || {
                cpu.matmul(&att, &l.wo, &mut o, t, nh * hd, h)
            });
            timed(&mut times, "residual", || {
                x.iter_mut().zip(&o).for_each(|(a, b)| *a += b)
            });
            timed(&mut times, "rmsnorm", || {
                cpu.rmsnorm(&x, &l.ln2, &mut n1, h, eps)
            });
            timed(&mut times, "matmul", || {
                cpu.matmul(&n1, &l.gate, &mut g, t, h, c.intermediate_size)
            });
            timed(&mut times, "matmul", || {
                cpu.matmul(&n1, &l.up, &mut u, t, h, c.intermediate_size)
            });
            timed(&mut times, "swiglu", || cpu.swiglu(&g, &u, &mut act));
            timed(&mut times, "matmul", || {
                cpu.matmul(&act, &l.down, &mut o, t, c.intermediate_size, h)
            });
            timed(&mut times, "residual", || {
                x.iter_mut().zip(&o).for_each(|(a, b)| *a += b)
            });
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
