//! The trunk tensor formats, one registration each ([`TENSOR_FORMATS`]):
//! what a format stores and must check, its exact weights (the definition
//! every kernel reproduces), its encoder, and the SIMD levels with kernels
//! of their own for it. Sizes are `waste_format::Fmt`'s (`row_bytes`,
//! `groups_per_row`), the one rule the reader, the writer and the kernels
//! share. Adding a format: docs/ADDING-A-FORMAT.md.

use crate::level::Level;
use crate::matrix::MatRef;
use waste_format::half::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use waste_format::Fmt;

/// Which stored values must be finite for the weights to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    /// f32 words (infinite or NaN when the exponent bits are all ones).
    F32Words,
    /// 16-bit floats with this exponent mask (f16 0x7C00, bf16 0x7F80).
    Halves(u16),
    /// Integer codes: always finite (the f16 scales are checked for every
    /// grouped format).
    Codes,
}

/// A value the format cannot hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EncodeError {
    /// The element at this index (row-major) is beyond the format's range.
    Value(usize),
    /// A group's scale is beyond f16's range.
    Scale {
        /// Row.
        row: usize,
        /// Group within the row.
        group: usize,
    },
}

/// Payload and f16 scale bytes of an encoded matrix.
pub type Encoded = (Vec<u8>, Vec<u8>);

/// One trunk tensor format: everything the engine knows of it but its size
/// rule (`Fmt`) and its SIMD kernels (the level files, which the levels in
/// [`TensorFormat::kernels`] name).
#[derive(Debug)]
pub struct TensorFormat {
    /// The format.
    pub fmt: Fmt,
    /// What must be checked finite in its payload.
    pub stored: Stored,
    /// The exact weights: `out[i] = W[r][c0 + i]` — the definition.
    pub dequant: fn(&MatRef<'_>, usize, usize, &mut [f32]),
    /// Encode `rows × cols` values row-major in groups of `group` (grouped
    /// formats): the converter's and the synthetic writer's encoder.
    pub encode: fn(&[f32], usize, usize, usize) -> Result<Encoded, EncodeError>,
    /// Levels with kernels of their own (every other level runs the
    /// scalar definition); the registration test checks each.
    pub kernels: &'static [Level],
}

/// Every level with kernels for every format today.
const ALL_KERNELS: &[Level] = &[Level::Avx2, Level::Avx512, Level::Neon];

/// The registered trunk formats, one per `Fmt` variant.
pub static TENSOR_FORMATS: [TensorFormat; 5] = [
    TensorFormat {
        fmt: Fmt::F32,
        stored: Stored::F32Words,
        dequant: dequant_f32,
        encode: encode_f32,
        kernels: ALL_KERNELS,
    },
    TensorFormat {
        fmt: Fmt::F16,
        stored: Stored::Halves(0x7C00),
        dequant: dequant_f16,
        encode: encode_f16,
        kernels: ALL_KERNELS,
    },
    TensorFormat {
        fmt: Fmt::Bf16,
        stored: Stored::Halves(0x7F80),
        dequant: dequant_bf16,
        encode: encode_bf16,
        kernels: ALL_KERNELS,
    },
    TensorFormat {
        fmt: Fmt::Q8G,
        stored: Stored::Codes,
        dequant: dequant_q8g,
        encode: encode_grouped::<8>,
        kernels: ALL_KERNELS,
    },
    TensorFormat {
        fmt: Fmt::Q4G,
        stored: Stored::Codes,
        dequant: dequant_q4g,
        encode: encode_grouped::<4>,
        kernels: ALL_KERNELS,
    },
];

/// The registration of `fmt`.
pub fn tensor_format(fmt: Fmt) -> &'static TensorFormat {
    // the registration test checks that each lands on its own entry
    &TENSOR_FORMATS[match fmt {
        Fmt::F32 => 0,
        Fmt::F16 => 1,
        Fmt::Bf16 => 2,
        Fmt::Q8G => 3,
        Fmt::Q4G => 4,
    }]
}

/// The row's payload bytes.
fn row<'a>(m: &MatRef<'a>, r: usize) -> &'a [u8] {
    &m.data[r * m.row_bytes()..(r + 1) * m.row_bytes()]
}

