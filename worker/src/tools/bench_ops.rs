//! `dflash-worker bench-ops`: what `dflash-supervise bench compute` measures, in this one
//! process. The target forward over one sequence, per op and as a whole, as tokens/s and
//! GFLOP/s; a bare GEMM over exactly the forward's matrix shapes, as the baseline the
//! forward's rate is compared with (the GEMMs are most of its FLOPs); and one drafter
//! training step on the same shapes. `--target ops:qwen3-8b` (or `ops:tiny`) measures
//! single ops on the device instead, at a model's real shapes: attention forward and
//! backward (causal and DFlash blocks), the target's GEMMs, the chunked cross-entropy, a
//! shallow target forward and a drafter step, each with TFLOP/s and its share of the bf16
//! peak ([`run_ops`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use dflash_shared::drafter::DrafterConfig;
use dflash_shared::model_config::TargetConfig;
use dflash_shared::rng::Rng;
use serde::Serialize;

use crate::device::ops::gemm::Dx;
use crate::device::ops::{Attention, AttentionGrad, Mat};
use crate::device::{DSlice, GpuError};
use crate::error::ToolError;
use crate::models::drafter::device::{GradTo, Gradient, Rows, Step};
use crate::models::drafter::{Drafter, Frozen, Sample};
use crate::models::target::Target;
use crate::models::weights::Weights;

#[derive(Debug, Serialize)]
pub struct Figures {
    pub backend: String,
    pub threads: usize,
    pub shape: String,
    pub tokens: usize,
    /// The target forward as a CPU target worker runs it (the device target on the CPU
    /// device).
    pub target_forward_s: f64,
    pub target_tokens_per_s: f64,
    pub target_gflops: f64,
    /// Bare GEMMs of the forward's shapes, back to back.
    pub gemm_gflops: f64,
    /// `target_gflops / gemm_gflops` (goal ≥ 0.7).
    pub forward_vs_gemm: f64,
    /// Seconds per op over one forward (the CPU device's kernels and GEMMs).
    pub op_seconds: BTreeMap<String, f64>,
    pub drafter_step_s: f64,
    pub drafter_tokens_per_s: f64,
    pub drafter_layers: usize,
    pub drafter_rows: usize,
    /// Seconds per kernel (and "gemm") of that step on the CPU device.
    pub drafter_op_seconds: BTreeMap<String, f64>,
    /// The shared-memory all-reduce (CPU workers' collective) of that drafter's gradient
    /// between two ranks over one pool, ms, and the gradient bytes it reads per second.
    pub shm_all_reduce_ms: f64,
    pub shm_all_reduce_gb_s: f64,
    /// The same target forward on a device, when there is one.
    pub device: Option<DeviceFigures>,
    /// Why there are no device figures.
    pub device_note: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct DeviceFigures {
    pub name: String,
    pub target_forward_s: f64,
    pub target_tokens_per_s: f64,
    pub target_tflops: f64,
    /// Dense bf16 peak of the device, TFLOP/s, when known (see `peak_bf16_tflops`).
    pub peak_bf16_tflops: Option<f64>,
    /// Model FLOP utilisation against that peak.
    pub mfu: Option<f64>,
    /// Device forward tokens/s over the CPU backend's, same shape, same run.
    pub vs_cpu: f64,
    /// One drafter training step (forward and backward) on the device, same batch as the
    /// CPU's, and its model FLOP utilisation.
    pub drafter_step_s: f64,
    pub drafter_tflops: f64,
    pub drafter_mfu: Option<f64>,
    /// The device optimizer over the drafter's parameters (norm, clip, AdamW), ms.
    pub optimizer_ms: f64,
    /// Device→host copies of `copy_bytes` into a shared-memory mapping pinned as the pools'
    /// slots are, and into a plain pinned buffer, GB/s; their ratio (goal ≥ 0.8).
    pub copy_bytes: usize,
    pub slot_copy_gb_s: f64,
    pub pinned_copy_gb_s: f64,
    pub slot_vs_pinned: f64,
    /// The drafter's gradient reduction on the device, bucket by bucket on the copy
    /// stream: which collective ("NCCL, 1 rank", or "device copy, 1 rank, no NCCL" where NCCL
    /// is not there), its time alone (ms), the step with it overlapped (s), and the share
    /// of the reduction hidden behind the backward: (step + reduction − both) / reduction.
    pub all_reduce: String,
    pub all_reduce_ms: f64,
    pub step_with_all_reduce_s: f64,
    pub all_reduce_overlap: f64,
}

/// Dense (no sparsity) bf16 tensor-core peak by device name, TFLOP/s, from NVIDIA's data
/// sheets: A100 SXM 312; H100 SXM and H200 989.4 (same GH100 compute); H100 PCIe 756;
/// B200 2250 (dense, half of the 4.5 PF sparse figure); L40S 362.
pub fn peak_bf16_tflops(name: &str) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    let table: [(&str, f64); 6] = [
        ("H100 PCIE", 756.0),
        ("H100", 989.4),
        ("H200", 989.4),
        ("A100", 312.0),
        ("B200", 2250.0),
        ("L40S", 362.0),
    ];
    table.iter().find(|(k, _)| n.contains(k)).map(|(_, v)| *v)
}

/// The GPU, if CUDA is there (a real driver, or the tests' emulated one).
pub(crate) fn open_device() -> Result<Option<Box<dyn crate::device::Device>>, ToolError> {
    if crate::device::cuda::missing_library().is_some() {
        return Ok(None);
    }
    Ok(Some(Box::new(crate::device::cuda::CudaDevice::open()?)))
}

/// What the device part measures besides the target: the drafter step of the CPU
/// measurement, on the device.
struct DrafterCase<'a> {
    drafter: &'a Drafter,
    frozen: &'a Frozen,
    params: &'a [f32],
    sample: Sample<'a>,
    anchors: &'a [usize],
    flops: f64,
}

