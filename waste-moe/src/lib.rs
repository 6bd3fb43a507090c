//! # waste-moe
//!
//! The MoE block of the Kimi family: the sigmoid router (correction bias
//! selects, un-biased scores weigh, optional group-limited selection,
//! renormalization with `+1e-20`, routed scaling), routed experts as GLUs over
//! quantized records (VQ lookup tables, Q4G groups or exact F16/BF16), shared
//! experts and dense FFNs, with SiLU or SiTU activations.
//!
//! Ties in top-k resolve to the lowest expert id (a project choice; no
//! reference defines one).
#![deny(missing_docs)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use waste_format::{Activation, ExpertFmt, RecordLayout};
use waste_quant::ops::{sigmoid, silu, situ};
use waste_quant::vq::{
    build_table_planes, matvec_rows_planes, planes_cover, planes_fit, planes_len, uses_planes, uses_vq4p_rows64,
    VqBook, VqLayout,
};
use waste_quant::vq_fast::TableForm;
use waste_quant::{vq_fast, Level, MatJob, MatRef, Matrix, Pool, SyncSlice};

/// Router settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterConfig {
    /// Experts.
    pub experts: usize,
    /// Chosen per token.
    pub top_k: usize,
    /// Groups (1 = off).
    pub n_group: usize,
    /// Groups kept.
    pub topk_group: usize,
    /// Renormalize chosen weights.
    pub renormalize: bool,
    /// Routed scaling factor.
    pub scaling: f32,
}

/// Choose experts from router logits. Returns `(expert, weight)` in
/// selection order (best first; ties → lowest id).
pub fn route(c: &RouterConfig, logits: &[f32], bias: &[f32], out: &mut Vec<(usize, f32)>) {
    let e = c.experts;
    let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
    let mut choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    if c.n_group > 1 {
        let per = e / c.n_group;
        let mut gs: Vec<(usize, f32)> = (0..c.n_group)
            .map(|g| {
                let mut v: Vec<f32> = choice[g * per..(g + 1) * per].to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                (g, v[0] + v.get(1).copied().unwrap_or(0.0))
            })
            .collect();
        gs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let keep: Vec<usize> = gs[..c.topk_group].iter().map(|g| g.0).collect();
        for (i, ch) in choice.iter_mut().enumerate() {
            if !keep.contains(&(i / per)) {
                *ch = f32::NEG_INFINITY;
            }
        }
    }
    // the top k by score, ties by id: a total order, so selecting the k
    // first and sorting them gives the full sort's first k
    let mut idx: Vec<usize> = (0..e).collect();
    let order = |a: &usize, b: &usize| choice[*b].total_cmp(&choice[*a]).then(a.cmp(b));
    let k = c.top_k;
    if k > 0 && k < e {
        idx.select_nth_unstable_by(k - 1, order);
    }
    idx[..k].sort_by(order);
    out.clear();
    let chosen = &idx[..k];
    let sum: f32 = chosen.iter().map(|&i| scores[i]).sum::<f32>() + 1e-20;
    for &i in chosen {
        let w = if c.renormalize { scores[i] / sum } else { scores[i] };
        out.push((i, w * c.scaling));
    }
}

/// [`route`] with the experts given (a recorded trace's choice): each gets
/// the weight the router gives it — its sigmoid score, renormalized over the
/// given set when the config says so, times the scaling — so the compute is
/// the model's, only the choice is replayed. `experts` must be distinct ids
/// below `c.experts`.
pub fn route_forced(c: &RouterConfig, logits: &[f32], experts: &[usize], out: &mut Vec<(usize, f32)>) {
    let scores: Vec<f32> = experts.iter().map(|&i| sigmoid(logits[i])).collect();
    let sum: f32 = scores.iter().sum::<f32>() + 1e-20;
    out.clear();
    for (&i, &s) in experts.iter().zip(&scores) {
        let w = if c.renormalize { s / sum } else { s };
        out.push((i, w * c.scaling));
    }
}

/// GLU activation `act(g, u)`.
#[inline]
pub fn glu(act: Activation, g: f32, u: f32) -> f32 {
    match act {
        Activation::Silu => silu(g) * u,
        Activation::Situ { beta, linear_beta } => situ(g, u, beta, linear_beta),
    }
}

/// A dense GLU (dense FFN or shared experts): `down · act(gate·x, up·x)`.
#[derive(Debug)]
pub struct DenseGlu {
    /// `[I, hidden]`.
    pub gate: Matrix,
    /// `[I, hidden]`.
    pub up: Matrix,
    /// `[hidden, I]`.
    pub down: Matrix,
}

impl DenseGlu {
    /// Intermediate width.
    pub fn width(&self) -> usize {
        self.gate.rows
    }
    /// `out = down · act(gate·x, up·x)`; `tmp` needs `2·width` floats.
    pub fn forward(&self, pool: &Pool, act: Activation, x: &[f32], tmp: &mut [f32], out: &mut [f32]) {
        // one input: the chunk form's matmats are matvecs
        self.forward_chunk(pool, act, x, 1, tmp, out)
    }

    /// [`DenseGlu::forward`] for `nt` token-major inputs at once (`xs`:
    /// `nt × hidden`, `outs`: `nt × hidden`, `tmp`: `2 · width · nt`):
    /// each weight row is read once for every input, and each output is
    /// bit-identical to `forward` on its input alone.
    ///
    /// # Panics
    /// When a buffer is shorter than the sizes above.
    pub fn forward_chunk(
        &self,
        pool: &Pool,
        act: Activation,
        xs: &[f32],
        nt: usize,
        tmp: &mut [f32],
        outs: &mut [f32],
    ) {
        let i = self.width();
        let (g, rest) = tmp.split_at_mut(i * nt);
        let u = &mut rest[..i * nt];
        let (gv, uv) = (self.gate.view(), self.up.view());
        pool.matmats(&mut [MatJob { m: &gv, xs, ys: g }, MatJob { m: &uv, xs, ys: u }]);
        for (gv, uv) in g.iter_mut().zip(u.iter()) {
            *gv = glu(act, *gv, *uv);
        }
        pool.matmat(&self.down.view(), g, nt, outs);
    }
}

/// A layer's codebooks: `[kind][stage]` (kind 0 gate, 1 up, 2 down).
#[derive(Debug, Default)]
pub struct LayerBooks {
    /// Books per kind.
    pub books: [Vec<VqBook>; 3],
}

/// How to run a layer's routed experts.
#[derive(Debug)]
pub struct ExpertKernel {
    /// Record layout.
    pub lay: RecordLayout,
    /// Activation.
    pub act: Activation,
    /// Most tokens [`ExpertKernel::forward_batch`] takes at once (a prefill
    /// chunk; its buffers are part of the scratch). 0 for none.
    pub batch: usize,
}

/// Per-token scratch for routed experts: the gate and up tables every
/// expert of a layer shares, and one [`ExpertLane`] per expert computed at
/// the same time.
#[derive(Debug)]
pub struct ExpertScratch {
    /// Gate table (built once per token per layer; empty when the byte
    /// planes serve every row, `waste_quant::vq::planes_cover`).
    pub t_gate: Vec<f32>,
    /// Up table.
    pub t_up: Vec<f32>,
    /// The form [`ExpertKernel::prepare`] built the fast mode's gate and up
    /// tables in (`waste_quant::vq_fast::table_form`, read once for the
    /// build and the rows that read them).
    pub t_form: TableForm,
    /// The gate table as byte planes (empty when the layout does not fit
    /// them, `waste_quant::vq::planes_fit`; unused when the level looks
    /// tables up by gathers, `waste_quant::vq::uses_planes`).
    pub p_gate: Vec<u8>,
    /// The up table as byte planes.
    pub p_up: Vec<u8>,
    /// One per expert in flight: lane 0 serves [`ExpertKernel::forward`],
    /// lane `i` the `i`-th task of [`ExpertKernel::forward_each`].
    pub lanes: Vec<ExpertLane>,
    /// [`ExpertKernel::forward_batch`]'s inputs, token-major (`batch × lat`;
    /// empty for VQ formats).
    pub batch_in: Vec<f32>,
    /// Its outputs (`batch × lat`).
    pub batch_out: Vec<f32>,
    /// Its gate and up activations (`2 × batch × m`).
    pub batch_act: Vec<f32>,
}

/// One expert's own buffers: its activations and its down table.
#[derive(Debug)]
pub struct ExpertLane {
    /// Down table (per expert).
    pub t_down: Vec<f32>,
    /// The down table as byte planes.
    pub p_down: Vec<u8>,
    /// Gate activations `[m]`.
    pub g: Vec<f32>,
    /// Up activations `[m]`.
    pub u: Vec<f32>,
    /// The second to fourth tokens' down tables, for
    /// [`ExpertKernel::forward_groups`] (empty where tokens cannot pair; a
    /// job of fewer tokens than its kernel takes writes the unused ones and
    /// discards them).
    pub t_down_more: [Vec<f32>; 3],
    /// Their gate activations.
    pub g_more: [Vec<f32>; 3],
    /// Their up activations.
    pub u_more: [Vec<f32>; 3],
    /// The discarded output of a job of one token by the pair kernel, or
    /// of three by the quad kernel (`lat`).
    pub spare: Vec<f32>,
}

impl ExpertScratch {
    /// Bytes allocated (capacities), for the plan's accounting.
    pub fn allocated_bytes(&self) -> u64 {
        let f = |v: &Vec<f32>| 4 * v.capacity() as u64;
        let b = |v: &Vec<u8>| v.capacity() as u64;
        let lanes: u64 = self
            .lanes
            .iter()
            .map(|l| {
                let more: u64 = (0..3).map(|i| f(&l.t_down_more[i]) + f(&l.g_more[i]) + f(&l.u_more[i])).sum();
                f(&l.t_down) + b(&l.p_down) + f(&l.g) + f(&l.u) + more + f(&l.spare)
            })
            .sum();
        let batch = f(&self.batch_in) + f(&self.batch_out) + f(&self.batch_act);
        f(&self.t_gate) + f(&self.t_up) + b(&self.p_gate) + b(&self.p_up) + lanes + batch
    }
}

