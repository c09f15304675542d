//! `dflash-supervise regenerate` end to end: on a tiny target trained on a low-entropy
//! synthetic language (tests/python/synthetic_target.py), the regenerated continuations
//! equal transformers' `generate(do_sample=False)` token for token, ending at EOS or the
//! limit; a sampled regeneration whose worker and then supervisor are SIGKILLed midway and
//! which is run again writes every line exactly once, byte-identical to an uninterrupted
//! one; chat lines come back as conversations with every reply written again that
//! `prepare` takes; bad inputs are refused with one line and exit 2. The transformers and
//! chat parts skip on a laptop without torch/transformers or the Qwen3 tokenizer, and fail
//! under CI.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// The synthetic-language target, trained into `dir`.
fn synthetic_target(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/synthetic_target.py");
    let o = Command::new("python3")
        .arg(&script)
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "training the synthetic target failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn lines(p: &Path) -> Vec<Value> {
    fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn regenerate(args: &[&str]) -> std::process::Output {
    let mut all = vec!["regenerate"];
    all.extend_from_slice(args);
    supervise(&all, None)
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// transformers' greedy continuation of each prompt (EOS 1, at most `max_new` tokens).
const HF_GREEDY: &str = r#"
import json, sys, torch
from transformers import AutoModelForCausalLM
job = json.load(open(sys.argv[1]))
m = AutoModelForCausalLM.from_pretrained(job["target"], dtype=torch.float32).eval()
out = []
for p in job["prompts"]:
    g = m.generate(torch.tensor([p]), max_new_tokens=job["max_new"], do_sample=False,
                   eos_token_id=1, pad_token_id=0)
    out.append(g[0].tolist())
print(json.dumps(out))
"#;

/// One target trained for both checks (training it is most of their time).
#[test]
fn on_a_trained_target_regeneration_is_transformers_greedy_and_teaches_the_drafter_more() {
    if !have_torch() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    synthetic_target(&target);
    // The trained language ends some continuations early and not others.
    for engine in ["native", "torch"] {
        let finishes = greedy_equals_transformers(tmp.path(), &target, engine);
        assert!(
            finishes.iter().any(|f| f == "stop") && finishes.iter().any(|f| f == "length"),
            "{engine}: {finishes:?}"
        );
    }
    regenerated_data_gives_a_higher_tau(tmp.path(), &target);
}

/// The regenerated continuations, by the target on `engine` (native or torch: this tool's
/// decoding loop over transformers' forward and KV cache), are transformers'
/// `generate(do_sample=False)`'s. Each line's finish.
fn greedy_equals_transformers(tmp: &Path, target: &Path, engine: &str) -> Vec<String> {
    let prompts: Vec<Vec<u32>> = (0..16u32)
        .map(|i| (0..2 + i % 6).map(|k| 2 + (i * 13 + k * 29) % 62).collect())
        .collect();
    let data = tmp.join("prompts.jsonl");
    let text_in: Vec<String> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| json!({"input_ids": p, "id": format!("p{i}")}).to_string())
        .collect();
    fs::write(&data, text_in.join("\n")).unwrap();
    let out = tmp.join(format!("out-{engine}.jsonl"));
    let o = regenerate(&[
        "--target",
        target.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-new-tokens",
        "24",
        "--gpus",
        "cpu:2",
        "--target-engine",
        engine,
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let got = lines(&out);
    assert_eq!(got.len(), prompts.len());
    let job = tmp.join("job.json");
    fs::write(
        &job,
        json!({"target": target, "prompts": prompts, "max_new": 24}).to_string(),
    )
    .unwrap();
    let o = Command::new("python3")
        .args(["-c", HF_GREEDY])
        .arg(&job)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want: Vec<Vec<u32>> = serde_json::from_slice(&o.stdout).unwrap();
    let mut finishes = Vec::new();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g["id"], format!("p{i}"), "input order and fields kept");
        let ids: Vec<u32> = serde_json::from_value(g["input_ids"].clone()).unwrap();
        assert_eq!(
            &ids,
            w,
            "{engine}: line {}: transformers' greedy continuation",
            i + 1
        );
        let mask: Vec<u8> = serde_json::from_value(g["loss_mask"].clone()).unwrap();
        let n = prompts[i].len();
        assert!(mask[..n].iter().all(|&m| m == 0) && mask[n..].iter().all(|&m| m == 1));
        finishes.push(g["regenerated"]["finish"][0].as_str().unwrap().to_string());
        if finishes[i] == "stop" {
            assert_eq!(ids.last(), Some(&1), "a stopped reply ends with EOS");
        } else {
            assert_eq!(ids.len() - n, 24);
        }
    }
    finishes
}

/// A family only the torch engine serves (gpt-oss: sliding-window and full attention,
/// attention sinks, experts): `auto` regenerates on the torch engine, and the
/// continuations are transformers' `generate(do_sample=False)`'s.
#[test]
fn a_family_only_the_torch_engine_serves_regenerates_as_transformers_generates() {
    if !have_torch() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("gpt_oss");
    let o = Command::new("python3")
        .args(["-c", GPT_OSS])
        .arg(&target)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let finishes = greedy_equals_transformers(tmp.path(), &target, "auto");
    assert_eq!(finishes.len(), 16);
}

/// A tiny random gpt-oss (EOS 1, as HF_GREEDY stops at it), its sliding window shorter
/// than prompt and reply together.
const GPT_OSS: &str = r#"
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
cfg = AutoConfig.for_model("gpt_oss", vocab_size=64, hidden_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
    num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
    eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
AutoModelForCausalLM.from_config(cfg).save_pretrained(sys.argv[1])
"#;

/// The synthetic language's successor rule: the target's (`a` 7, `b` 5), or another.
fn successor(t: u32, a: u32, b: u32) -> u32 {
    2 + (a * (t - 2) + b) % 62
}

/// A drafter trained on data the target regenerated accepts more than one trained on data
/// written by another hand (here: another rule of succession, as human-written data differs
/// from what the target would say). Training data: the same prompts, continued by the other
/// rule or by the target itself; τ measured on held-out prompts.
fn regenerated_data_gives_a_higher_tau(tmp: &Path, target: &Path) {
    let mut rng = 11u64;
    let mut next = |n: u32| {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((rng >> 33) % n as u64) as u32
    };
    let (mut prompts, mut original, mut held) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..316 {
        let p: Vec<u32> = (0..3 + next(4)).map(|_| 2 + next(62)).collect();
        if i >= 300 {
            held.push(json!(p).to_string());
            continue;
        }
        let mut t = *p.last().unwrap();
        let mut c = Vec::new();
        for _ in 0..60 {
            t = if next(10) < 9 {
                successor(t, 11, 3)
            } else {
                2 + next(62)
            };
            c.push(t);
        }
        let mask: Vec<u8> = (0..p.len() + c.len())
            .map(|k| u8::from(k >= p.len()))
            .collect();
        let ids: Vec<u32> = p.iter().chain(&c).copied().collect();
        original.push(json!({"input_ids": ids, "loss_mask": mask}).to_string());
        prompts.push(json!({"input_ids": p}).to_string());
    }
    let write = |name: &str, lines: &[String]| {
        let p = tmp.join(name);
        fs::write(&p, lines.join("\n")).unwrap();
        p
    };
    let (p, orig, held) = (
        write("tau-prompts.jsonl", &prompts),
        write("original.jsonl", &original),
        write("held-out.jsonl", &held),
    );
    let regen = tmp.join("regenerated.jsonl");
    let t = target.to_str().unwrap();
    let o = regenerate(&[
        "--target",
        t,
        "--data",
        p.to_str().unwrap(),
        "--out",
        regen.to_str().unwrap(),
        "--max-new-tokens",
        "60",
        "--gpus",
        "cpu:2",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let tau = |data: &Path, name: &str| -> f64 {
        let run = tmp.join(name);
        let o = supervise(
            &[
                "--target",
                t,
                "--data",
                data.to_str().unwrap(),
                "--gpus",
                "cpu:2",
                "--steps",
                "150",
                "--run-dir",
                run.to_str().unwrap(),
            ],
            None,
        );
        assert!(o.status.success(), "{name}: {}", text(&o));
        let drafter = run.join("drafter");
        let o = supervise(
            &[
                "eval",
                "--drafter",
                drafter.to_str().unwrap(),
                "--prompts",
                held.to_str().unwrap(),
                "--max-new-tokens",
                "32",
                "--json",
            ],
            None,
        );
        assert!(o.status.success(), "{name}: {}", text(&o));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        v["tau"]["pooled"].as_f64().unwrap()
    };
    let (before, after) = (tau(&orig, "on-original"), tau(&regen, "on-regenerated"));
    println!("τ (pooled) on held-out prompts: trained on the original data {before:.3}, on the regenerated data {after:.3}");
    assert!(
        after > before + 0.5,
        "regenerated data should teach the drafter more: τ {before:.3} → {after:.3}"
    );
}

fn token_prompts(path: &Path, n: usize) {
    let text: Vec<String> = (0..n)
        .map(|i| {
            let ids: Vec<usize> = (0..3 + i % 5).map(|k| (i * 37 + k * 11) % 500).collect();
            json!({"input_ids": ids, "n": i}).to_string()
        })
        .collect();
    fs::write(path, text.join("\n")).unwrap();
}

fn journal_records(out: &Path) -> usize {
    let j = PathBuf::from(format!("{}.partial", out.display()));
    fs::read_to_string(j)
        .map(|t| t.lines().count().saturating_sub(1))
        .unwrap_or(0)
}

#[test]
fn a_killed_regeneration_continued_writes_each_line_exactly_once() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("p.jsonl");
    let n = 240;
    token_prompts(&data, n);
    let args = |out: &Path| -> Vec<String> {
        [
            "regenerate",
            "--target",
            "tiny",
            "--data",
            data.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--max-new-tokens",
            "48",
            "--temperature",
            "0.9",
            "--top-p",
            "0.95",
            "--seed",
            "3",
            "--gpus",
            "cpu:2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let whole = tmp.path().join("whole.jsonl");
    let o = Command::new(bin("dflash-supervise"))
        .args(args(&whole))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = tmp.path().join("out.jsonl");
    let mut sup = Command::new(bin("dflash-supervise"))
        .args(args(&out))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = sup.id();
    // A worker killed midway: started again, its prompt sent again.
    wait_for("10 lines done", Duration::from_secs(60), || {
        (journal_records(&out) >= 10).then_some(())
    });
    let worker = children(pid)[0];
    signal(worker, nix::sys::signal::Signal::SIGKILL);
    wait_for("a new worker", Duration::from_secs(30), || {
        let c = children(pid);
        (c.len() == 2 && !c.contains(&worker)).then_some(())
    });
    // Then the supervisor itself, with lines still to do.
    let before = journal_records(&out);
    wait_for("more lines done", Duration::from_secs(60), || {
        (journal_records(&out) > before).then_some(())
    });
    signal(pid, nix::sys::signal::Signal::SIGKILL);
    sup.wait().unwrap();
    let done = journal_records(&out);
    assert!(
        !out.exists() && done < n,
        "killed midway: {done} of {n} done"
    );
    // Its workers died with it.
    wait_for("the workers gone", Duration::from_secs(30), || {
        children(pid).is_empty().then_some(())
    });
    let o = Command::new(bin("dflash-supervise"))
        .args(args(&out))
        .output()
        .unwrap();
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    assert!(
        said.contains("continuing") && said.contains("lines done before"),
        "{said}"
    );
    // Every line once, in order, and what the uninterrupted run wrote, byte for byte
    // (sampling draws from a generator per line and turn).
    let got = lines(&out);
    assert_eq!(got.len(), n);
    assert!(got.iter().enumerate().all(|(i, l)| l["n"] == i));
    assert_eq!(fs::read(&out).unwrap(), fs::read(&whole).unwrap());
    assert!(!PathBuf::from(format!("{}.partial", out.display())).exists());
    // Sampling at all: another seed writes other tokens.
    let other = tmp.path().join("other.jsonl");
    let mut a = args(&other);
    let at = a.iter().position(|s| s == "--seed").unwrap();
    a[at + 1] = "4".into();
    let o = Command::new(bin("dflash-supervise"))
        .args(&a)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_ne!(fs::read(&other).unwrap(), fs::read(&whole).unwrap());
}

#[test]
fn a_stopped_regeneration_exits_75_and_the_same_command_continues_it() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("p.jsonl");
    let n = 240;
    token_prompts(&data, n);
    let out = tmp.path().join("out.jsonl");
    let args = [
        "regenerate",
        "--target",
        "tiny",
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-new-tokens",
        "48",
        "--gpus",
        "cpu:2",
    ];
    let sup = Command::new(bin("dflash-supervise"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = sup.id();
    wait_for("5 lines done", Duration::from_secs(60), || {
        (journal_records(&out) >= 5).then_some(())
    });
    signal(pid, nix::sys::signal::Signal::SIGTERM);
    let o = sup.wait_with_output().unwrap();
    let said = text(&o);
    assert_eq!(o.status.code(), Some(75), "{said}");
    assert!(
        said.contains("stopped by SIGTERM") && said.contains("the same command continues"),
        "{said}"
    );
    assert!(!out.exists());
    let done = journal_records(&out);
    assert!((5..n).contains(&done), "{done}");
    let o = Command::new(bin("dflash-supervise"))
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("{done} of {n} lines done before")),
        "{}",
        text(&o)
    );
    let got = lines(&out);
    assert_eq!(got.len(), n);
    assert!(got.iter().enumerate().all(|(i, l)| l["n"] == i));
}

#[test]
fn bad_inputs_are_refused_with_one_line_and_nothing_is_overwritten() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("p.jsonl");
    token_prompts(&data, 3);
    let out = tmp.path().join("out.jsonl");
    fs::write(&out, "mine\n").unwrap();
    let d = data.to_str().unwrap();
    let o_ = out.to_str().unwrap();
    let chat = tmp.path().join("chat.jsonl");
    fs::write(
        &chat,
        r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
    )
    .unwrap();
    let fresh = tmp.path().join("fresh.jsonl");
    let f = fresh.to_str().unwrap();
    for (args, want) in [
        (
            vec!["--target", "tiny", "--data", d, "--out", o_],
            "already exists",
        ),
        (
            vec!["--target", "tiny", "--data", d, "--out", d],
            "is --data itself",
        ),
        (
            vec![
                "--target",
                "tiny",
                "--data",
                "/nonexistent/p.jsonl",
                "--out",
                f,
            ],
            "--data /nonexistent/p.jsonl",
        ),
        (
            vec!["--target", "/nonexistent", "--data", d, "--out", f],
            "no config.json",
        ),
        (
            vec![
                "--target",
                "tiny",
                "--data",
                chat.to_str().unwrap(),
                "--out",
                f,
            ],
            "no tokenizer",
        ),
        (
            vec!["--target", "tiny", "--data", d, "--out", f, "--top-p", "0"],
            "--top-p 0",
        ),
        (
            vec![
                "--target", "tiny", "--data", d, "--out", f, "--gpus", "cpu:0",
            ],
            "cpu:0",
        ),
    ] {
        let o = regenerate(&args);
        let e = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
        assert!(e.contains(want), "{args:?}: {e}");
        assert_eq!(e.trim().lines().count(), 1, "{args:?}: {e}");
    }
    assert_eq!(fs::read_to_string(&out).unwrap(), "mine\n");
    assert!(!fresh.exists());
    // A journal left under other settings is not continued with these.
    fs::write(
        format!("{f}.partial"),
        "{\"regenerate\":1,\"settings\":{\"target\":\"tiny\",\"target_config\":null,\"data\":\"x\",\"data_sha256\":\"0\",\"max_new_tokens\":1,\"temperature\":0.0,\"top_p\":1.0,\"seed\":0,\"thinking\":null,\"max_seq_len\":4096,\"chat_template\":null}}\n",
    )
    .unwrap();
    let o = regenerate(&["--target", "tiny", "--data", d, "--out", f]);
    let e = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("other settings") && e.contains("give the same flags"),
        "{e}"
    );
    // Neither the journal of those settings nor anything else was removed or made.
    assert!(fs::read_to_string(format!("{f}.partial"))
        .unwrap()
        .contains("\"data\":\"x\""));
    assert!(!fresh.exists());
    assert_eq!(fs::read_to_string(&out).unwrap(), "mine\n");
}

const QWEN_VOCAB_CONFIG: &str = r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":32,"num_hidden_layers":2,
  "num_attention_heads":2,"num_key_value_heads":1,"head_dim":16,"intermediate_size":64,"rms_norm_eps":1e-6,
  "max_position_embeddings":4096,"eos_token_id":151645,
  "rope_parameters":{"rope_type":"default","rope_theta":1000000.0},"vocab_size":151936,"tie_word_embeddings":true}"#;

#[test]
fn chat_lines_come_back_with_every_reply_written_again_and_prepare_takes_them() {
    let Some(tok) = qwen3_tokenizer() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    target_with_tokenizer(&target, QWEN_VOCAB_CONFIG, &tok);
    let data = tmp.path().join("chat.jsonl");
    fs::write(
        &data,
        [
            r#"{"id": "two-turns", "category": "math", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "ORIGINAL-1"}, {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "ORIGINAL-2"}]}"#,
            r#"{"conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "ORIGINAL-3"}]}"#,
            r#"{"messages": [{"role": "user", "content": "A question with no reply yet"}]}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let out = tmp.path().join("out.jsonl");
    let t = target.to_str().unwrap();
    let o = regenerate(&[
        "--target",
        t,
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-new-tokens",
        "6",
        "--thinking",
        "off",
        "--gpus",
        "cpu:1",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let got = lines(&out);
    assert_eq!(got.len(), 3);
    assert!(!fs::read_to_string(&out).unwrap().contains("ORIGINAL"));
    let roles = |l: &Value| -> Vec<String> {
        l["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        roles(&got[0]),
        ["system", "user", "assistant", "user", "assistant"]
    );
    assert_eq!(got[0]["messages"][3]["content"], "And 3 + 3?");
    assert_eq!(
        (&got[0]["id"], &got[0]["category"]),
        (&json!("two-turns"), &json!("math"))
    );
    assert_eq!(roles(&got[1]), ["user", "assistant"]);
    assert_eq!(got[1]["messages"][0]["content"], "Hello there");
    assert_eq!(
        roles(&got[2]),
        ["user", "assistant"],
        "a prompt gets its reply"
    );
    for l in &got {
        assert_eq!(l["thinking"], json!(false), "{l}");
        let n = l["regenerated"]["new_tokens"].as_array().unwrap();
        assert_eq!(
            n.len(),
            roles(l).iter().filter(|r| *r == "assistant").count()
        );
        assert!(
            n.iter().all(|k| (1..=6).contains(&k.as_u64().unwrap())),
            "{l}"
        );
    }
    // What a run takes: `prepare` renders every line.
    let prepared = tmp.path().join("prepared.jsonl");
    let o = supervise(
        &[
            "prepare",
            "--target",
            t,
            "--data",
            out.to_str().unwrap(),
            "--out",
            prepared.to_str().unwrap(),
        ],
        None,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(lines(&prepared).len(), 3, "{}", text(&o));
}
