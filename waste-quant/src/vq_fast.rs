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

/// How a fast table keeps its codes: the form the rows that read it take.
/// Chosen once by whoever builds a table ([`table_form`]) and passed to
/// both [`build`] and [`matvec_rows`], so a later [`set_avx2_lookup`]
/// cannot split the two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableForm {
    /// One `i8` per code.
    Plain,
    /// One `i8` per code, each 256-entry table telescoped (the x86_64
    /// `avx2::telescope`): the AVX2 chains' form.
    Telescoped,
    /// One `i16` (little-endian) per code, and 2 bytes of padding after the
    /// last: the AVX2 gathers' form (`x86_64::gathers`).
    Wide,
}

impl TableForm {
    /// Bytes per code.
    fn width(self) -> usize {
        if self == TableForm::Wide {
            2
        } else {
            1
        }
    }
}

/// Floats of a fast table of `form` in an f32 buffer: the block scales,
/// then the codes four (two when wide) to a float and, wide, one float of
/// padding. Never more than [`VqLayout::table_len`], so the exact mode's
/// table buffer holds it.
pub fn qtable_floats(lay: &VqLayout, form: TableForm) -> usize {
    blocks(lay).saturating_add(code_floats(lay, form))
}

/// Floats of a table's codes (with the wide form's padding).
fn code_floats(lay: &VqLayout, form: TableForm) -> usize {
    let pad = usize::from(form == TableForm::Wide);
    lay.table_len().saturating_mul(form.width()).div_ceil(4).saturating_add(pad)
}

/// Table entries (codes) of one block of positions.
fn block_entries(lay: &VqLayout) -> usize {
    QBLOCK * lay.stages * lay.table_entries()
}

/// The scales and code bytes of a fast table of `form` in `buf` (from
/// [`build`]; the wide form's padding included).
///
/// # Panics
/// When `buf` is shorter than [`qtable_floats`].
pub fn parts<'a>(lay: &VqLayout, form: TableForm, buf: &'a [f32]) -> (&'a [f32], &'a [u8]) {
    let nb = blocks(lay);
    let (d, q) = buf[..qtable_floats(lay, form)].split_at(nb);
    let bytes = if form == TableForm::Wide { 2 * lay.table_len() + 2 } else { lay.table_len() };
    (d, &bytemuck::cast_slice(q)[..bytes])
}

/// The scales and code bytes of blocks `b0..b1` of a fast table of `form`
/// in `buf`, to write.
///
/// # Panics
/// When `buf` is shorter than [`qtable_floats`] or the blocks are out of range.
pub fn parts_mut<'a>(
    lay: &VqLayout,
    form: TableForm,
    buf: &'a mut [f32],
    b0: usize,
    b1: usize,
) -> (&'a mut [f32], &'a mut [u8]) {
    let (d, q) = block_ranges(lay, form, b0, b1);
    let (lo, hi) = buf[..qtable_floats(lay, form)].split_at_mut(q.start);
    (&mut lo[d], bytemuck::cast_slice_mut(&mut hi[..q.len()]))
}

/// Where blocks `b0..b1` of a fast table of `form` lie in its f32 buffer:
/// their scales and their codes, as float ranges — disjoint for disjoint
/// blocks, so threads can build a table's blocks side by side (the last
/// block's range holds the wide form's padding).
///
/// # Panics
/// When the blocks are out of range.
pub fn block_ranges(
    lay: &VqLayout,
    form: TableForm,
    b0: usize,
    b1: usize,
) -> (core::ops::Range<usize>, core::ops::Range<usize>) {
    let nb = blocks(lay);
    assert!(b0 <= b1 && b1 <= nb, "blocks {b0}..{b1} of {nb}");
    // a block's codes are a multiple of 4 bytes (64 or 256 entries a stage)
    let be = block_entries(lay) * form.width() / 4;
    let end = if b1 == nb { code_floats(lay, form) } else { b1 * be };
    (b0..b1, nb + b0 * be..nb + end)
}

/// The form of the fast tables for `level` and this layout: where
/// [`rows32`] serves the layout, the one the process looks up by
/// ([`avx2_lookup`]: chains read a telescoped table, gathers a wide one
/// where they serve the layout's stages, else chains); elsewhere plain.
pub fn table_form(level: Level, lay: &VqLayout) -> TableForm {
    if !(cfg!(target_arch = "x86_64") && rows32(level, lay)) {
        return TableForm::Plain;
    }
    match avx2_lookup() {
        Avx2Lookup::Blends => TableForm::Plain,
        Avx2Lookup::Gathers if gathers_serve(lay) => TableForm::Wide,
        _ => TableForm::Telescoped,
    }
}

/// Whether two inputs' rows of this layout can share their gathers
/// ([`matvec_rows_pair`] with wide tables) on some level of this build: an
/// x86_64 build, byte stages the gathers serve, index blocks of a multiple
/// of 32 rows. A property of the layout, not of the CPU, so buffers for it
/// are the same on every x86_64 machine.
pub fn pairs_serve(lay: &VqLayout) -> bool {
    cfg!(target_arch = "x86_64")
        && gathers_serve(lay)
        && !lay.packed6
        && lay.stages == lay.bpv()
        && lay.block > 0
        && lay.block.is_multiple_of(32)
}

/// Whether the AVX2 gathers serve this layout (2 or 3 byte stages).
fn gathers_serve(lay: &VqLayout) -> bool {
    #[cfg(target_arch = "x86_64")]
    return crate::x86_64::gathers::serves(lay.bpv());
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = lay;
        false
    }
}

