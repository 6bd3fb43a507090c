//! The model configuration, parsed from the manifest's `config` object.
//!
//! Accepts the release's form (`linear_attn_config`, `num_experts`,
//! `num_experts_per_token`, ...), a nested `text_config` (flattened, the outer
//! object kept under `_outer`), and transformers' native form (`layer_types`,
//! `linear_num_heads`, `n_routed_experts`, `num_experts_per_tok`, ...).
//! Every value is bounded; failures name the key and the value.

use crate::arch::Family;
use crate::error::{Error, Result};
use serde_json::{Map, Value};

/// Upper bounds on configuration values (untrusted input).
pub mod limits {
    /// Maximum number of layers.
    pub const MAX_LAYERS: usize = 128;
    /// Maximum hidden width.
    pub const MAX_HIDDEN: usize = 1 << 20;
    /// Maximum vocabulary size.
    pub const MAX_VOCAB: usize = 1 << 24;
    /// Maximum number of routed experts per layer.
    pub const MAX_EXPERTS: usize = 1 << 20;
    /// Maximum top-k.
    pub const MAX_TOPK: usize = 64;
    /// Maximum heads of any attention kind.
    pub const MAX_HEADS: usize = 4096;
    /// Maximum per-head dimension.
    pub const MAX_HEAD_DIM: usize = 4096;
    /// Maximum FFN width.
    pub const MAX_FFN: usize = 1 << 20;
    /// Maximum number of shared experts.
    pub const MAX_SHARED: usize = 64;
}
use limits::*;

/// Attention kind of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// Kimi Delta Attention (linear, recurrent state).
    Kda,
    /// Multi-head latent attention (full attention over a latent cache).
    Mla,
}

/// FFN activation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// `silu(g) * u`.
    Silu,
    /// SiTU-GLU (Kimi K3): `β·tanh(g/β)·σ(g) · β'·tanh(u/β')` (β' ≤ 0: `u` raw).
    Situ {
        /// β on the gate half.
        beta: f32,
        /// β' on the up half.
        linear_beta: f32,
    },
}

/// The parsed, bounded model configuration.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// `model_type` (descriptive).
    pub model_type: String,
    /// The architecture family whose module parsed this config
    /// ([`crate::arch`]: its keys, layer plan, tensors and source names).
    pub family: Family,
    /// Hidden width.
    pub hidden: usize,
    /// Number of decoder layers.
    pub layers: usize,
    /// Vocabulary size (rows of the embedding and head).
    pub vocab: usize,
    /// RMSNorm epsilon of the layer norms.
    pub rms_eps: f32,
    /// Layers `< first_k_dense` use a dense FFN.
    pub first_k_dense: usize,
    /// Dense FFN width.
    pub intermediate: usize,
    /// Routed/shared expert width.
    pub moe_intermediate: usize,
    /// Routed experts per MoE layer.
    pub experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Shared experts (0 = none).
    pub shared_experts: usize,
    /// Renormalize the chosen weights to sum 1.
    pub renormalize: bool,
    /// Multiplier applied to routed weights.
    pub routed_scaling: f32,
    /// Expert groups for group-limited routing (1 = off).
    pub n_group: usize,
    /// Groups kept in group-limited routing.
    pub topk_group: usize,
    /// Per-layer attention kind.
    pub attn_kinds: Vec<AttnKind>,
    /// KDA heads.
    pub kda_heads: usize,
    /// KDA head dim (K = V).
    pub kda_head_dim: usize,
    /// KDA short conv kernel size.
    pub conv_kernel: usize,
    /// K3: full-rank KDA output gate `g_proj`.
    pub kda_full_rank_gate: bool,
    /// K3: bounded decay gate lower bound.
    pub gate_lower_bound: Option<f32>,
    /// MLA heads.
    pub mla_heads: usize,
    /// MLA no-position query/key dim.
    pub qk_nope: usize,
    /// MLA shared rope-slot key dim.
    pub qk_rope: usize,
    /// MLA value head dim.
    pub v_head: usize,
    /// MLA latent width.
    pub kv_lora: usize,
    /// MLA query LoRA rank (K3), `None` = plain `q_proj`.
    pub q_lora: Option<usize>,
    /// K3: MLA sigmoid output gate.
    pub mla_output_gate: bool,
    /// K3 latent MoE width (`routed_expert_hidden_size`).
    pub latent: Option<usize>,
    /// K3: RMSNorm on the latent routed sum.
    pub latent_norm: bool,
    /// FFN activation.
    pub activation: Activation,
    /// K3: Attention Residuals block size.
    pub attn_res_block: Option<usize>,
    /// Beginning-of-sequence token id, if given.
    pub bos: Option<u32>,
    /// End-of-sequence token ids (may be several).
    pub eos: Vec<u32>,
    /// Whether `lm_head` is tied to the embedding.
    pub tie_embeddings: bool,
}

