//! A roofline model of an H200 running the target forward and the drafter step at
//! Qwen3-8B's shapes, with the attention kernels' efficiency taken from their machine code
//! ([`attention_efficiency`]) and every other figure an assumption printed with it
//! ([`Model::assumptions`]).
//!
//! Each op takes max(hardware FLOPs / (efficiency · peak), bytes / (HBM fraction · HBM
//! bandwidth)); a workload's time is the sum of its ops (no overlap between kernels); its
//! MFU is its model FLOPs (the GEMMs' 2·m·n·k and attention's 4·keys·head dim per row
//! and head, forward; backward twice that) over time · peak.

use serde::Serialize;

/// The machine. H200 SXM: 989 TFLOP/s dense bf16 (the H100's tensor cores), 4.8 TB/s HBM3e.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Hardware {
    pub name: &'static str,
    pub peak_bf16_flops: f64,
    pub hbm_bytes_per_s: f64,
    /// The share of the dense peak an mma.sync (HMMA) kernel reaches at best on sm_90:
    /// the peak needs wgmma; FlashAttention-2 (mma.sync) tops out near this on H100.
    pub mma_sync_ceiling: f64,
    /// cuBLAS's large bf16 GEMMs (ours are m ≥ 4096, n, k ≥ 1024), share of the peak.
    pub gemm_efficiency: f64,
    /// Share of the HBM bandwidth a streaming elementwise kernel reaches.
    pub hbm_efficiency: f64,
    /// Warps per scheduler (4 per SM) needed to issue every cycle in dependent code.
    pub warps_to_hide_latency: f64,
    /// Cycles of a scheduler's tensor pipe per m16n8k16 MMA at the dense peak (4,096 FLOP;
    /// 1,024 FLOP per scheduler per cycle).
    pub mma_cycles_at_peak: f64,
    /// Cycles per warp-wide MUFU instruction (16 lanes per SM, 4 per scheduler).
    pub mufu_cycles: f64,
}

pub const H200: Hardware = Hardware {
    name: "H200 SXM (sm_90)",
    peak_bf16_flops: 989e12,
    hbm_bytes_per_s: 4.8e12,
    mma_sync_ceiling: 0.67,
    gemm_efficiency: 0.70,
    hbm_efficiency: 0.80,
    warps_to_hide_latency: 2.0,
    mma_cycles_at_peak: 4.0,
    mufu_cycles: 8.0,
};

/// Qwen3-8B and the drafter trained on it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Shapes {
    pub hidden: f64,
    pub q_heads: f64,
    pub kv_heads: f64,
    pub head_dim: f64,
    pub layers: f64,
    pub intermediate: f64,
    pub vocab: f64,
    /// DFlash's drafter depth for a 36-layer target (default_draft_layers: 5), also its taps.
    pub drafter_layers: f64,
    pub anchors: usize,
    pub block: usize,
    /// Context tokens of a drafter step (a run's 4096-token batch).
    pub drafter_context: usize,
}

pub fn qwen3_8b() -> Shapes {
    let layers = 36;
    Shapes {
        hidden: 4096.0,
        q_heads: 32.0,
        kv_heads: 8.0,
        head_dim: 128.0,
        layers: layers as f64,
        intermediate: 12288.0,
        vocab: 151_936.0,
        drafter_layers: dflash_shared::model_config::default_draft_layers(layers) as f64,
        anchors: 512,
        block: 16,
        drafter_context: 4096,
    }
}

/// A mixture-of-experts layer's MLP: Qwen3-30B-A3B's (and Qwen3-Coder-30B-A3B's).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MoeShapes {
    pub hidden: f64,
    pub experts: f64,
    pub top_k: f64,
    pub expert_width: f64,
}

pub fn qwen3_30b_a3b() -> MoeShapes {
    MoeShapes {
        hidden: 2048.0,
        experts: 128.0,
        top_k: 8.0,
        expert_width: 768.0,
    }
}

