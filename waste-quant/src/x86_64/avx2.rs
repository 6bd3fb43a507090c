//! AVX2 + FMA + F16C kernels. Each reproduces the scalar canonical order
//! exactly (see `scalar.rs`), so results are bit-identical.

use crate::matrix::MatRef;
use crate::scalar::LANES;
use crate::vq::{VqBook, VqLayout};
use core::arch::x86_64::*;
use waste_format::Fmt;

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce(a: [__m256; 4]) -> f32 {
    let s = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
    let c = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    let d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    let e = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));
    _mm_cvtss_f32(e)
}

/// Load 32 weights of row bytes `rb` at column `c` (`c % 32 == 0`; for
/// grouped formats the 32 share `scale`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load32(fmt: Fmt, rb: *const u8, c: usize, scale: f32) -> [__m256; 4] {
    // SAFETY (all arms): the caller guarantees the row holds columns c..c+32.
    unsafe {
        match fmt {
            Fmt::F32 => {
                let p = rb.add(c * 4) as *const f32;
                [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))]
            }
            Fmt::F16 => {
                let p = rb.add(c * 2) as *const __m128i;
                [
                    _mm256_cvtph_ps(_mm_loadu_si128(p)),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(2))),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(3))),
                ]
            }
            Fmt::Bf16 => {
                let p = rb.add(c * 2) as *const __m128i;
                let cv = |q: __m128i| _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(q), 16));
                [
                    cv(_mm_loadu_si128(p)),
                    cv(_mm_loadu_si128(p.add(1))),
                    cv(_mm_loadu_si128(p.add(2))),
                    cv(_mm_loadu_si128(p.add(3))),
                ]
            }
            Fmt::Q8G => {
                let p = rb.add(c);
                let s = _mm256_set1_ps(scale);
                let cv = |o: usize| {
                    _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(o) as *const __m128i))),
                        s,
                    )
                };
                [cv(0), cv(8), cv(16), cv(24)]
            }
            Fmt::Q4G => {
                let b = _mm_loadu_si128(rb.add(c / 2) as *const __m128i);
                let m = _mm_set1_epi8(0x0f);
                let lo = _mm_and_si128(b, m);
                let hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
                let e0 = _mm_unpacklo_epi8(lo, hi);
                let e1 = _mm_unpackhi_epi8(lo, hi);
                let s = _mm256_set1_ps(scale);
                let eight = _mm256_set1_epi32(8);
                let cv =
                    |q: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q), eight)), s);
                [cv(e0), cv(_mm_srli_si128(e0, 8)), cv(e1), cv(_mm_srli_si128(e1, 8))]
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma4(acc: &mut [__m256; 4], w: [__m256; 4], x: *const f32) {
    // SAFETY: caller guarantees 32 readable floats at x.
    unsafe {
        for k in 0..4 {
            acc[k] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(x.add(8 * k)), acc[k]);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_dot(m: &MatRef<'_>, r: usize, x: &[f32]) -> f32 {
    let rbs = m.row_bytes();
    let rb = m.data[r * rbs..(r + 1) * rbs].as_ptr();
    let mut acc = [_mm256_setzero_ps(); 4];
    let full = m.cols / LANES * LANES;
    let fused = !m.fmt.is_grouped() || m.group.is_multiple_of(LANES);
    if fused {
        let g = m.groups();
        // group by group: the scale converted once per group (in hardware),
        // no division per block; an ungrouped format is one group
        let gstep = if m.fmt.is_grouped() { m.group } else { full };
        // the row's bits a weight, for the prefetch ahead of the stream
        let bits = match m.fmt {
            Fmt::F32 => 32,
            Fmt::F16 | Fmt::Bf16 => 16,
            Fmt::Q8G => 8,
            Fmt::Q4G => 4,
        };
        let mut c = 0;
        while c < full {
            let gend = (c + gstep).min(full);
            let scale = if m.fmt.is_grouped() {
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(m.scales[r * g + c / m.group] as i32)))
            } else {
                0.0
            };
            while c < gend {
                super::prefetch_ahead(rb, c * bits / 8, LANES * bits / 8);
                // SAFETY: c + 32 <= cols <= row length; x has cols floats.
                unsafe { fma4(&mut acc, load32(m.fmt, rb, c, scale), x.as_ptr().add(c)) };
                c += LANES;
            }
        }
    } else {
        let mut w = [0f32; 8 * LANES];
        let mut c = 0;
        while c < full {
            let n = (full - c).min(w.len());
            m.dequant(r, c, &mut w[..n]);
            for k in (0..n).step_by(LANES) {
                // SAFETY: k + 32 <= n floats in w; c + k + 32 <= cols in x.
                unsafe {
                    fma4(&mut acc, load32(Fmt::F32, w.as_ptr().add(k) as *const u8, 0, 0.0), x.as_ptr().add(c + k))
                };
            }
            c += n;
        }
    }
    if full < m.cols {
        let mut wt = [0f32; LANES];
        let mut xt = [0f32; LANES];
        let n = m.cols - full;
        m.dequant(r, full, &mut wt[..n]);
        xt[..n].copy_from_slice(&x[full..]);
        // SAFETY: both tails are 32 floats.
        unsafe { fma4(&mut acc, load32(Fmt::F32, wt.as_ptr() as *const u8, 0, 0.0), xt.as_ptr()) };
    }
    // SAFETY: features enabled on this function.
    unsafe { reduce(acc) }
}

/// Columns (8 registers of accumulators) per pass of [`rows_axpy`].
const AXPY_COLS: usize = 64;

