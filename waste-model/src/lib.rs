//! # waste-model
//!
//! The WASTE engine: opens a container, keeps the dense trunk resident,
//! streams routed experts from disk, and computes logits exactly as the
//! reference implementations do. The CLI and the server are clients of this
//! API with no private access.
//!
//! ```no_run
//! # fn example() -> waste_model::Result<()> {
//! let report = waste_model::verify(std::path::Path::new("model.waste"), Default::default(), &|_, _| {})?;
//! assert!(report.problems.is_empty());
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

mod error;
mod verify;

pub use error::{ConstraintError, Error, NonFiniteAt, Result};
pub use verify::{verify, VerifyOptions, VerifyReport, MAX_VERIFY_READ};
pub use waste_format as format;

/// Engine version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Version and build facts.
#[derive(Clone, Debug)]
pub struct BuildInfo {
    /// Engine version.
    pub version: &'static str,
    /// SIMD level in use (`WASTE_SIMD` can force a lower one).
    pub simd: &'static str,
    /// SIMD levels this CPU supports.
    pub simd_available: Vec<&'static str>,
    /// Container format version read and written.
    pub format_version: u64,
    /// The numeric mode a model opened with default options computes in
    /// at [`BuildInfo::simd`] ([`default_numeric`]), or why there is none
    /// (`WASTE_NUMERIC` holding neither `exact` nor `fast`).
    pub numeric: String,
    /// Whether the fast mode's AVX2 matmats and matvecs take AVX-VNNI at
    /// [`BuildInfo::simd`] (Intel cores with it and without AVX-512;
    /// `WASTE_AVX_VNNI=0` turns it off).
    pub avx_vnni: bool,
}

/// Version and build facts.
pub fn build_info() -> BuildInfo {
    BuildInfo {
        version: VERSION,
        simd: waste_quant::level().name(),
        simd_available: waste_quant::Level::available().iter().map(|l| l.name()).collect(),
        format_version: waste_format::FORMAT_VERSION,
        numeric: default_numeric(waste_quant::level()).map_or_else(|e| e.to_string(), |n| n.name().to_string()),
        avx_vnni: waste_quant::fast::matmat_uses_avx_vnni(waste_quant::level()),
    }
}

mod compute;
mod generate;
pub mod halves;
mod model;
mod plan;
pub mod quality;
mod sample;
mod session;
mod state;
mod vision;
mod weights;

pub use compute::{ComputeBound, PrefillShape};
pub use generate::{
    Control, Finish, GenerateParams, Generation, Generator, Pick, TokenConstraint, TokenEvent, MARK_CLOSE, MARK_OPEN,
    NO_TOKEN,
};
pub use model::{
    default_numeric, expert_wave, halves_for, lookahead_for, prefill_span, Model, ModelOptions, AUTO_LOOKAHEAD,
    MAX_IO_THREADS, MAX_THREADS_PER_CORE, MIN_SPAN_CHUNKS,
};
pub use plan::{
    head_bytes, head_piece_bytes, layer_bytes, layer_read_bytes, plan, split, Plan, Split, GRAMMAR_BYTES_PER_TOKEN,
    HEAD_PIECE_BYTES, MAX_CTX, MAX_PARALLEL,
};
pub use plan::{CHUNK, MAX_CHUNK};
pub use sample::{argmax, log_softmax, Sampler, SamplingParams};
pub use session::span::SPAN_TOKENS;
pub use session::{Session, Stats};
pub use state::{Snapshot, STATE_MAGIC, STATE_VERSION};
pub use vision::{digest, Grid, Image, ImageInfo, PreparedImage, VisionConfig};
pub use waste_attn::{attn_res, attn_res_in_place};
pub use waste_cache::{parse_size, physical_ram, usable_ram, CacheError, CacheStats, Policy};
pub use waste_quant::fast::Numeric;
pub use waste_tokenizer as tokenizer;
/// The vision crate's errors, inside [`Error::Vision`].
pub use waste_vision::Error as VisionError;
/// The largest image file accepted (bytes).
pub use waste_vision::MAX_FILE_BYTES as MAX_IMAGE_FILE_BYTES;

/// In-place softmax (probabilities from logits).
pub fn softmax_in_place(x: &mut [f32]) {
    waste_quant::ops::softmax(x)
}
/// Direct I/O and the disk probe.
pub use waste_io as io;

/// Resolve a RAM budget for a plan (0 = the default rule) against usable RAM.
///
/// # Errors
/// [`waste_cache::BelowFloor`] when an explicit budget is below the floor.
pub fn resolve_budget(
    p: &Plan,
    budget: u64,
    usable: u64,
) -> std::result::Result<waste_cache::Budget, waste_cache::BelowFloor> {
    waste_cache::resolve(&p.floor(), budget, usable)
}
