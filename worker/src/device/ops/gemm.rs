//! Matrix products (`cuda/gemm.cuh`): the dense ones through the device's GEMM (cuBLAS on a
//! GPU), in f32 or bf16, forward and backward; the experts' grouped GEMM as a kernel of
//! our own, its arguments, its launch on [`Ops`], and its CPU body.

#![allow(clippy::needless_range_loop)] // the CPU bodies index several buffers by one row/element index, as the CUDA source does

use super::on_cpu::{need, rd, wr, Widened};
use super::{i32_of, DType, Mat, Ops};
use crate::device::{Arg, DSlice, Gemm, GpuError, Result};

/// The experts' grouped GEMM's tile (`MOE_BM` × `MOE_BN` in gemm.cuh), threads
/// (`MOE_THREADS`) and dynamic shared memory (`MOE_DYN_BYTES`: 3 stages of 64 + 128 rows
/// of 40 bf16).
pub const MOE_GEMM_ROWS: usize = 64;
pub const MOE_GEMM_COLS: usize = 128;
pub const MOE_GEMM_THREADS: u32 = 128;
pub const MOE_GEMM_DYN_BYTES: u32 = 3 * (64 + 128) * 40 * 2;
/// The experts' grouped GEMM, with its arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GemmKernel {
    /// The experts' grouped GEMM (grid: [`GemmKernel::moe_gemm_grid`], `MOE_THREADS`):
    /// `y[r,:] = x[src(r),:] · W_eᵀ` for each row r of expert e (`offsets[e] ≤ r <
    /// offsets[e + 1]`, i32 on the device), `W_e` the `[n, k]` matrix at `w + e·n·k`;
    /// `src(r)` is `rows[r]` (i32) when `gather` > 0 (`x` then has `gather` rows), else r.
    Grouped {
        act: DType,
        y: DSlice,
        x: DSlice,
        w: DSlice,
        offsets: DSlice,
        rows: DSlice,
        gather: usize,
        experts: usize,
        pairs: usize,
        n: usize,
        k: usize,
    },
}

impl GemmKernel {
    /// The grouped GEMM's grid for `pairs` routed rows over `experts` experts and `n`
    /// output columns: the most row tiles any routing can have (each expert's rows in
    /// tiles of `MOE_GEMM_ROWS`, at most one partial tile per expert with rows) times the
    /// column tiles. The CTAs past the routing's tiles return at once.
    pub fn moe_gemm_grid(pairs: usize, experts: usize, n: usize) -> usize {
        (pairs.div_ceil(MOE_GEMM_ROWS) + experts.min(pairs)) * n.div_ceil(MOE_GEMM_COLS)
    }

