//! Rotary embedding, in place (`cuda/rope.cuh`): the kernel and its arguments, its launch
//! on [`Ops`], and its CPU body (what the CPU device runs).

#![allow(clippy::needless_range_loop)] // the CPU bodies index several buffers by one row/element index, as the CUDA source does

use super::on_cpu::{need, rd, wr, Widened};
use super::{i32_of, row_block, DType, Mat, Ops};
use crate::device::{Arg, DSlice, Result};

/// The rotary embedding's kernel, with its arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rope {
    /// Rotary embedding in place (`pos` i32 per row, `inv_freq` head_dim/2), scaled by
    /// `scale`; `inverse` rotates back (the backward).
    Apply {
        act: DType,
        x: DSlice,
        pos: DSlice,
        inv_freq: DSlice,
        heads: usize,
        head_dim: usize,
        scale: f32,
        inverse: bool,
    },
}

impl Rope {
    /// Bytes of dynamic shared memory: none for these kernels.
    pub fn dynamic_shared_bytes(&self) -> u32 {
        0
    }

    /// The kernel's symbol in the CUDA source.
    pub fn name(&self) -> &'static str {
        match *self {
            Rope::Apply { act: a, .. } => a.pick("rope", "rope_bf16"),
        }
    }

    /// The arguments as the kernel's C parameters, in order: each buffer marked as the
    /// kernel reads it, writes it, or both; each scalar of its parameter's C type.
    pub fn args(&self) -> Vec<Arg> {
        use Arg::{F32, R, RW};
        match *self {
            Rope::Apply {
                x,
                pos,
                inv_freq,
                heads,
                head_dim,
                scale,
                inverse,
                ..
            } => vec![
                RW(x),
                R(pos),
                R(inv_freq),
                i32_of(heads),
                i32_of(head_dim),
                F32(scale),
                Arg::I32(inverse as i32),
            ],
        }
    }

    /// One launch of each kernel (each of its symbols), all buffers `b`.
    pub fn every(b: DSlice) -> Vec<Rope> {
        let mut all = Vec::new();
        for act in [DType::F32, DType::Bf16] {
            all.extend([Rope::Apply {
                act,
                x: b,
                pos: b,
                inv_freq: b,
                heads: 1,
                head_dim: 2,
                scale: 1.0,
                inverse: false,
            }]);
        }
        all
    }

    /// The f32 kernel a bf16 one runs as on the CPU, over `w`'s temporaries; `None` for a
    /// kernel that is f32 already.
    ///
    /// # Safety
    /// The kernel's buffers are the CPU device's memory.
    pub(crate) unsafe fn as_f32(&self, w: &mut Widened) -> Option<Rope> {
        let mut k = *self;
        match &mut k {
            Rope::Apply { act, x, .. } if *act == DType::Bf16 => {
                *x = w.output(*x);
                *act = DType::F32;
            }
            _ => return None,
        }
        Some(k)
    }

    /// The kernel on the CPU over `rows` (the launch's grid), f32 (a bf16 one runs as
    /// its f32 kernel).
    ///
    /// # Safety
    /// The buffers are the CPU device's memory, not aliased.
    pub(crate) unsafe fn run_cpu(&self, rows: usize, _threads: usize) -> Result<()> {
        match *self {
            Rope::Apply {
                x,
                pos,
                inv_freq,
                heads,
                head_dim,
                scale,
                inverse,
                ..
            } => rope(
                rows,
                wr(x),
                rd(pos),
                rd(inv_freq),
                (heads, head_dim),
                scale,
                inverse,
            ),
            #[allow(unreachable_patterns)]
            _ => Err(crate::device::GpuError::Invalid(format!(
                "{} runs as its f32 kernel on the CPU",
                self.name()
            ))),
        }
    }
}

impl Ops {
    /// Rotary embedding of the rows of `x` in place, each `x.cols / head_dim` heads of
    /// `head_dim` (f32, or bf16 activations); `pos`: i32 per row; `inv_freq`: head_dim/2
    /// f32.
    pub fn rope(
        &mut self,
        x: Mat,
        pos: DSlice,
        inv_freq: DSlice,
        head_dim: usize,
        scale: f32,
        inverse: bool,
    ) -> Result<()> {
        let (rows, heads) = (x.rows, x.cols / head_dim.max(1));
        if heads * head_dim != x.cols {
            return Err(crate::device::GpuError::Invalid(format!(
                "rope: rows of {} for heads of {head_dim}",
                x.cols
            )));
        }
        self.launch(
            Rope::Apply {
                act: x.dtype,
                x: x.buf,
                pos,
                inv_freq,
                heads,
                head_dim,
                scale,
                inverse,
            },
            rows as u32,
            row_block(heads * head_dim / 2),
        )
    }
}

fn rope(
    rows: usize,
    x: &mut [f32],
    pos: &[i32],
    inv_freq: &[f32],
    (heads, hd): (usize, usize),
    scale: f32,
    inverse: bool,
) -> Result<()> {
    let kernel = "rope";
    let half = hd / 2;
    need(kernel, "x", x.len(), rows * heads * hd)?;
    need(kernel, "pos", pos.len(), rows)?;
    need(kernel, "inv_freq", inv_freq.len(), half)?;
    for r in 0..rows {
        let p = pos[r] as f32;
        for i in 0..half {
            let (mut s, c) = (p * inv_freq[i]).sin_cos();
            s *= scale;
            let c = c * scale;
            if inverse {
                s = -s;
            }
            for h in 0..heads {
                let base = r * heads * hd + h * hd;
                let (x1, x2) = (x[base + i], x[base + i + half]);
                x[base + i] = x1 * c - x2 * s;
                x[base + i + half] = x2 * c + x1 * s;
            }
        }
    }
    Ok(())
}
