//! `Session`: one sequence's state and the forward pass.

use crate::model::Model;
use crate::plan::CHUNK;
use crate::weights::{kda_config, mla_config, router_config, Attn, Ffn, MoeWeights};
use crate::{Error, NonFiniteAt, Result};
use std::time::Instant;
use waste_attn::{attn_res, kda, mla, KdaScratch, KdaState, MlaScratch, MlaState};
use waste_moe::{route, ExpertScratch};
use waste_quant::ops::{first_non_finite, rmsnorm, rmsnorm_inplace};

/// Counters of expert traffic and time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stats {
    /// Tokens evaluated.
    pub tokens: u64,
    /// Expert uses served from the cache (resident, or already in flight from a prefetch).
    pub experts_hit: u64,
    /// Expert uses that needed a demand read.
    pub experts_missed: u64,
    /// Bytes of demand reads.
    pub bytes_read: u64,
    /// Speculative (lookahead) reads issued.
    pub prefetch_issued: u64,
    /// Seconds waiting for expert reads (while the expert lanes wait for
    /// records in parallel, their average: the share of the wall time the
    /// waits cost).
    pub io_seconds: f64,
    /// Seconds in the trunk outside attention (norms, dense FFN, router, shared experts, head).
    pub trunk_seconds: f64,
    /// Seconds in attention (KDA and MLA).
    pub attn_seconds: f64,
    /// Seconds computing routed experts.
    pub expert_seconds: f64,
    /// Runs of the expert kernel: one per token and expert when tokens run
    /// one by one, one per distinct expert of a prefill chunk when the
    /// kernel batches the chunk's tokens (so uses / runs is the tokens an
    /// expert's weights served at a time).
    pub expert_runs: u64,
}

/// What happened between two readings of the counters: `after - before`.
impl std::ops::Sub for Stats {
    type Output = Stats;
    fn sub(self, b: Stats) -> Stats {
        Stats {
            tokens: self.tokens - b.tokens,
            experts_hit: self.experts_hit - b.experts_hit,
            experts_missed: self.experts_missed - b.experts_missed,
            bytes_read: self.bytes_read - b.bytes_read,
            prefetch_issued: self.prefetch_issued - b.prefetch_issued,
            io_seconds: self.io_seconds - b.io_seconds,
            trunk_seconds: self.trunk_seconds - b.trunk_seconds,
            attn_seconds: self.attn_seconds - b.attn_seconds,
            expert_seconds: self.expert_seconds - b.expert_seconds,
            expert_runs: self.expert_runs - b.expert_runs,
        }
    }
}

enum LayerState {
    Kda(KdaState),
    Mla(MlaState),
}

/// A borrowed view of one layer's state (for state files).
pub(crate) enum LayerStateRef<'a> {
    Kda { conv: &'a [f32], s: &'a [f32] },
    Mla { cache: &'a [f32], len: usize, width: usize },
}

/// One sequence being evaluated.
pub struct Session<'m> {
    m: &'m Model,
    pos: usize,
    states: Vec<LayerState>,
    kda_sc: Option<KdaScratch>,
    mla_sc: Option<MlaScratch>,
    ex_sc: Option<ExpertScratch>,
    /// Per chunk token: hidden state, AttnRes prefix, FFN input, FFN output (`CHUNK × hidden` each).
    chunk_hidden: Vec<f32>,
    chunk_prefix: Vec<f32>,
    chunk_ffn_in: Vec<f32>,
    chunk_ffn_out: Vec<f32>,
    /// One token's layer input (the AttnRes mix, or the shared expert's output).
    token_in: Vec<f32>,
    /// The final-normed hidden state the LM head reads.
    head_in: Vec<f32>,
    /// AttnRes blocks, `CHUNK × res_blocks × hidden`.
    blocks: Vec<f32>,
    /// Blocks finished so far in this token's pass.
    nblocks: usize,
    /// AttnRes blocks per token (layers / block size; 0 without AttnRes).
    res_blocks: usize,
    /// The last token's hidden state, kept for the output aggregation.
    out_copy: Vec<f32>,
    router: Vec<f32>,
    chosen: Vec<(usize, f32)>,
    lat_in: Vec<f32>,
    lat_sum: Vec<f32>,
    eouts: Vec<f32>,
    ffn_tmp: Vec<f32>,
    /// The shared experts' output per chunk token.
    chunk_shared: Vec<f32>,
    logits: Vec<f32>,
    stats: Stats,
    /// A recorded routing to replay instead of the router's choice (benchmarks).
    replay: Option<std::sync::Arc<Vec<Vec<Vec<u32>>>>>,
    /// Images waiting for their `<|media_pad|>` placeholders, in order.
    images: std::collections::VecDeque<crate::Image>,
    /// The message of a step that failed part-way: the state is a mix of
    /// before and after that step, so evaluating or saving is refused
    /// ([`Error::Incomplete`]) until a reset or a restore replaces it all.
    pub(crate) incomplete: Option<std::borrow::Cow<'static, str>>,
    /// Unit tests: panic inside the step at this layer (an engine bug's stand-in).
    #[cfg(test)]
    panic_at_layer: Option<usize>,
}

