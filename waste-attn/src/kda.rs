//! Kimi Delta Attention for one token.

use waste_quant::ops::{rmsnorm_inplace, sigmoid, silu, softplus};
use waste_quant::{MatJob, Matrix, Pool};

/// Shape and constants of one KDA layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KdaConfig {
    /// Heads `H`.
    pub heads: usize,
    /// Head dim `D` (K = V).
    pub dim: usize,
    /// Short conv kernel.
    pub kernel: usize,
    /// `rms_norm_eps` (gated output norm).
    pub eps: f32,
    /// K3 bounded decay: `lower_bound · σ(exp(A_log)·z)`; None = Kimi-Linear softplus form.
    pub lower_bound: Option<f32>,
    /// Run a chunk of several tokens in the chunked (WY) form
    /// ([`head_chunk`]): the state is read twice per chunk instead of twice
    /// per token, at the price of a different order of sums — within
    /// [`CHUNKED_REL_TOL`] of the token-by-token form, not bit-identical, so
    /// off by default (placement then never changes the logits).
    pub chunked: bool,
}

/// The stated bound of the chunked form against the token-by-token one:
/// every output and state element within this times the largest magnitude
/// of its buffer (tested on random chunks, `tests::chunked_form_is_within_its_bound`).
pub const CHUNKED_REL_TOL: f32 = 1e-5;

impl KdaConfig {
    /// Channels `H·D`.
    pub fn channels(&self) -> usize {
        self.heads * self.dim
    }
}

/// The output gate.
#[derive(Debug)]
pub enum KdaGate {
    /// Kimi-Linear: `g_b · (g_a · x)`.
    LowRank {
        /// `[D, hidden]`.
        a: Matrix,
        /// `[C, D]`.
        b: Matrix,
    },
    /// K3: `g_proj · x`.
    Full(Matrix),
}

/// Weights of one KDA layer.
#[derive(Debug)]
pub struct KdaWeights {
    /// `[C, hidden]`.
    pub q: Matrix,
    /// `[C, hidden]`.
    pub k: Matrix,
    /// `[C, hidden]`.
    pub v: Matrix,
    /// Conv taps `[3][C][kernel]` (q, k, v), taps contiguous, newest last.
    pub conv: [Vec<f32>; 3],
    /// `[D, hidden]`.
    pub f_a: Matrix,
    /// `[C, D]`.
    pub f_b: Matrix,
    /// `[H, hidden]`.
    pub b: Matrix,
    /// Per head (first H values of the stored tensor).
    pub a_log: Vec<f32>,
    /// `[C]`.
    pub dt_bias: Vec<f32>,
    /// Output gate.
    pub gate: KdaGate,
    /// `[D]`, shared by heads.
    pub o_norm: Vec<f32>,
    /// `[hidden, C]`.
    pub o: Matrix,
}

/// Recurrent state of one KDA layer: conv rings and the per-head `D×D` state.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaState {
    /// `[kernel-1][3C]`: the last inputs, oldest first.
    pub conv: Vec<f32>,
    /// `[H][D (key)][D (value)]`.
    pub s: Vec<f32>,
}

/// `n` zeros written to memory, not left to the allocator's lazily zeroed
/// pages. The delta rule reads the state before it writes it: a fresh page
/// first read maps the shared zero page, so its first write faults a second
/// time and flushes the other threads' TLBs (an inter-processor interrupt
/// each, slow on a VM), while the pool's threads contend for the page-table
/// lock — a process's first prefill spent 15 % of its samples there, and its
/// attention took 1.7× what it takes since (docs/lab/2026-12-03-42-matmat-tiles-that-prefetch-where-a-first-prefill-s.md, eighteenth
/// session). Written here, each page is faulted once, writable, by the
/// thread making the state.
///
/// One pass of writes either way: a fresh mapping is faulted in by them, a
/// reused block is cleared by them (a zeroed allocation would clear it, and
/// a fill after it would write it twice).
fn written_zeros(n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    // hidden from the optimizer, so it cannot fold the allocation and the
    // writes into one lazily zeroed allocation
    std::hint::black_box(&mut v);
    v.resize(n, 0.0);
    v
}

