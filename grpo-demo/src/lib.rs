//! # grpo-demo
//!
//! End-to-end demo of grpo-kernels: a small decoder-only transformer (candle, CPU) is warmed up
//! on a few supervised examples of little-endian 3-digit addition, then trained with GRPO-family
//! recipes whose math (advantages, filters, per-token losses, aggregation, fused vocabulary
//! log-prob/entropy forward and backward) comes from `grpo-core` and `grpo-cpu`.

pub mod model;
pub mod report;
pub mod rl;
pub mod rng;
pub mod task;
pub mod train;
