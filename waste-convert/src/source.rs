//! A Hugging Face-style source directory: config.json and safetensors files
//! (with or without an index), read one tensor at a time.

use crate::{Error, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use waste_format::half::{bf16_to_f32, f16_to_f32};
use waste_io::DirectFile;

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorLoc {
    /// File.
    pub file: PathBuf,
    /// safetensors dtype name (`BF16`, `F16`, `F32`, `U8`, `I8`).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub start: u64,
    /// End (exclusive).
    pub end: u64,
}

/// An opened source.
pub struct Source {
    /// The directory.
    pub dir: PathBuf,
    /// config.json (as written; `text_config` not yet flattened).
    pub config: serde_json::Value,
    tensors: HashMap<String, TensorLoc>,
    /// Names read so far (for [`Source::unused`]).
    used: std::sync::Mutex<std::collections::HashSet<String>>,
}

/// E2M1 (MXFP4) value of a nibble: sign bit 3, exponent bits 2..1, mantissa bit 0.
pub fn e2m1(n: u8) -> f32 {
    const MAG: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = MAG[(n & 7) as usize];
    if n & 8 != 0 {
        -v
    } else {
        v
    }
}

/// E8M0 scale: `2^(e − 127)` (255 is NaN).
pub fn e8m0(e: u8) -> f32 {
    if e == 255 {
        f32::NAN
    } else {
        f32::from_bits(if e == 0 { 0x0040_0000 } else { (e as u32) << 23 })
    }
}

/// Decode MXFP4: `packed` `[rows, cols/2]` (low nibble first), `scales`
/// `[rows, cols/32]` E8M0 → `[rows, cols]` f32.
///
/// # Errors
/// [`Error::Source`] when the sizes do not match `rows × cols` (or overflow).
pub fn decode_mxfp4(packed: &[u8], scales: &[u8], rows: usize, cols: usize) -> Result<Vec<f32>> {
    let Some(n) = rows.checked_mul(cols) else {
        return Err(Error::Source(format!("MXFP4 sizes: {rows}x{cols} overflows")));
    };
    if !cols.is_multiple_of(32) || packed.len() != n / 2 || scales.len() != n / 32 {
        return Err(Error::Source(format!(
            "MXFP4 sizes: {rows}x{cols} needs {} packed and {} scale bytes, got {} and {}",
            rows * cols / 2,
            rows * cols / 32,
            packed.len(),
            scales.len()
        )));
    }
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let b = packed[r * cols / 2 + c / 2];
            let n = if c % 2 == 0 { b & 15 } else { b >> 4 };
            out[r * cols + c] = e2m1(n) * e8m0(scales[r * cols / 32 + c / 32]);
        }
    }
    Ok(out)
}

/// Largest JSON file of a source read (`config.json`, the index,
/// `tokenizer_config.json`, `preprocessor_config.json`).
pub const MAX_JSON_BYTES: u64 = 64 << 20;
/// Largest tokenizer rank file copied: what the engine reads
/// (`waste_tokenizer::MAX_TOKENIZER_FILE_BYTES`).
pub const MAX_TOKENIZER_BYTES: u64 = 64 << 20;
/// Largest chat template copied: what the engine reads
/// (`waste_tokenizer::MAX_TEMPLATE_BYTES`).
pub const MAX_TEMPLATE_BYTES: u64 = 1 << 20;

/// A source file of at most `max` bytes, `None` when it does not exist. A
/// checkpoint is untrusted: a device or a file past the bound (a
/// `config.json` linked to `/dev/zero`) is an error, not an endless read.
///
/// # Errors
/// [`Error::Io`] naming the file.
pub fn read_bounded(path: &Path, max: u64) -> Result<Option<Vec<u8>>> {
    match waste_format::read_regular(path, max) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// A source JSON file ([`MAX_JSON_BYTES`]), `None` when it does not exist.
///
/// # Errors
/// [`Error::Io`] as [`read_bounded`]; [`Error::Source`] for malformed JSON.
pub fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    read_bounded(path, MAX_JSON_BYTES)?
        .map(|b| serde_json::from_slice(&b).map_err(|e| Error::Source(format!("{}: {e}", path.display()))))
        .transpose()
}

