//! What the run looks like from outside: `state.json` while it runs, and the exit code,
//! report and records when it ends.

use std::time::Duration;

use dflash_shared::exit_codes;
use serde_json::json;

use super::{obj, Dispatcher, Phase, StopReason};
use crate::error::RunEnd;
use crate::state::{RunState, WorkerState};

impl Dispatcher {
    fn snapshot(&self, phase: &str, exit_code: Option<i32>) -> RunState {
        RunState {
            run_dir: self.run.path.clone(),
            supervisor_pid: std::process::id(),
            started_at: self.started_wall.clone(),
            started_at_unix_ms: self.started_unix_ms,
            phase: phase.into(),
            exit_code,
            batches_produced: self.pipeline.progress().1,
            batches_consumed: self.pipeline.progress().0,
            bad_lines: Some(self.pipeline.bad_lines()),
            train: Some(self.trainer.progress().clone()),
            metrics: self.metrics.latest.clone(),
            workers: self
                .workers
                .iter()
                .map(|w| WorkerState {
                    name: w.name.to_string(),
                    role: w.name.role.to_string(),
                    rank: w.name.rank,
                    gpu: w.device.to_string(),
                    pid: w.status.life().map(|l| l.pid),
                    state: w.status.as_str().into(),
                    restarts: w.restarts,
                    started_at: w.status.life().map(|l| l.started_wall.clone()),
                    last_exit: w.last_exit.clone(),
                    log: w.log_path.clone(),
                })
                .collect(),
        }
    }

    pub(super) fn flush_state(&mut self) {
        // Worker changes are written at once; batch progress alone at most once a second.
        let progress = self.pipeline.progress();
        let stale = progress != self.written_progress
            && self.now.saturating_duration_since(self.written_at) >= Duration::from_secs(1);
        if !self.dirty && !stale {
            return;
        }
        self.dirty = false;
        self.written_progress = progress;
        self.written_at = self.now;
        let phase = match self.phase {
            Phase::Running => "running",
            _ => "stopping",
        };
        if let Err(e) = self.run.write_state(&self.snapshot(phase, None)) {
            log::warn!("cannot write state.json: {e}");
        }
    }

    /// Every worker is gone: decide the exit code, say why, record it.
    pub(super) fn finish(mut self) -> i32 {
        self.write_metrics();
        crate::telemetry::console::status(None);
        let reason = self
            .stop_reason
            .take()
            .unwrap_or(StopReason::Requested("stopped".into()));
        self.pipeline.end(matches!(
            reason,
            StopReason::StepsDone | StopReason::DataDone
        ));
        let end = self.end_of(&reason);
        // What the supervisor still holds is written, and the newest checkpoint exported.
        let export_failure = self.save_and_export();
        if self.final_tau(&reason) {
            // The last τ in metrics.jsonl and on Prometheus too.
            self.write_metrics();
        }
        let end = if self.run_dir_gone.is_some() {
            end
        } else {
            self.unsaved_steps(end)
        };
        // A run never exits 0 with a checkpoint it has not exported; a second stop signal
        // that aborted the export is an interruption.
        let end = match (&export_failure, end) {
            (Some(f), _) if f.interrupted => RunEnd::Interrupted,
            (Some(_), RunEnd::Clean | RunEnd::StoppedEarly | RunEnd::UncleanStop) => RunEnd::Failed,
            (_, end) => end,
        };
        let export_failure = export_failure.map(|f| f.why);
        let code = end.exit_code();
        if self.run_dir_gone.is_some() {
            log::info!("run ended ({}); exit code {code}", reason.describe());
            crate::say!("dflash-supervise: {}", export_failure.unwrap_or_default());
            return code;
        }
        self.record_end(&reason, end, code);
        log::info!("run ended ({}); exit code {code}", reason.describe());
        let report = self.run.path.join("report.html");
        match crate::telemetry::report::write(&self.run.path, &report) {
            Ok(()) => crate::say!("dflash-supervise: report written to {}", report.display()),
            Err(e) => log::warn!("cannot write the report: {e}"),
        }
        self.say_drafter(export_failure.as_deref());
        self.say_what_next(&reason, end, code);
        code
    }

    /// How the run ended by the reason it stopped, and whether every worker stopped
    /// cleanly; the reasons of a failure are said here.
    fn end_of(&self, reason: &StopReason) -> RunEnd {
        match reason {
            StopReason::GaveUp(report) => {
                crate::telemetry::console::say(format_args!("{}", report.render()));
                RunEnd::Failed
            }
            StopReason::Fatal(_) => RunEnd::Internal,
            StopReason::BadInput(msg) => {
                crate::say!("dflash-supervise: error: {msg}");
                RunEnd::BadInput
            }
            StopReason::Interrupted => RunEnd::Interrupted,
            StopReason::TrainingFailed(msg) => {
                crate::say!("dflash-supervise: run failed: {msg}");
                RunEnd::Failed
            }
            StopReason::Requested(_)
            | StopReason::TimeLimit
            | StopReason::DataDone
            | StopReason::StepsDone => {
                let all_clean = self.workers.iter().all(|w| !w.unclean_stop);
                let finished = matches!(reason, StopReason::DataDone | StopReason::StepsDone);
                if all_clean && finished {
                    RunEnd::Clean
                } else if all_clean {
                    RunEnd::StoppedEarly
                } else {
                    let bad: Vec<String> = self
                        .workers
                        .iter()
                        .filter(|w| w.unclean_stop)
                        .map(|w| {
                            format!(
                                "{} ({})",
                                w.name,
                                w.last_exit.as_deref().unwrap_or("never started")
                            )
                        })
                        .collect();
                    log::warn!("not every worker stopped cleanly: {}", bad.join(", "));
                    RunEnd::UncleanStop
                }
            }
        }
    }

