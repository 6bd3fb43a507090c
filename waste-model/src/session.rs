//! `Session`: one sequence's state and the forward pass.

use crate::model::Model;
use crate::weights::{kda_config, mla_config, router_config, Attn, Ffn, MoeWeights};
use crate::{Error, NonFiniteAt, Result};
use std::time::Instant;
use waste_attn::{attn_res, kda, mla, KdaScratch, KdaState, MlaScratch, MlaState};
use waste_cache::Pinned;
use waste_moe::{route, ExpertScratch};
use waste_quant::ops::{first_non_finite, rmsnorm, rmsnorm_inplace};

mod attention;
mod rows;
use rows::Rows;
mod head;
mod moe;
pub(crate) mod span;

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
    /// Distinct experts a step's MoE layers acquired (per layer and step:
    /// a token's top-k alone; the union of a chunk's or a batched step's
    /// tokens' choices): the experts the step read from the cache or the disk.
    pub experts_acquired: u64,
    /// Bytes of streamed decoder layers read (issue 48: a budget below the
    /// resident floor streams layers every token; 0 otherwise).
    pub trunk_bytes_read: u64,
    /// Seconds waiting for a streamed layer to arrive (not in `trunk_seconds`).
    pub trunk_io_seconds: f64,
    /// Batched steps run as two halves in turn (counted in the step's
    /// first session; [`crate::ModelOptions::halves`]).
    pub halves_steps: u64,
    /// Acquires of a layer-step's experts after its first: a chunk whose
    /// layer routes to more experts than the cache can pin at once runs
    /// them in waves ([`crate::Model::expert_wave`]); 0 where the cache
    /// pins a layer's.
    pub expert_waves: u64,
}

/// `impl $tr for Stats`: `$op` field by field (one list of the fields for
/// every operator, so a new counter cannot be summed but not subtracted).
macro_rules! stats_op {
    ($tr:ident, $f:ident, $op:tt, $doc:literal) => {
        #[doc = $doc]
        impl std::ops::$tr for Stats {
            type Output = Stats;
            fn $f(self, b: Stats) -> Stats {
                stats_op!(@fields self b $op; tokens experts_hit experts_missed bytes_read prefetch_issued
                    io_seconds trunk_seconds attn_seconds expert_seconds expert_runs experts_acquired
                    trunk_bytes_read trunk_io_seconds halves_steps expert_waves)
            }
        }
    };
    (@fields $a:ident $b:ident $op:tt; $($x:ident)*) => {
        Stats { $($x: $a.$x $op $b.$x),* }
    };
}
stats_op!(Add, add, +, "Two sessions' counters together (a batch's: its sessions' sum).");
stats_op!(Sub, sub, -, "What happened between two readings of the counters: `after - before`.");

enum LayerState {
    Kda(KdaState),
    Mla(MlaState),
}

impl LayerState {
    /// A KDA layer's state (the layer's kind decides which state it has).
    fn kda(&mut self) -> &mut KdaState {
        match self {
            LayerState::Kda(s) => s,
            LayerState::Mla(_) => unreachable!("layer state matches its kind"),
        }
    }
    /// An MLA layer's state.
    fn mla(&mut self) -> &mut MlaState {
        match self {
            LayerState::Mla(s) => s,
            LayerState::Kda(_) => unreachable!("layer state matches its kind"),
        }
    }
}

/// A borrowed view of one layer's state (for state files).
pub(crate) enum LayerStateRef<'a> {
    Kda { conv: &'a [f32], s: &'a [f32] },
    Mla { cache: &'a [f32], len: usize, width: usize },
}

/// One sequence's own state: what each sequence of a batched step keeps
/// apart (its position, layer states, last logits and replayed routing).
pub(crate) struct Lane {
    pos: usize,
    states: Vec<LayerState>,
    logits: Vec<f32>,
    /// A recorded routing to replay instead of the router's choice (benchmarks).
    replay: Option<std::sync::Arc<Vec<Vec<Vec<u32>>>>>,
}

