//! Exact half-precision conversions (subnormals are values, never flushed): the
//! container stores scales and codebooks as IEEE binary16.

/// IEEE binary16 bits to f32 (exact; subnormals = mantissa · 2^-24).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // subnormal: value = m · 2^-24, exact in f32
            let v = m as f32 * f32::from_bits(0x3380_0000); // 2^-24
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// f32 to IEEE binary16 bits, round to nearest even (overflow → ±inf).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rem = m & ((1 << shift) - 1);
        let mut r = m >> shift;
        if rem > half || (rem == half && r & 1 == 1) {
            r += 1;
        }
        return sign | r as u16;
    }
    let rem = man & 0x1fff;
    let mut r = ((e as u32) << 10) | (man >> 13);
    if rem > 0x1000 || (rem == 0x1000 && r & 1 == 1) {
        r += 1; // may carry into the exponent, correctly rounding up to inf
    }
    sign | r as u16
}

/// Whether f16 bits are a finite value (its exponent is not all ones:
/// neither an infinity nor a NaN).
pub fn f16_is_finite(h: u16) -> bool {
    h & 0x7C00 != 0x7C00
}

/// The index of the first non-finite f16 in little-endian bytes.
pub fn first_non_finite_f16(bytes: &[u8]) -> Option<usize> {
    bytes.chunks_exact(2).position(|c| !f16_is_finite(u16::from_le_bytes([c[0], c[1]])))
}

/// bfloat16 bits to f32 (exact).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 to bfloat16 bits, round to nearest even (NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    ((b + round) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_halves_roundtrip_exactly() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_nan() {
                assert!(f16_to_f32(f32_to_f16(f)).is_nan());
            } else {
                assert_eq!(f32_to_f16(f), h, "h={h:#x} f={f}");
            }
        }
        assert_eq!(f16_to_f32(1), 5.960_464_5e-8);
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
    }

    #[test]
    fn rounding_is_nearest_even() {
        // 1 + 2^-11 is halfway between 1 and 1+2^-10: ties to even (1.0)
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00);
        assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
    }

    #[test]
    fn finite_means_the_exponent_is_not_all_ones() {
        for h in [0x0000u16, 0x8000, 0x0001, 0x03FF, 0x7BFF, 0xFBFF, 0x3C00] {
            assert!(f16_is_finite(h) && f16_to_f32(h).is_finite(), "{h:04x}");
        }
        for h in [0x7C00u16, 0xFC00, 0x7C01, 0x7E00, 0xFFFF] {
            assert!(!f16_is_finite(h) && !f16_to_f32(h).is_finite(), "{h:04x}");
        }
        assert_eq!(first_non_finite_f16(&[0, 0x3C, 0x01, 0x7C, 0, 0x7C]), Some(1));
        assert_eq!(first_non_finite_f16(&[0xFF, 0x7B]), None);
    }
}
