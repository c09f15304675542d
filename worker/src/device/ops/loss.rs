//! The cross-entropy through the frozen lm_head, a vocabulary chunk at a time
//! (`cuda/loss.cuh`): the kernels and their arguments, their launches on [`Ops`], and
//! their CPU bodies.

#![allow(clippy::needless_range_loop)] // the CPU bodies index several buffers by one row/element index, as the CUDA source does

use super::on_cpu::{need, rd, wr, Widened};
use super::{i32_of, row_block, DType, Mat, Ops};
use crate::device::{Arg, DSlice, Result};
use crate::math::exp_neg;

/// The cross-entropy's rows over the vocabulary chunks (loss.cuh's `ce_fold`): each
/// row's running max, Σexp (relative to that max), argmax (i32 id) and label logit, and
/// `acc` `[rows, h]`, Σ exp(l − max)·W over the chunks so far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CeState {
    pub run_max: DSlice,
    pub run_sum: DSlice,
    pub best_i: DSlice,
    pub label_logit: DSlice,
    pub acc: DSlice,
}

/// The cross-entropy's kernels, each with its arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Loss {
    /// Fold a vocabulary chunk of logits (`[rows, cw]`, ids `start..start+cw`; bf16 at
    /// `act` bf16) into each row's [`CeState`] (labels i32), the logits becoming
    /// `exp(l − max)` in place.
    CeFold {
        act: DType,
        st: CeState,
        logits: DSlice,
        labels: DSlice,
        cw: usize,
        start: usize,
        h: usize,
    },
    /// After the last chunk: `dx = scale·(acc/Σexp − W[label])` (`[rows, h]`, written),
    /// each row's cross-entropy (`loss`) and whether its argmax is its label (`correct`,
    /// i32), with the lm_head `w` `[vocab, h]` (bf16 at `act` bf16; labels i32).
    CeFinish {
        act: DType,
        st: CeState,
        dx: DSlice,
        loss: DSlice,
        correct: DSlice,
        labels: DSlice,
        scale: DSlice,
        w: DSlice,
        h: usize,
        vocab: usize,
    },
}

impl Loss {
    /// Bytes of dynamic shared memory: none for these kernels.
    pub fn dynamic_shared_bytes(&self) -> u32 {
        0
    }