/// The buffers a step computes in: a session's own, or the first session's
/// for every sequence of a batched step ([`crate::Model::step_many`]).
struct Work {
    kda_sc: Option<KdaScratch>,
    mla_sc: Option<MlaScratch>,
    ex_sc: Option<ExpertScratch>,
    /// Per chunk token: hidden state, FFN input, FFN output (a row of `hidden` each).
    chunk_hidden: Rows,
    chunk_ffn_in: Rows,
    chunk_ffn_out: Rows,
    /// One token's layer input (the AttnRes mix, or the shared expert's output).
    token_in: Vec<f32>,
    /// The final-normed hidden state the LM head reads.
    head_in: Vec<f32>,
    /// The Attention Residuals' buffers ([`attention::ResScratch`]).
    res: attention::ResScratch,
    /// The MoE block's buffers ([`moe::MoeScratch`]).
    moe: moe::MoeScratch,
    /// The dense FFN's and the shared experts' gate and up activations.
    ffn_tmp: Vec<f32>,
    /// A batched step's logits, `tokens × vocab` (allocated by the first
    /// batched step; empty otherwise).
    batch_logits: Vec<f32>,
    stats: Stats,
    /// Unit tests: panic inside the step at this layer (an engine bug's stand-in).
    #[cfg(test)]
    panic_at_layer: Option<usize>,
}

/// Which sequences a step's tokens belong to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// Consecutive tokens of one sequence; the last one's logits when `logits`.
    One { logits: bool },
    /// Token `t` is sequence `t`'s next; every token's logits.
    Batch,
}

/// One sequence being evaluated.
pub struct Session<'m> {
    m: &'m Model,
    lane: Lane,
    work: Work,
    /// Images waiting for their `<|media_pad|>` placeholders, in order.
    images: std::collections::VecDeque<crate::Image>,
    /// The message of a step that failed part-way: the state is a mix of
    /// before and after that step, so evaluating or saving is refused
    /// ([`Error::Incomplete`]) until a reset or a restore replaces it all.
    pub(crate) incomplete: Option<std::borrow::Cow<'static, str>>,
}

/// The lengths (f32s) of a session's own buffers for a config: what
/// `Session::new` allocates and what the memory plan counts — one formula
/// for both ([`scratch_bytes`]).
pub(crate) struct BufferLens {
    /// The shape `(rows, width)` of each of the chunk's three [`Rows`]
    /// (hidden states, FFN inputs, FFN outputs).
    chunk: (usize, usize),
    token_in: usize,
    head_in: usize,
    /// The Attention Residuals' ([`attention::ResScratch::floats`]).
    res: usize,
    /// The MoE block's ([`moe::MoeScratch::floats`]).
    moe: usize,
    ffn_tmp: usize,
    logits: usize,
}

impl BufferLens {
    /// For prefill chunks of `chunk` tokens.
    pub(crate) fn new(c: &waste_format::ModelConfig, chunk: usize) -> BufferLens {
        let h = c.hidden;
        let ffn_w = c.intermediate.max(c.moe_intermediate * c.shared_experts);
        BufferLens {
            chunk: (chunk, h),
            token_in: h,
            head_in: h,
            res: attention::ResScratch::floats(c, chunk),
            moe: moe::MoeScratch::floats(c, chunk),
            ffn_tmp: 2 * ffn_w * chunk,
            logits: c.vocab,
        }
    }

    /// All the buffers' f32s.
    fn total(&self) -> usize {
        [3 * self.chunk.0 * self.chunk.1, self.token_in, self.head_in, self.res, self.moe, self.ffn_tmp, self.logits]
            .iter()
            .sum()
    }
}

