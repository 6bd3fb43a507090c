//! Kernel timings, one thread, every SIMD level this CPU has, on the
//! Kimi-Linear-48B shapes: the trunk matvec (Q4G/Q8G 9216×2304 and
//! 2304×9216, and as a 16-input matmat) and one VQ3R expert matrix (1024×2304, 64-row index blocks)
//! — its byte-plane lookups also with indices from memory, on one thread
//! and on two at once (a token's experts, one per thread) — and the same
//! matrix as VQ4P (its tables in registers, 64 rows or 8 at a time).
//! The trunk matvec in both numeric modes (`exact`, `fast`).
//! Prints the median and range of `--reps` runs per kernel and level, with
//! weights per cycle-free unit (G weights/s) and the bytes' bandwidth.
//!
//! `cargo run --release -p waste-quant --example kernels [-- REPS]`

use std::time::Instant;
use waste_format::Fmt;
use waste_quant::vq::{
    build_planes, build_table, build_table_planes, matvec_rows, matvec_rows_planes, planes_len, set_plane_lookup,
    uses_planes, PlaneLookup, VqBook, VqLayout,
};
use waste_quant::vq_loads::{set_rows_kernel, RowsKernel};
use waste_quant::{f32_to_f16, Level, MatJob, Matrix};

fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

fn time(reps: usize, mut f: impl FnMut()) -> (f64, f64, f64) {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[0], t[t.len() - 1])
}

/// A random trunk matrix of the 48B shapes (group 128) and an input for it.
fn random_trunk(fmt: Fmt, rows: usize, cols: usize, r: &mut impl FnMut() -> u64) -> (Matrix, Vec<f32>) {
    let g = 128;
    let rb = if fmt == Fmt::Q8G { cols } else { cols / 2 };
    let data: Vec<u8> = (0..rows * rb).map(|_| r() as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / g).flat_map(|_| f32_to_f16(0.01).to_le_bytes()).collect();
    let m = Matrix::from_stored(fmt, rows, cols, g, data, &scales).expect("matrix");
    let x: Vec<f32> = (0..cols).map(|i| (i % 7) as f32 * 0.1).collect();
    (m, x)
}

/// The Kimi-Linear-48B KDA layer's input projections (q, k, v 4096 × 2304,
/// f_a and g_a 128 × 2304, b 32 × 2304, Q4G) of 20 layers cycled, so each
/// pass reads its 15 MB from DRAM, as a decode token does: one
/// `Pool::matmats` a layer, at every level and both modes, 1 and 2 threads,
/// against one big matrix of the same bytes in one matvec.
fn projections(reps: usize, r: &mut impl FnMut() -> u64) {
    let shapes = [(4096, 2304), (4096, 2304), (4096, 2304), (128, 2304), (32, 2304), (128, 2304)];
    let layers: Vec<Vec<Matrix>> =
        (0..20).map(|_| shapes.iter().map(|&(rows, cols)| random_trunk(Fmt::Q4G, rows, cols, r).0).collect()).collect();
    let bytes: f64 = layers[0].iter().map(|m| m.heap_bytes() as f64).sum();
    let x: Vec<f32> = (0..2304).map(|i| (i % 7) as f32 * 0.1).collect();
    let mut ys: Vec<Vec<f32>> = shapes.iter().map(|&(rows, _)| vec![0f32; rows]).collect();
    let big: Vec<Matrix> = (0..20).map(|_| random_trunk(Fmt::Q4G, 12_576, 2304, r).0).collect();
    let mut yb = vec![0f32; 12_576];
    let levels: Vec<Level> = Level::available().into_iter().filter(|&l| l != Level::Scalar).collect();
    for threads in [1, 2] {
        for &lv in &levels {
            for numeric in [waste_quant::fast::Numeric::Exact, waste_quant::fast::Numeric::Fast] {
                let mut pool = waste_quant::Pool::with_level(threads, lv);
                pool.set_numeric(numeric);
                let mut l = 0;
                let (med, lo, hi) = time(reps * 20, || {
                    let views: Vec<_> = layers[l % 20].iter().map(|m| m.view()).collect();
                    let mut jobs: Vec<MatJob<'_>> =
                        views.iter().zip(ys.iter_mut()).map(|(m, y)| MatJob { m, xs: &x, ys: y }).collect();
                    pool.matmats(&mut jobs);
                    l += 1;
                });
                let mut l = 0;
                let (bmed, _, _) = time(reps * 20, || {
                    pool.matvec(&big[l % 20].view(), &x, &mut yb);
                    l += 1;
                });
                println!(
                    "kda projections {threads} thread(s) {:>7} {:>5}: {:.3} ms ({:.3}–{:.3}) {:.1} GB/s; one matrix of their rows {:.3} ms {:.1} GB/s",
                    lv.name(),
                    numeric.name(),
                    med * 1e3,
                    lo * 1e3,
                    hi * 1e3,
                    bytes / med / 1e9,
                    bmed * 1e3,
                    bytes / bmed / 1e9
                );
            }
        }
    }
}

