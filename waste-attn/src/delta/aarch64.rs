//! The NEON forms of the delta-rule row operations.

use core::arch::aarch64::*;

/// `row[j] *= e; u[j] = fma(k, row[j], u[j])` for the whole vectors at the start; returns how
/// many elements it did (the caller finishes the rest with the scalar loop).
///
/// # Panics
/// When the lengths differ.
pub fn decay_project(e: f32, k: f32, row: &mut [f32], u: &mut [f32]) -> usize {
    assert_eq!(row.len(), u.len());
    let n4 = row.len() / 4 * 4;
    let mut j = 0;
    while j < n4 {
        // SAFETY: j + 4 <= len of both.
        unsafe {
            let s = vmulq_f32(vld1q_f32(row.as_ptr().add(j)), vdupq_n_f32(e));
            vst1q_f32(row.as_mut_ptr().add(j), s);
            vst1q_f32(u.as_mut_ptr().add(j), vfmaq_f32(vld1q_f32(u.as_ptr().add(j)), vdupq_n_f32(k), s));
        }
        j += 4;
    }
    n4
}

/// `row[j] = fma(k, d[j], row[j]); o[j] = fma(q, row[j], o[j])` for the whole vectors at the start; returns how
/// many elements it did (the caller finishes the rest with the scalar loop).
///
/// # Panics
/// When the lengths differ.
pub fn update_read(k: f32, d: &[f32], row: &mut [f32], q: f32, o: &mut [f32]) -> usize {
    assert!(d.len() == row.len() && row.len() == o.len());
    let n4 = row.len() / 4 * 4;
    let mut j = 0;
    while j < n4 {
        // SAFETY: j + 4 <= len of all three.
        unsafe {
            let s = vfmaq_f32(vld1q_f32(row.as_ptr().add(j)), vdupq_n_f32(k), vld1q_f32(d.as_ptr().add(j)));
            vst1q_f32(row.as_mut_ptr().add(j), s);
            vst1q_f32(o.as_mut_ptr().add(j), vfmaq_f32(vld1q_f32(o.as_ptr().add(j)), vdupq_n_f32(q), s));
        }
        j += 4;
    }
    n4
}
