//! The drafter's loss on the device: the cross-entropy of a sample's supervised block
//! rows through the frozen lm_head, a vocabulary chunk at a time (logits one GEMM per
//! chunk, the softmax statistics folded on the device), with its gradient with respect
//! to the final hidden states. Each row's loss and `argmax == label` stay on the device
//! until the step's are read together into pinned pages, behind an event: [`Loss`] owns
//! that readback and folds what it reads into the step's statistics.

use dflash_shared::drafter::StepStats;

use super::layers::{Locals, Pass};
use super::layout::{Work, CE_SAMPLES, CHUNK};
use super::pinned::Pinned;
use crate::device::ops::gemm::Dx;
use crate::device::ops::{DType, Mat};
use crate::device::{f32_bytes, i32_bytes, u32_bytes, Device, Event, Result, Stream};
use crate::models::drafter::{Drafter, Sample};

/// A sample's supervised rows (block row, loss weight), whose losses and flags are on the
/// device from `offset` on, and its number of blocks.
struct PendingCe {
    offset: usize,
    rows: Vec<(usize, f64)>,
    nb: usize,
}

/// The cross-entropy's readback: the samples whose losses wait on the device (in
/// `Work::ce_loss`, `ce_correct`), the rows they fill, and what the ones read so far added
/// to the step's statistics.
pub(super) struct Loss {
    /// `cap` losses (f32), then `cap` hits (i32).
    rows: Pinned,
    cap: usize,
    block_size: usize,
    pending: Vec<PendingCe>,
    used: usize,
    read: StepStats,
    /// The pending rows' losses and hits on their way into `rows` (rows, and the event
    /// behind the copies).
    inflight: Option<(usize, Event)>,
}

impl Loss {
    /// Room for [`CE_SAMPLES`] samples of up to `max_rows` block rows, its pages
    /// registered with `dev`.
    pub(super) fn new(dev: &mut dyn Device, max_rows: usize, block_size: usize) -> Result<Loss> {
        let cap = max_rows * CE_SAMPLES;
        Ok(Loss {
            rows: Pinned::new(dev, cap * 8)?,
            cap,
            block_size,
            pending: Vec::new(),
            used: 0,
            read: StepStats::default(),
            inflight: None,
        })
    }

    /// A batch starts: nothing of an earlier one is pending.
    pub(super) fn begin(&mut self, dev: &mut dyn Device) {
        self.pending.clear();
        self.used = 0;
        self.read = StepStats::default();
        if let Some((_, e)) = self.inflight.take() {
            // Left by a batch that failed; its rows are void.
            dev.release_event(e);
        }
    }

    /// What the rows read so far added to the batch's statistics.
    pub(super) fn take_read(&mut self) -> StepStats {
        std::mem::take(&mut self.read)
    }

    /// The loss over a sample's weighted slots, with its gradient with respect to `hn` (in
    /// `dxrows`, for the returned number of supervised rows) when `grad`, and the
    /// statistics the host knows now (the rest come with the step's read).
    pub(super) fn sample(
        &mut self,
        p: &mut Pass,
        d: &Drafter,
        s: &Sample,
        anchors: &[usize],
        denominator: f64,
        grad: bool,
    ) -> Result<(StepStats, usize)> {
        let Locals {
            bs, slen, nb, m, ..
        } = p.lc;
        // Loss over the weighted slots: their rows gathered, the vocabulary in chunks.
        let rows: Vec<(usize, u32, f64)> = (0..m)
            .filter_map(|i| {
                let (n, k) = (i / bs, i % bs);
                let wgt = d.slot_weight(anchors[n], k, s.mask);
                (wgt > 0.0).then(|| (i, s.ids[anchors[n] + k], wgt))
            })
            .collect();
        let mut stats = StepStats {
            slot_correct: vec![0; bs],
            slot_total: vec![0; bs],
            tokens: slen as u64,
            anchors: nb as u64,
            ..Default::default()
        };
        let n = rows.len();
        // What the host knows; the loss and what depends on `argmax == label` (the slots'
        // hits, each block's accepted run beyond its first token) come with the step's
        // read.
        for &(i, _, wgt) in &rows {
            stats.weight_sum += wgt;
            stats.slot_total[i % bs] += 1;
        }
        stats.accept_sum += nb as f64;
        stats.blocks += nb as u64;
        if n > 0 {
            if self.used + n > self.cap {
                self.start_read(p.ops.dev.as_mut(), p.w)?;
                self.finish_read(p.ops.dev.as_mut())?;
            }
            let at = self.used;
            gather_rows(p, &rows, denominator)?;
            cross_entropy(p, n, at, grad)?;
            self.used += n;
            let rows = rows.iter().map(|r| (r.0, r.2)).collect();
            self.pending.push(PendingCe {
                offset: at,
                rows,
                nb,
            });
        }
        Ok((stats, n))
    }

    /// Queue the copies of the pending rows' losses and hits (`w.ce_loss`, `ce_correct`)
    /// into the pinned pages, behind an event: nothing waits here.
    pub(super) fn start_read(&mut self, dev: &mut dyn Device, w: &Work) -> Result<()> {
        let used = self.used;
        if used == 0 || self.inflight.is_some() {
            return Ok(());
        }
        // SAFETY: the pages are registered and hold `cap` losses and hits; nothing reads
        // them before the event (`finish_read`).
        unsafe {
            dev.download_async(Stream::Compute, w.ce_loss.f32s(0..used), self.rows.at(0))?;
            dev.download_async(
                Stream::Compute,
                w.ce_correct.f32s(0..used),
                self.rows.at(self.cap * 4),
            )?;
        }
        let e = dev.record(Stream::Compute)?;
        self.inflight = Some((used, e));
        Ok(())
    }

