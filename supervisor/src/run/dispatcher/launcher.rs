//! The dispatcher's only door to processes: a [`Launcher`] starts a worker life and hands
//! back a [`Process`] to signal. Everything else about the life comes back as events (its
//! control channel's, its exit). Unit tests put a scripted launcher here and feed the
//! dispatcher those events themselves: no process, no sleep.

use std::io;
use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use dflash_shared::protocol::FromWorker;
use dflash_shared::{env, Device, WorkerName};
use ipc_channel::ipc::IpcOneShotServer;
use nix::sys::signal::Signal;

use super::{Event, LifeId};

/// How often a worker sends heartbeats: a tenth of `--hang-timeout`, within 20 ms..1 s.
pub fn heartbeat(hang_timeout: Duration) -> Duration {
    (hang_timeout / 10).clamp(Duration::from_millis(20), Duration::from_secs(1))
}
use crate::run::control;
use crate::run::process::{GroupLeader, SpawnSpec, Spawner};
use crate::run::reaper::Reaper;
use crate::run::worker_log::{Tag, WorkerLog};

/// A started worker process, as far as the dispatcher may touch it.
pub trait Process: Send + Sync {
    /// Signal the process itself.
    fn signal(&self, sig: Signal) -> io::Result<()>;
    /// Signal its whole process group (nothing once the leader has been reaped).
    fn signal_group(&self, sig: Signal);
}

impl Process for GroupLeader {
    fn signal(&self, sig: Signal) -> io::Result<()> {
        GroupLeader::signal(self, sig)
    }

    fn signal_group(&self, sig: Signal) {
        GroupLeader::signal_group(self, sig);
    }
}

/// Which life of which worker to start.
pub struct Launch<'a> {
    pub worker: usize,
    pub life: LifeId,
    pub name: WorkerName,
    pub device: Device,
    pub restarts: u32,
    /// Where its stdout and stderr go.
    pub log: &'a mut WorkerLog,
}

/// A life that started.
pub struct Launched {
    pub pid: u32,
    pub process: Arc<dyn Process>,
    /// Its control channel's one-shot server (see [`Launcher::abandon`]).
    pub server_name: String,
}

/// Starts worker lives. Each life's control events ([`control::ControlEvent`]) and its
/// exit ([`Event::Exited`]) arrive on the dispatcher's channel, tagged with the life.
pub trait Launcher {
    fn launch(&mut self, launch: Launch, events: &Sender<Event>) -> Result<Launched, SpawnError>;
    /// The life died before it connected: wake its control thread, still waiting for it.
    fn abandon(&mut self, server_name: &str);
}

/// Why a worker life could not be started: the run cannot go on (exit 4).
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("cannot open a control channel for {worker}: {source}")]
    Channel {
        worker: WorkerName,
        source: io::Error,
    },
    #[error("cannot start {worker} ({}): {}", program.display(), crate::nproc::start_failure(.source))]
    Start {
        worker: WorkerName,
        program: PathBuf,
        source: io::Error,
    },
    #[error("cannot open a pidfd for {worker} (pid {pid}): {source}")]
    Pidfd {
        worker: WorkerName,
        pid: u32,
        source: io::Error,
    },
    #[error("cannot start a waiter thread: {}", crate::nproc::start_failure(.0))]
    Waiter(#[source] io::Error),
}

/// Real processes: spawned by the spawner thread into their own group, watched by a pidfd
/// on a waiter thread, with the reaper told of each.
pub struct Processes {
    pub spawner: Spawner,
    pub reaper: Option<Arc<Reaper>>,
    pub worker_bin: PathBuf,
    pub target_dir: PathBuf,
    /// `native` or `torch` (the target workers' `DFLASH_TARGET_ENGINE`).
    pub target_engine: &'static str,
    /// Per target rank, its GPUs when it holds several (`CUDA_VISIBLE_DEVICES` lists them).
    pub target_spans: Vec<Vec<u32>>,
    pub run_dir: PathBuf,
    pub heartbeat: Duration,
    /// The shared-memory pools every worker inherits.
    pub inherit_fds: Vec<std::os::fd::RawFd>,
}

impl Processes {
    /// The launcher of a run: `reaper`, if it started, watches every worker's group.
    pub fn new(
        cfg: &super::Config,
        run_dir: PathBuf,
        reaper: Option<Reaper>,
        data: &super::Data,
    ) -> Result<Processes, crate::error::Error> {
        Ok(Processes {
            spawner: Spawner::start()
                .map_err(|e| crate::error::Error::start("spawner thread", e))?,
            reaper: reaper.map(Arc::new),
            worker_bin: cfg.worker_bin.clone(),
            target_dir: cfg.target_dir.clone(),
            target_engine: cfg.target_engine,
            target_spans: cfg.target_spans.clone(),
            run_dir,
            heartbeat: heartbeat(cfg.hang_timeout),
            inherit_fds: data
                .pipeline
                .inherit_fds()
                .into_iter()
                .chain(data.trainer.inherit_fds())
                .collect(),
        })
    }
}