fn main() {
    let reps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(15);
    let mut r = rng(1);
    // `kernels REPS rows [memory]`: the row forms alone, indices from L2 or memory
    if std::env::args().nth(2).as_deref() == Some("rows") {
        return vq_row_forms(reps, &mut r);
    }
    // `kernels REPS expert`: one lane's experts as decode runs them (gate and
    // up rows over two shared tables, the down table, the down rows), each
    // expert's indices a fresh record of a 450 MB arena
    if std::env::args().nth(2).as_deref() == Some("expert") {
        return expert_sequence(reps, &mut r);
    }
    // `kernels REPS seq`: a 15 MB matvec six times in a row, each place
    // timed (KBIG matrices cycled, KTHREADS threads, KGAP µs of spinning
    // between the rounds): the per-core streaming rate and the cost of a
    // pass after the pool's worker slept
    if std::env::args().nth(2).as_deref() == Some("seq") {
        return matvec_sequence(reps, &mut r);
    }
    // `kernels REPS tables`: VQ tables alone (f32 and the fast mode's) per level
    if std::env::args().nth(2).as_deref() == Some("tables") {
        return tables(reps);
    }
    // `kernels REPS mla`: MLA's absorbed query and value product per head
    if std::env::args().nth(2).as_deref() == Some("mla") {
        return mla_absorbed(reps, &mut r);
    }
    // `kernels REPS projections`: a KDA layer's input projections from DRAM
    if std::env::args().nth(2).as_deref() == Some("projections") {
        return projections(reps, &mut r);
    }
    // `kernels REPS matmat`: the trunk matmats and matvecs alone
    let trunk_only = std::env::args().nth(2).as_deref() == Some("matmat");
    if !trunk_only {
        pool_and_head(reps, &mut r);
        mla_absorbed(reps, &mut r);
        vq4p(reps, &mut r);
    }
    for (fmt, rows, cols) in [(Fmt::Q4G, 9216, 2304), (Fmt::Q4G, 2304, 9216), (Fmt::Q8G, 9216, 2304)] {
        let (m, x) = random_trunk(fmt, rows, cols, &mut r);
        let mut y = vec![0f32; rows];
        let bytes = m.heap_bytes() as f64;
        // prefill: 16 inputs through one matmat (one dequantization per block for several)
        let nt = 16;
        let xs: Vec<f32> = (0..nt * cols).map(|i| (i % 11) as f32 * 0.05).collect();
        let mut ys = vec![0f32; nt * rows];
        for lv in Level::available().into_iter().filter(|&l| l != Level::Scalar) {
            for numeric in [waste_quant::fast::Numeric::Exact, waste_quant::fast::Numeric::Fast] {
                let mut pool = waste_quant::Pool::with_level(1, lv);
                pool.set_numeric(numeric);
                let (med, lo, hi) = time(reps, || pool.matmat(&m.view(), &xs, nt, &mut ys));
                println!(
                    "matmat {:?} {rows}x{cols} x{nt} {:>7} {:>5}: {:.3} ms ({:.3}–{:.3}) {:.2} Gw/s",
                    fmt,
                    lv.name(),
                    numeric.name(),
                    med * 1e3,
                    lo * 1e3,
                    hi * 1e3,
                    (nt * rows * cols) as f64 / med / 1e9
                );
            }
        }
        for lv in Level::available() {
            // the fast mode's activations, quantized on the calling thread before a pool's matvec
            let (qmed, qlo, qhi) = time(reps, || {
                std::hint::black_box(waste_quant::fast::quantize_at(lv, &x, m.view().cols_padded(), 127.0));
            });
            println!(
                "activations {cols} to 8-bit blocks {:>7}: {:.2} µs ({:.2}–{:.2})",
                lv.name(),
                qmed * 1e6,
                qlo * 1e6,
                qhi * 1e6
            );
            let (med, lo, hi) = time(reps, || m.view().matvec_rows(lv, &x, 0, &mut y));
            // the fast numeric mode: the input quantized once, integer dots
            let qx = waste_quant::fast::quantize(&x, m.view().cols_padded());
            let (fmed, flo, fhi) = time(reps, || m.view().matvec_rows_fast(lv, &qx, 0, &mut y));
            for (mode, med, lo, hi) in [("exact", med, lo, hi), ("fast", fmed, flo, fhi)] {
                println!(
                    "trunk {:?} {rows}x{cols} {:>7} {mode:>5}: {:.3} ms ({:.3}–{:.3}) {:.2} Gw/s {:.1} GB/s",
                    fmt,
                    lv.name(),
                    med * 1e3,
                    lo * 1e3,
                    hi * 1e3,
                    (rows * cols) as f64 / med / 1e9,
                    bytes / med / 1e9
                );
            }
        }
    }
    if trunk_only {
        return;
    }
    let (rows, nvec, stages) = (1024, 2304 / 8, 3);
    let lay = VqLayout { rows, nvec, stages, block: 64, packed6: false };
    let books = vq_books(stages, 256);
    let br: Vec<&VqBook> = books.iter().collect();
    let idx: Vec<u8> = (0..lay.index_bytes()).map(|_| r() as u8).collect();
    let (scales, x) = vq_scales_input(rows, nvec);
    let mut t = vec![0f32; lay.table_len()];
    let mut y = vec![0f32; rows];
    for lv in Level::available() {
        table_and_rows(reps, "vq3r", lv, &lay, (&br, &x, &mut t), (&idx, &scales, &mut y));
        if uses_planes(lv, &lay) {
            let mut planes = vec![0u8; planes_len(&lay)];
            let (pb, _, _) = time(reps, || build_planes(lv, &lay, &t, &mut planes));
            let (tp, _, _) = time(reps, || build_table_planes(lv, &br, &lay, &x, &mut t, &mut planes));
            let (pa, _, _) = time(reps, || build_table_planes(lv, &br, &lay, &x, &mut [], &mut planes));
            println!(
                "vq3r {rows}x{} {:>7}: table and planes in one pass {:.3} ms, planes alone {:.3} ms",
                nvec * 8,
                lv.name(),
                tp * 1e3,
                pa * 1e3
            );
            // the same over 64 distinct index sets (57 MB): indices from
            // memory, as a token's experts are, not from L2/L3
            let many: Vec<Vec<u8>> = (0..64).map(|_| (0..lay.index_bytes()).map(|_| r() as u8).collect()).collect();
            // both plane lookups: which is faster depends on the CPU
            for form in PlaneLookup::ALL {
                set_plane_lookup(form);
                let (med, lo, hi) =
                    time(reps, || matvec_rows_planes(lv, &lay, &idx, &scales, &t, Some(&planes), 0, &mut y));
                println!(
                    "vq3r {rows}x{} {:>7} byte planes ({form:?}): planes {:.3} ms, rows {:.3} ms ({:.3}–{:.3}) {:.2} G lookups/s",
                    nvec * 8,
                    lv.name(),
                    pb * 1e3,
                    med * 1e3,
                    lo * 1e3,
                    hi * 1e3,
                    (rows * nvec * stages) as f64 / med / 1e9
                );
                let (med, lo, hi) = time(reps.min(9), || {
                    for ix in &many {
                        matvec_rows_planes(lv, &lay, ix, &scales, &t, Some(&planes), 0, &mut y);
                    }
                });
                from_memory(
                    &format!("vq3r {rows}x{} {:>7} byte planes ({form:?})", nvec * 8, lv.name()),
                    &lay,
                    (med, lo, hi),
                );
                // two threads at once, each over its own 64 index sets, as
                // decode runs a token's experts (one per thread): whether
                // the pair still looks up at twice one thread's rate
                let other: Vec<Vec<u8>> =
                    (0..64).map(|_| (0..lay.index_bytes()).map(|_| r() as u8).collect()).collect();
                let mut y2 = vec![0f32; rows];
                let (med, lo, hi) = time(reps.min(9), || {
                    std::thread::scope(|s| {
                        for (sets, y) in [(&many, &mut y), (&other, &mut y2)] {
                            let (lay, scales, t, planes) = (&lay, &scales, &t, &planes);
                            s.spawn(move || {
                                for ix in sets {
                                    matvec_rows_planes(lv, lay, ix, scales, t, Some(planes), 0, y);
                                }
                            });
                        }
                    })
                });
                println!(
                    "vq3r {rows}x{} {:>7} byte planes ({form:?}), indices from memory, 2 threads at once: {:.3} ms ({:.3}–{:.3}) per matrix a thread, {:.2} G lookups/s in all, {:.1} GB/s of indices",
                    nvec * 8,
                    lv.name(),
                    med * 1e3 / 64.0,
                    lo * 1e3 / 64.0,
                    hi * 1e3 / 64.0,
                    (2 * 64 * rows * nvec * stages) as f64 / med / 1e9,
                    (2 * 64 * lay.index_bytes()) as f64 / med / 1e9
                );
            }
        }
    }
}