fn measure_device(
    target: &Target,
    ids: &[u32],
    flops: f64,
    cpu_tokens_per_s: f64,
    dc: &DrafterCase,
) -> Result<Option<DeviceFigures>, ToolError> {
    let Some(dev) = open_device()? else {
        return Ok(None);
    };
    let mut g = crate::models::target::device::DeviceTarget::new(dev, target, ids.len())?;
    g.forward_taps(&ids[..ids.len().min(64)])?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = Instant::now();
        // forward_taps ends with a synchronous download: the time covers the device's work.
        std::hint::black_box(g.forward_taps(ids)?);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    let name = g.describe();
    drop(g);
    let tflops = flops / best / 1e12;
    let peak = peak_bf16_tflops(&name);
    let tokens_per_s = ids.len() as f64 / best;

    // The drafter step and the optimizer, on a device of their own (as a drafter worker has).
    let dev = open_device()?.ok_or(ToolError::Device(GpuError::Unavailable(
        "the device went away".into(),
    )))?;
    let mut gd = crate::models::drafter::device::DeviceDrafter::new(
        dev,
        dc.drafter,
        dc.frozen,
        dc.sample.ids.len(),
    )?;
    let n = dc.params.len();
    let zeros = vec![0f32; n];
    gd.load(dc.params, &zeros, &zeros, 0)?;
    let mut grads = vec![0f32; n];
    let (samples, anchors) = (std::slice::from_ref(&dc.sample), vec![dc.anchors.to_vec()]);
    let mut drafter_best = f64::INFINITY;
    let mut opt_best = f64::INFINITY;
    let hyper = crate::models::drafter::AdamW::new(0).hyper();
    for step in 1..=3 {
        let t0 = Instant::now();
        // train_batch ends with the gradient's synchronous download.
        gd.forward_backward(samples, Rows::F32, &anchors, 1.0, GradTo::Host(&mut grads))?;
        drafter_best = drafter_best.min(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        gd.update(&Step::new(step, 1.0, 1e-4, &hyper), Gradient::Host(&grads))?;
        gd.drain()?;
        opt_best = opt_best.min(t0.elapsed().as_secs_f64());
    }
    let (all_reduce, all_reduce_ms, step_with_all_reduce_s, all_reduce_overlap) =
        measure_reduction(&mut gd, dc)?;
    drop(gd);
    let drafter_tflops = dc.flops / drafter_best / 1e12;

    let dev = open_device()?.ok_or(ToolError::Device(GpuError::Unavailable(
        "the device went away".into(),
    )))?;
    let (copy_bytes, slot, pinned) = measure_copies(dev)?;
    Ok(Some(DeviceFigures {
        name,
        target_forward_s: best,
        target_tokens_per_s: tokens_per_s,
        target_tflops: tflops,
        peak_bf16_tflops: peak,
        mfu: peak.map(|p| tflops / p),
        vs_cpu: tokens_per_s / cpu_tokens_per_s,
        drafter_step_s: drafter_best,
        drafter_tflops,
        drafter_mfu: peak.map(|p| drafter_tflops / p),
        optimizer_ms: opt_best * 1e3,
        copy_bytes,
        slot_copy_gb_s: slot,
        pinned_copy_gb_s: pinned,
        slot_vs_pinned: slot / pinned,
        all_reduce,
        all_reduce_ms,
        step_with_all_reduce_s,
        all_reduce_overlap,
    }))
}

/// The drafter step with its gradient reduction (NCCL with one rank where NCCL loads, the
/// one-rank device copy elsewhere): (collective, reduction alone in ms, the step with the
/// reduction overlapped in s, the overlap share). Best of three each.
fn measure_reduction(
    gd: &mut crate::models::drafter::device::DeviceDrafter,
    dc: &DrafterCase,
) -> Result<(String, f64, f64, f64), ToolError> {
    use crate::collective::{local::LocalCollective, nccl::NcclCollective, Collective, Formed};
    let mut coll: Box<dyn Collective> = match NcclCollective::new(0, gd) {
        Ok(c) => Box::new(c),
        Err(_) => Box::new(LocalCollective::new(0)),
    };
    let name = match coll.kind() {
        dflash_shared::drafter::CollectiveKind::Nccl => "NCCL, 1 rank",
        _ => "device copy, 1 rank, no NCCL",
    };
    if let Formed::Created(id) = coll.form(1, &[0], None).map_err(ToolError::from)? {
        coll.form(1, &[0], Some(&id)).map_err(ToolError::from)?;
    }
    let (samples, anchors) = (std::slice::from_ref(&dc.sample), vec![dc.anchors.to_vec()]);
    let sync = |gd: &mut crate::models::drafter::device::DeviceDrafter| {
        gd.device().sync().map_err(ToolError::from)
    };
    let reduce = |coll: &mut Box<dyn Collective>,
                  gd: &mut crate::models::drafter::device::DeviceDrafter,
                  step: u64|
     -> Result<(), ToolError> {
        coll.contribute(step, 1.0, gd).map_err(ToolError::from)?;
        while coll.poll(gd).map_err(ToolError::from)?.is_none() {
            std::thread::yield_now();
        }
        sync(gd)
    };
    let (mut step_s, mut red_s, mut both_s) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for step in 1..=3u64 {
        let t0 = Instant::now();
        gd.forward_backward(samples, Rows::F32, &anchors, 1.0, GradTo::Device)?;
        sync(gd)?;
        step_s = step_s.min(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        reduce(&mut coll, gd, step)?;
        red_s = red_s.min(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        gd.forward_backward(samples, Rows::F32, &anchors, 1.0, GradTo::Device)?;
        reduce(&mut coll, gd, step)?;
        both_s = both_s.min(t0.elapsed().as_secs_f64());
    }
    let overlap = ((step_s + red_s - both_s) / red_s.max(1e-12)).clamp(0.0, 1.0);
    Ok((name.to_string(), red_s * 1e3, both_s, overlap))
}

/// The shared-memory all-reduce of `n` f32 between two ranks over one pool (as two CPU
/// drafter workers run it): best of three, ms, and gradient GB/s read.
fn measure_shm_all_reduce(n: usize) -> Result<(f64, f64), ToolError> {
    use crate::collective::{shm::ShmCollective, Collective};
    use dflash_shared::pool::{PoolGeometry, PoolMap};
    use std::os::fd::AsRawFd;
    let g = PoolGeometry {
        name: "grads".into(),
        slots: 4,
        slot_bytes: dflash_shared::drafter::GRAD_SLOT_HEADER + n as u64 * 4,
    };
    let (fd, _map) = PoolMap::create(g.clone()).map_err(ToolError::io("creating a pool"))?;
    let mut ranks: Vec<ShmCollective> = (0..2)
        .map(|r| {
            ShmCollective::new(
                PoolMap::open(fd.as_raw_fd(), g.clone())
                    .map_err(ToolError::io("mapping a pool"))?,
                r,
                n,
            )
            .map_err(ToolError::from)
        })
        .collect::<Result<_, _>>()?;
    for r in ranks.iter_mut() {
        r.form(1, &[0, 1], None).map_err(ToolError::from)?;
    }
    let grad: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 1e-3).collect();
    let mut best = f64::INFINITY;
    for step in 1..=3u64 {
        let t0 = Instant::now();
        for r in ranks.iter_mut() {
            r.contribute_host(step, 1.0, &grad)
                .map_err(ToolError::from)?;
        }
        let mut done = [false; 2];
        while !done.iter().all(|d| *d) {
            for (i, r) in ranks.iter_mut().enumerate() {
                done[i] |= r.progress().map_err(ToolError::from)?.is_some();
            }
        }
        best = best.min(t0.elapsed().as_secs_f64());
        for r in ranks.iter_mut() {
            r.take_sum(step, 2.0).map_err(ToolError::from)?;
        }
    }
    // Each rank writes its gradient and reads both.
    Ok((best * 1e3, (6 * n * 4) as f64 / best / 1e9))
}

/// Device→host copy rate into a shared-memory mapping (a memfd mapped shared, as the
/// pools are) pinned with `register_host`, against a plain page-aligned heap buffer
/// pinned the same way: best of five copies of 64 MiB each (4 MiB on the host device).
fn measure_copies(mut dev: Box<dyn crate::device::Device>) -> Result<(usize, f64, f64), ToolError> {
    use crate::device::{DSlice, Stream};
    let bytes: usize = if dev.describe().starts_with("host device") {
        4 << 20
    } else {
        64 << 20
    };
    let src = DSlice {
        ptr: dev.alloc(bytes)?,
        bytes,
    };
    // A hidden-state pool of one slot, mapped as a worker maps it (header read-only,
    // slots read-write), pinned as a target pins its output pool.
    use std::os::fd::AsRawFd;
    let geometry = dflash_shared::pool::PoolGeometry {
        name: "bench".into(),
        slots: 1,
        slot_bytes: bytes as u64,
    };
    let (fd, _owner) = dflash_shared::pool::PoolMap::create(geometry.clone())
        .map_err(ToolError::io("creating a pool"))?;
    let pool = dflash_shared::pool::PoolMap::open(fd.as_raw_fd(), geometry)
        .map_err(ToolError::io("mapping the pool"))?;
    let (slots_ptr, slots_len) = pool.slots_mapping();
    let slot = slots_ptr;
    let layout = std::alloc::Layout::from_size_align(bytes, 4096)
        .map_err(|_| ToolError::HostMemory { bytes })?;
    // SAFETY: non-zero size; freed below after the device is gone.
    let plain = unsafe { std::alloc::alloc_zeroed(layout) };
    if plain.is_null() {
        return Err(ToolError::HostMemory { bytes });
    }
    let time = |dev: &mut Box<dyn crate::device::Device>, dst: *mut u8| -> Result<f64, ToolError> {
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t0 = Instant::now();
            // SAFETY: dst is registered, `bytes` long, and not touched until the event.
            unsafe { dev.download_async(Stream::Copy, src, dst) }?;
            let e = dev.record(Stream::Copy)?;
            dev.sync_event(e)?;
            dev.release_event(e);
            best = best.min(t0.elapsed().as_secs_f64());
        }
        dev.host_access(dst, bytes, false)?;
        Ok(bytes as f64 / best / 1e9)
    };
    let result = (|| {
        // SAFETY: both ranges stay mapped until after the device is dropped.
        unsafe { dev.register_host(slots_ptr, slots_len) }?;
        unsafe { dev.register_host(plain, bytes) }?;
        let (mut s, mut p) = (0f64, 0f64);
        // Alternate, so that neither gets the warmer caches or clocks.
        for _ in 0..2 {
            s = s.max(time(&mut dev, slot)?);
            p = p.max(time(&mut dev, plain)?);
        }
        Ok::<_, ToolError>((bytes, s, p))
    })();
    drop(dev);
    drop(pool);
    // SAFETY: allocated above; the device that pinned it is gone.
    unsafe { std::alloc::dealloc(plain, layout) };
    result
}

/// Model FLOPs of one drafter step on one sample of `t` positions with `anchors`: the
/// forward's GEMMs and attention, and the backward's (twice the forward's, except that
/// `fc` needs no input gradient and the frozen lm_head no weight gradient). The logits
/// the loss recomputes in its backward are not counted (model FLOPs, not hardware).
pub fn drafter_step_flops(
    c: &DrafterConfig,
    t: usize,
    anchors: &[usize],
    supervised_rows: usize,
) -> f64 {
    let (h, qd, kd, inter) = (
        c.hidden as f64,
        (c.q_heads * c.head_dim) as f64,
        (c.kv_heads * c.head_dim) as f64,
        c.intermediate as f64,
    );
    let (t, m) = (t as f64, (anchors.len() * c.block_size) as f64);
    let fc = 2.0 * t * (c.n_taps as f64 * h) * h * 2.0;
    let layer_gemm =
        2.0 * (m * h * qd + 2.0 * (t + m) * h * kd + m * qd * h + 3.0 * m * h * inter) * 3.0;
    // Each block row sees the context before its anchor and its own block.
    let keys: f64 = anchors
        .iter()
        .map(|&a| (a + c.block_size) as f64 * c.block_size as f64)
        .sum();
    let attn = 2.0 * 2.0 * keys * qd * 3.0;
    let lm_head = 2.0 * supervised_rows as f64 * h * c.vocab as f64 * 2.0;
    fc + c.layers as f64 * (layer_gemm + attn) + lm_head
}

/// A built-in shape `qwen3:HIDDENxLAYERS` (heads of 64, a quarter as many KV heads, MLP
/// 3× hidden, vocabulary 8192), written as a random checkpoint into `dir`.
pub fn shape_config(spec: &str) -> Result<String, ToolError> {
    let err = || ToolError::Usage {
        flag: "--target",
        value: spec.to_string(),
        expected: "expected a model directory or a shape like qwen3:768x5".into(),
    };
    let rest = spec.strip_prefix("qwen3:").ok_or_else(err)?;
    let (h, l) = rest.split_once('x').ok_or_else(err)?;
    let (h, l): (usize, usize) = (h.parse().map_err(|_| err())?, l.parse().map_err(|_| err())?);
    if h == 0 || h % 64 != 0 || l == 0 {
        return Err(ToolError::Usage {
            flag: "--target",
            value: spec.to_string(),
            expected: "hidden must be a positive multiple of 64 and layers positive".into(),
        });
    }
    let heads = h / 64;
    let kv = (heads / 4).max(1);
    let kv = if heads % kv == 0 { kv } else { 1 };
    Ok(format!(
        r#"{{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":{h},"num_hidden_layers":{l},
        "num_attention_heads":{heads},"num_key_value_heads":{kv},"head_dim":64,"intermediate_size":{},"rms_norm_eps":1e-6,
        "rope_theta":1000000.0,"vocab_size":8192,"tie_word_embeddings":true}}"#,
        3 * h
    ))
}

