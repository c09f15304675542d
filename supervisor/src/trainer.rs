//! The data-parallel drafter group, coordinated by the supervisor.
//!
//! Each drafter rank computes the gradient of one batch into its slot of a shared
//! gradient pool and reports it ([`FromWorker::Grads`]). When every member has reported
//! step s, the step is *committed*: the batches behind it are recorded as consumed (the
//! supervisor acknowledges them on the ranks' behalf, so a batch is consumed exactly when
//! its gradient is part of a committed step), and every member is told to apply the
//! average of the listed slots. A member that dies before the commit is left out and its
//! batch goes back to the queue; the step commits over the others.
//!
//! A drafter that (re)joins after step 0 gets the current weights and optimizer state
//! from a surviving member through a shared state slot; commits wait while it joins, so it
//! joins exactly at the step it was given. If no member survives, the weights are gone:
//! the run stops rather than carry on with fresh ones.
//!
//! [`FromWorker::Grads`]: dflash_shared::protocol::FromWorker::Grads

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Instant;

use dflash_shared::drafter::{lr_at, state_bytes, DrafterConfig, Init, ParamLayout, StepStats, TrainSetup};
use dflash_shared::pool::{PoolGeometry, PoolMap};
use dflash_shared::protocol::{PoolId, PoolInfo, SlotRef, ToWorker};
use dflash_shared::slots::Holder;
use serde::Serialize;

use crate::error::Error;
use crate::rundir::unix_ms;

#[derive(Debug, Clone)]
pub struct TrainerConfig {
    pub drafter: DrafterConfig,
    pub lr: f64,
    pub warmup_steps: u64,
    pub total_steps: Option<u64>,
    pub steps_limit: Option<u64>,
    pub clip: f64,
    pub seed: u64,
    pub max_ranks: u32,
    pub target_layer_ids: Vec<u32>,
    pub num_target_layers: usize,
    /// Checkpoint every N committed steps (and always when the run stops).
    pub checkpoint_every: Option<u64>,
    pub keep_checkpoints: usize,
    pub checkpoints_dir: std::path::PathBuf,
    /// Resuming: the checkpoint (step, directory) the first ranks load.
    pub resume: Option<(u64, std::path::PathBuf)>,
}

/// What the dispatcher must do for the trainer.
#[derive(Debug)]
pub enum Action {
    Send(usize, ToWorker),
    /// Acknowledge `batch_id` held by `holder` in `input`: it reached the optimizer.
    Consume { worker: usize, holder: Holder, input: SlotRef, batch_id: u64 },
    /// Stop the run: the step limit is reached.
    Done,
    /// Stop the run: training cannot go on.
    Failed(String),
    Violation(usize, String),
    /// Ask `worker` to checkpoint `step` into `dir` (the dispatcher adds what was consumed).
    Checkpoint { worker: usize, step: u64, dir: std::path::PathBuf },
}

struct Member {
    rank: u32,
    holder: Holder,
}

struct Pending {
    holder: Holder,
    params: u64,
    input: SlotRef,
    batch_id: u64,
    stats: StepStats,
}

/// The latest committed step, for status and the run's end.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct TrainProgress {
    pub step: u64,
    pub loss: f64,
    pub acceptance: f64,
    pub slot_accuracy: Vec<f64>,
    pub members: usize,
    pub exported: Option<String>,
}

pub struct Trainer {
    cfg: TrainerConfig,
    grads_fd: OwnedFd,
    grads_geometry: PoolGeometry,
    _grads_map: PoolMap,
    state_fd: OwnedFd,
    state_geometry: PoolGeometry,
    _state_map: PoolMap,
    members: BTreeMap<usize, Member>,
    free_ranks: BTreeSet<u32>,
    committed: u64,
    pending: BTreeMap<usize, Pending>,
    /// (joiner, donor) while a snapshot is being taken.
    joining: Option<(usize, usize)>,
    queue: VecDeque<(usize, Holder)>,
    log: File,
    window: StepStats,
    window_start: Instant,
    window_steps: u64,
    /// The run is stopping: no more steps commit (the export reflects the last one).
    frozen: bool,
    /// Step of the last checkpoint asked for.
    checkpointed: u64,
    pub progress: TrainProgress,
}

