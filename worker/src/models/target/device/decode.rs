//! Decoding with the target over a KV cache (`dflash-supervise eval`): the forward of
//! [`DeviceTarget`] run on a few new positions at a time, each layer's keys and values
//! kept for every position processed so far, so that a prompt is processed once
//! (prefill, in blocks) and each later block of query positions sees the cache plus
//! itself causally (the attention's key spans), then through the final norm and the
//! lm_head. The cache can be cropped back to a length (rejected draft tokens). The same
//! device ops as training's forward: the CPU device, or GPUs with bf16 activations. A
//! target over several devices ([`Decoder::new_split`], `--gpus-per-target`) keeps each
//! layer's cache on the device holding the layer; the residual stream and the taps so far
//! hop from each device to the next through the host, and the last one holds the final
//! norm and the lm_head.

use super::{Carry, DeviceTarget, Target};
use crate::device::ops::Attention;
use crate::device::{f32_bytes, GpuError};
use crate::device::{f32_bytes_mut, i32_bytes, u32_bytes, Arena, DSlice, Device, Result, Stream};
use crate::models::target::Head;

/// The target with a KV cache, its final norm and its lm_head.
pub struct Decoder {
    /// One per device, in the layers' order.
    parts: Vec<Part>,
    /// On the last part's device.
    norm: DSlice,
    lm_head: DSlice,
    /// `[rows, vocab]`
    logits: DSlice,
    max_len: usize,
    len: usize,
}

/// The layers of one device with their cache.
struct Part {
    model: DeviceTarget,
    /// Per layer of this device: keys and values `[max_len, kv_heads × head_dim]` (post
    /// norm and RoPE).
    cache: Vec<(DSlice, DSlice)>,
    /// Absolute positions (i32) and key spans (4 i32) of the rows of one forward.
    pos: DSlice,
    spans: DSlice,
    _arena: Arena,
}

/// What one forward over the cache returns for its rows.
pub struct Forward {
    /// `[rows, vocab]`
    pub logits: Vec<f32>,
    /// `[rows, taps × hidden]`: each row's tapped hidden states.
    pub taps: Vec<f32>,
}

impl Forward {
    /// The argmax of each row's logits.
    pub fn argmax(&self, vocab: usize) -> Vec<u32> {
        self.logits.chunks_exact(vocab).map(argmax).collect()
    }
}

/// The first index of the largest value (greedy decoding's choice).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The final norm, the lm_head and the logits, placed with the last layers.
struct HeadBufs {
    norm: DSlice,
    lm_head: DSlice,
    logits: DSlice,
}

impl Decoder {
    /// `target` (every layer: [`Target::load_decoder`]) and `head` on `dev`, with a cache of
    /// `max_len` positions and forwards of up to `block` rows.
    pub fn new(
        dev: Box<dyn Device>,
        target: &Target,
        head: &Head,
        max_len: usize,
        block: usize,
    ) -> Result<Decoder> {
        every_layer(target)?;
        let model = DeviceTarget::new(dev, target, block)?;
        Decoder::of(model, head, max_len)
    }

    /// [`new`](Self::new) over several devices: `target`'s layers in contiguous ranges,
    /// as a split training target places them ([`DeviceTarget::new_split`]).
    pub fn new_split(
        devs: Vec<Box<dyn Device>>,
        target: Target,
        head: &Head,
        max_len: usize,
        block: usize,
    ) -> Result<Decoder> {
        every_layer(&target)?;
        let model = DeviceTarget::new_split(devs, target, block)?;
        Decoder::of(model, head, max_len)
    }

    /// The cache of every part of `model`, and the head on its last.
    fn of(mut model: DeviceTarget, head: &Head, max_len: usize) -> Result<Decoder> {
        let rest = std::mem::take(&mut model.rest);
        let models: Vec<DeviceTarget> = std::iter::once(model).chain(rest).collect();
        let n = models.len();
        let mut parts = Vec::with_capacity(n);
        let mut bufs = None;
        for (i, m) in models.into_iter().enumerate() {
            let (part, b) = Part::new(m, max_len, (i + 1 == n).then_some(head))?;
            parts.push(part);
            bufs = bufs.or(b);
        }
        let HeadBufs {
            norm,
            lm_head,
            logits,
        } = bufs.ok_or_else(|| GpuError::Invalid("a decoder on no device".into()))?;
        Ok(Decoder {
            parts,
            norm,
            lm_head,
            logits,
            max_len,
            len: 0,
        })
    }

