//! The reference op set, in the style of llm.c — every op has an explicit forward and,
//! where training needs it, an explicit backward: plain Rust with threads ([`cpu::Cpu`]).
//! The reference models (`crate::model`) compute with it, and every kernel of the
//! devices (`crate::device`: the GPU's CUDA kernels, the CPU device's) is tested against
//! it.
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
