//! Trunk tensor formats and the byte sizes they imply.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// A tensor storage format (`fmt` id in the manifest).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fmt {
    /// 0: raw f32.
    F32,
    /// 1: raw IEEE half.
    F16,
    /// 1 with `"dtype": "bf16"`: raw bfloat16 (project extension).
    Bf16,
    /// 2: 8-bit groups with f16 scales.
    Q8G,
    /// 3: 4-bit groups (low nibble first, biased by 8) with f16 scales.
    Q4G,
}

impl Fmt {
    /// Decode a manifest `fmt` id (+ optional `dtype` for id 1).
    ///
    /// # Errors
    /// [`Error::Tensor`] for an unknown format id or one that contradicts `dtype`.
    pub fn from_id(id: u32, dtype: Option<&str>, name: &str) -> Result<Fmt> {
        match (id, dtype) {
            (0, _) => Ok(Fmt::F32),
            (1, None | Some("f16") | Some("F16")) => Ok(Fmt::F16),
            (1, Some("bf16") | Some("BF16")) => Ok(Fmt::Bf16),
            (1, Some(d)) => Err(Error::tensor(name, format!("unknown dtype {d:?} for fmt 1"))),
            (2, _) => Ok(Fmt::Q8G),
            (3, _) => Ok(Fmt::Q4G),
            (7, _) => Err(Error::Unsupported(format!("tensor `{name}`: fmt 7 (Q3G) is not implemented"))),
            (4 | 5 | 8, _) => Err(Error::tensor(name, format!("fmt {id} is an expert-only VQ format"))),
            _ => Err(Error::tensor(name, format!("unknown fmt {id}"))),
        }
    }
    /// The manifest id.
    pub fn id(self) -> u32 {
        match self {
            Fmt::F32 => 0,
            Fmt::F16 | Fmt::Bf16 => 1,
            Fmt::Q8G => 2,
            Fmt::Q4G => 3,
        }
    }
    /// Short display name.
    pub fn name(self) -> &'static str {
        match self {
            Fmt::F32 => "F32",
            Fmt::F16 => "F16",
            Fmt::Bf16 => "BF16",
            Fmt::Q8G => "Q8G",
            Fmt::Q4G => "Q4G",
        }
    }
    /// Whether the format is group-quantized (has scales).
    pub fn is_grouped(self) -> bool {
        matches!(self, Fmt::Q8G | Fmt::Q4G)
    }
    /// Bits a stored weight takes in the payload (the scales apart).
    pub fn weight_bits(self) -> u64 {
        match self {
            Fmt::F32 => 32,
            Fmt::F16 | Fmt::Bf16 => 16,
            Fmt::Q8G => 8,
            Fmt::Q4G => 4,
        }
    }
    /// Columns as stored: padded to whole groups of `group` (grouped
    /// formats, `group` even and non-zero), else `cols`.
    pub fn cols_padded(self, cols: u64, group: u64) -> u64 {
        if self.is_grouped() {
            cols.div_ceil(group) * group
        } else {
            cols
        }
    }
    /// Payload bytes of one row of `cols` columns — the one rule the reader,
    /// the writer and the kernels use.
    pub fn row_bytes(self, cols: u64, group: u64) -> u64 {
        self.cols_padded(cols, group) * self.weight_bits() / 8
    }
    /// Scale groups (one f16 each) per row; 0 for formats without scales.
    pub fn groups_per_row(self, cols: u64, group: u64) -> u64 {
        if self.is_grouped() {
            self.cols_padded(cols, group) / group
        } else {
            0
        }
    }
}

/// One trunk tensor entry as stored in the manifest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TensorEntry {
    /// Full tensor name (including `tensor_prefix`).
    pub name: String,
    /// Format id.
    pub fmt: u32,
    /// Byte offset in trunk.bin.
    pub off: u64,
    /// Shape, row-major.
    pub shape: Vec<u64>,
    /// Group size for Q8G/Q4G.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<u64>,
    /// Offset of the f16 scales (Q8G/Q4G).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_off: Option<u64>,
    /// Total bytes (payload + scales).
    pub bytes: u64,
    /// Element type for fmt 1 (`"f16"` default, `"bf16"`), a project extension.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
}

/// A validated tensor: shape as (rows, cols), format, where its bytes live.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Name.
    pub name: String,
    /// Format.
    pub fmt: Fmt,
    /// Original shape.
    pub shape: Vec<usize>,
    /// Rows = product of all dims but the last (1 for 1-D).
    pub rows: usize,
    /// Columns = last dim.
    pub cols: usize,
    /// Group size (grouped formats).
    pub group: usize,
    /// Columns padded to the group (grouped formats), else `cols`.
    pub cols_padded: usize,
    /// Payload offset in trunk.bin.
    pub off: u64,
    /// Payload length.
    pub payload_len: u64,
    /// Scales offset (grouped formats).
    pub scale_off: u64,
    /// Scales length in bytes (grouped formats).
    pub scale_len: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.rows * self.cols
    }
    /// Total stored bytes.
    pub fn stored_bytes(&self) -> u64 {
        self.payload_len + self.scale_len
    }
}

