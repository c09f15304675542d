//! The frozen target's forward on a [`Device`]: the same computation as
//! [`crate::model::target::Target::forward_taps`] (which it is tested against), with the
//! weights, and activations for up to `max_tokens` tokens, allocated once from the arena.
//! Positions and the causal key spans are uploaded once too: they depend only on the
//! row index, so a shorter sequence uses their prefix.

use dflash_shared::model_config::TargetConfig;

use super::ops::Ops;
use super::{f32_bytes_mut, i32_bytes, u32_bytes, Arena, ArenaStats, DSlice, Device, Result, Stream};
use crate::model::target::Target;

struct Layer {
    ln1: DSlice,
    ln2: DSlice,
    wq: DSlice,
    wk: DSlice,
    wv: DSlice,
    wo: DSlice,
    qk_norm: Option<(DSlice, DSlice)>,
    gate: DSlice,
    up: DSlice,
    down: DSlice,
}

struct Acts {
    ids: DSlice,
    pos: DSlice,
    spans: DSlice,
    x: DSlice,
    n1: DSlice,
    rstd: DSlice,
    q: DSlice,
    k: DSlice,
    v: DSlice,
    att: DSlice,
    lse: DSlice,
    o: DSlice,
    g: DSlice,
    u: DSlice,
    act: DSlice,
    out: DSlice,
    /// Two bf16 staging buffers for the copy to the host, used in turn.
    stage: [DSlice; 2],
    /// The bf16 copy of a GEMM's input activation.
    xb: DSlice,
}

pub struct GpuTarget {
    pub cfg: TargetConfig,
    pub taps: Vec<usize>,
    pub max_tokens: usize,
    ops: Ops,
    arena: Arena,
    embed: DSlice,
    layers: Vec<Layer>,
    inv_freq: DSlice,
    rope_scale: f32,
    /// Projection weights and GEMM inputs in bf16 (a GPU), or f32 (the CPU device).
    bf16: bool,
    a: Acts,
    /// Per staging buffer: the event after its last copy to the host.
    stage_free: [Option<super::Event>; 2],
    next_stage: usize,
}

impl GpuTarget {
    /// Put `target`'s weights on `dev`, with room for sequences of up to `max_tokens`.
    pub fn new(mut dev: Box<dyn Device>, target: &Target, max_tokens: usize) -> Result<GpuTarget> {
        let c = target.cfg.clone();
        let t = max_tokens.max(1);
        let what = format!("the target (weights of {} layers, activations for {t} tokens)", target.layers.len());
        let bf16 = !dev.is_cpu();
        let mut dry = Arena::dry();
        place(dev.as_mut(), &mut dry, target, t, bf16)?;
        let mut arena = Arena::for_model(dev.as_mut(), dry.mark(), &what)?;
        let (embed, inv_freq, layers, a) = place(dev.as_mut(), &mut arena, target, t, bf16)?;
        Ok(GpuTarget { cfg: c, taps: target.taps.clone(), max_tokens: t, ops: Ops::new(dev), arena, embed, layers, inv_freq, rope_scale: target.rope_scale, bf16, a, stage_free: [None, None], next_stage: 0 })
    }

    pub fn describe(&self) -> String {
        self.ops.dev.describe()
    }

    /// The device's per-kernel seconds since the last call (the CPU device measures them).
    pub fn take_kernel_seconds(&mut self) -> Vec<(String, f64)> {
        self.ops.dev.take_kernel_seconds()
    }

    pub fn arena_stats(&self) -> ArenaStats {
        self.arena.stats
    }

    /// The arena's counters and the device's free/total memory (no device sync); none on
    /// the CPU device.
    pub fn device_memory(&self) -> Option<dflash_shared::protocol::DeviceMemory> {
        if self.ops.dev.is_cpu() {
            return None;
        }
        let s = self.arena.stats;
        let (free, total) = self.ops.dev.mem_info().unwrap_or((0, 0));
        Some(dflash_shared::protocol::DeviceMemory { reserved: s.reserved, in_use: s.in_use, peak: s.peak, alloc_failures: s.alloc_failures, free: free as u64, total: total as u64 })
    }

    /// Tapped hidden states of one sequence: `[tokens, taps × hidden]`, row-major.
    pub fn forward_taps(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let t = tokens.len();
        if t == 0 {
            return Ok(Vec::new());
        }
        self.compute(tokens)?;
        let width = self.taps.len() * self.cfg.hidden_size;
        let mut out = vec![0f32; t * width];
        self.ops.dev.download(Stream::Compute, self.a.out.f32s(0..t * width), f32_bytes_mut(&mut out))?;
        Ok(out)
    }

    /// Pin a host range (a pool's mapping) so taps can be copied straight into it.
    ///
    /// # Safety
    /// The range must stay mapped while this target lives.
    pub unsafe fn register_host(&mut self, ptr: *mut u8, bytes: usize) -> Result<()> {
        self.ops.dev.register_host(ptr, bytes)
    }

