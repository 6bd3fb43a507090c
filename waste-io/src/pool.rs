//! A pool of reader threads: positional reads into owned aligned buffers or
//! into caller-owned memory (cache slots); demand requests are always served
//! before speculative ones, and a queued speculative read can be promoted.

use crate::{AlignedBuf, DirectFile, Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Request priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// Needed now by the running layer.
    Demand,
    /// A prefetch that may go unused.
    Speculative,
}

type Outcome = (Option<AlignedBuf>, Result<()>);
type Done = Arc<(Mutex<Option<Outcome>>, Condvar)>;

enum Dest {
    Owned(AlignedBuf),
    Raw(*mut u8, usize),
}
// SAFETY: a Raw destination is exclusively reserved for the job by the submitter (see submit_into).
unsafe impl Send for Dest {}

struct Job {
    id: u64,
    file: Arc<DirectFile>,
    offset: u64,
    dest: Dest,
    done: Done,
}

#[derive(Default)]
struct Queues {
    demand: VecDeque<Job>,
    spec: VecDeque<Job>,
    closed: bool,
}

struct Shared {
    q: Mutex<Queues>,
    cv: Condvar,
}

/// Completion handle of one submitted read.
pub struct Ticket {
    id: u64,
    done: Done,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ticket({})", self.id)
    }
}

impl Ticket {
    /// Block until the read finished; returns the owned buffer (for
    /// [`ReaderPool::submit`]) and the outcome.
    pub fn wait_buf(self) -> (Option<AlignedBuf>, Result<()>) {
        let (m, cv) = &*self.done;
        let mut g = m.lock();
        loop {
            if let Some(r) = g.take() {
                return r;
            }
            cv.wait(&mut g);
        }
    }
    /// Block until an owned-buffer read finished.
    pub fn wait(self) -> (AlignedBuf, Result<()>) {
        match self.wait_buf() {
            (Some(b), r) => (b, r),
            (None, r) => (AlignedBuf::new(0, false), r),
        }
    }
    /// Block until a read into caller memory finished.
    ///
    /// # Errors
    /// The read's error, as [`crate::DirectFile::read_exact_at`] reports it; [`Error::Closed`] if the pool shut down.
    pub fn wait_raw(self) -> Result<()> {
        self.wait_buf().1
    }
    /// Whether the read has finished (non-blocking).
    pub fn is_done(&self) -> bool {
        self.done.0.lock().is_some()
    }
}

/// Reader threads serving [`DirectFile`] reads.
pub struct ReaderPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    next_id: AtomicU64,
}