impl KdaState {
    /// Zero state, its pages written now (not lazily zeroed: the delta rule
    /// reads the state before it writes it, and a lazily zeroed page read
    /// first faults twice and flushes the other threads' TLBs).
    pub fn new(c: &KdaConfig) -> KdaState {
        KdaState { conv: written_zeros((c.kernel - 1) * 3 * c.channels()), s: written_zeros(c.heads * c.dim * c.dim) }
    }
    /// Bytes of state.
    pub fn bytes(c: &KdaConfig) -> usize {
        ((c.kernel - 1) * 3 * c.channels() + c.heads * c.dim * c.dim) * 4
    }
    /// Reset to zero.
    pub fn reset(&mut self) {
        self.conv.fill(0.0);
        self.s.fill(0.0);
    }
}

/// Scratch buffers for [`chunk`] (and [`step`]).
#[derive(Debug)]
pub struct KdaScratch {
    /// Most tokens per [`chunk`] call.
    tokens: usize,
    /// `[3][tokens][C]`: q, k, v projections of every token.
    proj: Vec<f32>,
    conv_out: Vec<f32>,
    /// `[tokens][D]`: the decay's low-rank intermediates.
    lo: Vec<f32>,
    /// `[tokens][D]`: the output gate's low-rank intermediates.
    lo_g: Vec<f32>,
    /// `[tokens][C]`: decay pre-activations, then log-decays.
    z: Vec<f32>,
    /// `[tokens][H]`.
    beta: Vec<f32>,
    /// `[tokens][C]`: output gate pre-activations.
    gate: Vec<f32>,
    /// `[tokens][C]`: gated, normed outputs.
    o: Vec<f32>,
}

impl KdaScratch {
    /// Buffers for a config and at most `tokens` tokens per [`chunk`].
    pub fn new(c: &KdaConfig, tokens: usize) -> Self {
        let (ch, t) = (c.channels(), tokens.max(1));
        KdaScratch {
            tokens: t,
            proj: vec![0.0; 3 * t * ch],
            conv_out: vec![0.0; 3 * ch],
            lo: vec![0.0; t * c.dim],
            lo_g: vec![0.0; t * c.dim],
            z: vec![0.0; t * ch],
            beta: vec![0.0; t * c.heads],
            gate: vec![0.0; t * ch],
            o: vec![0.0; t * ch],
        }
    }
    /// Bytes [`KdaScratch::new`] allocates (for memory plans).
    pub fn bytes(c: &KdaConfig, tokens: usize) -> usize {
        let (ch, t) = (c.channels(), tokens.max(1));
        4 * (3 * t * ch + 3 * ch + 2 * t * c.dim + 3 * t * ch + t * c.heads)
    }
    /// Bytes allocated.
    pub fn allocated_bytes(&self) -> usize {
        4 * [&self.proj, &self.conv_out, &self.lo, &self.lo_g, &self.z, &self.beta, &self.gate, &self.o]
            .iter()
            .map(|v| v.capacity())
            .sum::<usize>()
    }
}

/// One token through a KDA layer: `out = KDA(x)` (x already normed).
pub fn step(
    pool: &Pool,
    c: &KdaConfig,
    w: &KdaWeights,
    st: &mut KdaState,
    sc: &mut KdaScratch,
    x: &[f32],
    out: &mut [f32],
) {
    chunk(pool, c, w, st, sc, x, 1, 0, out);
}

