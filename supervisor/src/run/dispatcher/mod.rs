//! The dispatcher: the one owner of the supervisor's state.
//!
//! # Theory of operation
//!
//! Everything that can happen to a run arrives as an [`Event`] on one channel: a signal
//! (from the signal thread), a worker connecting or sending a message (from its control
//! thread), a worker exiting (from its waiter thread, which blocks on the worker's pidfd).
//! Timers (hang detection, restart backoff, the stop deadline, the time limit) are checked
//! each time the loop wakes, at least every `TICK`. Only the dispatcher reads or writes
//! the worker table, so every decision sees one consistent picture and there are no locks
//! around it; helper threads own nothing but their fds.
//!
//! Each start of a worker is a *life* with a unique [`LifeId`]. Events carry it, so a late
//! event from a previous life (a control thread noticing a closed channel after the
//! replacement started) is recognised and dropped.
//!
//! A worker is only ever declared dead by its pidfd. A hang (no heartbeat for
//! `--hang-timeout`) or a protocol violation sends SIGKILL through the pidfd and records
//! why; the exit that follows is handled like any other death. A death is acted on (slots
//! reclaimed, restart decided) only once the dead worker's control channel has been read
//! to its end too, so a commit or ack it sent just before dying is never lost or
//! misread as stale (`DRAIN_GRACE` bounds the wait).
//!
//! The dispatcher touches processes only through a [`launcher::Launcher`] (start a life)
//! and the [`launcher::Process`] it returns (signal it), and reads time only from the
//! `now` of each turn of its loop (`step`). Its unit tests (`tests.rs`)
//! put a scripted launcher there and feed events at exact times: no process, no sleep.
//!
//! The data plane ([`Pipeline`]) is driven from here: after every event the dispatcher
//! grants what can be granted, and it stops the run once the loader is done and every
//! batch has been consumed.

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use dflash_shared::drafter::StepStats;
use dflash_shared::protocol::{FromWorker, Hello, SlotRef, ToWorker, PROTOCOL_VERSION};
use dflash_shared::{Device, Role, WorkerName};
use nix::sys::signal::Signal;
use serde_json::json;

use crate::data::pipeline::{LoaderEvent, Peer, Pipeline};
use crate::error::Error;
use crate::run::control;
use crate::run::control::ControlEvent;
use crate::run::process::describe_status;
use crate::run::restart::backoff;
use crate::run::root_cause::Report;
use crate::run::rundir::{now_rfc3339, unix_ms, RunDir};
use crate::run::worker_log::{Rotation, Tag, WorkerLog};
use crate::telemetry::nvml::GpuSamples;
use crate::training::trainer::Trainer;
use crate::violation::Violation;
use launcher::Launcher;
use life::{Life, Status};

mod data;
mod ending;
pub mod job;
pub mod launcher;
mod life;
mod metrics;
mod moves;
mod saving;
mod spawning;
mod steps;
pub mod tau_job;
#[cfg(test)]
mod tests;

/// Longest the loop sleeps without looking at its timers.
const TICK: Duration = Duration::from_millis(50);
/// A turn of the loop (its wait for an event included) this much longer than [`TICK`]
/// means the supervisor was not watching its workers: see
/// [`Dispatcher::resume_after_pause`].
const PAUSE: Duration = Duration::from_secs(2);
/// In a job across nodes, the same stop signal again within this long is the same stop
/// (srun forwards to its tasks the signal Slurm sends every process of the job).
const SAME_STOP_SIGNAL: Duration = Duration::from_secs(3);
/// Events handled in one turn at most, before the timers.
const MAX_EVENTS_PER_TURN: usize = 4096;
/// How long a dead worker's control channel may stay open before its death is handled
/// anyway (something it forked may still hold the socket).
const DRAIN_GRACE: Duration = Duration::from_secs(2);

pub use crate::run::control::LifeId;

/// Everything the dispatcher reacts to. Each source owns its event type; this wraps them.
pub enum Event {
    Signal(i32),
    Control(ControlEvent),
    Exited {
        worker: usize,
        life: LifeId,
        status: ExitStatus,
    },
    Loader(LoaderEvent),
    GpuSamples(GpuSamples),
    /// A τ measurement ended (`--eval-prompts`).
    Tau(tau_job::TauOutcome),
    /// From the link to the other nodes of a job across nodes.
    Job(crate::cluster::job::Input),
}

impl From<ControlEvent> for Event {
    fn from(e: ControlEvent) -> Event {
        Event::Control(e)
    }
}

impl From<LoaderEvent> for Event {
    fn from(e: LoaderEvent) -> Event {
        Event::Loader(e)
    }
}

impl From<GpuSamples> for Event {
    fn from(e: GpuSamples) -> Event {
        Event::GpuSamples(e)
    }
}

pub struct Config {
    pub plan: Vec<(WorkerName, Device)>,
    /// Per target rank, the GPUs it holds when more than one (`--gpus-per-target`), its
    /// device first; empty otherwise.
    pub target_spans: Vec<Vec<u32>>,
    pub worker_bin: PathBuf,
    /// The target model directory workers load.
    pub target_dir: PathBuf,
    /// What runs it: `native` or `torch`.
    pub target_engine: &'static str,
    pub hang_timeout: Duration,
    /// `--step-timeout`; `None`: the default of `steps::default_step_timeout`.
    pub step_timeout: Option<Duration>,
    pub max_restarts: u32,
    pub stable_after: Duration,
    pub stop_timeout: Duration,
    pub time_limit: Option<Duration>,
    pub tee: bool,
    pub log_max_size: u64,
    pub log_backups: u32,
    pub gpu_metrics: bool,
    pub prometheus: Option<crate::telemetry::prometheus::Exporter>,
    /// `--wandb-project`: the W&B bridge the run keeps going.
    pub wandb: Option<crate::telemetry::wandb::WandbArgs>,
    pub gpu_sample_interval: Duration,
    pub metrics_interval: Duration,
    /// Real τ during training (`--eval-prompts`).
    pub tau: Option<tau_job::TauConfig>,
    /// `--targets auto`: how the split between the roles is balanced.
    pub balance: Option<crate::run::balance::BalanceConfig>,
}

