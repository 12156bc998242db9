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
//!   `kl_rows`, `jsd_rows`, `jsd_backward_rows`, `jsd_backward_rows_in_place`,
//!   `backward_rows`, `backward_rows_in_place`, the forwards that save their row states —
//!   `logprob_entropy_rows_saved` and, for distillation, `kl_rows_saved` and `jsd_rows_saved`
//!   — and the backwards from them: `backward_rows_saved`, `backward_rows_in_place_saved`,
//!   `jsd_backward_rows_saved`, `jsd_backward_rows_in_place_saved`):
//!   grpo-core's `grpo_core::vocab` batch functions, same signatures plus `&self`, same bits,
//!   same errors.
//! - Per-token policy losses on the pool: [`Cpu::ppo_clip`] (grpo-core's `ppo_clip` per block
//!   of [`LOSS_BLOCK`] tokens; same bits, same errors).
//! - [`roofline`]: the streaming read / copy loops that kernel bandwidth is measured against.
//!
//! # Build settings of the calling crate
//!
//! The vocabulary row operations are generic over the logits' storage types, so their kernels
//! are compiled in the crate that calls them, with that crate's profile. Settings given to
//! grpo-cpu as a dependency (`[profile.dev.package."*"] opt-level = 3`) do not reach them;
//! [`Cpu::ppo_clip`], which dispatches through a sealed trait, is compiled here. A binary crate
//! calling `logprob_entropy_rows` (with entropy) and `kl_rows` on 64 × 32768 f32 rows
//! (AVX2 + FMA host, two threads, median of 21 calls, two to four runs each, 2026-12-05), its
//! dependencies at opt-level 3 in every dev build:
//!
//! | the calling crate built with | fused log-prob + entropy | KL |
//! |---|---|---|
//! | `--release` | 0.40–0.55 ms | 0.90–1.17 ms |
//! | the dev profile (opt-level 0) | 92–94 ms | 176 ms |
//! | dev, `opt-level = 1` | 1.2–1.6 ms | 2.3–2.9 ms |
//! | dev, `opt-level = 3` | 0.59–0.83 ms | 1.17–1.57 ms |
//! | dev, `opt-level = 3`, `debug-assertions = false` | 0.40–0.42 ms | 0.79–0.81 ms |
//!
//! Debug assertions also switch on the standard library's precondition checks, and those are
//! compiled into the kernels' inlined loops in the calling crate. A trainer that calls the
//! kernels in its tests or debug builds gets their release speed with, in its own
//! `Cargo.toml`:
//!
//! ```toml
//! [profile.dev]   # [profile.test], which `cargo test` uses, inherits these
//! opt-level = 3
//! debug-assertions = false
//! ```
//!
//! The same instantiations cost the calling crate compile time: the kernels of each backend
//! form a codegen unit of their own (three on x86-64: AVX-512, AVX2 and the portable path), so
//! a build spreads them over its cores, and each backend compiles each kernel once (software
//! prefetching is a run-time setting, [`Cpu::with_software_prefetch`]; AVX-512 compiles the
//! kernels that store bf16 a second time, for AVX512_BF16). The workspace's
//! `tests/vocab_cpu.rs`, which calls every operation in every storage type, took 163–181 s to
//! compile (with grpo-cpu and the tests' library) at `opt-level = 1` on two Zen 4 cores, 283 s
//! when every SIMD backend compiled each kernel twice, with and without prefetches.
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
