//! Images for Kimi K3: the vision tower loaded when asked, images encoded
//! into embedding rows, and the prompt markup that announces them.

use crate::weights::TrunkReader;
use crate::{Error, Model, Result};
use waste_format::Container;
pub use waste_vision::{Grid, ImageInfo, VisionConfig};

/// An image encoded for the text model: one embedding row per sequence
/// position, queued on a session with [`crate::Session::add_image`] and
/// spliced in at the next `<|media_pad|>` placeholder.
#[derive(Clone, Debug, PartialEq)]
pub struct Image {
    /// The image file's own width (before any resize).
    pub width: u32,
    /// The image file's own height.
    pub height: u32,
    /// Its patch grid.
    pub grid: Grid,
    pub(crate) rows: Vec<f32>,
    key: u64,
}

impl Image {
    /// Sequence positions the image takes: `(gw/2)·(gh/2)`.
    pub fn positions(&self) -> usize {
        self.grid.positions()
    }
    /// The embedding rows, `positions × hidden`.
    pub fn rows(&self) -> &[f32] {
        &self.rows
    }
    /// A 64-bit digest of the encoded image file's bytes (for prefix reuse).
    pub fn key(&self) -> u64 {
        self.key
    }
}

/// A decoded image cut into patches, ready for the tower.
#[derive(Clone, Debug)]
pub struct PreparedImage {
    pixels: waste_vision::Pixels,
    key: u64,
}

impl PreparedImage {
    /// Sequence positions the image will take.
    pub fn positions(&self) -> usize {
        self.pixels.grid.positions()
    }
    /// The image file's `(width, height)`.
    pub fn size(&self) -> (u32, u32) {
        (self.pixels.width, self.pixels.height)
    }
    /// Heap bytes the prepared image holds (its patches).
    pub fn heap_bytes(&self) -> usize {
        self.pixels.patches.capacity() * std::mem::size_of::<f32>()
    }
    /// [`digest`] of the image file's bytes.
    pub fn key(&self) -> u64 {
        self.key
    }
}

