//! # waste-io
//!
//! Direct, aligned, positional I/O for streaming experts from NVMe:
//! Linux `O_DIRECT` (with a probe read, falling back to buffered reads with
//! `POSIX_FADV_RANDOM`), macOS `F_NOCACHE` + `F_RDAHEAD 0`, Windows
//! `FILE_FLAG_NO_BUFFERING`; page-aligned (optionally 2 MiB huge-page)
//! buffers; short-read detection; a pool of reader threads with two
//! priorities (demand before speculative); a disk bandwidth probe.
//!
//! ```no_run
//! # fn example() -> waste_io::Result<()> {
//! use waste_io::{AlignedBuf, DirectFile};
//! let f = DirectFile::open("model.waste/experts-L1.bin".as_ref(), true)?;
//! let mut buf = AlignedBuf::new(4096, false);
//! f.read_exact_at(&mut buf, 0)?;
//! println!("direct I/O: {}", f.is_direct());
//! # Ok(()) }
//! ```
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod buf;
mod file;
mod pool;
mod prefault;
mod probe;
/// Reporting a check this machine cannot run (shared with the SIMD suites).
#[cfg(test)]
#[path = "../../waste-quant/tests/support/skip.rs"]
mod skip;

pub use buf::{advise_huge_pages, huge_page_bytes, AlignedBuf};
pub use file::DirectFile;
pub use pool::{user_initiated_qos, Priority, ReaderPool, Ticket};
pub use prefault::Prefault;
pub use probe::{
    probe_bandwidth, read_bandwidth, read_repeats, ProbeResult, PROBE_MAX_BUFFERS, PROBE_MAX_QD,
    READ_PROBE_MAX_REPEATS, READ_PROBE_MIN_BYTES,
};

use std::path::PathBuf;

/// I/O alignment (and the unit every direct transfer is a multiple of).
pub const ALIGN: usize = 4096;
/// Huge page size used for large buffers.
pub const HUGE_PAGE: usize = 2 << 20;

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An OS error on a file.
    #[error("{path}: {op}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file ended before the requested range.
    #[error("{path}: short read at offset {offset}: wanted {wanted} bytes, got {got}")]
    ShortRead {
        /// File.
        path: PathBuf,
        /// Offset of the read.
        offset: u64,
        /// Bytes requested.
        wanted: usize,
        /// Bytes obtained.
        got: usize,
    },
    /// A direct read with an unaligned buffer, offset or length.
    #[error("{path}: direct read at offset {offset} of {len} bytes is not {ALIGN}-aligned")]
    Misaligned {
        /// File.
        path: PathBuf,
        /// Offset.
        offset: u64,
        /// Length.
        len: usize,
    },
    /// The reader pool was shut down.
    #[error("reader pool is shut down")]
    Closed,
    /// The OS refused to start a thread (a process or memory limit).
    #[error("cannot start a {what} thread: {source}")]
    Thread {
        /// Which thread: "reader", "compute".
        what: &'static str,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// An argument out of its range (the message names it and the range).
    #[error("{0}")]
    Arg(String),
    /// A buffer of this size cannot be had: its size overflows, or the OS
    /// refused the memory.
    #[error("cannot allocate an aligned buffer of {len} bytes")]
    Alloc {
        /// Bytes requested.
        len: usize,
    },
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