impl Launcher for Processes {
    fn launch(&mut self, l: Launch, events: &Sender<Event>) -> Result<Launched, SpawnError> {
        let (server, server_name) =
            IpcOneShotServer::<FromWorker>::new().map_err(|source| SpawnError::Channel {
                worker: l.name,
                source,
            })?;
        let mut child = self
            .spawner
            .spawn(self.spec(&l, &server_name))
            .map_err(|source| SpawnError::Start {
                worker: l.name,
                program: self.worker_bin.clone(),
                source,
            })?;
        let pid = child.id();
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let process = match GroupLeader::new(child) {
            Ok(p) => Arc::new(p),
            Err((mut child, source)) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(SpawnError::Pidfd {
                    worker: l.name,
                    pid,
                    source,
                });
            }
        };
        if let Some(r) = &self.reaper {
            r.watch(pid);
        }
        for (stream, tag) in [
            (
                stdout.map(|s| Box::new(s) as Box<dyn io::Read + Send>),
                Tag::Stdout,
            ),
            (
                stderr.map(|s| Box::new(s) as Box<dyn io::Read + Send>),
                Tag::Stderr,
            ),
        ] {
            if let Some(stream) = stream {
                if let Err(e) = l.log.pump(stream, tag) {
                    log::error!(
                        "{}: cannot start a log thread ({}); its output is lost",
                        l.name,
                        crate::nproc::start_failure(&e)
                    );
                }
            }
        }
        control::serve(server, l.worker, l.life, events.clone());
        self.watch_exit(l.worker, l.life, process.clone(), events.clone())?;
        Ok(Launched {
            pid,
            process,
            server_name,
        })
    }

    fn abandon(&mut self, server_name: &str) {
        control::abandon(server_name);
    }
}

impl Processes {
    fn spec(&self, l: &Launch, server_name: &str) -> SpawnSpec {
        SpawnSpec {
            program: self.worker_bin.clone(),
            inherit_fds: self.inherit_fds.clone(),
            args: vec!["--control".into(), server_name.into()],
            env: vec![
                (env::ROLE.into(), l.name.role.to_string()),
                (env::RANK.into(), l.name.rank.to_string()),
                (env::GPU.into(), l.device.to_string()),
                (env::RESTART_COUNT.into(), l.restarts.to_string()),
                (env::RUN_DIR.into(), self.run_dir.display().to_string()),
                (
                    env::HEARTBEAT_MS.into(),
                    self.heartbeat.as_millis().to_string(),
                ),
                (env::CONTROL.into(), server_name.into()),
                (
                    env::TARGET_DIR.into(),
                    self.target_dir.display().to_string(),
                ),
                (env::TARGET_ENGINE.into(), self.target_engine.into()),
                (
                    "CUDA_VISIBLE_DEVICES".into(),
                    visible_devices(&self.target_spans, l.name, l.device),
                ),
                // NVML numbers GPUs by PCI bus; make CUDA agree so GPU i is the same board.
                ("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()),
            ],
        }
    }

    /// A thread that blocks on the process's pidfd and reports its exit.
    fn watch_exit(
        &self,
        worker: usize,
        life: LifeId,
        process: Arc<GroupLeader>,
        tx: Sender<Event>,
    ) -> Result<(), SpawnError> {
        let (pid, reaper) = (process.pid(), self.reaper.clone());
        thread::Builder::new()
            .name(format!("waiter-{pid}"))
            .spawn(move || {
                // Kills what is left of the group and reaps the leader under the lock
                // that every signal to the group takes: no group signal can follow the
                // reap (the pid, hence the group id, may be reused after it).
                let reaped = process.wait_and_reap(|| {
                    // Before the reap: once reaped the group id may be reused, and the
                    // reaper must not kill it then.
                    if let Some(r) = reaper {
                        r.unwatch(pid);
                    }
                });
                match reaped {
                    Ok(status) => {
                        let _ = tx.send(Event::Exited {
                            worker,
                            life,
                            status,
                        });
                    }
                    Err(e) => log::error!("cannot reap pid {pid}: {e}"),
                }
            })
            .map(|_| ())
            .map_err(SpawnError::Waiter)
    }
}

/// `CUDA_VISIBLE_DEVICES` of worker `name` on `device`: its GPU, or every GPU of a target
/// worker that holds several (`spans`, per target rank).
fn visible_devices(spans: &[Vec<u32>], name: WorkerName, device: Device) -> String {
    match spans.get(name.rank as usize) {
        Some(span) if name.role == dflash_shared::Role::Target && span.len() > 1 => span
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
        _ => device.cuda_visible_devices(),
    }
}

#[cfg(test)]
mod visible_tests {
    use super::*;
    use dflash_shared::Role;

    #[test]
    fn a_target_holding_several_gpus_sees_them_all_and_no_other_worker_does() {
        let spans = [vec![2, 3], vec![]];
        let name = |role, rank| WorkerName { role, rank };
        assert_eq!(
            visible_devices(&spans, name(Role::Target, 0), Device::Gpu(2)),
            "2,3"
        );
        assert_eq!(
            visible_devices(&spans, name(Role::Target, 1), Device::Gpu(4)),
            "4"
        );
        // A drafter of the same rank keeps its own GPU.
        assert_eq!(
            visible_devices(&spans, name(Role::Drafter, 0), Device::Gpu(5)),
            "5"
        );
        assert_eq!(visible_devices(&[], name(Role::Target, 0), Device::Cpu), "");
    }
}
