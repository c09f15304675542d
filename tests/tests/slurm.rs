//! The sbatch script of the documentation, as written there (extracted, not copied), run
//! under a driver that does what Slurm does to a batch job with `--signal=B:USR1@SECS
//! --requeue`: SIGUSR1 to the batch shell only, SIGTERM to every process of the job at the
//! time limit, SIGKILL to what is left after KillWait or once the batch shell has exited
//! (cgroup process tracking), and `scontrol requeue` starting the job again.

mod common;

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde_json::Value;

const T: Duration = Duration::from_secs(180);
/// Slurm's default KillWait.
const KILL_WAIT: Duration = Duration::from_secs(30);
const STEPS: u64 = 40;
/// Steps of the multi-node script's job (two supervisors on emulated GPUs).
const MULTI_STEPS: u64 = 16;

/// `dflash-supervise` for the script: the real one on CPU workers with the demo data, with
/// the script's `--run-dir` and `--resume-if-exists` (its model, data and GPUs are a real
/// machine's); `scontrol` records the requeue.
fn shims(dir: &Path) -> PathBuf {
    let bin_dir = dir.join("bin");
    fs::create_dir_all(&bin_dir).unwrap();
    let sup = format!(
        r#"#!/bin/sh
run_dir=; resume=; prev=
for a in "$@"; do
  [ "$prev" = --run-dir ] && run_dir=$a
  [ "$a" = --resume-if-exists ] && resume=$a
  prev=$a
done
exec '{}' --gpus cpu:2 --data demo --demo-samples 100000 --steps {STEPS} --checkpoint-every 0 --run-dir "$run_dir" $resume
"#,
        bin("dflash-supervise").display()
    );
    let scontrol = format!(
        "#!/bin/sh\necho \"$@\" >> '{}'\n",
        dir.join("requeues").display()
    );
    write_exe(&bin_dir.join("dflash-supervise"), &sup);
    write_exe(&bin_dir.join("scontrol"), &scontrol);
    bin_dir
}

/// An executable script at `p`.
fn write_exe(p: &Path, text: &str) {
    fs::write(p, text).unwrap();
    let mut perm = fs::metadata(p).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    fs::set_permissions(p, perm).unwrap();
}

/// One start of the batch job: the script in a process group of its own (the job's
/// cgroup).
fn start_job(dir: &Path, script: &Path, bin_dir: &Path, attempt: u32) -> Child {
    start_job_as(dir, script, bin_dir, attempt, "4242")
}

/// [`start_job`] with the job id `job_id`.
fn start_job_as(dir: &Path, script: &Path, bin_dir: &Path, attempt: u32, job_id: &str) -> Child {
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new("bash")
        .arg(script)
        .current_dir(dir)
        .env("PATH", path)
        .env("SLURM_JOB_ID", job_id)
        .env("SLURM_RESTART_COUNT", attempt.to_string())
        .stdin(Stdio::null())
        .stdout(fs::File::create(dir.join(format!("out.{attempt}"))).unwrap())
        .stderr(fs::File::create(dir.join(format!("err.{attempt}"))).unwrap())
        .process_group(0)
        .spawn()
        .unwrap()
}

