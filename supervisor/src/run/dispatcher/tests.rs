//! The dispatcher fed scripted events: a launcher that starts nothing, events made by the
//! test, and time only through the `now` of each step. No process, no sleep, exact times.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dflash_shared::protocol::{FromWorker, Hello, ToWorker, PROTOCOL_VERSION};
use ipc_channel::ipc::{self, IpcReceiver};
use nix::sys::signal::Signal;
use serde_json::Value;

use super::launcher::{Launch, Launched, Launcher, Process, SpawnError};
use super::life::{LifeState, Status};
use super::*;
use crate::data::loader::Loader;
use crate::run::rundir::EVENTS_FILE;

/// What the fake processes saw: launches `(worker, life, pid)` and signals `(pid, signal,
/// to the group)`.
#[derive(Default)]
struct Seen {
    launches: Vec<(usize, LifeId, u32)>,
    signals: Vec<(u32, Signal, bool)>,
}

struct FakeProcess {
    pid: u32,
    seen: Arc<Mutex<Seen>>,
}

impl Process for FakeProcess {
    fn signal(&self, sig: Signal) -> std::io::Result<()> {
        self.seen
            .lock()
            .unwrap()
            .signals
            .push((self.pid, sig, false));
        Ok(())
    }

    fn signal_group(&self, sig: Signal) {
        self.seen
            .lock()
            .unwrap()
            .signals
            .push((self.pid, sig, true));
    }
}

struct FakeLauncher {
    seen: Arc<Mutex<Seen>>,
    next_pid: u32,
}

impl Launcher for FakeLauncher {
    fn launch(&mut self, l: Launch, _events: &Sender<Event>) -> Result<Launched, SpawnError> {
        self.next_pid += 1;
        let pid = self.next_pid;
        self.seen
            .lock()
            .unwrap()
            .launches
            .push((l.worker, l.life, pid));
        Ok(Launched {
            pid,
            process: Arc::new(FakeProcess {
                pid,
                seen: self.seen.clone(),
            }),
            server_name: String::new(),
        })
    }

    fn abandon(&mut self, _server_name: &str) {}
}

struct Harness {
    d: Dispatcher,
    seen: Arc<Mutex<Seen>>,
    t0: Instant,
    _dir: tempfile::TempDir,
}

/// A dispatcher for `flags` (a run's command line), started at `t0`.
fn harness(flags: &[&str]) -> Harness {
    harness_after(flags, &[])
}

/// [`harness`] for a run whose earlier sessions left `events` in its events.jsonl.
fn harness_after(flags: &[&str], events: &[&str]) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let run_path = dir.path().join("run");
    let args = crate::cli::run_args(flags);
    let plan = crate::run::plan(&args, &mut || Ok(0)).unwrap();
    let target = crate::run::target_config("tiny").unwrap();
    let (loader_cfg, pipeline_cfg) = crate::run::data_config(&args, &plan, &target).unwrap();
    let mut trainer_cfg =
        crate::run::trainer_config(&args, &plan, &target, &pipeline_cfg.capture).unwrap();
    let run = RunDir::create(Some(&run_path)).unwrap();
    if !events.is_empty() {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(run.path.join(EVENTS_FILE))
            .unwrap();
        for e in events {
            writeln!(f, "{e}").unwrap();
        }
    }
    trainer_cfg.checkpoints_dir = run.path.join("checkpoints");
    std::fs::create_dir_all(&trainer_cfg.checkpoints_dir).unwrap();
    let data = Data {
        pipeline: Pipeline::new(&pipeline_cfg, &run.path).unwrap(),
        loader: Loader::new(loader_cfg).into(),
        job: None,
        trainer: Trainer::new(trainer_cfg, &run.path).unwrap(),
    };
    let cfg = Config {
        plan,
        target_spans: Vec::new(),
        worker_bin: "/nonexistent/dflash-worker".into(),
        target_dir: dir.path().into(),
        target_engine: "native",
        hang_timeout: args.hang_timeout,
        step_timeout: args.step_timeout,
        max_restarts: args.max_restarts,
        stable_after: args.stable_after,
        stop_timeout: args.stop_timeout,
        time_limit: args.time_limit,
        tee: false,
        log_max_size: args.log_max_size,
        log_backups: args.log_backups,
        gpu_metrics: false,
        prometheus: None,
        wandb: None,
        gpu_sample_interval: args.gpu_sample_interval,
        metrics_interval: args.metrics_interval,
        balance: None,
        tau: None,
    };
    let seen = Arc::new(Mutex::new(Seen::default()));
    let launcher = FakeLauncher {
        seen: seen.clone(),
        next_pid: 1000,
    };
    let mut d = Dispatcher::new(cfg, run, data, Box::new(launcher)).unwrap();
    let t0 = Instant::now();
    d.start(t0);
    Harness {
        d,
        seen,
        t0,
        _dir: dir,
    }
}

const TARGET: usize = 0;
const DRAFTER: usize = 1;

fn exit_code(code: i32) -> ExitStatus {
    ExitStatus::from_raw(code << 8)
}

fn killed_by(sig: Signal) -> ExitStatus {
    ExitStatus::from_raw(sig as i32)
}

impl Harness {
    fn at(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    fn step(&mut self, ev: Option<Event>, ms: u64) {
        let now = self.at(ms);
        self.d.step(ev, now);
    }

    /// Only the timers run at `ms`.
    fn tick(&mut self, ms: u64) {
        self.step(None, ms);
    }

    fn life(&self, worker: usize) -> Option<LifeId> {
        self.d.workers[worker].status.life().map(|l| l.id)
    }

    fn pid(&self, worker: usize) -> u32 {
        self.d.workers[worker]
            .status
            .life()
            .expect("a live worker")
            .pid
    }

    fn launches(&self, worker: usize) -> usize {
        self.seen
            .lock()
            .unwrap()
            .launches
            .iter()
            .filter(|(w, ..)| *w == worker)
            .count()
    }

    fn signals(&self, pid: u32) -> Vec<(Signal, bool)> {
        self.seen
            .lock()
            .unwrap()
            .signals
            .iter()
            .filter(|(p, ..)| *p == pid)
            .map(|&(_, s, g)| (s, g))
            .collect()
    }

    /// The current life of `worker` says hello; returns what the dispatcher sends it.
    fn connect(&mut self, worker: usize, ms: u64) -> IpcReceiver<ToWorker> {
        let (tx, rx) = ipc::channel().unwrap();
        let life = self.life(worker).expect("a live worker");
        let hello = Hello {
            protocol: PROTOCOL_VERSION,
            pid: self.pid(worker),
            worker: self.d.workers[worker].name.to_string(),
            restart_count: self.d.workers[worker].restarts,
            to_worker: tx,
        };
        self.step(
            Some(Event::Control(ControlEvent::Connected {
                worker,
                life,
                hello,
            })),
            ms,
        );
        rx
    }

    fn message(&mut self, worker: usize, life: LifeId, msg: FromWorker, ms: u64) {
        self.step(
            Some(Event::Control(ControlEvent::Message { worker, life, msg })),
            ms,
        );
    }

    /// The current life of `worker` ends with `status`; a connected one's channel closes
    /// after it.
    fn exit(&mut self, worker: usize, status: ExitStatus, ms: u64) {
        let life = self.life(worker).expect("a live worker");
        let connected = self.d.workers[worker]
            .status
            .life()
            .is_some_and(|l| l.connected());
        self.step(
            Some(Event::Exited {
                worker,
                life,
                status,
            }),
            ms,
        );
        if connected {
            let lost = ControlEvent::ChannelLost {
                worker,
                life,
                reason: "control channel closed".into(),
                malformed: false,
            };
            self.step(Some(Event::Control(lost)), ms);
        } else {
            // The control thread, woken by the abandon, found no hello.
            let abandoned = ControlEvent::Abandoned { worker, life };
            self.step(Some(Event::Control(abandoned)), ms);
        }
    }

    fn signal(&mut self, sig: Signal, ms: u64) {
        self.step(Some(Event::Signal(sig as i32)), ms);
    }

    /// The records of `kind` in events.jsonl.
    fn events(&self, kind: &str) -> Vec<Value> {
        let text = std::fs::read_to_string(self.d.run.path.join(EVENTS_FILE)).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|v| v["event"] == kind)
            .collect()
    }

