//! A user's training run from start to finish: the learning-rate schedule, resolved
//! settings on record, Slurm's requeue and pre-emption notice, a finished run resumed, a
//! failed start retried.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use serde_json::Value;

const T: Duration = Duration::from_secs(120);

/// `lines` pre-tokenized samples of `len` tokens (ids below the tiny target's 512).
fn token_file(dir: &Path, lines: usize, len: usize) -> PathBuf {
    let p = dir.join("data.jsonl");
    let mut text = String::new();
    for i in 0..lines {
        let ids: Vec<String> = (0..len)
            .map(|j| ((i * 7 + j * 3) % 500 + 1).to_string())
            .collect();
        text.push_str(&format!("{{\"input_ids\": [{}]}}\n", ids.join(",")));
    }
    std::fs::write(&p, text).unwrap();
    p
}

fn run_json(run_dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(run_dir.join("run.json")).unwrap()).unwrap()
}

fn steps(run_dir: &Path) -> Vec<Value> {
    read_jsonl(&run_dir.join("train.jsonl"))
        .into_iter()
        .filter(|r| r["step"].is_u64() && r["lr"].is_f64())
        .collect()
}

fn run_to_end(args: &[&str]) -> (i32, String) {
    let out = supervise(args, None);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn without_steps_the_learning_rate_warms_up_and_decays_over_the_data() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--demo-samples",
        "96",
        "--token-budget",
        "512",
        "--max-seq-len",
        "128",
        "--epochs",
        "2",
        "--warmup-ratio",
        "0.25",
    ]);
    let code = sup.wait_exit(T).code();
    let err = sup.stderr();
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains("schedule: peak lr"),
        "the schedule is printed at start: {err}"
    );
    let resolved = &run_json(&sup.run_dir)["resolved"];
    let total = resolved["schedule"]["total_steps"]
        .as_u64()
        .unwrap_or_else(|| panic!("the schedule's length is recorded: {resolved}"));
    let s = steps(&sup.run_dir);
    let n = s.len() as u64;
    assert!(n >= 4, "{n} steps");
    // The demo data's epoch is counted before the start: the schedule ends with the data.
    assert_eq!(total, n, "cosine to 0 at the last step the data gives");
    let peak = resolved["lr"].as_f64().unwrap();
    let lr = |i: usize| s[i]["lr"].as_f64().unwrap();
    assert!(
        lr(0) < 0.75 * peak,
        "warmup: step 1 at lr {} of {peak}",
        lr(0)
    );
    let top = s
        .iter()
        .map(|r| r["lr"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(
        (top - peak).abs() < 1e-9 * peak,
        "reaches the peak {peak}: {top}"
    );
    assert!(
        lr(s.len() - 1) < 0.2 * peak,
        "decays to near 0 by the end: last lr {} of {peak}",
        lr(s.len() - 1)
    );
}

#[test]
fn steps_beyond_the_data_are_refused_with_epochs_and_cycle_the_data_without() {
    let tmp = tempfile::tempdir().unwrap();
    // 20 samples of 64 tokens, 2 per batch at --token-budget 128: 10 steps an epoch.
    let data = token_file(tmp.path(), 20, 64);
    let data = data.to_str().unwrap();
    let run = tmp.path().join("refused");
    let (code, err) = run_to_end(&[
        "--gpus",
        "cpu:2",
        "--data",
        data,
        "--token-budget",
        "128",
        "--max-seq-len",
        "64",
        "--steps",
        "500",
        "--epochs",
        "1",
        "--run-dir",
        run.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("--steps 500"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.contains("--epochs 1") && line.contains("about 10 steps"),
        "{line}"
    );
    assert!(!run.exists(), "a refused start leaves no run directory");

    // Without --epochs the data is cycled up to --steps, said at start.
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        data,
        "--token-budget",
        "128",
        "--max-seq-len",
        "64",
        "--steps",
        "25",
    ]);
    let code = sup.wait_exit(T).code();
    let err = sup.stderr();
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("cycled"), "{err}");
    let s = steps(&sup.run_dir);
    assert_eq!(
        s.last().unwrap()["step"],
        25,
        "--steps reached over 3 passes"
    );
    assert_eq!(
        run_json(&sup.run_dir)["resolved"]["schedule"]["total_steps"],
        25
    );
    let (code, audit) = sup.ledger();
    assert_eq!(code, 0, "{audit}");
}

