//! A run's place in a job across nodes, once the nodes have met: the leader's side (the
//! job's epochs, commits and leases, over [`super::steps`] and [`super::leases`]) and a
//! follower's (its link to the leader).
//!
//! The dispatcher owns a [`JobNode`]. It hands it what its drafter group reports
//! ([`JobReport`]) and what the link threads received ([`Input`]); the node answers with
//! what the dispatcher itself must do ([`Local`]): form an epoch, relay an NCCL id, apply a
//! commit, take a lease, stop. On the leader, its own node's reports go through the same
//! state machines as the followers', without a socket.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use super::journal::Journal;
use super::leases::{Leases, Node};
use super::link::{self, Event, FromLeader, Msg, NodeInfo, Peer};
use super::secret::{hex, unhex};
use super::steps::{Commit, Epoch, Report, Steps};
use super::{ClusterError, Topology, BEAT};
use crate::training::group::{JobCommit, JobReport};

/// The leader's own node.
const ME: Node = 0;

/// What the node's dispatcher must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Local {
    Epoch {
        epoch: u64,
        ranks: Vec<u32>,
    },
    GroupId {
        epoch: u64,
        id: Vec<u8>,
    },
    Commit(JobCommit),
    /// Batches lent to this node.
    Lease(Vec<u64>),
    /// No batch is left for this node.
    NoMore,
    /// The job is over (`ok`: as planned).
    Done {
        ok: bool,
    },
    /// A follower's leader is lost: stop, exit 75.
    LeaderLost(String),
    /// A node joins the running job: checkpoint the next step for it.
    CheckpointForJoin,
    /// The leader: another node's metrics window.
    NodeWindow {
        node: Node,
        window: serde_json::Value,
    },
}

/// What the link's threads received.
#[derive(Debug)]
pub enum Input {
    Leader(Event),
    Follower(FromLeader),
}

/// How the job starts on every node: at `step`, from the leader's `checkpoint` (resumed).
#[derive(Debug, Clone, PartialEq)]
pub struct JobStart {
    pub step: u64,
    pub checkpoint: Option<String>,
}

pub enum JobNode {
    Leader(Box<LeaderNode>),
    Follower(FollowerNode),
}

/// A message for this node, as its dispatcher takes it.
fn local(msg: Msg) -> Option<Local> {
    Some(match msg {
        Msg::Epoch { epoch, ranks, .. } => Local::Epoch { epoch, ranks },
        Msg::GroupId { epoch, id } => Local::GroupId {
            epoch,
            id: unhex(&id)?,
        },
        Msg::Commit {
            step,
            stats,
            contributors,
        } => Local::Commit(JobCommit {
            step,
            stats,
            contributors,
        }),
        Msg::Lease { batches } => Local::Lease(batches),
        Msg::NoMore => Local::NoMore,
        Msg::Done { ok } => Local::Done { ok },
        _ => return None,
    })
}

/// A report of the node's group, as it travels.
fn message(r: JobReport) -> Msg {
    match r {
        JobReport::Ranks(ranks) => Msg::Ranks { ranks },
        JobReport::GroupId { epoch, id } => Msg::GroupId {
            epoch,
            id: hex(&id),
        },
        JobReport::Reduced {
            epoch,
            step,
            batches,
            stats,
        } => Msg::Reduced {
            epoch,
            step,
            batches,
            weight: stats.weight_sum,
            stats,
        },
    }
}

impl JobNode {
    /// What the node's group reports.
    pub fn report(&mut self, r: JobReport) -> Vec<Local> {
        self.send(message(r))
    }

    /// This node's loader read all the data: it has `batches` batches.
    pub fn data_end(&mut self, batches: u64) -> Vec<Local> {
        self.send(Msg::DataEnd { batches })
    }

    fn send(&mut self, msg: Msg) -> Vec<Local> {
        match self {
            JobNode::Leader(l) => {
                let mut out = Vec::new();
                l.on_message(ME, msg, &mut out);
                out
            }
            JobNode::Follower(f) => {
                if let Err(e) = f.writer.send(&msg) {
                    // The link's reader finds the leader lost and says so.
                    log::warn!("cluster: cannot send to the leader at {}: {e}", f.leader);
                }
                Vec::new()
            }
        }
    }

