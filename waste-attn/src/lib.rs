//! Kimi Delta Attention and multi-head latent attention for one token, with serializable state.
#![deny(missing_docs)]