/// The lengths (f32s) of a session's own buffers for a config: what
/// `Session::new` allocates and what the memory plan counts — one formula
/// for both ([`scratch_bytes`]).
pub(crate) struct BufferLens {
    chunk_hidden: usize,
    chunk_prefix: usize,
    chunk_ffn_in: usize,
    chunk_ffn_out: usize,
    token_in: usize,
    head_in: usize,
    blocks: usize,
    res_blocks: usize,
    out_copy: usize,
    router: usize,
    lat_in: usize,
    lat_sum: usize,
    eouts: usize,
    ffn_tmp: usize,
    chunk_shared: usize,
    logits: usize,
}

impl BufferLens {
    pub(crate) fn new(c: &waste_format::ModelConfig) -> BufferLens {
        let (h, lat) = (c.hidden, c.expert_width());
        let ffn_w = c.intermediate.max(c.moe_intermediate * c.shared_experts);
        let nb = c.attn_res_block.map_or(0, |b| c.layers.div_ceil(b));
        let moe = c.n_moe_layers() > 0;
        BufferLens {
            chunk_hidden: CHUNK * h,
            chunk_prefix: if nb > 0 { CHUNK * h } else { 0 },
            chunk_ffn_in: CHUNK * h,
            chunk_ffn_out: CHUNK * h,
            token_in: h,
            head_in: h,
            blocks: CHUNK * nb * h,
            res_blocks: nb,
            out_copy: if nb > 0 { h } else { 0 },
            router: CHUNK * c.experts,
            lat_in: CHUNK * lat,
            lat_sum: CHUNK * lat,
            eouts: if moe { c.top_k * lat } else { 0 },
            ffn_tmp: 2 * ffn_w * CHUNK,
            chunk_shared: if moe && c.shared_experts > 0 { CHUNK * h } else { 0 },
            logits: c.vocab,
        }
    }

    /// All the buffers' f32s.
    fn total(&self) -> usize {
        [
            self.chunk_hidden,
            self.chunk_prefix,
            self.chunk_ffn_in,
            self.chunk_ffn_out,
            self.token_in,
            self.head_in,
            self.blocks,
            self.out_copy,
            self.router,
            self.lat_in,
            self.lat_sum,
            self.eouts,
            self.ffn_tmp,
            self.chunk_shared,
            self.logits,
        ]
        .iter()
        .sum()
    }
}

/// Bytes of one session's scratch but the experts' (their VQ tables are the
/// kernel's): its buffers ([`BufferLens`]) and the attention scratch, as
/// `Session::new` allocates them for a context of `ctx`.
pub(crate) fn scratch_bytes(c: &waste_format::ModelConfig, ctx: usize) -> u64 {
    let mut b = 4 * BufferLens::new(c).total() as u64;
    if c.attn_kinds.contains(&waste_format::AttnKind::Kda) {
        b += KdaScratch::bytes(&kda_config(c), CHUNK) as u64;
    }
    if c.n_mla_layers() > 0 {
        b += MlaScratch::bytes(&mla_config(c, ctx), c.q_lora.unwrap_or(0), CHUNK) as u64;
    }
    b
}

/// One sequence position's input: a token's embedding row or an image's row.
#[derive(Clone, Copy)]
enum Input<'a> {
    Token(u32),
    Row(&'a [f32]),
}

