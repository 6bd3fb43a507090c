//! Kimi-Linear (`kimi_linear`; transformers' `KimiLinearForCausalLM`): KDA
//! and MLA layers in a plan from `linear_attn_config` (or `layer_types`),
//! leading dense GLU layers, then routed MoE layers with shared experts and
//! sigmoid routing. The fallback family: it claims every config no other
//! family claims.

use super::{blocks, Architecture};
use crate::config::limits::*;
use crate::config::{boolean, float, get, key_path, req_uint, uint, uint_list, Activation, AttnKind, ModelConfig};
use crate::error::{Error, Result};
use crate::schema::{r, Expect, Required};
use serde_json::{Map, Value};

/// Kimi-Linear's declarations.
pub static ARCH: Architecture = Architecture {
    name: "kimi-linear",
    model_types: &["kimi_linear"],
    keys: KEYS,
    claims: |_| true,
    parse,
    tensors,
    source_names,
};

/// The keys [`parse`] reads (`a|b`: alternative spellings, the first the release's).
pub const KEYS: &[&str] = &[
    "num_experts|n_routed_experts|num_local_experts",
    "num_experts_per_token|num_experts_per_tok",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "mlp_layer_types",
    "intermediate_size",
    "num_shared_experts|n_shared_experts",
    "moe_renormalize|norm_topk_prob",
    "routed_scaling_factor",
    "num_expert_group|n_group",
    "topk_group",
    "moe_router_activation_func",
    "linear_attn_config",
    "linear_attn_config.num_heads|linear_num_heads",
    "linear_attn_config.head_dim|linear_head_dim",
    "linear_attn_config.short_conv_kernel_size|linear_conv_kernel_dim",
    "linear_attn_config.kda_layers",
    "linear_attn_config.full_attn_layers",
    "layer_types",
    "num_attention_heads",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "kv_lora_rank",
    "mla_use_nope",
    "attention_bias",
    "hidden_act",
];

const P: &str = "config";

/// Read Kimi-Linear's keys: the routed MoE, the layer plan, KDA and MLA,
/// the activation (SiLU).
///
/// # Errors
/// [`Error::Manifest`] naming the key for a missing, mistyped or
/// out-of-range value; [`Error::Unsupported`] for MLA with rotary
/// embeddings or biases.
pub fn parse(m: &Map<String, Value>, c: &mut ModelConfig) -> Result<()> {
    blocks_and_plan(m, c)?;
    c.activation = silu(m)?;
    Ok(())
}

/// Everything [`parse`] reads but the activation: what K3 shares.
pub(crate) fn blocks_and_plan(m: &Map<String, Value>, c: &mut ModelConfig) -> Result<()> {
    moe(m, c)?;
    let lin = linear_attn_config(m)?;
    c.attn_kinds = layer_plan(m, lin, c.layers)?;
    kda(m, lin, c)?;
    mla(m, c)
}

/// The `hidden_act` Kimi-Linear has: SiLU (`silu`/`swish`, or absent).
pub(crate) fn silu(m: &Map<String, Value>) -> Result<Activation> {
    match get(m, &["hidden_act"]).map(|(_, v)| v) {
        None => Ok(Activation::Silu),
        Some(Value::String(s)) if s == "silu" || s == "swish" => Ok(Activation::Silu),
        Some(v) => Err(Error::manifest("config.hidden_act", format!("unsupported activation {v}"))),
    }
}

/// The release's nested `linear_attn_config` object, if any.
pub(crate) fn linear_attn_config(m: &Map<String, Value>) -> Result<Option<&Map<String, Value>>> {
    match m.get("linear_attn_config") {
        Some(Value::Object(o)) => Ok(Some(o)),
        Some(Value::Null) | None => Ok(None),
        Some(v) => Err(Error::manifest("config.linear_attn_config", format!("expected an object, got {v}"))),
    }
}

