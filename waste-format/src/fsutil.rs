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

/// The folder a writer of the container (or folder) `out` works in until
/// it is complete: a sibling named `<out>.partial`, renamed to `out` in one
/// step (the converter and the synthetic-container writer).
pub fn staging_dir(out: &Path) -> std::path::PathBuf {
    let mut name = out.file_name().map(|n| n.to_os_string()).unwrap_or_else(|| "out".into());
    name.push(".partial");
    out.with_file_name(name)
}

/// [`write_atomic`] for a file this program owns at a path a user chose
/// (a saved state, a usage hotlist): whatever is already at `path` is
/// replaced only when it is empty or starts with `magic`, that is, when this
/// program wrote it. A file the user named by mistake (`/save notes.txt`) is
/// refused and left as it was.
///
/// # Errors
/// [`Error::Io`] naming `path`: an `AlreadyExists` error when something
/// else is there (`what` names the kind of file expected), else as
/// [`write_atomic`].
pub fn replace_own(path: &Path, bytes: &[u8], magic: &[u8], what: &str) -> Result<()> {
    use std::io::Read;
    let refuse = |why: String| {
        let msg = format!("{why}, not a {what}: choose another path (nothing was written)");
        Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::AlreadyExists, msg)))
    };
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(path, e)),
        Ok(m) if !m.is_file() => return refuse("it exists and is not a regular file".into()),
        Ok(m) if m.len() == 0 => {}
        Ok(_) => {
            let mut head = Vec::with_capacity(magic.len());
            std::fs::File::open(path)
                .and_then(|f| f.take(magic.len() as u64).read_to_end(&mut head))
                .map_err(|e| Error::io(path, e))?;
            if head != magic {
                return refuse("it exists".into());
            }
        }
    }
    write_atomic(path, bytes)
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
    fn only_own_or_empty_files_are_replaced() {
        let d = std::env::temp_dir().join(format!("waste-replown-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let f = d.join("f");
        // absent, then ours, then empty: written
        replace_own(&f, b"MAGI1", b"MAGI", "test file").unwrap();
        replace_own(&f, b"MAGI2", b"MAGI", "test file").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"MAGI2");
        std::fs::write(&f, b"").unwrap();
        replace_own(&f, b"MAGI3", b"MAGI", "test file").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"MAGI3");
        // someone else's file (also one shorter than the magic), and a directory: kept
        for other in [&b"notes"[..], b"MA"] {
            std::fs::write(&f, other).unwrap();
            let e = replace_own(&f, b"MAGI4", b"MAGI", "test file").unwrap_err().to_string();
            assert!(e.contains("exists, not a test file") && e.contains("nothing was written"), "{e}");
            assert_eq!(std::fs::read(&f).unwrap(), other);
        }
        let e = replace_own(&d, b"MAGI5", b"MAGI", "test file").unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1, "no temporary file left");
        std::fs::remove_dir_all(&d).ok();
    }

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
