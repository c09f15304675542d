//! The slot state machine of one pool, kept by the supervisor (the only writer of state,
//! owner and generation). Pure logic: no memory, no processes, so every interleaving can
//! be property-tested.
//!
//! ```text
//!            lease              commit                 deliver              ack
//!   FREE ─────────────► WRITING ─────────► READY ─────────────► READING ─────────► FREE
//!     ▲                    │  owner died      ▲  owner died          │
//!     └────────────────────┘                  └──────────────────────┘ (front of the queue)
//! ```
//!
//! Every assignment of a slot to a holder bumps its generation; messages name the slot and
//! the generation they were given, so a message from an earlier assignment (a stale gen)
//! is refused instead of touching someone else's batch.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SlotState {
    Free = 0,
    Writing = 1,
    Ready = 2,
    Reading = 3,
}

/// In words, for logs: "free", "writing", "ready", "reading".
impl std::fmt::Display for SlotState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SlotState::Free => "free",
            SlotState::Writing => "writing",
            SlotState::Ready => "ready",
            SlotState::Reading => "reading",
        })
    }
}

/// Who holds a slot: the supervisor's id for one worker life (or the loader).
pub type Holder = u64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub state: SlotState,
    pub holder: Option<Holder>,
    pub gen: u64,
    pub len: u64,
    pub batch_id: u64,
}

/// Why a request about a slot was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("slot {slot} is out of range (pool has {slots} slots)")]
    OutOfRange { slot: u32, slots: u32 },
    #[error("slot {slot} is {state:?}, expected {expected:?}")]
    WrongState {
        slot: u32,
        state: SlotState,
        expected: SlotState,
    },
    #[error("slot {slot} is not held by this worker")]
    WrongOwner { slot: u32 },
    #[error("slot {slot}: stale generation {got} (current {current})")]
    StaleGen { slot: u32, got: u64, current: u64 },
    #[error("slot {slot}: length {len} exceeds the slot capacity {capacity}")]
    TooLong { slot: u32, len: u64, capacity: u64 },
    #[error("slot {slot}: committed with length 0 (an empty payload is not a batch)")]
    Empty { slot: u32 },
    #[error("slot {slot}: batch {got} acknowledged, but the slot holds batch {held}")]
    WrongBatch { slot: u32, got: u64, held: u64 },
}

/// A slot given to a holder: where, and under which generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub slot: u32,
    pub gen: u64,
    pub len: u64,
    pub batch_id: u64,
}

/// What [`SlotTable::release_holder`] did with a dead holder's slots.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Released {
    /// Batches it was reading: back to READY at the front of the queue.
    pub redelivered: Vec<u64>,
    /// Slots it was writing: back to FREE (their upstream batch is reissued by the caller).
    pub freed_writing: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct SlotTable {
    slots: Vec<Slot>,
    capacity: u64,
    /// READY slots in delivery order.
    ready: VecDeque<u32>,
}

