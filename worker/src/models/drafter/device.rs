//! The DFlash drafter's forward and backward on a [`Device`]: the one definition of the
//! drafter's math the workers run, on a GPU or on the CPU device (the parity tests check
//! it against the reference drafter, `crate::reference::drafter`), with the
//! frozen embedding and lm_head, the parameters, their gradient and every activation the
//! backward needs allocated once from the arena for the largest sample (`max_len` context
//! positions, `max_anchors` blocks). Per sample: the forward keeps each layer's
//! activations, the loss visits the vocabulary in chunks (logits one GEMM per chunk, the
//! softmax statistics folded on the device), and the backward runs the layers in reverse.
//! The attention is the fused span kernel, which recomputes the probabilities from the
//! saved log-sum-exp instead of storing them.

use dflash_shared::drafter::{DrafterConfig, StepStats};

use crate::device::ops::{Act, CeState, Ops};
use crate::device::{
    f32_bytes, f32_bytes_mut, i32_bytes, i32_bytes_mut, u32_bytes, Arena, DSlice, Device, GpuError,
    Result, Stream,
};
use crate::models::drafter::{Drafter, Frozen, LayerIdx, Sample};

/// Vocabulary columns per cross-entropy chunk.
const CHUNK: usize = 4096;

/// Samples' worth of rows (each up to `max_anchors × block_size`) whose losses and
/// `argmax == label` flags the device holds until they are read, once per step unless a
/// step has more.
const CE_SAMPLES: usize = 16;

const NONE: DSlice = DSlice { ptr: 0, bytes: 0 };

/// A weight for a GEMM: its f32 master copy and its bf16 copy (whichever the device uses;
/// the other may be [`NONE`]).
#[derive(Clone, Copy)]
struct W {
    f: DSlice,
    b: DSlice,
}

/// Mixed precision: on a GPU every GEMM takes bf16 inputs (the weights' bf16 copies, the
/// activation or incoming gradient cast just before into the scratch buffers) and
/// accumulates in f32, on tensor cores; the CPU device keeps f32 throughout.
#[derive(Clone, Copy)]
struct Mixed {
    bf16: bool,
    xb: DSlice,
    yb: DSlice,
}

impl Mixed {
    /// `n` elements of a GEMM-input activation buffer (`x`, `x2`, `act`, `ctx`): bf16 on
    /// a GPU, where its producer writes it rounded (the GEMMs' input, and the only copy the
    /// backward needs), else f32.
    fn gemm_act(&self, buf: DSlice, n: usize) -> DSlice {
        if self.bf16 {
            buf.sub(2, 0..n)
        } else {
            buf.f32s(0..n)
        }
    }

    /// Floats to allocate for a [`gemm_act`](Self::gemm_act) buffer of `n` elements.
    fn gemm_act_floats(bf16: bool, n: usize) -> usize {
        if bf16 {
            n.div_ceil(2)
        } else {
            n
        }
    }

    /// RMSNorm of f32 rows into a GEMM-input buffer ([`gemm_act`](Self::gemm_act)).
    #[allow(clippy::too_many_arguments)]
    fn norm(
        &self,
        ops: &mut Ops,
        x: DSlice,
        w: DSlice,
        y: DSlice,
        rstd: DSlice,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<()> {
        if self.bf16 {
            ops.rmsnorm_to_bf16(x, w, y, rstd, rows, d, eps)
        } else {
            ops.rmsnorm(x, w, y, rstd, rows, d, eps)
        }
    }

    /// SwiGLU of the fused f32 gate/up rows into a GEMM-input buffer.
    fn swiglu(&self, ops: &mut Ops, gu: DSlice, out: DSlice, width: usize) -> Result<()> {
        if self.bf16 {
            ops.swiglu_gu_to_bf16(gu, out, width)
        } else {
            ops.swiglu_gu(gu, out, width)
        }
    }

    /// `x` (`len` f32) as the GEMMs take it: on a GPU cast to bf16 into the input scratch
    /// (once for every GEMM that reads it, until the next `input`), else `x` itself.
    fn input(&self, ops: &mut Ops, x: DSlice, len: usize) -> Result<DSlice> {
        if !self.bf16 {
            return Ok(x);
        }
        let xb = self.xb.sub(2, 0..len);
        ops.f32_to_bf16(xb, x.f32s(0..len))?;
        Ok(xb)
    }

    /// `y = x · wᵀ` (`x` m×k, `w` n×k).
    #[allow(clippy::too_many_arguments)]
    fn mm(
        &self,
        ops: &mut Ops,
        x: DSlice,
        w: W,
        y: DSlice,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        let xin = self.input(ops, x, m * k)?;
        self.mm_in(ops, xin, w, y, m, k, n)
    }

    /// [`mm`](Self::mm) of an [`input`](Self::input).
    #[allow(clippy::too_many_arguments)]
    fn mm_in(
        &self,
        ops: &mut Ops,
        xin: DSlice,
        w: W,
        y: DSlice,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        if self.bf16 {
            ops.matmul_bf16(xin, w.b, y, m, k, n)
        } else {
            ops.matmul(xin, w.f, y, m, k, n)
        }
    }

    /// Backward of [`mm`](Self::mm): `dx += dy · w`, `dw += dyᵀ · x`.
    #[allow(clippy::too_many_arguments)]
    fn mm_back(
        &self,
        ops: &mut Ops,
        dy: DSlice,
        x: DSlice,
        w: W,
        dx: Option<DSlice>,
        dw: Option<DSlice>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        let xin = if dw.is_some() {
            self.input(ops, x, m * k)?
        } else {
            x
        };
        self.back_in(ops, dy, xin, w, dx.map(|d| (d, false)), dw, m, k, n)
    }

    /// [`mm_back`](Self::mm_back) with `dx` written, not added into: `dx = dy · w`.
    #[allow(clippy::too_many_arguments)]
    fn mm_back_over(
        &self,
        ops: &mut Ops,
        dy: DSlice,
        x: DSlice,
        w: W,
        dx: DSlice,
        dw: Option<DSlice>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        let xin = if dw.is_some() {
            self.input(ops, x, m * k)?
        } else {
            x
        };
        self.back_in(ops, dy, xin, w, Some((dx, true)), dw, m, k, n)
    }

    /// [`mm_back`](Self::mm_back) of an [`input`](Self::input) `xin` (read only for `dw`),
    /// `dx` added into (`false`) or written (`true`).
    #[allow(clippy::too_many_arguments)]
    fn back_in(
        &self,
        ops: &mut Ops,
        dy: DSlice,
        xin: DSlice,
        w: W,
        dx: Option<(DSlice, bool)>,
        dw: Option<DSlice>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        let (dy, w) = if self.bf16 {
            let yb = self.yb.sub(2, 0..m * n);
            ops.f32_to_bf16(yb, dy)?;
            (yb, w.b)
        } else {
            (dy, w.f)
        };
        match dx {
            Some((dx, true)) => ops.matmul_backward_over(dy, xin, w, dx, dw, m, k, n, self.bf16),
            dx if self.bf16 => ops.matmul_backward_bf16(dy, xin, w, dx.map(|d| d.0), dw, m, k, n),
            dx => ops.matmul_backward(dy, xin, w, dx.map(|d| d.0), dw, m, k, n),
        }
    }
}

/// What every part of a sample's step reads: the drafter's sizes, the sample's, the
/// parameters as GEMM weights and the work buffers' slices for this sample.
#[derive(Clone, Copy)]
struct Locals {
    h: usize,
    hd: usize,
    bs: usize,
    inter: usize,
    qd: usize,
    kd: usize,
    qh: usize,
    kvh: usize,
    eps: f32,
    n_taps: usize,
    vocab: usize,
    slen: usize,
    nb: usize,
    m: usize,
    tk: usize,
    fc: W,
    hnorm: DSlice,
    fnorm: DSlice,
    /// Parameters and gradients (f32), and the bf16 copy of the parameters.
    pw: DSlice,
    gw: DSlice,
    p16: DSlice,
    mx: Mixed,
    lm32: DSlice,
    lm16: DSlice,
    taps: DSlice,
    ctx_pre: DSlice,
    ctx: DSlice,
    ctx_rstd: DSlice,
    hcur: DSlice,
    o: DSlice,
    spans_d: DSlice,
    hn: DSlice,
    rstd_f: DSlice,
    /// The block rows' positions and every key's (the context's, then the block rows'),
    /// and the rotary frequencies and scale.
    block_pos: DSlice,
    key_pos: DSlice,
    inv_freq: DSlice,
    rope_scale: f32,
}

impl Locals {
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
    fn lmw(&self, start: usize, cw: usize) -> W {
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
/// buffers. A layer's forward and backward, and the loss's chunks, are its methods.
struct Pass<'a> {
    ops: &'a mut Ops,
    lc: Locals,
    w: &'a Work,
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
            tk,
            pw,
            mx,
            ctx,
            hcur,
            ..
        } = lc;
        let ops = &mut *self.ops;
        let p = |r: &std::ops::Range<usize>| pw.f32s(r.clone());
        let (h_in, xin, q_pre) = (
            sv.h_in.f32s(0..m * h),
            mx.gemm_act(sv.x, m * h),
            sv.q_pre.f32s(0..m * qd),
        );
        let (k_pre, v) = (sv.k_pre.f32s(0..tk * kd), sv.v.f32s(0..tk * kd));
        ops.copy_cols(h_in, hcur, m, h, h, 0, h, 0)?;
        // x and the context are written as the GEMMs read them (bf16 on a GPU).
        mx.norm(ops, hcur, p(&li.ln1), xin, sv.rstd1.f32s(0..m), m, h, eps)?;
        let (k_ctx, v_ctx) = (k_pre.f32s(0..slen * kd), v.f32s(0..slen * kd));
        mx.mm_in(ops, ctx, lc.pp(&li.wk), k_ctx, slen, h, kd)?;
        mx.mm_in(ops, ctx, lc.pp(&li.wv), v_ctx, slen, h, kd)?;
        let (k_blk, v_blk) = (k_pre.f32s(slen * kd..tk * kd), v.f32s(slen * kd..tk * kd));
        mx.mm_in(ops, xin, lc.pp(&li.wq), q_pre, m, h, qd)?;
        mx.mm_in(ops, xin, lc.pp(&li.wk), k_blk, m, h, kd)?;
        mx.mm_in(ops, xin, lc.pp(&li.wv), v_blk, m, h, kd)
    }

