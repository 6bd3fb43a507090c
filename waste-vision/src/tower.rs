//! The tower (ViT) and the projector: patches in, one text-width row per
//! merged 2×2 tile out (MODEL.md, "Vision").
//!
//! Every product goes through `waste-quant`'s canonical matmat — the
//! weights, and attention too (scores as keys × queries, outputs as the
//! transposed values × probabilities) — so the result is bit-identical at
//! every SIMD level and thread count. Elementwise work (norms, RoPE,
//! softmax, GELU) is per element or per row, the same on every split.

use crate::config::{VisionConfig, MAX_PATCHES_LIMIT, PATCH, PATCH_VALUES, PROJ_EPS, TOWER_EPS};
use crate::image::{taps, Pixels};
use crate::{Error, Result};
use waste_quant::ops::{erf, rmsnorm, rmsnorm_inplace, softmax, tanh};
use waste_quant::{f32_matrix, Matrix, Pool, SyncSlice};

struct Block {
    norm0: Vec<f32>,
    wqkv: Matrix,
    wo: Matrix,
    norm1: Vec<f32>,
    fc0: Matrix,
    fc1: Matrix,
}

/// The loaded tower and projector.
pub struct Tower {
    cfg: VisionConfig,
    patch: Matrix,
    /// The learned position grid `[pos_h][pos_w][hidden]`.
    pos: Vec<f32>,
    blocks: Vec<Block>,
    final_norm: Vec<f32>,
    proj0: Matrix,
    proj2: Matrix,
    post_norm: Vec<f32>,
    bytes: u64,
}

/// Loads one tensor by its full name as a matrix.
pub type Loader<'a> = dyn FnMut(&str) -> Result<Matrix> + 'a;

fn matrix(load: &mut Loader<'_>, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
    let m = load(name)?;
    if (m.rows, m.cols) != (rows, cols) {
        return Err(Error::Weights(format!("{name}: shape {}x{}, the tower needs {rows}x{cols}", m.rows, m.cols)));
    }
    Ok(m)
}

/// The patch embedding `[hidden, 3·14·14]`: stored flattened, as this
/// project's converter writes it, or as the release's conv weight `[hidden,
/// 3, 14, 14]`, as the C WASTE's converter writes it — which a container's
/// reader folds to `[hidden·3·14, 14]` (every dimension but the last as
/// rows). Both hold the same values in the same order (channel, y, x), so an
/// ungrouped format keeps its bytes and only the shape changes; a grouped
/// one (its scale groups run along the stored last dimension) is
/// dequantized to F32 — exact, and what [`conv_patch_bytes`] plans for.
fn patch_matrix(load: &mut Loader<'_>, name: &str, d: usize) -> Result<Matrix> {
    let m = load(name)?;
    if (m.rows, m.cols) == (d, PATCH_VALUES) {
        return Ok(m);
    }
    if Some(m.rows) != d.checked_mul(3 * PATCH) || m.cols != PATCH {
        return Err(Error::Weights(format!(
            "{name}: shape {}x{}, the tower needs {d}x{PATCH_VALUES} or the conv [{d}, 3, {PATCH}, {PATCH}]",
            m.rows, m.cols
        )));
    }
    let (fmt, data): (_, waste_quant::Payload) = if m.fmt.is_grouped() {
        (waste_format::Fmt::F32, m.to_f32().iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into())
    } else {
        (m.fmt, m.data)
    };
    Matrix::from_payload(fmt, d, PATCH_VALUES, 0, data, &[]).map_err(|e| Error::Weights(format!("{name}: {e}")))
}

/// Bytes the patch embedding takes once loaded when it is stored as the
/// conv `[hidden, 3, 14, 14]` in a grouped format ([`Tower::load`] makes it
/// F32); `None` when it loads as stored.
pub fn conv_patch_bytes(stored_shape: &[usize], grouped: bool) -> Option<u64> {
    (grouped && stored_shape.len() == 4).then(|| 4 * stored_shape.iter().map(|&x| x as u64).product::<u64>())
}

fn vector(load: &mut Loader<'_>, name: &str, n: usize) -> Result<Vec<f32>> {
    let m = load(name)?;
    let v = m.to_f32();
    if v.len() != n {
        return Err(Error::Weights(format!("{name}: {} values, the tower needs {n}", v.len())));
    }
    Ok(v)
}

/// `f` on every element, split across the pool (each element alone, so any split gives the same bits).
fn par_map(pool: &Pool, v: &mut [f32], f: fn(f32) -> f32) {
    let n = v.len();
    let s = SyncSlice::new(v);
    pool.chunks(n, &|a, b| {
        // SAFETY: chunks are disjoint ranges of the slice.
        for x in unsafe { s.range(a, b) } {
            *x = f(*x);
        }
    });
}

