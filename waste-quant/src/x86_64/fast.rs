//! AVX2 integer kernels of the fast numeric mode: `crate::fast`'s
//! definition bit for bit (the integer block sums are exact; the scale
//! product, the fused add into the block's eight lanes and the halving
//! reduction are the definition's operations in its order). Run at the
//! AVX-512 level too.

use crate::fast::{GroupStarts, QInput, BLOCK};
use crate::matrix::MatRef;
use core::arch::x86_64::*;
use waste_format::Fmt;

/// The definition's halving reduction of eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce8(a: __m256) -> f32 {
    let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)))
}

/// Rows this kernel computes together (each block of the input loaded once for them).
const ROWS: usize = 4;

/// The passes over `n` rows: each takes row `j` with rows `q + j`, `2q + j`,
/// `3q + j` (`q = ⌈n / ROWS⌉`; fewer at the end), so each of a pass's
/// streams runs on into its next row as the hardware prefetcher follows it.
/// Adjacent rows per pass read as many short interleaved streams: the Q8G
/// head from memory ran at 9.3 GB/s a thread against the exact kernel's
/// 13.2, which takes its rows from two halves for this reason
/// (docs/lab/2026-12-01-30-matvec-streams-the-pool-s-per-call-cost-byte.md; entry 65).
fn passes(n: usize) -> impl Iterator<Item = ([usize; ROWS], usize)> {
    let q = n.div_ceil(ROWS);
    (0..q).map(move |j| {
        let mut rs = [0; ROWS];
        let mut k = 0;
        for t in 0..ROWS {
            if t * q + j < n {
                rs[k] = t * q + j;
                k += 1;
            }
        }
        (rs, k)
    })
}

/// Lane `j` of the result: the exact sum of `w · q` over the block's
/// columns `4j..4j+4`, for 32 codes `w` (signed bytes) and 32 inputs `q`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_i8(w: __m256i, q: __m256i) -> __m256i {
    // |w| (unsigned) times q with w's sign: a product of two signed bytes
    // in maddubs (unsigned × signed); pairs summed to i16 cannot saturate
    // (2 · 128 · 127 < 32 768), then fours to i32
    let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w));
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// The 32 nibbles of a Q4G block (16 bytes at `p`, low nibble first) as
/// unsigned bytes in column order.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q4_nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at p.
    let bytes = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let m = _mm_set1_epi8(15);
    let (lo, hi) = (_mm_and_si128(bytes, m), _mm_and_si128(_mm_srli_epi16(bytes, 4), m));
    _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi))
}

/// Lane `j`: `Σ n·q` over columns `4j..4j+4` for unsigned nibbles `n`.
#[inline]
#[target_feature(enable = "avx2")]
fn dot_nibbles(nib: __m256i, q: __m256i) -> __m256i {
    // unsigned nibble × signed code: pairs ≤ 2 · 15 · 127, no saturation
    _mm256_madd_epi16(_mm256_maddubs_epi16(nib, q), _mm256_set1_epi16(1))
}

/// Row `r`'s weight scale for block `b` of a matrix with `gpr` groups of
/// `g` columns a row (the f16 scale as f32, F16C giving `f16_to_f32`'s bits).
#[inline]
#[target_feature(enable = "f16c")]
fn group_scale(scales: &[u16], (gpr, g): (usize, usize), r: usize, b: usize) -> f32 {
    let h = scales[r * gpr + b * BLOCK / g];
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Each lane's integer start for `vpdpbusd`, from an input block's lane
/// sums `s8` (eight times the four codes' sum): Q4G nibbles go in as they
/// are and start from `−8 Σq` (`−s8`); Q8G codes go in as `w + 128` and
/// start from `−128 Σq` (`−16 · s8`) — either way the lane ends at the
/// definition's `Σ w·q`.
#[inline]
#[target_feature(enable = "avx512f")]
fn vnni_start<const Q4: bool>(s8: __m512i) -> __m512i {
    _mm512_sub_epi32(_mm512_setzero_si512(), if Q4 { s8 } else { _mm512_slli_epi32::<4>(s8) })
}

/// [`vnni_start`] for eight lanes (AVX-VNNI's 256-bit `vpdpbusd`).
#[inline]
#[target_feature(enable = "avx2")]
fn vnni_start_256<const Q4: bool>(s8: __m256i) -> __m256i {
    _mm256_sub_epi32(_mm256_setzero_si256(), if Q4 { s8 } else { _mm256_slli_epi32::<4>(s8) })
}

/// Block `b`'s input codes and lane sums.
///
/// # Safety
/// AVX2 present; `b` a block of `x`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn input_block(x: &QInput, b: usize) -> (__m256i, __m256i) {
    // SAFETY: the block's 32 codes lie inside the padded input; one [i32; 8] a block.
    unsafe {
        (
            _mm256_loadu_si256(x.q.as_ptr().add(b * BLOCK) as *const __m256i),
            _mm256_loadu_si256(x.sum8.as_ptr().add(b) as *const __m256i),
        )
    }
}

