//! The DFlash drafter's forward and backward on a [`Device`]: the one definition of the
//! drafter's math the workers run, on a GPU or on the CPU device (the parity tests check
//! it against the reference drafter, `crate::reference::drafter`). Shaped as llm.c's
//! `train_gpt2.cu` is:
//!
//! - `layout`: every buffer placed once from the arena, for the largest sample;
//! - `layers`: the pass (a sample's forward, layer by layer, and its backward);
//! - `loss`: the chunked cross-entropy and the readback of its rows' losses;
//! - `update`: the optimizer's state, the gradient's buckets and the step;
//! - `inputs`: a sample's taps and positions on the device; `mixed`: the GEMMs' bf16
//!   casts on a GPU; `pinned`: the host pages results come back into.
//!
//! [`DeviceDrafter`] owns one of each, and its verbs are the forward-backward of a batch
//! (the gradient left on the device or copied to the host), its evaluation, and the
//! update.

mod inputs;
mod layers;
mod layout;
mod loss;
mod mixed;
mod pinned;
mod update;

use dflash_shared::drafter::StepStats;

use self::inputs::Taps;
use self::layers::{Locals, Pass};
use self::layout::{Buffers, Dims};
use self::loss::Loss;
pub use self::update::{Gradient, Step, StepOutcome};
use self::update::{Update, Weights};
use crate::device::ops::Ops;
use crate::device::{f32_bytes_mut, Arena, DSlice, Device, Event, GpuError, Result, Stream};
use crate::models::drafter::{Drafter, Frozen, Sample};

pub struct DeviceDrafter {
    d: Drafter,
    // Declared before `loss` and `update`: the device unregisters their pinned pages
    // before they are freed.
    ops: Ops,
    loss: Loss,
    update: Update,
    _arena: Arena,
    b: Buffers,
    max_len: usize,
    max_rows: usize,
}

/// Where a batch's taps come from.
#[derive(Clone, Copy)]
pub enum Rows<'a> {
    /// Each sample's own f32 `taps`, uploaded.
    F32,
    /// Each sample's taps as the bf16 bytes of its hidden-state slot (`[len, n_taps ×
    /// hidden]` bf16, little-endian, one row per sample): copied as they are, half the
    /// bytes of f32, while the previous sample computes, and widened on the device, with no
    /// pass over them on the host. The samples' own `taps` are not read.
    Bf16(&'a [&'a [u8]]),
}

/// Where a forward-backward's gradient goes.
pub enum GradTo<'a> {
    /// It stays on the device, for a collective.
    Device,
    /// It is also copied into this slice (the parameter count of f32).
    Host(&'a mut [f32]),
}

/// What a batch computes and where its gradient goes.
enum Grad<'a> {
    Device,
    Host(&'a mut [f32]),
    /// The forward and loss alone (held-out evaluation).
    Nowhere,
}

impl DeviceDrafter {
    /// Room for samples of up to `max_len` positions with up to the drafter's
    /// `max_anchors` blocks.
    pub fn new(
        mut dev: Box<dyn Device>,
        d: &Drafter,
        frozen: &Frozen,
        max_len: usize,
    ) -> Result<DeviceDrafter> {
        let (s, m) = (
            max_len.max(1),
            (d.cfg.max_anchors * d.cfg.block_size).max(1),
        );
        let what = format!(
            "the drafter (rows of up to {s} tokens, {} blocks)",
            d.cfg.max_anchors
        );
        let bf16 = !dev.is_cpu();
        let mut dry = Arena::dry();
        Buffers::place(dev.as_mut(), &mut dry, d, frozen, s, m, bf16)?;
        let mut arena = Arena::for_model(dev.as_mut(), dry.mark(), &what)?;
        let (b, opt) = Buffers::place(dev.as_mut(), &mut arena, d, frozen, s, m, bf16)?;
        let loss = Loss::new(dev.as_mut(), m, d.cfg.block_size)?;
        let update = Update::new(dev.as_mut(), opt)?;
        let gred = update.reduced();
        let mut g = DeviceDrafter {
            d: Drafter::new(d.cfg.clone()),
            ops: Ops::new(dev),
            loss,
            update,
            _arena: arena,
            b,
            max_len: s,
            max_rows: m,
        };
        // Each bucket of the gradient (and of the reduce buffer) is its own region to the
        // host device's race detector: a collective reads one while the backward writes
        // the next.
        for (k, r) in g.bucket_plan().into_iter().enumerate() {
            let grads = g.b.grads.f32s(r.clone());
            g.ops.dev.track(grads, &format!("gradients (bucket {k})"));
            let reduced = gred.f32s(r);
            let name = format!("all-reduced gradients (bucket {k})");
            g.ops.dev.track(reduced, &name);
        }
        // The RMSNorm backward's scratch from the arena, with the rest of the drafter's
        // memory (counted by its preflight), not allocated at the first backward (which
        // would wait for the device inside a step).
        g.ops.use_rmsnorm_partials(g.b.rms_partials);
        Ok(g)
    }

