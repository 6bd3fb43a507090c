//! NEON kernel of the fast mode's VQ row sums ([`crate::vq_fast`]): the
//! int8 table looked up by `tbl`/`tbx` over four registers (64 entries an
//! instruction: a 256-entry stage in one `tbl` and three `tbx`, a VQ4P
//! stage of 64 in one `tbl`), sixteen rows a lookup. The index bytes of
//! sixteen rows at a position are one `ld2`/`ld3` (the stages
//! de-interleaved as they load; VQ4P's 6-bit fields unpacked from the three
//! byte planes), each stage's table is loaded once for 32 rows, and a
//! block's codes add in 16-bit lanes (a block's sum is at most
//! `4 · 4 · 127` in magnitude) — the exact integer of the definition, whose
//! float steps follow in its order: one `fmla` a block (the same fused
//! multiply-add), blocks in order, positions in tiles of whole blocks.
//! Bit-identical to `vq_fast::rows` (tested under qemu at `-cpu cortex-a53`
//! and `max`); never timed on an ARM core, so `exact` stays NEON's default.

use crate::vq::VqLayout;
use crate::vq_fast::QBLOCK;
use core::arch::aarch64::*;

/// Vector positions per tile (whole blocks): 16 × 3 stages × 256 entries
/// = 12 KiB of table, in L1 while every row group of the call reads it.
const TILE: usize = 16;

/// Rows a lookup.
const LANES: usize = 16;

/// Whether the kernel serves this layout: byte indices of 1 to 3 stages of
/// 256 entries, or VQ4P's four 6-bit stages of 64, in index blocks of a
/// multiple of 16 rows (sixteen rows' index bytes at a position are then
/// contiguous).
pub fn serves(lay: &VqLayout) -> bool {
    let stages = if lay.packed6 { lay.stages == 4 } else { (1..=3).contains(&lay.stages) };
    stages && lay.block > 0 && lay.block.is_multiple_of(LANES)
}

/// `y[i] = Σ_b fma(n_b(r0 + i), d_b, ·)` (unscaled, as `vq_fast::rows`)
/// for rows `r0..r0 + y.len()`, both multiples of 16, over the plain table
/// `q` (one `i8` code an entry, `[v][stage][entry]`) with block scales `d`.
///
/// # Panics
/// When the layout is not one [`serves`] takes, or a size is short.
pub fn rows16(lay: &VqLayout, idx: &[u8], d: &[f32], q: &[i8], r0: usize, y: &mut [f32]) {
    assert!(serves(lay), "{lay:?} is not a layout of the NEON fast rows");
    assert!(r0.is_multiple_of(LANES) && y.len().is_multiple_of(LANES) && r0 + y.len() <= lay.rows);
    assert!(q.len() >= lay.table_len() && d.len() >= lay.nvec.div_ceil(QBLOCK) && idx.len() >= lay.index_bytes());
    match (lay.packed6, lay.stages) {
        (false, 1) => body::<1, 256, false>(lay, idx, d, q, r0, y),
        (false, 2) => body::<2, 256, false>(lay, idx, d, q, r0, y),
        (false, 3) => body::<3, 256, false>(lay, idx, d, q, r0, y),
        (true, 4) => body::<4, 64, true>(lay, idx, d, q, r0, y),
        (p, s) => unreachable!("the NEON fast rows serve 1 to 3 byte stages or VQ4P, not packed {p} stages {s}"),
    }
}

/// The `NS` stage indices of sixteen rows at byte offset `o` (in bounds:
/// the caller's check), one lane a row.
#[inline(always)]
fn indices<const NS: usize, const P6: bool>(idx: &[u8], o: usize) -> [uint8x16_t; NS] {
    let bpv = if P6 { NS * 6 / 8 } else { NS };
    let g = &idx[o..o + LANES * bpv];
    // SAFETY: NEON is baseline on aarch64; each load reads the 16 · bpv bytes of `g`.
    unsafe {
        let mut out = [vdupq_n_u8(0); NS];
        match (P6, bpv) {
            (false, 1) => out[0] = vld1q_u8(g.as_ptr()),
            (false, 2) => {
                let v = vld2q_u8(g.as_ptr());
                (out[0], out[1]) = (v.0, v.1);
            }
            (false, 3) => {
                let v = vld3q_u8(g.as_ptr());
                (out[0], out[1], out[2]) = (v.0, v.1, v.2);
            }
            (true, 3) => {
                // four 6-bit fields in three bytes, stage 0 at bit 0
                let v = vld3q_u8(g.as_ptr());
                let (b0, b1, b2) = (v.0, v.1, v.2);
                out[0] = vandq_u8(b0, vdupq_n_u8(63));
                out[1] = vorrq_u8(vshrq_n_u8::<6>(b0), vshlq_n_u8::<2>(vandq_u8(b1, vdupq_n_u8(15))));
                out[2] = vorrq_u8(vshrq_n_u8::<4>(b1), vshlq_n_u8::<4>(vandq_u8(b2, vdupq_n_u8(3))));
                out[3] = vshrq_n_u8::<2>(b2);
            }
            _ => unreachable!("stage bytes {bpv}"),
        }
        out
    }
}

