//! Aligned heap buffers.
//!
//! Small buffers come from the allocator (zeroed). Buffers of
//! [`LAZY_MIN`] bytes or more are anonymous mappings on Unix: the OS hands
//! out zero pages on first touch, so reserving a multi-GB expert cache costs
//! no time at open and no resident memory until a slot is first written.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Buffers at least this large are reserved lazily (Unix anonymous mapping).
pub const LAZY_MIN: usize = 1 << 20;

/// A zeroed buffer aligned to 4 KiB (or 2 MiB when huge pages were asked for
/// and the buffer is at least that big), usable for direct I/O.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// Usable capacity from `ptr` (a multiple of the alignment).
    cap: usize,
    backing: Backing,
    huge: bool,
}

enum Backing {
    Heap(Layout),
    /// An anonymous mapping: `base` and `size` as returned by mmap (the
    /// aligned window starts at `ptr`, inside it).
    #[cfg(unix)]
    Map {
        base: *mut u8,
        size: usize,
    },
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>; the raw
// base pointer of a mapping is only used to unmap it in Drop.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocate `len` zeroed bytes (rounded up to 4 KiB for the allocation).
    /// With `huge`, buffers ≥ 2 MiB are 2 MiB-aligned and advised as huge pages.
    ///
    /// # Panics
    /// If the size overflows or the memory cannot be had (like `Vec`); use
    /// [`AlignedBuf::try_new`] for sizes that come from input.
    pub fn new(len: usize, huge: bool) -> AlignedBuf {
        Self::try_new(len, huge).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`AlignedBuf::new`] with the size checked: an overflowing size or a
    /// refused allocation is an error, never a smaller buffer.
    ///
    /// # Errors
    /// [`crate::Error::Alloc`] when `len` rounded up to the alignment
    /// overflows, or the OS refuses the memory.
    pub fn try_new(len: usize, huge: bool) -> crate::Result<AlignedBuf> {
        let want_huge = huge && len >= crate::HUGE_PAGE;
        let align = if want_huge { crate::HUGE_PAGE } else { crate::ALIGN };
        let err = || crate::Error::Alloc { len };
        let cap = capacity(len, align)?;
        #[cfg(unix)]
        if cap >= LAZY_MIN {
            let (base, size, ptr) = map_aligned(cap, align).ok_or_else(err)?;
            let huge = want_huge && advise_huge(ptr, cap);
            return Ok(AlignedBuf { ptr, len, cap, backing: Backing::Map { base, size }, huge });
        }
        let layout = Layout::from_size_align(cap, align).map_err(|_| err())?;
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(err)?;
        let huge = want_huge && advise_huge(ptr, cap);
        Ok(AlignedBuf { ptr, len, cap, backing: Backing::Heap(layout), huge })
    }
    /// `len` zeroed bytes starting on a 2 MiB boundary, huge pages asked
    /// for behind every whole 2 MiB of them, the tail (under 2 MiB) in
    /// 4 KiB pages: a long-lived buffer of a few MiB (a trunk matrix) wholly
    /// in huge pages but its last partial one, which a buffer rounded up to
    /// 2 MiB ([`AlignedBuf::new`]) would fill to a whole huge page once
    /// touched. The allocator's buffers start anywhere: advised afterwards
    /// ([`advise_huge_pages`]) a 4.9 MB matrix got one huge page of its two
    /// (docs/lab entry 78). Below 2 MiB, [`AlignedBuf::new`] without huge pages.
    ///
    /// # Errors
    /// As [`AlignedBuf::try_new`].
    pub fn try_huge_blocks(len: usize) -> crate::Result<AlignedBuf> {
        let whole = len / crate::HUGE_PAGE * crate::HUGE_PAGE;
        #[cfg(unix)]
        if whole > 0 {
            let cap = capacity(len, crate::ALIGN)?;
            let (base, size, ptr) = map_aligned(cap, crate::HUGE_PAGE).ok_or(crate::Error::Alloc { len })?;
            let huge = advise_huge(ptr, whole);
            return Ok(AlignedBuf { ptr, len, cap, backing: Backing::Map { base, size }, huge });
        }
        let _ = whole;
        Self::try_new(len, false)
    }
    /// Whether huge pages were requested from the OS successfully.
    pub fn is_huge(&self) -> bool {
        self.huge
    }
    /// Allocated capacity (a multiple of the alignment).
    pub fn capacity(&self) -> usize {
        self.cap
    }
    /// The whole allocation, including the rounding tail.
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is `cap` bytes from ptr, exclusively ours.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

/// `len` rounded up to `align` (at least one unit), refused when that
/// overflows or passes half the address space.
fn capacity(len: usize, align: usize) -> crate::Result<usize> {
    let err = || crate::Error::Alloc { len };
    let cap = len.max(1).div_ceil(align).checked_mul(align).ok_or_else(err)?;
    if cap > isize::MAX as usize / 2 {
        return Err(err());
    }
    Ok(cap)
}

/// An anonymous private mapping of `cap` bytes aligned to `align`: maps
/// `cap + align` and returns (base, mapped size, aligned start).
#[cfg(unix)]
fn map_aligned(cap: usize, align: usize) -> Option<(*mut u8, usize, NonNull<u8>)> {
    let size = cap.checked_add(align)?;
    // SAFETY: a fresh anonymous mapping; no existing memory is touched.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let base = base.cast::<u8>();
    let skip = (align - (base as usize % align)) % align;
    // SAFETY: skip < align, so base + skip + cap ≤ base + size (inside the mapping).
    let ptr = unsafe { base.add(skip) };
    Some((base, size, NonNull::new(ptr)?))
}

/// Ask for 2 MiB pages behind the whole 2 MiB-aligned stretches of `buf`
/// (memory not yet touched gets them when it is first written; Linux with
/// transparent huge pages in `madvise` or `always` mode, elsewhere nothing
/// happens). For long-lived buffers the allocator gave, such as the trunk's
/// matrices: a matvec streams them, and 4 KiB pages cost a TLB walk every 4
/// KiB. Only a policy on memory this process owns: the contents are
/// unchanged (`T` may be `MaybeUninit`: nothing is read). Returns whether
/// the advice was taken (false when `buf` holds no whole aligned 2 MiB
/// stretch).
pub fn advise_huge_pages<T>(buf: &mut [T]) -> bool {
    let start = buf.as_mut_ptr().cast::<u8>();
    let a = start.align_offset(crate::HUGE_PAGE);
    let len = std::mem::size_of_val(buf);
    if a >= len {
        return false;
    }
    let whole = (len - a) / crate::HUGE_PAGE * crate::HUGE_PAGE;
    // SAFETY: a < len: inside the slice's bytes (never dereferenced here).
    let p = unsafe { start.add(a) };
    match NonNull::new(p) {
        Some(p) if whole > 0 => advise_huge(p, whole),
        _ => false,
    }
}

/// Bytes of this process's anonymous memory the OS backs with huge pages
/// now (`AnonHugePages` of `/proc/self/smaps_rollup`): what the advice of
/// [`advise_huge_pages`] and the huge [`AlignedBuf`]s actually obtained —
/// the OS may fall back to 4 KiB pages, and a VM may make the huge ones
/// slow to arrive (docs/ENGINE.md, "Memory"). `None` off Linux, or when
/// the file is missing or unreadable.
pub fn huge_page_bytes() -> Option<u64> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    std::fs::read_to_string("/proc/self/smaps_rollup").ok().as_deref().and_then(parse_anon_huge)
}

