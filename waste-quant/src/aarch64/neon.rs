//! AArch64 Advanced SIMD (NEON) kernels. NEON is baseline on every aarch64
//! CPU, so nothing here is detected at run time. Each kernel reproduces the
//! scalar canonical order exactly (see `scalar.rs`): the 32 canonical lanes
//! are eight 4-lane accumulators, `vfmaq_f32` is the same fused
//! multiply-add as `f32::mul_add`, and the halving reduction adds the same
//! pairs in the same order — so results are bit-identical to every level.
//!
//! The optional extensions (`dotprod`, `fp16` arithmetic, `i8mm`) are not
//! used: each would change the order or the precision of the sums (integer
//! dot products of quantized activations, half-precision accumulation), so
//! none can reproduce the canonical definition. (The `fast` numeric mode's
//! integer dots are a definition of their own: `super::fast`, with the base
//! ISA's `smull`.) Half → single conversion is
//! `fcvtl`, part of the base ISA (inline assembly: the `float16x4_t`
//! intrinsics are not stable Rust).

use crate::matrix::MatRef;
use crate::scalar::LANES;
use crate::vq::{VqBook, VqLayout};
use core::arch::aarch64::*;
use core::arch::asm;
use waste_format::Fmt;

/// Eight 4-lane accumulators: canonical lanes `4k..4k+4` live in `acc[k]`.
type Acc = [float32x4_t; 8];

#[inline(always)]
fn zero() -> Acc {
    // SAFETY: NEON is baseline on aarch64.
    unsafe { [vdupq_n_f32(0.0); 8] }
}

/// The canonical halving reduction: lane i + lane i+16, then +8, +4, +2, +1.
#[inline(always)]
fn reduce(a: &Acc) -> f32 {
    // SAFETY: NEON is baseline on aarch64.
    unsafe {
        let s: [float32x4_t; 4] = core::array::from_fn(|k| vaddq_f32(a[k], a[k + 4]));
        let t0 = vaddq_f32(s[0], s[2]);
        let t1 = vaddq_f32(s[1], s[3]);
        let u = vaddq_f32(t0, t1);
        let p = vadd_f32(vget_low_f32(u), vget_high_f32(u));
        vget_lane_f32::<0>(p) + vget_lane_f32::<1>(p)
    }
}

/// Four IEEE binary16 values to f32 (`fcvtl`: exact, subnormals kept, a
/// NaN quieted exactly as `f16_to_f32` does).
#[inline(always)]
pub fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: a pure register-to-register conversion of the base ISA.
    unsafe {
        asm!("fcvtl {o:v}.4s, {i:v}.4h", o = lateout(vreg) out, i = in(vreg) h, options(pure, nomem, nostack, preserves_flags));
    }
    out
}

/// The upper four binary16 values of `h` to f32 (`fcvtl2`).
#[inline(always)]
fn f16x8_high_to_f32(h: uint16x8_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: as `f16x4_to_f32`.
    unsafe {
        asm!("fcvtl2 {o:v}.4s, {i:v}.8h", o = lateout(vreg) out, i = in(vreg) h, options(pure, nomem, nostack, preserves_flags));
    }
    out
}

/// Signed 8-bit lanes × `scale` as f32, eight values from `q`.
#[inline(always)]
unsafe fn s16x8_scaled(q: int16x8_t, s: float32x4_t) -> [float32x4_t; 2] {
    // SAFETY: NEON baseline.
    unsafe { [vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(q))), s), vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(q)), s)] }
}