/// What the run feeds its workers.
pub struct Data {
    pub pipeline: Pipeline,
    pub loader: crate::data::share::Source,
    pub trainer: Trainer,
    /// This node's part in a job across nodes.
    pub job: Option<job::Job>,
}

struct Worker {
    name: WorkerName,
    device: Device,
    log: WorkerLog,
    log_path: PathBuf,
    status: Status,
    restarts: u32,
    consecutive_failures: u32,
    last_exit: Option<String>,
    /// A stop found this worker's process and it did not end the way a stop asks (exit 0
    /// after the request): it had to be killed, or failed. A worker with no process when
    /// the stop came (waiting to restart) has nothing to stop and is not counted.
    unclean_stop: bool,
    /// Lives in a row that ended before their hello, and whether any life ever said it.
    lives_without_hello: u32,
    ever_connected: bool,
    /// What its units of work took (for `--step-timeout`).
    steps: steps::StepTimes,
}

impl Worker {
    /// `name` on `device`, not started, its log opened.
    fn open(
        cfg: &Config,
        run: &RunDir,
        (name, device): (WorkerName, Device),
        restarts: u32,
    ) -> Result<Worker, Error> {
        let log_path = run.worker_log(&name.to_string());
        let tee = cfg.tee.then(|| format!("[{name}]"));
        let rotation = Rotation {
            max_size: cfg.log_max_size,
            backups: cfg.log_backups,
        };
        let log = WorkerLog::open(&log_path, rotation, tee)
            .map_err(|e| Error::io("cannot open", &log_path, e))?;
        Ok(Worker {
            name,
            device,
            log,
            log_path,
            status: Status::NotStarted,
            restarts,
            consecutive_failures: 0,
            last_exit: None,
            unclean_stop: false,
            lives_without_hello: 0,
            ever_connected: false,
            steps: steps::StepTimes::default(),
        })
    }
}

/// Lives in a row that end before saying hello, with no life of that worker ever
/// connected, before the worker program is judged unable to start (exit 4).
const NEVER_CONNECTED_LIVES: u32 = 3;

enum Phase {
    Running,
    Stopping { deadline: Instant },
    Killing,
}

enum StopReason {
    Requested(String),
    TimeLimit,
    GaveUp(Box<Report>),
    Fatal(String),
    BadInput(String),
    Interrupted,
    DataDone,
    StepsDone,
    TrainingFailed(String),
}

pub struct Dispatcher {
    cfg: Config,
    run: RunDir,
    workers: Vec<Worker>,
    phase: Phase,
    stop_reason: Option<StopReason>,
    tx: Sender<Event>,
    rx: Receiver<Event>,
    launcher: Box<dyn Launcher>,
    /// The time of the event or timer being handled: the dispatcher's only clock.
    now: Instant,
    next_life: LifeId,
    started: Instant,
    started_wall: String,
    started_unix_ms: u64,
    dirty: bool,
    pipeline: Pipeline,
    loader: Option<crate::data::share::Source>,
    job: Option<job::Job>,
    trainer: Trainer,
    written_progress: (u64, u64),
    written_at: Instant,
    metrics: crate::telemetry::metrics::Metrics,
    /// When the run directory was last looked at, and why it is gone if it is.
    run_dir_seen: Instant,
    run_dir_gone: Option<String>,
    tau: Option<tau_job::TauRunner>,
    /// The W&B bridge (`--wandb-project`).
    wandb: Option<crate::telemetry::wandb::Bridge>,
    /// `--targets auto`: the balancer, and the worker whose device is moving now.
    balancer: Option<crate::run::balance::Balancer>,
    moving: Option<moves::Moving>,
    /// Moves made over this session.
    role_moves: u64,
    /// The stop signal that began the stop, and when.
    stop_signal_at: Option<(Signal, Instant)>,
}

impl Dispatcher {
    pub fn new(
        mut cfg: Config,
        run: RunDir,
        data: Data,
        launcher: Box<dyn Launcher>,
    ) -> Result<Dispatcher, Error> {
        let metrics = crate::telemetry::metrics::Metrics::new(&run.path);
        if let Some(p) = &cfg.prometheus {
            let name = run.path.file_name().map(|n| n.to_string_lossy());
            p.set_run(name.as_deref().unwrap_or(""));
        }
        let wandb = match cfg.wandb.take() {
            Some(a) => Some(crate::telemetry::wandb::Bridge::start(a, &run.path)?),
            None => None,
        };
        let (tx, rx) = mpsc::channel();
        let mut workers = Vec::new();
        // `--max-restarts` counts over the whole run: a resumed run's workers start with
        // the restarts their names had in the earlier sessions.
        let earlier = run.restarts_so_far();
        let carried: Vec<String> = cfg
            .plan
            .iter()
            .filter_map(|(name, _)| {
                let n = earlier.get(&name.to_string()).copied().unwrap_or(0);
                (n > 0).then(|| format!("{name} {n}"))
            })
            .collect();
        if !carried.is_empty() {
            log::info!(
                "restarts so far in this run (--max-restarts {} counts over the whole run): {}",
                cfg.max_restarts,
                carried.join(", ")
            );
        }
        for &(name, device) in &cfg.plan {
            let restarts = earlier.get(&name.to_string()).copied().unwrap_or(0);
            workers.push(Worker::open(&cfg, &run, (name, device), restarts)?);
        }
        Ok(Dispatcher {
            run,
            workers,
            phase: Phase::Running,
            stop_reason: None,
            tx,
            rx,
            launcher,
            now: Instant::now(),
            next_life: 1,
            started: Instant::now(),
            started_wall: now_rfc3339(),
            started_unix_ms: unix_ms(),
            dirty: true,
            pipeline: data.pipeline,
            loader: Some(data.loader),
            job: data.job,
            trainer: data.trainer,
            written_progress: (0, 0),
            written_at: Instant::now(),
            metrics,
            run_dir_seen: Instant::now(),
            run_dir_gone: None,
            tau: cfg.tau.take().map(tau_job::TauRunner::new),
            wandb,
            balancer: cfg
                .balance
                .map(|b| crate::run::balance::Balancer::new(b, Instant::now())),
            moving: None,
            role_moves: 0,
            stop_signal_at: None,
            cfg,
        })
    }