/// The pool's per-call cost (two 5 µs tasks; the fixed price of every
/// split matvec) and matvecs read from memory, not L3 (the LM head of the
/// 48B shape, Q8G 163840×2304, 377 MB; Q4G stacks of its trunk matrices)
/// at 1 and 2 threads, against memory bandwidth.
fn pool_and_head(reps: usize, r: &mut impl FnMut() -> u64) {
    // two tasks of ~5 µs each: a pool at no cost takes 5 µs a call, one
    // that leaves the worker asleep 10 µs (the caller runs both)
    let spin = |n: u64| (0..n).fold(0u64, |a, i| std::hint::black_box(a.wrapping_add(i)));
    let n5 = {
        let t0 = Instant::now();
        spin(1_000_000);
        (5e-6 / (t0.elapsed().as_secs_f64() / 1e6)) as u64
    };
    let pool = waste_quant::Pool::new(2);
    let calls = 2_000;
    let (med, lo, hi) = time(reps, || {
        for _ in 0..calls {
            pool.run(2, &|_| {
                spin(n5);
            });
        }
    });
    println!(
        "pool 2 threads, 2 tasks of 5 µs: {:.2} µs per call ({:.2}–{:.2})",
        med / calls as f64 * 1e6,
        lo / calls as f64 * 1e6,
        hi / calls as f64 * 1e6
    );
    for (fmt, rows, cols) in [(Fmt::Q8G, 163_840, 2304), (Fmt::Q4G, 73_728, 2304), (Fmt::Q4G, 18_432, 9216)] {
        let (m, x) = random_trunk(fmt, rows, cols, r);
        let mut y = vec![0f32; rows];
        let bytes = m.heap_bytes() as f64;
        let modes = [waste_quant::fast::Numeric::Exact, waste_quant::fast::Numeric::Fast];
        let levels: Vec<Level> = Level::available().into_iter().filter(|&l| l != Level::Scalar).collect();
        for (threads, lv, numeric) in
            [1, 2].into_iter().flat_map(|t| levels.iter().flat_map(move |&l| modes.map(move |n| (t, l, n))))
        {
            let mut pool = waste_quant::Pool::with_level(threads, lv);
            pool.set_numeric(numeric);
            let (med, lo, hi) = time(reps.min(9), || pool.matvec(&m.view(), &x, &mut y));
            println!(
                "dram {fmt:?} {rows}x{cols} {threads} thread(s) {:>7} {:>5}: {:.2} ms ({:.2}–{:.2}) {:.1} GB/s",
                pool.level().name(),
                numeric.name(),
                med * 1e3,
                lo * 1e3,
                hi * 1e3,
                bytes / med / 1e9
            );
        }
        if fmt == Fmt::Q4G {
            // prefill chunks (8 and 16 inputs) over weights streamed from DRAM
            for nt in [8, 16] {
                let xs: Vec<f32> = (0..nt * cols).map(|i| (i % 11) as f32 * 0.05).collect();
                let mut ys = vec![0f32; nt * rows];
                for threads in [1, 2] {
                    let pool = waste_quant::Pool::new(threads);
                    let (med, lo, hi) = time(reps.min(9), || pool.matmat(&m.view(), &xs, nt, &mut ys));
                    println!(
                    "dram matmat {fmt:?} {rows}x{cols} x{nt} {threads} thread(s) {:>7}: {:.2} ms ({:.2}–{:.2}) {:.2} Gw/s",
                    pool.level().name(),
                    med * 1e3,
                    lo * 1e3,
                    hi * 1e3,
                    (nt * rows * cols) as f64 / med / 1e9
                );
                }
            }
        }
    }
}

