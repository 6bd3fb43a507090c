//! VQ row sums by plain table loads, and the choice between them and the
//! AVX2 gathers.
//!
//! [`rows`] is the portable form of the VQ row sum: eight rows interleaved
//! (eight independent sums hide the add latency), each row's stage indices
//! taken from its index bytes and its table entries loaded one at a time, the
//! vector positions walked in tiles whose table slices stay in L1. Every row
//! adds its entries in the canonical order (vector position, then stage), so
//! the sums are bit-identical to the lane-by-lane definition and to every
//! SIMD kernel. It is the `scalar` level's VQ kernel, and the AVX2 level's
//! where 8-lane gathers are slower than scalar loads (AMD Zen 2/3 execute
//! `vgatherdps` as many micro-ops; Intel cores since Haswell faster) —
//! decided per machine by measuring both on the process's own first calls
//! ([`next_form`]), not by vendor names.

use crate::vq::VqLayout;

/// Rows summed together: eight independent add chains.
const GROUP: usize = 8;

/// Vector positions per tile: 8 × 3 stages × 256 entries × 4 bytes = 24 KiB
/// of table, inside a 32 KiB L1 (the AVX2 gather kernel's tile too).
const TILE: usize = 8;

/// Unscaled VQ row sums `y[i] = Σ_v Σ_s T[v][s][idx(r0 + i, v, s)]` for rows
/// `r0..r0 + y.len()`, any layout (blocked or row-major, byte or 6-bit
/// indices, any row range). Bit-identical to the canonical definition.
///
/// # Panics
/// When the indices or the table are shorter than the layout needs, or the
/// rows are out of range.
pub fn rows(lay: &VqLayout, idx: &[u8], table: &[f32], r0: usize, y: &mut [f32]) {
    if y.is_empty() {
        // no row asked for: the byte planes may have served them all, with no table given
        return;
    }
    assert!(idx.len() >= lay.index_bytes() && table.len() >= lay.table_len());
    assert!(r0.checked_add(y.len()).is_some_and(|e| e <= lay.rows));
    match (lay.packed6, lay.stages) {
        (false, 1) => rows_n::<1, 256, false>(lay, idx, table, r0, y),
        (false, 2) => rows_n::<2, 256, false>(lay, idx, table, r0, y),
        (false, 3) => rows_n::<3, 256, false>(lay, idx, table, r0, y),
        (true, 4) => rows_n::<4, 64, true>(lay, idx, table, r0, y),
        _ => rows_any(lay, idx, table, r0, y),
    }
}

/// The stage indices of one row's stage group `g` (`bpv` bytes): byte `s`,
/// or for 6-bit packing the field `6s..6s + 6` of the 24 bits.
#[inline(always)]
pub(crate) fn field<const ST: usize, const P6: bool>(g: &[u8], s: usize) -> usize {
    if P6 {
        let w = g[0] as usize | (g[1] as usize) << 8 | (g[2] as usize) << 16;
        (w >> (6 * s)) & 63
    } else {
        g[s] as usize
    }
}

/// [`rows`] for `ST` stages of `TE` entries (`P6`: 6-bit packed indices).
fn rows_n<const ST: usize, const TE: usize, const P6: bool>(
    lay: &VqLayout,
    idx: &[u8],
    table: &[f32],
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
            // eight rows whose indices lie side by side at every position:
            // one index block holds them all
            let together = lay.block > 0 && r % lay.block + GROUP <= lay.block && r + GROUP <= end;
            let n = if together { GROUP } else { 1 };
            let yr = &mut y[r - r0..r - r0 + n];
            let mut acc = [0f32; GROUP];
            if v0 > 0 {
                acc[..n].copy_from_slice(yr);
            }
            let mut o = lay.offset(r, v0);
            for v in v0..v1 {
                let tv = &table[v * ST * TE..(v + 1) * ST * TE];
                let t: [&[f32; TE]; ST] = core::array::from_fn(|s| {
                    <&[f32; TE]>::try_from(&tv[s * TE..(s + 1) * TE]).expect("a stage's table is TE entries")
                });
                if together {
                    let g = &idx[o..o + GROUP * bpv];
                    for (i, a) in acc.iter_mut().enumerate() {
                        let gi = &g[i * bpv..(i + 1) * bpv];
                        for s in 0..ST {
                            *a += t[s][field::<ST, P6>(gi, s)];
                        }
                    }
                } else {
                    let gi = &idx[o..o + bpv];
                    for s in 0..ST {
                        acc[0] += t[s][field::<ST, P6>(gi, s)];
                    }
                }
                o += vstride;
            }
            yr.copy_from_slice(&acc[..n]);
            r += n;
        }
        v0 = v1;
    }
}

