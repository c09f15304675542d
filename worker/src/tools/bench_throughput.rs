//! `dflash-worker bench-ops --target throughput:PRESET` (what `dflash-supervise bench
//! compute --target throughput:qwen3-8b` runs, and `scripts/gpu_check.sh`'s `throughput`
//! step): the steady throughput of one target worker and one drafter worker on the GPU,
//! on random weights at a model's real layer shapes (no download), each over at least 20
//! timed steps after a warm-up, with the measured MFU against the device's dense bf16
//! peak. The shapes are those of the roofline model of `bench kernels` (a target forward
//! over one causal sequence of 4096 tokens; a drafter step of 512 blocks of 16 over a
//! 4096-token context, 5 layers reading 5 taps, Qwen3's 151,936 vocabulary), so the two
//! MFUs can be read side by side. `throughput:tiny` runs the same code at shapes the
//! emulated GPU (the host CPU) runs in seconds.

use std::time::Instant;

use dflash_shared::drafter::DrafterConfig;
use dflash_shared::model_config::TargetConfig;
use dflash_shared::rng::Rng;
use serde::Serialize;

use crate::device::GpuError;
use crate::error::ToolError;
use crate::models::drafter::device::{GradTo, Gradient, Rows, Step};
use crate::models::drafter::{AdamW, Drafter, Frozen, Sample};
use crate::models::target::device::DeviceTarget;
use crate::models::target::Target;
use crate::tools::bench_ops::{drafter_step_flops, open_device, pattern, peak_bf16_tflops};

/// The shapes and step counts of a preset.
#[derive(Debug, Clone, Serialize)]
pub struct ThroughputShape {
    pub name: String,
    pub hidden: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    /// The drafter's vocabulary (its frozen lm_head: the loss reads all of it).
    pub vocab: usize,
    /// Layers of the target measured (random weights) and of the model it stands for:
    /// a target worker's tokens/s for the whole model is the measured rate scaled by
    /// `target_layers / model_layers` (the layers are the forward's time).
    pub target_layers: usize,
    pub model_layers: usize,
    /// The target's vocabulary: only the embedding gather reads it (no lm_head in a
    /// target worker), at a cost that does not depend on its size.
    pub target_vocab: usize,
    /// Tokens of one target forward (one causal sequence) and of a drafter step's context.
    pub tokens: usize,
    pub drafter_layers: usize,
    pub block_size: usize,
    pub anchors: usize,
    pub warmup_steps: usize,
    pub target_steps: usize,
    pub drafter_steps: usize,
}

/// `qwen3-8b`: Qwen3-8B's layers (hidden 4096, 32 query and 8 KV heads of 128, MLP
/// 12288; 2 of its 36 layers for the target) and the drafter `bench kernels` models (5
/// layers and taps, 512 blocks of 16 over 4096 tokens, vocabulary 151,936). `tiny`: the
/// same code at shapes the emulated GPU runs in seconds (head dim 128 still).
pub fn preset(name: &str) -> Option<ThroughputShape> {
    let s = match name {
        "qwen3-8b" => ThroughputShape {
            name: name.into(),
            hidden: 4096,
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 12288,
            vocab: 151_936,
            target_layers: 2,
            model_layers: 36,
            target_vocab: 8192,
            tokens: 4096,
            drafter_layers: 5,
            block_size: 16,
            anchors: 512,
            warmup_steps: 3,
            target_steps: 50,
            drafter_steps: 20,
        },
        "tiny" => ThroughputShape {
            name: name.into(),
            hidden: 128,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 128,
            intermediate: 256,
            vocab: 256,
            target_layers: 1,
            model_layers: 2,
            target_vocab: 256,
            tokens: 16,
            drafter_layers: 1,
            block_size: 4,
            anchors: 2,
            warmup_steps: 1,
            target_steps: 20,
            drafter_steps: 20,
        },
        _ => return None,
    };
    Some(s)
}

