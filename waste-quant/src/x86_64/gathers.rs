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

/// One position of a 32-row group: prefetch the next group's index bytes
/// at `next` (a hint: never faults), then `look(k, s, iv)` for each eight
/// rows `8k..8k + 8` and stage `s`, `iv` their stage-`s` index bytes in the
/// low bytes of dword lanes (rows in order), from the group's `32 · BPV`
/// bytes at `at`.
///
/// # Safety
/// AVX2; `idx[at..at + 32 · BPV]` in bounds.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn each_index<const BPV: usize>(
    idx: &[u8],
    ms: &[__m256i; BPV],
    at: usize,
    next: usize,
    mut look: impl FnMut(usize, usize, __m256i),
) {
    let pn = idx.as_ptr().wrapping_add(next);
    _mm_prefetch::<_MM_HINT_T0>(pn as *const i8);
    _mm_prefetch::<_MM_HINT_T0>(pn.wrapping_add(32 * BPV - 1) as *const i8);
    let p = idx.as_ptr().wrapping_add(at);
    for k in 0..4 {
        let e = 8 * BPV * k;
        // SAFETY: bytes e .. e + 8·BPV of the group's 32·BPV at `at` (the caller's bound).
        let z = unsafe { _mm256_loadu2_m128i(p.add(e + high(BPV)) as *const __m128i, p.add(e) as *const __m128i) };
        for (s, m) in ms.iter().enumerate() {
            look(k, s, _mm256_shuffle_epi8(z, *m));
        }
    }
}

