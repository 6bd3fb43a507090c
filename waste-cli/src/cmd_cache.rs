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
    /// Sequences decoded together (`serve --parallel`): stream `i` replays
    /// the trace from token `i · len / N`, and each step accesses the union
    /// of the streams' experts per layer, once (as `Model::step_many` does).
    #[arg(long, default_value_t = 1)]
    streams: usize,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// The trace as `n` streams decoded together: step `t`, layer `l` holds
/// the union of stream `i`'s token `(t + i·len/n) mod len` at layer `l`
/// (each distinct expert once, in first-use order).
fn streams_of(trace: &waste_cache::Trace, n: usize) -> waste_cache::Trace {
    let len = trace.len();
    (0..len)
        .map(|t| {
            let layers = trace[t].len();
            (0..layers)
                .map(|l| {
                    let mut ids: Vec<u32> = Vec::new();
                    for i in 0..n {
                        let tok = &trace[(t + i * len / n) % len];
                        for &e in tok.get(l).map_or(&[][..], |v| v.as_slice()) {
                            if !ids.contains(&e) {
                                ids.push(e);
                            }
                        }
                    }
                    ids
                })
                .collect()
        })
        .collect()
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
    if a.streams == 0 || a.streams > 64 {
        bail!("--streams {}: 1 to 64", a.streams);
    }
    let tokens = (trace.len() * a.streams) as f64;
    let trace = if a.streams > 1 { streams_of(&trace, a.streams) } else { trace };
    if let Some(k) = trace.iter().flatten().map(Vec::len).max().filter(|&k| k > a.slots) {
        bail!("--slots {} cannot hold one step's {k} experts of a layer", a.slots);
    }
    let r = simulate(&trace, a.slots, policy)?;
    let reads = (r.accesses - r.hits) as f64 / tokens.max(1.0);
    if a.json {
        print_json(
            &json!({"hit_rate": r.hit_rate(), "hits": r.hits, "accesses": r.accesses, "evictions": r.evictions, "policy": policy.name(), "slots": a.slots,
                "streams": a.streams, "reads_per_token": reads, "accesses_per_token": r.accesses as f64 / tokens.max(1.0)}),
        )?;
    } else {
        outln!(
            "{}: {} slots, {} stream(s): hit rate {:.2}% ({} / {} accesses, {} evictions), {:.2} reads a token",
            policy.name(),
            a.slots,
            a.streams,
            100.0 * r.hit_rate(),
            r.hits,
            r.accesses,
            r.evictions,
            reads
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

#[cfg(test)]
mod tests {
    use super::streams_of;

    /// Two streams half a trace apart: each step's layer holds the union of
    /// the two tokens' experts, each once, the first stream's first.
    #[test]
    fn streams_access_the_union_of_their_tokens() {
        let trace = vec![vec![vec![1, 2], vec![5, 6]], vec![vec![2, 3], vec![6, 7]]];
        let two = streams_of(&trace, 2);
        assert_eq!(two, vec![vec![vec![1, 2, 3], vec![5, 6, 7]], vec![vec![2, 3, 1], vec![6, 7, 5]]]);
        assert_eq!(streams_of(&trace, 1), trace);
    }
}
