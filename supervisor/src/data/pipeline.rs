//! The data plane as the supervisor sees it: two slot pools in shared memory (token
//! batches, hidden-state batches), their state machines, the loader thread, credits, and
//! the ledger. The dispatcher owns the one [`Pipeline`] and calls it on every event, so
//! slot state changes are as serialised as everything else the supervisor decides.
//!
//! Credits: each consumer holds up to `prefetch` deliveries and each target up to
//! `prefetch` output leases, granted ahead, so a worker finishing a batch finds the next
//! one (and a place to write its output) already waiting: no round trip per batch.
//!
//! Deaths: when a worker is gone (pidfd) and its control channel drained, [`release`]
//! puts the batches it was reading back at the front of their queue (generation bumped, so
//! anything it might still have said about them is stale) and frees the slots it was
//! writing; the token batch behind a half-written hidden batch is one it was reading, so it
//! is reissued by the same rule.
//!
//! Each batch has one record ([`BatchRecord`], in [`Batches`]) saying where it is in its
//! life; the slot tables say which slot holds what. The pipeline changes both together
//! and sends nothing itself: [`pump`] returns what to tell the workers as [`Action`]s,
//! which the dispatcher sends.
//!
//! [`release`]: Pipeline::release
//! [`pump`]: Pipeline::pump

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::thread;

use dflash_shared::batch::{is_eval_batch, CaptureSpec, TokenBatch};
use dflash_shared::pool::{PoolGeometry, PoolMap};
use dflash_shared::protocol::{PoolId, PoolInfo, SlotRef, ToWorker};
use dflash_shared::slots::{Grant, Holder, SlotState, SlotTable};
use dflash_shared::{Role, WorkerName};
use serde_json::json;

use crate::data::batches::{BatchRecord, BatchState, Batches};
use crate::data::ledger::Ledger;
use crate::data::loader::{BadLines, Position};
use crate::error::Error;
use crate::telemetry::queue_health::{PoolView, QueueHealth};
use crate::violation::{Side, Violation};

/// The loader thread's holder id (worker lives start at 1).
const LOADER: Holder = 0;
/// Token slots the loader may fill ahead.
const LOADER_AHEAD: usize = 2;

/// A loader that failed, or what the pipeline's records refused of a loader event or a
/// rollback (bad input, or a bug): ends the run.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The loader stopped before the end of the data.
    #[error(transparent)]
    LoaderFailed(LoaderFailure),
    /// The loader committed a token slot its table does not let it commit.
    #[error("loader: {source}")]
    Loader {
        source: dflash_shared::slots::Reject,
    },
    /// A rolled-back batch that cannot go through the pipeline again.
    #[error("rollback to step {to}: {source}")]
    Rollback {
        to: u64,
        source: crate::data::batches::BatchError,
    },
}

/// Consumed batch ids as a checkpoint's meta.json records them: every id below
/// `consumed_below`, and the others listed.
pub fn consumed_json(mut ids: Vec<u64>) -> serde_json::Value {
    ids.sort_unstable();
    ids.dedup();
    let below = ids
        .iter()
        .enumerate()
        .take_while(|(i, id)| *i as u64 == **id)
        .count();
    json!({"consumed_below": below, "consumed_extra": ids[below..].to_vec()})
}

#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub token_slots: u32,
    pub hidden_slots: u32,
    pub prefetch: usize,
    pub token_budget: u32,
    pub capture: CaptureSpec,
}

impl PipelineConfig {
    pub fn geometries(&self) -> (PoolGeometry, PoolGeometry) {
        let budget = self.token_budget as u64;
        let tokens = PoolGeometry {
            name: "tokens".into(),
            slots: self.token_slots,
            slot_bytes: 24 + budget * 9,
        };
        let hidden = PoolGeometry {
            name: "hidden".into(),
            slots: self.hidden_slots,
            slot_bytes: self.capture.max_batch_bytes(budget),
        };
        (tokens, hidden)
    }

    /// Bytes of shared memory the pools take.
    pub fn total_bytes(&self) -> u64 {
        let (t, h) = self.geometries();
        t.total_bytes() + h.total_bytes()
    }

    /// Refuse pools (plus `extra` bytes of other shared memory) that do not fit: better
    /// a clear error now than an OOM kill later.
    pub fn check_memory(&self, extra: u64) -> Result<(), Error> {
        let need = self.total_bytes() + extra;
        let Some(avail) = mem_available() else {
            return Ok(());
        };
        if need > avail / 10 * 8 {
            let (t, h) = self.geometries();
            return Err(Error::Flag(format!(
                "shared-memory pools need {} ({} token slots × {}, {} hidden-state slots × {}) but only {} is available; \
                 expected at most 80% of it: lower --token-budget or --hidden-slots",
                human(need),
                t.slots,
                human(t.slot_bytes),
                h.slots,
                human(h.slot_bytes),
                human(avail)
            )));
        }
        Ok(())
    }
}

/// The kernel's estimate of memory available without swapping (`MemAvailable`).
pub(crate) fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The newest READY training batch of `table` (what an eval round withdraws first).
fn newest_ready_training(table: &SlotTable) -> Option<u64> {
    table
        .slots()
        .iter()
        .filter(|s| s.state == SlotState::Ready && !is_eval_batch(s.batch_id))
        .map(|s| s.batch_id)
        .max()
}

