//! One file per instruction set; [`run`] picks the one a [`Backend`] names.
//!
//! Every `unsafe` block of the crate lives in these files. Each ISA module exposes
//! `run(kernel) -> Result<Output, Kernel>`, which checks the CPU's features itself before
//! entering code compiled for them, so a `Backend` value can never cause an illegal
//! instruction.
//!
//! Each ISA defines its entry functions (the `#[target_feature]` functions that instantiate a
//! kernel's `#[inline(always)]` body for its lanes) in a module of their own (`entries`, the
//! functions `pub(super)`) and marks them `#[inline(never)]`; the portable backend's entry is
//! [`portable::entry`]. rustc places every instantiation of a generic function in the codegen
//! unit of the module that defines it, so each backend's kernels form a codegen unit of their
//! own, which a build optimises on a core of its own. On AArch64, where `neon` is a baseline
//! feature, entries without `#[inline(never)]` were inlined into their callers, into functions
//! of every kernel at once: this crate's test build for AArch64 (CI's NEON step) spent 486 s on
//! its test unit (Zen 4, `cargo test --no-run --timings`), 376 s with the entries out of line,
//! and 248 s with each software-prefetch setting (then a second instantiation of every kernel)
//! in a unit of its own as well.
//!
//! Software prefetching is a run-time setting ([`run`] sets it for the thread, see
//! `kernels::set_software_prefetch`), not a second instantiation of every kernel. The
//! submodule matters to speed as well: with AVX-512's entries as private functions of
//! `avx512` itself (the same code otherwise), `grpo-bench vocab --kernel jsd_backward_in_place`
//! (f32, 2048 × 32768, two threads, Zen 4) took 78–91 ms in six alternated rounds, against
//! 59–78 ms from `entries` and 62–77 ms from the earlier per-prefetch-setting modules.

use crate::backend::Backend;
use crate::kernels::Kernel;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon;
pub(crate) mod portable;

/// How a kernel runs: the instruction set and whether the kernels issue software prefetches
/// (the bits are the same either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) backend: Backend,
    pub(crate) prefetch: bool,
}

/// A backend with its default prefetching ([`Backend::software_prefetch_default`]).
impl From<Backend> for Target {
    fn from(backend: Backend) -> Target {
        Target {
            backend,
            prefetch: backend.software_prefetch_default(),
        }
    }
}

/// Every backend of this CPU, each with and without software prefetches (for tests: both
/// settings must give the same bits).
#[cfg(test)]
pub(crate) fn targets() -> impl Iterator<Item = Target> {
    Backend::available()
        .flat_map(|backend| [true, false].map(|prefetch| Target { backend, prefetch }))
}

/// Runs `k` on `target`, falling back to the portable path if this CPU cannot run its backend
/// (constructors of the public types only hand out available backends, so the fallback is a
/// defence, not a behaviour callers see).
#[inline]
pub(crate) fn run<K: Kernel>(target: impl Into<Target>, k: K) -> K::Output {
    let Target { backend, prefetch } = target.into();
    crate::kernels::set_software_prefetch(prefetch);
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
    portable::entry(k)
}

#[cfg(test)]
mod tests {
    //! Every backend against the portable oracle, operation by operation, on edge values
    //! (BLAKE3's test-driver pattern). The vocabulary kernels' bit-identity follows from this
    //! plus identical operation sequences.

    use super::run;
    use crate::backend::Backend;
    use crate::kernels::Kernel;
    use crate::lanes::F32x16;