/// Where the indices read after 32-row group `g` (of `groups` from row
/// `r0`) start, for the prefetch hint: the next group's in this tile of
/// `tile` positions, or the first group's in the next tile (a hint: past
/// the end it never faults).
#[inline]
fn next_indices(lay: &VqLayout, r0: usize, g: usize, groups: usize, tile: usize) -> usize {
    if g + 1 < groups {
        lay.offset(r0 + 32 * (g + 1), 0)
    } else {
        lay.offset(r0, 0) + tile * lay.vstride()
    }
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
        // the next tile's codes, a share of them each group (a hint: in a
        // decode step each expert's indices pass through L2 between the
        // lanes' reads of the shared gate and up tables; 1024 × 2304 rows
        // 0.193 → 0.188 ms, docs/lab entry 78)
        let (n0, n1) = (2 * 256 * BPV * t1, 2 * 256 * BPV * (t1 + TILE).min(lay.nvec));
        let per_group = (n1 - n0).div_ceil(64).div_ceil(groups.max(1)) * 64;
        for g in 0..groups {
            let pf = n0 + g * per_group;
            let mut o = pf;
            while o < (pf + per_group).min(n1) {
                _mm_prefetch::<_MM_HINT_T0>(q.as_ptr().wrapping_add(o) as *const i8);
                o += 64;
            }
            let base = lay.offset(r0 + 32 * g, 0);
            let next = next_indices(lay, r0, g, groups, TILE);
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
                    // SAFETY: the group's index bytes at vi are inside `idx` (asserted by the caller).
                    unsafe {
                        each_index(idx, &ms, base + vi * vstride, next + vi * vstride, |k, s, iv| {
                            let tb = q.as_ptr().wrapping_add(2 * 256 * (vi * BPV + s)) as *const i32;
                            // SAFETY: (vi, s)'s 256 wide codes and the 2 bytes after the last are inside `q` (asserted).
                            n[k] = _mm256_add_epi32(n[k], _mm256_i32gather_epi32::<2>(tb, iv));
                        })
                    };
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

/// Vector positions per tile of [`rows32_pair`]: two blocks, their two
/// tables' codes side by side (8 × 3 stages × 256 dwords = 24 KiB, in L1).
const PAIR_TILE: usize = 8;

/// [`rows32`] for two inputs' tables at once, over the same rows and
/// indices: `ys[j]` from the plain table `qs[j]` (one `i8` code an entry,
/// `table_len` of them) with block scales `ds[j]`. Each tile's codes of the
/// two tables are widened and laid side by side (one dword an entry: the
/// first table's code in the low half, the second's in the high one), so
/// one gather does eight rows' lookups for both inputs; the lanes add as
/// 16-bit halves (a block's sums fit), each half sign-extended once a
/// block. Every output is bit-identical to [`rows32`] on its table alone:
/// the same exact integer a block, the same float steps in the same order.
/// One input's rows take the same table twice (an output to discard): the
/// cost of one gather pass over plain codes.
///
/// # Safety
/// As [`rows32`], for both tables (plain, not wide).
pub unsafe fn rows32_pair(lay: &VqLayout, idx: &[u8], ds: [&[f32]; 2], qs: [&[u8]; 2], r0: usize, ys: [&mut [f32]; 2]) {
    check_plain(lay, idx, &ds, &qs, r0, &ys);
    // SAFETY: the caller's contract; sizes asserted.
    unsafe {
        match lay.bpv() {
            3 => pair_body::<3>(lay, idx, ds, qs, r0, ys),
            2 => pair_body::<2>(lay, idx, ds, qs, r0, ys),
            b => unreachable!("the gathers serve 2 or 3 byte stages, not {b}"),
        }
    }
}

/// The bounds [`rows32_pair`] and [`rows32_quad`] rely on: `N` outputs of
/// the same whole 32-row groups from `r0`, `N` plain tables and their block
/// scales, the layout's index bytes.
fn check_plain<const N: usize>(
    lay: &VqLayout,
    idx: &[u8],
    ds: &[&[f32]; N],
    qs: &[&[u8]; N],
    r0: usize,
    ys: &[&mut [f32]; N],
) {
    let n = ys[0].len();
    assert!(ys.iter().all(|y| y.len() == n), "{N} outputs of the same rows");
    for (d, q) in ds.iter().zip(qs) {
        assert!(q.len() >= lay.table_len(), "a plain table");
        assert!(d.len() >= lay.nvec.div_ceil(QBLOCK));
    }
    assert!(n.is_multiple_of(32) && r0.is_multiple_of(32));
    assert!(idx.len() >= lay.index_bytes() && r0 + n <= lay.rows);
    debug_assert!(lay.stages == lay.bpv() && !lay.packed6 && lay.block.is_multiple_of(32));
}

/// The tile's codes of two plain tables widened side by side: `w[e] =
/// (a[e] as i16) | (b[e] as i16) << 16` for the `w.len()` codes from code
/// `c0`.
///
/// # Safety
/// AVX2; `c0 + w.len()` codes inside both tables, `w.len()` a multiple of 16.
#[target_feature(enable = "avx2")]
unsafe fn interleave(qa: &[u8], qb: &[u8], c0: usize, w: &mut [u32]) {
    debug_assert!(w.len().is_multiple_of(16) && c0 + w.len() <= qa.len().min(qb.len()));
    let (pa, pb) = (qa.as_ptr().wrapping_add(c0), qb.as_ptr().wrapping_add(c0));
    for (i, o) in w.chunks_exact_mut(16).enumerate() {
        // SAFETY: 16 codes (16 bytes) at code c0 + 16i of each table (the caller's bound); 16 dwords out.
        unsafe {
            let a = _mm256_cvtepi8_epi16(_mm_loadu_si128(pa.add(16 * i) as *const __m128i));
            let b = _mm256_cvtepi8_epi16(_mm_loadu_si128(pb.add(16 * i) as *const __m128i));
            let (lo, hi) = (_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b));
            let op = o.as_mut_ptr() as *mut __m256i;
            _mm256_storeu_si256(op, _mm256_permute2x128_si256::<0x20>(lo, hi));
            _mm256_storeu_si256(op.add(1), _mm256_permute2x128_si256::<0x31>(lo, hi));
        }
    }
}

/// [`rows32_pair`] for `BPV` byte stages.
///
/// # Safety
/// As [`rows32_pair`].
#[target_feature(enable = "avx2,fma")]
unsafe fn pair_body<const BPV: usize>(
    lay: &VqLayout,
    idx: &[u8],
    ds: [&[f32]; 2],
    qs: [&[u8]; 2],
    r0: usize,
    ys: [&mut [f32]; 2],
) {
    let ms = masks::<BPV>();
    let vstride = lay.vstride();
    let per_v = BPV * 256;
    let groups = ys[0].len() / 32;
    let [ya, yb] = ys;
    let mut w = vec![0u32; PAIR_TILE * per_v];
    let mut t0 = 0;
    while t0 < lay.nvec {
        let t1 = (t0 + PAIR_TILE).min(lay.nvec);
        let wl = (t1 - t0) * per_v;
        // SAFETY: positions t0..t1's codes are inside both tables (asserted by the caller); wl is a multiple of 256.
        unsafe { interleave(qs[0], qs[1], t0 * per_v, &mut w[..wl]) };
        for g in 0..groups {
            let base = lay.offset(r0 + 32 * g, 0);
            let next = next_indices(lay, r0, g, groups, PAIR_TILE);
            let (pa, pb) = (ya.as_mut_ptr().wrapping_add(32 * g), yb.as_mut_ptr().wrapping_add(32 * g));
            let mut acc = [[_mm256_setzero_ps(); 4]; 2];
            if t0 > 0 {
                // SAFETY: 32g + 32 <= the outputs' length.
                acc = [
                    core::array::from_fn(|k| unsafe { _mm256_loadu_ps(pa.add(8 * k)) }),
                    core::array::from_fn(|k| unsafe { _mm256_loadu_ps(pb.add(8 * k)) }),
                ];
            }
            let mut v = t0;
            while v < t1 {
                let ve = (v + QBLOCK).min(t1);
                let mut n = [_mm256_setzero_si256(); 4];
                for vi in v..ve {
                    // SAFETY: the group's index bytes at vi are inside `idx` (asserted by the caller).
                    unsafe {
                        each_index(idx, &ms, base + vi * vstride, next + vi * vstride, |k, s, iv| {
                            let tb = w.as_ptr().wrapping_add((vi - t0) * per_v + 256 * s) as *const i32;
                            // SAFETY: (vi, s)'s 256 side-by-side codes are inside the tile.
                            n[k] = _mm256_add_epi16(n[k], _mm256_i32gather_epi32::<4>(tb, iv));
                        })
                    };
                }
                let (da, db) = (_mm256_set1_ps(ds[0][v / QBLOCK]), _mm256_set1_ps(ds[1][v / QBLOCK]));
                for (k, nk) in n.iter().enumerate() {
                    let lo = _mm256_srai_epi32::<16>(_mm256_slli_epi32::<16>(*nk));
                    let hi = _mm256_srai_epi32::<16>(*nk);
                    acc[0][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), da, acc[0][k]);
                    acc[1][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), db, acc[1][k]);
                }
                v = ve;
            }
            for k in 0..4 {
                // SAFETY: 32g + 8k + 8 <= the outputs' length.
                unsafe {
                    _mm256_storeu_ps(pa.add(8 * k), acc[0][k]);
                    _mm256_storeu_ps(pb.add(8 * k), acc[1][k]);
                }
            }
        }
        t0 = t1;
    }
}