    /// A sender for event sources outside the dispatcher (the signal thread).
    pub fn events(&self) -> Sender<Event> {
        self.tx.clone()
    }

    /// Run until every worker is gone; returns the process exit code.
    pub fn run(mut self) -> i32 {
        self.start(Instant::now());
        // The start of the last turn: a pause is measured from it, so that one that falls
        // in a turn's own work (not only in the wait for an event) is seen too.
        let mut last_turn = Instant::now();
        loop {
            self.flush_state();
            if self.finished() {
                break;
            }
            let mut evs = match self.rx.recv_timeout(TICK) {
                Ok(ev) => vec![ev],
                Err(RecvTimeoutError::Timeout) => vec![],
                Err(RecvTimeoutError::Disconnected) => {
                    unreachable!("the dispatcher holds a sender")
                }
            };
            // Everything queued meanwhile, bounded so that timers still run under a flood.
            while evs.len() < MAX_EVENTS_PER_TURN {
                match self.rx.try_recv() {
                    Ok(ev) => evs.push(ev),
                    Err(_) => break,
                }
            }
            let now = Instant::now();
            let gap = now.saturating_duration_since(last_turn);
            last_turn = now;
            if gap > TICK + PAUSE {
                self.resume_after_pause(gap, now);
            }
            self.step_all(evs, now);
        }
        self.finish()
    }

    /// One turn of the loop at `now`: the event, if one came, then the timers, then the
    /// grants. `now` is the dispatcher's only clock.
    #[cfg(test)]
    fn step(&mut self, ev: Option<Event>, now: Instant) {
        self.step_all(ev.into_iter().collect(), now);
    }

    /// One turn with every event that was queued (all of them before any timer: after a
    /// pause, the heartbeats that waited in the queue count before the hang check).
    fn step_all(&mut self, evs: Vec<Event>, now: Instant) {
        self.now = now;
        for ev in evs {
            self.handle(ev);
        }
        self.on_timers(now);
        self.pump();
        self.maybe_start_tau();
    }

    /// The loop wakes at least every [`TICK`]: a much longer gap since the last turn means
    /// the supervisor itself did not run (SIGSTOP, a stalled host), so nothing it saw of
    /// its workers is current. Their hang and step timers (and the stop deadline) start
    /// again, rather than healthy workers being killed as "hung".
    fn resume_after_pause(&mut self, gap: Duration, now: Instant) {
        log::warn!(
            "the supervisor did not run for {:.1}s (stopped, its machine stalled, or one turn of its loop took that long): restarting the workers' hang and step timers",
            gap.as_secs_f64()
        );
        for w in &mut self.workers {
            if let Some(l) = w.status.life_mut() {
                l.last_beat = l.last_beat.max(now);
                if let Some(b) = &mut l.in_work {
                    b.timer = b.timer.max(now);
                }
            }
        }
        if let Phase::Stopping { deadline } = &mut self.phase {
            *deadline += gap;
        }
    }

    /// Record the start, start the loader and every worker, and the GPU sampler.
    fn start(&mut self, now: Instant) {
        self.now = now;
        self.started = now;
        self.written_at = now;
        self.metrics.restart(now);
        if let Some(b) = self.cfg.balance {
            self.balancer = Some(crate::run::balance::Balancer::new(b, now));
        }
        // Hints agree with the warning that CPU workers outnumber the cores.
        let limit = crate::run::validate::oversubscribed(&self.cfg.plan);
        self.pipeline.health.cpu_limited(limit);
        if self.balancer.is_some() {
            self.pipeline.health.balanced();
        }
        let names: Vec<String> = self
            .workers
            .iter()
            .map(|w| format!("{} on {}", w.name, w.device))
            .collect();
        log::info!(
            "run dir {}; starting {}",
            self.run.path.display(),
            names.join(", ")
        );
        log::info!("{}", self.pipeline.describe());
        log::info!("{}", self.trainer.describe());
        self.run.event(
            "run_start",
            obj(json!({
                "workers": names,
                "pid": std::process::id(),
                "gpu_metrics": self.cfg.gpu_metrics,
                "metrics_interval_s": self.cfg.metrics_interval.as_secs_f64(),
            })),
        );
        if let Some(loader) = self.loader.take() {
            if let Err(e) = self.pipeline.start_loader(loader, self.tx.clone()) {
                log::error!("{e}");
                self.begin_stop(StopReason::Fatal(e.to_string()));
            }
        }
        self.job_begin();
        for i in 0..self.workers.len() {
            self.spawn(i);
        }
        if self.cfg.gpu_metrics {
            let mut gpus: Vec<u32> = self
                .workers
                .iter()
                .filter_map(|w| {
                    if let Device::Gpu(g) = w.device {
                        Some(g)
                    } else {
                        None
                    }
                })
                .collect();
            gpus.extend(self.cfg.target_spans.iter().flatten());
            gpus.sort_unstable();
            gpus.dedup();
            crate::telemetry::nvml::start(gpus, self.cfg.gpu_sample_interval, self.tx.clone());
        }
    }

