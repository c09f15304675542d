//! Which node trains which batch: the leader's lease table.
//!
//! Batches have job-wide ids (their place in the data's order, the same on every node:
//! every node reads the same data with the same seed). The leader lends each live node a
//! few ids at a time, up to a window, and a node loads, captures and trains only the ids
//! lent to it. A step's commit names the ids it consumed; those are done. A node lost
//! gives its outstanding ids back, and they are lent again before any new id, so no batch
//! is skipped and none is trained twice; a rollback gives back the ids consumed after the
//! step it goes back to, in their order.
//!
//! Pure state: no clock, no I/O. Each call says what changed; the caller sends the
//! grants and writes the ledger.

use std::collections::{BTreeMap, BTreeSet};

/// A node's rank in the job.
pub type Node = u32;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    #[error("node {node} reported batch {batch} consumed, but it is not lent to it{}", holder.map(|h| format!(" (node {h} holds it)")).unwrap_or_default())]
    NotLent {
        node: Node,
        batch: u64,
        holder: Option<Node>,
    },
    #[error("node {node} is not live")]
    NotLive { node: Node },
}

#[derive(Debug, Clone)]
pub struct Leases {
    /// The next id never lent.
    next: u64,
    /// Ids at or past this do not exist (set once the data's length is known).
    end: Option<u64>,
    /// Outstanding ids per node.
    window: usize,
    lent: BTreeMap<Node, BTreeSet<u64>>,
    /// Ids given back (a lost node's, a rollback's), lent again first, lowest first.
    returned: BTreeSet<u64>,
    consumed: BTreeSet<u64>,
}

impl Leases {
    /// Starting at `next` (0, or where a resumed run's consumed ids end), `window` ids
    /// outstanding per node at most.
    pub fn new(next: u64, window: usize) -> Leases {
        Leases {
            next,
            end: None,
            window: window.max(1),
            lent: BTreeMap::new(),
            returned: BTreeSet::new(),
            consumed: BTreeSet::new(),
        }
    }

    /// A node joins (or joins again): it holds nothing yet.
    pub fn join(&mut self, node: Node) {
        self.lent.entry(node).or_default();
    }

    /// A node is lost: what it held is given back, and returned (in order).
    pub fn lost(&mut self, node: Node) -> Vec<u64> {
        let back: Vec<u64> = self
            .lent
            .remove(&node)
            .unwrap_or_default()
            .into_iter()
            .collect();
        self.returned.extend(&back);
        back
    }

    /// Fill `node`'s window: the ids newly lent to it, given-back ones first.
    pub fn grant(&mut self, node: Node) -> Result<Vec<u64>, LeaseError> {
        let mut new = Vec::new();
        while let Some(id) = self.grant_one(node)? {
            new.push(id);
        }
        Ok(new)
    }

    /// One more id for `node` if its window has room (given-back ids first): granting
    /// one at a time to each node in turn interleaves their ids, so that each step of
    /// the job trains the same batches as one node with all the ranks would.
    pub fn grant_one(&mut self, node: Node) -> Result<Option<u64>, LeaseError> {
        let held = self.lent.get(&node).ok_or(LeaseError::NotLive { node })?;
        if held.len() >= self.window {
            return Ok(None);
        }
        let id = loop {
            match self.returned.pop_first() {
                Some(id) => break id,
                None if self.end.is_none_or(|e| self.next < e) => {
                    self.next += 1;
                    // A resumed job's consumed ids are not lent again.
                    if !self.consumed.contains(&(self.next - 1)) {
                        break self.next - 1;
                    }
                }
                None => return Ok(None),
            }
        };
        self.lent.entry(node).or_default().insert(id);
        Ok(Some(id))
    }

    /// A resumed job: these ids were consumed before it (never lent again).
    pub fn consumed_before(&mut self, ids: impl IntoIterator<Item = u64>) {
        self.consumed.extend(ids);
    }

    /// A committed step consumed `batches` of `node`: done, never lent again (unless a
    /// rollback gives them back). An id not lent to that node is refused, whole: the
    /// report changes nothing.
    pub fn consumed(&mut self, node: Node, batches: &[u64]) -> Result<(), LeaseError> {
        let held = self.lent.get(&node).ok_or(LeaseError::NotLive { node })?;
        if let Some(&batch) = batches.iter().find(|b| !held.contains(b)) {
            return Err(LeaseError::NotLent {
                node,
                batch,
                holder: self.holder(batch),
            });
        }
        let held = self.lent.entry(node).or_default();
        for b in batches {
            held.remove(b);
            self.consumed.insert(*b);
        }
        Ok(())
    }

    /// The job went back to a step: `batches` (consumed after it) are to be trained again.
    pub fn rollback(&mut self, batches: &[u64]) {
        for b in batches {
            if self.consumed.remove(b) {
                self.returned.insert(*b);
            }
        }
    }

    /// The data has `n` batches: ids from `n` on are withdrawn from whoever holds them
    /// (returned per node, for the caller to tell them).
    pub fn set_end(&mut self, n: u64) -> BTreeMap<Node, Vec<u64>> {
        self.end = Some(n);
        self.next = self.next.min(n);
        self.returned.retain(|&b| b < n);
        let mut withdrawn = BTreeMap::new();
        for (node, held) in &mut self.lent {
            let gone: Vec<u64> = held.range(n..).copied().collect();
            if !gone.is_empty() {
                held.retain(|&b| b < n);
                withdrawn.insert(*node, gone);
            }
        }
        withdrawn
    }