/// Vector positions per tile of [`rows32_quad`]: one block, its four
/// tables' codes side by side (4 × 3 stages × 256 qwords = 24 KiB, in L1).
const QUAD_TILE: usize = QBLOCK;

/// [`rows32_pair`] for four inputs: each tile's codes of the four plain
/// tables widened side by side, one qword an entry (input `j`'s code in
/// its 16-bit quarter `j`), so one `vpgatherdq` does four rows' lookups for
/// all four inputs (four lanes: on the Intel Xeon of docs/lab entry 75 a
/// 4-lane qword gather takes 2.1 reference cycles against the 8-lane dword
/// gather's 3.4, so a lookup costs 0.13 against a pair's 0.21). The
/// quarters add as 16-bit lanes; a block's four sums per row come out by
/// `vpmaddwd` against a one-hot pattern (exact: each code times 1). Every
/// output is bit-identical to [`rows32`] on its table alone. Three inputs
/// take the third's table twice (an output to discard).
///
/// # Safety
/// As [`rows32`], for all four tables (plain, not wide).
pub unsafe fn rows32_quad(lay: &VqLayout, idx: &[u8], ds: [&[f32]; 4], qs: [&[u8]; 4], r0: usize, ys: [&mut [f32]; 4]) {
    check_plain(lay, idx, &ds, &qs, r0, &ys);
    // SAFETY: the caller's contract; sizes asserted.
    unsafe {
        match lay.bpv() {
            3 => quad_body::<3>(lay, idx, ds, qs, r0, ys),
            2 => quad_body::<2>(lay, idx, ds, qs, r0, ys),
            b => unreachable!("the gathers serve 2 or 3 byte stages, not {b}"),
        }
    }
}

