//! Runtime SIMD dispatch: detected once, overridable with `WASTE_SIMD`.

use std::sync::OnceLock;

/// A SIMD implementation level. Every level computes bit-identical results
/// (the scalar code follows the same canonical lane and reduction order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Portable reference.
    Scalar,
    /// x86_64 AVX2 + FMA + F16C.
    Avx2,
    /// x86_64 AVX-512 F/BW/VL (with AVX2 + FMA + F16C): its own trunk
    /// matvec; every other kernel is the AVX2 one (all levels are
    /// bit-identical, so mixing them is exact).
    Avx512,
    /// AArch64 Advanced SIMD (baseline on every aarch64 CPU; no optional
    /// extension is used — see `aarch64/neon.rs` for why).
    Neon,
}

impl Level {
    /// Every level this crate knows, lowest first (whether or not the CPU has it).
    pub const ALL: [Level; 4] = [Level::Scalar, Level::Avx2, Level::Avx512, Level::Neon];

    /// Whether the test suite requires this level on this architecture: a
    /// machine that lacks it cannot vouch for the kernels CI ships (scalar
    /// always; AVX2 on x86_64; NEON on aarch64). Optional levels are reported
    /// as skipped.
    pub fn required(self) -> bool {
        match self {
            Level::Scalar => true,
            Level::Avx2 => cfg!(target_arch = "x86_64"),
            Level::Avx512 => false,
            Level::Neon => cfg!(target_arch = "aarch64"),
        }
    }

    /// Name as accepted by `WASTE_SIMD`.
    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Neon => "neon",
        }
    }
    /// Whether this CPU can run the level.
    pub fn supported(self) -> bool {
        match self {
            Level::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => {
                Level::Avx2.supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Level::Avx2 | Level::Avx512 => false,
            #[cfg(target_arch = "aarch64")]
            Level::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(not(target_arch = "aarch64"))]
            Level::Neon => false,
        }
    }
    /// Whether this level runs the AVX2 kernels (AVX2 itself, and AVX-512 for
    /// the kernels it has no own version of) and the CPU has them.
    pub fn avx2_kernels(self) -> bool {
        matches!(self, Level::Avx2 | Level::Avx512) && Level::Avx2.supported()
    }

    /// Whether this level runs the NEON kernels and the CPU has them.
    pub fn neon_kernels(self) -> bool {
        self == Level::Neon && Level::Neon.supported()
    }

    /// Every level this CPU can run, lowest first.
    pub fn available() -> Vec<Level> {
        Level::ALL.into_iter().filter(|l| l.supported()).collect()
    }
    /// Parse a `WASTE_SIMD` value.
    pub fn parse(s: &str) -> Option<Level> {
        match s {
            "scalar" => Some(Level::Scalar),
            "avx2" => Some(Level::Avx2),
            "avx512" => Some(Level::Avx512),
            "neon" => Some(Level::Neon),
            _ => None,
        }
    }
}

static LEVEL: OnceLock<Level> = OnceLock::new();

/// The level in use: the best the CPU supports, or `WASTE_SIMD` if it names
/// a supported level (an unsupported or unknown value falls back to the best).
pub fn level() -> Level {
    *LEVEL.get_or_init(|| {
        let best = *Level::available().last().unwrap_or(&Level::Scalar);
        match std::env::var("WASTE_SIMD").ok().as_deref().and_then(Level::parse) {
            Some(l) if l.supported() => l,
            _ => best,
        }
    })
}