    /// Positions in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most rows one [`forward`](Self::forward) takes.
    pub fn block(&self) -> usize {
        self.parts[0].model.max_tokens
    }

    pub fn vocab(&self) -> usize {
        self.parts[0].model.cfg.vocab_size
    }

    pub fn taps_width(&self) -> usize {
        self.parts[0].model.taps.len() * self.parts[0].model.cfg.hidden_size
    }

    /// The devices, and the model's layers on each.
    pub fn layer_ranges(&self) -> Vec<std::ops::Range<usize>> {
        self.parts
            .iter()
            .map(|p| p.model.first..p.model.first + p.model.layers.len())
            .collect()
    }

    /// Forget every position from `len` on.
    pub fn crop(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(GpuError::Invalid(format!(
                "cropping a cache of {} positions to {len}",
                self.len
            )));
        }
        self.len = len;
        Ok(())
    }

    /// Process `tokens` in forwards of up to [`block`](Self::block) rows after what the
    /// cache holds: the logits and taps of every row.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Forward> {
        let mut all = Forward {
            logits: Vec::new(),
            taps: Vec::new(),
        };
        for chunk in tokens.chunks(self.block()) {
            let f = self.forward(chunk)?;
            all.logits.extend(f.logits);
            all.taps.extend(f.taps);
        }
        Ok(all)
    }

    /// `tokens` at the positions after the cache's: each row sees the cache and the rows
    /// up to itself; their keys and values join the cache.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Forward> {
        let (t, s0) = (tokens.len(), self.len);
        if t == 0 || t > self.block() || s0 + t > self.max_len {
            return Err(GpuError::Invalid(format!(
                "a forward of {t} rows after {s0} positions: room for 1 to {} rows and {} positions",
                self.block(),
                self.max_len
            )));
        }
        let c = self.parts[0].model.cfg.clone();
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let width = self.taps_width();
        let mut carry: Option<Carry> = None;
        let n = self.parts.len();
        for (i, p) in self.parts.iter_mut().enumerate() {
            p.start(tokens, s0, carry.as_ref())?;
            for li in 0..p.model.layers.len() {
                p.layer(li, t, s0)?;
            }
            if i + 1 < n {
                carry = Some(p.model.carry(t)?);
            }
        }
        self.len = s0 + t;
        let (norm, lm_head) = (self.norm, self.lm_head);
        let p = self.parts.last_mut().expect("a decoder has a device");
        let (x, n1, logits) = (
            p.act(p.model.a.x, t * h),
            p.act(p.model.a.n1, t * h),
            p.act(self.logits, t * vocab),
        );
        let m = &mut p.model;
        let rstd = m.a.rstd.f32s(0..t);
        m.ops.rmsnorm(
            m.ops.act_mat(x, t, h),
            norm,
            m.ops.act_mat(n1, t, h),
            rstd,
            c.rms_norm_eps as f32,
        )?;
        m.ops.matmul(
            m.ops.act_mat(n1, t, h),
            m.ops.act_mat(lm_head, vocab, h),
            m.ops.act_mat(logits, t, vocab),
        )?;
        let taps = p.act(p.model.a.out, t * width);
        Ok(Forward {
            logits: p.download(logits, t * vocab)?,
            taps: p.download(taps, t * width)?,
        })
    }

    /// The greedy token of each row of final-normed hidden states `[rows, hidden]` (a
    /// drafter's output: it shares the target's lm_head).
    pub fn lm_head_argmax(&mut self, hidden: &[f32]) -> Result<Vec<u32>> {
        let (h, vocab) = (self.parts[0].model.cfg.hidden_size, self.vocab());
        let rows = hidden.len() / h;
        if rows == 0 || rows * h != hidden.len() || rows > self.block() {
            return Err(GpuError::Invalid(format!(
                "{} hidden values: not 1 to {} rows of {h}",
                hidden.len(),
                self.block()
            )));
        }
        let (lm_head, logits) = (self.lm_head, self.logits);
        let p = self.parts.last_mut().expect("a decoder has a device");
        let (x, logits) = (p.act(p.model.a.n1, rows * h), p.act(logits, rows * vocab));
        let dev = p.model.ops.dev.as_mut();
        if p.model.bf16 {
            let bits: Vec<u8> = hidden
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect();
            dev.upload(Stream::Compute, x, &bits)?;
        } else {
            dev.upload(Stream::Compute, x, f32_bytes(hidden))?;
        }
        p.model.ops.matmul(
            p.model.ops.act_mat(x, rows, h),
            p.model.ops.act_mat(lm_head, vocab, h),
            p.model.ops.act_mat(logits, rows, vocab),
        )?;
        let l = p.download(logits, rows * vocab)?;
        Ok(l.chunks_exact(vocab).map(argmax).collect())
    }
}

