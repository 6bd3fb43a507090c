//! The cores' bound on a token, for `bench`: how long one token's matrix
//! work takes at this machine's kernel speed with the data in cache, on the
//! model's own threads, SIMD level and weights. Memory and disk give the
//! roofline a token cannot beat by streaming; this is the one it cannot
//! beat by computing (docs/lab/2026-12-04-48-what-bounds-an-all-cached-token-on-one-core.md, twenty-fourth session: on a 2-vCPU
//! AVX-512 VM the VQ3R lookups and the Q4G matvec are bound by the vector
//! pipes, not by memory).
//!
//! Measured, not modelled: each trunk format's matvec runs on a slice of the
//! model's largest matrix of that format small enough to stay in L2 (each
//! thread its own rows), and one MoE layer's routed experts run as decode
//! runs them (tables, then `top_k` experts across the lanes) on one resident
//! record. What is left out — the attention recurrences, norms, routing, the
//! pool's synchronisation — makes it a lower bound on a token's time.
//!
//! A prefill token has its own ([`Model::compute_bounds`]): the
//! same probes with the matmat kernels at the chunk's width, the last layer
//! and the head shared by the prompt, and the experts as the prefill ran
//! them.

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

/// The prefill whose cores' bound [`Model::compute_bounds`] takes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillShape {
    /// Prompt tokens.
    pub tokens: usize,
    /// Most tokens a chunk evaluates together ([`crate::Session::chunk_len`];
    /// the probe takes at most the model's [`crate::Model::chunk`]).
    pub chunk: usize,
    /// Tokens each run of a batching expert kernel served on average
    /// (expert uses / [`crate::Stats::expert_runs`]; 1 when tokens run one
    /// by one).
    pub users: f64,
}

/// Weights per format of `mats`.
fn weights_by_fmt(mats: &[&Matrix]) -> Vec<(Fmt, f64)> {
    let mut weights: Vec<(Fmt, f64)> = Vec::new();
    for m in mats {
        let w = m.rows as f64 * m.cols as f64;
        match weights.iter_mut().find(|e| e.0 == m.fmt) {
            Some(e) => e.1 += w,
            None => weights.push((m.fmt, w)),
        }
    }
    weights
}

/// ms to run every matrix of `weights` (per format, in weights) at `rates`
/// (per format, weights a second); a format without a rate counts nothing.
fn trunk_ms(weights: &[(Fmt, f64)], rates: &[(Fmt, f64)]) -> f64 {
    weights
        .iter()
        .filter_map(|(f, w)| rates.iter().find(|r| r.0 == *f).filter(|r| r.1 > 0.0).map(|r| w / r.1 * 1e3))
        .sum()
}

/// ms a prefill token needs at least for its trunk matrices: `body` (the
/// layers before the last, every token, as chunks of matmats at `rates`,
/// weight-token products a second) and `once` (the last layer and the
/// head, for the prompt's last token only, at `once_rates`, shared by its
/// `tokens`).
fn prefill_trunk_ms(
    body: &[(Fmt, f64)],
    rates: &[(Fmt, f64)],
    once: &[(Fmt, f64)],
    once_rates: &[(Fmt, f64)],
    tokens: usize,
) -> f64 {
    trunk_ms(body, rates) + trunk_ms(once, once_rates) / tokens.max(1) as f64
}

