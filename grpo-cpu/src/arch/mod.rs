//! One file per instruction set; [`run`] picks the one a [`Backend`] names.
//!
//! Every `unsafe` block of the crate lives in these files. Each ISA module exposes
//! `run(kernel) -> Result<Output, Kernel>`, which checks the CPU's features itself before
//! entering code compiled for them, so a `Backend` value can never cause an illegal instruction.

use crate::backend::Backend;
use crate::kernels::Kernel;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon;
pub(crate) mod portable;

/// Runs `k` on `backend`, falling back to the portable path if this CPU cannot run `backend`
/// (constructors of the public types only hand out available backends, so the fallback is a
/// defence, not a behaviour callers see).
#[inline]
pub(crate) fn run<K: Kernel>(backend: Backend, k: K) -> K::Output {
    let k = match backend {
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512 => match avx512::run(k) {
            Ok(out) => return out,
            Err(k) => k,
        },
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2Fma => match avx2::run(k) {
            Ok(out) => return out,
            Err(k) => k,
        },
        #[cfg(target_arch = "aarch64")]
        Backend::Neon => match neon::run(k) {
            Ok(out) => return out,
            Err(k) => k,
        },
        _ => k,
    };
    k.run::<portable::Portable>()
}