/// Reduce the accumulators of rows `rs` (indices into `y`) into `y`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store(acc: &[__m256], y: &mut [f32], rs: &[usize]) {
    for (a, &i) in acc.iter().zip(rs) {
        // SAFETY: AVX2 present (this function's contract).
        y[i] = unsafe { reduce8(*a) };
    }
}

/// `y[i] = W[row0 + i] · x` in the fast mode.
///
/// # Safety
/// AVX2, FMA and F16C present; `m` one `crate::fast::applies` takes, `x`
/// quantized over its padded width, rows `row0..row0 + y.len()` in range.
/// With `avx_vnni` (AVX-VNNI present) the dots are `vpdpbusd`s.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matvec_rows(m: &MatRef<'_>, x: &QInput, row0: usize, y: &mut [f32], avx_vnni: bool) {
    // one loop per format (no branch on it inside)
    // SAFETY: this function's contract.
    unsafe {
        match (m.fmt == Fmt::Q4G, avx_vnni) {
            (true, false) => rows_avx2::<true>(m, x, row0, y),
            (false, false) => rows_avx2::<false>(m, x, row0, y),
            (true, true) => rows_avx2_vnni::<true>(m, x, row0, y),
            (false, true) => rows_avx2_vnni::<false>(m, x, row0, y),
        }
    }
}

/// Defines [`rows_avx2`] and [`rows_avx2_vnni`] from one loop (as
/// [`multi_nt!`]: the plain form never built with AVX-VNNI on).
macro_rules! rows_fast {
    ($(#[$doc:meta])* $name:ident, $feat:literal, $vnni:literal) => {
        $(#[$doc])*
        #[target_feature(enable = $feat)]
        unsafe fn $name<const Q4: bool>(m: &MatRef<'_>, x: &QInput, row0: usize, y: &mut [f32]) {
            let (rbs, g, gpr) = (m.row_bytes(), m.group, m.groups());
            let bbytes = if Q4 { BLOCK / 2 } else { BLOCK };
            for (rs, k) in passes(y.len()) {
                let rows: [usize; ROWS] = core::array::from_fn(|t| row0 + rs[t.min(k - 1)]);
                let rp: [*const u8; ROWS] = rows.map(|r| m.data.as_ptr().wrapping_add(r * rbs));
                let mut acc = [_mm256_setzero_ps(); ROWS];
                let mut wsv = [_mm256_setzero_ps(); ROWS];
                let mut starts = GroupStarts::new(g);
                for (b, db) in x.d.iter().enumerate() {
                    if starts.next() {
                        for (w, &r) in wsv.iter_mut().zip(&rows) {
                            *w = _mm256_set1_ps(group_scale(m.scales, (gpr, g), r, b));
                        }
                    }
                    // SAFETY: b is a block of x; AVX2 present.
                    let (xq, s8) = unsafe { input_block(x, b) };
                    let start = vnni_start_256::<Q4>(s8);
                    let dv = _mm256_broadcast_ss(db);
                    for &r in &rp {
                        super::prefetch_block(r, b * bbytes, bbytes);
                    }
                    let mut p = [_mm256_setzero_si256(); ROWS];
                    if Q4 {
                        for t in (0..ROWS).step_by(2) {
                            // SAFETY: the block's 16 bytes of both rows.
                            let (na, nb) =
                                unsafe { q4_nibbles_2rows(rp[t].wrapping_add(b * bbytes), rp[t + 1].wrapping_add(b * bbytes)) };
                            if $vnni {
                                // SAFETY: only the AVX-VNNI instance reaches this (see the Q8G arm)
                                #[allow(unused_unsafe)]
                                unsafe {
                                    p[t] = _mm256_dpbusd_avx_epi32(start, na, xq);
                                    p[t + 1] = _mm256_dpbusd_avx_epi32(start, nb, xq);
                                }
                            } else {
                                p[t] = _mm256_sub_epi32(dot_nibbles(na, xq), s8);
                                p[t + 1] = _mm256_sub_epi32(dot_nibbles(nb, xq), s8);
                            }
                        }
                    } else {
                        for (pt, &r) in p.iter_mut().zip(&rp) {
                            // SAFETY: the block's 32 bytes of the row.
                            let w = unsafe { _mm256_loadu_si256(r.wrapping_add(b * bbytes) as *const __m256i) };
                            *pt = if $vnni {
                                // SAFETY: only the AVX-VNNI instance reaches this (the feature enabled
                                // there; needless there, needed in the plain one's dead branch). The
                                // codes go in as w + 128 from −128 Σq: Σ w·q.
                                #[allow(unused_unsafe)]
                                unsafe {
                                    _mm256_dpbusd_avx_epi32(start, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), xq)
                                }
                            } else {
                                // SAFETY: AVX2 enabled here.
                                unsafe { dot_i8(w, xq) }
                            };
                        }
                    }
                    for t in 0..ROWS {
                        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(wsv[t], dv), _mm256_cvtepi32_ps(p[t]), acc[t]);
                    }
                }
                // SAFETY: AVX2 present.
                unsafe { store(&acc[..k], y, &rs[..k]) };
            }
        }
    };
}