/// Bytes of one session's scratch but the experts' (their VQ tables are the
/// kernel's): its buffers ([`BufferLens`]) and the attention scratch, as
/// `Session::new` allocates them for a context of `ctx` and prefill chunks
/// of `chunk` tokens.
pub(crate) fn scratch_bytes(c: &waste_format::ModelConfig, ctx: usize, chunk: usize) -> u64 {
    let mut b = 4 * BufferLens::new(c, chunk).total() as u64;
    if c.attn_kinds.contains(&waste_format::AttnKind::Kda) {
        b += KdaScratch::bytes(&kda_config(c), chunk) as u64;
    }
    if c.n_mla_layers() > 0 {
        b += MlaScratch::bytes(&mla_config(c, ctx), c.q_lora.unwrap_or(0), chunk) as u64;
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
        let chunk = m.chunk();
        let n = BufferLens::new(c, chunk);
        let buf = |len: usize| vec![0f32; len];
        let work = Work {
            kda_sc: has_kda.then(|| KdaScratch::new(&kc, chunk)),
            mla_sc: has_mla.then(|| MlaScratch::new(&mc, c.q_lora.unwrap_or(0), chunk)),
            ex_sc: m.kernel.as_ref().map(|k| k.scratch(waste_moe::lanes_for(m.pool.threads(), c.top_k))),
            chunk_hidden: Rows::new(n.chunk.0, n.chunk.1),
            chunk_ffn_in: Rows::new(n.chunk.0, n.chunk.1),
            chunk_ffn_out: Rows::new(n.chunk.0, n.chunk.1),
            token_in: buf(n.token_in),
            head_in: buf(n.head_in),
            res: attention::ResScratch::new(c, chunk),
            moe: moe::MoeScratch::new(c, chunk),
            ffn_tmp: buf(n.ffn_tmp),
            batch_logits: Vec::new(),
            stats: Stats::default(),
            #[cfg(test)]
            panic_at_layer: None,
        };
        Session {
            m,
            lane: Lane { pos: 0, states, logits: buf(n.logits), replay: None },
            work,
            images: Default::default(),
            incomplete: None,
        }
    }

    /// Tokens evaluated so far (the next position).
    pub fn position(&self) -> usize {
        self.lane.pos
    }
    /// Counters since the session started (or was reset). A batched step's
    /// shared work ([`crate::Model::step_many`]) is counted in its first
    /// session's counters; each session counts its own tokens.
    pub fn stats(&self) -> Stats {
        self.work.stats
    }
    /// The model.
    pub fn model(&self) -> &'m Model {
        self.m
    }
    /// Forget everything: position 0, zero states, zero counters, no queued images.
    pub fn reset(&mut self) {
        self.lane.pos = 0;
        self.incomplete = None;
        self.images.clear();
        for s in &mut self.lane.states {
            match s {
                LayerState::Kda(k) => k.reset(),
                LayerState::Mla(m) => m.reset(),
            }
        }
        self.work.stats = Stats::default();
    }

    pub(crate) fn layer_states(&self) -> Vec<LayerStateRef<'_>> {
        let c = self.m.config();
        let width = c.kv_lora + c.qk_rope;
        self.lane
            .states
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
        for (i, s) in self.lane.states.iter_mut().enumerate() {
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
        self.lane.logits.iter_mut().for_each(|v| *v = vals.next().unwrap_or(0.0));
        self.lane.pos = pos;
        self.incomplete = None;
    }

    /// Bytes this session holds: (state, scratch), counted from its buffers.
    pub fn allocated_bytes(&self) -> (u64, u64) {
        let mut state = 0u64;
        for s in &self.lane.states {
            state += 4 * match s {
                LayerState::Kda(k) => k.conv.capacity() + k.s.capacity(),
                LayerState::Mla(m) => m.cache.capacity(),
            } as u64;
        }
        let v = |x: &Vec<f32>| 4 * x.capacity() as u64;
        let mut sc = [&self.work.chunk_hidden, &self.work.chunk_ffn_in, &self.work.chunk_ffn_out]
            .iter()
            .map(|r| r.allocated_bytes())
            .sum::<u64>();
        sc += [&self.work.token_in, &self.work.head_in, &self.work.ffn_tmp, &self.work.batch_logits, &self.lane.logits]
            .iter()
            .map(|b| v(b))
            .sum::<u64>();
        sc += self.work.moe.allocated_bytes() + self.work.res.allocated_bytes();
        sc += self.work.kda_sc.as_ref().map_or(0, |k| k.allocated_bytes() as u64);
        sc += self.work.mla_sc.as_ref().map_or(0, |k| k.allocated_bytes() as u64);
        sc += self.work.ex_sc.as_ref().map_or(0, |e| e.allocated_bytes());
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
        if self.lane.pos + n > ctx {
            return Err(Error::ContextFull { pos: self.lane.pos, n, ctx });
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
        // several chunks a span at a time, layer by layer, where that
        // reads less and the model's span stash is free (else chunk by
        // chunk: the same bits)
        let m = self.m;
        let mut stash = match n > chunk && m.spans() {
            true => match m.span_stash.try_lock() {
                Ok(g) => Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            },
            false => None,
        };
        if let Some(g) = stash.as_mut().filter(|g| g.is_empty()) {
            let c = m.config();
            g.extend((0..span::span_chunks(m.chunk())).map(|_| span::Carried::new(c, m.chunk())));
        }
        let mut i = 0;
        while i < n {
            let (t, r) = match stash.as_mut() {
                Some(g) if n - i > chunk => {
                    let t = (chunk * g.len()).min(n - i);
                    (t, self.work.forward_span(m, &mut self.lane, &inputs[i..i + t], chunk, i + t == n, g))
                }
                _ => {
                    let t = chunk.min(n - i);
                    let shape = Shape::One { logits: i + t == n };
                    (t, self.work.forward(m, &mut [&mut self.lane], &inputs[i..i + t], shape))
                }
            };
            self.work.stats.tokens += t as u64;
            if let Err(e) = r {
                self.incomplete = Some(e.to_string().into());
                return Err(e);
            }
            i += t;
        }
        self.incomplete = None;
        Ok(&self.lane.logits)
    }

    /// Evaluate one generated token: [`Session::eval`] of `[token]`, but an
    /// image placeholder the model generates is an ordinary token (as
    /// [`Session::generate`] evaluates its tokens).
    ///
    /// # Errors
    /// As [`Session::eval`].
    pub fn eval_generated(&mut self, token: u32) -> Result<()> {
        self.eval_inner(&[token], false).map(|_| ())
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
    /// --routing`). Logits are then not the model's, and the router
    /// lookahead reads nothing ahead for this session (its guesses would be
    /// the router's, not the trace's).
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
        self.lane.replay = Some(trace);
        Ok(())
    }

    /// Tokens evaluated together in a prefill chunk: what the buffers hold
    /// ([`Model::chunk`]), at most the options' `max_chunk`
    /// ([`Model::chunk_limit`]). A cache too small to pin a chunk's layer's
    /// experts at once takes them in waves ([`Model::expert_wave`]).
    pub fn chunk_len(&self) -> usize {
        self.m.chunk_limit()
    }

    /// [`Error::Incomplete`] when a step failed part-way since the last
    /// reset or restore.
    pub(crate) fn check_complete(&self) -> Result<()> {
        self.incomplete.as_ref().map_or(Ok(()), |c| Err(Error::Incomplete(c.to_string())))
    }

    /// Logits of the last evaluated token.
    pub fn logits(&self) -> &[f32] {
        &self.lane.logits
    }
}

