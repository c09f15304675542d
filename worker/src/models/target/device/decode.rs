//! Decoding with the target over a KV cache (`dflash-supervise eval`): the forward of
//! [`DeviceTarget`] run on a few new positions at a time, each layer's keys and values
//! kept for every position processed so far, so that a prompt is processed once
//! (prefill, in blocks) and each later block of query positions sees the cache plus
//! itself causally (the attention's key spans), then through the final norm and the
//! lm_head. The cache can be cropped back to a length (rejected draft tokens). The same
//! device ops as training's forward: the CPU device now, a GPU with bf16 activations.

use super::{DeviceTarget, Target};
use crate::device::{f32_bytes, GpuError};
use crate::device::{f32_bytes_mut, i32_bytes, u32_bytes, Arena, DSlice, Device, Result, Stream};
use crate::models::target::Head;

/// The target with a KV cache, its final norm and its lm_head.
pub struct Decoder {
    model: DeviceTarget,
    norm: DSlice,
    lm_head: DSlice,
    /// Per layer: keys and values `[max_len, kv_heads × head_dim]` (post norm and RoPE).
    cache: Vec<(DSlice, DSlice)>,
    /// Absolute positions (i32) and key spans (4 i32) of the rows of one forward.
    pos: DSlice,
    spans: DSlice,
    /// `[rows, vocab]`
    logits: DSlice,
    max_len: usize,
    len: usize,
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
        let c = &target.cfg;
        if target.layers.len() != c.num_hidden_layers {
            return Err(GpuError::Invalid(format!(
                "decoding needs all {} layers of the target, {} loaded",
                c.num_hidden_layers,
                target.layers.len()
            )));
        }
        let mut model = DeviceTarget::new(dev, target, block)?;
        let (bf16, t) = (model.bf16, model.max_tokens);
        let kd = c.num_key_value_heads * c.head_dim;
        let parts = |d: &mut dyn Device, arena: &mut Arena| -> Result<_> {
            let mut f = |n: usize, name: &str| arena.alloc_f32(d, n, name);
            let an = |n: usize| if bf16 { n.div_ceil(2) } else { n };
            let cache = (0..c.num_hidden_layers)
                .map(|l| {
                    Ok((
                        f(an(max_len * kd), &format!("layer {l} key cache"))?,
                        f(an(max_len * kd), &format!("layer {l} value cache"))?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            let (pos, spans) = (f(t, "decode positions")?, f(4 * t, "decode key spans")?);
            let logits = f(an(t * c.vocab_size), "logits")?;
            let norm = f(c.hidden_size, "final norm")?;
            let lm_head = f(an(head.lm_head.len()), "lm_head")?;
            arena.fill_f32(d, norm, &head.norm, false)?;
            arena.fill_f32(d, lm_head, &head.lm_head, bf16)?;
            Ok((cache, pos, spans, logits, norm, lm_head))
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
        let (cache, pos, spans, logits, norm, lm_head) = parts(dev, &mut arena)?;
        Ok(Decoder {
            model,
            norm,
            lm_head,
            cache,
            pos,
            spans,
            logits,
            max_len,
            len: 0,
            _arena: arena,
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
        self.model.max_tokens
    }

    pub fn vocab(&self) -> usize {
        self.model.cfg.vocab_size
    }

    pub fn taps_width(&self) -> usize {
        self.model.taps.len() * self.model.cfg.hidden_size
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
        let c = self.model.cfg.clone();
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let width = self.taps_width();
        let pos: Vec<i32> = (s0..s0 + t).map(|p| p as i32).collect();
        let spans: Vec<i32> = pos.iter().flat_map(|&p| [0, p + 1, 0, 0]).collect();
        let x = self.act(self.model.a.x, t * h);
        let m = &mut self.model;
        let dev = m.ops.dev.as_mut();
        // The token ids go where a training forward's go: the head of Acts::meta.
        let ids = m.a.meta.sub(4, 0..t);
        dev.upload(Stream::Compute, ids, u32_bytes(tokens))?;
        dev.upload(Stream::Compute, self.pos, i32_bytes(&pos))?;
        dev.upload(Stream::Compute, self.spans, i32_bytes(&spans))?;
        // The decoder holds the whole model on one device: its embedding is there.
        let embed = m
            .embed
            .ok_or_else(|| GpuError::Invalid("a decoder without the embedding".into()))?;
        m.ops.embed(x, embed, ids, t, h, c.vocab_size)?;
        for li in 0..c.num_hidden_layers {
            self.layer(li, t, s0)?;
        }
        self.len = s0 + t;
        let (n1, logits) = (
            self.act(self.model.a.n1, t * h),
            self.act(self.logits, t * vocab),
        );
        let m = &mut self.model;
        let rstd = m.a.rstd.f32s(0..t);
        m.ops
            .rmsnorm(x, self.norm, n1, rstd, t, h, c.rms_norm_eps as f32)?;
        m.ops.matmul_act(n1, self.lm_head, logits, t, h, vocab)?;
        let taps = self.act(self.model.a.out, t * width);
        Ok(Forward {
            logits: self.download(logits, t * vocab)?,
            taps: self.download(taps, t * width)?,
        })
    }

    /// The greedy token of each row of final-normed hidden states `[rows, hidden]` (a
    /// drafter's output: it shares the target's lm_head).
    pub fn lm_head_argmax(&mut self, hidden: &[f32]) -> Result<Vec<u32>> {
        let (h, vocab) = (self.model.cfg.hidden_size, self.model.cfg.vocab_size);
        let rows = hidden.len() / h;
        if rows == 0 || rows * h != hidden.len() || rows > self.block() {
            return Err(GpuError::Invalid(format!(
                "{} hidden values: not 1 to {} rows of {h}",
                hidden.len(),
                self.block()
            )));
        }
        let (x, logits) = (
            self.act(self.model.a.n1, rows * h),
            self.act(self.logits, rows * vocab),
        );
        let dev = self.model.ops.dev.as_mut();
        if self.model.bf16 {
            let bits: Vec<u8> = hidden
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect();
            dev.upload(Stream::Compute, x, &bits)?;
        } else {
            dev.upload(Stream::Compute, x, f32_bytes(hidden))?;
        }
        self.model
            .ops
            .matmul_act(x, self.lm_head, logits, rows, h, vocab)?;
        let l = self.download(logits, rows * vocab)?;
        Ok(l.chunks_exact(vocab).map(argmax).collect())
    }

    /// Layer `li` on `t` rows at positions `s0..s0 + t`: their keys and values into the
    /// cache, attention over the cache's first `s0 + t` positions.
    fn layer(&mut self, li: usize, t: usize, s0: usize) -> Result<()> {
        let c = &self.model.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let (qd, kd) = (nh * hd, nkv * hd);
        let eps = c.rms_norm_eps as f32;
        let width = self.taps_width();
        let a = &self.model.a;
        let act = |s: DSlice, n: usize| self.act(s, n);
        let super::Views {
            x,
            n1,
            q,
            k,
            v,
            att,
            o,
            g,
            u,
            sw,
        } = a.views(c, t, self.model.bf16);
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
        let (rstd, lse) = (a.rstd.f32s(0..t * nh.max(nkv)), a.lse.f32s(0..t * nh));
        let out = act(a.out, t * width);
        let taps: Vec<usize> = self.model.taps.clone();
        let l = &self.model.layers[li];
        let ops = &mut self.model.ops;
        let (inv, scale) = (self.model.inv_freq, self.model.rope_scale);
        ops.rmsnorm(x, l.ln1, n1, rstd.f32s(0..t), t, h, eps)?;
        ops.matmul_act(n1, l.wq, q, t, h, qd)?;
        ops.matmul_act(n1, l.wk, k, t, h, kd)?;
        ops.matmul_act(n1, l.wv, v, t, h, kd)?;
        if let Some((qn, kn)) = l.qk_norm {
            ops.rmsnorm(q, qn, q, rstd.f32s(0..t * nh), t * nh, hd, eps)?;
            ops.rmsnorm(k, kn, k, rstd.f32s(0..t * nkv), t * nkv, hd, eps)?;
        }
        ops.rope(q, self.pos, inv, t, nh, hd, scale, false)?;
        ops.rope(k, self.pos, inv, t, nkv, hd, scale, false)?;
        ops.copy_cols(knew, k, t, kd, kd, 0, kd, 0)?;
        ops.copy_cols(vnew, v, t, kd, kd, 0, kd, 0)?;
        ops.attention(q, kall, vall, att, lse, self.spans, t, nh, nkv, hd)?;
        ops.matmul_act(att, l.wo, o, t, qd, h)?;
        ops.add(x, o)?;
        ops.rmsnorm(x, l.ln2, n1, rstd.f32s(0..t), t, h, eps)?;
        super::mlp(ops, c, l, a, (n1, o, [g, u, sw]), t, self.model.bf16)?;
        ops.add(x, o)?;
        for (ti, &tap) in taps.iter().enumerate() {
            if tap == li {
                ops.copy_cols(out, x, t, h, width, ti * h, h, 0)?;
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
