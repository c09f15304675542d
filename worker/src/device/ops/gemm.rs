//! Matrix products (`cuda/gemm.cuh`): the dense ones through the device's GEMM (cuBLAS on a
//! GPU), in f32 or bf16, forward and backward; the experts' grouped GEMM as a kernel of
//! our own, its arguments, its launch on [`Ops`], and its CPU body.

#![allow(clippy::needless_range_loop)] // the CPU bodies index several buffers by one row/element index, as the CUDA source does

use super::on_cpu::{need, rd, wr, Widened};
use super::{i32_of, Act, Ops};
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
        act: Act,
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
            GemmKernel::Grouped { act: Act::Bf16, .. } => MOE_GEMM_DYN_BYTES,
            _ => 0,
        }
    }

    /// One launch of each kernel (each of its symbols), all buffers `b`.
    pub fn every(b: DSlice) -> Vec<GemmKernel> {
        let mut all = Vec::new();
        for act in [Act::F32, Act::Bf16] {
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
            } if *act == Act::Bf16 => {
                (*y, *x, *wt) = (w.output(*y), w.input(*x), w.input(*wt));
                *act = Act::F32;
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

impl Ops {
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