/// Sixteen rows' codes of one stage: entry `i` of the `TE`-entry table at
/// `t` (256: one `tbl` and three `tbx` over 64-entry quarters; an index
/// outside a quarter leaves the lane as it was).
#[inline(always)]
fn lookup<const TE: usize>(t: &[int8x16x4_t; 4], i: uint8x16_t) -> int8x16_t {
    // SAFETY: NEON is baseline on aarch64; registers only.
    unsafe {
        let mut r = vqtbl4q_s8(t[0], i);
        if TE == 256 {
            r = vqtbx4q_s8(r, t[1], vsubq_u8(i, vdupq_n_u8(64)));
            r = vqtbx4q_s8(r, t[2], vsubq_u8(i, vdupq_n_u8(128)));
            r = vqtbx4q_s8(r, t[3], vsubq_u8(i, vdupq_n_u8(192)));
        }
        r
    }
}

/// Stage `s`'s table at position `v` in registers (`TE / 64` quarters).
#[inline(always)]
fn table<const NS: usize, const TE: usize>(q: &[i8], v: usize, s: usize) -> [int8x16x4_t; 4] {
    let t = &q[(v * NS + s) * TE..(v * NS + s + 1) * TE];
    let p = t.as_ptr();
    // SAFETY: NEON is baseline; each load reads 64 bytes of `t` (TE is 64 or 256).
    unsafe {
        let first = vld1q_s8_x4(p);
        if TE == 256 {
            [first, vld1q_s8_x4(p.add(64)), vld1q_s8_x4(p.add(128)), vld1q_s8_x4(p.add(192))]
        } else {
            [first; 4]
        }
    }
}

/// `y` += one block's sums `n` (16-bit lanes, rows in order) times `db`,
/// fused: `fma(n as f32, db, y)` per row, the definition's float step.
#[inline(always)]
fn add_block(n: [int16x8_t; 2], db: f32, y: &mut [f32]) {
    let y: &mut [f32; LANES] = (&mut y[..LANES]).try_into().expect("sixteen rows");
    // SAFETY: NEON is baseline; the loads and stores read and write the 16 floats of `y`.
    unsafe {
        for (h, nh) in n.iter().enumerate() {
            let q4 = [vmovl_s16(vget_low_s16(*nh)), vmovl_high_s16(*nh)];
            for (k, qk) in q4.iter().enumerate() {
                let p = y.as_mut_ptr().add(8 * h + 4 * k);
                vst1q_f32(p, vfmaq_n_f32(vld1q_f32(p), vcvtq_f32_s32(*qk), db));
            }
        }
    }
}

/// [`rows16`] for `NS` stages of `TE` entries (`P6`: VQ4P's packing): row
/// groups of 32 (each table loaded once for both halves), a last of 16.
fn body<const NS: usize, const TE: usize, const P6: bool>(
    lay: &VqLayout,
    idx: &[u8],
    d: &[f32],
    q: &[i8],
    r0: usize,
    y: &mut [f32],
) {
    y.fill(0.0);
    let mut t0 = 0;
    while t0 < lay.nvec {
        let t1 = (t0 + TILE).min(lay.nvec);
        let mut r = 0;
        while r + 2 * LANES <= y.len() {
            groups::<NS, TE, P6, 2>(lay, idx, d, q, r0 + r, (t0, t1), &mut y[r..r + 2 * LANES]);
            r += 2 * LANES;
        }
        if r < y.len() {
            groups::<NS, TE, P6, 1>(lay, idx, d, q, r0 + r, (t0, t1), &mut y[r..r + LANES]);
        }
        t0 = t1;
    }
}

