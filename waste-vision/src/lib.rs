//! # waste-vision
//!
//! Kimi K3's vision tower, loaded only when images are enabled: images are
//! read header first (format and size checked before a pixel is decoded),
//! decoded (PNG, JPEG, WebP, GIF's first frame), cut into a patch grid of at
//! most `max_patches` 14-pixel patches with the aspect kept, normalised, and
//! run through the ViT (27 blocks of RMSNorm, packed q/k/v, 2-D RoPE,
//! bidirectional attention, GELU-tanh MLP), the 2×2 merge and the projector
//! into the text model's embedding space: one row per sequence position.
//!
//! ```no_run
//! # fn example(cfg: &waste_vision::VisionConfig, tower: &waste_vision::Tower, bytes: &[u8]) -> waste_vision::Result<()> {
//! let info = waste_vision::probe(bytes)?; // header only
//! let px = waste_vision::preprocess(cfg, bytes)?;
//! let rows = tower.encode(&waste_quant::Pool::new(2), &px)?;
//! assert_eq!(rows.len(), px.grid.positions() * cfg.text_hidden);
//! # let _ = info; Ok(()) }
//! ```
#![deny(missing_docs)]

mod config;
mod image;
mod tower;

pub use config::{VisionConfig, MAX_PATCHES_LIMIT, PATCH, PATCH_VALUES, PROJ_EPS, TOWER_EPS};
pub use image::{
    from_rgb8, grid, max_preprocess_bytes, preprocess, preprocess_bytes, probe, Grid, ImageInfo, Pixels, MAX_ASPECT,
    MAX_DECODE_ALLOC, MAX_FILE_BYTES, MAX_PIXELS,
};
pub use tower::{conv_patch_bytes, gelu_erf, gelu_tanh, Loader, Tower};

/// Errors of the vision crate; each names what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// `vision.json` is malformed or out of range.
    #[error("vision.json: {0}")]
    Config(String),
    /// A tower tensor is missing or has the wrong shape.
    #[error("vision weights: {0}")]
    Weights(String),
    /// The image cannot be used (format, size, damage).
    #[error("image: {0}")]
    Image(String),
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
