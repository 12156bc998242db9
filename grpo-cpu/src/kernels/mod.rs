//! Kernels written once over [`F32x16`] and instantiated per ISA.
//!
//! A kernel is a value implementing [`Kernel`]: its arguments are fields, and `run::<V>` is the
//! body for the lane type `V`. `arch::run` calls it from an entry function compiled with the
//! ISA's `#[target_feature]`; because `run` and everything it calls are `#[inline(always)]`, the
//! whole body is compiled for that ISA (memchr's and pulp's pattern).

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
    /// Whether the kernel issues software prefetches ([`F32x16::prefetch`]). Each SIMD
    /// backend compiles such a kernel twice, with and without them (`arch::Target::prefetch`);
    /// a kernel that issues none says `false` and is compiled once. One that prefetches but
    /// says `false` computes the same bits, with the requests always on.
    const PREFETCHES: bool = true;
    /// The kernel body for lane type `V`. Implementations must be `#[inline(always)]`.
    fn run<V: F32x16>(self) -> Self::Output;
}
