//! `--target-engine torch`: the target worker's Python child runs transformers'
//! implementation and writes the taps into the hidden-state pool. Checked against the
//! native engine, an independent implementation of the same models: the taps of tiny
//! Qwen3, Qwen3-MoE and Llama checkpoints (made with transformers here) agree within 1e-5 of
//! their scale; a run's first steps have the native run's losses; the child killed
//! mid-run costs a worker restart and no batch; a missing torch is one line at the start.
//! Needs python3 with torch and transformers: skips on a laptop without, fails under CI.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;

/// Tiny random checkpoints of three families, made with transformers (float32).
const MAKE: &str = r#"
import sys, torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig, LlamaConfig
torch.manual_seed(0)
base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
cfgs = {
    "qwen3": Qwen3Config(**base),
    "qwen3_moe": Qwen3MoeConfig(**base, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True),
    "llama": LlamaConfig(**base),
}
for name, cfg in cfgs.items():
    m = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.08)
    m.save_pretrained(f"{sys.argv[1]}/{name}")
"#;

fn read_hidden(p: &Path) -> Vec<f32> {
    let bytes = fs::read(p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("hidden").unwrap();
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn torch_taps_equal_native_taps_on_qwen3_qwen3_moe_and_llama() {
    if !have_torch() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new("python3")
        .args(["-c", MAKE])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tokens = "3,17,99,5,64,127,0,42,8,8,21,77";
    for family in ["qwen3", "qwen3_moe", "llama"] {
        let dir = tmp.path().join(family);
        let mut taps = Vec::new();
        for engine in ["native", "torch"] {
            let out = tmp.path().join(format!("{family}-{engine}.safetensors"));
            let o = Command::new(bin("dflash-worker"))
                .args([
                    "inspect",
                    "--target",
                    dir.to_str().unwrap(),
                    "--tokens",
                    tokens,
                ])
                .args([
                    "--taps",
                    "0,2",
                    "--engine",
                    engine,
                    "--out",
                    out.to_str().unwrap(),
                ])
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "{family} {engine}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            taps.push(read_hidden(&out));
        }
        let (native, torch) = (&taps[0], &taps[1]);
        assert_eq!(native.len(), 12 * 2 * 64, "{family}");
        assert_eq!(native.len(), torch.len(), "{family}");
        let scale = native.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = native
            .iter()
            .zip(torch)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!("{family}: max |native - torch| {diff:.3e} at scale {scale:.3}");
        assert!(scale > 0.1, "{family}: taps of a real forward: {scale}");
        assert!(diff <= 1e-5 * scale, "{family}: {diff} > 1e-5 × {scale}");
    }
}

fn losses(run: &Path) -> Vec<f64> {
    read_jsonl(&run.join("train.jsonl"))
        .iter()
        .filter_map(|l| l["loss"].as_f64())
        .collect()
}

#[test]
fn a_run_on_the_torch_engine_has_the_native_runs_losses() {
    if !have_torch() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut got = Vec::new();
    for engine in ["native", "torch"] {
        let run = tmp.path().join(engine);
        let o = supervise(
            &[
                "--gpus",
                "cpu:2",
                "--steps",
                "3",
                "--seed",
                "5",
                "--target-engine",
                engine,
                "--run-dir",
                run.to_str().unwrap(),
            ],
            None,
        );
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(0), "{engine}: {err}");
        assert!(err.contains(&format!("target engine: {engine}")), "{err}");
        let log = fs::read_to_string(run.join("logs/target-0.log")).unwrap();
        if engine == "torch" {
            assert!(
                log.contains("target loaded by the torch engine (transformers"),
                "{log}"
            );
        }
        got.push(losses(&run));
    }
    let (native, torch) = (&got[0], &got[1]);
    println!("losses: native {native:?}, torch {torch:?}");
    assert_eq!(native.len(), 3);
    assert_eq!(torch.len(), 3);
    for (a, b) in native.iter().zip(torch) {
        // Both store the taps in bf16: f32 sums in another order may round a few apart.
        assert!(
            (a - b).abs() <= 1e-3 * a.abs(),
            "losses {native:?} vs {torch:?}"
        );
    }
}

/// The pid of target-0's Python child, once the run has trained two steps.
fn torch_child_after_two_steps(sup: &mut Sup) -> u32 {
    let st = sup.wait_running(2);
    let target = pid_of(&st, "target-0");
    wait_for("two trained steps", Duration::from_secs(120), || {
        (read_jsonl(&sup.run_dir.join("train.jsonl")).len() >= 2).then_some(())
    });
    wait_for("the python child", Duration::from_secs(60), || {
        children(target).first().copied()
    })
}

#[test]
fn the_python_child_killed_mid_run_costs_a_restart_and_no_batch() {
    if !have_torch() {
        return;
    }
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--steps",
        "40",
        "--target-engine",
        "torch",
        "--data",
        "demo",
    ]);
    let child = torch_child_after_two_steps(&mut sup);
    signal(child, nix::sys::signal::Signal::SIGKILL);
    let status = sup.wait_exit(Duration::from_secs(180));
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "{err}");
    let st: Value = sup.state().unwrap();
    assert!(
        worker(&st, "target-0")["restarts"].as_u64().unwrap() >= 1,
        "{st}"
    );
    let log = sup.log("target-0");
    assert!(
        log.contains("torch engine: the Python child ended"),
        "{log}"
    );
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
    assert_eq!(
        (a["lost"].as_u64(), a["duplicated"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
    assert_eq!(read_jsonl(&sup.run_dir.join("train.jsonl")).len(), 40);
}

/// A Python child that hangs (stopped mid-run) holds its target's batch past
/// `--step-timeout`: the supervisor kills the worker as hung, saying the torch engine's
/// child was running the batch, the worker restarts with a fresh child, the batch is
/// delivered again and the run ends with a clean ledger.
#[test]
fn a_hung_python_child_is_a_hung_target_restarted_with_its_batch_delivered_again() {
    if !have_torch() {
        return;
    }
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--steps",
        "12",
        "--target-engine",
        "torch",
        "--data",
        "demo",
        "--step-timeout",
        "6s",
    ]);
    let child = torch_child_after_two_steps(&mut sup);
    signal(child, nix::sys::signal::Signal::SIGSTOP);
    let status = sup.wait_exit(Duration::from_secs(240));
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "{err}");
    let hangs: Vec<Value> = sup
        .events()
        .into_iter()
        .filter(|e| e["event"] == "hang" && e["worker"] == "target-0")
        .collect();
    assert_eq!(hangs.len(), 1, "{hangs:?}\n{err}");
    let reason = hangs[0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("the target runs on the torch engine: its Python child (transformers) was running the batch"),
        "{reason}"
    );
    let st: Value = sup.state().unwrap();
    assert!(
        worker(&st, "target-0")["restarts"].as_u64().unwrap() >= 1,
        "{st}"
    );
    // The stopped child went with its worker.
    assert!(
        !std::path::Path::new(&format!("/proc/{child}")).exists()
            || fs::read_to_string(format!("/proc/{child}/stat")).is_ok_and(|s| s.contains(") Z ")),
        "the stopped child outlived its worker"
    );
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{a}");
    assert_eq!(
        (a["lost"].as_u64(), a["duplicated"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
    let steps = read_jsonl(&sup.run_dir.join("train.jsonl"));
    assert_eq!(steps.iter().filter(|l| l.get("tau").is_none()).count(), 12);
}

/// A checkpoint of an architecture the installed transformers does not know (one newer
/// than it) is refused at the start, before any worker, in one line naming the upgrade.
#[test]
fn an_architecture_transformers_does_not_know_is_refused_at_the_start() {
    if !have_torch() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("newer");
    let o = Command::new("python3")
        .args(["-c", FAMILY, "gpt_oss"])
        .arg(&target)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let path = target.join("config.json");
    let mut cfg: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    cfg["model_type"] = "a_family_from_next_year".into();
    cfg["architectures"] = serde_json::json!(["AFamilyFromNextYearForCausalLM"]);
    fs::write(&path, cfg.to_string()).unwrap();
    let run = tmp.path().join("run");
    let o = Command::new(bin("dflash-supervise"))
        .args([
            "--gpus", "cpu:2", "--steps", "2", "--data", "demo", "--target",
        ])
        .arg(&target)
        .arg("--run-dir")
        .arg(&run)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("the torch target engine (a_family_from_next_year)")
            && err.contains("does not know the target's architecture")
            && err.contains("a_family_from_next_year")
            && err.contains("pip install -U transformers"),
        "{err}"
    );
    assert!(!run.exists(), "nothing made before the refusal");
}

#[test]
fn a_python_without_torch_is_refused_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let fake = tmp.path().join("python");
    fs::write(
        &fake,
        "#!/bin/sh\necho 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
    let o = Command::new(bin("dflash-supervise"))
        .args([
            "--gpus",
            "cpu:2",
            "--steps",
            "1",
            "--target-engine",
            "torch",
            "--run-dir",
        ])
        .arg(tmp.path().join("run"))
        .env("DFLASH_PYTHON", &fake)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--target-engine torch")
            && err.contains("No module named torch")
            && err.contains("pip install torch transformers"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!tmp.path().join("run").exists());
}

/// A tiny random checkpoint of a family the native engine does not serve (vocabulary 512,
/// as the demo data's ids), made with transformers' `from_config`.
const FAMILY: &str = r#"
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
torch.manual_seed(0)
name, out = sys.argv[1], sys.argv[2]
kw = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
linear = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
moe = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=1, n_group=1, topk_group=1)
kw.update({
    "gpt_oss": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen3_5_text": dict(intermediate_size=96, **linear),
    "glm4_moe": dict(intermediate_size=96, **moe),
    "deepseek_v3": dict(intermediate_size=96, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, **moe),
    "minimax_m2": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, rotary_dim=8,
                       bos_token_id=1, eos_token_id=2),
    # Gemma's embedding scaled by sqrt(hidden) and its lm_head tied to the unscaled table.
    "gemma3_text": dict(intermediate_size=96, sliding_window=32, tie_word_embeddings=True,
                        layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "qwen3_5": dict(intermediate_size=96, **linear),
}[name])
if name == "deepseek_v3":
    kw.pop("head_dim")
