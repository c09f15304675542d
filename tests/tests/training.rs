//! Drafter training end to end: the demo learns and exports a drafter; data-parallel
//! ranks survive a kill and rejoin with the current weights; a stopped run resumes.
//! (Losing every rank: tests/recovery.rs.)

mod common;

use std::fs;
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use serde_json::Value;

const T: Duration = Duration::from_secs(120);

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn demo_run_learns_and_writes_a_loadable_drafter() {
    let mut sup = Sup::start_real(&["--gpus", "cpu:2", "--data", "demo", "--steps", "60"]);
    let status = sup.wait_exit(T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "stderr:\n{err}");
    let steps = read_jsonl(&sup.run_dir.join("train.jsonl"));
    assert_eq!(steps.len(), 60, "one record per committed step");
    let f = |k: &str, r: std::ops::Range<usize>| {
        mean(
            &steps[r]
                .iter()
                .map(|s| s[k].as_f64().unwrap())
                .collect::<Vec<_>>(),
        )
    };
    let (loss0, loss1) = (f("loss", 0..5), f("loss", 55..60));
    let (acc0, acc1) = (f("acceptance", 0..5), f("acceptance", 55..60));
    eprintln!("demo: loss {loss0:.3} -> {loss1:.3}, acceptance {acc0:.3} -> {acc1:.3}");
    assert!(
        loss0 / loss1 >= 1.5,
        "loss fell only from {loss0} to {loss1}"
    );
    assert!(
        acc1 > acc0 + 0.05,
        "acceptance proxy did not rise: {acc0} -> {acc1}"
    );
    // The run says where its drafter went, and the directory is an HF-style checkpoint.
    let dir = sup.run_dir.join("drafter");
    assert!(
        err.contains(&format!(
            "drafter (step 60) written to {}",
            fs::canonicalize(&dir).unwrap().display()
        )),
        "{err}"
    );
    let cfg: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "DFlashDraftModel");
    assert_eq!(
        cfg["dflash_config"]["target_layer_ids"],
        serde_json::json!([1, 3])
    );
    assert_eq!(
        (
            cfg["block_size"].as_u64(),
            cfg["num_target_layers"].as_u64(),
            cfg["num_hidden_layers"].as_u64()
        ),
        (Some(8), Some(6), Some(2))
    );
    let bytes = fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for name in [
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.k_norm.weight",
        "layers.0.mlp.down_proj.weight",
    ] {
        let t = st.tensor(name).unwrap_or_else(|_| panic!("{name} missing"));
        assert_eq!(t.dtype(), safetensors::Dtype::BF16);
    }
    assert_eq!(st.tensor("fc.weight").unwrap().shape(), &[64, 128]);
    assert!(
        st.names()
            .iter()
            .all(|n| !n.contains("embed") && !n.contains("lm_head")),
        "frozen tensors are not exported"
    );
    let out = supervise(
        &["status", "--run-dir", sup.run_dir.to_str().unwrap()],
        None,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("training:   step 60, loss "), "{text}");
    // One batch per rank per step reached the optimizer, each exactly once.
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
    assert_eq!(a["consumed_once"], 60);
}

/// The tiny target's shape with Qwen3-MoE MLPs: 4 experts of width 64, 2 per token,
/// renormalised; layer 0 dense.
const TINY_MOE: &str = r#"{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe","hidden_size":64,
  "num_hidden_layers":6,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"intermediate_size":128,
  "moe_intermediate_size":64,"num_experts":4,"num_experts_per_tok":2,"norm_topk_prob":true,"mlp_only_layers":[0],
  "rms_norm_eps":1e-6,"rope_theta":10000.0,"vocab_size":512,"tie_word_embeddings":true}"#;

