//! The frozen target's forward on a [`Device`]: the same computation as
//! `reference::target::Target::forward_taps` (which it is tested against), with the
//! weights, and activations for up to `max_tokens` tokens, allocated once from the arena.
//!
//! Rows are packed (varlen): a forward runs the tokens of several rows concatenated, each
//! token at its position within its own row and seeing the keys of its row up to itself
//! (the causal span `[row start, i + 1)`), so every GEMM and kernel runs once over all of
//! them. [`pack_rows`] fills each forward with as many whole rows as `max_tokens` holds;
//! a longer batch runs as several forwards.

use dflash_shared::model_config::TargetConfig;

use crate::device::ops::{Attention, Mat, Ops};
use crate::device::{f32_bytes_mut, Arena, ArenaStats, DSlice, Device, GpuError, Result, Stream};
use crate::models::target::Target;

pub mod decode;
mod layout;
pub mod moe;
mod place;
mod split;

use self::layout::{Acts, Layer, Meta, Mlp, Views};
use self::place::place;

pub use split::split_layers;

pub struct DeviceTarget {
    pub cfg: TargetConfig,
    pub taps: Vec<usize>,
    pub max_tokens: usize,
    ops: Ops,
    arena: Arena,
    /// The embedding: on the first device of a target split over several (the others
    /// start from the residual stream handed over, [`Carry`]).
    embed: Option<DSlice>,
    /// The index of this device's first layer in the model.
    first: usize,
    layers: Vec<Layer>,
    inv_freq: DSlice,
    rope_scale: f32,
    /// Weights of the projections and the embedding, and every activation, in bf16 (a
    /// GPU), or f32 (the CPU device).
    bf16: bool,
    a: Acts,
    /// Per staging buffer: the event after its last copy to the host.
    stage_free: [Option<crate::device::Event>; 2],
    next_stage: usize,
    /// The pinned staging buffer the weights came through (registered with the device):
    /// declared after `ops`, so it is freed after the device.
    _pinned: Vec<u8>,
    /// The devices that hold the following layers (`--gpus-per-target`), in order: the
    /// residual stream and the taps so far hop from each to the next; the last one's taps
    /// go to the host.
    rest: Vec<DeviceTarget>,
}

/// What one device of a split target hands the next after its layers: the residual
/// stream and the taps so far (`t` rows each, in the activations' dtype).
pub(crate) struct Carry {
    x: Vec<u8>,
    out: Vec<u8>,
}

impl DeviceTarget {
    /// Put `target`'s weights on `dev`, with room for sequences of up to `max_tokens`.
    pub fn new(dev: Box<dyn Device>, target: &Target, max_tokens: usize) -> Result<DeviceTarget> {
        DeviceTarget::part(dev, target, max_tokens, 0, true)
    }

    /// [`new`](Self::new) for the layers of `target` (which start at the model's layer
    /// `first`), with the embedding or not.
    fn part(
        mut dev: Box<dyn Device>,
        target: &Target,
        max_tokens: usize,
        first: usize,
        with_embed: bool,
    ) -> Result<DeviceTarget> {
        let c = target.cfg.clone();
        let t = max_tokens.max(1);
        let what = format!(
            "the target (weights of {} layers, activations for {t} tokens)",
            target.layers.len()
        );
        let bf16 = !dev.is_cpu();
        let mut dry = Arena::dry();
        place(dev.as_mut(), &mut dry, target, t, bf16, (first, with_embed))?;
        let mut arena = Arena::for_model(dev.as_mut(), dry.mark(), &what)?;
        let (embed, inv_freq, layers, a, pinned) = place(
            dev.as_mut(),
            &mut arena,
            target,
            t,
            bf16,
            (first, with_embed),
        )?;
        let mut ops = Ops::new(dev);
        ops.act16 = bf16;
        Ok(DeviceTarget {
            cfg: c,
            taps: target.taps.clone(),
            max_tokens: t,
            ops,
            arena,
            embed,
            first,
            layers,
            inv_freq,
            rope_scale: target.rope_scale,
            bf16,
            a,
            stage_free: [None, None],
            next_stage: 0,
            _pinned: pinned,
            rest: Vec::new(),
        })
    }

    /// This device and those holding the following layers.
    fn parts(&self) -> impl Iterator<Item = &DeviceTarget> {
        std::iter::once(self).chain(&self.rest)
    }

