//! Issue 10 §3 and §5: absurd settings and bad model directories are refused up front
//! (exit 2, one line), a model that breaks under a running worker stops the run at once
//! instead of spending the restart budget, a SIGTERM to the whole process group still
//! ends with the stop checkpoint, and flags given with --resume are not dropped.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;

/// Generous: the tests share two loaded cores.
const T: Duration = Duration::from_secs(180);

fn run_supervise(args: &[&str]) -> Output {
    Command::new(bin("dflash-supervise"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run dflash-supervise")
}

/// Exit 2 and one line on stderr mentioning every needle.
fn expect_usage_error(args: &[&str], needles: &[&str]) -> String {
    let out = run_supervise(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{args:?}: stderr:\n{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one line, got:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: {err:?} does not mention {n:?}");
    }
    err
}

#[test]
fn absurd_flags_are_refused_with_the_flag_and_what_is_expected() {
    let tmp = tempfile::tempdir().unwrap();
    let run_dir = tmp.path().join("run");
    let rd = run_dir.to_str().unwrap();
    // The worker program does not exist: a flag accepted by mistake would fail on it, with a
    // message that names --worker-bin instead of the flag.
    let base = [
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--run-dir",
        rd,
        "--worker-bin",
        "/nonexistent/dflash-worker",
    ];
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["--hang-timeout", "0s"],
            &["--hang-timeout 0s", "at least 1s"],
        ),
        (
            &["--block-size", "100000"],
            &["--block-size 100000", "at most 256"],
        ),
        (
            &[
                "--block-size",
                "64",
                "--max-seq-len",
                "32",
                "--token-budget",
                "64",
            ],
            &["--block-size 64", "--max-seq-len 32"],
        ),
        (&["--max-anchors", "0"], &["--max-anchors 0", "at least 1"]),
        (&["--lr", "1e20"], &["--lr 1e20", "at most 1"]),
        (&["--lr", "NaN"], &["--lr NaN"]),
        (
            &["--warmup-ratio", "1.5"],
            &["--warmup-ratio 1.5", "[0, 1)"],
        ),
        (&["--gamma", "0"], &["--gamma 0", "positive"]),
        (&["--steps", "0"], &["--steps 0", "at least 1"]),
        (
            &["--keep-checkpoints", "0"],
            &["--keep-checkpoints 0", "at least 1"],
        ),
        (
            &["--stop-timeout", "0s"],
            &["--stop-timeout 0s", "above zero"],
        ),
        (&["--stable-after", "0s"], &["--stable-after 0s"]),
        (
            &["--gpu-sample-interval", "0s"],
            &["--gpu-sample-interval 0s"],
        ),
        (&["--metrics-interval", "0s"], &["--metrics-interval 0s"]),
        (&["--time-limit", "0s"], &["--time-limit 0s"]),
    ];
    for (flags, needles) in cases {
        let mut args = base.to_vec();
        args.extend_from_slice(flags);
        expect_usage_error(&args, needles);
    }
    assert!(!run_dir.exists(), "nothing was started");
}

#[test]
fn a_drafter_that_cannot_fit_in_memory_is_refused_before_start() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    // 64 layers with 256-token blocks for 1024 anchors: far more activations than memory. (Were it
    // accepted, --steps 1 and --max-restarts 0 end the run at the drafter's first failure.)
    expect_usage_error(
        &[
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--steps",
            "1",
            "--max-restarts",
            "0",
            "--run-dir",
            rd.to_str().unwrap(),
            "--taps",
            "1,4",
            "--draft-layers",
            "64",
            "--block-size",
            "256",
            "--max-anchors",
            "1024",
        ],
        &[
            "the workers need about",
            "available",
            "--max-anchors 1024 × --block-size 256",
            "--draft-layers",
        ],
    );
    assert!(!rd.exists(), "nothing was started");
}

#[test]
fn a_non_empty_directory_without_a_run_is_not_used_as_the_run_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("mine");
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("notes.txt"), "my notes").unwrap();
    expect_usage_error(
        &[
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--steps",
            "1",
            "--run-dir",
            dir.to_str().unwrap(),
        ],
        &[
            "--run-dir",
            "not empty",
            "notes.txt",
            "expected a new or empty directory",
        ],
    );
    let left: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["notes.txt"], "nothing was written into it");
    assert_eq!(
        fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "my notes"
    );
}

