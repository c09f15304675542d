//! `bench kernels`' text output: the kernels' table, then the model with its assumptions.

use super::occupancy::Limiter;
use super::roofline::{Bound, KernelModel, Model, Workload};
use super::{KernelRow, Report};

fn ratio(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.1}"))
}

fn limiter(l: Limiter) -> &'static str {
    match l {
        Limiter::Registers => "registers",
        Limiter::SharedMemory => "shared",
        Limiter::Warps => "warps",
        Limiter::Blocks => "blocks",
    }
}

fn row(r: &KernelRow) {
    let inner = r.innermost_mma_loop.map_or("-".into(), |l| {
        format!("{} / {:.1}", l.mma, l.non_mma_per_mma())
    });
    println!(
        "  {:<20} {:<6} {:>4} {:>7} {:>5} {:>5} {:>7} {:>5} {:>3} {:<13} {:>4} {:>4} {:>9} {:>6} {:>12}",
        r.name,
        r.arch,
        r.registers,
        r.shared_bytes,
        r.stack_bytes,
        r.local_bytes,
        format!("{}/{}", r.local_loads, r.local_stores),
        r.block_threads,
        r.warps_per_sm,
        format!("({})", limiter(r.limited_by)),
        r.mma_total,
        r.mma_in_main_loop,
        ratio(r.non_mma_per_mma),
        ratio(r.mufu_per_mma),
        inner,
    );
}

fn workload(w: &Workload) {
    let shares: Vec<String> = w
        .bound_shares
        .iter()
        .map(|(b, s)| format!("{} {:.0}%", b.describe(), s * 100.0))
        .collect();
    println!(
        "  {:<58} {:>9.2} ms  MFU {:>5.1}% (modelled)  attention {:>3.0}% of the time  bound: {}",
        w.name,
        w.seconds * 1e3,
        w.mfu * 100.0,
        w.attention_share * 100.0,
        shares.join(", ")
    );
    for o in &w.ops {
        let rate = if o.flops > 0.0 {
            format!("at {:>5.1}% of peak", o.efficiency * 100.0)
        } else {
            "no FLOPs".into()
        };
        println!(
            "      {:<52} {:>9.3} ms  {:>8.1} TFLOP  {:>8.2} GB  {rate}  bound: {}",
            o.name,
            o.seconds * 1e3,
            o.flops / 1e12,
            o.bytes / 1e9,
            o.bound.describe(),
        );
    }
}

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.1}%", x * 100.0)
    } else {
        "-".into()
    }
}

fn kernel(k: &KernelModel) {
    let (c, e) = (&k.code, &k.ceilings);
    println!(
        "  {:<28} {:>5.1} non-MMA and {:.2} MUFU per MMA, {} warps/SM, {:.1} shared-memory bytes per MMA",
        k.kernel, c.non_mma_per_mma, c.mufu_per_mma, c.warps_per_sm, c.smem_bytes_per_mma
    );
    println!(
        "  {:<28} ceilings: mma.sync {}, issue {}, MUFU {}, shared memory {} -> {} of peak, bound: {}",
        "",
        pct(e.mma_sync),
        pct(e.issue),
        pct(e.mufu),
        pct(e.shared_memory),
        pct(k.efficiency),
        k.bound.describe()
    );
}

fn model(m: &Model) {
    println!(
        "model: {} at Qwen3-8B's shapes, from the sm_90 figures and the kernels' tiles (a model: scripts/gpu_check.sh measures it on a GPU)",
        m.hardware.name
    );
    for k in m.attention.iter().chain(std::iter::once(&m.moe_gemm)) {
        kernel(k);
    }
    for w in m
        .target_forward
        .iter()
        .chain(std::iter::once(&m.drafter_step))
        .chain(&m.moe_layer)
    {
        workload(w);
    }
    let (lo, hi) = m.target_forward_mfu_range;
    let most = |w: Option<&Workload>| w.map_or(Bound::Hbm, |w| w.bound).describe();
    println!(
        "  modelled MFU (a model until scripts/gpu_check.sh measures it): target forward {:.0}-{:.0}% (most of the time {}), drafter step {:.0}% (most of the time {})",
        lo * 100.0,
        hi * 100.0,
        most(m.target_forward.first()),
        m.drafter_step.mfu * 100.0,
        most(Some(&m.drafter_step)),
    );
    println!("  with attention at the goals (<= 4 non-MMA per MMA, 8 warps/SM, the same tiles), all else as now:");
    for (name, mfu) in &m.mfu_with_attention_at_goals {
        println!("      {name:<40} MFU {:>5.1}% (modelled)", mfu * 100.0);
    }
    println!("  assumptions:");
    for a in &m.assumptions {
        println!("    - {a}");
    }
}

pub fn report(r: &Report) {
    println!(
        "bench kernels: kernels.cu by NVRTC {}, read by cuobjdump {}",
        r.nvrtc, r.cuobjdump
    );
    println!(
        "  {:<20} {:<6} {:>4} {:>7} {:>5} {:>5} {:>7} {:>5} {:>3} {:<13} {:>4} {:>4} {:>9} {:>6} {:>12}",
        "kernel",
        "arch",
        "regs",
        "shared",
        "stack",
        "local",
        "LDL/STL",
        "block",
        "w/SM",
        "(limit)",
        "MMA",
        "loop",
        "nonMMA/MMA",
        "MUFU",
        "inner MMA/r"
    );
    for k in &r.kernels {
        row(k);
    }
    println!("  regs: per thread; shared: static bytes per block (with the 1 KB reserved); stack: the ABI stack frame per thread");
    println!("  (where NVRTC puts spills, local arrays and registers saved around calls); local: LOCAL bytes beyond it; LDL/STL: local");
    println!("  loads and stores in the kernel; w/SM: resident warps per SM; MMA: HMMA in the kernel; loop: HMMA in the main loop (the loop with the most);");
    println!("  nonMMA/MMA, MUFU: per MMA in that loop (static: a nested loop's body counts once, so with nested loops a lower bound);");
    println!("  inner: the innermost loop with an MMA (MMA / non-MMA per MMA)");
    for k in r
        .kernels
        .iter()
        .filter(|k| k.main_loop.is_some_and(|l| l.nested_loops > 0))
    {
        let l = k.main_loop.map_or(0, |l| l.nested_loops);
        println!(
            "  {} {}: the main loop holds {l} nested loops",
            k.name, k.arch
        );
    }
    for k in r.kernels.iter().filter(|k| k.spill_bytes > 0) {
        let in_loop = k.main_loop.map_or(String::new(), |l| {
            format!(
                "; in its loops with an MMA {} LDL and {} STL ({} and {} in the main loop)",
                k.local_loads_in_mma_loops,
                k.local_stores_in_mma_loops,
                l.local_loads,
                l.local_stores
            )
        });
        println!(
            "  {} {}: local memory: a {}-byte stack frame and {} bytes LOCAL per thread, {} LDL and {} STL{in_loop}",
            k.name, k.arch, k.stack_bytes, k.local_bytes, k.local_loads, k.local_stores
        );
    }
    if let Some(m) = &r.model {
        model(m);
    }
}