    /// Steps that no checkpoint holds are lost to a --resume: say which, and never call
    /// such a run a success (`end` becomes a failure).
    fn unsaved_steps(&self, end: RunEnd) -> RunEnd {
        let (committed, saved) = (self.trainer.committed(), self.trainer.saved_step());
        if committed <= saved || !self.trainer.saves_checkpoints() {
            return end;
        }
        let kept = self
            .trainer
            .last_checkpoint()
            .is_some_and(|(_, d)| d.join(dflash_shared::checkpoint::META_FILE).is_file());
        let from = if saved > 0 && kept {
            format!(
                "continue from the checkpoint of step {saved} with: dflash-supervise --resume {}",
                crate::shell::quote(&self.run.path)
            )
        } else if saved > 0 {
            format!(
                "no checkpoint is left in {} (the newest, of step {saved}, is gone)",
                self.trainer.checkpoints_dir().display()
            )
        } else {
            "no checkpoint was written: a new run starts from scratch".into()
        };
        let saved = if kept { saved } else { 0 };
        crate::say!(
            "dflash-supervise: steps {}..{committed} were not saved in a checkpoint; {from}",
            saved + 1
        );
        // Lost work outranks an unclean stop: the run failed.
        if matches!(
            end,
            RunEnd::Clean | RunEnd::StoppedEarly | RunEnd::UncleanStop
        ) {
            RunEnd::Failed
        } else {
            end
        }
    }

    /// The end in the run dir: state.json's last state, the `run_end` event, and for a
    /// run that finished, finished.json.
    fn record_end(&mut self, reason: &StopReason, end: RunEnd, code: i32) {
        let phase = if code == exit_codes::SUCCESS || code == exit_codes::STOPPED_EARLY {
            "stopped"
        } else {
            "failed"
        };
        if let Err(e) = self.run.write_state(&self.snapshot(phase, Some(code))) {
            log::warn!("cannot write state.json: {e}");
        }
        self.run.event(
            "run_end",
            obj(json!({"reason": reason.describe(), "exit_code": code})),
        );
        if end == RunEnd::Clean {
            let f = crate::training::resume::Finished {
                step: self.trainer.saved_step(),
                reason: reason.describe(),
                drafter: self.trainer.progress().exported.clone(),
            };
            if let Err(e) = f.write(&self.run.path) {
                log::warn!(
                    "cannot write {}: {e}",
                    crate::training::resume::FINISHED_FILE
                );
            }
        }
    }

    /// Where the drafter was written, or why none was (`export_failure`: the export's).
    fn say_drafter(&self, export_failure: Option<&str>) {
        if !self.trainer.saves_checkpoints() {
            crate::say!("dflash-supervise: this node's drafter is the job's: the leader writes its checkpoints and the drafter");
            return;
        }
        match (&self.trainer.progress().exported, export_failure) {
            (_, Some(why)) => crate::say!("dflash-supervise: {why}"),
            (Some(dir), None) => crate::say!(
                "dflash-supervise: drafter (step {}) written to {dir}",
                self.trainer
                    .progress()
                    .exported_step
                    .unwrap_or(self.trainer.progress().step)
            ),
            (None, None) if self.trainer.committed() == 0 => {
                crate::say!("dflash-supervise: no training step was committed; no drafter written")
            }
            (None, None) => crate::say!(
                "dflash-supervise: no checkpoint holds the trained steps; no drafter written"
            ),
        }
    }

    /// A run cut short says so: data that ran out before `--steps`, or a stop before the
    /// end, with how to continue it.
    fn say_what_next(&self, reason: &StopReason, end: RunEnd, code: i32) {
        if let (StopReason::DataDone, Some(n)) = (reason, self.trainer.steps_limit()) {
            let at = self.trainer.committed();
            if at < n {
                crate::say!(
                    "dflash-supervise: warning: the data ran out at step {at} of --steps {n}: the learning-rate schedule, which ends at step {n}, was cut short \
                     (drop --epochs to cycle the data up to --steps, or give fewer --steps)"
                );
            }
        }
        if end == RunEnd::StoppedEarly && self.job.as_ref().is_some_and(|j| !j.node.is_leader()) {
            crate::say!(
                "dflash-supervise: this node stopped before the job's end (exit {code}); the job continues from the leader's newest checkpoint when every node runs its command again (with --resume-if-exists, as a Slurm requeue does)"
            );
        } else if end == RunEnd::StoppedEarly {
            let saved = self.trainer.saved_step();
            if saved > 0 {
                crate::say!(
                    "dflash-supervise: stopped at step {saved}, before the run's end (exit {code}); continue it with: dflash-supervise --resume {}",
                    crate::shell::quote(&self.run.path)
                );
            } else {
                crate::say!(
                    "dflash-supervise: stopped before the run's end and before any step was trained (exit {code}); nothing to --resume: \
                     start it again (with --run-dir {} --resume-if-exists the same command starts or resumes it)",
                    crate::shell::quote(&self.run.path)
                );
            }
        }
    }
}
