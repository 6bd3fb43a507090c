//! The attention block of a step: the attention inputs (the hidden state
//! or K3's Attention Residuals mix, normed), KDA or MLA over the step's
//! tokens on each sequence's state, and the residuals around it into the
//! FFN's inputs and back into the hidden state.

use super::*;

/// The Attention Residuals' buffers in a step (one formula for what
/// `Session::new` allocates and what the plan counts:
/// [`ResScratch::floats`]); all empty for a model without them.
pub(super) struct ResScratch {
    /// Each chunk token's partial block (the running sum since the last
    /// block boundary), a row of `hidden` a chunk token.
    pub(super) prefix: Rows,
    /// Each chunk token's finished blocks, a row of `per_token × hidden` a chunk token.
    pub(super) blocks: Rows,
    /// Blocks finished so far in this token's pass.
    pub(super) done: usize,
    /// The last token's hidden state, kept for the output aggregation.
    pub(super) out_copy: Vec<f32>,
}

impl ResScratch {
    /// The buffers' shapes, `(rows, width)`: prefix, blocks (a token's
    /// row holds its layers / block size blocks), out copy; no rows
    /// without AttnRes.
    fn shapes(c: &waste_format::ModelConfig, chunk: usize) -> [(usize, usize); 3] {
        let (h, nb) = (c.hidden, c.attn_res_block.map_or(0, |b| c.layers.div_ceil(b)));
        let on = usize::from(nb > 0);
        [(on * chunk, h), (on * chunk, nb * h), (on, h)]
    }
    /// The buffers for a config and chunks of `chunk` tokens.
    pub(super) fn new(c: &waste_format::ModelConfig, chunk: usize) -> ResScratch {
        let [p, b, o] = Self::shapes(c, chunk);
        let (prefix, blocks) = (Rows::new(p.0, p.1), Rows::new(b.0, b.1));
        ResScratch { prefix, blocks, done: 0, out_copy: vec![0f32; o.0 * o.1] }
    }
    /// Their f32s for a config (the plan's count).
    pub(super) fn floats(c: &waste_format::ModelConfig, chunk: usize) -> usize {
        Self::shapes(c, chunk).iter().map(|(r, w)| r * w).sum()
    }
    /// Bytes allocated (capacities).
    pub(super) fn allocated_bytes(&self) -> u64 {
        self.prefix.allocated_bytes() + self.blocks.allocated_bytes() + 4 * self.out_copy.capacity() as u64
    }
}

impl Work {
    /// The attention inputs of a layer for every token (they depend on
    /// earlier layers only): the AttnRes mix (and a block boundary's copy)
    /// or the hidden state, normed into `chunk_ffn_in`.
    pub(super) fn attn_inputs(&mut self, m: &Model, layer: &crate::weights::Layer, nt: usize, restarted: bool) {
        let c = m.config();
        let h = c.hidden;
        for t in 0..nt {
            let hh = self.chunk_hidden.row_mut(t);
            let xa = self.chunk_ffn_in.row_mut(t);
            if c.attn_res_block.is_none() {
                rmsnorm(hh, &layer.in_norm, c.rms_eps, xa);
                continue;
            }
            let res = layer.res.as_ref().expect("attn res weights");
            let p = self.res.prefix.row_mut(t);
            let blocks = self.res.blocks.row_mut(t);
            p.copy_from_slice(hh);
            if self.res.done > 0 {
                attn_res(&blocks[..self.res.done * h], h, p, &res.attn, c.rms_eps, &mut self.token_in);
            } else {
                self.token_in.copy_from_slice(p);
            }
            if restarted {
                blocks[self.res.done * h..(self.res.done + 1) * h].copy_from_slice(p);
            }
            rmsnorm(&self.token_in, &layer.in_norm, c.rms_eps, xa);
        }
    }

    /// A layer's attention for the step's tokens: projections batched,
    /// each token's recurrence on its own sequence's state; outputs from
    /// token `first` into `chunk_ffn_out`.
    pub(super) fn attention(
        &mut self,
        m: &Model,
        l: usize,
        layer: &crate::weights::Layer,
        lanes: &mut [&mut Lane],
        nt: usize,
        first: usize,
    ) -> Result<()> {
        let (c, pool) = (m.config(), &m.pool);
        let (xs, outs) = (self.chunk_ffn_in.rows(0..nt), self.chunk_ffn_out.rows_mut(0..nt));
        match &layer.attn {
            Attn::Kda(w) => {
                let mut sts: Vec<&mut KdaState> = lanes.iter_mut().map(|ln| ln.states[l].kda()).collect();
                let sc = self.kda_sc.as_mut().expect("kda scratch");
                let kc = kda::KdaConfig { chunked: m.opts.kda_chunked, ..kda_config(c) };
                kda::chunk_states(pool, &kc, w, &mut sts, sc, xs, nt, first, outs);
            }
            Attn::Mla(w) => {
                let mut sts: Vec<&mut MlaState> = lanes.iter_mut().map(|ln| ln.states[l].mla()).collect();
                let sc = self.mla_sc.as_mut().expect("mla scratch");
                mla::chunk_states(pool, &mla_config(c, m.opts.ctx), w, &mut sts, sc, xs, nt, first, outs)
                    .map_err(|e| Error::ContextFull { pos: e.0, n: nt, ctx: m.opts.ctx })?;
            }
        }
        Ok(())
    }

    /// The attention residual and the FFN inputs of tokens `first..nt`.
    pub(super) fn ffn_inputs(
        &mut self,
        m: &Model,
        layer: &crate::weights::Layer,
        first: usize,
        nt: usize,
        restarted: bool,
    ) {
        let c = m.config();
        let h = c.hidden;
        for t in first..nt {
            let r = self.chunk_ffn_out.row(t);
            let xn_t = self.chunk_ffn_in.row_mut(t);
            if c.attn_res_block.is_none() {
                let hh = self.chunk_hidden.row_mut(t);
                add(hh, r);
                rmsnorm(hh, &layer.post_norm, c.rms_eps, xn_t);
                continue;
            }
            let res = layer.res.as_ref().expect("attn res weights");
            let p = self.res.prefix.row_mut(t);
            if restarted {
                p.copy_from_slice(r);
            } else {
                add(p, r);
            }
            let nbk = self.res.done + restarted as usize;
            attn_res(&self.res.blocks.row(t)[..nbk * h], h, p, &res.mlp, c.rms_eps, &mut self.token_in);
            rmsnorm(&self.token_in, &layer.post_norm, c.rms_eps, xn_t);
        }
    }

    /// The FFN residual of tokens `first..nt` into their hidden states.
    pub(super) fn ffn_residual(&mut self, c: &waste_format::ModelConfig, first: usize, nt: usize) {
        for t in first..nt {
            let r = self.chunk_ffn_out.row(t);
            if c.attn_res_block.is_some() {
                let p = self.res.prefix.row_mut(t);
                add(p, r);
                self.chunk_hidden.row_mut(t).copy_from_slice(p);
            } else {
                add(self.chunk_hidden.row_mut(t), r);
            }
        }
    }
}
