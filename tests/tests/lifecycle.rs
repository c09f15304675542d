//! Process management end to end: spawn, crash, hang, crash loop, stop, kill.

mod common;

use std::fs;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;
use serde_json::Value;

const T: Duration = Duration::from_secs(20);

fn environ(pid: u32) -> Vec<String> {
    let raw = fs::read(format!("/proc/{pid}/environ")).unwrap();
    raw.split(|&b| b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

fn events_of<'a>(events: &'a [Value], kind: &str, worker: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|e| e["event"] == kind && e["worker"] == worker)
        .collect()
}

fn millis(t: &Value) -> i128 {
    rfc3339_ms(t.as_str().unwrap())
}

/// Milliseconds since the Unix epoch of an RFC 3339 UTC time like
/// 2026-11-30T10:17:05.123Z (what the run's events carry): date and time, so differences
/// across midnight (or a month's or year's end) come out right.
fn rfc3339_ms(s: &str) -> i128 {
    let bad = || panic!("not an RFC 3339 UTC time with milliseconds: {s:?}");
    let b = s.as_bytes();
    if b.len() != 24
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b'T'
        || b[13] != b':'
        || b[16] != b':'
        || b[19] != b'.'
        || b[23] != b'Z'
    {
        bad();
    }
    let n = |r: std::ops::Range<usize>| -> i128 { s[r].parse().unwrap_or_else(|_| bad()) };
    let (y, mo, d) = (n(0..4), n(5..7), n(8..10));
    let (h, mi, sec, ms) = (n(11..13), n(14..16), n(17..19), n(20..23));
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        bad();
    }
    // Days from 1970-01-01 to y-mo-d in the proleptic Gregorian calendar (H. Hinnant's
    // days_from_civil).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((mo + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    ((days * 24 + h) * 60 + mi) * 60_000 + sec * 1000 + ms
}

#[test]
fn event_times_are_parsed_with_their_date() {
    assert_eq!(rfc3339_ms("1970-01-01T00:00:00.000Z"), 0);
    assert_eq!(rfc3339_ms("2000-03-01T00:00:00.001Z"), 951_868_800_001);
    // Across midnight, a month's end and a year's end: 1 ms apart, not -86 399 999.
    assert_eq!(
        rfc3339_ms("2026-12-01T00:00:00.000Z") - rfc3339_ms("2026-11-30T23:59:59.999Z"),
        1
    );
    assert_eq!(
        rfc3339_ms("2027-01-01T00:00:00.020Z") - rfc3339_ms("2026-12-31T23:59:59.990Z"),
        30
    );
    assert_eq!(
        rfc3339_ms("2028-03-01T00:00:00.000Z") - rfc3339_ms("2028-02-28T00:00:00.000Z"),
        2 * 86_400_000
    );
    // What the supervisor writes now parses to now.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i128;
    let run = Sup::start_real(&["--gpus", "cpu:2"]);
    run.wait_running(2);
    let spawn = run
        .events()
        .into_iter()
        .find(|e| e["event"] == "spawn")
        .expect("a spawn event");
    let t = millis(&spawn["time"]);
    assert!(
        (now - 1000..now + 120_000).contains(&t),
        "spawn at {t} ms, test started at {now} ms"
    );
}

