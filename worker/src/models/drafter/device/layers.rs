//! The drafter's pass on the device, a sample at a time: the context projection, the
//! block embeddings, every layer's forward (keeping what the backward needs, in
//! [`Saved`]) and the final norm; then the backward from the loss's gradient through
//! every layer in reverse into the gradient, finishing its buckets in the order
//! [`bucket_plan`] gives. The attention is the fused span kernel, which recomputes the
//! probabilities from the saved log-sum-exp instead of storing them.

use std::ops::Range;

use super::layout::{Buffers, Dims, Saved, Work};
use super::mixed::{Mixed, NONE, W};
use crate::device::ops::gemm::Dx;
use crate::device::ops::{Attention, AttentionGrad, Mat, Ops};
use crate::device::{DSlice, Result, Stream};
use crate::models::drafter::{Drafter, LayerIdx};

/// What every part of a sample's step reads: the drafter's sizes, the sample's, the
/// parameters as GEMM weights and the work buffers' slices for this sample.
#[derive(Clone, Copy)]
pub(super) struct Locals {
    pub(super) h: usize,
    pub(super) hd: usize,
    pub(super) bs: usize,
    pub(super) inter: usize,
    pub(super) qd: usize,
    pub(super) kd: usize,
    pub(super) qh: usize,
    pub(super) kvh: usize,
    pub(super) eps: f32,
    pub(super) n_taps: usize,
    pub(super) vocab: usize,
    pub(super) slen: usize,
    pub(super) nb: usize,
    pub(super) m: usize,
    pub(super) tk: usize,
    pub(super) fc: W,
    pub(super) hnorm: DSlice,
    pub(super) fnorm: DSlice,
    /// Parameters and gradients (f32), and the bf16 copy of the parameters.
    pub(super) pw: DSlice,
    pub(super) gw: DSlice,
    pub(super) p16: DSlice,
    pub(super) mx: Mixed,
    pub(super) lm32: DSlice,
    pub(super) lm16: DSlice,
    pub(super) taps: DSlice,
    pub(super) ctx_pre: DSlice,
    pub(super) ctx: Mat,
    pub(super) ctx_rstd: DSlice,
    pub(super) hcur: DSlice,
    pub(super) o: DSlice,
    pub(super) spans_d: DSlice,
    pub(super) hn: DSlice,
    pub(super) rstd_f: DSlice,
    /// The block rows' positions and every key's (the context's, then the block rows'),
    /// and the rotary frequencies and scale.
    pub(super) block_pos: DSlice,
    pub(super) key_pos: DSlice,
    pub(super) inv_freq: DSlice,
    pub(super) rope_scale: f32,
}

impl Locals {
    /// The sizes and slices of a sample of `dims`.
    pub(super) fn new(d: &Drafter, b: &Buffers, dims: Dims) -> Locals {
        let c = &d.cfg;
        let (h, hd) = (c.hidden, c.head_dim);
        let Dims { slen, nb, m, tk } = dims;
        let w = &b.w;
        let weight = |name: &str| {
            let r = d.layout.range(name);
            W {
                f: b.params.f32s(r.clone()),
                b: if b.mixed.bf16 {
                    b.params16.sub(2, r)
                } else {
                    NONE
                },
            }
        };
        Locals {
            h,
            hd,
            bs: c.block_size,
            inter: c.intermediate,
            qd: c.q_heads * hd,
            kd: c.kv_heads * hd,
            qh: c.q_heads,
            kvh: c.kv_heads,
            eps: c.eps as f32,
            n_taps: c.n_taps,
            vocab: c.vocab,
            slen,
            nb,
            m,
            tk,
            fc: weight("fc.weight"),
            hnorm: weight("hidden_norm.weight").f,
            fnorm: weight("norm.weight").f,
            pw: b.params,
            gw: b.grads,
            p16: b.params16,
            mx: b.mixed,
            lm32: b.lm_head,
            lm16: b.lm16,
            taps: w.taps.f32s(0..slen * c.n_taps * h),
            ctx_pre: w.ctx_pre.f32s(0..slen * h),
            ctx: b.mixed.gemm_act(w.ctx, slen, h),
            ctx_rstd: w.ctx_rstd.f32s(0..slen),
            hcur: w.hcur.f32s(0..m * h),
            o: w.o.f32s(0..m * h),
            spans_d: w.spans.f32s(0..4 * m),
            hn: w.hn.f32s(0..m * h),
            rstd_f: w.rstd_f.f32s(0..m),
            block_pos: w.block_pos.f32s(0..m),
            key_pos: w.key_pos.f32s(0..tk),
            inv_freq: b.inv_freq,
            rope_scale: d.rope_scale,
        }
    }

