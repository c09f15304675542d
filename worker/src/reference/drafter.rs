//! The reference drafter: forward and backward of the DFlash drafter on host slices,
//! with the reference ops ([`super::ops::Cpu`]): what the device drafter
//! ([`crate::models::drafter::device::DeviceDrafter`]) is tested against.

use dflash_shared::drafter::StepStats;

use super::ops::{axpy, Cpu};
use super::{AttnSaved, Heads, KeySpan};
use crate::math::exp_neg;
use crate::models::drafter::{Drafter, Frozen, LayerIdx, Sample};

/// Activations of one layer kept for the backward pass.
struct LayerSaved {
    h_in: Vec<f32>,
    x: Vec<f32>,
    rstd1: Vec<f32>,
    q_pre: Vec<f32>,
    q_rstd: Vec<f32>,
    k_pre: Vec<f32>,
    k_rstd: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    attn_saved: AttnSaved,
    h_mid: Vec<f32>,
    x2: Vec<f32>,
    rstd2: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    act: Vec<f32>,
}

/// One sample's forward up to the final norm.
struct Forward {
    ctx_pre: Vec<f32>,
    ctx: Vec<f32>,
    ctx_rstd: Vec<f32>,
    block_pos: Vec<usize>,
    key_pos: Vec<usize>,
    spans: Vec<KeySpan>,
    saved: Vec<LayerSaved>,
    /// The residual stream after the last layer (before the final norm).
    h_last: Vec<f32>,
    /// Final-normed hidden states, `[blocks × block_size, hidden]`.
    hn: Vec<f32>,
    rstd_f: Vec<f32>,
}

impl Drafter {
    /// Forward and backward over one batch: adds the gradient of `Σ w·CE / denominator`
    /// to `grads` and returns the batch's statistics. A rank passes 1 (the unnormalised
    /// sum; the step divides by the weight sum of every rank's batch); one process training
    /// alone passes [`total_weight`](Self::total_weight). `anchors[i]` are the anchors of
    /// sample `i` (see [`sample_anchors`](Self::sample_anchors)).
    #[allow(clippy::too_many_arguments)]
    pub fn train_batch(
        &self,
        p: &[f32],
        frozen: &Frozen,
        samples: &[Sample],
        anchors: &[Vec<usize>],
        denominator: f64,
        grads: &mut [f32],
    ) -> StepStats {
        let total_weight = self.total_weight(samples, anchors);
        let mut stats = StepStats {
            slot_correct: vec![0; self.cfg.block_size],
            slot_total: vec![0; self.cfg.block_size],
            ..Default::default()
        };
        if total_weight == 0.0 {
            return stats;
        }
        for (s, an) in samples.iter().zip(anchors) {
            if an.is_empty() {
                continue;
            }
            let st = self.sample_step(p, frozen, s, an, denominator, Some(&mut *grads));
            stats.merge(&st);
        }
        stats
    }

    /// Loss of one batch without gradients (for tests and evaluation).
    pub fn loss(
        &self,
        p: &[f32],
        frozen: &Frozen,
        samples: &[Sample],
        anchors: &[Vec<usize>],
    ) -> f64 {
        let total_weight = self.total_weight(samples, anchors);
        samples
            .iter()
            .zip(anchors)
            .filter(|(_, an)| !an.is_empty())
            .map(|(s, an)| {
                self.sample_step(p, frozen, s, an, total_weight, None)
                    .loss_sum
            })
            .sum::<f64>()
            / total_weight
    }