/// The whole token counts around `users` (at least 1, at most `most`; not
/// finite counts as 1) and `users`' place between them: a batching run's
/// time grows by about a step per token, so `R` runs of `U` uses cost
/// `R · t(U / R)` however the tokens spread over the runs, `t` interpolated
/// between its two probes.
fn users_around(users: f64, most: usize) -> (usize, usize, f64) {
    let most = most.max(1) as f64;
    let u = if users.is_finite() { users.clamp(1.0, most) } else { 1.0 };
    let (lo, hi) = (u.floor(), u.ceil());
    (lo as usize, hi as usize, u - lo)
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
        let r = self.measure_compute().map(|(d, _)| d);
        self.store.pause_prefault(false);
        r
    }

    /// The cores' bounds on a decode token and on a token of a prefill of
    /// `p.tokens` tokens (both per token, in the terms of
    /// [`Model::compute_bound`]), from one set of probes: the prefill reuses
    /// decode's matvec rates and token-by-token expert probe. For the
    /// prefill, the layers before the last run every matrix for every token
    /// as chunks of up to `p.chunk` inputs (the matmat kernels, timed at
    /// that width); the last layer's matrices and the head count once for
    /// the prompt (the engine runs them for the last token; the last layer's
    /// attention-state projections take every token, so counting them once
    /// keeps this a lower bound). The routed experts run as prefill runs
    /// them: a kernel that batches serves `p.users` tokens a run (its run
    /// time probed at the whole counts around it and interpolated), the
    /// others (VQ) run token by token as decode does. Same pin and
    /// prefault hold as [`Model::compute_bound`].
    ///
    /// # Errors
    /// A failed read of the probe's record.
    pub fn compute_bounds(&self, p: PrefillShape) -> Result<(ComputeBound, ComputeBound)> {
        self.store.pause_prefault(true);
        let r = self.measure_compute().and_then(|(d, mv)| Ok((d, self.measure_prefill_compute(p, &d, &mv)?)));
        self.store.pause_prefault(false);
        r
    }

    /// Decode's bound and the matvec rates per format it was built from.
    fn measure_compute(&self) -> Result<(ComputeBound, Vec<(Fmt, f64)>)> {
        let mats = self.trunk_matrices();
        let weights = weights_by_fmt(&mats);
        let rates = self.rates(&weights, &mats, 1);
        let top_k = self.config().top_k;
        let moe_layer_ms = self.moe_layer_ms()?;
        Ok((ComputeBound { trunk_ms: trunk_ms(&weights, &rates), moe_layer_ms, top_k }, rates))
    }

    /// The prefill's bound, with decode's bound `d` and matvec rates `mv`.
    fn measure_prefill_compute(&self, p: PrefillShape, d: &ComputeBound, mv: &[(Fmt, f64)]) -> Result<ComputeBound> {
        // the engine's chunks hold at most its buffers' tokens: a caller's larger
        // chunk or prompt does not size the probe's inputs
        let nt = p.chunk.clamp(1, p.tokens.max(1)).min(self.chunk());
        let last = self.layers.len().saturating_sub(1);
        let body: Vec<&Matrix> = (0..last).flat_map(|l| self.layer_matrices(l)).collect();
        let mut once: Vec<&Matrix> = if self.layers.is_empty() { Vec::new() } else { self.layer_matrices(last) };
        if let crate::model::Head::Resident(h) = &self.head {
            once.push(h);
        }
        let wb = weights_by_fmt(&body);
        // chunks of one token run the matvecs decode's rates already timed
        let rb = if nt > 1 { self.rates(&wb, &body, nt) } else { mv.to_vec() };
        let trunk = prefill_trunk_ms(&wb, &rb, &weights_by_fmt(&once), mv, p.tokens);
        let moe_layer_ms = match &self.kernel {
            Some(k) if k.batches() && nt > 1 => {
                let (lo, hi, frac) = users_around(p.users, k.batch.min(nt));
                let t_lo = self.moe_batch_ms(lo)?;
                let t = if hi > lo { t_lo + frac * (self.moe_batch_ms(hi)? - t_lo) } else { t_lo };
                // top_k uses a token and layer, `users` of them a run
                d.top_k as f64 * t / (lo as f64 + frac)
            }
            // VQ experts whose tokens go in groups share each group's
            // gathers: a use in a pair costs half a pair run, in a quad a
            // quarter of a quad run (three tokens run as four), alone decode's
            Some(_) if nt > 1 => match self.moe_groups_ms(2)? {
                Some(pair_ms) => {
                    let quad_ms = if nt >= 4 { self.moe_groups_ms(4)? } else { None };
                    grouped_layer_ms([d.moe_layer_ms, pair_ms, quad_ms.unwrap_or(f64::NAN)], p.users)
                }
                None => d.moe_layer_ms,
            },
            _ => d.moe_layer_ms,
        };
        Ok(ComputeBound { trunk_ms: trunk, moe_layer_ms, top_k: d.top_k })
    }

    /// Each format's rate (weight-input products a second) over `nt`
    /// inputs, probed on that format's largest matrix in `mats`.
    fn rates(&self, weights: &[(Fmt, f64)], mats: &[&Matrix], nt: usize) -> Vec<(Fmt, f64)> {
        weights
            .iter()
            .filter_map(|&(f, _)| {
                let largest = mats.iter().filter(|m| m.fmt == f).max_by_key(|m| m.rows.saturating_mul(m.cols))?;
                // a format of empty matrices has no work to time
                (largest.rows > 0 && largest.cols > 0).then(|| (f, self.product_rate(largest, nt)))
            })
            .collect()
    }

    /// Weight-input products a second of `m` (at least one row and column)
    /// over `nt` inputs — its matvec for one, its matmat for more — on
    /// every thread at once, each over its own L2-sized run of rows, at the
    /// model's SIMD level.
    fn product_rate(&self, m: &Matrix, nt: usize) -> f64 {
        let threads = self.pool.threads();
        let row_bytes = m.view().row_bytes().max(1);
        let rows = (PROBE_ROW_BYTES / row_bytes).clamp(1, (m.rows / threads).max(1));
        let nt = nt.max(1);
        let xs: Vec<f32> = (0..nt * m.cols).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
        let mut ys = vec![0f32; threads * rows * nt];
        let (level, numeric) = (self.pool.level(), self.pool.numeric());
        // the fast mode's inputs, quantized as the pool quantizes them
        let fast: Option<Vec<waste_quant::fast::QInput>> =
            numeric.qmax().filter(|_| waste_quant::fast::applies(&m.view())).map(|q| {
                (0..nt)
                    .map(|j| {
                        waste_quant::fast::quantize_at(
                            level,
                            &xs[j * m.cols..(j + 1) * m.cols],
                            m.view().cols_padded(),
                            q,
                        )
                    })
                    .collect()
            });
        let ys = SyncSlice::new(&mut ys);
        let (secs, calls) = time_calls(|| {
            self.pool.run(threads, &|t| {
                let row0 = (t * rows).min(m.rows - rows);
                if let Some(q) = &fast {
                    // SAFETY: task t alone writes [t·rows·nt, (t+1)·rows·nt); input j's rows at + j·rows.
                    let mut outs: Vec<&mut [f32]> = (0..nt)
                        .map(|j| unsafe { ys.range(t * rows * nt + j * rows, t * rows * nt + (j + 1) * rows) })
                        .collect();
                    m.view().matmat_rows_fast(level, q, row0, &mut outs);
                } else if nt == 1 {
                    // SAFETY: task t alone writes outputs [t·rows, (t+1)·rows).
                    let y = unsafe { ys.range(t * rows, (t + 1) * rows) };
                    m.view().matvec_rows(level, &xs, row0, y);
                } else {
                    // SAFETY: task t alone writes [t·rows·nt, (t+1)·rows·nt):
                    // input j's rows at t·rows·nt + j·rows, inside `ys`.
                    unsafe { m.view().matmat_rows(level, &xs, nt, row0, rows, ys.ptr_at(t * rows * nt), rows) };
                }
            })
        });
        (threads * rows * nt) as f64 * m.cols as f64 * calls as f64 / secs
    }

    /// ms of one MoE layer's routed experts for one token, run as decode
    /// runs them (tables, then `top_k` experts across the lanes), every job
    /// on expert 0 of the first MoE layer (pinned in the cache throughout).
    fn moe_layer_ms(&self) -> Result<f64> {
        let c = self.config();
        let (k, lat) = (c.top_k, c.expert_width());
        self.with_probe_record(|kernel, books, rec| {
            let mut sc = kernel.scratch(waste_moe::lanes_for(self.pool.threads(), k));
            let x: Vec<f32> = (0..lat).map(|i| ((i % 13) as f32 - 6.0) * 0.02).collect();
            let mut outs = vec![0f32; k * lat];
            let slots: Vec<usize> = (0..k).collect();
            let fetch = |_: usize| Ok::<_, std::convert::Infallible>(rec);
            time_calls(|| {
                kernel.prepare(&self.pool, books, &x, &mut sc);
                let Ok(()) = kernel.forward_fetched(&self.pool, books, &slots, &fetch, &x, &mut sc, &mut outs);
            })
        })
    }

    /// ms of one MoE layer's routed experts for `n` (2 or 4) tokens that
    /// share all `top_k` of them, as a prefill chunk runs groups (the
    /// tokens' tables, then `top_k` jobs of `n` across the lanes), on expert
    /// 0 of the first MoE layer; `None` where tokens do not pair now
    /// (`ExpertKernel::pairs`) or, for 4, where they go in pairs only
    /// (`ExpertKernel::group_most`).
    fn moe_groups_ms(&self, n: usize) -> Result<Option<f64>> {
        let c = self.config();
        let (k, lat) = (c.top_k, c.expert_width());
        let mut applies = false;
        let ms = self.with_probe_record(|kernel, books, rec| {
            applies = kernel.batch >= n && kernel.pairs(&self.pool, books) && kernel.group_most() >= n;
            if !applies {
                return (0.0, 1);
            }
            let mut sc = kernel.scratch(waste_moe::lanes_for(self.pool.threads(), k));
            let xs: Vec<f32> = (0..n * lat).map(|i| ((i % 13) as f32 - 6.0) * 0.02).collect();
            let mut outs = vec![0f32; n * k * lat];
            // job i: expert i's n tokens, token t's output in slot t·k + i
            let jobs: Vec<waste_moe::GroupJob> = (0..k)
                .map(|i| waste_moe::GroupJob {
                    tokens: core::array::from_fn(|t| t.min(n - 1)),
                    n,
                    slots: core::array::from_fn(|t| t.min(n - 1) * k + i),
                    of: i,
                })
                .collect();
            let fetch = |_: usize| Ok::<_, std::convert::Infallible>(rec);
            let mut tables = vec![0f32; kernel.token_tables_floats() / kernel.batch * n];
            time_calls(|| {
                kernel.prepare_tokens(&self.pool, books, &xs, n, &mut tables);
                let Ok(()) = kernel.forward_groups(&self.pool, books, &jobs, &fetch, &tables, &mut sc, &mut outs);
            })
        })?;
        Ok(applies.then_some(ms))
    }

    /// ms of one run of a batching expert kernel over `users` tokens, as
    /// prefill runs it (`forward_batch`, rows across the pool), on expert 0
    /// of the first MoE layer.
    fn moe_batch_ms(&self, users: usize) -> Result<f64> {
        let lat = self.config().expert_width();
        self.with_probe_record(|kernel, _, rec| {
            let mut sc = kernel.scratch(1);
            for (i, v) in sc.batch_in[..users * lat].iter_mut().enumerate() {
                *v = ((i % 13) as f32 - 6.0) * 0.02;
            }
            time_calls(|| kernel.forward_batch(&self.pool, rec, users, &mut sc))
        })
    }

    /// ms a call of `probe(kernel, books, record)` takes, from its
    /// (seconds, calls), with expert 0 of the first MoE layer pinned in the
    /// cache throughout; 0 for a model without routed experts.
    fn with_probe_record(
        &self,
        probe: impl FnOnce(&waste_moe::ExpertKernel, &waste_moe::LayerBooks, &[u8]) -> (f64, usize),
    ) -> Result<f64> {
        let Some(kernel) = &self.kernel else { return Ok(0.0) };
        // the first resident MoE layer's codebooks (a streamed one is not in memory)
        let Some((l, books)) =
            self.layers.iter().enumerate().find_map(|(l, layer)| match layer.as_ref().map(|x| &x.ffn) {
                Some(Ffn::Moe(w)) => Some((l, &w.books)),
                _ => None,
            })
        else {
            return Ok(0.0);
        };
        let pinned = self.store.acquire(l as u32, &[0], &[])?;
        let rec = pinned.wait(0)?;
        let (secs, calls) = probe(kernel, books, rec);
        pinned.release()?;
        Ok(secs / calls as f64 * 1e3)
    }
}

