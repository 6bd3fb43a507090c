//! Tensor formats (F32/F16/BF16/Q8G/Q4G/VQ3R/VQ2R/VQ4P): scalar reference decoders and SIMD matvec kernels with runtime dispatch.
#![deny(missing_docs)]