/// `acc[j] = fma(coef[i], W[r0 + i][j], acc[j])` for the rows `i` in order
/// (MLA's absorbed query `W_kbᵀ q`), each 32-weight block decoded in
/// registers ([`load32`]: the values `MatRef::dequant` gives) instead of
/// through a row buffer: per element the same fused multiply-adds in the
/// same order as dequantizing each row and `ops::axpy` — bit-identical.
/// 64 columns a pass, all the rows (the accumulators stay in registers).
/// 32 × 128 × 512 Q4G: 0.49 → 0.23 ms (docs/lab entry 72).
///
/// # Safety
/// AVX2, FMA, F16C; `m` checked; `acc.len() == m.cols`, a multiple of 32;
/// grouped formats have `group % 32 == 0`; rows `r0..r0 + coef.len()` exist.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_axpy(m: &MatRef<'_>, r0: usize, coef: &[f32], acc: &mut [f32]) {
    assert!(acc.len() == m.cols && m.cols.is_multiple_of(LANES) && r0 + coef.len() <= m.rows);
    assert!(!m.fmt.is_grouped() || m.group.is_multiple_of(LANES));
    let (rbs, g) = (m.row_bytes(), m.groups());
    let mut c0 = 0;
    while c0 < m.cols {
        let nb = (m.cols - c0).min(AXPY_COLS) / LANES;
        // SAFETY (loads and stores of acc): columns c0..c0 + 32·nb are inside acc.
        let mut a: [__m256; AXPY_COLS / 8] = core::array::from_fn(|v| {
            if v < 4 * nb {
                unsafe { _mm256_loadu_ps(acc.as_ptr().add(c0 + 8 * v)) }
            } else {
                _mm256_setzero_ps()
            }
        });
        for (i, &ci) in coef.iter().enumerate() {
            let r = r0 + i;
            let rb = m.data[r * rbs..(r + 1) * rbs].as_ptr();
            let cv = _mm256_set1_ps(ci);
            for b in 0..nb {
                let c = c0 + b * LANES;
                let scale = if m.fmt.is_grouped() {
                    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(m.scales[r * g + c / m.group] as i32)))
                } else {
                    0.0
                };
                // SAFETY: c + 32 <= cols, within the row.
                let w = unsafe { load32(m.fmt, rb, c, scale) };
                for (k, wk) in w.into_iter().enumerate() {
                    a[4 * b + k] = _mm256_fmadd_ps(cv, wk, a[4 * b + k]);
                }
            }
        }
        for (v, av) in a.iter().enumerate().take(4 * nb) {
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(acc.as_mut_ptr().add(c0 + 8 * v), *av) };
        }
        c0 += nb * LANES;
    }
}

/// AVX2 version of [`MatRef::matvec_rows`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `m` must be a checked view,
/// `x.len() == m.cols`, `row0 + y.len() <= m.rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matvec_rows(m: &MatRef<'_>, x: &[f32], row0: usize, y: &mut [f32]) {
    for (i, yo) in y.iter_mut().enumerate() {
        // SAFETY: forwarded contract.
        *yo = unsafe { row_dot(m, row0 + i, x) };
    }
}

/// AVX2 version of [`MatRef::matmat_rows`].
///
/// # Safety
/// As [`matvec_rows`], with `xs.len() == nt · m.cols` and `ys` valid for
/// writes at `t·ys_stride + i`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matmat_rows(
    m: &MatRef<'_>,
    xs: &[f32],
    nt: usize,
    row0: usize,
    n: usize,
    ys: *mut f32,
    ys_stride: usize,
) {
    let fused = !m.fmt.is_grouped() || m.group.is_multiple_of(LANES);
    let cols = m.cols;
    // SAFETY: forwarded contract; AVX2/FMA/F16C enabled on this function.
    unsafe {
        crate::matrix::matmat_groups::<MULTI>(m, xs, nt, row0, n, ys, ys_stride, |r, x, out| match out.try_into() {
            Ok(out3) if fused => row_dot_multi(m, r, x, out3),
            _ => {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = row_dot(m, r, &x[j * cols..(j + 1) * cols]);
                }
            }
        })
    };
}

/// Tokens sharing one dequantization of a weight block in [`row_dot_multi`].
const MULTI: usize = 3;

/// [`row_dot`] of one row with `MULTI` inputs: each 32-weight block is
/// dequantized once and multiplied into every input's own accumulators, in
/// the same order as [`row_dot`] — so each result is bit-identical to it.
/// Fused layouts only (`group % 32 == 0` or ungrouped).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_dot_multi(m: &MatRef<'_>, r: usize, xs: &[f32], out: &mut [f32; MULTI]) {
    let rbs = m.row_bytes();
    let rb = m.data[r * rbs..(r + 1) * rbs].as_ptr();
    let mut acc = [[_mm256_setzero_ps(); 4]; MULTI];
    let full = m.cols / LANES * LANES;
    let g = m.groups();
    let mut c = 0;
    while c < full {
        let scale =
            if m.fmt.is_grouped() { waste_format::half::f16_to_f32(m.scales[r * g + c / m.group]) } else { 0.0 };
        // SAFETY: c + 32 <= cols <= row length; each input has cols floats.
        unsafe {
            let w = load32(m.fmt, rb, c, scale);
            for (t, a) in acc.iter_mut().enumerate() {
                fma4(a, w, xs.as_ptr().add(t * m.cols + c));
            }
        }
        c += LANES;
    }
    for (t, a) in acc.iter_mut().enumerate() {
        if full < m.cols {
            let mut wt = [0f32; LANES];
            let mut xt = [0f32; LANES];
            let n = m.cols - full;
            m.dequant(r, full, &mut wt[..n]);
            xt[..n].copy_from_slice(&xs[t * m.cols + full..(t + 1) * m.cols]);
            // SAFETY: both tails are 32 floats.
            unsafe { fma4(a, load32(Fmt::F32, wt.as_ptr() as *const u8, 0, 0.0), xt.as_ptr()) };
        }
        // SAFETY: features enabled on this function.
        out[t] = unsafe { reduce(*a) };
    }
}

