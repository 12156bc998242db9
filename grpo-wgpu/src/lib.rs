//! # grpo-wgpu
//!
//! The GPU backend of grpo-kernels: WGSL compute shaders (the workspace's `shaders/`) run through
//! wgpu on Vulkan, Metal or DX12, equal to grpo-core within the tolerances of the test suite's
//! table (`tests/src/tolerance.rs`).
//!
//! - [`GpuContext`]: device, queue, cached pipelines, pooled buffers; blocking and async use.
//! - [`VocabKernel`]: log-sum-exp, token log-prob, entropy, KL, JSD_β and the fused backward over
//!   logit rows (f32, f16, bf16 storage) — recomputing the row statistics (`backward`,
//!   `backward_rows` for any set of log-prob, entropy and KL terms) or from the states a saving
//!   forward kept (`forward_saved`, `kl_saved`, then `backward_saved`), out of place (f32) or
//!   in place (`backward_rows_in_place`, `backward_saved_in_place`: over the logits, in their
//!   storage type); the JSD's gradient (`jsd_backward`, `jsd_backward_in_place`, or from the
//!   states `jsd_saved` kept: `jsd_backward_saved`, `jsd_backward_saved_in_place`); `forward`,
//!   `kl`, `jsd` and every method named here also as an `_async` method that awaits the
//!   readbacks (same bits, same errors).
//! - [`AdvantageKernel`]: GRPO z-score family, Dr.GRPO, RLOO, batch-scaled, GOPO, G²RPO, GDPO.
//! - [`LossKernel`]: PPO-clip (symmetric, clip-higher, KL3 bounds, dual-clip, δ cap), CISPO,
//!   SAPO, REINFORCE, GSPO (dual-clip, δ cap), GSPO-token, P3O with its ESS sums; KL penalties (k1, abs, k2, k3,
//!   importance-corrected k3·ρ, straight-through k1+/k3+); token/sequence IS weights
//!   (truncate, mask); verl's rollout rejection masks (k1/k2/k3 per token or per sequence sum,
//!   mean, max) and TRL's off-policy sequence mask; aggregation of token losses (every grpo-core
//!   mode).
//! - [`GpuError`]: no adapter, missing feature, too large (bytes) or too many workgroups for one
//!   dispatch, a device failure, or grpo-core's own validation error.
//!
//! Validation happens on the host before anything is written; data-dependent checks (non-finite
//! logits) are reported by the shaders in status words and turned into the same
//! [`grpo_core::Error`] before any caller buffer is touched.
//!
//! ```no_run
//! use grpo_wgpu::{GpuContext, VocabKernel};
//! let ctx = GpuContext::new()?;
//! let logits = [0.0f32, 1.0, 2.0, 3.0];
//! let mut lse = [0.0f32; 1];
//! VocabKernel::new(&ctx).log_sum_exp(&logits, 4, 1.0, &mut lse)?;
//! assert!((lse[0] - 3.4401897).abs() < 1e-5);
//! # Ok::<(), grpo_wgpu::GpuError>(())
//! ```

mod advantage;
mod context;
mod error;
mod loss;
pub mod shaders;
mod vocab;

pub use advantage::AdvantageKernel;
pub use context::{Arg, DEFAULT_TIMEOUT, GpuContext, Resident};
pub use error::{GpuError, Result};
pub use loss::LossKernel;
pub use shaders::{LogitDtype, ShaderId};
pub use vocab::{ForwardOut, LogitStorage, ResidentVocab, VocabKernel};
