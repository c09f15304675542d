//! `dflash-supervise plan`: the split of the devices between target and drafter workers,
//! from NVML (a fake libnvidia-ml scripted as eight H200s, or GPUs too small), from a
//! run's own measurements (`--from`), and refused with a reason when nothing fits.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::*;
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

/// A Qwen3-8B-shaped target (its config.json: plan reads shapes, not weights).
fn qwen3_8b(dir: &Path) {
    fs::write(
        dir.join("config.json"),
        r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000, "max_position_embeddings": 40960, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
}

fn gpus(dir: &Path, n: usize, name: &str, bytes: u64) -> std::path::PathBuf {
    let one = format!(r#"{{"name": "{name}", "uuid": "GPU-x", "memory_total": {bytes}}}"#);
    let p = dir.join("nvml.json");
    fs::write(
        &p,
        format!(
            r#"{{"driver": "550.54.15", "devices": [{}]}}"#,
            vec![one; n].join(",")
        ),
    )
    .unwrap();
    p
}

fn plan(args: &[&str], nvml: Option<&Path>) -> Output {
    let mut c = Command::new(bin("dflash-supervise"));
    c.arg("plan").args(args);
    if let Some(s) = nvml {
        c.env("DFLASH_NVML_LIBRARY", fake_nvml())
            .env("DFLASH_FAKE_NVML", s);
    }
    c.output().unwrap()
}

#[test]
fn plan_lists_every_split_of_eight_gpus_and_recommends_the_fastest_that_fits() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("qwen3-8b");
    fs::create_dir(&target).unwrap();
    qwen3_8b(&target);
    let nvml = gpus(tmp.path(), 8, "NVIDIA H200", 140 << 30);
    let t = target.to_str().unwrap();
    let out = plan(&["--target", t, "--data", "demo", "--json"], Some(&nvml));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    let splits = p["splits"].as_array().unwrap();
    // 1 + 7 up to 7 + 1.
    assert_eq!(splits.len(), 7, "{p:#}");
    assert_eq!(p["rates"]["source"], "roofline");
    // The drafter's state is 26 bytes per parameter; a target holds its weights up to the
    // last tap (bf16), about 13 GiB of the 16 GB model.
    let drafter = &p["drafter"];
    assert!(
        drafter["weights_bytes"].as_u64().unwrap() % 26 == 0,
        "{drafter}"
    );
    let target_weights = p["target"]["weights_bytes"].as_u64().unwrap();
    assert!(
        (10 << 30..16 << 30).contains(&target_weights),
        "{target_weights}"
    );
    // Each split's figure is its slower role's, and the recommendation is the best.
    let (rt, rd) = (
        p["rates"]["target_tokens_per_s"].as_f64().unwrap(),
        p["rates"]["drafter_tokens_per_s"].as_f64().unwrap(),
    );
    let mut best = (0, 0.0);
    for s in splits {
        let (t, d) = (
            s["targets"].as_f64().unwrap(),
            s["drafters"].as_f64().unwrap(),
        );
        assert_eq!(t + d, 8.0);
        let want = (t * rt).min(d * rd);
        let got = s["tokens_per_s"].as_f64().unwrap();
        assert!((got - want).abs() <= 1e-9 * want, "{s}");
        if got > best.1 {
            best = (t as u64, got);
        }
    }
    assert_eq!(p["recommended"].as_u64(), Some(best.0), "{p:#}");
    let cmd = p["command"].as_str().unwrap();
    assert!(
        cmd.starts_with("dflash-supervise --target ")
            && cmd.ends_with(&format!("--targets {}", best.0)),
        "{cmd}"
    );
    // A recipe (--config) is read as a run reads it: its rows and anchors change the
    // drafter's work per token, and the command keeps it.
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../recipes/qwen3-8b.toml");
    let args = [
        "--config",
        recipe.to_str().unwrap(),
        "--target",
        t,
        "--data",
        "demo",
        "--json",
    ];
    let out = plan(&args, Some(&nvml));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_ne!(
        r["drafter_flops_per_token"], p["drafter_flops_per_token"],
        "{r:#}"
    );
    assert_eq!(
        r["target"]["weights_bytes"], p["target"]["weights_bytes"],
        "{r:#}"
    );
    assert!(
        r["command"].as_str().unwrap().contains("--config "),
        "{r:#}"
    );
    // The same in words.
    let out = plan(&["--target", t, "--data", "demo"], Some(&nvml));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("8 × NVIDIA H200"), "{text}");
    assert!(
        text.contains("<- recommended") && text.contains("recommended: dflash-supervise"),
        "{text}"
    );
}