    /// The taps of one sequence as bf16 into registered host memory at `dst`
    /// (`tokens × taps × hidden × 2` bytes), asynchronously: cast on the compute stream,
    /// copied on the copy stream behind an event, so the next sequence computes while
    /// this one is copied. Returns the event after the copy; the bytes are there once
    /// [`finish`](Self::finish) has waited for it. The event stays valid until the call
    /// after next (its staging buffer's turn comes again): wait for the last one only.
    ///
    /// # Safety
    /// `dst` must be registered and nobody may touch those bytes before `finish`.
    pub unsafe fn forward_taps_into(&mut self, tokens: &[u32], dst: *mut u8) -> Result<Option<super::Event>> {
        let t = tokens.len();
        if t == 0 {
            return Ok(None);
        }
        self.compute(tokens)?;
        let n = t * self.taps.len() * self.cfg.hidden_size;
        let i = self.next_stage;
        self.next_stage = 1 - i;
        // The staging buffer is free once its previous copy has completed.
        if let Some(e) = self.stage_free[i].take() {
            self.ops.dev.wait(Stream::Compute, e)?;
            self.ops.dev.release_event(e);
        }
        let stage = self.a.stage[i].sub(2, 0..n);
        self.ops.f32_to_bf16(stage, self.a.out.f32s(0..n))?;
        let cast = self.ops.dev.record(Stream::Compute)?;
        self.ops.dev.wait(Stream::Copy, cast)?;
        self.ops.dev.release_event(cast);
        self.ops.dev.download_async(Stream::Copy, stage, dst)?;
        let copied = self.ops.dev.record(Stream::Copy)?;
        self.stage_free[i] = Some(copied);
        Ok(Some(copied))
    }

    /// Wait for everything queued (after an error, before the host reuses the memory).
    pub fn sync(&mut self) -> Result<()> {
        self.ops.dev.sync()
    }

    /// Wait for the copies up to `e`; then the host may read `bytes` bytes at `ptr`.
    pub fn finish(&mut self, e: super::Event, ptr: *const u8, bytes: usize) -> Result<()> {
        self.ops.dev.sync_event(e)?;
        self.ops.dev.host_access(ptr, bytes, false)
    }

    /// The host writes `bytes` at `ptr` (registered memory): checked against the copies.
    pub fn host_write(&mut self, ptr: *const u8, bytes: usize) -> Result<()> {
        self.ops.dev.host_access(ptr, bytes, true)
    }