fn dequant_f32(m: &MatRef<'_>, r: usize, c0: usize, out: &mut [f32]) {
    let rb = row(m, r);
    for (i, o) in out.iter_mut().enumerate() {
        let j = (c0 + i) * 4;
        *o = f32::from_le_bytes([rb[j], rb[j + 1], rb[j + 2], rb[j + 3]]);
    }
}

fn dequant_halves(m: &MatRef<'_>, r: usize, c0: usize, out: &mut [f32], cv: fn(u16) -> f32) {
    let rb = row(m, r);
    for (i, o) in out.iter_mut().enumerate() {
        let j = (c0 + i) * 2;
        *o = cv(u16::from_le_bytes([rb[j], rb[j + 1]]));
    }
}

fn dequant_f16(m: &MatRef<'_>, r: usize, c0: usize, out: &mut [f32]) {
    dequant_halves(m, r, c0, out, f16_to_f32)
}

fn dequant_bf16(m: &MatRef<'_>, r: usize, c0: usize, out: &mut [f32]) {
    dequant_halves(m, r, c0, out, bf16_to_f32)
}

/// `out` (columns `c0..c0 + out.len()`) cut where a new group of `group`
/// columns starts, each run with its first column: one scale conversion
/// per group, then a plain loop over its weights.
fn group_runs(out: &mut [f32], c0: usize, group: usize, mut f: impl FnMut(usize, &mut [f32])) {
    let (mut rest, mut c) = (out, c0);
    while !rest.is_empty() {
        let n = (group - c % group).min(rest.len());
        let (run, tail) = std::mem::take(&mut rest).split_at_mut(n);
        f(c, run);
        rest = tail;
        c += n;
    }
}

fn dequant_q8g(m: &MatRef<'_>, r: usize, c0: usize, out: &mut [f32]) {
    let (rb, sc) = (row(m, r), &m.scales[r * m.groups()..]);
    group_runs(out, c0, m.group, |c, run| {
        let (scale, n) = (f16_to_f32(sc[c / m.group]), run.len());
        for (o, &q) in run.iter_mut().zip(&rb[c..c + n]) {
            *o = (q as i8) as f32 * scale;
        }
    });
}

fn dequant_q4g(m: &MatRef<'_>, r: usize, c0: usize, out: &mut [f32]) {
    let (rb, sc) = (row(m, r), &m.scales[r * m.groups()..]);
    let w = |nib: u8, scale: f32| (nib as i32 - 8) as f32 * scale;
    group_runs(out, c0, m.group, |c, run| {
        let scale = f16_to_f32(sc[c / m.group]);
        let n = run.len();
        // an odd first column is a high nibble; then whole bytes (low,
        // high: a loop the compiler vectorizes); then a low one
        let lead = c % 2;
        if lead == 1 {
            run[0] = w(rb[c / 2] >> 4, scale);
        }
        let pairs = (n - lead) / 2;
        let bytes = &rb[(c + lead) / 2..(c + lead) / 2 + pairs];
        for (o, &b) in run[lead..lead + 2 * pairs].chunks_exact_mut(2).zip(bytes) {
            o[0] = w(b & 15, scale);
            o[1] = w(b >> 4, scale);
        }
        if lead + 2 * pairs < n {
            run[n - 1] = w(rb[(c + n - 1) / 2] & 15, scale);
        }
    });
}

fn encode_f32(v: &[f32], _: usize, _: usize, _: usize) -> Result<Encoded, EncodeError> {
    Ok((v.iter().flat_map(|x| x.to_le_bytes()).collect(), Vec::new()))
}

fn encode_halves(v: &[f32], cv: fn(f32) -> u16, exponent: u16) -> Result<Encoded, EncodeError> {
    let h: Vec<u16> = v.iter().map(|&x| cv(x)).collect();
    // a finite value that rounds to an infinity is beyond the format's range
    if let Some(i) = h.iter().zip(v).position(|(&h, x)| h & exponent == exponent && x.is_finite()) {
        return Err(EncodeError::Value(i));
    }
    Ok((h.iter().flat_map(|x| x.to_le_bytes()).collect(), Vec::new()))
}

fn encode_f16(v: &[f32], _: usize, _: usize, _: usize) -> Result<Encoded, EncodeError> {
    encode_halves(v, f32_to_f16, 0x7C00)
}