#[test]
fn spawns_one_process_per_worker_with_its_identity_and_sigterm_exits_75() {
    let mut sup = Sup::start_real(&["--gpus", "cpu:3", "--targets", "1"]);
    let st = sup.wait_running(3);
    let names: Vec<&str> = st["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["target-0", "drafter-0", "drafter-1"]);
    let run_dir = fs::canonicalize(&sup.run_dir).unwrap();
    let mut pids = Vec::new();
    for (name, role, rank) in [
        ("target-0", "target", 0),
        ("drafter-0", "drafter", 0),
        ("drafter-1", "drafter", 1),
    ] {
        let pid = pid_of(&st, name);
        pids.push(pid);
        assert!(pid_alive(pid));
        let env = environ(pid);
        for want in [
            format!("DFLASH_ROLE={role}"),
            format!("DFLASH_RANK={rank}"),
            "DFLASH_GPU=cpu".to_string(),
            "DFLASH_RESTART_COUNT=0".to_string(),
            format!("DFLASH_RUN_DIR={}", run_dir.display()),
            "CUDA_VISIBLE_DEVICES=".to_string(),
        ] {
            assert!(env.contains(&want), "{name} lacks {want}: {env:?}");
        }
        // Its own process group, child of the supervisor.
        let pgid = nix::unistd::getpgid(Some(nix::unistd::Pid::from_raw(pid as i32))).unwrap();
        assert_eq!(
            pgid.as_raw() as u32,
            pid,
            "{name} leads its own process group"
        );
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let ppid: u32 = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(ppid, sup.pid());
    }
    // Workers started later inherit nothing more than the first one did (no descriptor
    // of an earlier worker's control channel leaks into them). A worker's count moves
    // while it takes its first messages, so they are compared once they agree, up to a
    // deadline: a leaked descriptor never goes away, and the counts never agree.
    let count = || -> Vec<usize> {
        pids.iter()
            .map(|p| fs::read_dir(format!("/proc/{p}/fd")).unwrap().count())
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut fds = count();
    while !fds.iter().all(|&n| n == fds[0]) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        fds = count();
    }
    assert!(
        fds.iter().all(|&n| n == fds[0]),
        "open descriptors per worker differ: {fds:?}"
    );
    sup.signal(Signal::SIGTERM);
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(75), "stderr:\n{}", sup.stderr());
    for pid in pids {
        assert!(!pid_alive(pid), "worker {pid} outlived the run");
    }
    let st = sup.state().unwrap();
    assert_eq!(st["phase"], "stopped");
    assert_eq!(st["exit_code"], 75);
    let ev = sup.events();
    assert_eq!(ev.iter().filter(|e| e["event"] == "spawn").count(), 3);
    assert_eq!(
        ev.iter()
            .filter(|e| e["event"] == "exit" && e["code"] == 0)
            .count(),
        3
    );
    assert!(sup.run_dir.join("supervisor.log").exists());
}

#[test]
fn kill_9_restarts_that_worker_alone_and_fast() {
    let sup = Sup::start_real(&["--gpus", "cpu:3", "--targets", "1"]);
    let st = sup.wait_running(3);
    let before: Vec<u32> = ["target-0", "drafter-0", "drafter-1"]
        .iter()
        .map(|n| pid_of(&st, n))
        .collect();

    signal(before[2], Signal::SIGKILL);
    let st = sup.wait_state("drafter-1 back with a new pid", T, |s| {
        let w = worker(s, "drafter-1");
        w["state"] == "running" && w["pid"].as_u64().is_some_and(|p| p as u32 != before[2])
    });
    assert_eq!(worker(&st, "drafter-1")["restarts"], 1);
    assert_eq!(
        worker(&st, "drafter-1")["last_exit"],
        "killed by signal SIGKILL"
    );
    for (i, n) in ["target-0", "drafter-0"].iter().enumerate() {
        assert_eq!(pid_of(&st, n), before[i], "{n} was disturbed");
        assert_eq!(worker(&st, n)["restarts"], 0);
    }
    let new_pid = pid_of(&st, "drafter-1");
    assert!(environ(new_pid).contains(&"DFLASH_RESTART_COUNT=1".to_string()));

    // A target's replacement is spawned at once: no backoff (delay 0), and well within the
    // first backoff's second of its death being seen, however loaded the machine.
    signal(before[0], Signal::SIGKILL);
    sup.wait_state("target-0 back", T, |s| {
        worker(s, "target-0")["restarts"] == 1 && worker(s, "target-0")["state"] == "running"
    });
    let ev = sup.events();
    let exit = events_of(&ev, "exit", "target-0")[0];
    assert_eq!(exit["signal"], "SIGKILL");
    let spawn = events_of(&ev, "spawn", "target-0")[1];
    let gap = millis(&spawn["time"]) - millis(&exit["time"]);
    assert!(
        (0..1000).contains(&gap),
        "replacement spawned {gap} ms after the death"
    );
    assert_eq!(events_of(&ev, "restart", "target-0")[0]["delay_ms"], 0);
}