/// Blocks `b0..b1` of the fast table of input `x` (the whole input, `nvec ·
/// dim` long): `d` their scales, `q` their code bytes in `form` (from
/// [`parts_mut`]).
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
    q: &mut [u8],
    form: TableForm,
) {
    let dim = books[0].dim;
    assert_eq!(x.len(), lay.nvec * dim);
    let be = block_entries(lay);
    let (w, nb) = (form.width(), blocks(lay));
    let pad = if b1 == nb && form == TableForm::Wide { 4 } else { 0 };
    assert!(b1 <= nb && d.len() == b1 - b0 && q.len() == w * ((b1 * be).min(lay.table_len()) - b0 * be) + pad);
    // one block's f32 table and codes: on the stack for the standard
    // formats (this runs per expert and token for the down table), else
    // one allocation
    let mut stack = [0f32; QBLOCK * 3 * 256];
    let mut codes = [0i8; QBLOCK * 3 * 256];
    let mut heap = (Vec::new(), Vec::new());
    let (t, c): (&mut [f32], &mut [i8]) = if be <= stack.len() {
        (&mut stack[..be], &mut codes[..be])
    } else {
        heap.0.resize(be, 0f32);
        heap.1.resize(be, 0i8);
        (&mut heap.0, &mut heap.1)
    };
    for b in b0..b1 {
        let (v0, v1) = (b * QBLOCK, ((b + 1) * QBLOCK).min(lay.nvec));
        let part = VqLayout { nvec: v1 - v0, ..*lay };
        let (t, c) = (&mut t[..part.table_len()], &mut c[..part.table_len()]);
        build_table(level, books, &part, &x[v0 * dim..v1 * dim], t);
        let qb = &mut q[w * (b - b0) * be..][..w * t.len()];
        d[b - b0] = match form {
            TableForm::Plain => quantize_block(level, t, qmax, bytemuck::cast_slice_mut(qb)),
            TableForm::Wide => quantize_block_wide(t, qmax, qb),
            TableForm::Telescoped => {
                let s = quantize_block(level, t, qmax, c);
                telescope_into(c, qb);
                s
            }
        };
    }
}

/// Plain codes `c` telescoped into `q` (the x86_64 `avx2::telescope`).
///
/// # Panics
/// Off x86_64, where no kernel reads that form.
fn telescope_into(c: &[i8], q: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    crate::x86_64::avx2::telescope(c, bytemuck::cast_slice_mut(q));
    #[cfg(not(target_arch = "x86_64"))]
    panic!("telescoped tables ({} codes to {}) are the x86_64 AVX2 kernel's", c.len(), q.len());
}

/// One block's codes as `i16` (little-endian) into `q` (twice as long as
/// `t`); returns its scale, as [`quantize_block`].
fn quantize_block_wide(t: &[f32], qmax: f32, q: &mut [u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2; `q` twice as long as `t` (asserted there).
        return unsafe { crate::x86_64::avx2::quantize_codes_wide(t, qmax, q) };
    }
    quantize_body_into(t, qmax, q)
}

/// [`quantize_body`] for codes of `q.len() / t.len()` bytes (1: `i8`, 2:
/// `i16` little-endian): the bytes' codes in `q`'s first half, then each
/// widened in place from the last (code `i` moves to bytes `2i, 2i + 1`,
/// never before a code still to be read).
///
/// # Panics
/// When `q` is not 1 or 2 times as long as `t`.
pub(crate) fn quantize_body_into(t: &[f32], qmax: f32, q: &mut [u8]) -> f32 {
    let n = t.len();
    assert!(q.len() == n || q.len() == 2 * n, "one or two bytes a code");
    let d = quantize_body(t, qmax, bytemuck::cast_slice_mut(&mut q[..n]));
    if q.len() == 2 * n {
        for i in (0..n).rev() {
            let w = i16::from(q[i] as i8).to_le_bytes();
            q[2 * i..2 * i + 2].copy_from_slice(&w);
        }
    }
    d
}