#[test]
fn plan_refuses_gpus_too_small_for_either_role_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("qwen3-8b");
    fs::create_dir(&target).unwrap();
    qwen3_8b(&target);
    let nvml = gpus(tmp.path(), 4, "NVIDIA A10G", 8 << 30);
    let out = plan(
        &["--target", target.to_str().unwrap(), "--data", "demo"],
        Some(&nvml),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("no split"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.contains("a target worker needs") && line.contains("GPU 0 (NVIDIA A10G) has 8.0 GiB"),
        "{line}"
    );
    // Neither role fits: the drafter is named with what makes it smaller.
    assert!(
        line.contains("a drafter worker needs") && line.contains("--draft-layers"),
        "{line}"
    );

    // A target too large for one 12 GiB GPU beside a drafter that fits one: the refusal
    // names the --gpus-per-target that fits, and with it the plan recommends a split.
    let nvml = gpus(tmp.path(), 8, "NVIDIA A10G", 12 << 30);
    let small = [
        "--target",
        target.to_str().unwrap(),
        "--data",
        "demo",
        "--draft-layers",
        "1",
        "--taps",
        "1,9,17,25,33",
        "--max-seq-len",
        "512",
        "--token-budget",
        "512",
        "--max-anchors",
        "16",
    ];
    let out = plan(&small, Some(&nvml));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("; --gpus-per-target 2 would fit"), "{err}");
    let mut wider = small.to_vec();
    wider.extend(["--gpus-per-target", "2", "--json"]);
    let out = plan(&wider, Some(&nvml));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    // Targets of two GPUs each: 1, 2 or 3 of them beside the drafters.
    let splits: Vec<(u64, u64)> = p["splits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["targets"].as_u64().unwrap(),
                s["drafters"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(splits, vec![(1, 6), (2, 4), (3, 2)]);
    assert!(p["recommended"].as_u64().is_some(), "{p:#}");
}

#[test]
fn plan_from_a_run_uses_the_rates_it_measured() {
    let sup = Sup::start_real(&[
        "--gpus",
        "cpu:3",
        "--targets",
        "1",
        "--data",
        "demo",
        "--steps",
        "30",
        "--metrics-interval",
        "300ms",
        "--no-gpu-metrics",
    ]);
    let mut sup = sup;
    assert_eq!(sup.wait_exit(T).code(), Some(0), "{}", sup.stderr());
    let dir = sup.run_dir.to_str().unwrap().to_string();
    let out = plan(&["--gpus", "cpu:4", "--from", &dir, "--json"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(p["rates"]["source"], "measured", "{p:#}");
    for role in ["target_tokens_per_s", "drafter_tokens_per_s"] {
        assert!(p["rates"][role].as_f64().unwrap() > 0.0, "{p:#}");
    }
    assert_eq!(p["splits"].as_array().unwrap().len(), 3);
    assert!(p["recommended"].as_u64().is_some(), "{p:#}");
    // Roles given explicitly leave nothing to plan: one line, exit 2.
    let out = plan(&["--target-gpus", "cpu:1", "--drafter-gpus", "cpu:2"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("expected --gpus SPEC"), "{err}");
    // A directory that holds no run is one line, exit 2.
    let empty = tempfile::tempdir().unwrap();
    let out = plan(
        &["--gpus", "cpu:4", "--from", empty.path().to_str().unwrap()],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--from") && err.contains("expected the directory of an earlier run"),
        "{err}"
    );
}