    /// The drafter's output for one sample before the lm_head: the final-normed hidden
    /// states `[anchors.len() × block_size, hidden]` of the blocks whose input embeddings
    /// are `block_embeds` (`[anchors.len() × block_size, hidden]`, usually the frozen
    /// target embedding of `[token at anchor, MASK × (bs-1)]`), given the sample's tapped
    /// hidden states `taps` (`[len, n_taps × hidden]`). Block `n` sits at positions
    /// `anchors[n] + k` and sees the context strictly before its anchor and itself. The
    /// same forward as training (used for the export's parity probe).
    pub fn final_hidden(
        &self,
        p: &[f32],
        taps: &[f32],
        block_embeds: &[f32],
        anchors: &[usize],
    ) -> Result<Vec<f32>, String> {
        let c = &self.cfg;
        let width = c.n_taps * c.hidden;
        if p.len() != self.layout.total {
            return Err(format!(
                "{} parameters, the drafter has {}",
                p.len(),
                self.layout.total
            ));
        }
        if taps.is_empty() || taps.len() % width != 0 {
            return Err(format!(
                "taps hold {} values, not a positive multiple of n_taps × hidden = {width}",
                taps.len()
            ));
        }
        let slen = taps.len() / width;
        if block_embeds.len() != anchors.len() * c.block_size * c.hidden {
            return Err(format!(
                "{} block embedding values for {} blocks of {} × {}",
                block_embeds.len(),
                anchors.len(),
                c.block_size,
                c.hidden
            ));
        }
        if let Some(a) = anchors.iter().find(|&&a| a >= slen) {
            return Err(format!("anchor {a} is past the {slen} context tokens"));
        }
        Ok(self
            .forward(p, taps, slen, block_embeds.to_vec(), anchors)
            .hn)
    }

    /// Forward of one sample up to the final norm, keeping what the backward needs.
    fn forward(
        &self,
        p: &[f32],
        taps: &[f32],
        slen: usize,
        mut hcur: Vec<f32>,
        anchors: &[usize],
    ) -> Forward {
        let c = &self.cfg;
        let cpu = &Cpu::new();
        let (h, bs) = (c.hidden, c.block_size);
        let eps = c.eps as f32;
        let m = anchors.len() * bs;
        let w = |r: &std::ops::Range<usize>| &p[r.clone()];

        // Context.
        let fc = self.layout.range("fc.weight");
        let hn_r = self.layout.range("hidden_norm.weight");
        let mut ctx_pre = vec![0f32; slen * h];
        cpu.matmul(taps, w(&fc), &mut ctx_pre, slen, c.n_taps * h, h);
        let mut ctx = vec![0f32; slen * h];
        let ctx_rstd = cpu.rmsnorm(&ctx_pre, w(&hn_r), &mut ctx, h, eps);

        // Block positions and what each block row sees.
        let block_pos: Vec<usize> = anchors
            .iter()
            .flat_map(|&a| (0..bs).map(move |k| a + k))
            .collect();
        let key_pos: Vec<usize> = (0..slen).chain(block_pos.iter().copied()).collect();
        let spans: Vec<KeySpan> = (0..m)
            .map(|i| {
                let n = i / bs;
                KeySpan {
                    a: 0..anchors[n],
                    b: slen + n * bs..slen + (n + 1) * bs,
                }
            })
            .collect();

        // Layers.
        let ps = Pass {
            cpu,
            p,
            ctx: &ctx,
            block_pos: &block_pos,
            key_pos: &key_pos,
            spans: &spans,
        };
        let saved: Vec<LayerSaved> = self
            .layers
            .iter()
            .map(|li| self.layer_forward(&ps, li, &mut hcur))
            .collect();
        let norm_r = self.layout.range("norm.weight");
        let mut hn = vec![0f32; m * h];
        let rstd_f = cpu.rmsnorm(&hcur, w(&norm_r), &mut hn, h, eps);
        Forward {
            ctx_pre,
            ctx,
            ctx_rstd,
            block_pos,
            key_pos,
            spans,
            saved,
            h_last: hcur,
            hn,
            rstd_f,
        }
    }

