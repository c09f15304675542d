//! The group as one node's part of a job across nodes (`crate::cluster`): the second
//! level of the commit.
//!
//! The node's group keeps its members, joins and snapshots as on one machine, with two
//! differences:
//! - **Ranks are the job's**: drafter-N of node R is rank `R × RANK_STRIDE + N`, so that
//!   the ranks of all nodes form one collective (NCCL's communicator spans the nodes).
//! - **Epochs and commits are the leader's.** A change of the node's members is reported
//!   ([`JobReport::Ranks`]), and the leader forms the job's next epoch over every node's
//!   ranks ([`Group::on_job_epoch`]); the first rank's NCCL id travels through the leader
//!   too ([`JobReport::GroupId`], [`Group::on_job_id`]). When every member of the node has
//!   reduced the step in flight, the node reports it with its batches and statistics
//!   ([`JobReport::Reduced`]) instead of committing it; the step commits when the leader
//!   says every node reported it ([`Group::on_job_commit`]), with the job's statistics,
//!   which every node records alike.

use std::time::Instant;

use dflash_shared::drafter::StepStats;
use dflash_shared::protocol::ToWorker;

use super::{Action, Group, Out};

/// Node R's drafter-N is the job's rank `R * RANK_STRIDE + N`.
pub const RANK_STRIDE: u32 = 1000;

/// What the node tells the leader.
#[derive(Debug, Clone, PartialEq)]
pub enum JobReport {
    /// The node's members are now these ranks (a start, a death, a join, or an all-reduce
    /// that hung): the job needs a new epoch.
    Ranks(Vec<u32>),
    /// The job's first rank is here and created the epoch's NCCL id: for the other nodes.
    GroupId { epoch: u64, id: Vec<u8> },
    /// Every member of the node reduced `step` in `epoch`, over these batches.
    Reduced {
        epoch: u64,
        step: u64,
        batches: Vec<u64>,
        stats: StepStats,
    },
}

/// The leader's commit of a step, as every node applies it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobCommit {
    pub step: u64,
    /// The job's statistics (every node's merged).
    pub stats: StepStats,
    /// Batches of the step over the job.
    pub contributors: usize,
}

/// The node's side of the job's epochs and commits.
#[derive(Debug, Clone)]
pub struct JobGate {
    offset: u32,
    /// The ranks of the job's current epoch, once the leader formed it.
    ranks: Option<Vec<u32>>,
    /// (epoch, step) reported, so it is reported once.
    reported: Option<(u64, u64)>,
    /// The leader's commit of the step in flight, until the node's members reduced it.
    commit: Option<JobCommit>,
}

impl Group {
    /// This group is node `node`'s part of a job across nodes (before any member joins).
    pub fn join_job(&mut self, node: u32) {
        let offset = node * RANK_STRIDE;
        self.free_ranks = (offset..offset + self.cfg.max_ranks.max(1)).collect();
        self.job = Some(JobGate {
            offset,
            ranks: None,
            reported: None,
            commit: None,
        });
    }

    /// Does this group write checkpoints? Not a follower's: the leader writes the job's.
    pub fn saves_checkpoints(&self) -> bool {
        self.job.as_ref().is_none_or(|j| j.offset == 0)
    }

    /// The members of the group: the job's ranks in a job, else this node's.
    pub(super) fn group_size(&self) -> usize {
        match self.job.as_ref().and_then(|j| j.ranks.as_ref()) {
            Some(r) => r.len(),
            None => self.members.len(),
        }
    }

    /// The job's rank of drafter-`rank` of this node.
    pub(super) fn job_rank(&self, rank: u32) -> u32 {
        self.job.as_ref().map_or(rank, |j| j.offset + rank)
    }

    /// In a job: the node's members changed; the leader forms the next epoch (`true`:
    /// reported, nothing more to do here).
    pub(super) fn report_ranks(&mut self, why: &str, out: &mut Out) -> bool {
        let ranks = self.ranks();
        let Some(j) = self.job.as_mut() else {
            return false;
        };
        j.ranks = None;
        j.reported = None;
        self.reduced.clear();
        self.all_posted_at = None;
        log::info!("drafter group: this node's ranks {ranks:?} go to the leader ({why})");
        out.push(Action::Job(JobReport::Ranks(ranks)));
        true
    }

    /// The leader formed the job's epoch `epoch` of `ranks` (every node's).
    pub fn on_job_epoch(&mut self, epoch: u64, ranks: Vec<u32>, now: Instant) -> Out {
        let mut out = Out::default();
        let Some(j) = self.job.as_mut() else {
            return out;
        };
        if epoch <= self.epoch && j.ranks.is_some() {
            return out;
        }
        j.ranks = Some(ranks.clone());
        j.reported = None;
        j.commit = None;
        self.epoch = epoch;
        self.reduced.clear();
        self.all_posted_at = None;
        self.progress.epoch = epoch;
        let fields = serde_json::json!({
            "epoch": epoch, "ranks": ranks, "why": "the job's epoch (leader)",
            "step": self.committed + 1, "held": self.pending.len(),
        });
        if let serde_json::Value::Object(fields) = fields {
            out.push(Action::Event("group_epoch", fields));
        }
        log::info!("drafter group epoch {epoch} of the job: ranks {ranks:?}");
        for (&w, m) in &self.members {
            if ranks.contains(&m.rank) {
                out.push(Action::Send(
                    w,
                    ToWorker::Group {
                        epoch,
                        ranks: ranks.clone(),
                        id: None,
                    },
                ));
            }
        }
        self.try_commit(now, &mut out);
        out
    }

