//! `--targets auto` end to end (issue 44): CPU workers whose targets are made slow (a test
//! knob adds a second to every target batch), started (`--targets auto:1`) from a split
//! with one target and three drafters. The balancer moves drafters' devices to the target role while the run
//! trains, and then stays.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

const T: Duration = Duration::from_secs(240);

/// The moves made so far: (worker that left, worker that started).
fn moves(sup: &Sup) -> Vec<(String, String)> {
    sup.events()
        .iter()
        .filter(|e| e["event"] == "role_move")
        .map(|e| {
            (
                e["from"].as_str().unwrap_or("").to_string(),
                e["to"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

fn windows(sup: &Sup) -> Vec<Value> {
    read_jsonl(&sup.run_dir.join("metrics.jsonl"))
}

/// The trained tokens/s of the steady windows among `w` (those in which a step was
/// trained and in the one before), their mean.
fn trained(w: &[Value]) -> f64 {
    let steps: Vec<Option<u64>> = w.iter().map(|w| w["train"]["step"].as_u64()).collect();
    let v: Vec<f64> = (1..w.len())
        .filter(|&i| steps[i] > steps[i - 1] && steps[i - 1].is_some())
        .filter_map(|i| w[i]["pipeline"]["tokens_per_s_trained"].as_f64())
        .collect();
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

#[test]
fn slow_targets_get_devices_from_the_drafters_and_the_split_then_stays() {
    let mut sup = Sup::start_real_env(
        &[
            "--gpus",
            "cpu:4",
            "--targets",
            "auto:1",
            "--data",
            "demo",
            "--demo-samples",
            "100000",
            "--metrics-interval",
            "2s",
            "--checkpoint-every",
            "50",
        ],
        &[("DFLASH_TEST_BATCH_DELAY_MS", "1000")],
    );
    // The first move: a drafter's device to the target role.
    let first = wait_for("a first move", T, || moves(&sup).first().cloned());
    assert_eq!(first, ("drafter-2".into(), "target-1".into()));
    // Then it settles: twenty windows (forty seconds of training) after the last move
    // without another one, within a bounded number of moves.
    let settled = wait_for("the split to settle", T, || {
        let n = moves(&sup).len();
        assert!(n <= 3, "{n} moves: {:?}\n{}", moves(&sup), sup.stderr());
        let events = sup.events();
        let last = events.iter().rposition(|e| e["event"] == "role_move")?;
        let at = events[last]["time"].as_str()?.to_string();
        let after = windows(&sup)
            .into_iter()
            .filter(|w| w["time"].as_str().is_some_and(|t| t > at.as_str()))
            .count();
        (after >= 20 && moves(&sup).len() == n).then_some(n)
    });
    sup.signal(nix::sys::signal::Signal::SIGTERM);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(75), "{err}");
    let all = moves(&sup);
    assert_eq!(all.len(), settled, "no move after it settled: {all:?}");
    // Every move took a drafter's device for a target: the targets are the slow role.
    assert!(
        all.iter()
            .all(|(from, to)| from.starts_with("drafter") && to.starts_with("target")),
        "{all:?}"
    );
    let state = sup.state().unwrap();
    let running = |role: &str| {
        state["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["name"].as_str().unwrap().starts_with(role) && w["state"] != "moved")
            .count()
    };
    assert_eq!(
        (running("target"), running("drafter")),
        (1 + all.len(), 3 - all.len())
    );
    // Each move is in train.jsonl too, and the last window counts the workers per role.
    let w = windows(&sup);
    let moved = read_jsonl(&sup.run_dir.join("train.jsonl"))
        .into_iter()
        .filter(|l| l["role_move"].is_object())
        .count();
    assert_eq!(moved, all.len());
    let last = w.last().unwrap();
    assert_eq!(last["roles"]["target"], 1 + all.len() as u64, "{last}");
    assert_eq!(last["role_moves"], all.len() as u64, "{last}");
    // It trained faster at the end than at the start.
    let first_move = w
        .iter()
        .position(|x| x["workers"]["target-1"].is_object())
        .unwrap();
    let (start, end) = (trained(&w[..first_move]), trained(&w[w.len() - 15..]));
    assert!(
        end > 1.5 * start,
        "tokens/s trained: {start:.0} at the start, {end:.0} at the end"
    );
    // Nothing lost or trained twice across the moves, and training went on with the
    // current weights: steps in order, no rollback, no jump in the loss.
    let (code, audit) = sup.ledger();
    assert_eq!(code, 0, "ledger: {audit}");
    assert!(
        !sup.events().iter().any(|e| e["event"] == "rollback"),
        "{err}"
    );
    let train = read_jsonl(&sup.run_dir.join("train.jsonl"));
    let steps: Vec<u64> = train.iter().filter_map(|l| l["step"].as_u64()).collect();
    assert!(steps.windows(2).all(|s| s[1] == s[0] + 1), "steps in order");
    let loss: Vec<f64> = train.iter().filter_map(|l| l["loss"].as_f64()).collect();
    for e in sup.events().iter().filter(|e| e["event"] == "role_move") {
        // The steps trained just before and just after the move.
        let at = e["step"].as_u64().unwrap();
        let i = steps.iter().position(|&s| s > at).unwrap_or(steps.len());
        let before = &loss[i.saturating_sub(5)..i];
        let after = &loss[i..(i + 5).min(loss.len())];
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        assert!(
            mean(after) < 1.3 * mean(before),
            "loss {:.3} before the move at step {at}, {:.3} after",
            mean(before),
            mean(after)
        );
    }
}
