//! The drafter group as the dispatcher drives it: the group's state machine
//! ([`crate::training::group`]) with what it needs around it. The [`Trainer`] owns the
//! shared-memory pools the ranks exchange gradients and state through, the checkpoints
//! directory ([`CheckpointStore`]) and the training log ([`TrainLog`]); it gives the
//! group the time, carries out the group's [`Effect`]s on the disk, and hands its
//! [`Action`]s on to the dispatcher. See [`crate::training::group`] for how the group
//! trains, rolls back, snapshots and checkpoints.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Instant;

use dflash_shared::drafter::{
    state_bytes, CollectiveKind, DrafterConfig, ParamLayout, StepStats, GRAD_SLOT_HEADER,
};
use dflash_shared::pool::{PoolGeometry, PoolMap};
use dflash_shared::protocol::{PoolId, PoolInfo, SlotRef};
use dflash_shared::slots::Holder;

pub use crate::training::group::{Action, EvalSettings, TrainerConfig};

use crate::error::Error;
use crate::state::TrainProgress;
use crate::training::checkpoint_store::{CheckpointStore, StoreError};
use crate::training::group::{Effect, Gradient, Group, History, Out};
use crate::training::train_log::{LogLine, TrainLog};

/// Why the supervisor could not write a checkpoint from its snapshot.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotCheckpointError {
    #[error("no snapshot of step {step}")]
    NoSnapshot { step: u64 },
    #[error("the snapshot slot holds step {held}, expected {expected}")]
    WrongStep { held: u64, expected: u64 },
    #[error("the training state at step {step} is not finite: no checkpoint written")]
    NotFinite { step: u64 },
    #[error("the snapshot as safetensors: {0}")]
    Safetensors(#[source] safetensors::SafeTensorError),
    #[error("the supervisor's checkpoint metadata is not JSON: {0}")]
    Meta(#[source] serde_json::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub struct Trainer {
    group: Group,
    store: CheckpointStore,
    log: TrainLog,
    grads_fd: OwnedFd,
    _grads_map: PoolMap,
    state_fd: OwnedFd,
    state_map: PoolMap,
}

impl Trainer {
    pub fn new(cfg: TrainerConfig, run_dir: &Path) -> Result<Trainer, Error> {
        let params = ParamLayout::new(&cfg.drafter).total;
        let grads_geometry = PoolGeometry {
            name: "grads".into(),
            slots: 2 * cfg.max_ranks.max(1),
            slot_bytes: Self::grad_slot_bytes(params, cfg.collective),
        };
        // Slot 0: a joining rank's state; 1 and 2: the rollback snapshot, double-buffered.
        let state_geometry = PoolGeometry {
            name: "drafter-state".into(),
            slots: 3,
            slot_bytes: state_bytes(params),
        };
        let mk = |g: &PoolGeometry| {
            PoolMap::create(g.clone()).map_err(|e| Error::SharedMemory {
                pool: g.name.clone(),
                source: e.into(),
            })
        };
        let (grads_fd, grads_map) = mk(&grads_geometry)?;
        let (state_fd, state_map) = mk(&state_geometry)?;
        let mut log = TrainLog::open(run_dir)?;
        let store = CheckpointStore::new(cfg.checkpoints_dir.clone(), cfg.keep_checkpoints);
        store.remove_unfinished(run_dir);
        if let Some((step, _)) = &cfg.resume {
            log.write(&LogLine::Resumed { to: *step });
        }
        let history = if cfg.eval.is_some() || cfg.tau_every.is_some() {
            History {
                linked: crate::training::eval::best_step(store.dir()),
                evals: TrainLog::evals(run_dir),
                taus: TrainLog::taus(run_dir),
            }
        } else {
            History {
                linked: None,
                evals: Default::default(),
                taus: Default::default(),
            }
        };
        let info = |fd: &OwnedFd, geometry: PoolGeometry| PoolInfo {
            id: PoolId::Hidden,
            fd: fd.as_raw_fd(),
            geometry,
        };
        let resumed = cfg.resume.as_ref().map(|(step, _)| *step);
        let mut group = Group::new(
            cfg,
            info(&grads_fd, grads_geometry),
            info(&state_fd, state_geometry),
            Box::new(store.clone()),
            history,
            Instant::now(),
        );
        if let Some(step) = resumed {
            // Until its first step, the session is where its checkpoint is.
            group.resumed_at(step, TrainLog::step_line(run_dir, step).as_ref());
        }
        Ok(Trainer {
            group,
            store,
            log,
            grads_fd,
            _grads_map: grads_map,
            state_fd,
            state_map,
        })
    }

    /// Bytes of shared memory for a drafter config and rank count (for the start-up check).
    pub fn shared_bytes(drafter: &DrafterConfig, ranks: u32, collective: CollectiveKind) -> u64 {
        let p = ParamLayout::new(drafter).total;
        2 * ranks.max(1) as u64 * Self::grad_slot_bytes(p, collective)
            + 3 * state_bytes(p)
            + 2 * 4096
    }

    /// A gradient slot: the stamp and the gradient for the shared-memory collective; NCCL
    /// ranks and a lone rank keep their gradients on their devices and use none.
    fn grad_slot_bytes(params: usize, collective: CollectiveKind) -> u64 {
        match collective {
            CollectiveKind::Shm => GRAD_SLOT_HEADER + params as u64 * 4,
            CollectiveKind::Nccl | CollectiveKind::Local => GRAD_SLOT_HEADER,
        }
    }

    pub fn inherit_fds(&self) -> Vec<RawFd> {
        vec![self.grads_fd.as_raw_fd(), self.state_fd.as_raw_fd()]
    }

    /// Carry out the effects of `out`, in order; the actions are the dispatcher's.
    fn carry_out(&mut self, out: Out) -> Vec<Action> {
        for e in out.effects {
            match e {
                Effect::Log(line) => self.log.write(&line),
                Effect::PruneCheckpoints => {
                    self.store.prune(&self.group.protected_steps());
                }
                Effect::SetAsideCheckpointsAfter(to) => {
                    self.store.set_aside_after(to);
                }
                Effect::LinkBest { step, previous } => self.link_best(step, previous),
                Effect::UnlinkBest => self.store.unlink_best(),
            }
        }
        out.actions
    }

    /// See [`Group::tau_busy`].
    pub fn tau_busy(&mut self) -> Option<(u64, u64)> {
        self.group.tau_busy()
    }

    /// The τ to measure now (see [`Group::tau_wanted`]); `start`: it starts.
    pub fn tau_wanted(&mut self, last: bool, start: bool) -> Option<(u64, std::path::PathBuf)> {
        self.group.tau_wanted(last, start)
    }

    /// A τ measurement came in: recorded, and perhaps the best checkpoint. False when
    /// it was dropped (a rollback went back past its step).
    pub fn on_tau(&mut self, r: &crate::training::tau::TauResult) -> bool {
        let Some(out) = self.group.on_tau(r) else {
            return false;
        };
        let rest = self.carry_out(out);
        debug_assert!(rest.is_empty(), "a τ asks nothing of the dispatcher");
        true
    }

    /// The τ of `step` could not be measured (`passed_over`: by the cost share).
    pub fn on_tau_failed(&mut self, step: u64, passed_over: bool) {
        self.group.on_tau_failed(step, passed_over);
    }

    fn link_best(&mut self, step: u64, previous: Option<u64>) {
        let link = self.store.dir().join(crate::training::eval::BEST_LINK);
        let dir = self.store.dir().join(format!("step-{step:08}"));
        match self.store.link_best(step) {
            Ok(()) => log::info!("best checkpoint: {} -> {}", link.display(), dir.display()),
            Err(err) => {
                log::warn!(
                    "cannot point {} at {}: {err}",
                    link.display(),
                    dir.display()
                );
                self.group.on_best_link_failed(step, previous);
            }
        }
    }

    pub fn describe(&self) -> String {
        self.group.describe()
    }

    /// NCCL: the first rank of `epoch` created its communicator's id: relay it.
    pub fn on_group_id(&mut self, worker: usize, epoch: u64, id: Vec<u8>) -> Vec<Action> {
        let out = self.group.on_group_id(worker, epoch, id);
        self.carry_out(out)
    }

    /// Does this run write checkpoints (not a job's follower: the leader writes the job's)?
    pub fn saves_checkpoints(&self) -> bool {
        self.group.saves_checkpoints()
    }

    /// This run is node `node` of a job across nodes (see [`Group::join_job`]).
    pub fn join_job(&mut self, node: u32) {
        self.group.join_job(node);
    }

    /// The leader formed the job's epoch `epoch` of `ranks`.
    pub fn on_job_epoch(&mut self, epoch: u64, ranks: Vec<u32>) -> Vec<Action> {
        let out = self.group.on_job_epoch(epoch, ranks, Instant::now());
        self.carry_out(out)
    }

    /// Another node's first rank created epoch `epoch`'s NCCL id.
    pub fn on_job_id(&mut self, epoch: u64, id: &[u8]) -> Vec<Action> {
        let out = self.group.on_job_id(epoch, id);
        self.carry_out(out)
    }

    /// The leader committed a step over every node.
    pub fn on_job_commit(&mut self, c: crate::training::group::JobCommit) -> Vec<Action> {
        let out = self.group.on_job_commit(c, Instant::now());
        self.carry_out(out)
    }

    /// A member's all-reduce of `step` in `epoch` completed.
    pub fn on_reduced(
        &mut self,
        worker: usize,
        step: u64,
        epoch: u64,
        weight_sum: f64,
        ms: f64,
    ) -> Vec<Action> {
        let out = self
            .group
            .on_reduced(worker, step, epoch, weight_sum, ms, Instant::now());
        self.carry_out(out)
    }

    /// The collective's watchdog (see [`Group::watchdog`]).
    pub fn watchdog(&mut self, now: Instant) -> Vec<Action> {
        let out = self.group.watchdog(now);
        self.carry_out(out)
    }

    /// Drafter `worker` (life `holder`) is ready; `rank` is the number in its name.
    pub fn on_ready(&mut self, worker: usize, holder: Holder, rank: u32) -> Vec<Action> {
        let out = self.group.on_ready(worker, holder, rank);
        self.carry_out(out)
    }

    pub fn on_snapshot_done(
        &mut self,
        worker: usize,
        step: u64,
        slot: u32,
        ms: f64,
    ) -> Vec<Action> {
        let out = self
            .group
            .on_snapshot_done(worker, step, slot, ms, Instant::now());
        self.carry_out(out)
    }

    pub fn on_grads(
        &mut self,
        worker: usize,
        step: u64,
        input: SlotRef,
        batch_id: u64,
        stats: StepStats,
        params: u64,
    ) -> Vec<Action> {
        let g = Gradient {
            input,
            batch_id,
            stats,
            params,
        };
        let out = self.group.on_grads(worker, step, g, Instant::now());
        self.carry_out(out)
    }

    /// A drafter's life is over.
    pub fn on_gone(&mut self, worker: usize) -> Vec<Action> {
        let out = self.group.on_gone(worker, Instant::now());
        self.carry_out(out)
    }

    /// The end of the data (see [`Group::flush_tail`]).
    pub fn flush_tail(
        &mut self,
        remaining: Option<u64>,
        delivered: &dyn Fn(Holder) -> u64,
    ) -> Vec<Action> {
        let out = self.group.flush_tail(remaining, delivered, Instant::now());
        self.carry_out(out)
    }

    /// Is an eval round running (so no step commits)?
    pub fn eval_running(&self) -> bool {
        self.group.eval_running()
    }

    /// The data is consumed: the last step is evaluated too (see [`Group::eval_at_end`]).
    pub fn eval_at_end(&mut self, out: &mut Vec<Action>) -> bool {
        let mut o = Out::default();
        let going = self.group.eval_at_end(&mut o);
        out.extend(self.carry_out(o));
        going
    }

    /// A drafter scored eval batch `batch_id` at the weights of `step`. `Err`: a protocol
    /// violation (the report is not of the weights the round scores).
    pub fn on_evaluated(
        &mut self,
        batch_id: u64,
        step: u64,
        stats: &StepStats,
    ) -> Result<Vec<Action>, crate::violation::Violation> {
        let out = self
            .group
            .on_evaluated(batch_id, step, stats, Instant::now())?;
        Ok(self.carry_out(out))
    }

    /// The run is stopping and nothing can be saved (its directory is gone): no step
    /// commits from now on, and nothing is written.
    pub fn freeze(&mut self) {
        self.group.freeze();
    }

    /// The run is stopping (see [`Group::stop_checkpoint`]).
    pub fn stop_checkpoint(&mut self) -> Vec<Action> {
        let out = self.group.stop_checkpoint();
        self.carry_out(out)
    }

    /// No drafter is left: when the snapshot holds a step newer than the newest
    /// checkpoint, write it as one.
    pub fn checkpoint_held_snapshot(&mut self) -> Option<Action> {
        self.group.checkpoint_held_snapshot()
    }

    /// What a checkpoint's meta.json records for the export.
    pub fn export_meta(&self) -> serde_json::Value {
        self.group.export_meta()
    }

    /// The newest complete checkpoint (step, directory), if any.
    pub fn last_checkpoint(&self) -> Option<&(u64, std::path::PathBuf)> {
        self.group.last_checkpoint()
    }

    /// Write the current snapshot as a checkpoint of `step` into `dir`, in the format a
    /// drafter writes (state.safetensors with params/adam_m/adam_v, meta.json with its
    /// checksum), atomically. For a stop with no drafter left.
    pub fn checkpoint_from_snapshot(
        &mut self,
        step: u64,
        dir: &Path,
        supervisor_meta: &str,
    ) -> Result<(), SnapshotCheckpointError> {
        let Some((slot, at)) = self.group.snapshot().filter(|&(_, s)| s == step) else {
            return Err(SnapshotCheckpointError::NoSnapshot { step });
        };
        // SAFETY: the snapshot slot is current and no drafter is left to write into it.
        let src = unsafe { self.state_map.payload(slot) };
        let cfg = self.group.config();
        let n = ParamLayout::new(&cfg.drafter).total;
        // The slot's layout: a 64-byte head (the state's step and the optimizer's step,
        // little-endian u64), then params, adam_m and adam_v, f32 each.
        let (head, body) = src.split_at(64);
        let word = |i: usize| u64::from_le_bytes(head[8 * i..8 * i + 8].try_into().expect("8"));
        let (state_step, adam_step) = (word(0), word(1));
        if state_step != at {
            return Err(SnapshotCheckpointError::WrongStep {
                held: state_step,
                expected: at,
            });
        }
        let body = &body[..3 * n * 4];
        if !body
            .chunks_exact(4)
            .all(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")).is_finite())
        {
            return Err(SnapshotCheckpointError::NotFinite { step });
        }
        let tensor = |i: usize| {
            let bytes = &body[i * n * 4..(i + 1) * n * 4];
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n], bytes)
        };
        let views = [("params", 0), ("adam_m", 1), ("adam_v", 2)]
            .into_iter()
            .map(|(name, i)| tensor(i).map(|v| (name, v)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(SnapshotCheckpointError::Safetensors)?;
        let bytes =
            safetensors::serialize(views, None).map_err(SnapshotCheckpointError::Safetensors)?;
        let supervisor: serde_json::Value =
            serde_json::from_str(supervisor_meta).map_err(SnapshotCheckpointError::Meta)?;
        let meta = serde_json::json!({
            "step": step,
            "adam_step": adam_step,
            "drafter": cfg.drafter,
            "seed": cfg.seed,
            "supervisor": supervisor,
            "written_from": "the supervisor's snapshot",
        });
        self.store.write(dir, &bytes, &meta)?;
        self.on_checkpointed(dir.display().to_string(), step);
        Ok(())
    }

    /// A checkpoint of the last committed step, by one member.
    pub fn checkpoint(&mut self) -> Vec<Action> {
        self.group.checkpoint()
    }

    /// The member asked for the checkpoint of `step` could not write it.
    pub fn on_checkpoint_failed(&mut self, step: u64) {
        self.group.on_checkpoint_failed(step);
    }

    /// A checkpoint is complete: a rollback target from now on; the newest
    /// `keep_checkpoints` are kept.
    pub fn on_checkpointed(&mut self, dir: String, step: u64) {
        let out = self.group.on_checkpointed(dir, step);
        let rest = self.carry_out(out);
        debug_assert!(
            rest.is_empty(),
            "a checkpoint asks nothing of the dispatcher"
        );
    }

    pub fn on_exported(&mut self, dir: String, step: u64) {
        self.group.on_exported(dir, step);
    }

    /// The step this run (session) started from: 0, or the resumed checkpoint's.
    pub fn base_step(&self) -> u64 {
        self.group.base_step()
    }

    /// The first epoch was cut into `batches` batches (see [`Group::refine_schedule`]).
    pub fn refine_schedule(&mut self, batches: u64) -> Option<String> {
        self.group.refine_schedule(batches)
    }

    /// Write a checkpoint at the next committed step (a pre-emption notice). Returns that
    /// step.
    pub fn request_checkpoint(&mut self) -> Option<u64> {
        self.group.request_checkpoint()
    }

    /// Every setting as the run uses it, the schedule as it stands now.
    pub fn settings(&self) -> serde_json::Value {
        self.group.settings()
    }

    /// `--steps`, if given.
    pub fn steps_limit(&self) -> Option<u64> {
        self.group.steps_limit()
    }

    /// The learning-rate schedule as it stands (run.json, events).
    pub fn schedule(&self) -> Option<&crate::training::schedule::Schedule> {
        self.group.schedule()
    }

    pub fn committed(&self) -> u64 {
        self.group.committed()
    }

    /// The newest step a complete checkpoint holds (the run's start when none).
    pub fn saved_step(&self) -> u64 {
        self.group.saved_step()
    }

    pub fn checkpoints_dir(&self) -> &Path {
        self.store.dir()
    }

    /// Training progress, for state.json and the metrics.
    /// Append `line` to train.jsonl (a line of the run's, not of a step).
    pub fn log(&mut self, line: &LogLine) {
        self.log.write(line);
    }

    pub fn progress(&self) -> &TrainProgress {
        &self.group.progress
    }

    /// The schedule's length in optimizer steps, once it is known.
    pub fn total_steps(&self) -> Option<u64> {
        self.group.total_steps()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::protocol::ToWorker;
    use dflash_shared::protocol::{PoolId, SlotRef};

    fn trainer(flags: &[&str]) -> (Trainer, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let args = crate::cli::run_args(flags);
        let plan = crate::run::plan(&args, &mut || Ok(0)).unwrap();
        let target = crate::run::target_config("tiny").unwrap();
        let (_, pipeline_cfg) = crate::run::data_config(&args, &plan, &target).unwrap();
        let mut cfg =
            crate::run::trainer_config(&args, &plan, &target, &pipeline_cfg.capture).unwrap();
        cfg.checkpoints_dir = dir.path().join("checkpoints");
        std::fs::create_dir_all(&cfg.checkpoints_dir).unwrap();
        (Trainer::new(cfg, dir.path()).unwrap(), dir)
    }

    fn stats(weight: f64) -> StepStats {
        StepStats {
            loss_sum: 2.0 * weight,
            weight_sum: weight,
            tokens: 8,
            ..Default::default()
        }
    }

    fn slot(i: u32) -> SlotRef {
        SlotRef {
            pool: PoolId::Hidden,
            slot: i,
            gen: 1,
        }
    }

    /// Each life holds one delivered batch (the pending one).
    fn one_each(_: Holder) -> u64 {
        1
    }

    fn sends(out: &[Action]) -> Vec<(usize, &ToWorker)> {
        out.iter()
            .filter_map(|a| {
                if let Action::Send(w, m) = a {
                    Some((*w, m))
                } else {
                    None
                }
            })
            .collect()
    }

    /// Two members (workers 1 and 2) in the epoch of both; returns that epoch.
    fn two_members(t: &mut Trainer) -> u64 {
        t.on_ready(1, 11, 0);
        let out = t.on_ready(2, 12, 1);
        let epochs: Vec<u64> = sends(&out)
            .iter()
            .filter_map(|(_, m)| {
                if let ToWorker::Group { epoch, ranks, .. } = m {
                    (ranks.len() == 2).then_some(*epoch)
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(
            epochs.len(),
            2,
            "both are told of the epoch of both: {out:?}"
        );
        epochs[0]
    }

    #[test]
    fn every_drafter_dying_in_the_last_steps_eval_ends_the_run_at_that_step() {
        let dir = tempfile::tempdir().unwrap();
        let args = crate::cli::run_args(&["--gpus", "cpu:3", "--targets", "1", "--steps", "1"]);
        let plan = crate::run::plan(&args, &mut || Ok(0)).unwrap();
        let target = crate::run::target_config("tiny").unwrap();
        let (_, pipeline_cfg) = crate::run::data_config(&args, &plan, &target).unwrap();
        let mut cfg =
            crate::run::trainer_config(&args, &plan, &target, &pipeline_cfg.capture).unwrap();
        cfg.checkpoints_dir = dir.path().join("checkpoints");
        std::fs::create_dir_all(&cfg.checkpoints_dir).unwrap();
        let b = dflash_shared::batch::TokenBatch {
            batch_id: 0,
            seq_len: 4,
            lengths: vec![4],
            input_ids: vec![1, 2, 3, 4],
            loss_mask: vec![1; 4],
        };
        cfg.eval = Some(EvalSettings {
            set: crate::training::eval::EvalSet {
                path: "eval.jsonl".into(),
                batches: vec![b],
                tokens: 4,
                rows: 1,
            },
            every: 100,
        });
        let mut t = Trainer::new(cfg, dir.path()).unwrap();
        let epoch = two_members(&mut t);
        t.on_grads(1, 1, slot(0), 2, stats(3.0), 7);
        t.on_grads(2, 1, slot(1), 3, stats(3.0), 7);
        t.on_reduced(1, 1, epoch, 6.0, 1.0);
        let out = t.on_reduced(2, 1, epoch, 6.0, 1.0);
        assert_eq!(t.committed(), 1);
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::EvalStart { step: 1, .. })),
            "the last step is evaluated: {out:?}"
        );
        assert!(
            !out.iter().any(|a| matches!(a, Action::Done)),
            "Done waits for the eval"
        );
        assert!(t.on_gone(1).iter().all(|a| !matches!(a, Action::Failed(_))));
        let out = t.on_gone(2);
        assert!(
            out.iter().any(|a| matches!(a, Action::Done))
                && !out.iter().any(|a| matches!(a, Action::Failed(_))),
            "the run ends at step 1, not failed by a rollback: {out:?}"
        );
        assert!(!t.eval_running());
        assert_eq!(t.committed(), 1);
    }

    #[test]
    fn no_step_commits_while_an_eval_round_scores_the_eval_steps_weights() {
        let dir = tempfile::tempdir().unwrap();
        let args = crate::cli::run_args(&["--gpus", "cpu:3", "--targets", "1"]);
        let plan = crate::run::plan(&args, &mut || Ok(0)).unwrap();
        let target = crate::run::target_config("tiny").unwrap();
        let (_, pipeline_cfg) = crate::run::data_config(&args, &plan, &target).unwrap();
        let mut cfg =
            crate::run::trainer_config(&args, &plan, &target, &pipeline_cfg.capture).unwrap();
        cfg.checkpoints_dir = dir.path().join("checkpoints");
        std::fs::create_dir_all(&cfg.checkpoints_dir).unwrap();
        let b = dflash_shared::batch::TokenBatch {
            batch_id: 0,
            seq_len: 4,
            lengths: vec![4],
            input_ids: vec![1, 2, 3, 4],
            loss_mask: vec![1; 4],
        };
        cfg.eval = Some(EvalSettings {
            set: crate::training::eval::EvalSet {
                path: "eval.jsonl".into(),
                batches: vec![b.clone(), b],
                tokens: 8,
                rows: 2,
            },
            every: 1,
        });
        let mut t = Trainer::new(cfg, dir.path()).unwrap();
        let epoch = two_members(&mut t);
        let step = |t: &mut Trainer, n: u64| {
            t.on_grads(1, n, slot(0), 2 * n, stats(3.0), 7);
            t.on_grads(2, n, slot(1), 2 * n + 1, stats(3.0), 7);
            t.on_reduced(1, n, epoch, 6.0, 1.0);
            t.on_reduced(2, n, epoch, 6.0, 1.0)
        };
        let out = step(&mut t, 1);
        assert_eq!(t.committed(), 1);
        let ids: Vec<u64> = out
            .iter()
            .find_map(|a| match a {
                Action::EvalStart {
                    step: 1, batches, ..
                } => Some(batches.iter().map(|b| b.batch_id).collect()),
                _ => None,
            })
            .expect("an eval round of step 1 starts at its commit");
        assert_eq!(ids.len(), 2);
        assert!(ids.iter().all(|&b| dflash_shared::batch::is_eval_batch(b)));
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::Checkpoint { step: 1, .. })),
            "an eval step is checkpointed: {out:?}"
        );
        // Step 2's gradients are all in and reduced: it waits for the round.
        let out = step(&mut t, 2);
        assert_eq!(t.committed(), 1, "committed during the eval round: {out:?}");
        assert!(
            t.on_evaluated(ids[0], 2, &stats(1.0)).is_err(),
            "other weights"
        );
        assert!(t.on_evaluated(ids[0], 1, &stats(1.0)).unwrap().is_empty());
        assert_eq!(t.committed(), 1, "one eval batch is still out");
        let out = t.on_evaluated(ids[1], 1, &stats(1.0)).unwrap();
        assert!(matches!(out.first(), Some(Action::EvalEnd)), "{out:?}");
        assert_eq!(
            t.committed(),
            2,
            "the held step commits once the round is in"
        );
        let log = std::fs::read_to_string(dir.path().join("train.jsonl")).unwrap();
        let eval: Vec<serde_json::Value> = log
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["eval"].is_object())
            .collect();
        assert_eq!(eval.len(), 1);
        assert_eq!(
            (
                eval[0]["eval"]["step"].as_u64(),
                eval[0]["eval"]["tokens"].as_u64()
            ),
            (Some(1), Some(16))
        );
    }

    #[test]
    fn at_the_data_end_a_member_without_a_batch_abstains_and_the_step_commits_over_the_others() {
        let (mut t, _dir) = trainer(&["--gpus", "cpu:3", "--targets", "1"]);
        let epoch = two_members(&mut t);
        assert!(
            t.on_grads(1, 1, slot(0), 100, stats(3.0), 7).is_empty(),
            "no commit with one member"
        );
        assert!(
            t.flush_tail(Some(2), &one_each).is_empty(),
            "a batch left that no member holds: nobody abstains"
        );
        let out = t.flush_tail(Some(1), &one_each);
        assert!(
            matches!(sends(&out)[..], [(2, ToWorker::Abstain { step: 1 })]),
            "{out:?}"
        );
        assert!(t.flush_tail(Some(1), &one_each).is_empty(), "told once");
        assert!(t.on_reduced(1, 1, epoch, 3.0, 1.0).is_empty());
        assert_eq!(
            t.committed(),
            0,
            "the abstaining member has not reduced yet"
        );
        let out = t.on_reduced(2, 1, epoch, 3.0, 1.0);
        assert_eq!(t.committed(), 1);
        let applies: Vec<(usize, u64, f64)> = sends(&out)
            .iter()
            .filter_map(|(w, m)| {
                if let ToWorker::Apply {
                    step, weight_sum, ..
                } = m
                {
                    Some((*w, *step, *weight_sum))
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(
            applies,
            [(1, 1, 3.0), (2, 1, 3.0)],
            "both apply the one batch's step"
        );
        let consumed: Vec<u64> = out
            .iter()
            .filter_map(|a| {
                if let Action::Consume { batch_id, .. } = a {
                    Some(*batch_id)
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(consumed, [100]);
    }

    #[test]
    fn a_member_that_holds_the_last_two_batches_lets_the_idle_one_abstain() {
        // Worker 1 has its gradient for step 1 and a second batch delivered ahead, which it
        // takes only after the commit: worker 2 will get nothing for step 1.
        let (mut t, _dir) = trainer(&["--gpus", "cpu:3", "--targets", "1"]);
        let epoch = two_members(&mut t);
        t.on_grads(1, 1, slot(0), 100, stats(3.0), 7);
        let two = |h: Holder| if h == 11 { 2 } else { 0 };
        let out = t.flush_tail(Some(2), &two);
        assert!(
            matches!(sends(&out)[..], [(2, ToWorker::Abstain { step: 1 })]),
            "{out:?}"
        );
        t.on_reduced(1, 1, epoch, 3.0, 1.0);
        t.on_reduced(2, 1, epoch, 3.0, 1.0);
        assert_eq!(t.committed(), 1);
    }

    #[test]
    fn when_the_member_with_the_last_batch_dies_the_abstentions_are_withdrawn_and_the_batch_trains_elsewhere(
    ) {
        let (mut t, _dir) = trainer(&["--gpus", "cpu:3", "--targets", "1"]);
        let epoch = two_members(&mut t);
        t.on_grads(1, 1, slot(0), 100, stats(3.0), 7);
        t.flush_tail(Some(1), &one_each);
        t.on_reduced(2, 1, epoch, 3.0, 1.0);
        // Worker 1 dies holding batch 100, which goes back to the queue.
        let out = t.on_gone(1);
        assert_eq!(t.committed(), 0);
        let s = sends(&out);
        assert!(
            s.iter()
                .any(|(w, m)| *w == 2 && matches!(m, ToWorker::Withdraw { step: 1 })),
            "{out:?}"
        );
        let next = s
            .iter()
            .find_map(|(_, m)| {
                if let ToWorker::Group { epoch, ranks, .. } = m {
                    Some((*epoch, ranks.clone()))
                } else {
                    None
                }
            })
            .unwrap();
        assert_eq!(next.1.len(), 1);
        assert!(
            t.flush_tail(Some(1), &one_each).is_empty(),
            "the batch is nobody's now: nobody abstains"
        );
        // Worker 2 gets the batch back, trains on it and reduces it alone.
        t.on_grads(2, 1, slot(1), 100, stats(3.0), 7);
        let out = t.on_reduced(2, 1, next.0, 3.0, 1.0);
        assert_eq!(t.committed(), 1, "{out:?}");
    }

    #[test]
    fn a_batch_that_reaches_an_abstaining_member_first_is_reduced_with_the_step() {
        let (mut t, _dir) = trainer(&["--gpus", "cpu:3", "--targets", "1"]);
        let epoch = two_members(&mut t);
        t.on_grads(1, 1, slot(0), 100, stats(3.0), 7);
        t.flush_tail(Some(1), &one_each);
        // Its gradient was on its way before the order to abstain arrived (the rank ignores
        // that order when it holds a gradient).
        t.on_grads(2, 1, slot(1), 101, stats(4.0), 7);
        t.on_reduced(1, 1, epoch, 7.0, 1.0);
        let out = t.on_reduced(2, 1, epoch, 7.0, 1.0);
        assert_eq!(t.committed(), 1);
        let mut consumed: Vec<u64> = out
            .iter()
            .filter_map(|a| {
                if let Action::Consume { batch_id, .. } = a {
                    Some(*batch_id)
                } else {
                    None
                }
            })
            .collect();
        consumed.sort();
        assert_eq!(consumed, [100, 101]);
    }
}
