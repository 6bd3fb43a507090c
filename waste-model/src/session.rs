//! `Session`: one conversation's state and the forward pass.

use crate::model::Model;
use crate::weights::{kda_config, mla_config, router_config, Attn, Ffn};
use crate::{Error, Result};
use std::time::Instant;
use waste_attn::{kda, mla, KdaScratch, KdaState, MlaScratch, MlaState};
use waste_format::check_record;
use waste_io::AlignedBuf;
use waste_moe::{route, ExpertScratch};
use waste_quant::ops::{rmsnorm, rmsnorm_inplace, rms_scale, softmax};

/// Counters of expert traffic and time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stats {
    /// Tokens evaluated.
    pub tokens: u64,
    /// Expert uses served from memory.
    pub experts_hit: u64,
    /// Expert uses that needed a read.
    pub experts_missed: u64,
    /// Bytes read from expert banks.
    pub bytes_read: u64,
    /// Seconds waiting for expert reads.
    pub io_seconds: f64,
    /// Seconds in the trunk outside attention (norms, dense FFN, router, shared experts, head).
    pub trunk_seconds: f64,
    /// Seconds in attention (KDA and MLA).
    pub attn_seconds: f64,
    /// Seconds computing routed experts.
    pub expert_seconds: f64,
}

/// Per-layer state.
enum LayerState {
    Kda(KdaState),
    Mla(MlaState),
}

/// One sequence being evaluated.
pub struct Session<'m> {
    m: &'m Model,
    pos: usize,
    states: Vec<LayerState>,
    kda_sc: Option<KdaScratch>,
    mla_sc: Option<MlaScratch>,
    ex_sc: Option<ExpertScratch>,
    h: Vec<f32>,
    x: Vec<f32>,
    xn: Vec<f32>,
    r: Vec<f32>,
    p: Vec<f32>,
    blocks: Vec<Vec<f32>>,
    router: Vec<f32>,
    chosen: Vec<(usize, f32)>,
    lat_in: Vec<f32>,
    lat_sum: Vec<f32>,
    eout: Vec<f32>,
    ffn_tmp: Vec<f32>,
    rec: Option<AlignedBuf>,
    logits: Vec<f32>,
    stats: Stats,
}