    /// The kernel's symbol in the CUDA source.
    pub fn name(&self) -> &'static str {
        match *self {
            Loss::CeFold { act: a, .. } => a.pick("ce_fold", "ce_fold_bf16"),
            Loss::CeFinish { act: a, .. } => a.pick("ce_finish", "ce_finish_bf16"),
        }
    }

    /// The arguments as the kernel's C parameters, in order: each buffer marked as the
    /// kernel reads it, writes it, or both; each scalar of its parameter's C type.
    pub fn args(&self) -> Vec<Arg> {
        use Arg::{R, RW, W};
        match *self {
            Loss::CeFold {
                st,
                logits,
                labels,
                cw,
                start,
                h,
                ..
            } => vec![
                RW(st.run_max),
                RW(st.run_sum),
                RW(st.best_i),
                RW(st.label_logit),
                RW(st.acc),
                RW(logits),
                R(labels),
                i32_of(cw),
                i32_of(start),
                i32_of(h),
            ],
            Loss::CeFinish {
                st,
                dx,
                loss,
                correct,
                labels,
                scale,
                w,
                h,
                vocab,
                ..
            } => vec![
                W(dx),
                W(loss),
                W(correct),
                R(st.run_max),
                R(st.run_sum),
                R(st.best_i),
                R(st.label_logit),
                R(st.acc),
                R(labels),
                R(scale),
                R(w),
                i32_of(h),
                i32_of(vocab),
            ],
        }
    }

    /// One launch of each kernel (each of its symbols), all buffers `b`.
    pub fn every(b: DSlice) -> Vec<Loss> {
        let st = CeState {
            run_max: b,
            run_sum: b,
            best_i: b,
            label_logit: b,
            acc: b,
        };
        let mut all = Vec::new();
        for act in [DType::F32, DType::Bf16] {
            all.extend([
                Loss::CeFold {
                    act,
                    st,
                    logits: b,
                    labels: b,
                    cw: 1,
                    start: 0,
                    h: 1,
                },
                Loss::CeFinish {
                    act,
                    st,
                    dx: b,
                    loss: b,
                    correct: b,
                    labels: b,
                    scale: b,
                    w: b,
                    h: 1,
                    vocab: 1,
                },
            ]);
        }
        all
    }

    /// The f32 kernel a bf16 one runs as on the CPU, over `w`'s temporaries; `None` for a
    /// kernel that is f32 already.
    ///
    /// # Safety
    /// The kernel's buffers are the CPU device's memory.
    pub(crate) unsafe fn as_f32(&self, w: &mut Widened) -> Option<Loss> {
        let mut k = *self;
        match &mut k {
            Loss::CeFold { act, logits, .. } if *act == DType::Bf16 => {
                *logits = w.output(*logits);
                *act = DType::F32;
            }
            Loss::CeFinish { act, w: lm, .. } if *act == DType::Bf16 => {
                *lm = w.input(*lm);
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
            Loss::CeFold {
                st,
                logits,
                labels,
                cw,
                start,
                h,
                ..
            } => ce_fold(
                rows,
                CeRows {
                    run_max: wr(st.run_max),
                    run_sum: wr(st.run_sum),
                    best_i: wr(st.best_i),
                    label_logit: wr(st.label_logit),
                    acc: wr(st.acc),
                },
                (wr(logits), rd(labels)),
                (cw, start, h),
            ),
            Loss::CeFinish {
                st,
                dx,
                loss,
                correct,
                labels,
                scale,
                w,
                h,
                vocab,
                ..
            } => ce_finish(
                rows,
                (wr(dx), wr(loss), wr(correct)),
                &CeDone {
                    run_max: rd(st.run_max),
                    run_sum: rd(st.run_sum),
                    best_i: rd(st.best_i),
                    label_logit: rd(st.label_logit),
                    acc: rd(st.acc),
                },
                (rd(labels), rd(scale), rd(w)),
                (h, vocab),
            ),
        }
    }
}

impl Ops {
    /// Fold one vocabulary chunk of `logits` (`[n, cw]`, ids `start..start+cw`; f32 or
    /// bf16) into each row's [`CeState`] for rows of width `h` (`labels`: i32 per row); the
    /// logits become `exp(l − max)` in place, the input of the GEMM that adds them times the
    /// chunk's lm_head rows into `st.acc`.
    pub fn ce_fold(
        &mut self,
        st: CeState,
        logits: Mat,
        labels: DSlice,
        (start, h): (usize, usize),
    ) -> Result<()> {
        let (n, cw) = (logits.rows, logits.cols);
        self.launch(
            Loss::CeFold {
                act: logits.dtype,
                st,
                logits: logits.buf,
                labels,
                cw,
                start,
                h,
            },
            n as u32,
            row_block(cw),
        )
    }

    /// After the last chunk: `dx` (f32 `[n, h]`, written) = `scale·(acc/Σexp − W[label])`,
    /// each row's cross-entropy into `loss` and `argmax == label` into `correct` (i32);
    /// `w` the lm_head (`[vocab, h]`, f32 or bf16).
    pub fn ce_finish(
        &mut self,
        st: CeState,
        (dx, loss, correct): (Mat, DSlice, DSlice),
        (labels, scale): (DSlice, DSlice),
        w: Mat,
    ) -> Result<()> {
        let (n, h, vocab) = (dx.rows, w.cols, w.rows);
        dx.check("ce_finish: dx", n, h, DType::F32)?;
        self.launch(
            Loss::CeFinish {
                act: w.dtype,
                st,
                dx: dx.buf,
                loss,
                correct,
                labels,
                scale,
                w: w.buf,
                h,
                vocab,
            },
            n as u32,
            row_block(h),
        )
    }
}

