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
    /// block boundary), `CHUNK × hidden`.
    pub(super) prefix: Vec<f32>,
    /// Each chunk token's finished blocks, `CHUNK × per_token × hidden`.
    pub(super) blocks: Vec<f32>,
    /// Blocks finished so far in this token's pass.
    pub(super) done: usize,
    /// Blocks per token (layers / block size; 0 without AttnRes).
    pub(super) per_token: usize,
    /// The last token's hidden state, kept for the output aggregation.
    pub(super) out_copy: Vec<f32>,
}

impl ResScratch {
    /// Blocks per token and the buffers' f32 lengths (prefix, blocks, out copy).
    fn lens(c: &waste_format::ModelConfig) -> (usize, [usize; 3]) {
        let (h, nb) = (c.hidden, c.attn_res_block.map_or(0, |b| c.layers.div_ceil(b)));
        let on = usize::from(nb > 0);
        (nb, [on * CHUNK * h, CHUNK * nb * h, on * h])
    }
    /// The buffers for a config.
    pub(super) fn new(c: &waste_format::ModelConfig) -> ResScratch {
        let (per_token, lens) = Self::lens(c);
        let [prefix, blocks, out_copy] = lens.map(|n| vec![0f32; n]);
        ResScratch { prefix, blocks, done: 0, per_token, out_copy }
    }
    /// Their f32s for a config (the plan's count).
    pub(super) fn floats(c: &waste_format::ModelConfig) -> usize {
        Self::lens(c).1.iter().sum()
    }
    /// Bytes allocated (capacities).
    pub(super) fn allocated_bytes(&self) -> u64 {
        [&self.prefix, &self.blocks, &self.out_copy].iter().map(|b| 4 * b.capacity() as u64).sum()
    }
}

impl Work {
    /// The attention inputs of a layer for every token (they depend on
    /// earlier layers only): the AttnRes mix (and a block boundary's copy)
    /// or the hidden state, normed into `chunk_ffn_in`.
    pub(super) fn attn_inputs(&mut self, m: &Model, layer: &crate::weights::Layer, nt: usize, restarted: bool) {
        let c = m.config();
        let (h, nb) = (c.hidden, self.res.per_token);
        for t in 0..nt {
            let hh = &mut self.chunk_hidden[t * h..(t + 1) * h];
            let xa = &mut self.chunk_ffn_in[t * h..(t + 1) * h];
            if c.attn_res_block.is_none() {
                rmsnorm(hh, &layer.in_norm, c.rms_eps, xa);
                continue;
            }
            let res = layer.res.as_ref().expect("attn res weights");
            let p = &mut self.res.prefix[t * h..(t + 1) * h];
            let blocks = &mut self.res.blocks[t * nb * h..(t + 1) * nb * h];
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
        let (c, pool, h) = (m.config(), &m.pool, m.config().hidden);
        let (xs, outs) = (&self.chunk_ffn_in[..nt * h], &mut self.chunk_ffn_out[..nt * h]);
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
        let (h, nb) = (c.hidden, self.res.per_token);
        for t in first..nt {
            let r = &self.chunk_ffn_out[t * h..(t + 1) * h];
            let xn_t = &mut self.chunk_ffn_in[t * h..(t + 1) * h];
            if c.attn_res_block.is_none() {
                let hh = &mut self.chunk_hidden[t * h..(t + 1) * h];
                add(hh, r);
                rmsnorm(hh, &layer.post_norm, c.rms_eps, xn_t);
                continue;
            }
            let res = layer.res.as_ref().expect("attn res weights");
            let p = &mut self.res.prefix[t * h..(t + 1) * h];
            if restarted {
                p.copy_from_slice(r);
            } else {
                add(p, r);
            }
            let nbk = self.res.done + restarted as usize;
            attn_res(&self.res.blocks[t * nb * h..t * nb * h + nbk * h], h, p, &res.mlp, c.rms_eps, &mut self.token_in);
            rmsnorm(&self.token_in, &layer.post_norm, c.rms_eps, xn_t);
        }
    }

    /// The FFN residual of tokens `first..nt` into their hidden states.
    pub(super) fn ffn_residual(&mut self, c: &waste_format::ModelConfig, first: usize, nt: usize) {
        let h = c.hidden;
        for t in first..nt {
            let r = &self.chunk_ffn_out[t * h..(t + 1) * h];
            if c.attn_res_block.is_some() {
                let p = &mut self.res.prefix[t * h..(t + 1) * h];
                add(p, r);
                self.chunk_hidden[t * h..(t + 1) * h].copy_from_slice(p);
            } else {
                add(&mut self.chunk_hidden[t * h..(t + 1) * h], r);
            }
        }
    }
}
