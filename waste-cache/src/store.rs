//! The expert store: the slot cache, the reader pool and the record checks
//! behind one small API, so a model's MoE block reads like the math —
//! route, [`ExpertStore::acquire`], use each expert as it arrives
//! ([`Pinned::wait`]), release — with no locking, tickets or raw slot
//! memory on the caller's side.
//!
//! **Concurrency.** One store serves every session of a model. Each read
//! into a slot is completed by exactly one party (the cache's claim: the
//! session that waits on the read's ticket, or the one that reads the
//! record itself without read-ahead); everyone else waiting for that record
//! sleeps on a condition variable until it settles, then sees the same
//! outcome. A slot a session holds pinned is never evicted or rewritten, so
//! the record bytes [`Pinned::wait`] returns stay valid while the guard
//! lives; dropping the guard unpins them.

use crate::cache::{CacheError, CacheStats, Claim, ExpertCache, Key, Lookup, SlotState};
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use waste_io::{DirectFile, Priority, ReaderPool};

/// Where the expert records live and how to check one: the model's side of
/// the store.
pub trait RecordSource: Send + Sync {
    /// The caller's error type: cache and I/O failures convert into it, and
    /// a record check returns it (so a damaged record keeps its precise
    /// message).
    type Error: From<CacheError> + From<waste_io::Error> + std::fmt::Display;
    /// The bank file and byte offset of `key`'s record (`None`: the layer
    /// has no experts on disk).
    fn locate(&self, key: Key) -> Option<(Arc<DirectFile>, u64)>;
    /// Validate a record just read into memory.
    ///
    /// # Errors
    /// Why the record cannot be used (a bad header, a checksum mismatch).
    fn check(&self, key: Key, record: &[u8]) -> Result<(), Self::Error>;
}

/// What acquiring and waiting cost one caller (added to its statistics).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Traffic {
    /// Uses served from memory (resident or already in flight).
    pub hits: u64,
    /// Uses that started a read.
    pub misses: u64,
    /// Bytes of the reads started.
    pub bytes_read: u64,
    /// Seconds spent waiting for reads.
    pub io_seconds: f64,
    /// Speculative reads started by [`ExpertStore::prefetch`].
    pub prefetch_issued: u64,
}

impl std::ops::AddAssign for Traffic {
    fn add_assign(&mut self, o: Traffic) {
        self.hits += o.hits;
        self.misses += o.misses;
        self.bytes_read += o.bytes_read;
        self.io_seconds += o.io_seconds;
        self.prefetch_issued += o.prefetch_issued;
    }
}

/// The store: the cache, its readers and the record source.
pub struct ExpertStore<S: RecordSource> {
    /// The reader threads. First field: dropped first, so its threads are
    /// joined (queued reads abandoned, running ones finished) before the
    /// cache frees the slots those reads write into.
    readers: ReaderPool,
    cache: Mutex<ExpertCache>,
    /// Signalled whenever an in-flight read settles (Ready or Failed).
    settled: Condvar,
    source: S,
    rec_bytes: usize,
    readahead: bool,
    users: AtomicUsize,
    /// Times an acquire waited for another session to release slots.
    pin_waits: std::sync::atomic::AtomicU64,
}