impl SlotTable {
    pub fn new(slots: u32, capacity: u64) -> SlotTable {
        SlotTable {
            slots: (0..slots)
                .map(|_| Slot {
                    state: SlotState::Free,
                    holder: None,
                    gen: 0,
                    len: 0,
                    batch_id: 0,
                })
                .collect(),
            capacity,
            ready: VecDeque::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn slot(&self, i: u32) -> &Slot {
        &self.slots[i as usize]
    }

    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    pub fn count(&self, state: SlotState) -> usize {
        self.slots.iter().filter(|s| s.state == state).count()
    }

    /// Slots `holder` has in `state`.
    pub fn held(&self, holder: Holder, state: SlotState) -> usize {
        self.slots
            .iter()
            .filter(|s| s.holder == Some(holder) && s.state == state)
            .count()
    }

    /// FREE → WRITING for `holder`.
    pub fn lease(&mut self, holder: Holder) -> Option<Grant> {
        let i = self.slots.iter().position(|s| s.state == SlotState::Free)?;
        let s = &mut self.slots[i];
        s.state = SlotState::Writing;
        s.holder = Some(holder);
        s.gen += 1;
        s.len = 0;
        Some(Grant {
            slot: i as u32,
            gen: s.gen,
            len: 0,
            batch_id: 0,
        })
    }

    fn check(
        &self,
        holder: Holder,
        slot: u32,
        gen: u64,
        expected: SlotState,
    ) -> Result<(), Reject> {
        let s = self.slots.get(slot as usize).ok_or(Reject::OutOfRange {
            slot,
            slots: self.slots.len() as u32,
        })?;
        if s.gen != gen {
            return Err(Reject::StaleGen {
                slot,
                got: gen,
                current: s.gen,
            });
        }
        if s.state != expected {
            return Err(Reject::WrongState {
                slot,
                state: s.state,
                expected,
            });
        }
        if s.holder != Some(holder) {
            return Err(Reject::WrongOwner { slot });
        }
        Ok(())
    }

    /// Would [`commit`](Self::commit) accept this? (Checked before anything changes, so a
    /// message touching two pools is applied to both or to neither.)
    pub fn check_commit(
        &self,
        holder: Holder,
        slot: u32,
        gen: u64,
        len: u64,
    ) -> Result<(), Reject> {
        self.check(holder, slot, gen, SlotState::Writing)?;
        if len == 0 {
            return Err(Reject::Empty { slot });
        }
        if len > self.capacity {
            return Err(Reject::TooLong {
                slot,
                len,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// WRITING → READY: the payload of `batch_id` is complete.
    pub fn commit(
        &mut self,
        holder: Holder,
        slot: u32,
        gen: u64,
        len: u64,
        batch_id: u64,
    ) -> Result<(), Reject> {
        self.check_commit(holder, slot, gen, len)?;
        let s = &mut self.slots[slot as usize];
        s.state = SlotState::Ready;
        s.holder = None;
        s.len = len;
        s.batch_id = batch_id;
        self.ready.push_back(slot);
        Ok(())
    }

    /// WRITING → FREE without a payload (a lease handed back, or a duplicate dropped).
    pub fn cancel(&mut self, holder: Holder, slot: u32, gen: u64) -> Result<(), Reject> {
        self.check(holder, slot, gen, SlotState::Writing)?;
        let s = &mut self.slots[slot as usize];
        s.state = SlotState::Free;
        s.holder = None;
        s.gen += 1;
        Ok(())
    }

    /// The batch id the next [`deliver`](Self::deliver) would hand out.
    pub fn peek_ready(&self) -> Option<u64> {
        self.ready.front().map(|&i| self.slots[i as usize].batch_id)
    }

    /// READY → READING for `holder`, oldest (or redelivered) first.
    pub fn deliver(&mut self, holder: Holder) -> Option<Grant> {
        let i = self.ready.pop_front()?;
        Some(self.hand_out(i, holder))
    }

    /// A READY slot taken off the queue → READING for `holder`.
    fn hand_out(&mut self, i: u32, holder: Holder) -> Grant {
        let s = &mut self.slots[i as usize];
        debug_assert_eq!(s.state, SlotState::Ready);
        s.state = SlotState::Reading;
        s.holder = Some(holder);
        s.gen += 1;
        Grant {
            slot: i,
            gen: s.gen,
            len: s.len,
            batch_id: s.batch_id,
        }
    }

    /// The lowest batch id READY: what [`deliver_lowest`](Self::deliver_lowest) hands out.
    pub fn peek_lowest(&self) -> Option<u64> {
        self.ready
            .iter()
            .map(|&i| self.slots[i as usize].batch_id)
            .min()
    }

    /// READY → READING for `holder`, lowest batch id first. Batch ids count batches in the
    /// loader's order, and a redelivered batch is older than the rest, so this is the
    /// oldest-first order of [`deliver`](Self::deliver), and it also puts batches that a
    /// rollback sent through again back in their place.
    pub fn deliver_lowest(&mut self, holder: Holder) -> Option<Grant> {
        let pos =
            (0..self.ready.len()).min_by_key(|&p| self.slots[self.ready[p] as usize].batch_id)?;
        let i = self.ready.remove(pos).expect("in range");
        Some(self.hand_out(i, holder))
    }

    /// The lowest READY batch id for which `pick` holds.
    pub fn peek_lowest_where(&self, pick: impl Fn(u64) -> bool) -> Option<u64> {
        self.ready
            .iter()
            .map(|&i| self.slots[i as usize].batch_id)
            .filter(|&b| pick(b))
            .min()
    }

    /// READY → READING for `holder`, the slot holding `batch_id`.
    pub fn deliver_id(&mut self, holder: Holder, batch_id: u64) -> Option<Grant> {
        let pos = (0..self.ready.len())
            .find(|&p| self.slots[self.ready[p] as usize].batch_id == batch_id)?;
        let i = self.ready.remove(pos).expect("in range");
        Some(self.hand_out(i, holder))
    }

    /// READY slots whose batch `pick` chooses → FREE, undelivered; returns their batch
    /// ids (the others stay READY in their order).
    pub fn withdraw_ready_where(&mut self, pick: impl Fn(u64) -> bool) -> Vec<u64> {
        let mut out = Vec::new();
        let mut keep = VecDeque::with_capacity(self.ready.len());
        for i in std::mem::take(&mut self.ready) {
            let s = &mut self.slots[i as usize];
            if pick(s.batch_id) {
                s.state = SlotState::Free;
                s.holder = None;
                s.gen += 1;
                out.push(s.batch_id);
            } else {
                keep.push_back(i);
            }
        }
        self.ready = keep;
        out
    }

    /// Every READY slot → FREE, undelivered (a rollback recomputes them in order);
    /// returns their batch ids.
    pub fn withdraw_ready(&mut self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.ready.len());
        for i in std::mem::take(&mut self.ready) {
            let s = &mut self.slots[i as usize];
            s.state = SlotState::Free;
            s.holder = None;
            s.gen += 1;
            out.push(s.batch_id);
        }
        out
    }

    pub fn check_ack(
        &self,
        holder: Holder,
        slot: u32,
        gen: u64,
        batch_id: u64,
    ) -> Result<(), Reject> {
        self.check(holder, slot, gen, SlotState::Reading)?;
        let held = self.slots[slot as usize].batch_id;
        if held != batch_id {
            return Err(Reject::WrongBatch {
                slot,
                got: batch_id,
                held,
            });
        }
        Ok(())
    }

    /// READING → FREE: the batch was consumed.
    pub fn ack(
        &mut self,
        holder: Holder,
        slot: u32,
        gen: u64,
        batch_id: u64,
    ) -> Result<(), Reject> {
        self.check_ack(holder, slot, gen, batch_id)?;
        let s = &mut self.slots[slot as usize];
        s.state = SlotState::Free;
        s.holder = None;
        s.gen += 1;
        Ok(())
    }

    /// The holder is dead (its pidfd said so): take back everything it held.
    pub fn release_holder(&mut self, holder: Holder) -> Released {
        let mut out = Released::default();
        // Walk backwards so that pushing each to the front keeps slot order among them.
        for i in (0..self.slots.len()).rev() {
            let s = &mut self.slots[i];
            if s.holder != Some(holder) {
                continue;
            }
            s.holder = None;
            s.gen += 1;
            match s.state {
                SlotState::Reading => {
                    s.state = SlotState::Ready;
                    out.redelivered.push(s.batch_id);
                    self.ready.push_front(i as u32);
                }
                SlotState::Writing => {
                    s.state = SlotState::Free;
                    out.freed_writing.push(i as u32);
                }
                SlotState::Free | SlotState::Ready => {}
            }
        }
        out.redelivered.reverse();
        out
    }

    /// Batch ids held in the table (READY or READING), for audits.
    pub fn batches_held(&self) -> Vec<u64> {
        self.slots
            .iter()
            .filter(|s| matches!(s.state, SlotState::Ready | SlotState::Reading))
            .map(|s| s.batch_id)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn happy_path_and_generations() {
        let mut t = SlotTable::new(2, 100);
        let w = t.lease(7).unwrap();
        assert_eq!(
            t.commit(7, w.slot, w.gen, 0, 1),
            Err(Reject::Empty { slot: w.slot })
        );
        assert!(t
            .commit(7, w.slot, w.gen, 0, 1)
            .unwrap_err()
            .to_string()
            .contains("length 0"));
        assert_eq!(
            t.commit(7, w.slot, w.gen, 101, 1),
            Err(Reject::TooLong {
                slot: w.slot,
                len: 101,
                capacity: 100
            })
        );
        assert_eq!(
            t.commit(8, w.slot, w.gen, 10, 1),
            Err(Reject::WrongOwner { slot: w.slot })
        );
        assert!(matches!(
            t.commit(7, 5, w.gen, 10, 1),
            Err(Reject::OutOfRange { .. })
        ));
        t.commit(7, w.slot, w.gen, 10, 1).unwrap();
        let r = t.deliver(9).unwrap();
        assert_eq!((r.slot, r.len, r.batch_id), (w.slot, 10, 1));
        assert!(matches!(
            t.ack(9, r.slot, w.gen, 1),
            Err(Reject::StaleGen { .. })
        ));
        assert!(matches!(
            t.ack(9, r.slot, r.gen, 2),
            Err(Reject::WrongBatch { .. })
        ));
        t.ack(9, r.slot, r.gen, 1).unwrap();
        assert!(matches!(
            t.ack(9, r.slot, r.gen, 1),
            Err(Reject::StaleGen { .. })
        ));
        assert_eq!(t.count(SlotState::Free), 2);
    }

    #[test]
    fn dead_reader_batches_are_redelivered_first() {
        let mut t = SlotTable::new(3, 10);
        for b in 0..3 {
            let w = t.lease(1).unwrap();
            t.commit(1, w.slot, w.gen, 1, b).unwrap();
        }
        let a = t.deliver(2).unwrap();
        assert_eq!(a.batch_id, 0);
        let rel = t.release_holder(2);
        assert_eq!(rel.redelivered, vec![0]);
        assert_eq!(t.peek_ready(), Some(0));
        // The dead holder's old grant is now stale.
        assert!(matches!(
            t.ack(2, a.slot, a.gen, 0),
            Err(Reject::StaleGen { .. })
        ));
    }
}
