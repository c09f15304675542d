//! A roofline model of an H200 running the target forward and the drafter step at
//! Qwen3-8B's shapes, with the tensor-core kernels' efficiency taken from their machine
//! code and their tiles ([`mma_ceilings`]) and every other figure an assumption printed
//! with it ([`Model::assumptions`]). It is a model: `scripts/gpu_check.sh` measures the
//! same shapes on a GPU.
//!
//! Each op takes max(hardware FLOPs / (efficiency · peak), bytes / (HBM fraction · HBM
//! bandwidth)), and says which [`Bound`] set its time: for a tensor-core kernel the lowest
//! of its ceilings (mma.sync's share of the tensor peak, instruction issue, MUFU, shared
//! memory), for a cuBLAS GEMM the assumed share of peak times its last wave's fill of the
//! SMs, else HBM. A workload's time is the sum of its ops (no overlap between kernels);
//! its MFU is its model FLOPs (the GEMMs' 2·m·n·k and attention's 4·keys·head dim per row
//! and head, forward; backward twice that) over time · peak.

use serde::Serialize;

/// The machine. H200 SXM: 989 TFLOP/s dense bf16 (the H100's tensor cores), 4.8 TB/s HBM3e.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Hardware {
    pub name: &'static str,
    pub peak_bf16_flops: f64,
    pub hbm_bytes_per_s: f64,
    /// SMs (132 on an H100 or H200 SXM).
    pub sms: f64,
    /// The share of the dense peak an mma.sync (HMMA) kernel reaches at best on sm_90:
    /// the peak needs wgmma; FlashAttention-2 (mma.sync) tops out near this on H100. A
    /// bound among the others ([`mma_ceilings`]), not the answer.
    pub mma_sync_ceiling: f64,
    /// cuBLAS's large bf16 GEMMs (ours are m ≥ 4096, n, k ≥ 1024), share of the peak with
    /// every SM busy (the last wave's fill is counted apart: [`gemm_wave_fill`]).
    pub gemm_efficiency: f64,
    /// cuBLAS's CTA tile (rows × columns of the output) for these GEMMs on sm_90.
    pub gemm_tile: (f64, f64),
    /// Share of the HBM bandwidth a streaming elementwise kernel reaches.
    pub hbm_efficiency: f64,
    /// Warps per scheduler (4 per SM) needed to issue every cycle in dependent code.
    pub warps_to_hide_latency: f64,
    /// Cycles of a scheduler's tensor pipe per m16n8k16 MMA at the dense peak (4,096 FLOP;
    /// 1,024 FLOP per scheduler per cycle): an SM does 4 / this MMAs a cycle.
    pub mma_cycles_at_peak: f64,
    /// Cycles per warp-wide MUFU instruction (16 lanes per SM, 4 per scheduler).
    pub mufu_cycles: f64,
    /// Shared-memory bandwidth of an SM, bytes per cycle.
    pub smem_bytes_per_cycle: f64,
}

pub const H200: Hardware = Hardware {
    name: "H200 SXM (sm_90)",
    peak_bf16_flops: 989e12,
    hbm_bytes_per_s: 4.8e12,
    sms: 132.0,
    mma_sync_ceiling: 0.67,
    gemm_efficiency: 0.70,
    gemm_tile: (128.0, 256.0),
    hbm_efficiency: 0.80,
    warps_to_hide_latency: 2.0,
    mma_cycles_at_peak: 4.0,
    mufu_cycles: 8.0,
    smem_bytes_per_cycle: 128.0,
};

/// What set an op's time (the ceiling that binds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    /// The tensor pipe at mma.sync's share of the peak ([`Hardware::mma_sync_ceiling`]).
    MmaSyncCeiling,
    /// Instruction issue: the main loop's instructions per MMA at its resident warps.
    Issue,
    /// The special-function unit (exp2).
    Mufu,
    /// Shared-memory bandwidth: the bytes a kernel's tiles move per MMA.
    SharedMemory,
    /// A cuBLAS GEMM: its assumed share of the peak, times its last wave's fill.
    Gemm,
    /// HBM bandwidth.
    Hbm,
}

impl Bound {
    pub fn describe(self) -> &'static str {
        match self {
            Bound::MmaSyncCeiling => "mma.sync ceiling",
            Bound::Issue => "instruction issue",
            Bound::Mufu => "MUFU",
            Bound::SharedMemory => "shared memory",
            Bound::Gemm => "cuBLAS GEMM",
            Bound::Hbm => "HBM",
        }
    }
}

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

/// Bytes an `ldmatrix.x4` moves from shared memory (a warp's four 8 × 8 bf16 matrices).
const LDMATRIX_X4_BYTES: f64 = 512.0;

/// Shared-memory bytes per MMA of kernels.cu's FlashAttention-2 forward
/// (`attention_fa2_fwd*_hd{hd}`, `Fa2<HD>`): per tile of KT = 64 keys each of the CTA's 4
/// warps does NT·NK + (NT/2)·ND MMAs (NT = KT/8, NK = hd/16, ND = hd/8) fed by
/// NT·NK/2 `ldmatrix.x4` of K and (NT/2)·(ND/2) `.trans` of V, and the CTA writes the tile
/// (K and V, KT × hd bf16 each, by cp.async or by the threads) once for its 4 warps.
/// 320 bytes at every head dim: 256 read, 64 written.
pub fn fa2_fwd_smem_bytes_per_mma(hd: f64) -> f64 {
    let (kt, warps) = (64.0, 4.0);
    let (nt, nk, nd) = (kt / 8.0, hd / 16.0, hd / 8.0);
    let mma = nt * nk + nt / 2.0 * nd;
    let reads = (nt * nk / 2.0 + nt / 2.0 * nd / 2.0) * LDMATRIX_X4_BYTES;
    let writes = 2.0 * kt * hd * 2.0 / warps;
    (reads + writes) / mma
}

