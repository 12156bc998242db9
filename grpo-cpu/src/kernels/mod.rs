//! Kernels written once over [`F32x16`] and instantiated per ISA.
//!
//! A kernel is a value implementing [`Kernel`]: its arguments are fields, and `run::<V>` is the
//! body for the lane type `V`. `arch::run` calls it from an entry function compiled with the
//! ISA's `#[target_feature]`; because `run` and everything it calls are `#[inline(always)]`, the
//! whole body is compiled for that ISA (memchr's and pulp's pattern).

use core::cell::Cell;

use crate::lanes::F32x16;

pub(crate) mod loss;
pub(crate) mod math;
pub(crate) mod roofline;
pub(crate) mod vocab;

/// A computation generic over the lane type.
pub(crate) trait Kernel {
    /// What the kernel returns.
    type Output;
    /// Whether the kernel stores lanes rounded to bf16 ([`F32x16::store_bf16`]). An ISA with
    /// an instruction for that rounding runs such a kernel from an entry function compiled for
    /// it (AVX-512 with AVX512_BF16), so only these kernels are instantiated twice there. A
    /// kernel that stores bf16 without saying so gets the same bits, from the integer rounding.
    #[cfg_attr(
        not(target_arch = "x86_64"),
        allow(dead_code, reason = "only the AVX-512 backend has such an entry")
    )]
    const STORES_BF16: bool = false;
    /// The kernel body for lane type `V`. Implementations must be `#[inline(always)]`.
    fn run<V: F32x16>(self) -> Self::Output;
}

thread_local! {
    /// Whether the kernels this thread runs issue their software prefetches
    /// ([`F32x16::prefetch`]): set by [`arch::run`](crate::arch::run) before every entry.
    static SOFTWARE_PREFETCH: Cell<bool> = const { Cell::new(true) };
}

/// Makes the kernels this thread runs next issue their software prefetches (`on`) or not.
///
/// A run-time setting rather than a lane-type parameter, so that each backend's kernels are
/// compiled once: with a `const PREFETCH: bool` on the lanes, every SIMD backend compiled every
/// kernel twice, and the workspace's `tests/vocab_cpu.rs` took 283 s to build (with grpo-cpu
/// and the tests' library, two Zen 4 cores, `opt-level = 1`) against 163–181 s with one
/// instantiation (2026-12-07). The kernels read the setting once per call of a step loop
/// ([`software_prefetch`]) and branch on it per cache line; the bits are the same either way.
pub(crate) fn set_software_prefetch(on: bool) {
    SOFTWARE_PREFETCH.set(on);
}

/// The setting of [`set_software_prefetch`] on this thread.
#[inline(always)]
pub(crate) fn software_prefetch() -> bool {
    SOFTWARE_PREFETCH.get()
}
