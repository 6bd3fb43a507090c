//! The fast mode's VQ row sums ([`crate::vq_fast`]) by AVX2 dword gathers
//! from the table's wide form ([`crate::vq_fast::TableForm::Wide`]: each
//! code an `i16`). Eight rows a gather: each lane reads the 4 bytes at its
//! code, the code in the low half, the next entry in the high one; the
//! lanes' 32-bit sums keep the codes' exact sum in their low 16 bits (a
//! block's sum is at most `4 · 3 · 127` in magnitude), sign-extended once
//! a block. One gather does eight lookups with one add, against the 47
//! vector operations of 32 `pshufb` lookups (`avx2::lookup256_chains`):
//! where the CPU's gather is quick (the Intel Xeon of docs/lab entry 72:
//! 4.2 cycles for eight lanes), this is the faster form; on AMD Zen 2/3,
//! whose `vpgatherdd` is slow, the per-process probe keeps the chains
//! (`vq_fast::probe_avx2_lookup`).

use crate::vq::VqLayout;
use crate::vq_fast::QBLOCK;
use core::arch::x86_64::*;

/// Vector positions per tile: the rows are summed a tile at a time so the
/// tile's wide codes (16 positions × 3 stages × 512 bytes = 24 KiB) stay
/// in L1 while every row group reads them; a group's running sums go to
/// `y` between tiles (the block order of the definition is kept: tiles are
/// whole blocks, in order). 1024 × 2304 VQ3R, indices from 2 MiB pages:
/// 8 positions 0.174–0.179 ms, 16 0.170–0.176, 24 0.176, one tile (no
/// tiling) 0.198–0.215 (docs/lab entry 72).
const TILE: usize = 16;

/// Whether the gathers serve a layout of `bpv` byte stages: 2 or 3 (one
/// stage's eight rows fit no 16-byte load without reading past the group).
pub fn serves(bpv: usize) -> bool {
    (2..=3).contains(&bpv)
}

/// `y[i] = Σ_b fma(n_b(r0+i), d_b, ·)` (unscaled, as `avx2::vq_fast_rows32`)
/// for rows `r0..r0 + y.len()`, both multiples of 32, over the wide table
/// `q` (`table_len` codes, `i16` little-endian, and at least 2 more bytes
/// after them: a gather reads 4 bytes at its code); `d` the table's block
/// scales.
///
/// # Safety
/// AVX2 and FMA. The layout blocked with `block % 32 == 0`, 2 or 3 byte
/// stages ([`serves`]); `idx` holds the layout's index bytes.
pub unsafe fn rows32(lay: &VqLayout, idx: &[u8], d: &[f32], q: &[u8], r0: usize, y: &mut [f32]) {
    assert!(q.len() >= 2 * lay.table_len() + 2, "a wide table and its 2 bytes of padding");
    assert!(d.len() >= lay.nvec.div_ceil(QBLOCK) && y.len().is_multiple_of(32) && r0.is_multiple_of(32));
    assert!(idx.len() >= lay.index_bytes() && r0 + y.len() <= lay.rows);
    debug_assert!(lay.stages == lay.bpv() && !lay.packed6 && lay.block.is_multiple_of(32));
    // SAFETY: the caller's contract; sizes asserted.
    unsafe {
        match lay.bpv() {
            3 => body::<3>(lay, idx, d, q, r0, y),
            2 => body::<2>(lay, idx, d, q, r0, y),
            b => unreachable!("the gathers serve 2 or 3 byte stages, not {b}"),
        }
    }
}

/// Offset of the second 16-byte load of eight rows' `8 · BPV` index bytes
/// (rows 4–7 in the high lane): as late as keeps the load inside them.
const fn high(bpv: usize) -> usize {
    8 * bpv - 16
}

/// The `pshufb` masks that put stage `s`'s index byte of eight rows in the
/// low byte of their dword lanes (zeros above), from the two loads of
/// [`high`].
#[inline]
#[target_feature(enable = "avx2")]
fn masks<const BPV: usize>() -> [__m256i; BPV] {
    core::array::from_fn(|s| {
        let mut b = [0x80u8; 32];
        for i in 0..4 {
            b[4 * i] = (BPV * i + s) as u8;
            b[16 + 4 * i] = (4 * BPV + BPV * i + s - high(BPV)) as u8;
        }
        // SAFETY: 32 bytes.
        unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) }
    })
}

/// [`rows32`] for `BPV` byte stages.
///
/// # Safety
/// As [`rows32`].
#[target_feature(enable = "avx2,fma")]
unsafe fn body<const BPV: usize>(lay: &VqLayout, idx: &[u8], d: &[f32], q: &[u8], r0: usize, y: &mut [f32]) {
    let ms = masks::<BPV>();
    let vstride = lay.vstride();
    let groups = y.len() / 32;
    let mut t0 = 0;
    while t0 < lay.nvec {
        let t1 = (t0 + TILE).min(lay.nvec);
        for g in 0..groups {
            let base = lay.offset(r0 + 32 * g, 0);
            // the indices read next: the next group's in this tile, or the
            // first group's in the next (a hint: never faults)
            let next =
                if g + 1 < groups { lay.offset(r0 + 32 * (g + 1), 0) } else { lay.offset(r0, 0) + TILE * vstride };
            let ys = y.as_mut_ptr().wrapping_add(32 * g);
            let mut acc = [_mm256_setzero_ps(); 4];
            if t0 > 0 {
                // SAFETY: 32g + 32 <= y.len().
                acc = core::array::from_fn(|k| unsafe { _mm256_loadu_ps(ys.add(8 * k)) });
            }
            let mut v = t0;
            while v < t1 {
                let ve = (v + QBLOCK).min(t1);
                let mut n = [_mm256_setzero_si256(); 4];
                for vi in v..ve {
                    let pn = idx.as_ptr().wrapping_add(next + vi * vstride);
                    _mm_prefetch::<_MM_HINT_T0>(pn as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(pn.wrapping_add(32 * BPV - 1) as *const i8);
                    let p = idx.as_ptr().wrapping_add(base + vi * vstride);
                    for (k, nk) in n.iter_mut().enumerate() {
                        let e = 8 * BPV * k;
                        // SAFETY: bytes e .. e + 8·BPV of the group's 32·BPV at this position (asserted by the caller).
                        let z = unsafe {
                            _mm256_loadu2_m128i(p.add(e + high(BPV)) as *const __m128i, p.add(e) as *const __m128i)
                        };
                        for (s, m) in ms.iter().enumerate() {
                            let iv = _mm256_shuffle_epi8(z, *m);
                            let tb = q.as_ptr().wrapping_add(2 * 256 * (vi * BPV + s)) as *const i32;
                            // SAFETY: (vi, s)'s 256 wide codes and the 2 bytes after the last are inside `q` (asserted).
                            *nk = _mm256_add_epi32(*nk, unsafe { _mm256_i32gather_epi32::<2>(tb, iv) });
                        }
                    }
                }
                let db = _mm256_set1_ps(d[v / QBLOCK]);
                for (a, nk) in acc.iter_mut().zip(n) {
                    let s = _mm256_srai_epi32::<16>(_mm256_slli_epi32::<16>(nk));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), db, *a);
                }
                v = ve;
            }
            for (k, a) in acc.iter().enumerate() {
                // SAFETY: 32g + 8k + 8 <= y.len().
                unsafe { _mm256_storeu_ps(ys.add(8 * k), *a) };
            }
        }
        t0 = t1;
    }
}