/// Load 32 weights of row bytes `rb` at column `c` (`c % 32 == 0`; for
/// grouped formats the 32 share `scale`), each exactly as `MatRef::dequant`
/// computes it.
#[inline(always)]
unsafe fn load32(fmt: Fmt, rb: *const u8, c: usize, scale: f32) -> Acc {
    // SAFETY (all arms): the caller guarantees the row holds columns c..c+32.
    unsafe {
        match fmt {
            Fmt::F32 => {
                let p = rb.add(c * 4) as *const f32;
                core::array::from_fn(|k| vld1q_f32(p.add(4 * k)))
            }
            Fmt::F16 => {
                let p = rb.add(c * 2) as *const u16;
                let h: [uint16x8_t; 4] = core::array::from_fn(|k| vld1q_u16(p.add(8 * k)));
                core::array::from_fn(|k| {
                    let v = h[k / 2];
                    if k % 2 == 0 {
                        f16x4_to_f32(vget_low_u16(v))
                    } else {
                        f16x8_high_to_f32(v)
                    }
                })
            }
            Fmt::Bf16 => {
                let p = rb.add(c * 2) as *const u16;
                let h: [uint16x8_t; 4] = core::array::from_fn(|k| vld1q_u16(p.add(8 * k)));
                core::array::from_fn(|k| {
                    let v = h[k / 2];
                    let w = if k % 2 == 0 { vshll_n_u16::<16>(vget_low_u16(v)) } else { vshll_high_n_u16::<16>(v) };
                    vreinterpretq_f32_u32(w)
                })
            }
            Fmt::Q8G => {
                let s = vdupq_n_f32(scale);
                let b0 = vld1q_s8(rb.add(c) as *const i8);
                let b1 = vld1q_s8(rb.add(c + 16) as *const i8);
                let [a0, a1] = s16x8_scaled(vmovl_s8(vget_low_s8(b0)), s);
                let [a2, a3] = s16x8_scaled(vmovl_high_s8(b0), s);
                let [a4, a5] = s16x8_scaled(vmovl_s8(vget_low_s8(b1)), s);
                let [a6, a7] = s16x8_scaled(vmovl_high_s8(b1), s);
                [a0, a1, a2, a3, a4, a5, a6, a7]
            }
            Fmt::Q4G => {
                let s = vdupq_n_f32(scale);
                let b = vld1q_u8(rb.add(c / 2));
                let lo = vandq_u8(b, vdupq_n_u8(0x0f));
                let hi = vshrq_n_u8::<4>(b);
                // column 2i is byte i's low nibble, 2i+1 its high one
                let e0 = vzip1q_u8(lo, hi);
                let e1 = vzip2q_u8(lo, hi);
                let eight = vdupq_n_s16(8);
                let w = |u: uint16x8_t| vsubq_s16(vreinterpretq_s16_u16(u), eight);
                let [a0, a1] = s16x8_scaled(w(vmovl_u8(vget_low_u8(e0))), s);
                let [a2, a3] = s16x8_scaled(w(vmovl_high_u8(e0)), s);
                let [a4, a5] = s16x8_scaled(w(vmovl_u8(vget_low_u8(e1))), s);
                let [a6, a7] = s16x8_scaled(w(vmovl_high_u8(e1)), s);
                [a0, a1, a2, a3, a4, a5, a6, a7]
            }
        }
    }
}

/// `acc[k] = fma(w[k], x[4k..4k+4], acc[k])`.
#[inline(always)]
unsafe fn fma8(acc: &mut Acc, w: &Acc, x: *const f32) {
    // SAFETY: the caller guarantees 32 readable floats at x.
    unsafe {
        for k in 0..8 {
            acc[k] = vfmaq_f32(acc[k], w[k], vld1q_f32(x.add(4 * k)));
        }
    }
}

/// Whether each 32-column block of `m` lies in one scale group (or the
/// format has none), so blocks load straight from the row bytes.
fn fused(m: &MatRef<'_>) -> bool {
    !m.fmt.is_grouped() || m.group.is_multiple_of(LANES)
}

/// The scale of the group holding column `c` of row `r` (0 when ungrouped).
#[inline(always)]
fn scale_at(m: &MatRef<'_>, r: usize, c: usize) -> f32 {
    if m.fmt.is_grouped() {
        waste_format::half::f16_to_f32(m.scales[r * m.groups() + c / m.group])
    } else {
        0.0
    }
}

