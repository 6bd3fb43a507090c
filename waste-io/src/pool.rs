//! A pool of reader threads: positional reads into owned aligned buffers,
//! demand requests always served before speculative ones.

use crate::{AlignedBuf, DirectFile, Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
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

type Done = Arc<(Mutex<Option<(AlignedBuf, Result<()>)>>, Condvar)>;

struct Job {
    file: Arc<DirectFile>,
    offset: u64,
    buf: AlignedBuf,
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
    done: Done,
}

impl Ticket {
    /// Block until the read finished; returns the buffer and the outcome.
    pub fn wait(self) -> (AlignedBuf, Result<()>) {
        let (m, cv) = &*self.done;
        let mut g = m.lock();
        loop {
            if let Some(r) = g.take() {
                return r;
            }
            cv.wait(&mut g);
        }
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
}

impl ReaderPool {
    /// Start `n` reader threads (at least 1).
    pub fn new(n: usize) -> ReaderPool {
        let shared = Arc::new(Shared { q: Mutex::new(Queues::default()), cv: Condvar::new() });
        let threads = (0..n.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("waste-io-{i}")).spawn(move || worker(&s)).expect("spawn reader thread")
            })
            .collect();
        ReaderPool { shared, threads }
    }
    /// Number of reader threads.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }
    /// Queue a read of `buf.len()` bytes at `offset`.
    pub fn submit(&self, file: Arc<DirectFile>, offset: u64, buf: AlignedBuf, prio: Priority) -> Ticket {
        let done: Done = Arc::new((Mutex::new(None), Condvar::new()));
        let job = Job { file, offset, buf, done: done.clone() };
        let mut q = self.shared.q.lock();
        if q.closed {
            *done.0.lock() = Some((job.buf, Err(Error::Closed)));
        } else {
            match prio {
                Priority::Demand => q.demand.push_back(job),
                Priority::Speculative => q.spec.push_back(job),
            }
            self.shared.cv.notify_one();
        }
        Ticket { done }
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
        let Job { file, offset, mut buf, done } = job;
        let r = file.read_exact_at(&mut buf, offset);
        let (m, cv) = &*done;
        *m.lock() = Some((buf, r));
        cv.notify_all();
    }
}

impl Drop for ReaderPool {
    fn drop(&mut self) {
        self.shared.q.lock().closed = true;
        self.shared.cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn pool_reads_all_requests() {
        let p = std::env::temp_dir().join(format!("waste-pool-test-{}", std::process::id()));
        let data: Vec<u8> = (0..64 * 4096).map(|i| (i / 4096) as u8).collect();
        std::fs::File::create(&p).unwrap().write_all(&data).unwrap();
        let f = Arc::new(DirectFile::open(&p, true).unwrap());
        let pool = ReaderPool::new(3);
        let tickets: Vec<_> = (0..64)
            .map(|i| pool.submit(f.clone(), i * 4096, AlignedBuf::new(4096, false), if i % 2 == 0 { Priority::Demand } else { Priority::Speculative }))
            .collect();
        for (i, t) in tickets.into_iter().enumerate() {
            let (b, r) = t.wait();
            r.unwrap();
            assert!(b.iter().all(|&x| x == i as u8));
        }
        let (_, r) = pool.submit(f, 64 * 4096, AlignedBuf::new(4096, false), Priority::Demand).wait();
        assert!(matches!(r, Err(Error::ShortRead { .. })));
        std::fs::remove_file(p).ok();
    }
}