/// GELU, tanh approximation (the tower's MLP).
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + tanh(C * (x + 0.044715 * x * x * x)))
}

/// GELU, exact (the projector).
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

impl Tower {
    /// Load every tensor of [`VisionConfig::tensors`] through `load`,
    /// checking its shape. The patch embedding may be stored flattened
    /// `[hidden, 588]` (the conv `[hidden, 3, 14, 14]` loads as that), the
    /// position grid as `[h·w, hidden]` or `[h, w, hidden]`.
    ///
    /// # Errors
    /// The loader's errors, and [`Error::Weights`] naming a tensor whose shape is wrong.
    pub fn load(cfg: &VisionConfig, load: &mut Loader<'_>) -> Result<Tower> {
        let (d, q, i) = (cfg.hidden, cfg.qkv_hidden, cfg.intermediate);
        let patch = patch_matrix(load, "vision_tower.patch_embed.proj.weight", d)?;
        let pos = vector(load, "vision_tower.patch_embed.pos_emb.weight", cfg.pos_h * cfg.pos_w * d)?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for b in 0..cfg.layers {
            let p = format!("vision_tower.encoder.blocks.{b}.");
            blocks.push(Block {
                norm0: vector(load, &format!("{p}norm0.weight"), d)?,
                wqkv: matrix(load, &format!("{p}wqkv.weight"), 3 * q, d)?,
                wo: matrix(load, &format!("{p}wo.weight"), d, q)?,
                norm1: vector(load, &format!("{p}norm1.weight"), d)?,
                fc0: matrix(load, &format!("{p}mlp.fc0.weight"), i, d)?,
                fc1: matrix(load, &format!("{p}mlp.fc1.weight"), d, i)?,
            });
        }
        let final_norm = vector(load, "vision_tower.encoder.final_layernorm.weight", d)?;
        let proj0 = matrix(load, "mm_projector.proj.0.weight", 4 * d, 4 * d)?;
        let proj2 = matrix(load, "mm_projector.proj.2.weight", cfg.text_hidden, 4 * d)?;
        let post_norm = vector(load, "mm_projector.post_norm.weight", cfg.text_hidden)?;
        let mut bytes = 4 * (pos.len() + final_norm.len() + post_norm.len()) as u64;
        for m in [&patch, &proj0, &proj2] {
            bytes += m.heap_bytes() as u64;
        }
        for b in &blocks {
            bytes += 4 * (b.norm0.len() + b.norm1.len()) as u64;
            for m in [&b.wqkv, &b.wo, &b.fc0, &b.fc1] {
                bytes += m.heap_bytes() as u64;
            }
        }
        Ok(Tower { cfg: cfg.clone(), patch, pos, blocks, final_norm, proj0, proj2, post_norm, bytes })
    }

    /// A tower of the config's shapes with random weights — Q8G matrices
    /// (the converter's default) and F32 norms and position grid near 1 —
    /// for benchmarks and tests of everything but the values.
    ///
    /// # Panics
    /// Never for a validated config (the shapes are its own).
    pub fn random(cfg: &VisionConfig, seed: u64) -> Tower {
        use waste_format::Fmt;
        let mut rng = waste_quant::SplitMix64::new(seed);
        let shapes: std::collections::HashMap<String, (usize, usize)> =
            cfg.tensors().into_iter().map(|(n, r, k)| (n, (r, k))).collect();
        Tower::load(cfg, &mut |name: &str| {
            let (r, k) = shapes[name];
            if r == 1 || name.contains("pos_emb") {
                let v: Vec<u8> =
                    (0..r * k).flat_map(|_| (1.0 + 0.1 * (2.0 * rng.unif() - 1.0)).to_le_bytes()).collect();
                return Ok(Matrix::from_stored(Fmt::F32, r, k, 0, v, &[]).expect("an F32 vector"));
            }
            let g = 128;
            let kp = k.div_ceil(g) * g;
            let mut data = vec![0u8; r * kp];
            rng.fill(&mut data);
            // int8 codes up to ±127: rows of unit-ish gain
            let scale = waste_quant::f32_to_f16(1.0 / 127.0 / (k as f32).sqrt()).to_le_bytes();
            let scales: Vec<u8> = (0..r * kp / g).flat_map(|_| scale).collect();
            Ok(Matrix::from_stored(Fmt::Q8G, r, k, g, data, &scales).expect("a Q8G matrix"))
        })
        .expect("random weights have the config's shapes")
    }