/// The zero-padded last partial block of row `r` (columns `full..cols`).
fn tail_fma(m: &MatRef<'_>, r: usize, full: usize, x: &[f32], acc: &mut Acc) {
    let mut wt = [0f32; LANES];
    let mut xt = [0f32; LANES];
    let n = m.cols - full;
    m.dequant(r, full, &mut wt[..n]);
    xt[..n].copy_from_slice(&x[full..]);
    // SAFETY: both tails are 32 floats.
    unsafe { fma8(acc, &load32(Fmt::F32, wt.as_ptr() as *const u8, 0, 0.0), xt.as_ptr()) };
}

/// Rows per pass in [`rows_dot`]: two rows share each load of `x`
/// (2 × 8 accumulators + 8 weights + 8 inputs = the 32 vector registers).
const ROWS: usize = 2;

/// `out[k] = W[r0 + k] · x` for `k < N`, fused layouts: each 32-column block
/// of `x` is loaded once for the N rows; every row's lanes see the same
/// fused multiply-adds in the same order as the scalar definition.
///
/// # Safety
/// `m` checked, `x.len() == m.cols`, rows `r0..r0+N` exist, `fused(m)`.
unsafe fn rows_dot<const N: usize>(m: &MatRef<'_>, r0: usize, x: &[f32], out: &mut [f32]) {
    let rbs = m.row_bytes();
    let rows: [*const u8; N] = core::array::from_fn(|k| m.data[(r0 + k) * rbs..(r0 + k + 1) * rbs].as_ptr());
    let mut acc = [zero(); N];
    let full = m.cols / LANES * LANES;
    let mut c = 0;
    while c < full {
        for k in 0..N {
            // SAFETY: c + 32 <= cols, within the row and within x.
            unsafe { fma8(&mut acc[k], &load32(m.fmt, rows[k], c, scale_at(m, r0 + k, c)), x.as_ptr().add(c)) };
        }
        c += LANES;
    }
    for k in 0..N {
        if full < m.cols {
            tail_fma(m, r0 + k, full, x, &mut acc[k]);
        }
        out[k] = reduce(&acc[k]);
    }
}

/// One row of a layout whose groups cut 32-column blocks: dequantized a
/// chunk at a time (exact), then the same lane order.
fn row_dot_unfused(m: &MatRef<'_>, r: usize, x: &[f32]) -> f32 {
    let mut acc = zero();
    let full = m.cols / LANES * LANES;
    let mut w = [0f32; 8 * LANES];
    let mut c = 0;
    while c < full {
        let n = (full - c).min(w.len());
        m.dequant(r, c, &mut w[..n]);
        for k in (0..n).step_by(LANES) {
            // SAFETY: k + 32 <= n floats in w; c + k + 32 <= cols in x.
            unsafe { fma8(&mut acc, &load32(Fmt::F32, w.as_ptr().add(k) as *const u8, 0, 0.0), x.as_ptr().add(c + k)) };
        }
        c += n;
    }
    if full < m.cols {
        tail_fma(m, r, full, x, &mut acc);
    }
    reduce(&acc)
}

/// NEON version of [`MatRef::matvec_rows`].
///
/// # Safety
/// `m` must be a checked view, `x.len() == m.cols`, `row0 + y.len() <= m.rows`.
pub unsafe fn matvec_rows(m: &MatRef<'_>, x: &[f32], row0: usize, y: &mut [f32]) {
    if !fused(m) {
        for (i, yo) in y.iter_mut().enumerate() {
            *yo = row_dot_unfused(m, row0 + i, x);
        }
        return;
    }
    let pairs = y.len() / ROWS * ROWS;
    for i in (0..pairs).step_by(ROWS) {
        // SAFETY: rows row0+i..row0+i+ROWS exist (forwarded contract).
        unsafe { rows_dot::<ROWS>(m, row0 + i, x, &mut y[i..i + ROWS]) };
    }
    for i in pairs..y.len() {
        // SAFETY: as above, one row.
        unsafe { rows_dot::<1>(m, row0 + i, x, &mut y[i..i + 1]) };
    }
}

