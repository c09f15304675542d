//! One record per batch: where each batch the pipeline knows of is in its life, as a state
//! machine ([`BatchState`]), with the little it carries along (its tokens while a rollback
//! may send it through again, its real token count). The slot tables say which slot holds
//! what; these records say what a batch is waiting for, and keep the two consistent only
//! through the [`Pipeline`](super::pipeline::Pipeline), which changes both together.
//!
//! The indexes below ([`Batches::first_again`], [`Batches::next_queued`], the trained
//! count, the uncovered steps) are derived from the records and updated in one place,
//! [`Batches::set`], so the per-event work stays independent of how many batches a run
//! has seen.

use std::collections::{BTreeMap, BTreeSet};

use dflash_shared::batch::{is_eval_batch, TokenBatch, EVAL_BATCH_BASE};
use dflash_shared::slots::Holder;

/// Where a batch is. Training batches go
/// `Tokens → AtTarget → Hidden → AtDrafter → Trained`; a rollback or an eval round sends
/// one back to `Queued`, a worker's death sends it back one step (`AtTarget → Tokens`,
/// `AtDrafter → Hidden`). Eval batches start `Queued` and end `EvalOver`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchState {
    /// Waiting for a token slot, to be written there by the supervisor: a training batch
    /// sent through again (a rollback, or set aside for an eval round), or an eval batch.
    Queued,
    /// In a token slot, READY for a target. `again`: sent through again, hidden states
    /// not made yet (drafters wait for it before newer batches).
    Tokens { again: bool },
    /// Its token slot is being read by target `holder`, which writes its hidden states.
    AtTarget { holder: Holder, again: bool },
    /// Its hidden states are in a slot, READY for a drafter.
    Hidden,
    /// Its hidden-state slot was delivered to drafter `holder`.
    AtDrafter { holder: Holder },
    /// It reached the optimizer; `step` is the committed step it was trained in, while a
    /// rollback can still reach it (`None` once a snapshot or checkpoint covers it, or
    /// when it was consumed outside a step).
    Trained { step: Option<u64> },
    /// An eval batch that was scored, or dropped with its round after its hidden states
    /// were made (kept so that a late commit of it is seen as a duplicate).
    EvalOver,
}

impl BatchState {
    /// Hidden states were made of it (a further commit of it is a duplicate).
    pub fn hidden_made(self) -> bool {
        matches!(
            self,
            BatchState::Hidden
                | BatchState::AtDrafter { .. }
                | BatchState::Trained { .. }
                | BatchState::EvalOver
        )
    }

    /// Sent through again and its hidden states not made yet.
    fn again(self) -> bool {
        matches!(
            self,
            BatchState::Queued
                | BatchState::Tokens { again: true }
                | BatchState::AtTarget { again: true, .. }
        )
    }

    /// The same place one step back: where a dead consumer's batch goes again.
    pub fn back_to_ready(self) -> BatchState {
        match self {
            BatchState::AtTarget { again, .. } => BatchState::Tokens { again },
            BatchState::AtDrafter { .. } => BatchState::Hidden,
            other => other,
        }
    }
}

/// What the pipeline knows of one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRecord {
    pub state: BatchState,
    /// Real (unpadded) tokens, counted for per-worker throughput; 0 for eval batches,
    /// which are not counted.
    pub tokens: u64,
    /// The batch itself while it may have to be written into a token slot again: a
    /// training batch until it is trained outside any rollback's reach, an eval batch
    /// until it is written into its token slot.
    pub batch: Option<TokenBatch>,
}

/// A state change the records refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("batch {0} is unknown to the pipeline")]
    Unknown(u64),
    #[error("batch {batch_id} was not kept, it cannot be trained again")]
    NotKept { batch_id: u64 },
}

/// Every batch the pipeline knows of, by id, with the indexes derived from them.
#[derive(Debug, Default)]
pub struct Batches {
    records: BTreeMap<u64, BatchRecord>,
    /// Records in `Queued`, by id (training ids sort below eval ids).
    queued: BTreeSet<u64>,
    /// Training records sent through again whose hidden states are not made yet.
    again: BTreeSet<u64>,
    /// `(step, batch)` of records in `Trained { step: Some(step) }`.
    uncovered: BTreeSet<(u64, u64)>,
    /// Records in `Trained`.
    trained: u64,
}

impl Batches {
    pub fn get(&self, batch_id: u64) -> Option<&BatchRecord> {
        self.records.get(&batch_id)
    }

    pub fn state(&self, batch_id: u64) -> Option<BatchState> {
        self.records.get(&batch_id).map(|r| r.state)
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &BatchRecord)> {
        self.records.iter().map(|(&b, r)| (b, r))
    }

