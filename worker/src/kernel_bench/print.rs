//! `bench kernels`' text output: the kernels' table, then the model with its assumptions.

use super::occupancy::Limiter;
use super::roofline::{Model, Workload};
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
        "  {:<20} {:<6} {:>4} {:>7} {:>5} {:>5} {:>3} {:<13} {:>4} {:>4} {:>9} {:>6} {:>12}",
        r.name,
        r.arch,
        r.registers,
        r.shared_bytes,
        r.spill_bytes,
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
    println!(
        "  {:<58} {:>9.2} ms  MFU {:>5.1}%  attention {:>3.0}% of the time",
        w.name,
        w.seconds * 1e3,
        w.mfu * 100.0,
        w.attention_share * 100.0
    );
    for o in &w.ops {
        let rate = if o.flops > 0.0 {
            format!("at {:>5.1}% of peak", o.efficiency * 100.0)
        } else {
            "HBM-bound".into()
        };
        println!(
            "      {:<40} {:>9.3} ms  {:>8.1} TFLOP  {:>8.2} GB  {rate}",
            o.name,
            o.seconds * 1e3,
            o.flops / 1e12,
            o.bytes / 1e9,
        );
    }
}

fn model(m: &Model) {
    println!(
        "model: {} at Qwen3-8B's shapes, from the sm_90 figures",
        m.hardware.name
    );
    for (name, code, eff) in &m.attention {
        println!(
            "  {name:<20} {:>6.1} non-MMA and {:.2} MUFU per MMA, {} warps/SM -> {:.2}% of peak",
            code.non_mma_per_mma,
            code.mufu_per_mma,
            code.warps_per_sm,
            eff * 100.0
        );
    }
    let (name, code, eff) = &m.moe_gemm;
    println!(
        "  {name:<20} {:>6.1} non-MMA per MMA, {} warps/SM, {:.0} shared-memory bytes per MMA -> {:.2}% of peak",
        code.non_mma_per_mma,
        code.warps_per_sm,
        super::roofline::MOE_GEMM_SMEM_BYTES_PER_MMA,
        eff * 100.0
    );
    for w in m
        .target_forward
        .iter()
        .chain(std::iter::once(&m.drafter_step))
        .chain(&m.moe_layer)
    {
        workload(w);
    }
    println!("  with attention at the goals (<= 4 non-MMA per MMA, 8 warps/SM), all else as now:");
    for (name, mfu) in &m.mfu_with_attention_at_goals {
        println!("      {name:<40} MFU {:>5.1}%", mfu * 100.0);
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
        "  {:<20} {:<6} {:>4} {:>7} {:>5} {:>5} {:>3} {:<13} {:>4} {:>4} {:>9} {:>6} {:>12}",
        "kernel",
        "arch",
        "regs",
        "shared",
        "spill",
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
    println!("  regs: per thread; shared: static bytes per block (with the 1 KB reserved); spill: local bytes per thread;");
    println!("  w/SM: resident warps per SM; MMA: HMMA in the kernel; loop: HMMA in the main loop (the loop with the most);");
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
    if let Some(m) = &r.model {
        model(m);
    }
}
