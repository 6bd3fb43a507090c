//! # waste-rng
//!
//! The project's one seeded generator: SplitMix64 (Steele, Lea and Flood,
//! "Fast splittable pseudorandom number generators", OOPSLA 2014) — used by
//! the VQ encoder, token sampling, the expert cache's victim sampling and
//! synthetic containers. Not for anything secret.
#![deny(missing_docs)]

/// SplitMix64: a 64-bit state advanced by the golden-ratio increment, each
/// output mixed by two multiply-xorshift rounds.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator whose sequence is fixed by `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }
    /// A generator for a named stream of a seed (FNV-1a of the name mixed in).
    pub fn for_name(seed: u64, name: &str) -> SplitMix64 {
        let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        SplitMix64(seed ^ h)
    }
    /// Next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1) with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [0, 1) with 24 bits.
    pub fn unif(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in `0..n` (`n ≥ 1`; modulo bias is below 2⁻⁴⁰ for the sizes used).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
    /// Standard normal (Box–Muller).
    pub fn gauss(&mut self) -> f32 {
        let u = self.unif().max(1e-7);
        let v = self.unif();
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
    /// Fill bytes.
    pub fn fill(&mut self, b: &mut [u8]) {
        let mut ch = b.chunks_exact_mut(8);
        for c in &mut ch {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let r = ch.into_remainder();
        let last = self.next_u64().to_le_bytes();
        let n = r.len();
        r.copy_from_slice(&last[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_splitmix64_sequence() {
        // the reference implementation's first outputs for seed 1234567
        // (Vigna's splitmix64.c, as used to seed xoshiro)
        let mut r = SplitMix64::new(1234567);
        let want = [6457827717110365317u64, 3203168211198807973, 9817491932198370423, 4593380528125082431];
        for w in want {
            assert_eq!(r.next_u64(), w);
        }
    }

    #[test]
    fn helpers_stay_in_range() {
        let mut r = SplitMix64::for_name(7, "x");
        for _ in 0..1000 {
            let u = r.unif();
            assert!((0.0..1.0).contains(&u));
            assert!(r.below(3) < 3);
            assert!(r.gauss().is_finite());
        }
        let mut b = [0u8; 13];
        r.fill(&mut b);
        assert!(b.iter().any(|&x| x != 0));
    }
}
