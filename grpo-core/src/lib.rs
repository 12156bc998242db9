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
//! ```
//! use grpo_core::advantage::zscore::{zscore, ZScoreConfig};
//! use grpo_core::{Groups, Preset};
//! // Two groups of 4 completions: rewards (1, 0, 0, 0) and (1, 1, 1, 1).
//! let rewards = [1.0f64, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
//! let mut adv = [0.0; 8];
//! let d = zscore(&rewards, Groups::Uniform(4), &ZScoreConfig::from_preset(Preset::Trl), &mut adv)
//!     .unwrap();
//! // Group 0: μ = 1/4, unbiased σ = 1/2, A = (s − μ)/(σ + 1e-4); group 1 has no variance: 0.
//! assert!((adv[0] - 0.75 / (0.5 + 1e-4)).abs() < 1e-12);
//! assert!((adv[1] + 0.25 / (0.5 + 1e-4)).abs() < 1e-12);
//! assert_eq!(&adv[4..], &[0.0; 4]);
//! assert_eq!(d.zero_variance_groups, 1);
//! ```
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