    pub fn describe(&self) -> String {
        self.ops.dev.describe()
    }

    /// The device's per-kernel seconds since the last call (the CPU device measures them).
    pub fn take_kernel_seconds(&mut self) -> Vec<(String, f64)> {
        self.ops.dev.take_kernel_seconds()
    }

    /// The weights as the update sees them.
    fn weights(&self) -> Weights {
        Weights {
            f32: self.b.params,
            bf16: self.b.mixed.bf16.then_some(self.b.params16),
        }
    }

    /// Put the training state on the device: weights, Adam moments and step count. What
    /// was on its way back from the last step is dropped.
    pub fn load(&mut self, params: &[f32], m: &[f32], v: &[f32], adam_step: u64) -> Result<()> {
        let wt = self.weights();
        self.update
            .load(&mut self.ops, wt, (params, m, v), adam_step)
    }

    /// The checksum of the weights the last batch was computed with (those after the last
    /// step or load), which ranks compare at every step. It was computed on the device
    /// right after the weights changed: the host does not wait for the device here.
    pub fn weights_checksum(&mut self) -> Result<u64> {
        let wt = self.weights();
        self.update.weights_checksum(&mut self.ops, wt)
    }

    /// The training state back from the device (weights, moments, Adam step count).
    pub fn fetch(&mut self, params: &mut [f32], m: &mut [f32], v: &mut [f32]) -> Result<u64> {
        let wt = self.weights();
        self.update.fetch(&mut self.ops, wt, (params, m, v))
    }

    /// The weights' checksum ([`crate::device::ops::params_hash`]), computed on the device.
    pub fn params_hash(&mut self) -> Result<u64> {
        let wt = self.weights();
        self.update.params_hash(&mut self.ops, wt)
    }

    /// Apply a step with gradient `g` ([`Gradient::Host`], the group's average; or
    /// [`Gradient::Reduced`], the sum a device collective left in the reduce buffer
    /// ([`Self::reduce_buffers`]), scaled by `1 / weight_sum` on the device as
    /// [`crate::models::drafter::reduce_slots`] scales the host sum): the norm, the clip and
    /// AdamW all on the device, and a non-finite gradient leaves everything as it was (the
    /// `adamw` kernel checks the device's flag; the host does not wait for it). The step's
    /// outcome comes back by an asynchronous copy; this returns the previous step's, which
    /// has long arrived.
    pub fn update(&mut self, step: &Step, g: Gradient) -> Result<Option<StepOutcome>> {
        let wt = self.weights();
        self.update.apply(&mut self.ops, wt, g, step)
    }

    /// Wait for the last applied step's outcome (it is usually there already).
    pub fn drain(&mut self) -> Result<Option<StepOutcome>> {
        self.update.drain(&mut self.ops)
    }

    /// Pin host memory the batches' rows are read from (the hidden-state pool's mapping),
    /// so that their copies to the device are truly asynchronous.
    ///
    /// # Safety
    /// The range must stay mapped while this drafter lives.
    pub unsafe fn register_host(&mut self, ptr: *mut u8, bytes: usize) -> Result<()> {
        self.ops.dev.register_host(ptr, bytes)
    }

    /// This rank's gradient (the last batch's) and the buffer a device collective sums
    /// the group's into; both hold the drafter's parameter count of f32.
    pub fn reduce_buffers(&self) -> (DSlice, DSlice) {
        (self.b.grads, self.update.reduced())
    }

    /// Reduce the last batch's gradient bucket by bucket on `stream`, each as soon as the
    /// backward has finished it: `reduce(device, bucket of the gradient, the same range of
    /// the reduce buffer)` is queued on `stream` behind the bucket's event, so on a GPU it
    /// runs while the rest of the backward does. Buckets cover every parameter exactly
    /// once, the same on every rank; without the backward's events (a zero gradient, or
    /// no sample) each waits for everything queued so far. Returns an event on `stream`
    /// behind the last one: give it to [`update`](Self::update) with [`Gradient::Reduced`].
    pub fn reduce_buckets(
        &mut self,
        stream: Stream,
        mut reduce: impl FnMut(&mut dyn Device, DSlice, DSlice) -> Result<()>,
    ) -> Result<Event> {
        let plan = self.bucket_plan();
        self.update
            .reduce_buckets(&mut self.ops, self.b.grads, plan, stream, &mut reduce)
    }

