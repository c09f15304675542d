//! The op families, one room each (`gemm`, `norm`, `rope`, `attention`, `swiglu`, `moe`,
//! `loss`, `adamw`, `convert`): a family's kernels as a typed enum (their arguments by name,
//! beside `cuda/<family>.cuh`), their launches as typed methods of [`Ops`] on the compute
//! stream, and their CPU bodies. [`Kernel`] is the enum over the families. The launches are
//! the GPU counterpart of the reference op set (`reference::ops::Cpu`, test-only), with the
//! same layouts and the same accumulate-or-overwrite semantics, so that each can be checked
//! against it. Buffers are [`DSlice`]s of f32 unless said otherwise; a matrix operand is a
//! [`Mat`] (`view`), which carries its shape and element type, so that an op reads them
//! from its arguments rather than from its name.

pub mod adamw;
pub mod attention;
pub mod convert;
pub mod gemm;
pub mod kernel;
pub mod loss;
pub mod moe;
pub mod norm;
pub(crate) mod on_cpu;
pub mod rope;
pub mod swiglu;
pub mod view;

use super::{Arg, DSlice, Device, Result, Stream};
pub use adamw::{params_hash, AdamBuffers, AdamHyper, SUMSQ_BLOCKS};
pub use attention::{Attention, AttentionGrad, BwdScratch, Fa2Dim};
use kernel::Kernel;
pub use loss::CeState;
pub use moe::{moe_permute_scratch, MOE_CHUNK};

const BLOCK: u32 = 256;
fn grid_for(n: usize) -> u32 {
    (n.div_ceil(BLOCK as usize)).clamp(1, 65535) as u32
}

/// Block size for one-block-per-row kernels over rows of width `d`.
fn row_block(d: usize) -> u32 {
    (d.div_ceil(32) * 32).clamp(32, BLOCK as usize) as u32
}

pub use norm::{RMSNORM_BWD_MAX_WIDTH, RMSNORM_BWD_SCRATCH_F32};
pub use view::{DType, Mat};

pub(crate) fn i32_of(v: usize) -> Arg {
    Arg::I32(v as i32)
}

pub(crate) fn i64_of(v: usize) -> Arg {
    Arg::I64(v as i64)
}

pub struct Ops {
    pub dev: Box<dyn Device>,
    pub stream: Stream,
    /// Activations in bf16: the ops that take bare buffers of activations (embedding,
    /// attention, SwiGLU, the residual add, the experts' GEMM) read and write bf16 (their
    /// `_bf16` kernels; weights of norms, positions, rstd and lse stay f32), and
    /// [`act_mat`](Self::act_mat) makes bf16 matrices for the ops that take [`Mat`]s.
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
    pub fn act(&self) -> DType {
        if self.act16 {
            DType::Bf16
        } else {
            DType::F32
        }
    }

    /// The first `rows × cols` elements of `buf` as a matrix of activations (bf16 when
    /// activations are bf16, else f32).
    pub fn act_mat(&self, buf: DSlice, rows: usize, cols: usize) -> Mat {
        Mat::new(buf, rows, cols, self.act())
    }

    /// Elements of an activation buffer.
    fn act_len(&self, s: DSlice) -> usize {
        s.bytes / if self.act16 { 2 } else { 4 }
    }
}
