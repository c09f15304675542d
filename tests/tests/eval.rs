//! Held-out evaluation (`--eval-data`, `--eval-every`) end to end, with real CPU workers
//! and the tiny target: eval records over the whole eval set, at eval steps and the last
//! step; the ledger untouched by eval batches; `checkpoints/best` at the best eval
//! acceptance, surviving `--keep-checkpoints 1`; the flags refused when they cannot work.
//! And `dflash-supervise eval` on prompts of two categories: τ per category that adds up
//! to the totals, the acceptance curve, and each prompt's id kept.

mod common;

use std::fs;
use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;

const T: Duration = Duration::from_secs(120);

/// `n` token lines of `len` tokens (ids below the tiny target's vocabulary), every token
/// supervised.
fn token_lines(path: &Path, n: usize, len: usize, salt: usize) -> u64 {
    let mut text = String::new();
    let mut tokens = 0;
    for i in 0..n {
        let ids: Vec<String> = (0..len)
            .map(|t| ((t * 7 + i * 13 + salt) % 500 + 1).to_string())
            .collect();
        let mask = vec!["1"; len];
        text.push_str(&format!(
            "{{\"input_ids\": [{}], \"loss_mask\": [{}]}}\n",
            ids.join(", "),
            mask.join(", ")
        ));
        tokens += len as u64;
    }
    fs::write(path, text).unwrap();
    tokens
}

