//! The target's weights put on a device (see [`place`]): the norms and rotary
//! frequencies as f32, the matrices as bf16 on a GPU (from the host's f32 copy, or
//! straight from a mapped checkpoint through a pinned staging buffer), and the
//! activations allocated with them.

use super::layout::{Acts, Layer, Mlp};
use super::moe;
use crate::device::{Arena, DSlice, Device, GpuError, Result, Stream};
use crate::models::target::{matrix_name, Target};

/// Lay out (and, in a real arena, fill) the target's weights and activations for `t`
/// tokens: when `bf16`, the embedding, the projection matrices (a checkpoint's bf16
/// weights are exact in bf16 again: the CPU target widened them) and the activations in
/// bf16; norm weights, rope frequencies, rstd and lse f32 always.
#[allow(clippy::type_complexity)]
pub(super) fn place(
    d: &mut dyn Device,
    arena: &mut Arena,
    target: &Target,
    t: usize,
    bf16: bool,
    (first, with_embed): (usize, bool),
) -> Result<(Option<DSlice>, DSlice, Vec<Layer>, Acts, Vec<u8>)> {
    let c = &target.cfg;
    let staging = match &target.mapped {
        Some(_) if !arena.is_dry() => Some(Staging::new(d, target)?),
        _ => None,
    };
    let shapes = if target.mapped.is_some() {
        dflash_shared::model_config::expected_tensors(c, c.num_hidden_layers)
    } else {
        Vec::new()
    };
    let mut pl = Placer {
        d,
        arena,
        target,
        bf16,
        staging,
        shapes,
    };
    let embed = match with_embed {
        true => Some(pl.matrix(&target.embed, crate::models::target::EMBED, "embed_tokens")?),
        false => None,
    };
    let inv_freq = pl.put(&target.inv_freq, "rope inv_freq", false)?;
    let layers = target
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| pl.layer(first + i, l))
        .collect::<Result<Vec<Layer>>>()?;
    let Placer {
        d, arena, staging, ..
    } = pl;
    let a = Acts::alloc(d, arena, target, t, bf16)?;
    let pinned = match staging {
        Some(st) => st.finish(d)?,
        None => Vec::new(),
    };
    Ok((embed, inv_freq, layers, a, pinned))
}

/// Puts the target's weights in the arena (see [`place`]).
struct Placer<'a> {
    d: &'a mut dyn Device,
    arena: &'a mut Arena,
    target: &'a Target,
    /// The matrices (and the embedding) in bf16.
    bf16: bool,
    /// The pinned buffer a mapped checkpoint's matrices come through (a real arena), and
    /// the checkpoint's tensor shapes.
    staging: Option<Staging>,
    shapes: Vec<(String, Vec<usize>)>,
}

