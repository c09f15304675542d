//! Faults of issue 20's second round, end to end: stops that always save what the
//! supervisor holds, checkpoint writes that fail (a fault-injection preload library fails,
//! or kills at, one `mkdir` at an exact instant), the run directory removed under a run,
//! data that can be read only once, a paused supervisor, signals during a start.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use serde_json::Value;

const T: Duration = Duration::from_secs(120);

/// The preload library (tests/fault-inject).
fn fault_lib() -> PathBuf {
    cdylib("libdflash_fault_inject.so")
}

/// The environment that makes `call` on a path containing `path` do `action`, only in
/// processes whose environment has `only_if` (NAME=VALUE), when given.
fn fault_env(call: &str, path: &str, action: &str, only_if: Option<&str>) -> Vec<(String, String)> {
    let mut env = vec![
        ("LD_PRELOAD".to_string(), fault_lib().display().to_string()),
        ("DFLASH_FAULT_CALL".into(), call.into()),
        ("DFLASH_FAULT_PATH".into(), path.into()),
        ("DFLASH_FAULT_ACTION".into(), action.into()),
    ];
    if let Some(c) = only_if {
        env.push(("DFLASH_FAULT_IF_ENV".into(), c.into()));
    }
    env
}

fn start_env(args: &[&str], env: &[(String, String)]) -> Sup {
    let e: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Sup::start_real_env(args, &e)
}

fn meta(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap()
}

