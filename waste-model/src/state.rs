//! Session state files: every shape the state depends on plus a model
//! fingerprint, validated in full (and the exact length) before the live
//! session is touched; written atomically.

use crate::session::LayerStateRef;
use crate::{Error, Result, Session};
use std::path::Path;
use waste_format::Error as FErr;

/// State file magic "WSTA".
pub const STATE_MAGIC: u32 = 0x4154_5357;
/// State file version.
pub const STATE_VERSION: u32 = 1;

/// A state file that cannot be used: `PATH: what is wrong` (it read as a
/// manifest key's error before, an internal label in a user's message).
fn bad(path: &Path, msg: String) -> Error {
    Error::Format(FErr::io(path, std::io::Error::new(std::io::ErrorKind::InvalidData, msg)))
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}
impl Reader<'_> {
    fn u32(&mut self) -> Option<u32> {
        let v = self.b.get(self.at..self.at + 4)?;
        self.at += 4;
        Some(u32::from_le_bytes(v.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        let v = self.b.get(self.at..self.at + 8)?;
        self.at += 8;
        Some(u64::from_le_bytes(v.try_into().ok()?))
    }
}

impl Session<'_> {
    /// Save the state (position, every layer's state, the last logits) atomically.
    ///
    /// # Errors
    /// [`Error::Format`] when the file cannot be written (it is replaced
    /// atomically) or when something other than a state file (or an empty
    /// file) is already at `path` — that is left as it was;
    /// [`Error::Incomplete`] after a step that failed part-way (nothing is
    /// written).
    pub fn save_state(&self, path: impl AsRef<Path>) -> Result<()> {
        self.check_complete()?;
        let m = self.model();
        let mut out = Vec::new();
        let put32 = |o: &mut Vec<u8>, v: u32| o.extend_from_slice(&v.to_le_bytes());
        let put64 = |o: &mut Vec<u8>, v: u64| o.extend_from_slice(&v.to_le_bytes());
        put32(&mut out, STATE_MAGIC);
        put32(&mut out, STATE_VERSION);
        put64(&mut out, m.fingerprint());
        put64(&mut out, self.position() as u64);
        let layers = self.layer_states();
        put32(&mut out, layers.len() as u32);
        for l in &layers {
            match l {
                LayerStateRef::Kda { conv, s } => {
                    put32(&mut out, 0);
                    put64(&mut out, conv.len() as u64);
                    put64(&mut out, s.len() as u64);
                }
                LayerStateRef::Mla { cache, len, width } => {
                    put32(&mut out, 1);
                    put64(&mut out, *width as u64);
                    put64(&mut out, *len as u64);
                    let _ = cache;
                }
            }
        }
        put64(&mut out, self.logits().len() as u64);
        for l in &layers {
            match l {
                LayerStateRef::Kda { conv, s } => {
                    out.extend(conv.iter().flat_map(|v| v.to_le_bytes()));
                    out.extend(s.iter().flat_map(|v| v.to_le_bytes()));
                }
                LayerStateRef::Mla { cache, len, width } => {
                    out.extend(cache[..len * width].iter().flat_map(|v| v.to_le_bytes()))
                }
            }
        }
        out.extend(self.logits().iter().flat_map(|v| v.to_le_bytes()));
        waste_format::replace_own(path.as_ref(), &out, &STATE_MAGIC.to_le_bytes(), "WASTE state file")?;
        Ok(())
    }

    /// Load a state saved by [`Session::save_state`]. Everything is checked
    /// (magic, version, model fingerprint, every shape, the exact length)
    /// before the session changes; on error the session is as it was.
    ///
    /// # Errors
    /// [`Error::Format`] for a file that is missing, not a regular file, too
    /// large, from another model, malformed, or holding a non-finite value;
    /// the session is then unchanged.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        // a state is the header, the layer table and the state itself: more
        // than that (or a device posing as a file) is refused while reading
        let max = self.model().plan().state_bytes.saturating_add(1 << 20);
        let b = waste_format::read_regular(path, max).map_err(|e| Error::Format(FErr::io(path, e)))?;
        self.load_state_bytes(&b, path)
    }

    /// [`Session::load_state`] from bytes already in memory (`path` names
    /// them in errors).
    ///
    /// # Errors
    /// As [`Session::load_state`].
    pub fn load_state_bytes(&mut self, b: &[u8], path: &Path) -> Result<()> {
        let mut r = Reader { b, at: 0 };
        let trunc = || bad(path, "truncated".into());
        if r.u32().ok_or_else(trunc)? != STATE_MAGIC {
            return Err(bad(path, "not a WASTE state file (bad magic)".into()));
        }
        let ver = r.u32().ok_or_else(trunc)?;
        if ver != STATE_VERSION {
            return Err(bad(path, format!("version {ver}, expected {STATE_VERSION}")));
        }
        let fp = r.u64().ok_or_else(trunc)?;
        if fp != self.model().fingerprint() {
            return Err(bad(path, "saved from a different model (fingerprint mismatch)".into()));
        }
        let pos = r.u64().ok_or_else(trunc)?;
        let ctx = self.model().options().ctx as u64;
        if pos > ctx {
            return Err(bad(path, format!("position {pos} exceeds this session's ctx {ctx}")));
        }
        let n = r.u32().ok_or_else(trunc)? as usize;
        let cur = self.layer_states();
        if n != cur.len() {
            return Err(bad(path, format!("{n} layers, the model has {}", cur.len())));
        }
        let mut need: u64 = 0;
        let mut mla_lens = Vec::with_capacity(n);
        for (i, l) in cur.iter().enumerate() {
            let kind = r.u32().ok_or_else(trunc)?;
            let (a, c) = (r.u64().ok_or_else(trunc)?, r.u64().ok_or_else(trunc)?);
            match (kind, l) {
                (0, LayerStateRef::Kda { conv, s }) if a == conv.len() as u64 && c == s.len() as u64 => {
                    need += 4 * (a + c);
                    mla_lens.push(0);
                }
                (1, LayerStateRef::Mla { width, .. }) if a == *width as u64 && c <= ctx && c <= pos => {
                    need += 4 * a * c;
                    mla_lens.push(c as usize);
                }
                _ => {
                    return Err(bad(
                        path,
                        format!("layer {i}: state shape (kind {kind}, {a}, {c}) does not match this model"),
                    ))
                }
            }
        }
        let nl = r.u64().ok_or_else(trunc)?;
        if nl != self.logits().len() as u64 {
            return Err(bad(path, format!("{nl} logits, the model has {}", self.logits().len())));
        }
        need += 4 * nl;
        if (b.len() - r.at) as u64 != need {
            return Err(bad(path, format!("{} payload bytes, the shapes need {need}", b.len() - r.at)));
        }
        // a saved state is finite (a session whose logits were not failed
        // with Error::NonFinite): an infinite or NaN value is damage
        let vals = || b[r.at..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        if let Some((i, v)) = vals().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(bad(path, format!("payload value {i} is not finite ({v}): the state is damaged")));
        }
        // validated: apply
        let mut vals = vals();
        self.restore(pos as usize, &mla_lens, &mut vals);
        Ok(())
    }
}