impl ThroughputShape {
    fn config_json(&self, layers: usize, vocab: usize) -> String {
        format!(
            r#"{{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":{},"num_hidden_layers":{layers},
            "num_attention_heads":{},"num_key_value_heads":{},"head_dim":{},"intermediate_size":{},"rms_norm_eps":1e-6,
            "rope_theta":1000000.0,"vocab_size":{vocab},"tie_word_embeddings":true}}"#,
            self.hidden, self.q_heads, self.kv_heads, self.head_dim, self.intermediate
        )
    }

    /// Model FLOPs of one target forward over one causal sequence of `tokens` on
    /// `layers` layers, as the roofline counts them: the GEMMs' 2·m·n·k and attention's
    /// 4 · keys · head dim per row and query head.
    pub fn target_flops(&self, layers: usize) -> f64 {
        let (t, h, i) = (self.tokens, self.hidden, self.intermediate);
        let (qd, kd) = (self.q_heads * self.head_dim, self.kv_heads * self.head_dim);
        let gemm = 2.0 * (t * (h * qd + 2 * h * kd + qd * h + 3 * h * i)) as f64;
        let attn = 4.0 * (t * (t + 1) / 2) as f64 * qd as f64;
        (gemm + attn) * layers as f64
    }
}

/// One role's steady throughput.
#[derive(Debug, Serialize)]
pub struct RoleRow {
    /// "target" or "drafter".
    pub role: String,
    pub shape: String,
    /// Layers measured, and those of the model the row stands for.
    pub layers: usize,
    pub model_layers: usize,
    pub tokens_per_step: usize,
    pub warmup_steps: usize,
    /// Steps timed after the warm-up (as one span: the device synchronised at its end).
    pub steps: usize,
    pub seconds_per_step: Option<f64>,
    /// Tokens a worker of this role takes in per second, as measured (`layers` layers).
    pub tokens_per_s: Option<f64>,
    /// The same for the whole model (`model_layers`): scaled by `layers / model_layers`.
    pub tokens_per_s_model: Option<f64>,
    pub model_flops_per_step: f64,
    pub tflops: Option<f64>,
    /// Measured model FLOP utilisation against the device's dense bf16 peak (None when
    /// the peak of the device is unknown, e.g. the emulated GPU).
    pub mfu: Option<f64>,
    pub note: String,
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct ThroughputFigures {
    pub preset: ThroughputShape,
    pub device: String,
    pub peak_bf16_tflops: Option<f64>,
    pub rows: Vec<RoleRow>,
    pub seconds: f64,
}

/// Time `warmup` calls of `step`, then `steps` more as one span ended by `sync`: seconds
/// per step.
fn timed(
    warmup: usize,
    steps: usize,
    mut step: impl FnMut() -> Result<(), ToolError>,
    mut sync: impl FnMut() -> Result<(), ToolError>,
) -> Result<f64, ToolError> {
    for _ in 0..warmup {
        step()?;
    }
    sync()?;
    let t0 = Instant::now();
    for _ in 0..steps {
        step()?;
    }
    sync()?;
    Ok(t0.elapsed().as_secs_f64() / steps.max(1) as f64)
}

/// Seconds per target forward as a target worker runs it: the sequence's taps (the last
/// layer's) written in bf16 and copied into pinned host memory behind an event, the next
/// forward computing meanwhile.
fn measure_target(p: &ThroughputShape) -> Result<(f64, String), ToolError> {
    let layers = p.target_layers;
    let scratch = dflash_shared::scratch::ScratchDir::new(&format!("bench-throughput-{}", p.name))
        .map_err(ToolError::io("creating a scratch directory".to_string()))?;
    let dir = scratch.path();
    crate::models::tiny::write_random(dir, &p.config_json(layers, p.target_vocab), 13).map_err(
        ToolError::io(format!("writing the {layers}-layer checkpoint")),
    )?;
    let target = Target::load(dir, &[layers - 1])?;
    drop(scratch);
    let dev = open_device()?.ok_or(ToolError::Skipped {
        because: "no device".into(),
    })?;
    let mut g = DeviceTarget::new(dev, &target, p.tokens)?;
    drop(target);
    let name = g.describe();
    let bytes = p.tokens * p.hidden * 2;
    let layout = std::alloc::Layout::from_size_align(bytes.next_multiple_of(4096), 4096)
        .map_err(|_| ToolError::HostMemory { bytes })?;
    // SAFETY: non-zero size; freed below once the device is gone.
    let pinned = unsafe { std::alloc::alloc_zeroed(layout) };
    if pinned.is_null() {
        return Err(ToolError::HostMemory { bytes });
    }
    let mut rng = Rng::new(17);
    let ids: Vec<u32> = (0..p.tokens)
        .map(|_| rng.below(p.target_vocab as u64) as u32)
        .collect();
    let result = (|| -> Result<f64, ToolError> {
        // SAFETY: the buffer outlives `g` (dropped before it is freed).
        unsafe { g.register_host(pinned, layout.size()) }?;
        let last = std::cell::Cell::new(None);
        let g = std::cell::RefCell::new(&mut g);
        timed(
            p.warmup_steps,
            p.target_steps,
            || {
                // SAFETY: `pinned` is registered, holds the sequence's taps and is only
                // read after `finish`.
                let e = unsafe { g.borrow_mut().forward_rows_into(&[(&ids[..], pinned)]) }?;
                last.set(e.or(last.get()));
                Ok(())
            },
            || match last.take() {
                Some(e) => Ok(g.borrow_mut().finish(e, pinned, bytes)?),
                None => Ok(g.borrow_mut().sync()?),
            },
        )
    })();
    drop(g);
    // SAFETY: allocated above; the device that registered it is gone.
    unsafe { std::alloc::dealloc(pinned, layout) };
    Ok((result?, name))
}

/// Seconds per drafter step as a one-rank drafter worker runs it: forward and backward,
/// the gradient copied into the reduce buffer behind the backward, scaled, clipped and
/// applied by AdamW on the device; the step's outcome read back a step later.
fn measure_drafter(p: &ThroughputShape) -> Result<(f64, String, f64, String), ToolError> {
    let cfg = TargetConfig::read(&p.config_json(p.drafter_layers, p.vocab)).map_err(|problem| {
        dflash_shared::model_config::ConfigError {
            path: format!("the config of throughput:{}", p.name),
            problem,
        }
    })?;
    let n_taps = p.drafter_layers;
    let dcfg = DrafterConfig::for_target(&cfg, p.drafter_layers, n_taps, p.block_size, p.anchors);
    let drafter = Drafter::new(dcfg.clone());
    let s = p.tokens;
    let params = drafter.init_params(3);
    let frozen = Frozen {
        embed: pattern(p.vocab * p.hidden, 31, 0.05),
        lm_head: pattern(p.vocab * p.hidden, 32, 0.05),
    };
    let taps = pattern(s * n_taps * p.hidden, 33, 1.0);
    let mut rng = Rng::new(19);
    let ids: Vec<u32> = (0..s).map(|_| rng.below(p.vocab as u64) as u32).collect();
    let mask = vec![1u8; s];
    let anchors = drafter.sample_anchors(&mask, &mut rng);
    let supervised = drafter.supervised_slots(&anchors, &mask);
    let flops = drafter_step_flops(&dcfg, s, &anchors, supervised);
    let shape = format!(
        "{} layer(s), {n_taps} tap(s), {s} context tokens, {} blocks of {}, vocabulary {}",
        dcfg.layers,
        anchors.len(),
        p.block_size,
        p.vocab
    );
    let dev = open_device()?.ok_or(ToolError::Skipped {
        because: "no device".into(),
    })?;
    let mut gd = crate::models::drafter::device::DeviceDrafter::new(dev, &drafter, &frozen, s)?;
    drop(frozen);
    let name = gd.device().describe();
    let zeros = vec![0f32; params.len()];
    gd.load(&params, &zeros, &zeros, 0)?;
    drop((params, zeros));
    let sample = [Sample {
        taps: &taps,
        ids: &ids,
        mask: &mask,
    }];
    let anchors = [anchors];
    let hyper = AdamW::new(0).hyper();
    let step_no = std::cell::Cell::new(0u64);
    let gd = std::cell::RefCell::new(gd);
    let secs = timed(
        p.warmup_steps,
        p.drafter_steps,
        || {
            let mut gd = gd.borrow_mut();
            let stats = gd.forward_backward(&sample, Rows::F32, &anchors, 1.0, GradTo::Device)?;
            let reduced = gd.reduce_alone()?;
            step_no.set(step_no.get() + 1);
            gd.update(
                &Step::new(step_no.get(), 1.0, 1e-5, &hyper),
                Gradient::Reduced {
                    weight_sum: stats.weight_sum,
                    after: Some(reduced),
                },
            )?;
            Ok(())
        },
        || {
            let mut gd = gd.borrow_mut();
            gd.drain()?;
            Ok(gd.device().sync()?)
        },
    )?;
    Ok((secs, shape, flops, name))
}

/// What a row measures, before it is measured.
struct RoleSpec<'a> {
    role: &'a str,
    shape: String,
    layers: usize,
    model_layers: usize,
    tokens: usize,
    warmup: usize,
    steps: usize,
    flops: f64,
    note: &'a str,
}

