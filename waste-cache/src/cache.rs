//! The expert cache: a fixed arena of record-sized slots.

use crate::eta::Eta;
use std::collections::HashMap;
use waste_io::{AlignedBuf, Prefault, Ticket};

/// `(layer, expert)`.
pub type Key = (u32, u32);

/// Eviction policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Evict the expert expected to be needed last: a decayed per-expert
    /// rate and the expert's place in the layer cycle (`eta.rs`; default).
    Eta,
    /// Least frequently used, recency tie-break.
    Lfru,
    /// Least recently used.
    Lru,
    /// Optimal offline policy (needs next-use times; simulator only).
    Belady,
}

impl Policy {
    /// Parse `eta | lfru | lru | belady`.
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "eta" => Some(Policy::Eta),
            "lfru" => Some(Policy::Lfru),
            "lru" => Some(Policy::Lru),
            "belady" => Some(Policy::Belady),
            _ => None,
        }
    }
    /// Name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Eta => "eta",
            Policy::Lfru => "lfru",
            Policy::Lru => "lru",
            Policy::Belady => "belady",
        }
    }
}

/// State of a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Holds nothing.
    Empty,
    /// A read is in flight.
    InFlight,
    /// Holds a validated record.
    Ready,
    /// Its read failed while other sessions held it pinned: no longer found
    /// by lookups, freed when the last pin is released. Every session waiting
    /// on it gets an error.
    Failed,
}

/// Who completes an in-flight read (see [`ExpertCache::claim_read`]).
#[derive(Debug)]
pub enum Claim {
    /// The read was issued to the reader pool: wait on this ticket.
    Ticket(Ticket),
    /// Nothing was issued: read the record into the slot yourself.
    ReadYourself,
    /// Another session is completing it: wait until the slot is Ready or Failed.
    Wait,
}

#[derive(Debug)]
struct Slot {
    key: Option<Key>,
    state: SlotState,
    freq: u32,
    last: u64,
    pins: u32,
    spec: bool,
    window: bool,
    next_use: u64,
    ticket: Option<Ticket>,
    /// A session is completing the read (holding the ticket, or reading).
    claimed: bool,
    /// Why the read failed (kept while a `Failed` slot stays pinned, for
    /// the other sessions waiting on it).
    failure: Option<std::sync::Arc<str>>,
}

/// Result of a lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Resident and validated.
    Ready(usize),
    /// Being read.
    InFlight(usize),
    /// Not in the cache.
    Miss,
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CacheStats {
    /// Uses served from a resident or in-flight slot.
    pub hits: u64,
    /// Uses that needed a demand read.
    pub misses: u64,
    /// Bytes read (demand + speculative).
    pub bytes_read: u64,
    /// Speculative reads issued.
    pub prefetch_issued: u64,
    /// Speculative reads later used.
    pub prefetch_used: u64,
    /// Slots evicted.
    pub evictions: u64,
    /// Seconds waiting for reads.
    pub io_wait_seconds: f64,
}

/// Errors of the cache: all are engine bugs or impossible budgets, reported loudly.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum CacheError {
    /// No slot can be evicted.
    #[error("expert cache: no evictable slot for expert {expert} of layer {layer}: {pinned} of {slots} slots pinned, {inflight} in flight, {window} held by the prefetch window")]
    AllPinned {
        /// Layer wanted.
        layer: u32,
        /// Expert wanted.
        expert: u32,
        /// Slots.
        slots: usize,
        /// Pinned slots.
        pinned: usize,
        /// In-flight slots.
        inflight: usize,
        /// Window slots.
        window: usize,
    },
    /// A read of this record failed where another party completed it (a
    /// session, or a settling of finished reads); this one stops too rather
    /// than compute with a bad record.
    #[error("expert {expert} of layer {layer}: its read failed: {cause}")]
    ReadFailed {
        /// Layer.
        layer: u32,
        /// Expert.
        expert: u32,
        /// The failure as it was met (the record check's or the read's error).
        cause: String,
    },
    /// An expert of a layer whose records are not in the container.
    #[error("expert {expert} of layer {layer}: the container has no record for it")]
    NoRecord {
        /// Layer.
        layer: u32,
        /// Expert.
        expert: u32,
    },
    /// A record asked of a pin guard that did not acquire it (an engine bug).
    #[error("expert {expert} of layer {layer} was not acquired for this step")]
    NotPinned {
        /// Layer.
        layer: u32,
        /// Expert.
        expert: u32,
    },
    /// A pin was released twice.
    #[error("expert cache: slot {slot} unpinned more often than pinned")]
    PinUnderflow {
        /// Slot.
        slot: usize,
    },
    /// A pin outlived its kernel.
    #[error("expert cache: slot {slot} (expert {expert} of layer {layer}) is still pinned after its layer finished")]
    LeakedPin {
        /// Slot.
        slot: usize,
        /// Layer.
        layer: u32,
        /// Expert.
        expert: u32,
    },
}