/// Decoding needs the logits: every layer of the target.
fn every_layer(target: &Target) -> Result<()> {
    let c = &target.cfg;
    if target.layers.len() != c.num_hidden_layers {
        return Err(GpuError::Invalid(format!(
            "decoding needs all {} layers of the target, {} loaded",
            c.num_hidden_layers,
            target.layers.len()
        )));
    }
    Ok(())
}

impl Part {
    /// `model`'s layers with a cache of `max_len` positions, and with `head` the final
    /// norm, the lm_head and the logits.
    fn new(
        mut model: DeviceTarget,
        max_len: usize,
        head: Option<&Head>,
    ) -> Result<(Part, Option<HeadBufs>)> {
        let c = model.cfg.clone();
        let (bf16, t) = (model.bf16, model.max_tokens);
        let (first, layers) = (model.first, model.layers.len());
        let kd = c.num_key_value_heads * c.head_dim;
        let parts = |d: &mut dyn Device, arena: &mut Arena| -> Result<_> {
            let mut f = |n: usize, name: &str| arena.alloc_f32(d, n, name);
            let an = |n: usize| if bf16 { n.div_ceil(2) } else { n };
            let cache = (first..first + layers)
                .map(|l| {
                    Ok((
                        f(an(max_len * kd), &format!("layer {l} key cache"))?,
                        f(an(max_len * kd), &format!("layer {l} value cache"))?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            let (pos, spans) = (f(t, "decode positions")?, f(4 * t, "decode key spans")?);
            let head = match head {
                None => None,
                Some(head) => {
                    let logits = f(an(t * c.vocab_size), "logits")?;
                    let norm = f(c.hidden_size, "final norm")?;
                    let lm_head = f(an(head.lm_head.len()), "lm_head")?;
                    arena.fill_f32(d, norm, &head.norm, false)?;
                    arena.fill_f32(d, lm_head, &head.lm_head, bf16)?;
                    Some(HeadBufs {
                        norm,
                        lm_head,
                        logits,
                    })
                }
            };
            Ok((cache, pos, spans, head))
        };
        let dev = model.ops.dev.as_mut();
        let mut dry = Arena::dry();
        parts(dev, &mut dry)?;
        // A device that reports no free memory has no limit (the host device without one:
        // all it has is in use); any other is checked, so a cache too large is named.
        let what = "the target's KV cache and lm_head";
        let mut arena = match dev.mem_info()? {
            (0, _) => Arena::new(dev, dry.mark())?,
            _ => Arena::for_model(dev, dry.mark(), what)?,
        };
        let (cache, pos, spans, head) = parts(dev, &mut arena)?;
        let part = Part {
            model,
            cache,
            pos,
            spans,
            _arena: arena,
        };
        Ok((part, head))
    }

    /// The rows' positions and key spans on this device, and the residual stream: the
    /// embedding of `tokens` on the first device, what the previous one handed over on
    /// any other.
    fn start(&mut self, tokens: &[u32], s0: usize, carry: Option<&Carry>) -> Result<()> {
        let t = tokens.len();
        let c = &self.model.cfg;
        let (h, width) = (c.hidden_size, self.model.taps.len() * c.hidden_size);
        let pos: Vec<i32> = (s0..s0 + t).map(|p| p as i32).collect();
        let spans: Vec<i32> = pos.iter().flat_map(|&p| [0, p + 1, 0, 0]).collect();
        let (x, out) = (
            self.act(self.model.a.x, t * h),
            self.act(self.model.a.out, t * width),
        );
        let m = &mut self.model;
        let dev = m.ops.dev.as_mut();
        dev.upload(Stream::Compute, self.pos, i32_bytes(&pos))?;
        dev.upload(Stream::Compute, self.spans, i32_bytes(&spans))?;
        if let Some(c) = carry {
            dev.upload(Stream::Compute, x, &c.x)?;
            return dev.upload(Stream::Compute, out, &c.out);
        }
        // The token ids go where a training forward's go: the head of Acts::meta.
        let ids = m.a.meta.sub(4, 0..t);
        dev.upload(Stream::Compute, ids, u32_bytes(tokens))?;
        let embed = m.embed.ok_or_else(|| {
            GpuError::Invalid("a decoder's first device without the embedding".into())
        })?;
        m.ops.embed(x, embed, ids, t, h, m.cfg.vocab_size)
    }

    /// This device's layer `li` on `t` rows at positions `s0..s0 + t`: their keys and
    /// values into the cache, attention over the cache's first `s0 + t` positions.
    fn layer(&mut self, li: usize, t: usize, s0: usize) -> Result<()> {
        let c = &self.model.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let kd = nkv * hd;
        let width = self.model.taps.len() * h;
        let a = &self.model.a;
        let act = |s: DSlice, n: usize| self.act(s, n);
        let vw = a.views(c, t, self.model.bf16);
        let elem = if self.model.bf16 { 2 } else { 4 };
        let (ck, cv) = self.cache[li];
        let (kall, vall) = (
            ck.sub(elem, 0..(s0 + t) * kd),
            cv.sub(elem, 0..(s0 + t) * kd),
        );
        let (knew, vnew) = (
            ck.sub(elem, s0 * kd..(s0 + t) * kd),
            cv.sub(elem, s0 * kd..(s0 + t) * kd),
        );
        let lse = a.lse.f32s(0..t * nh);
        let out = act(a.out, t * width);
        let taps: Vec<usize> = self.model.taps.clone();
        let global = self.model.first + li;
        let l = &self.model.layers[li];
        let ops = &mut self.model.ops;
        let rope = (self.pos, self.model.inv_freq, self.model.rope_scale);
        super::attention_inputs(ops, c, l, &vw, a.rstd, rope)?;
        // The rows' keys and values join the cache; they attend over all of it.
        for (cache, new) in [(knew, vw.k), (vnew, vw.v)] {
            ops.copy_cols((ops.act_mat(cache, t, kd), 0), (new, 0), kd)?;
        }
        ops.attention(Attention {
            q: vw.q.buf,
            k: kall,
            v: vall,
            out: vw.att.buf,
            lse,
            spans: self.spans,
            tq: t,
            qh: nh,
            kvh: nkv,
            hd,
        })?;
        super::attention_output_and_mlp(ops, c, l, a, &vw, a.rstd)?;
        for (ti, &tap) in taps.iter().enumerate() {
            if tap == global {
                let taps = ops.act_mat(out, t, width);
                ops.copy_cols((taps, ti * h), (vw.x, 0), h)?;
            }
        }
        Ok(())
    }

    /// An activation of `n` elements at the start of `s`.
    fn act(&self, s: DSlice, n: usize) -> DSlice {
        if self.model.bf16 {
            s.sub(2, 0..n)
        } else {
            s.f32s(0..n)
        }
    }

    /// `n` activations of `s` to the host, as f32.
    fn download(&mut self, s: DSlice, n: usize) -> Result<Vec<f32>> {
        let mut out = vec![0f32; n];
        let dev = self.model.ops.dev.as_mut();
        if self.model.bf16 {
            let mut bits = vec![0u8; n * 2];
            dev.download(Stream::Compute, s, &mut bits)?;
            for (o, b) in out.iter_mut().zip(bits.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        } else {
            dev.download(Stream::Compute, s, f32_bytes_mut(&mut out))?;
        }
        Ok(out)
    }
}
