use std::path::PathBuf;

/// Everything that can go wrong reading or writing a container.
///
/// Every variant names *where* (file, key, tensor, layer/expert) and *why*,
/// so a damaged container is reported precisely, never as wrong text.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system I/O failure on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A manifest or config key is missing, mistyped or out of bounds.
    #[error("manifest key `{key}`: {msg}")]
    Manifest {
        /// Dotted key path, e.g. `config.hidden_size`.
        key: String,
        /// What is wrong, including the offending value.
        msg: String,
    },
    /// A trunk tensor entry is invalid or missing.
    #[error("tensor `{name}`: {msg}")]
    Tensor {
        /// Tensor name as in the manifest.
        name: String,
        /// What is wrong.
        msg: String,
    },
    /// An expert bank (file-level) problem.
    #[error("expert bank of layer {layer}: {msg}")]
    Bank {
        /// Layer index.
        layer: usize,
        /// What is wrong.
        msg: String,
    },
    /// One expert record is damaged.
    #[error("expert {expert} of layer {layer}: {msg}")]
    Record {
        /// Layer index.
        layer: usize,
        /// Expert id.
        expert: usize,
        /// What is wrong.
        msg: String,
    },
    /// A codebook record is damaged or out of range.
    #[error("codebook {id}: {msg}")]
    Codebook {
        /// Codebook index (record number in codebooks.bin).
        id: usize,
        /// What is wrong.
        msg: String,
    },
    /// The usage (hotlist) file is malformed.
    #[error("usage file: {msg}")]
    Usage {
        /// What is wrong.
        msg: String,
    },
    /// The container uses a feature this reader does not implement.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl Error {
    /// Shorthand for a manifest error.
    pub fn manifest(key: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Manifest { key: key.into(), msg: msg.into() }
    }
    /// Shorthand for a tensor error.
    pub fn tensor(name: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Tensor { name: name.into(), msg: msg.into() }
    }
    /// Shorthand for an expert-record error.
    pub fn record(layer: usize, expert: usize, msg: impl Into<String>) -> Self {
        Error::Record { layer, expert, msg: msg.into() }
    }
    /// Wrap an io::Error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