    /// q and k RMS-normed per head, then rotated (q at the block positions, k at the key
    /// positions).
    fn qk_norm_rope(&mut self, li: &LayerIdx, sv: &Saved) -> Result<()> {
        let Locals {
            hd,
            qd,
            kd,
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
        let p = |r: &std::ops::Range<usize>| pw.f32s(r.clone());
        let (q, k) = (sv.q.f32s(0..m * qd), sv.k.f32s(0..tk * kd));
        ops.rmsnorm(
            sv.q_pre.f32s(0..m * qd),
            p(&li.qn),
            q,
            sv.q_rstd.f32s(0..m * qh),
            m * qh,
            hd,
            eps,
        )?;
        ops.rmsnorm(
            sv.k_pre.f32s(0..tk * kd),
            p(&li.kn),
            k,
            sv.k_rstd.f32s(0..tk * kvh),
            tk * kvh,
            hd,
            eps,
        )?;
        ops.rope(q, block_pos, inv_freq, m, qh, hd, rope_scale, false)?;
        ops.rope(k, key_pos, inv_freq, tk, kvh, hd, rope_scale, false)
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
        ops.attention(
            sv.q.f32s(0..m * qd),
            sv.k.f32s(0..tk * kd),
            sv.v.f32s(0..tk * kd),
            att,
            sv.lse.f32s(0..m * qh),
            spans_d,
            m,
            qh,
            kvh,
            hd,
        )?;
        mx.mm(ops, att, lc.pp(&li.wo), o, m, qd, h)?;
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
        let p = |r: &std::ops::Range<usize>| pw.f32s(r.clone());
        let h_mid = sv.h_mid.f32s(0..m * h);
        ops.copy_cols(h_mid, hcur, m, h, h, 0, h, 0)?;
        // x2 and the SwiGLU's output are written as the GEMMs read them (bf16 on a GPU).
        let x2 = mx.gemm_act(sv.x2, m * h);
        mx.norm(ops, hcur, p(&li.ln2), x2, sv.rstd2.f32s(0..m), m, h, eps)?;
        let (gu, act) = (sv.gu.f32s(0..2 * m * inter), mx.gemm_act(sv.act, m * inter));
        mx.mm_in(ops, x2, lc.pp(&li.gate_up()), gu, m, h, 2 * inter)?;
        mx.swiglu(ops, gu, act, inter)?;
        mx.mm_in(ops, act, lc.pp(&li.down), o, m, inter, h)?;
        ops.add(hcur, o)
    }

    /// The supervised rows on the device (their indices, labels and loss scales), and
    /// their final hidden states gathered into `xrows`.
    fn ce_rows(&mut self, rows: &[(usize, u32, f64)], denominator: f64) -> Result<()> {
        let Locals { h, m, hn, .. } = self.lc;
        let (w, ops) = (self.w, &mut *self.ops);
        let n = rows.len();
        let idx: Vec<u32> = rows.iter().map(|r| r.0 as u32).collect();
        let labels: Vec<i32> = rows.iter().map(|r| r.1 as i32).collect();
        let scale: Vec<f32> = rows.iter().map(|r| (r.2 / denominator) as f32).collect();
        ops.dev.upload(Stream::Compute, w.rows, u32_bytes(&idx))?;
        ops.dev
            .upload(Stream::Compute, w.labels, i32_bytes(&labels))?;
        ops.dev
            .upload(Stream::Compute, w.scale, f32_bytes(&scale))?;
        ops.embed(w.xrows.f32s(0..n * h), hn, w.rows.f32s(0..n), n, h, m)
    }

    /// The cross-entropy of the `n` supervised rows in one pass over the vocabulary, a
    /// chunk at a time: the logits GEMM (bf16 out on a GPU), their fold into the rows'
    /// online softmax (they become `exp(l − max)`), and the GEMM adding those times the
    /// chunk's lm_head rows into `acc`; then `dxrows` = dCE/dx and each row's loss and
    /// `argmax == label` (`ce_loss`, `ce_correct`, from `at` on: they stay on the device
    /// until the step's are read together). The rows are cast to bf16 once. Without
    /// `grad` (held-out evaluation) the second GEMM is skipped: one GEMM per chunk, and
    /// `dxrows` is not the gradient.
    fn ce(&mut self, n: usize, at: usize, grad: bool) -> Result<()> {
        let lc = self.lc;
        let Locals { h, vocab, mx, .. } = lc;
        let (w, ops) = (self.w, &mut *self.ops);
        let xr = w.xrows.f32s(0..n * h);
        let labels = w.labels.f32s(0..n);
        let (act, x, lm) = if mx.bf16 {
            let xb = mx.xb.sub(2, 0..n * h);
            ops.f32_to_bf16(xb, xr)?;
            (Act::Bf16, xb, lc.lm16.sub(2, 0..vocab * h))
        } else {
            (Act::F32, xr, lc.lm32.f32s(0..vocab * h))
        };
        let st = w.ce_state(n, h);
        let neg_inf = vec![f32::NEG_INFINITY; n];
        ops.dev
            .upload(Stream::Compute, st.run_max, f32_bytes(&neg_inf))?;
        for b in [st.run_sum, st.best_i, st.label_logit, st.acc] {
            ops.dev.memset_zero(Stream::Compute, b)?;
        }
        for start in (0..vocab).step_by(CHUNK) {
            let cw = CHUNK.min(vocab - start);
            let wc = lc.lmw(start, cw);
            if mx.bf16 {
                let l = w.logits.sub(2, 0..n * cw);
                ops.matmul_bf16_out(x, wc.b, l, n, h, cw)?;
                ops.ce_fold(act, st, l, labels, n, cw, start, h)?;
                if grad {
                    ops.matmul_backward_bf16(l, x, wc.b, Some(st.acc), None, n, h, cw)?;
                }
            } else {
                let l = w.logits.f32s(0..n * cw);
                ops.matmul(x, wc.f, l, n, h, cw)?;
                ops.ce_fold(act, st, l, labels, n, cw, start, h)?;
                if grad {
                    ops.matmul_backward(l, x, wc.f, Some(st.acc), None, n, h, cw)?;
                }
            }
        }
        let out = (
            w.dxrows.f32s(0..n * h),
            w.ce_loss.f32s(at..at + n),
            w.ce_correct.f32s(at..at + n),
        );
        let scale = w.scale.f32s(0..n);
        ops.ce_finish(act, st, out, labels, scale, lm, n, h, vocab)
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
        let p = |r: &std::ops::Range<usize>| pw.f32s(r.clone());
        let gr = |r: &std::ops::Range<usize>| gw.f32s(r.clone());
        let dh = w.dh.f32s(0..m * h);
        let (x2, h_mid) = (mx.gemm_act(sv.x2, m * h), sv.h_mid.f32s(0..m * h));
        let (gu, act) = (sv.gu.f32s(0..2 * m * inter), mx.gemm_act(sv.act, m * inter));
        let (dact, dgu) = (w.dact.f32s(0..m * inter), w.dgu.f32s(0..2 * m * inter));
        // Each buffer's writer writes it (no zeroing): dact and dx2 by their GEMM, dgu by
        // the SwiGLU backward.
        let dx2 = w.dx2.f32s(0..m * h);
        mx.back_in(
            ops,
            dh,
            act,
            lc.pp(&li.down),
            Some((dact, true)),
            Some(gr(&li.down)),
            m,
            inter,
            h,
        )?;
        ops.swiglu_gu_backward(dact, gu, dgu, inter)?;
        let gate_up = li.gate_up();
        mx.back_in(
            ops,
            dgu,
            x2,
            lc.pp(&gate_up),
            Some((dx2, true)),
            Some(gr(&gate_up)),
            m,
            h,
            2 * inter,
        )?;
        ops.rmsnorm_backward(
            dx2,
            h_mid,
            p(&li.ln2),
            sv.rstd2.f32s(0..m),
            dh,
            Some(gr(&li.ln2)),
            m,
            h,
        )
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
        let gr = |r: &std::ops::Range<usize>| gw.f32s(r.clone());
        let dh = w.dh.f32s(0..m * h);
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
        mx.mm_back_over(
            ops,
            dh,
            att,
            lc.pp(&li.wo),
            datt,
            Some(gr(&li.wo)),
            m,
            qd,
            h,
        )?;
        ops.attention_backward(
            datt,
            att,
            sv.lse.f32s(0..m * qh),
            w.delta,
            q,
            k,
            v,
            spans_d,
            dq,
            dk,
            dv,
            m,
            qh,
            kvh,
            hd,
        )
    }

    /// Backward of [`qk_norm_rope`](Self::qk_norm_rope): `dq` and `dk` rotated back, then
    /// through the per-head norms into `dq_pre` and `dk_pre`.
    fn qk_norm_rope_backward(&mut self, li: &LayerIdx, sv: &Saved) -> Result<()> {
        let Locals {
            hd,
            qd,
            kd,
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
        let p = |r: &std::ops::Range<usize>| pw.f32s(r.clone());
        let gr = |r: &std::ops::Range<usize>| gw.f32s(r.clone());
        let (dq, dk) = (w.dq.f32s(0..m * qd), w.dk.f32s(0..tk * kd));
        ops.rope(dq, block_pos, inv_freq, m, qh, hd, rope_scale, true)?;
        ops.rope(dk, key_pos, inv_freq, tk, kvh, hd, rope_scale, true)?;
        ops.rmsnorm_backward(
            dq,
            sv.q_pre.f32s(0..m * qd),
            p(&li.qn),
            sv.q_rstd.f32s(0..m * qh),
            w.dq_pre.f32s(0..m * qd),
            Some(gr(&li.qn)),
            m * qh,
            hd,
        )?;
        ops.rmsnorm_backward(
            dk,
            sv.k_pre.f32s(0..tk * kd),
            p(&li.kn),
            sv.k_rstd.f32s(0..tk * kvh),
            w.dk_pre.f32s(0..tk * kd),
            Some(gr(&li.kn)),
            tk * kvh,
            hd,
        )
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
        let p = |r: &std::ops::Range<usize>| pw.f32s(r.clone());
        let gr = |r: &std::ops::Range<usize>| gw.f32s(r.clone());
        let (xin, h_in) = (mx.gemm_act(sv.x, m * h), sv.h_in.f32s(0..m * h));
        let (dh, dx, dctx) = (
            w.dh.f32s(0..m * h),
            w.dx.f32s(0..m * h),
            w.dctx.f32s(0..slen * h),
        );
        let (dq_pre, dk_pre, dv) = (
            w.dq_pre.f32s(0..m * qd),
            w.dk_pre.f32s(0..tk * kd),
            w.dv.f32s(0..tk * kd),
        );
        // The saved inputs as the GEMMs read them: the block rows (dx's first writer is
        // q's, no zeroing; k and v add into it), then the context.
        let (wq, wk, wv) = (lc.pp(&li.wq), lc.pp(&li.wk), lc.pp(&li.wv));
        let (dk_blk, dv_blk) = (dk_pre.f32s(slen * kd..tk * kd), dv.f32s(slen * kd..tk * kd));
        let block = [
            (dq_pre, wq, &li.wq, qd, true),
            (dk_blk, wk, &li.wk, kd, false),
            (dv_blk, wv, &li.wv, kd, false),
        ];
        for (dy, wt, g, n, first) in block {
            mx.back_in(ops, dy, xin, wt, Some((dx, first)), Some(gr(g)), m, h, n)?;
        }
        let (dk_ctx, dv_ctx) = (dk_pre.f32s(0..slen * kd), dv.f32s(0..slen * kd));
        for (dy, wt, g) in [(dk_ctx, wk, &li.wk), (dv_ctx, wv, &li.wv)] {
            mx.back_in(
                ops,
                dy,
                ctx,
                wt,
                Some((dctx, false)),
                Some(gr(g)),
                slen,
                h,
                kd,
            )?;
        }
        ops.rmsnorm_backward(
            dx,
            h_in,
            p(&li.ln1),
            sv.rstd1.f32s(0..m),
            dh,
            Some(gr(&li.ln1)),
            m,
            h,
        )
    }
}

/// One sample's sizes: context positions, blocks, block rows, and keys (context + rows).
#[derive(Debug, Clone, Copy)]
struct Dims {
    slen: usize,
    nb: usize,
    m: usize,
    tk: usize,
}

struct Saved {
    h_in: DSlice,
    x: DSlice,
    rstd1: DSlice,
    q_pre: DSlice,
    q_rstd: DSlice,
    k_pre: DSlice,
    k_rstd: DSlice,
    q: DSlice,
    k: DSlice,
    v: DSlice,
    att: DSlice,
    lse: DSlice,
    h_mid: DSlice,
    x2: DSlice,
    rstd2: DSlice,
    /// The fused gate/up projection: rows `[gate | up]`.
    gu: DSlice,
    act: DSlice,
}

impl Saved {
    /// Layer `l`'s activations for `m` block rows and `tk` keys (`f` allocates `n` floats
    /// by name).
    fn alloc(
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

struct Work {
    taps: DSlice,
    /// The taps as they arrive from the hidden-state slot (bf16), cast on the device.
    /// Two staging buffers for bf16 taps: the next sample's are copied in (copy stream)
    /// while the current one computes.
    taps16: [DSlice; 2],
    ctx_pre: DSlice,
    ctx: DSlice,
    ctx_rstd: DSlice,
    block_ids: DSlice,
    block_pos: DSlice,
    key_pos: DSlice,
    spans: DSlice,
    hcur: DSlice,
    hn: DSlice,
    rstd_f: DSlice,
    o: DSlice,
    // Cross-entropy.
    rows: DSlice,
    labels: DSlice,
    scale: DSlice,
    xrows: DSlice,
    dxrows: DSlice,
    /// A chunk's logits (f32 on the CPU device, bf16 on a GPU).
    logits: DSlice,
    ce_max: DSlice,
    ce_sum: DSlice,
    ce_argmax: DSlice,
    ce_label: DSlice,
    ce_acc: DSlice,
    ce_loss: DSlice,
    ce_correct: DSlice,
    // Backward.
    dh: DSlice,
    dx: DSlice,
    dx2: DSlice,
    dact: DSlice,
    /// The gradient of the fused gate/up projection: rows `[dgate | dup]`.
    dgu: DSlice,
    datt: DSlice,
    dq: DSlice,
    dk: DSlice,
    dv: DSlice,
    dq_pre: DSlice,
    dk_pre: DSlice,
    /// The attention backward's scratch (Ops::attention_backward_scratch).
    delta: DSlice,
    dctx: DSlice,
    dctx_pre: DSlice,
}

impl Work {
    /// The cross-entropy's state for `n` rows of width `h`.
    fn ce_state(&self, n: usize, h: usize) -> CeState {
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
    fn alloc(
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

/// The optimizer on the device: fp32 master weights (`DeviceDrafter::params`) with their Adam
/// moments, the averaged gradient of the step being applied, and the step's norm, skip
/// flag, Adam step count and the weights' checksum.
struct Opt {
    m: DSlice,
    v: DSlice,
    gsum: DSlice,
    /// The group's unnormalised gradient sum as a device collective leaves it (NCCL
    /// all-reduces `grads` into it), and a 1.0 for the GEMM that scales it into `gsum`.
    gred: DSlice,
    one: DSlice,
    /// Σg² (one f64), and each block's share of it.
    acc: DSlice,
    partials: DSlice,
    /// Set when the gradient is not finite (one i32).
    flag: DSlice,
    /// Adam's step count (one i32).
    t: DSlice,
    /// [`crate::device::ops::params_hash`] of the weights (one u64).
    hash: DSlice,
}

/// What the device said about an applied step, read a step later.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    pub step: u64,
    /// The gradient was not finite: weights and moments were left as they were.
    pub skipped: bool,
    /// The averaged gradient's norm before clipping (NaN when skipped).
    pub grad_norm: f64,
}

/// Pinned host memory that the device's step results are copied into, behind events, so
/// the host never waits for the GPU to drain: the first page holds the step's flag and
/// norm (the optimizer's outcome), the rest the cross-entropy rows' losses and hits
/// (`DeviceDrafter::start_ce_read`).
struct Readback {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

const PAGE: usize = 4096;

impl Readback {
    /// One page for the optimizer's outcome and room for `ce_rows` losses and hits.
    fn new(ce_rows: usize) -> Readback {
        let bytes = (PAGE + ce_rows * 8).next_multiple_of(PAGE);
        let layout = std::alloc::Layout::from_size_align(bytes, PAGE).expect("whole pages");
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Readback { ptr, layout }
    }

    fn bytes(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for Readback {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; the device that registered it was
        // dropped first (it is declared before us in DeviceDrafter) and unregistered it.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

// SAFETY: the page is only touched through &mut DeviceDrafter.
unsafe impl Send for Readback {}

pub struct DeviceDrafter {
    d: Drafter,
    // Declared before `readback`: the device unregisters the page before it is freed.
    ops: Ops,
    readback: Readback,
    /// The step whose outcome is on its way into `readback`, and the event behind it.
    pending: Option<(u64, crate::device::Event)>,
    /// The weights' checksum, queued behind every change of the weights (a step, a load)
    /// and on its way into `readback` behind this event; then the value read.
    hash_pending: Option<crate::device::Event>,
    hash_known: Option<u64>,
    _arena: Arena,
    embed: DSlice,
    /// The frozen lm_head: f32 on the CPU device, bf16 (`lm16`) on a GPU.
    lm_head: DSlice,
    lm16: DSlice,
    params: DSlice,
    /// The weights' bf16 copy for the GEMMs (a GPU), refreshed after every update.
    params16: DSlice,
    grads: DSlice,
    inv_freq: DSlice,
    opt: Opt,
    saved: Vec<Saved>,
    w: Work,
    mixed: Mixed,
    max_len: usize,
    max_rows: usize,
    /// The samples whose losses wait on the device (in `Work::ce_loss`, `ce_correct`),
    /// the rows they fill, and what the ones read so far added to the step's statistics.
    ce_pending: Vec<PendingCe>,
    ce_used: usize,
    ce_read: StepStats,
    /// The pending rows' losses and hits on their way into `readback` (rows, and the
    /// event behind the copies).
    ce_inflight: Option<(usize, crate::device::Event)>,
    /// The last batch's gradient buckets, in the order backward finished them: each
    /// parameter range and an event on the compute stream behind its last write (recorded
    /// during the last sample's backward, so a collective can reduce a bucket while the
    /// rest of the backward runs).
    buckets: Vec<(std::ops::Range<usize>, crate::device::Event)>,
}

/// A sample's supervised rows (block row, loss weight), whose losses and flags are on
/// the device from `offset` on, and its number of blocks.
struct PendingCe {
    offset: usize,
    rows: Vec<(usize, f64)>,
    nb: usize,
}

/// Where a sample's taps come from.
enum Taps {
    /// The sample's own f32 taps, uploaded on the compute stream.
    F32,
    /// Staging buffer b, filled by the copy stream behind the event.
    Staged(usize, crate::device::Event),
}

/// What [`DeviceDrafter::place`] lays out.
struct Placed {
    embed: DSlice,
    lm_head: DSlice,
    lm16: DSlice,
    params: DSlice,
    params16: DSlice,
    grads: DSlice,
    inv_freq: DSlice,
    opt: Opt,
    saved: Vec<Saved>,
    w: Work,
    mixed: Mixed,
    rms_partials: DSlice,
}

impl DeviceDrafter {
    /// Room for samples of up to `max_len` positions with up to the drafter's
    /// `max_anchors` blocks.
    pub fn new(
        mut dev: Box<dyn Device>,
        d: &Drafter,
        frozen: &Frozen,
        max_len: usize,
    ) -> Result<DeviceDrafter> {
        let (s, m) = (
            max_len.max(1),
            (d.cfg.max_anchors * d.cfg.block_size).max(1),
        );
        let what = format!(
            "the drafter (rows of up to {s} tokens, {} blocks)",
            d.cfg.max_anchors
        );
        let bf16 = !dev.is_cpu();
        let mut dry = Arena::dry();
        Self::place(dev.as_mut(), &mut dry, d, frozen, s, m, bf16)?;
        let mut arena = Arena::for_model(dev.as_mut(), dry.mark(), &what)?;
        let pl = Self::place(dev.as_mut(), &mut arena, d, frozen, s, m, bf16)?;
        let rms_partials = pl.rms_partials;
        let readback = Readback::new(m * CE_SAMPLES);
        // SAFETY: the pages live as long as the device (see the field order).
        unsafe { dev.register_host(readback.ptr, readback.bytes())? };
        dev.upload(Stream::Compute, pl.opt.one, f32_bytes(&[1.0]))?;
        let mut g = DeviceDrafter {
            d: Drafter::new(d.cfg.clone()),
            ops: Ops::new(dev),
            readback,
            pending: None,
            hash_pending: None,
            hash_known: None,
            _arena: arena,
            embed: pl.embed,
            lm_head: pl.lm_head,
            lm16: pl.lm16,
            params: pl.params,
            params16: pl.params16,
            grads: pl.grads,
            inv_freq: pl.inv_freq,
            opt: pl.opt,
            saved: pl.saved,
            w: pl.w,
            mixed: pl.mixed,
            max_len: s,
            max_rows: m,
            ce_pending: Vec::new(),
            ce_used: 0,
            ce_read: StepStats::default(),
            ce_inflight: None,
            buckets: Vec::new(),
        };
        // Each bucket of the gradient (and of the reduce buffer) is its own region to the
        // host device's race detector: a collective reads one while the backward writes
        // the next.
        for (k, r) in g.bucket_plan().into_iter().enumerate() {
            g.ops
                .dev
                .track(g.grads.f32s(r.clone()), &format!("gradients (bucket {k})"));
            g.ops.dev.track(
                g.opt.gred.f32s(r),
                &format!("all-reduced gradients (bucket {k})"),
            );
        }
        // The RMSNorm backward's scratch from the arena, with the rest of the drafter's
        // memory (counted by its preflight), not allocated at the first backward (which
        // would wait for the device inside a step).
        g.ops.use_rmsnorm_partials(rms_partials);
        Ok(g)
    }

    /// Lay out (and, in a real arena, fill) everything for rows of `s` positions and `m`
    /// block rows.
    fn place(
        dv: &mut dyn Device,
        arena: &mut Arena,
        d: &Drafter,
        frozen: &Frozen,
        s: usize,
        m: usize,
        bf16: bool,
    ) -> Result<Placed> {
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
        let opt = Opt {
            m: f(d.layout.total, "adam m")?,
            v: f(d.layout.total, "adam v")?,
            gsum: f(d.layout.total, "averaged gradient")?,
            gred: f(d.layout.total, "all-reduced gradient")?,
            one: f(1, "the constant 1")?,
            acc: f(2, "gradient sumsq")?,
            partials: f(
                2 * crate::device::ops::SUMSQ_BLOCKS,
                "gradient sumsq partials",
            )?,
            flag: f(1, "non-finite flag")?,
            t: f(1, "adam step")?,
            hash: f(2, "weights checksum")?,
        };
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
        Ok(Placed {
            embed,
            lm_head,
            lm16,
            params,
            params16,
            grads,
            inv_freq,
            opt,
            saved,
            w,
            mixed,
            rms_partials,
        })
    }

    pub fn describe(&self) -> String {
        self.ops.dev.describe()
    }

    /// The device's per-kernel seconds since the last call (the CPU device measures them).
    pub fn take_kernel_seconds(&mut self) -> Vec<(String, f64)> {
        self.ops.dev.take_kernel_seconds()
    }

    /// Put the training state on the device: weights, Adam moments and step count. What
    /// was on its way back from the last step is dropped.
    pub fn load(&mut self, params: &[f32], m: &[f32], v: &[f32], adam_step: u64) -> Result<()> {
        self.drain()?;
        let o = &self.opt;
        let dev = &mut self.ops.dev;
        dev.upload(Stream::Compute, self.params, f32_bytes(params))?;
        dev.upload(Stream::Compute, o.m, f32_bytes(m))?;
        dev.upload(Stream::Compute, o.v, f32_bytes(v))?;
        dev.upload(Stream::Compute, o.t, i32_bytes(&[adam_step as i32]))?;
        self.refresh_bf16()?;
        self.queue_hash()?;
        self.ops.dev.sync()
    }

    /// Where in the readback page the weights' checksum lands (after the step's flag and
    /// Σg², before the cross-entropy rows' page).
    const HASH_AT: usize = 16;

    /// Queue the checksum of the weights as they are now, and its copy into the readback
    /// page behind an event: read by [`weights_checksum`](Self::weights_checksum) once the
    /// device has long done it, so that no host wait sits inside a step.
    fn queue_hash(&mut self) -> Result<()> {
        if let Some(e) = self.hash_pending.take() {
            self.ops.dev.release_event(e);
        }
        self.hash_known = None;
        self.ops.dev.memset_zero(Stream::Compute, self.opt.hash)?;
        self.ops.params_hash(self.opt.hash, self.params)?;
        // SAFETY: the page is registered, and nothing reads these bytes before the event.
        unsafe {
            self.ops.dev.download_async(
                Stream::Compute,
                self.opt.hash,
                self.readback.ptr.add(Self::HASH_AT),
            )?;
        }
        self.hash_pending = Some(self.ops.dev.record(Stream::Compute)?);
        Ok(())
    }

    /// The checksum of the weights the last batch was computed with (those after the last
    /// step or load), which ranks compare at every step. It was computed on the device
    /// right after the weights changed; called once the batch's work is queued, the event
    /// behind it is long complete and the host does not wait for the device here.
    pub fn weights_checksum(&mut self) -> Result<u64> {
        if let Some(e) = self.hash_pending.take() {
            self.ops.dev.sync_event(e)?;
            self.ops.dev.release_event(e);
            let at = Self::HASH_AT;
            // SAFETY: inside the registered page; the copy completed (the event above).
            let p = unsafe { self.readback.ptr.add(at) };
            self.ops.dev.host_access(p, 8, false)?;
            let mut b = [0u8; 8];
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(p, b.as_mut_ptr(), 8) };
            self.hash_known = Some(u64::from_le_bytes(b));
        }
        match self.hash_known {
            Some(h) => Ok(h),
            None => self.params_hash(),
        }
    }

    /// The weights' bf16 copy, after they changed (a GPU's GEMMs read it).
    fn refresh_bf16(&mut self) -> Result<()> {
        if self.mixed.bf16 {
            self.ops.f32_to_bf16(self.params16, self.params)?;
        }
        Ok(())
    }

    /// The training state back from the device (weights, moments, Adam step count).
    pub fn fetch(&mut self, params: &mut [f32], m: &mut [f32], v: &mut [f32]) -> Result<u64> {
        let o = &self.opt;
        let dev = &mut self.ops.dev;
        dev.download(Stream::Compute, self.params, f32_bytes_mut(params))?;
        dev.download(Stream::Compute, o.m, f32_bytes_mut(m))?;
        dev.download(Stream::Compute, o.v, f32_bytes_mut(v))?;
        let mut t = [0u8; 4];
        dev.download(Stream::Compute, o.t.sub(1, 0..4), &mut t)?;
        Ok(i32::from_le_bytes(t) as u64)
    }

    /// The weights' checksum ([`crate::device::ops::params_hash`]), computed on the device.
    pub fn params_hash(&mut self) -> Result<u64> {
        self.ops.dev.memset_zero(Stream::Compute, self.opt.hash)?;
        self.ops.params_hash(self.opt.hash, self.params)?;
        let mut h = [0u8; 8];
        self.ops
            .dev
            .download(Stream::Compute, self.opt.hash, &mut h)?;
        Ok(u64::from_le_bytes(h))
    }

    /// Apply step `step` with the averaged gradient `g`: the norm, the clip to `clip`
    /// and AdamW all on the device, and a non-finite gradient leaves everything as it was
    /// (the `adamw` kernel checks the device's flag; the host does not wait for it). The
    /// step's outcome comes back by an asynchronous copy; this returns the previous
    /// step's, which has long arrived.
    pub fn apply(
        &mut self,
        step: u64,
        g: &[f32],
        clip: f32,
        lr: f32,
        hyper: &crate::device::ops::AdamHyper,
    ) -> Result<Option<StepOutcome>> {
        let before = self.drain()?;
        self.ops
            .dev
            .upload(Stream::Compute, self.opt.gsum, f32_bytes(g))?;
        self.optimize(step, clip, lr, hyper)?;
        Ok(before)
    }

    /// [`apply`](Self::apply) for a gradient that a device collective summed into the
    /// reduce buffer ([`Self::reduce_buffers`]): scaled by `1 / weight_sum` on the device
    /// (a GEMM with the constant 1, as [`crate::models::drafter::reduce_slots`] scales the
    /// host sum) and applied, with no host copy of it.
    pub fn apply_reduced(
        &mut self,
        step: u64,
        weight_sum: f64,
        clip: f32,
        lr: f32,
        hyper: &crate::device::ops::AdamHyper,
        after: Option<crate::device::Event>,
    ) -> Result<Option<StepOutcome>> {
        let before = self.drain()?;
        if let Some(e) = after {
            self.ops.dev.wait(Stream::Compute, e)?;
            self.ops.dev.release_event(e);
        }
        let (n, o) = (self.d.layout.total, &self.opt);
        let alpha = if weight_sum > 0.0 {
            (1.0 / weight_sum) as f32
        } else {
            1.0
        };
        let g = crate::device::Gemm {
            transa: false,
            transb: false,
            m: n,
            n: 1,
            k: 1,
            alpha,
            a: o.gred,
            lda: n,
            b: o.one,
            ldb: 1,
            beta: 0.0,
            c: o.gsum,
            ldc: n,
            bf16_inputs: false,
            bf16_output: false,
        };
        self.ops.dev.gemm(Stream::Compute, &g)?;
        self.optimize(step, clip, lr, hyper)?;
        Ok(before)
    }

    /// Pin host memory the batches' rows are read from (the hidden-state pool's mapping),
    /// so that their copies to the device are truly asynchronous.
    ///
    /// # Safety
    /// The range must stay mapped while this drafter lives.
    pub unsafe fn register_host(&mut self, ptr: *mut u8, bytes: usize) -> Result<()> {
        self.ops.dev.register_host(ptr, bytes)
    }

    /// This rank's gradient (the last batch's) and the buffer a device collective sums
    /// the group's into; both hold the drafter's parameter count of f32.
    pub fn reduce_buffers(&self) -> (DSlice, DSlice) {
        (self.grads, self.opt.gred)
    }

    fn release_buckets(&mut self) {
        for (_, e) in self.buckets.drain(..) {
            self.ops.dev.release_event(e);
        }
    }

    /// Reduce the last batch's gradient bucket by bucket on `stream`, each as soon as the
    /// backward has finished it: `reduce(device, bucket of the gradient, the same range of
    /// the reduce buffer)` is queued on `stream` behind the bucket's event, so on a GPU it
    /// runs while the rest of the backward does. Buckets cover every parameter exactly
    /// once, the same on every rank; without the backward's events (a zero gradient, or
    /// no sample) each waits for everything queued so far. Returns an event on `stream` behind the last one:
    /// give it to [`apply_reduced`](Self::apply_reduced).
    pub fn reduce_buckets(
        &mut self,
        stream: Stream,
        mut reduce: impl FnMut(&mut dyn Device, DSlice, DSlice) -> Result<()>,
    ) -> Result<crate::device::Event> {
        let mut buckets = std::mem::take(&mut self.buckets);
        if buckets.is_empty() {
            for r in self.bucket_plan() {
                buckets.push((r, self.ops.dev.record(Stream::Compute)?));
            }
        }
        let (grads, gred) = (self.grads, self.opt.gred);
        let dev = self.ops.dev.as_mut();
        let mut result = Ok(());
        for (r, e) in buckets {
            if result.is_ok() {
                result = dev
                    .wait(stream, e)
                    .and_then(|_| reduce(dev, grads.f32s(r.clone()), gred.f32s(r)));
            }
            dev.release_event(e);
        }
        result?;
        dev.record(stream)
    }

    /// A one-rank group's "all-reduce": its gradient copied into the reduce buffer on the
    /// copy stream, bucket by bucket behind the backward (a GEMM with the constant 1, so
    /// every device has it). Returns the event for [`apply_reduced`](Self::apply_reduced).
    pub fn reduce_alone(&mut self) -> Result<crate::device::Event> {
        let one = self.opt.one;
        self.reduce_buckets(Stream::Copy, |dev, g, r| {
            let n = g.bytes / 4;
            let gemm = crate::device::Gemm {
                transa: false,
                transb: false,
                m: n,
                n: 1,
                k: 1,
                alpha: 1.0,
                a: g,
                lda: n.max(1),
                b: one,
                ldb: 1,
                beta: 0.0,
                c: r,
                ldc: n.max(1),
                bf16_inputs: false,
                bf16_output: false,
            };
            dev.gemm(Stream::Copy, &gemm)
        })
    }

    /// The parameter ranges of the last batch's buckets, in the order backward finished
    /// them (for tests and the benchmark).
    pub fn bucket_ranges(&self) -> Vec<std::ops::Range<usize>> {
        self.buckets.iter().map(|(r, _)| r.clone()).collect()
    }

    /// The device, for a collective that works on its buffers and streams.
    pub fn device(&mut self) -> &mut dyn Device {
        self.ops.dev.as_mut()
    }

    /// This rank's gradient (the last batch's) into `dst` (the parameter count of f32,
    /// little-endian: a shared-memory gradient slot).
    pub fn grads_to_host(&mut self, dst: &mut [u8]) -> Result<()> {
        self.ops.dev.download(Stream::Compute, self.grads, dst)
    }

    /// Norm, clip, the skip of a non-finite gradient and AdamW over `gsum`, and the
    /// asynchronous readback of the outcome.
    fn optimize(
        &mut self,
        step: u64,
        clip: f32,
        lr: f32,
        hyper: &crate::device::ops::AdamHyper,
    ) -> Result<()> {
        let o = &self.opt;
        let (p, gsum, acc, partials, flag, t) =
            (self.params, o.gsum, o.acc, o.partials, o.flag, o.t);
        let (m, v) = (o.m, o.v);
        self.ops.dev.memset_zero(Stream::Compute, flag)?;
        self.ops.sumsq(gsum, partials, acc, flag)?;
        self.ops.adam_count(t, flag)?;
        self.ops
            .adamw(p, m, v, gsum, acc, flag, t, clip, lr, hyper)?;
        self.refresh_bf16()?;
        self.queue_hash()?;
        // SAFETY: the page is registered, and nothing reads it before the event (`drain`).
        unsafe {
            self.ops
                .dev
                .download_async(Stream::Compute, flag.sub(1, 0..4), self.readback.ptr)?;
            self.ops.dev.download_async(
                Stream::Compute,
                acc.sub(1, 0..8),
                self.readback.ptr.add(8),
            )?;
        }
        let e = self.ops.dev.record(Stream::Compute)?;
        self.pending = Some((step, e));
        Ok(())
    }

    /// Wait for the last applied step's outcome (it is usually there already).
    pub fn drain(&mut self) -> Result<Option<StepOutcome>> {
        let Some((step, e)) = self.pending.take() else {
            return Ok(None);
        };
        self.ops.dev.sync_event(e)?;
        self.ops.dev.release_event(e);
        self.ops.dev.host_access(self.readback.ptr, 16, false)?;
        let mut b = [0u8; 16];
        // SAFETY: the copies into the page completed (the event above).
        unsafe { std::ptr::copy_nonoverlapping(self.readback.ptr, b.as_mut_ptr(), 16) };
        let skipped = i32::from_le_bytes(b[..4].try_into().expect("4 bytes")) != 0;
        let sumsq = f64::from_le_bytes(b[8..].try_into().expect("8 bytes"));
        Ok(Some(StepOutcome {
            step,
            skipped,
            grad_norm: if skipped { f64::NAN } else { sumsq.sqrt() },
        }))
    }

    /// Forward and backward over one batch at the device's weights: writes the gradient
    /// of `Σ w·CE / denominator` into `grads` (overwriting) and returns the batch's
    /// statistics, as `reference::drafter::Drafter::train_batch` does (which adds into its `grads`).
    pub fn train_batch(
        &mut self,
        samples: &[Sample],
        anchors: &[Vec<usize>],
        denominator: f64,
        grads: &mut [f32],
    ) -> Result<StepStats> {
        self.batch(samples, None, anchors, denominator, Some(grads), true)
    }

    /// [`train_batch`](Self::train_batch) with each sample's taps as the bf16 bytes of the
    /// hidden-state slot (`taps16[i]`: `[len, n_taps × hidden]` bf16, little-endian):
    /// copied as they are, half the bytes of f32, and widened on the device, with no
    /// pass over them on the host. The samples' own `taps` are not read.
    pub fn train_batch_bf16(
        &mut self,
        samples: &[Sample],
        taps16: &[&[u8]],
        anchors: &[Vec<usize>],
        denominator: f64,
        grads: &mut [f32],
    ) -> Result<StepStats> {
        if taps16.len() != samples.len() {
            return Err(GpuError::Invalid(format!(
                "{} bf16 tap rows for {} samples",
                taps16.len(),
                samples.len()
            )));
        }
        self.batch(
            samples,
            Some(taps16),
            anchors,
            denominator,
            Some(grads),
            true,
        )
    }

    /// [`train_batch_bf16`](Self::train_batch_bf16) that leaves the gradient on the
    /// device, for a collective to take from there ([`Self::reduce_buffers`],
    /// [`Self::grads_to_host`]).
    pub fn train_batch_bf16_on_device(
        &mut self,
        samples: &[Sample],
        taps16: &[&[u8]],
        anchors: &[Vec<usize>],
        denominator: f64,
    ) -> Result<StepStats> {
        if taps16.len() != samples.len() {
            return Err(GpuError::Invalid(format!(
                "{} bf16 tap rows for {} samples",
                taps16.len(),
                samples.len()
            )));
        }
        self.batch(samples, Some(taps16), anchors, denominator, None, true)
    }

    /// [`train_batch`](Self::train_batch) that leaves the gradient on the device.
    pub fn train_batch_on_device(
        &mut self,
        samples: &[Sample],
        anchors: &[Vec<usize>],
        denominator: f64,
    ) -> Result<StepStats> {
        self.batch(samples, None, anchors, denominator, None, true)
    }

    /// The forward and loss of [`train_batch_bf16_on_device`](Self::train_batch_bf16_on_device)
    /// alone (held-out evaluation): the same statistics at the device's weights, with no
    /// backward, so the gradient buffer and its buckets (which a collective may be
    /// reducing) are not touched.
    pub fn eval_batch_bf16(
        &mut self,
        samples: &[Sample],
        taps16: &[&[u8]],
        anchors: &[Vec<usize>],
    ) -> Result<StepStats> {
        if taps16.len() != samples.len() {
            return Err(GpuError::Invalid(format!(
                "{} bf16 tap rows for {} samples",
                taps16.len(),
                samples.len()
            )));
        }
        self.batch(samples, Some(taps16), anchors, 1.0, None, false)
    }

    /// The final-normed hidden states `[anchors.len() × block_size, hidden]` of one
    /// sample's blocks at `anchors`, under the loaded weights: the forward of training
    /// alone, from f32 taps (the export's parity probe). Block `n` is
    /// `[s.ids[anchors[n]], MASK, …]` at positions `anchors[n] + k`; it sees the context
    /// strictly before its anchor and itself.
    pub fn final_hidden(&mut self, s: &Sample, anchors: &[usize]) -> Result<Vec<f32>> {
        let c = &self.d.cfg;
        let slen = s.ids.len();
        if s.taps.len() != slen * c.n_taps * c.hidden {
            return Err(GpuError::Invalid(format!(
                "{} tap values for {slen} positions × {} taps × {}",
                s.taps.len(),
                c.n_taps,
                c.hidden
            )));
        }
        if let Some(a) = anchors.iter().find(|&&a| a >= slen) {
            return Err(GpuError::Invalid(format!(
                "anchor {a} is past the {slen} context tokens"
            )));
        }
        let m = anchors.len() * c.block_size;
        if slen > self.max_len || m > self.max_rows {
            return Err(GpuError::Invalid(format!(
                "a sample of {slen} positions and {} blocks; room for {} and {}",
                anchors.len(),
                self.max_len,
                self.max_rows / c.block_size
            )));
        }
        let dims = Dims {
            slen,
            nb: anchors.len(),
            m,
            tk: slen + m,
        };
        let hidden = c.hidden;
        self.inputs(s, Taps::F32, anchors, dims)?;
        self.forward(dims)?;
        let mut out = vec![0f32; m * hidden];
        let hn = self.locals(dims).hn;
        self.ops
            .dev
            .download(Stream::Compute, hn, f32_bytes_mut(&mut out))?;
        Ok(out)
    }

    /// No batch for this step: a zero gradient (a rank that abstains from a step).
    pub fn zero_grads(&mut self) -> Result<()> {
        self.ops.dev.memset_zero(Stream::Compute, self.grads)
    }

    fn batch(
        &mut self,
        samples: &[Sample],
        taps16: Option<&[&[u8]]>,
        anchors: &[Vec<usize>],
        denominator: f64,
        grads: Option<&mut [f32]>,
        backward: bool,
    ) -> Result<StepStats> {
        let d = &self.d;
        let bs = d.cfg.block_size;
        let total_weight = d.total_weight(samples, anchors);
        let mut stats = StepStats {
            slot_correct: vec![0; bs],
            slot_total: vec![0; bs],
            ..Default::default()
        };
        if backward {
            self.release_buckets();
            self.ops.dev.memset_zero(Stream::Compute, self.grads)?;
        }
        if total_weight > 0.0 {
            let order: Vec<usize> = (0..samples.len())
                .filter(|&i| !anchors[i].is_empty())
                .collect();
            self.check_rows(samples, taps16, &order)?;
            // With bf16 rows (from the slot), sample k + 1's taps are copied on the copy
            // stream into the other staging buffer while sample k computes: `loaded[b]`
            // says buffer b holds its sample's taps, `free[b]` that the compute stream has
            // widened them (so it may be overwritten).
            self.ce_pending.clear();
            self.ce_used = 0;
            self.ce_read = StepStats::default();
            if let Some((_, e)) = self.ce_inflight.take() {
                // Left by a batch that failed; its rows are void.
                self.ops.dev.release_event(e);
            }
            let mut loaded: [Option<crate::device::Event>; 2] = [None, None];
            let mut free: [Option<crate::device::Event>; 2] = [None, None];
            let mut run = || -> Result<()> {
                if let (Some(t16), Some(&first)) = (taps16, order.first()) {
                    loaded[0] = Some(self.stage(0, t16[first], None)?);
                }
                for (k, &i) in order.iter().enumerate() {
                    if let (Some(t16), Some(&next)) = (taps16, order.get(k + 1)) {
                        let b = (k + 1) % 2;
                        loaded[b] = Some(self.stage(b, t16[next], free[b].take())?);
                    }
                    let taps = match taps16 {
                        Some(_) => {
                            Taps::Staged(k % 2, loaded[k % 2].take().expect("staged before"))
                        }
                        None => Taps::F32,
                    };
                    let (st, freed) = self.sample(
                        &samples[i],
                        taps,
                        &anchors[i],
                        denominator,
                        Some(&i) == order.last(),
                        backward,
                    )?;
                    free[k % 2] = freed;
                    stats.merge(&st);
                }
                Ok(())
            };
            let r = run();
            for e in loaded.into_iter().chain(free).flatten() {
                self.ops.dev.release_event(e);
            }
            r?;
            stats.merge(&std::mem::take(&mut self.ce_read));
            if taps16.is_some() {
                // The rows belong to the caller (a slot it gives back after this): every copy
                // from them is over before this returns (long since, on a GPU: each was
                // waited for by the compute stream).
                let e = self.ops.dev.record(Stream::Copy)?;
                let r = self.ops.dev.sync_event(e);
                self.ops.dev.release_event(e);
                r?;
            }
        }
        if let Some(grads) = grads {
            self.ops
                .dev
                .download(Stream::Compute, self.grads, f32_bytes_mut(grads))?;
        }
        Ok(stats)
    }

    /// The samples of `order` fit in the room there is, and each one's bf16 taps (if any)
    /// are a row of its length.
    fn check_rows(
        &self,
        samples: &[Sample],
        taps16: Option<&[&[u8]]>,
        order: &[usize],
    ) -> Result<()> {
        if let Some(&i) = order.iter().find(|&&i| samples[i].ids.len() > self.max_len) {
            return Err(GpuError::Invalid(format!(
                "a sample of {} positions; room for {}",
                samples[i].ids.len(),
                self.max_len
            )));
        }
        if let Some(t16) = taps16 {
            let row = self.d.cfg.n_taps * self.d.cfg.hidden * 2;
            if let Some(&i) = order
                .iter()
                .find(|&&i| t16[i].len() != samples[i].ids.len() * row)
            {
                return Err(GpuError::Invalid(format!(
                    "{} bytes of bf16 taps for {} positions × {} taps × {}",
                    t16[i].len(),
                    samples[i].ids.len(),
                    self.d.cfg.n_taps,
                    self.d.cfg.hidden
                )));
            }
        }
        Ok(())
    }

    /// The sizes and slices of a sample of `dims` (see [`Locals`]).
    fn locals(&self, dims: Dims) -> Locals {
        let c = &self.d.cfg;
        let (h, hd) = (c.hidden, c.head_dim);
        let Dims { slen, nb, m, tk } = dims;
        let w = &self.w;
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
            fc: self.pr("fc.weight"),
            hnorm: self.pr("hidden_norm.weight").f,
            fnorm: self.pr("norm.weight").f,
            pw: self.params,
            gw: self.grads,
            p16: self.params16,
            mx: self.mixed,
            lm32: self.lm_head,
            lm16: self.lm16,
            taps: w.taps.f32s(0..slen * c.n_taps * h),
            ctx_pre: w.ctx_pre.f32s(0..slen * h),
            ctx: self.mixed.gemm_act(w.ctx, slen * h),
            ctx_rstd: w.ctx_rstd.f32s(0..slen),
            hcur: w.hcur.f32s(0..m * h),
            o: w.o.f32s(0..m * h),
            spans_d: w.spans.f32s(0..4 * m),
            hn: w.hn.f32s(0..m * h),
            rstd_f: w.rstd_f.f32s(0..m),
            block_pos: w.block_pos.f32s(0..m),
            key_pos: w.key_pos.f32s(0..tk),
            inv_freq: self.inv_freq,
            rope_scale: self.d.rope_scale,
        }
    }

    /// Parameter `name` as a GEMM weight.
    fn pr(&self, name: &str) -> W {
        self.pw(&self.d.layout.range(name))
    }

    /// Parameters `r` as a GEMM weight.
    fn pw(&self, r: &std::ops::Range<usize>) -> W {
        W {
            f: self.params.f32s(r.clone()),
            b: if self.mixed.bf16 {
                self.params16.sub(2, r.clone())
            } else {
                NONE
            },
        }
    }

    /// Copy one row of bf16 taps into staging buffer `b` on the copy stream, after `free`
    /// (the compute stream done with what the buffer held); an event behind the copy.
    fn stage(
        &mut self,
        b: usize,
        raw: &[u8],
        free: Option<crate::device::Event>,
    ) -> Result<crate::device::Event> {
        let dev = &mut self.ops.dev;
        if let Some(e) = free {
            let r = dev.wait(Stream::Copy, e);
            dev.release_event(e);
            r?;
        }
        // SAFETY: `raw` is borrowed for the whole batch, which waits for this copy (and
        // every other) before it returns.
        unsafe {
            dev.upload_async(
                Stream::Copy,
                self.w.taps16[b].sub(1, 0..raw.len()),
                raw.as_ptr(),
            )?
        };
        dev.record(Stream::Copy)
    }

    /// One sample's forward, loss and backward, its gradient added into `grads`; the
    /// step's loss statistics read after the `last` one's loss. Returns an event behind
    /// the last read of its staging buffer, if it had one.
    fn sample(
        &mut self,
        s: &Sample,
        taps: Taps,
        anchors: &[usize],
        denominator: f64,
        last: bool,
        backward: bool,
    ) -> Result<(StepStats, Option<crate::device::Event>)> {
        let bs = self.d.cfg.block_size;
        let (slen, nb) = (s.ids.len(), anchors.len());
        let m = nb * bs;
        if slen > self.max_len || m > self.max_rows {
            return Err(GpuError::Invalid(format!(
                "a sample of {slen} positions and {nb} blocks; room for {} and {}",
                self.max_len,
                self.max_rows / bs
            )));
        }
        let dims = Dims {
            slen,
            nb,
            m,
            tk: slen + m,
        };
        let freed = self.inputs(s, taps, anchors, dims)?;
        let r = (|| {
            self.forward(dims)?;
            let (stats, supervised) = self.loss(s, anchors, dims, denominator, backward)?;
            if last {
                // The step's losses and hits start for the host; it waits for them only
                // once the last backward is queued, so the GPU never drains for the read
                // (and that backward may still run when the batch returns: a collective
                // reduces its buckets meanwhile).
                self.start_ce_read()?;
            }
            if backward {
                self.backward(dims, supervised, last)?;
            }
            if last {
                self.finish_ce_read()?;
            }
            Ok(stats)
        })();
        match r {
            Ok(stats) => Ok((stats, freed)),
            Err(e) => {
                if let Some(f) = freed {
                    self.ops.dev.release_event(f);
                }
                Err(e)
            }
        }
    }

    /// The sample's inputs on the device: taps, block token ids and positions, key
    /// positions, and each block row's key spans.
    fn inputs(
        &mut self,
        s: &Sample,
        taps: Taps,
        anchors: &[usize],
        dims: Dims,
    ) -> Result<Option<crate::device::Event>> {
        let c = self.d.cfg.clone();
        let lc = self.locals(dims);
        let Locals { h, bs, slen, m, .. } = lc;
        let w = &self.w;
        let ops = &mut self.ops;
        let width = slen * c.n_taps * h;
        let freed = match taps {
            Taps::Staged(b, loaded) => {
                let r = ops.dev.wait(Stream::Compute, loaded);
                ops.dev.release_event(loaded);
                r?;
                ops.bf16_to_f32(w.taps.f32s(0..width), w.taps16[b].sub(2, 0..width))?;
                Some(ops.dev.record(Stream::Compute)?)
            }
            Taps::F32 => {
                if s.taps.len() != width {
                    return Err(GpuError::Invalid(format!(
                        "{} tap values for {slen} positions × {} taps × {h}",
                        s.taps.len(),
                        c.n_taps
                    )));
                }
                ops.dev.upload(Stream::Compute, w.taps, f32_bytes(s.taps))?;
                None
            }
        };
        let mut block_ids = Vec::with_capacity(m);
        let mut block_pos = Vec::with_capacity(m);
        for &a in anchors {
            for k in 0..bs {
                block_ids.push(if k == 0 { s.ids[a] } else { c.mask_token_id });
                block_pos.push((a + k) as i32);
            }
        }
        let key_pos: Vec<i32> = (0..slen as i32).chain(block_pos.iter().copied()).collect();
        let spans: Vec<i32> = (0..m)
            .flat_map(|i| {
                let n = i / bs;
                [
                    0,
                    anchors[n] as i32,
                    (slen + n * bs) as i32,
                    (slen + (n + 1) * bs) as i32,
                ]
            })
            .collect();
        ops.dev
            .upload(Stream::Compute, w.block_ids, u32_bytes(&block_ids))?;
        ops.dev
            .upload(Stream::Compute, w.block_pos, i32_bytes(&block_pos))?;
        ops.dev
            .upload(Stream::Compute, w.key_pos, i32_bytes(&key_pos))?;
        ops.dev
            .upload(Stream::Compute, w.spans, i32_bytes(&spans))?;
        Ok(freed)
    }

    /// The forward: the context, the block embeddings, every layer (keeping what the
    /// backward needs) and the final norm into `hn`.
    fn forward(&mut self, dims: Dims) -> Result<()> {
        let lc = self.locals(dims);
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
        } = lc;
        let p = &mut Pass {
            ops: &mut self.ops,
            lc,
            w: &self.w,
        };
        // Context: hidden_norm(fc(taps)).
        mx.mm(p.ops, taps, fc, ctx_pre, slen, n_taps * h, h)?;
        mx.norm(p.ops, ctx_pre, hnorm, ctx, ctx_rstd, slen, h, eps)?;
        // Block inputs: the frozen embedding of [token at anchor, MASK, ...].
        p.ops
            .embed(hcur, self.embed, p.w.block_ids.f32s(0..m), m, h, vocab)?;

        for (li, sv) in self.d.layers.iter().zip(&self.saved) {
            p.projections(li, sv)?;
            p.qk_norm_rope(li, sv)?;
            p.attend(li, sv)?;
            p.mlp(li, sv)?;
        }
        p.ops.rmsnorm(hcur, fnorm, hn, rstd_f, m, h, eps)?;

        Ok(())
    }

    /// The loss over the weighted slots through the frozen lm_head, a vocabulary chunk at
    /// a time, with its gradient with respect to `hn` (in `dxrows`, for the returned
    /// number of supervised rows) when `grad`, and the step's statistics.
    fn loss(
        &mut self,
        s: &Sample,
        anchors: &[usize],
        dims: Dims,
        denominator: f64,
        grad: bool,
    ) -> Result<(StepStats, usize)> {
        let lc = self.locals(dims);
        let Locals {
            bs, slen, nb, m, ..
        } = lc;
        // Loss over the weighted slots: their rows gathered, the vocabulary in chunks.
        let rows: Vec<(usize, u32, f64)> = (0..m)
            .filter_map(|i| {
                let (n, k) = (i / bs, i % bs);
                let wgt = self.d.slot_weight(anchors[n], k, s.mask);
                (wgt > 0.0).then(|| (i, s.ids[anchors[n] + k], wgt))
            })
            .collect();
        let mut stats = StepStats {
            slot_correct: vec![0; bs],
            slot_total: vec![0; bs],
            tokens: slen as u64,
            anchors: nb as u64,
            ..Default::default()
        };
        let n = rows.len();
        // What the host knows; the loss and what depends on `argmax == label` (the slots'
        // hits, each block's accepted run beyond its first token) come with the step's
        // read ([`Self::read_ce`]).
        for &(i, _, wgt) in &rows {
            stats.weight_sum += wgt;
            stats.slot_total[i % bs] += 1;
        }
        stats.accept_sum += nb as f64;
        stats.blocks += nb as u64;
        if n > 0 {
            if self.ce_used + n > self.max_rows * CE_SAMPLES {
                self.read_ce()?;
            }
            let at = self.ce_used;
            let p = &mut Pass {
                ops: &mut self.ops,
                lc,
                w: &self.w,
            };
            p.ce_rows(&rows, denominator)?;
            p.ce(n, at, grad)?;
            self.ce_used += n;
            let rows = rows.iter().map(|r| (r.0, r.2)).collect();
            self.ce_pending.push(PendingCe {
                offset: at,
                rows,
                nb,
            });
        }
        Ok((stats, n))
    }

    /// Read the pending samples' losses and flags from the device (one wait) and fold
    /// them, sample by sample, into `ce_read`.
    fn read_ce(&mut self) -> Result<()> {
        self.start_ce_read()?;
        self.finish_ce_read()
    }

    /// Queue the copies of the pending rows' losses and hits into the pinned readback,
    /// behind an event: nothing waits here.
    fn start_ce_read(&mut self) -> Result<()> {
        let used = self.ce_used;
        if used == 0 || self.ce_inflight.is_some() {
            return Ok(());
        }
        let cap = self.max_rows * CE_SAMPLES;
        let dev = &mut self.ops.dev;
        // SAFETY: the readback is registered and holds `cap` losses and hits after its
        // first page; nothing reads them before the event (`finish_ce_read`).
        unsafe {
            let at = self.readback.ptr.add(PAGE);
            dev.download_async(Stream::Compute, self.w.ce_loss.f32s(0..used), at)?;
            dev.download_async(
                Stream::Compute,
                self.w.ce_correct.f32s(0..used),
                at.add(cap * 4),
            )?;
        }
        let e = dev.record(Stream::Compute)?;
        self.ce_inflight = Some((used, e));
        Ok(())
    }

    /// Wait for the rows [`start_ce_read`](Self::start_ce_read) queued and fold them,
    /// sample by sample, into `ce_read`: the loss, each slot's hits and each block's run
    /// of hits after its first token.
    fn finish_ce_read(&mut self) -> Result<()> {
        let Some((used, e)) = self.ce_inflight.take() else {
            return Ok(());
        };
        let cap = self.max_rows * CE_SAMPLES;
        let dev = &mut self.ops.dev;
        let r = dev.sync_event(e);
        dev.release_event(e);
        r?;
        let at = self.readback.ptr.wrapping_add(PAGE);
        dev.host_access(at, used * 4, false)?;
        dev.host_access(at.wrapping_add(cap * 4), used * 4, false)?;
        let (mut loss, mut ok) = (vec![0f32; used], vec![0i32; used]);
        // SAFETY: the copies into the readback completed (the event above), and it holds
        // `used` ≤ `cap` of each.
        unsafe {
            std::ptr::copy_nonoverlapping(at, f32_bytes_mut(&mut loss).as_mut_ptr(), used * 4);
            std::ptr::copy_nonoverlapping(
                at.add(cap * 4),
                i32_bytes_mut(&mut ok).as_mut_ptr(),
                used * 4,
            );
        }
        self.ce_used = 0;
        let pending = std::mem::take(&mut self.ce_pending);
        let bs = self.d.cfg.block_size;
        for p in &pending {
            let mut st = StepStats {
                slot_correct: vec![0; bs],
                slot_total: vec![0; bs],
                ..Default::default()
            };
            let mut correct = vec![false; p.nb * bs];
            for (r, &(i, wgt)) in p.rows.iter().enumerate() {
                let hit = ok[p.offset + r] != 0;
                st.loss_sum += wgt * loss[p.offset + r] as f64;
                correct[i] = hit;
                st.slot_correct[i % bs] += hit as u64;
            }
            for a in 0..p.nb {
                // Rows without weight are never a hit: a run stops at the first of them.
                let run = (1..bs).take_while(|&k| correct[a * bs + k]).count();
                st.accept_sum += run as f64;
            }
            self.ce_read.merge(&st);
        }
        Ok(())
    }

    /// The backward from the loss's gradient (`supervised` rows in `dxrows`) through the
    /// final norm, every layer in reverse and the context projection, into `grads`.
    fn backward(&mut self, dims: Dims, supervised: usize, buckets: bool) -> Result<()> {
        let n = supervised;
        let lc = self.locals(dims);
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
        } = lc;
        let mut plan = self.bucket_plan().into_iter();
        let layout = &self.d.layout;
        let g = |name: &str| gw.f32s(layout.range(name));
        let p = &mut Pass {
            ops: &mut self.ops,
            lc,
            w: &self.w,
        };
        let w = p.w;
        // Backward.
        let dhn = w.o.f32s(0..m * h);
        p.ops.dev.memset_zero(Stream::Compute, dhn)?;
        if n > 0 {
            p.ops
                .scatter_add_rows(dhn, w.dxrows.f32s(0..n * h), w.rows.f32s(0..n), n, h)?;
        }
        let dh = w.dh.f32s(0..m * h);
        p.ops.dev.memset_zero(Stream::Compute, dh)?;
        let mut done: Vec<(std::ops::Range<usize>, crate::device::Event)> = Vec::new();
        // The plan's next bucket is final (the last sample's backward wrote it last).
        let mut bucket = |ops: &mut Ops| -> Result<()> {
            let range = plan.next().expect("one bucket per point of the backward");
            if buckets {
                done.push((range, ops.dev.record(Stream::Compute)?));
            }
            Ok(())
        };
        p.ops
            .rmsnorm_backward(dhn, hcur, fnorm, rstd_f, dh, Some(g("norm.weight")), m, h)?;
        bucket(p.ops)?;
        let dctx = w.dctx.f32s(0..slen * h);
        p.ops.dev.memset_zero(Stream::Compute, dctx)?;
        for (li, sv) in self.d.layers.iter().zip(&self.saved).rev() {
            p.mlp_backward(li, sv)?;
            p.attend_backward(li, sv)?;
            p.qk_norm_rope_backward(li, sv)?;
            p.projections_backward(li, sv)?;
            bucket(p.ops)?;
        }
        // The block embeddings are frozen: dh stops here. The context goes back to fc.
        let dctx_pre = w.dctx_pre.f32s(0..slen * h);
        p.ops.dev.memset_zero(Stream::Compute, dctx_pre)?;
        p.ops.rmsnorm_backward(
            dctx,
            ctx_pre,
            hnorm,
            ctx_rstd,
            dctx_pre,
            Some(g("hidden_norm.weight")),
            slen,
            h,
        )?;
        mx.mm_back(
            p.ops,
            dctx_pre,
            taps,
            fc,
            None,
            Some(g("fc.weight")),
            slen,
            n_taps * h,
            h,
        )?;
        bucket(p.ops)?;
        self.buckets = done;
        Ok(())
    }

    /// The gradient's buckets in the order the backward finishes them: the final norm,
    /// each layer from the last, then the context projection (fc and hidden_norm).
    /// Together they cover every parameter once; every rank has the same.
    pub fn bucket_plan(&self) -> Vec<std::ops::Range<usize>> {
        let lay = &self.d.layout;
        let span = |ranges: &[std::ops::Range<usize>]| {
            ranges.iter().map(|r| r.start).min().unwrap_or(0)
                ..ranges.iter().map(|r| r.end).max().unwrap_or(0)
        };
        let mut plan = vec![lay.range("norm.weight")];
        for li in self.d.layers.iter().rev() {
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
}

impl crate::device::grads::GradientBuckets for DeviceDrafter {
    fn device(&mut self) -> &mut dyn Device {
        DeviceDrafter::device(self)
    }

    fn reduce_buckets(
        &mut self,
        stream: Stream,
        reduce: &mut dyn FnMut(&mut dyn Device, DSlice, DSlice) -> Result<()>,
    ) -> Result<crate::device::Event> {
        DeviceDrafter::reduce_buckets(self, stream, reduce)
    }

    fn reduce_alone(&mut self) -> Result<crate::device::Event> {
        DeviceDrafter::reduce_alone(self)
    }

    fn grads_to_host(&mut self, dst: &mut [u8]) -> Result<()> {
        DeviceDrafter::grads_to_host(self, dst)
    }
}
