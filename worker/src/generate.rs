//! `dflash-worker generate`: the target alone continues token-id prompts, one process per
//! device (what `dflash-supervise regenerate` runs). The supervisor renders chat with the
//! target's template and keeps the journal; this process reads one request per stdin line
//! and answers each with one stdout line, in order:
//!
//! ```text
//! → {"id": 7, "ids": [151644, 872, ...], "max_new": 512, "seed": 1234}
//! ← {"id": 7, "tokens": [785, 4226, ..., 151645], "finish": "stop"}
//! ```
//!
//! `finish` is `stop` (the last token is one of `--stop`) or `length` (`max_new` tokens).
//! The target runs on the native engine, or (`--engine torch`, and `auto` for the families
//! the native engine does not serve) in the torch engine's Python child over
//! transformers' KV cache; the sampling below is the same for both. Decoding is greedy (`--temperature 0`) or samples
//! from the temperature-scaled softmax cut to its top-p nucleus, with a generator seeded
//! per request, so a request gives the same tokens whichever process and whenever it runs.

use std::io::{BufRead, Write};
use std::path::Path;

use dflash_shared::rng::Rng;
use serde::{Deserialize, Serialize};

use crate::error::ToolError;
use crate::eval::verifier::{wants_torch, Verifier};
use crate::models::target::device::decode::argmax;

/// What `generate` was asked.
pub struct Args {
    /// A model directory, or "tiny".
    pub target: String,
    /// Prompt and new tokens together at most (the KV cache's length).
    pub max_len: usize,
    pub sampling: Sampling,
    /// Tokens that end a continuation (kept as its last token).
    pub stop: Vec<u32>,
    /// On the GPU (ordinal 0), not the CPU.
    pub gpu: bool,
    /// What runs the target: native, torch (transformers in a Python child) or auto.
    pub engine: String,
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the first largest logit).
    pub temperature: f32,
    /// The nucleus: the fewest most likely tokens whose probabilities reach this.
    pub top_p: f32,
}

#[derive(Debug, Deserialize)]
struct Request {
    id: u64,
    ids: Vec<u32>,
    max_new: usize,
    #[serde(default)]
    seed: u64,
}

#[derive(Debug, Serialize)]
struct Reply {
    id: u64,
    tokens: Vec<u32>,
    finish: &'static str,
}

