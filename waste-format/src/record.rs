//! Expert records: the 48-byte header, the expert quantization scheme and
//! the body layout it implies.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use bytemuck::{Pod, Zeroable};
use serde::{Deserialize, Serialize};

/// Record magic "WEXP".
pub const RECORD_MAGIC: u32 = 0x5058_4557;
/// Header size in bytes.
pub const HEADER_LEN: usize = 48;
/// Record alignment/page size.
pub const PAGE: usize = 4096;

/// Expert storage format (record `fmt` byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertFmt {
    /// 3 residual stages of 256 entries, 8-bit indices.
    Vq3r,
    /// 2 residual stages of 256 entries, 8-bit indices.
    Vq2r,
    /// 4 stages of 64 entries, 6-bit indices packed 4-in-3 bytes.
    Vq4p,
    /// Exact IEEE half (project extension).
    F16,
    /// Exact bfloat16 (project extension).
    Bf16,
    /// 4-bit groups of [`Q4G_GROUP`] columns with an f16 scale each, as the
    /// trunk's Q4G (project extension): the fast format for models that fit
    /// in RAM, and the one whose experts a prefill chunk can batch.
    Q4g,
}

/// Columns per scale group of Q4G expert matrices.
pub const Q4G_GROUP: usize = 128;

/// One expert record format's constants, registered once
/// ([`EXPERT_FORMATS`]): its names, its record header byte and its
/// standard scheme. The kernels are waste-moe's (`ExpertKernel`), the
/// encoders waste-convert's; docs/ADDING-A-FORMAT.md lists every place.
#[derive(Clone, Copy, Debug)]
pub struct ExpertFormatSpec {
    /// The format.
    pub fmt: ExpertFmt,
    /// `expert_quant.fmt` in the manifest.
    pub name: &'static str,
    /// The record header's fmt byte.
    pub byte: u8,
    /// Columns per scale group, 0 without scales.
    pub group: usize,
    /// The standard scheme (as the C WASTE writes it, for its formats).
    pub standard: ExpertQuant,
}

const fn spec(fmt: ExpertFmt, name: &'static str, byte: u8, group: usize, s: [usize; 5]) -> ExpertFormatSpec {
    let standard = ExpertQuant { fmt, stages: s[0], vec_dim: s[1], entries: s[2], index_block: s[3], index_bits: s[4] };
    ExpertFormatSpec { fmt, name, byte, group, standard }
}

/// The registered expert formats, one per `ExpertFmt` variant: VQ3R and
/// VQ2R with 256-entry books and 8-bit indices, VQ4P with 64 entries and
/// 6-bit packed indices, all 8-dim vectors blocked by 64 rows; F16/BF16
/// exact; Q4G in groups of [`Q4G_GROUP`]. (Scheme: stages, vec_dim,
/// entries, index_block, index_bits.)
pub const EXPERT_FORMATS: [ExpertFormatSpec; 6] = [
    spec(ExpertFmt::Vq3r, "VQ3R", 4, 0, [3, 8, 256, 64, 8]),
    spec(ExpertFmt::Vq2r, "VQ2R", 5, 0, [2, 8, 256, 64, 8]),
    spec(ExpertFmt::Vq4p, "VQ4P", 8, 0, [4, 8, 64, 64, 6]),
    spec(ExpertFmt::F16, "F16", 1, 0, [0, 1, 0, 0, 16]),
    spec(ExpertFmt::Bf16, "BF16", 1, 0, [0, 1, 0, 0, 16]),
    spec(ExpertFmt::Q4g, "Q4G", 3, Q4G_GROUP, [0, 1, 0, 0, 4]),
];

impl ExpertFmt {
    /// Its registration in [`EXPERT_FORMATS`].
    pub fn spec(self) -> &'static ExpertFormatSpec {
        &EXPERT_FORMATS[match self {
            ExpertFmt::Vq3r => 0,
            ExpertFmt::Vq2r => 1,
            ExpertFmt::Vq4p => 2,
            ExpertFmt::F16 => 3,
            ExpertFmt::Bf16 => 4,
            ExpertFmt::Q4g => 5,
        }]
    }
    /// The format named `name` in a manifest (`VQ3R`, …), or in any case
    /// (`vq3r`, as the CLI takes it).
    pub fn from_name(name: &str) -> Option<ExpertFmt> {
        EXPERT_FORMATS.iter().find(|f| f.name.eq_ignore_ascii_case(name)).map(|f| f.fmt)
    }
    /// The record header's fmt byte.
    pub fn byte(self) -> u8 {
        self.spec().byte
    }
    /// Name as in the manifest.
    pub fn name(self) -> &'static str {
        self.spec().name
    }
    /// Whether this is a codebook (VQ) format.
    pub fn is_vq(self) -> bool {
        matches!(self, ExpertFmt::Vq3r | ExpertFmt::Vq2r | ExpertFmt::Vq4p)
    }
    /// Columns per scale group (Q4G), else 0.
    pub fn group(self) -> usize {
        self.spec().group
    }
}