/// An in-memory copy of a session's state (for prefix reuse).
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// [`crate::Model::fingerprint`] of the model it was taken from.
    model: u64,
    pos: usize,
    mla_lens: Vec<usize>,
    values: Vec<f32>,
    /// The session's [`Error::Incomplete`] cause, restored with the rest.
    incomplete: Option<std::borrow::Cow<'static, str>>,
}

impl Snapshot {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.values.len() * 4
    }
    /// Position it was taken at.
    pub fn position(&self) -> usize {
        self.pos
    }
}

impl Session<'_> {
    /// Copy the state (positions, layer states, last logits).
    pub fn snapshot(&self) -> Snapshot {
        let mut values = Vec::new();
        let mut mla_lens = Vec::new();
        for l in self.layer_states() {
            match l {
                LayerStateRef::Kda { conv, s } => {
                    values.extend_from_slice(conv);
                    values.extend_from_slice(s);
                    mla_lens.push(0);
                }
                LayerStateRef::Mla { cache, len, width } => {
                    values.extend_from_slice(&cache[..len * width]);
                    mla_lens.push(len);
                }
            }
        }
        values.extend_from_slice(self.logits());
        Snapshot {
            model: self.model().fingerprint(),
            pos: self.position(),
            mla_lens,
            values,
            incomplete: self.incomplete.clone(),
        }
    }

    /// Return to a snapshot taken from a session of the same model.
    ///
    /// # Errors
    /// [`Error::Arg`] for a snapshot of another model, or one whose
    /// positions do not fit this session's context (the same container
    /// opened with a smaller `ctx`); the session is then unchanged.
    pub fn restore_snapshot(&mut self, snap: &Snapshot) -> Result<()> {
        if snap.model != self.model().fingerprint() {
            return Err(Error::Arg("the snapshot was taken from a different model".into()));
        }
        let ctx = self.model().options().ctx;
        if snap.pos > ctx {
            return Err(Error::Arg(format!("the snapshot's position {} exceeds this session's ctx {ctx}", snap.pos)));
        }
        // every shape from this session, so the values cannot run short or over
        let mut need = self.logits().len();
        let cur = self.layer_states();
        if snap.mla_lens.len() != cur.len() {
            return Err(Error::Arg(format!(
                "the snapshot has {} layers, the model {}",
                snap.mla_lens.len(),
                cur.len()
            )));
        }
        for (l, &len) in cur.iter().zip(&snap.mla_lens) {
            need += match l {
                LayerStateRef::Kda { conv, s } => conv.len() + s.len(),
                // (a snapshot of an incomplete session may hold more than its position)
                LayerStateRef::Mla { width, .. } if len <= ctx => len * width,
                LayerStateRef::Mla { .. } => {
                    return Err(Error::Arg(format!(
                        "the snapshot holds {len} cached positions, past this session's ctx {ctx}"
                    )))
                }
            };
        }
        if snap.values.len() != need {
            return Err(Error::Arg(format!(
                "the snapshot holds {} values, this session's shapes {need}",
                snap.values.len()
            )));
        }
        let mut it = snap.values.iter().copied();
        self.restore(snap.pos, &snap.mla_lens, &mut it);
        self.incomplete = snap.incomplete.clone();
        Ok(())
    }
}
