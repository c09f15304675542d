//! `--resume` checks what it continues (issue 20, cases 5 and 6): data changed since the run
//! started is refused unless `--allow-changed-data`; the operational settings of the run
//! (checkpoint interval, retention, time limit, ...) are kept without being given again; and
//! a newest checkpoint of another drafter, or with an edited meta.json, is set aside for the
//! one before it, from which the run completes with a clean ledger.

mod common;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Every run here is a few steps of the tiny target: well under this.
const T: Duration = Duration::from_secs(60);

/// Run `dflash-supervise ARGS` to completion, killed (and the test failed) after `T`.
fn run(args: &[&str]) -> Output {
    let tmp = tempfile::tempdir().unwrap();
    let (out, err) = (tmp.path().join("out"), tmp.path().join("err"));
    let mut child = Command::new(bin("dflash-supervise"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(fs::File::create(&out).unwrap())
        .stderr(fs::File::create(&err).unwrap())
        .spawn()
        .expect("start dflash-supervise");
    let deadline = Instant::now() + T;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "dflash-supervise {} did not end within {T:?}; stderr:\n{}",
                args.join(" "),
                fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: fs::read(&out).unwrap_or_default(),
        stderr: fs::read(&err).unwrap_or_default(),
    }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn expect_ok(o: &Output) -> String {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(0), "{e}");
    e
}

/// A run stopped before its end (its time limit): exit 75, resumable.
fn expect_stopped(o: &Output) -> String {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(75), "{e}");
    e
}

/// Pre-tokenized lines for the tiny target (ids below its vocabulary of 512), of 24 to 63
/// tokens, all supervised.
fn jsonl(lines: usize, seed: u64) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..lines)
        .map(|_| {
            let n = 24 + (next() % 40) as usize;
            let ids: Vec<String> = (0..n).map(|_| (next() % 500).to_string()).collect();
            format!(
                "{{\"input_ids\": [{}], \"loss_mask\": [{}]}}\n",
                ids.join(", "),
                vec!["1"; n].join(", ")
            )
        })
        .collect()
}

fn saved_run(rd: &Path) -> Value {
    serde_json::from_str(&fs::read_to_string(rd.join("run.json")).unwrap()).unwrap()
}

fn checkpoints(rd: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = fs::read_dir(rd.join("checkpoints"))
        .unwrap()
        .filter_map(|e| {
            e.unwrap()
                .file_name()
                .to_string_lossy()
                .strip_prefix("step-")
                .and_then(|n| n.parse().ok())
        })
        .collect();
    v.sort();
    v
}

fn last_step(rd: &Path) -> u64 {
    read_jsonl(&rd.join("train.jsonl"))
        .iter()
        .filter_map(|l| l["step"].as_u64())
        .next_back()
        .unwrap_or(0)
}