/// Sequences a batched step can advance together ([`crate::Plan::max_batch`]).
pub(crate) fn max_batch(m: &Model) -> usize {
    m.plan().max_batch(m.cache_slots(), m.lookahead)
}

/// [`crate::Model::step_many`].
pub(crate) fn step_many(m: &Model, sessions: &mut [&mut Session<'_>], tokens: &[u32]) -> Result<()> {
    let n = sessions.len();
    if n == 0 || tokens.len() != n {
        return Err(Error::Arg(format!(
            "a batched step takes one token per session: {} tokens for {n} sessions",
            tokens.len()
        )));
    }
    let most = max_batch(m);
    if n > most {
        return Err(Error::Arg(format!(
            "{n} sessions in one step: this model's cache and buffers take at most {most} (each token's experts pinned at once)"
        )));
    }
    let vocab = m.embed.rows();
    for (i, (s, &t)) in sessions.iter().zip(tokens).enumerate() {
        if !std::ptr::eq(s.m, m) {
            return Err(Error::Arg(format!("session {i} belongs to another model")));
        }
        s.check_complete()?;
        if t as usize >= vocab {
            return Err(Error::Arg(format!("session {i}: token id {t} is outside the vocabulary (0..{vocab})")));
        }
        if s.lane.pos + 1 > m.opts.ctx {
            return Err(Error::ContextFull { pos: s.lane.pos, n: 1, ctx: m.opts.ctx });
        }
    }
    let inputs: Vec<Input<'_>> = tokens.iter().map(|&t| Input::Token(t)).collect();
    for s in sessions.iter_mut() {
        s.incomplete = Some(std::borrow::Cow::Borrowed("a batched step was interrupted before it finished"));
    }
    // two halves in turn where reads are to hide and every layer is
    // resident: as asked, else whichever form has measured faster
    let measured = n >= 2 && m.halves().is_none();
    let choice = || m.halves_choice.lock().unwrap_or_else(|p| p.into_inner());
    let halves = n >= 2 && m.halves().unwrap_or_else(|| choice().choose(n));
    let a_tokens = if halves { n.div_ceil(2) } else { n };
    let t0 = Instant::now();
    let mut lanes: Vec<&mut Lane> = Vec::with_capacity(n);
    let mut works: Vec<&mut Work> = Vec::with_capacity(2);
    for (i, s) in sessions.iter_mut().enumerate() {
        let Session { lane, work, .. } = &mut **s;
        lanes.push(lane);
        if i == 0 || i == a_tokens {
            works.push(work);
        }
    }
    let r = match works.as_mut_slice() {
        [a, b] => forward_halves(a, b, m, &mut lanes, &inputs, a_tokens),
        [a] => a.forward(m, &mut lanes, &inputs, Shape::Batch),
        _ => unreachable!("one work, or two halves"),
    };
    drop((lanes, works));
    if measured && r.is_ok() {
        choice().record(n, halves, t0.elapsed().as_secs_f64());
    }
    sessions[0].work.stats.halves_steps += u64::from(halves);
    for s in sessions.iter_mut() {
        s.incomplete = r.as_ref().err().map(|e| e.to_string().into());
        s.work.stats.tokens += 1;
    }
    r
}

/// The tokens a layer's FFN runs for: `first..first + nt` of a step whose
/// tokens sit at positions `pos` and belong to sequences as `shape` says.
#[derive(Clone, Copy)]
struct Span<'a> {
    shape: Shape,
    pos: &'a [usize],
    first: usize,
    nt: usize,
}

