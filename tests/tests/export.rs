//! The exported drafter loads with transformers (`AutoModel.from_pretrained(dir,
//! trust_remote_code=True)`) and computes what the Rust drafter computed: `dflash-supervise
//! export-check` after a short run, on the tiny target and on ones with Llama-3 and YaRN
//! rope scaling, and on exports corrupted on purpose. Needs Python with torch and transformers
//! (CPU); skipped with a message where they are missing, except under CI (`CI` set), where
//! .ci/run installs them and a missing package fails the test.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::*;

const TOLERANCE: f64 = 1e-3;

fn python() -> String {
    std::env::var("DFLASH_PYTHON")
        .ok()
        .filter(|p| !p.trim().is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// True when torch and transformers import; false (skip) on a laptop without them; a
/// failure under CI.
fn have_torch_transformers(test: &str) -> bool {
    let ok = Command::new(python())
        .args(["-c", "import torch, transformers"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        assert!(std::env::var_os("CI").is_none(), "torch/transformers missing for {}: under CI this test may not skip (.ci/run installs them)", python());
        eprintln!("SKIPPED {test}: Python torch and transformers are not installed (python3 -m pip install torch transformers)");
    }
    ok
}

/// `dflash-supervise export-check DIR`, with transformers' module cache kept in `scratch`.
fn export_check(dir: &Path, scratch: &Path, python: Option<&Path>) -> Output {
    let mut cmd = Command::new(bin("dflash-supervise"));
    cmd.arg("export-check")
        .arg(dir)
        .env("HF_MODULES_CACHE", scratch.join("hf-modules"))
        .env("HF_HUB_OFFLINE", "1");
    if let Some(p) = python {
        cmd.env("DFLASH_PYTHON", p);
    }
    cmd.output().expect("run dflash-supervise export-check")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The error figure of the verdict line (`ok: max relative error 3.1e-07 ...`).
fn error_figure(o: &Output) -> f64 {
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out
        .lines()
        .find(|l| {
            l.starts_with("ok: max relative error ") || l.starts_with("FAIL: max relative error ")
        })
        .unwrap_or_else(|| panic!("no verdict line: {}", text(o)));
    line.split_whitespace()
        .nth(4)
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("no number in {line:?}"))
}

/// Train a few steps (demo data) against `target` (None: the built-in tiny target) and
/// return the run (its export is RUN_DIR/drafter).
fn train(target: Option<&Path>) -> Sup {
    let mut args = vec![
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
    ];
    let t;
    if let Some(p) = target {
        t = p.display().to_string();
        args.extend(["--target", &t]);
    }
    let mut sup = Sup::start_real(&args);
    assert_eq!(
        sup.wait_exit(Duration::from_secs(120)).code(),
        Some(0),
        "{}",
        sup.stderr()
    );
    // The model directory holds only what a model hub should receive; the parity probe
    // lies beside it.
    let mut held: Vec<String> = std::fs::read_dir(sup.run_dir.join("drafter"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    held.sort();
    assert_eq!(
        held,
        ["config.json", "dflash_drafter.py", "model.safetensors"],
        "the export holds the model and nothing else"
    );
    assert!(
        sup.run_dir.join("drafter.probe.safetensors").is_file(),
        "the parity probe is beside the export"
    );
    sup
}

/// A copy of an export, with the parity probe beside it.
fn copy_dir(from: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    std::fs::copy(
        dflash_shared::checkpoint::probe_path(from),
        dflash_shared::checkpoint::probe_path(to),
    )
    .unwrap();
    to.to_path_buf()
}

/// Rewrite `dir/model.safetensors` through `edit(name, bf16 values)`; a tensor `edit`
/// returns None for is left out.
fn edit_weights(dir: &Path, edit: impl Fn(&str, Vec<f32>) -> Option<Vec<f32>>) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        assert_eq!(
            view.dtype(),
            safetensors::Dtype::BF16,
            "{name} is exported as bf16"
        );
        let vals: Vec<f32> = view
            .data()
            .chunks_exact(2)
            .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
            .collect();
        if let Some(v) = edit(&name, vals) {
            out.push((
                name,
                view.shape().to_vec(),
                v.iter()
                    .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                    .collect(),
            ));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = out
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &path).unwrap();
}

fn edit_config(dir: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

#[test]
fn the_export_loads_with_transformers_and_matches_the_rust_drafter() {
    if !have_torch_transformers("export parity test") {
        return;
    }
    let sup = train(None);
    let export = sup.run_dir.join("drafter");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(
        config["auto_map"]["AutoModel"],
        "dflash_drafter.DFlashDraftModel"
    );
    assert_eq!(
        config["layer_types"].as_array().map(Vec::len),
        config["num_hidden_layers"].as_u64().map(|n| n as usize)
    );
    assert_eq!(config["use_sliding_window"], false);
    assert_eq!(config["hidden_act"], "silu");

    let scratch = tempfile::tempdir().unwrap();
    let ok = export_check(&export, scratch.path(), None);
    let out = text(&ok);
    assert_eq!(ok.status.code(), Some(0), "{out}");
    assert!(
        out.contains("loaded DFlashDraftModel")
            && out.contains("no missing, unexpected or mismatched keys"),
        "{out}"
    );
    assert!(
        out.contains("explicit mask: max relative error")
            && out.contains("mask from anchors: max relative error"),
        "{out}"
    );
    let err = error_figure(&ok);
    assert!(
        err < TOLERANCE,
        "export-check error {err:e} is over {TOLERANCE:e}: {out}"
    );
    eprintln!("export-check on the tiny target: max relative error {err:e}");

    // One tensor changed by 25 %: the export no longer computes what was trained.
    let bad = copy_dir(&export, &scratch.path().join("perturbed"));
    edit_weights(&bad, |n, v| {
        Some(if n == "layers.0.self_attn.o_proj.weight" {
            v.iter().map(|x| x * 1.25).collect()
        } else {
            v
        })
    });
    let o = export_check(&bad, scratch.path(), None);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let bad_err = error_figure(&o);
    assert!(
        bad_err > TOLERANCE,
        "a perturbed o_proj must fail the gate: {}",
        text(&o)
    );
    assert!(
        text(&o).contains("FAIL: max relative error"),
        "{}",
        text(&o)
    );

    // A tensor missing from the file: transformers would initialise it at random.
    let bad = copy_dir(&export, &scratch.path().join("missing"));
    edit_weights(&bad, |n, v| (n != "hidden_norm.weight").then_some(v));
    let o = export_check(&bad, scratch.path(), None);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("missing keys: hidden_norm.weight"),
        "{}",
        text(&o)
    );

    // A tensor the model does not have.
    let bad = copy_dir(&export, &scratch.path().join("extra"));
    {
        let path = bad.join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
        let extra = st.tensor("norm.weight").unwrap();
        tensors.push((
            "lm_head.weight".to_string(),
            safetensors::tensor::TensorView::new(
                extra.dtype(),
                extra.shape().to_vec(),
                extra.data(),
            )
            .unwrap(),
        ));
        let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        let data = safetensors::serialize(tensors, Some(meta)).unwrap();
        std::fs::write(&path, data).unwrap();
    }
    let o = export_check(&bad, scratch.path(), None);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("unexpected keys: lm_head.weight"),
        "{}",
        text(&o)
    );

    // Not an export: one line, exit 2.
    let o = export_check(&sup.run_dir, scratch.path(), None);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("not a dflash-supervise export"), "{stderr}");

    // A Python without torch/transformers: exit 2 naming what is missing and how to install it.
    let wrapper = scratch.path().join("bare-python");
    std::fs::write(
        &wrapper,
        format!("#!/bin/sh\nexec {} -S -E \"$@\"\n", python()),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bare_has_torch = Command::new(&wrapper)
        .args(["-c", "import torch"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(true);
    if bare_has_torch {
        eprintln!(
            "(torch imports without site-packages here: the missing-package case is not exercised)"
        );
    } else {
        let o = export_check(&export, scratch.path(), Some(&wrapper));
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        let stderr = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains("torch") && stderr.contains("pip install torch transformers"),
            "{stderr}"
        );
    }
    // No Python at all.
    let o = export_check(
        &export,
        scratch.path(),
        Some(Path::new("/nonexistent/python3")),
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not found"),
        "{}",
        text(&o)
    );
}

/// A target with scaled rope (`scaling` as its config.json gives it): the export carries the
/// scaling as trained and the Python module applies it as the Rust drafter did; dropping
/// it from config.json fails the gate.
fn scaled_rope_export_matches(kind: &str, scaling: serde_json::Value) {
    if !have_torch_transformers(&format!("{kind} export parity test")) {
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let target = scratch.path().join("target");
    let st = Command::new(bin("dflash-worker"))
        .arg("tiny-target")
        .arg("--out")
        .arg(&target)
        .status()
        .unwrap();
    assert!(st.success());
    edit_config(&target, |v| {
        v["rope_scaling"] = scaling.clone();
        v["max_position_embeddings"] = 256.into();
    });
    let sup = train(Some(&target));
    let export = sup.run_dir.join("drafter");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap())
            .unwrap();
    for (k, want) in scaling.as_object().unwrap() {
        assert_eq!(
            &config["rope_scaling"][k], want,
            "rope_scaling.{k} exported as trained: {}",
            config["rope_scaling"]
        );
    }
    assert_eq!(
        config["max_position_embeddings"], 256,
        "the target's max_position_embeddings"
    );
    let ok = export_check(&export, scratch.path(), None);
    assert_eq!(ok.status.code(), Some(0), "{}", text(&ok));
    let err = error_figure(&ok);
    assert!(err < TOLERANCE, "{}", text(&ok));
    eprintln!("export-check with {kind} rope scaling: max relative error {err:e}");

    let unscaled = copy_dir(&export, &scratch.path().join("unscaled"));
    edit_config(&unscaled, |v| v["rope_scaling"] = serde_json::Value::Null);
    let o = export_check(&unscaled, scratch.path(), None);
    assert_eq!(
        o.status.code(),
        Some(1),
        "without its rope scaling the export must fail: {}",
        text(&o)
    );
    assert!(error_figure(&o) > TOLERANCE);
}

/// original_max_position_embeddings 64 puts the head's 8 frequencies in all three of
/// llama3's bands (kept, smoothed, divided) at the probe's positions.
#[test]
fn llama3_rope_scaling_is_exported_and_matches() {
    scaled_rope_export_matches(
        "llama3",
        serde_json::json!({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    );
}

/// YaRN over 64 original positions: a ramp over the first dimensions, the rest
/// interpolated, and cos/sin scaled by the attention factor (0.1·ln 4 + 1).
#[test]
fn yarn_rope_scaling_is_exported_and_matches() {
    scaled_rope_export_matches(
        "yarn",
        serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}),
    );
}

/// The model module against transformers itself: rope inverse frequencies and attention
/// factors (linear, llama3, yarn) equal ROPE_INIT_FUNCTIONS, both config layouts, the mask rule, DynamicCache inference.
#[test]
fn the_drafter_module_agrees_with_transformers() {
    if !have_torch_transformers("drafter module unit checks") {
        return;
    }
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../worker/python/test_dflash_drafter.py");
    let o = Command::new(python())
        .arg(&script)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("ok: llama3 inv_freq equals transformers'")
            && out.contains("all checks passed"),
        "{out}"
    );
    assert!(!out.contains("FAIL"), "{out}");
}

/// `n` prompts of 8 token ids below 500, one JSON list a line, from `seed`.
fn write_prompts(path: &Path, seed: u64, n: usize) -> Vec<Vec<u64>> {
    let mut x = seed;
    let prompts: Vec<Vec<u64>> = (0..n)
        .map(|_| {
            (0..8)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 33) % 500
                })
                .collect()
        })
        .collect();
    let lines: Vec<String> = prompts
        .iter()
        .map(|p| serde_json::to_string(p).unwrap())
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
    prompts
}

