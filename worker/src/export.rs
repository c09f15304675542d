//! What an export directory holds besides the weights: config.json as transformers reads
//! it (Qwen3 fields, rope as trained, `auto_map` to our model code), the model code
//! itself ([`DRAFTER_MODULE`], our own Python, written for this project), and the parity
//! probe: a small batch and the Rust drafter's final hidden states for it, computed with
//! the bf16 weights that were exported, which `dflash-supervise export-check` compares
//! with what transformers computes from the export.

use std::path::Path;

use dflash_shared::drafter::DrafterConfig;
use dflash_shared::model_config::RopeScaling;
use dflash_shared::rng::Rng;
use serde_json::{json, Value};

use crate::model::drafter::{Drafter, Frozen};

/// The model code, as transformers imports it from the export directory.
pub const MODULE_FILE: &str = "dflash_drafter.py";
/// The class `auto_map` names.
pub const MODEL_CLASS: &str = "DFlashDraftModel";
pub const DRAFTER_MODULE: &str = include_str!("../python/dflash_drafter.py");
/// The parity probe.
pub const PROBE_FILE: &str = "probe.safetensors";
/// Rows of the probe batch and blocks per row.
pub const PROBE_ROWS: usize = 2;
pub const PROBE_BLOCKS: usize = 3;

/// `rope_scaling` as transformers writes it (`null` when positions are not scaled).
pub fn rope_scaling_json(s: Option<&RopeScaling>) -> Value {
    // transformers validates original_max_position_embeddings as an integer.
    let int_if_whole = |x: f64| {
        if x.fract() == 0.0 && x.abs() < 1e15 {
            json!(x as i64)
        } else {
            json!(x)
        }
    };
    match s {
        None => Value::Null,
        Some(RopeScaling::Linear { factor }) => json!({"rope_type": "linear", "factor": factor}),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": int_if_whole(*original_max_position_embeddings),
        }),
        // The attention factor as resolved, so a loader needs no mscale arithmetic.
        Some(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        }) => json!({
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int_if_whole(*original_max_position_embeddings),
            "beta_fast": beta_fast,
            "beta_slow": beta_slow,
            "attention_factor": attention_factor,
            "truncate": truncate,
        }),
    }
}

/// config.json of an export: every field transformers' Qwen3Config reads, as trained, plus
/// the DFlash fields and `auto_map`. `max_position_embeddings`: the target's, when its
/// config.json gives one (else Qwen3Config's default, 32768).
pub fn export_config(
    c: &DrafterConfig,
    step: u64,
    num_target_layers: usize,
    target_layer_ids: &[u32],
    max_position_embeddings: Option<u64>,
) -> Value {
    let module = MODULE_FILE.trim_end_matches(".py");
    json!({
        "architectures": [MODEL_CLASS],
        "auto_map": {"AutoModel": format!("{module}.{MODEL_CLASS}")},
        "model_type": "qwen3",
        "hidden_size": c.hidden,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.q_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": c.eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_scaling_json(c.rope_scaling.as_ref()),
        "max_position_embeddings": max_position_embeddings.unwrap_or(32768),
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_sliding_window": false,
        "sliding_window": null,
        "max_window_layers": c.layers,
        "layer_types": vec!["full_attention"; c.layers],
        "initializer_range": 0.02,
        "vocab_size": c.vocab,
        "tie_word_embeddings": false,
        "use_cache": true,
        "torch_dtype": "bfloat16",
        "block_size": c.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"target_layer_ids": target_layer_ids, "mask_token_id": c.mask_token_id, "block_size": c.block_size},
        "dflash_training": {"step": step, "gamma": c.gamma, "max_anchors": c.max_anchors},
    })
}

