//! Whole runs on four emulated GPUs: the fake NVML reports them to the supervisor, and the
//! workers run the production GPU path (`gpu/cuda.rs` over cudarc, `collective/nccl.rs`)
//! over the emulated CUDA stack (tests/emu-cuda: driver, cuBLAS, NCCL across processes),
//! found through the overrides a user has (`DFLASH_CUDA_LIB`, `DFLASH_CUBLAS_LIB`,
//! `DFLASH_NCCL_LIB`). One target and three drafters in one NCCL group.
//!
//! The kernels are compiled by NVRTC (PyPI's nvidia-cuda-nvrtc): without it these tests
//! skip on a laptop and fail under CI.

mod common;

use std::fs;
use std::time::Duration;

use common::*;
use serde_json::Value;

const T: Duration = Duration::from_secs(240);

/// An H200's memory, in bytes.
const BIG: u64 = 150323855360;

/// NVML's GPUs in `env` (from [`emulated`]) become GPUs of `bytes` each, written into `dir`.
fn with_gpu_memory(dir: &std::path::Path, env: &mut [(String, String)], bytes: &[u64]) {
    let devs: Vec<String> = bytes
        .iter()
        .enumerate()
        .map(|(i, b)| {
            format!(r#"{{"name": "Fake GPU", "uuid": "GPU-{i:04}", "memory_total": {b}}}"#)
        })
        .collect();
    let script = dir.join("sized-nvml.json");
    let json = format!(
        r#"{{"driver": "580.65.06", "devices": [{}]}}"#,
        devs.join(", ")
    );
    fs::write(&script, json).unwrap();
    for (k, v) in env.iter_mut() {
        if k == "DFLASH_FAKE_NVML" {
            *v = script.display().to_string();
        }
    }
}

fn start(args: &[&str], env: &[(String, String)]) -> Sup {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Sup::start_real_env(args, &env)
}

/// The step records of train.jsonl (not its τ records).
fn steps(sup: &Sup) -> Vec<Value> {
    read_jsonl(&sup.run_dir.join("train.jsonl"))
        .into_iter()
        .filter(|l| l.get("tau").is_none())
        .collect()
}

/// The ledger's audit, which must pass with nothing lost or duplicated.
fn clean_ledger(sup: &Sup) -> Value {
    let (code, audit) = sup.ledger();
    assert_eq!(code, 0, "{audit}");
    assert_eq!(
        (audit["lost"].as_u64(), audit["duplicated"].as_u64()),
        (Some(0), Some(0)),
        "{audit}"
    );
    audit
}

fn maps(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default()
}

#[test]
fn four_emulated_gpus_train_in_one_nccl_group_like_the_cpu_run_and_keep_cuda_out_of_the_supervisor()
{
    if skip_without_nvrtc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let env = emulated(tmp.path(), 4);
    let mut args = vec![
        "--gpus",
        "0-3",
        "--steps",
        "6",
        "--gpu-sample-interval",
        "200ms",
    ];
    args.extend(SMALL_GPU_RUN);
    let mut sup = start(&args, &env);

    // Isolation, while it runs: the supervisor maps NVML and no CUDA library; each worker
    // maps the (emulated) CUDA libraries and not NVML.
    let st = sup.wait_state("every worker running", T, |s| {
        s["workers"]
            .as_array()
            .is_some_and(|w| w.len() == 4 && w.iter().all(|w| w["state"] == "running"))
    });
    let sup_maps = maps(sup.pid());
    assert!(
        sup_maps.contains("libdflash_fake_nvml.so"),
        "the supervisor samples NVML"
    );
    assert!(
        !sup_maps.contains("libdflash_emu_cu")
            && !sup_maps.contains("libcuda")
            && !sup_maps.contains("libcublas")
            && !sup_maps.contains("libnvrtc"),
        "the supervisor maps no CUDA library"
    );
    for name in ["target-0", "drafter-0", "drafter-1", "drafter-2"] {
        let pid = pid_of(&st, name);
        // A worker maps its CUDA libraries once it has opened its GPU: the driver first,
        // cuBLAS and NVRTC as it sets the device up (so wait for all three, or its death).
        let all = |m: &str| {
            m.contains("libdflash_emu_cuda.so")
                && m.contains("libdflash_emu_cublas.so")
                && m.contains("libnvrtc")
        };
        let m = wait_for(&format!("{name} opened its GPU"), T, || {
            let m = maps(pid);
            (all(&m) || !pid_alive(pid)).then_some(m)
        });
        assert!(
            m.contains("libdflash_emu_cuda.so")
                && m.contains("libdflash_emu_cublas.so")
                && m.contains("libnvrtc"),
            "{name} maps the CUDA libraries"
        );
        assert!(
            !m.contains("fake_nvml") && !m.contains("libnvidia-ml"),
            "{name} maps no NVML"
        );
    }

    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "{}", sup.stderr());
    for name in ["drafter-0", "drafter-1", "drafter-2"] {
        let log = sup.log(name);
        assert!(
            log.contains("GPU: Emulated GPU (host device)")
                && log.contains("kernels: CUBIN for sm_90"),
            "{name}: {log}"
        );
        assert!(
            log.contains("NCCL: ") && log.contains("libdflash_emu_cuda.so (2.30.7)"),
            "{name} reports where NCCL came from: {log}"
        );
        assert!(
            log.contains("gradients exchanged through NCCL"),
            "{name}: {log}"
        );
    }
    clean_ledger(&sup);
    let gpu = steps(&sup);
    assert_eq!(gpu.len(), 6);
    // Every committed step passed the supervisor's check that all ranks hold the same
    // weights (their device checksums), or the run would have failed "diverged".
    assert!(
        gpu.iter().all(|s| s["members"] == 3),
        "three ranks throughout: {gpu:?}"
    );
    assert!(!sup.stderr().contains("diverged"));

    // The same run on CPU workers: the same batches per step (the dispatcher hands them out
    // in order), so the same losses up to bf16 (the GPU drafter's GEMMs take bf16 inputs).
    let mut args = vec!["--gpus", "cpu:4", "--steps", "6"];
    args.extend(SMALL_GPU_RUN);
    let mut cpu = Sup::start_real(&args);
    assert_eq!(cpu.wait_exit(T).code(), Some(0), "{}", cpu.stderr());
    let cpu = steps(&cpu);
    let mut compared = 0;
    for (g, c) in gpu.iter().zip(&cpu) {
        if g["tokens"] != c["tokens"] || g["contributors"] != c["contributors"] {
            continue; // another set of batches in this step (a loaded machine's order)
        }
        let (lg, lc) = (g["loss"].as_f64().unwrap(), c["loss"].as_f64().unwrap());
        assert!(
            (lg - lc).abs() <= 0.02 * lc,
            "step {}: loss {lg} on the emulated GPUs, {lc} on CPUs (tolerance 2%)",
            g["step"]
        );
        compared += 1;
    }
    assert!(
        compared >= 4,
        "at least 4 of 6 steps trained the same batches: {gpu:?} {cpu:?}"
    );
}

