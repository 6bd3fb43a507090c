//! The attention block of a step: the attention inputs (the hidden state
//! or K3's Attention Residuals mix, normed), KDA or MLA over the step's
//! tokens on each sequence's state, and the residuals around it into the
//! FFN's inputs and back into the hidden state.

use super::*;

impl Work {
    /// The attention inputs of a layer for every token (they depend on
    /// earlier layers only): the AttnRes mix (and a block boundary's copy)
    /// or the hidden state, normed into `chunk_ffn_in`.
    pub(super) fn attn_inputs(&mut self, m: &Model, layer: &crate::weights::Layer, nt: usize, restarted: bool) {
        let c = m.config();
        let (h, nb) = (c.hidden, self.res_blocks);
        for t in 0..nt {
            let hh = &mut self.chunk_hidden[t * h..(t + 1) * h];
            let xa = &mut self.chunk_ffn_in[t * h..(t + 1) * h];
            if c.attn_res_block.is_none() {
                rmsnorm(hh, &layer.in_norm, c.rms_eps, xa);
                continue;
            }
            let res = layer.res.as_ref().expect("attn res weights");
            let p = &mut self.chunk_prefix[t * h..(t + 1) * h];
            let blocks = &mut self.blocks[t * nb * h..(t + 1) * nb * h];
            p.copy_from_slice(hh);
            if self.nblocks > 0 {
                attn_res(&blocks[..self.nblocks * h], h, p, &res.attn, c.rms_eps, &mut self.token_in);
            } else {
                self.token_in.copy_from_slice(p);
            }
            if restarted {
                blocks[self.nblocks * h..(self.nblocks + 1) * h].copy_from_slice(p);
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
        let (h, nb) = (c.hidden, self.res_blocks);
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
            let p = &mut self.chunk_prefix[t * h..(t + 1) * h];
            if restarted {
                p.copy_from_slice(r);
            } else {
                add(p, r);
            }
            let nbk = self.nblocks + restarted as usize;
            attn_res(&self.blocks[t * nb * h..t * nb * h + nbk * h], h, p, &res.mlp, c.rms_eps, &mut self.token_in);
            rmsnorm(&self.token_in, &layer.post_norm, c.rms_eps, xn_t);
        }
    }

    /// The FFN residual of tokens `first..nt` into their hidden states.
    pub(super) fn ffn_residual(&mut self, c: &waste_format::ModelConfig, first: usize, nt: usize) {
        let h = c.hidden;
        for t in first..nt {
            let r = &self.chunk_ffn_out[t * h..(t + 1) * h];
            if c.attn_res_block.is_some() {
                let p = &mut self.chunk_prefix[t * h..(t + 1) * h];
                add(p, r);
                self.chunk_hidden[t * h..(t + 1) * h].copy_from_slice(p);
            } else {
                add(&mut self.chunk_hidden[t * h..(t + 1) * h], r);
            }
        }
    }
}