/// Tokens sharing one dequantization of a weight block in [`matmat_rows`].
const MULTI: usize = 2;

/// NEON version of [`MatRef::matmat_rows`]: each 32-weight block is
/// dequantized once for `MULTI` inputs, each with its own accumulators in
/// the canonical order — every result equals the matvec's bit for bit.
///
/// # Safety
/// As [`matvec_rows`], with `xs.len() == nt · m.cols` and `ys` valid for
/// writes at `t·ys_stride + i`.
pub unsafe fn matmat_rows(
    m: &MatRef<'_>,
    xs: &[f32],
    nt: usize,
    row0: usize,
    n: usize,
    ys: *mut f32,
    ys_stride: usize,
) {
    let cols = m.cols;
    let full = cols / LANES * LANES;
    let rbs = m.row_bytes();
    let dots = |r: usize, x: &[f32], out: &mut [f32]| {
        let k = out.len();
        if !fused(m) {
            for (j, o) in out.iter_mut().enumerate() {
                *o = row_dot_unfused(m, r, &x[j * cols..(j + 1) * cols]);
            }
            return;
        }
        let rb = m.data[r * rbs..(r + 1) * rbs].as_ptr();
        let mut acc = [zero(); MULTI];
        let mut c = 0;
        while c < full {
            // SAFETY: c + 32 <= cols; the k inputs each hold cols floats.
            unsafe {
                let w = load32(m.fmt, rb, c, scale_at(m, r, c));
                for (j, a) in acc.iter_mut().enumerate().take(k) {
                    fma8(a, &w, x.as_ptr().add(j * cols + c));
                }
            }
            c += LANES;
        }
        for (j, a) in acc.iter_mut().enumerate().take(k) {
            if full < cols {
                tail_fma(m, r, full, &x[j * cols..(j + 1) * cols], a);
            }
            out[j] = reduce(a);
        }
    };
    // SAFETY: forwarded contract.
    unsafe { crate::matrix::matmat_groups::<MULTI>(m, xs, nt, row0, n, ys, ys_stride, dots) };
}

/// Table entries for one (v, s): `t[e] = x0·c0 (+ fma over d)`, 4 entries a
/// vector, the scalar definition's order, for the whole vectors of entries;
/// returns how many entries it wrote (the caller does the rest).
///
/// # Panics
/// When `x.len() < b.dim` or `t.len() < b.entries`.
pub fn table_entries(b: &VqBook, x: &[f32], t: &mut [f32]) -> usize {
    assert!(x.len() >= b.dim && t.len() >= b.entries && b.cbt.len() >= b.dim * b.entries);
    let e4 = b.entries / 4 * 4;
    let mut e = 0;
    // sixteen (then four, then one) vectors' chains side by side: one
    // chain is `dim` dependent FMAs and waits out each one's latency (3–4
    // cycles with 2–4 FMA pipes on ARM cores: 8–16 chains keep them busy;
    // on AVX2, 4 → 8 chains built a VQ3R table 13 % faster, docs/lab entry
    // 72); each entry's order is the one-at-a-time order
    while e + 64 <= e4 {
        entries_chains::<16>(b, x, e, t);
        e += 64;
    }
    while e + 16 <= e4 {
        entries_chains::<4>(b, x, e, t);
        e += 16;
    }
    while e < e4 {
        entries_chains::<1>(b, x, e, t);
        e += 4;
    }
    e4
}