/// Victims are chosen among this many random slots.
pub const VICTIM_SAMPLE: usize = 16;

/// The cache.
pub struct ExpertCache {
    /// Faults the arena in ahead of use ([`ExpertCache::start_prefault`]);
    /// declared before `arena` so it is dropped (stopped, joined) first.
    prefault: Option<Prefault>,
    arena: Option<AlignedBuf>,
    slot_bytes: usize,
    slots: Vec<Slot>,
    map: HashMap<Key, usize>,
    /// Uses of every key ever seen, resident or not (LFRU's frequency).
    history: HashMap<Key, u32>,
    free: Vec<usize>,
    clock: u64,
    rng: waste_rng::SplitMix64,
    policy: Policy,
    /// The `eta` policy's estimator (set by [`ExpertCache::set_layers`]).
    eta: Option<Eta>,
    /// Every slot's pins summed, so [`ExpertCache::check_no_pins`] (called
    /// as each layer's experts are released) scans the slots only when some
    /// pin is held, not every time (6 656 slots of the 48B shape at 20G).
    pins_held: u64,
    /// Every slot [`ExpertCache::set_window`] held since the last
    /// [`ExpertCache::clear_window`] (a slot may repeat, or have been let go
    /// since): clearing walks these, not the arena.
    windowed: Vec<usize>,
    /// Every slot [`ExpertCache::reserve`] made in flight that may still be
    /// (a superset, pruned by [`ExpertCache::finished_reads`]): the scans
    /// for finished and unclaimed reads walk these, not the arena. Every
    /// acquire reaps finished reads and clears the window; over the 6 656
    /// slots of the 48B shape at 20G the two walks took 52 µs a MoE layer
    /// (1.4 ms a token, docs/lab entry 77).
    inflight: Vec<usize>,
    /// Layer of the key being placed (the `eta` policy's "now").
    placing: u32,
    /// Counters.
    pub stats: CacheStats,
}