#[test]
fn run_json_and_checkpoints_record_every_setting_as_used() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--demo-samples",
        "64",
        "--steps",
        "2",
    ]);
    let code = sup.wait_exit(T).code();
    assert_eq!(code, Some(0), "{}", sup.stderr());
    let saved = run_json(&sup.run_dir);
    // The flags as given keep their nulls (what a resume compares)...
    assert!(
        saved["lr"].is_null() && saved["block_size"].is_null(),
        "{saved}"
    );
    // ...and the resolved settings hold what the run used.
    let r = &saved["resolved"];
    assert_eq!(r["lr"], 3e-3, "the tiny target's default lr: {r}");
    assert_eq!(r["drafter"]["block_size"], 8, "{r}");
    assert_eq!(r["token_budget"], 2048, "{r}");
    assert_eq!(r["schedule"]["total_steps"], 2, "{r}");
    assert_eq!(r["schedule"]["warmup_steps"], 1, "{r}");
    assert!(r["taps"].as_array().is_some_and(|t| !t.is_empty()), "{r}");
    assert_eq!(r["collective"], "nothing (one rank)", "{r}");
    let ckpt = sup.run_dir.join("checkpoints/step-00000002/meta.json");
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(&ckpt).unwrap()).unwrap();
    assert_eq!(meta["supervisor"]["settings"]["lr"], 3e-3, "{meta}");
    let html = std::fs::read_to_string(sup.run_dir.join("report.html")).unwrap();
    assert!(
        html.contains(r#"<th>drafter.block_size</th><td data-key="drafter.block_size">8</td>"#),
        "the report shows the settings"
    );
}

#[test]
fn one_command_starts_resumes_after_a_requeue_and_ends_a_finished_run_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    // 400 samples, 2 per batch: 200 steps, far more than happen before the SIGTERM.
    let data = token_file(tmp.path(), 400, 64);
    let run = tmp.path().join("run");
    let cmd: Vec<String> = [
        "--gpus",
        "cpu:2",
        "--data",
        data.to_str().unwrap(),
        "--token-budget",
        "128",
        "--max-seq-len",
        "64",
        "--checkpoint-every",
        "0",
        "--run-dir",
        run.to_str().unwrap(),
        "--resume-if-exists",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
    let mut child = std::process::Command::new(bin("dflash-supervise"))
        .args(&args)
        .stdin(std::process::Stdio::null())
        .stderr(std::fs::File::create(tmp.path().join("first.err")).unwrap())
        .spawn()
        .unwrap();
    wait_for("step 3 of the first job", T, || {
        steps(&run)
            .last()
            .and_then(|r| r["step"].as_u64())
            .filter(|&s| s >= 3)
    });
    signal(child.id(), Signal::SIGTERM);
    let code = child.wait().unwrap().code();
    let err = std::fs::read_to_string(tmp.path().join("first.err")).unwrap();
    assert_eq!(code, Some(75), "stopped before its end, resumable: {err}");
    let stopped_at = steps(&run).last().unwrap()["step"].as_u64().unwrap();

    // The requeued job: the same command resumes it and runs it to its end.
    let (code, err) = run_to_end(&args);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("resuming"), "{err}");
    let s = steps(&run);
    assert_eq!(s.last().unwrap()["step"], 200, "{err}");
    assert!(stopped_at < 200);
    let out = supervise(&["ledger", "--run-dir", run.to_str().unwrap()], None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // Once more: the run is finished; nothing starts, nothing is rewritten.
    let events_before = read_jsonl(&run.join("events.jsonl")).len();
    let export_before = std::fs::metadata(run.join("drafter/model.safetensors"))
        .unwrap()
        .modified()
        .unwrap();
    let (code, err) = run_to_end(&args);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("already finished at step 200"), "{err}");
    assert!(err.contains("drafter (step 200)"), "{err}");
    assert_eq!(
        read_jsonl(&run.join("events.jsonl")).len(),
        events_before,
        "no worker started"
    );
    assert_eq!(
        std::fs::metadata(run.join("drafter/model.safetensors"))
            .unwrap()
            .modified()
            .unwrap(),
        export_before,
        "the export is not rewritten"
    );
}

#[test]
fn a_requeued_job_whose_run_reached_its_steps_exits_0_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let args = [
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--demo-samples",
        "64",
        "--steps",
        "3",
        "--run-dir",
        run.to_str().unwrap(),
        "--resume-if-exists",
    ];
    let (code, err) = run_to_end(&args);
    assert_eq!(code, 0, "{err}");
    // The same command again (a requeue after the end): finished, not "nothing to train".
    let (code, err) = run_to_end(&args);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("already finished at step 3"), "{err}");
    // A larger --steps trains on.
    let mut more = args.to_vec();
    more[7] = "5";
    let (code, err) = run_to_end(&more);
    assert_eq!(code, 0, "{err}");
    assert_eq!(steps(&run).last().unwrap()["step"], 5, "{err}");
}

