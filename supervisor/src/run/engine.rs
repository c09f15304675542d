//! `--target-engine`: what runs the target, chosen and checked before any worker starts.
//! `native` is this tool's own forward (Qwen3, Qwen3-MoE, Llama); `torch` a Python child
//! per target worker running transformers' implementation (the worker's
//! `torch_engine`); `auto` is native for every target the native engine serves.

use dflash_shared::env::python;
use std::process::Command;

use dflash_shared::model_config::{Arch, TargetConfig};

use crate::error::Error;

/// `--target-engine` (of a run, `eval` and `bench train`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TargetEngine {
    Auto,
    Native,
    Torch,
}

/// The versions of torch and transformers that `python` imports, or why it cannot.
fn torch_versions(python: &str) -> Result<(String, String), String> {
    let out = Command::new(python)
        .args([
            "-c",
            "import torch, transformers; print(torch.__version__, transformers.__version__)",
        ])
        .output()
        .map_err(|e| format!("{python} cannot be run ({e})"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(format!(
            "{python} cannot import torch and transformers ({last})"
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut v = text.split_whitespace();
    match (v.next(), v.next()) {
        (Some(t), Some(tf)) => Ok((t.to_string(), tf.to_string())),
        _ => Err(format!(
            "{python} printed {text:?} for the versions of torch and transformers"
        )),
    }
}

/// The engine's name for the workers (`native` or `torch`) and the start's line saying which
/// and why; `--target-engine torch` without torch and transformers is refused (exit 2).
/// A target over several GPUs (`--gpus-per-target`) on the torch engine needs accelerate
/// (transformers places the layers over the GPUs with it).
pub fn choose(
    requested: TargetEngine,
    per: u32,
    target: &TargetConfig,
) -> Result<(&'static str, String), Error> {
    let (engine, mut line) = pick(requested, target)?;
    if per <= 1 {
        return Ok((engine, line));
    }
    if engine == "native" {
        line.push_str(&format!(
            "; each target worker holds {per} GPUs, its layers in contiguous ranges over them"
        ));
        return Ok((engine, line));
    }
    let py = python();
    let out = Command::new(&py)
        .args(["-c", "import accelerate; print(accelerate.__version__)"])
        .output()
        .map_err(|e| Error::Unavailable {
            what: format!("--gpus-per-target {per}"),
            source: format!("{py} cannot be run ({e})").into(),
        })?;
    if !out.status.success() {
        return Err(Error::Unavailable {
            what: format!("--gpus-per-target {per} on the torch engine"),
            source: format!(
                "{py} cannot import accelerate, which transformers needs to place a model over several GPUs: pip install accelerate"
            )
            .into(),
        });
    }
    line.push_str(&format!(
        "; each target worker holds {per} GPUs, its layers in contiguous ranges over them (accelerate {})",
        String::from_utf8_lossy(&out.stdout).trim()
    ));
    Ok((engine, line))
}

/// [`choose`] for `requested`: also what `eval` decodes with.
pub fn pick(
    requested: TargetEngine,
    target: &TargetConfig,
) -> Result<(&'static str, String), Error> {
    let native = target.arch != Arch::Transformers;
    if !native {
        let family = &target.model_type;
        if requested == TargetEngine::Native {
            return Err(Error::Flag(format!(
                "--target-engine native: the native engine serves Qwen3, Qwen3-MoE and Llama, not {family} (expected --target-engine torch or auto, which run transformers' implementation)"
            )));
        }
        return torch(
            target,
            &format!("the native engine does not serve {family}"),
        );
    }
    match requested {
        TargetEngine::Native => Ok((
            "native",
            format!("target engine: native ({} by this tool's own forward)", target.arch),
        )),
        TargetEngine::Auto => Ok((
            "native",
            format!(
                "target engine: native (the native engine serves {}; --target-engine torch runs transformers' implementation instead)",
                target.arch
            ),
        )),
        TargetEngine::Torch => torch(target, "--target-engine torch"),
    }
}

/// The torch engine, `why` it was chosen, once python has torch and transformers.
fn torch(target: &TargetConfig, why: &str) -> Result<(&'static str, String), Error> {
    let py = python();
    let (torch, transformers) = torch_versions(&py).map_err(|e| Error::Unavailable {
        what: format!("the torch target engine ({why})"),
        source: format!(
            "{e}: pip install torch transformers, or point DFLASH_PYTHON at a Python that has them"
        )
        .into(),
    })?;
    let family = match target.arch {
        Arch::Transformers => target.model_type.clone(),
        a => a.to_string(),
    };
    Ok((
        "torch",
        format!("target engine: torch ({why}; transformers {transformers}, torch {torch}, {py}): a Python child per target worker runs transformers' {family}"),
    ))
}
