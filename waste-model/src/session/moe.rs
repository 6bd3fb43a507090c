//! The MoE block of a step, as the math reads: route each token (or
//! replay a recorded routing), acquire the union of the routed experts
//! from the store, run the experts in the order they arrive (batched over
//! the tokens routed to each, or token by token), combine with the shared
//! experts; and the router lookahead's prefetch of the next layer.

use super::*;

/// The MoE block's own buffers in a step (one formula for what
/// `Session::new` allocates and what the plan counts: [`MoeScratch::floats`]).
pub(super) struct MoeScratch {
    /// Router logits, a row of `experts` a chunk token.
    pub(super) router: Rows,
    /// One token's chosen (expert, weight) pairs.
    pub(super) chosen: Vec<(usize, f32)>,
    /// The experts' inputs per chunk token (the latent down-projection's
    /// output, where the model has one), a row of the expert width a chunk token.
    pub(super) lat_in: Rows,
    /// Each chunk token's weighted sum of its experts' outputs.
    pub(super) lat_sum: Rows,
    /// One token's experts' outputs, `top_k` rows of the expert width.
    pub(super) eouts: Rows,
    /// The shared experts' output per chunk token.
    pub(super) chunk_shared: Rows,
}

impl MoeScratch {
    /// The buffers' shapes, `(rows, width)`, in field order, for chunks of
    /// `chunk` tokens (no rows but the router's and the sums' without MoE
    /// layers).
    fn shapes(c: &waste_format::ModelConfig, chunk: usize) -> [(usize, usize); 5] {
        let (h, lat) = (c.hidden, c.expert_width());
        let moe = c.n_moe_layers() > 0;
        [
            (chunk, c.experts),
            (chunk, lat),
            (chunk, lat),
            (if moe { c.top_k } else { 0 }, lat),
            (if moe && c.shared_experts > 0 { chunk } else { 0 }, h),
        ]
    }
    /// The buffers for a config and chunks of `chunk` tokens.
    pub(super) fn new(c: &waste_format::ModelConfig, chunk: usize) -> MoeScratch {
        let [router, lat_in, lat_sum, eouts, shared] = Self::shapes(c, chunk).map(|(r, w)| Rows::new(r, w));
        MoeScratch { router, chosen: Vec::with_capacity(c.top_k), lat_in, lat_sum, eouts, chunk_shared: shared }
    }
    /// Their f32s for a config (the plan's count; the chosen pairs' few
    /// bytes aside).
    pub(super) fn floats(c: &waste_format::ModelConfig, chunk: usize) -> usize {
        Self::shapes(c, chunk).iter().map(|(r, w)| r * w).sum()
    }
    /// Bytes allocated (capacities).
    pub(super) fn allocated_bytes(&self) -> u64 {
        [&self.router, &self.lat_in, &self.lat_sum, &self.eouts, &self.chunk_shared]
            .iter()
            .map(|b| b.allocated_bytes())
            .sum()
    }
}

/// What a MoE layer's first half ([`Work::moe_front`]) leaves for its
/// second ([`Work::moe_back`]): the pinned experts (the first wave's where
/// they come in waves; none where a span of chunks pins them), some still
/// arriving, and the step's routes.
pub(super) struct MoeFront<'m> {
    experts: Option<Pinned<'m, crate::model::Records>>,
    pub(super) routed: Routed,
    /// Experts pinned at once where `distinct` (then in ascending id) is
    /// more than the cache can pin ([`crate::Model::expert_wave`]).
    wave: Option<usize>,
}

/// A step's routes and how its experts run.
pub(super) struct Routed {
    /// `nt × top_k` (expert, weight) pairs, each token's in ascending id.
    pub(super) routes: Vec<(usize, f32)>,
    /// Each expert once, in consumption order (ascending id where batched,
    /// paired or in waves).
    pub(super) distinct: Vec<u32>,
    /// Further uses of `distinct`'s experts.
    pub(super) repeats: Vec<u32>,
    /// Each expert once for all its tokens (formats a token reads directly).
    batched: bool,
    /// VQ experts with tokens in pairs (the fast mode's AVX2 gathers).
    paired: bool,
}