/// MLA's absorbed query on the 48B shape (`kv_b` Q4G, 32 heads × (128 + 128)
/// rows × 512 columns): per head `W_kbᵀ q` over its 128 key rows — a
/// dequantized row buffer and an axpy per row against `MatRef::rows_axpy`.
fn mla_absorbed(reps: usize, r: &mut impl FnMut() -> u64) {
    let (heads, nope, vd, kvl) = (32, 128, 128, 512);
    let (m, _) = random_trunk(Fmt::Q4G, heads * (nope + vd), kvl, r);
    let q: Vec<f32> = (0..nope).map(|i| (i % 5) as f32 * 0.1 - 0.2).collect();
    let mut acc = vec![0f32; kvl];
    let mut row = vec![0f32; kvl];
    for lv in Level::available() {
        let (a, alo, ahi) = time(reps, || {
            for h in 0..heads {
                acc.fill(0.0);
                for (i, &c) in q.iter().enumerate() {
                    m.view().row(h * (nope + vd) + i, &mut row);
                    waste_quant::ops::axpy_at(lv, c, &row, &mut acc);
                }
            }
        });
        let (b, blo, bhi) = time(reps, || {
            for h in 0..heads {
                acc.fill(0.0);
                m.view().rows_axpy(lv, h * (nope + vd), &q, &mut acc);
            }
        });
        // the value product: each head's 128 value rows times its mixed latent
        let cb: Vec<f32> = (0..kvl).map(|i| (i % 9) as f32 * 0.05 - 0.2).collect();
        let mut oh = vec![0f32; vd];
        for numeric in [waste_quant::fast::Numeric::Exact, waste_quant::fast::Numeric::Fast] {
            let (v, vlo, vhi) = time(reps, || {
                for h in 0..heads {
                    m.view().matvec_rows_in(lv, numeric, &cb, h * (nope + vd) + nope, &mut oh);
                }
            });
            println!(
                "mla value product 32x128x512 q4g {:>7} {}: {:.3} ms ({:.3}–{:.3})",
                lv.name(),
                numeric.name(),
                v * 1e3,
                vlo * 1e3,
                vhi * 1e3
            );
        }
        println!(
            "mla absorbed query 32x128x512 q4g {:>7}: row buffer + axpy {:.3} ms ({:.3}–{:.3}), rows_axpy {:.3} ms ({:.3}–{:.3})",
            lv.name(),
            a * 1e3,
            alo * 1e3,
            ahi * 1e3,
            b * 1e3,
            blo * 1e3,
            bhi * 1e3
        );
    }
}

/// One VQ4P expert matrix (1024×2304, 4 stages of 64 entries, 6-bit packed
/// indices): at each level, its table and rows; at AVX-512 also rows 16..
/// of the matrix (the 64-row kernel takes whole 64-row groups only, so the
/// 8-row one, AVX2's, sums them), and the rows with indices from memory on
/// one and on two threads at once.
fn vq4p(reps: usize, r: &mut impl FnMut() -> u64) {
    let (rows, nvec, stages) = (1024, 2304 / 8, 4);
    let lay = VqLayout { rows, nvec, stages, block: 64, packed6: true };
    let books = vq_books(stages, 64);
    let br: Vec<&VqBook> = books.iter().collect();
    let sets: Vec<Vec<u8>> = (0..64).map(|_| (0..lay.index_bytes()).map(|_| r() as u8).collect()).collect();
    let other: Vec<Vec<u8>> = (0..64).map(|_| (0..lay.index_bytes()).map(|_| r() as u8).collect()).collect();
    let (scales, x) = vq_scales_input(rows, nvec);
    let mut t = vec![0f32; lay.table_len()];
    let (mut y, mut y2) = (vec![0f32; rows], vec![0f32; rows]);
    let lookups = (rows * nvec * stages) as f64;
    for lv in Level::available() {
        table_and_rows(reps, "vq4p", lv, &lay, (&br, &x, &mut t), (&sets[0], &scales, &mut y));
        if lv == Level::Avx512 {
            let (med, lo, hi) = time(reps, || matvec_rows(lv, &lay, &sets[0], &scales, &t, 16, &mut y[16..]));
            let per = lookups * (rows - 16) as f64 / rows as f64;
            println!(
                "vq4p {rows}x{} {:>7} rows 16.. (the 8-row kernel): {:.3} ms ({:.3}–{:.3}) {:.2} G lookups/s",
                nvec * 8,
                lv.name(),
                med * 1e3,
                lo * 1e3,
                hi * 1e3,
                per / med / 1e9
            );
        }
        let (med, lo, hi) = time(reps.min(9), || {
            for ix in &sets {
                matvec_rows(lv, &lay, ix, &scales, &t, 0, &mut y);
            }
        });
        from_memory(&format!("vq4p {rows}x{} {:>7}", nvec * 8, lv.name()), &lay, (med, lo, hi));
        let (med, lo, hi) = time(reps.min(9), || {
            std::thread::scope(|s| {
                for (sets, y) in [(&sets, &mut y), (&other, &mut y2)] {
                    let (lay, scales, t) = (&lay, &scales, &t);
                    s.spawn(move || {
                        for ix in sets {
                            matvec_rows(lv, lay, ix, scales, t, 0, y);
                        }
                    });
                }
            })
        });
        println!(
            "vq4p {rows}x{} {:>7}, indices from memory, 2 threads at once: {:.3} ms ({:.3}–{:.3}) per matrix a thread, {:.2} G lookups/s in all",
            nvec * 8,
            lv.name(),
            med * 1e3 / 64.0,
            lo * 1e3 / 64.0,
            hi * 1e3 / 64.0,
            2.0 * 64.0 * lookups / med / 1e9
        );
    }
}