/// Table entries for one (v, s): `t[e] = x0·c0 (+ fma over d)`, 8 entries a
/// lane, for the whole vectors of entries; returns how many entries it
/// wrote (the caller computes the rest with the scalar definition).
///
/// # Safety
/// AVX2+FMA; `x.len() == b.dim`, `t.len() >= b.entries`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn table_entries(b: &VqBook, x: &[f32], t: &mut [f32]) -> usize {
    assert!(x.len() == b.dim && t.len() >= b.entries && b.cbt.len() >= b.dim * b.entries);
    let e8 = b.entries / 8 * 8;
    let c = b.cbt.as_ptr();
    let mut e = 0;
    // eight (then four, then one) vectors' chains at once: a chain is dim dependent
    // FMAs, each entry's in the same order as one at a time; eight keep
    // both FMA ports busy through the 4-cycle latency
    // SAFETY: cbt rows hold `entries` floats (asserted); e + 64 <= entries.
    while e + 64 <= e8 {
        unsafe { entries_chains::<8>(c, b.entries, x, e, t) };
        e += 64;
    }
    while e + 32 <= e8 {
        // SAFETY: as above, e + 32 <= entries.
        unsafe { entries_chains::<4>(c, b.entries, x, e, t) };
        e += 32;
    }
    while e < e8 {
        // SAFETY: as above, e + 8 <= entries.
        unsafe { entries_chains::<1>(c, b.entries, x, e, t) };
        e += 8;
    }
    e8
}

/// Entries `e .. e + 8N` of a (position, stage) table: `N` vectors' FMA
/// chains side by side (`c` the book transposed, `entries` a row).
///
/// # Safety
/// AVX2+FMA; `c` holds `x.len()` rows of `entries` floats, `e + 8N <=
/// entries`, `t` at least `e + 8N` long.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn entries_chains<const N: usize>(c: *const f32, entries: usize, x: &[f32], e: usize, t: &mut [f32]) {
    // SAFETY: the caller's contract.
    unsafe {
        let x0 = _mm256_set1_ps(x[0]);
        let mut acc: [__m256; N] = core::array::from_fn(|q| _mm256_mul_ps(x0, _mm256_loadu_ps(c.add(e + 8 * q))));
        for (d, &xd) in x.iter().enumerate().skip(1) {
            let xv = _mm256_set1_ps(xd);
            for (q, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(xv, _mm256_loadu_ps(c.add(d * entries + e + 8 * q)), *a);
            }
        }
        for (q, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(t.as_mut_ptr().add(e + 8 * q), *a);
        }
    }
}

/// The fast table's codes of one block ([`crate::vq_fast`]'s
/// `quantize_block`) with explicit AVX2: the largest magnitude as the
/// largest of the values' bits without the sign, then per value `T · inv`
/// and `+ 1.5·2²³` as two IEEE steps (no fusing), the rounded integer read
/// from the bits, clamped to ±qmax and packed to bytes (no saturation: the
/// values are already in range) — the scalar steps' bits. Returns the
/// block's scale `amax / qmax` (NaN when a value is NaN, 0 for a zero
/// block).
///
/// # Safety
/// AVX2; `q.len() == t.len()`.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize_codes(t: &[f32], qmax: f32, q: &mut [i8]) -> f32 {
    // SAFETY: the caller's contract.
    unsafe { quantize_into::<1>(t, qmax, bytemuck::cast_slice_mut(q)) }
}

/// [`quantize_codes`] written as `i16` codes (little-endian, `q` twice as
/// long as `t`): the gathers' wide table (`vq_fast::TableForm::Wide`)
/// without a pass of bytes between.
///
/// # Safety
/// AVX2; `q.len() == 2 · t.len()`.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize_codes_wide(t: &[f32], qmax: f32, q: &mut [u8]) -> f32 {
    // SAFETY: the caller's contract.
    unsafe { quantize_into::<2>(t, qmax, q) }
}