/// Shared-memory bytes per MMA of kernels.cu's FlashAttention-2 backward
/// (`attention_fa2_bwd_hd{hd}`, `Fa2b<HD>`): per tile of BR query rows (32 at head dim
/// 128, else 64) each of the 4 warps, for its 16 keys, does Sᵀ and dPᵀ (2·NK·NR MMAs,
/// (NK/2)·(2 + 2·NR) `ldmatrix.x4`: K's fragments, then Q's and dO's), dV and dK
/// (NR·ND MMAs, (NR/2)·(ND/2)·2 `.trans` of dO and Q), and its share of dQ (4·NDW MMAs,
/// 4·(1 + NDW/2) `.trans` of dSᵀ and K), NR = BR/8, NK = hd/16, ND = hd/8, NDW =
/// ND·(BR/16)/4; it writes dSᵀ (NR·2 stores of 128 bytes) and its quarter of the tile's
/// Q and dO (cp.async, BR × hd bf16 each). The per-row scalars (lse, D, spans) are
/// broadcast reads of a few bytes and not counted. 326.4 bytes at head dim 128.
pub fn fa2_bwd_smem_bytes_per_mma(hd: f64) -> f64 {
    let (keys, warps) = (64.0, 4.0);
    let br = if hd >= 128.0 { 32.0 } else { 64.0 };
    let (nr, nk, nd) = (br / 8.0, hd / 16.0, hd / 8.0);
    let ndw = nd * (br / 16.0) / warps;
    let mma = 2.0 * nk * nr + nr * nd + keys / 16.0 * ndw;
    let ldmatrix =
        nk / 2.0 * (2.0 + 2.0 * nr) + nr / 2.0 * nd / 2.0 * 2.0 + keys / 16.0 * (1.0 + ndw / 2.0);
    let writes = nr * 2.0 * 128.0 + 2.0 * br * hd * 2.0 / warps;
    (ldmatrix * LDMATRIX_X4_BYTES + writes) / mma
}

/// Shared-memory bytes the grouped GEMM (`moe_gemm_bf16`) moves per MMA: a warp's 32 × 64
/// tile takes, per k-step of 16, 2 A and 4 B `ldmatrix.x4` for its 16 MMAs (192 bytes
/// read), and each k-block of 32 is written by cp.async, (64 + 128) rows × 32 bf16, for
/// the CTA's 4 warps × 2 k-steps × 16 MMAs (96 bytes written).
pub const MOE_GEMM_SMEM_READ_BYTES_PER_MMA: f64 = 6.0 * LDMATRIX_X4_BYTES / 16.0;
pub const MOE_GEMM_SMEM_WRITE_BYTES_PER_MMA: f64 = (64.0 + 128.0) * 32.0 * 2.0 / (4.0 * 2.0 * 16.0);
pub const MOE_GEMM_SMEM_BYTES_PER_MMA: f64 =
    MOE_GEMM_SMEM_READ_BYTES_PER_MMA + MOE_GEMM_SMEM_WRITE_BYTES_PER_MMA;

/// The shared-memory bytes per MMA of a tensor-core kernel of kernels.cu, from its tiles;
/// None for one this model has no tile arithmetic for (the one-warp attention kernels).
pub fn smem_bytes_per_mma(kernel: &str) -> Option<f64> {
    if kernel == "moe_gemm_bf16" {
        return Some(MOE_GEMM_SMEM_BYTES_PER_MMA);
    }
    let hd = |k: &str| k.rsplit_once("_hd")?.1.parse::<u32>().ok().map(f64::from);
    if kernel.starts_with("attention_fa2_fwd") {
        hd(kernel).map(fa2_fwd_smem_bytes_per_mma)
    } else if kernel.starts_with("attention_fa2_bwd") {
        hd(kernel).map(fa2_bwd_smem_bytes_per_mma)
    } else {
        None
    }
}

/// Row tile of the grouped GEMM (`MOE_BM` in kernels.cu): an expert's last tile is on
/// average half empty, and those rows are computed all the same.
const MOE_GEMM_TILE_ROWS: f64 = 64.0;

/// One sparse MLP over `t` tokens as the device route runs it: the router GEMM; the
/// routing (`moe_route`); the permutation (`moe_count`, `moe_scan`, `moe_place`); the
/// experts' gate+up and down projections as one grouped GEMM each (`moe_gemm_bf16`, at
/// `gemm`'s ceilings), reading the normed rows through the permutation (no gathered
/// copy), every expert's weights read once (at these token counts each expert has rows),
/// each expert's last row tile half empty on average; the SwiGLU over the routed rows; the
/// weighted sum (`moe_combine`). Model FLOPs: the GEMMs' over the routed rows (2 per
/// multiply-add).
pub fn moe_layer(hw: &Hardware, m: &MoeShapes, t: usize, gemm: &AttentionCode) -> Workload {
    let (tf, h, e, k, w) = (t as f64, m.hidden, m.experts, m.top_k, m.expert_width);
    let rows = tf * k;
    let padded = rows + e * MOE_GEMM_TILE_ROWS / 2.0;
    let c = mma_ceilings(hw, gemm);
    let experts = |name: &str, n_in: f64, n_out: f64| {
        let bytes = 2.0 * (e * n_in * n_out + rows * n_in + rows * n_out);
        let (f, model) = (2.0 * padded * n_in * n_out, 2.0 * rows * n_in * n_out);
        op(hw, name, f, model, bytes, c.efficiency(), c.bound())
    };
    let chunks = (rows / 256.0).ceil();
    let ops = vec![
        gemm_op(hw, "gemm router", 1.0, tf, h, e, 1.0),
        // Logits read (bf16), experts and weights written (i32, f32).
        hbm_op(hw, "moe route", 2.0 * tf * e + 8.0 * rows),
        // The experts read twice (count, place), the counts per chunk written, read twice
        // and written by the scan, read by the place; rows and slots written (i32).
        hbm_op(
            hw,
            "moe permute (count, scan, place)",
            8.0 * rows + 5.0 * 4.0 * chunks * e + 8.0 * rows,
        ),
        experts("moe grouped gemm gate+up", h, 2.0 * w),
        hbm_op(hw, "swiglu (routed rows)", 3.0 * 2.0 * rows * w),
        experts("moe grouped gemm down", w, h),
        hbm_op(
            hw,
            "moe combine",
            2.0 * rows * h + 8.0 * rows + 2.0 * tf * h,
        ),
    ];
    workload(hw, format!("MoE layer, {t} tokens"), ops)
}

