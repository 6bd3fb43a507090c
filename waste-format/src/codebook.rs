//! `codebooks.bin`: equal-size records of a 16-byte header + f16 entries.

use crate::error::{Error, Result};
use crate::record::ExpertQuant;

/// Codebook record magic "WCBK".
pub const CODEBOOK_MAGIC: u32 = 0x4B42_4357;
/// Codebook header length.
pub const CODEBOOK_HEADER_LEN: usize = 16;

/// All codebooks of a container, validated, entries kept as raw f16 bits.
#[derive(Clone, Debug, Default)]
pub struct Codebooks {
    /// Number of books.
    pub count: usize,
    /// Entries per book.
    pub entries: usize,
    /// Vector length.
    pub vec_dim: usize,
    /// `count × entries × vec_dim` f16 bit patterns.
    pub data: Vec<u16>,
}

impl Codebooks {
    /// Size in bytes of one codebook record for a scheme.
    pub fn record_len(q: &ExpertQuant) -> usize {
        CODEBOOK_HEADER_LEN + q.entries * q.vec_dim * 2
    }

    /// Parse and validate the whole file's bytes.
    ///
    /// # Errors
    /// [`Error::Codebook`] for a length that is not whole records, a record
    /// whose header or size is wrong, or an entry that is not finite.
    pub fn parse(bytes: &[u8], q: &ExpertQuant) -> Result<Codebooks> {
        let rl = Self::record_len(q);
        if !bytes.len().is_multiple_of(rl) {
            return Err(Error::Codebook {
                id: bytes.len() / rl,
                msg: format!("codebooks.bin size {} is not a multiple of the {rl}-byte record", bytes.len()),
            });
        }
        let count = bytes.len() / rl;
        let per = q.entries * q.vec_dim;
        let mut data = Vec::with_capacity(count * per);
        for (id, rec) in bytes.chunks_exact(rl).enumerate() {
            let u32_at = |o: usize| u32::from_le_bytes([rec[o], rec[o + 1], rec[o + 2], rec[o + 3]]);
            let err = |msg: String| Err(Error::Codebook { id, msg });
            if u32_at(0) != CODEBOOK_MAGIC {
                return err(format!("bad magic 0x{:08x}", u32_at(0)));
            }
            let cid = u16::from_le_bytes([rec[4], rec[5]]) as usize;
            if cid != id % 65536 {
                return err(format!("header says codebook {cid}"));
            }
            if rec[7] as usize != q.vec_dim || u32_at(8) as usize != q.entries {
                return err(format!(
                    "vec_dim {} entries {} disagree with expert_quant ({} / {})",
                    rec[7],
                    u32_at(8),
                    q.vec_dim,
                    q.entries
                ));
            }
            let at = data.len();
            data.extend(rec[CODEBOOK_HEADER_LEN..].chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])));
            // an infinite or NaN entry would make every lookup of it NaN
            if let Some(i) = data[at..].iter().position(|&h| !crate::half::f16_is_finite(h)) {
                return err(format!(
                    "entry {} (element {}) is not finite (f16 0x{:04x})",
                    i / q.vec_dim,
                    i % q.vec_dim,
                    data[at + i]
                ));
            }
        }
        Ok(Codebooks { count, entries: q.entries, vec_dim: q.vec_dim, data })
    }

    /// The f16 bits of book `id` (`entries × vec_dim`).
    pub fn book(&self, id: usize) -> Option<&[u16]> {
        let per = self.entries * self.vec_dim;
        self.data.get(id * per..(id + 1) * per)
    }

    /// Encode one codebook record.
    pub fn encode_record(id: usize, q: &ExpertQuant, entries_f16: &[u16], out: &mut Vec<u8>) {
        out.extend_from_slice(&CODEBOOK_MAGIC.to_le_bytes());
        out.extend_from_slice(&(id as u16).to_le_bytes());
        out.push(q.fmt.byte());
        out.push(q.vec_dim as u8);
        out.extend_from_slice(&(q.entries as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for &h in entries_f16 {
            out.extend_from_slice(&h.to_le_bytes());
        }
    }
}
