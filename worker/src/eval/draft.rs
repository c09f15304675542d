//! The drafter at inference, without gradients: an exported drafter directory read back
//! (config.json and model.safetensors as [`crate::tools::export::write_hf_dir`] writes them), and
//! one block proposed by argmax from the context's taps. The forward is the device
//! drafter's training forward ([`DeviceDrafter::final_hidden`]) on one block; the
//! lm_head is the target's frozen one, applied by the target's [`Verifier`].

use std::path::{Path, PathBuf};

use dflash_shared::drafter::DrafterConfig;
use dflash_shared::model_config::TargetConfig;
use serde_json::Value;

use super::verifier::Verifier;
use super::EvalError;
use crate::device::{Device, Result};
use crate::models::drafter::device::DeviceDrafter;
use crate::models::drafter::{Drafter, Frozen, Sample};

/// An exported drafter: its config, its weights (f32, in the layout's order) and the
/// target it was trained against, as config.json records it.
pub struct Exported {
    pub cfg: DrafterConfig,
    pub params: Vec<f32>,
    pub target_layer_ids: Vec<usize>,
    pub num_target_layers: usize,
    pub step: u64,
}

impl Exported {
    /// Read the drafter of export directory `dir`.
    pub fn load(dir: &Path) -> std::result::Result<Exported, EvalError> {
        let bad = |why: String| EvalError::NotADrafter {
            dir: dir.to_path_buf(),
            why,
        };
        let path: PathBuf = dir.join("config.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| bad(format!("reading config.json: {e}")))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| bad(format!("config.json: {e}")))?;
        let dflash = &v["dflash_config"];
        let ids: Vec<usize> = dflash["target_layer_ids"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_u64().map(|x| x as usize))
                    .collect()
            })
            .filter(|a: &Vec<usize>| !a.is_empty())
            .ok_or_else(|| bad("config.json has no dflash_config.target_layer_ids".into()))?;
        let int = |x: &Value, name: &str| {
            x.as_u64()
                .ok_or_else(|| bad(format!("config.json has no integer {name}")))
        };
        // The Qwen3 fields, read as a target's config is (rope layouts, defaults).
        let q = TargetConfig::read(&text).map_err(|e| bad(format!("config.json: {e}")))?;
        let cfg = DrafterConfig {
            hidden: q.hidden_size,
            layers: q.num_hidden_layers,
            q_heads: q.num_attention_heads,
            kv_heads: q.num_key_value_heads,
            head_dim: q.head_dim,
            intermediate: q.intermediate_size,
            vocab: q.vocab_size,
            eps: q.rms_norm_eps,
            rope_theta: q.rope_theta,
            rope_scaling: q.rope_scaling,
            n_taps: ids.len(),
            block_size: int(&dflash["block_size"], "dflash_config.block_size")? as usize,
            max_anchors: 1,
            mask_token_id: int(&dflash["mask_token_id"], "dflash_config.mask_token_id")? as u32,
            gamma: v["dflash_training"]["gamma"].as_f64().unwrap_or(7.0),
        };
        if cfg.block_size < 2 {
            return Err(bad(format!(
                "block_size {} (expected 2 or more)",
                cfg.block_size
            )));
        }
        let d = Drafter::new(cfg.clone());
        let w = crate::models::weights::Weights::open(dir).map_err(|e| bad(e.to_string()))?;
        let mut params = vec![0f32; d.layout.total];
        for (name, shape, off) in &d.layout.entries {
            let t = w.get(name, shape).map_err(|e| bad(e.to_string()))?;
            params[*off..*off + t.len()].copy_from_slice(&t);
        }
        Ok(Exported {
            cfg,
            params,
            target_layer_ids: ids,
            num_target_layers: int(&v["num_target_layers"], "num_target_layers")? as usize,
            step: v["dflash_training"]["step"].as_u64().unwrap_or(0),
        })
    }

    /// Refuse a target other than the one this drafter was trained against: another depth,
    /// width or vocabulary, or a mask token outside its vocabulary.
    pub fn check_target(&self, dir: &Path, t: &TargetConfig) -> std::result::Result<(), EvalError> {
        let c = &self.cfg;
        let checks = [
            ("layers", self.num_target_layers, t.num_hidden_layers),
            ("hidden size", c.hidden, t.hidden_size),
            ("vocabulary", c.vocab, t.vocab_size),
        ];
        for (what, drafter, target) in checks {
            if drafter != target {
                return Err(EvalError::OtherTarget {
                    dir: dir.to_path_buf(),
                    what,
                    drafter,
                    target,
                });
            }
        }
        if let Some(&bad) = self
            .target_layer_ids
            .iter()
            .find(|&&l| l >= t.num_hidden_layers)
        {
            return Err(EvalError::OtherTarget {
                dir: dir.to_path_buf(),
                what: "tapped layer (of the target's layers)",
                drafter: bad,
                target: t.num_hidden_layers,
            });
        }
        Ok(())
    }
}

/// The drafter on a device, proposing one block at a time.
pub struct Draft {
    model: DeviceDrafter,
    pub cfg: DrafterConfig,
    width: usize,
}

impl Draft {
    /// `params` of a drafter of config `cfg` (one block per forward) on `dev`, for contexts
    /// of up to `max_len` positions, with the target's frozen embedding and lm_head.
    pub fn new(
        dev: Box<dyn Device>,
        cfg: &DrafterConfig,
        params: &[f32],
        frozen: &Frozen,
        max_len: usize,
    ) -> Result<Draft> {
        let cfg = DrafterConfig {
            max_anchors: 1,
            ..cfg.clone()
        };
        let d = Drafter::new(cfg.clone());
        let mut model = DeviceDrafter::new(dev, &d, frozen, max_len)?;
        let zeros = vec![0f32; params.len()];
        model.load(params, &zeros, &zeros, 0)?;
        Ok(Draft {
            width: cfg.n_taps * cfg.hidden,
            model,
            cfg,
        })
    }

    /// The block after `committed` (whose last token is the block's first, not yet seen by
    /// the target): the greedy token of each of its slots 1..block_size, from the taps of
    /// the positions before it (`ctx_taps`, `[committed.len() − 1, taps × hidden]`).
    pub fn propose(
        &mut self,
        committed: &[u32],
        ctx_taps: &[f32],
        dec: &mut dyn Verifier,
    ) -> std::result::Result<Vec<u32>, crate::error::ToolError> {
        let n = committed.len();
        if n < 2 || ctx_taps.len() != (n - 1) * self.width {
            return Err(crate::device::GpuError::Invalid(format!(
                "{} tap values for a context of {} positions × {}",
                ctx_taps.len(),
                n.saturating_sub(1),
                self.width
            ))
            .into());
        }
        // The anchor's own row is never seen (strictly before): zeros stand in for it.
        let mut taps = Vec::with_capacity(n * self.width);
        taps.extend_from_slice(ctx_taps);
        taps.resize(n * self.width, 0.0);
        let s = Sample {
            taps: &taps,
            ids: committed,
            mask: &[],
        };
        let hidden = self.model.final_hidden(&s, &[n - 1])?;
        let mut out = dec.head_argmax(&hidden)?;
        out.remove(0);
        Ok(out)
    }
}
