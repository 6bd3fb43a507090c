//! AVX-512 (F/BW/VL, with AVX2 + FMA + F16C) kernels: the trunk matvec.
//!
//! Same canonical order as `scalar.rs`: column `j` accumulates into lane
//! `j mod 32` with a fused multiply-add (lanes 0–15 in one register, 16–31
//! in another), then the halving reduction. What changes is how the work is
//! arranged: Q4G's rows go [`ROWS_Q4`] per pass sharing each 32-column block
//! of the input (loaded once instead of once per row), the format is resolved at compile
//! time, f16 scales convert in hardware, and Q4G weights come from a
//! 16-entry in-register table `(i − 8) · scale` indexed by the nibbles — the
//! same product the scalar definition computes per weight, so the results
//! are bit-identical to every other level.

use crate::matrix::MatRef;
use crate::scalar::LANES;
use core::arch::x86_64::*;
use waste_format::Fmt;

/// Rows per pass of [`rows_dot`]: two, taken from the two halves of the
/// call's rows (row `i` with row `half + i`), so the pass reads two
/// sequential streams that each run on into their next row, as the
/// hardware prefetcher follows them, and keeps two independent FMA chains.
/// Adjacent rows per pass read as many short interleaved streams and ran at
/// about half the memory speed on the Q8G LM head; one row per pass ran
/// 18–40 % slower than two halves' from DRAM (docs/lab/2026-12-01-30-matvec-streams-the-pool-s-per-call-cost-byte.md, "Matvec
/// streams" and "Two streams per pass").
const ROWS: usize = 2;
/// Rows per pass of [`rows_dot_q4`]: Q4G is compute-bound on one row's
/// chain, so four rows share the input, and the next group is prefetched
/// in address order ([`PREFETCH_GROUPS`]).
const ROWS_Q4: usize = 4;

/// How many row groups ahead [`rows_dot_q4`] prefetches. A pass reads its
/// N rows as N interleaved streams that each end after one row (1152 bytes
/// for a 2304-wide Q4G matrix), too short for the hardware prefetcher to
/// follow; prefetching the rows after them in address order, at the pace
/// this group is read, brings the matvec near memory speed (one group
/// ahead measured best of 1, 2, 4: docs/lab/2026-12-01-30-matvec-streams-the-pool-s-per-call-cost-byte.md, "Matvec streams").
const PREFETCH_GROUPS: usize = 1;

/// Prefetch the cache lines of `len` bytes at `p` (a hint: never faults,
/// any address).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn prefetch_lines(p: *const u8, len: usize) {
    let mut o = 0;
    while o < len {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8);
        o += 64;
    }
}

const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;
const Q8G: u8 = 3;
const Q4G: u8 = 4;

/// The canonical halving reduction of 32 lanes held as (0–15, 16–31).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn reduce(lo: __m512, hi: __m512) -> f32 {
    let h = _mm512_add_ps(lo, hi); // i + i+16
    let top = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(h)));
    let s = _mm256_add_ps(_mm512_castps512_ps256(h), top); // i + i+8
    let c = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s)); // i + i+4
    let d = _mm_add_ps(c, _mm_movehl_ps(c, c)); // i + i+2
    let e = _mm_add_ss(d, _mm_shuffle_ps::<1>(d, d)); // 0 + 1
    _mm_cvtss_f32(e)
}

/// f16 bits to f32 in hardware (exact, as the software conversion).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn f16(h: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Q4G's in-register table for one group: entry `i` is `(i − 8) · scale`,
/// the product the scalar definition computes per weight.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn q4_table(scale: f32) -> __m512 {
    let steps = _mm512_setr_ps(-8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.);
    _mm512_mul_ps(steps, _mm512_set1_ps(scale))
}

/// Accumulators of the nibble-order kernels — canonical lanes 0, 2, … 30
/// in `e`, 1, 3, … 31 in `o` — back in canonical order (0..16, 16..32).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn canonical_lanes(e: __m512, o: __m512) -> (__m512, __m512) {
    let lo_ix = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let hi_ix = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    (_mm512_permutex2var_ps(e, lo_ix, o), _mm512_permutex2var_ps(e, hi_ix, o))
}

/// The 32 weights of row bytes `rb` at column `c` as (columns c..c+16,
/// c+16..c+32). `tab` is Q4G's `(i − 8) · scale` table, `scale` Q8G's scale.
///
/// # Safety
/// The row holds columns `c..c+32`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load32<const FMT: u8>(rb: *const u8, c: usize, scale: f32, tab: __m512) -> (__m512, __m512) {
    // SAFETY (all arms): the caller guarantees the row holds columns c..c+32.
    unsafe {
        match FMT {
            F32 => {
                let p = rb.add(c * 4) as *const f32;
                (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)))
            }
            F16 => {
                let p = rb.add(c * 2) as *const __m256i;
                (_mm512_cvtph_ps(_mm256_loadu_si256(p)), _mm512_cvtph_ps(_mm256_loadu_si256(p.add(1))))
            }
            BF16 => {
                let p = rb.add(c * 2) as *const __m256i;
                let cv = |q: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(q)));
                (cv(_mm256_loadu_si256(p)), cv(_mm256_loadu_si256(p.add(1))))
            }
            Q8G => {
                let p = rb.add(c) as *const __m128i;
                let s = _mm512_set1_ps(scale);
                let cv = |q: __m128i| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s);
                (cv(_mm_loadu_si128(p)), cv(_mm_loadu_si128(p.add(1))))
            }
            _ => {
                // Q4G: column 2i is the low nibble of byte i, 2i+1 the high one
                let b = _mm_loadu_si128(rb.add(c / 2) as *const __m128i);
                let m = _mm_set1_epi8(0x0f);
                let lo = _mm_and_si128(b, m);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), m);
                let e0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
                let e1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));
                (_mm512_permutexvar_ps(e0, tab), _mm512_permutexvar_ps(e1, tab))
            }
        }
    }
}

/// `out[k] = W[rs[k]] · x` for `k < N`: each 32-column block of `x` is
/// loaded once for the N rows, and each row's stream is prefetched ahead.
///
/// # Safety
/// `m` checked, `x.len() == m.cols`, every row of `rs` exists, fused
/// layout (ungrouped or `group % 32 == 0`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn rows_dot<const N: usize, const FMT: u8>(m: &MatRef<'_>, rs: [usize; N], x: &[f32], out: &mut [f32]) {
    let rbs = m.row_bytes();
    let g = m.groups();
    let rows: [&[u8]; N] = core::array::from_fn(|k| &m.data[rs[k] * rbs..(rs[k] + 1) * rbs]);
    let mut acc = [[_mm512_setzero_ps(); 2]; N];
    let full = m.cols / LANES * LANES;
    let steps = _mm512_setr_ps(-8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.);
    let grouped = FMT == Q8G || FMT == Q4G;
    // each row's scale (and Q4G table), converted once per group, not once per 32-column block
    let mut scale = [0f32; N];
    let mut tab = [steps; N];
    // group by group (no division per block); an ungrouped format is one group
    let gstep = if grouped { m.group } else { full };
    let mut c = 0;
    while c < full {
        let gend = (c + gstep).min(full);
        if grouped {
            for k in 0..N {
                scale[k] = f16(m.scales[rs[k] * g + c / m.group]);
                if FMT == Q4G {
                    tab[k] = q4_table(scale[k]);
                }
            }
        }
        while c < gend {
            // each row is one long stream that goes on into its next row:
            // fetch ahead of it
            let (off, len) = match FMT {
                F32 => (4 * c, 128),
                F16 | BF16 => (2 * c, 64),
                _ => (c, 32),
            };
            for row in rows {
                super::prefetch_ahead(row.as_ptr(), off, len);
            }
            // SAFETY: c + 32 <= cols = x.len().
            let (xl, xh) = unsafe { (_mm512_loadu_ps(x.as_ptr().add(c)), _mm512_loadu_ps(x.as_ptr().add(c + 16))) };
            for k in 0..N {
                // SAFETY: c + 32 <= cols, within the row.
                let (wl, wh) = unsafe { load32::<FMT>(rows[k].as_ptr(), c, scale[k], tab[k]) };
                acc[k][0] = _mm512_fmadd_ps(wl, xl, acc[k][0]);
                acc[k][1] = _mm512_fmadd_ps(wh, xh, acc[k][1]);
            }
            c += LANES;
        }
    }
    for k in 0..N {
        let [lo, hi] = acc[k];
        // SAFETY: features enabled on this function; row rs[k] exists.
        let (lo, hi) = unsafe { tail_fma(m, rs[k], full, x, lo, hi) };
        out[k] = reduce(lo, hi);
    }
}

