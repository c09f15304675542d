//! SwiGLU over split or fused gate/up projections, forward and backward (`cuda/swiglu.cuh`):
//! the kernels and their arguments, their launches on [`Ops`], and their CPU bodies.

#![allow(clippy::needless_range_loop)] // the CPU bodies index several buffers by one row/element index, as the CUDA source does

use super::on_cpu::{need, rd, wr, Widened};
use super::{grid_for, i32_of, i64_of, DType, Ops, BLOCK};
use crate::device::{Arg, DSlice, GpuError, Result};

/// The SwiGLU kernels, each with its arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Swiglu {
    /// `out = silu(gate)·up`, `n` elements.
    Fwd {
        act: DType,
        out: DSlice,
        gate: DSlice,
        up: DSlice,
        n: usize,
    },
    /// SwiGLU over a fused gate/up projection: row r of `gu` is `[gate | up]`, each
    /// `width` wide (one GEMM over the adjacent gate and up weights); `out = silu(gate)·up`,
    /// `n` = rows × width elements.
    GuFwd {
        act: DType,
        out: DSlice,
        gu: DSlice,
        width: usize,
        n: usize,
    },
    /// [`Swiglu::GuFwd`] of f32 rows with `out` rounded to bf16 (a GEMM's input).
    GuFwdToBf16 {
        out: DSlice,
        gu: DSlice,
        width: usize,
        n: usize,
    },
    /// The backward of [`Swiglu::GuFwd`]: row r of `dgu` = `[dgate | dup]`, written
    /// (not accumulated: nothing else adds into it, so it needs no zeroing first).
    GuBwd {
        dgu: DSlice,
        dout: DSlice,
        gu: DSlice,
        width: usize,
        n: usize,
    },
}

impl Swiglu {
    /// Bytes of dynamic shared memory: none for these kernels.
    pub fn dynamic_shared_bytes(&self) -> u32 {
        0
    }

