//! Typed views of device memory: a [`Mat`] carries its buffer, its shape and its element
//! type ([`DType`]), as candle's layout and dtype ride with the storage, so that an op
//! reads its operands' sizes and precision from them (`matmul(x, w, y)`), and a mismatch
//! is an error at the launch rather than a wrong result.

use crate::device::{DSlice, GpuError, Result};

/// An element type on the device: f32, or bf16 (a GPU's activations and GEMM inputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
}

impl DType {
    /// The kernel symbol for this element type: `f32`'s or `bf16`'s.
    pub fn pick(self, f32: &'static str, bf16: &'static str) -> &'static str {
        match self {
            DType::F32 => f32,
            DType::Bf16 => bf16,
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }

    /// bf16 when `bf16`, else f32.
    pub fn of(bf16: bool) -> DType {
        if bf16 {
            DType::Bf16
        } else {
            DType::F32
        }
    }
}

/// A row-major matrix on a device: `rows × cols` elements of `dtype` at `buf`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mat {
    pub buf: DSlice,
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
}

impl Mat {
    /// The first `rows × cols` elements of `buf`, as a matrix of `dtype` (panics when the
    /// buffer is smaller, as [`DSlice::sub`] does).
    pub fn new(buf: DSlice, rows: usize, cols: usize, dtype: DType) -> Mat {
        Mat {
            buf: buf.sub(dtype.bytes(), 0..rows * cols),
            rows,
            cols,
            dtype,
        }
    }

    /// [`new`](Self::new) of f32.
    pub fn f32(buf: DSlice, rows: usize, cols: usize) -> Mat {
        Mat::new(buf, rows, cols, DType::F32)
    }

    /// [`new`](Self::new) of bf16.
    pub fn bf16(buf: DSlice, rows: usize, cols: usize) -> Mat {
        Mat::new(buf, rows, cols, DType::Bf16)
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// No elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An error unless this matrix is `rows × cols` of `dtype`; `what` names it in the
    /// message (an op and its operand, `"matmul: y"`).
    pub fn check(&self, what: &str, rows: usize, cols: usize, dtype: DType) -> Result<()> {
        if (self.rows, self.cols, self.dtype) == (rows, cols, dtype) {
            return Ok(());
        }
        Err(GpuError::Invalid(format!(
            "{what}: a {}×{} {:?} matrix where {rows}×{cols} {dtype:?} was expected",
            self.rows, self.cols, self.dtype
        )))
    }
}
