//! Where every buffer of the drafter's step lives: placed once from the arena for the
//! largest sample (`max_len` context positions, `max_anchors` blocks), first in a dry
//! arena that measures them and then in the real one. [`Buffers`] holds the frozen
//! embedding and lm_head, the parameters and their gradient; [`Saved`] one layer's
//! activations that the backward reads; [`Work`] the scratch of a sample's step.

use dflash_shared::drafter::DrafterConfig;

use super::mixed::{Mixed, NONE};
use super::update::Opt;
use crate::device::ops::{CeState, Ops};
use crate::device::{Arena, DSlice, Device, Result};
use crate::models::drafter::{Drafter, Frozen};

/// Vocabulary columns per cross-entropy chunk.
pub(super) const CHUNK: usize = 4096;

/// Samples' worth of rows (each up to `max_anchors × block_size`) whose losses and
/// `argmax == label` flags the device holds until they are read, once per step unless a
/// step has more.
pub(super) const CE_SAMPLES: usize = 16;

/// One sample's sizes: context positions, blocks, block rows, and keys (context + rows).
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub(super) slen: usize,
    pub(super) nb: usize,
    pub(super) m: usize,
    pub(super) tk: usize,
}

pub(super) struct Saved {
    pub(super) h_in: DSlice,
    pub(super) x: DSlice,
    pub(super) rstd1: DSlice,
    pub(super) q_pre: DSlice,
    pub(super) q_rstd: DSlice,
    pub(super) k_pre: DSlice,
    pub(super) k_rstd: DSlice,
    pub(super) q: DSlice,
    pub(super) k: DSlice,
    pub(super) v: DSlice,
    pub(super) att: DSlice,
    pub(super) lse: DSlice,
    pub(super) h_mid: DSlice,
    pub(super) x2: DSlice,
    pub(super) rstd2: DSlice,
    /// The fused gate/up projection: rows `[gate | up]`.
    pub(super) gu: DSlice,
    pub(super) act: DSlice,
}

impl Saved {
    /// Layer `l`'s activations for `m` block rows and `tk` keys (`f` allocates `n` floats
    /// by name).
    pub(super) fn alloc(
        f: &mut impl FnMut(usize, &str) -> Result<DSlice>,
        c: &DrafterConfig,
        l: usize,
        m: usize,
        tk: usize,
        bf16: bool,
    ) -> Result<Saved> {
        let (h, hd, inter) = (c.hidden, c.head_dim, c.intermediate);
        let (qd, kd) = (c.q_heads * hd, c.kv_heads * hd);
        let mut g = |n: usize, what: &str| f(n, &format!("layer {l} {what}"));
        Ok(Saved {
            h_in: g(m * h, "h_in")?,
            x: g(Mixed::gemm_act_floats(bf16, m * h), "x")?,
            rstd1: g(m, "rstd1")?,
            q_pre: g(m * qd, "q_pre")?,
            q_rstd: g(m * c.q_heads, "q_rstd")?,
            k_pre: g(tk * kd, "k_pre")?,
            k_rstd: g(tk * c.kv_heads, "k_rstd")?,
            q: g(m * qd, "q")?,
            k: g(tk * kd, "k")?,
            v: g(tk * kd, "v")?,
            att: g(m * qd, "att")?,
            lse: g(m * c.q_heads, "lse")?,
            h_mid: g(m * h, "h_mid")?,
            x2: g(Mixed::gemm_act_floats(bf16, m * h), "x2")?,
            rstd2: g(m, "rstd2")?,
            gu: g(2 * m * inter, "gate|up")?,
            act: g(Mixed::gemm_act_floats(bf16, m * inter), "act")?,
        })
    }
}

