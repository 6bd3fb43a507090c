//! The `fast` numeric mode's VQ row sums (issue 50): the per-input lookup
//! table quantized to 8 bits in blocks of [`QBLOCK`] vector positions, the
//! row sums taken in integers.
//!
//! The definition (every level reproduces it bit for bit):
//!
//! * **table**: the f32 table `T[v][s][e]` of [`crate::vq::build_table`]
//!   (itself bit-identical across levels);
//! * **blocks**: positions `QBLOCK·b .. QBLOCK·b + QBLOCK` (the last block
//!   may be shorter) share one scale `d_b = amax_b / qmax`, `amax_b` the
//!   largest `|T|` over the block's positions, stages and entries (NaN when
//!   any entry is NaN, so damage still shows); the codes are
//!   `q = clamp(rne(T · (qmax / amax_b)), −qmax, qmax)` (`rne`: round half to
//!   even, by adding and subtracting 1.5·2²³), all 0 when `amax_b` is 0;
//! * **row sum**: per block the exact integer sum `n_b(r) = Σ_{v∈b} Σ_s
//!   q[v][s][idx(r, v, s)]`; the row's value `acc = fma(n_b, d_b, acc)` over
//!   the blocks in order from 0, times the row's f16 scale `σ_r`.
//!
//! The integer sums do not depend on their order, and the float steps are
//! the same operations in the same order at every level: the mode is
//! bit-identical across levels, threads and placements. Only layouts whose
//! books are full (every index names an entry) take it; a damaged or
//! partial book keeps `exact`'s NaN entries ([`applies`]).
//!
//! A block of 4 positions is 32 activations, the block of the trunk's fast
//! products ([`crate::fast::BLOCK`]); the table's 8 bits cost about what 8-bit
//! activations cost (docs/FINDINGS.md, "Numeric modes").

use crate::level::Level;
use crate::vq::{build_table, VqBook, VqLayout};
use crate::vq_loads::field;
use waste_format::half::f16_to_f32;

/// Vector positions per table scale.
pub const QBLOCK: usize = 4;

/// Rows summed together: eight independent integer sums.
const GROUP: usize = 8;

/// Vector positions per tile: two blocks, 8 × 3 stages × 256 one-byte
/// entries = 6 KiB of table. Longer tiles made the rows slower when their
/// indices come from memory (AVX2 level, Intel Xeon, a 1024 × 2304 VQ3R
/// matrix: 0.44 ms at 32 positions, 0.42 at 16, 0.33 at 8, 0.36–0.38 at
/// 4; the f32 loads 0.35): docs/lab, "Fast VQ tables".
const TILE: usize = 8;

/// Adding and subtracting this rounds an f32 of magnitude below 2²² to the
/// nearest integer, ties to even (the default rounding mode).
pub(crate) const RNE: f32 = 12_582_912.0;

/// Whether the fast table serves this layout with these books: every book
/// full (as many entries as an index can name), one per stage.
pub fn applies<'b>(books: impl IntoIterator<Item = &'b VqBook>, lay: &VqLayout) -> bool {
    let mut n = 0;
    for b in books {
        if b.entries != lay.table_entries() {
            return false;
        }
        n += 1;
    }
    n == lay.stages
}

/// Scale blocks of a layout.
pub fn blocks(lay: &VqLayout) -> usize {
    lay.nvec.div_ceil(QBLOCK)
}

/// Floats of a fast table in an f32 buffer: the block scales, then the
/// codes four to a float. Never more than [`VqLayout::table_len`], so the
/// exact mode's table buffer holds it.
pub fn qtable_floats(lay: &VqLayout) -> usize {
    blocks(lay).saturating_add(lay.table_len().div_ceil(4))
}

/// Table entries (codes) of one block of positions.
fn block_entries(lay: &VqLayout) -> usize {
    QBLOCK * lay.stages * lay.table_entries()
}