    /// The configuration it was loaded with.
    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// Heap bytes of the loaded weights.
    pub fn weight_bytes(&self) -> u64 {
        self.bytes
    }

    /// The position grid resized to `gh × gw` (bilinear, half-pixel
    /// centres; copied when the sizes match), `[gh·gw][hidden]`.
    fn positions(&self, gw: usize, gh: usize) -> Vec<f32> {
        let (d, sw, sh) = (self.cfg.hidden, self.cfg.pos_w, self.cfg.pos_h);
        if (gw, gh) == (sw, sh) {
            return self.pos.clone();
        }
        let (xs, ys) = (taps(sw, gw), taps(sh, gh));
        let mut out = vec![0f32; gw * gh * d];
        for (y, &(y0, y1, wy)) in ys.iter().enumerate() {
            for (x, &(x0, x1, wx)) in xs.iter().enumerate() {
                let row = |yy: usize, xx: usize| &self.pos[(yy * sw + xx) * d..][..d];
                let (a, b, c, e) = (row(y0, x0), row(y0, x1), row(y1, x0), row(y1, x1));
                let o = &mut out[(y * gw + x) * d..][..d];
                for k in 0..d {
                    let top = (1.0 - wx) * a[k] + wx * b[k];
                    let bot = (1.0 - wx) * c[k] + wx * e[k];
                    o[k] = (1.0 - wy) * top + wy * bot;
                }
            }
        }
        out
    }

    /// The patch embedding plus positions, `[patches][hidden]` (the tower's
    /// first stage; exposed for the oracle comparison).
    ///
    /// # Errors
    /// [`Error::Image`] when the pixels do not match their grid (odd sides,
    /// too many patches, a wrong length).
    pub fn embed(&self, pool: &Pool, px: &Pixels) -> Result<Vec<f32>> {
        let g = px.grid;
        let n = g.patches();
        if g.gw < 2 || g.gh < 2 || !g.gw.is_multiple_of(2) || !g.gh.is_multiple_of(2) || n > MAX_PATCHES_LIMIT {
            return Err(Error::Image(format!("a {}x{} patch grid is not even or too large", g.gw, g.gh)));
        }
        if px.patches.len() != n * PATCH_VALUES {
            return Err(Error::Image(format!("{} pixel values for {n} patches", px.patches.len())));
        }
        let d = self.cfg.hidden;
        let mut x = vec![0f32; n * d];
        pool.matmat(&self.patch.view(), &px.patches, n, &mut x);
        for (xi, p) in x.iter_mut().zip(self.positions(g.gw, g.gh)) {
            *xi += p;
        }
        Ok(x)
    }

    /// Encode one image: `grid.positions()` rows of the text model's width,
    /// in order (merged tiles row-major).
    ///
    /// # Errors
    /// As [`Tower::embed`]; [`Error::Weights`] when a block's or the
    /// projector's output is not finite (weights that overflow), naming it.
    pub fn encode(&self, pool: &Pool, px: &Pixels) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let g = px.grid;
        let n = g.patches();
        let (d, q, hd, ff) = (c.hidden, c.qkv_hidden, c.head_dim(), c.intermediate);
        let mut x = self.embed(pool, px)?;
        let rope = rope_table(g.gw, g.gh, hd);
        let mut y = vec![0f32; n * d];
        let mut qkv = vec![0f32; n * 3 * q];
        let mut att = vec![0f32; n * q];
        let mut act = vec![0f32; n * ff];
        let mut heads = HeadScratch::new(n, hd);
        for (bi, b) in self.blocks.iter().enumerate() {
            for t in 0..n {
                rmsnorm(&x[t * d..][..d], &b.norm0, TOWER_EPS, &mut y[t * d..][..d]);
            }
            pool.matmat(&b.wqkv.view(), &y, n, &mut qkv);
            for t in 0..n {
                let r = &rope[t * hd / 2..][..hd / 2];
                let tok = &mut qkv[t * 3 * q..][..2 * q];
                for v in tok.chunks_exact_mut(hd) {
                    rotate(v, r);
                }
            }
            for h in 0..c.heads {
                heads.attend(pool, &qkv, q, h, &mut att);
            }
            pool.matmat(&b.wo.view(), &att, n, &mut y);
            add(&mut x, &y);
            for t in 0..n {
                rmsnorm(&x[t * d..][..d], &b.norm1, TOWER_EPS, &mut y[t * d..][..d]);
            }
            pool.matmat(&b.fc0.view(), &y, n, &mut act);
            par_map(pool, &mut act, gelu_tanh);
            pool.matmat(&b.fc1.view(), &act, n, &mut y);
            add(&mut x, &y);
            finite(&x, d, || format!("block {bi}'s output"))?;
        }
        for t in 0..n {
            rmsnorm(&x[t * d..][..d], &self.final_norm, TOWER_EPS, &mut y[t * d..][..d]);
        }
        // 2×2 merge: tile (a, b) is patches (2a, 2b), (2a, 2b+1), (2a+1, 2b), (2a+1, 2b+1)
        let (mh, mw) = (g.gh / 2, g.gw / 2);
        let m = mh * mw;
        let mut merged = vec![0f32; m * 4 * d];
        for a in 0..mh {
            for bb in 0..mw {
                let dst = &mut merged[(a * mw + bb) * 4 * d..][..4 * d];
                for (k, (dy, dx)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
                    let src = ((2 * a + dy) * g.gw + 2 * bb + dx) * d;
                    dst[k * d..(k + 1) * d].copy_from_slice(&y[src..src + d]);
                }
            }
        }
        let mut mid = vec![0f32; m * 4 * d];
        pool.matmat(&self.proj0.view(), &merged, m, &mut mid);
        par_map(pool, &mut mid, gelu_erf);
        let th = c.text_hidden;
        let mut out = vec![0f32; m * th];
        pool.matmat(&self.proj2.view(), &mid, m, &mut out);
        for row in out.chunks_exact_mut(th) {
            rmsnorm_inplace(row, &self.post_norm, PROJ_EPS);
        }
        finite(&out, th, || "the projector's output".into())?;
        Ok(out)
    }
}

