//! Recipe files (`--config FILE`): a whole run set by one file, the command line over it,
//! run.json recording what ran and from which file, a `--resume` with the same recipe, and
//! a file with an unknown key refused in one line.

mod common;

use std::fs;
use std::path::Path;

use common::*;
use serde_json::Value;

/// A run of the tiny target on two CPU workers, every section of the file but [eval],
/// [pipeline], [run], [telemetry] used.
const RECIPE: &str = r#"# a test recipe
[model]
target = "tiny"

[data]
data = "demo"
demo_samples = 64
max_seq_len = 96
token_budget = 512
seed = 3

[devices]
gpus = "cpu:2"

[drafter]
draft_layers = 1
block_size = 4
max_anchors = 8
gamma = 3.0

[schedule]
lr = 2e-3
warmup_ratio = 0.5
steps = 5

[checkpoints]
checkpoint_every = 1
keep_checkpoints = 2

[restarts]
hang_timeout = "90s"

[logs]
log_backups = 1
"#;

fn run_json(run_dir: &Path) -> Value {
    serde_json::from_str(&fs::read_to_string(run_dir.join("run.json")).unwrap()).unwrap()
}

fn last_step(run_dir: &Path) -> Option<u64> {
    read_jsonl(&run_dir.join("train.jsonl"))
        .iter()
        .filter_map(|r| r["step"].as_u64())
        .max()
}

#[test]
fn a_recipe_sets_the_run_the_command_line_wins_and_run_json_records_both() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = tmp.path().join("recipe.toml");
    fs::write(&recipe, RECIPE).unwrap();
    let rd = tmp.path().join("run");
    let (c, r) = (recipe.to_str().unwrap(), rd.to_str().unwrap());
    // --steps (no default) and --seed (a default of 0) typed: both win over the file.
    let out = supervise(
        &["--config", c, "--steps", "2", "--seed", "7", "--run-dir", r],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(
        last_step(&rd),
        Some(2),
        "--steps 2 typed wins over the file's 5"
    );

    let saved = run_json(&rd);
    // The settings as given: the file's, and the command line's over them.
    assert_eq!(
        (&saved["steps"], &saved["seed"]),
        (&Value::from(2), &Value::from(7)),
        "{saved}"
    );
    for (key, want) in [
        ("target", Value::from("tiny")),
        ("data", "demo".into()),
        ("demo_samples", 64.into()),
        ("max_seq_len", 96.into()),
        ("token_budget", 512.into()),
        ("draft_layers", 1.into()),
        ("block_size", 4.into()),
        ("max_anchors", 8.into()),
        ("gamma", 3.0.into()),
        ("lr", 2e-3.into()),
        ("warmup_ratio", 0.5.into()),
        ("checkpoint_every", 1.into()),
        ("keep_checkpoints", 2.into()),
        ("hang_timeout", "1m 30s".into()),
        ("log_backups", 1.into()),
    ] {
        assert_eq!(saved[key], want, "run.json {key}: {saved}");
    }
    let path = fs::canonicalize(&recipe).unwrap();
    assert_eq!(saved["config"], path.to_str().unwrap(), "{saved}");
    // The resolved settings: what the run used.
    let res = &saved["resolved"];
    assert_eq!(res["workers"].as_array().map(Vec::len), Some(2), "{res}");
    assert_eq!(res["drafter"]["block_size"], 4, "{res}");
    assert_eq!(res["lr"], 2e-3, "{res}");
    assert_eq!(res["seed"], 7, "{res}");
    assert_eq!(
        (&res["max_seq_len"], &res["token_budget"]),
        (&Value::from(96), &Value::from(512)),
        "{res}"
    );
    assert_eq!(res["schedule"]["total_steps"], 2, "{res}");
    assert_eq!(
        res["taps"].as_array().map(Vec::len),
        Some(1),
        "one drafter layer, one tap"
    );

    // A resume with the same recipe: what the file sets counts as given, as typed flags do,
    // so a kept setting the file gives otherwise than the run (seed 3 against the 7 typed at
    // the start) is refused, naming the flag...
    let out = supervise(&["--resume", r, "--config", c, "--steps", "3"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--seed 3 differs from this run's 7"), "{err}");
    // ...and with the same command line the run continues.
    let out = supervise(
        &["--resume", r, "--config", c, "--seed", "7", "--steps", "3"],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(last_step(&rd), Some(3), "{err}");
    let saved = run_json(&rd);
    assert_eq!(saved["steps"], 3, "{saved}");
    assert_eq!(saved["config"], path.to_str().unwrap(), "{saved}");
}

#[test]
fn an_unknown_key_is_refused_in_one_line_with_the_sections_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = tmp.path().join("typo.toml");
    fs::write(
        &recipe,
        "[drafter]\nlayers = 1\n\n[schedule]\nlr = 1e-3\nepoch = 6\n",
    )
    .unwrap();
    let rd = tmp.path().join("run");
    let (c, r) = (recipe.to_str().unwrap(), rd.to_str().unwrap());
    let out = supervise(&["--gpus", "cpu:2", "--config", c, "--run-dir", r], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(
        err.trim_end(),
        format!(
            "dflash-supervise: error: --config {c}: line 6: unknown key 'epoch' in [schedule] \
             (valid keys of [schedule]: lr, warmup_ratio, steps, epochs)"
        )
    );
    assert!(!rd.exists(), "nothing was started");

    fs::write(
        &recipe,
        "[model]\ntarget = \"tiny\"\n[optimiser]\nlr = 1e-3\n",
    )
    .unwrap();
    let out = supervise(&["--config", c, "--run-dir", r], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("--config {c}: line 3: unknown section [optimiser] (valid sections: model, data, devices, drafter, schedule, eval,")),
        "{err}"
    );
}
