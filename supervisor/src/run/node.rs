//! A run as one node of a job across nodes (`crate::cluster`): where it stands, what such
//! a run refuses, the meeting of the nodes at the start, and the node's share of the data.
//!
//! Every node runs the same command. The leader (node 0) runs in `--run-dir D` itself:
//! the job's run directory, with its ledger, checkpoints, export and report. A follower
//! runs in a directory of its own under `D/nodes/` (its workers' logs, its events), new
//! for each of its sessions, so that nothing of an earlier session is touched.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

use dflash_shared::drafter::CollectiveKind;
use dflash_shared::{Device, Role, WorkerName};

use crate::cli::{RunArgs, Targets};
use crate::cluster::job::{self, Input, JobNode, JobStart};
use crate::cluster::leases::Leases;
use crate::cluster::link::{self, FromLeader};
use crate::cluster::topology::{self, NodeFlags, Topology};
use crate::data::loader::LoaderConfig;
use crate::data::share::{Feed, NodeShare, ShareFeed, Source};
use crate::error::Error;
use crate::run::dispatcher::Event;
use crate::training::resume::Resume;
use crate::training::trainer::TrainerConfig;

/// Batches a node's share keeps of those it passed without a lease (a lost node's
/// batches, lent again, are served from them).
const SHARE_CACHE: usize = 256;
/// Batches lent to a node at once, per drafter of its: one step at hand and one ahead.
const LEASES_PER_DRAFTER: usize = 2;

/// This run's place in a job across nodes.
pub struct NodeRun {
    pub t: Topology,
    /// The job's run directory, which every node shares.
    pub shared: PathBuf,
}

/// Where this run stands: `None` for a single node (the flags, or Slurm's environment,
/// say so), which runs as it always did. A follower's run directory becomes its own
/// under the job's.
pub fn place(args: &mut RunArgs) -> Result<Option<NodeRun>, Error> {
    let flags = NodeFlags {
        nodes: args.nodes,
        node_rank: args.node_rank,
        leader: args.leader.clone(),
    };
    let t = topology::resolve(&flags, |k| std::env::var(k).ok())
        .map_err(crate::cluster::ClusterError::from)?;
    let Some(t) = t else {
        return Ok(None);
    };
    let of = format!("node {} of {}", t.rank, t.nodes);
    let Some(shared) = args.run_dir.clone().or(args.resume.clone()) else {
        return Err(Error::Flag(format!("{of}: a job across nodes needs --run-dir DIR (or --resume DIR) on a filesystem every node shares: the leader writes the job's secret and its run there")));
    };
    if args.eval_data.is_some() || args.eval_prompts.is_some() {
        return Err(Error::Flag(format!("{of}: --eval-data and --eval-prompts are not built for a job across nodes yet (expected neither; measure τ on the exported drafter with `dflash-supervise eval`)")));
    }
    if matches!(args.targets, Some(Targets::Auto { .. })) {
        return Err(Error::Flag(format!("{of}: --targets auto is not built for a job across nodes yet (expected --targets N, the same on every node)")));
    }
    if args.data == "-" {
        return Err(Error::Flag(format!(
            "{of}: {}",
            crate::data::share::StdinShare
        )));
    }
    // Without --targets a job splits each node as one node of 1 or 2 devices would.
    args.targets.get_or_insert(Targets::Fixed(1));
    if !t.is_leader() {
        let own =
            shared
                .join("nodes")
                .join(format!("node-{}.{}", t.rank, crate::run::rundir::unix_ms()));
        args.run_dir = Some(own);
        args.resume = None;
        args.resume_if_exists = false;
    }
    Ok(Some(NodeRun { t, shared }))
}

/// A job's drafters all-reduce across nodes with NCCL: every drafter on a GPU (nothing to
/// check for a run of one node, `n` `None`).
pub fn check_plan(
    n: Option<&NodeRun>,
    args: &RunArgs,
    plan: &[(WorkerName, Device)],
    trainer_cfg: &mut TrainerConfig,
) -> Result<(), Error> {
    let Some(n) = n else {
        return Ok(());
    };
    let on_cpu = plan
        .iter()
        .any(|(w, d)| w.role == Role::Drafter && matches!(d, Device::Cpu));
    if on_cpu {
        return Err(Error::Flag(format!("node {} of {}: the drafters of a job across nodes exchange gradients with NCCL, which CPU drafters cannot (expected --gpus with GPUs on every node)", n.t.rank, n.t.nodes)));
    }
    if args.collective == "shm" {
        return Err(Error::Flag("--collective shm: shared memory does not span nodes (expected nccl or auto in a job across nodes)".into()));
    }
    trainer_cfg.collective = CollectiveKind::Nccl;
    Ok(())
}