pub(super) struct Work {
    pub(super) taps: DSlice,
    /// The taps as they arrive from the hidden-state slot (bf16), cast on the device.
    /// Two staging buffers for bf16 taps: the next sample's are copied in (copy stream)
    /// while the current one computes.
    pub(super) taps16: [DSlice; 2],
    pub(super) ctx_pre: DSlice,
    pub(super) ctx: DSlice,
    pub(super) ctx_rstd: DSlice,
    pub(super) block_ids: DSlice,
    pub(super) block_pos: DSlice,
    pub(super) key_pos: DSlice,
    pub(super) spans: DSlice,
    pub(super) hcur: DSlice,
    pub(super) hn: DSlice,
    pub(super) rstd_f: DSlice,
    pub(super) o: DSlice,
    // Cross-entropy.
    pub(super) rows: DSlice,
    pub(super) labels: DSlice,
    pub(super) scale: DSlice,
    pub(super) xrows: DSlice,
    pub(super) dxrows: DSlice,
    /// A chunk's logits (f32 on the CPU device, bf16 on a GPU).
    pub(super) logits: DSlice,
    pub(super) ce_max: DSlice,
    pub(super) ce_sum: DSlice,
    pub(super) ce_argmax: DSlice,
    pub(super) ce_label: DSlice,
    pub(super) ce_acc: DSlice,
    pub(super) ce_loss: DSlice,
    pub(super) ce_correct: DSlice,
    // Backward.
    pub(super) dh: DSlice,
    pub(super) dx: DSlice,
    pub(super) dx2: DSlice,
    pub(super) dact: DSlice,
    /// The gradient of the fused gate/up projection: rows `[dgate | dup]`.
    pub(super) dgu: DSlice,
    pub(super) datt: DSlice,
    pub(super) dq: DSlice,
    pub(super) dk: DSlice,
    pub(super) dv: DSlice,
    pub(super) dq_pre: DSlice,
    pub(super) dk_pre: DSlice,
    /// The attention backward's scratch (Ops::attention_backward_scratch).
    pub(super) delta: DSlice,
    pub(super) dctx: DSlice,
    pub(super) dctx_pre: DSlice,
}

impl Work {
    /// The cross-entropy's state for `n` rows of width `h`.
    pub(super) fn ce_state(&self, n: usize, h: usize) -> CeState {
        CeState {
            run_max: self.ce_max.f32s(0..n),
            run_sum: self.ce_sum.f32s(0..n),
            best_i: self.ce_argmax.f32s(0..n),
            label_logit: self.ce_label.f32s(0..n),
            acc: self.ce_acc.f32s(0..n * h),
        }
    }

    /// The work buffers for rows of `s` positions and `m` block rows (`f` allocates `n`
    /// floats by name).
    pub(super) fn alloc(
        f: &mut impl FnMut(usize, &str) -> Result<DSlice>,
        c: &DrafterConfig,
        s: usize,
        m: usize,
        bf16: bool,
    ) -> Result<Work> {
        let (h, hd, inter) = (c.hidden, c.head_dim, c.intermediate);
        let (qd, kd) = (c.q_heads * hd, c.kv_heads * hd);
        let (tk, n_ce, cw) = (s + m, m, CHUNK.min(c.vocab));
        Ok(Work {
            taps: f(s * c.n_taps * h, "taps")?,
            taps16: [
                f((s * c.n_taps * h).div_ceil(2), "taps bf16 (0)")?,
                f((s * c.n_taps * h).div_ceil(2), "taps bf16 (1)")?,
            ],
            ctx_pre: f(s * h, "ctx_pre")?,
            ctx: f(Mixed::gemm_act_floats(bf16, s * h), "ctx")?,
            ctx_rstd: f(s, "ctx_rstd")?,
            block_ids: f(m, "block ids")?,
            block_pos: f(m, "block positions")?,
            key_pos: f(tk, "key positions")?,
            spans: f(4 * m, "spans")?,
            hcur: f(m * h, "hcur")?,
            hn: f(m * h, "hn")?,
            rstd_f: f(m, "rstd_f")?,
            o: f(m * h, "o")?,
            rows: f(n_ce, "ce rows")?,
            labels: f(n_ce, "ce labels")?,
            scale: f(n_ce, "ce scale")?,
            xrows: f(n_ce * h, "ce x")?,
            dxrows: f(n_ce * h, "ce dx")?,
            logits: f(n_ce * cw, "ce logits")?,
            ce_max: f(n_ce, "ce max")?,
            ce_sum: f(n_ce, "ce sum")?,
            ce_argmax: f(n_ce, "ce argmax")?,
            ce_label: f(n_ce, "ce label logit")?,
            ce_acc: f(n_ce * h, "ce softmax·W")?,
            ce_loss: f(n_ce * CE_SAMPLES, "ce loss")?,
            ce_correct: f(n_ce * CE_SAMPLES, "ce argmax is the label")?,
            dh: f(m * h, "dh")?,
            dx: f(m * h, "dx")?,
            dx2: f(m * h, "dx2")?,
            dact: f(m * inter, "dact")?,
            dgu: f(2 * m * inter, "dgate|dup")?,
            datt: f(m * qd, "datt")?,
            dq: f(m * qd, "dq")?,
            dk: f(tk * kd, "dk")?,
            dv: f(tk * kd, "dv")?,
            dq_pre: f(m * qd, "dq_pre")?,
            dk_pre: f(tk * kd, "dk_pre")?,
            delta: f(
                Ops::attention_backward_scratch(m, c.q_heads, hd),
                "attention backward scratch",
            )?,
            dctx: f(s * h, "dctx")?,
            dctx_pre: f(s * h, "dctx_pre")?,
        })
    }
}