fn encode_bf16(v: &[f32], _: usize, _: usize, _: usize) -> Result<Encoded, EncodeError> {
    encode_halves(v, f32_to_bf16, 0x7F80)
}

fn encode_grouped<const BITS: u32>(v: &[f32], rows: usize, cols: usize, group: usize) -> Result<Encoded, EncodeError> {
    let fmt = if BITS == 8 { Fmt::Q8G } else { Fmt::Q4G };
    let (d, s) = crate::group::quantize_groups(fmt, rows, cols, group, v);
    if let Some(i) = waste_format::half::first_non_finite_f16(&s) {
        let g = fmt.groups_per_row(cols as u64, group as u64) as usize;
        return Err(EncodeError::Scale { row: i / g, group: i % g });
    }
    Ok((d, s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SplitMix64;

    /// Every registered format: its encoder's output decodes (through the
    /// registered definition) to values within the format's error, its
    /// sizes are `Fmt`'s, and each level it names computes matvec and
    /// matmat bit-identical to the scalar definition (the levels this CPU
    /// has; the others are listed as skipped by the cross-level suites).
    #[test]
    fn every_registered_format_round_trips_and_every_level_equals_the_definition() {
        let mut rng = SplitMix64::new(17);
        for f in &TENSOR_FORMATS {
            assert_eq!(tensor_format(f.fmt).fmt, f.fmt);
            for (rows, cols, group) in [(5usize, 70usize, 32usize), (9, 256, 128), (3, 33, 2)] {
                let v: Vec<f32> = (0..rows * cols).map(|_| rng.unif() * 4.0 - 2.0).collect();
                let (data, scale_bytes) = (f.encode)(&v, rows, cols, group).unwrap();
                let g = if f.fmt.is_grouped() { group } else { 0 };
                assert_eq!(data.len() as u64, rows as u64 * f.fmt.row_bytes(cols as u64, g as u64), "{:?}", f.fmt);
                let m = crate::Matrix::from_stored(f.fmt, rows, cols, g, data, &scale_bytes).unwrap();
                let back = m.to_f32();
                // the format's error: exact for f32, half's rounding, or half a quantization step
                for (i, (&a, &b)) in v.iter().zip(&back).enumerate() {
                    let tol = match f.fmt {
                        Fmt::F32 => 0.0,
                        Fmt::F16 => 2e-3,
                        Fmt::Bf16 => 1e-2,
                        Fmt::Q8G => 2.0 / 127.0,
                        Fmt::Q4G => 2.0 / 7.0,
                    };
                    assert!((a - b).abs() <= tol, "{:?} [{i}]: {a} → {b}", f.fmt);
                }
                let x: Vec<f32> = (0..cols).map(|_| rng.unif() - 0.5).collect();
                let view = m.view();
                let want: Vec<u32> = (0..rows).map(|r| view.row_dot_scalar(r, &x).to_bits()).collect();
                for &level in f.kernels.iter().filter(|l| l.supported()) {
                    let mut y = vec![0f32; rows];
                    view.matvec_rows(level, &x, 0, &mut y);
                    assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "{:?} at {level:?}", f.fmt);
                    let xs: Vec<f32> = x.iter().chain(&x).copied().collect();
                    let mut ys = vec![0f32; 2 * rows];
                    // SAFETY: ys holds 2 × rows outputs; nothing else touches it.
                    unsafe { view.matmat_rows(level, &xs, 2, 0, rows, ys.as_mut_ptr(), rows) };
                    for t in 0..2 {
                        let got: Vec<u32> = ys[t * rows..(t + 1) * rows].iter().map(|v| v.to_bits()).collect();
                        assert_eq!(got, want, "{:?} matmat at {level:?}", f.fmt);
                    }
                }
            }
        }
    }

    #[test]
    fn values_beyond_a_format_are_refused_naming_them() {
        let big = [1.0f32, 1e6, 3.0];
        assert_eq!(encode_f16(&big, 1, 3, 0), Err(EncodeError::Value(1)));
        assert!(encode_bf16(&big, 1, 3, 0).is_ok());
        let huge = [1.0f32, 1e9, 3.0, 4.0];
        assert_eq!(encode_grouped::<8>(&huge, 2, 2, 2), Err(EncodeError::Scale { row: 0, group: 0 }));
    }
}
