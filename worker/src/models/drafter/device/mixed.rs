//! Mixed precision for the drafter's GEMMs: a weight as its f32 master copy and its bf16
//! copy ([`W`]), and [`Mixed`], which casts a GEMM's input or incoming gradient to bf16
//! on a GPU (tensor cores, f32 accumulation) and keeps f32 throughout on the CPU device.
//! Operands are [`Mat`]s: a GEMM's sizes come from its operands' shapes.

use crate::device::ops::gemm::Dx;
use crate::device::ops::{DType, Mat, Ops};
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
    /// The GEMMs' input type: bf16 on a GPU, f32 on the CPU device.
    pub(super) fn dtype(&self) -> DType {
        DType::of(self.bf16)
    }

    /// A GEMM-input activation buffer (`x`, `x2`, `act`, `ctx`) as a `rows × cols`
    /// matrix: bf16 on a GPU, where its producer writes it rounded (the GEMMs' input, and
    /// the only copy the backward needs), else f32.
    pub(super) fn gemm_act(&self, buf: DSlice, rows: usize, cols: usize) -> Mat {
        Mat::new(buf, rows, cols, self.dtype())
    }

    /// Floats to allocate for a [`gemm_act`](Self::gemm_act) buffer of `n` elements.
    pub(super) fn gemm_act_floats(bf16: bool, n: usize) -> usize {
        if bf16 {
            n.div_ceil(2)
        } else {
            n
        }
    }

    /// Weight `w` as the `rows × cols` matrix the GEMMs read.
    pub(super) fn weight(&self, w: W, rows: usize, cols: usize) -> Mat {
        if self.bf16 {
            Mat::bf16(w.b, rows, cols)
        } else {
            Mat::f32(w.f, rows, cols)
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

    /// `x` (f32) as the GEMMs take it: on a GPU cast to bf16 into the input scratch (once
    /// for every GEMM that reads it, until the next `input`), else `x` itself.
    pub(super) fn input(&self, ops: &mut Ops, x: Mat) -> Result<Mat> {
        if !self.bf16 {
            return Ok(x);
        }
        let xb = Mat::bf16(self.xb, x.rows, x.cols);
        ops.f32_to_bf16(xb.buf, x.buf)?;
        Ok(xb)
    }

    /// `y = x · wᵀ` for f32 `x` (m×k) and `y` (m×n).
    pub(super) fn mm(&self, ops: &mut Ops, x: Mat, w: W, y: Mat) -> Result<()> {
        let xin = self.input(ops, x)?;
        self.mm_in(ops, xin, w, y)
    }

    /// [`mm`](Self::mm) of an [`input`](Self::input) (or a GEMM-input buffer).
    pub(super) fn mm_in(&self, ops: &mut Ops, xin: Mat, w: W, y: Mat) -> Result<()> {
        let w = self.weight(w, y.cols, xin.cols);
        ops.matmul(xin, w, y)
    }

    /// Backward of [`mm`](Self::mm) for f32 `x`: `dx` as [`Dx`] says, `dw += dyᵀ · x`.
    pub(super) fn mm_back(
        &self,
        ops: &mut Ops,
        (dy, x): (Mat, Mat),
        w: W,
        dx: Dx,
        dw: Option<Mat>,
    ) -> Result<()> {
        let xin = if dw.is_some() { self.input(ops, x)? } else { x };
        self.back_in(ops, (dy, xin), w, dx, dw)
    }

    /// [`mm_back`](Self::mm_back) of an [`input`](Self::input) `xin` (read only for `dw`;
    /// its shape gives the GEMM's inner size): the f32 `dy` cast to bf16 on a GPU.
    pub(super) fn back_in(
        &self,
        ops: &mut Ops,
        (dy, xin): (Mat, Mat),
        w: W,
        dx: Dx,
        dw: Option<Mat>,
    ) -> Result<()> {
        let dy = if self.bf16 {
            let yb = Mat::bf16(self.yb, dy.rows, dy.cols);
            ops.f32_to_bf16(yb.buf, dy.buf)?;
            yb
        } else {
            dy
        };
        let w = self.weight(w, dy.cols, xin.cols);
        ops.matmul_backward(dy, xin, w, dx, dw)
    }
}