/// The zero-padded last partial block of row `r` (columns `full..cols`)
/// into the canonical lanes `lo` (0..16) and `hi` (16..32).
///
/// # Safety
/// AVX-512 F; `m` checked, row `r` exists, `x.len() == m.cols`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tail_fma(m: &MatRef<'_>, r: usize, full: usize, x: &[f32], lo: __m512, hi: __m512) -> (__m512, __m512) {
    if full == m.cols {
        return (lo, hi);
    }
    let mut wt = [0f32; LANES];
    let mut xt = [0f32; LANES];
    let n = m.cols - full;
    m.dequant(r, full, &mut wt[..n]);
    xt[..n].copy_from_slice(&x[full..]);
    // SAFETY: both tails are 32 floats.
    unsafe {
        (
            _mm512_fmadd_ps(_mm512_loadu_ps(wt.as_ptr()), _mm512_loadu_ps(xt.as_ptr()), lo),
            _mm512_fmadd_ps(_mm512_loadu_ps(wt.as_ptr().add(16)), _mm512_loadu_ps(xt.as_ptr().add(16)), hi),
        )
    }
}

/// Q4G rows in nibble order: byte k of a 32-column block holds columns 2k
/// (low nibble) and 2k+1 (high nibble), so zero-extending the 16 bytes to
/// 32-bit lanes and looking the low 4 bits up gives the even columns, a
/// 4-bit shift the odd ones — no unpacking. `xe`/`xo` are `x`'s even and odd
/// columns per block (`xe[16b + k] = x[32b + 2k]`); the accumulators hold
/// the canonical lanes 0, 2, … 30 and 1, 3, … 31 and are interleaved back
/// before the canonical reduction, so every lane sees the same fused
/// multiply-adds in the same order.
///
/// # Safety
/// As [`rows_dot`], Q4G with `group % 32 == 0`, `xe.len() == xo.len() ==
/// 16 · (cols / 32)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn rows_dot_q4<const N: usize>(m: &MatRef<'_>, r0: usize, x: &[f32], xe: &[f32], xo: &[f32], out: &mut [f32]) {
    let rbs = m.row_bytes();
    let g = m.groups();
    let rows: [&[u8]; N] = core::array::from_fn(|k| &m.data[(r0 + k) * rbs..(r0 + k + 1) * rbs]);
    let mut acc = [[_mm512_setzero_ps(); 2]; N];
    let full = m.cols / LANES * LANES;
    let steps = _mm512_setr_ps(-8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.);
    let mut tabs = [steps; N];
    let ahead = m.data.as_ptr().wrapping_add((r0 + N * PREFETCH_GROUPS) * rbs);
    let mut c = 0;
    // the next group's first column (no division per block)
    let mut next_group = 0;
    while c < full {
        let b = c / 2;
        // the next row group, in address order, at the pace this one is read
        prefetch_lines(ahead.wrapping_add(b * N), N * LANES / 2);
        // SAFETY: b + 16 <= xe.len() = xo.len() (16 per full block).
        let (xl, xh) = unsafe { (_mm512_loadu_ps(xe.as_ptr().add(b)), _mm512_loadu_ps(xo.as_ptr().add(b))) };
        if c == next_group {
            next_group += m.group;
            // each row's table, built once per group
            for k in 0..N {
                tabs[k] = q4_table(f16(m.scales[(r0 + k) * g + c / m.group]));
            }
        }
        for k in 0..N {
            let tab = tabs[k];
            // SAFETY: the row holds bytes c/2 .. c/2 + 16.
            let dw = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(rows[k].as_ptr().add(b) as *const __m128i)) };
            let we = _mm512_permutexvar_ps(dw, tab);
            let wo = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(dw), tab);
            acc[k][0] = _mm512_fmadd_ps(we, xl, acc[k][0]);
            acc[k][1] = _mm512_fmadd_ps(wo, xh, acc[k][1]);
        }
        c += LANES;
    }
    for k in 0..N {
        let (lo, hi) = canonical_lanes(acc[k][0], acc[k][1]);
        // SAFETY: features enabled on this function; row r0 + k exists.
        let (lo, hi) = unsafe { tail_fma(m, r0 + k, full, x, lo, hi) };
        out[k] = reduce(lo, hi);
    }
}

thread_local! {
    /// `x` split into even and odd columns per 32-column block (Q4G).
    static SPLIT_X: core::cell::RefCell<Vec<f32>> = const { core::cell::RefCell::new(Vec::new()) };
}

/// `x`'s full 32-column blocks split into even and odd columns, as
/// [`rows_dot_q4`] and [`tile_dot_q4`] read them: `xe[16b + k] = x[32b +
/// 2k]`, `xo[16b + k] = x[32b + 2k + 1]` (two permutes per block).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn split_even_odd(x: &[f32], xe: &mut [f32], xo: &mut [f32]) {
    let blocks = xe.len() / 16;
    assert!(xo.len() == xe.len() && x.len() >= 32 * blocks);
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for b in 0..blocks {
        // SAFETY: 32b + 32 <= x.len(), 16b + 16 <= xe.len() = xo.len() (asserted).
        unsafe {
            let lo = _mm512_loadu_ps(x.as_ptr().add(32 * b));
            let hi = _mm512_loadu_ps(x.as_ptr().add(32 * b + 16));
            _mm512_storeu_ps(xe.as_mut_ptr().add(16 * b), _mm512_permutex2var_ps(lo, even, hi));
            _mm512_storeu_ps(xo.as_mut_ptr().add(16 * b), _mm512_permutex2var_ps(lo, odd, hi));
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn matvec_q4(m: &MatRef<'_>, x: &[f32], row0: usize, y: &mut [f32]) {
    let half = m.cols / LANES * LANES / 2;
    SPLIT_X.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.clear();
        buf.resize(2 * half, 0.0);
        let (xe, xo) = buf.split_at_mut(half);
        split_even_odd(x, xe, xo);
        let mut i = 0;
        while i + ROWS_Q4 <= y.len() {
            // SAFETY: forwarded contract; rows row0+i..row0+i+ROWS_Q4 exist.
            unsafe { rows_dot_q4::<ROWS_Q4>(m, row0 + i, x, xe, xo, &mut y[i..i + ROWS_Q4]) };
            i += ROWS_Q4;
        }
        while i < y.len() {
            // SAFETY: as above, one row.
            unsafe { rows_dot_q4::<1>(m, row0 + i, x, xe, xo, &mut y[i..i + 1]) };
            i += 1;
        }
    });
}

/// Rows `row0..row0 + y.len()` in [`ROWS`] streams: pass `i` computes
/// row `row0 + k · part + i` for each stream `k` (`part = y.len() / ROWS`),
/// then the rows past `ROWS · part` one at a time.
///
/// # Safety
/// As [`rows_dot`] for rows `row0..row0 + y.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn matvec_fmt<const FMT: u8>(m: &MatRef<'_>, x: &[f32], row0: usize, y: &mut [f32]) {
    let part = y.len() / ROWS;
    for i in 0..part {
        let mut o = [0f32; ROWS];
        // SAFETY: forwarded contract; k · part + i < y.len() for every stream k.
        unsafe { rows_dot::<ROWS, FMT>(m, core::array::from_fn(|k| row0 + k * part + i), x, &mut o) };
        for (k, v) in o.into_iter().enumerate() {
            y[k * part + i] = v;
        }
    }
    for i in ROWS * part..y.len() {
        // SAFETY: as above, one row.
        unsafe { rows_dot::<1, FMT>(m, [row0 + i], x, &mut y[i..i + 1]) };
    }
}

/// AVX-512 version of [`MatRef::matvec_rows`].
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C; `m` must be a
/// checked view, `x.len() == m.cols`, `row0 + y.len() <= m.rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn matvec_rows(m: &MatRef<'_>, x: &[f32], row0: usize, y: &mut [f32]) {
    if m.fmt.is_grouped() && !m.group.is_multiple_of(LANES) {
        // SAFETY: AVX2 ⊂ this level; forwarded contract.
        return unsafe { super::avx2::matvec_rows(m, x, row0, y) };
    }
    // SAFETY (all arms): forwarded contract, layout fused (checked above).
    unsafe {
        match m.fmt {
            Fmt::F32 => matvec_fmt::<F32>(m, x, row0, y),
            Fmt::F16 => matvec_fmt::<F16>(m, x, row0, y),
            Fmt::Bf16 => matvec_fmt::<BF16>(m, x, row0, y),
            Fmt::Q8G => matvec_fmt::<Q8G>(m, x, row0, y),
            Fmt::Q4G => matvec_q4(m, x, row0, y),
        }
    }
}

/// Rows per tile of [`matmat_rows`].
const MM_ROWS: usize = 2;
/// Inputs per tile of [`matmat_rows`]: `MM_ROWS × MM_TOKENS` dots keep
/// their 32 canonical lanes in two registers each (16), the inputs' blocks
/// take 8 more, the weights 2 — within AVX-512's 32 registers. Measured
/// best of 1×8, 2×4, 2×5, 2×6, 3×3, 3×4, 4×2, 4×3 (docs/lab/).
const MM_TOKENS: usize = 4;

