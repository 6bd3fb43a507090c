//! tiktoken-style BPE with the model's pre-tokenizer regex, special tokens and chat templates.
#![deny(missing_docs)]