    /// Applies every lane operation to `(a, b, c)` and returns the results' bit patterns.
    struct Probe<'a>(&'a [[f32; 16]], &'a [[f32; 16]], &'a [[f32; 16]]);

    impl Kernel for Probe<'_> {
        type Output = Vec<u32>;
        #[inline(always)]
        fn run<V: F32x16>(self) -> Vec<u32> {
            let mut out = Vec::new();
            // NaN payloads of arithmetic are unspecified (LLVM may commute operands); "both NaN"
            // is the contract there. Bit operations, selects, max/min keep exact bits.
            let mut out_f = Vec::new();
            let mut push_f = |v: V| {
                out_f.extend(
                    v.to_array()
                        .map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() }),
                )
            };
            for ((a, b), c) in self.0.iter().zip(self.1).zip(self.2) {
                let (a, b, c) = (V::load(a), V::load(b), V::load(c));
                push_f(a.add(b));
                push_f(a.sub(b));
                push_f(a.mul(b));
                push_f(a.div(b));
                push_f(a.mul_add(b, c));
                let mut push = |v: V| out.extend(v.to_array().map(f32::to_bits));
                push(a.max(b));
                push(a.min(b));
                push(a.and(b));
                push(a.or(b));
                push(a.xor(b));
                push(a.andnot(b));
                push(a.add_i32(b));
                push(a.sub_i32(b));
                push(a.max_i32(b));
                push(a.shl::<7>());
                push(a.shr_logical::<9>());
                push(a.shr_arith::<23>());
                push(a.i32_to_f32());
                push(a.f32_to_i32_round());
                push(a.f32_to_i32_trunc());
                let one = V::splat(1.0);
                let zero = V::splat(0.0);
                push(V::select(a.gt(b), one, zero));
                push(V::select(a.ge(b), one, zero));
                push(V::select(a.lt(b), one, zero));
                push(V::select(a.le(b), one, zero));
                push(V::select(a.eq(b), one, zero));
                push(V::select(a.not_lt(b), one, zero));
                push(V::select(V::mask_andnot(a.gt(b), b.gt(c)), a, c));
                push(V::select(V::mask_none(), a, c));
                let mut st = [0.0; 16];
                a.store_stream(&mut st);
                push(V::load(&st));
                push(V::select(a.ne(b), one, zero));
                push(V::select(a.eq_i32(b), one, zero));
                push(V::select(V::mask_and(a.gt(b), b.gt(c)), a, c));
                push(V::select(V::mask_or(a.gt(b), b.gt(c)), a, c));
                push(V::splat(if V::mask_any(a.gt(b)) { 1.0 } else { 0.0 }));
                push(V::from_array(a.to_array()));
                push(V::count_lanes(a, a.gt(b)));
                push(V::count_lanes(c, V::mask_andnot(a.gt(b), b.gt(c))));
                push(V::count_lanes(b, V::mask_none()));
            }
            out.extend(out_f);
            out
        }
    }

    struct Widen<'a>(&'a [[half::bf16; 16]], &'a [[half::f16; 16]]);

    impl Kernel for Widen<'_> {
        type Output = Vec<u32>;
        #[inline(always)]
        fn run<V: F32x16>(self) -> Vec<u32> {
            let mut out = Vec::new();
            for (b, h) in self.0.iter().zip(self.1) {
                out.extend(V::load_bf16(b).to_array().map(f32::to_bits));
                // NaN payloads may differ between conversions; the contract is "both NaN".
                out.extend(
                    V::load_f16(h).to_array().map(
                        |x| {
                            if x.is_nan() { u32::MAX } else { x.to_bits() }
                        },
                    ),
                );
            }
            out
        }
    }

    /// Deterministic xorshift bit patterns mixed with edge values.
    fn inputs(seed: u64, n: usize) -> Vec<[f32; 16]> {
        let edges = [
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            0.5,
            1.5,
            2.5,
            -2.5,
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            1e-45,
            f32::MAX,
            2147483648.0,
            -2147483648.0,
            2147483520.0,
            -2147483904.0,
            8388608.5,
            1e30,
            -88.0,
            88.0,
        ];
        let mut s = seed;
        (0..n)
            .map(|_| {
                core::array::from_fn(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    match s % 4 {
                        0 => edges[(s >> 8) as usize % edges.len()],
                        1 => f32::from_bits((s >> 16) as u32),
                        _ => ((s >> 11) as f64 / (1u64 << 53) as f64 * 200.0 - 100.0) as f32,
                    }
                })
            })
            .collect()
    }

    /// Returns the software-prefetch setting the kernel body sees.
    struct PrefetchSetting;

    impl Kernel for PrefetchSetting {
        type Output = bool;
        #[inline(always)]
        fn run<V: F32x16>(self) -> bool {
            crate::kernels::software_prefetch()
        }
    }

    /// Every kernel body sees the prefetch setting of the target it runs on, on the pool's
    /// threads, with the settings alternating (a value left from the last run would show). The
    /// results are the same bits either way, so no other test would see a path that skips it.
    #[test]
    fn kernels_see_their_targets_prefetch_setting() {
        use rayon::prelude::*;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for _ in 0..2 {
            for target in super::targets() {
                let seen: Vec<bool> = pool.install(|| {
                    (0..8)
                        .into_par_iter()
                        .map(|_| run(target, PrefetchSetting))
                        .collect()
                });
                assert!(
                    seen.iter().all(|&s| s == target.prefetch),
                    "{target:?}: {seen:?}"
                );
            }
        }
    }

    #[test]
    fn every_backend_matches_portable_op_by_op() {
        let (a, b, c) = (inputs(1, 4000), inputs(2, 4000), inputs(3, 4000));
        let want = run(Backend::Portable, Probe(&a, &b, &c));
        let bits: Vec<u16> = (0..=u16::MAX).collect();
        let bf: Vec<[half::bf16; 16]> = bits
            .chunks_exact(16)
            .map(|c| core::array::from_fn(|i| half::bf16::from_bits(c[i])))
            .collect();
        let hf: Vec<[half::f16; 16]> = bits
            .chunks_exact(16)
            .map(|c| core::array::from_fn(|i| half::f16::from_bits(c[i])))
            .collect();
        let want_widen = run(Backend::Portable, Widen(&bf, &hf));
        let mut tested = 0;
        for backend in Backend::available() {
            let got = run(backend, Probe(&a, &b, &c));
            let first = got.iter().zip(&want).position(|(g, w)| g != w);
            assert_eq!(first, None, "{backend:?}: first differing word {first:?}");
            assert_eq!(got.len(), want.len());
            assert_eq!(
                run(backend, Widen(&bf, &hf)),
                want_widen,
                "{backend:?} widening"
            );
            tested += 1;
        }
        assert!(tested >= 1);
    }

    struct Reduce<'a>(&'a [[f32; 16]]);

    impl Kernel for Reduce<'_> {
        type Output = Vec<(f32, f32)>;
        #[inline(always)]
        fn run<V: F32x16>(self) -> Vec<(f32, f32)> {
            self.0
                .iter()
                .map(|c| (V::load(c).reduce_max(), V::load(c).reduce_min()))
                .collect()
        }
    }

    /// `reduce_max`/`reduce_min` give the exact extreme lane on every backend for chunks
    /// without NaN (the sign of a zero aside: compared after `+ 0.0`).
    #[test]
    fn lane_reductions_are_exact_without_nan() {
        let mut chunks = inputs(4, 4000);
        chunks.retain(|c| c.iter().all(|x| !x.is_nan()));
        chunks.push([-0.0; 16]);
        chunks.push(core::array::from_fn(|i| if i == 15 { 0.0 } else { -0.0 }));
        assert!(chunks.len() > 2000);
        for backend in Backend::available() {
            let got = run(backend, Reduce(&chunks));
            for (c, (mx, mn)) in chunks.iter().zip(got) {
                let want_max = c.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let want_min = c.iter().copied().fold(f32::INFINITY, f32::min);
                assert_eq!(
                    (mx + 0.0).to_bits(),
                    (want_max + 0.0).to_bits(),
                    "{backend:?} {c:?}"
                );
                assert_eq!(
                    (mn + 0.0).to_bits(),
                    (want_min + 0.0).to_bits(),
                    "{backend:?} {c:?}"
                );
            }
        }
    }

    #[test]
    fn widening_is_exact() {
        for bits in 0..=u16::MAX {
            let b = half::bf16::from_bits(bits);
            let h = half::f16::from_bits(bits);
            let lanes_b = [b; 16];
            let lanes_h = [h; 16];
            let got = run(Backend::detect(), Widen(&[lanes_b], &[lanes_h]));
            assert_eq!(got[0], u32::from(bits) << 16);
            let want = h.to_f32();
            if want.is_nan() {
                assert_eq!(got[16], u32::MAX);
            } else {
                assert_eq!(got[16], want.to_bits(), "f16 bits {bits:#x}");
            }
        }
    }
}