/// One job of [`ExpertKernel::forward_groups`]: an expert for one to four
/// of a chunk's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupJob {
    /// The tokens (rows of [`ExpertKernel::prepare_tokens`]' inputs); the
    /// first `n` are read.
    pub tokens: [usize; 4],
    /// How many tokens: 1 to 4.
    pub n: usize,
    /// Each token's output slot (the first `n`).
    pub slots: [usize; 4],
    /// Which of [`group_jobs`]' use lists the job serves (its expert).
    pub of: usize,
}

/// A chunk's expert uses as [`GroupJob`]s of at most `most` (2 or 4)
/// tokens: `uses` lists, in the order the jobs should run, each expert's
/// `(token, slot)` uses; consecutive uses of one expert go together, the
/// rest of a division in a last, smaller job.
///
/// # Panics
/// When `most` is not 2 or 4.
pub fn group_jobs<'a>(uses: impl IntoIterator<Item = &'a [(usize, usize)]>, most: usize) -> Vec<GroupJob> {
    assert!(most == 2 || most == 4, "jobs of {most} tokens: 2 or 4");
    let mut jobs = Vec::new();
    for (of, u) in uses.into_iter().enumerate() {
        for p in u.chunks(most) {
            let at = |i: usize| p[i.min(p.len() - 1)];
            jobs.push(GroupJob {
                tokens: [0, 1, 2, 3].map(|i| at(i).0),
                n: p.len(),
                slots: [0, 1, 2, 3].map(|i| at(i).1),
                of,
            });
        }
    }
    jobs
}

/// How many experts [`ExpertKernel::forward_each`] computes at once on a
/// pool of `threads`: one per thread, at most the experts a token chooses.
pub fn lanes_for(threads: usize, top_k: usize) -> usize {
    threads.min(top_k).max(1)
}

/// How many experts [`ExpertKernel::forward_fetched`] computes at once on
/// `pool` with scratch `sc`: its lanes, at most the pool's threads (one
/// means experts run one at a time, rows split).
pub fn lanes_in_use(sc: &ExpertScratch, pool: &Pool) -> usize {
    sc.lanes.len().min(pool.threads()).max(1)
}

impl ExpertKernel {
    fn vq(&self, rows: usize, cols: usize) -> VqLayout {
        VqLayout::for_expert(&self.lay.quant, rows, cols)
    }

    /// What computes these experts at `level` on this CPU, as reports name
    /// it: the format and, for VQ, the row kernel
    /// ([`waste_quant::vq::rows_kernel_name`]: `vq3r avx2-gather`, `vq3r
    /// scalar-loads`, …); for the other formats the level's matvec (`q4g
    /// avx2`).
    ///
    /// In the fast mode VQ experts whose books are full name the fast
    /// kernel ([`vq_fast::rows_kernel_name`]: `vq3r fast
    /// avx512-int8-permutes`, `vq3r fast int8-loads`).
    pub fn kernel_name(&self, level: Level, numeric: waste_quant::fast::Numeric) -> String {
        let fmt = self.lay.quant.fmt;
        let name = fmt.name().to_ascii_lowercase();
        let lay = self.vq(self.lay.m, self.lay.lat);
        if fmt.is_vq() && numeric.qmax().is_some() && self.lay.quant.entries == lay.table_entries() {
            format!("{name} fast {}", vq_fast::rows_kernel_name(level, &lay))
        } else if fmt.is_vq() {
            format!("{name} {}", waste_quant::vq::rows_kernel_name(level, &self.vq(self.lay.m, self.lay.lat)))
        } else {
            format!("{name} {}", level.name())
        }
    }
    /// Lengths of the gate (= up) and down tables in floats and of their
    /// byte planes in bytes (planes wherever the layout fits them, used or
    /// not: the same bytes on every machine).
    fn table_lens(&self) -> (usize, usize, usize, usize) {
        if !self.lay.quant.fmt.is_vq() {
            return (0, 0, 0, 0);
        }
        let (m, lat) = (self.lay.m, self.lay.lat);
        let (lg, ld) = (self.vq(m, lat), self.vq(lat, m));
        let planes = |l: &VqLayout| if planes_fit(l) { planes_len(l) } else { 0 };
        (lg.table_len(), ld.table_len(), planes(&lg), planes(&ld))
    }

    /// Whether a chunk's tokens can share each expert's weights
    /// ([`ExpertKernel::forward_batch`]): formats whose rows a token reads
    /// directly (Q4G, F16, BF16). VQ's tables belong to one token.
    pub fn batches(&self) -> bool {
        !self.lay.quant.fmt.is_vq() && self.batch > 1
    }

    /// Floats of the batch buffers: inputs and outputs (`lat` each) and
    /// gate and up activations (`m` each) per token.
    fn batch_lens(&self) -> (usize, usize) {
        if self.lay.quant.fmt.is_vq() {
            return (0, 0);
        }
        (self.batch * self.lay.lat, 2 * self.batch * self.lay.m)
    }

    /// Whether a chunk's tokens can pair on these experts
    /// ([`ExpertKernel::forward_groups`]): VQ layouts whose rows two inputs'
    /// gathers share on this build (`vq_fast::pairs_serve`), with a batch.
    /// The scratch holds the pairs' lane buffers exactly then; the tokens'
    /// tables are the caller's ([`ExpertKernel::token_tables_floats`]).
    pub fn pairable(&self) -> bool {
        let (lg, ld) = (self.vq(self.lay.m, self.lay.lat), self.vq(self.lay.lat, self.lay.m));
        self.lay.quant.fmt.is_vq() && self.batch > 1 && vq_fast::pairs_serve(&lg) && vq_fast::pairs_serve(&ld)
    }

    /// Whether the tokens of a chunk pair on these experts now: they can
    /// ([`ExpertKernel::pairable`]), `pool` computes in the fast mode with
    /// full books at the AVX2 kernels' level, and the process's probes found
    /// two inputs' shared gathers faster than each alone by the fastest form
    /// (`vq_fast::avx2_pairs`: where the gathers are slow and the chains win
    /// alone, a pair may still pay).
    pub fn pairs(&self, pool: &Pool, books: &LayerBooks) -> bool {
        self.may_pair(pool.level(), pool.numeric())
            && self.fast_vq(pool.numeric(), books).is_some()
            && vq_fast::avx2_pairs()
    }

    /// Where tokens pair ([`ExpertKernel::pairs`]), whether three or four
    /// tokens of an expert go together through the quad kernel
    /// (`vq_fast::avx2_quads`: the probes found four inputs' qword gathers
    /// faster than two pairs): the most tokens a [`GroupJob`] takes, 2 or 4.
    pub fn group_most(&self) -> usize {
        if vq_fast::avx2_quads() {
            4
        } else {
            2
        }
    }

    /// Whether tokens may pair at `level` in `numeric` (what
    /// [`ExpertKernel::pairs`] asks before the books and the probes): they
    /// can ([`ExpertKernel::pairable`]), the mode quantizes, and the level
    /// sums these rows by the AVX2 kernels. Where not, the pairs' buffers go
    /// unused.
    pub fn may_pair(&self, level: Level, numeric: waste_quant::fast::Numeric) -> bool {
        self.pairable() && numeric.qmax().is_some() && vq_fast::rows32(level, &self.vq(self.lay.m, self.lay.lat))
    }

    /// Floats of one plain fast table of the gate (= up) and of the down
    /// layout, where tokens can pair (else 0).
    fn pair_lens(&self) -> (usize, usize) {
        if !self.pairable() {
            return (0, 0);
        }
        let (lg, ld) = (self.vq(self.lay.m, self.lay.lat), self.vq(self.lay.lat, self.lay.m));
        (vq_fast::qtable_floats(&lg, TableForm::Plain), vq_fast::qtable_floats(&ld, TableForm::Plain))
    }

    /// Floats of the tables [`ExpertKernel::prepare_tokens`] builds for a
    /// whole batch: each token's gate and up tables (plain codes, a byte an
    /// entry); 0 where tokens cannot pair. One buffer serves every session
    /// of a model (it holds one step's tokens at a time).
    pub fn token_tables_floats(&self) -> usize {
        self.batch * 2 * self.pair_lens().0
    }

    /// Bytes of [`ExpertKernel::scratch`] with `lanes` lanes (the per-token
    /// part the plan counts beside the session's activations).
    pub fn scratch_bytes(&self, lanes: usize) -> usize {
        let (tg, td, pg, pd) = self.table_lens();
        let (bio, bact) = self.batch_lens();
        let (_, pdn) = self.pair_lens();
        let pair_lane = if pdn > 0 { 3 * (pdn + 2 * self.lay.m) + self.lay.lat } else { 0 };
        4 * 2 * tg + 2 * pg + lanes.max(1) * (4 * td + pd + 4 * 2 * self.lay.m + 4 * pair_lane) + 4 * (2 * bio + bact)
    }

