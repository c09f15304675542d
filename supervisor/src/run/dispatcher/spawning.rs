//! Starting one life of a worker: its control channel, its process (with the pools
//! inherited), its log pumps and the thread that waits on its pidfd.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use dflash_shared::{env, WorkerName};
use dflash_shared::protocol::FromWorker;
use ipc_channel::ipc::IpcOneShotServer;
use serde_json::json;

use super::life::{Life, LifeState, Status};
use super::{obj, Dispatcher, Event, StopReason};
use crate::run::control;
use crate::run::process::{GroupLeader, SpawnSpec};
use crate::run::rundir::now_rfc3339;
use crate::run::worker_log::Tag;

/// Why a worker life could not be started: the run cannot go on (exit 4).
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("cannot open a control channel for {worker}: {source}")]
    Channel { worker: WorkerName, source: std::io::Error },
    #[error("cannot start {worker} ({}): {source}", program.display())]
    Start { worker: WorkerName, program: std::path::PathBuf, source: std::io::Error },
    #[error("cannot open a pidfd for {worker} (pid {pid}): {source}")]
    Pidfd { worker: WorkerName, pid: u32, source: std::io::Error },
    #[error("cannot start a waiter thread: {0}")]
    Waiter(#[source] std::io::Error),
}

impl Dispatcher {
    pub(super) fn spawn(&mut self, worker: usize) {
        match self.try_spawn(worker) {
            Ok(()) => {}
            Err(e) => {
                let msg = e.to_string();
                log::error!("{msg}");
                self.workers[worker].status = Status::Failed;
                self.begin_stop(StopReason::Fatal(msg));
            }
        }
        self.dirty = true;
    }

    fn try_spawn(&mut self, worker: usize) -> Result<(), SpawnError> {
        let id = self.next_life;
        self.next_life += 1;
        let heartbeat = (self.cfg.hang_timeout / 10).clamp(Duration::from_millis(20), Duration::from_secs(1));
        let w = &mut self.workers[worker];
        let (server, server_name) = IpcOneShotServer::<FromWorker>::new()
            .map_err(|source| SpawnError::Channel { worker: w.name, source })?;
        let spec = SpawnSpec {
            program: self.cfg.worker_bin.clone(),
            inherit_fds: self.pipeline.inherit_fds().into_iter().chain(self.trainer.inherit_fds()).collect(),
            args: vec!["--control".into(), server_name.clone().into()],
            env: vec![
                (env::ROLE.into(), w.name.role.to_string()),
                (env::RANK.into(), w.name.rank.to_string()),
                (env::GPU.into(), w.device.to_string()),
                (env::RESTART_COUNT.into(), w.restarts.to_string()),
                (env::RUN_DIR.into(), self.run.path.display().to_string()),
                (env::HEARTBEAT_MS.into(), heartbeat.as_millis().to_string()),
                (env::CONTROL.into(), server_name.clone()),
                (env::TARGET_DIR.into(), self.cfg.target_dir.display().to_string()),
                ("CUDA_VISIBLE_DEVICES".into(), w.device.cuda_visible_devices()),
                // NVML numbers GPUs by PCI bus; make CUDA agree so GPU i is the same board.
                ("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()),
            ],
        };
        let mut child = self
            .spawner
            .spawn(spec)
            .map_err(|source| SpawnError::Start { worker: w.name, program: self.cfg.worker_bin.clone(), source })?;
        let pid = child.id();
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let process = match GroupLeader::new(child) {
            Ok(p) => Arc::new(p),
            Err((mut child, e)) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(SpawnError::Pidfd { worker: w.name, pid, source: e });
            }
        };
        if let Some(r) = &self.reaper {
            r.watch(pid);
        }
        for (stream, tag) in [
            (stdout.map(|s| Box::new(s) as Box<dyn std::io::Read + Send>), Tag::Stdout),
            (stderr.map(|s| Box::new(s) as Box<dyn std::io::Read + Send>), Tag::Stderr),
        ] {
            if let Some(stream) = stream {
                if let Err(e) = w.log.pump(stream, tag) {
                    log::error!("{}: cannot start a log thread ({e}); its output is lost", w.name);
                }
            }
        }
        control::serve(server, worker, id, self.tx.clone());
        let (tx, waited, reaper) = (self.tx.clone(), process.clone(), self.reaper.clone());
        thread::Builder::new()
            .name(format!("waiter-{pid}"))
            .spawn(move || {
                // Kills what is left of the group and reaps the leader under the lock
                // that every signal to the group takes: no group signal can follow the
                // reap (the pid, hence the group id, may be reused after it).
                let reaped = waited.wait_and_reap(|| {
                    // Before the reap: once reaped the group id may be reused, and the
                    // reaper must not kill it then.
                    if let Some(r) = reaper {
                        r.unwatch(pid);
                    }
                });
                match reaped {
                    Ok(status) => {
                        let _ = tx.send(Event::Exited { worker, life: id, status });
                    }
                    Err(e) => log::error!("cannot reap pid {pid}: {e}"),
                }
            })
            .map_err(SpawnError::Waiter)?;
        let now = Instant::now();
        w.log.line(Tag::Supervisor, &format!("started pid {pid} on {} (restart {})", w.device, w.restarts));
        self.run.event("spawn", obj(json!({"worker": w.name.to_string(), "pid": pid,
                                            "gpu": w.device.to_string(), "restart": w.restarts})));
        if w.restarts > 0 {
            log::info!("{} restarted as pid {pid} (restart {} of {})", w.name, w.restarts, self.cfg.max_restarts);
        }
        w.status = Status::Live(Life {
            id,
            pid,
            process,
            started: now,
            started_wall: now_rfc3339(),
            server_name,
            last_beat: now,
            state: LifeState::Starting,
        });
        Ok(())
    }
}
