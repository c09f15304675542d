//! Greedy DFlash speculative decoding (`eval::spec`, what `dflash-supervise eval` runs)
//! on the built-in tiny target: the drafter's proposals equal the reference drafter's
//! argmax; the decoded tokens equal plain greedy decoding token for token, for several
//! prompts, with an untrained drafter and with one trained on the target's own outputs
//! (which accepts more); every step commits 1 to block-size tokens; a target and drafter
//! that always agree commit whole blocks (τ = block size); and a Python reference of the
//! same loop (transformers for the target, the export loaded with `AutoModel(...,
//! trust_remote_code=True)`, written from the published algorithm) accepts the same
//! lengths at every step of every prompt (skips without python3, torch and transformers
//! on a laptop, fails under CI).

mod support;

use dflash_shared::drafter::DrafterConfig;
use dflash_shared::model_config::{target_layer_ids, TargetConfig};
use dflash_worker::device::cpu::CpuDevice;
use dflash_worker::eval::draft::Draft;
use dflash_worker::eval::spec::{greedy, speculative, Stop};
use dflash_worker::models::drafter::device::{DeviceDrafter, GradTo, Rows};
use dflash_worker::models::drafter::{AdamW, Drafter, Frozen, Sample};
use dflash_worker::models::target::device::decode::{argmax, Decoder};
use dflash_worker::models::target::{Head, Target};
use dflash_worker::models::tiny;

const BS: usize = 6;
const MAX_LEN: usize = 160;

struct Setup {
    dir: tempfile::TempDir,
    target: Target,
    head: Head,
    frozen: Frozen,
    cfg: DrafterConfig,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    tiny::write(dir.path()).unwrap();
    let tc = TargetConfig::load(dir.path()).unwrap();
    let taps: Vec<usize> = target_layer_ids(tc.num_hidden_layers, 2)
        .into_iter()
        .map(|t| t as usize)
        .collect();
    let (target, head) = Target::load_decoder(dir.path(), &taps).unwrap();
    let embed = dflash_worker::models::weights::Weights::open(dir.path())
        .unwrap()
        .get(
            "model.embed_tokens.weight",
            &[tc.vocab_size, tc.hidden_size],
        )
        .unwrap();
    let frozen = Frozen {
        embed,
        lm_head: head.lm_head.clone(),
    };
    let cfg = DrafterConfig {
        hidden: tc.hidden_size,
        layers: 1,
        q_heads: tc.num_attention_heads,
        kv_heads: tc.num_key_value_heads,
        head_dim: tc.head_dim,
        intermediate: tc.intermediate_size,
        vocab: tc.vocab_size,
        eps: tc.rms_norm_eps,
        rope_theta: tc.rope_theta,
        rope_scaling: None,
        n_taps: taps.len(),
        block_size: BS,
        max_anchors: 64,
        mask_token_id: tc.vocab_size as u32 - 1,
        gamma: 4.0,
    };
    Setup {
        dir,
        target,
        head,
        frozen,
        cfg,
    }
}

fn decoder(s: &Setup, head: &Head) -> Decoder {
    Decoder::new(Box::new(CpuDevice::new()), &s.target, head, MAX_LEN, 16).unwrap()
}

fn draft(s: &Setup, params: &[f32], frozen: &Frozen) -> Draft {
    Draft::new(Box::new(CpuDevice::new()), &s.cfg, params, frozen, MAX_LEN).unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    (0..5)
        .map(|i| {
            (0..3 + 4 * i)
                .map(|t| ((t * 31 + i * 17 + 5) % 500) as u32)
                .collect()
        })
        .collect()
}

#[test]
fn proposals_equal_the_reference_drafters_argmax() {
    let s = setup();
    let d = Drafter::new(s.cfg.clone());
    let mut p = d.init_params(11);
    for (i, x) in p.iter_mut().enumerate() {
        *x += ((i * 7919) % 13) as f32 * 0.01;
    }
    let mut dec = decoder(&s, &s.head);
    let mut dr = draft(&s, &p, &s.frozen);
    let (h, width) = (s.cfg.hidden, dec.taps_width());
    for prompt in prompts() {
        dec.crop(0).unwrap();
        let f = dec.prefill(&prompt).unwrap();
        let mut committed = prompt.clone();
        committed.push(argmax(&f.logits[f.logits.len() - s.cfg.vocab..]));
        let got = dr.propose(&committed, &f.taps, &mut dec).unwrap();
        assert_eq!(got.len(), BS - 1);
        // The reference: the block [last token, MASK…] at the anchor, the context's taps.
        let n = committed.len();
        let mut taps = f.taps.clone();
        taps.resize(n * width, 0.0);
        let mut embeds = Vec::new();
        for k in 0..BS {
            let tok = if k == 0 {
                committed[n - 1]
            } else {
                s.cfg.mask_token_id
            } as usize;
            embeds.extend_from_slice(&s.frozen.embed[tok * h..(tok + 1) * h]);
        }
        let hn = d.final_hidden(&p, &taps, &embeds, &[n - 1]).unwrap();
        let want: Vec<u32> = hn
            .chunks_exact(h)
            .skip(1)
            .map(|row| {
                let logits: Vec<f32> = s
                    .frozen
                    .lm_head
                    .chunks_exact(h)
                    .map(|w| w.iter().zip(row).map(|(a, b)| a * b).sum())
                    .collect();
                argmax(&logits)
            })
            .collect();
        assert_eq!(got, want, "prompt of {} tokens", prompt.len());
    }
}

