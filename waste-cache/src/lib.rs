//! # waste-cache
//!
//! The expert store of the streaming engine: [`ExpertStore`] owns the
//! expert cache (a fixed arena of record-sized slots, huge pages where the
//! OS gives them), the reader pool, record checks, read-ahead, lookahead
//! prefetch and the usage preload behind `acquire` / [`Pinned::wait`] /
//! `prefetch`. Eviction is the `eta` policy by default (the expert expected
//! to be needed last, [`eta`]), or LFRU / LRU over a random sample of 16
//! slots; in-flight, in-use and prefetch-window slots are pinned,
//! speculative slots evicted first. Also here: the RAM budget resolver
//! (physical RAM, cgroup v1 and v2 limits, macOS memory pressure, the
//! default-budget rule) and a trace-driven simulator that replays real
//! routing through the very same cache code (with Belady's optimal policy as
//! the upper bound).
#![deny(missing_docs)]

mod budget;
mod cache;
pub mod eta;
mod sim;
mod store;

pub use budget::{
    cgroup_limit, parse_size, physical_ram, resolve, usable_ram, usable_ram_macos, usable_ram_with, BelowFloor, Budget,
    CgroupPaths, Floor, MacMemory,
};
pub use cache::{CacheError, CacheStats, Claim, ExpertCache, Key, Lookup, Policy, SlotState, VICTIM_SAMPLE};
pub use sim::{parse_trace, simulate, SimResult, Trace};
pub use store::{ExpertStore, Pinned, RecordSource, Traffic, PIN_WAIT};
