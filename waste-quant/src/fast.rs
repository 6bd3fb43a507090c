//! The `fast` numeric mode's trunk products (issue 50): each input vector
//! quantized to 8 bits in blocks of [`BLOCK`] values with one f32 scale
//! (llama.cpp's Q8_0), integer dot products against Q8G / Q4G weights.
//! Other formats, and grouped matrices whose groups are not whole blocks,
//! compute as in `exact`; the VQ experts' fast form (8-bit lookup tables)
//! is [`crate::vq_fast`].
//!
//! The definition (every level reproduces it bit for bit, like `exact`'s):
//!
//! * **input**: per block `b`, `d_b = max|x| / 127` (f32), `q = round(x / d_b)`
//!   (half away from zero; 0 when the block is all zero); the padding past
//!   `cols` is zero. Computed once per input, before the rows are split;
//! * **row dot**: eight f32 lanes; block `b`'s lane `j` is the exact integer
//!   sum of `w · q` over its columns `4j..4j+4` (`w` the stored code: the
//!   Q8G byte, or the Q4G nibble − 8), added as `fma(s_g · d_b, sum, lane)`
//!   with `s_g` the weight group's f16 scale; blocks in order; the lanes
//!   reduced by halving (i + 4, + 2, + 1).
//!
//! The integer sums are exact at every level; the float steps are the same
//! operations in the same order, so the mode is bit-identical across
//! levels, threads and placements.

use crate::level::Level;
use crate::matrix::MatRef;
use waste_format::half::f16_to_f32;
use waste_format::Fmt;

/// Values per activation block (one scale each).
pub const BLOCK: usize = 32;

/// How the engine computes: the references' arithmetic, or 8-bit
/// activations with integer dot products where a format allows them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Numeric {
    /// Exact f32 activations: the definition every oracle test uses.
    #[default]
    Exact,
    /// 8-bit activations in blocks of 32 for Q8G / Q4G products, and VQ
    /// lookup tables in 8 bits per block of 4 positions ([`crate::vq_fast`]).
    Fast,
    /// The same with 4-bit activations: the quality contract's negative
    /// control (its tests must see it fail the contract), never offered to
    /// a user.
    Control4,
}

impl Numeric {
    /// `exact`, `fast` (or the control's name).
    pub fn name(self) -> &'static str {
        match self {
            Numeric::Exact => "exact",
            Numeric::Fast => "fast",
            Numeric::Control4 => "control-4-bit",
        }
    }
    /// The largest activation code (127 for 8 bits); None in `exact`.
    pub fn qmax(self) -> Option<f32> {
        match self {
            Numeric::Exact => None,
            Numeric::Fast => Some(127.0),
            Numeric::Control4 => Some(7.0),
        }
    }
    /// The mode used when none is asked for, at `level` on this CPU:
    /// `Fast` where its kernels were measured faster end to end than
    /// `exact`'s, decode and prefill (docs/FINDINGS.md, "Numeric modes") —
    /// AVX2, and AVX-512 with VNNI and VBMI (the integer dots and the VQ
    /// tables' byte permutes); `Exact` elsewhere: the scalar level (its
    /// portable fast form is slower than exact's kernels), NEON (its fast
    /// matvec is tested under emulation, never timed on a real core) and
    /// AVX-512 without those extensions (not measured). Both modes meet the
    /// quality contract wherever they run.
    pub fn preferred(level: Level) -> Numeric {
        #[cfg(target_arch = "x86_64")]
        {
            let fast = match level {
                Level::Avx2 => Level::Avx2.supported(),
                Level::Avx512 => vnni() && std::arch::is_x86_feature_detected!("avx512vbmi"),
                _ => false,
            };
            if fast {
                return Numeric::Fast;
            }
        }
        let _ = level;
        Numeric::Exact
    }
    /// Parse `exact` / `fast`.
    pub fn parse(s: &str) -> Option<Numeric> {
        match s {
            "exact" => Some(Numeric::Exact),
            "fast" => Some(Numeric::Fast),
            _ => None,
        }
    }
}

/// An input vector quantized for the fast products.
#[derive(Clone, Debug, PartialEq)]
pub struct QInput {
    /// Codes, `cols_padded` of them (zero past `cols`).
    pub q: Vec<i8>,
    /// One scale per block.
    pub d: Vec<f32>,
    /// Per block, eight times the sum of each lane's four codes (Q4G's
    /// `Σ (n − 8)·q = Σ n·q − 8·Σ q`, the second term once per input).
    pub sum8: Vec<[i32; 8]>,
}