    /// The device holding the last layers: where the taps end.
    fn tail(&mut self) -> &mut DeviceTarget {
        let n = self.rest.len();
        if n == 0 {
            return self;
        }
        &mut self.rest[n - 1]
    }

    pub fn describe(&self) -> String {
        let d: Vec<String> = self.parts().map(|p| p.ops.dev.describe()).collect();
        d.join(" + ")
    }

    /// The devices' per-kernel seconds since the last call (the CPU device measures them).
    pub fn take_kernel_seconds(&mut self) -> Vec<(String, f64)> {
        let mut k = self.ops.dev.take_kernel_seconds();
        for p in &mut self.rest {
            k.extend(p.ops.dev.take_kernel_seconds());
        }
        k
    }

    /// The arenas' counters, summed over the devices.
    pub fn arena_stats(&self) -> ArenaStats {
        self.parts().fold(ArenaStats::default(), |a, p| {
            let s = p.arena.stats;
            ArenaStats {
                reserved: a.reserved + s.reserved,
                in_use: a.in_use + s.in_use,
                peak: a.peak + s.peak,
                alloc_failures: a.alloc_failures + s.alloc_failures,
            }
        })
    }

    /// The arenas' counters and the devices' free/total memory, summed over the devices
    /// (no device sync); none on the CPU device.
    pub fn device_memory(&self) -> Option<dflash_shared::protocol::DeviceMemory> {
        if self.ops.dev.is_cpu() {
            return None;
        }
        let s = self.arena_stats();
        let (free, total) = self.parts().fold((0u64, 0u64), |(f, t), p| {
            let (pf, pt) = p.ops.dev.mem_info().unwrap_or((0, 0));
            (f + pf as u64, t + pt as u64)
        });
        Some(dflash_shared::protocol::DeviceMemory {
            reserved: s.reserved,
            in_use: s.in_use,
            peak: s.peak,
            alloc_failures: s.alloc_failures,
            free,
            total,
        })
    }

    /// The devices before the last run `rows` through their layers in turn; what the
    /// last one starts from (none when this target is on one device).
    fn head(&mut self, rows: &[&[u32]]) -> Result<Option<Carry>> {
        let n = self.rest.len();
        if n == 0 {
            return Ok(None);
        }
        let t = self.compute(rows, self.a.out, None)?;
        let mut carry = self.carry(t)?;
        for p in &mut self.rest[..n - 1] {
            p.compute(rows, p.a.out, Some(&carry))?;
            carry = p.carry(t)?;
        }
        Ok(Some(carry))
    }

    /// The residual stream and the taps so far of the last forward's `t` rows, for the
    /// next device.
    fn carry(&mut self, t: usize) -> Result<Carry> {
        let width = self.taps.len() * self.cfg.hidden_size;
        let elem = if self.bf16 { 2 } else { 4 };
        let view = |s: DSlice, n: usize| {
            if self.bf16 {
                s.sub(2, 0..n)
            } else {
                s.f32s(0..n)
            }
        };
        let (x, out) = (
            view(self.a.x, t * self.cfg.hidden_size),
            view(self.a.out, t * width),
        );
        let mut c = Carry {
            x: vec![0u8; t * self.cfg.hidden_size * elem],
            out: vec![0u8; t * width * elem],
        };
        self.ops.dev.download(Stream::Compute, x, &mut c.x)?;
        self.ops.dev.download(Stream::Compute, out, &mut c.out)?;
        Ok(c)
    }

    /// Tapped hidden states of one sequence: `[tokens, taps × hidden]`, row-major.
    pub fn forward_taps(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        Ok(self.forward_rows(&[tokens])?.pop().unwrap_or_default())
    }

    /// Tapped hidden states of each row (`[len, taps × hidden]`, row-major), the rows
    /// packed into as few forwards as `max_tokens` allows ([`pack_rows`]).
    pub fn forward_rows(&mut self, rows: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        let width = self.taps.len() * self.cfg.hidden_size;
        let lens: Vec<usize> = rows.iter().map(|r| r.len()).collect();
        let mut out = Vec::with_capacity(rows.len());
        for pack in pack_rows(&lens, self.max_tokens)? {
            let rows = &rows[pack];
            let carry = self.head(rows)?;
            let tail = self.tail();
            let mut taps = vec![0f32; tail.compute(rows, tail.a.out, carry.as_ref())? * width];
            tail.download_out(&mut taps)?;
            let mut rest = taps.as_slice();
            for r in rows {
                let (mine, more) = rest.split_at(r.len() * width);
                out.push(mine.to_vec());
                rest = more;
            }
        }
        Ok(out)
    }