fn checkpoints(run: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(run.join("checkpoints"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.retain(|p| p.join("meta.json").is_file());
    v.sort();
    v
}

/// The step the exported drafter holds (its config.json).
fn exported_step(run: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(run.join("drafter").join("config.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    v["dflash_training"]["step"].as_u64()
}

fn ledger_clean(sup: &Sup) {
    let (code, audit) = sup.ledger();
    assert_eq!(code, 0, "ledger: {audit}");
}

#[test]
fn the_only_drafter_killed_while_writing_the_stop_checkpoint_leaves_its_step_saved_by_the_supervisor(
) {
    // Only the stop checkpoint is written (--checkpoint-every 0); the drafter kills itself
    // at its mkdir of the temporary directory.
    let env = fault_env("mkdir", ".tmp-", "kill", Some("DFLASH_ROLE=drafter"));
    let mut sup = start_env(
        &[
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--steps",
            "6",
            "--checkpoint-every",
            "0",
        ],
        &env,
    );
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    // The drafter did not stop as asked (it died): an unclean stop, but nothing is lost.
    assert_eq!(status.code(), Some(3), "stderr:\n{err}");
    assert!(!err.contains("were not saved"), "{err}");
    let ck = checkpoints(&sup.run_dir);
    assert_eq!(ck.len(), 1, "{ck:?}");
    let m = meta(&ck[0]);
    assert_eq!(
        m["step"], 6,
        "the last committed step, from the stop's snapshot"
    );
    assert_eq!(m["written_from"], "the supervisor's snapshot");
    assert_eq!(exported_step(&sup.run_dir), Some(6), "stderr:\n{err}");
    assert!(err.contains("drafter (step 6) written to"), "{err}");
    ledger_clean(&sup);
}

#[test]
fn a_full_disk_during_the_export_fails_the_run_and_export_writes_the_drafter_later() {
    // ENOSPC on the export's own new directory only (RUN/.drafter.export-PID-N), in the
    // export tool the supervisor runs after its workers stopped.
    let env = fault_env("mkdir", ".drafter.export-", "errno:28", None);
    let mut sup = start_env(&["--gpus", "cpu:2", "--data", "demo", "--steps", "4"], &env);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(
        status.code(),
        Some(1),
        "a checkpoint not exported is no success:\n{err}"
    );
    assert!(
        err.contains("the drafter (step 4) could not be written")
            && err.contains("No space left on device")
            && err.contains("dflash-supervise export"),
        "{err}"
    );
    assert!(!sup.run_dir.join("drafter").exists());
    assert_eq!(meta(checkpoints(&sup.run_dir).last().unwrap())["step"], 4);
    // Later, with room on the disk: the same export from the command line.
    let run = sup.run_dir.to_str().unwrap().to_string();
    let out = supervise(&["export", &run], None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("drafter (step 4)"));
    assert_eq!(exported_step(&sup.run_dir), Some(4));
    for f in ["config.json", "model.safetensors", "dflash_drafter.py"] {
        assert!(sup.run_dir.join("drafter").join(f).is_file(), "{f}");
    }
    // Bad input to export: one line, exit 2.
    let out = supervise(&["export", "/nonexistent/run"], None);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim().lines().count(),
        1
    );
    export_never_removes_what_is_not_its_own(&sup.run_dir);
}

/// `export --out` replaces only an earlier export (or an empty directory): onto the run
/// directory itself, a directory of the user's, or `DIR/..` it refuses with one line and
/// exit 2, everything left as it was; a sibling whose name differs by its extension
/// (`qwen.old` beside `qwen.new`) is never touched; an export made twice replaces the first.
fn export_never_removes_what_is_not_its_own(run_dir: &Path) {
    let run = run_dir.to_str().unwrap().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let listing = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let refused = |out: &Path| {
        let o = supervise(&["export", &run, "--out", out.to_str().unwrap()], None);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(2), "--out {}: {err}", out.display());
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        err
    };
    // The run directory itself.
    let before = listing(run_dir);
    let err = refused(run_dir);
    assert!(err.contains("not an export of dflash-supervise"), "{err}");
    assert_eq!(listing(run_dir), before, "the run is untouched");
    // A directory of the user's.
    let mine = tmp.path().join("mine");
    fs::create_dir(&mine).unwrap();
    fs::write(mine.join("notes.txt"), b"keep me").unwrap();
    refused(&mine);
    assert_eq!(fs::read(mine.join("notes.txt")).unwrap(), b"keep me");
    // `DIR/..`: the parent of the user's directory.
    let err = refused(&mine.join(".."));
    assert!(err.contains("names a new directory"), "{err}");
    assert!(mine.join("notes.txt").is_file());
    // models/qwen.new beside models/qwen.old (and a name like the old temporary ones).
    let models = tmp.path().join("models");
    for sib in ["qwen.old", &format!("qwen.tmp-{}", std::process::id())] {
        fs::create_dir_all(models.join(sib)).unwrap();
        fs::write(models.join(sib).join("weights.bin"), b"other model").unwrap();
    }
    let new = models.join("qwen.new");
    for round in 0..2 {
        let o = supervise(&["export", &run, "--out", new.to_str().unwrap()], None);
        assert_eq!(
            o.status.code(),
            Some(0),
            "round {round}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(dflash_shared::export_dest::is_export(&new), "round {round}");
        assert_eq!(
            listing(&models),
            vec![
                "qwen.new".to_string(),
                "qwen.new.probe.safetensors".into(),
                "qwen.old".into(),
                format!("qwen.tmp-{}", std::process::id()),
            ],
            "round {round}: nothing else made or removed beside it"
        );
    }
    for sib in ["qwen.old", &format!("qwen.tmp-{}", std::process::id())] {
        assert_eq!(
            fs::read(models.join(sib).join("weights.bin")).unwrap(),
            b"other model"
        );
    }
}

#[test]
fn a_stop_while_the_only_drafter_waits_to_restart_still_saves_and_exports() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--demo-samples",
        "200000",
        "--snapshot-every",
        "1",
        "--checkpoint-every",
        "0",
    ]);
    // A few steps (each one snapshotted), then kill the drafter as soon as it is up
    // again, until it waits in a restart backoff of 4 s (the 4th restart; they wait 0,
    // 1, 2, 4 s), time enough for the stop to come before it ends, however loaded the
    // machine. Each death rolls the group back to its snapshot.
    sup.wait_state("three committed steps", T, |s| {
        s["train"]["step"].as_u64().unwrap_or(0) >= 3
    });
    let mut killed = 0;
    let st = loop {
        let st = sup.wait_state("the drafter up, or waiting to restart", T, |s| {
            let w = worker(s, "drafter-0");
            (w["state"] == "backoff" && w["restarts"].as_u64() >= Some(4))
                || (w["state"] == "running" && w["pid"].is_u64())
        });
        if worker(&st, "drafter-0")["state"] == "backoff" {
            break st;
        }
        assert!(killed < 8, "the drafter never waited 4 s to restart: {st}");
        signal(pid_of(&st, "drafter-0"), Signal::SIGKILL);
        killed += 1;
        let restarts = worker(&st, "drafter-0")["restarts"].as_u64().unwrap();
        sup.wait_state("the drafter's death handled", T, |s| {
            worker(s, "drafter-0")["restarts"].as_u64().unwrap() > restarts
        });
    };
    sup.signal(Signal::SIGINT);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(75), "st {st}\nstderr:\n{err}");
    let ck = checkpoints(&sup.run_dir);
    let last = meta(ck.last().expect("a stop checkpoint"));
    assert_eq!(last["written_from"], "the supervisor's snapshot");
    let step = last["step"].as_u64().unwrap();
    // Exit 75 above (stopped before its end, resumable): no committed step is missing.
    assert!(step >= 1, "{last}");
    assert_eq!(exported_step(&sup.run_dir), Some(step), "stderr:\n{err}");
    ledger_clean(&sup);
}