/// The codes of `t` as `W`-byte integers (1: `i8`, 2: `i16` little-endian).
///
/// # Safety
/// AVX2; `q.len() == W · t.len()`.
#[target_feature(enable = "avx2")]
unsafe fn quantize_into<const W: usize>(t: &[f32], qmax: f32, q: &mut [u8]) -> f32 {
    let rne = crate::vq_fast::RNE;
    assert_eq!(q.len(), W * t.len());
    let n8 = t.len() / 8 * 8;
    let abs = _mm256_set1_epi32(0x7fff_ffff);
    let mut mv = _mm256_setzero_si256();
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= t.len().
        let v = unsafe { _mm256_loadu_si256(t.as_ptr().add(i) as *const __m256i) };
        mv = _mm256_max_epu32(mv, _mm256_and_si256(v, abs));
    }
    let mut lanes = [0u32; 8];
    // SAFETY: 8 u32s.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, mv) };
    let m = t[n8..].iter().fold(lanes.into_iter().fold(0, u32::max), |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    if m > f32::INFINITY.to_bits() || m == 0 {
        // a NaN (the scale NaN), or an all-zero block: the scalar steps
        return crate::vq_fast::quantize_body_into(t, qmax, q);
    }
    let amax = f32::from_bits(m);
    let inv = qmax / amax;
    let (qm, rb) = (qmax as i32, rne.to_bits() as i32);
    let (vinv, vrne, vrb) = (_mm256_set1_ps(inv), _mm256_set1_ps(rne), _mm256_set1_epi32(rb));
    let (lo, hi) = (_mm256_set1_epi32(-qm), _mm256_set1_epi32(qm));
    let n32 = t.len() / 32 * 32;
    for i in (0..n32).step_by(32) {
        let k: [__m256i; 4] = core::array::from_fn(|j| {
            // SAFETY: i + 32 <= t.len().
            let v = unsafe { _mm256_loadu_ps(t.as_ptr().add(i + 8 * j)) };
            let r = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_mul_ps(v, vinv), vrne)), vrb);
            _mm256_min_epi32(_mm256_max_epi32(r, lo), hi)
        });
        // packs work within 128-bit lanes: the dwords come out in the
        // order 0 4 1 5 2 6 3 7 (by 4s), put back by one permute; as
        // words, in the order 0 2 1 3 (by 4s)
        let (a, b) = (_mm256_packs_epi32(k[0], k[1]), _mm256_packs_epi32(k[2], k[3]));
        if W == 1 {
            let w = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            // SAFETY: i + 32 <= q.len().
            unsafe { _mm256_storeu_si256(q.as_mut_ptr().add(i) as *mut __m256i, w) };
        } else {
            for (j, w) in [a, b].into_iter().enumerate() {
                let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(w);
                // SAFETY: 2i + 32j + 32 <= 2 · t.len() = q.len().
                unsafe { _mm256_storeu_si256(q.as_mut_ptr().add(2 * i + 32 * j) as *mut __m256i, w) };
            }
        }
    }
    for (o, &v) in q[W * n32..].chunks_exact_mut(W).zip(&t[n32..]) {
        o.copy_from_slice(&i16::from(crate::vq_fast::code(v, inv, qmax)).to_le_bytes()[..W]);
    }
    amax / qmax
}

/// `y[i] *= f16(scales[2i..2i+2])` (little-endian f16s), eight rows at a
/// time by F16C: the same conversions (exact) and products as one at a
/// time.
///
/// # Safety
/// AVX2 and F16C; `scales.len() >= 2 · y.len()`.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn scale_by_f16(y: &mut [f32], scales: &[u8]) {
    assert!(scales.len() >= 2 * y.len());
    let n8 = y.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= y.len(); 2i + 16 <= scales.len().
        unsafe {
            let s = _mm256_cvtph_ps(_mm_loadu_si128(scales.as_ptr().add(2 * i) as *const __m128i));
            let p = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_loadu_ps(p), s));
        }
    }
    for (i, v) in y.iter_mut().enumerate().skip(n8) {
        *v *= waste_format::half::f16_to_f32(u16::from_le_bytes([scales[2 * i], scales[2 * i + 1]]));
    }
}

/// VQ4P row sums without gathers: each row's 3 index bytes moved into its
/// 32-bit lane (one byte shuffle per 8 rows), stage `s`'s field the lane
/// shifted right by `6s`, and its 64 table entries looked up as 8 one-register
/// float permutes (`vpermps`, 8 entries by the field's low 3 bits, the
/// table read from L1) merged by a blend tree on bits 3, 4 and 5. A row's
/// sum stays in a register across the 4 stages and adds its entries in the
/// canonical order (vector position, then stage): bit-identical to the
/// scalar definition.
///
/// Rows `r0..r0+y.len()` (multiples of 8), blocked layout with `block % 8
/// == 0`, 6-bit packed indices of 4 stages (`bpv == 3`); `table` has 64
/// entries per (vector position, stage).
///
/// # Safety
/// AVX2; sizes as asserted.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn vq4p_rows8(lay: &VqLayout, idx: &[u8], table: &[f32], r0: usize, y: &mut [f32]) {
    assert!(lay.packed6 && lay.stages == 4 && lay.block > 0 && lay.block.is_multiple_of(8));
    assert!(r0.is_multiple_of(8) && y.len().is_multiple_of(8) && r0 + y.len() <= lay.rows);
    assert!(idx.len() >= lay.index_bytes() && table.len() >= lay.table_len());
    // lane j of each 128-bit half: bytes 3j, 3j+1, 3j+2, 3j+2 of its 4
    // rows; the low half loads the group's bytes 0..16 (rows 0..4 in 0..12),
    // the high half bytes 8..24 (rows 4..8 in its bytes 4..16)
    let ctl = {
        let b: [u8; 32] = core::array::from_fn(|i| {
            let (h, j, c) = (i / 16, (i % 16) / 4, (i % 4).min(2));
            (4 * h + 3 * j + c) as u8
        });
        // SAFETY: 32-byte array.
        unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) }
    };
    y.fill(0.0);
    let goff: Vec<usize> = (0..y.len() / 8).map(|g| lay.offset(r0 + 8 * g, 0)).collect();
    let vstride = lay.vstride();
    let yp = y.as_mut_ptr();
    for v in 0..lay.nvec {
        let tv = table.as_ptr().wrapping_add(4 * 64 * v);
        for (g, &go) in goff.iter().enumerate() {
            // SAFETY: the group's 24 index bytes at go + v·vstride are inside
            // `idx` (asserted); both 16-byte loads stay inside them.
            let d = unsafe {
                let p = idx.as_ptr().add(go + v * vstride);
                let lo = _mm_loadu_si128(p as *const __m128i);
                let hi = _mm_loadu_si128(p.add(8) as *const __m128i);
                _mm256_shuffle_epi8(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi), ctl)
            };
            // SAFETY (table loads): position v's 4 stages of 64 entries are inside `table` (asserted).
            let look = |i: __m256i, t: *const f32| unsafe {
                let e: [__m256; 8] =
                    core::array::from_fn(|q| _mm256_permutevar8x32_ps(_mm256_loadu_ps(t.add(8 * q)), i));
                let m3 = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(i));
                let m4 = _mm256_castsi256_ps(_mm256_slli_epi32::<27>(i));
                let m5 = _mm256_castsi256_ps(_mm256_slli_epi32::<26>(i));
                let e4: [__m256; 4] = core::array::from_fn(|k| _mm256_blendv_ps(e[2 * k], e[2 * k + 1], m3));
                let e2: [__m256; 2] = core::array::from_fn(|k| _mm256_blendv_ps(e4[2 * k], e4[2 * k + 1], m4));
                _mm256_blendv_ps(e2[0], e2[1], m5)
            };
            // SAFETY: 8g + 8 <= y.len().
            unsafe {
                let a = yp.add(8 * g);
                let mut acc = _mm256_add_ps(_mm256_loadu_ps(a), look(d, tv));
                acc = _mm256_add_ps(acc, look(_mm256_srli_epi32::<6>(d), tv.add(64)));
                acc = _mm256_add_ps(acc, look(_mm256_srli_epi32::<12>(d), tv.add(128)));
                acc = _mm256_add_ps(acc, look(_mm256_srli_epi32::<18>(d), tv.add(192)));
                _mm256_storeu_ps(a, acc);
            }
        }
    }
}