impl ExpertCache {
    /// A cache of `slots` slots of `slot_bytes` (a 4 KiB multiple), its arena
    /// allocated up front (huge pages when asked and available). With
    /// `slot_bytes == 0` no arena is allocated (simulation).
    pub fn new(slots: usize, slot_bytes: usize, policy: Policy, huge: bool) -> ExpertCache {
        let arena = (slot_bytes > 0 && slots > 0).then(|| AlignedBuf::new(slots * slot_bytes, huge));
        ExpertCache {
            prefault: None,
            arena,
            slot_bytes,
            slots: (0..slots)
                .map(|_| Slot {
                    key: None,
                    state: SlotState::Empty,
                    freq: 0,
                    last: 0,
                    pins: 0,
                    spec: false,
                    window: false,
                    next_use: u64::MAX,
                    ticket: None,
                    claimed: false,
                    failure: None,
                })
                .collect(),
            map: HashMap::with_capacity(slots * 2),
            history: HashMap::new(),
            free: (0..slots).rev().collect(),
            clock: 0,
            rng: waste_rng::SplitMix64::new(0x9E37_79B9_7F4A_7C15),
            policy,
            eta: (policy == Policy::Eta).then(|| Eta::new(&[0], 1)),
            pins_held: 0,
            windowed: Vec::new(),
            inflight: Vec::new(),
            placing: 0,
            stats: CacheStats::default(),
        }
    }
    /// The MoE layers in the order a token visits them and the experts each
    /// uses per token (the `eta` policy's cycle; other policies ignore it).
    pub fn set_layers(&mut self, layers: &[u32], top_k: usize) {
        if self.policy == Policy::Eta {
            self.eta = Some(Eta::new(layers, top_k));
        }
    }
    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }
    /// Whether the arena got huge pages.
    pub fn huge_pages(&self) -> bool {
        self.arena.as_ref().is_some_and(|a| a.is_huge())
    }
    /// Start faulting the arena's pages in ahead of their first read, on a
    /// thread of the idle scheduling class, first slot first (the order
    /// free slots are handed out): the OS's zeroing of fresh pages then
    /// stays out of the reads' latency ([`waste_io::Prefault`]). Nothing
    /// where the OS cannot, in a simulation, or when already started.
    pub fn start_prefault(&mut self) {
        if self.prefault.is_none() {
            // SAFETY: the arena is owned by this cache and never moves (a
            // mapping); `prefault` is declared before `arena`, so it is
            // dropped — its thread stopped and joined — first.
            self.prefault = self.arena.as_ref().and_then(|a| unsafe { Prefault::start(a) });
        }
    }
    /// Hold (`true`) or let go on (`false`) the prefault, if one runs
    /// ([`waste_io::Prefault::pause`]): a memory-bandwidth probe holds it.
    pub fn pause_prefault(&self, on: bool) {
        if let Some(p) = &self.prefault {
            p.pause(on);
        }
    }
    /// Bytes of the arena faulted in ahead of use so far.
    pub fn prefaulted_bytes(&self) -> usize {
        self.prefault.as_ref().map_or(0, |p| p.done())
    }
    /// Bytes of the arena.
    pub fn arena_bytes(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.capacity())
    }
    /// Policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Where `key` is.
    pub fn lookup(&self, key: Key) -> Lookup {
        match self.map.get(&key) {
            Some(&s) if self.slots[s].state == SlotState::Ready => Lookup::Ready(s),
            Some(&s) => Lookup::InFlight(s),
            None => Lookup::Miss,
        }
    }
    /// Key of a slot.
    pub fn key(&self, slot: usize) -> Option<Key> {
        self.slots[slot].key
    }
    /// State of a slot.
    pub fn state(&self, slot: usize) -> SlotState {
        self.slots[slot].state
    }

    /// Record a use of a slot (frequency, recency; a speculative slot becomes
    /// used). The frequency is the key's count over its whole history, so a
    /// popular expert that was evicted comes back with its count.
    pub fn touch(&mut self, slot: usize) {
        self.clock += 1;
        let s = &mut self.slots[slot];
        if let Some(k) = s.key {
            let h = self.history.entry(k).or_insert(0);
            *h = h.saturating_add(1);
            s.freq = *h;
        }
        s.last = self.clock;
        if let (Some(e), Some(k)) = (self.eta.as_mut(), s.key) {
            e.used(k);
        }
        if s.spec {
            s.spec = false;
            self.stats.prefetch_used += 1;
        }
    }
    /// Pin (in use or in flight): never evicted while pinned.
    pub fn pin(&mut self, slot: usize) {
        self.slots[slot].pins += 1;
        self.pins_held += 1;
    }
    /// Release a pin.
    ///
    /// # Errors
    /// [`CacheError::PinUnderflow`] when the slot is not pinned or does not exist.
    pub fn unpin(&mut self, slot: usize) -> Result<(), CacheError> {
        let s = self.slots.get_mut(slot).ok_or(CacheError::PinUnderflow { slot })?;
        if s.pins == 0 {
            return Err(CacheError::PinUnderflow { slot });
        }
        s.pins -= 1;
        self.pins_held -= 1;
        if s.pins == 0 && s.state == SlotState::Failed {
            self.free_slot(slot);
        }
        Ok(())
    }
    /// Hold or release a slot for the current prefetch window.
    pub fn set_window(&mut self, slot: usize, on: bool) {
        self.slots[slot].window = on;
        if on {
            // a caller that holds windows and never clears them: the list
            // keeps the held ones, once each (bounded by the arena)
            if self.windowed.len() >= 2 * self.slots.len().max(1) {
                let slots = &self.slots;
                self.windowed.retain(|&i| slots[i].window);
                self.windowed.sort_unstable();
                self.windowed.dedup();
            }
            self.windowed.push(slot);
        }
    }
    /// Release every prefetch-window hold.
    pub fn clear_window(&mut self) {
        for s in self.windowed.drain(..) {
            self.slots[s].window = false;
        }
    }
    /// Set the next use time of a slot (Belady).
    pub fn set_next_use(&mut self, slot: usize, t: u64) {
        self.slots[slot].next_use = t;
    }

    fn next_rand(&mut self) -> u64 {
        self.rng.next_u64()
    }

    fn evictable(s: &Slot) -> bool {
        s.pins == 0 && s.state != SlotState::InFlight && !s.window && s.key.is_some()
    }

    /// Better victim of two: unused speculative first, then by policy.
    fn better(&self, a: usize, b: usize) -> bool {
        let (x, y) = (&self.slots[a], &self.slots[b]);
        if x.spec != y.spec {
            return x.spec;
        }
        match self.policy {
            Policy::Lru => x.last < y.last,
            Policy::Lfru => (x.freq, x.last) < (y.freq, y.last),
            Policy::Belady => x.next_use > y.next_use,
            Policy::Eta => match (&self.eta, x.key, y.key) {
                (Some(e), Some(kx), Some(ky)) => e.distance(kx, self.placing) > e.distance(ky, self.placing),
                _ => x.last < y.last,
            },
        }
    }

    fn victim(&mut self) -> Option<usize> {
        let n = self.slots.len();
        let mut best: Option<usize> = None;
        if let (Policy::Eta, Some(e)) = (self.policy, &self.eta) {
            // every candidate once: an unused speculative slot first, then
            // the farthest expected next use
            let mut far = (false, f64::NEG_INFINITY);
            for (i, s) in self.slots.iter().enumerate() {
                if let (true, Some(k)) = (Self::evictable(s), s.key) {
                    let d = (s.spec, e.distance(k, self.placing));
                    if best.is_none() || d > far {
                        (best, far) = (Some(i), d);
                    }
                }
            }
            return best;
        }
        if !matches!(self.policy, Policy::Belady | Policy::Eta) && n > VICTIM_SAMPLE {
            for _ in 0..VICTIM_SAMPLE {
                let i = (self.next_rand() % n as u64) as usize;
                if Self::evictable(&self.slots[i]) && best.is_none_or(|b| self.better(i, b)) {
                    best = Some(i);
                }
            }
            if best.is_some() {
                return best;
            }
        }
        for i in 0..n {
            if Self::evictable(&self.slots[i]) && best.is_none_or(|b| self.better(i, b)) {
                best = Some(i);
            }
        }
        best
    }

    /// Take a slot for `key` (not present): an empty one, else evict a
    /// victim. The slot is returned in flight, pinned once, untouched.
    ///
    /// # Errors
    /// [`CacheError::AllPinned`] when every slot is pinned, in flight or held by the prefetch window.
    pub fn reserve(&mut self, key: Key, speculative: bool) -> Result<usize, CacheError> {
        debug_assert!(!self.map.contains_key(&key));
        self.placing = key.0;
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let v = self.victim().ok_or_else(|| CacheError::AllPinned {
                    layer: key.0,
                    expert: key.1,
                    slots: self.slots.len(),
                    pinned: self.slots.iter().filter(|s| s.pins > 0).count(),
                    inflight: self.slots.iter().filter(|s| s.state == SlotState::InFlight).count(),
                    window: self.slots.iter().filter(|s| s.window).count(),
                })?;
                if let Some(k) = self.slots[v].key.take() {
                    self.map.remove(&k);
                }
                self.stats.evictions += 1;
                v
            }
        };
        let freq = self.history.get(&key).copied().unwrap_or(0);
        let s = &mut self.slots[slot];
        // a free slot or a victim: unpinned, so the new slot's pin is the only one
        debug_assert_eq!(s.pins, 0);
        self.pins_held += 1;
        *s = Slot {
            key: Some(key),
            state: SlotState::InFlight,
            freq,
            last: self.clock,
            pins: 1,
            spec: speculative,
            window: false,
            next_use: u64::MAX,
            ticket: None,
            claimed: false,
            failure: None,
        };
        self.map.insert(key, slot);
        self.inflight.push(slot);
        if speculative {
            self.stats.prefetch_issued += 1;
        }
        Ok(slot)
    }

    /// The read into `slot` completed and validated.
    pub fn mark_ready(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        s.state = SlotState::Ready;
        s.claimed = false;
    }
    /// The read into `slot` failed (`cause`): lookups no longer find it (a
    /// later use reads the record again, into another slot). Unpinned, the
    /// slot is free at once; pinned by other sessions, it stays `Failed` —
    /// so none of them can mistake it for a good record or see it reused —
    /// until the last pin goes, and keeps the cause for them
    /// ([`ExpertCache::failure`]).
    pub fn mark_failed(&mut self, slot: usize, cause: &str) {
        let s = &mut self.slots[slot];
        if let Some(k) = s.key {
            if self.map.get(&k) == Some(&slot) {
                self.map.remove(&k);
            }
        }
        s.state = SlotState::Failed;
        s.claimed = false;
        s.ticket = None;
        if s.pins == 0 {
            self.free_slot(slot);
        } else {
            s.failure = Some(cause.into());
        }
    }
    /// Why the read into a `Failed` slot failed (`None` for any other slot).
    pub fn failure(&self, slot: usize) -> Option<std::sync::Arc<str>> {
        self.slots.get(slot).filter(|s| s.state == SlotState::Failed).and_then(|s| s.failure.clone())
    }
    fn free_slot(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        self.pins_held -= u64::from(s.pins);
        s.key = None;
        s.state = SlotState::Empty;
        s.pins = 0;
        s.spec = false;
        s.window = false;
        s.ticket = None;
        s.claimed = false;
        s.failure = None;
        self.free.push(slot);
    }
    /// Decide who completes the in-flight read of `slot`: the first caller
    /// takes the ticket (or, when nothing was issued, reads itself); later
    /// callers wait for it. Exactly one claimant per read, so no two sessions
    /// ever write a slot at once.
    pub fn claim_read(&mut self, slot: usize) -> Claim {
        let s = &mut self.slots[slot];
        if s.state != SlotState::InFlight || s.claimed {
            return Claim::Wait;
        }
        s.claimed = true;
        match s.ticket.take() {
            Some(t) => Claim::Ticket(t),
            None => Claim::ReadYourself,
        }
    }
    /// Attach the in-flight read's ticket.
    pub fn set_ticket(&mut self, slot: usize, t: Ticket) {
        self.slots[slot].ticket = Some(t);
    }
    /// Take the in-flight read's ticket (the taker waits on it).
    pub fn take_ticket(&mut self, slot: usize) -> Option<Ticket> {
        let s = &mut self.slots[slot];
        let t = s.ticket.take();
        s.claimed |= t.is_some();
        t
    }
    /// Borrow a ticket (to promote it).
    pub fn ticket(&self, slot: usize) -> Option<&Ticket> {
        self.slots[slot].ticket.as_ref()
    }
    /// Destination memory of a slot.
    ///
    /// # Panics
    /// When `slot` is not a slot of this cache.
    pub fn slot_ptr(&mut self, slot: usize) -> *mut u8 {
        assert!(slot < self.slots.len(), "slot {slot} of {}", self.slots.len());
        let b = self.slot_bytes;
        let arena = self.arena.as_mut().expect("cache has an arena");
        // SAFETY: slot < slots, the arena holds slots × slot_bytes.
        unsafe { arena.as_mut_ptr().add(slot * b) }
    }
    /// A slot's bytes (only meaningful when Ready).
    ///
    /// # Panics
    /// When the cache has no arena (a simulation) or `slot` is out of range.
    pub fn slot_data(&self, slot: usize) -> &[u8] {
        let b = self.slot_bytes;
        let arena = self.arena.as_ref().expect("cache has an arena");
        &arena[slot * b..(slot + 1) * b]
    }
    /// Fail loudly if any slot is still pinned (called when a layer or token ends).
    ///
    /// # Errors
    /// [`CacheError::LeakedPin`] naming the first ready slot still pinned.
    pub fn check_no_pins(&self) -> Result<(), CacheError> {
        if self.pins_held == 0 {
            return Ok(());
        }
        match self.slots.iter().position(|s| s.pins > 0 && s.state == SlotState::Ready) {
            Some(i) => {
                let (layer, expert) = self.slots[i].key.unwrap_or((u32::MAX, u32::MAX));
                Err(CacheError::LeakedPin { slot: i, layer, expert })
            }
            None => Ok(()),
        }
    }
    /// Slots a session holds: pinned or in its prefetch window (an
    /// unpinned read in flight is not held: an acquire settles it itself).
    pub fn held_slots(&self) -> usize {
        self.slots.iter().filter(|s| s.pins > 0 || s.window).count()
    }
    /// Every key used so far with its use count (for the usage hotlist).
    pub fn history(&self) -> Vec<(Key, u32)> {
        self.history.iter().map(|(k, v)| (*k, *v)).collect()
    }
    /// Seed a key's use count (from a usage hotlist whose largest count is
    /// `max_count`).
    pub fn seed_history(&mut self, key: Key, count: u32, max_count: u32) {
        self.history.insert(key, count);
        if let Some(e) = self.eta.as_mut() {
            e.seed(key, count, max_count);
        }
        if let Some(&s) = self.map.get(&key) {
            self.slots[s].freq = count;
        }
    }
    /// In-flight slots whose read has finished (to be validated by the owner).
    pub fn finished_reads(&mut self) -> Vec<usize> {
        let slots = &self.slots;
        self.inflight.retain(|&i| slots[i].state == SlotState::InFlight);
        // a slot reserved again after its read ended is listed twice
        self.inflight.sort_unstable();
        self.inflight.dedup();
        self.inflight.iter().copied().filter(|&i| slots[i].ticket.as_ref().is_some_and(|t| t.is_done())).collect()
    }
    /// Whether a slot is in flight with a session completing its read.
    pub fn is_claimed(&self, slot: usize) -> bool {
        self.slots[slot].claimed
    }
    /// An unpinned in-flight slot with its ticket still attached (a
    /// speculative read nobody waits for): waiting on it frees a victim.
    pub fn unclaimed_inflight(&self) -> Option<usize> {
        self.inflight
            .iter()
            .copied()
            .filter(|&i| {
                self.slots[i].state == SlotState::InFlight && self.slots[i].pins == 0 && self.slots[i].ticket.is_some()
            })
            .min()
    }
    /// Resident keys with their use counts.
    pub fn resident(&self) -> Vec<(Key, u32)> {
        self.slots.iter().filter_map(|s| s.key.filter(|_| s.state == SlotState::Ready).map(|k| (k, s.freq))).collect()
    }
}