#[test]
fn a_drafter_trains_on_a_mixture_of_experts_target() {
    let tmp = tempfile::tempdir().unwrap();
    let (target, config) = (tmp.path().join("target"), tmp.path().join("config.json"));
    fs::write(&config, TINY_MOE).unwrap();
    let st = std::process::Command::new(bin("dflash-worker"))
        .args(["tiny-target", "--out"])
        .arg(&target)
        .arg("--config")
        .arg(&config)
        .status()
        .unwrap();
    assert!(st.success());
    let t = target.display().to_string();
    let mut sup = Sup::start_real(&[
        "--gpus", "cpu:2", "--target", &t, "--data", "demo", "--steps", "20",
    ]);
    // A debug drafter's step takes seconds on a loaded 2-core machine (3.5 s seen).
    let status = sup.wait_exit(3 * T);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "stderr:\n{err}");
    assert!(
        sup.log("target-0")
            .contains("target loaded: Qwen3-MoE, 6 layers"),
        "{}",
        sup.log("target-0")
    );
    let steps = read_jsonl(&sup.run_dir.join("train.jsonl"));
    assert_eq!(steps.len(), 20, "one record per committed step");
    let loss = |r: std::ops::Range<usize>| {
        mean(
            &steps[r]
                .iter()
                .map(|s| s["loss"].as_f64().unwrap())
                .collect::<Vec<_>>(),
        )
    };
    let (loss0, loss1) = (loss(0..3), loss(17..20));
    eprintln!("MoE target: loss {loss0:.3} -> {loss1:.3}");
    assert!(
        loss0 / loss1 >= 1.3,
        "loss fell only from {loss0} to {loss1}"
    );
    let cfg: Value = serde_json::from_str(
        &fs::read_to_string(sup.run_dir.join("drafter").join("config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["num_target_layers"].as_u64(), Some(6));
    // The export records the target it was trained for.
    let t = &cfg["dflash_target"];
    assert_eq!(t["architecture"], "Qwen3-MoE", "{cfg}");
    assert_eq!(
        (
            t["moe"]["num_experts"].as_u64(),
            t["moe"]["num_experts_per_tok"].as_u64()
        ),
        (Some(4), Some(2))
    );
    assert_eq!(t["moe"]["dense_layers"], serde_json::json!([0]));
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
    assert_eq!(a["consumed_once"], 20);
}

#[test]
fn a_killed_drafter_rejoins_with_the_current_weights() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:3",
        "--targets",
        "1",
        "--data",
        "demo",
        "--epochs",
        "20",
        "--steps",
        "30",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    sup.wait_state("training to reach step 5", T, |s| {
        s["train"]["step"].as_u64().unwrap_or(0) >= 5
    });
    let st = sup.state().unwrap();
    signal(pid_of(&st, "drafter-1"), Signal::SIGKILL);
    wait_for("drafter-1 to rejoin from drafter-0's state", T, || {
        sup.log("drafter-1")
            .contains("from the state of step")
            .then_some(())
    });
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "stderr:\n{}", sup.stderr());
    // Every step, each member's weights were checked equal (the run would have failed).
    assert!(!sup.stderr().contains("diverged"));
    let steps = read_jsonl(&sup.run_dir.join("train.jsonl"));
    assert_eq!(steps.len(), 30);
    assert_eq!(steps.last().unwrap()["members"], 2, "both ranks at the end");
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
    // A batch is consumed exactly when its gradient is part of a committed step.
    let contributions: u64 = steps
        .iter()
        .map(|s| s["contributors"].as_u64().unwrap())
        .sum();
    assert_eq!(a["consumed_once"].as_u64().unwrap(), contributions, "{a}");
    assert!(
        a["requeued"].as_u64().unwrap() >= 1,
        "the killed rank's batch went back: {a}"
    );
}