    fn status(&self, worker: usize) -> &'static str {
        self.d.workers[worker].status.as_str()
    }
}

/// Everything `rx` holds now.
fn received(rx: &IpcReceiver<ToWorker>) -> Vec<ToWorker> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

fn is_shutdown(m: &ToWorker) -> bool {
    matches!(m, ToWorker::Shutdown { .. })
}

#[test]
fn backoff_doubles_from_an_immediate_restart_and_resets_once_a_life_lasts_stable_after() {
    let mut h = harness(&[
        "--gpus",
        "cpu:2",
        "--stable-after",
        "10s",
        "--max-restarts",
        "20",
    ]);
    assert_eq!(h.launches(TARGET), 1);
    // A worker program that once connected: its later deaths are crashes to restart.
    let _rx = h.connect(TARGET, 0);
    // (time of the exit, when the next life must start): 0 s, then 1, 2, 4 s later.
    for (exit_at, restart_at) in [(0, 0), (0, 1000), (1000, 3000), (3000, 7000)] {
        let before = h.launches(TARGET);
        h.exit(TARGET, exit_code(1), exit_at);
        if restart_at > exit_at {
            assert_eq!(h.status(TARGET), "backoff");
            h.tick(restart_at - 1);
            assert_eq!(
                h.launches(TARGET),
                before,
                "restarted 1 ms early (exit at {exit_at} ms)"
            );
            h.tick(restart_at);
        }
        assert_eq!(
            h.launches(TARGET),
            before + 1,
            "not restarted at {restart_at} ms"
        );
    }
    // Up 1 ms less than --stable-after: the backoff goes on doubling (8 s).
    h.exit(TARGET, exit_code(1), 7000 + 9_999);
    h.tick(16_999 + 7_999);
    assert_eq!(h.status(TARGET), "backoff");
    h.tick(16_999 + 8_000);
    // Up exactly --stable-after: reset, the restart is immediate again, then 1 s.
    h.exit(TARGET, exit_code(1), 24_999 + 10_000);
    assert_eq!(h.status(TARGET), "starting");
    h.exit(TARGET, exit_code(1), 34_999);
    assert_eq!(h.status(TARGET), "backoff");
    let delays: Vec<u64> = h
        .events("restart")
        .iter()
        .map(|e| e["delay_ms"].as_u64().unwrap())
        .collect();
    assert_eq!(delays, [0, 1000, 2000, 4000, 8000, 0, 1000]);
    assert_eq!(h.d.workers[TARGET].restarts, 7);
    assert_eq!(h.launches(DRAFTER), 1, "only the failed worker restarts");
}

