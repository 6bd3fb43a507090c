//! A prompt's chunks a span at a time, layer by layer: every chunk of the
//! span through a layer's attention and routing, then the layer's experts
//! pinned once for the whole span (in waves where the cache cannot pin
//! them at once) and run chunk by chunk, then the next layer. Each routed
//! expert is so read at most once a span and layer (not once a chunk),
//! and each streamed layer once a span. Every chunk's arithmetic is the
//! chunk-by-chunk order's — a chunk's attention meets the state the
//! span's earlier chunks left, its experts run for its own tokens as
//! before, each token's sum adds its experts in ascending id — so the
//! logits are the same bits.
//!
//! The rows a chunk carries from layer to layer ([`Carried`]) wait in the
//! model's span stash ([`crate::Plan::shared_scratch_bytes`] counts it)
//! while the step's buffers work on another chunk: swapped in and out,
//! never copied.

use super::*;

/// Tokens a span takes at most (rounded to whole chunks of the buffers'
/// chunk): the 48B's real routing trace reads 3.64 experts a token and
/// layer in chunks of 16, 1.41 in 128, 0.69 over 280 tokens at once.
pub const SPAN_TOKENS: usize = 256;

/// Chunks of `chunk` tokens the span stash holds.
pub(crate) fn span_chunks(chunk: usize) -> usize {
    SPAN_TOKENS.div_ceil(chunk.max(1))
}

/// The rows a chunk of a span carries between layers: its hidden states,
/// FFN inputs and outputs, AttnRes partial and finished blocks, expert
/// inputs, routed sums and shared experts' outputs.
pub(crate) struct Carried {
    hidden: Rows,
    ffn_in: Rows,
    ffn_out: Rows,
    prefix: Rows,
    blocks: Rows,
    done: usize,
    lat_in: Rows,
    lat_sum: Rows,
    shared: Rows,
}

impl Carried {
    /// `(rows, width)` of each buffer in field order (the step's own
    /// buffers' shapes: [`BufferLens`], [`attention::ResScratch`],
    /// [`moe::MoeScratch`]).
    fn shapes(c: &waste_format::ModelConfig, chunk: usize) -> [(usize, usize); 8] {
        let (h, lat) = (c.hidden, c.expert_width());
        let nb = c.attn_res_block.map_or(0, |b| c.layers.div_ceil(b));
        let res = if nb > 0 { chunk } else { 0 };
        let shared = if c.n_moe_layers() > 0 && c.shared_experts > 0 { chunk } else { 0 };
        [(chunk, h), (chunk, h), (chunk, h), (res, h), (res, nb * h), (chunk, lat), (chunk, lat), (shared, h)]
    }
    /// A chunk's carried rows for chunks of `chunk` tokens.
    pub(crate) fn new(c: &waste_format::ModelConfig, chunk: usize) -> Carried {
        let [hidden, ffn_in, ffn_out, prefix, blocks, lat_in, lat_sum, shared] =
            Self::shapes(c, chunk).map(|(r, w)| Rows::new(r, w));
        Carried { hidden, ffn_in, ffn_out, prefix, blocks, done: 0, lat_in, lat_sum, shared }
    }
    /// Their f32s (the plan's count).
    pub(crate) fn floats(c: &waste_format::ModelConfig, chunk: usize) -> usize {
        Self::shapes(c, chunk).iter().map(|(r, w)| r * w).sum()
    }
}

/// f32s of a model's span stash for chunks of `chunk` tokens: a chunk's
/// carried rows for each of [`span_chunks`] (none without MoE layers: the
/// span is for their reads).
pub(crate) fn stash_floats(c: &waste_format::ModelConfig, chunk: usize) -> usize {
    if c.n_moe_layers() == 0 {
        return 0;
    }
    span_chunks(chunk) * Carried::floats(c, chunk)
}

impl Work {
    /// Trade the step's carried buffers with `c`'s (a chunk of a span in,
    /// the buffers it displaced out; the same call again undoes it).
    fn swap(&mut self, c: &mut Carried) {
        use std::mem::swap;
        swap(&mut self.chunk_hidden, &mut c.hidden);
        swap(&mut self.chunk_ffn_in, &mut c.ffn_in);
        swap(&mut self.chunk_ffn_out, &mut c.ffn_out);
        swap(&mut self.res.prefix, &mut c.prefix);
        swap(&mut self.res.blocks, &mut c.blocks);
        swap(&mut self.res.done, &mut c.done);
        swap(&mut self.moe.lat_in, &mut c.lat_in);
        swap(&mut self.moe.lat_sum, &mut c.lat_sum);
        swap(&mut self.moe.chunk_shared, &mut c.shared);
    }

    /// `f` with chunk `j` of `stash` swapped in (and out again, whatever
    /// `f` returns).
    fn with_chunk<T>(&mut self, stash: &mut [Carried], j: usize, f: impl FnOnce(&mut Work) -> T) -> T {
        self.swap(&mut stash[j]);
        let r = f(self);
        self.swap(&mut stash[j]);
        r
    }

