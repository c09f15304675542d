//! The dispatcher's side of a job across nodes (`crate::cluster::job`): what the drafter
//! group reports goes to the leader, and what the leader decided comes back to the group,
//! to the node's share of the data, or ends the run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;

use super::{Dispatcher, StopReason};
use crate::cluster::job::{Input, JobNode, Local};
use crate::data::share::Feed;
use crate::training::group::JobReport;

/// This node's part in a job across nodes.
pub struct Job {
    pub node: JobNode,
    /// Leases for the node's share of the data (its loader thread).
    pub feed: Sender<Feed>,
    /// The data's length, once this node's loader read all of it (`u64::MAX` before).
    pub end: Arc<AtomicU64>,
    /// The data's length was told to the leader.
    pub end_told: bool,
    /// This node's rank.
    pub rank: u32,
    /// On the leader: each other node's latest metrics window.
    pub windows: std::collections::BTreeMap<u32, crate::telemetry::window::Window>,
}

impl Dispatcher {
    /// The group reports to the leader.
    pub(super) fn job_report(&mut self, r: JobReport) {
        let Some(job) = self.job.as_mut() else {
            return;
        };
        let locals = job.node.report(r);
        self.on_locals(locals);
    }

    /// The link's threads received something.
    pub(super) fn on_job_input(&mut self, i: Input) {
        let Some(job) = self.job.as_mut() else {
            return;
        };
        let locals = job.node.on_input(i);
        self.on_locals(locals);
    }

    /// At the start: the leader's first leases.
    pub(super) fn job_begin(&mut self) {
        if let Some(job) = self.job.as_mut() {
            let locals = job.node.begin();
            self.on_locals(locals);
        }
    }

    /// Every turn: the leader's beats, and the data's end told once it is known.
    pub(super) fn job_timers(&mut self) {
        let Some(job) = self.job.as_mut() else {
            return;
        };
        let mut locals = job.node.tick(self.now);
        let end = job.end.load(Ordering::SeqCst);
        if end != u64::MAX && !job.end_told {
            job.end_told = true;
            locals.extend(job.node.data_end(end));
        }
        if !locals.is_empty() {
            self.on_locals(locals);
        }
    }

    /// A checkpoint of this run is complete: a node joining the job starts from it.
    pub(super) fn job_checkpointed(&mut self, step: u64, dir: &str) {
        if let Some(job) = self.job.as_mut() {
            let locals = job.node.checkpointed(step, dir);
            self.on_locals(locals);
        }
    }

    fn on_locals(&mut self, locals: Vec<Local>) {
        for l in locals {
            match l {
                Local::Epoch { epoch, ranks } => {
                    let a = self.trainer.on_job_epoch(epoch, ranks);
                    self.execute(a);
                }
                Local::GroupId { epoch, id } => {
                    let a = self.trainer.on_job_id(epoch, &id);
                    self.execute(a);
                }
                Local::Commit(c) => {
                    let a = self.trainer.on_job_commit(c);
                    self.execute(a);
                }
                Local::Lease(ids) => self.feed(Feed::Lend(ids)),
                Local::NoMore => self.feed(Feed::NoMore),
                Local::Done { ok: true } => {
                    log::info!("cluster: the job's data is consumed: stopping");
                    self.begin_stop(StopReason::DataDone);
                }
                Local::Done { ok: false } => {
                    self.begin_stop(StopReason::TrainingFailed(
                        "the leader ended the job (its supervisor.log says why)".into(),
                    ));
                }
                Local::NodeWindow { node, window } => match serde_json::from_value(window) {
                    Ok(w) => {
                        if let Some(job) = self.job.as_mut() {
                            job.windows.insert(node, w);
                        }
                    }
                    Err(e) => log::warn!("cluster: node {node}'s metrics window: {e}"),
                },
                Local::CheckpointForJoin => {
                    if let Some(step) = self.trainer.request_checkpoint() {
                        log::info!(
                            "checkpoint of step {step} asked for: a node joins the job from it"
                        );
                    }
                }
                Local::LeaderLost(why) => {
                    log::error!("{why}: this node stops its workers (exit 75: the job is requeued and resumes from its last checkpoint)");
                    self.begin_stop(StopReason::Requested(why));
                }
            }
        }
        self.dirty = true;
    }

    fn feed(&self, f: Feed) {
        if let Some(job) = &self.job {
            // The loader thread is gone once the data ended: nothing more to feed.
            let _ = job.feed.send(f);
        }
    }
}