/// Shared-memory bytes the grouped GEMM (`moe_gemm_bf16`) reads per MMA: a warp's 32 × 64
/// tile takes, per k-step of 16, 2 A and 4 B `ldmatrix.x4` (512 bytes each) for its 16
/// MMAs.
pub const MOE_GEMM_SMEM_BYTES_PER_MMA: f64 = 6.0 * 512.0 / 16.0;
/// An SM's shared-memory bandwidth (bytes per cycle) and its m16n8k16 MMAs per cycle at
/// the dense peak (4 schedulers, one per mma_cycles_at_peak cycles each).
pub const SMEM_BYTES_PER_CYCLE: f64 = 128.0;

/// Share of the dense peak of the grouped GEMM: what its machine code allows
/// ([`attention_efficiency`]: issue, occupancy, the mma.sync ceiling), and at most what
/// shared memory can feed its MMAs ([`MOE_GEMM_SMEM_BYTES_PER_MMA`]).
pub fn moe_gemm_efficiency(hw: &Hardware, c: &AttentionCode) -> f64 {
    let mma_per_cycle_at_peak = 4.0 / hw.mma_cycles_at_peak;
    let smem = SMEM_BYTES_PER_CYCLE / (MOE_GEMM_SMEM_BYTES_PER_MMA * mma_per_cycle_at_peak);
    attention_efficiency(hw, c).min(smem)
}

/// Row tile of the grouped GEMM (`MOE_BM` in kernels.cu): an expert's last tile is on
/// average half empty, and those rows are computed all the same.
const MOE_GEMM_TILE_ROWS: f64 = 64.0;

/// One sparse MLP over `t` tokens as the device route runs it: the router GEMM; the
/// routing (`moe_route`); the permutation (`moe_count`, `moe_scan`, `moe_place`); the
/// experts' gate+up and down projections as one grouped GEMM each (`moe_gemm_bf16`, at
/// `gemm`'s efficiency), reading the normed rows through the permutation (no gathered
/// copy), every expert's weights read once (at these token counts each expert has rows),
/// each expert's last row tile half empty on average; the SwiGLU over the routed rows; the
/// weighted sum (`moe_combine`). Model FLOPs: the GEMMs' over the routed rows (2 per
/// multiply-add).
pub fn moe_layer(hw: &Hardware, m: &MoeShapes, t: usize, gemm: &AttentionCode) -> Workload {
    let (tf, h, e, k, w) = (t as f64, m.hidden, m.experts, m.top_k, m.expert_width);
    let rows = tf * k;
    let padded = rows + e * MOE_GEMM_TILE_ROWS / 2.0;
    let eff = moe_gemm_efficiency(hw, gemm);
    let experts = |name: &str, n_in: f64, n_out: f64| {
        let bytes = 2.0 * (e * n_in * n_out + rows * n_in + rows * n_out);
        let (f, model) = (2.0 * padded * n_in * n_out, 2.0 * rows * n_in * n_out);
        op(hw, name, f, model, bytes, eff)
    };
    let chunks = (rows / 256.0).ceil();
    let ops = vec![
        gemm_op(hw, "gemm router", 1.0, tf, h, e, 1.0),
        // Logits read (bf16), experts and weights written (i32, f32).
        op(hw, "moe route", 0.0, 0.0, 2.0 * tf * e + 8.0 * rows, 1.0),
        // The experts read twice (count, place), the counts per chunk written, read twice
        // and written by the scan, read by the place; rows and slots written (i32).
        op(
            hw,
            "moe permute (count, scan, place)",
            0.0,
            0.0,
            8.0 * rows + 5.0 * 4.0 * chunks * e + 8.0 * rows,
            1.0,
        ),
        experts("moe grouped gemm gate+up", h, 2.0 * w),
        op(
            hw,
            "swiglu (routed rows)",
            0.0,
            0.0,
            3.0 * 2.0 * rows * w,
            1.0,
        ),
        experts("moe grouped gemm down", w, h),
        op(
            hw,
            "moe combine",
            0.0,
            0.0,
            2.0 * rows * h + 8.0 * rows + 2.0 * tf * h,
            1.0,
        ),
    ];
    workload(hw, format!("MoE layer, {t} tokens"), ops)
}