    /// A new batch (or one known before, replaced: its indexes follow).
    pub fn insert(&mut self, batch_id: u64, record: BatchRecord) {
        let state = record.state;
        if let Some(old) = self.records.insert(batch_id, record) {
            self.unindex(batch_id, old.state);
        }
        self.index(batch_id, state);
    }

    /// Forget a batch.
    pub fn remove(&mut self, batch_id: u64) -> Option<BatchRecord> {
        let r = self.records.remove(&batch_id)?;
        self.unindex(batch_id, r.state);
        Some(r)
    }

    /// Move a known batch to `state`.
    pub fn set(&mut self, batch_id: u64, state: BatchState) -> Result<(), BatchError> {
        let r = self
            .records
            .get_mut(&batch_id)
            .ok_or(BatchError::Unknown(batch_id))?;
        let old = std::mem::replace(&mut r.state, state);
        self.unindex(batch_id, old);
        self.index(batch_id, state);
        Ok(())
    }

    /// Send a training batch through again (`Queued`): only if its tokens were kept.
    pub fn requeue(&mut self, batch_id: u64) -> Result<(), BatchError> {
        let r = self
            .records
            .get(&batch_id)
            .ok_or(BatchError::NotKept { batch_id })?;
        if r.batch.is_none() {
            return Err(BatchError::NotKept { batch_id });
        }
        self.set(batch_id, BatchState::Queued)
    }

    /// Stop keeping a batch's tokens (no rollback can need them again).
    pub fn forget_tokens(&mut self, batch_id: u64) {
        if let Some(r) = self.records.get_mut(&batch_id) {
            r.batch = None;
        }
    }

    /// The lowest `Queued` batch of the kind asked for.
    pub fn next_queued(&self, eval: bool) -> Option<u64> {
        if eval {
            self.queued.range(EVAL_BATCH_BASE..).next().copied()
        } else {
            self.queued.range(..EVAL_BATCH_BASE).next().copied()
        }
    }

    /// `Queued` batches of the kind asked for, lowest first.
    pub fn queued(&self, eval: bool) -> Vec<u64> {
        let all = self.queued.iter().copied();
        all.filter(|&b| is_eval_batch(b) == eval).collect()
    }

    /// The lowest training batch sent through again whose hidden states are not made yet.
    pub fn first_again(&self) -> Option<u64> {
        self.again.first().copied()
    }

    /// Batches in `Trained` (each counted once, however often it was consumed).
    pub fn trained(&self) -> u64 {
        self.trained
    }

    /// Batches trained in a step at or before `step` and not yet covered.
    pub fn uncovered_upto(&self, step: u64) -> Vec<u64> {
        let upto = self.uncovered.range(..=(step, u64::MAX));
        upto.map(|&(_, b)| b).collect()
    }

    fn index(&mut self, batch_id: u64, state: BatchState) {
        self.flags(batch_id, state, true);
    }

    fn unindex(&mut self, batch_id: u64, state: BatchState) {
        self.flags(batch_id, state, false);
    }

    /// Add (`on`) or take away a record's contribution to every index.
    fn flags(&mut self, batch_id: u64, state: BatchState, on: bool) {
        let toggle = |set: &mut BTreeSet<u64>| {
            if on {
                set.insert(batch_id);
            } else {
                set.remove(&batch_id);
            }
        };
        if state == BatchState::Queued {
            toggle(&mut self.queued);
        }
        if state.again() && !is_eval_batch(batch_id) {
            toggle(&mut self.again);
        }
        if let BatchState::Trained { step } = state {
            if on {
                self.trained += 1;
            } else {
                self.trained -= 1;
            }
            if let Some(s) = step {
                if on {
                    self.uncovered.insert((s, batch_id));
                } else {
                    self.uncovered.remove(&(s, batch_id));
                }
            }
        }
    }

    /// The indexes, recomputed from the records, equal the ones kept (tests).
    #[cfg(test)]
    pub fn check_indexes(&self) -> Result<(), IndexDrift> {
        let mut fresh = Batches::default();
        for (&b, r) in &self.records {
            fresh.index(b, r.state);
        }
        let (kept, derived) = (Indexes::of(self), Indexes::of(&fresh));
        if kept != derived {
            return Err(IndexDrift {
                kept: Box::new(kept),
                derived: Box::new(derived),
            });
        }
        Ok(())
    }
}

/// The indexes [`Batches`] keeps beside its records (tests).
#[cfg(test)]
#[derive(Debug, PartialEq, Eq)]
pub struct Indexes {
    queued: BTreeSet<u64>,
    again: BTreeSet<u64>,
    uncovered: BTreeSet<(u64, u64)>,
    trained: u64,
}