impl<S: RecordSource> ExpertStore<S> {
    /// A store over `cache` (its slots hold records of `rec_bytes`), with
    /// `io_threads` reader threads. With `readahead`, every missing expert
    /// of a layer is read at once in the background; without, each is read
    /// when first needed, by the session that needs it.
    ///
    /// # Errors
    /// [`waste_io::Error::Thread`] when the OS refuses a reader thread.
    pub fn new(
        cache: ExpertCache,
        io_threads: usize,
        source: S,
        rec_bytes: usize,
        readahead: bool,
    ) -> Result<Self, waste_io::Error> {
        Ok(ExpertStore {
            readers: ReaderPool::try_new(io_threads)?,
            cache: Mutex::new(cache),
            settled: Condvar::new(),
            source,
            rec_bytes,
            readahead,
            users: AtomicUsize::new(0),
            pin_waits: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Hold or let go on the cache's prefault ([`ExpertCache::pause_prefault`]).
    pub fn pause_prefault(&self, on: bool) {
        self.cache.lock().pause_prefault(on)
    }

    /// Bytes of the cache's arena faulted in ahead of use so far
    /// ([`ExpertCache::start_prefault`]).
    pub fn prefaulted_bytes(&self) -> usize {
        self.cache.lock().prefaulted_bytes()
    }

    /// The record source.
    pub fn source(&self) -> &S {
        &self.source
    }
    /// Reader threads.
    pub fn io_threads(&self) -> usize {
        self.readers.threads()
    }
    /// Cache slots.
    pub fn slots(&self) -> usize {
        self.cache.lock().slots()
    }
    /// Whether the arena got huge pages.
    pub fn huge_pages(&self) -> bool {
        self.cache.lock().huge_pages()
    }
    /// Bytes of the arena.
    pub fn arena_bytes(&self) -> usize {
        self.cache.lock().arena_bytes()
    }
    /// The cache's counters.
    pub fn stats(&self) -> CacheStats {
        self.cache.lock().stats
    }
    /// Times an acquire found every slot held by other sessions and waited
    /// for a release.
    pub fn pin_waits(&self) -> u64 {
        self.pin_waits.load(Ordering::Relaxed)
    }
    /// Every expert used so far with its use count (the usage hotlist).
    pub fn history(&self) -> Vec<(Key, u32)> {
        self.cache.lock().history()
    }

    /// A session starts using the store (the global pin check in
    /// [`Pinned::release`] holds only while there is one).
    pub fn enter(&self) {
        self.users.fetch_add(1, Ordering::Relaxed);
    }
    /// A session stops using the store: its prefetch window is released and
    /// finished speculative reads are settled, so no ticket outlives it.
    pub fn leave(&self) {
        let mut cache = self.cache.lock();
        cache.clear_window();
        self.reap(&mut cache);
        self.users.fetch_sub(1, Ordering::Relaxed);
    }

    /// Read the experts of a usage hotlist into the cache now (most used
    /// first, as many as there are slots), each checked; a record that fails
    /// its read or check is skipped (it is reported when a token needs it).
    /// The cache's counters start from zero afterwards. Returns how many
    /// were loaded.
    ///
    /// # Errors
    /// A cache error (no slot could be had).
    pub fn preload(&self, entries: &[(Key, u32)]) -> Result<usize, S::Error> {
        let max = entries.iter().map(|e| e.1).max().unwrap_or(0);
        let mut cache = self.cache.lock();
        let n = cache.slots().min(entries.len());
        let mut loaded = 0;
        for &(key, hits) in &entries[..n] {
            let Some((file, off)) = self.source.locate(key) else { continue };
            let slot = cache.reserve(key, false)?;
            let ok = {
                // SAFETY: the slot is reserved (pinned, in flight) for this
                // read only, and the cache lock is held throughout.
                let buf = unsafe { std::slice::from_raw_parts_mut(cache.slot_ptr(slot), self.rec_bytes) };
                file.read_exact_at(buf, off).is_ok() && self.source.check(key, buf).is_ok()
            };
            if ok {
                cache.mark_ready(slot);
                cache.seed_history(key, hits, max);
                cache.unpin(slot)?;
                loaded += 1;
            } else {
                cache.mark_failed(slot, "its preload failed");
                cache.unpin(slot)?;
            }
        }
        cache.stats = Default::default();
        Ok(loaded)
    }

    /// Pin layer `layer`'s `experts` (distinct, in the order they will be
    /// used) for one layer-step and start reading the missing ones. `repeats`
    /// are further uses of the same experts in this step (a prefill chunk's
    /// tokens sharing an expert): counted as hits and as uses for the policy.
    ///
    /// When other sessions hold so many pins that no slot is free, this one
    /// lets go of what it pinned so far, waits for a release and tries again
    /// (at most [`PIN_WAIT`]); where no other session held a slot when the
    /// attempt failed (alone on the store), a step that needs more slots
    /// than exist is an error at once. Whether others held slots is read
    /// in the same critical section as the failure, after this attempt's
    /// own pins are let go: a session that releases (or leaves) between
    /// the attempt and the check cannot turn a wait into an error.
    ///
    /// # Errors
    /// A cache error when no slot can be had for a missing expert.
    pub fn acquire(&self, layer: u32, experts: &[u32], repeats: &[u32]) -> Result<Pinned<'_, S>, S::Error> {
        let deadline = Instant::now() + PIN_WAIT;
        let mut carried = Traffic::default();
        loop {
            match self.try_acquire(layer, experts, repeats) {
                Ok(mut p) => {
                    *p.traffic.get_mut() += carried;
                    p.acquired = true;
                    return Ok(p);
                }
                Err((Full(e, others), t)) => {
                    // with this step's pins let go, a cache no other session
                    // held anything of cannot hold the step at all: waiting
                    // cannot help
                    if others == 0 || Instant::now() >= deadline {
                        return Err(e.into());
                    }
                    // the reads started stay in flight (found again on retry);
                    // their cost is real, the attempt's hits are not
                    carried += Traffic { hits: 0, ..t };
                    let mut cache = self.cache.lock();
                    // released since the attempt: try again at once
                    if cache.held_slots() < others {
                        continue;
                    }
                    self.pin_waits.fetch_add(1, Ordering::Relaxed);
                    self.settled.wait_for(&mut cache, std::time::Duration::from_millis(50));
                }
                Err((Fail(e), _)) => return Err(e),
            }
        }
    }

    fn try_acquire(
        &self,
        layer: u32,
        experts: &[u32],
        repeats: &[u32],
    ) -> Result<Pinned<'_, S>, (Stop<S::Error>, Traffic)> {
        let mut pinned = Pinned {
            store: self,
            layer,
            slots: Vec::with_capacity(experts.len()),
            traffic: Mutex::new(Traffic::default()),
            released: false,
            acquired: false,
        };
        let mut cache = self.cache.lock();
        cache.clear_window();
        self.reap(&mut cache);
        for &e in experts {
            match self.acquire_one(&mut cache, (layer, e), pinned.traffic.get_mut()) {
                Ok((s, ready)) => {
                    cache.touch(s);
                    pinned.slots.push((e, s, AtomicBool::new(ready)));
                }
                Err(err) => {
                    // let go of this attempt's pins under the same lock, so
                    // what stays held is what others hold at the failure
                    for (_, s, _) in pinned.slots.drain(..) {
                        cache.unpin(s).map_err(|e| (Fail(e.into()), Traffic::default()))?;
                    }
                    let err = match err {
                        Full(e, _) => Full(e, cache.held_slots()),
                        f => f,
                    };
                    self.settled.notify_all();
                    drop(cache);
                    let t = *pinned.traffic.get_mut();
                    return Err((err, t));
                }
            }
        }
        for &e in repeats {
            if let Some(&(_, s, _)) = pinned.slots.iter().find(|x| x.0 == e) {
                cache.touch(s);
                pinned.traffic.get_mut().hits += 1;
            }
        }
        Ok(pinned)
    }

    /// Start speculative reads of layer `layer`'s `experts` (a router's
    /// guess for the next layer) and hold them until the next acquire, so
    /// they are not evicted before they can be used. Returns the reads
    /// started.
    ///
    /// # Errors
    /// A cache error (a pin bookkeeping bug).
    pub fn prefetch(&self, layer: u32, experts: &[u32]) -> Result<u64, S::Error> {
        let mut cache = self.cache.lock();
        let mut issued = 0;
        for &e in experts {
            let key = (layer, e);
            match cache.lookup(key) {
                Lookup::Miss => {
                    if self.source.locate(key).is_none() {
                        continue;
                    }
                    if let Ok(s) = cache.reserve(key, true) {
                        // in flight protects it until settled; no reservation pin is kept
                        cache.unpin(s)?;
                        issued += 1;
                        self.submit(&mut cache, s, Priority::Speculative);
                        cache.set_window(s, true);
                    }
                }
                Lookup::Ready(s) | Lookup::InFlight(s) => cache.set_window(s, true),
            }
        }
        Ok(issued)
    }

    /// Pin `key` for use, starting its read if missing. Returns (slot, ready).
    fn acquire_one(
        &self,
        cache: &mut ExpertCache,
        key: Key,
        traffic: &mut Traffic,
    ) -> Result<(usize, bool), Stop<S::Error>> {
        let (slot, ready) = match cache.lookup(key) {
            Lookup::Ready(s) => {
                traffic.hits += 1;
                (s, true)
            }
            Lookup::InFlight(s) => {
                traffic.hits += 1;
                if let Some(t) = cache.ticket(s) {
                    self.readers.promote(t);
                }
                (s, false)
            }
            Lookup::Miss => {
                if self.source.locate(key).is_none() {
                    return Err(Fail(CacheError::NoRecord { layer: key.0, expert: key.1 }.into()));
                }
                let s = loop {
                    match cache.reserve(key, false) {
                        Ok(s) => break s,
                        // every slot busy: settle a speculative read nobody claimed, then retry
                        Err(e) => match cache.unclaimed_inflight() {
                            Some(spec) => {
                                let Some(t) = cache.take_ticket(spec) else { return Err(Full(e, 0)) };
                                let ti = Instant::now();
                                let r = t.wait_raw();
                                traffic.io_seconds += ti.elapsed().as_secs_f64();
                                let _ = self.finish_read(cache, spec, r);
                                self.settled.notify_all();
                            }
                            None => return Err(Full(e, 0)),
                        },
                    }
                };
                cache.unpin(s).map_err(|e| Fail(e.into()))?; // pinned below like every other use
                traffic.misses += 1;
                traffic.bytes_read += self.rec_bytes as u64;
                if self.readahead {
                    self.submit(cache, s, Priority::Demand);
                }
                (s, false)
            }
        };
        cache.pin(slot);
        Ok((slot, ready))
    }

    /// Start the read of a reserved slot on the reader pool.
    fn submit(&self, cache: &mut ExpertCache, slot: usize, prio: Priority) {
        let Some(key) = cache.key(slot) else { return };
        let Some((file, off)) = self.source.locate(key) else { return };
        let dst = cache.slot_ptr(slot);
        // SAFETY: the slot is reserved in flight; nobody touches its memory
        // until the ticket is waited on (the claim protocol).
        let t = unsafe { self.readers.submit_into(file, off, dst, self.rec_bytes, prio) };
        cache.set_ticket(slot, t);
    }

    /// Validate a finished read into `slot`; mark it ready or failed.
    fn finish_read(&self, cache: &mut ExpertCache, slot: usize, res: waste_io::Result<()>) -> Result<(), S::Error> {
        let Some(key) = cache.key(slot) else {
            let cause = "the slot holds no record".into();
            return Err(CacheError::ReadFailed { layer: 0, expert: 0, cause }.into());
        };
        let r = res.map_err(S::Error::from).and_then(|()| self.source.check(key, cache.slot_data(slot)));
        match &r {
            Ok(()) => cache.mark_ready(slot),
            Err(e) => cache.mark_failed(slot, &e.to_string()),
        }
        r
    }

    /// Settle speculative reads that finished (validated, else dropped
    /// silently: a damaged record is reported when it is actually needed).
    fn reap(&self, cache: &mut ExpertCache) {
        let mut settled = false;
        for s in cache.finished_reads() {
            if let Some(t) = cache.take_ticket(s) {
                let r = t.wait_raw();
                let _ = self.finish_read(cache, s, r);
                settled = true;
            }
        }
        if settled {
            self.settled.notify_all();
        }
    }

    /// Wait until `slot` (pinned by the caller) holds its validated record.
    /// Exactly one party completes each read (the cache's claim); others
    /// wait for it and share its outcome.
    fn ensure_ready(&self, slot: usize, traffic: &mut Traffic) -> Result<(), S::Error> {
        let ti = Instant::now();
        let mut cache = self.cache.lock();
        let outcome = loop {
            match cache.state(slot) {
                SlotState::Ready => break Ok(()),
                SlotState::InFlight => match cache.claim_read(slot) {
                    Claim::Ticket(t) => {
                        drop(cache);
                        let r = t.wait_raw();
                        cache = self.cache.lock();
                        let done = self.finish_read(&mut cache, slot, r);
                        self.settled.notify_all();
                        break done;
                    }
                    Claim::ReadYourself => {
                        let Some((file, off)) = cache.key(slot).and_then(|k| self.source.locate(k)) else {
                            let (layer, expert) = cache.key(slot).unwrap_or((0, 0));
                            let cause = "the container has no record for it";
                            cache.mark_failed(slot, cause);
                            self.settled.notify_all();
                            break Err(CacheError::ReadFailed { layer, expert, cause: cause.into() }.into());
                        };
                        let dst = cache.slot_ptr(slot);
                        drop(cache);
                        // SAFETY: this caller holds the slot's only claim: no
                        // reader thread and no other session writes or reads it
                        // until the claim is settled below.
                        let buf = unsafe { std::slice::from_raw_parts_mut(dst, self.rec_bytes) };
                        let r = file.read_exact_at(buf, off);
                        cache = self.cache.lock();
                        let done = self.finish_read(&mut cache, slot, r);
                        self.settled.notify_all();
                        break done;
                    }
                    Claim::Wait => self.settled.wait(&mut cache),
                },
                SlotState::Failed | SlotState::Empty => {
                    let (layer, expert) = cache.key(slot).unwrap_or((0, 0));
                    let cause = cache.failure(slot).map_or_else(|| "in another session".into(), |c| c.to_string());
                    break Err(CacheError::ReadFailed { layer, expert, cause }.into());
                }
            }
        };
        traffic.io_seconds += ti.elapsed().as_secs_f64();
        outcome
    }
}

/// One layer-step's experts, pinned: each stays resident (or in flight)
/// until the guard is released or dropped.
pub struct Pinned<'s, S: RecordSource> {
    store: &'s ExpertStore<S>,
    layer: u32,
    /// (expert, slot, known ready)
    slots: Vec<(u32, usize, AtomicBool)>,
    traffic: Mutex<Traffic>,
    released: bool,
    /// Set once the acquire succeeded: a guard dropped unreleased after
    /// that belongs to a step that failed part-way, which settles its reads.
    acquired: bool,
}