/// `out[k][t] = W[r0 + k] · xs[t]` for `k < R`, `t < T` (`xs` holds the
/// `T` inputs, `cols` floats each): every 32-column weight block is
/// dequantized once for the `T` inputs and every input block loaded once
/// for the `R` rows. Each dot sees the same fused multiply-adds in the same
/// lanes and order as [`rows_dot`] (and the scalar definition).
///
/// # Safety
/// As [`rows_dot`]; `xs.len() == T · cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tile_dot<const R: usize, const T: usize, const FMT: u8>(
    m: &MatRef<'_>,
    r0: usize,
    xs: &[f32],
    out: &mut [[f32; T]; R],
) {
    let rbs = m.row_bytes();
    let g = m.groups();
    let cols = m.cols;
    let rows: [&[u8]; R] = core::array::from_fn(|k| &m.data[(r0 + k) * rbs..(r0 + k + 1) * rbs]);
    let mut acc = [[[_mm512_setzero_ps(); 2]; T]; R];
    let full = cols / LANES * LANES;
    let steps = _mm512_setr_ps(-8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.);
    let grouped = FMT == Q8G || FMT == Q4G;
    // a row's bytes per 32-column block; the next tile's rows are
    // prefetched at the pace these are read (see tile_dot_q4)
    let block_bytes = match FMT {
        F32 => 128,
        F16 | BF16 => 64,
        Q8G => 32,
        _ => 16,
    };
    let ahead = m.data.as_ptr().wrapping_add((r0 + R) * rbs);
    let mut c = 0;
    while c < full {
        // each row's scale (and Q4G's table) once per group: the caller
        // guarantees groups of whole 32-column blocks
        let end = if grouped { ((c / m.group + 1) * m.group).min(full) } else { full };
        let scale: [f32; R] =
            core::array::from_fn(|k| if grouped { f16(m.scales[(r0 + k) * g + c / m.group]) } else { 0.0 });
        let tab: [__m512; R] = core::array::from_fn(|k| if FMT == Q4G { q4_table(scale[k]) } else { steps });
        while c < end {
            prefetch_lines(ahead.wrapping_add(R * (c / LANES) * block_bytes), R * block_bytes);
            // SAFETY: c + 32 <= cols; input t spans t·cols .. (t+1)·cols.
            let x = unsafe { input_halves::<T>(xs.as_ptr().add(c), cols, 16) };
            for k in 0..R {
                // SAFETY: c + 32 <= cols, within the row.
                let w = unsafe { load32::<FMT>(rows[k].as_ptr(), c, scale[k], tab[k]) };
                fma_inputs(&mut acc[k], w, &x);
            }
            c += LANES;
        }
    }
    // SAFETY: features enabled on this function; rows r0..r0+R exist; xs holds T inputs of cols floats.
    unsafe { finish_tile(m, r0, full, xs, acc, false, out) };
}

/// The `T` inputs' two 16-float halves of one block: input `t`'s at `p +
/// t·stride` and `p + t·stride + second`.
///
/// # Safety
/// Those 2·`T` runs of 16 floats are readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn input_halves<const T: usize>(p: *const f32, stride: usize, second: usize) -> [(__m512, __m512); T] {
    // SAFETY: the caller's contract.
    core::array::from_fn(|t| unsafe {
        let q = p.add(t * stride);
        (_mm512_loadu_ps(q), _mm512_loadu_ps(q.add(second)))
    })
}

/// One weight block `w` (two halves) into a row's `T` accumulator pairs,
/// one fused multiply-add per lane against each input's halves `x`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn fma_inputs<const T: usize>(acc: &mut [[__m512; 2]; T], w: (__m512, __m512), x: &[(__m512, __m512); T]) {
    for (a, xt) in acc.iter_mut().zip(x) {
        a[0] = _mm512_fmadd_ps(w.0, xt.0, a[0]);
        a[1] = _mm512_fmadd_ps(w.1, xt.1, a[1]);
    }
}

/// A tile's dots from its accumulators (in nibble order when
/// `interleaved`, put back in the canonical lanes first): each with the
/// zero-padded tail of its row and input, then the canonical reduction.
///
/// # Safety
/// Rows `r0..r0+R` of `m` exist; `xs` holds `T` inputs of `m.cols` floats.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn finish_tile<const R: usize, const T: usize>(
    m: &MatRef<'_>,
    r0: usize,
    full: usize,
    xs: &[f32],
    acc: [[[__m512; 2]; T]; R],
    interleaved: bool,
    out: &mut [[f32; T]; R],
) {
    let cols = m.cols;
    for (k, (ak, ok)) in acc.iter().zip(out.iter_mut()).enumerate() {
        for (t, (a, o)) in ak.iter().zip(ok.iter_mut()).enumerate() {
            let (lo, hi) = if interleaved { canonical_lanes(a[0], a[1]) } else { (a[0], a[1]) };
            // SAFETY: row r0 + k exists; input t has cols floats.
            let (lo, hi) = unsafe { tail_fma(m, r0 + k, full, &xs[t * cols..(t + 1) * cols], lo, hi) };
            *o = reduce(lo, hi);
        }
    }
}

/// Rows `row0 .. row0 + n` of `m` against `nt` inputs in tiles of
/// `MM_ROWS × MM_TOKENS` (smaller tiles at the edges). Q4G's tiles read
/// the inputs split into even and odd columns ([`tile_dot_q4`]), made once
/// per call in a cache-line-aligned buffer of the calling thread.
///
/// # Safety
/// As [`MatRef::matmat_rows`], fused layout.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn matmat_fmt<const FMT: u8>(
    m: &MatRef<'_>,
    xs: &[f32],
    nt: usize,
    row0: usize,
    n: usize,
    ys: *mut f32,
    ys_stride: usize,
) {
    let cols = m.cols;
    // SAFETY (every store): `ys` is valid at t·ys_stride + i for t < nt, i < n (the caller's contract).
    let store = |i: usize, t: usize, v: f32| unsafe { *ys.add(t * ys_stride + i) = v };
    // a token left alone after the tiles of inputs goes to the matvec
    // kernel over all the rows (faster than 1-input tiles; the same dots)
    let lone = nt > 1 && nt % MM_TOKENS == 1;
    let tiled = if lone { nt - 1 } else { nt };
    // Q4G: the tiled inputs split (input t's halves at t·2h), taken out of
    // the thread's cell for the call and put back after
    let h = cols / LANES * LANES / 2;
    let mut lines = if FMT == Q4G { SPLIT_XS.take() } else { Vec::new() };
    if FMT == Q4G {
        lines.clear();
        lines.resize((2 * h * tiled).div_ceil(16), Line([0.0; 16]));
        let split: &mut [f32] = bytemuck::cast_slice_mut(&mut lines[..]);
        for t in 0..tiled {
            let x = &xs[t * cols..(t + 1) * cols];
            let (xe, xo) = split[t * 2 * h..(t + 1) * 2 * h].split_at_mut(h);
            split_even_odd(x, xe, xo);
        }
    }
    let split: &[f32] = bytemuck::cast_slice(&lines[..]);
    let mut i = 0;
    while i < n {
        let r = (n - i).min(MM_ROWS);
        let mut t = 0;
        while t < tiled {
            let k = (tiled - t).min(MM_TOKENS);
            let x = &xs[t * cols..(t + k) * cols];
            let xsp = if FMT == Q4G { &split[t * 2 * h..(t + k) * 2 * h] } else { &[][..] };
            let st = |a: usize, b: usize, v: f32| store(i + a, t + b, v);
            // SAFETY (all arms): rows row0+i .. row0+i+r exist, x (and xsp) hold k inputs.
            unsafe {
                match (r, k) {
                    (MM_ROWS, MM_TOKENS) => tile_store::<MM_ROWS, MM_TOKENS, FMT>(m, row0 + i, x, xsp, &st),
                    (MM_ROWS, 3) => tile_store::<MM_ROWS, 3, FMT>(m, row0 + i, x, xsp, &st),
                    (MM_ROWS, 2) => tile_store::<MM_ROWS, 2, FMT>(m, row0 + i, x, xsp, &st),
                    (MM_ROWS, _) => tile_store::<MM_ROWS, 1, FMT>(m, row0 + i, x, xsp, &st),
                    (_, MM_TOKENS) => tile_store::<1, MM_TOKENS, FMT>(m, row0 + i, x, xsp, &st),
                    (_, 3) => tile_store::<1, 3, FMT>(m, row0 + i, x, xsp, &st),
                    (_, 2) => tile_store::<1, 2, FMT>(m, row0 + i, x, xsp, &st),
                    _ => tile_store::<1, 1, FMT>(m, row0 + i, x, xsp, &st),
                }
            }
            t += k;
        }
        i += r;
    }
    if FMT == Q4G {
        SPLIT_XS.set(lines);
    }
    if lone {
        let t = nt - 1;
        // SAFETY: token t's outputs are the n elements from t·ys_stride (the caller's contract).
        let y = unsafe { std::slice::from_raw_parts_mut(ys.add(t * ys_stride), n) };
        // SAFETY: features as this function's; x holds cols floats, rows in range.
        unsafe { matvec_rows(m, &xs[t * cols..(t + 1) * cols], row0, y) };
    }
}

