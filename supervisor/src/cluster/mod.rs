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