    /// One layer's forward on the residual stream `hcur` (`[block rows, hidden]`,
    /// updated in place), keeping what the backward needs.
    fn layer_forward(&self, ps: &Pass, li: &LayerIdx, hcur: &mut [f32]) -> LayerSaved {
        let c = &self.cfg;
        let cpu = ps.cpu;
        let (slen, m, tk) = (ps.slen(), ps.m(), ps.key_pos.len());
        let (h, hd, inter) = (c.hidden, c.head_dim, c.intermediate);
        let (qd, kd) = (c.q_heads * hd, c.kv_heads * hd);
        let eps = c.eps as f32;
        let w = |r: &std::ops::Range<usize>| &ps.p[r.clone()];
        let ctx = ps.ctx;
        let h_in = hcur.to_vec();
        let mut x = vec![0f32; m * h];
        let rstd1 = cpu.rmsnorm(hcur, w(&li.ln1), &mut x, h, eps);
        let mut q_pre = vec![0f32; m * qd];
        cpu.matmul(&x, w(&li.wq), &mut q_pre, m, h, qd);
        let mut k_pre = vec![0f32; tk * kd];
        let mut v = vec![0f32; tk * kd];
        cpu.matmul(ctx, w(&li.wk), &mut k_pre[..slen * kd], slen, h, kd);
        cpu.matmul(&x, w(&li.wk), &mut k_pre[slen * kd..], m, h, kd);
        cpu.matmul(ctx, w(&li.wv), &mut v[..slen * kd], slen, h, kd);
        cpu.matmul(&x, w(&li.wv), &mut v[slen * kd..], m, h, kd);
        let mut q = vec![0f32; m * qd];
        let q_rstd = cpu.rmsnorm(&q_pre, w(&li.qn), &mut q, hd, eps);
        let mut k = vec![0f32; tk * kd];
        let k_rstd = cpu.rmsnorm(&k_pre, w(&li.kn), &mut k, hd, eps);
        self.rope(cpu, &mut q, c.q_heads, ps.block_pos, false);
        self.rope(cpu, &mut k, c.kv_heads, ps.key_pos, false);
        let mut att = vec![0f32; m * qd];
        let attn_saved = cpu.attention(&q, &k, &v, &mut att, ps.spans, self.heads());
        let mut o = vec![0f32; m * h];
        cpu.matmul(&att, w(&li.wo), &mut o, m, qd, h);
        hcur.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let h_mid = hcur.to_vec();
        let mut x2 = vec![0f32; m * h];
        let rstd2 = cpu.rmsnorm(hcur, w(&li.ln2), &mut x2, h, eps);
        let (mut g, mut u, mut act) = (
            vec![0f32; m * inter],
            vec![0f32; m * inter],
            vec![0f32; m * inter],
        );
        cpu.matmul(&x2, w(&li.gate), &mut g, m, h, inter);
        cpu.matmul(&x2, w(&li.up), &mut u, m, h, inter);
        cpu.swiglu(&g, &u, &mut act);
        cpu.matmul(&act, w(&li.down), &mut o, m, inter, h);
        hcur.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        LayerSaved {
            h_in,
            x,
            rstd1,
            q_pre,
            q_rstd,
            k_pre,
            k_rstd,
            q,
            k,
            v,
            att,
            attn_saved,
            h_mid,
            x2,
            rstd2,
            g,
            u,
            act,
        }
    }