/// The tile's codes of four plain tables widened side by side: qword `e`
/// of `w` holds code `c0 + e` of table `j` in its 16-bit quarter `j`.
///
/// # Safety
/// AVX2; `c0 + w.len()` codes inside every table, `w.len()` a multiple of 16.
#[target_feature(enable = "avx2")]
unsafe fn interleave4(qs: [&[u8]; 4], c0: usize, w: &mut [u64]) {
    debug_assert!(w.len().is_multiple_of(16) && qs.iter().all(|q| c0 + w.len() <= q.len()));
    let ps = qs.map(|q| q.as_ptr().wrapping_add(c0));
    for (i, o) in w.chunks_exact_mut(16).enumerate() {
        // SAFETY: 16 codes (16 bytes) at code c0 + 16i of each table (the caller's bound); 16 qwords out.
        unsafe {
            let [a, b, c, d] = ps.map(|p| _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(16 * i) as *const __m128i)));
            // dwords (a, b) and (c, d) of entries 0–3 | 8–11 (lo) and 4–7 | 12–15 (hi)
            let (ab_lo, ab_hi) = (_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b));
            let (cd_lo, cd_hi) = (_mm256_unpacklo_epi16(c, d), _mm256_unpackhi_epi16(c, d));
            // qwords (a, b, c, d): entries 0,1 | 8,9; 2,3 | 10,11; 4,5 | 12,13; 6,7 | 14,15
            let x0 = _mm256_unpacklo_epi32(ab_lo, cd_lo);
            let x1 = _mm256_unpackhi_epi32(ab_lo, cd_lo);
            let x2 = _mm256_unpacklo_epi32(ab_hi, cd_hi);
            let x3 = _mm256_unpackhi_epi32(ab_hi, cd_hi);
            let op = o.as_mut_ptr() as *mut __m256i;
            _mm256_storeu_si256(op, _mm256_permute2x128_si256::<0x20>(x0, x1));
            _mm256_storeu_si256(op.add(1), _mm256_permute2x128_si256::<0x20>(x2, x3));
            _mm256_storeu_si256(op.add(2), _mm256_permute2x128_si256::<0x31>(x0, x1));
            _mm256_storeu_si256(op.add(3), _mm256_permute2x128_si256::<0x31>(x2, x3));
        }
    }
}