    /// A one-rank group's "all-reduce": its gradient copied into the reduce buffer on the
    /// copy stream, bucket by bucket behind the backward. Returns the event for
    /// [`update`](Self::update) with [`Gradient::Reduced`].
    pub fn reduce_alone(&mut self) -> Result<Event> {
        let plan = self.bucket_plan();
        self.update.reduce_alone(&mut self.ops, self.b.grads, plan)
    }

    /// The parameter ranges of the last batch's buckets, in the order backward finished
    /// them (for tests and the benchmark).
    pub fn bucket_ranges(&self) -> Vec<std::ops::Range<usize>> {
        self.update.bucket_ranges()
    }

    /// The gradient's buckets in the order the backward finishes them: the final norm,
    /// each layer from the last, then the context projection (fc and hidden_norm).
    /// Together they cover every parameter once; every rank has the same.
    pub fn bucket_plan(&self) -> Vec<std::ops::Range<usize>> {
        layers::bucket_plan(&self.d)
    }

    /// The device, for a collective that works on its buffers and streams.
    pub fn device(&mut self) -> &mut dyn Device {
        self.ops.dev.as_mut()
    }

    /// This rank's gradient (the last batch's) into `dst` (the parameter count of f32,
    /// little-endian: a shared-memory gradient slot).
    pub fn grads_to_host(&mut self, dst: &mut [u8]) -> Result<()> {
        self.ops.dev.download(Stream::Compute, self.b.grads, dst)
    }

    /// No batch for this step: a zero gradient (a rank that abstains from a step).
    pub fn zero_grads(&mut self) -> Result<()> {
        self.ops.dev.memset_zero(Stream::Compute, self.b.grads)
    }

    /// Forward and backward over one batch at the device's weights: the gradient of
    /// `Σ w·CE / denominator` overwrites the device's, and is also copied to the host with
    /// [`GradTo::Host`] (as `reference::drafter::Drafter::train_batch` computes it, which
    /// adds into its `grads`); [`GradTo::Device`] leaves it for a collective
    /// ([`Self::reduce_buckets`], [`Self::grads_to_host`]). Returns the batch's
    /// statistics.
    pub fn forward_backward(
        &mut self,
        samples: &[Sample],
        rows: Rows,
        anchors: &[Vec<usize>],
        denominator: f64,
        to: GradTo,
    ) -> Result<StepStats> {
        let grads = match to {
            GradTo::Device => Grad::Device,
            GradTo::Host(g) => Grad::Host(g),
        };
        self.batch(samples, rows, anchors, denominator, grads)
    }

    /// The forward and loss of [`forward_backward`](Self::forward_backward) alone
    /// (held-out evaluation): the same statistics at the device's weights, with no
    /// backward, so the gradient buffer and its buckets (which a collective may be
    /// reducing) are not touched.
    pub fn evaluate(
        &mut self,
        samples: &[Sample],
        rows: Rows,
        anchors: &[Vec<usize>],
    ) -> Result<StepStats> {
        self.batch(samples, rows, anchors, 1.0, Grad::Nowhere)
    }

    /// The final-normed hidden states `[anchors.len() × block_size, hidden]` of one
    /// sample's blocks at `anchors`, under the loaded weights: the forward of training
    /// alone, from f32 taps (the export's parity probe). Block `n` is
    /// `[s.ids[anchors[n]], MASK, …]` at positions `anchors[n] + k`; it sees the context
    /// strictly before its anchor and itself.
    pub fn final_hidden(&mut self, s: &Sample, anchors: &[usize]) -> Result<Vec<f32>> {
        let c = &self.d.cfg;
        let slen = s.ids.len();
        if s.taps.len() != slen * c.n_taps * c.hidden {
            return Err(GpuError::Invalid(format!(
                "{} tap values for {slen} positions × {} taps × {}",
                s.taps.len(),
                c.n_taps,
                c.hidden
            )));
        }
        if let Some(a) = anchors.iter().find(|&&a| a >= slen) {
            return Err(GpuError::Invalid(format!(
                "anchor {a} is past the {slen} context tokens"
            )));
        }
        let dims = self.dims(slen, anchors.len())?;
        let lc = Locals::new(&self.d, &self.b, dims);
        self.forward(&lc, s, Taps::F32, anchors)?;
        let mut out = vec![0f32; lc.hn.len_f32()];
        self.ops
            .dev
            .download(Stream::Compute, lc.hn, f32_bytes_mut(&mut out))?;
        Ok(out)
    }