impl Source {
    /// Open a source directory.
    ///
    /// # Errors
    /// [`Error::Source`] / [`Error::Io`] for a missing or malformed `config.json`, index, or safetensors header, and for index paths outside the folder.
    pub fn open(dir: &Path) -> Result<Source> {
        let cpath = dir.join("config.json");
        let config = read_json(&cpath)?.ok_or_else(|| {
            Error::io(&cpath, std::io::Error::new(std::io::ErrorKind::NotFound, "missing: a source needs config.json"))
        })?;
        let mut files: Vec<PathBuf> = Vec::new();
        // with an index, the file that holds each tensor
        let mut owner: HashMap<String, PathBuf> = HashMap::new();
        let idx = dir.join("model.safetensors.index.json");
        if let Some(v) = read_json(&idx)? {
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::Source(format!("{}: no weight_map", idx.display())))?;
            for (name, f) in map {
                let f =
                    f.as_str().ok_or_else(|| Error::Source(format!("{}: {name}: not a file name", idx.display())))?;
                let p = confined(dir, f)?;
                if !files.contains(&p) {
                    files.push(p.clone());
                }
                owner.insert(name.clone(), p);
            }
        } else {
            for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
                let p = e.map_err(|e| Error::io(dir, e))?.path();
                if p.extension().is_some_and(|x| x == "safetensors") {
                    files.push(p);
                }
            }
        }
        files.sort();
        if files.is_empty() {
            return Err(Error::Source(format!("{}: no *.safetensors files", dir.display())));
        }
        let mut tensors: HashMap<String, TensorLoc> = HashMap::new();
        for f in &files {
            for (name, loc) in read_header(f)? {
                // the index decides which file's copy counts; a name it does
                // not place, in two files, is ambiguous (the later file used to win)
                match owner.get(&name) {
                    Some(o) if o != f => continue,
                    None if tensors.contains_key(&name) => {
                        return Err(Error::Source(format!(
                            "tensor {name} is in both {} and {}",
                            tensors[&name].file.display(),
                            f.display()
                        )));
                    }
                    _ => {}
                }
                tensors.insert(name, loc);
            }
        }
        Ok(Source { dir: dir.into(), config, tensors, used: Default::default() })
    }

    /// Whether a tensor exists.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    /// A tensor's location.
    pub fn loc(&self, name: &str) -> Option<&TensorLoc> {
        self.tensors.get(name)
    }
    /// All tensor names.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    fn mark(&self, name: &str) {
        self.used.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string());
    }

    /// The tensors no read has touched yet, sorted: after a whole
    /// conversion, the checkpoint's weights the container left out.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<String> = self.tensors.keys().filter(|n| !used.contains(*n)).cloned().collect();
        v.sort();
        v
    }

    fn bytes(&self, loc: &TensorLoc) -> Result<Vec<u8>> {
        let f = open(&loc.file)?;
        let mut b = vec![0u8; (loc.end - loc.start) as usize];
        read_exact_at(&f, &mut b, loc.start)?;
        Ok(b)
    }

    /// Read elements `[start, start + n)` of a float tensor (row-major), only
    /// those bytes: one expert's slice of a fused `[E, rows, cols]` tensor.
    ///
    /// # Errors
    /// [`Error::Source`] when the tensor is missing, not a float type, the
    /// range lies outside it, or a value in it is not finite.
    pub fn read_f32_range(&self, name: &str, start: usize, n: usize) -> Result<Vec<f32>> {
        let loc = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::Source(format!("tensor {name} not found in {}", self.dir.display())))?;
        let es = match loc.dtype.as_str() {
            "F32" => 4u64,
            "F16" | "BF16" => 2,
            d => return Err(Error::Source(format!("tensor {name}: dtype {d} is not a float type"))),
        };
        let at = |k: usize| (k as u64).checked_mul(es).and_then(|x| x.checked_add(loc.start));
        let (a, b) = match (at(start), start.checked_add(n).and_then(at)) {
            (Some(a), Some(b)) => (a, b),
            _ => return Err(Error::Source(format!("tensor {name}: element range {start}+{n} overflows"))),
        };
        if b > loc.end {
            return Err(Error::Source(format!(
                "tensor {name}: elements {start}..{} beyond its {} bytes",
                start + n,
                loc.end - loc.start
            )));
        }
        let sub = TensorLoc { start: a, end: b, shape: vec![n], ..loc.clone() };
        self.mark(name);
        finite(name, start, decode_floats(&self.bytes(&sub)?, &sub.dtype))
    }

    /// Read a tensor as f32 `(shape, values)`. A name whose `.weight` is
    /// stored as MXFP4 (`.weight_packed` + `.weight_scale`) is decoded.
    ///
    /// # Errors
    /// [`Error::Source`] when the tensor is missing, not a float type, its
    /// MXFP4 parts do not match, or a value is not finite.
    pub fn read_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        if let Some(loc) = self.tensors.get(name) {
            if !matches!(loc.dtype.as_str(), "F32" | "F16" | "BF16") {
                return Err(Error::Source(format!("tensor {name}: dtype {} is not a float type", loc.dtype)));
            }
            self.mark(name);
            return Ok((loc.shape.clone(), finite(name, 0, decode_floats(&self.bytes(loc)?, &loc.dtype))?));
        }
        if let Some(base) = name.strip_suffix(".weight") {
            let (p, s) = (format!("{base}.weight_packed"), format!("{base}.weight_scale"));
            if let (Some(pl), Some(sl)) = (self.tensors.get(&p), self.tensors.get(&s)) {
                let rows = pl.shape.first().copied().unwrap_or(0);
                let cols = pl.shape.get(1).copied().unwrap_or(0) * 2;
                let v = decode_mxfp4(&self.bytes(pl)?, &self.bytes(sl)?, rows, cols)
                    .map_err(|e| Error::Source(format!("tensor {name}: {e}")))?;
                self.mark(&p);
                self.mark(&s);
                return Ok((vec![rows, cols], finite(name, 0, v)?));
            }
        }
        Err(Error::Source(format!("tensor {name} not found in {}", self.dir.display())))
    }
}