/// A fresh layer-step's stamp for the shared pair tables
/// ([`crate::model::PairScratch`]), never 0.
pub(super) fn next_stamp() -> u64 {
    static STAMPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    STAMPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The uses of `repeats` (experts used again in a step) that fall in
/// `wave`: what its acquire counts as further hits.
pub(super) fn repeats_in(repeats: &[u32], wave: &[u32]) -> Vec<u32> {
    repeats.iter().copied().filter(|e| wave.contains(e)).collect()
}

impl Work {
    /// A MoE layer for the step's tokens `first..first + nt`, first half:
    /// route every token, acquire the union of their experts once (the
    /// missing experts' reads start), the shared experts and the latent
    /// down-projection while they are in flight. [`Work::moe_back`] runs the
    /// experts (each once for all its tokens where the format batches, else
    /// token by token, resident ones first), combines them with the shared
    /// experts — at once, or after another half-batch's work.
    /// Where `pin` is false (a chunk of a span, [`Work::forward_span`]),
    /// nothing is acquired: the span pins its chunks' experts together.
    pub(super) fn moe_front<'m>(
        &mut self,
        m: &'m Model,
        l: usize,
        w: &MoeWeights,
        lanes: &[&mut Lane],
        span: Span<'_>,
        pin: bool,
    ) -> Result<MoeFront<'m>> {
        let (first, nt) = (span.first, span.nt);
        let kernel = m.kernel.as_ref().expect("MoE layer has an expert kernel");
        let xs = first..first + nt;
        let routes = self.route(m, l, w, lanes, span);
        // formats a token reads directly run each expert once for the
        // chunk, in ascending id: their reads are started in that order
        let batched = nt > 1 && kernel.batches();
        // VQ experts in the fast mode, looked up by gathers: two tokens of
        // an expert share its gathers (also in ascending id)
        let paired = !batched && nt > 1 && kernel.pairs(&m.pool, &w.books);
        let (mut distinct, repeats) = union_of(&routes, batched || paired);
        // more than the cache can pin at once: waves in ascending id, so
        // every token's sum still adds its experts in ascending id; half
        // the free slots each, the next wave's reads in flight while one
        // computes
        let wave = m.expert_wave().filter(|&n| pin && distinct.len() > n);
        if wave.is_some() {
            distinct.sort_unstable();
        }
        let mut experts = None;
        if pin {
            experts = Some(self.pin_wave(m, l, &distinct, &repeats, wave.unwrap_or(distinct.len()), 0)?);
            self.stats.experts_acquired += distinct.len() as u64;
        }
        // the shared experts while the reads are in flight (and while the
        // router's input still streams: not after the experts' compute)
        self.shared_experts(m, w, first, nt);
        // the chunk's expert inputs (the latent down-projection for all tokens at once)
        if let Some(lt) = &w.latent {
            m.pool.matmat(&lt.down.view(), self.chunk_ffn_in.rows(xs), nt, self.moe.lat_in.rows_mut(0..nt));
        }
        Ok(MoeFront { experts, routed: Routed { routes, distinct, repeats, batched, paired }, wave })
    }

    /// The MoE layer's second half: the routed experts (waiting for the
    /// reads still in flight), the combination into `chunk_ffn_out`, the
    /// release of the pins and the router lookahead into the next layer.
    pub(super) fn moe_back(
        &mut self,
        m: &Model,
        l: usize,
        w: &MoeWeights,
        lanes: &[&mut Lane],
        span: Span<'_>,
        front: MoeFront<'_>,
    ) -> Result<()> {
        let (first, nt) = (span.first, span.nt);
        let MoeFront { experts, routed, wave } = front;
        let distinct = &routed.distinct;
        // every token's sum from zero, its experts added in ascending id
        // (wave by wave where they come in waves: the same bits)
        self.moe.lat_sum.rows_mut(0..nt).fill(0.0);
        let stamp = next_stamp();
        let mut pinned = experts;
        let n = wave.unwrap_or(distinct.len()).max(1);
        for (i, ids) in distinct.chunks(n).enumerate() {
            let experts = match pinned.take() {
                Some(p) => p,
                None => {
                    self.stats.expert_waves += u64::from(i > 0);
                    self.pin_wave(m, l, distinct, &routed.repeats, n, i)?
                }
            };
            let overlapped = self.run_wave(m, w, &experts, &routed, ids, wave.map(|_| ids), stamp, first, nt)?;
            self.settle(experts, overlapped)?;
        }
        self.combine(m, w, first, nt);
        // a replayed routing's lane: the router's guess is not what the
        // trace will choose, so nothing is read ahead for it
        if lanes[owner(span.shape, first + nt - 1)].replay.is_some() {
            return Ok(());
        }
        self.lookahead(m, l, first + nt - 1)
    }

    /// Pin wave `i` of `distinct` in waves of `n` (its repeats among
    /// `repeats` counted as hits) and start the next wave's reads (waves
    /// of all `distinct`: one acquire, as a step that fits the cache).
    pub(super) fn pin_wave<'m>(
        &mut self,
        m: &'m Model,
        l: usize,
        distinct: &[u32],
        repeats: &[u32],
        n: usize,
        i: usize,
    ) -> Result<Pinned<'m, crate::model::Records>> {
        let ids = distinct.chunks(n.max(1)).nth(i).unwrap_or(&[]);
        // one wave of all: every repeat is its own
        let p = match ids.len() == distinct.len() {
            true => m.store.acquire(l as u32, ids, repeats)?,
            false => m.store.acquire(l as u32, ids, &repeats_in(repeats, ids))?,
        };
        let next = next_wave(distinct, n, i);
        if !next.is_empty() {
            self.stats.prefetch_issued += m.store.prefetch(l as u32, next)?;
        }
        Ok(p)
    }

    /// The experts `ids` (ascending where batched or paired) of a step's
    /// `routed` tokens `first..first + nt`, added to their sums — of the
    /// routes in `only` (a wave's experts, ascending; `None`: all); the
    /// paired tables are this layer-step's `stamp`. Returns the I/O wait
    /// other lanes' compute overlapped.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_wave(
        &mut self,
        m: &Model,
        w: &MoeWeights,
        experts: &Pinned<'_, crate::model::Records>,
        routed: &Routed,
        ids: &[u32],
        only: Option<&[u32]>,
        stamp: u64,
        first: usize,
        nt: usize,
    ) -> Result<f64> {
        let routes = &routed.routes;
        let (overlapped, runs) = if routed.batched {
            self.experts_batched(m, w, experts, routes, ids, first, nt)?;
            (0.0, ids.len())
        } else if routed.paired {
            self.experts_paired(m, w, experts, routes, ids, only, stamp, first, nt)?
        } else {
            self.experts_per_token(m, w, experts, routes, only, first, nt)?
        };
        self.stats.expert_runs += runs as u64;
        Ok(overlapped)
    }

    /// Release a wave's pins and count its traffic (less the I/O wait other
    /// lanes' compute `overlapped`).
    pub(super) fn settle(&mut self, experts: Pinned<'_, crate::model::Records>, overlapped: f64) -> Result<()> {
        let traffic = experts.release()?;
        self.stats.experts_hit += traffic.hits;
        self.stats.experts_missed += traffic.misses;
        self.stats.bytes_read += traffic.bytes_read;
        self.stats.io_seconds += traffic.io_seconds - overlapped;
        Ok(())
    }

    /// Every token's top-k (one pass over the router for all; a replayed
    /// trace's experts instead where the lane replays one), each token's in
    /// ascending id: `nt × top_k` (expert, weight) pairs.
    fn route(&mut self, m: &Model, l: usize, w: &MoeWeights, lanes: &[&mut Lane], span: Span<'_>) -> Vec<(usize, f32)> {
        let Span { shape, pos, first, nt } = span;
        let c = m.config();
        let xs = self.chunk_ffn_in.rows(first..first + nt);
        m.pool.matmat(&w.gate.view(), xs, nt, self.moe.router.rows_mut(0..nt));
        let mut routes: Vec<(usize, f32)> = Vec::with_capacity(nt * c.top_k);
        for t in 0..nt {
            let scores = self.moe.router.row(t);
            route(&router_config(c), scores, &w.bias, &mut self.moe.chosen);
            if let Some(tr) = &lanes[owner(shape, first + t)].replay {
                // the trace's experts for this position and MoE layer (wrapping)
                let mi = c.moe_layers().position(|x| x == l).unwrap_or(0);
                let ids: Vec<usize> = tr[pos[first + t] % tr.len()][mi].iter().map(|&e| e as usize).collect();
                waste_moe::route_forced(&router_config(c), scores, &ids, &mut self.moe.chosen);
            }
            let mut order = self.moe.chosen.clone();
            order.sort_by_key(|e| e.0);
            routes.extend(order);
        }
        routes
    }

    /// Each expert of `distinct` (a wave's, or all) once for all the
    /// chunk's tokens routed to it, in ascending id, added to their sums,
    /// so every token's sum still adds its experts in ascending id (the
    /// token-by-token order, bit for bit).
    #[allow(clippy::too_many_arguments)]
    fn experts_batched(
        &mut self,
        m: &Model,
        w: &MoeWeights,
        experts: &Pinned<'_, crate::model::Records>,
        routes: &[(usize, f32)],
        distinct: &[u32],
        first: usize,
        nt: usize,
    ) -> Result<()> {
        let c = m.config();
        let (lat, k) = (c.expert_width(), c.top_k);
        let kernel = m.kernel.as_ref().expect("MoE layer has an expert kernel");
        let scr = self.ex_sc.as_mut().expect("expert scratch");
        let mut users: Vec<(usize, f32)> = Vec::with_capacity(nt);
        for &e in distinct {
            users.clear();
            users.extend(uses_of(routes, k, nt, e).map(|(t, i)| (t, routes[t * k + i].1)));
            for (i, &(t, _)) in users.iter().enumerate() {
                let x = expert_inputs(&self.moe.lat_in, &self.chunk_ffn_in, w, first, t..t + 1);
                scr.batch_in[i * lat..(i + 1) * lat].copy_from_slice(x);
            }
            let (te, io0) = (Instant::now(), experts.traffic().io_seconds);
            let rec = experts.wait(e)?;
            kernel.forward_batch(&m.pool, rec, users.len(), scr);
            let waited = experts.traffic().io_seconds - io0;
            self.stats.expert_seconds += (te.elapsed().as_secs_f64() - waited).max(0.0);
            for (i, &(t, wgt)) in users.iter().enumerate() {
                let sum = self.moe.lat_sum.row_mut(t);
                for (s, &v) in sum.iter_mut().zip(&scr.batch_out[i * lat..(i + 1) * lat]) {
                    *s += v * wgt;
                }
            }
        }
        Ok(())
    }

    /// Every token's tables (unless the shared scratch still holds this
    /// layer-step's, `stamp`), then each expert of `distinct` (a wave's,
    /// or all) once for every two (or four, where the quad kernel pays) of
    /// its tokens, the rest in a smaller job, in ascending id, the jobs
    /// whose records are resident first; then each token's experts of
    /// `only` (of the wave; `None`: all) added to its sum in ascending id,
    /// as token by token, bit for bit. Returns the I/O wait other lanes'
    /// compute overlapped and the expert runs (jobs).
    #[allow(clippy::too_many_arguments)]
    fn experts_paired(
        &mut self,
        m: &Model,
        w: &MoeWeights,
        experts: &Pinned<'_, crate::model::Records>,
        routes: &[(usize, f32)],
        distinct: &[u32],
        only: Option<&[u32]>,
        stamp: u64,
        first: usize,
        nt: usize,
    ) -> Result<(f64, usize)> {
        let k = m.config().top_k;
        let kernel = m.kernel.as_ref().expect("MoE layer has an expert kernel");
        let scr = self.ex_sc.as_mut().expect("expert scratch");
        let xs = expert_inputs(&self.moe.lat_in, &self.chunk_ffn_in, w, first, 0..nt);
        // the model's shared tables and outputs, one step at a time
        let mut shared = m.pair_scratch.lock().unwrap_or_else(|p| p.into_inner());
        let tf = kernel.token_tables_floats();
        let shared = &mut *shared;
        shared.floats.resize(crate::plan::shared_scratch_floats(kernel, k), 0.0);
        let (tables, outs) = shared.floats.split_at_mut(tf);
        // the tables of the tokens these experts serve, unless built for
        // this layer-step already (by an earlier wave)
        if shared.tables_of != stamp {
            shared.tables_of = stamp;
            shared.built.clear();
            shared.built.resize(nt, false);
        }
        // each expert's (token, slot) uses, slot t·k + i for token t's i-th
        // route, the resident experts first
        let (ready, arriving): (Vec<u32>, Vec<u32>) = distinct.iter().partition(|&&e| experts.is_ready(e));
        let uses: Vec<(u32, Vec<(usize, usize)>)> = ready
            .iter()
            .chain(&arriving)
            .map(|&e| (e, uses_of(routes, k, nt, e).map(|(t, i)| (t, t * k + i)).collect()))
            .collect();
        let mut want = vec![false; nt];
        uses.iter().flat_map(|(_, u)| u).for_each(|&(t, _)| want[t] = true);
        let which: Vec<usize> = (0..nt).filter(|&t| want[t] && !shared.built[t]).collect();
        if !which.is_empty() {
            // marked unbuilt until built (a panic inside leaves them so)
            let te = Instant::now();
            kernel.prepare_some_tokens(&m.pool, &w.books, xs, nt, &which, tables);
            self.stats.expert_seconds += te.elapsed().as_secs_f64();
            which.iter().for_each(|&t| shared.built[t] = true);
        }
        // jobs of up to four tokens where the quad kernel pays, else two
        let most = kernel.group_most();
        let jobs = waste_moe::group_jobs(uses.iter().map(|(_, u)| &u[..]), most);
        let fetch = |j: usize| experts.wait(uses[jobs[j].of].0);
        let lanes = waste_moe::lanes_in_use(scr, &m.pool);
        let (te, io0) = (Instant::now(), experts.traffic().io_seconds);
        let lat = m.config().expert_width();
        let outs = &mut outs[..nt * k * lat];
        kernel.forward_groups(&m.pool, &w.books, &jobs, &fetch, tables, scr, outs)?;
        let (spent, waited) = (te.elapsed().as_secs_f64(), experts.traffic().io_seconds - io0);
        let io_wall = (waited / lanes as f64).min(spent);
        self.stats.expert_seconds += spent - io_wall;
        for t in 0..nt {
            let sum = self.moe.lat_sum.row_mut(t);
            for (i, &(e, wgt)) in routes[t * k..(t + 1) * k].iter().enumerate() {
                if !in_wave(only, e) {
                    continue;
                }
                for (s, &v) in sum.iter_mut().zip(&outs[(t * k + i) * lat..(t * k + i + 1) * lat]) {
                    *s += v * wgt;
                }
            }
        }
        Ok((waited - io_wall, jobs.len()))
    }

    /// Token by token: its tables, then its experts of `only` (a wave's;
    /// `None`: all; the resident ones first, the others as their reads
    /// arrive, one lane each), added to its sum in ascending id. Returns
    /// the I/O wait that other lanes' compute overlapped (not wall time)
    /// and the expert runs.
    #[allow(clippy::too_many_arguments)]
    fn experts_per_token(
        &mut self,
        m: &Model,
        w: &MoeWeights,
        experts: &Pinned<'_, crate::model::Records>,
        routes: &[(usize, f32)],
        only: Option<&[u32]>,
        first: usize,
        nt: usize,
    ) -> Result<(f64, usize)> {
        let c = m.config();
        let k = c.top_k;
        let kernel = m.kernel.as_ref().expect("MoE layer has an expert kernel");
        let scr = self.ex_sc.as_mut().expect("expert scratch");
        let kernel_lanes = waste_moe::lanes_in_use(scr, &m.pool);
        let (mut overlapped, mut runs) = (0.0, 0);
        for t in 0..nt {
            let mine = &routes[t * k..(t + 1) * k];
            let (mut order, arriving): (Vec<usize>, Vec<usize>) =
                (0..k).filter(|&i| in_wave(only, mine[i].0)).partition(|&i| experts.is_ready(mine[i].0 as u32));
            if order.is_empty() && arriving.is_empty() {
                continue;
            }
            order.extend(arriving);
            runs += order.len();
            let x = expert_inputs(&self.moe.lat_in, &self.chunk_ffn_in, w, first, t..t + 1);
            let te = Instant::now();
            kernel.prepare(&m.pool, &w.books, x, scr);
            self.stats.expert_seconds += te.elapsed().as_secs_f64();
            let fetch = |j: usize| experts.wait(mine[order[j]].0 as u32);
            let (te, io0) = (Instant::now(), experts.traffic().io_seconds);
            kernel.forward_fetched(&m.pool, &w.books, &order, &fetch, x, scr, self.moe.eouts.rows_mut(0..k))?;
            // waits overlap other lanes' compute: count their lane average as I/O wait
            let (spent, waited) = (te.elapsed().as_secs_f64(), experts.traffic().io_seconds - io0);
            let io_wall = (waited / kernel_lanes as f64).min(spent);
            overlapped += waited - io_wall;
            self.stats.expert_seconds += spent - io_wall;
            let sum = self.moe.lat_sum.row_mut(t);
            for (i, &(e, wgt)) in mine.iter().enumerate() {
                if !in_wave(only, e) {
                    continue;
                }
                for (s, &v) in sum.iter_mut().zip(self.moe.eouts.row(i)) {
                    *s += v * wgt;
                }
            }
        }
        Ok((overlapped, runs))
    }

    /// Back to the hidden width (one pass over the latent up-projection),
    /// plus the shared experts, into `chunk_ffn_out`.
    pub(super) fn combine(&mut self, m: &Model, w: &MoeWeights, first: usize, nt: usize) {
        let c = m.config();
        let (lat, xs) = (c.expert_width(), first..first + nt);
        match &w.latent {
            Some(lt) => {
                if let Some(n) = &lt.norm {
                    for sum in self.moe.lat_sum.rows_mut(0..nt).chunks_exact_mut(lat) {
                        rmsnorm_inplace(sum, n, c.rms_eps);
                    }
                }
                m.pool.matmat(&lt.up.view(), self.moe.lat_sum.rows(0..nt), nt, self.chunk_ffn_out.rows_mut(xs.clone()));
            }
            None => self.chunk_ffn_out.rows_mut(xs.clone()).copy_from_slice(self.moe.lat_sum.rows(0..nt)),
        }
        if w.shared.is_some() {
            add(self.chunk_ffn_out.rows_mut(xs), self.moe.chunk_shared.rows(0..nt));
        }
    }

    /// The shared experts of chunk tokens `first..first + nt` into
    /// `moe.chunk_shared` ([`Work::combine`] adds them to the routed sum).
    fn shared_experts(&mut self, m: &Model, w: &MoeWeights, first: usize, nt: usize) {
        if let Some(sh) = &w.shared {
            let out = self.moe.chunk_shared.rows_mut(0..nt);
            let xs = self.chunk_ffn_in.rows(first..first + nt);
            sh.forward_chunk(&m.pool, m.config().activation, xs, nt, &mut self.ffn_tmp, out);
        }
    }

    /// Router lookahead from chunk row `t`: prefetch the next MoE layer's
    /// likely experts ([`Model::lookahead`] of them), its router on the next
    /// layer's FFN input as far as it is known — this layer's output (the
    /// hidden state plus this FFN's, `chunk_ffn_out` before the residual is
    /// added) under the next layer's FFN norm, lacking only the next
    /// attention's share. On the 48B shape at 6 GB this guessed 97 % of
    /// its reads right against 85–87 % from this layer's FFN input (docs/lab
    /// entry 80). K3's attention residuals mix block sums into that input:
    /// there the guess takes this layer's FFN input.
    fn lookahead(&mut self, m: &Model, l: usize, t: usize) -> Result<()> {
        let c = m.config();
        if m.lookahead == 0 {
            return Ok(());
        }
        // a streamed next layer is not in memory yet: no lookahead into it
        let Some(nl) = m.layers.get(l + 1).and_then(Option::as_ref) else { return Ok(()) };
        let Ffn::Moe(next) = &nl.ffn else { return Ok(()) };
        let xn: &[f32] = if c.attn_res_block.is_none() {
            let (h, o) = (self.chunk_hidden.row(t), self.chunk_ffn_out.row(t));
            for ((x, &a), &b) in self.token_in.iter_mut().zip(h).zip(o) {
                *x = a + b;
            }
            rmsnorm_inplace(&mut self.token_in, &nl.post_norm, c.rms_eps);
            &self.token_in
        } else {
            self.chunk_ffn_in.row(t)
        };
        let scores = self.moe.router.row_mut(0);
        m.pool.matvec(&next.gate.view(), xn, scores);
        let mut guess = Vec::with_capacity(c.top_k);
        route(&router_config(c), scores, &next.bias, &mut guess);
        let want: Vec<u32> = guess.iter().take(m.lookahead).map(|&(e, _)| e as u32).collect();
        self.stats.prefetch_issued += m.store.prefetch((l + 1) as u32, &want)?;
        Ok(())
    }
}