/// What the machine code and the tiles of a tensor-core kernel say (sm_90).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct AttentionCode {
    pub non_mma_per_mma: f64,
    pub mufu_per_mma: f64,
    pub warps_per_sm: f64,
    /// Bytes through shared memory per MMA, from its tiles ([`smem_bytes_per_mma`]; 0:
    /// not modelled, no shared-memory ceiling).
    pub smem_bytes_per_mma: f64,
}

/// The issue's goals for the attention kernels: ≤ 4 non-MMA instructions per MMA, 8
/// warps per SM; a FlashAttention-2 tile of 64 keys at head dim 128 has 1 exp2 per 4 MMAs;
/// its shared-memory traffic is the current forward's tiles' (the goals say nothing of it).
pub const ATTENTION_AT_GOALS: AttentionCode = AttentionCode {
    non_mma_per_mma: 4.0,
    mufu_per_mma: 0.25,
    warps_per_sm: 8.0,
    smem_bytes_per_mma: 320.0,
};

/// A tensor-core kernel's ceilings, each a share of the dense peak; its efficiency is the
/// lowest, and that one binds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Ceilings {
    /// mma.sync's share of the tensor peak.
    pub mma_sync: f64,
    /// Issue: the MMA's share of a scheduler's issue slots it can use.
    pub issue: f64,
    pub mufu: f64,
    pub shared_memory: f64,
}

impl Ceilings {
    fn all(&self) -> [(f64, Bound); 4] {
        [
            (self.mma_sync, Bound::MmaSyncCeiling),
            (self.issue, Bound::Issue),
            (self.mufu, Bound::Mufu),
            (self.shared_memory, Bound::SharedMemory),
        ]
    }

    pub fn efficiency(&self) -> f64 {
        self.all().iter().map(|c| c.0).fold(f64::INFINITY, f64::min)
    }

    /// The ceiling that binds (the first of equals in the order of [`Bound`]).
    pub fn bound(&self) -> Bound {
        self.all()
            .iter()
            .copied()
            .reduce(|a, b| if b.0 < a.0 { b } else { a })
            .map_or(Bound::Issue, |c| c.1)
    }
}

/// A scheduler needs per MMA (which does mma_cycles_at_peak's work) at least
/// mma_cycles_at_peak / mma_sync_ceiling tensor cycles; (1 + non-MMA per MMA) /
/// min(1, warps per scheduler / warps_to_hide_latency) issue cycles; mufu_per_mma ·
/// mufu_cycles MUFU cycles; and the SM, doing 4 / mma_cycles_at_peak MMAs a cycle at the
/// peak, smem_bytes_per_mma / smem_bytes_per_cycle cycles of shared memory per MMA. Each
/// gives a ceiling: the peak's cycles over those.
pub fn mma_ceilings(hw: &Hardware, c: &AttentionCode) -> Ceilings {
    let issue_share = (c.warps_per_sm / 4.0 / hw.warps_to_hide_latency).min(1.0);
    let issue = if issue_share <= 0.0 || !c.non_mma_per_mma.is_finite() {
        0.0
    } else {
        hw.mma_cycles_at_peak / ((1.0 + c.non_mma_per_mma) / issue_share)
    };
    let per = |cycles: f64| {
        if cycles > 0.0 {
            hw.mma_cycles_at_peak / cycles
        } else {
            f64::INFINITY
        }
    };
    let mma_per_cycle_at_peak = 4.0 / hw.mma_cycles_at_peak;
    Ceilings {
        mma_sync: hw.mma_sync_ceiling,
        issue,
        mufu: per(c.mufu_per_mma * hw.mufu_cycles),
        shared_memory: if c.smem_bytes_per_mma > 0.0 {
            hw.smem_bytes_per_cycle / (c.smem_bytes_per_mma * mma_per_cycle_at_peak)
        } else {
            f64::INFINITY
        },
    }
}

/// Share of the dense peak of an attention kernel: the lowest of its [`mma_ceilings`].
pub fn attention_efficiency(hw: &Hardware, c: &AttentionCode) -> f64 {
    mma_ceilings(hw, c).efficiency()
}

/// Share of the dense peak of the grouped GEMM: the same ceilings as attention's, its
/// shared memory ([`MOE_GEMM_SMEM_BYTES_PER_MMA`]) among them.
pub fn moe_gemm_efficiency(hw: &Hardware, c: &AttentionCode) -> f64 {
    mma_ceilings(hw, c).efficiency()
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
    /// What set `seconds`: HBM where its bytes take longer than its FLOPs, else the
    /// ceiling its FLOPs run at.
    pub bound: Bound,
}