#[test]
fn an_emulated_gpu_drafter_killed_in_an_nccl_all_reduce_leaves_the_step_to_the_survivors() {
    if skip_without_nvrtc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut env = emulated(tmp.path(), 4);
    env.push(("DFLASH_TEST_DIE_IN_ALLREDUCE".into(), "1:4".into()));
    let mut args = vec![
        "--gpus",
        "0-3",
        "--steps",
        "8",
        "--epochs",
        "50",
        "--no-gpu-metrics",
    ];
    args.extend(SMALL_GPU_RUN);
    let mut sup = start(&args, &env);
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "{}", sup.stderr());
    let logs = sup.log("drafter-0") + &sup.log("drafter-1") + &sup.log("drafter-2");
    assert!(
        logs.contains("test fault: dying in the all-reduce of step 4"),
        "{logs}"
    );
    let epochs: Vec<Value> = sup
        .events()
        .into_iter()
        .filter(|e| e["event"] == "group_epoch")
        .collect();
    let left = epochs
        .iter()
        .find(|e| e["why"] == "rank 1 left")
        .unwrap_or_else(|| panic!("no epoch after rank 1 left: {epochs:?}"));
    assert_eq!(left["ranks"], serde_json::json!([0, 2]), "{left}");
    assert!(
        epochs.iter().any(|e| e["why"]
            .as_str()
            .is_some_and(|w| w.starts_with("rank 1 joined"))),
        "the killed rank rejoined: {epochs:?}"
    );
    let audit = clean_ledger(&sup);
    assert!(
        audit["requeued"].as_u64().unwrap() >= 1,
        "the dead rank's batch went back: {audit}"
    );
    let st = steps(&sup);
    let numbers: Vec<u64> = st.iter().map(|s| s["step"].as_u64().unwrap()).collect();
    assert_eq!(
        numbers,
        (1..=8).collect::<Vec<_>>(),
        "every step committed once"
    );
    let contributions: u64 = st.iter().map(|s| s["contributors"].as_u64().unwrap()).sum();
    assert_eq!(
        audit["consumed_once"].as_u64().unwrap(),
        contributions,
        "a batch is consumed exactly when its gradient is in a committed step: {audit}"
    );
}