/// [`tile_dot`] for Q4G in nibble order (as [`rows_dot_q4`]): the `T`
/// inputs split into even and odd columns per block (`xs_split`: input t's
/// even columns at `t·2h`, its odd ones at `t·2h + h`, `h = full / 2`), so a
/// row's 16 bytes zero-extend to 32-bit lanes and look the low nibbles up as
/// they are and the high ones after one shift — no unpacking — and the
/// accumulators are interleaved back to the canonical lanes before the tail
/// and the reduction. The same fused multiply-adds per lane, in the same
/// order: bit-identical to [`tile_dot`].
///
/// # Safety
/// As [`tile_dot`], Q4G with `group % 32 == 0`; `xs_split` as above.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tile_dot_q4<const R: usize, const T: usize>(
    m: &MatRef<'_>,
    r0: usize,
    xs: &[f32],
    xs_split: &[f32],
    out: &mut [[f32; T]; R],
) {
    let rbs = m.row_bytes();
    let g = m.groups();
    let cols = m.cols;
    let full = cols / LANES * LANES;
    let h = full / 2;
    let rows: [&[u8]; R] = core::array::from_fn(|k| &m.data[(r0 + k) * rbs..(r0 + k + 1) * rbs]);
    let mut acc = [[[_mm512_setzero_ps(); 2]; T]; R];
    // the next tile's R rows (contiguous, after these), prefetched in
    // address order at the pace these are read: R rows read side by side
    // are R short streams the hardware prefetcher does not follow (as in
    // rows_dot_q4): 1.1–1.6× on 8–16-input matmats from DRAM (docs/lab/)
    let ahead = m.data.as_ptr().wrapping_add((r0 + R) * rbs);
    let mut c = 0;
    while c < full {
        let end = ((c / m.group + 1) * m.group).min(full);
        let tab: [__m512; R] = core::array::from_fn(|k| q4_table(f16(m.scales[(r0 + k) * g + c / m.group])));
        while c < end {
            let b = c / 2;
            prefetch_lines(ahead.wrapping_add(b * R), R * LANES / 2);
            // SAFETY: b + 16 <= h; input t's halves span t·2h .. (t+1)·2h.
            let x = unsafe { input_halves::<T>(xs_split.as_ptr().add(b), 2 * h, h) };
            for k in 0..R {
                // SAFETY: the row holds bytes b .. b + 16.
                let dw = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(rows[k].as_ptr().add(b) as *const __m128i)) };
                let we = _mm512_permutexvar_ps(dw, tab[k]);
                let wo = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(dw), tab[k]);
                fma_inputs(&mut acc[k], (we, wo), &x);
            }
            c += LANES;
        }
    }
    // SAFETY: features enabled on this function; rows r0..r0+R exist; xs holds T inputs of cols floats.
    unsafe { finish_tile(m, r0, full, xs, acc, true, out) };
}

/// 16 floats on a cache line: the unit of [`SPLIT_XS`], so the split
/// inputs start on a 64-byte boundary (a load split across two lines costs
/// a matmat 7–45 %, docs/lab/).
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Line([f32; 16]);

thread_local! {
    /// A matmat's inputs split into even and odd columns per block (Q4G).
    static SPLIT_XS: core::cell::Cell<Vec<Line>> = const { core::cell::Cell::new(Vec::new()) };
}

/// The `R × T` tile from row `r0` against the `T` inputs of `x` — by
/// [`tile_dot_q4`] over the split inputs `xsp` for Q4G, else by
/// [`tile_dot`] — each result handed to `store(row offset, input, value)`.
///
/// # Safety
/// As [`tile_dot`] (and [`tile_dot_q4`] for Q4G).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tile_store<const R: usize, const T: usize, const FMT: u8>(
    m: &MatRef<'_>,
    r0: usize,
    x: &[f32],
    xsp: &[f32],
    store: &dyn Fn(usize, usize, f32),
) {
    let mut o = [[0f32; T]; R];
    // SAFETY: forwarded.
    unsafe {
        if FMT == Q4G {
            tile_dot_q4::<R, T>(m, r0, x, xsp, &mut o)
        } else {
            tile_dot::<R, T, FMT>(m, r0, x, &mut o)
        }
    };
    for (a, row) in o.iter().enumerate() {
        for (b, &v) in row.iter().enumerate() {
            store(a, b, v);
        }
    }
}

/// AVX-512 version of [`MatRef::matmat_rows`]: tiles of rows × inputs.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C; the rest as
/// [`MatRef::matmat_rows`] (sizes checked by its caller).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn matmat_rows(
    m: &MatRef<'_>,
    xs: &[f32],
    nt: usize,
    row0: usize,
    n: usize,
    ys: *mut f32,
    ys_stride: usize,
) {
    if m.fmt.is_grouped() && !m.group.is_multiple_of(LANES) {
        // SAFETY: AVX2 ⊂ this level; forwarded contract.
        return unsafe { super::avx2::matmat_rows(m, xs, nt, row0, n, ys, ys_stride) };
    }
    // SAFETY (all arms): forwarded contract, layout fused (checked above).
    unsafe {
        match m.fmt {
            Fmt::F32 => matmat_fmt::<F32>(m, xs, nt, row0, n, ys, ys_stride),
            Fmt::F16 => matmat_fmt::<F16>(m, xs, nt, row0, n, ys, ys_stride),
            Fmt::Bf16 => matmat_fmt::<BF16>(m, xs, nt, row0, n, ys, ys_stride),
            Fmt::Q8G => matmat_fmt::<Q8G>(m, xs, nt, row0, n, ys, ys_stride),
            Fmt::Q4G => matmat_fmt::<Q4G>(m, xs, nt, row0, n, ys, ys_stride),
        }
    }
}

/// Whether the CPU has AVX-512 VBMI (byte permutes) for [`vq_rows16`].
pub fn has_vbmi() -> bool {
    is_x86_feature_detected!("avx512vbmi")
}