impl<'m> Session<'m> {
    pub(crate) fn new(m: &'m Model) -> Session<'m> {
        m.store.enter();
        let c = m.config();
        let kc = kda_config(c);
        let mc = mla_config(c, m.opts.ctx);
        let states = c
            .attn_kinds
            .iter()
            .map(|k| match k {
                waste_format::AttnKind::Kda => LayerState::Kda(KdaState::new(&kc)),
                waste_format::AttnKind::Mla => LayerState::Mla(MlaState::new(&mc)),
            })
            .collect();
        let has_kda = c.attn_kinds.contains(&waste_format::AttnKind::Kda);
        let has_mla = c.n_mla_layers() > 0;
        let n = BufferLens::new(c);
        let buf = |len: usize| vec![0f32; len];
        Session {
            m,
            pos: 0,
            states,
            kda_sc: has_kda.then(|| KdaScratch::new(&kc, CHUNK)),
            mla_sc: has_mla.then(|| MlaScratch::new(&mc, c.q_lora.unwrap_or(0), CHUNK)),
            ex_sc: m.kernel.as_ref().map(|k| k.scratch(waste_moe::lanes_for(m.pool.threads(), c.top_k))),
            chunk_hidden: buf(n.chunk_hidden),
            chunk_prefix: buf(n.chunk_prefix),
            chunk_ffn_in: buf(n.chunk_ffn_in),
            chunk_ffn_out: buf(n.chunk_ffn_out),
            token_in: buf(n.token_in),
            head_in: buf(n.head_in),
            blocks: buf(n.blocks),
            nblocks: 0,
            res_blocks: n.res_blocks,
            out_copy: buf(n.out_copy),
            router: buf(n.router),
            chosen: Vec::with_capacity(c.top_k),
            lat_in: buf(n.lat_in),
            lat_sum: buf(n.lat_sum),
            eouts: buf(n.eouts),
            ffn_tmp: buf(n.ffn_tmp),
            chunk_shared: buf(n.chunk_shared),
            logits: buf(n.logits),
            stats: Stats::default(),
            replay: None,
            images: Default::default(),
            incomplete: None,
            #[cfg(test)]
            panic_at_layer: None,
        }
    }

    /// Tokens evaluated so far (the next position).
    pub fn position(&self) -> usize {
        self.pos
    }
    /// Counters since the session started (or was reset).
    pub fn stats(&self) -> Stats {
        self.stats
    }
    /// The model.
    pub fn model(&self) -> &'m Model {
        self.m
    }
    /// Forget everything: position 0, zero states, zero counters, no queued images.
    pub fn reset(&mut self) {
        self.pos = 0;
        self.incomplete = None;
        self.images.clear();
        for s in &mut self.states {
            match s {
                LayerState::Kda(k) => k.reset(),
                LayerState::Mla(m) => m.reset(),
            }
        }
        self.stats = Stats::default();
    }