rows_fast!(
    /// [`matvec_rows`] for Q4G (`Q4`) or Q8G: [`ROWS`] rows a pass (a
    /// missing row repeats the pass's last, computed and not stored, so the
    /// accumulators stay in registers), the group scales converted once a
    /// group, the input's block scale broadcast once a block for the four
    /// rows, and a pair of rows' Q4G nibbles split in one register.
    rows_avx2,
    "avx2,fma,f16c",
    false
);
rows_fast!(
    /// [`rows_avx2`] with AVX-VNNI's `vpdpbusd` for the dots.
    rows_avx2_vnni,
    "avx2,fma,f16c,avxvnni",
    true
);

/// One Q4G block of two rows (16 bytes at `a`, 16 at `b`) split in one
/// register: per 128-bit lane (row `a` in the low one), columns 0..15 in
/// the first result and 16..31 in the second (unsigned bytes).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q4_split_2rows(a: *const u8, b: *const u8) -> (__m256i, __m256i) {
    // SAFETY: the caller guarantees 16 readable bytes at a and at b.
    let bytes = unsafe {
        _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(a as *const __m128i)),
            _mm_loadu_si128(b as *const __m128i),
            1,
        )
    };
    let m = _mm256_set1_epi8(15);
    let (lo, hi) = (_mm256_and_si256(bytes, m), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m));
    (_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi))
}

/// One Q4G block of two rows (16 bytes at `a`, 16 at `b`) as each row's 32
/// nibbles in column order (unsigned bytes).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q4_nibbles_2rows(a: *const u8, b: *const u8) -> (__m256i, __m256i) {
    // SAFETY: the caller's contract.
    let (u, v) = unsafe { q4_split_2rows(a, b) };
    (_mm256_permute2x128_si256(u, v, 0x20), _mm256_permute2x128_si256(u, v, 0x31))
}

/// [`matvec_rows`] with AVX-512 VNNI: a block of two rows' integer sums
/// per instruction, each block still fused into each row's eight lanes in
/// order — the same bits.
///
/// # Safety
/// As [`matvec_rows`], and AVX-512 F/BW/VL/DQ with VNNI present.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn matvec_rows_vnni(m: &MatRef<'_>, x: &QInput, row0: usize, y: &mut [f32]) {
    // SAFETY: this function's contract.
    unsafe {
        if m.fmt == Fmt::Q4G {
            rows_vnni::<true>(m, x, row0, y)
        } else {
            rows_vnni::<false>(m, x, row0, y)
        }
    }
}