#[test]
fn sigusr1_writes_a_checkpoint_at_the_next_step_and_training_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let data = token_file(tmp.path(), 400, 64);
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        data.to_str().unwrap(),
        "--token-budget",
        "128",
        "--max-seq-len",
        "64",
        "--checkpoint-every",
        "0",
    ]);
    let at = wait_for("step 2", T, || {
        steps(&sup.run_dir)
            .last()
            .and_then(|r| r["step"].as_u64())
            .filter(|&s| s >= 2)
    });
    sup.signal(Signal::SIGUSR1);
    let ckpt = wait_for("a checkpoint after SIGUSR1", T, || {
        std::fs::read_dir(sup.run_dir.join("checkpoints"))
            .ok()?
            .flatten()
            .find(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                !n.contains(".tmp") && e.path().join("meta.json").is_file()
            })
            .map(|e| e.file_name().to_string_lossy().into_owned())
    });
    let step: u64 = ckpt.trim_start_matches("step-").parse().unwrap();
    assert!(
        step > at,
        "checkpoint {ckpt} is of a step after the signal (step {at})"
    );
    // Training goes on past it.
    wait_for("training past the checkpoint", T, || {
        steps(&sup.run_dir)
            .last()
            .and_then(|r| r["step"].as_u64())
            .filter(|&s| s > step + 1)
    });
    assert_eq!(sup.state().unwrap()["phase"], "running");
    assert!(sup
        .events()
        .iter()
        .any(|e| e["event"] == "checkpoint_requested"));
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(T).code(), Some(75), "{}", sup.stderr());
}

#[test]
fn under_slurm_a_stop_timeout_beyond_killwait_is_warned_about() {
    let env = [("SLURM_JOB_ID", "4242")];
    let base = [
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--demo-samples",
        "32",
        "--steps",
        "1",
    ];
    let mut args = base.to_vec();
    args.extend(["--stop-timeout", "120s"]);
    let mut sup = Sup::start_real_env(&args, &env);
    assert_eq!(sup.wait_exit(T).code(), Some(0), "{}", sup.stderr());
    let err = sup.stderr();
    let line = err
        .lines()
        .find(|l| l.contains("KillWait"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(line.contains("--stop-timeout 2m"), "{line}");
    // The default fits.
    let mut sup = Sup::start_real_env(&base, &env);
    assert_eq!(sup.wait_exit(T).code(), Some(0), "{}", sup.stderr());
    assert!(!sup.stderr().contains("KillWait"), "{}", sup.stderr());
}

#[test]
fn a_failed_start_leaves_nothing_behind_and_the_retry_with_the_same_run_dir_works() {
    let tmp = tempfile::tempdir().unwrap();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let run = tmp.path().join("run");
    let args = [
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--demo-samples",
        "32",
        "--steps",
        "1",
        "--prometheus",
        &port,
        "--run-dir",
        run.to_str().unwrap(),
    ];
    let (code, err) = run_to_end(&args);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains(&port), "the error names the port: {err}");
    assert!(!run.exists(), "the failed start removed its run directory");
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "nothing left beside it"
    );
    drop(busy);
    let (code, err) = run_to_end(&args);
    assert_eq!(code, 0, "the retry with the same --run-dir: {err}");
}

/// A pre-emption notice that comes while the run is still starting (here: reading its
/// data from a pipe) is honoured at the first committed step.
#[test]
fn sigusr1_during_the_start_writes_a_checkpoint_at_the_first_step() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(token_file(tmp.path(), 200, 64)).unwrap();
    let fifo = tmp.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let (opened, reading) = std::sync::mpsc::channel::<()>();
    let writer = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            use std::io::Write;
            // The open returns once the supervisor opened the FIFO to read it: its signal
            // handlers are installed by then.
            let mut f = std::fs::OpenOptions::new().write(true).open(fifo).unwrap();
            let half = bytes.len() / 2;
            f.write_all(&bytes[..half]).unwrap();
            opened.send(()).unwrap();
            wait.recv().unwrap();
            f.write_all(&bytes[half..]).unwrap();
        })
    };
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        fifo.to_str().unwrap(),
        "--token-budget",
        "128",
        "--max-seq-len",
        "64",
        "--checkpoint-every",
        "0",
        "--epochs",
        "20",
    ]);
    reading
        .recv_timeout(T)
        .expect("the supervisor reads the FIFO");
    sup.signal(Signal::SIGUSR1);
    wait_for("the notice seen during the start", T, || {
        sup.stderr()
            .contains("SIGUSR1 received while starting")
            .then_some(())
    });
    assert!(!sup.run_dir.join("train.jsonl").exists() || steps(&sup.run_dir).is_empty());
    go.send(()).unwrap();
    writer.join().unwrap();
    // A complete checkpoint: one being written is a `.tmp-PID` directory until renamed.
    let ckpt = wait_for("a checkpoint", T, || {
        std::fs::read_dir(sup.run_dir.join("checkpoints"))
            .ok()?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| {
                !n.contains(".tmp")
                    && sup
                        .run_dir
                        .join("checkpoints")
                        .join(n)
                        .join("meta.json")
                        .is_file()
            })
    });
    assert_eq!(ckpt, "step-00000001", "{}", sup.stderr());
    assert_eq!(
        sup.events()
            .iter()
            .filter(|e| e["event"] == "checkpoint_requested")
            .count(),
        1
    );
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(T).code(), Some(75), "{}", sup.stderr());
}

