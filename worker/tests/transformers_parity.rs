//! The target's taps against transformers itself (CPU, float32) on checkpoints whose
//! configs use each rotary layout a user may bring: transformers 4's top-level
//! `rope_theta`/`rope_scaling` and transformers 5's `rope_parameters`, with default, linear,
//! llama3 and YaRN scaling (YaRN with and without mscale, and with an explicit attention
//! factor). Also the inverse frequencies and attention factor against transformers' own
//! `ROPE_INIT_FUNCTIONS`. Needs python3 with torch and transformers: skips without them on
//! a laptop, fails under CI (`.ci/run` installs them).

mod support;

use std::path::Path;

use dflash_worker::models::target::Target;
use dflash_worker::models::tiny;

const SCRIPT: &str = r#"
import json, sys
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
import transformers
from packaging import version
dtype_kw = "dtype" if version.parse(transformers.__version__) >= version.parse("4.56") else "torch_dtype"
# One process for every case (torch's import is most of the time): sys.argv[1] is a JSON
# list of {dir, tokens, taps, out}; prints the list of each case's rope figures.
def case(d, tokens, taps, out):
    cfg = AutoConfig.from_pretrained(d)
    # transformers 5: rope_parameters; 4.x: rope_scaling (None without scaling).
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default":
        inv, af = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    else:
        inv, af = None, 1.0
    model = AutoModelForCausalLM.from_pretrained(d, **{dtype_kw: torch.float32}).eval()
    with torch.no_grad():
        hs = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    np.concatenate([hs[t + 1][0].float().numpy() for t in taps], axis=1).astype("<f4").tofile(out)
    return {"rope_type": kind, "attention_factor": float(af), "inv_freq": None if inv is None else inv.float().tolist()}
json.dump([case(**c) for c in json.load(open(sys.argv[1]))], sys.stdout)
"#;

fn python_ok() -> bool {
    support::python_ok(&["numpy"])
}

const BASE_QWEN3: &str = r#""architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":64,"num_hidden_layers":3,
  "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"intermediate_size":96,"rms_norm_eps":1e-6,
  "vocab_size":300,"tie_word_embeddings":true,"max_position_embeddings":4096"#;
/// No head_dim, num_key_value_heads, rms_norm_eps, rope_theta or tie_word_embeddings:
/// Qwen3Config's defaults (head_dim 128, 32 key-value heads, ...) must be ours.
const BASE_QWEN3_DEFAULTS: &str = r#""architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":64,"num_hidden_layers":3,
  "num_attention_heads":32,"intermediate_size":96,"vocab_size":300"#;
const BASE_LLAMA: &str = r#""architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":48,"num_hidden_layers":3,
  "num_attention_heads":6,"num_key_value_heads":2,"intermediate_size":96,"rms_norm_eps":1e-5,
  "vocab_size":300,"tie_word_embeddings":false,"max_position_embeddings":8192"#;

/// One config's checkpoint, our target on it and where transformers writes its taps.
struct Case {
    name: String,
    dir: tempfile::TempDir,
    target: Target,
    tokens: Vec<u32>,
    taps: [usize; 2],
    out: std::path::PathBuf,
}

fn prepare(name: &str, base: &str, rope: &str) -> Case {
    let config = format!("{{{base},{rope}}}");
    let dir = tempfile::tempdir().unwrap();
    tiny::write_random(dir.path(), &config, 5).unwrap();
    // Not the last layer: transformers applies the final norm to its last hidden state.
    let taps = [0usize, 1];
    // Long enough to reach positions where the scaled frequencies matter.
    let tokens: Vec<u32> = (0..96).map(|i| (i * 37 + 11) % 300).collect();
    let target = Target::load(dir.path(), &taps).unwrap_or_else(|e| panic!("{name}: {e}"));
    let out = dir.path().join("ref.f32");
    Case {
        name: name.to_string(),
        dir,
        target,
        tokens,
        taps,
        out,
    }
}

/// transformers on every case, in one python process: each case's rope figures.
fn transformers(cases: &[Case]) -> Vec<serde_json::Value> {
    let jobs: Vec<serde_json::Value> = cases
        .iter()
        .map(|c| {
            serde_json::json!({"d": c.dir.path(), "tokens": c.tokens, "taps": c.taps, "out": c.out})
        })
        .collect();
    let metas: Vec<serde_json::Value> =
        support::run_python("transformers", SCRIPT, &serde_json::Value::from(jobs));
    assert_eq!(metas.len(), cases.len());
    metas
}

