//! `dflash-worker eval`: load the target and the exported drafter, read the prompts,
//! decode each prompt greedily and speculatively on the CPU device (f32) or the GPU
//! (`--gpu`: bf16), print the figures.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use super::draft::{Draft, Exported};
use super::report::Tau;
use super::spec::{greedy, speculative, Stop};
use super::EvalError;
use crate::device::cpu::CpuDevice;
use crate::error::ToolError;
use crate::models::drafter::Frozen;
use crate::models::target::device::decode::Decoder;
use crate::models::target::Target;

/// What `eval` was asked.
pub struct Args {
    pub target: String,
    pub drafter: PathBuf,
    pub prompts: PathBuf,
    pub max_new_tokens: usize,
    pub json: bool,
    pub seed: u64,
    /// On the GPU (ordinal 0), not the CPU.
    pub gpu: bool,
}

/// The device to decode on: the CPU, or with `gpu` the worker's GPU (said on stderr, so
/// that stdout stays the report).
fn device(gpu: bool) -> Result<Box<dyn crate::device::Device>, ToolError> {
    if !gpu {
        return Ok(Box::new(CpuDevice::new()));
    }
    let dev = crate::device::cuda::CudaDevice::open()?;
    eprintln!("GPU: {}", crate::device::Device::describe(&dev));
    for l in &dev.libraries {
        eprintln!("  {l}");
    }
    Ok(Box::new(dev))
}

/// Token-id prompts, one per line: a JSON array, or an object with `input_ids`. Blank
/// lines are skipped; ids must lie in the vocabulary.
pub fn read_prompts(path: &Path, vocab: usize) -> Result<Vec<Vec<u32>>, EvalError> {
    let text = std::fs::read_to_string(path).map_err(|source| EvalError::Unreadable {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = |why: String| EvalError::BadPrompt {
            path: path.to_path_buf(),
            line: i + 1,
            why,
        };
        let v: Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        let ids = match &v {
            Value::Object(o) => o.get("input_ids").cloned().unwrap_or(Value::Null),
            _ => v,
        };
        let ids: Vec<u32> = serde_json::from_value(ids)
            .map_err(|e| bad(format!("not a list of token ids ({e})")))?;
        if ids.is_empty() {
            return Err(bad("an empty prompt".into()));
        }
        if let Some(t) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(bad(format!(
                "token {t} is not below the vocabulary size {vocab}"
            )));
        }
        out.push(ids);
    }
    if out.is_empty() {
        return Err(EvalError::NoPrompts {
            path: path.to_path_buf(),
        });
    }
    Ok(out)
}

/// The target's end-of-sequence token(s), when config.json names one.
fn eos(dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    let e = &v["eos_token_id"];
    e.as_u64()
        .or_else(|| e.as_array()?.first()?.as_u64())
        .map(|x| x as u32)
}

/// Decode every prompt both ways and print the figures; whether speculative decoding
/// wrote what greedy decoding wrote on every prompt.
pub fn run(a: &Args) -> Result<bool, ToolError> {
    if a.max_new_tokens == 0 {
        return Err(EvalError::NoNewTokens.into());
    }
    // The built-in tiny target, written into a scratch directory of ours (removed with it).
    let mut scratch = None;
    let dir = if a.target == "tiny" {
        let s = scratch.insert(
            dflash_shared::scratch::ScratchDir::new("tiny-eval")
                .map_err(ToolError::io("creating a scratch directory".to_string()))?,
        );
        crate::models::tiny::write(s.path())
            .map_err(ToolError::io(format!("writing {}", s.path().display())))?;
        s.path()
    } else {
        Path::new(&a.target)
    };
    let cfg = dflash_shared::model_config::TargetConfig::load(dir)?;
    let ex = Exported::load(&a.drafter)?;
    ex.check_target(&a.drafter, &cfg)?;
    let prompts = read_prompts(&a.prompts, cfg.vocab_size)?;
    let loaded = Target::load_decoder(dir, &ex.target_layer_ids);
    let eos = eos(dir);
    drop(scratch);
    let (target, head) = loaded?;
    let bs = ex.cfg.block_size;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let max_len = longest + a.max_new_tokens + bs;
    // DFLASH_DEVICE=cpu forces the CPU, as for training.
    let on_gpu = a.gpu && std::env::var("DFLASH_DEVICE").map_or(true, |d| d != "cpu");
    let mut dec = Decoder::new(device(on_gpu)?, &target, &head, max_len, bs.max(64))?;
    let frozen = Frozen {
        embed: target.embed.clone(),
        lm_head: head.lm_head.clone(),
    };
    drop((target, head));
    let mut draft = Draft::new(device(on_gpu)?, &ex.cfg, &ex.params, &frozen, max_len)?;
    drop(frozen);
    let stop = Stop {
        max_new: a.max_new_tokens,
        eos,
    };
    let (mut runs, mut per) = (Vec::new(), Vec::new());
    let (mut t_greedy, mut t_spec, mut n_greedy, mut n_spec, mut same) = (0.0, 0.0, 0, 0, 0);
    for p in &prompts {
        // The first token is the prefill's argmax: how far its logit stands above the
        // runner-up's, and the row's largest |logit|, say whether another device's
        // rounding (bf16 on the GPU) could choose another first token.
        let (margin, scale) = first_token_margin(&mut dec, p)?;
        let t0 = Instant::now();
        let g = greedy(&mut dec, p, stop)?;
        let t1 = Instant::now();
        let s = speculative(&mut dec, &mut draft, p, stop)?;
        t_greedy += (t1 - t0).as_secs_f64();
        t_spec += t1.elapsed().as_secs_f64();
        n_greedy += g.len();
        n_spec += s.tokens.len();
        same += usize::from(g == s.tokens);
        per.push(
            json!({"prompt_tokens": p.len(), "tokens": s.tokens, "accepted": s.accepted,
                        "first_margin": margin, "first_logit_max_abs": scale}),
        );
        runs.push(s.accepted);
    }
    let tau = Tau::new(&runs, bs, a.seed);
    let report = json!({
        "target": a.target,
        "drafter": a.drafter,
        "drafter_step": ex.step,
        "device": if on_gpu { "gpu" } else { "cpu" },
        "prompts": prompts.len(),
        "block_size": bs,
        "max_new_tokens": a.max_new_tokens,
        "tau": tau,
        "bootstrap": {"resamples": super::report::BOOTSTRAP, "seed": a.seed},
        "identical_to_greedy": same,
        "speculative_tokens_per_s": n_spec as f64 / t_spec.max(1e-9),
        "greedy_tokens_per_s": n_greedy as f64 / t_greedy.max(1e-9),
        "speedup": t_greedy / t_spec.max(1e-9) * n_spec as f64 / n_greedy.max(1) as f64,
        "per_prompt": per,
    });
    print(&report, a.json);
    Ok(verdict(same, prompts.len(), on_gpu))
}

