//! Runs across nodes on one machine: each "node" is a supervisor of its own (the leader on
//! 127.0.0.2) with its own target and drafter on emulated GPUs, and the drafters of every
//! node all-reduce in one NCCL group (the emulated NCCL spans processes). The job trains
//! like one node with all the drafters, goes on without a follower it lost, and ends its
//! followers with 75 when it loses the leader, which a relaunch resumes.
//!
//! The kernels are compiled by NVRTC (PyPI's nvidia-cuda-nvrtc): without it these tests
//! skip on a laptop and fail under CI.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const T: Duration = Duration::from_secs(300);

/// The flags of every run here: small batches of the built-in data, one target and one
/// drafter per node.
fn run_flags() -> Vec<&'static str> {
    let mut v = SMALL_GPU_RUN.to_vec();
    v.extend(["--node-timeout", "10s"]);
    v
}

/// One node's supervisor.
struct Node {
    child: Child,
    err: PathBuf,
    status: Option<std::process::ExitStatus>,
}

impl Node {
    fn start(tmp: &Path, env: &[(String, String)], args: &[&str], tag: &str) -> Node {
        let err = tmp.join(format!("{tag}.err"));
        let child = Command::new(bin("dflash-supervise"))
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(tmp.join(format!("{tag}.out"))).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        Node {
            child,
            err,
            status: None,
        }
    }

    /// Its exit code (`None`: killed by a signal).
    fn wait(&mut self, within: Duration) -> Option<i32> {
        if self.status.is_none() {
            let st = wait_for("the node's exit", within, || self.child.try_wait().unwrap());
            self.status = Some(st);
        }
        self.status.and_then(|s| s.code())
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }
}

/// A job of `nodes` nodes in `run_dir`, each on two emulated GPUs.
struct Job {
    env: Vec<(String, String)>,
    tmp: PathBuf,
    run_dir: PathBuf,
    port: u16,
    nodes: u32,
    extra: Vec<String>,
}

impl Job {
    fn new(tmp: &Path, nodes: u32, extra: &[&str]) -> Job {
        Job {
            env: emulated(tmp, 2),
            tmp: tmp.to_path_buf(),
            run_dir: tmp.join("job"),
            port: free_port(),
            nodes,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn node(&self, rank: u32, tag: &str) -> Node {
        let (nodes, rank_s, leader) = (
            self.nodes.to_string(),
            rank.to_string(),
            format!("127.0.0.2:{}", self.port),
        );
        let mut args: Vec<&str> = vec!["--gpus", "0,1", "--run-dir"];
        args.push(self.run_dir.to_str().unwrap());
        args.extend([
            "--nodes",
            &nodes,
            "--node-rank",
            &rank_s,
            "--leader",
            &leader,
        ]);
        args.extend(run_flags());
        args.extend(self.extra.iter().map(String::as_str));
        Node::start(&self.tmp, &self.env, &args, &format!("{tag}-node{rank}"))
    }

    fn start(&self, tag: &str) -> Vec<Node> {
        (0..self.nodes).map(|r| self.node(r, tag)).collect()
    }

    /// A follower's run directory (its newest session's).
    fn follower_dir(&self, rank: u32) -> PathBuf {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(self.run_dir.join("nodes"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("node-{rank}.")))
            })
            .collect();
        dirs.sort();
        dirs.pop().expect("the follower's run directory")
    }
}