impl Placer<'_> {
    /// `v` into the arena, as bf16 when `bf16`.
    fn put(&mut self, v: &[f32], name: &str, bf16: bool) -> Result<DSlice> {
        let s = self
            .arena
            .alloc(self.d, v.len() * if bf16 { 2 } else { 4 }, name)?;
        self.arena.fill_f32(self.d, s, v, bf16)?;
        Ok(s)
    }

    /// A matrix (`tensor` of the checkpoint) in bf16: from the host's f32 copy `v`, or
    /// (Load::Mapped) straight from the checkpoint's mapping through the pinned staging
    /// buffer.
    fn matrix(&mut self, v: &[f32], tensor: &str, name: &str) -> Result<DSlice> {
        let (n, elem) = match &self.target.mapped {
            Some(_) => (self.shape(tensor).iter().product::<usize>(), 2),
            None => (v.len(), if self.bf16 { 2 } else { 4 }),
        };
        let s = self.arena.alloc(self.d, n * elem, name)?;
        self.matrix_into(v, tensor, s)?;
        Ok(s)
    }

    /// The checkpoint's shape of `tensor` (empty when it has none).
    fn shape(&self, tensor: &str) -> Vec<usize> {
        self.shapes
            .iter()
            .find(|(n, _)| n == tensor)
            .map(|(_, s)| s.clone())
            .unwrap_or_default()
    }

    /// [`matrix`](Self::matrix) into `dst`, which the caller sized for it.
    fn matrix_into(&mut self, v: &[f32], tensor: &str, dst: DSlice) -> Result<()> {
        let target = self.target;
        let Some(w) = &target.mapped else {
            return self.arena.fill_f32(self.d, dst, v, self.bf16);
        };
        let shape = self.shape(tensor);
        let (dtype, bytes) = w
            .raw(tensor, &shape)
            .map_err(|e| GpuError::Invalid(e.to_string()))?;
        if let Some(st) = self.staging.as_mut() {
            st.upload(self.d, dst, dtype, bytes)?;
        }
        Ok(())
    }

    /// Layer `i`'s norms (f32) and matrices.
    fn layer(&mut self, i: usize, l: &crate::models::target::Layer) -> Result<Layer> {
        let n = |s: &str| format!("layer {i} {s}");
        let m = |s: &str| matrix_name(i, s);
        let qk_norm = match (&l.q_norm, &l.k_norm) {
            (Some(qn), Some(kn)) => Some((
                self.put(qn, &n("q_norm"), false)?,
                self.put(kn, &n("k_norm"), false)?,
            )),
            _ => None,
        };
        Ok(Layer {
            ln1: self.put(&l.ln1, &n("input_layernorm"), false)?,
            ln2: self.put(&l.ln2, &n("post_attention_layernorm"), false)?,
            wq: self.matrix(&l.wq, &m("self_attn.q_proj"), &n("q_proj"))?,
            wk: self.matrix(&l.wk, &m("self_attn.k_proj"), &n("k_proj"))?,
            wv: self.matrix(&l.wv, &m("self_attn.v_proj"), &n("v_proj"))?,
            wo: self.matrix(&l.wo, &m("self_attn.o_proj"), &n("o_proj"))?,
            qk_norm,
            mlp: self.mlp(i, &l.mlp)?,
        })
    }

    /// Layer `i`'s MLP matrices: the dense MLP's, or the router and every expert's.
    fn mlp(&mut self, i: usize, mlp: &crate::models::target::Mlp) -> Result<Mlp> {
        use crate::models::target::{Mlp as HostMlp, Swiglu};
        let mut swiglu = |w: &Swiglu, at: &str| -> Result<[DSlice; 3]> {
            let mut one = |v: &[f32], p: &str| {
                self.matrix(
                    v,
                    &matrix_name(i, &format!("{at}.{p}")),
                    &format!("layer {i} {at}.{p}"),
                )
            };
            Ok([
                one(&w.gate, "gate_proj")?,
                one(&w.up, "up_proj")?,
                one(&w.down, "down_proj")?,
            ])
        };
        Ok(match mlp {
            HostMlp::Dense(w) => Mlp::Dense(swiglu(w, "mlp")?),
            HostMlp::Sparse { router, experts } => {
                let router = self.matrix(
                    router,
                    &matrix_name(i, "mlp.gate"),
                    &format!("layer {i} router"),
                )?;
                Mlp::Sparse(self.experts(i, router, experts)?)
            }
        })
    }

    /// Layer `i`'s experts, stacked for the grouped GEMM: every expert's gate and up
    /// projections as one `[experts, 2·width, hidden]` matrix (expert e's `[gate; up]`
    /// rows, so its gate+up GEMM writes `[gate | up]` rows), and the down projections as
    /// `[experts, hidden, width]`.
    fn experts(
        &mut self,
        i: usize,
        router: DSlice,
        experts: &[crate::models::target::Swiglu],
    ) -> Result<moe::Experts> {
        let moe = self.target.cfg.moe.as_ref().ok_or_else(|| {
            GpuError::Invalid(format!(
                "layer {i}: experts in a target without a mixture of experts"
            ))
        })?;
        let (h, mi, ne) = (
            self.target.cfg.hidden_size,
            moe.moe_intermediate_size,
            experts.len(),
        );
        let elem = if self.bf16 || self.target.mapped.is_some() {
            2
        } else {
            4
        };
        let name = |p: &str| format!("layer {i} experts' {p}");
        let gate_up = self
            .arena
            .alloc(self.d, ne * 2 * mi * h * elem, &name("gate+up"))?;
        let down = self
            .arena
            .alloc(self.d, ne * h * mi * elem, &name("down"))?;
        let m = mi * h;
        for (e, w) in experts.iter().enumerate() {
            let t = |p: &str| matrix_name(i, &format!("mlp.experts.{e}.{p}"));
            let at = |s: DSlice, j: usize| s.sub(elem, j * m..(j + 1) * m);
            self.matrix_into(&w.gate, &t("gate_proj"), at(gate_up, 2 * e))?;
            self.matrix_into(&w.up, &t("up_proj"), at(gate_up, 2 * e + 1))?;
            self.matrix_into(&w.down, &t("down_proj"), at(down, e))?;
        }
        Ok(moe::Experts {
            router,
            gate_up,
            down,
            experts: ne,
        })
    }
}