/// [`rows`] for a layout no specialised form takes (other stage counts):
/// one row at a time, the stages read by [`VqLayout::indices_at`].
fn rows_any(lay: &VqLayout, idx: &[u8], table: &[f32], r0: usize, y: &mut [f32]) {
    let te = lay.table_entries();
    let mut ix = [0usize; 8];
    for (i, yo) in y.iter_mut().enumerate() {
        let mut acc = 0f32;
        let mut o = lay.offset(r0 + i, 0);
        for v in 0..lay.nvec {
            lay.indices_at(idx, o, &mut ix);
            for s in 0..lay.stages {
                acc += table[(v * lay.stages + s) * te + ix[s]];
            }
            o += lay.vstride();
        }
        *yo = acc;
    }
}

/// How the AVX2 level sums the rows of one VQ index family: its vector
/// kernel or [`rows`]. Both give the same bits; which is faster depends on
/// the core (gather and shuffle units), so it is measured ([`next_form`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowsKernel {
    /// The family's AVX2 vector kernel: for byte indices (VQ3R, VQ2R) one
    /// 8-lane `vgatherdps` per stage and 8 rows (`x86_64::avx2::vq_rows8`);
    /// for VQ4P's 6-bit fields 8 one-register permutes and a blend tree
    /// per stage (`x86_64::avx2::vq4p_rows8`).
    Vector,
    /// Scalar loads, 8 rows interleaved ([`rows`]).
    Loads,
}

impl RowsKernel {
    /// Both forms, for tests and benchmarks that run each.
    pub const ALL: [RowsKernel; 2] = [RowsKernel::Vector, RowsKernel::Loads];

    /// The name `WASTE_VQ_ROWS` takes.
    pub fn name(self) -> &'static str {
        match self {
            RowsKernel::Vector => "vector",
            RowsKernel::Loads => "loads",
        }
    }

    /// Parses a [`RowsKernel::name`].
    pub fn parse(s: &str) -> Option<RowsKernel> {
        RowsKernel::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// The VQ index families the AVX2 level chooses a row kernel for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexFamily {
    /// One byte per stage (VQ3R, VQ2R): gathers or loads.
    Bytes,
    /// 6-bit fields packed 4 to 3 bytes (VQ4P): permutes or loads.
    Packed6,
}

impl IndexFamily {
    /// The family of a layout.
    pub fn of(lay: &VqLayout) -> IndexFamily {
        if lay.packed6 {
            IndexFamily::Packed6
        } else {
            IndexFamily::Bytes
        }
    }

    /// The family's AVX2 vector kernel, as reports name it.
    pub fn vector_name(self) -> &'static str {
        match self {
            IndexFamily::Bytes => "gather",
            IndexFamily::Packed6 => "permute",
        }
    }
}

/// Per family: 0 not fixed, 1 + the [`RowsKernel`] fixed by
/// `WASTE_VQ_ROWS` or [`set_rows_kernel`] otherwise.
static FIXED: [AtomicU8; 2] = [AtomicU8::new(0), AtomicU8::new(0)];

/// Per family: the form the measurements favour now (1 + [`RowsKernel`]).
static CURRENT: [AtomicU8; 2] = [AtomicU8::new(1), AtomicU8::new(1)];