/// [`matvec_rows_vnni`] for Q4G (`Q4`) or Q8G: [`ROWS`] rows a pass (from
/// [`passes`]' quarters) as two pairs, a pair's block in one 512-bit
/// register (the first row's 32 weights, then the second's) dotted with
/// the input block broadcast to both halves by one `vpdpbusd` — the rows'
/// transpose of [`matmat_rows_vnni`]'s pairs of inputs. Q8G codes go in as
/// `w + 128` from `−128 Σq`, Q4G nibbles from `−8 Σq`: each lane ends at
/// the definition's exact `Σ w·q`, fused as `fma(s_g · d_b, sum, lane)` in
/// block order. Two blocks a register of one row (the form before) spent
/// more operations on the nibbles and on each block's eight-lane float
/// steps: Q4G from memory ran at 10.3 GB/s a thread against exact's 13.4.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_vnni<const Q4: bool>(m: &MatRef<'_>, x: &QInput, row0: usize, y: &mut [f32]) {
    let (rbs, g, gpr) = (m.row_bytes(), m.group, m.groups());
    let bbytes = if Q4 { BLOCK / 2 } else { BLOCK };
    for (rs, k) in passes(y.len()) {
        // two pairs; a missing row repeats the pass's last (computed, not stored)
        let rows: [usize; ROWS] = core::array::from_fn(|t| row0 + rs[t.min(k - 1)]);
        let mut acc = [_mm512_setzero_ps(); 2];
        let mut wsv = [_mm512_setzero_ps(); 2];
        let mut starts = GroupStarts::new(g);
        for (b, db) in x.d.iter().enumerate() {
            if starts.next() {
                // a new weight group: each pair's two scales, eight lanes each
                for (p, w) in wsv.iter_mut().enumerate() {
                    let h = |r: usize| group_scale(m.scales, (gpr, g), r, b);
                    let (lo, hi) = (_mm256_set1_ps(h(rows[2 * p])), _mm256_set1_ps(h(rows[2 * p + 1])));
                    *w = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
                }
            }
            // the input block in both halves, each lane's start, its scale
            // SAFETY: the block's 32 codes and 8 lane sums lie inside the padded input.
            let (q, s8) = unsafe {
                (
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(x.q.as_ptr().add(b * BLOCK) as *const __m256i)),
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(x.sum8.as_ptr().add(b) as *const __m256i)),
                )
            };
            let st = vnni_start::<Q4>(s8);
            let dv = _mm512_set1_ps(*db);
            for (p, a) in acc.iter_mut().enumerate() {
                let (ra, rb) = (
                    m.data.as_ptr().wrapping_add(rows[2 * p] * rbs),
                    m.data.as_ptr().wrapping_add(rows[2 * p + 1] * rbs),
                );
                super::prefetch_block(ra, b * bbytes, bbytes);
                super::prefetch_block(rb, b * bbytes, bbytes);
                let (ba, bb) = (ra.wrapping_add(b * bbytes), rb.wrapping_add(b * bbytes));
                // SAFETY: the block's 16 (Q4G) or 32 (Q8G) bytes of both rows.
                let w = unsafe {
                    if Q4 {
                        q4_nibbles_pair(ba, bb)
                    } else {
                        let z = _mm512_inserti64x4(
                            _mm512_castsi256_si512(_mm256_loadu_si256(ba as *const __m256i)),
                            _mm256_loadu_si256(bb as *const __m256i),
                            1,
                        );
                        _mm512_xor_si512(z, _mm512_set1_epi8(-128))
                    }
                };
                let s = _mm512_dpbusd_epi32(st, w, q);
                *a = _mm512_fmadd_ps(_mm512_mul_ps(wsv[p], dv), _mm512_cvtepi32_ps(s), *a);
            }
        }
        for (p, a) in acc.iter().enumerate() {
            let (lo, hi) =
                (_mm512_castps512_ps256(*a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(*a), 1)));
            for (h, v) in [(0, lo), (1, hi)] {
                if 2 * p + h < k {
                    // SAFETY: AVX2 present.
                    y[rs[2 * p + h]] = unsafe { reduce8(v) };
                }
            }
        }
    }
}

/// One Q4G block of two rows (16 bytes at `a`, 16 at `b`) as 64 unsigned
/// bytes: the first row's 32 nibbles in column order, then the second's.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn q4_nibbles_pair(a: *const u8, b: *const u8) -> __m512i {
    // SAFETY: the caller's contract.
    let (u, v) = unsafe { q4_split_2rows(a, b) };
    // [u0 u1 v0 v1] → [u0 v0 u1 v1]: the first row's 32 columns, then the second's
    let z = _mm512_inserti64x4(_mm512_castsi256_si512(u), v, 1);
    _mm512_shuffle_i64x2(z, z, 0b11_01_10_00)
}

/// Tokens [`matmat_rows`] computes together (each weight block decoded once for them).
pub const TOKENS: usize = 8;

/// `outs[t][i] = W[row0 + i] · xs[t]` for up to [`TOKENS`] inputs: each
/// row's weight blocks decoded once for all of them, every dot the
/// definition's (the same per-token operations in the same order as
/// [`matvec_rows`]). With `avx_vnni` the Q4G dots are AVX-VNNI
/// `vpdpbusd`s from the correction as start: one instruction for `maddubs`,
/// `madd` and the subtraction.
///
/// # Safety
/// As [`matvec_rows`], for every input; `xs.len() == outs.len() ≤ TOKENS`,
/// every output the same length; with `avx_vnni`, AVX-VNNI present.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn matmat_rows(m: &MatRef<'_>, xs: &[QInput], row0: usize, outs: &mut [&mut [f32]], avx_vnni: bool) {
    // SAFETY: this function's contract.
    unsafe {
        match (m.fmt == Fmt::Q4G, avx_vnni) {
            (true, true) => multi_avx2_vnni(m, xs, row0, outs),
            (true, false) => multi_avx2::<true>(m, xs, row0, outs),
            (false, _) => multi_avx2::<false>(m, xs, row0, outs),
        }
    }
}

