//! RMSNorm, forward and backward (`cuda/norm.cuh`): the kernels and their arguments, their
//! launches on [`Ops`], and their CPU bodies (what the CPU device runs).

#![allow(clippy::needless_range_loop)] // the CPU bodies index several buffers by one row/element index, as the CUDA source does

use super::on_cpu::{need, rd, wr, Widened};
use super::{i32_of, row_block, DType, Mat, Ops};
use crate::device::{Arg, DSlice, GpuError, Result};

/// The widest row whose weight-gradient shares the RMSNorm backward keeps in dynamic
/// shared memory (`RMSNORM_BWD_DYN_BYTES` in norm.cuh, 48 KB); a wider row (a 16,384-wide
/// target's drafter) keeps them in its partial row in global memory.
pub const RMSNORM_BWD_MAX_WIDTH: usize = 12288;
/// Most blocks (each a partial row of the weight gradient) the RMSNorm backward's first
/// stage runs: enough to fill an H100's or H200's 132 SMs at 128 to 256 threads a block,
/// few enough that the second stage (reading them all) is a small share of the first.
const RMSNORM_BWD_BLOCKS: usize = 1024;
/// f32 of the RMSNorm backward's partial rows (8 MiB, per stream, allocated by the first
/// backward with a weight gradient): 1024 partial rows up to a width of 2048, fewer
/// beyond.
pub const RMSNORM_BWD_SCRATCH_F32: usize = 1 << 21;
/// Threads of the second stage's blocks: 32 warps summing 32 columns.
const RMSNORM_BWD_DW_THREADS: u32 = 1024;

/// The RMSNorm backward's split of `rows` rows of width `d` with a weight gradient:
/// (rows per block, blocks), the blocks at most [`RMSNORM_BWD_BLOCKS`] and their partial
/// rows within [`RMSNORM_BWD_SCRATCH_F32`].
fn rmsnorm_bwd_split(rows: usize, d: usize) -> (usize, usize) {
    let most = RMSNORM_BWD_BLOCKS
        .min(RMSNORM_BWD_SCRATCH_F32 / d.max(1))
        .max(1);
    let per = rows.div_ceil(most).max(1);
    (per, rows.div_ceil(per))
}

/// The RMSNorm kernels, each with its arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Norm {
    /// RMSNorm of rows of width `d`: `y` (in place when it is `x`) and the reciprocal RMS
    /// per row (f32).
    Fwd {
        act: DType,
        y: DSlice,
        rstd: DSlice,
        x: DSlice,
        w: DSlice,
        d: usize,
        eps: f32,
    },
    /// [`Norm::Fwd`] of f32 rows with `y` rounded to bf16 (a GEMM's input).
    FwdToBf16 {
        y: DSlice,
        rstd: DSlice,
        x: DSlice,
        w: DSlice,
        d: usize,
        eps: f32,
    },
    /// The RMSNorm backward's first stage over `rows` rows, `rows_per_block` per block (the
    /// grid: their blocks): `dx` accumulates; with `partials` (f32, a row of `d` per
    /// block) each block writes its rows' share of the weight gradient, which
    /// [`Norm::BwdDw`] then adds to `dw`.
    Bwd {
        dx: DSlice,
        partials: Option<DSlice>,
        dy: DSlice,
        x: DSlice,
        w: DSlice,
        rstd: DSlice,
        d: usize,
        rows: usize,
        rows_per_block: usize,
    },
    /// The RMSNorm backward's second stage: `dw` (`d`) += the sum of the first `blocks`
    /// rows of `partials`, in a fixed order. Grid: ceil(d / 32).
    BwdDw {
        dw: DSlice,
        partials: DSlice,
        d: usize,
        blocks: usize,
    },
}

