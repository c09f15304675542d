//! Several nodes, one job: where this supervisor stands among them ([`topology`]: Slurm's
//! environment or `--nodes/--node-rank/--leader`), the job's secret ([`secret`]) and the
//! authenticated control link between the leader and each follower ([`link`]).
//!
//! On the leader, two pure state machines hold what is global: which node trains which
//! batch ([`leases`]) and the step commit across nodes ([`steps`]).
//!
//! `dflash-supervise cluster-check` uses the link: every node joins the leader, which
//! lists them; `bench cluster` drives the leader's state machines over it with many
//! simulated nodes. A run across nodes is not built yet: a run started as one of several
//! tasks is refused ([`refuse_multi_node_run`]), rather than every node training alone
//! into the same run directory.

pub mod job;
pub mod leases;
pub mod link;
pub mod secret;
pub mod steps;
pub mod topology;

use std::time::Duration;

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
    /// A run started as one of several tasks.
    #[error("{0}")]
    MultiNodeRun(String),
    #[error("cannot start the control link's threads: {0}")]
    Thread(std::io::Error),
}

impl ClusterError {
    pub fn exit_code(&self) -> i32 {
        match self {
            ClusterError::Topology(_)
            | ClusterError::Bind(_)
            | ClusterError::MultiNodeRun(_)
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

/// A run started as one task of several (srun with one task per node): refused in one
/// line until runs across nodes are built, so that no node trains alone into the run
/// directory the others share.
pub fn refuse_multi_node_run() -> Result<(), ClusterError> {
    let Some(t) = topology::resolve(&NodeFlags::default(), |k| std::env::var(k).ok())? else {
        return Ok(());
    };
    Err(ClusterError::MultiNodeRun(format!(
        "srun started this run as node {} of {}: this version trains on one node only (expected srun --nodes=1, or no srun); `dflash-supervise cluster-check --run-dir DIR` under the same srun checks the nodes and their link to the leader at {}",
        t.rank, t.nodes, t.leader
    )))
}