/// The whole pipeline through the GPU code path with every device operation checked for
/// stream order (`DFLASH_CHECK_STREAMS=1`: a copy not ordered after the compute it reads,
/// or the host touching a pinned slot before its copy's event, would fail the worker with
/// both sides named): the target's weights in the arena, its forward's kernels and GEMMs,
/// the bf16 cast, the copy stream into the pinned slot behind an event; the drafters'
/// forward and backward on the device, their NCCL all-reduce — and the drafter learns.
#[test]
fn stream_checked_emulated_gpus_feed_the_pipeline_and_the_drafter_learns() {
    if skip_without_nvrtc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut env = emulated(tmp.path(), 3);
    env.push(("DFLASH_CHECK_STREAMS".into(), "1".into()));
    // τ of the last step measured on GPU 2 (--eval-gpu), beside the drafter placed there.
    let prompts = tmp.path().join("prompts.jsonl");
    fs::write(
        &prompts,
        "[5, 17, 42, 99]\n[7, 8, 9, 10, 11, 12]\n[300, 2, 301]\n",
    )
    .unwrap();
    // Two drafter ranks: their device-computed weight checksums are compared every step.
    let mut sup = start(
        &[
            "--eval-prompts",
            prompts.to_str().unwrap(),
            "--eval-gpu",
            "2",
            "--eval-max-new-tokens",
            "6",
            "--gpus",
            "0-2",
            "--targets",
            "1",
            "--data",
            "demo",
            "--steps",
            "5",
            "--max-seq-len",
            "16",
            "--token-budget",
            "128",
            "--no-gpu-metrics",
            "--metrics-interval",
            "200ms",
        ],
        &env,
    );
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "{}", sup.stderr());
    for name in ["target-0", "drafter-0", "drafter-1"] {
        let log = sup.log(name);
        assert!(
            log.contains("streams: every operation checked for stream order")
                && log.contains("(stream-checked)"),
            "{name} computes on the checked emulated GPU: {log}"
        );
    }
    clean_ledger(&sup);
    let steps = steps(&sup);
    assert_eq!(steps.len(), 5);
    let loss: Vec<f64> = steps.iter().map(|s| s["loss"].as_f64().unwrap()).collect();
    assert!(loss.iter().all(|l| l.is_finite() && *l > 0.0), "{loss:?}");
    assert!(
        loss[3..].iter().sum::<f64>() < loss[..2].iter().sum::<f64>(),
        "the drafter learns from device-computed taps: {loss:?}"
    );
    // The optimizer ran on the device: the final checkpoint's state came back from it,
    // with the device's Adam step count (5 applied steps, none skipped).
    let meta: Value = serde_json::from_str(
        &fs::read_to_string(
            sup.run_dir
                .join("checkpoints")
                .join(format!("step-{:08}", 5))
                .join("meta.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(
        (meta["step"].as_u64(), meta["adam_step"].as_u64()),
        (Some(5), Some(5)),
        "{meta}"
    );
    // The last step's τ, decoded on the (emulated) GPU by the τ child.
    let tau: Vec<Value> = read_jsonl(&sup.run_dir.join("train.jsonl"))
        .into_iter()
        .filter_map(|l| l.get("tau").cloned())
        .collect();
    let last = tau
        .iter()
        .find(|t| t["step"] == 5)
        .unwrap_or_else(|| panic!("no τ of step 5 in train.jsonl: {tau:?}\n{}", sup.stderr()));
    let pooled = last["pooled"].as_f64().unwrap();
    assert!(
        (1.0..=last["block_size"].as_f64().unwrap()).contains(&pooled),
        "{last}"
    );
    let report: Value = serde_json::from_str(
        &fs::read_to_string(sup.run_dir.join("eval").join("tau-step-00000005.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(report["device"], "gpu", "decoded on --eval-gpu: {report}");
    // The target's device memory reaches metrics.jsonl (its arena: in use within reserved).
    let metrics = read_jsonl(&sup.run_dir.join("metrics.jsonl"));
    let m = metrics.into_iter().rev().find_map(|m| {
        m["pipeline"]["cuda_memory_by_worker"]
            .get("target-0")
            .cloned()
    });
    let m = m.unwrap_or_else(|| panic!("no cuda_memory_by_worker.target-0 in metrics.jsonl"));
    let (reserved, in_use, peak) = (
        m["reserved"].as_u64().unwrap(),
        m["in_use"].as_u64().unwrap(),
        m["peak"].as_u64().unwrap(),
    );
    assert!(
        reserved > 0
            && in_use > 0
            && in_use <= reserved
            && peak >= in_use
            && m["alloc_failures"] == 0,
        "{m}"
    );
}

/// A Qwen3-MoE target on an emulated GPU, every device operation checked for stream
/// order: the sparse MLP's device route (router GEMM, `moe_route`, `moe_permute`, the
/// grouped GEMMs reading the offsets on the device, `moe_combine`) in bf16 inside the
/// pipeline, and the drafter trains on its taps.
#[test]
fn a_mixture_of_experts_target_runs_on_a_stream_checked_emulated_gpu() {
    if skip_without_nvrtc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (target, config) = (tmp.path().join("target"), tmp.path().join("config.json"));
    fs::write(
        &config,
        r#"{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":4,
        "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"intermediate_size":128,"moe_intermediate_size":32,
        "num_experts":8,"num_experts_per_tok":2,"norm_topk_prob":true,"mlp_only_layers":[0],"vocab_size":512,
        "tie_word_embeddings":true}"#,
    )
    .unwrap();
    let st = std::process::Command::new(bin("dflash-worker"))
        .args(["tiny-target", "--out"])
        .arg(&target)
        .arg("--config")
        .arg(&config)
        .status()
        .unwrap();
    assert!(st.success());
    let mut env = emulated(tmp.path(), 2);
    env.push(("DFLASH_CHECK_STREAMS".into(), "1".into()));
    let t = target.display().to_string();
    let mut sup = start(
        &[
            "--gpus",
            "0-1",
            "--targets",
            "1",
            "--target",
            &t,
            "--data",
            "demo",
            "--steps",
            "4",
            "--max-seq-len",
            "16",
            "--token-budget",
            "128",
            "--no-gpu-metrics",
        ],
        &env,
    );
    let status = sup.wait_exit(T);
    assert_eq!(status.code(), Some(0), "{}", sup.stderr());
    let log = sup.log("target-0");
    assert!(
        log.contains("target loaded: Qwen3-MoE") && log.contains("(stream-checked)"),
        "{log}"
    );
    clean_ledger(&sup);
    let loss: Vec<f64> = steps(&sup)
        .iter()
        .map(|s| s["loss"].as_f64().unwrap())
        .collect();
    assert_eq!(loss.len(), 4);
    assert!(loss.iter().all(|l| l.is_finite() && *l > 0.0), "{loss:?}");
}

/// `bench compute` on a GPU — here the emulated one: the target forward, the drafter step
/// and the device optimizer run there, the device→host copy into a pinned pool slot is
/// measured against a plain pinned buffer in the same run, and the one-rank gradient
/// reduction goes through NCCL.
#[test]
fn bench_compute_on_an_emulated_gpu_measures_the_drafter_step_the_optimizer_and_the_pinned_slot_copy(
) {
    if skip_without_nvrtc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let env = emulated(tmp.path(), 1);
    let mut c = std::process::Command::new(bin("dflash-supervise"));
    c.args([
        "bench",
        "compute",
        "--json",
        "--target",
        "qwen3:64x1",
        "--tokens",
        "16",
    ]);
    for (k, v) in &env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    let d = &v["device"];
    assert!(
        d["name"].as_str().unwrap().starts_with("Emulated GPU"),
        "{v}"
    );
    for k in [
        "target_forward_s",
        "drafter_step_s",
        "drafter_tflops",
        "optimizer_ms",
        "slot_copy_gb_s",
        "pinned_copy_gb_s",
        "all_reduce_ms",
        "step_with_all_reduce_s",
    ] {
        let x = d[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k} missing in {d}"));
        assert!(x.is_finite() && x > 0.0, "{k} = {x}");
    }
    // The copy measured is a GPU's (64 MiB), not the host device's small one.
    assert_eq!(d["copy_bytes"], 64 << 20, "{d}");
    let ratio = d["slot_copy_gb_s"].as_f64().unwrap() / d["pinned_copy_gb_s"].as_f64().unwrap();
    assert!(
        (d["slot_vs_pinned"].as_f64().unwrap() - ratio).abs() < 1e-9 * ratio,
        "{d}"
    );
    // NCCL as a one-rank group, bucket by bucket; the step with it covers at least the
    // part of the reduction the backward did not hide. (Not compared with the step alone:
    // the two are timed at different moments, and on a loaded 2-core machine another
    // test's burst made the step alone twice as slow as the step with its reduction; the
    // benchmark prints the ratio, a test does not judge it.)
    assert_eq!(d["all_reduce"], "NCCL, 1 rank", "{d}");
    let overlap = d["all_reduce_overlap"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&overlap), "{d}");
    assert!(
        d["step_with_all_reduce_s"].as_f64().unwrap()
            >= d["all_reduce_ms"].as_f64().unwrap() / 1e3 * (1.0 - overlap),
        "{d}"
    );
    for k in ["shm_all_reduce_ms", "shm_all_reduce_gb_s"] {
        assert!(
            v[k].as_f64().is_some_and(|x| x > 0.0 && x.is_finite()),
            "{k}: {v}"
        );
    }
    // No bf16 peak is known for the emulated GPU: no MFU is made up.
    assert!(d["mfu"].is_null() && d["drafter_mfu"].is_null(), "{d}");
}

/// `eval --gpus 0` decodes on an emulated GPU (bf16 kernels run by the host device) what
/// `eval` decodes on the CPU: the same prompts, the same first token of every prompt (the
/// prefill's argmax; later tokens may part at a bf16 near tie), τ within [1, block size]
/// with its interval around it, and `device: gpu` only because the GPU opened (a GPU that
/// cannot be opened is exit 2, one line); `--gpus 0,1` holds the target over two emulated
/// GPUs and decodes what one does. The drafter: a few demo steps on CPU workers.
#[test]
fn eval_on_an_emulated_gpu_decodes_the_prompts_as_the_cpu_does() {
    if skip_without_nvrtc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let env = emulated(tmp.path(), 1);
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
    let prompts = tmp.path().join("prompts.jsonl");
    let lines: Vec<String> = (0..4)
        .map(|i| {
            let ids: Vec<String> = (0..5 + i)
                .map(|t| ((t * 41 + i * 7 + 3) % 500).to_string())
                .collect();
            format!("[{}]", ids.join(", "))
        })
        .collect();
    fs::write(&prompts, lines.join("\n")).unwrap();
    let eval = |gpus: &str, env: &[(String, String)]| {
        let out = std::process::Command::new(bin("dflash-supervise"))
            .args(["eval", "--target"])
            .arg(sup.run_dir.join("target"))
            .arg("--drafter")
            .arg(sup.run_dir.join("drafter"))
            .arg("--prompts")
            .arg(&prompts)
            .args(["--max-new-tokens", "8", "--json", "--gpus", gpus])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), text)
    };
    let (code, cpu) = eval("cpu", &[]);
    assert_eq!(code, Some(0), "{cpu}");
    let (code, gpu) = eval("0", &env);
    assert_eq!(code, Some(0), "{gpu}");
    let (cpu, gpu): (Value, Value) = (
        serde_json::from_str(&cpu).unwrap_or_else(|e| panic!("{e}: {cpu}")),
        serde_json::from_str(&gpu).unwrap_or_else(|e| panic!("{e}: {gpu}")),
    );
    assert_eq!(
        (cpu["device"].as_str(), gpu["device"].as_str()),
        (Some("cpu"), Some("gpu"))
    );
    assert_eq!(gpu["prompts"], 4);
    let bs = gpu["block_size"].as_f64().unwrap();
    for def in ["pooled", "mean_of_means"] {
        let t = gpu["tau"][def].as_f64().unwrap();
        let ci = &gpu["tau"][format!("{def}_ci95")];
        assert!((1.0..=bs).contains(&t), "{def} {t}: {gpu}");
        assert!(
            ci[0].as_f64().unwrap() <= t && t <= ci[1].as_f64().unwrap(),
            "{gpu}"
        );
    }
    assert!(gpu["identical_to_greedy"].as_u64().unwrap() <= 4);
    for (c, g) in cpu["per_prompt"]
        .as_array()
        .unwrap()
        .iter()
        .zip(gpu["per_prompt"].as_array().unwrap())
    {
        assert_eq!(c["prompt_tokens"], g["prompt_tokens"]);
        assert_eq!(g["tokens"].as_array().unwrap().len(), 8, "{g}");
        assert_eq!(
            c["tokens"][0], g["tokens"][0],
            "the prefill's argmax: cpu {c}, gpu {g}"
        );
        let accepted: u64 = g["accepted"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_u64().unwrap())
            .sum();
        assert_eq!(
            accepted + 1,
            8,
            "the prefill's token and the verify steps' make 8: {g}"
        );
    }
    // A GPU that cannot be opened (no CUDA driver where it looks): one line, exit 2.
    let (code, text) = eval(
        "0",
        &[("DFLASH_CUDA_LIB".into(), "/nonexistent/libcuda.so".into())],
    );
    assert_eq!(code, Some(2), "{text}");
    assert!(text.lines().count() == 1 && text.contains("GPU"), "{text}");
    // The target over two GPUs (its layers split, the drafter on the first): what one
    // GPU decodes, token for token and block for block (the same bf16 kernels on each).
    let two = tmp.path().join("two");
    fs::create_dir_all(&two).unwrap();
    let (code, split) = eval("0,1", &emulated(&two, 2));
    assert_eq!(code, Some(0), "{split}");
    let split: Value = serde_json::from_str(&split).unwrap_or_else(|e| panic!("{e}: {split}"));
    for (g, s) in gpu["per_prompt"]
        .as_array()
        .unwrap()
        .iter()
        .zip(split["per_prompt"].as_array().unwrap())
    {
        assert_eq!(
            (&g["tokens"], &g["accepted"]),
            (&s["tokens"], &s["accepted"]),
            "one GPU {g}, two {s}"
        );
    }
    assert_eq!(split["per_prompt"].as_array().unwrap().len(), 4);
    let (code, text) = eval("0,x", &[]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("--gpus 0,x") && text.contains("expected cpu, one GPU index"),
        "{text}"
    );
}

