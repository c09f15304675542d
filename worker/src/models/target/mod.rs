//! The frozen target: a Qwen3, Qwen3-MoE or Llama decoder run forward only, up to its last
//! tapped layer, returning the residual stream after each tapped layer (HF `hidden_states[id+1]`,
//! before the final norm) concatenated on the feature axis.

use std::path::Path;

use dflash_shared::model_config::TargetConfig;

use super::weights::{ModelError, ModelProblem, Weights};
use crate::math::rope_inv_freq;

pub mod device;

pub use dflash_shared::model_config::expected_tensors;

pub(crate) struct Layer {
    pub(crate) ln1: Vec<f32>,
    pub(crate) ln2: Vec<f32>,
    pub(crate) wq: Vec<f32>,
    pub(crate) wk: Vec<f32>,
    pub(crate) wv: Vec<f32>,
    pub(crate) wo: Vec<f32>,
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) mlp: Mlp,
}

/// A SwiGLU MLP's projections: `down(silu(gate·x) ⊙ up·x)`.
pub(crate) struct Swiglu {
    pub(crate) gate: Vec<f32>,
    pub(crate) up: Vec<f32>,
    pub(crate) down: Vec<f32>,
}

impl Swiglu {
    fn len(&self) -> usize {
        self.gate.len() + self.up.len() + self.down.len()
    }
}

/// A layer's MLP: dense, or (Qwen3-MoE's sparse layers) the router `[experts, hidden]` and
/// the experts ([`dflash_shared::model_config::Moe`]).
pub(crate) enum Mlp {
    Dense(Swiglu),
    Sparse {
        router: Vec<f32>,
        experts: Vec<Swiglu>,
    },
}

impl Mlp {
    fn len(&self) -> usize {
        match self {
            Mlp::Dense(s) => s.len(),
            Mlp::Sparse { router, experts } => {
                router.len() + experts.iter().map(Swiglu::len).sum::<usize>()
            }
        }
    }
}

/// How much of a checkpoint [`Target::load_as`] reads into host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Load {
    /// Every tensor widened to f32 (the CPU target computes with them).
    F32,
    /// Only the norm weights; the embedding and the projections stay in the checkpoint's
    /// mapping, for a device to copy as bf16 straight from it (an 8B model would be 32 GB of
    /// f32 on the host otherwise). Such a target has no host forward.
    Mapped,
}

/// The embedding's tensor name.
pub(crate) const EMBED: &str = "model.embed_tokens.weight";

/// The name of layer `l`'s matrix `m` (`self_attn.q_proj`, `mlp.down_proj`, ...).
pub(crate) fn matrix_name(l: usize, m: &str) -> String {
    format!("model.layers.{l}.{m}.weight")
}

impl Target {
    /// Bytes of weights this target holds in host memory.
    pub fn host_weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.ln1, &l.ln2, &l.wq, &l.wk, &l.wv, &l.wo]
                    .iter()
                    .map(|v| v.len())
                    .sum::<usize>()
                    + l.mlp.len()
                    + l.q_norm.as_ref().map_or(0, Vec::len)
                    + l.k_norm.as_ref().map_or(0, Vec::len)
            })
            .sum();
        (l + self.embed.len()) * 4
    }
}

/// What follows the last layer: the final RMSNorm and the lm_head `[vocab, hidden]` (the
/// embedding again when the target ties them), f32.
pub struct Head {
    pub norm: Vec<f32>,
    pub lm_head: Vec<f32>,
}

pub struct Target {
    pub cfg: TargetConfig,
    pub taps: Vec<usize>,
    pub(crate) embed: Vec<f32>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) inv_freq: Vec<f32>,
    /// Rotary cos/sin scale (YaRN's attention factor; else 1).
    pub(crate) rope_scale: f32,
    /// With [`Load::Mapped`]: the checkpoint, where the embedding and the projection
    /// matrices (empty in `embed` and `layers`) are read from.
    pub(crate) mapped: Option<Weights>,
}

impl Target {
    /// Load the layers needed for `taps` (all tensors of the checkpoint are checked).
    pub fn load(dir: &Path, taps: &[usize]) -> Result<Target, ModelError> {
        Target::load_as(dir, taps, Load::F32)
    }

    /// [`load`](Self::load), keeping in host memory what `how` says.
    pub fn load_as(dir: &Path, taps: &[usize], how: Load) -> Result<Target, ModelError> {
        Target::load_layers(dir, taps, how, false)
    }

    /// Every layer (not only those up to the last tap) in f32, and the final norm and
    /// lm_head: what decoding needs (`dflash-supervise eval`).
    pub fn load_decoder(dir: &Path, taps: &[usize]) -> Result<(Target, Head), ModelError> {
        let t = Target::load_layers(dir, taps, Load::F32, true)?;
        let w = Weights::open(dir)?;
        let (v, h) = (t.cfg.vocab_size, t.cfg.hidden_size);
        let norm = w.get("model.norm.weight", &[h])?;
        let lm_head = match t.cfg.tie_word_embeddings {
            true => t.embed.clone(),
            false => w.get("lm_head.weight", &[v, h])?,
        };
        Ok((t, Head { norm, lm_head }))
    }