impl Norm {
    /// The kernel's symbol in norm.cuh.
    pub fn name(&self) -> &'static str {
        match *self {
            Norm::Fwd {
                act: DType::F32, ..
            } => "rmsnorm_fwd",
            Norm::Fwd {
                act: DType::Bf16, ..
            } => "rmsnorm_fwd_bf16",
            Norm::FwdToBf16 { .. } => "rmsnorm_fwd_to_bf16",
            Norm::Bwd { .. } => "rmsnorm_bwd",
            Norm::BwdDw { .. } => "rmsnorm_bwd_dw",
        }
    }

    /// The arguments as the kernel's C parameters, in order.
    pub fn args(&self) -> Vec<Arg> {
        use Arg::{F32, R, RW, W};
        match *self {
            Norm::Fwd {
                y,
                rstd,
                x,
                w,
                d,
                eps,
                ..
            }
            | Norm::FwdToBf16 {
                y,
                rstd,
                x,
                w,
                d,
                eps,
            } => vec![W(y), W(rstd), R(x), R(w), i32_of(d), F32(eps)],
            Norm::Bwd {
                dx,
                partials,
                dy,
                x,
                w,
                rstd,
                d,
                rows,
                rows_per_block,
            } => vec![
                RW(dx),
                partials.map_or(Arg::Null, W),
                R(dy),
                R(x),
                R(w),
                R(rstd),
                i32_of(d),
                i32_of(rows),
                i32_of(rows_per_block),
            ],
            Norm::BwdDw {
                dw,
                partials,
                d,
                blocks,
            } => vec![RW(dw), R(partials), i32_of(d), i32_of(blocks)],
        }
    }

    /// Bytes of dynamic shared memory: the backward's weight-gradient shares of a row (d
    /// f32), up to the 48 KB any launch may have; a wider row keeps them in its partial row
    /// in global memory instead.
    pub fn dynamic_shared_bytes(&self) -> u32 {
        match *self {
            Norm::Bwd {
                partials: Some(_),
                d,
                ..
            } if d <= RMSNORM_BWD_MAX_WIDTH => (d * 4) as u32,
            _ => 0,
        }
    }

    /// One launch of each kernel (each of its symbols), all buffers `b`.
    pub fn every(b: DSlice) -> Vec<Norm> {
        let fwd = |act| Norm::Fwd {
            act,
            y: b,
            rstd: b,
            x: b,
            w: b,
            d: 1,
            eps: 1e-6,
        };
        vec![
            fwd(DType::F32),
            fwd(DType::Bf16),
            Norm::FwdToBf16 {
                y: b,
                rstd: b,
                x: b,
                w: b,
                d: 1,
                eps: 1e-6,
            },
            Norm::Bwd {
                dx: b,
                partials: Some(b),
                dy: b,
                x: b,
                w: b,
                rstd: b,
                d: 1,
                rows: 1,
                rows_per_block: 1,
            },
            Norm::BwdDw {
                dw: b,
                partials: b,
                d: 1,
                blocks: 1,
            },
        ]
    }

    /// Whether arguments `i` (written) and `j` may be one buffer: the forward runs in
    /// place (y = x exactly), as the target's q/k norms do.
    pub(crate) fn in_place(&self, i: usize, j: usize) -> bool {
        matches!(self, Norm::Fwd { .. }) && (i, j) == (0, 2)
    }

    /// The f32 kernel a bf16 one runs as on the CPU, over `w`'s temporaries; `None` for a
    /// kernel that is f32 already.
    ///
    /// # Safety
    /// The kernel's buffers are the CPU device's memory.
    pub(crate) unsafe fn as_f32(&self, w: &mut Widened) -> Option<Norm> {
        match *self {
            Norm::FwdToBf16 {
                y,
                rstd,
                x,
                w: g,
                d,
                eps,
            } => Some(Norm::Fwd {
                act: DType::F32,
                y: w.output(y),
                rstd,
                x,
                w: g,
                d,
                eps,
            }),
            Norm::Fwd {
                act: DType::Bf16,
                y,
                rstd,
                x,
                w: g,
                d,
                eps,
            } => Some(Norm::Fwd {
                act: DType::F32,
                y: w.output(y),
                rstd,
                x: w.input(x),
                w: g,
                d,
                eps,
            }),
            _ => None,
        }
    }

    /// The kernel on the CPU over `rows` (the launch's grid), f32 ([`as_f32`](Self::as_f32)).
    ///
    /// # Safety
    /// The buffers are the CPU device's memory, not aliased but as [`in_place`](Self::in_place) allows.
    pub(crate) unsafe fn run_cpu(&self, rows: usize, _threads: usize) -> Result<()> {
        match *self {
            Norm::Fwd {
                y,
                rstd,
                x,
                w,
                d,
                eps,
                ..
            } => rmsnorm_fwd(rows, y, wr(rstd), x, rd(w), d, eps),
            Norm::FwdToBf16 { .. } => Err(crate::device::GpuError::Invalid(
                "rmsnorm_fwd_to_bf16 runs as its f32 kernel on the CPU".into(),
            )),
            Norm::Bwd {
                dx,
                partials,
                dy,
                x,
                w,
                rstd,
                d,
                rows: n,
                rows_per_block,
            } => rmsnorm_bwd(
                (n, rows_per_block, rows),
                wr(dx),
                partials.map(|b| wr(b)),
                (rd(dy), rd(x), rd(w), rd(rstd)),
                d,
            ),
            Norm::BwdDw {
                dw,
                partials,
                d,
                blocks,
            } => rmsnorm_bwd_dw(wr(dw), rd(partials), d, blocks),
        }
    }
}