    /// In a job: a member created the epoch's NCCL id (`None`: not in a job).
    pub(super) fn job_group_id(&mut self, worker: usize, epoch: u64, id: &[u8]) -> Option<Out> {
        let ranks = self.job.as_ref()?.ranks.clone();
        let mut out = Out::default();
        let first = ranks.as_ref().and_then(|r| r.first().copied());
        match self.members.get(&worker) {
            Some(m) if epoch == self.epoch && first == Some(m.rank) => {
                let ranks = ranks.unwrap_or_default();
                self.relay_id(epoch, &ranks, id, &mut out);
                out.push(Action::Job(JobReport::GroupId {
                    epoch,
                    id: id.to_vec(),
                }));
            }
            Some(_) if epoch < self.epoch => {}
            _ => out.push(Action::Violation(
                worker,
                crate::violation::Violation::NcclIdNotFromFirstRank { epoch },
            )),
        }
        Some(out)
    }

    /// Another node's first rank created epoch `epoch`'s NCCL id.
    pub fn on_job_id(&mut self, epoch: u64, id: &[u8]) -> Out {
        let mut out = Out::default();
        if let Some(ranks) = self.job.as_ref().and_then(|j| j.ranks.clone()) {
            if epoch == self.epoch {
                self.relay_id(epoch, &ranks, id, &mut out);
            }
        }
        out
    }

    /// The id to every member of the epoch but its first rank (which made it).
    fn relay_id(&self, epoch: u64, ranks: &[u32], id: &[u8], out: &mut Out) {
        for (&w, m) in &self.members {
            if ranks.first() != Some(&m.rank) && ranks.contains(&m.rank) {
                out.push(Action::Send(
                    w,
                    ToWorker::Group {
                        epoch,
                        ranks: ranks.to_vec(),
                        id: Some(id.to_vec()),
                    },
                ));
            }
        }
    }

    /// The leader committed `c.step` over every node.
    pub fn on_job_commit(&mut self, c: JobCommit, now: Instant) -> Out {
        let mut out = Out::default();
        let step = self.committed + 1;
        let Some(j) = self.job.as_mut() else {
            return out;
        };
        if c.step < step {
            return out;
        }
        if c.step > step || j.reported.is_none_or(|(_, s)| s != step) {
            self.phase = self.phase.frozen();
            out.push(Action::Failed(format!(
                "the leader committed step {} while this node is at step {step} and reported {:?}: the nodes are out of step",
                c.step, j.reported
            )));
            return out;
        }
        j.commit = Some(c);
        self.try_commit(now, &mut out);
        out
    }

    /// In a job, in place of committing: report the step once every member reduced it,
    /// and commit it once the leader did (`false`: not in a job).
    pub(super) fn job_try_commit(&mut self, now: Instant, out: &mut Out) -> bool {
        let Some(j) = &self.job else {
            return false;
        };
        let all = |set: &dyn Fn(&usize) -> bool| self.members.keys().all(set);
        if self.members.is_empty()
            || j.ranks.is_none()
            || !all(&|w| self.pending.contains_key(w) || self.abstained.contains(w))
            || !all(&|w| self.reduced.contains_key(w))
        {
            return true;
        }
        let step = self.committed + 1;
        if j.reported != Some((self.epoch, step)) {
            let mut stats = StepStats::default();
            for p in self.pending.values() {
                stats.merge(&p.stats);
            }
            let batches = self.pending.values().map(|p| p.batch_id).collect();
            out.push(Action::Job(JobReport::Reduced {
                epoch: self.epoch,
                step,
                batches,
                stats,
            }));
            let epoch = self.epoch;
            if let Some(j) = self.job.as_mut() {
                j.reported = Some((epoch, step));
            }
        }
        let commit = self.job.as_mut().and_then(|j| j.commit.take());
        if let Some(c) = commit {
            self.commit_with(now, Some(c), out);
        }
        true
    }

    /// In a job, with no batch left for this node (the leader lends it no more): its
    /// members contribute nothing to the step in flight, so the other nodes' batches
    /// commit (`false`: not in a job, or not now).
    pub(super) fn job_idle(&mut self, remaining: Option<u64>, now: Instant) -> Option<Out> {
        if self.job.is_none()
            || self.is_frozen()
            || self.joining().is_some()
            || remaining != Some(0)
            || !self.pending.is_empty()
        {
            return None;
        }
        let mut out = Out::default();
        self.abstain_idle(now, &mut out);
        Some(out)
    }
}
