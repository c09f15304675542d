//! A worker that misbehaves on request, for the end-to-end tests. It speaks the real
//! control protocol (through dflash-shared) and is run with `--worker-bin`.
//!
//! `DFLASH_TEST_BEHAVIOR` holds rules `WORKER[@RESTART]=ACTION[,ACTION...]` separated by
//! `;`. A rule applies to the worker of that name, on every life or only on the life whose
//! `DFLASH_RESTART_COUNT` is RESTART. Actions:
//!
//! - `crash:CODE`        say so on stderr and exit with CODE right after the hello
//! - `crash-after:MS`    behave for MS milliseconds, then exit 3
//! - `hang-after:MS`     behave for MS milliseconds, then stop heartbeating forever
//! - `ignore-stop`       ignore SIGTERM and the shutdown message
//! - `grandchild`        start `sleep 1000` in the worker's process group, print its pid
//! - `chatty:N`          print N numbered lines ("chatty N") one per millisecond
//! - `second-hello`      send a second Hello (a protocol violation)
//! - `heartbeat-first`   open the connection with a Heartbeat instead of a Hello
//! - `wrong-version`     say hello with protocol version 999
//! - `exit-early:CODE`   exit with CODE before connecting
//! - `hello-delay:MS`    wait MS milliseconds before installing signal handlers and
//!   connecting (a worker still starting: a signal's default action applies to it)
//! - `bad-ack:KIND`      on its first delivery, acknowledge it wrongly: KIND is
//!   stale-gen, out-of-range, wrong-slot or wrong-batch
//! - `bad-commit:KIND`   (a target) once it has a delivery and a lease, commit wrongly:
//!   too-long, empty (length 0) or stale-gen
//! - `real-after:WORKER` wait until the run's state.json shows WORKER (e.g. drafter-1)
//!   running, i.e. connected (at most 50 s), then become the real worker
//!   (`DFLASH_TEST_REAL_WORKER`): workers that connect in a chosen order
//!
//! A rule that names no known action, or an action whose value is missing or wrong (a
//! typo in a test), is an error: the whole spec is checked, every worker's rules, before
//! anything else, and a worker given a bad spec exits with WORKER_PERMANENT, so the run
//! stops instead of carrying on with an idle worker. `dflash-test-worker --check-behavior
//! SPEC` checks a spec alone (the e2e harness runs it before every run it starts).
//!
//! It never consumes batches it is given (unless told to misuse them).
//! With no rule for the current life it execs the real worker named by
//! `DFLASH_TEST_REAL_WORKER` if that is set, else behaves like an idle worker: heartbeats,
//! exits 0 on shutdown or SIGTERM, prints a line on SIGUSR1/SIGUSR2.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_shared::protocol::{connect, FatalKind, FromWorker, Hello, SlotRef, ToWorker};
use dflash_shared::{env, exit_codes};
use ipc_channel::ipc::{self, IpcSender};

/// What an action's value must be.
enum Takes {
    Nothing,
    Number,
    OneOf(&'static [&'static str]),
    /// A worker name: target-N or drafter-N.
    Worker,
}

/// Every action this worker knows.
const ACTIONS: &[(&str, Takes)] = &[
    ("crash", Takes::Number),
    ("crash-after", Takes::Number),
    ("hang-after", Takes::Number),
    ("ignore-stop", Takes::Nothing),
    ("grandchild", Takes::Nothing),
    ("chatty", Takes::Number),
    ("second-hello", Takes::Nothing),
    ("heartbeat-first", Takes::Nothing),
    ("wrong-version", Takes::Nothing),
    ("exit-early", Takes::Number),
    ("hello-delay", Takes::Number),
    (
        "bad-ack",
        Takes::OneOf(&["stale-gen", "out-of-range", "wrong-slot", "wrong-batch"]),
    ),
    (
        "bad-commit",
        Takes::OneOf(&["too-long", "empty", "stale-gen"]),
    ),
    ("real-after", Takes::Worker),
];

struct Rule {
    name: String,
    life: Option<String>,
    actions: Vec<(String, Option<String>)>,
}

