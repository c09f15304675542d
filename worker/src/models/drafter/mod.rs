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
    /// `[vocab, hidden]`: what the target's input embedding module returns for each id
    /// (the stored rows, times the family's scale where it has one: Gemma's
    /// `sqrt(hidden_size)`).
    pub embed: Vec<f32>,
    /// `[vocab, hidden]`; the stored embedding (unscaled) when the target ties them.
    pub lm_head: Vec<f32>,
}

/// Where checkpoints keep the input embedding, each with the lm_head stored beside it: a
/// causal LM's own (`model.embed_tokens`), then the language model nested in a multimodal
/// wrapper, as transformers 4.52+ and 5 name it (`model.language_model.`, e.g. Qwen3.5's
/// published checkpoints) and as the earlier layout did (`language_model.model.`, e.g.
/// Gemma 3's and LLaVA's). Tried in this order; the first present is the embedding.
pub const EMBEDDINGS: &[(&str, &str)] = &[
    (crate::models::target::EMBED, "lm_head.weight"),
    ("model.language_model.embed_tokens.weight", "lm_head.weight"),
    (
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
    ),
];

impl Frozen {
    /// The target checkpoint's embedding and lm_head (the embedding again when it ties
    /// them), `[vocab, hidden]` each, widened to f32, found under any of [`EMBEDDINGS`]'
    /// names; the embedding scaled as the target's config.json (beside the weights) says
    /// its family scales it ([`dflash_shared::model_config::TargetConfig::embed_scale`]).
    pub fn load(
        w: &crate::models::weights::Weights,
        vocab: usize,
        hidden: usize,
    ) -> Result<Frozen, crate::models::ModelError> {
        let cfg = dflash_shared::model_config::TargetConfig::load_any(w.dir()).map_err(|e| {
            crate::models::ModelError {
                path: e.path,
                problem: crate::models::weights::ModelProblem::Config(e.problem),
            }
        })?;
        Frozen::load_scaled(w, vocab, hidden, cfg.embed_scale)
    }

    /// [`load`](Self::load) with the embedding's scale given: each row times `scale` as
    /// transformers' scaled embedding computes it in the weight's dtype (the scale rounded
    /// to bf16 or f16 for such a checkpoint, and the product too: both factors fit in an
    /// f32's mantissa, so one rounding of their f32 product is the dtype's own product).
    /// The lm_head is never scaled (a tied one is the stored embedding).
    pub fn load_scaled(
        w: &crate::models::weights::Weights,
        vocab: usize,
        hidden: usize,
        scale: Option<f32>,
    ) -> Result<Frozen, crate::models::ModelError> {
        use crate::models::weights::ModelProblem;
        let shape = [vocab, hidden];
        let problem = |problem| crate::models::ModelError {
            path: w.dir().display().to_string(),
            problem,
        };
        let Some(&(embed_name, beside)) = EMBEDDINGS.iter().find(|(e, _)| w.contains(e)) else {
            return Err(problem(ModelProblem::NoEmbedding {
                tried: EMBEDDINGS.iter().map(|(e, _)| e.to_string()).collect(),
                shape: shape.to_vec(),
            }));
        };
        let table = w.get(embed_name, &shape)?;
        // The lm_head beside this embedding, else one of another layout; none at all: tied.
        let mut heads: Vec<&str> = vec![beside];
        for (_, h) in EMBEDDINGS {
            if !heads.contains(h) {
                heads.push(h);
            }
        }
        let lm_head = match heads.iter().find(|h| w.contains(h)) {
            Some(h) => w.get(h, &shape)?,
            None => {
                let mut other: Vec<&str> = w
                    .names()
                    .filter(|n| n.ends_with("lm_head.weight"))
                    .collect();
                other.sort_unstable();
                if let Some(found) = other.first() {
                    return Err(problem(ModelProblem::UnknownLmHead {
                        found: found.to_string(),
                        tried: heads.iter().map(|h| h.to_string()).collect(),
                    }));
                }
                table.clone()
            }
        };
        let mut embed = table;
        if let Some(s) = scale {
            scale_rows(&mut embed, s, w.dtype(embed_name));
        }
        Ok(Frozen { embed, lm_head })
    }
}

