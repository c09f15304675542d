//! `dflash-worker bench-kernels` (what `dflash-supervise bench kernels` runs): the
//! kernels' machine code read without a GPU. NVRTC compiles `cuda/kernels.cu` to a CUBIN
//! per architecture (sm_80, sm_90, sm_100); cuobjdump (`-res-usage`, and `-sass` through
//! nvdisasm) says per kernel its registers, static shared memory, stack frame and local
//! memory, from which [`occupancy`] gives the resident warps per SM, and the main loop's
//! instruction mix ([`sass`]): tensor-core MMAs and non-MMA instructions per MMA. Spills
//! show as the ABI stack frame (`STACK:`, where NVRTC puts them) and as `LDL`/`STL` in the
//! SASS, counted per kernel and in its main loop. From the sm_90 figures of the attention
//! kernels and their tiles, [`roofline`] models an H200 running Qwen3-8B's target forward
//! and a drafter step, and prints the MFU (a model, until `scripts/gpu_check.sh` measures
//! it) with the bound that binds each op and its assumptions.

pub mod occupancy;
mod print;
pub mod roofline;
pub mod sass;
pub mod tools;

use std::path::PathBuf;

use serde::Serialize;

use crate::device::nvrtc;
pub use tools::KernelBenchError;

pub const ARCHS: [&str; 3] = ["sm_80", "sm_90", "sm_100"];

/// One kernel compiled for one architecture.
#[derive(Debug, Clone, Serialize)]
pub struct KernelRow {
    pub name: String,
    pub arch: String,
    pub registers: u32,
    /// Shared memory of a block: static (cuobjdump's SHARED: with the 1 KB the system
    /// reserves on sm_80+, for a kernel with shared memory) and the dynamic shared memory
    /// it is launched with.
    pub shared_bytes: u32,
    /// Local memory per thread: the ABI stack frame and any `LOCAL` beyond it
    /// (`stack_bytes + local_bytes`). Non-zero when the kernel spills registers, keeps a
    /// local array or saves registers around a call; `local_loads`, `local_stores` and the
    /// main loop's say whether it costs anything where the time goes.
    pub spill_bytes: u32,
    /// cuobjdump's `STACK:`, the ABI stack frame per thread: where NVRTC puts spills.
    pub stack_bytes: u32,
    /// cuobjdump's `LOCAL:`, local memory per thread outside the stack frame.
    pub local_bytes: u32,
    /// `LDL` and `STL` in the kernel's SASS.
    pub local_loads: usize,
    pub local_stores: usize,
    /// `LDL` and `STL` inside the loops that hold an MMA (spills paid per iteration).
    pub local_loads_in_mma_loops: usize,
    pub local_stores_in_mma_loops: usize,
    /// Threads per block as the worker launches it (device/ops/).
    pub block_threads: u32,
    pub warps_per_sm: u32,
    pub limited_by: occupancy::Limiter,
    /// Every HMMA of the kernel.
    pub mma_total: usize,
    pub mma_in_main_loop: usize,
    /// None for a kernel without a loop around an MMA.
    pub non_mma_per_mma: Option<f64>,
    pub mufu_per_mma: Option<f64>,
    pub main_loop: Option<sass::LoopMix>,
    pub innermost_mma_loop: Option<sass::LoopMix>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub nvrtc: String,
    pub cuobjdump: String,
    pub kernels: Vec<KernelRow>,
    /// From the sm_90 figures; None when sm_90 was not analysed.
    pub model: Option<roofline::Model>,
}

/// Threads per block of a kernel as device/ops/ launches it: the FlashAttention-2
/// kernels, the backward's preparation and the experts' grouped GEMM four warps, the other
/// attention kernels, the MoE routing and the permutation's placing one warp, the RMSNorm
/// backward's second stage 32 warps, the rest blocks of 256 (a row kernel's
/// block is up to 256 threads: 256 at these widths).
pub fn block_threads(kernel: &str) -> u32 {
    if kernel == "rmsnorm_bwd_dw" {
        1024
    } else if kernel.starts_with("attention_fa2")
        || kernel == "attention_bwd_prep"
        || kernel.starts_with("moe_gemm")
    {
        128
    } else if kernel.starts_with("attention")
        || kernel == "adam_count"
        || kernel.starts_with("moe_route")
        || kernel == "moe_place"
    {
        32
    } else {
        256
    }
}

