//! Architecture families: each declares, in one module, what sets it apart
//! — which configs it claims, the config keys it reads (its layer plan
//! among them), the tensors its forward pass needs and the source
//! spellings the converter tries. The blocks they share (KDA, MLA, the MoE
//! and dense FFNs) are in [`blocks`]; the math in `waste-attn` and
//! `waste-moe`.
//!
//! Adding a family: a module here with an [`Architecture`], a [`Family`]
//! variant, its place in [`Family::ALL`] (before the fallback), and the
//! steps of `docs/ADDING-AN-ARCHITECTURE.md`.

pub mod blocks;
pub mod k3;
pub mod kimi_linear;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::schema::Required;
use serde_json::{Map, Value};

/// What one architecture family declares.
pub struct Architecture {
    /// Short name (`waste info`, errors, docs).
    pub name: &'static str,
    /// The `model_type`s that name it.
    pub model_types: &'static [&'static str],
    /// The config keys its parser reads beyond the common ones (sizes,
    /// `rms_norm_eps`, special tokens, `tie_word_embeddings`); nested keys
    /// dotted (`linear_attn_config.num_heads`), alternatives as
    /// `a|b`. A test sets each to a wrong type and expects an error naming it.
    pub keys: &'static [&'static str],
    /// Whether a (flattened) config is this family's: its `model_type`, or
    /// a key only it has. The fallback family claims every config.
    pub claims: fn(&Map<String, Value>) -> bool,
    /// Read the family's keys into the config (the common ones are read);
    /// every value bounded, errors naming the key.
    pub parse: fn(&Map<String, Value>, &mut ModelConfig) -> Result<()>,
    /// Every tensor the forward pass reads, in forward order (the
    /// container's check at open, the converter's list, the synthesizer's).
    pub tensors: fn(&ModelConfig) -> Vec<Required>,
    /// A container tensor name's spellings in the family's sources (the
    /// release's and transformers'), tried in order by the converter.
    pub source_names: fn(&str) -> Vec<String>,
}

/// The architecture families the engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Kimi-Linear (KDA + MLA layers, routed MoE): `kimi_linear`.
    KimiLinear,
    /// Kimi K3: Kimi-Linear's blocks with the K3 additions (latent MoE,
    /// SiTU, full-rank KDA gate, bounded decay, MLA q-LoRA and output
    /// gate, Attention Residuals): `kimi_k3`.
    K3,
}

impl Family {
    /// Every family, the most specific first; the last claims every config.
    pub const ALL: [Family; 2] = [Family::K3, Family::KimiLinear];

