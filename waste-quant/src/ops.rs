//! Element-wise operators shared by attention and MoE, written to match the
//! reference implementations' f32 formulas.

use crate::scalar;

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

/// `1 / sqrt(mean(x²) + eps)`.
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss = scalar::dot(x, x);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
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
    let a = beta * (g / beta).tanh() * sigmoid(g);
    let b = if linear_beta > 0.0 { linear_beta * (u / linear_beta).tanh() } else { u };
    a * b
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

/// `y += a · x`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi = a.mul_add(xi, *yi);
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
    if level.avx2_kernels() {
        // SAFETY: AVX2/FMA verified; equal lengths asserted.
        done = unsafe { crate::x86_64::avx2::axpy(a, x, y) };
    }
    #[cfg(target_arch = "aarch64")]
    if level.neon_kernels() {
        done = crate::aarch64::neon::axpy(a, x, y);
    }
    let _ = level;
    axpy(a, &x[done..], &mut y[done..]);
}

/// `row[j] *= e; u[j] = fma(k, row[j], u[j])` — the decay-and-project step
/// of a delta-rule state row.
///
/// # Panics
/// When the slices' lengths differ.
pub fn decay_project(level: crate::Level, e: f32, k: f32, row: &mut [f32], u: &mut [f32]) {
    assert_eq!(row.len(), u.len());
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if level.avx2_kernels() {
        // SAFETY: AVX2/FMA verified; equal lengths asserted.
        done = unsafe { crate::x86_64::avx2::decay_project(e, k, row, u) };
    }
    #[cfg(target_arch = "aarch64")]
    if level.neon_kernels() {
        done = crate::aarch64::neon::decay_project(e, k, row, u);
    }
    let _ = level;
    for (sv, uj) in row[done..].iter_mut().zip(u[done..].iter_mut()) {
        *sv *= e;
        *uj = k.mul_add(*sv, *uj);
    }
}

/// `row[j] = fma(k, d[j], row[j]); o[j] = fma(q, row[j], o[j])` — the
/// rank-one update of a delta-rule state row and its read-out.
///
/// # Panics
/// When the slices' lengths differ.
pub fn update_read(level: crate::Level, k: f32, d: &[f32], row: &mut [f32], q: f32, o: &mut [f32]) {
    assert!(d.len() == row.len() && row.len() == o.len());
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if level.avx2_kernels() {
        // SAFETY: AVX2/FMA verified; equal lengths asserted.
        done = unsafe { crate::x86_64::avx2::update_read(k, d, row, q, o) };
    }
    #[cfg(target_arch = "aarch64")]
    if level.neon_kernels() {
        done = crate::aarch64::neon::update_read(k, d, row, q, o);
    }
    let _ = level;
    for ((sv, &dj), oj) in row[done..].iter_mut().zip(&d[done..]).zip(o[done..].iter_mut()) {
        *sv = k.mul_add(dj, *sv);
        *oj = q.mul_add(*sv, *oj);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn state_row_ops_are_bit_identical_across_levels() {
        let n = 37;
        let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 113) as f32 / 57.0 - 1.0).collect();
        let d: Vec<f32> = (0..n).map(|i| ((i * 104729) % 97) as f32 / 31.0 - 1.5).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut want = None;
        for lv in crate::Level::available() {
            let (mut y, mut row, mut u, mut o) = (d.clone(), x.clone(), d.clone(), x.clone());
            axpy_at(lv, 0.37, &x, &mut y);
            decay_project(lv, 0.93, -0.41, &mut row, &mut u);
            update_read(lv, 0.21, &d, &mut row, 1.7, &mut o);
            let got = (bits(&y), bits(&row), bits(&u), bits(&o));
            if let Some(w) = &want {
                assert_eq!(&got, w, "level {lv:?}");
            }
            want = Some(got);
        }
        // the scalar forms are the definition
        let mut y = d.clone();
        axpy(0.37, &x, &mut y);
        assert_eq!(want.unwrap().0, bits(&y));
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
