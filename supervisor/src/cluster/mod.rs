//! Several nodes, one job: where this supervisor stands among them ([`topology`]: Slurm's
//! environment or `--nodes/--node-rank/--leader`), the job's secret ([`secret`]) and the
//! authenticated control link between the leader and each follower ([`link`]).
//!
//! On the leader, two pure state machines hold what is global: which node trains which
//! batch ([`leases`]) and the step commit across nodes ([`steps`]). [`job`] runs them for
//! a run (the leader's side), and carries a follower's side of the link; the run's
//! dispatcher drives it (`crate::run::node`, `crate::run::dispatcher::job`).
//!
//! `dflash-supervise cluster-check` uses the link alone: every node joins the leader,
//! which lists them; `bench cluster` drives the leader's state machines over it with many
//! simulated nodes.

pub mod job;
pub mod journal;
pub mod leases;
pub mod link;
pub mod secret;
pub mod steps;
pub mod topology;

use std::collections::BTreeMap;
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use dflash_shared::exit_codes;

pub use topology::{NodeFlags, Topology};

/// How often each side of a link beats by default, and the silence after which the other
/// side counts as lost.
pub const BEAT: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Topology(#[from] topology::TopologyError),
    #[error("the job's secret: {0}")]
    Secret(#[from] secret::SecretError),
    #[error(transparent)]
    Bind(#[from] link::BindError),
    #[error(transparent)]
    Join(#[from] link::JoinError),
    #[error("the leader at {leader} is lost ({why}): this node stops (exit 75: the job is requeued and resumes)")]
    LeaderLost { leader: String, why: String },
    /// The check found a node missing or unlike the leader.
    #[error("{0}")]
    Incomplete(String),
    #[error("cannot start the control link's threads: {0}")]
    Thread(std::io::Error),
}

impl ClusterError {
    pub fn exit_code(&self) -> i32 {
        match self {
            ClusterError::Topology(_)
            | ClusterError::Bind(_)
            | ClusterError::Join(link::JoinError::Refused { .. }) => exit_codes::USAGE,
            ClusterError::Secret(secret::SecretError::Io { .. }) | ClusterError::Thread(_) => {
                exit_codes::INTERNAL
            }
            // A run directory holding something else, or a secret others can read.
            ClusterError::Secret(_) => exit_codes::USAGE,
            ClusterError::Join(link::JoinError::Timeout { .. })
            | ClusterError::LeaderLost { .. } => exit_codes::STOPPED_EARLY,
            ClusterError::Incomplete(_) => exit_codes::RUN_FAILED,
        }
    }
}

/// The followers that joined the leader: rank → what it said of itself, its link.
pub type Joined = BTreeMap<u32, (link::NodeInfo, link::Peer)>;

/// Lead the nodes of `t` (`what` names the command in the line said): write the job's
/// secret into `run_dir`, listen, and wait up to `join_timeout` for the other nodes.
/// Returns those that joined, the ranks that did not, and the link's events from then on.
pub fn meet(
    t: &Topology,
    run_dir: &std::path::Path,
    (join_timeout, node_timeout): (Duration, Duration),
    what: &str,
) -> Result<(Joined, Vec<String>, Receiver<link::Event>), ClusterError> {
    let secret = secret::Secret::create(run_dir)?;
    let listener = link::Listener::bind(&t.leader)?;
    crate::say!(
        "{what}: leader of {} nodes on {}; waiting up to {} for the other {}",
        t.nodes,
        listener.addr,
        humantime::format_duration(join_timeout),
        t.nodes - 1
    );
    let (tx, rx) = mpsc::channel();
    listener
        .serve(link::Auth::new(secret, t.nodes, node_timeout), tx)
        .map_err(ClusterError::Thread)?;
    let joined = gather(t.nodes, &rx, Instant::now() + join_timeout);
    let missing = (1..t.nodes)
        .filter(|r| !joined.contains_key(r))
        .map(|r| r.to_string())
        .collect();
    Ok((joined, missing, rx))
}

/// The followers that joined, until all `nodes - 1` have or `deadline`; beating to them
/// meanwhile. A follower lost before the end drops out (and may join again).
fn gather(nodes: u32, rx: &Receiver<link::Event>, deadline: Instant) -> Joined {
    let mut joined = Joined::new();
    let mut beat = Instant::now() + BEAT;
    while joined.len() + 1 < nodes as usize {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        let wait = deadline.min(beat).saturating_duration_since(now);
        match rx.recv_timeout(wait.max(Duration::from_millis(1))) {
            Ok(link::Event::Joined { rank, info, peer }) => {
                log::info!("node {rank} joined from {} ({})", peer.addr, info.host);
                joined.insert(rank, (info, peer));
            }
            Ok(link::Event::Lost { rank, why }) => {
                if let Some((_, p)) = joined.remove(&rank) {
                    p.close();
                }
                log::warn!("node {rank} lost: {why}");
            }
            Ok(link::Event::Message { .. }) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if Instant::now() >= beat {
            for (_, p) in joined.values() {
                let _ = p.send(&link::Msg::Beat);
            }
            beat = Instant::now() + BEAT;
        }
    }
    joined
}
