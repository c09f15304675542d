//! The pipeline without processes: the test plays the loader thread, the targets and the
//! drafters, and carries the pipeline's actions to them itself.

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::sync::mpsc::{self, Receiver};

use dflash_shared::batch::{eval_batch_id, CaptureSpec, TokenBatch, DTYPE_BF16};
use dflash_shared::protocol::{PoolId, SlotRef, ToWorker};
use dflash_shared::slots::{Grant, Holder, SlotState};
use dflash_shared::{Role, WorkerName};
use proptest::prelude::*;
use tempfile::TempDir;

use super::{Action, LoaderEvent, Peer, Pipeline, PipelineConfig};
use crate::data::batches::BatchState;
use crate::data::ledger::{audit, LEDGER_FILE};
use crate::data::loader::{BadLines, Position};

fn config(token_slots: u32, hidden_slots: u32, prefetch: usize) -> PipelineConfig {
    PipelineConfig {
        token_slots,
        hidden_slots,
        prefetch,
        token_budget: 16,
        capture: CaptureSpec {
            tap_ids: vec![0],
            hidden: 4,
            dtype: DTYPE_BF16,
            target: 1,
        },
    }
}

fn batch(batch_id: u64) -> TokenBatch {
    TokenBatch {
        batch_id,
        seq_len: 4,
        lengths: vec![3],
        input_ids: vec![5, 6, 7, 0],
        loss_mask: vec![1, 1, 1, 0],
    }
}

/// One worker the test plays: its current life, and what it was told and not done yet.
struct Sim {
    name: WorkerName,
    life: Holder,
    inbox: VecDeque<(SlotRef, u64)>,
    leases: VecDeque<SlotRef>,
}

/// A pipeline with simulated workers (indexes below `targets` are targets, the rest
/// drafters) and the drafter group's lineage: `(step, batch)` per trained batch.
struct Harness {
    p: Pipeline,
    dir: TempDir,
    grants: Receiver<Grant>,
    made: u64,
    total: u64,
    sims: Vec<Sim>,
    next_life: Holder,
    lineage: Vec<(u64, u64)>,
    step: u64,
    covered: u64,
    round: u64,
    evaluating: bool,
}

impl Harness {
    fn new(cfg: &PipelineConfig, targets: u32, drafters: u32, total: u64) -> Harness {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut p = Pipeline::new(cfg, dir.path()).expect("pipeline");
        let (tx, grants) = mpsc::channel();
        p.loader_tx = Some(tx);
        let names = (0..targets)
            .map(|rank| (Role::Target, rank))
            .chain((0..drafters).map(|rank| (Role::Drafter, rank)));
        let sims = names
            .enumerate()
            .map(|(i, (role, rank))| Sim {
                name: WorkerName { role, rank },
                life: i as Holder + 1,
                inbox: VecDeque::new(),
                leases: VecDeque::new(),
            })
            .collect::<Vec<_>>();
        let next_life = sims.len() as Holder + 1;
        Harness {
            p,
            dir,
            grants,
            made: 0,
            total,
            sims,
            next_life,
            lineage: Vec::new(),
            step: 0,
            covered: 0,
            round: 0,
            evaluating: false,
        }
    }

    fn peer(&self, i: usize) -> Peer {
        let s = &self.sims[i];
        Peer {
            name: s.name,
            holder: s.life,
            pid: 1000 + i as u32,
        }
    }

    /// Pump, and carry every action to the worker life it names.
    fn pump(&mut self) -> Vec<Action> {
        let peers: Vec<Peer> = (0..self.sims.len()).map(|i| self.peer(i)).collect();
        let actions = self.p.pump(&peers);
        for a in &actions {
            let sim = self.sims.iter_mut().find(|s| s.life == a.to());
            let sim = sim.expect("an action for a worker life that was not given");
            match *a {
                Action::Deliver { slot, batch_id, .. } => sim.inbox.push_back((slot, batch_id)),
                Action::Lease { slot, .. } => sim.leases.push_back(slot),
            }
        }
        actions
    }