/// Entries `e .. e + 4N` of a (position, stage) table, `N` vectors' FMA
/// chains side by side.
///
/// # Panics
/// When `e + 4N > b.entries` or `t` is shorter (or as [`table_entries`]).
#[inline(always)]
fn entries_chains<const N: usize>(b: &VqBook, x: &[f32], e: usize, t: &mut [f32]) {
    assert!(e + 4 * N <= b.entries && t.len() >= e + 4 * N && x.len() >= b.dim && b.cbt.len() >= b.dim * b.entries);
    let c = b.cbt.as_ptr();
    // SAFETY: cbt rows hold `entries` floats and e + 4N <= entries (asserted); t holds e + 4N floats.
    unsafe {
        let x0 = vdupq_n_f32(x[0]);
        let mut acc: [float32x4_t; N] = core::array::from_fn(|q| vmulq_f32(x0, vld1q_f32(c.add(e + 4 * q))));
        for d in 1..b.dim {
            let xd = vdupq_n_f32(x[d]);
            for (q, a) in acc.iter_mut().enumerate() {
                *a = vfmaq_f32(*a, xd, vld1q_f32(c.add(d * b.entries + e + 4 * q)));
            }
        }
        for (q, a) in acc.iter().enumerate() {
            vst1q_f32(t.as_mut_ptr().add(e + 4 * q), *a);
        }
    }
}

/// Row groups of 4 rows walked together in [`vq_rows4`].
const GROUPS: usize = 8;

/// Unscaled VQ row sums for rows `r0..r0+y.len()` (a multiple of 4, `r0 % 4
/// == 0`, blocked layout with `block % 4 == 0`). NEON has no gather: each
/// lane is filled by a lane load, four rows to a vector and up to
/// [`GROUPS`] vectors in flight, so the adds of 32 rows overlap instead of
/// one row's chain serialising on the add latency. Vector positions are
/// walked in tiles of [`VQ_TILE`] (the tile's table stays in L1; partial
/// sums wait in `y`). Each row adds the same values in the same order as
/// the scalar definition — bit-identical.
///
/// # Panics
/// When the sizes break the contract above or the indices/table are short.
pub fn vq_rows4(lay: &VqLayout, idx: &[u8], table: &[f32], r0: usize, y: &mut [f32]) {
    assert!(lay.block > 0 && lay.block.is_multiple_of(4) && r0.is_multiple_of(4) && y.len().is_multiple_of(4));
    assert!(idx.len() >= lay.index_bytes() && table.len() >= lay.table_len() && r0 + y.len() <= lay.rows);
    let te = lay.table_entries();
    let st = lay.stages;
    let end = r0 + y.len();
    let mut ix = [[0usize; 8]; 4];
    let vstride = lay.vstride();
    let mut v0 = 0;
    while v0 < lay.nvec {
        let v1 = (v0 + VQ_TILE).min(lay.nvec);
        let mut r = r0;
        while r < end {
            let block_end = (r / lay.block + 1) * lay.block;
            let ng = ((block_end.min(end) - r) / 4).clamp(1, GROUPS);
            // SAFETY: NEON baseline.
            let mut acc = unsafe { [vdupq_n_f32(0.0); GROUPS] };
            if v0 > 0 {
                for (g, a) in acc.iter_mut().enumerate().take(ng) {
                    // SAFETY: r + 4g + 4 <= end; the previous tile wrote these partial sums.
                    *a = unsafe { vld1q_f32(y.as_ptr().add(r - r0 + 4 * g)) };
                }
            }
            // each row's stage group at position v0; later positions add vstride
            let base: [[usize; 4]; GROUPS] = core::array::from_fn(|g| {
                core::array::from_fn(|i| if g < ng { lay.offset(r + 4 * g + i, v0) } else { 0 })
            });
            for v in v0..v1 {
                for (g, a) in acc.iter_mut().enumerate().take(ng) {
                    for (i, x) in ix.iter_mut().enumerate() {
                        lay.indices_at(idx, base[g][i] + (v - v0) * vstride, x);
                    }
                    for s in 0..st {
                        let base = &table[(v * st + s) * te..(v * st + s + 1) * te];
                        let lane: [f32; 4] = core::array::from_fn(|i| base[ix[i][s]]);
                        // SAFETY: NEON baseline; 4 floats.
                        *a = unsafe { vaddq_f32(*a, vld1q_f32(lane.as_ptr())) };
                    }
                }
            }
            for (g, a) in acc.iter().enumerate().take(ng) {
                // SAFETY: r + 4g + 4 <= end.
                unsafe { vst1q_f32(y.as_mut_ptr().add(r - r0 + 4 * g), *a) };
            }
            r += 4 * ng;
        }
        v0 = v1;
    }
}