/// Unscaled VQ row sums for rows `r0..r0+y.len()` (a multiple of 8, `r0 % 8
/// == 0`, blocked layout with `block % 8 == 0`): lanes are rows, each summing
/// over (v, s) in the canonical order. Up to 8 row groups of one index block
/// run together, so each (v, s) table slice is loaded once for 64 rows and
/// the 8 accumulators hide the add latency.
///
/// The vector positions are walked in tiles of [`VQ_TILE`]: every row's sum
/// over one tile is finished before the next tile starts (the partial sums
/// wait in `y`), so the table tile in use stays in L1 instead of the whole
/// table (hundreds of KB) streaming from L2/L3 once per 64 rows. Each row
/// still adds the same values in the same order — bit-identical.
///
/// # Safety
/// AVX2; sizes as asserted by `vq::matvec_rows`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn vq_rows8(lay: &VqLayout, idx: &[u8], table: &[f32], r0: usize, y: &mut [f32]) {
    let te = lay.table_entries();
    let bpv = lay.bpv();
    let st = lay.stages;
    let end = r0 + y.len();
    // Fast index extraction: each row's bpv (2 or 3) bytes become one 32-bit lane
    // by a byte shuffle; stage s is then (w >> field·s) & mask.
    let fast = bpv == 2 || bpv == 3;
    let mut ml = [0x80u8; 16];
    let mut mh = [0x80u8; 16];
    let hi_off = (8 * bpv).saturating_sub(16);
    for i in 0..4 {
        for k in 0..bpv.min(4) {
            ml[4 * i + k] = (bpv * i + k) as u8;
            mh[4 * i + k] = (bpv * (i + 4) + k - hi_off) as u8;
        }
    }
    // SAFETY: 16-byte arrays.
    let (mask_lo, mask_hi) =
        unsafe { (_mm_loadu_si128(ml.as_ptr() as *const __m128i), _mm_loadu_si128(mh.as_ptr() as *const __m128i)) };
    let field = if lay.packed6 { 6 } else { 8 };
    let field_mask = _mm256_set1_epi32(if lay.packed6 { 63 } else { 255 });
    let mut v0 = 0;
    while v0 < lay.nvec {
        let v1 = (v0 + VQ_TILE).min(lay.nvec);
        let mut r = r0;
        while r < end {
            let block_end = (r / lay.block + 1) * lay.block;
            let ng = ((block_end.min(end) - r) / 8).clamp(1, 8);
            let mut acc = [_mm256_setzero_ps(); 8];
            if v0 > 0 {
                for (g, a) in acc.iter_mut().enumerate().take(ng) {
                    // SAFETY: r + 8g + 8 <= end; the previous tile wrote these partial sums.
                    *a = unsafe { _mm256_loadu_ps(y.as_ptr().add(r - r0 + 8 * g)) };
                }
            }
            // the blocked layout puts position v at block · bpv bytes past v - 1
            let (o0, vstride) = (lay.offset(r, v0), lay.vstride());
            for v in v0..v1 {
                let o = o0 + (v - v0) * vstride;
                let src = &idx[o..o + 8 * ng * bpv];
                if fast {
                    for (g, a) in acc.iter_mut().enumerate().take(ng) {
                        // SAFETY: the 8 rows' indices are 8·bpv ≥ 16 contiguous bytes at src[g·8·bpv..].
                        unsafe {
                            let p = src.as_ptr().add(g * 8 * bpv);
                            let lo = _mm_shuffle_epi8(_mm_loadu_si128(p as *const __m128i), mask_lo);
                            let hi = _mm_shuffle_epi8(_mm_loadu_si128(p.add(8 * bpv - 16) as *const __m128i), mask_hi);
                            let w = _mm256_set_m128i(hi, lo);
                            for s in 0..st {
                                let base = _mm256_set1_epi32(((v * st + s) * te) as i32);
                                let ix = _mm256_and_si256(
                                    _mm256_srl_epi32(w, _mm_cvtsi32_si128((field * s) as i32)),
                                    field_mask,
                                );
                                *a = _mm256_add_ps(
                                    *a,
                                    _mm256_i32gather_ps::<4>(table.as_ptr(), _mm256_add_epi32(ix, base)),
                                );
                            }
                        }
                    }
                    continue;
                }
                for s in 0..st {
                    let base = ((v * st + s) * te) as i32;
                    for (g, a) in acc.iter_mut().enumerate().take(ng) {
                        let mut ix = [0i32; 8];
                        for (i, x) in ix.iter_mut().enumerate() {
                            let q = &src[(g * 8 + i) * bpv..];
                            *x = base
                                + if lay.packed6 {
                                    ((q[0] as i32 | (q[1] as i32) << 8 | (q[2] as i32) << 16) >> (6 * s)) & 63
                                } else {
                                    q[s] as i32
                                };
                        }
                        // SAFETY: every index < te, so base + index lies within the table.
                        unsafe {
                            let vi = _mm256_loadu_si256(ix.as_ptr() as *const __m256i);
                            *a = _mm256_add_ps(*a, _mm256_i32gather_ps::<4>(table.as_ptr(), vi));
                        }
                    }
                }
            }
            for (g, a) in acc.iter().enumerate().take(ng) {
                // SAFETY: r + 8g + 8 <= end.
                unsafe { _mm256_storeu_ps(y.as_mut_ptr().add(r - r0 + 8 * g), *a) };
            }
            r += 8 * ng;
        }
        v0 = v1;
    }
}

