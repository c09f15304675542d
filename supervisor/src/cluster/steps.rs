//! The job's step commit across nodes, on the leader: the second level of the drafter
//! group's commit.
//!
//! Within a node, the node's supervisor runs its drafters' group as on one machine
//! (`crate::training::group`): its ranks all-reduce with every rank of the job, and when
//! all of them have reduced step s the node *reports* s to the leader, with the batches
//! its ranks consumed and their loss weights. The leader commits s once every node with
//! ranks in the current epoch has reported it in that epoch, and tells every node, which
//! applies it.
//!
//! The epoch is the job's: its ranks are those of every node, and the collective (NCCL's
//! communicator) spans them all, so any change anywhere (a node joining or lost, a rank
//! dying or joining on one node) starts a new epoch for every node. The reports of the
//! step in flight are then void, and the ranks reduce again in the new group, exactly as
//! a rank's death starts a new epoch within a node.
//!
//! Pure state: no clock, no I/O.

use std::collections::{BTreeMap, BTreeSet};

use dflash_shared::drafter::StepStats;

use super::leases::Node;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StepError {
    #[error("node {node} reported step {got}, the step in flight is {want}")]
    WrongStep { node: Node, got: u64, want: u64 },
    #[error("node {node} is not a member of node epoch {epoch}")]
    NotMember { node: Node, epoch: u64 },
    #[error("node {node} reported step {step} twice in node epoch {epoch}")]
    Twice { node: Node, step: u64, epoch: u64 },
    #[error("node {node} claims rank {rank}, which node {holder} has")]
    RankTaken { node: Node, rank: u32, holder: Node },
}

/// A node's report of the step in flight.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub batches: Vec<u64>,
    /// Σ of its ranks' loss weights.
    pub weight: f64,
    /// What its ranks measured (merged).
    pub stats: StepStats,
}

/// A step every member reported: apply it everywhere.
#[derive(Debug, Clone, PartialEq)]
pub struct Commit {
    pub step: u64,
    pub epoch: u64,
    /// Each node's consumed batches.
    pub batches: BTreeMap<Node, Vec<u64>>,
    pub weight_sum: f64,
    /// Every node's statistics, merged.
    pub stats: StepStats,
}

/// A new epoch: the nodes that report its steps and the job's ranks, ascending, for every
/// node to form its group with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Epoch {
    pub epoch: u64,
    pub members: Vec<Node>,
    pub ranks: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct Steps {
    epoch: u64,
    /// Each live node's ranks (a node without any reports nothing).
    members: BTreeMap<Node, BTreeSet<u32>>,
    /// The step in flight (the next to commit).
    next: u64,
    reports: BTreeMap<Node, Report>,
    /// No step commits (a node is joining: the job waits for it at this step).
    held: bool,
}

impl Steps {
    /// The job at `next` (0, or a resumed run's step + 1) with the leader alone, and its
    /// ranks.
    pub fn new(next: u64, leader: Node, ranks: &[u32]) -> Steps {
        Steps {
            epoch: 1,
            members: BTreeMap::from([(leader, ranks.iter().copied().collect())]),
            next,
            reports: BTreeMap::new(),
            held: false,
        }
    }