/// The scales and codes of a fast table in `buf` (from [`build`]).
///
/// # Panics
/// When `buf` is shorter than [`qtable_floats`].
pub fn parts<'a>(lay: &VqLayout, buf: &'a [f32]) -> (&'a [f32], &'a [i8]) {
    let nb = blocks(lay);
    let (d, q) = buf[..qtable_floats(lay)].split_at(nb);
    (d, &bytemuck::cast_slice(q)[..lay.table_len()])
}

/// The scales and codes of blocks `b0..b1` of a fast table in `buf`, to write.
///
/// # Panics
/// When `buf` is shorter than [`qtable_floats`] or the blocks are out of range.
pub fn parts_mut<'a>(lay: &VqLayout, buf: &'a mut [f32], b0: usize, b1: usize) -> (&'a mut [f32], &'a mut [i8]) {
    let (d, q) = block_ranges(lay, b0, b1);
    let (lo, hi) = buf[..qtable_floats(lay)].split_at_mut(q.start);
    (&mut lo[d], bytemuck::cast_slice_mut(&mut hi[..q.len()]))
}

/// Where blocks `b0..b1` of a fast table lie in its f32 buffer: their
/// scales and their codes (four to a float), as float ranges — disjoint for
/// disjoint blocks, so threads can build a table's blocks side by side.
///
/// # Panics
/// When the blocks are out of range.
pub fn block_ranges(lay: &VqLayout, b0: usize, b1: usize) -> (core::ops::Range<usize>, core::ops::Range<usize>) {
    let nb = blocks(lay);
    assert!(b0 <= b1 && b1 <= nb, "blocks {b0}..{b1} of {nb}");
    // a block's codes are a multiple of 4 bytes (64 or 256 entries a stage)
    let be = block_entries(lay) / 4;
    (b0..b1, nb + b0 * be..nb + (b1 * be).min(lay.table_len() / 4))
}

/// Whether tables for `level` and this layout are kept telescoped (the
/// AVX2 kernel's chains form, the x86_64 `avx2::telescope`): where
/// [`rows32`] serves the layout and the process looks up by chains
/// ([`avx2_lookup`]). Read once by whoever builds a table and passed to
/// both [`build`] and [`matvec_rows`], so a later [`set_avx2_lookup`]
/// cannot split the two.
pub fn telescopes(level: Level, lay: &VqLayout) -> bool {
    cfg!(target_arch = "x86_64") && rows32(level, lay) && avx2_lookup() == Avx2Lookup::Chains
}

/// Blocks `b0..b1` of the fast table of input `x` (the whole input, `nvec ·
/// dim` long): `d` their scales, `q` their codes (from [`parts_mut`]),
/// each 256-entry table telescoped when `telescoped` ([`telescopes`]).
///
/// # Panics
/// As [`build_table`]; when `d` or `q` do not hold those blocks.
#[allow(clippy::too_many_arguments)]
pub fn build(
    level: Level,
    books: &[&VqBook],
    lay: &VqLayout,
    x: &[f32],
    qmax: f32,
    (b0, b1): (usize, usize),
    d: &mut [f32],
    q: &mut [i8],
    telescoped: bool,
) {
    let dim = books[0].dim;
    assert_eq!(x.len(), lay.nvec * dim);
    let be = block_entries(lay);
    assert!(b1 <= blocks(lay) && d.len() == b1 - b0 && q.len() == ((b1 * be).min(lay.table_len()) - b0 * be));
    // one block's f32 table: on the stack for the standard formats (this
    // runs per expert and token for the down table), else one allocation
    let mut stack = [0f32; QBLOCK * 3 * 256];
    let mut heap = Vec::new();
    let t: &mut [f32] = if be <= stack.len() {
        &mut stack[..be]
    } else {
        heap.resize(be, 0f32);
        &mut heap
    };
    for b in b0..b1 {
        let (v0, v1) = (b * QBLOCK, ((b + 1) * QBLOCK).min(lay.nvec));
        let part = VqLayout { nvec: v1 - v0, ..*lay };
        let t = &mut t[..part.table_len()];
        build_table(level, books, &part, &x[v0 * dim..v1 * dim], t);
        let qb = &mut q[(b - b0) * be..][..t.len()];
        d[b - b0] = quantize_block(t, qmax, qb);
        #[cfg(target_arch = "x86_64")]
        if telescoped {
            let mut plain = [0i8; QBLOCK * 3 * 256];
            let plain = &mut plain[..qb.len()];
            plain.copy_from_slice(qb);
            crate::x86_64::avx2::telescope(plain, qb);
        }
    }
    let _ = telescoped;
}

