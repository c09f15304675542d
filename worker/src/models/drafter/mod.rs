//! The DFlash drafter (DFLASH.md): context = hidden_norm(fc(taps)); blocks of
//! `[token at anchor, MASK × (bs-1)]` embedded with the frozen target embedding; Qwen3
//! decoder layers whose keys and values are `[Wk·ctx ; Wk·x]`, `[Wv·ctx ; Wv·x]`; a block
//! sees the context strictly before its anchor and itself, never another block; final
//! norm; logits by the frozen target lm_head, computed in vocabulary chunks so the full
//! logits never exist. Explicit forward and backward; the trainable parameters live in
//! one flat buffer so the optimizer, the all-reduce and checkpoints treat them as one.
//!
//! This module holds what defines a drafter apart from its math: the parameter layout,
//! initialisation, anchors and loss weights, the optimizer's host state. The model itself
//! runs over the [`crate::device::Device`] seam ([`device::DeviceDrafter`]) on a GPU or on
//! the CPU device; the parity tests check it against the reference drafter
//! (`crate::reference::drafter`, test-only), which is checked against candle autograd and
//! finite differences (`tests/drafter.rs`).

pub mod device;

use dflash_shared::drafter::{DrafterConfig, ParamLayout};
use dflash_shared::rng::Rng;

use crate::math::rope_inv_freq;

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

impl LayerIdx {
    /// gate_proj and up_proj as one `[2·intermediate, hidden]` weight (the layout puts
    /// up right after gate), for the fused gate/up GEMM.
    pub(crate) fn gate_up(&self) -> std::ops::Range<usize> {
        debug_assert_eq!(
            self.gate.end, self.up.start,
            "up follows gate in the layout"
        );
        self.gate.start..self.up.end
    }
}

/// Frozen tensors shared with the target.
pub struct Frozen {
    /// `[vocab, hidden]`
    pub embed: Vec<f32>,
    /// `[vocab, hidden]`; the same values as `embed` when the target ties them.
    pub lm_head: Vec<f32>,
}

impl Frozen {
    /// The target checkpoint's embedding and lm_head (the embedding again when it ties
    /// them), `[vocab, hidden]` each, widened to f32.
    pub fn load(
        w: &crate::models::weights::Weights,
        vocab: usize,
        hidden: usize,
    ) -> Result<Frozen, crate::models::ModelError> {
        let embed = w.get("model.embed_tokens.weight", &[vocab, hidden])?;
        let lm_head = if w.contains("lm_head.weight") {
            w.get("lm_head.weight", &[vocab, hidden])?
        } else {
            embed.clone()
        };
        Ok(Frozen { embed, lm_head })
    }
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

    /// How many slots of the blocks at `anchors` are trained (weight above 0).
    pub fn supervised_slots(&self, anchors: &[usize], mask: &[u8]) -> usize {
        anchors
            .iter()
            .map(|&a| {
                (1..self.cfg.block_size)
                    .filter(|&k| self.slot_weight(a, k, mask) > 0.0)
                    .count()
            })
            .sum()
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
