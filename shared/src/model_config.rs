//! The target model's `config.json` (Hugging Face format), for the Qwen3, Qwen3-MoE and
//! Llama architectures, and the tap convention. Both the supervisor (to size hidden-state
//! slots and stamp the capture spec) and the worker (to build the model) read it here.

use std::path::Path;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arch {
    Qwen3,
    Llama,
    /// Qwen3's attention with a mixture-of-experts MLP in the sparse layers ([`Moe`]).
    Qwen3Moe,
    /// Any other architecture transformers implements (gpt-oss, Qwen3.5, GLM, DeepSeek-V3,
    /// ...): run by the torch target engine only ([`TargetConfig::read_any`]).
    Transformers,
}

impl Arch {
    /// Whether the attention RMS-normalises each head's queries and keys (Qwen3's
    /// `q_norm`/`k_norm`).
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe)
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Arch::Qwen3 => "Qwen3",
            Arch::Llama => "Llama",
            Arch::Qwen3Moe => "Qwen3-MoE",
            Arch::Transformers => "transformers",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3 frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: frequencies blended between interpolated and original by a linear ramp over
    /// the dimensions, and cos/sin scaled by `attention_factor` (resolved from `factor`,
    /// `mscale` and `mscale_all_dim` as transformers does when the config omits it).
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
}

impl RopeScaling {
    /// What rotary embeddings multiply cos and sin by (1 but for YaRN).
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    /// The context length the target was trained for (`None` when config.json omits it).
    /// Not part of the [`TargetConfig::fingerprint`]: it changes no computation.
    #[serde(skip)]
    pub max_position_embeddings: Option<usize>,
    /// The mixture of experts of a Qwen3-MoE target (`None`: every layer dense). Left out
    /// of the serialised form when `None`, so a dense target's fingerprint is unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<Moe>,
    /// config.json's `model_type` (what names an [`Arch::Transformers`] target).
    #[serde(skip)]
    pub model_type: String,
    /// What the target's input embedding module multiplies the rows it looks up by
    /// (Gemma's `sqrt(hidden_size)`, MiniCPM3's `scale_emb`; `embed_scale`), as an f32
    /// as transformers holds it; `None`: the rows as stored. The drafter's frozen
    /// embedding is the scaled one (what `get_input_embeddings()(ids)` returns), its
    /// lm_head the unscaled weight. Left out of the serialised form when `None`, so the
    /// fingerprint of a target without one is unchanged and older saved configs read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embed_scale: Option<f32>,
}

/// A Qwen3-MoE target's sparse MLP: per token, the router's softmax over `num_experts`,
/// the `num_experts_per_tok` most probable experts (their probabilities renormalised to sum
/// to 1 when `norm_topk_prob`), and the sum of those experts' SwiGLU MLPs (width
/// `moe_intermediate_size`) weighted by them. Layers in `dense_layers` have the dense MLP
/// of width `intermediate_size` instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Moe {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    /// The dense layers, ascending: those of `mlp_only_layers` and those off the
    /// `decoder_sparse_step` grid (layer `l` is sparse when `(l + 1) % step == 0`).
    pub dense_layers: Vec<usize>,
}

impl TargetConfig {
    /// The target in one line: the architecture, depth and width, and for a mixture of
    /// experts its experts, top-k, expert width and dense layers.
    pub fn describe(&self) -> String {
        let arch = match self.arch {
            Arch::Transformers => format!("{} (transformers)", self.model_type),
            a => a.to_string(),
        };
        let mut s = format!(
            "{arch}, {} layers, hidden {}",
            self.num_hidden_layers, self.hidden_size
        );
        if let Some(m) = &self.moe {
            s.push_str(&format!(
                "; {} experts, {} per token ({}), expert width {}, dense layers {:?}",
                m.num_experts,
                m.num_experts_per_tok,
                if m.norm_topk_prob {
                    "weights renormalised"
                } else {
                    "softmax weights"
                },
                m.moe_intermediate_size,
                m.dense_layers
            ));
        }
        s
    }

    /// The mixture of experts of layer `l`, if that layer is sparse.
    pub fn sparse(&self, l: usize) -> Option<&Moe> {
        self.moe
            .as_ref()
            .filter(|m| m.dense_layers.binary_search(&l).is_err())
    }
}

/// The largest value config.json's size fields may take: generous for any published model,
/// but finite, so that a typo (or a hostile file) is refused before anything is sized by it
/// (the list of expected tensors holds one entry per layer, the memory estimate multiplies
/// these together).
pub const SIZE_LIMITS: &[(&str, u64)] = &[
    ("num_hidden_layers", 1024),
    ("hidden_size", 131_072),
    ("intermediate_size", 1 << 20),
    ("num_attention_heads", 4096),
    ("num_key_value_heads", 4096),
    ("head_dim", 4096),
    ("vocab_size", 1 << 24),
    ("max_position_embeddings", 1 << 27),
    ("num_experts", 4096),
    ("num_local_experts", 4096),
    ("num_experts_per_tok", 4096),
    ("moe_intermediate_size", 1 << 20),
    ("decoder_sparse_step", 1024),
];

