//! The drafter's update on the device: the optimizer's state (Adam moments, step count),
//! the gradient's buckets as the backward finished them and their reduction by a
//! collective, and the step itself: the averaged gradient's norm, the clip, the skip of a
//! non-finite gradient and AdamW, with the outcome and the weights' checksum copied back
//! behind events so that the host never waits inside a step.

use std::ops::Range;

use super::pinned::Pinned;
use crate::device::ops::adamw::scale_on;
use crate::device::ops::{AdamBuffers, AdamHyper, Ops};
use crate::device::{f32_bytes, f32_bytes_mut, i32_bytes, DSlice, Device, Event, Result, Stream};

/// The optimizer's buffers on the device: the Adam moments of the fp32 master weights,
/// the averaged gradient of the step being applied, and the step's norm, skip flag, Adam
/// step count and the weights' checksum.
pub(super) struct Opt {
    m: DSlice,
    v: DSlice,
    gsum: DSlice,
    /// The group's unnormalised gradient sum as a device collective leaves it (NCCL
    /// all-reduces the gradient into it), which the `scale` kernel scales into `gsum`.
    gred: DSlice,
    /// Σg² (one f64), and each block's share of it.
    acc: DSlice,
    partials: DSlice,
    /// Set when the gradient is not finite (one i32).
    flag: DSlice,
    /// Adam's step count (one i32).
    t: DSlice,
    /// [`crate::device::ops::params_hash`] of the weights (one u64).
    hash: DSlice,
}

impl Opt {
    /// The buffers for `total` parameters (`f` allocates `n` floats by name).
    pub(super) fn alloc(
        f: &mut impl FnMut(usize, &str) -> Result<DSlice>,
        total: usize,
    ) -> Result<Opt> {
        Ok(Opt {
            m: f(total, "adam m")?,
            v: f(total, "adam v")?,
            gsum: f(total, "averaged gradient")?,
            gred: f(total, "all-reduced gradient")?,
            acc: f(2, "gradient sumsq")?,
            partials: f(
                2 * crate::device::ops::SUMSQ_BLOCKS,
                "gradient sumsq partials",
            )?,
            flag: f(1, "non-finite flag")?,
            t: f(1, "adam step")?,
            hash: f(2, "weights checksum")?,
        })
    }
}

/// What the device said about an applied step, read a step later.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    pub step: u64,
    /// The gradient was not finite: weights and moments were left as they were.
    pub skipped: bool,
    /// The averaged gradient's norm before clipping (NaN when skipped).
    pub grad_norm: f64,
}

/// The weights an update changes: the f32 master copy and its bf16 copy for a GPU's
/// GEMMs (refreshed after every change).
#[derive(Clone, Copy)]
pub(super) struct Weights {
    pub(super) f32: DSlice,
    pub(super) bf16: Option<DSlice>,
}

/// The gradient a step applies.
pub enum Gradient<'a> {
    /// The averaged gradient, from the host.
    Host(&'a [f32]),
    /// The group's sum that a device collective left in the reduce buffer, scaled on the
    /// device by `1 / weight_sum`, after `after` (the collective's event).
    Reduced {
        weight_sum: f64,
        after: Option<Event>,
    },
}

/// One step's settings: its number, the gradient norm's clip (0: none), the learning
/// rate and AdamW's constants.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    pub step: u64,
    pub clip: f32,
    pub lr: f32,
    pub hyper: &'a AdamHyper,
}

impl<'a> Step<'a> {
    pub fn new(step: u64, clip: f32, lr: f32, hyper: &'a AdamHyper) -> Step<'a> {
        Step {
            step,
            clip,
            lr,
            hyper,
        }
    }
}

/// Where in the pinned page the step's flag (i32), its Σg² (f64) and the weights'
/// checksum (u64) land.
const FLAG_AT: usize = 0;
const SUMSQ_AT: usize = 8;
const HASH_AT: usize = 16;

/// The optimizer's state and what is on its way back from the device.
pub(super) struct Update {
    opt: Opt,
    page: Pinned,
    /// The step whose outcome is on its way into `page`, and the event behind it.
    pending: Option<(u64, Event)>,
    /// The weights' checksum, queued behind every change of the weights (a step, a load)
    /// and on its way into `page` behind this event; then the value read.
    hash_pending: Option<Event>,
    hash_known: Option<u64>,
    /// The last batch's gradient buckets, in the order backward finished them: each
    /// parameter range and an event on the compute stream behind its last write (recorded
    /// during the last sample's backward, so a collective can reduce a bucket while the
    /// rest of the backward runs).
    buckets: Vec<(Range<usize>, Event)>,
}

impl Update {
    /// The update over `opt`, with its pinned page registered with `dev`.
    pub(super) fn new(dev: &mut dyn Device, opt: Opt) -> Result<Update> {
        let page = Pinned::new(dev, HASH_AT + 8)?;
        Ok(Update {
            opt,
            page,
            pending: None,
            hash_pending: None,
            hash_known: None,
            buckets: Vec::new(),
        })
    }

