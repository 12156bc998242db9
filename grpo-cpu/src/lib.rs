//! # grpo-cpu
//!
//! Fast CPU kernels for grpo-core's operations: SIMD backends (AVX-512, AVX2+FMA, NEON) and row
//! parallelism, **bit-identical** to grpo-core for every ISA and thread count.
//!
//! Status: this crate currently provides run-time backend detection ([`Backend`]) only. The
//! vocabulary kernels that use it arrive with the vocabulary-kernels issue; until then, call
//! grpo-core directly — it is the reference every backend must match.

pub mod backend;

pub use backend::Backend;