pub fn run(target: &str, tokens: usize, json: bool) -> Result<(), ToolError> {
    if let Some(preset) = target.strip_prefix("ops:") {
        return run_ops(preset, json);
    }
    // A shape's random checkpoint lives in a scratch directory of ours, removed with it.
    let mut scratch = None;
    let (dir, shape): (PathBuf, String) = if Path::new(target).is_dir() {
        (PathBuf::from(target), target.to_string())
    } else {
        let cfg = shape_config(target)?;
        let s = scratch.insert(
            dflash_shared::scratch::ScratchDir::new("bench-ops")
                .map_err(ToolError::io("creating a scratch directory".to_string()))?,
        );
        crate::models::tiny::write_random(s.path(), &cfg, 7)
            .map_err(ToolError::io(format!("writing the {target} checkpoint")))?;
        (s.path().to_path_buf(), target.to_string())
    };
    let result = measure(&dir, &shape, tokens);
    drop(scratch);
    let f = result?;
    if json {
        println!(
            "{}",
            serde_json::to_string(&f).map_err(ToolError::json("the figures"))?
        );
    } else {
        print_figures(&f);
    }
    Ok(())
}

pub fn print_figures(f: &Figures) {
    println!(
        "bench compute: backend {} ({} threads), target {}, {} tokens",
        f.backend, f.threads, f.shape, f.tokens
    );
    match (&f.device, &f.device_note) {
        (Some(d), _) => {
            let mfu = d
                .mfu
                .map_or("MFU: peak unknown for this device".to_string(), |m| {
                    format!(
                        "{:.1} % MFU of {:.0} TFLOP/s bf16",
                        m * 100.0,
                        d.peak_bf16_tflops.unwrap_or(0.0)
                    )
                });
            println!("  device {}: target forward {:.0} tokens/s, {:.2} TFLOP/s, {mfu}; {:.1}x the CPU backend", d.name, d.target_tokens_per_s, d.target_tflops, d.vs_cpu);
            let dmfu = d.drafter_mfu.map_or(String::new(), |m| {
                format!(", {:.1} % MFU (goal >= 35 %)", m * 100.0)
            });
            println!(
                "    drafter step {:.3} s, {:.2} TFLOP/s{dmfu}; optimizer {:.2} ms",
                d.drafter_step_s, d.drafter_tflops, d.optimizer_ms
            );
            println!(
                "    copy {} MiB device->host: pinned slot {:.2} GB/s, plain pinned buffer {:.2} GB/s, ratio {:.2} (goal >= 0.8)",
                d.copy_bytes >> 20,
                d.slot_copy_gb_s,
                d.pinned_copy_gb_s,
                d.slot_vs_pinned
            );
            println!(
                "    gradient reduction ({}): {:.2} ms alone; step with it {:.3} s; {:.0} % of it hidden behind the backward",
                d.all_reduce,
                d.all_reduce_ms,
                d.step_with_all_reduce_s,
                d.all_reduce_overlap * 100.0
            );
        }
        (None, note) => println!(
            "  no GPU measured ({}): the figures below are the CPU backend's",
            note.as_deref().unwrap_or("none")
        ),
    }
    println!(
        "  target forward (CPU worker) {:>7.0} tokens/s  {:>7.2} GFLOP/s  ({:.3} s)",
        f.target_tokens_per_s, f.target_gflops, f.target_forward_s
    );
    println!(
        "  bare GEMM, same shapes    {:>27.2} GFLOP/s",
        f.gemm_gflops
    );
    println!(
        "  forward / GEMM            {:>9.2}   (goal >= 0.7)",
        f.forward_vs_gemm
    );
    for (op, s) in &f.op_seconds {
        println!(
            "    {op:<12} {:>8.1} ms  {:>5.1} %",
            s * 1e3,
            100.0 * s / f.target_forward_s.max(1e-12)
        );
    }
    println!(
        "  drafter step ({} layers, {} block rows)  {:>9.0} tokens/s  ({:.3} s)",
        f.drafter_layers, f.drafter_rows, f.drafter_tokens_per_s, f.drafter_step_s
    );
    let mut ops: Vec<_> = f.drafter_op_seconds.iter().collect();
    ops.sort_by(|a, b| b.1.total_cmp(a.1));
    for (op, s) in ops.into_iter().take(6) {
        println!(
            "    {op:<16} {:>8.1} ms  {:>5.1} %",
            s * 1e3,
            100.0 * s / f.drafter_step_s.max(1e-12)
        );
    }
    println!(
        "  shared-memory all-reduce of its gradient, 2 ranks  {:>7.2} ms  ({:.2} GB/s)",
        f.shm_all_reduce_ms, f.shm_all_reduce_gb_s
    );
}

/// `y[m,n] = x[m,k] · w[n,k]ᵀ` through the `gemm` crate, on `threads` threads for a
/// large product (the bare-GEMM baseline of the forward).
fn bare_matmul(threads: usize, x: &[f32], w: &[f32], y: &mut [f32], m: usize, k: usize, n: usize) {
    assert_eq!((x.len(), w.len(), y.len()), (m * k, n * k, m * n));
    let par = if threads > 1 && m * n * k >= (1 << 22) {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the strides address exactly the three slices, whose lengths are checked.
    unsafe {
        crate::math::sgemm(
            par,
            m,
            n,
            k,
            y.as_mut_ptr(),
            n,
            1,
            false,
            x.as_ptr(),
            k,
            1,
            w.as_ptr(),
            1,
            k as isize,
        )
    };
}

/// The best of three runs of the GEMMs `gemms` (`(k, n)`, m = `t`), `layers` times each,
/// bare on random operands: seconds.
fn time_bare_gemms(
    gemms: &[(usize, usize)],
    t: usize,
    layers: usize,
    threads: usize,
    rng: &mut Rng,
) -> f64 {
    let mut operands = Vec::new();
    for &(k, n) in gemms {
        let x: Vec<f32> = (0..t * k)
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect();
        operands.push((x, w, vec![0f32; t * n], k, n));
    }
    let mut gemm_best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = Instant::now();
        for _ in 0..layers {
            for (x, w, y, k, n) in operands.iter_mut() {
                bare_matmul(threads, x, w, y, t, *k, *n);
            }
        }
        gemm_best = gemm_best.min(t0.elapsed().as_secs_f64());
    }
    gemm_best
}