/// Whether `m` computes differently in the fast mode: Q8G or Q4G with
/// groups of whole blocks.
pub fn applies(m: &MatRef<'_>) -> bool {
    matches!(m.fmt, Fmt::Q8G | Fmt::Q4G) && m.group.is_multiple_of(BLOCK)
}

/// Quantize `x` (the matrix's `cols` inputs) into blocks over `cols_padded`
/// (a multiple of [`BLOCK`]), 8 bits.
pub fn quantize(x: &[f32], cols_padded: usize) -> QInput {
    quantize_to(x, cols_padded, 127.0)
}

/// [`quantize`] with codes up to `qmax` (≤ 127), at the process's level.
pub fn quantize_to(x: &[f32], cols_padded: usize, qmax: f32) -> QInput {
    quantize_at(crate::level::level(), x, cols_padded, qmax)
}

/// [`quantize_to`] at `level`: the same bits at every level (the AVX2
/// kernels do whole blocks with the definition's operations,
/// `x86_64::fast::quantize_block`; this runs on the calling thread before a
/// pool's matvec, while the other threads wait).
pub fn quantize_at(level: Level, x: &[f32], cols_padded: usize, qmax: f32) -> QInput {
    let nb = cols_padded / BLOCK;
    let mut q = vec![0i8; cols_padded];
    let mut d = vec![0f32; nb];
    let mut sum8 = vec![[0i32; 8]; nb];
    #[cfg(target_arch = "x86_64")]
    let simd = level.avx2_kernels();
    #[cfg(not(target_arch = "x86_64"))]
    let _ = level;
    for b in 0..nb {
        let lo = (b * BLOCK).min(x.len());
        let hi = ((b + 1) * BLOCK).min(x.len());
        let xs = &x[lo..hi];
        #[cfg(target_arch = "x86_64")]
        if let (true, Ok(xb), Ok(qb)) =
            (simd, <&[f32; BLOCK]>::try_from(xs), <&mut [i8; BLOCK]>::try_from(&mut q[lo..hi]))
        {
            // SAFETY: the level's kernels run on this CPU (avx2_kernels checks it).
            d[b] = unsafe { crate::x86_64::fast::quantize_block(xb, qmax, qb) };
            block_sums(&q[lo..hi], &mut sum8[b]);
            continue;
        }
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        if amax == 0.0 {
            continue;
        }
        let db = amax / qmax;
        d[b] = db;
        for (o, &v) in q[lo..hi].iter_mut().zip(xs) {
            *o = (v / db).round().clamp(-qmax, qmax) as i8;
        }
        block_sums(&q[b * BLOCK..(b + 1) * BLOCK], &mut sum8[b]);
    }
    QInput { q, d, sum8 }
}

/// Which blocks start a weight group (`g / BLOCK` blocks each), counted
/// down rather than tested by `(b · BLOCK) % g` — a division per block,
/// a quarter of the AVX2 matmat's time per row block. Used by the x86_64
/// and aarch64 kernels.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
pub(crate) struct GroupStarts {
    per: usize,
    left: usize,
}

#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
impl GroupStarts {
    /// For groups of `g` columns (a multiple of [`BLOCK`]), from block 0.
    #[inline(always)]
    pub(crate) fn new(g: usize) -> Self {
        GroupStarts { per: (g / BLOCK).max(1), left: 0 }
    }
    /// Whether the next block starts a group (call once a block, in order).
    #[inline(always)]
    pub(crate) fn next(&mut self) -> bool {
        let start = self.left == 0;
        if start {
            self.left = self.per;
        }
        self.left -= 1;
        start
    }
}

/// A block's eight sums of four codes, times 8.
fn block_sums(q: &[i8], sum8: &mut [i32; 8]) {
    for (j, s) in sum8.iter_mut().enumerate() {
        *s = 8 * q[4 * j..4 * j + 4].iter().map(|&v| v as i32).sum::<i32>();
    }
}