/// `nt` consecutive tokens through a KDA layer (`xs`: `nt × hidden`, already
/// normed; `outs`: `nt × hidden`). Every projection reads its weights once
/// for all `nt` tokens; the conv and the delta rule run token after token.
/// Bit-identical to `nt` calls of [`step`]. The state takes every token;
/// the output projection runs for tokens `first..nt` only (a model's last
/// layer, where only the last token's output is read): the rows of `outs`
/// below `first` are left as they were.
///
/// # Panics
/// When `xs`/`outs` are shorter than `nt` tokens of their widths, `nt`
/// exceeds the scratch's chunk size, or `first > nt`.
#[allow(clippy::too_many_arguments)]
pub fn chunk(
    pool: &Pool,
    c: &KdaConfig,
    w: &KdaWeights,
    st: &mut KdaState,
    sc: &mut KdaScratch,
    xs: &[f32],
    nt: usize,
    first: usize,
    outs: &mut [f32],
) {
    chunk_states(pool, c, w, &mut [st], sc, xs, nt, first, outs)
}

/// [`chunk`] for the tokens of one sequence (`sts` holds its one state)
/// or of several (`sts` holds one state per token: token `t` is the next
/// token of the sequence whose state is `sts[t]` — a batched decode step).
/// The projections read their weights once for all `nt` tokens either
/// way; each token's recurrence advances its own state, so every
/// sequence's outputs are bit-identical to [`step`] on it alone. The
/// chunked (WY) form applies to one sequence only.
///
/// # Panics
/// As [`chunk`]; and when `sts` holds neither one state nor `nt`.
#[allow(clippy::too_many_arguments)]
pub fn chunk_states(
    pool: &Pool,
    c: &KdaConfig,
    w: &KdaWeights,
    sts: &mut [&mut KdaState],
    sc: &mut KdaScratch,
    xs: &[f32],
    nt: usize,
    first: usize,
    outs: &mut [f32],
) {
    let ch = c.channels();
    let (d, h, k) = (c.dim, c.heads, c.kernel);
    assert!(nt >= 1 && nt <= sc.tokens, "chunk of {nt} tokens, scratch for {}", sc.tokens);
    assert!(sts.len() == 1 || sts.len() == nt, "{} states for a chunk of {nt} tokens", sts.len());
    assert!(first <= nt, "outputs from token {first} of {nt}");
    // 1. q/k/v, 3. decay pre-activations, 4. beta, 6. output gate of every
    // token: everything that reads the input in one pass of the pool, then
    // the two low-rank second halves in another
    {
        let (q, rest) = sc.proj.split_at_mut(sc.tokens * ch);
        let (kp, v) = rest.split_at_mut(sc.tokens * ch);
        let dl = w.f_a.rows;
        let views = [w.q.view(), w.k.view(), w.v.view(), w.f_a.view(), w.b.view()];
        let [vq, vk, vv, vfa, vb] = &views;
        let mut jobs = vec![
            MatJob { m: vq, xs, ys: &mut q[..nt * ch] },
            MatJob { m: vk, xs, ys: &mut kp[..nt * ch] },
            MatJob { m: vv, xs, ys: &mut v[..nt * ch] },
            MatJob { m: vfa, xs, ys: &mut sc.lo[..nt * dl] },
            MatJob { m: vb, xs, ys: &mut sc.beta[..nt * h] },
        ];
        let gv = match &w.gate {
            KdaGate::LowRank { a, b } => (a.view(), Some(b.view())),
            KdaGate::Full(g) => (g.view(), None),
        };
        let gout = match gv.1 {
            Some(_) => &mut sc.lo_g[..nt * gv.0.rows],
            None => &mut sc.gate[..nt * ch],
        };
        jobs.push(MatJob { m: &gv.0, xs, ys: gout });
        pool.matmats(&mut jobs);
        let vfb = w.f_b.view();
        let mut second = vec![MatJob { m: &vfb, xs: &sc.lo[..nt * dl], ys: &mut sc.z[..nt * ch] }];
        if let Some(b) = &gv.1 {
            second.push(MatJob { m: b, xs: &sc.lo_g[..nt * gv.0.rows], ys: &mut sc.gate[..nt * ch] });
        }
        pool.matmats(&mut second);
    }
    let qscale = 1.0 / (d as f32).sqrt();
    if c.chunked && nt > 1 && sts.len() == 1 {
        chunk_wy(pool, c, w, sts[0], sc, nt, qscale);
        out_proj(pool, w, &sc.o[..nt * ch], first, outs);
        return;
    }
    for t in 0..nt {
        let st = &mut *sts[if sts.len() == 1 { 0 } else { t }];
        // per head, across the pool: 2. its channels' causal depthwise conv
        // over the ring + current input, then SiLU, and its channels of the
        // ring advanced by the input; 3. its log-decays; 4. its beta; 5. the
        // delta rule; 6. the gated norm of its output
        let slots = st.conv.len() / (3 * ch);
        let ring_all = waste_quant::SyncSlice::new(&mut st.conv);
        let (proj, tokens) = (&sc.proj, sc.tokens);
        let z_all = waste_quant::SyncSlice::new(&mut sc.z[t * ch..(t + 1) * ch]);
        let cv_all = waste_quant::SyncSlice::new(&mut sc.conv_out);
        let s_all = waste_quant::SyncSlice::new(&mut st.s);
        let o_all = waste_quant::SyncSlice::new(&mut sc.o[t * ch..(t + 1) * ch]);
        let (beta, gate) = (&sc.beta[t * h..(t + 1) * h], &sc.gate[t * ch..(t + 1) * ch]);
        let level = pool.level();
        pool.chunks(h, &|h0, h1| {
            for hh in h0..h1 {
                let (c0, c1) = (hh * d, (hh + 1) * d);
                // SAFETY: head hh alone touches channels [c0, c1) of each of q/k/v's
                // conv outputs and of the decays, its D×D state block and its D outputs.
                let (qh, kh, vh, z, s, o) = unsafe {
                    (
                        cv_all.range(c0, c1),
                        cv_all.range(ch + c0, ch + c1),
                        cv_all.range(2 * ch + c0, 2 * ch + c1),
                        z_all.range(c0, c1),
                        s_all.range(hh * d * d, (hh + 1) * d * d),
                        o_all.range(c0, c1),
                    )
                };
                for (part, out) in [(0, &mut *qh), (1, &mut *kh), (2, &mut *vh)] {
                    let cur = &proj[(part * tokens + t) * ch + c0..(part * tokens + t) * ch + c1];
                    // SAFETY: head hh alone touches channels [c0, c1) of its part in
                    // every ring slot: read here, then moved one slot down.
                    let at = |slot: usize| unsafe {
                        ring_all.range(slot * 3 * ch + part * ch + c0, slot * 3 * ch + part * ch + c1)
                    };
                    for (j, y) in out.iter_mut().enumerate() {
                        let i = c0 + j;
                        *y = conv_silu(&w.conv[part][i * k..(i + 1) * k], |jj| at(jj)[j], cur[j]);
                    }
                    // the ring's unit is a token's [q | k | v], oldest first
                    for slot in 1..slots {
                        at(slot - 1).copy_from_slice(at(slot));
                    }
                    if slots > 0 {
                        at(slots - 1).copy_from_slice(cur);
                    }
                }
                log_decays(c, w, hh, z);
                head_update(level, d, s, qh, kh, vh, z, sigmoid(beta[hh]), qscale, o);
                gated_norm(c, w, o, &gate[c0..c1]);
            }
        });
    }
    // 7. output projection of the tokens from `first`
    out_proj(pool, w, &sc.o[..nt * ch], first, outs);
}