    /// What the link's threads received.
    pub fn on_input(&mut self, i: Input) -> Vec<Local> {
        let mut out = Vec::new();
        match (self, i) {
            (JobNode::Leader(l), Input::Leader(ev)) => l.on_link(ev, &mut out),
            (JobNode::Follower(f), Input::Follower(FromLeader::Msg(m))) => {
                if matches!(m, Msg::Done { .. }) {
                    f.done = true;
                }
                out.extend(local(m));
            }
            (JobNode::Follower(f), Input::Follower(FromLeader::Lost(why))) if !f.done => {
                out.push(Local::LeaderLost(format!(
                    "the leader at {} is lost ({why})",
                    f.leader
                )));
            }
            _ => {}
        }
        out
    }

    /// The leader beats to its followers (their own threads beat to it), and gives up on
    /// a node that did not join in time.
    pub fn tick(&mut self, now: Instant) -> Vec<Local> {
        let mut out = Vec::new();
        if let JobNode::Leader(l) = self {
            if now >= l.next_beat {
                l.next_beat = now + BEAT;
                for p in l.peers.values() {
                    let _ = p.send(&Msg::Beat);
                }
            }
            if l.joining.as_ref().is_some_and(|j| now >= j.deadline) {
                l.join_failed("it did not start within --join-timeout", &mut out);
            }
        }
        out
    }

    /// A follower sends its metrics window to the leader (one that does not fit a frame
    /// is said once and kept to its own metrics.jsonl).
    pub fn metrics(&mut self, window: &crate::telemetry::window::Window) {
        let JobNode::Follower(f) = self else {
            return;
        };
        let Ok(window) = serde_json::to_value(window) else {
            return;
        };
        let msg = Msg::Metrics { window };
        let fits = serde_json::to_vec(&msg).is_ok_and(|b| b.len() < link::MAX_FRAME as usize);
        if !fits {
            if !f.too_large_said {
                f.too_large_said = true;
                log::warn!("cluster: this node's metrics window is over a frame ({} KiB): it stays in this node's metrics.jsonl", link::MAX_FRAME / 1024);
            }
            return;
        }
        if let Err(e) = f.writer.send(&msg) {
            log::warn!("cluster: cannot send to the leader at {}: {e}", f.leader);
        }
    }

    /// The leader's checkpoint of `step` is complete, in `dir`.
    pub fn checkpointed(&mut self, step: u64, dir: &str) -> Vec<Local> {
        let mut out = Vec::new();
        if let JobNode::Leader(l) = self {
            l.checkpointed(step, dir, &mut out);
        }
        out
    }

    /// The leader's first grants (nothing on a follower).
    pub fn begin(&mut self) -> Vec<Local> {
        let mut out = Vec::new();
        if let JobNode::Leader(l) = self {
            l.settle(&mut out);
        }
        out
    }

    /// The leader: every batch the job consumed so far (`None` on a follower).
    pub fn consumed(&self) -> Option<Vec<u64>> {
        match self {
            JobNode::Leader(l) => Some(l.leases.consumed_ids()),
            JobNode::Follower(_) => None,
        }
    }

    /// The job reached its `--steps` (every node commits the last step alike): on the
    /// leader, the nodes that end from now on are not lost.
    pub fn steps_done(&mut self) {
        if let JobNode::Leader(l) = self {
            l.done = true;
        }
    }

    pub fn is_leader(&self) -> bool {
        matches!(self, JobNode::Leader(_))
    }

    /// The job is over for this node (told by the leader, or, on it, decided).
    pub fn done(&self) -> bool {
        match self {
            JobNode::Leader(l) => l.done,
            JobNode::Follower(f) => f.done,
        }
    }
}

