//! Sigmoid router, expert GLU (SiLU/SiTU) over quantized records, shared experts, dense FFN.
#![deny(missing_docs)]
