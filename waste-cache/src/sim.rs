//! Trace-driven cache simulation through the same [`ExpertCache`] the engine uses.

use crate::cache::{CacheError, ExpertCache, Lookup, Policy};
use std::collections::HashMap;

/// A routing trace: `tokens × MoE layers × chosen experts`.
pub type Trace = Vec<Vec<Vec<u32>>>;

/// Parse a JSONL trace (`{"tok": i, "layers": [[ids], ...]}` per line).
///
/// # Errors
/// A message naming the line when a line is not a JSON object with a `layers` array of expert-id arrays.
pub fn parse_trace(text: &str) -> Result<Trace, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("line {}: {e}", n + 1))?;
        let layers =
            v.get("layers").and_then(|l| l.as_array()).ok_or_else(|| format!("line {}: no \"layers\" array", n + 1))?;
        let mut tok = Vec::with_capacity(layers.len());
        for (li, l) in layers.iter().enumerate() {
            let ids = l.as_array().ok_or_else(|| format!("line {}: a layer is not an array", n + 1))?;
            let ids = ids
                .iter()
                .map(|x| {
                    x.as_u64()
                        .filter(|&x| x < u32::MAX as u64)
                        .map(|x| x as u32)
                        .ok_or_else(|| format!("line {}: bad expert id {x}", n + 1))
                })
                .collect::<Result<Vec<_>, _>>()?;
            // a router picks distinct experts; a repeated id would count as
            // a free hit here and is refused by the engine's replay
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return Err(format!("line {}, layer {li}: expert {} appears twice", n + 1, w[0]));
            }
            tok.push(ids);
        }
        out.push(tok);
    }
    Ok(out)
}

/// Simulation outcome.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimResult {
    /// Hits.
    pub hits: u64,
    /// Accesses.
    pub accesses: u64,
    /// Evictions.
    pub evictions: u64,
}

impl SimResult {
    /// Hit rate in [0, 1].
    pub fn hit_rate(&self) -> f64 {
        if self.accesses == 0 {
            0.0
        } else {
            self.hits as f64 / self.accesses as f64
        }
    }
}

/// Replay `trace` through a cache of `slots` slots. A layer's experts are
/// pinned while that layer runs (as in the engine).
///
/// # Errors
/// [`CacheError::AllPinned`] when `slots` cannot hold one layer-step's experts.
pub fn simulate(trace: &Trace, slots: usize, policy: Policy) -> Result<SimResult, CacheError> {
    // a cache never holds more keys than the trace has accesses: capping the
    // slot table there changes no result and bounds what a caller's number allocates
    let accesses: usize = trace.iter().flatten().map(Vec::len).sum();
    let slots = slots.min(accesses.max(1));
    let mut c = ExpertCache::new(slots, 0, policy, false);
    let layers = trace.iter().map(|t| t.len()).max().unwrap_or(0);
    let top_k = trace.iter().flatten().map(|ids| ids.len()).max().unwrap_or(1);
    c.set_layers(&(0..layers as u32).collect::<Vec<_>>(), top_k);
    // flatten accesses; next use of each access for Belady
    let mut flat: Vec<(u32, u32)> = Vec::new();
    for tok in trace {
        for (l, ids) in tok.iter().enumerate() {
            for &e in ids {
                flat.push((l as u32, e));
            }
        }
    }
    let mut next = vec![u64::MAX; flat.len()];
    let mut seen: HashMap<(u32, u32), u64> = HashMap::new();
    for i in (0..flat.len()).rev() {
        next[i] = seen.get(&flat[i]).copied().unwrap_or(u64::MAX);
        seen.insert(flat[i], i as u64);
    }
    let mut i = 0usize;
    let mut hits = 0u64;
    for tok in trace {
        for (l, ids) in tok.iter().enumerate() {
            let mut pinned = Vec::with_capacity(ids.len());
            for &e in ids {
                let key = (l as u32, e);
                let slot = match c.lookup(key) {
                    Lookup::Ready(s) | Lookup::InFlight(s) => {
                        hits += 1;
                        c.pin(s);
                        s
                    }
                    Lookup::Miss => {
                        let s = c.reserve(key, false)?;
                        c.mark_ready(s);
                        s
                    }
                };
                c.touch(slot);
                c.set_next_use(slot, next[i]);
                pinned.push(slot);
                i += 1;
            }
            for s in pinned {
                c.unpin(s)?;
            }
        }
    }
    Ok(SimResult { hits, accesses: flat.len() as u64, evictions: c.stats.evictions })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn belady_is_an_upper_bound_and_cyclic_scans_break_lru() {
        // 1 layer, a cyclic scan over 5 experts with 4 slots: LRU never hits after warm-up.
        let trace: Trace = (0..100).map(|t| vec![vec![(t % 5) as u32]]).collect();
        let lru = simulate(&trace, 4, Policy::Lru).unwrap();
        let bel = simulate(&trace, 4, Policy::Belady).unwrap();
        let lfru = simulate(&trace, 4, Policy::Lfru).unwrap();
        assert_eq!(lru.hits, 0);
        assert!(bel.hits > 60, "{bel:?}");
        assert!(bel.hits >= lfru.hits);
        assert_eq!(lru.accesses, 100);
    }

    #[test]
    fn a_huge_slot_count_is_the_whole_trace_not_an_allocation() {
        let trace: Trace = (0..50).map(|t| vec![vec![(t % 7) as u32, 9]]).collect();
        let all = simulate(&trace, 100, Policy::Eta).unwrap();
        assert_eq!(simulate(&trace, usize::MAX, Policy::Eta).unwrap(), all);
        assert_eq!(all.hits, 100 - 8, "only first uses miss");
    }

    #[test]
    fn parse_rejects_garbage_precisely() {
        assert!(parse_trace("{\"tok\":0}\n").unwrap_err().contains("line 1"));
        assert!(parse_trace("{\"layers\":[[1,-2]]}").unwrap_err().contains("bad expert id"));
        let e = parse_trace("{\"layers\":[[1,2],[3,4,3]]}").unwrap_err();
        assert!(e.contains("line 1, layer 1: expert 3 appears twice"), "{e}");
        assert_eq!(parse_trace("{\"tok\":0,\"layers\":[[1,2],[3]]}\n").unwrap(), vec![vec![vec![1, 2], vec![3]]]);
    }
}