#[test]
fn the_run_dir_removed_under_a_run_stops_it_with_a_line_that_says_so() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--demo-samples",
        "200000",
    ]);
    sup.wait_state("a committed step", T, |s| {
        s["train"]["step"].as_u64().unwrap_or(0) >= 1
    });
    std::fs::remove_dir_all(&sup.run_dir).unwrap();
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("{} was removed", sup.run_dir.display())),
        "{err}"
    );
    assert!(err.contains("of this session are lost"), "{err}");
    assert!(
        !sup.run_dir.exists(),
        "nothing recreates the removed directory (a checkpoint or the report there would be an orphan)"
    );
}

#[test]
fn a_checkpoint_that_cannot_be_written_stops_the_run_once_without_restarting_the_drafter() {
    // The second periodic checkpoint (step 4) fails with ENOSPC: inodes ran out, say.
    let env = fault_env(
        "mkdir",
        "step-00000004.tmp-",
        "errno:28",
        Some("DFLASH_ROLE=drafter"),
    );
    let mut sup = start_env(
        &[
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--demo-samples",
            "200000",
            "--checkpoint-every",
            "2",
        ],
        &env,
    );
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("the checkpoint of step 4 could not be written")
            && err.contains("No space left on device")
            && err.contains("df -i")
            && err.contains("--resume"),
        "{err}"
    );
    let st = sup.state().unwrap();
    assert_eq!(worker(&st, "drafter-0")["restarts"], 0, "{st}");
    let events = sup.events();
    assert!(!events.iter().any(|e| e["event"] == "rollback"));
    assert_eq!(
        events
            .iter()
            .filter(|e| e["event"] == "checkpoint_failed")
            .count(),
        1,
        "the stop asks once more only for a newer step"
    );
    assert!(checkpoints(&sup.run_dir)
        .iter()
        .any(|c| c.ends_with("step-00000002")));
    ledger_clean(&sup);
}

/// A filesystem too full for a checkpoint (statvfs reports 4 KiB free on the checkpoints'
/// directory): a skipped checkpoint is a failed one, so the run stops cleanly at the first
/// checkpoint it cannot write, saying how much to free, instead of training on to its end
/// with nothing saved.
#[test]
fn a_disk_too_full_for_a_checkpoint_stops_the_run_there_and_says_what_to_free() {
    let env = fault_env("statvfs", "checkpoints", "free:4096", None);
    let mut sup = start_env(
        &[
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--steps",
            "40",
            "--checkpoint-every",
            "2",
        ],
        &env,
    );
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("not enough free space in")
            && err.contains("for the checkpoint of step 2")
            && err.contains("free at least")
            && err.contains("stopping the run")
            && err.contains("--resume"),
        "{err}"
    );
    assert_eq!(
        err.matches("error: not enough free space in").count(),
        1,
        "said once: {err}"
    );
    let steps: Vec<u64> = read_jsonl(&sup.run_dir.join("train.jsonl"))
        .iter()
        .filter_map(|l| l["step"].as_u64())
        .collect();
    let last = steps.iter().max().copied().unwrap_or(0);
    assert!(
        (2..=8).contains(&last),
        "stopped at the first checkpoint it could not write (step 2), not at step 40: trained to {last}\n{err}"
    );
    ledger_clean(&sup);
}

fn write_data(path: &Path, n: usize) {
    // Pre-tokenized lines below the tiny target's vocabulary (512).
    let mut text = String::new();
    for i in 0..n {
        let len = 40 + i % 30;
        let ids: Vec<String> = (0..len)
            .map(|k| ((i * 7 + k * 3) % 500).to_string())
            .collect();
        text.push_str(&format!("{{\"input_ids\": [{}]}}\n", ids.join(",")));
    }
    std::fs::write(path, text).unwrap();
}

/// Batches the loader produced, from the ledger's `load` records.
fn loaded(sup: &Sup) -> usize {
    sup.ledger_records()
        .iter()
        .filter(|r| r["ev"] == "load")
        .count()
}

