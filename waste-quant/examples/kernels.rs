//! Kernel timings, one thread, every SIMD level this CPU has, on the
//! Kimi-Linear-48B shapes: the trunk matvec (Q4G/Q8G 9216×2304 and
//! 2304×9216, and as a 16-input matmat) and one VQ3R expert matrix (1024×2304, 64-row index blocks).
//! Prints the median and range of `--reps` runs per kernel and level, with
//! weights per cycle-free unit (G weights/s) and the bytes' bandwidth.
//!
//! `cargo run --release -p waste-quant --example kernels [-- REPS]`

use std::time::Instant;
use waste_format::Fmt;
use waste_quant::vq::{build_table, matvec_rows, VqBook, VqLayout};
use waste_quant::{f32_to_f16, Level, Matrix};

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

fn main() {
    let reps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(15);
    let mut r = rng(1);
    for (fmt, rows, cols) in [(Fmt::Q4G, 9216, 2304), (Fmt::Q4G, 2304, 9216), (Fmt::Q8G, 9216, 2304)] {
        let g = 128;
        let rb = if fmt == Fmt::Q8G { cols } else { cols / 2 };
        let data: Vec<u8> = (0..rows * rb).map(|_| r() as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / g).flat_map(|_| f32_to_f16(0.01).to_le_bytes()).collect();
        let m = Matrix::from_stored(fmt, rows, cols, g, data, &scales).expect("matrix");
        let x: Vec<f32> = (0..cols).map(|i| (i % 7) as f32 * 0.1).collect();
        let mut y = vec![0f32; rows];
        let bytes = m.heap_bytes() as f64;
        // prefill: 16 inputs through one matmat (one dequantization per block for several)
        let nt = 16;
        let xs: Vec<f32> = (0..nt * cols).map(|i| (i % 11) as f32 * 0.05).collect();
        let mut ys = vec![0f32; nt * rows];
        for lv in Level::available().into_iter().filter(|&l| l != Level::Scalar) {
            let pool = waste_quant::Pool::with_level(1, lv);
            let (med, lo, hi) = time(reps, || pool.matmat(&m.view(), &xs, nt, &mut ys));
            println!(
                "matmat {:?} {rows}x{cols} x{nt} {:>7}: {:.3} ms ({:.3}–{:.3}) {:.2} Gw/s",
                fmt,
                lv.name(),
                med * 1e3,
                lo * 1e3,
                hi * 1e3,
                (nt * rows * cols) as f64 / med / 1e9
            );
        }
        for lv in Level::available() {
            let (med, lo, hi) = time(reps, || m.view().matvec_rows(lv, &x, 0, &mut y));
            println!(
                "trunk {:?} {rows}x{cols} {:>7}: {:.3} ms ({:.3}–{:.3}) {:.2} Gw/s {:.1} GB/s",
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
    let (rows, nvec, stages) = (1024, 2304 / 8, 3);
    let lay = VqLayout { rows, nvec, stages, block: 64, packed6: false };
    let books: Vec<VqBook> = (0..stages)
        .map(|_| {
            let bits: Vec<u16> = (0..256 * 8).map(|i| f32_to_f16((i % 13) as f32 * 0.01)).collect();
            VqBook::from_f16(&bits, 256, 8)
        })
        .collect();
    let br: Vec<&VqBook> = books.iter().collect();
    let idx: Vec<u8> = (0..lay.index_bytes()).map(|_| r() as u8).collect();
    let scales: Vec<u8> = (0..rows).flat_map(|_| f32_to_f16(1.0).to_le_bytes()).collect();
    let x: Vec<f32> = (0..nvec * 8).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut t = vec![0f32; lay.table_len()];
    let mut y = vec![0f32; rows];
    for lv in Level::available() {
        let (tb, _, _) = time(reps, || build_table(lv, &br, &lay, &x, &mut t));
        let (med, lo, hi) = time(reps, || matvec_rows(lv, &lay, &idx, &scales, &t, 0, &mut y));
        println!(
            "vq3r {rows}x{} {:>7}: table {:.3} ms, rows {:.3} ms ({:.3}–{:.3}) {:.2} G lookups/s",
            nvec * 8,
            lv.name(),
            tb * 1e3,
            med * 1e3,
            lo * 1e3,
            hi * 1e3,
            (rows * nvec * stages) as f64 / med / 1e9
        );
    }
}