/// The forward as a CPU target worker runs it (the device target on the CPU device), best
/// of three: seconds, seconds per op (its kernels and GEMMs, timed by the device) and the
/// taps.
fn time_cpu_forward(target: &Target, ids: &[u32]) -> Result<CpuForward, ToolError> {
    let tokens = ids.len();
    let mut worker = crate::models::target::device::DeviceTarget::new(
        Box::new(crate::device::cpu::CpuDevice::new()),
        target,
        tokens,
    )?;
    worker.forward_taps(&ids[..tokens.min(64)])?;
    let mut worker_best = f64::INFINITY;
    let mut worker_ops = Vec::new();
    let mut target_taps = Vec::new();
    for _ in 0..3 {
        worker.take_kernel_seconds();
        let t0 = Instant::now();
        let taps = std::hint::black_box(worker.forward_taps(ids)?);
        let s = t0.elapsed().as_secs_f64();
        target_taps = taps;
        if s < worker_best {
            worker_best = s;
            worker_ops = worker.take_kernel_seconds();
        }
    }
    drop(worker);
    // Kernel names as op names.
    let mut op_seconds = BTreeMap::new();
    for (k, v) in worker_ops {
        let op = match k.as_str() {
            "gemm" => "matmul",
            n if n.starts_with("attention_fwd") || n.starts_with("attention_fa2_fwd") => {
                "attention"
            }
            "rmsnorm_fwd" => "rmsnorm",
            "swiglu_fwd" => "swiglu",
            "add_inplace" => "residual",
            "embed_gather" => "embed",
            "copy_cols" => "taps",
            other => other,
        };
        *op_seconds.entry(op.to_string()).or_insert(0.0) += v;
    }

    Ok(CpuForward {
        seconds: worker_best,
        op_seconds,
        taps: target_taps,
    })
}

/// What [`time_cpu_forward`] measures.
struct CpuForward {
    seconds: f64,
    op_seconds: BTreeMap<String, f64>,
    taps: Vec<f32>,
}

/// One drafter step as a CPU drafter worker runs it (the device model on the CPU device),
/// best of two: seconds and seconds per kernel.
fn time_cpu_drafter_step(
    drafter: &Drafter,
    frozen: &Frozen,
    p: &[f32],
    sample: &Sample,
    anchors: &[usize],
) -> Result<(f64, BTreeMap<String, f64>), ToolError> {
    let tokens = sample.ids.len();
    let mut cpu_model = crate::models::drafter::device::DeviceDrafter::new(
        Box::new(crate::device::cpu::CpuDevice::new()),
        drafter,
        frozen,
        tokens,
    )?;
    let zeros = vec![0f32; p.len()];
    cpu_model.load(p, &zeros, &zeros, 0)?;
    let mut grads = vec![0f32; p.len()];
    let mut drafter_s = f64::INFINITY;
    let mut drafter_op_seconds = BTreeMap::new();
    for _ in 0..2 {
        cpu_model.take_kernel_seconds();
        let t0 = Instant::now();
        cpu_model.forward_backward(
            std::slice::from_ref(sample),
            Rows::F32,
            &[anchors.to_vec()],
            1.0,
            GradTo::Host(&mut grads),
        )?;
        let s = t0.elapsed().as_secs_f64();
        if s < drafter_s {
            drafter_s = s;
            drafter_op_seconds = cpu_model.take_kernel_seconds().into_iter().collect();
        }
    }
    drop(cpu_model);
    Ok((drafter_s, drafter_op_seconds))
}

/// The device's figures, or why there are none.
fn device_or_why(
    r: Result<Option<DeviceFigures>, ToolError>,
) -> (Option<DeviceFigures>, Option<String>) {
    match r {
        Ok(Some(d)) => (Some(d), None),
        Ok(None) => (
            None,
            Some(crate::device::cuda::missing_library().unwrap_or_default()),
        ),
        Err(e) => (None, Some(format!("the device could not be measured: {e}"))),
    }
}

fn measure(dir: &Path, shape: &str, tokens: usize) -> Result<Figures, ToolError> {
    let cfg = TargetConfig::load(dir)?;
    let layers = cfg.num_hidden_layers;
    let target = Target::load(dir, &[layers - 1])?;
    let mut rng = Rng::new(1);
    let ids: Vec<u32> = (0..tokens)
        .map(|_| rng.below(cfg.vocab_size as u64) as u32)
        .collect();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);

    let (t, h, hd, inter) = (tokens, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (qd, kd) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    // The forward's GEMMs (m = tokens): q, k, v, o, gate, up, down.
    let gemms = [
        (h, qd),
        (h, kd),
        (h, kd),
        (qd, h),
        (h, inter),
        (h, inter),
        (inter, h),
    ];
    let gemm_flops: f64 = gemms
        .iter()
        .map(|&(k, n)| 2.0 * (t * k * n) as f64)
        .sum::<f64>()
        * layers as f64;
    // Causal attention: QKᵀ and PV over t(t+1)/2 pairs per head.
    let attn_flops = 2.0 * 2.0 * (t * (t + 1) / 2) as f64 * qd as f64 * layers as f64;
    let model_flops = gemm_flops + attn_flops;

    // The baseline: the same GEMMs, bare, on random operands.
    let gemm_best = time_bare_gemms(&gemms, t, layers, threads, &mut rng);
    let gemm_gflops = gemm_flops / gemm_best / 1e9;

    let CpuForward {
        seconds: worker_best,
        op_seconds,
        taps: target_taps,
    } = time_cpu_forward(&target, &ids)?;
    let target_gflops = model_flops / worker_best / 1e9;

    // One drafter step (2 layers, blocks of 16, up to 64 anchors) on the target's taps.
    let dcfg = DrafterConfig::for_target(&cfg, 2, 1, 16, 64);
    let drafter = Drafter::new(dcfg.clone());
    let p = drafter.init_params(3);
    let w = Weights::open(dir)?;
    let frozen = Frozen::load(&w, cfg.vocab_size, h)?;
    let taps = target_taps;
    let mask = vec![1u8; tokens];
    let anchors = drafter.sample_anchors(&mask, &mut rng);
    let sample = Sample {
        taps: &taps,
        ids: &ids,
        mask: &mask,
    };
    let (drafter_s, drafter_op_seconds) =
        time_cpu_drafter_step(&drafter, &frozen, &p, &sample, &anchors)?;
    let (shm_all_reduce_ms, shm_all_reduce_gb_s) = measure_shm_all_reduce(p.len())?;

    let supervised = drafter.supervised_slots(&anchors, &mask);
    let dc = DrafterCase {
        drafter: &drafter,
        frozen: &frozen,
        params: &p,
        sample,
        anchors: &anchors,
        flops: drafter_step_flops(&dcfg, tokens, &anchors, supervised),
    };
    let (device, device_note) = device_or_why(measure_device(
        &target,
        &ids,
        model_flops,
        tokens as f64 / worker_best,
        &dc,
    ));
    Ok(Figures {
        device,
        device_note,
        backend: "cpu".into(),
        threads,
        shape: shape.into(),
        tokens,
        target_forward_s: worker_best,
        target_tokens_per_s: tokens as f64 / worker_best,
        target_gflops,
        gemm_gflops,
        forward_vs_gemm: target_gflops / gemm_gflops,
        op_seconds,
        drafter_step_s: drafter_s,
        drafter_tokens_per_s: tokens as f64 / drafter_s,
        drafter_layers: dcfg.layers,
        drafter_rows: anchors.len() * dcfg.block_size,
        drafter_op_seconds,
        shm_all_reduce_ms,
        shm_all_reduce_gb_s,
    })
}

// ---------------------------------------------------------------------------------------
// `--target ops:PRESET`: single ops at a model's real shapes, on a device (the GPU, the
// emulated GPU of the tests). Each op is timed on the device alone:
// one warm-up, then as many repetitions as fit in about 0.2 s (at least one), with the
// device synchronised around them, so launch latency is amortised but never hidden.

/// The shapes of a preset: a target's attention and MLP, the drafter's blocks and loss.
#[derive(Debug, Clone, Serialize)]
pub struct OpsShape {
    pub name: String,
    pub hidden: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    /// Sequence lengths of the attention benchmarks (causal and DFlash blocks).
    pub seq: Vec<usize>,
    /// Rows (tokens) of the target GEMM benchmarks.
    pub gemm_rows: usize,
    pub block_size: usize,
    /// Blocks per sequence of the DFlash attention, the loss and the drafter step.
    pub anchors: usize,
    /// Layers of the target forward (a random checkpoint of this depth).
    pub forward_layers: usize,
    pub forward_tokens: Vec<usize>,
    /// Row length of the packed and row-by-row target forward figures.
    pub forward_row: usize,
    /// The forward's vocabulary: only the embedding gather reads it, at a cost that does
    /// not depend on its size, so the checkpoint is written with a small one.
    pub forward_vocab: usize,
    pub drafter_layers: usize,
    /// Context tokens of the drafter step.
    pub drafter_seq: usize,
}