/// Vector positions per tile in [`vq_rows8`]: 8 × 3 stages × 256 entries ×
/// 4 bytes = 24 KiB of table, inside a 32 KiB L1.
pub const VQ_TILE: usize = 8;

/// `y[j] = fma(a, x[j], y[j])` for the whole vectors at the start; returns how
/// many elements it did (the caller finishes the rest with the scalar loop).
///
/// # Safety
/// AVX2+FMA; `x.len() == y.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) -> usize {
    let n8 = y.len() / 8 * 8;
    let av = _mm256_set1_ps(a);
    let mut j = 0;
    while j < n8 {
        // SAFETY: j + 8 <= len of both.
        unsafe {
            let r = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(j)), _mm256_loadu_ps(y.as_ptr().add(j)));
            _mm256_storeu_ps(y.as_mut_ptr().add(j), r);
        }
        j += 8;
    }
    n8
}

/// The fast mode's VQ row sums ([`crate::vq_fast`]) without a load per
/// lookup, over a plain table: each (vector position, stage) int8 table is
/// 16 sub-tables of 16 entries; 32 rows' indices look all 16 up by
/// `pshufb` on their low nibble, and a blend tree on the high nibble's
/// bits (4, 5, 6, 7) keeps each row's entry. A block's lookups are summed
/// in 16-bit lanes, then each row's `fma(n_b, d_b, ·)` in block order: the
/// definition's bits. ([`vq_fast_rows32_telescoped`] is the blend-free
/// form over a table telescoped at its build.)
///
/// Rows `r0..r0+y.len()`, both multiples of 32, blocked layout with `block
/// % 32 == 0`, 8-bit indices of 1 to 3 stages; `d` and `q` a whole table's
/// scales and codes ([`crate::vq_fast::parts`]).
///
/// # Safety
/// AVX2 and FMA; sizes as asserted by `vq_fast::matvec_rows`.
pub unsafe fn vq_fast_rows32(lay: &VqLayout, idx: &[u8], d: &[f32], q: &[i8], r0: usize, y: &mut [f32]) {
    // SAFETY: the caller's contract.
    unsafe { rows32_by::<false>(lay, idx, d, q, r0, y) }
}

/// [`vq_fast_rows32`] by one chain of 16 `pshufb`s over a table telescoped
/// when it was built (`vq_fast::TableForm::Telescoped`), no blend
/// ([`lookup256_chains`]).
///
/// # Safety
/// As [`vq_fast_rows32`].
pub unsafe fn vq_fast_rows32_telescoped(lay: &VqLayout, idx: &[u8], d: &[f32], q: &[i8], r0: usize, y: &mut [f32]) {
    // SAFETY: the caller's contract.
    unsafe { rows32_by::<true>(lay, idx, d, q, r0, y) }
}

/// The sizes checked and the loop for the layout's byte stages, by chains
/// (`q` telescoped) or by the blend tree.
///
/// # Safety
/// As [`vq_fast_rows32`].
unsafe fn rows32_by<const CHAINS: bool>(lay: &VqLayout, idx: &[u8], d: &[f32], q: &[i8], r0: usize, y: &mut [f32]) {
    use crate::vq_fast::QBLOCK;
    debug_assert!(lay.stages == lay.bpv() && !lay.packed6 && lay.block.is_multiple_of(32));
    assert!(q.len() >= lay.table_len() && d.len() >= lay.nvec.div_ceil(QBLOCK) && y.len().is_multiple_of(32));
    // SAFETY: the caller's contract (1 to 3 byte stages); `q` holds a whole table.
    unsafe {
        match lay.bpv() {
            3 => vq_fast_rows32_body::<3, CHAINS>(lay, idx, d, q, r0, y),
            2 => vq_fast_rows32_body::<2, CHAINS>(lay, idx, d, q, r0, y),
            1 => vq_fast_rows32_body::<1, CHAINS>(lay, idx, d, q, r0, y),
            b => unreachable!("the fast AVX2 lookups serve 1 to 3 byte stages, not {b}"),
        }
    }
}

