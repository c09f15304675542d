//! Row gathers and scatters, casts and element-wise kernels (`cuda/convert.cuh`): the
//! embedding gather, the scatter-add of rows, bf16 <-> f32, the residual add, column
//! copies; their arguments, their launches on [`Ops`], and their CPU bodies.

#![allow(clippy::needless_range_loop)] // the CPU bodies index several buffers by one row/element index, as the CUDA source does

use super::on_cpu::{need, rd, wr, Widened};
use super::{grid_for, i32_of, i64_of, row_block, DType, Mat, Ops, BLOCK};
use crate::device::{Arg, DSlice, Result};

/// The gather, scatter, cast and element-wise kernels, each with its arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Convert {
    /// `out[r,:] = table[ids[r],:]` (ids u32, clamped to the vocabulary).
    EmbedGather {
        act: DType,
        out: DSlice,
        table: DSlice,
        ids: DSlice,
        h: usize,
        vocab: usize,
    },
    /// `dst[idx[r],:] += src[r,:]` (idx u32, distinct).
    ScatterAddRows {
        dst: DSlice,
        src: DSlice,
        idx: DSlice,
        h: usize,
    },
    /// bf16 bits → f32, `n` elements.
    Bf16ToF32 {
        out: DSlice,
        input: DSlice,
        n: usize,
    },
    /// f32 → bf16 bits (nearest even), `n` elements.
    F32ToBf16 {
        out: DSlice,
        input: DSlice,
        n: usize,
    },
    /// `x += y`, `n` elements.
    AddInplace {
        act: DType,
        x: DSlice,
        y: DSlice,
        n: usize,
    },
    /// `dst[r, dst_off..+width] = src[r, src_off..+width]`.
    CopyCols {
        act: DType,
        dst: DSlice,
        src: DSlice,
        width: usize,
        dst_stride: usize,
        dst_off: usize,
        src_stride: usize,
        src_off: usize,
    },
}

impl Convert {
    /// Bytes of dynamic shared memory: none for these kernels.
    pub fn dynamic_shared_bytes(&self) -> u32 {
        0
    }

