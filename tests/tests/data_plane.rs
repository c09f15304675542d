//! The shared-memory data plane end to end: every batch consumed exactly once through
//! real worker processes, under bad messages and random SIGKILLs.

mod common;

use std::collections::HashMap;
use std::fs;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

fn consumed_by(records: &[Value]) -> HashMap<String, u64> {
    let mut m = HashMap::new();
    for r in records.iter().filter(|r| r["ev"] == "consumed") {
        *m.entry(r["worker"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    m
}

fn assert_clean_ledger(sup: &Sup) -> Value {
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "ledger audit failed: {a}");
    assert!(a["produced"].as_u64().unwrap() > 0);
    assert_eq!(a["produced"], a["consumed_once"], "{a}");
    assert_eq!(
        (
            a["lost"].as_u64(),
            a["duplicated"].as_u64(),
            a["in_flight"].as_u64()
        ),
        (Some(0), Some(0), Some(0)),
        "{a}"
    );
    assert_eq!(a["ended"], true);
    a
}

#[test]
fn demo_data_flows_through_targets_to_drafters_exactly_once_and_balanced() {
    let shm_before: Vec<_> = fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:4",
        "--targets",
        "2",
        "--data",
        "demo",
        "--epochs",
        "3",
        "--demo-samples",
        "300",
        "--max-seq-len",
        "32",
        "--token-budget",
        "256",
    ]);
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "stderr:\n{}", sup.stderr());
    assert!(sup.stderr().contains("all data consumed"));
    let a = assert_clean_ledger(&sup);
    let records = sup.ledger_records();
    let by_drafter = consumed_by(&records);
    assert_eq!(
        by_drafter.len(),
        2,
        "both drafters consumed: {by_drafter:?}"
    );
    let (lo, hi) = (
        by_drafter.values().min().unwrap(),
        by_drafter.values().max().unwrap(),
    );
    assert!(*lo * 3 >= *hi, "drafters badly unbalanced: {by_drafter:?}");
    let targets: std::collections::HashSet<&str> = records
        .iter()
        .filter(|r| r["ev"] == "hidden")
        .map(|r| r["worker"].as_str().unwrap())
        .collect();
    assert_eq!(targets.len(), 2, "both targets produced hidden states");
    assert_eq!(a["requeued"], 0);
    // Shared memory is anonymous: nothing was left behind in /dev/shm.
    let shm_after: Vec<_> = fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    let new: Vec<_> = shm_after
        .iter()
        .filter(|f| !shm_before.contains(f))
        .collect();
    assert!(
        new.iter().all(|f| !f.to_string_lossy().contains("dflash")),
        "{new:?}"
    );
}

/// Kills in the chaos test, and consumed batches between two of them.
const CHAOS_KILLS: u64 = 12;
const CHAOS_EVERY: u64 = 4;