    /// The kernel's symbol in the CUDA source.
    pub fn name(&self) -> &'static str {
        match *self {
            GemmKernel::Grouped { act: a, .. } => a.pick("moe_gemm", "moe_gemm_bf16"),
        }
    }

    /// The arguments as the kernel's C parameters, in order: each buffer marked as the
    /// kernel reads it, writes it, or both; each scalar of its parameter's C type.
    pub fn args(&self) -> Vec<Arg> {
        use Arg::{R, W};
        match *self {
            GemmKernel::Grouped {
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
                ..
            } => vec![
                W(y),
                R(x),
                R(w),
                R(offsets),
                R(rows),
                i32_of(gather),
                i32_of(experts),
                i32_of(pairs),
                i32_of(n),
                i32_of(k),
            ],
        }
    }

    /// Bytes of dynamic shared memory the kernel is launched with.
    pub fn dynamic_shared_bytes(&self) -> u32 {
        match *self {
            GemmKernel::Grouped {
                act: DType::Bf16, ..
            } => MOE_GEMM_DYN_BYTES,
            _ => 0,
        }
    }

    /// One launch of each kernel (each of its symbols), all buffers `b`.
    pub fn every(b: DSlice) -> Vec<GemmKernel> {
        let mut all = Vec::new();
        for act in [DType::F32, DType::Bf16] {
            all.extend([GemmKernel::Grouped {
                act,
                y: b,
                x: b,
                w: b,
                offsets: b,
                rows: b,
                gather: 0,
                experts: 1,
                pairs: 1,
                n: 1,
                k: 1,
            }]);
        }
        all
    }

    /// The f32 kernel a bf16 one runs as on the CPU, over `w`'s temporaries; `None` for a
    /// kernel that is f32 already.
    ///
    /// # Safety
    /// The kernel's buffers are the CPU device's memory.
    pub(crate) unsafe fn as_f32(&self, w: &mut Widened) -> Option<GemmKernel> {
        let mut k = *self;
        match &mut k {
            GemmKernel::Grouped {
                act, y, x, w: wt, ..
            } if *act == DType::Bf16 => {
                (*y, *x, *wt) = (w.output(*y), w.input(*x), w.input(*wt));
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
    pub(crate) unsafe fn run_cpu(&self, _rows: usize, threads: usize) -> Result<()> {
        match *self {
            GemmKernel::Grouped {
                y,
                x,
                w,
                offsets,
                rows: order,
                gather,
                experts,
                pairs,
                n,
                k,
                ..
            } => moe_gemm(
                wr(y),
                (rd(x), rd(w)),
                (rd(offsets), rd(order)),
                gather,
                (experts, pairs),
                (n, k),
                super::on_cpu::par(threads, pairs * n * k / experts.max(1)),
            ),
        }
    }
}

/// Where [`Ops::matmul_backward`] puts `dx = dy · w`.
#[derive(Debug, Clone, Copy)]
pub enum Dx {
    /// Not computed.
    Skip,
    /// Added into this (f32) matrix.
    Add(Mat),
    /// Written over this (f32) matrix: a first writer needs no zeroed buffer.
    Write(Mat),
}

impl Ops {
    /// `y = x · wᵀ` (row-major: `x` m×k, `w` n×k, `y` m×n) as one cuBLAS-convention GEMM,
    /// column-major `yᵀ = op(w)·xᵀ` with `op = T`. `x` and `w` are both f32, or both bf16
    /// (tensor cores, f32 accumulation); `y` is f32, or bf16 (the result rounded once).
    pub fn matmul(&mut self, x: Mat, w: Mat, y: Mat) -> Result<()> {
        let (m, k, n) = (x.rows, x.cols, w.rows);
        w.check("matmul: w", n, k, x.dtype)?;
        y.check("matmul: y", m, n, y.dtype)?;
        let g = Gemm {
            transa: true,
            transb: false,
            m: n,
            n: m,
            k,
            alpha: 1.0,
            a: w.buf,
            lda: k,
            b: x.buf,
            ldb: k,
            beta: 0.0,
            c: y.buf,
            ldc: n,
            bf16_inputs: x.dtype == DType::Bf16,
            bf16_output: y.dtype == DType::Bf16,
        };
        self.dev.gemm(self.stream, &g)
    }

    /// Backward of [`matmul`](Self::matmul) for `dy` (m×n): `dx (+)= dy · w` as [`Dx`]
    /// says, and `dw += dyᵀ · x` when `dw` is given. `dy`, `x` and `w` are of one type (bf16:
    /// tensor cores, f32 accumulation; `x` is read only for `dw`); `dx` and `dw` are f32.
    pub fn matmul_backward(
        &mut self,
        dy: Mat,
        x: Mat,
        w: Mat,
        dx: Dx,
        dw: Option<Mat>,
    ) -> Result<()> {
        let (m, n, k) = (dy.rows, dy.cols, w.cols);
        let bf16_inputs = dy.dtype == DType::Bf16;
        w.check("matmul_backward: w", n, k, dy.dtype)?;
        let dx = match dx {
            Dx::Skip => None,
            Dx::Add(d) => Some((d, 1.0)),
            Dx::Write(d) => Some((d, 0.0)),
        };
        if let Some((dx, beta)) = dx {
            dx.check("matmul_backward: dx", m, k, DType::F32)?;
            // column-major dxᵀ[k,m] (+)= w_c[k,n] · dy_c[n,m]
            let g = Gemm {
                transa: false,
                transb: false,
                m: k,
                n: m,
                k: n,
                alpha: 1.0,
                a: w.buf,
                lda: k,
                b: dy.buf,
                ldb: n,
                beta,
                c: dx.buf,
                ldc: k,
                bf16_inputs,
                bf16_output: false,
            };
            self.dev.gemm(self.stream, &g)?;
        }
        if let Some(dw) = dw {
            x.check("matmul_backward: x", m, k, dy.dtype)?;
            dw.check("matmul_backward: dw", n, k, DType::F32)?;
            // column-major dwᵀ[k,n] += x_c[k,m] · (dy_c[n,m])ᵀ
            let g = Gemm {
                transa: false,
                transb: true,
                m: k,
                n,
                k: m,
                alpha: 1.0,
                a: x.buf,
                lda: k,
                b: dy.buf,
                ldb: n,
                beta: 1.0,
                c: dw.buf,
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
    /// else r. Activations of the ops' type ([`act`](Self::act)): bf16 `x`, `w` and `y`
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
        let grid = GemmKernel::moe_gemm_grid(pairs, experts, n);
        if grid == 0 {
            return Ok(());
        }
        let grid = u32::try_from(grid)
            .ok()
            .filter(|&g| g <= i32::MAX as u32)
            .ok_or_else(|| {
                GpuError::Invalid(format!(
                    "moe_gemm: {grid} CTAs for {pairs} rows, {experts} experts and {n} columns: \
                     more than a grid holds"
                ))
            })?;
        let (rows, gather) = gather.unwrap_or((offsets, 0));
        let act = self.act();
        self.launch(
            GemmKernel::Grouped {
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
}

/// The experts' grouped GEMM ([`GemmKernel::Grouped`]): each expert's rows (gathered into
/// a copy when `gather`) times its `[n, k]` matrix, one f32 GEMM per expert with rows.
fn moe_gemm(
    y: &mut [f32],
    (x, w): (&[f32], &[f32]),
    (offsets, order): (&[i32], &[i32]),
    gather: usize,
    (experts, pairs): (usize, usize),
    (n, k): (usize, usize),
    par: gemm::Parallelism,
) -> Result<()> {
    let kernel = "moe_gemm";
    need(kernel, "offsets", offsets.len(), experts + 1)?;
    need(kernel, "w", w.len(), experts * n * k)?;
    need(kernel, "y", y.len(), pairs * n)?;
    need(
        kernel,
        "x",
        x.len(),
        if gather > 0 { gather } else { pairs } * k,
    )?;
    if gather > 0 {
        need(kernel, "rows", order.len(), pairs)?;
    }
    let clamp = |v: i32, lo: usize| (v.max(0) as usize).clamp(lo, pairs);
    let slice = |v: &[f32]| DSlice {
        ptr: v.as_ptr() as u64,
        bytes: v.len() * 4,
    };
    for e in 0..experts {
        let first = clamp(offsets[e], 0);
        let end = clamp(offsets[e + 1], first);
        if end == first {
            continue;
        }
        let src: Vec<f32> = (first..end)
            .flat_map(|r| {
                let s = if gather > 0 {
                    (order[r].max(0) as usize).min(gather - 1)
                } else {
                    r
                };
                x[s * k..(s + 1) * k].iter().copied()
            })
            .collect();
        let out = &mut y[first * n..end * n];
        let g = Gemm {
            transa: true,
            transb: false,
            m: n,
            n: end - first,
            k,
            alpha: 1.0,
            a: slice(&w[e * n * k..(e + 1) * n * k]),
            lda: k,
            b: slice(&src),
            ldb: k,
            beta: 0.0,
            c: DSlice {
                ptr: out.as_mut_ptr() as u64,
                bytes: out.len() * 4,
            },
            ldc: n,
            bf16_inputs: false,
            bf16_output: false,
        };
        // SAFETY: a, b and c are the slices above, of the extents the GEMM reads and
        // writes (validated), c disjoint from both.
        g.validate()?;
        unsafe { crate::device::host::sgemm_colmajor(&g, par) };
    }
    Ok(())
}
