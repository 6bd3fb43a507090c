//! Streaming detokenization.

/// Turns a stream of token byte strings into text, holding back a trailing
/// incomplete UTF-8 character until it completes (a definitely invalid
/// sequence becomes U+FFFD, once).
#[derive(Default, Debug, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// A new decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed one token's bytes; returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // SAFETY-free: the prefix is valid UTF-8 by construction
                    out.push_str(std::str::from_utf8(&self.pending[..good]).unwrap_or_default());
                    match e.error_len() {
                        None => {
                            // incomplete at the end: keep it for the next token
                            self.pending.drain(..good);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
    }

    /// Flush whatever is held (an incomplete tail becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }

    /// Bytes held back.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_split_characters() {
        let mut d = StreamDecoder::new();
        let e = "é😀".as_bytes();
        assert_eq!(d.push(&e[..1]), "");
        assert_eq!(d.push(&e[1..3]), "é");
        assert_eq!(d.push(&e[3..5]), "");
        assert_eq!(d.push(&e[5..]), "😀");
        assert_eq!(d.push(&[0xff, b'a']), "\u{FFFD}a");
        assert_eq!(d.push(&[0xe2, 0x82]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