    /// A sample of `slen` positions and `nb` blocks, if there is room for it.
    fn dims(&self, slen: usize, nb: usize) -> Result<Dims> {
        let bs = self.d.cfg.block_size;
        let m = nb * bs;
        if slen > self.max_len || m > self.max_rows {
            return Err(GpuError::Invalid(format!(
                "a sample of {slen} positions and {nb} blocks; room for {} and {}",
                self.max_len,
                self.max_rows / bs
            )));
        }
        Ok(Dims {
            slen,
            nb,
            m,
            tk: slen + m,
        })
    }

    /// The sample's inputs and the forward; returns an event behind the last read of its
    /// staging buffer, if it had one.
    fn forward(
        &mut self,
        lc: &Locals,
        s: &Sample,
        taps: Taps,
        anchors: &[usize],
    ) -> Result<Option<Event>> {
        let (w, mask) = (&self.b.w, self.d.cfg.mask_token_id);
        let freed = inputs::upload(&mut self.ops, lc, w, s, taps, anchors, mask)?;
        let mut p = Pass {
            ops: &mut self.ops,
            lc: *lc,
            w,
        };
        match p.forward(&self.d, &self.b.saved, self.b.embed) {
            Ok(()) => Ok(freed),
            Err(e) => {
                if let Some(f) = freed {
                    self.ops.dev.release_event(f);
                }
                Err(e)
            }
        }
    }

    fn batch(
        &mut self,
        samples: &[Sample],
        rows: Rows,
        anchors: &[Vec<usize>],
        denominator: f64,
        grads: Grad,
    ) -> Result<StepStats> {
        let taps16 = match rows {
            Rows::F32 => None,
            Rows::Bf16(t) => Some(t),
        };
        if let Some(t16) = taps16.filter(|t| t.len() != samples.len()) {
            return Err(GpuError::Invalid(format!(
                "{} bf16 tap rows for {} samples",
                t16.len(),
                samples.len()
            )));
        }
        let bs = self.d.cfg.block_size;
        let total_weight = self.d.total_weight(samples, anchors);
        let mut stats = StepStats {
            slot_correct: vec![0; bs],
            slot_total: vec![0; bs],
            ..Default::default()
        };
        let backward = !matches!(grads, Grad::Nowhere);
        if backward {
            self.update.release_buckets(self.ops.dev.as_mut());
            self.ops.dev.memset_zero(Stream::Compute, self.b.grads)?;
        }
        if total_weight > 0.0 {
            let order: Vec<usize> = (0..samples.len())
                .filter(|&i| !anchors[i].is_empty())
                .collect();
            self.check_rows(samples, taps16, &order)?;
            self.loss.begin(self.ops.dev.as_mut());
            // With bf16 rows (from the slot), sample k + 1's taps are copied on the copy
            // stream into the other staging buffer while sample k computes: `loaded[b]`
            // says buffer b holds its sample's taps, `free[b]` that the compute stream has
            // widened them (so it may be overwritten).
            let mut loaded: [Option<Event>; 2] = [None, None];
            let mut free: [Option<Event>; 2] = [None, None];
            let mut run = || -> Result<()> {
                if let (Some(t16), Some(&first)) = (taps16, order.first()) {
                    loaded[0] = Some(inputs::stage(
                        &mut self.ops,
                        &self.b.w,
                        0,
                        t16[first],
                        None,
                    )?);
                }
                for (k, &i) in order.iter().enumerate() {
                    if let (Some(t16), Some(&next)) = (taps16, order.get(k + 1)) {
                        let b = (k + 1) % 2;
                        let raw = t16[next];
                        let e = inputs::stage(&mut self.ops, &self.b.w, b, raw, free[b].take())?;
                        loaded[b] = Some(e);
                    }
                    let taps = match taps16 {
                        Some(_) => {
                            Taps::Staged(k % 2, loaded[k % 2].take().expect("staged before"))
                        }
                        None => Taps::F32,
                    };
                    let last = Some(&i) == order.last();
                    let s = (&samples[i], anchors[i].as_slice());
                    let (st, freed) = self.sample(s, taps, denominator, last, backward)?;
                    free[k % 2] = freed;
                    stats.merge(&st);
                }
                Ok(())
            };
            let r = run();
            for e in loaded.into_iter().chain(free).flatten() {
                self.ops.dev.release_event(e);
            }
            r?;
            stats.merge(&self.loss.take_read());
            if taps16.is_some() {
                // The rows belong to the caller (a slot it gives back after this): every copy
                // from them is over before this returns (long since, on a GPU: each was
                // waited for by the compute stream).
                let e = self.ops.dev.record(Stream::Copy)?;
                let r = self.ops.dev.sync_event(e);
                self.ops.dev.release_event(e);
                r?;
            }
        }
        if let Grad::Host(grads) = grads {
            self.ops
                .dev
                .download(Stream::Compute, self.b.grads, f32_bytes_mut(grads))?;
        }
        Ok(stats)
    }