fn op(
    hw: &Hardware,
    name: &str,
    flops: f64,
    model_flops: f64,
    bytes: f64,
    efficiency: f64,
    compute_bound: Bound,
) -> Op {
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
        bound: if compute > memory {
            compute_bound
        } else {
            Bound::Hbm
        },
    }
}

/// An op without FLOPs: its bytes at HBM bandwidth.
fn hbm_op(hw: &Hardware, name: &str, bytes: f64) -> Op {
    op(hw, name, 0.0, 0.0, bytes, 1.0, Bound::Hbm)
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
    /// The bound that holds the most of the time.
    pub bound: Bound,
    /// Each bound's share of the time, largest first.
    pub bound_shares: Vec<(Bound, f64)>,
}

fn workload(hw: &Hardware, name: String, ops: Vec<Op>) -> Workload {
    let model_flops: f64 = ops.iter().map(|o| o.model_flops).sum();
    let seconds: f64 = ops.iter().map(|o| o.seconds).sum();
    // From +0 (an empty f64 sum is -0, printed "-0%" for a workload without attention).
    let attention: f64 = ops
        .iter()
        .filter(|o| o.name.starts_with("attention"))
        .fold(0.0, |a, o| a + o.seconds);
    let mut shares: std::collections::BTreeMap<Bound, f64> = Default::default();
    for o in &ops {
        *shares.entry(o.bound).or_insert(0.0) += o.seconds / seconds;
    }
    let mut bound_shares: Vec<(Bound, f64)> = shares.into_iter().collect();
    bound_shares.sort_by(|a, b| b.1.total_cmp(&a.1));
    Workload {
        name,
        model_flops,
        seconds,
        mfu: model_flops / (seconds * hw.peak_bf16_flops),
        attention_share: attention / seconds,
        bound: bound_shares.first().map_or(Bound::Hbm, |b| b.0),
        bound_shares,
        ops,
    }
}

/// The share of the SMs a GEMM with an `m` × `n` output keeps busy over its waves: its
/// CTA tiles (cuBLAS's [`Hardware::gemm_tile`]) over the waves' slots.
pub fn gemm_wave_fill(hw: &Hardware, m: f64, n: f64) -> f64 {
    let tiles = (m / hw.gemm_tile.0).ceil() * (n / hw.gemm_tile.1).ceil();
    tiles / ((tiles / hw.sms).ceil() * hw.sms)
}

/// A GEMM of every layer: `m` rows, `k` in, `n` out, bf16 weights and activations;
/// `passes` 1: the forward (output m × n); 2: and the weight gradient (k × n); 3: and the
/// input gradient (m × k). Each pass at gemm_efficiency times its wave fill.
fn gemm_op(hw: &Hardware, name: &str, layers: f64, m: f64, k: f64, n: f64, passes: f64) -> Op {
    let outputs: &[(f64, f64)] = match passes as usize {
        1 => &[(m, n)],
        2 => &[(m, n), (k, n)],
        _ => &[(m, n), (k, n), (m, k)],
    };
    let pass = 2.0 * m * k * n * layers;
    let f = pass * outputs.len() as f64;
    // The passes' time at gemm_efficiency · fill, as one efficiency.
    let at_full: f64 = outputs
        .iter()
        .map(|&(r, c)| pass / gemm_wave_fill(hw, r, c))
        .sum();
    let bytes = 2.0 * (k * n + m * k + m * n) * passes * layers;
    op(
        hw,
        name,
        f,
        f,
        bytes,
        hw.gemm_efficiency * f / at_full,
        Bound::Gemm,
    )
}

/// Keys a causal FlashAttention-2 forward computes over `t` rows: each CTA's 64 rows
/// (FA2_ROWS) against whole 64-key tiles (KT) up to its last row's, the diagonal tile
/// computed whole and masked.
pub fn fa2_causal_keys(t: usize) -> f64 {
    let (rows, kt) = (64, 64);
    (0..t.div_ceil(rows))
        .map(|i| {
            let r = rows.min(t - i * rows);
            (r * (i * rows + r).div_ceil(kt) * kt) as f64
        })
        .sum()
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
    let attn_model = 4.0 * s.q_heads * s.head_dim * tf * (tf + 1.0) / 2.0 * l;
    let attn_flops = 4.0 * s.q_heads * s.head_dim * fa2_causal_keys(t) * l;
    let attn_bytes = 2.0 * tf * (2.0 * qd + 2.0 * kd) * l;
    // Elementwise, per layer, in passes over a [t, width] bf16 tensor (read or write):
    // 2 RMSNorms (2 each) and 2 residual adds (3 each) over hidden; q/k norm and rope (2
    // each) over q+k, the QKV split (2) over q+k+v; SwiGLU (3) over the intermediate.
    let elementwise = 2.0 * tf * (10.0 * h + 4.0 * (qd + kd) + 2.0 * (qd + 2.0 * kd) + 3.0 * i) * l;
    let c = mma_ceilings(hw, attn);
    let ops = vec![
        gemm_op(hw, "gemm qkv", l, tf, h, qd + 2.0 * kd, 1.0),
        gemm_op(hw, "gemm o", l, tf, qd, h, 1.0),
        gemm_op(hw, "gemm gate+up", l, tf, h, 2.0 * i, 1.0),
        gemm_op(hw, "gemm down", l, tf, i, h, 1.0),
        op(
            hw,
            "attention fwd (causal)",
            attn_flops,
            attn_model,
            attn_bytes,
            c.efficiency(),
            c.bound(),
        ),
        hbm_op(hw, "elementwise (bf16)", elementwise),
    ];
    workload(hw, format!("target forward, {t} tokens"), ops)
}