/// `qwen3-8b`: Qwen3-8B (hidden 4096, 32 query and 8 KV heads of 128, MLP 12288,
/// vocabulary 151,936) at a run's defaults (rows of 1024 tokens, 4096 per batch, 512
/// blocks of 16). `tiny`: the same ops at shapes an emulated GPU (the host CPU) runs in
/// seconds; head dim 128 still.
pub fn ops_preset(name: &str) -> Option<OpsShape> {
    let s = match name {
        "qwen3-8b" => OpsShape {
            name: name.into(),
            hidden: 4096,
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 12288,
            vocab: 151_936,
            seq: vec![1024, 4096],
            gemm_rows: 4096,
            block_size: 16,
            anchors: 512,
            forward_layers: 2,
            forward_tokens: vec![1024, 4096],
            forward_row: 256,
            forward_vocab: 8192,
            drafter_layers: 2,
            drafter_seq: 1024,
        },
        "tiny" => OpsShape {
            name: name.into(),
            hidden: 512,
            q_heads: 4,
            kv_heads: 1,
            head_dim: 128,
            intermediate: 1024,
            vocab: 3000,
            seq: vec![64, 128],
            gemm_rows: 128,
            block_size: 4,
            anchors: 8,
            forward_layers: 2,
            forward_tokens: vec![64],
            forward_row: 16,
            forward_vocab: 512,
            drafter_layers: 1,
            drafter_seq: 64,
        },
        _ => return None,
    };
    Some(s)
}

impl OpsShape {
    fn config_json(&self, layers: usize, vocab: usize) -> String {
        format!(
            r#"{{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":{},"num_hidden_layers":{layers},
            "num_attention_heads":{},"num_key_value_heads":{},"head_dim":{},"intermediate_size":{},"rms_norm_eps":1e-6,
            "rope_theta":1000000.0,"vocab_size":{vocab},"tie_word_embeddings":true}}"#,
            self.hidden, self.q_heads, self.kv_heads, self.head_dim, self.intermediate
        )
    }

    /// `anchors` block starts spread evenly over `seq` tokens (each block fits).
    fn anchors_for(&self, seq: usize) -> Vec<usize> {
        let room = seq.saturating_sub(self.block_size).max(1);
        let n = self.anchors.min(room);
        let mut a: Vec<usize> = (0..n).map(|i| i * room / n).collect();
        a.dedup();
        a
    }
}

/// One measured op.
#[derive(Debug, Serialize)]
pub struct OpRow {
    pub op: String,
    pub shape: String,
    /// Seconds per call on the device.
    pub seconds: Option<f64>,
    pub reps: usize,
    /// FLOPs per call as counted in `note` (model FLOPs unless said otherwise).
    pub flops: f64,
    pub tflops: Option<f64>,
    /// Share of the device's dense bf16 peak, in percent, when the peak is known.
    pub pct_peak: Option<f64>,
    pub note: String,
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct OpsFigures {
    pub preset: OpsShape,
    pub device: String,
    pub peak_bf16_tflops: Option<f64>,
    pub rows: Vec<OpRow>,
    pub seconds: f64,
}

/// Deterministic values in [-scale, scale): a pool of 64 Ki drawn once, tiled, so that
/// gigabytes of operands cost no more than a copy.
pub(crate) fn pattern(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let pool: Vec<f32> = (0..(1usize << 16).min(n.max(1)))
        .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
        .collect();
    (0..n).map(|i| pool[i % pool.len()]).collect()
}

/// Device buffers of one micro-benchmark: allocated (zeroed) and optionally filled.
struct Bufs<'a> {
    dev: &'a mut dyn crate::device::Device,
    seed: u64,
}

impl Bufs<'_> {
    fn zeros(&mut self, bytes: usize) -> Result<crate::device::DSlice, ToolError> {
        let ptr = self.dev.alloc(bytes.max(4))?;
        Ok(crate::device::DSlice { ptr, bytes })
    }
    /// `n` values, f32 or bf16.
    fn random(
        &mut self,
        n: usize,
        bf16: bool,
        scale: f32,
    ) -> Result<crate::device::DSlice, ToolError> {
        self.seed += 1;
        let v = pattern(n, self.seed, scale);
        let s = self.zeros(n * if bf16 { 2 } else { 4 })?;
        let bytes: Vec<u8> = if bf16 {
            v.iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect()
        } else {
            crate::device::f32_bytes(&v).to_vec()
        };
        self.dev.upload(crate::device::Stream::Compute, s, &bytes)?;
        Ok(s)
    }
    fn i32s(&mut self, v: &[i32]) -> Result<crate::device::DSlice, ToolError> {
        let s = self.zeros(v.len() * 4)?;
        self.dev.upload(
            crate::device::Stream::Compute,
            s,
            crate::device::i32_bytes(v),
        )?;
        Ok(s)
    }
}

/// Seconds per call of `f` on the device and the repetitions timed (see above).
fn time_on_device(
    ops: &mut crate::device::ops::Ops,
    mut f: impl FnMut(&mut crate::device::ops::Ops) -> crate::device::Result<()>,
) -> Result<(f64, usize), ToolError> {
    f(ops).map_err(ToolError::from)?;
    ops.dev.sync().map_err(ToolError::from)?;
    let t0 = Instant::now();
    f(ops).map_err(ToolError::from)?;
    ops.dev.sync().map_err(ToolError::from)?;
    let one = t0.elapsed().as_secs_f64();
    let reps = ((0.2 / one.max(1e-9)).ceil() as usize).clamp(1, 50);
    let t0 = Instant::now();
    for _ in 0..reps {
        f(ops).map_err(ToolError::from)?;
    }
    ops.dev.sync().map_err(ToolError::from)?;
    Ok((t0.elapsed().as_secs_f64() / reps as f64, reps))
}

struct RowSink {
    rows: Vec<OpRow>,
    peak: Option<f64>,
}

impl RowSink {
    /// A row that could not be measured, for `e`.
    fn failed(&mut self, op: &str, shape: String, flops: f64, e: &ToolError) {
        let error = ToolError::Skipped {
            because: e.to_string(),
        };
        self.push(op, shape, flops, "", Err(error));
    }

    fn push(
        &mut self,
        op: &str,
        shape: String,
        flops: f64,
        note: &str,
        r: Result<(f64, usize), ToolError>,
    ) {
        let (seconds, reps, error) = match r {
            Ok((s, n)) => (Some(s), n, None),
            Err(e) => (None, 0, Some(e.to_string())),
        };
        let tflops = seconds.map(|s| flops / s.max(1e-12) / 1e12);
        let pct_peak = tflops.zip(self.peak).map(|(t, p)| 100.0 * t / p);
        self.rows.push(OpRow {
            op: op.into(),
            shape,
            seconds,
            reps,
            flops,
            tflops,
            pct_peak,
            note: note.into(),
            error,
        });
    }
}

/// Causal spans (`[0, i + 1)`) of `t` rows, or DFlash's: block row `i` of anchor `a`
/// sees the context `[0, a)` and its own block (keys after the `ctx` context keys).
fn causal_spans(t: usize) -> Vec<i32> {
    (0..t as i32).flat_map(|i| [0, i + 1, 0, 0]).collect()
}
fn block_spans(ctx: usize, anchors: &[usize], bs: usize) -> Vec<i32> {
    (0..anchors.len() * bs)
        .flat_map(|i| {
            let n = i / bs;
            [
                0,
                anchors[n] as i32,
                (ctx + n * bs) as i32,
                (ctx + (n + 1) * bs) as i32,
            ]
        })
        .collect()
}
/// Keys seen by every query row of those spans, summed.
fn span_keys(spans: &[i32]) -> f64 {
    spans
        .chunks_exact(4)
        .map(|s| ((s[1] - s[0]) + (s[3] - s[2])) as f64)
        .sum()
}

/// The attention, the GEMM and the loss micro-benchmarks on one device.
fn measure_kernels(
    p: &OpsShape,
    dev: Box<dyn crate::device::Device>,
    sink: &mut RowSink,
) -> Result<(), ToolError> {
    let mut ops = crate::device::ops::Ops::new(dev);
    let seed = measure_attention(p, &mut ops, 100, sink);
    let seed = measure_gemms(p, &mut ops, seed, sink);
    measure_cross_entropy(p, &mut ops, seed, sink);
    Ok(())
}

/// The spans; q, k, v, out, lse (f32); q, k, v, out (bf16); dout, dq, dk, dv (f32).
type AttnBufs = (
    crate::device::DSlice,
    [crate::device::DSlice; 5],
    [crate::device::DSlice; 4],
    [crate::device::DSlice; 5],
);

