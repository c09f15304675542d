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
        let text =
            serde_json::to_string_pretty(self).map_err(|e| Error::json("the run settings", e))?;
        std::fs::write(run_dir.join(RUN_FILE), text)
            .map_err(|e| Error::io("cannot write", run_dir.join(RUN_FILE), e))
    }
}

/// A checkpoint to continue from.
pub struct Resume {
    pub dir: PathBuf,
    pub step: u64,
    pub checkpoint: PathBuf,
    pub consumed: HashSet<u64>,
}

/// Saved settings a resumed run may change: flags given with `--resume` win over them.
/// (The step limit and the learning-rate schedule; the rest decide which batches exist
/// and what the drafter is, so changing them would not continue the same run.)
pub const OVERRIDABLE: [&str; 4] = ["steps", "lr", "warmup_ratio", "max_bad_lines"];

/// Merge the settings given on this command line (`given`: the ids of the flags on it;
/// an optional setting that has a value also counts, from a flag or `--config`) into the
/// saved ones. A given overridable setting wins; another one that differs from the saved
/// value is refused. Returns the merged settings and one note per override.
pub fn merge(
    saved: SavedRun,
    now: &SavedRun,
    given: &[String],
) -> Result<(SavedRun, Vec<String>), String> {
    let to_map = |r: &SavedRun| match serde_json::to_value(r) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        _ => Err("cannot compare the settings".to_string()),
    };
    let mut merged = to_map(&saved)?;
    let now = to_map(now)?;
    let mut notes = Vec::new();
    for (key, value) in &now {
        let optional = OPTIONAL.contains(&key.as_str());
        let is_given = if optional {
            !value.is_null()
        } else {
            given.iter().any(|g| g == key)
        };
        let old = merged.get(key).cloned().unwrap_or(serde_json::Value::Null);
        if !is_given || *value == old {
            continue;
        }
        let flag = format!("--{}", key.replace('_', "-"));
        let shown = |v: &serde_json::Value| match v {
            serde_json::Value::Null => "the default".to_string(),
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(a) => a
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(","),
            other => other.to_string(),
        };
        if OVERRIDABLE.contains(&key.as_str()) {
            notes.push(format!(
                "{flag} {} replaces this run's {}",
                shown(value),
                shown(&old)
            ));
            merged.insert(key.clone(), value.clone());
        } else {
            return Err(format!(
                "{flag} {} differs from this run's {} ({RUN_FILE}); a resumed run keeps its model, data and batching \
                 (expected no {flag}, or the same value; only {} may change; or start a new run)",
                shown(value),
                shown(&old),
                OVERRIDABLE.map(|k| format!("--{}", k.replace('_', "-"))).join(", ")
            ));
        }
    }
    let merged = serde_json::from_value(serde_json::Value::Object(merged))
        .map_err(|e| format!("cannot merge the settings: {e}"))?;
    Ok((merged, notes))
}

/// Settings that are optional (`None`: the default for the target); the others always
/// have a value, so only the command line tells whether one was given.
const OPTIONAL: [&str; 10] = [
    "taps",
    "draft_layers",
    "token_budget",
    "steps",
    "lr",
    "warmup_ratio",
    "gamma",
    "mask_token_id",
    "block_size",
    "max_anchors",
];

