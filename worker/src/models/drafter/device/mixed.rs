//! Mixed precision for the drafter's GEMMs: a weight as its f32 master copy and its bf16
//! copy ([`W`]), and [`Mixed`], which casts a GEMM's input or incoming gradient to bf16
//! on a GPU (tensor cores, f32 accumulation) and keeps f32 throughout on the CPU device.

use crate::device::ops::Ops;
use crate::device::{DSlice, Result};

/// An absent buffer (the bf16 copy on the CPU device, the f32 one of a bf16-only weight).
pub(super) const NONE: DSlice = DSlice { ptr: 0, bytes: 0 };

/// A weight for a GEMM: its f32 master copy and its bf16 copy (whichever the device uses;
/// the other may be [`NONE`]).
#[derive(Clone, Copy)]
pub(super) struct W {
    pub(super) f: DSlice,
    pub(super) b: DSlice,
}

/// Mixed precision: on a GPU every GEMM takes bf16 inputs (the weights' bf16 copies, the
/// activation or incoming gradient cast just before into the scratch buffers) and
/// accumulates in f32, on tensor cores; the CPU device keeps f32 throughout.
#[derive(Clone, Copy)]
pub(super) struct Mixed {
    pub(super) bf16: bool,
    pub(super) xb: DSlice,
    pub(super) yb: DSlice,
}

impl Mixed {
    /// `n` elements of a GEMM-input activation buffer (`x`, `x2`, `act`, `ctx`): bf16 on
    /// a GPU, where its producer writes it rounded (the GEMMs' input, and the only copy the
    /// backward needs), else f32.
    pub(super) fn gemm_act(&self, buf: DSlice, n: usize) -> DSlice {
        if self.bf16 {
            buf.sub(2, 0..n)
        } else {
            buf.f32s(0..n)
        }
    }

    /// Floats to allocate for a [`gemm_act`](Self::gemm_act) buffer of `n` elements.
    pub(super) fn gemm_act_floats(bf16: bool, n: usize) -> usize {
        if bf16 {
            n.div_ceil(2)
        } else {
            n
        }
    }

    /// RMSNorm of f32 rows into a GEMM-input buffer ([`gemm_act`](Self::gemm_act)).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm(
        &self,
        ops: &mut Ops,
        x: DSlice,
        w: DSlice,
        y: DSlice,
        rstd: DSlice,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<()> {
        if self.bf16 {
            ops.rmsnorm_to_bf16(x, w, y, rstd, rows, d, eps)
        } else {
            ops.rmsnorm(x, w, y, rstd, rows, d, eps)
        }
    }

    /// SwiGLU of the fused f32 gate/up rows into a GEMM-input buffer.
    pub(super) fn swiglu(
        &self,
        ops: &mut Ops,
        gu: DSlice,
        out: DSlice,
        width: usize,
    ) -> Result<()> {
        if self.bf16 {
            ops.swiglu_gu_to_bf16(gu, out, width)
        } else {
            ops.swiglu_gu(gu, out, width)
        }
    }

    /// `x` (`len` f32) as the GEMMs take it: on a GPU cast to bf16 into the input scratch
    /// (once for every GEMM that reads it, until the next `input`), else `x` itself.
    pub(super) fn input(&self, ops: &mut Ops, x: DSlice, len: usize) -> Result<DSlice> {
        if !self.bf16 {
            return Ok(x);
        }
        let xb = self.xb.sub(2, 0..len);
        ops.f32_to_bf16(xb, x.f32s(0..len))?;
        Ok(xb)
    }

    /// `y = x · wᵀ` (`x` m×k, `w` n×k).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mm(
        &self,
        ops: &mut Ops,
        x: DSlice,
        w: W,
        y: DSlice,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        let xin = self.input(ops, x, m * k)?;
        self.mm_in(ops, xin, w, y, m, k, n)
    }

    /// [`mm`](Self::mm) of an [`input`](Self::input).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mm_in(
        &self,
        ops: &mut Ops,
        xin: DSlice,
        w: W,
        y: DSlice,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        if self.bf16 {
            ops.matmul_bf16(xin, w.b, y, m, k, n)
        } else {
            ops.matmul(xin, w.f, y, m, k, n)
        }
    }

    /// Backward of [`mm`](Self::mm): `dx += dy · w`, `dw += dyᵀ · x`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mm_back(
        &self,
        ops: &mut Ops,
        dy: DSlice,
        x: DSlice,
        w: W,
        dx: Option<DSlice>,
        dw: Option<DSlice>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        let xin = if dw.is_some() {
            self.input(ops, x, m * k)?
        } else {
            x
        };
        self.back_in(ops, dy, xin, w, dx.map(|d| (d, false)), dw, m, k, n)
    }

    /// [`mm_back`](Self::mm_back) with `dx` written, not added into: `dx = dy · w`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mm_back_over(
        &self,
        ops: &mut Ops,
        dy: DSlice,
        x: DSlice,
        w: W,
        dx: DSlice,
        dw: Option<DSlice>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        let xin = if dw.is_some() {
            self.input(ops, x, m * k)?
        } else {
            x
        };
        self.back_in(ops, dy, xin, w, Some((dx, true)), dw, m, k, n)
    }

    /// [`mm_back`](Self::mm_back) of an [`input`](Self::input) `xin` (read only for `dw`),
    /// `dx` added into (`false`) or written (`true`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn back_in(
        &self,
        ops: &mut Ops,
        dy: DSlice,
        xin: DSlice,
        w: W,
        dx: Option<(DSlice, bool)>,
        dw: Option<DSlice>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        let (dy, w) = if self.bf16 {
            let yb = self.yb.sub(2, 0..m * n);
            ops.f32_to_bf16(yb, dy)?;
            (yb, w.b)
        } else {
            (dy, w.f)
        };
        match dx {
            Some((dx, true)) => ops.matmul_backward_over(dy, xin, w, dx, dw, m, k, n, self.bf16),
            dx if self.bf16 => ops.matmul_backward_bf16(dy, xin, w, dx.map(|d| d.0), dw, m, k, n),
            dx => ops.matmul_backward(dy, xin, w, dx.map(|d| d.0), dw, m, k, n),
        }
    }
}