impl RoleSpec<'_> {
    /// The row of `r` (seconds per step, or why there are none) against `peak`.
    fn measured(self, peak: Option<f64>, r: Result<f64, ToolError>) -> RoleRow {
        let (secs, error) = match r {
            Ok(s) => (Some(s), None),
            Err(e) => (None, Some(e.to_string())),
        };
        let tps = secs.map(|s| self.tokens as f64 / s.max(1e-12));
        let tflops = secs.map(|s| self.flops / s.max(1e-12) / 1e12);
        RoleRow {
            role: self.role.into(),
            shape: self.shape,
            layers: self.layers,
            model_layers: self.model_layers,
            tokens_per_step: self.tokens,
            warmup_steps: self.warmup,
            steps: self.steps,
            seconds_per_step: secs,
            tokens_per_s: tps,
            tokens_per_s_model: tps.map(|t| t * self.layers as f64 / self.model_layers as f64),
            model_flops_per_step: self.flops,
            tflops,
            mfu: tflops.zip(peak).map(|(t, p)| t / p),
            note: self.note.into(),
            error,
        }
    }
}

/// The figures as one JSON object, or a line per role.
fn print_figures(f: &ThroughputFigures, json: bool) -> Result<(), ToolError> {
    if json {
        println!(
            "{}",
            serde_json::to_string(f).map_err(ToolError::json("the figures"))?
        );
    } else {
        println!(
            "bench compute throughput:{}: {} ({}), {:.1} s",
            f.preset.name,
            f.device,
            f.peak_bf16_tflops
                .map_or("peak unknown".into(), |p| format!(
                    "bf16 peak {p:.0} TFLOP/s"
                )),
            f.seconds
        );
        for r in &f.rows {
            match (&r.error, r.tokens_per_s) {
                (None, Some(t)) => println!(
                    "  {:<8} {:>12.0} tokens/s ({:.0} for {} layers), {:.2} TFLOP/s, MFU {}, {} steps after {} warm-up: {}",
                    r.role,
                    t,
                    r.tokens_per_s_model.unwrap_or(0.0),
                    r.model_layers,
                    r.tflops.unwrap_or(0.0),
                    r.mfu.map_or("-".into(), |m| format!("{:.1} %", 100.0 * m)),
                    r.steps,
                    r.warmup_steps,
                    r.shape
                ),
                (e, _) => println!("  {:<8} FAILED: {}", r.role, e.as_deref().unwrap_or("?")),
            }
        }
    }
    Ok(())
}