    /// The drafter's attention shape.
    fn heads(&self) -> Heads {
        Heads {
            q_heads: self.cfg.q_heads,
            kv_heads: self.cfg.kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    /// The drafter's rotary embedding on rows of `heads` heads at `positions` (its
    /// transpose when `inverse`).
    fn rope(&self, cpu: &Cpu, x: &mut [f32], heads: usize, positions: &[usize], inverse: bool) {
        let hd = self.cfg.head_dim;
        cpu.rope(
            x,
            heads,
            hd,
            positions,
            &self.inv_freq,
            self.rope_scale,
            inverse,
        );
    }

    /// Block inputs: [token at anchor, MASK × (bs-1)], embedded with the frozen embedding.
    fn block_inputs(&self, frozen: &Frozen, s: &Sample, anchors: &[usize]) -> Vec<f32> {
        let c = &self.cfg;
        let (h, bs) = (c.hidden, c.block_size);
        let mut hcur = vec![0f32; anchors.len() * bs * h];
        for (n, &a) in anchors.iter().enumerate() {
            for k in 0..bs {
                let tok = if k == 0 { s.ids[a] } else { c.mask_token_id } as usize;
                hcur[(n * bs + k) * h..(n * bs + k + 1) * h]
                    .copy_from_slice(&frozen.embed[tok * h..(tok + 1) * h]);
            }
        }
        hcur
    }

    /// One sample's forward and loss and, given `grads`, its backward (the gradient of
    /// `Σ w·CE / total_weight` added into `grads`).
    #[allow(clippy::needless_range_loop)]
    fn sample_step(
        &self,
        p: &[f32],
        frozen: &Frozen,
        s: &Sample,
        anchors: &[usize],
        total_weight: f64,
        grads: Option<&mut [f32]>,
    ) -> StepStats {
        let c = &self.cfg;
        let cpu = &Cpu::new();
        let (h, bs) = (c.hidden, c.block_size);
        let slen = s.ids.len();
        let nb = anchors.len();
        let m = nb * bs;

        let hcur = self.block_inputs(frozen, s, anchors);
        let fw = self.forward(p, s.taps, slen, hcur, anchors);

        // Loss over the weighted slots, in vocabulary chunks.
        let mut stats = StepStats {
            slot_correct: vec![0; bs],
            slot_total: vec![0; bs],
            tokens: slen as u64,
            anchors: nb as u64,
            ..Default::default()
        };
        let rows: Vec<(usize, u32, f64)> = (0..m)
            .filter_map(|i| {
                let (n, k) = (i / bs, i % bs);
                let wgt = self.slot_weight(anchors[n], k, s.mask);
                (wgt > 0.0).then(|| (i, s.ids[anchors[n] + k], wgt))
            })
            .collect();
        let mut dhn = vec![0f32; m * h];
        let mut correct = vec![false; m];
        for chunk in rows.chunks(256) {
            let res = lm_head_ce(
                cpu,
                &fw.hn,
                h,
                &frozen.lm_head,
                c.vocab,
                chunk,
                total_weight,
                grads.is_some().then_some(&mut dhn[..]),
            );
            for ((i, _, wgt), (ce, ok)) in chunk.iter().zip(res) {
                stats.loss_sum += wgt * ce;
                stats.weight_sum += wgt;
                correct[*i] = ok;
                let k = i % bs;
                stats.slot_total[k] += 1;
                stats.slot_correct[k] += ok as u64;
            }
        }
        for n in 0..nb {
            let run = (1..bs)
                .take_while(|&k| {
                    self.slot_weight(anchors[n], k, s.mask) > 0.0 && correct[n * bs + k]
                })
                .count();
            stats.accept_sum += 1.0 + run as f64;
            stats.blocks += 1;
        }
        if let Some(grads) = grads {
            self.backward(cpu, p, s.taps, &fw, &dhn, grads);
        }
        stats
    }

    /// The backward of one sample from `dhn` (the loss's gradient with respect to the
    /// final-normed hidden states) through the final norm, every layer in reverse and the
    /// context projection, added into `grads`.
    fn backward(
        &self,
        cpu: &Cpu,
        p: &[f32],
        taps: &[f32],
        fw: &Forward,
        dhn: &[f32],
        grads: &mut [f32],
    ) {
        let c = &self.cfg;
        let h = c.hidden;
        let slen = fw.ctx.len() / h;
        let w = |r: &std::ops::Range<usize>| &p[r.clone()];
        let fc = self.layout.range("fc.weight");
        let hn_r = self.layout.range("hidden_norm.weight");
        let norm_r = self.layout.range("norm.weight");
        let mut b = Back {
            dh: vec![0f32; dhn.len()],
            dctx: vec![0f32; slen * h],
            grads,
        };
        {
            let (pn, gn) = (w(&norm_r), &mut b.grads[norm_r.clone()]);
            cpu.rmsnorm_backward(dhn, &fw.h_last, pn, &fw.rstd_f, &mut b.dh, Some(gn), h);
        }
        let ps = Pass {
            cpu,
            p,
            ctx: &fw.ctx,
            block_pos: &fw.block_pos,
            key_pos: &fw.key_pos,
            spans: &fw.spans,
        };
        for (li, sv) in self.layers.iter().zip(&fw.saved).rev() {
            self.mlp_backward(&ps, li, sv, &mut b);
            let d = self.attention_backward(&ps, li, sv, &mut b);
            self.projections_backward(&ps, li, sv, &d, &mut b);
        }
        // The block embeddings are frozen: dh stops here. The context goes back to fc.
        let grads = b.grads;
        let mut dctx_pre = vec![0f32; slen * h];
        cpu.rmsnorm_backward(
            &b.dctx,
            &fw.ctx_pre,
            w(&hn_r),
            &fw.ctx_rstd,
            &mut dctx_pre,
            Some(&mut grads[hn_r.clone()]),
            h,
        );
        cpu.matmul_backward(
            &dctx_pre,
            taps,
            w(&fc),
            None,
            Some(&mut grads[fc.clone()]),
            slen,
            c.n_taps * h,
            h,
        );
    }

    /// MLP branch, `h_out = h_mid + down(swiglu(gate(x2), up(x2)))`: `dh` through it (the
    /// residual's gradient stays in `dh`).
    fn mlp_backward(&self, ps: &Pass, li: &LayerIdx, sv: &LayerSaved, b: &mut Back) {
        let c = &self.cfg;
        let (cpu, m) = (ps.cpu, ps.m());
        let (h, inter) = (c.hidden, c.intermediate);
        let w = |r: &std::ops::Range<usize>| &ps.p[r.clone()];
        let grads = &mut *b.grads;
        let mut dact = vec![0f32; m * inter];
        cpu.matmul_backward(
            &b.dh,
            &sv.act,
            w(&li.down),
            Some(&mut dact),
            Some(&mut grads[li.down.clone()]),
            m,
            inter,
            h,
        );
        let (mut dg, mut du) = (vec![0f32; m * inter], vec![0f32; m * inter]);
        cpu.swiglu_backward(&dact, &sv.g, &sv.u, &mut dg, &mut du);
        let mut dx2 = vec![0f32; m * h];
        cpu.matmul_backward(
            &dg,
            &sv.x2,
            w(&li.gate),
            Some(&mut dx2),
            Some(&mut grads[li.gate.clone()]),
            m,
            h,
            inter,
        );
        cpu.matmul_backward(
            &du,
            &sv.x2,
            w(&li.up),
            Some(&mut dx2),
            Some(&mut grads[li.up.clone()]),
            m,
            h,
            inter,
        );
        cpu.rmsnorm_backward(
            &dx2,
            &sv.h_mid,
            w(&li.ln2),
            &sv.rstd2,
            &mut b.dh,
            Some(&mut grads[li.ln2.clone()]),
            h,
        );
    }

    /// Attention branch, `h_mid = h_in + o_proj(attention)`: `dh` through the output
    /// projection, the attention, the rotary embedding and the per-head q/k norms, to the
    /// gradients of the projections' outputs.
    fn attention_backward(
        &self,
        ps: &Pass,
        li: &LayerIdx,
        sv: &LayerSaved,
        b: &mut Back,
    ) -> ProjGrads {
        let c = &self.cfg;
        let (cpu, m, tk) = (ps.cpu, ps.m(), ps.key_pos.len());
        let (h, hd) = (c.hidden, c.head_dim);
        let (qd, kd) = (c.q_heads * hd, c.kv_heads * hd);
        let w = |r: &std::ops::Range<usize>| &ps.p[r.clone()];
        let grads = &mut *b.grads;
        let mut datt = vec![0f32; m * qd];
        cpu.matmul_backward(
            &b.dh,
            &sv.att,
            w(&li.wo),
            Some(&mut datt),
            Some(&mut grads[li.wo.clone()]),
            m,
            qd,
            h,
        );
        let (mut dq, mut dk, mut dv) =
            (vec![0f32; m * qd], vec![0f32; tk * kd], vec![0f32; tk * kd]);
        cpu.attention_backward(
            &datt,
            &sv.q,
            &sv.k,
            &sv.v,
            &sv.attn_saved,
            ps.spans,
            self.heads(),
            &mut dq,
            &mut dk,
            &mut dv,
        );
        self.rope(cpu, &mut dq, c.q_heads, ps.block_pos, true);
        self.rope(cpu, &mut dk, c.kv_heads, ps.key_pos, true);
        let mut dq_pre = vec![0f32; m * qd];
        cpu.rmsnorm_backward(
            &dq,
            &sv.q_pre,
            w(&li.qn),
            &sv.q_rstd,
            &mut dq_pre,
            Some(&mut grads[li.qn.clone()]),
            hd,
        );
        let mut dk_pre = vec![0f32; tk * kd];
        cpu.rmsnorm_backward(
            &dk,
            &sv.k_pre,
            w(&li.kn),
            &sv.k_rstd,
            &mut dk_pre,
            Some(&mut grads[li.kn.clone()]),
            hd,
        );
        ProjGrads { dq_pre, dk_pre, dv }
    }

    /// The projections' gradients `d` through wq, wk and wv (the block rows' share into
    /// `dx`, the context's into `dctx`), then `dx` through ln1 into `dh`.
    fn projections_backward(
        &self,
        ps: &Pass,
        li: &LayerIdx,
        sv: &LayerSaved,
        d: &ProjGrads,
        b: &mut Back,
    ) {
        let c = &self.cfg;
        let (cpu, slen, m) = (ps.cpu, ps.slen(), ps.m());
        let (h, hd) = (c.hidden, c.head_dim);
        let (qd, kd) = (c.q_heads * hd, c.kv_heads * hd);
        let w = |r: &std::ops::Range<usize>| &ps.p[r.clone()];
        let (grads, dctx) = (&mut *b.grads, &mut b.dctx);
        let ProjGrads { dq_pre, dk_pre, dv } = d;
        let mut dx = vec![0f32; m * h];
        cpu.matmul_backward(
            dq_pre,
            &sv.x,
            w(&li.wq),
            Some(&mut dx),
            Some(&mut grads[li.wq.clone()]),
            m,
            h,
            qd,
        );
        cpu.matmul_backward(
            &dk_pre[slen * kd..],
            &sv.x,
            w(&li.wk),
            Some(&mut dx),
            Some(&mut grads[li.wk.clone()]),
            m,
            h,
            kd,
        );
        cpu.matmul_backward(
            &dk_pre[..slen * kd],
            ps.ctx,
            w(&li.wk),
            Some(dctx),
            Some(&mut grads[li.wk.clone()]),
            slen,
            h,
            kd,
        );
        cpu.matmul_backward(
            &dv[slen * kd..],
            &sv.x,
            w(&li.wv),
            Some(&mut dx),
            Some(&mut grads[li.wv.clone()]),
            m,
            h,
            kd,
        );
        cpu.matmul_backward(
            &dv[..slen * kd],
            ps.ctx,
            w(&li.wv),
            Some(dctx),
            Some(&mut grads[li.wv.clone()]),
            slen,
            h,
            kd,
        );
        cpu.rmsnorm_backward(
            &dx,
            &sv.h_in,
            w(&li.ln1),
            &sv.rstd1,
            &mut b.dh,
            Some(&mut grads[li.ln1.clone()]),
            h,
        );
    }
}

/// What every layer of one sample reads: the reference ops, the parameters, the
/// context (after its norm), the block rows' and keys' positions and the keys each block
/// row sees.
struct Pass<'a> {
    cpu: &'a Cpu,
    p: &'a [f32],
    ctx: &'a [f32],
    block_pos: &'a [usize],
    key_pos: &'a [usize],
    spans: &'a [KeySpan],
}

impl Pass<'_> {
    /// Context positions.
    fn slen(&self) -> usize {
        self.key_pos.len() - self.block_pos.len()
    }