#[test]
fn a_fifo_as_data_is_read_once_and_every_sample_trains() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data.jsonl");
    write_data(&file, 400);
    // The regular file: the reference.
    let mut plain = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        file.to_str().unwrap(),
        "--preflight-lines",
        "50",
    ]);
    assert_eq!(plain.wait_exit(T).code(), Some(0), "{}", plain.stderr());
    let want = loaded(&plain);
    assert!(want > 0);
    // The same bytes through a FIFO, read once.
    let fifo = dir.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let writer = {
        let (fifo, file) = (fifo.clone(), file.clone());
        std::thread::spawn(move || {
            let bytes = std::fs::read(file).unwrap();
            std::fs::write(fifo, bytes).unwrap();
        })
    };
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        fifo.to_str().unwrap(),
        "--preflight-lines",
        "50",
    ]);
    let status = sup.wait_exit(T);
    writer.join().unwrap();
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(loaded(&sup), want, "every batch of the data, none lost");
    ledger_clean(&sup);
    let copy = sup.run_dir.join("data.jsonl");
    assert_eq!(std::fs::read(&copy).unwrap(), std::fs::read(&file).unwrap());
    let run: Value =
        serde_json::from_str(&std::fs::read_to_string(sup.run_dir.join("run.json")).unwrap())
            .unwrap();
    assert_eq!(
        run["data"].as_str().map(PathBuf::from),
        Some(copy),
        "a --resume reads the copy"
    );
}

/// Whether process `pid` holds a flock on the file `path` (as /proc/locks lists it).
fn holds_flock(pid: u32, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let ino = fs::metadata(path).unwrap().ino();
    fs::read_to_string("/proc/locks")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(1) == Some(&"FLOCK")
                && f.get(4) == Some(&pid.to_string().as_str())
                && f.get(5).is_some_and(|id| id.ends_with(&format!(":{ino}")))
        })
}

/// Two runs on one FIFO would each get part of the stream: the second is refused at once
/// (exit 2, one line naming the FIFO and the run reading it) and the first trains on every
/// sample.
#[test]
fn a_second_run_on_a_fifo_another_run_reads_is_refused_and_the_first_trains_on_every_sample() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data.jsonl");
    write_data(&file, 400);
    let mut plain = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        file.to_str().unwrap(),
        "--preflight-lines",
        "50",
    ]);
    assert_eq!(plain.wait_exit(T).code(), Some(0), "{}", plain.stderr());
    let want = loaded(&plain);
    let fifo = dir.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let args = [
        "--gpus",
        "cpu:2",
        "--data",
        fifo.to_str().unwrap(),
        "--preflight-lines",
        "50",
    ];
    let mut first = Sup::start_real(&args);
    // No writer yet: the first run waits for one, holding the FIFO.
    wait_for("the first run to hold the FIFO", T, || {
        holds_flock(first.pid(), &fifo).then_some(())
    });
    let mut second = Sup::start_real(&args);
    let status = second.wait_exit(T);
    let err = second.stderr();
    assert_eq!(status.code(), Some(2), "{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "{err}");
    assert!(
        errors[0].contains(fifo.to_str().unwrap())
            && errors[0].contains(&format!("pid {}", first.pid())),
        "{err}"
    );
    assert!(!second.run_dir.exists(), "the refused run made no run dir");
    fs::write(&fifo, fs::read(&file).unwrap()).unwrap();
    let status = first.wait_exit(T);
    assert_eq!(status.code(), Some(0), "{}", first.stderr());
    assert_eq!(loaded(&first), want, "every batch of the data, none lost");
    assert_eq!(
        fs::read(first.run_dir.join("data.jsonl")).unwrap(),
        fs::read(&file).unwrap()
    );
    ledger_clean(&first);
}