/// AVX-512 version of the AVX2 `vq_rows8`: 16 rows a vector (one gather
/// fetches 16 table entries), each row's `bpv` index bytes moved into its
/// 32-bit lane by one byte permute (VBMI). Rows `r0..r0+y.len()` (a multiple
/// of 16, `r0 % 16 == 0`), blocked layout with `block % 16 == 0`, 8-bit
/// indices with `bpv ≤ 4` or 6-bit packed ones with `bpv == 3`. The same
/// tiling over vector positions as the AVX2 kernel, and the same sum order
/// per row — bit-identical.
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI; sizes as asserted by `vq::matvec_rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma")]
pub unsafe fn vq_rows16(lay: &crate::vq::VqLayout, idx: &[u8], table: &[f32], r0: usize, y: &mut [f32]) {
    let te = lay.table_entries();
    let bpv = lay.bpv();
    let st = lay.stages;
    let end = r0 + y.len();
    // row i's bytes bpv·i .. bpv·i+bpv into lane i (bytes 4i..4i+bpv), zeros above
    let mut perm = [0u8; 64];
    let mut keep = 0u64;
    for i in 0..16 {
        for k in 0..bpv {
            perm[4 * i + k] = (bpv * i + k) as u8;
            keep |= 1 << (4 * i + k);
        }
    }
    // SAFETY: 64-byte array.
    let perm = unsafe { _mm512_loadu_si512(perm.as_ptr() as *const __m512i) };
    let field = if lay.packed6 { 6 } else { 8 };
    let field_mask = _mm512_set1_epi32(if lay.packed6 { 63 } else { 255 });
    let group_bytes = 16 * bpv;
    let mut v0 = 0;
    while v0 < lay.nvec {
        let v1 = (v0 + super::avx2::VQ_TILE).min(lay.nvec);
        let mut r = r0;
        while r < end {
            let block_end = (r / lay.block + 1) * lay.block;
            let ng = ((block_end.min(end) - r) / 16).clamp(1, 4);
            let mut acc = [_mm512_setzero_ps(); 4];
            if v0 > 0 {
                for (g, a) in acc.iter_mut().enumerate().take(ng) {
                    // SAFETY: r + 16g + 16 <= end; the previous tile wrote these partial sums.
                    *a = unsafe { _mm512_loadu_ps(y.as_ptr().add(r - r0 + 16 * g)) };
                }
            }
            // the blocked layout puts position v at block · bpv bytes past v - 1
            let (o0, vstride) = (lay.offset(r, v0), lay.vstride());
            for v in v0..v1 {
                let o = o0 + (v - v0) * vstride;
                let src = &idx[o..o + ng * group_bytes];
                for (g, a) in acc.iter_mut().enumerate().take(ng) {
                    // SAFETY: the group's 16·bpv ≤ 64 bytes are inside `src`; the masked load reads no others.
                    let w = unsafe {
                        let raw = _mm512_maskz_loadu_epi8(
                            keep_bytes(group_bytes),
                            src.as_ptr().add(g * group_bytes) as *const i8,
                        );
                        _mm512_maskz_permutexvar_epi8(keep, perm, raw)
                    };
                    for s in 0..st {
                        let base = _mm512_set1_epi32(((v * st + s) * te) as i32);
                        let ix =
                            _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_set1_epi32((field * s) as i32)), field_mask);
                        // SAFETY: every index < te, so base + index lies within the table.
                        let t = unsafe { _mm512_i32gather_ps::<4>(_mm512_add_epi32(ix, base), table.as_ptr()) };
                        *a = _mm512_add_ps(*a, t);
                    }
                }
            }
            for (g, a) in acc.iter().enumerate().take(ng) {
                // SAFETY: r + 16g + 16 <= end.
                unsafe { _mm512_storeu_ps(y.as_mut_ptr().add(r - r0 + 16 * g), *a) };
            }
            r += 16 * ng;
        }
        v0 = v1;
    }
}

/// A byte mask of the low `n` (≤ 64) bytes.
#[inline]
fn keep_bytes(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

/// Byte planes of a VQ table for [`vq_rows64`]: for every (vector position,
/// stage), the 256 entries' f32 bits as 4 planes of 256 bytes (byte 0 of
/// every entry, then byte 1, …): `planes[((v·stages + s)·4 + p)·256 + e]`
/// is byte `p` of `table[(v·stages + s)·256 + e]`. A pure byte transpose.
///
/// # Safety
/// AVX-512 F/BW/VBMI; `table` and `planes` hold `nvec · stages · 256`
/// entries (floats / 4-byte groups).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma")]
pub unsafe fn vq_planes(table: &[f32], planes: &mut [u8], tables: usize) {
    assert!(table.len() >= tables * 256 && planes.len() >= tables * 1024);
    // plane byte i of a 64-entry run = byte 4i + p of the run's 256 bytes;
    // the low 128 bytes serve i < 32, the high ones i ≥ 32 (same index mod 128)
    let ix: [__m512i; 4] = core::array::from_fn(|p| {
        let b: [u8; 64] = core::array::from_fn(|i| ((4 * i + p) & 127) as u8);
        // SAFETY: 64-byte array.
        unsafe { _mm512_loadu_si512(b.as_ptr() as *const __m512i) }
    });
    let upper: __mmask64 = 0xFFFF_FFFF_0000_0000;
    for t in 0..tables {
        // SAFETY: t < tables: 256 floats at 256t, 1024 bytes at 1024t.
        unsafe {
            let src = table.as_ptr().add(256 * t);
            let dst = planes.as_mut_ptr().add(1024 * t);
            for q in 0..4 {
                let z: [__m512; 4] = core::array::from_fn(|k| _mm512_loadu_ps(src.add(64 * q + 16 * k)));
                let zi: [__m512i; 4] = core::array::from_fn(|k| _mm512_castps_si512(z[k]));
                for (p, ixp) in ix.iter().enumerate() {
                    let lo = _mm512_permutex2var_epi8(zi[0], *ixp, zi[1]);
                    let hi = _mm512_permutex2var_epi8(zi[2], *ixp, zi[3]);
                    let plane = _mm512_mask_blend_epi8(upper, lo, hi);
                    _mm512_storeu_si512(dst.add(256 * p + 64 * q) as *mut __m512i, plane);
                }
            }
        }
    }
}

/// One (vector position, stage) table of 256 entries computed in registers
/// — entry `e` = `x[0]·c_e[0]`, then `fma(x[d], c_e[d], ·)` for `d = 1..8`,
/// as `vq::build_table` defines it — stored as f32 (`t`, 256 floats) and
/// as the byte planes of [`vq_planes`] (`p`, 1024 bytes), without reading
/// the table back. An empty `t` stores the planes alone (when the planes
/// serve every row, the f32 table would be written for nothing).
///
/// # Safety
/// AVX-512 F/BW/VBMI; `b` has 256 entries of dimension 8, `x` 8 floats,
/// `t` 256 floats or none, `p` 1024 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma")]
pub unsafe fn table_planes(b: &crate::vq::VqBook, x: &[f32], t: &mut [f32], p: &mut [u8]) {
    assert!(b.entries == 256 && b.dim == 8 && x.len() >= 8 && (t.is_empty() || t.len() >= 256) && p.len() >= 1024);
    let store_t = !t.is_empty();
    let xs: [__m512; 8] = core::array::from_fn(|d| _mm512_set1_ps(x[d]));
    let ix: [__m512i; 4] = core::array::from_fn(|pl| {
        let bytes: [u8; 64] = core::array::from_fn(|i| ((4 * i + pl) & 127) as u8);
        // SAFETY: 64-byte array.
        unsafe { _mm512_loadu_si512(bytes.as_ptr() as *const __m512i) }
    });
    let upper: __mmask64 = 0xFFFF_FFFF_0000_0000;
    for q in 0..4 {
        // entries 64q .. 64q + 64, 16 per register
        let z: [__m512i; 4] = core::array::from_fn(|k| {
            let e = 64 * q + 16 * k;
            // SAFETY: cbt holds 8 rows of 256 floats; e + 16 <= 256.
            unsafe {
                let mut acc = _mm512_mul_ps(xs[0], _mm512_loadu_ps(b.cbt.as_ptr().add(e)));
                for (d, xd) in xs.iter().enumerate().skip(1) {
                    acc = _mm512_fmadd_ps(*xd, _mm512_loadu_ps(b.cbt.as_ptr().add(d * 256 + e)), acc);
                }
                if store_t {
                    _mm512_storeu_ps(t.as_mut_ptr().add(e), acc);
                }
                _mm512_castps_si512(acc)
            }
        });
        for (pl, ixp) in ix.iter().enumerate() {
            let lo = _mm512_permutex2var_epi8(z[0], *ixp, z[1]);
            let hi = _mm512_permutex2var_epi8(z[2], *ixp, z[3]);
            // SAFETY: 256·pl + 64q + 64 <= 1024.
            unsafe {
                _mm512_storeu_si512(
                    p.as_mut_ptr().add(256 * pl + 64 * q) as *mut __m512i,
                    _mm512_mask_blend_epi8(upper, lo, hi),
                )
            };
        }
    }
}

/// How many vector positions ahead [`vq_rows64`] prefetches each row
/// group's indices (docs/lab/).
const VQ_PREFETCH_V: usize = 4;

/// VQ row sums by in-register byte lookups instead of gathers: for each
/// vector position and stage, the stage's 256-entry table is held as 4
/// byte planes in 16 registers, and 64 rows' indices look up each plane
/// in one of two forms chosen per CPU ([`crate::vq::plane_lookup`]): two 128-entry
/// two-register permutes blended on the index's top bit, or four 64-entry
/// permutes merged under masks of its top two bits (VBMI); the 4 planes' bytes are interleaved back into the
/// 64 f32 entries. Each row still adds its entries in the canonical order (vector position, then
/// stage) into its own sum — bit-identical to the scalar definition. The
/// gathers' one load per lookup is what capped [`vq_rows16`]
/// (docs/lab/).
///
/// Rows `r0..r0+y.len()`, both multiples of 64, blocked layout with `block
/// % 64 == 0`, 8-bit indices (`bpv == stages`, 1 to 3; 256 entries); `planes`
/// from [`vq_planes`] over the whole table.
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI; sizes as asserted by `vq::matvec_rows`.
pub unsafe fn vq_rows64(lay: &crate::vq::VqLayout, idx: &[u8], planes: &[u8], r0: usize, y: &mut [f32]) {
    use crate::vq::PlaneLookup::{OneSource, TwoSource};
    // SAFETY: the caller's contract (bpv == stages, 1 to 3: `planes_fit`; 8-bit indices).
    unsafe {
        match (crate::vq::plane_lookup(), lay.bpv()) {
            (TwoSource, 3) => vq_rows64_with::<true, 3>(lay, idx, planes, r0, y),
            (TwoSource, 2) => vq_rows64_with::<true, 2>(lay, idx, planes, r0, y),
            (TwoSource, 1) => vq_rows64_with::<true, 1>(lay, idx, planes, r0, y),
            (OneSource, 3) => vq_rows64_with::<false, 3>(lay, idx, planes, r0, y),
            (OneSource, 2) => vq_rows64_with::<false, 2>(lay, idx, planes, r0, y),
            (OneSource, 1) => vq_rows64_with::<false, 1>(lay, idx, planes, r0, y),
            (_, b) => unreachable!("byte planes serve 1 to 3 stages (planes_fit), not {b}"),
        }
    }
}