/// The output projection of the tokens from `first` (`o`: every token's
/// gated outputs; `outs`: every token's rows).
fn out_proj(pool: &Pool, w: &KdaWeights, o: &[f32], first: usize, outs: &mut [f32]) {
    let (ch, hid) = (w.o.cols, w.o.rows);
    let nt = o.len() / ch;
    if first < nt {
        pool.matmat(&w.o.view(), &o[first * ch..], nt - first, &mut outs[first * hid..nt * hid]);
    }
}

/// The chunk in the WY form, per head across the pool: the head's
/// channels' conv + SiLU for every token (from the ring and the chunk's raw
/// inputs), its log-decays and betas, [`head_chunk`], the gated norms; then
/// the ring advanced by the chunk's tokens.
fn chunk_wy(
    pool: &Pool,
    c: &KdaConfig,
    w: &KdaWeights,
    st: &mut KdaState,
    sc: &mut KdaScratch,
    nt: usize,
    qscale: f32,
) {
    let ch = c.channels();
    let (d, h, k) = (c.dim, c.heads, c.kernel);
    let tokens = sc.tokens;
    let raw = |part: usize, t: usize| &sc.proj[(part * tokens + t) * ch..(part * tokens + t + 1) * ch];
    let s_all = waste_quant::SyncSlice::new(&mut st.s);
    let o_all = waste_quant::SyncSlice::new(&mut sc.o[..nt * ch]);
    let (ring, z, beta, gate) = (&st.conv, &sc.z, &sc.beta, &sc.gate);
    let level = pool.level();
    pool.chunks(h, &|h0, h1| {
        let mut qkv = [vec![0f32; nt * d], vec![0f32; nt * d], vec![0f32; nt * d]];
        let (mut g, mut o) = (vec![0f32; nt * d], vec![0f32; nt * d]);
        for hh in h0..h1 {
            for (part, out) in qkv.iter_mut().enumerate() {
                for t in 0..nt {
                    for j in 0..d {
                        let i = hh * d + j;
                        // the inputs k−1 … 1 positions back: the chunk's raw
                        // ones, then (before the chunk) the ring's
                        let past = |jj: usize| match (t + jj + 1).checked_sub(k) {
                            Some(u) => raw(part, u)[i],
                            None => ring[(t + jj) * 3 * ch + part * ch + i],
                        };
                        out[t * d + j] = conv_silu(&w.conv[part][i * k..(i + 1) * k], past, raw(part, t)[i]);
                    }
                }
            }
            for t in 0..nt {
                let gt = &mut g[t * d..(t + 1) * d];
                gt.copy_from_slice(&z[t * ch + hh * d..t * ch + (hh + 1) * d]);
                log_decays(c, w, hh, gt);
            }
            let b: Vec<f32> = (0..nt).map(|t| sigmoid(beta[t * h + hh])).collect();
            // SAFETY: head hh alone owns its D×D state block.
            let s = unsafe { s_all.range(hh * d * d, (hh + 1) * d * d) };
            head_chunk(level, d, s, &qkv[0], &qkv[1], &qkv[2], &g, &b, qscale, &mut o);
            for t in 0..nt {
                // SAFETY: head hh alone writes its D outputs of each token.
                let ot = unsafe { o_all.range(t * ch + hh * d, t * ch + (hh + 1) * d) };
                ot.copy_from_slice(&o[t * d..(t + 1) * d]);
                gated_norm(c, w, ot, &gate[t * ch + hh * d..t * ch + (hh + 1) * d]);
            }
        }
    });
    // the ring's unit is a token's [q | k | v]
    push_ring(&mut st.conv, 3 * ch, nt, |t, dst| {
        for part in 0..3 {
            dst[part * ch..(part + 1) * ch].copy_from_slice(raw(part, t));
        }
    });
}