/// [`Error::NonFinite`] for the first non-finite logit of the `wanted`
/// tokens: garbage in the weights ends here as an error, not as sampled text.
fn check_logits(lanes: &[&mut Lane], shape: Shape, wanted: std::ops::Range<usize>, pos: &[usize]) -> Result<()> {
    for t in wanted {
        let logits = &lanes[owner(shape, t)].logits;
        if let Some(token) = first_non_finite(logits) {
            let at = NonFiniteAt::Logit { token };
            return Err(Error::NonFinite { pos: pos[t], at, value: logits[token] });
        }
    }
    Ok(())
}

/// Start `f` on a scoped loader thread (a streamed layer or head piece,
/// read while the step computes: issue 48).
fn loader<'s, T: Send + 's>(
    s: &'s std::thread::Scope<'s, '_>,
    what: &'static str,
    f: impl FnOnce() -> T + Send + 's,
) -> Result<std::thread::ScopedJoinHandle<'s, T>> {
    std::thread::Builder::new()
        .name(format!("waste-{what}"))
        .spawn_scoped(s, f)
        .map_err(|source| waste_io::Error::Thread { what: "trunk loader", source }.into())
}

/// Token `t`'s sequence: its index in a step's lanes.
fn owner(shape: Shape, t: usize) -> usize {
    match shape {
        Shape::One { .. } => 0,
        Shape::Batch => t,
    }
}