/// One block's codes into `q`; returns its scale `amax / qmax`.
fn quantize_block(t: &[f32], qmax: f32, q: &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2; `q` as long as `t` (asserted there).
        return unsafe { crate::x86_64::avx2::quantize_codes(t, qmax, q) };
    }
    quantize_body(t, qmax, q)
}

/// [`quantize_block`]'s steps, written so they vectorize: the largest
/// magnitude as the largest of the values' bits without the sign (an order
/// the same as the floats' for every non-NaN value; above infinity's bits
/// a NaN is present), and each code read from the bits of `T · inv + 1.5·2²³`
/// (the rounded integer sits in the low mantissa bits).
#[inline(always)]
pub(crate) fn quantize_body(t: &[f32], qmax: f32, q: &mut [i8]) -> f32 {
    let m = t.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    if m > f32::INFINITY.to_bits() {
        q.fill(0);
        return f32::NAN;
    }
    let amax = f32::from_bits(m);
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let inv = qmax / amax;
    for (o, &v) in q.iter_mut().zip(t) {
        *o = code(v, inv, qmax);
    }
    amax / qmax
}

/// One value's code: `T · inv` rounded to the nearest integer, ties to
/// even, by adding [`RNE`] and reading the low bits (|v · inv| ≤ qmax (1 +
/// ε): the trick is exact there), clamped to ±qmax. The AVX2 form
/// (`x86_64::avx2::quantize_codes`) takes the same steps 8 lanes at a time.
#[inline(always)]
pub(crate) fn code(v: f32, inv: f32, qmax: f32) -> i8 {
    let qm = qmax as i32;
    ((v * inv + RNE).to_bits() as i32 - RNE.to_bits() as i32).clamp(-qm, qm) as i8
}

/// `y[i] = σ_{r0+i} · Σ_b fma(n_b(r0+i), d_b, ·)`: the fast mode's row sums
/// for rows `r0..r0 + y.len()` over a table from [`build`] (all its blocks)
/// held in `qt` ([`parts`]), built `telescoped` or not ([`telescopes`]).
/// `scales` holds one f16 per row.
///
/// # Panics
/// When the indices, scales or table are shorter than the layout needs, or
/// the rows are out of range.
#[allow(clippy::too_many_arguments)]
pub fn matvec_rows(
    level: Level,
    lay: &VqLayout,
    idx: &[u8],
    scales: &[u8],
    qt: &[f32],
    r0: usize,
    y: &mut [f32],
    telescoped: bool,
) {
    assert!(idx.len() >= lay.index_bytes() && scales.len() >= lay.rows * 2);
    assert!(r0.checked_add(y.len()).is_some_and(|e| e <= lay.rows));
    assert!(!telescoped || rows32(level, lay), "a telescoped table is the AVX2 kernel's");
    let (d, q) = parts(lay, qt);
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if rows64(level, lay) && r0.is_multiple_of(64) {
        done = y.len() / 64 * 64;
        // SAFETY: features checked by rows64; sizes asserted above and by parts.
        unsafe { crate::x86_64::avx512::vq_fast_rows64(lay, idx, d, q, r0, &mut y[..done]) };
    }
    #[cfg(target_arch = "x86_64")]
    if done == 0 && rows32(level, lay) && r0.is_multiple_of(32) {
        done = y.len() / 32 * 32;
        // SAFETY: features checked by rows32; sizes asserted above and by parts.
        unsafe {
            if telescoped {
                crate::x86_64::avx2::vq_fast_rows32_telescoped(lay, idx, d, q, r0, &mut y[..done])
            } else {
                let chains = avx2_lookup() == Avx2Lookup::Chains;
                crate::x86_64::avx2::vq_fast_rows32(lay, idx, d, q, r0, &mut y[..done], chains)
            }
        };
    }
    let _ = level;
    if done < y.len() {
        if telescoped {
            // the rows the AVX2 kernel leaves (a tail under 32, a start off
            // 32): the plain table back, once for the call
            #[cfg(target_arch = "x86_64")]
            PLAIN.with_borrow_mut(|p| {
                p.resize(lay.table_len(), 0);
                crate::x86_64::avx2::untelescope(&q[..lay.table_len()], p);
                rows(lay, idx, d, p, r0 + done, &mut y[done..])
            });
        } else {
            rows(lay, idx, d, q, r0 + done, &mut y[done..]);
        }
    }
    for (i, yo) in y.iter_mut().enumerate() {
        let r = r0 + i;
        *yo *= f16_to_f32(u16::from_le_bytes([scales[2 * r], scales[2 * r + 1]]));
    }
}

