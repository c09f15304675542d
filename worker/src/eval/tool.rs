//! `dflash-worker eval`: load the target and the exported drafter, read the prompts,
//! decode each prompt greedily and speculatively on the CPU device (f32) or the GPU
//! (`--gpu`: bf16), print the figures.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use super::draft::{Draft, Exported};
use super::report::{acceptance_by_position, per_category, Tau};
use super::spec::{greedy, speculative, Stop};
use super::verifier::Verifier;
use super::EvalError;
use crate::device::cpu::CpuDevice;
use crate::error::ToolError;

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
    /// What runs the target: native, torch (transformers in a Python child) or auto.
    pub engine: String,
}

/// The drafter's device: the CPU, or the first of the target's GPUs.
fn first_device(gpus: usize) -> Result<Box<dyn crate::device::Device>, ToolError> {
    if gpus == 0 {
        return Ok(Box::new(CpuDevice::new()));
    }
    Ok(Box::new(crate::device::cuda::CudaDevice::open_ordinal(0)?))
}

/// The fields of a prompt line kept beside its tokens (strings or numbers, each optional).
pub const PROMPT_FIELDS: [&str; 3] = ["id", "category", "dataset"];

/// One prompt: its token ids and the [`PROMPT_FIELDS`] its line carried.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub ids: Vec<u32>,
    pub fields: serde_json::Map<String, Value>,
}

impl Prompt {
    /// What its τ is grouped by: its category, else its dataset (a number as written).
    pub fn category(&self) -> Option<String> {
        let v = self
            .fields
            .get("category")
            .or_else(|| self.fields.get("dataset"))?;
        Some(v.as_str().map_or_else(|| v.to_string(), str::to_string))
    }
}

/// The [`PROMPT_FIELDS`] of a line's object: null is absent, a string or a number kept.
fn prompt_fields(
    o: &serde_json::Map<String, Value>,
) -> Result<serde_json::Map<String, Value>, String> {
    let mut out = serde_json::Map::new();
    for k in PROMPT_FIELDS {
        match o.get(k) {
            None | Some(Value::Null) => {}
            Some(v @ (Value::String(_) | Value::Number(_))) => {
                out.insert(k.to_string(), v.clone());
            }
            Some(v) => return Err(format!("{k} {v} is neither a string nor a number")),
        }
    }
    Ok(out)
}

