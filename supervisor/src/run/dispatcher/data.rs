//! The dispatcher's side of the data plane and of training: grants after every event,
//! and carrying out what the trainer decided.

use dflash_shared::protocol::ToWorker;
use ipc_channel::ipc::IpcSender;

use super::{Dispatcher, Phase, StopReason};
use crate::data::pipeline::{self, Peer};
use crate::training::trainer::Action;

impl Dispatcher {
    /// Grant slots and batches to the workers that can take them; end the run when all
    /// data is consumed.
    pub(super) fn pump(&mut self) {
        if !matches!(self.phase, Phase::Running) {
            return;
        }
        // Worker lives that take work, with the channel the pipeline's messages go on.
        let takers: Vec<(Peer, &IpcSender<ToWorker>)> = self
            .workers
            .iter()
            .filter_map(|w| {
                let l = w.status.life()?;
                let peer = Peer {
                    name: w.name,
                    holder: l.id,
                    pid: l.pid,
                };
                Some((peer, l.takes_work()?))
            })
            .collect();
        if let Some(e) = self.pipeline.ledger_failed() {
            log::error!("{e}");
            self.begin_stop(StopReason::TrainingFailed(e));
            return;
        }
        let peers: Vec<Peer> = takers.iter().map(|(p, _)| *p).collect();
        for a in self.pipeline.pump(&peers) {
            send(&takers, a);
        }
        let pipeline = &self.pipeline;
        let tail = self.trainer.flush_tail(pipeline.remaining(), &|holder| {
            pipeline.delivered_to(holder)
        });
        self.execute(tail);
        let hung = self.trainer.watchdog(self.now);
        self.execute(hung);
        // In a job across nodes the leader says when the job's data is consumed.
        if self.pipeline.finished() && self.job.is_none() {
            // With --eval-data the last step is evaluated before the run ends.
            let mut out = Vec::new();
            let evaluating = self.trainer.eval_at_end(&mut out);
            self.execute(out);
            if evaluating {
                return;
            }
            let (consumed, _) = self.pipeline.progress();
            log::info!("all {consumed} batches consumed: stopping");
            self.begin_stop(StopReason::DataDone);
        }
    }

    /// Carry out what the trainer decided.
    pub(super) fn execute(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Send(w, msg) => {
                    if let Some(tx) = self.workers[w].status.life().and_then(|l| l.to_worker()) {
                        let _ = tx.send(msg);
                    }
                }
                Action::Consume {
                    worker,
                    holder,
                    input,
                    batch_id,
                    step,
                } => {
                    if let Err(e) = self.pipeline.consume(
                        self.workers[worker].name,
                        holder,
                        input,
                        batch_id,
                        Some(step),
                    ) {
                        log::error!("committed batch {batch_id} could not be recorded: {e}");
                    }
                    self.dirty = true;
                }
                Action::Done => self.steps_done(),
                Action::Failed(msg) => {
                    log::error!("{msg}");
                    self.begin_stop(StopReason::TrainingFailed(msg));
                }
                Action::Violation(w, msg) => self.violation(w, &msg),
                Action::Rollback { from, to, batches } => {
                    if let Err(e) = self.pipeline.rollback(from, to, &batches) {
                        log::error!("{e}");
                        self.begin_stop(StopReason::TrainingFailed(e.to_string()));
                    }
                    self.run.event(
                        "rollback",
                        super::obj(
                            serde_json::json!({"from": from, "to": to, "batches": batches.len()}),
                        ),
                    );
                    self.dirty = true;
                }
                Action::Covered(step) => self.pipeline.covered(step),
                Action::EvalStart {
                    round,
                    step,
                    batches,
                } => {
                    self.run.event(
                        "eval_start",
                        super::obj(serde_json::json!({"step": step, "round": round, "batches": batches.len()})),
                    );
                    self.pipeline.start_eval(round, batches);
                    self.dirty = true;
                }
                Action::EvalEnd => {
                    self.pipeline.end_eval();
                    self.dirty = true;
                }
                Action::Event(kind, fields) => self.run.event(kind, fields),
                Action::Job(r) => self.job_report(r),
                Action::CheckpointFromSnapshot { step, dir } => {
                    let meta = self.checkpoint_meta();
                    match self.trainer.checkpoint_from_snapshot(step, &dir, &meta) {
                        Ok(()) => {
                            log::info!("checkpoint of step {step} written from the supervisor's snapshot (no drafter was left to write it)");
                            self.run.event("checkpoint", super::obj(serde_json::json!({"worker": "supervisor", "step": step, "dir": dir.display().to_string()})))
                        }
                        Err(e) => {
                            self.trainer.on_checkpoint_failed(step);
                            log::error!("no drafter is left to write the checkpoint of step {step}, and the supervisor's snapshot cannot be written instead: {e}")
                        }
                    }
                }
                Action::Checkpoint { worker, step, dir } => {
                    let meta = self.checkpoint_meta();
                    if let Some(tx) = self.workers[worker]
                        .status
                        .life()
                        .and_then(|l| l.to_worker())
                    {
                        let _ = tx.send(ToWorker::Checkpoint {
                            dir: dir.display().to_string(),
                            step,
                            meta,
                        });
                    }
                }
            }
        }
    }

    /// The supervisor's part of a checkpoint's meta.json: which batches were consumed,
    /// what the export needs (the target layers the drafter reads), and every setting as
    /// the run uses it.
    /// The step limit is reached: the run stops (in a job, every node reached it: their
    /// ends from now on are no loss).
    fn steps_done(&mut self) {
        log::info!("step limit reached: stopping");
        if let Some(j) = self.job.as_mut() {
            j.node.steps_done();
        }
        self.begin_stop(StopReason::StepsDone);
    }

    fn checkpoint_meta(&self) -> String {
        // A job's leader records the batches every node consumed (the lease table's).
        let job = self.job.as_ref().and_then(|j| j.node.consumed());
        let mut meta = match job {
            Some(ids) => pipeline::consumed_json(ids),
            None => self.pipeline.consumed_summary(),
        };
        meta["export"] = self.trainer.export_meta();
        meta["settings"] = self.trainer.settings();
        meta.to_string()
    }
}

/// Send a pipeline action to its worker (a send error means the worker is gone: its
/// death hands the slot back).
fn send(takers: &[(Peer, &IpcSender<ToWorker>)], a: pipeline::Action) {
    if let Some((_, tx)) = takers.iter().find(|(p, _)| p.holder == a.to()) {
        let _ = tx.send(a.message());
    }
}