/// Attention's buffers for `tq` query rows over `tk` keys: the spans; q, k, v, out (f32)
/// and lse; q, k, v, out in bf16; dout, dq, dk, dv (f32) and the backward's scratch. Random from `seed` (advanced).
fn attention_bufs(
    ops: &mut crate::device::ops::Ops,
    seed: &mut u64,
    p: &OpsShape,
    (tq, tk): (usize, usize),
    spans: &[i32],
) -> Result<AttnBufs, ToolError> {
    let mut b = Bufs {
        dev: ops.dev.as_mut(),
        seed: *seed,
    };
    let r = attention_bufs_in(&mut b, p, (tq, tk), spans);
    *seed = b.seed;
    r
}

fn attention_bufs_in(
    b: &mut Bufs,
    p: &OpsShape,
    (tq, tk): (usize, usize),
    spans: &[i32],
) -> Result<AttnBufs, ToolError> {
    let (qh, qd, kd) = (p.q_heads, p.q_heads * p.head_dim, p.kv_heads * p.head_dim);
    let sp = b.i32s(spans)?;
    let f32s = [
        b.random(tq * qd, false, 1.0)?,
        b.random(tk * kd, false, 1.0)?,
        b.random(tk * kd, false, 1.0)?,
        b.zeros(tq * qd * 4)?,
        b.zeros(tq * qh * 4)?,
    ];
    let bf16s = [
        b.random(tq * qd, true, 1.0)?,
        b.random(tk * kd, true, 1.0)?,
        b.random(tk * kd, true, 1.0)?,
        b.zeros(tq * qd * 2)?,
    ];
    let grads = [
        b.random(tq * qd, false, 1.0)?,
        b.zeros(tq * qd * 4)?,
        b.zeros(tk * kd * 4)?,
        b.zeros(tk * kd * 4)?,
        b.zeros(
            crate::device::ops::Ops::attention_backward_scratch(tq, p.q_heads, p.head_dim) * 4,
        )?,
    ];
    Ok((sp, f32s, bf16s, grads))
}

/// Attention forward and backward, causal and over DFlash blocks, at each length of
/// `p.seq`; returns the next seed.
fn measure_attention(
    p: &OpsShape,
    ops: &mut crate::device::ops::Ops,
    mut seed: u64,
    sink: &mut RowSink,
) -> u64 {
    let (qh, kvh, hd) = (p.q_heads, p.kv_heads, p.head_dim);
    let qd = qh * hd;
    let heads = format!("{qh}/{kvh} heads of {hd}");
    // Attention: causal over t tokens (the target's, bf16), and DFlash's blocks over a
    // context of t tokens (the drafter's, f32 in and out, bf16 products), each forward
    // and backward. Model FLOPs: QKᵀ and PV forward; four products backward (dQ, dK, dV
    // and dP; the recomputed QKᵀ not counted).
    for &t in &p.seq {
        let anchors = p.anchors_for(t);
        let m = anchors.len() * p.block_size;
        for (kind, tq, tk, spans) in [
            ("causal", t, t, causal_spans(t)),
            ("dflash", m, t + m, block_spans(t, &anchors, p.block_size)),
        ] {
            let keys = span_keys(&spans);
            let fwd_flops = 4.0 * keys * qd as f64;
            let shape = match kind {
                "causal" => format!("{t} tokens, {heads}"),
                _ => format!(
                    "{} blocks of {} over {t} tokens, {heads}",
                    anchors.len(),
                    p.block_size
                ),
            };
            let bufs = attention_bufs(ops, &mut seed, p, (tq, tk), &spans);
            let (sp, [q, k, v, out, lse], [q16, k16, v16, out16], [dout, dq, dk, dv, delta]) =
                match bufs {
                    Ok(x) => x,
                    Err(e) => {
                        for (dir, flops) in [("forward", fwd_flops), ("backward", 2.0 * fwd_flops)]
                        {
                            let what = format!("attention {kind} {dir}");
                            sink.failed(&what, shape.clone(), flops, &e);
                        }
                        continue;
                    }
                };
            let fwd = Attention {
                q,
                k,
                v,
                out,
                lse,
                spans: sp,
                tq,
                qh,
                kvh,
                hd,
            };
            let fwd16 = Attention {
                q: q16,
                k: k16,
                v: v16,
                out: out16,
                ..fwd
            };
            let g = AttentionGrad {
                fwd,
                dout,
                dq,
                dk,
                dv,
            };
            time_attention(ops, sink, (kind, shape, fwd_flops), fwd16, (g, delta));
        }
    }

    seed
}

/// Times one attention's forward (the target's bf16 kernel on `fwd16` when `kind` is
/// `causal`, else the drafter's on `g.fwd`) and its backward `g` (with scratch `delta`).
fn time_attention(
    ops: &mut crate::device::ops::Ops,
    sink: &mut RowSink,
    (kind, shape, fwd_flops): (&str, String, f64),
    fwd16: Attention,
    (g, delta): (AttentionGrad, DSlice),
) {
    let fwd = g.fwd;
    if kind == "causal" {
        ops.act16 = true;
        let r = time_on_device(ops, |o| o.attention(fwd16));
        ops.act16 = false;
        sink.push(
            "attention causal forward",
            shape.clone(),
            fwd_flops,
            "the target's kernel: bf16 in and out",
            r,
        );
    } else {
        let r = time_on_device(ops, |o| o.attention(fwd));
        sink.push(
            "attention dflash forward",
            shape.clone(),
            fwd_flops,
            "the drafter's kernel: f32 in and out, bf16 products",
            r,
        );
    }
    // The backward needs the forward's output and log-sum-exp (f32).
    let r = ops
        .attention(fwd)
        .map_err(ToolError::from)
        .and_then(|_| time_on_device(ops, |o| o.attention_backward(g, delta)));
    sink.push(
        &format!("attention {kind} backward"),
        shape,
        2.0 * fwd_flops,
        "dQ, dK, dV (f32, accumulated); 4 products counted",
        r,
    );
}

/// The target's GEMMs; returns the next seed.
fn measure_gemms(
    p: &OpsShape,
    ops: &mut crate::device::ops::Ops,
    mut seed: u64,
    sink: &mut RowSink,
) -> u64 {
    let (h, qd, kd) = (p.hidden, p.q_heads * p.head_dim, p.kv_heads * p.head_dim);
    // The target's GEMMs over one batch's tokens, bf16 in and out (f32 accumulation).
    let m = p.gemm_rows;
    let gemms = [
        ("q_proj", h, qd),
        ("k_proj", h, kd),
        ("v_proj", h, kd),
        ("o_proj", qd, h),
        ("gate_proj", h, p.intermediate),
        ("up_proj", h, p.intermediate),
        ("down_proj", p.intermediate, h),
    ];
    for (name, k, n) in gemms {
        let mut b = Bufs {
            dev: ops.dev.as_mut(),
            seed,
        };
        let bufs = (|| {
            Ok::<_, ToolError>((
                b.random(m * k, true, 1.0)?,
                b.random(n * k, true, 0.05)?,
                b.zeros(m * n * 2)?,
            ))
        })();
        seed = b.seed;
        let flops = 2.0 * (m * k * n) as f64;
        let shape = format!("{m}x{k} · ({n}x{k})ᵀ");
        let r = bufs.and_then(|(x, w, y)| {
            ops.act16 = true;
            let r = time_on_device(ops, |o| {
                o.matmul(o.act_mat(x, m, k), o.act_mat(w, n, k), o.act_mat(y, m, n))
            });
            ops.act16 = false;
            r
        });
        sink.push(
            &format!("gemm {name}"),
            shape,
            flops,
            "cuBLAS bf16 in and out",
            r,
        );
    }

    seed
}

/// The buffers of the loss benchmark: the input (f32 and bf16), the lm_head (bf16), one
/// chunk's logits (bf16), the rows' running state, the labels, each row's gradient scale,
/// dX and each row's loss and `argmax == label`.
struct CeBufs {
    x: DSlice,
    xb: DSlice,
    lm16: DSlice,
    logits: DSlice,
    st: crate::device::ops::CeState,
    labels: DSlice,
    scale: DSlice,
    dx: DSlice,
    loss: DSlice,
    correct: DSlice,
}

/// The shape of the loss benchmark: `n` rows of `h` over a vocabulary of `v` in chunks of
/// `cw`.
#[derive(Clone, Copy)]
struct CeShape {
    n: usize,
    h: usize,
    v: usize,
    cw: usize,
}