#[test]
fn hung_worker_is_killed_and_restarted() {
    let t0 = Instant::now();
    let sup = Sup::start(
        &["--gpus", "cpu:2", "--hang-timeout", "3s"],
        "drafter-0@0=hang-after:200",
    );
    let st = sup.wait_state("drafter-0 restarted after hanging", T, |s| {
        let w = worker(s, "drafter-0");
        w["restarts"] == 1 && w["state"] == "running"
    });
    // Hang after 0.2 s + 3 s timeout; generous margin for a loaded machine.
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
    assert!(worker(&st, "drafter-0")["last_exit"]
        .as_str()
        .unwrap()
        .contains("hung: no heartbeat"));
    let ev = sup.events();
    assert_eq!(events_of(&ev, "hang", "drafter-0").len(), 1);
    assert_eq!(worker(&st, "target-0")["restarts"], 0);
}

#[test]
fn crash_loop_gives_up_with_a_root_cause_report() {
    let mut sup = Sup::start(
        &["--gpus", "cpu:2", "--max-restarts", "2"],
        "drafter-0=crash:7",
    );
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "stderr:\n{err}");
    for needle in [
        "run failed: drafter-0",
        "--max-restarts 2",
        "last exit: exit code 7",
        "restarts:  2",
        "crashing on purpose with exit code 7",
    ] {
        assert!(err.contains(needle), "report lacks {needle:?}:\n{err}");
    }
    let st = sup.state().unwrap();
    assert_eq!(st["phase"], "failed");
    assert_eq!(st["exit_code"], 1);
    assert_eq!(worker(&st, "drafter-0")["state"], "failed");
    let ev = sup.events();
    assert_eq!(events_of(&ev, "exit", "drafter-0").len(), 3);
    assert_eq!(events_of(&ev, "give_up", "drafter-0").len(), 1);
    // Second restart waited for the backoff (1 s), the first did not.
    let delays: Vec<u64> = events_of(&ev, "restart", "drafter-0")
        .iter()
        .map(|e| e["delay_ms"].as_u64().unwrap())
        .collect();
    assert_eq!(delays, [0, 1000]);
}

#[test]
fn supervisor_sigkill_leaves_no_worker_or_grandchild() {
    let sup = Sup::start(
        &["--gpus", "cpu:3", "--targets", "1"],
        "drafter-1=grandchild",
    );
    let st = sup.wait_running(3);
    let mut pids: Vec<u32> = ["target-0", "drafter-0", "drafter-1"]
        .iter()
        .map(|n| pid_of(&st, n))
        .collect();
    let grandchild: u32 = wait_for("the grandchild's pid in the log", T, || {
        let log = sup.log("drafter-1");
        let line = log.lines().find(|l| l.contains("grandchild pid "))?;
        line.rsplit(' ').next()?.parse().ok()
    });
    assert!(pid_alive(grandchild));
    pids.push(grandchild);
    sup.signal(Signal::SIGKILL);
    wait_for(
        "every worker and the grandchild to die",
        Duration::from_secs(10),
        || pids.iter().all(|&p| !pid_alive(p)).then_some(()),
    );
}