    /// Scratch sized for this layout, with `lanes` lanes (at least one).
    pub fn scratch(&self, lanes: usize) -> ExpertScratch {
        let m = self.lay.m;
        let (tg, td, pg, pd) = self.table_lens();
        let (_, pdn) = self.pair_lens();
        let (pm, pl) = if pdn > 0 { (m, self.lay.lat) } else { (0, 0) };
        ExpertScratch {
            t_gate: vec![0.0; tg],
            t_up: vec![0.0; tg],
            t_form: TableForm::Plain,
            p_gate: vec![0; pg],
            p_up: vec![0; pg],
            lanes: (0..lanes.max(1))
                .map(|_| ExpertLane {
                    t_down: vec![0.0; td],
                    p_down: vec![0; pd],
                    g: vec![0.0; m],
                    u: vec![0.0; m],
                    t_down_more: core::array::from_fn(|_| vec![0.0; pdn]),
                    g_more: core::array::from_fn(|_| vec![0.0; pm]),
                    u_more: core::array::from_fn(|_| vec![0.0; pm]),
                    spare: vec![0.0; pl],
                })
                .collect(),
            batch_in: vec![0.0; self.batch_lens().0],
            batch_out: vec![0.0; self.batch_lens().0],
            batch_act: vec![0.0; self.batch_lens().1],
        }
    }

    /// One expert for `n` tokens at once: `sc.batch_out[i·lat..][..lat] =
    /// E_rec(sc.batch_in[i·lat..][..lat])` for `i < n`, each weight row read
    /// once for all of them (rows split across the pool); each output is
    /// bit-identical to [`ExpertKernel::forward`] on its input alone. Only
    /// when [`ExpertKernel::batches`] (header already validated).
    ///
    /// # Panics
    /// When `n` exceeds the kernel's `batch`, or for a VQ record.
    pub fn forward_batch(&self, pool: &Pool, rec: &[u8], n: usize, sc: &mut ExpertScratch) {
        assert!(self.batches() && n <= self.batch, "forward_batch: {n} tokens of a {}-token batch", self.batch);
        let (m, lat) = (self.lay.m, self.lay.lat);
        let (g, rest) = sc.batch_act.split_at_mut(n * m);
        let u = &mut rest[..n * m];
        let xs = &sc.batch_in[..n * lat];
        let ys = &mut sc.batch_out[..n * lat];
        with_dense_mats(&self.lay, rec, |[gate, up, down]| {
            pool.matmats(&mut [MatJob { m: &gate, xs, ys: g }, MatJob { m: &up, xs, ys: u }]);
            for (gv, uv) in g.iter_mut().zip(u.iter()) {
                *gv = glu(self.act, *gv, *uv);
            }
            pool.matmat(&down, g, n, ys);
        });
    }

    /// The fast mode's table code limit for these VQ experts: `Some` in a
    /// mode with quantized activations when every book is full
    /// ([`vq_fast::applies`]); `None` (the f32 tables) otherwise.
    fn fast_vq(&self, numeric: waste_quant::fast::Numeric, books: &LayerBooks) -> Option<f32> {
        let qmax = numeric.qmax().filter(|_| self.lay.quant.fmt.is_vq())?;
        let (lg, ld) = (self.vq(self.lay.m, self.lay.lat), self.vq(self.lay.lat, self.lay.m));
        let full = [&lg, &lg, &ld].iter().zip(&books.books).all(|(l, b)| vq_fast::applies(b, l));
        full.then_some(qmax)
    }

    /// Prepare per-token tables from the expert input `h` (VQ only).
    pub fn prepare(&self, pool: &Pool, books: &LayerBooks, h: &[f32], sc: &mut ExpertScratch) {
        if !self.lay.quant.fmt.is_vq() {
            return;
        }
        let lay = self.vq(self.lay.m, self.lay.lat);
        // the f32 tables (the exact mode's) have no other form
        sc.t_form = TableForm::Plain;
        let bg: Vec<&VqBook> = books.books[0].iter().collect();
        let bu: Vec<&VqBook> = books.books[1].iter().collect();
        let lv = pool.level();
        if let Some(qmax) = self.fast_vq(pool.numeric(), books) {
            // the fast mode's int8 tables, in the f32 tables' buffers
            let (tgs, tus) = (SyncSlice::new(&mut sc.t_gate), SyncSlice::new(&mut sc.t_up));
            let nb = vq_fast::blocks(&lay);
            let form = vq_fast::table_form(lv, &lay);
            sc.t_form = form;
            pool.run(2, &|i| {
                let (d, q) = vq_fast::block_ranges(&lay, form, 0, nb);
                let (buf, books) = if i == 0 { (&tgs, &bg) } else { (&tus, &bu) };
                // SAFETY: task 0 writes the gate table, task 1 the up one.
                let (d, q) = unsafe { (buf.range(d.start, d.end), buf.range(q.start, q.end)) };
                vq_fast::build(lv, books, &lay, h, qmax, (0, nb), d, bytemuck::cast_slice_mut(q), form);
            });
            return;
        }
        let with_planes = uses_planes(lv, &lay) && !sc.p_gate.is_empty();
        // planes alone when they serve every row (the f32 table would go unread)
        let tlen = if with_planes && planes_cover(lv, &lay) { 0 } else { lay.table_len() };
        let (tgs, tus) = (SyncSlice::new(&mut sc.t_gate), SyncSlice::new(&mut sc.t_up));
        let (pgs, pus) = (SyncSlice::new(&mut sc.p_gate), SyncSlice::new(&mut sc.p_up));
        pool.run(2, &|i| {
            // SAFETY: task 0 writes the gate table and planes, task 1 the up ones.
            let (t, books) = unsafe {
                if i == 0 {
                    (tgs.range(0, tlen), &bg)
                } else {
                    (tus.range(0, tlen), &bu)
                }
            };
            // SAFETY: as above.
            let p = unsafe {
                match (with_planes, i) {
                    (false, _) => &mut [][..],
                    (true, 0) => pgs.range(0, planes_len(&lay)),
                    (true, _) => pus.range(0, planes_len(&lay)),
                }
            };
            build_table_planes(lv, books, &lay, h, t, p);
        });
    }

    /// `out = E(h)` for one record (header already validated), its rows split
    /// across the pool (lane 0's buffers).
    ///
    /// # Panics
    /// When the scratch or output buffers are smaller than the layer's widths.
    pub fn forward(
        &self,
        pool: &Pool,
        books: &LayerBooks,
        rec: &[u8],
        h: &[f32],
        sc: &mut ExpertScratch,
        out: &mut [f32],
    ) {
        let shared = Shared { t_gate: &sc.t_gate, t_up: &sc.t_up, form: sc.t_form, p_gate: &sc.p_gate, p_up: &sc.p_up };
        self.run(Some(pool), (pool.level(), pool.numeric()), books, rec, h, &shared, &mut sc.lanes[0], out)
    }

    /// Several experts at once, each whole on one thread (no synchronisation
    /// inside an expert; one pass of the pool for as many experts as it has
    /// lanes): `outs[slot·lat..][..lat] = E_rec(h)` for every `(rec, slot)`
    /// in `jobs` (distinct slots; headers already validated). Experts beyond
    /// a multiple of the lanes run one at a time across the pool. Each
    /// output is bit-identical to [`ExpertKernel::forward`] on its record.
    ///
    /// # Panics
    /// When a slot repeats or lies outside `outs`, or as [`ExpertKernel::forward`].
    pub fn forward_each(
        &self,
        pool: &Pool,
        books: &LayerBooks,
        jobs: &[(&[u8], usize)],
        h: &[f32],
        sc: &mut ExpertScratch,
        outs: &mut [f32],
    ) {
        let slots: Vec<usize> = jobs.iter().map(|j| j.1).collect();
        let fetch = |j: usize| Ok::<_, std::convert::Infallible>(jobs[j].0);
        let Ok(()) = self.forward_fetched(pool, books, &slots, &fetch, h, sc, outs);
    }

    /// [`ExpertKernel::forward_each`] for records that may still be on
    /// their way: job `j` writes output slot `slots[j]`, its record is
    /// `fetch(j)` (which may wait for a read, from any thread). Each lane
    /// claims the next job as soon as it finishes one, so while one thread
    /// waits for a read the others compute what has arrived; jobs are
    /// claimed in the order given (put the resident ones first). Jobs beyond
    /// a multiple of the lanes run afterwards one at a time across the pool.
    /// Outputs are bit-identical to [`ExpertKernel::forward`] whatever
    /// thread computes them.
    ///
    /// # Errors
    /// The first error `fetch` returns; the jobs not yet claimed are skipped.
    ///
    /// # Panics
    /// As [`ExpertKernel::forward_each`].
    #[allow(clippy::too_many_arguments)]
    pub fn forward_fetched<'r, E: Send>(
        &self,
        pool: &Pool,
        books: &LayerBooks,
        slots: &[usize],
        fetch: &(dyn Fn(usize) -> Result<&'r [u8], E> + Sync),
        h: &[f32],
        sc: &mut ExpertScratch,
        outs: &mut [f32],
    ) -> Result<(), E> {
        let lat = self.lay.lat;
        let lanes = lanes_in_use(sc, pool);
        let whole = if lanes > 1 { slots.len() / lanes * lanes } else { 0 };
        for (i, s) in slots.iter().enumerate() {
            assert!((s + 1) * lat <= outs.len(), "expert output slot {s} outside the buffer");
            assert!(!slots[..i].contains(s), "expert output slot {s} repeats");
        }
        if whole > 0 {
            let shared =
                Shared { t_gate: &sc.t_gate, t_up: &sc.t_up, form: sc.t_form, p_gate: &sc.p_gate, p_up: &sc.p_up };
            let os = SyncSlice::new(outs);
            claim_jobs(pool, &mut sc.lanes[..lanes], whole, fetch, &|j, rec, lane| {
                let s = slots[j];
                // SAFETY: the slots are distinct (asserted above), so are the outputs.
                let out = unsafe { os.range(s * lat, (s + 1) * lat) };
                self.run(None, (pool.level(), pool.numeric()), books, rec, h, &shared, lane, out);
            })?;
        }
        for (j, &s) in slots.iter().enumerate().skip(whole) {
            let rec = fetch(j)?;
            self.forward(pool, books, rec, h, sc, &mut outs[s * lat..(s + 1) * lat]);
        }
        Ok(())
    }

