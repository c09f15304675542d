//! The optimizer (`cuda/adamw.cuh`): the gradient norm, AdamW, the weights' checksum and
//! the gradient's scaling, with no host sync; their arguments, their launches on [`Ops`], and their CPU bodies.

#![allow(clippy::needless_range_loop)] // the CPU bodies index several buffers by one row/element index, as the CUDA source does

use super::on_cpu::{need, rd, wr, Widened};
use super::{grid_for, i32_of, i64_of, Ops, BLOCK};
use crate::device::{Arg, DSlice, Device, GpuError, Result, Stream};

/// Most blocks `sumsq` uses (the f64 partials it needs).
pub const SUMSQ_BLOCKS: usize = 1024;
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The weights' checksum that the `params_hash` kernel computes: Σᵢ splitmix64(bits(pᵢ)
/// << 32 ^ i), wrapping. Order-free, so the device's grid does not change it; one flipped
/// bit anywhere changes it.
pub fn params_hash(p: &[f32]) -> u64 {
    p.iter().enumerate().fold(0u64, |s, (i, x)| {
        s.wrapping_add(splitmix64(((x.to_bits() as u64) << 32) ^ i as u64))
    })
}

/// AdamW's constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

/// What one AdamW step reads and writes on the device: the f32 weights `p` with their
/// moments `m` and `v`, the gradient `g`, and the step's Σg² (`acc`, one f64), non-finite
/// flag and step count `t` (one i32 each).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamBuffers {
    pub p: DSlice,
    pub m: DSlice,
    pub v: DSlice,
    pub g: DSlice,
    pub acc: DSlice,
    pub nonfinite: DSlice,
    pub t: DSlice,
}

/// The optimizer's kernels, each with its arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// Each block's share of Σg² (f64 `partials`), `nonfinite` (i32) set on NaN/inf.
    Sumsq {
        partials: DSlice,
        nonfinite: DSlice,
        g: DSlice,
        n: usize,
    },
    /// `acc` (one f64) = Σ of the first `blocks` partials, in order.
    SumsqFinish {
        acc: DSlice,
        partials: DSlice,
        blocks: usize,
    },
    /// `t += 1` (one i32) unless `nonfinite` is set.
    AdamCount { t: DSlice, nonfinite: DSlice },
    /// Clip by the norm in `acc` to `max_norm` (0: no clip), AdamW at step count `t`,
    /// unless `nonfinite` is set.
    Adamw {
        p: DSlice,
        m: DSlice,
        v: DSlice,
        g: DSlice,
        n: usize,
        acc: DSlice,
        nonfinite: DSlice,
        t: DSlice,
        max_norm: f32,
        lr: f32,
        hyper: AdamHyper,
    },
    /// The weights' checksum ([`super::params_hash`]) added into `acc` (one u64).
    ParamsHash { acc: DSlice, p: DSlice, n: usize },
    /// `y = alpha · x` (f32, `n` each): a group's gradient sum scaled into the step's
    /// average, or copied (`alpha` 1).
    Scale {
        y: DSlice,
        x: DSlice,
        n: usize,
        alpha: f32,
    },
}

impl Optimizer {
    /// Bytes of dynamic shared memory: none for these kernels.
    pub fn dynamic_shared_bytes(&self) -> u32 {
        0
    }

    /// These kernels are f32 only: none runs as another on the CPU.
    ///
    /// # Safety
    /// None: nothing is read.
    pub(crate) unsafe fn as_f32(&self, _w: &mut Widened) -> Option<Optimizer> {
        None
    }

