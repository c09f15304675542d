//! The data-parallel drafter group, coordinated by the supervisor.
//!
//! Each drafter rank computes the gradient of one batch, reports it ([`FromWorker::Grads`])
//! and all-reduces it with the other members through its collective (shared memory, or
//! NCCL on GPUs), reporting [`FromWorker::Reduced`]. Membership comes in *epochs*: every
//! change (a death, a join, a rollback) starts a new one ([`ToWorker::Group`]), which
//! aborts the all-reduce in flight, and the members reduce the gradients they hold again.
//! When every member has reduced step s in the current epoch, the step is *committed*:
//! the batches behind it are recorded as consumed (the supervisor acknowledges them on
//! the ranks' behalf, so a batch is consumed exactly when its gradient is part of a
//! committed step), and every member applies the sum ([`ToWorker::Apply`]). A member
//! that dies before the commit is left out and its batch goes back to the queue; the
//! step commits over the others, reduced again in the next epoch. An all-reduce that
//! every member entered and that does not complete within `--collective-timeout` is
//! aborted the same way.
//!
//! A drafter that (re)joins after step 0 gets the current weights and optimizer state
//! from a surviving member through a shared state slot; commits wait while it joins, so it
//! joins exactly at the step it was given.
//!
//! Every few steps one member also writes its state into a supervisor-owned snapshot slot
//! (two of them, used in turn: the newer one becomes current only once it is complete, so
//! a death while writing leaves the older intact). If no member survives, the group rolls
//! back to the newest of that snapshot, the newest checkpoint and the run's start: the
//! batches committed after it go back to the queue in their order, the step counter and
//! the LR schedule follow the rolled-back step, and restarted drafters load that state.
//! `--max-rollbacks` bounds how often.
//!
//! This module is the group's state machine alone: it reads no clock (the caller passes
//! `now`) and writes nothing. What it decides comes back as an [`Out`]: [`Action`]s for
//! the dispatcher, and [`Effect`]s on the checkpoints and the training log, which
//! [`crate::training::trainer::Trainer`] carries out through
//! [`crate::training::checkpoint_store::CheckpointStore`] and
//! [`crate::training::train_log::TrainLog`]. What it needs to know of the disk (whether a
//! checkpoint is complete, verifies, or has room) it asks a [`CheckpointView`].
//!
//! [`FromWorker::Grads`]: dflash_shared::protocol::FromWorker::Grads
//! [`FromWorker::Reduced`]: dflash_shared::protocol::FromWorker::Reduced
//! [`ToWorker::Group`]: dflash_shared::protocol::ToWorker::Group
//! [`ToWorker::Apply`]: dflash_shared::protocol::ToWorker::Apply

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::Instant;

use dflash_shared::drafter::{
    lr_at, CollectiveKind, DrafterConfig, Init, ParamLayout, StepStats, TrainSetup,
};
use dflash_shared::protocol::{PoolInfo, SlotRef, ToWorker};
use dflash_shared::slots::Holder;

use crate::state::TrainProgress;
use crate::training::train_log::LogLine;
use crate::violation::Violation;

mod job;
pub use job::{JobCommit, JobReport, RANK_STRIDE};

#[derive(Debug, Clone)]
pub struct TrainerConfig {
    pub drafter: DrafterConfig,
    /// How the ranks exchange gradients.
    pub collective: CollectiveKind,
    /// An all-reduce every member entered that has not completed after this is aborted.
    pub collective_timeout: std::time::Duration,
    pub lr: f64,
    pub warmup_steps: u64,
    pub total_steps: Option<u64>,
    /// Where `warmup_steps` and `total_steps` come from; refined once the first epoch is
    /// cut ([`Group::refine_schedule`]).
    pub schedule: Option<crate::training::schedule::Schedule>,
    /// Every setting as the run uses it (defaults resolved), for run.json and each
    /// checkpoint's meta.json.
    pub settings: serde_json::Value,
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
    /// `--init-drafter`: the drafter directory whose weights a fresh start loads (checked
    /// against the drafter before any worker starts).
    pub init_drafter: Option<std::path::PathBuf>,
    /// Snapshot every N committed steps; `None`: as often as keeps the snapshot's cost
    /// under 2 % of the step time.
    pub snapshot_every: Option<u64>,
    /// Rollbacks allowed before the run gives up.
    pub max_rollbacks: u32,
    /// Consecutive steps skipped for a non-finite gradient before the run gives up.
    pub max_skipped_steps: u64,
    /// Held-out evaluation (`--eval-data`): the set, and every how many steps.
    pub eval: Option<EvalSettings>,
    /// Real τ (`--eval-prompts`): measured every N steps (and at the last), each one a
    /// checkpoint step; the best τ, not the eval acceptance, names `checkpoints/best`.
    pub tau_every: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct EvalSettings {
    pub set: crate::training::eval::EvalSet,
    pub every: u64,
}

/// Share of the step time the automatic snapshot interval spends on snapshots.
const SNAPSHOT_BUDGET: f64 = 0.02;

/// Where the first members of the group get their state at `restore_step`.
#[derive(Debug, Clone, PartialEq)]
enum Restore {
    Fresh,
    Snapshot { slot: u32 },
    Checkpoint { dir: std::path::PathBuf },
}

/// What the dispatcher must do for the trainer.
#[derive(Debug)]
pub enum Action {
    Send(usize, ToWorker),
    /// Acknowledge `batch_id` held by `holder` in `input`: it reached the optimizer in
    /// committed step `step`.
    Consume {
        worker: usize,
        holder: Holder,
        input: SlotRef,
        batch_id: u64,
        step: u64,
    },
    /// Every drafter died: the group goes back from step `from` to `to`, and `batches`
    /// (committed after `to`, in commit order) go back to the front of the queue.
    Rollback {
        from: u64,
        to: u64,
        batches: Vec<u64>,
    },
    /// Batches consumed at or before this step can no longer be rolled back.
    Covered(u64),
    /// Record this in the run's events.jsonl.
    Event(&'static str, serde_json::Map<String, serde_json::Value>),
    /// Stop the run: the step limit is reached.
    Done,
    /// Stop the run: training cannot go on.
    Failed(String),
    Violation(usize, Violation),
    /// Ask `worker` to checkpoint `step` into `dir` (the dispatcher adds what was consumed).
    Checkpoint {
        worker: usize,
        step: u64,
        dir: std::path::PathBuf,
    },
    /// No drafter is left to write the stop checkpoint, but the snapshot holds the last
    /// committed step: write it from the snapshot (see
    /// [`crate::training::trainer::Trainer::checkpoint_from_snapshot`]).
    CheckpointFromSnapshot {
        step: u64,
        dir: std::path::PathBuf,
    },
    /// An eval round of the weights of `step` starts: put its `batches` into the
    /// pipeline (and pause training traffic until [`Action::EvalEnd`]).
    EvalStart {
        round: u64,
        step: u64,
        batches: Vec<dflash_shared::batch::TokenBatch>,
    },
    /// The eval round is over (complete, or dropped by a rollback): training traffic
    /// resumes.
    EvalEnd,
    /// In a job across nodes: tell the leader.
    Job(JobReport),
}

/// What the group does to the checkpoints directory and the training log; carried out, in
/// order, by the [`crate::training::trainer::Trainer`] before it hands the actions on.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Append this line to train.jsonl.
    Log(LogLine),
    /// Keep the newest `--keep-checkpoints` complete checkpoints, never the best one
    /// ([`Group::protected_steps`] at the time it is carried out).
    PruneCheckpoints,
    /// Move the checkpoints of steps after this one aside (an abandoned lineage).
    SetAsideCheckpointsAfter(u64),
    /// Point `checkpoints/best` at this step's checkpoint; should that fail, tell the group
    /// ([`Group::on_best_link_failed`]), which then keeps `previous`.
    LinkBest { step: u64, previous: Option<u64> },
    /// Remove `checkpoints/best` (its checkpoint went aside).
    UnlinkBest,
}

/// What a call decided: actions for the dispatcher, and effects on the disk.
#[derive(Debug, Default)]
pub struct Out {
    pub actions: Vec<Action>,
    pub effects: Vec<Effect>,
}

impl Out {
    pub fn push(&mut self, a: Action) {
        self.actions.push(a);
    }

    fn effect(&mut self, e: Effect) {
        self.effects.push(e);
    }
}

impl Extend<Action> for Out {
    fn extend<I: IntoIterator<Item = Action>>(&mut self, iter: I) {
        self.actions.extend(iter);
    }
}

/// What the group asks of the checkpoints on disk (read only).
pub trait CheckpointView: Send {
    /// Does the checkpoint in `dir` pass its checks ([`dflash_shared::checkpoint::verify`])?
    fn verify(
        &self,
        dir: &Path,
        drafter: &DrafterConfig,
    ) -> Result<u64, dflash_shared::checkpoint::Refused>;
    /// Is the checkpoint of `step` complete (its meta.json written)?
    fn is_complete(&self, step: u64) -> bool;
    /// The newest complete checkpoint of a step at most `at_most`.
    fn newest_complete(&self, at_most: u64) -> Option<(u64, PathBuf)>;
    /// Is there room for a checkpoint of `step`, `bytes` large? `Err`: why not, and what to
    /// free (warns in the log while there is room for only a few more).
    fn room_for(&self, step: u64, bytes: u64) -> Result<(), String>;
    /// The directory of the checkpoint of `step`.
    fn dir_of(&self, step: u64) -> PathBuf;
}

/// Where the group is: training, a drafter joining, or frozen (no step commits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Steps commit as the members reduce them.
    Training,
    /// `joiner` gets the state from `donor`'s snapshot; no step commits until it joined.
    Joining { joiner: usize, donor: usize },
    /// No step commits any more: the run stops, reached its step limit, or failed. A
    /// join in progress still completes; `ends_after_eval`: the step limit was reached and
    /// the run ends once the eval round of the last step is in.
    Frozen {
        joining: Option<(usize, usize)>,
        ends_after_eval: bool,
    },
}

impl Phase {
    /// The join in progress (joiner, donor).
    pub fn joining(self) -> Option<(usize, usize)> {
        match self {
            Phase::Training => None,
            Phase::Joining { joiner, donor } => Some((joiner, donor)),
            Phase::Frozen { joining, .. } => joining,
        }
    }

