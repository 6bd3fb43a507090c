//! Atomic file replacement, and bounded reads of regular files.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::Path;

/// Write `bytes` to `path` atomically: a temp file in the same directory,
/// fsync, rename over the target, fsync the directory (best effort).
///
/// # Errors
/// [`Error::Io`] naming `path`; the temporary file is removed and the target is unchanged.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    res.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// Read a whole file that must be a regular file (a symlink to one is
/// fine; a device, FIFO or directory is refused) of at most `max` bytes.
/// The bound holds while reading, not by the size the OS reports, so a file
/// that grows, or lies about its length, cannot make this allocate more.
///
/// # Errors
/// An `InvalidData` I/O error naming the problem for a non-regular or
/// oversized file; the OS error otherwise.
pub fn read_regular(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let f = std::fs::File::open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "not a regular file"));
    }
    let mut out = Vec::with_capacity(meta.len().min(max) as usize);
    f.take(max.saturating_add(1)).read_to_end(&mut out)?;
    if out.len() as u64 > max {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("larger than {max} bytes")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bounded_regular_files_are_read() {
        let d = std::env::temp_dir().join(format!("waste-readreg-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let f = d.join("a");
        std::fs::write(&f, b"hello").unwrap();
        assert_eq!(read_regular(&f, 5).unwrap(), b"hello");
        assert!(read_regular(&f, 4).unwrap_err().to_string().contains("larger than 4"));
        assert!(read_regular(&d, 100).is_err());
        #[cfg(unix)]
        {
            let z = d.join("zero");
            std::os::unix::fs::symlink("/dev/zero", &z).unwrap();
            assert!(read_regular(&z, 1 << 20).unwrap_err().to_string().contains("not a regular file"));
        }
        std::fs::remove_dir_all(&d).ok();
    }
}