/// The VQ row sums alone on one 48B expert matrix (1024×2304, 64-row
/// blocks: VQ3R, VQ2R, VQ4P) at the scalar and AVX2 levels, each AVX2 row
/// form ([`RowsKernel`]: gathers or permutes, or scalar loads);
/// every (format, level, form) runs once a round, `reps` rounds alternated.
/// `kernels REPS rows`.
fn vq_row_forms(reps: usize, r: &mut impl FnMut() -> u64) {
    let from_mem = std::env::args().nth(3).is_some_and(|a| a.starts_with("memory"));
    for (name, stages, packed6) in [("vq3r", 3, false), ("vq2r", 2, false), ("vq4p", 4, true)] {
        // KSHAPE=ROWSxCOLS: another matrix (2304x1024: an expert's down)
        let shape = std::env::var("KSHAPE").ok();
        let (rr, cc) = shape
            .as_deref()
            .and_then(|s| s.split_once('x'))
            .map_or((1024, 2304), |(a, b)| (a.parse().expect("KSHAPE rows"), b.parse().expect("KSHAPE columns")));
        let lay = VqLayout { rows: rr, nvec: cc / 8, stages, block: 64, packed6 };
        let books = vq_books(stages, lay.table_entries());
        let br: Vec<&VqBook> = books.iter().collect();
        let idx: Vec<u8> = (0..lay.index_bytes()).map(|_| r() as u8).collect();
        let (scales, x) = vq_scales_input(lay.rows, lay.nvec);
        let mut t = vec![0f32; lay.table_len()];
        build_table(Level::Scalar, &br, &lay, &x, &mut t);
        let mut y = vec![0f32; lay.rows];
        // 64 index sets read in turn (56 MB for VQ3R): from memory, as decode reads experts
        // `memory-huge`: the 64 sets in one buffer of 2 MiB pages, as the expert cache's arena
        let huge = std::env::args().nth(3).as_deref() == Some("memory-huge");
        let n = lay.index_bytes();
        // KSETS: more sets than 64 (an arena past the L3)
        let nsets = env_num("KSETS", 64);
        let mut arena = waste_io::AlignedBuf::new(nsets * n, huge);
        for b in arena.iter_mut() {
            *b = r() as u8;
        }
        let sets: Vec<&[u8]> = arena.chunks_exact(n).collect();
        // the indices of each call: one set (in L2), or the 64 in turn (from memory)
        let mut which = 0;
        let (sets_r, idx_r) = (&sets, &idx);
        let mut pick = move || -> &[u8] {
            if from_mem {
                which = (which + 1) % sets_r.len();
                sets_r[which]
            } else {
                idx_r
            }
        };
        let mut runs: Vec<(Level, RowsKernel, Vec<f64>)> = Vec::new();
        for lv in [Level::Scalar, Level::Avx2].into_iter().filter(|l| l.supported()) {
            for k in RowsKernel::ALL {
                runs.push((lv, k, Vec::new()));
            }
        }
        for _ in 0..reps.max(1) {
            for (lv, k, ts) in runs.iter_mut() {
                set_rows_kernel(*k);
                let ix = pick();
                let t0 = Instant::now();
                matvec_rows(*lv, &lay, ix, &scales, &t, 0, &mut y);
                ts.push(t0.elapsed().as_secs_f64());
            }
        }
        // the fast mode's int8 table beside them, in the form each AVX2
        // lookup keeps (chains a telescoped table, gathers a wide one)
        use waste_quant::vq_fast::{self as vf, Avx2Lookup, TableForm};
        let mut qt = vec![0f32; lay.table_len()];
        let nb = vf::blocks(&lay);
        let fast_level = if std::env::var("WASTE_SIMD").is_ok() { waste_quant::level() } else { Level::Avx2 };
        let (build_med, _, _) = time(reps.max(1), || {
            let (d, q) = vf::parts_mut(&lay, TableForm::Plain, &mut qt, 0, nb);
            vf::build(fast_level, &br, &lay, &x, 127.0, (0, nb), d, q, TableForm::Plain);
        });
        println!(
            "{name} {}x{} fast table build {}: {:.3} ms",
            lay.rows,
            lay.nvec * 8,
            fast_level.name(),
            build_med * 1e3
        );
        let keep = vf::avx2_lookup();
        let forms: &[Avx2Lookup] = if vf::rows32(fast_level, &lay) { &Avx2Lookup::ALL } else { &[Avx2Lookup::Chains] };
        for &lookup in forms {
            vf::set_avx2_lookup(lookup);
            let form = vf::table_form(fast_level, &lay);
            let (d, q) = vf::parts_mut(&lay, form, &mut qt, 0, nb);
            vf::build(fast_level, &br, &lay, &x, 127.0, (0, nb), d, q, form);
            let (med, lo, hi) =
                time(reps.max(1), || vf::matvec_rows(fast_level, &lay, pick(), &scales, &qt, 0, &mut y, form));
            println!(
                "{name} rows {}x{} fast {}{}: {:.3} ms ({:.3}–{:.3}) {:.2} G lookups/s",
                lay.rows,
                lay.nvec * 8,
                vf::rows_kernel_name(fast_level, &lay),
                if from_mem { ", indices from memory" } else { "" },
                med * 1e3,
                lo * 1e3,
                hi * 1e3,
                (lay.rows * lay.nvec * lay.stages) as f64 / med / 1e9
            );
        }
        // two inputs through the same rows: two gathers' calls, or one of the pair's
        if vf::rows32(fast_level, &lay) && lay.stages > 1 {
            vf::set_avx2_lookup(Avx2Lookup::Gathers);
            let form = vf::table_form(fast_level, &lay);
            // the pair's tables plain (widened a tile at a time), the calls' wide
            let (mut qt2, mut pa, mut pb) =
                (vec![0f32; lay.table_len()], vec![0f32; lay.table_len()], vec![0f32; lay.table_len()]);
            let x2: Vec<f32> = x.iter().map(|v| 0.3 - v).collect();
            for (buf, xi, f) in [
                (&mut qt, &x, form),
                (&mut qt2, &x2, form),
                (&mut pa, &x, TableForm::Plain),
                (&mut pb, &x2, TableForm::Plain),
            ] {
                let (d, q) = vf::parts_mut(&lay, f, buf, 0, nb);
                vf::build(fast_level, &br, &lay, xi, 127.0, (0, nb), d, q, f);
            }
            let mut y2 = vec![0f32; lay.rows];
            let (mut two, mut pair, mut twice, mut quad) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let (mut y3, mut y4) = (vec![0f32; lay.rows], vec![0f32; lay.rows]);
            for _ in 0..reps.max(1) {
                let ix = pick();
                let t0 = Instant::now();
                vf::matvec_rows(fast_level, &lay, ix, &scales, &qt, 0, &mut y, form);
                vf::matvec_rows(fast_level, &lay, ix, &scales, &qt2, 0, &mut y2, form);
                two.push(t0.elapsed().as_secs_f64());
                let ix = pick();
                let t0 = Instant::now();
                vf::matvec_rows_pair(fast_level, &lay, ix, &scales, [&pa, &pb], 0, [&mut y, &mut y2], TableForm::Plain);
                pair.push(t0.elapsed().as_secs_f64());
                // one input by the pair kernel: its plain table twice, one output discarded
                let ix = pick();
                let t0 = Instant::now();
                vf::matvec_rows_pair(fast_level, &lay, ix, &scales, [&pa, &pa], 0, [&mut y, &mut y2], TableForm::Plain);
                twice.push(t0.elapsed().as_secs_f64());
                // four inputs (the two tables, each twice) by one quad call
                let ix = pick();
                let t0 = Instant::now();
                let ys4 = [&mut y[..], &mut y2[..], &mut y3[..], &mut y4[..]];
                vf::matvec_rows_quad(fast_level, &lay, ix, &scales, [&pa, &pb, &pa, &pb], 0, ys4, TableForm::Plain);
                quad.push(t0.elapsed().as_secs_f64());
            }
            for (what, ts) in [
                ("two inputs by two calls", &mut two),
                ("two inputs by one pair call", &mut pair),
                ("one input by the pair kernel, its table twice", &mut twice),
                ("four inputs by one quad call", &mut quad),
            ] {
                ts.sort_by(f64::total_cmp);
                println!(
                    "{name} rows {}x{} fast gathers, {what}{}: {:.3} ms ({:.3}–{:.3})",
                    lay.rows,
                    lay.nvec * 8,
                    if from_mem { ", indices from memory" } else { "" },
                    ts[ts.len() / 2] * 1e3,
                    ts[0] * 1e3,
                    ts[ts.len() - 1] * 1e3
                );
            }
        }
        vf::set_avx2_lookup(keep);
        for (lv, k, ts) in runs.iter_mut() {
            ts.sort_by(f64::total_cmp);
            let med = ts[ts.len() / 2];
            println!(
                "{name} rows {}x{} {:>6} {:>6}{}: {:.3} ms ({:.3}–{:.3}) {:.2} G lookups/s",
                lay.rows,
                lay.nvec * 8,
                lv.name(),
                k.name(),
                if from_mem { ", indices from memory" } else { "" },
                med * 1e3,
                ts[0] * 1e3,
                ts[ts.len() - 1] * 1e3,
                (lay.rows * lay.nvec * lay.stages) as f64 / med / 1e9
            );
        }
    }
}

