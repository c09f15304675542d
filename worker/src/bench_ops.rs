//! `dflash-worker bench-ops`: what `dflash-supervise bench compute` measures, in this one
//! process. The target forward over one sequence, per op and as a whole, as tokens/s and
//! GFLOP/s; a bare GEMM over exactly the forward's matrix shapes, as the baseline the
//! forward's rate is compared with (the GEMMs are most of its FLOPs); and one drafter
//! training step on the same shapes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use dflash_shared::drafter::DrafterConfig;
use dflash_shared::model_config::TargetConfig;
use dflash_shared::rng::Rng;
use serde::Serialize;

use crate::compute::cpu::Cpu;
use crate::compute::Backend;
use crate::model::drafter::{Drafter, Frozen, Sample};
use crate::model::target::{OpTimes, Target};
use crate::model::weights::Weights;

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
    /// The reference target (host slices, `src/model/target.rs`), same tokens.
    pub reference_forward_s: f64,
    pub reference_gflops: f64,
    /// Seconds per op of the reference forward.
    pub reference_op_seconds: BTreeMap<String, f64>,
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
    /// The same target forward on a device, when there is one (or DFLASH_DEVICE=host).
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
    let table: [(&str, f64); 6] = [("H100 PCIE", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0), ("B200", 2250.0), ("L40S", 362.0)];
    table.iter().find(|(k, _)| n.contains(k)).map(|(_, v)| *v)
}

