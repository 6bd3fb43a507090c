//! Multi-head latent attention for one token, absorbed decode over a latent
//! cache of `kv_lora + qk_rope` floats per position.

use waste_quant::ops::{rmsnorm, rmsnorm_inplace, sigmoid, softmax};
use waste_quant::{f32_matrix, MatJob, Matrix, Pool, SyncSlice};

/// Shape and constants of one MLA layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaConfig {
    /// Heads.
    pub heads: usize,
    /// No-position query/key dim.
    pub nope: usize,
    /// Shared rope-slot key dim.
    pub rope: usize,
    /// Value head dim.
    pub v: usize,
    /// Latent width.
    pub kv_lora: usize,
    /// Epsilon of `q_a_layernorm` / `kv_a_layernorm` (1e-6 in transformers).
    pub latent_eps: f32,
    /// Maximum positions (context bound).
    pub max_ctx: usize,
}

impl MlaConfig {
    /// Floats cached per position.
    pub fn latent(&self) -> usize {
        self.kv_lora + self.rope
    }
}

/// Query projection.
#[derive(Debug)]
pub enum MlaQuery {
    /// `q_proj`.
    Plain(Matrix),
    /// `q_b · RMSNorm(q_a · x)`.
    Lora {
        /// `[q_lora, hidden]`.
        a: Matrix,
        /// `[q_lora]`.
        norm: Vec<f32>,
        /// `[heads·(nope+rope), q_lora]`.
        b: Matrix,
    },
}

/// Weights of one MLA layer.
#[derive(Debug)]
pub struct MlaWeights {
    /// Query.
    pub q: MlaQuery,
    /// `[kv_lora + rope, hidden]`.
    pub kv_a: Matrix,
    /// `[kv_lora]`.
    pub kv_a_norm: Vec<f32>,
    /// `[heads·(nope+v), kv_lora]`.
    pub kv_b: Matrix,
    /// K3 output gate `[heads·v, hidden]`.
    pub g: Option<Matrix>,
    /// `[hidden, heads·v]`.
    pub o: Matrix,
}

/// The latent cache of one MLA layer.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaState {
    /// `[len][kv_lora + rope]`.
    pub cache: Vec<f32>,
    /// Positions cached.
    pub len: usize,
}

impl MlaState {
    /// Empty cache with room for `max_ctx` positions (allocated up front, so
    /// memory is what the plan says from the start).
    pub fn new(c: &MlaConfig) -> MlaState {
        MlaState { cache: vec![0.0; c.max_ctx * c.latent()], len: 0 }
    }
    /// Bytes for a context.
    pub fn bytes(c: &MlaConfig) -> usize {
        c.max_ctx * c.latent() * 4
    }
    /// Forget everything.
    pub fn reset(&mut self) {
        self.len = 0;
    }
}

/// Scratch for [`chunk`] (and [`step`]).
#[derive(Debug)]
pub struct MlaScratch {
    /// Most tokens per [`chunk`] call.
    tokens: usize,
    /// `[tokens][H·(nope+rope)]`.
    q: Vec<f32>,
    /// `[tokens][q_lora]`.
    qa: Vec<f32>,
    /// `[tokens][latent]`.
    c: Vec<f32>,
    qcat: Vec<f32>,
    scores: Vec<f32>,
    cbar: Vec<f32>,
    /// `[tokens][H·v]`.
    o: Vec<f32>,
    /// `[tokens][H·v]`.
    g: Vec<f32>,
}

impl MlaScratch {
    /// Buffers for at most `tokens` tokens per [`chunk`].
    pub fn new(c: &MlaConfig, q_lora: usize, tokens: usize) -> Self {
        let (h, t) = (c.heads, tokens.max(1));
        MlaScratch {
            tokens: t,
            q: vec![0.0; t * h * (c.nope + c.rope)],
            qa: vec![0.0; t * q_lora],
            c: vec![0.0; t * c.latent()],
            qcat: vec![0.0; h * c.latent()],
            scores: vec![0.0; h * c.max_ctx],
            cbar: vec![0.0; h * c.kv_lora],
            o: vec![0.0; t * h * c.v],
            g: vec![0.0; t * h * c.v],
        }
    }
    /// Bytes [`MlaScratch::new`] allocates (for memory plans).
    pub fn bytes(c: &MlaConfig, q_lora: usize, tokens: usize) -> usize {
        let (h, t) = (c.heads, tokens.max(1));
        4 * (t * (h * (c.nope + c.rope) + q_lora + c.latent() + 2 * h * c.v)
            + h * c.latent()
            + h * c.max_ctx
            + h * c.kv_lora)
    }
    /// Bytes allocated.
    pub fn allocated_bytes(&self) -> usize {
        4 * [&self.q, &self.qa, &self.c, &self.qcat, &self.scores, &self.cbar, &self.o, &self.g]
            .iter()
            .map(|v| v.capacity())
            .sum::<usize>()
    }
}