/// The leader's state: the job's steps and leases, and a link per live follower.
pub struct LeaderNode {
    steps: Steps,
    leases: Leases,
    peers: BTreeMap<Node, Peer>,
    /// Nodes told that no batch is left for them.
    no_more: BTreeSet<Node>,
    done: bool,
    next_beat: Instant,
    /// A node joining the running job, and how long it may take.
    joining: Option<Joining>,
    join_timeout: Duration,
    /// The job's ledger (`job.jsonl`), and the data's length once known.
    journal: Journal,
    data_end: Option<u64>,
}

/// A node joins a running job: the job commits up to step `after`, whose checkpoint the
/// node starts from, and waits there until the node's ranks are in.
struct Joining {
    node: Node,
    /// Until its start is sent (then it is among the peers).
    peer: Option<Peer>,
    after: u64,
    deadline: Instant,
}

impl LeaderNode {
    fn live(&self) -> Vec<Node> {
        std::iter::once(ME)
            .chain(self.peers.keys().copied())
            .collect()
    }

    fn send(&self, node: Node, msg: Msg, out: &mut Vec<Local>) {
        if node == ME {
            out.extend(local(msg));
        } else if let Some(p) = self.peers.get(&node) {
            if let Err(e) = p.send(&msg) {
                // Its reader reports it lost.
                log::warn!("cluster: cannot send to node {node}: {e}");
            }
        }
    }

    fn broadcast(&self, msg: &Msg, except: Option<Node>, out: &mut Vec<Local>) {
        for n in self.live() {
            if Some(n) != except {
                self.send(n, msg.clone(), out);
            }
        }
    }

    fn on_message(&mut self, node: Node, msg: Msg, out: &mut Vec<Local>) {
        match msg {
            Msg::Ranks { ranks } => match self.steps.ranks(node, &ranks) {
                Ok(Some(e)) => {
                    self.epoch(e, out);
                    if !ranks.is_empty() && self.joining.as_ref().is_some_and(|j| j.node == node) {
                        log::info!("cluster: node {node} joined the job with ranks {ranks:?}");
                        self.joining = None;
                        self.release(out);
                    }
                }
                // The same ranks: an all-reduce hung somewhere; form the group again.
                Ok(None) => {
                    let e = self.steps.renew();
                    self.epoch(e, out);
                }
                Err(e) => log::error!("cluster: {e}"),
            },
            Msg::GroupId { epoch, id } => {
                self.broadcast(&Msg::GroupId { epoch, id }, Some(node), out)
            }
            Msg::Reduced {
                epoch,
                step,
                batches,
                weight,
                stats,
            } => {
                let report = Report {
                    batches,
                    weight,
                    stats,
                };
                match self.steps.reported(node, epoch, step, report) {
                    Ok(Some(c)) => self.commit(c, out),
                    Ok(None) => {}
                    Err(e) => log::warn!("cluster: {e}"),
                }
            }
            Msg::DataEnd { batches } => {
                if self.data_end.is_none() {
                    self.data_end = Some(batches);
                    self.journal.end_of_data(batches);
                }
                self.leases.set_end(batches);
                self.settle(out);
            }
            Msg::Metrics { window } => out.push(Local::NodeWindow { node, window }),
            other => log::warn!(
                "cluster: node {node} sent {}, which only the leader sends",
                link::kind(&other)
            ),
        }
    }

    fn epoch(&self, e: Epoch, out: &mut Vec<Local>) {
        let msg = Msg::Epoch {
            epoch: e.epoch,
            members: e.members,
            ranks: e.ranks,
            step: self.steps.next_step(),
        };
        self.broadcast(&msg, None, out);
    }

    fn commit(&mut self, c: Commit, out: &mut Vec<Local>) {
        let contributors = c.batches.values().map(Vec::len).sum();
        self.journal.commit(c.step, &c.batches);
        for (n, b) in &c.batches {
            if let Err(e) = self.leases.consumed(*n, b) {
                log::error!("cluster: step {}: {e}", c.step);
            }
        }
        let msg = Msg::Commit {
            step: c.step,
            stats: c.stats,
            contributors,
        };
        self.broadcast(&msg, None, out);
        if self.joining.as_ref().is_some_and(|j| j.after == c.step) {
            // The joiner starts from this step's checkpoint: the job waits here for it.
            self.steps.hold();
        }
        self.settle(out);
    }