/// Max elements of one tensor (2^40) — bounds every product below.
const MAX_NUMEL: u64 = 1 << 40;

impl TensorEntry {
    /// Validate the entry against the size of the file that holds it.
    ///
    /// # Errors
    /// [`Error::Tensor`] for a shape or range that overflows or lies outside the file.
    pub fn validate(&self, file_len: u64) -> Result<TensorInfo> {
        let name = &self.name;
        let fmt = Fmt::from_id(self.fmt, self.dtype.as_deref(), name)?;
        if self.shape.is_empty() || self.shape.len() > 4 {
            return Err(Error::tensor(name, format!("shape {:?}: rank must be 1..=4", self.shape)));
        }
        let mut numel: u64 = 1;
        for &d in &self.shape {
            if d == 0 {
                return Err(Error::tensor(name, format!("shape {:?} has a zero dimension", self.shape)));
            }
            numel = numel
                .checked_mul(d)
                .filter(|&n| n <= MAX_NUMEL)
                .ok_or_else(|| Error::tensor(name, format!("shape {:?} too large", self.shape)))?;
        }
        let cols = *self.shape.last().unwrap_or(&1);
        let rows = numel / cols;
        let group = if fmt.is_grouped() {
            let g = self.group.ok_or_else(|| Error::tensor(name, "grouped format without `group`"))?;
            if g == 0 || g > 1 << 16 || g % 2 != 0 {
                return Err(Error::tensor(name, format!("group {g} invalid (must be even, 2..=65536)")));
            }
            g
        } else {
            0
        };
        let cols_padded = fmt.cols_padded(cols, group);
        let (payload_len, scale_len) = (rows * fmt.row_bytes(cols, group), rows * fmt.groups_per_row(cols, group) * 2);
        let total = payload_len + scale_len;
        if self.bytes != total {
            return Err(Error::tensor(
                name,
                format!("bytes {} but {} shape {:?} needs {total}", self.bytes, fmt.name(), self.shape),
            ));
        }
        let end = self
            .off
            .checked_add(payload_len)
            .ok_or_else(|| Error::tensor(name, format!("off {} overflows", self.off)))?;
        if end > file_len {
            return Err(Error::tensor(name, format!("payload [{}, {end}) beyond trunk.bin size {file_len}", self.off)));
        }
        let scale_off = if fmt.is_grouped() {
            let so = self.scale_off.ok_or_else(|| Error::tensor(name, "grouped format without `scale_off`"))?;
            let se =
                so.checked_add(scale_len).ok_or_else(|| Error::tensor(name, format!("scale_off {so} overflows")))?;
            if se > file_len {
                return Err(Error::tensor(name, format!("scales [{so}, {se}) beyond trunk.bin size {file_len}")));
            }
            if so < end && se > self.off {
                return Err(Error::tensor(
                    name,
                    format!("scales [{so}, {se}) overlap the payload [{}, {end})", self.off),
                ));
            }
            so
        } else {
            0
        };
        Ok(TensorInfo {
            name: name.clone(),
            fmt,
            shape: self.shape.iter().map(|&d| d as usize).collect(),
            rows: rows as usize,
            cols: cols as usize,
            group: group as usize,
            cols_padded: cols_padded as usize,
            off: self.off,
            payload_len,
            scale_off,
            scale_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(fmt: u32, shape: Vec<u64>, bytes: u64) -> TensorEntry {
        TensorEntry { name: "t".into(), fmt, off: 0, shape, group: Some(128), scale_off: Some(0), bytes, dtype: None }
    }

    #[test]
    fn sizes_match_the_anchor_container() {
        // from the C WASTE's anchor: embedding [316,128] Q8G = 41080 bytes, q_proj [128,128] Q4G = 8448.
        let mut t = e(2, vec![316, 128], 41080);
        t.scale_off = Some(40448);
        assert_eq!(t.validate(1 << 20).unwrap().payload_len, 40448);
        let mut t = e(3, vec![128, 128], 8448);
        t.scale_off = Some(8192);
        assert_eq!(t.validate(1 << 20).unwrap().scale_len, 256);
        let t = e(3, vec![128, 32], 8448); // padded to one group of 128
        let mut t = t;
        t.scale_off = Some(8192);
        assert_eq!(t.validate(1 << 20).unwrap().cols_padded, 128);
    }

    #[test]
    fn rejects_out_of_file_and_overflow() {
        let t = TensorEntry {
            name: "x".into(),
            fmt: 0,
            off: u64::MAX - 3,
            shape: vec![4],
            group: None,
            scale_off: None,
            bytes: 16,
            dtype: None,
        };
        assert!(t.validate(100).unwrap_err().to_string().contains("overflows"));
        let t = TensorEntry { off: 90, ..t };
        assert!(t.validate(100).unwrap_err().to_string().contains("beyond trunk.bin"));
        let t = TensorEntry { shape: vec![1 << 30, 1 << 30], ..t };
        assert!(t.validate(100).unwrap_err().to_string().contains("too large"));
        let t = TensorEntry { fmt: 7, shape: vec![4], ..t };
        assert!(matches!(t.validate(100), Err(Error::Unsupported(_))));
    }
}