/// Token-id prompts, one per line: a JSON array, or an object with `input_ids` (and
/// optionally `id`, `category`, `dataset`). Blank lines are skipped; ids must lie in the
/// vocabulary.
pub fn read_prompts(path: &Path, vocab: usize) -> Result<Vec<Prompt>, EvalError> {
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
        let (ids, fields) = match &v {
            Value::Object(o) => (
                o.get("input_ids").cloned().unwrap_or(Value::Null),
                prompt_fields(o).map_err(bad)?,
            ),
            _ => (v, serde_json::Map::new()),
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
        out.push(Prompt { ids, fields });
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
    let cfg = dflash_shared::model_config::TargetConfig::load_any(dir)?;
    let ex = Exported::load(&a.drafter)?;
    ex.check_target(&a.drafter, &cfg)?;
    let prompts = read_prompts(&a.prompts, cfg.vocab_size)?;
    let torch = super::verifier::wants_torch(&a.engine, &cfg)?;
    let eos = eos(dir);
    let bs = ex.cfg.block_size;
    let longest = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
    let max_len = longest + a.max_new_tokens + bs;
    let gpus = super::verifier::decode_gpus(a.gpu);
    let on_gpu = gpus > 0;
    let open = super::verifier::Open {
        dir,
        taps: &ex.target_layer_ids,
        torch,
        gpus,
        max_len,
        block: bs.max(64),
    };
    let (mut dec, frozen) = super::verifier::open(&open, true)?;
    let Some(frozen) = frozen else {
        return Err(crate::device::GpuError::Invalid(
            "the target opened without its embedding and lm_head, which the drafter shares".into(),
        )
        .into());
    };
    drop(scratch);
    let mut draft = Draft::new(first_device(gpus)?, &ex.cfg, &ex.params, &frozen, max_len)?;
    drop(frozen);
    let stop = Stop {
        max_new: a.max_new_tokens,
        eos,
    };
    let d = decode_all(dec.as_mut(), &mut draft, &prompts, stop)?;
    let keys: Vec<Option<String>> = prompts.iter().map(Prompt::category).collect();
    let categories: serde_json::Map<String, Value> = per_category(&d.runs, &keys, bs, a.seed)
        .into_iter()
        .map(|(k, c)| (k, json!(c)))
        .collect();
    let report = json!({
        "target": a.target,
        "drafter": a.drafter,
        "drafter_step": ex.step,
        "device": if on_gpu { "gpu" } else { "cpu" },
        "engine": if torch { "torch" } else { "native" },
        "prompts": prompts.len(),
        "block_size": bs,
        "max_new_tokens": a.max_new_tokens,
        "tau": Tau::new(&d.runs, bs, a.seed),
        "acceptance_by_position": acceptance_by_position(&d.runs, bs),
        "per_category": categories,
        "bootstrap": {"resamples": super::report::BOOTSTRAP, "seed": a.seed},
        "identical_to_greedy": d.same,
        "speculative_tokens_per_s": d.n_spec as f64 / d.t_spec.max(1e-9),
        "greedy_tokens_per_s": d.n_greedy as f64 / d.t_greedy.max(1e-9),
        "speedup": d.t_greedy / d.t_spec.max(1e-9) * d.n_spec as f64 / d.n_greedy.max(1) as f64,
        "per_prompt": d.per,
    });
    print(&report, a.json);
    Ok(verdict(d.same, prompts.len(), on_gpu))
}

/// Every prompt decoded both ways: the accepted lengths per prompt, the per-prompt
/// entries of the report, the times and token counts of each decoding, and on how many
/// prompts they agreed.
struct Decoding {
    runs: Vec<Vec<usize>>,
    per: Vec<Value>,
    t_greedy: f64,
    t_spec: f64,
    n_greedy: usize,
    n_spec: usize,
    same: usize,
}

fn decode_all(
    dec: &mut dyn Verifier,
    draft: &mut Draft,
    prompts: &[Prompt],
    stop: Stop,
) -> Result<Decoding, ToolError> {
    let mut d = Decoding {
        runs: Vec::new(),
        per: Vec::new(),
        t_greedy: 0.0,
        t_spec: 0.0,
        n_greedy: 0,
        n_spec: 0,
        same: 0,
    };
    for p in prompts {
        // The first token is the prefill's argmax: how far its logit stands above the
        // runner-up's, and the row's largest |logit|, say whether another device's
        // rounding (bf16 on the GPU) could choose another first token.
        let (margin, scale) = first_token_margin(dec, &p.ids)?;
        let t0 = Instant::now();
        let g = greedy(dec, &p.ids, stop)?;
        let t1 = Instant::now();
        let s = speculative(dec, draft, &p.ids, stop)?;
        d.t_greedy += (t1 - t0).as_secs_f64();
        d.t_spec += t1.elapsed().as_secs_f64();
        d.n_greedy += g.len();
        d.n_spec += s.tokens.len();
        d.same += usize::from(g == s.tokens);
        // The line's id, category and dataset, as it gave them, beside the figures.
        let mut entry = p.fields.clone();
        if let Value::Object(o) = json!({"prompt_tokens": p.ids.len(), "tokens": s.tokens,
            "accepted": s.accepted, "first_margin": margin, "first_logit_max_abs": scale})
        {
            entry.extend(o);
        }
        d.per.push(Value::Object(entry));
        d.runs.push(s.accepted);
    }
    Ok(d)
}

/// The prefill of `prompt`'s top-2 margin and largest |logit| of its last row
/// ([`super::verifier::top2_margin`]).
fn first_token_margin(dec: &mut dyn Verifier, prompt: &[u32]) -> Result<(f32, f32), ToolError> {
    dec.keep(0)?;
    let f = dec.verify(prompt)?;
    Ok((f.margin, f.max_abs))
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
    print_curve_and_categories(r);
    println!(
        "decode {:.1} tokens/s speculative, {:.1} greedy: speedup {:.2}x; identical to greedy on {} of {} prompts",
        f(&r["speculative_tokens_per_s"]),
        f(&r["greedy_tokens_per_s"]),
        f(&r["speedup"]),
        r["identical_to_greedy"],
        r["prompts"]
    );
}

/// The acceptance curve on one line, then τ per category as a table (when the prompts
/// had categories).
fn print_curve_and_categories(r: &Value) {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    let ci = |v: &Value| format!("[{:.2}, {:.2}]", f(&v[0]), f(&v[1]));
    let curve: Vec<String> = r["acceptance_by_position"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| format!("{:.3}", f(v)))
        .collect();
    if curve.is_empty() {
        println!("acceptance by drafted position: no verify step");
    } else {
        println!(
            "acceptance by drafted position 1..{}: {}",
            curve.len(),
            curve.join(" ")
        );
    }
    let Some(cats) = r["per_category"].as_object().filter(|c| !c.is_empty()) else {
        return;
    };
    let w = cats
        .keys()
        .map(|k| k.chars().count())
        .chain([8])
        .max()
        .unwrap_or(8);
    println!(
        "{:<w$}  prompts  {:<26}  τ pooled [95% CI]",
        "category", "τ mean of means [95% CI]"
    );
    for (k, c) in cats {
        let t = &c["tau"];
        let mm = format!(
            "{:.3} {}",
            f(&t["mean_of_means"]),
            ci(&t["mean_of_means_ci95"])
        );
        println!(
            "{k:<w$}  {:>7}  {mm:<26}  {:.3} {}",
            c["prompts"].as_u64().unwrap_or(0),
            f(&t["pooled"]),
            ci(&t["pooled_ci95"])
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::verifier::top2_margin;
    use super::{read_prompts, EvalError};

    #[test]
    fn prompt_lines_keep_their_id_category_and_dataset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        let lines = [
            r#"[1, 2]"#,
            r#"{"input_ids": [3], "id": "gsm8k-0", "category": "math", "dataset": "gsm8k"}"#,
            "",
            r#"{"input_ids": [4, 5], "id": 7, "dataset": "mbpp", "loss_mask": [1, 1]}"#,
            r#"{"input_ids": [6], "category": 3, "id": null}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let p = read_prompts(&path, 10).unwrap();
        assert_eq!(p.len(), 4);
        assert_eq!(p[0].ids, [1, 2]);
        assert!(p[0].fields.is_empty() && p[0].category().is_none());
        assert_eq!(p[1].fields["id"], "gsm8k-0");
        assert_eq!(p[1].fields["dataset"], "gsm8k");
        assert_eq!(p[1].category().as_deref(), Some("math"));
        // No category: the dataset groups it; other fields are not kept.
        assert_eq!(p[2].ids, [4, 5]);
        assert_eq!(p[2].fields["id"], 7);
        assert_eq!(p[2].category().as_deref(), Some("mbpp"));
        assert!(!p[2].fields.contains_key("loss_mask"));
        // A number is a category too; null is no id.
        assert_eq!(p[3].category().as_deref(), Some("3"));
        assert!(!p[3].fields.contains_key("id"));
        std::fs::write(&path, r#"{"input_ids": [1], "category": ["math"]}"#).unwrap();
        match read_prompts(&path, 10) {
            Err(e @ EvalError::BadPrompt { line: 1, .. }) => {
                let e = e.to_string();
                assert!(
                    e.contains("category [\"math\"] is neither a string nor a number"),
                    "{e}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

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