/// Whether the AVX2 level's fast matmat takes AVX-VNNI's `vpdpbusd` (256
/// bits, no AVX-512: Intel client cores since Alder Lake) for its integer
/// dots: where the CPU has it, unless `WASTE_AVX_VNNI=0` or
/// [`set_avx_vnni`] turned it off. The same integers, so the same bits.
pub fn avx_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use core::sync::atomic::Ordering::Relaxed;
        // 0 not decided yet, 1 off, 2 on
        match AVX_VNNI.load(Relaxed) {
            1 => return false,
            2 => return true,
            _ => {}
        }
        let on = std::arch::is_x86_feature_detected!("avxvnni")
            && Level::Avx2.supported()
            && std::env::var("WASTE_AVX_VNNI").map_or(true, |v| v != "0");
        AVX_VNNI.store(if on { 2 } else { 1 }, Relaxed);
        on
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Turn AVX-VNNI off (or back on where the CPU has it) for the whole
/// process: benchmarks measuring plain AVX2, and the tests of both forms.
pub fn set_avx_vnni(on: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        let on = on && std::arch::is_x86_feature_detected!("avxvnni") && Level::Avx2.supported();
        AVX_VNNI.store(if on { 2 } else { 1 }, core::sync::atomic::Ordering::Relaxed);
    }
    let _ = on;
}

/// Whether the fast matmats and matvecs at `level` on this CPU take
/// AVX-VNNI (the AVX2 kernels run them: AVX2, or AVX-512 without its own
/// VNNI): what the kernels are given and what reports say, one answer.
pub fn matmat_uses_avx_vnni(level: Level) -> bool {
    #[cfg(target_arch = "x86_64")]
    return level.avx2_kernels() && !(level == Level::Avx512 && vnni()) && avx_vnni();
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = level;
        false
    }
}

#[cfg(target_arch = "x86_64")]
static AVX_VNNI: core::sync::atomic::AtomicU8 = core::sync::atomic::AtomicU8::new(0);

/// Whether the CPU runs the AVX-512 level's VNNI fast kernel (AVX-512
/// F/BW/VL/DQ and VNNI).
#[cfg(target_arch = "x86_64")]
fn vnni() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        Level::Avx512.supported()
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    })
}

/// The stored code of column `c` in row bytes `rb`.
#[inline]
fn code(fmt: Fmt, rb: &[u8], c: usize) -> i32 {
    match fmt {
        Fmt::Q8G => rb[c] as i8 as i32,
        _ => (if c.is_multiple_of(2) { rb[c / 2] & 15 } else { rb[c / 2] >> 4 }) as i32 - 8,
    }
}

/// The canonical halving reduction of the eight lanes.
#[inline]
pub(crate) fn reduce8(a: [f32; 8]) -> f32 {
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let c = [b[0] + b[2], b[1] + b[3]];
    c[0] + c[1]
}

fma_scalar! {
    /// The definition: row `r`'s dot with the quantized input.
    pub fn row_dot_scalar(m: &MatRef<'_>, r: usize, x: &QInput) -> f32 {
        let rb = &m.data[r * m.row_bytes()..(r + 1) * m.row_bytes()];
        let sc = &m.scales[r * m.groups()..(r + 1) * m.groups()];
        let mut acc = [0f32; 8];
        for (b, &db) in x.d.iter().enumerate() {
            let d = f16_to_f32(sc[b * BLOCK / m.group]) * db;
            for (j, a) in acc.iter_mut().enumerate() {
                let c0 = b * BLOCK + 4 * j;
                let p: i32 = (c0..c0 + 4).map(|c| code(m.fmt, rb, c) * x.q[c] as i32).sum();
                *a = d.mul_add(p as f32, *a);
            }
        }
        reduce8(acc)
    }
}