#[cfg(test)]
impl Indexes {
    fn of(b: &Batches) -> Indexes {
        Indexes {
            queued: b.queued.clone(),
            again: b.again.clone(),
            uncovered: b.uncovered.clone(),
            trained: b.trained,
        }
    }
}

/// Indexes kept that differ from those the records give (tests).
#[cfg(test)]
#[derive(Debug, thiserror::Error)]
#[error("indexes drifted: kept {kept:?}, derived {derived:?}")]
pub struct IndexDrift {
    pub kept: Box<Indexes>,
    pub derived: Box<Indexes>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::batch::eval_batch_id;

    fn batch(id: u64) -> TokenBatch {
        TokenBatch {
            batch_id: id,
            seq_len: 2,
            lengths: vec![2],
            input_ids: vec![1, 2],
            loss_mask: vec![1, 1],
        }
    }

    fn loaded(b: &mut Batches, id: u64) {
        let record = BatchRecord {
            state: BatchState::Tokens { again: false },
            tokens: 2,
            batch: Some(batch(id)),
        };
        b.insert(id, record);
    }

    #[test]
    fn life_of_a_training_batch_updates_the_indexes() {
        let mut b = Batches::default();
        loaded(&mut b, 3);
        assert_eq!(b.first_again(), None);
        b.set(
            3,
            BatchState::AtTarget {
                holder: 1,
                again: false,
            },
        )
        .unwrap();
        b.set(3, BatchState::Hidden).unwrap();
        b.set(3, BatchState::AtDrafter { holder: 2 }).unwrap();
        b.set(3, BatchState::Trained { step: Some(7) }).unwrap();
        assert_eq!(b.trained(), 1);
        assert_eq!(b.uncovered_upto(6), Vec::<u64>::new());
        assert_eq!(b.uncovered_upto(7), vec![3]);
        b.requeue(3).unwrap();
        assert_eq!(b.trained(), 0);
        assert_eq!(b.uncovered_upto(7), Vec::<u64>::new());
        assert_eq!(b.next_queued(false), Some(3));
        assert_eq!(b.first_again(), Some(3));
        b.set(3, BatchState::Tokens { again: true }).unwrap();
        assert_eq!(b.next_queued(false), None);
        assert_eq!(b.first_again(), Some(3));
        b.set(3, BatchState::Hidden).unwrap();
        assert_eq!(b.first_again(), None);
        b.check_indexes().unwrap();
    }

    #[test]
    fn a_batch_whose_tokens_were_dropped_cannot_be_requeued() {
        let mut b = Batches::default();
        loaded(&mut b, 1);
        b.set(1, BatchState::Trained { step: None }).unwrap();
        b.forget_tokens(1);
        assert_eq!(b.requeue(1), Err(BatchError::NotKept { batch_id: 1 }));
        assert_eq!(b.state(1), Some(BatchState::Trained { step: None }));
        assert_eq!(b.requeue(9), Err(BatchError::NotKept { batch_id: 9 }));
        assert_eq!(b.set(9, BatchState::Hidden), Err(BatchError::Unknown(9)));
    }

    #[test]
    fn eval_batches_queue_apart_and_never_count_as_sent_again() {
        let mut b = Batches::default();
        let e = eval_batch_id(1, 0);
        b.insert(
            e,
            BatchRecord {
                state: BatchState::Queued,
                tokens: 0,
                batch: Some(batch(e)),
            },
        );
        loaded(&mut b, 5);
        b.requeue(5).unwrap();
        assert_eq!(b.next_queued(true), Some(e));
        assert_eq!(b.next_queued(false), Some(5));
        assert_eq!(b.queued(true), vec![e]);
        assert_eq!(b.first_again(), Some(5));
        b.remove(5);
        assert_eq!(b.first_again(), None);
        assert!(b.state(e).is_some_and(|s| !s.hidden_made()));
        b.set(e, BatchState::EvalOver).unwrap();
        assert!(BatchState::EvalOver.hidden_made());
        b.check_indexes().unwrap();
    }

    #[test]
    fn a_dead_consumer_sends_its_batch_back_one_step() {
        let at = BatchState::AtTarget {
            holder: 4,
            again: true,
        };
        assert_eq!(at.back_to_ready(), BatchState::Tokens { again: true });
        let ad = BatchState::AtDrafter { holder: 4 };
        assert_eq!(ad.back_to_ready(), BatchState::Hidden);
        assert_eq!(BatchState::Hidden.back_to_ready(), BatchState::Hidden);
    }
}