impl CeShape {
    fn alloc(self, b: &mut Bufs) -> Result<CeBufs, ToolError> {
        let CeShape { n, h, v, cw } = self;
        let labels: Vec<i32> = (0..n).map(|i| ((i * 7919) % v) as i32).collect();
        Ok(CeBufs {
            x: b.random(n * h, false, 1.0)?,
            xb: b.zeros(n * h * 2)?,
            lm16: b.random(v * h, true, 0.05)?,
            logits: b.zeros(n * cw * 2)?,
            st: crate::device::ops::CeState {
                run_max: b.zeros(n * 4)?,
                run_sum: b.zeros(n * 4)?,
                best_i: b.zeros(n * 4)?,
                label_logit: b.zeros(n * 4)?,
                acc: b.zeros(n * h * 4)?,
            },
            labels: b.i32s(&labels)?,
            scale: b.random(n, false, 1e-3)?,
            dx: b.zeros(n * h * 4)?,
            loss: b.zeros(n * 4)?,
            correct: b.zeros(n * 4)?,
        })
    }

    /// The loss and its gradient as `DeviceDrafter::loss` runs them: the input cast once,
    /// then per chunk the logits GEMM (bf16 out), their fold into the rows' online
    /// softmax and the GEMM adding `exp(l − max)·W` into the rows' accumulator; then dX
    /// and the losses.
    fn run(self, c: &CeBufs, o: &mut crate::device::ops::Ops) -> crate::device::Result<()> {
        use crate::device::{f32_bytes, ops::DType, Stream};
        let CeShape { n, h, v, cw } = self;
        let st = c.st;
        o.dev.upload(
            Stream::Compute,
            st.run_max,
            f32_bytes(&vec![f32::NEG_INFINITY; n]),
        )?;
        for b in [st.run_sum, st.best_i, st.label_logit, st.acc] {
            o.dev.memset_zero(Stream::Compute, b)?;
        }
        o.f32_to_bf16(c.xb, c.x)?;
        for start in (0..v).step_by(cw) {
            let w = cw.min(v - start);
            let lm = c.lm16.sub(2, start * h..(start + w) * h);
            let l = c.logits.sub(2, 0..n * w);
            let (x, lm, l16) = (
                Mat::bf16(c.xb, n, h),
                Mat::bf16(lm, w, h),
                Mat::bf16(l, n, w),
            );
            o.matmul(x, lm, l16)?;
            o.ce_fold(st, Mat::new(l, n, w, DType::Bf16), c.labels, (start, h))?;
            let acc = Dx::Add(Mat::f32(st.acc, n, h));
            o.matmul_backward(l16, x, lm, acc, None)?;
        }
        let out = (Mat::f32(c.dx, n, h), c.loss, c.correct);
        o.ce_finish(st, out, (c.labels, c.scale), Mat::bf16(c.lm16, v, h))
    }
}

/// The drafter's loss through the lm_head with its gradient: one pass.
fn measure_cross_entropy(
    p: &OpsShape,
    ops: &mut crate::device::ops::Ops,
    seed: u64,
    sink: &mut RowSink,
) {
    let (n, h, v) = (p.anchors * (p.block_size - 1), p.hidden, p.vocab);
    let ce = CeShape {
        n,
        h,
        v,
        cw: 4096.min(v),
    };
    let flops = 4.0 * (n * h * v) as f64;
    let shape = format!("{n} rows x {h} over {v} tokens, chunks of {}", ce.cw);
    let name = "cross_entropy forward and backward";
    let mut b = Bufs {
        dev: ops.dev.as_mut(),
        seed,
    };
    let bufs = match ce.alloc(&mut b) {
        Ok(bufs) => bufs,
        Err(e) => return sink.failed(name, shape, flops, &e),
    };
    let r = time_on_device(ops, |o| ce.run(&bufs, o));
    sink.push(
        name,
        shape,
        flops,
        "per chunk the logits GEMM (bf16 out), the fold and the softmax·W GEMM; then dX",
        r,
    );
}

/// The target forward of `p.forward_layers` layers of the preset's shape (random bf16
/// weights), as a target worker runs it: taps written to a staging buffer and copied
/// into pinned host memory behind an event, the next forward computing meanwhile. Each
/// length is timed as one sequence, then as rows of `p.forward_row` tokens packed into
/// one forward (what a target worker runs for a batch) and run row by row.
fn measure_forward(p: &OpsShape, sink: &mut RowSink) -> Result<(), ToolError> {
    let layers = p.forward_layers;
    let scratch = dflash_shared::scratch::ScratchDir::new(&format!("bench-ops-{}", p.name))
        .map_err(ToolError::io("creating a scratch directory".to_string()))?;
    let dir = scratch.path();
    crate::models::tiny::write_random(dir, &p.config_json(layers, p.forward_vocab), 11).map_err(
        ToolError::io(format!("writing the {layers}-layer checkpoint")),
    )?;
    let target = Target::load(dir, &[layers - 1])?;
    drop(scratch);
    let tmax = p.forward_tokens.iter().copied().max().unwrap_or(1);
    let dev = open_device()?.ok_or(ToolError::Skipped {
        because: "no device".into(),
    })?;
    let mut g = crate::models::target::device::DeviceTarget::new(dev, &target, tmax)?;
    let (h, qd, kd, inter) = (
        p.hidden,
        p.q_heads * p.head_dim,
        p.kv_heads * p.head_dim,
        p.intermediate,
    );
    let width = h; // one tap, the last layer's output
    let bytes = tmax * width * 2;
    let layout = std::alloc::Layout::from_size_align(bytes.max(1).next_multiple_of(4096), 4096)
        .map_err(|_| ToolError::HostMemory { bytes })?;
    // SAFETY: non-zero size; freed below once the device is gone.
    let pinned = unsafe { std::alloc::alloc_zeroed(layout) };
    if pinned.is_null() {
        return Err(ToolError::HostMemory { bytes });
    }
    let result = (|| -> Result<(), ToolError> {
        // SAFETY: the buffer outlives `g` (dropped before it is freed).
        unsafe { g.register_host(pinned, layout.size()) }?;
        let mut rng = Rng::new(5);
        for &t in &p.forward_tokens {
            let ids: Vec<u32> = (0..t)
                .map(|_| rng.below(p.forward_vocab as u64) as u32)
                .collect();
            // t tokens in causal rows of `row`.
            let flops = |row: usize| {
                let gemm = 2.0 * (t * (h * qd + 2 * h * kd + qd * h + 3 * h * inter)) as f64;
                let attn = 4.0 * (t / row * row * (row + 1) / 2) as f64 * qd as f64;
                (gemm + attn) * layers as f64
            };
            let row = p.forward_row.min(t);
            let rows: Vec<&[u32]> = ids.chunks(row).collect();
            let shape = format!(
                "{layers} layer(s), {t} tokens in {} rows of {row}",
                rows.len()
            );
            for (op, shape, rows, per_row, note) in [
                ("target forward", format!("{layers} layer(s), {t} tokens"), vec![&ids[..]], false,
                 "GEMMs and causal attention; taps copied to pinned memory, overlapped"),
                ("target forward, rows packed", shape.clone(), rows.clone(), false,
                 "the rows in one forward (each token's causal span within its row), each row's taps copied to pinned memory"),
                ("target forward, row by row", shape, rows, true,
                 "a forward per row, copies overlapped with the next row"),
            ] {
                // SAFETY: `pinned` is registered, holds `tmax` tokens' taps, and is only
                // read after `finish`.
                let r = unsafe { time_forward(&mut g, &rows, per_row, pinned, width) };
                let n = if per_row { rows[0].len() } else { t };
                sink.push(op, shape, flops(n), note, r);
            }
        }
        Ok(())
    })();
    drop(g);
    // SAFETY: allocated above; the device that registered it is gone.
    unsafe { std::alloc::dealloc(pinned, layout) };
    result
}

/// Seconds per run of the target forward over `rows` (each row's taps into `pinned`
/// after the row before's), and the runs timed: a run is one call for every row (packed
/// into as few forwards as the target's room allows), or one call per row when
/// `per_row`; enough runs for ~0.3 s, 2 to 20.
///
/// # Safety
/// `pinned` must be registered with `g`, hold the rows' taps (`width` bf16 a token), and
/// not be touched during the call.
unsafe fn time_forward(
    g: &mut crate::models::target::device::DeviceTarget,
    rows: &[&[u32]],
    per_row: bool,
    pinned: *mut u8,
    width: usize,
) -> Result<(f64, usize), ToolError> {
    let mut at = 0;
    let rows: Vec<(&[u32], *mut u8)> = rows
        .iter()
        .map(|&r| {
            let dst = pinned.add(at * width * 2);
            at += r.len();
            (r, dst)
        })
        .collect();
    let mut run = |n: usize| -> Result<f64, ToolError> {
        let t0 = Instant::now();
        let mut last = None;
        for _ in 0..n {
            if per_row {
                for r in &rows {
                    last = g.forward_rows_into(std::slice::from_ref(r))?.or(last);
                }
            } else {
                last = g.forward_rows_into(&rows)?.or(last);
            }
        }
        if let Some(e) = last {
            g.finish(e, pinned, at * width * 2)?;
        }
        Ok(t0.elapsed().as_secs_f64() / n as f64)
    };
    let one = run(1)?;
    let reps = ((0.3 / one.max(1e-9)).ceil() as usize).clamp(2, 20);
    run(reps).map(|s| (s, reps))
}

