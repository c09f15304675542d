//! Liveness vs slowness, with the real worker: a step longer than --hang-timeout is not a
//! hang (heartbeats come from a thread that does not wait for compute); a step longer than
//! --step-timeout is, and the kill says how long the step took and what to change.
//!
//! A real step is made slow by the worker's test-only DFLASH_TEST_STEP_DELAY_MS (every
//! drafter step waits that long more), so it exceeds the timeouts by seconds on any
//! machine, however fast or loaded.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

const T: Duration = Duration::from_secs(60);
/// How much longer every drafter step is made.
const DELAY: (&str, &str) = ("DFLASH_TEST_STEP_DELAY_MS", "5000");

fn small_run(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--demo-samples",
        "64",
        "--max-seq-len",
        "32",
        "--token-budget",
        "256",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn of_kind<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["event"] == kind).collect()
}

#[test]
fn drafter_steps_longer_than_the_hang_timeout_are_no_hang_and_the_run_finishes() {
    // No restart allowed: a step killed as a hang ends the run (exit 1) at once.
    let args = small_run(&[
        "--steps",
        "2",
        "--hang-timeout",
        "3s",
        "--max-restarts",
        "0",
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut sup = Sup::start_real_env(&args, &[DELAY]);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "stderr:\n{err}");
    let ev = sup.events();
    assert!(of_kind(&ev, "hang").is_empty(), "{ev:?}");
    assert!(of_kind(&ev, "restart").is_empty(), "{ev:?}");
    assert_eq!(
        read_jsonl(&sup.run_dir.join("train.jsonl")).len(),
        2,
        "both steps trained"
    );
    // Slow, and said so rather than silence.
    let slow = of_kind(&ev, "slow_step");
    assert!(
        slow.iter()
            .any(|e| e["worker"] == "drafter-0"
                && e["work"].as_str().unwrap().starts_with("step 1 ")),
        "{ev:?}"
    );
    let log = std::fs::read_to_string(sup.run_dir.join("supervisor.log")).unwrap();
    assert!(
        log.contains("drafter-0: step 1 (batch ")
            && log.contains(
                "so far (no step has finished yet); not a hang (--step-timeout 10m by default)"
            ),
        "{log}"
    );
}

#[test]
fn a_step_over_the_step_timeout_is_killed_naming_the_step_time_and_the_flag() {
    let args = small_run(&[
        "--steps",
        "2",
        "--hang-timeout",
        "3s",
        "--step-timeout",
        "4s",
        "--max-restarts",
        "0",
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut sup = Sup::start_real_env(&args, &[DELAY]);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(
        status.code(),
        Some(1),
        "the restart budget spent; stderr:\n{err}"
    );
    let ev = sup.events();
    let hangs = of_kind(&ev, "hang");
    assert_eq!(hangs.len(), 1, "{ev:?}");
    let h = hangs[0];
    assert_eq!(h["worker"], "drafter-0");
    assert!(h["work"].as_str().unwrap().starts_with("step 1 "), "{h}");
    assert_eq!(h["step_timeout_s"].as_f64(), Some(4.0));
    let reason = h["reason"].as_str().unwrap();
    for words in [
        "hung: in step 1 (batch ",
        " for ",
        "over --step-timeout 4s (no step has finished yet)",
        "raise --step-timeout",
        "--token-budget or --max-anchors",
    ] {
        assert!(reason.contains(words), "{words:?} not in {reason:?}");
    }
    // The console line, the worker's exit and its log say the same.
    assert!(err.contains(reason), "stderr:\n{err}");
    let exit = of_kind(&ev, "exit")
        .into_iter()
        .find(|e| e["worker"] == "drafter-0")
        .unwrap();
    assert_eq!(exit["killed_for"], reason);
    assert!(sup.log("drafter-0").contains(reason));
}
