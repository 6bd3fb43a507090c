//! The WASTE engine: Model, Session, prefill/decode, sampling, generation, state; the public Rust API.
#![deny(missing_docs)]
