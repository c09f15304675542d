//! `dflash-supervise bench train`: compute throughput of the target forward and of the
//! drafter step on CPU, each measured alone in one `dflash-worker` process (the supervisor
//! links no compute), against the whole pipeline (supervisor, target worker, drafter
//! worker, shared-memory pools) training on the same batches, in the same run. The
//! pipeline can go no faster than its slowest stage alone; the ratio says how close it
//! gets.
//!
//! With `--target-engine torch`, the torch engine (transformers' implementation of the same
//! checkpoint, in a Python child) is measured beside the native one on the same batches:
//! its target forward alone (in the same `dflash-worker` process) and its whole pipeline (a
//! run with `--target-engine torch`), with the ratios torch/native of both.
//!
//! Config: the tiny target (Qwen3 shape, hidden 64, 6 layers, taps 1 and 3), a 2-layer
//! drafter, blocks of 8, up to 32 anchors per sample, demo data, 2048-token batches.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use dflash_shared::batch::TokenBatch;
use dflash_shared::drafter::DrafterConfig;
use dflash_shared::model_config::{TargetConfig, TINY_CONFIG};
use dflash_shared::scratch::ScratchDir;

use crate::cli::{BenchTrainEngine, TargetEngine};
use crate::data::loader::{DataSource, Loader, LoaderConfig};
use crate::error::Error;

fn fail(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Bench {
        bench: "train",
        what: what.to_string(),
        source: e.to_string().into(),
    }
}

pub fn run(json: bool, steps: u64, engine: BenchTrainEngine) -> Result<i32, Error> {
    let steps = steps.max(3);
    let torch = engine == BenchTrainEngine::Torch;
    let target_cfg = TargetConfig::read(TINY_CONFIG).map_err(|e| fail("tiny config", e))?;
    if torch {
        // Python with torch and transformers, checked as a run checks it: refused in one
        // line naming what to install (exit 2) before anything is measured.
        crate::run::engine::pick(TargetEngine::Torch, &target_cfg, None)?;
    }
    let exe = std::env::current_exe().map_err(|e| fail("finding dflash-supervise", e))?;
    let worker = exe.with_file_name("dflash-worker");
    // A directory of this run's own, removed (with everything in it) when dropped.
    let tmp = ScratchDir::new("bench-train").map_err(|e| fail("temporary directory", e))?;
    let out = measure(&exe, &worker, tmp.path(), &target_cfg, steps, torch)?;
    drop(tmp);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(|e| fail("json", e))?
        );
    } else {
        println!("bench train (CPU, tiny target, 2-layer drafter, {steps} batches of up to 2048 tokens):");
        println!(
            "  target forward alone      {:>9.0} tokens/s",
            out["target_tokens_per_s"]
        );
        println!(
            "  drafter step alone        {:>9.0} tokens/s",
            out["drafter_tokens_per_s"]
        );
        println!(
            "  whole pipeline (cpu:2)    {:>9.0} tokens/s",
            out["pipeline_tokens_per_s"]
        );
        println!(
            "  rollback snapshot         {:>9.2} ms every {} step(s) of {:.0} ms: {:.2}% of step time (goal < 2%)",
            out["snapshot_ms"],
            out["snapshot_every_steps"],
            out["step_ms"],
            out["snapshot_share_of_step_time"] * 100.0
        );
        println!(
            "  pipeline / slowest stage  {:>9.2}   (target >= 0.95)",
            out["pipeline_vs_slowest_stage"]
        );
        if torch {
            println!("  torch engine (transformers in a Python child, f32), the same batches:");
            println!(
                "  target forward alone      {:>9.0} tokens/s   torch/native {:.2}",
                out["torch_target_tokens_per_s"], out["torch_vs_native_target"]
            );
            println!(
                "  whole pipeline (cpu:2)    {:>9.0} tokens/s   torch/native {:.2}",
                out["torch_pipeline_tokens_per_s"], out["torch_vs_native_pipeline"]
            );
            println!(
                "  pipeline / slowest stage  {:>9.2}",
                out["torch_pipeline_vs_slowest_stage"]
            );
        }
    }
    Ok(0)
}