    /// Steps commit again (the joiner is in, or gone).
    fn release(&mut self, out: &mut Vec<Local>) {
        if let Some(c) = self.steps.release() {
            self.commit(c, out);
        }
    }

    fn checkpointed(&mut self, step: u64, dir: &str, out: &mut Vec<Local>) {
        let Some(j) = self.joining.as_mut().filter(|j| j.after == step) else {
            return;
        };
        let Some(peer) = j.peer.take() else {
            return;
        };
        let node = j.node;
        let start = Msg::Start {
            step,
            checkpoint: Some(dir.to_string()),
        };
        if let Err(e) = peer.send(&start) {
            log::warn!("cluster: cannot send node {node} its start: {e}");
        }
        log::info!("cluster: node {node} starts from the checkpoint of step {step}");
        self.peers.insert(node, peer);
        self.no_more.remove(&node);
        self.leases.join(node);
        self.settle(out);
    }

    /// The joining node is given up (`why`): the job goes on without it.
    fn join_failed(&mut self, why: &str, out: &mut Vec<Local>) {
        let Some(j) = self.joining.take() else {
            return;
        };
        log::warn!(
            "cluster: node {} did not join the running job ({why}): the job goes on without it",
            j.node
        );
        match j.peer {
            Some(p) => p.close(),
            None => self.on_link(
                Event::Lost {
                    rank: j.node,
                    why: why.into(),
                },
                out,
            ),
        }
        self.release(out);
    }