/// A token's routed experts of one layer when its uses run `users` to a
/// run in groups: `ms[0]` a token's layer run alone (decode's), `ms[1]`
/// two tokens' layer all in pairs, `ms[2]` four tokens' all in quads (NaN
/// where tokens go in pairs only: `users` is then at most 2). A run of `n`
/// tokens costs the layer time of its group size `t(n)` (three run as a
/// quad: `t(3) = t(4)`), so `R` runs of `U` uses cost about `R · t(U / R)`
/// with `t` linear between whole group sizes: a use `t(u) / u`, `u`
/// clamped to 1..2 or 1..4.
fn grouped_layer_ms(ms: [f64; 3], users: f64) -> f64 {
    let most = if ms[2].is_finite() { 4 } else { 2 };
    let (lo, hi, frac) = users_around(users, most);
    let t = |n: usize| match n {
        0 | 1 => ms[0],
        2 => ms[1],
        _ => ms[2],
    };
    (t(lo) + frac * (t(hi) - t(lo))) / (lo as f64 + frac)
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
    fn a_prefill_token_pays_the_body_and_a_share_of_the_last_layer_and_head() {
        let body = [(Fmt::Q4G, 8e9)];
        let once = [(Fmt::Q4G, 1e9), (Fmt::Q8G, 2e9)];
        // the body at its matmat rate every token: 8e9 / 4e10 = 200 ms;
        // the last layer and head once for 8 tokens: (50 + 200) / 8 ms
        let (mm, mv) = ([(Fmt::Q4G, 4e10)], [(Fmt::Q4G, 2e10), (Fmt::Q8G, 1e10)]);
        assert!((prefill_trunk_ms(&body, &mm, &once, &mv, 8) - (200.0 + 250.0 / 8.0)).abs() < 1e-9);
        // one token pays all of it; 0 tokens count as one, not a division by 0
        assert!((prefill_trunk_ms(&body, &mm, &once, &mv, 1) - 450.0).abs() < 1e-9);
        assert_eq!(prefill_trunk_ms(&body, &mm, &once, &mv, 0), prefill_trunk_ms(&body, &mm, &once, &mv, 1));
    }

    #[test]
    fn grouped_uses_cost_their_groups_share() {
        let pairs_only = [10.0, 12.0, f64::NAN];
        assert_eq!(grouped_layer_ms(pairs_only, 1.0), 10.0);
        assert_eq!(grouped_layer_ms(pairs_only, 2.0), 6.0);
        // 1.5 a run: half the runs pairs, the uses 1/3 alone, 2/3 in pairs
        assert!((grouped_layer_ms(pairs_only, 1.5) - (10.0 / 3.0 + 6.0 * 2.0 / 3.0)).abs() < 1e-12);
        assert_eq!(grouped_layer_ms(pairs_only, 7.0), 6.0, "no more than pairs");
        assert_eq!(grouped_layer_ms(pairs_only, f64::NAN), 10.0);
        let quads = [10.0, 12.0, 16.0];
        assert_eq!(grouped_layer_ms(quads, 2.0), 6.0);
        assert_eq!(grouped_layer_ms(quads, 4.0), 4.0, "a quarter of a quad run");
        assert!((grouped_layer_ms(quads, 3.0) - 16.0 / 3.0).abs() < 1e-12, "three tokens run as four");
        // 2.5 a run: half pairs, half three-token quads: (12 + 16) / 2 per run
        assert!((grouped_layer_ms(quads, 2.5) - 14.0 / 2.5).abs() < 1e-12);
        assert_eq!(grouped_layer_ms(quads, 9.0), 4.0);
    }

    #[test]
    fn the_batched_probe_brackets_the_measured_users_within_the_batch() {
        assert_eq!(users_around(2.25, 16), (2, 3, 0.25));
        assert_eq!(users_around(1.0, 16), (1, 1, 0.0));
        // fewer than one token a run cannot be: one
        assert_eq!(users_around(0.3, 16), (1, 1, 0.0));
        assert_eq!(users_around(40.0, 16), (16, 16, 0.0));
        assert_eq!(users_around(f64::NAN, 16), (1, 1, 0.0));
        assert_eq!(users_around(f64::INFINITY, 8), (1, 1, 0.0));
        assert_eq!(users_around(5.0, 0), (1, 1, 0.0));
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
