//! NEON kernel of the fast numeric mode's Q8G / Q4G matvec: `crate::fast`'s
//! definition bit for bit with the base ISA only (`smull` products of
//! signed bytes, pairwise widening adds: each lane's four-column sum is
//! the exact integer), the float steps the definition's (`fmla` is the same
//! fused multiply-add, the halving reduction the same pairs). The
//! `dotprod` extension's `sdot` would give the same integers; it is not
//! used so that every aarch64 CPU runs this one kernel.
//!
//! Several inputs (a prefill chunk) take [`matmat_rows`]: each weight
//! block decoded once for [`TOKENS`] of them, each input's dots and float
//! steps exactly one input's.

use crate::fast::{GroupStarts, QInput, BLOCK};
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

/// Inputs a pass of [`matmat_rows`] (each weight block decoded once for
/// them; their accumulators fill 8 of the 32 vector registers — at 8 the
/// compiled loop spilled three a block).
pub const TOKENS: usize = 4;

/// `outs[t][i] = W[row0 + i] · xs[t]` in the fast mode for up to
/// [`TOKENS`] inputs: each row's weight block decoded once for all of
/// them, every `(row, input)` pair's integer lanes, `fmla`s and reduction
/// those of [`matvec_rows`] on that input alone (the same bits). A missing
/// input repeats the last one, computed and not stored, so the
/// accumulators stay in registers.
///
/// # Panics
/// When there are no inputs or more than [`TOKENS`], the outputs differ
/// from the inputs in number or from each other in length, or the rows are
/// out of range (the caller checks the rest).
pub fn matmat_rows(m: &MatRef<'_>, xs: &[QInput], row0: usize, outs: &mut [&mut [f32]]) {
    assert!(!xs.is_empty() && xs.len() <= TOKENS && xs.len() == outs.len(), "1 to {TOKENS} inputs, one output each");
    let n = outs[0].len();
    assert!(outs.iter().all(|o| o.len() == n) && row0 + n <= m.rows, "matmat rows out of range");
    if m.fmt == Fmt::Q4G {
        multi::<true>(m, xs, row0, outs)
    } else {
        multi::<false>(m, xs, row0, outs)
    }
}

fn multi<const Q4: bool>(m: &MatRef<'_>, xs: &[QInput], row0: usize, outs: &mut [&mut [f32]]) {
    let (rbs, gpr) = (m.row_bytes(), m.groups());
    let (nt, n) = (xs.len(), outs[0].len());
    let x: [&QInput; TOKENS] = core::array::from_fn(|t| &xs[t.min(nt - 1)]);
    let nb = x[0].d.len();
    // the loop below reads every input's block b by pointer: all as long
    assert!(x.iter().all(|xt| xt.d.len() == nb && xt.q.len() >= nb * BLOCK), "quantized inputs of one width");
    assert!(
        m.group.is_multiple_of(BLOCK) && nb * BLOCK <= m.row_bytes() * if Q4 { 2 } else { 1 },
        "whole blocks a group"
    );
    let qp: [*const i8; TOKENS] = core::array::from_fn(|t| x[t].q.as_ptr());
    for r in 0..n {
        let row = row0 + r;
        let rb = &m.data[row * rbs..(row + 1) * rbs];
        let sc = &m.scales[row * gpr..(row + 1) * gpr];
        // SAFETY (every intrinsic below): NEON is baseline on aarch64; registers only.
        let mut acc = [[unsafe { vdupq_n_f32(0.0) }; 2]; TOKENS];
        let (mut ws, mut starts) = (0f32, GroupStarts::new(m.group));
        for b in 0..nb {
            if starts.next() {
                ws = f16_to_f32(sc[b * BLOCK / m.group]);
            }
            let w = weights::<Q4>(rb, b);
            for (t, a) in acc.iter_mut().enumerate() {
                // SAFETY: block b's 32 codes of input t (lengths asserted above).
                let q = unsafe {
                    let p = qp[t].add(b * BLOCK);
                    [vld1q_s8(p), vld1q_s8(p.add(16))]
                };
                let p = block_lanes(w, q);
                let d = ws * x[t].d[b];
                for (ak, pk) in a.iter_mut().zip(p) {
                    // as `rows`: fma(d, p, lane)
                    *ak = unsafe { vfmaq_n_f32(*ak, vcvtq_f32_s32(pk), d) };
                }
            }
        }
        for (o, a) in outs.iter_mut().zip(&acc) {
            o[r] = reduce(a);
        }
    }
}

/// The definition's halving reduction of a row's eight lanes: (i + 4),
/// (+ 2), (+ 1).
#[inline(always)]
fn reduce(a: &[float32x4_t; 2]) -> f32 {
    // SAFETY: registers only.
    unsafe {
        let b = vaddq_f32(a[0], a[1]);
        let c = vadd_f32(vget_low_f32(b), vget_high_f32(b));
        vget_lane_f32::<0>(c) + vget_lane_f32::<1>(c)
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
        let mut starts = GroupStarts::new(g);
        for (b, &db) in x.d.iter().enumerate() {
            if starts.next() {
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
            *o = reduce(a);
        }
    }
}
