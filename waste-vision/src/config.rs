//! `vision.json`: the tower's geometry and the engine's image keys
//! (FORMAT.md, "vision.json"), read as untrusted input.

use crate::{Error, Result};
use serde_json::Value;

/// Pixels per patch side (the only size the release and the C WASTE use).
pub const PATCH: usize = 14;
/// Values per patch: 3 channels × 14 × 14.
pub const PATCH_VALUES: usize = 3 * PATCH * PATCH;
/// The tower's RMSNorm epsilon: float32 machine epsilon (`nn.RMSNorm`
/// built without `eps`), whatever `vt_rms_eps` says (MODEL.md).
pub const TOWER_EPS: f32 = f32::EPSILON;
/// The projector's `post_norm` epsilon.
pub const PROJ_EPS: f32 = 1e-5;
/// The most patches an image may have, whatever `max_patches` says: the
/// attention scores of one head are `patches²` floats (64 MiB at 4096).
pub const MAX_PATCHES_LIMIT: usize = 4096;

/// The tower's geometry and the image keys of `vision.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    /// Tower width (`vt_hidden_size`).
    pub hidden: usize,
    /// Attention heads (`vt_num_attention_heads`).
    pub heads: usize,
    /// Packed q/k/v width per projection (`qkv_hidden_size`).
    pub qkv_hidden: usize,
    /// MLP width (`vt_intermediate_size`).
    pub intermediate: usize,
    /// Blocks (`vt_num_hidden_layers`).
    pub layers: usize,
    /// Learned position grid rows (`init_pos_emb_height`).
    pub pos_h: usize,
    /// Learned position grid columns (`init_pos_emb_width`).
    pub pos_w: usize,
    /// Projector output: the text model's hidden size.
    pub text_hidden: usize,
    /// The `<|media_pad|>` token id.
    pub placeholder: u32,
    /// Patch budget per image.
    pub max_patches: usize,
    /// Most patches along one side (`patch_limit_on_one_side`), if given.
    pub side_limit: Option<usize>,
    /// Per-channel mean of the normalisation.
    pub mean: [f32; 3],
    /// Per-channel standard deviation of the normalisation.
    pub std: [f32; 3],
}

fn uint(m: &serde_json::Map<String, Value>, key: &str, default: Option<usize>, lo: usize, hi: usize) -> Result<usize> {
    let v = match m.get(key) {
        None | Some(Value::Null) => default.ok_or_else(|| Error::Config(format!("{key}: missing")))?,
        Some(v) => {
            let n = v.as_u64().ok_or_else(|| Error::Config(format!("{key}: {v} is not a non-negative integer")))?;
            usize::try_from(n).map_err(|_| Error::Config(format!("{key}: {n} is too large")))?
        }
    };
    if !(lo..=hi).contains(&v) {
        return Err(Error::Config(format!("{key}: {v} is outside {lo}..={hi}")));
    }
    Ok(v)
}

fn triple(m: &serde_json::Map<String, Value>, key: &str, positive: bool) -> Result<[f32; 3]> {
    let Some(v) = m.get(key) else { return Ok([0.5; 3]) };
    let a =
        v.as_array().filter(|a| a.len() == 3).ok_or_else(|| Error::Config(format!("{key}: {v} is not 3 numbers")))?;
    let mut out = [0f32; 3];
    for (o, x) in out.iter_mut().zip(a) {
        let f = x.as_f64().ok_or_else(|| Error::Config(format!("{key}: {x} is not a number")))?;
        if !f.is_finite() || f.abs() > 1e6 || (positive && f <= 1e-6) {
            return Err(Error::Config(format!("{key}: {f} is out of range")));
        }
        *o = f as f32;
    }
    Ok(out)
}