#[cfg(target_arch = "x86_64")]
std::thread_local! {
    /// A telescoped table's plain codes, for the rows the AVX2 kernel leaves.
    static PLAIN: core::cell::RefCell<Vec<i8>> = const { core::cell::RefCell::new(Vec::new()) };
}

/// Whether `level` on this CPU sums this layout's fast rows 64 at a time
/// with the tables in registers (AVX-512 VBMI; byte indices of 1 to 3
/// stages in index blocks of a multiple of 64 rows): callers splitting rows
/// across threads split them at multiples of 64.
pub fn rows64(level: Level, lay: &VqLayout) -> bool {
    crate::vq::uses_planes(level, lay)
}

/// Whether `level` on this CPU sums this layout's fast rows 32 at a time by
/// `pshufb` lookups (AVX2 kernels, where [`rows64`] does not; byte indices
/// of 1 to 3 stages in index blocks of a multiple of 32 rows).
pub fn rows32(level: Level, lay: &VqLayout) -> bool {
    level.avx2_kernels()
        && !rows64(level, lay)
        && !lay.packed6
        && (1..=3).contains(&lay.stages)
        && lay.block > 0
        && lay.block.is_multiple_of(32)
}

/// How the AVX2 kernel ([`rows32`]) looks a 256-entry table up: both give
/// the definition's bits; which is faster depends on the CPU's
/// `vpblendvb` (three micro-ops on the Intel Xeon of docs/lab entry 70).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Avx2Lookup {
    /// 16 `pshufb`s and a 15-blend tree on the index's high nibble.
    Blends,
    /// One chain of 16 `pshufb`s over a telescoped table, no blend.
    Chains,
}

impl Avx2Lookup {
    /// Both forms.
    pub const ALL: [Avx2Lookup; 2] = [Avx2Lookup::Blends, Avx2Lookup::Chains];
    /// As reports name it.
    pub fn name(self) -> &'static str {
        match self {
            Avx2Lookup::Blends => "blends",
            Avx2Lookup::Chains => "chains",
        }
    }
}

/// The AVX2 lookup form: 0 not chosen yet, else 1 + the form's index in
/// [`Avx2Lookup::ALL`].
static AVX2_LOOKUP: core::sync::atomic::AtomicU8 = core::sync::atomic::AtomicU8::new(0);

/// Choose the AVX2 lookup form for the whole process (benchmarks, tests;
/// `WASTE_VQ_LOOKUP=blends|chains` does it for a run).
pub fn set_avx2_lookup(l: Avx2Lookup) {
    AVX2_LOOKUP.store(1 + l as u8, core::sync::atomic::Ordering::Relaxed);
}