#[cfg(test)]
mod tests {
    /// The prefetch window's holds are let go by one clear however often a
    /// slot was held (the list of them may repeat a slot), and reserved
    /// slots that left flight are not read as in flight.
    #[test]
    fn windows_clear_and_finished_reads_follow_the_slots() {
        let mut c = ExpertCache::new(4, 0, Policy::Lru, false);
        let s: Vec<usize> = (0..3).map(|e| c.reserve((1, e), true).unwrap()).collect();
        for &x in &s {
            c.unpin(x).unwrap();
        }
        for _ in 0..20 {
            c.set_window(s[0], true);
            c.set_window(s[1], true);
        }
        assert_eq!(c.held_slots(), 2);
        c.clear_window();
        assert_eq!(c.held_slots(), 0);
        c.set_window(s[2], true);
        c.set_window(s[2], false);
        c.clear_window();
        assert_eq!(c.held_slots(), 0);
        // no ticket: nothing finished; one made ready, one failed and reserved again
        assert!(c.finished_reads().is_empty());
        c.mark_ready(s[0]);
        c.mark_failed(s[1], "test");
        let again = c.reserve((1, 7), true).unwrap();
        assert_eq!(c.state(again), SlotState::InFlight);
        assert!(c.finished_reads().is_empty() && c.unclaimed_inflight().is_none());
        assert_eq!(c.lookup((1, 0)), Lookup::Ready(s[0]));
    }