#[test]
fn a_hang_is_detected_once_silence_exceeds_hang_timeout_and_a_heartbeat_restarts_the_clock() {
    let mut h = harness(&["--gpus", "cpu:2", "--hang-timeout", "5s"]);
    let (target_pid, drafter_pid) = (h.pid(TARGET), h.pid(DRAFTER));
    let _rx = h.connect(TARGET, 0);
    let life = h.life(TARGET).unwrap();
    h.message(
        TARGET,
        life,
        FromWorker::Heartbeat { seq: 1, busy: None },
        3000,
    );
    // The drafter never says hello: silent since its spawn at 0.
    h.tick(5000);
    assert!(
        h.signals(drafter_pid).is_empty(),
        "killed at exactly --hang-timeout"
    );
    h.tick(5001);
    assert_eq!(
        h.signals(drafter_pid),
        [(Signal::SIGKILL, false), (Signal::SIGKILL, true)]
    );
    let drafter = h.d.workers[DRAFTER].status.life().unwrap();
    assert_eq!(drafter.killed_for(), Some("hung: no hello for 5s"));
    assert!(
        h.signals(target_pid).is_empty(),
        "its heartbeat at 3 s counts"
    );
    h.tick(8000);
    assert!(h.signals(target_pid).is_empty());
    h.tick(8001);
    assert_eq!(
        h.signals(target_pid),
        [(Signal::SIGKILL, false), (Signal::SIGKILL, true)]
    );
    assert_eq!(
        h.d.workers[TARGET].status.life().unwrap().killed_for(),
        Some("hung: no heartbeat for 5s")
    );
    let hangs: Vec<String> = h
        .events("hang")
        .iter()
        .map(|e| e["worker"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(hangs, ["drafter-0", "target-0"]);
    // Killed once: the next ticks do not kill again; the exit that follows restarts it.
    h.tick(20_000);
    assert_eq!(h.signals(target_pid).len(), 2);
    h.exit(TARGET, killed_by(Signal::SIGKILL), 20_001);
    assert_eq!(h.launches(TARGET), 2);
    let exit = h.events("exit").pop().unwrap();
    assert_eq!(exit["killed_for"], "hung: no heartbeat for 5s");
}

#[test]
fn a_worker_program_that_never_connects_stops_the_run_after_three_lives() {
    let mut h = harness(&["--gpus", "cpu:2", "--max-restarts", "20"]);
    h.exit(TARGET, exit_code(0), 0);
    h.exit(TARGET, exit_code(0), 10);
    h.tick(1010);
    assert!(
        matches!(h.d.phase, Phase::Running),
        "two lives are not yet a verdict"
    );
    h.exit(TARGET, exit_code(0), 1020);
    assert_eq!(h.status(TARGET), "failed");
    let Some(StopReason::Fatal(msg)) = &h.d.stop_reason else {
        panic!("the run did not stop")
    };
    assert!(
        msg.contains("ended 3 times in a row without connecting") && msg.contains("--worker-bin"),
        "{msg}"
    );
    assert_eq!(crate::error::RunEnd::Internal.exit_code(), 4);
}

/// `--max-restarts` counts over the whole run: a resumed session's workers start with the
/// restarts their names had in the earlier sessions (events.jsonl), so a budget spent
/// there is not given again.
#[test]
fn the_restart_budget_counts_the_restarts_of_the_runs_earlier_sessions() {
    let earlier = [
        r#"{"time":"t","event":"restart","worker":"target-0","restarts":1}"#,
        r#"{"time":"t","event":"exit","worker":"drafter-0"}"#,
        r#"{"time":"t","event":"restart","worker":"target-0","restarts":2}"#,
        r#"{"time":"t","event":"restart","worker":"drafter-7","restarts":1}"#,
        r#"{"time":"t","event":"restart","wor"#,
    ];
    let mut h = harness_after(&["--gpus", "cpu:2", "--max-restarts", "2"], &earlier);
    assert_eq!(h.d.workers[TARGET].restarts, 2);
    assert_eq!(
        h.d.workers[DRAFTER].restarts, 0,
        "other names count for nothing"
    );
    let _rx = h.connect(TARGET, 0);
    h.exit(TARGET, exit_code(3), 0);
    assert_eq!(h.status(TARGET), "failed");
    assert_eq!(
        h.launches(TARGET),
        1,
        "the budget was spent before the resume"
    );
    let Some(StopReason::GaveUp(report)) = &h.d.stop_reason else {
        panic!("the run did not give up")
    };
    assert_eq!((report.restarts, report.max_restarts), (2, 2));
}

#[test]
fn the_restart_budget_spent_stops_the_run_with_a_report_naming_the_worker() {
    let mut h = harness(&["--gpus", "cpu:2", "--max-restarts", "2"]);
    let _rx = h.connect(TARGET, 0);
    h.exit(TARGET, exit_code(3), 0);
    h.exit(TARGET, exit_code(3), 10);
    h.tick(1010);
    assert_eq!(h.launches(TARGET), 3);
    assert!(matches!(h.d.phase, Phase::Running));
    let drafter_pid = h.pid(DRAFTER);
    h.exit(TARGET, exit_code(3), 2000);
    assert_eq!(h.status(TARGET), "failed");
    assert_eq!(h.launches(TARGET), 3, "no restart past the budget");
    let Some(StopReason::GaveUp(report)) = &h.d.stop_reason else {
        panic!("the run did not give up")
    };
    assert_eq!(
        (report.worker.as_str(), report.restarts, report.max_restarts),
        ("target-0", 2, 2)
    );
    assert_eq!(report.last_exit, "exit code 3");
    assert!(
        report
            .render()
            .contains("target-0 kept failing and spent its restart budget (--max-restarts 2)"),
        "{}",
        report.render()
    );
    let give_up = h.events("give_up");
    assert_eq!(
        (give_up.len(), give_up[0]["restarts"].as_u64()),
        (1, Some(2))
    );
    // The drafter, not connected, is asked to stop by SIGTERM to its group.
    assert_eq!(h.signals(drafter_pid), [(Signal::SIGTERM, true)]);
    h.exit(DRAFTER, exit_code(0), 2100);
    assert!(h.d.finished());
    assert_eq!(h.d.finish(), dflash_shared::exit_codes::RUN_FAILED);
}

#[test]
fn a_second_stop_signal_kills_every_worker_at_once_and_exits_130() {
    let mut h = harness(&["--gpus", "cpu:2", "--stop-timeout", "60s"]);
    let rx: Vec<_> = [TARGET, DRAFTER].iter().map(|&w| h.connect(w, 0)).collect();
    let pids = [h.pid(TARGET), h.pid(DRAFTER)];
    h.signal(Signal::SIGINT, 100);
    assert!(matches!(h.d.phase, Phase::Stopping { .. }));
    for r in &rx {
        assert!(
            received(r).iter().any(is_shutdown),
            "a connected worker is asked by message"
        );
    }
    assert!(pids.iter().all(|&p| h.signals(p).is_empty()));
    h.signal(Signal::SIGINT, 200);
    assert!(matches!(h.d.phase, Phase::Killing));
    for p in pids {
        assert_eq!(
            h.signals(p),
            [(Signal::SIGKILL, false), (Signal::SIGKILL, true)]
        );
    }
    h.exit(TARGET, killed_by(Signal::SIGKILL), 210);
    h.exit(DRAFTER, killed_by(Signal::SIGKILL), 210);
    assert!(h.d.finished());
    assert_eq!(h.d.finish(), dflash_shared::exit_codes::INTERRUPTED);
}

#[test]
fn a_death_during_the_stop_is_not_restarted_and_makes_the_stop_unclean() {
    let mut h = harness(&["--gpus", "cpu:2", "--stop-timeout", "60s"]);
    let _rx: Vec<_> = [TARGET, DRAFTER].iter().map(|&w| h.connect(w, 0)).collect();
    h.signal(Signal::SIGTERM, 100);
    assert_eq!(h.status(TARGET), "stopping");
    // It dies (exit 1) while stopping; its channel is read to its end first.
    let life = h.life(TARGET).unwrap();
    h.step(
        Some(Event::Exited {
            worker: TARGET,
            life,
            status: exit_code(1),
        }),
        500,
    );
    assert!(matches!(
        h.d.workers[TARGET].status.life().unwrap().state,
        LifeState::Draining { .. }
    ));
    h.step(
        Some(Event::Control(ControlEvent::ChannelLost {
            worker: TARGET,
            life,
            reason: "closed".into(),
            malformed: false,
        })),
        500,
    );
    assert_eq!(h.status(TARGET), "exited");
    assert_eq!(h.launches(TARGET), 1, "no restart during a stop");
    assert!(h.events("restart").is_empty());
    h.exit(DRAFTER, exit_code(0), 600);
    assert_eq!(h.d.finish(), dflash_shared::exit_codes::UNCLEAN_STOP);
}

#[test]
fn the_stop_timeout_kills_what_is_left_at_exactly_its_deadline() {
    let mut h = harness(&["--gpus", "cpu:2", "--stop-timeout", "30s"]);
    let _rx: Vec<_> = [TARGET, DRAFTER].iter().map(|&w| h.connect(w, 0)).collect();
    h.signal(Signal::SIGTERM, 1000);
    h.exit(DRAFTER, exit_code(0), 2000);
    let target_pid = h.pid(TARGET);
    h.tick(30_999);
    assert!(h.signals(target_pid).is_empty());
    h.tick(31_000);
    assert_eq!(
        h.signals(target_pid),
        [(Signal::SIGKILL, false), (Signal::SIGKILL, true)]
    );
    h.exit(TARGET, killed_by(Signal::SIGKILL), 31_001);
    assert_eq!(h.d.finish(), dflash_shared::exit_codes::UNCLEAN_STOP);
}

#[test]
fn events_of_a_previous_life_are_dropped() {
    let mut h = harness(&["--gpus", "cpu:2", "--hang-timeout", "5s"]);
    let _rx = h.connect(TARGET, 0);
    let old = h.life(TARGET).unwrap();
    h.exit(TARGET, exit_code(1), 100);
    let new = h.life(TARGET).unwrap();
    assert_ne!(old, new);
    let new_pid = h.pid(TARGET);
    // Late events from the old life: each would kill, restart or connect the new one.
    let (tx, _old_rx) = ipc::channel().unwrap();
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        pid: 1,
        worker: "someone-else".into(),
        restart_count: 0,
        to_worker: tx,
    };
    h.step(
        Some(Event::Control(ControlEvent::Connected {
            worker: TARGET,
            life: old,
            hello,
        })),
        200,
    );
    h.message(
        TARGET,
        old,
        FromWorker::Heartbeat { seq: 9, busy: None },
        4000,
    );
    h.step(
        Some(Event::Control(ControlEvent::ChannelLost {
            worker: TARGET,
            life: old,
            reason: "garbage".into(),
            malformed: true,
        })),
        300,
    );
    h.step(
        Some(Event::Exited {
            worker: TARGET,
            life: old,
            status: exit_code(1),
        }),
        400,
    );
    assert!(
        h.signals(new_pid).is_empty(),
        "a stale event touched the new life"
    );
    assert_eq!((h.launches(TARGET), h.d.workers[TARGET].restarts), (2, 1));
    assert!(h.events("protocol_violation").is_empty());
    assert_eq!(h.status(TARGET), "starting");
    // The stale heartbeat at 4 s did not feed the new life's hang clock (spawned at 100).
    h.tick(5101);
    assert_eq!(
        h.signals(new_pid),
        [(Signal::SIGKILL, false), (Signal::SIGKILL, true)]
    );
}

#[test]
fn a_worker_breaking_the_protocol_is_killed_and_restarted_alone() {
    let mut h = harness(&["--gpus", "cpu:2"]);
    let _rx = h.connect(TARGET, 0);
    let (life, pid) = (h.life(TARGET).unwrap(), h.pid(TARGET));
    // A second hello after the first is out of protocol.
    let (tx, _r) = ipc::channel().unwrap();
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        pid,
        worker: "target-0".into(),
        restart_count: 0,
        to_worker: tx,
    };
    h.message(TARGET, life, FromWorker::Hello(hello), 10);
    assert_eq!(
        h.signals(pid),
        [(Signal::SIGKILL, false), (Signal::SIGKILL, true)]
    );
    assert_eq!(
        h.events("protocol_violation")[0]["reason"],
        "sent a second Hello after its hello"
    );
    h.exit(TARGET, killed_by(Signal::SIGKILL), 20);
    assert_eq!(h.launches(TARGET), 2);
    assert_eq!(h.launches(DRAFTER), 1);
    assert!(matches!(h.d.workers[DRAFTER].status, Status::Live(_)));
}