/// Per family: calls so far (every [`EXPLORE`]-th runs the other form).
static CALLS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// Per family and form: the calls that ran it.
static USED: [[AtomicU64; 2]; 2] = [[AtomicU64::new(0), AtomicU64::new(0)], [AtomicU64::new(0), AtomicU64::new(0)]];

/// Per family: whether both forms have their first samples (read without
/// the lock by every call; set under it by [`record`]).
static STARTED: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];

/// Per family and form: the last [`WINDOW`] seconds per lookup.
static SAMPLES: [Mutex<Windows>; 2] = [Mutex::new(Windows::new()), Mutex::new(Windows::new())];

/// Samples per form a choice looks at (their median).
pub const WINDOW: usize = 32;

/// One phase of [`PHASE`] calls in this many runs the form not in use, so
/// its figure stays current (at most 1/16 of the difference is spent on it).
pub const EXPLORE: u64 = 16;

/// Consecutive calls of one form: the compute threads run experts side by
/// side, and a form measured while the other thread runs the other form
/// is not what either gives when both run it (one exploring call beside
/// the gathers measured the loads slower on the Intel Xeon where decode
/// runs faster with them on both threads).
pub const PHASE: u64 = 8;

/// Samples each form needs before the medians decide; until then the
/// calls alternate the forms in phases of 8.
const START: usize = 8;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::Mutex;

/// Each form's last [`WINDOW`] samples (a ring).
struct Windows {
    ring: [[f64; WINDOW]; 2],
    len: [usize; 2],
    next: [usize; 2],
}

impl Windows {
    const fn new() -> Windows {
        Windows { ring: [[0.0; WINDOW]; 2], len: [0; 2], next: [0; 2] }
    }
    fn push(&mut self, k: RowsKernel, v: f64) {
        let i = k as usize;
        self.ring[i][self.next[i]] = v;
        self.next[i] = (self.next[i] + 1) % WINDOW;
        self.len[i] = (self.len[i] + 1).min(WINDOW);
    }
    fn median(&self, k: RowsKernel) -> f64 {
        let i = k as usize;
        // a copy on the stack: this runs after every timed call
        let mut v = self.ring[i];
        let v = &mut v[..self.len[i]];
        v.sort_unstable_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::INFINITY)
    }
    fn started(&self) -> bool {
        self.len.iter().all(|&l| l >= START)
    }
}

fn form(v: u8) -> Option<RowsKernel> {
    match v {
        1 => Some(RowsKernel::Vector),
        2 => Some(RowsKernel::Loads),
        _ => None,
    }
}

fn other(k: RowsKernel) -> RowsKernel {
    match k {
        RowsKernel::Vector => RowsKernel::Loads,
        RowsKernel::Loads => RowsKernel::Vector,
    }
}

/// The form fixed for a family by `WASTE_VQ_ROWS` (`vector` or `loads`,
/// both families) or [`set_rows_kernel`]; `None` when it is measured.
pub fn fixed_form(f: IndexFamily) -> Option<RowsKernel> {
    if let Some(k) = form(FIXED[f as usize].load(Relaxed)) {
        return Some(k);
    }
    let env = std::env::var("WASTE_VQ_ROWS").ok().as_deref().and_then(RowsKernel::parse)?;
    // a concurrent set_rows_kernel wins
    let _ = FIXED[f as usize].compare_exchange(0, 1 + env as u8, Relaxed, Relaxed);
    form(FIXED[f as usize].load(Relaxed))
}

/// The form a family's AVX2 row sums use now: the fixed one, else the one
/// the measurements favour ([`next_form`]).
pub fn rows_kernel(f: IndexFamily) -> RowsKernel {
    fixed_form(f).or_else(|| form(CURRENT[f as usize].load(Relaxed))).unwrap_or(RowsKernel::Vector)
}