/// The prefill of `prompt`'s top-2 margin and largest |logit| of its last row
/// ([`top2_margin`]).
fn first_token_margin(dec: &mut Decoder, prompt: &[u32]) -> Result<(f32, f32), ToolError> {
    let vocab = dec.vocab();
    dec.crop(0)?;
    let f = dec.prefill(prompt)?;
    let last =
        f.logits.len().checked_sub(vocab).ok_or_else(|| {
            crate::device::GpuError::Invalid("the prefill returned no logits".into())
        })?;
    Ok(top2_margin(&f.logits[last..]))
}

/// The largest value of `row` minus the second largest (0 for fewer than two values,
/// or a tie), and the largest |value|.
pub fn top2_margin(row: &[f32]) -> (f32, f32) {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in row {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    let scale = row.iter().fold(0f32, |m, x| m.max(x.abs()));
    let margin = if b.is_finite() { a - b } else { 0.0 };
    (margin, scale)
}

/// Whether `same` of `n` prompts decoded as greedy decoding did is a pass: all of them on
/// the CPU; on the GPU a difference is said, not failed (bf16 may round a near tie apart).
fn verdict(same: usize, n: usize, on_gpu: bool) -> bool {
    if same == n {
        return true;
    }
    let why = if on_gpu {
        " (on the GPU, bf16 may round a near tie apart)"
    } else {
        ""
    };
    eprintln!(
        "dflash-worker: {}speculative decoding wrote other tokens than greedy decoding on {} of {n} prompts{why}",
        if on_gpu { "" } else { "error: " },
        n - same,
    );
    on_gpu
}

fn print(r: &Value, json: bool) {
    if json {
        println!("{r}");
        return;
    }
    let t = &r["tau"];
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    let ci = |v: &Value| format!("[{:.2}, {:.2}]", f(&v[0]), f(&v[1]));
    println!(
        "{} prompts, block {}, up to {} new tokens",
        r["prompts"], r["block_size"], r["max_new_tokens"]
    );
    println!(
        "τ mean of per-prompt means {:.3} (95% CI {}), pooled tokens/verify steps {:.3} (95% CI {})",
        f(&t["mean_of_means"]),
        ci(&t["mean_of_means_ci95"]),
        f(&t["pooled"]),
        ci(&t["pooled_ci95"])
    );
    println!(
        "accepted lengths 1..{}: {}",
        r["block_size"], t["histogram"]
    );
    println!(
        "decode {:.1} tokens/s speculative, {:.1} greedy: speedup {:.2}x; identical to greedy on {} of {} prompts",
        f(&r["speculative_tokens_per_s"]),
        f(&r["greedy_tokens_per_s"]),
        f(&r["speedup"]),
        r["identical_to_greedy"],
        r["prompts"]
    );
}

#[cfg(test)]
mod tests {
    use super::top2_margin;

    #[test]
    fn the_margin_is_the_top_logit_over_the_runner_up() {
        assert_eq!(top2_margin(&[1.0, 4.0, -7.5, 3.25]), (0.75, 7.5));
        // A tie has no margin, wherever the two stand.
        assert_eq!(top2_margin(&[2.0, -1.0, 2.0]), (0.0, 2.0));
        assert_eq!(top2_margin(&[5.0, 5.0, 1.0]), (0.0, 5.0));
        // Descending order too (the runner-up is found after the top).
        assert_eq!(top2_margin(&[3.0, 2.0, 1.0]), (1.0, 3.0));
        assert_eq!(top2_margin(&[3.0]), (0.0, 3.0));
    }
}