    #[test]
    fn one_claimant_per_read_and_a_failure_outlives_other_sessions_pins() {
        let mut c = ExpertCache::new(3, 4096, Policy::Lfru, false);
        let s = c.reserve((1, 2), false).unwrap();
        // a second session pins the same in-flight slot
        assert_eq!(c.lookup((1, 2)), Lookup::InFlight(s));
        c.pin(s);
        // nothing issued: the first claimant reads it; everyone else waits
        assert!(matches!(c.claim_read(s), Claim::ReadYourself));
        assert!(matches!(c.claim_read(s), Claim::Wait));
        assert!(c.is_claimed(s));
        // the read fails: lookups miss at once (a new use reads again), but
        // the slot is not reused while the other session still pins it
        c.mark_failed(s, "test");
        assert_eq!(c.state(s), SlotState::Failed);
        assert_eq!(c.lookup((1, 2)), Lookup::Miss);
        let others: Vec<usize> = (0..2).map(|e| c.reserve((2, e), false).unwrap()).collect();
        assert!(!others.contains(&s), "a failed slot still pinned was handed out");
        c.unpin(s).unwrap();
        assert_eq!(c.state(s), SlotState::Failed);
        c.unpin(s).unwrap();
        assert_eq!(c.state(s), SlotState::Empty);
        assert!(c.unpin(s).is_err());
        assert!(c.unpin(99).is_err(), "an index out of range is an error, not a panic");
    }