/// Parse and check a whole `DFLASH_TEST_BEHAVIOR` spec.
fn parse_spec(spec: &str) -> Result<Vec<Rule>, String> {
    let mut rules = Vec::new();
    for rule in spec.split(';').filter(|r| !r.trim().is_empty()) {
        let (who, what) = rule
            .split_once('=')
            .ok_or_else(|| format!("rule '{rule}' is not WORKER[@RESTART]=ACTION"))?;
        let (name, life) = match who.split_once('@') {
            Some((n, l)) => (n.trim(), Some(l.trim())),
            None => (who.trim(), None),
        };
        let Some((role, rank)) = name.rsplit_once('-') else {
            return Err(format!("rule '{rule}': '{name}' is not ROLE-RANK"));
        };
        if !matches!(role, "target" | "drafter") || rank.parse::<u32>().is_err() {
            return Err(format!(
                "rule '{rule}': '{name}' is not target-N or drafter-N"
            ));
        }
        if life.is_some_and(|l| l.parse::<u32>().is_err()) {
            return Err(format!(
                "rule '{rule}': the restart after '@' is not a number"
            ));
        }
        let mut actions = Vec::new();
        for a in what.split(',') {
            let (k, v) = match a.split_once(':') {
                Some((k, v)) => (k.trim().to_string(), Some(v.trim().to_string())),
                None => (a.trim().to_string(), None),
            };
            let Some((_, takes)) = ACTIONS.iter().find(|(known, _)| *known == k) else {
                let known: Vec<&str> = ACTIONS.iter().map(|(k, _)| *k).collect();
                return Err(format!(
                    "rule '{rule}': unknown action '{k}' (known: {})",
                    known.join(", ")
                ));
            };
            match (takes, v.as_deref()) {
                (Takes::Nothing, None) => {}
                (Takes::Number, Some(n)) if n.parse::<u64>().is_ok() => {}
                (Takes::OneOf(kinds), Some(kind)) if kinds.contains(&kind) => {}
                (Takes::Worker, Some(w)) if is_worker_name(w) => {}
                (Takes::Nothing, Some(_)) => {
                    return Err(format!("rule '{rule}': action '{k}' takes no value"))
                }
                (Takes::Number, _) => {
                    return Err(format!(
                        "rule '{rule}': action '{k}' takes a number ({k}:N)"
                    ))
                }
                (Takes::OneOf(kinds), _) => {
                    return Err(format!(
                        "rule '{rule}': action '{k}' takes one of {}",
                        kinds.join(", ")
                    ))
                }
                (Takes::Worker, _) => {
                    return Err(format!(
                        "rule '{rule}': action '{k}' takes a worker name ({k}:drafter-N)"
                    ))
                }
            }
            actions.push((k, v));
        }
        rules.push(Rule {
            name: name.to_string(),
            life: life.map(str::to_string),
            actions,
        });
    }
    Ok(rules)
}

/// `target-N` or `drafter-N`.
fn is_worker_name(name: &str) -> bool {
    name.rsplit_once('-').is_some_and(|(role, rank)| {
        matches!(role, "target" | "drafter") && rank.parse::<u32>().is_ok()
    })
}

/// `real-after:WORKER`: wait (at most 50 s) until the run's state.json shows `worker`
/// running (connected).
fn wait_until_running(worker: &str) {
    let state = std::path::Path::new(&var(env::RUN_DIR)).join("state.json");
    let deadline = Instant::now() + Duration::from_secs(50);
    while Instant::now() < deadline {
        let running = std::fs::read_to_string(&state)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|s| {
                s["workers"].as_array().is_some_and(|ws| {
                    ws.iter()
                        .any(|w| w["name"] == worker && w["state"] == "running")
                })
            });
        if running {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("test worker: {worker} did not connect within 50 s; going on");
}

/// This life's actions, from a checked spec.
fn actions(rules: Vec<Rule>) -> Vec<(String, Option<String>)> {
    let me = format!("{}-{}", var(env::ROLE), var(env::RANK));
    let restart = var(env::RESTART_COUNT);
    rules
        .into_iter()
        .filter(|r| r.name == me && r.life.as_ref().is_none_or(|l| *l == restart))
        .flat_map(|r| r.actions)
        .collect()
}

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_default()
}