/// The wave after wave `i` of `distinct` in waves of `n` (empty after the
/// last): read ahead while wave `i` computes.
fn next_wave(distinct: &[u32], n: usize, i: usize) -> &[u32] {
    distinct.chunks(n.max(1)).nth(i + 1).unwrap_or(&[])
}

/// Whether expert `e` runs in the wave `only` (its experts in ascending
/// id; `None`: every expert of the step).
fn in_wave(only: Option<&[u32]>, e: usize) -> bool {
    only.is_none_or(|ids| ids.binary_search(&(e as u32)).is_ok())
}

/// Expert `e`'s uses among a chunk's routes (`nt` tokens of `k` each, a
/// token's experts distinct): `(token, index of the route in the token's)`,
/// in token order.
fn uses_of(routes: &[(usize, f32)], k: usize, nt: usize, e: u32) -> impl Iterator<Item = (usize, usize)> + '_ {
    (0..nt).filter_map(move |t| routes[t * k..(t + 1) * k].iter().position(|r| r.0 == e as usize).map(|i| (t, i)))
}

/// The experts' inputs of chunk tokens `ts` (token-major): the latent
/// down-projection's output where the layer has one, else the FFN inputs
/// (chunk rows from `first`).
fn expert_inputs<'a>(
    lat_in: &'a Rows,
    ffn_in: &'a Rows,
    w: &MoeWeights,
    first: usize,
    ts: std::ops::Range<usize>,
) -> &'a [f32] {
    match &w.latent {
        Some(_) => lat_in.rows(ts),
        None => ffn_in.rows(first + ts.start..first + ts.end),
    }
}

/// Each distinct expert of `routes` once, in consumption order (ascending
/// id when `sorted`), and the later uses as repeats: what the store pins.
fn union_of(routes: &[(usize, f32)], sorted: bool) -> (Vec<u32>, Vec<u32>) {
    let mut distinct: Vec<u32> = Vec::with_capacity(routes.len());
    let mut repeats: Vec<u32> = Vec::new();
    for &(e, _) in routes {
        if distinct.contains(&(e as u32)) {
            repeats.push(e as u32);
        } else {
            distinct.push(e as u32);
        }
    }
    if sorted {
        distinct.sort_unstable();
    }
    (distinct, repeats)
}