    fn finished(&self) -> bool {
        !matches!(self.phase, Phase::Running)
            && self.workers.iter().all(|w| w.status.life().is_none())
    }

    fn handle(&mut self, ev: Event) {
        match ev {
            Event::Signal(sig) => self.on_signal(sig),
            Event::Control(ControlEvent::Connected {
                worker,
                life,
                hello,
            }) => self.on_connected(worker, life, hello),
            Event::Control(ControlEvent::Message { worker, life, msg }) => {
                self.on_message(worker, life, msg)
            }
            Event::Control(ControlEvent::Abandoned { worker, life }) => {
                if let Some(status) = self.live(worker, life).and_then(|l| l.abandoned()) {
                    self.finish_exit(worker, status);
                }
            }
            Event::Control(ControlEvent::ChannelLost {
                worker,
                life,
                reason,
                malformed,
            }) => {
                let Some(l) = self.live(worker, life) else {
                    return;
                };
                if let Some(status) = l.channel_lost() {
                    self.finish_exit(worker, status);
                    return;
                }
                if malformed {
                    self.violation(worker, &Violation::Malformed(reason));
                } else {
                    if matches!(self.phase, Phase::Running) {
                        log::info!("{}: {reason}", self.workers[worker].name);
                    }
                }
            }
            Event::Exited {
                worker,
                life,
                status,
            } => self.on_exit(worker, life, status),
            Event::GpuSamples(GpuSamples(samples)) => self.metrics.gpu.add(&samples),
            Event::Tau(o) => self.on_tau(o),
            Event::Job(i) => self.on_job_input(i),
            Event::Loader(ev) => {
                if let Err(e) = self.pipeline.on_loader(ev) {
                    log::error!("{e}");
                    self.begin_stop(StopReason::BadInput(e.to_string()));
                }
                if let Some(batches) = self.pipeline.first_epoch_batches() {
                    if let Some(msg) = self.trainer.refine_schedule(batches) {
                        log::info!("{msg}");
                        let schedule = self.trainer.schedule().map(|s| s.to_json());
                        self.run
                            .event("schedule", obj(json!({ "schedule": schedule })));
                    }
                }
            }
        }
    }

    /// The current life of `worker` if it is `life`.
    fn live(&mut self, worker: usize, life: LifeId) -> Option<&mut Life> {
        self.workers[worker]
            .status
            .life_mut()
            .filter(|l| l.id == life)
    }

    fn on_signal(&mut self, sig: i32) {
        let Ok(signal) = Signal::try_from(sig) else {
            return;
        };
        match signal {
            Signal::SIGUSR1 | Signal::SIGUSR2 => self.on_user_signal(signal),
            _ => match self.phase {
                Phase::Running => {
                    self.stop_signal_at = Some((signal, self.now));
                    log::info!(
                        "{} received: stopping workers (up to {} before they are killed; Ctrl-C again to kill now)",
                        signal.as_str(),
                        humantime::format_duration(self.cfg.stop_timeout)
                    );
                    self.begin_stop(StopReason::Requested(format!(
                        "{} received",
                        signal.as_str()
                    )));
                }
                _ if self.job.is_some()
                    && self.stop_signal_at.is_some_and(|(first, at)| {
                        first == signal && self.now.saturating_duration_since(at) < SAME_STOP_SIGNAL
                    }) =>
                {
                    // Slurm signals every process of the job and srun forwards what it gets
                    // to its tasks: one stop reaches a node of a job twice.
                    log::info!(
                        "{} again within {}s (srun forwards the signal Slurm sends the whole job): the same stop",
                        signal.as_str(),
                        SAME_STOP_SIGNAL.as_secs()
                    );
                }
                _ => {
                    log::warn!(
                        "{} received again: killing every worker now",
                        signal.as_str()
                    );
                    // A give-up or fatal error stays the reason: its report matters more.
                    if !matches!(
                        self.stop_reason,
                        Some(StopReason::GaveUp(_) | StopReason::Fatal(_))
                    ) {
                        self.stop_reason = Some(StopReason::Interrupted);
                    }
                    self.kill_all("second stop signal");
                }
            },
        }
    }

    /// SIGUSR1 or SIGUSR2: the workers get it too; SIGUSR1 is also a checkpoint request.
    fn on_user_signal(&mut self, signal: Signal) {
        // SIGUSR1 is the usual pre-emption notice (Slurm's --signal=B:USR1@SECS):
        // save the training state now, so the stop that follows loses nothing.
        if signal == Signal::SIGUSR1
            && matches!(self.phase, Phase::Running)
            && !self.trainer.saves_checkpoints()
        {
            log::info!(
                "SIGUSR1 received (pre-emption notice): the job's leader writes its checkpoint"
            );
        } else if signal == Signal::SIGUSR1 && matches!(self.phase, Phase::Running) {
            let Some(step) = self.trainer.request_checkpoint() else {
                // Asked already, not yet written: one request, said once (and
                // forwarded once).
                log::debug!("SIGUSR1 again before its checkpoint: coalesced");
                return;
            };
            log::info!("SIGUSR1 received (pre-emption notice): writing a checkpoint at step {step}, then training on");
            self.run.event(
                "checkpoint_requested",
                obj(json!({"signal": "SIGUSR1", "step": step})),
            );
        }
        // Only to workers that said hello: one still starting may not have its
        // handlers yet, and the signal's default action would kill it.
        let (told, starting): (Vec<_>, Vec<_>) = self
            .workers
            .iter()
            .filter_map(|w| w.status.life().map(|l| (w, l)))
            .partition(|(_, l)| l.connected());
        for (_, l) in &told {
            l.process.signal_group(signal);
        }
        let starting: Vec<String> = starting.iter().map(|(w, _)| w.name.to_string()).collect();
        if starting.is_empty() {
            log::info!("forwarded {} to every worker", signal.as_str());
        } else {
            log::info!(
                "forwarded {} to {} worker(s); not to {} (still starting)",
                signal.as_str(),
                told.len(),
                starting.join(", ")
            );
        }
        self.run
            .event("signal_forwarded", obj(json!({"signal": signal.as_str()})));
    }