/// (step, loss, contributors, members) of train.jsonl's step records.
fn steps(run_dir: &Path) -> Vec<(u64, f64, u64, u64)> {
    read_jsonl(&run_dir.join("train.jsonl"))
        .iter()
        .filter(|l| l.get("loss").is_some())
        .map(|l| {
            (
                l["step"].as_u64().unwrap(),
                l["loss"].as_f64().unwrap(),
                l["contributors"].as_u64().unwrap(),
                l["members"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn state(run_dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(run_dir.join("state.json")).unwrap()).unwrap()
}

/// The ledger of one node's run directory: its audit passes, nothing lost or duplicated.
/// Returns the audit (with the leader's, `job`: every node's batches).
fn clean_ledger(run_dir: &Path) -> Value {
    let out = supervise(
        &["ledger", "--run-dir", run_dir.to_str().unwrap(), "--json"],
        None,
    );
    let audit: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert_eq!(out.status.code(), Some(0), "{audit}");
    assert_eq!(
        (audit["lost"].as_u64(), audit["duplicated"].as_u64()),
        (Some(0), Some(0)),
        "{}: {audit}",
        run_dir.display()
    );
    audit
}

/// The leader's audit of the job (`job.jsonl`): every batch of the data consumed exactly
/// once over all the nodes, and the job done.
fn clean_job(run_dir: &Path, batches: u64) -> Value {
    let job = clean_ledger(run_dir)["job"].clone();
    assert_eq!(
        (
            job["consumed_once"].as_u64(),
            job["duplicated"].as_u64(),
            job["missing"].as_u64(),
            job["data_batches"].as_u64(),
            job["done"].as_bool()
        ),
        (Some(batches), Some(0), Some(0), Some(batches), Some(true)),
        "{job}"
    );
    job
}

/// The consumed batches the newest checkpoint of `run_dir` records (`consumed_below`, and
/// how many others).
fn checkpoint_consumed(run_dir: &Path) -> (u64, usize) {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(run_dir.join("checkpoints"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("meta.json").is_file())
        .collect();
    dirs.sort();
    let meta: Value = serde_json::from_str(
        &std::fs::read_to_string(dirs.last().unwrap().join("meta.json")).unwrap(),
    )
    .unwrap();
    let s = &meta["supervisor"];
    (
        s["consumed_below"].as_u64().unwrap(),
        s["consumed_extra"].as_array().map_or(0, Vec::len),
    )
}

#[test]
fn two_nodes_train_like_one_node_with_the_union_of_their_drafters() {
    if skip_without_nvrtc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let job = Job::new(
        tmp.path(),
        2,
        &["--demo-samples", "64", "--metrics-interval", "1s"],
    );
    let mut nodes = job.start("a");
    // Bad peers while it trains: an HTTP request, and a frame that is not a message.
    wait_for("a step of the job", T, || {
        (!steps(&job.run_dir).is_empty()).then_some(())
    });
    // Their sockets stay open: the leader closes them.
    let mut peers = Vec::new();
    for bytes in [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        [&10u32.to_be_bytes()[..], b"{\"msg\": 1}"].concat(),
    ] {
        let mut s = std::net::TcpStream::connect(("127.0.0.2", job.port)).unwrap();
        std::io::Write::write_all(&mut s, &bytes).unwrap();
        peers.push(s);
    }
    for (r, n) in nodes.iter_mut().enumerate() {
        assert_eq!(n.wait(T), Some(0), "node {r}: {}", n.stderr());
    }
    let leader = &job.run_dir;
    let follower = job.follower_dir(1);
    // One node with a target and both drafters, over the same data.
    let one = tmp.path().join("one");
    let mut args = vec!["--gpus", "0,1,2", "--run-dir", one.to_str().unwrap()];
    args.extend(run_flags());
    args.extend(["--demo-samples", "64"]);
    let env = emulated(tmp.path(), 3);
    let mut single = Node::start(tmp.path(), &env, &args, "one");
    assert_eq!(single.wait(T), Some(0), "{}", single.stderr());

    let (job_steps, one_steps) = (steps(leader), steps(&one));
    assert!(job_steps.len() >= 3, "{job_steps:?}");
    assert_eq!(
        job_steps.len(),
        one_steps.len(),
        "{job_steps:?} vs {one_steps:?}"
    );
    for (j, o) in job_steps.iter().zip(&one_steps) {
        // The same batches in each step, summed in the same rank order: the same losses.
        assert_eq!((j.0, j.2), (o.0, o.2), "{job_steps:?} vs {one_steps:?}");
        assert!(
            (j.1 - o.1).abs() <= 1e-9 * o.1.abs(),
            "step {}: loss {} across nodes, {} on one node",
            j.0,
            j.1,
            o.1
        );
        assert_eq!(j.3, 2, "both nodes' drafters are members of every step");
    }
    assert_eq!(
        steps(&follower),
        job_steps,
        "the follower records the job's steps"
    );
    // Every batch trained exactly once across the job: each node's ledger is clean, the
    // nodes' batches add up to the one node's, and so do the steps' contributors.
    clean_ledger(&follower);
    let batches = state(&one)["batches_consumed"].as_u64().unwrap();
    assert_eq!(clean_job(leader, batches)["nodes"], 2);
    let per_node: Vec<u64> = [leader.as_path(), follower.as_path()]
        .iter()
        .map(|d| state(d)["batches_consumed"].as_u64().unwrap())
        .collect();
    assert_eq!(per_node.iter().sum::<u64>(), batches, "{per_node:?}");
    assert!(per_node.iter().all(|&n| n > 0), "{per_node:?}");
    let contributors: u64 = job_steps.iter().map(|s| s.2).sum();
    assert_eq!(contributors, batches);
    // The leader's checkpoint records the job's consumed batches, not its own only; the
    // follower writes no checkpoint nor drafter of its own: the job's are the leader's.
    assert_eq!(checkpoint_consumed(leader), (batches, 0));
    assert!(leader.join("drafter/model.safetensors").is_file());
    assert!(!follower.join("drafter").exists());
    assert_eq!(
        std::fs::read_dir(follower.join("checkpoints"))
            .unwrap()
            .count(),
        0,
        "no checkpoint on the follower"
    );
    let err = nodes[1].stderr();
    assert!(
        err.contains("cluster: node 1 joined the leader at 127.0.0.2:"),
        "{err}"
    );
    // Each bad peer was one line, and the run trained as above: unaffected.
    let log = nodes[0].stderr();
    let refused: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("cluster: refused a connection from"))
        .collect();
    assert_eq!(refused.len(), 2, "{log}");
    assert!(refused.iter().any(|l| l.contains("a frame of")), "{log}");
    assert!(refused.iter().any(|l| l.contains("not a message")), "{log}");
    // One metrics stream: the leader's windows hold the follower's, its GPUs sampled by the
    // follower's own supervisor (NVML stays in supervisors).
    let windows = read_jsonl(&leader.join("metrics.jsonl"));
    assert!(windows.iter().all(|w| w["node"] == 0), "{windows:?}");
    let forwarded = windows
        .iter()
        .filter_map(|w| w["nodes"].get("1"))
        .find(|w| w["gpu"]["gpus"].as_array().is_some_and(|g| g.len() == 2))
        .unwrap_or_else(|| panic!("a window of node 1 with its two GPUs: {windows:?}"));
    assert_eq!(forwarded["node"], 1);
    assert!(
        forwarded["workers"].get("drafter-0").is_some(),
        "{forwarded}"
    );
}

/// Every batch of the data trained exactly once over the job: the job's consumed batches
/// (the leader's newest checkpoint) are 0..n, the leader counted n, and the steps'
/// contributors add up to n. Returns the steps.
fn every_batch_once(job: &Job, leader_log: &str) -> Vec<(u64, f64, u64, u64)> {
    let job_steps = steps(&job.run_dir);
    let (below, extra) = checkpoint_consumed(&job.run_dir);
    assert_eq!(extra, 0);
    assert_eq!(
        job_steps.iter().map(|s| s.2).sum::<u64>(),
        below,
        "{job_steps:?}"
    );
    let all = leader_log
        .lines()
        .find(|l| l.contains("batches of the job consumed"))
        .and_then(|l| l.split("cluster: all ").nth(1))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse::<u64>().ok());
    assert_eq!(all, Some(below), "{leader_log}");
    job_steps
}

fn worker_pids(run_dir: &Path) -> Vec<u32> {
    state(run_dir)["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|w| w["pid"].as_u64().map(|p| p as u32))
        .collect()
}

#[test]
fn a_follower_killed_mid_run_costs_nothing_and_started_again_it_rejoins() {
    if skip_without_nvrtc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let job = Job::new(tmp.path(), 3, &["--demo-samples", "400"]);
    let mut nodes = job.start("a");
    wait_for("two steps of the job", T, || {
        (steps(&job.run_dir).len() >= 2).then_some(())
    });
    let victim = job.follower_dir(2);
    let workers = worker_pids(&victim);
    signal(nodes[2].child.id(), nix::sys::signal::Signal::SIGKILL);
    assert_eq!(nodes[2].wait(T), None, "killed");
    let lost = wait_for("the leader to lose node 2", T, || {
        let log = nodes[0].stderr();
        log.contains("cluster: node 2 lost").then_some(log)
    });
    assert!(lost.contains("the job goes on without it"), "{lost}");
    // Its workers went with it (the reaper), no orphan.
    for pid in workers {
        wait_for("the lost node's workers to end", T, || {
            (!pid_alive(pid)).then_some(())
        });
    }
    // The same command again: it joins the running job from a checkpoint of the leader.
    let mut again = job.node(2, "b");
    for r in [0, 1] {
        assert_eq!(nodes[r].wait(T), Some(0), "node {r}: {}", nodes[r].stderr());
    }
    assert_eq!(again.wait(T), Some(0), "{}", again.stderr());
    let log = nodes[0].stderr();
    assert!(
        log.contains("cluster: node 2 (") && log.contains("joins the running job"),
        "{log}"
    );
    assert!(
        log.contains("cluster: node 2 joined the job with ranks [2000]"),
        "{log}"
    );
    let job_steps = every_batch_once(&job, &log);
    let audit = clean_job(&job.run_dir, checkpoint_consumed(&job.run_dir).0);
    assert_eq!(audit["losses"], 1, "{audit}");
    assert_eq!(
        job_steps[0].3, 3,
        "three nodes' drafters at first: {job_steps:?}"
    );
    assert!(
        job_steps.iter().any(|s| s.3 == 2),
        "two while node 2 was gone: {job_steps:?}"
    );
    assert_eq!(job_steps.last().unwrap().3, 3, "three again: {job_steps:?}");
    // The rejoined node's steps are the job's from the checkpoint it started from.
    let rejoined = steps(&job.follower_dir(2));
    assert!(
        !rejoined.is_empty() && rejoined.len() < job_steps.len(),
        "{rejoined:?}"
    );
    assert_eq!(rejoined.last(), job_steps.last());
    for d in [job.follower_dir(1), job.follower_dir(2)] {
        clean_ledger(&d);
    }
}

#[test]
fn a_follower_frozen_past_the_node_timeout_is_lost_and_thawed_it_ends_with_75() {
    if skip_without_nvrtc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let job = Job::new(tmp.path(), 2, &["--demo-samples", "120"]);
    let mut nodes = job.start("a");
    wait_for("two steps of the job", T, || {
        (steps(&job.run_dir).len() >= 2).then_some(())
    });
    let frozen = Instant::now();
    signal(nodes[1].child.id(), nix::sys::signal::Signal::SIGSTOP);
    let log = wait_for("the leader to lose node 1", T, || {
        let log = nodes[0].stderr();
        log.contains("cluster: node 1 lost").then_some(log)
    });
    assert!(log.contains("silent for 10s"), "{log}");
    assert!(
        frozen.elapsed() >= Duration::from_secs(9),
        "{:?}",
        frozen.elapsed()
    );
    signal(nodes[1].child.id(), nix::sys::signal::Signal::SIGCONT);
    // Thawed, it finds its leader gone from its link and stops: no split brain.
    assert_eq!(nodes[1].wait(T), Some(75), "{}", nodes[1].stderr());
    assert_eq!(nodes[0].wait(T), Some(0), "{}", nodes[0].stderr());
    let job_steps = every_batch_once(&job, &nodes[0].stderr());
    let audit = clean_job(&job.run_dir, checkpoint_consumed(&job.run_dir).0);
    assert_eq!(audit["losses"], 1, "{audit}");
    assert_eq!(
        job_steps.last().unwrap().3,
        1,
        "the leader alone at the end: {job_steps:?}"
    );
    for pid in worker_pids(&job.follower_dir(1)) {
        wait_for("the frozen node's workers to end", T, || {
            (!pid_alive(pid)).then_some(())
        });
    }
}

#[test]
fn the_leaders_loss_ends_every_follower_with_75_and_the_relaunch_resumes() {
    if skip_without_nvrtc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let job = Job::new(
        tmp.path(),
        2,
        &[
            "--demo-samples",
            "160",
            "--checkpoint-every",
            "2",
            "--resume-if-exists",
        ],
    );
    let mut nodes = job.start("a");
    wait_for("a checkpoint and a step after it", T, || {
        let s = steps(&job.run_dir);
        (s.len() >= 3
            && job
                .run_dir
                .join("checkpoints/step-00000002/meta.json")
                .is_file())
        .then_some(())
    });
    let follower_workers = worker_pids(&job.follower_dir(1));
    let leader_workers = worker_pids(&job.run_dir);
    let killed = Instant::now();
    signal(nodes[0].child.id(), nix::sys::signal::Signal::SIGKILL);
    assert_eq!(nodes[1].wait(T), Some(75), "{}", nodes[1].stderr());
    assert!(
        killed.elapsed() < Duration::from_secs(60),
        "within the stop timeout: {:?}",
        killed.elapsed()
    );
    let err = nodes[1].stderr();
    assert!(
        err.contains("the leader at 127.0.0.2:") && err.contains("is lost"),
        "{err}"
    );
    assert!(
        err.contains("when every node runs its command again"),
        "{err}"
    );
    for pid in follower_workers {
        assert!(!pid_alive(pid), "the follower stopped its workers");
    }
    // The killed leader's workers end too (its reaper): no orphan anywhere.
    for pid in leader_workers {
        wait_for("the leader's workers to end", T, || {
            (!pid_alive(pid)).then_some(())
        });
    }
    nodes[0].wait(T);
    // The same command on every node resumes the job from the leader's newest checkpoint.
    let saved = checkpoint_consumed(&job.run_dir);
    let mut again = job.start("b");
    for (r, n) in again.iter_mut().enumerate() {
        assert_eq!(n.wait(T), Some(0), "node {r}: {}", n.stderr());
    }
    let log = again[1].stderr();
    assert!(
        log.contains("the job resumes at step") && log.contains("from the leader's checkpoint"),
        "{log}"
    );
    let lines = read_jsonl(&job.run_dir.join("train.jsonl"));
    let resumed = lines
        .iter()
        .find_map(|l| {
            l["rollback"]["to"]
                .as_u64()
                .filter(|_| l["rollback"]["resume"] == true)
        })
        .expect("train.jsonl records the resume");
    assert!(resumed >= 2 && saved.0 > 0, "{resumed} {saved:?}");
    // The lineage: the first session's steps up to the resumed one, then the second
    // session's; every batch of the data once.
    let at = lines
        .iter()
        .position(|l| l["rollback"]["resume"] == true)
        .unwrap();
    let contributors = |l: &Value| l["contributors"].as_u64().unwrap_or(0);
    let lineage: u64 = lines[..at]
        .iter()
        .filter(|l| l["step"].as_u64().is_some_and(|s| s <= resumed))
        .map(contributors)
        .chain(lines[at + 1..].iter().map(contributors))
        .sum();
    let job_steps = steps(&job.run_dir);
    let (below, extra) = checkpoint_consumed(&job.run_dir);
    assert_eq!((lineage, extra), (below, 0), "{job_steps:?}");
    let audit = clean_job(&job.run_dir, below);
    assert_eq!(audit["resumes"], 1, "{audit}");
}