/// A CUDA toolkit's `stubs/` directory on `LD_LIBRARY_PATH` ahead of the driver: its
/// `libcuda.so` answers every call with `CUDA_ERROR_STUB_LIBRARY`, and the CUDA bindings
/// open `libcuda.so` before the driver's own `libcuda.so.1`. The worker opens the driver
/// (`libcuda.so.1`, here the emulated one under that soname), sees that the bindings would
/// get the stub instead, and stops the run with one line naming the stub and what to
/// change; with only the stub there, the line says so. No restart is spent on either.
#[test]
fn a_toolkit_stub_on_the_loader_path_is_named_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let (stubs, drv) = (tmp.path().join("cuda/stubs"), tmp.path().join("driver"));
    fs::create_dir_all(&stubs).unwrap();
    fs::create_dir_all(&drv).unwrap();
    std::os::unix::fs::symlink(fake_cuda(), stubs.join("libcuda.so")).unwrap();
    std::os::unix::fs::symlink(
        target_dir().join("libdflash_emu_cuda.so"),
        drv.join("libcuda.so.1"),
    )
    .unwrap();
    let run = |dirs: &[&std::path::Path]| {
        let mut env: Vec<(String, String)> = emulated(tmp.path(), 2)
            .into_iter()
            .filter(|(k, _)| k != "DFLASH_CUDA_LIB")
            .collect();
        let mut path: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        if let Ok(p) = std::env::var("LD_LIBRARY_PATH") {
            path.extend(p.split(':').filter(|s| !s.is_empty()).map(String::from));
        }
        env.push(("LD_LIBRARY_PATH".into(), path.join(":")));
        env.push(("DFLASH_FAKE_CUDA_STUB".into(), "1".into()));
        let mut sup = start(
            &["--gpus", "0-1", "--max-restarts", "50", "--no-gpu-metrics"],
            &env,
        );
        let status = sup.wait_exit(T);
        let err = sup.stderr();
        assert_eq!(status.code(), Some(1), "{err}");
        let events = sup.events();
        assert_eq!(
            events.iter().filter(|e| e["event"] == "restart").count(),
            0,
            "a permanent failure spends no restart: {events:?}"
        );
        let line = err
            .lines()
            .find(|l| l.starts_with("dflash-supervise: run failed:"))
            .unwrap_or_default()
            .to_string();
        (line, err)
    };
    let stub = stubs.join("libcuda.so");
    let stub = stub.display();
    // The stub first, the driver after it.
    let (line, err) = run(&[&stubs, &drv]);
    assert!(
        line.contains("was not restarted")
            && line.contains(&format!("resolves libcuda.so to {stub}"))
            && line.contains("CUDA_ERROR_STUB_LIBRARY")
            && line.contains(&format!("take {} off LD_LIBRARY_PATH", stubs.display()))
            && line.contains(&format!(
                "not to {} chosen here",
                fs::canonicalize(target_dir().join("libdflash_emu_cuda.so"))
                    .unwrap()
                    .display()
            )),
        "stub at {stub}: {err}"
    );
    // Only the stub: no driver, said as such.
    let (line, err) = run(&[&stubs]);
    assert!(
        line.contains("found only the CUDA toolkit's stub library")
            && line.contains(&stub.to_string())
            && line.contains("install the NVIDIA driver"),
        "{err}"
    );
}