/// Our taps and rope tables against transformers' for one config.
fn check(case: &Case, meta: &serde_json::Value) {
    let Case {
        name,
        target,
        tokens,
        out,
        ..
    } = case;
    let ours = target.forward_taps(tokens);
    // Rope tables.
    let scaling = target.cfg.rope_scaling.as_ref();
    let af = scaling.map_or(1.0, |s| s.attention_factor());
    let want_af = meta["attention_factor"].as_f64().unwrap();
    assert!(
        (af - want_af).abs() <= 1e-6 * want_af.abs(),
        "{name}: attention factor {af} vs transformers {want_af}"
    );
    if let Some(inv) = meta["inv_freq"].as_array() {
        let mine =
            dflash_worker::math::rope_inv_freq(target.cfg.head_dim, target.cfg.rope_theta, scaling);
        assert_eq!(mine.len(), inv.len(), "{name}");
        for (i, (a, b)) in mine.iter().zip(inv).enumerate() {
            let b = b.as_f64().unwrap() as f32;
            assert!(
                (a - b).abs() <= 2e-6 * b.abs().max(1e-30),
                "{name}: inv_freq[{i}] {a} vs transformers {b}"
            );
        }
    }
    // Taps.
    let bytes = std::fs::read(out).unwrap();
    let theirs: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(theirs.len(), ours.len(), "{name}");
    let scale = theirs.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
    let err = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale;
    eprintln!("{name}: max error / max |ref| = {err:.2e}");
    assert!(
        err <= 2e-4,
        "{name}: taps differ from transformers' hidden_states by {err:.2e} of their scale"
    );
    // What a CPU target worker computes: the device target on the CPU device.
    let mut worker = dflash_worker::models::target::device::DeviceTarget::new(
        Box::new(dflash_worker::device::cpu::CpuDevice::new()),
        target,
        tokens.len(),
    )
    .unwrap();
    let w = worker.forward_taps(tokens).unwrap();
    let err = w
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale;
    eprintln!("{name}: CPU worker's path, max error / max |ref| = {err:.2e}");
    assert!(
        err <= 2e-4,
        "{name}: the CPU worker's taps differ from transformers' by {err:.2e} of their scale"
    );
}

#[test]
fn taps_equal_transformers_for_every_rope_layout_and_scaling() {
    if !python_ok() {
        return;
    }
    let cases: &[(&str, &str, &str)] = &[
        (
            "qwen3 default, transformers 4 layout",
            BASE_QWEN3,
            r#""rope_theta":1000000.0,"rope_scaling":null"#,
        ),
        (
            "qwen3 with absent fields (transformers' defaults)",
            BASE_QWEN3_DEFAULTS,
            r#""max_position_embeddings":4096"#,
        ),
        (
            "qwen3 default, transformers 5 layout",
            BASE_QWEN3,
            r#""rope_parameters":{"rope_type":"default","rope_theta":1000000.0}"#,
        ),
        (
            "qwen3 yarn, transformers 4 layout",
            BASE_QWEN3,
            r#""rope_theta":1000000.0,"rope_scaling":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32}"#,
        ),
        (
            "llama yarn with mscale, transformers 5 layout",
            BASE_LLAMA,
            r#""rope_parameters":{"rope_type":"yarn","rope_theta":500000.0,"factor":8.0,"original_max_position_embeddings":64,"mscale":0.707,"mscale_all_dim":1.0,"beta_fast":16}"#,
        ),
        (
            "llama yarn with attention_factor, no truncation",
            BASE_LLAMA,
            r#""rope_parameters":{"rope_type":"yarn","rope_theta":10000.0,"factor":2.0,"original_max_position_embeddings":48,"attention_factor":1.3,"truncate":false}"#,
        ),
        (
            "llama llama3, transformers 5 layout",
            BASE_LLAMA,
            r#""rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":64}"#,
        ),
        (
            "llama linear, transformers 4 layout",
            BASE_LLAMA,
            r#""rope_theta":10000.0,"rope_scaling":{"type":"linear","factor":2.0}"#,
        ),
    ];
    let cases: Vec<Case> = cases
        .iter()
        .map(|(name, base, rope)| prepare(name, base, rope))
        .collect();
    for (case, meta) in cases.iter().zip(transformers(&cases)) {
        check(case, &meta);
    }
}

/// The comparison above has teeth: YaRN changes the taps well beyond its tolerance.
#[test]
fn yarn_changes_the_taps_well_beyond_the_parity_tolerance() {
    let config = format!("{{{BASE_QWEN3},\"rope_theta\":1000000.0,\"rope_scaling\":{{\"rope_type\":\"yarn\",\"factor\":4.0,\"original_max_position_embeddings\":32}}}}");
    let tmp = tempfile::tempdir().unwrap();
    tiny::write_random(tmp.path(), &config, 5).unwrap();
    let a = Target::load(tmp.path(), &[2]).unwrap();
    let plain = format!("{{{BASE_QWEN3},\"rope_theta\":1000000.0,\"rope_scaling\":null}}");
    std::fs::write(Path::new(tmp.path()).join("config.json"), plain).unwrap();
    let b = Target::load(tmp.path(), &[2]).unwrap();
    let tokens: Vec<u32> = (0..64).map(|i| (i * 7) % 300).collect();
    let (x, y) = (a.forward_taps(&tokens), b.forward_taps(&tokens));
    let diff = x
        .iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs())
        .fold(0f32, f32::max);
    assert!(diff > 1e-2, "YaRN must change the taps ({diff})");
}