    /// The nodes that report each step: those with ranks.
    fn reporting(&self) -> impl Iterator<Item = Node> + '_ {
        self.members
            .iter()
            .filter(|(_, r)| !r.is_empty())
            .map(|(n, _)| *n)
    }

    pub fn next_step(&self) -> u64 {
        self.next
    }

    pub fn epoch(&self) -> Epoch {
        Epoch {
            epoch: self.epoch,
            members: self.reporting().collect(),
            ranks: self
                .members
                .values()
                .flatten()
                .copied()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
        }
    }

    /// A new epoch of the same members (an all-reduce hung somewhere).
    pub fn renew(&mut self) -> Epoch {
        self.epoch += 1;
        self.reports.clear();
        self.epoch()
    }

    /// A node joins with `ranks`, or a node's ranks changed (one died, one joined): a new
    /// epoch (`Ok(None)`: nothing changed). A rank another node has is refused.
    pub fn ranks(&mut self, node: Node, ranks: &[u32]) -> Result<Option<Epoch>, StepError> {
        for &rank in ranks {
            if let Some((&holder, _)) = self
                .members
                .iter()
                .find(|(&n, r)| n != node && r.contains(&rank))
            {
                return Err(StepError::RankTaken { node, rank, holder });
            }
        }
        let new: BTreeSet<u32> = ranks.iter().copied().collect();
        if self.members.get(&node) == Some(&new) {
            return Ok(None);
        }
        self.members.insert(node, new);
        Ok(Some(self.renew()))
    }

    /// A node is lost: a new epoch without it and its ranks (`None`: it was no member).
    pub fn lost(&mut self, node: Node) -> Option<Epoch> {
        self.members.remove(&node).map(|_| self.renew())
    }

    /// `node` reports the step in flight reduced in `epoch`: the commit once every member
    /// has. A report of an older epoch is void (`Ok(None)`): the node reports again in
    /// the current one.
    pub fn reported(
        &mut self,
        node: Node,
        epoch: u64,
        step: u64,
        report: Report,
    ) -> Result<Option<Commit>, StepError> {
        if epoch < self.epoch {
            return Ok(None);
        }
        if epoch > self.epoch || self.members.get(&node).is_none_or(|r| r.is_empty()) {
            return Err(StepError::NotMember { node, epoch });
        }
        if step != self.next {
            return Err(StepError::WrongStep {
                node,
                got: step,
                want: self.next,
            });
        }
        if self.reports.contains_key(&node) {
            return Err(StepError::Twice { node, step, epoch });
        }
        self.reports.insert(node, report);
        Ok(self.try_commit())
    }

    /// From now on no step commits, until [`Steps::release`] (the reports are kept).
    pub fn hold(&mut self) {
        self.held = true;
    }

    /// Steps commit again: the step in flight, if every member reported it meanwhile.
    pub fn release(&mut self) -> Option<Commit> {
        self.held = false;
        self.try_commit()
    }

    fn try_commit(&mut self) -> Option<Commit> {
        if self.held || self.reporting().any(|n| !self.reports.contains_key(&n)) {
            return None;
        }
        let step = self.next;
        let epoch = self.epoch;
        let reports = std::mem::take(&mut self.reports);
        let weight_sum = reports.values().map(|r| r.weight).sum();
        let mut stats = StepStats::default();
        for r in reports.values() {
            stats.merge(&r.stats);
        }
        let batches = reports.into_iter().map(|(n, r)| (n, r.batches)).collect();
        self.next += 1;
        Some(Commit {
            step,
            epoch,
            batches,
            weight_sum,
            stats,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_step_commits_once_released_and_not_before() {
        let mut s = Steps::new(0, 0, &[0]);
        let e = s.epoch().epoch;
        s.hold();
        assert_eq!(s.reported(0, e, 0, r(&[4], 1.0)), Ok(None));
        let c = s.release().expect("every member reported");
        assert_eq!((c.step, c.batches[&0].clone()), (0, vec![4]));
        assert_eq!(s.release(), None, "nothing left in flight");
    }

    fn r(b: &[u64], w: f64) -> Report {
        Report {
            batches: b.to_vec(),
            weight: w,
            stats: StepStats::default(),
        }
    }

    #[test]
    fn a_step_commits_once_every_member_reported_it_in_the_current_epoch() {
        let mut s = Steps::new(0, 0, &[0, 1]);
        let e = s.ranks(1, &[8, 9]).unwrap().unwrap();
        assert_eq!(
            (e.epoch, e.members, e.ranks),
            (2, vec![0, 1], vec![0, 1, 8, 9])
        );
        assert_eq!(s.ranks(2, &[16]).unwrap().unwrap().members, [0, 1, 2]);
        assert_eq!(s.ranks(2, &[16]), Ok(None), "nothing changed");
        assert_eq!(
            s.ranks(2, &[9]),
            Err(StepError::RankTaken {
                node: 2,
                rank: 9,
                holder: 1
            })
        );
        assert_eq!(s.reported(0, 3, 0, r(&[0, 1], 1.0)), Ok(None));
        assert_eq!(s.reported(1, 3, 0, r(&[2, 3], 2.0)), Ok(None));
        // Node 2 lost before reporting: a new epoch, the reports void.
        let e = s.lost(2).unwrap();
        assert_eq!((e.epoch, e.ranks), (4, vec![0, 1, 8, 9]));
        assert_eq!(s.lost(2), None);
        assert_eq!(
            s.reported(1, 3, 0, r(&[2], 2.0)),
            Ok(None),
            "an old epoch's report is void"
        );
        assert_eq!(s.reported(0, 4, 0, r(&[0], 1.0)), Ok(None));
        let c = s.reported(1, 4, 0, r(&[1], 2.0)).unwrap().unwrap();
        assert_eq!((c.step, c.epoch, c.weight_sum), (0, 4, 3.0));
        assert_eq!(c.batches, BTreeMap::from([(0, vec![0]), (1, vec![1])]));
        assert_eq!(s.next_step(), 1);
        // Bad reports change nothing.
        assert!(matches!(
            s.reported(1, 4, 0, r(&[], 0.0)),
            Err(StepError::WrongStep { .. })
        ));
        assert!(matches!(
            s.reported(2, 4, 1, r(&[], 0.0)),
            Err(StepError::NotMember { .. })
        ));
        assert!(matches!(
            s.reported(0, 5, 1, r(&[], 0.0)),
            Err(StepError::NotMember { .. })
        ));
        assert_eq!(s.reported(0, 4, 1, r(&[2], 1.0)), Ok(None));
        assert!(matches!(
            s.reported(0, 4, 1, r(&[2], 1.0)),
            Err(StepError::Twice { .. })
        ));
        // A rank of node 1 dies: a new epoch; node 1 with no rank left reports nothing.
        assert_eq!(s.ranks(1, &[8]).unwrap().unwrap().ranks, [0, 1, 8]);
        let e = s.ranks(1, &[]).unwrap().unwrap();
        assert_eq!((e.members, e.ranks), (vec![0], vec![0, 1]));
        assert!(matches!(
            s.reported(1, e.epoch, 1, r(&[], 0.0)),
            Err(StepError::NotMember { .. })
        ));
        assert!(
            s.reported(0, e.epoch, 1, r(&[3], 1.0)).unwrap().is_some(),
            "the leader alone"
        );
    }
}