const DRAFTER_1: usize = 2;

impl Harness {
    /// Hand the dispatcher the loader thread's next event (the loader is real; a deadline
    /// turns a loader that never answers into a failure, no sleep).
    fn next_loader_event(&mut self, ms: u64) {
        let ev = self
            .d
            .rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the loader produced nothing for 30 s");
        assert!(
            matches!(ev, Event::Loader(_)),
            "only the loader sends events in these tests"
        );
        self.step(Some(ev), ms);
    }

    /// Run the target: feed the loader until the target holds `n` batches, then commit
    /// each into a hidden-state slot it was leased.
    fn target_commits(&mut self, target_rx: &IpcReceiver<ToWorker>, n: usize, ms: u64) -> Vec<u64> {
        let (mut inputs, mut leases) = (Vec::new(), Vec::new());
        while inputs.len() < n || leases.len() < n {
            for m in received(target_rx) {
                match m {
                    ToWorker::Deliver { slot, batch_id, .. } => inputs.push((slot, batch_id)),
                    ToWorker::Lease { slot } => leases.push(slot),
                    _ => {}
                }
            }
            if inputs.len() < n || leases.len() < n {
                self.next_loader_event(ms);
            }
        }
        let life = self.life(TARGET).unwrap();
        let mut ids = Vec::new();
        for (&(input, batch_id), &output) in inputs.iter().zip(&leases).take(n) {
            let commit = FromWorker::Commit {
                output,
                len: 64,
                batch_id,
                input: Some(input),
                wait_ms: 0.0,
                compute_ms: 1.0,
            };
            self.message(TARGET, life, commit, ms);
            ids.push(batch_id);
        }
        ids
    }
}

/// The hidden-state batches delivered to a drafter so far: `(slot, batch_id)`.
fn deliveries(msgs: &[ToWorker]) -> Vec<(dflash_shared::protocol::SlotRef, u64)> {
    msgs.iter()
        .filter_map(|m| {
            if let ToWorker::Deliver { slot, batch_id, .. } = m {
                Some((*slot, *batch_id))
            } else {
                None
            }
        })
        .collect()
}

fn grads(step: u64, (input, batch_id): (dflash_shared::protocol::SlotRef, u64)) -> FromWorker {
    let stats = dflash_shared::drafter::StepStats {
        loss_sum: 2.0,
        weight_sum: 4.0,
        tokens: 16,
        ..Default::default()
    };
    FromWorker::Grads {
        step,
        input,
        batch_id,
        stats,
        params: 7,
    }
}

/// The group epochs a drafter was told of: `(epoch, ranks, id)`.
fn epochs(msgs: &[ToWorker]) -> Vec<(u64, Vec<u32>, Option<Vec<u8>>)> {
    msgs.iter()
        .filter_map(|m| {
            if let ToWorker::Group { epoch, ranks, id } = m {
                Some((*epoch, ranks.clone(), id.clone()))
            } else {
                None
            }
        })
        .collect()
}

/// The steps a drafter was told to apply: `(step, epoch, weight_sum)`.
fn applies(msgs: &[ToWorker]) -> Vec<(u64, u64, f64)> {
    msgs.iter()
        .filter_map(|m| {
            if let ToWorker::Apply {
                step,
                epoch,
                weight_sum,
                ..
            } = m
            {
                Some((*step, *epoch, *weight_sum))
            } else {
                None
            }
        })
        .collect()
}

fn reduced(step: u64, epoch: u64, weight_sum: f64) -> FromWorker {
    FromWorker::Reduced {
        step,
        epoch,
        weight_sum,
        ms: 1.0,
    }
}