    use super::*;

    /// The layer cycle: three MoE layers, two slots. After layers 0 and 1
    /// of a token, layer 2's expert needs a slot: LRU evicts layer 0's (the
    /// oldest — and the first needed by the next token), `eta` evicts layer
    /// 1's (equally likely to return, but a whole token later).
    #[test]
    fn eta_keeps_the_expert_needed_next_where_lru_evicts_it() {
        for (pol, gone) in [(Policy::Lru, (0, 0)), (Policy::Eta, (1, 0))] {
            let mut c = ExpertCache::new(2, 0, pol, false);
            c.set_layers(&[0, 1, 2], 1);
            for key in [(0, 0), (1, 0)] {
                let s = c.reserve(key, false).unwrap();
                c.touch(s);
                c.mark_ready(s);
                c.unpin(s).unwrap();
            }
            let s = c.reserve((2, 0), false).unwrap();
            c.touch(s);
            assert_eq!(c.lookup(gone), Lookup::Miss, "{pol:?}");
            assert_eq!(c.stats.evictions, 1);
        }
    }

    #[test]
    fn evicts_by_policy_and_never_pinned() {
        for pol in [Policy::Lfru, Policy::Lru] {
            let mut c = ExpertCache::new(3, 0, pol, false);
            for e in 0..3 {
                let s = c.reserve((0, e), false).unwrap();
                c.mark_ready(s);
                c.unpin(s).unwrap();
                c.touch(s);
            }
            // expert 0 used often, expert 1 most recently
            let s0 = match c.lookup((0, 0)) {
                Lookup::Ready(s) => s,
                _ => panic!(),
            };
            for _ in 0..5 {
                c.touch(s0);
            }
            let s1 = match c.lookup((0, 1)) {
                Lookup::Ready(s) => s,
                _ => panic!(),
            };
            c.touch(s1);
            let s = c.reserve((0, 9), false).unwrap();
            c.mark_ready(s);
            c.unpin(s).unwrap();
            let gone: Vec<u32> = (0..3).filter(|&e| c.lookup((0, e)) == Lookup::Miss).collect();
            match pol {
                Policy::Lfru => assert_eq!(gone, vec![2]), // least frequent (1 use) and older than 1
                _ => assert_eq!(gone, vec![2]),            // least recent
            }
            // pin everything: reserving fails loudly
            for e in [0, 1, 9] {
                if let Lookup::Ready(s) = c.lookup((0, e)) {
                    c.pin(s);
                }
            }
            let err = c.reserve((1, 1), false).unwrap_err();
            assert!(err.to_string().contains("no evictable slot for expert 1 of layer 1"), "{err}");
        }
    }