/// The manifest's `expert_quant` object.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ExpertQuantEntry {
    /// "VQ3R" | "VQ2R" | "VQ4P" | "F16" | "BF16" | "Q4G".
    pub fmt: String,
    /// Residual stages.
    #[serde(default)]
    pub stages: u32,
    /// Vector length.
    #[serde(default)]
    pub vec_dim: u32,
    /// Codebook entries per stage.
    #[serde(default)]
    pub entries: u32,
    /// Rows per index block (0 = row-major).
    #[serde(default)]
    pub index_block: u32,
    /// Bits per stage index (absent = 8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_bits: Option<u32>,
    /// Nominal bits per weight (informational).
    #[serde(default)]
    pub bits_per_weight: f64,
    /// Columns per scale group (Q4G only; must be 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<u32>,
}

/// The validated expert quantization scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertQuant {
    /// Format.
    pub fmt: ExpertFmt,
    /// Residual stages (VQ).
    pub stages: usize,
    /// Vector length (VQ).
    pub vec_dim: usize,
    /// Entries per codebook (VQ).
    pub entries: usize,
    /// Index block rows (0 = row-major).
    pub index_block: usize,
    /// Bits per stage index.
    pub index_bits: usize,
}

impl ExpertQuantEntry {
    /// Validate the scheme.
    ///
    /// # Errors
    /// [`Error::Manifest`] for an unknown format or stage/entry/block counts it cannot have.
    pub fn validate(&self) -> Result<ExpertQuant> {
        let k = |f: &str| format!("expert_quant.{f}");
        let fmt = EXPERT_FORMATS
            .iter()
            .find(|f| f.name == self.fmt)
            .map(|f| f.fmt)
            .ok_or_else(|| Error::manifest(k("fmt"), format!("unknown expert format {:?}", self.fmt)))?;
        let group = self.group.map(|g| g as usize);
        if group.is_some_and(|g| g != fmt.group()) || (fmt == ExpertFmt::Q4g && group.is_none()) {
            let want = if fmt == ExpertFmt::Q4g { format!("{Q4G_GROUP}") } else { "absent".into() };
            return Err(Error::manifest(k("group"), format!("{:?} but {} needs {want}", self.group, self.fmt)));
        }
        if !fmt.is_vq() {
            return Ok(ExpertQuant::standard(fmt));
        }
        let index_bits = self.index_bits.unwrap_or(8) as usize;
        let std = fmt.spec().standard;
        let (want_stages, want_bits, max_entries) = (std.stages, std.index_bits, std.entries);
        if self.stages as usize != want_stages {
            return Err(Error::manifest(k("stages"), format!("{} but {} has {want_stages}", self.stages, self.fmt)));
        }
        if index_bits != want_bits {
            return Err(Error::manifest(
                k("index_bits"),
                format!("{index_bits} but {} uses {want_bits}-bit indices", self.fmt),
            ));
        }
        if self.entries == 0 || self.entries as usize > max_entries {
            return Err(Error::manifest(k("entries"), format!("{} out of range 1..={max_entries}", self.entries)));
        }
        if !(1..=64).contains(&self.vec_dim) {
            return Err(Error::manifest(k("vec_dim"), format!("{} out of range 1..=64", self.vec_dim)));
        }
        if self.index_block > 4096 {
            return Err(Error::manifest(k("index_block"), format!("{} exceeds 4096", self.index_block)));
        }
        Ok(ExpertQuant {
            fmt,
            stages: want_stages,
            vec_dim: self.vec_dim as usize,
            entries: self.entries as usize,
            index_block: self.index_block as usize,
            index_bits,
        })
    }
}

