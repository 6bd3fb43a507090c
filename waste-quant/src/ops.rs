//! Element-wise operators shared by attention and MoE, written to match the
//! reference implementations' f32 formulas.

use crate::scalar;

/// The index of the first infinite or NaN value of `v`, if any: a
/// branch-free pass first (it vectorizes, so checking a layer's outputs
/// costs ~80 ns per 2 304 values), the position only on failure.
pub fn first_non_finite(v: &[f32]) -> Option<usize> {
    if !v.iter().fold(false, |bad, x| bad | !x.is_finite()) {
        return None;
    }
    v.iter().position(|x| !x.is_finite())
}

/// `out = w ⊙ (x · rsqrt(mean(x²) + eps))` (transformers' RMSNorm order).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let r = rms_scale(x, eps);
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * r);
    }
}

/// In-place [`rmsnorm`].
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let r = rms_scale(x, eps);
    for (xi, &wi) in x.iter_mut().zip(w) {
        *xi = wi * (*xi * r);
    }
}

/// `1 / sqrt(mean(x²) + eps)`, or NaN when the sum of squares overflows
/// f32 (|x| beyond ≈ 1.8e19). The reference's `x · rsqrt(inf)` turns such
/// a vector into zeros, finite and meaningless, that every later check
/// passes (a model whose hidden state blew up would then print fluent
/// nonsense); NaN makes the engine's non-finite checks stop the step and
/// name the layer (docs/REFERENCE-DIFFERENCES.md). A finite sum gives a
/// positive scale, so 0 happens exactly on overflow.
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss = scalar::dot(x, x);
    let r = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    if r == 0.0 {
        f32::NAN
    } else {
        r
    }
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU `x·σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Softplus as transformers' Kimi forget gate computes it: `x` above 20,
/// else `ln(1 + exp(x))`.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// SiTU-GLU: `β·tanh(g/β)·σ(g) · β'·tanh(u/β')` (β' ≤ 0: `u` raw).
#[inline]
pub fn situ(g: f32, u: f32, beta: f32, linear_beta: f32) -> f32 {
    let a = beta * tanh(g / beta) * sigmoid(g);
    let b = if linear_beta > 0.0 { linear_beta * tanh(u / linear_beta) } else { u };
    a * b
}

/// Hyperbolic tangent, the same bits on every machine. The C library's
/// `tanhf` is not: glibc's x86_64 and aarch64 versions disagree on many
/// inputs (as do `expm1f` and `log1pf`; `expf`, `logf`, `sinf`, `cosf`,
/// `powf` and `sqrtf` agree — checked over 47 million inputs each,
/// docs/lab/), which made K3's logits depend on the architecture.
/// Computed in f64 with only +, −, ×, ÷ (Rust never fuses them): `(1 −
/// e)/(1 + e)` with `e = exp(−2|x|)` from a private f64 `exp`; the f64 error
/// (~1e-15 relative, even where `1 − e` cancels: |x| ≥ 2⁻¹² there) is far
/// below f32's half ulp, so the result is the correctly rounded tanh except
/// within ~1e-15 of a rounding boundary.
pub fn tanh(x: f32) -> f32 {
    let a = (x as f64).abs();
    if a.is_nan() {
        return x;
    }
    if a < 1.0 / 4096.0 {
        // tanh x = x − x³/3 + …: x³/3 < 2⁻²⁵·x, under half an ulp of x
        return x;
    }
    if a > 20.0 {
        return 1f32.copysign(x); // 1 − tanh < 1e-17
    }
    let e = exp_f64(-2.0 * a);
    (((1.0 - e) / (1.0 + e)) as f32).copysign(x)
}

/// The error function, the same bits on every machine (Rust has no stable
/// `erf`, and libm's differ between architectures like `tanhf`): f64 from
/// basic arithmetic and the private `exp` — the Maclaurin series below 2.5
/// (terms stay under 20, so cancellation costs < 2 digits of f64), the
/// continued fraction of `erfc` from 2.5 to 6 (60 terms), 1 beyond
/// (`erfc 6 < 3e-17`) — then rounded to f32.
pub fn erf(x: f32) -> f32 {
    let a = (x as f64).abs();
    if a.is_nan() {
        return x;
    }
    let r = if a < 2.5 {
        let a2 = a * a;
        let (mut term, mut sum) = (a, a);
        for n in 1..=80 {
            term *= -a2 / n as f64;
            let t = term / (2 * n + 1) as f64;
            sum += t;
            if t.abs() < 1e-18 {
                break;
            }
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else if a < 6.0 {
        // erfc a = e^(−a²)/√π · 1/(a + (1/2)/(a + 1/(a + (3/2)/(a + …))))
        let mut f = a;
        for k in (1..=60).rev() {
            f = a + (k as f64 / 2.0) / f;
        }
        1.0 - exp_f64(-a * a) * std::f64::consts::FRAC_2_SQRT_PI / (2.0 * f)
    } else {
        1.0
    };
    (r as f32).copysign(x)
}

/// `e^y` for `-41 ≤ y ≤ 0` in f64 from basic arithmetic only (so the same
/// bits on every machine): `y = k·ln 2 + r`, |r| ≤ ln2/2, a degree-14
/// Taylor polynomial for `e^r` (truncation < 1e-17), scaled by `2^k`.
fn exp_f64(y: f64) -> f64 {
    // fdlibm's split of ln 2: the high part has the low 32 significand bits clear,
    // so k·LN2_HI is exact for |k| < 2^20
    const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    debug_assert!((-41.0..=0.0).contains(&y));
    let k = (y * std::f64::consts::LOG2_E).round();
    let r = (y - k * LN2_HI) - k * LN2_LO;
    let mut p = 1.0;
    for n in (1..=14).rev() {
        p = 1.0 + p * r / n as f64;
    }
    p * f64::from_bits(((k as i64 + 1023) as u64) << 52)
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

fma_scalar! {
    /// `y += a · x`.
    pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        for (yi, &xi) in y.iter_mut().zip(x) {
            *yi = a.mul_add(xi, *yi);
        }
    }
}

/// [`axpy`] at a SIMD level (one fused multiply-add per element either
/// way, so bit-identical).
///
/// # Panics
/// When the slices' lengths differ.
pub fn axpy_at(level: crate::Level, a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if level == crate::Level::Avx512 && crate::Level::Avx512.supported() {
        // SAFETY: AVX-512 verified; equal lengths asserted.
        done = unsafe { crate::x86_64::avx512::axpy(a, x, y) };
    }
    #[cfg(target_arch = "x86_64")]
    if level.avx2_kernels() {
        // SAFETY: AVX2/FMA verified; equal lengths asserted.
        done += unsafe { crate::x86_64::avx2::axpy(a, &x[done..], &mut y[done..]) };
    }
    #[cfg(target_arch = "aarch64")]
    if level.neon_kernels() {
        done = crate::aarch64::neon::axpy(a, x, y);
    }
    let _ = level;
    axpy(a, &x[done..], &mut y[done..]);
}

/// [`crate::scalar::dot`] at a SIMD level (the F32 matvec of one row: the
/// same 32 lanes and reduction, so bit-identical).
///
/// # Panics
/// When the lengths differ.
pub fn dot_at(level: crate::Level, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut y = [0f32];
    crate::f32_matrix(1, a.len(), a).matvec_rows(level, b, 0, &mut y);
    y[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_non_finite_finds_the_first() {
        assert_eq!(first_non_finite(&[1.0, -2.0, 0.0]), None);
        assert_eq!(first_non_finite(&[]), None);
        assert_eq!(first_non_finite(&[1.0, f32::NAN, f32::INFINITY]), Some(1));
        assert_eq!(first_non_finite(&[f32::NEG_INFINITY]), Some(0));
        assert_eq!(first_non_finite(&[f32::MAX, f32::MIN, f32::MIN_POSITIVE, -0.0]), None);
    }

    /// A vector whose squares overflow normalizes to NaN (caught by the
    /// engine's checks), not to the zeros `x · rsqrt(inf)` gives; large but
    /// summable vectors, a zero vector and a single huge value below the
    /// limit stay finite and exact.
    #[test]
    fn an_overflowing_norm_is_nan_not_zeros() {
        let w = [1.0f32; 4];
        let mut out = [0f32; 4];
        for x in [[1e20f32, 1.0, 2.0, 3.0], [3e19, 3e19, 0.0, 0.0], [f32::MAX, 0.0, 0.0, 0.0]] {
            rmsnorm(&x, &w, 1e-6, &mut out);
            assert!(out.iter().all(|v| v.is_nan()), "{x:?} → {out:?}");
        }
        for x in [[1e18f32, -1e18, 1.0, 0.0], [0.0; 4], [1.8e19, 0.0, 0.0, 0.0]] {
            rmsnorm(&x, &w, 1e-6, &mut out);
            assert!(out.iter().all(|v| v.is_finite()), "{x:?} → {out:?}");
            let r = 1.0 / (scalar::dot(&x, &x) / 4.0 + 1e-6).sqrt();
            assert_eq!(out[0], x[0] * r, "{x:?}");
        }
    }

    /// `axpy` and `dot` at every level are the scalar definitions' bits
    /// (the delta-rule rows' test is in waste-attn's `delta`).
    #[test]
    fn axpy_and_dot_are_bit_identical_across_levels() {
        // 37: two 16-wide vectors and a scalar tail; 45: 16-, 8-wide and scalar parts
        for n in [37, 45] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 113) as f32 / 57.0 - 1.0).collect();
            let d: Vec<f32> = (0..n).map(|i| ((i * 104729) % 97) as f32 / 31.0 - 1.5).collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let mut want = d.clone();
            axpy(0.37, &x, &mut want);
            for lv in crate::Level::available() {
                let mut y = d.clone();
                axpy_at(lv, 0.37, &x, &mut y);
                assert_eq!(bits(&y), bits(&want), "axpy, {n} at level {lv:?}");
                assert_eq!(
                    dot_at(lv, &x, &d).to_bits(),
                    crate::scalar::dot(&x, &d).to_bits(),
                    "dot, {n} at level {lv:?}"
                );
            }
        }
    }

    #[test]
    fn tanh_is_accurate_and_odd() {
        // against f64's tanh: within one f32 ulp everywhere (the f64 value
        // rounded to f32 is the reference; we allow the ulp for the rare
        // boundary case), exact sign symmetry, saturation, NaN
        let mut x = 1e-6f32;
        let mut worst = 0u32;
        while x < 30.0 {
            let want = (x as f64).tanh() as f32;
            let got = tanh(x);
            worst = worst.max(got.to_bits().abs_diff(want.to_bits()));
            assert_eq!(tanh(-x).to_bits(), (-got).to_bits());
            x *= 1.000_37;
        }
        assert!(worst <= 1, "{worst} ulps");
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(tanh(100.0), 1.0);
        assert_eq!(tanh(-100.0), -1.0);
        assert!(tanh(f32::NAN).is_nan());
        assert_eq!(tanh(f32::INFINITY), 1.0);
    }

    #[test]
    fn erf_matches_tabulated_values() {
        // erf to 16 digits (Abramowitz & Stegun table 7.1; math.erf agrees)
        for (x, want) in [
            (0.1, 0.1124629160182849),
            (0.5, 0.5204998778130465),
            (1.0, 0.8427007929497149),
            (1.5, 0.9661051464753108),
            (2.0, 0.9953222650189527),
            (2.4999, 0.9995928), // either side of the series / fraction switch
            (2.5, 0.999593047982555),
            (3.0, 0.9999779095030014),
            (4.0, 0.9999999845827421),
        ] {
            let got = erf(x as f32);
            let w = want as f32;
            assert!(got.to_bits().abs_diff(w.to_bits()) <= 1, "erf({x}) = {got}, want {w}");
            assert_eq!(erf(-(x as f32)).to_bits(), (-got).to_bits());
        }
        assert_eq!(erf(0.0), 0.0);
        assert_eq!(erf(7.0), 1.0);
        assert!(erf(f32::NAN).is_nan());
        // monotone across the switch points
        let mut prev = -1.0f32;
        let mut x = -7.0f32;
        while x < 7.0 {
            let v = erf(x);
            assert!(v >= prev, "erf not monotone at {x}");
            prev = v;
            x += 0.001;
        }
    }

    #[test]
    fn formulas() {
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        assert_eq!(softplus(25.0), 25.0);
        assert!((silu(1.0) - 0.7310586).abs() < 1e-6);
        // SiTU with huge betas tends to SiLU-GLU
        assert!((situ(0.5, 0.3, 1e6, 1e6) - silu(0.5) * 0.3).abs() < 1e-6);
        let mut v = [1.0, 2.0, 3.0];
        softmax(&mut v);
        assert!((v.iter().sum::<f32>() - 1.0).abs() < 1e-6 && v[2] > v[1]);
        let mut o = [0f32; 2];
        rmsnorm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut o);
        let r = 1.0 / 12.5f32.sqrt();
        assert_eq!(o, [3.0 * r, 2.0 * (4.0 * r)]);
    }
}