/// The AVX2 lookup form in use: the one set, else `WASTE_VQ_LOOKUP`, else
/// the faster on this CPU by a probe of well under a millisecond, run once
/// per process on the first call ([`probe_avx2_lookup`]). On a CPU without
/// AVX2 it names the form the probe would not need: `Chains`.
pub fn avx2_lookup() -> Avx2Lookup {
    match AVX2_LOOKUP.load(core::sync::atomic::Ordering::Relaxed) {
        1 => return Avx2Lookup::Blends,
        2 => return Avx2Lookup::Chains,
        _ => {}
    }
    let chosen = match std::env::var("WASTE_VQ_LOOKUP").as_deref() {
        Ok("blends") => Avx2Lookup::Blends,
        Ok("chains") => Avx2Lookup::Chains,
        _ => probe_avx2_lookup(),
    };
    // a race sets the same answer or the probe's other run: either is exact
    AVX2_LOOKUP.store(1 + chosen as u8, core::sync::atomic::Ordering::Relaxed);
    chosen
}

/// Time both AVX2 lookup forms on a synthetic table and indices the shape
/// of a thread's share of an expert matrix (512 rows, 96 positions, 3
/// stages: 72 KiB of codes, a real table's place past L1), alternated, 9
/// runs each (about 0.6 ms in all); the faster by its best run. `Chains`
/// where the CPU has no AVX2. Chains run on a table already telescoped, as
/// real calls do since the table keeps that form from its build (docs/lab
/// entry 71; a 128-row probe that telescoped per call chose blends on the
/// Intel Xeon, where whole matrices ran 14 % faster by chains: lab 70).
pub fn probe_avx2_lookup() -> Avx2Lookup {
    let lay = VqLayout { rows: 512, nvec: 96, stages: 3, block: 64, packed6: false };
    if !rows32(Level::Avx2, &lay) {
        return Avx2Lookup::Chains;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let mut r = waste_rng::SplitMix64::new(50);
        let idx: Vec<u8> = (0..lay.index_bytes()).map(|_| r.next_u64() as u8).collect();
        let q: Vec<i8> = (0..lay.table_len()).map(|_| r.next_u64() as i8).collect();
        let d = vec![1.0f32; blocks(&lay)];
        let mut y = vec![0f32; lay.rows];
        let mut best = [f64::INFINITY; 2];
        for _ in 0..9 {
            for (k, b) in best.iter_mut().enumerate() {
                let t = std::time::Instant::now();
                // SAFETY: rows32 checked AVX2 and the layout; the sizes are the layout's.
                // (Chains as a real call runs them: on a table telescoped at its build,
                // which random codes stand for as well as any.)
                unsafe {
                    if k == 1 {
                        crate::x86_64::avx2::vq_fast_rows32_telescoped(&lay, &idx, &d, &q, 0, &mut y)
                    } else {
                        crate::x86_64::avx2::vq_fast_rows32(&lay, &idx, &d, &q, 0, &mut y, false)
                    }
                };
                *b = b.min(t.elapsed().as_secs_f64());
            }
        }
        if best[0] < best[1] {
            return Avx2Lookup::Blends;
        }
    }
    Avx2Lookup::Chains
}

/// The kernel that sums this layout's fast rows at `level` on this CPU, as
/// reports name it: `avx512-int8-permutes`, `avx2-int8-pshufb-chains` (or
/// `avx2-int8-pshufb-blends`: [`avx2_lookup`]) or `int8-loads`.
pub fn rows_kernel_name(level: Level, lay: &VqLayout) -> &'static str {
    if rows64(level, lay) {
        "avx512-int8-permutes"
    } else if rows32(level, lay) {
        match avx2_lookup() {
            Avx2Lookup::Blends => "avx2-int8-pshufb-blends",
            Avx2Lookup::Chains => "avx2-int8-pshufb-chains",
        }
    } else {
        "int8-loads"
    }
}

fma_scalar! {
    /// Unscaled fast row sums (before `σ_r`), any layout, by plain loads:
    /// the definition at every level.
    fn rows(lay: &VqLayout, idx: &[u8], d: &[f32], q: &[i8], r0: usize, y: &mut [f32]) {
        if y.is_empty() {
            return;
        }
        match (lay.packed6, lay.stages) {
            (false, 1) => rows_generic::<1, 256, false>(lay, idx, d, q, r0, y),
            (false, 2) => rows_generic::<2, 256, false>(lay, idx, d, q, r0, y),
            (false, 3) => rows_generic::<3, 256, false>(lay, idx, d, q, r0, y),
            (true, 4) => rows_generic::<4, 64, true>(lay, idx, d, q, r0, y),
            _ => rows_any(lay, idx, d, q, r0, y),
        }
    }
}

