//! # waste-format
//!
//! The WASTE container format v0 — the on-disk layout the C WASTE 0.6
//! writes, so containers open unchanged in either engine. This crate reads
//! and writes it; it has no I/O policy (direct I/O lives in `waste-io`).
//!
//! Everything read is untrusted: every dimension is bounded, every offset
//! checked against the file that holds it, every product checked for
//! overflow, and every failure names the key, tensor, layer or expert.
//!
//! ```no_run
//! # fn example() -> waste_format::Result<()> {
//! let c = waste_format::Container::open("model.waste")?;
//! println!("{} layers, {} experts, {}", c.config.layers, c.config.experts, c.quant_summary());
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod arch;
mod codebook;
mod config;
mod container;
mod error;
mod fsutil;
pub mod half;
mod manifest;
mod record;
mod schema;
mod tensor;
mod usage;
mod writer;

pub use arch::{Architecture, Family};
pub use codebook::{Codebooks, CODEBOOK_HEADER_LEN, CODEBOOK_MAGIC};
pub use config::{flatten_text_config, limits, Activation, AttnKind, ModelConfig};
pub use container::{is_vision_tensor, Bank, Container, ParamCounts};
pub use error::{Error, Result};
pub use fsutil::{read_regular, replace_own, staging_dir, write_atomic};
pub use manifest::{LayerEntry, Manifest, FORMAT_VERSION, MAX_MANIFEST_BYTES};
pub use record::{
    check_record, record_crc, ExpertFmt, ExpertFormatSpec, ExpertQuant, ExpertQuantEntry, RecordHeader, RecordLayout,
    EXPERT_FORMATS, HEADER_LEN, PAGE, Q4G_GROUP, RECORD_MAGIC,
};
pub use schema::{required_tensors, Expect, Required};
pub use tensor::{Fmt, TensorEntry, TensorInfo};
pub use usage::{Usage, UsageEntry, USAGE_MAGIC, USAGE_VERSION};
pub use writer::{seal_record, write_manifest, BankWriter, TrunkWriter};