    pub(crate) fn layer_states(&self) -> Vec<LayerStateRef<'_>> {
        let c = self.m.config();
        let width = c.kv_lora + c.qk_rope;
        self.states
            .iter()
            .map(|s| match s {
                LayerState::Kda(k) => LayerStateRef::Kda { conv: &k.conv, s: &k.s },
                LayerState::Mla(m) => LayerStateRef::Mla { cache: &m.cache, len: m.len, width },
            })
            .collect()
    }

    /// Overwrite the state from validated values (in save order).
    pub(crate) fn restore(&mut self, pos: usize, mla_lens: &[usize], vals: &mut dyn Iterator<Item = f32>) {
        let width = self.m.config().kv_lora + self.m.config().qk_rope;
        for (i, s) in self.states.iter_mut().enumerate() {
            match s {
                LayerState::Kda(k) => {
                    k.conv.iter_mut().chain(k.s.iter_mut()).for_each(|v| *v = vals.next().unwrap_or(0.0));
                }
                LayerState::Mla(m) => {
                    m.len = mla_lens[i];
                    m.cache[..m.len * width].iter_mut().for_each(|v| *v = vals.next().unwrap_or(0.0));
                }
            }
        }
        self.logits.iter_mut().for_each(|v| *v = vals.next().unwrap_or(0.0));
        self.pos = pos;
        self.incomplete = None;
    }

    /// Bytes this session holds: (state, scratch), counted from its buffers.
    pub fn allocated_bytes(&self) -> (u64, u64) {
        let mut state = 0u64;
        for s in &self.states {
            state += 4 * match s {
                LayerState::Kda(k) => k.conv.capacity() + k.s.capacity(),
                LayerState::Mla(m) => m.cache.capacity(),
            } as u64;
        }
        let v = |x: &Vec<f32>| 4 * x.capacity() as u64;
        let mut sc = [
            &self.chunk_hidden,
            &self.chunk_prefix,
            &self.chunk_ffn_in,
            &self.chunk_ffn_out,
            &self.token_in,
            &self.head_in,
            &self.blocks,
            &self.out_copy,
            &self.router,
            &self.lat_in,
            &self.lat_sum,
            &self.eouts,
            &self.ffn_tmp,
            &self.chunk_shared,
            &self.logits,
        ]
        .iter()
        .map(|b| v(b))
        .sum::<u64>();
        sc += self.kda_sc.as_ref().map_or(0, |k| k.allocated_bytes() as u64);
        sc += self.mla_sc.as_ref().map_or(0, |k| k.allocated_bytes() as u64);
        sc += self.ex_sc.as_ref().map_or(0, |e| e.allocated_bytes());
        (state, sc)
    }

    /// Evaluate `tokens` (prefill or a single step) and return the logits of
    /// the last one. The context bound is checked before any state changes.
    ///
    /// With images enabled, each `<|media_pad|>` placeholder takes the next
    /// queued image ([`Session::add_image`]) and stands for its
    /// [`crate::Image::positions`] positions; the positions evaluated are
    /// the tokens minus the placeholders plus the images' positions.
    ///
    /// # Errors
    /// [`Error::Arg`] for no tokens, an id outside the vocabulary, or more
    /// placeholders than queued images; [`Error::ContextFull`] when the
    /// positions do not fit (checked before any state changes); the engine's
    /// I/O, record and cache errors; [`Error::NonFinite`] when the logits
    /// are not all finite (damaged or overflowing weights). After an error
    /// from the computation itself (not the argument checks above) the
    /// session's state may be partly updated, and every later call returns
    /// [`Error::Incomplete`] until [`Session::reset`], a state load or a
    /// snapshot restore.
    pub fn eval(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        self.eval_inner(tokens, true)
    }

    /// [`Session::eval`]; placeholders are expanded only when `images` (a
    /// placeholder the model *generates* is an ordinary token).
    pub(crate) fn eval_inner(&mut self, tokens: &[u32], images: bool) -> Result<&[f32]> {
        self.check_complete()?;
        if tokens.is_empty() {
            return Err(Error::Arg("eval needs at least one token".into()));
        }
        let vocab = self.m.embed.rows();
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Arg(format!("token id {t} is outside the vocabulary (0..{vocab})")));
        }
        let pad = self.m.vision().filter(|_| images).map(|v| v.placeholder);
        let npad = pad.map_or(0, |p| tokens.iter().filter(|&&t| t == p).count());
        if npad > self.images.len() {
            return Err(Error::Arg(format!(
                "the tokens hold {npad} image placeholder(s) (<|media_pad|>) but {} image(s) are queued",
                self.images.len()
            )));
        }
        let n = tokens.len() - npad + self.images.iter().take(npad).map(|i| i.positions()).sum::<usize>();
        let ctx = self.m.opts.ctx;
        if self.pos + n > ctx {
            return Err(Error::ContextFull { pos: self.pos, n, ctx });
        }
        let imgs: Vec<crate::Image> = self.images.drain(..npad).collect();
        let h = self.m.config().hidden;
        let mut inputs = Vec::with_capacity(n);
        let mut next = imgs.iter();
        for &t in tokens {
            if Some(t) == pad {
                if let Some(img) = next.next() {
                    inputs.extend(img.rows.chunks_exact(h).map(Input::Row));
                    continue;
                }
            }
            inputs.push(Input::Token(t));
        }
        let chunk = self.chunk_len();
        // a failure inside a step may leave some layers past it and the rest
        // before it: no later call may build on that. Marked before the
        // first step and cleared after the last, so a step that never
        // returns (a panic caught by the caller, as the C ABI does) leaves
        // the mark too.
        self.incomplete = Some(std::borrow::Cow::Borrowed("a step was interrupted before it finished"));
        let mut i = 0;
        while i < n {
            let t = chunk.min(n - i);
            if let Err(e) = self.forward(&inputs[i..i + t], i + t == n) {
                self.incomplete = Some(e.to_string().into());
                return Err(e);
            }
            i += t;
        }
        self.incomplete = None;
        Ok(&self.logits)
    }

    /// Queue an encoded image for the next `<|media_pad|>` placeholder
    /// [`Session::eval`] meets.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when images are not enabled; [`Error::Arg`] for
    /// an image encoded by a model of another width.
    pub fn add_image(&mut self, img: crate::Image) -> Result<()> {
        let v =
            self.m.vision().ok_or_else(|| Error::Unsupported("images: open the model with images enabled".into()))?;
        if img.rows.len() != img.positions() * v.text_hidden {
            return Err(Error::Arg(format!(
                "the image has {} values, not {} positions of width {}",
                img.rows.len(),
                img.positions(),
                v.text_hidden
            )));
        }
        self.images.push_back(img);
        Ok(())
    }

    /// Images queued and not yet placed.
    pub fn queued_images(&self) -> usize {
        self.images.len()
    }

    /// Drop the queued images.
    pub fn clear_images(&mut self) {
        self.images.clear();
    }

    /// Replay a recorded routing (the `cachesim` trace format: per token, per
    /// MoE layer, the chosen expert ids) instead of the router's choice, from
    /// this session's next token on; position `p` takes the trace's token
    /// `p mod len`. The gates are still the router's weights for those
    /// experts, so compute is unchanged — the point is to reproduce a real
    /// model's expert traffic on a synthetic container (`waste bench
    /// --routing`). Logits are then not the model's.
    ///
    /// # Errors
    /// [`Error::Arg`] naming the token and layer when the trace is empty, has
    /// fewer MoE layers than the model, or a layer's choice is not `top_k`
    /// distinct ids below the expert count.
    pub fn replay_routing(&mut self, trace: std::sync::Arc<Vec<Vec<Vec<u32>>>>) -> Result<()> {
        let c = self.m.config();
        if trace.is_empty() {
            return Err(Error::Arg("the routing trace has no tokens".into()));
        }
        let moe = c.n_moe_layers();
        for (t, tok) in trace.iter().enumerate() {
            if tok.len() < moe {
                return Err(Error::Arg(format!(
                    "routing trace token {t}: {} MoE layers, the model has {moe}",
                    tok.len()
                )));
            }
            for (l, ids) in tok.iter().take(moe).enumerate() {
                let mut seen = ids.clone();
                seen.sort_unstable();
                seen.dedup();
                if ids.len() != c.top_k || seen.len() != ids.len() || ids.iter().any(|&e| e as usize >= c.experts) {
                    return Err(Error::Arg(format!(
                        "routing trace token {t}, MoE layer {l}: {ids:?} is not {} distinct experts below {}",
                        c.top_k, c.experts
                    )));
                }
            }
        }
        self.replay = Some(trace);
        Ok(())
    }

    /// Tokens evaluated together in a prefill chunk: as many as the cache can
    /// hold every distinct expert of (each read once per chunk), at most [`CHUNK`].
    pub fn chunk_len(&self) -> usize {
        let c = self.m.config();
        if c.n_moe_layers() == 0 {
            return CHUNK;
        }
        let slots = self.m.cache_slots();
        ((slots.saturating_sub(self.m.opts.lookahead)) / c.top_k).clamp(1, self.m.opts.max_chunk.clamp(1, CHUNK))
    }

    /// [`Error::Incomplete`] when a step failed part-way since the last
    /// reset or restore.
    pub(crate) fn check_complete(&self) -> Result<()> {
        self.incomplete.as_ref().map_or(Ok(()), |c| Err(Error::Incomplete(c.to_string())))
    }

    /// Logits of the last evaluated token.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    fn forward(&mut self, toks: &[Input<'_>], want_logits: bool) -> Result<()> {
        let m = self.m;
        let c = m.config();
        let pool = &m.pool;
        let h = c.hidden;
        let nt = toks.len();
        let nb = self.res_blocks;
        let t0 = Instant::now();
        let (io0, ex0, at0) = (self.stats.io_seconds, self.stats.expert_seconds, self.stats.attn_seconds);
        for (t, inp) in toks.iter().enumerate() {
            let dst = &mut self.chunk_hidden[t * h..(t + 1) * h];
            match *inp {
                Input::Token(tok) => m.embed.row(tok, dst)?,
                Input::Row(r) => dst.copy_from_slice(r),
            }
        }
        let ar = c.attn_res_block;
        self.nblocks = 0;
        for (l, layer) in m.layers.iter().enumerate() {
            #[cfg(test)]
            assert!(self.panic_at_layer != Some(l), "injected panic at layer {l}");
            let restarted = ar.is_some_and(|b| l % b == 0);
            // --- attention inputs of every token (they depend on earlier layers only)
            for t in 0..nt {
                let hh = &mut self.chunk_hidden[t * h..(t + 1) * h];
                let xa = &mut self.chunk_ffn_in[t * h..(t + 1) * h];
                if ar.is_some() {
                    let p = &mut self.chunk_prefix[t * h..(t + 1) * h];
                    let blocks = &mut self.blocks[t * nb * h..(t + 1) * nb * h];
                    p.copy_from_slice(hh);
                    let w = &layer.res.as_ref().expect("attn res weights").attn;
                    if self.nblocks > 0 {
                        attn_res(&blocks[..self.nblocks * h], h, p, w, c.rms_eps, &mut self.token_in);
                    } else {
                        self.token_in.copy_from_slice(p);
                    }
                    if restarted {
                        blocks[self.nblocks * h..(self.nblocks + 1) * h].copy_from_slice(p);
                    }
                    rmsnorm(&self.token_in, &layer.in_norm, c.rms_eps, xa);
                } else {
                    rmsnorm(hh, &layer.in_norm, c.rms_eps, xa);
                }
            }
            // the last layer's outputs feed only the head: its attention
            // outputs and FFN run for the token whose logits are wanted (the
            // chunk's last) or for none (llama.cpp's `inp_out_ids`); its
            // state still takes every token
            let first = if l + 1 < m.layers.len() {
                0
            } else if want_logits {
                nt - 1
            } else {
                nt
            };
            // --- attention for the chunk: projections batched, the recurrence token after token
            let ta = Instant::now();
            let (xs, outs) = (&self.chunk_ffn_in[..nt * h], &mut self.chunk_ffn_out[..nt * h]);
            match (&layer.attn, &mut self.states[l]) {
                (Attn::Kda(w), LayerState::Kda(st)) => {
                    let sc = self.kda_sc.as_mut().expect("kda scratch");
                    let kc = kda::KdaConfig { chunked: m.opts.kda_chunked, ..kda_config(c) };
                    kda::chunk(pool, &kc, w, st, sc, xs, nt, first, outs);
                }
                (Attn::Mla(w), LayerState::Mla(st)) => {
                    let sc = self.mla_sc.as_mut().expect("mla scratch");
                    mla::chunk(pool, &mla_config(c, m.opts.ctx), w, st, sc, xs, nt, first, outs)
                        .map_err(|e| Error::ContextFull { pos: e.0, n: nt, ctx: m.opts.ctx })?;
                }
                _ => unreachable!("layer state matches its kind"),
            }
            self.stats.attn_seconds += ta.elapsed().as_secs_f64();
            let x0 = first * h;
            self.check_finite(&self.chunk_ffn_out[x0..nt * h], h, first, NonFiniteAt::Attention { layer: l })?;
            // --- residuals and FFN inputs
            for t in first..nt {
                let r = &self.chunk_ffn_out[t * h..(t + 1) * h];
                let xn_t = &mut self.chunk_ffn_in[t * h..(t + 1) * h];
                if ar.is_some() {
                    let p = &mut self.chunk_prefix[t * h..(t + 1) * h];
                    if restarted {
                        p.copy_from_slice(r);
                    } else {
                        add(p, r);
                    }
                    let w = &layer.res.as_ref().expect("attn res weights").mlp;
                    let nbk = self.nblocks + restarted as usize;
                    attn_res(&self.blocks[t * nb * h..t * nb * h + nbk * h], h, p, w, c.rms_eps, &mut self.token_in);
                    rmsnorm(&self.token_in, &layer.post_norm, c.rms_eps, xn_t);
                } else {
                    let hh = &mut self.chunk_hidden[t * h..(t + 1) * h];
                    add(hh, r);
                    rmsnorm(hh, &layer.post_norm, c.rms_eps, xn_t);
                }
            }
            if restarted {
                self.nblocks += 1;
            }
            // --- FFN for the chunk's tokens from `first`
            let n = nt - first;
            match &layer.ffn {
                _ if n == 0 => {}
                Ffn::Dense(d) => d.forward_chunk(
                    pool,
                    c.activation,
                    &self.chunk_ffn_in[x0..x0 + n * h],
                    n,
                    &mut self.ffn_tmp,
                    &mut self.chunk_ffn_out[x0..x0 + n * h],
                ),
                Ffn::Moe(w) => self.moe(l, w, first, n)?,
            }
            self.check_finite(&self.chunk_ffn_out[x0..x0 + n * h], h, first, NonFiniteAt::Ffn { layer: l })?;
            for t in first..nt {
                let r = &self.chunk_ffn_out[t * h..(t + 1) * h];
                if ar.is_some() {
                    let p = &mut self.chunk_prefix[t * h..(t + 1) * h];
                    add(p, r);
                    self.chunk_hidden[t * h..(t + 1) * h].copy_from_slice(p);
                } else {
                    add(&mut self.chunk_hidden[t * h..(t + 1) * h], r);
                }
            }
        }
        let last = (nt - 1) * h;
        if let Some(w) = &m.out_res {
            // alias-safe: the live candidate is a copy, the output the state itself
            if want_logits {
                self.out_copy.copy_from_slice(&self.chunk_hidden[last..last + h]);
                attn_res(
                    &self.blocks[(nt - 1) * nb * h..(nt - 1) * nb * h + self.nblocks * h],
                    h,
                    &self.out_copy,
                    w,
                    c.rms_eps,
                    &mut self.chunk_hidden[last..last + h],
                );
            }
        }
        if want_logits {
            rmsnorm(&self.chunk_hidden[last..last + h], &m.final_norm, c.rms_eps, &mut self.head_in);
            pool.matvec(&m.lm_head.view(), &self.head_in, &mut self.logits);
        }
        self.pos += nt;
        self.stats.tokens += nt as u64;
        let spent = t0.elapsed().as_secs_f64()
            - (self.stats.io_seconds - io0)
            - (self.stats.expert_seconds - ex0)
            - (self.stats.attn_seconds - at0);
        self.stats.trunk_seconds += spent;
        // garbage in the weights ends here as an error, not as sampled text
        if let Some(token) = want_logits.then(|| first_non_finite(&self.logits)).flatten() {
            let at = NonFiniteAt::Logit { token };
            return Err(Error::NonFinite { pos: self.pos - 1, at, value: self.logits[token] });
        }
        Ok(())
    }

    /// [`Error::NonFinite`] at `at` for the first non-finite value of a
    /// chunk's outputs (`width` per token, from the chunk's token `first`):
    /// where overflowing or damaged weights first show, named while the
    /// step runs.
    fn check_finite(&self, outs: &[f32], width: usize, first: usize, at: NonFiniteAt) -> Result<()> {
        let Some(i) = first_non_finite(outs) else { return Ok(()) };
        Err(Error::NonFinite { pos: self.pos + first + i / width, at, value: outs[i] })
    }

    fn moe(&mut self, l: usize, w: &MoeWeights, first: usize, nt: usize) -> Result<()> {
        let m = self.m;
        let c = m.config();
        let pool = &m.pool;
        let (h, lat, k) = (c.hidden, c.expert_width(), c.top_k);
        let kernel = m.kernel.as_ref().expect("MoE layer has an expert kernel");
        // the chunk's tokens first..first + nt: their rows of the FFN input and output
        let x0 = first * h;
        // 1. route every token of the chunk (one pass over the router for all);
        // each token's experts in ascending id
        let ne = c.experts;
        pool.matmat(&w.gate.view(), &self.chunk_ffn_in[x0..x0 + nt * h], nt, &mut self.router[..nt * ne]);
        let mut routes: Vec<(usize, f32)> = Vec::with_capacity(nt * k);
        for t in 0..nt {
            let scores = &self.router[t * ne..(t + 1) * ne];
            route(&router_config(c), scores, &w.bias, &mut self.chosen);
            if let Some(tr) = &self.replay {
                // the trace's experts for this position and MoE layer (wrapping)
                let mi = c.moe_layers().position(|x| x == l).unwrap_or(0);
                let ids: Vec<usize> = tr[(self.pos + first + t) % tr.len()][mi].iter().map(|&e| e as usize).collect();
                waste_moe::route_forced(&router_config(c), scores, &ids, &mut self.chosen);
            }
            let mut order = self.chosen.clone();
            order.sort_by_key(|e| e.0);
            routes.extend(order);
        }
        // 2. each distinct expert once, in consumption order: pin it, start
        // the reads of the missing ones; a chunk's later uses are repeats
        let mut distinct: Vec<u32> = Vec::with_capacity(nt * k);
        let mut repeats: Vec<u32> = Vec::new();
        for &(e, _) in &routes {
            if distinct.contains(&(e as u32)) {
                repeats.push(e as u32);
            } else {
                distinct.push(e as u32);
            }
        }
        // formats a token reads directly run each expert once for the chunk,
        // in ascending id (below): their reads are started in that order
        let batched = nt > 1 && kernel.batches();
        if batched {
            distinct.sort_unstable();
        }
        let experts = m.store.acquire(l as u32, &distinct, &repeats)?;
        // 3. the chunk's expert inputs (the latent down-projection for all tokens at once)
        if let Some(lt) = &w.latent {
            pool.matmat(&lt.down.view(), &self.chunk_ffn_in[x0..x0 + nt * h], nt, &mut self.lat_in[..nt * lat]);
        }
        // 4. per token: tables, then its experts (resident ones first), summed in ascending id
        let scr = self.ex_sc.as_mut().expect("expert scratch");
        let kernel_lanes = waste_moe::lanes_in_use(scr, pool);
        let mut overlapped = 0.0;
        if batched {
            // formats a token reads directly: each expert once for all the
            // chunk's tokens routed to it, in ascending id, so every token's
            // sum still adds its experts in ascending id (the token-by-token
            // order, bit for bit)
            self.lat_sum[..nt * lat].fill(0.0);
            let mut users: Vec<(usize, f32)> = Vec::with_capacity(nt);
            for &e in &distinct {
                users.clear();
                users.extend(
                    (0..nt).filter_map(|t| {
                        routes[t * k..(t + 1) * k].iter().find(|r| r.0 == e as usize).map(|r| (t, r.1))
                    }),
                );
                for (i, &(t, _)) in users.iter().enumerate() {
                    let x = match &w.latent {
                        Some(_) => &self.lat_in[t * lat..(t + 1) * lat],
                        None => &self.chunk_ffn_in[x0 + t * h..x0 + (t + 1) * h],
                    };
                    scr.batch_in[i * lat..(i + 1) * lat].copy_from_slice(x);
                }
                let (te, io0) = (Instant::now(), experts.traffic().io_seconds);
                let rec = experts.wait(e)?;
                kernel.forward_batch(pool, rec, users.len(), scr);
                let waited = experts.traffic().io_seconds - io0;
                self.stats.expert_seconds += (te.elapsed().as_secs_f64() - waited).max(0.0);
                for (i, &(t, wgt)) in users.iter().enumerate() {
                    let sum = &mut self.lat_sum[t * lat..(t + 1) * lat];
                    for (s, &v) in sum.iter_mut().zip(&scr.batch_out[i * lat..(i + 1) * lat]) {
                        *s += v * wgt;
                    }
                }
            }
        }
        self.stats.expert_runs += if batched { distinct.len() } else { nt * k } as u64;
        let per_token = if batched { 0 } else { nt };
        for t in 0..per_token {
            let x = match &w.latent {
                Some(_) => &self.lat_in[t * lat..(t + 1) * lat],
                None => &self.chunk_ffn_in[x0 + t * h..x0 + (t + 1) * h],
            };
            let te = Instant::now();
            kernel.prepare(pool, &w.books, x, scr);
            self.stats.expert_seconds += te.elapsed().as_secs_f64();
            let mine = &routes[t * k..(t + 1) * k];
            // the resident experts first, then the others in the order their
            // reads were started; each lane takes the next one as it arrives
            let (mut order, arriving): (Vec<usize>, Vec<usize>) =
                (0..k).partition(|&i| experts.is_ready(mine[i].0 as u32));
            order.extend(arriving);
            let fetch = |j: usize| experts.wait(mine[order[j]].0 as u32);
            let (te, io0) = (Instant::now(), experts.traffic().io_seconds);
            kernel.forward_fetched(pool, &w.books, &order, &fetch, x, scr, &mut self.eouts[..k * lat])?;
            // waits overlap other lanes' compute: count their lane average as I/O wait
            let (spent, waited) = (te.elapsed().as_secs_f64(), experts.traffic().io_seconds - io0);
            let io_wall = (waited / kernel_lanes as f64).min(spent);
            overlapped += waited - io_wall;
            self.stats.expert_seconds += spent - io_wall;
            let sum = &mut self.lat_sum[t * lat..(t + 1) * lat];
            sum.fill(0.0);
            for (i, &(_, wgt)) in mine.iter().enumerate() {
                for (s, &v) in sum.iter_mut().zip(&self.eouts[i * lat..(i + 1) * lat]) {
                    *s += v * wgt;
                }
            }
        }
        // 5. back to the hidden width (one pass over the up-projection), plus the shared experts
        match &w.latent {
            Some(lt) => {
                if let Some(n) = &lt.norm {
                    for sum in self.lat_sum[..nt * lat].chunks_exact_mut(lat) {
                        rmsnorm_inplace(sum, n, c.rms_eps);
                    }
                }
                pool.matmat(&lt.up.view(), &self.lat_sum[..nt * lat], nt, &mut self.chunk_ffn_out[x0..x0 + nt * h]);
            }
            None => self.chunk_ffn_out[x0..x0 + nt * h].copy_from_slice(&self.lat_sum[..nt * h]),
        }
        if let Some(sh) = &w.shared {
            let out = &mut self.chunk_shared[..nt * h];
            sh.forward_chunk(pool, c.activation, &self.chunk_ffn_in[x0..x0 + nt * h], nt, &mut self.ffn_tmp, out);
            add(&mut self.chunk_ffn_out[x0..x0 + nt * h], out);
        }
        let traffic = experts.release()?;
        self.stats.experts_hit += traffic.hits;
        self.stats.experts_missed += traffic.misses;
        self.stats.bytes_read += traffic.bytes_read;
        self.stats.io_seconds += traffic.io_seconds - overlapped;
        // 4. router lookahead from the last token: prefetch the next MoE layer's likely experts
        if m.opts.lookahead > 0 {
            if let Some(Ffn::Moe(next)) = m.layers.get(l + 1).map(|x| &x.ffn) {
                let xn = &self.chunk_ffn_in[x0 + (nt - 1) * h..x0 + nt * h];
                let scores = &mut self.router[..c.experts];
                pool.matvec(&next.gate.view(), xn, scores);
                let mut guess = Vec::with_capacity(k);
                route(&router_config(c), scores, &next.bias, &mut guess);
                let want: Vec<u32> = guess.iter().take(m.opts.lookahead).map(|&(e, _)| e as u32).collect();
                self.stats.prefetch_issued += m.store.prefetch((l + 1) as u32, &want)?;
            }
        }
        Ok(())
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        // release the prefetch window; settle finished speculative reads
        self.m.store.leave();
    }
}

fn add(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

#[cfg(test)]
mod tests {
    use crate::{Error, Model, ModelOptions};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// A step that never returns (a panic inside the engine, caught by the
    /// caller as the C ABI's guard does) leaves the session refusing to go
    /// on, as a step that returns an error does.
    #[test]
    fn a_step_cut_short_by_a_panic_marks_the_session_incomplete() {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/anchor-tiny/kimi-linear-tiny.waste");
        let m = Model::open(&p, ModelOptions { ctx: 32, threads: 1, ..Default::default() }).unwrap();
        let mut s = m.session();
        s.eval(&[1, 2]).unwrap();
        s.panic_at_layer = Some(2);
        assert!(catch_unwind(AssertUnwindSafe(|| s.eval(&[3]).map(|_| ()))).is_err());
        s.panic_at_layer = None;
        match s.eval(&[3]) {
            Err(Error::Incomplete(c)) => assert!(c.contains("interrupted"), "{c}"),
            other => panic!("went on after a panic mid-step: {:?}", other.map(|l| l.len())),
        }
        s.reset();
        s.eval(&[1, 2, 3]).expect("a reset session works");
    }
}