    #[test]
    fn speculative_slots_are_evicted_first_and_counted() {
        let mut c = ExpertCache::new(2, 0, Policy::Lfru, false);
        let a = c.reserve((0, 0), false).unwrap();
        c.mark_ready(a);
        c.unpin(a).unwrap();
        for _ in 0..3 {
            c.touch(a);
        }
        let b = c.reserve((0, 1), true).unwrap();
        c.mark_ready(b);
        c.unpin(b).unwrap();
        c.touch(b); // used: no longer speculative
        assert_eq!(c.stats.prefetch_used, 1);
        let d = c.reserve((0, 2), true).unwrap(); // evicts (0,1): fewer uses
        c.mark_ready(d);
        c.unpin(d).unwrap();
        let e = c.reserve((0, 3), false).unwrap(); // evicts the unused speculative (0,2) even though (0,0)...
        assert_eq!(c.lookup((0, 2)), Lookup::Miss);
        assert_eq!(c.lookup((0, 0)), Lookup::Ready(a));
        c.unpin(e).unwrap();
        assert!(c.unpin(e).is_err());
    }

    #[test]
    fn leaked_pin_is_reported() {
        let mut c = ExpertCache::new(2, 0, Policy::Lru, false);
        let a = c.reserve((3, 7), false).unwrap();
        c.mark_ready(a);
        assert_eq!(c.check_no_pins(), Err(CacheError::LeakedPin { slot: a, layer: 3, expert: 7 }));
        c.unpin(a).unwrap();
        assert_eq!(c.check_no_pins(), Ok(()));
    }

