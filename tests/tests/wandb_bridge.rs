//! scripts/wandb_bridge.py logs a run's metrics to W&B (offline mode). Skipped, with a
//! message, where the wandb package is not installed (.ci/run installs it).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

fn python_has_wandb() -> bool {
    Command::new("python3")
        .args(["-c", "import wandb"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Whether to skip for want of the wandb package: never under CI (.ci/run installs it).
fn skip_without_wandb() -> bool {
    if python_has_wandb() {
        return false;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "the wandb Python package is missing: under CI this test may not skip (.ci/run installs it)"
    );
    eprintln!("SKIPPED: the wandb Python package is not installed (pip install wandb)");
    true
}

#[test]
fn the_bridge_logs_every_window_and_step_offline() {
    if skip_without_wandb() {
        return;
    }
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--steps",
        "6",
        "--metrics-interval",
        "200ms",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    assert_eq!(
        sup.wait_exit(Duration::from_secs(60)).code(),
        Some(0),
        "{}",
        sup.stderr()
    );
    let windows = read_jsonl(&sup.run_dir.join("metrics.jsonl")).len();
    let wandb_dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/wandb_bridge.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&sup.run_dir)
        .args(["--project", "dflash-test", "--name", "bridge-test"])
        .env("WANDB_MODE", "offline")
        .env("WANDB_DIR", wandb_dir.path())
        .env("WANDB_SILENT", "true")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains(&format!("logged {} records", 6 + windows)),
        "6 steps and {windows} windows: {stdout}"
    );
    let runs: Vec<_> = std::fs::read_dir(wandb_dir.path().join("wandb"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("offline-run-"))
        .collect();
    assert_eq!(runs.len(), 1, "one offline W&B run");
    let has_data = std::fs::read_dir(runs[0].path())
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().ends_with(".wandb"));
    assert!(has_data, "the offline run holds a .wandb log");
    // A directory that is not a run: a clear error, exit 2.
    let out = Command::new("python3")
        .arg(&script)
        .arg(wandb_dir.path())
        .env("WANDB_MODE", "offline")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a dflash-supervise run directory"));
}

/// RUN_DIR/wandb.json once the bridge has finished (its last `global_step` written).
fn finished_bridge(run_dir: &Path, after: u64) -> serde_json::Value {
    wait_for("the W&B bridge's end", Duration::from_secs(60), || {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run_dir.join("wandb.json")).ok()?)
                .ok()?;
        (v["finished_global_step"].as_u64()? > after).then_some(v)
    })
}