    /// The same phase with `join` in progress (or none).
    fn with_joining(self, join: Option<(usize, usize)>) -> Phase {
        match (self, join) {
            (
                Phase::Frozen {
                    ends_after_eval, ..
                },
                joining,
            ) => Phase::Frozen {
                joining,
                ends_after_eval,
            },
            (_, Some((joiner, donor))) => Phase::Joining { joiner, donor },
            (_, None) => Phase::Training,
        }
    }

    /// Frozen, keeping the join in progress.
    fn frozen(self) -> Phase {
        match self {
            Phase::Frozen { .. } => self,
            _ => Phase::Frozen {
                joining: self.joining(),
                ends_after_eval: false,
            },
        }
    }

    pub fn is_frozen(self) -> bool {
        matches!(self, Phase::Frozen { .. })
    }

    pub fn ends_after_eval(self) -> bool {
        matches!(
            self,
            Phase::Frozen {
                ends_after_eval: true,
                ..
            }
        )
    }

    /// The same phase, ending (or not) after the eval round; only a frozen group ends.
    fn with_ends_after_eval(self, ends: bool) -> Phase {
        match self {
            Phase::Frozen { joining, .. } => Phase::Frozen {
                joining,
                ends_after_eval: ends,
            },
            other => other,
        }
    }
}

/// What the group knows at its start of the run so far (read by the caller).
pub struct History {
    /// The step `checkpoints/best` points at, if any.
    pub linked: Option<u64>,
    /// Every eval of train.jsonl: step → acceptance.
    pub evals: BTreeMap<u64, f64>,
    /// Every τ of train.jsonl: step → pooled τ.
    pub taus: BTreeMap<u64, f64>,
}

struct Member {
    rank: u32,
    holder: Holder,
}

/// A member's gradient of a step, as it reports it.
#[derive(Debug, Clone)]
pub struct Gradient {
    /// The slot and batch it was computed from.
    pub input: SlotRef,
    pub batch_id: u64,
    pub stats: StepStats,
    /// A checksum of the member's weights (all members must agree).
    pub params: u64,
}

struct Pending {
    holder: Holder,
    params: u64,
    input: SlotRef,
    batch_id: u64,
    stats: StepStats,
}

/// The highest score of `scores` (step → score) at or before `upto` whose checkpoint is
/// complete (ties: the earliest).
fn best_of(
    scores: &BTreeMap<u64, f64>,
    upto: u64,
    view: &dyn CheckpointView,
) -> Option<(u64, f64)> {
    scores
        .iter()
        .filter(|&(&s, _)| s <= upto && view.is_complete(s))
        .fold(None, |b: Option<(u64, f64)>, (&s, &a)| match b {
            Some((_, ba)) if ba >= a => b,
            _ => Some((s, a)),
        })
}

fn ordinal(n: u32) -> String {
    match (n % 10, n % 100) {
        (1, r) if r != 11 => format!("{n}st"),
        (2, r) if r != 12 => format!("{n}nd"),
        (3, r) if r != 13 => format!("{n}rd"),
        _ => format!("{n}th"),
    }
}

/// The drafter group's state machine.
pub struct Group {
    cfg: TrainerConfig,
    /// The gradient and state pools, as each rank gets them.
    grads: PoolInfo,
    state: PoolInfo,
    view: Box<dyn CheckpointView>,
    phase: Phase,
    members: BTreeMap<usize, Member>,
    free_ranks: BTreeSet<u32>,
    /// A checkpoint was asked for (SIGUSR1): written at the next committed step.
    checkpoint_requested: bool,
    committed: u64,
    pending: BTreeMap<usize, Pending>,
    /// Drafters waiting to join: (worker, life, the rank its name asks for).
    queue: VecDeque<(usize, Holder, u32)>,
    /// The membership epoch, and the members that reduced step `committed + 1` in it (with
    /// the loss-weight sum their all-reduce found).
    epoch: u64,
    reduced: BTreeMap<usize, f64>,
    /// Members told to contribute nothing to step `committed + 1` (the data's end).
    abstained: BTreeSet<usize>,
    /// When every member had entered the all-reduce of the current epoch, and how many
    /// epochs in a row aborted a hung one.
    all_posted_at: Option<Instant>,
    hung_in_a_row: u32,
    /// All-reduce times of the last commit's members (ms), for the log.
    reduce_ms: Vec<f64>,
    /// Step of the last checkpoint asked for, and of whom (until it is complete).
    checkpointed: u64,
    checkpoint_asked: Option<(usize, u64)>,
    /// A checkpoint found no room on disk and the run was told to stop (said once).
    no_room_said: bool,
    /// The newest complete checkpoint (step, directory).
    last_checkpoint: Option<(u64, std::path::PathBuf)>,
    /// How the first members load their state, and at which step.
    restore: Restore,
    restore_step: u64,
    /// The run's own start (fresh, or the resumed checkpoint): the oldest rollback target.
    base: (u64, Restore),
    /// The current snapshot (slot, step), and the one being written (donor, slot, step).
    snapshot: Option<(u32, u64)>,
    snapshot_asked: Option<(usize, u32, u64)>,
    /// Measured: milliseconds per snapshot and per step (moving averages).
    snapshot_ms: Option<f64>,
    step_ms: Option<f64>,
    last_commit: Option<Instant>,
    /// Batches of each committed step that a rollback may still take back.
    lineage: BTreeMap<u64, Vec<u64>>,
    rollbacks: u32,
    /// Consecutive skipped steps, and the newest checkpoint from before they began.
    skipped_in_a_row: u64,
    good_checkpoint: Option<u64>,
    pub progress: TrainProgress,
    /// Held-out evaluation, with `--eval-data`.
    eval: Option<Box<crate::training::eval::Evaluator>>,
    /// Real τ, with `--eval-prompts`.
    tau: Option<crate::training::tau::TauTrack>,
    /// The step `checkpoints/best` points at now.
    linked: Option<u64>,
    /// In a job across nodes: this node's side of the job's epochs and commits.
    job: Option<job::JobGate>,
}

/// Bytes of the files in `dir` and its subdirectories (what a checkpoint or an export
/// takes on disk); 0 where it cannot be read.
fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

impl Group {
    /// The schedule's length in optimizer steps, once it is known.
    pub fn total_steps(&self) -> Option<u64> {
        self.cfg.total_steps
    }

    /// A group of no member yet, at the run's start (fresh, or the resumed checkpoint).
    /// `grads` and `state` are the pools each rank maps.
    pub fn new(
        cfg: TrainerConfig,
        grads: PoolInfo,
        state: PoolInfo,
        view: Box<dyn CheckpointView>,
        history: History,
        _now: Instant,
    ) -> Group {
        let base = match &cfg.resume {
            Some((step, dir)) => (*step, Restore::Checkpoint { dir: dir.clone() }),
            None => (0, Restore::Fresh),
        };
        let eval = cfg.eval.as_ref().map(|e| {
            let mut ev = Box::new(crate::training::eval::Evaluator::new(
                e.set.clone(),
                e.every,
            ));
            // Resuming: the best eval of the lineage resumed (whose checkpoint is still
            // there) stays the one to beat.
            ev.best = best_of(&history.evals, base.0, view.as_ref());
            ev
        });
        let tau = cfg.tau_every.map(|every| {
            let mut t = crate::training::tau::TauTrack::new(every);
            t.best = best_of(&history.taus, base.0, view.as_ref());
            t
        });
        let linked = (eval.is_some() || tau.is_some())
            .then_some(history.linked)
            .flatten();
        Group {
            restore: base.1.clone(),
            restore_step: base.0,
            last_checkpoint: cfg.resume.clone(),
            base,
            snapshot: None,
            snapshot_asked: None,
            snapshot_ms: None,
            step_ms: None,
            last_commit: None,
            lineage: BTreeMap::new(),
            checkpoint_asked: None,
            no_room_said: false,
            rollbacks: 0,
            skipped_in_a_row: 0,
            good_checkpoint: None,
            free_ranks: (0..cfg.max_ranks.max(1)).collect(),
            checkpoint_requested: false,
            committed: cfg.resume.as_ref().map_or(0, |(s, _)| *s),
            checkpointed: cfg.resume.as_ref().map_or(0, |(s, _)| *s),
            cfg,
            grads,
            state,
            view,
            phase: Phase::Training,
            members: BTreeMap::new(),
            pending: BTreeMap::new(),
            queue: VecDeque::new(),
            epoch: 0,
            reduced: BTreeMap::new(),
            abstained: BTreeSet::new(),
            all_posted_at: None,
            hung_in_a_row: 0,
            reduce_ms: Vec::new(),
            progress: TrainProgress::default(),
            eval,
            tau,
            linked,
            job: None,
        }
    }

    /// The group's configuration.
    pub fn config(&self) -> &TrainerConfig {
        &self.cfg
    }