fn ledger_is_clean(rd: &Path) {
    let out = supervise(
        &["ledger", "--run-dir", rd.to_str().unwrap(), "--json"],
        None,
    );
    let a: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert_eq!(out.status.code(), Some(0), "{a}\n{}", stderr(&out));
    assert_eq!(
        (a["duplicated"].as_u64(), a["lost"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
}

const SMALL: [&str; 6] = [
    "--max-seq-len",
    "64",
    "--token-budget",
    "512",
    "--epochs",
    "20",
];

#[test]
fn data_changed_in_place_is_refused_naming_it_and_accepted_with_allow_changed_data() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("train.jsonl");
    fs::write(&data, jsonl(48, 1)).unwrap();
    let rd = tmp.path().join("run");
    let (ds, rds) = (data.to_str().unwrap(), rd.to_str().unwrap());
    let mut first = vec!["--gpus", "cpu:2", "--data", ds, "--steps", "3"];
    first.extend(["--checkpoint-every", "2", "--run-dir", rds]);
    first.extend(SMALL);
    expect_ok(&run(&first));
    let saved = saved_run(&rd);
    let canonical = data.canonicalize().unwrap();
    assert_eq!(
        saved["inputs"]["data"]["file"]["path"],
        canonical.to_str().unwrap(),
        "run.json fingerprints the data: {saved}"
    );
    let size = fs::metadata(&data).unwrap().len();

    // The file changed in place: more lines appended.
    fs::OpenOptions::new()
        .append(true)
        .open(&data)
        .unwrap()
        .write_all(jsonl(8, 2).as_bytes())
        .unwrap();
    let resume = ["--gpus", "cpu:2", "--resume", rds, "--steps", "5"];
    let out = run(&resume);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let want = format!(
        "--resume {rds}: the data file {} changed since the run started (size {size} → {}",
        canonical.display(),
        fs::metadata(&data).unwrap().len()
    );
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("--resume")).collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(
        lines[0].contains(&want)
            && lines[0]
                .ends_with("expected the same data, or --allow-changed-data to continue knowingly"),
        "{err}"
    );
    assert_eq!(last_step(&rd), 3, "nothing ran");

    // Accepted knowingly, with a warning; the data as it is now is what later resumes check.
    let mut allowed = resume.to_vec();
    allowed.push("--allow-changed-data");
    let err = expect_ok(&run(&allowed));
    assert!(
        err.contains("--allow-changed-data: the data file")
            && err.contains("continuing with the data as it is now"),
        "{err}"
    );
    assert!(err.contains("from the checkpoint of step 3"), "{err}");
    assert!(err.contains("drafter (step 5) written to"), "{err}");
    assert_eq!(last_step(&rd), 5);
    // Long enough that its loader runs past every batch the earlier lives loaded ahead (the
    // audit counts a batch loaded in an earlier life and in no later one as lost).
    let err = expect_ok(&run(&["--gpus", "cpu:2", "--resume", rds, "--steps", "12"]));
    assert!(!err.contains("changed since the run started"), "{err}");
    assert_eq!(last_step(&rd), 12);
    ledger_is_clean(&rd);
}

#[test]
fn a_resume_without_the_flags_keeps_the_saved_time_limit_checkpoint_interval_and_retention() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    let rds = rd.to_str().unwrap();
    // Far more steps than 8 s allow: the time limit ends each run.
    let mut first = vec!["--gpus", "cpu:2", "--data", "demo", "--steps", "100000"];
    first.extend(["--time-limit", "8s", "--checkpoint-every", "1"]);
    first.extend(["--keep-checkpoints", "50", "--hang-timeout", "45s"]);
    first.extend(["--run-dir", rds]);
    // Without --epochs: the data is cycled up to --steps.
    first.extend(&SMALL[..4]);
    let err = expect_stopped(&run(&first));
    assert!(err.contains("time limit 8s reached"), "{err}");
    let stopped = last_step(&rd);
    assert!(stopped >= 1, "it trained before its time limit: {err}");
    let saved = saved_run(&rd);
    assert_eq!(
        (
            &saved["time_limit"],
            &saved["checkpoint_every"],
            &saved["keep_checkpoints"],
            &saved["hang_timeout"]
        ),
        (
            &Value::from("8s"),
            &Value::from(1),
            &Value::from(50),
            &Value::from("45s")
        ),
        "{saved}"
    );

    // Resumed with none of them: the same time limit stops it again, and it checkpoints
    // every step and keeps them all (the defaults: one at the stop, three kept).
    let err = expect_stopped(&run(&["--gpus", "cpu:2", "--resume", rds]));
    assert!(err.contains("time limit 8s reached"), "{err}");
    let end = last_step(&rd);
    assert!(
        end > stopped + 1,
        "it trained a few steps: {stopped} → {end}\n{err}"
    );
    // Every step checkpointed, the newest 50 kept (across both lives).
    let ck = checkpoints(&rd);
    let want: Vec<u64> = (end.saturating_sub(49).max(1)..=end).collect();
    assert_eq!(ck, want, "{err}");
    assert!(ck.len() > 3, "more than the default 3 kept: {ck:?}");
    let saved = saved_run(&rd);
    assert_eq!(saved["time_limit"], "8s", "{saved}");
    assert_eq!(saved["checkpoint_every"], 1, "{saved}");

    // Given again, an operational flag wins and says so.
    let err = expect_stopped(&run(&[
        "--gpus",
        "cpu:2",
        "--resume",
        rds,
        "--time-limit",
        "3s",
        "--checkpoint-every",
        "0",
    ]));
    assert!(
        err.contains("--time-limit 3s replaces this run's 8s"),
        "{err}"
    );
    assert!(
        err.contains("--checkpoint-every 0 replaces this run's 1"),
        "{err}"
    );
    assert_eq!(saved_run(&rd)["time_limit"], "3s");
    ledger_is_clean(&rd);
}

/// Rewrite a checkpoint's meta.json through `f`; `finish`: with a correct meta checksum
/// again (as a writer of another run would), else as a hand edit leaves it.
fn edit_meta(dir: &Path, finish: bool, f: impl FnOnce(&mut Value)) {
    let p = dir.join("meta.json");
    let mut m: Value = serde_json::from_str(&fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut m);
    let text = if finish {
        dflash_shared::checkpoint::finish_meta(&m).unwrap()
    } else {
        serde_json::to_string_pretty(&m).unwrap()
    };
    fs::write(&p, text).unwrap();
}