/// The tools `analyse` runs.
#[derive(Debug, Clone)]
pub struct Tools {
    pub cuobjdump: PathBuf,
    pub nvdisasm: PathBuf,
}

impl Tools {
    pub fn find() -> Result<Tools, KernelBenchError> {
        Ok(Tools {
            cuobjdump: tools::CUOBJDUMP.find()?,
            nvdisasm: tools::NVDISASM.find()?,
        })
    }
}

/// Compile `src` for `arch` and read every kernel `names` lists from its machine code.
pub fn analyse_arch(
    t: &Tools,
    src: &str,
    arch: &str,
    names: &[String],
) -> Result<Vec<KernelRow>, KernelBenchError> {
    let limits = occupancy::sm_limits(arch).ok_or_else(|| KernelBenchError::Arch(arch.into()))?;
    let (compiled, _) =
        nvrtc::compile_cached(src, arch, &nvrtc::cache_dir()).map_err(|source| {
            KernelBenchError::Nvrtc {
                arch: arch.into(),
                source,
            }
        })?;
    let cubin = std::env::temp_dir().join(format!(
        "dflash-bench-kernels-{}-{arch}.cubin",
        std::process::id()
    ));
    std::fs::write(&cubin, &compiled.cubin).map_err(|source| KernelBenchError::Cubin {
        arch: arch.into(),
        source,
    })?;
    let res = tools::cuobjdump(&t.cuobjdump, Some(&t.nvdisasm), &["-res-usage"], &cubin);
    let sass_text = tools::cuobjdump(&t.cuobjdump, Some(&t.nvdisasm), &["-sass"], &cubin);
    let _ = std::fs::remove_file(&cubin);
    let res = sass::parse_res_usage(&res?);
    let code = sass::parse_sass(&sass_text?);
    let missing = |what, kernel: &String| KernelBenchError::Missing {
        arch: arch.into(),
        what,
        kernel: kernel.clone(),
    };
    let mut rows = Vec::new();
    for name in names {
        let r = res.get(name).ok_or_else(|| missing("-res-usage", name))?;
        let insns = code.get(name).ok_or_else(|| missing("-sass", name))?;
        let threads = block_threads(name);
        // Static shared memory as the CUBIN says (with the system's 1 KB once there is
        // any) and the dynamic shared memory device/ops/ launches it with.
        let dynamic = crate::device::ops::kernel::Kernel::dynamic_shared_bytes_of(name);
        let shared = if dynamic > 0 {
            r.shared.max(limits.reserved_per_block) + dynamic
        } else {
            r.shared
        };
        let (warps, limited_by) = occupancy::warps_per_sm(&limits, r.registers, shared, threads);
        let loops = sass::mma_loops(insns);
        let (local_loads, local_stores) = sass::local_accesses(insns);
        let (local_loads_in_mma_loops, local_stores_in_mma_loops) =
            sass::local_accesses_in_mma_loops(insns);
        let main = loops.map(|l| l.0);
        rows.push(KernelRow {
            name: name.clone(),
            arch: arch.into(),
            registers: r.registers,
            shared_bytes: shared,
            spill_bytes: r.stack + r.local,
            stack_bytes: r.stack,
            local_bytes: r.local,
            local_loads,
            local_stores,
            local_loads_in_mma_loops,
            local_stores_in_mma_loops,
            block_threads: threads,
            warps_per_sm: warps,
            limited_by,
            mma_total: insns.iter().filter(|i| i.op == "HMMA").count(),
            mma_in_main_loop: main.map_or(0, |m| m.mma),
            non_mma_per_mma: main.map(|m| m.non_mma_per_mma()),
            mufu_per_mma: main.map(|m| m.mufu as f64 / m.mma as f64),
            main_loop: main,
            innermost_mma_loop: loops.map(|l| l.1),
        });
    }
    Ok(rows)
}

/// The attention forward device/ops/ chooses at `head_dim` and activation type `act`
/// (aligned buffers): the GPU target's at bf16, the drafter's at f32.
pub fn attention_kernel(head_dim: usize, act: crate::device::ops::kernel::DType) -> &'static str {
    use crate::device::ops::attention::AttentionKernel;
    use crate::device::ops::{Attention, Fa2Dim};
    let a = Attention::shape_of(1, 1, 1, head_dim);
    match Fa2Dim::for_call(&a) {
        Some(dim) => AttentionKernel::Fa2Fwd { act, dim, a }.name(),
        None => AttentionKernel::Fwd { act, a }.name(),
    }
}

