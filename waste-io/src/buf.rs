//! Aligned heap buffers.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// A zeroed heap buffer aligned to 4 KiB (or 2 MiB when huge pages were
/// asked for and the buffer is at least that big), usable for direct I/O.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
    huge: bool,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocate `len` zeroed bytes (rounded up to 4 KiB for the allocation).
    /// With `huge`, buffers ≥ 2 MiB are 2 MiB-aligned and advised as huge pages.
    ///
    /// Panics only if the allocator fails (like `Vec`).
    pub fn new(len: usize, huge: bool) -> AlignedBuf {
        let want_huge = huge && len >= crate::HUGE_PAGE;
        let align = if want_huge { crate::HUGE_PAGE } else { crate::ALIGN };
        let cap = len.max(1).div_ceil(align) * align;
        let layout = Layout::from_size_align(cap, align).expect("buffer size overflows");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        let huge = want_huge && advise_huge(ptr, cap);
        AlignedBuf { ptr, len, layout, huge }
    }
    /// Whether huge pages were requested from the OS successfully.
    pub fn is_huge(&self) -> bool {
        self.huge
    }
    /// Allocated capacity (a multiple of the alignment).
    pub fn capacity(&self) -> usize {
        self.layout.size()
    }
    /// The whole allocation, including the rounding tail.
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is layout.size() bytes, exclusively ours.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
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
        // SAFETY: allocated with this layout in `new`.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
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
mod tests {
    use super::*;
    #[test]
    fn aligned_and_zeroed() {
        for len in [1, 4095, 4096, 10_000, 3 << 20] {
            let b = AlignedBuf::new(len, true);
            assert_eq!(b.as_ptr() as usize % crate::ALIGN, 0);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            if len >= crate::HUGE_PAGE {
                assert_eq!(b.as_ptr() as usize % crate::HUGE_PAGE, 0);
            }
        }
    }
}