    /// The first `out.len()` values of the taps activation, as f32.
    fn download_out(&mut self, out: &mut [f32]) -> Result<()> {
        let n = out.len();
        if n == 0 {
            return Ok(());
        }
        if self.bf16 {
            let mut bits = vec![0u8; n * 2];
            self.ops
                .dev
                .download(Stream::Compute, self.a.out.sub(2, 0..n), &mut bits)?;
            for (o, b) in out.iter_mut().zip(bits.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
            Ok(())
        } else {
            self.ops
                .dev
                .download(Stream::Compute, self.a.out.f32s(0..n), f32_bytes_mut(out))
        }
    }

    /// Pin a host range (a pool's mapping) so taps can be copied straight into it.
    ///
    /// # Safety
    /// The range must stay mapped while this target lives.
    pub unsafe fn register_host(&mut self, ptr: *mut u8, bytes: usize) -> Result<()> {
        // The taps are copied to the host from the last device.
        self.tail().ops.dev.register_host(ptr, bytes)
    }

    /// The taps of each row (its tokens, and where they go) as bf16 into registered host
    /// memory at its `dst` (`len × taps × hidden × 2` bytes), asynchronously, the rows
    /// packed into as few forwards as `max_tokens` allows ([`pack_rows`]). Each forward's
    /// taps are written in bf16 into a staging buffer on the compute stream (cast there from
    /// f32 on the CPU device) and each row's part copied to its `dst` on the copy stream
    /// behind an event, so the next forward computes while this one is copied. Returns the
    /// event after the last copy (none when no row has a token); the bytes are there once
    /// [`finish`](Self::finish) has waited for it. The event stays valid until its staging
    /// buffer's turn comes again, two forwards later (within the next call when that runs
    /// two): of a series of calls, wait for the last one's event only.
    ///
    /// # Safety
    /// Every `dst` must be registered and nobody may touch those bytes before `finish`.
    pub unsafe fn forward_rows_into(
        &mut self,
        rows: &[(&[u32], *mut u8)],
    ) -> Result<Option<crate::device::Event>> {
        let lens: Vec<usize> = rows.iter().map(|r| r.0.len()).collect();
        let mut last = None;
        for pack in pack_rows(&lens, self.max_tokens)? {
            if let Some(e) = self.pack_into(&rows[pack])? {
                last = Some(e);
            }
        }
        Ok(last)
    }

    /// One forward of [`forward_rows_into`](Self::forward_rows_into).
    ///
    /// # Safety
    /// As for `forward_rows_into`.
    unsafe fn pack_into(
        &mut self,
        rows: &[(&[u32], *mut u8)],
    ) -> Result<Option<crate::device::Event>> {
        let ids: Vec<&[u32]> = rows.iter().map(|r| r.0).collect();
        let carry = self.head(&ids)?;
        self.tail().pack_into_here(rows, carry.as_ref())
    }

    /// [`pack_into`](Self::pack_into) on this device, from `carry` when it holds later
    /// layers of a split target.
    ///
    /// # Safety
    /// As for `forward_rows_into`.
    unsafe fn pack_into_here(
        &mut self,
        rows: &[(&[u32], *mut u8)],
        carry: Option<&Carry>,
    ) -> Result<Option<crate::device::Event>> {
        let ids: Vec<&[u32]> = rows.iter().map(|r| r.0).collect();
        let width = self.taps.len() * self.cfg.hidden_size;
        let n = ids.iter().map(|r| r.len()).sum::<usize>() * width;
        if n == 0 {
            return Ok(None);
        }
        let i = self.next_stage;
        self.next_stage = 1 - i;
        // The staging buffer is free once its previous copies have completed.
        if let Some(e) = self.stage_free[i].take() {
            self.ops.dev.wait(Stream::Compute, e)?;
            self.ops.dev.release_event(e);
        }
        let stage = self.a.stage[i].sub(2, 0..n);
        if self.bf16 {
            self.compute(&ids, stage, carry)?;
        } else {
            self.compute(&ids, self.a.out, carry)?;
            self.ops.f32_to_bf16(stage, self.a.out.f32s(0..n))?;
        }
        let cast = self.ops.dev.record(Stream::Compute)?;
        self.ops.dev.wait(Stream::Copy, cast)?;
        self.ops.dev.release_event(cast);
        let mut at = 0;
        for &(tokens, dst) in rows {
            let m = tokens.len() * width;
            if m > 0 {
                self.ops
                    .dev
                    .download_async(Stream::Copy, stage.sub(2, at..at + m), dst)?;
            }
            at += m;
        }
        let copied = self.ops.dev.record(Stream::Copy)?;
        self.stage_free[i] = Some(copied);
        Ok(Some(copied))
    }

    /// Wait for everything queued (after an error, before the host reuses the memory).
    pub fn sync(&mut self) -> Result<()> {
        self.ops.dev.sync()?;
        for p in &mut self.rest {
            p.ops.dev.sync()?;
        }
        Ok(())
    }

    /// Wait for the copies up to `e`; then the host may read `bytes` bytes at `ptr`.
    pub fn finish(&mut self, e: crate::device::Event, ptr: *const u8, bytes: usize) -> Result<()> {
        let tail = self.tail();
        tail.ops.dev.sync_event(e)?;
        tail.ops.dev.host_access(ptr, bytes, false)
    }

    /// The host writes `bytes` at `ptr` (registered memory): checked against the copies.
    pub fn host_write(&mut self, ptr: *const u8, bytes: usize) -> Result<()> {
        self.tail().ops.dev.host_access(ptr, bytes, true)
    }

    /// One packed forward of `rows` through this device's layers, their taps into `out`
    /// (`[t, taps × hidden]` activations, the rows' tokens in turn: bf16 on a GPU, f32 on
    /// the CPU device), from the embedding or (a later device of a split target) from
    /// `carry`. Returns `t`, the rows' tokens.
    fn compute(&mut self, rows: &[&[u32]], out: DSlice, carry: Option<&Carry>) -> Result<usize> {
        let t: usize = rows.iter().map(|r| r.len()).sum();
        if t > self.max_tokens {
            return Err(too_long(t, self.max_tokens));
        }
        if t == 0 {
            return Ok(0);
        }
        let c = &self.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let width = self.taps.len() * h;
        let a = &self.a;
        let ops = &mut self.ops;
        let (ids, pos, spans) = Meta::upload(ops, a.meta, rows, t)?;
        // On a GPU every activation is bf16 and the GEMMs are bf16 in and out with f32
        // accumulation (tensor cores); the kernels compute in f32 and round on store. On
        // the CPU device, f32 throughout.
        let act = |s: DSlice, n: usize| {
            if self.bf16 {
                s.sub(2, 0..n)
            } else {
                s.f32s(0..n)
            }
        };
        let vw = a.views(c, t, self.bf16);
        let x = vw.x.buf;
        let lse = a.lse.f32s(0..t * nh);
        let out = act(out, t * width);
        match (carry, self.embed) {
            (Some(c), _) => {
                ops.dev.upload(Stream::Compute, x, &c.x)?;
                ops.dev.upload(Stream::Compute, out, &c.out)?;
            }
            (None, Some(e)) => ops.embed(x, e, ids, t, h, c.vocab_size)?,
            (None, None) => {
                return Err(GpuError::Invalid(
                    "a later device of a split target ran without the residual stream".into(),
                ))
            }
        }
        let last = self.taps.iter().copied().max().unwrap_or(0);
        for (li, l) in self.layers.iter().enumerate() {
            let li = self.first + li;
            if li > last {
                break;
            }
            let rope = (pos, self.inv_freq, self.rope_scale);
            attention_inputs(ops, c, l, &vw, a.rstd, rope)?;
            ops.attention(Attention {
                q: vw.q.buf,
                k: vw.k.buf,
                v: vw.v.buf,
                out: vw.att.buf,
                lse,
                spans,
                tq: t,
                qh: nh,
                kvh: nkv,
                hd,
            })?;
            attention_output_and_mlp(ops, c, l, a, &vw, a.rstd)?;
            for (ti, &tap) in self.taps.iter().enumerate() {
                if tap == li {
                    let taps = ops.act_mat(out, t, width);
                    ops.copy_cols((taps, ti * h), (vw.x, 0), h)?;
                }
            }
        }
        Ok(t)
    }
}

/// Layer `l`'s attention inputs from the residual stream `v.x` (`t` rows): `n1 =
/// ln1(x)`, q, k and v, then q and k normed per head (where the model has those norms)
/// and rotated to the rows' positions (`rope`: positions, frequencies, cos/sin scale).
/// `rstd` holds a reciprocal RMS per row and head.
fn attention_inputs(
    ops: &mut Ops,
    c: &TargetConfig,
    l: &Layer,
    v: &Views,
    rstd: DSlice,
    (pos, inv_freq, scale): (DSlice, DSlice, f32),
) -> Result<()> {
    let (h, hd, eps) = (c.hidden_size, c.head_dim, c.rms_norm_eps as f32);
    let (t, act) = (v.x.rows, ops.act());
    ops.rmsnorm(v.x, l.ln1, v.n1, rstd.f32s(0..t), eps)?;
    for (w, y) in [(l.wq, v.q), (l.wk, v.k), (l.wv, v.v)] {
        ops.matmul(v.n1, Mat::new(w, y.cols, h, act), y)?;
    }
    if let Some((qn, kn)) = l.qk_norm {
        for (y, norm) in [(v.q, qn), (v.k, kn)] {
            let heads = Mat::new(y.buf, t * y.cols / hd, hd, act);
            ops.rmsnorm(heads, norm, heads, rstd.f32s(0..heads.rows), eps)?;
        }
    }
    ops.rope(v.q, pos, inv_freq, hd, scale, false)?;
    ops.rope(v.k, pos, inv_freq, hd, scale, false)
}

/// The rest of layer `l` once its attention wrote `v.att`: the output projection added
/// into the residual stream `v.x`, then `x += mlp(ln2(x))`.
fn attention_output_and_mlp(
    ops: &mut Ops,
    c: &TargetConfig,
    l: &Layer,
    a: &Acts,
    v: &Views,
    rstd: DSlice,
) -> Result<()> {
    let (h, eps) = (c.hidden_size, c.rms_norm_eps as f32);
    let wo = Mat::new(l.wo, h, v.att.cols, ops.act());
    ops.matmul(v.att, wo, v.o)?;
    ops.add(v.x.buf, v.o.buf)?;
    ops.rmsnorm(v.x, l.ln2, v.n1, rstd.f32s(0..v.x.rows), eps)?;
    mlp(ops, c, l, a, v)?;
    ops.add(v.x.buf, v.o.buf)
}

/// Layer `l`'s MLP of the normed rows `v.n1` into `v.o`, with the dense MLP's gate, up and
/// SwiGLU activations of `v` or the sparse MLP's of `a`.
fn mlp(ops: &mut Ops, c: &TargetConfig, l: &Layer, a: &Acts, v: &Views) -> Result<()> {
    let (h, t, act) = (c.hidden_size, v.x.rows, ops.act());
    match (&l.mlp, &c.moe, &a.moe) {
        (Mlp::Dense([gate, up, down]), _, _) => {
            let inter = c.intermediate_size;
            ops.matmul(v.n1, Mat::new(*gate, inter, h, act), v.g)?;
            ops.matmul(v.n1, Mat::new(*up, inter, h, act), v.u)?;
            ops.swiglu(v.g.buf, v.u.buf, v.sw.buf)?;
            ops.matmul(v.sw, Mat::new(*down, h, inter, act), v.o)
        }
        (Mlp::Sparse(w), Some(m), Some(acts)) => {
            moe::sparse_mlp(ops, m, w, acts, (v.n1.buf, v.o.buf), t, h)
        }
        (Mlp::Sparse(_), _, _) => Err(GpuError::Invalid(
            "a sparse layer in a target without a mixture of experts".into(),
        )),
    }
}

/// The error of a forward of `t` tokens on a target with room for `cap`.
fn too_long(t: usize, cap: usize) -> GpuError {
    GpuError::Invalid(format!("{t} tokens, room for {cap}"))
}

/// The forwards that run rows of lengths `lens`, in order: ranges of consecutive rows,
/// each as many whole rows as `cap` tokens hold (empty rows ride along). A row longer
/// than `cap` is refused with the error a forward of it gives.
pub fn pack_rows(lens: &[usize], cap: usize) -> Result<Vec<std::ops::Range<usize>>> {
    if let Some(&t) = lens.iter().find(|&&t| t > cap) {
        return Err(too_long(t, cap));
    }
    let mut packs = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (i, &t) in lens.iter().enumerate() {
        if tokens + t > cap {
            packs.push(start..i);
            (start, tokens) = (i, 0);
        }
        tokens += t;
    }
    if start < lens.len() {
        packs.push(start..lens.len());
    }
    Ok(packs)
}