/// `dflash-supervise eval --json` of `drafter` against `target` on `prompts`.
fn eval_json(target: &Path, drafter: &Path, prompts: &Path, max_new: &str) -> serde_json::Value {
    let args = [
        "eval",
        "--target",
        target.to_str().unwrap(),
        "--drafter",
        drafter.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-new-tokens",
        max_new,
        "--json",
    ];
    let o = supervise(&args, None);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)))
}

/// z-lab's transformers API on an export: `AutoModel.from_pretrained(export,
/// trust_remote_code=True).spec_generate(input_ids=..., max_new_tokens=..., temperature=0.0,
/// target=..., stop_token_ids=[...])` writes `target.generate(do_sample=False)`'s tokens,
/// stops at a stop token, and, fed the target's taps as the trainer defines them, accepts
/// what the Rust eval accepts at every verify step. A drafter trained a few steps on the
/// demo data accepts nothing on the tiny target, so the drafter checked here is trained on
/// the target's own greedy continuations, where it accepts whole blocks.
#[test]
fn spec_generate_of_the_export_writes_the_targets_greedy_tokens() {
    if !have_torch_transformers("spec_generate test") {
        return;
    }
    let a = train(None);
    let target = a.run_dir.join("target");
    let scratch = tempfile::tempdir().unwrap();
    let train_prompts = scratch.path().join("train-prompts.jsonl");
    let prompts = write_prompts(&train_prompts, 11, 64);
    let greedy = eval_json(&target, &a.run_dir.join("drafter"), &train_prompts, "56");
    let data = scratch.path().join("greedy.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .zip(greedy["per_prompt"].as_array().unwrap())
        .map(|(p, r)| {
            let mut ids = p.clone();
            ids.extend(
                r["tokens"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap()),
            );
            serde_json::json!({ "input_ids": ids }).to_string()
        })
        .collect();
    assert_eq!(lines.len(), 64);
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let t = target.display().to_string();
    let d = data.display().to_string();
    let mut b = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--target",
        &t,
        "--data",
        &d,
        "--steps",
        "100",
        "--lr",
        "3e-3",
        "--block-size",
        "8",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    assert_eq!(
        b.wait_exit(Duration::from_secs(120)).code(),
        Some(0),
        "{}",
        b.stderr()
    );
    let drafter = b.run_dir.join("drafter");
    let held_out = scratch.path().join("prompts.jsonl");
    write_prompts(&held_out, 7, 8);
    let eval_out = scratch.path().join("eval.json");
    let r = eval_json(&target, &drafter, &held_out, "32");
    std::fs::write(&eval_out, r.to_string()).unwrap();
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../worker/python/test_dflash_drafter.py");
    let o = Command::new(python())
        .arg(&script)
        .arg("--spec-generate")
        .args([&drafter, &target, &held_out, &eval_out])
        .arg("32")
        .env("HF_MODULES_CACHE", scratch.path().join("hf-modules"))
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for line in [
        "ok: AutoModel loads the export's DFlashDraftModel",
        "ok: spec_generate(input_ids=..., target=...) returns target.generate's tokens",
        "ok: prompt 7: accepted lengths equal the Rust eval's",
        "ok: some verify step accepted guesses",
        "ends the output as it ends target.generate",
        "all spec_generate checks passed",
    ] {
        assert!(out.contains(line), "no {line:?} in:\n{out}");
    }
    assert!(!out.contains("FAIL"), "{out}");
    if let Some(summary) = out
        .lines()
        .find(|l| l.starts_with("all spec_generate checks"))
    {
        eprintln!("{summary}");
    }
}

/// A demo run of `steps` steps with `extra` flags; exits 0.
fn demo_run(steps: &str, extra: &[&str]) -> Sup {
    let mut args = vec!["--gpus", "cpu:2", "--data", "demo", "--steps", steps];
    args.extend_from_slice(extra);
    let mut sup = Sup::start_real(&args);
    assert_eq!(
        sup.wait_exit(Duration::from_secs(120)).code(),
        Some(0),
        "{}",
        sup.stderr()
    );
    sup
}

fn losses(sup: &Sup) -> Vec<f64> {
    read_jsonl(&sup.run_dir.join("train.jsonl"))
        .iter()
        .map(|s| s["loss"].as_f64().unwrap())
        .collect()
}

#[test]
fn init_drafter_starts_training_from_an_exported_drafter() {
    let a = demo_run("30", &[]);
    let a_drafter = a.run_dir.join("drafter");
    let a_loss = losses(&a);
    let a_drafter_arg = a_drafter.display().to_string();
    let b = demo_run("5", &["--init-drafter", &a_drafter_arg]);
    let fresh = demo_run("5", &[]);
    // The built-in tiny target is the same in every run: B's drafter fits A's target.
    assert_eq!(
        std::fs::read(a.run_dir.join("target/model.safetensors")).unwrap(),
        std::fs::read(b.run_dir.join("target/model.safetensors")).unwrap()
    );
    let (b_loss, fresh_loss) = (losses(&b), losses(&fresh));
    let (b1, f1, a_last) = (b_loss[0], fresh_loss[0], *a_loss.last().unwrap());
    eprintln!("first-step loss: warm {b1:.3}, fresh {f1:.3}; A's last {a_last:.3}");
    assert!(
        b1 < 0.8 * f1,
        "warm start {b1} is not below 0.8 × fresh {f1}"
    );
    assert!(
        b1 < 1.5 * a_last,
        "warm start {b1} is far from A's last loss {a_last}"
    );
    // The schedule and the optimizer start afresh: B's steps are 1..=5.
    let steps: Vec<u64> = read_jsonl(&b.run_dir.join("train.jsonl"))
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5]);
    // run.json records where the weights came from and their checksum.
    let run: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(b.run_dir.join("run.json")).unwrap())
            .unwrap();
    let rec = &run["init_drafter"];
    assert_eq!(
        rec["path"].as_str().map(PathBuf::from),
        Some(std::fs::canonicalize(&a_drafter).unwrap()),
        "{run}"
    );
    assert_eq!(
        rec["model_sha256"].as_str().map(str::len),
        Some(64),
        "{run}"
    );
    // B's export loads with transformers.
    if have_torch_transformers("init-drafter export check") {
        let scratch = tempfile::tempdir().unwrap();
        let ok = export_check(&b.run_dir.join("drafter"), scratch.path(), None);
        assert_eq!(ok.status.code(), Some(0), "{}", text(&ok));
    }
}

#[test]
fn init_drafter_refusals_name_what_does_not_fit() {
    let a = demo_run("2", &[]);
    let dir = a.run_dir.join("drafter").display().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["--gpus", "cpu:2", "--data", "demo", "--steps", "2"];
        args.extend_from_slice(extra);
        let o = supervise(&args, Some(tmp.path()));
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    // The tiny target's drafter has blocks of 8.
    let (code, err) = run(&["--init-drafter", &dir, "--block-size", "4"]);
    assert_eq!(code, Some(2), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("--init-drafter"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.contains("block size 4 (--block-size), but the init drafter has 8"),
        "{err}"
    );
    let (code, err) = run(&[
        "--init-drafter",
        &dir,
        "--resume",
        &a.run_dir.display().to_string(),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--init-drafter") && err.contains("--resume"),
        "{err}"
    );
    let empty = tmp.path().join("not-a-drafter");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::copy(
        a.run_dir.join("drafter/config.json"),
        empty.join("config.json"),
    )
    .unwrap();
    let (code, err) = run(&["--init-drafter", &empty.display().to_string()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!(
            "{} is missing",
            empty.join("model.safetensors").display()
        )),
        "{err}"
    );
}
