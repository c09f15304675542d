//! `dflash-worker bench-compute --spec FILE`: the target forward and the drafter train step
//! over given token batches, in this one process with no pipeline — the baseline that
//! `dflash-supervise bench train` compares the pipeline against. Both run the models the
//! CPU workers run: the device target and drafter on the CPU device. With `"torch": true` in
//! the spec, also the torch engine's target forward over the same rows: its Python child
//! (transformers, f32 on the CPU), as a target worker with `--target-engine torch` runs it.

use std::path::{Path, PathBuf};
use std::time::Instant;

use dflash_shared::batch::TokenBatch;
use dflash_shared::drafter::DrafterConfig;
use serde::{Deserialize, Serialize};

use crate::device::cpu::CpuDevice;
use crate::error::ToolError;
use crate::models::drafter::device::{DeviceDrafter, GradTo, Gradient, Rows, Step};
use crate::models::drafter::{batch_samples, AdamW, Drafter, Frozen};
use crate::models::target::device::DeviceTarget;
use crate::models::target::Target;
use crate::models::weights::Weights;

#[derive(Debug, Serialize, Deserialize)]
pub struct Spec {
    pub target_dir: PathBuf,
    pub taps: Vec<usize>,
    pub drafter: DrafterConfig,
    pub lr: f64,
    pub seed: u64,
    pub batches: Vec<TokenBatch>,
    /// Also measure the torch engine's target forward.
    #[serde(default)]
    pub torch: bool,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Figures {
    pub tokens: u64,
    pub target_tokens_per_s: f64,
    pub drafter_tokens_per_s: f64,
    /// The torch engine's target forward, when the spec asks for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_target_tokens_per_s: Option<f64>,
}

pub fn run(spec_path: &Path) -> Result<(), ToolError> {
    let text = std::fs::read_to_string(spec_path)
        .map_err(ToolError::io(format!("--spec {}", spec_path.display())))?;
    let spec: Spec = serde_json::from_str(&text)
        .map_err(ToolError::json(format!("--spec {}", spec_path.display())))?;
    let target = Target::load(&spec.target_dir, &spec.taps)?;
    let c = &spec.drafter;
    let w = Weights::open(&spec.target_dir)?;
    let frozen = Frozen::load(&w, c.vocab, c.hidden)?;
    let tokens: u64 = spec.batches.iter().map(|b| b.tokens()).sum();

    let longest = spec
        .batches
        .iter()
        .flat_map(|b| b.lengths.iter().map(|&l| l as usize))
        .max()
        .unwrap_or(1);
    // Room for the largest batch's tokens: each batch is one packed forward, as in a
    // target worker (whose room is the run's token budget).
    let room = spec.batches.iter().map(|b| b.tokens() as usize).max();
    let mut target = DeviceTarget::new(Box::new(CpuDevice::new()), &target, room.unwrap_or(1))?;

    // Target: forward every batch's rows, keep the taps as bf16 values (as the pipeline
    // ships them).
    let t0 = Instant::now();
    let mut hidden: Vec<Vec<Vec<f32>>> = Vec::new();
    for b in &spec.batches {
        let seq = b.seq_len as usize;
        let rows: Vec<&[u32]> = b
            .lengths
            .iter()
            .enumerate()
            .map(|(r, &len)| &b.input_ids[r * seq..r * seq + len as usize])
            .collect();
        let mut taps = target.forward_rows(&rows)?;
        for v in taps.iter_mut().flatten() {
            *v = half::bf16::from_f32(*v).to_f32();
        }
        hidden.push(taps);
    }
    let target_s = t0.elapsed().as_secs_f64();

    drop(target);
    let torch_s = if spec.torch {
        Some(torch_forward(&spec)?)
    } else {
        None
    };
    // Drafter: one step per batch, as a one-rank group takes it (gradient, its copy into
    // the reduce buffer, clip to 1 and AdamW on the device).
    let d = Drafter::new(c.clone());
    let p = d.init_params(spec.seed);
    let zeros = vec![0f32; p.len()];
    let mut model = DeviceDrafter::new(Box::new(CpuDevice::new()), &d, &frozen, longest)?;
    model.load(&p, &zeros, &zeros, 0)?;
    let hyper = AdamW::new(0).hyper();
    let t1 = Instant::now();
    for (step, (b, taps)) in spec.batches.iter().zip(&hidden).enumerate() {
        let (samples, anchors) = batch_samples(&d, b, taps, spec.seed);
        let stats = model.forward_backward(&samples, Rows::F32, &anchors, 1.0, GradTo::Device)?;
        let reduced = model.reduce_alone()?;
        model.update(
            &Step::new(step as u64 + 1, 1.0, spec.lr as f32, &hyper),
            Gradient::Reduced {
                weight_sum: stats.weight_sum,
                after: Some(reduced),
            },
        )?;
    }
    model.drain()?;
    let drafter_s = t1.elapsed().as_secs_f64();
    let f = Figures {
        tokens,
        target_tokens_per_s: tokens as f64 / target_s,
        drafter_tokens_per_s: tokens as f64 / drafter_s,
        torch_target_tokens_per_s: torch_s.map(|s| tokens as f64 / s),
    };
    println!(
        "{}",
        serde_json::to_string(&f).map_err(ToolError::json("the figures"))?
    );
    Ok(())
}

/// The torch engine's target forward over every batch's rows, in seconds: its Python child
/// on the spec's target (transformers, f32 on the CPU), each batch one request whose rows'
/// taps it writes, in f32, into a scratch file as it writes into a hidden-state pool. From
/// the first request to the last answer: the child's start (Python, transformers, the
/// model) is not throughput, as loading the native target is not.
fn torch_forward(spec: &Spec) -> Result<f64, ToolError> {
    use crate::torch_engine::{Mode, TorchChild};
    let hidden = dflash_shared::model_config::TargetConfig::load(&spec.target_dir)?.hidden_size;
    let row_bytes = |len: usize| (len * spec.taps.len() * hidden * 4) as u64;
    let scratch = dflash_shared::scratch::ScratchDir::new("bench-torch")
        .map_err(ToolError::io("creating a scratch directory".to_string()))?;
    let pool = scratch.path().join("pool");
    let room = spec
        .batches
        .iter()
        .map(|b| row_bytes(b.tokens() as usize))
        .max()
        .unwrap_or(0);
    std::fs::File::create(&pool)
        .and_then(|f| f.set_len(room.max(1)))
        .map_err(ToolError::io(format!("creating {}", pool.display())))?;
    let mut child = TorchChild::start(&spec.target_dir, &spec.taps, Mode::Taps { pool: &pool }, 0)?;
    let t0 = Instant::now();
    for (id, b) in spec.batches.iter().enumerate() {
        let seq = b.seq_len as usize;
        let mut offset = 0u64;
        let rows: Vec<(&[u32], u64)> = b
            .lengths
            .iter()
            .enumerate()
            .map(|(r, &len)| {
                let row = (&b.input_ids[r * seq..r * seq + len as usize], offset);
                offset += row_bytes(len as usize);
                row
            })
            .collect();
        child.run(id as u64, &rows, true)?;
    }
    let seconds = t0.elapsed().as_secs_f64();
    drop(child);
    Ok(seconds)
}