pub(crate) fn get<'a>(m: &'a Map<String, Value>, keys: &[&str]) -> Option<(&'a str, &'a Value)> {
    keys.iter().find_map(|k| m.get_key_value(*k).filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.as_str(), v)))
}

pub(crate) fn key_path(prefix: &str, k: &str) -> String {
    format!("{prefix}.{k}")
}

pub(crate) fn uint(m: &Map<String, Value>, prefix: &str, keys: &[&str], lo: usize, hi: usize) -> Result<Option<usize>> {
    let Some((k, v)) = get(m, keys) else { return Ok(None) };
    let n = v
        .as_u64()
        .ok_or_else(|| Error::manifest(key_path(prefix, k), format!("expected a non-negative integer, got {v}")))?;
    if n < lo as u64 || n > hi as u64 {
        return Err(Error::manifest(key_path(prefix, k), format!("value {n} out of range {lo}..={hi}")));
    }
    Ok(Some(n as usize))
}

pub(crate) fn req_uint(m: &Map<String, Value>, prefix: &str, keys: &[&str], lo: usize, hi: usize) -> Result<usize> {
    uint(m, prefix, keys, lo, hi)?.ok_or_else(|| Error::manifest(key_path(prefix, keys[0]), "missing"))
}

pub(crate) fn float(m: &Map<String, Value>, prefix: &str, keys: &[&str]) -> Result<Option<f32>> {
    let Some((k, v)) = get(m, keys) else { return Ok(None) };
    let f = v.as_f64().ok_or_else(|| Error::manifest(key_path(prefix, k), format!("expected a number, got {v}")))?;
    // finite as the f32 the engine computes with (1e39 is a finite f64)
    if !(f as f32).is_finite() {
        return Err(Error::manifest(key_path(prefix, k), format!("{f} is not a finite f32")));
    }
    Ok(Some(f as f32))
}

pub(crate) fn boolean(m: &Map<String, Value>, prefix: &str, keys: &[&str]) -> Result<Option<bool>> {
    let Some((k, v)) = get(m, keys) else { return Ok(None) };
    v.as_bool().map(Some).ok_or_else(|| Error::manifest(key_path(prefix, k), format!("expected a boolean, got {v}")))
}

pub(crate) fn uint_list(v: &Value, key: &str) -> Result<Vec<usize>> {
    let arr = v.as_array().ok_or_else(|| Error::manifest(key, format!("expected an array, got {v}")))?;
    if arr.len() > MAX_LAYERS {
        return Err(Error::manifest(key, format!("{} entries exceed {MAX_LAYERS}", arr.len())));
    }
    arr.iter()
        .map(|x| {
            x.as_u64().map(|n| n as usize).ok_or_else(|| Error::manifest(key, format!("expected integers, got {x}")))
        })
        .collect()
}

/// Flatten a multimodal config: `text_config` keys are lifted to the top
/// level, the outer object is kept under `_outer`.
pub fn flatten_text_config(v: &Value) -> Value {
    match v.get("text_config") {
        Some(Value::Object(text)) => {
            let mut out = text.clone();
            let mut outer = v.as_object().cloned().unwrap_or_default();
            outer.remove("text_config");
            out.insert("_outer".into(), Value::Object(outer));
            Value::Object(out)
        }
        _ => v.clone(),
    }
}

impl ModelConfig {
    /// Parse and bound a config object (the manifest's `config`, or a
    /// release/transformers `config.json`).
    ///
    /// # Errors
    /// [`Error::Manifest`] naming the key for a missing, mistyped or out-of-range field.
    pub fn from_json(v: &Value) -> Result<Self> {
        let flat = flatten_text_config(v);
        let m = flat.as_object().ok_or_else(|| Error::manifest("config", "expected an object"))?;
        let family = Family::detect(m);
        let mut c = Self::common(m, family)?;
        (family.def().parse)(m, &mut c)?;
        Ok(c)
    }

