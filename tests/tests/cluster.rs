//! Several nodes on one machine: supervisors on distinct loopback addresses (127.0.0.2,
//! 127.0.0.3, ...) run `cluster-check`, the leader's authenticated control link; bad peers
//! are refused without harm, and a lost leader ends its followers with 75.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{bin, free_port, wait_for};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

struct Node {
    child: Child,
    out: std::path::PathBuf,
    err: std::path::PathBuf,
}

impl Node {
    fn start(dir: &Path, run_dir: &Path, port: u16, nodes: u32, rank: u32, extra: &[&str]) -> Node {
        let out = dir.join(format!("node{rank}-{}.out", unique()));
        let err = out.with_extension("err");
        let child = Command::new(bin("dflash-supervise"))
            .arg("cluster-check")
            .arg("--run-dir")
            .arg(run_dir)
            .args([
                "--nodes",
                &nodes.to_string(),
                "--node-rank",
                &rank.to_string(),
            ])
            .args(["--leader", &format!("127.0.0.2:{port}")])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        Node { child, out, err }
    }

    fn wait(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            assert!(
                Instant::now() < deadline,
                "still running after {within:?}: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn unique() -> u64 {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
}

/// The leader is listening once its first line is out.
fn wait_listening(leader: &Node) {
    wait_for("the leader listening", T, || {
        leader.stderr().contains("waiting up to").then_some(())
    });
}

#[test]
fn three_nodes_join_the_leader_and_it_lists_them() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let port = free_port();
    // Followers first: they wait for the leader (and its secret) to appear.
    let mut f1 = Node::start(tmp.path(), &run, port, 3, 1, &[]);
    let mut f2 = Node::start(tmp.path(), &run, port, 3, 2, &[]);
    let mut leader = Node::start(tmp.path(), &run, port, 3, 0, &["--json"]);
    assert_eq!(leader.wait(T), Some(0), "{}", leader.stderr());
    assert_eq!(f1.wait(T), Some(0), "{}", f1.stderr());
    assert_eq!(f2.wait(T), Some(0), "{}", f2.stderr());
    let v: Value = serde_json::from_str(leader.stdout().trim()).unwrap();
    let nodes: Vec<u64> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["node"].as_u64().unwrap())
        .collect();
    assert_eq!(nodes, [0, 1, 2]);
    assert!(v["nodes"][1]["version"] == v["nodes"][0]["version"], "{v}");
    assert!(
        f1.stderr()
            .contains("node 1 joined the leader at 127.0.0.2:"),
        "{}",
        f1.stderr()
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(run.join("cluster.secret"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "the secret is the job's user's alone");
}

/// Connect to the leader and read its challenge (so the connection is surely accepted).
fn connect(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.2", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    let challenge: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(challenge["msg"], "challenge", "{challenge}");
    s
}

fn frame(json: &str) -> Vec<u8> {
    let mut f = (json.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(json.as_bytes());
    f
}

/// The connection ends (the leader closed it): a read returns 0 or fails.
fn closed(mut s: TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return true,
            Ok(_) => {} // a refusal's frame first
        }
    }
}

#[test]
fn bad_peers_are_refused_in_one_line_each_and_the_nodes_still_join() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let port = free_port();
    let mut leader = Node::start(tmp.path(), &run, port, 2, 0, &["--timeout", "50s"]);
    wait_listening(&leader);

    // A second leader on the same port.
    let mut second = Node::start(tmp.path(), &tmp.path().join("other"), port, 2, 0, &[]);
    assert_eq!(second.wait(T), Some(2), "{}", second.stderr());
    let line = second.stderr();
    assert_eq!(line.trim().lines().count(), 1, "{line}");
    assert!(line.contains("the port is taken"), "{line}");