/// `stages` books of `entries` 8-dimensional entries (a fixed pattern).
fn vq_books(stages: usize, entries: usize) -> Vec<VqBook> {
    let bits: Vec<u16> = (0..entries * 8).map(|i| f32_to_f16((i % 13) as f32 * 0.01)).collect();
    (0..stages).map(|_| VqBook::from_f16(&bits, entries, 8)).collect()
}

/// The VQ3R tables of an expert's gate/up input (2304 wide) and down input
/// (1024 wide) alone at each level: the exact mode's f32 table and the fast
/// mode's plain int8 one (with its quantization), alternated a round.
fn tables(reps: usize) {
    use waste_quant::vq_fast::{self as vf, TableForm};
    for cols in [2304, 1024] {
        let lay = VqLayout { rows: 64, nvec: cols / 8, stages: 3, block: 64, packed6: false };
        let books = vq_books(3, lay.table_entries());
        let br: Vec<&VqBook> = books.iter().collect();
        let (_, x) = vq_scales_input(lay.rows, lay.nvec);
        let mut t = vec![0f32; lay.table_len()];
        let nb = vf::blocks(&lay);
        let levels: Vec<Level> = [Level::Avx2, Level::Avx512].into_iter().filter(|l| l.supported()).collect();
        let mut ts = vec![(Vec::new(), Vec::new()); levels.len()];
        for _ in 0..reps.max(1) {
            for (lv, (tf, tq)) in levels.iter().zip(ts.iter_mut()) {
                let t0 = Instant::now();
                build_table(*lv, &br, &lay, &x, &mut t);
                tf.push(t0.elapsed().as_secs_f64());
                let (d, q) = vf::parts_mut(&lay, TableForm::Plain, &mut t, 0, nb);
                let t0 = Instant::now();
                vf::build(*lv, &br, &lay, &x, 127.0, (0, nb), d, q, TableForm::Plain);
                tq.push(t0.elapsed().as_secs_f64());
            }
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2] * 1e3
        };
        for (lv, (tf, tq)) in levels.iter().zip(ts.iter_mut()) {
            println!("vq3r table of {cols}: {:>6} f32 {:.4} ms, fast {:.4} ms", lv.name(), med(tf), med(tq));
        }
    }
}

/// Unit row scales (f16 bytes) and an input for `nvec` 8-wide positions.
fn vq_scales_input(rows: usize, nvec: usize) -> (Vec<u8>, Vec<f32>) {
    let scales = (0..rows).flat_map(|_| f32_to_f16(1.0).to_le_bytes()).collect();
    (scales, (0..nvec * 8).map(|i| (i % 5) as f32 * 0.1).collect())
}