/// `--gpus-per-target 2` on the native engine over emulated GPUs: the target worker holds
/// GPUs 0 and 1, its layers in contiguous ranges over them, the residual stream handed
/// from one to the other; the drafter on GPU 2 trains on taps bit for bit those of the
/// target on one GPU: every step's loss equals the one-GPU run's. A split that leaves no
/// drafter is refused in one line saying what would fit.
#[test]
fn a_target_over_two_emulated_gpus_captures_what_it_captures_on_one() {
    if skip_without_nvrtc() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let env = emulated(tmp.path(), 3);
    let run = |gpus: &str, extra: &[&str]| {
        let mut a = vec![
            "--gpus",
            gpus,
            "--data",
            "demo",
            "--steps",
            "4",
            "--max-seq-len",
            "16",
            "--token-budget",
            "128",
            "--no-gpu-metrics",
        ];
        a.extend_from_slice(extra);
        let mut sup = start(&a, &env);
        let status = sup.wait_exit(T);
        assert_eq!(status.code(), Some(0), "{gpus} {extra:?}: {}", sup.stderr());
        clean_ledger(&sup);
        sup
    };
    let one = run("0-1", &[]);
    let two = run("0-2", &["--gpus-per-target", "2"]);
    let log = two.log("target-0");
    assert!(
        log.contains("target split over 2 GPUs: GPU 0: layers 0-")
            && log.contains(", GPU 1: layers "),
        "{log}"
    );
    assert!(
        two.stderr().contains("each target worker holds 2 GPUs"),
        "{}",
        two.stderr()
    );
    let loss = |s: &Sup| -> Vec<f64> {
        steps(s)
            .iter()
            .map(|l| l["loss"].as_f64().unwrap())
            .collect()
    };
    let (a, b) = (loss(&one), loss(&two));
    assert_eq!(a.len(), 4);
    assert!(a.iter().all(|l| l.is_finite() && *l > 0.0), "{a:?}");
    assert_eq!(a, b, "the same taps, the same losses");
    // Refused before any worker starts.
    let run_dir = tmp.path().join("refused");
    let o = std::process::Command::new(bin("dflash-supervise"))
        .args([
            "--gpus",
            "0-2",
            "--gpus-per-target",
            "3",
            "--no-gpu-metrics",
        ])
        .arg("--run-dir")
        .arg(&run_dir)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("takes 3 of the 3 device(s) and leaves no drafter")
            && err.contains("at most --gpus-per-target 2"),
        "{err}"
    );
    assert!(!run_dir.join("workers").exists());
}

