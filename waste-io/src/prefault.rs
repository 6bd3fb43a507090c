//! Faulting a lazily mapped buffer's pages in, in the background, at idle
//! priority.
//!
//! A large [`AlignedBuf`] is an anonymous mapping: the OS zeroes each page
//! when it is first touched. For the expert cache that touch is a direct
//! read into a fresh slot, so the zeroing lands on the read's latency — on
//! the measuring VM it ran at 0.5–1.5 GB/s, as slow as the disk (see
//! docs/lab/). [`Prefault`] zeroes the pages ahead of use on a
//! thread of the lowest scheduling class (Linux `SCHED_IDLE`: it runs only
//! on a core nothing else wants, e.g. while the trunk loads or decode waits
//! for the disk), with `MADV_POPULATE_WRITE`, which faults pages in without
//! writing them: bytes already in the buffer — a read landing in a slot at
//! the same moment — are never changed. Resident memory grows toward the
//! buffer's size, which the budget already counts.

use crate::AlignedBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Bytes faulted in per call (a huge page: the stop flag is seen between calls).
const STEP: usize = crate::HUGE_PAGE;
/// How often a paused prefault looks whether to go on.
const PAUSE_POLL: std::time::Duration = std::time::Duration::from_millis(1);

/// The background thread faulting a buffer in, front to back. Dropping it
/// stops the thread (within one 2 MiB step) and joins it.
pub struct Prefault {
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    done: Arc<AtomicUsize>,
    handle: Option<JoinHandle<()>>,
}

impl Prefault {
    /// Start faulting `buf`'s pages in, from its start. `None` where the
    /// OS cannot do it without writing (systems other than Linux) or the
    /// buffer is not a lazy mapping (small buffers are already zeroed).
    ///
    /// # Safety
    /// `buf` must outlive the returned guard: drop the guard (which joins
    /// the thread) before the buffer. Its memory must not be unmapped or
    /// moved meanwhile — an [`AlignedBuf`] never is while it lives.
    pub unsafe fn start(buf: &AlignedBuf) -> Option<Prefault> {
        if !cfg!(target_os = "linux") || buf.capacity() < crate::buf::LAZY_MIN {
            return None;
        }
        let (base, len) = (buf.as_ptr() as usize, buf.capacity());
        let stop = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicUsize::new(0));
        let (s, p, d) = (stop.clone(), paused.clone(), done.clone());
        let handle = std::thread::Builder::new()
            .name("waste-prefault".into())
            .spawn(move || {
                idle_priority();
                let mut off = 0;
                while off < len && !s.load(Ordering::Relaxed) {
                    if p.load(Ordering::Relaxed) {
                        // paused: wake now and then to see whether to go on
                        std::thread::park_timeout(PAUSE_POLL);
                        continue;
                    }
                    let n = STEP.min(len - off);
                    // SAFETY: [base + off, base + off + n) lies in the buffer,
                    // alive until the guard joins this thread (the caller's contract).
                    if !unsafe { populate_write((base + off) as *mut u8, n) } {
                        break;
                    }
                    off += n;
                    d.store(off, Ordering::Release);
                }
            })
            .ok()?;
        Some(Prefault { stop, paused, done, handle: Some(handle) })
    }

    /// Hold the faulting (`true`) or let it go on (`false`). While it runs,
    /// this VM's page zeroing takes memory bandwidth from everything else —
    /// a bandwidth probe pauses it (it stops within one step, 2 MiB).
    pub fn pause(&self, on: bool) {
        self.paused.store(on, Ordering::Relaxed);
        if !on {
            if let Some(h) = &self.handle {
                h.thread().unpark();
            }
        }
    }

    /// Bytes from the buffer's start faulted in so far.
    pub fn done(&self) -> usize {
        self.done.load(Ordering::Acquire)
    }

    /// Wait until the whole buffer is faulted in (or the OS refused);
    /// returns the bytes done.
    pub fn finish(mut self) -> usize {
        self.pause(false);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.done()
    }
}

impl Drop for Prefault {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Fault `[ptr, ptr + len)` in as writable without changing its contents.
/// False when the OS refuses (a kernel before 5.14, another system).
///
/// # Safety
/// The range must lie inside a live mapping of this process.
unsafe fn populate_write(ptr: *mut u8, len: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: the caller's range; MADV_POPULATE_WRITE faults pages in
        // (zero pages for untouched anonymous memory) and writes no data.
        unsafe { libc::madvise(ptr.cast(), len, libc::MADV_POPULATE_WRITE) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (ptr, len);
        false
    }
}

/// Move the calling thread to the idle scheduling class (Linux
/// `SCHED_IDLE`); elsewhere, or if refused, it stays as it is.
fn idle_priority() {
    #[cfg(target_os = "linux")]
    {
        let p = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; a plain struct argument.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &p) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    use crate::buf::tests::resident;

    #[test]
    #[cfg(target_os = "linux")]
    fn faults_every_page_in_and_changes_no_byte() {
        for huge in [false, true] {
            let mut b = AlignedBuf::new(24 << 20, huge);
            // a "read" already landed in the middle
            for (i, x) in b[5 << 20..(5 << 20) + 10_000].iter_mut().enumerate() {
                *x = (i % 251) as u8 + 1;
            }
            assert!(resident(&b) < b.capacity(), "pages resident before the prefault");
            // SAFETY: `b` outlives the guard (finish joins the thread).
            let p = unsafe { Prefault::start(&b) }.expect("a lazy mapping on Linux");
            let done = p.finish();
            if done == 0 {
                crate::skip::report_skip("the cache prefault (this kernel has no MADV_POPULATE_WRITE)", false);
                return;
            }
            assert_eq!(done, b.capacity());
            assert_eq!(resident(&b), b.capacity(), "huge {huge}");
            for (i, &x) in b.iter().enumerate() {
                let want =
                    if (5 << 20..(5 << 20) + 10_000).contains(&i) { (((i - (5 << 20)) % 251) + 1) as u8 } else { 0 };
                assert_eq!(x, want, "byte {i}");
            }
        }
    }

    #[test]
    fn small_buffers_need_none_and_a_dropped_guard_stops() {
        let b = AlignedBuf::new(4096, false);
        // SAFETY: `b` outlives the (absent) guard.
        assert!(unsafe { Prefault::start(&b) }.is_none());
        let big = AlignedBuf::new(64 << 20, false);
        // SAFETY: the guard is dropped on the next line, before `big`.
        let p = unsafe { Prefault::start(&big) };
        drop(p); // joins; the buffer stays valid and zeroed
        assert!(big.iter().step_by(4096).all(|&x| x == 0));
    }

    /// A paused prefault stops advancing (within one step) and goes on when
    /// let go; `finish` lets a paused one go on rather than wait forever.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_paused_prefault_stops_advancing_and_finishes_when_let_go() {
        let b = AlignedBuf::new(256 << 20, false);
        // SAFETY: `b` outlives the guard (finish joins the thread).
        let p = unsafe { Prefault::start(&b) }.expect("a lazy mapping on Linux");
        p.pause(true);
        // the step in flight when the pause came ends, then nothing moves
        std::thread::sleep(std::time::Duration::from_millis(50));
        let held = p.done();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(p.done(), held, "advanced while paused");
        if held == b.capacity() {
            eprintln!("note: the whole buffer was faulted in before the pause");
        }
        assert!(held <= b.capacity());
        let done = p.finish();
        assert!(done == b.capacity() || done == 0, "finish stopped at {done}");
    }
}