/// The routed MoE and the dense layers before it.
fn moe(m: &Map<String, Value>, c: &mut ModelConfig) -> Result<()> {
    let experts = req_uint(m, P, &["num_experts", "n_routed_experts", "num_local_experts"], 1, MAX_EXPERTS)?;
    let top_k = req_uint(m, P, &["num_experts_per_token", "num_experts_per_tok"], 1, MAX_TOPK.min(experts))?;
    c.moe_intermediate = req_uint(m, P, &["moe_intermediate_size"], 1, MAX_FFN)?;
    c.first_k_dense = first_k_dense(m, c.layers)?;
    c.intermediate = match uint(m, P, &["intermediate_size"], 1, MAX_FFN)? {
        Some(n) => n,
        None if c.first_k_dense == 0 => 0,
        None => return Err(Error::manifest("config.intermediate_size", "missing (needed by dense layers)")),
    };
    c.shared_experts = uint(m, P, &["num_shared_experts", "n_shared_experts"], 0, MAX_SHARED)?.unwrap_or(0);
    c.renormalize = boolean(m, P, &["moe_renormalize", "norm_topk_prob"])?.unwrap_or(true);
    c.routed_scaling = float(m, P, &["routed_scaling_factor"])?.unwrap_or(1.0);
    let n_group = uint(m, P, &["num_expert_group", "n_group"], 1, experts)?.unwrap_or(1);
    if experts % n_group != 0 {
        return Err(Error::manifest(
            "config.num_expert_group",
            format!("{n_group} does not divide num_experts {experts}"),
        ));
    }
    let topk_group = uint(m, P, &["topk_group"], 1, n_group)?.unwrap_or(n_group);
    if n_group > 1 && top_k > topk_group * (experts / n_group) {
        return Err(Error::manifest("config.topk_group", format!("{topk_group} groups cannot supply top_k {top_k}")));
    }
    if let Some((k, v)) = get(m, &["moe_router_activation_func"]) {
        if v.as_str() != Some("sigmoid") {
            return Err(Error::manifest(key_path(P, k), format!("only \"sigmoid\" is supported, got {v}")));
        }
    }
    (c.experts, c.top_k, c.n_group, c.topk_group) = (experts, top_k, n_group, topk_group);
    Ok(())
}

/// Layers `< first_k_dense` are dense: `first_k_dense_replace`, or
/// transformers' `mlp_layer_types` (leading "dense", the rest "sparse").
fn first_k_dense(m: &Map<String, Value>, layers: usize) -> Result<usize> {
    if let Some(k) = uint(m, P, &["first_k_dense_replace"], 0, layers)? {
        return Ok(k);
    }
    match m.get("mlp_layer_types").filter(|v| !v.is_null()) {
        Some(Value::Array(a)) => {
            let k = a.iter().take_while(|v| v.as_str() == Some("dense")).count();
            if a.len() != layers || a[k..].iter().any(|v| v.as_str() != Some("sparse")) {
                return Err(Error::manifest(
                    "config.mlp_layer_types",
                    "must be leading \"dense\" layers then \"sparse\" ones, one per layer",
                ));
            }
            Ok(k)
        }
        Some(v) => Err(Error::manifest("config.mlp_layer_types", format!("expected an array, got {v}"))),
        None => Ok(0),
    }
}

/// The KDA block's sizes (the release's nested object or transformers' flat keys).
fn kda(m: &Map<String, Value>, lin: Option<&Map<String, Value>>, c: &mut ModelConfig) -> Result<()> {
    let lp = "config.linear_attn_config";
    let (heads, head_dim, conv_kernel) = match lin {
        Some(o) => (
            uint(o, lp, &["num_heads"], 1, MAX_HEADS)?,
            uint(o, lp, &["head_dim"], 1, MAX_HEAD_DIM)?,
            uint(o, lp, &["short_conv_kernel_size"], 1, 64)?,
        ),
        None => (
            uint(m, P, &["linear_num_heads"], 1, MAX_HEADS)?,
            uint(m, P, &["linear_head_dim"], 1, MAX_HEAD_DIM)?,
            uint(m, P, &["linear_conv_kernel_dim"], 1, 64)?,
        ),
    };
    c.conv_kernel = conv_kernel.unwrap_or(4);
    if !c.attn_kinds.contains(&AttnKind::Kda) {
        (c.kda_heads, c.kda_head_dim) = (heads.unwrap_or(0), head_dim.unwrap_or(0));
        return Ok(());
    }
    let need = |v: Option<usize>, key: &str| v.ok_or_else(|| Error::manifest(key, "missing (needed by KDA layers)"));
    c.kda_heads = need(heads, "config.linear_attn_config.num_heads")?;
    c.kda_head_dim = need(head_dim, "config.linear_attn_config.head_dim")?;
    if c.kda_heads.checked_mul(c.kda_head_dim).is_none_or(|w| w > MAX_HIDDEN) {
        return Err(Error::manifest(
            "config.linear_attn_config.num_heads",
            format!("{} x {} too wide", c.kda_heads, c.kda_head_dim),
        ));
    }
    Ok(())
}

