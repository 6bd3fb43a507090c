//! The tensors the forward pass needs, derived from the config alone.

use crate::config::{AttnKind, ModelConfig};

/// The expected shape of a required tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A matrix `[rows, cols]` (leading dims flattened into rows).
    Mat(usize, usize),
    /// A vector of exactly `n` elements (any rank).
    Vec(usize),
    /// At least `n` elements (A_log: per head, maybe zero-padded).
    AtLeast(usize),
}

impl Expect {
    /// Whether a tensor of `rows × cols` satisfies this expectation.
    pub fn accepts(&self, rows: usize, cols: usize) -> bool {
        match *self {
            Expect::Mat(r, c) => rows == r && cols == c,
            Expect::Vec(n) => rows * cols == n,
            Expect::AtLeast(n) => rows * cols >= n,
        }
    }
    /// Whether a source tensor of this `shape` is this expectation stored
    /// without transposition: a vector's element count, or a matrix whose
    /// leading dimensions multiply to its rows and trailing ones to its
    /// columns (`[rows, cols]`, `[D, 3, 14, 14]` for `[D, 588]`, `[H, W, D]`
    /// for `[H·W, D]`). A transposed `[cols, rows]` has the right element
    /// count but no such split, unless the matrix is square or a row.
    pub fn accepts_shape(&self, shape: &[usize]) -> bool {
        let prod = |d: &[usize]| d.iter().try_fold(1usize, |a, &x| a.checked_mul(x));
        match *self {
            Expect::Mat(r, c) => {
                (0..=shape.len()).any(|k| prod(&shape[..k]) == Some(r) && prod(&shape[k..]) == Some(c))
            }
            Expect::Vec(n) => prod(shape) == Some(n),
            Expect::AtLeast(n) => prod(shape).is_some_and(|p| p >= n),
        }
    }
    /// Element count implied (for synthesis).
    pub fn numel(&self) -> usize {
        match *self {
            Expect::Mat(r, c) => r * c,
            Expect::Vec(n) | Expect::AtLeast(n) => n,
        }
    }
}

/// One required tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Required {
    /// Name without `tensor_prefix`.
    pub name: String,
    /// Expected shape.
    pub expect: Expect,
    /// Stays on disk (the embedding table): not counted as resident.
    pub on_disk: bool,
}

fn r(name: String, expect: Expect) -> Required {
    Required { name, expect, on_disk: false }
}