if name == "qwen3_5":
    # The published multimodal checkpoint's layout: the language model nested under
    # model.language_model, beside a (tiny) vision tower.
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16)
    cfg = AutoConfig.for_model(name, text_config=kw, vision_config=vision, tie_word_embeddings=False,
                               image_token_id=508, video_token_id=509, vision_start_token_id=510,
                               vision_end_token_id=511)
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(out)
else:
    AutoModelForCausalLM.from_config(AutoConfig.for_model(name, **kw)).save_pretrained(out)
"#;

/// A family the native engine does not serve: `auto` picks the torch engine, a drafter
/// trains 20 steps with a clean ledger (τ measured at the end by the torch engine),
/// exports, the export passes `export-check`, and `eval` decodes with it losslessly (the
/// torch engine's KV cache cut back, or rebuilt where sliding windows or linear attention
/// cannot be cut, after every verify step).
fn family_trains_and_exports(family: &str) {
    if !have_torch() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join(family);
    let o = Command::new("python3")
        .args(["-c", FAMILY, family])
        .arg(&target)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{family}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    // Longer than gpt-oss's sliding window (32) once decoded: its cache is rebuilt.
    let prompts = tmp.path().join("prompts.jsonl");
    let lines: Vec<String> = (0..4)
        .map(|i| {
            let ids: Vec<u32> = (0..6 + 7 * i)
                .map(|t| (t * 37 + i * 11 + 3) % 500)
                .collect();
            serde_json::json!({"input_ids": ids, "category": if i % 2 == 0 { "a" } else { "b" }})
                .to_string()
        })
        .collect();
    fs::write(&prompts, lines.join("\n")).unwrap();
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--steps",
        "20",
        "--target",
        target.to_str().unwrap(),
        "--data",
        "demo",
        "--eval-prompts",
        prompts.to_str().unwrap(),
        "--eval-max-new-tokens",
        "12",
    ]);
    let status = sup.wait_exit(Duration::from_secs(180));
    let err = sup.stderr();
    assert_eq!(status.code(), Some(0), "{family}: {err}");
    assert!(
        err.contains(&format!(
            "target engine: torch (the native engine does not serve {family}"
        )),
        "{err}"
    );
    let log = sup.log("target-0");
    assert!(log.contains("target loaded by the torch engine"), "{log}");
    let (tau, steps): (Vec<Value>, Vec<Value>) = read_jsonl(&sup.run_dir.join("train.jsonl"))
        .into_iter()
        .partition(|l| l.get("tau").is_some());
    assert_eq!(steps.len(), 20, "{family}");
    assert_eq!(tau.len(), 1, "{family}: the last step's τ: {tau:?}");
    assert!(steps
        .iter()
        .all(|s| s["loss"].as_f64().is_some_and(f64::is_finite)));
    let (code, a) = sup.ledger();
    assert_eq!(code, 0, "{family}: {a}");
    assert_eq!(
        (a["lost"].as_u64(), a["duplicated"].as_u64()),
        (Some(0), Some(0)),
        "{a}"
    );
    let drafter = sup.run_dir.join("drafter");
    let cfg: Value =
        serde_json::from_str(&fs::read_to_string(drafter.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["dflash_target"]["model_type"], family, "{cfg}");
    // No tokenizer beside these checkpoints: the MASK token is the last id, and says so.
    assert_eq!(cfg["dflash_config"]["mask_token_id"], 511, "{cfg}");
    assert_eq!(
        cfg["dflash_training"]["mask_token"],
        "511: the vocabulary's last id (no tokenizer.json to read)",
        "{cfg}"
    );
    let o = Command::new(bin("dflash-supervise"))
        .arg("export-check")
        .arg(&drafter)
        .env("HF_MODULES_CACHE", tmp.path().join("hf-modules"))
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{family}: export-check: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    // τ of the last step, decoded by the torch engine beside training.
    let report: Value = serde_json::from_str(
        &fs::read_to_string(sup.run_dir.join("eval").join("tau-step-00000020.json"))
            .unwrap_or_else(|e| panic!("{family}: no τ of step 20 ({e}): {err}")),
    )
    .unwrap();
    assert_eq!(
        (&report["engine"], &report["identical_to_greedy"]),
        (&Value::from("torch"), &Value::from(4)),
        "{report}"
    );
    // eval, the target found from the export's record.
    let o = Command::new(bin("dflash-supervise"))
        .arg("eval")
        .arg("--drafter")
        .arg(&drafter)
        .arg("--prompts")
        .arg(&prompts)
        .args(["--max-new-tokens", "40", "--json"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{family}: eval: {err}");
    assert!(
        err.contains(&format!(
            "eval: target engine: torch (the native engine does not serve {family}"
        )),
        "{err}"
    );
    let r: Value = serde_json::from_str(String::from_utf8_lossy(&o.stdout).trim()).unwrap();
    assert_eq!(r["engine"], "torch", "{r}");
    assert_eq!(r["identical_to_greedy"], 4, "{family}: {r}");
    let per = r["per_prompt"].as_array().unwrap();
    let steps: u64 = per
        .iter()
        .map(|p| p["accepted"].as_array().unwrap().len() as u64)
        .sum();
    assert_eq!(r["tau"]["verify_steps"], steps, "{r}");
    assert!(
        per.iter().all(|p| {
            let n = p["tokens"].as_array().unwrap().len();
            (1..=40).contains(&n)
                && p["tokens"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|t| t.as_u64().unwrap() < 512)
        }),
        "{r}"
    );
}

#[test]
fn gpt_oss_trains_on_the_torch_engine() {
    family_trains_and_exports("gpt_oss");
}

#[test]
fn qwen3_5_trains_on_the_torch_engine() {
    family_trains_and_exports("qwen3_5_text");
}

#[test]
fn glm4_moe_trains_on_the_torch_engine() {
    family_trains_and_exports("glm4_moe");
}

#[test]
fn deepseek_v3_trains_on_the_torch_engine() {
    family_trains_and_exports("deepseek_v3");
}

#[test]
fn minimax_m2_trains_on_the_torch_engine() {
    family_trains_and_exports("minimax_m2");
}

#[test]
fn the_native_engine_refuses_a_family_it_does_not_serve_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("t");
    fs::create_dir_all(&target).unwrap();
    fs::write(
        target.join("config.json"),
        r#"{"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "vocab_size": 512}"#,
    )
    .unwrap();
    let o = supervise(
        &[
            "--gpus",
            "cpu:2",
            "--target",
            target.to_str().unwrap(),
            "--target-engine",
            "native",
            "--run-dir",
            tmp.path().join("run").to_str().unwrap(),
        ],
        None,
    );
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("the native engine serves Qwen3, Qwen3-MoE and Llama, not gpt_oss"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// NVML is the supervisor's alone: a Python child that has it in its address space (here
/// preloaded by the interpreter's wrapper) stops the run with one line naming it, as a
/// permanent failure (not restarted).
#[test]
fn a_python_child_with_nvml_loaded_is_refused_as_permanent() {
    if !have_torch() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let lib = tmp.path().join("libnvidia-ml.so.1");
    fs::copy(fake_nvml(), &lib).unwrap();
    let py = tmp.path().join("python");
    fs::write(
        &py,
        format!(
            "#!/bin/sh\nLD_PRELOAD={} exec python3 \"$@\"\n",
            lib.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&py, fs::Permissions::from_mode(0o755)).unwrap();
    let mut sup = Sup::start_real_env(
        &[
            "--gpus",
            "cpu:2",
            "--steps",
            "5",
            "--target-engine",
            "torch",
            "--data",
            "demo",
        ],
        &[("DFLASH_PYTHON", py.to_str().unwrap())],
    );
    let status = sup.wait_exit(Duration::from_secs(120));
    let err = sup.stderr();
    assert_ne!(status.code(), Some(0), "{err}");
    assert!(
        err.contains("the Python child loaded NVML") && err.contains("libnvidia-ml.so.1"),
        "{err}"
    );
    let st: Value = sup.state().unwrap();
    assert_eq!(
        worker(&st, "target-0")["restarts"].as_u64(),
        Some(0),
        "permanent: {st}"
    );
}

#[test]
fn gemma3_text_trains_on_the_torch_engine() {
    family_trains_and_exports("gemma3_text");
}

/// Qwen3.5 as published: the multimodal checkpoint (`Qwen3_5ForConditionalGeneration`), its
/// language model's weights under `model.language_model.`, a vision tower beside it.
#[test]
fn a_nested_multimodal_qwen3_5_checkpoint_trains_on_the_torch_engine() {
    family_trains_and_exports("qwen3_5");
}