/// The MLA block's sizes: required when a layer is MLA, else 0 when absent.
fn mla(m: &Map<String, Value>, c: &mut ModelConfig) -> Result<()> {
    let has_mla = c.attn_kinds.contains(&AttnKind::Mla);
    let mreq = |keys: &[&str], lo: usize, hi: usize| -> Result<usize> {
        if has_mla {
            req_uint(m, P, keys, lo, hi)
        } else {
            Ok(uint(m, P, keys, lo, hi)?.unwrap_or(0))
        }
    };
    c.mla_heads = mreq(&["num_attention_heads"], 1, MAX_HEADS)?;
    c.qk_nope = mreq(&["qk_nope_head_dim"], 0, MAX_HEAD_DIM)?;
    c.qk_rope = mreq(&["qk_rope_head_dim"], 0, MAX_HEAD_DIM)?;
    c.v_head = mreq(&["v_head_dim"], 1, MAX_HEAD_DIM)?;
    c.kv_lora = mreq(&["kv_lora_rank"], 1, MAX_HIDDEN)?;
    if !has_mla {
        return Ok(());
    }
    if c.qk_nope + c.qk_rope == 0 {
        return Err(Error::manifest("config.qk_nope_head_dim", "qk_nope_head_dim + qk_rope_head_dim is 0"));
    }
    if let Some(false) = boolean(m, P, &["mla_use_nope"])? {
        return Err(Error::Unsupported("MLA with rotary embeddings (mla_use_nope = false)".into()));
    }
    // transformers then gives q_a_proj, kv_a_proj_with_mqa and o_proj
    // biases, which the container has no place for
    if let Some(true) = boolean(m, P, &["attention_bias"])? {
        return Err(Error::Unsupported("MLA projections with biases (attention_bias = true)".into()));
    }
    if c.mla_heads.checked_mul(c.qk_nope + c.qk_rope + c.v_head).is_none_or(|w| w > MAX_HIDDEN * 4) {
        return Err(Error::manifest("config.num_attention_heads", format!("{} heads too wide", c.mla_heads)));
    }
    Ok(())
}

