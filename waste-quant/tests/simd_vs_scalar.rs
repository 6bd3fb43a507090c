//! Every SIMD level against the scalar reference on random awkward sizes:
//! bit-identical (the design's promise), and the scalar against an f64
//! dequantize-then-dot within a stated bound.

#[path = "support/skip.rs"]
mod skip;

use proptest::prelude::*;
use skip::report_skip;
use waste_format::Fmt;
use waste_quant::vq::{
    build_planes, build_table, build_table_planes, dequant_row, matvec_rows, matvec_rows_planes, planes_cover,
    planes_len, set_plane_lookup, PlaneLookup, VqBook, VqLayout,
};
use waste_quant::vq_loads::{set_rows_kernel, RowsKernel};
use waste_quant::{f32_to_f16, Level, Matrix};

/// Relative bound of an f32 dot product against f64 for these sizes.
const DOT_REL_TOL: f64 = 1e-4;

fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

fn gauss(r: &mut impl FnMut() -> u64) -> f32 {
    let u = (r() >> 11) as f64 / (1u64 << 53) as f64;
    let v = (r() >> 11) as f64 / (1u64 << 53) as f64;
    ((-2.0 * (u + 1e-12).ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

fn random_matrix(fmt: Fmt, rows: usize, cols: usize, group: usize, seed: u64) -> Matrix {
    let mut r = rng(seed);
    let (data, scales): (Vec<u8>, Vec<u8>) = match fmt {
        Fmt::F32 => ((0..rows * cols).flat_map(|_| gauss(&mut r).to_le_bytes()).collect(), vec![]),
        Fmt::F16 => ((0..rows * cols).flat_map(|_| f32_to_f16(gauss(&mut r)).to_le_bytes()).collect(), vec![]),
        Fmt::Bf16 => {
            ((0..rows * cols).flat_map(|_| waste_quant::f32_to_bf16(gauss(&mut r)).to_le_bytes()).collect(), vec![])
        }
        Fmt::Q8G | Fmt::Q4G => {
            let np = cols.div_ceil(group) * group;
            let rb = if fmt == Fmt::Q8G { np } else { np / 2 };
            let d = (0..rows * rb).map(|_| r() as u8).collect();
            let s = (0..rows * np / group)
                .flat_map(|_| f32_to_f16(gauss(&mut r).abs() * 0.01 + 1e-3).to_le_bytes())
                .collect();
            (d, s)
        }
    };
    Matrix::from_stored(fmt, rows, cols, group, data, &scales).unwrap()
}

fn fmt_of(i: u8) -> Fmt {
    [Fmt::F32, Fmt::F16, Fmt::Bf16, Fmt::Q8G, Fmt::Q4G][i as usize % 5]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn trunk_matvec_bit_identical_across_levels(f in 0u8..5, rows in 1usize..9, cols in 1usize..300, g in prop::sample::select(vec![2usize, 16, 32, 64, 128]), seed in any::<u64>()) {
        let fmt = fmt_of(f);
        let m = random_matrix(fmt, rows, cols, g, seed);
        let mut r = rng(seed + 1);
        let x: Vec<f32> = (0..cols).map(|_| gauss(&mut r)).collect();
        let mut want = vec![0f32; rows];
        m.view().matvec_rows(Level::Scalar, &x, 0, &mut want);
        // scalar vs f64 reference of the exact dequantized weights
        let w = m.to_f32();
        for i in 0..rows {
            let exact: f64 = (0..cols).map(|j| w[i * cols + j] as f64 * x[j] as f64).sum();
            let mag: f64 = (0..cols).map(|j| (w[i * cols + j] as f64 * x[j] as f64).abs()).sum();
            prop_assert!((want[i] as f64 - exact).abs() <= DOT_REL_TOL * mag.max(1e-30), "row {} {} vs {}", i, want[i], exact);
        }
        for lv in Level::available() {
            let mut got = vec![0f32; rows];
            m.view().matvec_rows(lv, &x, 0, &mut got);
            prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "level {:?} fmt {:?}", lv, fmt);
            // a row range that starts inside the matrix (as a thread's share does)
            let mut part = vec![0f32; rows - 1];
            m.view().matvec_rows(lv, &x, 1, &mut part);
            prop_assert_eq!(part.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want[1..].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "level {:?} fmt {:?} from row 1", lv, fmt);
        }
    }

    /// The transposed product of a row range (`MatRef::rows_axpy`, MLA's
    /// absorbed query): every level bit-identical to dequantizing each row
    /// and the scalar axpy, rows in order; widths over and under one
    /// 256-column pass, and ones the AVX-512 kernel leaves to the fallback.
    #[test]
    fn rows_axpy_is_dequant_then_axpy(f in 0u8..5, rows in 1usize..40, cols in prop_oneof![(1usize..20).prop_map(|k| 32 * k), 1usize..100], g in prop::sample::select(vec![16usize, 32, 64, 128]), seed in any::<u64>()) {
        let m = random_matrix(fmt_of(f), rows + 3, cols, g, seed);
        let mut r = rng(seed + 5);
        let coef: Vec<f32> = (0..rows).map(|_| gauss(&mut r)).collect();
        let acc0: Vec<f32> = (0..cols).map(|_| gauss(&mut r)).collect();
        let mut want = acc0.clone();
        let mut row = vec![0f32; cols];
        for (i, &c) in coef.iter().enumerate() {
            m.view().row(2 + i, &mut row);
            waste_quant::ops::axpy(c, &row, &mut want);
        }
        for lv in Level::available() {
            let mut got = acc0.clone();
            m.view().rows_axpy(lv, 2, &coef, &mut got);
            prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "level {:?} fmt {:?}", lv, fmt_of(f));
        }
    }

    /// Several matrices in one pass of the pool (`Pool::matmats`: rows of
    /// all split together by work): each output bit-identical to the
    /// scalar product of its own matrix, any thread count, level, width
    /// mix, and each job's own token count (none included).
    #[test]
    fn matmats_equal_one_matmat_each(shapes in prop::collection::vec((0u8..5, 1usize..90, 1usize..150, 0usize..4), 1..5), threads in 1usize..4, seed in any::<u64>()) {
        let ms: Vec<_> = shapes.iter().enumerate().map(|(i, &(f, rows, cols, _))| random_matrix(fmt_of(f), rows, cols, 32, seed + i as u64)).collect();
        let nts: Vec<usize> = shapes.iter().map(|s| s.3).collect();
        let mut r = rng(seed + 99);
        let xs: Vec<Vec<f32>> = ms.iter().zip(&nts).map(|(m, &nt)| (0..nt * m.cols).map(|_| gauss(&mut r)).collect()).collect();
        let want: Vec<Vec<f32>> = ms.iter().zip(&xs).zip(&nts).map(|((m, x), &nt)| {
            let mut y = vec![0f32; nt * m.rows];
            for t in 0..nt {
                m.view().matvec_rows(Level::Scalar, &x[t * m.cols..(t + 1) * m.cols], 0, &mut y[t * m.rows..(t + 1) * m.rows]);
            }
            y
        }).collect();
        for lv in Level::available() {
            let views: Vec<_> = ms.iter().map(|m| m.view()).collect();
            let mut got: Vec<Vec<f32>> = ms.iter().zip(&nts).map(|(m, &nt)| vec![f32::NAN; nt * m.rows]).collect();
            let mut jobs: Vec<waste_quant::MatJob<'_>> = views.iter().zip(&xs).zip(got.iter_mut()).map(|((m, x), y)| waste_quant::MatJob { m, xs: x, ys: y }).collect();
            waste_quant::Pool::with_level(threads, lv).matmats(&mut jobs);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                prop_assert_eq!(g.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), w.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "job {} level {:?}", i, lv);
            }
        }
    }

    /// Several inputs at once (prefill): every level, any thread count,
    /// bit-identical to one scalar matvec per input.
    #[test]
    fn trunk_matmat_equals_matvecs(f in 0u8..5, rows in 1usize..70, cols in 1usize..300, nt in 1usize..10, threads in 1usize..4, g in prop::sample::select(vec![16usize, 32, 64, 128]), seed in any::<u64>()) {
        let fmt = fmt_of(f);
        let m = random_matrix(fmt, rows, cols, g, seed);
        let mut r = rng(seed + 2);
        let xs: Vec<f32> = (0..nt * cols).map(|_| gauss(&mut r)).collect();
        let mut want = vec![0f32; nt * rows];
        for t in 0..nt {
            m.view().matvec_rows(Level::Scalar, &xs[t * cols..(t + 1) * cols], 0, &mut want[t * rows..(t + 1) * rows]);
        }
        for lv in Level::available() {
            let mut got = vec![0f32; nt * rows];
            waste_quant::Pool::with_level(threads, lv).matmat(&m.view(), &xs, nt, &mut got);
            prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "level {:?} fmt {:?}", lv, fmt);
        }
    }

    #[test]
    fn vq_matvec_bit_identical_across_levels(packed in any::<bool>(), st in 1usize..=3, rows in prop_oneof![1usize..200, (1usize..4).prop_map(|k| 64 * k)], nvec in 1usize..20, block in prop::sample::select(vec![0usize, 8, 64, 128]), seed in any::<u64>()) {
        // 1 to 3 byte stages (each has its own byte-plane kernel), or VQ4P's 4 packed
        let stages = if packed { 4 } else { st };
        let entries = if packed { 64 } else { 256 };
        let lay = VqLayout { rows, nvec, stages, block, packed6: packed };
        let mut r = rng(seed);
        let books: Vec<VqBook> = (0..stages).map(|_| {
            let bits: Vec<u16> = (0..entries * 8).map(|_| f32_to_f16(gauss(&mut r) * 0.1)).collect();
            VqBook::from_f16(&bits, entries, 8)
        }).collect();
        let br: Vec<&VqBook> = books.iter().collect();
        let idx: Vec<u8> = (0..lay.index_bytes()).map(|_| r() as u8).collect();
        let scales: Vec<u8> = (0..rows).flat_map(|_| f32_to_f16(gauss(&mut r).abs() + 0.1).to_le_bytes()).collect();
        let x: Vec<f32> = (0..nvec * 8).map(|_| gauss(&mut r)).collect();
        let mut t0 = vec![0f32; lay.table_len()];
        build_table(Level::Scalar, &br, &lay, &x, &mut t0);
        let mut want = vec![0f32; rows];
        matvec_rows(Level::Scalar, &lay, &idx, &scales, &t0, 0, &mut want);
        // scalar LUT product vs dequantized weights in f64
        let mut w = vec![0f32; nvec * 8];
        for i in 0..rows {
            dequant_row(&br, &lay, &idx, &scales, i, &mut w);
            let exact: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 = w.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            prop_assert!((want[i] as f64 - exact).abs() <= DOT_REL_TOL * mag.max(1e-30));
        }
        for lv in Level::available() {
            let mut t = vec![0f32; lay.table_len()];
            build_table(lv, &br, &lay, &x, &mut t);
            prop_assert_eq!(t.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), t0.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            // split rows unevenly to exercise row ranges; both AVX2 row
            // forms (the one this CPU uses is chosen by a probe)
            for k in RowsKernel::ALL {
                set_rows_kernel(k);
                let mut got = vec![0f32; rows];
                let cut = (rows / 2) / 8 * 8;
                let (a, b) = got.split_at_mut(cut);
                matvec_rows(lv, &lay, &idx, &scales, &t, 0, a);
                matvec_rows(lv, &lay, &idx, &scales, &t, cut, b);
                prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "level {:?}, rows {:?}", lv, k);
                // a start inside an 8-row group (the scalar loads' single rows)
                if rows > 3 {
                    let mut part = vec![0f32; rows - 3];
                    matvec_rows(lv, &lay, &idx, &scales, &t, 3, &mut part);
                    prop_assert_eq!(part.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want[3..].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "level {:?}, rows {:?} from 3", lv, k);
                }
            }
            // the byte-plane lookups (AVX-512 VBMI), split at a 64-row boundary
            let mut planes = vec![0u8; planes_len(&lay)];
            build_planes(lv, &lay, &t, &mut planes);
            // the table and its planes in one pass: the same bits as the two calls
            let (mut t2, mut planes2) = (vec![0f32; lay.table_len()], vec![0u8; planes_len(&lay)]);
            build_table_planes(lv, &br, &lay, &x, &mut t2, &mut planes2);
            prop_assert_eq!(t2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), t0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "fused table, level {:?}", lv);
            prop_assert!(planes2 == planes, "fused planes, level {:?}", lv);
            // both plane lookups (the one this CPU uses is chosen per vendor)
            for form in PlaneLookup::ALL {
                set_plane_lookup(form);
                let mut got = vec![0f32; rows];
                let cut = (rows / 2) / 64 * 64;
                let (a, b) = got.split_at_mut(cut);
                matvec_rows_planes(lv, &lay, &idx, &scales, &t, Some(&planes), 0, a);
                matvec_rows_planes(lv, &lay, &idx, &scales, &t, Some(&planes), cut, b);
                prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "planes {:?}, level {:?}", form, lv);
            }
            // where the planes serve every row, the planes alone (no f32 table)
            if planes_cover(lv, &lay) {
                let mut planes3 = vec![0u8; planes_len(&lay)];
                build_table_planes(lv, &br, &lay, &x, &mut [], &mut planes3);
                prop_assert!(planes3 == planes, "planes without the table, level {:?}", lv);
                let mut got = vec![0f32; rows];
                matvec_rows_planes(lv, &lay, &idx, &scales, &[], Some(&planes3), 0, &mut got);
                prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "planes alone, level {:?}", lv);
            }
        }
    }
}