/// The drafter's long-lived buffers: the frozen embedding and lm_head (f32 on the CPU
/// device, bf16 in `lm16` on a GPU), the f32 parameters with their bf16 copy for a GPU's
/// GEMMs, the gradient, the rotary frequencies, every layer's saved activations, the
/// work buffers and the GEMMs' bf16 scratch.
pub(super) struct Buffers {
    pub(super) embed: DSlice,
    pub(super) lm_head: DSlice,
    pub(super) lm16: DSlice,
    pub(super) params: DSlice,
    pub(super) params16: DSlice,
    pub(super) grads: DSlice,
    pub(super) inv_freq: DSlice,
    pub(super) saved: Vec<Saved>,
    pub(super) w: Work,
    pub(super) mixed: Mixed,
    /// The RMSNorm backward's scratch.
    pub(super) rms_partials: DSlice,
}

impl Buffers {
    /// Lay out (and, in a real arena, fill) everything for rows of `s` positions and `m`
    /// block rows, and the optimizer's state.
    pub(super) fn place(
        dv: &mut dyn Device,
        arena: &mut Arena,
        d: &Drafter,
        frozen: &Frozen,
        s: usize,
        m: usize,
        bf16: bool,
    ) -> Result<(Buffers, Opt)> {
        let c = &d.cfg;
        let (h, hd, inter) = (c.hidden, c.head_dim, c.intermediate);
        let (qd, kd) = (c.q_heads * hd, c.kv_heads * hd);
        let tk = s + m;
        let n_ce = m;
        let cw = CHUNK.min(c.vocab);
        let mut f = |n: usize, name: &str| arena.alloc_f32(dv, n.max(1), name);
        let embed = f(frozen.embed.len(), "embed_tokens")?;
        let (lm_head, lm16) = if bf16 {
            (NONE, f(frozen.lm_head.len().div_ceil(2), "lm_head (bf16)")?)
        } else {
            (f(frozen.lm_head.len(), "lm_head")?, NONE)
        };
        let params = f(d.layout.total, "parameters")?;
        let params16 = if bf16 {
            f(d.layout.total.div_ceil(2), "parameters (bf16)")?
        } else {
            NONE
        };
        // GEMM inputs and incoming gradients, cast to bf16: the largest of any GEMM.
        let widest = (s * c.n_taps * h)
            .max((s + m) * h.max(qd).max(kd).max(inter))
            .max(n_ce * cw.max(h));
        let mixed = if bf16 {
            Mixed {
                bf16,
                xb: f(widest.div_ceil(2), "bf16 GEMM inputs")?,
                yb: f(widest.div_ceil(2), "bf16 GEMM gradients")?,
            }
        } else {
            Mixed {
                bf16,
                xb: NONE,
                yb: NONE,
            }
        };
        let grads = f(d.layout.total, "gradients")?;
        let inv_freq = f(d.inv_freq.len(), "rope inv_freq")?;
        let opt = Opt::alloc(&mut f, d.layout.total)?;
        let saved = (0..c.layers)
            .map(|l| Saved::alloc(&mut f, c, l, m, tk, bf16))
            .collect::<Result<Vec<Saved>>>()?;
        let w = Work::alloc(&mut f, c, s, m, bf16)?;
        let rms_partials = f(
            crate::device::ops::RMSNORM_BWD_SCRATCH_F32,
            "rmsnorm backward partials",
        )?;
        arena.fill_f32(dv, embed, &frozen.embed, false)?;
        if bf16 {
            arena.fill_f32(dv, lm16, &frozen.lm_head, true)?;
        } else {
            arena.fill_f32(dv, lm_head, &frozen.lm_head, false)?;
        }
        arena.fill_f32(dv, inv_freq, &d.inv_freq, false)?;
        let buffers = Buffers {
            embed,
            lm_head,
            lm16,
            params,
            params16,
            grads,
            inv_freq,
            saved,
            w,
            mixed,
            rms_partials,
        };
        Ok((buffers, opt))
    }
}