impl Trainer {
    pub fn new(cfg: TrainerConfig, run_dir: &Path) -> Result<Trainer, Error> {
        let params = ParamLayout::new(&cfg.drafter).total;
        let grads_geometry = PoolGeometry { name: "grads".into(), slots: 2 * cfg.max_ranks.max(1), slot_bytes: params as u64 * 4 };
        let state_geometry = PoolGeometry { name: "drafter-state".into(), slots: 1, slot_bytes: state_bytes(params) };
        let mk = |g: &PoolGeometry| PoolMap::create(g.clone()).map_err(|e| Error::Internal(format!("cannot create the {} pool: {e}", g.name)));
        let (grads_fd, grads_map) = mk(&grads_geometry)?;
        let (state_fd, state_map) = mk(&state_geometry)?;
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(run_dir.join("train.jsonl"))
            .map_err(|e| Error::Internal(format!("cannot create train.jsonl: {e}")))?;
        Ok(Trainer {
            free_ranks: (0..cfg.max_ranks.max(1)).collect(),
            committed: cfg.resume.as_ref().map_or(0, |(s, _)| *s),
            checkpointed: cfg.resume.as_ref().map_or(0, |(s, _)| *s),
            cfg,
            grads_fd,
            grads_geometry,
            _grads_map: grads_map,
            state_fd,
            state_geometry,
            _state_map: state_map,
            members: BTreeMap::new(),
            pending: BTreeMap::new(),
            joining: None,
            queue: VecDeque::new(),
            log,
            window: StepStats::default(),
            window_start: Instant::now(),
            window_steps: 0,
            frozen: false,
            progress: TrainProgress::default(),
        })
    }

    /// Bytes of shared memory for a drafter config and rank count (for the start-up check).
    pub fn shared_bytes(drafter: &DrafterConfig, ranks: u32) -> u64 {
        let p = ParamLayout::new(drafter).total as u64;
        2 * ranks.max(1) as u64 * p * 4 + state_bytes(p as usize) + 2 * 4096
    }

    pub fn inherit_fds(&self) -> Vec<RawFd> {
        vec![self.grads_fd.as_raw_fd(), self.state_fd.as_raw_fd()]
    }

    pub fn describe(&self) -> String {
        let p = ParamLayout::new(&self.cfg.drafter).total;
        let c = &self.cfg.drafter;
        format!(
            "drafter: {} layers, {p} parameters, block {}, up to {} anchors, γ {}, lr {}",
            c.layers, c.block_size, c.max_anchors, c.gamma, self.cfg.lr
        )
    }

    fn setup(&self, rank: u32, init: Init) -> ToWorker {
        let info = |id, fd: &OwnedFd, g: &PoolGeometry| PoolInfo { id, fd: fd.as_raw_fd(), geometry: g.clone() };
        ToWorker::Train(Box::new(TrainSetup {
            drafter: self.cfg.drafter.clone(),
            lr: self.cfg.lr,
            warmup_steps: self.cfg.warmup_steps,
            total_steps: self.cfg.total_steps,
            clip: self.cfg.clip,
            seed: self.cfg.seed,
            grads: info(PoolId::Hidden, &self.grads_fd, &self.grads_geometry),
            state: info(PoolId::Hidden, &self.state_fd, &self.state_geometry),
            rank,
            target_layer_ids: self.cfg.target_layer_ids.clone(),
            num_target_layers: self.cfg.num_target_layers,
            checkpoint: self.cfg.resume.as_ref().map(|(_, d)| d.display().to_string()),
            init,
        }))
    }

    fn add_member(&mut self, worker: usize, holder: Holder, init: Init, out: &mut Vec<Action>) {
        let Some(rank) = self.free_ranks.pop_first() else {
            out.push(Action::Failed("more drafter ranks than gradient slots".into()));
            return;
        };
        self.members.insert(worker, Member { rank, holder });
        out.push(Action::Send(worker, self.setup(rank, init)));
    }

    /// A drafter connected (after it got the pools).
    pub fn on_ready(&mut self, worker: usize, holder: Holder) -> Vec<Action> {
        let mut out = Vec::new();
        let base = self.cfg.resume.as_ref().map_or(0, |(s, _)| *s);
        if self.committed == base && self.joining.is_none() {
            // Nothing applied since the start: the group's weights are the fresh ones (or
            // the resumed checkpoint's), which every rank can load by itself.
            let init = if base == 0 { Init::Fresh } else { Init::FromCheckpoint { step: base } };
            self.add_member(worker, holder, init, &mut out);
        } else if self.members.is_empty() {
            out.push(Action::Failed(self.lost_message()));
        } else {
            self.queue.push_back((worker, holder));
            self.start_join(&mut out);
        }
        out
    }

    fn lost_message(&self) -> String {
        let resume = if self.checkpointed > 0 {
            format!("; continue from the checkpoint of step {} with --resume RUN_DIR", self.checkpointed)
        } else {
            "; no checkpoint was written yet (see --checkpoint-every)".into()
        };
        format!("every drafter died after step {}: the newer weights lived only in their memory{resume}", self.committed)
    }

