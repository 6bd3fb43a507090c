//! A file opened for direct (cache-bypassing) positional reads.

use crate::{AlignedBuf, Error, Result, ALIGN};
use std::fs::File;
use std::path::{Path, PathBuf};

/// A read-only file for positional reads, direct where the OS allows.
#[derive(Debug)]
pub struct DirectFile {
    file: File,
    path: PathBuf,
    direct: bool,
    len: u64,
}

impl DirectFile {
    /// Open `path`. With `want_direct`, try to bypass the page cache; a
    /// probe read verifies the transfer works (some filesystems accept
    /// `O_DIRECT` and fail the read), else fall back to buffered reads with
    /// random-access advice. [`DirectFile::is_direct`] says which was obtained.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file when it cannot be opened or sized.
    pub fn open(path: &Path, want_direct: bool) -> Result<DirectFile> {
        let io = |op, e| Error::Io { path: path.to_path_buf(), op, source: e };
        let buffered = File::open(path).map_err(|e| io("open", e))?;
        let len = buffered.metadata().map_err(|e| io("stat", e))?.len();
        if want_direct {
            if let Some(f) = open_direct(path, len) {
                return Ok(DirectFile { file: f, path: path.into(), direct: true, len });
            }
        }
        advise_random(&buffered);
        Ok(DirectFile { file: buffered, path: path.into(), direct: false, len })
    }

    /// Whether reads bypass the OS page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }
    /// File length at open.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tell the OS that `len` bytes from `offset` will be read soon, so it
    /// starts reading them in the background (`posix_fadvise(WILLNEED)` on
    /// Linux, `F_RDADVISE` on macOS). Only buffered files: a direct file has
    /// no page cache to fill. Advisory — a refusal changes nothing.
    pub fn will_need(&self, offset: u64, len: u64) {
        if self.direct || len == 0 {
            return;
        }
        let end = offset.saturating_add(len).min(self.len);
        if offset < end {
            will_need(&self.file, offset, end - offset);
        }
    }

    /// Tell the OS that `len` bytes from `offset` will not be read again
    /// soon, so their page-cache copy may go (`posix_fadvise(DONTNEED)` on
    /// Linux; nothing elsewhere): a streamed trunk layer is read once a
    /// token, and its pages would otherwise fill the machine's memory
    /// beside the process's budget. Advisory — a refusal changes nothing.
    pub fn dont_need(&self, offset: u64, len: u64) {
        if self.direct || len == 0 {
            return;
        }
        let end = offset.saturating_add(len).min(self.len);
        if offset < end {
            dont_need(&self.file, offset, end - offset);
        }
    }

    /// Fill `buf` from `offset`. Direct files need a 4 KiB-aligned offset,
    /// buffer and length. A file that ends early is a [`Error::ShortRead`].
    ///
    /// # Errors
    /// [`Error::Misaligned`] for an unaligned direct read, [`Error::ShortRead`] when the file ends first, [`Error::Io`] otherwise.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        if self.direct
            && (!offset.is_multiple_of(ALIGN as u64)
                || !buf.len().is_multiple_of(ALIGN)
                || !(buf.as_ptr() as usize).is_multiple_of(ALIGN))
        {
            return Err(Error::Misaligned { path: self.path.clone(), offset, len: buf.len() });
        }
        let mut done = 0usize;
        while done < buf.len() {
            match pread(&self.file, &mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    return Err(Error::ShortRead { path: self.path.clone(), offset, wanted: buf.len(), got: done })
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::Io { path: self.path.clone(), op: "read", source: e }),
            }
        }
        Ok(())
    }

    /// Read `len` bytes at any `offset` (aligning internally when direct).
    /// For small metadata reads (an embedding row, a tensor), not the hot path.
    ///
    /// # Errors
    /// As [`DirectFile::read_exact_at`].
    pub fn read_vec_at(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        if !self.direct {
            let mut v = vec![0u8; len];
            self.read_exact_at(&mut v, offset)?;
            return Ok(v);
        }
        let start = offset / ALIGN as u64 * ALIGN as u64;
        let end = offset.checked_add(len as u64).ok_or_else(|| Error::ShortRead {
            path: self.path.clone(),
            offset,
            wanted: len,
            got: 0,
        })?;
        if end > self.len {
            return Err(Error::ShortRead {
                path: self.path.clone(),
                offset,
                wanted: len,
                got: self.len.saturating_sub(offset) as usize,
            });
        }
        // the aligned window may run past EOF; read only whole pages within the file, the tail buffered
        let aend = end.div_ceil(ALIGN as u64) * ALIGN as u64;
        let mut b = AlignedBuf::new((aend - start) as usize, false);
        let full = ((self.len - start) / ALIGN as u64 * ALIGN as u64).min(aend - start) as usize;
        self.read_exact_at(&mut b[..full], start)?;
        if full < (end - start) as usize {
            let f = File::open(&self.path).map_err(|e| Error::Io { path: self.path.clone(), op: "open", source: e })?;
            let tail = &mut b[full..(end - start) as usize];
            let mut done = 0;
            while done < tail.len() {
                match pread(&f, &mut tail[done..], start + (full + done) as u64) {
                    Ok(0) => {
                        return Err(Error::ShortRead { path: self.path.clone(), offset, wanted: len, got: full + done })
                    }
                    Ok(n) => done += n,
                    Err(e) => return Err(Error::Io { path: self.path.clone(), op: "read", source: e }),
                }
            }
        }
        let s = (offset - start) as usize;
        Ok(b[s..s + len].to_vec())
    }
}