/// Train the drafter on the target's own greedy outputs (what regenerated data is): its
/// weights after 40 steps (some slots still wrong) and after 200.
fn trained(s: &Setup, dec: &mut Decoder) -> (Vec<f32>, Vec<f32>) {
    let stop = Stop {
        max_new: 60,
        eos: None,
    };
    let (mut seqs, mut taps) = (Vec::new(), Vec::new());
    // The eval prompts' own continuations: a drafter that has learned them.
    for prompt in prompts() {
        let mut seq = prompt.clone();
        seq.extend(greedy(dec, &prompt, stop).unwrap());
        dec.crop(0).unwrap();
        taps.push(dec.prefill(&seq).unwrap().taps);
        seqs.push(seq);
    }
    let d = Drafter::new(s.cfg.clone());
    let mut p = d.init_params(3);
    let mut opt = AdamW::new(p.len());
    let mut dd = DeviceDrafter::new(Box::new(CpuDevice::new()), &d, &s.frozen, MAX_LEN).unwrap();
    let masks: Vec<Vec<u8>> = seqs.iter().map(|q| vec![1u8; q.len()]).collect();
    let samples: Vec<Sample> = (0..seqs.len())
        .map(|i| Sample {
            taps: &taps[i],
            ids: &seqs[i],
            mask: &masks[i],
        })
        .collect();
    let mut rng = dflash_shared::rng::Rng::new(7);
    let zeros = vec![0f32; p.len()];
    let mut half = Vec::new();
    for step in 0..200 {
        if step == 40 {
            half = p.clone();
        }
        let anchors: Vec<Vec<usize>> = samples
            .iter()
            .map(|x| d.sample_anchors(x.mask, &mut rng))
            .collect();
        dd.load(&p, &zeros, &zeros, 0).unwrap();
        let mut g = vec![0f32; p.len()];
        let den = d.total_weight(&samples, &anchors);
        dd.forward_backward(&samples, Rows::F32, &anchors, den, GradTo::Host(&mut g))
            .unwrap();
        opt.update(&mut p, &g, 1e-2);
    }
    (half, p)
}

/// Each prompt decoded both ways: the tokens must be equal; the accepted lengths.
fn decode_all(dec: &mut Decoder, dr: &mut Draft, stop: Stop) -> Vec<Vec<usize>> {
    prompts()
        .iter()
        .map(|prompt| {
            let g = greedy(dec, prompt, stop).unwrap();
            let sp = speculative(dec, dr, prompt, stop).unwrap();
            assert_eq!(sp.tokens, g, "speculative ≠ greedy for prompt {prompt:?}");
            assert_eq!(g.len(), stop.max_new);
            assert!(sp.accepted.iter().all(|&a| (1..=BS).contains(&a)));
            // The first token comes from the prefill; every other from a verify step
            // (the last step may overshoot the limit).
            let committed: usize = sp.accepted.iter().sum();
            assert!(committed + 1 >= g.len() && committed < g.len() + BS);
            sp.accepted
        })
        .collect()
}

fn tau(runs: &[Vec<usize>]) -> f64 {
    let steps: usize = runs.iter().map(Vec::len).sum();
    runs.iter().flatten().sum::<usize>() as f64 / steps as f64
}