/// Causal depthwise conv of one channel, then SiLU: `taps` oldest first
/// (the current input's tap last), `past(j)` the input `k − 1 − j`
/// positions back, `cur` the current one; summed in tap order.
#[inline]
fn conv_silu(taps: &[f32], past: impl Fn(usize) -> f32, cur: f32) -> f32 {
    let k = taps.len();
    let mut acc = 0f32;
    for (j, tp) in taps[..k - 1].iter().enumerate() {
        acc += tp * past(j);
    }
    acc += taps[k - 1] * cur;
    silu(acc)
}

/// Head `hh`'s decay pre-activations (with `dt_bias` still to add) → log-decays, in place.
fn log_decays(c: &KdaConfig, w: &KdaWeights, hh: usize, z: &mut [f32]) {
    let c0 = hh * c.dim;
    for (j, zi) in z.iter_mut().enumerate() {
        *zi = decay_gate(*zi + w.dt_bias[c0 + j], w.a_log[hh], c.lower_bound);
    }
}

/// The gated output norm of one head's output.
fn gated_norm(c: &KdaConfig, w: &KdaWeights, o: &mut [f32], gate: &[f32]) {
    rmsnorm_inplace(o, &w.o_norm, c.eps);
    for (oi, gi) in o.iter_mut().zip(gate) {
        *oi *= sigmoid(*gi);
    }
}