    /// Ask a member for a snapshot for the next joiner in line. Commits wait while a join
    /// is in progress, so every snapshot taken until the next commit holds the same
    /// bytes: a joiner still reading the slot while the next one is written reads the
    /// same values either way.
    fn start_join(&mut self, out: &mut Vec<Action>) {
        if self.joining.is_some() {
            return;
        }
        let Some(&(joiner, _)) = self.queue.front() else { return };
        let Some((&donor, _)) = self.members.iter().next() else { return };
        self.joining = Some((joiner, donor));
        out.push(Action::Send(donor, ToWorker::Snapshot { step: self.committed }));
    }

    pub fn on_snapshot_done(&mut self, worker: usize, step: u64) -> Vec<Action> {
        let mut out = Vec::new();
        match self.joining {
            // The donor answers in the order it was asked, and applies every committed
            // step before a later request: a reply for an older step answers a request
            // whose joiner died before a commit. The reply to this one is still coming.
            Some((_, donor)) if donor == worker && step < self.committed => {}
            Some((joiner, donor)) if donor == worker => {
                if step != self.committed {
                    out.push(Action::Violation(worker, format!("snapshot at step {step}, expected {}", self.committed)));
                    return out;
                }
                self.joining = None;
                let (_, holder) = self.queue.pop_front().expect("the joiner is queued");
                self.add_member(joiner, holder, Init::FromState { step }, &mut out);
                self.start_join(&mut out);
                self.try_commit(&mut out);
            }
            // A reply to a request whose joiner has died since: nothing to do.
            _ if self.members.contains_key(&worker) => {}
            _ => out.push(Action::Violation(worker, "SnapshotDone from a drafter that was not asked for one".into())),
        }
        out
    }

