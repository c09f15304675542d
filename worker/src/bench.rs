//! `dflash-worker bench-compute --spec FILE`: the target forward and the drafter train step
//! over given token batches, in this one process with no pipeline — the baseline that
//! `dflash-supervise bench train` compares the pipeline against.

use std::path::{Path, PathBuf};
use std::time::Instant;

use dflash_shared::batch::TokenBatch;
use dflash_shared::drafter::DrafterConfig;
use serde::{Deserialize, Serialize};

use crate::error::ToolError;
use crate::model::drafter::{batch_samples, grad_norm, AdamW, Drafter, Frozen};
use crate::model::target::Target;
use crate::model::weights::Weights;

#[derive(Debug, Serialize, Deserialize)]
pub struct Spec {
    pub target_dir: PathBuf,
    pub taps: Vec<usize>,
    pub drafter: DrafterConfig,
    pub lr: f64,
    pub seed: u64,
    pub batches: Vec<TokenBatch>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Figures {
    pub tokens: u64,
    pub target_tokens_per_s: f64,
    pub drafter_tokens_per_s: f64,
}

pub fn run(spec_path: &Path) -> Result<(), ToolError> {
    let text = std::fs::read_to_string(spec_path)
        .map_err(ToolError::io(format!("--spec {}", spec_path.display())))?;
    let spec: Spec = serde_json::from_str(&text)
        .map_err(ToolError::json(format!("--spec {}", spec_path.display())))?;
    let target = Target::load(&spec.target_dir, &spec.taps)?;
    let c = &spec.drafter;
    let w = Weights::open(&spec.target_dir)?;
    let embed = w.get("model.embed_tokens.weight", &[c.vocab, c.hidden])?;
    let lm_head = if w.contains("lm_head.weight") {
        w.get("lm_head.weight", &[c.vocab, c.hidden])?
    } else {
        embed.clone()
    };
    let frozen = Frozen { embed, lm_head };
    let tokens: u64 = spec.batches.iter().map(|b| b.tokens()).sum();

    // Target: forward every row, keep the taps as bf16 values (as the pipeline ships them).
    let t0 = Instant::now();
    let mut hidden: Vec<Vec<Vec<f32>>> = Vec::new();
    for b in &spec.batches {
        let seq = b.seq_len as usize;
        let rows = b
            .lengths
            .iter()
            .enumerate()
            .map(|(r, &len)| {
                target
                    .forward_taps(&b.input_ids[r * seq..r * seq + len as usize])
                    .into_iter()
                    .map(|v| half::bf16::from_f32(v).to_f32())
                    .collect()
            })
            .collect();
        hidden.push(rows);
    }
    let target_s = t0.elapsed().as_secs_f64();

    // Drafter: one step per batch, as one rank would take it.
    let d = Drafter::new(c.clone());
    let mut p = d.init_params(spec.seed);
    let mut opt = AdamW::new(p.len());
    let t1 = Instant::now();
    for (b, taps) in spec.batches.iter().zip(&hidden) {
        let (samples, anchors) = batch_samples(&d, b, taps, spec.seed);
        let mut g = vec![0f32; p.len()];
        d.train_batch(
            &p,
            &frozen,
            &samples,
            &anchors,
            d.total_weight(&samples, &anchors),
            &mut g,
        );
        if let Some(norm) = grad_norm(&g) {
            if norm > 1.0 {
                g.iter_mut().for_each(|x| *x /= norm as f32);
            }
            opt.update(&mut p, &g, spec.lr as f32);
        }
    }
    let drafter_s = t1.elapsed().as_secs_f64();
    let f = Figures {
        tokens,
        target_tokens_per_s: tokens as f64 / target_s,
        drafter_tokens_per_s: tokens as f64 / drafter_s,
    };
    println!(
        "{}",
        serde_json::to_string(&f).map_err(ToolError::json("the figures"))?
    );
    Ok(())
}