/// One tensor of a safetensors file.
pub struct Tensor {
    pub name: &'static str,
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

fn f32_tensor(name: &'static str, shape: Vec<usize>, v: &[f32]) -> Tensor {
    Tensor {
        name,
        dtype: safetensors::Dtype::F32,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn i64_tensor(name: &'static str, shape: Vec<usize>, v: &[usize]) -> Tensor {
    Tensor {
        name,
        dtype: safetensors::Dtype::I64,
        shape,
        bytes: v.iter().flat_map(|x| (*x as i64).to_le_bytes()).collect(),
    }
}

/// The parity probe: [`PROBE_ROWS`] rows of `S` context tokens with pseudo-random taps,
/// [`PROBE_BLOCKS`] blocks each (one at anchor 0, which sees no context, one at the last
/// token, whose block runs past the context), their inputs embedded with the frozen
/// embedding, and the drafter's final-normed hidden states for them under `params`.
/// Tensors: `target_hidden` [B,S,L·H] f32, `noise_embedding` [B,M,H] f32,
/// `block_input_ids` [B,M] i64, `position_ids` [B,S+M] i64, `anchors` [B,N] i64,
/// `attention_mask` [B,1,M,S+M] bool, `hidden_states` [B,M,H] f32 (the reference).
pub fn probe_batch(
    d: &Drafter,
    frozen: &Frozen,
    params: &[f32],
    seed: u64,
) -> Result<Vec<Tensor>, String> {
    let c = &d.cfg;
    let (h, bs, width) = (c.hidden, c.block_size, c.n_taps * c.hidden);
    let s = 2 * bs + 5;
    let m = PROBE_BLOCKS * bs;
    let mut rng = Rng::new(seed ^ 0x7072_6f62_6521);
    let mut uniform =
        |scale: f32| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale;
    let mut taps = Vec::with_capacity(PROBE_ROWS * s * width);
    let mut noise = Vec::with_capacity(PROBE_ROWS * m * h);
    let mut ids = Vec::with_capacity(PROBE_ROWS * m);
    let mut positions = Vec::with_capacity(PROBE_ROWS * (s + m));
    let mut anchors_all = Vec::with_capacity(PROBE_ROWS * PROBE_BLOCKS);
    let mut mask = Vec::with_capacity(PROBE_ROWS * m * (s + m));
    let mut out = Vec::with_capacity(PROBE_ROWS * m * h);
    for row in 0..PROBE_ROWS {
        let anchors = if row == 0 {
            [0, bs / 2 + 1, s - 1]
        } else {
            [1, s / 2, s - 2]
        };
        let row_taps: Vec<f32> = (0..s * width).map(|_| uniform(2.0)).collect();
        let mut row_noise = Vec::with_capacity(m * h);
        for _ in anchors {
            let anchor_token = (uniform(1.0).abs() * c.vocab as f32) as usize % c.vocab;
            for k in 0..bs {
                let tok = if k == 0 {
                    anchor_token
                } else {
                    c.mask_token_id as usize
                };
                let e = frozen
                    .embed
                    .get(tok * h..(tok + 1) * h)
                    .ok_or_else(|| format!("token {tok} is outside the embedding"))?;
                row_noise.extend_from_slice(e);
                ids.push(tok);
            }
        }
        let hidden = d.final_hidden(params, &row_taps, &row_noise, &anchors)?;
        positions.extend(0..s);
        positions.extend(anchors.iter().flat_map(|&a| (0..bs).map(move |k| a + k)));
        for q in 0..m {
            let n = q / bs;
            mask.extend((0..s + m).map(|kv| {
                u8::from(if kv < s {
                    kv < anchors[n]
                } else {
                    (kv - s) / bs == n
                })
            }));
        }
        anchors_all.extend_from_slice(&anchors);
        taps.extend(row_taps);
        noise.extend(row_noise);
        out.extend(hidden);
    }
    let b = PROBE_ROWS;
    Ok(vec![
        f32_tensor("target_hidden", vec![b, s, width], &taps),
        f32_tensor("noise_embedding", vec![b, m, h], &noise),
        i64_tensor("block_input_ids", vec![b, m], &ids),
        i64_tensor("position_ids", vec![b, s + m], &positions),
        i64_tensor("anchors", vec![b, PROBE_BLOCKS], &anchors_all),
        Tensor {
            name: "attention_mask",
            dtype: safetensors::Dtype::BOOL,
            shape: vec![b, 1, m, s + m],
            bytes: mask,
        },
        f32_tensor("hidden_states", vec![b, m, h], &out),
    ])
}

pub fn write_safetensors(tensors: &[Tensor], path: &Path) -> crate::error::Result<()> {
    let views: Vec<(&str, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|t| {
            Ok((
                t.name,
                safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes)?,
            ))
        })
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::model_config::{TargetConfig, TINY_CONFIG};

    #[test]
    fn the_config_carries_auto_map_and_rope_as_trained() {
        let t = TargetConfig::parse(TINY_CONFIG).unwrap();
        let mut c = DrafterConfig::for_target(&t, 2, 2, 8, 4);
        let v = export_config(&c, 3, 6, &[1, 4], None);
        assert_eq!(
            v["auto_map"]["AutoModel"],
            "dflash_drafter.DFlashDraftModel"
        );
        assert_eq!(v["rope_scaling"], Value::Null);
        assert_eq!(
            v["layer_types"],
            json!(["full_attention", "full_attention"])
        );
        assert_eq!(v["max_position_embeddings"], 32768);
        c.rope_scaling = Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        });
        let v = export_config(&c, 3, 6, &[1, 4], Some(131072));
        assert_eq!(v["rope_scaling"]["rope_type"], "llama3");
        assert_eq!(
            v["rope_scaling"]["original_max_position_embeddings"],
            json!(8192)
        );
        assert_eq!(v["max_position_embeddings"], 131072);
        // What the trainer reads back is what was trained.
        let back = TargetConfig::parse(&v.to_string()).unwrap();
        assert_eq!(back.rope_scaling, c.rope_scaling);
        assert_eq!(back.rope_theta, c.rope_theta);
        assert!(DRAFTER_MODULE.contains(&format!("class {MODEL_CLASS}(")));
    }

