//! `dflash-supervise bench cluster`: what the leader of a job across nodes costs per step.
//!
//! The leader runs here, on 127.0.0.2, with its real control link, lease table and step
//! commit (`crate::cluster`); `--followers` follower processes (this binary's hidden
//! `__cluster-peer`) join it over loopback with the job's secret and step as fast as they
//! can: each holds `--ranks` simulated drafter ranks (no model, no worker process), and
//! for every step reports the `--ranks` batches its ranks consumed, lent by the leader.
//! The leader itself is a node too. Measured over `--steps` steps once every node has
//! joined: steps/s, the leader's CPU per step, control bytes per step both ways, and the
//! commit latency (the first report of a step to its commit going out); then scaled to 64
//! nodes of as many ranks (8 by default: 64 nodes of 8 GPUs), at the costs per node
//! measured here.

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::cluster::leases::{Leases, Node};
use crate::cluster::link::{self, Auth, Event, FromLeader, Listener, Msg, Peer};
use crate::cluster::secret::Secret;
use crate::cluster::steps::{Commit, Report, Steps};
use crate::cluster::topology::Leader;
use crate::error::Error;

fn fail(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Bench {
        bench: "cluster",
        what: what.to_string(),
        source: e.to_string().into(),
    }
}

/// CPU seconds (user + system) this process has used.
fn own_cpu() -> f64 {
    // SAFETY: rusage is plain integers, for which all zeroes is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes the struct it is given, which lives through the call.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |x: libc::timeval| x.tv_sec as f64 + x.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// The follower processes, killed if the bench ends early.
struct Peers(Vec<Child>);

impl Drop for Peers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn run(json: bool, followers: u32, steps: u64, ranks: u32) -> Result<i32, Error> {
    let tmp = own_temp_dir()?;
    let secret = Secret::create(&tmp).map_err(|e| fail("writing the secret", e))?;
    let port = std::net::TcpListener::bind("127.0.0.2:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| fail("finding a free port on 127.0.0.2", e))?
        .port();
    let leader = Leader {
        host: "127.0.0.2".into(),
        port,
    };
    let listener = Listener::bind(&leader).map_err(|e| fail("listening", e))?;
    let nodes = followers + 1;
    let (tx, rx) = mpsc::channel();
    listener
        .serve(Auth::new(secret, nodes, Duration::from_secs(30)), tx)
        .map_err(|e| fail("starting the link", e))?;
    let exe = std::env::current_exe().map_err(|e| fail("finding dflash-supervise", e))?;
    let mut peers = Peers(Vec::new());
    for r in 1..nodes {
        let child = Command::new(&exe)
            .args(["__cluster-peer", "--leader", &leader.to_string()])
            .args(["--node-rank", &r.to_string()])
            .args(["--ranks", &ranks.to_string(), "--run-dir"])
            .arg(&tmp)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| fail("starting a follower", e))?;
        peers.0.push(child);
    }
    let m = lead(&rx, nodes, steps, ranks)?;
    for c in &mut peers.0 {
        let _ = c.wait();
    }
    let _ = std::fs::remove_file(tmp.join(crate::cluster::secret::FILE));
    let _ = std::fs::remove_dir(&tmp);
    report(json, followers, ranks, &m);
    Ok(0)
}

fn own_temp_dir() -> Result<std::path::PathBuf, Error> {
    let d = std::env::temp_dir().join(format!("dflash-bench-cluster-{}", std::process::id()));
    std::fs::create_dir(&d).map_err(|e| fail("creating its temporary directory", e))?;
    Ok(d)
}

struct Measured {
    steps: u64,
    seconds: f64,
    cpu: f64,
    sent: u64,
    received: u64,
    latency_ms: Vec<f64>,
}

/// The leader's loop: wait for every node, then commit `warmup + steps` steps.
fn lead(rx: &mpsc::Receiver<Event>, nodes: u32, steps: u64, ranks: u32) -> Result<Measured, Error> {
    let mut peers: BTreeMap<Node, Peer> = BTreeMap::new();
    let joined_by = Instant::now() + Duration::from_secs(120);
    while peers.len() + 1 < nodes as usize {
        let left = joined_by.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Event::Joined { rank, peer, .. }) => {
                peers.insert(rank, peer);
            }
            Ok(Event::Lost { rank, why }) => return Err(fail(&format!("node {rank}"), why)),
            Ok(Event::Message { .. }) => {}
            Err(e) => return Err(fail("waiting for the followers to join", e)),
        }
    }
    let mut st = LeaderState {
        steps: Steps::new(0, 0, &node_ranks(0, ranks)),
        leases: Leases::new(0, 2 * ranks as usize),
        own: VecDeque::new(),
        ranks,
        first_report: None,
    };
    for &n in peers.keys() {
        st.leases.join(n);
        st.steps
            .ranks(n, &node_ranks(n, ranks))
            .map_err(|e| fail("a node's ranks", e))?;
    }
    st.leases.join(0);
    st.start(&peers)?;
    let warmup = 5.min(steps);
    let mut m = Measured {
        steps,
        seconds: 0.0,
        cpu: 0.0,
        sent: 0,
        received: 0,
        latency_ms: Vec::new(),
    };
    let mut t0 = None;
    while st.steps.next_step() < warmup + steps {
        if t0.is_none() && st.steps.next_step() >= warmup {
            t0 = Some((
                Instant::now(),
                own_cpu(),
                link::SENT.load(Ordering::Relaxed),
                link::RECEIVED.load(Ordering::Relaxed),
            ));
        }
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Event::Message {
                rank,
                msg:
                    Msg::Reduced {
                        epoch,
                        step,
                        batches,
                        weight,
                        stats,
                    },
            }) => {
                let r = Report {
                    batches,
                    weight,
                    stats,
                };
                if let Some(c) = st.on_report(rank, epoch, step, r)? {
                    let started = st.first_report.take();
                    st.commit(&c, &peers)?;
                    if step >= warmup {
                        if let Some(t) = started {
                            m.latency_ms.push(t.elapsed().as_secs_f64() * 1e3);
                        }
                    }
                }
            }
            Ok(Event::Lost { rank, why }) => return Err(fail(&format!("node {rank} lost"), why)),
            Ok(_) => {}
            Err(e) => return Err(fail("waiting for reports", e)),
        }
    }
    if let Some((t, cpu, sent, received)) = t0 {
        m.seconds = t.elapsed().as_secs_f64();
        m.cpu = own_cpu() - cpu;
        m.sent = link::SENT.load(Ordering::Relaxed) - sent;
        m.received = link::RECEIVED.load(Ordering::Relaxed) - received;
    }
    for p in peers.values() {
        let _ = p.send(&Msg::Done { ok: true });
    }
    Ok(m)
}

