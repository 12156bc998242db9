//! AVX2 + FMA backend: the 16 lanes are two `__m256` (lanes 0–7 and 8–15).
//!
//! `vmaxps`/`vminps` implement the project's NaN rule exactly (`a > b ? a : b`; for a NaN or
//! equal operands the second operand is returned). f16 widening uses F16C, which every
//! AVX2+FMA CPU has; detection checks it anyway.
//!
//! [`F32x16::store_stream`] is a cached store here, not `vmovntps`. The out-of-place vocabulary
//! backward, whose gradient (as large as the logits) is never read back, measured on the AVX2
//! host we have (AMD EPYC, Zen 3, family 25 model 1, 2 vCPUs under KVM):
//! - `grpo-bench vocab --kernel backward` (f32, two threads, 2048 × 32768 / 512 × 151936,
//!   four alternated runs of each binary): 53.3–59.9 / 59.2–86.9 ms with `vmovntps` against
//!   38.8–60.0 / 39.2–52.8 ms with cached stores: a higher ratio to the read + write
//!   roofline in all eight pairs (0.31–0.39 against 0.36–0.54), fewer milliseconds in seven;
//! - one row of 65536 in L2, one thread, fastest of 500–3000 calls: the same kernel code with
//!   `vmovntps` took 157–177 µs in one build of a throwaway harness and 55–75 µs in another
//!   (deterministic per build; `perf` put three quarters of the slow build's samples on one
//!   instruction after a run of register spills, a stall we did not explain), and with cached
//!   stores 53–77 µs in both. Streaming stores in a plain loop were not slow on this host (a
//!   stand-alone C loop wrote 21–34 GB/s with `vmovntps` against 13–16 GB/s with `vmovups`).
//!
//! The cached store has no such dependence, and the read for ownership it adds cost less than
//! the stall. `grpo-bench loss`, whose outputs go through `store_stream` too, measured within
//! the noise either way (ratios 0.36–0.52 with `vmovntps` against 0.39–0.53 over seven
//! alternated runs).

use core::arch::x86_64::*;

use crate::kernels::Kernel;
use crate::lanes::F32x16;

/// 16 lanes in two 256-bit registers. Created only inside [`run`] after detection.
#[derive(Clone, Copy)]
pub(crate) struct Avx2(__m256, __m256);

/// The entry function, in a module of its own so that its instantiations form a codegen unit
/// of their own (see [`super`]).
mod entries {
    use super::{Avx2, Kernel};

    /// Runs `k` compiled for AVX2 + FMA + F16C: this backend's entry function, out of line.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline(never)]
    pub(super) unsafe fn entry<K: Kernel>(k: K) -> K::Output {
        // No fence: this backend has no streaming stores (see the module documentation).
        k.run::<Avx2>()
    }
}
use entries::entry;

/// Whether the CPU has what the entry functions are compiled for: AVX2, FMA and F16C (the f16
/// loads and stores; every CPU with AVX2 and FMA has it).
pub(crate) fn detected() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// Runs `k` on this backend, or returns it if the CPU lacks AVX2, FMA or F16C.
pub(crate) fn run<K: Kernel>(k: K) -> Result<K::Output, K> {
    if detected() {
        // SAFETY: the features `entry` is compiled for were detected on this CPU just above.
        Ok(unsafe { entry(k) })
    } else {
        Err(k)
    }
}

macro_rules! both {
    ($f:ident, $a:expr, $b:expr) => {
        // SAFETY: an `Avx2` value exists only inside `entry`, which runs only after `run`
        // detected AVX2, FMA and F16C, so the intrinsic's target features are present.
        unsafe { Avx2($f($a.0, $b.0), $f($a.1, $b.1)) }
    };
}

macro_rules! both_i {
    ($f:ident, $a:expr, $b:expr) => {
        // SAFETY: as in `both!`; the casts are reinterpretations.
        unsafe {
            Avx2(
                _mm256_castsi256_ps($f(_mm256_castps_si256($a.0), _mm256_castps_si256($b.0))),
                _mm256_castsi256_ps($f(_mm256_castps_si256($a.1), _mm256_castps_si256($b.1))),
            )
        }
    };
}