/// The form an AVX2 VQ row sum of family `f` uses for this call, and
/// whether the caller times it ([`record`]). Unless a form is fixed
/// ([`fixed_form`]), every call is timed and the form follows the
/// measurements on the process's own work (its matrices, the cache
/// arena's memory, the threads side by side, whatever else runs): the
/// calls alternate the forms in phases of [`PHASE`] calls until each has 8
/// samples; then the form with the lower median time per lookup over its
/// last [`WINDOW`] calls runs, and one phase in [`EXPLORE`] runs the other
/// to keep its figure current. Both forms give the same bits, so no result
/// depends on which ran.
///
/// Choices made once were tried first and chose wrong on an Intel Xeon
/// where decode runs 10–16 % faster with the loads: a probe at the open (on
/// its own matrices, in L1/L2 or flushed to memory) and a trial of the
/// first 96 calls (while the cache's prefault zeroed pages on the other
/// vCPU) both chose the gathers (docs/lab/2026-12-05-54-vq-rows-without-gathers-the-scalar-level-s-fma.md, "VQ rows without
/// gathers").
pub fn next_form(f: IndexFamily) -> (RowsKernel, bool) {
    let (k, timed) = choose(f);
    USED[f as usize][k as usize].fetch_add(1, Relaxed);
    (k, timed)
}

/// The form that ran most of this process's AVX2 row sums of family `f`
/// (the fixed one where a form is fixed; the one in use before any ran) —
/// what reports name: the form in use at a given moment follows the work
/// of that moment (a benchmark's in-cache probe of one thread favours the
/// gathers where decode favours the loads).
pub fn most_used(f: IndexFamily) -> RowsKernel {
    if let Some(k) = fixed_form(f) {
        return k;
    }
    let [v, l] = [&USED[f as usize][0], &USED[f as usize][1]].map(|a| a.load(Relaxed));
    match v.cmp(&l) {
        std::cmp::Ordering::Greater => RowsKernel::Vector,
        std::cmp::Ordering::Less => RowsKernel::Loads,
        std::cmp::Ordering::Equal => rows_kernel(f),
    }
}

fn choose(f: IndexFamily) -> (RowsKernel, bool) {
    if let Some(k) = fixed_form(f) {
        return (k, false);
    }
    let n = CALLS[f as usize].fetch_add(1, Relaxed);
    let phase = n / PHASE;
    if !STARTED[f as usize].load(Relaxed) {
        return (if phase.is_multiple_of(2) { RowsKernel::Vector } else { RowsKernel::Loads }, true);
    }
    let cur = rows_kernel(f);
    (if phase % EXPLORE == EXPLORE - 1 { other(cur) } else { cur }, true)
}

/// Records a timed call of [`next_form`]: `seconds` for `lookups` table
/// lookups with form `k`; the family's current form becomes the one with
/// the lower median.
pub fn record(f: IndexFamily, k: RowsKernel, seconds: f64, lookups: usize) {
    if lookups == 0 || !seconds.is_finite() {
        return;
    }
    let mut w = SAMPLES[f as usize].lock().unwrap_or_else(|e| e.into_inner());
    w.push(k, seconds / lookups as f64);
    if w.started() {
        STARTED[f as usize].store(true, Relaxed);
        let best = if w.median(RowsKernel::Vector) <= w.median(RowsKernel::Loads) {
            RowsKernel::Vector
        } else {
            RowsKernel::Loads
        };
        CURRENT[f as usize].store(1 + best as u8, Relaxed);
    }
}

/// Fixes the row form of both families for the whole process — for
/// benchmarks and tests comparing them; results do not change (the same
/// bits).
pub fn set_rows_kernel(k: RowsKernel) {
    for a in &FIXED {
        a.store(1 + k as u8, Relaxed);
    }
}