impl ExpertQuant {
    /// The standard scheme of a format, as the C WASTE writes it: VQ3R and
    /// VQ2R with 256-entry books, VQ4P with 64 entries and 6-bit packed
    /// indices, all 8-dim vectors blocked by 64 rows; F16/BF16 exact.
    pub fn standard(fmt: ExpertFmt) -> ExpertQuant {
        fmt.spec().standard
    }
    /// Parse `vq3r | vq2r | vq4p | f16 | bf16 | q4g` (any case).
    pub fn parse_fmt(s: &str) -> Option<ExpertFmt> {
        ExpertFmt::from_name(s)
    }
    /// Bytes of stage indices per (row, vector position).
    pub fn index_bytes_per_vec(&self) -> usize {
        if self.index_bits == 6 {
            self.stages * 6 / 8
        } else {
            self.stages
        }
    }
    /// Bytes for the body of one matrix `[rows, cols]`.
    pub fn matrix_bytes(&self, rows: usize, cols: usize) -> u64 {
        if self.fmt == ExpertFmt::Q4g {
            return rows as u64 * cols.div_ceil(Q4G_GROUP) as u64 * (Q4G_GROUP / 2) as u64;
        }
        if !self.fmt.is_vq() {
            return rows as u64 * cols as u64 * 2;
        }
        let rows_p = if self.index_block > 0 { rows.div_ceil(self.index_block) * self.index_block } else { rows };
        rows_p as u64 * (cols / self.vec_dim) as u64 * self.index_bytes_per_vec() as u64
    }
    /// The manifest form.
    pub fn to_entry(&self) -> ExpertQuantEntry {
        ExpertQuantEntry {
            fmt: self.fmt.name().into(),
            stages: self.stages as u32,
            vec_dim: if self.fmt.is_vq() { self.vec_dim as u32 } else { 0 },
            entries: self.entries as u32,
            index_block: self.index_block as u32,
            index_bits: (self.index_bits == 6).then_some(6),
            bits_per_weight: self.bits_per_weight(),
            group: (self.fmt.group() > 0).then_some(self.fmt.group() as u32),
        }
    }
    /// f16 scales of one matrix `[rows, cols]`: one per row (VQ), one per
    /// group of a row (Q4G), none (F16/BF16).
    pub fn scales_per_matrix(&self, rows: usize, cols: usize) -> usize {
        match self.fmt {
            ExpertFmt::Q4g => rows * cols.div_ceil(Q4G_GROUP),
            f if f.is_vq() => rows,
            _ => 0,
        }
    }
    /// Nominal bits per weight of the indices.
    pub fn bits_per_weight(&self) -> f64 {
        match self.fmt {
            ExpertFmt::Q4g => 4.0 + 16.0 / Q4G_GROUP as f64,
            f if f.is_vq() => (self.stages * self.index_bits) as f64 / self.vec_dim as f64,
            _ => 16.0,
        }
    }
    /// Codebooks per MoE layer (3 kinds × stages).
    pub fn books_per_layer(&self) -> usize {
        3 * self.stages
    }
}

/// Where each part of a record body lives; computed from the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordLayout {
    /// Rows of gate/up (`moe_intermediate`).
    pub m: usize,
    /// Columns of gate/up = rows of down (the expert width).
    pub lat: usize,
    /// The quantization.
    pub quant: ExpertQuant,
    /// Offset of gate indices.
    pub gate_off: usize,
    /// Offset of up indices.
    pub up_off: usize,
    /// Offset of down indices.
    pub down_off: usize,
    /// Offset of the per-row scales.
    pub scales_off: usize,
    /// Bytes of scales (f16: gate, up, then down, as
    /// [`ExpertQuant::scales_per_matrix`] gives; 0 for F16/BF16 records).
    pub scales_len: usize,
    /// Record size (whole pages).
    pub rec_bytes: usize,
}

