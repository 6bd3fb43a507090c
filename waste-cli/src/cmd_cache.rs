//! `waste cachesim`: replay a routing trace through the engine's cache.

use crate::print_json;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use waste_cache::{parse_trace, simulate, Policy};

#[derive(Args)]
pub struct CachesimArgs {
    /// Routing trace (JSONL: `{"tok": i, "layers": [[ids], ...]}`).
    trace: PathBuf,
    /// Experts per layer (ids must be below it).
    #[arg(long)]
    experts: u32,
    /// Cache slots.
    #[arg(long)]
    slots: usize,
    /// eta (the engine's default), lfru, lru or belady (the offline optimum).
    #[arg(long, default_value = "eta")]
    policy: String,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn cachesim(a: CachesimArgs) -> Result<ExitCode> {
    let policy = Policy::parse(&a.policy)
        .with_context(|| format!("--policy {:?}: expected eta, lfru, lru or belady", a.policy))?;
    if a.slots == 0 {
        bail!("--slots must be at least 1");
    }
    let trace = load_trace(&a.trace)?;
    for (t, tok) in trace.iter().enumerate() {
        for ids in tok {
            if let Some(&e) = ids.iter().find(|&&e| e >= a.experts) {
                bail!("token {t}: expert {e} is not below --experts {}", a.experts);
            }
            let max_k = ids.len();
            if a.slots < max_k {
                bail!("--slots {} cannot hold one layer's {max_k} experts", a.slots);
            }
        }
    }
    let r = simulate(&trace, a.slots, policy)?;
    if a.json {
        print_json(
            &json!({"hit_rate": r.hit_rate(), "hits": r.hits, "accesses": r.accesses, "evictions": r.evictions, "policy": policy.name(), "slots": a.slots}),
        )?;
    } else {
        outln!(
            "{}: {} slots: hit rate {:.2}% ({} / {} accesses, {} evictions)",
            policy.name(),
            a.slots,
            100.0 * r.hit_rate(),
            r.hits,
            r.accesses,
            r.evictions
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Read and parse a routing trace (JSONL; a trace is a few MB, anything
/// beyond 1 GiB is refused rather than read).
pub fn load_trace(path: &std::path::Path) -> Result<waste_cache::Trace> {
    let bytes =
        waste_model::format::read_regular(path, 1 << 30).with_context(|| format!("reading {}", path.display()))?;
    let text = String::from_utf8(bytes).with_context(|| format!("{}: not UTF-8", path.display()))?;
    parse_trace(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}