/// Node `n`'s simulated ranks, job-wide: `ranks` of them from `n * ranks`.
fn node_ranks(n: Node, ranks: u32) -> Vec<u32> {
    (n * ranks..(n + 1) * ranks).collect()
}

/// The leader's state: its state machines, and node 0's own simulated ranks.
struct LeaderState {
    steps: Steps,
    leases: Leases,
    own: VecDeque<u64>,
    ranks: u32,
    first_report: Option<Instant>,
}

impl LeaderState {
    fn grant(&mut self, n: Node, peers: &BTreeMap<Node, Peer>) -> Result<(), Error> {
        let batches = self.leases.grant(n).map_err(|e| fail("lending", e))?;
        match n {
            0 => self.own.extend(batches),
            _ => {
                let p = &peers[&n];
                p.send(&Msg::Lease { batches })
                    .map_err(|e| fail("sending a lease", e))?;
            }
        }
        Ok(())
    }

    /// The epoch and the first leases to every node, and node 0's first report.
    fn start(&mut self, peers: &BTreeMap<Node, Peer>) -> Result<(), Error> {
        let e = self.steps.epoch();
        for (&n, p) in peers {
            p.send(&Msg::Epoch {
                epoch: e.epoch,
                members: e.members.clone(),
                ranks: e.ranks.clone(),
                step: self.steps.next_step(),
            })
            .map_err(|e| fail("sending the epoch", e))?;
            self.grant(n, peers)?;
        }
        self.grant(0, peers)?;
        self.own_report(peers).map(|_| ())
    }

    fn on_report(
        &mut self,
        n: Node,
        epoch: u64,
        step: u64,
        r: Report,
    ) -> Result<Option<Commit>, Error> {
        self.first_report.get_or_insert_with(Instant::now);
        self.steps
            .reported(n, epoch, step, r)
            .map_err(|e| fail("a report", e))
    }

    /// Node 0's ranks report the step in flight (the leader's own drafters).
    fn own_report(&mut self, peers: &BTreeMap<Node, Peer>) -> Result<Option<Commit>, Error> {
        let k = (self.ranks as usize).min(self.own.len());
        let batches: Vec<u64> = self.own.drain(..k).collect();
        let (epoch, step) = (self.steps.epoch().epoch, self.steps.next_step());
        let c = self.on_report(
            0,
            epoch,
            step,
            Report {
                weight: batches.len() as f64,
                stats: simulated_stats(batches.len()),
                batches,
            },
        )?;
        if let Some(c) = &c {
            self.commit(c, peers)?;
        }
        Ok(c)
    }

    fn commit(&mut self, c: &Commit, peers: &BTreeMap<Node, Peer>) -> Result<(), Error> {
        for (&n, b) in &c.batches {
            self.leases
                .consumed(n, b)
                .map_err(|e| fail("a commit", e))?;
        }
        for p in peers.values() {
            p.send(&Msg::Commit {
                step: c.step,
                stats: c.stats.clone(),
                contributors: c.batches.values().map(Vec::len).sum(),
            })
            .map_err(|e| fail("sending a commit", e))?;
        }
        for n in std::iter::once(0)
            .chain(peers.keys().copied())
            .collect::<Vec<_>>()
        {
            self.grant(n, peers)?;
        }
        self.first_report = None;
        self.own_report(peers).map(|_| ())
    }
}

