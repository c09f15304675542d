//! Saving a run's settings (`run.json`) and continuing it from its newest checkpoint.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cli::RunArgs;
use crate::error::Error;

pub const RUN_FILE: &str = "run.json";

/// The settings that decide what a run computes: a resumed run must use the same.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedRun {
    pub target: String,
    pub taps: Option<Vec<u32>>,
    pub draft_layers: Option<usize>,
    pub data: String,
    pub token_budget: Option<u32>,
    pub max_seq_len: u32,
    pub seed: u64,
    pub epochs: u32,
    pub max_bad_lines: u64,
    pub shuffle_window: usize,
    pub demo_samples: usize,
    pub steps: Option<u64>,
    pub lr: Option<f64>,
    pub warmup_ratio: Option<f64>,
    #[serde(default)]
    pub gamma: Option<f64>,
    #[serde(default)]
    pub mask_token_id: Option<u32>,
    pub block_size: Option<usize>,
    pub max_anchors: Option<usize>,
}

impl SavedRun {
    pub fn of(a: &RunArgs) -> SavedRun {
        SavedRun {
            // A relative target or data path is kept as given: resume from the same place.
            target: a.target.clone(),
            taps: a.taps.clone(),
            draft_layers: a.draft_layers,
            data: a.data.clone(),
            token_budget: a.token_budget,
            max_seq_len: a.max_seq_len,
            seed: a.seed,
            epochs: a.epochs,
            max_bad_lines: a.max_bad_lines,
            shuffle_window: a.shuffle_window,
            demo_samples: a.demo_samples,
            steps: a.steps,
            lr: a.lr,
            warmup_ratio: a.warmup_ratio,
            gamma: a.gamma,
            mask_token_id: a.mask_token_id,
            block_size: a.block_size,
            max_anchors: a.max_anchors,
        }
    }

    fn apply(self, a: &mut RunArgs) {
        a.target = self.target;
        a.taps = self.taps;
        a.draft_layers = self.draft_layers;
        a.data = self.data;
        a.token_budget = self.token_budget;
        a.max_seq_len = self.max_seq_len;
        a.seed = self.seed;
        a.epochs = self.epochs;
        a.max_bad_lines = self.max_bad_lines;
        a.shuffle_window = self.shuffle_window;
        a.demo_samples = self.demo_samples;
        a.steps = self.steps;
        a.lr = self.lr;
        a.warmup_ratio = self.warmup_ratio;
        a.gamma = self.gamma;
        a.mask_token_id = self.mask_token_id;
        a.block_size = self.block_size;
        a.max_anchors = self.max_anchors;
    }

    pub fn save(&self, run_dir: &Path) -> Result<(), Error> {
        let text = serde_json::to_string_pretty(self).map_err(|e| Error::Internal(e.to_string()))?;
        std::fs::write(run_dir.join(RUN_FILE), text).map_err(|e| Error::Internal(format!("cannot write {RUN_FILE}: {e}")))
    }
}

/// A checkpoint to continue from.
pub struct Resume {
    pub dir: PathBuf,
    pub step: u64,
    pub checkpoint: PathBuf,
    pub consumed: HashSet<u64>,
}

/// Load `dir`'s saved settings into `args` and find its newest complete checkpoint.
pub fn prepare(dir: &Path, args: &mut RunArgs) -> Result<Resume, Error> {
    let usage = |msg: String| Error::Usage(format!("--resume {}: {msg}", dir.display()));
    let text = std::fs::read_to_string(dir.join(RUN_FILE))
        .map_err(|e| usage(format!("cannot read {RUN_FILE}: {e} (expected the run directory of a dflash-supervise run)")))?;
    let saved: SavedRun = serde_json::from_str(&text).map_err(|e| usage(format!("{RUN_FILE} is not valid: {e}")))?;
    saved.apply(args);
    let ckpts = dir.join("checkpoints");
    let mut done: Vec<PathBuf> = std::fs::read_dir(&ckpts)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    done.retain(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")) && p.join("meta.json").is_file());
    done.sort();
    let checkpoint = done.pop().ok_or_else(|| usage("no checkpoint in it yet (expected checkpoints/step-N/ with meta.json)".into()))?;
    let meta: serde_json::Value = std::fs::read_to_string(checkpoint.join("meta.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .ok_or_else(|| usage(format!("{}/meta.json is not valid", checkpoint.display())))?;
    let step = meta["step"].as_u64().ok_or_else(|| usage(format!("{}/meta.json has no step", checkpoint.display())))?;
    let sup = &meta["supervisor"];
    let below = sup["consumed_below"].as_u64().unwrap_or(0);
    let mut consumed: HashSet<u64> = (0..below).collect();
    consumed.extend(sup["consumed_extra"].as_array().into_iter().flatten().filter_map(|v| v.as_u64()));
    Ok(Resume { dir: dir.to_path_buf(), step, checkpoint, consumed })
}