/// Times a VQ table build and the rows' sums at `lv` and prints both.
fn table_and_rows(
    reps: usize,
    name: &str,
    lv: Level,
    lay: &VqLayout,
    (br, x, t): (&[&VqBook], &[f32], &mut [f32]),
    (idx, scales, y): (&[u8], &[u8], &mut [f32]),
) {
    let (tb, _, _) = time(reps, || build_table(lv, br, lay, x, t));
    let (med, lo, hi) = time(reps, || matvec_rows(lv, lay, idx, scales, t, 0, y));
    println!(
        "{name} {}x{} {:>7}: table {:.3} ms, rows {:.3} ms ({:.3}–{:.3}) {:.2} G lookups/s",
        lay.rows,
        lay.nvec * 8,
        lv.name(),
        tb * 1e3,
        med * 1e3,
        lo * 1e3,
        hi * 1e3,
        (lay.rows * lay.nvec * lay.stages) as f64 / med / 1e9
    );
}

/// Prints a timing of 64 index sets read from memory, per matrix.
fn from_memory(what: &str, lay: &VqLayout, (med, lo, hi): (f64, f64, f64)) {
    println!(
        "{what}, indices from memory: rows {:.3} ms ({:.3}–{:.3}) per matrix, {:.1} GB/s of indices",
        med * 1e3 / 64.0,
        lo * 1e3 / 64.0,
        hi * 1e3 / 64.0,
        (64 * lay.index_bytes()) as f64 / med / 1e9
    );
}

/// The `expert` mode: a lane's sequence of VQ3R 1024 × 2304 experts in the
/// fast mode at the process's level, each phase timed.
fn expert_sequence(reps: usize, r: &mut impl FnMut() -> u64) {
    use waste_quant::vq_fast::{self as vf};
    let lv = if std::env::var("WASTE_SIMD").is_ok() { waste_quant::level() } else { Level::Avx2 };
    let lg = VqLayout { rows: 1024, nvec: 2304 / 8, stages: 3, block: 64, packed6: false };
    let ld = VqLayout { rows: 2304, nvec: 1024 / 8, stages: 3, block: 64, packed6: false };
    let books = vq_books(3, 256);
    let br: Vec<&VqBook> = books.iter().collect();
    let rec = 3 * lg.index_bytes();
    let nrec = 170;
    let mut arena = waste_io::AlignedBuf::new(nrec * rec, true);
    for b in arena.iter_mut() {
        *b = r() as u8;
    }
    let (gs, x) = vq_scales_input(lg.rows, lg.nvec);
    let (ds, _) = vq_scales_input(ld.rows, ld.nvec);
    let form = vf::table_form(lv, &lg);
    let dform = vf::table_form(lv, &ld);
    let mut tg = vec![0f32; lg.table_len()];
    let mut tu = vec![0f32; lg.table_len()];
    let mut td = vec![0f32; ld.table_len()];
    let x2: Vec<f32> = x.iter().map(|v| 0.3 - v).collect();
    for (buf, xi) in [(&mut tg, &x), (&mut tu, &x2)] {
        let nb = vf::blocks(&lg);
        let (d, q) = vf::parts_mut(&lg, form, buf, 0, nb);
        vf::build(lv, &br, &lg, xi, 127.0, (0, nb), d, q, form);
    }
    let (mut g, mut u, mut y) = (vec![0f32; 1024], vec![0f32; 1024], vec![0f32; 2304]);
    let mut ts = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    let mut k = 0;
    for _ in 0..reps.max(1) * 8 {
        k = (k + 37) % nrec;
        let rb = &arena[k * rec..(k + 1) * rec];
        let (gi, rest) = rb.split_at(lg.index_bytes());
        let (ui, di) = rest.split_at(lg.index_bytes());
        let t = Instant::now();
        vf::matvec_rows(lv, &lg, gi, &gs, &tg, 0, &mut g, form);
        ts[0].push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        vf::matvec_rows(lv, &lg, ui, &gs, &tu, 0, &mut u, form);
        ts[1].push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for (a, b) in g.iter_mut().zip(&u) {
            *a = *a / (1.0 + (-*a).exp()) * b * 1e-3;
        }
        let nb = vf::blocks(&ld);
        let (d, q) = vf::parts_mut(&ld, dform, &mut td, 0, nb);
        vf::build(lv, &br, &ld, &g, 127.0, (0, nb), d, q, dform);
        ts[2].push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        vf::matvec_rows(lv, &ld, di, &ds, &td, 0, &mut y, dform);
        ts[3].push(t.elapsed().as_secs_f64());
    }
    for (name, t) in ["gate rows", "up rows", "glu + down table", "down rows"].iter().zip(ts.iter_mut()) {
        t.sort_by(f64::total_cmp);
        let n = t.len();
        println!("expert {name} {}: {:.3} ms ({:.3}–{:.3})", lv.name(), t[n / 2] * 1e3, t[0] * 1e3, t[n - 1] * 1e3);
    }
}