/// What is wrong with a config.json: the field, the value read and what was expected. Each
/// prints as one line (the file's path is [`ConfigError`]'s).
#[derive(Debug, thiserror::Error)]
pub enum ConfigProblem {
    #[error("cannot read: {source} (expected a Hugging Face model directory with config.json)")]
    Unreadable { source: std::io::Error },
    #[error("not valid JSON: {source}")]
    Json { source: serde_json::Error },
    #[error("unsupported architecture {architectures:?} (model_type {model_type:?}); expected Qwen3ForCausalLM, Qwen3MoeForCausalLM or LlamaForCausalLM")]
    Architecture {
        architectures: Vec<String>,
        model_type: String,
    },
    #[error("{field} {value} is out of range (expected 1 to {max})")]
    OutOfRange {
        field: &'static str,
        value: serde_json::Value,
        max: u64,
    },
    #[error("{field} is missing or not a positive integer")]
    NotPositiveInteger { field: &'static str },
    #[error("{field} is missing or not a positive number")]
    NotPositiveNumber { field: &'static str },
    #[error("{field} is not true or false")]
    NotBool { field: &'static str },
    #[error("num_experts {a} and num_local_experts {b} disagree (expected one expert count)")]
    ExpertCounts { a: u64, b: u64 },
    #[error("num_experts_per_tok {top_k} is larger than num_experts {experts} (expected 1 to {experts} experts per token)")]
    TopK { top_k: usize, experts: usize },
    #[error(
        "mlp_only_layers {value} is not a list of layer indices below num_hidden_layers {layers}"
    )]
    MlpOnlyLayers {
        value: serde_json::Value,
        layers: usize,
    },
    #[error("num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")]
    KvHeads { heads: usize, kv_heads: usize },
    #[error("hidden_size {hidden_size} is not a multiple of num_attention_heads {heads}")]
    HeadDim { hidden_size: usize, heads: usize },
    #[error("head_dim {head_dim} is odd; rotary embeddings need an even head_dim")]
    OddHeadDim { head_dim: usize },
    /// A setting that changes the math these models compute: `setting` as config.json
    /// says it, and what is supported instead.
    #[error("{setting} is not supported (expected {expected})")]
    Unsupported {
        setting: String,
        expected: &'static str,
    },
    #[error("rope_parameters.{layer_type} differs from rope_parameters.full_attention (expected one set of rotary parameters)")]
    RopePerLayerType { layer_type: String },
    #[error("rope_parameters holds no rope_type or rope_theta and no full_attention entry (expected the rotary parameters)")]
    RopeNoFullAttention,
    #[error("rope_theta {top} and rope_parameters.rope_theta {nested} disagree")]
    RopeThetaDisagree { top: f64, nested: f64 },
    #[error("both rope_scaling and rope_parameters are set, and they differ (expected one of the two layouts)")]
    RopeLayouts,
    #[error("rope_parameters is not an object")]
    RopeParametersNotObject,
    #[error("{field} is not a positive number")]
    ThetaNotPositive { field: &'static str },
    #[error("{field} is not a number")]
    ThetaNotNumber { field: &'static str },
    /// `scaling` is `rope_scaling` or `rope_parameters`, whichever layout the file uses.
    #[error("{scaling}.{field} is missing")]
    ScalingMissing {
        scaling: &'static str,
        field: &'static str,
    },
    #[error(
        "{scaling}.original_max_position_embeddings is missing (and so is max_position_embeddings)"
    )]
    ScalingOriginalMissing { scaling: &'static str },
    #[error("{scaling}.rope_type {rope_type:?} is not supported (expected default, linear, llama3 or yarn)")]
    ScalingType {
        scaling: &'static str,
        rope_type: String,
    },
}

/// A size field of config.json above its [`SIZE_LIMITS`] entry: the field, its value and
/// the accepted range.
fn check_sizes(v: &serde_json::Value) -> Result<(), ConfigProblem> {
    for &(field, max) in SIZE_LIMITS {
        let Some(x) = v.get(field).filter(|x| x.is_number()) else {
            continue;
        };
        let above = match x.as_u64() {
            Some(n) => n > max,
            // A float or a negative number: out of range if it is above the bound; the
            // field's own parsing refuses whatever else is not a positive integer.
            None => x.as_f64().is_some_and(|f| f > max as f64),
        };
        if above {
            return Err(ConfigProblem::OutOfRange {
                field,
                value: x.clone(),
                max,
            });
        }
    }
    Ok(())
}

/// What config.json may say that changes the math these models compute: refused, never
/// ignored.
fn refuse_unsupported(v: &serde_json::Value) -> Result<(), ConfigProblem> {
    let unsupported = |setting: String, expected| ConfigProblem::Unsupported { setting, expected };
    if v["attention_bias"].as_bool() == Some(true) || v["mlp_bias"].as_bool() == Some(true) {
        return Err(unsupported(
            "attention_bias/mlp_bias = true".into(),
            "bias-free projections",
        ));
    }
    if let Some(act) = v["hidden_act"].as_str().or(v["hidden_activation"].as_str()) {
        if act != "silu" && act != "swish" {
            return Err(unsupported(format!("hidden_act {act:?}"), "silu"));
        }
    }
    if v["partial_rotary_factor"]
        .as_f64()
        .is_some_and(|p| p != 1.0)
        || v["rope_parameters"]["partial_rotary_factor"]
            .as_f64()
            .is_some_and(|p| p != 1.0)
    {
        return Err(unsupported(
            "partial_rotary_factor other than 1".into(),
            "rotary embeddings over the whole head",
        ));
    }
    if v["use_sliding_window"].as_bool() == Some(true) {
        return Err(unsupported(
            "use_sliding_window = true".into(),
            "full causal attention in every layer",
        ));
    }
    Ok(())
}

/// Settings of other mixture-of-experts families that change what a layer computes
/// (shared experts, grouped or biased routing, scaled routing weights, dense leading
/// layers): refused in a Qwen3-MoE config unless they hold the value that means "none".
fn refuse_unsupported_moe(v: &serde_json::Value) -> Result<(), ConfigProblem> {
    let unsupported = |setting: String, expected| ConfigProblem::Unsupported { setting, expected };
    for key in [
        "shared_expert_intermediate_size",
        "n_shared_experts",
        "num_shared_experts",
        "first_k_dense_replace",
    ] {
        if v[key].as_f64().is_some_and(|x| x != 0.0) {
            return Err(unsupported(
                format!("{key} {}", v[key]),
                "0 (Qwen3-MoE: routed experts only, sparse layers as decoder_sparse_step and mlp_only_layers say)",
            ));
        }
    }
    for key in [
        "n_group",
        "topk_group",
        "moe_layer_freq",
        "routed_scaling_factor",
    ] {
        if v[key].as_f64().is_some_and(|x| x != 1.0) {
            return Err(unsupported(
                format!("{key} {}", v[key]),
                "1 (Qwen3-MoE routing: one group, unscaled weights, decoder_sparse_step)",
            ));
        }
    }
    for (key, plain) in [("scoring_func", "softmax"), ("topk_method", "greedy")] {
        if let Some(x) = v[key].as_str().filter(|x| *x != plain) {
            return Err(unsupported(
                format!("{key} {x:?}"),
                "Qwen3-MoE's softmax top-k",
            ));
        }
    }
    for key in [
        "router_bias",
        "moe_router_bias",
        "mlp_bias",
        "attention_bias",
    ] {
        if v[key].as_bool() == Some(true) {
            return Err(unsupported(
                format!("{key} = true"),
                "bias-free projections",
            ));
        }
    }
    Ok(())
}

/// The mixture of experts of a Qwen3-MoE config.json (`v`, of a model of `layers` layers):
/// transformers 4 writes `num_experts`, transformers 5 may write `num_local_experts`.
fn moe(v: &serde_json::Value, layers: usize) -> Result<Moe, ConfigProblem> {
    refuse_unsupported_moe(v)?;
    let num = |field: &'static str| -> Result<usize, ConfigProblem> {
        v[field]
            .as_u64()
            .map(|n| n as usize)
            .filter(|&n| n > 0)
            .ok_or(ConfigProblem::NotPositiveInteger { field })
    };
    // transformers' defaults where a field is absent (Qwen3MoeConfig).
    let num_or = |field: &'static str, default: usize| match v.get(field) {
        None | Some(serde_json::Value::Null) => Ok(default),
        Some(_) => num(field),
    };
    let num_experts = match (v["num_experts"].as_u64(), v["num_local_experts"].as_u64()) {
        (Some(a), Some(b)) if a != b => return Err(ConfigProblem::ExpertCounts { a, b }),
        (_, Some(_)) if v["num_experts"].is_null() => num("num_local_experts")?,
        _ => num_or("num_experts", 128)?,
    };
    let num_experts_per_tok = num_or("num_experts_per_tok", 8)?;
    if num_experts_per_tok > num_experts {
        return Err(ConfigProblem::TopK {
            top_k: num_experts_per_tok,
            experts: num_experts,
        });
    }
    let norm_topk_prob = match &v["norm_topk_prob"] {
        serde_json::Value::Null => false,
        x => x.as_bool().ok_or(ConfigProblem::NotBool {
            field: "norm_topk_prob",
        })?,
    };
    let step = num_or("decoder_sparse_step", 1)?;
    let only = &v["mlp_only_layers"];
    let bad = || ConfigProblem::MlpOnlyLayers {
        value: only.clone(),
        layers,
    };
    let only: Vec<usize> = match only {
        serde_json::Value::Null => Vec::new(),
        serde_json::Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .map(|l| l as usize)
                    .filter(|&l| l < layers)
                    .ok_or_else(bad)
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(bad()),
    };
    Ok(Moe {
        num_experts,
        num_experts_per_tok,
        moe_intermediate_size: num_or("moe_intermediate_size", 768)?,
        norm_topk_prob,
        dense_layers: (0..layers)
            .filter(|l| only.contains(l) || (l + 1) % step != 0)
            .collect(),
    })
}