#[test]
fn a_step_waits_for_every_member_and_commits_in_the_next_epoch_once_a_member_that_never_sent_dies()
{
    let mut h = harness(&["--gpus", "cpu:3", "--targets", "1", "--hidden-slots", "8"]);
    let target_rx = h.connect(TARGET, 0);
    let (d0, d1) = (h.connect(DRAFTER, 0), h.connect(DRAFTER_1, 0));
    h.target_commits(&target_rx, 2, 10);
    let (got0, got1) = (received(&d0), received(&d1));
    let (e0, e1) = (epochs(&got0), epochs(&got1));
    let both = e0.last().expect("drafter-0 is told of the group").clone();
    assert_eq!(
        both.1.len(),
        2,
        "the second drafter's start makes an epoch of both: {e0:?}"
    );
    assert_eq!(e1.last(), Some(&both), "both are told the same epoch");
    let (b0, b1) = (deliveries(&got0), deliveries(&got1));
    assert!(
        !b0.is_empty() && !b1.is_empty(),
        "each drafter gets a batch: {b0:?} {b1:?}"
    );
    let d0_life = h.life(DRAFTER).unwrap();
    h.message(DRAFTER, d0_life, grads(1, b0[0]), 20);
    assert_eq!(
        h.d.trainer.committed(),
        0,
        "committed before every member sent its gradients"
    );
    // drafter-1 dies holding its batch, before sending gradients for step 1: drafter-0's
    // all-reduce of the epoch of both never completes, and a new epoch aborts it.
    h.exit(DRAFTER_1, exit_code(1), 30);
    assert_eq!(
        h.d.trainer.committed(),
        0,
        "no commit before the survivor reduced again"
    );
    let got = received(&d0);
    let next = epochs(&got);
    assert_eq!(next.len(), 1, "{next:?}");
    assert!(
        next[0].0 > both.0 && next[0].1.len() == 1,
        "an epoch of the survivor alone: {next:?}"
    );
    // A late completion of the old epoch is ignored; the new one commits.
    h.message(DRAFTER, d0_life, reduced(1, both.0, 8.0), 35);
    assert_eq!(
        h.d.trainer.committed(),
        0,
        "an all-reduce of an epoch that is over never commits"
    );
    h.message(DRAFTER, d0_life, reduced(1, next[0].0, 4.0), 40);
    assert_eq!(h.d.trainer.committed(), 1);
    assert_eq!(
        applies(&received(&d0)),
        [(1, next[0].0, 4.0)],
        "step 1 over the surviving member's gradient alone"
    );
    assert_eq!(h.d.pipeline.progress().0, 1, "its batch was consumed");
    let ledger =
        std::fs::read_to_string(h.d.run.path.join(crate::data::ledger::LEDGER_FILE)).unwrap();
    let requeued = ledger
        .lines()
        .filter(|l| l.contains("\"requeue\"") && l.contains(&format!("\"batch\":{}", b1[0].1)))
        .count();
    assert_eq!(
        requeued, 1,
        "the dead member's batch goes back to its queue:\n{ledger}"
    );
}

#[test]
fn a_restarted_drafter_rejoins_with_a_surviving_ranks_state_at_the_committed_step() {
    let mut h = harness(&["--gpus", "cpu:3", "--targets", "1", "--hidden-slots", "8"]);
    let target_rx = h.connect(TARGET, 0);
    let (d0, d1) = (h.connect(DRAFTER, 0), h.connect(DRAFTER_1, 0));
    let rank_of = |msgs: &[ToWorker]| {
        msgs.iter().find_map(|m| {
            if let ToWorker::Train(s) = m {
                Some((s.rank, s.init))
            } else {
                None
            }
        })
    };
    h.target_commits(&target_rx, 2, 10);
    let (got0, got1) = (received(&d0), received(&d1));
    let (rank0, rank1) = (rank_of(&got0).unwrap().0, rank_of(&got1).unwrap().0);
    assert_ne!(rank0, rank1);
    let (l0, l1) = (h.life(DRAFTER).unwrap(), h.life(DRAFTER_1).unwrap());
    h.message(DRAFTER, l0, grads(1, deliveries(&got0)[0]), 20);
    h.message(DRAFTER_1, l1, grads(1, deliveries(&got1)[0]), 20);
    let epoch = epochs(&got0).last().unwrap().0;
    h.message(DRAFTER, l0, reduced(1, epoch, 8.0), 20);
    assert_eq!(h.d.trainer.committed(), 0, "one member has not reduced yet");
    h.message(DRAFTER_1, l1, reduced(1, epoch, 8.0), 20);
    assert_eq!(h.d.trainer.committed(), 1);
    h.exit(DRAFTER_1, exit_code(1), 30);
    assert_eq!(
        h.launches(DRAFTER_1),
        2,
        "the first failure restarts at once"
    );
    let _ = received(&d0);
    let d1_again = h.connect(DRAFTER_1, 40);
    // The survivor is asked for its state at the committed step, into the join slot.
    let asked: Vec<(u64, u32)> = received(&d0)
        .into_iter()
        .filter_map(|m| {
            if let ToWorker::Snapshot { step, slot } = m {
                Some((step, slot))
            } else {
                None
            }
        })
        .collect();
    assert_eq!(asked, [(1, 0)]);
    assert_eq!(
        rank_of(&received(&d1_again)),
        None,
        "no setup before the state is there"
    );
    h.message(
        DRAFTER,
        l0,
        FromWorker::SnapshotDone {
            step: 1,
            slot: 0,
            ms: 1.0,
        },
        50,
    );
    let joined = received(&d1_again);
    let (rank, init) = rank_of(&joined).expect("the joiner gets its setup");
    assert_eq!(
        (rank, init),
        (
            rank1,
            dflash_shared::drafter::Init::FromState { step: 1, slot: 0 }
        )
    );
    // Then both are told of the epoch that has them both again.
    let (mine, theirs) = (epochs(&joined), epochs(&received(&d0)));
    assert_eq!(mine.last().map(|e| e.1.len()), Some(2), "{mine:?}");
    assert_eq!(mine.last(), theirs.last());
    assert!(mine.last().unwrap().0 > epoch);
}

#[test]
fn a_drafters_rank_is_the_number_in_its_name_whatever_the_order_they_connect_in_and_after_a_restart(
) {
    let mut h = harness(&["--gpus", "cpu:3", "--targets", "1", "--hidden-slots", "8"]);
    let _target_rx = h.connect(TARGET, 0);
    let rank_of = |msgs: &[ToWorker]| {
        msgs.iter().find_map(|m| {
            if let ToWorker::Train(s) = m {
                Some(s.rank)
            } else {
                None
            }
        })
    };
    // drafter-1 first, drafter-0 after it.
    let d1 = h.connect(DRAFTER_1, 0);
    let d0 = h.connect(DRAFTER, 10);
    assert_eq!(h.d.workers[DRAFTER].name.to_string(), "drafter-0");
    assert_eq!(h.d.workers[DRAFTER_1].name.to_string(), "drafter-1");
    assert_eq!(rank_of(&received(&d0)), Some(0), "drafter-0 is rank 0");
    assert_eq!(rank_of(&received(&d1)), Some(1), "drafter-1 is rank 1");
    // drafter-0 dies and comes back: rank 0 again, not the rank that happens to be free.
    h.exit(DRAFTER, exit_code(1), 20);
    assert_eq!(h.launches(DRAFTER), 2, "the first failure restarts at once");
    let d0_again = h.connect(DRAFTER, 30);
    assert_eq!(
        rank_of(&received(&d0_again)),
        Some(0),
        "drafter-0 restarted"
    );
    let ranks: Vec<Vec<u32>> = epochs(&received(&d1)).into_iter().map(|e| e.1).collect();
    assert_eq!(ranks.last(), Some(&vec![0, 1]), "{ranks:?}");
}