/// Error: the context is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextFull(pub usize);

/// One token through an MLA layer. Fails (leaving state untouched) when the
/// cache already holds `max_ctx` positions.
///
/// # Errors
/// [`ContextFull`] when the cache already holds `max_ctx` positions; the state is then unchanged.
pub fn step(
    pool: &Pool,
    c: &MlaConfig,
    w: &MlaWeights,
    st: &mut MlaState,
    sc: &mut MlaScratch,
    x: &[f32],
    out: &mut [f32],
) -> Result<(), ContextFull> {
    chunk(pool, c, w, st, sc, x, 1, 0, out)
}

/// `nt` consecutive tokens through an MLA layer (`xs`: `nt × hidden`,
/// normed; `outs`: `nt × hidden`). The projections read their weights once
/// for all tokens; each token attends over the cache up to itself.
/// Bit-identical to `nt` calls of [`step`]. Fails (leaving state untouched)
/// when the tokens do not fit in `max_ctx`. The cache takes every token;
/// the queries, the attention and the output projection run for tokens
/// `first..nt` only (a model's last layer, where only the last token's
/// output is read): the rows of `outs` below `first` are left as they were.
///
/// # Errors
/// [`ContextFull`] when the `nt` tokens do not fit in the cache; the state is then unchanged.
///
/// # Panics
/// When `xs`/`outs` are shorter than `nt` tokens of their widths, `nt`
/// exceeds the scratch's chunk size, or `first > nt`.
#[allow(clippy::too_many_arguments)]
pub fn chunk(
    pool: &Pool,
    c: &MlaConfig,
    w: &MlaWeights,
    st: &mut MlaState,
    sc: &mut MlaScratch,
    xs: &[f32],
    nt: usize,
    first: usize,
    outs: &mut [f32],
) -> Result<(), ContextFull> {
    chunk_states(pool, c, w, &mut [st], sc, xs, nt, first, outs)
}

