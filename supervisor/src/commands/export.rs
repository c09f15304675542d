//! `dflash-supervise export RUN_OR_CHECKPOINT [--out DIR]`: any verified checkpoint as the
//! Hugging Face directory a run's end writes (config.json, model.safetensors, the model
//! code and the parity probe `export-check` runs), so no checkpoint is a dead end. A run's
//! own end goes through [`export_checkpoint`] too.
//!
//! The supervisor links no model code: the worker binary's `export` tool reads the
//! checkpoint and the target's embeddings and writes the directory (atomically).

use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::run::rundir;

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// A run directory (its newest checkpoint that verifies) or one checkpoint directory
    /// (RUN_DIR/checkpoints/step-N).
    #[arg(value_name = "RUN_OR_CHECKPOINT")]
    pub source: PathBuf,
    /// Where the drafter goes (default: the run's drafter/ directory).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// The run's target model directory, when it is no longer where run.json says.
    #[arg(long, value_name = "DIR")]
    pub target: Option<PathBuf>,
    /// The worker program (default: dflash-worker beside dflash-supervise).
    #[arg(long, value_name = "PATH")]
    pub worker_bin: Option<PathBuf>,
}

/// Why an export was not written.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    /// The worker's export tool failed; its own line says why.
    #[error("{0}")]
    Failed(String),
}

/// Write the drafter of `checkpoint` to `out` with the worker's export tool; the frozen
/// embeddings come from `target`. Returns the step written.
pub fn export_checkpoint(
    worker_bin: &Path,
    checkpoint: &Path,
    target: &Path,
    out: &Path,
) -> Result<u64, ExportError> {
    let mut cmd = std::process::Command::new(worker_bin);
    cmd.arg("export")
        .arg("--checkpoint")
        .arg(checkpoint)
        .arg("--target")
        .arg(target)
        .arg("--out")
        .arg(out);
    // Loading a large target's embeddings takes seconds to minutes, never an hour.
    let output = crate::run::output_within(&mut cmd, std::time::Duration::from_secs(3600))
        .map_err(|source| ExportError::Spawn {
            program: format!("{} export", worker_bin.display()),
            source,
        })?;
    if !output.status.success() {
        let err = String::from_utf8_lossy(&output.stderr);
        let line = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no message")
            .trim();
        let line = line.strip_prefix("dflash-worker: error: ").unwrap_or(line);
        return Err(ExportError::Failed(format!(
            "{line} ({})",
            crate::run::process::describe_status(&output.status)
        )));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    // "drafter of step N written to DIR"
    let step = text
        .split_whitespace()
        .skip_while(|w| *w != "step")
        .nth(1)
        .and_then(|w| w.parse().ok())
        .unwrap_or(0);
    Ok(step)
}

/// The checkpoints of a run that verify, newest first, with the reason each one set
/// aside was refused.
pub fn verified_checkpoints(run_dir: &Path) -> (Vec<(u64, PathBuf)>, Vec<String>) {
    let dir = run_dir.join("checkpoints");
    let mut all: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let step = dflash_shared::checkpoint::step_of_dir(
                        &e.file_name().to_string_lossy(),
                    )?;
                    Some((step, e.path()))
                })
                .collect()
        })
        .unwrap_or_default();
    all.sort();
    let (mut good, mut refused) = (Vec::new(), Vec::new());
    for (step, path) in all.into_iter().rev() {
        match dflash_shared::checkpoint::verify(&path, None) {
            Ok(_) => good.push((step, path)),
            Err(e) => refused.push(e),
        }
    }
    (good, refused)
}

/// The target directory of a run, as its run.json names it (`tiny`: RUN_DIR/target).
pub fn run_target(run_dir: &Path) -> Result<PathBuf, Error> {
    let path = run_dir.join(crate::training::resume::RUN_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::input(
            format!(
                "{}: cannot read (expected the run directory of a dflash-supervise run)",
                path.display()
            ),
            e,
        )
    })?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::input(format!("{}: not valid JSON", path.display()), e))?;
    match v["target"].as_str() {
        Some("tiny") => Ok(run_dir.join("target")),
        Some(t) => Ok(PathBuf::from(t)),
        None => Err(Error::Flag(format!(
            "{}: no target recorded (expected --target DIR)",
            path.display()
        ))),
    }
}

pub fn run(a: ExportArgs) -> Result<i32, Error> {
    let src = &a.source;
    let usage = |what: String| Error::Flag(format!("export {}: {what}", src.display()));
    if !src.is_dir() {
        return Err(usage(
            "no such directory (expected a run directory or a checkpoint directory checkpoints/step-N)".into(),
        ));
    }
    let (run_dir, checkpoint) = if src.join(dflash_shared::checkpoint::META_FILE).is_file() {
        dflash_shared::checkpoint::verify(src, None)
            .map_err(|e| usage(format!("the checkpoint does not verify: {e}")))?;
        // RUN_DIR/checkpoints/step-N
        let run = src
            .canonicalize()
            .ok()
            .and_then(|p| p.parent().and_then(Path::parent).map(Path::to_path_buf))
            .filter(|r| r.join(crate::training::resume::RUN_FILE).is_file());
        (run, src.clone())
    } else if src.join(crate::training::resume::RUN_FILE).is_file() {
        let (good, refused) = verified_checkpoints(src);
        let Some((_, c)) = good.into_iter().next() else {
            let why = if refused.is_empty() {
                "it holds no checkpoint (checkpoints/step-N); nothing to export".to_string()
            } else {
                format!("no checkpoint in it verifies: {}", refused.join("; "))
            };
            return Err(usage(why));
        };
        for r in &refused {
            log::warn!("set aside: {r}");
        }
        (Some(src.clone()), c)
    } else {
        return Err(usage(
            "neither a run directory (run.json) nor a checkpoint (meta.json)".into(),
        ));
    };
    let target = match (&a.target, &run_dir) {
        (Some(t), _) => t.clone(),
        (None, Some(r)) => run_target(r)?,
        (None, None) => {
            return Err(usage(
                "the checkpoint is not inside a run directory: give --target DIR".into(),
            ))
        }
    };
    if !target.join("config.json").is_file() {
        return Err(Error::Flag(format!(
            "export: the target {} has no config.json (expected the run's target model directory; give --target DIR)",
            target.display()
        )));
    }
    let out = match (&a.out, &run_dir) {
        (Some(o), _) => o.clone(),
        (None, Some(r)) => r.join("drafter"),
        (None, None) => return Err(usage("give --out DIR".into())),
    };
    if let Some(r) = &run_dir {
        let live = (rundir::ExistingRun { path: r.clone() }).supervisor_alive();
        if live && a.out.is_none() {
            return Err(usage(
                "its supervisor is still running and writes drafter/ at its end (expected --out DIR for a copy now)".into(),
            ));
        }
    }
    let worker_bin = crate::run::resolve_worker_bin(a.worker_bin.as_deref())?;
    let step = export_checkpoint(&worker_bin, &checkpoint, &target, &out)?;
    crate::say!(
        "dflash-supervise: drafter (step {step}) of {} written to {} (check it with: dflash-supervise export-check {})",
        checkpoint.display(),
        out.display(),
        out.display()
    );
    Ok(dflash_shared::exit_codes::SUCCESS)
}