    /// The family's declarations.
    pub fn def(self) -> &'static Architecture {
        match self {
            Family::KimiLinear => &kimi_linear::ARCH,
            Family::K3 => &k3::ARCH,
        }
    }

    /// The first family in [`Family::ALL`] that claims a flattened config.
    pub fn detect(m: &Map<String, Value>) -> Family {
        Family::ALL.into_iter().find(|f| (f.def().claims)(m)).unwrap_or(Family::KimiLinear)
    }

    /// Whether `m`'s `model_type` is one of `f`'s.
    pub(crate) fn named(m: &Map<String, Value>, f: &Architecture) -> bool {
        m.get("model_type").and_then(|v| v.as_str()).is_some_and(|t| f.model_types.contains(&t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use serde_json::json;

    /// The release's form: a nested `linear_attn_config` with layer lists.
    fn release() -> Value {
        crate::config::tests::base()
    }

    /// transformers' form: flat KDA keys, `layer_types`, `mlp_layer_types`.
    fn transformers() -> Value {
        json!({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10, "n_routed_experts": 4,
               "num_experts_per_tok": 1, "moe_intermediate_size": 8, "layer_types": ["linear_attention", "full_attention"],
               "linear_num_heads": 2, "linear_head_dim": 8, "num_attention_heads": 2, "qk_nope_head_dim": 4,
               "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_lora_rank": 8, "mlp_layer_types": ["dense", "sparse"],
               "intermediate_size": 16})
    }

    fn as_k3(mut v: Value) -> Value {
        v["model_type"] = json!("kimi_k3");
        v["hidden_act"] = json!("situ");
        v
    }

    fn family(v: &Value) -> Family {
        crate::ModelConfig::from_json(v).unwrap().family
    }

    #[test]
    fn a_config_is_claimed_by_its_model_type_or_a_key_only_its_family_has() {
        assert_eq!(family(&release()), Family::KimiLinear);
        assert_eq!(family(&as_k3(transformers())), Family::K3);
        for f in Family::ALL {
            for t in f.def().model_types {
                let mut v = release();
                v["model_type"] = json!(t);
                assert_eq!(family(&v), f, "{t}");
            }
        }
        // K3's additions are detected from the config (MODEL.md), whatever the model_type says
        for (k, val) in [
            ("attn_res_block_size", json!(2)),
            ("routed_expert_hidden_size", json!(16)),
            ("q_lora_rank", json!(8)),
            ("hidden_act", json!("situ")),
            ("use_full_rank_gate", json!(false)),
        ] {
            let mut v = release();
            v["model_type"] = json!("kimi_linear");
            v[k] = val.clone();
            assert_eq!(family(&v), Family::K3, "{k}");
        }
        let mut v = release();
        v["linear_attn_config"]["gate_lower_bound"] = json!(-5.0);
        assert_eq!(family(&v), Family::K3);
        // null is absent
        let mut v = release();
        v["q_lora_rank"] = Value::Null;
        assert_eq!(family(&v), Family::KimiLinear);
        // the last family is the fallback: it claims anything
        let last = Family::ALL[Family::ALL.len() - 1];
        assert!((last.def().claims)(&Map::new()));
    }

    /// Each family's `keys` are what its parser reads: a key set to a
    /// string (every one expects another type, or a named value) is an
    /// error naming it, in the config form that reads it.
    #[test]
    fn every_declared_key_is_read_and_checked() {
        for f in Family::ALL {
            let bases: Vec<Value> = match f {
                Family::K3 => vec![as_k3(release()), as_k3(transformers())],
                Family::KimiLinear => vec![release(), transformers()],
            };
            for key in f.def().keys {
                for spelling in key.split('|') {
                    let caught = bases.iter().any(|b| {
                        assert_eq!(family(b), f, "{spelling}");
                        let mut v = b.clone();
                        // an alternative is read when the spellings before it are absent
                        for other in key.split('|').filter(|o| *o != spelling) {
                            remove(&mut v, other);
                        }
                        if !set(&mut v, spelling, json!("x")) {
                            return false;
                        }
                        match crate::ModelConfig::from_json(&v) {
                            Err(Error::Manifest { key, .. }) => key == format!("config.{spelling}"),
                            _ => false,
                        }
                    });
                    assert!(caught, "{}: {spelling} is declared but never read", f.def().name);
                }
            }
        }
    }

    fn remove(v: &mut Value, path: &str) {
        let (outer, inner) = path.split_once('.').unwrap_or(("", path));
        let o = if outer.is_empty() { Some(&mut *v) } else { v.get_mut(outer) };
        if let Some(Value::Object(o)) = o {
            o.remove(inner);
        }
    }

    /// Set a (dotted) key; false when its outer object is absent.
    fn set(v: &mut Value, path: &str, val: Value) -> bool {
        match path.split_once('.') {
            Some((outer, inner)) => match v.get_mut(outer) {
                Some(o) => o[inner] = val,
                None => return false,
            },
            None => v[path] = val,
        }
        true
    }

    #[test]
    fn k3_tensors_are_kimi_linears_with_the_attention_residuals() {
        let mut v = as_k3(release());
        let c = crate::ModelConfig::from_json(&v).unwrap();
        assert_eq!(kimi_linear::tensors(&c), k3::tensors(&c));
        v["attn_res_block_size"] = json!(2);
        let c = crate::ModelConfig::from_json(&v).unwrap();
        let (kl, k3) = (kimi_linear::tensors(&c), k3::tensors(&c));
        let extra: Vec<_> = k3.iter().filter(|t| !kl.contains(t)).map(|t| t.name.as_str()).collect();
        assert_eq!(extra.len(), 4 * c.layers + 2);
        assert!(extra.iter().all(|n| n.contains("attn_res") || n.contains("attention_res") || n.contains("mlp_res")));
        assert!(kl.iter().all(|t| k3.contains(t)));
        assert_eq!(crate::required_tensors(&c), k3);
    }

    #[test]
    fn kimi_linear_source_names_try_the_release_first_then_transformers() {
        let names = kimi_linear::source_names("model.layers.3.self_attn.A_log");
        assert_eq!(names, ["model.layers.3.self_attn.A_log", "model.layers.3.self_attn.forget_gate.A_log"]);
        let names = kimi_linear::source_names("model.layers.0.mlp.up_proj.weight");
        assert_eq!(names[1], "model.layers.0.block_sparse_moe.up_proj.weight");
        assert_eq!(kimi_linear::source_names("lm_head.weight"), ["lm_head.weight"]);
    }
}