/// A layout without stages (a caller's degenerate input: no container
/// format has one) sums nothing and reads no index byte at any level — the
/// byte-plane kernels, compiled per stage count, never take it
/// (`planes_fit` admits 1 to 3 stages).
#[test]
fn a_layout_without_stages_sums_nothing() {
    let lay = VqLayout { rows: 128, nvec: 4, stages: 0, block: 64, packed6: false };
    assert!(!waste_quant::vq::planes_fit(&lay));
    assert_eq!(lay.index_bytes(), 0);
    let scales: Vec<u8> = (0..lay.rows).flat_map(|_| f32_to_f16(1.0).to_le_bytes()).collect();
    // the table has no entries either; an empty slice would mean "none given"
    let table = [f32::NAN];
    for lv in Level::available() {
        let mut y = vec![f32::NAN; lay.rows];
        matvec_rows_planes(lv, &lay, &[], &scales, &table, Some(&[]), 0, &mut y);
        assert!(y.iter().all(|&v| v == 0.0), "level {lv:?}");
    }
}

/// A layout whose index or table size does not fit in `usize` (a caller's
/// input, never a container's: records bound their sizes) is refused by
/// the length checks at every level — the sizes saturate rather than wrap
/// to a small number that a short slice would pass — before any kernel
/// reads an index byte.
#[test]
fn a_layout_too_large_to_address_is_refused() {
    let scales: Vec<u8> = (0..64).flat_map(|_| f32_to_f16(1.0).to_le_bytes()).collect();
    for packed in [false, true] {
        let stages = if packed { 4 } else { 3 };
        // 64 · nvec · 3 wraps to 0 (mod 2^64) without saturation
        let lay = VqLayout { rows: 64, nvec: 1 << 58, stages, block: 64, packed6: packed };
        assert_eq!((lay.index_bytes(), lay.table_len()), (usize::MAX, usize::MAX));
        for lv in Level::available() {
            let got = std::panic::catch_unwind(|| {
                let mut y = vec![0f32; 64];
                matvec_rows(lv, &lay, &[0u8; 192], &scales, &[0f32; 1024], 0, &mut y);
            });
            assert!(got.is_err(), "level {lv:?}, packed {packed}: a wrapped size reached a kernel");
        }
    }
}

#[test]
fn reports_skipped_levels() {
    for l in Level::ALL {
        if !l.supported() {
            report_skip(
                &format!("waste-quant simd_vs_scalar: SIMD level {} not supported by this CPU", l.name()),
                l.required(),
            );
        }
    }
}