    /// Block rows.
    fn m(&self) -> usize {
        self.block_pos.len()
    }
}

/// The gradients flowing back through one sample's layers: the residual stream's, the
/// context's, and the parameters' (added into).
struct Back<'g> {
    dh: Vec<f32>,
    dctx: Vec<f32>,
    grads: &'g mut [f32],
}

/// The gradients of a layer's q (before its norm), k (before its norm) and v, each over
/// the context then the block rows for k and v.
struct ProjGrads {
    dq_pre: Vec<f32>,
    dk_pre: Vec<f32>,
    dv: Vec<f32>,
}

/// Cross-entropy of `rows` (row index into `hn`, label, weight) through the frozen
/// `lm_head`, visiting the vocabulary in chunks (each chunk's logits one GEMM): returns
/// (CE, argmax == label) per row and, if asked, adds `w/total · dCE/dhn` into `dhn`.
#[allow(clippy::too_many_arguments)]
pub fn lm_head_ce(
    cpu: &Cpu,
    hn: &[f32],
    h: usize,
    lm_head: &[f32],
    vocab: usize,
    rows: &[(usize, u32, f64)],
    total: f64,
    dhn: Option<&mut [f32]>,
) -> Vec<(f64, bool)> {
    const CHUNK: usize = 4096;
    let n = rows.len();
    let mut x = Vec::with_capacity(n * h);
    for &(i, _, _) in rows {
        x.extend_from_slice(&hn[i * h..(i + 1) * h]);
    }
    let mut max = vec![f32::NEG_INFINITY; n];
    let mut sum = vec![0f64; n];
    let mut best = vec![(f32::NEG_INFINITY, 0usize); n];
    let mut label_logit = vec![0f32; n];
    let mut logits = vec![0f32; n * CHUNK];
    for start in (0..vocab).step_by(CHUNK) {
        let end = (start + CHUNK).min(vocab);
        let cw = end - start;
        let l = &mut logits[..n * cw];
        cpu.matmul(&x, &lm_head[start * h..end * h], l, n, h, cw);
        for r in 0..n {
            let lr = &l[r * cw..(r + 1) * cw];
            let label = rows[r].1 as usize;
            if (start..end).contains(&label) {
                label_logit[r] = lr[label - start];
            }
            let cmax = lr.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if let Some(j) = lr.iter().position(|&v| v == cmax) {
                if cmax > best[r].0 {
                    best[r] = (cmax, start + j);
                }
            }
            // Online log-sum-exp, one rescale per chunk.
            let m_new = max[r].max(cmax);
            let s: f64 = lr.iter().map(|&v| exp_neg(v - m_new) as f64).sum();
            sum[r] = sum[r] * ((max[r] - m_new) as f64).exp() + s;
            max[r] = m_new;
        }
    }
    let out: Vec<(f64, bool)> = (0..n)
        .map(|r| {
            let lse = max[r] as f64 + sum[r].ln();
            (lse - label_logit[r] as f64, best[r].1 == rows[r].1 as usize)
        })
        .collect();
    if let Some(dhn) = dhn {
        let mut dx = vec![0f32; n * h];
        for start in (0..vocab).step_by(CHUNK) {
            let end = (start + CHUNK).min(vocab);
            let cw = end - start;
            let w = &lm_head[start * h..end * h];
            let l = &mut logits[..n * cw];
            cpu.matmul(&x, w, l, n, h, cw);
            for (r, &(_, label, wgt)) in rows.iter().enumerate() {
                let scale = (wgt / total) as f32;
                let inv_sum = (1.0 / sum[r]) as f32;
                for (j, v) in l[r * cw..(r + 1) * cw].iter_mut().enumerate() {
                    let pj = exp_neg(*v - max[r]) * inv_sum;
                    let g =
                        (pj - if start + j == label as usize {
                            1.0
                        } else {
                            0.0
                        }) * scale;
                    // Flush what would be subnormal: x86 FMAs on subnormals run ~100× slower.
                    *v = if g.abs() < 1e-30 { 0.0 } else { g };
                }
            }
            // dx (n×h) += g (n×cw) · w (cw×h)
            unsafe {
                crate::math::sgemm(
                    cpu.par(n * cw * h),
                    n,
                    h,
                    cw,
                    dx.as_mut_ptr(),
                    h,
                    1,
                    true,
                    l.as_ptr(),
                    cw,
                    1,
                    w.as_ptr(),
                    h as isize,
                    1,
                )
            };
        }
        for (r, &(i, _, _)) in rows.iter().enumerate() {
            axpy(1.0, &dx[r * h..(r + 1) * h], &mut dhn[i * h..(i + 1) * h]);
        }
    }
    out
}