/// [`rows`] for `ST` stages of `TE` entries: eight rows interleaved,
/// positions in L1-sized tiles of whole blocks.
#[inline(always)]
fn rows_generic<const ST: usize, const TE: usize, const P6: bool>(
    lay: &VqLayout,
    idx: &[u8],
    d: &[f32],
    q: &[i8],
    r0: usize,
    y: &mut [f32],
) {
    let bpv = if P6 { ST * 6 / 8 } else { ST };
    let vstride = lay.vstride();
    let end = r0 + y.len();
    let mut v0 = 0;
    while v0 < lay.nvec {
        let v1 = (v0 + TILE).min(lay.nvec);
        let mut r = r0;
        while r < end {
            let together = lay.block > 0 && r % lay.block + GROUP <= lay.block && r + GROUP <= end;
            let n = if together { GROUP } else { 1 };
            let yr = &mut y[r - r0..r - r0 + n];
            let mut acc = [0f32; GROUP];
            if v0 > 0 {
                acc[..n].copy_from_slice(yr);
            }
            let mut o = lay.offset(r, v0);
            let mut vb = v0;
            while vb < v1 {
                let ve = (vb + QBLOCK).min(v1);
                let mut sum = [0i32; GROUP];
                for v in vb..ve {
                    let tv = &q[v * ST * TE..(v + 1) * ST * TE];
                    let t: [&[i8; TE]; ST] = core::array::from_fn(|s| {
                        <&[i8; TE]>::try_from(&tv[s * TE..(s + 1) * TE]).expect("a stage's table is TE entries")
                    });
                    if together {
                        let g = &idx[o..o + GROUP * bpv];
                        for (i, a) in sum.iter_mut().enumerate() {
                            let gi = &g[i * bpv..(i + 1) * bpv];
                            for (s, ts) in t.iter().enumerate() {
                                *a += ts[field::<ST, P6>(gi, s)] as i32;
                            }
                        }
                    } else {
                        let gi = &idx[o..o + bpv];
                        for (s, ts) in t.iter().enumerate() {
                            sum[0] += ts[field::<ST, P6>(gi, s)] as i32;
                        }
                    }
                    o += vstride;
                }
                let db = d[vb / QBLOCK];
                for (a, &s) in acc.iter_mut().zip(&sum).take(n) {
                    *a = (s as f32).mul_add(db, *a);
                }
                vb = ve;
            }
            yr.copy_from_slice(&acc[..n]);
            r += n;
        }
        v0 = v1;
    }
}