    /// The kernel's symbol in the CUDA source.
    pub fn name(&self) -> &'static str {
        match *self {
            Swiglu::Fwd { act: a, .. } => a.pick("swiglu_fwd", "swiglu_fwd_bf16"),
            Swiglu::GuFwd { act: a, .. } => a.pick("swiglu_gu_fwd", "swiglu_gu_fwd_bf16"),
            Swiglu::GuFwdToBf16 { .. } => "swiglu_gu_fwd_to_bf16",
            Swiglu::GuBwd { .. } => "swiglu_gu_bwd",
        }
    }

    /// The arguments as the kernel's C parameters, in order: each buffer marked as the
    /// kernel reads it, writes it, or both; each scalar of its parameter's C type.
    pub fn args(&self) -> Vec<Arg> {
        use Arg::{R, W};
        match *self {
            Swiglu::Fwd {
                out, gate, up, n, ..
            } => vec![W(out), R(gate), R(up), i64_of(n)],
            Swiglu::GuFwd {
                out, gu, width, n, ..
            }
            | Swiglu::GuFwdToBf16 {
                out, gu, width, n, ..
            } => vec![W(out), R(gu), i32_of(width), i64_of(n)],
            Swiglu::GuBwd {
                dgu,
                dout,
                gu,
                width,
                n,
            } => vec![W(dgu), R(dout), R(gu), i32_of(width), i64_of(n)],
        }
    }

    /// One launch of each kernel (each of its symbols), all buffers `b`.
    pub fn every(b: DSlice) -> Vec<Swiglu> {
        let mut all = Vec::new();
        for act in [DType::F32, DType::Bf16] {
            all.extend([
                Swiglu::Fwd {
                    act,
                    out: b,
                    gate: b,
                    up: b,
                    n: 1,
                },
                Swiglu::GuFwd {
                    act,
                    out: b,
                    gu: b,
                    width: 1,
                    n: 1,
                },
            ]);
        }
        all.extend([
            Swiglu::GuBwd {
                dgu: b,
                dout: b,
                gu: b,
                width: 1,
                n: 1,
            },
            Swiglu::GuFwdToBf16 {
                out: b,
                gu: b,
                width: 1,
                n: 1,
            },
        ]);
        all
    }

    /// The f32 kernel a bf16 one runs as on the CPU, over `w`'s temporaries; `None` for a
    /// kernel that is f32 already.
    ///
    /// # Safety
    /// The kernel's buffers are the CPU device's memory.
    pub(crate) unsafe fn as_f32(&self, w: &mut Widened) -> Option<Swiglu> {
        let mut k = *self;
        match &mut k {
            Swiglu::Fwd {
                act, out, gate, up, ..
            } if *act == DType::Bf16 => {
                (*out, *gate, *up) = (w.output(*out), w.input(*gate), w.input(*up));
                *act = DType::F32;
            }
            Swiglu::GuFwd { act, out, gu, .. } if *act == DType::Bf16 => {
                (*out, *gu) = (w.output(*out), w.input(*gu));
                *act = DType::F32;
            }
            Swiglu::GuFwdToBf16 { out, gu, width, n } => {
                return Some(Swiglu::GuFwd {
                    act: DType::F32,
                    out: w.output(*out),
                    gu: *gu,
                    width: *width,
                    n: *n,
                });
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
    pub(crate) unsafe fn run_cpu(&self, _rows: usize, _threads: usize) -> Result<()> {
        match *self {
            Swiglu::Fwd {
                out, gate, up, n, ..
            } => swiglu_fwd(wr(out), rd(gate), rd(up), n),
            Swiglu::GuFwd {
                out, gu, width, n, ..
            } => swiglu_gu_fwd(wr(out), rd(gu), width, n),
            Swiglu::GuBwd {
                dgu,
                dout,
                gu,
                width,
                n,
            } => swiglu_gu_bwd(wr(dgu), rd(dout), rd(gu), width, n),
            Swiglu::GuFwdToBf16 { .. } => Err(crate::device::GpuError::Invalid(format!(
                "{} runs as its f32 kernel on the CPU",
                self.name()
            ))),
        }
    }
}

impl Ops {
    pub fn swiglu(&mut self, gate: DSlice, up: DSlice, out: DSlice) -> Result<()> {
        let (n, act) = (self.act_len(out), self.act());
        self.launch(
            Swiglu::Fwd {
                act,
                out,
                gate,
                up,
                n,
            },
            grid_for(n),
            BLOCK,
        )
    }

    /// SwiGLU of a fused gate/up projection: `out` (rows × `width`) from `gu`, whose rows
    /// are `[gate | up]` (2 × `width` each).
    pub fn swiglu_gu(&mut self, gu: DSlice, out: DSlice, width: usize) -> Result<()> {
        let (n, act) = (self.act_len(out), self.act());
        self.launch(
            Swiglu::GuFwd {
                act,
                out,
                gu,
                width,
                n,
            },
            grid_for(n),
            BLOCK,
        )
    }

    /// [`swiglu_gu`](Self::swiglu_gu) of f32 rows with `out` (rows × `width`) rounded to
    /// bf16: a GEMM's input written as the GEMM takes it.
    pub fn swiglu_gu_to_bf16(&mut self, gu: DSlice, out: DSlice, width: usize) -> Result<()> {
        let n = out.bytes / 2;
        self.launch(
            Swiglu::GuFwdToBf16 { out, gu, width, n },
            grid_for(n),
            BLOCK,
        )
    }

    /// The backward of [`swiglu_gu`](Self::swiglu_gu): `dgu`'s rows `[dgate | dup]`
    /// written (f32).
    pub fn swiglu_gu_backward(
        &mut self,
        dout: DSlice,
        gu: DSlice,
        dgu: DSlice,
        width: usize,
    ) -> Result<()> {
        let n = dout.len_f32();
        self.launch(
            Swiglu::GuBwd {
                dgu,
                dout,
                gu,
                width,
                n,
            },
            grid_for(n),
            BLOCK,
        )
    }
}

fn swiglu_fwd(out: &mut [f32], gate: &[f32], up: &[f32], n: usize) -> Result<()> {
    let have = out.len().min(gate.len()).min(up.len());
    need("swiglu_fwd", "buffers", have, n)?;
    for i in 0..n {
        let g = gate[i];
        let s = 1.0 / (1.0 + (-g).exp());
        out[i] = g * s * up[i];
    }
    Ok(())
}

/// `out = silu(gate)·up` over `gu`'s rows `[gate | up]` (each `width` wide).
fn swiglu_gu_fwd(out: &mut [f32], gu: &[f32], width: usize, n: usize) -> Result<()> {
    need("swiglu_gu_fwd", "out", out.len(), n)?;
    need("swiglu_gu_fwd", "gu", gu.len(), 2 * n)?;
    if width == 0 || n % width != 0 {
        return Err(GpuError::Invalid(format!(
            "swiglu_gu_fwd: {n} elements are not rows of width {width}"
        )));
    }
    for (o, row) in out[..n]
        .chunks_exact_mut(width)
        .zip(gu.chunks_exact(2 * width))
    {
        let (gate, up) = row.split_at(width);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            let s = 1.0 / (1.0 + (-g).exp());
            *o = g * s * u;
        }
    }
    Ok(())
}

/// The backward of [`swiglu_gu_fwd`]: `dgu`'s rows `[dgate | dup]`, written.
fn swiglu_gu_bwd(dgu: &mut [f32], dout: &[f32], gu: &[f32], width: usize, n: usize) -> Result<()> {
    need("swiglu_gu_bwd", "dout", dout.len(), n)?;
    need(
        "swiglu_gu_bwd",
        "gu and dgu",
        gu.len().min(dgu.len()),
        2 * n,
    )?;
    if width == 0 || n % width != 0 {
        return Err(GpuError::Invalid(format!(
            "swiglu_gu_bwd: {n} elements are not rows of width {width}"
        )));
    }
    let rows = dgu[..2 * n]
        .chunks_exact_mut(2 * width)
        .zip(gu.chunks_exact(2 * width))
        .zip(dout[..n].chunks_exact(width));
    for ((drow, row), d) in rows {
        let (dgate, dup) = drow.split_at_mut(width);
        let (gate, up) = row.split_at(width);
        for c in 0..width {
            let (g, u) = (gate[c], up[c]);
            let s = 1.0 / (1.0 + (-g).exp());
            dup[c] = d[c] * g * s;
            dgate[c] = d[c] * u * s * (1.0 + g * (1.0 - s));
        }
    }
    Ok(())
}