    // Garbage: an HTTP request (its first four bytes read as a frame far over the limit).
    let mut g = connect(port);
    g.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert!(closed(g));
    // A frame in bounds that is not a message.
    let mut g = connect(port);
    g.write_all(&frame("{\"msg\": \"join\", \"rank\": [1]}"))
        .unwrap();
    assert!(closed(g));
    // A join with a MAC made without the secret.
    let mut g = connect(port);
    let info = r#"{"host": "x", "version": "0", "gpus": [], "gpu_note": null}"#;
    let join = format!(
        r#"{{"msg": "join", "rank": 1, "nonce": "00", "mac": "{}", "info": {info}}}"#,
        "ab".repeat(32)
    );
    g.write_all(&frame(&join)).unwrap();
    assert!(closed(g));
    // A slow peer: a few bytes of a frame, then nothing; dropped at the handshake's limit.
    let started = Instant::now();
    let mut slow = connect(port);
    slow.write_all(&[0, 0]).unwrap();
    assert!(closed(slow));
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    // A follower holding another job's secret: refused, and gives up at its --timeout.
    let other = tmp.path().join("other-job");
    std::fs::create_dir_all(&other).unwrap();
    let secret = other.join("cluster.secret");
    std::fs::write(&secret, "cd".repeat(32)).unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let mut stranger = Node::start(tmp.path(), &other, port, 2, 1, &["--timeout", "2s"]);
    assert_eq!(stranger.wait(T), Some(75), "{}", stranger.stderr());
    assert!(
        stranger.stderr().contains("wrong secret"),
        "{}",
        stranger.stderr()
    );

    // The real follower joins and the check passes.
    let mut f1 = Node::start(tmp.path(), &run, port, 2, 1, &[]);
    assert_eq!(f1.wait(T), Some(0), "{}", f1.stderr());
    assert_eq!(leader.wait(T), Some(0), "{}", leader.stderr());
    let err = leader.stderr();
    let refused: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("refused a connection"))
        .collect();
    let count = |why: &str| refused.iter().filter(|l| l.contains(why)).count();
    for why in ["a frame of", "not a message", "no join within 5s"] {
        assert_eq!(count(why), 1, "{why}: {err}");
    }
    // The forged join, and each try of the follower with another job's secret.
    assert!(count("wrong secret") >= 2, "{err}");
    assert_eq!(refused.len(), 3 + count("wrong secret"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_lost_leader_ends_its_followers_with_75_and_a_lost_follower_may_join_again() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let port = free_port();
    let fast = ["--node-timeout", "4s"];
    let mut leader = Node::start(tmp.path(), &run, port, 3, 0, &fast);
    wait_listening(&leader);
    // A follower killed: the leader says it is lost; started again, it joins again.
    let mut f1 = Node::start(tmp.path(), &run, port, 3, 1, &fast);
    wait_for("node 1 joined", T, || {
        leader.stderr().contains("node 1 joined").then_some(())
    });
    f1.child.kill().unwrap();
    let _ = f1.child.wait();
    wait_for("node 1 lost", T, || {
        leader.stderr().contains("node 1 lost").then_some(())
    });
    let mut f1 = Node::start(tmp.path(), &run, port, 3, 1, &fast);
    wait_for("node 1 joined again", T, || {
        (leader.stderr().matches("node 1 joined").count() == 2).then_some(())
    });
    // A follower frozen past the node timeout: lost too; thawed, it finds its link closed
    // (exit 75), and started again it joins a third time.
    let frozen = nix::unistd::Pid::from_raw(f1.child.id() as i32);
    nix::sys::signal::kill(frozen, nix::sys::signal::Signal::SIGSTOP).unwrap();
    wait_for("node 1 lost again", T, || {
        (leader.stderr().matches("node 1 lost").count() == 2).then_some(())
    });
    assert!(
        leader.stderr().contains("node 1 lost: silent for 4s"),
        "{}",
        leader.stderr()
    );
    nix::sys::signal::kill(frozen, nix::sys::signal::Signal::SIGCONT).unwrap();
    assert_eq!(f1.wait(T), Some(75), "{}", f1.stderr());
    let mut f1 = Node::start(tmp.path(), &run, port, 3, 1, &fast);
    wait_for("node 1 joined a third time", T, || {
        (leader.stderr().matches("node 1 joined").count() == 3).then_some(())
    });

    let mut f2 = Node::start(tmp.path(), &run, port, 3, 2, &fast);
    assert_eq!(leader.wait(T), Some(0), "{}", leader.stderr());
    assert_eq!(f1.wait(T), Some(0), "{}", f1.stderr());
    assert_eq!(f2.wait(T), Some(0), "{}", f2.stderr());

    // The leader frozen (SIGSTOP): its followers stop on its silence, with 75.
    let port = free_port();
    let mut leader = Node::start(tmp.path(), &run, port, 3, 0, &fast);
    wait_listening(&leader);
    let mut f1 = Node::start(tmp.path(), &run, port, 3, 1, &fast);
    wait_for("node 1 joined", T, || {
        leader.stderr().contains("node 1 joined").then_some(())
    });
    let pid = nix::unistd::Pid::from_raw(leader.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let stopped = Instant::now();
    assert_eq!(f1.wait(T), Some(75), "{}", f1.stderr());
    assert!(
        stopped.elapsed() >= Duration::from_millis(3500),
        "{:?}",
        stopped.elapsed()
    );
    assert!(f1.stderr().contains("silent for 4s"), "{}", f1.stderr());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();

    // The leader killed (still waiting for node 1): its followers stop at once, the link
    // closed, with 75.
    let mut f2 = Node::start(tmp.path(), &run, port, 3, 2, &fast);
    wait_for("node 2 joined", T, || {
        leader.stderr().contains("node 2 joined").then_some(())
    });
    leader.child.kill().unwrap();
    assert_eq!(f2.wait(T), Some(75), "{}", f2.stderr());
    let line = f2.stderr();
    assert!(
        line.contains("is lost (its link closed)") && line.contains("exit 75"),
        "{line}"
    );
}

/// A run started as one of several srun tasks is a node of a job across nodes; what such a
/// job cannot do is refused in one line (exit 2) before anything is made.
#[test]
fn a_job_across_nodes_refuses_what_it_cannot_do_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let run_s = run.to_str().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &["--gpus", "cpu:2", "--run-dir", run_s],
            "CPU drafters cannot",
        ),
        (&["--gpus", "cpu:2"], "needs --run-dir DIR"),
        (
            &["--gpus", "cpu:2", "--run-dir", run_s, "--data", "-"],
            "stdin is read once",
        ),
        (
            &["--gpus", "cpu:2", "--run-dir", run_s, "--targets", "auto"],
            "--targets auto is not built for a job across nodes",
        ),
    ];
    for (args, want) in cases {
        let out: Output = Command::new(bin("dflash-supervise"))
            .args(args)
            .current_dir(tmp.path())
            .envs([
                ("SLURM_STEP_NUM_TASKS", "2"),
                ("SLURM_STEP_NUM_NODES", "2"),
                ("SLURM_PROCID", "1"),
                ("SLURM_STEP_NODELIST", "gpu[1-2]"),
                ("SLURM_JOB_ID", "4242"),
            ])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.contains("node 1 of 2") || err.contains(want),
            "{args:?}: {err}"
        );
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!run.exists(), "nothing made: {args:?}");
        assert!(!tmp.path().join("runs").exists(), "nothing made: {args:?}");
    }
}

