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
mod vision;

pub use convert::{
    convert, verify_against_source, ConvertOptions, HeadMode, Progress, Report, TrunkMode, MAX_JOBS, MAX_KMEANS_ITERS,
};
pub use source::{
    decode_mxfp4, e2m1, e8m0, parse_header, read_bounded, read_json, Source, TensorLoc, MAX_HEADER_BYTES,
    MAX_JSON_BYTES, MAX_TEMPLATE_BYTES, MAX_TOKENIZER_BYTES,
};
pub use vision::VisionMode;
/// The folder an unfinished conversion into `out` works in (`<out>.partial`).
pub use waste_format::staging_dir;

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
    /// Encoding the experts failed outside the math: a thread the OS
    /// refused, a job that panicked, a bank short of experts. Nothing of
    /// the layer is kept.
    #[error("expert encoding: {0}")]
    Encoder(String),
    /// Stopped on request (tests of resumption).
    #[error("conversion interrupted after {0} layer(s)")]
    Interrupted(usize),
    /// `--out` and `--src` overlap (equal, or one inside the other).
    #[error("--out {out} and --src {src} overlap: the output must be outside the source and not contain it")]
    Overlap {
        /// Source folder.
        src: std::path::PathBuf,
        /// Output folder.
        out: std::path::PathBuf,
    },
    /// `--out` exists and is not empty: nothing is overwritten.
    #[error("{0} exists and is not empty; choose another --out (nothing was changed)")]
    OutputExists(std::path::PathBuf),
    /// An unfinished conversion with other options or another source is in
    /// the staging folder.
    #[error("{dir} holds an unfinished conversion with {differs}; run with the same options to resume, or --force to start over")]
    ResumeMismatch {
        /// Staging folder.
        dir: std::path::PathBuf,
        /// What differs, e.g. `trunk "q8" (now "f32")`.
        differs: String,
    },
    /// The staging folder exists but was not made by `waste convert`.
    #[error("{0} exists but is not an unfinished conversion (no fingerprint); remove it or choose another --out")]
    ForeignStaging(std::path::PathBuf),
}

impl Error {
    pub(crate) fn io(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