/// The layer plan: each layer's attention kind, from the release's
/// 1-based `kda_layers` / `full_attn_layers`, transformers' `layer_types`,
/// or all KDA (a `linear_attn_config` without lists) or all MLA.
fn layer_plan(m: &Map<String, Value>, lin: Option<&Map<String, Value>>, layers: usize) -> Result<Vec<AttnKind>> {
    if let Some(o) = lin {
        let full = o.get("full_attn_layers").filter(|v| !v.is_null());
        let kda = o.get("kda_layers").filter(|v| !v.is_null());
        if full.is_some() || kda.is_some() {
            let mut kinds = vec![None; layers];
            for (list, kind, key) in [(kda, AttnKind::Kda, "kda_layers"), (full, AttnKind::Mla, "full_attn_layers")] {
                let Some(list) = list else { continue };
                let key = format!("config.linear_attn_config.{key}");
                for l in uint_list(list, &key)? {
                    if l == 0 || l > layers {
                        return Err(Error::manifest(&key, format!("layer {l} outside 1..={layers} (1-based)")));
                    }
                    if kinds[l - 1].is_some() {
                        return Err(Error::manifest(&key, format!("layer {l} listed twice")));
                    }
                    kinds[l - 1] = Some(kind);
                }
            }
            // A layer named in neither list takes the kind of the other list's complement.
            let default = if kda.is_some() && full.is_none() { AttnKind::Mla } else { AttnKind::Kda };
            return Ok(kinds.into_iter().map(|k| k.unwrap_or(default)).collect());
        }
    }
    if let Some(lt) = m.get("layer_types").filter(|v| !v.is_null()) {
        let arr = lt.as_array().ok_or_else(|| Error::manifest("config.layer_types", "expected an array"))?;
        if arr.len() != layers {
            return Err(Error::manifest("config.layer_types", format!("{} entries for {layers} layers", arr.len())));
        }
        return arr
            .iter()
            .map(|v| match v.as_str() {
                Some("linear_attention") | Some("kda") | Some("linear") => Ok(AttnKind::Kda),
                Some("full_attention") | Some("mla") | Some("full") => Ok(AttnKind::Mla),
                _ => Err(Error::manifest("config.layer_types", format!("unknown layer type {v}"))),
            })
            .collect();
    }
    if lin.is_some() {
        return Ok(vec![AttnKind::Kda; layers]);
    }
    Ok(vec![AttnKind::Mla; layers])
}

/// Kimi-Linear's tensors: the embedding, each layer's norms, attention and
/// FFN blocks, the final norm and the head.
pub fn tensors(c: &ModelConfig) -> Vec<Required> {
    let mut v = vec![embedding(c)];
    for l in 0..c.layers {
        let p = format!("model.layers.{l}.");
        layer_norms(c, &p, &mut v);
        layer_blocks(c, l, &p, &mut v);
    }
    head(c, &mut v);
    v
}

/// The token embedding (stays on disk: rows are read as tokens come).
pub(crate) fn embedding(c: &ModelConfig) -> Required {
    Required { name: "model.embed_tokens.weight".into(), expect: Expect::Mat(c.vocab, c.hidden), on_disk: true }
}

/// A layer's two RMSNorms.
pub(crate) fn layer_norms(c: &ModelConfig, p: &str, v: &mut Vec<Required>) {
    v.push(r(format!("{p}input_layernorm.weight"), Expect::Vec(c.hidden)));
    v.push(r(format!("{p}post_attention_layernorm.weight"), Expect::Vec(c.hidden)));
}

/// A layer's attention and FFN blocks.
pub(crate) fn layer_blocks(c: &ModelConfig, l: usize, p: &str, v: &mut Vec<Required>) {
    blocks::attention(c, l, &format!("{p}self_attn."), v);
    blocks::ffn(c, l, p, v);
}

/// The final norm and the LM head (none when tied to the embedding).
pub(crate) fn head(c: &ModelConfig, v: &mut Vec<Required>) {
    v.push(r("model.norm.weight".into(), Expect::Vec(c.hidden)));
    if !c.tie_embeddings {
        v.push(r("lm_head.weight".into(), Expect::Mat(c.vocab, c.hidden)));
    }
}

/// A container tensor's spellings: the release's (the container's own),
/// then transformers': the dense layer-0 FFN under `block_sparse_moe`, the
/// KDA decay under `forget_gate`, the MoE under `mlp`. (The fused forms —
/// one `conv1d` over q|k|v, `experts.gate_up_proj` — are split by the
/// converter's reader.)
pub fn source_names(name: &str) -> Vec<String> {
    let mut v = vec![name.to_string()];
    let alt = |from: &str, to: &str| name.replace(from, to);
    if name.contains(".mlp.") {
        v.push(alt(".mlp.", ".block_sparse_moe."));
    }
    for k in ["f_a_proj", "f_b_proj", "dt_bias", "A_log"] {
        if name.contains(&format!("self_attn.{k}")) {
            v.push(alt("self_attn.", "self_attn.forget_gate."));
        }
    }
    if name.contains(".block_sparse_moe.") {
        v.push(alt(".block_sparse_moe.", ".mlp."));
    }
    v
}
