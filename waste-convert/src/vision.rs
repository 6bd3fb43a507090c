//! K3's vision tower in a conversion: `vision.json` from the release's
//! `config.json` (`vision_config`, `media_placeholder_token_id`) and
//! `preprocessor_config.json` (`media_proc_cfg`), and the tower and
//! projector tensors under their release names (FORMAT.md, "vision.json").

use crate::source::Source;
use crate::{Error, Result};
use serde_json::{json, Map, Value};
use std::path::Path;
use waste_format::{Expect, Fmt};
use waste_vision::VisionConfig;

/// How the vision tower is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VisionMode {
    /// Q8G matrices, F32 norms (default; 4 bits measurably damages the
    /// tower; the C WASTE reads it).
    Q8,
    /// F16 matrices (this engine only: the C WASTE 0.6 reads every trunk
    /// format but F32/Q4G/Q3G as Q8G and would misread them).
    F16,
    /// Leave the tower out.
    Off,
}

impl VisionMode {
    /// Parse `q8 | f16`.
    pub fn parse(s: &str) -> Option<VisionMode> {
        match s {
            "q8" => Some(VisionMode::Q8),
            "f16" => Some(VisionMode::F16),
            _ => None,
        }
    }
}

/// The engine's default patch budget per image.
const MAX_PATCHES: u64 = 1024;

/// `vision.json` for a source, or `None` when it has no vision tower
/// (no `vision_config`, or no tower tensors).
///
/// # Errors
/// [`Error::Source`] when the release's vision config is malformed, the
/// placeholder id is missing, `preprocessor_config.json` is unreadable, or
/// the resulting geometry is refused by [`VisionConfig::from_json`].
pub fn vision_json(
    src_dir: &Path,
    src: &Source,
    text_hidden: usize,
    vocab: usize,
) -> Result<Option<(Value, VisionConfig)>> {
    let Some(vc) = src.config.get("vision_config") else { return Ok(None) };
    if !src.has("vision_tower.patch_embed.proj.weight") {
        return Ok(None);
    }
    let vc = vc.as_object().ok_or_else(|| Error::Source("config.json: vision_config is not an object".into()))?;
    let mut out: Map<String, Value> =
        vc.iter().filter(|(k, _)| !k.starts_with('_')).map(|(k, v)| (k.clone(), v.clone())).collect();
    let get = |k: &str, d: u64| vc.get(k).cloned().unwrap_or(json!(d));
    for (k, d) in [
        ("vt_hidden_size", 1024),
        ("vt_num_attention_heads", 12),
        ("qkv_hidden_size", 1536),
        ("vt_intermediate_size", 4096),
        ("vt_num_hidden_layers", 27),
        ("init_pos_emb_height", 64),
        ("init_pos_emb_width", 64),
        ("patch_size", 14),
    ] {
        out.insert(k.into(), get(k, d));
    }
    out.insert("text_hidden_size".into(), json!(text_hidden));
    out.insert("vt_rms_eps".into(), json!(f32::EPSILON as f64));
    let pad = src
        .config
        .get("media_placeholder_token_id")
        .or_else(|| vc.get("media_placeholder_token_id"))
        .cloned()
        .ok_or_else(|| {
            Error::Source("config.json: media_placeholder_token_id is missing (needed for images)".into())
        })?;
    out.insert("media_placeholder_token_id".into(), pad);
    out.insert("max_patches".into(), json!(MAX_PATCHES));
    let pp = src_dir.join("preprocessor_config.json");
    let proc = crate::source::read_json(&pp)?.unwrap_or_else(|| json!({}));
    let mp = proc.get("media_proc_cfg").unwrap_or(&proc);
    for (k, d) in [("image_mean", json!([0.5, 0.5, 0.5])), ("image_std", json!([0.5, 0.5, 0.5]))] {
        out.insert(k.into(), mp.get(k).cloned().unwrap_or(d));
    }
    for k in ["in_patch_limit", "patch_limit_on_one_side"] {
        if let Some(v) = mp.get(k) {
            out.insert(k.into(), v.clone());
        }
    }
    let v = Value::Object(out);
    let cfg = VisionConfig::from_json(&v, text_hidden, vocab).map_err(|e| Error::Source(e.to_string()))?;
    Ok(Some((v, cfg)))
}

/// One tower tensor ready to write: full name, format, rows, columns, values.
pub type VisionTensor = (String, Fmt, usize, usize, Vec<f32>);

/// Read every tower tensor from the source, flattened to the `(rows,
/// cols)` the tower loads (the conv `[D,3,14,14]` to `[D,588]`, the
/// position grid `[H,W,D]` to `[H·W,D]`), with the format it is stored in.
///
/// # Errors
/// [`Error::Source`] for a missing tensor or one whose element count does not match the config.
pub fn tensors(src: &Source, cfg: &VisionConfig, mode: VisionMode) -> Result<Vec<VisionTensor>> {
    let mut out = Vec::new();
    for (name, rows, cols) in cfg.tensors() {
        let (shape, v) = src.read_f32(&name)?;
        if !Expect::Mat(rows, cols).accepts_shape(&shape) {
            return Err(Error::Source(format!("{name}: shape {shape:?}, the vision config needs {rows}x{cols}")));
        }
        let fmt = match mode {
            _ if rows == 1 => Fmt::F32,
            VisionMode::F16 => Fmt::F16,
            _ => Fmt::Q8G,
        };
        out.push((name, fmt, rows, cols, v));
    }
    Ok(out)
}
