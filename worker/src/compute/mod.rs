//! Compute: the op set behind a backend trait, in the style of llm.c — every op has an
//! explicit forward and, where training needs it, an explicit backward. The `cpu` backend
//! is plain Rust with threads; a CUDA backend (cudarc, NVRTC, cuBLASLt) implements the
//! same trait later.
//!
//! Layouts: activations are row-major `[rows, dim]` f32; a linear layer's weight is
//! `[out, in]` as in Hugging Face checkpoints, so `y = x · Wᵀ`.

pub mod cpu;

use std::ops::Range;

/// Which keys one query row may attend to: the union of two key ranges (the causal
/// prefix of a sequence; or, for a DFlash block, the context before its anchor and the
/// block itself). Empty ranges are allowed; a row with no key outputs zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpan {
    pub a: Range<usize>,
    pub b: Range<usize>,
}

impl KeySpan {
    pub fn keys(&self) -> impl Iterator<Item = usize> + '_ {
        self.a.clone().chain(self.b.clone())
    }

    pub fn len(&self) -> usize {
        self.a.len() + self.b.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Shape of a multi-head attention call.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// What attention's forward keeps for its backward: the softmax probabilities of every
/// (head, query) over its allowed keys, in `KeySpan::keys` order.
pub struct AttnSaved {
    pub probs: Vec<f32>,
    /// Start of each (query, head) row in `probs`.
    pub offsets: Vec<usize>,
}

/// The op set. Buffers are host f32 slices for now; the CUDA backend will bring its own
/// buffer type.
pub trait Backend: Sync {
    /// `y[m,n] = x[m,k] · w[n,k]ᵀ`
    fn matmul(&self, x: &[f32], w: &[f32], y: &mut [f32], m: usize, k: usize, n: usize);
    /// Backward of [`matmul`](Backend::matmul): `dx += dy · w` (if given), `dw += dyᵀ · x`
    /// (if given).
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward(
        &self,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        dx: Option<&mut [f32]>,
        dw: Option<&mut [f32]>,
        m: usize,
        k: usize,
        n: usize,
    );
    /// RMSNorm of each row of width `d`; returns the reciprocal RMS of each row.
    fn rmsnorm(&self, x: &[f32], w: &[f32], y: &mut [f32], d: usize, eps: f32) -> Vec<f32>;
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        dw: Option<&mut [f32]>,
        d: usize,
    );
    /// Rotary embedding in place on rows of `heads × head_dim`, row `i` at `positions[i]`
    /// (Hugging Face's rotate-half convention). `inverse` applies the transpose (backward).
    /// Rotary embedding in place, cos and sin times `scale` (YaRN's attention factor, else
    /// 1); `inverse` applies the transpose (the backward).
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &mut [f32],
        heads: usize,
        head_dim: usize,
        positions: &[usize],
        inv_freq: &[f32],
        scale: f32,
        inverse: bool,
    );
    /// `out = silu(gate) * up`
    fn swiglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]);
    fn swiglu_backward(
        &self,
        dout: &[f32],
        gate: &[f32],
        up: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    );
    /// Masked softmax attention. q: `[tq, q_heads·hd]`, k/v: `[tk, kv_heads·hd]`,
    /// out: `[tq, q_heads·hd]`. Scale 1/√hd.
    fn attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
        spans: &[KeySpan],
        h: Heads,
    ) -> AttnSaved;
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dout: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        saved: &AttnSaved,
        spans: &[KeySpan],
        h: Heads,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    );
}

/// Inverse frequencies of rotary embeddings, with the target's scaling.
pub fn rope_inv_freq(
    head_dim: usize,
    theta: f64,
    scaling: Option<&dflash_shared::model_config::RopeScaling>,
) -> Vec<f32> {
    use dflash_shared::model_config::RopeScaling;
    (0..head_dim / 2)
        .map(|i| {
            let f = 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64);
            let f = match scaling {
                None => f,
                Some(RopeScaling::Linear { factor }) => f / factor,
                Some(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                }) => {
                    let low_wavelen = original_max_position_embeddings / low_freq_factor;
                    let high_wavelen = original_max_position_embeddings / high_freq_factor;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (original_max_position_embeddings / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                }
                Some(RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings,
                    beta_fast,
                    beta_slow,
                    truncate,
                    ..
                }) => {
                    let dim = head_dim as f64;
                    let correction = |rotations: f64| {
                        dim * (original_max_position_embeddings
                            / (rotations * 2.0 * std::f64::consts::PI))
                            .ln()
                            / (2.0 * theta.ln())
                    };
                    let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
                    if *truncate {
                        (low, high) = (low.floor(), high.ceil());
                    }
                    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                    if low == high {
                        high += 0.001;
                    }
                    // 1 keeps the original frequency, 0 interpolates it.
                    let extrapolate = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    f / factor * (1.0 - extrapolate) + f * extrapolate
                }
            };
            f as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::model_config::RopeScaling;

    #[test]
    fn llama3_rope_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let plain = rope_inv_freq(128, 500000.0, None);
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let scaled = rope_inv_freq(128, 500000.0, Some(&s));
        assert_eq!(plain[0], 1.0);
        assert_eq!(
            scaled[0], plain[0],
            "wavelength 2π is far below 8192/4: unchanged"
        );
        let last = plain.len() - 1;
        assert!(
            (scaled[last] - plain[last] / 8.0).abs() < 1e-12,
            "lowest frequency divided by the factor"
        );
        // In between, the scaled frequency lies between f/8 and f.
        assert!(plain
            .iter()
            .zip(&scaled)
            .all(|(p, s)| *s <= *p && *s >= *p / 8.0 - 1e-12));
        let lin = rope_inv_freq(128, 500000.0, Some(&RopeScaling::Linear { factor: 2.0 }));
        assert!(plain
            .iter()
            .zip(&lin)
            .all(|(p, l)| (l - p / 2.0).abs() < 1e-9));
    }
}