    /// The kernel's symbol in the CUDA source.
    pub fn name(&self) -> &'static str {
        match *self {
            Optimizer::Sumsq { .. } => "sumsq",
            Optimizer::SumsqFinish { .. } => "sumsq_finish",
            Optimizer::AdamCount { .. } => "adam_count",
            Optimizer::Adamw { .. } => "adamw",
            Optimizer::ParamsHash { .. } => "params_hash",
            Optimizer::Scale { .. } => "scale_f32",
        }
    }

    /// The arguments as the kernel's C parameters, in order: each buffer marked as the
    /// kernel reads it, writes it, or both; each scalar of its parameter's C type.
    pub fn args(&self) -> Vec<Arg> {
        use Arg::{F32, R, RW, W};
        match *self {
            Optimizer::Sumsq {
                partials,
                nonfinite,
                g,
                n,
            } => vec![W(partials), RW(nonfinite), R(g), i64_of(n)],
            Optimizer::SumsqFinish {
                acc,
                partials,
                blocks,
            } => vec![W(acc), R(partials), i32_of(blocks)],
            Optimizer::AdamCount { t, nonfinite } => vec![RW(t), R(nonfinite)],
            Optimizer::Adamw {
                p,
                m,
                v,
                g,
                n,
                acc,
                nonfinite,
                t,
                max_norm,
                lr,
                hyper,
            } => vec![
                RW(p),
                RW(m),
                RW(v),
                R(g),
                i64_of(n),
                R(acc),
                R(nonfinite),
                R(t),
                F32(max_norm),
                F32(lr),
                F32(hyper.beta1),
                F32(hyper.beta2),
                F32(hyper.eps),
                F32(hyper.weight_decay),
            ],
            Optimizer::ParamsHash { acc, p, n } => vec![RW(acc), R(p), i64_of(n)],
            Optimizer::Scale { y, x, n, alpha } => vec![W(y), R(x), i64_of(n), F32(alpha)],
        }
    }

    /// One launch of each kernel (each of its symbols), all buffers `b`.
    pub fn every(b: DSlice) -> Vec<Optimizer> {
        let hyper = AdamHyper {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut all = Vec::new();
        all.extend([
            Optimizer::Sumsq {
                partials: b,
                nonfinite: b,
                g: b,
                n: 1,
            },
            Optimizer::SumsqFinish {
                acc: b,
                partials: b,
                blocks: 1,
            },
            Optimizer::AdamCount { t: b, nonfinite: b },
            Optimizer::Adamw {
                p: b,
                m: b,
                v: b,
                g: b,
                n: 1,
                acc: b,
                nonfinite: b,
                t: b,
                max_norm: 1.0,
                lr: 1e-3,
                hyper,
            },
            Optimizer::ParamsHash { acc: b, p: b, n: 1 },
            Optimizer::Scale {
                y: b,
                x: b,
                n: 1,
                alpha: 0.5,
            },
        ]);
        all
    }

    /// The kernel on the CPU over `rows` (the launch's grid), f32 (a bf16 one runs as
    /// its f32 kernel).
    ///
    /// # Safety
    /// The buffers are the CPU device's memory, not aliased.
    pub(crate) unsafe fn run_cpu(&self, rows: usize, _threads: usize) -> Result<()> {
        let name = self.name();
        match *self {
            Optimizer::Sumsq {
                partials,
                nonfinite,
                g,
                n,
            } => sumsq(rows, wr(partials), wr(nonfinite), rd(g), n),
            Optimizer::SumsqFinish {
                acc,
                partials,
                blocks,
            } => {
                let (acc, partials) = (wr::<f64>(acc), rd::<f64>(partials));
                need(name, "partials", partials.len(), blocks)?;
                acc[0] = partials[..blocks].iter().sum();
                Ok(())
            }
            Optimizer::AdamCount { t, nonfinite } => {
                let (t, nonfinite) = (wr::<i32>(t), rd::<i32>(nonfinite));
                if nonfinite[0] == 0 {
                    t[0] += 1;
                }
                Ok(())
            }
            Optimizer::Adamw {
                p,
                m,
                v,
                g,
                n,
                acc,
                nonfinite,
                t,
                max_norm,
                lr,
                hyper,
            } => adamw(
                (wr(p), wr(m), wr(v)),
                rd(g),
                n,
                (rd(acc), rd(nonfinite), rd(t)),
                (max_norm, lr),
                &hyper,
            ),
            Optimizer::ParamsHash { acc, p, n } => {
                let (acc, p) = (wr::<u64>(acc), rd::<f32>(p));
                need(name, "p", p.len(), n)?;
                acc[0] = acc[0].wrapping_add(params_hash(&p[..n]));
                Ok(())
            }
            Optimizer::Scale { y, x, n, alpha } => {
                let (y, x) = (wr::<f32>(y), rd::<f32>(x));
                need(name, "x", x.len(), n)?;
                need(name, "y", y.len(), n)?;
                for (y, x) in y[..n].iter_mut().zip(&x[..n]) {
                    *y = alpha * x;
                }
                Ok(())
            }
        }
    }
}

/// `y = alpha · x` (f32, the length of `x`) on `stream` of `dev`: [`Ops::scale`] on a
/// stream the ops do not own (a collective's).
pub fn scale_on(
    dev: &mut dyn Device,
    stream: Stream,
    y: DSlice,
    x: DSlice,
    alpha: f32,
) -> Result<()> {
    let n = x.len_f32();
    if y.len_f32() < n {
        return Err(GpuError::Invalid(format!(
            "scale: {} f32 of output for {n} of input",
            y.len_f32()
        )));
    }
    let k = Optimizer::Scale { y, x, n, alpha };
    dev.launch(stream, &k.into(), grid_for(n), BLOCK)
}

impl Ops {
    /// `y = alpha · x` (f32, the length of `x`).
    pub fn scale(&mut self, y: DSlice, x: DSlice, alpha: f32) -> Result<()> {
        scale_on(self.dev.as_mut(), self.stream, y, x, alpha)
    }

