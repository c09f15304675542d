//! What a run says about its data and its workers: bad data lines count once however
//! many epochs read them, and a drafter's rank is the number in its name, in words.

mod common;

use std::fs;
use std::time::Duration;

use common::*;

const T: Duration = Duration::from_secs(60);

#[test]
fn bad_lines_count_once_however_many_epochs_read_them() {
    // 3 bad lines, a budget of 10: 5 epochs read them 15 times, and the run finishes.
    let tmp = tempfile::tempdir().unwrap();
    let mut lines = vec![r#"{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 1, 1, 1]}"#; 12];
    lines.insert(2, "not json");
    lines.insert(6, r#"{"input_ids": [1, 512]}"#);
    lines.insert(9, r#"{"loss_mask": [1]}"#);
    let data = tmp.path().join("d.jsonl");
    fs::write(&data, lines.join("\n") + "\n").unwrap();
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        data.to_str().unwrap(),
        "--max-bad-lines",
        "10",
        "--epochs",
        "5",
    ]);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "stderr:\n{err}");
    let st = sup.state().unwrap();
    assert_eq!(st["bad_lines"], 3, "{st}");
    assert!(err.contains("15 lines read, 3 bad"), "{err}");
    // Each later epoch says it skipped them again.
    for epoch in 2..=5 {
        assert!(
            err.contains(&format!(
                "epoch {epoch}: skipped the same 3 bad line(s) again (each counts once against --max-bad-lines 10; 3 so far)"
            )),
            "epoch {epoch}:\n{err}"
        );
    }
    // Each line is named with its file and line by the preflight and by the first epoch,
    // not again by the four after it.
    let d = data.display();
    for (at, why) in [(3, "not JSON"), (7, "token id >= vocab size")] {
        let line = format!("skipping {d}:{at}: {why}");
        assert_eq!(err.matches(&line).count(), 2, "{line}:\n{err}");
    }
}

#[test]
fn a_drafters_rank_is_the_number_in_its_name_whatever_order_they_connect_in() {
    // drafter-0 waits until drafter-1 is connected: drafter-1 joins first.
    let tmp = tempfile::tempdir().unwrap();
    let line = r#"{"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 1, 1, 1, 1, 1]}"#;
    let data = tmp.path().join("d.jsonl");
    fs::write(&data, [line; 16].join("\n") + "\n").unwrap();
    let mut sup = Sup::start(
        &[
            "--gpus",
            "cpu:3",
            "--targets",
            "1",
            "--data",
            data.to_str().unwrap(),
        ],
        "drafter-0=real-after:drafter-1",
    );
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "stderr:\n{}", sup.stderr());
    let (log0, log1) = (sup.log("drafter-0"), sup.log("drafter-1"));
    assert!(!log0.contains("did not connect"), "{log0}");
    // In words: "fresh", not Rust's `Fresh`.
    assert!(
        log0.contains("training: rank 0 joined at step 0") && log0.contains(" parameters, fresh)"),
        "drafter-0.log:\n{log0}"
    );
    assert!(
        log1.contains("training: rank 1 joined at step 0") && log1.contains(" parameters, fresh)"),
        "drafter-1.log:\n{log1}"
    );
    // drafter-1 really came first: the first group had rank 1 alone.
    let first = sup
        .events()
        .into_iter()
        .find(|e| e["event"] == "group_epoch")
        .unwrap();
    assert_eq!(first["ranks"], serde_json::json!([1]), "{first}");
}