    /// The layers up to the last tap, or all of them when `every`.
    fn load_layers(
        dir: &Path,
        taps: &[usize],
        how: Load,
        every: bool,
    ) -> Result<Target, ModelError> {
        let cfg = TargetConfig::load(dir).map_err(|e| ModelError {
            path: e.path,
            problem: e.problem.into(),
        })?;
        let w = Weights::open(dir)?;
        if let Some(&bad) = taps.iter().find(|&&t| t >= cfg.num_hidden_layers) {
            return Err(ModelError {
                path: dir.display().to_string(),
                problem: ModelProblem::NoSuchTap {
                    tap: bad,
                    layers: cfg.num_hidden_layers,
                },
            });
        }
        let all = expected_tensors(&cfg, cfg.num_hidden_layers);
        check_tensors(dir, &w, &all)?;
        let shapes: std::collections::HashMap<&str, &[usize]> = all
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        let shape = |name: &str| shapes.get(name).copied().unwrap_or_default();
        let get = |name: &str| w.get(name, shape(name));
        // A matrix a device reads from the mapping: checked here (shape, dtype), not read.
        let big = |name: &str| -> Result<Vec<f32>, ModelError> {
            match how {
                Load::F32 => get(name),
                Load::Mapped => w.raw(name, shape(name)).map(|_| Vec::new()),
            }
        };
        let last = match every {
            true => cfg.num_hidden_layers - 1,
            false => taps.iter().copied().max().unwrap_or(0),
        };
        let layers = (0..=last)
            .map(|l| load_layer(&cfg, l, &get, &big))
            .collect::<Result<Vec<Layer>, ModelError>>()?;
        let embed = big(EMBED)?;
        let inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling.as_ref());
        let rope_scale = cfg
            .rope_scaling
            .as_ref()
            .map_or(1.0, |s| s.attention_factor()) as f32;
        let mapped = (how == Load::Mapped).then_some(w);
        Ok(Target {
            cfg,
            taps: taps.to_vec(),
            embed,
            layers,
            inv_freq,
            rope_scale,
            mapped,
        })
    }
}

/// Every tensor of `all` in the checkpoint `w` (of `dir`), and none it does not name but
/// those loaders ignore.
fn check_tensors(dir: &Path, w: &Weights, all: &[(String, Vec<usize>)]) -> Result<(), ModelError> {
    if let Some((name, shape)) = all.iter().find(|(n, _)| !w.contains(n)) {
        return Err(ModelError {
            path: dir.display().to_string(),
            problem: ModelProblem::MissingTensor {
                name: name.clone(),
                shape: shape.clone(),
            },
        });
    }
    let known: std::collections::HashSet<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    w.check_no_extra(&|n: &str| {
        known.contains(n) || dflash_shared::model_config::is_ignorable_tensor(n)
    })
}

type Getter<'a> = dyn Fn(&str) -> Result<Vec<f32>, ModelError> + 'a;

/// Layer `l` of a `cfg` model: its norms read with `g` (f32), its matrices with `b` (f32,
/// or left in the checkpoint's mapping).
fn load_layer(cfg: &TargetConfig, l: usize, g: &Getter, b: &Getter) -> Result<Layer, ModelError> {
    let p = format!("model.layers.{l}");
    let g = |s: &str| g(&format!("{p}.{s}"));
    let b = |s: &str| b(&format!("{p}.{s}"));
    let swiglu = |m: &str| -> Result<Swiglu, ModelError> {
        Ok(Swiglu {
            gate: b(&format!("{m}.gate_proj.weight"))?,
            up: b(&format!("{m}.up_proj.weight"))?,
            down: b(&format!("{m}.down_proj.weight"))?,
        })
    };
    let mlp = match cfg.sparse(l) {
        None => Mlp::Dense(swiglu("mlp")?),
        Some(m) => Mlp::Sparse {
            router: b("mlp.gate.weight")?,
            experts: (0..m.num_experts)
                .map(|e| swiglu(&format!("mlp.experts.{e}")))
                .collect::<Result<_, _>>()?,
        },
    };
    let qk = cfg.arch.has_qk_norm();
    Ok(Layer {
        ln1: g("input_layernorm.weight")?,
        ln2: g("post_attention_layernorm.weight")?,
        wq: b("self_attn.q_proj.weight")?,
        wk: b("self_attn.k_proj.weight")?,
        wv: b("self_attn.v_proj.weight")?,
        wo: b("self_attn.o_proj.weight")?,
        q_norm: qk.then(|| g("self_attn.q_norm.weight")).transpose()?,
        k_norm: qk.then(|| g("self_attn.k_norm.weight")).transpose()?,
        mlp,
    })
}