/// VQ4P row sums by table lookups in registers instead of lane loads:
/// for each vector position and stage, the stage's 64 f32 entries are split
/// by `vld4q_u8` into 4 byte planes of 64 bytes (4 registers each, 16 in
/// all), and 16 rows' 6-bit indices look each plane up with one
/// `vqtbl4q_u8`; two rounds of zips put the 4 planes' bytes back together
/// as the rows' 16 f32 entries. A row's 3 index bytes come apart by one
/// `vld3q_u8` per 16 rows (byte 0, 1, 2 of each row in its own register),
/// and each stage's field is two shifts and a mask away. Each row adds its
/// entries in the canonical order (vector position, then stage) into its
/// own sum — bit-identical to the scalar definition.
///
/// Rows `r0..r0+y.len()`, both multiples of 16, blocked layout with `block
/// % 16 == 0` (16 rows' index bytes contiguous), 6-bit packed indices of 4
/// stages; `table` has 64 entries per (vector position, stage).
///
/// # Panics
/// When the sizes break the contract above or the indices/table are short.
pub fn vq4p_rows16(lay: &VqLayout, idx: &[u8], table: &[f32], r0: usize, y: &mut [f32]) {
    assert!(lay.packed6 && lay.stages == 4 && lay.block > 0 && lay.block.is_multiple_of(16));
    assert!(r0.is_multiple_of(16) && y.len().is_multiple_of(16) && r0 + y.len() <= lay.rows);
    assert!(idx.len() >= lay.index_bytes() && table.len() >= lay.table_len());
    y.fill(0.0);
    // each 16-row group's index offset at vector position 0; position v adds
    // v · vstride (block · 3 bytes)
    let goff: Vec<usize> = (0..y.len() / 16).map(|g| lay.offset(r0 + 16 * g, 0)).collect();
    let vstride = lay.vstride();
    let yp = y.as_mut_ptr();
    for v in 0..lay.nvec {
        for s in 0..4 {
            // SAFETY: the 64 entries of (v, s) are inside `table` (asserted);
            // NEON is baseline.
            let planes: [uint8x16x4_t; 4] = unsafe {
                let t = table.as_ptr().add((4 * v + s) * 64) as *const u8;
                // q[k].p: byte p of entries 16k .. 16k + 16
                let q: [uint8x16x4_t; 4] = core::array::from_fn(|k| vld4q_u8(t.add(64 * k)));
                [
                    uint8x16x4_t(q[0].0, q[1].0, q[2].0, q[3].0),
                    uint8x16x4_t(q[0].1, q[1].1, q[2].1, q[3].1),
                    uint8x16x4_t(q[0].2, q[1].2, q[2].2, q[3].2),
                    uint8x16x4_t(q[0].3, q[1].3, q[2].3, q[3].3),
                ]
            };
            for (g, &go) in goff.iter().enumerate() {
                // SAFETY: the group's 48 index bytes at position v are inside
                // `idx` (asserted: offset(r, v) + 3 <= index_bytes for every
                // row of the group); 16g + 16 <= y.len(); NEON is baseline.
                unsafe {
                    let b = vld3q_u8(idx.as_ptr().add(go + v * vstride));
                    let m6 = vdupq_n_u8(63);
                    let i = match s {
                        0 => vandq_u8(b.0, m6),
                        1 => vorrq_u8(vshrq_n_u8::<6>(b.0), vandq_u8(vshlq_n_u8::<2>(b.1), m6)),
                        2 => vorrq_u8(vshrq_n_u8::<4>(b.1), vandq_u8(vshlq_n_u8::<4>(b.2), m6)),
                        _ => vshrq_n_u8::<2>(b.2),
                    };
                    let p0 = vqtbl4q_u8(planes[0], i);
                    let p1 = vqtbl4q_u8(planes[1], i);
                    let p2 = vqtbl4q_u8(planes[2], i);
                    let p3 = vqtbl4q_u8(planes[3], i);
                    // bytes 0,1 and 2,3 of each row's entry paired, then the pairs
                    let (lo01, hi01) = (vzip1q_u8(p0, p1), vzip2q_u8(p0, p1));
                    let (lo23, hi23) = (vzip1q_u8(p2, p3), vzip2q_u8(p2, p3));
                    let h = |a: uint8x16_t| vreinterpretq_u16_u8(a);
                    let f = [
                        vzip1q_u16(h(lo01), h(lo23)),
                        vzip2q_u16(h(lo01), h(lo23)),
                        vzip1q_u16(h(hi01), h(hi23)),
                        vzip2q_u16(h(hi01), h(hi23)),
                    ];
                    for (k, fk) in f.iter().enumerate() {
                        let a = yp.add(16 * g + 4 * k);
                        vst1q_f32(a, vaddq_f32(vld1q_f32(a), vreinterpretq_f32_u16(*fk)));
                    }
                }
            }
        }
    }
}