/// The four inputs' sums of eight rows as `i32` lanes (rows in order),
/// from `lo` (rows 0–3) and `hi` (rows 4–7), each a qword a row of four
/// 16-bit sums.
#[inline]
#[target_feature(enable = "avx2")]
fn quad_sums(lo: __m256i, hi: __m256i) -> [__m256i; 4] {
    // per row, dwords (input 0, input 2) and (input 1, input 3): exact products by 1
    let even = _mm256_set1_epi64x(0x0000_0001_0000_0001);
    let odd = _mm256_set1_epi64x(0x0001_0000_0001_0000);
    let (e_lo, e_hi) = (_mm256_madd_epi16(lo, even), _mm256_madd_epi16(hi, even));
    let (o_lo, o_hi) = (_mm256_madd_epi16(lo, odd), _mm256_madd_epi16(hi, odd));
    // lanes of rows 0 1 4 5 | 2 3 6 7, then qwords back in row order
    let pick = |a: __m256i, b: __m256i, second: bool| {
        let (a, b) = (_mm256_castsi256_ps(a), _mm256_castsi256_ps(b));
        let s = if second { _mm256_shuffle_ps::<0xDD>(a, b) } else { _mm256_shuffle_ps::<0x88>(a, b) };
        _mm256_permute4x64_epi64::<0xD8>(_mm256_castps_si256(s))
    };
    [pick(e_lo, e_hi, false), pick(o_lo, o_hi, false), pick(e_lo, e_hi, true), pick(o_lo, o_hi, true)]
}

/// [`rows32_quad`] for `BPV` byte stages.
///
/// # Safety
/// As [`rows32_quad`].
#[target_feature(enable = "avx2,fma")]
unsafe fn quad_body<const BPV: usize>(
    lay: &VqLayout,
    idx: &[u8],
    ds: [&[f32]; 4],
    qs: [&[u8]; 4],
    r0: usize,
    ys: [&mut [f32]; 4],
) {
    let ms = masks::<BPV>();
    let vstride = lay.vstride();
    let per_v = BPV * 256;
    let groups = ys[0].len() / 32;
    let ps = ys.map(|y| y.as_mut_ptr());
    let mut w = vec![0u64; QUAD_TILE * per_v];
    let mut t0 = 0;
    while t0 < lay.nvec {
        let t1 = (t0 + QUAD_TILE).min(lay.nvec);
        // SAFETY: positions t0..t1's codes are inside every table (asserted by the caller); a multiple of 256.
        unsafe { interleave4(qs, t0 * per_v, &mut w[..(t1 - t0) * per_v]) };
        let dv = ds.map(|d| _mm256_set1_ps(d[t0 / QBLOCK]));
        for g in 0..groups {
            let base = lay.offset(r0 + 32 * g, 0);
            let next = next_indices(lay, r0, g, groups, QUAD_TILE);
            // rows 8k..8k+3 in n[2k], 8k+4..8k+7 in n[2k+1]
            let mut n = [_mm256_setzero_si256(); 8];
            for vi in t0..t1 {
                // SAFETY: the group's index bytes at vi are inside `idx` (asserted by the caller).
                unsafe {
                    each_index(idx, &ms, base + vi * vstride, next + vi * vstride, |k, s, iv| {
                        let tb = w.as_ptr().wrapping_add((vi - t0) * per_v + 256 * s) as *const i64;
                        // SAFETY: (vi, s)'s 256 side-by-side codes are inside the tile.
                        let lo = _mm256_i32gather_epi64::<8>(tb, _mm256_castsi256_si128(iv));
                        let hi = _mm256_i32gather_epi64::<8>(tb, _mm256_extracti128_si256::<1>(iv));
                        n[2 * k] = _mm256_add_epi16(n[2 * k], lo);
                        n[2 * k + 1] = _mm256_add_epi16(n[2 * k + 1], hi);
                    })
                };
            }
            for k in 0..4 {
                let sums = quad_sums(n[2 * k], n[2 * k + 1]);
                for j in 0..4 {
                    let yp = ps[j].wrapping_add(32 * g + 8 * k);
                    // SAFETY: 32g + 8k + 8 <= the outputs' length.
                    unsafe {
                        let a = if t0 > 0 { _mm256_loadu_ps(yp) } else { _mm256_setzero_ps() };
                        _mm256_storeu_ps(yp, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), dv[j], a));
                    }
                }
            }
        }
        t0 = t1;
    }
}