/// `$f::<G…, NT>$args` with the input count `NT` = `$n` fixed at compile
/// time (1 to 8: the accumulators stay in registers).
macro_rules! by_inputs {
    ($n:expr, $f:ident, [$($g:tt)*], $args:tt) => {
        match $n {
            1 => $f::<$($g)* 1> $args,
            2 => $f::<$($g)* 2> $args,
            3 => $f::<$($g)* 3> $args,
            4 => $f::<$($g)* 4> $args,
            5 => $f::<$($g)* 5> $args,
            6 => $f::<$($g)* 6> $args,
            7 => $f::<$($g)* 7> $args,
            _ => $f::<$($g)* 8> $args,
        }
    };
}

/// [`matmat_rows`]'s Q4G form with AVX-VNNI.
///
/// # Safety
/// As [`matmat_rows`], and AVX-VNNI present.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn multi_avx2_vnni(m: &MatRef<'_>, xs: &[QInput], row0: usize, outs: &mut [&mut [f32]]) {
    // SAFETY: this function's contract.
    unsafe { by_inputs!(xs.len(), multi_vnni_nt, [true,], (m, xs, row0, outs)) }
}

/// [`matmat_rows`] for Q4G (`Q4`) or Q8G by `maddubs` / `madd`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn multi_avx2<const Q4: bool>(m: &MatRef<'_>, xs: &[QInput], row0: usize, outs: &mut [&mut [f32]]) {
    // SAFETY: this function's contract.
    unsafe { by_inputs!(xs.len(), multi_avx2_nt, [Q4,], (m, xs, row0, outs)) }
}

/// Defines [`multi_avx2_nt`] and [`multi_vnni_nt`]: one loop, compiled
/// for AVX2 and for AVX2 with AVX-VNNI (a function's target features are
/// the compiler's to use; the plain form must not be built with VNNI on).
macro_rules! multi_nt {
    ($(#[$doc:meta])* $name:ident, $feat:literal, $vnni:literal) => {
        $(#[$doc])*
        #[target_feature(enable = $feat)]
        unsafe fn $name<const Q4: bool, const NT: usize>(
            m: &MatRef<'_>,
            xs: &[QInput],
            row0: usize,
            outs: &mut [&mut [f32]],
        ) {
            let (rbs, g, gpr) = (m.row_bytes(), m.group, m.groups());
            let bbytes = if Q4 { BLOCK / 2 } else { BLOCK };
            let n = outs.first().map_or(0, |o| o.len());
            let nb = xs.first().map_or(0, |x| x.d.len());
            let xs: &[QInput; NT] = xs.try_into().expect("NT inputs");
            // Q4G: the inputs as unsigned codes `q + 128`, block-major (block b's
            // inputs side by side), against signed weights `n − 8`: `Σ (q+128)(n−8)
            // − 128 Σ (n−8)` is the definition's `Σ (n−8)·q`, its correction once a
            // row's block for every input (no per-input lane sums to load)
            let qu: Vec<u8> = if Q4 {
                let mut v = vec![0u8; nb * NT * BLOCK];
                for b in 0..nb {
                    for (t, x) in xs.iter().enumerate() {
                        for (o, &c) in v[(b * NT + t) * BLOCK..][..BLOCK].iter_mut().zip(&x.q[b * BLOCK..(b + 1) * BLOCK]) {
                            *o = (c as u8) ^ 0x80;
                        }
                    }
                }
                v
            } else {
                Vec::new()
            };
            // Q4G: block b's input scales side by side (lanes past NT zero)
            let dt: Vec<[f32; 8]> = if Q4 {
                (0..nb).map(|b| core::array::from_fn(|t| if t < NT { xs[t].d[b] } else { 0.0 })).collect()
            } else {
                Vec::new()
            };
            let mut dd = [0f32; 8];
            // the products are read back by broadcast loads (load ports), not
            // shuffles (the vector ports this loop is bound by)
            let ddp: *const f32 = core::hint::black_box(dd.as_ptr());
            for i in 0..n {
                let r = row0 + i;
                let mut acc = [_mm256_setzero_ps(); NT];
                let mut wsv = _mm256_setzero_ps();
                // SAFETY: row r of the matrix.
                let row = unsafe { m.data.as_ptr().add(r * rbs) };
                let mut starts = GroupStarts::new(g);
                for b in 0..nb {
                    if starts.next() {
                        wsv = _mm256_set1_ps(group_scale(m.scales, (gpr, g), r, b));
                    }
                    super::prefetch_block(row, b * bbytes, bbytes);
                    let rb = row.wrapping_add(b * bbytes);
                    if Q4 {
                        // SAFETY: dt[b] and dd are 8 floats.
                        unsafe { _mm256_storeu_ps(dd.as_mut_ptr(), _mm256_mul_ps(wsv, _mm256_loadu_ps(dt[b].as_ptr()))) };
                        // SAFETY: 16 bytes of the row.
                        let w = _mm256_sub_epi8(unsafe { q4_nibbles(rb) }, _mm256_set1_epi8(8));
                        let c = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(-128), w), _mm256_set1_epi16(1));
                        let negc = _mm256_sub_epi32(_mm256_setzero_si256(), c);
                        for (t, a) in acc.iter_mut().enumerate() {
                            // SAFETY: block b of input t in `qu`; ddp is dd.
                            let (q, d) = unsafe {
                                (
                                    _mm256_loadu_si256(qu.as_ptr().add((b * NT + t) * BLOCK) as *const __m256i),
                                    _mm256_broadcast_ss(&*ddp.add(t)),
                                )
                            };
                            let p = if $vnni {
                                // SAFETY: only the AVX-VNNI instance reaches this (the feature
                                // enabled there; needless there, needed in the plain one's dead branch)
                                #[allow(unused_unsafe)]
                                unsafe {
                                    _mm256_dpbusd_avx_epi32(negc, q, w)
                                }
                            } else {
                                _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(q, w), _mm256_set1_epi16(1)), c)
                            };
                            *a = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), *a);
                        }
                    } else {
                        // SAFETY: 32 bytes of the row.
                        let w = unsafe { _mm256_loadu_si256(rb as *const __m256i) };
                        let u = _mm256_sign_epi8(w, w);
                        for (a, x) in acc.iter_mut().zip(xs) {
                            // SAFETY: the block's codes of this input.
                            let q = unsafe { _mm256_loadu_si256(x.q.as_ptr().add(b * BLOCK) as *const __m256i) };
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(q, w)), _mm256_set1_epi16(1));
                            let d = _mm256_mul_ps(wsv, _mm256_broadcast_ss(&x.d[b]));
                            *a = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), *a);
                        }
                    }
                }
                for (o, a) in outs.iter_mut().zip(&acc) {
                    // SAFETY: AVX2 present.
                    o[i] = unsafe { reduce8(*a) };
                }
            }
        }
    };
}