    /// Put the training state on the device: weights, Adam moments and step count. What
    /// was on its way back from the last step is dropped.
    pub(super) fn load(
        &mut self,
        ops: &mut Ops,
        wt: Weights,
        state: (&[f32], &[f32], &[f32]),
        adam_step: u64,
    ) -> Result<()> {
        self.drain(ops)?;
        let (params, m, v) = state;
        let o = &self.opt;
        let dev = &mut ops.dev;
        dev.upload(Stream::Compute, wt.f32, f32_bytes(params))?;
        dev.upload(Stream::Compute, o.m, f32_bytes(m))?;
        dev.upload(Stream::Compute, o.v, f32_bytes(v))?;
        dev.upload(Stream::Compute, o.t, i32_bytes(&[adam_step as i32]))?;
        refresh_bf16(ops, wt)?;
        self.queue_hash(ops, wt)?;
        ops.dev.sync()
    }

    /// The training state back from the device (weights, moments); returns the Adam step
    /// count.
    pub(super) fn fetch(
        &mut self,
        ops: &mut Ops,
        wt: Weights,
        state: (&mut [f32], &mut [f32], &mut [f32]),
    ) -> Result<u64> {
        let (params, m, v) = state;
        let o = &self.opt;
        let dev = &mut ops.dev;
        dev.download(Stream::Compute, wt.f32, f32_bytes_mut(params))?;
        dev.download(Stream::Compute, o.m, f32_bytes_mut(m))?;
        dev.download(Stream::Compute, o.v, f32_bytes_mut(v))?;
        let mut t = [0u8; 4];
        dev.download(Stream::Compute, o.t.sub(1, 0..4), &mut t)?;
        Ok(i32::from_le_bytes(t) as u64)
    }

    /// Queue the checksum of the weights as they are now, and its copy into the page
    /// behind an event: read by [`weights_checksum`](Self::weights_checksum) once the
    /// device has long done it, so that no host wait sits inside a step.
    fn queue_hash(&mut self, ops: &mut Ops, wt: Weights) -> Result<()> {
        if let Some(e) = self.hash_pending.take() {
            ops.dev.release_event(e);
        }
        self.hash_known = None;
        ops.dev.memset_zero(Stream::Compute, self.opt.hash)?;
        ops.params_hash(self.opt.hash, wt.f32)?;
        // SAFETY: the page is registered, and nothing reads these bytes before the event.
        unsafe {
            ops.dev
                .download_async(Stream::Compute, self.opt.hash, self.page.at(HASH_AT))?;
        }
        self.hash_pending = Some(ops.dev.record(Stream::Compute)?);
        Ok(())
    }

    /// The checksum of the weights the last batch was computed with (those after the last
    /// step or load), which ranks compare at every step. It was computed on the device
    /// right after the weights changed; called once the batch's work is queued, the event
    /// behind it is long complete and the host does not wait for the device here.
    pub(super) fn weights_checksum(&mut self, ops: &mut Ops, wt: Weights) -> Result<u64> {
        if let Some(e) = self.hash_pending.take() {
            ops.dev.sync_event(e)?;
            ops.dev.release_event(e);
            let mut b = [0u8; 8];
            self.page.read(ops.dev.as_mut(), HASH_AT, &mut b)?;
            self.hash_known = Some(u64::from_le_bytes(b));
        }
        match self.hash_known {
            Some(h) => Ok(h),
            None => self.params_hash(ops, wt),
        }
    }

    /// The weights' checksum ([`crate::device::ops::params_hash`]), computed on the
    /// device now.
    pub(super) fn params_hash(&mut self, ops: &mut Ops, wt: Weights) -> Result<u64> {
        ops.dev.memset_zero(Stream::Compute, self.opt.hash)?;
        ops.params_hash(self.opt.hash, wt.f32)?;
        let mut h = [0u8; 8];
        ops.dev.download(Stream::Compute, self.opt.hash, &mut h)?;
        Ok(u64::from_le_bytes(h))
    }

    /// Apply a step with gradient `g`: the norm, the clip and AdamW all on the device, and
    /// a non-finite gradient leaves everything as it was (the `adamw` kernel checks the
    /// device's flag; the host does not wait for it). The step's outcome comes back by an
    /// asynchronous copy; this returns the previous step's, which has long arrived.
    pub(super) fn apply(
        &mut self,
        ops: &mut Ops,
        wt: Weights,
        g: Gradient,
        args: &Step,
    ) -> Result<Option<StepOutcome>> {
        let before = self.drain(ops)?;
        let o = &self.opt;
        match g {
            Gradient::Host(g) => ops.dev.upload(Stream::Compute, o.gsum, f32_bytes(g))?,
            Gradient::Reduced { weight_sum, after } => {
                if let Some(e) = after {
                    ops.dev.wait(Stream::Compute, e)?;
                    ops.dev.release_event(e);
                }
                let alpha = if weight_sum > 0.0 {
                    (1.0 / weight_sum) as f32
                } else {
                    1.0
                };
                ops.scale(o.gsum, o.gred, alpha)?;
            }
        }
        self.optimize(ops, wt, args)?;
        Ok(before)
    }

