//! Any interleaving of loads, leases, commits, deliveries, acks, deaths and garbage
//! requests keeps every batch in exactly one place, and draining the pipeline afterwards
//! consumes every batch exactly once.

use std::collections::HashMap;

use dflash_shared::slots::{Holder, SlotState, SlotTable};
use proptest::prelude::*;

const LOADER: Holder = 100;
const TARGETS: [Holder; 2] = [1, 2];
const DRAFTERS: [Holder; 2] = [3, 4];

#[derive(Debug, Clone)]
enum Op {
    Load,
    TargetTake(usize),
    TargetLease(usize),
    TargetFinish(usize),
    DrafterTake(usize),
    DrafterFinish(usize),
    Kill(usize),
    Garbage { kind: u8, slot: u32, hidden: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Load),
        3 => (0..2usize).prop_map(Op::TargetTake),
        3 => (0..2usize).prop_map(Op::TargetLease),
        3 => (0..2usize).prop_map(Op::TargetFinish),
        3 => (0..2usize).prop_map(Op::DrafterTake),
        3 => (0..2usize).prop_map(Op::DrafterFinish),
        1 => (0..4usize).prop_map(Op::Kill),
        2 => (0..3u8, 0..3u32, any::<bool>()).prop_map(|(kind, slot, hidden)| Op::Garbage { kind, slot, hidden }),
    ]
}

struct Pipeline {
    tokens: SlotTable,
    hidden: SlotTable,
    next_batch: u64,
    consumed: HashMap<u64, u32>,
    /// Holder ids are per life: a killed worker comes back with a new one.
    targets: [Holder; 2],
    drafters: [Holder; 2],
    next_holder: Holder,
}

impl Pipeline {
    fn new() -> Pipeline {
        Pipeline {
            tokens: SlotTable::new(3, 64),
            hidden: SlotTable::new(3, 64),
            next_batch: 0,
            consumed: HashMap::new(),
            targets: TARGETS,
            drafters: DRAFTERS,
            next_holder: 10,
        }
    }

    fn first(t: &SlotTable, h: Holder, st: SlotState) -> Option<(u32, u64, u64)> {
        t.slots()
            .iter()
            .enumerate()
            .find(|(_, s)| s.holder == Some(h) && s.state == st)
            .map(|(i, s)| (i as u32, s.gen, s.batch_id))
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Load => {
                if let Some(g) = self.tokens.lease(LOADER) {
                    self.tokens
                        .commit(LOADER, g.slot, g.gen, 8, self.next_batch)
                        .unwrap();
                    self.next_batch += 1;
                }
            }
            Op::TargetTake(i) => {
                if self.tokens.held(self.targets[i], SlotState::Reading) < 2 {
                    self.tokens.deliver(self.targets[i]);
                }
            }
            Op::TargetLease(i) => {
                if self.hidden.held(self.targets[i], SlotState::Writing) < 2 {
                    self.hidden.lease(self.targets[i]);
                }
            }
            Op::TargetFinish(i) => {
                let h = self.targets[i];
                let (Some((ts, tg, batch)), Some((hs, hg, _))) = (
                    Self::first(&self.tokens, h, SlotState::Reading),
                    Self::first(&self.hidden, h, SlotState::Writing),
                ) else {
                    return;
                };
                // Both checks before either change: the commit is atomic across pools.
                self.tokens.check_ack(h, ts, tg, batch).unwrap();
                self.hidden.check_commit(h, hs, hg, 8).unwrap();
                self.tokens.ack(h, ts, tg, batch).unwrap();
                self.hidden.commit(h, hs, hg, 8, batch).unwrap();
            }
            Op::DrafterTake(i) => {
                if self.hidden.held(self.drafters[i], SlotState::Reading) < 2 {
                    self.hidden.deliver(self.drafters[i]);
                }
            }
            Op::DrafterFinish(i) => {
                let h = self.drafters[i];
                if let Some((s, g, batch)) = Self::first(&self.hidden, h, SlotState::Reading) {
                    self.hidden.ack(h, s, g, batch).unwrap();
                    *self.consumed.entry(batch).or_default() += 1;
                }
            }
            Op::Kill(i) => {
                let slot = if i < 2 {
                    &mut self.targets[i]
                } else {
                    &mut self.drafters[i - 2]
                };
                let dead = *slot;
                *slot = self.next_holder;
                self.next_holder += 1;
                self.tokens.release_holder(dead);
                self.hidden.release_holder(dead);
            }
            Op::Garbage { kind, slot, hidden } => {
                let before = (self.tokens.slots().to_vec(), self.hidden.slots().to_vec());
                let t = if hidden {
                    &mut self.hidden
                } else {
                    &mut self.tokens
                };
                let s = t.slot(slot).clone();
                // Requests that must be refused: from someone who does not hold the slot,
                // with a stale generation, or for a slot that does not exist.
                let (h, slot, gen) = match kind {
                    0 => (999, slot, s.gen),
                    1 => (s.holder.unwrap_or(999), slot, s.gen.wrapping_sub(1)),
                    _ => (s.holder.unwrap_or(999), slot + 10, s.gen),
                };
                assert!(t.ack(h, slot, gen, s.batch_id).is_err());
                assert!(t.commit(h, slot, gen, 8, 0).is_err());
                assert!(t.cancel(h, slot, gen).is_err());
                assert_eq!(
                    before,
                    (self.tokens.slots().to_vec(), self.hidden.slots().to_vec())
                );
            }
        }
    }

    /// Every batch produced so far is in exactly one place.
    fn check(&self) {
        let mut place: HashMap<u64, u32> = HashMap::new();
        for b in self
            .tokens
            .batches_held()
            .into_iter()
            .chain(self.hidden.batches_held())
        {
            *place.entry(b).or_default() += 1;
        }
        for (&b, &n) in &self.consumed {
            assert_eq!(n, 1, "batch {b} consumed {n} times");
            *place.entry(b).or_default() += 1;
        }
        for b in 0..self.next_batch {
            assert_eq!(
                place.get(&b).copied().unwrap_or(0),
                1,
                "batch {b} is in {:?} places",
                place.get(&b)
            );
        }
        assert_eq!(
            place.len() as u64,
            self.next_batch,
            "unknown batch ids appeared"
        );
    }

    fn drain(&mut self) {
        for _ in 0..1000 {
            for i in 0..2 {
                for op in [
                    Op::TargetTake(i),
                    Op::TargetLease(i),
                    Op::TargetFinish(i),
                    Op::DrafterTake(i),
                    Op::DrafterFinish(i),
                ] {
                    self.apply(&op);
                }
            }
            if self.consumed.len() as u64 == self.next_batch {
                return;
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn every_batch_in_exactly_one_place(ops in prop::collection::vec(op(), 1..200)) {
        let mut p = Pipeline::new();
        for op in &ops {
            p.apply(op);
            p.check();
        }
        p.drain();
        p.check();
        prop_assert_eq!(p.consumed.len() as u64, p.next_batch, "drained pipeline left batches behind");
    }
}