/// `v` when every value is finite; else an error naming the tensor and the
/// element (`first` is the index of `v[0]` in the tensor): a NaN or an
/// infinity in a checkpoint is damage, and quantizing it would give a
/// container of NaNs (or, in a VQ search, of silently wrong codes).
fn finite(name: &str, first: usize, v: Vec<f32>) -> Result<Vec<f32>> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(Error::Source(format!(
            "tensor {name}: element {} is {} (not finite): the checkpoint is damaged",
            first + i,
            v[i]
        ))),
        None => Ok(v),
    }
}

/// f32 values of little-endian F32 / F16 / BF16 bytes (dtype checked by the caller).
fn decode_floats(b: &[u8], dtype: &str) -> Vec<f32> {
    match dtype {
        "F32" => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        "F16" => b.chunks_exact(2).map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
        _ => b.chunks_exact(2).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
    }
}

/// Positional read through waste-io (buffered: the source is read once).
fn read_exact_at(f: &DirectFile, b: &mut [u8], off: u64) -> Result<()> {
    f.read_exact_at(b, off).map_err(|e| Error::Source(e.to_string()))
}

/// `dir/f` for a file named by the index, refused unless it stays inside
/// `dir`: no absolute paths, no `..`, no symlink leading out.
fn confined(dir: &Path, f: &str) -> Result<PathBuf> {
    let rel = Path::new(f);
    let plain = rel.components().all(|c| matches!(c, std::path::Component::Normal(_)));
    let outside = || Error::Source(format!("{}: weight_map names {f:?}, outside the source folder", dir.display()));
    if !plain {
        return Err(outside());
    }
    let p = dir.join(rel);
    if let (Ok(cp), Ok(cd)) = (p.canonicalize(), dir.canonicalize()) {
        if !cp.starts_with(&cd) {
            return Err(outside());
        }
    }
    Ok(p)
}

fn open(path: &Path) -> Result<DirectFile> {
    DirectFile::open(path, false).map_err(|e| Error::Source(e.to_string()))
}