#[test]
fn eval_every_two_steps_scores_the_whole_eval_set_and_keeps_the_best_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("train.jsonl");
    let eval = tmp.path().join("eval.jsonl");
    token_lines(&data, 200, 32, 0);
    // Lines of three lengths: the eval set is cut into batches as the data is.
    let eval_tokens = token_lines(&eval, 5, 24, 3) + {
        let more = tmp.path().join("more.jsonl");
        let t = token_lines(&more, 3, 40, 5);
        let mut all = fs::read_to_string(&eval).unwrap();
        all.push_str(&fs::read_to_string(&more).unwrap());
        fs::write(&eval, all).unwrap();
        t
    };
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:3",
        "--targets",
        "1",
        "--data",
        data.to_str().unwrap(),
        "--epochs",
        "2",
        "--steps",
        "6",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--eval-data",
        eval.to_str().unwrap(),
        "--eval-every",
        "2",
        "--checkpoint-every",
        "100",
        "--keep-checkpoints",
        "1",
    ]);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "stderr:\n{err}");
    let lines = read_jsonl(&sup.run_dir.join("train.jsonl"));
    let evals: Vec<&Value> = lines
        .iter()
        .map(|l| &l["eval"])
        .filter(|e| e.is_object())
        .collect();
    let steps: Vec<u64> = evals.iter().map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(
        steps,
        [2, 4, 6],
        "an eval every 2 steps, the last step's included:\n{evals:?}"
    );
    for e in &evals {
        // The whole eval set, every time.
        assert_eq!(e["tokens"].as_u64(), Some(eval_tokens), "{e}");
        assert!(e["blocks"].as_u64().unwrap() > 0, "{e}");
        assert!(e["loss"].as_f64().unwrap().is_finite(), "{e}");
        assert!(e["acceptance"].as_f64().unwrap() >= 1.0, "{e}");
    }
    // The same eval set and anchors each time: the blocks scored are the same.
    assert!(
        evals.iter().all(|e| e["blocks"] == evals[0]["blocks"]),
        "{evals:?}"
    );
    // Training records are unchanged: one per step.
    assert_eq!(lines.iter().filter(|l| l.get("step").is_some()).count(), 6);
    // One console line per eval; every report was of the eval step's weights (one of
    // other weights is a protocol violation, which restarts the worker).
    assert_eq!(err.matches("eval at step ").count(), 3, "{err}");
    assert!(
        !err.contains("invalid eval report") && !err.contains("restarted as pid"),
        "{err}"
    );
    // Eval batches never reach the optimizer, and the training batches' audit is clean.
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
    let contributions: u64 = lines
        .iter()
        .filter_map(|l| l["contributors"].as_u64())
        .sum();
    assert_eq!(a["consumed_once"].as_u64(), Some(contributions), "{a}");
    let records = sup.ledger_records();
    let eval_id = |r: &Value| r["batch"].as_u64().is_some_and(|b| b >= 1 << 62);
    assert!(
        !records.iter().any(|r| r["ev"] == "consumed" && eval_id(r)),
        "an eval batch was consumed"
    );
    assert_eq!(
        records.iter().filter(|r| r["ev"] == "evaluated").count() as u64,
        3 * evals[0]["batches"].as_u64().unwrap(),
        "every eval batch of every round scored once"
    );
    // checkpoints/best is the step of the best eval acceptance (the first of equals),
    // kept although --keep-checkpoints 1 prunes everything but the newest.
    let best = evals
        .iter()
        .fold(None::<&Value>, |b, e| match b {
            Some(b) if b["acceptance"].as_f64() >= e["acceptance"].as_f64() => Some(b),
            _ => Some(e),
        })
        .unwrap()["step"]
        .as_u64()
        .unwrap();
    let ckpts = sup.run_dir.join("checkpoints");
    let link = fs::read_link(ckpts.join("best")).expect("checkpoints/best is a link");
    assert_eq!(link, Path::new(&format!("step-{best:08}")));
    assert!(
        ckpts.join("best").join("meta.json").is_file(),
        "it points at a checkpoint"
    );
    assert!(
        ckpts.join("step-00000006").join("meta.json").is_file(),
        "the newest is kept"
    );
    let mut dirs: Vec<String> = fs::read_dir(&ckpts)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    dirs.sort();
    let mut want = vec![format!("step-{best:08}"), "step-00000006".to_string()];
    want.dedup();
    assert_eq!(dirs, want, "pruned to the newest, the best kept besides");
    // The report draws the evals beside the training curves, one point per eval.
    let html = fs::read_to_string(sup.run_dir.join("report.html")).unwrap();
    for class in ["eval-loss", "eval-acceptance"] {
        for step in [2, 4, 6] {
            assert!(
                html.contains(&format!(r#"<circle class="{class}" data-step="{step}""#)),
                "no {class} point at step {step} in the report"
            );
        }
    }
}

#[test]
fn eval_flags_that_cannot_work_are_refused_with_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let one_line = |args: &[&str], needles: &[&str]| {
        let out = supervise(args, Some(tmp.path()));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line, got:\n{err}");
        for n in needles {
            assert!(err.contains(n), "{args:?}: {err:?} does not mention {n:?}");
        }
    };
    one_line(
        &["--gpus", "cpu:2", "--eval-every", "2"],
        &["--eval-every 2", "--eval-data"],
    );
    let missing = tmp.path().join("missing.jsonl");
    one_line(
        &["--gpus", "cpu:2", "--eval-data", missing.to_str().unwrap()],
        &["--eval-data", "missing.jsonl", "cannot read"],
    );
    let empty = tmp.path().join("empty.jsonl");
    fs::write(&empty, "").unwrap();
    one_line(
        &["--gpus", "cpu:2", "--eval-data", empty.to_str().unwrap()],
        &["--eval-data", "empty.jsonl", "no usable sample"],
    );
    let eval = tmp.path().join("eval.jsonl");
    token_lines(&eval, 2, 16, 0);
    one_line(
        &[
            "--gpus",
            "cpu:2",
            "--eval-data",
            eval.to_str().unwrap(),
            "--eval-every",
            "0",
        ],
        &["--eval-every 0", "above 0"],
    );
    // Nothing was started: no run directory left behind.
    assert!(
        !fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("runs")),
        "a refused start left a run directory"
    );
}