/// The rotary settings of config.json (its `v`): theta and the scaling, from either
/// transformers layout.
fn rope(v: &serde_json::Value) -> Result<(f64, Option<RopeScaling>), ConfigProblem> {
    // transformers 5 writes the rotary settings under `rope_parameters` (rope_theta,
    // rope_type and the scaling fields together); transformers 4 writes a top-level
    // `rope_theta` and a `rope_scaling` object. Either layout, never a silent default.
    let mut rp = &v["rope_parameters"];
    // transformers 5 may key rope_parameters by layer type; these models have full
    // attention only, so one set of parameters, and every layer type must agree.
    if let Some(full) = rp.get("full_attention").filter(|f| f.is_object()) {
        if let Some((k, _)) = rp
            .as_object()
            .into_iter()
            .flatten()
            .find(|(_, p)| *p != full)
        {
            return Err(ConfigProblem::RopePerLayerType {
                layer_type: k.clone(),
            });
        }
        rp = full;
    } else if rp
        .as_object()
        .is_some_and(|o| !o.is_empty() && o.values().all(|x| x.is_object()))
    {
        return Err(ConfigProblem::RopeNoFullAttention);
    }
    let (theta_field, scaling_field, scaling) = if rp.is_object() {
        if let (Some(a), Some(b)) = (v["rope_theta"].as_f64(), rp["rope_theta"].as_f64()) {
            if a != b {
                return Err(ConfigProblem::RopeThetaDisagree { top: a, nested: b });
            }
        }
        if !v["rope_scaling"].is_null() && v["rope_scaling"] != *rp {
            return Err(ConfigProblem::RopeLayouts);
        }
        ("rope_parameters.rope_theta", "rope_parameters", rp)
    } else if !rp.is_null() {
        return Err(ConfigProblem::RopeParametersNotObject);
    } else {
        ("rope_theta", "rope_scaling", &v["rope_scaling"])
    };
    let rope_theta = match if rp.is_object() {
        rp["rope_theta"].as_f64().or(v["rope_theta"].as_f64())
    } else {
        v["rope_theta"].as_f64()
    } {
        Some(t) if t > 0.0 => t,
        Some(_) => {
            return Err(ConfigProblem::ThetaNotPositive { field: theta_field });
        }
        // transformers' default for both Qwen3Config and LlamaConfig.
        None if v["rope_theta"].is_null() && rp["rope_theta"].is_null() => 10000.0,
        None => return Err(ConfigProblem::ThetaNotNumber { field: theta_field }),
    };
    let rope_scaling = match scaling {
        serde_json::Value::Null => None,
        s => scaling_of(s, v, scaling_field)?,
    };
    Ok((rope_theta, rope_scaling))
}

/// The rotary scaling object `s` of config.json `v` (`scaling_field` names it in errors):
/// `None` for the default (unscaled) rotary embeddings.
fn scaling_of(
    s: &serde_json::Value,
    v: &serde_json::Value,
    scaling_field: &'static str,
) -> Result<Option<RopeScaling>, ConfigProblem> {
    let kind = s["rope_type"]
        .as_str()
        .or(s["type"].as_str())
        .unwrap_or("default");
    let f = |field: &'static str| {
        s[field].as_f64().ok_or(ConfigProblem::ScalingMissing {
            scaling: scaling_field,
            field,
        })
    };
    Ok(match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: f("factor")?,
        }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: f("factor")?,
            low_freq_factor: f("low_freq_factor")?,
            high_freq_factor: f("high_freq_factor")?,
            original_max_position_embeddings: f("original_max_position_embeddings")?,
        }),
        "yarn" => Some(yarn(s, v, scaling_field, f("factor")?)?),
        other => {
            return Err(ConfigProblem::ScalingType {
                scaling: scaling_field,
                rope_type: other.to_string(),
            })
        }
    })
}

/// YaRN scaling by `factor`, its other fields from `s` (transformers' defaults where
/// absent).
fn yarn(
    s: &serde_json::Value,
    v: &serde_json::Value,
    scaling_field: &'static str,
    factor: f64,
) -> Result<RopeScaling, ConfigProblem> {
    let original = match s["original_max_position_embeddings"]
        .as_f64()
        .or(v["max_position_embeddings"].as_f64())
    {
        Some(o) if o > 0.0 => o,
        _ => {
            return Err(ConfigProblem::ScalingOriginalMissing {
                scaling: scaling_field,
            })
        }
    };
    let opt = |k: &str| s[k].as_f64().filter(|x| *x != 0.0);
    let mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention_factor = match (
        opt("attention_factor"),
        opt("mscale"),
        opt("mscale_all_dim"),
    ) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) => mscale(factor, m) / mscale(factor, all),
        _ => mscale(factor, 1.0),
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: opt("beta_fast").unwrap_or(32.0),
        beta_slow: opt("beta_slow").unwrap_or(1.0),
        attention_factor,
        truncate: s["truncate"].as_bool().unwrap_or(true),
    })
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {problem}")]
pub struct ConfigError {
    pub path: String,
    pub problem: ConfigProblem,
}

