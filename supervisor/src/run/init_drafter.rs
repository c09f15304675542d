//! `--init-drafter DIR`: a warm start from a drafter directory in the export layout
//! (config.json, model.safetensors in bf16, as `export` writes it and z-lab publishes it).
//! The supervisor reads its config.json only: the settings it fixes are taken from it where
//! no flag gives them, and the drafter the run trains is checked against it before any
//! worker starts. The drafter workers read its weights themselves (a fresh start only).

use std::path::{Path, PathBuf};

use dflash_shared::drafter::DrafterConfig;
use serde_json::Value;

use crate::cli::RunArgs;

/// The weights file of a drafter directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// Why `--init-drafter DIR` cannot be used (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum InitDrafterError {
    #[error("{} is missing (expected a drafter directory in the export layout: config.json and model.safetensors, as RUN_DIR/drafter)", .0.display())]
    Missing(PathBuf),
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{} has no {field} (expected the config.json of a DFlash drafter)", path.display())]
    Field { path: PathBuf, field: &'static str },
    /// Every setting of the init drafter that differs from the run's, one per entry.
    #[error("does not fit this run: {}", .0.join("; "))]
    Mismatch(Vec<String>),
}

/// What the init drafter's config.json fixes.
#[derive(Debug, Clone, PartialEq)]
pub struct InitDrafter {
    pub dir: PathBuf,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub layers: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub block_size: usize,
    pub target_layer_ids: Vec<u32>,
    pub mask_token_id: u32,
}

impl InitDrafter {
    /// Read DIR/config.json (DIR/model.safetensors must be there too).
    pub fn read(dir: &Path) -> Result<InitDrafter, InitDrafterError> {
        let weights = dir.join(WEIGHTS_FILE);
        let path = dir.join("config.json");
        for p in [&path, &weights] {
            if !p.is_file() {
                return Err(InitDrafterError::Missing(p.clone()));
            }
        }
        let text = std::fs::read_to_string(&path).map_err(|source| InitDrafterError::Read {
            path: path.clone(),
            source,
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|source| InitDrafterError::Json {
            path: path.clone(),
            source,
        })?;
        let field = |field: &'static str| InitDrafterError::Field {
            path: path.clone(),
            field,
        };
        let num = |name: &'static str| v[name].as_u64().map(|n| n as usize).ok_or(field(name));
        let hidden_size = num("hidden_size")?;
        let q_heads = num("num_attention_heads")?;
        let dflash = &v["dflash_config"];
        let target_layer_ids = dflash["target_layer_ids"]
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|n| n as u32)).collect())
            .ok_or(field("dflash_config.target_layer_ids"))?;
        Ok(InitDrafter {
            dir: dir.to_path_buf(),
            hidden_size,
            vocab_size: num("vocab_size")?,
            layers: num("num_hidden_layers")?,
            q_heads,
            kv_heads: v["num_key_value_heads"]
                .as_u64()
                .map_or(q_heads, |n| n as usize),
            head_dim: v["head_dim"]
                .as_u64()
                .map_or(hidden_size / q_heads.max(1), |n| n as usize),
            intermediate: num("intermediate_size")?,
            block_size: dflash["block_size"]
                .as_u64()
                .or(v["block_size"].as_u64())
                .map(|n| n as usize)
                .ok_or(field("block_size"))?,
            target_layer_ids,
            mask_token_id: dflash["mask_token_id"]
                .as_u64()
                .map(|n| n as u32)
                .ok_or(field("dflash_config.mask_token_id"))?,
        })
    }

    /// The settings it fixes that no flag gives are taken from it. Returns the flags that
    /// were given (whose values [`InitDrafter::check`] compares).
    pub fn adopt(&self, a: &mut RunArgs) -> Given {
        let given = Given {
            taps: a.taps.is_some(),
            layers: a.draft_layers.is_some(),
            block: a.block_size.is_some(),
            mask: a.mask_token_id.is_some(),
        };
        a.taps.get_or_insert_with(|| self.target_layer_ids.clone());
        a.draft_layers.get_or_insert(self.layers);
        a.block_size.get_or_insert(self.block_size);
        a.mask_token_id.get_or_insert(self.mask_token_id);
        given
    }

    /// The run's drafter (`d`, reading target layers `taps`) against this one: every
    /// difference named, in one error.
    pub fn check(
        &self,
        d: &DrafterConfig,
        taps: &[u32],
        given: Given,
    ) -> Result<(), InitDrafterError> {
        let by = |flag: &str, is_given: bool| {
            if is_given {
                flag.to_string()
            } else {
                "the target".to_string()
            }
        };
        let ids = |t: &[u32]| t.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let mut out = Vec::new();
        let mut differs = |what: &str, ours: String, from: String, theirs: String| {
            if ours != theirs {
                out.push(format!(
                    "{what} {ours} ({from}), but the init drafter has {theirs}"
                ));
            }
        };
        let target = "the target".to_string();
        differs(
            "hidden size",
            d.hidden.to_string(),
            target.clone(),
            self.hidden_size.to_string(),
        );
        differs(
            "vocabulary size",
            d.vocab.to_string(),
            target.clone(),
            self.vocab_size.to_string(),
        );
        differs(
            "attention heads",
            d.q_heads.to_string(),
            target.clone(),
            self.q_heads.to_string(),
        );
        differs(
            "key/value heads",
            d.kv_heads.to_string(),
            target.clone(),
            self.kv_heads.to_string(),
        );
        differs(
            "head dim",
            d.head_dim.to_string(),
            target.clone(),
            self.head_dim.to_string(),
        );
        differs(
            "intermediate size",
            d.intermediate.to_string(),
            target,
            self.intermediate.to_string(),
        );
        differs(
            "layers",
            d.layers.to_string(),
            by("--draft-layers", given.layers),
            self.layers.to_string(),
        );
        differs(
            "taps",
            ids(taps),
            by("--taps", given.taps),
            ids(&self.target_layer_ids),
        );
        differs(
            "block size",
            d.block_size.to_string(),
            by("--block-size", given.block),
            self.block_size.to_string(),
        );
        differs(
            "mask token id",
            d.mask_token_id.to_string(),
            by("--mask-token-id", given.mask),
            self.mask_token_id.to_string(),
        );
        if out.is_empty() {
            Ok(())
        } else {
            Err(InitDrafterError::Mismatch(out))
        }
    }

    /// What run.json records of it: its path (absolute where it can be) and the checksum of
    /// its weights.
    pub fn record(&self) -> Result<Value, InitDrafterError> {
        let weights = self.dir.join(WEIGHTS_FILE);
        let read = |source| InitDrafterError::Read {
            path: weights.clone(),
            source,
        };
        let f = std::fs::File::open(&weights).map_err(read)?;
        let sha = dflash_shared::checkpoint::content_sha256(&f).map_err(read)?;
        let path = std::fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone());
        Ok(serde_json::json!({"path": path, "model_sha256": sha}))
    }
}

