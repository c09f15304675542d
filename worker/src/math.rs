//! Math helpers shared by the CPU reference, the CPU device and the host device: a leaf
//! module (it imports nothing of the crate): `exp_neg`, dot and axpy, a GEMM over the
//! `gemm` crate with strides, rotary inverse frequencies.

/// `eˣ` for `x ≤ 0` (a logit minus a running maximum), flushed to 0 where it falls below
/// 1e-30, so that nothing downstream goes subnormal (x86 arithmetic on subnormals takes a
/// microcode assist: it made the loss's GEMMs ten times slower). Computed inline, so the
/// softmax loops vectorise (libm's expf is a call per element): x = n·ln2 + r with the
/// Cody–Waite split of ln2 (n·ln2_hi exact), eʳ by its Taylor series to r⁶ on |r| ≤ ln2/2,
/// 2ⁿ from the exponent bits; relative error below 3e-7 (tested).
#[inline(always)]
pub fn exp_neg(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4; // 355/512: n·LN2_HI is exact for |n| < 2¹⁵
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.max(-69.0);
    // round(x·log2 e) for x ≤ 0, with a truncating conversion (no libm call).
    let n = (xc * std::f32::consts::LOG2_E - 0.5) as i32;
    let nf = n as f32;
    let r = (xc - nf * LN2_HI) - nf * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let y = p * f32::from_bits(((n + 127) as u32) << 23);
    if x < -69.0 {
        0.0
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y += a * x`
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// `dst (m×n) = [dst +] lhs (m×k) · rhs (k×n)` through the `gemm` crate, every matrix given
/// by its row and column strides in elements.
///
/// # Safety
/// Every pointer must be valid for the elements its strides and sizes address.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm(
    par: gemm::Parallelism,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    dst_cs: isize,
    accumulate: bool,
    lhs: *const f32,
    lhs_rs: usize,
    lhs_cs: isize,
    rhs: *const f32,
    rhs_rs: isize,
    rhs_cs: isize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    *dst.offset(i as isize * dst_rs as isize + j as isize * dst_cs) = 0.0;
                }
            }
        }
        return;
    }
    // gemm's contract: dst := alpha·dst + beta·lhs·rhs (alpha read only when read_dst).
    gemm::gemm(
        m,
        n,
        k,
        dst,
        dst_cs,
        dst_rs as isize,
        accumulate,
        lhs,
        lhs_cs,
        lhs_rs as isize,
        rhs,
        rhs_cs,
        rhs_rs,
        1.0,
        1.0,
        false,
        false,
        false,
        par,
    )
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
mod rope_tests {
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

#[cfg(test)]
mod tests {
    use super::exp_neg;

    #[test]
    fn exp_neg_is_within_3e_7_of_exp_and_flushes_below_1e_30() {
        let mut worst = 0f64;
        for i in 0..=690_000 {
            let x = -(i as f32) * 1e-4;
            let want = (x as f64).exp();
            let got = exp_neg(x) as f64;
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(-69.5), 0.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert!(
            exp_neg(f32::NAN).is_nan(),
            "a NaN must reach the loss and the gradient-norm check"
        );
        assert!(exp_neg(-68.9) > 1e-30 && exp_neg(-68.9).is_normal());
    }
}
