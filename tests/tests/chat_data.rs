//! A run on chat data, end to end: a Qwen3-vocabulary target (random weights) with Qwen3's
//! real tokenizer and chat template, `messages` and ShareGPT lines, the preflight report at
//! start, training, and a clean ledger. Needs the Qwen3 tokenizer test asset
//! (scripts/fetch_test_assets.sh): skips without it on a laptop, fails under CI.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const CONFIG: &str = r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":32,"num_hidden_layers":4,
  "num_attention_heads":2,"num_key_value_heads":1,"head_dim":16,"intermediate_size":64,"rms_norm_eps":1e-6,
  "rope_parameters":{"rope_type":"default","rope_theta":1000000.0},"vocab_size":151936,"tie_word_embeddings":true}"#;

#[test]
fn a_run_trains_on_chat_data_with_the_targets_own_template() {
    let Some(tok) = qwen3_tokenizer() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    target_with_tokenizer(&target, CONFIG, &tok);
    let mut lines = Vec::new();
    for i in 0..24 {
        let q = format!("Question {i}: what is {i} times {i}?");
        let a = format!(
            "{i} times {i} is {}. Multiplying a number by itself squares it.",
            i * i
        );
        lines.push(if i % 2 == 0 {
            serde_json::json!({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        } else {
            serde_json::json!({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": q}, {"from": "gpt", "value": a}]})
        }
        .to_string());
    }
    lines.insert(
        3,
        r#"{"conversations": [{"from": "bot", "value": "?"}]}"#.into(),
    );
    let data = tmp.path().join("chat.jsonl");
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let (t, d) = (target.display().to_string(), data.display().to_string());
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--target",
        &t,
        "--data",
        &d,
        "--steps",
        "3",
        "--max-seq-len",
        "96",
        "--token-budget",
        "512",
        "--block-size",
        "4",
        "--max-anchors",
        "8",
        "--draft-layers",
        "1",
    ]);
    let status = sup.wait_exit(Duration::from_secs(300));
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(
        err.contains("data preflight:")
            && err.contains("25 read, 24 kept, 1 dropped (unknown role: 1)"),
        "{err}"
    );
    let pre: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sup.run_dir.join("preflight.json")).unwrap())
            .unwrap();
    assert_eq!(
        (pre["chat_samples"].as_u64(), pre["marker_missing"].as_u64()),
        (Some(24), Some(0)),
        "{pre}"
    );
    assert_eq!(pre["assistant_header"], "<|im_start|>assistant\n");
    let share = pre["supervised_share"].as_f64().unwrap();
    assert!(
        share > 0.2 && share < 0.8,
        "the assistant replies only: {share}"
    );
    let steps = read_jsonl(&sup.run_dir.join("train.jsonl"));
    assert_eq!(steps.len(), 3, "three committed steps");
    assert!(steps
        .iter()
        .all(|s| s["loss"].as_f64().is_some_and(f64::is_finite)));
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "ledger audit failed: {a}");
    assert_eq!(
        (a["lost"].as_u64(), a["duplicated"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
    assert!(a["consumed_once"].as_u64().unwrap() >= 3, "{a}");
}

/// Issue 40: a tokenizer of another model (Qwen3's 151K tokens against a 512-token target)
/// is refused at the start in one line naming both sizes and both paths, not dropped line
/// by line.
#[test]
fn a_tokenizer_whose_ids_pass_the_targets_vocabulary_is_refused_at_the_start() {
    let Some(tok) = qwen3_tokenizer() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    let st = Command::new(bin("dflash-worker"))
        .arg("tiny-target")
        .arg("--out")
        .arg(&target)
        .status()
        .unwrap();
    assert!(st.success());
    let data = tmp.path().join("chat.jsonl");
    std::fs::write(
        &data,
        r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}"#,
    )
    .unwrap();
    let out = supervise(
        &[
            "--gpus",
            "cpu:2",
            "--target",
            target.to_str().unwrap(),
            "--tokenizer",
            tok.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--run-dir",
            tmp.path().join("run").to_str().unwrap(),
        ],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains("vocabulary of 512")
            && lines[0].contains("tokenizer.json")
            && lines[0].contains(target.to_str().unwrap()),
        "{err}"
    );
    assert!(!tmp.path().join("run").exists());
}

/// Issue 43: served-τ consistency. Chat data that says how it was rendered (`"thinking":
/// false`, as `regenerate` writes it) is rendered so; preflight.json and the export record
/// the chat template's hash and the thinking switch; `--eval-prompts` are rendered like
/// the data, and a prompt rendered otherwise is warned about once; `eval` renders like the
/// training data by default and warns once when told otherwise.
#[test]
fn the_datas_thinking_switch_and_template_travel_to_the_export_and_eval_warns_on_others() {
    let Some(tok) = qwen3_tokenizer() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    target_with_tokenizer(&target, CONFIG, &tok);
    let lines: Vec<String> = (0..12)
        .map(|i| {
            serde_json::json!({"thinking": false, "messages": [
                {"role": "user", "content": format!("What is {i} + {i}?")},
                {"role": "assistant", "content": format!("{i} + {i} is {}, since doubling adds a number to itself.", 2 * i)}]})
            .to_string()
        })
        .collect();
    let data = tmp.path().join("chat.jsonl");
    std::fs::write(&data, lines.join("\n")).unwrap();
    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        [
            r#"{"messages": [{"role": "user", "content": "What is 5 + 5?"}]}"#,
            r#"{"thinking": true, "messages": [{"role": "user", "content": "What is 6 + 6?"}]}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let run = tmp.path().join("run");
    let (t, d, p, r) = (
        target.to_str().unwrap(),
        data.to_str().unwrap(),
        prompts.to_str().unwrap(),
        run.to_str().unwrap(),
    );
    let o = supervise(
        &[
            "--gpus",
            "cpu:2",
            "--target",
            t,
            "--data",
            d,
            "--steps",
            "2",
            "--max-seq-len",
            "96",
            "--token-budget",
            "512",
            "--block-size",
            "4",
            "--max-anchors",
            "8",
            "--draft-layers",
            "1",
            "--eval-prompts",
            p,
            "--eval-max-new-tokens",
            "4",
            "--run-dir",
            r,
        ],
        None,
    );
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(0), "{err}");
    let warned =
        "chat prompts rendered with thinking off and on, but the training data with thinking off";
    assert_eq!(err.matches(warned).count(), 1, "{err}");
    let pre: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("preflight.json")).unwrap())
            .unwrap();
    assert_eq!(pre["thinking"], serde_json::json!({"off": 12}), "{pre}");
    let sha = pre["chat_template_sha256"].as_str().unwrap().to_string();
    assert_eq!(sha.len(), 64);
    let exported: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("drafter/config.json")).unwrap())
            .unwrap();
    let rec = &exported["dflash_rendering"];
    assert_eq!(
        (
            rec["thinking"].as_str(),
            rec["chat_template_sha256"].as_str()
        ),
        (Some("off"), Some(sha.as_str())),
        "{exported}"
    );
    // eval: the training's rendering by default (the line with its own switch aside).
    let one = tmp.path().join("one.jsonl");
    std::fs::write(
        &one,
        r#"{"messages": [{"role": "user", "content": "What is 5 + 5?"}]}"#,
    )
    .unwrap();
    let drafter = run.join("drafter");
    let eval = |extra: &[&str]| {
        let mut args = vec![
            "eval",
            "--drafter",
            drafter.to_str().unwrap(),
            "--prompts",
            one.to_str().unwrap(),
            "--max-new-tokens",
            "4",
        ];
        args.extend_from_slice(extra);
        let o = supervise(&args, None);
        let text = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(0), "{text}");
        text
    };
    let quiet = eval(&[]);
    assert!(!quiet.contains("warning"), "{quiet}");
    let told = eval(&["--thinking", "on"]);
    assert_eq!(
        told.matches("chat prompts rendered with thinking on, the training data with thinking off")
            .count(),
        1,
        "{told}"
    );
}