    /// Who holds `batch`.
    pub fn holder(&self, batch: u64) -> Option<Node> {
        self.lent
            .iter()
            .find(|(_, h)| h.contains(&batch))
            .map(|(n, _)| *n)
    }

    /// Every batch of the data consumed (its length known).
    pub fn done(&self) -> bool {
        self.end.is_some_and(|e| {
            self.next >= e && self.returned.is_empty() && self.lent.values().all(BTreeSet::is_empty)
        })
    }

    /// No id is left to lend: the data's length is known, every id was lent, and none
    /// was given back.
    pub fn exhausted(&self) -> bool {
        self.end.is_some_and(|e| self.next >= e) && self.returned.is_empty()
    }

    pub fn consumed_ids(&self) -> Vec<u64> {
        self.consumed.iter().copied().collect()
    }

    pub fn consumed_count(&self) -> usize {
        self.consumed.len()
    }

    pub fn outstanding(&self, node: Node) -> usize {
        self.lent.get(&node).map_or(0, BTreeSet::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_lost_nodes_batches_are_lent_again_first_and_none_twice() {
        let mut l = Leases::new(0, 3);
        l.join(1);
        l.join(2);
        assert_eq!(l.grant(1).unwrap(), [0, 1, 2]);
        assert_eq!(l.grant(2).unwrap(), [3, 4, 5]);
        l.consumed(1, &[0]).unwrap();
        assert_eq!(l.lost(1), [1, 2]);
        assert_eq!(l.grant(2).unwrap(), Vec::<u64>::new(), "its window is full");
        l.consumed(2, &[3, 4]).unwrap();
        assert_eq!(l.grant(2).unwrap(), [1, 2], "given back first");
        // A report of a batch it does not hold changes nothing.
        assert_eq!(
            l.consumed(2, &[5, 0]),
            Err(LeaseError::NotLent {
                node: 2,
                batch: 0,
                holder: None
            })
        );
        assert_eq!(l.outstanding(2), 3);
        assert!(matches!(
            l.consumed(1, &[1]),
            Err(LeaseError::NotLive { node: 1 })
        ));
        // The data's end withdraws what lies past it.
        let w = l.set_end(3);
        assert_eq!(w.get(&2), Some(&vec![5]));
        l.consumed(2, &[1]).unwrap();
        assert!(!l.done());
        assert_eq!(l.lost(2), [2]);
        l.join(3);
        assert_eq!(l.grant(3).unwrap(), [2], "nothing past the end");
        l.consumed(3, &[2]).unwrap();
        assert!(l.done(), "0, 1 and 2 consumed, of 3");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Join(Node),
        Lose(Node),
        Grant(Node),
        /// Consume up to this many of the node's outstanding ids, lowest first.
        Train(Node, usize),
        /// Roll back this many of the latest consumed.
        Rollback(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..4).prop_map(Op::Join),
            (0u32..4).prop_map(Op::Lose),
            (0u32..4).prop_map(Op::Grant),
            (0u32..4, 0usize..4).prop_map(|(n, k)| Op::Train(n, k)),
            (0usize..3).prop_map(Op::Rollback),
        ]
    }

    proptest! {
        /// Whatever nodes join, train, are lost and come back, and however the job rolls
        /// back: no batch is held by two nodes, none is consumed twice in the final
        /// lineage, and once the survivors finish, every batch of the data is consumed.
        #[test]
        fn every_batch_is_trained_exactly_once_whatever_happens_to_the_nodes(
            ops in proptest::collection::vec(op(), 1..80),
            n in 1u64..40,
            window in 1usize..5,
        ) {
            let mut l = Leases::new(0, window);
            l.set_end(n);
            let mut lineage: Vec<u64> = Vec::new();
            for o in ops {
                match o {
                    Op::Join(x) => l.join(x),
                    Op::Lose(x) => { l.lost(x); }
                    Op::Grant(x) => { let _ = l.grant(x); }
                    Op::Train(x, k) => {
                        let ids: Vec<u64> = l.lent.get(&x).map(|h| h.iter().take(k).copied().collect()).unwrap_or_default();
                        if l.consumed(x, &ids).is_ok() { lineage.extend(ids); }
                    }
                    Op::Rollback(k) => {
                        let back = lineage.split_off(lineage.len().saturating_sub(k));
                        l.rollback(&back);
                    }
                }
                let mut seen = BTreeSet::new();
                for h in l.lent.values() {
                    for b in h { prop_assert!(seen.insert(*b), "batch {b} lent twice"); }
                }
            }
            // A survivor finishes the data.
            l.join(9);
            for _ in 0..(2 * n + 2) {
                l.grant(9).unwrap();
                let ids: Vec<u64> = l.lent[&9].iter().copied().collect();
                l.consumed(9, &ids).unwrap();
                lineage.extend(ids);
                for other in [0, 1, 2, 3] { l.lost(other); }
            }
            prop_assert!(l.done());
            let mut sorted = lineage.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..n).collect::<Vec<u64>>(), "each batch once");
        }
    }
}