    /// Where the group is.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    fn joining(&self) -> Option<(usize, usize)> {
        self.phase.joining()
    }

    fn set_joining(&mut self, join: Option<(usize, usize)>) {
        self.phase = self.phase.with_joining(join);
    }

    fn is_frozen(&self) -> bool {
        self.phase.is_frozen()
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
        ToWorker::Train(Box::new(TrainSetup {
            drafter: self.cfg.drafter.clone(),
            lr: self.cfg.lr,
            warmup_steps: self.cfg.warmup_steps,
            total_steps: self.cfg.total_steps,
            clip: self.cfg.clip,
            seed: self.cfg.seed,
            grads: self.grads.clone(),
            collective: self.cfg.collective,
            state: self.state.clone(),
            rank,
            target_layer_ids: self.cfg.target_layer_ids.clone(),
            num_target_layers: self.cfg.num_target_layers,
            checkpoint: match &self.restore {
                Restore::Checkpoint { dir } => Some(dir.display().to_string()),
                _ => None,
            },
            init,
            init_drafter: self
                .cfg
                .init_drafter
                .as_ref()
                .map(|d| d.display().to_string()),
        }))
    }

    /// `worker` joins as `rank` (the number in its name, drafter-N is rank N), or, should
    /// that rank be taken, as the lowest free one, said in one line.
    fn add_member(&mut self, worker: usize, holder: Holder, rank: u32, init: Init, out: &mut Out) {
        let rank = if self.free_ranks.remove(&rank) {
            rank
        } else {
            let Some(other) = self.free_ranks.pop_first() else {
                out.push(Action::Failed(
                    "more drafter ranks than gradient slots".into(),
                ));
                return;
            };
            log::warn!("drafter-{rank}: rank {rank} is taken; it joins as rank {other}");
            other
        };
        self.members.insert(worker, Member { rank, holder });
        out.push(Action::Send(worker, self.setup(rank, init)));
    }

    /// The members changed (`why`): start the next membership epoch. The all-reduce in
    /// flight is void; the members reduce the gradients they hold again in the new epoch.
    fn new_epoch(&mut self, why: &str, out: &mut Out) {
        if self.report_ranks(why, out) {
            return;
        }
        if self.members.is_empty() {
            return;
        }
        self.epoch += 1;
        let in_flight: Vec<u32> = self
            .pending
            .keys()
            .filter(|w| !self.reduced.contains_key(w))
            .filter_map(|w| self.members.get(w).map(|m| m.rank))
            .collect();
        let reduced_before = self.reduced.len();
        self.reduced.clear();
        self.all_posted_at = None;
        let ranks = self.ranks();
        let fields = serde_json::json!({
            "epoch": self.epoch, "ranks": ranks, "why": why, "step": self.committed + 1,
            "held": self.pending.len(), "in_flight": in_flight, "reduced_before": reduced_before,
        });
        if let serde_json::Value::Object(fields) = fields {
            out.push(Action::Event("group_epoch", fields));
        }
        self.progress.epoch = self.epoch;
        log::info!(
            "drafter group epoch {}: ranks {ranks:?} ({why})",
            self.epoch
        );
        for &w in self.members.keys() {
            out.push(Action::Send(
                w,
                ToWorker::Group {
                    epoch: self.epoch,
                    ranks: ranks.clone(),
                    id: None,
                },
            ));
        }
    }

    /// The members' ranks, ascending (a rank's place in the collective).
    fn ranks(&self) -> Vec<u32> {
        let mut r: Vec<u32> = self.members.values().map(|m| m.rank).collect();
        r.sort_unstable();
        r
    }

    /// NCCL: the first rank of `epoch` created its communicator's id: relay it.
    pub fn on_group_id(&mut self, worker: usize, epoch: u64, id: Vec<u8>) -> Out {
        if let Some(out) = self.job_group_id(worker, epoch, &id) {
            return out;
        }
        let mut out = Out::default();
        let ranks = self.ranks();
        match self.members.get(&worker) {
            Some(m) if epoch == self.epoch && ranks.first() == Some(&m.rank) => {
                for &w in self.members.keys().filter(|&&w| w != worker) {
                    out.push(Action::Send(
                        w,
                        ToWorker::Group {
                            epoch,
                            ranks: ranks.clone(),
                            id: Some(id.clone()),
                        },
                    ));
                }
            }
            // For an epoch that is over: nobody needs it.
            Some(_) if epoch < self.epoch => {}
            _ => out.push(Action::Violation(
                worker,
                Violation::NcclIdNotFromFirstRank { epoch },
            )),
        }
        out
    }

    /// A member's all-reduce of `step` in `epoch` completed.
    pub fn on_reduced(
        &mut self,
        worker: usize,
        step: u64,
        epoch: u64,
        weight_sum: f64,
        ms: f64,
        now: Instant,
    ) -> Out {
        let mut out = Out::default();
        if !self.members.contains_key(&worker) {
            out.push(Action::Violation(
                worker,
                Violation::NotAMember {
                    what: "an all-reduce",
                },
            ));
            return out;
        }
        if epoch > self.epoch || (epoch == self.epoch && step != self.committed + 1) {
            out.push(Action::Violation(
                worker,
                Violation::ReducedOutOfOrder {
                    step,
                    epoch,
                    expected_step: self.committed + 1,
                    expected_epoch: self.epoch,
                },
            ));
            return out;
        }
        if epoch < self.epoch {
            // Overtaken by a newer epoch: it reduces again there.
            return out;
        }
        if !self.pending.contains_key(&worker) && !self.abstained.contains(&worker) {
            out.push(Action::Violation(
                worker,
                Violation::ReducedWithoutGradient { step },
            ));
            return out;
        }
        self.reduced.insert(worker, weight_sum);
        self.reduce_ms.push(ms);
        self.try_commit(now, &mut out);
        out
    }

    /// The collective's watchdog: an all-reduce that every member entered and that has
    /// not completed after `--collective-timeout` is aborted by a new epoch of the same
    /// members; three in a row for one step stop the run.
    pub fn watchdog(&mut self, now: Instant) -> Out {
        let mut out = Out::default();
        let entered = !self.members.is_empty()
            && self
                .members
                .keys()
                .all(|w| self.pending.contains_key(w) || self.abstained.contains(w));
        if !entered
            || self.is_frozen()
            || self.joining().is_some()
            || self.reduced.len() == self.members.len()
        {
            self.all_posted_at = None;
            return out;
        }
        let since = *self.all_posted_at.get_or_insert(now);
        if now.saturating_duration_since(since) < self.cfg.collective_timeout {
            return out;
        }
        self.hung_in_a_row += 1;
        let late: Vec<u32> = self
            .members
            .iter()
            .filter(|(w, _)| !self.reduced.contains_key(w))
            .map(|(_, m)| m.rank)
            .collect();
        let what = format!(
            "the all-reduce of step {} hung for {} (--collective-timeout) on ranks {late:?}",
            self.committed + 1,
            humantime::format_duration(self.cfg.collective_timeout)
        );
        if self.hung_in_a_row >= 3 {
            self.phase = self.phase.frozen();
            out.push(Action::Failed(format!("{what}, the third time in a row: the group cannot exchange gradients (see the drafters' logs; NCCL_DEBUG=INFO says more on NCCL)")));
            return out;
        }
        log::warn!("{what}: aborting it and forming the group again");
        self.new_epoch(&what, &mut out);
        // The members enter the new epoch's all-reduce at once: its deadline starts now.
        self.all_posted_at = Some(now);
        out
    }

    /// How a member that starts at `restore_step` loads its state.
    fn restore_init(&self) -> Init {
        match &self.restore {
            Restore::Fresh => Init::Fresh,
            Restore::Snapshot { slot } => Init::FromState {
                step: self.restore_step,
                slot: *slot,
            },
            Restore::Checkpoint { .. } => Init::FromCheckpoint {
                step: self.restore_step,
            },
        }
    }

    /// A drafter connected (after it got the pools).
    /// Drafter `worker` (life `holder`) is ready; `rank` is the number in its name
    /// (drafter-N is rank N, in every life).
    pub fn on_ready(&mut self, worker: usize, holder: Holder, rank: u32) -> Out {
        let rank = self.job_rank(rank);
        let mut out = Out::default();
        if self.committed == self.restore_step && self.joining().is_none() {
            // Nothing applied since the start or the last rollback: every rank can load
            // the group's state by itself (fresh, a checkpoint, or the snapshot).
            self.add_member(worker, holder, rank, self.restore_init(), &mut out);
            self.new_epoch("a drafter started", &mut out);
        } else if self.members.is_empty() {
            out.push(Action::Failed(self.lost_message()));
        } else {
            self.queue.push_back((worker, holder, rank));
            self.start_join(&mut out);
        }
        out
    }

    /// Every member is gone and steps were committed since `restore_step`: go back to the
    /// newest state that survived them (snapshot, checkpoint, or the run's start).
    fn rollback(&mut self, out: &mut Out) {
        if self.is_frozen() || self.committed == self.restore_step {
            return;
        }
        self.rollbacks += 1;
        if self.rollbacks > self.cfg.max_rollbacks {
            self.phase = self.phase.frozen();
            out.push(Action::Failed(format!(
                "every drafter died for the {} time (at step {}), more than --max-rollbacks {}: a crash that recurs is not recovered by rolling back (see the drafters' logs)",
                ordinal(self.rollbacks),
                self.committed,
                self.cfg.max_rollbacks
            )));
            return;
        }
        let from = self.committed;
        let mut candidates = vec![self.base.clone()];
        if let Some((slot, step)) = self.snapshot {
            candidates.push((step, Restore::Snapshot { slot }));
        }
        if let Some((step, dir)) = &self.last_checkpoint {
            match self.view.verify(dir, &self.cfg.drafter) {
                Ok(_) => candidates.push((*step, Restore::Checkpoint { dir: dir.clone() })),
                Err(e) => log::warn!("not rolling back to the checkpoint of step {step}: {e}"),
            }
        }
        let (to, restore) = candidates
            .into_iter()
            .filter(|(s, _)| *s <= from)
            .max_by_key(|(s, _)| *s)
            .expect("the run's start is a candidate");
        let batches: Vec<u64> = self
            .lineage
            .split_off(&(to + 1))
            .into_values()
            .flatten()
            .collect();
        let what = match &restore {
            Restore::Fresh => "the run's fresh start".to_string(),
            Restore::Snapshot { .. } => "the snapshot".to_string(),
            Restore::Checkpoint { dir } => format!("the checkpoint {}", dir.display()),
        };
        log::warn!(
            "every drafter died after step {from}: rolling back to step {to} ({what}); {} batch(es) committed since go back to the queue (rollback {} of at most {})",
            batches.len(),
            self.rollbacks,
            self.cfg.max_rollbacks
        );
        out.effect(Effect::Log(LogLine::Rollback {
            from,
            to,
            batches: batches.len(),
            source: what.clone(),
        }));
        self.pending.clear();
        self.reduced.clear();
        self.abstained.clear();
        self.set_joining(None);
        self.snapshot_asked = None;
        self.checkpoint_asked = None;
        self.skipped_in_a_row = 0;
        self.committed = to;
        if let Some(e) = self.eval.as_mut() {
            if let Some(step) = e.rolled_back(to) {
                log::warn!("eval of step {step} dropped: the group rolled back to step {to} (step {step} is evaluated again when it commits again)");
                out.push(Action::EvalEnd);
            }
        }
        if let Some(t) = self.tau.as_mut() {
            t.rolled_back(to);
        }
        if self.linked.is_some_and(|s| s > to) {
            // Its checkpoint goes aside with the abandoned lineage.
            out.effect(Effect::UnlinkBest);
            self.linked = None;
        }
        self.phase = self.phase.with_ends_after_eval(false);
        self.set_aside_checkpoints_after(to, out);
        self.checkpointed = self.saved_step().min(to);
        self.restore = restore;
        self.restore_step = to;
        self.progress.step = to;
        self.progress.rollbacks = self.rollbacks;
        self.last_commit = None;
        out.push(Action::Rollback { from, to, batches });
        // Drafters that came up while no member could give them the state load it now.
        for (w, h, rank) in std::mem::take(&mut self.queue) {
            self.add_member(w, h, rank, self.restore_init(), out);
        }
        self.new_epoch(&format!("rolled back to step {to}"), out);
    }

    /// Checkpoints of steps after `to` belong to the abandoned lineage: they go out of
    /// `checkpoints/` (to `abandoned-checkpoints/`), so that neither a later checkpoint of
    /// the same step number nor a `--resume` meets them, and are forgotten.
    fn set_aside_checkpoints_after(&mut self, to: u64, out: &mut Out) {
        out.effect(Effect::SetAsideCheckpointsAfter(to));
        if self.last_checkpoint.as_ref().is_some_and(|(s, _)| *s > to) {
            // The newest complete checkpoint left, if any.
            self.last_checkpoint = self
                .view
                .newest_complete(to)
                .or_else(|| self.cfg.resume.clone());
        }
    }

    fn lost_message(&self) -> String {
        let saved = self.saved_step();
        let resume = if saved > 0 {
            format!("; continue from the checkpoint of step {saved} with --resume RUN_DIR")
        } else {
            "; no checkpoint was written yet (see --checkpoint-every)".into()
        };
        format!("every drafter died after step {}: the newer weights lived only in their memory{resume}", self.committed)
    }

    /// Ask a member for a snapshot for the next joiner in line. Commits wait while a join
    /// is in progress, so every snapshot taken until the next commit holds the same
    /// bytes: a joiner still reading the slot while the next one is written reads the
    /// same values either way.
    fn start_join(&mut self, out: &mut Out) {
        if self.joining().is_some() {
            return;
        }
        let Some(&(joiner, ..)) = self.queue.front() else {
            return;
        };
        let Some((&donor, _)) = self.members.iter().next() else {
            return;
        };
        self.set_joining(Some((joiner, donor)));
        out.push(Action::Send(
            donor,
            ToWorker::Snapshot {
                step: self.committed,
                slot: 0,
            },
        ));
    }

    pub fn on_snapshot_done(
        &mut self,
        worker: usize,
        step: u64,
        slot: u32,
        ms: f64,
        now: Instant,
    ) -> Out {
        let mut out = Out::default();
        if slot != 0 {
            match self.snapshot_asked {
                Some((donor, s, at)) if donor == worker && s == slot && at == step => {
                    self.snapshot_asked = None;
                    if self.snapshot_ms.is_none() {
                        log::info!(
                            "snapshot of the training state: {ms:.1} ms (taken {})",
                            self.snapshot_policy()
                        );
                    }
                    self.snapshot_ms = Some(self.snapshot_ms.map_or(ms, |m| 0.8 * m + 0.2 * ms));
                    self.progress.snapshot_step = Some(step);
                    self.progress.snapshot_ms = self.snapshot_ms;
                    self.progress.snapshot_every = self.snapshot_interval();
                    self.snapshot = Some((slot, step));
                    self.cover(step, &mut out);
                }
                // The answer to a request from before a rollback (or from a dead donor's
                // time): the slot it names was not made current.
                _ if self.members.contains_key(&worker) => {}
                _ => out.push(Action::Violation(worker, Violation::SnapshotNotAsked)),
            }
            return out;
        }
        match self.joining() {
            // The donor answers in the order it was asked, and applies every committed
            // step before a later request: a reply for an older step answers a request
            // whose joiner died before a commit. The reply to this one is still coming.
            Some((_, donor)) if donor == worker && step < self.committed => {}
            Some((joiner, donor)) if donor == worker => {
                if step != self.committed {
                    out.push(Action::Violation(
                        worker,
                        Violation::SnapshotAtOtherStep {
                            step,
                            expected: self.committed,
                        },
                    ));
                    return out;
                }
                self.set_joining(None);
                let (_, holder, rank) = self.queue.pop_front().expect("the joiner is queued");
                self.add_member(
                    joiner,
                    holder,
                    rank,
                    Init::FromState { step, slot: 0 },
                    &mut out,
                );
                let rank = self.members.get(&joiner).map_or(0, |m| m.rank);
                self.new_epoch(&format!("rank {rank} joined at step {step}"), &mut out);
                self.start_join(&mut out);
                self.try_commit(now, &mut out);
            }
            // A reply to a request whose joiner has died since: nothing to do.
            _ if self.members.contains_key(&worker) => {}
            _ => out.push(Action::Violation(worker, Violation::SnapshotNotAsked)),
        }
        out
    }

    /// Member `worker` computed the gradient of `step`.
    pub fn on_grads(&mut self, worker: usize, step: u64, g: Gradient, now: Instant) -> Out {
        let Gradient {
            input,
            batch_id,
            stats,
            params,
        } = g;
        let mut out = Out::default();
        let Some(m) = self.members.get(&worker) else {
            out.push(Action::Violation(
                worker,
                Violation::NotAMember { what: "gradients" },
            ));
            return out;
        };
        if step != self.committed + 1 || self.pending.contains_key(&worker) {
            out.push(Action::Violation(
                worker,
                Violation::GradientsOutOfOrder {
                    step,
                    expected: self.committed + 1,
                },
            ));
            return out;
        }
        self.pending.insert(
            worker,
            Pending {
                holder: m.holder,
                params,
                input,
                batch_id,
                stats,
            },
        );
        // Its batch came before the order to abstain reached it: it reduces its gradient.
        self.abstained.remove(&worker);
        self.try_commit(now, &mut out);
        out
    }

    /// A drafter's life is over.
    pub fn on_gone(&mut self, worker: usize, now: Instant) -> Out {
        let mut out = Out::default();
        let left = self.members.remove(&worker);
        if let Some(m) = &left {
            self.free_ranks.insert(m.rank);
        }
        self.pending.remove(&worker);
        self.reduced.remove(&worker);
        self.abstained.remove(&worker);
        self.queue.retain(|(w, ..)| *w != worker);
        if self
            .snapshot_asked
            .is_some_and(|(donor, ..)| donor == worker)
        {
            // Its half-written slot never becomes current.
            self.snapshot_asked = None;
        }
        if self.checkpoint_asked.is_some_and(|(w, _)| w == worker) {
            // Its checkpoint will never be complete: ask again (at the next one, or the stop).
            self.checkpoint_asked = None;
            self.checkpointed = self.saved_step();
        }
        if let Some((joiner, donor)) = self.joining() {
            if joiner == worker || donor == worker {
                self.set_joining(None);
            }
        }
        if self.members.is_empty() && self.phase.ends_after_eval() {
            // The last step is committed (and its checkpoint asked for, or written from
            // the snapshot at the stop); only its eval was left. Rolling back would lose
            // the step; the eval is dropped instead and the run ends.
            let step = self.committed;
            if let Some(e) = self.eval.as_mut() {
                e.rolled_back(step.saturating_sub(1));
            }
            log::warn!(
                "every drafter died during the eval of the last step {step}: that eval is dropped, and the run ends at step {step}"
            );
            self.phase = self.phase.with_ends_after_eval(false);
            out.push(Action::EvalEnd);
            out.push(Action::Done);
        } else if self.members.is_empty() && self.job.is_some() {
            // In a job the others go on: the node leaves the job's group until a drafter
            // of its joins again.
            self.new_epoch("this node's last drafter left", &mut out);
        } else if self.members.is_empty() {
            self.rollback(&mut out);
        } else {
            if let Some(m) = left {
                self.new_epoch(&format!("rank {} left", m.rank), &mut out);
                // Its batch goes back to the queue: the members told to abstain may get
                // it (or another) after all.
                let step = self.committed + 1;
                for w in std::mem::take(&mut self.abstained) {
                    out.push(Action::Send(w, ToWorker::Withdraw { step }));
                }
            }
            self.start_join(&mut out);
        }
        self.try_commit(now, &mut out);
        out
    }

    /// Batches consumed up to `step` are safe from any rollback: forget them.
    fn cover(&mut self, step: u64, out: &mut Out) {
        let newer = self.lineage.split_off(&(step + 1));
        self.lineage = newer;
        out.push(Action::Covered(step));
    }

    fn snapshot_policy(&self) -> String {
        match self.cfg.snapshot_every {
            Some(n) => format!("every {n} steps, --snapshot-every"),
            None => format!(
                "every {} steps, to stay under {:.0}% of the step time",
                self.snapshot_interval(),
                SNAPSHOT_BUDGET * 100.0
            ),
        }
    }

    /// Steps between snapshots: --snapshot-every, or what keeps their cost under the budget.
    fn snapshot_interval(&self) -> u64 {
        match (self.cfg.snapshot_every, self.snapshot_ms, self.step_ms) {
            (Some(n), _, _) => n.max(1),
            (None, Some(snap), Some(step)) if step > 0.0 => {
                ((snap / (SNAPSHOT_BUDGET * step)).ceil() as u64).clamp(1, 100_000)
            }
            // Not measured yet: take one at once, to measure it.
            _ => 1,
        }
    }

    /// After committing `step`: ask one member for a snapshot when one is due.
    fn maybe_snapshot(&mut self, step: u64, out: &mut Out) {
        if self.snapshot_asked.is_some() {
            return;
        }
        let last = self.snapshot.map_or(self.restore_step, |(_, s)| s);
        if step < last + self.snapshot_interval() {
            return;
        }
        let Some(&donor) = self.members.keys().next() else {
            return;
        };
        // The slot that is not current.
        let slot = if self.snapshot.is_some_and(|(s, _)| s == 1) {
            2
        } else {
            1
        };
        self.snapshot_asked = Some((donor, slot, step));
        out.push(Action::Send(donor, ToWorker::Snapshot { step, slot }));
    }

    /// The end of the data: when every batch not yet consumed is in the hands of a member
    /// that holds a gradient for the step (its pending batch, or one delivered ahead that
    /// it takes after the commit; `remaining` = batches produced and not consumed, once the
    /// loader is done; `delivered(holder)`: batches delivered to that life), the members
    /// without one will not get one for this step: they abstain, so it commits over those
    /// who have one.
    pub fn flush_tail(
        &mut self,
        remaining: Option<u64>,
        delivered: &dyn Fn(Holder) -> u64,
        now: Instant,
    ) -> Out {
        if let Some(out) = self.job_idle(remaining, now) {
            return out;
        }
        let mut out = Out::default();
        let held: u64 = self.pending.values().map(|p| delivered(p.holder)).sum();
        if self.is_frozen()
            || self.joining().is_some()
            || self.pending.is_empty()
            || !remaining.is_some_and(|r| r > 0 && r == held)
        {
            return out;
        }
        self.abstain_idle(now, &mut out);
        out
    }

    /// The members with no batch for the step in flight contribute nothing to it (the
    /// all-reduce needs every member), so it commits over those who have one.
    fn abstain_idle(&mut self, now: Instant, out: &mut Out) {
        let step = self.committed + 1;
        let idle: Vec<usize> = self
            .members
            .keys()
            .filter(|w| !self.pending.contains_key(w) && !self.abstained.contains(w))
            .copied()
            .collect();
        for w in idle {
            self.abstained.insert(w);
            out.push(Action::Send(w, ToWorker::Abstain { step }));
        }
        self.try_commit(now, out);
    }

    /// Commit once every member holds a gradient (or abstains) and has reduced it in the
    /// current epoch.
    fn try_commit(&mut self, now: Instant, out: &mut Out) {
        if self.job_try_commit(now, out) {
            return;
        }
        let all = |set: &dyn Fn(&usize) -> bool| self.members.keys().all(set);
        if self.pending.is_empty()
            || !all(&|w| self.pending.contains_key(w) || self.abstained.contains(w))
            || !all(&|w| self.reduced.contains_key(w))
        {
            return;
        }
        self.commit_with(now, None, out);
    }

    /// Commit step `committed + 1` over the members with a pending gradient; every
    /// member applies it. In a job across nodes, `job` is the leader's commit: its
    /// statistics are the job's.
    fn commit_with(&mut self, now: Instant, job: Option<JobCommit>, out: &mut Out) {
        // While an eval round scores the weights of `committed`, nothing moves them.
        if self.is_frozen()
            || self.eval_running()
            || self.joining().is_some()
            || self.members.is_empty()
            || (self.pending.is_empty() && job.is_none())
        {
            return;
        }
        let step = self.committed + 1;
        let sums: BTreeSet<u64> = self.pending.values().map(|p| p.params).collect();
        if sums.len() > 1 {
            self.phase = self.phase.frozen();
            out.push(Action::Failed(format!(
                "the drafter ranks hold different weights at step {}: data-parallel training diverged",
                self.committed
            )));
            return;
        }
        let mut contributors = self.pending.len();
        let lr = lr_at(
            step - 1,
            self.cfg.lr,
            self.cfg.warmup_steps,
            self.cfg.total_steps,
        );
        let mut stats = StepStats::default();
        for p in self.pending.values() {
            stats.merge(&p.stats);
        }
        if let Some(c) = job {
            (stats, contributors) = (c.stats, c.contributors);
        }
        // Every member's all-reduce must have summed exactly the committed batches' weights.
        if let Some((&w, &found)) = self
            .reduced
            .iter()
            .find(|(_, &r)| (r - stats.weight_sum).abs() > 1e-9 * stats.weight_sum.abs().max(1.0))
        {
            self.phase = self.phase.frozen();
            let name = self
                .members
                .get(&w)
                .map_or(String::from("?"), |m| m.rank.to_string());
            out.push(Action::Failed(format!(
                "rank {name}'s all-reduce of step {step} (epoch {}) summed loss weights {found}, the members' batches {}: the ranks reduced different memberships",
                self.epoch, stats.weight_sum
            )));
            return;
        }
        let mut batches = Vec::new();
        for (&w, p) in std::mem::take(&mut self.pending).iter() {
            out.push(Action::Consume {
                worker: w,
                holder: p.holder,
                input: p.input,
                batch_id: p.batch_id,
                step,
            });
            batches.push(p.batch_id);
        }
        self.reduced.clear();
        self.abstained.clear();
        self.all_posted_at = None;
        self.hung_in_a_row = 0;
        self.lineage.insert(step, batches);
        if let Some(t) = self.last_commit.replace(now) {
            let ms = (now - t).as_secs_f64() * 1e3;
            self.step_ms = Some(self.step_ms.map_or(ms, |m| 0.8 * m + 0.2 * ms));
        }
        for &w in self.members.keys() {
            out.push(Action::Send(
                w,
                ToWorker::Apply {
                    step,
                    epoch: self.epoch,
                    lr,
                    weight_sum: stats.weight_sum,
                },
            ));
        }
        self.committed = step;
        self.record(step, lr, contributors, &stats, out);
        if self.too_many_skipped(stats.nonfinite, out) {
            return;
        }
        self.after_commit(step, out);
    }

    /// Step `step` committed: a snapshot, a checkpoint and an eval round when due; the
    /// run's end at the step limit.
    fn after_commit(&mut self, step: u64, out: &mut Out) {
        self.maybe_snapshot(step, out);
        let periodic = self
            .cfg
            .checkpoint_every
            .is_some_and(|n| n > 0 && step % n == 0);
        let last = self.cfg.steps_limit.is_some_and(|n| step >= n);
        // An eval step is a checkpoint step too, so the best eval names a checkpoint; the
        // last step is evaluated as well, so the last checkpoint is compared too.
        let eval_step = self
            .eval
            .as_ref()
            .is_some_and(|e| e.is_eval_step(step) || last);
        let tau_step = self.tau.as_ref().is_some_and(|t| t.is_tau_step(step, last));
        if std::mem::take(&mut self.checkpoint_requested) || periodic || eval_step || tau_step {
            out.extend(self.checkpoint());
        }
        if eval_step {
            self.start_eval(out);
        }
        if last {
            self.phase = self.phase.frozen();
            if self.eval_running() {
                self.phase = self.phase.with_ends_after_eval(true);
            } else {
                out.push(Action::Done);
            }
        }
    }

    /// Count a step skipped for a non-finite loss or gradient (`nonfinite`), or end the
    /// run of them; true when `--max-skipped-steps` in a row stop the run.
    fn too_many_skipped(&mut self, nonfinite: bool, out: &mut Out) -> bool {
        if !nonfinite {
            self.skipped_in_a_row = 0;
            return false;
        }
        if self.skipped_in_a_row == 0 {
            self.good_checkpoint = self.last_checkpoint.as_ref().map(|(s, _)| *s);
        }
        self.skipped_in_a_row += 1;
        self.progress.skipped_steps += 1;
        if self.skipped_in_a_row < self.cfg.max_skipped_steps.max(1) {
            return false;
        }
        self.phase = self.phase.frozen();
        let good = match self.good_checkpoint {
            Some(s) => format!(
                "the newest checkpoint from before them is step {s} ({})",
                self.view.dir_of(s).display()
            ),
            None => "no checkpoint was written before them".into(),
        };
        out.push(Action::Failed(format!(
            "{} steps in a row had a non-finite loss or gradient and were skipped (--max-skipped-steps {}): the learning rate (--lr {}) is likely too high, or the target's weights or hidden states are not finite; {good}",
            self.skipped_in_a_row, self.cfg.max_skipped_steps, self.cfg.lr
        )));
        true
    }

    /// Is an eval round running (so no step commits)?
    pub fn eval_running(&self) -> bool {
        self.eval.as_ref().is_some_and(|e| e.running().is_some())
    }

    /// Start an eval round of the weights of the last committed step (unless it was
    /// evaluated already).
    fn start_eval(&mut self, out: &mut Out) {
        let step = self.committed;
        let Some(e) = self.eval.as_mut() else {
            return;
        };
        if let Some((round, batches)) = e.start(step) {
            log::info!(
                "eval of step {step}: {} batches ({} tokens) of {}; steps wait until it is done",
                batches.len(),
                e.set.tokens,
                e.set.path.display()
            );
            out.push(Action::EvalStart {
                round,
                step,
                batches,
            });
        }
    }

    /// The data is consumed: the last step is evaluated too (and checkpointed, so it can
    /// be the best). Returns true while that keeps the run going.
    pub fn eval_at_end(&mut self, out: &mut Out) -> bool {
        let Some(e) = self.eval.as_ref() else {
            return false;
        };
        if e.running().is_some() {
            return true;
        }
        if self.committed == 0 || self.members.is_empty() || e.done.contains(&self.committed) {
            return false;
        }
        out.extend(self.checkpoint());
        self.start_eval(out);
        self.eval_running()
    }

    /// A drafter scored eval batch `batch_id` at the weights of `step`. `Err`: a protocol
    /// violation (the report is not of the weights the round scores).
    pub fn on_evaluated(
        &mut self,
        batch_id: u64,
        step: u64,
        stats: &StepStats,
        now: Instant,
    ) -> Result<Out, Violation> {
        let mut out = Out::default();
        let Some(e) = self.eval.as_mut() else {
            return Err(Violation::NoEvalData);
        };
        match e.report(batch_id, step, stats) {
            crate::training::eval::Report::Wrong(why) => return Err(why),
            crate::training::eval::Report::Stale => return Ok(out),
            crate::training::eval::Report::Counted { done: false } => return Ok(out),
            crate::training::eval::Report::Counted { done: true } => {}
        }
        let Some((r, best)) = e.finish() else {
            return Ok(out);
        };
        let acc1 = r.slot_accuracy.first().copied().unwrap_or(0.0);
        log::info!(
            "eval at step {}: loss {:.4}, acceptance {:.2}, acc@1 {:.2} over {} batches ({} tokens, {} blocks) in {:.1} s{}",
            r.step,
            r.loss,
            r.acceptance,
            acc1,
            r.batches,
            r.tokens,
            r.blocks,
            r.ms / 1e3,
            if best { ": the best so far" } else { "" }
        );
        out.effect(Effect::Log(LogLine::Eval(r.json())));
        self.progress.eval_step = Some(r.step);
        self.progress.eval_loss = Some(r.loss);
        self.progress.eval_acceptance = Some(r.acceptance);
        if best && self.tau.is_none() {
            self.progress.best_step = Some(r.step);
            self.link_best_if_saved(r.step, &mut out);
        }
        out.push(Action::EvalEnd);
        self.try_commit(now, &mut out);
        if self.phase.ends_after_eval() {
            self.phase = self.phase.with_ends_after_eval(false);
            out.push(Action::Done);
        }
        Ok(out)
    }

    /// Point `checkpoints/best` at `step` once its checkpoint is complete (else when it
    /// is, [`Self::on_checkpointed`]).
    fn link_best_if_saved(&mut self, step: u64, out: &mut Out) {
        if self.best_step() != Some(step) || self.linked == Some(step) {
            return;
        }
        if !self.view.is_complete(step) {
            return;
        }
        let previous = self.linked.replace(step);
        out.effect(Effect::LinkBest { step, previous });
    }

    /// The best step so far: by τ with `--eval-prompts`, else by eval acceptance.
    fn best_step(&self) -> Option<u64> {
        match (&self.tau, &self.eval) {
            (Some(t), _) => t.best.map(|(s, _)| s),
            (None, Some(e)) => e.best.map(|(s, _)| s),
            (None, None) => None,
        }
    }

    /// The τ to measure now, if any: the newest complete checkpoint's step, when it is a
    /// τ step not measured yet and no measurement runs (`last`: it is the run's end).
    /// `start` marks it running (its checkpoint is then never pruned).
    pub fn tau_wanted(&mut self, last: bool, start: bool) -> Option<(u64, std::path::PathBuf)> {
        let (step, dir) = self.last_checkpoint.clone()?;
        let last = last || self.cfg.steps_limit.is_some_and(|n| step >= n);
        let t = self.tau.as_mut()?;
        if !t.wants(step, last) {
            return None;
        }
        if start {
            t.running = Some(step);
        }
        Some((step, dir))
    }

    /// The newest checkpoint is a τ step that must wait for the measurement of another:
    /// (its step, the step measured), once; it is not measured.
    pub fn tau_busy(&mut self) -> Option<(u64, u64)> {
        let (step, _) = self.last_checkpoint.clone()?;
        let last = self.cfg.steps_limit.is_some_and(|n| step >= n);
        let running = self.tau.as_mut()?.busy_with(step, last)?;
        Some((step, running))
    }

    /// The τ of the weights of `r.step` was measured: recorded, and `checkpoints/best`
    /// names it when it is the best so far (dropped if a rollback went back past it).
    pub fn on_tau(&mut self, r: &crate::training::tau::TauResult) -> Option<Out> {
        let mut out = Out::default();
        let Some(best) = self.tau.as_mut().and_then(|t| t.finish(r)) else {
            log::info!(
                "τ of step {} dropped: the group rolled back past it",
                r.step
            );
            return None;
        };
        log::info!(
            "τ at step {}: pooled {:.3} (95% CI [{:.2}, {:.2}]), mean of per-prompt means {:.3} (95% CI [{:.2}, {:.2}]) over {} prompts in {:.1} s{}",
            r.step,
            r.pooled,
            r.pooled_ci95[0],
            r.pooled_ci95[1],
            r.mean_of_means,
            r.mean_of_means_ci95[0],
            r.mean_of_means_ci95[1],
            r.prompts,
            r.seconds,
            if best { ": the best so far" } else { "" }
        );
        out.effect(Effect::Log(LogLine::Tau(r.json())));
        self.progress.tau = Some(r.json());
        if best {
            self.progress.best_step = Some(r.step);
            self.link_best_if_saved(r.step, &mut out);
        }
        Some(out)
    }

    /// The τ of `step` could not be measured (`passed_over`: by the cost share): not
    /// tried again.
    pub fn on_tau_failed(&mut self, step: u64, passed_over: bool) {
        if let Some(t) = self.tau.as_mut() {
            if passed_over {
                t.pass_over(step);
            } else {
                t.failed(step);
            }
        }
    }

    /// `checkpoints/best` could not be pointed at `step`: it still points at `previous`.
    pub fn on_best_link_failed(&mut self, step: u64, previous: Option<u64>) {
        if self.linked == Some(step) {
            self.linked = previous;
        }
    }

    /// The steps whose checkpoints are never pruned: the one `checkpoints/best` points
    /// at, and the one whose τ is measured now.
    pub fn protected_steps(&self) -> Vec<u64> {
        self.linked
            .into_iter()
            .chain(self.tau.as_ref().and_then(|t| t.running))
            .collect()
    }

    fn record(&mut self, step: u64, lr: f64, contributors: usize, s: &StepStats, out: &mut Out) {
        let acc: Vec<f64> = s
            .slot_correct
            .iter()
            .zip(&s.slot_total)
            .skip(1)
            .map(|(c, t)| if *t > 0 { *c as f64 / *t as f64 } else { 0.0 })
            .collect();
        let line = serde_json::json!({
            "step": step, "loss": s.loss(), "acceptance": s.acceptance(), "slot_accuracy": acc,
            "lr": lr, "members": self.group_size(), "contributors": contributors, "group_epoch": self.epoch,
            "reduce_ms": self.reduce_ms.iter().copied().fold(0.0, f64::max),
            "tokens": s.tokens, "anchors": s.anchors, "blocks": s.blocks,
            "wait_ms": s.wait_ms, "compute_ms": s.compute_ms, "optimizer_ms": s.optimizer_ms,
            "skipped": s.nonfinite,
        });
        out.effect(Effect::Log(LogLine::Step(line)));
        self.reduce_ms.clear();
        self.progress.step = step;
        self.progress.loss = s.loss();
        self.progress.lr = Some(lr);
        self.progress.acceptance = s.acceptance();
        self.progress.slot_accuracy = acc;
        self.progress.members = self.group_size();
    }

    /// The run is stopping and nothing can be saved (its directory is gone): no step
    /// commits from now on, and nothing is written.
    pub fn freeze(&mut self) {
        self.phase = self.phase.frozen();
    }

    /// The run is stopping: from now on no step commits, and the last committed step is
    /// checkpointed. By one member (which first copies its state into the snapshot slot,
    /// so that its death while writing leaves the supervisor holding that step), or, with
    /// no member left, from the snapshot when it is newer than the newest checkpoint. The
    /// drafter is exported from that checkpoint once every worker has stopped.
    pub fn stop_checkpoint(&mut self) -> Out {
        self.phase = self.phase.frozen();
        let mut out = Out::default();
        if !self.saves_checkpoints() {
            return out;
        }
        let held = self
            .snapshot_asked
            .map_or(self.snapshot.map(|(_, s)| s), |(_, _, at)| Some(at));
        if self.committed > self.saved_step() && held.is_none_or(|s| s < self.committed) {
            // A snapshot still being written (of an older step) is written again, in the
            // same slot (not the current one), at the last step; otherwise the slot that
            // is not current.
            let (donor, slot) = match self.snapshot_asked {
                Some((donor, slot, _)) => (Some(donor), slot),
                None => (
                    self.members.keys().next().copied(),
                    if self.snapshot.is_some_and(|(s, _)| s == 1) {
                        2
                    } else {
                        1
                    },
                ),
            };
            if let Some(donor) = donor.filter(|d| self.members.contains_key(d)) {
                self.snapshot_asked = Some((donor, slot, self.committed));
                out.push(Action::Send(
                    donor,
                    ToWorker::Snapshot {
                        step: self.committed,
                        slot,
                    },
                ));
            }
        }
        out.extend(self.checkpoint());
        if self.members.is_empty() {
            out.extend(self.checkpoint_held_snapshot());
        }
        out
    }

    /// No drafter is left (the run has ended, or every one died during the stop): when the
    /// snapshot holds a step newer than the newest checkpoint, write it as one.
    pub fn checkpoint_held_snapshot(&mut self) -> Option<Action> {
        let (_, step) = self.snapshot?;
        if !self.saves_checkpoints() {
            return None;
        }
        if !self.members.is_empty() || step <= self.saved_step() || step > self.committed {
            return None;
        }
        if self.checkpoint_asked.is_some() {
            return None;
        }
        self.checkpointed = step;
        let dir = self.view.dir_of(step);
        Some(Action::CheckpointFromSnapshot { step, dir })
    }

    /// What a checkpoint's meta.json records for the export: the target layers the
    /// drafter reads, out of how many.
    pub fn export_meta(&self) -> serde_json::Value {
        serde_json::json!({
            "target_layer_ids": self.cfg.target_layer_ids,
            "num_target_layers": self.cfg.num_target_layers,
        })
    }

    /// The newest complete checkpoint (step, directory), if any.
    pub fn last_checkpoint(&self) -> Option<&(u64, std::path::PathBuf)> {
        self.last_checkpoint.as_ref()
    }

    /// The current snapshot: (slot, step).
    pub fn snapshot(&self) -> Option<(u32, u64)> {
        self.snapshot
    }

    /// Bytes a checkpoint takes on disk (parameters and two Adam moments, f32, plus JSON).
    fn checkpoint_bytes(&self) -> u64 {
        ParamLayout::new(&self.cfg.drafter).total as u64 * 12 + 64 * 1024
    }

    /// A checkpoint of the last committed step, by one member. A filesystem without room
    /// for it stops the run at once (a skipped checkpoint is a failed one: training on
    /// would leave every step since the newest checkpoint unsaved), said once.
    pub fn checkpoint(&mut self) -> Vec<Action> {
        if self.members.is_empty()
            || self.committed <= self.checkpointed
            || !self.saves_checkpoints()
        {
            return vec![];
        }
        if let Err(why) = self.view.room_for(self.committed, self.checkpoint_bytes()) {
            if self.no_room_said {
                return vec![];
            }
            self.no_room_said = true;
            let kept = self.last_checkpoint.as_ref().map_or(
                "no checkpoint of this run is on disk yet".to_string(),
                |(s, d)| format!("the newest checkpoint, step {s} ({}), is kept", d.display()),
            );
            return vec![Action::Failed(format!(
                "{why}: stopping the run ({kept}); then continue with --resume"
            ))];
        }
        match self.members.keys().next() {
            Some(&w) => {
                self.checkpointed = self.committed;
                self.checkpoint_asked = Some((w, self.committed));
                let dir = self.view.dir_of(self.committed);
                vec![Action::Checkpoint {
                    worker: w,
                    step: self.committed,
                    dir,
                }]
            }
            _ => vec![],
        }
    }

    /// The member asked for the checkpoint of `step` could not write it (see
    /// [`ToWorker::Checkpoint`]): it is not a rollback target, and the next checkpoint
    /// asks again.
    pub fn on_checkpoint_failed(&mut self, step: u64) {
        if self.checkpoint_asked.is_some_and(|(_, s)| s == step) {
            self.checkpoint_asked = None;
        }
        self.checkpointed = self.saved_step();
    }

    /// A checkpoint is complete: a rollback target from now on; keep the newest
    /// `keep_checkpoints`.
    pub fn on_checkpointed(&mut self, dir: String, step: u64) -> Out {
        let mut out = Out::default();
        log::info!(
            "checkpoint of step {step} written to {dir} ({})",
            crate::data::pipeline::human(dir_bytes(std::path::Path::new(&dir)))
        );
        if self.checkpoint_asked.is_some_and(|(_, s)| s == step) {
            self.checkpoint_asked = None;
        }
        // A rollback target from now on. It does not end the rollback window of the
        // batches before it (only a snapshot does): the checkpoint may fail its check when
        // a rollback needs it, and the group then goes back further.
        if step <= self.committed
            && self
                .last_checkpoint
                .as_ref()
                .is_none_or(|(s, _)| *s <= step)
        {
            self.last_checkpoint = Some((step, dir.clone().into()));
        }
        self.link_best_if_saved(step, &mut out);
        out.effect(Effect::PruneCheckpoints);
        out
    }

    pub fn on_exported(&mut self, dir: String, step: u64) {
        log::info!(
            "drafter at step {step} written to {dir} ({})",
            crate::data::pipeline::human(dir_bytes(std::path::Path::new(&dir)))
        );
        self.progress.exported = Some(dir);
        self.progress.exported_step = Some(step);
    }

    /// A resumed session before its first step: its progress is the checkpoint's step,
    /// with the loss, acceptance and slot accuracy train.jsonl recorded for it (`line`).
    pub fn resumed_at(&mut self, step: u64, line: Option<&serde_json::Value>) {
        self.progress.step = step;
        if let Some(l) = line {
            self.progress.loss = l["loss"].as_f64().unwrap_or(0.0);
            self.progress.acceptance = l["acceptance"].as_f64().unwrap_or(0.0);
            self.progress.slot_accuracy = l["slot_accuracy"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(serde_json::Value::as_f64)
                .collect();
        }
    }

    /// The step this run (session) started from: 0, or the resumed checkpoint's.
    pub fn base_step(&self) -> u64 {
        self.base.0
    }

    /// The first epoch was cut into `batches` batches: a schedule whose length was
    /// estimated from the data takes the exact one. Returns what changed, in words.
    pub fn refine_schedule(&mut self, batches: u64) -> Option<String> {
        let s = self.cfg.schedule.as_mut()?;
        let msg = s.refine(batches)?;
        self.cfg.warmup_steps = s.warmup_steps;
        self.cfg.total_steps = s.total_steps;
        Some(msg)
    }

    /// Write a checkpoint at the next committed step (a pre-emption notice). Returns that
    /// step; `None` when one is asked for already and not yet taken (a storm of notices
    /// is one request).
    pub fn request_checkpoint(&mut self) -> Option<u64> {
        if self.checkpoint_requested {
            return None;
        }
        self.checkpoint_requested = true;
        Some(self.committed + 1)
    }

    /// Every setting as the run uses it, the schedule as it stands now.
    pub fn settings(&self) -> serde_json::Value {
        let mut v = self.cfg.settings.clone();
        if let (serde_json::Value::Object(m), Some(s)) = (&mut v, &self.cfg.schedule) {
            m.insert("schedule".into(), s.to_json());
        }
        v
    }

    /// `--steps`, if given.
    pub fn steps_limit(&self) -> Option<u64> {
        self.cfg.steps_limit
    }

    /// The learning-rate schedule as it stands (run.json, events).
    pub fn schedule(&self) -> Option<&crate::training::schedule::Schedule> {
        self.cfg.schedule.as_ref()
    }

    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// The newest step a complete checkpoint holds (the run's start when none).
    pub fn saved_step(&self) -> u64 {
        self.last_checkpoint
            .as_ref()
            .map_or(self.base.0, |(s, _)| *s)
    }

    pub fn checkpoints_dir(&self) -> &Path {
        &self.cfg.checkpoints_dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::pool::PoolGeometry;
    use dflash_shared::protocol::PoolId;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// The disk as the group sees it, in memory: which steps are complete, which fail
    /// their check, whether there is room.
    #[derive(Clone, Default)]
    struct Disk {
        complete: Arc<Mutex<BTreeSet<u64>>>,
        bad: Arc<Mutex<BTreeSet<u64>>>,
        full: bool,
    }

    impl CheckpointView for Disk {
        fn verify(
            &self,
            dir: &Path,
            _: &DrafterConfig,
        ) -> Result<u64, dflash_shared::checkpoint::Refused> {
            let step =
                dflash_shared::checkpoint::step_of_dir(&dir.file_name().unwrap().to_string_lossy())
                    .unwrap();
            match self.bad.lock().unwrap().contains(&step) {
                true => Err(dflash_shared::checkpoint::Refused {
                    file: dir.to_path_buf(),
                    problem: dflash_shared::checkpoint::Problem::DataLength,
                }),
                false => Ok(step),
            }
        }
        fn is_complete(&self, step: u64) -> bool {
            self.complete.lock().unwrap().contains(&step)
        }
        fn newest_complete(&self, at_most: u64) -> Option<(u64, PathBuf)> {
            let c = self.complete.lock().unwrap();
            c.range(..=at_most)
                .next_back()
                .map(|&s| (s, self.dir_of(s)))
        }
        fn room_for(&self, step: u64, _: u64) -> Result<(), String> {
            if self.full {
                Err(format!("no room for the checkpoint of step {step}"))
            } else {
                Ok(())
            }
        }
        fn dir_of(&self, step: u64) -> PathBuf {
            PathBuf::from(format!("/nonexistent/checkpoints/step-{step:08}"))
        }
    }

    /// A group of this run's command line over `disk`, at `t0`: no file, pool or clock.
    fn group(flags: &[&str], disk: &Disk, t0: Instant) -> Group {
        let mut v = vec!["--gpus", "cpu:3", "--targets", "1"];
        v.extend(flags);
        let args = crate::cli::run_args(&v);
        let plan = crate::run::plan(&args, &mut || Ok(0)).unwrap();
        let target = crate::run::target_config("tiny").unwrap();
        let (_, pipeline_cfg) = crate::run::data_config(&args, &plan, &target).unwrap();
        let mut cfg =
            crate::run::trainer_config(&args, &plan, &target, &pipeline_cfg.capture).unwrap();
        cfg.checkpoints_dir = "/nonexistent/checkpoints".into();
        let pool = |name: &str| PoolInfo {
            id: PoolId::Hidden,
            fd: -1,
            geometry: PoolGeometry {
                name: name.into(),
                slots: 1,
                slot_bytes: 64,
            },
        };
        let history = History {
            linked: None,
            evals: BTreeMap::new(),
            taus: BTreeMap::new(),
        };
        Group::new(
            cfg,
            pool("grads"),
            pool("state"),
            Box::new(disk.clone()),
            history,
            t0,
        )
    }

    fn grad(batch_id: u64) -> Gradient {
        Gradient {
            input: SlotRef {
                pool: PoolId::Hidden,
                slot: batch_id as u32,
                gen: 1,
            },
            batch_id,
            stats: StepStats {
                loss_sum: 2.0,
                weight_sum: 1.0,
                tokens: 8,
                ..Default::default()
            },
            params: 7,
        }
    }

    /// Workers 1 and 2 join as ranks 0 and 1; returns the epoch of both.
    fn two_members(g: &mut Group) -> u64 {
        g.on_ready(1, 11, 0);
        g.on_ready(2, 12, 1);
        g.epoch
    }

    /// Both members report and reduce step `n` at `now`.
    fn step(g: &mut Group, epoch: u64, n: u64, now: Instant) -> Out {
        g.on_grads(1, n, grad(2 * n), now);
        g.on_grads(2, n, grad(2 * n + 1), now);
        g.on_reduced(1, n, epoch, 2.0, 1.0, now);
        g.on_reduced(2, n, epoch, 2.0, 1.0, now)
    }

    /// The ranks a node reported to the leader in `out`.
    fn ranks_of(out: &Out) -> Vec<Vec<u32>> {
        out.actions
            .iter()
            .filter_map(|a| match a {
                Action::Job(JobReport::Ranks(r)) => Some(r.clone()),
                _ => None,
            })
            .collect()
    }

    /// Node 1 of a job: job ranks, the leader's epochs, a report instead of a commit,
    /// the leader's commit with the job's statistics, and no rollback when its last
    /// drafter leaves.
    #[test]
    fn a_node_of_a_job_reports_its_steps_and_commits_them_when_the_leader_does() {
        let t0 = Instant::now();
        let mut g = group(&[], &Disk::default(), t0);
        g.join_job(1);
        let out = g.on_ready(1, 11, 0);
        assert_eq!(ranks_of(&out), [vec![1000]]);
        assert!(out
            .actions
            .iter()
            .any(|a| matches!(a, Action::Send(1, ToWorker::Train(s)) if s.rank == 1000)));
        let out = g.on_ready(2, 12, 1);
        assert_eq!(ranks_of(&out), [vec![1000, 1001]]);
        assert!(
            !out.actions
                .iter()
                .any(|a| matches!(a, Action::Send(_, ToWorker::Group { .. }))),
            "the epoch is the leader's: {out:?}"
        );
        let job = vec![0, 1000, 1001];
        let out = g.on_job_epoch(5, job.clone(), t0);
        let groups: Vec<usize> = out
            .actions
            .iter()
            .filter_map(|a| match a {
                Action::Send(
                    w,
                    ToWorker::Group {
                        epoch: 5,
                        ranks,
                        id: None,
                    },
                ) if *ranks == job => Some(*w),
                _ => None,
            })
            .collect();
        assert_eq!(groups, [1, 2]);
        // Rank 0 (on node 0) makes the id: a member of this node claiming it is refused.
        let out = g.on_group_id(1, 5, vec![9]);
        assert!(matches!(out.actions.as_slice(), [Action::Violation(1, _)]));
        let out = g.on_job_id(5, &[9]);
        assert_eq!(out.actions.len(), 2, "to both members: {out:?}");
        g.on_grads(1, 1, grad(2), t0);
        g.on_grads(2, 1, grad(3), t0);
        g.on_reduced(1, 1, 5, 3.0, 1.0, t0);
        let out = g.on_reduced(2, 1, 5, 3.0, 1.0, t0);
        let reports: Vec<&Action> = out
            .actions
            .iter()
            .filter(|a| matches!(a, Action::Job(JobReport::Reduced { .. })))
            .collect();
        let [Action::Job(JobReport::Reduced {
            epoch: 5,
            step: 1,
            batches,
            stats,
        })] = reports.as_slice()
        else {
            panic!("one report of step 1: {out:?}")
        };
        assert_eq!((batches.as_slice(), stats.weight_sum), (&[2, 3][..], 2.0));
        assert_eq!(g.committed(), 0, "not before the leader commits");
        let job_stats = StepStats {
            loss_sum: 9.0,
            weight_sum: 3.0,
            ..Default::default()
        };
        let out = g.on_job_commit(
            JobCommit {
                step: 1,
                stats: job_stats,
                contributors: 3,
            },
            t0,
        );
        assert_eq!(g.committed(), 1);
        let applied = out
            .actions
            .iter()
            .filter(|a| matches!(a, Action::Send(_, ToWorker::Apply { step: 1, weight_sum, .. }) if *weight_sum == 3.0))
            .count();
        let consumed = out
            .actions
            .iter()
            .filter(|a| matches!(a, Action::Consume { step: 1, .. }))
            .count();
        assert_eq!((applied, consumed), (2, 2), "{out:?}");
        let [Effect::Log(LogLine::Step(line))] = out.effects.as_slice() else {
            panic!("one step line: {:?}", out.effects)
        };
        assert_eq!(line["contributors"].as_u64(), Some(3));
        assert_eq!(line["loss"].as_f64(), Some(3.0), "the job's loss");
    }

    /// A node of a job: a commit ahead of it is out of step; its last drafter leaving is
    /// no rollback but empty ranks for the leader.
    #[test]
    fn a_node_of_a_job_fails_on_a_commit_ahead_and_leaves_without_rolling_back() {
        let t0 = Instant::now();
        let mut g = group(&[], &Disk::default(), t0);
        g.join_job(1);
        g.on_ready(1, 11, 0);
        g.on_job_epoch(5, vec![1000], t0);
        // A commit ahead of this node: out of step.
        let out = g.on_job_commit(
            JobCommit {
                step: 3,
                stats: StepStats::default(),
                contributors: 1,
            },
            t0,
        );
        assert!(matches!(out.actions.as_slice(), [Action::Failed(_)]));
        // Its last drafter leaves: no rollback, the leader hears of no ranks.
        let mut g = group(&[], &Disk::default(), t0);
        g.join_job(1);
        g.on_ready(1, 11, 0);
        let out = g.on_gone(1, t0);
        assert_eq!(ranks_of(&out), [Vec::<u32>::new()]);
        assert!(!out
            .actions
            .iter()
            .any(|a| matches!(a, Action::Rollback { .. } | Action::Failed(_))));
    }

    #[test]
    fn a_commit_logs_its_step_as_an_effect_and_times_steps_by_the_given_clock() {
        let t0 = Instant::now();
        let mut g = group(&[], &Disk::default(), t0);
        let epoch = two_members(&mut g);
        let out = step(&mut g, epoch, 1, t0);
        assert_eq!(g.committed(), 1);
        let consumed = out
            .actions
            .iter()
            .filter(|a| matches!(a, Action::Consume { step: 1, .. }))
            .count();
        assert_eq!(consumed, 2, "{out:?}");
        let [Effect::Log(LogLine::Step(line))] = out.effects.as_slice() else {
            panic!("one step line: {:?}", out.effects)
        };
        assert_eq!(
            (line["step"].as_u64(), line["contributors"].as_u64()),
            (Some(1), Some(2))
        );
        assert!(
            line.get("t").is_none(),
            "the log stamps the time, not the group"
        );
        step(&mut g, epoch, 2, t0 + Duration::from_millis(250));
        assert_eq!(g.step_ms, Some(250.0), "from the times passed in");
    }

    #[test]
    fn the_phase_carries_a_join_through_a_freeze_until_the_joiner_is_in() {
        let t0 = Instant::now();
        let mut g = group(&[], &Disk::default(), t0);
        let epoch = two_members(&mut g);
        assert_eq!(g.phase(), Phase::Training);
        step(&mut g, epoch, 1, t0);
        // Rank 1 dies and comes back (worker 3): it joins from rank 0's state.
        g.on_gone(2, t0);
        let out = g.on_ready(3, 13, 1);
        assert_eq!(
            g.phase(),
            Phase::Joining {
                joiner: 3,
                donor: 1
            }
        );
        assert!(matches!(
            out.actions.as_slice(),
            [Action::Send(1, ToWorker::Snapshot { step: 1, slot: 0 })]
        ));
        g.on_grads(1, 2, grad(10), t0);
        g.freeze();
        assert_eq!(
            g.phase(),
            Phase::Frozen {
                joining: Some((3, 1)),
                ends_after_eval: false
            }
        );
        let out = g.on_snapshot_done(1, 1, 0, 5.0, t0);
        assert!(
            out.actions
                .iter()
                .any(|a| matches!(a, Action::Send(3, ToWorker::Train(_)))),
            "{out:?}"
        );
        assert_eq!(
            g.phase(),
            Phase::Frozen {
                joining: None,
                ends_after_eval: false
            }
        );
        // Every member reduces step 2 in the epoch of both: frozen, it does not commit.
        g.on_grads(3, 2, grad(11), t0);
        g.on_reduced(1, 2, g.epoch, 2.0, 1.0, t0);
        g.on_reduced(3, 2, g.epoch, 2.0, 1.0, t0);
        assert_eq!(g.committed(), 1);
    }

    #[test]
    fn a_rollback_passes_over_a_checkpoint_that_fails_its_check_and_sets_newer_ones_aside() {
        let t0 = Instant::now();
        let disk = Disk::default();
        let mut g = group(&["--checkpoint-every", "1"], &disk, t0);
        let epoch = two_members(&mut g);
        for n in [1, 2] {
            let out = step(&mut g, epoch, n, t0);
            let Some(Action::Checkpoint { step, dir, .. }) = out
                .actions
                .iter()
                .find(|a| matches!(a, Action::Checkpoint { .. }))
            else {
                panic!("a checkpoint of step {n} is asked for: {out:?}")
            };
            assert_eq!((*step, dir), (n, &disk.dir_of(n)));
            disk.complete.lock().unwrap().insert(n);
            let out = g.on_checkpointed(dir.display().to_string(), n);
            assert_eq!(out.effects, [Effect::PruneCheckpoints]);
        }
        assert_eq!(g.saved_step(), 2);
        disk.bad.lock().unwrap().insert(2);
        g.on_gone(1, t0);
        let out = g.on_gone(2, t0);
        assert!(
            out.actions.iter().any(|a| matches!(
                a,
                Action::Rollback { from: 2, to: 0, batches } if batches.len() == 4
            )),
            "{out:?}"
        );
        assert_eq!(
            out.effects,
            [
                Effect::Log(LogLine::Rollback {
                    from: 2,
                    to: 0,
                    batches: 4,
                    source: "the run's fresh start".into()
                }),
                Effect::SetAsideCheckpointsAfter(0)
            ]
        );
        assert_eq!((g.committed(), g.saved_step()), (0, 0));
        assert_eq!(g.last_checkpoint(), None, "none at or before step 0");
    }

    #[test]
    fn tau_steps_are_checkpointed_measured_once_kept_from_pruning_and_the_best_tau_is_linked() {
        let t0 = Instant::now();
        let disk = Disk::default();
        let mut g = group(&["--checkpoint-every", "100"], &disk, t0);
        g.cfg.tau_every = Some(2);
        g.tau = Some(crate::training::tau::TauTrack::new(2));
        let epoch = two_members(&mut g);
        let tau = |step: u64, pooled: f64| crate::training::tau::TauResult {
            step,
            prompts: 2,
            block_size: 8,
            max_new_tokens: 4,
            mean_of_means: pooled,
            mean_of_means_ci95: [1.0, pooled],
            pooled,
            pooled_ci95: [1.0, pooled],
            histogram: vec![1; 8],
            identical_to_greedy: 2,
            seconds: 0.5,
        };
        let mut links = Vec::new();
        for (n, pooled) in [(1, 0.0), (2, 2.0), (3, 0.0), (4, 1.5)] {
            let out = step(&mut g, epoch, n, t0);
            let asked = out
                .actions
                .iter()
                .any(|a| matches!(a, Action::Checkpoint { step, .. } if *step == n));
            assert_eq!(asked, n % 2 == 0, "step {n}: {out:?}");
            if !asked {
                continue;
            }
            assert!(
                g.tau_wanted(false, false).is_none(),
                "not before it is complete"
            );
            disk.complete.lock().unwrap().insert(n);
            g.on_checkpointed(disk.dir_of(n).display().to_string(), n);
            assert_eq!(g.tau_wanted(false, true), Some((n, disk.dir_of(n))));
            assert!(g.tau_wanted(false, true).is_none(), "one at a time");
            assert!(
                g.protected_steps().contains(&n),
                "never pruned while measured"
            );
            let out = g.on_tau(&tau(n, pooled)).expect("the step measured");
            assert!(out
                .effects
                .iter()
                .any(|e| matches!(e, Effect::Log(LogLine::Tau(v)) if v["step"] == n)));
            links.extend(out.effects.iter().filter_map(|e| match e {
                Effect::LinkBest { step, .. } => Some(*step),
                _ => None,
            }));
            assert!(g.tau_wanted(false, true).is_none(), "measured once");
        }
        assert_eq!(links, [2], "the lower τ of step 4 links nothing");
        assert_eq!(g.protected_steps(), [2]);
        assert_eq!(g.progress.best_step, Some(2));
        assert_eq!(g.progress.tau.as_ref().unwrap()["step"], 4);
    }

    #[test]
    fn no_room_for_a_checkpoint_stops_the_run_once_instead_of_skipping_it() {
        let t0 = Instant::now();
        let disk = Disk {
            full: true,
            ..Disk::default()
        };
        let mut g = group(&["--checkpoint-every", "1"], &disk, t0);
        let epoch = two_members(&mut g);
        let out = step(&mut g, epoch, 1, t0);
        assert_eq!(g.committed(), 1);
        assert!(
            !out.actions
                .iter()
                .any(|a| matches!(a, Action::Checkpoint { .. })),
            "{out:?}"
        );
        assert_eq!(g.saved_step(), 0);
        let failed: Vec<&String> = out
            .actions
            .iter()
            .filter_map(|a| match a {
                Action::Failed(m) => Some(m),
                _ => None,
            })
            .collect();
        assert!(
            failed.len() == 1
                && failed[0].contains("no room for the checkpoint of step 1")
                && failed[0].contains("stopping the run")
                && failed[0].contains("--resume"),
            "a skipped checkpoint is a failed one: {out:?}"
        );
        // Said once: a later try (the stop's) asks for nothing and says nothing again.
        assert!(g.checkpoint().is_empty());
    }
}