impl<S: RecordSource> Pinned<'_, S> {
    /// Whether `expert`'s record is already in memory (use it first).
    pub fn is_ready(&self, expert: u32) -> bool {
        self.slots.iter().any(|x| x.0 == expert && x.2.load(Ordering::Acquire))
    }
    /// What acquiring and waiting have cost so far.
    pub fn traffic(&self) -> Traffic {
        *self.traffic.lock()
    }

    /// `expert`'s record, waiting for its read if needed. Takes the guard
    /// shared, so several threads can each wait for (and then use) a
    /// different expert of the step at once; the time each waits is added
    /// to [`Pinned::traffic`].
    ///
    /// # Errors
    /// The read's failure (I/O error or a damaged record — the session that
    /// completed the read reports the precise reason, others
    /// [`CacheError::ReadFailed`]), or [`CacheError::NotPinned`] for an
    /// expert this guard did not acquire.
    pub fn wait(&self, expert: u32) -> Result<&[u8], S::Error> {
        let (_, slot, known) =
            self.slots.iter().find(|x| x.0 == expert).ok_or(CacheError::NotPinned { layer: self.layer, expert })?;
        if !known.load(Ordering::Acquire) {
            let mut t = Traffic::default();
            let r = self.store.ensure_ready(*slot, &mut t);
            *self.traffic.lock() += t;
            r?;
            known.store(true, Ordering::Release);
        }
        let ptr = self.store.cache.lock().slot_ptr(*slot);
        // SAFETY: the slot is Ready and pinned by this guard: it is neither
        // evicted nor written until the guard unpins it (release/drop), which
        // needs the guard by value — so not while this borrow lives.
        Ok(unsafe { std::slice::from_raw_parts(ptr as *const u8, self.store.rec_bytes) })
    }

    /// Unpin everything; with one session on the store, also check that no
    /// slot stayed pinned (a leak would slowly eat the cache).
    ///
    /// # Errors
    /// A pin bookkeeping error (an engine bug), reported loudly.
    pub fn release(mut self) -> Result<Traffic, S::Error> {
        self.released = true;
        let mut cache = self.store.cache.lock();
        // every pin goes even if one is refused; the first refusal is reported
        let mut first = Ok(());
        for &(_, s, _) in &self.slots {
            if let (Err(e), Ok(())) = (cache.unpin(s), &first) {
                first = Err(e);
            }
        }
        self.store.settled.notify_all(); // a session waiting for a free slot
        first?;
        if self.store.users.load(Ordering::Relaxed) <= 1 {
            cache.check_no_pins()?;
        }
        Ok(*self.traffic.get_mut())
    }
}