#[test]
fn chaos_random_sigkills_lose_and_duplicate_nothing() {
    // Paced by progress, not by wall time: a kill lands only once the run has consumed
    // CHAOS_EVERY more batches since the last one and the victim is back up, so a slow
    // (loaded) machine gets fewer kills per second, never more kills per batch. The run
    // has several times the batches the kills need, so the last kill lands long before
    // the data runs out (a kill after the stop began would rightly be an unclean stop).
    let started = Instant::now();
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:4",
        "--targets",
        "2",
        "--data",
        "demo",
        "--epochs",
        "3",
        "--demo-samples",
        "512",
        "--max-seq-len",
        "32",
        "--token-budget",
        "256",
        "--max-restarts",
        "10000",
        "--stable-after",
        "50ms",
        "--hang-timeout",
        "20s",
    ]);
    sup.wait_running(4);
    // A small deterministic generator for which worker.
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    // drafter-1 dies again and again and rejoins from drafter-0's state; drafter-0 is
    // spared so that the run makes progress (losing both drafters rolls the group back:
    // tests/recovery.rs).
    let names = ["target-0", "target-1", "drafter-1", "target-0"];
    let consumed = |s: &Value| s["batches_consumed"].as_u64().unwrap_or(0);
    let (mut kills, mut kill_at) = (0, CHAOS_EVERY);
    // Each kill hits a process not killed before (state.json may lag behind a death).
    let mut killed = std::collections::HashSet::new();
    while kills < CHAOS_KILLS {
        let name = names[(next() % 4) as usize];
        let what = format!(
            "kill {} of {CHAOS_KILLS}: {kill_at} batches consumed and {name} running",
            kills + 1
        );
        let deadline = Instant::now() + T;
        let (st, pid) = loop {
            if let Some(status) = sup.child.try_wait().unwrap() {
                panic!(
                    "the run ended ({status}) after {kills} kills, before {what}; stderr:\n{}",
                    sup.stderr()
                );
            }
            if let Some(st) = sup.state() {
                let w = worker(&st, name);
                if st["phase"] == "running" && consumed(&st) >= kill_at && w["state"] == "running" {
                    if let Some(pid) = w["pid"].as_u64().filter(|p| !killed.contains(p)) {
                        break (st, pid as u32);
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "no progress in {T:?} waiting for {what}; state: {:?}\nstderr:\n{}",
                sup.state(),
                sup.stderr()
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        signal(pid, Signal::SIGKILL);
        killed.insert(pid as u64);
        kills += 1;
        kill_at = consumed(&st) + CHAOS_EVERY;
    }
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "stderr:\n{}", sup.stderr());
    let a = assert_clean_ledger(&sup);
    assert!(
        a["produced"].as_u64().unwrap() >= 2 * CHAOS_KILLS * CHAOS_EVERY,
        "the run was too short for its kills to land well before its end: {a}"
    );
    assert!(
        a["requeued"].as_u64().unwrap() > 0,
        "no kill caught a batch in flight: {a}"
    );
    let restarts: u64 = sup.state().unwrap()["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["restarts"].as_u64().unwrap())
        .sum();
    assert_eq!(restarts, kills, "every kill is one restart");
    eprintln!(
        "chaos: {kills} kills, {restarts} restarts in {:.1}s, ledger {a}",
        started.elapsed().as_secs_f64()
    );
}

fn violation_reasons(sup: &Sup) -> HashMap<String, String> {
    sup.events()
        .into_iter()
        .filter(|e| e["event"] == "protocol_violation")
        .map(|e| {
            (
                e["worker"].as_str().unwrap().to_string(),
                e["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn bad_acks_restart_only_the_offender_and_lose_nothing() {
    let mut sup = Sup::start(
        &["--gpus", "cpu:5", "--targets", "1", "--data", "demo", "--demo-samples", "200", "--max-seq-len", "32", "--token-budget", "256"],
        "drafter-0@0=bad-ack:stale-gen;drafter-1@0=bad-ack:out-of-range;drafter-2@0=bad-ack:wrong-batch;drafter-3@0=bad-ack:wrong-slot",
    );
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "stderr:\n{}", sup.stderr());
    assert_clean_ledger(&sup);
    let why = violation_reasons(&sup);
    assert!(why["drafter-0"].contains("stale generation"), "{why:?}");
    assert!(why["drafter-1"].contains("out of range"), "{why:?}");
    assert!(why["drafter-2"].contains("holds batch"), "{why:?}");
    assert!(!why["drafter-3"].is_empty());
    let st = sup.state().unwrap();
    for d in ["drafter-0", "drafter-1", "drafter-2", "drafter-3"] {
        assert_eq!(worker(&st, d)["restarts"], 1, "{d}");
    }
    assert_eq!(
        worker(&st, "target-0")["restarts"],
        0,
        "the target was disturbed"
    );
}

#[test]
fn bad_commits_restart_only_the_offender_and_lose_nothing() {
    let mut sup = Sup::start(
        &["--gpus", "cpu:5", "--targets", "3", "--data", "demo", "--demo-samples", "200", "--max-seq-len", "32", "--token-budget", "256"],
        "target-0@0=bad-commit:too-long;target-1@0=bad-commit:stale-gen;target-2@0=bad-commit:empty",
    );
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "stderr:\n{}", sup.stderr());
    assert_clean_ledger(&sup);
    let why = violation_reasons(&sup);
    assert!(
        why["target-0"].contains("exceeds the slot capacity"),
        "{why:?}"
    );
    assert!(why["target-1"].contains("stale generation"), "{why:?}");
    // An empty commit has its own reason, not "exceeds the slot capacity".
    assert!(why["target-2"].contains("length 0"), "{why:?}");
    assert!(!why["target-2"].contains("exceeds"), "{why:?}");
    let st = sup.state().unwrap();
    assert_eq!(worker(&st, "drafter-0")["restarts"], 0);
    assert_eq!(worker(&st, "drafter-1")["restarts"], 0);
}

fn jsonl(dir: &std::path::Path, name: &str, lines: &[&str]) -> String {
    let p = dir.join(name);
    fs::write(&p, lines.join("\n") + "\n").unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn bad_dataset_lines_are_skipped_and_reported_with_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let mut lines = vec![r#"{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}"#; 20];
    lines.insert(1, "not json at all");
    lines.insert(5, r#"{"input_ids": [1, 512]}"#);
    let data = jsonl(tmp.path(), "d.jsonl", &lines);
    let mut sup = Sup::start_real(&["--gpus", "cpu:2", "--data", &data]);
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "stderr:\n{}", sup.stderr());
    let err = sup.stderr();
    assert!(err.contains("d.jsonl:2: not JSON"), "{err}");
    assert!(err.contains("d.jsonl:6: token id >= vocab size"), "{err}");
    assert!(err.contains("22 lines read, 2 bad"), "{err}");
    // The preflight report, printed at start and kept in the run dir.
    assert!(
        err.contains("data preflight:") && err.contains("22 read, 20 kept, 2 dropped"),
        "{err}"
    );
    let pre: Value =
        serde_json::from_str(&std::fs::read_to_string(sup.run_dir.join("preflight.json")).unwrap())
            .unwrap();
    assert_eq!(
        (
            pre["lines"].as_u64(),
            pre["kept"].as_u64(),
            pre["complete"].as_bool()
        ),
        (Some(22), Some(20), Some(true)),
        "{pre}"
    );
    assert_eq!(pre["dropped"]["not JSON"], 1);
    assert_eq!(pre["duplicates"], 19, "every good line is the same sample");
    assert_eq!(pre["supervised_tokens"], 60);
    let a = assert_clean_ledger(&sup);
    let rows: u64 = sup
        .ledger_records()
        .iter()
        .filter(|r| r["ev"] == "load")
        .map(|r| r["rows"].as_u64().unwrap())
        .sum();
    assert_eq!(rows, 20, "every good line became a row: {a}");
}

#[test]
fn dataset_errors_exit_2_with_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = jsonl(tmp.path(), "bad.jsonl", &["x"; 5]);
    let empty = jsonl(tmp.path(), "empty.jsonl", &[]);
    let unsupervised = jsonl(
        tmp.path(),
        "unsupervised.jsonl",
        &[r#"{"input_ids": [1, 2, 3], "loss_mask": [1, 0, 1]}"#; 3],
    );
    for (data, needle) in [
        (bad.as_str(), "4 bad lines, more than --max-bad-lines 3"),
        (empty.as_str(), "no usable sample"),
        (unsupervised.as_str(), "nothing would be supervised"),
    ] {
        let mut sup = Sup::start_real(&["--gpus", "cpu:2", "--data", data, "--max-bad-lines", "3"]);
        let status = sup.wait_exit(T);
        assert_eq!(status.code(), Some(2), "{data}: stderr:\n{}", sup.stderr());
        let err = sup.stderr();
        let line = err
            .lines()
            .find(|l| l.starts_with("dflash-supervise: error:"))
            .unwrap_or_else(|| panic!("{err}"));
        assert!(line.contains(needle) && line.contains(data), "{line}");
    }
    let out = supervise(&["--gpus", "cpu:2", "--data", "/nonexistent/x.jsonl"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/x.jsonl"));
    let out = supervise(&["ledger", "--run-dir", tmp.path().to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(2), "a dir that is not a run");
}

#[test]
fn bench_ipc_prints_every_figure_and_ratio() {
    let out = supervise(&["bench", "ipc", "--json", "--quick"], None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    for k in [
        "memcpy_64mb_gbps",
        "pool_4mb_gbps",
        "pool_64mb_gbps",
        "pool_256mb_gbps",
        "ipc_channel_4mb_gbps",
        "ipc_channel_64mb_gbps",
        "ipc_channel_256mb_gbps",
        "handoff_p50_us",
        "handoff_p99_us",
        "futex_rtt_p50_us",
        "pool_vs_memcpy_64mb",
        "pool_vs_ipc_channel_64mb",
        "handoff_p50_vs_futex_rtt_p50",
    ] {
        let x = v[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k} missing in {v}"));
        assert!(x.is_finite() && x > 0.0, "{k} = {x}");
    }
    assert!(v["handoff_p99_us"].as_f64() >= v["handoff_p50_us"].as_f64());
}

#[test]
fn metrics_report_queue_health_balance_composition_and_the_bottleneck() {
    // One target feeding one drafter that trains about three times slower: the hidden-state
    // pool fills up and the targets wait on it.
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--steps",
        "40",
        "--metrics-interval",
        "500ms",
        "--no-gpu-metrics",
    ]);
    assert_eq!(sup.wait_exit(T).code(), Some(0), "{}", sup.stderr());
    let windows = read_jsonl(&sup.run_dir.join("metrics.jsonl"));
    assert!(windows.len() >= 3, "{} windows", windows.len());
    for w in &windows {
        let p = &w["pipeline"];
        for pool in ["tokens_pool", "hidden_pool"] {
            for k in [
                "fill_ratio",
                "producers_blocked_share",
                "consumers_starved_share",
            ] {
                let x = p[pool][k].as_f64().unwrap();
                assert!((0.0..=1.0 + 1e-9).contains(&x), "{pool}.{k} = {x}");
            }
        }
    }
    let busy: Vec<&Value> = windows
        .iter()
        .filter(|w| {
            w["pipeline"]["batches_per_worker"]["drafter-0"]
                .as_u64()
                .unwrap_or(0)
                > 0
        })
        .collect();
    assert!(!busy.is_empty());
    let eff = busy[0]["pipeline"]["padding_efficiency"].as_f64().unwrap();
    assert!(
        eff > 0.8 && eff <= 1.0,
        "length bucketing keeps padding low: {eff}"
    );
    assert!(
        busy[0]["pipeline"]["tokens_per_s_by_worker"]["target-0"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(
        windows.iter().any(|w| w["pipeline"]["bottleneck_hint"]
            .as_str()
            .is_some_and(|h| h.contains("add drafters"))),
        "the drafter-bound run is named as such: {:?}",
        windows
            .iter()
            .map(|w| w["pipeline"]["bottleneck_hint"].clone())
            .collect::<Vec<_>>()
    );
    assert!(windows.last().unwrap()["train"]["step"].as_u64().unwrap() >= 35);
    // Host-side phase timings reported by the workers themselves (in whichever windows
    // their reports landed).
    let phase = |w: &str, p: &str| {
        windows
            .iter()
            .filter_map(|x| x["pipeline"]["phase_ms_by_worker"][w][p].as_f64())
            .next()
    };
    assert!(phase("target-0", "forward").is_some_and(|ms| ms > 0.0));
    assert!(phase("drafter-0", "forward_backward").is_some_and(|ms| ms > 0.0));
    assert!(phase("drafter-0", "optimizer").is_some());
}
