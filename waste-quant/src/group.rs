//! Group quantization for the trunk formats (Q8G, Q4G): the encoder the
//! converter and synthetic containers use; `matrix.rs` holds the decoders.

use waste_format::half::{f16_to_f32, f32_to_f16};
use waste_format::Fmt;

/// Quantize a row-major f32 matrix into group format (`Q8G`/`Q4G`), round-to-nearest per group.
pub fn quantize_groups(fmt: Fmt, rows: usize, cols: usize, group: usize, w: &[f32]) -> (Vec<u8>, Vec<u8>) {
    let np = cols.div_ceil(group) * group;
    let (qmax, rb) = if fmt == Fmt::Q8G { (127.0f32, np) } else { (7.0f32, np / 2) };
    let mut data = vec![0u8; rows * rb];
    let mut scales = Vec::with_capacity(rows * np / group * 2);
    for r in 0..rows {
        for g in 0..np / group {
            let c0 = g * group;
            let c1 = (c0 + group).min(cols);
            let amax = (c0..c1).map(|c| w[r * cols + c].abs()).fold(0f32, f32::max);
            let sh = f32_to_f16(if amax > 0.0 { amax / qmax } else { 0.0 });
            let s = f16_to_f32(sh);
            scales.extend_from_slice(&sh.to_le_bytes());
            for c in c0..c0 + group {
                let v =
                    if c < c1 && s > 0.0 { (w[r * cols + c] / s).round().clamp(-qmax - 1.0, qmax) as i32 } else { 0 };
                if fmt == Fmt::Q8G {
                    data[r * rb + c] = v as i8 as u8;
                } else {
                    let nib = (v + 8) as u8 & 15;
                    data[r * rb + c / 2] |= if c % 2 == 0 { nib } else { nib << 4 };
                }
            }
        }
    }
    (data, scales)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Matrix;

    #[test]
    fn decodes_within_half_a_step() {
        for fmt in [Fmt::Q8G, Fmt::Q4G] {
            let (rows, cols, g) = (3, 70, 32);
            let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
            let (d, s) = quantize_groups(fmt, rows, cols, g, &w);
            let m = Matrix::from_stored(fmt, rows, cols, g, d, &s).unwrap();
            let back = m.to_f32();
            let qmax = if fmt == Fmt::Q8G { 127.0 } else { 7.0 };
            for r in 0..rows {
                for c in 0..cols {
                    let g0 = c / g * g;
                    let amax = (g0..(g0 + g).min(cols)).map(|k| w[r * cols + k].abs()).fold(0f32, f32::max);
                    let step = amax / qmax;
                    assert!(
                        (back[r * cols + c] - w[r * cols + c]).abs() <= 0.5 * step * 1.01 + 1e-6,
                        "{fmt:?} {r},{c}"
                    );
                }
            }
        }
    }
}
