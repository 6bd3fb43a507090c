//! The cores' bound on a token, for `bench`: how long one token's matrix
//! work takes at this machine's kernel speed with the data in cache, on the
//! model's own threads, SIMD level and weights. Memory and disk give the
//! roofline a token cannot beat by streaming; this is the one it cannot
//! beat by computing (docs/LEARNED.md, twenty-fourth session: on a 2-vCPU
//! AVX-512 VM the VQ3R lookups and the Q4G matvec are bound by the vector
//! pipes, not by memory).
//!
//! Measured, not modelled: each trunk format's matvec runs on a slice of the
//! model's largest matrix of that format small enough to stay in L2 (each
//! thread its own rows), and one MoE layer's routed experts run as decode
//! runs them (tables, then `top_k` experts across the lanes) on one resident
//! record. What is left out — the attention recurrences, norms, routing, the
//! pool's synchronisation — makes it a lower bound on a token's time.

use crate::model::Model;
use crate::weights::Ffn;
use crate::Result;
use std::time::Instant;
use waste_format::Fmt;
use waste_quant::{Matrix, SyncSlice};

/// Bytes of one thread's rows in a trunk probe: inside any L2 this engine
/// targets (1–2 MiB per core) with the input and outputs beside them.
const PROBE_ROW_BYTES: usize = 256 << 10;
/// Each timed pass of a probe runs for about this long.
const PASS_SECONDS: f64 = 0.02;
/// Passes per probe; the fastest counts (the others met interruptions).
const PASSES: usize = 10;
/// Most calls in one pass (a probe of a tiny model's microsecond calls
/// stays bounded).
const MAX_CALLS: usize = 100_000;

/// One token's compute at in-cache kernel speed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ComputeBound {
    /// Every trunk matrix once (the attention projections, dense and shared
    /// FFNs, routers, the LM head), ms.
    pub trunk_ms: f64,
    /// One MoE layer's routed experts for one token — its tables and
    /// `top_k` experts — ms; 0 for a model without routed experts.
    pub moe_layer_ms: f64,
    /// Experts per token and MoE layer.
    pub top_k: usize,
}

impl ComputeBound {
    /// ms the routed experts of a token that uses `experts_per_token` of
    /// them (`top_k` per MoE layer it runs) need at least.
    pub fn expert_ms_per_token(&self, experts_per_token: f64) -> f64 {
        let layers = if self.top_k > 0 { experts_per_token / self.top_k as f64 } else { 0.0 };
        layers * self.moe_layer_ms
    }
    /// ms such a token needs at least: the trunk and its experts.
    pub fn ms_per_token(&self, experts_per_token: f64) -> f64 {
        self.trunk_ms + self.expert_ms_per_token(experts_per_token)
    }
}

/// ms to run every matrix of `weights` (per format, in weights) at `rates`
/// (per format, weights a second); a format without a rate counts nothing.
fn trunk_ms(weights: &[(Fmt, f64)], rates: &[(Fmt, f64)]) -> f64 {
    weights
        .iter()
        .filter_map(|(f, w)| rates.iter().find(|r| r.0 == *f).filter(|r| r.1 > 0.0).map(|r| w / r.1 * 1e3))
        .sum()
}

/// Seconds of the fastest of [`PASSES`] passes of `calls` calls of `f`,
/// `calls` chosen so that a pass takes about [`PASS_SECONDS`]; returns
/// (seconds, calls).
fn time_calls(mut f: impl FnMut()) -> (f64, usize) {
    let t0 = Instant::now();
    f();
    let one = t0.elapsed().as_secs_f64().max(1e-9);
    let calls = ((PASS_SECONDS / one) as usize).clamp(1, MAX_CALLS);
    let best = (0..PASSES)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..calls {
                f();
            }
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    (best.max(1e-9), calls)
}

impl Model {
    /// The cores' bound on one token (see [`ComputeBound`]): each trunk
    /// format's matvec and one MoE layer's experts, timed with their data in
    /// cache on the model's threads. Takes about a second (ten passes of
    /// ≈ 20 ms per probe); the cache's prefault is held meanwhile. Run it after the work being
    /// judged: the expert probe pins one record of the first MoE layer,
    /// reading it into the cache if it is not there (which may evict
    /// another).
    ///
    /// # Errors
    /// A failed read of the probe's record.
    pub fn compute_bound(&self) -> Result<ComputeBound> {
        self.store.pause_prefault(true);
        let r = self.measure_compute();
        self.store.pause_prefault(false);
        r
    }