fn read_header(path: &Path) -> Result<Vec<(String, TensorLoc)>> {
    let f = open(path)?;
    let len = f.len();
    let mut n8 = [0u8; 8];
    read_exact_at(&f, &mut n8, 0)?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER_BYTES || 8 + n > len {
        return Err(Error::Source(format!("{}: header of {n} bytes does not fit", path.display())));
    }
    let mut buf = vec![0u8; 8 + n as usize];
    read_exact_at(&f, &mut buf, 0)?;
    parse_header(path, &buf, len)
}

/// Largest safetensors JSON header accepted.
pub const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Parse a safetensors file's header from its first bytes (`head`: the
/// 8-byte length and the JSON) for a file of `file_len` bytes: every
/// tensor's dtype, shape and byte range, checked against the file with
/// checked arithmetic. `path` only names the file in errors. The converter's
/// reader and the fuzz target use this.
///
/// # Errors
/// [`Error::Source`] naming the file and tensor for anything malformed.
pub fn parse_header(path: &Path, head: &[u8], file_len: u64) -> Result<Vec<(String, TensorLoc)>> {
    let len = file_len;
    let short = || Error::Source(format!("{}: shorter than its header", path.display()));
    let n8: [u8; 8] = head.get(..8).and_then(|b| b.try_into().ok()).ok_or_else(short)?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER_BYTES || n.checked_add(8).is_none_or(|e| e > len) {
        return Err(Error::Source(format!("{}: header of {n} bytes does not fit", path.display())));
    }
    let buf = head.get(..8 + n as usize).ok_or_else(short)?;
    // The header is `u64 length` + JSON `{name: {dtype, shape, data_offsets}}`.
    // (safetensors' own read_metadata wants the whole file in memory; we stream.)
    let meta: serde_json::Value =
        serde_json::from_slice(&buf[8..]).map_err(|e| Error::Source(format!("{}: header: {e}", path.display())))?;
    let obj = meta.as_object().ok_or_else(|| Error::Source(format!("{}: header is not an object", path.display())))?;
    let base = 8 + n;
    let mut out = Vec::new();
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let bad = |m: &str| Error::Source(format!("{}: tensor {name}: {m}", path.display()));
        let dtype = info.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| bad("no dtype"))?.to_string();
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|d| d.as_u64().map(|x| x as usize).ok_or_else(|| bad("bad shape")))
            .collect::<Result<_>>()?;
        let off = info
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad("no data_offsets"))?;
        let (s0, e0) =
            (off[0].as_u64().ok_or_else(|| bad("bad offset"))?, off[1].as_u64().ok_or_else(|| bad("bad offset"))?);
        let elem = match dtype.as_str() {
            "F32" | "I32" | "U32" => 4,
            "F16" | "BF16" | "I16" | "U16" => 2,
            "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
            "F64" | "I64" | "U64" => 8,
            _ => 0,
        };
        let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
        let bytes = numel.and_then(|n| n.checked_mul(elem));
        let fits = base.checked_add(e0).is_some_and(|end| end <= len);
        if e0 < s0 || !fits || bytes.is_none() || (elem > 0 && bytes != Some(e0 - s0)) {
            return Err(bad(&format!("byte range [{s0}, {e0}) does not fit the file or the shape {shape:?}")));
        }
        out.push((name.clone(), TensorLoc { file: path.into(), dtype, shape, start: base + s0, end: base + e0 }));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_map_paths_stay_in_the_source_folder() {
        let d = std::env::temp_dir().join(format!("waste-confined-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        for bad in ["/etc/passwd", "../x.safetensors", "a/../../x.safetensors", "./../x"] {
            assert!(confined(&d, bad).is_err(), "{bad}");
        }
        assert_eq!(confined(&d, "model-1.safetensors").unwrap(), d.join("model-1.safetensors"));
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("/etc", d.join("out")).unwrap();
            assert!(confined(&d, "out/passwd").is_err());
        }
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn hostile_headers_are_errors() {
        let d = std::env::temp_dir().join(format!("waste-hdr-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let write = |name: &str, json: &str, data: usize| {
            let p = d.join(name);
            let mut b = (json.len() as u64).to_le_bytes().to_vec();
            b.extend(json.as_bytes());
            b.extend(vec![0u8; data]);
            std::fs::write(&p, b).unwrap();
            p
        };
        for (i, h) in [
            r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}}"#,
            r#"{"t":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}"#,
            r#"{"t":{"dtype":"F32","shape":[3],"data_offsets":[8,0]}}"#,
            r#"{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}"#,
            r#"{"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}}"#,
            r#"[1,2]"#,
        ]
        .iter()
        .enumerate()
        {
            let p = write(&format!("h{i}.safetensors"), h, 8);
            assert!(read_header(&p).is_err(), "{h}");
        }
        let ok = write("ok.safetensors", r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, 8);
        assert_eq!(read_header(&ok).unwrap()[0].1.shape, vec![2]);
        assert!(decode_mxfp4(&[], &[], usize::MAX, 64).is_err());
        std::fs::remove_dir_all(&d).ok();
    }

    /// A tensor in two shards: without an index the source is ambiguous and
    /// refused naming both files (the later file's copy used to win
    /// silently); with one, the index's file is read and the other copy
    /// ignored, whichever order the files sort in.
    #[test]
    fn a_tensor_in_two_shards_follows_the_index_or_is_refused() {
        let d = std::env::temp_dir().join(format!("waste-shards-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("config.json"), "{}").unwrap();
        let shard = |name: &str, v: f32| {
            let json = r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
            let mut b = (json.len() as u64).to_le_bytes().to_vec();
            b.extend(json.as_bytes());
            b.extend(v.to_le_bytes());
            b.extend(v.to_le_bytes());
            std::fs::write(d.join(name), b).unwrap();
        };
        shard("a.safetensors", 1.0);
        shard("b.safetensors", 2.0);
        let e = Source::open(&d).err().expect("ambiguous").to_string();
        assert!(e.contains("tensor t is in both") && e.contains("a.safetensors") && e.contains("b.safetensors"), "{e}");
        for (owner, want) in [("a.safetensors", 1.0), ("b.safetensors", 2.0)] {
            let index = format!(r#"{{"weight_map": {{"t": "{owner}"}}}}"#);
            std::fs::write(d.join("model.safetensors.index.json"), index).unwrap();
            let s = Source::open(&d).unwrap();
            assert_eq!(s.read_f32("t").unwrap().1, vec![want, want], "{owner}");
        }
        // an index that lists both files but places another tensor: `t` is unplaced
        let index = r#"{"weight_map": {"u": "a.safetensors", "v": "b.safetensors"}}"#;
        std::fs::write(d.join("model.safetensors.index.json"), index).unwrap();
        assert!(Source::open(&d).err().expect("ambiguous").to_string().contains("tensor t is in both"));
        std::fs::remove_dir_all(&d).ok();
    }

    proptest::proptest! {
        /// The fuzz target's twin: mutations of a valid header (past its
        /// length word, so the JSON and range checks are reached) are
        /// parsed or refused, never a panic, and what parses fits the file.
        #[test]
        fn mutated_headers_are_parsed_or_refused(
            edits in proptest::collection::vec((proptest::prelude::any::<u16>(), proptest::prelude::any::<u8>()), 0..6),
            file_extra in 0u64..64,
        ) {
            let json = br#"{"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]},"__metadata__":{"x":"y"}}"#;
            let mut head = (json.len() as u64).to_le_bytes().to_vec();
            head.extend_from_slice(json);
            for &(pos, v) in &edits {
                let at = 8 + pos as usize % json.len();
                head[at] = v;
            }
            let len = head.len() as u64 + 32 + file_extra;
            if let Ok(ts) = parse_header(Path::new("t"), &head, len) {
                for (_, t) in ts {
                    proptest::prop_assert!(t.start <= t.end && t.end <= len);
                }
            }
        }
    }

    #[test]
    fn e2m1_and_e8m0() {
        assert_eq!(
            (0..16).map(e2m1).collect::<Vec<_>>(),
            vec![0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
        );
        assert_eq!(e8m0(127), 1.0);
        assert_eq!(e8m0(128), 2.0);
        assert_eq!(e8m0(120), 2f32.powi(-7));
        assert!(e8m0(255).is_nan());
    }
}