impl TargetConfig {
    pub fn load(dir: &Path) -> Result<TargetConfig, ConfigError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError {
            path: path.display().to_string(),
            problem: ConfigProblem::Unreadable { source },
        })?;
        TargetConfig::read(&text).map_err(|problem| ConfigError {
            path: path.display().to_string(),
            problem,
        })
    }

    /// The config of a config.json's text, or what is wrong with it.
    pub fn read(text: &str) -> Result<TargetConfig, ConfigProblem> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|source| ConfigProblem::Json { source })?;
        let archs: Vec<&str> = v["architectures"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str())
            .collect();
        let model_type = v["model_type"].as_str().unwrap_or("");
        let arch = if archs.contains(&"Qwen3MoeForCausalLM") || model_type == "qwen3_moe" {
            Arch::Qwen3Moe
        } else if archs.contains(&"Qwen3ForCausalLM") || model_type == "qwen3" {
            Arch::Qwen3
        } else if archs.contains(&"LlamaForCausalLM") || model_type == "llama" {
            Arch::Llama
        } else {
            return Err(ConfigProblem::Architecture {
                architectures: archs.iter().map(|a| a.to_string()).collect(),
                model_type: model_type.to_string(),
            });
        };
        check_sizes(&v)?;
        let num = |field: &'static str| -> Result<usize, ConfigProblem> {
            v[field]
                .as_u64()
                .map(|n| n as usize)
                .filter(|&n| n > 0)
                .ok_or(ConfigProblem::NotPositiveInteger { field })
        };
        let float = |field: &'static str, default: Option<f64>| -> Result<f64, ConfigProblem> {
            match (v[field].as_f64(), default) {
                (Some(x), _) if x > 0.0 => Ok(x),
                (None, Some(d)) if v[field].is_null() => Ok(d),
                _ => Err(ConfigProblem::NotPositiveNumber { field }),
            }
        };
        let hidden_size = num("hidden_size")?;
        let heads = num("num_attention_heads")?;
        // Absent fields take transformers' defaults for the architecture: Qwen3Config's are
        // num_key_value_heads 32 and head_dim 128; Qwen3MoeConfig's 4 key-value heads and
        // hidden_size / num_attention_heads; LlamaConfig's are the attention heads and
        // hidden_size / num_attention_heads. An explicit null means the attention heads.
        let kv_heads = match (v.get("num_key_value_heads"), arch) {
            (None, Arch::Qwen3) => 32,
            (None, Arch::Qwen3Moe) => 4,
            (None | Some(serde_json::Value::Null), _) => heads,
            _ => num("num_key_value_heads")?,
        };
        if heads % kv_heads != 0 {
            return Err(ConfigProblem::KvHeads { heads, kv_heads });
        }
        let head_dim = if v.get("head_dim").is_none() && arch == Arch::Qwen3 {
            128
        } else if v["head_dim"].is_null() {
            if hidden_size % heads != 0 {
                return Err(ConfigProblem::HeadDim { hidden_size, heads });
            }
            hidden_size / heads
        } else {
            num("head_dim")?
        };
        if head_dim % 2 != 0 {
            return Err(ConfigProblem::OddHeadDim { head_dim });
        }
        refuse_unsupported(&v)?;
        let (rope_theta, rope_scaling) = rope(&v)?;
        let num_hidden_layers = num("num_hidden_layers")?;
        Ok(TargetConfig {
            arch,
            hidden_size,
            num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            intermediate_size: num("intermediate_size")?,
            rms_norm_eps: float("rms_norm_eps", Some(1e-6))?,
            rope_theta,
            rope_scaling,
            vocab_size: num("vocab_size")?,
            tie_word_embeddings: v["tie_word_embeddings"].as_bool().unwrap_or(false),
            max_position_embeddings: match v.get("max_position_embeddings") {
                None | Some(serde_json::Value::Null) => None,
                Some(_) => Some(num("max_position_embeddings")?),
            },
            moe: match arch {
                Arch::Qwen3Moe => Some(moe(&v, num_hidden_layers)?),
                _ => None,
            },
            model_type: model_type.to_string(),
            embed_scale: None,
        })
    }

    /// A config.json of any architecture, for the torch target engine: the native
    /// families as [`read`](Self::read) reads them; any other as [`Arch::Transformers`],
    /// with what the data plane and the drafter need (sizes, attention shape for the
    /// drafter's own layers, vocabulary, context), read from `text_config` when the model
    /// nests its language model there, and the scale its input embedding module applies
    /// ([`TargetConfig::embed_scale`]). Its rope settings are not the drafter's business:
    /// the drafter's own rotary embedding uses `rope_theta` (10000 when absent).
    pub fn read_any(text: &str) -> Result<TargetConfig, ConfigProblem> {
        let model_type = match TargetConfig::read(text) {
            Err(ConfigProblem::Architecture { model_type, .. }) => model_type,
            r => return r,
        };
        let top: serde_json::Value =
            serde_json::from_str(text).map_err(|source| ConfigProblem::Json { source })?;
        let v = match &top["text_config"] {
            t if t["num_hidden_layers"].is_u64() => t.clone(),
            _ => top.clone(),
        };
        check_sizes(&v)?;
        let num = |field: &'static str| -> Result<usize, ConfigProblem> {
            v[field]
                .as_u64()
                .or(top[field].as_u64())
                .map(|n| n as usize)
                .filter(|&n| n > 0)
                .ok_or(ConfigProblem::NotPositiveInteger { field })
        };
        let hidden_size = num("hidden_size")?;
        let heads = num("num_attention_heads")?;
        let kv_heads = v["num_key_value_heads"]
            .as_u64()
            .map_or(heads, |n| n as usize);
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(ConfigProblem::KvHeads { heads, kv_heads });
        }
        let head_dim = match v["head_dim"].as_u64() {
            Some(d) if d > 0 => d as usize,
            _ if hidden_size % heads == 0 => hidden_size / heads,
            _ => return Err(ConfigProblem::HeadDim { hidden_size, heads }),
        };
        if head_dim % 2 != 0 {
            return Err(ConfigProblem::OddHeadDim { head_dim });
        }
        let theta = v["rope_theta"]
            .as_f64()
            .or(v["rope_parameters"]["rope_theta"].as_f64())
            .or_else(|| {
                v["rope_parameters"]
                    .as_object()?
                    .values()
                    .find_map(|p| p["rope_theta"].as_f64())
            })
            .unwrap_or(10000.0);
        Ok(TargetConfig {
            arch: Arch::Transformers,
            hidden_size,
            num_hidden_layers: num("num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            intermediate_size: num("intermediate_size").unwrap_or(4 * hidden_size),
            rms_norm_eps: v["rms_norm_eps"]
                .as_f64()
                .filter(|e| *e > 0.0)
                .unwrap_or(1e-6),
            rope_theta: theta,
            rope_scaling: None,
            vocab_size: num("vocab_size")?,
            tie_word_embeddings: top["tie_word_embeddings"]
                .as_bool()
                .or(v["tie_word_embeddings"].as_bool())
                .unwrap_or(false),
            max_position_embeddings: v["max_position_embeddings"]
                .as_u64()
                .map(|n| n as usize)
                .filter(|&n| n > 0),
            moe: None,
            embed_scale: embed_scale(
                &[&model_type, v["model_type"].as_str().unwrap_or("")],
                &v,
                hidden_size,
            )?,
            model_type,
        })
    }

    /// [`read_any`](Self::read_any) of `dir/config.json`.
    pub fn load_any(dir: &Path) -> Result<TargetConfig, ConfigError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError {
            path: path.display().to_string(),
            problem: ConfigProblem::Unreadable { source },
        })?;
        TargetConfig::read_any(&text).map_err(|problem| ConfigError {
            path: path.display().to_string(),
            problem,
        })
    }

    /// A stable fingerprint of the architecture-relevant fields (stamped in every
    /// hidden-state batch; a drafter refuses batches from another target).
    pub fn fingerprint(&self) -> u64 {
        let text = serde_json::to_string(self).unwrap_or_default();
        crate::batch::checksum(text.as_bytes())
    }
}

/// The families whose input embedding module scales the rows it looks up by
/// `sqrt(hidden_size)` (transformers' `*ScaledWordEmbedding` with that scale), by their
/// `model_type` or their nested language model's.
pub const SQRT_HIDDEN_EMBED_SCALE: &[&str] = &[
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "gemma3n",
    "gemma3n_text",
    "gemma4",
    "gemma4_text",
    "vaultgemma",
];