/// The link's events, until the dispatcher takes them.
pub enum Link {
    Leader(Receiver<link::Event>),
    Follower(Receiver<FromLeader>),
}

/// The nodes met: this node's side of the job, how the job starts, and the link's
/// events.
pub struct Met {
    /// This node's rank.
    pub rank: u32,
    pub node: JobNode,
    pub start: JobStart,
    pub link: Link,
}

impl Link {
    /// The link's events go to the dispatcher from now on (a thread of their own).
    pub fn forward(self, tx: Sender<Event>) -> Result<(), Error> {
        let spawned = match self {
            Link::Leader(rx) => std::thread::Builder::new()
                .name("cluster-events".into())
                .spawn(move || {
                    for ev in rx {
                        if tx.send(Event::Job(Input::Leader(ev))).is_err() {
                            return;
                        }
                    }
                }),
            Link::Follower(rx) => std::thread::Builder::new()
                .name("cluster-events".into())
                .spawn(move || {
                    for ev in rx {
                        if tx.send(Event::Job(Input::Follower(ev))).is_err() {
                            return;
                        }
                    }
                }),
        };
        spawned.map_err(|e| Error::start("the cluster events thread", e))?;
        Ok(())
    }
}

/// Meet the other nodes: the leader waits until all joined and tells them where the job
/// starts (its resumed checkpoint, if any); a follower joins and learns it, and its
/// drafters start from that checkpoint.
pub fn meet(
    n: &NodeRun,
    args: &RunArgs,
    resume: Option<&Resume>,
    drafters: u32,
    trainer_cfg: &mut TrainerConfig,
) -> Result<Met, Error> {
    let timeouts = (args.join_timeout, args.node_timeout);
    if n.t.is_leader() {
        let start = JobStart {
            step: resume.map_or(0, |r| r.step),
            checkpoint: resume.map(|r| r.checkpoint.display().to_string()),
        };
        let mut leases = Leases::new(0, LEASES_PER_DRAFTER * drafters.max(1) as usize);
        if let Some(r) = resume {
            leases.consumed_before(r.consumed.iter().copied());
        }
        let (node, rx) = job::lead(&n.t, &n.shared, timeouts, &start, leases)?;
        return Ok(Met {
            rank: 0,
            node,
            start,
            link: Link::Leader(rx),
        });
    }
    let info = crate::commands::cluster_check::node_info(true);
    let (node, rx, start) = job::follow(&n.t, &n.shared, &info, timeouts)?;
    if let Some(dir) = &start.checkpoint {
        log::info!(
            "the job resumes at step {} from the leader's checkpoint {dir}",
            start.step
        );
        trainer_cfg.resume = Some((start.step, PathBuf::from(dir)));
    }
    Ok(Met {
        rank: n.t.rank,
        node,
        start,
        link: Link::Follower(rx),
    })
}

/// [`meet`], where `n` is given (a run of one node meets nobody).
pub fn meet_if(
    n: Option<&NodeRun>,
    args: &RunArgs,
    resume: Option<&Resume>,
    drafters: u32,
    trainer_cfg: &mut TrainerConfig,
) -> Result<Option<Met>, Error> {
    n.map(|n| meet(n, args, resume, drafters, trainer_cfg))
        .transpose()
}

/// The node's share of the job's batches, as its loader thread reads it: fed with the
/// leader's leases through the returned sender.
pub fn share(cfg: LoaderConfig) -> Result<(Source, Sender<Feed>, Arc<AtomicU64>), Error> {
    let share = NodeShare::new(cfg, SHARE_CACHE).map_err(|e| Error::Flag(e.to_string()))?;
    let (feed, tx, end) = ShareFeed::new(share);
    Ok((Source::Share(Box::new(feed)), tx, end))
}
