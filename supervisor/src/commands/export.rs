//! `dflash-supervise export RUN_OR_CHECKPOINT [--out DIR]`: any verified checkpoint as the
//! Hugging Face directory a run's end writes (config.json, model.safetensors, the model
//! code and the parity probe `export-check` runs), so no checkpoint is a dead end. A run's
//! own end goes through [`export_checkpoint`] too.
//!
//! The supervisor links no model code: the worker binary's `export` tool reads the
//! checkpoint and the target's embeddings and writes the directory (atomically).

use std::path::{Path, PathBuf};

use crate::cli::ExportArgs;
use crate::error::Error;
use crate::export_tool::{export_checkpoint, verified_checkpoints, ExportError};
use crate::run::rundir;

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
        // A newer version's checkpoint is not passed over for an older one's steps.
        let newest_good = good.first().map(|(s, _)| *s);
        if let Some(r) = refused.iter().find(|r| {
            matches!(
                r.problem,
                dflash_shared::checkpoint::Problem::NewerFormat { .. }
            ) && step_of_checkpoint_file(&r.file).is_some_and(|s| Some(s) > newest_good)
        }) {
            return Err(usage(format!(
                "its newest checkpoint cannot be read by this version: {r}; use the newer dflash-supervise to export it (or give an older checkpoint's directory)"
            )));
        }
        let Some((_, c)) = good.into_iter().next() else {
            let why = if refused.is_empty() {
                "it holds no checkpoint (checkpoints/step-N); nothing to export".to_string()
            } else {
                let each: Vec<String> = refused.iter().map(ToString::to_string).collect();
                format!("no checkpoint in it verifies: {}", each.join("; "))
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
    // A destination that is not new, empty or an earlier export is refused before anything
    // is written (the worker checks again when it writes).
    dflash_shared::export_dest::check(&out)
        .map_err(|e| Error::Flag(format!("export {}: {e}", src.display())))?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::io("cannot create", parent, e))?;
    }
    let worker_bin = crate::run::resolve_worker_bin(a.worker_bin.as_deref())?;
    let step = export_stoppable(&worker_bin, &checkpoint, &target, &out)?;
    crate::say!(
        "dflash-supervise: drafter (step {step}) of {} written to {} (check it with: dflash-supervise export-check {})",
        checkpoint.display(),
        out.display(),
        crate::shell::quote(&out)
    );
    Ok(dflash_shared::exit_codes::SUCCESS)
}

/// [`export_checkpoint`], stopped by a Ctrl-C (or SIGTERM, SIGHUP), which leaves `out` as
/// it was (exit 130).
fn export_stoppable(
    worker_bin: &Path,
    checkpoint: &Path,
    target: &Path,
    out: &Path,
) -> Result<u64, Error> {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(sig, stop.clone())
            .map_err(|e| Error::start("signal handlers", e))?;
    }
    let stopped = || stop.load(std::sync::atomic::Ordering::SeqCst);
    match export_checkpoint(
        worker_bin,
        checkpoint,
        target,
        out,
        crate::export_tool::EXPORT_TIMEOUT,
        &stopped,
    ) {
        Err(ExportError::Stopped { out, .. }) if stopped() => Err(Error::ExportInterrupted { out }),
        r => Ok(r?),
    }
}

/// The step of the checkpoint a file of it belongs to (`.../step-N/meta.json`).
fn step_of_checkpoint_file(file: &Path) -> Option<u64> {
    let dir = if file.join(dflash_shared::checkpoint::META_FILE).exists() {
        file
    } else {
        file.parent()?
    };
    dflash_shared::checkpoint::step_of_dir(&dir.file_name()?.to_string_lossy())
}