    /// Play the loader thread for one grant, if one is waiting.
    fn load(&mut self) -> bool {
        let Ok(g) = self.grants.try_recv() else {
            return false;
        };
        let ev = if self.made == self.total {
            LoaderEvent::Done {
                position: Position {
                    epoch: 1,
                    batches: self.total,
                },
                bad: BadLines::default(),
                first_epoch_batches: Some(self.total),
            }
        } else {
            let b = batch(self.made);
            self.made += 1;
            // SAFETY: the slot is leased to the loader, whose part the test plays.
            let buf = unsafe { self.p.tokens.map.payload_mut(g.slot) };
            let len = b.encode_into(buf).expect("fits") as u64;
            LoaderEvent::Produced {
                slot: g.slot,
                gen: g.gen,
                len,
                batch_id: b.batch_id,
                rows: b.rows(),
                tokens: b.tokens(),
                lengths: b.lengths.clone(),
                seq_len: b.seq_len,
                batch: Box::new(b),
                bad_lines: 0,
                first_epoch_batches: None,
            }
        };
        let done = matches!(ev, LoaderEvent::Done { .. });
        self.p.on_loader(ev).expect("loader event");
        if done {
            // The loader thread ends here: grants still on their way find nobody.
            while self.grants.try_recv().is_ok() {}
        }
        true
    }

    /// Target `i` turns its oldest delivered token batch into hidden states.
    fn target(&mut self, i: usize) -> bool {
        let s = &mut self.sims[i];
        if s.inbox.is_empty() || s.leases.is_empty() {
            return false;
        }
        let (input, batch_id) = s.inbox.pop_front().expect("checked");
        let output = s.leases.pop_front().expect("checked");
        let peer = self.peer(i);
        let r = self.p.on_commit(&peer, output, 1, batch_id, Some(input));
        r.expect("a commit of what was delivered and leased");
        true
    }

    /// Drafter `i` trains on (or scores) its oldest delivered batch, one step per batch.
    fn drafter(&mut self, i: usize) -> bool {
        let Some((input, batch_id)) = self.sims[i].inbox.pop_front() else {
            return false;
        };
        let peer = self.peer(i);
        if dflash_shared::batch::is_eval_batch(batch_id) {
            self.p.on_evaluated(&peer, input, batch_id).expect("scored");
            return true;
        }
        self.step += 1;
        let r = self
            .p
            .consume(peer.name, peer.holder, input, batch_id, Some(self.step));
        r.expect("a consumption of what was delivered");
        self.lineage.push((self.step, batch_id));
        true
    }

    /// Worker `i` dies; it comes back as a new life that holds nothing.
    fn kill(&mut self, i: usize) {
        let peer = self.peer(i);
        self.p.release(peer.name, peer.holder);
        let s = &mut self.sims[i];
        s.life = self.next_life;
        self.next_life += 1;
        s.inbox.clear();
        s.leases.clear();
    }

    /// The drafter group rolls back `back` steps (not past what a snapshot covers).
    fn rollback(&mut self, back: u64) {
        let to = self.step.saturating_sub(back).max(self.covered);
        if self.evaluating {
            self.eval_end();
        }
        let abandoned: Vec<u64> = self
            .lineage
            .iter()
            .filter(|(s, _)| *s > to)
            .map(|&(_, b)| b)
            .collect();
        self.lineage.retain(|(s, _)| *s <= to);
        self.p
            .rollback(self.step, to, &abandoned)
            .expect("rollback");
        self.step = to;
    }

    fn cover(&mut self) {
        self.covered = self.step;
        self.p.covered(self.step);
    }

    fn eval_start(&mut self) {
        if self.evaluating {
            return;
        }
        self.round += 1;
        let batches = (0..2)
            .map(|i| batch(eval_batch_id(self.round, i)))
            .collect();
        self.p.start_eval(self.round, batches);
        self.evaluating = true;
    }

    fn eval_end(&mut self) {
        self.p.end_eval();
        self.evaluating = false;
    }