    /// The keys every family reads (sizes, norm epsilon, special tokens),
    /// the rest at their "absent" values for the family's parser to fill.
    fn common(m: &Map<String, Value>, family: Family) -> Result<Self> {
        let p = "config";
        let hidden = req_uint(m, p, &["hidden_size"], 1, MAX_HIDDEN)?;
        let layers = req_uint(m, p, &["num_hidden_layers"], 1, MAX_LAYERS)?;
        let vocab = req_uint(m, p, &["vocab_size"], 1, MAX_VOCAB)?;
        let rms_eps = float(m, p, &["rms_norm_eps"])?.unwrap_or(1e-5);
        if !(rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(Error::manifest("config.rms_norm_eps", format!("value {rms_eps} out of range (0, 1)")));
        }
        // token ids inside the vocabulary: an end token the model cannot
        // produce never ends an answer (and a constrained one cannot end)
        let bos = uint(m, p, &["bos_token_id"], 0, vocab - 1)?.map(|x| x as u32);
        let eos = match get(m, &["eos_token_id"]) {
            None => vec![],
            Some((k, Value::Array(_))) => {
                let key = key_path(p, k);
                let ids = uint_list(m.get(k).unwrap_or(&Value::Null), &key)?;
                if let Some(bad) = ids.iter().find(|&&x| x >= vocab) {
                    return Err(Error::manifest(key, format!("id {bad} is outside the vocabulary of {vocab}")));
                }
                ids.into_iter().map(|x| x as u32).collect()
            }
            Some(_) => vec![req_uint(m, p, &["eos_token_id"], 0, vocab - 1)? as u32],
        };
        let tie_embeddings = boolean(m, p, &["tie_word_embeddings"])?.unwrap_or(false);
        let model_type = m.get("model_type").and_then(|v| v.as_str()).unwrap_or("").to_string();
        Ok(ModelConfig {
            model_type,
            family,
            hidden,
            layers,
            vocab,
            rms_eps,
            first_k_dense: 0,
            intermediate: 0,
            moe_intermediate: 0,
            experts: 0,
            top_k: 0,
            shared_experts: 0,
            renormalize: true,
            routed_scaling: 1.0,
            n_group: 1,
            topk_group: 1,
            attn_kinds: vec![],
            kda_heads: 0,
            kda_head_dim: 0,
            conv_kernel: 4,
            kda_full_rank_gate: false,
            gate_lower_bound: None,
            mla_heads: 0,
            qk_nope: 0,
            qk_rope: 0,
            v_head: 0,
            kv_lora: 0,
            q_lora: None,
            mla_output_gate: false,
            latent: None,
            latent_norm: false,
            activation: Activation::Silu,
            attn_res_block: None,
            bos,
            eos,
            tie_embeddings,
        })
    }

