//! What bounds the AVX-512 kernels on this core: the clock (a chain of
//! dependent integer adds, one cycle each), the throughput of the vector
//! instructions the kernels are made of (8 independent destinations, data
//! in registers; the AVX2 fast mode's 256-bit ones too), and the inner loops of the VQ3R byte-plane lookup (one
//! 64-row group, one stage) and of the Q4G matvec (one 32-column block of
//! 4 rows) as the compiler emits them, with their data in L1 — so the cycles
//! they take are the core's limit, not memory's. From those, the most
//! index (VQ3R) or weight (Q4G) bytes one core can consume per second,
//! to set beside `waste bench`'s memory bandwidth (docs/lab/); and
//! two alternatives to the Q4G loop that give the same weights, both
//! measured slower (twenty-seventh session).
//!
//! `cargo run --release -p waste-quant --example port_bound`
//! (x86_64 with AVX-512 F/BW/VBMI; elsewhere it says so and exits).

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::time::Instant;

    /// Seconds per iteration of `f(n)` (which runs `n` iterations), the
    /// fastest of 5 runs.
    fn per_iter(n: u64, mut f: impl FnMut(u64)) -> f64 {
        f(n / 10);
        (0..5)
            .map(|_| {
                let t = Instant::now();
                f(n);
                t.elapsed().as_secs_f64() / n as f64
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// GHz: a chain of dependent adds retires one per cycle.
    fn clock_ghz() -> f64 {
        let s = per_iter(200_000_000, |n| {
            let mut x = 0u64;
            for i in 0..n {
                // SAFETY: register arithmetic only.
                unsafe {
                    asm!("add {x}, {i}", "add {x}, {i}", "add {x}, {i}", "add {x}, {i}", x = inout(reg) x, i = in(reg) i, options(nomem, nostack))
                };
            }
            std::hint::black_box(x);
        });
        4.0 / s / 1e9
    }

    /// Eight independent `op dst, r1, r0` on registers 8–15 of width `$r`
    /// (`zmm` or `ymm`).
    macro_rules! eight {
        ($op:literal, $r:literal) => {
            concat!(
                $op, " ", $r, "8, ", $r, "1, ", $r, "0\n", $op, " ", $r, "9, ", $r, "1, ", $r, "0\n", $op, " ", $r,
                "10, ", $r, "1, ", $r, "0\n", $op, " ", $r, "11, ", $r, "1, ", $r, "0\n", $op, " ", $r, "12, ", $r,
                "1, ", $r, "0\n", $op, " ", $r, "13, ", $r, "1, ", $r, "0\n", $op, " ", $r, "14, ", $r, "1, ", $r,
                "0\n", $op, " ", $r, "15, ", $r, "1, ", $r, "0\n"
            )
        };
    }

    /// Seconds per instruction of `$op` on `$r` registers (`zmm` under
    /// AVX-512 F/BW/VBMI, `ymm` under AVX2), eight independent destinations.
    macro_rules! throughput {
        ($name:literal, $op:literal) => {
            throughput!($name, $op, "zmm", "avx512f,avx512bw,avx512vbmi")
        };
        ($name:literal, $op:literal, $r:literal, $feat:literal) => {{
            #[target_feature(enable = $feat)]
            unsafe fn run(n: u64) {
                for _ in 0..n {
                    // SAFETY: register-only vector operations (the features checked by the caller).
                    unsafe {
                        asm!(eight!($op, $r), out("xmm8") _, out("xmm9") _, out("xmm10") _, out("xmm11") _,
                            out("xmm12") _, out("xmm13") _, out("xmm14") _, out("xmm15") _, options(nomem, nostack))
                    };
                }
            }
            // SAFETY: the features checked in main.
            ($name, per_iter(50_000_000, |n| unsafe { run(n) }) / 8.0)
        }};
    }

    /// One VQ3R group and stage of `avx512::vq_rows64` (two-source form): 3
    /// index loads and 2 permutes to pull the stage's 64 indices out, the
    /// top bit as a mask, 4 planes × (2 `vpermt2b` + blend), 8 unpacks to
    /// f32, and 64 sums loaded, added and stored — `body` picks the lookup
    /// part (1), the unpack-and-add part (2) or both (3).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn vq3r_group(n: u64, body: u8, idx: &[u8; 4096], y: &mut [f32; 4096]) {
        let (ip, yp) = (idx.as_ptr(), y.as_mut_ptr());
        for i in 0..n {
            let p = ip.wrapping_add((i as usize & 15) * 192);
            let a = yp.wrapping_add((i as usize & 15) * 64);
            // SAFETY: p + 192 <= idx.len(), a + 64 <= y.len(); registers only otherwise.
            unsafe {
                if body & 1 != 0 {
                    asm!(
                        "vmovdqu64 zmm22, [{p}]", "vpermt2b zmm22, zmm0, [{p} + 64]", "vpermt2b zmm22, zmm1, [{p} + 128]",
                        "vpmovb2m k1, zmm22",
                        "vmovdqa64 zmm23, zmm6", "vpermt2b zmm23, zmm22, zmm7", "vmovdqa64 zmm24, zmm8", "vpermt2b zmm24, zmm22, zmm9",
                        "vmovdqu8 zmm23 {{k1}}, zmm24",
                        "vmovdqa64 zmm24, zmm10", "vpermt2b zmm24, zmm22, zmm11", "vmovdqa64 zmm25, zmm12", "vpermt2b zmm25, zmm22, zmm13",
                        "vmovdqu8 zmm24 {{k1}}, zmm25",
                        "vmovdqa64 zmm25, zmm14", "vpermt2b zmm25, zmm22, zmm15", "vmovdqa64 zmm26, zmm16", "vpermt2b zmm26, zmm22, zmm17",
                        "vmovdqu8 zmm25 {{k1}}, zmm26",
                        "vmovdqa64 zmm26, zmm18", "vpermt2b zmm26, zmm22, zmm19", "vpermi2b zmm22, zmm20, zmm21",
                        "vmovdqu8 zmm26 {{k1}}, zmm22",
                        p = in(reg) p,
                        out("zmm22") _, out("zmm23") _, out("zmm24") _, out("zmm25") _, out("zmm26") _, out("k1") _,
                        options(nostack, readonly)
                    );
                }
                if body & 2 != 0 {
                    asm!(
                        "vpunpcklbw zmm27, zmm23, zmm24", "vpunpckhbw zmm28, zmm23, zmm24",
                        "vpunpcklbw zmm29, zmm25, zmm26", "vpunpckhbw zmm30, zmm25, zmm26",
                        "vpunpcklwd zmm31, zmm27, zmm29", "vaddps zmm31, zmm31, [{a}]", "vmovups [{a}], zmm31",
                        "vpunpckhwd zmm31, zmm27, zmm29", "vaddps zmm31, zmm31, [{a} + 64]", "vmovups [{a} + 64], zmm31",
                        "vpunpcklwd zmm31, zmm28, zmm30", "vaddps zmm31, zmm31, [{a} + 128]", "vmovups [{a} + 128], zmm31",
                        "vpunpckhwd zmm31, zmm28, zmm30", "vaddps zmm31, zmm31, [{a} + 192]", "vmovups [{a} + 192], zmm31",
                        a = in(reg) a,
                        out("zmm27") _, out("zmm28") _, out("zmm29") _, out("zmm30") _, out("zmm31") _,
                        options(nostack)
                    );
                }
            }
        }
    }

    /// A Q4G row's instructions in the kernel's form: 16 bytes
    /// zero-extended to 32-bit lanes, one shift, two table permutes and two
    /// fused multiply-adds (`$t` the table, `$a`/`$b` the sums).
    #[rustfmt::skip]
    macro_rules! row_kernel {
        ($off:literal, $t:literal, $a:literal, $b:literal) => {
            concat!(
                "vpmovzxbd zmm4, [{p}", $off, "]\n",
                "vpsrld zmm5, zmm4, 4\n",
                "vpermps zmm4, zmm4, ", $t, "\n",
                "vpermps zmm5, zmm5, ", $t, "\n",
                "vfmadd231ps ", $a, ", zmm4, zmm2\n",
                "vfmadd231ps ", $b, ", zmm5, zmm3\n"
            )
        };
    }

    /// The row with its 16 bytes broadcast to the four 128-bit lanes by the
    /// load (no shuffle) and two variable shifts (`vpsrlvd` by 8 · lane/4,
    /// and 4 more, in zmm16/zmm17) putting a nibble in each 32-bit lane's
    /// low bits, in a permuted lane order.
    #[rustfmt::skip]
    macro_rules! row_bcast {
        ($off:literal, $t:literal, $a:literal, $b:literal) => {
            concat!(
                "vbroadcasti32x4 zmm18, [{p}", $off, "]\n",
                "vpsrlvd zmm4, zmm18, zmm16\n",
                "vpsrlvd zmm5, zmm18, zmm17\n",
                "vpermps zmm4, zmm4, ", $t, "\n",
                "vpermps zmm5, zmm5, ", $t, "\n",
                "vfmadd231ps ", $a, ", zmm4, zmm2\n",
                "vfmadd231ps ", $b, ", zmm5, zmm3\n"
            )
        };
    }

    /// The row with the low nibbles from the table (one `vpermps`) and the
    /// high ones converted (`vpsubd` of the bias in zmm16, `vcvtdq2ps`,
    /// `vmulps` by the scale in zmm17): the same floats, `(q − 8) · s`, one
    /// operation moved off the shuffle pipe onto the others.
    #[rustfmt::skip]
    macro_rules! row_mixed {
        ($off:literal, $t:literal, $a:literal, $b:literal) => {
            concat!(
                "vpmovzxbd zmm4, [{p}", $off, "]\n",
                "vpsrld zmm5, zmm4, 4\n",
                "vpermps zmm4, zmm4, ", $t, "\n",
                "vpsubd zmm5, zmm5, zmm16\n",
                "vcvtdq2ps zmm5, zmm5\n",
                "vmulps zmm5, zmm5, zmm17\n",
                "vfmadd231ps ", $a, ", zmm4, zmm2\n",
                "vfmadd231ps ", $b, ", zmm5, zmm3\n"
            )
        };
    }

    /// One 32-column block of 4 Q4G rows, each row as `$row` emits it (the
    /// inputs' halves loaded once for the 4 rows; tables in zmm6/zmm7); the
    /// `$k0`/`$k1` vectors are loaded into zmm16/zmm17 first, for the rows
    /// that need constants.
    macro_rules! q4g_block {
        ($(#[$doc:meta])* $name:ident, $row:ident, $k0:expr, $k1:expr) => {
            $(#[$doc])*
            #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
            unsafe fn $name(n: u64, w: &[u8; 4096], x: &[f32; 4096]) {
                let (wp, xp) = (w.as_ptr(), x.as_ptr());
                let (k0, k1): ([u32; 16], [u32; 16]) = ($k0, $k1);
                for i in 0..n {
                    let p = wp.wrapping_add((i as usize & 31) * 64);
                    let q = xp.wrapping_add((i as usize & 31) * 32);
                    // SAFETY: p + 64 <= w.len(), q + 32 <= x.len(); k0, k1 hold
                    // 64 bytes each; registers otherwise.
                    unsafe {
                        asm!(
                            "vmovdqu32 zmm16, [{k0}]", "vmovdqu32 zmm17, [{k1}]",
                            "vmovups zmm2, [{q}]", "vmovups zmm3, [{q} + 64]",
                            $row!("", "zmm6", "zmm8", "zmm9"),
                            $row!(" + 16", "zmm7", "zmm10", "zmm11"),
                            $row!(" + 32", "zmm6", "zmm12", "zmm13"),
                            $row!(" + 48", "zmm7", "zmm14", "zmm15"),
                            p = in(reg) p, q = in(reg) q, k0 = in(reg) k0.as_ptr(), k1 = in(reg) k1.as_ptr(),
                            out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _,
                            out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                            out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                            out("zmm16") _, out("zmm17") _, out("zmm18") _,
                            options(nostack, readonly)
                        );
                    }
                }
            }
        };
    }

    q4g_block!(
        /// `avx512::rows_dot_q4`'s loop (the two constant loads unused).
        q4g_block_kernel,
        row_kernel,
        [0; 16],
        [0; 16]
    );
    q4g_block!(
        /// Broadcast loads and variable shifts by 8 · lane/4 and 4 more.
        q4g_block_bcast,
        row_bcast,
        core::array::from_fn(|d| 8 * (d as u32 / 4)),
        core::array::from_fn(|d| 8 * (d as u32 / 4) + 4)
    );
    q4g_block!(
        /// High nibbles converted: the bias 8, the scale 0.25.
        q4g_block_mixed,
        row_mixed,
        [8; 16],
        [0.25f32.to_bits(); 16]
    );

    /// Seconds per round of 8 independent `vpgatherdd ymm` (8 dwords each,
    /// from a 4 KiB table in L1, the indices stepped so no gather repeats)
    /// and `scalar` byte-table lookups beside them (a byte load, a table
    /// load, an add): whether a gather leaves load slots for scalar
    /// lookups (the AVX2 fast VQ gathers, docs/lab entry 72).
    #[target_feature(enable = "avx2")]
    unsafe fn gathers(n: u64, scalar: usize) -> f64 {
        use std::arch::x86_64::*;
        let table = vec![1i32; 1024];
        let bytes: Vec<u8> = (0..4096).map(|i| (i * 37 % 251) as u8).collect();
        let t8: Vec<i8> = (0..256).map(|i| (i % 100) as i8).collect();
        let mut acc = [_mm256_setzero_si256(); 8];
        let mut ix: [__m256i; 8] = core::array::from_fn(|k| _mm256_setr_epi32(k as i32, 9, 77, 130, 255, 3, 500, 1000));
        let (step, m) = (_mm256_set1_epi32(37), _mm256_set1_epi32(1023));
        let mut s = [0i32; 8];
        let mut o = 0usize;
        let t0 = Instant::now();
        for _ in 0..n {
            for (a, x) in acc.iter_mut().zip(ix.iter_mut()) {
                *x = _mm256_and_si256(_mm256_add_epi32(*x, step), m);
                // SAFETY: indices below 1024, the table's length.
                *a = _mm256_add_epi32(*a, unsafe { _mm256_i32gather_epi32::<4>(table.as_ptr(), *x) });
            }
            for j in 0..scalar {
                s[j & 7] += i32::from(t8[usize::from(bytes[(o + j) & 4095])]);
            }
            o = o.wrapping_add(scalar);
        }
        let t = t0.elapsed().as_secs_f64();
        std::hint::black_box((acc, s));
        t / n as f64
    }

    /// Seconds per round of `G` `vpgatherdd ymm` (one stepped index vector,
    /// `G` table offsets, four accumulators) beside `S` lookups as the
    /// chains do them (`vpsubb` of the index, `vpshufb`, `vpaddb`: two index
    /// chains, two tables, two accumulators), everything in registers
    /// (constant trip counts, 15 `ymm`): whether the gathers leave the
    /// vector ports free for in-register lookups (docs/lab entry 73).
    #[target_feature(enable = "avx2")]
    unsafe fn beside<const G: usize, const S: usize>(n: u64) -> f64 {
        use std::arch::x86_64::*;
        let table = vec![1i32; 2048];
        let mut acc = [_mm256_setzero_si256(); 4];
        let mut x = _mm256_setr_epi32(0, 9, 77, 130, 255, 3, 500, 1000);
        let (step, m) = (_mm256_set1_epi32(37), _mm256_set1_epi32(1023));
        let t = std::hint::black_box([_mm256_set1_epi8(3), _mm256_set1_epi8(5)]);
        let (c16, mut base) = (_mm256_set1_epi8(16), std::hint::black_box(_mm256_set1_epi8(7)));
        let mut sh = [_mm256_set1_epi8(1); 2];
        let start = Instant::now();
        for _ in 0..n {
            x = _mm256_and_si256(_mm256_add_epi32(x, step), m);
            for k in 0..G {
                // SAFETY: indices below 1024 from offset 128·k < 1024: inside the 2048.
                let g = unsafe { _mm256_i32gather_epi32::<4>(table.as_ptr().add(128 * k), x) };
                acc[k & 3] = _mm256_add_epi32(acc[k & 3], g);
            }
            base = _mm256_add_epi8(base, x);
            let mut v = [base, _mm256_add_epi8(base, c16)];
            for j in 0..S {
                v[j & 1] = _mm256_sub_epi8(v[j & 1], c16);
                sh[j & 1] = _mm256_add_epi8(sh[j & 1], _mm256_shuffle_epi8(t[j & 1], v[j & 1]));
            }
        }
        let el = start.elapsed().as_secs_f64();
        std::hint::black_box((acc, sh));
        el / n as f64
    }

    pub fn main() {
        if is_x86_feature_detected!("avx2") {
            let ghz = clock_ghz();
            // SAFETY (each): AVX2 checked.
            let rounds = unsafe {
                [
                    ("8 gathers", beside::<8, 0>(5_000_000)),
                    ("16 chain lookups", beside::<0, 16>(5_000_000)),
                    ("8 gathers + 16 chain lookups", beside::<8, 16>(5_000_000)),
                ]
            };
            for (name, sec) in rounds {
                println!("{name}: {:.1} cycles a round", sec * ghz * 1e9);
            }
            for scalar in [0, 8, 16, 32] {
                // SAFETY: AVX2 checked.
                let c = unsafe { gathers(5_000_000, scalar) } * ghz * 1e9;
                println!(
                    "8 x vpgatherdd ymm + {scalar:2} scalar byte lookups: {c:.1} cycles a round ({:.2} a gather)",
                    c / 8.0
                );
            }
        }
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vbmi"))
        {
            println!("port_bound: this CPU lacks AVX-512 F/BW/VBMI; nothing to measure");
            return;
        }
        let ghz = clock_ghz();
        println!("clock: {ghz:.2} GHz (a chain of dependent adds)");
        for (name, s) in [
            throughput!("vpermb", "vpermb"),
            throughput!("vpermt2b", "vpermt2b"),
            throughput!("vpermps", "vpermps"),
            throughput!("vpunpcklbw", "vpunpcklbw"),
            throughput!("vpaddd", "vpaddd"),
            throughput!("vpsrlvd", "vpsrlvd"),
            throughput!("vpsubd", "vpsubd"),
            throughput!("vmulps", "vmulps"),
            throughput!("vaddps", "vaddps"),
            throughput!("vfmadd231ps", "vfmadd231ps"),
        ] {
            println!("{name:>12}: {:.2} per cycle (zmm, 8 independent destinations)", 1.0 / (s * ghz * 1e9));
        }
        // the AVX2 fast mode's instructions (its matmat: maddubs, madd,
        // subtract, convert, multiply, FMA per input block)
        for (name, s) in [
            throughput!("vpmaddubsw", "vpmaddubsw", "ymm", "avx2,fma"),
            throughput!("vpmaddwd", "vpmaddwd", "ymm", "avx2,fma"),
            throughput!("vpsubd", "vpsubd", "ymm", "avx2,fma"),
            throughput!("vpshufb", "vpshufb", "ymm", "avx2,fma"),
            throughput!("vmulps", "vmulps", "ymm", "avx2,fma"),
            throughput!("vfmadd231ps", "vfmadd231ps", "ymm", "avx2,fma"),
            throughput!("vpunpcklbw", "vpunpcklbw", "ymm", "avx2,fma"),
        ] {
            println!("{name:>12}: {:.2} per cycle (ymm, 8 independent destinations)", 1.0 / (s * ghz * 1e9));
        }
        let idx = Box::new([7u8; 4096]);
        let mut y = Box::new([0f32; 4096]);
        let mut cycles = [0f64; 4];
        for body in 1..=3u8 {
            // SAFETY: AVX-512 F/BW/VBMI checked above.
            let s = per_iter(20_000_000, |n| unsafe { vq3r_group(n, body, &idx, &mut y) });
            cycles[body as usize] = s * ghz * 1e9;
        }
        println!(
            "VQ3R group-stage (64 lookups): lookups {:.1} cycles, unpack and add {:.1}, both {:.1} -> at most {:.1} GB/s of indices per core",
            cycles[1],
            cycles[2],
            cycles[3],
            64.0 * ghz / cycles[3]
        );
        let w = Box::new([0x5Au8; 4096]);
        let x = Box::new([0.5f32; 4096]);
        type Block = unsafe fn(u64, &[u8; 4096], &[f32; 4096]);
        let blocks: [(&str, Block); 3] = [
            ("Q4G block (4 rows x 32 columns)", q4g_block_kernel),
            ("Q4G block, broadcast loads and variable shifts (slower)", q4g_block_bcast),
            ("Q4G block, low nibbles by table, high ones converted (slower)", q4g_block_mixed),
        ];
        for (name, f) in blocks {
            // SAFETY: as above.
            let c = per_iter(20_000_000, |n| unsafe { f(n, &w, &x) }) * ghz * 1e9;
            println!(
                "{name}: {c:.1} cycles -> at most {:.1} GB/s of weights per core ({:.1} weights per cycle)",
                64.0 * ghz / c,
                128.0 / c
            );
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::main();
    #[cfg(not(target_arch = "x86_64"))]
    println!("port_bound: x86_64 only");
}