    /// Every token's gate and up tables for [`ExpertKernel::forward_groups`]
    /// into `tables` ([`ExpertKernel::token_tables_floats`] long): token
    /// `t`'s input is `xs[t·lat..][..lat]`, its tables the fast mode's with
    /// plain codes (widened side by side a tile at a time where two tokens'
    /// gathers share them), each built whole by one task of the pool. Only
    /// where [`ExpertKernel::pairs`].
    ///
    /// # Panics
    /// When `nt` exceeds the kernel's `batch`, `xs` is shorter than `nt`
    /// inputs, `tables` is too short, or the tokens cannot pair.
    pub fn prepare_tokens(&self, pool: &Pool, books: &LayerBooks, xs: &[f32], nt: usize, tables: &mut [f32]) {
        let all: Vec<usize> = (0..nt).collect();
        self.prepare_some_tokens(pool, books, xs, nt, &all, tables);
    }

    /// [`ExpertKernel::prepare_tokens`] for the tokens `which` of `nt` only
    /// (distinct, each below `nt`): their tables are built, the others'
    /// left as they were (a step whose experts come in waves builds a
    /// token's tables when a wave first needs them).
    ///
    /// # Panics
    /// As [`ExpertKernel::prepare_tokens`], or when a token of `which` is
    /// not below `nt` or repeats.
    pub fn prepare_some_tokens(
        &self,
        pool: &Pool,
        books: &LayerBooks,
        xs: &[f32],
        nt: usize,
        which: &[usize],
        tables: &mut [f32],
    ) {
        let lat = self.lay.lat;
        assert!(
            nt <= self.batch && xs.len() >= nt * lat,
            "prepare_tokens: {nt} tokens of a {}-token batch",
            self.batch
        );
        let qmax = self.fast_vq(pool.numeric(), books).expect("pairs: the fast mode, full books");
        let (pq, _) = self.pair_lens();
        assert!(pq > 0 && tables.len() >= 2 * nt * pq, "prepare_tokens: tokens that cannot pair");
        let lay = self.vq(self.lay.m, lat);
        let lv = pool.level();
        assert!(vq_fast::rows32(lv, &lay), "prepare_tokens: the level's rows do not read wide tables");
        let nb = vq_fast::blocks(&lay);
        let by_kind: [Vec<&VqBook>; 2] = [books.books[0].iter().collect(), books.books[1].iter().collect()];
        let mut seen = vec![false; nt];
        for &t in which {
            assert!(t < nt && !std::mem::replace(&mut seen[t], true), "prepare_some_tokens: token {t} of {nt}");
        }
        let tabs = SyncSlice::new(&mut tables[..2 * nt * pq]);
        pool.run(2 * which.len(), &|i| {
            let (t, kind) = (which[i / 2], i % 2);
            let at = 2 * t + kind;
            // SAFETY: the tokens are distinct (asserted above): task i alone writes table `at`.
            let buf = unsafe { tabs.range(at * pq, (at + 1) * pq) };
            let (d, q) = vq_fast::parts_mut(&lay, TableForm::Plain, buf, 0, nb);
            let x = &xs[t * lat..(t + 1) * lat];
            vq_fast::build(lv, &by_kind[kind], &lay, x, qmax, (0, nb), d, q, TableForm::Plain);
        });
    }

    /// Experts for one to four tokens each ([`GroupJob`]), over the
    /// `tables` of [`ExpertKernel::prepare_tokens`]: job `j`'s record is
    /// `fetch(j)` (which may wait for a read, from any thread), token
    /// `tokens[i]`'s output goes to `outs[slots[i]·lat..][..lat]`. A job's
    /// tokens share each row's gathers (two by the pair kernel, three or
    /// four by the quad kernel); each output is bit-identical to
    /// [`ExpertKernel::forward`] on that token alone. Lanes claim jobs in
    /// the order given, each whole on one thread; the jobs beyond a multiple
    /// of the lanes run afterwards one at a time across the pool.
    ///
    /// # Errors
    /// The first error `fetch` returns; the jobs not yet claimed are skipped.
    ///
    /// # Panics
    /// When a slot repeats or lies outside `outs`, a token is beyond the
    /// prepared ones, a job has other than 1 to 4 tokens, or the tokens
    /// cannot pair.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_groups<'r, E: Send>(
        &self,
        pool: &Pool,
        books: &LayerBooks,
        jobs: &[GroupJob],
        fetch: &(dyn Fn(usize) -> Result<&'r [u8], E> + Sync),
        tables: &[f32],
        sc: &mut ExpertScratch,
        outs: &mut [f32],
    ) -> Result<(), E> {
        let lat = self.lay.lat;
        let (lv, qmax) = (pool.level(), self.fast_vq(pool.numeric(), books).expect("pairs: the fast mode"));
        let (pq, pdn) = self.pair_lens();
        assert!(
            pq > 0 && sc.lanes.iter().all(|l| l.t_down_more.iter().all(|t| t.len() >= pdn)),
            "forward_groups: tokens that cannot pair"
        );
        // one flag a slot of `outs`: the check stays linear in the uses
        let mut seen = vec![false; outs.len() / lat.max(1)];
        for j in jobs {
            assert!((1..=4).contains(&j.n), "a job of {} tokens", j.n);
            for i in 0..j.n {
                let s = j.slots[i];
                assert!(s < seen.len(), "expert output slot {s} outside the buffer");
                assert!(!std::mem::replace(&mut seen[s], true), "expert output slot {s} repeats");
                assert!(2 * (j.tokens[i] + 1) * pq <= tables.len(), "token {} not prepared", j.tokens[i]);
            }
        }
        let table = |t: usize, kind: usize| &tables[(2 * t + kind) * pq..(2 * t + kind + 1) * pq];
        // a job's tokens past its n repeat its last (their outputs discarded)
        let tabs_of = |j: &GroupJob| {
            let tok = |i: usize| j.tokens[i.min(j.n - 1)];
            Tabs {
                gate: [0, 1, 2, 3].map(|i| table(tok(i), 0)),
                up: [0, 1, 2, 3].map(|i| table(tok(i), 1)),
                form: TableForm::Plain,
                down_form: TableForm::Plain,
                pairwise: true,
            }
        };
        let os = SyncSlice::new(outs);
        // SAFETY (both uses): the slots are distinct (asserted above), so are the outputs.
        let outs_of = |j: &GroupJob| -> [&mut [f32]; 4] {
            core::array::from_fn(|i| match i < j.n {
                true => unsafe { os.range(j.slots[i] * lat, (j.slots[i] + 1) * lat) },
                false => &mut [][..],
            })
        };
        let lanes = lanes_in_use(sc, pool);
        let whole = if lanes > 1 { jobs.len() / lanes * lanes } else { 0 };
        if whole > 0 {
            claim_jobs(pool, &mut sc.lanes[..lanes], whole, fetch, &|j, rec, lane| {
                let job = &jobs[j];
                let on_thread = |n: usize, f: &(dyn Fn(usize, usize) + Sync)| f(0, n);
                self.run_fast_vq_n(on_thread, (lv, qmax), books, rec, &tabs_of(job), job.n, lane, outs_of(job));
            })?;
        }
        for (j, job) in jobs.iter().enumerate().skip(whole) {
            let rec = fetch(j)?;
            let tabs = tabs_of(job);
            let across = |n: usize, f: &(dyn Fn(usize, usize) + Sync)| pool.chunks(n, f);
            self.run_fast_vq_n(across, (lv, qmax), books, rec, &tabs, job.n, &mut sc.lanes[0], outs_of(job));
        }
        Ok(())
    }