    /// Whether layer `l` uses a routed MoE FFN (else a dense GLU).
    pub fn is_moe(&self, l: usize) -> bool {
        l >= self.first_k_dense
    }
    /// Width the routed experts operate on (`routed_expert_hidden_size` or hidden).
    pub fn expert_width(&self) -> usize {
        self.latent.unwrap_or(self.hidden)
    }
    /// KDA channels `H·D`.
    pub fn kda_channels(&self) -> usize {
        self.kda_heads * self.kda_head_dim
    }
    /// Indices of MoE layers.
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (self.first_k_dense..self.layers).filter(|_| true)
    }
    /// Number of MoE layers.
    pub fn n_moe_layers(&self) -> usize {
        self.layers - self.first_k_dense
    }
    /// Number of MLA layers.
    pub fn n_mla_layers(&self) -> usize {
        self.attn_kinds.iter().filter(|k| **k == AttnKind::Mla).count()
    }
    /// Elements of one routed expert (gate + up + down).
    pub fn expert_params(&self) -> u64 {
        3 * self.moe_intermediate as u64 * self.expert_width() as u64
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// A release-form config (nested `linear_attn_config` with layer lists).
    pub(crate) fn base() -> Value {
        json!({"hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 100, "num_experts": 4,
               "num_experts_per_token": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
               "intermediate_size": 96, "num_attention_heads": 2, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
               "v_head_dim": 8, "kv_lora_rank": 16,
               "linear_attn_config": {"num_heads": 2, "head_dim": 16, "kda_layers": [1, 3], "full_attn_layers": [2]}})
    }

    #[test]
    fn parses_release_form() {
        let c = ModelConfig::from_json(&base()).unwrap();
        assert_eq!(c.attn_kinds, vec![AttnKind::Kda, AttnKind::Mla, AttnKind::Kda]);
        assert_eq!(c.kda_channels(), 32);
        assert!(c.renormalize);
        assert_eq!(c.activation, Activation::Silu);
    }

    #[test]
    fn parses_transformers_form_and_text_config() {
        let v = json!({"text_config": {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10, "n_routed_experts": 4,
            "num_experts_per_tok": 1, "moe_intermediate_size": 8, "layer_types": ["linear_attention", "full_attention"],
            "linear_num_heads": 2, "linear_head_dim": 8, "num_attention_heads": 2, "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_lora_rank": 8, "norm_topk_prob": false,
            "hidden_act": "situ", "mlp_layer_types": ["dense", "sparse"], "intermediate_size": 16}, "model_type": "kimi_k3"});
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.attn_kinds, vec![AttnKind::Kda, AttnKind::Mla]);
        assert_eq!(c.first_k_dense, 1);
        assert!(!c.renormalize);
        assert_eq!(c.activation, Activation::Situ { beta: 4.0, linear_beta: 25.0 });
    }

    /// The router scores with a sigmoid (MODEL.md), and a config naming
    /// another function is refused at the open naming the key, so the
    /// router and the trace replay (`waste_moe::route_forced`), which both
    /// use the sigmoid, always score as the model does.
    #[test]
    fn a_router_scoring_function_other_than_sigmoid_is_refused() {
        let mut v = base();
        v["moe_router_activation_func"] = json!("sigmoid");
        assert!(ModelConfig::from_json(&v).is_ok());
        for other in ["softmax", "Sigmoid", ""] {
            v["moe_router_activation_func"] = json!(other);
            let e = ModelConfig::from_json(&v).unwrap_err().to_string();
            assert!(e.contains("moe_router_activation_func") && e.contains("only \"sigmoid\""), "{other}: {e}");
        }
    }

    #[test]
    fn rejects_huge_and_bad_values_naming_the_key() {
        let mut v = base();
        v["hidden_size"] = json!(1u64 << 40);
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("config.hidden_size") && e.contains("1099511627776"), "{e}");
        let mut v = base();
        v["num_experts_per_token"] = json!(5);
        assert!(ModelConfig::from_json(&v).unwrap_err().to_string().contains("num_experts_per_token"));
        let mut v = base();
        v["linear_attn_config"]["kda_layers"] = json!([0]);
        assert!(ModelConfig::from_json(&v).unwrap_err().to_string().contains("kda_layers"));
        let mut v = base();
        v["hidden_size"] = json!(-3);
        assert!(ModelConfig::from_json(&v).unwrap_err().to_string().contains("non-negative integer"));
        // a finite f64 that is infinite as the engine's f32
        let mut v = base();
        v["routed_scaling_factor"] = json!(1e39);
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("config.routed_scaling_factor") && e.contains("not a finite f32"), "{e}");
        // token ids past the vocabulary (one that wrapped as u32 included)
        let vocab = base()["vocab_size"].as_u64().unwrap();
        for (key, val) in [
            ("bos_token_id", json!(vocab)),
            ("eos_token_id", json!(vocab + 3)),
            ("eos_token_id", json!([1, vocab])),
            ("eos_token_id", json!([(1u64 << 32) + 1])),
        ] {
            let mut v = base();
            v[key] = val.clone();
            let e = ModelConfig::from_json(&v).unwrap_err().to_string();
            assert!(e.contains(&format!("config.{key}")), "{key} {val}: {e}");
        }
        let mut v = base();
        v["attention_bias"] = json!(true);
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("attention_bias = true"), "{e}");
        v["attention_bias"] = json!(false);
        ModelConfig::from_json(&v).unwrap();
        let mut v = base();
        v["eos_token_id"] = json!([vocab - 1, 0]);
        assert_eq!(ModelConfig::from_json(&v).unwrap().eos, vec![vocab as u32 - 1, 0]);
    }

    #[test]
    fn booleans_are_read_by_value() {
        let mut v = base();
        v["mla_use_output_gate"] = json!(false);
        v["moe_renormalize"] = json!(false);
        let c = ModelConfig::from_json(&v).unwrap();
        assert!(!c.mla_output_gate && !c.renormalize);
        v["mla_use_output_gate"] = json!("yes");
        assert!(ModelConfig::from_json(&v).is_err());
    }
}