    fn on_connected(&mut self, worker: usize, life: LifeId, hello: Hello) {
        let stopping = !matches!(self.phase, Phase::Running);
        let name = self.workers[worker].name;
        let bin = self.cfg.worker_bin.display().to_string();
        let pools = self.pipeline.pools_message();
        let now = self.now;
        let Some(l) = self.live(worker, life) else {
            return;
        };
        if hello.protocol != PROTOCOL_VERSION {
            let msg = format!(
                "{name} speaks control protocol v{}, this supervisor v{PROTOCOL_VERSION}: the worker binary {bin} comes from another version of dflash-supervise",
                hello.protocol
            );
            let _ = l.process.signal(Signal::SIGKILL);
            l.mark_killed("incompatible control protocol");
            log::error!("{msg}");
            self.begin_stop(StopReason::Fatal(msg));
            return;
        }
        if hello.worker != name.to_string() {
            let said = hello.worker.clone();
            self.violation(worker, &Violation::WrongHello { said });
            return;
        }
        l.last_beat = now;
        if hello.to_worker.send(pools).is_err() {
            log::warn!("{name}: cannot send the pool description; its channel is closed");
        }
        let alive = l.connect(hello.to_worker, now);
        let pid = l.pid;
        self.workers[worker].lives_without_hello = 0;
        self.workers[worker].ever_connected = true;
        if !alive {
            // Its hello was taken after its death: what it sent is read, then the death
            // is handled (as a connected worker's).
            log::info!("{name} (pid {pid}) said hello and died before it was taken");
            return;
        }
        if hello.pid != pid {
            log::info!(
                "{name}: hello from pid {} (spawned pid {pid}; a wrapper?)",
                hello.pid
            );
        }
        self.dirty = true;
        log::info!("{name} ready (pid {pid})");
        if stopping {
            self.ask_to_stop(worker, "the run is stopping");
        } else if name.role == Role::Drafter {
            let actions = self.trainer.on_ready(worker, life, name.rank);
            self.execute(actions);
        }
    }

    fn on_message(&mut self, worker: usize, life: LifeId, msg: FromWorker) {
        let name = self.workers[worker].name;
        let now = self.now;
        let Some(l) = self.live(worker, life) else {
            return;
        };
        l.last_beat = now;
        let (holder, pid) = (l.id, l.pid);
        let result: Result<(), Violation> = match msg {
            FromWorker::Heartbeat { busy, .. } => {
                let old = l.in_work.take().map(|b| *b);
                l.in_work = steps::InWork::update(old, busy, now).map(Box::new);
                Ok(())
            }
            FromWorker::DeviceMemory(m) => {
                self.pipeline.health.device_memory(&name.to_string(), m);
                Ok(())
            }
            FromWorker::Fatal { kind, message } => {
                log::info!("{name} is ending on a {} failure: {message}", kind.as_str());
                l.fatal = Some((kind, message));
                Ok(())
            }
            m @ (FromWorker::Commit { .. }
            | FromWorker::Ack { .. }
            | FromWorker::Evaluated { .. }) => {
                if l.to_worker().is_none() {
                    return;
                }
                self.on_data_message(worker, Peer { name, holder, pid }, m)
            }
            m @ FromWorker::Grads { .. } => {
                self.on_data_message(worker, Peer { name, holder, pid }, m)
            }
            m @ (FromWorker::Reduced { .. }
            | FromWorker::GroupId { .. }
            | FromWorker::SnapshotDone { .. }
            | FromWorker::Checkpointed { .. }
            | FromWorker::CheckpointFailed { .. }) => self.on_group_message(worker, name, m),
            other => Err(Violation::Unexpected {
                message: variant(&other),
            }),
        };
        if let Err(why) = result {
            self.violation(worker, &why);
        }
    }

    /// A message of the data plane from `peer`: a slot committed, acknowledged or
    /// evaluated (taken only from a life still connected, see `on_message`), or a
    /// drafter's gradients.
    fn on_data_message(
        &mut self,
        worker: usize,
        peer: Peer,
        msg: FromWorker,
    ) -> Result<(), Violation> {
        match msg {
            FromWorker::Commit {
                output,
                len,
                batch_id,
                input,
                wait_ms,
                compute_ms,
            } => {
                let r = self.pipeline.on_commit(&peer, output, len, batch_id, input);
                if r.is_ok() {
                    let w = peer.name.to_string();
                    self.pipeline.health.phase(&w, "wait", wait_ms);
                    self.pipeline.health.phase(&w, "forward", compute_ms);
                    self.step_took(worker, compute_ms);
                }
                r
            }
            FromWorker::Ack { input, batch_id } => self.pipeline.on_ack(&peer, input, batch_id),
            FromWorker::Evaluated {
                input,
                batch_id,
                step,
                stats,
            } => self.on_evaluated(&peer, input, batch_id, step, &stats),
            FromWorker::Grads {
                step,
                input,
                batch_id,
                stats,
                params,
            } => match self
                .pipeline
                .check_consume(peer.name, peer.holder, input, batch_id)
            {
                Ok(()) => {
                    let w = peer.name.to_string();
                    self.pipeline.health.phase(&w, "wait", stats.wait_ms);
                    self.pipeline
                        .health
                        .phase(&w, "forward_backward", stats.compute_ms);
                    self.pipeline
                        .health
                        .phase(&w, "optimizer", stats.optimizer_ms);
                    self.step_took(worker, stats.compute_ms);
                    let actions = self
                        .trainer
                        .on_grads(worker, step, input, batch_id, stats, params);
                    self.execute(actions);
                    Ok(())
                }
                Err(e) => Err(Violation::InvalidGradients(Box::new(e))),
            },
            other => Err(Violation::Unexpected {
                message: variant(&other),
            }),
        }
    }