/// The command a stopped run prints to continue it is quoted for a shell: with a run dir
/// whose name holds a space and a single quote, the printed `dflash-supervise --resume ...`
/// run through `sh -c` as it is resumes that run to its end.
#[test]
fn the_printed_resume_command_pastes_into_a_shell_whatever_the_run_dir_is_called() {
    let tmp = tempfile::tempdir().unwrap();
    // 200 samples, 2 per batch: 100 steps, far more than happen before the SIGTERM.
    let data = token_file(tmp.path(), 200, 64);
    let run = tmp.path().join("my run's dir");
    let mut child = std::process::Command::new(bin("dflash-supervise"))
        .args(["--gpus", "cpu:2", "--data"])
        .arg(&data)
        .args(["--token-budget", "128", "--max-seq-len", "64"])
        .args(["--checkpoint-every", "0", "--run-dir"])
        .arg(&run)
        .stdin(std::process::Stdio::null())
        .stderr(std::fs::File::create(tmp.path().join("first.err")).unwrap())
        .spawn()
        .unwrap();
    wait_for("step 2", T, || {
        steps(&run)
            .last()
            .and_then(|r| r["step"].as_u64())
            .filter(|&s| s >= 2)
    });
    signal(child.id(), Signal::SIGTERM);
    let code = child.wait().unwrap().code();
    let err = std::fs::read_to_string(tmp.path().join("first.err")).unwrap();
    assert_eq!(code, Some(75), "{err}");
    let cmd = err
        .lines()
        .find_map(|l| l.split_once("continue it with: ").map(|(_, c)| c))
        .unwrap_or_else(|| panic!("{err}"));
    let quoted = format!("'{}'", run.display().to_string().replace('\'', r"'\''"));
    assert_eq!(cmd, format!("dflash-supervise --resume {quoted}"));
    // Pasted into a shell as it is, it resumes this run.
    let dir = bin("dflash-supervise").parent().unwrap().to_path_buf();
    let path = std::env::join_paths(
        std::iter::once(dir).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap())),
    )
    .unwrap();
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .env("PATH", path)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(steps(&run).last().unwrap()["step"], 100, "{err}");
}

/// Issue 40: the default `--max-seq-len` fits a target of a shorter context; a value given
/// past it is still refused.
#[test]
fn the_default_max_seq_len_adapts_to_a_short_target_and_a_given_one_past_it_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("tiny");
    let st = std::process::Command::new(bin("dflash-worker"))
        .args(["tiny-target", "--out"])
        .arg(&t)
        .status()
        .unwrap();
    assert!(st.success());
    let cfg = t.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["max_position_embeddings"] = 512.into();
    std::fs::write(&cfg, v.to_string()).unwrap();
    let target = t.to_str().unwrap();
    let base = [
        "--gpus",
        "cpu:2",
        "--target",
        target,
        "--data",
        "demo",
        "--demo-samples",
        "32",
        "--steps",
        "1",
    ];
    let mut sup = Sup::start_real(&base);
    assert_eq!(sup.wait_exit(T).code(), Some(0), "{}", sup.stderr());
    assert!(
        sup.stderr()
            .contains("--max-seq-len 512: the target's max_position_embeddings"),
        "{}",
        sup.stderr()
    );
    assert_eq!(run_json(&sup.run_dir)["max_seq_len"], 512);
    let mut args = base.to_vec();
    args.extend(["--max-seq-len", "1024", "--run-dir", "/nonexistent/never"]);
    let out = supervise(&args, None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-seq-len 1024 exceeds"));
}