    /// Wait for the rows [`start_read`](Self::start_read) queued and fold them, sample by
    /// sample, into the step's statistics: the loss, each slot's hits and each block's run
    /// of hits after its first token.
    pub(super) fn finish_read(&mut self, dev: &mut dyn Device) -> Result<()> {
        let Some((used, e)) = self.inflight.take() else {
            return Ok(());
        };
        let r = dev.sync_event(e);
        dev.release_event(e);
        r?;
        let (mut loss, mut ok) = (vec![0u8; used * 4], vec![0u8; used * 4]);
        self.rows.read(dev, 0, &mut loss)?;
        self.rows.read(dev, self.cap * 4, &mut ok)?;
        let loss = |r: usize| f32::from_le_bytes(loss[r * 4..r * 4 + 4].try_into().expect("4"));
        let hit = |r: usize| i32::from_le_bytes(ok[r * 4..r * 4 + 4].try_into().expect("4")) != 0;
        self.used = 0;
        let bs = self.block_size;
        for p in std::mem::take(&mut self.pending) {
            let mut st = StepStats {
                slot_correct: vec![0; bs],
                slot_total: vec![0; bs],
                ..Default::default()
            };
            let mut correct = vec![false; p.nb * bs];
            for (r, &(i, wgt)) in p.rows.iter().enumerate() {
                let h = hit(p.offset + r);
                st.loss_sum += wgt * loss(p.offset + r) as f64;
                correct[i] = h;
                st.slot_correct[i % bs] += h as u64;
            }
            for a in 0..p.nb {
                // Rows without weight are never a hit: a run stops at the first of them.
                let run = (1..bs).take_while(|&k| correct[a * bs + k]).count();
                st.accept_sum += run as f64;
            }
            self.read.merge(&st);
        }
        Ok(())
    }
}

/// The supervised rows on the device (their indices, labels and loss scales), and
/// their final hidden states gathered into `xrows`.
fn gather_rows(p: &mut Pass, rows: &[(usize, u32, f64)], denominator: f64) -> Result<()> {
    let Locals { h, m, hn, .. } = p.lc;
    let (w, ops) = (p.w, &mut *p.ops);
    let n = rows.len();
    let idx: Vec<u32> = rows.iter().map(|r| r.0 as u32).collect();
    let labels: Vec<i32> = rows.iter().map(|r| r.1 as i32).collect();
    let scale: Vec<f32> = rows.iter().map(|r| (r.2 / denominator) as f32).collect();
    ops.dev.upload(Stream::Compute, w.rows, u32_bytes(&idx))?;
    ops.dev
        .upload(Stream::Compute, w.labels, i32_bytes(&labels))?;
    ops.dev
        .upload(Stream::Compute, w.scale, f32_bytes(&scale))?;
    ops.embed(w.xrows.f32s(0..n * h), hn, w.rows.f32s(0..n), n, h, m)
}

/// The cross-entropy of the `n` supervised rows in one pass over the vocabulary, a
/// chunk at a time: the logits GEMM (bf16 out on a GPU), their fold into the rows'
/// online softmax (they become `exp(l − max)`), and the GEMM adding those times the
/// chunk's lm_head rows into `acc`; then `dxrows` = dCE/dx and each row's loss and
/// `argmax == label` (`ce_loss`, `ce_correct`, from `at` on: they stay on the device
/// until the step's are read together). The rows are cast to bf16 once. Without
/// `grad` (held-out evaluation) the second GEMM is skipped: one GEMM per chunk, and
/// `dxrows` is not the gradient.
fn cross_entropy(p: &mut Pass, n: usize, at: usize, grad: bool) -> Result<()> {
    let lc = p.lc;
    let Locals { h, vocab, mx, .. } = lc;
    let (w, ops) = (p.w, &mut *p.ops);
    let xr = w.xrows.f32s(0..n * h);
    let labels = w.labels.f32s(0..n);
    let (act, x, lm) = if mx.bf16 {
        let xb = mx.xb.sub(2, 0..n * h);
        ops.f32_to_bf16(xb, xr)?;
        (DType::Bf16, xb, lc.lm16.sub(2, 0..vocab * h))
    } else {
        (DType::F32, xr, lc.lm32.f32s(0..vocab * h))
    };
    let st = w.ce_state(n, h);
    let neg_inf = vec![f32::NEG_INFINITY; n];
    ops.dev
        .upload(Stream::Compute, st.run_max, f32_bytes(&neg_inf))?;
    for b in [st.run_sum, st.best_i, st.label_logit, st.acc] {
        ops.dev.memset_zero(Stream::Compute, b)?;
    }
    let x = Mat::new(x, n, h, act);
    let acc = Mat::f32(st.acc, n, h);
    for start in (0..vocab).step_by(CHUNK) {
        let cw = CHUNK.min(vocab - start);
        // The chunk's logits in the GEMMs' type (bf16 on a GPU).
        let wc = mx.weight(lc.lmw(start, cw), cw, h);
        let l = Mat::new(w.logits, n, cw, act);
        ops.matmul(x, wc, l)?;
        ops.ce_fold(st, Mat::new(l.buf, n, cw, act), labels, (start, h))?;
        if grad {
            ops.matmul_backward(l, x, wc, Dx::Add(acc), None)?;
        }
    }
    let out = (
        Mat::f32(w.dxrows, n, h),
        w.ce_loss.f32s(at..at + n),
        w.ce_correct.f32s(at..at + n),
    );
    let scale = w.scale.f32s(0..n);
    ops.ce_finish(st, out, (labels, scale), Mat::new(lm, vocab, h, act))
}