/// Advance the conv ring (`ring.len() / unit` inputs, oldest first) by `n`
/// inputs, `input(t, slot)` writing the `t`-th into its slot: the same as
/// pushing them one by one.
fn push_ring(ring: &mut [f32], unit: usize, n: usize, mut input: impl FnMut(usize, &mut [f32])) {
    let slots = ring.len() / unit;
    if slots == 0 {
        return;
    }
    let keep = slots.saturating_sub(n);
    ring.copy_within((slots - keep) * unit.., 0);
    for t in n.saturating_sub(slots)..n {
        let at = keep + t - n.saturating_sub(slots);
        input(t, &mut ring[at * unit..(at + 1) * unit]);
    }
}

/// One head over `n` tokens in the chunked (WY) form: the same recurrence
/// as `n` calls of [`head_update`], as small matrix products. With `S₀`
/// the state before the chunk, `eₜ = exp(gₜ)` (per key channel),
/// `cₜ = e₀ ⊙ … ⊙ eₜ` and `a_{s→t} = k̂ₛ ⊙ e_{s+1} ⊙ … ⊙ eₜ`:
///
/// - `wₜ = βₜ (vₜ − S₀ᵀ(cₜ ⊙ k̂ₜ) − Σ_{s<t} (k̂ₜ·a_{s→t}) wₛ)` (forward substitution),
/// - `oₜ = S₀ᵀ(cₜ ⊙ q̂ₜ) + Σ_{s≤t} (q̂ₜ·a_{s→t}) wₛ`,
/// - `S ← diag(c_{n−1}) S₀ + Σₛ a_{s→n−1} wₛᵀ`.
///
/// The decays enter as products of per-token factors (each ≤ 1), never as
/// `exp(−Σg)`, so nothing overflows. `S₀` is read twice per chunk (the
/// token form reads and writes it twice per token). Per-token inputs are
/// token-major (`q`, `k`, `v`, `g`: `n × D`, `beta`: `n`); `o`: `n × D`.
///
/// # Panics
/// When a buffer's length disagrees with `n` and `d`.
#[allow(clippy::too_many_arguments)]
pub fn head_chunk(
    level: waste_quant::Level,
    d: usize,
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    qscale: f32,
    o: &mut [f32],
) {
    use waste_quant::ops::{axpy_at, dot_at};
    let n = beta.len();
    assert!(q.len() == n * d && k.len() == n * d && v.len() == n * d && g.len() == n * d && o.len() >= n * d);
    assert_eq!(s.len(), d * d);
    let mut kh = vec![0f32; n * d];
    let mut qh = vec![0f32; n * d];
    for t in 0..n {
        let r = t * d..(t + 1) * d;
        unit_norm(level, &k[r.clone()], 1.0, &mut kh[r.clone()]);
        unit_norm(level, &q[r.clone()], qscale, &mut qh[r]);
    }
    let e: Vec<f32> = g.iter().map(|x| x.exp()).collect();
    // cₜ ⊙ k̂ₜ and cₜ ⊙ q̂ₜ, with the cumulative decays
    let (mut kc, mut qc) = (vec![0f32; n * d], vec![0f32; n * d]);
    let mut cum = vec![1f32; d];
    for t in 0..n {
        for i in 0..d {
            cum[i] *= e[t * d + i];
            kc[t * d + i] = kh[t * d + i] * cum[i];
            qc[t * d + i] = qh[t * d + i] * cum[i];
        }
    }
    // kk[t][s] = k̂ₜ·a_{s→t} (s < t), qk[t][s] = q̂ₜ·a_{s→t} (s ≤ t), and a_{s→n−1}
    let (mut kk, mut qk) = (vec![0f32; n * n], vec![0f32; n * n]);
    let mut a_end = vec![0f32; n * d];
    let mut a = vec![0f32; d];
    for s0 in 0..n {
        a.copy_from_slice(&kh[s0 * d..(s0 + 1) * d]);
        qk[s0 * n + s0] = dot_at(level, &qh[s0 * d..(s0 + 1) * d], &a);
        for t in s0 + 1..n {
            for (ai, ei) in a.iter_mut().zip(&e[t * d..(t + 1) * d]) {
                *ai *= ei;
            }
            kk[t * n + s0] = dot_at(level, &kh[t * d..(t + 1) * d], &a);
            qk[t * n + s0] = dot_at(level, &qh[t * d..(t + 1) * d], &a);
        }
        a_end[s0 * d..(s0 + 1) * d].copy_from_slice(&a);
    }
    // S₀ᵀ(cₜ ⊙ k̂ₜ) and S₀ᵀ(cₜ ⊙ q̂ₜ): one pass over S₀
    let (mut ks, mut qs) = (vec![0f32; n * d], vec![0f32; n * d]);
    for i in 0..d {
        let row = &s[i * d..(i + 1) * d];
        for t in 0..n {
            axpy_at(level, kc[t * d + i], row, &mut ks[t * d..(t + 1) * d]);
            axpy_at(level, qc[t * d + i], row, &mut qs[t * d..(t + 1) * d]);
        }
    }
    // forward substitution for the wₜ, then the outputs
    let mut wv = vec![0f32; n * d];
    for t in 0..n {
        let (done, rest) = wv.split_at_mut(t * d);
        let wt = &mut rest[..d];
        for j in 0..d {
            wt[j] = v[t * d + j] - ks[t * d + j];
        }
        for s0 in 0..t {
            axpy_at(level, -kk[t * n + s0], &done[s0 * d..(s0 + 1) * d], wt);
        }
        for x in wt.iter_mut() {
            *x *= beta[t];
        }
    }
    for t in 0..n {
        let ot = &mut o[t * d..(t + 1) * d];
        ot.copy_from_slice(&qs[t * d..(t + 1) * d]);
        for s0 in 0..=t {
            axpy_at(level, qk[t * n + s0], &wv[s0 * d..(s0 + 1) * d], ot);
        }
    }
    // the state after the chunk: one more pass over S₀
    for i in 0..d {
        let row = &mut s[i * d..(i + 1) * d];
        let ci = cum[i];
        for x in row.iter_mut() {
            *x *= ci;
        }
        for s0 in 0..n {
            axpy_at(level, a_end[s0 * d + i], &wv[s0 * d..(s0 + 1) * d], row);
        }
    }
}

