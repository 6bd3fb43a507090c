//! safetensors (bf16/f16/f32/MXFP4) to WASTE container converter.
#![deny(missing_docs)]