impl RecordLayout {
    /// The canonical layout for a config and quantization.
    ///
    /// # Errors
    /// [`Error::Manifest`] when the expert shapes overflow or the format does not fit the config.
    pub fn new(cfg: &ModelConfig, quant: ExpertQuant) -> Result<RecordLayout> {
        let m = cfg.moe_intermediate;
        let lat = cfg.expert_width();
        if quant.fmt.is_vq() {
            for (what, n) in [("moe_intermediate_size", m), ("expert width", lat)] {
                if n % quant.vec_dim != 0 {
                    return Err(Error::manifest(
                        "expert_quant.vec_dim",
                        format!("{} does not divide {what} {n}", quant.vec_dim),
                    ));
                }
            }
        }
        let gate = quant.matrix_bytes(m, lat);
        let up = gate;
        let down = quant.matrix_bytes(lat, m);
        let scales_len = (2 * quant.scales_per_matrix(m, lat) + quant.scales_per_matrix(lat, m)) as u64 * 2;
        let body = HEADER_LEN as u64 + gate + up + down + scales_len;
        let rec = body.div_ceil(PAGE as u64) * PAGE as u64;
        if rec > u32::MAX as u64 {
            return Err(Error::manifest(
                "config.moe_intermediate_size",
                format!("expert record of {rec} bytes exceeds 4 GiB"),
            ));
        }
        let gate_off = HEADER_LEN;
        let up_off = gate_off + gate as usize;
        let down_off = up_off + up as usize;
        let scales_off = down_off + down as usize;
        Ok(RecordLayout {
            m,
            lat,
            quant,
            gate_off,
            up_off,
            down_off,
            scales_off,
            scales_len: scales_len as usize,
            rec_bytes: rec as usize,
        })
    }
    /// Byte length of the gate (= up) matrix section.
    pub fn gate_len(&self) -> usize {
        self.up_off - self.gate_off
    }
    /// Byte length of the down matrix section.
    pub fn down_len(&self) -> usize {
        self.scales_off - self.down_off
    }
    /// Scales of the gate (= up) and down matrices (f16 values, not bytes).
    pub fn scale_counts(&self) -> (usize, usize) {
        (self.quant.scales_per_matrix(self.m, self.lat), self.quant.scales_per_matrix(self.lat, self.m))
    }
    /// Bytes of matrix `k`'s scales (0 gate, 1 up, 2 down) within the
    /// scales section (add the header's `chan_corr_off` for the record).
    pub fn scale_bytes(&self, k: usize) -> std::ops::Range<usize> {
        let (gs, ds) = self.scale_counts();
        let start = 2 * gs * k.min(2);
        start..start + 2 * if k < 2 { gs } else { ds }
    }
    /// A header for expert `expert` of `layer` with this layout (CRC 0).
    pub fn header(&self, layer: usize, expert: usize, codebook_id: u16) -> RecordHeader {
        RecordHeader {
            magic: RECORD_MAGIC,
            layer: layer as u16,
            expert_id: expert as u16,
            fmt: self.quant.fmt.byte(),
            flags: if self.quant.fmt == ExpertFmt::Bf16 { 1 } else { 0 },
            codebook_id,
            lowrank_id: 0,
            reserved0: 0,
            rec_4k_blocks: (self.rec_bytes / PAGE) as u32,
            gate_off: self.gate_off as u32,
            up_off: self.up_off as u32,
            down_off: self.down_off as u32,
            chan_corr_off: self.scales_off as u32,
            crc32: 0,
            reserved1: [0; 2],
        }
    }
}

/// The 48-byte packed record header (little-endian on disk).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct RecordHeader {
    /// `RECORD_MAGIC`.
    pub magic: u32,
    /// Layer index.
    pub layer: u16,
    /// Expert id.
    pub expert_id: u16,
    /// Format byte.
    pub fmt: u8,
    /// Flags (bit0 bf16, bit1 has_sub, bit2 hot_hint; informational).
    pub flags: u8,
    /// Codebook id (= the layer's codebook_base).
    pub codebook_id: u16,
    /// Must be 0.
    pub lowrank_id: u16,
    /// Reserved.
    pub reserved0: u16,
    /// Record size / 4096.
    pub rec_4k_blocks: u32,
    /// Gate indices offset.
    pub gate_off: u32,
    /// Up indices offset.
    pub up_off: u32,
    /// Down indices offset.
    pub down_off: u32,
    /// Per-row scales offset.
    pub chan_corr_off: u32,
    /// CRC32 of `[48, chan_corr_off + scales_len)`.
    pub crc32: u32,
    /// Reserved.
    pub reserved1: [u32; 2],
}
const _: () = assert!(std::mem::size_of::<RecordHeader>() == HEADER_LEN);