multi_nt!(
    /// [`multi_avx2`] with its input count fixed (the accumulators in
    /// registers): a row at a time, its group scale converted once a group.
    /// For Q4G the inputs are laid out block-major (one pointer, no per-input
    /// reloads) and the products `s_g · d_b` of a row's block are one multiply
    /// for all the inputs, each then broadcast from memory: the multiply ports
    /// (maddubs, madd, convert, FMA) bound this loop, and a multiply per input
    /// was a fifth of their work. With the per-block division gone
    /// ([`GroupStarts`]) the Q4G matmat went from 10.4 to 8.3–8.5 ms (9216 ×
    /// 2304 × 16 inputs, one thread, Intel Xeon; docs/lab entry 70).
    multi_avx2_nt,
    "avx2,fma,f16c",
    false
);
multi_nt!(
    /// [`multi_avx2_nt`] with AVX-VNNI's `vpdpbusd` for the Q4G dots (Q4G only).
    multi_vnni_nt,
    "avx2,fma,f16c,avxvnni",
    true
);

/// Inputs [`matmat_rows_vnni`] computes together: pairs of them, a pair's
/// block in one 512-bit register (the first input's eight lanes, then the
/// second's), so one `vpdpbusd` gives both inputs' sums of a weight block.
pub const VNNI_TOKENS: usize = 8;

/// The inputs of one [`matmat_rows_vnni`] call laid out by pair and block:
/// per pair `p` and block `b`, the two inputs' 32 codes each, the integer
/// correction each lane starts from, and each lane's input scale.
struct PairedInputs {
    codes: Vec<__m512i>,
    start: Vec<__m512i>,
    scale: Vec<__m512>,
    nb: usize,
}