impl Work {
    /// One step: `toks` through every layer and, for the tokens `shape`
    /// wants, the head into their lanes' logits. Each lane's position
    /// advances by its tokens (the callers count them in the stats).
    fn forward(&mut self, m: &Model, lanes: &mut [&mut Lane], toks: &[Input<'_>], shape: Shape) -> Result<()> {
        let nt = toks.len();
        debug_assert_eq!(lanes.len(), if shape == Shape::Batch { nt } else { 1 });
        let pos: Vec<usize> =
            (0..nt).map(|t| lanes[owner(shape, t)].pos + if shape == Shape::Batch { 0 } else { t }).collect();
        let (t0, timed0) = (Instant::now(), self.timed());
        self.embed(m, toks)?;
        self.layers(m, lanes, shape, &pos)?;
        let wanted = match shape {
            Shape::One { logits: true } => nt - 1..nt,
            Shape::One { logits: false } => nt..nt,
            Shape::Batch => 0..nt,
        };
        self.head(m, lanes, shape, wanted.clone())?;
        match shape {
            Shape::One { .. } => lanes[0].pos += nt,
            Shape::Batch => lanes.iter_mut().for_each(|ln| ln.pos += 1),
        }
        self.stats.trunk_seconds += t0.elapsed().as_secs_f64() - (self.timed() - timed0);
        check_logits(lanes, shape, wanted, &pos)
    }

    /// Every decoder layer in order, each streamed layer read from disk
    /// on a loader thread while the layer before it computes (issue 48:
    /// at most two streamed layers in memory, the one computed and the
    /// one read ahead).
    fn layers(&mut self, m: &Model, lanes: &mut [&mut Lane], shape: Shape, pos: &[usize]) -> Result<()> {
        self.each_layer(m, |w, l, layer| w.layer(m, l, layer, lanes, shape, pos))
    }

    /// `f` for every decoder layer in order, a streamed one read from disk
    /// on a loader thread while the layer before it computes.
    fn each_layer(
        &mut self,
        m: &Model,
        mut f: impl FnMut(&mut Work, usize, &crate::weights::Layer) -> Result<()>,
    ) -> Result<()> {
        let streamed = &m.split.streamed;
        std::thread::scope(|s| -> Result<()> {
            let load =
                |l: usize| loader(s, "layer", move || crate::weights::stream_layer(&m.container, &m.trunk_file, l));
            let mut ahead = match streamed.first() {
                Some(&l) => Some((l, load(l)?)),
                None => None,
            };
            for l in 0..m.layers.len() {
                let owned;
                let layer = match &m.layers[l] {
                    Some(x) => x,
                    None => {
                        let (_, h) = ahead.take().filter(|(al, _)| *al == l).ok_or_else(|| {
                            Error::Unsupported(format!("layer {l} is neither resident nor read ahead"))
                        })?;
                        let (layer, bytes) = self.arrived(h)?;
                        self.stats.trunk_bytes_read += bytes;
                        if let Some(&next) = streamed.iter().find(|&&x| x > l) {
                            ahead = Some((next, load(next)?));
                        }
                        owned = layer;
                        &owned
                    }
                };
                f(self, l, layer)?;
            }
            Ok(())
        })
    }

    /// A loader's result once it has arrived, the wait counted as the
    /// trunk's I/O.
    fn arrived<T>(&mut self, h: std::thread::ScopedJoinHandle<'_, Result<T>>) -> Result<T> {
        let t = Instant::now();
        let v = h.join().map_err(|_| Error::Unsupported("a trunk loader thread panicked".into()))?;
        self.stats.trunk_io_seconds += t.elapsed().as_secs_f64();
        v
    }

    /// Layer `l` for a step's tokens: attention, then the FFN, each with
    /// its residual.
    fn layer(
        &mut self,
        m: &Model,
        l: usize,
        layer: &crate::weights::Layer,
        lanes: &mut [&mut Lane],
        shape: Shape,
        pos: &[usize],
    ) -> Result<()> {
        let front = self.layer_front(m, l, layer, lanes, shape, pos, true)?;
        self.layer_back(m, l, layer, lanes, shape, pos, front)
    }

    /// A layer's first half: attention with its residual, the FFN's inputs,
    /// and a dense FFN whole or a MoE block's first half (its reads
    /// started where `pin`, else left to a span: [`Work::moe_front`]).
    #[allow(clippy::too_many_arguments)]
    fn layer_front<'m>(
        &mut self,
        m: &'m Model,
        l: usize,
        layer: &crate::weights::Layer,
        lanes: &mut [&mut Lane],
        shape: Shape,
        pos: &[usize],
        pin: bool,
    ) -> Result<LayerFront<'m>> {
        let c = m.config();
        let nt = pos.len();
        #[cfg(test)]
        assert!(self.panic_at_layer != Some(l), "injected panic at layer {l}");
        let restarted = c.attn_res_block.is_some_and(|b| l.is_multiple_of(b));
        self.attn_inputs(m, layer, nt, restarted);
        // the last layer's outputs feed only the head: its attention
        // outputs and FFN run for the tokens whose logits are wanted
        // (a chunk's last, or none: llama.cpp's `inp_out_ids`); its
        // state still takes every token
        let first = match shape {
            _ if l + 1 < m.layers.len() => 0,
            Shape::One { logits: true } => nt - 1,
            Shape::One { logits: false } => nt,
            Shape::Batch => 0,
        };
        let ta = Instant::now();
        self.attention(m, l, layer, lanes, nt, first)?;
        self.stats.attn_seconds += ta.elapsed().as_secs_f64();
        check_finite(self.chunk_ffn_out.rows(first..nt), c.hidden, &pos[first..], NonFiniteAt::Attention { layer: l })?;
        self.ffn_inputs(m, layer, first, nt, restarted);
        if restarted {
            self.res.done += 1;
        }
        let n = nt - first;
        let moe = match &layer.ffn {
            _ if n == 0 => None,
            Ffn::Dense(d) => {
                d.forward_chunk(
                    &m.pool,
                    c.activation,
                    self.chunk_ffn_in.rows(first..nt),
                    n,
                    &mut self.ffn_tmp,
                    self.chunk_ffn_out.rows_mut(first..nt),
                );
                None
            }
            Ffn::Moe(w) => Some(self.moe_front(m, l, w, lanes, Span { shape, pos, first, nt: n }, pin)?),
        };
        Ok(LayerFront { moe, first })
    }

    /// A layer's second half: a MoE block's experts and combination
    /// ([`Work::moe_back`]), then the FFN residual.
    #[allow(clippy::too_many_arguments)]
    fn layer_back(
        &mut self,
        m: &Model,
        l: usize,
        layer: &crate::weights::Layer,
        lanes: &mut [&mut Lane],
        shape: Shape,
        pos: &[usize],
        front: LayerFront<'_>,
    ) -> Result<()> {
        let c = m.config();
        let (first, nt) = (front.first, pos.len());
        if let (Some(f), Ffn::Moe(w)) = (front.moe, &layer.ffn) {
            self.moe_back(m, l, w, lanes, Span { shape, pos, first, nt: nt - first }, f)?;
        }
        check_finite(self.chunk_ffn_out.rows(first..nt), c.hidden, &pos[first..], NonFiniteAt::Ffn { layer: l })?;
        self.ffn_residual(c, first, nt);
        Ok(())
    }

    /// The step's inputs into `chunk_hidden`: token embeddings or given rows.
    fn embed(&mut self, m: &Model, toks: &[Input<'_>]) -> Result<()> {
        for (t, inp) in toks.iter().enumerate() {
            let dst = self.chunk_hidden.row_mut(t);
            match *inp {
                Input::Token(tok) => m.embed.row(tok, dst)?,
                Input::Row(r) => dst.copy_from_slice(r),
            }
        }
        self.res.done = 0;
        Ok(())
    }

    /// The stats' times so far that are not the trunk's: I/O waits,
    /// experts, attention, streamed-layer waits.
    fn timed(&self) -> f64 {
        self.stats.io_seconds + self.stats.expert_seconds + self.stats.attn_seconds + self.stats.trunk_io_seconds
    }
}