/// Vector positions per tile in [`vq_rows4`] (8 × 3 stages × 256 entries ×
/// 4 bytes = 24 KiB of table: inside the smallest L1 of the targets).
pub const VQ_TILE: usize = 8;

/// `y[j] = fma(a, x[j], y[j])` for the whole vectors at the start; returns how
/// many elements it did (the caller finishes the rest with the scalar loop).
///
/// # Panics
/// When the lengths differ.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) -> usize {
    assert_eq!(x.len(), y.len());
    let n4 = y.len() / 4 * 4;
    let mut j = 0;
    while j < n4 {
        // SAFETY: j + 4 <= len of both.
        unsafe {
            let r = vfmaq_f32(vld1q_f32(y.as_ptr().add(j)), vdupq_n_f32(a), vld1q_f32(x.as_ptr().add(j)));
            vst1q_f32(y.as_mut_ptr().add(j), r);
        }
        j += 4;
    }
    n4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fcvtl_equals_the_scalar_conversion_for_every_f16() {
        for h0 in (0..=u16::MAX).step_by(4) {
            let h = [h0, h0 + 1, h0 + 2, h0 + 3];
            // SAFETY: 4 u16.
            let v = f16x4_to_f32(unsafe { vld1_u16(h.as_ptr()) });
            let mut got = [0f32; 4];
            // SAFETY: 4 floats.
            unsafe { vst1q_f32(got.as_mut_ptr(), v) };
            for i in 0..4 {
                assert_eq!(got[i].to_bits(), waste_format::half::f16_to_f32(h[i]).to_bits(), "f16 {:#06x}", h[i]);
            }
        }
    }

    #[test]
    fn reduction_is_the_canonical_halving() {
        let lanes: [f32; 32] =
            core::array::from_fn(|i| (i as f32 + 0.1).powi(3) * if i % 3 == 0 { -1e-3 } else { 1.7 });
        let mut acc = zero();
        for k in 0..8 {
            // SAFETY: 4 floats.
            acc[k] = unsafe { vld1q_f32(lanes.as_ptr().add(4 * k)) };
        }
        assert_eq!(reduce(&acc).to_bits(), crate::scalar::reduce(&lanes).to_bits());
    }
}