#[cfg(unix)]
fn pread(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<usize> {
    std::os::unix::fs::FileExt::read_at(f, buf, off)
}
#[cfg(windows)]
fn pread(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<usize> {
    std::os::windows::fs::FileExt::seek_read(f, buf, off)
}

#[cfg(target_os = "linux")]
fn open_direct(path: &Path, len: u64) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).ok()?;
    if len >= ALIGN as u64 {
        let mut probe = AlignedBuf::new(ALIGN, false);
        if pread(&f, &mut probe, 0).ok()? != ALIGN {
            return None;
        }
    }
    Some(f)
}

#[cfg(target_os = "macos")]
fn open_direct(path: &Path, _len: u64) -> Option<File> {
    use std::os::unix::io::AsRawFd;
    let f = File::open(path).ok()?;
    // SAFETY: fcntl on a descriptor we own; these commands take an int.
    let ok = unsafe {
        libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) == 0 && libc::fcntl(f.as_raw_fd(), libc::F_RDAHEAD, 0) == 0
    };
    ok.then_some(f)
}

#[cfg(windows)]
fn open_direct(path: &Path, _len: u64) -> Option<File> {
    use std::os::windows::fs::OpenOptionsExt;
    const FILE_FLAG_NO_BUFFERING: u32 = 0x2000_0000;
    std::fs::OpenOptions::new().read(true).custom_flags(FILE_FLAG_NO_BUFFERING).open(path).ok()
}

#[cfg(not(any(target_os = "linux", target_os = "macos", windows)))]
fn open_direct(_path: &Path, _len: u64) -> Option<File> {
    None
}

#[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
fn advise_random(f: &File) {
    use std::os::unix::io::AsRawFd;
    // SAFETY: advisory call on a descriptor we own.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM);
    }
}
#[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
fn advise_random(_f: &File) {}

#[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
fn will_need(f: &File, offset: u64, len: u64) {
    use std::os::unix::io::AsRawFd;
    let (Ok(off), Ok(n)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else { return };
    // SAFETY: advisory call on a descriptor we own.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), off, n, libc::POSIX_FADV_WILLNEED);
    }
}
#[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
fn dont_need(f: &File, offset: u64, len: u64) {
    use std::os::unix::io::AsRawFd;
    let (Ok(off), Ok(n)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else { return };
    // SAFETY: advisory call on a descriptor we own.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), off, n, libc::POSIX_FADV_DONTNEED);
    }
}
#[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
fn dont_need(_f: &File, _offset: u64, _len: u64) {}
#[cfg(target_os = "macos")]
fn will_need(f: &File, offset: u64, len: u64) {
    use std::os::unix::io::AsRawFd;
    // F_RDADVISE takes an int count: advise in pieces of at most 1 GiB
    // (the range is bounded by the file's length, so the loop is too).
    const PIECE: u64 = 1 << 30;
    let mut at = offset;
    while at < offset + len {
        let n = (offset + len - at).min(PIECE);
        let Ok(ra_offset) = libc::off_t::try_from(at) else { return };
        let ra = libc::radvisory { ra_offset, ra_count: n as libc::c_int };
        // SAFETY: fcntl on a descriptor we own with a valid radvisory.
        unsafe {
            libc::fcntl(f.as_raw_fd(), libc::F_RDADVISE, &ra);
        }
        at += n;
    }
}
#[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd", target_os = "macos")))]
fn will_need(_f: &File, _offset: u64, _len: u64) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn tmpfile(len: usize) -> PathBuf {
        let p = std::env::temp_dir().join(format!("waste-io-test-{}-{len}", std::process::id()));
        let mut f = File::create(&p).unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        f.write_all(&data).unwrap();
        p
    }

    #[test]
    fn reads_match_and_short_reads_are_detected() {
        let p = tmpfile(3 * ALIGN + 100);
        for direct in [false, true] {
            let f = DirectFile::open(&p, direct).unwrap();
            let mut b = AlignedBuf::new(2 * ALIGN, false);
            f.read_exact_at(&mut b, ALIGN as u64).unwrap();
            assert!(b.iter().enumerate().all(|(i, &x)| x == ((i + ALIGN) * 7 + 3) as u8));
            let mut b = AlignedBuf::new(ALIGN, false);
            let e = f.read_exact_at(&mut b, 3 * ALIGN as u64).unwrap_err();
            assert!(matches!(e, Error::ShortRead { got: 100, .. }), "{e}");
            // read-ahead advice is only advice: any range (past the end,
            // overflowing, empty), on either kind of file, changes no byte
            f.will_need(0, u64::MAX);
            f.will_need(u64::MAX - 1, 10);
            f.will_need(ALIGN as u64, 0);
            let v = f.read_vec_at(5, 3 * ALIGN + 90).unwrap();
            assert!(v.iter().enumerate().all(|(i, &x)| x == ((i + 5) * 7 + 3) as u8));
            assert!(f.read_vec_at(3 * ALIGN as u64, 101).is_err());
        }
        std::fs::remove_file(p).ok();
    }
}
