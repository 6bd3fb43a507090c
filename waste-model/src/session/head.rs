//! The head of a step: the output aggregation (AttnRes), the final norm
//! and the LM head for the tokens that want logits — resident, or streamed
//! from disk in pieces below the floor.

use super::*;

impl Work {
    /// The output aggregation (AttnRes), the final norm and the LM head for
    /// the `wanted` tokens, into their lanes' logits: one matvec for one
    /// sequence, one pass over the head for a batched step's tokens.
    pub(super) fn head(
        &mut self,
        m: &Model,
        lanes: &mut [&mut Lane],
        shape: Shape,
        wanted: std::ops::Range<usize>,
    ) -> Result<()> {
        let c = m.config();
        let h = c.hidden;
        for t in wanted.clone() {
            if let Some(w) = &m.out_res {
                // alias-safe: the live candidate is a copy, the output the state itself
                self.res.out_copy.copy_from_slice(self.chunk_hidden.row(t));
                let blocks = &self.res.blocks.row(t)[..self.res.done * h];
                attn_res(blocks, h, &self.res.out_copy, w, c.rms_eps, self.chunk_hidden.row_mut(t));
            }
            let normed = match shape {
                Shape::One { .. } => &mut self.head_in[..],
                Shape::Batch => self.chunk_ffn_in.row_mut(t),
            };
            rmsnorm(self.chunk_hidden.row(t), &m.final_norm, c.rms_eps, normed);
        }
        let nt = wanted.len();
        if nt == 0 {
            return Ok(());
        }
        match &m.head {
            crate::model::Head::Resident(w) => self.head_rows(m, &w.view(), 0, lanes, shape, nt),
            crate::model::Head::Streamed(rows) => self.streamed_head(m, rows, lanes, shape, nt)?,
        }
        Ok(())
    }

    /// The logits of head rows `r0..r0 + w.rows` for the step's `nt`
    /// wanted tokens (normed in `head_in`, or `chunk_ffn_in` for a batch).
    fn head_rows(
        &mut self,
        m: &Model,
        w: &waste_quant::MatRef<'_>,
        r0: usize,
        lanes: &mut [&mut Lane],
        shape: Shape,
        nt: usize,
    ) {
        let n = w.rows;
        match shape {
            Shape::One { .. } => m.pool.matvec(w, &self.head_in, &mut lanes[0].logits[r0..r0 + n]),
            Shape::Batch => {
                if self.batch_logits.len() < nt * n {
                    self.batch_logits.resize(nt * n, 0.0);
                }
                let out = &mut self.batch_logits[..nt * n];
                m.pool.matmat(w, self.chunk_ffn_in.rows(0..nt), nt, out);
                for (ln, row) in lanes.iter_mut().zip(out.chunks_exact(n)) {
                    ln.logits[r0..r0 + n].copy_from_slice(row);
                }
            }
        }
    }

    /// The head read from disk in pieces of whole rows (at most
    /// [`crate::plan::head_piece_bytes`]), the next piece read on a loader
    /// thread while this one computes: each row's logit as the resident
    /// head computes it.
    fn streamed_head(
        &mut self,
        m: &Model,
        rows: &crate::weights::TensorRows,
        lanes: &mut [&mut Lane],
        shape: Shape,
        nt: usize,
    ) -> Result<()> {
        let total = rows.rows();
        let rb = rows.row_bytes().max(1);
        let per = (crate::plan::head_piece_bytes(rb * total as u64) / rb).max(1) as usize;
        std::thread::scope(|s| -> Result<()> {
            let load = |r0: usize| loader(s, "head", move || rows.read(r0, per.min(total - r0)));
            let mut ahead = Some(load(0)?);
            let mut r0 = 0;
            while let Some(h) = ahead.take() {
                let piece = self.arrived(h)?;
                self.stats.trunk_bytes_read += piece.rows as u64 * rows.row_bytes();
                if r0 + piece.rows < total {
                    ahead = Some(load(r0 + piece.rows)?);
                }
                self.head_rows(m, &piece.view(), r0, lanes, shape, nt);
                r0 += piece.rows;
            }
            Ok(())
        })
    }
}