fn arg(acts: &[(String, Option<String>)], key: &str) -> Option<u64> {
    acts.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_deref().unwrap_or("0").parse().expect("number"))
}

fn text<'a>(acts: &'a [(String, Option<String>)], key: &str) -> Option<&'a str> {
    acts.iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| v.as_deref())
}

fn has(acts: &[(String, Option<String>)], key: &str) -> bool {
    acts.iter().any(|(k, _)| k == key)
}

type Acts = Vec<(String, Option<String>)>;

fn main() {
    check_behavior_and_exit();
    exec_the_real_worker_for_tools();
    let acts = this_lifes_actions();
    let name = format!("{}-{}", var(env::ROLE), var(env::RANK));
    let restart: u32 = var(env::RESTART_COUNT).parse().unwrap_or(0);
    let control = std::env::args().nth(2).expect("--control NAME");
    let hb = Duration::from_millis(var(env::HEARTBEAT_MS).parse().unwrap_or(100));
    println!(
        "test worker {name} pid {} restart {restart} actions {acts:?}",
        std::process::id()
    );

    if let Some(code) = arg(&acts, "exit-early") {
        std::process::exit(code as i32);
    }
    if let Some(ms) = arg(&acts, "hello-delay") {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let signals = Signals::install(&acts);
    let (up, down) = say_hello(&acts, &control, &name, restart);
    misbehave_after_hello(&acts, &up, &name, restart);
    serve(&acts, &up, &down, &signals, hb);
}

/// `--check-behavior SPEC` (run by the harness before every run): exit 0 when the spec
/// is valid, 2 with the reason when not.
fn check_behavior_and_exit() {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() != Some("--check-behavior") {
        return;
    }
    let spec = args.next().unwrap_or_default();
    match parse_spec(&spec) {
        Ok(_) => std::process::exit(0),
        Err(e) => {
            eprintln!("bad DFLASH_TEST_BEHAVIOR: {e}");
            std::process::exit(exit_codes::USAGE);
        }
    }
}

/// Tools (like writing the tiny target) are the real worker's business.
fn exec_the_real_worker_for_tools() {
    if std::env::args().nth(1).is_some_and(|a| a != "--control") {
        use std::os::unix::process::CommandExt;
        let me = std::env::current_exe().expect("current exe");
        let real = me.with_file_name("dflash-worker");
        let err = std::process::Command::new(real)
            .args(std::env::args_os().skip(1))
            .exec();
        panic!("exec of dflash-worker failed: {err}");
    }
}

/// The actions of the rules that apply to this life. With none, and a real worker named,
/// this process becomes the real worker (same pid, same arguments).
fn this_lifes_actions() -> Acts {
    let rules = match parse_spec(&var("DFLASH_TEST_BEHAVIOR")) {
        Ok(r) => r,
        Err(e) => {
            // Loud: a permanent failure stops the run with this line as its reason, told
            // the way a real worker tells it: connected, as its last message.
            let message = format!("bad DFLASH_TEST_BEHAVIOR: {e}");
            eprintln!("{message}");
            if let Some(control) = std::env::args().nth(2) {
                let name = format!("{}-{}", var(env::ROLE), var(env::RANK));
                let restart = var(env::RESTART_COUNT).parse().unwrap_or(0);
                let (up, down) = say_hello(&Acts::new(), &control, &name, restart);
                // Its first order (the pools) says the supervisor took the hello, as a
                // real worker's failures come after it: then the exit is read after this.
                let _ = down.recv();
                let kind = FatalKind::Config;
                let _ = up.send(FromWorker::Fatal { kind, message });
            }
            std::process::exit(exit_codes::WORKER_PERMANENT);
        }
    };
    let mut acts = actions(rules);
    if let Some(w) = text(&acts, "real-after").map(str::to_string) {
        wait_until_running(&w);
        acts.retain(|(k, _)| k != "real-after");
    }
    if acts.is_empty() {
        if let Some(real) = std::env::var_os("DFLASH_TEST_REAL_WORKER") {
            use std::os::unix::process::CommandExt;
            let err = std::process::Command::new(real)
                .args(std::env::args_os().skip(1))
                .exec();
            panic!("exec of the real worker failed: {err}");
        }
    }
    acts
}

/// SIGTERM (unless `ignore-stop`) and SIGUSR1, as flags the loop looks at.
struct Signals {
    stop: Arc<AtomicBool>,
    usr1: Arc<AtomicBool>,
}

impl Signals {
    fn install(acts: &Acts) -> Signals {
        let stop = Arc::new(AtomicBool::new(false));
        let usr1 = Arc::new(AtomicBool::new(false));
        if has(acts, "ignore-stop") {
            // SAFETY: installing SIG_IGN runs no handler code.
            unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
        } else {
            signal_hook::flag::register(libc::SIGTERM, stop.clone()).unwrap();
        }
        signal_hook::flag::register(libc::SIGUSR1, usr1.clone()).unwrap();
        Signals { stop, usr1 }
    }
}

/// Connect to the supervisor: a proper hello, or the broken openings a rule asks for.
fn say_hello(
    acts: &Acts,
    control: &str,
    name: &str,
    restart: u32,
) -> (IpcSender<FromWorker>, ipc::IpcReceiver<ToWorker>) {
    if !has(acts, "heartbeat-first") && !has(acts, "wrong-version") {
        return connect(control, name, restart).expect("connect to supervisor");
    }
    let up = IpcSender::<FromWorker>::connect(control.to_string()).unwrap();
    let (to_worker, down) = ipc::channel::<ToWorker>().unwrap();
    if has(acts, "heartbeat-first") {
        up.send(FromWorker::Heartbeat { seq: 0, busy: None })
            .unwrap();
        // Keep the downward channel open so this worker lives until the supervisor
        // reacts, instead of exiting on its own first.
        std::mem::forget(to_worker);
    } else {
        let hello = Hello {
            protocol: 999,
            pid: std::process::id(),
            worker: name.to_string(),
            restart_count: restart,
            to_worker,
        };
        up.send(FromWorker::Hello(hello)).unwrap();
    }
    (up, down)
}

/// What a rule does at once after the hello: crash, fork, chatter, a second hello.
fn misbehave_after_hello(acts: &Acts, up: &IpcSender<FromWorker>, name: &str, restart: u32) {
    if let Some(code) = arg(acts, "crash") {
        eprintln!("crashing on purpose with exit code {code}");
        std::process::exit(code as i32);
    }
    if has(acts, "grandchild") {
        let g = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .expect("spawn sleep");
        println!("grandchild pid {}", g.id());
        std::mem::forget(g);
    }
    if let Some(n) = arg(acts, "chatty") {
        for i in 0..n {
            println!("chatty {i}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    if has(acts, "second-hello") {
        let (to_worker, keep) = ipc::channel::<ToWorker>().unwrap();
        let hello = Hello {
            protocol: dflash_shared::protocol::PROTOCOL_VERSION,
            pid: std::process::id(),
            worker: name.to_string(),
            restart_count: restart,
            to_worker,
        };
        up.send(FromWorker::Hello(hello)).unwrap();
        std::mem::forget(keep);
    }
}

/// The first delivered batch and the first leased slot, for `bad-ack` and `bad-commit`.
#[derive(Default)]
struct Slots {
    delivery: Option<(SlotRef, u64)>,
    lease: Option<SlotRef>,
    misbehaved: bool,
}

impl Slots {
    /// Send the bad ack or commit a rule asks for, once its slots are known.
    fn misbehave(&mut self, acts: &Acts, up: &IpcSender<FromWorker>) {
        if self.misbehaved {
            return;
        }
        if let (Some(kind), Some((slot, batch_id))) = (text(acts, "bad-ack"), self.delivery) {
            let (slot, batch_id) = match kind {
                "stale-gen" => (
                    SlotRef {
                        gen: slot.gen - 1,
                        ..slot
                    },
                    batch_id,
                ),
                "out-of-range" => (SlotRef { slot: 9999, ..slot }, batch_id),
                "wrong-slot" => (
                    SlotRef {
                        slot: slot.slot + 1,
                        ..slot
                    },
                    batch_id,
                ),
                "wrong-batch" => (slot, batch_id + 1000),
                other => unreachable!("bad-ack:{other} passed the spec check"),
            };
            println!("sending a bad ack ({kind})");
            up.send(FromWorker::Ack {
                input: slot,
                batch_id,
            })
            .unwrap();
            self.misbehaved = true;
        }
        if let (Some(kind), Some((input, batch_id)), Some(output)) =
            (text(acts, "bad-commit"), self.delivery, self.lease)
        {
            let (output, len) = match kind {
                "too-long" => (output, u64::MAX),
                "empty" => (output, 0),
                "stale-gen" => (
                    SlotRef {
                        gen: output.gen + 7,
                        ..output
                    },
                    100,
                ),
                other => unreachable!("bad-commit:{other} passed the spec check"),
            };
            println!("sending a bad commit ({kind})");
            up.send(FromWorker::Commit {
                output,
                len,
                batch_id,
                input: Some(input),
                wait_ms: 0.0,
                compute_ms: 0.0,
            })
            .unwrap();
            self.misbehaved = true;
        }
    }
}

/// Heartbeat every `hb` and obey (or not, as the rules say) until told to stop.
fn serve(
    acts: &Acts,
    up: &IpcSender<FromWorker>,
    down: &ipc::IpcReceiver<ToWorker>,
    signals: &Signals,
    hb: Duration,
) -> ! {
    let started = Instant::now();
    let crash_after = arg(acts, "crash-after").map(Duration::from_millis);
    let hang_after = arg(acts, "hang-after").map(Duration::from_millis);
    let ignore_stop = has(acts, "ignore-stop");
    let mut seq = 0;
    let mut slots = Slots::default();
    loop {
        slots.misbehave(acts, up);
        match down.try_recv_timeout(hb) {
            Ok(
                ToWorker::Pools { .. }
                | ToWorker::Train(_)
                | ToWorker::Group { .. }
                | ToWorker::Apply { .. }
                | ToWorker::Abstain { .. }
                | ToWorker::Withdraw { .. }
                | ToWorker::Snapshot { .. }
                | ToWorker::Checkpoint { .. },
            ) => {}
            Ok(ToWorker::Deliver { slot, batch_id, .. }) => {
                slots.delivery.get_or_insert((slot, batch_id));
            }
            Ok(ToWorker::Lease { slot }) => {
                slots.lease.get_or_insert(slot);
            }
            Ok(ToWorker::Shutdown { reason }) => {
                if ignore_stop {
                    println!("ignoring shutdown ({reason})");
                } else {
                    println!("shutdown ({reason})");
                    std::process::exit(0);
                }
            }
            Err(ipc_channel::TryRecvError::Empty) => {}
            Err(ipc_channel::TryRecvError::IpcError(ipc_channel::IpcError::Io(e)))
                if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => {
                eprintln!("control channel closed");
                std::process::exit(exit_codes::WORKER_ORPHANED);
            }
        }
        if signals.stop.load(Ordering::Relaxed) {
            println!("SIGTERM: exiting");
            std::process::exit(0);
        }
        if signals.usr1.swap(false, Ordering::Relaxed) {
            println!("got SIGUSR1");
        }
        if crash_after.is_some_and(|d| started.elapsed() >= d) {
            eprintln!("crashing on purpose after {:?}", started.elapsed());
            std::process::exit(3);
        }
        if hang_after.is_some_and(|d| started.elapsed() >= d) {
            println!("hanging on purpose");
            loop {
                std::thread::park();
            }
        }
        seq += 1;
        if up.send(FromWorker::Heartbeat { seq, busy: None }).is_err() {
            std::process::exit(exit_codes::WORKER_ORPHANED);
        }
    }
}
