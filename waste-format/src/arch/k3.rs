//! Kimi K3 (`kimi_k3`, also as the `text_config` of `kimi_k3_vision`):
//! Kimi-Linear's blocks and layer plan with the K3 additions, each turned
//! on by its own key (MODEL.md, "Kimi K3 additions"): the latent MoE
//! (`routed_expert_hidden_size`, `latent_moe_use_norm`), SiTU-GLU, the
//! full-rank KDA output gate, the bounded decay, the MLA query LoRA and
//! output gate, and Attention Residuals (per-layer and output mixing
//! tensors). A config is K3's when its `model_type` says so or it has any
//! of those keys.

use super::{kimi_linear, Architecture, Family};
use crate::config::limits::*;
use crate::config::{boolean, float, get, uint, Activation, ModelConfig};
use crate::error::{Error, Result};
use crate::schema::{r, Expect, Required};
use serde_json::{Map, Value};

/// K3's declarations.
pub static ARCH: Architecture = Architecture {
    name: "kimi-k3",
    model_types: &["kimi_k3"],
    keys: KEYS,
    claims,
    parse,
    tensors,
    source_names: kimi_linear::source_names,
};

/// The keys [`parse`] reads beyond Kimi-Linear's ([`kimi_linear::KEYS`]).
pub const KEYS: &[&str] = &[
    "linear_attn_config.use_full_rank_gate|use_full_rank_gate",
    "linear_attn_config.gate_lower_bound|gate_lower_bound",
    "q_lora_rank",
    "mla_use_output_gate",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "attn_res_block_size",
];

/// `model_type` `kimi_k3`, `hidden_act: "situ"`, or any of [`KEYS`]
/// present and not null.
fn claims(m: &Map<String, Value>) -> bool {
    let present = |path: &str| match path.split_once('.') {
        Some((outer, inner)) => m.get(outer).and_then(Value::as_object).is_some_and(|o| get(o, &[inner]).is_some()),
        None => get(m, &[path]).is_some(),
    };
    Family::named(m, &ARCH)
        || m.get("hidden_act").and_then(|v| v.as_str()) == Some("situ")
        || KEYS.iter().flat_map(|k| k.split('|')).any(present)
}

const P: &str = "config";

/// Kimi-Linear's keys, then K3's.
///
/// # Errors
/// As [`kimi_linear::parse`], and for a non-negative decay bound or a
/// non-positive SiTU β.
pub fn parse(m: &Map<String, Value>, c: &mut ModelConfig) -> Result<()> {
    kimi_linear::blocks_and_plan(m, c)?;
    kda_gates(m, c)?;
    c.q_lora = uint(m, P, &["q_lora_rank"], 1, MAX_HIDDEN)?;
    c.mla_output_gate = boolean(m, P, &["mla_use_output_gate"])?.unwrap_or(false);
    c.latent = uint(m, P, &["routed_expert_hidden_size"], 1, MAX_HIDDEN)?;
    c.latent_norm = boolean(m, P, &["latent_moe_use_norm"])?.unwrap_or(false) && c.latent.is_some();
    c.activation = activation(m)?;
    c.attn_res_block = uint(m, P, &["attn_res_block_size"], 1, MAX_LAYERS)?;
    Ok(())
}

/// The full-rank output gate and the decay's lower bound (nested in
/// `linear_attn_config` when it is there, else flat).
fn kda_gates(m: &Map<String, Value>, c: &mut ModelConfig) -> Result<()> {
    let (full_rank, lower_bound) = match kimi_linear::linear_attn_config(m)? {
        Some(o) => {
            let lp = "config.linear_attn_config";
            (boolean(o, lp, &["use_full_rank_gate"])?, float(o, lp, &["gate_lower_bound"])?)
        }
        None => (boolean(m, P, &["use_full_rank_gate"])?, float(m, P, &["gate_lower_bound"])?),
    };
    if let Some(lb) = lower_bound {
        if lb >= 0.0 {
            return Err(Error::manifest(
                "config.linear_attn_config.gate_lower_bound",
                format!("must be negative, got {lb}"),
            ));
        }
    }
    (c.kda_full_rank_gate, c.gate_lower_bound) = (full_rank.unwrap_or(false), lower_bound);
    Ok(())
}

/// SiTU-GLU (`situ`, β and β' from their keys) or Kimi-Linear's SiLU.
fn activation(m: &Map<String, Value>) -> Result<Activation> {
    if m.get("hidden_act").and_then(|v| v.as_str()) != Some("situ") {
        return kimi_linear::silu(m);
    }
    let beta = float(m, P, &["activation_situ_beta"])?.unwrap_or(4.0);
    let linear_beta = float(m, P, &["activation_situ_linear_beta"])?.unwrap_or(25.0);
    if beta <= 0.0 {
        return Err(Error::manifest("config.activation_situ_beta", format!("must be positive, got {beta}")));
    }
    Ok(Activation::Situ { beta, linear_beta })
}

/// Kimi-Linear's tensors with the Attention Residuals' mixing tensors: four
/// per layer (after its norms) and two before the final norm.
pub fn tensors(c: &ModelConfig) -> Vec<Required> {
    let ar = c.attn_res_block.is_some();
    let mut v = vec![kimi_linear::embedding(c)];
    for l in 0..c.layers {
        let p = format!("model.layers.{l}.");
        kimi_linear::layer_norms(c, &p, &mut v);
        if ar {
            for n in ["self_attention_res_norm", "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj"] {
                v.push(r(format!("{p}{n}.weight"), Expect::Vec(c.hidden)));
            }
        }
        kimi_linear::layer_blocks(c, l, &p, &mut v);
    }
    if ar {
        v.push(r("model.output_attn_res_norm.weight".into(), Expect::Vec(c.hidden)));
        v.push(r("model.output_attn_res_proj.weight".into(), Expect::Vec(c.hidden)));
    }
    kimi_linear::head(c, &mut v);
    v
}