#[test]
fn a_drafter_killed_during_an_eval_round_leaves_the_round_whole_and_the_ledger_clean() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("train.jsonl");
    let eval = tmp.path().join("eval.jsonl");
    token_lines(&data, 200, 32, 0);
    // Large enough that the round is still running when the kill lands.
    let eval_tokens = token_lines(&eval, 300, 48, 1);
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:3",
        "--targets",
        "1",
        "--data",
        data.to_str().unwrap(),
        "--epochs",
        "2",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--eval-data",
        eval.to_str().unwrap(),
        "--eval-every",
        "4",
    ]);
    wait_for("the eval round of step 4 to start", T, || {
        sup.stderr().contains("eval of step 4:").then_some(())
    });
    let st = sup.state().unwrap();
    signal(pid_of(&st, "drafter-1"), nix::sys::signal::Signal::SIGKILL);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "stderr:\n{err}");
    let lines = read_jsonl(&sup.run_dir.join("train.jsonl"));
    let evals: Vec<&Value> = lines
        .iter()
        .map(|l| &l["eval"])
        .filter(|e| e.is_object())
        .collect();
    let last = lines
        .iter()
        .filter_map(|l| l["step"].as_u64())
        .max()
        .unwrap();
    let steps: Vec<u64> = evals.iter().map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(steps.first(), Some(&4), "{steps:?}");
    assert_eq!(
        steps.last(),
        Some(&last),
        "the last step is evaluated at the data's end"
    );
    for e in &evals {
        assert_eq!(
            e["tokens"].as_u64(),
            Some(eval_tokens),
            "the whole set despite the kill: {e}"
        );
    }
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
    assert_eq!(a["lost"], 0, "{a}");
    assert_eq!(a["duplicated"], 0, "{a}");
    let best = sup.run_dir.join("checkpoints").join("best");
    assert!(
        best.join("meta.json").is_file(),
        "checkpoints/best points at a checkpoint"
    );
}