/// One block's codes into `q`; returns its scale `amax / qmax` (the same
/// codes at every level).
fn quantize_block(level: Level, t: &[f32], qmax: f32, q: &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx512 && Level::Avx512.supported() {
        // SAFETY: the CPU has AVX-512 F; `q` as long as `t` (asserted there).
        return unsafe { crate::x86_64::avx512::quantize_codes(t, qmax, q) };
    }
    let _ = level;
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
/// held in `qt` ([`parts`]), built in `form` ([`table_form`]). `scales`
/// holds one f16 per row.
///
/// # Panics
/// When the indices, scales or table are shorter than the layout needs, or
/// the rows are out of range; when `form` is not plain and [`rows32`] does
/// not serve the layout at `level`.
#[allow(clippy::too_many_arguments)]
pub fn matvec_rows(
    level: Level,
    lay: &VqLayout,
    idx: &[u8],
    scales: &[u8],
    qt: &[f32],
    r0: usize,
    y: &mut [f32],
    form: TableForm,
) {
    assert!(idx.len() >= lay.index_bytes() && scales.len() >= lay.rows * 2);
    assert!(r0.checked_add(y.len()).is_some_and(|e| e <= lay.rows));
    assert!(form == TableForm::Plain || rows32(level, lay), "a {form:?} table is the AVX2 kernel's");
    assert!(form != TableForm::Wide || gathers_serve(lay), "wide tables serve 2 or 3 byte stages");
    let (d, q) = parts(lay, form, qt);
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if rows64(level, lay) && r0.is_multiple_of(64) {
        done = y.len() / 64 * 64;
        // SAFETY: features checked by rows64; sizes asserted above and by parts.
        unsafe { crate::x86_64::avx512::vq_fast_rows64(lay, idx, d, bytemuck::cast_slice(q), r0, &mut y[..done]) };
    }
    #[cfg(target_arch = "x86_64")]
    if done == 0 && rows32(level, lay) && r0.is_multiple_of(32) {
        done = y.len() / 32 * 32;
        let (q8, y) = (bytemuck::cast_slice(q), &mut y[..done]);
        // SAFETY: features checked by rows32; sizes asserted above and by parts.
        unsafe {
            match form {
                TableForm::Wide => crate::x86_64::gathers::rows32(lay, idx, d, q, r0, y),
                TableForm::Telescoped => crate::x86_64::avx2::vq_fast_rows32_telescoped(lay, idx, d, q8, r0, y),
                TableForm::Plain => crate::x86_64::avx2::vq_fast_rows32(lay, idx, d, q8, r0, y),
            }
        };
    }
    #[cfg(target_arch = "aarch64")]
    if rows16(level, lay) && form == TableForm::Plain && r0.is_multiple_of(16) {
        done = y.len() / 16 * 16;
        crate::aarch64::vq_fast::rows16(lay, idx, d, bytemuck::cast_slice(q), r0, &mut y[..done]);
    }
    if done < y.len() {
        if form == TableForm::Plain {
            rows(lay, idx, d, bytemuck::cast_slice(q), r0 + done, &mut y[done..]);
        } else {
            // the rows the AVX2 kernels leave (a tail under 32, a start off
            // 32): the plain table back, once for the call
            #[cfg(target_arch = "x86_64")]
            PLAIN.with_borrow_mut(|p| {
                p.resize(lay.table_len(), 0);
                plain_codes(form, q, p);
                rows(lay, idx, d, p, r0 + done, &mut y[done..])
            });
        }
    }
    let sc = &scales[2 * r0..2 * (r0 + y.len())];
    #[cfg(target_arch = "x86_64")]
    if level.avx2_kernels() {
        // SAFETY: the AVX2 kernels' level has AVX2 and F16C; 2 bytes a row.
        return unsafe { crate::x86_64::avx2::scale_by_f16(y, sc) };
    }
    for (yo, s) in y.iter_mut().zip(sc.chunks_exact(2)) {
        *yo *= f16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

/// [`matvec_rows`] for two inputs through the same rows: `ys[j]` from the
/// table in `qts[j]`, both built in `form`. Where the AVX2 gathers serve
/// the layout and the tables are plain ([`TableForm::Plain`], as
/// [`pairs_serve`] callers build them) one gather looks both up, each
/// tile's codes widened side by side (`x86_64::gathers::rows32_pair`);
/// elsewhere the tables go one after the other. Each output is
/// bit-identical to [`matvec_rows`] on its table. The same table twice is
/// one input's rows by the gathers from a plain table.
///
/// # Panics
/// As [`matvec_rows`]; when the outputs differ in length.
#[allow(clippy::too_many_arguments)]
pub fn matvec_rows_pair(
    level: Level,
    lay: &VqLayout,
    idx: &[u8],
    scales: &[u8],
    qts: [&[f32]; 2],
    r0: usize,
    ys: [&mut [f32]; 2],
    form: TableForm,
) {
    // SAFETY (the kernel's call): `matvec_rows_together` checked the features and sizes.
    #[cfg(target_arch = "x86_64")]
    let gather = |d, q, h: [&mut [f32]; 2]| unsafe { crate::x86_64::gathers::rows32_pair(lay, idx, d, q, r0, h) };
    #[cfg(not(target_arch = "x86_64"))]
    let gather = |_: [&[f32]; 2], _: [&[u8]; 2], _: [&mut [f32]; 2]| unreachable!("the gathers are x86_64's");
    matvec_rows_together(level, lay, idx, scales, qts, r0, ys, form, gather);
}

/// [`matvec_rows_pair`] for four inputs: where the AVX2 gathers serve the
/// layout and the tables are plain, one `vpgatherdq` looks four rows up in
/// all four tables (`x86_64::gathers::rows32_quad`); elsewhere the tables
/// go one after the other. Each output is bit-identical to [`matvec_rows`]
/// on its table; a table given twice gives its rows twice.
///
/// # Panics
/// As [`matvec_rows`]; when the outputs differ in length.
#[allow(clippy::too_many_arguments)]
pub fn matvec_rows_quad(
    level: Level,
    lay: &VqLayout,
    idx: &[u8],
    scales: &[u8],
    qts: [&[f32]; 4],
    r0: usize,
    ys: [&mut [f32]; 4],
    form: TableForm,
) {
    // SAFETY (the kernel's call): `matvec_rows_together` checked the features and sizes.
    #[cfg(target_arch = "x86_64")]
    let gather = |d, q, h: [&mut [f32]; 4]| unsafe { crate::x86_64::gathers::rows32_quad(lay, idx, d, q, r0, h) };
    #[cfg(not(target_arch = "x86_64"))]
    let gather = |_: [&[f32]; 4], _: [&[u8]; 4], _: [&mut [f32]; 4]| unreachable!("the gathers are x86_64's");
    matvec_rows_together(level, lay, idx, scales, qts, r0, ys, form, gather);
}

/// [`matvec_rows_pair`] and [`matvec_rows_quad`]: `N` inputs through the
/// same rows, the whole 32-row groups by `gather(scales, codes, outputs)`
/// (an AVX2 kernel sharing its gathers) where it serves the layout and the
/// tables are plain, then the rows' scales; the rest table by table.
///
/// # Panics
/// As [`matvec_rows`]; when the outputs differ in length.
#[allow(clippy::too_many_arguments)]
fn matvec_rows_together<'t, const N: usize>(
    level: Level,
    lay: &VqLayout,
    idx: &[u8],
    scales: &[u8],
    qts: [&'t [f32]; N],
    r0: usize,
    mut ys: [&mut [f32]; N],
    form: TableForm,
    gather: impl FnOnce([&'t [f32]; N], [&'t [u8]; N], [&mut [f32]; N]),
) {
    let len = ys[0].len();
    assert!(ys.iter().all(|y| y.len() == len), "{N} outputs of the same rows");
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if form == TableForm::Plain && rows32(level, lay) && gathers_serve(lay) && r0.is_multiple_of(32) && len >= 32 {
        assert!(idx.len() >= lay.index_bytes() && scales.len() >= lay.rows * 2);
        assert!(r0.checked_add(len).is_some_and(|e| e <= lay.rows));
        done = len / 32 * 32;
        let ps = qts.map(|t| parts(lay, form, t));
        let mut it = ys.iter_mut();
        gather(ps.map(|p| p.0), ps.map(|p| p.1), core::array::from_fn(|_| &mut it.next().expect("N outputs")[..done]));
        let sc = &scales[2 * r0..2 * (r0 + done)];
        for y in ys.iter_mut() {
            // SAFETY: the AVX2 kernels' level has AVX2 and F16C; 2 bytes a row.
            unsafe { crate::x86_64::avx2::scale_by_f16(&mut y[..done], sc) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = gather;
    if done < len {
        for (y, t) in ys.iter_mut().zip(qts) {
            matvec_rows(level, lay, idx, scales, t, r0 + done, &mut y[done..], form);
        }
    }
}

/// A table's plain codes (`out`, `table_len` of them) from its code bytes
/// `q` in `form`.
#[cfg(target_arch = "x86_64")]
fn plain_codes(form: TableForm, q: &[u8], out: &mut [i8]) {
    match form {
        TableForm::Plain => out.copy_from_slice(bytemuck::cast_slice(&q[..out.len()])),
        TableForm::Telescoped => crate::x86_64::avx2::untelescope(bytemuck::cast_slice(&q[..out.len()]), out),
        TableForm::Wide => {
            for (o, c) in out.iter_mut().zip(q.chunks_exact(2)) {
                // a code is within ±127: its low byte is the i8
                *o = i16::from_le_bytes([c[0], c[1]]) as i8;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
std::thread_local! {
    /// A table's plain codes, for the rows the AVX2 kernels leave.
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
/// `pshufb` lookups or gathers (AVX2 kernels, where [`rows64`] does not;
/// byte indices of 1 to 3 stages in index blocks of a multiple of 32 rows).
/// A plain table there is read by the blend tree, a telescoped one by the
/// chains, a wide one by the gathers ([`TableForm`]).
pub fn rows32(level: Level, lay: &VqLayout) -> bool {
    level.avx2_kernels()
        && !rows64(level, lay)
        && !lay.packed6
        && (1..=3).contains(&lay.stages)
        && lay.block > 0
        && lay.block.is_multiple_of(32)
}

/// Whether `level` on this CPU sums this layout's fast rows 16 at a time by
/// NEON `tbl`/`tbx` lookups (`aarch64::vq_fast`: 1 to 3 byte stages or
/// VQ4P, index blocks of a multiple of 16 rows; plain tables).
pub fn rows16(level: Level, lay: &VqLayout) -> bool {
    #[cfg(target_arch = "aarch64")]
    {
        level.neon_kernels() && crate::aarch64::vq_fast::serves(lay)
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        let _ = (level, lay);
        false
    }
}

/// How the AVX2 kernel ([`rows32`]) looks a 256-entry table up: all give
/// the definition's bits; which is faster depends on the CPU — its
/// `vpblendvb` (three micro-ops on the Intel Xeon of docs/lab entry 70) and
/// its `vpgatherdd` (4.2 cycles for eight lanes there, slow on AMD Zen 2/3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Avx2Lookup {
    /// 16 `pshufb`s and a 15-blend tree on the index's high nibble.
    Blends,
    /// One chain of 16 `pshufb`s over a telescoped table, no blend.
    Chains,
    /// Dword gathers from a wide (`i16`) table, eight rows a gather, in
    /// tiles of positions (layouts of 2 or 3 byte stages; chains for one).
    Gathers,
}

impl Avx2Lookup {
    /// Every form.
    pub const ALL: [Avx2Lookup; 3] = [Avx2Lookup::Blends, Avx2Lookup::Chains, Avx2Lookup::Gathers];
    /// As reports name it.
    pub fn name(self) -> &'static str {
        match self {
            Avx2Lookup::Blends => "blends",
            Avx2Lookup::Chains => "chains",
            Avx2Lookup::Gathers => "gathers",
        }
    }
}

/// The AVX2 lookup form fixed for the process ([`set_avx2_lookup`] or
/// `WASTE_VQ_LOOKUP`): 0 none, else 1 + the form's index in
/// [`Avx2Lookup::ALL`].
static AVX2_FIXED: core::sync::atomic::AtomicU8 = core::sync::atomic::AtomicU8::new(0);
/// The form the probes chose so far, encoded as [`AVX2_FIXED`] (0: no probe
/// has finished yet).
static AVX2_PROBED: core::sync::atomic::AtomicU8 = core::sync::atomic::AtomicU8::new(0);
/// Calls of [`avx2_lookup`] that did not find a fixed form.
static AVX2_CALLS: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(0);
/// One probe's times ([`probe_times`]): seconds per form in
/// [`Avx2Lookup::ALL`]'s order, then two inputs' rows by the pair kernel,
/// then four inputs' by the quad kernel.
pub type ProbeTimes = [f64; 5];

/// Every probe's times.
static AVX2_PROBES: std::sync::Mutex<Vec<ProbeTimes>> = std::sync::Mutex::new(Vec::new());
/// Whether two inputs pay to share the gathers, by the probes so far
/// ([`pairs_pay`]): 0 no probe has finished, 1 no, 2 yes.
static AVX2_PAIRS: core::sync::atomic::AtomicU8 = core::sync::atomic::AtomicU8::new(0);
/// Whether four inputs pay to share the qword gathers, by the probes so far
/// ([`quads_pay`]): as [`AVX2_PAIRS`].
static AVX2_QUADS: core::sync::atomic::AtomicU8 = core::sync::atomic::AtomicU8::new(0);

/// The calls of [`avx2_lookup`] (counted from 0) that probe: the first,
/// then two later ones (a 48B token makes about 230 calls, a 3-layer slice's
/// about 18). One probe after an open once chose the chains where the
/// gathers were 12 % faster (experts 94 against 83 ms a 48B token, Intel
/// Xeon, docs/lab entry 74); later probes taken with it outvote a moment's
/// disturbance.
pub const AVX2_PROBE_CALLS: [u64; 3] = [0, 512, 8192];

/// Choose the AVX2 lookup form for the whole process (benchmarks, tests;
/// `WASTE_VQ_LOOKUP=blends|chains|gathers` does it for a run); no probe
/// runs while one is set.
pub fn set_avx2_lookup(l: Avx2Lookup) {
    AVX2_FIXED.store(1 + l as u8, core::sync::atomic::Ordering::Relaxed);
}

/// The form a code of [`AVX2_FIXED`] or [`AVX2_PROBED`] names.
fn decoded(code: u8) -> Option<Avx2Lookup> {
    Avx2Lookup::ALL.get(usize::from(code).wrapping_sub(1)).copied()
}

/// Each probe column's best time over all the probes (a disturbed probe
/// only raises times, so the least is the speed); infinite for none.
fn best_of(probes: &[ProbeTimes]) -> ProbeTimes {
    let mut best = [f64::INFINITY; 5];
    for p in probes {
        for (b, t) in best.iter_mut().zip(p) {
            *b = b.min(*t);
        }
    }
    best
}

/// The form fastest by every probe's times together: each form's best time
/// over all the probes, the least of those (`Chains` for no probe; the
/// pairs' and the quads' columns take no part).
pub fn fastest_of(probes: &[ProbeTimes]) -> Avx2Lookup {
    let best = best_of(probes);
    (0..3)
        .filter(|&i| best[i].is_finite())
        .min_by(|&a, &b| best[a].total_cmp(&best[b]))
        .map_or(Avx2Lookup::Chains, |i| Avx2Lookup::ALL[i])
}

/// The AVX2 lookup form in use: the one set, else `WASTE_VQ_LOOKUP`, else
/// the fastest on this CPU by probes of about a millisecond and a half
/// each, taken on the calls [`AVX2_PROBE_CALLS`] names and weighed together
/// ([`fastest_of`]). Every form gives the same bits, so the form may change
/// between calls: whoever builds a table takes the form once for its build
/// and its rows. On a CPU without AVX2 it names the form the probe would
/// not need: `Chains`.
pub fn avx2_lookup() -> Avx2Lookup {
    use core::sync::atomic::Ordering::Relaxed;
    if let Some(l) = decoded(AVX2_FIXED.load(Relaxed)) {
        return l;
    }
    let n = AVX2_CALLS.fetch_add(1, Relaxed);
    if n == 0 {
        let asked = std::env::var("WASTE_VQ_LOOKUP");
        if let Some(l) = Avx2Lookup::ALL.into_iter().find(|l| asked.as_deref() == Ok(l.name())) {
            set_avx2_lookup(l);
            return l;
        }
    }
    if let Some(l) = decoded(AVX2_PROBED.load(Relaxed)).filter(|_| !AVX2_PROBE_CALLS.contains(&n)) {
        return l;
    }
    // the scheduled probe, or a call that came before the first probe ended
    // (it probes too: both sets of times count)
    let Some(times) = probe_times() else {
        AVX2_PAIRS.store(1, Relaxed);
        AVX2_QUADS.store(1, Relaxed);
        AVX2_PROBED.store(1 + Avx2Lookup::Chains as u8, Relaxed);
        return Avx2Lookup::Chains;
    };
    let mut all = AVX2_PROBES.lock().unwrap_or_else(|e| e.into_inner());
    all.push(times);
    let l = fastest_of(&all);
    AVX2_PAIRS.store(1 + u8::from(pairs_pay(&all)), Relaxed);
    AVX2_QUADS.store(1 + u8::from(quads_pay(&all)), Relaxed);
    AVX2_PROBED.store(1 + l as u8, Relaxed);
    l
}

/// Whether two inputs through the same rows pay to share the gathers
/// ([`matvec_rows_pair`]) against each alone by the fastest form, by every
/// probe's times together: the pair's best time for two inputs under twice
/// the best single form's (on the Intel Xeon of docs/lab entry 75 about 1.05
/// against 2; where gathers are slow, AMD Zen 2/3, the chains may win
/// alone and the pair still pay). False for no probe or times that are not
/// finite.
pub fn pairs_pay(probes: &[ProbeTimes]) -> bool {
    let best = best_of(probes);
    let single = best[..3].iter().copied().fold(f64::INFINITY, f64::min);
    best[3].is_finite() && single.is_finite() && best[3] < 2.0 * single
}

/// Whether four inputs through the same rows pay to share the qword
/// gathers ([`matvec_rows_quad`]) against two pairs, by every probe's times
/// together: where pairs pay, the quad's best time for four inputs under
/// twice the pair's best for two (on the Intel Xeon of docs/lab entry 76
/// about 0.30 against 0.38 ms a 1024 × 2304 matrix). False where pairs do
/// not pay, for no probe, or times that are not finite.
pub fn quads_pay(probes: &[ProbeTimes]) -> bool {
    let best = best_of(probes);
    pairs_pay(probes) && best[4].is_finite() && best[4] < 2.0 * best[3]
}

/// Whether a caller with two inputs through the same rows at the AVX2
/// kernels' level should pair them ([`matvec_rows_pair`] over plain tables)
/// on this CPU: by the probes of [`avx2_lookup`] (taken on its schedule;
/// this call counts as one of its calls), or, where the form is fixed
/// (`WASTE_VQ_LOOKUP`, [`set_avx2_lookup`]), when it is the gathers.
pub fn avx2_pairs() -> bool {
    grouped(&AVX2_PAIRS)
}

/// Whether a caller with three or four inputs through the same rows at the
/// AVX2 kernels' level should run them together ([`matvec_rows_quad`]) on
/// this CPU: by the probes (as [`avx2_pairs`]), or, where the form is
/// fixed, when it is the gathers.
pub fn avx2_quads() -> bool {
    grouped(&AVX2_QUADS)
}

/// [`avx2_pairs`] and [`avx2_quads`]: with the form fixed, whether it is
/// the gathers; else the probes' verdict in `flag` (as [`AVX2_PAIRS`]).
fn grouped(flag: &core::sync::atomic::AtomicU8) -> bool {
    use core::sync::atomic::Ordering::Relaxed;
    let l = avx2_lookup();
    if decoded(AVX2_FIXED.load(Relaxed)).is_some() {
        return l == Avx2Lookup::Gathers;
    }
    flag.load(Relaxed) == 2
}

/// The times of every probe [`avx2_lookup`] took so far in this process
/// ([`ProbeTimes`]; reports: which form won by how much, whether pairs and
/// quads pay).
pub fn avx2_lookup_probes() -> Vec<ProbeTimes> {
    AVX2_PROBES.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// One probe's verdict alone ([`probe_times`]; `Chains` without AVX2).
pub fn probe_avx2_lookup() -> Avx2Lookup {
    probe_times().map_or(Avx2Lookup::Chains, |t| fastest_of(&[t]))
}

/// Time the AVX2 lookup forms on a synthetic table and indices the shape
/// of a thread's share of an expert matrix (512 rows, 96 positions, 3
/// stages: 72 KiB of codes, 144 KiB wide, a real table's place past L1),
/// alternated, 9 runs each (about 1.8 ms in all): each form's best run, in
/// [`Avx2Lookup::ALL`]'s order, then the pair kernel's for two inputs (two
/// plain tables) and the quad kernel's for four ([`ProbeTimes`]). `None`
/// where the CPU has no AVX2. Each form reads the
/// table in the form its build keeps (chains a telescoped one — a 128-row
/// probe that telescoped per call chose blends on the Intel Xeon, where
/// whole matrices ran 14 % faster by chains: docs/lab entries 70, 71 —
/// gathers a wide one).
pub fn probe_times() -> Option<ProbeTimes> {
    let lay = VqLayout { rows: 512, nvec: 96, stages: 3, block: 64, packed6: false };
    if !rows32(Level::Avx2, &lay) {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let mut r = waste_rng::SplitMix64::new(50);
        let idx: Vec<u8> = (0..lay.index_bytes()).map(|_| r.next_u64() as u8).collect();
        // random codes stand for a built table as well as any, in every form
        let q: Vec<u8> = (0..2 * lay.table_len() + 2).map(|_| (r.next_u64() % 255) as u8).collect();
        let d = vec![1.0f32; blocks(&lay)];
        let (mut y, mut y2) = (vec![0f32; lay.rows], vec![0f32; lay.rows]);
        let (mut y3, mut y4) = (vec![0f32; lay.rows], vec![0f32; lay.rows]);
        let mut best = [f64::INFINITY; 5];
        // a second plain table, for the pair
        let q2: Vec<u8> = (0..lay.table_len()).map(|_| (r.next_u64() % 255) as u8).collect();
        for _ in 0..9 {
            let t = std::time::Instant::now();
            let (q1, qs) = (&q[..lay.table_len()], &q2[..]);
            // SAFETY: rows32 checked AVX2 and the layout (3 byte stages: the gathers serve it); the sizes are the layout's.
            unsafe { crate::x86_64::gathers::rows32_pair(&lay, &idx, [&d, &d], [q1, qs], 0, [&mut y, &mut y2]) };
            best[3] = best[3].min(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            let (ds, qs4) = ([&d[..], &d, &d, &d], [q1, qs, q1, qs]);
            // SAFETY: as above (the quads serve what the pairs do).
            unsafe { crate::x86_64::gathers::rows32_quad(&lay, &idx, ds, qs4, 0, [&mut y, &mut y2, &mut y3, &mut y4]) };
            best[4] = best[4].min(t.elapsed().as_secs_f64());
            for (l, b) in Avx2Lookup::ALL.into_iter().zip(best.iter_mut()) {
                let t = std::time::Instant::now();
                let q8 = bytemuck::cast_slice(&q[..lay.table_len()]);
                // SAFETY: rows32 checked AVX2 and the layout; the sizes are the layout's.
                unsafe {
                    match l {
                        Avx2Lookup::Blends => crate::x86_64::avx2::vq_fast_rows32(&lay, &idx, &d, q8, 0, &mut y),
                        Avx2Lookup::Chains => {
                            crate::x86_64::avx2::vq_fast_rows32_telescoped(&lay, &idx, &d, q8, 0, &mut y)
                        }
                        Avx2Lookup::Gathers => crate::x86_64::gathers::rows32(&lay, &idx, &d, &q, 0, &mut y),
                    }
                };
                *b = b.min(t.elapsed().as_secs_f64());
            }
        }
        return Some(best);
    }
    #[allow(unreachable_code)]
    None
}

/// The kernel that sums this layout's fast rows at `level` on this CPU, as
/// reports name it: `avx512-int8-permutes`, `avx2-int8-pshufb-chains` (or
/// `avx2-int8-pshufb-blends`, `avx2-int16-gathers`: [`avx2_lookup`]),
/// `neon-int8-tbl` or `int8-loads`.
pub fn rows_kernel_name(level: Level, lay: &VqLayout) -> &'static str {
    if rows64(level, lay) {
        "avx512-int8-permutes"
    } else if rows16(level, lay) {
        "neon-int8-tbl"
    } else if rows32(level, lay) {
        match table_form(level, lay) {
            TableForm::Plain => "avx2-int8-pshufb-blends",
            TableForm::Telescoped => "avx2-int8-pshufb-chains",
            TableForm::Wide => "avx2-int16-gathers",
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
        // built in two halves, as the pool builds it, in the form this
        // level and lookup keep
        let nb = blocks(&lay);
        let form = table_form(level, &lay);
        assert!(qtable_floats(&lay, form) <= buf.len());
        for (b0, b1) in [(0, nb / 2), (nb / 2, nb)] {
            let (d, q) = parts_mut(&lay, form, &mut buf, b0, b1);
            build(level, &books, &lay, &x, 127.0, (b0, b1), d, q, form);
        }
        let want = reference(&lay, &books, &x, &idx, &scales, 127.0);
        // a second input's table, for the rows of two inputs at once
        let x2: Vec<f32> = (0..lay.nvec * 8).map(|_| r.unif() * 6.0 - 3.0).collect();
        let mut buf2 = vec![0f32; lay.table_len()];
        let (d, q) = parts_mut(&lay, form, &mut buf2, 0, nb);
        build(level, &books, &lay, &x2, 127.0, (0, nb), d, q, form);
        let want2 = reference(&lay, &books, &x2, &idx, &scales, 127.0);
        // two more inputs, for the rows of four at once
        let more: Vec<(Vec<f32>, Vec<f32>)> = (0..2)
            .map(|j| {
                let xj: Vec<f32> = (0..lay.nvec * 8).map(|_| (r.unif() - 0.5) * (2.0 + j as f32)).collect();
                let mut bj = vec![0f32; lay.table_len()];
                let (d, q) = parts_mut(&lay, form, &mut bj, 0, nb);
                build(level, &books, &lay, &xj, 127.0, (0, nb), d, q, form);
                (reference(&lay, &books, &xj, &idx, &scales, 127.0), bj)
            })
            .collect();
        // every row range the kernels may be given
        for (a, b) in [(0, lay.rows), (1, lay.rows.min(13)), (lay.rows / 2, lay.rows), (64.min(lay.rows), lay.rows)] {
            let mut y = vec![0f32; b - a];
            matvec_rows(level, &lay, &idx, &scales, &buf, a, &mut y, form);
            for (i, (g, w)) in y.iter().zip(&want[a..b]).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{lay:?} row {} level {level:?}", a + i);
            }
            let (mut p1, mut p2) = (vec![0f32; b - a], vec![0f32; b - a]);
            matvec_rows_pair(level, &lay, &idx, &scales, [&buf, &buf2], a, [&mut p1, &mut p2], form);
            for (i, ((g1, g2), (w1, w2))) in p1.iter().zip(&p2).zip(want[a..b].iter().zip(&want2[a..b])).enumerate() {
                assert_eq!(g1.to_bits(), w1.to_bits(), "pair, first: {lay:?} row {} level {level:?}", a + i);
                assert_eq!(g2.to_bits(), w2.to_bits(), "pair, second: {lay:?} row {} level {level:?}", a + i);
            }
            // four inputs, and three (the third's table twice)
            let wants: [&[f32]; 4] = [&want, &want2, &more[0].0, &more[1].0];
            for tables in [[&buf, &buf2, &more[0].1, &more[1].1], [&buf, &buf2, &more[0].1, &more[0].1]] {
                let mut ys = [(); 4].map(|_| vec![0f32; b - a]);
                let [y0, y1, y2, y3] = &mut ys;
                matvec_rows_quad(level, &lay, &idx, &scales, tables.map(|t| &t[..]), a, [y0, y1, y2, y3], form);
                for (j, y) in ys.iter().enumerate() {
                    let w = if core::ptr::eq(tables[j], tables[2]) { wants[2] } else { wants[j] };
                    for (i, (g, w)) in y.iter().zip(&w[a..b]).enumerate() {
                        assert_eq!(g.to_bits(), w.to_bits(), "quad, input {j}: {lay:?} row {} level {level:?}", a + i);
                    }
                }
            }
        }
    }

    /// The probes weigh together: each form by its best time over all of
    /// them, so a probe whose gathers a moment slowed does not outvote one
    /// that timed them undisturbed; times that are not finite never win;
    /// no probe names the chains (the form without AVX2's probe).
    #[test]
    fn probes_weigh_together() {
        use Avx2Lookup::{Blends, Chains, Gathers};
        assert_eq!(fastest_of(&[]), Chains);
        assert_eq!(fastest_of(&[[3.0, 2.0, 1.0, 9.0, 9.0]]), Gathers);
        assert_eq!(fastest_of(&[[3.0, 2.0, 5.0, 9.0, 9.0]]), Chains);
        assert_eq!(fastest_of(&[[3.0, 2.0, 5.0, 9.0, 9.0], [3.1, 2.1, 1.0, 9.0, 9.0]]), Gathers);
        assert_eq!(fastest_of(&[[3.1, 2.1, 1.0, 9.0, 9.0], [3.0, 2.0, 5.0, 9.0, 9.0]]), Gathers, "in either order");
        assert_eq!(fastest_of(&[[1.5, 9.0, 9.0, 0.1, 9.0], [9.0, 9.0, 1.6, 0.1, 9.0]]), Blends, "each form's best");
        assert_eq!(fastest_of(&[[f64::NAN, f64::INFINITY, 2.0, 0.5, 9.0]]), Gathers);
        assert_eq!(fastest_of(&[[f64::NAN; 5]]), Chains);
        // pairs pay when two inputs' pair beats twice the best form alone
        // (the best of each column over the probes), never without times
        assert!(!pairs_pay(&[]));
        assert!(pairs_pay(&[[3.0, 2.0, 1.0, 1.9, 9.0]]));
        assert!(!pairs_pay(&[[3.0, 2.0, 1.0, 2.1, 9.0]]));
        assert!(pairs_pay(&[[3.0, 2.0, 1.0, 2.1, 9.0], [3.0, 2.0, 1.0, 1.5, 9.0]]), "the pair's best");
        assert!(!pairs_pay(&[[3.0, 0.9, 1.0, 2.1, 9.0], [3.0, 2.0, 1.0, 1.9, 9.0]]), "against the chains' best");
        assert!(pairs_pay(&[[3.0, 1.5, 2.4, 2.9, 9.0]]), "the chains win alone, the pair still pays");
        assert!(!pairs_pay(&[[1.0, 1.0, 1.0, f64::NAN, 9.0]]));
        // quads pay when four inputs' quad beats two pairs, and pairs pay
        assert!(quads_pay(&[[3.0, 2.0, 1.0, 1.5, 2.9]]));
        assert!(!quads_pay(&[[3.0, 2.0, 1.0, 1.5, 3.1]]));
        assert!(quads_pay(&[[3.0, 2.0, 1.0, 1.5, 3.1], [3.0, 2.0, 1.0, 1.6, 2.5]]), "the quad's best");
        assert!(!quads_pay(&[[3.0, 2.0, 1.0, 2.5, 1.0]]), "not where pairs do not pay");
        assert!(!quads_pay(&[[3.0, 2.0, 1.0, 1.5, f64::NAN]]));
        // a real probe times every form
        if let Some(t) = probe_times() {
            assert!(t.iter().all(|x| x.is_finite() && *x > 0.0), "{t:?}");
        }
    }

    /// Every level and kernel (the AVX-512 one in both plane lookups, the
    /// AVX2 one in every table lookup, from row 0 and from row 64) gives
    /// the definition's bits — the gathers over several of their tiles of
    /// positions and a short last one (37, 40 positions); the NEON one (under
    /// qemu) in pairs of 16-row groups and a last group alone (80 rows in
    /// index blocks of 16; 96 from row 48).
    #[test]
    fn rows_are_the_definition_at_every_level() {
        let planes = crate::vq::PlaneLookup::ALL;
        for (i, form) in Avx2Lookup::ALL.into_iter().enumerate() {
            crate::vq::set_plane_lookup(planes[i % planes.len()]);
            set_avx2_lookup(form);
            for level in Level::available() {
                for (rows, stages, packed6, nvec, block) in [
                    (70, 3, false, 37, 64),
                    (200, 3, false, 9, 128),
                    (128, 2, false, 6, 64),
                    (96, 2, false, 40, 32),
                    (64, 1, false, 5, 64),
                    (70, 2, false, 9, 8),
                    (70, 1, false, 5, 0),
                    (70, 4, true, 11, 64),
                    (70, 3, false, 1, 16),
                    (80, 3, false, 9, 16),
                ] {
                    let lay = VqLayout { rows, nvec, stages, block, packed6 };
                    case(lay, 7 + nvec as u64, level);
                }
            }
        }
    }

    /// The AVX2 and AVX-512 codes (`x86_64::avx2::quantize_codes`,
    /// `x86_64::avx512::quantize_codes`) are the scalar steps' bytes and
    /// scale: every length (tails of 1..63 values), ties,
    /// ±amax, zero blocks and a NaN (on a CPU with AVX2, as the other
    /// levels' tests here run on the levels the CPU has).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_codes_are_the_scalar_steps() {
        if !Level::available().contains(&Level::Avx2) {
            return;
        }
        let mut r = crate::SplitMix64::new(7);
        for len in (0..140).chain([768, 1024, 3072, 3071, 3120]) {
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
                    if Level::Avx512.supported() {
                        let mut c = vec![0x55u8 as i8; len];
                        // SAFETY: AVX-512 F checked; equal lengths.
                        let dc = unsafe { crate::x86_64::avx512::quantize_codes(&t, qmax, &mut c) };
                        assert_eq!(a, c, "AVX-512 len {len} case {case} qmax {qmax}");
                        assert_eq!(da.to_bits(), dc.to_bits(), "AVX-512 len {len} case {case}");
                    }
                    // the wide form: the same codes as i16, by AVX2 and by the scalar steps
                    let want: Vec<u8> = a.iter().flat_map(|&c| i16::from(c).to_le_bytes()).collect();
                    for wide in [true, false] {
                        let mut w = vec![0xAAu8; 2 * len];
                        let dw = if wide {
                            // SAFETY: AVX2 checked above; twice the length.
                            unsafe { crate::x86_64::avx2::quantize_codes_wide(&t, qmax, &mut w) }
                        } else {
                            quantize_body_into(&t, qmax, &mut w)
                        };
                        assert_eq!(w, want, "wide {wide} len {len} case {case} qmax {qmax}");
                        assert_eq!(dw.to_bits(), da.to_bits(), "wide {wide} len {len} case {case}");
                    }
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
        let (d, q) = parts_mut(&lay, TableForm::Plain, &mut buf, 0, 1);
        build(Level::Scalar, &books, &lay, &x, 127.0, (0, 1), d, q, TableForm::Plain);
        let mut y = vec![0f32; 8];
        let scales = vec![0x3c; 16];
        matvec_rows(Level::Scalar, &lay, &vec![1u8; lay.index_bytes()], &scales, &buf, 0, &mut y, TableForm::Plain);
        assert!(y.iter().all(|v| v.is_nan()));
        let short = book(200, 9);
        assert!(applies(books.iter().copied(), &lay));
        assert!(!applies([&short, books[1], books[2]], &lay));
    }
}