/// What the machine code of an attention kernel says (sm_90).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct AttentionCode {
    pub non_mma_per_mma: f64,
    pub mufu_per_mma: f64,
    pub warps_per_sm: f64,
}

/// The issue's goals for the attention kernels: ≤ 4 non-MMA instructions per MMA, 8
/// warps per SM; a FlashAttention-2 tile of 64 keys at head dim 128 has 1 exp2 per 4 MMAs.
pub const ATTENTION_AT_GOALS: AttentionCode = AttentionCode {
    non_mma_per_mma: 4.0,
    mufu_per_mma: 0.25,
    warps_per_sm: 8.0,
};

/// Share of the dense peak: a scheduler needs max(tensor, issue, MUFU) cycles per MMA:
/// tensor mma_cycles_at_peak / mma_sync_ceiling; issue (1 + non-MMA per MMA) / (its
/// share of cycles it can issue in: warps per scheduler / warps_to_hide_latency, at most
/// 1); MUFU mufu_per_mma · mufu_cycles. The MMA does mma_cycles_at_peak's work.
pub fn attention_efficiency(hw: &Hardware, c: &AttentionCode) -> f64 {
    let issue_share = (c.warps_per_sm / 4.0 / hw.warps_to_hide_latency).min(1.0);
    if issue_share <= 0.0 || !c.non_mma_per_mma.is_finite() {
        return 0.0;
    }
    let cycles = (hw.mma_cycles_at_peak / hw.mma_sync_ceiling)
        .max((1.0 + c.non_mma_per_mma) / issue_share)
        .max(c.mufu_per_mma * hw.mufu_cycles);
    hw.mma_cycles_at_peak / cycles
}

/// One op of a workload, all its launches together.
#[derive(Debug, Clone, Serialize)]
pub struct Op {
    pub name: String,
    /// What the hardware computes (e.g. the backward's recomputed scores).
    pub flops: f64,
    /// What MFU counts.
    pub model_flops: f64,
    pub bytes: f64,
    /// Share of the peak its FLOPs run at.
    pub efficiency: f64,
    pub seconds: f64,
}