    /// The forward into `a.out` (`[t, taps × hidden]` f32 on the device).
    fn compute(&mut self, tokens: &[u32]) -> Result<()> {
        let t = tokens.len();
        if t > self.max_tokens {
            return Err(super::GpuError::Invalid(format!("{t} tokens, room for {}", self.max_tokens)));
        }
        let c = &self.cfg;
        let (h, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let (qd, kd) = (nh * hd, nkv * hd);
        let eps = c.rms_norm_eps as f32;
        let width = self.taps.len() * h;
        let a = &self.a;
        let ops = &mut self.ops;
        ops.dev.upload(Stream::Compute, a.ids, u32_bytes(tokens))?;
        let (x, n1, q, k, v) = (a.x.f32s(0..t * h), a.n1.f32s(0..t * h), a.q.f32s(0..t * qd), a.k.f32s(0..t * kd), a.v.f32s(0..t * kd));
        let (att, o, g, u, act) = (a.att.f32s(0..t * qd), a.o.f32s(0..t * h), a.g.f32s(0..t * inter), a.u.f32s(0..t * inter), a.act.f32s(0..t * inter));
        let (rstd, lse) = (a.rstd.f32s(0..t * qd / hd), a.lse.f32s(0..t * nh));
        ops.embed(x, self.embed, a.ids.f32s(0..t), t, h, c.vocab_size)?;
        let last = self.taps.iter().copied().max().unwrap_or(0);
        // On a GPU, GEMMs take bf16 inputs (weights stored bf16, the activation cast just
        // before) and accumulate in f32: tensor cores. On the CPU device, f32 throughout.
        let bf16 = self.bf16;
        let mm = |ops: &mut Ops, x: DSlice, w: DSlice, y: DSlice, m: usize, k: usize, n: usize| -> Result<()> {
            if bf16 {
                let xb = a.xb.sub(2, 0..m * k);
                ops.f32_to_bf16(xb, x)?;
                ops.matmul_bf16(xb, w, y, m, k, n)
            } else {
                ops.matmul(x, w, y, m, k, n)
            }
        };
        for (li, l) in self.layers.iter().enumerate().take(last + 1) {
            ops.rmsnorm(x, l.ln1, n1, rstd.f32s(0..t), t, h, eps)?;
            mm(ops, n1, l.wq, q, t, h, qd)?;
            mm(ops, n1, l.wk, k, t, h, kd)?;
            mm(ops, n1, l.wv, v, t, h, kd)?;
            if let Some((qn, kn)) = l.qk_norm {
                ops.rmsnorm(q, qn, q, rstd.f32s(0..t * nh), t * nh, hd, eps)?;
                ops.rmsnorm(k, kn, k, rstd.f32s(0..t * nkv), t * nkv, hd, eps)?;
            }
            ops.rope(q, a.pos, self.inv_freq, t, nh, hd, self.rope_scale, false)?;
            ops.rope(k, a.pos, self.inv_freq, t, nkv, hd, self.rope_scale, false)?;
            ops.attention(q, k, v, att, lse, a.spans, t, nh, nkv, hd)?;
            mm(ops, att, l.wo, o, t, qd, h)?;
            ops.add(x, o)?;
            ops.rmsnorm(x, l.ln2, n1, rstd.f32s(0..t), t, h, eps)?;
            mm(ops, n1, l.gate, g, t, h, inter)?;
            mm(ops, n1, l.up, u, t, h, inter)?;
            ops.swiglu(g, u, act)?;
            mm(ops, act, l.down, o, t, inter, h)?;
            ops.add(x, o)?;
            for (ti, &tap) in self.taps.iter().enumerate() {
                if tap == li {
                    ops.copy_cols(a.out, x, t, h, width, ti * h, h, 0)?;
                }
            }
        }
        Ok(())
    }
}

/// Lay out (and, in a real arena, fill) the target's weights and activations for `t`
/// tokens: the projection matrices in bf16 when `bf16` (a checkpoint's bf16 weights are
/// exact in bf16 again: the CPU target widened them), everything else f32.
fn place(d: &mut dyn Device, arena: &mut Arena, target: &Target, t: usize, bf16: bool) -> Result<(DSlice, DSlice, Vec<Layer>, Acts)> {
    let c = &target.cfg;
    let (h, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let (qd, kd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let width = target.taps.len() * h;
    let widest = h.max(qd).max(inter);
    let put = |d: &mut dyn Device, arena: &mut Arena, v: &[f32], name: &str, bf16: bool| -> Result<DSlice> {
        let s = arena.alloc(d, v.len() * if bf16 { 2 } else { 4 }, name)?;
        arena.fill_f32(d, s, v, bf16)?;
        Ok(s)
    };
    let embed = put(d, arena, &target.embed, "embed_tokens", false)?;
    let inv_freq = put(d, arena, &target.inv_freq, "rope inv_freq", false)?;
    let mut layers = Vec::new();
    for (i, l) in target.layers.iter().enumerate() {
        let n = |s: &str| format!("layer {i} {s}");
        let qk_norm = match (&l.q_norm, &l.k_norm) {
            (Some(qn), Some(kn)) => Some((put(d, arena, qn, &n("q_norm"), false)?, put(d, arena, kn, &n("k_norm"), false)?)),
            _ => None,
        };
        layers.push(Layer {
            ln1: put(d, arena, &l.ln1, &n("input_layernorm"), false)?,
            ln2: put(d, arena, &l.ln2, &n("post_attention_layernorm"), false)?,
            wq: put(d, arena, &l.wq, &n("q_proj"), bf16)?,
            wk: put(d, arena, &l.wk, &n("k_proj"), bf16)?,
            wv: put(d, arena, &l.wv, &n("v_proj"), bf16)?,
            wo: put(d, arena, &l.wo, &n("o_proj"), bf16)?,
            qk_norm,
            gate: put(d, arena, &l.gate, &n("gate_proj"), bf16)?,
            up: put(d, arena, &l.up, &n("up_proj"), bf16)?,
            down: put(d, arena, &l.down, &n("down_proj"), bf16)?,
        });
    }
    let mut f = |n: usize, name: &str| arena.alloc_f32(d, n, name);
    let a = Acts {
        ids: f(t, "token ids")?,
        pos: f(t, "positions")?,
        spans: f(4 * t, "causal spans")?,
        x: f(t * h, "residual")?,
        n1: f(t * h, "normed")?,
        rstd: f(t * qd / hd, "rstd")?,
        q: f(t * qd, "q")?,
        k: f(t * kd, "k")?,
        v: f(t * kd, "v")?,
        att: f(t * qd, "attention out")?,
        lse: f(t * c.num_attention_heads, "attention lse")?,
        o: f(t * h, "projection out")?,
        g: f(t * inter, "gate")?,
        u: f(t * inter, "up")?,
        act: f(t * inter, "swiglu")?,
        out: f(t * width, "taps")?,
        stage: [f(t * width / 2 + 1, "bf16 staging 0")?, f(t * width / 2 + 1, "bf16 staging 1")?],
        xb: f((t * widest).div_ceil(2), "bf16 GEMM input")?,
    };
    // Positions and causal spans depend only on the row index: once, for all lengths.
    let pos: Vec<i32> = (0..t as i32).collect();
    let spans: Vec<i32> = (0..t as i32).flat_map(|i| [0, i + 1, 0, 0]).collect();
    arena.fill(d, a.pos, i32_bytes(&pos))?;
    arena.fill(d, a.spans, i32_bytes(&spans))?;
    Ok((embed, inv_freq, layers, a))
}
