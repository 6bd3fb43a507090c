//! The tensors of the blocks every family builds from: KDA and MLA
//! attention, the routed MoE FFN (shared experts, latent projections) and
//! the dense GLU. Each reads its options from the config (a K3 option left
//! at its absent value gives Kimi-Linear's tensors).

use crate::config::{AttnKind, ModelConfig};
use crate::schema::{
    r,
    Expect::{AtLeast, Mat, Vec as Len},
    Required,
};

/// Layer `l`'s attention block under `a` (`model.layers.{l}.self_attn.`).
pub fn attention(c: &ModelConfig, l: usize, a: &str, v: &mut Vec<Required>) {
    match c.attn_kinds[l] {
        AttnKind::Kda => kda(c, a, v),
        AttnKind::Mla => mla(c, a, v),
    }
}

/// Layer `l`'s FFN block under `p` (`model.layers.{l}.`): routed MoE or dense.
pub fn ffn(c: &ModelConfig, l: usize, p: &str, v: &mut Vec<Required>) {
    if c.is_moe(l) {
        moe(c, &format!("{p}block_sparse_moe."), v);
    } else {
        dense(c, &format!("{p}mlp."), v);
    }
}

/// Kimi Delta Attention: projections, short convolutions, decay and beta,
/// the output gate (low-rank, or K3's full-rank `g_proj`), norm and output.
pub fn kda(c: &ModelConfig, a: &str, v: &mut Vec<Required>) {
    let h = c.hidden;
    let (hh, d) = (c.kda_heads, c.kda_head_dim);
    let ch = hh * d;
    for n in ["q_proj", "k_proj", "v_proj"] {
        v.push(r(format!("{a}{n}.weight"), Mat(ch, h)));
    }
    for n in ["q_conv1d", "k_conv1d", "v_conv1d"] {
        v.push(r(format!("{a}{n}.weight"), Len(ch * c.conv_kernel)));
    }
    v.push(r(format!("{a}f_a_proj.weight"), Mat(d, h)));
    v.push(r(format!("{a}f_b_proj.weight"), Mat(ch, d)));
    v.push(r(format!("{a}b_proj.weight"), Mat(hh, h)));
    v.push(r(format!("{a}A_log"), AtLeast(hh)));
    v.push(r(format!("{a}dt_bias"), Len(ch)));
    if c.kda_full_rank_gate {
        v.push(r(format!("{a}g_proj.weight"), Mat(ch, h)));
    } else {
        v.push(r(format!("{a}g_a_proj.weight"), Mat(d, h)));
        v.push(r(format!("{a}g_b_proj.weight"), Mat(ch, d)));
    }
    v.push(r(format!("{a}o_norm.weight"), Len(d)));
    v.push(r(format!("{a}o_proj.weight"), Mat(h, ch)));
}

/// Multi-head latent attention: the query (plain, or K3's LoRA), the
/// latent key/value projections, K3's output gate, the output.
pub fn mla(c: &ModelConfig, a: &str, v: &mut Vec<Required>) {
    let h = c.hidden;
    let nh = c.mla_heads;
    let qd = nh * (c.qk_nope + c.qk_rope);
    match c.q_lora {
        Some(ql) => {
            v.push(r(format!("{a}q_a_proj.weight"), Mat(ql, h)));
            v.push(r(format!("{a}q_a_layernorm.weight"), Len(ql)));
            v.push(r(format!("{a}q_b_proj.weight"), Mat(qd, ql)));
        }
        None => v.push(r(format!("{a}q_proj.weight"), Mat(qd, h))),
    }
    v.push(r(format!("{a}kv_a_proj_with_mqa.weight"), Mat(c.kv_lora + c.qk_rope, h)));
    v.push(r(format!("{a}kv_a_layernorm.weight"), Len(c.kv_lora)));
    v.push(r(format!("{a}kv_b_proj.weight"), Mat(nh * (c.qk_nope + c.v_head), c.kv_lora)));
    if c.mla_output_gate {
        v.push(r(format!("{a}g_proj.weight"), Mat(nh * c.v_head, h)));
    }
    v.push(r(format!("{a}o_proj.weight"), Mat(h, nh * c.v_head)));
}

/// The routed MoE FFN's trunk tensors under `m`: the router, K3's latent
/// projections and norm, the shared experts (the routed experts are the
/// banks, not tensors).
pub fn moe(c: &ModelConfig, m: &str, v: &mut Vec<Required>) {
    let h = c.hidden;
    v.push(r(format!("{m}gate.weight"), Mat(c.experts, h)));
    v.push(r(format!("{m}gate.e_score_correction_bias"), Len(c.experts)));
    if let Some(lat) = c.latent {
        v.push(r(format!("{m}routed_expert_down_proj.weight"), Mat(lat, h)));
        v.push(r(format!("{m}routed_expert_up_proj.weight"), Mat(h, lat)));
        if c.latent_norm {
            v.push(r(format!("{m}routed_expert_norm.weight"), Len(lat)));
        }
    }
    if c.shared_experts > 0 {
        let s = c.moe_intermediate * c.shared_experts;
        v.push(r(format!("{m}shared_experts.gate_proj.weight"), Mat(s, h)));
        v.push(r(format!("{m}shared_experts.up_proj.weight"), Mat(s, h)));
        v.push(r(format!("{m}shared_experts.down_proj.weight"), Mat(h, s)));
    }
}

/// The dense GLU FFN under `m`.
pub fn dense(c: &ModelConfig, m: &str, v: &mut Vec<Required>) {
    let h = c.hidden;
    v.push(r(format!("{m}gate_proj.weight"), Mat(c.intermediate, h)));
    v.push(r(format!("{m}up_proj.weight"), Mat(c.intermediate, h)));
    v.push(r(format!("{m}down_proj.weight"), Mat(h, c.intermediate)));
}