impl Ops {
    /// RMSNorm of the rows of `x` into `y` (the same shape), and the reciprocal RMS per row
    /// into `rstd` (f32). `x` and `y` both f32, both bf16 (activations), or `x` f32 and `y`
    /// bf16: a GEMM's input written as the GEMM takes it (the same bits as the f32 result
    /// cast after).
    pub fn rmsnorm(&mut self, x: Mat, w: DSlice, y: Mat, rstd: DSlice, eps: f32) -> Result<()> {
        let (rows, d) = (x.rows, x.cols);
        y.check("rmsnorm: y", rows, d, y.dtype)?;
        let (xb, yb) = (x.buf, y.buf);
        let kernel = match (x.dtype, y.dtype) {
            (DType::F32, DType::Bf16) => Norm::FwdToBf16 {
                y: yb,
                rstd,
                x: xb,
                w,
                d,
                eps,
            },
            (DType::Bf16, DType::F32) => {
                return Err(GpuError::Invalid(
                    "rmsnorm: bf16 rows into f32 (no such kernel)".into(),
                ))
            }
            (act, _) => Norm::Fwd {
                act,
                y: yb,
                rstd,
                x: xb,
                w,
                d,
                eps,
            },
        };
        self.launch(kernel, rows as u32, row_block(d))
    }

    /// Backward of [`rmsnorm`](Self::rmsnorm) of f32 rows: `dx` accumulates, and `dw` when
    /// given. The
    /// weight gradient in two stages, with no atomics: blocks of rows write their partial
    /// sums into these ops' scratch, then one launch adds their column sums to `dw` in a
    /// fixed order (the same bits every run).
    pub fn rmsnorm_backward(
        &mut self,
        dy: Mat,
        x: Mat,
        w: DSlice,
        rstd: DSlice,
        dx: Mat,
        dw: Option<DSlice>,
    ) -> Result<()> {
        let (rows, d) = (x.rows, x.cols);
        x.check("rmsnorm_backward: x", rows, d, DType::F32)?;
        dy.check("rmsnorm_backward: dy", rows, d, DType::F32)?;
        dx.check("rmsnorm_backward: dx", rows, d, DType::F32)?;
        let (dy, x, dx) = (dy.buf, x.buf, dx.buf);
        if rows == 0 {
            return Ok(());
        }
        let block = row_block(d);
        let Some(dw) = dw else {
            return self.launch(
                Norm::Bwd {
                    dx,
                    partials: None,
                    dy,
                    x,
                    w,
                    rstd,
                    d,
                    rows,
                    rows_per_block: 1,
                },
                rows as u32,
                block,
            );
        };
        let (per, blocks) = rmsnorm_bwd_split(rows, d);
        let partials = self.rmsnorm_partials()?.f32s(0..blocks * d);
        self.launch(
            Norm::Bwd {
                dx,
                partials: Some(partials),
                dy,
                x,
                w,
                rstd,
                d,
                rows,
                rows_per_block: per,
            },
            blocks as u32,
            block,
        )?;
        self.launch(
            Norm::BwdDw {
                dw,
                partials,
                d,
                blocks,
            },
            d.div_ceil(32).max(1) as u32,
            RMSNORM_BWD_DW_THREADS,
        )
    }

    /// The RMSNorm backward's partial rows on the current stream: `s`
    /// ([`RMSNORM_BWD_SCRATCH_F32`] f32, from a model's arena), instead of memory these ops
    /// allocate at the first backward with a weight gradient.
    pub fn use_rmsnorm_partials(&mut self, s: DSlice) {
        self.rmsnorm_partials[self.stream.index()] = Some(s);
    }