    /// A span of one sequence's consecutive `toks` in chunks of `chunk`
    /// (at most `stash.len()` of them), layer by layer; the last token's
    /// logits into the lane when `logits`. The lane's position advances by
    /// the span's tokens (the caller counts them in the stats).
    pub(super) fn forward_span(
        &mut self,
        m: &Model,
        lane: &mut Lane,
        toks: &[Input<'_>],
        chunk: usize,
        logits: bool,
        stash: &mut [Carried],
    ) -> Result<()> {
        let n = toks.len();
        let chunks: Vec<std::ops::Range<usize>> = (0..n).step_by(chunk.max(1)).map(|a| a..(a + chunk).min(n)).collect();
        assert!(chunks.len() <= stash.len(), "a span of {} chunks for a stash of {}", chunks.len(), stash.len());
        let pos: Vec<usize> = (0..n).map(|t| lane.pos + t).collect();
        let (t0, timed0) = (Instant::now(), self.timed());
        for (j, r) in chunks.iter().enumerate() {
            self.with_chunk(stash, j, |w| w.embed(m, &toks[r.clone()]))?;
        }
        let last = chunks.len() - 1;
        let shape = |j: usize| Shape::One { logits: logits && j == last };
        self.each_layer(m, |w, l, layer| {
            // every chunk's attention and routing (its experts not pinned)
            let mut fronts = Vec::with_capacity(chunks.len());
            for (j, r) in chunks.iter().enumerate() {
                let p = &pos[r.clone()];
                let f =
                    w.with_chunk(stash, j, |w| w.layer_front(m, l, layer, &mut [&mut *lane], shape(j), p, false))?;
                // its experts' reads start while the next chunks' attention
                // runs (as many as the free slots take; the pins come after)
                if let Some(mf) = &f.moe {
                    w.stats.prefetch_issued += m.store.prefetch(l as u32, &mf.routed.distinct)?;
                }
                fronts.push(f);
            }
            // the span's experts, pinned together (in waves where they
            // must), each chunk's run for its own tokens
            if let Ffn::Moe(mw) = &layer.ffn {
                w.span_experts(m, l, mw, &chunks, &mut fronts, stash)?;
            }
            // each chunk's combination and FFN residual
            for (j, (r, f)) in chunks.iter().zip(&fronts).enumerate() {
                let (first, nt) = (f.first, r.len());
                w.with_chunk(stash, j, |w| -> Result<()> {
                    if let (Some(_), Ffn::Moe(mw)) = (&f.moe, &layer.ffn) {
                        w.combine(m, mw, first, nt - first);
                    }
                    check_finite(w.chunk_ffn_out.rows(first..nt), m.config().hidden, &pos[r.clone()][first..], {
                        NonFiniteAt::Ffn { layer: l }
                    })?;
                    w.ffn_residual(m.config(), first, nt);
                    Ok(())
                })?;
            }
            Ok(())
        })?;
        let nt = chunks[last].len();
        let wanted = if logits { nt - 1..nt } else { nt..nt };
        self.with_chunk(stash, last, |w| w.head(m, &mut [&mut *lane], shape(last), wanted.clone()))?;
        lane.pos += n;
        self.stats.trunk_seconds += t0.elapsed().as_secs_f64() - (self.timed() - timed0);
        check_logits(&[lane], shape(last), wanted, &pos[chunks[last].clone()])
    }

    /// A MoE layer's routed experts for a span: the union of its chunks'
    /// experts in ascending id, pinned at once or in waves
    /// ([`crate::Model::expert_wave`]), each wave's experts run chunk by
    /// chunk for the chunk's tokens (its pair tables built again where
    /// another chunk took the shared scratch), summed in ascending id.
    fn span_experts(
        &mut self,
        m: &Model,
        l: usize,
        mw: &MoeWeights,
        chunks: &[std::ops::Range<usize>],
        fronts: &mut [LayerFront<'_>],
        stash: &mut [Carried],
    ) -> Result<()> {
        // the span's experts: ascending (`all`, for the waves and their
        // membership) and in first use (chunk by chunk, each chunk's in
        // its consumption order: the order its reads are wanted)
        let (mut all, mut first_use, mut repeats) = (Vec::new(), Vec::new(), Vec::new());
        for f in fronts.iter().filter_map(|f| f.moe.as_ref()) {
            let r = &f.routed;
            repeats.extend(&r.repeats);
            for &e in &r.distinct {
                match all.binary_search(&e) {
                    Ok(_) => repeats.push(e),
                    Err(i) => {
                        all.insert(i, e);
                        first_use.push(e);
                    }
                }
            }
        }
        self.stats.experts_acquired += all.len() as u64;
        // more than the cache can pin at once: waves in ascending id (every
        // token's sum adds its experts in ascending id); else all at once
        let wave = m.expert_wave().filter(|&n| all.len() > n);
        let (order, n) = match wave {
            Some(n) => (&all, n),
            None => (&first_use, all.len().max(1)),
        };
        let stamps: Vec<u64> = chunks.iter().map(|_| moe::next_stamp()).collect();
        for (j, f) in fronts.iter().enumerate() {
            if f.moe.is_some() {
                let nt = chunks[j].len() - f.first;
                self.with_chunk(stash, j, |wk| wk.moe.lat_sum.rows_mut(0..nt).fill(0.0));
            }
        }
        for (i, ids) in order.chunks(n).enumerate() {
            self.stats.expert_waves += u64::from(i > 0);
            let experts = self.pin_wave(m, l, order, &repeats, n, i)?;
            let mut overlapped = 0.0;
            for (j, f) in fronts.iter().enumerate() {
                let Some(front) = &f.moe else { continue };
                let distinct = &front.routed.distinct;
                let mine: Vec<u32> = match wave {
                    Some(_) => distinct.iter().copied().filter(|e| ids.binary_search(e).is_ok()).collect(),
                    None => distinct.clone(),
                };
                if mine.is_empty() {
                    continue;
                }
                let only = wave.map(|_| ids);
                let (first, nt, stamp) = (f.first, chunks[j].len() - f.first, stamps[j]);
                overlapped += self.with_chunk(stash, j, |wk| {
                    wk.run_wave(m, mw, &experts, &front.routed, &mine, only, stamp, first, nt)
                })?;
            }
            self.settle(experts, overlapped)?;
        }
        Ok(())
    }
}