    /// Run every worker until the loader is done and every batch trained.
    fn drain(&mut self) {
        if self.evaluating {
            self.eval_end();
        }
        for _ in 0..10_000 {
            if self.p.finished() {
                return;
            }
            self.pump();
            while self.load() {}
            for i in 0..self.sims.len() {
                let work = match self.sims[i].name.role {
                    Role::Target => Harness::target,
                    Role::Drafter => Harness::drafter,
                };
                while work(self, i) {}
            }
        }
        let records: Vec<_> = self.p.batches.iter().map(|(b, r)| (b, r.state)).collect();
        panic!(
            "the pipeline stalled: {:?}\nrecords {records:?}\ntokens {:?}\nhidden {:?}\nfirst again {:?}",
            self.p.progress(),
            self.p.tokens.table.slots(),
            self.p.hidden.table.slots(),
            self.p.batches.first_again(),
        );
    }

    fn ledger(&self) -> crate::data::ledger::Audit {
        audit(&self.dir.path().join(LEDGER_FILE)).expect("ledger")
    }
}

/// An invariant of [`check`] that does not hold, with what shows it.
#[derive(Debug, thiserror::Error)]
enum Broken {
    #[error(transparent)]
    Indexes(#[from] crate::data::batches::IndexDrift),
    #[error("{pool} slot {slot:?}: record {record:?}")]
    Slot {
        pool: PoolId,
        slot: dflash_shared::slots::Slot,
        record: Option<BatchState>,
    },
    #[error("batch {batch} is {state:?} but in no slot")]
    Unplaced { batch: u64, state: BatchState },
    #[error("batch {batch}: a rollback may need it, but it was dropped")]
    Dropped { batch: u64 },
    #[error("batch {batch} was lost")]
    Lost { batch: u64 },
    #[error("a batch trained twice: {lineage:?}")]
    TrainedTwice { lineage: Vec<(u64, u64)> },
    #[error("lineage {lineage:?}, trained records {trained:?}")]
    Lineage {
        lineage: BTreeSet<u64>,
        trained: BTreeSet<u64>,
    },
}

/// The invariants that hold between any two events.
fn check(h: &Harness) -> Result<(), Broken> {
    let p = &h.p;
    p.batches.check_indexes()?;
    // Each batch in a slot is in one slot only, and its record says so.
    let mut in_slot = HashSet::new();
    for (pool, table) in [
        (PoolId::Tokens, &p.tokens.table),
        (PoolId::Hidden, &p.hidden.table),
    ] {
        for s in table.slots() {
            if matches!(s.state, SlotState::Free | SlotState::Writing) {
                continue;
            }
            let state = p.batches.state(s.batch_id);
            let ok = match (pool, s.state, state) {
                (PoolId::Tokens, SlotState::Ready, Some(BatchState::Tokens { .. })) => true,
                (PoolId::Tokens, SlotState::Reading, Some(BatchState::AtTarget { holder, .. })) => {
                    s.holder == Some(holder)
                }
                (PoolId::Hidden, SlotState::Ready, Some(BatchState::Hidden)) => true,
                (PoolId::Hidden, SlotState::Reading, Some(BatchState::AtDrafter { holder })) => {
                    s.holder == Some(holder)
                }
                _ => false,
            };
            if !ok || !in_slot.insert(s.batch_id) {
                return Err(Broken::Slot {
                    pool,
                    slot: s.clone(),
                    record: state,
                });
            }
        }
    }
    let mut trained = BTreeSet::new();
    for (b, r) in p.batches.iter() {
        let placed = matches!(
            r.state,
            BatchState::Tokens { .. }
                | BatchState::AtTarget { .. }
                | BatchState::Hidden
                | BatchState::AtDrafter { .. }
        );
        if placed && !in_slot.contains(&b) {
            return Err(Broken::Unplaced {
                batch: b,
                state: r.state,
            });
        }
        if let BatchState::Trained { step } = r.state {
            trained.insert(b);
            if step.is_some() && r.batch.is_none() {
                return Err(Broken::Dropped { batch: b });
            }
        }
    }
    // Every batch the loader made is known, and the lineage has each at most once: those
    // its records say are trained.
    if let Some(b) = (0..h.made).find(|&b| p.batches.get(b).is_none()) {
        return Err(Broken::Lost { batch: b });
    }
    let lineage: BTreeSet<u64> = h.lineage.iter().map(|&(_, b)| b).collect();
    if lineage.len() != h.lineage.len() {
        return Err(Broken::TrainedTwice {
            lineage: h.lineage.clone(),
        });
    }
    if lineage != trained {
        return Err(Broken::Lineage { lineage, trained });
    }
    Ok(())
}

fn one_of_each(total: u64) -> Harness {
    Harness::new(&config(3, 3, 1), 1, 1, total)
}

#[test]
fn pump_returns_the_deliveries_and_leases_and_sends_nothing() {
    let mut h = one_of_each(1);
    let target = h.sims[0].life;
    let first = h.pump();
    let [Action::Lease { to, slot: lease }] = first[..] else {
        panic!("only an output lease before the loader made a batch: {first:?}");
    };
    assert_eq!((to, lease.pool), (target, PoolId::Hidden));
    let sent = first[0].message();
    assert!(
        matches!(sent, ToWorker::Lease { slot: s } if s == lease),
        "{sent:?}"
    );
    assert!(h.load());
    let actions = h.pump();
    let [Action::Deliver {
        to,
        slot,
        len,
        batch_id,
    }] = actions[..]
    else {
        panic!("expected one delivery: {actions:?}");
    };
    assert_eq!((to, batch_id, slot.pool), (target, 0, PoolId::Tokens));
    assert_eq!(len, batch(0).encoded_len() as u64);
    let sent = actions[0].message();
    assert!(
        matches!(sent, ToWorker::Deliver { slot: s, len: l, batch_id: 0 } if s == slot && l == len),
        "{sent:?}"
    );
    assert_eq!(
        h.p.batches.state(0),
        Some(BatchState::AtTarget {
            holder: target,
            again: false
        })
    );
    check(&h).unwrap();
}

#[test]
fn a_batch_goes_through_each_state_in_turn() {
    let mut h = one_of_each(1);
    h.pump();
    h.load();
    assert_eq!(
        h.p.batches.state(0),
        Some(BatchState::Tokens { again: false })
    );
    h.pump();
    assert!(h.target(0));
    assert_eq!(h.p.batches.state(0), Some(BatchState::Hidden));
    h.pump();
    let drafter = h.sims[1].life;
    assert_eq!(
        h.p.batches.state(0),
        Some(BatchState::AtDrafter { holder: drafter })
    );
    assert!(h.drafter(1));
    assert_eq!(
        h.p.batches.state(0),
        Some(BatchState::Trained { step: Some(1) })
    );
    assert!(
        h.p.batches.get(0).unwrap().batch.is_some(),
        "kept for a rollback"
    );
    h.cover();
    assert_eq!(
        h.p.batches.state(0),
        Some(BatchState::Trained { step: None })
    );
    assert!(
        h.p.batches.get(0).unwrap().batch.is_none(),
        "no rollback can need it"
    );
    check(&h).unwrap();
    h.drain();
    assert_eq!(h.p.progress(), (1, 1));
    assert_eq!(h.p.remaining(), Some(0));
}

#[test]
fn a_dead_workers_batches_go_back_and_its_messages_are_stale() {
    let mut h = Harness::new(&config(3, 3, 1), 2, 1, 2);
    h.pump();
    h.load();
    h.load();
    h.pump();
    let (input, b) = *h.sims[0].inbox.front().expect("delivered");
    let output = *h.sims[0].leases.front().expect("leased");
    let dead = h.peer(0);
    h.kill(0);
    assert_eq!(
        h.p.batches.state(b),
        Some(BatchState::Tokens { again: false })
    );
    check(&h).unwrap();
    let late = h.p.on_commit(&dead, output, 1, b, Some(input));
    assert!(late.is_err(), "a dead life's commit is stale");
    h.pump();
    check(&h).unwrap();
    h.drain();
    check(&h).unwrap();
    assert_eq!(h.ledger().requeued, 1);
}

#[test]
fn a_drafter_commit_and_a_target_ack_are_refused() {
    let mut h = one_of_each(1);
    h.pump();
    h.load();
    h.pump();
    let (input, b) = *h.sims[0].inbox.front().unwrap();
    let drafter = h.peer(1);
    assert!(h.p.on_commit(&drafter, input, 1, b, Some(input)).is_err());
    let target = h.peer(0);
    assert!(h.p.on_ack(&target, input, b).is_err());
    assert!(
        h.p.on_evaluated(&drafter, input, b).is_err(),
        "a training batch"
    );
    check(&h).unwrap();
}

#[test]
fn a_rollback_sends_batches_through_again_lowest_first() {
    let mut h = Harness::new(&config(4, 4, 1), 1, 1, 3);
    for _ in 0..8 {
        h.pump();
        h.load();
        h.target(0);
        h.drafter(1);
    }
    assert_eq!(h.p.progress().0, 3);
    h.rollback(2);
    assert_eq!(h.p.progress().0, 1, "two batches are untrained again");
    assert_eq!(h.p.batches.state(1), Some(BatchState::Queued));
    assert_eq!(h.p.batches.state(2), Some(BatchState::Queued));
    assert_eq!(h.p.batches.first_again(), Some(1));
    h.pump();
    assert_eq!(
        h.p.batches.state(2),
        Some(BatchState::Tokens { again: true })
    );
    check(&h).unwrap();
    h.drain();
    check(&h).unwrap();
    let order: Vec<u64> = h.lineage.iter().map(|&(_, b)| b).collect();
    assert_eq!(order, vec![0, 1, 2]);
    let a = h.ledger();
    assert_eq!((a.rollbacks, a.abandoned), (1, 2));
}

#[test]
fn a_rollback_past_what_was_covered_fails() {
    let mut h = one_of_each(1);
    h.drain();
    h.cover();
    let e = h.p.rollback(1, 0, &[0]).unwrap_err().to_string();
    assert!(e.contains("was not kept"), "{e}");
}

#[test]
fn an_ack_outside_a_step_drops_the_batch_at_once() {
    let mut h = one_of_each(1);
    for _ in 0..3 {
        h.pump();
        h.load();
        h.target(0);
    }
    let (input, b) = h.sims[1].inbox.pop_front().expect("delivered");
    let drafter = h.peer(1);
    h.p.on_ack(&drafter, input, b).unwrap();
    assert_eq!(
        h.p.batches.state(b),
        Some(BatchState::Trained { step: None })
    );
    assert!(h.p.batches.get(b).unwrap().batch.is_none());
    assert!(
        h.p.on_ack(&drafter, input, b).is_err(),
        "the slot is free now"
    );
}

#[test]
fn an_eval_round_makes_room_and_training_resumes_after_it() {
    // Two token slots, both READY with training batches: the round must make room.
    let mut h = Harness::new(&config(2, 2, 1), 1, 1, 2);
    h.pump();
    h.load();
    h.load();
    h.eval_start();
    h.pump();
    assert_eq!(
        h.p.batches.state(1),
        Some(BatchState::Queued),
        "the newest set aside"
    );
    let e = eval_batch_id(1, 0);
    let delivered: Vec<u64> = h.sims[0].inbox.iter().map(|d| d.1).collect();
    assert_eq!(delivered, vec![e], "training traffic pauses");
    assert_eq!(
        h.p.batches.state(0),
        Some(BatchState::Tokens { again: false })
    );
    for _ in 0..6 {
        h.target(0);
        h.drafter(1);
        h.pump();
    }
    assert_eq!(h.p.batches.state(e), Some(BatchState::EvalOver));
    assert_eq!(
        h.p.progress().0,
        0,
        "no training batch moved during the round"
    );
    check(&h).unwrap();
    h.drain();
    check(&h).unwrap();
    let order: Vec<u64> = h.lineage.iter().map(|&(_, b)| b).collect();
    assert_eq!(order, vec![0, 1]);
}

/// One event of the property test.
#[derive(Debug, Clone)]
enum Op {
    Pump,
    Load,
    Target(usize),
    Drafter(usize),
    Kill(usize),
    Rollback(u64),
    Cover,
    EvalStart,
    EvalEnd,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Pump),
        3 => Just(Op::Load),
        4 => (0..2usize).prop_map(Op::Target),
        4 => (0..2usize).prop_map(Op::Drafter),
        1 => (0..4usize).prop_map(Op::Kill),
        1 => (1..4u64).prop_map(Op::Rollback),
        1 => Just(Op::Cover),
        1 => Just(Op::EvalStart),
        1 => Just(Op::EvalEnd),
    ]
}