/// What a layer's first half ([`Work::layer_front`]) leaves for its second.
struct LayerFront<'m> {
    /// A MoE block's pinned experts and routes.
    moe: Option<moe::MoeFront<'m>>,
    /// The first token the FFN runs for.
    first: usize,
}

/// A batched step of every resident layer as two halves in turn ([`crate::ModelOptions::halves`]):
/// `a` computes the first `a_tokens` sequences, `b` the rest, and each half's
/// MoE reads are in flight while the other half computes — half B finishes
/// layer `l - 1` and starts layer `l` while A's experts of `l` arrive, A
/// finishes `l` and starts `l + 1` while B's arrive — so the disk is not
/// idle while attention runs. One pass over the head for every sequence
/// (B's final states beside A's). Each sequence's arithmetic is its own
/// (a batch's widths never change a bit), so the logits are those of the
/// whole batch in one.
fn forward_halves(
    a: &mut Work,
    b: &mut Work,
    m: &Model,
    lanes: &mut [&mut Lane],
    toks: &[Input<'_>],
    a_tokens: usize,
) -> Result<()> {
    let (n, na) = (toks.len(), a_tokens);
    let pos: Vec<usize> = lanes.iter().map(|ln| ln.pos).collect();
    let (ta0, tb0) = (a.timed(), b.timed());
    let mut busy = [0f64; 2];
    let t = Instant::now();
    a.embed(m, &toks[..na])?;
    b.embed(m, &toks[na..])?;
    busy[0] += t.elapsed().as_secs_f64();
    {
        let layer =
            |l: usize| m.layers[l].as_ref().ok_or_else(|| Error::Unsupported(format!("layer {l} streams: no halves")));
        let (la, lb) = lanes.split_at_mut(na);
        let (pa, pb) = pos.split_at(na);
        let last = m.layers.len() - 1;
        let t = Instant::now();
        let mut fa = Some(a.layer_front(m, 0, layer(0)?, la, Shape::Batch, pa, true)?);
        let mut fb: Option<LayerFront<'_>> = None;
        busy[0] += t.elapsed().as_secs_f64();
        for l in 0..=last {
            // B: the rest of layer l - 1, then layer l's first half (A's reads of l in flight)
            let t = Instant::now();
            if let Some(f) = fb.take() {
                b.layer_back(m, l - 1, layer(l - 1)?, lb, Shape::Batch, pb, f)?;
            }
            fb = Some(b.layer_front(m, l, layer(l)?, lb, Shape::Batch, pb, true)?);
            busy[1] += t.elapsed().as_secs_f64();
            // A: the rest of layer l, then layer l + 1's first half (B's reads of l in flight)
            let t = Instant::now();
            let f = fa.take().expect("A's layer started");
            a.layer_back(m, l, layer(l)?, la, Shape::Batch, pa, f)?;
            if l < last {
                fa = Some(a.layer_front(m, l + 1, layer(l + 1)?, la, Shape::Batch, pa, true)?);
            }
            busy[0] += t.elapsed().as_secs_f64();
        }
        let t = Instant::now();
        if let Some(f) = fb.take() {
            b.layer_back(m, last, layer(last)?, lb, Shape::Batch, pb, f)?;
        }
        busy[1] += t.elapsed().as_secs_f64();
    }
    // B's final states (and AttnRes blocks) beside A's: one pass over the head
    let t = Instant::now();
    for i in 0..n - na {
        a.chunk_hidden.row_mut(na + i).copy_from_slice(b.chunk_hidden.row(i));
        if m.out_res.is_some() {
            a.res.blocks.row_mut(na + i).copy_from_slice(b.res.blocks.row(i));
        }
    }
    a.head(m, lanes, Shape::Batch, 0..n)?;
    lanes.iter_mut().for_each(|ln| ln.pos += 1);
    busy[0] += t.elapsed().as_secs_f64();
    a.stats.trunk_seconds += busy[0] - (a.timed() - ta0);
    b.stats.trunk_seconds += busy[1] - (b.timed() - tb0);
    check_logits(lanes, Shape::Batch, 0..n, &pos)
}

/// [`Error::NonFinite`] at `at` for the first non-finite value of a step's
/// outputs (`width` per token, the tokens at positions `pos`): where
/// overflowing or damaged weights first show, named while the step runs.
fn check_finite(outs: &[f32], width: usize, pos: &[usize], at: NonFiniteAt) -> Result<()> {
    let Some(i) = first_non_finite(outs) else { return Ok(()) };
    Err(Error::NonFinite { pos: pos[i / width], at, value: outs[i] })
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
        let m = Model::open(&p, ModelOptions { ctx: 32, threads: 1, ..ModelOptions::exact() }).unwrap();
        let mut s = m.session();
        s.eval(&[1, 2]).unwrap();
        s.work.panic_at_layer = Some(2);
        assert!(catch_unwind(AssertUnwindSafe(|| s.eval(&[3]).map(|_| ()))).is_err());
        s.work.panic_at_layer = None;
        match s.eval(&[3]) {
            Err(Error::Incomplete(c)) => assert!(c.contains("interrupted"), "{c}"),
            other => panic!("went on after a panic mid-step: {:?}", other.map(|l| l.len())),
        }
        s.reset();
        s.eval(&[1, 2, 3]).expect("a reset session works");
    }
}