fma_scalar! {
    /// [`rows`] for a layout no specialised form takes: one row at a time.
    fn rows_any(lay: &VqLayout, idx: &[u8], d: &[f32], q: &[i8], r0: usize, y: &mut [f32]) {
        let te = lay.table_entries();
        let mut ix = [0usize; 8];
        for (i, yo) in y.iter_mut().enumerate() {
            let mut acc = 0f32;
            let mut o = lay.offset(r0 + i, 0);
            for (b, &db) in d.iter().enumerate() {
                let mut sum = 0i32;
                for v in b * QBLOCK..((b + 1) * QBLOCK).min(lay.nvec) {
                    lay.indices_at(idx, o, &mut ix);
                    for (s, &e) in ix.iter().enumerate().take(lay.stages) {
                        sum += q[(v * lay.stages + s) * te + e] as i32;
                    }
                    o += lay.vstride();
                }
                acc = (sum as f32).mul_add(db, acc);
            }
            *yo = acc;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book(entries: usize, seed: u64) -> VqBook {
        let mut r = crate::SplitMix64::new(seed);
        let bits: Vec<u16> = (0..entries * 8).map(|_| crate::f32_to_f16(r.unif() - 0.5)).collect();
        VqBook::from_f16(&bits, entries, 8)
    }

    /// The definition written out once, one row at a time, from the f32
    /// table: the kernel must give its bits.
    fn reference(lay: &VqLayout, books: &[&VqBook], x: &[f32], idx: &[u8], scales: &[u8], qmax: f32) -> Vec<f32> {
        let mut t = vec![0f32; lay.table_len()];
        build_table(Level::Scalar, books, lay, x, &mut t);
        let te = lay.table_entries();
        let per_v = lay.stages * te;
        (0..lay.rows)
            .map(|r| {
                let mut acc = 0f32;
                for b in 0..blocks(lay) {
                    let (v0, v1) = (b * QBLOCK, ((b + 1) * QBLOCK).min(lay.nvec));
                    let tb = &t[v0 * per_v..v1 * per_v];
                    let amax = tb.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let mut n = 0i64;
                    let mut ix = [0usize; 8];
                    for v in v0..v1 {
                        lay.indices(idx, r, v, &mut ix);
                        for (s, &e) in ix.iter().enumerate().take(lay.stages) {
                            let tv = t[(v * lay.stages + s) * te + e];
                            if amax > 0.0 {
                                n += ((tv * (qmax / amax)).round_ties_even().clamp(-qmax, qmax)) as i64;
                            }
                        }
                    }
                    acc = (n as f32).mul_add(amax / qmax, acc);
                }
                acc * f16_to_f32(u16::from_le_bytes([scales[2 * r], scales[2 * r + 1]]))
            })
            .collect()
    }

    fn case(lay: VqLayout, seed: u64, level: Level) {
        let mut r = crate::SplitMix64::new(seed);
        let owned: Vec<VqBook> = (0..lay.stages).map(|s| book(lay.table_entries(), seed + s as u64)).collect();
        let books: Vec<&VqBook> = owned.iter().collect();
        let x: Vec<f32> = (0..lay.nvec * 8).map(|_| r.unif() * 4.0 - 2.0).collect();
        let idx: Vec<u8> = (0..lay.index_bytes()).map(|_| (r.next_u64() & 0xff) as u8).collect();
        let scales: Vec<u8> = (0..lay.rows).flat_map(|_| crate::f32_to_f16(0.5 + r.unif()).to_le_bytes()).collect();
        let mut buf = vec![0f32; lay.table_len()];
        assert!(qtable_floats(&lay) <= buf.len());
        // built in two halves, as the pool builds it, in the form this
        // level and lookup keep
        let nb = blocks(&lay);
        let tele = telescopes(level, &lay);
        for (b0, b1) in [(0, nb / 2), (nb / 2, nb)] {
            let (d, q) = parts_mut(&lay, &mut buf, b0, b1);
            build(level, &books, &lay, &x, 127.0, (b0, b1), d, q, tele);
        }
        let want = reference(&lay, &books, &x, &idx, &scales, 127.0);
        // every row range the kernels may be given
        for (a, b) in [(0, lay.rows), (1, lay.rows.min(13)), (lay.rows / 2, lay.rows), (64.min(lay.rows), lay.rows)] {
            let mut y = vec![0f32; b - a];
            matvec_rows(level, &lay, &idx, &scales, &buf, a, &mut y, tele);
            for (i, (g, w)) in y.iter().zip(&want[a..b]).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{lay:?} row {} level {level:?}", a + i);
            }
        }
    }

    /// Every level and kernel (the AVX-512 one in both plane lookups, the
    /// AVX2 one in both table lookups, from row 0 and from row 64) gives
    /// the definition's bits.
    #[test]
    fn rows_are_the_definition_at_every_level() {
        for (lookup, form) in crate::vq::PlaneLookup::ALL.into_iter().zip(Avx2Lookup::ALL) {
            crate::vq::set_plane_lookup(lookup);
            set_avx2_lookup(form);
            for level in Level::available() {
                for (rows, stages, packed6, nvec, block) in [
                    (70, 3, false, 37, 64),
                    (200, 3, false, 9, 128),
                    (128, 2, false, 6, 64),
                    (64, 1, false, 5, 64),
                    (70, 2, false, 9, 8),
                    (70, 1, false, 5, 0),
                    (70, 4, true, 11, 64),
                    (70, 3, false, 1, 16),
                ] {
                    let lay = VqLayout { rows, nvec, stages, block, packed6 };
                    case(lay, 7 + nvec as u64, level);
                }
            }
        }
    }

    /// The AVX2 codes (`x86_64::avx2::quantize_codes`) are the scalar
    /// steps' bytes and scale: every length (tails of 1..31 values), ties,
    /// ±amax, zero blocks and a NaN (on a CPU with AVX2, as the other
    /// levels' tests here run on the levels the CPU has).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_codes_are_the_scalar_steps() {
        if !Level::available().contains(&Level::Avx2) {
            return;
        }
        let mut r = crate::SplitMix64::new(7);
        for len in (0..100).chain([768, 1024, 3072, 3071]) {
            for case in 0..4 {
                let mut t: Vec<f32> = (0..len).map(|_| (r.unif() * 2.0 - 1.0) * 3.0).collect();
                match case {
                    // values whose codes are exact halves (ties to even)
                    1 if len > 2 => {
                        t[0] = 2.0;
                        for (i, v) in t.iter_mut().enumerate().skip(1) {
                            *v = (i as f32 % 9.0 - 4.0) * (2.0 / 127.0) + 1.0 / 127.0;
                        }
                    }
                    2 => t.iter_mut().for_each(|v| *v = 0.0),
                    3 if len > 0 => t[len / 2] = f32::NAN,
                    _ => {}
                }
                for qmax in [127.0, 63.0] {
                    let (mut a, mut b) = (vec![0i8; len], vec![0i8; len]);
                    let da = quantize_body(&t, qmax, &mut a);
                    // SAFETY: AVX2 checked above; equal lengths.
                    let db = unsafe { crate::x86_64::avx2::quantize_codes(&t, qmax, &mut b) };
                    assert_eq!(a, b, "len {len} case {case} qmax {qmax}");
                    assert_eq!(da.to_bits(), db.to_bits(), "len {len} case {case}");
                }
            }
        }
    }

    /// A telescoped table (the AVX2 chains' form, kept from the build)
    /// comes back whole: every byte of random tables, wrapping included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn untelescope_undoes_telescope() {
        let mut r = crate::SplitMix64::new(11);
        let t: Vec<i8> = (0..256 * 12).map(|_| r.next_u64() as i8).collect();
        let (mut tq, mut back) = (vec![0i8; t.len()], vec![0i8; t.len()]);
        crate::x86_64::avx2::telescope(&t, &mut tq);
        assert_ne!(tq, t);
        crate::x86_64::avx2::untelescope(&tq, &mut back);
        assert_eq!(back, t);
    }

    #[test]
    fn a_nan_input_shows_and_partial_books_stay_exact() {
        let lay = VqLayout { rows: 8, nvec: 4, stages: 3, block: 8, packed6: false };
        let owned: Vec<VqBook> = (0..3).map(|s| book(256, s)).collect();
        let books: Vec<&VqBook> = owned.iter().collect();
        let mut x = vec![0.5f32; 32];
        x[3] = f32::NAN;
        let mut buf = vec![0f32; lay.table_len()];
        let (d, q) = parts_mut(&lay, &mut buf, 0, 1);
        build(Level::Scalar, &books, &lay, &x, 127.0, (0, 1), d, q, false);
        let mut y = vec![0f32; 8];
        let scales = vec![0x3c; 16];
        matvec_rows(Level::Scalar, &lay, &vec![1u8; lay.index_bytes()], &scales, &buf, 0, &mut y, false);
        assert!(y.iter().all(|v| v.is_nan()));
        let short = book(200, 9);
        assert!(applies(books.iter().copied(), &lay));
        assert!(!applies([&short, books[1], books[2]], &lay));
    }
}