#[test]
fn an_all_reduce_that_found_other_loss_weights_than_the_members_batches_stops_the_run() {
    let mut h = harness(&["--gpus", "cpu:3", "--targets", "1", "--hidden-slots", "8"]);
    let target_rx = h.connect(TARGET, 0);
    let (d0, d1) = (h.connect(DRAFTER, 0), h.connect(DRAFTER_1, 0));
    h.target_commits(&target_rx, 2, 10);
    let (got0, got1) = (received(&d0), received(&d1));
    let (l0, l1) = (h.life(DRAFTER).unwrap(), h.life(DRAFTER_1).unwrap());
    h.message(DRAFTER, l0, grads(1, deliveries(&got0)[0]), 20);
    h.message(DRAFTER_1, l1, grads(1, deliveries(&got1)[0]), 20);
    let epoch = epochs(&got0).last().unwrap().0;
    h.message(DRAFTER, l0, reduced(1, epoch, 8.0), 20);
    // 4.0: drafter-1 summed its own batch alone.
    h.message(DRAFTER_1, l1, reduced(1, epoch, 4.0), 20);
    assert_eq!(h.d.trainer.committed(), 0, "nothing is applied");
    assert!(applies(&received(&d0)).is_empty());
    assert!(matches!(h.d.phase, Phase::Stopping { .. }), "the run stops");
}

#[test]
fn an_all_reduce_every_member_entered_that_hangs_is_aborted_by_a_new_epoch_and_the_third_stops_the_run(
) {
    let mut h = harness(&[
        "--gpus",
        "cpu:3",
        "--targets",
        "1",
        "--hidden-slots",
        "8",
        "--collective-timeout",
        "10s",
    ]);
    let target_rx = h.connect(TARGET, 0);
    let (d0, d1) = (h.connect(DRAFTER, 0), h.connect(DRAFTER_1, 0));
    h.target_commits(&target_rx, 2, 10);
    let (got0, got1) = (received(&d0), received(&d1));
    let first = epochs(&got0).last().unwrap().0;
    let (l0, l1) = (h.life(DRAFTER).unwrap(), h.life(DRAFTER_1).unwrap());
    h.message(DRAFTER, l0, grads(1, deliveries(&got0)[0]), 20);
    h.tick(60_000);
    assert!(
        epochs(&received(&d0)).is_empty(),
        "waiting for a member that has no gradient yet is not a hang"
    );
    h.message(DRAFTER_1, l1, grads(1, deliveries(&got1)[0]), 60_000);
    h.tick(69_000);
    assert!(epochs(&received(&d0)).is_empty(), "not hung yet");
    h.tick(71_000);
    let again = epochs(&received(&d0));
    assert_eq!(
        again.iter().map(|e| (e.0, e.1.len())).collect::<Vec<_>>(),
        [(first + 1, 2)],
        "the same members, a new epoch"
    );
    assert!(!matches!(h.d.phase, Phase::Stopping { .. }));
    h.tick(82_000);
    h.tick(93_000);
    assert!(
        matches!(h.d.phase, Phase::Stopping { .. }),
        "the third hang of one step stops the run"
    );
    assert_eq!(h.d.trainer.committed(), 0);
}

/// A heartbeat saying the compute loop has been in `work` for `for_ms`.
fn busy_beat(work: dflash_shared::protocol::Work, for_ms: u64) -> FromWorker {
    FromWorker::Heartbeat {
        seq: 1,
        busy: Some(dflash_shared::protocol::Busy { work, for_ms }),
    }
}

const STEP_1: dflash_shared::protocol::Work = dflash_shared::protocol::Work::Step {
    step: 1,
    batch_id: 7,
};

impl Harness {
    /// The drafter's heartbeats every second from `from` to `to` ms, in step 1 since `since`.
    fn busy_beats(&mut self, since: u64, from: u64, to: u64) {
        let life = self.life(DRAFTER).unwrap();
        for ms in (from..=to).step_by(1000) {
            self.message(DRAFTER, life, busy_beat(STEP_1, ms - since), ms);
        }
    }
}

#[test]
fn a_step_longer_than_the_hang_timeout_is_said_once_and_one_over_the_step_timeout_is_killed_naming_both(
) {
    let mut h = harness(&[
        "--gpus",
        "cpu:2",
        "--hang-timeout",
        "5s",
        "--step-timeout",
        "30s",
    ]);
    let _rx = h.connect(DRAFTER, 0);
    let pid = h.pid(DRAFTER);
    // In step 1 from 0 on, beating every second: alive, merely slow.
    h.busy_beats(0, 1000, 5000);
    assert!(
        h.events("slow_step").is_empty(),
        "not slow at exactly --hang-timeout"
    );
    h.tick(5001);
    h.busy_beats(0, 6000, 30_000);
    let slow = h.events("slow_step");
    assert_eq!(slow.len(), 1, "said once: {slow:?}");
    assert_eq!(slow[0]["work"], "step 1 (batch 7)");
    assert!(
        h.signals(pid).is_empty(),
        "killed at exactly --step-timeout"
    );
    let log = std::fs::read_to_string(&h.d.workers[DRAFTER].log_path).unwrap();
    assert!(
        log.contains("drafter-0: step 1 (batch 7) has taken 5s so far (no step has finished yet); not a hang (--step-timeout 30s)"),
        "{log}"
    );
    h.tick(30_001);
    assert_eq!(
        h.signals(pid),
        [(Signal::SIGKILL, false), (Signal::SIGKILL, true)]
    );
    let why = h.d.workers[DRAFTER]
        .status
        .life()
        .unwrap()
        .killed_for()
        .unwrap()
        .to_string();
    assert_eq!(
        why,
        "hung: in step 1 (batch 7) for 30s, over --step-timeout 30s (no step has finished yet); \
         if it is merely slow, raise --step-timeout, or make steps smaller (--token-budget or --max-anchors)"
    );
    let hang = h.events("hang").pop().unwrap();
    assert_eq!(
        (hang["worker"].as_str(), hang["step_timeout_s"].as_f64()),
        (Some("drafter-0"), Some(30.0))
    );
    // Killed as a hang: restarted like one.
    h.exit(DRAFTER, killed_by(Signal::SIGKILL), 30_002);
    assert_eq!(h.launches(DRAFTER), 2);
    assert_eq!(h.events("exit").pop().unwrap()["killed_for"], why.as_str());
}

#[test]
fn by_default_a_step_is_held_to_ten_minutes_then_to_five_times_the_slowest_first_step() {
    let mut h = harness(&["--gpus", "cpu:2", "--hang-timeout", "5s"]);
    let _rx = h.connect(DRAFTER, 0);
    let pid = h.pid(DRAFTER);
    // Nothing measured: the floor, 10 minutes.
    h.busy_beats(0, 1000, 600_000);
    assert!(h.signals(pid).is_empty(), "killed before 10m");
    h.tick(600_001);
    assert_eq!(h.signals(pid).len(), 2, "not killed past 10m");
    assert!(h.d.workers[DRAFTER]
        .status
        .life()
        .unwrap()
        .killed_for()
        .unwrap()
        .contains("over --step-timeout 10m by default (no step has finished yet)"));
    h.exit(DRAFTER, killed_by(Signal::SIGKILL), 600_002);
    // The next life measured steps of 150 s, 190 s and 100 s (and a later one of 900 s,
    // past the first three): 5 × 190 s.
    let _rx = h.connect(DRAFTER, 600_500);
    let pid = h.pid(DRAFTER);
    for s in [150, 190, 100, 900] {
        h.d.step_took(DRAFTER, s as f64 * 1e3);
    }
    let t = 601_000;
    h.busy_beats(t, t + 1000, t + 950_000);
    assert!(h.signals(pid).is_empty(), "killed before 5 × 190 s");
    h.tick(t + 950_001);
    assert_eq!(h.signals(pid).len(), 2);
    assert!(h.d.workers[DRAFTER].status.life().unwrap().killed_for().unwrap()
        .contains("for 15m 50s, over --step-timeout 15m 50s by default (the first steps took 2m 30s, 3m 10s, 1m 40s (the last of 4: 15m))"),
        "{:?}", h.d.workers[DRAFTER].status.life().unwrap().killed_for());
    // A slow step was said once, past 3 × 190 s.
    let slow = h.events("slow_step");
    assert_eq!(slow.len(), 2, "{slow:?}");
    assert_eq!(slow[1]["busy_s"].as_f64().map(|s| s.round()), Some(571.0));
}