impl RecordHeader {
    /// Decode from little-endian bytes (needs ≥ 48 bytes). No validation.
    pub fn decode(b: &[u8]) -> Option<RecordHeader> {
        let b = b.get(..HEADER_LEN)?;
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        Some(RecordHeader {
            magic: u32_at(0),
            layer: u16_at(4),
            expert_id: u16_at(6),
            fmt: b[8],
            flags: b[9],
            codebook_id: u16_at(10),
            lowrank_id: u16_at(12),
            reserved0: u16_at(14),
            rec_4k_blocks: u32_at(16),
            gate_off: u32_at(20),
            up_off: u32_at(24),
            down_off: u32_at(28),
            chan_corr_off: u32_at(32),
            crc32: u32_at(36),
            reserved1: [u32_at(40), u32_at(44)],
        })
    }
    /// Encode as little-endian bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut le = *self;
        if cfg!(target_endian = "big") {
            le = RecordHeader {
                magic: self.magic.to_le(),
                layer: self.layer.to_le(),
                expert_id: self.expert_id.to_le(),
                codebook_id: self.codebook_id.to_le(),
                lowrank_id: self.lowrank_id.to_le(),
                reserved0: self.reserved0.to_le(),
                rec_4k_blocks: self.rec_4k_blocks.to_le(),
                gate_off: self.gate_off.to_le(),
                up_off: self.up_off.to_le(),
                down_off: self.down_off.to_le(),
                chan_corr_off: self.chan_corr_off.to_le(),
                crc32: self.crc32.to_le(),
                reserved1: [self.reserved1[0].to_le(), self.reserved1[1].to_le()],
                ..*self
            };
        }
        bytemuck::cast(le)
    }

    /// Validate a header read from the record of `expert` in `layer` against
    /// the layout the bank index predicts. This is memory safety, done on
    /// every read. `codebook_base` is the layer's base; `n_codebooks` the
    /// number of records in codebooks.bin.
    ///
    /// # Errors
    /// [`Error::Record`] naming the layer and expert for a wrong magic, identity, format, codebook or section offset.
    pub fn validate(
        &self,
        layer: usize,
        expert: usize,
        lay: &RecordLayout,
        codebook_base: usize,
        n_codebooks: usize,
    ) -> Result<()> {
        let err = |msg: String| Err(Error::record(layer, expert, msg));
        if self.magic != RECORD_MAGIC {
            return err(format!("bad magic 0x{:08x} (expected 0x{RECORD_MAGIC:08x} \"WEXP\")", self.magic));
        }
        if self.layer as usize != layer || self.expert_id as usize != expert {
            return err(format!("header names expert {} of layer {} (misplaced record)", self.expert_id, self.layer));
        }
        if self.fmt != lay.quant.fmt.byte() {
            return err(format!(
                "fmt byte {} disagrees with the manifest's {} ({})",
                self.fmt,
                lay.quant.fmt.name(),
                lay.quant.fmt.byte()
            ));
        }
        if self.lowrank_id != 0 {
            return err(format!("lowrank_id {} (must be 0)", self.lowrank_id));
        }
        if self.rec_4k_blocks as usize * PAGE != lay.rec_bytes {
            return err(format!(
                "rec_4k_blocks {} disagrees with the bank stride {} bytes",
                self.rec_4k_blocks, lay.rec_bytes
            ));
        }
        if lay.quant.fmt.is_vq() {
            let cb = self.codebook_id as usize;
            if cb != codebook_base {
                return err(format!("codebook_id {cb} disagrees with the layer's codebook_base {codebook_base}"));
            }
            if cb + lay.quant.books_per_layer() > n_codebooks {
                return err(format!(
                    "codebook_id {cb} + {} books out of range ({n_codebooks} codebooks)",
                    lay.quant.books_per_layer()
                ));
            }
        }
        let (g, u, d, c) =
            (self.gate_off as usize, self.up_off as usize, self.down_off as usize, self.chan_corr_off as usize);
        if g != HEADER_LEN
            || u < g + lay.gate_len()
            || d < u + lay.gate_len()
            || c < d + lay.down_len()
            || (lay.quant.fmt == ExpertFmt::Q4g && !c.is_multiple_of(2))
        {
            return err(format!(
                "section offsets gate {g} up {u} down {d} scales {c} do not fit the matrices ({} / {} / {} bytes)",
                lay.gate_len(),
                lay.gate_len(),
                lay.down_len()
            ));
        }
        match c.checked_add(lay.scales_len) {
            Some(end) if end <= lay.rec_bytes => Ok(()),
            _ => err(format!("scales at {c} (+{}) run past the record ({} bytes)", lay.scales_len, lay.rec_bytes)),
        }
    }

    /// Offsets of the sections as a layout (after `validate`).
    pub fn sections(&self) -> [usize; 4] {
        [self.gate_off as usize, self.up_off as usize, self.down_off as usize, self.chan_corr_off as usize]
    }
}

/// CRC32 (zlib polynomial) of a record's payload `[48, scales_off + scales_len)`.
pub fn record_crc(rec: &[u8], hdr: &RecordHeader, lay: &RecordLayout) -> u32 {
    let end = (hdr.chan_corr_off as usize + lay.scales_len).min(rec.len());
    crc32fast::hash(&rec[HEADER_LEN.min(end)..end])
}