impl VisionConfig {
    /// Parse and validate `vision.json` for a text model of width
    /// `text_hidden` and `vocab` tokens.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key: not an object, a size out of range
    /// (heads not dividing `qkv_hidden`, an odd head size, a patch size
    /// other than 14, `text_hidden_size` different from the text model's),
    /// a placeholder id outside the vocabulary, a zero or non-finite std.
    pub fn from_json(v: &Value, text_hidden: usize, vocab: usize) -> Result<VisionConfig> {
        let m = v.as_object().ok_or_else(|| Error::Config("vision.json is not a JSON object".into()))?;
        let hidden = uint(m, "vt_hidden_size", Some(1024), 1, 16384)?;
        let heads = uint(m, "vt_num_attention_heads", Some(12), 1, 256)?;
        let qkv_hidden = uint(m, "qkv_hidden_size", Some(1536), 1, 65536)?;
        if !qkv_hidden.is_multiple_of(heads) || !(qkv_hidden / heads).is_multiple_of(2) {
            return Err(Error::Config(format!(
                "qkv_hidden_size {qkv_hidden} over {heads} heads: the head size must be a whole even number"
            )));
        }
        let intermediate = uint(m, "vt_intermediate_size", Some(4096), 1, 65536)?;
        let layers = uint(m, "vt_num_hidden_layers", Some(27), 1, 256)?;
        let pos_h = uint(m, "init_pos_emb_height", Some(64), 1, 1024)?;
        let pos_w = uint(m, "init_pos_emb_width", Some(64), 1, 1024)?;
        let th = uint(m, "text_hidden_size", Some(text_hidden), 1, 1 << 20)?;
        if th != text_hidden {
            return Err(Error::Config(format!(
                "text_hidden_size {th} differs from the text model's hidden size {text_hidden}"
            )));
        }
        let patch = uint(m, "patch_size", Some(PATCH), 1, 1024)?;
        if patch != PATCH {
            return Err(Error::Config(format!("patch_size {patch}: only {PATCH} is supported")));
        }
        // the tower merges 2×2 patches (MODEL.md); another merge would run
        // with the wrong geometry, so a vision.json asking for one is refused
        if let Some(mk) = m.get("merge_kernel_size").filter(|v| !v.is_null()) {
            if mk != &serde_json::json!([2, 2]) {
                return Err(Error::Config(format!("merge_kernel_size {mk}: only [2, 2] is supported")));
            }
        }
        let placeholder = uint(m, "media_placeholder_token_id", None, 0, vocab.saturating_sub(1))?;
        let max_patches = uint(m, "max_patches", Some(1024), 4, MAX_PATCHES_LIMIT)?;
        let side_limit = match m.get("patch_limit_on_one_side") {
            None | Some(Value::Null) => None,
            Some(_) => Some(uint(m, "patch_limit_on_one_side", None, 2, 1 << 20)?),
        };
        Ok(VisionConfig {
            hidden,
            heads,
            qkv_hidden,
            intermediate,
            layers,
            pos_h,
            pos_w,
            text_hidden,
            placeholder: placeholder as u32,
            max_patches,
            side_limit,
            mean: triple(m, "image_mean", false)?,
            std: triple(m, "image_std", true)?,
        })
    }

    /// Head size (`qkv_hidden / heads`).
    pub fn head_dim(&self) -> usize {
        self.qkv_hidden / self.heads
    }

    /// Every tensor the tower and projector need: full name and
    /// `(rows, cols)` as loaded (a vector is one row).
    pub fn tensors(&self) -> Vec<(String, usize, usize)> {
        let (d, q, i, m) = (self.hidden, self.qkv_hidden, self.intermediate, 4 * self.hidden);
        let mut v = vec![
            ("vision_tower.patch_embed.proj.weight".to_string(), d, PATCH_VALUES),
            ("vision_tower.patch_embed.pos_emb.weight".to_string(), self.pos_h * self.pos_w, d),
        ];
        for b in 0..self.layers {
            let p = format!("vision_tower.encoder.blocks.{b}.");
            v.push((format!("{p}norm0.weight"), 1, d));
            v.push((format!("{p}wqkv.weight"), 3 * q, d));
            v.push((format!("{p}wo.weight"), d, q));
            v.push((format!("{p}norm1.weight"), 1, d));
            v.push((format!("{p}mlp.fc0.weight"), i, d));
            v.push((format!("{p}mlp.fc1.weight"), d, i));
        }
        v.push(("vision_tower.encoder.final_layernorm.weight".into(), 1, d));
        v.push(("mm_projector.proj.0.weight".into(), m, m));
        v.push(("mm_projector.proj.2.weight".into(), self.text_hidden, m));
        v.push(("mm_projector.post_norm.weight".into(), 1, self.text_hidden));
        v
    }