/// The cross-entropy's rows over the vocabulary chunks (see [`CeState`]).
struct CeRows<'a> {
    run_max: &'a mut [f32],
    run_sum: &'a mut [f32],
    best_i: &'a mut [i32],
    label_logit: &'a mut [f32],
    acc: &'a mut [f32],
}

/// `(cw, start, h)`: the chunk's width and first vocabulary id, and the rows' width.
fn ce_fold(
    rows: usize,
    st: CeRows<'_>,
    (logits, labels): (&mut [f32], &[i32]),
    (cw, start, h): (usize, usize, usize),
) -> Result<()> {
    let kernel = "ce_fold";
    let have = (st.run_max.len().min(st.run_sum.len()).min(st.best_i.len()))
        .min(st.label_logit.len().min(labels.len()));
    need(kernel, "row state", have, rows)?;
    need(kernel, "acc", st.acc.len(), rows * h)?;
    need(kernel, "logits", logits.len(), rows * cw)?;
    for r in 0..rows {
        let lr = &mut logits[r * cw..(r + 1) * cw];
        let (mut cmax, mut cidx) = (f32::NEG_INFINITY, 0usize);
        for (j, &v) in lr.iter().enumerate() {
            if v > cmax {
                (cmax, cidx) = (v, j);
            }
        }
        let m_old = st.run_max[r];
        let m_new = m_old.max(cmax);
        let lab = labels[r];
        if lab >= start as i32 && (lab as usize) < start + cw {
            st.label_logit[r] = lr[lab as usize - start];
        }
        let mut s = 0f32;
        for l in lr.iter_mut() {
            *l = exp_neg(*l - m_new);
            s += *l;
        }
        if m_new > m_old {
            let f = exp_neg(m_old - m_new);
            st.acc[r * h..(r + 1) * h].iter_mut().for_each(|a| *a *= f);
        }
        st.run_sum[r] = st.run_sum[r] * exp_neg(m_old - m_new) + s;
        st.run_max[r] = m_new;
        if cmax > m_old {
            st.best_i[r] = (start + cidx) as i32;
        }
    }
    Ok(())
}

/// The cross-entropy's rows after the last chunk (see [`CeRows`]).
struct CeDone<'a> {
    run_max: &'a [f32],
    run_sum: &'a [f32],
    best_i: &'a [i32],
    label_logit: &'a [f32],
    acc: &'a [f32],
}

/// `(dx, loss, correct)` written from the rows' state, `(labels, scale, w)` and
/// `(h, vocab)`, as loss.cuh's `ce_finish`.
fn ce_finish(
    rows: usize,
    (dx, loss, correct): (&mut [f32], &mut [f32], &mut [i32]),
    st: &CeDone<'_>,
    (labels, scale, w): (&[i32], &[f32], &[f32]),
    (h, vocab): (usize, usize),
) -> Result<()> {
    let kernel = "ce_finish";
    let have = (loss.len().min(correct.len()).min(st.run_max.len()))
        .min(
            st.run_sum
                .len()
                .min(st.best_i.len())
                .min(st.label_logit.len()),
        )
        .min(labels.len().min(scale.len()));
    need(kernel, "row state", have, rows)?;
    need(kernel, "dx and acc", dx.len().min(st.acc.len()), rows * h)?;
    need(kernel, "w", w.len(), vocab * h)?;
    for r in 0..rows {
        let lab = labels[r];
        let wl = (lab >= 0 && (lab as usize) < vocab).then(|| &w[lab as usize * h..][..h]);
        let (inv, sc) = (1.0 / st.run_sum[r], scale[r]);
        for d in 0..h {
            let wd = wl.map_or(0.0, |wl| wl[d]);
            dx[r * h + d] = sc * (st.acc[r * h + d] * inv - wd);
        }
        loss[r] = st.run_max[r] + st.run_sum[r].ln() - st.label_logit[r];
        correct[r] = (st.best_i[r] == lab) as i32;
    }
    Ok(())
}
