//! The sbatch script of the documentation, as written there (extracted, not copied),
//! submitted to a real single-node Slurm (munged, slurmctld and slurmd started here, in a
//! temporary directory) with its time limit shortened on the sbatch command line: Slurm
//! sends SIGUSR1 to the batch shell 30 s before the 1-minute limit, SIGTERM at the limit;
//! the script requeues the job, which resumes and finishes.
//!
//! Skips when Slurm is not installed or the test is not root; under CI (`CI` set) a
//! missing Slurm fails it (.ci/run installs slurmctld, slurmd, slurm-client and munge).

mod common;

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;
use serde_json::Value;

/// Every wait's deadline: a start of the job, Slurm's requeue delay, the daemons' start.
const T: Duration = Duration::from_secs(300);
const STEPS: u64 = 40;
/// The first start's steps are made this much longer (the worker's test-only
/// DFLASH_TEST_STEP_DELAY_MS), so it is still training at its 1-minute limit (40 steps take
/// over 200 s); the requeued start runs at full speed and finishes well within its own.
const FIRST_START_STEP_DELAY_MS: u32 = 5000;

/// A program on PATH or in the sbin directories (root's PATH may lack them under cargo).
fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .map(PathBuf::from)
        .chain(["/usr/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn write_executable(path: &Path, text: &str) {
    fs::write(path, text).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

/// munged, slurmctld and slurmd of one test, with their configuration and state in `dir`;
/// stopped on drop (the job cancelled first), also when the test panics.
struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
    daemons: Vec<(&'static str, Child)>,
    job: Option<String>,
}

impl Cluster {
    fn start(dir: &Path, programs: &[PathBuf; 4]) -> Cluster {
        let [mungekey, munged, slurmctld, slurmd] = programs;
        let node = fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap()
            .trim()
            .split('.')
            .next()
            .unwrap()
            .to_string();
        let munge = dir.join("munge");
        let (state, spool) = (dir.join("state"), dir.join("spool"));
        for d in [&munge, &state, &spool] {
            fs::create_dir_all(d).unwrap();
        }
        let mut cluster = Cluster {
            dir: dir.to_path_buf(),
            conf: dir.join("slurm.conf"),
            daemons: Vec::new(),
            job: None,
        };
        let key = munge.join("munge.key");
        let out = Command::new(mungekey)
            .arg("--create")
            .arg(format!("--keyfile={}", key.display()))
            .output()
            .unwrap();
        assert!(out.status.success(), "mungekey: {out:?}");
        fs::set_permissions(&key, fs::Permissions::from_mode(0o400)).unwrap();
        let socket = munge.join("munge.socket");
        cluster.spawn(
            "munged",
            Command::new(munged)
                .arg("--foreground")
                .arg("--force")
                .arg(format!("--key-file={}", key.display()))
                .arg(format!("--socket={}", socket.display()))
                .arg(format!("--pid-file={}", munge.join("munged.pid").display()))
                .arg(format!("--log-file={}", munge.join("munged.log").display()))
                .arg(format!(
                    "--seed-file={}",
                    munge.join("munged.seed").display()
                )),
        );
        wait_for("munged's socket", T, || socket.exists().then_some(()));

        // The script asks for --gres=gpu:8: eight GPUs whose device files are /dev/null (a
        // gres/gpu without File is dropped by slurmd; task/none confines no device).
        let gpus = dir.join("gpus");
        fs::create_dir_all(&gpus).unwrap();
        for i in 0..8 {
            std::os::unix::fs::symlink("/dev/null", gpus.join(format!("gpu{i}"))).unwrap();
        }
        fs::write(
            dir.join("gres.conf"),
            format!(
                "NodeName={node} Name=gpu File={}/gpu[0-7]\n",
                gpus.display()
            ),
        )
        .unwrap();
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (d, ctld_port, d_port) = (dir.display(), free_port(), free_port());
        fs::write(
            &cluster.conf,
            format!(
                "ClusterName=dflashtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket},cred_expire=10
StateSaveLocation={state}
SlurmdSpoolDir={spool}
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
GresTypes=gpu
JobRequeue=1
KillWait=30
MinJobAge=600
ReturnToService=2
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} Gres=gpu:8 State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
",
                socket = socket.display(),
                state = state.display(),
                spool = spool.display(),
            ),
        )
        .unwrap();
        let conf = cluster.conf.clone();
        cluster.spawn(
            "slurmctld",
            Command::new(slurmctld)
                .arg("-D")
                .arg("-i")
                .arg("-f")
                .arg(&conf),
        );
        cluster.spawn(
            "slurmd",
            Command::new(slurmd)
                .arg("-D")
                .arg("-N")
                .arg(&node)
                .arg("-f")
                .arg(&conf),
        );
        let up = Instant::now() + T;
        loop {
            let o = cluster.slurm("sinfo", &["-h", "-o", "%t"]);
            if String::from_utf8_lossy(&o.stdout).trim() == "idle" {
                break;
            }
            let exited = cluster
                .daemons
                .iter_mut()
                .find_map(|(name, child)| Some((*name, child.try_wait().unwrap()?)));
            if let Some((name, st)) = exited {
                panic!("{name} exited ({st}) at start\n{}", cluster.logs());
            }
            if Instant::now() > up {
                panic!(
                    "timed out after {T:?} waiting for the node to be idle: sinfo {o:?}\n{}",
                    cluster.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        cluster
    }

    fn spawn(&mut self, name: &'static str, cmd: &mut Command) {
        let child = cmd
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(fs::File::create(self.dir.join(format!("{name}.out"))).unwrap())
            .stderr(fs::File::create(self.dir.join(format!("{name}.err"))).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        self.daemons.push((name, child));
    }

    /// A Slurm client command (sinfo, sbatch, scontrol, scancel) of this cluster.
    fn slurm(&self, program: &str, args: &[&str]) -> Output {
        Command::new(find_program(program).unwrap_or_else(|| PathBuf::from(program)))
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run {program}: {e}"))
    }

    /// `scontrol show job`'s KEY=VALUE fields of the job.
    fn job_field(&self, job: &str, key: &str) -> Option<String> {
        let o = self.slurm("scontrol", &["show", "job", job]);
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{key}=")).map(str::to_string))
    }

    fn logs(&self) -> String {
        ["slurmctld.log", "slurmd.log", "slurmctld.err", "slurmd.err"]
            .iter()
            .map(|f| {
                let text = fs::read_to_string(self.dir.join(f)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- {f}\n{}", tail.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(job) = self.job.take() {
            let state = self.job_field(&job, "JobState");
            if !matches!(state.as_deref(), Some("COMPLETED" | "FAILED" | "CANCELLED")) {
                let _ = self.slurm("scancel", &[&job]);
                let deadline = Instant::now() + Duration::from_secs(60);
                while Instant::now() < deadline
                    && matches!(
                        self.job_field(&job, "JobState").as_deref(),
                        Some("RUNNING" | "COMPLETING" | "PENDING" | "REQUEUED")
                    )
                {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
        // slurmd, slurmctld, then munged.
        for (_, child) in self.daemons.iter_mut().rev() {
            signal(child.id(), Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `dflash-supervise` for the script: the real one on CPU workers with the demo data, with
/// the script's `--run-dir` and `--resume-if-exists` (its model, data and GPUs are a real
/// machine's); the first start (SLURM_RESTART_COUNT unset or 0) has slow steps.
fn shim(dir: &Path) -> PathBuf {
    let bin_dir = dir.join("bin");
    fs::create_dir_all(&bin_dir).unwrap();
    write_executable(
        &bin_dir.join("dflash-supervise"),
        &format!(
            r#"#!/bin/sh
run_dir=; resume=; prev=
for a in "$@"; do
  [ "$prev" = --run-dir ] && run_dir=$a
  [ "$a" = --resume-if-exists ] && resume=$a
  prev=$a
done
[ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] && export DFLASH_TEST_STEP_DELAY_MS={FIRST_START_STEP_DELAY_MS}
exec '{}' --gpus cpu:2 --data demo --demo-samples 100000 --steps {STEPS} --checkpoint-every 0 --run-dir "$run_dir" $resume
"#,
            bin("dflash-supervise").display()
        ),
    );
    bin_dir
}

fn events_of(run: &Path, kind: &str) -> Vec<Value> {
    read_jsonl(&run.join("events.jsonl"))
        .into_iter()
        .filter(|e| e["event"] == kind)
        .collect()
}

#[test]
fn the_documented_sbatch_script_under_a_real_slurm_is_signalled_requeued_and_finishes() {
    // Root first: a machine where the test cannot start daemons (and .ci/run could not
    // install them) skips, under CI too.
    if fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(1) != 0 {
        eprintln!("skipped: a real slurmctld and slurmd are started only as root");
        return;
    }
    let names = [
        "mungekey",
        "munged",
        "slurmctld",
        "slurmd",
        "sbatch",
        "scontrol",
    ];
    let found: Vec<Option<PathBuf>> = names.iter().map(|n| find_program(n)).collect();
    if let Some(i) = found.iter().position(Option::is_none) {
        let msg = format!(
            "{} is not installed (Debian: slurmctld slurmd slurm-client munge)",
            names[i]
        );
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("skipped: {msg}");
        return;
    }
    let p = |i: usize| found[i].clone().unwrap();
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut cluster = Cluster::start(&dir.join("slurm"), &[p(0), p(1), p(2), p(3)]);

    let (from, script) = documented_sbatch_script();
    let job_dir = dir.join("job");
    fs::create_dir_all(&job_dir).unwrap();
    let script_path = job_dir.join("job.sbatch");
    fs::write(&script_path, &script).unwrap();
    let run_dir = script
        .lines()
        .find(|l| l.contains("--run-dir"))
        .and_then(|l| {
            l.split_whitespace()
                .skip_while(|w| *w != "--run-dir")
                .nth(1)
        })
        .unwrap_or_else(|| panic!("{}: the script names no --run-dir", from.display()));
    let run = job_dir.join(run_dir);
    let bin_dir = shim(dir);

    // The script's #SBATCH lines stand (--gres=gpu:8, --requeue, --open-mode=append) but
    // for the time limit and its notice, shortened here: options given to sbatch win.
    let out_file = job_dir.join("slurm.out");
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let submitted = Command::new(p(4))
        .args([
            "--parsable",
            "--time=1",
            "--signal=B:USR1@30",
            "--cpus-per-task=1",
            "--export=ALL",
        ])
        .arg(format!("--chdir={}", job_dir.display()))
        .arg(format!("--output={}", out_file.display()))
        .arg(&script_path)
        .env("PATH", path)
        .env("SLURM_CONF", &cluster.conf)
        .env_remove("SLURM_RESTART_COUNT")
        .output()
        .unwrap();
    assert!(
        submitted.status.success(),
        "sbatch: {submitted:?}\n{}",
        cluster.logs()
    );
    let job = String::from_utf8_lossy(&submitted.stdout)
        .trim()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    cluster.job = Some(job.clone());
    let output = || fs::read_to_string(&out_file).unwrap_or_default();
    let wait = |what: &str, f: &mut dyn FnMut() -> bool| {
        let deadline = Instant::now() + T;
        while !f() {
            if Instant::now() > deadline {
                panic!(
                    "timed out after {T:?} waiting for {what}\nscontrol show job: {}\njob output:\n{}\n{}",
                    String::from_utf8_lossy(&cluster.slurm("scontrol", &["show", "job", &job]).stdout),
                    output(),
                    cluster.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    };

    // The first start: Slurm's notice (SIGUSR1, forwarded by the script) writes a
    // checkpoint; the time limit's SIGTERM stops the run with exit 75 and the script
    // requeues it.
    wait("the notice's checkpoint request", &mut || {
        !events_of(&run, "checkpoint_requested").is_empty()
    });
    wait("the first start's end", &mut || {
        !events_of(&run, "run_end").is_empty()
    });
    let first_end = &events_of(&run, "run_end")[0];
    assert_eq!(first_end["exit_code"], 75, "{first_end}\n{}", output());
    assert_eq!(first_end["reason"], "SIGTERM received", "{first_end}");
    let requested = &events_of(&run, "checkpoint_requested")[0];
    assert_eq!(requested["signal"], "SIGUSR1", "{requested}");
    assert!(
        output().contains("DUE TO TIME LIMIT"),
        "no time limit in the job's output:\n{}",
        output()
    );

    // Requeued by the script: it starts again, resumes and finishes.
    wait("the job to complete after its requeue", &mut || {
        cluster.job_field(&job, "JobState").as_deref() == Some("COMPLETED")
    });
    assert_eq!(
        cluster.job_field(&job, "Restarts").as_deref(),
        Some("1"),
        "{}",
        output()
    );
    assert_eq!(
        cluster.job_field(&job, "ExitCode").as_deref(),
        Some("0:0"),
        "{}",
        output()
    );
    let text = output();
    assert!(text.contains("from the checkpoint of step"), "{text}");
    assert_eq!(events_of(&run, "run_start").len(), 2, "{text}");
    let ends: Vec<Value> = events_of(&run, "run_end");
    assert_eq!(ends.len(), 2, "{text}");
    assert_eq!(ends[1]["exit_code"], 0, "{}", ends[1]);
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
        (Some(0), Some(0)),
        "{a}"
    );
    eprintln!(
        "job {job}: signalled, requeued and finished under slurmctld/slurmd in {:?}",
        started.elapsed()
    );
    drop(cluster);
}