    /// Bytes of f32 buffers [`crate::Tower::encode`] allocates for one image
    /// at the patch budget (pixels, activations, one head's scores), on top of
    /// the weights.
    pub fn scratch_bytes(&self) -> u64 {
        let n = self.max_patches as u64;
        let (d, q, i) = (self.hidden as u64, self.qkv_hidden as u64, self.intermediate as u64);
        let hd = self.head_dim() as u64;
        let floats = n * PATCH_VALUES as u64 // patches
            + 2 * n * d // x, y
            + n * 3 * q // qkv
            + n * q // attention output
            + n * i.max(4 * d) // MLP activations / merged rows
            + 3 * n * hd + n * n // one head's q, k, v^T and scores
            + (n / 4) * (4 * d + self.text_hidden as u64) // projector
            + (self.pos_h * self.pos_w) as u64 * d; // the position grid
        4 * floats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"vt_hidden_size": 32, "vt_num_attention_heads": 2, "qkv_hidden_size": 32, "vt_intermediate_size": 64,
               "vt_num_hidden_layers": 2, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "text_hidden_size": 16,
               "patch_size": 14, "media_placeholder_token_id": 9, "max_patches": 64})
    }

    #[test]
    fn parses_and_lists_tensors() {
        let c = VisionConfig::from_json(&base(), 16, 10).unwrap();
        assert_eq!((c.hidden, c.heads, c.head_dim(), c.placeholder, c.max_patches), (32, 2, 16, 9, 64));
        assert_eq!(c.mean, [0.5; 3]);
        let t = c.tensors();
        assert_eq!(t.len(), 2 + 6 * 2 + 4);
        assert!(t.iter().any(|(n, r, k)| n == "mm_projector.proj.2.weight" && *r == 16 && *k == 128));
    }

    #[test]
    fn refuses_bad_geometry_naming_the_key() {
        for (k, v, want) in [
            ("qkv_hidden_size", json!(33), "qkv_hidden_size"),
            ("text_hidden_size", json!(17), "text_hidden_size"),
            ("patch_size", json!(16), "patch_size"),
            ("media_placeholder_token_id", json!(10), "media_placeholder_token_id"),
            ("max_patches", json!(1 << 20), "max_patches"),
            ("vt_hidden_size", json!(-1), "vt_hidden_size"),
            ("image_std", json!([0.5, 0.0, 0.5]), "image_std"),
            ("image_mean", json!([0.5, 0.5]), "image_mean"),
            ("merge_kernel_size", json!([3, 3]), "merge_kernel_size [3,3]: only [2, 2]"),
            ("merge_kernel_size", json!(2), "merge_kernel_size"),
        ] {
            let mut j = base();
            j[k] = v;
            let e = VisionConfig::from_json(&j, 16, 10).unwrap_err().to_string();
            assert!(e.contains(want), "{k}: {e}");
        }
        let mut j = base();
        j["merge_kernel_size"] = json!([2, 2]);
        VisionConfig::from_json(&j, 16, 10).unwrap();
        let mut j = base();
        j.as_object_mut().unwrap().remove("media_placeholder_token_id");
        assert!(VisionConfig::from_json(&j, 16, 10).unwrap_err().to_string().contains("missing"));
        assert!(VisionConfig::from_json(&json!([1]), 16, 10).is_err());
    }
}