pub fn run(preset_name: &str, json: bool) -> Result<(), ToolError> {
    let p = preset(preset_name).ok_or_else(|| ToolError::Usage {
        flag: "--target",
        value: format!("throughput:{preset_name}"),
        expected: "unknown preset (throughput:qwen3-8b, throughput:tiny)".into(),
    })?;
    let t0 = Instant::now();
    if open_device()?.is_none() {
        return Err(ToolError::Device(GpuError::Unavailable(format!(
            "throughput:{preset_name} measures on a GPU, and none can be used here: {}",
            crate::device::cuda::missing_library().unwrap_or_default()
        ))));
    }
    let target = measure_target(&p);
    let mut device = target.as_ref().map(|t| t.1.clone()).ok();
    let target_shape = format!(
        "{} of {} layer(s) at hidden {}, {} query and {} KV heads of {}, MLP {}; one causal sequence of {} tokens",
        p.target_layers, p.model_layers, p.hidden, p.q_heads, p.kv_heads, p.head_dim, p.intermediate, p.tokens
    );
    let drafter = measure_drafter(&p);
    if let Ok(d) = &drafter {
        device.get_or_insert_with(|| d.3.clone());
    }
    let device = device.unwrap_or_else(|| "the device (not measured)".into());
    let peak = peak_bf16_tflops(&device);
    let (d_secs, d_shape, d_flops) = match drafter {
        Ok((s, shape, f, _)) => (Ok(s), shape, f),
        Err(e) => (Err(e), String::new(), 0.0),
    };
    let rows = vec![
        RoleSpec {
            role: "target",
            shape: target_shape,
            layers: p.target_layers,
            model_layers: p.model_layers,
            tokens: p.tokens,
            warmup: p.warmup_steps,
            steps: p.target_steps,
            flops: p.target_flops(p.target_layers),
            note: "forward over random weights, the last layer's taps copied to pinned memory behind each forward; no lm_head (a target worker has none)",
        }
        .measured(peak, target.map(|t| t.0)),
        RoleSpec {
            role: "drafter",
            shape: d_shape,
            layers: p.drafter_layers,
            model_layers: p.drafter_layers,
            tokens: p.tokens,
            warmup: p.warmup_steps,
            steps: p.drafter_steps,
            flops: d_flops,
            note: "a one-rank step: forward and backward, the gradient's reduction copy, AdamW (model FLOPs: drafter_step_flops)",
        }
        .measured(peak, d_secs),
    ];
    let f = ThroughputFigures {
        preset: p,
        device,
        peak_bf16_tflops: peak,
        rows,
        seconds: t0.elapsed().as_secs_f64(),
    };
    print_figures(&f, json)?;
    let failed = f.rows.iter().filter(|r| r.error.is_some()).count();
    if failed > 0 {
        return Err(ToolError::OpsFailed {
            failed,
            of: f.rows.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_qwen3_8b_preset_has_the_roofline_shapes_and_enough_steps() {
        let p = preset("qwen3-8b").unwrap();
        let r = crate::tools::kernel_bench::roofline::qwen3_8b();
        assert_eq!(
            (p.hidden, p.q_heads, p.kv_heads, p.head_dim, p.intermediate),
            (
                r.hidden as usize,
                r.q_heads as usize,
                r.kv_heads as usize,
                r.head_dim as usize,
                r.intermediate as usize
            )
        );
        assert_eq!(
            (p.vocab, p.model_layers, p.drafter_layers),
            (
                r.vocab as usize,
                r.layers as usize,
                r.drafter_layers as usize
            )
        );
        assert_eq!(
            (p.anchors, p.block_size, p.tokens),
            (r.anchors, r.block, r.drafter_context)
        );
        for p in [p, preset("tiny").unwrap()] {
            assert!(p.target_steps >= 20 && p.drafter_steps >= 20, "{p:?}");
            assert!(p.warmup_steps >= 1, "{p:?}");
        }
        assert!(preset("qwen3-9b").is_none());
    }

    #[test]
    fn target_flops_count_the_gemms_and_the_causal_pairs() {
        let p = preset("tiny").unwrap();
        // hidden 128, q 1×128, kv 128, MLP 256, 16 tokens.
        let gemm = 2.0
            * 16.0
            * (128.0 * 128.0 + 2.0 * 128.0 * 128.0 + 128.0 * 128.0 + 3.0 * 128.0 * 256.0);
        let attn = 4.0 * (16.0 * 17.0 / 2.0) * 128.0;
        assert_eq!(p.target_flops(1), gemm + attn);
        assert_eq!(p.target_flops(3), 3.0 * (gemm + attn));
    }

    fn spec(layers: usize, model_layers: usize, tokens: usize, flops: f64) -> RoleSpec<'static> {
        RoleSpec {
            role: "target",
            shape: "s".into(),
            layers,
            model_layers,
            tokens,
            warmup: 3,
            steps: 20,
            flops,
            note: "",
        }
    }

    #[test]
    fn a_row_scales_tokens_to_the_whole_model_and_has_no_mfu_without_a_peak() {
        let r = spec(2, 36, 4096, 1e12).measured(Some(1000.0), Ok(0.01));
        assert!((r.tokens_per_s.unwrap() - 409_600.0).abs() < 1e-6);
        assert!((r.tokens_per_s_model.unwrap() - 409_600.0 * 2.0 / 36.0).abs() < 1e-6);
        assert!((r.tflops.unwrap() - 100.0).abs() < 1e-9);
        assert!((r.mfu.unwrap() - 0.1).abs() < 1e-12);
        let e = spec(5, 5, 4096, 1e12).measured(
            Some(1000.0),
            Err(ToolError::Skipped {
                because: "x".into(),
            }),
        );
        assert!(e.error.is_some() && e.tokens_per_s.is_none() && e.mfu.is_none());
        let n = spec(5, 5, 8, 1e9).measured(None, Ok(0.5));
        assert_eq!((n.tokens_per_s, n.mfu), (Some(16.0), None));
    }
}
