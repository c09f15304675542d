//! Every bad input: one line on stderr naming the input and what was expected, exit 2,
//! never a panic.

mod common;

use std::fs;
use std::process::{Command, Stdio};

use common::*;

fn expect_usage_error(args: &[&str], needles: &[&str]) {
    expect_usage_error_env(args, needles, &[]);
}

fn expect_usage_error_env(args: &[&str], needles: &[&str], env: &[(&str, &str)]) {
    let mut cmd = std::process::Command::new(bin("dflash-supervise"));
    cmd.args(args).stdin(std::process::Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: stderr:\n{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one line, got:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: {err:?} does not mention {n:?}");
    }
}

#[test]
fn bad_gpu_specs() {
    expect_usage_error(&["--gpus", "7-3"], &["7-3", "expected"]);
    expect_usage_error(&["--gpus", "x"], &["'x'", "expected"]);
    expect_usage_error(&["--gpus", "cpu:0"], &["cpu:0", "at least 1"]);
    expect_usage_error(
        &["--gpus", "cpu:3", "--targets", "3"],
        &["--targets 3", "no drafter"],
    );
    expect_usage_error(&["--gpus", "cpu:2", "--targets", "0"], &["--targets 0"]);
}

#[test]
fn gpus_without_a_driver_suggest_cpu_workers() {
    let env = [("DFLASH_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1")];
    expect_usage_error_env(
        &["--gpus", "0-7"],
        &["--gpus 0,1,2,3,4,5,6,7", "no NVIDIA driver", "cpu:N"],
        &env,
    );
    expect_usage_error_env(&["--gpus", "all"], &["no NVIDIA driver", "cpu:N"], &env);
    expect_usage_error_env(
        &["--target-gpus", "0", "--drafter-gpus", "0"],
        &["--target-gpus 0", "cpu:N"],
        &env,
    );
}

#[test]
fn bad_flags_and_values() {
    expect_usage_error(&["--hang-timeout", "soon"], &["soon", "duration"]);
    expect_usage_error(&["--log-max-size", "12parsecs"], &["12parsecs", "size"]);
    expect_usage_error(&["--max-restarts", "-1"], &["-1"]);
    expect_usage_error(&["--frobnicate"], &["--frobnicate"]);
    expect_usage_error(
        &[
            "--gpus",
            "cpu:2",
            "--worker-bin",
            "/nonexistent/dflash-worker",
        ],
        &["/nonexistent/dflash-worker", "expected"],
    );
    expect_usage_error(
        &["--gpus", "cpu:2", "--data", "/nonexistent/d.jsonl"],
        &["--data /nonexistent/d.jsonl", "expected"],
    );
    expect_usage_error(
        &[
            "--gpus",
            "cpu:2",
            "--max-seq-len",
            "8192",
            "--token-budget",
            "4096",
        ],
        &["--max-seq-len 8192", "--token-budget 4096"],
    );
    expect_usage_error(
        &["--gpus", "cpu:2", "--data", "-", "--epochs", "2"],
        &["stdin", "--epochs 1"],
    );
    expect_usage_error(
        &["--gpus", "cpu:2", "--hidden-slots", "0"],
        &["--hidden-slots 0"],
    );
    expect_usage_error(
        &["--gpus", "cpu:2", "--taps", "1,6"],
        &["--taps", "layer 6 does not exist", "6 layers"],
    );
    expect_usage_error(
        &["--gpus", "cpu:2", "--target", "/nonexistent/model"],
        &["--target /nonexistent/model", "config.json"],
    );
    expect_usage_error(
        &["--gpus", "cpu:3", "--collective", "nccl"],
        &[
            "--collective nccl",
            "2 of the 2 drafters are CPU workers",
            "--collective shm",
        ],
    );
    expect_usage_error(
        &["--gpus", "cpu:3", "--collective", "mpi"],
        &["mpi", "--collective"],
    );
}

#[test]
fn pools_larger_than_memory_are_refused_up_front() {
    expect_usage_error(
        &["--gpus", "cpu:2", "--token-budget", "100000000"],
        &["shared-memory pools need", "available", "--token-budget"],
    );
}

#[test]
fn unwritable_or_used_run_dirs() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    fs::write(&file, "x").unwrap();
    let under_file = file.join("run");
    expect_usage_error(
        &["--gpus", "cpu:2", "--run-dir", under_file.to_str().unwrap()],
        &["--run-dir", "a-file/run", "expected"],
    );
    expect_usage_error(
        &["--gpus", "cpu:2", "--run-dir", file.to_str().unwrap()],
        &["not a directory"],
    );

    let used = tmp.path().join("used");
    fs::create_dir(&used).unwrap();
    fs::write(used.join("state.json"), "{}").unwrap();
    expect_usage_error(
        &["--gpus", "cpu:2", "--run-dir", used.to_str().unwrap()],
        &["already holds a run"],
    );
}