    #[test]
    fn the_probe_is_the_drafters_output_on_its_inputs() {
        let t = TargetConfig::parse(TINY_CONFIG).unwrap();
        let c = DrafterConfig::for_target(&t, 1, 2, 4, 4);
        let d = Drafter::new(c.clone());
        let p = d.init_params(5);
        let embed: Vec<f32> = (0..c.vocab * c.hidden)
            .map(|i| ((i % 97) as f32 - 48.0) / 100.0)
            .collect();
        let frozen = Frozen {
            lm_head: embed.clone(),
            embed,
        };
        let probe = probe_batch(&d, &frozen, &p, 9).unwrap();
        let get = |n: &str| probe.iter().find(|t| t.name == n).unwrap();
        let (s, m) = (2 * 4 + 5, PROBE_BLOCKS * 4);
        assert_eq!(get("target_hidden").shape, vec![2, s, 2 * c.hidden]);
        assert_eq!(get("attention_mask").shape, vec![2, 1, m, s + m]);
        let out: Vec<f32> = get("hidden_states")
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(out.len(), 2 * m * c.hidden);
        assert!(out.iter().all(|x| x.is_finite()) && out.iter().any(|x| x.abs() > 0.1));
        // The block at anchor 0 sees no context key: its first query row's mask is its block only.
        let mask = &get("attention_mask").bytes;
        assert_eq!(mask[..s].iter().filter(|&&x| x == 1).count(), 0);
        assert_eq!(mask[s..s + m].iter().filter(|&&x| x == 1).count(), 4);
        // Bad inputs are errors, not panics.
        assert!(d.final_hidden(&p, &[0.0; 3], &[], &[]).is_err());
        assert!(d
            .final_hidden(
                &p,
                &vec![0.0; 2 * c.hidden * 2],
                &vec![0.0; 4 * c.hidden],
                &[5]
            )
            .is_err());
    }
}