/// One 256-entry int8 table lookup for 32 indices `iv` (`lo` their low
/// nibbles): 16 `pshufb`s and a 15-blend tree on bits 4–7.
///
/// # Safety
/// AVX2; 256 readable bytes at `t`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn lookup256(t: *const i8, iv: __m256i, lo: __m256i) -> __m256i {
    let mut sub = [_mm256_setzero_si256(); 16];
    for (k, sk) in sub.iter_mut().enumerate() {
        // SAFETY: the caller passes 256 readable bytes at `t`.
        let tk = unsafe { _mm_loadu_si128(t.add(16 * k) as *const __m128i) };
        *sk = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(tk), lo);
    }
    // blendv picks by each byte's top bit: bit 4 of the index moved there
    // (a 16-bit shift moves each byte's own bit: what crosses from the low
    // byte lands in the high byte's low bits), then 5, 6, and 7 itself
    let m = [_mm256_slli_epi16(iv, 3), _mm256_slli_epi16(iv, 2), _mm256_slli_epi16(iv, 1), iv];
    let mut n = 16;
    for mb in m {
        for k in 0..n / 2 {
            sub[k] = _mm256_blendv_epi8(sub[2 * k], sub[2 * k + 1], mb);
        }
        n /= 2;
    }
    sub[0]
}

/// One 256-entry int8 table lookup for 32 indices `x` from the table's
/// telescoped form `t` ([`telescope`]): 16 `pshufb`s summed in one chain
/// (wrapping bytes: exact), sub-table `k`'s index `x − 16k` for `k < 8`
/// (the low nibble unchanged; bit 7 set, so the entry 0, for the
/// sub-tables above the index's) and `max(x, 127) − 16k` for `k ≥ 8` (all
/// of them 0 for an index below 128). For an index of 128 or more the
/// first eight add up to `T₇ − T_{j−8}` rather than nothing; the second
/// eight's differences make up for it. 16 `pshufb`, 15 adds, 16 index
/// steps and no blend, against [`lookup256`]'s 15 blends: `vpblendvb` is
/// three micro-ops on the Intel Xeon (docs/lab entry 70).
///
/// # Safety
/// AVX2; 256 readable bytes at `t`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn lookup256_chains(t: *const i8, x: __m256i) -> __m256i {
    let sixteen = _mm256_set1_epi8(16);
    let sub = |k: usize| {
        // SAFETY: the caller passes 256 readable bytes at `t`.
        _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(t.add(16 * k) as *const __m128i) })
    };
    let mut idx = x;
    let mut sum = _mm256_shuffle_epi8(sub(0), idx);
    for k in 1..8 {
        idx = opaque(_mm256_sub_epi8(idx, sixteen));
        sum = _mm256_add_epi8(sum, _mm256_shuffle_epi8(sub(k), idx));
    }
    // max(x, 127) − 128: x − 128 for the upper half, 255 (entry 0) below
    idx = _mm256_xor_si256(_mm256_max_epu8(x, _mm256_set1_epi8(127)), _mm256_set1_epi8(-128));
    sum = _mm256_add_epi8(sum, _mm256_shuffle_epi8(sub(8), idx));
    for k in 9..16 {
        idx = opaque(_mm256_sub_epi8(idx, sixteen));
        sum = _mm256_add_epi8(sum, _mm256_shuffle_epi8(sub(k), idx));
    }
    sum
}

/// `v` unchanged, hidden from the optimizer: it cannot fold a chain of
/// steps into one constant per step (sixteen splat constants, reloaded by
/// two-micro-op byte broadcasts once registers run out).
#[inline]
#[target_feature(enable = "avx2")]
fn opaque(mut v: __m256i) -> __m256i {
    // SAFETY: an empty template: no instruction, no memory, no flags.
    unsafe { core::arch::asm!("/* {0} */", inout(ymm_reg) v, options(pure, nomem, nostack, preserves_flags)) };
    v
}

/// A fast table's codes in [`lookup256_chains`]'s form, per 256-entry
/// table `T` of sub-tables `T₀..T₁₅` (16 entries each; differences wrap):
/// `D₀ = T₀`, `D_k = T_k − T_{k−1}` for `k` in 1..8, `D₈ = T₈ − T₇ + T₀`,
/// `D_k = (T_k − T_{k−1}) + (T_{k−8} − T_{k−9})` for `k` in 9..16. An index
/// in sub-table `j < 8` sums `D₀..D_j = T_j`; one in `j ≥ 8` sums
/// `D_{j−7}..D₇ = T₇ − T_{j−8}` and `D₈..D_j = T_j − T₇ + T_{j−8}`.
pub fn telescope(q: &[i8], out: &mut [i8]) {
    assert_eq!(q.len(), out.len());
    for (t, o) in q.chunks_exact(256).zip(out.chunks_exact_mut(256)) {
        let t: &[i8; 256] = t.try_into().expect("256");
        let o: &mut [i8; 256] = o.try_into().expect("256");
        // every entry minus the one 16 before (a pass the compiler
        // vectorizes), then the corrections
        for i in 16..256 {
            o[i] = t[i].wrapping_sub(t[i - 16]);
        }
        o[..16].copy_from_slice(&t[..16]);
        for l in 0..16 {
            // D₈ = T₈ − T₇ + T₀; D_k += T_{k−8} − T_{k−9} = D_{k−8} (k = 9..15)
            o[128 + l] = o[128 + l].wrapping_add(t[l]);
        }
        for i in 144..256 {
            o[i] = o[i].wrapping_add(t[i - 128].wrapping_sub(t[i - 144]));
        }
    }
}