/// Host → device copies of a checkpoint's matrices as bf16, through two halves of one
/// pinned buffer in turn: a half is refilled (a bf16 tensor's bytes copied from the
/// mapping, an f32 or f16 one narrowed to bf16) once the device has read it, while the
/// other half's copy runs. Nothing of the model is widened to f32 on the host.
struct Staging {
    buf: Vec<u8>,
    half: usize,
    busy: [Option<crate::device::Event>; 2],
    next: usize,
}

impl Staging {
    /// Room for the largest matrix, up to 2 × 32 MiB, registered with the device (the
    /// registration lasts as long as the device).
    fn new(d: &mut dyn Device, target: &Target) -> Result<Staging> {
        let c = &target.cfg;
        let largest = (c.vocab_size * c.hidden_size)
            .max(c.intermediate_size * c.hidden_size)
            .max(c.num_attention_heads * c.head_dim * c.hidden_size);
        let half = (largest * 2).clamp(4096, 32 << 20).div_ceil(256) * 256;
        let mut buf = vec![0u8; 2 * half];
        // SAFETY: the buffer is kept by the DeviceTarget, after (dropped after) its device.
        unsafe { d.register_host(buf.as_mut_ptr(), buf.len())? };
        // Each half is its own range for the host device's ordering checks.
        for h in 0..2 {
            d.track(
                DSlice {
                    ptr: buf[h * half..].as_ptr() as u64,
                    bytes: half,
                },
                &format!("weights staging {h}"),
            );
        }
        Ok(Staging {
            buf,
            half,
            busy: [None, None],
            next: 0,
        })
    }

    fn upload(
        &mut self,
        d: &mut dyn Device,
        dst: DSlice,
        dtype: safetensors::Dtype,
        src: &[u8],
    ) -> Result<()> {
        use safetensors::Dtype;
        let width = match dtype {
            Dtype::BF16 | Dtype::F16 => 2,
            _ => 4,
        };
        let n = src.len() / width;
        if n * 2 != dst.bytes {
            return Err(GpuError::Invalid(format!(
                "a matrix of {n} elements for {} bytes of bf16",
                dst.bytes
            )));
        }
        let per = self.half / 2; // elements per half
        for start in (0..n).step_by(per) {
            let m = per.min(n - start);
            let h = self.next;
            self.next ^= 1;
            if let Some(e) = self.busy[h].take() {
                let r = d.sync_event(e);
                d.release_event(e);
                r?;
            }
            let base = self.buf[h * self.half..].as_mut_ptr();
            d.host_access(base, m * 2, true)?;
            let out = &mut self.buf[h * self.half..h * self.half + m * 2];
            let chunk = &src[start * width..(start + m) * width];
            match dtype {
                Dtype::BF16 => out.copy_from_slice(chunk),
                Dtype::F16 => {
                    for (o, b) in out.chunks_exact_mut(2).zip(chunk.chunks_exact(2)) {
                        o.copy_from_slice(
                            &half::bf16::from_f32(half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                                .to_le_bytes(),
                        );
                    }
                }
                _ => {
                    for (o, b) in out.chunks_exact_mut(2).zip(chunk.chunks_exact(4)) {
                        o.copy_from_slice(
                            &half::bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                                .to_le_bytes(),
                        );
                    }
                }
            }
            // SAFETY: pinned memory that is not touched again before `busy[h]` completes.
            unsafe { d.upload_async(Stream::Compute, dst.sub(2, start..start + m), out.as_ptr())? };
            self.busy[h] = Some(d.record(Stream::Compute)?);
        }
        Ok(())
    }

    /// Wait for the last copies. The buffer is registered for the device's life (as
    /// `register_host` requires): its owner keeps it until after the device.
    fn finish(mut self, d: &mut dyn Device) -> Result<Vec<u8>> {
        for e in self.busy.iter_mut().filter_map(Option::take) {
            let r = d.sync_event(e);
            d.release_event(e);
            r?;
        }
        Ok(self.buf)
    }
}
