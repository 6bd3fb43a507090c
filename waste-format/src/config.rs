//! The model configuration, parsed from the manifest's `config` object.
//!
//! Accepts the release's form (`linear_attn_config`, `num_experts`,
//! `num_experts_per_token`, ...), a nested `text_config` (flattened, the outer
//! object kept under `_outer`), and transformers' native form (`layer_types`,
//! `linear_num_heads`, `n_routed_experts`, `num_experts_per_tok`, ...).
//! Every value is bounded; failures name the key and the value.

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

fn get<'a>(m: &'a Map<String, Value>, keys: &[&str]) -> Option<(&'a str, &'a Value)> {
    keys.iter().find_map(|k| m.get_key_value(*k).filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.as_str(), v)))
}

fn key_path(prefix: &str, k: &str) -> String {
    format!("{prefix}.{k}")
}

fn uint(m: &Map<String, Value>, prefix: &str, keys: &[&str], lo: usize, hi: usize) -> Result<Option<usize>> {
    let Some((k, v)) = get(m, keys) else { return Ok(None) };
    let n = v
        .as_u64()
        .ok_or_else(|| Error::manifest(key_path(prefix, k), format!("expected a non-negative integer, got {v}")))?;
    if n < lo as u64 || n > hi as u64 {
        return Err(Error::manifest(key_path(prefix, k), format!("value {n} out of range {lo}..={hi}")));
    }
    Ok(Some(n as usize))
}

fn req_uint(m: &Map<String, Value>, prefix: &str, keys: &[&str], lo: usize, hi: usize) -> Result<usize> {
    uint(m, prefix, keys, lo, hi)?.ok_or_else(|| Error::manifest(key_path(prefix, keys[0]), "missing"))
}

fn float(m: &Map<String, Value>, prefix: &str, keys: &[&str]) -> Result<Option<f32>> {
    let Some((k, v)) = get(m, keys) else { return Ok(None) };
    let f = v.as_f64().ok_or_else(|| Error::manifest(key_path(prefix, k), format!("expected a number, got {v}")))?;
    // finite as the f32 the engine computes with (1e39 is a finite f64)
    if !(f as f32).is_finite() {
        return Err(Error::manifest(key_path(prefix, k), format!("{f} is not a finite f32")));
    }
    Ok(Some(f as f32))
}

fn boolean(m: &Map<String, Value>, prefix: &str, keys: &[&str]) -> Result<Option<bool>> {
    let Some((k, v)) = get(m, keys) else { return Ok(None) };
    v.as_bool().map(Some).ok_or_else(|| Error::manifest(key_path(prefix, k), format!("expected a boolean, got {v}")))
}