    /// A message of the drafter group's training from worker `name`: an all-reduce, the
    /// group's id, a snapshot, a checkpoint written or failed.
    fn on_group_message(
        &mut self,
        worker: usize,
        name: WorkerName,
        msg: FromWorker,
    ) -> Result<(), Violation> {
        match msg {
            FromWorker::Reduced {
                step,
                epoch,
                weight_sum,
                ms,
            } => {
                self.pipeline
                    .health
                    .phase(&name.to_string(), "all_reduce", ms);
                let actions = self.trainer.on_reduced(worker, step, epoch, weight_sum, ms);
                self.execute(actions);
                Ok(())
            }
            FromWorker::GroupId { epoch, id } => {
                let actions = self.trainer.on_group_id(worker, epoch, id);
                self.execute(actions);
                Ok(())
            }
            FromWorker::SnapshotDone { step, slot, ms } => {
                let actions = self.trainer.on_snapshot_done(worker, step, slot, ms);
                self.execute(actions);
                Ok(())
            }
            FromWorker::Checkpointed { dir, step } => {
                self.trainer.on_checkpointed(dir.clone(), step);
                self.job_checkpointed(step, &dir);
                self.run.event(
                    "checkpoint",
                    obj(json!({"worker": name.to_string(), "step": step, "dir": dir})),
                );
                Ok(())
            }
            FromWorker::CheckpointFailed { step, dir, failure } => {
                self.trainer.on_checkpoint_failed(step);
                self.on_checkpoint_failed(name, step, &dir, &failure);
                Ok(())
            }
            other => Err(Violation::Unexpected {
                message: variant(&other),
            }),
        }
    }

    /// A drafter scored eval batch `batch_id` at the weights of `step`. The slot stays
    /// held (a violation restarts the worker, and its death requeues the batch) unless
    /// the report is one the round takes.
    fn on_evaluated(
        &mut self,
        peer: &Peer,
        input: SlotRef,
        batch_id: u64,
        step: u64,
        stats: &StepStats,
    ) -> Result<(), Violation> {
        let (name, holder) = (peer.name, peer.holder);
        let actions = self
            .pipeline
            .check_consume(name, holder, input, batch_id)
            .and_then(|()| self.trainer.on_evaluated(batch_id, step, stats))
            .map_err(|e| Violation::InvalidEvalReport(Box::new(e)))?;
        let r = self.pipeline.on_evaluated(peer, input, batch_id);
        self.pipeline
            .health
            .phase(&name.to_string(), "eval", stats.compute_ms);
        self.execute(actions);
        self.dirty = true;
        r
    }

    /// A worker broke the control protocol: log it and restart that worker alone.
    fn violation(&mut self, worker: usize, why: &Violation) {
        let name = self.workers[worker].name;
        log::error!("{name} broke the control protocol ({why}): killing it");
        self.workers[worker].log.line(
            Tag::Supervisor,
            &format!("protocol violation: {why}; killing"),
        );
        self.run.event(
            "protocol_violation",
            obj(json!({"worker": name.to_string(), "reason": why.to_string()})),
        );
        self.kill(worker, &format!("protocol violation: {why}"));
    }

    fn kill(&mut self, worker: usize, why: &str) {
        let name = self.workers[worker].name;
        if let Some(l) = self.workers[worker].status.life_mut() {
            l.mark_killed(why);
            if let Err(e) = l.process.signal(Signal::SIGKILL) {
                log::warn!("cannot kill {name} (pid {}): {e}", l.pid);
            }
            l.process.signal_group(Signal::SIGKILL);
        }
    }

    fn on_exit(&mut self, worker: usize, life: LifeId, status: ExitStatus) {
        let now = self.now;
        let Some(l) = self.live(worker, life) else {
            return;
        };
        // A connected life's channel is read to its end first (see the module docs); an
        // unconnected one's control thread is woken to say whether a hello came first.
        if l.exited(status, now) {
            self.finish_exit(worker, status);
        } else if !l.connected() {
            let server = l.server_name.clone();
            self.launcher.abandon(&server);
        }
    }