#[test]
fn newest_checkpoints_of_another_drafter_or_edited_are_set_aside_and_the_run_completes() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    let rds = rd.to_str().unwrap();
    let mut first = vec!["--gpus", "cpu:2", "--data", "demo", "--steps", "6"];
    first.extend(["--checkpoint-every", "2", "--keep-checkpoints", "3"]);
    first.extend(["--run-dir", rds]);
    first.extend(SMALL);
    expect_ok(&run(&first));
    assert_eq!(checkpoints(&rd), [2, 4, 6]);
    let ck = |s: u64| -> PathBuf { rd.join("checkpoints").join(format!("step-{s:08}")) };
    let meta: Value =
        serde_json::from_str(&fs::read_to_string(ck(6).join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["format"], 1, "{meta}");
    assert!(meta["meta_checksum"].is_string(), "{meta}");
    assert_eq!(meta["checksum_algorithm"], "sha256", "{meta}");
    // The newest: another drafter's (a deeper one), with a valid meta checksum.
    edit_meta(&ck(6), true, |m| {
        let layers = m["drafter"]["layers"].as_u64().unwrap();
        m["drafter"]["layers"] = (layers + 1).into();
    });
    // The one before: its consumed count edited by hand.
    edit_meta(&ck(4), false, |m| {
        let below = m["supervisor"]["consumed_below"].as_u64().unwrap();
        m["supervisor"]["consumed_below"] = (below + 3).into();
    });

    let err = expect_ok(&run(&["--gpus", "cpu:2", "--resume", rds, "--steps", "8"]));
    for (s, why) in [
        (
            6,
            "a checkpoint of another drafter (layers 3, this run's 2)",
        ),
        (4, "meta.json changed after it was written"),
    ] {
        assert!(
            err.contains(&format!("not resuming from {}", ck(s).display())) && err.contains(why),
            "step {s}: {why}\n{err}"
        );
    }
    assert!(err.contains("from the checkpoint of step 2"), "{err}");
    assert!(err.contains("drafter (step 8) written to"), "{err}");
    assert_eq!(last_step(&rd), 8);
    // Set aside, not left to be pruned in place of good ones or met again.
    let aside = fs::read_dir(rd.join("refused-checkpoints"))
        .unwrap()
        .count();
    assert_eq!(aside, 2, "{err}");
    assert!(checkpoints(&rd).contains(&8), "{:?}", checkpoints(&rd));
    ledger_is_clean(&rd);
}

#[test]
fn the_tokenizer_given_at_the_start_is_used_again_by_a_resume_without_it() {
    let Some(tok) = qwen3_tokenizer() else { return };
    let tmp = tempfile::tempdir().unwrap();
    // A small target of Qwen3's vocabulary, without a tokenizer of its own.
    let target = tmp.path().join("target");
    let cfg = tmp.path().join("config.json");
    fs::write(
        &cfg,
        r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":32,"num_hidden_layers":4,
  "num_attention_heads":2,"num_key_value_heads":1,"head_dim":16,"intermediate_size":64,"rms_norm_eps":1e-6,
  "rope_theta":1000000.0,"vocab_size":151936,"tie_word_embeddings":true}"#,
    )
    .unwrap();
    let st = Command::new(bin("dflash-worker"))
        .arg("tiny-target")
        .arg("--out")
        .arg(&target)
        .arg("--config")
        .arg(&cfg)
        .status()
        .unwrap();
    assert!(st.success());
    let data = tmp.path().join("chat.jsonl");
    let lines: Vec<String> = (0..24)
        .map(|i| {
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("What is {i} times {i}?")},
                {"role": "assistant", "content": format!("{i} times {i} is {}; squaring a number multiplies it by itself.", i * i)}]})
            .to_string()
        })
        .collect();
    fs::write(&data, lines.join("\n") + "\n").unwrap();
    let rd = tmp.path().join("run");
    let (t, d, k, rds) = (
        target.to_str().unwrap(),
        data.to_str().unwrap(),
        tok.to_str().unwrap(),
        rd.to_str().unwrap(),
    );
    let mut first = vec![
        "--gpus",
        "cpu:2",
        "--target",
        t,
        "--data",
        d,
        "--tokenizer",
        k,
    ];
    first.extend([
        "--steps",
        "2",
        "--max-seq-len",
        "96",
        "--token-budget",
        "512",
    ]);
    first.extend([
        "--block-size",
        "4",
        "--max-anchors",
        "8",
        "--draft-layers",
        "1",
    ]);
    first.extend(["--epochs", "10", "--run-dir", rds]);
    expect_ok(&run(&first));
    let saved = saved_run(&rd);
    assert_eq!(saved["tokenizer"], k, "{saved}");
    assert!(
        saved["inputs"]["tokenizer"]["tokenizer_json"].is_string(),
        "{saved}"
    );
    // Before, the resume had no tokenizer and called every chat line bad.
    let err = expect_ok(&run(&["--gpus", "cpu:2", "--resume", rds, "--steps", "6"]));
    assert!(!err.contains("bad lines"), "{err}");
    assert!(err.contains("drafter (step 6) written to"), "{err}");
    ledger_is_clean(&rd);
}
