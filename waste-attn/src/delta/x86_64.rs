//! The x86_64 forms of the delta-rule row operations: AVX2+FMA per row,
//! and a head's whole step by blocks of 32 columns (at AVX2 and AVX-512).

use core::arch::x86_64::*;

/// `row[j] *= e; u[j] = fma(k, row[j], u[j])` for the whole vectors at the start; returns how
/// many elements it did (the caller finishes the rest with the scalar loop).
///
/// # Safety
/// AVX2+FMA; `row.len() == u.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn decay_project(e: f32, k: f32, row: &mut [f32], u: &mut [f32]) -> usize {
    let n8 = row.len() / 8 * 8;
    let (ev, kv) = (_mm256_set1_ps(e), _mm256_set1_ps(k));
    let mut j = 0;
    while j < n8 {
        // SAFETY: j + 8 <= len of both.
        unsafe {
            let s = _mm256_mul_ps(_mm256_loadu_ps(row.as_ptr().add(j)), ev);
            _mm256_storeu_ps(row.as_mut_ptr().add(j), s);
            _mm256_storeu_ps(u.as_mut_ptr().add(j), _mm256_fmadd_ps(kv, s, _mm256_loadu_ps(u.as_ptr().add(j))));
        }
        j += 8;
    }
    n8
}

/// `row[j] = fma(k, d[j], row[j]); o[j] = fma(q, row[j], o[j])` for the whole vectors at the start; returns how
/// many elements it did (the caller finishes the rest with the scalar loop).
///
/// # Safety
/// AVX2+FMA; equal lengths.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn update_read(k: f32, d: &[f32], row: &mut [f32], q: f32, o: &mut [f32]) -> usize {
    let n8 = row.len() / 8 * 8;
    let (kv, qv) = (_mm256_set1_ps(k), _mm256_set1_ps(q));
    let mut j = 0;
    while j < n8 {
        // SAFETY: j + 8 <= len of all three.
        unsafe {
            let s = _mm256_fmadd_ps(kv, _mm256_loadu_ps(d.as_ptr().add(j)), _mm256_loadu_ps(row.as_ptr().add(j)));
            _mm256_storeu_ps(row.as_mut_ptr().add(j), s);
            _mm256_storeu_ps(o.as_mut_ptr().add(j), _mm256_fmadd_ps(qv, s, _mm256_loadu_ps(o.as_ptr().add(j))));
        }
        j += 8;
    }
    n8
}

/// One head's whole recurrence step by blocks of 32 value columns (see
/// `crate::delta::head_step`): per block the decay-and-project pass over
/// every row with `u` in four registers, `d = beta·(v − u)`, then the
/// update-and-read pass with `d` and `o` in registers — the block's 16 KiB
/// of state (128 rows) still in L1 for the second pass. Per element the
/// same operations in the same order as the two whole-state passes.
///
/// # Safety
/// AVX2+FMA; `w % 32 == 0`, `s.len() == e.len() · w`, `k`, `q` as long as
/// `e`, `v` and `o` `w` long.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn head_step_blocks(e: &[f32], k: &[f32], v: &[f32], beta: f32, q: &[f32], s: &mut [f32], o: &mut [f32]) {
    let (rows, w) = (e.len(), o.len());
    let bv = _mm256_set1_ps(beta);
    let sp = s.as_mut_ptr();
    let mut c0 = 0;
    while c0 + 32 <= w {
        // SAFETY (the block): rows·w elements of s, columns c0..c0+32 < w of each row.
        unsafe {
            let mut u = [_mm256_setzero_ps(); 4];
            for i in 0..rows {
                let row = sp.add(i * w + c0);
                let (ev, kv) = (_mm256_set1_ps(*e.get_unchecked(i)), _mm256_set1_ps(*k.get_unchecked(i)));
                for (r, ur) in u.iter_mut().enumerate() {
                    let x = _mm256_mul_ps(_mm256_loadu_ps(row.add(8 * r)), ev);
                    _mm256_storeu_ps(row.add(8 * r), x);
                    *ur = _mm256_fmadd_ps(kv, x, *ur);
                }
            }
            let d: [__m256; 4] = core::array::from_fn(|r| {
                _mm256_mul_ps(bv, _mm256_sub_ps(_mm256_loadu_ps(v.as_ptr().add(c0 + 8 * r)), u[r]))
            });
            let mut ov = [_mm256_setzero_ps(); 4];
            for i in 0..rows {
                let row = sp.add(i * w + c0);
                let (kv, qv) = (_mm256_set1_ps(*k.get_unchecked(i)), _mm256_set1_ps(*q.get_unchecked(i)));
                for r in 0..4 {
                    let x = _mm256_fmadd_ps(kv, d[r], _mm256_loadu_ps(row.add(8 * r)));
                    _mm256_storeu_ps(row.add(8 * r), x);
                    ov[r] = _mm256_fmadd_ps(qv, x, ov[r]);
                }
            }
            for (r, orr) in ov.iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(c0 + 8 * r), *orr);
            }
        }
        c0 += 32;
    }
}