    /// The current life of `worker` is over: reclaim its slots, then restart or record.
    fn finish_exit(&mut self, worker: usize, status: ExitStatus) {
        let w = &mut self.workers[worker];
        if !matches!(w.status, Status::Live(_)) {
            return;
        }
        // Until decided below (restart, backoff, failed), a worker with no life has exited.
        let Status::Live(l) = std::mem::replace(&mut w.status, Status::Exited) else {
            unreachable!("checked above")
        };
        let requeued = self.pipeline.release(w.name, l.id);
        if requeued > 0 && matches!(self.phase, Phase::Running) {
            log::info!(
                "{}: {requeued} batch(es) it held go back to their queue",
                w.name
            );
        }
        if w.name.role == Role::Drafter {
            let actions = self.trainer.on_gone(worker);
            self.execute(actions);
        }
        let w = &mut self.workers[worker];
        let uptime = self.now.saturating_duration_since(l.started);
        let desc = describe_status(&status);
        let killed_for = l.killed_for().map(String::from);
        let why = killed_for
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default();
        w.log.line(
            Tag::Supervisor,
            &format!(
                "pid {} {desc}{why} after {:.1}s",
                l.pid,
                uptime.as_secs_f64()
            ),
        );
        w.last_exit = Some(format!("{desc}{why}"));
        if !l.connected() {
            control::abandon(&l.server_name);
        }
        let name = w.name.to_string();
        let (code, sig) = (status.code(), ExitStatusExt::signal(&status));
        let sig_name = sig
            .and_then(|s| Signal::try_from(s).ok())
            .map(|s| s.as_str());
        self.run.event(
            "exit",
            obj(json!({"worker": name, "pid": l.pid, "status": desc, "code": code, "signal": sig_name,
                       "uptime_s": uptime.as_secs_f64(), "killed_for": killed_for,
                       "fatal": l.fatal.as_ref().map(|(kind, _)| kind.as_str())})),
        );
        self.dirty = true;
        if self.finish_move(worker) {
            return;
        }
        // The worker's own word decides (its Fatal message); without one (it failed
        // before it connected), its exit code.
        let permanent = match &l.fatal {
            Some((kind, _)) => kind.permanent(),
            None => code == Some(dflash_shared::exit_codes::WORKER_PERMANENT),
        };
        if matches!(self.phase, Phase::Running) && permanent {
            let reason = l.fatal.as_ref().map(|(_, m)| m.clone());
            self.on_permanent_failure(worker, l.pid, reason);
        } else if matches!(self.phase, Phase::Running) {
            log::warn!(
                "{name} (pid {}) {desc}{why} after {:.1}s",
                l.pid,
                uptime.as_secs_f64()
            );
            let w = &mut self.workers[worker];
            if !l.connected() {
                w.lives_without_hello += 1;
            }
            if !w.ever_connected && w.lives_without_hello >= NEVER_CONNECTED_LIVES {
                w.status = Status::Failed;
                let msg = format!(
                    "{name}: the worker program {} ended {} times in a row without connecting to the supervisor (last: {desc}{why}); expected the dflash-worker of this dflash-supervise version (--worker-bin PATH); its output is in {}",
                    self.cfg.worker_bin.display(),
                    w.lives_without_hello,
                    w.log_path.display()
                );
                log::error!("{msg}");
                self.run.event("give_up", obj(json!({"worker": name, "pid": l.pid, "restarts": w.restarts, "never_connected": true, "last_exit": format!("{desc}{why}")})));
                self.begin_stop(StopReason::Fatal(msg));
                return;
            }
            self.on_failure(worker, l.pid, uptime);
        } else {
            // A worker still starting (not connected) has nothing in flight: the stop's
            // SIGTERM may end it before it installs its handlers, and that is a clean stop.
            let stopped =
                status.success() || (!l.connected() && sig == Some(Signal::SIGTERM as i32));
            let w = &mut self.workers[worker];
            w.unclean_stop = !(stopped && l.asked_to_stop() && killed_for.is_none());
            log::info!("{name} (pid {}) {desc}{why}", l.pid);
        }
    }

    /// The worker exited saying it can never work here (e.g. no usable GPU): restarting
    /// would only spend the budget. Stop the run with its own one-line reason (`reason`,
    /// from its Fatal message; a worker that failed before it connected sent none).
    fn on_permanent_failure(&mut self, worker: usize, pid: u32, reason: Option<String>) {
        let w = &mut self.workers[worker];
        w.status = Status::Failed;
        let reason = reason.unwrap_or_else(|| format!("see {}", w.log_path.display()));
        let name = w.name.to_string();
        self.run.event("give_up", obj(json!({"worker": name, "pid": pid, "restarts": w.restarts, "permanent": true, "last_exit": reason})));
        let device = match w.device {
            Device::Gpu(i) => format!("GPU {i}"),
            Device::Cpu => "its CPU".to_string(),
        };
        let msg = format!("{name} cannot run on {device} and was not restarted: {reason}");
        log::error!("{msg}");
        self.begin_stop(StopReason::TrainingFailed(msg));
    }

    fn on_failure(&mut self, worker: usize, pid: u32, uptime: Duration) {
        let max = self.cfg.max_restarts;
        let w = &mut self.workers[worker];
        if w.restarts >= max {
            w.status = Status::Failed;
            let report = Report {
                worker: w.name.to_string(),
                device: w.device.to_string(),
                last_exit: w.last_exit.clone().unwrap_or_default(),
                restarts: w.restarts,
                max_restarts: max,
                log_path: w.log_path.clone(),
                log_tail: w.log.tail(20),
            };
            self.run.event(
                "give_up",
                obj(
                    json!({"worker": report.worker, "pid": pid, "restarts": report.restarts,
                                                  "last_exit": report.last_exit}),
                ),
            );
            log::error!(
                "{} failed again after {} restarts: giving up, stopping the run",
                report.worker,
                report.restarts
            );
            self.begin_stop(StopReason::GaveUp(Box::new(report)));
            return;
        }
        if uptime >= self.cfg.stable_after {
            w.consecutive_failures = 0;
        }
        let delay = backoff(w.consecutive_failures);
        w.consecutive_failures += 1;
        w.restarts += 1;
        let name = w.name.to_string();
        self.run.event(
            "restart",
            obj(json!({"worker": name, "pid": pid, "restarts": w.restarts,
                                              "delay_ms": delay.as_millis() as u64})),
        );
        if delay.is_zero() {
            self.spawn(worker);
        } else {
            log::info!(
                "restarting {name} in {} (restart {} of {max})",
                humantime::format_duration(delay),
                w.restarts
            );
            w.status = Status::Backoff {
                until: self.now + delay,
            };
        }
    }

