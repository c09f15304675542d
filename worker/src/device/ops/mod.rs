//! One typed method per kernel of `cuda/kernels.cu` ([`Kernel`]), on the compute stream: the GPU
//! counterpart of the reference op set (`reference::ops::Cpu`, test-only), with the same
//! layouts and the same accumulate-or-overwrite semantics, so that each can be checked
//! against it. Buffers are [`DSlice`]s of f32 unless said otherwise.

pub mod kernel;
pub mod norm;
pub mod gemm;
pub mod moe;
pub mod loss;
pub mod adamw;
pub mod convert;
pub mod swiglu;
pub mod rope;
pub(crate) mod on_cpu;

use super::{Arg, DSlice, Device, Gemm, Result, Stream};
pub use adamw::{params_hash, AdamHyper, SUMSQ_BLOCKS};
pub use loss::CeState;
use kernel::{Attention, AttentionGrad, BwdScratch, Fa2Dim, Kernel};
pub use moe::{moe_permute_scratch, MOE_CHUNK};

const BLOCK: u32 = 256;
/// Attention, forward and backward, on tensor cores: query rows of one head per block of
/// one warp (`ATTN_MMA_ROWS` in kernels.cu).
const ATTN_MMA_ROWS: usize = 16;

/// The FlashAttention-2 forward's CTA: 4 warps of 16 query rows of one head
/// (`FA2_ROWS`, `FA2_THREADS` in kernels.cu).
const FA2_ROWS: usize = 64;
const FA2_THREADS: u32 = 128;
/// Keys per CTA of the FlashAttention-2 backward (`FA2B_KEYS` in kernels.cu).
const FA2_BWD_KEYS: usize = 64;

/// Blocks of one warp, ATTN_MMA_ROWS query rows of one head each.
fn attention_grid(tq: usize, qh: usize) -> u32 {
    (tq.div_ceil(ATTN_MMA_ROWS) * qh).max(1) as u32
}

fn grid_for(n: usize) -> u32 {
    (n.div_ceil(BLOCK as usize)).clamp(1, 65535) as u32
}

/// Block size for one-block-per-row kernels over rows of width `d`.
fn row_block(d: usize) -> u32 {
    (d.div_ceil(32) * 32).clamp(32, BLOCK as usize) as u32
}

pub use norm::{RMSNORM_BWD_MAX_WIDTH, RMSNORM_BWD_SCRATCH_F32};
/// Whether a forward activation kernel's activations are f32 or bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    F32,
    Bf16,
}

pub(crate) fn i32_of(v: usize) -> Arg {
    Arg::I32(v as i32)
}

pub(crate) fn i64_of(v: usize) -> Arg {
    Arg::I64(v as i64)
}

pub struct Ops {
    pub dev: Box<dyn Device>,
    pub stream: Stream,
    /// Activations in bf16: the forward ops that a target uses (embedding, RMSNorm, RoPE,
    /// attention, SwiGLU, the residual add, the tap copy) take and write bf16 activations
    /// (their `_bf16` kernels; weights of norms, positions, rstd and lse stay f32), and
    /// [`matmul_act`](Self::matmul_act) is bf16 in and out.
    pub act16: bool,
    /// The RMSNorm backward's partial rows ([`RMSNORM_BWD_SCRATCH_F32`] f32), per stream
    /// (by [`Stream::index`]): device memory of these ops', taken at their first use.
    rmsnorm_partials: [Option<DSlice>; 2],
}

impl Ops {
    pub fn new(dev: Box<dyn Device>) -> Ops {
        Ops {
            dev,
            stream: Stream::Compute,
            act16: false,
            rmsnorm_partials: [None; 2],
        }
    }

    fn launch(&mut self, kernel: impl Into<Kernel>, grid: u32, block: u32) -> Result<()> {
        self.dev.launch(self.stream, &kernel.into(), grid, block)
    }

    /// The precision of the forward activation kernels: bf16 when activations are bf16.
    fn act(&self) -> Act {
        if self.act16 {
            Act::Bf16
        } else {
            Act::F32
        }
    }