#[test]
fn sigint_while_the_run_starts_removes_what_the_start_made() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let run_dir = dir.path().join("runs").join("r1");
    let mut child = std::process::Command::new(bin("dflash-supervise"))
        .args([
            "--gpus",
            "cpu:2",
            "--data",
            fifo.to_str().unwrap(),
            "--run-dir",
        ])
        .arg(&run_dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A writer that opens the FIFO and writes nothing: the start waits for the data.
    let _writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    let parent = run_dir.parent().unwrap().to_path_buf();
    wait_for("the copy of --data to begin", T, || {
        std::fs::read_dir(&parent)
            .ok()?
            .flatten()
            .any(|e| e.file_name().to_string_lossy().contains(".data-"))
            .then_some(())
    });
    signal(child.id(), Signal::SIGINT);
    wait_for("the supervisor to exit", T, || {
        child.try_wait().unwrap().map(|_| ())
    });
    let output = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted by SIGINT"), "{err}");
    assert!(!run_dir.exists());
    let left: Vec<_> = std::fs::read_dir(&parent)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn a_paused_supervisor_kills_no_healthy_worker_as_hung() {
    let sup = Sup::start(
        &["--gpus", "cpu:2", "--hang-timeout", "2s"],
        "target-0@99=crash:1",
    );
    sup.wait_running(2);
    sup.signal(Signal::SIGSTOP);
    // The pause itself is the fault: longer than the hang timeout.
    std::thread::sleep(Duration::from_secs(4));
    sup.signal(Signal::SIGCONT);
    let log = sup.run_dir.join("supervisor.log");
    wait_for("the supervisor to notice its pause", T, || {
        std::fs::read_to_string(&log)
            .ok()?
            .contains("did not run for")
            .then_some(())
    });
    // Heartbeats flow again: state.json is rewritten after the pause was handled.
    let st = sup.wait_state("both workers still running", T, |s| {
        s["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["state"] == "running")
    });
    assert!(
        !sup.events().iter().any(|e| e["event"] == "hang"),
        "{:?}",
        sup.events()
    );
    for w in ["target-0", "drafter-0"] {
        assert_eq!(worker(&st, w)["restarts"], 0, "{st}");
    }
}

/// A run whose target runs while its drafter, in its first life, waits `ms` before it
/// installs its signal handlers and connects; returned once the state shows both.
fn drafter_still_starting(ms: u64) -> Sup {
    let sup = Sup::start(
        &["--gpus", "cpu:2"],
        &format!("drafter-0@0=hello-delay:{ms}"),
    );
    sup.wait_state("the target running, the drafter starting", T, |s| {
        worker(s, "target-0")["state"] == "running" && worker(s, "drafter-0")["state"] == "starting"
    });
    sup
}

#[test]
fn sigusr1_goes_only_to_workers_that_said_hello() {
    let mut sup = drafter_still_starting(15_000);
    sup.signal(Signal::SIGUSR1);
    wait_for("the target to get SIGUSR1", T, || {
        sup.log("target-0").contains("got SIGUSR1").then_some(())
    });
    let st = sup.wait_running(2);
    assert_eq!(
        worker(&st, "drafter-0")["restarts"],
        0,
        "a Slurm notice during a start costs no worker: {st}"
    );
    let log = std::fs::read_to_string(sup.run_dir.join("supervisor.log")).unwrap();
    assert!(log.contains("not to drafter-0 (still starting)"), "{log}");
    sup.signal(Signal::SIGINT);
    assert_eq!(sup.wait_exit(T).code(), Some(75), "{}", sup.stderr());
}

/// A worker still starting when the run stops has no batch and no step in flight: the
/// SIGTERM it is sent (it has no channel yet) may end it before it installs its signal
/// handlers, and that is a clean stop (exit 75, resumable), not an unclean one (exit 3).
#[test]
fn a_worker_ended_by_the_stops_sigterm_while_still_starting_stopped_cleanly() {
    // The drafter sleeps 10 min before installing its handlers and connecting.
    let mut sup = drafter_still_starting(600_000);
    sup.signal(Signal::SIGINT);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(75), "{err}");
    assert!(!err.contains("not every worker stopped cleanly"), "{err}");
    let ev = sup.events();
    let exit = ev
        .iter()
        .find(|e| e["event"] == "exit" && e["worker"] == "drafter-0")
        .unwrap_or_else(|| panic!("no exit of drafter-0: {ev:?}"));
    assert_eq!(exit["signal"], "SIGTERM", "{exit}");
}

#[test]
fn a_worker_program_that_never_connects_ends_the_run_with_exit_4() {
    let mut sup = Sup::start_real(&["--gpus", "cpu:2", "--worker-bin", "/bin/true"]);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(4), "{err}");
    assert!(
        err.contains("ended 3 times in a row without connecting") && err.contains("--worker-bin"),
        "{err}"
    );
}