/// Forgets the fixed form and every measurement of both families (tests).
pub fn reset_rows_kernel() {
    for f in 0..2 {
        FIXED[f].store(0, Relaxed);
        CURRENT[f].store(1, Relaxed);
        CALLS[f].store(0, Relaxed);
        STARTED[f].store(false, Relaxed);
        USED[f].iter().for_each(|a| a.store(0, Relaxed));
        *SAMPLES[f].lock().unwrap_or_else(|e| e.into_inner()) = Windows::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, row by row: `Σ_v Σ_s T[v][s][idx]` in that order.
    fn reference(lay: &VqLayout, idx: &[u8], table: &[f32], r0: usize, n: usize) -> Vec<f32> {
        let te = lay.table_entries();
        let mut ix = [0usize; 8];
        (r0..r0 + n)
            .map(|r| {
                let mut acc = 0f32;
                for v in 0..lay.nvec {
                    lay.indices(idx, r, v, &mut ix);
                    for s in 0..lay.stages {
                        acc += table[(v * lay.stages + s) * te + ix[s]];
                    }
                }
                acc
            })
            .collect()
    }

    /// Every specialised form and the general one, blocked and row-major,
    /// row ranges that start and end inside a group: the definition's bits.
    #[test]
    fn loads_equal_the_definition() {
        let mut rng = crate::SplitMix64::new(3);
        for (stages, packed6) in [(1, false), (2, false), (3, false), (4, true), (4, false), (5, false)] {
            for block in [0, 8, 16, 64] {
                let lay = VqLayout { rows: 77, nvec: 19, stages, block, packed6 };
                let idx: Vec<u8> = (0..lay.index_bytes()).map(|_| rng.next_u64() as u8).collect();
                let table: Vec<f32> = (0..lay.table_len()).map(|_| rng.unif() - 0.5).collect();
                for (r0, n) in [(0, 77), (3, 61), (16, 8), (70, 7)] {
                    let mut y = vec![f32::NAN; n];
                    rows(&lay, &idx, &table, r0, &mut y);
                    let want = reference(&lay, &idx, &table, r0, n);
                    assert_eq!(
                        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{lay:?} rows {r0}+{n}"
                    );
                }
            }
        }
    }

    #[test]
    fn names_parse_back() {
        for k in RowsKernel::ALL {
            assert_eq!(RowsKernel::parse(k.name()), Some(k));
        }
        assert_eq!(RowsKernel::parse("gather"), None);
    }

    /// The measured choice: phases of both forms at the start, then the
    /// faster one with one phase in EXPLORE of the other; when the other
    /// becomes faster (conditions change), the choice follows. (The only
    /// test that touches the process-wide choice in this binary.)
    #[test]
    fn the_measured_form_follows_the_faster() {
        if std::env::var_os("WASTE_VQ_ROWS").is_some() {
            return;
        }
        reset_rows_kernel();
        let f = IndexFamily::Bytes;
        let run = |calls: usize, faster: RowsKernel| {
            let mut seen = [0usize; 2];
            for _ in 0..calls {
                let (k, timed) = next_form(f);
                assert!(timed);
                seen[k as usize] += 1;
                // the faster form takes 1 s per 1000 lookups, the other 2 s
                record(f, k, if k == faster { 1.0 } else { 2.0 }, 1000);
            }
            seen
        };
        // the start: both forms alternate until each has its samples
        let seen = run(2 * START, RowsKernel::Loads);
        assert_eq!(seen, [START, START]);
        assert_eq!(rows_kernel(f), RowsKernel::Loads);
        // then mostly the faster, the other for one phase in EXPLORE
        let seen = run((EXPLORE * PHASE) as usize * 4, RowsKernel::Loads);
        assert_eq!(seen[RowsKernel::Vector as usize], 4 * PHASE as usize, "{seen:?}");
        assert_eq!(most_used(f), RowsKernel::Loads);
        // the vector form becomes the faster: within a window of its samples
        // and a window of the loads', the choice moves over and stays
        run((EXPLORE * PHASE) as usize * WINDOW.div_ceil(PHASE as usize), RowsKernel::Vector);
        assert_eq!(rows_kernel(f), RowsKernel::Vector);
        let seen = run((EXPLORE * PHASE) as usize * 4, RowsKernel::Vector);
        assert_eq!(seen[RowsKernel::Loads as usize], 4 * PHASE as usize, "{seen:?}");
        // the other family was not touched; a fixed form is never timed
        assert_eq!(CALLS[IndexFamily::Packed6 as usize].load(Relaxed), 0);
        set_rows_kernel(RowsKernel::Loads);
        assert_eq!(next_form(f), (RowsKernel::Loads, false));
        reset_rows_kernel();
    }
}