/// [`chunk`] for the tokens of one sequence (`sts` holds its one state)
/// or of several (`sts` holds one state per token: token `t` is the next
/// token of the sequence whose state is `sts[t]` — a batched decode step).
/// The projections read their weights once for all `nt` tokens either
/// way; each token attends over its own sequence's cache, so every
/// sequence's outputs are bit-identical to [`step`] on it alone.
///
/// # Errors
/// [`ContextFull`] when some state's cache cannot take its tokens; every
/// state is then unchanged.
///
/// # Panics
/// As [`chunk`]; and when `sts` holds neither one state nor `nt`.
#[allow(clippy::too_many_arguments)]
pub fn chunk_states(
    pool: &Pool,
    c: &MlaConfig,
    w: &MlaWeights,
    sts: &mut [&mut MlaState],
    sc: &mut MlaScratch,
    xs: &[f32],
    nt: usize,
    first: usize,
    outs: &mut [f32],
) -> Result<(), ContextFull> {
    assert!(nt >= 1 && nt <= sc.tokens, "chunk of {nt} tokens, scratch for {}", sc.tokens);
    assert!(first <= nt, "outputs from token {first} of {nt}");
    assert!(sts.len() == 1 || sts.len() == nt, "{} states for a chunk of {nt} tokens", sts.len());
    let per_state = if sts.len() == 1 { nt } else { 1 };
    if sts.iter().any(|st| st.len + per_state > c.max_ctx) {
        return Err(ContextFull(c.max_ctx));
    }
    let (h, nope, rope, vd, kvl) = (c.heads, c.nope, c.rope, c.v, c.kv_lora);
    let lat = c.latent();
    let qd = nope + rope;
    // 1. queries (or their low-rank first half) of the tokens from `first`,
    // 2. latents of every token and 4. the output gate (K3) of the tokens
    // from `first`: what reads the input, in one pass of the pool
    let ho = h * vd;
    let hid = w.kv_a.cols;
    let (xq, nq) = (&xs[first * hid..nt * hid], nt - first);
    {
        let qv = match &w.q {
            MlaQuery::Plain(q) => q.view(),
            MlaQuery::Lora { a, .. } => a.view(),
        };
        let qout = match &w.q {
            MlaQuery::Plain(_) => &mut sc.q[first * h * qd..nt * h * qd],
            MlaQuery::Lora { a, .. } => &mut sc.qa[first * a.rows..nt * a.rows],
        };
        let (kv, gv) = (w.kv_a.view(), w.g.as_ref().map(|g| g.view()));
        let mut jobs = vec![MatJob { m: &qv, xs: xq, ys: qout }, MatJob { m: &kv, xs, ys: &mut sc.c[..nt * lat] }];
        if let Some(g) = &gv {
            jobs.push(MatJob { m: g, xs: xq, ys: &mut sc.g[first * ho..nt * ho] });
        }
        pool.matmats(&mut jobs);
    }
    if let (MlaQuery::Lora { a, norm, b }, 1..) = (&w.q, nq) {
        let r = a.rows;
        for t in first..nt {
            rmsnorm_inplace(&mut sc.qa[t * r..(t + 1) * r], norm, c.latent_eps);
        }
        pool.matmat(&b.view(), &sc.qa[first * r..nt * r], nq, &mut sc.q[first * h * qd..nt * h * qd]);
    }
    let scale = 1.0 / (qd as f32).sqrt();
    let kv_b = w.kv_b.view();
    let level = pool.level();
    for t in 0..nt {
        let st = &mut *sts[if sts.len() == 1 { 0 } else { t }];
        let pos = st.len;
        {
            let src = &sc.c[t * lat..(t + 1) * lat];
            let dst = &mut st.cache[pos * lat..(pos + 1) * lat];
            rmsnorm(&src[..kvl], &w.kv_a_norm, c.latent_eps, &mut dst[..kvl]);
            dst[kvl..].copy_from_slice(&src[kvl..]);
        }
        st.len += 1;
        if t < first {
            continue;
        }
        let n = st.len;
        let cache = f32_matrix(n, lat, &st.cache);
        let qcat = SyncSlice::new(&mut sc.qcat);
        let scores = SyncSlice::new(&mut sc.scores);
        let cbar = SyncSlice::new(&mut sc.cbar);
        let o = SyncSlice::new(&mut sc.o[t * h * vd..(t + 1) * h * vd]);
        let q = &sc.q[t * h * qd..(t + 1) * h * qd];
        let stc = &st.cache;
        // 3. per head: absorbed query, scores over the cache, softmax, latent mix, value
        pool.chunks(h, &|h0, h1| {
            for hh in h0..h1 {
                // SAFETY: head hh owns its slices of every scratch buffer.
                let (qc, sco, cb, oh) = unsafe {
                    (
                        qcat.range(hh * lat, (hh + 1) * lat),
                        scores.range(hh * c.max_ctx, hh * c.max_ctx + n),
                        cbar.range(hh * kvl, (hh + 1) * kvl),
                        o.range(hh * vd, (hh + 1) * vd),
                    )
                };
                let qh = &q[hh * qd..(hh + 1) * qd];
                // q̃ = W_kb,hᵀ q_nope (the weights decoded in registers at AVX-512)
                qc[..kvl].fill(0.0);
                kv_b.rows_axpy(level, hh * (nope + vd), &qh[..nope], &mut qc[..kvl]);
                qc[kvl..].copy_from_slice(&qh[nope..]);
                cache.matvec_rows(level, qc, 0, sco);
                for s in sco.iter_mut() {
                    *s *= scale;
                }
                softmax(sco);
                cb.fill(0.0);
                for (s, &a) in sco.iter().enumerate() {
                    waste_quant::ops::axpy_at(level, a, &st_row(stc, s, lat)[..kvl], cb);
                }
                kv_b.matvec_rows(level, cb, hh * (nope + vd) + nope, oh);
            }
        });
    }
    // 4. output gate (K3), 5. output projection: the tokens from `first` at once
    if w.g.is_some() {
        for (oi, gi) in sc.o[first * ho..nt * ho].iter_mut().zip(&sc.g[first * ho..nt * ho]) {
            *oi *= sigmoid(*gi);
        }
    }
    if nq > 0 {
        let ow = w.o.rows;
        pool.matmat(&w.o.view(), &sc.o[first * ho..nt * ho], nq, &mut outs[first * ow..nt * ow]);
    }
    Ok(())
}

#[inline]
fn st_row(cache: &[f32], s: usize, lat: usize) -> &[f32] {
    &cache[s * lat..(s + 1) * lat]
}