/// A run of 4 steps whose final export stops at its first rename (its probe, then its
/// directory, out of `RUN/.drafter.export-PID-N`) until `release` exists; the supervisor
/// leads a process group of its own, as a shell's foreground job. Returns the run and the
/// PID of the export tool, once it is there.
fn run_held_at_its_export(release: &Path) -> (Sup, u32) {
    let hold = format!("hold:{}", release.display());
    let env = fault_env("rename", ".drafter.export-", &hold, None);
    let e: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let sup =
        Sup::start_real_env_as_job(&["--gpus", "cpu:2", "--data", "demo", "--steps", "4"], &e);
    let held = PathBuf::from(format!("{}.held", release.display()));
    let pid = wait_for("the export tool at its rename", T, || {
        fs::read_to_string(&held).ok()?.trim().parse::<u32>().ok()
    });
    (sup, pid)
}

/// Everything an export leaves beside RUN/drafter while it works.
fn export_litter(run: &Path) -> Vec<String> {
    fs::read_dir(run)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".drafter") || n.starts_with("drafter"))
        .collect()
}

#[test]
fn a_ctrl_c_during_the_final_export_finishes_it_and_a_second_aborts_it() {
    // One Ctrl-C at the terminal, and Slurm's SIGTERM to every process of the job: the
    // export goes on, the run finishes with its drafter.
    let release = tempfile::tempdir().unwrap();
    let go = release.path().join("go");
    let (mut sup, export) = run_held_at_its_export(&go);
    sup.ctrl_c();
    signal(export, Signal::SIGTERM);
    wait_for("the first signal said", T, || {
        sup.stderr().contains("finishing the export").then_some(())
    });
    assert!(pid_alive(export), "{}", sup.stderr());
    fs::write(&go, b"").unwrap();
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "stderr:\n{err}");
    assert_eq!(exported_step(&sup.run_dir), Some(4), "stderr:\n{err}");
    assert!(sup.run_dir.join("finished.json").is_file());
    let mut left = export_litter(&sup.run_dir);
    left.sort();
    assert_eq!(left, ["drafter", "drafter.probe.safetensors"]);

    // Two: the export is aborted, the checkpoint kept, nothing half-written left.
    let release = tempfile::tempdir().unwrap();
    let go = release.path().join("go");
    let (mut sup, export) = run_held_at_its_export(&go);
    sup.ctrl_c();
    wait_for("the first signal said", T, || {
        sup.stderr().contains("finishing the export").then_some(())
    });
    sup.ctrl_c();
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(130), "stderr:\n{err}");
    assert!(err.contains("aborted by a second SIGINT"), "{err}");
    assert!(!pid_alive(export));
    assert_eq!(export_litter(&sup.run_dir), Vec::<String>::new(), "{err}");
    assert_eq!(meta(checkpoints(&sup.run_dir).last().unwrap())["step"], 4);
    assert!(!sup.run_dir.join("finished.json").exists());
}

#[test]
fn the_export_tool_dies_with_a_killed_supervisor_and_the_next_export_tidies_after_it() {
    let release = tempfile::tempdir().unwrap();
    let go = release.path().join("go");
    let (mut sup, export) = run_held_at_its_export(&go);
    sup.signal(Signal::SIGKILL);
    sup.wait_exit(T);
    wait_for("the export tool gone with its supervisor", T, || {
        (!pid_alive(export)).then_some(())
    });
    // It left its unfinished directory; the next export removes it, and writes the drafter.
    assert!(!export_litter(&sup.run_dir).is_empty());
    assert!(!sup.run_dir.join("drafter").exists());
    let out = supervise(&["export", sup.run_dir.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(exported_step(&sup.run_dir), Some(4), "{err}");
    let mut left = export_litter(&sup.run_dir);
    left.sort();
    assert_eq!(left, ["drafter", "drafter.probe.safetensors"]);
}

/// The run's filesystem turns read-only under it (the ledger's writes fail with EROFS, as
/// after a disk error remounts it): the run stops taking batches with one line that names
/// a read-only filesystem and asks for no free space.
#[test]
fn a_ledger_on_a_filesystem_turned_read_only_is_said_to_be_so() {
    let env = fault_env("write", "ledger.jsonl", "errno:30", None);
    let mut sup = start_env(
        &["--gpus", "cpu:2", "--data", "demo", "--steps", "40"],
        &env,
    );
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("the run stops taking batches"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.contains("cannot append to ledger.jsonl: Read-only file system (os error 30)")
            && line.contains("its filesystem is read-only: remount it read-write, then --resume")
            && !line.contains("free space"),
        "{line}"
    );
}