impl ReaderPool {
    /// Start `n` reader threads (at least 1).
    ///
    /// # Panics
    /// When the OS refuses to start a reader thread; the engine uses
    /// [`ReaderPool::try_new`].
    pub fn new(n: usize) -> ReaderPool {
        Self::try_new(n).expect("spawn reader thread")
    }
    /// [`ReaderPool::new`], with a thread the OS refuses to start an error
    /// ([`Error::Thread`]) instead of a panic; the threads already started
    /// are stopped before it returns.
    ///
    /// # Errors
    /// [`Error::Thread`] when the OS refuses a reader thread.
    pub fn try_new(n: usize) -> Result<ReaderPool> {
        Self::start(n, |i, s| {
            std::thread::Builder::new().name(format!("waste-io-{i}")).spawn(move || {
                user_initiated_qos();
                worker(&s)
            })
        })
    }
    /// The pool with its `n` threads started by `spawn(i, queues)`.
    fn start(
        n: usize,
        mut spawn: impl FnMut(usize, Arc<Shared>) -> std::io::Result<JoinHandle<()>>,
    ) -> Result<ReaderPool> {
        let shared = Arc::new(Shared { q: Mutex::new(Queues::default()), cv: Condvar::new() });
        let mut pool = ReaderPool { shared, threads: Vec::new(), next_id: AtomicU64::new(1) };
        for i in 0..n.max(1) {
            // on an error the pool is dropped: its Drop stops the threads started
            let h = spawn(i, pool.shared.clone()).map_err(|source| Error::Thread { what: "reader", source })?;
            pool.threads.push(h);
        }
        Ok(pool)
    }
    /// Number of reader threads.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    fn push(&self, file: Arc<DirectFile>, offset: u64, dest: Dest, prio: Priority) -> Ticket {
        let done: Done = Arc::new((Mutex::new(None), Condvar::new()));
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let job = Job { id, file, offset, dest, done: done.clone() };
        let mut q = self.shared.q.lock();
        if q.closed {
            let buf = match job.dest {
                Dest::Owned(b) => Some(b),
                Dest::Raw(..) => None,
            };
            *done.0.lock() = Some((buf, Err(Error::Closed)));
        } else {
            match prio {
                Priority::Demand => q.demand.push_back(job),
                Priority::Speculative => q.spec.push_back(job),
            }
            self.shared.cv.notify_one();
        }
        Ticket { id, done }
    }

    /// Queue a read of `buf.len()` bytes at `offset` into an owned buffer.
    pub fn submit(&self, file: Arc<DirectFile>, offset: u64, buf: AlignedBuf, prio: Priority) -> Ticket {
        self.push(file, offset, Dest::Owned(buf), prio)
    }

    /// Queue a read of `len` bytes at `offset` into caller memory at `dst`.
    ///
    /// # Safety
    /// `dst..dst+len` must stay valid, aligned for the file's I/O mode, and
    /// untouched by anyone else until the ticket has been waited on.
    pub unsafe fn submit_into(
        &self,
        file: Arc<DirectFile>,
        offset: u64,
        dst: *mut u8,
        len: usize,
        prio: Priority,
    ) -> Ticket {
        self.push(file, offset, Dest::Raw(dst, len), prio)
    }

    /// If the read of `t` is still queued as speculative, move it to the
    /// front of the demand queue (a demand read never waits behind
    /// speculative ones). Returns whether it was promoted.
    pub fn promote(&self, t: &Ticket) -> bool {
        let mut q = self.shared.q.lock();
        if let Some(pos) = q.spec.iter().position(|j| j.id == t.id) {
            if let Some(j) = q.spec.remove(pos) {
                q.demand.push_front(j);
                return true;
            }
        }
        false
    }
}

fn worker(s: &Shared) {
    loop {
        let job = {
            let mut q = s.q.lock();
            loop {
                if let Some(j) = q.demand.pop_front().or_else(|| q.spec.pop_front()) {
                    break j;
                }
                if q.closed {
                    return;
                }
                s.cv.wait(&mut q);
            }
        };
        let Job { file, offset, dest, done, .. } = job;
        let out = match dest {
            Dest::Owned(mut buf) => {
                let r = file.read_exact_at(&mut buf, offset);
                (Some(buf), r)
            }
            Dest::Raw(p, len) => {
                // SAFETY: the submitter reserved this memory for the job (submit_into's contract).
                let s = unsafe { std::slice::from_raw_parts_mut(p, len) };
                (None, file.read_exact_at(s, offset))
            }
        };
        let (m, cv) = &*done;
        *m.lock() = Some(out);
        cv.notify_all();
    }
}

