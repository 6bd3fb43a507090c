//! NEON kernel of the fast numeric mode's Q8G / Q4G matvec: `crate::fast`'s
//! definition bit for bit with the base ISA only (`smull` products of
//! signed bytes, pairwise widening adds: each lane's four-column sum is
//! the exact integer), the float steps the definition's (`fmla` is the same
//! fused multiply-add, the halving reduction the same pairs). The
//! `dotprod` extension's `sdot` would give the same integers; it is not
//! used so that every aarch64 CPU runs this one kernel.

use crate::fast::{QInput, BLOCK};
use crate::matrix::MatRef;
use core::arch::aarch64::*;
use waste_format::half::f16_to_f32;
use waste_format::Fmt;

/// Rows a pass (their input block loaded once for them).
const ROWS: usize = 4;

/// The eight lanes of one block: lanes 0–3 and 4–7, each the exact sum of
/// `w·q` over its four columns, for 32 signed weights `w` (two registers)
/// and the block's 32 codes `q`.
#[inline(always)]
fn block_lanes(w: [int8x16_t; 2], q: [int8x16_t; 2]) -> [int32x4_t; 2] {
    // SAFETY: NEON is baseline on aarch64; registers only.
    unsafe {
        core::array::from_fn(|h| {
            // 16 products (|w·q| ≤ 128·127 fits i16), pairs to i32, then fours
            let lo = vpaddlq_s16(vmull_s8(vget_low_s8(w[h]), vget_low_s8(q[h])));
            let hi = vpaddlq_s16(vmull_high_s8(w[h], q[h]));
            vpaddq_s32(lo, hi)
        })
    }
}

/// Block `b`'s 32 signed weights of row bytes `rb` (Q8G bytes, or Q4G
/// nibbles − 8 in column order).
#[inline(always)]
fn weights<const Q4: bool>(rb: &[u8], b: usize) -> [int8x16_t; 2] {
    // SAFETY: NEON is baseline; the loads read 16 or 32 bytes inside the row (bounds checked by the slices).
    unsafe {
        if Q4 {
            let bytes = vld1q_u8(rb[b * BLOCK / 2..(b + 1) * BLOCK / 2].as_ptr());
            let (lo, hi) = (vandq_u8(bytes, vdupq_n_u8(15)), vshrq_n_u8::<4>(bytes));
            // columns 2i and 2i + 1 are byte i's low and high nibbles
            let eight = vdupq_n_s8(8);
            [
                vsubq_s8(vreinterpretq_s8_u8(vzip1q_u8(lo, hi)), eight),
                vsubq_s8(vreinterpretq_s8_u8(vzip2q_u8(lo, hi)), eight),
            ]
        } else {
            let w = &rb[b * BLOCK..(b + 1) * BLOCK];
            [vld1q_s8(w.as_ptr() as *const i8), vld1q_s8(w[16..].as_ptr() as *const i8)]
        }
    }
}

/// `y[i] = W[row0 + i] · x` in the fast mode, `m` one `crate::fast::applies`
/// takes, `x` quantized over its padded width.
///
/// # Panics
/// When the rows are out of range (the caller checks the rest).
pub fn matvec_rows(m: &MatRef<'_>, x: &QInput, row0: usize, y: &mut [f32]) {
    if m.fmt == Fmt::Q4G {
        rows::<true>(m, x, row0, y)
    } else {
        rows::<false>(m, x, row0, y)
    }
}

fn rows<const Q4: bool>(m: &MatRef<'_>, x: &QInput, row0: usize, y: &mut [f32]) {
    let (rbs, g, gpr) = (m.row_bytes(), m.group, m.groups());
    for (c, yc) in y.chunks_mut(ROWS).enumerate() {
        let r0 = row0 + c * ROWS;
        let n = yc.len();
        let rb: [&[u8]; ROWS] = core::array::from_fn(|t| {
            let r = r0 + t.min(n - 1);
            &m.data[r * rbs..(r + 1) * rbs]
        });
        let sc: [&[u16]; ROWS] = core::array::from_fn(|t| {
            let r = r0 + t.min(n - 1);
            &m.scales[r * gpr..(r + 1) * gpr]
        });
        // SAFETY (every intrinsic below): NEON is baseline on aarch64; registers only.
        let mut acc = [[unsafe { vdupq_n_f32(0.0) }; 2]; ROWS];
        let mut ws = [0f32; ROWS];
        for (b, &db) in x.d.iter().enumerate() {
            if (b * BLOCK).is_multiple_of(g) {
                for (w, s) in ws.iter_mut().zip(&sc) {
                    *w = f16_to_f32(s[b * BLOCK / g]);
                }
            }
            let xq = &x.q[b * BLOCK..(b + 1) * BLOCK];
            // SAFETY: 32 codes of the block.
            let q = unsafe { [vld1q_s8(xq.as_ptr()), vld1q_s8(xq[16..].as_ptr())] };
            for t in 0..ROWS {
                let p = block_lanes(weights::<Q4>(rb[t], b), q);
                let d = ws[t] * db;
                for (a, pk) in acc[t].iter_mut().zip(p) {
                    // fma(d, p, lane): fmla's product d·p added once rounded
                    *a = unsafe { vfmaq_n_f32(*a, vcvtq_f32_s32(pk), d) };
                }
            }
        }
        for (o, a) in yc.iter_mut().zip(&acc) {
            // the definition's halving reduction: (i + 4), (+ 2), (+ 1)
            // SAFETY: registers only.
            *o = unsafe {
                let b = vaddq_f32(a[0], a[1]);
                let c = vadd_f32(vget_low_f32(b), vget_high_f32(b));
                vget_lane_f32::<0>(c) + vget_lane_f32::<1>(c)
            };
        }
    }
}
