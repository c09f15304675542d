//! The target decoding over its KV cache (`models::target::device::decode`, what
//! `dflash-supervise eval` runs): greedy decoding with the cache equals greedy decoding by
//! full recomputation token for token, a cropped cache forgets what it held, the taps of
//! cached forwards are the full forward's, and the logits at every step equal
//! transformers' (CPU, float32) for tiny random Qwen3, Qwen3-MoE and Llama targets. The transformers
//! test skips without python3, torch and transformers on a laptop and fails under CI.

mod support;

use dflash_worker::device::cpu::CpuDevice;
use dflash_worker::models::target::device::decode::{argmax, Decoder};
use dflash_worker::models::target::device::DeviceTarget;
use dflash_worker::models::target::{Head, Target};
use dflash_worker::models::tiny;

const QWEN3_UNTIED: &str = r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":64,"num_hidden_layers":3,
  "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"intermediate_size":96,"rms_norm_eps":1e-6,
  "vocab_size":300,"tie_word_embeddings":false,"max_position_embeddings":4096,"rope_theta":1000000.0}"#;
const LLAMA_TIED: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":48,"num_hidden_layers":3,
  "num_attention_heads":6,"num_key_value_heads":2,"intermediate_size":96,"rms_norm_eps":1e-5,
  "vocab_size":300,"tie_word_embeddings":true,"max_position_embeddings":8192,"rope_theta":10000.0}"#;

/// Every layer but the dense layer 1 a mixture of 6 experts, 2 per token, renormalised.
const QWEN3_MOE: &str = r#"{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":3,
  "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"intermediate_size":96,"moe_intermediate_size":48,
  "num_experts":6,"num_experts_per_tok":2,"norm_topk_prob":true,"mlp_only_layers":[1],"rms_norm_eps":1e-6,
  "vocab_size":300,"tie_word_embeddings":false,"max_position_embeddings":4096,"rope_theta":1000000.0}"#;

fn load(config: &str, seed: u64) -> (tempfile::TempDir, Target, Head) {
    let dir = tempfile::tempdir().unwrap();
    tiny::write_random(dir.path(), config, seed).unwrap();
    let (t, h) = Target::load_decoder(dir.path(), &[0, 1]).unwrap();
    (dir, t, h)
}

fn decoder(t: &Target, h: &Head, block: usize) -> Decoder {
    Decoder::new(Box::new(CpuDevice::new()), t, h, 256, block).unwrap()
}

/// Greedy decoding of `n` tokens after `prompt` with the cache: the logits of every
/// prompt row, then of every step.
fn greedy_cached(d: &mut Decoder, prompt: &[u32], n: usize, vocab: usize) -> (Vec<u32>, Vec<f32>) {
    d.crop(0).unwrap();
    let f = d.prefill(prompt).unwrap();
    let mut logits = f.logits;
    let mut out = vec![argmax(&logits[logits.len() - vocab..])];
    while out.len() < n {
        let f = d.forward(&[*out.last().unwrap()]).unwrap();
        out.push(argmax(&f.logits));
        logits.extend(f.logits);
    }
    (out, logits)
}

#[test]
fn cached_greedy_decoding_equals_full_recomputation_and_crop_forgets() {
    let (_dir, t, h) = load(QWEN3_UNTIED, 3);
    let vocab = t.cfg.vocab_size;
    let prompt: Vec<u32> = (0..19).map(|i| (i * 37 + 11) % 300).collect();
    // Blocks of 8 rows: the prompt is prefilled in three forwards.
    let mut d = decoder(&t, &h, 8);
    let (cached, _) = greedy_cached(&mut d, &prompt, 24, vocab);
    // Full recomputation: the whole sequence from an empty cache at every step.
    let mut seq = prompt.clone();
    let mut full = Vec::new();
    for _ in 0..24 {
        d.crop(0).unwrap();
        let f = d.prefill(&seq).unwrap();
        let next = argmax(&f.logits[f.logits.len() - vocab..]);
        full.push(next);
        seq.push(next);
    }
    assert_eq!(
        cached, full,
        "cached greedy decoding differs from recomputation"
    );
    assert!(
        full.iter().collect::<std::collections::HashSet<_>>().len() > 3,
        "a degenerate sequence would not test much: {full:?}"
    );
    // A block forwarded and cropped away leaves no trace.
    d.crop(0).unwrap();
    let base = d.prefill(&prompt).unwrap();
    d.forward(&[5, 6, 7, 8, 9]).unwrap();
    d.crop(prompt.len()).unwrap();
    let again = d.forward(&[full[0]]).unwrap();
    d.crop(0).unwrap();
    d.prefill(&prompt).unwrap();
    let clean = d.forward(&[full[0]]).unwrap();
    assert_eq!(
        again.logits, clean.logits,
        "the cropped block is still seen"
    );
    assert!(
        d.crop(1000).is_err(),
        "crop past the cache's length is refused"
    );
    // The taps of the cached forwards are the full forward's.
    let mut dt = DeviceTarget::new(Box::new(CpuDevice::new()), &t, seq.len()).unwrap();
    let want = dt.forward_taps(&seq).unwrap();
    d.crop(0).unwrap();
    let mut got = d.prefill(&seq[..20]).unwrap().taps;
    for &tok in &seq[20..] {
        got.extend(d.forward(&[tok]).unwrap().taps);
    }
    let w = d.taps_width();
    assert_eq!(got.len(), seq.len() * w);
    let err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        err < 1e-4,
        "cached taps differ from the full forward's by {err}"
    );
    assert!(base.logits.len() == prompt.len() * vocab);
}