impl Drop for ReaderPool {
    fn drop(&mut self) {
        {
            let mut q = self.shared.q.lock();
            q.closed = true;
            // queued jobs finish with Closed so no waiter hangs
            let mut jobs: Vec<Job> = q.demand.drain(..).collect();
            jobs.extend(q.spec.drain(..));
            for j in jobs {
                let buf = match j.dest {
                    Dest::Owned(b) => Some(b),
                    Dest::Raw(..) => None,
                };
                *j.done.0.lock() = Some((buf, Err(Error::Closed)));
                j.done.1.notify_all();
            }
        }
        self.shared.cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// macOS: the calling thread runs at the quality-of-service class of work
/// a user waits on — reader threads (a demand read stalls a token) and the
/// compute pool's workers (`waste-quant`'s) — not the default class the
/// scheduler may park on efficiency cores with throttled I/O. Elsewhere:
/// nothing.
pub fn user_initiated_qos() {
    #[cfg(target_os = "macos")]
    // SAFETY: sets the calling thread's own QoS class; no pointers involved.
    unsafe {
        libc::pthread_set_qos_class_self_np(libc::qos_class_t::QOS_CLASS_USER_INITIATED, 0);
    }
}

#[cfg(test)]
#[path = "../../tests-support/refusing_spawn.rs"]
mod refusing_spawn;

#[cfg(test)]
mod tests {
    use super::refusing_spawn::refusing_spawn;
    use super::*;
    use std::io::Write;

    /// A thread the OS refuses is an error, not a panic, and the threads
    /// started before it stop (the pool's Drop joins them).
    #[test]
    fn a_refused_thread_is_an_error_and_the_started_ones_stop() {
        let exited = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let r = ReaderPool::start(4, refusing_spawn(2, exited.clone(), |s: &Arc<Shared>| worker(s)));
        match r {
            Err(Error::Thread { what: "reader", .. }) => {}
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("a refused thread was not reported"),
        }
        assert_eq!(exited.load(Ordering::SeqCst), 2, "the two started readers were not stopped");
    }

    #[test]
    fn pool_reads_all_requests() {
        let p = std::env::temp_dir().join(format!("waste-pool-test-{}", std::process::id()));
        let data: Vec<u8> = (0..64 * 4096).map(|i| (i / 4096) as u8).collect();
        std::fs::File::create(&p).unwrap().write_all(&data).unwrap();
        let f = Arc::new(DirectFile::open(&p, true).unwrap());
        let pool = ReaderPool::new(3);
        let tickets: Vec<_> = (0..64)
            .map(|i| {
                pool.submit(
                    f.clone(),
                    i * 4096,
                    AlignedBuf::new(4096, false),
                    if i % 2 == 0 { Priority::Demand } else { Priority::Speculative },
                )
            })
            .collect();
        for (i, t) in tickets.into_iter().enumerate() {
            let (b, r) = t.wait();
            r.unwrap();
            assert!(b.iter().all(|&x| x == i as u8));
        }
        let (_, r) = pool.submit(f.clone(), 64 * 4096, AlignedBuf::new(4096, false), Priority::Demand).wait();
        assert!(matches!(r, Err(Error::ShortRead { .. })));
        // into caller memory
        let mut arena = AlignedBuf::new(3 * 4096, false);
        let base = arena.as_mut_ptr();
        // SAFETY: disjoint 4 KiB pieces of the arena, waited on below.
        let ts: Vec<_> = (0..3)
            .map(|i| unsafe {
                pool.submit_into(f.clone(), (10 + i) as u64 * 4096, base.add(i * 4096), 4096, Priority::Speculative)
            })
            .collect();
        for t in ts {
            t.wait_raw().unwrap();
        }
        assert!(arena.chunks(4096).enumerate().all(|(i, c)| c.iter().all(|&x| x == 10 + i as u8)));
        std::fs::remove_file(p).ok();
    }

    #[test]
    fn promote_moves_a_queued_speculative_read() {
        let p = std::env::temp_dir().join(format!("waste-pool-promote-{}", std::process::id()));
        std::fs::File::create(&p).unwrap().write_all(&vec![7u8; 8 * 4096]).unwrap();
        let f = Arc::new(DirectFile::open(&p, false).unwrap());
        // a pool with no reader thread yet: the queue holds still while we look
        let pool = ReaderPool {
            shared: Arc::new(Shared { q: Mutex::new(Queues::default()), cv: Condvar::new() }),
            threads: vec![],
            next_id: AtomicU64::new(1),
        };
        let ts: Vec<_> = (0..4)
            .map(|i| pool.submit(f.clone(), i * 4096, AlignedBuf::new(4096, false), Priority::Speculative))
            .collect();
        let d = pool.submit(f.clone(), 5 * 4096, AlignedBuf::new(4096, false), Priority::Demand);
        assert!(pool.promote(&ts[2]), "a queued speculative read was not promoted");
        assert!(!pool.promote(&ts[2]), "promoted twice");
        assert!(!pool.promote(&d), "a demand read is not speculative");
        {
            let q = pool.shared.q.lock();
            let demand: Vec<u64> = q.demand.iter().map(|j| j.id).collect();
            let spec: Vec<u64> = q.spec.iter().map(|j| j.id).collect();
            // the promoted read goes first, ahead of the demand read queued before it
            assert_eq!(demand, vec![ts[2].id, d.id]);
            assert_eq!(spec, vec![ts[0].id, ts[1].id, ts[3].id]);
        }
        // a worker now drains them, every read intact
        let s2 = pool.shared.clone();
        let w = std::thread::spawn(move || worker(&s2));
        for t in ts.into_iter().chain([d]) {
            let (b, r) = t.wait();
            r.unwrap();
            assert!(b.iter().all(|&x| x == 7));
        }
        drop(pool);
        w.join().unwrap();
        std::fs::remove_file(p).ok();
    }
}