    /// The RMSNorm backward's partial rows on this stream: allocated once, at first use.
    fn rmsnorm_partials(&mut self) -> Result<DSlice> {
        let i = self.stream.index();
        if let Some(s) = self.rmsnorm_partials[i] {
            return Ok(s);
        }
        let bytes = RMSNORM_BWD_SCRATCH_F32 * 4;
        let s = DSlice {
            ptr: self.dev.alloc(bytes)?,
            bytes,
        };
        self.dev.track(s, "rmsnorm backward partials");
        self.rmsnorm_partials[i] = Some(s);
        Ok(s)
    }
}

/// `y` and `x` are one buffer (in place) or disjoint (the CPU device's aliasing check): raw pointers,
/// each row read whole before it is written.
///
/// # Safety
/// `yb` and `xb` are this device's memory.
unsafe fn rmsnorm_fwd(
    rows: usize,
    yb: DSlice,
    rstd: &mut [f32],
    xb: DSlice,
    w: &[f32],
    d: usize,
    eps: f32,
) -> Result<()> {
    let kernel = "rmsnorm_fwd";
    need(kernel, "x/y", xb.len_f32().min(yb.len_f32()), rows * d)?;
    need(kernel, "rstd", rstd.len(), rows)?;
    need(kernel, "w", w.len(), d)?;
    let (y, x) = (yb.ptr as *mut f32, xb.ptr as *const f32);
    for r in 0..rows {
        let mut ss = 0f32;
        for i in 0..d {
            let v = *x.add(r * d + i);
            ss += v * v;
        }
        let rs = 1.0 / (ss / d as f32 + eps).sqrt();
        for i in 0..d {
            *y.add(r * d + i) = *x.add(r * d + i) * rs * w[i];
        }
        rstd[r] = rs;
    }
    Ok(())
}

/// `(rows, rows_per_block, blocks)`: the launch; `(dy, x, w, rstd)`: what the backward
/// reads. Block b's rows' share of the weight gradient goes to row b of `partials`, each
/// a sum over its rows in order, as the CUDA kernel's threads sum them.
fn rmsnorm_bwd(
    (rows, per, blocks): (usize, usize, usize),
    dx: &mut [f32],
    mut partials: Option<&mut [f32]>,
    (dy, x, w, rstd): (&[f32], &[f32], &[f32], &[f32]),
    d: usize,
) -> Result<()> {
    let kernel = "rmsnorm_bwd";
    // The launch's rows: those of its blocks, and no more than it names.
    let rows = rows.min(blocks * per);
    need(
        kernel,
        "dx/dy/x",
        dx.len().min(dy.len()).min(x.len()),
        rows * d,
    )?;
    need(kernel, "rstd", rstd.len(), rows)?;
    need(kernel, "w", w.len(), d)?;
    if let Some(p) = partials.as_deref() {
        need(kernel, "partials", p.len(), blocks * d)?;
    }
    for b in 0..blocks {
        let mut share = vec![0f32; if partials.is_some() { d } else { 0 }];
        for r in b * per..((b + 1) * per).min(rows) {
            let (xr, gr, rs) = (&x[r * d..(r + 1) * d], &dy[r * d..(r + 1) * d], rstd[r]);
            let gx: f32 = gr
                .iter()
                .zip(w)
                .zip(xr)
                .map(|((g, w), x)| g * w * x)
                .sum::<f32>()
                / d as f32;
            for i in 0..d {
                dx[r * d + i] += rs * gr[i] * w[i] - xr[i] * rs * rs * rs * gx;
            }
            for (i, s) in share.iter_mut().enumerate() {
                *s += gr[i] * xr[i] * rs;
            }
        }
        if let Some(p) = partials.as_deref_mut() {
            p[b * d..(b + 1) * d].copy_from_slice(&share);
        }
    }
    Ok(())
}

/// `dw += Σ` of the first `blocks` partial rows, column by column in row order.
fn rmsnorm_bwd_dw(dw: &mut [f32], partials: &[f32], d: usize, blocks: usize) -> Result<()> {
    let kernel = "rmsnorm_bwd_dw";
    need(kernel, "dw", dw.len(), d)?;
    need(kernel, "partials", partials.len(), blocks * d)?;
    for i in 0..d {
        dw[i] += (0..blocks).map(|b| partials[b * d + i]).sum::<f32>();
    }
    Ok(())
}
