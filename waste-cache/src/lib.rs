//! # waste-cache
//!
//! The expert cache of the streaming engine — a fixed arena of record-sized
//! slots (huge pages where the OS gives them), LFRU (default) or LRU
//! eviction over a random sample of 16 slots, pinning of in-flight, in-use
//! and prefetch-window slots, speculative slots evicted first — plus the RAM
//! budget resolver (physical RAM, cgroup v1 and v2 limits, the default-budget
//! rule) and a trace-driven simulator that replays real routing through the
//! very same cache code (with Belady's optimal policy as the upper bound).
#![deny(missing_docs)]

mod budget;
mod cache;
pub mod eta;
mod sim;

pub use budget::{
    cgroup_limit, parse_size, physical_ram, resolve, usable_ram, usable_ram_macos, usable_ram_with, BelowFloor, Budget,
    CgroupPaths, Floor, MacMemory,
};
pub use cache::{CacheError, CacheStats, Claim, ExpertCache, Key, Lookup, Policy, SlotState, VICTIM_SAMPLE};
pub use sim::{parse_trace, simulate, SimResult, Trace};