const SCRIPT: &str = r#"
import json, sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM
import transformers
from packaging import version
dtype_kw = "dtype" if version.parse(transformers.__version__) >= version.parse("4.56") else "torch_dtype"
# sys.argv[1]: a JSON list of {dir, prompt, n, out}: greedy decoding by full recomputation,
# the logits of the prompt rows and of every step to out; prints the tokens of each case.
def case(d, prompt, n, out):
    model = AutoModelForCausalLM.from_pretrained(d, **{dtype_kw: torch.float32}).eval()
    ids, rows, toks = list(prompt), [], []
    with torch.no_grad():
        for step in range(n):
            logits = model(torch.tensor([ids])).logits[0]
            rows.append(logits if step == 0 else logits[-1:])
            nxt = int(torch.argmax(logits[-1]))
            toks.append(nxt)
            ids.append(nxt)
    torch.cat(rows).numpy().astype("<f4").tofile(out)
    return toks
json.dump([case(**c) for c in json.load(open(sys.argv[1]))], sys.stdout)
"#;

/// A target decoded over several devices (`--gpus-per-target`, `dflash-supervise eval
/// --gpus 0-3`): each device holds a contiguous range of the layers and their cache, the
/// last one the final norm and the lm_head. Its logits and taps at every step, through a
/// prefill in blocks, single-token steps, a multi-row verify and a crop, are bit for bit
/// those of the same target on one device: on the CPU device (f32) and on host devices
/// (bf16 activations, ordering checked).
#[test]
fn a_target_decoded_over_several_devices_decodes_as_on_one() {
    use dflash_worker::device::host::HostDevice;
    use dflash_worker::device::Device;
    for config in [QWEN3_UNTIED, QWEN3_MOE] {
        let (dir, t, h) = load(config, 5);
        let vocab = t.cfg.vocab_size;
        let prompt: Vec<u32> = (0..13).map(|i| (i * 41 + 7) % 300).collect();
        for host in [false, true] {
            let dev = |_: usize| -> Box<dyn Device> {
                if host {
                    Box::new(HostDevice::new())
                } else {
                    Box::new(CpuDevice::new())
                }
            };
            let run = |d: &mut Decoder| {
                let mut f = d.prefill(&prompt).unwrap();
                let mut out = vec![argmax(&f.logits[f.logits.len() - vocab..])];
                for _ in 0..4 {
                    let g = d.forward(&[*out.last().unwrap()]).unwrap();
                    out.push(argmax(&g.logits));
                    f.logits.extend(g.logits);
                    f.taps.extend(g.taps);
                }
                // A block of four rows verified, then all but its first forgotten.
                let n = d.len();
                let g = d.forward(&out[1..5]).unwrap();
                f.logits.extend(g.logits);
                d.crop(n + 1).unwrap();
                let g = d.forward(&[out[0]]).unwrap();
                f.logits.extend(g.logits);
                f.taps.extend(g.taps);
                assert_eq!(d.len(), n + 2);
                let hidden: Vec<f32> = f.taps[..2 * t.cfg.hidden_size].to_vec();
                (f, d.lm_head_argmax(&hidden).unwrap())
            };
            let mut one = Decoder::new(dev(0), &t, &h, 64, 8).unwrap();
            let (want, want_head) = run(&mut one);
            assert!(want.logits.iter().all(|x| x.is_finite()));
            for n in [2, 3] {
                let (t2, h2) = Target::load_decoder(dir.path(), &[0, 1]).unwrap();
                let mut split =
                    Decoder::new_split((0..n).map(dev).collect(), t2, &h2, 64, 8).unwrap();
                let r = split.layer_ranges();
                assert_eq!(r.len(), n, "{r:?}");
                assert_eq!((r[0].start, r[n - 1].end), (0, 3));
                assert!(r.windows(2).all(|w| w[0].end == w[1].start));
                let (got, got_head) = run(&mut split);
                assert!(
                    got.logits == want.logits && got.taps == want.taps,
                    "host {host}, {n} devices: the logits or taps differ"
                );
                assert_eq!(got_head, want_head);
            }
        }
    }
}

fn python_ok() -> bool {
    support::python_ok(&["numpy"])
}

#[test]
fn logits_at_every_step_equal_transformers() {
    if !python_ok() {
        return;
    }
    let cases = [
        ("qwen3 untied", QWEN3_UNTIED),
        ("llama tied", LLAMA_TIED),
        ("qwen3-moe", QWEN3_MOE),
    ];
    let prompt: Vec<u32> = (0..13).map(|i| (i * 53 + 7) % 300).collect();
    let n = 12;
    let loaded: Vec<_> = cases.iter().map(|(_, c)| load(c, 9)).collect();
    let jobs: Vec<serde_json::Value> = loaded
        .iter()
        .map(|(dir, ..)| {
            serde_json::json!({"d": dir.path(), "prompt": prompt, "n": n, "out": dir.path().join("ref.f32")})
        })
        .collect();
    let tokens: Vec<Vec<u32>> =
        support::run_python("transformers", SCRIPT, &serde_json::Value::from(jobs));
    for (((name, _), (dir, t, h)), want) in cases.iter().zip(&loaded).zip(tokens) {
        let vocab = t.cfg.vocab_size;
        let mut d = decoder(t, h, 4);
        let (got, logits) = greedy_cached(&mut d, &prompt, n, vocab);
        assert_eq!(got, want, "{name}: greedy tokens differ from transformers'");
        let theirs: Vec<f32> = std::fs::read(dir.path().join("ref.f32"))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(theirs.len(), (prompt.len() + n - 1) * vocab, "{name}");
        assert_eq!(logits.len(), theirs.len(), "{name}");
        let scale = theirs.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        let err = logits
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
            / scale;
        eprintln!("{name}: logits max error / max |ref| = {err:.2e}");
        assert!(
            err <= 2e-4,
            "{name}: logits differ from transformers' by {err:.2e} of their scale"
        );
    }
}