/// Validate a full record buffer: header and per-row scales always, CRC
/// when `verify_crc`. The scales must be finite: a record can be sealed
/// with an infinite scale (its CRC then passes), and every value it yielded
/// would be NaN.
///
/// # Errors
/// [`Error::Record`] naming the layer and expert: short record, bad header,
/// (with `verify_crc`) a checksum mismatch, or a scale that is not finite
/// (naming the matrix and row).
pub fn check_record(
    rec: &[u8],
    layer: usize,
    expert: usize,
    lay: &RecordLayout,
    codebook_base: usize,
    n_codebooks: usize,
    verify_crc: bool,
) -> Result<RecordHeader> {
    if rec.len() < lay.rec_bytes {
        return Err(Error::record(layer, expert, format!("short record: {} of {} bytes", rec.len(), lay.rec_bytes)));
    }
    let hdr =
        RecordHeader::decode(rec).ok_or_else(|| Error::record(layer, expert, "record shorter than its header"))?;
    hdr.validate(layer, expert, lay, codebook_base, n_codebooks)?;
    if verify_crc {
        let got = record_crc(rec, &hdr, lay);
        if got != hdr.crc32 {
            return Err(Error::record(
                layer,
                expert,
                format!("checksum mismatch (stored 0x{:08x}, computed 0x{got:08x})", hdr.crc32),
            ));
        }
    }
    // the scales where the header puts them (validated inside the record),
    // as the kernels read them: gate, then up, then down (a scale per row,
    // or per group of a row)
    let c = hdr.chan_corr_off as usize;
    let sc = &rec[c..c + lay.scales_len];
    if let Some(i) = crate::half::first_non_finite_f16(sc) {
        let h = u16::from_le_bytes([sc[2 * i], sc[2 * i + 1]]);
        let (gs, _) = lay.scale_counts();
        let (kind, j, cols) = match i {
            i if i < gs => ("gate", i, lay.lat),
            i if i < 2 * gs => ("up", i - gs, lay.lat),
            i => ("down", i - 2 * gs, lay.m),
        };
        let per_row = lay.quant.scales_per_matrix(1, cols);
        let at = match lay.quant.fmt.group() {
            0 => format!("row {}", j / per_row),
            g => format!("row {} (columns {}..{})", j / per_row, j % per_row * g, (j % per_row + 1) * g),
        };
        return Err(Error::record(layer, expert, format!("the {kind} scale of {at} is not finite (f16 0x{h:04x})")));
    }
    Ok(hdr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Header bytes the format leaves free (FORMAT.md: flags, informational;
    /// the two reserved fields).
    const FREE_HEADER_BYTES: [usize; 11] = [9, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47];

    fn arb_header() -> impl Strategy<Value = RecordHeader> {
        (any::<[u32; 12]>(), any::<[u8; 2]>()).prop_map(|(w, b)| RecordHeader {
            magic: w[0],
            layer: w[1] as u16,
            expert_id: (w[1] >> 16) as u16,
            fmt: b[0],
            flags: b[1],
            codebook_id: w[2] as u16,
            lowrank_id: (w[2] >> 16) as u16,
            reserved0: w[3] as u16,
            rec_4k_blocks: w[4],
            gate_off: w[5],
            up_off: w[6],
            down_off: w[7],
            chan_corr_off: w[8],
            crc32: w[9],
            reserved1: [w[10], w[11]],
        })
    }

    proptest! {
        #[test]
        fn header_roundtrip(h in arb_header()) {
            prop_assert_eq!(RecordHeader::decode(&h.encode()), Some(h));
        }

        /// Mutations of a valid sealed record reach every check past the
        /// length test: header fields, offsets, codebook ids, the CRC. None
        /// panics; a change anywhere in the payload, or in any header byte
        /// but the informational ones, is always caught; a change in those
        /// alone is not refused.
        #[test]
        fn mutated_valid_records_never_panic_and_payload_damage_is_caught(
            seed in any::<u64>(),
            edits in proptest::collection::vec((any::<u16>(), any::<u8>()), 1..6),
            in_header in any::<bool>(),
            cut in proptest::option::of(0usize..4096),
        ) {
            let q = ExpertQuantEntry { fmt: "VQ3R".into(), stages: 3, vec_dim: 8, entries: 256, index_block: 64, index_bits: None, bits_per_weight: 3.0, group: None }.validate().unwrap();
            let cfg = crate::config::ModelConfig::from_json(&serde_json::json!({"hidden_size": 16, "num_hidden_layers": 1, "vocab_size": 4, "num_experts": 2, "num_experts_per_token": 1, "moe_intermediate_size": 8, "num_attention_heads": 1, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_lora_rank": 4})).unwrap();
            let lay = RecordLayout::new(&cfg, q).unwrap();
            let mut rec = vec![0u8; lay.rec_bytes];
            let mut x = seed | 1;
            for b in rec.iter_mut() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                *b = x as u8;
            }
            // finite scales (an exponent bit cleared): a valid record
            for c in rec[lay.scales_off..lay.scales_off + lay.scales_len].chunks_exact_mut(2) {
                c[1] &= !0x40;
            }
            crate::writer::seal_record(&mut rec, 0, 1, &lay, 0);
            prop_assert!(check_record(&rec, 0, 1, &lay, 0, 9, true).is_ok());
            let end = lay.scales_off + lay.scales_len;
            let (mut changed_payload, mut changed_checked_header, mut changed_free) = (false, false, false);
            for &(pos, v) in &edits {
                let at = if in_header { pos as usize % HEADER_LEN } else { HEADER_LEN + pos as usize % (end - HEADER_LEN) };
                if rec[at] != v {
                    if !in_header {
                        changed_payload = true;
                    } else if FREE_HEADER_BYTES.contains(&at) {
                        changed_free = true;
                    } else {
                        changed_checked_header = true;
                    }
                }
                rec[at] = v;
            }
            let cut_short = cut.is_some_and(|c| c < rec.len());
            if let Some(c) = cut {
                rec.truncate(c.min(rec.len()));
            }
            let r = check_record(&rec, 0, 1, &lay, 0, 9, true);
            if changed_payload {
                prop_assert!(r.is_err(), "a payload change passed the CRC");
            }
            // every header byte but the informational ones is checked: by
            // value (magic, identity, format, lowrank, size, codebook, the
            // first offset), by order (the sections are packed: any other
            // offset change breaks it) or by the CRC (its field, and the
            // scales' offset, which bounds the CRC's range)
            if changed_checked_header || cut_short {
                prop_assert!(r.is_err(), "a header change passed: {:?}", edits);
            } else if changed_free {
                prop_assert!(r.is_ok(), "an informational byte was refused: {:?}", r);
            }
    }
    }

    /// A sealed record (CRC valid) whose scale is infinite or NaN is
    /// refused with or without the CRC check, naming the matrix and row;
    /// finite extremes (the largest, a subnormal, −0) pass.
    #[test]
    fn non_finite_scales_are_refused_naming_the_row() {
        let q = ExpertQuant::standard(ExpertFmt::Vq3r);
        let lay = RecordLayout::new(&cfg(64, 16), q).unwrap();
        let with = |i: usize, h: u16| sealed_with_scale(&lay, i, h);
        for h in [0x7BFFu16, 0x0001, 0x8000] {
            assert!(check_record(&with(3, h), 0, 1, &lay, 0, 9, true).is_ok(), "{h:04x}");
        }
        for (i, h, want) in [
            (0, 0x7C00u16, "the gate scale of row 0 is not finite (f16 0x7c00)"),
            (lay.m + 1, 0xFE00, "the up scale of row 1 is not finite (f16 0xfe00)"),
            (2 * lay.m + 63, 0xFC00, "the down scale of row 63 is not finite (f16 0xfc00)"),
        ] {
            for crc in [false, true] {
                let e = check_record(&with(i, h), 0, 1, &lay, 0, 9, crc).unwrap_err().to_string();
                assert!(e.contains("expert 1 of layer 0") && e.contains(want), "{e}");
            }
        }
    }

    #[test]
    fn anchor_layout() {
        // hidden 128, moe_intermediate 64, VQ3R blocked by 64: the C WASTE's record is 3 pages with
        // gate 48, up 3120, down 6192, scales 9264 (read off testdata/anchor-tiny).
        let q = ExpertQuantEntry {
            fmt: "VQ3R".into(),
            stages: 3,
            vec_dim: 8,
            entries: 256,
            index_block: 64,
            index_bits: None,
            bits_per_weight: 3.0,
            group: None,
        }
        .validate()
        .unwrap();
        let cfg = crate::config::ModelConfig::from_json(&serde_json::json!({"hidden_size": 128, "num_hidden_layers": 1, "vocab_size": 4, "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 64, "num_attention_heads": 1, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_lora_rank": 4})).unwrap();
        let l = RecordLayout::new(&cfg, q).unwrap();
        assert_eq!((l.gate_off, l.up_off, l.down_off, l.scales_off, l.rec_bytes), (48, 3120, 6192, 9264, 12288));
    }

    /// A zero record of `lay` (expert 1 of layer 0) whose `i`-th scale is
    /// the f16 `h`, sealed.
    fn sealed_with_scale(lay: &RecordLayout, i: usize, h: u16) -> Vec<u8> {
        let mut rec = vec![0u8; lay.rec_bytes];
        let at = lay.scales_off + 2 * i;
        rec[at..at + 2].copy_from_slice(&h.to_le_bytes());
        crate::writer::seal_record(&mut rec, 0, 1, lay, 0);
        rec
    }

    fn cfg(hidden: usize, m: usize) -> crate::config::ModelConfig {
        crate::config::ModelConfig::from_json(&serde_json::json!({"hidden_size": hidden, "num_hidden_layers": 1, "vocab_size": 4, "num_experts": 2, "num_experts_per_token": 1, "moe_intermediate_size": m, "num_attention_heads": 1, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_lora_rank": 4})).unwrap()
    }

    /// Q4G experts: half a byte per weight, a scale per 128 columns of a
    /// row (gate, up, down in that order; rows padded to whole groups), and
    /// the manifest round trip names the group.
    #[test]
    fn q4g_layout_and_manifest() {
        let q = ExpertQuant::standard(ExpertFmt::Q4g);
        let l = RecordLayout::new(&cfg(256, 384), q).unwrap();
        // gate/up 384×256: 384·128 bytes; down 256×384: 256·192 bytes
        assert_eq!((l.gate_len(), l.down_len()), (384 * 128, 256 * 192));
        assert_eq!(l.scale_counts(), (384 * 2, 256 * 3));
        assert_eq!(l.scales_len, 2 * (2 * 384 * 2 + 256 * 3));
        assert_eq!([l.scale_bytes(0), l.scale_bytes(1), l.scale_bytes(2)], [0..1536, 1536..3072, 3072..4608]);
        // VQ: a scale per row, gate and up m rows each, down lat rows
        let v = RecordLayout::new(&cfg(256, 384), ExpertQuant::standard(ExpertFmt::Vq3r)).unwrap();
        assert_eq!([v.scale_bytes(0), v.scale_bytes(1), v.scale_bytes(2)], [0..768, 768..1536, 1536..2048]);
        assert_eq!(v.scale_bytes(2).end, v.scales_len);
        assert_eq!(l.rec_bytes, (48 + 2 * 384 * 128 + 256 * 192 + l.scales_len).div_ceil(PAGE) * PAGE);
        let e = q.to_entry();
        assert_eq!((e.fmt.as_str(), e.group, e.bits_per_weight), ("Q4G", Some(128), 4.125));
        assert_eq!(e.validate().unwrap(), q);
        for g in [None, Some(64)] {
            let err = ExpertQuantEntry { group: g, ..e.clone() }.validate().unwrap_err().to_string();
            assert!(err.contains("expert_quant.group"), "{err}");
        }
        let vq = ExpertQuant::standard(ExpertFmt::Vq3r).to_entry();
        assert!(ExpertQuantEntry { group: Some(128), ..vq }.validate().is_err());
        // a width that is not whole groups is padded, as the trunk's Q4G rows are
        let l = RecordLayout::new(&cfg(200, 72), q).unwrap();
        assert_eq!((l.gate_len(), l.down_len()), (72 * 128, 200 * 64));
        assert_eq!(l.scale_counts(), (72 * 2, 200));
    }

    /// A Q4G record's non-finite scale is named by matrix, row and columns;
    /// an odd scales offset (the kernels read them as u16) is refused.
    #[test]
    fn q4g_record_checks() {
        let lay = RecordLayout::new(&cfg(256, 128), ExpertQuant::standard(ExpertFmt::Q4g)).unwrap();
        let (gs, _) = lay.scale_counts();
        let with = |i: usize, h: u16| sealed_with_scale(&lay, i, h);
        assert!(check_record(&with(0, 0x3C00), 0, 1, &lay, 0, 0, true).is_ok());
        for (i, want) in [
            (3, "the gate scale of row 1 (columns 128..256)"),
            (gs + 2, "the up scale of row 1 (columns 0..128)"),
            (2 * gs + 5, "the down scale of row 5 (columns 0..128)"),
        ] {
            let e = check_record(&with(i, 0x7C00), 0, 1, &lay, 0, 0, false).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        let mut rec = with(0, 0x3C00);
        let mut h = RecordHeader::decode(&rec).unwrap();
        h.chan_corr_off += 1;
        rec[..HEADER_LEN].copy_from_slice(&h.encode());
        assert!(check_record(&rec, 0, 1, &lay, 0, 0, false).is_err());
    }
}