/// Vocabulary columns per chunk of the drafter's cross-entropy (`CHUNK` in
/// models/drafter/device.rs): each chunk's two GEMMs have a rows × 4096 and a rows ×
/// hidden output.
const CE_CHUNK: f64 = 4096.0;

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
    let ce_fill =
        2.0 / (1.0 / gemm_wave_fill(hw, rows, CE_CHUNK) + 1.0 / gemm_wave_fill(hw, rows, h));
    let (cf, cb) = (mma_ceilings(hw, fwd), mma_ceilings(hw, bwd));
    vec![
        op(
            hw,
            "attention fwd (DFlash blocks)",
            f,
            f,
            kv_bytes,
            cf.efficiency(),
            cf.bound(),
        ),
        // The backward recomputes S and computes dP, dV, dQ, dK: 5 products to the
        // forward's 2; MFU counts it as twice the forward.
        op(
            hw,
            "attention bwd (DFlash blocks)",
            2.5 * f,
            2.0 * f,
            2.0 * kv_bytes,
            cb.efficiency(),
            cb.bound(),
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
            hw.gemm_efficiency * ce_fill,
            Bound::Gemm,
        ),
    ]
}

/// Bytes per parameter of a drafter step's passes over all its parameters besides AdamW,
/// each an f32 stream at HBM bandwidth: the gradient's scale (read, write: 8), its sum of
/// squares (read: 4), the bf16 copy's refresh (read 4, write 2), the weights' checksum
/// (read: 4) and the reduction's copy of the gradient (read, write: 8).
pub const DRAFTER_PARAMETER_PASS_BYTES: f64 = 8.0 + 4.0 + 6.0 + 4.0 + 8.0;

/// AdamW's bytes per parameter: read weight, gradient and both moments, write weight and
/// moments (f32).
pub const ADAMW_BYTES: f64 = 28.0;

/// The drafter's trained parameters: per layer q, k, v, o and the MLP's three matrices,
/// and fc over the taps (taps × hidden → hidden).
pub fn drafter_parameters(s: &Shapes) -> f64 {
    let (h, qd, kd, i, l) = (
        s.hidden,
        s.q_heads * s.head_dim,
        s.kv_heads * s.head_dim,
        s.intermediate,
        s.drafter_layers,
    );
    l * (h * (qd + 2.0 * kd) + qd * h + 3.0 * h * i) + l * h * h
}

/// One drafter training step: `anchors` blocks of `block` rows over a context of
/// `drafter_context` tokens, `drafter_layers` layers reading as many taps, as the current
/// code does it: f32 activations, except that the GEMM inputs x, x2, the context and the
/// SwiGLU output are written in bf16 by the kernels that make them (the attention output
/// is cast once); gate/up one GEMM, Q/K/V separate; 5 memsets per layer (the buffers
/// kernels add into); AdamW over f32 master weights; the step's other passes over every
/// parameter ([`DRAFTER_PARAMETER_PASS_BYTES`]).
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
    ops.push(hbm_op(
        hw,
        "elementwise, casts, memsets (f32)",
        (passes + casts + memsets) * l,
    ));
    let params = drafter_parameters(s);
    ops.push(hbm_op(hw, "AdamW (f32)", ADAMW_BYTES * params));
    ops.push(hbm_op(
        hw,
        "parameter passes (scale, sumsq, bf16, checksum, copy)",
        DRAFTER_PARAMETER_PASS_BYTES * params,
    ));
    let name = format!(
        "drafter step, {} anchors × {}, {} layers, {} context",
        s.anchors, s.block, l, s.drafter_context
    );
    workload(hw, name, ops)
}

/// A tensor-core kernel as the model takes it: its sm_90 figures, ceilings, and the one
/// that binds.
#[derive(Debug, Clone, Serialize)]
pub struct KernelModel {
    pub kernel: String,
    pub code: AttentionCode,
    pub ceilings: Ceilings,
    pub efficiency: f64,
    pub bound: Bound,
}

fn kernel_model(hw: &Hardware, (kernel, code): (&str, AttentionCode)) -> KernelModel {
    let ceilings = mma_ceilings(hw, &code);
    KernelModel {
        kernel: kernel.into(),
        code,
        ceilings,
        efficiency: ceilings.efficiency(),
        bound: ceilings.bound(),
    }
}