/// `--wandb-project`: the supervisor runs the bridge itself (offline here) and the W&B
/// run's id is kept in RUN_DIR/wandb.json. A run killed after step 5 with its newest
/// checkpoint at step 3 and then resumed trains steps 4 and 5 again: the bridge logs them
/// again (W&B's `global_step` goes on, never back) into the same W&B run.
#[test]
fn the_supervisor_runs_the_bridge_and_a_resume_logs_the_retrained_steps_into_the_same_wandb_run() {
    if skip_without_wandb() {
        return;
    }
    let wandb_dir = tempfile::tempdir().unwrap();
    let wd = wandb_dir.path().to_str().unwrap();
    let env = [("WANDB_DIR", wd), ("WANDB_SILENT", "true")];
    let mut sup = Sup::start_real_env(
        &[
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--steps",
            "100000",
            "--checkpoint-every",
            "3",
            "--metrics-interval",
            "200ms",
            "--max-seq-len",
            "64",
            "--token-budget",
            "512",
            "--wandb-project",
            "dflash-test",
            "--wandb-mode",
            "offline",
            // Slow steps, so that the kill lands between checkpoints.
            "--max-anchors",
            "4",
        ],
        &env,
    );
    let steps_in = |sup: &Sup| -> Vec<u64> {
        read_jsonl(&sup.run_dir.join("train.jsonl"))
            .iter()
            .filter_map(|l| l["step"].as_u64())
            .collect()
    };
    wait_for("step 5", Duration::from_secs(60), || {
        (steps_in(&sup).len() >= 5).then_some(())
    });
    sup.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = sup.wait_exit(Duration::from_secs(30));
    assert!(
        sup.stderr().contains("W&B: project dflash-test"),
        "{}",
        sup.stderr()
    );
    let first = finished_bridge(&sup.run_dir, 0);
    let killed_at = *steps_in(&sup).last().unwrap();
    let id = first["id"].as_str().unwrap().to_string();
    // The newest complete checkpoint (a kill may land right on one: then nothing is
    // trained again).
    let newest = std::fs::read_dir(sup.run_dir.join("checkpoints"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().join("meta.json").is_file())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("step-")?
                .parse::<u64>()
                .ok()
        })
        .max()
        .unwrap_or(0);

    let rd = sup.run_dir.to_str().unwrap();
    let out = Command::new(bin("dflash-supervise"))
        .args([
            "--gpus",
            "cpu:2",
            "--resume",
            rd,
            "--steps",
            &(killed_at + 2).to_string(),
        ])
        .envs(env)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps = steps_in(&sup);
    let retrained: Vec<u64> = steps
        .iter()
        .enumerate()
        .filter(|(i, s)| steps[..*i].contains(s))
        .map(|(_, s)| *s)
        .collect();
    assert!(
        newest >= killed_at || !retrained.is_empty(),
        "steps after the checkpoint of step {newest} trained again: {steps:?}"
    );
    let second = finished_bridge(
        &sup.run_dir,
        first["finished_global_step"].as_u64().unwrap(),
    );
    assert_eq!(second["id"], id.as_str(), "the same W&B run: {second}");
    let records = read_jsonl(&sup.run_dir.join("train.jsonl")).len() as u64
        + read_jsonl(&sup.run_dir.join("metrics.jsonl")).len() as u64;
    assert_eq!(
        second["finished_global_step"], records,
        "every record once, the retrained steps {retrained:?} included: {second}"
    );
    let runs: Vec<String> = std::fs::read_dir(wandb_dir.path().join("wandb"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("offline-run-"))
        .collect();
    assert!(
        runs.len() == 2 && runs.iter().all(|n| n.ends_with(&id)),
        "{runs:?}"
    );
}

/// The pid of the bridge logging `run_dir`, if one runs.
fn bridge_pid(run_dir: &Path) -> Option<i32> {
    let want = run_dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<String> = cmd
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        (args.iter().any(|a| a.ends_with("wandb_bridge.py")) && args.contains(&want)).then_some(pid)
    })
}

/// A bridge that dies is started again by the supervisor, and training goes on.
#[test]
fn a_killed_bridge_is_started_again_and_training_goes_on() {
    if skip_without_wandb() {
        return;
    }
    let wandb_dir = tempfile::tempdir().unwrap();
    let wd = wandb_dir.path().to_str().unwrap();
    let mut sup = Sup::start_real_env(
        &[
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--steps",
            "100000",
            "--time-limit",
            "90s",
            "--max-seq-len",
            "64",
            "--token-budget",
            "512",
            "--wandb-project",
            "dflash-test",
            "--wandb-mode",
            "offline",
        ],
        &[("WANDB_DIR", wd), ("WANDB_SILENT", "true")],
    );
    let first = wait_for("the bridge", Duration::from_secs(30), || {
        bridge_pid(&sup.run_dir)
    });
    // SAFETY: signalling a process of this test's own run.
    unsafe { libc::kill(first, libc::SIGKILL) };
    wait_for("the restart said", Duration::from_secs(30), || {
        sup.stderr().contains("the W&B bridge exited").then_some(())
    });
    let second = wait_for("a new bridge", Duration::from_secs(30), || {
        bridge_pid(&sup.run_dir).filter(|&p| p != first)
    });
    assert_ne!(first, second);
    let steps = read_jsonl(&sup.run_dir.join("train.jsonl")).len();
    wait_for("training goes on", Duration::from_secs(30), || {
        (read_jsonl(&sup.run_dir.join("train.jsonl")).len() > steps).then_some(())
    });
    sup.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(30)).code(), Some(75));
}