    fn on_timers(&mut self, now: Instant) {
        self.job_timers();
        if self.metrics.due(now, self.cfg.metrics_interval) {
            self.write_metrics();
        }
        let ending = self.stop_reason.is_some();
        if let Some(b) = self.wandb.as_mut() {
            b.tend(ending);
        }
        self.refresh_status();
        match self.phase {
            Phase::Running | Phase::Stopping { .. } | Phase::Killing
                if self.workers.iter().any(|w| {
                    w.status
                        .life()
                        .and_then(Life::died)
                        .is_some_and(|(_, t)| now.duration_since(t) > DRAIN_GRACE)
                }) =>
            {
                for i in 0..self.workers.len() {
                    let late = self.workers[i]
                        .status
                        .life()
                        .and_then(Life::died)
                        .filter(|(_, t)| now.duration_since(*t) > DRAIN_GRACE);
                    if let Some((status, _)) = late {
                        log::warn!("{}: its control channel stayed open {} after it died; handling the death anyway", self.workers[i].name, humantime::format_duration(DRAIN_GRACE));
                        self.finish_exit(i, status);
                    }
                }
            }
            Phase::Running => {
                self.watch_run_dir();
                if !matches!(self.phase, Phase::Running) {
                    return;
                }
                if let Some(limit) = self.cfg.time_limit {
                    if now.duration_since(self.started) >= limit {
                        log::info!(
                            "time limit {} reached: stopping",
                            humantime::format_duration(limit)
                        );
                        self.begin_stop(StopReason::TimeLimit);
                        return;
                    }
                }
                for i in 0..self.workers.len() {
                    if let Status::Backoff { until } = self.workers[i].status {
                        if now >= until {
                            self.spawn(i);
                        }
                    }
                    let hang = self.cfg.hang_timeout;
                    let Some(l) = self.workers[i].status.life() else {
                        continue;
                    };
                    let silent = now.saturating_duration_since(l.last_beat);
                    if l.watched() && silent > hang {
                        let (name, pid) = (self.workers[i].name, l.pid);
                        let what = if l.connected() {
                            "no heartbeat"
                        } else {
                            "no hello"
                        };
                        log::warn!(
                            "{name} (pid {pid}) hung: {what} for {:.1}s; killing it",
                            silent.as_secs_f64()
                        );
                        self.run.event(
                            "hang",
                            obj(json!({"worker": name.to_string(), "pid": pid,
                                                           "silent_s": silent.as_secs_f64()})),
                        );
                        self.kill(
                            i,
                            &format!("hung: {what} for {}", humantime::format_duration(hang)),
                        );
                        continue;
                    }
                    self.watch_step(i, now);
                }
            }
            Phase::Stopping { deadline } if now >= deadline => {
                let left: Vec<String> = self
                    .workers
                    .iter()
                    .filter(|w| w.status.life().is_some())
                    .map(|w| w.name.to_string())
                    .collect();
                log::warn!(
                    "{} did not stop within --stop-timeout {}: killing",
                    left.join(", "),
                    humantime::format_duration(self.cfg.stop_timeout)
                );
                self.kill_all("did not stop within --stop-timeout");
            }
            _ => {}
        }
    }

    fn begin_stop(&mut self, reason: StopReason) {
        if self.stop_reason.is_none() {
            self.stop_reason = Some(reason);
        }
        if !matches!(self.phase, Phase::Running) {
            return;
        }
        self.phase = Phase::Stopping {
            deadline: self.now + self.cfg.stop_timeout,
        };
        self.run.event(
            "stop",
            obj(json!({"reason": self.stop_reason.as_ref().map(StopReason::describe)})),
        );
        // The stop checkpoint is asked for before anyone is asked to stop: its rank reads
        // the request first, then its shutdown. The drafter is exported from it at the end.
        if self.run_dir_gone.is_some() {
            // A checkpoint would make a new directory at its path: nothing is written.
            self.trainer.freeze();
        } else {
            let save = self.trainer.stop_checkpoint();
            self.execute(save);
        }
        for i in 0..self.workers.len() {
            if let Status::Backoff { .. } = self.workers[i].status {
                self.workers[i].status = Status::Exited;
            }
            self.ask_to_stop(i, "the run is stopping");
        }
        self.dirty = true;
    }

    fn ask_to_stop(&mut self, worker: usize, reason: &str) {
        let w = &mut self.workers[worker];
        let Some(l) = w.status.life_mut() else { return };
        l.mark_asked_to_stop();
        let sent = l.to_worker().is_some_and(|tx| {
            tx.send(ToWorker::Shutdown {
                reason: reason.into(),
            })
            .is_ok()
        });
        if !sent {
            // Not connected (yet): the signal is the only way to ask.
            l.process.signal_group(Signal::SIGTERM);
        }
    }

    fn kill_all(&mut self, why: &str) {
        self.phase = Phase::Killing;
        for i in 0..self.workers.len() {
            self.kill(i, why);
        }
        self.dirty = true;
    }
}

impl StopReason {
    fn describe(&self) -> String {
        match self {
            StopReason::Requested(s) => s.clone(),
            StopReason::TimeLimit => "time limit reached".into(),
            StopReason::GaveUp(r) => format!("{} spent its restart budget", r.worker),
            StopReason::Fatal(s) => s.clone(),
            StopReason::BadInput(s) => s.clone(),
            StopReason::Interrupted => "killed by a second stop signal".into(),
            StopReason::DataDone => "all data consumed".into(),
            StopReason::StepsDone => "step limit reached".into(),
            StopReason::TrainingFailed(s) => s.clone(),
        }
    }
}

fn variant(m: &FromWorker) -> &'static str {
    match m {
        FromWorker::Hello(_) => "a second Hello",
        FromWorker::Heartbeat { .. } => "Heartbeat",
        FromWorker::DeviceMemory(_) => "DeviceMemory",
        FromWorker::Abandon => "Abandon",
        FromWorker::Commit { .. } => "Commit",
        FromWorker::Ack { .. } => "Ack",
        FromWorker::Evaluated { .. } => "Evaluated",
        FromWorker::Grads { .. } => "Grads",
        FromWorker::SnapshotDone { .. } => "SnapshotDone",
        FromWorker::Reduced { .. } => "Reduced",
        FromWorker::GroupId { .. } => "GroupId",
        FromWorker::CheckpointFailed { .. } => "CheckpointFailed",
        FromWorker::Checkpointed { .. } => "Checkpointed",
        FromWorker::Fatal { .. } => "Fatal",
    }
}

fn obj(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    match v {
        serde_json::Value::Object(m) => m,
        _ => serde_json::Map::new(),
    }
}