    /// One expert with `lane`'s buffers at `lv` in `numeric`, its rows
    /// split across `pool` (`None`: all on the calling thread).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        pool: Option<&Pool>,
        (lv, numeric): (Level, waste_quant::fast::Numeric),
        books: &LayerBooks,
        rec: &[u8],
        h: &[f32],
        shared: &Shared<'_>,
        lane: &mut ExpertLane,
        out: &mut [f32],
    ) {
        let l = &self.lay;
        let (m, lat) = (l.m, l.lat);
        let hdr = waste_format::RecordHeader::decode(rec).expect("validated record");
        let [go, uo, dof, so] = hdr.sections();
        let chunks = |n: usize, f: &(dyn Fn(usize, usize) + Sync)| match pool {
            Some(p) => p.chunks(n, f),
            None => f(0, n),
        };
        if l.quant.fmt.is_vq() {
            let lg = self.vq(m, lat);
            let ld = self.vq(lat, m);
            let scales = &rec[so..so + l.scales_len];
            let (gs, us, ds) = (&scales[..2 * m], &scales[2 * m..4 * m], &scales[4 * m..]);
            let fast = self.fast_vq(numeric, books);
            if let Some(qmax) = fast {
                return self.run_fast_vq(chunks, (lv, qmax), books, rec, shared, lane, out);
            }
            {
                let gi = &rec[go..go + lg.index_bytes()];
                let ui = &rec[uo..uo + lg.index_bytes()];
                let (g, u) = (SyncSlice::new(&mut lane.g), SyncSlice::new(&mut lane.u));
                let (tg, tu) =
                    (table_of(lv, &lg, shared.t_gate, shared.p_gate), table_of(lv, &lg, shared.t_up, shared.p_up));
                let (pg, pu) = (planes_of(lv, &lg, shared.p_gate), planes_of(lv, &lg, shared.p_up));
                let unit = row_unit(pg.is_some() || uses_vq4p_rows64(lv, &lg));
                let units = (m / unit).max(1);
                chunks(units, &|a, b| {
                    // SAFETY: disjoint row ranges [unit·a, unit·b) (the last chunk takes the tail).
                    let (ra, rb) = (unit * a, if b == units { m } else { unit * b });
                    let (gy, uy) = unsafe { (g.range(ra, rb), u.range(ra, rb)) };
                    matvec_rows_planes(lv, &lg, gi, gs, tg, pg, ra, gy);
                    matvec_rows_planes(lv, &lg, ui, us, tu, pu, ra, uy);
                });
            }
            for (gv, uv) in lane.g.iter_mut().zip(lane.u.iter()) {
                *gv = glu(self.act, *gv, *uv);
            }
            // the down table across the pool, by vector positions (each
            // position's entries are computed alike whoever computes them)
            let bd: Vec<&VqBook> = books.books[2].iter().collect();
            let per_v = ld.stages * ld.table_entries();
            let dim = l.quant.vec_dim;
            let with_planes = uses_planes(lv, &ld) && !lane.p_down.is_empty();
            let with_table = !(with_planes && planes_cover(lv, &ld));
            let tds = SyncSlice::new(&mut lane.t_down);
            let pds = SyncSlice::new(&mut lane.p_down);
            let gin = &lane.g;
            chunks(ld.nvec, &|a, b| {
                let part = VqLayout { nvec: b - a, ..ld };
                // SAFETY: the tasks' position ranges [a, b) are disjoint, so are their tables and planes.
                let t = if with_table { unsafe { tds.range(a * per_v, b * per_v) } } else { &mut [][..] };
                // SAFETY: as above (4 plane bytes per table entry).
                let p = if with_planes { unsafe { pds.range(4 * a * per_v, 4 * b * per_v) } } else { &mut [][..] };
                build_table_planes(lv, &bd, &part, &gin[a * dim..b * dim], t, p);
            });
            let di = &rec[dof..dof + ld.index_bytes()];
            let o = SyncSlice::new(out);
            let pd = planes_of(lv, &ld, &lane.p_down);
            let td = table_of(lv, &ld, &lane.t_down, &lane.p_down);
            let unit = row_unit(pd.is_some() || uses_vq4p_rows64(lv, &ld));
            let units = (lat / unit).max(1);
            chunks(units, &|a, b| {
                let (ra, rb) = (unit * a, if b == units { lat } else { unit * b });
                // SAFETY: disjoint row ranges.
                let oy = unsafe { o.range(ra, rb) };
                matvec_rows_planes(lv, &ld, di, ds, td, pd, ra, oy);
            });
        } else {
            with_dense_mats(l, rec, |[gate, up, down]| {
                // gate and up read the same input: in the fast mode it is quantized once
                match pool {
                    Some(p) => p.matmats(&mut [
                        MatJob { m: &gate, xs: h, ys: &mut lane.g },
                        MatJob { m: &up, xs: h, ys: &mut lane.u },
                    ]),
                    None => match numeric.qmax().filter(|_| waste_quant::fast::applies(&gate)) {
                        Some(q) => {
                            let qh = waste_quant::fast::quantize_at(lv, h, gate.cols_padded(), q);
                            gate.matvec_rows_fast(lv, &qh, 0, &mut lane.g);
                            up.matvec_rows_fast(lv, &qh, 0, &mut lane.u);
                        }
                        None => {
                            gate.matvec_rows(lv, h, 0, &mut lane.g);
                            up.matvec_rows(lv, h, 0, &mut lane.u);
                        }
                    },
                }
                for (gv, uv) in lane.g.iter_mut().zip(lane.u.iter()) {
                    *gv = glu(self.act, *gv, *uv);
                }
                match pool {
                    Some(p) => p.matvec(&down, &lane.g, out),
                    None => down.matvec_rows_in(lv, numeric, &lane.g, 0, out),
                }
            });
        }
    }
}

impl ExpertKernel {
    /// [`ExpertKernel::run`]'s VQ experts in the fast mode: the gate and
    /// up rows over the layer's int8 tables ([`ExpertKernel::prepare`]),
    /// the down table built by blocks of positions across `chunks`.
    #[allow(clippy::too_many_arguments)]
    fn run_fast_vq(
        &self,
        chunks: impl Fn(usize, &(dyn Fn(usize, usize) + Sync)),
        (lv, qmax): (Level, f32),
        books: &LayerBooks,
        rec: &[u8],
        shared: &Shared<'_>,
        lane: &mut ExpertLane,
        out: &mut [f32],
    ) {
        let ld = self.vq(self.lay.lat, self.lay.m);
        let tabs = Tabs {
            gate: [shared.t_gate, &[], &[], &[]],
            up: [shared.t_up, &[], &[], &[]],
            form: shared.form,
            down_form: vq_fast::table_form(lv, &ld),
            pairwise: false,
        };
        self.run_fast_vq_n(chunks, (lv, qmax), books, rec, &tabs, 1, lane, [out, &mut [], &mut [], &mut []]);
    }

    /// One fast-mode VQ expert for `n` (1 to 4) tokens: token `j`'s gate
    /// and up rows over `tabs.gate[j]` and `tabs.up[j]` (built in
    /// `tabs.form`), its down table built in `tabs.down_form` by blocks of
    /// positions across `chunks` (lane `t_down` for the first token,
    /// `t_down_more` for the others), its output in `outs[j]`. Two tokens
    /// share each row's gathers (`vq_fast::matvec_rows_pair`), three or four
    /// the quad kernel's (`vq_fast::matvec_rows_quad`: `tabs` repeats the
    /// last token's tables past `n`); each output is bit-identical to the
    /// token's expert alone.
    #[allow(clippy::too_many_arguments)]
    fn run_fast_vq_n(
        &self,
        chunks: impl Fn(usize, &(dyn Fn(usize, usize) + Sync)),
        (lv, qmax): (Level, f32),
        books: &LayerBooks,
        rec: &[u8],
        tabs: &Tabs<'_>,
        n: usize,
        lane: &mut ExpertLane,
        outs: [&mut [f32]; 4],
    ) {
        debug_assert!((1..=4).contains(&n));
        let l = &self.lay;
        let (m, lat) = (l.m, l.lat);
        let (lg, ld) = (self.vq(m, lat), self.vq(lat, m));
        let [go, uo, dof, so] = waste_format::RecordHeader::decode(rec).expect("validated record").sections();
        let scales = &rec[so..so + l.scales_len];
        let (gs, us, ds) = (&scales[..2 * m], &scales[2 * m..4 * m], &scales[4 * m..]);
        let (gi, ui) = (&rec[go..go + lg.index_bytes()], &rec[uo..uo + lg.index_bytes()]);
        let ExpertLane { t_down, g, u, t_down_more, g_more, u_more, spare, .. } = lane;
        // the kernel's inputs: four by the quad kernel, two by the pair
        // kernel (one token's table twice where `pairwise`), or one
        let width = match n {
            3 | 4 => 4,
            2 => 2,
            _ if tabs.pairwise => 2,
            _ => 1,
        };
        {
            let [gm0, gm1, gm2] = g_more;
            let [um0, um1, um2] = u_more;
            let gy: [SyncSlice<f32>; 4] =
                [SyncSlice::new(g), SyncSlice::new(gm0), SyncSlice::new(gm1), SyncSlice::new(gm2)];
            let uy: [SyncSlice<f32>; 4] =
                [SyncSlice::new(u), SyncSlice::new(um0), SyncSlice::new(um1), SyncSlice::new(um2)];
            let unit = row_unit(vq_fast::rows64(lv, &lg));
            let units = (m / unit).max(1);
            chunks(units, &|a, b| {
                let (ra, rb) = (unit * a, if b == units { m } else { unit * b });
                // SAFETY (every range below): disjoint row ranges [unit·a, unit·b) (the last
                // chunk takes the tail) of the buffers the width uses (m rows each).
                match width {
                    4 => {
                        let gq: [&mut [f32]; 4] = core::array::from_fn(|i| unsafe { gy[i].range(ra, rb) });
                        let uq: [&mut [f32]; 4] = core::array::from_fn(|i| unsafe { uy[i].range(ra, rb) });
                        vq_fast::matvec_rows_quad(lv, &lg, gi, gs, tabs.gate, ra, gq, tabs.form);
                        vq_fast::matvec_rows_quad(lv, &lg, ui, us, tabs.up, ra, uq, tabs.form);
                    }
                    2 => {
                        let gp: [&mut [f32]; 2] = core::array::from_fn(|i| unsafe { gy[i].range(ra, rb) });
                        let up: [&mut [f32]; 2] = core::array::from_fn(|i| unsafe { uy[i].range(ra, rb) });
                        let (gt, ut) = ([tabs.gate[0], tabs.gate[1]], [tabs.up[0], tabs.up[1]]);
                        vq_fast::matvec_rows_pair(lv, &lg, gi, gs, gt, ra, gp, tabs.form);
                        vq_fast::matvec_rows_pair(lv, &lg, ui, us, ut, ra, up, tabs.form);
                    }
                    _ => {
                        let (g0, u0) = unsafe { (gy[0].range(ra, rb), uy[0].range(ra, rb)) };
                        vq_fast::matvec_rows(lv, &lg, gi, gs, tabs.gate[0], ra, g0, tabs.form);
                        vq_fast::matvec_rows(lv, &lg, ui, us, tabs.up[0], ra, u0, tabs.form);
                    }
                }
            });
        }
        let bd: Vec<&VqBook> = books.books[2].iter().collect();
        let form = tabs.down_form;
        let [tm0, tm1, tm2] = t_down_more;
        let [gm0, gm1, gm2] = g_more;
        let [um0, um1, um2] = u_more;
        let mut toks: [(&mut [f32], &[f32], &mut [f32]); 4] = [
            (&mut g[..], &u[..], &mut t_down[..]),
            (&mut gm0[..], &um0[..], &mut tm0[..]),
            (&mut gm1[..], &um1[..], &mut tm1[..]),
            (&mut gm2[..], &um2[..], &mut tm2[..]),
        ];
        for (gin, uin, td) in toks.iter_mut().take(n) {
            for (gv, uv) in gin.iter_mut().zip(uin.iter()) {
                *gv = glu(self.act, *gv, *uv);
            }
            let tds = SyncSlice::new(td);
            let gin = &**gin;
            chunks(vq_fast::blocks(&ld), &|a, b| {
                let (d, q) = vq_fast::block_ranges(&ld, form, a, b);
                // SAFETY: the tasks' block ranges [a, b) are disjoint, so are their scales and codes.
                let (d, q) = unsafe { (tds.range(d.start, d.end), tds.range(q.start, q.end)) };
                vq_fast::build(lv, &bd, &ld, gin, qmax, (a, b), d, bytemuck::cast_slice_mut(q), form);
            });
        }
        let di = &rec[dof..dof + ld.index_bytes()];
        // the down tables, the last token's repeated past n; the outputs
        // past n are discarded (one spare serves: at most one is written)
        let tds: [&[f32]; 4] = {
            let all = [&*toks[0].2, &*toks[1].2, &*toks[2].2, &*toks[3].2];
            core::array::from_fn(|i| all[i.min(n - 1)])
        };
        let [o0, o1, o2, o3] = outs;
        let mut spare = Some(&mut spare[..]);
        let mut out_or_spare = |o: &'_ mut [f32], used: bool| -> SyncSlice<f32> {
            match used {
                true => SyncSlice::new(o),
                false => SyncSlice::new(spare.take().map_or(&mut [][..], |s| s)),
            }
        };
        let os = [
            SyncSlice::new(o0),
            out_or_spare(o1, n >= 2 || width < 2),
            out_or_spare(o2, n >= 3 || width < 4),
            out_or_spare(o3, n >= 4 || width < 4),
        ];
        let unit = row_unit(vq_fast::rows64(lv, &ld));
        let units = (lat / unit).max(1);
        chunks(units, &|a, b| {
            let (ra, rb) = (unit * a, if b == units { lat } else { unit * b });
            // SAFETY: disjoint row ranges of each output (lat rows each) the kernel writes.
            let rows = |i: usize| unsafe { os[i].range(ra, rb) };
            match width {
                4 => vq_fast::matvec_rows_quad(lv, &ld, di, ds, tds, ra, [rows(0), rows(1), rows(2), rows(3)], form),
                2 => vq_fast::matvec_rows_pair(lv, &ld, di, ds, [tds[0], tds[1]], ra, [rows(0), rows(1)], form),
                _ => vq_fast::matvec_rows(lv, &ld, di, ds, tds[0], ra, rows(0), form),
            }
        });
    }
}

