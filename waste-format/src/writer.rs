//! Writing containers the C WASTE can read: trunk tensors appended to
//! trunk.bin, page-aligned CRC-sealed expert records, codebooks, and the
//! manifest written last and atomically.

use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use crate::manifest::Manifest;
use crate::record::{RecordLayout, HEADER_LEN};
use crate::tensor::{Fmt, TensorEntry};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Appends trunk tensors to `trunk.bin`.
pub struct TrunkWriter {
    path: PathBuf,
    out: BufWriter<File>,
    off: u64,
    entries: Vec<TensorEntry>,
}

impl TrunkWriter {
    /// Create `dir/trunk.bin` (truncating). Removes any existing manifest
    /// first, so a half-written container never looks complete.
    ///
    /// # Errors
    /// [`Error::Io`] when `trunk.bin` cannot be created.
    pub fn create(dir: &Path) -> Result<TrunkWriter> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let m = dir.join("manifest.json");
        if m.exists() {
            std::fs::remove_file(&m).map_err(|e| Error::io(&m, e))?;
        }
        let path = dir.join("trunk.bin");
        let f = File::create(&path).map_err(|e| Error::io(&path, e))?;
        Ok(TrunkWriter { path, out: BufWriter::with_capacity(1 << 20, f), off: 0, entries: Vec::new() })
    }

    /// Append one tensor. `payload` and `scales` must already be encoded in
    /// `fmt` (scales empty for F32/F16/BF16); sizes are checked.
    ///
    /// # Errors
    /// [`Error::Tensor`] when the data does not match the shape and format; [`Error::Io`] when it cannot be written.
    pub fn add(
        &mut self,
        name: &str,
        fmt: Fmt,
        shape: &[usize],
        group: usize,
        payload: &[u8],
        scales: &[u8],
    ) -> Result<()> {
        let grouped = fmt.is_grouped();
        let mut e = TensorEntry {
            name: name.into(),
            fmt: fmt.id(),
            off: self.off,
            shape: shape.iter().map(|&d| d as u64).collect(),
            group: grouped.then_some(group as u64),
            scale_off: grouped.then_some(self.off + payload.len() as u64),
            bytes: (payload.len() + scales.len()) as u64,
            dtype: (fmt == Fmt::Bf16).then(|| "bf16".into()),
        };
        // validate sizes against a file that would end right after this tensor
        let info = e.validate(self.off + e.bytes)?;
        if info.payload_len != payload.len() as u64 {
            return Err(Error::tensor(name, format!("payload {} bytes, {} expected", payload.len(), info.payload_len)));
        }
        let wr = |out: &mut BufWriter<File>, b: &[u8]| out.write_all(b);
        wr(&mut self.out, payload).and_then(|_| wr(&mut self.out, scales)).map_err(|er| Error::io(&self.path, er))?;
        self.off += e.bytes;
        if !grouped {
            e.scale_off = None;
        }
        self.entries.push(e);
        Ok(())
    }

    /// Record a tensor without writing its bytes (a hole in a sparse file):
    /// for manifest-only containers that `plan`/`info` can read.
    ///
    /// # Errors
    /// [`Error::Tensor`] for a shape that overflows; [`Error::Io`] when the file cannot be extended.
    pub fn add_sparse(&mut self, name: &str, fmt: Fmt, shape: &[usize], group: usize) -> Result<()> {
        let grouped = fmt.is_grouped();
        let probe = TensorEntry {
            name: name.into(),
            fmt: fmt.id(),
            off: 0,
            shape: shape.iter().map(|&d| d as u64).collect(),
            group: grouped.then_some(group as u64),
            scale_off: grouped.then_some(0),
            bytes: 0,
            dtype: None,
        };
        // sizes from the same rules the reader applies
        let numel: u64 = probe.shape.iter().product();
        let cols = *probe.shape.last().unwrap_or(&1);
        let rows = numel / cols.max(1);
        let g = if grouped { group as u64 } else { 0 };
        let (payload, scales) = (rows * fmt.row_bytes(cols, g), rows * fmt.groups_per_row(cols, g) * 2);
        let e = TensorEntry {
            off: self.off,
            scale_off: grouped.then_some(self.off + payload),
            bytes: payload + scales,
            ..probe
        };
        e.validate(self.off + e.bytes)?;
        self.out.flush().map_err(|er| Error::io(&self.path, er))?;
        self.off += e.bytes;
        std::io::Seek::seek(self.out.get_mut(), std::io::SeekFrom::Start(self.off))
            .map_err(|er| Error::io(&self.path, er))?;
        self.entries.push(e);
        Ok(())
    }

    /// Flush and return the manifest entries.
    ///
    /// # Errors
    /// [`Error::Io`] when `trunk.bin` cannot be flushed.
    pub fn finish(mut self) -> Result<Vec<TensorEntry>> {
        self.out.flush().map_err(|e| Error::io(&self.path, e))?;
        self.out.get_ref().set_len(self.off).map_err(|e| Error::io(&self.path, e))?;
        self.out.get_ref().sync_all().map_err(|e| Error::io(&self.path, e))?;
        Ok(self.entries)
    }
}

