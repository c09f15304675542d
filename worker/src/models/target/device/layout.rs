//! Where the target's weights and activations live on one device: a layer's weights
//! ([`Layer`], its MLP dense or a mixture of experts), the activations of a forward of up
//! to `max_tokens` tokens ([`Acts`], and [`Views`] of them for `t` tokens), and where a
//! forward's token ids, positions and key spans lie in one upload ([`Meta`]).

use dflash_shared::model_config::TargetConfig;

use super::moe;
use crate::device::ops::{DType, Mat, Ops};
use crate::device::{i32_bytes, Arena, DSlice, Device, Result, Stream};
use crate::models::target::Target;

pub(super) struct Layer {
    pub(super) ln1: DSlice,
    pub(super) ln2: DSlice,
    pub(super) wq: DSlice,
    pub(super) wk: DSlice,
    pub(super) wv: DSlice,
    pub(super) wo: DSlice,
    pub(super) qk_norm: Option<(DSlice, DSlice)>,
    pub(super) mlp: Mlp,
}

/// A layer's MLP on the device: dense (gate, up, down), or a mixture of experts.
pub(super) enum Mlp {
    Dense([DSlice; 3]),
    Sparse(moe::Experts),
}

pub(super) struct Acts {
    /// Per forward, in one upload: the token ids, each token's position in its row and
    /// its causal key span (4 i32), at [`Meta`]'s offsets.
    pub(super) meta: DSlice,
    pub(super) x: DSlice,
    pub(super) n1: DSlice,
    pub(super) rstd: DSlice,
    pub(super) q: DSlice,
    pub(super) k: DSlice,
    pub(super) v: DSlice,
    pub(super) att: DSlice,
    pub(super) lse: DSlice,
    pub(super) o: DSlice,
    pub(super) g: DSlice,
    pub(super) u: DSlice,
    pub(super) act: DSlice,
    /// The sparse MLP's activations (a mixture-of-experts target).
    pub(super) moe: Option<moe::MoeActs>,
    pub(super) out: DSlice,
    /// Two bf16 staging buffers for the copy to the host, used in turn (with bf16
    /// activations the taps are written straight into them).
    pub(super) stage: [DSlice; 2],
}

/// One forward's activations for `t` tokens, each the `[t, width]` matrix the layer
/// writes (bf16 on a GPU, f32 on the CPU device): [`Acts::views`].
#[derive(Clone, Copy)]
pub(super) struct Views {
    pub(super) x: Mat,
    pub(super) n1: Mat,
    pub(super) q: Mat,
    pub(super) k: Mat,
    pub(super) v: Mat,
    pub(super) att: Mat,
    pub(super) o: Mat,
    pub(super) g: Mat,
    pub(super) u: Mat,
    pub(super) sw: Mat,
}

impl Acts {
    /// The activations of a forward of `t` tokens of a `c` model, bf16 or f32.
    pub(super) fn views(&self, c: &TargetConfig, t: usize, bf16: bool) -> Views {
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let (qd, kd) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let act = |s: DSlice, cols: usize| Mat::new(s, t, cols, DType::of(bf16));
        Views {
            x: act(self.x, h),
            n1: act(self.n1, h),
            q: act(self.q, qd),
            k: act(self.k, kd),
            v: act(self.v, kd),
            att: act(self.att, qd),
            o: act(self.o, h),
            g: act(self.g, inter),
            u: act(self.u, inter),
            sw: act(self.act, inter),
        }
    }
}

impl Acts {
    /// The activations for `t` tokens (half the f32s of each in bf16 when `bf16`).
    pub(super) fn alloc(
        d: &mut dyn Device,
        arena: &mut Arena,
        target: &Target,
        t: usize,
        bf16: bool,
    ) -> Result<Acts> {
        let c = &target.cfg;
        let (h, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (qd, kd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let width = target.taps.len() * h;
        let moe = match &c.moe {
            Some(m) => Some(moe::MoeActs::alloc(d, arena, m, h, t, bf16)?),
            None => None,
        };
        let mut f = |n: usize, name: &str| arena.alloc_f32(d, n, name);
        // An activation of n elements: half the f32s in bf16.
        let an = |n: usize| if bf16 { n.div_ceil(2) } else { n };
        Ok(Acts {
            meta: f(Meta::len(t), "token ids, positions and causal spans")?,
            x: f(an(t * h), "residual")?,
            n1: f(an(t * h), "normed")?,
            rstd: f(t * qd / hd, "rstd")?,
            q: f(an(t * qd), "q")?,
            k: f(an(t * kd), "k")?,
            v: f(an(t * kd), "v")?,
            att: f(an(t * qd), "attention out")?,
            lse: f(t * c.num_attention_heads, "attention lse")?,
            o: f(an(t * h), "projection out")?,
            g: f(an(t * inter), "gate")?,
            u: f(an(t * inter), "up")?,
            act: f(an(t * inter), "swiglu")?,
            moe,
            out: f(an(t * width), "taps")?,
            stage: [
                f(t * width / 2 + 1, "bf16 staging 0")?,
                f(t * width / 2 + 1, "bf16 staging 1")?,
            ],
        })
    }
}

/// Where a forward's per-token inputs lie in [`Acts::meta`] (i32 elements): the token
/// ids from 0, the positions from `pos`, the key spans from `spans`, each 16-byte aligned.
pub(super) struct Meta {
    pub(super) pos: usize,
    pub(super) spans: usize,
}

impl Meta {
    pub(super) fn of(t: usize) -> Meta {
        let a = t.next_multiple_of(4);
        Meta {
            pos: a,
            spans: 2 * a,
        }
    }

    /// Elements for a forward of `t` tokens.
    pub(super) fn len(t: usize) -> usize {
        Meta::of(t).spans + 4 * t
    }

    /// The ids, positions and causal spans of `rows` (`t` tokens) packed: token `i` of a
    /// row that starts at `s` is at position `i` and sees keys `[s, s + i + 1)`, no second
    /// span. Uploaded into `meta` at once; returns the three parts.
    pub(super) fn upload(
        ops: &mut Ops,
        meta: DSlice,
        rows: &[&[u32]],
        t: usize,
    ) -> Result<(DSlice, DSlice, DSlice)> {
        let m = Meta::of(t);
        let mut v = vec![0i32; Meta::len(t)];
        let mut i = 0;
        for r in rows {
            let start = i as i32;
            for (p, &id) in r.iter().enumerate() {
                // The bits of the u32 id: the embedding gather reads them as u32.
                v[i] = id as i32;
                v[m.pos + i] = p as i32;
                v[m.spans + 4 * i] = start;
                v[m.spans + 4 * i + 1] = i as i32 + 1;
                i += 1;
            }
        }
        ops.dev
            .upload(Stream::Compute, meta.sub(4, 0..v.len()), i32_bytes(&v))?;
        Ok((
            meta.sub(4, 0..t),
            meta.sub(4, m.pos..m.pos + t),
            meta.sub(4, m.spans..m.spans + 4 * t),
        ))
    }
}