fn op(hw: &Hardware, name: &str, flops: f64, model_flops: f64, bytes: f64, efficiency: f64) -> Op {
    let compute = if flops > 0.0 {
        flops / (efficiency.max(1e-9) * hw.peak_bf16_flops)
    } else {
        0.0
    };
    let memory = bytes / (hw.hbm_efficiency * hw.hbm_bytes_per_s);
    Op {
        name: name.into(),
        flops,
        model_flops,
        bytes,
        efficiency,
        seconds: compute.max(memory),
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    pub name: String,
    pub ops: Vec<Op>,
    pub model_flops: f64,
    pub seconds: f64,
    pub mfu: f64,
    /// Attention's share of the time.
    pub attention_share: f64,
}

fn workload(hw: &Hardware, name: String, ops: Vec<Op>) -> Workload {
    let model_flops: f64 = ops.iter().map(|o| o.model_flops).sum();
    let seconds: f64 = ops.iter().map(|o| o.seconds).sum();
    // From +0 (an empty f64 sum is -0, printed "-0%" for a workload without attention).
    let attention: f64 = ops
        .iter()
        .filter(|o| o.name.starts_with("attention"))
        .fold(0.0, |a, o| a + o.seconds);
    Workload {
        name,
        model_flops,
        seconds,
        mfu: model_flops / (seconds * hw.peak_bf16_flops),
        attention_share: attention / seconds,
        ops,
    }
}

/// A GEMM of every layer: `m` rows, `k` in, `n` out, bf16 weights and activations.
fn gemm_op(hw: &Hardware, name: &str, layers: f64, m: f64, k: f64, n: f64, passes: f64) -> Op {
    let f = 2.0 * m * k * n * passes * layers;
    let bytes = 2.0 * (k * n + m * k + m * n) * passes * layers;
    op(hw, name, f, f, bytes, hw.gemm_efficiency)
}

/// The target forward over one sequence of `t` tokens, causal, bf16 activations, no
/// lm_head (the drafter reads the taps).
pub fn target_forward(hw: &Hardware, s: &Shapes, t: usize, attn: &AttentionCode) -> Workload {
    let (tf, h, l) = (t as f64, s.hidden, s.layers);
    let (qd, kd, i) = (
        s.q_heads * s.head_dim,
        s.kv_heads * s.head_dim,
        s.intermediate,
    );
    let attn_flops = 4.0 * s.q_heads * s.head_dim * tf * (tf + 1.0) / 2.0 * l;
    let attn_bytes = 2.0 * tf * (2.0 * qd + 2.0 * kd) * l;
    // Elementwise, per layer, in passes over a [t, width] bf16 tensor (read or write):
    // 2 RMSNorms (2 each) and 2 residual adds (3 each) over hidden; q/k norm and rope (2
    // each) over q+k, the QKV split (2) over q+k+v; SwiGLU (3) over the intermediate.
    let elementwise = 2.0 * tf * (10.0 * h + 4.0 * (qd + kd) + 2.0 * (qd + 2.0 * kd) + 3.0 * i) * l;
    let ops = vec![
        gemm_op(hw, "gemm qkv", l, tf, h, qd + 2.0 * kd, 1.0),
        gemm_op(hw, "gemm o", l, tf, qd, h, 1.0),
        gemm_op(hw, "gemm gate+up", l, tf, h, 2.0 * i, 1.0),
        gemm_op(hw, "gemm down", l, tf, i, h, 1.0),
        op(
            hw,
            "attention fwd (causal)",
            attn_flops,
            attn_flops,
            attn_bytes,
            attention_efficiency(hw, attn),
        ),
        op(hw, "elementwise (bf16)", 0.0, 0.0, elementwise, 1.0),
    ];
    workload(hw, format!("target forward, {t} tokens"), ops)
}

/// The current drafter step's attention and loss (see [`drafter_step`]).
fn drafter_attention_and_loss(
    hw: &Hardware,
    s: &Shapes,
    fwd: &AttentionCode,
    bwd: &AttentionCode,
) -> Vec<Op> {
    let (h, qd, l) = (s.hidden, s.q_heads * s.head_dim, s.drafter_layers);
    let (n, ctx, bs) = ((s.anchors * s.block) as f64, s.drafter_context, s.block);
    // Anchors spread evenly over the context; each row sees the context before its anchor
    // and its own block.
    let room = ctx - bs;
    let keys: f64 = (0..s.anchors)
        .map(|a| ((a * room / s.anchors + bs) * bs) as f64)
        .sum();
    let f = 4.0 * keys * qd * l;
    let kv_bytes = 4.0 * (2.0 * n * qd + 2.0 * (ctx as f64 + n) * s.kv_heads * s.head_dim) * l;
    // Supervised rows: 15 of each block of 16 (the anchor is given).
    let rows = (s.anchors * (s.block - 1)) as f64;
    let (v, ce_model) = (s.vocab, 2.0 * 2.0 * rows * h * s.vocab);
    vec![
        op(
            hw,
            "attention fwd (DFlash blocks)",
            f,
            f,
            kv_bytes,
            attention_efficiency(hw, fwd),
        ),
        // The backward recomputes S and computes dP, dV, dQ, dK: 5 products to the
        // forward's 2; MFU counts it as twice the forward.
        op(
            hw,
            "attention bwd (DFlash blocks)",
            2.5 * f,
            2.0 * f,
            2.0 * kv_bytes,
            attention_efficiency(hw, bwd),
        ),
        // 2 GEMMs per vocabulary chunk (the logits, then exp(l − max)·W into dX's
        // accumulator), the logits in bf16: written by the first, read and rewritten by
        // the fold, read by the second (4 passes of 2 bytes).
        op(
            hw,
            "cross-entropy (lm_head)",
            ce_model,
            ce_model,
            4.0 * 2.0 * rows * v,
            hw.gemm_efficiency,
        ),
    ]
}

/// One drafter training step: `anchors` blocks of `block` rows over a context of
/// `drafter_context` tokens, `drafter_layers` layers reading as many taps, as the current
/// code does it: f32 activations, except that the GEMM inputs x, x2, the context and the
/// SwiGLU output are written in bf16 by the kernels that make them (the attention output
/// is cast once); gate/up one GEMM, Q/K/V separate; 5 memsets per layer (the buffers
/// kernels add into); AdamW over f32 master weights.
pub fn drafter_step(
    hw: &Hardware,
    s: &Shapes,
    fwd: &AttentionCode,
    bwd: &AttentionCode,
) -> Workload {
    let (h, qd, kd, i, l) = (
        s.hidden,
        s.q_heads * s.head_dim,
        s.kv_heads * s.head_dim,
        s.intermediate,
        s.drafter_layers,
    );
    let (n, ctx) = ((s.anchors * s.block) as f64, s.drafter_context as f64);
    let mut ops = vec![
        // fc over the context's taps: forward and weight gradient (its input is frozen).
        gemm_op(hw, "gemm fc (taps → hidden)", 1.0, ctx, l * h, h, 2.0),
        gemm_op(hw, "gemm q", l, n, h, qd, 3.0),
        gemm_op(
            hw,
            "gemm k, v (context + blocks)",
            l,
            ctx + n,
            h,
            2.0 * kd,
            3.0,
        ),
        gemm_op(hw, "gemm o", l, n, qd, h, 3.0),
        gemm_op(hw, "gemm gate+up", l, n, h, 2.0 * i, 3.0),
        gemm_op(hw, "gemm down", l, n, i, h, 3.0),
    ];
    ops.extend(drafter_attention_and_loss(hw, s, fwd, bwd));
    // Elementwise in f32, forward and backward (twice): passes as the target's over n
    // rows, less 2 bytes an element where the forward writes a GEMM input in bf16 (x and
    // x2 by the norms, the SwiGLU output, the context by hidden_norm); a cast (read 4,
    // write 2 bytes) of the attention output for the o GEMM, forward and backward;
    // 5 memsets of [n, hidden] f32 per layer (dq, dk, dv and the q/k norms' input
    // gradients, which kernels add into; every other buffer is written by its first writer).
    let passes = 4.0 * n * (10.0 * h + 4.0 * (qd + kd) + 2.0 * (qd + 2.0 * kd) + 3.0 * i) * 3.0
        - 2.0 * (n * (2.0 * h + i) + ctx * h);
    let casts = 6.0 * n * qd * 3.0;
    let memsets = 5.0 * 4.0 * n * h;
    ops.push(op(
        hw,
        "elementwise, casts, memsets (f32)",
        0.0,
        0.0,
        (passes + casts + memsets) * l,
        1.0,
    ));
    // AdamW: read weight, gradient and both moments, write weight and moments (f32).
    let params = l * (h * (qd + 2.0 * kd) + qd * h + 3.0 * h * i) + l * h * h;
    ops.push(op(hw, "AdamW (f32)", 0.0, 0.0, 28.0 * params, 1.0));
    let name = format!(
        "drafter step, {} anchors × {}, {} layers, {} context",
        s.anchors, s.block, l, s.drafter_context
    );
    workload(hw, name, ops)
}

/// The model's figures: the current kernels, and the same with attention at the goals.
#[derive(Debug, Clone, Serialize)]
pub struct Model {
    pub hardware: Hardware,
    pub shapes: Shapes,
    pub attention: [(String, AttentionCode, f64); 3],
    pub target_forward: Vec<Workload>,
    pub drafter_step: Workload,
    /// One Qwen3-30B-A3B sparse MLP at the forward's lengths.
    pub moe: MoeShapes,
    /// The experts' grouped GEMM: its kernel, sm_90 figures and modelled efficiency.
    pub moe_gemm: (String, AttentionCode, f64),
    pub moe_layer: Vec<Workload>,
    /// MFU of the target forward at each length, then the drafter step, with attention at
    /// the issue's goals (everything else as now).
    pub mfu_with_attention_at_goals: Vec<(String, f64)>,
    pub assumptions: Vec<String>,
}

/// `target`, `drafter`: the target's (bf16) and the drafter's (f32) attention forward,
/// `bwd` the drafter's attention backward and `moe_gemm` the experts' grouped GEMM, each
/// its kernel's name and sm_90 figures.
pub fn model(
    target: (&str, AttentionCode),
    drafter: (&str, AttentionCode),
    bwd: (&str, AttentionCode),
    moe_gemm: (&str, AttentionCode),
) -> Model {
    let (target_kernel, fwd_bf16) = target;
    let (drafter_kernel, fwd) = drafter;
    let (bwd_kernel, bwd) = bwd;
    let (hw, s) = (H200, qwen3_8b());
    let lengths = [1024, 4096, 8192];
    let forwards: Vec<Workload> = lengths
        .iter()
        .map(|&t| target_forward(&hw, &s, t, &fwd_bf16))
        .collect();
    let drafter = drafter_step(&hw, &s, &fwd, &bwd);
    let g = ATTENTION_AT_GOALS;
    let mut at_goals: Vec<(String, f64)> = lengths
        .iter()
        .map(|&t| {
            (
                format!("target forward, {t} tokens"),
                target_forward(&hw, &s, t, &g).mfu,
            )
        })
        .collect();
    at_goals.push(("drafter step".into(), drafter_step(&hw, &s, &g, &g).mfu));
    let attention = [
        (
            target_kernel.to_string(),
            fwd_bf16,
            attention_efficiency(&hw, &fwd_bf16),
        ),
        (
            drafter_kernel.to_string(),
            fwd,
            attention_efficiency(&hw, &fwd),
        ),
        (bwd_kernel.to_string(), bwd, attention_efficiency(&hw, &bwd)),
    ];
    let moe = qwen3_30b_a3b();
    Model {
        hardware: hw,
        shapes: s,
        attention,
        target_forward: forwards,
        drafter_step: drafter,
        moe,
        moe_gemm: (
            moe_gemm.0.to_string(),
            moe_gemm.1,
            moe_gemm_efficiency(&hw, &moe_gemm.1),
        ),
        moe_layer: lengths
            .iter()
            .map(|&t| moe_layer(&hw, &moe, t, &moe_gemm.1))
            .collect(),
        mfu_with_attention_at_goals: at_goals,
        assumptions: assumptions(&hw, &s),
    }
}

fn assumptions(hw: &Hardware, s: &Shapes) -> Vec<String> {
    vec![
        format!("{}: {:.0} TFLOP/s dense bf16, {:.1} TB/s HBM", hw.name, hw.peak_bf16_flops / 1e12, hw.hbm_bytes_per_s / 1e12),
        format!("an op takes max(FLOPs / (efficiency × peak), bytes / ({:.0}% of HBM)); ops do not overlap", hw.hbm_efficiency * 100.0),
        format!("GEMMs (cuBLAS, bf16 in, f32 accumulate): {:.0}% of peak", hw.gemm_efficiency * 100.0),
        format!(
            "attention: {:.0}% of peak at best with mma.sync (wgmma needed beyond); cycles per MMA per scheduler = max({} / that, (1 + non-MMA per MMA) / min(1, warps per scheduler / {}), {} × MUFU per MMA), from the sm_90 SASS of its main loop (static counts) and its resident warps",
            hw.mma_sync_ceiling * 100.0, hw.mma_cycles_at_peak, hw.warps_to_hide_latency, hw.mufu_cycles
        ),
        "static counts: where a main loop holds nested loops (the current attention kernels: the K/V staging, O rescaling and head-dim loops), each body counts once, so the ratio is a lower bound on the executed one and the attention MFU an upper bound".into(),
        "attention backward: 2.5× the forward's products on the hardware, counted as 2× in MFU".into(),
        format!(
            "Qwen3-8B: hidden {}, {} q / {} kv heads of {}, {} layers, MLP {}, vocabulary {}; target forward causal over one sequence, bf16 activations, no lm_head",
            s.hidden, s.q_heads, s.kv_heads, s.head_dim, s.layers, s.intermediate, s.vocab
        ),
        format!(
            "drafter: {} layers (DFlash's depth for a 36-layer target) reading {} taps; {} anchors × block {} over a {}-token context, anchors evenly spread; 15 supervised rows per block",
            s.drafter_layers, s.drafter_layers, s.anchors, s.block, s.drafter_context
        ),
        "drafter as now: f32 activations but the GEMM inputs (x, x2, the context and the SwiGLU output written in bf16 by their producers, the attention output cast once per pass), gate/up one GEMM, cross-entropy in one pass with 2 GEMMs per vocabulary chunk and bf16 logits (written, folded in place, read: 4 passes of 2 bytes), 5 memsets per layer, AdamW at 28 bytes per parameter; host syncs not modelled".into(),
        "elementwise passes per layer: 10 over hidden, 4 over q+k, 2 over q+k+v, 3 over the MLP width (backward twice the forward)".into(),
        format!(
            "MoE layer (Qwen3-30B-A3B: hidden 2048, 128 experts, top-8, expert width 768): no host round trip; each projection one grouped GEMM (moe_gemm_bf16, mma.sync) at the efficiency its sm_90 SASS allows as attention's above, capped by shared memory ({} bytes per MMA at {} bytes per cycle per SM), each expert's last 64-row tile half empty on average (those rows computed, not counted in MFU), every expert's weights read once; routing balanced enough that every expert has rows",
            MOE_GEMM_SMEM_BYTES_PER_MMA, SMEM_BYTES_PER_CYCLE
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_efficiency_follows_issue_occupancy_and_the_tensor_ceiling() {
        let hw = H200;
        // The issue's figures for the current forward: ≈265 non-MMA per MMA, 5 warps/SM
        // (1.25 per scheduler of the 2 needed): about 1% of peak.
        let now = AttentionCode {
            non_mma_per_mma: 265.0,
            mufu_per_mma: 1.0,
            warps_per_sm: 5.0,
        };
        let e = attention_efficiency(&hw, &now);
        assert!((e - 4.0 / (266.0 / 0.625)).abs() < 1e-12, "{e}");
        // At the goals the tensor pipe is the limit: the mma.sync ceiling.
        assert!(
            (attention_efficiency(&hw, &ATTENTION_AT_GOALS) - hw.mma_sync_ceiling).abs() < 1e-12
        );
        // MUFU-bound: 1 exp2 per MMA costs 8 cycles to the MMA's 4.
        let mufu = AttentionCode {
            non_mma_per_mma: 2.0,
            mufu_per_mma: 1.0,
            warps_per_sm: 16.0,
        };
        assert!((attention_efficiency(&hw, &mufu) - 0.5).abs() < 1e-12);
        let none = AttentionCode {
            non_mma_per_mma: f64::NAN,
            mufu_per_mma: 0.0,
            warps_per_sm: 8.0,
        };
        assert_eq!(attention_efficiency(&hw, &none), 0.0);
    }

    #[test]
    fn the_model_counts_qwen3_8b_flops_and_ranks_attention_as_the_issue_does() {
        let s = qwen3_8b();
        assert_eq!(s.drafter_layers, 5.0);
        let now = AttentionCode {
            non_mma_per_mma: 265.0,
            mufu_per_mma: 1.0,
            warps_per_sm: 5.0,
        };
        let w = target_forward(&H200, &s, 4096, &now);
        // GEMMs: 2·t·(params per layer)·layers, params 4096·6144 + 4096² + 3·4096·12288.
        let gemm: f64 = w
            .ops
            .iter()
            .filter(|o| o.name.starts_with("gemm"))
            .map(|o| o.model_flops)
            .sum();
        let params = 4096.0 * 6144.0 + 4096.0 * 4096.0 + 3.0 * 4096.0 * 12288.0;
        assert!((gemm / (2.0 * 4096.0 * params * 36.0) - 1.0).abs() < 1e-12);
        // With ~1%-efficient attention the forward is attention-bound and far from 50%.
        assert!(
            w.attention_share > 0.7 && w.mfu < 0.2,
            "{} {}",
            w.attention_share,
            w.mfu
        );
        let g = target_forward(&H200, &s, 4096, &ATTENTION_AT_GOALS);
        assert!(g.mfu > 0.5 && g.mfu < hw_gemm_ceiling(), "{}", g.mfu);
        // Longer sequences: attention grows quadratically, so MFU now falls with length.
        let long = target_forward(&H200, &s, 8192, &now);
        assert!(long.mfu < w.mfu);
        let d = drafter_step(&H200, &s, &now, &now);
        assert!(
            d.mfu > 0.0
                && d.mfu < drafter_step(&H200, &s, &ATTENTION_AT_GOALS, &ATTENTION_AT_GOALS).mfu
        );
    }

    #[test]
    fn the_moe_layer_counts_only_the_routed_rows_flops_and_every_experts_weights() {
        let m = qwen3_30b_a3b();
        let code = AttentionCode {
            non_mma_per_mma: 3.2,
            mufu_per_mma: 0.0,
            warps_per_sm: 16.0,
        };
        let w = moe_layer(&H200, &m, 4096, &code);
        let find = |name: &str| w.ops.iter().find(|o| o.name == name).unwrap().clone();
        let (gu, down) = (
            find("moe grouped gemm gate+up"),
            find("moe grouped gemm down"),
        );
        // 4096 tokens × 8 routed rows, 3 matrices of 2048 × 768 each: not 128 experts' worth.
        assert_eq!(
            gu.model_flops + down.model_flops,
            2.0 * 4096.0 * 8.0 * 3.0 * 2048.0 * 768.0
        );
        // The hardware also computes each expert's half-empty last tile: 32 rows each.
        assert_eq!(
            gu.flops,
            2.0 * (4096.0 * 8.0 + 128.0 * 32.0) * 2048.0 * 1536.0
        );
        assert_eq!(
            find("gemm router").model_flops,
            2.0 * 4096.0 * 2048.0 * 128.0
        );
        assert!(
            down.bytes >= 2.0 * 128.0 * 2048.0 * 768.0,
            "every expert's weights: {}",
            down.bytes
        );
        // No gather pass: the gate+up GEMM reads the normed rows through the permutation.
        assert!(!w.ops.iter().any(|o| o.name.contains("gather")));
        // At 3.2 non-MMA per MMA and 16 warps/SM the issue rate is no limit: shared
        // memory (192 bytes per MMA at 128 per cycle) and the mma.sync ceiling are.
        let eff = moe_gemm_efficiency(&H200, &code);
        assert!(
            (eff - (128.0 / 192.0f64).min(H200.mma_sync_ceiling)).abs() < 1e-12,
            "{eff}"
        );
        assert_eq!(gu.efficiency, eff);
        // Fewer warps or more overhead per MMA lower it.
        let slow = AttentionCode {
            non_mma_per_mma: 12.0,
            warps_per_sm: 4.0,
            ..code
        };
        assert!(moe_gemm_efficiency(&H200, &slow) < eff / 2.0);
        // Short batches are bound by reading the experts' weights: MFU rises with tokens.
        let short = moe_layer(&H200, &m, 1024, &code);
        assert!(short.mfu < w.mfu && w.mfu < eff, "{} {}", short.mfu, w.mfu);
    }

    fn hw_gemm_ceiling() -> f64 {
        H200.gemm_efficiency
    }
}