/// The scale a family's input embedding module multiplies the looked-up rows by, as
/// transformers computes it: `hidden_size ** 0.5` (a Python float, held as an f32 tensor)
/// for the Gemma families ([`SQRT_HIDDEN_EMBED_SCALE`]), `scale_emb` (default 12) for
/// MiniCPM3; `None` for every other family (`types`: the model's `model_type` and its
/// language model's; `v`: the language model's config).
fn embed_scale(
    types: &[&str],
    v: &serde_json::Value,
    hidden_size: usize,
) -> Result<Option<f32>, ConfigProblem> {
    if types.iter().any(|t| SQRT_HIDDEN_EMBED_SCALE.contains(t)) {
        Ok(Some((hidden_size as f64).sqrt() as f32))
    } else if types.contains(&"minicpm3") {
        match &v["scale_emb"] {
            serde_json::Value::Null => Ok(Some(12.0)),
            s => s
                .as_f64()
                .map(|x| x as f32)
                .filter(|x| x.is_finite() && *x > 0.0)
                .map(Some)
                .ok_or(ConfigProblem::NotPositiveNumber { field: "scale_emb" }),
        }
    } else {
        Ok(None)
    }
}

/// `config.json` of the built-in tiny demo target (`--target tiny`): a Qwen3-architecture
/// model small enough to run on a laptop core. Its weights are written by
/// `dflash-worker tiny-target`.
pub const TINY_CONFIG: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"],
  "model_type": "qwen3",
  "hidden_size": 64,
  "num_hidden_layers": 6,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 16,
  "intermediate_size": 128,
  "rms_norm_eps": 1e-6,
  "rope_theta": 10000.0,
  "rope_scaling": null,
  "vocab_size": 512,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16"
}
"#;

/// Drafter depth DFlash uses for a target of `n_layers` (and so the number of taps): the
/// public recipe's 5 for real targets, 2 for tiny ones where 5 taps would repeat layers.
pub fn default_draft_layers(n_layers: usize) -> usize {
    if n_layers >= 12 {
        5
    } else {
        2
    }
}

/// DFlash's default taps: `L` layers spread over the target's depth, from layer 1 to
/// layer `n - 3` (see DFLASH.md), ascending and distinct: a target too shallow for `L`
/// distinct layers there gets fewer taps (a 4-layer target: `[1]`, not `[1, 1]`). Tap `id`
/// is the output of decoder layer `id` (HF `hidden_states[id + 1]`).
pub fn target_layer_ids(n_layers: usize, taps: usize) -> Vec<u32> {
    if n_layers == 0 {
        return Vec::new();
    }
    if taps <= 1 {
        return vec![(n_layers / 2) as u32];
    }
    // Targets under 4 layers: the span is empty, every tap is layer 1 (0 for one layer).
    let first = 1.min(n_layers - 1) as f64;
    let last = (n_layers as f64 - 3.0).max(first);
    let mut ids: Vec<u32> = (0..taps)
        .map(|i| (first + i as f64 * (last - first) / (taps - 1) as f64).round() as u32)
        .collect();
    // Ascending: equal ids are neighbours.
    ids.dedup();
    ids
}

/// Every tensor of the first `layers` decoder layers plus embeddings, final norm and
/// (untied) lm_head, with their shapes from the config, as a Hugging Face checkpoint names
/// them. The worker loads exactly these; the supervisor checks a `--target` directory's
/// safetensors headers against them before any worker starts.
pub fn expected_tensors(cfg: &TargetConfig, layers: usize) -> Vec<(String, Vec<usize>)> {
    let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (qd, kd) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let mut v = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![cfg.vocab_size, h],
        ),
        ("model.norm.weight".into(), vec![h]),
    ];
    if !cfg.tie_word_embeddings {
        v.push(("lm_head.weight".into(), vec![cfg.vocab_size, h]));
    }
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        v.push((format!("{p}.input_layernorm.weight"), vec![h]));
        v.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        v.push((format!("{p}.self_attn.q_proj.weight"), vec![qd, h]));
        v.push((format!("{p}.self_attn.k_proj.weight"), vec![kd, h]));
        v.push((format!("{p}.self_attn.v_proj.weight"), vec![kd, h]));
        v.push((format!("{p}.self_attn.o_proj.weight"), vec![h, qd]));
        if cfg.arch.has_qk_norm() {
            v.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            v.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        }
        match cfg.sparse(l) {
            None => v.extend(swiglu_tensors(&format!("{p}.mlp"), h, i)),
            Some(m) => {
                v.push((format!("{p}.mlp.gate.weight"), vec![m.num_experts, h]));
                for e in 0..m.num_experts {
                    let mi = m.moe_intermediate_size;
                    v.extend(swiglu_tensors(&format!("{p}.mlp.experts.{e}"), h, mi));
                }
            }
        }
    }
    v
}

/// The gate, up and down projections of a SwiGLU MLP of width `i` under `prefix`.
fn swiglu_tensors(prefix: &str, h: usize, i: usize) -> [(String, Vec<usize>); 3] {
    [
        (format!("{prefix}.gate_proj.weight"), vec![i, h]),
        (format!("{prefix}.up_proj.weight"), vec![i, h]),
        (format!("{prefix}.down_proj.weight"), vec![h, i]),
    ]
}

