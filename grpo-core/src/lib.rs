//! # grpo-core
//!
//! The numerical contract of GRPO-family reinforcement learning, defined once: group-relative
//! advantages, policy divergences and the clipping they drive, per-token surrogate losses with
//! exact gradients and their aggregation, and vocabulary-wide reductions over logits.
//!
//! `#![no_std]`, no allocation, no `unsafe`, no panics on any input: every operation takes
//! caller slices, validates them completely, and either writes its outputs or returns an
//! [`Error`] with every output untouched. The other crates of the workspace (`grpo-cpu`,
//! `grpo-wgpu`) compute the same results faster and are tested against this one.
//!
//! The formulas, their sources and every constant are specified in the project's `MATH.md`;
//! each function's documentation repeats the formula it implements and where it comes from.
//!
//! ## Example: GRPO advantages of two groups
//!
//! See [`advantage`] for the estimators.
#![no_std]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod advantage;
pub mod aggregate;
pub mod control;
pub mod divergence;
pub mod error;
pub mod is_correction;
pub mod layout;
pub mod loss;
pub mod presets;
pub mod real;
pub mod selection;
pub mod stats;
pub mod vocab;

pub use error::{Error, Result};
pub use layout::{Groups, Segments, Tokens};
pub use presets::Preset;
pub use real::Real;