/// From the loader thread.
pub enum LoaderEvent {
    Produced {
        slot: u32,
        gen: u64,
        len: u64,
        batch_id: u64,
        rows: usize,
        tokens: u64,
        lengths: Vec<u32>,
        seq_len: u32,
        batch: Box<TokenBatch>,
        /// Bad dataset lines skipped so far.
        bad_lines: u64,
        /// Batches of the first epoch, once it has been read.
        first_epoch_batches: Option<u64>,
    },
    Done {
        position: Position,
        bad: BadLines,
        first_epoch_batches: Option<u64>,
    },
    Failed(LoaderFailure),
}

/// Why the loader thread stopped before the end of the data.
#[derive(Debug, thiserror::Error)]
pub enum LoaderFailure {
    /// The data cannot be read, or has too many bad lines.
    #[error(transparent)]
    Data(#[from] crate::data::loader::LoaderError),
    /// A made batch larger than a token slot.
    #[error("batch {batch_id} does not fit a token slot: {source}")]
    SlotTooSmall {
        batch_id: u64,
        source: dflash_shared::batch::BatchError,
    },
    /// The loader (or the tokenizer under it) panicked: where it was, and the panic's
    /// message.
    #[error("the data loader failed while making batch {batches} (epoch {epoch}): {what} (a bug in the loader or in the tokenizer on this data; please report it)")]
    Panicked {
        batches: u64,
        epoch: u32,
        what: String,
    },
}

/// A connected worker that may be given work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub name: WorkerName,
    pub holder: Holder,
    pub pid: u32,
}

/// A message the pipeline decided on, for the dispatcher to send to worker life `to`.
/// The slot's header is published before the action is returned (sync points, pool edges
/// 2 to 4), so the worker finds it complete when the message arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// A READY batch is now the worker's to read (`ToWorker::Deliver`).
    Deliver {
        to: Holder,
        slot: SlotRef,
        len: u64,
        batch_id: u64,
    },
    /// A free hidden-state slot a target may write its next output into
    /// (`ToWorker::Lease`).
    Lease { to: Holder, slot: SlotRef },
}

impl Action {
    /// The worker life the message is for.
    pub fn to(&self) -> Holder {
        match *self {
            Action::Deliver { to, .. } | Action::Lease { to, .. } => to,
        }
    }

    /// The message itself.
    pub fn message(&self) -> ToWorker {
        match *self {
            Action::Deliver {
                slot,
                len,
                batch_id,
                ..
            } => ToWorker::Deliver {
                slot,
                len,
                batch_id,
            },
            Action::Lease { slot, .. } => ToWorker::Lease { slot },
        }
    }
}

struct Pool {
    id: PoolId,
    fd: OwnedFd,
    map: Arc<PoolMap>,
    table: SlotTable,
}

impl Pool {
    fn new(id: PoolId, geometry: PoolGeometry) -> Result<Pool, Error> {
        let name = geometry.name.clone();
        let slots = geometry.slots;
        let bytes = geometry.slot_bytes;
        let (fd, map) = PoolMap::create(geometry).map_err(|e| Error::SharedMemory {
            pool: name,
            source: e.into(),
        })?;
        Ok(Pool {
            id,
            fd,
            map: Arc::new(map),
            table: SlotTable::new(slots, bytes),
        })
    }

    /// Mirror the table's view of `slot` into the shared header.
    fn publish(&self, slot: u32, pid: u32) {
        let s = self.table.slot(slot);
        self.map
            .publish(slot, s.state, pid, s.gen, s.len, s.batch_id);
    }

    fn publish_all(&self) {
        for i in 0..self.table.len() as u32 {
            self.publish(i, 0);
        }
    }

    fn fref(&self, g: &Grant) -> SlotRef {
        SlotRef {
            pool: self.id,
            slot: g.slot,
            gen: g.gen,
        }
    }
}

pub struct Pipeline {
    tokens: Pool,
    hidden: Pool,
    capture: CaptureSpec,
    prefetch: usize,
    loader_tx: Option<Sender<Grant>>,
    loader_done: Option<Position>,
    /// Bad dataset lines the loader skipped so far.
    bad_lines: u64,
    /// Batches of the first epoch, once the loader has read it.
    first_epoch_batches: Option<u64>,
    produced: u64,
    /// Every batch produced (or eval batch queued) and where it is.
    batches: Batches,
    /// Consumed by the run this one resumes.
    consumed_before: HashSet<u64>,
    /// Batches given to each worker life, to balance load.
    served: HashMap<Holder, u64>,
    /// Queue health of the current metrics window.
    pub health: QueueHealth,
    ledger: Ledger,
    failed: Option<String>,
    /// The eval round whose batches are in the pipeline (training traffic pauses while
    /// it runs: see [`crate::training::eval`]).
    eval_round: Option<u64>,
}

impl Pipeline {
    pub fn new(cfg: &PipelineConfig, run_dir: &Path) -> Result<Pipeline, Error> {
        let (tg, hg) = cfg.geometries();
        let ledger = Ledger::create(run_dir)
            .map_err(|e| Error::io("cannot create the ledger in", run_dir, e))?;
        Ok(Pipeline {
            tokens: Pool::new(PoolId::Tokens, tg)?,
            hidden: Pool::new(PoolId::Hidden, hg)?,
            capture: cfg.capture.clone(),
            prefetch: cfg.prefetch.max(1),
            loader_tx: None,
            loader_done: None,
            bad_lines: 0,
            first_epoch_batches: None,
            produced: 0,
            batches: Batches::default(),
            consumed_before: HashSet::new(),
            served: HashMap::new(),
            health: QueueHealth::default(),
            ledger,
            failed: None,
            eval_round: None,
        })
    }