    /// The samples of `order` fit in the room there is, and each one's bf16 taps (if any)
    /// are a row of its length.
    fn check_rows(
        &self,
        samples: &[Sample],
        taps16: Option<&[&[u8]]>,
        order: &[usize],
    ) -> Result<()> {
        if let Some(&i) = order.iter().find(|&&i| samples[i].ids.len() > self.max_len) {
            return Err(GpuError::Invalid(format!(
                "a sample of {} positions; room for {}",
                samples[i].ids.len(),
                self.max_len
            )));
        }
        if let Some(t16) = taps16 {
            let row = self.d.cfg.n_taps * self.d.cfg.hidden * 2;
            if let Some(&i) = order
                .iter()
                .find(|&&i| t16[i].len() != samples[i].ids.len() * row)
            {
                return Err(GpuError::Invalid(format!(
                    "{} bytes of bf16 taps for {} positions × {} taps × {}",
                    t16[i].len(),
                    samples[i].ids.len(),
                    self.d.cfg.n_taps,
                    self.d.cfg.hidden
                )));
            }
        }
        Ok(())
    }

    /// One sample's forward, loss and backward, its gradient added into the gradient; the
    /// step's loss statistics read after the `last` one's loss. Returns an event behind
    /// the last read of its staging buffer, if it had one.
    fn sample(
        &mut self,
        (s, anchors): (&Sample, &[usize]),
        taps: Taps,
        denominator: f64,
        last: bool,
        backward: bool,
    ) -> Result<(StepStats, Option<Event>)> {
        let dims = self.dims(s.ids.len(), anchors.len())?;
        let lc = Locals::new(&self.d, &self.b, dims);
        let freed = self.forward(&lc, s, taps, anchors)?;
        let r = (|| {
            let mut p = Pass {
                ops: &mut self.ops,
                lc,
                w: &self.b.w,
            };
            let (stats, supervised) =
                self.loss
                    .sample(&mut p, &self.d, s, anchors, denominator, backward)?;
            if last {
                // The step's losses and hits start for the host; it waits for them only
                // once the last backward is queued, so the GPU never drains for the read
                // (and that backward may still run when the batch returns: a collective
                // reduces its buckets meanwhile).
                self.loss.start_read(p.ops.dev.as_mut(), p.w)?;
            }
            if backward {
                let mut plan = layers::bucket_plan(&self.d).into_iter();
                let mut done: Vec<(std::ops::Range<usize>, Event)> = Vec::new();
                // The plan's next bucket is final (the last sample's backward wrote it
                // last).
                let mut bucket = |ops: &mut Ops| -> Result<()> {
                    let range = plan.next().expect("one bucket per point of the backward");
                    if last {
                        done.push((range, ops.dev.record(Stream::Compute)?));
                    }
                    Ok(())
                };
                p.backward(&self.d, &self.b.saved, supervised, &mut bucket)?;
                self.update.set_buckets(done);
            }
            if last {
                self.loss.finish_read(self.ops.dev.as_mut())?;
            }
            Ok(stats)
        })();
        match r {
            Ok(stats) => Ok((stats, freed)),
            Err(e) => {
                if let Some(f) = freed {
                    self.ops.dev.release_event(f);
                }
                Err(e)
            }
        }
    }
}

impl crate::device::grads::GradientBuckets for DeviceDrafter {
    fn device(&mut self) -> &mut dyn Device {
        DeviceDrafter::device(self)
    }

    fn reduce_buckets(
        &mut self,
        stream: Stream,
        reduce: &mut dyn FnMut(&mut dyn Device, DSlice, DSlice) -> Result<()>,
    ) -> Result<Event> {
        DeviceDrafter::reduce_buckets(self, stream, reduce)
    }

    fn reduce_alone(&mut self) -> Result<Event> {
        DeviceDrafter::reduce_alone(self)
    }

    fn grads_to_host(&mut self, dst: &mut [u8]) -> Result<()> {
        DeviceDrafter::grads_to_host(self, dst)
    }
}