/// Load `dir`'s saved settings into `args` (flags given on this command line, `given`,
/// win where they may, see [`merge`]) and find its newest complete checkpoint.
pub fn prepare(dir: &Path, args: &mut RunArgs, given: &[String]) -> Result<Resume, Error> {
    let usage = |msg: String| Error::Flag(format!("--resume {}: {msg}", dir.display()));
    let text = std::fs::read_to_string(dir.join(RUN_FILE)).map_err(|e| {
        usage(format!(
            "cannot read {RUN_FILE}: {e} (expected the run directory of a dflash-supervise run)"
        ))
    })?;
    let saved: SavedRun =
        serde_json::from_str(&text).map_err(|e| usage(format!("{RUN_FILE} is not valid: {e}")))?;
    let (merged, notes) = merge(saved, &SavedRun::of(args), given).map_err(usage)?;
    for n in notes {
        log::info!("resuming with {n}");
    }
    merged.apply(args);
    let ckpts = dir.join("checkpoints");
    let mut done: Vec<PathBuf> = std::fs::read_dir(&ckpts)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    // Complete checkpoints only: `step-N`, not a `step-N.tmp-PID` a crash left behind.
    done.retain(|p| {
        p.file_name()
            .is_some_and(|n| dflash_shared::checkpoint::step_of_dir(&n.to_string_lossy()).is_some())
            && p.join("meta.json").is_file()
    });
    done.sort();
    if done.is_empty() {
        return Err(usage(
            "no checkpoint in it yet (expected checkpoints/step-N/ with meta.json)".into(),
        ));
    }
    // The newest checkpoint that verifies (checksums, finite values); a changed or damaged
    // one is passed over with a warning rather than loaded, or looped on.
    let mut refused = Vec::new();
    let checkpoint = loop {
        let Some(c) = done.pop() else {
            return Err(usage(format!(
                "no checkpoint verifies: {}",
                refused.join("; ")
            )));
        };
        match dflash_shared::checkpoint::verify(&c) {
            Ok(_) => break c,
            Err(e) => {
                log::warn!(
                    "not resuming from {}: {e}; trying the one before it",
                    c.display()
                );
                refused.push(e);
            }
        }
    };
    let meta: serde_json::Value = std::fs::read_to_string(checkpoint.join("meta.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .ok_or_else(|| usage(format!("{}/meta.json is not valid", checkpoint.display())))?;
    let step = meta["step"]
        .as_u64()
        .ok_or_else(|| usage(format!("{}/meta.json has no step", checkpoint.display())))?;
    let sup = &meta["supervisor"];
    let below = sup["consumed_below"].as_u64().unwrap_or(0);
    let mut consumed: HashSet<u64> = (0..below).collect();
    consumed.extend(
        sup["consumed_extra"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_u64()),
    );
    Ok(Resume {
        dir: dir.to_path_buf(),
        step,
        checkpoint,
        consumed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> RunArgs {
        crate::cli::run_args(extra)
    }

    fn given(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn saved() -> SavedRun {
        SavedRun::of(&args(&[
            "--data",
            "demo",
            "--steps",
            "3",
            "--max-seq-len",
            "64",
            "--block-size",
            "8",
        ]))
    }

    #[test]
    fn without_flags_the_saved_settings_are_used() {
        let (m, notes) = merge(saved(), &SavedRun::of(&args(&[])), &[]).unwrap();
        assert_eq!(m.steps, Some(3));
        assert_eq!(
            m.max_seq_len, 64,
            "a default value not given on the command line does not count"
        );
        assert_eq!(m.block_size, Some(8));
        assert!(notes.is_empty());
    }

    #[test]
    fn given_steps_and_lr_win_over_the_saved_ones() {
        let now = SavedRun::of(&args(&[
            "--steps",
            "6",
            "--lr",
            "1e-3",
            "--max-bad-lines",
            "50",
        ]));
        let (m, notes) = merge(saved(), &now, &given(&["steps", "lr", "max_bad_lines"])).unwrap();
        assert_eq!(m.steps, Some(6));
        assert_eq!(m.lr, Some(1e-3));
        assert_eq!(m.max_bad_lines, 50);
        assert_eq!(notes.len(), 3, "{notes:?}");
        assert!(
            notes.iter().any(|n| n == "--steps 6 replaces this run's 3"),
            "{notes:?}"
        );
    }

    #[test]
    fn a_given_setting_that_would_change_the_run_is_refused_unless_it_is_the_same() {
        let now = SavedRun::of(&args(&["--block-size", "4"]));
        let e = merge(saved(), &now, &given(&["block_size"])).unwrap_err();
        assert!(
            e.contains("--block-size 4 differs from this run's 8") && e.contains("--steps"),
            "{e}"
        );
        let now = SavedRun::of(&args(&["--max-seq-len", "32"]));
        let e = merge(saved(), &now, &given(&["max_seq_len"])).unwrap_err();
        assert!(
            e.contains("--max-seq-len 32 differs from this run's 64"),
            "{e}"
        );
        let now = SavedRun::of(&args(&["--data", "/other.jsonl"]));
        assert!(merge(saved(), &now, &given(&["data"]))
            .unwrap_err()
            .contains("--data /other.jsonl differs from this run's demo"));
        // The same value again is fine.
        let now = SavedRun::of(&args(&["--block-size", "8", "--max-seq-len", "64"]));
        merge(saved(), &now, &given(&["block_size", "max_seq_len"])).unwrap();
    }
}