/// [`Error::Weights`] naming `what` and the first row and value when `v`
/// (rows of `width`) holds an infinite or NaN value: weights that load as
/// finite but overflow end here, not as garbage rows in the text model.
fn finite(v: &[f32], width: usize, what: impl FnOnce() -> String) -> Result<()> {
    let Some(i) = waste_quant::ops::first_non_finite(v) else { return Ok(()) };
    Err(Error::Weights(format!(
        "the tower computed a non-finite value ({}) in {} (row {}): the vision weights are damaged or overflow",
        v[i],
        what(),
        i / width.max(1)
    )))
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// cos/sin per token and rotation pair: pair `j` of a head (dims 2j, 2j+1)
/// turns by `pos · 10000^(−4⌊j/2⌋/hd)`, pos the column for even `j` and the
/// row for odd `j`. Angles in f64, then rounded.
fn rope_table(gw: usize, gh: usize, hd: usize) -> Vec<(f32, f32)> {
    let half = hd / 2;
    let mut t = Vec::with_capacity(gw * gh * half);
    for i in 0..gw * gh {
        let (col, row) = ((i % gw) as f64, (i / gw) as f64);
        for j in 0..half {
            let f = 10000f64.powf(-((4 * (j / 2)) as f64) / hd as f64);
            let a = if j % 2 == 0 { col } else { row } * f;
            t.push((a.cos() as f32, a.sin() as f32));
        }
    }
    t
}

fn rotate(v: &mut [f32], r: &[(f32, f32)]) {
    for (p, &(cs, sn)) in v.chunks_exact_mut(2).zip(r) {
        let (a, b) = (p[0], p[1]);
        p[0] = a * cs - b * sn;
        p[1] = a * sn + b * cs;
    }
}

/// One head's contiguous queries, keys, transposed values and scores.
struct HeadScratch {
    n: usize,
    hd: usize,
    qh: Vec<f32>,
    kh: Vec<f32>,
    vt: Vec<f32>,
    scores: Vec<f32>,
    oh: Vec<f32>,
}

impl HeadScratch {
    fn new(n: usize, hd: usize) -> HeadScratch {
        HeadScratch {
            n,
            hd,
            qh: vec![0.0; n * hd],
            kh: vec![0.0; n * hd],
            vt: vec![0.0; n * hd],
            scores: vec![0.0; n * n],
            oh: vec![0.0; n * hd],
        }
    }

    /// Bidirectional softmax attention of head `h` over every token;
    /// writes the head's slice of each token's output in `att` (`n × q`).
    fn attend(&mut self, pool: &Pool, qkv: &[f32], q: usize, h: usize, att: &mut [f32]) {
        let (n, hd) = (self.n, self.hd);
        for t in 0..n {
            let base = t * 3 * q + h * hd;
            self.qh[t * hd..][..hd].copy_from_slice(&qkv[base..base + hd]);
            self.kh[t * hd..][..hd].copy_from_slice(&qkv[base + q..base + q + hd]);
            for k in 0..hd {
                self.vt[k * n + t] = qkv[base + 2 * q + k];
            }
        }
        // scores[i][j] = k_j · q_i
        pool.matmat(&f32_matrix(n, hd, &self.kh), &self.qh, n, &mut self.scores);
        let scale = 1.0 / (hd as f32).sqrt();
        let s = SyncSlice::new(&mut self.scores);
        pool.chunks(n, &|a, b| {
            // SAFETY: rows a..b of the scores, disjoint between chunks.
            let rows = unsafe { s.range(a * n, b * n) };
            for row in rows.chunks_exact_mut(n) {
                for v in row.iter_mut() {
                    *v *= scale;
                }
                softmax(row);
            }
        });
        // o_i[k] = Σ_j p_ij · v_j[k]
        pool.matmat(&f32_matrix(hd, n, &self.vt), &self.scores, n, &mut self.oh);
        for t in 0..n {
            att[t * q + h * hd..][..hd].copy_from_slice(&self.oh[t * hd..][..hd]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg() -> VisionConfig {
        VisionConfig::from_json(
            &json!({"vt_hidden_size": 32, "vt_num_attention_heads": 2, "qkv_hidden_size": 32, "vt_intermediate_size": 48,
                    "vt_num_hidden_layers": 2, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "text_hidden_size": 24,
                    "media_placeholder_token_id": 1, "max_patches": 64}),
            24,
            4,
        )
        .unwrap()
    }

    fn tower(c: &VisionConfig, seed: u64) -> Tower {
        Tower::random(c, seed)
    }

    /// Finite weights that overflow (a block's norm at f32's largest value)
    /// are an error naming the block, never non-finite rows handed to the
    /// text model.
    #[test]
    fn an_overflowing_block_is_an_error_naming_it() {
        let c = cfg();
        let mut t = tower(&c, 5);
        let rgb: Vec<u8> = (0..40 * 40 * 3).map(|i| (i * 37 % 251) as u8).collect();
        let px = crate::from_rgb8(&c, 40, 40, &rgb).unwrap();
        let pool = Pool::new(1);
        assert!(t.encode(&pool, &px).unwrap().iter().all(|v| v.is_finite()));
        t.blocks[1].norm1.iter_mut().for_each(|w| *w = f32::MAX);
        let e = t.encode(&pool, &px).expect_err("an overflowing tower encoded").to_string();
        assert!(e.contains("block 1's output") && e.contains("non-finite"), "{e}");
    }

    #[test]
    fn positions_copy_at_the_stored_size_and_interpolate_otherwise() {
        let c = cfg();
        let t = tower(&c, 5);
        assert_eq!(t.positions(4, 4), t.pos);
        // 4 → 2 per side: half-pixel centres land between stored rows 0,1 and 2,3
        let p = t.positions(2, 2);
        let d = c.hidden;
        let at = |y: usize, x: usize, k: usize| t.pos[(y * 4 + x) * d + k];
        let want = 0.25 * (at(0, 0, 7) + at(0, 1, 7) + at(1, 0, 7) + at(1, 1, 7));
        assert!((p[7] - want).abs() < 1e-6);
    }

    #[test]
    fn rope_pairs_follow_column_then_row() {
        let t = rope_table(3, 2, 8);
        // token 4 = column 1, row 1; pair 0 (col, freq 1), pair 1 (row, freq 1), pair 2 (col, 10000^-0.5)
        let r = &t[4 * 4..][..4];
        assert_eq!(r[0], (1f64.cos() as f32, 1f64.sin() as f32));
        assert_eq!(r[1], (1f64.cos() as f32, 1f64.sin() as f32));
        let f = 10000f64.powf(-0.5);
        assert_eq!(r[2], (f.cos() as f32, f.sin() as f32));
        // token 2 = column 2, row 0: odd pairs do not turn
        assert_eq!(t[2 * 4 + 1], (1.0, 0.0));
        assert_eq!(t[2 * 4], (2f64.cos() as f32, 2f64.sin() as f32));
    }

    #[test]
    fn wrong_shapes_are_named() {
        let c = cfg();
        let e = Tower::load(&c, &mut |name: &str| {
            let (r, k) = if name.contains("wo.") {
                (3, 3)
            } else {
                c.tensors().into_iter().find(|t| t.0 == name).map(|t| (t.1, t.2)).unwrap()
            };
            Ok(Matrix::from_stored(waste_format::Fmt::F32, r, k, 0, vec![0; 4 * r * k], &[]).unwrap())
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("vision_tower.encoder.blocks.0.wo.weight: shape 3x3"), "{e}");
    }

    #[test]
    fn gelus() {
        assert_eq!(gelu_erf(0.0), 0.0);
        assert!((gelu_erf(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-6);
    }
}