/// Uniform in [0, 1).
fn uniform(rng: &mut Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

impl Sampling {
    /// The next token from one row of logits.
    pub fn pick(&self, row: &[f32], rng: &mut Rng) -> u32 {
        if self.temperature <= 0.0 {
            return argmax(row);
        }
        let t = self.temperature as f64;
        let top = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
        let mut p: Vec<(u32, f64)> = row
            .iter()
            .enumerate()
            .map(|(i, &x)| (i as u32, ((x as f64 - top) / t).exp()))
            .collect();
        // Most likely first; ties by id, so the order is the same on every machine.
        p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let total: f64 = p.iter().map(|x| x.1).sum();
        let (mut kept, mut mass) = (0, 0.0);
        for &(_, w) in &p {
            kept += 1;
            mass += w;
            if mass >= self.top_p as f64 * total {
                break;
            }
        }
        let mut u = uniform(rng) * mass;
        for &(id, w) in &p[..kept] {
            if u < w {
                return id;
            }
            u -= w;
        }
        p[kept - 1].0
    }
}

/// One continuation of `prompt`: up to `max_new` tokens, ending at a stop token.
pub fn continue_prompt(
    dec: &mut dyn Verifier,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    sampling: Sampling,
    rng: &mut Rng,
) -> Result<(Vec<u32>, &'static str), ToolError> {
    dec.keep(0)?;
    let mut out = vec![sampling.pick(&dec.last_logits(prompt)?, rng)];
    loop {
        if stop.contains(&out[out.len() - 1]) {
            return Ok((out, "stop"));
        }
        if out.len() >= max_new {
            return Ok((out, "length"));
        }
        let logits = dec.last_logits(&out[out.len() - 1..])?;
        out.push(sampling.pick(&logits, rng));
    }
}

/// A request this process cannot serve: the supervisor checks these before sending, so
/// one means the two disagree.
fn bad_request(line: usize, why: String) -> ToolError {
    ToolError::Usage {
        flag: "stdin",
        value: format!("request {line}"),
        expected: why,
    }
}

/// Load the target, then answer requests until stdin ends.
pub fn run(a: &Args) -> Result<(), ToolError> {
    let mut scratch = None;
    let dir = if a.target == "tiny" {
        let s = scratch.insert(
            dflash_shared::scratch::ScratchDir::new("tiny-generate")
                .map_err(ToolError::io("creating a scratch directory".to_string()))?,
        );
        crate::models::tiny::write(s.path())
            .map_err(ToolError::io(format!("writing {}", s.path().display())))?;
        s.path().to_path_buf()
    } else {
        Path::new(&a.target).to_path_buf()
    };
    let cfg = dflash_shared::model_config::TargetConfig::load_any(&dir)?;
    let vocab = cfg.vocab_size;
    // Every layer (decoding needs the logits); one tap, as the decoder reads one.
    let open = crate::eval::verifier::Open {
        dir: &dir,
        taps: &[0],
        torch: wants_torch(&a.engine, &cfg)?,
        gpus: crate::eval::verifier::decode_gpus(a.gpu),
        max_len: a.max_len,
        block: 64,
    };
    let (mut dec, _) = crate::eval::verifier::open(&open, false)?;
    drop(scratch);
    let stdout = std::io::stdout();
    for (n, line) in std::io::stdin().lock().lines().enumerate() {
        let line = line.map_err(ToolError::io("reading stdin"))?;
        if line.trim().is_empty() {
            continue;
        }
        let r: Request =
            serde_json::from_str(&line).map_err(ToolError::json(format!("request {}", n + 1)))?;
        if r.ids.is_empty() || r.max_new == 0 {
            return Err(bad_request(
                n + 1,
                "a prompt and 1 or more new tokens".into(),
            ));
        }
        if let Some(t) = r.ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(bad_request(n + 1, format!("token {t} not below {vocab}")));
        }
        if r.ids.len() + r.max_new > a.max_len {
            return Err(bad_request(
                n + 1,
                format!(
                    "{} + {} tokens within --max-len {}",
                    r.ids.len(),
                    r.max_new,
                    a.max_len
                ),
            ));
        }
        let mut rng = Rng::new(r.seed);
        let (tokens, finish) = continue_prompt(
            dec.as_mut(),
            &r.ids,
            r.max_new,
            &a.stop,
            a.sampling,
            &mut rng,
        )?;
        let reply = serde_json::to_string(&Reply {
            id: r.id,
            tokens,
            finish,
        })
        .map_err(ToolError::json("a reply"))?;
        let mut out = stdout.lock();
        writeln!(out, "{reply}")
            .and_then(|_| out.flush())
            .map_err(ToolError::io("writing stdout"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest_and_sampling_stays_in_the_nucleus() {
        let row = [0.5f32, 3.0, 3.0, -1.0, 2.9];
        let mut rng = Rng::new(1);
        let greedy = Sampling {
            temperature: 0.0,
            top_p: 1.0,
        };
        assert_eq!(greedy.pick(&row, &mut rng), 1);
        // top_p small: only the most likely token (the lower id of a tie) is kept.
        let narrow = Sampling {
            temperature: 1.0,
            top_p: 0.01,
        };
        assert!((0..50).all(|_| narrow.pick(&row, &mut rng) == 1));
        // The three near-equal tokens hold ~97% of the mass; top_p 0.9 never picks the rest.
        let nucleus = Sampling {
            temperature: 1.0,
            top_p: 0.9,
        };
        let mut seen = [0usize; 5];
        for _ in 0..3000 {
            seen[nucleus.pick(&row, &mut rng) as usize] += 1;
        }
        assert_eq!((seen[0], seen[3]), (0, 0), "{seen:?}");
        assert!(seen[1] > 700 && seen[2] > 700 && seen[4] > 700, "{seen:?}");
        // Full nucleus, high temperature: every token comes up.
        let wide = Sampling {
            temperature: 5.0,
            top_p: 1.0,
        };
        let mut all = [false; 5];
        for _ in 0..3000 {
            all[wide.pick(&row, &mut rng) as usize] = true;
        }
        assert_eq!(all, [true; 5]);
        // Seeded: the same generator gives the same picks.
        let picks = |seed| {
            let mut r = Rng::new(seed);
            (0..20).map(|_| wide.pick(&row, &mut r)).collect::<Vec<_>>()
        };
        assert_eq!(picks(7), picks(7));
        assert_ne!(picks(7), picks(8));
    }
}