impl<'m> Session<'m> {
    pub(crate) fn new(m: &'m Model) -> Session<'m> {
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
        let h = c.hidden;
        let lat = c.expert_width();
        let ffn_w = c.intermediate.max(c.moe_intermediate * c.shared_experts);
        Session {
            m,
            pos: 0,
            states,
            kda_sc: has_kda.then(|| KdaScratch::new(&kc)),
            mla_sc: has_mla.then(|| MlaScratch::new(&mc, c.q_lora.unwrap_or(0))),
            ex_sc: m.kernel.as_ref().map(|k| k.scratch()),
            h: vec![0.0; h],
            x: vec![0.0; h],
            xn: vec![0.0; h],
            r: vec![0.0; h],
            p: vec![0.0; h],
            blocks: Vec::new(),
            router: vec![0.0; c.experts],
            chosen: Vec::with_capacity(c.top_k),
            lat_in: vec![0.0; lat],
            lat_sum: vec![0.0; lat],
            eout: vec![0.0; lat],
            ffn_tmp: vec![0.0; 2 * ffn_w],
            rec: m.kernel.as_ref().map(|k| AlignedBuf::new(k.lay.rec_bytes, true)),
            logits: vec![0.0; c.vocab],
            stats: Stats::default(),
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
    /// Forget everything: position 0, zero states.
    pub fn reset(&mut self) {
        self.pos = 0;
        for s in &mut self.states {
            match s {
                LayerState::Kda(k) => k.reset(),
                LayerState::Mla(m) => m.reset(),
            }
        }
        self.stats = Stats::default();
    }

    /// Evaluate `tokens` (prefill or a single step) and return the logits of
    /// the last one. The context bound is checked before any state changes.
    pub fn eval(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        if tokens.is_empty() {
            return Err(Error::Arg("eval needs at least one token".into()));
        }
        let ctx = self.m.opts.ctx;
        if self.pos + tokens.len() > ctx {
            return Err(Error::Arg(format!("context full: {} + {} tokens exceed ctx {ctx}", self.pos, tokens.len())));
        }
        let vocab = self.m.embed.rows();
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Arg(format!("token id {t} is outside the vocabulary (0..{vocab})")));
        }
        for (i, &t) in tokens.iter().enumerate() {
            self.forward(t, i + 1 == tokens.len())?;
        }
        Ok(&self.logits)
    }

    /// Logits of the last evaluated token.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    fn forward(&mut self, tok: u32, want_logits: bool) -> Result<()> {
        let m = self.m;
        let c = m.config();
        let pool = &m.pool;
        let t0 = Instant::now();
        let (io0, ex0, at0) = (self.stats.io_seconds, self.stats.expert_seconds, self.stats.attn_seconds);
        m.embed.row(tok, &mut self.h)?;
        let ar = c.attn_res_block;
        self.blocks.clear();
        for (l, layer) in m.layers.iter().enumerate() {
            // --- attention (with Attention Residuals on K3)
            let mut restarted = false;
            if let Some(bsz) = ar {
                self.p.copy_from_slice(&self.h);
                let w = &layer.res.as_ref().expect("attn res weights").attn;
                if !self.blocks.is_empty() {
                    attn_res(&self.blocks, &self.p, w, c.rms_eps, &mut self.x);
                } else {
                    self.x.copy_from_slice(&self.p);
                }
                if l % bsz == 0 {
                    self.blocks.push(self.p.clone());
                    restarted = true;
                }
                rmsnorm(&self.x, &layer.in_norm, c.rms_eps, &mut self.xn);
            } else {
                rmsnorm(&self.h, &layer.in_norm, c.rms_eps, &mut self.xn);
            }
            let ta = Instant::now();
            match (&layer.attn, &mut self.states[l]) {
                (Attn::Kda(w), LayerState::Kda(st)) => {
                    let sc = self.kda_sc.as_mut().expect("kda scratch");
                    kda::step(pool, &kda_config(c), w, st, sc, &self.xn, &mut self.r);
                }
                (Attn::Mla(w), LayerState::Mla(st)) => {
                    let sc = self.mla_sc.as_mut().expect("mla scratch");
                    mla::step(pool, &mla_config(c, m.opts.ctx), w, st, sc, &self.xn, &mut self.r).map_err(|e| Error::Arg(format!("context full at {} tokens", e.0)))?;
                }
                _ => unreachable!("layer state matches its kind"),
            }
            self.stats.attn_seconds += ta.elapsed().as_secs_f64();
            // --- FFN
            if ar.is_some() {
                if restarted {
                    self.p.copy_from_slice(&self.r);
                } else {
                    add(&mut self.p, &self.r);
                }
                let w = &layer.res.as_ref().expect("attn res weights").mlp;
                attn_res(&self.blocks, &self.p, w, c.rms_eps, &mut self.x);
                rmsnorm(&self.x, &layer.post_norm, c.rms_eps, &mut self.xn);
            } else {
                add(&mut self.h, &self.r);
                rmsnorm(&self.h, &layer.post_norm, c.rms_eps, &mut self.xn);
            }
            match &layer.ffn {
                Ffn::Dense(d) => d.forward(pool, c.activation, &self.xn, &mut self.ffn_tmp, &mut self.r),
                Ffn::Moe(w) => self.moe(l, w)?,
            }
            if ar.is_some() {
                add(&mut self.p, &self.r);
                self.h.copy_from_slice(&self.p);
            } else {
                add(&mut self.h, &self.r);
            }
        }
        if let Some(w) = &m.out_res {
            let hcopy = self.h.clone();
            attn_res(&self.blocks, &hcopy, w, c.rms_eps, &mut self.h);
        }
        if want_logits {
            rmsnorm(&self.h, &m.final_norm, c.rms_eps, &mut self.xn);
            pool.matvec(&m.lm_head.view(), &self.xn, &mut self.logits);
        }
        self.pos += 1;
        self.stats.tokens += 1;
        let spent = t0.elapsed().as_secs_f64() - (self.stats.io_seconds - io0) - (self.stats.expert_seconds - ex0) - (self.stats.attn_seconds - at0);
        self.stats.trunk_seconds += spent;
        Ok(())
    }

