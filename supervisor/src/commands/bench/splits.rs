//! `dflash-supervise bench train --splits`: what `--targets auto` trains against every
//! fixed split, in the same run. Four CPU workers train the demo data on the tiny target
//! for the same time with `--targets 1`, `2` and `3`, then with `--targets auto`; each
//! run's tokens/s trained is taken from its train.jsonl, from its first committed step to
//! its last (start-up is not throughput; auto's measuring and moves are).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};

use dflash_shared::scratch::ScratchDir;

use crate::error::Error;
use crate::run::rundir::{read_jsonl, EVENTS_FILE};

const DEVICES: u32 = 4;

fn fail(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Bench {
        bench: "train --splits",
        what: what.to_string(),
        source: e.to_string().into(),
    }
}

pub fn run(json: bool, seconds: u64) -> Result<i32, Error> {
    let exe = std::env::current_exe().map_err(|e| fail("finding dflash-supervise", e))?;
    let tmp = ScratchDir::new("bench-splits").map_err(|e| fail("temporary directory", e))?;
    let mut out = BTreeMap::new();
    let mut fixed = Vec::new();
    for t in 1..DEVICES {
        let targets = t.to_string();
        let dir = tmp.path().join(format!("targets-{t}"));
        let tps = trained(&exe, &dir, &targets, seconds)?;
        out.insert(format!("targets_{t}_tokens_per_s"), serde_json::json!(tps));
        fixed.push((t, tps));
    }
    let dir = tmp.path().join("auto");
    let auto = trained(&exe, &dir, "auto", seconds)?;
    let moves = role_moves(&dir);
    let start = start_targets(&dir);
    let (best_t, best) = fixed
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((1, 0.0));
    out.insert("auto_tokens_per_s".into(), serde_json::json!(auto));
    out.insert("auto_moves".into(), serde_json::json!(moves));
    out.insert("auto_start_targets".into(), serde_json::json!(start));
    out.insert("best_fixed_targets".into(), serde_json::json!(best_t));
    out.insert(
        "auto_vs_best_fixed".into(),
        serde_json::json!(auto / best.max(1e-9)),
    );
    out.insert("seconds_per_run".into(), serde_json::json!(seconds));
    drop(tmp);
    if json {
        let text = serde_json::to_string_pretty(&out).map_err(|e| fail("json", e))?;
        println!("{text}");
        return Ok(0);
    }
    println!("bench train --splits (cpu:{DEVICES}, tiny target, demo data, {seconds} s per run):");
    for (t, tps) in &fixed {
        let mark = if *t == best_t { "  <- best fixed" } else { "" };
        println!("  --targets {t}        {tps:>9.0} tokens/s trained{mark}");
    }
    println!(
        "  --targets auto     {auto:>9.0} tokens/s trained ({} move(s): {})",
        moves.len(),
        moves.join(", ")
    );
    println!(
        "  auto / best fixed  {:>9.2}   (goal >= 0.9)",
        auto / best.max(1e-9)
    );
    Ok(0)
}

/// Trains cpu:4 with `--targets targets` in `dir` for `seconds`: its tokens/s trained.
fn trained(exe: &Path, dir: &Path, targets: &str, seconds: u64) -> Result<f64, Error> {
    let out = Command::new(exe)
        .args(["--gpus", &format!("cpu:{DEVICES}"), "--targets", targets])
        .args(["--target", "tiny", "--data", "demo", "--epochs", "1000"])
        .args(["--checkpoint-every", "0", "--metrics-interval", "2s"])
        .args(["--time-limit", &format!("{seconds}s"), "--run-dir"])
        .arg(dir)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| fail("running the pipeline", e))?;
    // Stopped by its time limit: exit 75.
    if !matches!(out.status.code(), Some(0 | 75)) {
        return Err(fail(
            &format!("the run with --targets {targets}"),
            String::from_utf8_lossy(&out.stderr),
        ));
    }
    let (tps, _, _) = super::train::pipeline_throughput(dir)?;
    Ok(tps)
}

/// The target workers the run in `dir` started with (its `run_start` event).
fn start_targets(dir: &Path) -> usize {
    read_jsonl(&dir.join(EVENTS_FILE))
        .0
        .into_iter()
        .find(|e| e["event"] == "run_start")
        .and_then(|e| {
            let workers = e["workers"].as_array()?;
            let targets = workers.iter().filter_map(|w| w.as_str());
            Some(targets.filter(|w| w.starts_with("target")).count())
        })
        .unwrap_or(0)
}

/// The moves of the run in `dir` (`from → to`), from its events.
fn role_moves(dir: &Path) -> Vec<String> {
    read_jsonl(&dir.join(EVENTS_FILE))
        .0
        .into_iter()
        .filter(|e| e["event"] == "role_move")
        .map(|e| {
            format!(
                "{} → {}",
                e["from"].as_str().unwrap_or("?"),
                e["to"].as_str().unwrap_or("?")
            )
        })
        .collect()
}
