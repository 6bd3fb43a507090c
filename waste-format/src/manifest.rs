//! `manifest.json`: the commit record of a container.

use crate::error::{Error, Result};
use crate::record::ExpertQuantEntry;
use crate::tensor::TensorEntry;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// The only format version this reader accepts.
pub const FORMAT_VERSION: u64 = 0;
/// Largest manifest accepted (bounds allocation).
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;

/// One MoE layer's bank entry.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LayerEntry {
    /// Bank file name inside the container directory.
    pub file: String,
    /// Number of expert records.
    pub experts: u64,
    /// Bank size in bytes.
    pub bytes: u64,
    /// Index of the layer's first codebook.
    #[serde(default)]
    pub codebook_base: u64,
}

/// The manifest as stored.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// Must be 0.
    pub format_version: u64,
    /// Descriptive architecture string.
    #[serde(default)]
    pub arch: String,
    /// Prefix of text-model tensor names.
    #[serde(default)]
    pub tensor_prefix: String,
    /// The model config (flattened `text_config`).
    pub config: Value,
    /// Expert quantization.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_quant: Option<ExpertQuantEntry>,
    /// Banks keyed by decimal layer index.
    #[serde(default)]
    pub layers: BTreeMap<String, LayerEntry>,
    /// Trunk tensors.
    pub trunk: Vec<TensorEntry>,
}

impl Manifest {
    /// Parse manifest bytes: `format_version` checked first, with a precise error.
    ///
    /// # Errors
    /// [`Error::Manifest`] for malformed JSON, a missing or unsupported `format_version`, or a missing section.
    pub fn parse(bytes: &[u8]) -> Result<Manifest> {
        let v: Value = serde_json::from_slice(bytes)
            .map_err(|e| Error::manifest("manifest.json", format!("invalid JSON: {e}")))?;
        let obj = v.as_object().ok_or_else(|| Error::manifest("manifest.json", "top level is not an object"))?;
        match obj.get("format_version") {
            None => {
                return Err(Error::manifest(
                    "format_version",
                    "missing (a v0 container must say \"format_version\": 0)",
                ))
            }
            Some(fv) if fv.as_u64() != Some(FORMAT_VERSION) => {
                return Err(Error::manifest(
                    "format_version",
                    format!("{fv} is not supported (this reader knows version {FORMAT_VERSION})"),
                ))
            }
            _ => {}
        }
        // Entries one by one, so an error names the entry.
        for (i, t) in obj.get("trunk").and_then(|t| t.as_array()).into_iter().flatten().enumerate() {
            let name = t.get("name").and_then(|n| n.as_str()).unwrap_or("?");
            serde_json::from_value::<TensorEntry>(t.clone())
                .map_err(|e| Error::manifest(format!("trunk[{i}] ({name})"), e.to_string()))?;
        }
        for (k, l) in obj.get("layers").and_then(|t| t.as_object()).into_iter().flatten() {
            serde_json::from_value::<LayerEntry>(l.clone())
                .map_err(|e| Error::manifest(format!("layers.{k}"), e.to_string()))?;
        }
        if let Some(q) = obj.get("expert_quant") {
            serde_json::from_value::<Option<ExpertQuantEntry>>(q.clone())
                .map_err(|e| Error::manifest("expert_quant", e.to_string()))?;
        }
        serde_json::from_value(v).map_err(|e| Error::manifest("manifest.json", e.to_string()))
    }

    /// Serialize (pretty, stable key order).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}