/// `dflash-supervise eval --prompts` whose lines carry ids, categories and datasets (as
/// users convert GSM8K or HumanEval): `--json` gives τ per category (the category, else
/// the dataset) whose prompt counts and pooled tokens and steps add up to the totals, the
/// acceptance curve per drafted position agreeing with the accepted lengths, and each
/// prompt's fields in its per-prompt entry; the text form has the table and the curve.
#[test]
fn eval_gives_tau_per_prompt_category_and_the_acceptance_curve() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--steps",
        "4",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    assert_eq!(sup.wait_exit(T).code(), Some(0), "{}", sup.stderr());
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.jsonl");
    let ids = |i: usize| -> Vec<usize> { (0..5 + i).map(|t| (t * 41 + i * 7 + 3) % 500).collect() };
    // Three math prompts (string ids), two coding prompts (number ids; the last has no
    // category, its dataset names it), a blank line.
    let lines = [
        serde_json::json!({"input_ids": ids(0), "id": "gsm8k-0", "category": "math", "dataset": "gsm8k"}),
        serde_json::json!({"input_ids": ids(1), "id": 17, "category": "coding", "dataset": "humaneval"}),
        serde_json::json!({"input_ids": ids(2), "id": "gsm8k-1", "category": "math", "dataset": "gsm8k"}),
        serde_json::json!({"input_ids": ids(3), "id": "math500-4", "category": "math", "dataset": "math-500"}),
        serde_json::json!({"input_ids": ids(4), "id": 18, "dataset": "coding"}),
    ];
    let mut text: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    text.insert(2, String::new());
    fs::write(&prompts, text.join("\n")).unwrap();
    let eval = |extra: &[&str]| {
        let run = sup.run_dir.to_str().unwrap().to_string();
        let (target, drafter) = (format!("{run}/target"), format!("{run}/drafter"));
        let mut args = vec![
            "eval",
            "--target",
            target.as_str(),
            "--drafter",
            drafter.as_str(),
            "--prompts",
            prompts.to_str().unwrap(),
            "--max-new-tokens",
            "16",
        ];
        args.extend_from_slice(extra);
        let o = supervise(&args, None);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert_eq!(
            o.status.code(),
            Some(0),
            "{out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        out
    };
    let r: Value = serde_json::from_str(&eval(&["--json"])).unwrap();
    let (n, bs) = (
        r["prompts"].as_u64().unwrap(),
        r["block_size"].as_u64().unwrap(),
    );
    assert_eq!(n, 5);
    let cats = r["per_category"].as_object().expect("per_category");
    let mut names: Vec<&String> = cats.keys().collect();
    names.sort();
    assert_eq!(names, ["coding", "math"], "{r}");
    assert_eq!(cats["math"]["prompts"], 3);
    assert_eq!(cats["coding"]["prompts"], 2);
    let sum = |k: &str| -> u64 { cats.values().map(|c| c["tau"][k].as_u64().unwrap()).sum() };
    assert_eq!(sum("tokens"), r["tau"]["tokens"].as_u64().unwrap());
    assert_eq!(
        sum("verify_steps"),
        r["tau"]["verify_steps"].as_u64().unwrap()
    );
    let pooled = r["tau"]["pooled"].as_f64().unwrap();
    assert!(
        (sum("tokens") as f64 / sum("verify_steps") as f64 - pooled).abs() < 1e-12,
        "{r}"
    );
    // Each prompt keeps its fields, in the file's order; each category's figures are its
    // prompts' accepted lengths.
    let per = r["per_prompt"].as_array().unwrap();
    for (p, l) in per.iter().zip(&lines) {
        for k in ["id", "category", "dataset"] {
            assert_eq!(p.get(k), l.get(k), "{k} of {p}");
        }
    }
    let accepted =
        |p: &Value| -> Vec<u64> { serde_json::from_value(p["accepted"].clone()).unwrap() };
    let math: Vec<u64> = [0, 2, 3].iter().flat_map(|&i| accepted(&per[i])).collect();
    assert_eq!(cats["math"]["tau"]["verify_steps"], math.len());
    assert_eq!(cats["math"]["tau"]["tokens"], math.iter().sum::<u64>());
    // The curve: for drafted positions 1..bs-1, the share of verify steps committing
    // more than the position, over all prompts and per category.
    let all: Vec<u64> = per.iter().flat_map(accepted).collect();
    let curve = |steps: &[u64]| -> Vec<f64> {
        (1..bs)
            .map(|k| steps.iter().filter(|&&a| a > k).count() as f64 / steps.len() as f64)
            .collect()
    };
    let got = |v: &Value| -> Vec<f64> { serde_json::from_value(v.clone()).unwrap() };
    assert_eq!(got(&r["acceptance_by_position"]), curve(&all));
    assert_eq!(got(&cats["math"]["acceptance_by_position"]), curve(&math));
    let sum_curve: f64 = got(&r["acceptance_by_position"]).iter().sum();
    assert!(
        (1.0 + sum_curve - pooled).abs() < 1e-9,
        "1 + the curve's sum is pooled τ"
    );
    // The text form: the curve on one line, the table with a row per category.
    let out = eval(&[]);
    assert!(
        out.contains(&format!("acceptance by drafted position 1..{}: ", bs - 1)),
        "{out}"
    );
    let row = |name: &str| {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row {name} in:\n{out}"))
            .to_string()
    };
    assert!(
        out.lines()
            .any(|l| l.starts_with("category") && l.contains("τ pooled")),
        "{out}"
    );
    let math_row = row("math");
    assert_eq!(math_row.split_whitespace().nth(1), Some("3"), "{math_row}");
    assert!(
        math_row.contains(&format!(
            "{:.3}",
            cats["math"]["tau"]["pooled"].as_f64().unwrap()
        )),
        "{math_row}"
    );
    assert_eq!(row("coding").split_whitespace().nth(1), Some("2"));
}