#[test]
fn logs_and_status_reject_what_is_not_there() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    let out = supervise(
        &[
            "--gpus",
            "cpu:2",
            "--time-limit",
            "200ms",
            "--max-seq-len",
            "32",
            "--token-budget",
            "256",
            "--run-dir",
            rd.to_str().unwrap(),
            "--worker-bin",
            bin("dflash-worker").to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(
        out.status.code(),
        Some(75),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rd = rd.to_str().unwrap();
    expect_usage_error(
        &["logs", "--run-dir", rd, "drafter-9"],
        &["drafter-9", "target-0, drafter-0"],
    );
    expect_usage_error(
        &["logs", "--run-dir", rd, "nonsense"],
        &["nonsense", "<role>-<rank>"],
    );
    let empty = tmp.path().join("empty");
    fs::create_dir(&empty).unwrap();
    expect_usage_error(
        &["logs", "--run-dir", empty.to_str().unwrap(), "target-0"],
        &["not a dflash-supervise run"],
    );
    expect_usage_error(
        &["status", "--run-dir", "/nonexistent/run"],
        &["/nonexistent/run", "no such directory"],
    );
    let out = supervise(&["status"], Some(tmp.path()));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no run found under runs/"));
}

/// A `--target` directory holding only a config.json: the tiny target's with `set` applied.
fn target_with_config(tmp: &std::path::Path, set: &[(&str, serde_json::Value)]) -> String {
    let dir = tmp.join("target");
    fs::create_dir_all(&dir).unwrap();
    let mut v: serde_json::Value =
        serde_json::from_str(dflash_shared::model_config::TINY_CONFIG).unwrap();
    for (k, x) in set {
        v[*k] = x.clone();
    }
    fs::write(dir.join("config.json"), v.to_string()).unwrap();
    dir.to_str().unwrap().to_string()
}

#[test]
fn issue_20_bounds_and_words() {
    // §1: a zero --collective-timeout is refused like every other zero duration.
    expect_usage_error(
        &["--gpus", "cpu:2", "--collective-timeout", "0s"],
        &["--collective-timeout 0s", "above zero"],
    );
    // §9: a negative value reaches the range check (not clap's "unexpected argument").
    expect_usage_error(
        &["--gpus", "cpu:2", "--gamma", "-1"],
        &["--gamma -1: expected a positive number"],
    );
    expect_usage_error(&["--gpus", "cpu:2", "--lr", "-1e-3"], &["--lr -0.001"]);
    expect_usage_error(
        &["--gpus", "cpu:2", "--warmup-ratio", "-0.1"],
        &["--warmup-ratio -0.1", "[0, 1)"],
    );
    // §3: CPU workers far past the cores are refused before any is planned or started.
    expect_usage_error(
        &["--gpus", "cpu:1024"],
        &["--gpus cpu:1024", "CPU workers on this machine", "at most"],
    );

    let tmp = tempfile::tempdir().unwrap();
    // §2: a config.json whose sizes would have the supervisor allocate by them until OOM
    // is refused at once, naming the field, its value and the range.
    let t = target_with_config(
        tmp.path(),
        &[("num_hidden_layers", 1_000_000_000u64.into())],
    );
    let started = std::time::Instant::now();
    expect_usage_error(
        &["--gpus", "cpu:2", "--target", &t],
        &[
            "--target",
            "config.json",
            "num_hidden_layers 1000000000",
            "expected 1 to 1024",
        ],
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "refused quickly: {:?}",
        started.elapsed()
    );
    // §8: --max-seq-len past the target's max_position_embeddings.
    let t = target_with_config(tmp.path(), &[("max_position_embeddings", 64.into())]);
    expect_usage_error(
        &["--gpus", "cpu:2", "--target", &t, "--max-seq-len", "128"],
        &["--max-seq-len 128", "max_position_embeddings 64"],
    );
    // Issue 39: τ prompts that with their new tokens pass the target's context.
    let t = tmp.path().join("tiny");
    let st = std::process::Command::new(bin("dflash-worker"))
        .args(["tiny-target", "--out"])
        .arg(&t)
        .status()
        .unwrap();
    assert!(st.success());
    let cfg = t.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&cfg).unwrap()).unwrap();
    v["max_position_embeddings"] = 64.into();
    fs::write(&cfg, v.to_string()).unwrap();
    let t = t.to_str().unwrap().to_string();
    let prompts = tmp.path().join("prompts.jsonl");
    let long: Vec<u32> = (1..=60).collect();
    fs::write(&prompts, format!("[1,2,3]\n{long:?}\n")).unwrap();
    let p = prompts.to_str().unwrap();
    expect_usage_error(
        &[
            "--gpus",
            "cpu:2",
            "--target",
            &t,
            "--max-seq-len",
            "32",
            "--eval-prompts",
            p,
            "--eval-max-new-tokens",
            "16",
        ],
        &["--eval-prompts", "prompt 2", "60 tokens", "context of 64"],
    );
    // Issue 39: eval data that is the training data.
    let data = tmp.path().join("train.jsonl");
    fs::write(&data, "[1,2,3]\n").unwrap();
    let d = data.to_str().unwrap();
    expect_usage_error(
        &["--gpus", "cpu:2", "--data", d, "--eval-data", d],
        &["--eval-data", "is the training data"],
    );
}