/// The job's end as Slurm sees it: the batch shell's exit code; what is left of the job
/// is SIGKILLed then (cgroup tracking), and at `kill_at` (the limit's KillWait) at the latest.
fn end_of_job(job: &mut Child, kill_at: Option<Instant>) -> i32 {
    let group = Pid::from_raw(job.id() as i32);
    let deadline = Instant::now() + T;
    let status = loop {
        if let Some(st) = job.try_wait().unwrap() {
            break st;
        }
        if kill_at.is_some_and(|k| Instant::now() >= k) {
            let _ = killpg(group, Signal::SIGKILL);
            panic!("the job outlived KillWait after the time limit's SIGTERM");
        }
        assert!(Instant::now() < deadline, "the job never ended");
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = killpg(group, Signal::SIGKILL);
    status
        .code()
        .unwrap_or(128 + std::os::unix::process::ExitStatusExt::signal(&status).unwrap_or(0))
}

fn last_step(run: &Path) -> u64 {
    read_jsonl(&run.join("train.jsonl"))
        .iter()
        .filter_map(|r| r["step"].as_u64())
        .max()
        .unwrap_or(0)
}

#[test]
fn the_documented_sbatch_script_checkpoints_at_the_notice_is_requeued_at_the_limit_and_finishes() {
    let (from, script) = documented_sbatch_script();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let script_path = dir.join("job.sbatch");
    fs::write(&script_path, &script).unwrap();
    let bin_dir = shims(dir);
    let run_line = script
        .lines()
        .find(|l| l.contains("--run-dir"))
        .unwrap_or_else(|| panic!("{}: the script names no --run-dir", from.display()));
    let run_dir = run_line
        .split_whitespace()
        .skip_while(|w| *w != "--run-dir")
        .nth(1)
        .unwrap();
    let run = dir.join(run_dir);

    // The first start: the notice (SIGUSR1 to the batch shell only), then the time limit.
    let mut job = start_job(dir, &script_path, &bin_dir, 0);
    wait_for("training under way", T, || {
        (last_step(&run) >= 3).then_some(())
    });
    signal(job.id(), Signal::SIGUSR1);
    let events = run.join("events.jsonl");
    wait_for("the notice's checkpoint", T, || {
        let asked = read_jsonl(&events)
            .iter()
            .any(|e| e["event"] == "checkpoint_requested");
        let written = fs::read_dir(run.join("checkpoints"))
            .ok()?
            .flatten()
            .any(|e| e.path().join("meta.json").is_file());
        (asked && written).then_some(())
    });
    let at_limit = last_step(&run);
    assert!(at_limit < STEPS, "the run ended before its time limit");
    killpg(Pid::from_raw(job.id() as i32), Signal::SIGTERM).unwrap();
    let code = end_of_job(&mut job, Some(Instant::now() + KILL_WAIT));
    let err0 = fs::read_to_string(dir.join("err.0")).unwrap_or_default();
    assert_eq!(code, 75, "the first start\n{err0}");
    let requeues = fs::read_to_string(dir.join("requeues")).unwrap_or_default();
    assert_eq!(requeues.trim(), "requeue 4242", "{err0}");

    // Requeued: it resumes and finishes; a requeue of a finished job exits 0 at once.
    let mut job = start_job(dir, &script_path, &bin_dir, 1);
    let code = end_of_job(&mut job, None);
    let err1 = fs::read_to_string(dir.join("err.1")).unwrap_or_default();
    assert_eq!(code, 0, "the requeued start\n{err1}");
    assert!(err1.contains("from the checkpoint of step"), "{err1}");
    let requeues = fs::read_to_string(dir.join("requeues")).unwrap_or_default();
    assert_eq!(requeues.lines().count(), 1, "{requeues}");
    let finished: Value =
        serde_json::from_str(&fs::read_to_string(run.join("finished.json")).unwrap()).unwrap();
    assert_eq!(finished["step"], STEPS);
    let ledger = supervise(
        &["ledger", "--run-dir", run.to_str().unwrap(), "--json"],
        None,
    );
    let a: Value = serde_json::from_slice(&ledger.stdout).unwrap();
    assert_eq!(ledger.status.code(), Some(0), "{a}");
    assert_eq!(
        (a["lost"].as_u64(), a["duplicated"].as_u64()),
        (Some(0), Some(0))
    );
    let mut job = start_job(dir, &script_path, &bin_dir, 2);
    assert_eq!(end_of_job(&mut job, None), 0);
}

/// The multi-node script's shims: `srun` starts one task per node (two, on this machine:
/// "nodes" 127.0.0.2 and 127.0.0.3) with Slurm's variables and forwards signals to them
/// as srun does; `dflash-supervise` runs the real one on two emulated GPUs per node with
/// the demo data; `scontrol` records the requeue. Its forwarding of SIGTERM comes a moment
/// after Slurm's own (two signals at once would merge into one).
fn multi_node_shims(dir: &Path) -> PathBuf {
    let bin_dir = shims(dir);
    let env: String = emulated(dir, 2)
        .iter()
        .map(|(k, v)| format!("export {k}='{v}'\n"))
        .collect();
    let sup = format!(
        r#"#!/bin/sh
{env}run_dir=; resume=; prev=
for a in "$@"; do
  [ "$prev" = --run-dir ] && run_dir=$a
  [ "$a" = --resume-if-exists ] && resume=$a
  prev=$a
done
exec '{}' --gpus 0,1 --targets 1 --data demo --demo-samples 100000 --max-seq-len 16 \
    --token-budget 128 --steps {MULTI_STEPS} --checkpoint-every 0 --node-timeout 10s \
    --run-dir "$run_dir" $resume
"#,
        bin("dflash-supervise").display()
    );
    let srun = r#"#!/bin/bash
while [ "${1#--}" != "$1" ]; do shift; done
pids=()
for i in 0 1; do
  SLURM_PROCID=$i SLURM_STEP_NUM_TASKS=2 SLURM_STEP_NUM_NODES=2 \
    SLURM_STEP_NODELIST=127.0.0.2,127.0.0.3 "$@" &
  pids+=($!)
done
trap 'kill -USR1 "${pids[@]}"' USR1
trap 'sleep 0.3; kill -TERM "${pids[@]}"' TERM
code=0
for p in "${pids[@]}"; do
  # A trapped signal ends a wait early (128 + its number): wait until the task has ended.
  while kill -0 $p 2>/dev/null; do wait $p; done
  wait $p; c=$?
  [ $c -gt $code ] && code=$c
done
exit $code
"#;
    write_exe(&bin_dir.join("dflash-supervise"), &sup);
    write_exe(&bin_dir.join("srun"), srun);
    bin_dir
}

/// A job id whose derived leader port (20000 + id % 20000) is free on 127.0.0.2 now.
fn job_id_with_a_free_port() -> u32 {
    loop {
        let l = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
        let port = u32::from(l.local_addr().unwrap().port());
        if (20000..40000).contains(&port) {
            return port - 20000;
        }
    }
}

/// The multi-node script of the documentation, as written there, with two nodes on this
/// machine: the notice reaches every node through srun, the time limit's SIGTERM reaches
/// every supervisor twice (from Slurm and forwarded by srun) and is one stop, every node
/// exits 75, the script requeues, and the requeued job resumes from the leader's
/// checkpoint and finishes.
#[test]
fn the_documented_multi_node_sbatch_script_is_requeued_at_the_limit_and_resumes() {
    if skip_without_nvrtc() {
        return;
    }
    let (from, script) = documented_multi_node_sbatch_script();
    assert!(script.contains("srun"), "{}", from.display());
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let script_path = dir.join("job.sbatch");
    fs::write(&script_path, &script).unwrap();
    let bin_dir = multi_node_shims(dir);
    let run_dir = script
        .split_whitespace()
        .skip_while(|w| *w != "--run-dir")
        .nth(1)
        .unwrap_or_else(|| panic!("{}: the script names no --run-dir", from.display()));
    let run = dir.join(run_dir);
    let id = job_id_with_a_free_port().to_string();

    let mut job = start_job_as(dir, &script_path, &bin_dir, 0, &id);
    wait_for("training under way", T, || {
        (last_step(&run) >= 3).then_some(())
    });
    signal(job.id(), Signal::SIGUSR1);
    wait_for("the notice's checkpoint", T, || {
        fs::read_dir(run.join("checkpoints"))
            .ok()?
            .flatten()
            .any(|e| e.path().join("meta.json").is_file())
            .then_some(())
    });
    assert!(
        last_step(&run) < MULTI_STEPS,
        "the job ended before its time limit"
    );
    killpg(Pid::from_raw(job.id() as i32), Signal::SIGTERM).unwrap();
    let code = end_of_job(&mut job, Some(Instant::now() + KILL_WAIT));
    let err0 = fs::read_to_string(dir.join("err.0")).unwrap_or_default();
    assert_eq!(code, 75, "the first start\n{err0}");
    assert!(
        err0.contains("again within 3s"),
        "one stop, though twice: {err0}"
    );
    let requeues = fs::read_to_string(dir.join("requeues")).unwrap_or_default();
    assert_eq!(requeues.trim(), format!("requeue {id}"), "{err0}");

    let mut job = start_job_as(dir, &script_path, &bin_dir, 1, &id);
    let code = end_of_job(&mut job, None);
    let err1 = fs::read_to_string(dir.join("err.1")).unwrap_or_default();
    assert_eq!(code, 0, "the requeued start\n{err1}");
    assert!(err1.contains("the job resumes at step"), "{err1}");
    let finished: Value =
        serde_json::from_str(&fs::read_to_string(run.join("finished.json")).unwrap()).unwrap();
    assert_eq!(finished["step"], MULTI_STEPS);
    let followers = fs::read_dir(run.join("nodes")).unwrap().count();
    assert_eq!(followers, 2, "one directory per session of node 1");
}