/// Every tensor the forward pass reads, in forward order.
pub fn required_tensors(c: &ModelConfig) -> Vec<Required> {
    use Expect::*;
    let h = c.hidden;
    let mut v = vec![Required { name: "model.embed_tokens.weight".into(), expect: Mat(c.vocab, h), on_disk: true }];
    for l in 0..c.layers {
        let p = format!("model.layers.{l}.");
        v.push(r(format!("{p}input_layernorm.weight"), Vec(h)));
        v.push(r(format!("{p}post_attention_layernorm.weight"), Vec(h)));
        if c.attn_res_block.is_some() {
            for n in ["self_attention_res_norm", "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj"] {
                v.push(r(format!("{p}{n}.weight"), Vec(h)));
            }
        }
        let a = format!("{p}self_attn.");
        match c.attn_kinds[l] {
            AttnKind::Kda => {
                let (hh, d) = (c.kda_heads, c.kda_head_dim);
                let ch = hh * d;
                for n in ["q_proj", "k_proj", "v_proj"] {
                    v.push(r(format!("{a}{n}.weight"), Mat(ch, h)));
                }
                for n in ["q_conv1d", "k_conv1d", "v_conv1d"] {
                    v.push(r(format!("{a}{n}.weight"), Vec(ch * c.conv_kernel)));
                }
                v.push(r(format!("{a}f_a_proj.weight"), Mat(d, h)));
                v.push(r(format!("{a}f_b_proj.weight"), Mat(ch, d)));
                v.push(r(format!("{a}b_proj.weight"), Mat(hh, h)));
                v.push(r(format!("{a}A_log"), AtLeast(hh)));
                v.push(r(format!("{a}dt_bias"), Vec(ch)));
                if c.kda_full_rank_gate {
                    v.push(r(format!("{a}g_proj.weight"), Mat(ch, h)));
                } else {
                    v.push(r(format!("{a}g_a_proj.weight"), Mat(d, h)));
                    v.push(r(format!("{a}g_b_proj.weight"), Mat(ch, d)));
                }
                v.push(r(format!("{a}o_norm.weight"), Vec(d)));
                v.push(r(format!("{a}o_proj.weight"), Mat(h, ch)));
            }
            AttnKind::Mla => {
                let nh = c.mla_heads;
                let qd = nh * (c.qk_nope + c.qk_rope);
                match c.q_lora {
                    Some(ql) => {
                        v.push(r(format!("{a}q_a_proj.weight"), Mat(ql, h)));
                        v.push(r(format!("{a}q_a_layernorm.weight"), Vec(ql)));
                        v.push(r(format!("{a}q_b_proj.weight"), Mat(qd, ql)));
                    }
                    None => v.push(r(format!("{a}q_proj.weight"), Mat(qd, h))),
                }
                v.push(r(format!("{a}kv_a_proj_with_mqa.weight"), Mat(c.kv_lora + c.qk_rope, h)));
                v.push(r(format!("{a}kv_a_layernorm.weight"), Vec(c.kv_lora)));
                v.push(r(format!("{a}kv_b_proj.weight"), Mat(nh * (c.qk_nope + c.v_head), c.kv_lora)));
                if c.mla_output_gate {
                    v.push(r(format!("{a}g_proj.weight"), Mat(nh * c.v_head, h)));
                }
                v.push(r(format!("{a}o_proj.weight"), Mat(h, nh * c.v_head)));
            }
        }
        if c.is_moe(l) {
            let m = format!("{p}block_sparse_moe.");
            v.push(r(format!("{m}gate.weight"), Mat(c.experts, h)));
            v.push(r(format!("{m}gate.e_score_correction_bias"), Vec(c.experts)));
            if let Some(lat) = c.latent {
                v.push(r(format!("{m}routed_expert_down_proj.weight"), Mat(lat, h)));
                v.push(r(format!("{m}routed_expert_up_proj.weight"), Mat(h, lat)));
                if c.latent_norm {
                    v.push(r(format!("{m}routed_expert_norm.weight"), Vec(lat)));
                }
            }
            if c.shared_experts > 0 {
                let s = c.moe_intermediate * c.shared_experts;
                v.push(r(format!("{m}shared_experts.gate_proj.weight"), Mat(s, h)));
                v.push(r(format!("{m}shared_experts.up_proj.weight"), Mat(s, h)));
                v.push(r(format!("{m}shared_experts.down_proj.weight"), Mat(h, s)));
            }
        } else {
            let m = format!("{p}mlp.");
            v.push(r(format!("{m}gate_proj.weight"), Mat(c.intermediate, h)));
            v.push(r(format!("{m}up_proj.weight"), Mat(c.intermediate, h)));
            v.push(r(format!("{m}down_proj.weight"), Mat(h, c.intermediate)));
        }
    }
    if c.attn_res_block.is_some() {
        v.push(r("model.output_attn_res_norm.weight".into(), Vec(h)));
        v.push(r("model.output_attn_res_proj.weight".into(), Vec(h)));
    }
    v.push(r("model.norm.weight".into(), Vec(h)));
    if !c.tie_embeddings {
        v.push(r("lm_head.weight".into(), Mat(c.vocab, h)));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::Expect::{self, *};

    #[test]
    fn a_matrix_is_accepted_in_any_untransposed_layout() {
        let m = Mat(6, 4);
        for ok in [&[6, 4][..], &[2, 3, 4], &[6, 2, 2], &[2, 3, 2, 2], &[6, 4, 1], &[1, 6, 4]] {
            assert!(m.accepts_shape(ok), "{ok:?}");
        }
        // the same 24 elements transposed or regrouped across the split
        for bad in [&[4, 6][..], &[24], &[3, 8], &[2, 12], &[4, 3, 2], &[]] {
            assert!(!m.accepts_shape(bad), "{bad:?}");
        }
        // a row vector, and a square matrix, cannot tell
        assert!(Mat(1, 5).accepts_shape(&[5]));
        assert!(Mat(3, 3).accepts_shape(&[3, 3]));
    }

    #[test]
    fn vectors_count_elements_and_overflowing_shapes_are_refused() {
        assert!(Vec(12).accepts_shape(&[3, 1, 4]));
        assert!(!Vec(12).accepts_shape(&[13]));
        assert!(AtLeast(4).accepts_shape(&[1, 8]));
        assert!(!AtLeast(4).accepts_shape(&[3]));
        let huge = [usize::MAX, 2, 2];
        for e in [Mat(1, 0), Vec(0), AtLeast(1)] {
            assert!(!Expect::accepts_shape(&e, &huge), "{e:?}");
        }
    }
}