    /// Parameters `r` as a GEMM weight.
    fn pp(&self, r: &std::ops::Range<usize>) -> W {
        W {
            f: self.pw.f32s(r.clone()),
            b: if self.mx.bf16 {
                self.p16.sub(2, r.clone())
            } else {
                NONE
            },
        }
    }

    /// Vocabulary rows `start..start + cw` of the frozen lm_head as a GEMM weight.
    pub(super) fn lmw(&self, start: usize, cw: usize) -> W {
        let r = start * self.h..(start + cw) * self.h;
        if self.mx.bf16 {
            W {
                f: NONE,
                b: self.lm16.sub(2, r),
            }
        } else {
            W {
                f: self.lm32.f32s(r),
                b: NONE,
            }
        }
    }
}

/// One sample's pass on the device: the ops, the sample's [`Locals`] and the work
/// buffers. A layer's forward and backward, and the whole forward and backward, are its
/// methods.
pub(super) struct Pass<'a> {
    pub(super) ops: &'a mut Ops,
    pub(super) lc: Locals,
    pub(super) w: &'a Work,
}

impl Pass<'_> {
    /// A layer's attention inputs: `h_in` kept, `x = ln1(h)`, then q from the block rows
    /// and k, v from the context followed by the block rows.
    fn projections(&mut self, li: &LayerIdx, sv: &Saved) -> Result<()> {
        let lc = self.lc;
        let Locals {
            h,
            qd,
            kd,
            eps,
            slen,
            m,
            pw,
            mx,
            ctx,
            hcur,
            ..
        } = lc;
        let ops = &mut *self.ops;
        let p = |r: &Range<usize>| pw.f32s(r.clone());
        let xin = mx.gemm_act(sv.x, m, h);
        let (h_in, hc) = (Mat::f32(sv.h_in, m, h), Mat::f32(hcur, m, h));
        ops.copy_cols((h_in, 0), (hc, 0), h)?;
        // x and the context are written as the GEMMs read them (bf16 on a GPU).
        ops.rmsnorm(hc, p(&li.ln1), xin, sv.rstd1.f32s(0..m), eps)?;
        let ctx_rows = |b: DSlice| Mat::f32(b, slen, kd);
        let blk_rows = |b: DSlice| Mat::f32(b.f32s(slen * kd..(slen + m) * kd), m, kd);
        mx.mm_in(ops, ctx, lc.pp(&li.wk), ctx_rows(sv.k_pre))?;
        mx.mm_in(ops, ctx, lc.pp(&li.wv), ctx_rows(sv.v))?;
        mx.mm_in(ops, xin, lc.pp(&li.wq), Mat::f32(sv.q_pre, m, qd))?;
        mx.mm_in(ops, xin, lc.pp(&li.wk), blk_rows(sv.k_pre))?;
        mx.mm_in(ops, xin, lc.pp(&li.wv), blk_rows(sv.v))
    }

    /// q and k RMS-normed per head, then rotated (q at the block positions, k at the key
    /// positions).
    fn qk_norm_rope(&mut self, li: &LayerIdx, sv: &Saved) -> Result<()> {
        let Locals {
            hd,
            qh,
            kvh,
            eps,
            m,
            tk,
            pw,
            block_pos,
            key_pos,
            inv_freq,
            rope_scale,
            ..
        } = self.lc;
        let ops = &mut *self.ops;
        let p = |r: &Range<usize>| pw.f32s(r.clone());
        // Per head: rows of head_dim.
        let (q_pre, q) = (Mat::f32(sv.q_pre, m * qh, hd), Mat::f32(sv.q, m * qh, hd));
        let (k_pre, k) = (
            Mat::f32(sv.k_pre, tk * kvh, hd),
            Mat::f32(sv.k, tk * kvh, hd),
        );
        ops.rmsnorm(q_pre, p(&li.qn), q, sv.q_rstd.f32s(0..m * qh), eps)?;
        ops.rmsnorm(k_pre, p(&li.kn), k, sv.k_rstd.f32s(0..tk * kvh), eps)?;
        let (q, k) = (Mat::f32(sv.q, m, qh * hd), Mat::f32(sv.k, tk, kvh * hd));
        ops.rope(q, block_pos, inv_freq, hd, rope_scale, false)?;
        ops.rope(k, key_pos, inv_freq, hd, rope_scale, false)
    }

    /// The span attention, its output projection added into `h`.
    fn attend(&mut self, li: &LayerIdx, sv: &Saved) -> Result<()> {
        let lc = self.lc;
        let Locals {
            h,
            hd,
            qd,
            kd,
            qh,
            kvh,
            m,
            tk,
            mx,
            hcur,
            o,
            spans_d,
            ..
        } = lc;
        let ops = &mut *self.ops;
        let att = sv.att.f32s(0..m * qd);
        ops.attention(Attention {
            q: sv.q.f32s(0..m * qd),
            k: sv.k.f32s(0..tk * kd),
            v: sv.v.f32s(0..tk * kd),
            out: att,
            lse: sv.lse.f32s(0..m * qh),
            spans: spans_d,
            tq: m,
            qh,
            kvh,
            hd,
        })?;
        let (att, out) = (Mat::f32(att, m, qd), Mat::f32(o, m, h));
        mx.mm(ops, att, lc.pp(&li.wo), out)?;
        ops.add(hcur, o)
    }

    /// The MLP half of a layer: `h_mid` kept, `h += down(swiglu(gate(x2), up(x2)))` with
    /// `x2 = ln2(h)`; gate and up as one GEMM over their adjacent weights.
    fn mlp(&mut self, li: &LayerIdx, sv: &Saved) -> Result<()> {
        let lc = self.lc;
        let Locals {
            h,
            inter,
            eps,
            m,
            pw,
            mx,
            hcur,
            o,
            ..
        } = lc;
        let ops = &mut *self.ops;
        let p = |r: &Range<usize>| pw.f32s(r.clone());
        let (h_mid, hc) = (Mat::f32(sv.h_mid, m, h), Mat::f32(hcur, m, h));
        ops.copy_cols((h_mid, 0), (hc, 0), h)?;
        // x2 and the SwiGLU's output are written as the GEMMs read them (bf16 on a GPU).
        let x2 = mx.gemm_act(sv.x2, m, h);
        ops.rmsnorm(hc, p(&li.ln2), x2, sv.rstd2.f32s(0..m), eps)?;
        let (gu, act) = (Mat::f32(sv.gu, m, 2 * inter), mx.gemm_act(sv.act, m, inter));
        mx.mm_in(ops, x2, lc.pp(&li.gate_up()), gu)?;
        mx.swiglu(ops, gu.buf, act.buf, inter)?;
        mx.mm_in(ops, act, lc.pp(&li.down), Mat::f32(o, m, h))?;
        ops.add(hcur, o)
    }

    /// Backward of [`mlp`](Self::mlp): `dh` through down, the SwiGLU, the fused gate/up
    /// (one GEMM for `dx2`, one for both weights' gradients) and ln2 (the residual's
    /// gradient stays in `dh`).
    fn mlp_backward(&mut self, li: &LayerIdx, sv: &Saved) -> Result<()> {
        let lc = self.lc;
        let Locals {
            h,
            inter,
            m,
            pw,
            gw,
            mx,
            ..
        } = lc;
        let (w, ops) = (self.w, &mut *self.ops);
        let p = |r: &Range<usize>| pw.f32s(r.clone());
        let g =
            |r: &Range<usize>, rows: usize, cols: usize| Mat::f32(gw.f32s(r.clone()), rows, cols);
        let dh = Mat::f32(w.dh, m, h);
        let (x2, h_mid) = (mx.gemm_act(sv.x2, m, h), Mat::f32(sv.h_mid, m, h));
        let (gu, act) = (sv.gu.f32s(0..2 * m * inter), mx.gemm_act(sv.act, m, inter));
        let (dact, dgu) = (Mat::f32(w.dact, m, inter), Mat::f32(w.dgu, m, 2 * inter));
        // Each buffer's writer writes it (no zeroing): dact and dx2 by their GEMM, dgu by
        // the SwiGLU backward.
        let dx2 = Mat::f32(w.dx2, m, h);
        let ddown = Some(g(&li.down, h, inter));
        mx.back_in(ops, (dh, act), lc.pp(&li.down), Dx::Write(dact), ddown)?;
        ops.swiglu_gu_backward(dact.buf, gu, dgu.buf, inter)?;
        let gate_up = li.gate_up();
        let dgate_up = Some(g(&gate_up, 2 * inter, h));
        mx.back_in(ops, (dgu, x2), lc.pp(&gate_up), Dx::Write(dx2), dgate_up)?;
        let (rstd, dln2) = (sv.rstd2.f32s(0..m), Some(gw.f32s(li.ln2.clone())));
        ops.rmsnorm_backward(dx2, h_mid, p(&li.ln2), rstd, dh, dln2)
    }

    /// Backward of [`attend`](Self::attend): `dh` through the output projection and the
    /// span attention into `dq`, `dk` and `dv`.
    fn attend_backward(&mut self, li: &LayerIdx, sv: &Saved) -> Result<()> {
        let lc = self.lc;
        let Locals {
            h,
            hd,
            qd,
            kd,
            qh,
            kvh,
            m,
            tk,
            gw,
            mx,
            spans_d,
            ..
        } = lc;
        let (w, ops) = (self.w, &mut *self.ops);
        let dh = Mat::f32(w.dh, m, h);
        let (datt, dq, dk, dv) = (
            w.datt.f32s(0..m * qd),
            w.dq.f32s(0..m * qd),
            w.dk.f32s(0..tk * kd),
            w.dv.f32s(0..tk * kd),
        );
        let (dq_pre, dk_pre) = (w.dq_pre.f32s(0..m * qd), w.dk_pre.f32s(0..tk * kd));
        // Zeroed where kernels add into them (the attention backward, the norms'
        // backward); datt is written by its GEMM.
        for b in [dq, dk, dv, dq_pre, dk_pre] {
            ops.dev.memset_zero(Stream::Compute, b)?;
        }
        let (att, q, k, v) = (
            sv.att.f32s(0..m * qd),
            sv.q.f32s(0..m * qd),
            sv.k.f32s(0..tk * kd),
            sv.v.f32s(0..tk * kd),
        );
        let dwo = Some(Mat::f32(gw.f32s(li.wo.clone()), h, qd));
        let (x, dx) = (Mat::f32(att, m, qd), Dx::Write(Mat::f32(datt, m, qd)));
        mx.mm_back(ops, (dh, x), lc.pp(&li.wo), dx, dwo)?;
        ops.attention_backward(
            AttentionGrad {
                fwd: Attention {
                    q,
                    k,
                    v,
                    out: att,
                    lse: sv.lse.f32s(0..m * qh),
                    spans: spans_d,
                    tq: m,
                    qh,
                    kvh,
                    hd,
                },
                dout: datt,
                dq,
                dk,
                dv,
            },
            w.delta,
        )
    }

    /// Backward of [`qk_norm_rope`](Self::qk_norm_rope): `dq` and `dk` rotated back, then
    /// through the per-head norms into `dq_pre` and `dk_pre`.
    fn qk_norm_rope_backward(&mut self, li: &LayerIdx, sv: &Saved) -> Result<()> {
        let Locals {
            hd,
            qh,
            kvh,
            m,
            tk,
            pw,
            gw,
            block_pos,
            key_pos,
            inv_freq,
            rope_scale,
            ..
        } = self.lc;
        let (w, ops) = (self.w, &mut *self.ops);
        let p = |r: &Range<usize>| pw.f32s(r.clone());
        let gr = |r: &Range<usize>| Some(gw.f32s(r.clone()));
        let (dq, dk) = (Mat::f32(w.dq, m, qh * hd), Mat::f32(w.dk, tk, kvh * hd));
        ops.rope(dq, block_pos, inv_freq, hd, rope_scale, true)?;
        ops.rope(dk, key_pos, inv_freq, hd, rope_scale, true)?;
        // Per head: rows of head_dim.
        let (q, k) = ((m * qh, hd), (tk * kvh, hd));
        let q_rows = |b: DSlice| Mat::f32(b, q.0, q.1);
        let k_rows = |b: DSlice| Mat::f32(b, k.0, k.1);
        let (q_rstd, k_rstd) = (sv.q_rstd.f32s(0..q.0), sv.k_rstd.f32s(0..k.0));
        let (dq, q_pre, dq_pre) = (q_rows(w.dq), q_rows(sv.q_pre), q_rows(w.dq_pre));
        ops.rmsnorm_backward(dq, q_pre, p(&li.qn), q_rstd, dq_pre, gr(&li.qn))?;
        let (dk, k_pre, dk_pre) = (k_rows(w.dk), k_rows(sv.k_pre), k_rows(w.dk_pre));
        ops.rmsnorm_backward(dk, k_pre, p(&li.kn), k_rstd, dk_pre, gr(&li.kn))
    }

    /// Backward of [`projections`](Self::projections): `dq_pre`, `dk_pre` and `dv`
    /// through wq, wk and wv (the block rows' share into `dx`, the context's into `dctx`),
    /// then `dx` through ln1 into `dh`.
    fn projections_backward(&mut self, li: &LayerIdx, sv: &Saved) -> Result<()> {
        let lc = self.lc;
        let Locals {
            h,
            qd,
            kd,
            slen,
            m,
            tk,
            pw,
            gw,
            mx,
            ctx,
            ..
        } = lc;
        let (w, ops) = (self.w, &mut *self.ops);
        let p = |r: &Range<usize>| pw.f32s(r.clone());
        let (xin, h_in) = (mx.gemm_act(sv.x, m, h), Mat::f32(sv.h_in, m, h));
        let (dh, dx, dctx) = (
            Mat::f32(w.dh, m, h),
            Mat::f32(w.dx, m, h),
            Mat::f32(w.dctx, slen, h),
        );
        let (dq_pre, dk_pre, dv) = (
            w.dq_pre.f32s(0..m * qd),
            w.dk_pre.f32s(0..tk * kd),
            w.dv.f32s(0..tk * kd),
        );
        // The saved inputs as the GEMMs read them: the block rows (dx's first writer is
        // q's, no zeroing; k and v add into it), then the context.
        let (wq, wk, wv) = (lc.pp(&li.wq), lc.pp(&li.wk), lc.pp(&li.wv));
        let blk = |b: DSlice| Mat::f32(b.f32s(slen * kd..tk * kd), m, kd);
        let block = [
            (Mat::f32(dq_pre, m, qd), wq, &li.wq, Dx::Write(dx)),
            (blk(dk_pre), wk, &li.wk, Dx::Add(dx)),
            (blk(dv), wv, &li.wv, Dx::Add(dx)),
        ];
        for (dy, wt, g, dx) in block {
            let dw = Some(Mat::f32(gw.f32s(g.clone()), dy.cols, h));
            mx.back_in(ops, (dy, xin), wt, dx, dw)?;
        }
        let ctx_rows = |b: DSlice| Mat::f32(b, slen, kd);
        for (dy, wt, g) in [(ctx_rows(dk_pre), wk, &li.wk), (ctx_rows(dv), wv, &li.wv)] {
            let dw = Some(Mat::f32(gw.f32s(g.clone()), kd, h));
            mx.back_in(ops, (dy, ctx), wt, Dx::Add(dctx), dw)?;
        }
        let (rstd, dln1) = (sv.rstd1.f32s(0..m), Some(gw.f32s(li.ln1.clone())));
        ops.rmsnorm_backward(dx, h_in, p(&li.ln1), rstd, dh, dln1)
    }

    /// The forward: the context, the block embeddings of `embed`, every layer (keeping
    /// what the backward needs in `saved`) and the final norm into `hn`.
    pub(super) fn forward(&mut self, d: &Drafter, saved: &[Saved], embed: DSlice) -> Result<()> {
        let Locals {
            h,
            eps,
            slen,
            m,
            n_taps,
            vocab,
            fc,
            hnorm,
            fnorm,
            mx,
            taps,
            ctx_pre,
            ctx,
            ctx_rstd,
            hcur,
            hn,
            rstd_f,
            ..
        } = self.lc;
        // Context: hidden_norm(fc(taps)).
        let (taps, ctx_pre) = (Mat::f32(taps, slen, n_taps * h), Mat::f32(ctx_pre, slen, h));
        mx.mm(self.ops, taps, fc, ctx_pre)?;
        self.ops.rmsnorm(ctx_pre, hnorm, ctx, ctx_rstd, eps)?;
        // Block inputs: the frozen embedding of [token at anchor, MASK, ...].
        let ids = self.w.block_ids.f32s(0..m);
        self.ops.embed(hcur, embed, ids, m, h, vocab)?;
        for (li, sv) in d.layers.iter().zip(saved) {
            self.projections(li, sv)?;
            self.qk_norm_rope(li, sv)?;
            self.attend(li, sv)?;
            self.mlp(li, sv)?;
        }
        let (hc, hn) = (Mat::f32(hcur, m, h), Mat::f32(hn, m, h));
        self.ops.rmsnorm(hc, fnorm, hn, rstd_f, eps)
    }

    /// The backward from the loss's gradient (`supervised` rows in `dxrows`) through the
    /// final norm, every layer in reverse and the context projection, into the gradient;
    /// `bucket` is called where each of [`bucket_plan`]'s buckets is final.
    pub(super) fn backward(
        &mut self,
        d: &Drafter,
        saved: &[Saved],
        supervised: usize,
        bucket: &mut dyn FnMut(&mut Ops) -> Result<()>,
    ) -> Result<()> {
        let n = supervised;
        let Locals {
            h,
            slen,
            m,
            n_taps,
            fc,
            hnorm,
            fnorm,
            gw,
            mx,
            taps,
            ctx_pre,
            ctx_rstd,
            hcur,
            rstd_f,
            ..
        } = self.lc;
        let g = |name: &str| gw.f32s(d.layout.range(name));
        let w = self.w;
        let dhn = w.o.f32s(0..m * h);
        self.ops.dev.memset_zero(Stream::Compute, dhn)?;
        if n > 0 {
            let (dx, rows) = (w.dxrows.f32s(0..n * h), w.rows.f32s(0..n));
            self.ops.scatter_add_rows(dhn, dx, rows, n, h)?;
        }
        let dh = w.dh.f32s(0..m * h);
        self.ops.dev.memset_zero(Stream::Compute, dh)?;
        let dnorm = Some(g("norm.weight"));
        let (dhn, hc, dh) = (
            Mat::f32(dhn, m, h),
            Mat::f32(hcur, m, h),
            Mat::f32(dh, m, h),
        );
        self.ops
            .rmsnorm_backward(dhn, hc, fnorm, rstd_f, dh, dnorm)?;
        bucket(self.ops)?;
        let dctx = w.dctx.f32s(0..slen * h);
        self.ops.dev.memset_zero(Stream::Compute, dctx)?;
        for (li, sv) in d.layers.iter().zip(saved).rev() {
            self.mlp_backward(li, sv)?;
            self.attend_backward(li, sv)?;
            self.qk_norm_rope_backward(li, sv)?;
            self.projections_backward(li, sv)?;
            bucket(self.ops)?;
        }
        // The block embeddings are frozen: dh stops here. The context goes back to fc.
        let dctx_pre = w.dctx_pre.f32s(0..slen * h);
        self.ops.dev.memset_zero(Stream::Compute, dctx_pre)?;
        let dhnorm = Some(g("hidden_norm.weight"));
        let ctx = |b: DSlice| Mat::f32(b, slen, h);
        let (dctx, ctx_pre, dctx_pre) = (ctx(dctx), ctx(ctx_pre), ctx(dctx_pre));
        self.ops
            .rmsnorm_backward(dctx, ctx_pre, hnorm, ctx_rstd, dctx_pre, dhnorm)?;
        let dfc = Some(Mat::f32(g("fc.weight"), h, n_taps * h));
        let taps = Mat::f32(taps, slen, n_taps * h);
        mx.mm_back(self.ops, (dctx_pre, taps), fc, Dx::Skip, dfc)?;
        bucket(self.ops)
    }
}

/// The gradient's buckets in the order the backward finishes them: the final norm, each
/// layer from the last, then the context projection (fc and hidden_norm). Together they
/// cover every parameter once; every rank has the same.
pub(super) fn bucket_plan(d: &Drafter) -> Vec<Range<usize>> {
    let lay = &d.layout;
    let span = |ranges: &[Range<usize>]| {
        ranges.iter().map(|r| r.start).min().unwrap_or(0)
            ..ranges.iter().map(|r| r.end).max().unwrap_or(0)
    };
    let mut plan = vec![lay.range("norm.weight")];
    for li in d.layers.iter().rev() {
        plan.push(span(&[
            li.ln1.clone(),
            li.wq.clone(),
            li.wk.clone(),
            li.wv.clone(),
            li.wo.clone(),
            li.qn.clone(),
            li.kn.clone(),
            li.ln2.clone(),
            li.gate.clone(),
            li.up.clone(),
            li.down.clone(),
        ]));
    }
    plan.push(span(&[
        lay.range("fc.weight"),
        lay.range("hidden_norm.weight"),
    ]));
    plan
}
