//! # waste-tokenizer
//!
//! Byte-level BPE with tiktoken's semantics: a rank file (`tokenizer.model`
//! / `*.tiktoken`), a pre-tokenizer regex (Kimi's, o200k's or cl100k's),
//! rank-ordered merging identical to tiktoken's (in O(n log n), so a 1 MB
//! run of one character is fast), special tokens, and two entry points:
//!
//! * [`Tokenizer::encode_plain`] — special-token text stays ordinary text:
//!   for anything a user, a document or a tool wrote;
//! * [`Tokenizer::encode_markup`] — specials recognised: for templates.
//!
//! [`StreamDecoder`] holds back a piece that ends inside a UTF-8 character
//! until it is complete. [`ChatTemplate`] renders conversations with markup
//! and content encoded separately (never concatenated then encoded).
//!
//! ```
//! use waste_tokenizer::{Pattern, Tokenizer};
//! let ranks: Vec<(Vec<u8>, u32)> = (0u8..=255).map(|b| (vec![b], b as u32)).collect();
//! let t = Tokenizer::new(ranks, vec![(256, "<|end|>".into())], Pattern::O200k).unwrap();
//! assert_eq!(t.encode_markup("a<|end|>"), vec![97, 256]);
//! assert_eq!(t.encode_plain("a<|end|>").len(), 8);
//! ```
#![deny(missing_docs)]

mod bpe;
mod chat;
mod constraint;
mod decode;
pub mod k2;
pub mod xtml;

pub use bpe::{Pattern, Tokenizer, PRIVATE_REGEX_ABOVE, REGEX_ALLOWANCE};
pub use chat::{
    image_markup, render_jinja, set_jinja_renderer, ChatTemplate, JinjaRenderer, Message, MEDIA_BEGIN, MEDIA_CONTENT,
    MEDIA_END, MEDIA_PAD, TEMPLATE_FUEL, TEMPLATE_OUTPUT_BYTES, TEMPLATE_RECURSION,
};
pub use constraint::{ConstraintError, TokenConstraint};
pub use decode::StreamDecoder;

/// Errors of the tokenizer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A rank file line is malformed.
    #[error("{file}: line {line}: {msg}")]
    RankFile {
        /// File.
        file: String,
        /// 1-based line.
        line: usize,
        /// What is wrong.
        msg: String,
    },
    /// specials.json or chat.json is malformed.
    #[error("{file}: {msg}")]
    Json {
        /// File.
        file: String,
        /// What is wrong.
        msg: String,
    },
    /// An I/O error.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: String,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The pre-tokenizer pattern does not compile.
    #[error("pattern: {0}")]
    Pattern(String),
    /// A chat template failed to render.
    #[error("chat template: {0}")]
    Template(String),
    /// The vocabulary is inconsistent: two tokens share an id or a text, or
    /// an id lies outside the model's vocabulary.
    #[error("tokenizer: {0}")]
    Vocabulary(String),
}

/// Largest rank or specials file read (the 200K-token o200k file is 3.6 MB).
pub const MAX_TOKENIZER_FILE_BYTES: u64 = 64 << 20;
/// Largest chat template (`chat_template.jinja`, `chat.json`) read.
pub const MAX_TEMPLATE_BYTES: u64 = 1 << 20;

/// A regular UTF-8 file of at most `max` bytes (see [`waste_format::read_regular`]).
pub(crate) fn read_text(p: &std::path::Path, max: u64) -> Result<String> {
    let io = |e| Error::Io { path: p.display().to_string(), source: e };
    let b = waste_format::read_regular(p, max).map_err(io)?;
    String::from_utf8(b).map_err(|_| io(std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8")))
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