/// What `batches` batches of a drafter with 16-token blocks report (the size of a real
/// report: per-slot counts).
fn simulated_stats(batches: usize) -> dflash_shared::drafter::StepStats {
    let n = batches as u64;
    dflash_shared::drafter::StepStats {
        loss_sum: 1.5 * n as f64,
        weight_sum: n as f64,
        slot_correct: (0..16).map(|k| 1000 * n / (k + 1)).collect(),
        slot_total: vec![1000 * n; 16],
        accept_sum: 3.0 * n as f64,
        blocks: 64 * n,
        tokens: 4096 * n,
        anchors: 64 * n,
        ..Default::default()
    }
}

fn report(json: bool, followers: u32, ranks: u32, m: &Measured) {
    let mut lat = m.latency_ms.clone();
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let nodes = f64::from(followers + 1);
    let per_step = |x: f64| x / m.steps.max(1) as f64;
    let cpu_ms = per_step(m.cpu) * 1e3;
    let bytes = per_step((m.sent + m.received) as f64);
    // Scaled to 64 nodes of as many ranks: the leader's CPU per node report (its own
    // node's included), the bytes per follower.
    let at64_cpu = cpu_ms / nodes * 64.0;
    let at64_bytes = bytes / f64::from(followers.max(1)) * 63.0;
    let v = serde_json::json!({
        "followers": followers,
        "ranks_per_node": ranks,
        "steps": m.steps,
        "steps_per_s": m.steps as f64 / m.seconds.max(1e-9),
        "leader_cpu_ms_per_step": cpu_ms,
        "control_bytes_per_step": bytes,
        "sent_bytes_per_step": per_step(m.sent as f64),
        "received_bytes_per_step": per_step(m.received as f64),
        "commit_latency_ms_p50": pct(0.5),
        "commit_latency_ms_p99": pct(0.99),
        "extrapolated_64_nodes_leader_cpu_ms_per_step": at64_cpu,
        "extrapolated_64_nodes_control_bytes_per_step": at64_bytes,
    });
    if json {
        println!("{v}");
        return;
    }
    println!(
        "bench cluster: a leader and {followers} followers on loopback, {ranks} simulated rank(s) each, {} steps",
        m.steps
    );
    println!(
        "  steps/s                       {:>10.1}",
        v["steps_per_s"].as_f64().unwrap_or(0.0)
    );
    println!("  leader CPU per step           {cpu_ms:>10.3} ms");
    println!(
        "  control bytes per step        {bytes:>10.0} (sent {:.0}, received {:.0})",
        per_step(m.sent as f64),
        per_step(m.received as f64)
    );
    println!(
        "  commit latency p50 / p99      {:>10.3} / {:.3} ms",
        pct(0.5),
        pct(0.99)
    );
    println!("  at 64 nodes of {ranks} (scaled)   {at64_cpu:>10.3} ms leader CPU, {at64_bytes:.0} bytes per step");
}

/// The hidden `__cluster-peer`: one follower of `bench cluster`.
pub fn peer(leader: &str, run_dir: &Path, rank: u32, ranks: u32) -> Result<i32, Error> {
    let leader = crate::cluster::topology::parse_leader(leader).map_err(|e| fail("--leader", e))?;
    let info = crate::commands::cluster_check::node_info(false);
    let session = link::join(
        &leader,
        run_dir,
        rank,
        &info,
        Instant::now() + Duration::from_secs(60),
    )
    .map_err(|e| fail("joining", e))?;
    let (tx, rx) = mpsc::channel();
    let writer = session
        .serve(crate::cluster::BEAT, Duration::from_secs(30), tx)
        .map_err(|e| fail("the link", e))?;
    let mut pool: VecDeque<u64> = VecDeque::new();
    let (mut epoch, mut step) = (0u64, 0u64);
    // The step this node has reported and not seen committed yet.
    let mut pending: Option<(u64, Vec<u64>)> = None;
    loop {
        let msg = match rx.recv() {
            Ok(FromLeader::Msg(m)) => m,
            Ok(FromLeader::Lost(why)) => return Err(fail("the leader", why)),
            Err(e) => return Err(fail("the link", e)),
        };
        match msg {
            Msg::Epoch {
                epoch: e, step: s, ..
            } => {
                (epoch, step) = (e, s);
                if let Some((_, b)) = pending.take() {
                    pool.extend(b); // reported in an older epoch: report again
                }
            }
            Msg::Lease { batches } => pool.extend(batches),
            Msg::Commit { step: s, .. } => {
                if pending.as_ref().is_some_and(|(p, _)| *p == s) {
                    pending = None;
                }
                step = s + 1;
            }
            Msg::Done { .. } => return Ok(0),
            _ => {}
        }
        if pending.is_none() && pool.len() >= ranks as usize && epoch > 0 {
            let batches: Vec<u64> = pool.drain(..ranks as usize).collect();
            let m = Msg::Reduced {
                epoch,
                step,
                batches: batches.clone(),
                weight: batches.len() as f64,
                stats: simulated_stats(batches.len()),
            };
            writer.send(&m).map_err(|e| fail("reporting", e))?;
            pending = Some((step, batches));
        }
    }
}
