//! What the run has trained, kept: a checkpoint that could not be written stops the run
//! cleanly (it is no crash), the run directory is watched, and at the end the newest
//! checkpoint (from a drafter, or from the supervisor's snapshot when none was left) is
//! exported through the same path as `dflash-supervise export`.

use std::time::Duration;

use dflash_shared::protocol::WriteFailure;
use dflash_shared::WorkerName;

use super::{Dispatcher, StopReason};
use crate::export_tool::{export_checkpoint, ExportError, EXPORT_TIMEOUT};

/// How often the run directory is looked at.
pub(super) const WATCH_EVERY: Duration = Duration::from_secs(1);

/// What a user can do about a failed write, from its errno.
pub fn advice(os_error: Option<i32>, dir: &std::path::Path) -> String {
    let dir = dir.display();
    match os_error {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => format!(
            "the filesystem of {dir} is full (space or inodes: see df -h and df -i); free some"
        ),
        Some(libc::ENOTDIR) | Some(libc::EEXIST) | Some(libc::ENOENT) => {
            format!(
                "{dir} is not the directory it was (replaced by a file, or removed?); put it back"
            )
        }
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => {
            format!("{dir} cannot be written (permissions, or a read-only filesystem); make it writable")
        }
        Some(libc::EIO) => format!("the disk of {dir} reports I/O errors; check it"),
        _ => "fix that".to_string(),
    }
}

impl Dispatcher {
    /// A drafter could not write the checkpoint of `step`: say so once, on the console,
    /// and stop the run cleanly. Another try would fail the same way, and treating it as a
    /// crash would cost a rollback and a restart per checkpoint.
    pub(super) fn on_checkpoint_failed(
        &mut self,
        who: WorkerName,
        step: u64,
        dir: &str,
        failure: &WriteFailure,
    ) {
        self.run.event(
            "checkpoint_failed",
            super::obj(
                serde_json::json!({"worker": who.to_string(), "step": step, "dir": dir,
                "doing": failure.doing, "os_error": failure.os_error, "error": failure.words}),
            ),
        );
        let what = advice(failure.os_error, self.trainer.checkpoints_dir());
        let msg = format!(
            "the checkpoint of step {step} could not be written ({failure}); {what}, then continue with: dflash-supervise --resume {}",
            crate::shell::quote(&self.run.path)
        );
        if matches!(self.phase, super::Phase::Running) {
            log::error!("{msg}: stopping the run");
            self.begin_stop(StopReason::TrainingFailed(msg));
        } else {
            log::error!("{msg}");
        }
    }

    /// The run directory still is the one this supervisor locked: its removal or
    /// replacement (another inode) stops the run, since its ledger, events, logs and lock
    /// would go to files nobody can find.
    pub(super) fn watch_run_dir(&mut self) {
        if self.now.saturating_duration_since(self.run_dir_seen) < WATCH_EVERY {
            return;
        }
        self.run_dir_seen = self.now;
        if self.run_dir_gone.is_some() {
            return;
        }
        if let Err(why) = self.run.still_there() {
            let msg = format!(
                "the run directory {} {why} while the run was running: its ledger, events, logs and lock are gone with it",
                self.run.path.display()
            );
            log::error!("{msg}; stopping the run");
            self.run_dir_gone = Some(msg.clone());
            self.begin_stop(StopReason::TrainingFailed(msg));
        }
    }

