//! Portable reference kernels. They define the canonical arithmetic order
//! that every SIMD path reproduces bit for bit:
//!
//! * dot products run in [`LANES`] = 32 lanes: element `j` accumulates into
//!   lane `j mod 32` with a fused multiply-add, the tail padded with zeros;
//!   lanes are reduced by halving (lane i + lane i+16, then +8, +4, +2, +1);
//! * VQ tables: `T = x0·c0`, then `fma(x_d, c_d, T)` for d = 1.. in order;
//! * VQ rows: a plain sum over (vector position, stage) in order, then × σ.

/// Canonical number of accumulator lanes.
pub const LANES: usize = 32;

fma_scalar! {
    /// Accumulate `w · x` into the 32 lanes (`w.len() == x.len()`, a multiple of 32).
    pub fn dot_acc(acc: &mut [f32; LANES], w: &[f32], x: &[f32]) {
        for (wc, xc) in w.chunks_exact(LANES).zip(x.chunks_exact(LANES)) {
            for i in 0..LANES {
                acc[i] = wc[i].mul_add(xc[i], acc[i]);
            }
        }
    }
}

/// Canonical halving reduction of the 32 lanes.
#[inline]
pub fn reduce(acc: &[f32; LANES]) -> f32 {
    let mut a = *acc;
    let mut n = LANES / 2;
    while n >= 1 {
        for i in 0..n {
            a[i] += a[i + n];
        }
        n /= 2;
    }
    a[0]
}

/// Canonical dot product of two f32 slices of equal length.
pub fn dot(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let full = w.len() / LANES * LANES;
    dot_acc(&mut acc, &w[..full], &x[..full]);
    if full < w.len() {
        let mut wt = [0f32; LANES];
        let mut xt = [0f32; LANES];
        wt[..w.len() - full].copy_from_slice(&w[full..]);
        xt[..w.len() - full].copy_from_slice(&x[full..]);
        dot_acc(&mut acc, &wt, &xt);
    }
    reduce(&acc)
}