/// Tensors a checkpoint may hold beside [`expected_tensors`] (a tied model's spare
/// lm_head, rotary tables): loaders ignore them.
pub fn is_ignorable_tensor(name: &str) -> bool {
    name == "lm_head.weight" || name.ends_with("rotary_emb.inv_freq")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_architecture_is_read_for_the_torch_engine_and_only_there() {
        let gpt_oss = r#"{"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
            "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "intermediate_size": 2880, "vocab_size": 201088, "rope_theta": 150000, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0}}"#;
        // The native engine refuses it; read_any takes it as transformers'.
        assert!(matches!(
            TargetConfig::read(gpt_oss),
            Err(ConfigProblem::Architecture { .. })
        ));
        let t = TargetConfig::read_any(gpt_oss).unwrap();
        assert_eq!(t.arch, Arch::Transformers);
        assert_eq!(t.model_type, "gpt_oss");
        assert_eq!(
            (
                t.hidden_size,
                t.num_hidden_layers,
                t.num_attention_heads,
                t.num_key_value_heads,
                t.head_dim
            ),
            (2880, 24, 64, 8, 64)
        );
        assert_eq!(
            (t.vocab_size, t.max_position_embeddings),
            (201088, Some(131072))
        );
        assert_eq!((t.rope_theta, t.rope_scaling.clone()), (150000.0, None));
        assert!(t
            .describe()
            .starts_with("gpt_oss (transformers), 24 layers"));
        // A multimodal wrapper: the language model's config is nested.
        let nested = r#"{"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "tie_word_embeddings": true, "text_config": {"hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}}"#;
        let t = TargetConfig::read_any(nested).unwrap();
        assert_eq!(
            (t.hidden_size, t.num_hidden_layers, t.head_dim, t.vocab_size),
            (64, 4, 16, 512)
        );
        assert_eq!((t.rope_theta, t.tie_word_embeddings), (1_000_000.0, true));
        // The native families read as read() reads them; sizes are still checked.
        assert_eq!(
            TargetConfig::read_any(TINY_CONFIG).unwrap(),
            TargetConfig::read(TINY_CONFIG).unwrap()
        );
        let bad = r#"{"model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 3, "vocab_size": 512}"#;
        assert!(matches!(
            TargetConfig::read_any(bad),
            Err(ConfigProblem::KvHeads { .. })
        ));
    }

    #[test]
    fn tap_convention_matches_the_published_one() {
        assert_eq!(target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(target_layer_ids(36, 1), vec![18]);
        // The tiny target (6 layers) keeps its two taps.
        assert_eq!(target_layer_ids(6, 2), vec![1, 3]);
    }

    #[test]
    fn default_taps_of_a_shallow_target_are_distinct_layers_that_exist() {
        assert_eq!(target_layer_ids(4, 2), vec![1], "not [1, 1]");
        assert_eq!(target_layer_ids(6, 5), vec![1, 2, 3]);
        assert_eq!(target_layer_ids(5, 2), vec![1, 2]);
        assert_eq!(target_layer_ids(3, 2), vec![1]);
        assert_eq!(target_layer_ids(2, 2), vec![1]);
        assert_eq!(target_layer_ids(1, 2), vec![0]);
        for n in 1..40 {
            for taps in 1..8 {
                let ids = target_layer_ids(n, taps);
                assert!(!ids.is_empty() && ids.len() <= taps, "{n} {taps}: {ids:?}");
                assert!(ids.windows(2).all(|w| w[0] < w[1]), "{n} {taps}: {ids:?}");
                assert!(ids.iter().all(|&i| (i as usize) < n), "{n} {taps}: {ids:?}");
            }
        }
    }

    #[test]
    fn qwen3_and_llama_configs() {
        let q = TargetConfig::read(
            r#"{"architectures":["Qwen3ForCausalLM"],"hidden_size":1024,"num_hidden_layers":28,"num_attention_heads":16,
                "num_key_value_heads":8,"head_dim":128,"intermediate_size":3072,"rms_norm_eps":1e-6,"rope_theta":1000000,
                "rope_scaling":null,"vocab_size":151936,"tie_word_embeddings":true}"#,
        )
        .unwrap();
        assert_eq!(
            (
                q.arch,
                q.head_dim,
                q.num_key_value_heads,
                q.tie_word_embeddings
            ),
            (Arch::Qwen3, 128, 8, true)
        );
        let l = TargetConfig::read(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":2048,"num_hidden_layers":16,"num_attention_heads":32,
                "num_key_value_heads":8,"intermediate_size":8192,"rms_norm_eps":1e-5,"rope_theta":500000,"vocab_size":128256,
                "rope_scaling":{"factor":32.0,"high_freq_factor":4.0,"low_freq_factor":1.0,"original_max_position_embeddings":8192,"rope_type":"llama3"}}"#,
        )
        .unwrap();
        assert_eq!((l.arch, l.head_dim), (Arch::Llama, 64));
        assert!(matches!(l.rope_scaling, Some(RopeScaling::Llama3 { .. })));
        assert_ne!(q.fingerprint(), l.fingerprint());
    }

    #[test]
    fn absent_fields_take_the_transformers_defaults_of_the_architecture() {
        let q = TargetConfig::read(r#"{"model_type":"qwen3","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":32,"intermediate_size":8,"vocab_size":10}"#).unwrap();
        assert_eq!(
            (
                q.head_dim,
                q.num_key_value_heads,
                q.rms_norm_eps,
                q.rope_theta,
                q.tie_word_embeddings
            ),
            (128, 32, 1e-6, 10000.0, false)
        );
        let l = TargetConfig::read(r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":8,"vocab_size":10}"#).unwrap();
        assert_eq!(
            (
                l.head_dim,
                l.num_key_value_heads,
                l.rms_norm_eps,
                l.tie_word_embeddings
            ),
            (16, 4, 1e-6, false)
        );
        let q = TargetConfig::read(r#"{"model_type":"qwen3","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":null,"head_dim":null,"intermediate_size":8,"vocab_size":10}"#).unwrap();
        assert_eq!(
            (q.head_dim, q.num_key_value_heads),
            (16, 4),
            "explicit nulls: derived"
        );
    }

    #[test]
    fn transformers_5_rope_parameters_read_like_the_transformers_4_layout() {
        let base = r#""architectures":["LlamaForCausalLM"],"hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":8,"vocab_size":10,"hidden_act":"silu""#;
        let v4 = TargetConfig::read(&format!(r#"{{{base},"rope_theta":500000.0,"rope_scaling":{{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}}}"#)).unwrap();
        let v5 = TargetConfig::read(&format!(r#"{{{base},"rope_parameters":{{"rope_theta":500000.0,"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}}}"#)).unwrap();
        assert_eq!(v4.rope_theta, 500000.0);
        assert_eq!(v5.rope_theta, 500000.0, "not the 10000 fallback");
        assert!(
            matches!(v5.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0)
        );
        assert_eq!(
            v4.fingerprint(),
            v5.fingerprint(),
            "the same model either way"
        );
        // Qwen3 as transformers 5 saves it: default rope type, theta 1e6.
        let q = TargetConfig::read(&format!(
            r#"{{{base},"rope_parameters":{{"rope_theta":1000000.0,"rope_type":"default"}}}}"#
        ))
        .unwrap();
        assert_eq!((q.rope_theta, q.rope_scaling.is_none()), (1000000.0, true));
        // Keyed by layer type (transformers 5): the full-attention entry.
        let keyed = TargetConfig::read(&format!(r#"{{{base},"rope_parameters":{{"full_attention":{{"rope_theta":500000.0,"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}}}}}"#)).unwrap();
        assert_eq!(keyed.fingerprint(), v4.fingerprint());
        let mixed = format!(
            r#"{{{base},"rope_parameters":{{"full_attention":{{"rope_theta":1e6,"rope_type":"default"}},"sliding_attention":{{"rope_theta":1e4,"rope_type":"default"}}}}}}"#
        );
        assert!(TargetConfig::read(&mixed)
            .unwrap_err()
            .to_string()
            .contains("rope_parameters.sliding_attention differs"));
        let unknown = format!(r#"{{{base},"rope_parameters":{{"other":{{"rope_theta":1e6}}}}}}"#);
        assert!(TargetConfig::read(&unknown)
            .unwrap_err()
            .to_string()
            .contains("no full_attention"));
        // Neither layout: transformers' default.
        assert_eq!(
            TargetConfig::read(&format!("{{{base}}}"))
                .unwrap()
                .rope_theta,
            10000.0
        );
    }

    const MOE_BASE: &str = r#""hidden_size":64,"num_hidden_layers":4,"num_attention_heads":4,"head_dim":32,
        "intermediate_size":96,"moe_intermediate_size":48,"num_experts_per_tok":2,"vocab_size":300"#;

    #[test]
    fn qwen3_moe_configs_of_transformers_4_and_5_read_alike() {
        let v4 = TargetConfig::read(&format!(
            r#"{{"architectures":["Qwen3MoeForCausalLM"],{MOE_BASE},"num_experts":8,"norm_topk_prob":true,
                "mlp_only_layers":[1],"decoder_sparse_step":1,"rope_theta":1000000.0,"rope_scaling":null}}"#
        ))
        .unwrap();
        let v5 = TargetConfig::read(&format!(
            r#"{{"model_type":"qwen3_moe",{MOE_BASE},"num_local_experts":8,"norm_topk_prob":true,
                "mlp_only_layers":[1],"rope_parameters":{{"rope_type":"default","rope_theta":1000000.0}}}}"#
        ))
        .unwrap();
        assert_eq!(v4.arch, Arch::Qwen3Moe);
        assert_eq!(v4.arch.to_string(), "Qwen3-MoE");
        assert!(v4.arch.has_qk_norm());
        assert_eq!(
            v4.fingerprint(),
            v5.fingerprint(),
            "the same model either way"
        );
        let m = v4.moe.as_ref().unwrap();
        assert_eq!(
            (
                m.num_experts,
                m.num_experts_per_tok,
                m.moe_intermediate_size
            ),
            (8, 2, 48)
        );
        assert!(m.norm_topk_prob);
        assert_eq!(m.dense_layers, vec![1]);
        assert!(v4.sparse(0).is_some() && v4.sparse(1).is_none() && v4.sparse(3).is_some());
        assert_eq!(
            v4.describe(),
            "Qwen3-MoE, 4 layers, hidden 64; 8 experts, 2 per token (weights renormalised), expert width 48, dense layers [1]"
        );
        // Qwen3MoeConfig's defaults: 4 key-value heads, head_dim hidden / heads, 128
        // experts, 8 per token, width 768, no renormalisation, every layer sparse.
        let d = TargetConfig::read(
            r#"{"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":3,"num_attention_heads":8,"intermediate_size":96,"vocab_size":10}"#,
        )
        .unwrap();
        let m = d.moe.as_ref().unwrap();
        assert_eq!((d.num_key_value_heads, d.head_dim), (4, 8));
        assert_eq!(
            (
                m.num_experts,
                m.num_experts_per_tok,
                m.moe_intermediate_size,
                m.norm_topk_prob
            ),
            (128, 8, 768, false)
        );
        assert!(m.dense_layers.is_empty());
        // decoder_sparse_step 2: layers 1 and 3 sparse (transformers: (l + 1) % step == 0).
        let step = TargetConfig::read(&format!(
            r#"{{"model_type":"qwen3_moe",{MOE_BASE},"num_experts":4,"decoder_sparse_step":2}}"#
        ))
        .unwrap();
        assert_eq!(step.moe.unwrap().dense_layers, vec![0, 2]);
        // A dense target's fingerprint text has no MoE field (unchanged by its addition).
        let q = TargetConfig::read(TINY_CONFIG).unwrap();
        assert!(!serde_json::to_string(&q).unwrap().contains("moe"));
        assert_ne!(q.fingerprint(), v4.fingerprint());
    }

    #[test]
    fn moe_tensors_are_the_router_and_every_expert_of_the_sparse_layers() {
        let c = TargetConfig::read(&format!(
            r#"{{"model_type":"qwen3_moe",{MOE_BASE},"num_experts":3,"mlp_only_layers":[1]}}"#
        ))
        .unwrap();
        let t = expected_tensors(&c, 2);
        let has = |n: &str, s: &[usize]| t.iter().any(|(a, b)| a == n && b == s);
        assert!(has("model.layers.0.mlp.gate.weight", &[3, 64]));
        assert!(has(
            "model.layers.0.mlp.experts.2.gate_proj.weight",
            &[48, 64]
        ));
        assert!(has(
            "model.layers.0.mlp.experts.0.down_proj.weight",
            &[64, 48]
        ));
        assert!(has("model.layers.0.self_attn.q_norm.weight", &[32]));
        assert!(!has("model.layers.0.mlp.gate_proj.weight", &[96, 64]));
        assert!(
            has("model.layers.1.mlp.gate_proj.weight", &[96, 64]),
            "dense"
        );
        assert!(!t
            .iter()
            .any(|(n, _)| n.starts_with("model.layers.1.mlp.experts")));
        // Layer 0: 8 norms and attention + router + 3 experts × 3; layer 1: 8 + 3; the
        // embedding, final norm and (untied) lm_head.
        assert_eq!(t.len(), 18 + 11 + 3);
    }

    #[test]
    fn odd_moe_configs_are_refused_naming_the_key() {
        let moe = |extra: &str| {
            TargetConfig::read(&format!(
                r#"{{"model_type":"qwen3_moe",{MOE_BASE},"num_experts":4{extra}}}"#
            ))
            .map(|_| ())
            .unwrap_err()
            .to_string()
        };
        for (extra, needle) in [
            (
                r#","num_experts_per_tok":5"#,
                "num_experts_per_tok 5 is larger than num_experts 4",
            ),
            (
                r#","num_local_experts":6"#,
                "num_experts 4 and num_local_experts 6 disagree",
            ),
            (
                r#","shared_expert_intermediate_size":64"#,
                "shared_expert_intermediate_size 64 is not supported",
            ),
            (
                r#","n_shared_experts":1"#,
                "n_shared_experts 1 is not supported",
            ),
            (r#","first_k_dense_replace":1"#, "first_k_dense_replace"),
            (r#","scoring_func":"sigmoid""#, "scoring_func \"sigmoid\""),
            (
                r#","routed_scaling_factor":2.5"#,
                "routed_scaling_factor 2.5",
            ),
            (r#","n_group":8"#, "n_group 8"),
            (r#","router_bias":true"#, "router_bias = true"),
            (
                r#","mlp_only_layers":[7]"#,
                "mlp_only_layers [7] is not a list of layer indices below num_hidden_layers 4",
            ),
            (r#","mlp_only_layers":"all""#, "mlp_only_layers"),
            (
                r#","norm_topk_prob":"yes""#,
                "norm_topk_prob is not true or false",
            ),
            (
                r#","decoder_sparse_step":0"#,
                "decoder_sparse_step is missing or not a positive integer",
            ),
            (
                r#","moe_intermediate_size":0"#,
                "moe_intermediate_size is missing or not a positive integer",
            ),
            (r#","num_experts_per_tok":0"#, "num_experts_per_tok"),
        ] {
            let e = moe(extra);
            assert!(e.contains(needle) && !e.contains('\n'), "{extra}: {e}");
        }
        let zero = TargetConfig::read(&format!(
            r#"{{"model_type":"qwen3_moe",{MOE_BASE},"num_experts":0}}"#
        ))
        .unwrap_err();
        assert!(zero
            .to_string()
            .contains("num_experts is missing or not a positive integer"));
        // Keys of other MoE families at their "none" values are accepted.
        TargetConfig::read(&format!(
            r#"{{"model_type":"qwen3_moe",{MOE_BASE},"num_experts":4,"shared_expert_intermediate_size":0,"routed_scaling_factor":1.0,"scoring_func":"softmax","router_aux_loss_coef":0.001,"output_router_logits":false}}"#
        ))
        .unwrap();
    }

    #[test]
    fn sizes_are_bounded_before_anything_is_sized_by_them() {
        let base = |field: &str, value: &str| {
            let mut v: serde_json::Value = serde_json::from_str(TINY_CONFIG).unwrap();
            v[field] = serde_json::from_str(value).unwrap();
            v.to_string()
        };
        let t = TargetConfig::read(&base("max_position_embeddings", "40960")).unwrap();
        assert_eq!(t.max_position_embeddings, Some(40960));
        assert_eq!(
            TargetConfig::read(TINY_CONFIG)
                .unwrap()
                .max_position_embeddings,
            None
        );
        assert_eq!(
            t.fingerprint(),
            TargetConfig::read(TINY_CONFIG).unwrap().fingerprint(),
            "the context length changes no computation"
        );
        for (field, value, range) in [
            ("num_hidden_layers", "1000000000", "1 to 1024"),
            ("hidden_size", "131073", "1 to 131072"),
            ("intermediate_size", "2097152", "1 to 1048576"),
            ("num_attention_heads", "1e12", "1 to 4096"),
            ("num_key_value_heads", "5000", "1 to 4096"),
            ("head_dim", "8192", "1 to 4096"),
            ("vocab_size", "18446744073709551615", "1 to 16777216"),
            ("max_position_embeddings", "1000000000000", "1 to 134217728"),
            ("num_experts", "100000", "1 to 4096"),
            ("num_local_experts", "100000", "1 to 4096"),
            ("num_experts_per_tok", "5000", "1 to 4096"),
        ] {
            let e = TargetConfig::read(&base(field, value))
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with(&format!("{field} "))
                    && e.contains("out of range")
                    && e.contains(range)
                    && !e.contains('\n'),
                "{field} {value}: {e}"
            );
        }
        // At the bounds: accepted (a 1024-layer, 131072-wide model is not refused here).
        let at = base("num_hidden_layers", "1024");
        assert_eq!(TargetConfig::read(&at).unwrap().num_hidden_layers, 1024);
        assert!(TargetConfig::read(&base("max_position_embeddings", "0"))
            .unwrap_err()
            .to_string()
            .contains("max_position_embeddings is missing or not a positive integer"));
    }

    #[test]
    fn bad_configs_say_what_is_wrong() {
        for (text, needle) in [
            ("{", "not valid JSON"),
            (
                r#"{"architectures":["GPT2LMHeadModel"]}"#,
                "unsupported architecture",
            ),
            (
                r#"{"model_type":"llama","hidden_size":64}"#,
                "num_attention_heads is missing",
            ),
            (
                r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":3,"intermediate_size":8,"vocab_size":10}"#,
                "not a multiple",
            ),
            (
                r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":8,"vocab_size":10,"rope_scaling":{"rope_type":"yarn","factor":4}}"#,
                "rope_scaling.original_max_position_embeddings is missing",
            ),
            (
                r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":8,"vocab_size":10,"rope_scaling":{"rope_type":"longrope","factor":4}}"#,
                "rope_scaling.rope_type \"longrope\" is not supported",
            ),
            (
                r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":8,"vocab_size":10,"partial_rotary_factor":0.5}"#,
                "partial_rotary_factor",
            ),
            (
                r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":8,"vocab_size":10,"rope_parameters":{"rope_type":"dynamic","rope_theta":1e4,"factor":2}}"#,
                "rope_parameters.rope_type \"dynamic\"",
            ),
            (
                r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":8,"vocab_size":10,"rope_theta":5e5,"rope_parameters":{"rope_type":"default","rope_theta":1e6}}"#,
                "disagree",
            ),
            (
                r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":8,"vocab_size":10,"rope_parameters":{"rope_type":"linear","rope_theta":1e4}}"#,
                "rope_parameters.factor is missing",
            ),
            (
                r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":8,"vocab_size":10,"hidden_act":"gelu"}"#,
                "hidden_act \"gelu\"",
            ),
            (
                r#"{"model_type":"qwen3","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"intermediate_size":8,"vocab_size":10,"use_sliding_window":true}"#,
                "use_sliding_window",
            ),
        ] {
            let e = TargetConfig::read(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn families_that_scale_their_input_embedding_record_the_scale() {
        // Gemma 3's language model alone, and nested in its multimodal wrapper: the scale is
        // sqrt of the language model's hidden size, as an f32.
        let text = r#"{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 48,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 512}"#;
        let t = TargetConfig::read_any(text).unwrap();
        assert_eq!(t.embed_scale, Some(48f64.sqrt() as f32));
        let nested = r#"{"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "hidden_size": 1152, "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
            "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "vocab_size": 262208}}"#;
        let t = TargetConfig::read_any(nested).unwrap();
        assert_eq!(t.embed_scale, Some(2560f64.sqrt() as f32));
        for family in ["gemma", "gemma2", "vaultgemma", "gemma4_text"] {
            let v = text.replace("gemma3_text", family);
            assert_eq!(
                TargetConfig::read_any(&v).unwrap().embed_scale,
                Some(48f64.sqrt() as f32),
                "{family}"
            );
        }
        // MiniCPM3: its scale_emb (12 when absent); a non-positive one is refused.
        let mini = text.replace("gemma3_text", "minicpm3");
        assert_eq!(
            TargetConfig::read_any(&mini).unwrap().embed_scale,
            Some(12.0)
        );
        let v = mini.replace(
            r#""vocab_size": 512"#,
            r#""vocab_size": 512, "scale_emb": 2.5"#,
        );
        assert_eq!(TargetConfig::read_any(&v).unwrap().embed_scale, Some(2.5));
        let v = mini.replace(
            r#""vocab_size": 512"#,
            r#""vocab_size": 512, "scale_emb": -1"#,
        );
        assert!(matches!(
            TargetConfig::read_any(&v),
            Err(ConfigProblem::NotPositiveNumber { field: "scale_emb" })
        ));
        // Other families: none, and their serialised form (the fingerprint) has no such field.
        let qwen = text.replace("gemma3_text", "qwen3_5_text");
        let t = TargetConfig::read_any(&qwen).unwrap();
        assert_eq!(t.embed_scale, None);
        assert!(!serde_json::to_string(&t).unwrap().contains("embed_scale"));
        let tiny = TargetConfig::read(TINY_CONFIG).unwrap();
        assert_eq!(tiny.embed_scale, None);
        // A config saved before the field existed still reads; a scaled one round-trips.
        let mut old = serde_json::to_value(&tiny).unwrap();
        old.as_object_mut().unwrap().remove("embed_scale");
        let back: TargetConfig = serde_json::from_value(old).unwrap();
        assert_eq!(back.embed_scale, None);
        let g = TargetConfig::read_any(text).unwrap();
        let back: TargetConfig = serde_json::from_str(&serde_json::to_string(&g).unwrap()).unwrap();
        assert_eq!(back.embed_scale, g.embed_scale);
        assert_ne!(
            g.fingerprint(),
            TargetConfig::read_any(&qwen).unwrap().fingerprint()
        );
    }
}
