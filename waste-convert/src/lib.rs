//! # waste-convert
//!
//! Hugging Face-style weights (safetensors in bf16, f16, f32 or MXFP4) to a
//! WASTE v0 container, with no Python: streaming one tensor at a time,
//! residual-VQ experts (k-means codebooks per layer, kind and stage fitted on
//! a sample of experts, then each expert encoded on its own) or exact
//! F16/BF16 experts, a Q4G/Q8G/F16/F32 trunk, resumable per layer,
//! deterministic for a seed, manifest written last and atomically.
//!
//! ```no_run
//! # fn example() -> waste_convert::Result<()> {
//! let opts = waste_convert::ConvertOptions::default();
//! let report = waste_convert::convert("hf-model/".as_ref(), "model.waste".as_ref(), &opts, &|_| {})?;
//! println!("{:?}", report.rel_error);
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod convert;
mod names;
mod source;

pub use convert::{convert, verify_against_source, ConvertOptions, Progress, Report, TrunkMode};
pub use source::{decode_mxfp4, e2m1, e8m0, Source, TensorLoc};

/// Errors of the converter.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The source directory is malformed or lacks a tensor.
    #[error("source: {0}")]
    Source(String),
    /// A container-side error.
    #[error(transparent)]
    Format(#[from] waste_format::Error),
    /// I/O on a named file.
    #[error("{path}: {source}")]
    Io {
        /// File.
        path: std::path::PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// Bad options.
    #[error("invalid argument: {0}")]
    Arg(String),
    /// Stopped on request (tests of resumption).
    #[error("conversion interrupted after {0} layer(s)")]
    Interrupted(usize),
}

impl Error {
    pub(crate) fn io(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