    pub fn on_grads(&mut self, worker: usize, step: u64, input: SlotRef, batch_id: u64, stats: StepStats, params: u64) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(m) = self.members.get(&worker) else {
            out.push(Action::Violation(worker, "gradients from a drafter that is not in the training group".into()));
            return out;
        };
        if step != self.committed + 1 || self.pending.contains_key(&worker) {
            out.push(Action::Violation(worker, format!("gradients for step {step}, expected step {} once", self.committed + 1)));
            return out;
        }
        self.pending.insert(worker, Pending { holder: m.holder, params, input, batch_id, stats });
        self.try_commit(&mut out);
        out
    }

    /// A drafter's life is over.
    pub fn on_gone(&mut self, worker: usize) -> Vec<Action> {
        let mut out = Vec::new();
        if let Some(m) = self.members.remove(&worker) {
            self.free_ranks.insert(m.rank);
        }
        self.pending.remove(&worker);
        self.queue.retain(|(w, _)| *w != worker);
        if let Some((joiner, donor)) = self.joining {
            if joiner == worker || donor == worker {
                self.joining = None;
                if donor == worker && self.members.is_empty() && self.committed > 0 {
                    out.push(Action::Failed(self.lost_message()));
                    return out;
                }
                self.start_join(&mut out);
            }
        }
        self.try_commit(&mut out);
        out
    }

    /// The end of the data: when every batch not yet consumed is already in a pending
    /// gradient (`remaining` = batches produced and not consumed, once the loader is
    /// done), the members still waiting will never get one: commit the last step over
    /// those who have a gradient.
    pub fn flush_tail(&mut self, remaining: Option<u64>) -> Vec<Action> {
        let mut out = Vec::new();
        if remaining.is_some_and(|r| r > 0 && r == self.pending.len() as u64) {
            self.commit(&mut out);
        }
        out
    }

    fn try_commit(&mut self, out: &mut Vec<Action>) {
        if !self.members.keys().all(|w| self.pending.contains_key(w)) {
            return;
        }
        self.commit(out);
    }

    /// Commit step `committed + 1` over the members with a pending gradient; every
    /// member applies it.
    fn commit(&mut self, out: &mut Vec<Action>) {
        if self.frozen || self.joining.is_some() || self.members.is_empty() || self.pending.is_empty() {
            return;
        }
        let step = self.committed + 1;
        let sums: BTreeSet<u64> = self.pending.values().map(|p| p.params).collect();
        if sums.len() > 1 {
            self.frozen = true;
            out.push(Action::Failed(format!(
                "the drafter ranks hold different weights at step {}: data-parallel training diverged",
                self.committed
            )));
            return;
        }
        let slots: Vec<u32> = self
            .members
            .iter()
            .filter(|(w, _)| self.pending.contains_key(w))
            .map(|(_, m)| m.rank * 2 + (step % 2) as u32)
            .collect();
        let lr = lr_at(step - 1, self.cfg.lr, self.cfg.warmup_steps, self.cfg.total_steps);
        let mut stats = StepStats::default();
        for (&w, p) in std::mem::take(&mut self.pending).iter() {
            out.push(Action::Consume { worker: w, holder: p.holder, input: p.input, batch_id: p.batch_id });
            stats.merge(&p.stats);
        }
        for &w in self.members.keys() {
            out.push(Action::Send(w, ToWorker::Reduce { step, slots: slots.clone(), lr }));
        }
        self.committed = step;
        self.record(step, lr, slots.len(), &stats);
        if self.cfg.checkpoint_every.is_some_and(|n| n > 0 && step % n == 0) {
            out.extend(self.checkpoint());
        }
        if self.cfg.steps_limit.is_some_and(|n| step >= n) {
            self.frozen = true;
            out.push(Action::Done);
        }
    }

    fn record(&mut self, step: u64, lr: f64, contributors: usize, s: &StepStats) {
        let acc: Vec<f64> = s.slot_correct.iter().zip(&s.slot_total).skip(1).map(|(c, t)| if *t > 0 { *c as f64 / *t as f64 } else { 0.0 }).collect();
        let line = serde_json::json!({
            "t": unix_ms(), "step": step, "loss": s.loss(), "acceptance": s.acceptance(), "slot_accuracy": acc,
            "lr": lr, "members": self.members.len(), "contributors": contributors,
            "tokens": s.tokens, "anchors": s.anchors, "blocks": s.blocks,
            "wait_ms": s.wait_ms, "compute_ms": s.compute_ms, "optimizer_ms": s.optimizer_ms,
        });
        let _ = writeln!(self.log, "{line}");
        self.progress.step = step;
        self.progress.loss = s.loss();
        self.progress.acceptance = s.acceptance();
        self.progress.slot_accuracy = acc;
        self.progress.members = self.members.len();
        self.window.merge(s);
        self.window_steps += 1;
        let secs = self.window_start.elapsed().as_secs_f64();
        if secs >= 5.0 || step == 1 {
            let w = &self.window;
            let acc1 = if w.slot_total.len() > 1 && w.slot_total[1] > 0 { w.slot_correct[1] as f64 / w.slot_total[1] as f64 } else { 0.0 };
            log::info!(
                "step {step}: loss {:.4}, acceptance {:.2}, acc@1 {:.2}, {:.0} tokens/s, {} drafter(s), lr {:.2e}",
                w.loss(),
                w.acceptance(),
                acc1,
                w.tokens as f64 / secs.max(1e-9),
                self.members.len(),
                lr
            );
            self.window = StepStats::default();
            self.window_start = Instant::now();
            self.window_steps = 0;
        }
    }

    /// Ask one member to write the drafter to `dir` (the run is ending): from now on no
    /// step commits, so what is written is the last committed step.
    pub fn export(&mut self, dir: &Path) -> Vec<Action> {
        self.frozen = true;
        let mut out = self.checkpoint();
        if let Some(&w) = self.members.keys().next() {
            if self.committed > 0 {
                out.push(Action::Send(w, ToWorker::Export { dir: dir.display().to_string() }));
            }
        }
        out
    }

    /// A checkpoint of the last committed step, by one member.
    pub fn checkpoint(&mut self) -> Vec<Action> {
        match self.members.keys().next() {
            Some(&w) if self.committed > self.checkpointed => {
                self.checkpointed = self.committed;
                let dir = self.cfg.checkpoints_dir.join(format!("step-{:08}", self.committed));
                vec![Action::Checkpoint { worker: w, step: self.committed, dir }]
            }
            _ => vec![],
        }
    }

    /// A checkpoint is complete: keep the newest `keep_checkpoints`.
    pub fn on_checkpointed(&mut self, dir: String, step: u64) {
        log::info!("checkpoint of step {step} written to {dir}");
        let Ok(entries) = std::fs::read_dir(&self.cfg.checkpoints_dir) else { return };
        let mut done: Vec<std::path::PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")) && p.join("meta.json").exists())
            .collect();
        done.sort();
        let keep = self.cfg.keep_checkpoints.max(1);
        if done.len() > keep {
            for old in &done[..done.len() - keep] {
                let _ = std::fs::remove_dir_all(old);
            }
        }
    }

    pub fn on_exported(&mut self, dir: String, step: u64) {
        log::info!("drafter at step {step} written to {dir}");
        self.progress.exported = Some(dir);
    }

    pub fn committed(&self) -> u64 {
        self.committed
    }
}