    /// Σg² into `acc` (one f64, overwritten) and `nonfinite` (one i32, set on NaN/inf;
    /// zero it first), through `partials` ([`SUMSQ_BLOCKS`] f64s): each block's share,
    /// then their sum in block order, so the result does not depend on scheduling.
    pub fn sumsq(
        &mut self,
        g: DSlice,
        partials: DSlice,
        acc: DSlice,
        nonfinite: DSlice,
    ) -> Result<()> {
        let n = g.len_f32();
        let blocks = grid_for(n).min(SUMSQ_BLOCKS as u32);
        if partials.bytes < blocks as usize * 8 {
            return Err(GpuError::Invalid(format!(
                "sumsq: {} bytes of partials for {blocks} blocks",
                partials.bytes
            )));
        }
        self.launch(
            Optimizer::Sumsq {
                partials,
                nonfinite,
                g,
                n,
            },
            blocks,
            BLOCK,
        )?;
        let blocks = blocks as usize;
        self.launch(
            Optimizer::SumsqFinish {
                acc,
                partials,
                blocks,
            },
            1,
            32,
        )
    }

    /// One more Adam step in the device counter `t` (one i32) unless `nonfinite` is set.
    pub fn adam_count(&mut self, t: DSlice, nonfinite: DSlice) -> Result<()> {
        self.launch(Optimizer::AdamCount { t, nonfinite }, 1, 32)
    }

    /// Clip `b.g` by the norm in `b.acc` to `max_norm` (0: no clip) and apply AdamW at the
    /// step count in `b.t` (after [`adam_count`](Self::adam_count)), unless `b.nonfinite`
    /// is set.
    pub fn adamw(&mut self, b: AdamBuffers, max_norm: f32, lr: f32, opt: &AdamHyper) -> Result<()> {
        let AdamBuffers {
            p,
            m,
            v,
            g,
            acc,
            nonfinite,
            t,
        } = b;
        let n = p.len_f32();
        self.launch(
            Optimizer::Adamw {
                p,
                m,
                v,
                g,
                n,
                acc,
                nonfinite,
                t,
                max_norm,
                lr,
                hyper: *opt,
            },
            grid_for(n),
            BLOCK,
        )
    }

    /// [`params_hash`] of `p` added into `acc` (one u64; zero it first).
    pub fn params_hash(&mut self, acc: DSlice, p: DSlice) -> Result<()> {
        let n = p.len_f32();
        self.launch(
            Optimizer::ParamsHash { acc, p, n },
            grid_for(n).min(1024),
            BLOCK,
        )
    }
}

/// One share (the whole sum, in order), the other `rows − 1` zero: `sumsq_finish` adds
/// them all as on a GPU.
fn sumsq(
    rows: usize,
    partials: &mut [f64],
    nonfinite: &mut [i32],
    g: &[f32],
    n: usize,
) -> Result<()> {
    need("sumsq", "partials", partials.len(), rows)?;
    need("sumsq", "g", g.len(), n)?;
    let mut s = 0f64;
    let mut bad = false;
    for &x in &g[..n] {
        if x.is_finite() {
            s += (x as f64) * (x as f64);
        } else {
            bad = true;
        }
    }
    partials[..rows].iter_mut().for_each(|p| *p = 0.0);
    if rows > 0 {
        partials[0] = s;
    }
    if bad {
        nonfinite[0] = 1;
    }
    Ok(())
}

/// `(p, m, v)` updated from `g` (n elements); `(acc, nonfinite, t)`: Σg², the skip flag
/// and the step count; `(max_norm, lr)`.
fn adamw(
    (p, m, v): (&mut [f32], &mut [f32], &mut [f32]),
    g: &[f32],
    n: usize,
    (acc, nonfinite, t): (&[f64], &[i32], &[i32]),
    (max_norm, lr): (f32, f32),
    h: &AdamHyper,
) -> Result<()> {
    let have = p.len().min(m.len()).min(v.len()).min(g.len());
    need("adamw", "buffers", have, n)?;
    if nonfinite[0] != 0 {
        return Ok(());
    }
    let (b1, b2, eps, wd) = (h.beta1, h.beta2, h.eps, h.weight_decay);
    let norm = acc[0].sqrt() as f32;
    let clip = if max_norm > 0.0 && norm > max_norm {
        max_norm / norm
    } else {
        1.0
    };
    let c1 = (1.0 - (b1 as f64).powf(t[0] as f64)) as f32;
    let c2 = (1.0 - (b2 as f64).powf(t[0] as f64)) as f32;
    for i in 0..n {
        let gi = g[i] * clip;
        m[i] = b1 * m[i] + (1.0 - b1) * gi;
        v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
        let (mh, vh) = (m[i] / c1, v[i] / c2);
        p[i] -= lr * (mh / (vh.sqrt() + eps) + wd * p[i]);
    }
    Ok(())
}