/// Which of the settings an init drafter fixes were given by a flag (or --config).
#[derive(Debug, Clone, Copy, Default)]
pub struct Given {
    pub taps: bool,
    pub layers: bool,
    pub block: bool,
    pub mask: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::model_config::{TargetConfig, TINY_CONFIG};

    fn write(dir: &Path, config: &Value) {
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        std::fs::write(dir.join(WEIGHTS_FILE), b"").unwrap();
    }

    #[test]
    fn a_config_is_read_and_every_mismatch_is_named() {
        let t = TargetConfig::read(TINY_CONFIG).unwrap();
        let d = DrafterConfig::for_target(&t, 2, 2, 8, 4);
        let tmp = tempfile::tempdir().unwrap();
        let mut v = crate::run::init_drafter::tests::export_like(&d, &[1, 3]);
        write(tmp.path(), &v);
        let init = InitDrafter::read(tmp.path()).unwrap();
        assert_eq!(
            init.check(&d, &[1, 3], Given::default())
                .map_err(|e| e.to_string())
                .err(),
            None
        );
        v["dflash_config"]["block_size"] = 4.into();
        v["hidden_size"] = 7.into();
        write(tmp.path(), &v);
        let init = InitDrafter::read(tmp.path()).unwrap();
        let given = Given {
            block: true,
            ..Given::default()
        };
        let e = init.check(&d, &[1, 3], given).unwrap_err().to_string();
        assert!(
            e.contains("block size 8 (--block-size), but the init drafter has 4"),
            "{e}"
        );
        assert!(e.contains("hidden size"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        std::fs::remove_file(tmp.path().join(WEIGHTS_FILE)).unwrap();
        let e = InitDrafter::read(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("model.safetensors is missing"), "{e}");
    }

    pub(super) fn export_like(d: &DrafterConfig, taps: &[u32]) -> Value {
        serde_json::json!({
            "hidden_size": d.hidden, "num_hidden_layers": d.layers,
            "num_attention_heads": d.q_heads, "num_key_value_heads": d.kv_heads,
            "head_dim": d.head_dim, "intermediate_size": d.intermediate,
            "vocab_size": d.vocab, "block_size": d.block_size,
            "dflash_config": {"target_layer_ids": taps, "mask_token_id": d.mask_token_id, "block_size": d.block_size},
        })
    }
}