    /// Elements of an activation buffer.
    fn act_len(&self, s: DSlice) -> usize {
        s.bytes / if self.act16 { 2 } else { 4 }
    }

    /// Attention of `tq` query rows over key spans (`spans`: 4 i32 per row, see
    /// kernels.cu); writes `out` and the log-sum-exp per (row, head) for the backward.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &mut self,
        q: DSlice,
        k: DSlice,
        v: DSlice,
        out: DSlice,
        lse: DSlice,
        spans: DSlice,
        tq: usize,
        qh: usize,
        kvh: usize,
        hd: usize,
    ) -> Result<()> {
        check_heads(qh, kvh, hd)?;
        let a = Attention {
            out,
            lse,
            q,
            k,
            v,
            spans,
            tq,
            qh,
            kvh,
            hd,
        };
        let act = self.act();
        match Fa2Dim::for_call(&a) {
            Some(dim) => self.launch(
                Kernel::AttentionFa2Fwd { act, dim, a },
                (tq.div_ceil(FA2_ROWS) * qh).max(1) as u32,
                FA2_THREADS,
            ),
            None => self.launch(Kernel::AttentionFwd { act, a }, attention_grid(tq, qh), 32),
        }
    }

    /// Backward of [`attention`](Self::attention): `dq`, `dk`, `dv` accumulate. `scratch`
    /// (at least [`attention_backward_scratch`](Self::attention_backward_scratch) f32,
    /// 16-byte aligned) is the FlashAttention-2 backward's.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &mut self,
        dout: DSlice,
        out: DSlice,
        lse: DSlice,
        scratch: DSlice,
        q: DSlice,
        k: DSlice,
        v: DSlice,
        spans: DSlice,
        dq: DSlice,
        dk: DSlice,
        dv: DSlice,
        tq: usize,
        qh: usize,
        kvh: usize,
        hd: usize,
    ) -> Result<()> {
        check_heads(qh, kvh, hd)?;
        let fwd = Attention {
            out,
            lse,
            q,
            k,
            v,
            spans,
            tq,
            qh,
            kvh,
            hd,
        };
        let g = AttentionGrad {
            fwd,
            dout,
            dq,
            dk,
            dv,
        };
        let Some(dim) = Fa2Dim::for_backward(&g) else {
            return self.launch(Kernel::AttentionBwd(g), attention_grid(tq, qh), 32);
        };
        let need = BwdScratch::bytes(tq, qh, hd);
        if scratch.bytes < need || scratch.ptr % 16 != 0 {
            return Err(super::GpuError::Invalid(format!(
                "attention backward: its scratch is {} bytes at {:#x}; {tq} rows × {qh} heads of {hd} need {need}, 16-byte aligned",
                scratch.bytes, scratch.ptr
            )));
        }
        let (s, tk) = (
            BwdScratch::at(scratch, tq, qh, hd),
            k.len_f32() / (kvh * hd),
        );
        self.launch(
            Kernel::AttentionBwdPrep { g, s },
            (tq * qh).div_ceil(4).max(1) as u32,
            FA2_THREADS,
        )?;
        self.launch(
            Kernel::AttentionFa2Bwd { dim, g, s, tk },
            (tk.div_ceil(FA2_BWD_KEYS) * kvh).max(1) as u32,
            FA2_THREADS,
        )
    }

    /// The f32 of scratch [`attention_backward`](Self::attention_backward) needs for
    /// `tq` query rows of `qh` heads of `hd`.
    pub fn attention_backward_scratch(tq: usize, qh: usize, hd: usize) -> usize {
        BwdScratch::bytes(tq, qh, hd).div_ceil(4)
    }

}

fn check_heads(qh: usize, kvh: usize, hd: usize) -> Result<()> {
    if hd == 0 || hd > 256 || kvh == 0 || qh % kvh != 0 {
        return Err(super::GpuError::Invalid(format!("attention: {qh} query heads, {kvh} KV heads, head_dim {hd} (head_dim ≤ 256, heads a multiple of KV heads)")));
    }
    Ok(())
}