/// Seal a record buffer whose body is filled: write the header with the
/// CRC of `[48, scales_off + scales_len)` and zero the page padding.
pub fn seal_record(rec: &mut [u8], layer: usize, expert: usize, lay: &RecordLayout, codebook_id: u16) {
    let end = lay.scales_off + lay.scales_len;
    rec[end..lay.rec_bytes].fill(0);
    let mut h = lay.header(layer, expert, codebook_id);
    h.crc32 = crc32fast::hash(&rec[HEADER_LEN..end]);
    rec[..HEADER_LEN].copy_from_slice(&h.encode());
}

/// Writes one expert bank, record by record, in expert order.
pub struct BankWriter {
    path: PathBuf,
    out: BufWriter<File>,
    layer: usize,
    lay: RecordLayout,
    codebook_id: u16,
    next: usize,
}

impl BankWriter {
    /// Create (truncate) a bank file.
    ///
    /// # Errors
    /// [`Error::Io`] when the bank file cannot be created.
    pub fn create(path: &Path, layer: usize, lay: RecordLayout, codebook_id: u16) -> Result<BankWriter> {
        let f = File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(BankWriter {
            path: path.into(),
            out: BufWriter::with_capacity(4 << 20, f),
            layer,
            lay,
            codebook_id,
            next: 0,
        })
    }
    /// Seal and append the next record (`rec.len() == rec_bytes`, body filled).
    ///
    /// # Errors
    /// [`Error::Io`] when the record cannot be written.
    pub fn write(&mut self, rec: &mut [u8]) -> Result<()> {
        if rec.len() != self.lay.rec_bytes {
            return Err(Error::record(
                self.layer,
                self.next,
                format!("buffer of {} bytes, record is {}", rec.len(), self.lay.rec_bytes),
            ));
        }
        seal_record(rec, self.layer, self.next, &self.lay, self.codebook_id);
        self.out.write_all(rec).map_err(|e| Error::io(&self.path, e))?;
        self.next += 1;
        Ok(())
    }
    /// Flush and sync; returns the number of records written.
    ///
    /// # Errors
    /// [`Error::Io`] when the bank cannot be flushed and synced.
    pub fn finish(mut self) -> Result<usize> {
        self.out.flush().map_err(|e| Error::io(&self.path, e))?;
        self.out.get_ref().sync_all().map_err(|e| Error::io(&self.path, e))?;
        Ok(self.next)
    }
}

/// Write the manifest last, atomically.
///
/// # Errors
/// [`Error::Io`] when the manifest cannot be serialized or written.
pub fn write_manifest(dir: &Path, m: &Manifest) -> Result<()> {
    write_atomic(&dir.join("manifest.json"), m.to_json().as_bytes())
}