    fn measure_compute(&self) -> Result<ComputeBound> {
        let mats = self.trunk_matrices();
        let mut weights: Vec<(Fmt, f64)> = Vec::new();
        for m in &mats {
            let w = m.rows as f64 * m.cols as f64;
            match weights.iter_mut().find(|e| e.0 == m.fmt) {
                Some(e) => e.1 += w,
                None => weights.push((m.fmt, w)),
            }
        }
        let rates: Vec<(Fmt, f64)> = weights
            .iter()
            .filter_map(|&(f, _)| {
                let largest = mats.iter().filter(|m| m.fmt == f).max_by_key(|m| m.rows.saturating_mul(m.cols))?;
                // a format of empty matrices has no work to time
                (largest.rows > 0 && largest.cols > 0).then(|| (f, self.matvec_rate(largest)))
            })
            .collect();
        let top_k = self.config().top_k;
        let moe_layer_ms = self.moe_layer_ms()?;
        Ok(ComputeBound { trunk_ms: trunk_ms(&weights, &rates), moe_layer_ms, top_k })
    }

    /// Weights a second of `m`'s matvec (at least one row and column) on
    /// every thread at once, each over its own L2-sized run of rows, at the
    /// model's SIMD level.
    fn matvec_rate(&self, m: &Matrix) -> f64 {
        let threads = self.pool.threads();
        let row_bytes = m.view().row_bytes().max(1);
        let rows = (PROBE_ROW_BYTES / row_bytes).clamp(1, (m.rows / threads).max(1));
        let x: Vec<f32> = (0..m.cols).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
        let mut ys = vec![0f32; threads * rows];
        let level = self.pool.level();
        let ys = SyncSlice::new(&mut ys);
        let (secs, calls) = time_calls(|| {
            self.pool.run(threads, &|t| {
                // SAFETY: task t alone writes outputs [t·rows, (t+1)·rows).
                let y = unsafe { ys.range(t * rows, (t + 1) * rows) };
                let row0 = (t * rows).min(m.rows - rows);
                m.view().matvec_rows(level, &x, row0, y);
            })
        });
        (threads * rows) as f64 * m.cols as f64 * calls as f64 / secs
    }

    /// ms of one MoE layer's routed experts for one token, run as decode
    /// runs them (tables, then `top_k` experts across the lanes), every job
    /// on expert 0 of the first MoE layer (pinned in the cache throughout).
    fn moe_layer_ms(&self) -> Result<f64> {
        let Some(kernel) = &self.kernel else { return Ok(0.0) };
        let Some((l, books)) = self.layers.iter().enumerate().find_map(|(l, layer)| match &layer.ffn {
            Ffn::Moe(w) => Some((l, &w.books)),
            Ffn::Dense(_) => None,
        }) else {
            return Ok(0.0);
        };
        let c = self.config();
        let (k, lat) = (c.top_k, c.expert_width());
        let pinned = self.store.acquire(l as u32, &[0], &[])?;
        let rec = pinned.wait(0)?;
        let mut sc = kernel.scratch(waste_moe::lanes_for(self.pool.threads(), k));
        let x: Vec<f32> = (0..lat).map(|i| ((i % 13) as f32 - 6.0) * 0.02).collect();
        let mut outs = vec![0f32; k * lat];
        let slots: Vec<usize> = (0..k).collect();
        let fetch = |_: usize| Ok::<_, std::convert::Infallible>(rec);
        let (secs, calls) = time_calls(|| {
            kernel.prepare(&self.pool, books, &x, &mut sc);
            let Ok(()) = kernel.forward_fetched(&self.pool, books, &slots, &fetch, &x, &mut sc, &mut outs);
        });
        pinned.release()?;
        Ok(secs / calls as f64 * 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trunk_time_is_each_formats_weights_at_its_rate() {
        let w = [(Fmt::Q4G, 4e9), (Fmt::Q8G, 1e9), (Fmt::F32, 5e6)];
        let r = [(Fmt::Q8G, 2e10), (Fmt::Q4G, 4e10), (Fmt::F32, 0.0)];
        // 100 ms + 50 ms; a format with no usable rate adds nothing
        assert!((trunk_ms(&w, &r) - 150.0).abs() < 1e-9);
        assert_eq!(trunk_ms(&w, &[]), 0.0);
    }

    #[test]
    fn a_token_runs_one_moe_layer_per_top_k_experts() {
        let b = ComputeBound { trunk_ms: 10.0, moe_layer_ms: 2.0, top_k: 8 };
        // 26 MoE layers × 8 experts
        assert!((b.ms_per_token(208.0) - 62.0).abs() < 1e-9);
        assert!((b.expert_ms_per_token(208.0) - 52.0).abs() < 1e-9);
        assert_eq!(b.ms_per_token(0.0), 10.0);
        let dense = ComputeBound { trunk_ms: 3.0, moe_layer_ms: 0.0, top_k: 0 };
        assert_eq!(dense.ms_per_token(5.0), 3.0);
    }
}