/// A number from the environment, else `default`.
fn env_num(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// The `seq` mode: six 12 576 × 2304 Q4G matvecs in a row in the fast mode,
/// the median time of each place in the row, for each way of splitting the
/// rows (`KPARTS=a,b,…`: that many tasks claimed in turn by the threads; 0
/// is `Pool::matvec`'s one part a thread; every split runs each round, on
/// the same matrices). Between the rounds `KGAP` µs of what `KGMODE` names
/// ([`Gap`]): the cost of a pass after the memory or a worker went quiet.
fn matvec_sequence(reps: usize, r: &mut impl FnMut() -> u64) {
    let nbig = env_num("KBIG", 20).max(1);
    let big: Vec<Matrix> = (0..nbig).map(|_| random_trunk(Fmt::Q4G, 12_576, 2304, r).0).collect();
    let x: Vec<f32> = (0..2304).map(|i| (i % 7) as f32 * 0.1).collect();
    let mut y = vec![0f32; 12_576];
    let mut pool = waste_quant::Pool::with_level(env_num("KTHREADS", 2), waste_quant::level());
    pool.set_numeric(waste_quant::fast::Numeric::Fast);
    let kps: Vec<usize> =
        std::env::var("KPARTS").unwrap_or("0".into()).split(',').map(|v| v.parse().expect("KPARTS")).collect();
    let mut gap = Gap::new(env_num("KGMODE", 0), env_num("KGAP", 0) as u64, r);
    let mut ts = vec![vec![Vec::new(); 6]; kps.len()];
    let mut k = 0;
    for _ in 0..reps * 10 {
        for (&parts, t) in kps.iter().zip(ts.iter_mut()) {
            for tp in t.iter_mut() {
                k = (k + 7) % nbig;
                let m = big[k].view();
                let t0 = Instant::now();
                if parts == 0 {
                    pool.matvec(&m, &x, &mut y);
                } else {
                    let (n, q) = (m.rows, waste_quant::fast::quantize(&x, m.cols_padded()));
                    let ys = waste_quant::SyncSlice::new(&mut y);
                    pool.run(parts, &|p| {
                        let (a, b) = (n * p / parts, n * (p + 1) / parts);
                        // SAFETY: task p alone writes rows [a, b) of y.
                        m.matvec_rows_fast(waste_quant::level(), &q, a, unsafe { ys.range(a, b) });
                    });
                }
                tp.push(t0.elapsed().as_secs_f64());
            }
            gap.fill(&pool);
        }
    }
    let bytes = big[0].heap_bytes() as f64;
    for (parts, t) in kps.iter().zip(ts.iter_mut()) {
        for (i, v) in t.iter_mut().enumerate() {
            v.sort_by(f64::total_cmp);
            let med = v[v.len() / 2];
            println!("parts {parts} matvec {} in a row: {:.3} ms {:.1} GB/s", i + 1, med * 1e3, bytes / med / 1e9);
        }
    }
}

/// What fills the `seq` mode's gap between rounds (`KGMODE`): 0 the caller
/// spins (`pause`), 1 the caller reads a 256 MB buffer at full speed, 2 it
/// reads a line every `KTRICKLE` pauses, 3 it spins without `pause`, 4 both
/// threads read their half of the buffer (a line every `KTRICKLE` pauses,
/// 0: full speed), 5 both threads run gate rows of the fast VQ kernel
/// (indices from a 450 MB arena), as a decode's experts' pass.
struct Gap {
    mode: usize,
    len: std::time::Duration,
    trickle: usize,
    side: Vec<u64>,
    at: usize,
    /// Mode 5's rows.
    vq: Option<GapRows>,
}

/// Mode 5's gate rows: layout, index arena, block scales, table and its form.
type GapRows = (VqLayout, waste_io::AlignedBuf, Vec<u8>, Vec<f32>, waste_quant::vq_fast::TableForm);

impl Gap {
    fn new(mode: usize, micros: u64, r: &mut impl FnMut() -> u64) -> Gap {
        use waste_quant::vq_fast as vf;
        let side = if matches!(mode, 1 | 2 | 4) { (0..(256u64 << 20) / 8).collect() } else { Vec::new() };
        let vq = (mode == 5).then(|| {
            let lv = waste_quant::level();
            let lg = VqLayout { rows: 1024, nvec: 2304 / 8, stages: 3, block: 64, packed6: false };
            let books = vq_books(3, 256);
            let br: Vec<&VqBook> = books.iter().collect();
            let mut arena = waste_io::AlignedBuf::new(510 * lg.index_bytes(), true);
            for b in arena.iter_mut() {
                *b = r() as u8;
            }
            let (gs, xg) = vq_scales_input(lg.rows, lg.nvec);
            let form = vf::table_form(lv, &lg);
            let mut tg = vec![0f32; lg.table_len()];
            let nb = vf::blocks(&lg);
            let (d, q) = vf::parts_mut(&lg, form, &mut tg, 0, nb);
            vf::build(lv, &br, &lg, &xg, 127.0, (0, nb), d, q, form);
            (lg, arena, gs, tg, form)
        });
        let len = std::time::Duration::from_micros(micros);
        Gap { mode, len, trickle: env_num("KTRICKLE", 100), side, at: 0, vq }
    }

    /// One gap.
    fn fill(&mut self, pool: &waste_quant::Pool) {
        let (t0, len, trickle, side) = (Instant::now(), self.len, self.trickle, &self.side);
        let mut acc = 0u64;
        match self.mode {
            1 | 2 => {
                while t0.elapsed() < len {
                    for _ in 0..if self.mode == 1 { 64 } else { 1 } {
                        acc = acc.wrapping_add(side[self.at]);
                        self.at = (self.at + 8) % side.len();
                    }
                    for _ in 0..if self.mode == 2 { trickle } else { 0 } {
                        std::hint::spin_loop();
                    }
                }
            }
            3 => while t0.elapsed() < len {},
            4 => {
                let (h, at) = (side.len() / 2, self.at % (side.len() / 2));
                pool.run(2, &|i| {
                    let mut o = i * h + at;
                    let mut a = 0u64;
                    while t0.elapsed() < len {
                        for _ in 0..16 {
                            a = a.wrapping_add(side[o]);
                            o = if o + 8 >= (i + 1) * h { i * h } else { o + 8 };
                            for _ in 0..trickle {
                                std::hint::spin_loop();
                            }
                        }
                    }
                    std::hint::black_box(a);
                });
                self.at += 4096 * 64;
            }
            5 => {
                let (lg, arena, gs, tg, form) = self.vq.as_ref().expect("mode 5's arena");
                let next = std::sync::atomic::AtomicUsize::new(self.at);
                let nrec = arena.len() / lg.index_bytes();
                pool.run(2, &|_| {
                    let mut g = vec![0f32; lg.rows];
                    while t0.elapsed() < len {
                        let k = next.fetch_add(37, std::sync::atomic::Ordering::Relaxed) % nrec;
                        let gi = &arena[k * lg.index_bytes()..(k + 1) * lg.index_bytes()];
                        waste_quant::vq_fast::matvec_rows(waste_quant::level(), lg, gi, gs, tg, 0, &mut g, *form);
                    }
                    std::hint::black_box(&g);
                });
                self.at = next.into_inner();
            }
            _ => {
                while t0.elapsed() < len {
                    std::hint::spin_loop();
                }
            }
        }
        std::hint::black_box(acc);
    }
}