/// `G` groups of sixteen rows from `r` (`y` their `16 · G` sums so far)
/// over the tile of positions `t0..t1`: each stage's table in registers
/// once for all `G` groups.
#[inline(always)]
fn groups<const NS: usize, const TE: usize, const P6: bool, const G: usize>(
    lay: &VqLayout,
    idx: &[u8],
    d: &[f32],
    q: &[i8],
    r: usize,
    (t0, t1): (usize, usize),
    y: &mut [f32],
) {
    let vstride = lay.vstride();
    let bases: [usize; G] = core::array::from_fn(|g| lay.offset(r + g * LANES, t0));
    let mut vb = t0;
    while vb < t1 {
        let ve = (vb + QBLOCK).min(t1);
        // SAFETY: NEON is baseline on aarch64; registers only.
        let mut n = [[unsafe { vdupq_n_s16(0) }; 2]; G];
        for v in vb..ve {
            let o = (v - t0) * vstride;
            let ix: [[uint8x16_t; NS]; G] = core::array::from_fn(|g| indices::<NS, P6>(idx, bases[g] + o));
            for s in 0..NS {
                let t = table::<NS, TE>(q, v, s);
                for (ng, ixg) in n.iter_mut().zip(&ix) {
                    let c = lookup::<TE>(&t, ixg[s]);
                    // SAFETY: registers only.
                    unsafe {
                        ng[0] = vaddw_s8(ng[0], vget_low_s8(c));
                        ng[1] = vaddw_high_s8(ng[1], c);
                    }
                }
            }
        }
        let db = d[vb / QBLOCK];
        for (g, ng) in n.iter().enumerate() {
            add_block(*ng, db, &mut y[g * LANES..]);
        }
        vb = ve;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SplitMix64;

    /// The definition read straight off the format: per row, each block's
    /// integer sum of its positions' stage codes (the layout's own index
    /// reader), then `fma(sum, d_b, acc)` block by block.
    fn reference(lay: &VqLayout, idx: &[u8], d: &[f32], q: &[i8], r: usize) -> f32 {
        let (te, ns) = (lay.table_entries(), lay.stages);
        let mut acc = 0f32;
        let mut ix = [0usize; 8];
        for b in 0..lay.nvec.div_ceil(QBLOCK) {
            let mut sum = 0i32;
            for v in b * QBLOCK..((b + 1) * QBLOCK).min(lay.nvec) {
                lay.indices(idx, r, v, &mut ix);
                for (s, &e) in ix.iter().enumerate().take(ns) {
                    sum += q[(v * ns + s) * te + e] as i32;
                }
            }
            acc = (sum as f32).mul_add(d[b], acc);
        }
        acc
    }

    /// Every layout the kernel serves, 16 and 32 rows at a time and a
    /// start inside the rows, against [`reference`] bit for bit; codes at
    /// ±127 and every index value, so each `tbx` quarter is exercised.
    #[test]
    fn rows16_is_the_definition() {
        let mut rng = SplitMix64::new(11);
        for (rows, stages, packed6, nvec, block) in [
            (96, 3, false, 37, 32),
            (64, 2, false, 18, 64),
            (48, 1, false, 5, 16),
            (80, 4, true, 21, 16),
            (128, 3, false, 4, 128),
        ] {
            let lay = VqLayout { rows, nvec, stages, block, packed6 };
            assert!(serves(&lay), "{lay:?}");
            let q: Vec<i8> = (0..lay.table_len()).map(|_| ((rng.next_u64() % 255) as i32 - 127) as i8).collect();
            let d: Vec<f32> = (0..nvec.div_ceil(QBLOCK)).map(|_| rng.unif() * 0.01 + 1e-4).collect();
            let idx: Vec<u8> = (0..lay.index_bytes()).map(|_| rng.next_u64() as u8).collect();
            for (r0, n) in [(0, rows), (16, 16), (16, rows - 16), (rows - 32, 32)] {
                let mut y = vec![f32::NAN; n];
                rows16(&lay, &idx, &d, &q, r0, &mut y);
                for (i, g) in y.iter().enumerate() {
                    let want = reference(&lay, &idx, &d, &q, r0 + i);
                    assert_eq!(g.to_bits(), want.to_bits(), "{lay:?} rows {r0}+{i}");
                }
            }
        }
        assert!(!serves(&VqLayout { rows: 64, nvec: 4, stages: 3, block: 8, packed6: false }), "blocks under 16 rows");
        assert!(!serves(&VqLayout { rows: 64, nvec: 4, stages: 3, block: 0, packed6: false }), "row-major indices");
    }
}