#[test]
fn a_pause_of_the_supervisor_restarts_the_step_timer() {
    let mut h = harness(&[
        "--gpus",
        "cpu:2",
        "--hang-timeout",
        "5s",
        "--step-timeout",
        "30s",
    ]);
    let _rx = h.connect(DRAFTER, 0);
    let pid = h.pid(DRAFTER);
    h.busy_beats(0, 1000, 20_000);
    // The supervisor did not run from 20 s to 40 s; the heartbeats queued meanwhile say
    // the step goes on.
    let now = h.at(40_000);
    h.d.resume_after_pause(Duration::from_secs(20), now);
    h.busy_beats(0, 40_000, 70_000);
    assert!(
        h.signals(pid).is_empty(),
        "killed less than 30 s after the pause"
    );
    h.tick(70_001);
    assert_eq!(h.signals(pid).len(), 2);
    assert!(h.d.workers[DRAFTER]
        .status
        .life()
        .unwrap()
        .killed_for()
        .unwrap()
        .starts_with("hung: in step 1 (batch 7) for 1m 10s, over --step-timeout 30s"));
}

#[test]
fn a_heartbeat_that_says_the_step_ended_stops_its_clock() {
    let mut h = harness(&["--gpus", "cpu:2", "--step-timeout", "30s"]);
    let _rx = h.connect(DRAFTER, 0);
    let (pid, life) = (h.pid(DRAFTER), h.life(DRAFTER).unwrap());
    h.busy_beats(0, 1000, 29_000);
    h.message(
        DRAFTER,
        life,
        FromWorker::Heartbeat { seq: 2, busy: None },
        29_500,
    );
    h.tick(45_000);
    assert!(h.signals(pid).is_empty(), "an idle worker is no slow step");
}

#[test]
fn a_workers_fatal_message_decides_whether_it_is_restarted_and_gives_the_reason() {
    use dflash_shared::protocol::FatalKind;
    // A crash the worker reports as such is restarted, whatever its exit code.
    let mut h = harness(&["--gpus", "cpu:2"]);
    let _rx = h.connect(TARGET, 0);
    let life = h.life(TARGET).unwrap();
    let crash = FromWorker::Fatal {
        kind: FatalKind::Crash,
        message: "a batch slot was torn".into(),
    };
    h.message(TARGET, life, crash, 5);
    h.exit(
        TARGET,
        exit_code(dflash_shared::exit_codes::WORKER_PERMANENT),
        10,
    );
    h.tick(1100);
    assert_eq!(h.launches(TARGET), 2, "a crash is restarted");
    assert!(matches!(h.d.phase, Phase::Running));
    assert_eq!(h.events("exit")[0]["fatal"], "crash");
    // A permanent one stops the run at once with the worker's own line, exit code aside.
    let _rx = h.connect(TARGET, 1200);
    let life = h.life(TARGET).unwrap();
    let device = FromWorker::Fatal {
        kind: FatalKind::Device,
        message: "cannot compute on device 0: libcuda.so.1 not found".into(),
    };
    h.message(TARGET, life, device, 1205);
    h.exit(TARGET, exit_code(1), 1210);
    assert_eq!(h.status(TARGET), "failed");
    assert_eq!(
        h.launches(TARGET),
        2,
        "a permanent failure is not restarted"
    );
    let Some(StopReason::TrainingFailed(msg)) = &h.d.stop_reason else {
        panic!("the run did not stop")
    };
    assert_eq!(
        msg,
        "target-0 cannot run on its CPU and was not restarted: cannot compute on device 0: libcuda.so.1 not found"
    );
    let give_up = h.events("give_up");
    assert_eq!(
        give_up[0]["last_exit"],
        "cannot compute on device 0: libcuda.so.1 not found"
    );
}

#[test]
fn a_permanent_exit_code_without_a_fatal_message_stops_the_run_naming_the_log() {
    let mut h = harness(&["--gpus", "cpu:2"]);
    h.exit(
        TARGET,
        exit_code(dflash_shared::exit_codes::WORKER_PERMANENT),
        10,
    );
    assert_eq!(h.status(TARGET), "failed");
    let Some(StopReason::TrainingFailed(msg)) = &h.d.stop_reason else {
        panic!("the run did not stop")
    };
    assert!(
        msg.starts_with("target-0 cannot run on its CPU and was not restarted: see ")
            && msg.ends_with("target-0.log"),
        "{msg}"
    );
}

#[test]
fn a_hello_taken_after_the_workers_death_still_counts_and_its_last_words_are_read() {
    use dflash_shared::protocol::FatalKind;
    let mut h = harness(&["--gpus", "cpu:2", "--max-restarts", "20"]);
    for round in 0..3u64 {
        let t = 10 + round * 2000;
        let life = h.life(TARGET).unwrap();
        // The process is reaped before its control thread has handed over the hello it
        // sent: the death waits for the control thread's word.
        h.step(
            Some(Event::Exited {
                worker: TARGET,
                life,
                status: exit_code(7),
            }),
            t,
        );
        assert_eq!(h.life(TARGET), Some(life), "the death waits for the hello");
        assert_eq!(h.launches(TARGET), round as usize + 1);
        let _rx = h.connect(TARGET, t + 1);
        let fatal = FromWorker::Fatal {
            kind: FatalKind::Crash,
            message: "crashing on purpose".into(),
        };
        h.message(TARGET, life, fatal, t + 2);
        let lost = ControlEvent::ChannelLost {
            worker: TARGET,
            life,
            reason: "control channel closed".into(),
            malformed: false,
        };
        h.step(Some(Event::Control(lost)), t + 3);
        h.tick(t + 1500);
    }
    // Three crashes after a hello are crashes, not a program that never connects.
    assert!(matches!(h.d.phase, Phase::Running), "the run stopped");
    assert!(h.d.workers[TARGET].ever_connected);
    h.tick(20_000);
    assert_eq!(h.launches(TARGET), 4, "restarted after each crash");
    let exits = h.events("exit");
    assert_eq!(exits.len(), 3);
    assert!(exits.iter().all(|e| e["fatal"] == "crash"), "{exits:?}");
}

#[test]
fn a_death_with_no_hello_is_handled_once_the_control_thread_finds_none() {
    let mut h = harness(&["--gpus", "cpu:2"]);
    let life = h.life(TARGET).unwrap();
    h.step(
        Some(Event::Exited {
            worker: TARGET,
            life,
            status: exit_code(3),
        }),
        10,
    );
    assert_eq!(h.launches(TARGET), 1, "not yet handled");
    h.step(
        Some(Event::Control(ControlEvent::Abandoned {
            worker: TARGET,
            life,
        })),
        11,
    );
    h.tick(1100);
    assert_eq!(h.launches(TARGET), 2, "handled, and restarted");
    assert_eq!(h.d.workers[TARGET].lives_without_hello, 1);
}