/// The `AnonHugePages:` line of an smaps file, in bytes (`None` without
/// one, when it is not `N kB`, or on overflow).
fn parse_anon_huge(smaps: &str) -> Option<u64> {
    let rest = smaps.lines().find_map(|l| l.strip_prefix("AnonHugePages:"))?;
    let mut words = rest.split_whitespace();
    let kb = words.next()?.parse::<u64>().ok()?;
    (words.next() == Some("kB") && words.next().is_none()).then_some(())?;
    kb.checked_mul(1024)
}

#[cfg(target_os = "linux")]
fn advise_huge(ptr: NonNull<u8>, len: usize) -> bool {
    // SAFETY: madvise on memory we own; MADV_HUGEPAGE only changes backing policy.
    unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) == 0 }
}
#[cfg(not(target_os = "linux"))]
fn advise_huge(_: NonNull<u8>, _: usize) -> bool {
    false
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: allocated with this layout in `try_new`.
            Backing::Heap(layout) => unsafe { dealloc(self.ptr.as_ptr(), layout) },
            #[cfg(unix)]
            Backing::Map { base, size } => {
                // SAFETY: base/size are exactly what mmap returned; nothing
                // borrows the buffer any more (we are in Drop).
                unsafe { libc::munmap(base.cast(), size) };
            }
        }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: len ≤ capacity, memory initialized (zeroed), owned.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}
impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes, huge={})", self.len, self.huge)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Advice only for the whole aligned 2 MiB stretches inside the slice
    /// (a slice under 2 MiB holds none, a 6 MiB one at least two), taken
    /// on Linux with transparent huge pages built in; the bytes unchanged.
    #[test]
    fn huge_page_advice_covers_whole_stretches_only() {
        let thp = cfg!(target_os = "linux") && std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists();
        assert!(!advise_huge_pages::<u8>(&mut []));
        let mut small: Vec<u8> = (0..(1 << 20)).map(|i| i as u8).collect();
        assert!(!advise_huge_pages(&mut small));
        let mut big: Vec<u8> = (0..(6 << 20)).map(|i| (i * 7) as u8).collect();
        assert_eq!(advise_huge_pages(&mut big), thp);
        assert!(big.iter().enumerate().all(|(i, &b)| b == (i * 7) as u8) && small[12345] == 12345u32 as u8);
        // untouched capacity too: how the trunk reader asks before its reads
        let mut v: Vec<u8> = Vec::with_capacity(6 << 20);
        assert_eq!(advise_huge_pages(v.spare_capacity_mut()), thp);
    }
    /// The `AnonHugePages` line in bytes, from smaps_rollup's own format;
    /// anything else is no figure.
    #[test]
    fn anon_huge_pages_are_read_from_their_line() {
        let rollup = "55d0c0a00000-7ffd2b5f2000 ---p 00000000 00:00 0                          [rollup]\n\
                      Rss:             2408448 kB\nAnonymous:       2391040 kB\nAnonHugePages:   2244608 kB\n\
                      ShmemPmdMapped:        0 kB\n";
        assert_eq!(parse_anon_huge(rollup), Some(2244608 * 1024));
        assert_eq!(parse_anon_huge("AnonHugePages:        0 kB"), Some(0));
        for bad in [
            "Rss: 1 kB",
            "AnonHugePages: 12",
            "AnonHugePages: 12 MB",
            "AnonHugePages: x kB",
            "AnonHugePages: 18446744073709551615 kB",
        ] {
            assert_eq!(parse_anon_huge(bad), None, "{bad}");
        }
    }

    /// On Linux the figure exists, and grows by whole huge pages when an
    /// advised buffer is touched and the OS grants them (said when not:
    /// THP off, or no free 2 MiB block).
    #[test]
    fn huge_page_bytes_grow_by_whole_pages() {
        let Some(before) = huge_page_bytes() else {
            assert!(!cfg!(target_os = "linux") || !std::path::Path::new("/proc/self/smaps_rollup").exists());
            crate::skip::report_skip("huge page bytes (no smaps_rollup here)", false);
            return;
        };
        assert!(before.is_multiple_of(4096));
        let mut v: Vec<u8> = Vec::with_capacity(8 << 20);
        let advised = advise_huge_pages(v.spare_capacity_mut());
        v.resize(8 << 20, 1);
        let after = huge_page_bytes().unwrap();
        if advised && after > before {
            assert!(
                after - before >= crate::HUGE_PAGE as u64 && (after - before).is_multiple_of(crate::HUGE_PAGE as u64),
                "{before} -> {after}"
            );
        } else {
            let why =
                format!("huge page bytes (no huge page granted: {before} -> {after} bytes, advice taken: {advised})");
            crate::skip::report_skip(&why, false);
        }
        std::hint::black_box(&v);
    }

    /// A buffer of whole huge blocks and a tail: 2 MiB-aligned, zeroed,
    /// its capacity the length to 4 KiB (not to 2 MiB), and where the OS
    /// grants huge pages, exactly the whole blocks get them once touched —
    /// the tail stays in 4 KiB pages (its mapping's own `AnonHugePages`
    /// line in /proc/self/smaps).
    #[test]
    fn huge_blocks_cover_the_whole_blocks_only() {
        let len = (5 << 20) + 17;
        let zeroed = AlignedBuf::try_huge_blocks(len).unwrap();
        assert!(zeroed.iter().all(|&x| x == 0));
        let small = AlignedBuf::try_huge_blocks(100_000).unwrap();
        assert!(small.len() == 100_000 && !small.is_huge() && small.iter().all(|&x| x == 0));
        // written before any read (a read first maps the zero page)
        let mut b = AlignedBuf::try_huge_blocks(len).unwrap();
        assert_eq!(b.as_ptr() as usize % crate::HUGE_PAGE, 0);
        assert_eq!((b.len(), b.capacity()), (len, len.div_ceil(crate::ALIGN) * crate::ALIGN));
        b.fill(3);
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            crate::skip::report_skip("huge blocks' pages (no /proc/self/smaps here)", false);
            return;
        };
        // the mapping that starts at the buffer: the advised whole blocks
        let start = format!("{:x}-", b.as_ptr() as usize);
        let vma: Vec<&str> = smaps
            .lines()
            .skip_while(|l| !l.starts_with(&start))
            .skip(1)
            .take_while(|l| !l.contains('-') || l.contains(':'))
            .collect();
        let huge_kb = vma
            .iter()
            .find_map(|l| l.strip_prefix("AnonHugePages:"))
            .and_then(|v| v.trim().strip_suffix(" kB"))
            .and_then(|v| v.trim().parse::<u64>().ok());
        match huge_kb {
            Some(kb) if b.is_huge() && kb > 0 => assert_eq!(kb * 1024, 4 << 20, "the two whole blocks, not the tail"),
            _ => crate::skip::report_skip(
                &format!("huge blocks' pages (advice {}, {huge_kb:?} kB granted)", b.is_huge()),
                false,
            ),
        }
        std::hint::black_box(&b);
    }

    #[test]
    fn aligned_and_zeroed() {
        for len in [1, 4095, 4096, 10_000, LAZY_MIN - 1, LAZY_MIN, 3 << 20, (5 << 20) + 17] {
            for huge in [false, true] {
                let mut b = AlignedBuf::new(len, huge);
                assert_eq!(b.as_ptr() as usize % crate::ALIGN, 0);
                assert_eq!(b.len(), len);
                assert!(b.iter().all(|&x| x == 0));
                if huge && len >= crate::HUGE_PAGE {
                    assert_eq!(b.as_ptr() as usize % crate::HUGE_PAGE, 0);
                }
                // every byte writable, the last one included
                b[len - 1] = 7;
                assert_eq!(b[len - 1], 7);
                b[0] = 9;
                assert_eq!(b[0], 9);
                let cap = b.capacity();
                assert!(cap >= len && cap.is_multiple_of(crate::ALIGN));
                b.full_mut()[cap - 1] = 1;
            }
        }
    }

    #[test]
    fn overflowing_sizes_are_errors_not_small_buffers() {
        for len in [usize::MAX, usize::MAX - 4095, isize::MAX as usize] {
            for huge in [false, true] {
                assert!(matches!(AlignedBuf::try_new(len, huge), Err(crate::Error::Alloc { .. })), "{len}");
            }
        }
    }

    /// Bytes of `b` resident in memory (Linux `mincore`, 4 KiB pages): the
    /// buffer's own pages, unlike the process's RSS, which the tests running
    /// beside it move.
    #[cfg(target_os = "linux")]
    pub(crate) fn resident(b: &AlignedBuf) -> usize {
        let page = 4096;
        let n = b.capacity() / page;
        let mut v = vec![0u8; n];
        // SAFETY: the buffer's own range; `v` holds one byte per page.
        let r = unsafe { libc::mincore(b.as_ptr() as *mut libc::c_void, b.capacity(), v.as_mut_ptr()) };
        assert_eq!(r, 0);
        v.iter().filter(|&&x| x & 1 == 1).count() * page
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn large_buffers_are_not_resident_until_touched() {
        let mut b = AlignedBuf::new(512 << 20, false);
        let reserved = resident(&b);
        // touching 8 MiB of it makes (about) 8 MiB resident
        for i in (0..8 << 20).step_by(4096) {
            b[i] = 1;
        }
        let touched = resident(&b);
        assert!(reserved < 64 << 20, "512 MiB reserved made {} KiB resident", reserved >> 10);
        assert!(touched >= reserved + (6 << 20), "touching 8 MiB added only {} KiB", (touched - reserved) >> 10);
    }
}
