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
//! decided per machine by [`rows_kernel`]'s probe, not by vendor names.

use crate::level::Level;
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
fn field<const ST: usize, const P6: bool>(g: &[u8], s: usize) -> usize {
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
/// the core (gather and shuffle units), so it is measured ([`probe`]).
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

/// Per family: 0 not yet chosen, 1 + the [`RowsKernel`] in use otherwise.
static ROWS_KERNEL: [core::sync::atomic::AtomicU8; 2] =
    [core::sync::atomic::AtomicU8::new(0), core::sync::atomic::AtomicU8::new(0)];

/// The AVX2 level's VQ row kernel for a family, chosen once per process:
/// `WASTE_VQ_ROWS=vector|loads` if set (both families), else [`probe`]'s
/// measurement on this CPU (about a millisecond, at the first call —
/// `Model::open` makes it), unless [`set_rows_kernel`] chose first. Without
/// AVX2 it is [`RowsKernel::Loads`], the only form there.
pub fn rows_kernel(f: IndexFamily) -> RowsKernel {
    use core::sync::atomic::Ordering::Relaxed;
    match ROWS_KERNEL[f as usize].load(Relaxed) {
        1 => RowsKernel::Vector,
        2 => RowsKernel::Loads,
        _ => {
            let k = std::env::var("WASTE_VQ_ROWS")
                .ok()
                .as_deref()
                .and_then(RowsKernel::parse)
                .unwrap_or_else(|| probe(f).choice);
            // a concurrent set_rows_kernel wins over detection
            let _ = ROWS_KERNEL[f as usize].compare_exchange(0, 1 + k as u8, Relaxed, Relaxed);
            rows_kernel(f)
        }
    }
}

/// Chooses the row kernel of both families for the whole process — for
/// benchmarks and tests comparing the forms; results do not change (the
/// same bits).
pub fn set_rows_kernel(k: RowsKernel) {
    for a in &ROWS_KERNEL {
        a.store(1 + k as u8, core::sync::atomic::Ordering::Relaxed);
    }
}

/// What [`probe`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProbeResult {
    /// The faster form ([`RowsKernel::Loads`] where AVX2 is missing).
    pub choice: RowsKernel,
    /// Best time of the vector kernel, seconds (`None` without AVX2).
    pub vector_seconds: Option<f64>,
    /// Best time of the loads, seconds.
    pub loads_seconds: f64,
}

/// Times both row kernels of a family on an expert-shaped matrix (512 rows
/// × 512 columns in 64-row index blocks: 98 K lookups a run for VQ3R, 131 K
/// for VQ4P), the table from L1/L2, alternating them 9 times, and picks
/// the lower best time. About 0.5–2 ms.
pub fn probe(f: IndexFamily) -> ProbeResult {
    let (stages, packed6) = match f {
        IndexFamily::Bytes => (3, false),
        IndexFamily::Packed6 => (4, true),
    };
    let lay = VqLayout { rows: 512, nvec: 64, stages, block: 64, packed6 };
    let mut rng = crate::SplitMix64::new(0x005e_ed0f_9a7e);
    let idx: Vec<u8> = (0..lay.index_bytes()).map(|_| rng.next_u64() as u8).collect();
    let table: Vec<f32> = (0..lay.table_len()).map(|i| (i % 97) as f32 * 0.01).collect();
    let mut y = vec![0f32; lay.rows];
    let timed = |f: &mut dyn FnMut(&mut [f32]), y: &mut [f32], best: &mut f64| {
        let t0 = std::time::Instant::now();
        f(y);
        *best = best.min(t0.elapsed().as_secs_f64());
    };
    let mut loads = |y: &mut [f32]| rows(&lay, &idx, &table, 0, y);
    let mut vector = vector_rows(&lay, &idx, &table);
    let (mut tl, mut tv) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..9 {
        timed(&mut loads, &mut y, &mut tl);
        if let Some(g) = vector.as_mut() {
            timed(g, &mut y, &mut tv);
        }
    }
    let vector_seconds = vector.is_some().then_some(tv);
    let choice = match vector_seconds {
        Some(v) if v < tl => RowsKernel::Vector,
        _ => RowsKernel::Loads,
    };
    ProbeResult { choice, vector_seconds, loads_seconds: tl }
}

/// The family's AVX2 vector kernel as a closure over one matrix, where the
/// CPU has AVX2.
#[allow(clippy::type_complexity)]
fn vector_rows<'a>(lay: &'a VqLayout, idx: &'a [u8], table: &'a [f32]) -> Option<Box<dyn FnMut(&mut [f32]) + 'a>> {
    #[cfg(target_arch = "x86_64")]
    if Level::Avx2.supported() {
        use crate::x86_64::avx2;
        // SAFETY (both): AVX2 checked; the probe's layouts (64-row blocks,
        // 512 rows) meet the kernels' multiples of 8, and the slices are
        // the layout's sizes.
        return Some(if lay.packed6 {
            Box::new(move |y: &mut [f32]| unsafe { avx2::vq4p_rows8(lay, idx, table, 0, y) })
        } else {
            Box::new(move |y: &mut [f32]| unsafe { avx2::vq_rows8(lay, idx, table, 0, y) })
        });
    }
    let _ = (lay, idx, table);
    None
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

    /// The probe names a form that exists here and times it, per family.
    #[test]
    fn probe_measures_both_where_avx2_exists() {
        for f in [IndexFamily::Bytes, IndexFamily::Packed6] {
            let p = probe(f);
            assert!(p.loads_seconds.is_finite() && p.loads_seconds > 0.0);
            assert_eq!(p.vector_seconds.is_some(), cfg!(target_arch = "x86_64") && Level::Avx2.supported());
            if p.vector_seconds.is_none() {
                assert_eq!(p.choice, RowsKernel::Loads);
            }
        }
    }
}
