//! `dflash-supervise eval`: real acceptance length. Greedy DFlash speculative decoding of
//! each prompt with an exported drafter, against plain greedy decoding of its target, in a
//! `dflash-worker eval` process on the CPU or GPUs (`--gpus 0`, or `0-3` for a target over
//! several; the supervisor links no model code, nor CUDA). Chat
//! prompts are rendered here with the target's chat template and tokenizer (with the
//! generation prompt), so the worker reads token ids only (with each line's id, category
//! and dataset beside them: its report gives τ per category and per-prompt ids).
//!
//! Exit 0: measured, and speculative decoding wrote what greedy decoding wrote on every
//! prompt (on a GPU: counted, not required); 1: on the CPU it did not on some prompt (a
//! bug); 2: an input that cannot be used (one
//! line: which, and what was expected); 4: the worker could not be run.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use dflash_shared::exit_codes;

use crate::data::prompts::token_lines;
use crate::error::Error;

#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// The target model directory (RUN_DIR/target for the built-in tiny target), or tiny.
    /// Default: the target the export records (its config.json's dflash_target.path).
    #[arg(long, value_name = "DIR")]
    pub target: Option<String>,
    /// An exported drafter directory (RUN_DIR/drafter, or what `export` wrote).
    #[arg(long, value_name = "DIR")]
    pub drafter: PathBuf,
    /// One prompt per line: a JSON array of token ids, {"input_ids": [...]}, or a chat
    /// conversation ({"messages": [...]} or ShareGPT {"conversations": [...]}, rendered
    /// with the target's chat template; trailing assistant turns are dropped).
    #[arg(long, value_name = "FILE")]
    pub prompts: PathBuf,
    /// New tokens per prompt at most (decoding also stops at the target's EOS).
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Seed of the bootstrap interval over prompts.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
    /// Where to decode: cpu (f32), or GPUs (bf16, over CUDA, numbered as NVML and
    /// `--gpus` of a run number them): one index, or several (0,1 or 0-3) to hold a
    /// target too large for one, its layers in contiguous ranges over them as
    /// `--gpus-per-target` places a training target's (the drafter on the first). On a GPU
    /// a prompt whose speculative output differs from greedy decoding's is counted, not an
    /// error.
    #[arg(long, value_name = "cpu|GPUS", default_value = "cpu")]
    pub gpus: String,
    /// The chat template's thinking switch (enable_thinking) for chat prompts. Default:
    /// the one the drafter's training data was rendered with (its config.json's
    /// dflash_rendering), else the template's own default. A line's own "thinking" wins.
    #[arg(long, value_name = "on|off", value_parser = crate::commands::regenerate::parse_on_off)]
    pub thinking: Option<bool>,
    /// What runs the target: native (this tool's forward: Qwen3, Qwen3-MoE, Llama), torch
    /// (transformers' implementation in a Python child, over its own KV cache), or auto
    /// (native for the families it serves, torch for any other).
    #[arg(long, value_enum, value_name = "ENGINE", default_value = "auto")]
    pub target_engine: crate::run::engine::TargetEngine,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The worker program (default: dflash-worker beside dflash-supervise).
    #[arg(long, value_name = "PATH")]
    pub worker_bin: Option<PathBuf>,
}

/// `--gpus`: none for the CPU, else the GPUs to hold the target over (NVML numbering).
fn gpus_of(spec: &str) -> Result<Vec<u32>, Error> {
    let s = spec.trim();
    if s == "cpu" {
        return Ok(Vec::new());
    }
    match s.parse::<dflash_shared::devices::DeviceSpec>() {
        Ok(dflash_shared::devices::DeviceSpec::Gpus(g)) if !g.is_empty() => Ok(g),
        _ => Err(Error::input(
            format!("--gpus {spec}"),
            "expected cpu, one GPU index, or the GPUs to hold the target over (e.g. 0,1 or 0-3)",
        )),
    }
}

/// The target an export was trained for, as its config.json records it.
fn recorded_target(drafter: &Path) -> Result<String, Error> {
    let cfg = drafter.join("config.json");
    let none = || {
        Error::input(
            format!("--drafter {}", drafter.display()),
            "its config.json records no target (an export of an older version): give --target DIR",
        )
    };
    let text = std::fs::read_to_string(&cfg).map_err(|_| none())?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|_| none())?;
    let path = v["dflash_target"]["path"].as_str().ok_or_else(none)?;
    if !Path::new(path).join("config.json").is_file() {
        return Err(Error::input(
            format!("--drafter {}", drafter.display()),
            format!("the target it records, {path}, is no longer there: give --target DIR"),
        ));
    }
    log::info!("eval: target {path} (recorded by the export)");
    Ok(path.to_string())
}