#[test]
fn prepare_of_chat_data_without_a_tokenizer_names_the_missing_tokenizer_json_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    // A model directory with a config.json and no tokenizer.json.
    let t = target_with_config(tmp.path(), &[]);
    let chat = tmp.path().join("chat.jsonl");
    let line = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}"#;
    fs::write(&chat, [line; 6].join("\n") + "\n").unwrap();
    let out = tmp.path().join("prepared.jsonl");
    let (chat_s, out_s) = (chat.to_str().unwrap(), out.to_str().unwrap());
    // One line (no per-line warnings before it), naming the file that is missing and the
    // line that needs it.
    expect_usage_error(
        &["prepare", "--target", &t, "--data", chat_s, "--out", out_s],
        &[
            &format!("--target {t}"),
            &format!("{t} has no tokenizer.json"),
            "--tokenizer DIR",
            &format!("{chat_s}:1 is a chat conversation"),
        ],
    );
    assert!(!out.exists(), "nothing written");
    // Pre-tokenized lines need no tokenizer: the same command prepares them.
    let tokens = tmp.path().join("tokens.jsonl");
    let line = r#"{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}"#;
    fs::write(&tokens, [line; 3].join("\n") + "\n").unwrap();
    let o = supervise(
        &[
            "prepare",
            "--target",
            &t,
            "--data",
            tokens.to_str().unwrap(),
            "--out",
            out_s,
        ],
        None,
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(fs::read_to_string(&out).unwrap().lines().count(), 3);
    // `bench prepare` has no default tokenizer (it was the build tree's).
    let o = supervise(&["bench", "prepare", "--json"], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--tokenizer <DIR>"), "{err}");
    assert!(o.stdout.is_empty(), "nothing measured");
}

#[test]
fn duplicate_taps_are_refused_naming_the_layer() {
    expect_usage_error(
        &["--gpus", "cpu:2", "--taps", "1,1"],
        &["--taps 1,1: layer 1 is given twice", "distinct"],
    );
}

/// `bench kernels` runs in a dflash-worker process; a missing cuobjdump (or a bad --arch)
/// is its one line on stderr and exit 2, passed through.
#[test]
fn bench_kernels_without_cuobjdump_or_with_a_bad_arch_is_one_line_and_exit_2() {
    let o = Command::new(bin("dflash-supervise"))
        .args(["bench", "kernels", "--arch", "sm_90"])
        .env("DFLASH_CUOBJDUMP", "/nonexistent/cuobjdump")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("cuobjdump not found") && err.contains("pip install nvidia-cuda-cuobjdump"),
        "{err}"
    );
    assert!(o.stdout.is_empty());
    let o = supervise(&["bench", "kernels", "--arch", "sm_75"], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--arch sm_75: expected sm_80, sm_90 or sm_100"),
        "{err}"
    );
}