    /// Eval round `round` starts: its `batches` go in ahead of any training batch, and
    /// training traffic pauses until [`end_eval`](Self::end_eval).
    pub fn start_eval(&mut self, round: u64, batches: Vec<TokenBatch>) {
        self.eval_round = Some(round);
        self.forget_queued_eval();
        for b in batches {
            let id = b.batch_id;
            let record = BatchRecord {
                state: BatchState::Queued,
                tokens: 0,
                batch: Some(b),
            };
            self.batches.insert(id, record);
        }
    }

    /// Eval batches not written into a token slot yet: forgotten.
    fn forget_queued_eval(&mut self) {
        for b in self.batches.queued(true) {
            self.batches.remove(b);
        }
    }

    /// The eval round is over (complete or dropped): training traffic resumes; what is
    /// left of the round's batches is dropped as it comes by.
    pub fn end_eval(&mut self) {
        self.eval_round = None;
        self.forget_queued_eval();
        self.drop_stale_eval();
    }

    /// Eval batches of a round that is over, READY in either pool: freed. Those with
    /// hidden states made stay known (`EvalOver`), the others are forgotten.
    fn drop_stale_eval(&mut self) {
        for pool in [&mut self.tokens, &mut self.hidden] {
            let dropped = pool.table.withdraw_ready_where(is_eval_batch);
            if dropped.is_empty() {
                continue;
            }
            pool.publish_all();
            for b in dropped {
                if pool.id == PoolId::Tokens {
                    self.batches.remove(b);
                } else {
                    let _ = self.batches.set(b, BatchState::EvalOver);
                }
            }
        }
    }

    /// A drafter scored eval batch `batch_id` (forward only): free its slot.
    pub fn on_evaluated(
        &mut self,
        peer: &Peer,
        input: SlotRef,
        batch_id: u64,
    ) -> Result<(), Violation> {
        if !is_eval_batch(batch_id) {
            return Err(Violation::NotAnEvalBatch { batch_id });
        }
        self.check_consume(peer.name, peer.holder, input, batch_id)?;
        self.hidden
            .table
            .ack(peer.holder, input.slot, input.gen, batch_id)
            .map_err(Violation::slot(None))?;
        self.hidden.publish(input.slot, 0);
        let _ = self.batches.set(batch_id, BatchState::EvalOver);
        self.ledger
            .record("evaluated", batch_id, &peer.name.to_string(), json!({}));
        Ok(())
    }

    /// Write the eval round's batches into free token slots; where none is free, READY
    /// training token batches make room (they go through again after the round), and
    /// where the hidden-state pool is full with no target writing, READY training hidden
    /// batches do: nothing can take those before the round ends.
    fn eval_batches(&mut self, targets: &[&Peer]) {
        let queued = self.batches.next_queued(true).is_some();
        if queued && self.tokens.table.count(SlotState::Free) == 0 {
            // One at a time, the newest: as little as possible goes through again.
            let newest = newest_ready_training(&self.tokens.table);
            let back = self
                .tokens
                .table
                .withdraw_ready_where(|b| Some(b) == newest);
            self.tokens.publish_all();
            self.send_again(&back, "tokens");
        }
        while let Some(id) = self.batches.next_queued(true) {
            let Some(g) = self.tokens.table.lease(LOADER) else {
                break;
            };
            // SAFETY: the slot was just leased to LOADER (WRITING): no worker reads it.
            let buf = unsafe { self.tokens.map.payload_mut(g.slot) };
            let b = self.batches.get(id).and_then(|r| r.batch.as_ref());
            let b = b.expect("a queued eval batch keeps its tokens");
            let (rows, tokens) = (b.rows(), b.tokens());
            match b.encode_into(buf) {
                Ok(len) => {
                    self.tokens
                        .table
                        .commit(LOADER, g.slot, g.gen, len as u64, id)
                        .expect("leased just now");
                    self.tokens.publish(g.slot, std::process::id());
                    let _ = self.batches.set(id, BatchState::Tokens { again: false });
                    self.batches.forget_tokens(id);
                    self.ledger.record(
                        "eval_load",
                        id,
                        "supervisor",
                        json!({"rows": rows, "tokens": tokens}),
                    );
                }
                Err(e) => {
                    let _ = self.tokens.table.cancel(LOADER, g.slot, g.gen);
                    self.batches.remove(id);
                    self.failed = Some(format!(
                        "eval batch of {tokens} tokens does not fit a token slot: {e}"
                    ));
                    return;
                }
            }
        }
        let writing = targets
            .iter()
            .any(|p| self.hidden.table.held(p.holder, SlotState::Writing) > 0);
        if self.hidden.table.count(SlotState::Free) == 0 && !writing {
            let newest = newest_ready_training(&self.hidden.table);
            let back = self
                .hidden
                .table
                .withdraw_ready_where(|b| Some(b) == newest);
            self.hidden.publish_all();
            self.send_again(&back, "hidden");
        }
    }