fma_scalar! {
    /// [`row_dot_scalar`]'s operations for rows `row0..row0 + y.len()`,
    /// written so a compiler vectorizes them (each block's codes decoded
    /// into an array, its eight lane sums as one loop, the row's scales
    /// converted once): the kernel of every level without its own (the
    /// scalar level, NEON). 3.3× the per-column form at the scalar level
    /// on the Intel Xeon (docs/lab, "Fast VQ tables").
    fn rows_portable(m: &MatRef<'_>, x: &QInput, row0: usize, y: &mut [f32]) {
        let (rbs, gpr) = (m.row_bytes(), m.groups());
        let q4 = m.fmt == Fmt::Q4G;
        let bb = if q4 { BLOCK / 2 } else { BLOCK };
        let mut scales = vec![0f32; gpr];
        for (i, yo) in y.iter_mut().enumerate() {
            let r = row0 + i;
            let rb = &m.data[r * rbs..(r + 1) * rbs];
            for (o, &h) in scales.iter_mut().zip(&m.scales[r * gpr..(r + 1) * gpr]) {
                *o = f16_to_f32(h);
            }
            let mut acc = [0f32; 8];
            for (b, &db) in x.d.iter().enumerate() {
                let xq = &x.q[b * BLOCK..(b + 1) * BLOCK];
                let wb = &rb[b * bb..(b + 1) * bb];
                let mut w = [0i8; BLOCK];
                if q4 {
                    for (k, &v) in wb.iter().enumerate() {
                        w[2 * k] = (v & 15) as i8 - 8;
                        w[2 * k + 1] = (v >> 4) as i8 - 8;
                    }
                } else {
                    for (o, &v) in w.iter_mut().zip(wb) {
                        *o = v as i8;
                    }
                }
                let mut p = [0i32; 8];
                for (j, pj) in p.iter_mut().enumerate() {
                    for c in 4 * j..4 * j + 4 {
                        *pj += w[c] as i32 * xq[c] as i32;
                    }
                }
                let d = scales[b * BLOCK / m.group] * db;
                for (a, &pj) in acc.iter_mut().zip(&p) {
                    *a = d.mul_add(pj as f32, *a);
                }
            }
            *yo = reduce8(acc);
        }
    }
}