impl<S: RecordSource> Drop for Pinned<'_, S> {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        if self.acquired {
            // a step that failed part-way: finish its own reads now (each
            // checked; a damaged one is dropped and read again when next
            // needed), so none stays in flight past the failure — a read
            // issued before it can never be found later holding bytes the
            // file no longer has
            for (_, s, known) in &self.slots {
                if !known.load(Ordering::Acquire) {
                    let _ = self.store.ensure_ready(*s, &mut Traffic::default());
                }
            }
        }
        let mut cache = self.store.cache.lock();
        for &(_, s, _) in &self.slots {
            let _ = cache.unpin(s);
        }
        self.store.settled.notify_all(); // a session waiting for a free slot
    }
}

/// Longest an acquire waits for other sessions to release slots.
pub const PIN_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Why an acquire attempt stopped.
enum Stop<E> {
    /// Every slot pinned or in flight: worth waiting when others hold them
    /// (the slots others held at the failure, once [`ExpertStore::try_acquire`]
    /// has let go of its own; 0 where it is raised).
    Full(CacheError, usize),
    /// Anything else.
    Fail(E),
}
use Stop::{Fail, Full};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Policy;
    use std::io::Write;

    const REC: usize = 4096;

    /// Records of one layer in a temp file: record `e` is filled with byte
    /// `e`; record 3 is "damaged" (its check fails).
    struct Fake {
        file: Arc<DirectFile>,
        experts: u32,
    }

    #[derive(Debug, PartialEq)]
    enum E {
        Cache(CacheError),
        Io(String),
        Bad(u32),
    }
    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{self:?}")
        }
    }
    impl From<CacheError> for E {
        fn from(e: CacheError) -> E {
            E::Cache(e)
        }
    }
    impl From<waste_io::Error> for E {
        fn from(e: waste_io::Error) -> E {
            E::Io(e.to_string())
        }
    }

    impl RecordSource for Fake {
        type Error = E;
        fn locate(&self, (layer, e): Key) -> Option<(Arc<DirectFile>, u64)> {
            (layer == 1 && e < self.experts).then(|| (self.file.clone(), e as u64 * REC as u64))
        }
        fn check(&self, (_, e): Key, rec: &[u8]) -> Result<(), E> {
            if e == 3 || rec.iter().any(|&b| b != e as u8) {
                return Err(E::Bad(e));
            }
            Ok(())
        }
    }

    fn store(slots: usize, readahead: bool, tag: &str) -> ExpertStore<Fake> {
        let p = std::env::temp_dir().join(format!("waste-store-{}-{tag}", std::process::id()));
        let mut f = std::fs::File::create(&p).unwrap();
        for e in 0..8u8 {
            f.write_all(&[e; REC]).unwrap();
        }
        drop(f);
        let file = Arc::new(DirectFile::open(&p, false).unwrap());
        let _ = std::fs::remove_file(&p); // the open file lives on; nothing stays in the temp dir
        let mut cache = ExpertCache::new(slots, REC, Policy::Eta, false);
        cache.set_layers(&[1], 2);
        ExpertStore::new(cache, 2, Fake { file, experts: 8 }, REC, readahead).unwrap()
    }

    #[test]
    fn acquire_wait_release_with_and_without_readahead() {
        for readahead in [true, false] {
            let s = store(4, readahead, &format!("a{readahead}"));
            s.enter();
            let p = s.acquire(1, &[5, 2], &[5]).unwrap();
            assert_eq!(p.traffic().misses, 2);
            assert_eq!(p.traffic().hits, 1, "the repeat counts as a hit");
            assert!(p.wait(5).unwrap().iter().all(|&b| b == 5));
            assert!(p.wait(2).unwrap().iter().all(|&b| b == 2));
            assert!(p.is_ready(5) && p.is_ready(2));
            assert_eq!(p.wait(6), Err(E::Cache(CacheError::NotPinned { layer: 1, expert: 6 })));
            p.release().unwrap();
            // now resident: hits, no reads
            let p = s.acquire(1, &[2, 5], &[]).unwrap();
            assert_eq!((p.traffic().hits, p.traffic().misses), (2, 0));
            drop(p); // dropping unpins too
            let p = s.acquire(1, &[0, 1, 4, 7], &[]).unwrap(); // evicts both, none pinned
            p.release().unwrap();
            s.leave();
        }
    }

    #[test]
    fn a_damaged_record_is_the_source_error_and_nothing_stays_pinned() {
        let s = store(4, true, "bad");
        s.enter();
        let p = s.acquire(1, &[3, 4], &[]).unwrap();
        assert_eq!(p.wait(3).unwrap_err(), E::Bad(3));
        drop(p);
        // the failed step settled its other read: none stays in flight past
        // the failure (the file may change before the next step), and the
        // good record it read is kept
        {
            let n = s.slots();
            let c = s.cache.lock();
            assert!((0..n).all(|i| c.state(i) != SlotState::InFlight), "a failed step left a read in flight");
            assert!(matches!(c.lookup((1, 4)), crate::cache::Lookup::Ready(_)));
        }
        // the failed record is not cached: the next use reads (and fails) again
        let p = s.acquire(1, &[3], &[]).unwrap();
        assert_eq!(p.traffic().misses, 1);
        assert_eq!(p.wait(3).unwrap_err(), E::Bad(3));
        drop(p);
        // a layer without records is an error, not a panic
        assert!(matches!(s.acquire(2, &[0], &[]), Err(E::Cache(CacheError::NoRecord { layer: 2, expert: 0 }))));
        assert!(matches!(s.acquire(1, &[99], &[]), Err(E::Cache(CacheError::NoRecord { layer: 1, expert: 99 }))));
        // every pin was released (a single user: release checks)
        s.acquire(1, &[4], &[]).unwrap().release().unwrap();
        s.leave();
    }

    #[test]
    fn sessions_on_threads_share_reads_and_see_the_same_bytes() {
        // 3 threads × 2 pins ≤ 6 slots (sessions pinning every slot get
        // AllPinned — the known limit), 7 usable experts: evictions happen
        let s = store(6, true, "threads");
        std::thread::scope(|sc| {
            for t in 0..3u32 {
                let s = &s;
                sc.spawn(move || {
                    s.enter();
                    for round in 0..50u32 {
                        let want = [(t + round) % 8, (t + round + 1) % 8];
                        let want: Vec<u32> = want.into_iter().filter(|&e| e != 3).collect();
                        let p = s.acquire(1, &want, &[]).unwrap();
                        for &e in &want {
                            assert!(p.wait(e).unwrap().iter().all(|&b| b == e as u8));
                        }
                        drop(p);
                    }
                    s.leave();
                });
            }
        });
        assert_eq!(s.slots(), 6);
    }

    /// One guard's experts waited for from several threads at once (the
    /// MoE step's lanes, each taking the next expert as it arrives): every
    /// thread sees its own record, the failed one fails alone, and the
    /// guard's traffic counts each read once.
    #[test]
    fn threads_wait_for_one_guards_experts_together() {
        for readahead in [true, false] {
            let s = store(8, readahead, &format!("shared{readahead}"));
            s.enter();
            let want = [0u32, 1, 2, 3, 4, 5, 6];
            let p = s.acquire(1, &want, &[]).unwrap();
            let next = AtomicUsize::new(0);
            std::thread::scope(|sc| {
                for _ in 0..3 {
                    sc.spawn(|| loop {
                        let j = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&e) = want.get(j) else { break };
                        match p.wait(e) {
                            Ok(r) => assert!(e != 3 && r.iter().all(|&b| b == e as u8)),
                            Err(err) => assert_eq!((e, err), (3, E::Bad(3))),
                        }
                    });
                }
            });
            assert!(want.iter().all(|&e| p.is_ready(e) == (e != 3)));
            let t = p.traffic();
            assert_eq!((t.misses, t.bytes_read), (7, 7 * REC as u64));
            drop(p);
            s.leave();
        }
    }

    /// Dropping a store while its reads are in flight: the readers stop
    /// (queued reads abandoned, running ones finished) before the slots'
    /// memory goes — a read landing in a freed arena corrupts the heap
    /// (this found it: the allocator aborted a later test now and then).
    #[test]
    fn a_store_dropped_with_reads_in_flight_frees_its_slots_last() {
        for round in 0..2000 {
            let s = store(8, true, &format!("drop{round}"));
            s.enter();
            // read-ahead starts every read; nobody waits for them
            drop(s.acquire(1, &[0, 1, 2, 4, 5, 6, 7], &[]).unwrap());
            s.leave();
            // heap churn over the arena's old place, as the next test would
            let junk: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 4096]).collect();
            drop(s);
            assert!(junk.iter().enumerate().all(|(i, v)| v.iter().all(|&b| b == i as u8)), "round {round}");
        }
    }

    /// Two sessions, three slots: the first holds two, the second needs
    /// two new ones — it waits for the release instead of failing. Alone,
    /// a step larger than the cache fails at once.
    #[test]
    fn a_session_waits_for_slots_another_holds() {
        let s = store(3, true, "wait");
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|sc| {
            let s = &s;
            s.enter();
            s.enter();
            sc.spawn(move || {
                let p = s.acquire(1, &[0, 1], &[]).unwrap();
                p.wait(0).unwrap();
                p.wait(1).unwrap();
                held_tx.send(()).unwrap();
                // hold the two slots until the other session is blocked on them
                go_rx.recv().unwrap();
                drop(p);
                s.leave();
            });
            held_rx.recv().unwrap();
            let waiter = sc.spawn(move || {
                let p = s.acquire(1, &[4, 5], &[]).unwrap();
                assert!(p.wait(4).unwrap().iter().all(|&b| b == 4));
                assert!(p.wait(5).unwrap().iter().all(|&b| b == 5));
                drop(p);
                s.leave();
            });
            // the waiter cannot finish while two of three slots are held
            std::thread::sleep(std::time::Duration::from_millis(200));
            assert!(!waiter.is_finished(), "acquired two slots while only one was free");
            go_tx.send(()).unwrap();
            waiter.join().unwrap();
        });
        assert!(s.pin_waits() > 0, "the second session never waited");
        let waits = s.pin_waits();
        // alone: four experts never fit three slots
        s.enter();
        assert!(matches!(s.acquire(1, &[0, 1, 2, 4], &[]), Err(E::Cache(CacheError::AllPinned { .. }))));
        // with an idle second session (no pins) it still fails at once
        // rather than wait for a release that cannot come
        s.enter();
        for e in [0, 1, 2, 4] {
            // settle the reads the failed attempts left in flight
            if let Ok(p) = s.acquire(1, &[e], &[]) {
                p.wait(e).unwrap();
            }
        }
        assert!(matches!(s.acquire(1, &[0, 1, 2, 4], &[]), Err(E::Cache(CacheError::AllPinned { .. }))));
        assert_eq!(s.pin_waits(), waits, "waited for a release no session could give");
        s.leave();
        s.leave();
    }

    #[test]
    fn speculative_reads_settle_evict_and_return() {
        // every round prefetches two experts and acquires a third: the
        // speculative reads are reaped, evicted, settled to free a slot (2
        // slots: both in flight, unclaimed) and their slots reserved again;
        // the cache finds its reads and windows from its lists of them
        for slots in [2, 3] {
            let s = store(slots, true, &format!("lists{slots}"));
            s.enter();
            // the fake source's expert 3 is damaged: the other seven
            let ok = [0u32, 1, 2, 4, 5, 6, 7];
            for round in 0..40usize {
                let (a, b, c) = (ok[round % 7], ok[(round + 3) % 7], ok[(round + 5) % 7]);
                s.prefetch(1, &[a, b]).unwrap();
                let p = s.acquire(1, &[c], &[]).unwrap();
                assert!(p.wait(c).unwrap().iter().all(|&x| x == c as u8), "{slots} slots, round {round}");
                p.release().unwrap();
            }
            s.leave();
        }
    }

    #[test]
    fn prefetch_reads_ahead_and_preload_fills() {
        let s = store(4, true, "pre");
        s.enter();
        assert_eq!(s.prefetch(1, &[6, 7]).unwrap(), 2);
        let p = s.acquire(1, &[6], &[]).unwrap();
        assert_eq!(p.traffic().misses, 0, "a prefetched expert is a hit");
        p.release().unwrap();
        s.leave();
        let s = store(2, true, "preload");
        assert_eq!(s.preload(&[((1, 1), 9), ((1, 3), 8), ((1, 2), 1)]).unwrap(), 1, "damaged 3 skipped, 2 slots");
        s.enter();
        let p = s.acquire(1, &[1], &[]).unwrap();
        assert_eq!(p.traffic().hits, 1);
        p.release().unwrap();
        s.leave();
    }
}