#[test]
fn bench_cluster_commits_every_step_over_the_link_and_counts_its_cost() {
    // Its temporary directory goes under TMPDIR, and only what it made there is removed.
    let tmp = tempfile::tempdir().unwrap();
    let mine = tmp.path().join("users-file");
    std::fs::write(&mine, "kept").unwrap();
    let out = Command::new(bin("dflash-supervise"))
        .args([
            "bench",
            "cluster",
            "--followers",
            "4",
            "--steps",
            "40",
            "--ranks",
            "2",
            "--json",
        ])
        .env("TMPDIR", tmp.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"));
    assert_eq!(
        (f("followers"), f("steps"), f("ranks_per_node")),
        (4.0, 40.0, 2.0)
    );
    assert!(
        f("steps_per_s") > 0.0 && f("leader_cpu_ms_per_step") > 0.0,
        "{v}"
    );
    // Per step each follower receives a commit and a lease of 2 ids and sends a report of
    // 2 ids, the report and the commit with the step's statistics (a drafter's per-slot
    // counts, about 450 bytes each): between 4 × 300 and 4 × 2000 bytes of frames.
    let bytes = f("control_bytes_per_step");
    assert!((1200.0..8000.0).contains(&bytes), "{v}");
    assert!(
        f("sent_bytes_per_step") > 0.0 && f("received_bytes_per_step") > 0.0,
        "{v}"
    );
    assert!(
        f("commit_latency_ms_p50") > 0.0
            && f("commit_latency_ms_p99") >= f("commit_latency_ms_p50"),
        "{v}"
    );
    assert!(
        f("extrapolated_64_nodes_control_bytes_per_step") > bytes,
        "{v}"
    );
    assert!(!err.contains("refused"), "{err}");
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        left,
        ["users-file"],
        "its own directory removed, nothing else"
    );
    assert_eq!(std::fs::read_to_string(&mine).unwrap(), "kept");
}