impl Harness {
    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Pump => {
                self.pump();
            }
            Op::Load => {
                self.load();
            }
            Op::Target(i) => {
                self.target(i);
            }
            Op::Drafter(i) => {
                self.drafter(2 + i);
            }
            Op::Kill(i) => self.kill(i),
            Op::Rollback(back) => self.rollback(back),
            Op::Cover => self.cover(),
            Op::EvalStart => self.eval_start(),
            Op::EvalEnd => {
                if self.evaluating {
                    self.eval_end();
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Under any interleaving of deliveries, commits, deaths, requeues (eval rounds) and
    /// rollbacks, every batch is trained exactly once in the surviving lineage.
    #[test]
    fn every_batch_is_trained_once_in_the_lineage(
        ops in prop::collection::vec(op(), 1..120),
        (token_slots, hidden_slots, prefetch) in (2u32..5, 2u32..5, 1usize..3),
        total in 1u64..10,
    ) {
        let cfg = config(token_slots, hidden_slots, prefetch);
        let mut h = Harness::new(&cfg, 2, 2, total);
        for op in &ops {
            h.apply(op);
            check(&h).map_err(|e| TestCaseError::fail(format!("after {op:?}: {e}")))?;
        }
        h.drain();
        check(&h).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut trained: Vec<u64> = h.lineage.iter().map(|&(_, b)| b).collect();
        trained.sort_unstable();
        prop_assert_eq!(trained, (0..total).collect::<Vec<_>>());
        h.p.end(false);
        let a = h.ledger();
        prop_assert_eq!((a.produced, a.consumed_once), (total, total));
        prop_assert_eq!((a.duplicated, a.lost, a.in_flight), (0, 0, 0));
    }
}

#[test]
fn a_ledger_that_cannot_be_written_says_what_lets_it_be_written_again() {
    // The OS's reason decides: a read-only filesystem is named so, not asked for space.
    let failure = |errno| {
        format!(
            "cannot append to {LEDGER_FILE}: {}",
            std::io::Error::from_raw_os_error(errno)
        )
    };
    assert_eq!(
        super::ledger_remedy(&failure(libc::EROFS)),
        "its filesystem is read-only: remount it read-write"
    );
    assert_eq!(
        super::ledger_remedy(&failure(libc::ENOSPC)),
        "free space (df -h, df -i)"
    );
    assert_eq!(
        super::ledger_remedy("no OS error"),
        "make it writable again"
    );
    // A pipeline whose ledger is /dev/full (every write fails with ENOSPC).
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink("/dev/full", dir.path().join(LEDGER_FILE)).unwrap();
    let mut p = Pipeline::new(&config(4, 4, 2), dir.path()).expect("pipeline");
    assert!(p.ledger_failed().is_none());
    p.record_resume(0);
    let line = p.ledger_failed().expect("the append failed");
    assert!(
        line.contains("No space left on device")
            && line.ends_with("(free space (df -h, df -i), then --resume)"),
        "{line}"
    );
}
