//! A counting global allocator for tests that bound memory (included by
//! `#[path]` from `waste-tokenizer/tests/working_memory.rs` and
//! `waste-serve/tests/json_cost.rs`). Its counters are process-wide: a test
//! binary that includes it holds one test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

struct Counting;
/// Bytes allocated and not yet freed.
pub static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters only observe the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(l.size(), Relaxed) + l.size();
        PEAK.fetch_max(live, Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // counted as the copy it may be: old and new at once
        let live = LIVE.fetch_add(new, Relaxed) + new;
        PEAK.fetch_max(live, Relaxed);
        let q = unsafe { System.realloc(p, l, new) };
        LIVE.fetch_sub(l.size(), Relaxed);
        q
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Peak bytes allocated above the live ones while `f` runs (its result
/// included), and the result.
pub fn peak_during<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let r = f();
    (PEAK.load(Relaxed) - base, r)
}