/// The attention backward device/ops/ chooses at `head_dim` (aligned buffers).
pub fn attention_backward_kernel(head_dim: usize) -> &'static str {
    use crate::device::ops::attention::AttentionKernel;
    use crate::device::ops::{Attention, AttentionGrad, Fa2Dim};
    let fwd = Attention::shape_of(1, 1, 1, head_dim);
    let g = AttentionGrad {
        fwd,
        dout: fwd.out,
        dq: fwd.out,
        dk: fwd.out,
        dv: fwd.out,
    };
    match Fa2Dim::for_backward(&g) {
        Some(dim) => AttentionKernel::Fa2Bwd {
            dim,
            g,
            s: crate::device::ops::BwdScratch::at(fwd.out, 1, 1, head_dim),
            tk: 1,
        }
        .name(),
        None => AttentionKernel::Bwd(g).name(),
    }
}

/// The tensor-core figures the model takes (attention's, the grouped GEMM's), from an
/// sm_90 row and the kernel's tiles.
fn attention_code(rows: &[KernelRow], name: &str) -> roofline::AttentionCode {
    let r = rows.iter().find(|r| r.arch == "sm_90" && r.name == name);
    roofline::AttentionCode {
        non_mma_per_mma: r.and_then(|r| r.non_mma_per_mma).unwrap_or(f64::NAN),
        mufu_per_mma: r.and_then(|r| r.mufu_per_mma).unwrap_or(0.0),
        warps_per_sm: r.map_or(0.0, |r| r.warps_per_sm as f64),
        smem_bytes_per_mma: roofline::smem_bytes_per_mma(name).unwrap_or(0.0),
    }
}

/// Every kernel of kernels.cu for each of `archs`, and the model.
pub fn analyse(t: &Tools, archs: &[String]) -> Result<Report, KernelBenchError> {
    let names = nvrtc::kernel_names(nvrtc::KERNELS_CU);
    let mut kernels = Vec::new();
    for arch in archs {
        kernels.extend(analyse_arch(t, nvrtc::KERNELS_CU, arch, &names)?);
    }
    let model = archs.iter().any(|a| a == "sm_90").then(|| {
        use crate::device::ops::kernel::DType;
        let hd = roofline::qwen3_8b().head_dim as usize;
        let (target, drafter, bwd) = (
            attention_kernel(hd, DType::Bf16),
            attention_kernel(hd, DType::F32),
            attention_backward_kernel(hd),
        );
        roofline::model(
            (target, attention_code(&kernels, target)),
            (drafter, attention_code(&kernels, drafter)),
            (bwd, attention_code(&kernels, bwd)),
            ("moe_gemm_bf16", attention_code(&kernels, "moe_gemm_bf16")),
        )
    });
    let nvrtc = nvrtc::version().map_or_else(|e| e.to_string(), |(a, b)| format!("{a}.{b}"));
    let version = std::process::Command::new(&t.cuobjdump)
        .arg("--version")
        .output();
    let cuobjdump = version
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout).lines().find_map(|l| {
                l.split_once("release ")
                    .map(|(_, v)| v.split(',').next().unwrap_or(v).to_string())
            })
        })
        .unwrap_or_else(|| "version unknown".into());
    Ok(Report {
        nvrtc,
        cuobjdump,
        kernels,
        model,
    })
}

/// `bench-kernels [--arch A,B] [--json]`.
pub fn run(archs: &[String], json: bool) -> Result<(), KernelBenchError> {
    let archs: Vec<String> = if archs.is_empty() {
        ARCHS.iter().map(|a| a.to_string()).collect()
    } else {
        archs.to_vec()
    };
    if let Some(bad) = archs.iter().find(|a| !ARCHS.contains(&a.as_str())) {
        return Err(KernelBenchError::Arch(bad.clone()));
    }
    let tools = Tools::find()?;
    let report = analyse(&tools, &archs)?;
    if json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(KernelBenchError::Json)?
        );
    } else {
        print::report(&report);
    }
    Ok(())
}