    /// Training batches withdrawn from `pool` to make room for an eval round: they go
    /// through the targets again after it, in their order.
    fn send_again(&mut self, batches: &[u64], pool: &str) {
        for &b in batches {
            self.ledger.record(
                "withdrawn",
                b,
                "supervisor",
                json!({"pool": pool, "why": "eval"}),
            );
            // Queued batches are written back lowest id first (see `replay_batches`).
            if self.batches.requeue(b).is_err() {
                self.batches.remove(b);
                self.failed = Some(format!(
                    "batch {b}, set aside for an eval round, was not kept: it cannot be trained"
                ));
            }
        }
    }

    /// Pool fds every worker inherits.
    pub fn inherit_fds(&self) -> Vec<RawFd> {
        vec![self.tokens.fd.as_raw_fd(), self.hidden.fd.as_raw_fd()]
    }

    pub fn pools_message(&self) -> ToWorker {
        let info = |p: &Pool| PoolInfo {
            id: p.id,
            fd: p.fd.as_raw_fd(),
            geometry: p.map.geometry().clone(),
        };
        ToWorker::Pools {
            pools: vec![info(&self.tokens), info(&self.hidden)],
            capture: self.capture.clone(),
        }
    }

    pub fn describe(&self) -> String {
        let g = |p: &Pool| format!("{} × {}", p.table.len(), human(p.map.geometry().slot_bytes));
        format!(
            "pools: tokens {}, hidden states {}",
            g(&self.tokens),
            g(&self.hidden)
        )
    }