#[test]
fn speculative_decoding_equals_greedy_trained_or_not() {
    let s = setup();
    let stop = Stop {
        max_new: 40,
        eos: None,
    };
    let mut dec = decoder(&s, &s.head);
    let untrained = Drafter::new(s.cfg.clone()).init_params(5);
    let mut dr = draft(&s, &untrained, &s.frozen);
    let before = tau(&decode_all(&mut dec, &mut dr, stop));
    let (half, p) = trained(&s, &mut dec);
    let mut dr = draft(&s, &half, &s.frozen);
    let runs = decode_all(&mut dec, &mut dr, stop);
    let mid = tau(&runs);
    let mut dr = draft(&s, &p, &s.frozen);
    let after = tau(&decode_all(&mut dec, &mut dr, stop));
    eprintln!("τ untrained {before:.3}, 40 steps {mid:.3}, 200 steps {after:.3}");
    assert!(before >= 1.0);
    assert!(
        runs.iter().flatten().any(|&a| 1 < a && a < BS),
        "partly accepted blocks: {runs:?}"
    );
    assert!(
        before < mid && mid < after && after > 0.8 * BS as f64,
        "training on the target's outputs must raise τ: {before:.3} → {mid:.3} → {after:.3}"
    );
    // An EOS cuts both ways alike.
    let g = greedy(&mut dec, &prompts()[2], stop).unwrap();
    let eos = Stop {
        max_new: 40,
        eos: Some(g[7]),
    };
    let sp = speculative(&mut dec, &mut dr, &prompts()[2], eos).unwrap();
    let cut = g.iter().position(|&t| t == g[7]).unwrap() + 1;
    assert_eq!(sp.tokens, g[..cut]);
}

#[test]
fn a_drafter_that_always_agrees_commits_whole_blocks() {
    let s = setup();
    // Zero lm_head: every logit ties, the argmax is token 0 for the target and the drafter.
    let head = Head {
        norm: s.head.norm.clone(),
        lm_head: vec![0.0; s.head.lm_head.len()],
    };
    let frozen = Frozen {
        embed: s.frozen.embed.clone(),
        lm_head: head.lm_head.clone(),
    };
    let mut dec = decoder(&s, &head);
    let p = Drafter::new(s.cfg.clone()).init_params(5);
    let mut dr = draft(&s, &p, &frozen);
    let stop = Stop {
        max_new: 1 + 4 * BS,
        eos: None,
    };
    let sp = speculative(&mut dec, &mut dr, &prompts()[1], stop).unwrap();
    assert_eq!(sp.tokens, vec![0; stop.max_new]);
    assert_eq!(sp.accepted, vec![BS; 4], "τ = block size");
}

const REFERENCE: &str = r#"
import json, sys
import torch
import transformers
from packaging import version
from transformers import AutoModel, AutoModelForCausalLM
kw = "dtype" if version.parse(transformers.__version__) >= version.parse("4.56") else "torch_dtype"
job = json.load(open(sys.argv[1]))
target = AutoModelForCausalLM.from_pretrained(job["target"], **{kw: torch.float32}).eval()
drafter = AutoModel.from_pretrained(job["drafter"], trust_remote_code=True, **{kw: torch.float32}).eval()
taps, bs, mask = drafter.target_layer_ids, drafter.block_size, drafter.mask_token_id
emb, head = target.get_input_embeddings(), target.get_output_embeddings()

def run(ids):
    # The target on a whole sequence, no cache: its logits and taps per position.
    o = target(torch.tensor([ids]), output_hidden_states=True)
    return o.logits[0], torch.cat([o.hidden_states[t + 1][0] for t in taps], -1)

def greedy(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(run(seq)[0][-1].argmax()))
    return seq[len(prompt):]

def speculative(prompt, n):
    seq = list(prompt)
    seq.append(int(run(seq)[0][-1].argmax()))
    accepted = []
    while len(seq) - len(prompt) < n:
        a = len(seq) - 1  # the block starts at the last committed token
        _, ctx = run(seq[:a])  # the taps of every position before it
        block = [seq[-1]] + [mask] * (bs - 1)
        h = drafter(position_ids=torch.arange(a + bs)[None],
                    noise_embedding=emb(torch.tensor([block])), target_hidden=ctx[None])
        guess = [int(x) for x in drafter.compute_logits(h, head)[0, 1:].argmax(-1)]
        logits, _ = run(seq + guess)
        verify = [int(x) for x in logits[a:].argmax(-1)]  # the target's token after each slot
        k = 0
        while k < bs - 1 and guess[k] == verify[k]:
            k += 1
        seq += guess[:k] + [verify[k]]
        accepted.append(k + 1)
    return seq[len(prompt):][:n], accepted

with torch.no_grad():
    out = [dict(zip(["tokens", "accepted"], speculative(p, job["n"])), greedy=greedy(p, job["n"]))
           for p in job["prompts"]]
json.dump(out, sys.stdout)
"#;

fn python_ok() -> bool {
    support::python_ok(&[])
}