#[test]
fn data_files_with_a_utf8_bom_train_and_logs_of_a_run_without_logs_dir_say_so() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    fs::create_dir(&data).unwrap();
    for (i, f) in ["a.jsonl", "b.jsonl"].iter().enumerate() {
        let mut bytes = b"\xEF\xBB\xBF".to_vec();
        for j in 0..3 {
            let ids: Vec<String> = (0..12)
                .map(|k| ((i * 50 + j * 13 + k) % 500 + 1).to_string())
                .collect();
            bytes
                .extend_from_slice(format!("{{\"input_ids\": [{}]}}\n", ids.join(", ")).as_bytes());
        }
        fs::write(data.join(f), bytes).unwrap();
    }
    let rd = tmp.path().join("run");
    let out = run_supervise(&[
        "--gpus",
        "cpu:2",
        "--data",
        data.to_str().unwrap(),
        "--steps",
        "1",
        "--run-dir",
        rd.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        !err.contains("not JSON"),
        "a leading BOM is not a bad line:\n{err}"
    );
    let pre: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(rd.join("preflight.json")).unwrap()).unwrap();
    assert_eq!(pre["lines"], 6, "{pre}");
    assert_eq!(pre["kept"], 6, "line 1 of each file is kept: {pre}");

    // The run's logs/ went missing: `logs` says so instead of printing nothing with exit 0.
    fs::remove_dir_all(rd.join("logs")).unwrap();
    expect_usage_error(
        &["logs", "--run-dir", rd.to_str().unwrap(), "target-0"],
        &["logs", "no such directory"],
    );
    expect_usage_error(
        &["logs", "--run-dir", rd.to_str().unwrap(), "--all"],
        &["logs", "no such directory"],
    );
}