/// FNV-1a 64 of a byte string.
pub fn digest(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &x in b {
        h = (h ^ x as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// The loaded tower with its configuration.
pub(crate) struct Vision {
    pub(crate) tower: waste_vision::Tower,
}

/// `vision.json` of a container, if it has one, validated against its text model.
///
/// # Errors
/// [`Error::Vision`] for a malformed file, [`Error::Format`] when it cannot be read.
pub(crate) fn config(c: &Container) -> Result<Option<VisionConfig>> {
    let p = c.dir.join("vision.json");
    if !p.exists() {
        return Ok(None);
    }
    let b = waste_format::read_regular(&p, 1 << 20).map_err(|e| waste_format::Error::io(&p, e))?;
    let v: serde_json::Value =
        serde_json::from_slice(&b).map_err(|e| waste_vision::Error::Config(format!("not JSON: {e}")))?;
    Ok(Some(VisionConfig::from_json(&v, c.config.hidden, c.config.vocab)?))
}

/// Bytes the tower's weights take once loaded (matrices as stored, vectors
/// and the position grid as f32), from the manifest alone.
pub(crate) fn weight_bytes(c: &Container, v: &VisionConfig) -> u64 {
    v.tensors()
        .iter()
        .map(|(name, rows, cols)| match c.tensors.get(name) {
            Some(t) if *rows > 1 && !name.contains("pos_emb") => {
                waste_vision::conv_patch_bytes(&t.shape, t.fmt.is_grouped()).unwrap_or(t.payload_len + t.scale_len)
            }
            _ => 4 * (*rows * *cols) as u64,
        })
        .sum()
}

/// Load the tower through the trunk reader (its I/O errors kept as they are).
pub(crate) fn load(v: &VisionConfig, r: &mut TrunkReader<'_>) -> Result<Vision> {
    let mut err = None;
    let tower = waste_vision::Tower::load(v, &mut |name: &str| {
        r.matrix_full(name).map_err(|e| {
            let m = e.to_string();
            err = Some(e);
            waste_vision::Error::Weights(m)
        })
    });
    match (tower, err) {
        (Ok(tower), _) => Ok(Vision { tower }),
        (Err(_), Some(e)) => Err(e),
        (Err(e), None) => Err(e.into()),
    }
}

impl Model {
    /// The vision tower's configuration, when images are enabled
    /// ([`crate::ModelOptions::vision`]) and the container has a tower.
    pub fn vision(&self) -> Option<&VisionConfig> {
        self.vision.as_ref().map(|v| v.tower.config())
    }

    /// Why the vision tower asked for did not load, when the model opened
    /// text-only because of it ([`crate::ModelOptions::vision_optional`]).
    pub fn vision_error(&self) -> Option<&str> {
        self.vision_error.as_deref()
    }

    fn vision_or_err(&self) -> Result<&Vision> {
        self.vision.as_ref().ok_or_else(|| {
            Error::Unsupported(if let Some(e) = &self.vision_error {
                format!("images: the vision tower could not load ({e}); this model runs text only")
            } else if self.plan().vision_weight_bytes > 0 {
                "images: open the model with images enabled (ModelOptions::vision, --image)".into()
            } else {
                "images: this model has no vision tower".into()
            })
        })
    }

    /// Read an image's header only: format and size, checked against the limits.
    ///
    /// # Errors
    /// [`Error::Vision`] naming what is wrong (format, size, pixel count, aspect ratio).
    pub fn image_info(&self, bytes: &[u8]) -> Result<ImageInfo> {
        Ok(waste_vision::probe(bytes)?)
    }

    /// Sequence positions an image will take, from its header alone.
    ///
    /// # Errors
    /// As [`Model::image_info`], and [`Error::Unsupported`] without a loaded tower.
    pub fn image_positions(&self, bytes: &[u8]) -> Result<usize> {
        let v = self.vision_or_err()?;
        let i = waste_vision::probe(bytes)?;
        Ok(waste_vision::grid(v.tower.config(), i.width, i.height)?.positions())
    }

    /// Decode and encode an image (PNG, JPEG, WebP, GIF's first frame) into
    /// its embedding rows: [`Model::prepare_image`] then [`Model::encode_prepared`].
    ///
    /// # Errors
    /// [`Error::Unsupported`] without a loaded tower; [`Error::Vision`] for an
    /// image that cannot be used (format, size, damage — precise).
    pub fn encode_image(&self, bytes: &[u8]) -> Result<Image> {
        self.encode_prepared(&self.prepare_image(bytes)?)
    }

    /// Most bytes [`Model::prepare_image`] holds at once for these image
    /// bytes, read from the header alone (`waste_vision::preprocess_bytes`).
    ///
    /// # Errors
    /// As [`Model::image_positions`].
    pub fn image_prepare_bytes(&self, bytes: &[u8]) -> Result<u64> {
        let v = self.vision_or_err()?;
        let i = waste_vision::probe(bytes)?;
        Ok(waste_vision::preprocess_bytes(v.tower.config(), &i)?)
    }

    /// Decode an image and cut it into the tower's patches (no tower work:
    /// a server does this off its engine thread).
    ///
    /// # Errors
    /// As [`Model::encode_image`].
    pub fn prepare_image(&self, bytes: &[u8]) -> Result<PreparedImage> {
        let v = self.vision_or_err()?;
        Ok(PreparedImage { pixels: waste_vision::preprocess(v.tower.config(), bytes)?, key: digest(bytes) })
    }

    /// Run the tower on a prepared image.
    ///
    /// # Errors
    /// [`Error::Unsupported`] without a loaded tower; [`Error::Vision`] for
    /// pixels that do not fit this tower, or a tower whose output is not
    /// finite (overflowing weights; the message names the block).
    pub fn encode_prepared(&self, p: &PreparedImage) -> Result<Image> {
        let v = self.vision_or_err()?;
        let px = &p.pixels;
        let rows = v.tower.encode(&self.pool, px)?;
        Ok(Image { width: px.width, height: px.height, grid: px.grid, rows, key: p.key })
    }
}
