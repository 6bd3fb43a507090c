//! # waste-attn
//!
//! The two attention kinds of the Kimi family for one token at a time:
//! Kimi Delta Attention ([`kda`]: short causal conv with a ring state, the
//! Kimi-Linear softplus decay or K3's bounded decay, beta, the delta-rule
//! state update, gated RMSNorm output) and multi-head latent attention
//! ([`mla`]: a latent cache of `kv_lora + qk_rope` floats per position,
//! absorbed decode, optional q-LoRA and sigmoid output gate). States are
//! plain vectors so a session can serialize them.
//!
//! Matches `transformers`' `modeling_kimi_linear.py` (the reference):
//! softplus as `ln(1+exp(z))` below 20, q/k L2 norm with `+1e-6` inside the
//! square root, latent norms with eps 1e-6.
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod kda;
pub mod mla;

pub use kda::{KdaConfig, KdaGate, KdaScratch, KdaState, KdaWeights};
pub use mla::{ContextFull, MlaConfig, MlaQuery, MlaScratch, MlaState, MlaWeights};