/// [`vq_rows64`] with the plane lookup and the stage count (`BPV`, 1 to 3)
/// fixed at compile time: the index extraction is straight-line code with
/// its permute vectors in registers, and the row groups are walked without
/// an index computation per group (with both chosen at run time, the
/// experts' part of an all-cached decode took 1.2× as long: docs/lab/2026-12-04-46-the-stage-count-fixed-at-compile-time-in-the.md,
/// "The stage count fixed at compile time").
///
/// # Safety
/// As [`vq_rows64`]; `BPV == lay.bpv() == lay.stages`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma")]
unsafe fn vq_rows64_with<const TWO_SOURCE: bool, const BPV: usize>(
    lay: &crate::vq::VqLayout,
    idx: &[u8],
    planes: &[u8],
    r0: usize,
    y: &mut [f32],
) {
    debug_assert!(lay.stages == BPV && lay.bpv() == BPV && (1..=3).contains(&BPV) && !lay.packed6);
    // byte j = 16L + 4k + e of the index vector holds the index of row
    // 16k + 4L + e, so the interleave below yields rows in order
    let mut ix = [_mm512_setzero_si512(); BPV];
    let mut high = [0u64; BPV];
    for (s, (ixs, hs)) in ix.iter_mut().zip(high.iter_mut()).enumerate() {
        let b: [u8; 64] = core::array::from_fn(|j| {
            let (l, k, e) = (j / 16, (j % 16) / 4, j % 4);
            let off = BPV * (16 * k + 4 * l + e) + s;
            if off >= 128 {
                *hs |= 1 << j;
            }
            (off & 127) as u8
        });
        // SAFETY: 64-byte array.
        *ixs = unsafe { _mm512_loadu_si512(b.as_ptr() as *const __m512i) };
    }
    y.fill(0.0);
    // each row group's index offset at vector position 0; position v adds
    // v · block · bpv (blocked layout): no division per group in the loop
    let goff: Vec<usize> = (0..y.len() / 64).map(|g| lay.offset(r0 + 64 * g, 0)).collect();
    let vstride = lay.vstride();
    let yp = y.as_mut_ptr();
    for v in 0..lay.nvec {
        let vbase = idx.as_ptr().wrapping_add(v * vstride);
        for s in 0..BPV {
            // SAFETY (loads): the planes of (v, s) are 1024 bytes inside `planes`.
            let pl: [[__m512i; 4]; 4] = core::array::from_fn(|p| {
                core::array::from_fn(|q| unsafe {
                    _mm512_loadu_si512(planes.as_ptr().add(((v * BPV + s) * 4 + p) * 256 + 64 * q) as *const __m512i)
                })
            });
            let (ixs, hs) = (ix[s], high[s]);
            for (g, &go) in goff.iter().enumerate() {
                let p = vbase.wrapping_add(go);
                if s == 0 {
                    // this group's indices a few vector positions ahead (a
                    // hint: never faults): each 64-row group is a stream of
                    // its own, too many interleaved for the hardware prefetcher
                    prefetch_lines(p.wrapping_add(VQ_PREFETCH_V * lay.block * BPV), 64 * BPV);
                }
                // SAFETY: the group's 64·BPV index bytes are inside `idx` (asserted by the caller).
                let iv = unsafe {
                    let z0 = _mm512_loadu_si512(p as *const __m512i);
                    match BPV {
                        1 => _mm512_permutexvar_epi8(ixs, z0),
                        2 => _mm512_permutex2var_epi8(z0, ixs, _mm512_loadu_si512(p.add(64) as *const __m512i)),
                        _ => {
                            let z1 = _mm512_loadu_si512(p.add(64) as *const __m512i);
                            let z2 = _mm512_loadu_si512(p.add(128) as *const __m512i);
                            _mm512_mask_permutexvar_epi8(_mm512_permutex2var_epi8(z0, ixs, z1), hs, ixs, z2)
                        }
                    }
                };
                let b7 = _mm512_movepi8_mask(iv);
                let b: [__m512i; 4] = if TWO_SOURCE {
                    // two 128-entry halves, blended on the index's top bit
                    core::array::from_fn(|p| {
                        let lo = _mm512_permutex2var_epi8(pl[p][0], iv, pl[p][1]);
                        let hi = _mm512_permutex2var_epi8(pl[p][2], iv, pl[p][3]);
                        _mm512_mask_blend_epi8(b7, lo, hi)
                    })
                } else {
                    // four one-register permutes per plane, each 64-entry
                    // quarter merged where the index's top two bits choose it
                    let b6 = _mm512_movepi8_mask(_mm512_add_epi8(iv, iv));
                    let (q1, q3) = (_kandn_mask64(b7, b6), _kand_mask64(b7, b6));
                    core::array::from_fn(|p| {
                        let r = _mm512_permutexvar_epi8(iv, pl[p][0]);
                        let r = _mm512_mask_permutexvar_epi8(r, q1, iv, pl[p][1]);
                        let r = _mm512_mask_permutexvar_epi8(r, b7, iv, pl[p][2]);
                        _mm512_mask_permutexvar_epi8(r, q3, iv, pl[p][3])
                    })
                };
                let t0 = _mm512_unpacklo_epi8(b[0], b[1]);
                let t1 = _mm512_unpackhi_epi8(b[0], b[1]);
                let t2 = _mm512_unpacklo_epi8(b[2], b[3]);
                let t3 = _mm512_unpackhi_epi8(b[2], b[3]);
                let f = [
                    _mm512_unpacklo_epi16(t0, t2),
                    _mm512_unpackhi_epi16(t0, t2),
                    _mm512_unpacklo_epi16(t1, t3),
                    _mm512_unpackhi_epi16(t1, t3),
                ];
                for (k, fk) in f.iter().enumerate() {
                    // SAFETY: 64g + 16k + 16 <= y.len().
                    unsafe {
                        let a = yp.add(64 * g + 16 * k);
                        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_castsi512_ps(*fk)));
                    }
                }
            }
        }
    }
}

/// Table entries for one (v, s) as the AVX2 `table_entries` computes them
/// (`t[e] = x0·c0`, then one fused multiply-add per further dimension, in
/// order), 16 entries a lane: the same bits. Returns how many entries it
/// wrote (whole vectors of 16; the caller computes the rest).
///
/// # Safety
/// AVX-512 F; `x.len() == b.dim`, `t.len() >= b.entries`.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn table_entries(b: &crate::vq::VqBook, x: &[f32], t: &mut [f32]) -> usize {
    assert!(x.len() == b.dim && t.len() >= b.entries && b.cbt.len() >= b.dim * b.entries);
    let e16 = b.entries / 16 * 16;
    let c = b.cbt.as_ptr();
    let mut e = 0;
    // eight (then four, then one) vectors' chains at once: a chain is dim
    // dependent FMAs, each entry's in the same order as one at a time; two
    // 512-bit FMA ports need eight through the 4-cycle latency (the Intel
    // Xeon of docs/lab entry 85 has one: four chains 0.089, eight 0.085 ms
    // for 1024 × 2304 VQ3R's fast table)
    while e + 128 <= e16 {
        // SAFETY: cbt rows hold `entries` floats (asserted); e + 128 <= entries.
        unsafe { entries_chains::<8>(c, b.entries, x, e, t) };
        e += 128;
    }
    while e + 64 <= e16 {
        // SAFETY: as above; e + 64 <= entries.
        unsafe { entries_chains::<4>(c, b.entries, x, e, t) };
        e += 64;
    }
    while e < e16 {
        // SAFETY: as above; e + 16 <= entries.
        unsafe { entries_chains::<1>(c, b.entries, x, e, t) };
        e += 16;
    }
    e16
}

/// Entries `e .. e + 16N` of a (position, stage) table: `N` vectors' FMA
/// chains side by side (`c` the book transposed, `entries` a row).
///
/// # Safety
/// AVX-512 F; `c` holds `x.len()` rows of `entries` floats, `e + 16N <=
/// entries`, `t` at least `e + 16N` long.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn entries_chains<const N: usize>(c: *const f32, entries: usize, x: &[f32], e: usize, t: &mut [f32]) {
    // SAFETY: the caller's contract.
    unsafe {
        let x0 = _mm512_set1_ps(x[0]);
        let mut acc: [__m512; N] = core::array::from_fn(|q| _mm512_mul_ps(x0, _mm512_loadu_ps(c.add(e + 16 * q))));
        for (d, &xd) in x.iter().enumerate().skip(1) {
            let xv = _mm512_set1_ps(xd);
            for (q, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(xv, _mm512_loadu_ps(c.add(d * entries + e + 16 * q)), *a);
            }
        }
        for (q, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(t.as_mut_ptr().add(e + 16 * q), *a);
        }
    }
}

