//! # waste-quant
//!
//! The tensor formats of the WASTE container and their kernels: exact
//! scalar reference decoders, matrix-vector products for the trunk formats
//! (F32, F16, BF16, Q8G, Q4G) and lookup-table products for the VQ expert
//! formats (VQ3R, VQ2R, VQ4P), with runtime SIMD dispatch through
//! `core::arch` (`WASTE_SIMD=scalar|avx2|avx512|neon` forces a level); the
//! group quantizer and the residual-VQ encoder for the converter; the
//! project's one seeded generator ([`SplitMix64`]).
//!
//! **Exactness.** Every SIMD kernel is bit-identical to the scalar one: the
//! scalar code defines a canonical order (32 fused-multiply-add lanes and a
//! halving reduction for dot products; in-order sums for VQ rows) that the
//! vector code reproduces exactly, so a model's logits do not depend on the
//! machine's SIMD level.
//!
//! ```
//! use waste_quant::{level, Matrix};
//! use waste_format::Fmt;
//! let w = Matrix::from_stored(Fmt::F32, 1, 2, 0, [1f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect(), &[]).unwrap();
//! let mut y = [0f32];
//! w.view().matvec_rows(level(), &[3.0, 4.0], 0, &mut y);
//! assert_eq!(y[0], 11.0);
//! ```
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

/// A scalar function whose body uses `mul_add`, compiled twice: as written,
/// and with the FMA target feature for x86_64 CPUs that have it (chosen at
/// each call). x86_64's baseline has no FMA, so there `mul_add` is a libm
/// call per product; with the feature it is the instruction. The same
/// fused operations in the same order either way: the same bits.
/// Exported for the crates whose scalar definitions need the same
/// (`waste-attn`'s delta-rule rows).
#[macro_export]
macro_rules! fma_scalar {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $crate::fma_scalar! { $(#[$m])* $vis fn $name($($arg: $ty),*) -> () $body }
    };
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "fma")]
            unsafe fn with_fma($($arg: $ty),*) -> $ret {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has FMA.
                return unsafe { with_fma($($arg),*) };
            }
            body($($arg),*)
        }
    };
}

#[cfg(target_arch = "aarch64")]
mod aarch64;
pub mod fast;
pub mod formats;
mod group;
mod level;
mod matrix;
pub mod scalar;
pub mod vq;
pub mod vq_fast;
pub mod vq_loads;
#[cfg(target_arch = "x86_64")]
mod x86_64;

pub use group::quantize_groups;
pub use level::{level, Level};
pub use matrix::{MatRef, Matrix, Payload, ShapeError};
pub use vq::{VqBook, VqLayout};
pub use waste_format::half::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
pub use waste_rng::SplitMix64;
mod pool;
pub use pool::{MatJob, Pool, SyncSlice};

/// View an f32 slice as an F32 matrix `[rows, cols]` (e.g. a KV cache).
pub fn f32_matrix(rows: usize, cols: usize, data: &[f32]) -> MatRef<'_> {
    MatRef {
        fmt: waste_format::Fmt::F32,
        rows,
        cols,
        group: 0,
        data: bytemuck::cast_slice(&data[..rows * cols]),
        scales: &[],
    }
}
pub mod ops;
pub mod vq_encode;