/// The log-decay of one channel from its pre-activation `z` (with `dt_bias`
/// added): Kimi-Linear `-exp(A_log)·softplus(z)`, or K3's bounded
/// `lower_bound·σ(exp(A_log)·z)` — a different function, not a clamp.
#[inline]
pub fn decay_gate(z: f32, a_log: f32, lower_bound: Option<f32>) -> f32 {
    let a = a_log.exp();
    match lower_bound {
        None => -a * softplus(z),
        Some(lb) => lb * sigmoid(a * z),
    }
}

/// The per-head recurrence (state rows indexed by key dim).
#[allow(clippy::too_many_arguments)]
pub fn head_update(
    level: waste_quant::Level,
    d: usize,
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    qscale: f32,
    o: &mut [f32],
) {
    let mut khat = [0f32; 512];
    let mut qhat = [0f32; 512];
    let (khat, qhat) = if d <= 512 { (&mut khat[..d], &mut qhat[..d]) } else { unreachable_big(d) };
    unit_norm(level, k, 1.0, khat);
    unit_norm(level, q, qscale, qhat);
    // decay rows, u = Sᵀ k̂; S += k̂ dᵀ with d = beta (v - u); o = Sᵀ q̂
    let mut e = [0f32; 512];
    let e = &mut e[..d];
    for (ei, gi) in e.iter_mut().zip(g) {
        *ei = gi.exp();
    }
    crate::delta::head_step(level, e, khat, v, beta, qhat, &mut s[..d * d], o);
}