impl PairedInputs {
    /// Pair `xs` (the last pair's second half zero when their number is
    /// odd), each lane starting from [`vnni_start`] for Q4G (`Q4`) or Q8G.
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    fn new<const Q4: bool>(xs: &[QInput]) -> PairedInputs {
        let nb = xs.first().map_or(0, |x| x.d.len());
        let np = xs.len().div_ceil(2);
        let (mut codes, mut start, mut scale) =
            (Vec::with_capacity(np * nb), Vec::with_capacity(np * nb), Vec::with_capacity(np * nb));
        for pair in xs.chunks(2) {
            for b in 0..nb {
                let mut c = [0i8; 2 * BLOCK];
                let mut s = [0i32; 16];
                let mut d = [0f32; 16];
                for (h, x) in pair.iter().enumerate() {
                    c[h * BLOCK..(h + 1) * BLOCK].copy_from_slice(&x.q[b * BLOCK..(b + 1) * BLOCK]);
                    for j in 0..8 {
                        s[8 * h + j] = x.sum8[b][j];
                        d[8 * h + j] = x.d[b];
                    }
                }
                // SAFETY: 64-byte arrays; AVX-512 F present (this function's features).
                unsafe {
                    codes.push(_mm512_loadu_si512(c.as_ptr() as *const __m512i));
                    start.push(vnni_start::<Q4>(_mm512_loadu_si512(s.as_ptr() as *const __m512i)));
                    scale.push(_mm512_loadu_ps(d.as_ptr()));
                }
            }
        }
        PairedInputs { codes, start, scale, nb }
    }
}

/// `outs[t][i] = W[row0 + i] · xs[t]` for up to [`VNNI_TOKENS`] inputs with
/// AVX-512 VNNI: each weight block decoded once, broadcast to both halves
/// of a register and dotted with a pair of inputs per `vpdpbusd`; each
/// lane's sum is the definition's exact integer, fused into its input's
/// eight lanes as `fma(s_g · d_b, sum, lane)` in block order, the lanes
/// reduced as the definition does — the same bits as [`matmat_rows`].
///
/// # Safety
/// As [`matmat_rows`] with `xs.len() ≤ VNNI_TOKENS`, and AVX-512
/// F/BW/VL/DQ with VNNI present.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn matmat_rows_vnni(m: &MatRef<'_>, xs: &[QInput], row0: usize, outs: &mut [&mut [f32]]) {
    let q4 = m.fmt == Fmt::Q4G;
    // SAFETY: this function's contract.
    unsafe {
        if q4 {
            multi_vnni::<true>(m, &PairedInputs::new::<true>(xs), row0, outs)
        } else {
            multi_vnni::<false>(m, &PairedInputs::new::<false>(xs), row0, outs)
        }
    }
}

/// [`matmat_rows_vnni`] for Q4G (`Q4`) or Q8G, `NP` pairs of inputs:
/// [`ROWS`] rows a pass (from [`passes`]' quarters), so each pair's codes,
/// starts and scales, loaded once a block, serve four rows (one row a pass
/// read them from L2 for every row: 31 G weights/s against exact's 47).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn multi_vnni<const Q4: bool>(m: &MatRef<'_>, px: &PairedInputs, row0: usize, outs: &mut [&mut [f32]]) {
    // SAFETY (every call): this function's contract.
    unsafe {
        match outs.len().div_ceil(2) {
            1 => multi_vnni_np::<Q4, 1>(m, px, row0, outs),
            2 => multi_vnni_np::<Q4, 2>(m, px, row0, outs),
            3 => multi_vnni_np::<Q4, 3>(m, px, row0, outs),
            _ => multi_vnni_np::<Q4, 4>(m, px, row0, outs),
        }
    }
}

/// [`multi_vnni`] with its pair count fixed (the accumulators in registers).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn multi_vnni_np<const Q4: bool, const NP: usize>(
    m: &MatRef<'_>,
    px: &PairedInputs,
    row0: usize,
    outs: &mut [&mut [f32]],
) {
    let n = outs.first().map_or(0, |o| o.len());
    for (rs, k) in passes(n) {
        if k == ROWS {
            // SAFETY: rows of the matrix; this function's contract.
            unsafe { vnni_pass::<Q4, NP, ROWS>(m, px, row0, &rs, outs) };
        } else {
            for r in &rs[..k] {
                // SAFETY: as above.
                unsafe { vnni_pass::<Q4, NP, 1>(m, px, row0, core::slice::from_ref(r), outs) };
            }
        }
    }
}