/// Jobs `0..whole` claimed in order by `lanes` (one pool task each, lane
/// `i` on task `i`, each taking the next job as soon as it finishes one):
/// `run(j, record, lane)` once `fetch(j)` returns job `j`'s record. The
/// first error stops the claiming (no lane takes another job) and is
/// returned.
fn claim_jobs<'r, E: Send>(
    pool: &Pool,
    lanes: &mut [ExpertLane],
    whole: usize,
    fetch: &(dyn Fn(usize) -> Result<&'r [u8], E> + Sync),
    run: &(dyn Fn(usize, &[u8], &mut ExpertLane) + Sync),
) -> Result<(), E> {
    let n = lanes.len();
    let ls = SyncSlice::new(lanes);
    let next = AtomicUsize::new(0);
    let failed = Mutex::new(None);
    pool.run(n, &|i| {
        // SAFETY: task i alone uses lane i.
        let lane = unsafe { &mut ls.range(i, i + 1)[0] };
        loop {
            let j = next.fetch_add(1, Ordering::Relaxed);
            if j >= whole {
                break;
            }
            match fetch(j) {
                Ok(rec) => run(j, rec, lane),
                Err(e) => {
                    // no lane claims another job
                    next.store(usize::MAX / 2, Ordering::Relaxed);
                    failed.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                    break;
                }
            }
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The fast tables one run of [`ExpertKernel::run_fast_vq_n`] reads: each
/// token's gate and up tables (the second unused for one token), their form,
/// and the form to build the down tables in.
struct Tabs<'a> {
    gate: [&'a [f32]; 4],
    up: [&'a [f32]; 4],
    form: TableForm,
    down_form: TableForm,
    /// Every row by the pair kernel (plain tables on the gathers' level):
    /// one token's rows take its table twice, the second output discarded.
    pairwise: bool,
}

/// `f([gate, up, down])` over a validated record of a format a token reads
/// directly (F16, BF16, Q4G). Q4G's scales are read in place when the
/// record is 2-byte aligned (every cache slot is), else from a copy.
fn with_dense_mats<R>(l: &RecordLayout, rec: &[u8], f: impl FnOnce([MatRef<'_>; 3]) -> R) -> R {
    use waste_format::Fmt;
    let (m, lat) = (l.m, l.lat);
    let hdr = waste_format::RecordHeader::decode(rec).expect("validated record");
    let [go, uo, dof, so] = hdr.sections();
    let (fmt, group) = match l.quant.fmt {
        ExpertFmt::Bf16 => (Fmt::Bf16, 0),
        ExpertFmt::Q4g => (Fmt::Q4G, l.quant.fmt.group()),
        _ => (Fmt::F16, 0),
    };
    let (gl, dl) = (l.gate_len(), l.down_len());
    let bytes = &rec[so..so + l.scales_len];
    let copy: Vec<u16>;
    let scales: &[u16] = match bytemuck::try_cast_slice(bytes) {
        Ok(s) => s,
        Err(_) => {
            copy = bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
            &copy
        }
    };
    // the byte ranges of each matrix's scales, in u16
    let sc = |k: usize| {
        let b = l.scale_bytes(k);
        &scales[b.start / 2..b.end / 2]
    };
    let gate = MatRef { fmt, rows: m, cols: lat, group, data: &rec[go..go + gl], scales: sc(0) };
    let up = MatRef { data: &rec[uo..uo + gl], scales: sc(1), ..gate };
    let down = MatRef { fmt, rows: lat, cols: m, group, data: &rec[dof..dof + dl], scales: sc(2) };
    f([gate, up, down])
}

/// The tables every expert of a layer shares (built by [`ExpertKernel::prepare`]).
struct Shared<'a> {
    t_gate: &'a [f32],
    t_up: &'a [f32],
    /// The fast gate and up tables' form ([`ExpertScratch::t_form`]).
    form: TableForm,
    p_gate: &'a [u8],
    p_up: &'a [u8],
}

/// The f32 table as the kernels take it: none when the planes serve every
/// row (then it was not built).
fn table_of<'a>(level: Level, lay: &VqLayout, t: &'a [f32], p: &'a [u8]) -> &'a [f32] {
    if planes_of(level, lay, p).is_some() && planes_cover(level, lay) {
        &[]
    } else {
        t
    }
}

/// Byte planes when the level uses them and the scratch has them.
fn planes_of<'a>(level: Level, lay: &VqLayout, p: &'a [u8]) -> Option<&'a [u8]> {
    (uses_planes(level, lay) && !p.is_empty()).then_some(p)
}

/// Rows per unit of work of an expert matvec split across the pool: whole
/// 64-row groups for the 64-row kernels (byte planes, VQ4P's tables in
/// registers on AVX-512), else 16: NEON's VQ4P kernel takes 16 rows at a
/// time (from a multiple of 16), the gather kernels 8.
fn row_unit(rows64: bool) -> usize {
    if rows64 {
        64
    } else {
        16
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use waste_format::{ExpertQuant, ModelConfig, RecordLayout};
    use waste_quant::fast::Numeric;
    use waste_quant::{f32_to_f16, Level};

    /// The fast mode's VQ experts (int8 tables) stay near the exact ones —
    /// within what 8-bit tables cost — and are not the exact ones (the
    /// fast path ran); 4-bit tables (the control) are farther off.
    #[test]
    fn fast_vq_experts_are_near_exact() {
        for fmt in [ExpertFmt::Vq3r, ExpertFmt::Vq4p] {
            let (hidden, m) = (256, 128);
            let (kernel, books, recs, h) = experts(fmt, hidden, m, 2, 11);
            let run = |numeric: Numeric| {
                let mut pool = Pool::with_level(2, waste_quant::level());
                pool.set_numeric(numeric);
                let mut sc = kernel.scratch(1);
                kernel.prepare(&pool, &books, &h, &mut sc);
                let mut out = vec![0f32; hidden];
                kernel.forward(&pool, &books, &recs[1], &h, &mut sc, &mut out);
                out
            };
            let exact = run(Numeric::Exact);
            let rel = |o: &[f32]| {
                let num: f32 = o.iter().zip(&exact).map(|(a, b)| (a - b) * (a - b)).sum();
                (num / exact.iter().map(|b| b * b).sum::<f32>()).sqrt()
            };
            let (fast, control) = (run(Numeric::Fast), run(Numeric::Control4));
            assert!(
                fast.iter().zip(&exact).any(|(a, b)| a.to_bits() != b.to_bits()),
                "{fmt:?}: the fast path did not run"
            );
            assert!(rel(&fast) < 0.03, "{fmt:?}: fast {} from exact", rel(&fast));
            assert!(rel(&control) > 3.0 * rel(&fast), "{fmt:?}: control {} fast {}", rel(&control), rel(&fast));
        }
    }

    /// Random sealed records and books of a small VQ layout (`fmt` VQ3R or VQ4P).
    fn experts(
        fmt: ExpertFmt,
        hidden: usize,
        m: usize,
        n: usize,
        seed: u64,
    ) -> (ExpertKernel, LayerBooks, Vec<Vec<u8>>, Vec<f32>) {
        let q = ExpertQuant::standard(fmt);
        let cfg = ModelConfig::from_json(&serde_json::json!({"hidden_size": hidden, "num_hidden_layers": 1,
            "vocab_size": 4, "num_experts": n, "num_experts_per_token": 1, "moe_intermediate_size": m,
            "num_attention_heads": 1, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_lora_rank": 4}))
        .unwrap();
        let lay = RecordLayout::new(&cfg, q).unwrap();
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let small = |v: u64| ((v % 2001) as f32 - 1000.0) * 1e-3;
        let recs = (0..n)
            .map(|e| {
                let mut r: Vec<u8> = (0..lay.rec_bytes).map(|_| next() as u8).collect();
                for c in r[lay.scales_off..lay.scales_off + lay.scales_len].chunks_exact_mut(2) {
                    c.copy_from_slice(&f32_to_f16(0.05 + small(next()).abs()).to_le_bytes());
                }
                waste_format::seal_record(&mut r, 0, e, &lay, 0);
                r
            })
            .collect();
        let books = LayerBooks {
            books: core::array::from_fn(|_| {
                (0..q.stages)
                    .map(|_| {
                        let bits: Vec<u16> = (0..q.entries * 8).map(|_| f32_to_f16(small(next()) * 0.1)).collect();
                        VqBook::from_f16(&bits, q.entries, 8)
                    })
                    .collect()
            }),
        };
        let h = (0..hidden).map(|_| small(next())).collect();
        (ExpertKernel { lay, act: Activation::Silu, batch: 0 }, books, recs, h)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]
        /// Whole experts per thread give each expert's output bit for bit as
        /// the row-split form, and both as the scalar level, at every level,
        /// for any number of experts (whole rounds of lanes and a
        /// remainder), VQ3R and VQ4P, shapes whose rows are whole 64-row
        /// groups (the 64-row kernels alone) or not (with the gathers).
        #[test]
        fn forward_each_is_forward(wide in any::<bool>(), vq4p in any::<bool>(), fast in any::<bool>(), n in 1usize..6, threads in 1usize..4, seed in any::<u64>()) {
            let (hidden, m) = if wide { (128, 192) } else { (136, 72) };
            let fmt = if vq4p { ExpertFmt::Vq4p } else { ExpertFmt::Vq3r };
            let numeric = if fast { Numeric::Fast } else { Numeric::Exact };
            let (kernel, books, recs, h) = experts(fmt, hidden, m, n, seed);
            let mut scalar = vec![0f32; n * hidden];
            {
                let mut pool = Pool::with_level(1, Level::Scalar);
                pool.set_numeric(numeric);
                let mut sc = kernel.scratch(1);
                kernel.prepare(&pool, &books, &h, &mut sc);
                for (e, r) in recs.iter().enumerate() {
                    kernel.forward(&pool, &books, r, &h, &mut sc, &mut scalar[e * hidden..(e + 1) * hidden]);
                }
            }
            for lv in Level::available() {
                let mut pool = Pool::with_level(threads, lv);
                pool.set_numeric(numeric);
                let mut sc = kernel.scratch(lanes_for(threads, n));
                kernel.prepare(&pool, &books, &h, &mut sc);
                let mut want = vec![0f32; n * hidden];
                for (e, r) in recs.iter().enumerate() {
                    kernel.forward(&pool, &books, r, &h, &mut sc, &mut want[e * hidden..(e + 1) * hidden]);
                }
                prop_assert!(want.iter().all(|v| v.is_finite()));
                prop_assert!(want.iter().zip(&scalar).all(|(x, y)| x.to_bits() == y.to_bits()), "level {:?} against scalar", lv);
                // slots in reverse: the output order is the caller's
                let jobs: Vec<(&[u8], usize)> = recs.iter().enumerate().map(|(e, r)| (&r[..], n - 1 - e)).collect();
                let mut got = vec![f32::NAN; n * hidden];
                kernel.forward_each(&pool, &books, &jobs, &h, &mut sc, &mut got);
                for e in 0..n {
                    let (a, b) = (&want[e * hidden..(e + 1) * hidden], &got[(n - 1 - e) * hidden..(n - e) * hidden]);
                    prop_assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "expert {} level {:?}", e, lv);
                }
                // records "arriving" late and out of order, claimed by whichever lane is free
                let slots: Vec<usize> = (0..n).map(|e| (e + 1) % n).collect();
                let fetch = |j: usize| {
                    if j.is_multiple_of(2) {
                        std::thread::sleep(std::time::Duration::from_micros(200));
                    }
                    Ok::<_, ()>(&recs[j][..])
                };
                let mut got = vec![f32::NAN; n * hidden];
                prop_assert!(kernel.forward_fetched(&pool, &books, &slots, &fetch, &h, &mut sc, &mut got).is_ok());
                for e in 0..n {
                    let s = (e + 1) % n;
                    let (a, b) = (&want[e * hidden..(e + 1) * hidden], &got[s * hidden..(s + 1) * hidden]);
                    prop_assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "fetched {} level {:?}", e, lv);
                }
            }
        }
    }

    /// Experts for groups of tokens (`forward_groups` over `prepare_tokens`'
    /// tables) give every token's output bit for bit as the expert alone
    /// on it: jobs of up to two and of up to four tokens (pairs, quads,
    /// three by the quad kernel, odd ones out), on 1 to 3 threads (whole
    /// jobs per lane and a remainder across the pool), rows of whole 32-row
    /// groups and not, at the AVX2 level with the gathers (where the CPU
    /// has it).
    #[test]
    fn groups_are_each_token_alone() {
        if !Level::Avx2.supported() {
            return;
        }
        waste_quant::vq_fast::set_avx2_lookup(waste_quant::vq_fast::Avx2Lookup::Gathers);
        for (hidden, m) in [(128, 192), (136, 72)] {
            let (mut kernel, books, recs, _) = experts(ExpertFmt::Vq3r, hidden, m, 4, 5 + m as u64);
            kernel.batch = 5;
            assert!(kernel.pairable());
            let mut r = 99u64;
            let xs: Vec<f32> = (0..5 * hidden)
                .map(|_| {
                    r = r.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((r >> 40) % 2001) as f32 * 1e-3 - 1.0
                })
                .collect();
            // expert e's users: 0 takes all five tokens (a quad and one
            // alone, or two pairs and one), 1 takes three (a quad with a
            // repeat, or a pair and one), 2 one, 3 two
            let users: [&[usize]; 4] = [&[0, 1, 2, 3, 4], &[2, 0, 4], &[1], &[3, 1]];
            for threads in 1..4 {
                let mut pool = Pool::with_level(threads, Level::Avx2);
                pool.set_numeric(Numeric::Fast);
                assert!(kernel.pairs(&pool, &books));
                let mut sc = kernel.scratch(lanes_for(threads, 2));
                let mut want = vec![vec![0f32; hidden]; 5 * 4];
                for t in 0..5 {
                    let h = &xs[t * hidden..(t + 1) * hidden];
                    kernel.prepare(&pool, &books, h, &mut sc);
                    for e in 0..4 {
                        kernel.forward(&pool, &books, &recs[e], h, &mut sc, &mut want[t * 4 + e]);
                    }
                }
                let mut tables = vec![0f32; kernel.token_tables_floats()];
                kernel.prepare_tokens(&pool, &books, &xs, 5, &mut tables);
                let uses: Vec<Vec<(usize, usize)>> =
                    users.iter().enumerate().map(|(e, u)| u.iter().map(|&t| (t, t * 4 + e)).collect()).collect();
                for most in [2, 4] {
                    let jobs = group_jobs(uses.iter().map(|u| &u[..]), most);
                    let sizes: Vec<usize> = jobs.iter().map(|j| j.n).collect();
                    let want_sizes: &[usize] = if most == 4 { &[4, 1, 3, 1, 2] } else { &[2, 2, 1, 2, 1, 1, 2] };
                    assert_eq!(sizes, want_sizes);
                    let fetch = |j: usize| Ok::<_, ()>(&recs[jobs[j].of][..]);
                    let mut got = vec![f32::NAN; 20 * hidden];
                    assert!(kernel.forward_groups(&pool, &books, &jobs, &fetch, &tables, &mut sc, &mut got).is_ok());
                    for (e, u) in users.iter().enumerate() {
                        for &t in u.iter() {
                            let s = t * 4 + e;
                            let same = got[s * hidden..(s + 1) * hidden]
                                .iter()
                                .zip(&want[s])
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{hidden}x{m}, {threads} threads, jobs of {most}: expert {e} token {t}");
                        }
                    }
                }
            }
        }
    }

    /// Random sealed records of a format a token reads directly (Q4G with
    /// rows of whole and of padded groups, F16, BF16), finite everywhere.
    fn dense_experts(fmt: ExpertFmt, hidden: usize, m: usize, n: usize, seed: u64) -> (ExpertKernel, Vec<Vec<u8>>) {
        let cfg = ModelConfig::from_json(&serde_json::json!({"hidden_size": hidden, "num_hidden_layers": 1,
            "vocab_size": 4, "num_experts": n, "num_experts_per_token": 1, "moe_intermediate_size": m,
            "num_attention_heads": 1, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_lora_rank": 4}))
        .unwrap();
        let lay = RecordLayout::new(&cfg, ExpertQuant::standard(fmt)).unwrap();
        let mut rng = waste_quant::SplitMix64::new(seed);
        let recs = (0..n)
            .map(|e| {
                let mut r = vec![0u8; lay.rec_bytes];
                for b in &mut r[lay.gate_off..lay.scales_off] {
                    *b = rng.next_u64() as u8;
                }
                // finite halves: small weights (F16) or small scales (Q4G)
                let halves = if fmt == ExpertFmt::Q4g {
                    lay.scales_off..lay.scales_off + lay.scales_len
                } else {
                    lay.gate_off..lay.scales_off
                };
                let half = if fmt == ExpertFmt::Bf16 { waste_quant::f32_to_bf16 } else { f32_to_f16 };
                for c in r[halves].chunks_exact_mut(2) {
                    let v = ((rng.next_u64() % 2001) as f32 - 1000.0) * 2e-5;
                    c.copy_from_slice(&half(v).to_le_bytes());
                }
                waste_format::seal_record(&mut r, 0, e, &lay, 0);
                r
            })
            .collect();
        (ExpertKernel { lay, act: Activation::Silu, batch: 5 }, recs)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(8))]
        /// An expert over a batch of tokens gives each token's output bit
        /// for bit as the one-token form, at every level and thread count,
        /// for Q4G (whole and padded groups) and F16 records.
        #[test]
        fn forward_batch_is_forward(q4g in any::<bool>(), padded in any::<bool>(), n in 1usize..6, threads in 1usize..4, seed in any::<u64>()) {
            let fmt = if q4g { ExpertFmt::Q4g } else { ExpertFmt::F16 };
            let (hidden, m) = if padded { (200, 72) } else { (256, 128) };
            let (kernel, recs) = dense_experts(fmt, hidden, m, 2, seed);
            prop_assert!(kernel.batches());
            let books = LayerBooks::default();
            let xs: Vec<f32> = (0..n * hidden).map(|i| ((i * 7919 + seed as usize) % 2001) as f32 * 1e-3 - 1.0).collect();
            for lv in Level::available() {
                let pool = Pool::with_level(threads, lv);
                let mut sc = kernel.scratch(lanes_for(threads, 2));
                for rec in &recs {
                    sc.batch_in[..n * hidden].copy_from_slice(&xs);
                    kernel.forward_batch(&pool, rec, n, &mut sc);
                    let got = sc.batch_out[..n * hidden].to_vec();
                    for t in 0..n {
                        let mut want = vec![0f32; hidden];
                        kernel.forward(&pool, &books, rec, &xs[t * hidden..(t + 1) * hidden], &mut sc, &mut want);
                        prop_assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|v| *v != 0.0));
                        let b = &got[t * hidden..(t + 1) * hidden];
                        prop_assert!(want.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "token {} level {:?} {:?}", t, lv, fmt);
                    }
                }
            }
        }
    }

    /// The batch form for a Q4G record equals the weights the format
    /// defines (dequantized independently: nibble − 8 times the group's
    /// scale), to rounding.
    #[test]
    fn q4g_expert_matches_its_dequantized_weights() {
        let (kernel, recs) = dense_experts(ExpertFmt::Q4g, 200, 72, 1, 3);
        let l = kernel.lay;
        let rec = &recs[0];
        let (gs, _) = l.scale_counts();
        let w = |off: usize, so: usize, rows: usize, cols: usize| -> Vec<f32> {
            let (rb, sr) = (cols.div_ceil(128) * 64, cols.div_ceil(128));
            let mut out = vec![0f32; rows * cols];
            for r in 0..rows {
                for c in 0..cols {
                    let b = rec[off + r * rb + c / 2];
                    let q = if c % 2 == 0 { b & 15 } else { b >> 4 } as f32 - 8.0;
                    let s = so + 2 * (r * sr + c / 128);
                    out[r * cols + c] = q * waste_quant::f16_to_f32(u16::from_le_bytes([rec[s], rec[s + 1]]));
                }
            }
            out
        };
        let (m, lat) = (l.m, l.lat);
        let (wg, wu) = (w(l.gate_off, l.scales_off, m, lat), w(l.up_off, l.scales_off + 2 * gs, m, lat));
        let wd = w(l.down_off, l.scales_off + 4 * gs, lat, m);
        let x: Vec<f32> = (0..lat).map(|i| (i as f32 * 0.37).sin()).collect();
        let dot = |w: &[f32], r: usize, v: &[f32]| -> f64 {
            v.iter().enumerate().map(|(c, &x)| w[r * v.len() + c] as f64 * x as f64).sum()
        };
        let act: Vec<f32> =
            (0..m).map(|r| glu(Activation::Silu, dot(&wg, r, &x) as f32, dot(&wu, r, &x) as f32)).collect();
        let want: Vec<f64> = (0..lat).map(|r| dot(&wd, r, &act)).collect();
        let pool = Pool::new(2);
        let mut sc = kernel.scratch(1);
        let mut got = vec![0f32; lat];
        kernel.forward(&pool, &LayerBooks::default(), rec, &x, &mut sc, &mut got);
        let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
        assert!(scale > 0.0);
        for (g, w) in got.iter().zip(&want) {
            assert!((*g as f64 - w).abs() <= 1e-4 * scale, "{g} vs {w}");
        }
    }

    /// Every registered expert format (waste_format::EXPERT_FORMATS): its
    /// records compute the same bits at every level this CPU has as at the
    /// scalar level (the definition), finite and not all zero, and the
    /// kernel names itself at each level (what `bench` reports).
    #[test]
    fn every_registered_expert_format_is_the_definition_at_every_level() {
        for spec in &waste_format::EXPERT_FORMATS {
            let (kernel, books, recs, h) = if spec.fmt.is_vq() {
                experts(spec.fmt, 136, 72, 2, 11)
            } else {
                let (k, r) = dense_experts(spec.fmt, 200, 72, 2, 11);
                let h = (0..200).map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-2).collect();
                (k, LayerBooks::default(), r, h)
            };
            assert_eq!(kernel.lay.quant, ExpertQuant::standard(spec.fmt));
            let run = |lv: Level| {
                let pool = Pool::with_level(1, lv);
                let mut sc = kernel.scratch(1);
                kernel.prepare(&pool, &books, &h, &mut sc);
                let mut out = vec![0f32; recs.len() * h.len()];
                for (r, o) in recs.iter().zip(out.chunks_mut(h.len())) {
                    kernel.forward(&pool, &books, r, &h, &mut sc, o);
                }
                out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            };
            let want = run(Level::Scalar);
            assert!(want.iter().all(|&b| f32::from_bits(b).is_finite()), "{}", spec.name);
            assert!(want.iter().any(|&b| b << 1 != 0), "{}: all zero", spec.name);
            for lv in Level::available() {
                assert_eq!(run(lv), want, "{} at {lv:?}", spec.name);
                assert!(!kernel.kernel_name(lv, Numeric::Exact).is_empty());
            }
        }
    }

    /// A record that cannot be had stops the step with its error, in the
    /// whole-per-thread part and in the remainder alike.
    #[test]
    fn a_failed_fetch_is_returned() {
        let (kernel, books, recs, h) = experts(ExpertFmt::Vq3r, 136, 72, 5, 7);
        let pool = Pool::new(2);
        let mut sc = kernel.scratch(2);
        kernel.prepare(&pool, &books, &h, &mut sc);
        let slots: Vec<usize> = (0..5).collect();
        for bad in [1, 4] {
            let fetch = |j: usize| if j == bad { Err(j) } else { Ok(&recs[j][..]) };
            let mut out = vec![0f32; 5 * 136];
            assert_eq!(kernel.forward_fetched(&pool, &books, &slots, &fetch, &h, &mut sc, &mut out), Err(bad));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The top k by selection and a sort of those k are the full sort's
        /// first k, ties (equal scores, repeated logits) by the lower id.
        #[test]
        fn routing_selects_what_the_full_sort_does(
            logits in prop::collection::vec(prop::sample::select(vec![-2.0f32, -0.5, 0.0, -0.0, 0.25, 1.5, 3.0]), 1..40),
            top_k in 0usize..10,
            seed in any::<u64>(),
        ) {
            let e = logits.len();
            let mut r = seed;
            let bias: Vec<f32> = (0..e).map(|_| { r = r.wrapping_mul(6364136223846793005).wrapping_add(1); [0.0, 0.0, 0.5][(r >> 62) as usize % 3] }).collect();
            let c = RouterConfig { experts: e, top_k: top_k.min(e), n_group: 1, topk_group: 1, renormalize: true, scaling: 2.0 };
            let mut got = Vec::new();
            route(&c, &logits, &bias, &mut got);
            let choice: Vec<f32> = logits.iter().zip(&bias).map(|(&l, b)| sigmoid(l) + b).collect();
            let mut idx: Vec<usize> = (0..e).collect();
            idx.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
            let want: Vec<usize> = idx[..c.top_k].to_vec();
            prop_assert_eq!(got.iter().map(|x| x.0).collect::<Vec<_>>(), want);
        }
    }

    #[test]
    fn router_bias_selects_but_does_not_weigh() {
        let c = RouterConfig { experts: 4, top_k: 2, n_group: 1, topk_group: 1, renormalize: true, scaling: 2.0 };
        let logits = [2.0, 1.0, 0.0, -1.0];
        let bias = [0.0, 0.0, 5.0, 0.0];
        let mut out = vec![];
        route(&c, &logits, &bias, &mut out);
        assert_eq!(out.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 0]);
        let (s2, s0) = (sigmoid(0.0), sigmoid(2.0));
        assert!((out[0].1 - 2.0 * s2 / (s2 + s0)).abs() < 1e-6);
        assert!((out[0].1 + out[1].1 - 2.0).abs() < 1e-6);
    }

    #[test]
    fn ties_go_to_the_lowest_id_and_groups_limit() {
        let c = RouterConfig { experts: 4, top_k: 2, n_group: 1, topk_group: 1, renormalize: false, scaling: 1.0 };
        let mut out = vec![];
        route(&c, &[1.0; 4], &[0.0; 4], &mut out);
        assert_eq!(out.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        // two groups of two: group 1 holds the best pair-sum, so both picks come from it
        let c = RouterConfig { experts: 4, top_k: 2, n_group: 2, topk_group: 1, renormalize: false, scaling: 1.0 };
        route(&c, &[3.0, -3.0, 1.0, 1.0], &[0.0; 4], &mut out);
        assert_eq!(out.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 3]);
    }
}