    /// The pins the cache counts are the slots' pins summed, through pins,
    /// unpins, failed reads and evictions — so `check_no_pins` skipping its
    /// scan at zero skips nothing.
    #[test]
    fn the_pin_count_is_the_slots_pins_summed() {
        let mut c = ExpertCache::new(3, 0, Policy::Lru, false);
        let sum = |c: &ExpertCache| c.slots.iter().map(|s| u64::from(s.pins)).sum::<u64>();
        let a = c.reserve((0, 0), false).unwrap();
        c.pin(a); // a second session on the same slot
        let b = c.reserve((0, 1), true).unwrap();
        assert_eq!((c.pins_held, sum(&c)), (3, 3));
        c.mark_failed(b, "bad header"); // still pinned: not freed yet
        assert_eq!(c.failure(b).as_deref(), Some("bad header"), "the cause kept for the pinning sessions");
        assert_eq!((c.pins_held, sum(&c)), (3, 3));
        c.unpin(b).unwrap(); // the last pin of a failed slot frees it
        c.mark_ready(a);
        c.unpin(a).unwrap();
        assert_eq!((c.pins_held, sum(&c)), (1, 1));
        assert!(c.check_no_pins().is_err());
        c.unpin(a).unwrap();
        assert_eq!((c.pins_held, sum(&c)), (0, 0));
        assert_eq!(c.check_no_pins(), Ok(()));
        // evictions reuse unpinned slots only; the count follows them
        for e in 2..8 {
            let s = c.reserve((0, e), false).unwrap();
            c.mark_ready(s);
            c.unpin(s).unwrap();
        }
        assert_eq!((c.pins_held, sum(&c)), (0, 0));
        assert!(c.unpin(a).is_err(), "an unpinned slot");
        assert_eq!((c.pins_held, sum(&c)), (0, 0));
    }
}