fn measure(
    exe: &std::path::Path,
    worker: &std::path::Path,
    tmp: &std::path::Path,
    target_cfg: &TargetConfig,
    steps: u64,
    torch: bool,
) -> Result<BTreeMap<String, f64>, Error> {
    let batches = demo_batches(target_cfg, steps)?;
    let base = baseline(worker, tmp, target_cfg, &batches, torch)?;
    let run_dir = pipeline_run(exe, &tmp.join("run"), steps, "native")?;
    let (pipeline, secs, commits) = pipeline_throughput(&run_dir)?;
    let figure = |k: &str| {
        base[k]
            .as_f64()
            .ok_or_else(|| fail("baseline output", format!("no {k} in {base}")))
    };
    let (t, d) = (
        figure("target_tokens_per_s")?,
        figure("drafter_tokens_per_s")?,
    );
    let mut m = BTreeMap::new();
    m.insert("target_tokens_per_s".into(), t);
    m.insert("drafter_tokens_per_s".into(), d);
    m.insert("pipeline_tokens_per_s".into(), pipeline);
    m.insert("pipeline_vs_slowest_stage".into(), pipeline / t.min(d));
    m.insert("batches".into(), steps as f64);
    // The rollback snapshot's cost: its time over the steps between two snapshots.
    let state: serde_json::Value = std::fs::read_to_string(run_dir.join("state.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let step_ms = 1000.0 * secs / (commits.max(2) - 1) as f64;
    let (snap_ms, every) = (
        state["train"]["snapshot_ms"].as_f64().unwrap_or(0.0),
        state["train"]["snapshot_every"].as_f64().unwrap_or(1.0),
    );
    m.insert("step_ms".into(), step_ms);
    m.insert("snapshot_ms".into(), snap_ms);
    m.insert("snapshot_every_steps".into(), every);
    m.insert(
        "snapshot_share_of_step_time".into(),
        snap_ms / (every.max(1.0) * step_ms.max(1e-9)),
    );
    if torch {
        // The torch engine on the same batches: its forward alone (measured above, in the
        // same process as the native one) and its whole pipeline.
        let tt = figure("torch_target_tokens_per_s")?;
        let torch_dir = pipeline_run(exe, &tmp.join("run-torch"), steps, "torch")?;
        let (tp, _, _) = pipeline_throughput(&torch_dir)?;
        m.insert("torch_target_tokens_per_s".into(), tt);
        m.insert("torch_pipeline_tokens_per_s".into(), tp);
        m.insert("torch_vs_native_target".into(), tt / t);
        m.insert("torch_vs_native_pipeline".into(), tp / pipeline);
        m.insert("torch_pipeline_vs_slowest_stage".into(), tp / tt.min(d));
    }
    Ok(m)
}

/// A pipeline run's tokens/s from its `train.jsonl`, with the seconds and the commits they
/// were measured over: from the first commit to the last (start-up, loading and the first
/// batch, is not throughput).
pub(super) fn pipeline_throughput(run_dir: &std::path::Path) -> Result<(f64, f64, usize), Error> {
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(run_dir.join("train.jsonl"))
        .map_err(|e| fail("train.jsonl", e))?
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l.get("step").is_some())
        .collect();
    let (Some(first), Some(last)) = (lines.first(), lines.last()) else {
        return Err(fail("train.jsonl", "empty"));
    };
    let secs = (last["t"].as_f64().unwrap_or(0.0) - first["t"].as_f64().unwrap_or(0.0)) / 1000.0;
    let tokens: f64 = lines[1..]
        .iter()
        .map(|l| l["tokens"].as_f64().unwrap_or(0.0))
        .sum();
    Ok((tokens / secs.max(1e-9), secs, lines.len()))
}

/// `steps` batches of the demo data, as the pipeline run's loader makes them.
fn demo_batches(target_cfg: &TargetConfig, steps: u64) -> Result<Vec<TokenBatch>, Error> {
    let mut loader = Loader::new(LoaderConfig {
        source: DataSource::Demo { samples: 1024 },
        vocab_size: Some(target_cfg.vocab_size as u32),
        token_budget: 2048,
        max_seq_len: 1024,
        seed: 0,
        epochs: 1000,
        max_bad_lines: 0,
        shuffle_window: 4096,
        max_line_bytes: 1 << 20,
        chat: None,
        chat_error: None,
    });
    let mut batches = Vec::new();
    for _ in 0..steps {
        batches.push(
            loader
                .next_batch()
                .map_err(|e| fail("loader", e))?
                .ok_or_else(|| fail("loader", "ran out of demo data"))?,
        );
    }
    Ok(batches)
}

/// Each stage alone: the target forward and the drafter step over `batches`, measured by
/// the worker's `bench-compute` in one process (on the tiny target it writes to `tmp`);
/// with `torch`, the torch engine's target forward over them too.
fn baseline(
    worker: &std::path::Path,
    tmp: &std::path::Path,
    target_cfg: &TargetConfig,
    batches: &[TokenBatch],
    torch: bool,
) -> Result<serde_json::Value, Error> {
    let target_dir = tmp.join("target");
    let st = Command::new(worker)
        .arg("tiny-target")
        .arg("--out")
        .arg(&target_dir)
        .stdin(Stdio::null())
        .status();
    if !st.map(|s| s.success()).unwrap_or(false) {
        return Err(fail(
            "writing the tiny target",
            format!("{} tiny-target failed", worker.display()),
        ));
    }
    let spec = serde_json::json!({
        "target_dir": target_dir,
        "taps": [1, 3],
        "drafter": DrafterConfig::for_target(target_cfg, 2, 2, 8, 32),
        "lr": 3e-3,
        "seed": 0,
        "batches": batches,
        "torch": torch,
    });
    let spec_path = tmp.join("spec.json");
    std::fs::write(&spec_path, spec.to_string()).map_err(|e| fail("writing the spec", e))?;
    let out = Command::new(worker)
        .arg("bench-compute")
        .arg("--spec")
        .arg(&spec_path)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| fail("running the baseline", e))?;
    if !out.status.success() {
        return Err(fail(
            "the in-process baseline",
            String::from_utf8_lossy(&out.stderr),
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| fail("baseline output", e))
}

/// The whole pipeline (`cpu:2`) training `steps` batches of the same data with the target
/// engine `engine`, in `run_dir`; returns it.
fn pipeline_run(
    exe: &std::path::Path,
    run_dir: &std::path::Path,
    steps: u64,
    engine: &str,
) -> Result<std::path::PathBuf, Error> {
    let out = Command::new(exe)
        .args([
            "--gpus",
            "cpu:2",
            "--target",
            "tiny",
            "--data",
            "demo",
            "--seed",
            "0",
            "--token-budget",
            "2048",
            "--max-seq-len",
            "1024",
        ])
        .args([
            "--epochs",
            "1000",
            "--checkpoint-every",
            "0",
            "--steps",
            &steps.to_string(),
            "--target-engine",
            engine,
            "--run-dir",
        ])
        .arg(run_dir)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| fail("running the pipeline", e))?;
    if !out.status.success() {
        return Err(fail(
            &format!("the pipeline run (--target-engine {engine})"),
            String::from_utf8_lossy(&out.stderr),
        ));
    }
    Ok(run_dir.to_path_buf())
}