fn open_device() -> Result<Option<Box<dyn crate::gpu::Device>>, String> {
    Ok(Some(match std::env::var("DFLASH_DEVICE").as_deref() {
        Ok("host") => Box::new(crate::gpu::host::HostDevice::new()) as Box<dyn crate::gpu::Device>,
        _ => match crate::gpu::cuda::missing_library() {
            Some(_) => return Ok(None),
            None => Box::new(crate::gpu::cuda::CudaDevice::open().map_err(|e| e.to_string())?),
        },
    }))
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

fn measure_device(target: &Target, ids: &[u32], flops: f64, cpu_tokens_per_s: f64, dc: &DrafterCase) -> Result<Option<DeviceFigures>, String> {
    let Some(dev) = open_device()? else { return Ok(None) };
    let mut g = crate::gpu::target::GpuTarget::new(dev, target, ids.len()).map_err(|e| e.to_string())?;
    g.forward_taps(&ids[..ids.len().min(64)]).map_err(|e| e.to_string())?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = Instant::now();
        // forward_taps ends with a synchronous download: the time covers the device's work.
        std::hint::black_box(g.forward_taps(ids).map_err(|e| e.to_string())?);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    let name = g.describe();
    drop(g);
    let tflops = flops / best / 1e12;
    let peak = peak_bf16_tflops(&name);
    let tokens_per_s = ids.len() as f64 / best;

    // The drafter step and the optimizer, on a device of their own (as a drafter worker has).
    let dev = open_device()?.ok_or("the device went away")?;
    let mut gd = crate::gpu::drafter::GpuDrafter::new(dev, dc.drafter, dc.frozen, dc.sample.ids.len()).map_err(|e| e.to_string())?;
    let n = dc.params.len();
    let zeros = vec![0f32; n];
    gd.load(dc.params, &zeros, &zeros, 0).map_err(|e| e.to_string())?;
    let mut grads = vec![0f32; n];
    let (samples, anchors) = (std::slice::from_ref(&dc.sample), vec![dc.anchors.to_vec()]);
    let mut drafter_best = f64::INFINITY;
    let mut opt_best = f64::INFINITY;
    let hyper = crate::model::drafter::AdamW::new(0).hyper();
    for step in 1..=3 {
        let t0 = Instant::now();
        // train_batch ends with the gradient's synchronous download.
        gd.train_batch(samples, &anchors, 1.0, &mut grads).map_err(|e| e.to_string())?;
        drafter_best = drafter_best.min(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        gd.apply(step, &grads, 1.0, 1e-4, &hyper).map_err(|e| e.to_string())?;
        gd.drain().map_err(|e| e.to_string())?;
        opt_best = opt_best.min(t0.elapsed().as_secs_f64());
    }
    let (all_reduce, all_reduce_ms, step_with_all_reduce_s, all_reduce_overlap) = measure_reduction(&mut gd, dc)?;
    drop(gd);
    let drafter_tflops = dc.flops / drafter_best / 1e12;

    let dev = open_device()?.ok_or("the device went away")?;
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
fn measure_reduction(gd: &mut crate::gpu::drafter::GpuDrafter, dc: &DrafterCase) -> Result<(String, f64, f64, f64), String> {
    use crate::collective::{local::LocalCollective, nccl::NcclCollective, Collective, Formed};
    let e = |e: crate::error::WorkerError| e.to_string();
    let mut coll: Box<dyn Collective> = match NcclCollective::new(0, gd) {
        Ok(c) => Box::new(c),
        Err(_) => Box::new(LocalCollective::new(0)),
    };
    let name = match coll.kind() {
        dflash_shared::drafter::CollectiveKind::Nccl => "NCCL, 1 rank",
        _ => "device copy, 1 rank, no NCCL",
    };
    if let Formed::Created(id) = coll.form(1, &[0], None).map_err(e)? {
        coll.form(1, &[0], Some(&id)).map_err(e)?;
    }
    let (samples, anchors) = (std::slice::from_ref(&dc.sample), vec![dc.anchors.to_vec()]);
    let sync = |gd: &mut crate::gpu::drafter::GpuDrafter| gd.device().sync().map_err(|e| e.to_string());
    let reduce = |coll: &mut Box<dyn Collective>, gd: &mut crate::gpu::drafter::GpuDrafter, step: u64| -> Result<(), String> {
        coll.contribute(step, 1.0, gd).map_err(e)?;
        while coll.poll(gd).map_err(e)?.is_none() {
            std::thread::yield_now();
        }
        sync(gd)
    };
    let (mut step_s, mut red_s, mut both_s) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for step in 1..=3u64 {
        let t0 = Instant::now();
        gd.train_batch_on_device(samples, &anchors, 1.0).map_err(|e| e.to_string())?;
        sync(gd)?;
        step_s = step_s.min(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        reduce(&mut coll, gd, step)?;
        red_s = red_s.min(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        gd.train_batch_on_device(samples, &anchors, 1.0).map_err(|e| e.to_string())?;
        reduce(&mut coll, gd, step)?;
        both_s = both_s.min(t0.elapsed().as_secs_f64());
    }
    let overlap = ((step_s + red_s - both_s) / red_s.max(1e-12)).clamp(0.0, 1.0);
    Ok((name.to_string(), red_s * 1e3, both_s, overlap))
}

/// The shared-memory all-reduce of `n` f32 between two ranks over one pool (as two CPU
/// drafter workers run it): best of three, ms, and gradient GB/s read.
fn measure_shm_all_reduce(n: usize) -> Result<(f64, f64), String> {
    use crate::collective::{shm::ShmCollective, Collective};
    use dflash_shared::pool::{PoolGeometry, PoolMap};
    use std::os::fd::AsRawFd;
    let e = |e: crate::error::WorkerError| e.to_string();
    let g = PoolGeometry { name: "grads".into(), slots: 4, slot_bytes: dflash_shared::drafter::GRAD_SLOT_HEADER + n as u64 * 4 };
    let (fd, _map) = PoolMap::create(g.clone()).map_err(|e| e.to_string())?;
    let mut ranks: Vec<ShmCollective> = (0..2).map(|r| ShmCollective::new(PoolMap::open(fd.as_raw_fd(), g.clone()).map_err(|e| e.to_string())?, r, n).map_err(e)).collect::<Result<_, _>>()?;
    for r in ranks.iter_mut() {
        r.form(1, &[0, 1], None).map_err(e)?;
    }
    let grad: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 1e-3).collect();
    let mut best = f64::INFINITY;
    for step in 1..=3u64 {
        let t0 = Instant::now();
        for r in ranks.iter_mut() {
            r.contribute_host(step, 1.0, &grad).map_err(e)?;
        }
        let mut done = [false; 2];
        while !done.iter().all(|d| *d) {
            for (i, r) in ranks.iter_mut().enumerate() {
                done[i] |= r.progress().map_err(e)?.is_some();
            }
        }
        best = best.min(t0.elapsed().as_secs_f64());
        for r in ranks.iter_mut() {
            r.take_sum(step, 2.0).map_err(e)?;
        }
    }
    // Each rank writes its gradient and reads both.
    Ok((best * 1e3, (6 * n * 4) as f64 / best / 1e9))
}

/// Device→host copy rate into a shared-memory mapping (a memfd mapped shared, as the
/// pools are) pinned with `register_host`, against a plain page-aligned heap buffer
/// pinned the same way: best of five copies of 64 MiB each (4 MiB on the host device).
fn measure_copies(mut dev: Box<dyn crate::gpu::Device>) -> Result<(usize, f64, f64), String> {
    use crate::gpu::{DSlice, Stream};
    let bytes: usize = if dev.describe().starts_with("host device") { 4 << 20 } else { 64 << 20 };
    let src = DSlice { ptr: dev.alloc(bytes).map_err(|e| e.to_string())?, bytes };
    // A hidden-state pool of one slot, mapped as a worker maps it (header read-only,
    // slots read-write), pinned as a target pins its output pool.
    use std::os::fd::AsRawFd;
    let geometry = dflash_shared::pool::PoolGeometry { name: "bench".into(), slots: 1, slot_bytes: bytes as u64 };
    let (fd, _owner) = dflash_shared::pool::PoolMap::create(geometry.clone()).map_err(|e| format!("creating a pool: {e}"))?;
    let pool = dflash_shared::pool::PoolMap::open(fd.as_raw_fd(), geometry).map_err(|e| format!("mapping the pool: {e}"))?;
    let (slots_ptr, slots_len) = pool.slots_mapping();
    let slot = slots_ptr;
    let layout = std::alloc::Layout::from_size_align(bytes, 4096).map_err(|e| e.to_string())?;
    // SAFETY: non-zero size; freed below after the device is gone.
    let plain = unsafe { std::alloc::alloc_zeroed(layout) };
    if plain.is_null() {
        return Err("out of host memory".into());
    }
    let time = |dev: &mut Box<dyn crate::gpu::Device>, dst: *mut u8| -> Result<f64, String> {
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t0 = Instant::now();
            // SAFETY: dst is registered, `bytes` long, and not touched until the event.
            unsafe { dev.download_async(Stream::Copy, src, dst) }.map_err(|e| e.to_string())?;
            let e = dev.record(Stream::Copy).map_err(|e| e.to_string())?;
            dev.sync_event(e).map_err(|e| e.to_string())?;
            dev.release_event(e);
            best = best.min(t0.elapsed().as_secs_f64());
        }
        dev.host_access(dst, bytes, false).map_err(|e| e.to_string())?;
        Ok(bytes as f64 / best / 1e9)
    };
    let result = (|| {
        // SAFETY: both ranges stay mapped until after the device is dropped.
        unsafe { dev.register_host(slots_ptr, slots_len) }.map_err(|e| e.to_string())?;
        unsafe { dev.register_host(plain, bytes) }.map_err(|e| e.to_string())?;
        let (mut s, mut p) = (0f64, 0f64);
        // Alternate, so that neither gets the warmer caches or clocks.
        for _ in 0..2 {
            s = s.max(time(&mut dev, slot)?);
            p = p.max(time(&mut dev, plain)?);
        }
        Ok::<_, String>((bytes, s, p))
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
pub fn drafter_step_flops(c: &DrafterConfig, t: usize, anchors: &[usize], supervised_rows: usize) -> f64 {
    let (h, qd, kd, inter) = (c.hidden as f64, (c.q_heads * c.head_dim) as f64, (c.kv_heads * c.head_dim) as f64, c.intermediate as f64);
    let (t, m) = (t as f64, (anchors.len() * c.block_size) as f64);
    let fc = 2.0 * t * (c.n_taps as f64 * h) * h * 2.0;
    let layer_gemm = 2.0 * (m * h * qd + 2.0 * (t + m) * h * kd + m * qd * h + 3.0 * m * h * inter) * 3.0;
    // Each block row sees the context before its anchor and its own block.
    let keys: f64 = anchors.iter().map(|&a| (a + c.block_size) as f64 * c.block_size as f64).sum();
    let attn = 2.0 * 2.0 * keys * qd * 3.0;
    let lm_head = 2.0 * supervised_rows as f64 * h * c.vocab as f64 * 2.0;
    fc + c.layers as f64 * (layer_gemm + attn) + lm_head
}

/// A built-in shape `qwen3:HIDDENxLAYERS` (heads of 64, a quarter as many KV heads, MLP
/// 3× hidden, vocabulary 8192), written as a random checkpoint into `dir`.
pub fn shape_config(spec: &str) -> Result<String, String> {
    let err = || format!("--target {spec}: expected a model directory or a shape like qwen3:768x5");
    let rest = spec.strip_prefix("qwen3:").ok_or_else(err)?;
    let (h, l) = rest.split_once('x').ok_or_else(err)?;
    let (h, l): (usize, usize) = (h.parse().map_err(|_| err())?, l.parse().map_err(|_| err())?);
    if h == 0 || h % 64 != 0 || l == 0 {
        return Err(format!("--target {spec}: hidden must be a positive multiple of 64 and layers positive"));
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

pub fn run(target: &str, tokens: usize, json: bool) -> Result<(), String> {
    let tmp;
    let (dir, shape): (PathBuf, String) = if Path::new(target).is_dir() {
        (PathBuf::from(target), target.to_string())
    } else {
        let cfg = shape_config(target)?;
        tmp = std::env::temp_dir().join(format!("dflash-bench-ops-{}", std::process::id()));
        crate::model::tiny::write_random(&tmp, &cfg, 7).map_err(|e| format!("writing the {target} checkpoint: {e}"))?;
        (tmp.clone(), target.to_string())
    };
    let result = measure(&dir, &shape, tokens);
    if dir.starts_with(std::env::temp_dir()) && !Path::new(target).is_dir() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let f = result?;
    if json {
        println!("{}", serde_json::to_string(&f).map_err(|e| e.to_string())?);
    } else {
        print_figures(&f);
    }
    Ok(())
}

pub fn print_figures(f: &Figures) {
    println!("bench compute: backend {} ({} threads), target {}, {} tokens", f.backend, f.threads, f.shape, f.tokens);
    match (&f.device, &f.device_note) {
        (Some(d), _) => {
            let mfu = d.mfu.map_or("MFU: peak unknown for this device".to_string(), |m| format!("{:.1} % MFU of {:.0} TFLOP/s bf16", m * 100.0, d.peak_bf16_tflops.unwrap_or(0.0)));
            println!("  device {}: target forward {:.0} tokens/s, {:.2} TFLOP/s, {mfu}; {:.1}x the CPU backend", d.name, d.target_tokens_per_s, d.target_tflops, d.vs_cpu);
            let dmfu = d.drafter_mfu.map_or(String::new(), |m| format!(", {:.1} % MFU (goal >= 35 %)", m * 100.0));
            println!("    drafter step {:.3} s, {:.2} TFLOP/s{dmfu}; optimizer {:.2} ms", d.drafter_step_s, d.drafter_tflops, d.optimizer_ms);
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
        (None, note) => println!("  no GPU measured ({}): the figures below are the CPU backend's", note.as_deref().unwrap_or("none")),
    }
    println!("  target forward (CPU worker) {:>7.0} tokens/s  {:>7.2} GFLOP/s  ({:.3} s)", f.target_tokens_per_s, f.target_gflops, f.target_forward_s);
    println!("  bare GEMM, same shapes    {:>27.2} GFLOP/s", f.gemm_gflops);
    println!("  forward / GEMM            {:>9.2}   (goal >= 0.7)", f.forward_vs_gemm);
    for (op, s) in &f.op_seconds {
        println!("    {op:<12} {:>8.1} ms  {:>5.1} %", s * 1e3, 100.0 * s / f.target_forward_s.max(1e-12));
    }
    println!("  reference target forward  {:>27.2} GFLOP/s  ({:.3} s)", f.reference_gflops, f.reference_forward_s);
    println!(
        "  drafter step ({} layers, {} block rows)  {:>9.0} tokens/s  ({:.3} s)",
        f.drafter_layers, f.drafter_rows, f.drafter_tokens_per_s, f.drafter_step_s
    );
    let mut ops: Vec<_> = f.drafter_op_seconds.iter().collect();
    ops.sort_by(|a, b| b.1.total_cmp(a.1));
    for (op, s) in ops.into_iter().take(6) {
        println!("    {op:<16} {:>8.1} ms  {:>5.1} %", s * 1e3, 100.0 * s / f.drafter_step_s.max(1e-12));
    }
    println!("  shared-memory all-reduce of its gradient, 2 ranks  {:>7.2} ms  ({:.2} GB/s)", f.shm_all_reduce_ms, f.shm_all_reduce_gb_s);
}

fn measure(dir: &Path, shape: &str, tokens: usize) -> Result<Figures, String> {
    let cfg = TargetConfig::load(dir).map_err(|e| e.to_string())?;
    let layers = cfg.num_hidden_layers;
    let target = Target::load(dir, &[layers - 1]).map_err(|e| e.to_string())?;
    let mut rng = Rng::new(1);
    let ids: Vec<u32> = (0..tokens).map(|_| rng.below(cfg.vocab_size as u64) as u32).collect();
    let cpu = Cpu::new();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);

    // Warm up (page in the weights, start the thread pool), then the best of three.
    target.forward_taps(&ids[..tokens.min(64)]);
    let mut best = f64::INFINITY;
    let mut op_times = OpTimes::default();
    for _ in 0..3 {
        let mut times = OpTimes::default();
        let t0 = Instant::now();
        std::hint::black_box(target.forward_taps_timed(&ids, Some(&mut times)));
        let s = t0.elapsed().as_secs_f64();
        if s < best {
            best = s;
            op_times = times;
        }
    }
    let (t, h, hd, inter) = (tokens, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (qd, kd) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    // The forward's GEMMs (m = tokens): q, k, v, o, gate, up, down.
    let gemms = [(h, qd), (h, kd), (h, kd), (qd, h), (h, inter), (h, inter), (inter, h)];
    let gemm_flops: f64 = gemms.iter().map(|&(k, n)| 2.0 * (t * k * n) as f64).sum::<f64>() * layers as f64;
    // Causal attention: QKᵀ and PV over t(t+1)/2 pairs per head.
    let attn_flops = 2.0 * 2.0 * (t * (t + 1) / 2) as f64 * qd as f64 * layers as f64;
    let model_flops = gemm_flops + attn_flops;

    // The baseline: the same GEMMs, bare, on random operands.
    let mut operands = Vec::new();
    for &(k, n) in &gemms {
        let x: Vec<f32> = (0..t * k).map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5).collect();
        let w: Vec<f32> = (0..n * k).map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5).collect();
        operands.push((x, w, vec![0f32; t * n], k, n));
    }
    let mut gemm_best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = Instant::now();
        for _ in 0..layers {
            for (x, w, y, k, n) in operands.iter_mut() {
                cpu.matmul(x, w, y, t, *k, *n);
            }
        }
        gemm_best = gemm_best.min(t0.elapsed().as_secs_f64());
    }
    let reference_gflops = model_flops / best / 1e9;
    let gemm_gflops = gemm_flops / gemm_best / 1e9;

    // The forward as a CPU target worker runs it: the device target on the CPU device, its
    // kernels and GEMMs timed by the device.
    let mut worker = crate::gpu::target::GpuTarget::new(Box::new(crate::gpu::cpu::CpuDevice::new()), &target, tokens).map_err(|e| e.to_string())?;
    worker.forward_taps(&ids[..tokens.min(64)]).map_err(|e| e.to_string())?;
    let mut worker_best = f64::INFINITY;
    let mut worker_ops = Vec::new();
    for _ in 0..3 {
        worker.take_kernel_seconds();
        let t0 = Instant::now();
        std::hint::black_box(worker.forward_taps(&ids).map_err(|e| e.to_string())?);
        let s = t0.elapsed().as_secs_f64();
        if s < worker_best {
            worker_best = s;
            worker_ops = worker.take_kernel_seconds();
        }
    }
    drop(worker);
    let target_gflops = model_flops / worker_best / 1e9;
    // Kernel names as the op names of the reference's breakdown.
    let mut op_seconds = BTreeMap::new();
    for (k, v) in worker_ops {
        let op = match k.as_str() {
            "gemm" => "matmul",
            "attention_fwd" => "attention",
            "rmsnorm_fwd" => "rmsnorm",
            "swiglu_fwd" => "swiglu",
            "add_inplace" => "residual",
            "embed_gather" => "embed",
            "copy_cols" => "taps",
            other => other,
        };
        *op_seconds.entry(op.to_string()).or_insert(0.0) += v;
    }

    // One drafter step (2 layers, blocks of 16, up to 64 anchors) on the target's taps.
    let dcfg = DrafterConfig::for_target(&cfg, 2, 1, 16, 64);
    let drafter = Drafter::new(dcfg.clone());
    let p = drafter.init_params(3);
    let w = Weights::open(dir).map_err(|e| e.to_string())?;
    let embed = w.get("model.embed_tokens.weight", &[cfg.vocab_size, h]).map_err(|e| e.to_string())?;
    let lm_head = if w.contains("lm_head.weight") { w.get("lm_head.weight", &[cfg.vocab_size, h]).map_err(|e| e.to_string())? } else { embed.clone() };
    let frozen = Frozen { embed, lm_head };
    let taps = target.forward_taps(&ids);
    let mask = vec![1u8; tokens];
    let anchors = drafter.sample_anchors(&mask, &mut rng);
    let sample = Sample { taps: &taps, ids: &ids, mask: &mask };
    // The step as a CPU drafter worker runs it: the device model on the CPU device.
    let mut cpu_model = crate::gpu::drafter::GpuDrafter::new(Box::new(crate::gpu::cpu::CpuDevice::new()), &drafter, &frozen, tokens).map_err(|e| e.to_string())?;
    let zeros = vec![0f32; p.len()];
    cpu_model.load(&p, &zeros, &zeros, 0).map_err(|e| e.to_string())?;
    let mut grads = vec![0f32; p.len()];
    let mut drafter_s = f64::INFINITY;
    let mut drafter_op_seconds = BTreeMap::new();
    for _ in 0..2 {
        cpu_model.take_kernel_seconds();
        let t0 = Instant::now();
        cpu_model.train_batch(std::slice::from_ref(&sample), std::slice::from_ref(&anchors), 1.0, &mut grads).map_err(|e| e.to_string())?;
        let s = t0.elapsed().as_secs_f64();
        if s < drafter_s {
            drafter_s = s;
            drafter_op_seconds = cpu_model.take_kernel_seconds().into_iter().collect();
        }
    }
    drop(cpu_model);
    let (shm_all_reduce_ms, shm_all_reduce_gb_s) = measure_shm_all_reduce(p.len())?;

    let supervised = anchors.iter().map(|&a| (1..dcfg.block_size).filter(|&k| drafter.slot_weight(a, k, &mask) > 0.0).count()).sum();
    let dc = DrafterCase { drafter: &drafter, frozen: &frozen, params: &p, sample, anchors: &anchors, flops: drafter_step_flops(&dcfg, tokens, &anchors, supervised) };
    let (device, device_note) = match measure_device(&target, &ids, model_flops, tokens as f64 / best, &dc) {
        Ok(Some(d)) => (Some(d), None),
        Ok(None) => (None, Some(crate::gpu::cuda::missing_library().unwrap_or_default())),
        Err(e) => (None, Some(format!("the device could not be measured: {e}"))),
    };
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
        reference_forward_s: best,
        reference_gflops,
        reference_op_seconds: op_times.secs.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        drafter_step_s: drafter_s,
        drafter_tokens_per_s: tokens as f64 / drafter_s,
        drafter_layers: dcfg.layers,
        drafter_rows: anchors.len() * dcfg.block_size,
        drafter_op_seconds,
        shm_all_reduce_ms,
        shm_all_reduce_gb_s,
    })
}