fn uint_list(v: &Value, key: &str) -> Result<Vec<usize>> {
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
        let p = "config";
        let hidden = req_uint(m, p, &["hidden_size"], 1, MAX_HIDDEN)?;
        let layers = req_uint(m, p, &["num_hidden_layers"], 1, MAX_LAYERS)?;
        let vocab = req_uint(m, p, &["vocab_size"], 1, MAX_VOCAB)?;
        let rms_eps = float(m, p, &["rms_norm_eps"])?.unwrap_or(1e-5);
        if !(rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(Error::manifest("config.rms_norm_eps", format!("value {rms_eps} out of range (0, 1)")));
        }
        let experts = req_uint(m, p, &["num_experts", "n_routed_experts", "num_local_experts"], 1, MAX_EXPERTS)?;
        let top_k = req_uint(m, p, &["num_experts_per_token", "num_experts_per_tok"], 1, MAX_TOPK.min(experts))?;
        let moe_intermediate = req_uint(m, p, &["moe_intermediate_size"], 1, MAX_FFN)?;
        let first_k_dense = match uint(m, p, &["first_k_dense_replace"], 0, layers)? {
            Some(k) => k,
            None => match m.get("mlp_layer_types").filter(|v| !v.is_null()) {
                // transformers' form: leading "dense" layers, the rest "sparse"
                Some(Value::Array(a)) => {
                    let k = a.iter().take_while(|v| v.as_str() == Some("dense")).count();
                    if a.len() != layers || a[k..].iter().any(|v| v.as_str() != Some("sparse")) {
                        return Err(Error::manifest(
                            "config.mlp_layer_types",
                            "must be leading \"dense\" layers then \"sparse\" ones, one per layer",
                        ));
                    }
                    k
                }
                Some(v) => {
                    return Err(Error::manifest("config.mlp_layer_types", format!("expected an array, got {v}")))
                }
                None => 0,
            },
        };
        let intermediate = match uint(m, p, &["intermediate_size"], 1, MAX_FFN)? {
            Some(n) => n,
            None if first_k_dense == 0 => 0,
            None => return Err(Error::manifest("config.intermediate_size", "missing (needed by dense layers)")),
        };
        let shared_experts = uint(m, p, &["num_shared_experts", "n_shared_experts"], 0, MAX_SHARED)?.unwrap_or(0);
        let renormalize = boolean(m, p, &["moe_renormalize", "norm_topk_prob"])?.unwrap_or(true);
        let routed_scaling = float(m, p, &["routed_scaling_factor"])?.unwrap_or(1.0);
        let n_group = uint(m, p, &["num_expert_group", "n_group"], 1, experts)?.unwrap_or(1);
        if experts % n_group != 0 {
            return Err(Error::manifest(
                "config.num_expert_group",
                format!("{n_group} does not divide num_experts {experts}"),
            ));
        }
        let topk_group = uint(m, p, &["topk_group"], 1, n_group)?.unwrap_or(n_group);
        if n_group > 1 && top_k > topk_group * (experts / n_group) {
            return Err(Error::manifest(
                "config.topk_group",
                format!("{topk_group} groups cannot supply top_k {top_k}"),
            ));
        }
        if let Some((k, v)) = get(m, &["moe_router_activation_func"]) {
            if v.as_str() != Some("sigmoid") {
                return Err(Error::manifest(key_path(p, k), format!("only \"sigmoid\" is supported, got {v}")));
            }
        }

        // Linear attention block: the release's nested object or transformers' flat keys.
        let lin = match m.get("linear_attn_config") {
            Some(Value::Object(o)) => Some(o),
            Some(Value::Null) | None => None,
            Some(v) => {
                return Err(Error::manifest("config.linear_attn_config", format!("expected an object, got {v}")))
            }
        };
        let lp = "config.linear_attn_config";
        let (kda_heads, kda_head_dim, conv_kernel, full_rank, lower_bound) = match lin {
            Some(o) => (
                uint(o, lp, &["num_heads"], 1, MAX_HEADS)?,
                uint(o, lp, &["head_dim"], 1, MAX_HEAD_DIM)?,
                uint(o, lp, &["short_conv_kernel_size"], 1, 64)?,
                boolean(o, lp, &["use_full_rank_gate"])?.unwrap_or(false),
                float(o, lp, &["gate_lower_bound"])?,
            ),
            None => (
                uint(m, p, &["linear_num_heads"], 1, MAX_HEADS)?,
                uint(m, p, &["linear_head_dim"], 1, MAX_HEAD_DIM)?,
                uint(m, p, &["linear_conv_kernel_dim"], 1, 64)?,
                boolean(m, p, &["use_full_rank_gate"])?.unwrap_or(false),
                float(m, p, &["gate_lower_bound"])?,
            ),
        };
        if let Some(lb) = lower_bound {
            if lb >= 0.0 {
                return Err(Error::manifest(
                    "config.linear_attn_config.gate_lower_bound",
                    format!("must be negative, got {lb}"),
                ));
            }
        }
        let attn_kinds = Self::parse_layer_kinds(m, lin, layers)?;
        let has_kda = attn_kinds.contains(&AttnKind::Kda);
        let has_mla = attn_kinds.contains(&AttnKind::Mla);
        let need =
            |v: Option<usize>, key: &str| v.ok_or_else(|| Error::manifest(key, "missing (needed by KDA layers)"));
        let (kda_heads, kda_head_dim, conv_kernel) = if has_kda {
            (
                need(kda_heads, "config.linear_attn_config.num_heads")?,
                need(kda_head_dim, "config.linear_attn_config.head_dim")?,
                conv_kernel.unwrap_or(4),
            )
        } else {
            (kda_heads.unwrap_or(0), kda_head_dim.unwrap_or(0), conv_kernel.unwrap_or(4))
        };
        if has_kda && kda_heads.checked_mul(kda_head_dim).is_none_or(|c| c > MAX_HIDDEN) {
            return Err(Error::manifest(
                "config.linear_attn_config.num_heads",
                format!("{kda_heads} x {kda_head_dim} too wide"),
            ));
        }

        let mreq = |keys: &[&str], lo: usize, hi: usize| -> Result<usize> {
            if has_mla {
                req_uint(m, p, keys, lo, hi)
            } else {
                Ok(uint(m, p, keys, lo, hi)?.unwrap_or(0))
            }
        };
        let mla_heads = mreq(&["num_attention_heads"], 1, MAX_HEADS)?;
        let qk_nope = mreq(&["qk_nope_head_dim"], 0, MAX_HEAD_DIM)?;
        let qk_rope = mreq(&["qk_rope_head_dim"], 0, MAX_HEAD_DIM)?;
        let v_head = mreq(&["v_head_dim"], 1, MAX_HEAD_DIM)?;
        let kv_lora = mreq(&["kv_lora_rank"], 1, MAX_HIDDEN)?;
        let q_lora = uint(m, p, &["q_lora_rank"], 1, MAX_HIDDEN)?;
        if has_mla {
            if qk_nope + qk_rope == 0 {
                return Err(Error::manifest("config.qk_nope_head_dim", "qk_nope_head_dim + qk_rope_head_dim is 0"));
            }
            if let Some(false) = boolean(m, p, &["mla_use_nope"])? {
                return Err(Error::Unsupported("MLA with rotary embeddings (mla_use_nope = false)".into()));
            }
            // transformers then gives q_a_proj, kv_a_proj_with_mqa and o_proj
            // biases, which the container has no place for
            if let Some(true) = boolean(m, p, &["attention_bias"])? {
                return Err(Error::Unsupported("MLA projections with biases (attention_bias = true)".into()));
            }
            if mla_heads.checked_mul(qk_nope + qk_rope + v_head).is_none_or(|c| c > MAX_HIDDEN * 4) {
                return Err(Error::manifest("config.num_attention_heads", format!("{mla_heads} heads too wide")));
            }
        }
        let mla_output_gate = boolean(m, p, &["mla_use_output_gate"])?.unwrap_or(false);
        let latent = uint(m, p, &["routed_expert_hidden_size"], 1, MAX_HIDDEN)?;
        let latent_norm = boolean(m, p, &["latent_moe_use_norm"])?.unwrap_or(false) && latent.is_some();
        let activation = match get(m, &["hidden_act"]).map(|(_, v)| v) {
            None => Activation::Silu,
            Some(Value::String(s)) if s == "silu" || s == "swish" => Activation::Silu,
            Some(Value::String(s)) if s == "situ" => Activation::Situ {
                beta: float(m, p, &["activation_situ_beta"])?.unwrap_or(4.0),
                linear_beta: float(m, p, &["activation_situ_linear_beta"])?.unwrap_or(25.0),
            },
            Some(v) => return Err(Error::manifest("config.hidden_act", format!("unsupported activation {v}"))),
        };
        if let Activation::Situ { beta, .. } = activation {
            if beta <= 0.0 {
                return Err(Error::manifest("config.activation_situ_beta", format!("must be positive, got {beta}")));
            }
        }
        let attn_res_block = uint(m, p, &["attn_res_block_size"], 1, MAX_LAYERS)?;
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
            hidden,
            layers,
            vocab,
            rms_eps,
            first_k_dense,
            intermediate,
            moe_intermediate,
            experts,
            top_k,
            shared_experts,
            renormalize,
            routed_scaling,
            n_group,
            topk_group,
            attn_kinds,
            kda_heads,
            kda_head_dim,
            conv_kernel,
            kda_full_rank_gate: full_rank,
            gate_lower_bound: lower_bound,
            mla_heads,
            qk_nope,
            qk_rope,
            v_head,
            kv_lora,
            q_lora,
            mla_output_gate,
            latent,
            latent_norm,
            activation,
            attn_res_block,
            bos,
            eos,
            tie_embeddings,
        })
    }

    fn parse_layer_kinds(
        m: &Map<String, Value>,
        lin: Option<&Map<String, Value>>,
        layers: usize,
    ) -> Result<Vec<AttnKind>> {
        if let Some(o) = lin {
            let full = o.get("full_attn_layers").filter(|v| !v.is_null());
            let kda = o.get("kda_layers").filter(|v| !v.is_null());
            if full.is_some() || kda.is_some() {
                let mut kinds = vec![None; layers];
                for (list, kind, key) in [(kda, AttnKind::Kda, "kda_layers"), (full, AttnKind::Mla, "full_attn_layers")]
                {
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
                return Err(Error::manifest(
                    "config.layer_types",
                    format!("{} entries for {layers} layers", arr.len()),
                ));
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
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
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
