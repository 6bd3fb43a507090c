//! Attention Residuals (Kimi K3): each layer's input is a learned softmax
//! mix of the earlier blocks' outputs and the running residual, instead of
//! the plain running sum (MODEL.md, "Attention Residuals").

use waste_quant::ops::{rms_scale, softmax};

/// Most candidates a mix can have (blocks + the running residual).
pub const MAX_CANDIDATES: usize = 129;

/// [`attn_res`] with the live candidate and the output in one buffer (the
/// output aggregation's form): alias-safe.
pub fn attn_res_in_place(blocks: &[f32], h: usize, x: &mut [f32], w: &[f32], eps: f32) {
    let p = x.to_vec();
    attn_res(blocks, h, &p, w, eps, x);
}

/// Attention Residuals: softmax over candidates (the `blocks`, each `h`
/// wide, then `p`) of `rsqrt(mean v² + eps) · Σ v ⊙ w`, returning the mix of
/// the raw candidates. `out` must not alias the inputs.
///
/// # Panics
/// With more than [`MAX_CANDIDATES`] − 1 blocks.
pub fn attn_res(blocks: &[f32], h: usize, p: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let nb = blocks.len() / h;
    let cand = |i: usize| if i < nb { &blocks[i * h..(i + 1) * h] } else { p };
    let mut scores = [0f32; MAX_CANDIDATES];
    let scores = &mut scores[..nb + 1];
    for (i, s) in scores.iter_mut().enumerate() {
        let v = cand(i);
        let r = rms_scale(v, eps);
        *s = v.iter().zip(w).map(|(a, b)| a * r * b).sum();
    }
    softmax(scores);
    out.fill(0.0);
    for (i, a) in scores.iter().enumerate() {
        waste_quant::ops::axpy(*a, cand(i), out);
    }
}
