//! aarch64 SIMD kernels (one module per ISA, same functions as `scalar`).
pub mod fast;
pub mod neon;
pub mod vq_fast;