    /// Run `loader` on a thread of its own: it fills the token slots it is granted.
    pub fn start_loader<E: From<LoaderEvent> + Send + 'static>(
        &mut self,
        loader: impl Into<crate::data::share::Source>,
        events: Sender<E>,
    ) -> Result<(), Error> {
        let mut loader = loader.into();
        let (tx, rx) = mpsc::channel::<Grant>();
        let map = self.tokens.map.clone();
        // Tests make the loader panic at its Nth batch, to see the run end on it.
        let panic_at: Option<u64> = std::env::var("DFLASH_TEST_LOADER_PANIC")
            .ok()
            .and_then(|v| v.parse().ok());
        thread::Builder::new()
            .name("loader".into())
            .spawn(move || {
                for (made, grant) in rx.into_iter().enumerate() {
                    // A panic while reading or tokenizing (a bug here or in a tokenizer or
                    // chat template meeting a line it cannot handle) ends the run with one
                    // line saying where, instead of leaving it waiting for a loader that
                    // is gone.
                    let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        if panic_at == Some(made as u64) {
                            panic!("test fault: the loader panics at batch {made}");
                        }
                        loader.next_batch()
                    }));
                    let next = match next {
                        Ok(r) => r,
                        Err(p) => {
                            let what = p
                                .downcast_ref::<String>()
                                .map(String::as_str)
                                .or_else(|| p.downcast_ref::<&str>().copied())
                                .unwrap_or("a panic");
                            let at = loader.position();
                            let ev = LoaderEvent::Failed(LoaderFailure::Panicked {
                                batches: at.batches,
                                epoch: at.epoch,
                                what: what.to_string(),
                            });
                            let _ = events.send(E::from(ev));
                            break;
                        }
                    };
                    let ev = match next {
                        Ok(Some(b)) => {
                            // SAFETY: the loader holds this slot (WRITING, granted to LOADER)
                            // until it reports it produced.
                            let buf = unsafe { map.payload_mut(grant.slot) };
                            match b.encode_into(buf) {
                                Ok(len) => LoaderEvent::Produced {
                                    slot: grant.slot,
                                    gen: grant.gen,
                                    len: len as u64,
                                    batch_id: b.batch_id,
                                    rows: b.rows(),
                                    tokens: b.tokens(),
                                    lengths: b.lengths.clone(),
                                    seq_len: b.seq_len,
                                    batch: Box::new(b),
                                    bad_lines: loader.bad().total,
                                    first_epoch_batches: loader.first_epoch_batches(),
                                },
                                Err(source) => LoaderEvent::Failed(LoaderFailure::SlotTooSmall {
                                    batch_id: b.batch_id,
                                    source,
                                }),
                            }
                        }
                        Ok(None) => LoaderEvent::Done {
                            position: loader.position(),
                            bad: loader.bad().clone(),
                            first_epoch_batches: loader.first_epoch_batches(),
                        },
                        Err(e) => LoaderEvent::Failed(e.into()),
                    };
                    let last = !matches!(ev, LoaderEvent::Produced { .. });
                    // sync point (pool edge 1): the token slot's bytes written above reach
                    // the dispatcher thread, and through its Deliver a target, only because
                    // this send follows the last write.
                    if events.send(E::from(ev)).is_err() || last {
                        break;
                    }
                }
            })
            .map_err(|e| Error::start("loader thread", e))?;
        self.loader_tx = Some(tx);
        Ok(())
    }

    /// A loader event; `Err` is bad input that ends the run.
    pub fn on_loader(&mut self, ev: LoaderEvent) -> Result<(), PipelineError> {
        match ev {
            LoaderEvent::Produced {
                slot,
                gen,
                len,
                batch_id,
                rows,
                tokens,
                lengths,
                seq_len,
                batch,
                bad_lines,
                first_epoch_batches,
            } => {
                self.bad_lines = bad_lines;
                self.first_epoch_batches = self.first_epoch_batches.or(first_epoch_batches);
                self.health.batch(&lengths, seq_len);
                self.tokens
                    .table
                    .commit(LOADER, slot, gen, len, batch_id)
                    .map_err(|source| PipelineError::Loader { source })?;
                self.tokens.publish(slot, std::process::id());
                // Its tokens are kept until no rollback can need them again.
                let record = BatchRecord {
                    state: BatchState::Tokens { again: false },
                    tokens,
                    batch: Some(*batch),
                };
                self.batches.insert(batch_id, record);
                self.produced += 1;
                self.ledger.record(
                    "load",
                    batch_id,
                    "loader",
                    json!({"rows": rows, "tokens": tokens}),
                );
                Ok(())
            }
            LoaderEvent::Done {
                position,
                bad,
                first_epoch_batches,
            } => {
                self.first_epoch_batches = self.first_epoch_batches.or(first_epoch_batches);
                self.loader_tx = None;
                self.loader_done = Some(position);
                self.bad_lines = bad.total;
                // Hand back the slots it held for batches that will never come.
                for i in 0..self.tokens.table.len() as u32 {
                    let s = self.tokens.table.slot(i).clone();
                    if s.holder == Some(LOADER) && s.state == SlotState::Writing {
                        let _ = self.tokens.table.cancel(LOADER, i, s.gen);
                        self.tokens.publish(i, 0);
                    }
                }
                let lines = if bad.lines > 0 {
                    format!("; {}", bad.summary())
                } else {
                    String::new()
                };
                log::info!(
                    "loader done: {} batches over {} epoch(s){lines}",
                    position.batches,
                    position.epoch
                );
                Ok(())
            }
            LoaderEvent::Failed(failure) => {
                self.loader_tx = None;
                Err(PipelineError::LoaderFailed(failure))
            }
        }
    }

    /// How many batches the first epoch was cut into, once the loader has read it.
    pub fn first_epoch_batches(&self) -> Option<u64> {
        self.first_epoch_batches
    }

    /// The loader has made every batch it will (the data's end, or the run's).
    pub fn loader_done(&self) -> bool {
        self.loader_done.is_some()
    }

    /// Every batch the loader will ever make has been consumed.
    pub fn finished(&self) -> bool {
        self.loader_done.is_some() && self.batches.trained() == self.produced
    }

    /// Which batches reached the optimizer, compactly: every id below `below`, plus
    /// `extra`. Goes into checkpoints so a resumed run skips exactly those.
    pub fn consumed_summary(&self) -> serde_json::Value {
        let trained = self
            .batches
            .iter()
            .filter(|(_, r)| matches!(r.state, BatchState::Trained { .. }));
        consumed_json(
            trained
                .map(|(b, _)| b)
                .chain(self.consumed_before.iter().copied())
                .collect(),
        )
    }

    /// Batches a previous run consumed (resuming): kept for the next checkpoint.
    pub fn set_consumed_before(&mut self, ids: std::collections::HashSet<u64>) {
        self.consumed_before = ids;
    }

    /// Once the loader is done: how many batches are not consumed yet.
    pub fn remaining(&self) -> Option<u64> {
        self.loader_done
            .map(|_| self.produced - self.batches.trained())
    }

    /// Bad dataset lines the loader skipped so far.
    /// Hidden-state batches delivered to `holder` and not yet consumed.
    pub fn delivered_to(&self, holder: Holder) -> u64 {
        self.hidden
            .table
            .held(holder, dflash_shared::slots::SlotState::Reading) as u64
    }

    pub fn bad_lines(&self) -> u64 {
        self.bad_lines
    }

    pub fn progress(&self) -> (u64, u64) {
        (self.batches.trained(), self.produced)
    }

    /// A target finished a batch: its output is complete and its input consumed.
    pub fn on_commit(
        &mut self,
        peer: &Peer,
        output: SlotRef,
        len: u64,
        batch_id: u64,
        input: Option<SlotRef>,
    ) -> Result<(), Violation> {
        if peer.name.role != Role::Target {
            return Err(Violation::DrafterCommitted);
        }
        let input = input.ok_or(Violation::NoInputSlot)?;
        if output.pool != PoolId::Hidden || input.pool != PoolId::Tokens {
            return Err(Violation::WrongPools {
                output: output.pool,
                input: input.pool,
            });
        }
        // Check both before changing either: they change together.
        self.tokens
            .table
            .check_ack(peer.holder, input.slot, input.gen, batch_id)
            .map_err(Violation::slot(Some(Side::Input)))?;
        self.hidden
            .table
            .check_commit(peer.holder, output.slot, output.gen, len)
            .map_err(Violation::slot(Some(Side::Output)))?;
        self.tokens
            .table
            .ack(peer.holder, input.slot, input.gen, batch_id)
            .expect("checked");
        self.tokens.publish(input.slot, 0);
        let name = peer.name.to_string();
        let state = self.batches.state(batch_id);
        if state.is_some_and(BatchState::hidden_made) {
            self.hidden
                .table
                .cancel(peer.holder, output.slot, output.gen)
                .expect("checked");
            self.hidden.publish(output.slot, 0);
            self.ledger
                .record("duplicate", batch_id, &name, json!({"pool": "hidden"}));
            return Ok(());
        }
        self.hidden
            .table
            .commit(peer.holder, output.slot, output.gen, len, batch_id)
            .expect("checked");
        if state.is_none() {
            // Not a batch the pipeline put in a token slot (it cannot happen): known from
            // now on, so that a second commit of it is seen as a duplicate.
            let record = BatchRecord {
                state: BatchState::Hidden,
                tokens: 0,
                batch: None,
            };
            self.batches.insert(batch_id, record);
        }
        let _ = self.batches.set(batch_id, BatchState::Hidden);
        let tokens = self.batches.get(batch_id).map_or(0, |r| r.tokens);
        self.health.tokens(&name, tokens);
        self.hidden.publish(output.slot, 0);
        self.ledger
            .record("hidden", batch_id, &name, json!({"bytes": len}));
        Ok(())
    }

    /// A drafter consumed a batch.
    pub fn on_ack(&mut self, peer: &Peer, input: SlotRef, batch_id: u64) -> Result<(), Violation> {
        self.check_consume(peer.name, peer.holder, input, batch_id)?;
        self.consume(peer.name, peer.holder, input, batch_id, None)
    }

    /// Would [`consume`](Self::consume) accept this?
    pub fn check_consume(
        &self,
        name: WorkerName,
        holder: Holder,
        input: SlotRef,
        batch_id: u64,
    ) -> Result<(), Violation> {
        if name.role != Role::Drafter || input.pool != PoolId::Hidden {
            return Err(Violation::NotAConsumer {
                pool: input.pool,
                role: name.role,
            });
        }
        self.hidden
            .table
            .check_ack(holder, input.slot, input.gen, batch_id)
            .map_err(Violation::slot(None))
    }

    /// `batch_id`, delivered to `holder`, reached the optimizer (in committed step `step`):
    /// free its slot.
    pub fn consume(
        &mut self,
        name: WorkerName,
        holder: Holder,
        input: SlotRef,
        batch_id: u64,
        step: Option<u64>,
    ) -> Result<(), Violation> {
        self.hidden
            .table
            .ack(holder, input.slot, input.gen, batch_id)
            .map_err(Violation::slot(None))?;
        self.hidden.publish(input.slot, 0);
        let name = name.to_string();
        let record = self.batches.get(batch_id);
        let trained = record.is_some_and(|r| matches!(r.state, BatchState::Trained { .. }));
        if !trained {
            // Eval batches carry no token count: they are not counted here.
            if let Some(r) = record.filter(|_| !is_eval_batch(batch_id)) {
                self.health.tokens(&name, r.tokens);
            }
            if record.is_none() {
                // Not a batch the pipeline sent (it cannot happen): counted all the same.
                let record = BatchRecord {
                    state: BatchState::Hidden,
                    tokens: 0,
                    batch: None,
                };
                self.batches.insert(batch_id, record);
            }
            let _ = self.batches.set(batch_id, BatchState::Trained { step });
            match step {
                Some(s) => {
                    self.ledger
                        .record("consumed", batch_id, &name, json!({"step": s}));
                }
                None => {
                    self.batches.forget_tokens(batch_id);
                    self.ledger.record("consumed", batch_id, &name, json!({}));
                }
            }
        } else {
            self.ledger
                .record("duplicate", batch_id, &name, json!({"pool": "consumed"}));
        }
        Ok(())
    }

    /// The drafter group rolled back from step `from` to `to`: `batches` (committed after
    /// `to`, in commit order) were consumed in an abandoned lineage. They go through the
    /// pipeline again, ahead of anything the loader makes from now on.
    pub fn rollback(&mut self, from: u64, to: u64, batches: &[u64]) -> Result<(), PipelineError> {
        self.ledger.rollback(Some(from), to, batches);
        // Hidden states made of newer batches and not delivered yet are made again after
        // the rolled-back ones, so that the group trains on everything in batch order.
        // (Eval batches are not training batches: the eval round ends with the rollback.)
        let recalled = self
            .hidden
            .table
            .withdraw_ready_where(|b| !is_eval_batch(b));
        self.hidden.publish_all();
        for &b in &recalled {
            self.ledger.record(
                "requeue",
                b,
                "supervisor",
                json!({"pool": "hidden", "why": "rollback"}),
            );
        }
        let mut again: Vec<u64> = batches.iter().chain(&recalled).copied().collect();
        again.sort_unstable();
        again.dedup();
        for b in again {
            // Queued batches are written back lowest id first (see `replay_batches`).
            self.batches
                .requeue(b)
                .map_err(|source| PipelineError::Rollback { to, source })?;
        }
        Ok(())
    }

    /// Batches consumed at or before `step` are out of any rollback's reach.
    pub fn covered(&mut self, step: u64) {
        for b in self.batches.uncovered_upto(step) {
            let _ = self.batches.set(b, BatchState::Trained { step: None });
            self.batches.forget_tokens(b);
        }
    }

    /// Write batches sent through again into free token slots, lowest batch id first,
    /// READY before anything the loader commits later.
    fn replay_batches(&mut self) {
        while let Some(id) = self.batches.next_queued(false) {
            let Some(g) = self.tokens.table.lease(LOADER) else {
                return;
            };
            // SAFETY: the slot was just leased to LOADER (WRITING): no worker reads it.
            let buf = unsafe { self.tokens.map.payload_mut(g.slot) };
            let b = self.batches.get(id).and_then(|r| r.batch.as_ref());
            let b = b.expect("a queued training batch keeps its tokens");
            let (rows, tokens) = (b.rows(), b.tokens());
            // Written on the dispatcher thread itself; it reaches a target through the
            // Deliver that `deliver` returns later (sync point, pool edge 2).
            match b.encode_into(buf) {
                Ok(len) => {
                    self.tokens
                        .table
                        .commit(LOADER, g.slot, g.gen, len as u64, id)
                        .expect("leased just now");
                    self.tokens.publish(g.slot, std::process::id());
                    let _ = self.batches.set(id, BatchState::Tokens { again: true });
                    self.ledger.record(
                        "replay",
                        id,
                        "supervisor",
                        json!({"rows": rows, "tokens": tokens}),
                    );
                }
                Err(e) => {
                    // It fitted the first time and the slot size has not changed: this
                    // cannot happen, but if it did the batch could not be trained again.
                    let _ = self.tokens.table.cancel(LOADER, g.slot, g.gen);
                    self.batches.remove(id);
                    self.failed = Some(format!(
                        "batch {id} sent through again no longer fits a token slot: {e}"
                    ));
                    return;
                }
            }
        }
    }

    /// Resuming from the checkpoint of `step`: what the previous run consumed after it is
    /// an abandoned lineage.
    pub fn record_resume(&mut self, step: u64) {
        self.ledger.rollback(None, step, &[]);
    }

    /// Why no more batches may be taken: the ledger cannot be written, or a batch could
    /// not be sent through again.
    pub fn ledger_failed(&self) -> Option<String> {
        if let Some(e) = &self.failed {
            return Some(e.clone());
        }
        self.ledger.failed().map(|e| {
            format!(
                "{e}: the run stops taking batches, since it cannot record them ({}, then --resume)",
                ledger_remedy(e)
            )
        })
    }

    /// A worker life is over (pidfd said so, channel drained): take back its slots.
    /// Returns how many batches went back to their queue.
    pub fn release(&mut self, name: WorkerName, holder: Holder) -> usize {
        let mut requeued = 0;
        let who = name.to_string();
        for pool in [&mut self.tokens, &mut self.hidden] {
            let r = pool.table.release_holder(holder);
            for &b in &r.redelivered {
                let p = if pool.id == PoolId::Tokens {
                    "tokens"
                } else {
                    "hidden"
                };
                if let Some(state) = self.batches.state(b) {
                    let _ = self.batches.set(b, state.back_to_ready());
                }
                self.ledger.record("requeue", b, &who, json!({"pool": p}));
            }
            requeued += r.redelivered.len();
            pool.publish_all();
        }
        self.served.remove(&holder);
        requeued
    }

    /// Grant whatever can be granted: token slots to the loader, token batches and output
    /// leases to targets, hidden-state batches to drafters. Returns the messages to send,
    /// in order.
    pub fn pump(&mut self, peers: &[Peer]) -> Vec<Action> {
        let mut out = Vec::new();
        if self.ledger.failed().is_some() {
            return out;
        }
        let targets: Vec<&Peer> = peers
            .iter()
            .filter(|p| p.name.role == Role::Target)
            .collect();
        let eval = self.eval_round.is_some();
        if eval {
            // Training traffic pauses while an eval round runs: no new token batches.
            self.eval_batches(&targets);
        } else {
            self.drop_stale_eval();
            self.replay_batches();
        }
        if let (Some(tx), false) = (&self.loader_tx, eval) {
            while self.tokens.table.held(LOADER, SlotState::Writing) < LOADER_AHEAD {
                let Some(g) = self.tokens.table.lease(LOADER) else {
                    break;
                };
                self.tokens.publish(g.slot, std::process::id());
                if tx.send(g).is_err() {
                    break;
                }
            }
        }
        let drafters: Vec<&Peer> = peers
            .iter()
            .filter(|p| p.name.role == Role::Drafter)
            .collect();
        self.observe_health(&targets, &drafters);
        self.deliver(PoolId::Tokens, &targets, &mut out);
        // Output leases for targets.
        while let Some(p) = targets
            .iter()
            .filter(|p| self.hidden.table.held(p.holder, SlotState::Writing) < self.prefetch)
            .min_by_key(|p| self.hidden.table.held(p.holder, SlotState::Writing))
        {
            let Some(g) = self.hidden.table.lease(p.holder) else {
                break;
            };
            self.hidden.publish(g.slot, p.pid);
            // sync point (pool edges 2 and 4): the header is published before the lease is
            // sent, and the slot's previous reader acknowledged it (its last read) before
            // the slot was free to lease: the target writes after both.
            out.push(Action::Lease {
                to: p.holder,
                slot: self.hidden.fref(&g),
            });
        }
        self.deliver(PoolId::Hidden, &drafters, &mut out);
        out
    }

    fn observe_health(&mut self, targets: &[&Peer], drafters: &[&Peer]) {
        let (t, h, k) = (&self.tokens.table, &self.hidden.table, self.prefetch);
        let free = |tb: &SlotTable| tb.count(SlotState::Free) > 0;
        let ready = |tb: &SlotTable| tb.count(SlotState::Ready);
        let tokens = PoolView {
            ready: ready(t),
            slots: t.len(),
            producer_blocked: self.loader_tx.is_some()
                && t.held(LOADER, SlotState::Writing) < LOADER_AHEAD
                && !free(t),
            consumer_starved: ready(t) == 0
                && targets
                    .iter()
                    .any(|p| t.held(p.holder, SlotState::Reading) < k),
        };
        let hidden = PoolView {
            ready: ready(h),
            slots: h.len(),
            producer_blocked: !free(h)
                && targets
                    .iter()
                    .any(|p| h.held(p.holder, SlotState::Writing) < k),
            consumer_starved: ready(h) == 0
                && drafters
                    .iter()
                    .any(|p| h.held(p.holder, SlotState::Reading) < k),
        };
        self.health.observe(tokens, hidden);
    }

    /// Hand READY batches of `pool` to the least-loaded consumers with credit left.
    /// While an eval round runs, only its batches move (with credits of their own: a
    /// consumer's training credits may be held by batches it cannot take before the round
    /// ends); otherwise only training batches.
    fn deliver(&mut self, pool: PoolId, consumers: &[&Peer], out: &mut Vec<Action>) {
        let eval = self.eval_round.is_some();
        // Whether hidden states can still be made without the READY hidden slots: a free
        // slot lets a target start one, and a target writing one while it reads a token
        // batch will hand it in. (A target holding a lease with nothing to read does
        // not count: waiting on it stalls everything.) Delivering changes neither.
        let hidden = &self.hidden.table;
        let free = hidden.count(SlotState::Free) > 0;
        let making = hidden.slots().iter().any(|s| {
            s.state == SlotState::Writing
                && s.holder
                    .is_some_and(|h| self.tokens.table.held(h, SlotState::Reading) > 0)
        });
        loop {
            let p = match pool {
                PoolId::Tokens => &mut self.tokens,
                PoolId::Hidden => &mut self.hidden,
            };
            let Some(next) = p.table.peek_lowest_where(|b| is_eval_batch(b) == eval) else {
                return;
            };
            // After a rollback, drafters get the batches sent through again before any
            // newer one, so the group sees them in their order; unless that would stall
            // the targets (no hidden-state slot left to make them in, see `making`).
            if pool == PoolId::Hidden
                && !eval
                && self.batches.first_again().is_some_and(|m| next > m)
                && (free || making)
            {
                return;
            }
            let served = &self.served;
            let held = |h: Holder| {
                p.table
                    .slots()
                    .iter()
                    .filter(|s| {
                        s.state == SlotState::Reading
                            && s.holder == Some(h)
                            && is_eval_batch(s.batch_id) == eval
                    })
                    .count()
            };
            let Some(peer) = consumers
                .iter()
                .filter(|c| held(c.holder) < self.prefetch)
                .min_by_key(|c| (held(c.holder), served.get(&c.holder).copied().unwrap_or(0)))
            else {
                return;
            };
            let g = p
                .table
                .deliver_id(peer.holder, next)
                .expect("a batch is ready");
            p.publish(g.slot, peer.pid);
            let slot = p.fref(&g);
            // sync point (pool edges 2 and 3): the payload was complete before its writer's
            // Commit (or the loader's Produced) reached us, and the header is published
            // above; the consumer reads both only after receiving this message.
            out.push(Action::Deliver {
                to: peer.holder,
                slot,
                len: g.len,
                batch_id: g.batch_id,
            });
            let holder = peer.holder;
            let state = match (pool, self.batches.state(g.batch_id)) {
                (PoolId::Tokens, Some(BatchState::Tokens { again })) => {
                    BatchState::AtTarget { holder, again }
                }
                (PoolId::Tokens, _) => BatchState::AtTarget {
                    holder,
                    again: false,
                },
                (PoolId::Hidden, _) => BatchState::AtDrafter { holder },
            };
            let _ = self.batches.set(g.batch_id, state);
            *self.served.entry(peer.holder).or_default() += 1;
            self.health.served(&peer.name.to_string());
            let ev = if pool == PoolId::Tokens {
                "to_target"
            } else {
                "to_drafter"
            };
            self.ledger
                .record(ev, g.batch_id, &peer.name.to_string(), json!({}));
        }
    }

    /// The session is over: record what is still held; `finished`: the run reached its
    /// end (nothing will train what is held).
    pub fn end(&mut self, finished: bool) {
        let mut held = self.tokens.table.batches_held();
        held.extend(self.hidden.table.batches_held());
        // Sent through again and waiting for a token slot: in the pipeline too.
        held.extend(self.batches.queued(false));
        held.sort_unstable();
        held.dedup();
        // Batches leaving the token pool into a half-written hidden slot are READING
        // until committed, so `held` is everything produced and not consumed.
        let pos = self
            .loader_done
            .map(|p| json!({"epoch": p.epoch, "batches": p.batches}));
        self.ledger.end(
            &held,
            self.loader_done.is_some(),
            finished,
            json!({"loader_position": pos, "produced": self.produced}),
        );
    }
}

/// What lets the ledger be written again, from its failure's words. The ledger keeps its
/// failure as text, which ends in the OS's "(os error N)": a read-only filesystem (EROFS)
/// is said to be one, not asked for free space.
fn ledger_remedy(failure: &str) -> &'static str {
    let os_error = failure
        .rsplit_once("(os error ")
        .and_then(|(_, n)| n.strip_suffix(')')?.parse::<i32>().ok());
    match os_error {
        Some(libc::EROFS) => "its filesystem is read-only: remount it read-write",
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => "free space (df -h, df -i)",
        Some(libc::EACCES) | Some(libc::EPERM) => "make it writable (permissions)",
        Some(libc::EIO) => "its disk reports I/O errors: check it",
        _ => "make it writable again",
    }
}

#[cfg(test)]
mod tests;
