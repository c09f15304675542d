//! Math helpers shared by the CPU reference, the CPU device and the host device: a leaf
//! module (it imports nothing of the crate).

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