/// The built-in tiny target written as a Hugging Face directory.
fn tiny_target(dir: &Path) -> PathBuf {
    let t = dir.join("target");
    let out = Command::new(bin("dflash-worker"))
        .args(["tiny-target", "--out", t.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    t
}

/// Rewrite `src` (a safetensors file) into `dst` through `f` (name, dtype, shape, bytes).
fn rewrite(
    src: &Path,
    dst: &Path,
    f: impl Fn(
        &str,
        safetensors::Dtype,
        Vec<usize>,
        Vec<u8>,
    ) -> Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>,
) {
    let bytes = fs::read(src).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        if let Some((d, s, b)) = f(
            &name,
            view.dtype(),
            view.shape().to_vec(),
            view.data().to_vec(),
        ) {
            kept.push((name, d, s, b));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = kept
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, dst).unwrap();
}

#[test]
fn a_bad_target_directory_is_refused_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tiny_target(tmp.path());
    let model = good.join("model.safetensors");
    let copy = |name: &str| {
        let d = tmp.path().join(name);
        fs::create_dir(&d).unwrap();
        fs::copy(good.join("config.json"), d.join("config.json")).unwrap();
        d
    };
    let rd = tmp.path().join("run");
    // --max-restarts 0: were a case missed, the run would end with exit 1 at the first
    // failure rather than spend minutes in backoff.
    let args = |target: &Path| -> Vec<String> {
        [
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--steps",
            "1",
            "--max-restarts",
            "0",
            "--run-dir",
            rd.to_str().unwrap(),
            "--target",
            target.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let refuse = |target: &Path, needles: &[&str]| {
        let a = args(target);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        expect_usage_error(&a, needles);
        assert!(!rd.exists(), "no run was started for {}", target.display());
    };

    // Truncated (an interrupted download).
    let d = copy("truncated");
    let bytes = fs::read(&model).unwrap();
    fs::write(d.join("model.safetensors"), &bytes[..bytes.len() - 1000]).unwrap();
    refuse(
        &d,
        &["truncated/model.safetensors", "truncated safetensors file"],
    );

    // A dtype the workers do not read.
    let d = copy("int8");
    rewrite(&model, &d.join("model.safetensors"), |n, dt, s, b| {
        if n == "model.layers.0.mlp.up_proj.weight" {
            let numel = s.iter().product();
            Some((safetensors::Dtype::I8, s, vec![0u8; numel]))
        } else {
            Some((dt, s, b))
        }
    });
    refuse(
        &d,
        &[
            "int8/model.safetensors",
            "model.layers.0.mlp.up_proj.weight has dtype I8",
            "expected bf16, f16 or f32",
        ],
    );

    // A shape that disagrees with config.json.
    let d = copy("shape");
    fs::copy(&model, d.join("model.safetensors")).unwrap();
    let cfg = fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 128", "\"intermediate_size\": 96");
    assert!(cfg.contains("96"), "the tiny config changed: {cfg}");
    fs::write(d.join("config.json"), cfg).unwrap();
    refuse(
        &d,
        &[
            "shape/model.safetensors",
            "has shape",
            "expected",
            "from config.json",
        ],
    );

    // Shards: one listed in the index is missing.
    let d = copy("shards");
    let mut names: Vec<String> = Vec::new();
    rewrite(
        &model,
        &d.join("model-00001-of-00002.safetensors"),
        |n, dt, s, b| n.contains("layers.").then_some((dt, s, b)),
    );
    rewrite(
        &model,
        &d.join("model-00002-of-00002.safetensors"),
        |n, dt, s, b| (!n.contains("layers.")).then_some((dt, s, b)),
    );
    let st_bytes = fs::read(&model).unwrap();
    let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
    names.extend(st.names().into_iter().map(str::to_string));
    let map: serde_json::Map<String, serde_json::Value> = names
        .iter()
        .map(|n| {
            (
                n.clone(),
                if n.contains("layers.") {
                    "model-00001-of-00002.safetensors"
                } else {
                    "model-00002-of-00002.safetensors"
                }
                .into(),
            )
        })
        .collect();
    fs::write(
        d.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    // First the complete shards are accepted (the run trains its one step)...
    let a = args(&d);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let out = run_supervise(&a);
    assert_eq!(
        out.status.code(),
        Some(0),
        "sharded target: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    fs::remove_dir_all(&rd).unwrap();
    // ...then one goes missing.
    fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
    refuse(
        &d,
        &[
            "model-00002-of-00002.safetensors: missing",
            "model.safetensors.index.json",
        ],
    );
}

#[test]
fn a_target_that_breaks_under_a_running_worker_stops_the_run_at_once() {
    // Data from an empty stdin held open: the workers are up and idle.
    let mut sup = Sup::start_real(&["--gpus", "cpu:2", "--max-restarts", "10"]);
    let st = sup.wait_running(2);
    let model = sup.run_dir.join("target").join("model.safetensors");
    sup.wait_state("target-0 to have loaded the model", T, |_| {
        sup.log("target-0").contains("target loaded")
    });
    let bytes = fs::read(&model).unwrap();
    fs::write(&model, &bytes[..bytes.len() - 1000]).unwrap();
    signal(pid_of(&st, "target-0"), Signal::SIGKILL);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "stderr:\n{err}");
    assert!(
        err.contains("cannot load the target model") && err.contains("truncated"),
        "the worker's reason is given:\n{err}"
    );
    let st = sup.state().unwrap();
    let restarts = worker(&st, "target-0")["restarts"].as_u64().unwrap();
    assert_eq!(
        restarts, 1,
        "restarted once (after the SIGKILL), never again for a permanent failure: {st}"
    );
    assert!(
        sup.log("target-0").contains("(permanent, do not restart)"),
        "{}",
        sup.log("target-0")
    );
}

/// train.jsonl's step lines (not rollback or other records).
fn steps(run_dir: &Path) -> Vec<u64> {
    read_jsonl(&run_dir.join("train.jsonl"))
        .iter()
        .filter(|l| l.get("loss").is_some())
        .filter_map(|l| l["step"].as_u64())
        .collect()
}

#[test]
fn sigterm_to_the_whole_group_still_ends_with_the_stop_checkpoint() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--steps",
        "1000",
        "--checkpoint-every",
        "1000",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    wait_for("three committed steps", T, || {
        (steps(&sup.run_dir).len() >= 3).then_some(())
    });
    let st = sup.state().unwrap();
    let workers: Vec<u32> = st["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|w| w["pid"].as_u64())
        .map(|p| p as u32)
        .collect();
    assert_eq!(workers.len(), 2, "{st}");
    // What Slurm, systemd and a cgroup stop do: everyone at once.
    sup.signal(Signal::SIGTERM);
    for &pid in &workers {
        signal(pid, Signal::SIGTERM);
    }
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(75), "stderr:\n{err}");
    let last = *steps(&sup.run_dir).last().unwrap();
    let ckpt = sup
        .run_dir
        .join("checkpoints")
        .join(format!("step-{last:08}"));
    let meta: serde_json::Value = serde_json::from_str(&fs::read_to_string(ckpt.join("meta.json")).unwrap_or_else(|e| {
        panic!("no stop checkpoint of the last step {last} ({e}); checkpoints: {:?}\nstderr:\n{err}", fs::read_dir(sup.run_dir.join("checkpoints")).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>()))
    }))
    .unwrap();
    assert_eq!(meta["step"], last, "{meta}");
    assert!(
        sup.run_dir.join("drafter").join("config.json").is_file(),
        "the drafter was exported:\n{err}"
    );
    assert!(
        err.contains(&format!("drafter (step {last}) written to")),
        "{err}"
    );
    assert!(
        sup.log("drafter-0")
            .contains("working on until its stop order"),
        "the worker saw the signal and kept going:\n{}",
        sup.log("drafter-0")
    );
}

#[test]
fn flags_given_with_resume_win_or_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    let rds = rd.to_str().unwrap();
    let out = run_supervise(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "20",
        "--steps",
        "3",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--run-dir",
        rds,
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(steps(&rd).last(), Some(&3));

    // A setting that would change the batches or the drafter is refused, naming the flag.
    expect_usage_error(
        &["--gpus", "cpu:2", "--resume", rds, "--block-size", "4"],
        &["--block-size 4 differs from this run's", "--steps"],
    );
    expect_usage_error(
        &["--gpus", "cpu:2", "--resume", rds, "--max-seq-len", "32"],
        &["--max-seq-len 32 differs from this run's 64"],
    );

    // --steps given with --resume wins over the saved 3.
    let out = run_supervise(&[
        "--gpus",
        "cpu:2",
        "--resume",
        rds,
        "--steps",
        "6",
        "--max-seq-len",
        "64",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("--steps 6 replaces this run's 3"), "{err}");
    assert!(err.contains("drafter (step 6) written to"), "{err}");
    assert_eq!(steps(&rd).last(), Some(&6), "{err}");
    let saved: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(rd.join("run.json")).unwrap()).unwrap();
    assert_eq!(
        saved["steps"], 6,
        "run.json holds the run's settings as now: {saved}"
    );
}

#[test]
fn a_loader_that_panics_ends_the_run_with_one_line_instead_of_a_hang() {
    // A bug in the loader or in a tokenizer meeting a line it cannot handle panics on the
    // loader's thread. The run ends (exit 2) saying which batch, with every batch that was
    // made accounted for; before, it waited forever for a loader that was gone.
    let mut sup = Sup::start_real_env(
        &[
            "--gpus", "cpu:2", "--data", "demo", "--epochs", "50", "--steps", "40",
        ],
        &[("DFLASH_TEST_LOADER_PANIC", "3")],
    );
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("the data loader failed while making batch 3")
            && err.contains("test fault: the loader panics at batch 3"),
        "{err}"
    );
    let out = Command::new(bin("dflash-supervise"))
        .args(["ledger", "--json", "--run-dir"])
        .arg(&sup.run_dir)
        .output()
        .unwrap();
    let a: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(
        (a["lost"].as_u64(), a["duplicated"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
}

#[test]
fn a_second_supervisor_on_a_run_dir_in_use_is_told_another_supervisor_uses_it() {
    // A supervisor running in it (state.json written).
    let sup = Sup::start_real(&["--gpus", "cpu:2"]);
    sup.wait_running(2);
    let rd = sup.run_dir.to_str().unwrap().to_string();
    expect_usage_error(
        &["--gpus", "cpu:2", "--data", "demo", "--run-dir", &rd],
        &[&format!("--run-dir {rd}"), "another supervisor is using it"],
    );
    // A supervisor that has only just taken a new directory: its .lock held, nothing else.
    let tmp = tempfile::tempdir().unwrap();
    let fresh = tmp.path().join("fresh");
    fs::create_dir(&fresh).unwrap();
    let lock = fs::File::create(fresh.join(".lock")).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a file descriptor this test owns.
    assert_eq!(
        unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    let err = expect_usage_error(
        &[
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--run-dir",
            fresh.to_str().unwrap(),
        ],
        &["another supervisor is using it"],
    );
    assert!(!err.contains("not empty"), "{err}");
    drop(lock);
}

#[test]
fn a_killed_reaper_is_noticed_with_one_warning_and_the_run_goes_on() {
    let mut sup = Sup::start_real(&["--gpus", "cpu:2"]);
    sup.wait_running(2);
    let reaper = wait_for("the reaper process", T, || {
        children(sup.pid()).into_iter().find(|p| {
            fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == b"__reap"))
        })
    });
    signal(reaper, Signal::SIGKILL);
    let needle = format!("the reaper (pid {reaper}) was killed by SIGKILL");
    wait_for("the warning about the reaper", T, || {
        sup.stderr().contains(&needle).then_some(())
    });
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(T).code(), Some(75), "{}", sup.stderr());
    let err = sup.stderr();
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("the reaper")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains("warning:")
            && lines[0].contains("processes forked by workers are no longer killed"),
        "{}",
        lines[0]
    );
}