/// One drafter training step (forward and backward, the gradient left on the device) of
/// `p.drafter_layers` layers at the preset's shape, over one sample of `p.drafter_seq`
/// tokens with `p.anchors` blocks.
fn measure_drafter(p: &OpsShape, sink: &mut RowSink) -> Result<(), ToolError> {
    let cfg = TargetConfig::read(&p.config_json(p.drafter_layers.max(1), p.vocab)).map_err(
        |problem| dflash_shared::model_config::ConfigError {
            path: format!("the config of ops:{}", p.name),
            problem,
        },
    )?;
    let n_taps = p.drafter_layers.max(1);
    let dcfg = DrafterConfig::for_target(&cfg, p.drafter_layers, n_taps, p.block_size, p.anchors);
    let drafter = Drafter::new(dcfg.clone());
    let s = p.drafter_seq;
    let shape = format!(
        "{} layer(s), {} tap(s), {s} tokens, {} blocks of {}, vocabulary {}",
        dcfg.layers,
        n_taps,
        dcfg.max_anchors.min(s - 1),
        p.block_size,
        p.vocab
    );
    let params = drafter.init_params(3);
    let frozen = Frozen {
        embed: pattern(p.vocab * p.hidden, 21, 0.05),
        lm_head: pattern(p.vocab * p.hidden, 22, 0.05),
    };
    let taps = pattern(s * n_taps * p.hidden, 23, 1.0);
    let mut rng = Rng::new(9);
    let ids: Vec<u32> = (0..s).map(|_| rng.below(p.vocab as u64) as u32).collect();
    let mask = vec![1u8; s];
    let anchors = drafter.sample_anchors(&mask, &mut rng);
    let supervised = anchors
        .iter()
        .map(|&a| {
            (1..dcfg.block_size)
                .filter(|&k| drafter.slot_weight(a, k, &mask) > 0.0)
                .count()
        })
        .sum();
    let flops = drafter_step_flops(&dcfg, s, &anchors, supervised);
    let dev = open_device()?.ok_or(ToolError::Skipped {
        because: "no device".into(),
    })?;
    let r = (|| -> Result<(f64, usize), ToolError> {
        let mut gd = crate::models::drafter::device::DeviceDrafter::new(dev, &drafter, &frozen, s)
            .map_err(ToolError::from)?;
        let zeros = vec![0f32; params.len()];
        gd.load(&params, &zeros, &zeros, 0)
            .map_err(ToolError::from)?;
        let sample = [Sample {
            taps: &taps,
            ids: &ids,
            mask: &mask,
        }];
        let anchors = [anchors.clone()];
        let step =
            |gd: &mut crate::models::drafter::device::DeviceDrafter| -> Result<f64, ToolError> {
                let t0 = Instant::now();
                gd.forward_backward(&sample, Rows::F32, &anchors, 1.0, GradTo::Device)
                    .map_err(ToolError::from)?;
                gd.device().sync().map_err(ToolError::from)?;
                Ok(t0.elapsed().as_secs_f64())
            };
        step(&mut gd)?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            best = best.min(step(&mut gd)?);
        }
        Ok((best, 3))
    })();
    sink.push(
        "drafter step",
        shape,
        flops,
        "forward and backward (model FLOPs, drafter_step_flops); f32 taps uploaded; best of 3",
        r,
    );
    Ok(())
}

pub fn run_ops(preset: &str, json: bool) -> Result<(), ToolError> {
    let p = ops_preset(preset).ok_or_else(|| ToolError::Usage {
        flag: "--target",
        value: format!("ops:{preset}"),
        expected: "unknown preset (ops:qwen3-8b, ops:tiny)".into(),
    })?;
    let t0 = Instant::now();
    let dev = match open_device() {
        Ok(Some(d)) => d,
        Ok(None) => {
            return Err(ToolError::Device(GpuError::Unavailable(format!(
                "ops:{preset} measures ops on a GPU, and none can be used here: {}",
                crate::device::cuda::missing_library().unwrap_or_default()
            ))))
        }
        Err(e) => {
            return Err(ToolError::During {
                what: format!("ops:{preset}: opening the GPU"),
                source: Box::new(e),
            })
        }
    };
    let device = dev.describe();
    let peak = peak_bf16_tflops(&device);
    let mut sink = RowSink {
        rows: Vec::new(),
        peak,
    };
    let fail = |sink: &mut RowSink, op: &str, r: Result<(), ToolError>| {
        if let Err(e) = r {
            sink.push(op, String::new(), 0.0, "", Err(e));
        }
    };
    let r = measure_kernels(&p, dev, &mut sink);
    fail(&mut sink, "kernels", r);
    let r = measure_forward(&p, &mut sink);
    fail(&mut sink, "target forward", r);
    let r = measure_drafter(&p, &mut sink);
    fail(&mut sink, "drafter step", r);
    let f = OpsFigures {
        preset: p,
        device,
        peak_bf16_tflops: peak,
        rows: sink.rows,
        seconds: t0.elapsed().as_secs_f64(),
    };
    if json {
        println!(
            "{}",
            serde_json::to_string(&f).map_err(ToolError::json("the figures"))?
        );
    } else {
        let peak = f
            .peak_bf16_tflops
            .map_or("peak unknown for this device".to_string(), |p| {
                format!("bf16 peak {p:.0} TFLOP/s")
            });
        println!(
            "bench compute ops:{}: {} ({peak}), {:.1} s",
            f.preset.name, f.device, f.seconds
        );
        println!(
            "  {:<26} {:<56} {:>10} {:>9} {:>7}",
            "op", "shape", "ms", "TFLOP/s", "% peak"
        );
        for r in &f.rows {
            match (&r.error, r.seconds) {
                (None, Some(s)) => println!(
                    "  {:<26} {:<56} {:>10.3} {:>9.3} {:>7}",
                    r.op,
                    r.shape,
                    s * 1e3,
                    r.tflops.unwrap_or(0.0),
                    r.pct_peak.map_or("-".into(), |p| format!("{p:.1}"))
                ),
                (e, _) => println!(
                    "  {:<26} {:<56} FAILED: {}",
                    r.op,
                    r.shape,
                    e.as_deref().unwrap_or("?")
                ),
            }
        }
    }
    if f.rows.iter().any(|r| r.error.is_some()) {
        return Err(ToolError::OpsFailed {
            failed: f.rows.iter().filter(|r| r.error.is_some()).count(),
            of: f.rows.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_qwen3_8b_preset_has_the_model_and_run_shapes() {
        let p = ops_preset("qwen3-8b").unwrap();
        assert_eq!(
            (
                p.hidden,
                p.q_heads,
                p.kv_heads,
                p.head_dim,
                p.intermediate,
                p.vocab
            ),
            (4096, 32, 8, 128, 12288, 151_936)
        );
        let cfg = TargetConfig::read(&p.config_json(2, p.vocab)).unwrap();
        assert_eq!(
            (
                cfg.num_attention_heads * cfg.head_dim,
                cfg.num_key_value_heads
            ),
            (4096, 8)
        );
        for &t in &p.seq {
            let a = p.anchors_for(t);
            assert_eq!(a.len(), 512, "{t} tokens");
            assert!(
                a.windows(2).all(|w| w[0] < w[1]) && a.last().unwrap() + p.block_size <= t,
                "{t}: {a:?}"
            );
        }
        assert!(ops_preset("tiny").is_some() && ops_preset("gpt2").is_none());
    }

    #[test]
    fn attention_flops_count_the_keys_each_row_sees() {
        // Causal: row i sees i + 1 keys.
        assert_eq!(span_keys(&causal_spans(4)), 10.0);
        // Blocks of 2 at anchors 3 and 5 over 8 context tokens: each row sees its anchor's
        // context and its own block; the block's keys come after the context's.
        let s = block_spans(8, &[3, 5], 2);
        assert_eq!(
            s,
            vec![0, 3, 8, 10, 0, 3, 8, 10, 0, 5, 10, 12, 0, 5, 10, 12]
        );
        assert_eq!(span_keys(&s), 2.0 * (3.0 + 2.0) + 2.0 * (5.0 + 2.0));
    }
}
