//! The DFlash drafter (DFLASH.md): context = hidden_norm(fc(taps)); blocks of
//! `[token at anchor, MASK × (bs-1)]` embedded with the frozen target embedding; Qwen3
//! decoder layers whose keys and values are `[Wk·ctx ; Wk·x]`, `[Wv·ctx ; Wv·x]`; a block
//! sees the context strictly before its anchor and itself, never another block; final
//! norm; logits by the frozen target lm_head, computed in vocabulary chunks so the full
//! logits never exist. Explicit forward and backward; the trainable parameters live in
//! one flat buffer so the optimizer, the all-reduce and checkpoints treat them as one.
//!
//! This is the reference implementation, on host slices, checked against candle autograd
//! and finite differences (`tests/drafter.rs`). Workers train with the device model
//! ([`crate::device::drafter::GpuDrafter`]) on their GPU or on the CPU device, which the
//! parity tests check against this one.

use dflash_shared::drafter::{DrafterConfig, ParamLayout, StepStats};
use dflash_shared::rng::Rng;

use crate::compute::cpu::{axpy, Cpu};
use crate::compute::{rope_inv_freq, AttnSaved, Heads, KeySpan};
use crate::math::exp_neg;

/// Offsets of one layer's tensors, resolved once.
#[derive(Debug, Clone)]
pub(crate) struct LayerIdx {
    pub(crate) ln1: std::ops::Range<usize>,
    pub(crate) wq: std::ops::Range<usize>,
    pub(crate) wk: std::ops::Range<usize>,
    pub(crate) wv: std::ops::Range<usize>,
    pub(crate) wo: std::ops::Range<usize>,
    pub(crate) qn: std::ops::Range<usize>,
    pub(crate) kn: std::ops::Range<usize>,
    pub(crate) ln2: std::ops::Range<usize>,
    pub(crate) gate: std::ops::Range<usize>,
    pub(crate) up: std::ops::Range<usize>,
    pub(crate) down: std::ops::Range<usize>,
}

/// Frozen tensors shared with the target.
pub struct Frozen {
    /// `[vocab, hidden]`
    pub embed: Vec<f32>,
    /// `[vocab, hidden]`; the same values as `embed` when the target ties them.
    pub lm_head: Vec<f32>,
}

/// One sample of a hidden-state batch.
pub struct Sample<'a> {
    /// `[len, n_taps × hidden]`
    pub taps: &'a [f32],
    pub ids: &'a [u32],
    pub mask: &'a [u8],
}