    fn moe(&mut self, l: usize, w: &crate::weights::MoeWeights) -> Result<()> {
        let m = self.m;
        let c = m.config();
        let pool = &m.pool;
        pool.matvec(&w.gate.view(), &self.xn, &mut self.router);
        route(&router_config(c), &self.router, &w.bias, &mut self.chosen);
        // experts run on the latent h (K3) or on x itself
        match &w.latent {
            Some((down, _, _)) => pool.matvec(&down.view(), &self.xn, &mut self.lat_in),
            None => self.lat_in.copy_from_slice(&self.xn),
        }
        let kernel = m.kernel.as_ref().expect("MoE layer has an expert kernel");
        let sc = self.ex_sc.as_mut().expect("expert scratch");
        let te = Instant::now();
        kernel.prepare(pool, &w.books, &self.lat_in, sc);
        self.stats.expert_seconds += te.elapsed().as_secs_f64();
        self.lat_sum.fill(0.0);
        // ascending expert id, as the reference accumulates
        let mut order: Vec<(usize, f32)> = self.chosen.clone();
        order.sort_by_key(|e| e.0);
        let bank = m.banks[l].as_ref().expect("bank for MoE layer");
        let binfo = m.container.banks[l].as_ref().expect("bank info");
        let rec = self.rec.as_mut().expect("record buffer");
        for (e, wgt) in order {
            let ti = Instant::now();
            bank.read_exact_at(rec, binfo.record_offset(e, &kernel.lay))?;
            check_record(rec, l, e, &kernel.lay, binfo.codebook_base, m.container.codebooks.count, m.opts.verify_records)?;
            self.stats.io_seconds += ti.elapsed().as_secs_f64();
            self.stats.experts_missed += 1;
            self.stats.bytes_read += kernel.lay.rec_bytes as u64;
            let te = Instant::now();
            kernel.forward(pool, &w.books, rec, &self.lat_in, sc, &mut self.eout);
            for (s, &v) in self.lat_sum.iter_mut().zip(&self.eout) {
                *s += v * wgt;
            }
            self.stats.expert_seconds += te.elapsed().as_secs_f64();
        }
        match &w.latent {
            Some((_, up, norm)) => {
                if let Some(n) = norm {
                    rmsnorm_inplace(&mut self.lat_sum, n, c.rms_eps);
                }
                pool.matvec(&up.view(), &self.lat_sum, &mut self.r);
            }
            None => self.r.copy_from_slice(&self.lat_sum),
        }
        if let Some(sh) = &w.shared {
            let mut tmp = std::mem::take(&mut self.eout);
            tmp.resize(c.hidden.max(tmp.len()), 0.0);
            sh.forward(pool, c.activation, &self.xn, &mut self.ffn_tmp, &mut tmp[..c.hidden]);
            add(&mut self.r, &tmp[..c.hidden]);
            tmp.truncate(c.expert_width());
            self.eout = tmp;
        }
        Ok(())
    }
}

fn add(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// Attention Residuals: softmax over candidates (`blocks` then `p`) of
/// `rsqrt(mean v² + eps) · Σ v ⊙ w`, returning the mix of the raw
/// candidates. `out` may not alias the inputs (callers copy first).
pub fn attn_res(blocks: &[Vec<f32>], p: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = blocks.len() + 1;
    let cand = |i: usize| if i < blocks.len() { &blocks[i][..] } else { p };
    let mut scores: Vec<f32> = (0..n)
        .map(|i| {
            let v = cand(i);
            let r = rms_scale(v, eps);
            v.iter().zip(w).map(|(a, b)| a * r * b).sum()
        })
        .collect();
    softmax(&mut scores);
    out.fill(0.0);
    for (i, a) in scores.iter().enumerate() {
        waste_quant::ops::axpy(*a, cand(i), out);
    }
}