macro_rules! one_i {
    ($f:expr, $a:expr) => {
        // SAFETY: as in `both!`; the casts are reinterpretations.
        unsafe {
            Avx2(
                _mm256_castsi256_ps($f(_mm256_castps_si256($a.0))),
                _mm256_castsi256_ps($f(_mm256_castps_si256($a.1))),
            )
        }
    };
}

macro_rules! cmp {
    ($imm:ident, $a:expr, $b:expr) => {
        // SAFETY: as in `both!`.
        unsafe {
            (
                _mm256_cmp_ps::<$imm>($a.0, $b.0),
                _mm256_cmp_ps::<$imm>($a.1, $b.1),
            )
        }
    };
}

impl F32x16 for Avx2 {
    /// All-ones lanes where set.
    type Mask = (__m256, __m256);
    /// 16 ymm registers, two per value.
    const REGISTERS: usize = 8;
    const SPECIALIZED_LOOPS: bool = true;

    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: as in `both!`.
        unsafe { Avx2(_mm256_set1_ps(x), _mm256_set1_ps(x)) }
    }
    #[inline(always)]
    fn from_array(a: [f32; 16]) -> Self {
        Self::load(&a)
    }
    #[inline(always)]
    fn to_array(self) -> [f32; 16] {
        let mut a = [0.0; 16];
        self.store(&mut a);
        a
    }
    #[inline(always)]
    fn load(src: &[f32; 16]) -> Self {
        let p = src.as_ptr();
        // SAFETY: as in `both!`; the reference covers 64 readable bytes, p + 8 stays inside.
        unsafe { Avx2(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
    }
    #[inline(always)]
    fn load_bf16(src: &[half::bf16; 16]) -> Self {
        // SAFETY: as in `both!`; 32 readable bytes behind the reference. Zero-extend each u16
        // to 32 bits and shift left by 16: the exact bf16 → f32 widening.
        unsafe {
            let h = _mm256_loadu_si256(src.as_ptr().cast());
            let lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(h));
            let hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256::<1>(h));
            Avx2(
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(lo)),
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(hi)),
            )
        }
    }
    #[inline(always)]
    fn load_f16(src: &[half::f16; 16]) -> Self {
        let p = src.as_ptr().cast::<__m128i>();
        // SAFETY: as in `both!`; 32 readable bytes, p + 1 (16 bytes) stays inside. `vcvtph2ps`
        // is exact for every f16.
        unsafe {
            Avx2(
                _mm256_cvtph_ps(_mm_loadu_si128(p)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
            )
        }
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32; 16]) {
        let p = dst.as_mut_ptr();
        // SAFETY: as in `both!`; 64 writable bytes behind the exclusive reference.
        unsafe {
            _mm256_storeu_ps(p, self.0);
            _mm256_storeu_ps(p.add(8), self.1);
        }
    }
    #[inline(always)]
    fn store_bf16_bits(self, dst: &mut [half::bf16; 16]) {
        // SAFETY: as in `both!`; 32 writable bytes (`half::bf16` is a `repr(transparent)` u16).
        // Every lane is at most 0xFFFF (the method's contract), so the unsigned saturating
        // pack is a truncation; it interleaves 128-bit halves ([a0–3, b0–3, a4–7, b4–7]),
        // which the 64-bit permute puts back in lane order.
        unsafe {
            let packed =
                _mm256_packus_epi32(_mm256_castps_si256(self.0), _mm256_castps_si256(self.1));
            let h = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
            _mm256_storeu_si256(dst.as_mut_ptr().cast(), h)
        }
    }
    #[inline(always)]
    fn store_f16(self, dst: &mut [half::f16; 16]) {
        let p = dst.as_mut_ptr().cast::<__m128i>();
        // SAFETY: as in `both!` (F16C is detected); 32 writable bytes, p + 1 (16 bytes) stays
        // inside. `vcvtps2ph` with an explicit round-to-nearest-even immediate rounds as IEEE
        // (and `half`) does, whatever MXCSR's rounding mode.
        unsafe {
            _mm_storeu_si128(p, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.0));
            _mm_storeu_si128(
                p.add(1),
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.1),
            );
        }
    }
    /// A cached store (`vmovups`), not `vmovntps`: see the module documentation.
    #[inline(always)]
    fn store_stream(self, dst: &mut [f32; 16]) {
        self.store(dst);
    }
    #[inline(always)]
    fn prefetch(p: *const u8) {
        // SAFETY: a prefetch never dereferences architecturally and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
    }
    #[inline(always)]
    fn prefetch_l2(p: *const u8) {
        // SAFETY: as `prefetch`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
    }

    #[inline(always)]
    fn add(self, b: Self) -> Self {
        both!(_mm256_add_ps, self, b)
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        both!(_mm256_sub_ps, self, b)
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        both!(_mm256_mul_ps, self, b)
    }
    #[inline(always)]
    fn div(self, b: Self) -> Self {
        both!(_mm256_div_ps, self, b)
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        // SAFETY: as in `both!`.
        unsafe {
            Avx2(
                _mm256_fmadd_ps(self.0, b.0, c.0),
                _mm256_fmadd_ps(self.1, b.1, c.1),
            )
        }
    }
    #[inline(always)]
    fn max(self, b: Self) -> Self {
        both!(_mm256_max_ps, self, b)
    }
    #[inline(always)]
    fn min(self, b: Self) -> Self {
        both!(_mm256_min_ps, self, b)
    }

    #[inline(always)]
    fn and(self, b: Self) -> Self {
        both!(_mm256_and_ps, self, b)
    }
    #[inline(always)]
    fn or(self, b: Self) -> Self {
        both!(_mm256_or_ps, self, b)
    }
    #[inline(always)]
    fn xor(self, b: Self) -> Self {
        both!(_mm256_xor_ps, self, b)
    }
    #[inline(always)]
    fn andnot(self, b: Self) -> Self {
        both!(_mm256_andnot_ps, self, b)
    }
    #[inline(always)]
    fn add_i32(self, b: Self) -> Self {
        both_i!(_mm256_add_epi32, self, b)
    }
    #[inline(always)]
    fn sub_i32(self, b: Self) -> Self {
        both_i!(_mm256_sub_epi32, self, b)
    }
    #[inline(always)]
    fn lookup8(self, table: &[f32; 8]) -> Self {
        // SAFETY: as in `both!`; the reference covers the 32 bytes loaded. `vpermps` on ymm
        // reads the low three bits of each index lane, exactly the contract's `b & 7`.
        unsafe {
            let tab = _mm256_loadu_ps(table.as_ptr());
            Avx2(
                _mm256_permutevar8x32_ps(tab, _mm256_castps_si256(self.0)),
                _mm256_permutevar8x32_ps(tab, _mm256_castps_si256(self.1)),
            )
        }
    }
    #[inline(always)]
    fn max_i32(self, b: Self) -> Self {
        both_i!(_mm256_max_epi32, self, b)
    }
    #[inline(always)]
    fn shl<const N: u32>(self) -> Self {
        one_i!(slli::<N>, self)
    }
    #[inline(always)]
    fn shr_logical<const N: u32>(self) -> Self {
        one_i!(srli::<N>, self)
    }
    #[inline(always)]
    fn shr_arith<const N: u32>(self) -> Self {
        one_i!(srai::<N>, self)
    }
    #[inline(always)]
    fn i32_to_f32(self) -> Self {
        // SAFETY: as in `both!`. MXCSR rounding is Rust's default (nearest-even).
        unsafe {
            Avx2(
                _mm256_cvtepi32_ps(_mm256_castps_si256(self.0)),
                _mm256_cvtepi32_ps(_mm256_castps_si256(self.1)),
            )
        }
    }
    #[inline(always)]
    fn f32_to_i32_round(self) -> Self {
        // SAFETY: as in `both!`. MXCSR rounding is Rust's default (nearest-even).
        unsafe {
            Avx2(
                _mm256_castsi256_ps(_mm256_cvtps_epi32(self.0)),
                _mm256_castsi256_ps(_mm256_cvtps_epi32(self.1)),
            )
        }
    }
    #[inline(always)]
    fn f32_to_i32_trunc(self) -> Self {
        // SAFETY: as in `both!`.
        unsafe {
            Avx2(
                _mm256_castsi256_ps(_mm256_cvttps_epi32(self.0)),
                _mm256_castsi256_ps(_mm256_cvttps_epi32(self.1)),
            )
        }
    }

    #[inline(always)]
    fn gt(self, b: Self) -> Self::Mask {
        cmp!(_CMP_GT_OQ, self, b)
    }
    #[inline(always)]
    fn ge(self, b: Self) -> Self::Mask {
        cmp!(_CMP_GE_OQ, self, b)
    }
    #[inline(always)]
    fn lt(self, b: Self) -> Self::Mask {
        cmp!(_CMP_LT_OQ, self, b)
    }
    #[inline(always)]
    fn le(self, b: Self) -> Self::Mask {
        cmp!(_CMP_LE_OQ, self, b)
    }
    #[inline(always)]
    fn not_lt(self, b: Self) -> Self::Mask {
        // Unordered: true when either lane is NaN.
        cmp!(_CMP_NLT_UQ, self, b)
    }
    #[inline(always)]
    fn eq(self, b: Self) -> Self::Mask {
        cmp!(_CMP_EQ_OQ, self, b)
    }
    #[inline(always)]
    fn ne(self, b: Self) -> Self::Mask {
        // Unordered: true when either lane is NaN, like Rust's `!=`.
        cmp!(_CMP_NEQ_UQ, self, b)
    }
    #[inline(always)]
    fn eq_i32(self, b: Self) -> Self::Mask {
        let m: Self = both_i!(_mm256_cmpeq_epi32, self, b);
        (m.0, m.1)
    }
    #[inline(always)]
    fn select(m: Self::Mask, a: Self, b: Self) -> Self {
        // SAFETY: as in `both!`. blendv takes the second operand where the mask's sign bit is set.
        unsafe {
            Avx2(
                _mm256_blendv_ps(b.0, a.0, m.0),
                _mm256_blendv_ps(b.1, a.1, m.1),
            )
        }
    }
    #[inline(always)]
    fn mask_and(a: Self::Mask, b: Self::Mask) -> Self::Mask {
        // SAFETY: as in `both!`.
        unsafe { (_mm256_and_ps(a.0, b.0), _mm256_and_ps(a.1, b.1)) }
    }
    #[inline(always)]
    fn mask_or(a: Self::Mask, b: Self::Mask) -> Self::Mask {
        // SAFETY: as in `both!`.
        unsafe { (_mm256_or_ps(a.0, b.0), _mm256_or_ps(a.1, b.1)) }
    }
    #[inline(always)]
    fn mask_andnot(a: Self::Mask, b: Self::Mask) -> Self::Mask {
        // SAFETY: as in `both!`.
        unsafe { (_mm256_andnot_ps(a.0, b.0), _mm256_andnot_ps(a.1, b.1)) }
    }
    #[inline(always)]
    fn mask_none() -> Self::Mask {
        // SAFETY: as in `both!`.
        unsafe { (_mm256_setzero_ps(), _mm256_setzero_ps()) }
    }
    #[inline(always)]
    fn count_lanes(acc: Self, m: Self::Mask) -> Self {
        // A set lane of the mask is all ones: −1 as an integer.
        acc.sub_i32(Avx2(m.0, m.1))
    }
    #[inline(always)]
    fn mask_any(m: Self::Mask) -> bool {
        // SAFETY: as in `both!`.
        unsafe { _mm256_movemask_ps(_mm256_or_ps(m.0, m.1)) != 0 }
    }
}

/// Shifts by a count in a register: AVX2's immediate forms take `i32` const generics, which a
/// `u32` const parameter cannot be converted to on stable Rust; LLVM folds the constant count
/// back into the immediate form.
///
/// # Safety
/// The CPU must support AVX2.
#[inline(always)]
unsafe fn slli<const N: u32>(a: __m256i) -> __m256i {
    // SAFETY: the caller guarantees AVX2.
    unsafe { _mm256_sll_epi32(a, _mm_cvtsi32_si128(N as i32)) }
}

/// Logical right shift; see [`slli`].
///
/// # Safety
/// The CPU must support AVX2.
#[inline(always)]
unsafe fn srli<const N: u32>(a: __m256i) -> __m256i {
    // SAFETY: the caller guarantees AVX2.
    unsafe { _mm256_srl_epi32(a, _mm_cvtsi32_si128(N as i32)) }
}

/// Arithmetic right shift; see [`slli`].
///
/// # Safety
/// The CPU must support AVX2.
#[inline(always)]
unsafe fn srai<const N: u32>(a: __m256i) -> __m256i {
    // SAFETY: the caller guarantees AVX2.
    unsafe { _mm256_sra_epi32(a, _mm_cvtsi32_si128(N as i32)) }
}