/// The model's figures: the current kernels, and the same with attention at the goals.
#[derive(Debug, Clone, Serialize)]
pub struct Model {
    pub hardware: Hardware,
    pub shapes: Shapes,
    /// The target's attention forward, the drafter's, the drafter's backward.
    pub attention: [KernelModel; 3],
    pub target_forward: Vec<Workload>,
    pub drafter_step: Workload,
    /// The lowest and highest MFU of the target forward over its lengths (a model until
    /// `scripts/gpu_check.sh` measures it on a GPU).
    pub target_forward_mfu_range: (f64, f64),
    /// One Qwen3-30B-A3B sparse MLP at the forward's lengths.
    pub moe: MoeShapes,
    /// The experts' grouped GEMM: its kernel, sm_90 figures and modelled efficiency.
    pub moe_gemm: KernelModel,
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
    let (hw, s) = (H200, qwen3_8b());
    let lengths = [1024, 4096, 8192];
    let forwards: Vec<Workload> = lengths
        .iter()
        .map(|&t| target_forward(&hw, &s, t, &target.1))
        .collect();
    let drafter_w = drafter_step(&hw, &s, &drafter.1, &bwd.1);
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
    let range = forwards
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), w| {
            (lo.min(w.mfu), hi.max(w.mfu))
        });
    let moe = qwen3_30b_a3b();
    Model {
        hardware: hw,
        shapes: s,
        attention: [
            kernel_model(&hw, target),
            kernel_model(&hw, drafter),
            kernel_model(&hw, bwd),
        ],
        target_forward: forwards,
        drafter_step: drafter_w,
        target_forward_mfu_range: range,
        moe,
        moe_gemm: kernel_model(&hw, moe_gemm),
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
        "a model, not a measurement: scripts/gpu_check.sh measures these shapes on a GPU".into(),
        format!("{}: {:.0} TFLOP/s dense bf16, {:.1} TB/s HBM, {} SMs", hw.name, hw.peak_bf16_flops / 1e12, hw.hbm_bytes_per_s / 1e12, hw.sms),
        format!("an op takes max(FLOPs / (efficiency × peak), bytes / ({:.0}% of HBM)); ops do not overlap; each says which bound set its time", hw.hbm_efficiency * 100.0),
        format!(
            "GEMMs (cuBLAS, bf16 in, f32 accumulate): {:.0}% of peak with every SM busy, times the last wave's fill ({} × {} output tiles over {} SMs); the drafter's weight and input gradients each with their own output's fill",
            hw.gemm_efficiency * 100.0, hw.gemm_tile.0, hw.gemm_tile.1, hw.sms
        ),
        format!(
            "tensor-core kernels (attention, the grouped GEMM): the lowest of four ceilings, each cycles per MMA at the peak ({}) over: the tensor pipe at mma.sync's {:.0}% of peak (wgmma needed beyond); issue, (1 + non-MMA per MMA) / min(1, warps per scheduler / {}) from the sm_90 SASS of the main loop (static counts) and the resident warps; MUFU, {} × MUFU per MMA; shared memory, the bytes the kernel's tiles move per MMA (ldmatrix reads, cp.async and st.shared writes) at {} bytes per cycle per SM (1 MMA per cycle per SM at the peak)",
            hw.mma_cycles_at_peak, hw.mma_sync_ceiling * 100.0, hw.warps_to_hide_latency, hw.mufu_cycles, hw.smem_bytes_per_cycle
        ),
        format!(
            "FlashAttention-2 tiles: the forward {:.0} bytes per MMA (K by ldmatrix, V by ldmatrix.trans, the 64-key K/V tile written once for 4 warps), the backward {:.1} at head dim 128 (K, Q, dO, dSᵀ by ldmatrix; dSᵀ, Q and dO written); per-row scalars not counted",
            fa2_fwd_smem_bytes_per_mma(s.head_dim), fa2_bwd_smem_bytes_per_mma(s.head_dim)
        ),
        "static counts: where a main loop holds nested loops, each body counts once, so the ratio is a lower bound on the executed one and the issue ceiling an upper bound; local memory (LDL/STL of a spilling loop) counts as issue only, its latency and L1 traffic are not modelled".into(),
        "causal attention forward: whole 64-key tiles up to each 64-row CTA's last row computed (the diagonal tile masked), the exact causal products counted in MFU; attention backward: 2.5× the forward's products on the hardware, counted as 2× in MFU".into(),
        format!(
            "Qwen3-8B: hidden {}, {} q / {} kv heads of {}, {} layers, MLP {}, vocabulary {}; target forward causal over one sequence, bf16 activations, no lm_head",
            s.hidden, s.q_heads, s.kv_heads, s.head_dim, s.layers, s.intermediate, s.vocab
        ),
        format!(
            "drafter: {} layers (DFlash's depth for a 36-layer target) reading {} taps; {} anchors × block {} over a {}-token context, anchors evenly spread; 15 supervised rows per block",
            s.drafter_layers, s.drafter_layers, s.anchors, s.block, s.drafter_context
        ),
        format!(
            "drafter as now: f32 activations but the GEMM inputs (x, x2, the context and the SwiGLU output written in bf16 by their producers, the attention output cast once per pass), gate/up one GEMM, cross-entropy in one pass with 2 GEMMs per {CE_CHUNK}-column vocabulary chunk and bf16 logits (written, folded in place, read: 4 passes of 2 bytes), 5 memsets per layer, AdamW at {ADAMW_BYTES} bytes per parameter and {DRAFTER_PARAMETER_PASS_BYTES} more per parameter per step (gradient scale 8, sum of squares 4, bf16 refresh 6, checksum 4, reduction copy 8) over {:.0}M parameters; host syncs and launch gaps not modelled",
            drafter_parameters(s) / 1e6
        ),
        "elementwise passes per layer: 10 over hidden, 4 over q+k, 2 over q+k+v, 3 over the MLP width (backward twice the forward)".into(),
        format!(
            "MoE layer (Qwen3-30B-A3B: hidden 2048, 128 experts, top-8, expert width 768): no host round trip; each projection one grouped GEMM (moe_gemm_bf16, mma.sync) at the ceilings its sm_90 SASS and tiles allow as attention's above ({} bytes per MMA: {} of ldmatrix, {} of cp.async), each expert's last 64-row tile half empty on average (those rows computed, not counted in MFU), every expert's weights read once; routing balanced enough that every expert has rows",
            MOE_GEMM_SMEM_BYTES_PER_MMA, MOE_GEMM_SMEM_READ_BYTES_PER_MMA, MOE_GEMM_SMEM_WRITE_BYTES_PER_MMA
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
            smem_bytes_per_mma: 0.0,
        };
        let e = attention_efficiency(&hw, &now);
        assert!((e - 4.0 / (266.0 / 0.625)).abs() < 1e-12, "{e}");
        assert_eq!(mma_ceilings(&hw, &now).bound(), Bound::Issue);
        // At the goals, with the current tiles' 320 bytes per MMA, shared memory binds
        // below the mma.sync ceiling: 128 bytes a cycle for one MMA a cycle.
        let goals = mma_ceilings(&hw, &ATTENTION_AT_GOALS);
        assert!((goals.efficiency() - 128.0 / 320.0).abs() < 1e-12);
        assert!(goals.efficiency() < hw.mma_sync_ceiling);
        assert_eq!(goals.bound(), Bound::SharedMemory);
        // Without the shared-memory traffic the tensor pipe is the limit: the ceiling.
        let tiles_free = AttentionCode {
            smem_bytes_per_mma: 0.0,
            ..ATTENTION_AT_GOALS
        };
        assert!((attention_efficiency(&hw, &tiles_free) - hw.mma_sync_ceiling).abs() < 1e-12);
        assert_eq!(
            mma_ceilings(&hw, &tiles_free).bound(),
            Bound::MmaSyncCeiling
        );
        // MUFU-bound: 1 exp2 per MMA costs 8 cycles to the MMA's 4.
        let mufu = AttentionCode {
            non_mma_per_mma: 2.0,
            mufu_per_mma: 1.0,
            warps_per_sm: 16.0,
            smem_bytes_per_mma: 0.0,
        };
        assert!((attention_efficiency(&hw, &mufu) - 0.5).abs() < 1e-12);
        assert_eq!(mma_ceilings(&hw, &mufu).bound(), Bound::Mufu);
        let none = AttentionCode {
            non_mma_per_mma: f64::NAN,
            mufu_per_mma: 0.0,
            warps_per_sm: 8.0,
            smem_bytes_per_mma: 0.0,
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
            smem_bytes_per_mma: 0.0,
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
            smem_bytes_per_mma: smem_bytes_per_mma("moe_gemm_bf16").unwrap(),
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
        // memory is. Per k-step of 16 a warp reads 2 A and 4 B ldmatrix.x4 (512 bytes
        // each) for its 2 × 8 MMAs; per k-block of 32 the CTA's cp.async writes 64 A and
        // 128 B rows of 32 bf16 for its 4 warps' 2 k-steps of 16 MMAs.
        let read = 6.0 * 512.0 / 16.0;
        let written = (64.0 + 128.0) * 32.0 * 2.0 / (4.0 * 2.0 * 16.0);
        assert_eq!(code.smem_bytes_per_mma, read + written);
        let eff = moe_gemm_efficiency(&H200, &code);
        assert!(
            (eff - (128.0 / (read + written)).min(H200.mma_sync_ceiling)).abs() < 1e-12,
            "{eff}"
        );
        assert!(eff < 128.0 / read, "the cp.async writes count");
        assert_eq!(gu.efficiency, eff);
        assert_eq!(mma_ceilings(&H200, &code).bound(), Bound::SharedMemory);
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
        // ... there the grouped GEMMs' bytes take longer than their FLOPs: HBM binds.
        assert_eq!(
            short
                .ops
                .iter()
                .find(|o| o.name == "moe grouped gemm down")
                .unwrap()
                .bound,
            Bound::Hbm
        );
        assert_eq!(find("moe grouped gemm down").bound, Bound::SharedMemory);
    }

    /// Per warp and tile of 64 keys at head dim 128: Q·Kᵀ is 8 n-tiles × 8 k-steps (64
    /// MMAs, an ldmatrix.x4 per 2), P·V 4 k-steps × 16 n-tiles (64 MMAs, one per 2); the
    /// CTA's 4 warps share the K and V tile they write (64 × 128 bf16 each).
    #[test]
    fn the_attention_tiles_cap_attention_at_the_shared_memory_bandwidth() {
        let mma = 64.0 + 64.0;
        let fwd = (mma / 2.0 * 512.0 + 2.0 * 64.0 * 128.0 * 2.0 / 4.0) / mma;
        assert_eq!(fa2_fwd_smem_bytes_per_mma(128.0), fwd);
        assert_eq!(
            smem_bytes_per_mma("attention_fa2_fwd_bf16_hd128"),
            Some(fwd)
        );
        assert_eq!(smem_bytes_per_mma("attention_fa2_fwd_hd64"), Some(fwd));
        // The backward at head dim 128 (32-row tiles), per warp (16 keys): Sᵀ and dPᵀ
        // 64 MMAs (4 pairs of k-steps: 2 K ldmatrix, then a Q and a dO one per 4 MMAs),
        // dV and dK 64 (an ldmatrix per 2), dQ 32 (4 k-steps: a dSᵀ ldmatrix, then one
        // per 2); it writes dSᵀ (4 n-tiles × 2 stores of 128 bytes) and a quarter of Q
        // and dO (32 × 128 bf16 each).
        let bwd_mma = 64.0 + 64.0 + 32.0;
        let ldm = 4.0 * (2.0 + 8.0) + 32.0 + 4.0 * (1.0 + 4.0);
        let bwd = (ldm * 512.0 + 4.0 * 2.0 * 128.0 + 2.0 * 32.0 * 128.0 * 2.0 / 4.0) / bwd_mma;
        assert_eq!(fa2_bwd_smem_bytes_per_mma(128.0), bwd);
        assert_eq!(smem_bytes_per_mma("attention_fa2_bwd_hd128"), Some(bwd));
        assert_eq!(smem_bytes_per_mma("attention_fwd_bf16"), None);
        // Whatever the instruction mix, attention runs at most at 128 bytes a cycle.
        let (hw, s) = (H200, qwen3_8b());
        for (code_smem, cap) in [(fwd, 128.0 / fwd), (bwd, 128.0 / bwd)] {
            let code = AttentionCode {
                non_mma_per_mma: 1.0,
                mufu_per_mma: 0.0,
                warps_per_sm: 16.0,
                smem_bytes_per_mma: code_smem,
            };
            assert!(cap < hw.mma_sync_ceiling && cap > 0.3, "{cap}");
            assert!((attention_efficiency(&hw, &code) - cap).abs() < 1e-12);
            let w = target_forward(&hw, &s, 8192, &code);
            let a = w
                .ops
                .iter()
                .find(|o| o.name.starts_with("attention"))
                .unwrap();
            assert!(a.efficiency <= cap + 1e-12);
            assert_eq!(a.bound, Bound::SharedMemory);
            // The causal forward computes whole 64-key tiles: more than MFU counts.
            assert!(a.flops > a.model_flops);
            assert!(a.seconds >= a.flops / (cap * hw.peak_bf16_flops) * (1.0 - 1e-12));
        }
        // 64-row CTAs over 128 rows: 64 rows see 64 keys, 64 rows see 128.
        assert_eq!(fa2_causal_keys(128), 64.0 * 64.0 + 64.0 * 128.0);
    }

    #[test]
    fn every_op_says_which_bound_set_its_time() {
        let (hw, s) = (H200, qwen3_8b());
        let code = AttentionCode {
            non_mma_per_mma: 3.9,
            mufu_per_mma: 0.27,
            warps_per_sm: 8.0,
            smem_bytes_per_mma: fa2_fwd_smem_bytes_per_mma(128.0),
        };
        let bwd = AttentionCode {
            smem_bytes_per_mma: fa2_bwd_smem_bytes_per_mma(128.0),
            ..code
        };
        let mut all = vec![drafter_step(&hw, &s, &code, &bwd)];
        all.extend([1024, 4096, 8192].map(|t| target_forward(&hw, &s, t, &code)));
        for w in &all {
            for o in &w.ops {
                let compute = if o.flops > 0.0 {
                    o.flops / (o.efficiency * hw.peak_bf16_flops)
                } else {
                    0.0
                };
                let memory = o.bytes / (hw.hbm_efficiency * hw.hbm_bytes_per_s);
                assert!((o.seconds - compute.max(memory)).abs() <= 1e-12 * o.seconds);
                if memory >= compute {
                    assert_eq!(o.bound, Bound::Hbm, "{}: {}", w.name, o.name);
                } else if o.name.starts_with("gemm") || o.name.starts_with("cross") {
                    assert_eq!(o.bound, Bound::Gemm, "{}: {}", w.name, o.name);
                    // cuBLAS at its assumed share, never more (the wave fill only lowers it).
                    assert!(o.efficiency <= hw.gemm_efficiency);
                } else {
                    assert_eq!(o.bound, Bound::SharedMemory, "{}: {}", w.name, o.name);
                }
            }
            let shares: f64 = w.bound_shares.iter().map(|b| b.1).sum();
            assert!((shares - 1.0).abs() < 1e-9);
            assert_eq!(w.bound, w.bound_shares[0].0);
        }
        // 4096 rows × 6144 columns in 128 × 256 tiles: 32 × 24 = 768 tiles, 6 waves of
        // 132 SMs (792 slots).
        assert!((gemm_wave_fill(&hw, 4096.0, 6144.0) - 768.0 / 792.0).abs() < 1e-12);
        assert_eq!(gemm_wave_fill(&hw, 128.0 * 12.0, 256.0 * 11.0), 1.0);
    }

    #[test]
    fn the_drafter_step_streams_every_parameter_for_adamw_and_its_other_passes() {
        let s = qwen3_8b();
        // 5 layers of q (4096²), k and v (4096 × 1024 each), o (4096²), gate, up, down
        // (4096 × 12288 each), and fc over the 5 taps (5·4096 → 4096).
        let layer = 4096.0 * 4096.0 * 2.0 + 2.0 * 4096.0 * 1024.0 + 3.0 * 4096.0 * 12288.0;
        let params = 5.0 * layer + 5.0 * 4096.0 * 4096.0;
        assert_eq!(drafter_parameters(&s), params);
        // Gradient scale (read, write f32), sum of squares (read), bf16 refresh (read f32,
        // write bf16), checksum (read), reduction copy (read, write).
        assert_eq!(
            DRAFTER_PARAMETER_PASS_BYTES,
            8.0 + 4.0 + 4.0 + 2.0 + 4.0 + 8.0
        );
        let w = drafter_step(&H200, &s, &ATTENTION_AT_GOALS, &ATTENTION_AT_GOALS);
        let streamed: f64 = w
            .ops
            .iter()
            .filter(|o| o.name.starts_with("AdamW") || o.name.starts_with("parameter passes"))
            .map(|o| o.bytes)
            .sum();
        assert_eq!(streamed, (28.0 + 30.0) * params);
        let passes = w
            .ops
            .iter()
            .find(|o| o.name.starts_with("parameter passes"))
            .unwrap();
        assert_eq!(passes.bound, Bound::Hbm);
        assert!(
            (passes.seconds - 30.0 * params / (0.8 * 4.8e12)).abs() < 1e-12,
            "{}",
            passes.seconds
        );
    }

    fn hw_gemm_ceiling() -> f64 {
        H200.gemm_efficiency
    }
}