#[test]
fn stop_then_resume_continues_to_the_same_step_count_without_retraining_a_batch() {
    let args = [
        "--gpus",
        "cpu:3",
        "--data",
        "demo",
        "--epochs",
        "20",
        "--steps",
        "30",
        "--checkpoint-every",
        "4",
        "--keep-checkpoints",
        "2",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ];
    let mut sup = Sup::start_real(&args);
    sup.wait_state("training to reach step 9", T, |s| {
        s["train"]["step"].as_u64().unwrap_or(0) >= 9
    });
    sup.signal(Signal::SIGTERM);
    assert_eq!(
        sup.wait_exit(T).code(),
        Some(75),
        "stderr:\n{}",
        sup.stderr()
    );
    let ckpts: Vec<String> = fs::read_dir(sup.run_dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(ckpts.len() <= 2, "only the newest 2 are kept: {ckpts:?}");
    let stopped_at = read_jsonl(&sup.run_dir.join("train.jsonl")).len() as u64;
    assert!(
        ckpts.contains(&format!("step-{stopped_at:08}")),
        "a checkpoint of the last step is written at the stop: {ckpts:?}"
    );
    assert!(stopped_at < 30);

    // What a crash mid-write leaves: temporary directories, removed at the next start.
    let leftover = sup
        .run_dir
        .join("checkpoints")
        .join("step-00000099.tmp-4242");
    fs::create_dir_all(&leftover).unwrap();
    fs::create_dir_all(sup.run_dir.join("drafter.tmp-4242")).unwrap();
    let out = supervise(
        &[
            "--gpus",
            "cpu:3",
            "--targets",
            "1",
            "--resume",
            sup.run_dir.to_str().unwrap(),
        ],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        !leftover.exists() && !sup.run_dir.join("drafter.tmp-4242").exists(),
        "{err}"
    );
    assert!(
        err.contains(&format!("from the checkpoint of step {stopped_at}")),
        "{err}"
    );
    assert!(err.contains("drafter (step 30) written to"), "{err}");
    let lines = read_jsonl(&sup.run_dir.join("train.jsonl"));
    // The resumed run marks where its lineage goes back to: the checkpoint.
    let rb: Vec<&Value> = lines.iter().filter_map(|l| l.get("rollback")).collect();
    assert_eq!(rb.len(), 1, "{rb:?}");
    assert_eq!(rb[0]["to"], stopped_at);
    let steps: Vec<Value> = lines
        .into_iter()
        .filter(|l| l.get("step").is_some())
        .collect();
    let numbers: Vec<u64> = steps.iter().map(|s| s["step"].as_u64().unwrap()).collect();
    assert_eq!(
        numbers,
        (1..=30).collect::<Vec<_>>(),
        "every step once, across the stop"
    );
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
    let contributions: u64 = steps
        .iter()
        .map(|s| s["contributors"].as_u64().unwrap())
        .sum();
    assert_eq!(a["consumed_once"].as_u64().unwrap(), contributions, "{a}");
    assert_eq!(a["duplicated"], 0);
}

#[test]
fn resume_refuses_what_cannot_be_resumed() {
    let out = supervise(&["--gpus", "cpu:2", "--resume", "/nonexistent/run"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--resume /nonexistent/run"));
    // A run that never checkpointed (it trained nothing).
    let mut sup = Sup::start_real(&["--gpus", "cpu:2", "--time-limit", "300ms"]);
    assert_eq!(sup.wait_exit(T).code(), Some(75));
    let out = supervise(
        &["--gpus", "cpu:2", "--resume", sup.run_dir.to_str().unwrap()],
        None,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no checkpoint in it yet"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A run that already reached its --steps: nothing to train, said so (it used to train
    // one step more).
    let mut done = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--steps",
        "3",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    assert_eq!(done.wait_exit(T).code(), Some(0), "{}", done.stderr());
    let out = supervise(
        &[
            "--gpus",
            "cpu:2",
            "--resume",
            done.run_dir.to_str().unwrap(),
        ],
        None,
    );
    // It finished by itself: said so, exit 0, nothing started.
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("already finished at step 3"), "{err}");
    // Without the record of its end (a run of an older version, or a session that ended
    // before recording it), a checkpoint at --steps is nothing to train: the run is
    // finished (its drafter is there), exit 0; a --steps below it is refused.
    fs::remove_file(done.run_dir.join("finished.json")).unwrap();
    let out = supervise(
        &[
            "--gpus",
            "cpu:2",
            "--resume",
            done.run_dir.to_str().unwrap(),
        ],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("had trained its --steps 3") && err.contains("its drafter (step 3) is in"),
        "{err}"
    );
    fs::remove_file(done.run_dir.join("finished.json")).unwrap();
    let out = supervise(
        &[
            "--gpus",
            "cpu:2",
            "--resume",
            done.run_dir.to_str().unwrap(),
            "--steps",
            "2",
        ],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("checkpoint is at step 3, and --steps is 2: nothing to train"),
        "{err}"
    );
}

/// `dflash-supervise bench train ARGS` with `TMPDIR` set to `tmp` and `env` on top.
fn bench_train(args: &[&str], tmp: &std::path::Path, env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = std::process::Command::new(bin("dflash-supervise"));
    cmd.args(["bench", "train"])
        .args(args)
        .env("TMPDIR", tmp)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null());
    cmd.output().expect("run dflash-supervise bench train")
}

/// The figure `k` of a `bench train --json` object: present, positive and finite.
fn figure(v: &Value, k: &str) -> f64 {
    let x = v[k]
        .as_f64()
        .unwrap_or_else(|| panic!("{k} missing in {v}"));
    assert!(x.is_finite() && x > 0.0, "{k} = {x} in {v}");
    x
}

/// The printed ratio `r` is the quotient of the printed figures it names.
fn assert_ratio(v: &Value, r: &str, quotient: f64) {
    let x = figure(v, r);
    assert!(
        (x - quotient).abs() <= 1e-12 * quotient.abs(),
        "{r} = {x}, the quotient of its figures is {quotient}: {v}"
    );
}

#[test]
fn bench_train_prints_stage_and_pipeline_throughput() {
    // Its scratch directory is a fresh one of its own under TMPDIR, removed at the end;
    // a directory that was there before (even one named as the old pid-named directory
    // was) is left alone.
    let tmp = tempfile::tempdir().unwrap();
    let other = tmp.path().join("dflash-bench-train-keep");
    fs::create_dir(&other).unwrap();
    fs::write(other.join("mine"), b"x").unwrap();
    let out = bench_train(&["--json", "--steps", "3"], tmp.path(), &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        other.join("mine").is_file(),
        "a directory it did not make is untouched"
    );
    let left: Vec<_> = fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().starts_with("dflash-bench-train"))
        .filter(|n| n != "dflash-bench-train-keep")
        .collect();
    assert!(
        left.is_empty(),
        "its scratch directory is removed: {left:?}"
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    // The native engine alone: no torch figures.
    assert!(v.get("torch_target_tokens_per_s").is_none(), "{v}");
    assert_ratio(
        &v,
        "pipeline_vs_slowest_stage",
        figure(&v, "pipeline_tokens_per_s")
            / figure(&v, "target_tokens_per_s").min(figure(&v, "drafter_tokens_per_s")),
    );
    for k in [
        "target_tokens_per_s",
        "drafter_tokens_per_s",
        "pipeline_tokens_per_s",
        "pipeline_vs_slowest_stage",
        "snapshot_ms",
        "step_ms",
    ] {
        figure(&v, k);
    }
    // The snapshot's share is its cost over the steps between snapshots.
    let share = v["snapshot_ms"].as_f64().unwrap()
        / (v["snapshot_every_steps"].as_f64().unwrap() * v["step_ms"].as_f64().unwrap());
    assert!(
        (v["snapshot_share_of_step_time"].as_f64().unwrap() - share).abs() < 1e-12,
        "{v}"
    );
}

#[test]
fn bench_train_measures_the_torch_engine_beside_the_native_one() {
    if !have_torch() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = bench_train(
        &["--target-engine", "torch", "--json", "--steps", "3"],
        tmp.path(),
        &[],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let native_target = figure(&v, "target_tokens_per_s");
    let drafter = figure(&v, "drafter_tokens_per_s");
    let native_pipeline = figure(&v, "pipeline_tokens_per_s");
    let torch_target = figure(&v, "torch_target_tokens_per_s");
    let torch_pipeline = figure(&v, "torch_pipeline_tokens_per_s");
    assert_eq!(v["batches"].as_f64(), Some(3.0), "{v}");
    assert_ratio(&v, "torch_vs_native_target", torch_target / native_target);
    assert_ratio(
        &v,
        "torch_vs_native_pipeline",
        torch_pipeline / native_pipeline,
    );
    assert_ratio(
        &v,
        "pipeline_vs_slowest_stage",
        native_pipeline / native_target.min(drafter),
    );
    assert_ratio(
        &v,
        "torch_pipeline_vs_slowest_stage",
        torch_pipeline / torch_target.min(drafter),
    );
}

#[test]
fn bench_train_torch_without_torch_is_refused_naming_what_to_install() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-python");
    let out = bench_train(
        &["--target-engine", "torch", "--steps", "3"],
        tmp.path(),
        &[("DFLASH_PYTHON", missing.to_str().unwrap())],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("--target-engine torch") && err.contains("pip install torch transformers"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "nothing measured");
    assert_eq!(
        fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "nothing made before the refusal"
    );
}

#[test]
fn bench_compute_reports_the_forward_per_op_against_bare_gemms() {
    let out = supervise(
        &[
            "bench",
            "compute",
            "--json",
            "--target",
            "qwen3:128x2",
            "--tokens",
            "96",
        ],
        None,
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["backend"], "cpu",
        "no GPU here: the CPU backend is measured, and said so"
    );
    assert_eq!(v["tokens"], 96);
    for k in [
        "target_tokens_per_s",
        "target_gflops",
        "gemm_gflops",
        "forward_vs_gemm",
        "drafter_tokens_per_s",
    ] {
        let x = v[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k} missing in {v}"));
        assert!(x.is_finite() && x > 0.0, "{k} = {x}");
    }
    let ratio = v["target_gflops"].as_f64().unwrap() / v["gemm_gflops"].as_f64().unwrap();
    assert!((v["forward_vs_gemm"].as_f64().unwrap() - ratio).abs() < 1e-9 * ratio);
    // The per-op times cover the forward's ops and add up to no more than the forward.
    let ops = v["op_seconds"].as_object().unwrap();
    for op in ["matmul", "attention", "rmsnorm", "rope", "swiglu"] {
        assert!(
            ops.get(op)
                .and_then(|x| x.as_f64())
                .is_some_and(|x| x > 0.0),
            "{op} missing in {ops:?}"
        );
    }
    let sum: f64 = ops.values().map(|x| x.as_f64().unwrap()).sum();
    assert!(
        sum <= v["target_forward_s"].as_f64().unwrap() * 1.001,
        "ops {sum} s > forward {}",
        v["target_forward_s"]
    );
    // The reference models are test-only: the shipped benchmark measures what the workers
    // run. The drafter step's kernels:
    assert!(v.get("reference_gflops").is_none(), "{v}");
    let dops = v["drafter_op_seconds"].as_object().unwrap();
    // The attention forward is whichever kernel device/ops/ chose (the FlashAttention-2
    // one at the demo's head dim).
    let fwd = dops
        .keys()
        .find(|k| k.starts_with("attention_fa2_fwd") || k.starts_with("attention_fwd"))
        .unwrap_or_else(|| panic!("no attention forward in {dops:?}"));
    // And its backward (the FlashAttention-2 one there, after its preparation pass).
    let bwd = dops
        .keys()
        .find(|k| k.starts_with("attention_fa2_bwd") || *k == "attention_bwd")
        .unwrap_or_else(|| panic!("no attention backward in {dops:?}"));
    for op in [
        "gemm",
        fwd.as_str(),
        bwd.as_str(),
        "ce_fold",
        "ce_finish",
        "adamw",
    ] {
        if op == "adamw" {
            assert!(
                !dops.contains_key(op),
                "the step alone is timed, not the optimizer: {dops:?}"
            );
            continue;
        }
        assert!(
            dops.get(op)
                .and_then(|x| x.as_f64())
                .is_some_and(|x| x > 0.0),
            "{op} missing in {dops:?}"
        );
    }
    let dsum: f64 = dops.values().map(|x| x.as_f64().unwrap()).sum();
    assert!(
        dsum <= v["drafter_step_s"].as_f64().unwrap() * 1.001,
        "drafter ops {dsum} s > step {}",
        v["drafter_step_s"]
    );

    let out = supervise(&["bench", "compute", "--target", "gpt2:12"], None);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--target gpt2:12") && err.contains("qwen3:768x5"),
        "{err}"
    );
}

#[test]
fn a_toml_config_sets_the_drafter_and_flags_override_it() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("dflash.toml");
    fs::write(
        &cfg,
        "[drafter]\nlayers = 1\nblock_size = 4\nmax_anchors = 8\nsteps = 5\ngamma = 3.0\n",
    )
    .unwrap();
    let c = cfg.to_str().unwrap();
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--config",
        c,
        "--steps",
        "3",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    assert_eq!(sup.wait_exit(T).code(), Some(0), "{}", sup.stderr());
    assert_eq!(
        read_jsonl(&sup.run_dir.join("train.jsonl")).len(),
        3,
        "--steps on the command line wins over the file"
    );
    let exported: Value =
        serde_json::from_str(&fs::read_to_string(sup.run_dir.join("drafter/config.json")).unwrap())
            .unwrap();
    assert_eq!(
        (
            exported["num_hidden_layers"].as_u64(),
            exported["block_size"].as_u64()
        ),
        (Some(1), Some(4))
    );
    assert_eq!(exported["dflash_training"]["gamma"], 3.0);
    assert_eq!(
        exported["dflash_config"]["target_layer_ids"]
            .as_array()
            .unwrap()
            .len(),
        1,
        "one drafter layer, one tap"
    );

    fs::write(&cfg, "[drafter]\nlayrs = 2\n").unwrap();
    let out = supervise(&["--gpus", "cpu:2", "--config", c], None);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("dflash.toml") && err.contains("layrs"),
        "{err}"
    );
}
