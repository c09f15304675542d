//! `--target-engine`: what runs the target, chosen and checked before any worker starts.
//! `native` is this tool's own forward (Qwen3, Qwen3-MoE, Llama); `torch` a Python child
//! per target worker running transformers' implementation (the worker's
//! `torch_engine`); `auto` is native for every target the native engine serves.

use dflash_shared::env::python;
use std::path::Path;
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

/// Why `python` cannot serve as the torch engine.
#[derive(Debug)]
enum Missing {
    /// torch or transformers cannot be imported (or python cannot be run).
    Import(String),
    /// transformers cannot read the target's config.json: an architecture it does not
    /// know (too old a transformers).
    Config { transformers: String, why: String },
}

/// The versions of torch and transformers that `python` imports, and that transformers
/// reads the config.json in `dir` (when given), or why not.
fn torch_versions(python: &str, dir: Option<&Path>) -> Result<(String, String), Missing> {
    let script = "import sys, torch, transformers\n\
        print(torch.__version__, transformers.__version__, flush=True)\n\
        if len(sys.argv) > 1:\n\
        \x20   from transformers import AutoConfig\n\
        \x20   try:\n\
        \x20       AutoConfig.from_pretrained(sys.argv[1])\n\
        \x20   except Exception as e:\n\
        \x20       print('CONFIG', str(e).replace(chr(10), ' '))\n";
    let mut cmd = Command::new(python);
    cmd.args(["-c", script]).env("HF_HUB_OFFLINE", "1");
    if let Some(d) = dir {
        cmd.arg(d);
    }
    let out = cmd
        .output()
        .map_err(|e| Missing::Import(format!("{python} cannot be run ({e})")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(Missing::Import(format!(
            "{python} cannot import torch and transformers ({last})"
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    let mut v = lines.next().unwrap_or("").split_whitespace();
    let (t, tf) = match (v.next(), v.next()) {
        (Some(t), Some(tf)) => (t.to_string(), tf.to_string()),
        _ => {
            return Err(Missing::Import(format!(
                "{python} printed {text:?} for the versions of torch and transformers"
            )))
        }
    };
    if let Some(why) = lines.find_map(|l| l.strip_prefix("CONFIG ")) {
        return Err(Missing::Config {
            transformers: tf,
            // transformers' first sentence says it; the rest is its own advice.
            why: why.split(". ").next().unwrap_or(why).trim().to_string(),
        });
    }
    Ok((t, tf))
}

/// The engine's name for the workers (`native` or `torch`) and the start's line saying which
/// and why; `--target-engine torch` without torch and transformers is refused (exit 2).
/// A target over several GPUs (`--gpus-per-target`) on the torch engine needs accelerate
/// (transformers places the layers over the GPUs with it).
pub fn choose(
    requested: TargetEngine,
    per: u32,
    (target, dir): (&TargetConfig, Option<&Path>),
) -> Result<(&'static str, String), Error> {
    let (engine, mut line) = pick(requested, target, dir)?;
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
/// `dir`: the target's directory, whose config.json transformers must read for the torch
/// engine (none for the built-in tiny target).
pub fn pick(
    requested: TargetEngine,
    target: &TargetConfig,
    dir: Option<&Path>,
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
            dir,
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
        TargetEngine::Torch => torch(target, dir, "--target-engine torch"),
    }
}

/// The torch engine, `why` it was chosen, once python has torch and transformers.
fn torch(
    target: &TargetConfig,
    dir: Option<&Path>,
    why: &str,
) -> Result<(&'static str, String), Error> {
    let py = python();
    let (torch, transformers) = torch_versions(&py, dir).map_err(|e| match e {
        Missing::Import(e) => Error::Unavailable {
            what: format!("the torch target engine ({why})"),
            source: format!(
                "{e}: pip install torch transformers, or point DFLASH_PYTHON at a Python that has them"
            )
            .into(),
        },
        Missing::Config { transformers, why } => Error::Unavailable {
            what: format!("the torch target engine ({})", target.model_type),
            source: if why.contains("does not recognize this architecture") {
                format!(
                    "transformers {transformers} ({py}) does not know the target's architecture ({why}): pip install -U transformers for an architecture this recent"
                )
            } else {
                format!(
                    "transformers {transformers} ({py}) cannot read the target's config.json: {why}"
                )
            }
            .into(),
        },
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