pub fn run(mut a: EvalArgs) -> Result<i32, Error> {
    if a.target.is_none() {
        a.target = Some(recorded_target(&a.drafter)?);
    }
    let target = a.target.clone().unwrap_or_default();
    let tiny = target == "tiny";
    let gpus = gpus_of(&a.gpus)?;
    if !tiny && !Path::new(&target).join("config.json").is_file() {
        return Err(Error::input(
            format!("--target {target}"),
            "no config.json there (expected a Hugging Face model directory, or tiny)",
        ));
    }
    for f in ["config.json", "model.safetensors"] {
        if !a.drafter.join(f).is_file() {
            return Err(Error::input(
                format!("--drafter {}", a.drafter.display()),
                format!(
                    "no {f} there (expected an exported drafter directory, e.g. RUN_DIR/drafter)"
                ),
            ));
        }
    }
    let trained = trained_rendering(&a.drafter);
    let thinking = a.thinking.or(trained.as_ref().and_then(|t| t.1));
    let rendered = token_lines(
        "--prompts",
        &a.prompts,
        (!tiny).then(|| Path::new(&target)),
        thinking,
    )?;
    if let Some(w) = other_conditions(&rendered, trained.as_ref()) {
        crate::say!("eval: warning: {w}");
    }
    let lines = rendered.lines;
    let mut engine = "native";
    if !tiny {
        let t = dflash_shared::model_config::TargetConfig::load_any(Path::new(&target))
            .map_err(|e| Error::input(format!("--target {target}"), e.to_string()))?;
        crate::data::prompts::check_context(
            "--prompts",
            &a.prompts,
            &lines,
            t.max_position_embeddings,
            a.max_new_tokens as u64,
        )?;
        let per = gpus.len().max(1) as u32;
        let (e, line) =
            crate::run::engine::choose(a.target_engine, per, (&t, Some(Path::new(&target))))?;
        // Said when it is not this tool's own forward (stdout is the report).
        if e == "torch" {
            log::info!("eval: {line}");
        }
        engine = e;
    } else if a.target_engine == crate::run::engine::TargetEngine::Torch {
        engine = crate::run::engine::pick(
            a.target_engine,
            &dflash_shared::model_config::TargetConfig::read(
                dflash_shared::model_config::TINY_CONFIG,
            )
            .map_err(|e| Error::input("--target tiny", e.to_string()))?,
            None,
        )?
        .0;
    }
    let file =
        std::env::temp_dir().join(format!("dflash-eval-prompts-{}.jsonl", std::process::id()));
    std::fs::write(&file, lines.join("\n"))
        .map_err(|e| Error::io("cannot write the prompts to", &file, e))?;
    let r = worker(&a, &file, &gpus, engine);
    let _ = std::fs::remove_file(&file);
    r
}

/// How the drafter's training data was rendered, as its export records it
/// (`dflash_rendering`): the chat template's SHA-256, and the thinking switch when all of
/// it was rendered alike (`Some(None)`: the template's default).
fn trained_rendering(drafter: &Path) -> Option<(Option<String>, Option<bool>, String)> {
    let text = std::fs::read_to_string(drafter.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let r = &v["dflash_rendering"];
    let words = r["thinking"].as_str()?.to_string();
    let thinking = match words.as_str() {
        "on" => Some(true),
        "off" => Some(false),
        _ => None,
    };
    Some((
        r["chat_template_sha256"].as_str().map(str::to_string),
        thinking,
        words,
    ))
}

/// The warning when chat prompts are rendered otherwise than the drafter's training data
/// was (another chat template, another thinking switch): τ then is not what serving the
/// way it was trained gives.
fn other_conditions(
    r: &crate::data::prompts::Rendered,
    trained: Option<&(Option<String>, Option<bool>, String)>,
) -> Option<String> {
    let (template, thinking, words) = trained?;
    let mut why = Vec::new();
    if let (Some(a), Some(b)) = (template, &r.template_sha256) {
        if a != b {
            why.push(format!(
                "the target's chat template (sha256 {}) is not the one the training data was rendered with ({})",
                &b[..12],
                &a[..a.len().min(12)]
            ));
        }
    }
    let alike = words != "mixed" && r.thinking.iter().all(|t| t == thinking);
    if !r.thinking.is_empty() && !alike {
        why.push(format!(
            "chat prompts rendered with thinking {}, the training data with thinking {words}",
            crate::data::prompts::thinking_words(&r.thinking)
        ));
    }
    (!why.is_empty()).then(|| {
        format!(
            "{}: τ measured so is not what serving under the training's conditions gives",
            why.join("; ")
        )
    })
}

/// `dflash-worker eval` on the token-id prompts in `prompts`: its report to stdout; its
/// one error line as ours.
fn worker(a: &EvalArgs, prompts: &Path, gpus: &[u32], engine: &str) -> Result<i32, Error> {
    let worker = match &a.worker_bin {
        Some(w) => w.clone(),
        None => std::env::current_exe()
            .map_err(|e| Error::start("finding dflash-supervise", e))?
            .with_file_name("dflash-worker"),
    };
    let mut cmd = Command::new(&worker);
    cmd.arg("eval")
        .arg("--target")
        .arg(a.target.as_deref().unwrap_or("tiny"))
        .arg("--drafter")
        .arg(&a.drafter)
        .arg("--prompts")
        .arg(prompts)
        .arg("--max-new-tokens")
        .arg(a.max_new_tokens.to_string())
        .arg("--seed")
        .arg(a.seed.to_string())
        .args(["--engine", engine]);
    if a.json {
        cmd.arg("--json");
    }
    if !gpus.is_empty() {
        // The worker holds the target over every GPU it sees (ordinals 0..n); CUDA numbers
        // GPUs as NVML does.
        let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
        cmd.arg("--gpu")
            .env("CUDA_VISIBLE_DEVICES", list.join(","))
            .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    }
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .stdout(Stdio::inherit())
        .output()
        .map_err(|e| Error::start(format!("running {} eval", worker.display()), e))?;
    let line = crate::worker_output::error_line(&out.stderr);
    match out.status.code() {
        Some(exit_codes::SUCCESS) => Ok(exit_codes::SUCCESS),
        Some(exit_codes::RUN_FAILED) => {
            crate::say!("dflash-supervise: {line}");
            Ok(exit_codes::RUN_FAILED)
        }
        Some(exit_codes::USAGE) => Err(Error::Data(line.to_string().into())),
        _ => Err(Error::Helper {
            program: format!("{} eval", worker.display()),
            detail: format!("{} ({})", line, out.status),
        }),
    }
}