/// Rows `rs` (`R` of them, indices into the outputs) of [`multi_vnni`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn vnni_pass<const Q4: bool, const NP: usize, const R: usize>(
    m: &MatRef<'_>,
    px: &PairedInputs,
    row0: usize,
    rs: &[usize],
    outs: &mut [&mut [f32]],
) {
    let (rbs, g, gpr, nb, nt) = (m.row_bytes(), m.group, m.groups(), px.nb, outs.len());
    let bbytes = if Q4 { BLOCK / 2 } else { BLOCK };
    let mut acc = [[_mm512_setzero_ps(); NP]; R];
    let rows: [usize; R] = core::array::from_fn(|t| row0 + rs[t]);
    let mut wsv = [_mm512_setzero_ps(); R];
    let mut starts = GroupStarts::new(g);
    for b in 0..nb {
        let mut w = [_mm512_setzero_si512(); R];
        if starts.next() {
            // a new weight group: its rows' scales (once a group, not a block)
            for t in 0..R {
                wsv[t] = _mm512_set1_ps(group_scale(m.scales, (gpr, g), rows[t], b));
            }
        }
        for t in 0..R {
            let r = rows[t];
            // SAFETY: row r of the matrix.
            let row = unsafe { m.data.as_ptr().add(r * rbs) };
            super::prefetch_block(row, b * bbytes, bbytes);
            let rb = row.wrapping_add(b * bbytes);
            // the block's 32 weights as unsigned bytes, in both halves
            // SAFETY: 16 (Q4G) or 32 (Q8G) bytes of the row.
            let v = unsafe {
                if Q4 {
                    q4_nibbles(rb)
                } else {
                    _mm256_xor_si256(_mm256_loadu_si256(rb as *const __m256i), _mm256_set1_epi8(-128))
                }
            };
            w[t] = _mm512_broadcast_i64x4(v);
        }
        for p in 0..NP {
            let k = p * nb + b;
            let (c, st, sc) = (px.codes[k], px.start[k], px.scale[k]);
            for t in 0..R {
                let s = _mm512_dpbusd_epi32(st, w[t], c);
                acc[t][p] = _mm512_fmadd_ps(_mm512_mul_ps(wsv[t], sc), _mm512_cvtepi32_ps(s), acc[t][p]);
            }
        }
    }
    for t in 0..R {
        for (p, a) in acc[t].iter().enumerate() {
            let (lo, hi) =
                (_mm512_castps512_ps256(*a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(*a), 1)));
            // SAFETY: AVX2 present.
            outs[2 * p][rs[t]] = unsafe { reduce8(lo) };
            if 2 * p + 1 < nt {
                // SAFETY: AVX2 present.
                outs[2 * p + 1][rs[t]] = unsafe { reduce8(hi) };
            }
        }
    }
}

/// One full block of the activations' codes ([`crate::fast::quantize_at`]'s
/// definition, bit for bit): `amax` the largest `|v|` ignoring NaNs (as
/// `f32::max` folds), then per value `v / d` (the same IEEE division),
/// rounded half away from zero (`t = trunc(y)`, `y − t` is exact, one away
/// from zero where `|y − t| ≥ 0.5`), clamped to `±qmax`, NaN to 0 (as `as
/// i8`). Returns the block's scale `d` (0 for an all-zero block, whose codes
/// stay 0).
///
/// # Safety
/// AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize_block(x: &[f32; BLOCK], qmax: f32, q: &mut [i8; BLOCK]) -> f32 {
    // SAFETY: 32 floats in x, 32 bytes in q.
    unsafe {
        let v: [__m256; 4] = core::array::from_fn(|k| _mm256_loadu_ps(x.as_ptr().add(8 * k)));
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        // max_ps returns its second operand when either is NaN: the running
        // maximum second, so a NaN value is skipped as f32::max skips it
        let mut m = _mm256_setzero_ps();
        for vk in v {
            m = _mm256_max_ps(_mm256_and_ps(vk, abs), m);
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
        if amax == 0.0 {
            return 0.0;
        }
        let d = amax / qmax;
        let (dv, hi, lo) = (_mm256_set1_ps(d), _mm256_set1_ps(qmax), _mm256_set1_ps(-qmax));
        let (half, one, sign) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
        let codes: [__m256i; 4] = core::array::from_fn(|k| {
            let y = _mm256_div_ps(v[k], dv);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            let away = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_and_ps(_mm256_sub_ps(y, t), abs), half);
            let step = _mm256_and_ps(away, _mm256_or_ps(_mm256_and_ps(y, sign), one));
            let r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, step), lo), hi);
            // NaN (max_ps gave `lo` for it) to 0, as `as i8` makes it
            let r = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(y, y), r);
            _mm256_cvtps_epi32(r)
        });
        let w = _mm256_packs_epi32(codes[0], codes[1]);
        let z = _mm256_packs_epi32(codes[2], codes[3]);
        // the packs interleave 128-bit lanes: dwords 0, 4, 1, 5, 2, 6, 3, 7 hold the values in order
        let b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w, z), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, b);
        d
    }
}