/// `rows · scale` in the arithmetic of the rows' stored dtype (what transformers'
/// `*ScaledWordEmbedding` computes: `embedding(ids) * embed_scale.to(weight.dtype)`).
fn scale_rows(rows: &mut [f32], scale: f32, dtype: Option<safetensors::Dtype>) {
    use half::{bf16, f16};
    match dtype {
        Some(safetensors::Dtype::BF16) => {
            let s = bf16::from_f32(scale).to_f32();
            rows.iter_mut()
                .for_each(|x| *x = bf16::from_f32(*x * s).to_f32());
        }
        Some(safetensors::Dtype::F16) => {
            let s = f16::from_f32(scale).to_f32();
            rows.iter_mut()
                .for_each(|x| *x = f16::from_f32(*x * s).to_f32());
        }
        _ => rows.iter_mut().for_each(|x| *x *= scale),
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

pub use crate::collective::reduce_slots;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::weights::{ModelProblem, Weights};
    use std::path::Path;

    /// Tiny random checkpoints made by transformers, and what transformers' own modules
    /// give for them: `embeds` = `get_input_embeddings()(every id)` and `lm_head` =
    /// `get_output_embeddings().weight`, both as f32, of the model loaded back from the
    /// checkpoint in its dtype (as the torch engine loads a target). Hidden 48: Gemma's
    /// scale sqrt(48) is not a power of two, so its rounding to bf16 shows.
    const MAKE: &str = r#"
import sys, torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
torch.manual_seed(0)
out = sys.argv[1]
text = dict(vocab_size=512, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=64, max_position_embeddings=512)
linear = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
models = {
    "gemma3_text_f32": (AutoModelForCausalLM, AutoConfig.for_model("gemma3_text", tie_word_embeddings=True, **text), torch.float32),
    "gemma3_text_bf16": (AutoModelForCausalLM, AutoConfig.for_model("gemma3_text", tie_word_embeddings=False, **text), torch.bfloat16),
    "gemma3": (AutoModelForImageTextToText, AutoConfig.for_model("gemma3", text_config=text,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=500, boi_token_index=501, eoi_token_index=502), torch.float32),
    "qwen3_5": (AutoModelForImageTextToText, AutoConfig.for_model("qwen3_5", text_config=dict(text, **linear),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                           num_position_embeddings=16),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503), torch.float32),
}
for name, (auto, cfg, dtype) in models.items():
    m = auto.from_config(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    m.to(dtype).save_pretrained(f"{out}/{name}")
    t = AutoModelForCausalLM.from_pretrained(f"{out}/{name}", dtype=dtype).eval()
    with torch.no_grad():
        embeds = t.get_input_embeddings()(torch.arange(512)[None])[0]
    save_file({"embeds": embeds.float().contiguous(),
               "lm_head": t.get_output_embeddings().weight.float().contiguous()}, f"{out}/{name}/ref.safetensors")
"#;

    fn python_has_torch() -> bool {
        let ok = std::process::Command::new("python3")
            .args(["-c", "import torch, transformers, safetensors"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            assert!(
                std::env::var_os("CI").is_none(),
                "python3 with torch and transformers is missing: under CI this test may not skip"
            );
            eprintln!("skipping: python3 with torch and transformers is not installed");
        }
        ok
    }

    fn reference(dir: &Path, name: &str) -> Vec<f32> {
        let bytes = std::fs::read(dir.join("ref.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.shape(), [512, 48]);
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// Largest |a - b| over the table.
    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn the_frozen_embedding_is_what_transformers_embeds_with() {
        if !python_has_torch() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let o = std::process::Command::new("python3")
            .args(["-c", MAKE])
            .arg(tmp.path())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        for (name, scaled) in [
            ("gemma3_text_f32", true),
            ("gemma3_text_bf16", true),
            ("gemma3", true),
            ("qwen3_5", false),
        ] {
            let dir = tmp.path().join(name);
            let w = Weights::open(&dir).unwrap();
            let f = Frozen::load(&w, 512, 48).unwrap();
            let (embeds, head) = (reference(&dir, "embeds"), reference(&dir, "lm_head"));
            // Bit for bit: the same products, rounded as transformers rounds them.
            assert_eq!(max_diff(&f.embed, &embeds), 0.0, "{name}: embedding");
            assert_eq!(max_diff(&f.lm_head, &head), 0.0, "{name}: lm_head");
            // The scale is there (or not), and the lm_head is the stored table.
            let stored = Frozen::load_scaled(&w, 512, 48, None).unwrap();
            assert_eq!(stored.lm_head, f.lm_head, "{name}");
            assert_eq!(max_diff(&stored.embed, &embeds) > 0.1, scaled, "{name}");
            if name == "gemma3_text_bf16" {
                // The scale rounded to bf16 matters: the f32 scale's products differ.
                let s = 48f32.sqrt();
                let unrounded: Vec<f32> = stored
                    .embed
                    .iter()
                    .map(|x| half::bf16::from_f32(x * s).to_f32())
                    .collect();
                assert!(max_diff(&unrounded, &embeds) > 0.0, "{name}");
            }
        }
    }

    /// A checkpoint of `tensors` (f32, shape [4, 2] each) beside a Qwen3-shaped config.
    fn checkpoint(dir: &Path, tensors: &[&str]) -> Weights {
        let config = r#"{"model_type": "qwen3_5_text", "hidden_size": 2, "num_hidden_layers": 1,
            "num_attention_heads": 1, "head_dim": 2, "vocab_size": 4}"#;
        std::fs::write(dir.join("config.json"), config).unwrap();
        let bytes: Vec<u8> = (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let views = tensors.iter().map(|n| {
            let v =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4, 2], &bytes);
            (*n, v.unwrap())
        });
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        Weights::open(dir).unwrap()
    }

    #[test]
    fn an_embedding_or_lm_head_under_an_unknown_name_is_a_typed_error() {
        let tmp = tempfile::tempdir().unwrap();
        let w = checkpoint(tmp.path(), &["transformer.wte.weight"]);
        let e = Frozen::load(&w, 4, 2).err().unwrap();
        let ModelProblem::NoEmbedding { tried, shape } = &e.problem else {
            panic!("{e}");
        };
        assert_eq!(shape, &[4, 2]);
        assert_eq!(tried.len(), EMBEDDINGS.len());
        for (name, _) in EMBEDDINGS {
            assert!(e.to_string().contains(name), "{e}");
        }
        // An lm_head this tool does not know is refused, not replaced by the embedding.
        let tmp = tempfile::tempdir().unwrap();
        let w = checkpoint(
            tmp.path(),
            &[
                "language_model.model.embed_tokens.weight",
                "text.lm_head.weight",
            ],
        );
        let e = Frozen::load(&w, 4, 2).err().unwrap();
        assert!(
            matches!(&e.problem, ModelProblem::UnknownLmHead { found, .. } if found == "text.lm_head.weight"),
            "{e}"
        );
        // Found under the nested names, the lm_head beside the embedding first.
        let tmp = tempfile::tempdir().unwrap();
        let w = checkpoint(
            tmp.path(),
            &["model.language_model.embed_tokens.weight", "lm_head.weight"],
        );
        let f = Frozen::load(&w, 4, 2).unwrap();
        assert_eq!(f.embed, (0..8).map(|i| i as f32).collect::<Vec<_>>());
        assert_eq!(f.lm_head, f.embed);
        // The wrong shape is the shape error, naming the tensor.
        let e = Frozen::load(&w, 8, 1).err().unwrap();
        assert!(
            e.to_string()
                .contains("model.language_model.embed_tokens.weight has shape [4, 2]"),
            "{e}"
        );
    }
}