/// The fast table's `i8` codes of one block `t` into `q` (as long) and its
/// scale: the steps of `avx2::quantize_codes` (the largest magnitude as the
/// largest of the values' bits without the sign; each code `T · inv + RNE`'s
/// low bits, clamped to ±qmax), sixteen lanes at a time — the same codes.
/// 1024 × 2304 VQ3R's fast table 0.085 → 0.081 ms on the Intel Xeon of
/// docs/lab entry 85 (whose one 512-bit FMA port keeps the f32 entries at
/// AVX2's speed).
///
/// # Safety
/// AVX-512 F; `q.len() == t.len()`.
#[target_feature(enable = "avx512f,avx2")]
pub unsafe fn quantize_codes(t: &[f32], qmax: f32, q: &mut [i8]) -> f32 {
    let rne = crate::vq_fast::RNE;
    assert_eq!(q.len(), t.len());
    let n16 = t.len() / 16 * 16;
    let abs = _mm512_set1_epi32(0x7fff_ffff);
    let mut mv = [_mm512_setzero_si512(); 4];
    let n64 = t.len() / 64 * 64;
    for i in (0..n64).step_by(64) {
        for (j, m) in mv.iter_mut().enumerate() {
            // SAFETY: i + 64 <= t.len().
            let v = unsafe { _mm512_loadu_si512(t.as_ptr().add(i + 16 * j) as *const __m512i) };
            *m = _mm512_max_epu32(*m, _mm512_and_si512(v, abs));
        }
    }
    for i in (n64..n16).step_by(16) {
        // SAFETY: i + 16 <= t.len().
        let v = unsafe { _mm512_loadu_si512(t.as_ptr().add(i) as *const __m512i) };
        mv[0] = _mm512_max_epu32(mv[0], _mm512_and_si512(v, abs));
    }
    let mv = _mm512_max_epu32(_mm512_max_epu32(mv[0], mv[1]), _mm512_max_epu32(mv[2], mv[3]));
    let m = t[n16..].iter().fold(_mm512_reduce_max_epu32(mv), |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    if m > f32::INFINITY.to_bits() || m == 0 {
        // a NaN (the scale NaN), or an all-zero block: the scalar steps
        return crate::vq_fast::quantize_body_into(t, qmax, bytemuck::cast_slice_mut(q));
    }
    let amax = f32::from_bits(m);
    let inv = qmax / amax;
    let (qm, rb) = (qmax as i32, rne.to_bits() as i32);
    let (vinv, vrne, vrb) = (_mm512_set1_ps(inv), _mm512_set1_ps(rne), _mm512_set1_epi32(rb));
    let (lo, hi) = (_mm512_set1_epi32(-qm), _mm512_set1_epi32(qm));
    for i in (0..n16).step_by(16) {
        // SAFETY: i + 16 <= t.len() = q.len().
        unsafe {
            let v = _mm512_loadu_ps(t.as_ptr().add(i));
            let r = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(v, vinv), vrne)), vrb);
            let c = _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(r, lo), hi));
            _mm_storeu_si128(q.as_mut_ptr().add(i) as *mut __m128i, c);
        }
    }
    for (o, &v) in q[n16..].iter_mut().zip(&t[n16..]) {
        *o = crate::vq_fast::code(v, inv, qmax);
    }
    amax / qmax
}

/// VQ4P row sums with the whole 64-entry tables in registers: a vector
/// position's 4 stages are 16 registers of f32 entries, looked up by
/// two-register float permutes (`vpermt2ps`, 32 entries each) blended on the
/// index's bit 5 — no gathers, no byte planes. Each row's 3 index bytes are
/// moved into its 32-bit lane by one byte permute per 16 rows (VBMI); stage
/// `s`'s field is that lane shifted right by `6s` (the permutes read only
/// the low 5 bits, the blend bit 5). A row's sum stays in a register across
/// the 4 stages and adds its entries in the canonical order (vector
/// position, then stage): bit-identical to the scalar definition.
///
/// Rows `r0..r0+y.len()`, both multiples of 64, blocked layout with `block
/// % 64 == 0`, 6-bit packed indices of 4 stages (`bpv == 3`); `table` has
/// 64 entries per (vector position, stage).
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI; sizes as asserted.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma")]
pub unsafe fn vq4p_rows64(lay: &crate::vq::VqLayout, idx: &[u8], table: &[f32], r0: usize, y: &mut [f32]) {
    assert!(lay.packed6 && lay.stages == 4 && lay.block > 0 && lay.block.is_multiple_of(64));
    assert!(r0.is_multiple_of(64) && y.len().is_multiple_of(64) && r0 + y.len() <= lay.rows);
    assert!(idx.len() >= lay.index_bytes() && table.len() >= lay.table_len());
    // lane j of the 16-row vector k holds bytes 3j..3j+3 of the 48 bytes of
    // rows 16k..16k+16 (its fourth byte repeats the third: shifted out or
    // above bit 5 for every stage); rows 48..64 are read from a load at
    // byte 128, so every load stays inside the group's 192 bytes
    let ctl: [__m512i; 2] = core::array::from_fn(|h| {
        let b: [u8; 64] = core::array::from_fn(|i| (16 * h + 3 * (i / 4) + (i % 4).min(2)) as u8);
        // SAFETY: 64-byte array.
        unsafe { _mm512_loadu_si512(b.as_ptr() as *const __m512i) }
    });
    let bit5 = _mm512_set1_epi32(32);
    y.fill(0.0);
    let goff: Vec<usize> = (0..y.len() / 64).map(|g| lay.offset(r0 + 64 * g, 0)).collect();
    let vstride = lay.vstride();
    let yp = y.as_mut_ptr();
    for v in 0..lay.nvec {
        // SAFETY: the 4 stages' 64 entries of position v are inside `table` (asserted).
        let t: [[__m512; 4]; 4] = core::array::from_fn(|s| {
            core::array::from_fn(|q| unsafe { _mm512_loadu_ps(table.as_ptr().add((4 * v + s) * 64 + 16 * q)) })
        });
        let vbase = idx.as_ptr().wrapping_add(v * vstride);
        for (g, &go) in goff.iter().enumerate() {
            let p = vbase.wrapping_add(go);
            // this group's indices a few vector positions ahead (a hint: never faults)
            prefetch_lines(p.wrapping_add(VQ_PREFETCH_V * vstride), 192);
            for k in 0..4 {
                // SAFETY: bytes 48k .. 48k + 64 (k < 3) and 128 .. 192 (k = 3)
                // are inside the group's 192 index bytes, inside `idx` (asserted).
                let d = unsafe {
                    let (at, c) = if k < 3 { (48 * k, ctl[0]) } else { (128, ctl[1]) };
                    _mm512_permutexvar_epi8(c, _mm512_loadu_si512(p.add(at) as *const __m512i))
                };
                let look = |i: __m512i, t: &[__m512; 4]| {
                    let lo = _mm512_permutex2var_ps(t[0], i, t[1]);
                    let hi = _mm512_permutex2var_ps(t[2], i, t[3]);
                    _mm512_mask_blend_ps(_mm512_test_epi32_mask(i, bit5), lo, hi)
                };
                // SAFETY: 64g + 16k + 16 <= y.len().
                unsafe {
                    let a = yp.add(64 * g + 16 * k);
                    let mut acc = _mm512_add_ps(_mm512_loadu_ps(a), look(d, &t[0]));
                    acc = _mm512_add_ps(acc, look(_mm512_srli_epi32::<6>(d), &t[1]));
                    acc = _mm512_add_ps(acc, look(_mm512_srli_epi32::<12>(d), &t[2]));
                    acc = _mm512_add_ps(acc, look(_mm512_srli_epi32::<18>(d), &t[3]));
                    _mm512_storeu_ps(a, acc);
                }
            }
        }
    }
}

/// `y[j] = fma(a, x[j], y[j])` for the whole 16-wide vectors at the start;
/// returns how many elements it did (the caller finishes the rest). One
/// fused multiply-add per element, as the scalar definition.
///
/// # Safety
/// AVX-512 F; `x.len() == y.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) -> usize {
    let n16 = y.len().min(x.len()) / 16 * 16;
    let av = _mm512_set1_ps(a);
    let mut j = 0;
    while j < n16 {
        // SAFETY: j + 16 <= len of both.
        unsafe {
            let r = _mm512_fmadd_ps(av, _mm512_loadu_ps(x.as_ptr().add(j)), _mm512_loadu_ps(y.as_ptr().add(j)));
            _mm512_storeu_ps(y.as_mut_ptr().add(j), r);
        }
        j += 16;
    }
    n16
}

/// Columns (16 registers of accumulators) per pass of [`rows_axpy`].
const AXPY_COLS: usize = 256;