/// A target whose weights do not fit its GPU (NVML's memory: here GPUs 0 and 1 of 256
/// KiB, 2 and 3 large) is refused before any worker starts, in one line saying how many
/// GPUs per target would hold it; with that many, the run trains. A drafter placed on a
/// GPU too small for its training state is refused the same way.
#[test]
fn a_target_too_large_for_one_gpu_is_refused_saying_how_many_would_hold_it() {
    let tmp = tempfile::tempdir().unwrap();
    let mut env = emulated(tmp.path(), 4);
    with_gpu_memory(tmp.path(), &mut env, &[262144, 262144, BIG, BIG]);
    let run = |extra: &[&str], dir: &str| {
        std::process::Command::new(bin("dflash-supervise"))
            .args([
                "--gpus",
                "0-3",
                "--targets",
                "1",
                "--data",
                "demo",
                "--steps",
                "2",
                "--max-seq-len",
                "16",
            ])
            .args(["--token-budget", "128", "--no-gpu-metrics"])
            .args(extra)
            .arg("--run-dir")
            .arg(tmp.path().join(dir))
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .unwrap()
    };
    let o = run(&[], "refused");
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("target-0: the target's weights it loads (")
            && err.contains("do not fit in 90% of a GPU of 256.0 KiB"),
        "{err}"
    );
    assert!(!tmp.path().join("refused").join("workers").exists());
    let n: u32 = err
        .split("--gpus-per-target ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no --gpus-per-target N in {err}"));
    assert!((2..4).contains(&n), "{err}");
    // A drafter on a small GPU: its weights, gradients and Adam state alone do not fit.
    let o = std::process::Command::new(bin("dflash-supervise"))
        .args([
            "--target-gpus",
            "2",
            "--drafter-gpus",
            "0",
            "--data",
            "demo",
            "--steps",
            "2",
        ])
        .args([
            "--max-seq-len",
            "16",
            "--token-budget",
            "128",
            "--no-gpu-metrics",
        ])
        .arg("--run-dir")
        .arg(tmp.path().join("drafter"))
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("drafter-0: the drafter's training state (")
            && err.contains("do not fit in 90% of GPU 0 (256.0 KiB"),
        "{err}"
    );
    assert!(!tmp.path().join("drafter").join("workers").exists());
    if skip_without_nvrtc() {
        return;
    }
    let o = run(&["--gpus-per-target", &n.to_string()], "fits");
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(0), "--gpus-per-target {n}: {err}");
}