/// [`telescope`] undone: each 256-entry table's plain codes from its
/// telescoped form (`T_k = T_{k−1} + D_k` for `k` in 1..8, `T₈ = D₈ + T₇ −
/// T₀`, `T_k = T_{k−1} + D_k − D_{k−8}` for `k` in 9..16; wrapping).
pub fn untelescope(tq: &[i8], out: &mut [i8]) {
    assert_eq!(tq.len(), out.len());
    for (dq, o) in tq.chunks_exact(256).zip(out.chunks_exact_mut(256)) {
        o[..16].copy_from_slice(&dq[..16]);
        for i in 16..128 {
            o[i] = o[i - 16].wrapping_add(dq[i]);
        }
        for l in 0..16 {
            o[128 + l] = dq[128 + l].wrapping_add(o[112 + l]).wrapping_sub(o[l]);
        }
        for i in 144..256 {
            o[i] = o[i - 16].wrapping_add(dq[i]).wrapping_sub(dq[i - 128]);
        }
    }
}

/// Vector positions [`vq_fast_rows32`] prefetches its indices ahead (each
/// group's `32 · BPV` bytes, both lines they may span).
const VQ_FAST_AHEAD: usize = 24;

/// The `pshufb` masks that gather one stage's 32 index bytes of a group
/// (`BPV` byte stages): a group's `32 · BPV` index bytes are `BPV`
/// registers, load `k` taking bytes `16k..` (rows 0–15) and `16 · BPV + 16k..`
/// (rows 16–31); byte `i` of a lane for stage `s` is row `i`'s byte
/// `BPV · i + s`, in load `(BPV · i + s) / 16`.
#[inline]
#[target_feature(enable = "avx2")]
fn stage_masks<const BPV: usize>() -> [[__m256i; BPV]; BPV] {
    core::array::from_fn(|s| {
        core::array::from_fn(|k| {
            let b: [u8; 16] = core::array::from_fn(|i| {
                let o = (BPV * i + s) as isize - 16 * k as isize;
                if (0..16).contains(&o) {
                    o as u8
                } else {
                    0x80
                }
            });
            // SAFETY: 16-byte array.
            let m = unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) };
            _mm256_broadcastsi128_si256(m)
        })
    })
}

/// [`vq_fast_rows32`]'s loop for `BPV` byte stages, by chains (`CHAINS`:
/// `q` telescoped) or by the blend tree.
///
/// # Safety
/// As [`vq_fast_rows32`].
#[target_feature(enable = "avx2,fma")]
unsafe fn vq_fast_rows32_body<const BPV: usize, const CHAINS: bool>(
    lay: &VqLayout,
    idx: &[u8],
    d: &[f32],
    q: &[i8],
    r0: usize,
    y: &mut [f32],
) {
    use crate::vq_fast::QBLOCK;
    let masks = stage_masks::<BPV>();
    let nib = _mm256_set1_epi8(0x0f);
    let vstride = lay.vstride();
    for g in 0..y.len() / 32 {
        let base = lay.offset(r0 + 32 * g, 0);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut v = 0;
        while v < lay.nvec {
            let ve = (v + QBLOCK).min(lay.nvec);
            let (mut a0, mut a1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for vi in v..ve {
                let p = idx.as_ptr().wrapping_add(base + vi * vstride);
                // a hint: never faults
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(VQ_FAST_AHEAD * vstride) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(VQ_FAST_AHEAD * vstride + 32 * BPV - 1) as *const i8);
                // SAFETY: the group's 32·BPV index bytes at this position are inside `idx` (asserted by the caller).
                let z: [__m256i; BPV] = core::array::from_fn(|k| unsafe {
                    _mm256_loadu2_m128i(p.add(16 * BPV + 16 * k) as *const __m128i, p.add(16 * k) as *const __m128i)
                });
                for (s, ms) in masks.iter().enumerate() {
                    let mut iv = _mm256_shuffle_epi8(z[0], ms[0]);
                    for k in 1..BPV {
                        iv = _mm256_or_si256(iv, _mm256_shuffle_epi8(z[k], ms[k]));
                    }
                    let tp = q.as_ptr().wrapping_add((vi * BPV + s) * 256);
                    // SAFETY: (vi, s)'s 256 codes are inside `q` (asserted).
                    let look = unsafe {
                        if CHAINS {
                            lookup256_chains(tp, iv)
                        } else {
                            lookup256(tp, iv, _mm256_and_si256(iv, nib))
                        }
                    };
                    a0 = _mm256_add_epi16(a0, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(look)));
                    a1 = _mm256_add_epi16(a1, _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(look)));
                }
            }
            let db = _mm256_set1_ps(d[v / QBLOCK]);
            let n = [
                _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a0)),
                _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(a0)),
                _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a1)),
                _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(a1)),
            ];
            for (a, nk) in acc.iter_mut().zip(n) {
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(nk), db, *a);
            }
            v = ve;
        }
        for (k, a) in acc.iter().enumerate() {
            // SAFETY: 32g + 8k + 8 <= y.len().
            unsafe { _mm256_storeu_ps(y.as_mut_ptr().add(32 * g + 8 * k), *a) };
        }
    }
}