    /// The kernel's symbol in the CUDA source.
    pub fn name(&self) -> &'static str {
        match *self {
            Convert::EmbedGather { act: a, .. } => a.pick("embed_gather", "embed_gather_bf16"),
            Convert::ScatterAddRows { .. } => "scatter_add_rows",
            Convert::Bf16ToF32 { .. } => "bf16_to_f32",
            Convert::F32ToBf16 { .. } => "f32_to_bf16",
            Convert::AddInplace { act: a, .. } => a.pick("add_inplace", "add_inplace_bf16"),
            Convert::CopyCols { act: a, .. } => a.pick("copy_cols", "copy_cols_bf16"),
        }
    }

    /// The arguments as the kernel's C parameters, in order: each buffer marked as the
    /// kernel reads it, writes it, or both; each scalar of its parameter's C type.
    pub fn args(&self) -> Vec<Arg> {
        use Arg::{R, RW, W};
        match *self {
            Convert::EmbedGather {
                out,
                table,
                ids,
                h,
                vocab,
                ..
            } => vec![W(out), R(table), R(ids), i32_of(h), i32_of(vocab)],
            Convert::ScatterAddRows { dst, src, idx, h } => {
                vec![RW(dst), R(src), R(idx), i32_of(h)]
            }
            Convert::Bf16ToF32 { out, input, n } | Convert::F32ToBf16 { out, input, n } => {
                vec![W(out), R(input), i64_of(n)]
            }
            Convert::AddInplace { x, y, n, .. } => vec![RW(x), R(y), i64_of(n)],
            Convert::CopyCols {
                dst,
                src,
                width,
                dst_stride,
                dst_off,
                src_stride,
                src_off,
                ..
            } => vec![
                RW(dst),
                R(src),
                i32_of(width),
                i32_of(dst_stride),
                i32_of(dst_off),
                i32_of(src_stride),
                i32_of(src_off),
            ],
        }
    }

    /// One launch of each kernel (each of its symbols), all buffers `b`.
    pub fn every(b: DSlice) -> Vec<Convert> {
        let mut all = Vec::new();
        for act in [DType::F32, DType::Bf16] {
            all.extend([
                Convert::EmbedGather {
                    act,
                    out: b,
                    table: b,
                    ids: b,
                    h: 1,
                    vocab: 1,
                },
                Convert::AddInplace {
                    act,
                    x: b,
                    y: b,
                    n: 1,
                },
                Convert::CopyCols {
                    act,
                    dst: b,
                    src: b,
                    width: 1,
                    dst_stride: 1,
                    dst_off: 0,
                    src_stride: 1,
                    src_off: 0,
                },
            ]);
        }
        all.extend([
            Convert::ScatterAddRows {
                dst: b,
                src: b,
                idx: b,
                h: 1,
            },
            Convert::Bf16ToF32 {
                out: b,
                input: b,
                n: 1,
            },
            Convert::F32ToBf16 {
                out: b,
                input: b,
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
    pub(crate) unsafe fn as_f32(&self, w: &mut Widened) -> Option<Convert> {
        let mut k = *self;
        match &mut k {
            Convert::EmbedGather {
                act, out, table, ..
            } if *act == DType::Bf16 => {
                (*out, *table) = (w.output(*out), w.input(*table));
                *act = DType::F32;
            }
            Convert::AddInplace { act, x, y, .. } if *act == DType::Bf16 => {
                (*x, *y) = (w.output(*x), w.input(*y));
                *act = DType::F32;
            }
            Convert::CopyCols { act, dst, src, .. } if *act == DType::Bf16 => {
                (*dst, *src) = (w.output(*dst), w.input(*src));
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
            Convert::EmbedGather {
                out,
                table,
                ids,
                h,
                vocab,
                ..
            } => embed_gather(rows, wr(out), rd(table), rd(ids), h, vocab),
            Convert::ScatterAddRows { dst, src, idx, h } => {
                scatter_add_rows(rows, wr(dst), rd(src), rd(idx), h)
            }
            Convert::Bf16ToF32 { out, input, n } => bf16_to_f32(wr(out), rd(input), n),
            Convert::F32ToBf16 { out, input, n } => f32_to_bf16(wr(out), rd(input), n),
            Convert::AddInplace { x, y, n, .. } => add_inplace(wr(x), rd(y), n),
            Convert::CopyCols {
                dst,
                src,
                width,
                dst_stride,
                dst_off,
                src_stride,
                src_off,
                ..
            } => copy_cols(
                rows,
                wr(dst),
                rd(src),
                width,
                (dst_stride, dst_off),
                (src_stride, src_off),
            ),
        }
    }
}

impl Ops {
    /// `out[i,:] = table[ids[i],:]` (ids: u32, clamped to the vocabulary).
    pub fn embed(
        &mut self,
        out: DSlice,
        table: DSlice,
        ids: DSlice,
        rows: usize,
        h: usize,
        vocab: usize,
    ) -> Result<()> {
        let act = self.act();
        self.launch(
            Convert::EmbedGather {
                act,
                out,
                table,
                ids,
                h,
                vocab,
            },
            rows as u32,
            row_block(h),
        )
    }

    /// `dst[idx[i], :] += src[i, :]` for `rows` rows (idx: u32, distinct).
    pub fn scatter_add_rows(
        &mut self,
        dst: DSlice,
        src: DSlice,
        idx: DSlice,
        rows: usize,
        h: usize,
    ) -> Result<()> {
        self.launch(
            Convert::ScatterAddRows { dst, src, idx, h },
            rows as u32,
            row_block(h),
        )
    }

    /// `x += y`
    pub fn add(&mut self, x: DSlice, y: DSlice) -> Result<()> {
        let (n, act) = (self.act_len(x), self.act());
        self.launch(Convert::AddInplace { act, x, y, n }, grid_for(n), BLOCK)
    }

    /// `dst[r, dst_col..dst_col + width] = src[r, src_col..src_col + width]` for every row
    /// of `src` (`dst` has as many; both of one element type).
    pub fn copy_cols(
        &mut self,
        (dst, dst_off): (Mat, usize),
        (src, src_off): (Mat, usize),
        width: usize,
    ) -> Result<()> {
        dst.check("copy_cols: dst", src.rows, dst.cols, src.dtype)?;
        if dst_off + width > dst.cols || src_off + width > src.cols {
            return Err(crate::device::GpuError::Invalid(format!(
                "copy_cols: columns {src_off}..+{width} of {} into {dst_off}..+{width} of {}",
                src.cols, dst.cols
            )));
        }
        self.launch(
            Convert::CopyCols {
                act: src.dtype,
                dst: dst.buf,
                src: src.buf,
                width,
                dst_stride: dst.cols,
                dst_off,
                src_stride: src.cols,
                src_off,
            },
            src.rows as u32,
            row_block(width),
        )
    }

    pub fn bf16_to_f32(&mut self, out: DSlice, input: DSlice) -> Result<()> {
        let n = out.len_f32();
        self.launch(Convert::Bf16ToF32 { out, input, n }, grid_for(n), BLOCK)
    }

    pub fn f32_to_bf16(&mut self, out: DSlice, input: DSlice) -> Result<()> {
        let n = input.len_f32();
        self.launch(Convert::F32ToBf16 { out, input, n }, grid_for(n), BLOCK)
    }
}

fn embed_gather(
    rows: usize,
    out: &mut [f32],
    table: &[f32],
    ids: &[u32],
    h: usize,
    vocab: usize,
) -> Result<()> {
    let kernel = "embed_gather";
    need(kernel, "out", out.len(), rows * h)?;
    need(kernel, "ids", ids.len(), rows)?;
    need(kernel, "table", table.len(), vocab * h)?;
    for (r, o) in out.chunks_exact_mut(h).take(rows).enumerate() {
        let id = (ids[r] as usize).min(vocab - 1);
        o.copy_from_slice(&table[id * h..(id + 1) * h]);
    }
    Ok(())
}

fn bf16_to_f32(out: &mut [f32], input: &[u16], n: usize) -> Result<()> {
    need("bf16_to_f32", "out", out.len(), n)?;
    need("bf16_to_f32", "in", input.len(), n)?;
    for (o, b) in out[..n].iter_mut().zip(input) {
        *o = f32::from_bits((*b as u32) << 16);
    }
    Ok(())
}

fn f32_to_bf16(out: &mut [u16], input: &[f32], n: usize) -> Result<()> {
    need("f32_to_bf16", "out", out.len(), n)?;
    need("f32_to_bf16", "in", input.len(), n)?;
    for (o, x) in out[..n].iter_mut().zip(input) {
        *o = half::bf16::from_f32(*x).to_bits();
    }
    Ok(())
}

fn add_inplace(x: &mut [f32], y: &[f32], n: usize) -> Result<()> {
    need("add_inplace", "x", x.len(), n)?;
    need("add_inplace", "y", y.len(), n)?;
    x[..n].iter_mut().zip(y).for_each(|(x, y)| *x += y);
    Ok(())
}

fn scatter_add_rows(
    rows: usize,
    dst: &mut [f32],
    src: &[f32],
    idx: &[u32],
    h: usize,
) -> Result<()> {
    let kernel = "scatter_add_rows";
    need(kernel, "src", src.len(), rows * h)?;
    need(kernel, "idx", idx.len(), rows)?;
    for r in 0..rows {
        let to = idx[r] as usize;
        need(kernel, "dst", dst.len(), (to + 1) * h)?;
        for (d, s) in dst[to * h..(to + 1) * h]
            .iter_mut()
            .zip(&src[r * h..(r + 1) * h])
        {
            *d += s;
        }
    }
    Ok(())
}

/// `(ds, doff)`, `(ss, soff)`: each side's row stride and column offset.
fn copy_cols(
    rows: usize,
    dst: &mut [f32],
    src: &[f32],
    width: usize,
    (ds, doff): (usize, usize),
    (ss, soff): (usize, usize),
) -> Result<()> {
    let kernel = "copy_cols";
    if rows > 0 {
        need(kernel, "dst", dst.len(), (rows - 1) * ds + doff + width)?;
        need(kernel, "src", src.len(), (rows - 1) * ss + soff + width)?;
    }
    for r in 0..rows {
        dst[r * ds + doff..r * ds + doff + width]
            .copy_from_slice(&src[r * ss + soff..r * ss + soff + width]);
    }
    Ok(())
}
