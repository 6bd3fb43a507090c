//! OpenAI-compatible HTTP server library for the WASTE engine.
#![deny(missing_docs)]