/// `--targets auto` may move any device to either role: a GPU that holds the target but not
/// a drafter's training state is refused before anything starts, naming it.
#[test]
fn with_targets_auto_every_gpu_must_hold_either_role() {
    let tmp = tempfile::tempdir().unwrap();
    let mut env = emulated(tmp.path(), 4);
    // GPU 0: 1 MiB, room for the tiny target's weights, not for a drafter.
    with_gpu_memory(tmp.path(), &mut env, &[1 << 20, BIG, BIG, BIG]);
    let o = std::process::Command::new(bin("dflash-supervise"))
        .args(["--gpus", "0-3", "--targets", "auto:1", "--data", "demo"])
        .args([
            "--steps",
            "2",
            "--max-seq-len",
            "16",
            "--token-budget",
            "128",
        ])
        .arg("--no-gpu-metrics")
        .arg("--run-dir")
        .arg(tmp.path().join("auto"))
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("--targets auto (the default on 3 or more devices: any device may come to run either role)")
            && err.contains("the drafter's training state (")
            && err.contains("do not fit in 90% of GPU 0 (1.0 MiB")
            && err.contains("--targets N"),
        "{err}"
    );
    assert!(!tmp.path().join("auto").join("workers").exists());
}

/// `--targets auto` on GPUs (issue 44): the emulated stack's drafters exchange gradients
/// over NCCL (the collective double); a move takes a drafter out of the group (its next
/// epoch forms without it) and starts a target on its GPU, and training goes on with
/// nothing lost or trained twice.
#[test]
fn targets_auto_moves_a_gpu_out_of_the_nccl_group_and_training_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let mut env = emulated(tmp.path(), 4);
    if skip_without_nvrtc() {
        return;
    }
    // Slow targets: a second and a half added to every target batch.
    env.push(("DFLASH_TEST_BATCH_DELAY_MS".into(), "1500".into()));
    let mut sup = start(
        &[
            "--gpus",
            "0-3",
            "--targets",
            "auto:1",
            "--data",
            "demo",
            "--demo-samples",
            "4000",
            "--max-seq-len",
            "16",
            "--token-budget",
            "128",
            "--metrics-interval",
            "2s",
        ],
        &env,
    );
    let t = Duration::from_secs(240);
    let moved = wait_for("a move", t, || {
        sup.events().into_iter().find(|e| e["event"] == "role_move")
    });
    assert_eq!(
        (moved["from"].as_str(), moved["to"].as_str()),
        (Some("drafter-2"), Some("target-1"))
    );
    let at = moved["step"].as_u64().unwrap();
    // Training goes on past the move, the new target among the producers.
    wait_for("steps after the move", t, || {
        (steps(&sup).len() as u64 >= at + 4).then_some(())
    });
    sup.signal(nix::sys::signal::Signal::SIGTERM);
    let status = sup.wait_exit(t);
    let err = sup.stderr();
    assert_eq!(status.code(), Some(75), "{err}");
    let resolved: Value =
        serde_json::from_str(&fs::read_to_string(sup.run_dir.join("run.json")).unwrap()).unwrap();
    assert_eq!(resolved["resolved"]["collective"], "NCCL", "{resolved}");
    // The group's epoch after the move leaves rank 2 out.
    let epochs: Vec<Value> = sup
        .events()
        .into_iter()
        .filter(|e| e["event"] == "group_epoch")
        .collect();
    assert!(
        epochs
            .iter()
            .any(|e| e["ranks"] == serde_json::json!([0, 1])),
        "{epochs:?}"
    );
    assert!(sup.log("target-1").contains("started pid"), "{err}");
    let s = steps(&sup);
    let numbers: Vec<u64> = s.iter().filter_map(|l| l["step"].as_u64()).collect();
    assert!(numbers.windows(2).all(|w| w[1] == w[0] + 1), "{numbers:?}");
    clean_ledger(&sup);
}