#[test]
fn a_death_after_its_control_thread_ended_is_not_waited_on() {
    let mut h = harness(&["--gpus", "cpu:2"]);
    let life = h.life(TARGET).unwrap();
    let lost = ControlEvent::ChannelLost {
        worker: TARGET,
        life,
        reason: "cannot start its control thread: out of threads".into(),
        malformed: false,
    };
    h.step(Some(Event::Control(lost)), 5);
    h.step(
        Some(Event::Exited {
            worker: TARGET,
            life,
            status: exit_code(3),
        }),
        10,
    );
    h.tick(1100);
    assert_eq!(h.launches(TARGET), 2, "handled at once, and restarted");
}

#[test]
fn a_storm_of_pre_emption_notices_is_one_checkpoint_request_said_and_forwarded_once() {
    let mut h = harness(&["--gpus", "cpu:2"]);
    let _rx: Vec<_> = [TARGET, DRAFTER].iter().map(|&w| h.connect(w, 0)).collect();
    let target = h.pid(TARGET);
    for i in 0..10 {
        h.signal(Signal::SIGUSR1, 100 + i);
    }
    assert_eq!(h.events("checkpoint_requested").len(), 1);
    assert_eq!(h.events("signal_forwarded").len(), 1);
    assert_eq!(h.signals(target), [(Signal::SIGUSR1, true)]);
    // SIGUSR2 is no request: forwarded each time.
    h.signal(Signal::SIGUSR2, 200);
    h.signal(Signal::SIGUSR2, 201);
    assert_eq!(h.events("signal_forwarded").len(), 3);
}

#[test]
fn a_slow_write_of_the_state_is_held_to_the_disks_floor_not_the_steps_and_named_as_the_disk() {
    let mut h = harness(&[
        "--gpus",
        "cpu:2",
        "--hang-timeout",
        "5s",
        "--step-timeout",
        "30s",
    ]);
    let _rx = h.connect(DRAFTER, 0);
    let pid = h.pid(DRAFTER);
    let life = h.life(DRAFTER).unwrap();
    let save = dflash_shared::protocol::Work::Save { step: 4 };
    for ms in (1000..=120_000).step_by(1000) {
        h.message(DRAFTER, life, busy_beat(save, ms), ms);
    }
    assert!(h.signals(pid).is_empty(), "a slow disk is no hung step");
    let log = std::fs::read_to_string(&h.d.workers[DRAFTER].log_path).unwrap();
    assert!(
        log.contains("saving the state of step 4 has taken") && log.contains("is slow?"),
        "{log}"
    );
    let floor = super::steps::SAVE_TIMEOUT_FLOOR.as_millis() as u64;
    for ms in (121_000..=floor).step_by(1000) {
        h.message(DRAFTER, life, busy_beat(save, ms), ms);
    }
    assert!(h.signals(pid).is_empty());
    h.tick(floor + 1);
    assert_eq!(
        h.signals(pid),
        [(Signal::SIGKILL, false), (Signal::SIGKILL, true)]
    );
    let why = h.d.workers[DRAFTER]
        .status
        .life()
        .unwrap()
        .killed_for()
        .unwrap()
        .to_string();
    assert!(
        why.contains("the filesystem of") && !why.contains("make steps smaller"),
        "{why}"
    );
}

/// `--targets auto`'s mechanism (the decision is `run::balance`'s, tested there): a worker
/// asked to leave becomes `moved` when it exits and the other role starts on its device; a
/// worker that moved away starts again when a device comes back to its role; a stop during
/// a move starts nothing.
#[test]
fn a_moved_device_starts_the_other_role_and_a_name_that_moved_away_comes_back() {
    use super::moves::Moving;
    let mut h = harness(&["--gpus", "cpu:3", "--checkpoint-every", "0"]);
    let rx: Vec<_> = (0..3).map(|w| h.connect(w, 0)).collect();
    for r in &rx {
        received(r);
    }
    let name = |h: &Harness, w: usize| h.d.workers[w].name.to_string();
    assert_eq!(name(&h, 2), "drafter-1");
    // drafter-1's device goes to the target role.
    h.d.moving = Some(Moving::Leaving {
        worker: 2,
        to: Role::Target,
    });
    h.d.ask_to_stop(2, "its device moves to the target role");
    assert!(received(&rx[2]).iter().any(is_shutdown));
    h.exit(2, exit_code(0), 100);
    assert_eq!(h.status(2), "moved");
    assert_eq!(h.d.workers.len(), 4);
    assert_eq!((name(&h, 3), h.launches(3)), ("target-1".to_string(), 1));
    assert!(matches!(h.d.moving, Some(Moving::Joining { worker: 3 })));
    let roles = h.d.roles();
    assert_eq!((roles["target"], roles["drafter"]), (2, 1));
    let moves = h.events("role_move");
    assert_eq!(moves.len(), 1);
    assert_eq!(
        (moves[0]["from"].as_str(), moves[0]["to"].as_str()),
        (Some("drafter-1"), Some("target-1"))
    );
    let train = std::fs::read_to_string(h.d.run.path.join("train.jsonl")).unwrap();
    assert!(
        train.contains(r#""role_move":{"from":"drafter-1""#),
        "{train}"
    );
    // Not a failure: no restart was counted for the worker that left.
    assert_eq!((h.d.workers[2].restarts, h.launches(2)), (0, 1));
    // The new worker dies before its first unit of work: restarted as any worker, and the
    // move is over.
    let _rx3 = h.connect(3, 200);
    h.exit(3, exit_code(1), 300);
    h.tick(300);
    assert_eq!(h.launches(3), 2);
    assert!(h.d.moving.is_none());
    // target-1's device comes back to the drafters: the entry drafter-1 starts again there.
    let _rx3 = h.connect(3, 400);
    h.d.moving = Some(Moving::Leaving {
        worker: 3,
        to: Role::Drafter,
    });
    h.d.ask_to_stop(3, "its device moves to the drafter role");
    h.exit(3, exit_code(0), 500);
    assert_eq!((h.status(3), h.d.workers.len()), ("moved", 4));
    assert_eq!((name(&h, 2), h.launches(2)), ("drafter-1".to_string(), 2));
    assert_eq!(h.d.roles()["drafter"], 2);
    // Its first unit of work ends the move.
    h.d.joined(2);
    assert!(h.d.moving.is_none());
    // A stop during a move: the leaving worker just stops.
    let _rx2 = h.connect(2, 600);
    h.d.moving = Some(Moving::Leaving {
        worker: 1,
        to: Role::Target,
    });
    h.signal(Signal::SIGTERM, 700);
    h.exit(1, exit_code(0), 800);
    assert_eq!(h.status(1), "exited");
    assert_eq!(h.d.workers.len(), 4, "nothing started");
    assert_eq!(h.events("role_move").len(), 2);
}
