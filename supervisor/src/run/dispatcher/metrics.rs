//! The dispatcher's side of the metrics windows: what goes into each window of
//! `metrics.jsonl` (schema in [`crate::telemetry::metrics`]) and the live status line.

use std::io::Write;
use std::time::Duration;

use super::Dispatcher;
use crate::run::rundir::now_rfc3339;
use crate::telemetry::console::Status;
use crate::telemetry::metrics::{status_fields, step_line};
use crate::telemetry::window::{Batches, Eval, Train, Window, WorkerEntry};

impl Dispatcher {
    /// On a terminal, redraw the live status line once a second: the training figures of
    /// this moment, tokens/s over the open window (once it is a second old; the last
    /// window's before), and the latest window's other rates.
    pub(super) fn refresh_status(&mut self) {
        if let Some(p) = &self.cfg.prometheus {
            p.progress(
                self.trainer.progress().step,
                self.pipeline.health.drafter_tokens_total(),
            );
            if let Some(lr) = self.trainer.progress().lr {
                p.set_lr(lr);
            }
        }
        if !crate::telemetry::console::live()
            || self.now.saturating_duration_since(self.metrics.status_at) < Duration::from_secs(1)
        {
            return;
        }
        self.metrics.status_at = self.now;
        let mut w = self.metrics.latest.clone().unwrap_or_default();
        let t = self.trainer.progress();
        if t.step > 0 {
            w.train = Some(Train {
                step: t.step,
                loss: Some(t.loss),
                acceptance: Some(t.acceptance),
                ..w.train.unwrap_or_default()
            });
        }
        w.restarts = self.restarts();
        let open = self
            .now
            .saturating_duration_since(self.metrics.started)
            .as_secs_f64();
        let tokens = self.pipeline.health.drafter_tokens();
        let live = (open >= 1.0 && tokens > 0).then(|| tokens as f64 / open);
        crate::telemetry::console::status(Some(Status {
            step: t.step,
            total: self.trainer.total_steps(),
            base: self.trainer.base_step(),
            figures: status_fields(&w, live),
        }));
    }

    /// Close the current window: write it and start the next.
    pub(super) fn write_metrics(&mut self) {
        let (mut record, steady, before) = self.window();
        // --targets auto reads the window and says what it did, in the hint's line.
        let did = self.balance(&record, steady);
        let hint = &mut record.pipeline.bottleneck_hint;
        if let (Some(h), Some(d)) = (hint.as_mut(), did) {
            *h = format!("{h}; --targets auto: {d}");
        }
        if let Some(hint) = &record.pipeline.bottleneck_hint {
            log::info!("bottleneck: {hint}");
        }
        if let Some(f) = self.metrics.file.as_mut() {
            if let Ok(line) = serde_json::to_string(&record) {
                let _ = writeln!(f, "{line}");
            }
        }
        if let Some(p) = &self.cfg.prometheus {
            p.update(&record);
        }
        if let Some(j) = self.job.as_mut() {
            // A follower's window goes to the leader's metrics stream.
            j.node.metrics(&record);
        }
        let total = self.trainer.total_steps();
        let step = record.train.map_or(0, |t| t.step);
        crate::telemetry::console::status(Some(Status {
            step,
            total,
            base: self.trainer.base_step(),
            figures: status_fields(&record, None),
        }));
        if !crate::telemetry::console::live() {
            // Not a terminal: the plain step line of a window in which a step was trained,
            // instead of the live status line.
            if let Some(line) = step_line(&record, total, before) {
                log::info!("{line}");
            }
        }
        self.metrics.last_consumed = record.batches.consumed;
        self.metrics.last_step = step;
        self.metrics.started = self.now;
        self.metrics.latest = Some(record);
        self.dirty = true;
    }

    /// The window now closing; whether it is steady (training moved in it and in the one
    /// before, the data had not ended, the run is not stopping: its figures describe the
    /// split, and only its hint is kept); the step of the window before.
    fn window(&mut self) -> (Window, bool, u64) {
        let secs = self
            .now
            .saturating_duration_since(self.metrics.started)
            .as_secs_f64()
            .max(1e-9);
        let names = |pid: u32| {
            self.workers
                .iter()
                .find(|w| w.status.life().is_some_and(|l| l.pid == pid))
                .map(|w| w.name.to_string())
        };
        let gpu = self.metrics.gpu.take(&names);
        let (consumed, produced) = self.pipeline.progress();
        let workers = self.worker_entries();
        let roles = self.roles();
        let t = self.trainer.progress();
        // The step of the window before (a resumed session's first: the step it resumed).
        let before = self.metrics.last_step.max(self.trainer.base_step());
        let train = (t.step > 0).then(|| Train {
            step: t.step,
            steps_per_s: t.step.saturating_sub(before) as f64 / secs,
            loss: Some(t.loss),
            acceptance: Some(t.acceptance),
        });
        let mut pipeline = self.pipeline.health.take(secs);
        // The start, when workers load, and an end leave workers idle or blocked without
        // any stage being slow.
        let steady = self.metrics.last_step > 0
            && t.step > self.metrics.last_step
            && !self.pipeline.loader_done()
            && self.stop_reason.is_none();
        if !steady {
            pipeline.bottleneck_hint = None;
        }
        let record = Window {
            time: now_rfc3339(),
            window_s: secs,
            gpu,
            pipeline,
            batches: Batches {
                produced,
                consumed,
                consumed_per_s: consumed.saturating_sub(self.metrics.last_consumed) as f64 / secs,
            },
            train,
            eval: t.eval_step.map(|step| Eval {
                step,
                loss: t.eval_loss,
                acceptance: t.eval_acceptance,
                best_step: t.best_step,
            }),
            tau: t.tau.clone().map(|mut v| {
                v["best_step"] = serde_json::json!(t.best_step);
                v
            }),
            restarts: self.restarts(),
            workers,
            roles,
            role_moves: self.role_moves,
            node: self.job.as_ref().map(|j| j.rank),
            nodes: self
                .job
                .as_ref()
                .map(|j| j.windows.clone())
                .unwrap_or_default(),
        };
        (record, steady, before)
    }

    /// Each worker's state, pid and restarts, by name.
    fn worker_entries(&self) -> std::collections::BTreeMap<String, WorkerEntry> {
        self.workers
            .iter()
            .map(|w| {
                let entry = WorkerEntry {
                    state: w.status.as_str().to_string(),
                    pid: w.status.life().map(|l| l.pid),
                    restarts: w.restarts,
                };
                (w.name.to_string(), entry)
            })
            .collect()
    }

    /// Worker restarts over the run.
    fn restarts(&self) -> u64 {
        self.workers.iter().map(|w| w.restarts as u64).sum()
    }
}