/// The samples of a token batch, with their tapped hidden states `taps[row]`
/// (`[len, n_taps × hidden]`), and this step's anchors for each: drawn from the batch id,
/// so a batch gets the same anchors whichever rank trains it.
pub fn batch_samples<'a>(
    d: &Drafter,
    b: &'a dflash_shared::batch::TokenBatch,
    taps: &'a [Vec<f32>],
    seed: u64,
) -> (Vec<Sample<'a>>, Vec<Vec<usize>>) {
    let seq = b.seq_len as usize;
    let mut rng = Rng::new(seed ^ b.batch_id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    b.lengths
        .iter()
        .enumerate()
        .map(|(r, &len)| {
            let (ids, mask) = (
                &b.input_ids[r * seq..r * seq + len as usize],
                &b.loss_mask[r * seq..r * seq + len as usize],
            );
            (
                Sample {
                    taps: &taps[r],
                    ids,
                    mask,
                },
                d.sample_anchors(mask, &mut rng),
            )
        })
        .unzip()
}

pub struct Drafter {
    pub cfg: DrafterConfig,
    pub layout: ParamLayout,
    pub(crate) layers: Vec<LayerIdx>,
    pub(crate) inv_freq: Vec<f32>,
    /// Rotary cos/sin scale (YaRN's attention factor; else 1).
    pub(crate) rope_scale: f32,
    cpu: Cpu,
}

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
    pub fn new(cfg: DrafterConfig) -> Drafter {
        let layout = ParamLayout::new(&cfg);
        let layers = (0..cfg.layers)
            .map(|l| {
                let r = |s: &str| layout.range(&format!("layers.{l}.{s}"));
                LayerIdx {
                    ln1: r("input_layernorm.weight"),
                    wq: r("self_attn.q_proj.weight"),
                    wk: r("self_attn.k_proj.weight"),
                    wv: r("self_attn.v_proj.weight"),
                    wo: r("self_attn.o_proj.weight"),
                    qn: r("self_attn.q_norm.weight"),
                    kn: r("self_attn.k_norm.weight"),
                    ln2: r("post_attention_layernorm.weight"),
                    gate: r("mlp.gate_proj.weight"),
                    up: r("mlp.up_proj.weight"),
                    down: r("mlp.down_proj.weight"),
                }
            })
            .collect();
        let inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling.as_ref());
        let rope_scale = cfg
            .rope_scaling
            .as_ref()
            .map_or(1.0, |s| s.attention_factor()) as f32;
        Drafter {
            cfg,
            layout,
            layers,
            inv_freq,
            rope_scale,
            cpu: Cpu::new(),
        }
    }

    /// Fresh parameters: norms at 1, projections uniform with a 1/√fan_in scale.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        let mut p = vec![0f32; self.layout.total];
        for (name, shape, off) in &self.layout.entries {
            let n: usize = shape.iter().product();
            let dst = &mut p[*off..*off + n];
            if name.ends_with("norm.weight") {
                dst.fill(1.0);
            } else {
                let scale = 1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt();
                for v in dst {
                    *v = ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale;
                }
            }
        }
        p
    }

    /// Valid anchors of a sample, then up to `max_anchors` of them drawn without
    /// replacement, sorted.
    pub fn sample_anchors(&self, mask: &[u8], rng: &mut Rng) -> Vec<usize> {
        let s = mask.len();
        let mut valid: Vec<usize> = (0..s.saturating_sub(1))
            .filter(|&a| mask[a] == 1 && mask[a + 1] == 1)
            .collect();
        let w = self.cfg.max_anchors.min(valid.len());
        for i in 0..w {
            let j = i + rng.below((valid.len() - i) as u64) as usize;
            valid.swap(i, j);
        }
        valid.truncate(w);
        valid.sort_unstable();
        valid
    }

    /// Loss weight of slot `k` of the block at anchor `a` (0 if not trained).
    pub fn slot_weight(&self, a: usize, k: usize, mask: &[u8]) -> f64 {
        if k == 0 || a + k >= mask.len() || mask[a + k] == 0 {
            return 0.0;
        }
        (-((k - 1) as f64) / self.cfg.gamma).exp()
    }

    /// Σ w over the trained slots of a batch: the loss's denominator.
    pub fn total_weight(&self, samples: &[Sample], anchors: &[Vec<usize>]) -> f64 {
        samples
            .iter()
            .zip(anchors)
            .map(|(s, an)| {
                an.iter()
                    .map(|&a| {
                        (1..self.cfg.block_size)
                            .map(|k| self.slot_weight(a, k, s.mask))
                            .sum::<f64>()
                    })
                    .sum::<f64>()
            })
            .sum()
    }

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
        let cpu = &self.cpu;
        let (h, hd, bs, inter) = (c.hidden, c.head_dim, c.block_size, c.intermediate);
        let (qd, kd) = (c.q_heads * hd, c.kv_heads * hd);
        let heads = Heads {
            q_heads: c.q_heads,
            kv_heads: c.kv_heads,
            head_dim: hd,
        };
        let eps = c.eps as f32;
        let m = anchors.len() * bs;
        let tk = slen + m;
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
        let mut saved = Vec::with_capacity(c.layers);
        for li in &self.layers {
            let h_in = hcur.clone();
            let mut x = vec![0f32; m * h];
            let rstd1 = cpu.rmsnorm(&hcur, w(&li.ln1), &mut x, h, eps);
            let mut q_pre = vec![0f32; m * qd];
            cpu.matmul(&x, w(&li.wq), &mut q_pre, m, h, qd);
            let mut k_pre = vec![0f32; tk * kd];
            let mut v = vec![0f32; tk * kd];
            cpu.matmul(&ctx, w(&li.wk), &mut k_pre[..slen * kd], slen, h, kd);
            cpu.matmul(&x, w(&li.wk), &mut k_pre[slen * kd..], m, h, kd);
            cpu.matmul(&ctx, w(&li.wv), &mut v[..slen * kd], slen, h, kd);
            cpu.matmul(&x, w(&li.wv), &mut v[slen * kd..], m, h, kd);
            let mut q = vec![0f32; m * qd];
            let q_rstd = cpu.rmsnorm(&q_pre, w(&li.qn), &mut q, hd, eps);
            let mut k = vec![0f32; tk * kd];
            let k_rstd = cpu.rmsnorm(&k_pre, w(&li.kn), &mut k, hd, eps);
            cpu.rope(
                &mut q,
                c.q_heads,
                hd,
                &block_pos,
                &self.inv_freq,
                self.rope_scale,
                false,
            );
            cpu.rope(
                &mut k,
                c.kv_heads,
                hd,
                &key_pos,
                &self.inv_freq,
                self.rope_scale,
                false,
            );
            let mut att = vec![0f32; m * qd];
            let attn_saved = cpu.attention(&q, &k, &v, &mut att, &spans, heads);
            let mut o = vec![0f32; m * h];
            cpu.matmul(&att, w(&li.wo), &mut o, m, qd, h);
            hcur.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h_mid = hcur.clone();
            let mut x2 = vec![0f32; m * h];
            let rstd2 = cpu.rmsnorm(&hcur, w(&li.ln2), &mut x2, h, eps);
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
            saved.push(LayerSaved {
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
            });
        }
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
        let cpu = &self.cpu;
        let (h, hd, bs, inter) = (c.hidden, c.head_dim, c.block_size, c.intermediate);
        let (qd, kd) = (c.q_heads * hd, c.kv_heads * hd);
        let heads = Heads {
            q_heads: c.q_heads,
            kv_heads: c.kv_heads,
            head_dim: hd,
        };
        let slen = s.ids.len();
        let nb = anchors.len();
        let m = nb * bs;
        let tk = slen + m;
        let w = |r: &std::ops::Range<usize>| &p[r.clone()];

        // Block inputs: [token at anchor, MASK × (bs-1)], embedded with the frozen embedding.
        let mut hcur = vec![0f32; m * h];
        for (n, &a) in anchors.iter().enumerate() {
            for k in 0..bs {
                let tok = if k == 0 { s.ids[a] } else { c.mask_token_id } as usize;
                hcur[(n * bs + k) * h..(n * bs + k + 1) * h]
                    .copy_from_slice(&frozen.embed[tok * h..(tok + 1) * h]);
            }
        }
        let Forward {
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
        } = self.forward(p, s.taps, slen, hcur, anchors);
        let fc = self.layout.range("fc.weight");
        let hn_r = self.layout.range("hidden_norm.weight");
        let norm_r = self.layout.range("norm.weight");

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
                &hn,
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
        let Some(grads) = grads else { return stats };

        // Backward.
        let mut dh = vec![0f32; m * h];
        {
            let (pn, gn) = (w(&norm_r), &mut grads[norm_r.clone()]);
            cpu.rmsnorm_backward(&dhn, &hcur, pn, &rstd_f, &mut dh, Some(gn), h);
        }
        let mut dctx = vec![0f32; slen * h];
        for (li, sv) in self.layers.iter().zip(&saved).rev() {
            // MLP branch: h_out = h_mid + down(swiglu(gate(x2), up(x2))).
            let mut dact = vec![0f32; m * inter];
            cpu.matmul_backward(
                &dh,
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
                &mut dh,
                Some(&mut grads[li.ln2.clone()]),
                h,
            );
            // Attention branch: h_mid = h_in + o_proj(attention).
            let mut datt = vec![0f32; m * qd];
            cpu.matmul_backward(
                &dh,
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
                &spans,
                heads,
                &mut dq,
                &mut dk,
                &mut dv,
            );
            cpu.rope(
                &mut dq,
                c.q_heads,
                hd,
                &block_pos,
                &self.inv_freq,
                self.rope_scale,
                true,
            );
            cpu.rope(
                &mut dk,
                c.kv_heads,
                hd,
                &key_pos,
                &self.inv_freq,
                self.rope_scale,
                true,
            );
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
            let mut dx = vec![0f32; m * h];
            cpu.matmul_backward(
                &dq_pre,
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
                &ctx,
                w(&li.wk),
                Some(&mut dctx),
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
                &ctx,
                w(&li.wv),
                Some(&mut dctx),
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
                &mut dh,
                Some(&mut grads[li.ln1.clone()]),
                h,
            );
        }
        // The block embeddings are frozen: dh stops here. The context goes back to fc.
        let mut dctx_pre = vec![0f32; slen * h];
        cpu.rmsnorm_backward(
            &dctx,
            &ctx_pre,
            w(&hn_r),
            &ctx_rstd,
            &mut dctx_pre,
            Some(&mut grads[hn_r.clone()]),
            h,
        );
        cpu.matmul_backward(
            &dctx_pre,
            s.taps,
            w(&fc),
            None,
            Some(&mut grads[fc.clone()]),
            slen,
            c.n_taps * h,
            h,
        );
        stats
    }
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
                crate::compute::cpu::sgemm(
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

/// AdamW with fp32 state, weight decay 0 by default.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct AdamW {
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub step: u64,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl AdamW {
    pub fn new(n: usize) -> AdamW {
        AdamW {
            m: vec![0.0; n],
            v: vec![0.0; n],
            step: 0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }

    pub fn hyper(&self) -> crate::device::ops::AdamHyper {
        crate::device::ops::AdamHyper {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
    }

    pub fn update(&mut self, p: &mut [f32], g: &[f32], lr: f32) {
        self.step += 1;
        let (b1, b2) = (self.beta1, self.beta2);
        // Bias corrections in f64, rounded once: what the device's `adamw` kernel computes.
        let c1 = (1.0 - (b1 as f64).powf(self.step as f64)) as f32;
        let c2 = (1.0 - (b2 as f64).powf(self.step as f64)) as f32;
        for i in 0..p.len() {
            self.m[i] = b1 * self.m[i] + (1.0 - b1) * g[i];
            self.v[i] = b2 * self.v[i] + (1.0 - b2) * g[i] * g[i];
            let mhat = self.m[i] / c1;
            let vhat = self.v[i] / c2;
            p[i] -= lr * (mhat / (vhat.sqrt() + self.eps) + self.weight_decay * p[i]);
        }
    }
}

/// The step's gradient from the committed slots' sum: divided by the loss weights of all
/// their batches, so that a rank with few supervised tokens weighs each of them as much as
/// a busy rank does (the gradient of Σ_r num_r / Σ_r den_r, which is what one process
/// training on the union of the batches gets). No weight at all: the sum is zero anyway.
pub fn reduce_slots(sum: &mut [f32], weight_sum: f64) {
    if weight_sum > 0.0 {
        let inv = (1.0 / weight_sum) as f32;
        sum.iter_mut().for_each(|x| *x *= inv);
    }
}

/// Global L2 norm of a gradient; `None` if any entry is not finite.
pub fn grad_norm(g: &[f32]) -> Option<f64> {
    let mut s = 0f64;
    for &x in g {
        if !x.is_finite() {
            return None;
        }
        s += (x as f64) * (x as f64);
    }
    Some(s.sqrt())
}

pub use dflash_shared::drafter::lr_at;
