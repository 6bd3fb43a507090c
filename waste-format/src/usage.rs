//! `usage.waste`: the learned expert hotlist.

use crate::error::{Error, Result};

/// Usage file magic "WUSG".
pub const USAGE_MAGIC: u32 = 0x4753_5557;
/// Usage file version.
pub const USAGE_VERSION: u32 = 1;
/// Maximum entries accepted (bounds allocation on untrusted input).
pub const MAX_USAGE_ENTRIES: usize = 1 << 24;

/// One hotlist entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsageEntry {
    /// Layer.
    pub layer: u16,
    /// Expert id.
    pub expert: u16,
    /// Times used.
    pub hits: u32,
    /// Token index of last use.
    pub last_seen: u32,
}

/// A parsed usage file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Usage {
    /// Tokens the statistics cover.
    pub total_tokens: u64,
    /// Entries (unfiltered; see [`Usage::filtered`]).
    pub entries: Vec<UsageEntry>,
}

impl Usage {
    /// Parse (strict about the header and length; entries are checked by
    /// [`Usage::filtered`]).
    ///
    /// # Errors
    /// [`Error::Usage`] for a wrong magic or version, or a length that is not whole entries.
    pub fn parse(b: &[u8]) -> Result<Usage> {
        let err = |m: String| Err(Error::Usage { msg: m });
        if b.len() < 16 {
            return err(format!("{} bytes, shorter than the 16-byte header", b.len()));
        }
        let magic = u32::from_le_bytes(b[0..4].try_into().unwrap_or_default());
        if magic != USAGE_MAGIC {
            return err(format!("bad magic 0x{magic:08x}"));
        }
        let ver = u32::from_le_bytes(b[4..8].try_into().unwrap_or_default());
        if ver != USAGE_VERSION {
            return err(format!("version {ver}, expected {USAGE_VERSION}"));
        }
        if !(b.len() - 16).is_multiple_of(16) {
            return err(format!("length {} is not header + whole 16-byte entries", b.len()));
        }
        let n = (b.len() - 16) / 16;
        if n > MAX_USAGE_ENTRIES {
            return err(format!("{n} entries exceed {MAX_USAGE_ENTRIES}"));
        }
        let total_tokens = u64::from_le_bytes(b[8..16].try_into().unwrap_or_default());
        let entries = b[16..]
            .chunks_exact(16)
            .map(|e| UsageEntry {
                layer: u16::from_le_bytes([e[0], e[1]]),
                expert: u16::from_le_bytes([e[2], e[3]]),
                hits: u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
                last_seen: u32::from_le_bytes([e[8], e[9], e[10], e[11]]),
            })
            .collect();
        Ok(Usage { total_tokens, entries })
    }

    /// Entries naming a layer/expert the container has (`has(layer, expert)`), others skipped.
    pub fn filtered(&self, has: impl Fn(usize, usize) -> bool) -> Vec<UsageEntry> {
        self.entries.iter().copied().filter(|e| has(e.layer as usize, e.expert as usize)).collect()
    }

    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + 16 * self.entries.len());
        out.extend_from_slice(&USAGE_MAGIC.to_le_bytes());
        out.extend_from_slice(&USAGE_VERSION.to_le_bytes());
        out.extend_from_slice(&self.total_tokens.to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.layer.to_le_bytes());
            out.extend_from_slice(&e.expert.to_le_bytes());
            out.extend_from_slice(&e.hits.to_le_bytes());
            out.extend_from_slice(&e.last_seen.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip(total in any::<u64>(), es in proptest::collection::vec(any::<(u16, u16, u32, u32)>(), 0..50)) {
            let u = Usage { total_tokens: total, entries: es.iter().map(|&(layer, expert, hits, last_seen)| UsageEntry { layer, expert, hits, last_seen }).collect() };
            prop_assert_eq!(Usage::parse(&u.encode()).unwrap(), u);
        }
        /// Mutations of a valid file (past the magic, so the parser's
        /// logic is reached): never a panic; what parses re-encodes to itself.
        #[test]
        fn mutated_valid_files_never_panic(
            es in proptest::collection::vec(any::<(u16, u16, u32, u32)>(), 0..20),
            edits in proptest::collection::vec((any::<u16>(), any::<u8>()), 0..6),
            cut in proptest::option::of(0usize..400),
            extra in proptest::collection::vec(any::<u8>(), 0..24),
        ) {
            let u = Usage { total_tokens: 7, entries: es.iter().map(|&(layer, expert, hits, last_seen)| UsageEntry { layer, expert, hits, last_seen }).collect() };
            let mut b = u.encode();
            for &(pos, v) in &edits {
                let at = 4 + pos as usize % (b.len() - 4);
                b[at] = v;
            }
            if let Some(c) = cut {
                b.truncate(c.max(4).min(b.len()));
            }
            b.extend(&extra);
            if let Ok(p) = Usage::parse(&b) {
                prop_assert_eq!(Usage::parse(&p.encode()).unwrap(), p);
            }
        }
    }

    #[test]
    fn foreign_entries_are_skipped() {
        let u = Usage {
            total_tokens: 3,
            entries: vec![
                UsageEntry { layer: 1, expert: 2, hits: 5, last_seen: 1 },
                UsageEntry { layer: 99, expert: 0, hits: 9, last_seen: 2 },
            ],
        };
        assert_eq!(u.filtered(|l, e| l < 4 && e < 8).len(), 1);
        assert!(Usage::parse(b"WUSG").is_err());
    }
}