/// `acc[j] = fma(coef[i], W[r0 + i][j], acc[j])` for the rows `i` in order
/// — a transposed product over a row range, as MLA's absorbed query needs
/// (`W_kbᵀ q`) — decoding each 32-weight block in registers (`load32`: the
/// same exact values as `MatRef::dequant`) instead of through a row buffer.
/// Per element the same fused multiply-adds in the same order as
/// dequantizing each row and `ops::axpy`: bit-identical.
///
/// # Safety
/// AVX-512 F/BW/VL, F16C; `m` checked; `acc.len() == m.cols`, a multiple of
/// 32; grouped formats have `group % 32 == 0`; rows `r0..r0 + coef.len()` exist.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn rows_axpy(m: &MatRef<'_>, r0: usize, coef: &[f32], acc: &mut [f32]) {
    unsafe {
        match m.fmt {
            Fmt::F32 => rows_axpy_fmt::<F32>(m, r0, coef, acc),
            Fmt::F16 => rows_axpy_fmt::<F16>(m, r0, coef, acc),
            Fmt::Bf16 => rows_axpy_fmt::<BF16>(m, r0, coef, acc),
            Fmt::Q8G => rows_axpy_fmt::<Q8G>(m, r0, coef, acc),
            Fmt::Q4G => rows_axpy_fmt::<Q4G>(m, r0, coef, acc),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn rows_axpy_fmt<const FMT: u8>(m: &MatRef<'_>, r0: usize, coef: &[f32], acc: &mut [f32]) {
    assert!(acc.len() == m.cols && m.cols.is_multiple_of(LANES) && r0 + coef.len() <= m.rows);
    let grouped = FMT == Q8G || FMT == Q4G;
    assert!(!grouped || m.group.is_multiple_of(LANES));
    let (rbs, g) = (m.row_bytes(), m.groups());
    let steps = _mm512_setr_ps(-8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.);
    let mut c0 = 0;
    while c0 < m.cols {
        let nb = (m.cols - c0).min(AXPY_COLS) / LANES;
        // SAFETY (loads/stores of acc): columns c0..c0 + 32·nb are inside acc.
        let mut a: [__m512; 2 * AXPY_COLS / LANES] = core::array::from_fn(|v| {
            if v < 2 * nb {
                unsafe { _mm512_loadu_ps(acc.as_ptr().add(c0 + 16 * v)) }
            } else {
                _mm512_setzero_ps()
            }
        });
        for (i, &ci) in coef.iter().enumerate() {
            let r = r0 + i;
            let rb = &m.data[r * rbs..(r + 1) * rbs];
            let cv = _mm512_set1_ps(ci);
            for b in 0..nb {
                let c = c0 + b * LANES;
                let (scale, tab) = if grouped {
                    let s = f16(m.scales[r * g + c / m.group]);
                    (s, if FMT == Q4G { q4_table(s) } else { steps })
                } else {
                    (0.0, steps)
                };
                // SAFETY: c + 32 <= cols, within the row.
                let (wl, wh) = unsafe { load32::<FMT>(rb.as_ptr(), c, scale, tab) };
                a[2 * b] = _mm512_fmadd_ps(cv, wl, a[2 * b]);
                a[2 * b + 1] = _mm512_fmadd_ps(cv, wh, a[2 * b + 1]);
            }
        }
        for (v, av) in a.iter().enumerate().take(2 * nb) {
            unsafe { _mm512_storeu_ps(acc.as_mut_ptr().add(c0 + 16 * v), *av) };
        }
        c0 += nb * LANES;
    }
}

/// The fast mode's VQ row sums ([`crate::vq_fast`]) with each (vector
/// position, stage) int8 table — 256 bytes, four registers — looked up by
/// byte permutes for 64 rows at once ([`crate::vq::plane_lookup`]'s two
/// forms, as [`vq_rows64`] looks up one of its four byte planes); a
/// block's lookups summed in 16-bit lanes (at most 12 · 127), then each
/// row's `fma(n_b, d_b, ·)` in block order: the definition's bits.
///
/// Rows `r0..r0+y.len()`, both multiples of 64, blocked layout with `block
/// % 64 == 0`, 8-bit indices of 1 to 3 stages; `d` and `q` a whole table's
/// scales and codes ([`crate::vq_fast::parts`]).
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI; sizes as asserted by `vq_fast::matvec_rows`.
pub unsafe fn vq_fast_rows64(lay: &crate::vq::VqLayout, idx: &[u8], d: &[f32], q: &[i8], r0: usize, y: &mut [f32]) {
    use crate::vq::PlaneLookup::{OneSource, TwoSource};
    // SAFETY: the caller's contract (1 to 3 byte stages).
    unsafe {
        match (crate::vq::plane_lookup(), lay.bpv()) {
            (TwoSource, 3) => vq_fast_rows64_with::<true, 3>(lay, idx, d, q, r0, y),
            (TwoSource, 2) => vq_fast_rows64_with::<true, 2>(lay, idx, d, q, r0, y),
            (TwoSource, 1) => vq_fast_rows64_with::<true, 1>(lay, idx, d, q, r0, y),
            (OneSource, 3) => vq_fast_rows64_with::<false, 3>(lay, idx, d, q, r0, y),
            (OneSource, 2) => vq_fast_rows64_with::<false, 2>(lay, idx, d, q, r0, y),
            (OneSource, 1) => vq_fast_rows64_with::<false, 1>(lay, idx, d, q, r0, y),
            (_, b) => unreachable!("the fast byte lookups serve 1 to 3 stages, not {b}"),
        }
    }
}

/// [`vq_fast_rows64`] with the lookup form and the stage count fixed.
///
/// # Safety
/// As [`vq_fast_rows64`]; `BPV == lay.bpv() == lay.stages`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma")]
unsafe fn vq_fast_rows64_with<const TWO_SOURCE: bool, const BPV: usize>(
    lay: &crate::vq::VqLayout,
    idx: &[u8],
    d: &[f32],
    q: &[i8],
    r0: usize,
    y: &mut [f32],
) {
    use crate::vq_fast::QBLOCK;
    debug_assert!(lay.stages == BPV && lay.bpv() == BPV && !lay.packed6);
    assert!(q.len() >= lay.table_len() && d.len() >= lay.nvec.div_ceil(QBLOCK));
    // byte j of stage s's index vector: row j's index byte s
    let mut ix = [_mm512_setzero_si512(); BPV];
    let mut high = [0u64; BPV];
    for (s, (ixs, hs)) in ix.iter_mut().zip(high.iter_mut()).enumerate() {
        let b: [u8; 64] = core::array::from_fn(|j| {
            let off = BPV * j + s;
            if off >= 128 {
                *hs |= 1 << j;
            }
            (off & 127) as u8
        });
        // SAFETY: 64-byte array.
        *ixs = unsafe { _mm512_loadu_si512(b.as_ptr() as *const __m512i) };
    }
    y.fill(0.0);
    let groups = y.len() / 64;
    let goff: Vec<usize> = (0..groups).map(|g| lay.offset(r0 + 64 * g, 0)).collect();
    // per group, the block's sums so far: rows 0..32 and 32..64 in 16 bits
    let mut acc = vec![[_mm512_setzero_si512(); 2]; groups];
    let vstride = lay.vstride();
    let yp = y.as_mut_ptr();
    for v in 0..lay.nvec {
        let vbase = idx.as_ptr().wrapping_add(v * vstride);
        // SAFETY: the tables of (v, 0..BPV) are 256·BPV bytes inside `q` (asserted).
        let tb: [[__m512i; 4]; BPV] = core::array::from_fn(|s| {
            core::array::from_fn(|k| unsafe {
                _mm512_loadu_si512(q.as_ptr().add((v * BPV + s) * 256 + 64 * k) as *const __m512i)
            })
        });
        for (g, &go) in goff.iter().enumerate() {
            let p = vbase.wrapping_add(go);
            prefetch_lines(p.wrapping_add(VQ_PREFETCH_V * lay.block * BPV), 64 * BPV);
            // SAFETY: the group's 64·BPV index bytes are inside `idx` (asserted by the caller).
            let z: [__m512i; BPV] =
                core::array::from_fn(|k| unsafe { _mm512_loadu_si512(p.add(64 * k) as *const __m512i) });
            let [mut lo, mut hi] = acc[g];
            for s in 0..BPV {
                let iv = match BPV {
                    1 => _mm512_permutexvar_epi8(ix[s], z[0]),
                    2 => _mm512_permutex2var_epi8(z[0], ix[s], z[1]),
                    _ => _mm512_mask_permutexvar_epi8(
                        _mm512_permutex2var_epi8(z[0], ix[s], z[1]),
                        high[s],
                        ix[s],
                        z[BPV - 1],
                    ),
                };
                let t = &tb[s];
                let b7 = _mm512_movepi8_mask(iv);
                let look = if TWO_SOURCE {
                    let l = _mm512_permutex2var_epi8(t[0], iv, t[1]);
                    let h = _mm512_permutex2var_epi8(t[2], iv, t[3]);
                    _mm512_mask_blend_epi8(b7, l, h)
                } else {
                    let b6 = _mm512_movepi8_mask(_mm512_add_epi8(iv, iv));
                    let (q1, q3) = (_kandn_mask64(b7, b6), _kand_mask64(b7, b6));
                    let r = _mm512_permutexvar_epi8(iv, t[0]);
                    let r = _mm512_mask_permutexvar_epi8(r, q1, iv, t[1]);
                    let r = _mm512_mask_permutexvar_epi8(r, b7, iv, t[2]);
                    _mm512_mask_permutexvar_epi8(r, q3, iv, t[3])
                };
                lo = _mm512_add_epi16(lo, _mm512_cvtepi8_epi16(_mm512_castsi512_si256(look)));
                hi = _mm512_add_epi16(hi, _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(look)));
            }
            acc[g] = [lo, hi];
        }
        // a block ends: each row's fma(n_b, d_b, ·)
        if (v + 1) % QBLOCK == 0 || v + 1 == lay.nvec {
            let db = _mm512_set1_ps(d[v / QBLOCK]);
            for (g, a) in acc.iter_mut().enumerate() {
                for (h, half) in a.iter().enumerate() {
                    let parts = [_mm512_castsi512_si256(*half), _mm512_extracti64x4_epi64::<1>(*half)];
                    for (k, p16) in parts.iter().enumerate() {
                        let n = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(*p16));
                        // SAFETY: 64g + 32h + 16k + 16 <= y.len().
                        unsafe {
                            let o = yp.add(64 * g + 32 * h + 16 * k);
                            _mm512_storeu_ps(o, _mm512_fmadd_ps(n, db, _mm512_loadu_ps(o)));
                        }
                    }
                }
                *a = [_mm512_setzero_si512(); 2];
            }
        }
    }
}