    /// Fill every live node's window; tell those with nothing left; end the job once
    /// every batch is consumed.
    fn settle(&mut self, out: &mut Vec<Local>) {
        let open: Vec<Node> = self
            .live()
            .into_iter()
            .filter(|n| !self.no_more.contains(n))
            .collect();
        // One id at a time to each node in turn: their ids interleave.
        let mut lent: BTreeMap<Node, Vec<u64>> = BTreeMap::new();
        loop {
            let mut any = false;
            for &n in &open {
                if let Ok(Some(id)) = self.leases.grant_one(n) {
                    lent.entry(n).or_default().push(id);
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        for n in open {
            match lent.remove(&n) {
                Some(ids) => self.send(n, Msg::Lease { batches: ids }, out),
                None if self.leases.outstanding(n) == 0 && self.leases.exhausted() => {
                    self.no_more.insert(n);
                    self.send(n, Msg::NoMore, out);
                }
                None => {}
            }
        }
        if self.done {
            return;
        }
        if self.leases.done() {
            self.done = true;
            self.journal.done();
            log::info!(
                "cluster: all {} batches of the job consumed",
                self.leases.consumed_count()
            );
            self.broadcast(&Msg::Done { ok: true }, None, out);
        } else if !self.leases.exhausted() && self.live().iter().all(|n| self.no_more.contains(n)) {
            // Batches given back after every node had finished its share.
            self.done = true;
            log::error!("cluster: batches a lost node held are left, and every node has finished its share: the job stops; --resume trains them");
            self.broadcast(&Msg::Done { ok: false }, None, out);
        }
    }

    fn on_link(&mut self, ev: Event, out: &mut Vec<Local>) {
        match ev {
            Event::Joined { rank, info, peer } => {
                if self.done || self.joining.is_some() || self.peers.contains_key(&rank) {
                    log::warn!("cluster: node {rank} ({}) cannot join now (the job is over, or another node is joining): it is told to stop", info.host);
                    let _ = peer.send(&Msg::Done { ok: false });
                    peer.close();
                    return;
                }
                let after = self.steps.next_step();
                log::warn!("cluster: node {rank} ({}) joins the running job: it starts from the checkpoint of step {after}, and the job waits at that step until its drafters are in", info.host);
                self.joining = Some(Joining {
                    node: rank,
                    peer: Some(peer),
                    after,
                    deadline: Instant::now() + self.join_timeout,
                });
                out.push(Local::CheckpointForJoin);
            }
            Event::Message { rank, msg } => self.on_message(rank, msg, out),
            Event::Lost { rank, why } => {
                if self.joining.as_ref().is_some_and(|j| j.node == rank) {
                    let had_start = self.joining.as_ref().is_some_and(|j| j.peer.is_none());
                    self.joining = None;
                    if !had_start {
                        log::warn!("cluster: node {rank}, joining, is lost ({why})");
                        self.release(out);
                        return;
                    }
                    // Started: it is a peer; lost as any other, and the job goes on.
                    self.release(out);
                }
                let Some(p) = self.peers.remove(&rank) else {
                    return;
                };
                p.close();
                if self.done {
                    // The job is over: its nodes end.
                    log::info!("cluster: node {rank} left ({why})");
                    return;
                }
                self.no_more.remove(&rank);
                let back = self.leases.lost(rank);
                self.journal.lost(rank, &back);
                log::warn!(
                    "cluster: node {rank} lost ({why}): the job goes on without it; its {} outstanding batch(es) go to the other nodes",
                    back.len()
                );
                if let Some(e) = self.steps.lost(rank) {
                    self.epoch(e, out);
                }
                self.settle(out);
            }
        }
    }
}

/// A follower's state: its link to the leader.
pub struct FollowerNode {
    writer: link::Writer,
    leader: String,
    done: bool,
    /// A metrics window over a frame was said.
    too_large_said: bool,
}

/// Lead the job: write its secret into `run_dir`, listen, and wait until every other node
/// joined (`join_timeout`), then tell them how the job starts. `leases`: the job's, with
/// a resumed job's consumed batches. Returns the leader's node and the link's events (for
/// the dispatcher).
pub fn lead(
    t: &Topology,
    run_dir: &Path,
    timeouts: (Duration, Duration),
    start: &JobStart,
    mut leases: Leases,
) -> Result<(JobNode, Receiver<Event>), ClusterError> {
    let (joined, missing, rx) = super::meet(t, run_dir, timeouts, "cluster")?;
    if !missing.is_empty() {
        for (_, p) in joined.values() {
            let _ = p.send(&Msg::Done { ok: false });
        }
        return Err(ClusterError::Incomplete(format!(
            "node(s) {} did not join the leader within {} (each runs the same command under srun, or with its --node-rank)",
            missing.join(", "),
            humantime::format_duration(timeouts.0)
        )));
    }
    leases.join(ME);
    let mut peers = BTreeMap::new();
    for (rank, (_, peer)) in joined {
        let _ = peer.send(&Msg::Start {
            step: start.step,
            checkpoint: start.checkpoint.clone(),
        });
        leases.join(rank);
        peers.insert(rank, peer);
    }
    crate::say!("cluster: all {} nodes joined; the job starts", t.nodes);
    let mut journal = Journal::open(run_dir);
    journal.start(start.step);
    let node = LeaderNode {
        steps: Steps::new(start.step + 1, ME, &[]),
        leases,
        peers,
        no_more: BTreeSet::new(),
        done: false,
        next_beat: Instant::now(),
        joining: None,
        join_timeout: timeouts.0,
        journal,
        data_end: None,
    };
    Ok((JobNode::Leader(Box::new(node)), rx))
}

/// Join the job's leader (until `join_timeout`) and wait for its start. Returns the
/// follower's node, the link's messages (for the dispatcher) and how the job starts.
pub fn follow(
    t: &Topology,
    run_dir: &Path,
    info: &NodeInfo,
    timeouts: (Duration, Duration),
) -> Result<(JobNode, Receiver<FromLeader>, JobStart), ClusterError> {
    let (join_timeout, node_timeout) = timeouts;
    let deadline = Instant::now() + join_timeout;
    let session = link::join(&t.leader, run_dir, t.rank, info, deadline)?;
    crate::say!("cluster: node {} joined the leader at {}", t.rank, t.leader);
    let (tx, rx) = mpsc::channel();
    let writer = session
        .serve(BEAT, node_timeout, tx)
        .map_err(ClusterError::Thread)?;
    let lost = |why: String| ClusterError::LeaderLost {
        leader: t.leader.to_string(),
        why,
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left.max(node_timeout)) {
            Ok(FromLeader::Msg(Msg::Start { step, checkpoint })) => {
                let node = FollowerNode {
                    writer,
                    leader: t.leader.to_string(),
                    done: false,
                    too_large_said: false,
                };
                return Ok((JobNode::Follower(node), rx, JobStart { step, checkpoint }));
            }
            Ok(FromLeader::Msg(Msg::Done { .. })) => {
                return Err(lost(
                    "it ended the job before it started (its log says why)".into(),
                ))
            }
            Ok(FromLeader::Msg(_)) => {}
            Ok(FromLeader::Lost(why)) => return Err(lost(why)),
            Err(_) => return Err(lost("it did not start the job".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::drafter::StepStats;

    fn leader(nodes: u32) -> LeaderNode {
        let mut leases = Leases::new(0, 2);
        for n in 0..nodes {
            leases.join(n);
        }
        LeaderNode {
            steps: Steps::new(1, ME, &[]),
            leases,
            peers: BTreeMap::new(),
            no_more: BTreeSet::new(),
            done: false,
            next_beat: Instant::now(),
            joining: None,
            join_timeout: Duration::from_secs(60),
            journal: Journal::none(),
            data_end: None,
        }
    }

    fn stats(w: f64) -> StepStats {
        StepStats {
            loss_sum: 2.0 * w,
            weight_sum: w,
            ..Default::default()
        }
    }

    /// The leader alone (its own node through the same machines): epochs, commits with
    /// its statistics, leases refilled, the end of the data, and the job's end.
    #[test]
    fn the_leaders_own_node_goes_through_the_jobs_epochs_commits_and_leases() {
        let mut node = JobNode::Leader(Box::new(leader(1)));
        assert_eq!(node.begin(), vec![Local::Lease(vec![0, 1])]);
        let out = node.report(JobReport::Ranks(vec![0, 1]));
        assert_eq!(
            out,
            vec![Local::Epoch {
                epoch: 2,
                ranks: vec![0, 1]
            }]
        );
        // A report of an older epoch is void.
        let stale = JobReport::Reduced {
            epoch: 1,
            step: 1,
            batches: vec![0, 1],
            stats: stats(3.0),
        };
        assert!(node.report(stale).is_empty());
        let out = node.report(JobReport::Reduced {
            epoch: 2,
            step: 1,
            batches: vec![0, 1],
            stats: stats(3.0),
        });
        assert_eq!(
            out,
            vec![
                Local::Commit(JobCommit {
                    step: 1,
                    stats: stats(3.0),
                    contributors: 2
                }),
                Local::Lease(vec![2, 3])
            ]
        );
        // The data has 3 batches: id 3 is withdrawn; once 2 is consumed, nothing is left.
        assert!(node.data_end(3).is_empty());
        let out = node.report(JobReport::Reduced {
            epoch: 2,
            step: 2,
            batches: vec![2],
            stats: stats(1.0),
        });
        assert_eq!(out.len(), 3, "{out:?}");
        assert_eq!(out[1], Local::NoMore);
        assert_eq!(out[2], Local::Done { ok: true });
        assert!(node.done());
        // The id of the first rank goes to the other nodes only: none here.
        assert!(node
            .report(JobReport::GroupId {
                epoch: 2,
                id: vec![1, 2]
            })
            .is_empty());
    }

    #[test]
    fn messages_travel_between_nodes_as_the_dispatcher_takes_them() {
        assert_eq!(
            local(Msg::GroupId {
                epoch: 3,
                id: hex(&[7, 8])
            }),
            Some(Local::GroupId {
                epoch: 3,
                id: vec![7, 8]
            })
        );
        assert_eq!(
            local(Msg::GroupId {
                epoch: 3,
                id: "zz".into()
            }),
            None
        );
        assert_eq!(local(Msg::Beat), None);
        let r = message(JobReport::Reduced {
            epoch: 1,
            step: 2,
            batches: vec![5],
            stats: stats(4.0),
        });
        assert!(matches!(r, Msg::Reduced { weight, .. } if weight == 4.0));
    }
}