/// `out = x / √(x·x + 1e-6) · scale` (the key and query L2 norm).
fn unit_norm(level: waste_quant::Level, x: &[f32], scale: f32, out: &mut [f32]) {
    let n = 1.0 / (waste_quant::ops::dot_at(level, x, x) + 1e-6).sqrt();
    for (o, &xi) in out.iter_mut().zip(x) {
        *o = xi * n * scale;
    }
}

fn unreachable_big(d: usize) -> ! {
    panic!("KDA head dim {d} exceeds 512 (bounded at open)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// The chunked (WY) form against `n` token steps from a random
        /// state: outputs and the state after, within `CHUNKED_REL_TOL` of
        /// each buffer's largest magnitude, for decays from negligible to
        /// ones that wipe the state within a token (their factors underflow
        /// to 0 instead of overflowing), at every level.
        #[test]
        fn chunked_form_is_within_its_bound(n in 2usize..17, wide in any::<bool>(), decay in prop::sample::select(vec![0.01f32, 0.5, 4.0, 40.0]), seed in any::<u64>()) {
            let d = if wide { 128 } else { 16 };
            let mut r = waste_quant::SplitMix64::new(seed);
            let mut u = move |a: f32| (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 * a - a;
            let s0: Vec<f32> = (0..d * d).map(|_| u(0.3)).collect();
            let (q, k, v): (Vec<f32>, Vec<f32>, Vec<f32>) = ((0..n * d).map(|_| u(1.0)).collect(), (0..n * d).map(|_| u(1.0)).collect(), (0..n * d).map(|_| u(1.0)).collect());
            let g: Vec<f32> = (0..n * d).map(|_| -decay * (0.5 + u(0.5))).collect();
            let beta: Vec<f32> = (0..n).map(|_| 0.5 + u(0.5)).collect();
            let qscale = 1.0 / (d as f32).sqrt();
            for lv in waste_quant::Level::available() {
                let mut sa = s0.clone();
                let mut want = vec![0f32; n * d];
                for t in 0..n {
                    let r = t * d..(t + 1) * d;
                    head_update(lv, d, &mut sa, &q[r.clone()], &k[r.clone()], &v[r.clone()], &g[r.clone()], beta[t], qscale, &mut want[r]);
                }
                let mut sb = s0.clone();
                let mut got = vec![0f32; n * d];
                head_chunk(lv, d, &mut sb, &q, &k, &v, &g, &beta, qscale, &mut got);
                for (what, a, b) in [("outputs", &got, &want), ("state", &sb, &sa)] {
                    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                    let err = a.iter().zip(b.iter()).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                    prop_assert!(a.iter().all(|x| x.is_finite()), "{} not finite", what);
                    prop_assert!(err <= CHUNKED_REL_TOL * scale, "{}: max error {} against {} x {} (n {}, d {}, decay {}, {:?})", what, err, CHUNKED_REL_TOL, scale, n, d, decay, lv);
                }
            }
        }
    }
}