#[test]
fn accepted_lengths_equal_a_python_reference_with_the_export() {
    if !python_ok() {
        return;
    }
    use dflash_worker::eval::draft::Exported;
    use dflash_worker::tools::export::{write_hf_dir, ExportInfo};
    let s = setup();
    let mut dec = decoder(&s, &s.head);
    // Partly trained: steps of every accepted length.
    let (half, _) = trained(&s, &mut dec);
    let out = tempfile::tempdir().unwrap();
    let export = out.path().join("drafter");
    let ids: Vec<u32> = s.target.taps.iter().map(|&t| t as u32).collect();
    let info = ExportInfo {
        step: 40,
        seed: 1,
        num_target_layers: s.target.cfg.num_hidden_layers,
        target_layer_ids: &ids,
        max_position_embeddings: None,
        target: None,
        rendering: None,
        mask_token_rule: None,
    };
    write_hf_dir(
        &Drafter::new(s.cfg.clone()),
        &s.frozen,
        &half,
        &info,
        &export,
    )
    .unwrap();
    // Ours from the export as eval reads it (the bf16 weights).
    let ex = Exported::load(&export).unwrap();
    let mut dr = draft(&s, &ex.params, &s.frozen);
    let stop = Stop {
        max_new: 30,
        eos: None,
    };
    let ours: Vec<_> = prompts()
        .iter()
        .map(|p| speculative(&mut dec, &mut dr, p, stop).unwrap())
        .collect();
    let spec = serde_json::json!({"target": s.dir.path(), "drafter": export, "prompts": prompts(), "n": stop.max_new});
    let theirs: Vec<serde_json::Value> = support::run_python("the reference", REFERENCE, &spec);
    for (i, (ours, theirs)) in ours.iter().zip(&theirs).enumerate() {
        let acc: Vec<usize> = serde_json::from_value(theirs["accepted"].clone()).unwrap();
        let toks: Vec<u32> = serde_json::from_value(theirs["tokens"].clone()).unwrap();
        let greedy: Vec<u32> = serde_json::from_value(theirs["greedy"].clone()).unwrap();
        assert_eq!(ours.accepted, acc, "prompt {i}: accepted lengths");
        assert_eq!(ours.tokens, toks, "prompt {i}: tokens");
        assert_eq!(
            toks, greedy,
            "prompt {i}: the reference's own speculative ≠ greedy"
        );
    }
    assert_eq!(theirs.len(), ours.len());
    let all: Vec<usize> = ours.iter().flat_map(|d| d.accepted.clone()).collect();
    assert!(
        all.contains(&1) && all.iter().any(|&a| 1 < a && a < BS),
        "{all:?}"
    );
}

/// The torch engine's decoding (transformers' Qwen3 in the Python child, over its own KV
/// cache, cut back after every verify step) against the native decoder, an independent
/// implementation: the same taps and greedy tokens on a prefill, the same lm_head argmax
/// of a drafter's hidden states, and speculative decoding with a partly trained drafter
/// commits the same tokens in the same accepted lengths, equal to greedy decoding.
#[test]
fn the_torch_engine_decodes_as_the_native_decoder() {
    if !python_ok() {
        return;
    }
    use dflash_worker::eval::verifier::{TorchVerifier, Verifier};
    let s = setup();
    let mut dec = decoder(&s, &s.head);
    let (half, _) = trained(&s, &mut dec);
    let taps = s.target.taps.clone();
    let mut torch = TorchVerifier::start(s.dir.path(), &taps, s.target.cfg.hidden_size, 0).unwrap();
    let prompt = &prompts()[3];
    dec.keep(0).unwrap();
    torch.keep(0).unwrap();
    let (a, b) = (dec.verify(prompt).unwrap(), torch.verify(prompt).unwrap());
    assert_eq!(a.argmax, b.argmax);
    let scale = a.taps.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = a
        .taps
        .iter()
        .zip(&b.taps)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        worst <= 1e-5 * scale,
        "taps differ by {worst} (scale {scale})"
    );
    assert!((a.margin - b.margin).abs() <= 1e-4 * a.max_abs.max(1.0));
    let hidden: Vec<f32> = (0..3 * s.cfg.hidden)
        .map(|i| ((i * 37 % 19) as f32 - 9.0) * 0.1)
        .collect();
    assert_eq!(
        dec.head_argmax(&hidden).unwrap(),
        torch.head_argmax(&hidden).unwrap()
    );
    let stop = Stop {
        max_new: 30,
        eos: None,
    };
    let mut dr = draft(&s, &half, &s.frozen);
    let mut all = Vec::new();
    for p in prompts() {
        let native = speculative(&mut dec, &mut dr, &p, stop).unwrap();
        let theirs = speculative(&mut torch, &mut dr, &p, stop).unwrap();
        assert_eq!(theirs, native, "prompt {p:?}");
        assert_eq!(theirs.tokens, greedy(&mut torch, &p, stop).unwrap());
        all.extend(theirs.accepted);
    }
    assert!(
        all.contains(&1) && all.iter().any(|&a| 1 < a && a < BS),
        "cut-back caches: {all:?}"
    );
}