#[test]
fn killing_a_worker_kills_its_grandchild_too() {
    let sup = Sup::start(&["--gpus", "cpu:2"], "drafter-0@0=grandchild");
    let st = sup.wait_running(2);
    let grandchild: u32 = wait_for("the grandchild's pid", T, || {
        sup.log("drafter-0")
            .lines()
            .find(|l| l.contains("grandchild pid "))?
            .rsplit(' ')
            .next()?
            .parse()
            .ok()
    });
    signal(pid_of(&st, "drafter-0"), Signal::SIGKILL);
    wait_for(
        "the grandchild to die with its worker",
        Duration::from_secs(5),
        || (!pid_alive(grandchild)).then_some(()),
    );
    sup.wait_state("drafter-0 restarted", T, |s| {
        worker(s, "drafter-0")["restarts"] == 1
    });
}

#[test]
fn worker_ignoring_stop_is_killed_after_stop_timeout() {
    let mut sup = Sup::start(
        &["--gpus", "cpu:2", "--stop-timeout", "3s"],
        "drafter-0=ignore-stop",
    );
    let st = sup.wait_running(2);
    let stubborn = pid_of(&st, "drafter-0");
    let t0 = Instant::now();
    sup.signal(Signal::SIGTERM);
    let status = sup.wait_exit(T);
    assert!(
        t0.elapsed() >= Duration::from_secs(3),
        "killed before the stop timeout: {:?}",
        t0.elapsed()
    );
    assert_eq!(status.code(), Some(3), "stderr:\n{}", sup.stderr());
    assert!(!pid_alive(stubborn));
    assert!(sup.stderr().contains("did not stop within --stop-timeout"));
    assert!(sup.log("drafter-0").contains("ignoring shutdown"));
    let st = sup.state().unwrap();
    assert_eq!(worker(&st, "target-0")["last_exit"], "exit code 0");
    assert!(worker(&st, "drafter-0")["last_exit"]
        .as_str()
        .unwrap()
        .contains("SIGKILL"));
}

#[test]
fn second_ctrl_c_kills_at_once() {
    let mut sup = Sup::start(
        &["--gpus", "cpu:2", "--stop-timeout", "10m"],
        "drafter-0=ignore-stop",
    );
    let st = sup.wait_running(2);
    let stubborn = pid_of(&st, "drafter-0");
    sup.signal(Signal::SIGINT);
    sup.wait_state("the run to be stopping", T, |s| s["phase"] == "stopping");
    sup.signal(Signal::SIGINT);
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(130), "stderr:\n{}", sup.stderr());
    assert!(!pid_alive(stubborn));
}

#[test]
fn sigusr1_is_forwarded_to_every_worker() {
    let sup = Sup::start_real(&["--gpus", "cpu:2"]);
    sup.wait_running(2);
    sup.signal(Signal::SIGUSR1);
    for w in ["target-0", "drafter-0"] {
        wait_for(&format!("{w} to report SIGUSR1"), T, || {
            sup.log(w).contains("SIGUSR1 received").then_some(())
        });
    }
    let st = sup.state().unwrap();
    assert!(st["phase"] == "running", "SIGUSR1 must not stop the run");
    for w in st["workers"].as_array().unwrap() {
        assert_eq!(w["restarts"], 0, "SIGUSR1 must not disturb a worker: {w}");
    }
}

#[test]
fn protocol_violations_restart_only_the_offender() {
    let sup = Sup::start(
        &["--gpus", "cpu:3", "--targets", "1"],
        "drafter-0@0=second-hello;drafter-1@0=heartbeat-first",
    );
    let st = sup.wait_state("both offenders restarted", T, |s| {
        ["drafter-0", "drafter-1"]
            .iter()
            .all(|n| worker(s, n)["restarts"] == 1 && worker(s, n)["state"] == "running")
    });
    assert_eq!(worker(&st, "target-0")["restarts"], 0);
    let ev = sup.events();
    assert_eq!(events_of(&ev, "protocol_violation", "drafter-0").len(), 1);
    assert_eq!(events_of(&ev, "protocol_violation", "drafter-1").len(), 1);
    assert!(worker(&st, "drafter-0")["last_exit"]
        .as_str()
        .unwrap()
        .contains("second Hello"));
    // The message named in words, not its Rust Debug text ("Heartbeat { seq: 0, .. }").
    let why = worker(&st, "drafter-1")["last_exit"].as_str().unwrap();
    assert!(
        why.contains("first control message was Heartbeat, expected Hello") && !why.contains('{'),
        "{why}"
    );
}

