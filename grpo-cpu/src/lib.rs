//! # grpo-cpu
//!
//! Fast CPU kernels for grpo-core's operations: SIMD backends (AVX-512, AVX2+FMA, NEON) and row
//! parallelism, **bit-identical** to grpo-core for every ISA and thread count.
//!
//! The contract assumes the default floating-point environment on every thread that runs a
//! kernel — the calling thread and the pool's: round to nearest even, no flush-to-zero, no
//! denormals-are-zero (Rust's default). A host that changes it (for example PyTorch's
//! `torch.set_flush_denormal(True)`, which sets FTZ/DAZ in the calling thread's MXCSR on x86,
//! inherited by threads it creates later) can change results wherever a subnormal appears, and
//! the rows a pool thread computes may then differ from the calling thread's.
//!
//! - [`Backend`]: the instruction set, detected once; [`Cpu`]: a backend plus a thread pool.
//! - Vocabulary row operations as methods of [`Cpu`] (`stats_rows`, `logprob_entropy_rows`,
//!   `kl_rows`, `jsd_rows`, `backward_rows`, `backward_rows_in_place`): grpo-core's
//!   `grpo_core::vocab` batch functions, same signatures plus `&self`, same bits, same errors.
//! - Per-token policy losses on the pool: [`Cpu::ppo_clip`] (grpo-core's `ppo_clip` per block
//!   of [`LOSS_BLOCK`] tokens; same bits, same errors).
//! - [`roofline`]: the streaming read / copy loops that kernel bandwidth is measured against.
//!
//! Structure (BLAKE3/memchr style): one lane trait of 16 `f32` lanes with `#[inline(always)]`
//! operations, one implementation per ISA in `arch/` (the only place with `unsafe`), kernels
//! written once over the trait, and `#[target_feature]` only on the per-ISA entry functions.

pub mod backend;
mod cpu;
mod loss;
pub mod math;
pub mod roofline;
mod vocab;

mod arch;
mod kernels;
mod lanes;
#[cfg(test)]
mod test_data;

pub use backend::Backend;
pub use cpu::Cpu;
/// Logit storage the kernels read: `f32`, `half::bf16`, `half::f16` (sealed: its methods name
/// crate-internal lane types).
pub use kernels::vocab::Load as Storage;
pub use loss::{LOSS_BLOCK, LossFloat};
#[doc(hidden)]
pub use vocab::fallbacks_on_this_thread;
