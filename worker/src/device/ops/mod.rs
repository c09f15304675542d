//! One typed method per kernel of `cuda/kernels.cu` ([`Kernel`]), on the compute stream: the GPU
//! counterpart of the reference op set (`reference::ops::Cpu`, test-only), with the same
//! layouts and the same accumulate-or-overwrite semantics, so that each can be checked
//! against it. Buffers are [`DSlice`]s of f32 unless said otherwise.

pub mod kernel;
pub mod norm;
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
use kernel::{Attention, AttentionGrad, BwdScratch, Fa2Dim, Kernel, MOE_GEMM_THREADS};
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

    /// [`matmul`](Self::matmul) on activations: with bf16 activations, bf16 `x`, `w` and
    /// `y` (f32 accumulation, one rounding of the result); else f32.
    pub fn matmul_act(
        &mut self,
        x: DSlice,
        w: DSlice,
        y: DSlice,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        self.linear(x, w, y, m, k, n, self.act16, self.act16)
    }

    /// `y = x · wᵀ` as one cuBLAS-convention GEMM, with bf16 inputs and/or output.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &mut self,
        x: DSlice,
        w: DSlice,
        y: DSlice,
        m: usize,
        k: usize,
        n: usize,
        bf16_inputs: bool,
        bf16_output: bool,
    ) -> Result<()> {
        let g = Gemm {
            transa: true,
            transb: false,
            m: n,
            n: m,
            k,
            alpha: 1.0,
            a: w,
            lda: k,
            b: x,
            ldb: k,
            beta: 0.0,
            c: y,
            ldc: n,
            bf16_inputs,
            bf16_output,
        };
        self.dev.gemm(self.stream, &g)
    }

    /// `y[m,n] = x[m,k] · w[n,k]ᵀ` (row-major), as one cuBLAS-convention GEMM:
    /// column-major `yᵀ = op(w)·xᵀ` with `op = T`.
    pub fn matmul(
        &mut self,
        x: DSlice,
        w: DSlice,
        y: DSlice,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        self.linear(x, w, y, m, k, n, false, false)
    }

    /// [`matmul`](Self::matmul) with `x` and `w` in bf16 (`y` f32, f32 accumulation).
    pub fn matmul_bf16(
        &mut self,
        x: DSlice,
        w: DSlice,
        y: DSlice,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        self.linear(x, w, y, m, k, n, true, false)
    }

    /// [`matmul`](Self::matmul) with `x`, `w` and `y` in bf16 (f32 accumulation, `y`
    /// rounded once).
    pub fn matmul_bf16_out(
        &mut self,
        x: DSlice,
        w: DSlice,
        y: DSlice,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        self.linear(x, w, y, m, k, n, true, true)
    }

    /// Backward of [`matmul`](Self::matmul): `dx += dy · w`, `dw += dyᵀ · x`.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward(
        &mut self,
        dy: DSlice,
        x: DSlice,
        w: DSlice,
        dx: Option<DSlice>,
        dw: Option<DSlice>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        self.matmul_backward_ex(dy, x, w, (dx, 1.0), dw, m, k, n, false)
    }

    /// [`matmul_backward`](Self::matmul_backward) with `dy`, `x` and `w` in bf16 (`dx`
    /// and `dw` f32, f32 accumulation).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward_bf16(
        &mut self,
        dy: DSlice,
        x: DSlice,
        w: DSlice,
        dx: Option<DSlice>,
        dw: Option<DSlice>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        self.matmul_backward_ex(dy, x, w, (dx, 1.0), dw, m, k, n, true)
    }

    /// [`matmul_backward`](Self::matmul_backward) (`bf16` inputs or f32) with `dx`
    /// written, not added into: `dx = dy · w` (a first writer needs no zeroed buffer).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward_over(
        &mut self,
        dy: DSlice,
        x: DSlice,
        w: DSlice,
        dx: DSlice,
        dw: Option<DSlice>,
        m: usize,
        k: usize,
        n: usize,
        bf16: bool,
    ) -> Result<()> {
        self.matmul_backward_ex(dy, x, w, (Some(dx), 0.0), dw, m, k, n, bf16)
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul_backward_ex(
        &mut self,
        dy: DSlice,
        x: DSlice,
        w: DSlice,
        (dx, dx_beta): (Option<DSlice>, f32),
        dw: Option<DSlice>,
        m: usize,
        k: usize,
        n: usize,
        bf16_inputs: bool,
    ) -> Result<()> {
        if let Some(dx) = dx {
            // column-major dxᵀ[k,m] (+)= w_c[k,n] · dy_c[n,m]
            let g = Gemm {
                transa: false,
                transb: false,
                m: k,
                n: m,
                k: n,
                alpha: 1.0,
                a: w,
                lda: k,
                b: dy,
                ldb: n,
                beta: dx_beta,
                c: dx,
                ldc: k,
                bf16_inputs,
                bf16_output: false,
            };
            self.dev.gemm(self.stream, &g)?;
        }
        if let Some(dw) = dw {
            // column-major dwᵀ[k,n] += x_c[k,m] · (dy_c[n,m])ᵀ
            let g = Gemm {
                transa: false,
                transb: true,
                m: k,
                n,
                k: m,
                alpha: 1.0,
                a: x,
                lda: k,
                b: dy,
                ldb: n,
                beta: 1.0,
                c: dw,
                ldc: k,
                bf16_inputs,
                bf16_output: false,
            };
            self.dev.gemm(self.stream, &g)?;
        }
        Ok(())
    }

    /// The experts' grouped GEMM, one launch for every expert: for each of the `pairs`
    /// routed rows r of expert e (`offsets`, i32 `[experts + 1]`, on the device: the host
    /// never reads them), `y[r,:] = x[src(r),:] · W_eᵀ` with `W_e` the `[n, k]` matrix at
    /// `w + e·n·k`; `src(r) = rows[r]` (i32) when `gather` is `Some((rows, x_rows))`,
    /// else r. Activations as [`matmul_act`](Self::matmul_act): bf16 `x`, `w` and `y`
    /// on tensor cores, or f32.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gemm(
        &mut self,
        y: DSlice,
        x: DSlice,
        w: DSlice,
        offsets: DSlice,
        gather: Option<(DSlice, usize)>,
        (pairs, experts): (usize, usize),
        n: usize,
        k: usize,
    ) -> Result<()> {
        let grid = Kernel::moe_gemm_grid(pairs, experts, n);
        if grid == 0 {
            return Ok(());
        }
        let grid = u32::try_from(grid)
            .ok()
            .filter(|&g| g <= i32::MAX as u32)
            .ok_or_else(|| {
                super::GpuError::Invalid(format!(
                    "moe_gemm: {grid} CTAs for {pairs} rows, {experts} experts and {n} columns: \
                     more than a grid holds"
                ))
            })?;
        let (rows, gather) = gather.unwrap_or((offsets, 0));
        let act = self.act();
        self.launch(
            Kernel::MoeGemm {
                act,
                y,
                x,
                w,
                offsets,
                rows,
                gather,
                experts,
                pairs,
                n,
                k,
            },
            grid,
            MOE_GEMM_THREADS,
        )
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