#[test]
fn incompatible_protocol_version_stops_the_run() {
    let mut sup = Sup::start(&["--gpus", "cpu:2"], "drafter-0=wrong-version");
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(4), "stderr:\n{}", sup.stderr());
    assert!(
        sup.stderr().contains("control protocol v999"),
        "{}",
        sup.stderr()
    );
}

#[test]
fn worker_dying_before_hello_is_restarted() {
    let sup = Sup::start(&["--gpus", "cpu:2"], "drafter-0@0=exit-early:5");
    let st = sup.wait_state("drafter-0 restarted", T, |s| {
        let w = worker(s, "drafter-0");
        w["restarts"] == 1 && w["state"] == "running"
    });
    assert_eq!(worker(&st, "drafter-0")["last_exit"], "exit code 5");
}

#[test]
fn time_limit_ends_the_run_with_exit_75() {
    let mut sup = Sup::start_real(&["--gpus", "cpu:2", "--time-limit", "1s"]);
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(75), "stderr:\n{}", sup.stderr());
    assert!(sup
        .events()
        .iter()
        .any(|e| e["event"] == "stop" && e["reason"] == "time limit reached"));
}

#[test]
fn a_typo_in_a_test_workers_behaviour_is_an_error() {
    let check = |spec: &str| {
        let out = std::process::Command::new(test_worker())
            .args(["--check-behavior", spec])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert_eq!(
        check("drafter-0@0=crash:3;target-1=bad-commit:empty,ignore-stop").0,
        Some(0)
    );
    for (spec, says) in [
        ("drafter-0=crahs:3", "unknown action 'crahs'"),
        ("drafter-0=crash", "takes a number"),
        ("drafter-0=ignore-stop:1", "takes no value"),
        ("target-0=bad-commit:too-lng", "takes one of"),
        ("target-0=bad-ack:stale", "takes one of"),
        ("drafter-0@x=crash:3", "restart after '@'"),
        ("draftr-0=crash:3", "not target-N or drafter-N"),
        ("drafter-0", "WORKER[@RESTART]=ACTION"),
    ] {
        let (code, stderr) = check(spec);
        assert_eq!(
            code,
            Some(dflash_shared::exit_codes::USAGE),
            "{spec} was accepted"
        );
        assert!(stderr.contains(says), "{spec}: {stderr}");
    }
    // The harness refuses it before starting anything.
    let refused =
        std::panic::catch_unwind(|| Sup::start(&["--gpus", "cpu:2"], "drafter-0=hang-afer:200"));
    assert!(
        refused.is_err(),
        "the harness started a run with a misspelt action"
    );
}

#[test]
fn a_worker_given_a_misspelt_action_stops_the_run() {
    // Past the harness's check (as if a test set the variable itself): the worker refuses
    // the spec as a permanent failure, so the run stops and says why, instead of idling.
    let worker_bin = test_worker();
    let mut sup = Sup::start_real_env(
        &[
            "--gpus",
            "cpu:2",
            "--worker-bin",
            worker_bin.to_str().unwrap(),
        ],
        &[("DFLASH_TEST_BEHAVIOR", "drafter-0=hang-afer:200")],
    );
    let status = sup.wait_exit(T);
    assert_ne!(status.code(), Some(0), "stderr:\n{}", sup.stderr());
    assert!(
        sup.stderr().contains("unknown action 'hang-afer'")
            || sup.log("drafter-0").contains("unknown action 'hang-afer'"),
        "stderr:\n{}\nlog:\n{}",
        sup.stderr(),
        sup.log("drafter-0")
    );
}