impl MatRef<'_> {
    /// `y[i] = W[row0 + i] · x` in `numeric`: the fast products where they
    /// apply (the input quantized here), else as in `exact` — what a caller
    /// that computes a product on one thread uses, so it gives what the
    /// pool gives.
    pub fn matvec_rows_in(&self, level: Level, numeric: Numeric, x: &[f32], row0: usize, y: &mut [f32]) {
        match numeric.qmax().filter(|_| applies(self)) {
            Some(q) => self.matvec_rows_fast(level, &quantize_at(level, x, self.cols_padded(), q), row0, y),
            None => self.matvec_rows(level, x, row0, y),
        }
    }

    /// `outs[t][i] = W[row0 + i] · xs[t]` in the fast mode for several
    /// inputs (a prefill chunk): each weight block decoded once for up to
    /// eight of them at AVX2 and at AVX-512 with VNNI (two per
    /// instruction there), four at NEON, every dot the definition's — the
    /// same bits as a [`MatRef::matvec_rows_fast`] per input.
    ///
    /// # Panics
    /// As [`MatRef::matvec_rows_fast`]; when `outs` and `xs` differ in
    /// number or the outputs in length.
    pub fn matmat_rows_fast(&self, level: Level, xs: &[QInput], row0: usize, outs: &mut [&mut [f32]]) {
        assert_eq!(xs.len(), outs.len(), "one output per input");
        let n = outs.first().map_or(0, |o| o.len());
        assert!(outs.iter().all(|o| o.len() == n), "outputs of one length");
        if let ([x], [o]) = (xs, &mut *outs) {
            // one input (a decode step's projections through the pool's
            // matmats): the matvec kernels, four rows at a time with their
            // scales converted once (the matmat's row at a time converted
            // a scale per block: attention 59 -> 47 ms/token, 48B at AVX2)
            return self.matvec_rows_fast(level, x, row0, o);
        }
        #[cfg(target_arch = "x86_64")]
        if level.avx2_kernels() && applies(self) && n > 0 {
            assert!(xs.iter().all(|x| x.q.len() == self.cols_padded()), "quantized input length");
            assert!(row0 + n <= self.rows, "matmat rows out of range");
            if level == Level::Avx512 && vnni() {
                let t = crate::x86_64::fast::VNNI_TOKENS;
                for (xc, oc) in xs.chunks(t).zip(outs.chunks_mut(t)) {
                    // SAFETY: AVX-512 F/BW/VL/DQ + VNNI (and AVX2/FMA/F16C) verified; shapes asserted above.
                    unsafe { crate::x86_64::fast::matmat_rows_vnni(self, xc, row0, oc) };
                }
                return;
            }
            let t = crate::x86_64::fast::TOKENS;
            for (xc, oc) in xs.chunks(t).zip(outs.chunks_mut(t)) {
                // SAFETY: AVX2/FMA/F16C (and AVX-VNNI where taken) verified; shapes asserted above.
                unsafe { crate::x86_64::fast::matmat_rows(self, xc, row0, oc, matmat_uses_avx_vnni(level)) };
            }
            return;
        }
        #[cfg(target_arch = "aarch64")]
        if level.neon_kernels() && applies(self) && n > 0 {
            assert!(xs.iter().all(|x| x.q.len() == self.cols_padded()), "quantized input length");
            let t = crate::aarch64::fast::TOKENS;
            for (xc, oc) in xs.chunks(t).zip(outs.chunks_mut(t)) {
                crate::aarch64::fast::matmat_rows(self, xc, row0, oc);
            }
            return;
        }
        for (x, o) in xs.iter().zip(outs.iter_mut()) {
            self.matvec_rows_fast(level, x, row0, o);
        }
    }

    /// `y[i] = W[row0 + i] · x` in the fast mode (`x` quantized over this
    /// matrix's `cols_padded`), at a SIMD level: AVX-512 VNNI's integer
    /// kernel at AVX-512 where the CPU has VNNI, AVX2's at AVX2 (and
    /// AVX-512 without VNNI), NEON's at NEON, the definition elsewhere.
    /// Bit-identical across levels.
    ///
    /// # Panics
    /// When the matrix is not one [`applies`] takes, `x` does not cover its
    /// padded width, or the rows are out of range.
    pub fn matvec_rows_fast(&self, level: Level, x: &QInput, row0: usize, y: &mut [f32]) {
        assert!(applies(self), "the fast products take Q8G / Q4G in groups of whole blocks");
        assert_eq!(x.q.len(), self.cols_padded(), "quantized input length");
        assert!(row0 + y.len() <= self.rows, "matvec rows out of range");
        #[cfg(target_arch = "x86_64")]
        if level == Level::Avx512 && vnni() {
            // SAFETY: AVX-512 F/BW/VL/DQ + VNNI (and so AVX2/FMA/F16C) verified; the shape as below.
            unsafe { crate::x86_64::fast::matvec_rows_vnni(self, x, row0, y) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if level.avx2_kernels() {
            // SAFETY: AVX2/FMA/F16C (and AVX-VNNI where taken) verified; the shape checked by MatRef::new and the asserts.
            unsafe { crate::x86_64::fast::matvec_rows(self, x, row0, y, matmat_uses_avx_vnni(level)) };
            return;
        }
        #[cfg(target_arch = "aarch64")]
        if level.neon_kernels() {
            crate::aarch64::fast::matvec_rows(self, x, row0, y);
            return;
        }
        let _ = level;
        rows_portable(self, x, row0, y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Matrix, SplitMix64};
    use waste_format::Fmt;

    fn random(fmt: Fmt, rows: usize, cols: usize, group: usize, seed: u64) -> (Matrix, Vec<f32>) {
        let mut r = SplitMix64::new(seed);
        let w: Vec<f32> = (0..rows * cols).map(|_| r.gauss()).collect();
        let (data, scales) = (crate::formats::tensor_format(fmt).encode)(&w, rows, cols, group).unwrap();
        let x = (0..cols).map(|i| if i % 7 == 3 { 0.0 } else { r.gauss() * 3.0 }).collect();
        (Matrix::from_stored(fmt, rows, cols, group, data, &scales).unwrap(), x)
    }

    /// The activations' codes, scales and sums are the scalar level's at
    /// every level: random blocks with zeros, NaNs, infinities, values
    /// that land exactly half-way between codes, tails and padding, at 8-
    /// and 4-bit codes.
    #[test]
    fn every_level_quantizes_as_the_scalar_level() {
        let mut r = SplitMix64::new(7);
        for case in 0..400 {
            let n = [32, 64, 96, 33, 1, 70, 128][case % 7];
            let qmax = if case % 5 == 4 { 7.0 } else { 127.0 };
            let mut x: Vec<f32> = (0..n).map(|_| r.gauss() * [1.0, 1e-30, 3e4][case % 3]).collect();
            match case % 11 {
                1 => x.iter_mut().step_by(5).for_each(|v| *v = f32::NAN),
                2 => x[n / 2] = f32::INFINITY,
                3 => x[0] = f32::NEG_INFINITY,
                4 => x.iter_mut().for_each(|v| *v = 0.0),
                5 => x.iter_mut().for_each(|v| *v = -0.0),
                // the block's largest is qmax codes; the rest exact halves (k + 0.5 codes)
                6 | 7 => {
                    let d = 0.25f32;
                    x.iter_mut()
                        .enumerate()
                        .for_each(|(i, v)| *v = d * ((i % 9) as f32 - 4.5) * if i % 2 == 0 { 1.0 } else { -1.0 });
                    x[0] = d * qmax;
                }
                8 => x.iter_mut().for_each(|v| *v = f32::NAN),
                9 => x.iter_mut().step_by(3).for_each(|v| *v = f32::from_bits(1 + (r.next_u64() as u32 & 0x7f_ffff))),
                _ => {}
            }
            let cp = n.div_ceil(BLOCK) * BLOCK + if case % 4 == 0 { BLOCK } else { 0 };
            let want = quantize_at(Level::Scalar, &x, cp, qmax);
            for lv in Level::available() {
                let got = quantize_at(lv, &x, cp, qmax);
                assert_eq!(got.q, want.q, "codes, case {case} at {lv:?}");
                assert_eq!(
                    got.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "scales, case {case} at {lv:?}"
                );
                assert_eq!(got.sum8, want.sum8, "sums, case {case} at {lv:?}");
            }
        }
    }

    /// Every level's kernels, and at AVX2 both the plain dots and AVX-VNNI's
    /// where the CPU has it, give the definition's bits.
    #[test]
    fn every_level_is_the_definition() {
        for vnni_on in [false, true] {
            set_avx_vnni(vnni_on);
            every_level_is_the_definition_once();
        }
    }

    fn every_level_is_the_definition_once() {
        for fmt in [Fmt::Q8G, Fmt::Q4G] {
            for (rows, cols, group, seed) in
                [(7, 256, 128, 1), (5, 300, 128, 2), (3, 33, 32, 3), (9, 1024, 64, 4), (6, 96, 32, 5), (1, 64, 32, 6)]
            {
                let (m, x) = random(fmt, rows, cols, group, seed);
                let v = m.view();
                let qx = quantize(&x, v.cols_padded());
                let want: Vec<u32> = (0..rows).map(|r| row_dot_scalar(&v, r, &qx).to_bits()).collect();
                // eight more inputs for the several-input form (up to nine:
                // AVX2's and VNNI's chunks 8 + 1, a pair half empty)
                let qs: Vec<QInput> = (0..9)
                    .map(|t| {
                        if t == 0 {
                            qx.clone()
                        } else {
                            quantize(&x.iter().map(|v| v * t as f32 - 0.3).collect::<Vec<_>>(), v.cols_padded())
                        }
                    })
                    .collect();
                for lv in Level::available() {
                    let mut y = vec![0f32; rows];
                    v.matvec_rows_fast(lv, &qx, 0, &mut y);
                    assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "{fmt:?} {cols} at {lv:?}");
                    // every chunk size the kernels fix at compile time
                    for nt in 2..=qs.len() {
                        let mut ys = vec![vec![0f32; rows - 1]; nt];
                        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
                        v.matmat_rows_fast(lv, &qs[..nt], 1, &mut outs);
                        for (t, (q, y)) in qs.iter().zip(&ys).enumerate() {
                            let w: Vec<u32> = (1..rows).map(|r| row_dot_scalar(&v, r, q).to_bits()).collect();
                            assert_eq!(
                                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                w,
                                "{fmt:?} {cols} matmat input {t} of {nt} at {lv:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_definition_is_close_to_exact_and_not_the_same() {
        // each product within 8-bit activations' error of the exact dot,
        // and not exact (the mode does something)
        let (m, x) = random(Fmt::Q4G, 16, 1024, 128, 9);
        let v = m.view();
        let qx = quantize(&x, v.cols_padded());
        let mut differs = 0;
        for r in 0..16 {
            let (f, e) = (row_dot_scalar(&v, r, &qx), v.row_dot_scalar(r, &x));
            let mut w = vec![0f32; 1024];
            v.row(r, &mut w);
            let mag: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            assert!((f - e).abs() <= 0.01 * mag, "row {r}: fast {f} exact {e} (Σ|w·x| {mag})");
            differs += (f != e) as usize;
        }
        assert!(differs >= 12, "fast equals exact in {} of 16 rows", 16 - differs);
    }

    #[test]
    fn quantized_inputs_round_half_away_and_pad_with_zeros() {
        let x = [127.0f32, -63.5, 0.5, 0.0, -127.0];
        let q = quantize(&x, 32);
        assert_eq!(q.d, vec![1.0]);
        assert_eq!(&q.q[..5], &[127, -64, 1, 0, -127]);
        assert!(q.q[5..].iter().all(|&v| v == 0));
        assert_eq!(quantize(&[0.0; 40], 64).d, vec![0.0, 0.0]);
    }
}