    /// Every worker has stopped: write what the supervisor still holds (its snapshot, when
    /// newer than the newest checkpoint), then export the newest checkpoint as the drafter.
    /// Returns a failure to report (the run then does not exit 0).
    pub(super) fn save_and_export(&mut self) -> Option<ExportFailed> {
        let failed = |why: String| {
            Some(ExportFailed {
                why,
                interrupted: false,
            })
        };
        if let Some(gone) = &self.run_dir_gone {
            let (base, committed) = (self.trainer.base_step(), self.trainer.committed());
            return failed(if committed > base {
                format!("{gone}: steps {}..{committed} of this session are lost, with every checkpoint and the export (nothing is written to a removed run directory)", base + 1)
            } else {
                format!("{gone}; nothing is written to a removed run directory")
            });
        }
        if !self.trainer.saves_checkpoints() {
            // A job's follower: the leader writes the job's checkpoints and drafter.
            return None;
        }
        if let Some(a) = self.trainer.checkpoint_held_snapshot() {
            self.execute(vec![a]);
        }
        let (step, checkpoint) = self.trainer.last_checkpoint().cloned()?;
        if step == 0 || self.trainer.committed() == 0 && self.trainer.saved_step() == 0 {
            return None;
        }
        if !checkpoint
            .join(dflash_shared::checkpoint::META_FILE)
            .is_file()
        {
            return failed(format!(
                "the checkpoint of step {step} ({}) is gone: no drafter written",
                checkpoint.display()
            ));
        }
        let out = self.run.path.join("drafter");
        let stops = StopsDuringExport::default();
        let cancel = || stops.heard(&self.rx);
        let written = export_checkpoint(
            &self.cfg.worker_bin,
            &checkpoint,
            &self.cfg.target_dir,
            &out,
            EXPORT_TIMEOUT,
            &cancel,
        );
        // What came meanwhile and is not a signal (a τ measurement's end) is the run's end's
        // to take: back on the channel.
        for ev in stops.kept.take() {
            let _ = self.tx.send(ev);
        }
        match written {
            Ok(written) => {
                self.trainer.on_exported(out.display().to_string(), written);
                self.dirty = true;
                None
            }
            Err(e) => {
                let interrupted = stops.aborted();
                if let Some(sig) = stops.second.get() {
                    self.run.event(
                        "export_aborted",
                        super::obj(serde_json::json!({"signal": sig, "step": step})),
                    );
                }
                let e = match (stops.second.get(), &e) {
                    (Some(sig), ExportError::Stopped { out, .. }) => format!(
                        "the export was aborted by a second {sig}: {} holds the previous export or none",
                        out.display()
                    ),
                    _ => e.to_string(),
                };
                Some(ExportFailed {
                    why: format!(
                        "the drafter (step {step}) could not be written: {e}; the checkpoint is kept: write the drafter later with: dflash-supervise export {}",
                        crate::shell::quote(&self.run.path)
                    ),
                    interrupted,
                })
            }
        }
    }
}

/// Why the run's drafter was not written; `interrupted`: a second stop signal aborted its
/// export (the run then ends as interrupted, exit 130).
pub(super) struct ExportFailed {
    pub why: String,
    pub interrupted: bool,
}

/// The stop signals heard while the drafter is exported, counted as during training: the
/// first says the export is being finished, the second aborts it.
#[derive(Default)]
struct StopsDuringExport {
    first: std::cell::Cell<Option<&'static str>>,
    second: std::cell::Cell<Option<&'static str>>,
    /// The other events taken off the channel meanwhile, to put back after the export.
    kept: std::cell::RefCell<Vec<super::Event>>,
}

impl StopsDuringExport {
    /// Take what came on the dispatcher's channel: the stop signals count, the other
    /// events are kept for after the export; whether the export is to be aborted.
    fn heard(&self, rx: &std::sync::mpsc::Receiver<super::Event>) -> bool {
        use nix::sys::signal::Signal;
        while let Ok(ev) = rx.try_recv() {
            let sig = match ev {
                super::Event::Signal(sig) => sig,
                other => {
                    self.kept.borrow_mut().push(other);
                    continue;
                }
            };
            let name = match Signal::try_from(sig) {
                Ok(s @ (Signal::SIGINT | Signal::SIGTERM | Signal::SIGHUP)) => s.as_str(),
                Ok(s) => {
                    log::info!(
                        "{} received while the drafter is exported: ignored",
                        s.as_str()
                    );
                    continue;
                }
                Err(_) => continue,
            };
            if self.first.get().is_none() {
                self.first.set(Some(name));
                log::warn!(
                    "{name} received: finishing the export of the drafter first (up to {}; {name} again aborts it, keeping the checkpoint)",
                    humantime::format_duration(EXPORT_TIMEOUT)
                );
            } else if self.second.get().is_none() {
                self.second.set(Some(name));
                log::warn!("{name} received again: aborting the export of the drafter");
            }
        }
        self.aborted()
    }

    fn aborted(&self) -> bool {
        self.second.get().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A τ measurement's end (or any event but a stop signal) taken off the channel while
    /// the export runs is kept, to be put back: the run's end waits for it.
    #[test]
    fn events_that_are_not_stop_signals_are_kept_while_the_export_runs() {
        use std::os::unix::process::ExitStatusExt;
        let (tx, rx) = std::sync::mpsc::channel();
        let exited = || super::super::Event::Exited {
            worker: 0,
            life: 1,
            status: std::process::ExitStatus::from_raw(0),
        };
        tx.send(exited()).unwrap();
        tx.send(super::super::Event::Signal(libc::SIGINT)).unwrap();
        tx.send(exited()).unwrap();
        let stops = StopsDuringExport::default();
        assert!(!stops.heard(&rx), "one signal finishes the export");
        assert_eq!(stops.first.get(), Some("SIGINT"));
        assert_eq!(stops.kept.borrow().len(), 2);
        tx.send(super::super::Event::Signal(libc::SIGTERM)).unwrap();
        assert!(stops.heard(&rx), "a second aborts it");
    }
}
