//! Starting one life of a worker through the [`Launcher`](super::launcher::Launcher), and
//! recording it.

use serde_json::json;

use super::launcher::{Launch, SpawnError};
use super::life::{Life, LifeState, Status};
use super::{obj, Dispatcher, StopReason};
use crate::run::rundir::now_rfc3339;
use crate::run::worker_log::Tag;

impl Dispatcher {
    pub(super) fn spawn(&mut self, worker: usize) {
        if let Err(e) = self.try_spawn(worker) {
            let msg = e.to_string();
            log::error!("{msg}");
            self.workers[worker].status = Status::Failed;
            self.begin_stop(StopReason::Fatal(msg));
        }
        self.dirty = true;
    }

    fn try_spawn(&mut self, worker: usize) -> Result<(), SpawnError> {
        let id = self.next_life;
        self.next_life += 1;
        let w = &mut self.workers[worker];
        let launch = Launch {
            worker,
            life: id,
            name: w.name,
            device: w.device,
            restarts: w.restarts,
            log: &mut w.log,
        };
        let launched = self.launcher.launch(launch, &self.tx)?;
        let pid = launched.pid;
        w.log.line(
            Tag::Supervisor,
            &format!("started pid {pid} on {} (restart {})", w.device, w.restarts),
        );
        self.run.event(
            "spawn",
            obj(json!({"worker": w.name.to_string(), "pid": pid,
                                            "gpu": w.device.to_string(), "restart": w.restarts})),
        );
        if w.restarts > 0 {
            log::info!(
                "{} restarted as pid {pid} (restart {} of {})",
                w.name,
                w.restarts,
                self.cfg.max_restarts
            );
        }
        w.status = Status::Live(Life {
            id,
            pid,
            process: launched.process,
            started: self.now,
            started_wall: now_rfc3339(),
            server_name: launched.server_name,
            last_beat: self.now,
            in_work: None,
            fatal: None,
            control_ended: false,
            state: LifeState::Starting,
        });
        Ok(())
    }
}