    /// Norm, clip, the skip of a non-finite gradient and AdamW over `gsum`, and the
    /// asynchronous readback of the outcome.
    fn optimize(&mut self, ops: &mut Ops, wt: Weights, a: &Step) -> Result<()> {
        let o = &self.opt;
        let (gsum, acc, partials, flag, t) = (o.gsum, o.acc, o.partials, o.flag, o.t);
        ops.dev.memset_zero(Stream::Compute, flag)?;
        ops.sumsq(gsum, partials, acc, flag)?;
        ops.adam_count(t, flag)?;
        let b = AdamBuffers {
            p: wt.f32,
            m: o.m,
            v: o.v,
            g: gsum,
            acc,
            nonfinite: flag,
            t,
        };
        ops.adamw(b, a.clip, a.lr, a.hyper)?;
        refresh_bf16(ops, wt)?;
        self.queue_hash(ops, wt)?;
        // SAFETY: the page is registered, and nothing reads it before the event (`drain`).
        unsafe {
            ops.dev
                .download_async(Stream::Compute, flag.sub(1, 0..4), self.page.at(FLAG_AT))?;
            ops.dev
                .download_async(Stream::Compute, acc.sub(1, 0..8), self.page.at(SUMSQ_AT))?;
        }
        let e = ops.dev.record(Stream::Compute)?;
        self.pending = Some((a.step, e));
        Ok(())
    }

    /// Wait for the last applied step's outcome (it is usually there already).
    pub(super) fn drain(&mut self, ops: &mut Ops) -> Result<Option<StepOutcome>> {
        let Some((step, e)) = self.pending.take() else {
            return Ok(None);
        };
        ops.dev.sync_event(e)?;
        ops.dev.release_event(e);
        let mut b = [0u8; 16];
        self.page.read(ops.dev.as_mut(), FLAG_AT, &mut b)?;
        let skipped = i32::from_le_bytes(b[..4].try_into().expect("4 bytes")) != 0;
        let sumsq = f64::from_le_bytes(b[SUMSQ_AT..].try_into().expect("8 bytes"));
        Ok(Some(StepOutcome {
            step,
            skipped,
            grad_norm: if skipped { f64::NAN } else { sumsq.sqrt() },
        }))
    }

    /// The buffer a device collective sums the group's gradients into.
    pub(super) fn reduced(&self) -> DSlice {
        self.opt.gred
    }

    /// A new batch's backward starts: the last one's buckets are void.
    pub(super) fn release_buckets(&mut self, dev: &mut dyn Device) {
        for (_, e) in self.buckets.drain(..) {
            dev.release_event(e);
        }
    }

    /// The buckets the last sample's backward finished, in order, each with its event.
    pub(super) fn set_buckets(&mut self, buckets: Vec<(Range<usize>, Event)>) {
        self.buckets = buckets;
    }

    /// The parameter ranges of the last batch's buckets, in the order backward finished
    /// them.
    pub(super) fn bucket_ranges(&self) -> Vec<Range<usize>> {
        self.buckets.iter().map(|(r, _)| r.clone()).collect()
    }

    /// Reduce the last batch's gradient bucket by bucket on `stream`, each as soon as the
    /// backward has finished it: `reduce(device, bucket of the gradient, the same range of
    /// the reduce buffer)` is queued on `stream` behind the bucket's event. Without the
    /// backward's events (a zero gradient, or no sample) each of `plan`'s buckets waits for
    /// everything queued so far. Returns an event on `stream` behind the last one.
    pub(super) fn reduce_buckets(
        &mut self,
        ops: &mut Ops,
        grads: DSlice,
        plan: Vec<Range<usize>>,
        stream: Stream,
        reduce: &mut dyn FnMut(&mut dyn Device, DSlice, DSlice) -> Result<()>,
    ) -> Result<Event> {
        let mut buckets = std::mem::take(&mut self.buckets);
        if buckets.is_empty() {
            for r in plan {
                buckets.push((r, ops.dev.record(Stream::Compute)?));
            }
        }
        let gred = self.opt.gred;
        let dev = ops.dev.as_mut();
        let mut result = Ok(());
        for (r, e) in buckets {
            if result.is_ok() {
                result = dev
                    .wait(stream, e)
                    .and_then(|_| reduce(dev, grads.f32s(r.clone()), gred.f32s(r)));
            }
            dev.release_event(e);
        }
        result?;
        dev.record(stream)
    }

    /// A one-rank group's "all-reduce": the gradient copied into the reduce buffer on the
    /// copy stream, bucket by bucket behind the backward.
    pub(super) fn reduce_alone(
        &mut self,
        ops: &mut Ops,
        grads: DSlice,
        plan: Vec<Range<usize>>,
    ) -> Result<Event> {
        self.reduce_buckets(ops, grads, plan, Stream::Copy, &mut |dev, g, r| {
            scale_on(dev, Stream::Copy, r, g, 1.0)
        })
    }
}

/// The weights' bf16 copy, after they changed (a GPU's GEMMs read it).
fn refresh_bf16(ops: &mut Ops, wt: Weights) -> Result<()> {
    match wt.bf16 {
        Some(b) => ops.f32_to_bf16(b, wt.f32),
        None => Ok(()),
    }
}
