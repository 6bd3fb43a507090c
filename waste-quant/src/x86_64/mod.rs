//! x86_64 SIMD kernels (one module per ISA, same functions as `scalar`).
pub mod avx2;
pub mod avx512;
pub mod fast;
pub mod gathers;

/// How far ahead of the weights being read a one-row matvec prefetches,
/// in bytes of the same stream (rows are contiguous, so past a row's end
/// this is the next rows'). Intel's server cores stall on a lone sequential
/// stream: the Q8G LM head ran at 5.4 GB/s on one thread against 8.5 the
/// bandwidth probe reads, and 3–8 KiB ahead all gave 7.8–9.8
/// (docs/lab/, "Prefetch ahead in one-row matvecs").
const ROW_PREFETCH: usize = 4096;

/// Prefetch, [`ROW_PREFETCH`] bytes ahead, each 64-byte line that starts
/// inside the block of `len` bytes at offset `off` of the row bytes `rb`
/// (so a row's blocks issue one prefetch per line, whatever their size).
/// A hint: past the matrix's end it fetches nothing and never faults.
#[inline(always)]
fn prefetch_ahead(rb: *const u8, off: usize, len: usize) {
    let mut o = off.next_multiple_of(64);
    while o < off + len {
        // SAFETY: a prefetch never faults and reads nothing architecturally.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                rb.wrapping_add(o + ROW_PREFETCH) as *const i8
            )
        };
        o += 64;
    }
}

/// [`prefetch_ahead`] for blocks of a size dividing 64 (16 or 32 bytes:
/// the fast kernels' Q4G and Q8G blocks): the one line, if any, that starts
/// at `off` — a test and no loop, which in the AVX2 fast matmat's block
/// loop cost 5–7 % (docs/lab entry 70).
#[inline(always)]
fn prefetch_block(rb: *const u8, off: usize, len: usize) {
    debug_assert!(64usize.is_multiple_of(len) && off.is_multiple_of(len));
    if off.is_multiple_of(64) {
        // SAFETY: a prefetch never faults and reads nothing architecturally.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                rb.wrapping_add(off + ROW_PREFETCH) as *const i8
            )
        };
    }
}
