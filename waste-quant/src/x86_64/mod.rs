//! x86_64 SIMD kernels (one module per ISA, same functions as `scalar`).
pub mod avx2;
pub mod avx512;
