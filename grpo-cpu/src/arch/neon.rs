//! AArch64 NEON backend: the 16 lanes are four `float32x4_t` (lanes 0–3, 4–7, 8–11, 12–15).
//!
//! NEON's `fmax` propagates NaN, unlike the project's rule, so `max`/`min` are a compare and a
//! bit select. Its conversions saturate instead of giving x86's `i32::MIN`, so out-of-range lanes
//! are patched to keep every backend identical. f16 is widened with integer operations because
//! Rust's `float16x4_t` is not stable.

use core::arch::aarch64::*;

use crate::kernels::Kernel;
use crate::lanes::F32x16;

/// 16 lanes in four 128-bit registers. Created only inside [`run`] after detection.
#[derive(Clone, Copy)]
pub(crate) struct Neon([float32x4_t; 4]);

/// The entry function, in a module of its own so that its instantiations form a codegen unit
/// of their own (see [`super`]).
mod entries {
    use super::{Kernel, Neon};

    /// Runs `k` compiled for NEON: this backend's entry function, out of line.
    ///
    /// # Safety
    /// The CPU must support NEON.
    #[target_feature(enable = "neon")]
    #[inline(never)]
    pub(super) unsafe fn entry<K: Kernel>(k: K) -> K::Output {
        k.run::<Neon>()
    }
}
use entries::entry;

/// Runs `k` on this backend, or returns it if the CPU lacks NEON.
pub(crate) fn run<K: Kernel>(k: K) -> Result<K::Output, K> {
    if std::arch::is_aarch64_feature_detected!("neon") {
        // SAFETY: the feature `entry` is compiled for was detected on this CPU just above.
        Ok(unsafe { entry(k) })
    } else {
        Err(k)
    }
}

/// `[e(0), e(1), e(2), e(3)]` written out as blocks, not a closure: a closure is a separate
/// function, and if LLVM declines to inline it, its intrinsics are compiled without NEON.
macro_rules! arr4 {
    (|$i:ident| $e:expr) => {
        [
            {
                let $i = 0;
                $e
            },
            {
                let $i = 1;
                $e
            },
            {
                let $i = 2;
                $e
            },
            {
                let $i = 3;
                $e
            },
        ]
    };
}

/// Applies a NEON intrinsic to each of the four registers.
macro_rules! each {
    ([$($x:expr),*] |$($v:ident),*| $e:expr) => {
        // SAFETY: a `Neon` value exists only inside `entry`, which runs only after `run` detected
        // NEON, so the intrinsics' target feature is present.
        unsafe { Neon(arr4!(|i| { $(let $v = $x.0[i];)* $e })) }
    };
}

macro_rules! each_u {
    ([$($x:expr),*] |$($v:ident),*| $e:expr) => {
        // SAFETY: as in `each!`; the reinterpretations are free.
        unsafe {
            Neon(arr4!(|i| {
                $(let $v = vreinterpretq_u32_f32($x.0[i]);)*
                vreinterpretq_f32_u32($e)
            }))
        }
    };
}

impl F32x16 for Neon {
    /// All-ones lanes where set.
    type Mask = [uint32x4_t; 4];
    /// 32 q registers, four per value.
    const REGISTERS: usize = 8;
    const SPECIALIZED_LOOPS: bool = true;

    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: as in `each!`.
        unsafe { Neon([vdupq_n_f32(x); 4]) }
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
        // SAFETY: as in `each!`; the reference covers 16 readable f32, p + 4i + 3 < p + 16.
        unsafe { Neon(arr4!(|i| vld1q_f32(p.add(4 * i)))) }
    }
    #[inline(always)]
    fn load_bf16(src: &[half::bf16; 16]) -> Self {
        let p = src.as_ptr().cast::<u16>();
        // SAFETY: as in `each!`; 16 readable u16 behind the reference. `vshll_n_u16::<16>`
        // zero-extends and shifts by 16: the exact bf16 → f32 widening.
        unsafe {
            let lo = vld1q_u16(p);
            let hi = vld1q_u16(p.add(8));
            Neon([
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(lo))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(lo))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(hi))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(hi))),
            ])
        }
    }
    #[inline(always)]
    fn load_f16(src: &[half::f16; 16]) -> Self {
        let p = src.as_ptr().cast::<u16>();
        // SAFETY: as in `each!`; 16 readable u16 behind the reference.
        unsafe {
            let lo = vld1q_u16(p);
            let hi = vld1q_u16(p.add(8));
            Neon([
                f16_to_f32(vmovl_u16(vget_low_u16(lo))),
                f16_to_f32(vmovl_u16(vget_high_u16(lo))),
                f16_to_f32(vmovl_u16(vget_low_u16(hi))),
                f16_to_f32(vmovl_u16(vget_high_u16(hi))),
            ])
        }
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32; 16]) {
        let p = dst.as_mut_ptr();
        // SAFETY: as in `each!`; 16 writable f32 behind the exclusive reference.
        unsafe {
            for i in 0..4 {
                vst1q_f32(p.add(4 * i), self.0[i]);
            }
        }
    }
    #[inline(always)]
    fn store_bf16_bits(self, dst: &mut [half::bf16; 16]) {
        let p = dst.as_mut_ptr().cast::<u16>();
        // SAFETY: as in `each!`; 16 writable u16 behind the exclusive reference (`half::bf16`
        // is a `repr(transparent)` u16). `vmovn_u32` keeps each lane's low 16 bits.
        unsafe {
            let n = arr4!(|i| vmovn_u32(vreinterpretq_u32_f32(self.0[i])));
            vst1q_u16(p, vcombine_u16(n[0], n[1]));
            vst1q_u16(p.add(8), vcombine_u16(n[2], n[3]));
        }
    }
    #[inline(always)]
    fn store_stream(self, dst: &mut [f32; 16]) {
        self.store(dst);
    }
    #[inline(always)]
    fn prefetch(p: *const u8) {
        // SAFETY: `prfm` is a hint: it never faults and has no architectural side effect.
        unsafe {
            core::arch::asm!("prfm pldl1keep, [{0}]", in(reg) p, options(nostack, readonly, preserves_flags));
        }
    }
    #[inline(always)]
    fn prefetch_l2(p: *const u8) {
        // SAFETY: as `prefetch`.
        unsafe {
            core::arch::asm!("prfm pldl2keep, [{0}]", in(reg) p, options(nostack, readonly, preserves_flags));
        }
    }

    #[inline(always)]
    fn add(self, b: Self) -> Self {
        each!([self, b] | a, b | vaddq_f32(a, b))
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        each!([self, b] | a, b | vsubq_f32(a, b))
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        each!([self, b] | a, b | vmulq_f32(a, b))
    }
    #[inline(always)]
    fn div(self, b: Self) -> Self {
        each!([self, b] | a, b | vdivq_f32(a, b))
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        // vfmaq_f32(c, a, b) = c + a·b with one rounding.
        each!([self, b, c] | a, b, c | vfmaq_f32(c, a, b))
    }
    #[inline(always)]
    fn max(self, b: Self) -> Self {
        each!([self, b] | a, b | vbslq_f32(vcgtq_f32(a, b), a, b))
    }
    #[inline(always)]
    fn min(self, b: Self) -> Self {
        each!([self, b] | a, b | vbslq_f32(vcltq_f32(a, b), a, b))
    }

    #[inline(always)]
    fn and(self, b: Self) -> Self {
        each_u!([self, b] | a, b | vandq_u32(a, b))
    }
    #[inline(always)]
    fn or(self, b: Self) -> Self {
        each_u!([self, b] | a, b | vorrq_u32(a, b))
    }
    #[inline(always)]
    fn xor(self, b: Self) -> Self {
        each_u!([self, b] | a, b | veorq_u32(a, b))
    }
    #[inline(always)]
    fn andnot(self, b: Self) -> Self {
        // vbicq(b, a) = b & !a.
        each_u!([self, b] | a, b | vbicq_u32(b, a))
    }
    #[inline(always)]
    fn add_i32(self, b: Self) -> Self {
        each_u!([self, b] | a, b | vaddq_u32(a, b))
    }
    #[inline(always)]
    fn sub_i32(self, b: Self) -> Self {
        each_u!([self, b] | a, b | vsubq_u32(a, b))
    }
    #[inline(always)]
    fn lookup8(self, table: &[f32; 8]) -> Self {
        // SAFETY: as in `each!`; the reference covers the 32 bytes loaded. Each lane's byte
        // indices are `4j, 4j + 1, 4j + 2, 4j + 3` (little-endian) for `j = b & 7`: `j` times
        // 0x04040404 puts `4j` (at most 28, no carry) in every byte, and 0x03020100 adds the
        // byte offsets. `vqtbl2q_u8` then copies those bytes of the 32-byte table.
        unsafe {
            let tab = vld1q_u8_x2(table.as_ptr().cast::<u8>());
            let (low3, spread, offsets) = (
                vdupq_n_u32(7),
                vdupq_n_u32(0x0404_0404),
                vdupq_n_u32(0x0302_0100),
            );
            Neon(arr4!(|i| {
                let j = vandq_u32(vreinterpretq_u32_f32(self.0[i]), low3);
                let idx = vmlaq_u32(offsets, j, spread);
                vreinterpretq_f32_u8(vqtbl2q_u8(tab, vreinterpretq_u8_u32(idx)))
            }))
        }
    }
    #[inline(always)]
    fn max_i32(self, b: Self) -> Self {
        each_u!(
            [self, b] | a,
            b | vreinterpretq_u32_s32(vmaxq_s32(
                vreinterpretq_s32_u32(a),
                vreinterpretq_s32_u32(b)
            ))
        )
    }
    #[inline(always)]
    fn shl<const N: u32>(self) -> Self {
        // Register-count shifts: the immediate forms take `i32` const generics, which a `u32`
        // const parameter cannot be converted to on stable Rust; LLVM folds the constant back.
        each_u!([self] | a | vshlq_u32(a, vdupq_n_s32(N as i32)))
    }
    #[inline(always)]
    fn shr_logical<const N: u32>(self) -> Self {
        each_u!([self] | a | vshlq_u32(a, vdupq_n_s32(-(N as i32))))
    }
    #[inline(always)]
    fn shr_arith<const N: u32>(self) -> Self {
        each_u!(
            [self]
                | a
                | vreinterpretq_u32_s32(vshlq_s32(
                    vreinterpretq_s32_u32(a),
                    vdupq_n_s32(-(N as i32))
                ))
        )
    }
    #[inline(always)]
    fn i32_to_f32(self) -> Self {
        each!([self] | a | vcvtq_f32_s32(vreinterpretq_s32_f32(a)))
    }
    #[inline(always)]
    fn f32_to_i32_round(self) -> Self {
        // SAFETY: as in `each!`.
        let r = unsafe { Neon(arr4!(|i| vreinterpretq_f32_s32(vcvtnq_s32_f32(self.0[i])))) };
        patch_out_of_range(self, r)
    }
    #[inline(always)]
    fn f32_to_i32_trunc(self) -> Self {
        // SAFETY: as in `each!`.
        let r = unsafe { Neon(arr4!(|i| vreinterpretq_f32_s32(vcvtq_s32_f32(self.0[i])))) };
        patch_out_of_range(self, r)
    }

    #[inline(always)]
    fn gt(self, b: Self) -> Self::Mask {
        // SAFETY: as in `each!`.
        unsafe { arr4!(|i| vcgtq_f32(self.0[i], b.0[i])) }
    }
    #[inline(always)]
    fn ge(self, b: Self) -> Self::Mask {
        // SAFETY: as in `each!`.
        unsafe { arr4!(|i| vcgeq_f32(self.0[i], b.0[i])) }
    }
    #[inline(always)]
    fn lt(self, b: Self) -> Self::Mask {
        // SAFETY: as in `each!`.
        unsafe { arr4!(|i| vcltq_f32(self.0[i], b.0[i])) }
    }
    #[inline(always)]
    fn le(self, b: Self) -> Self::Mask {
        // SAFETY: as in `each!`.
        unsafe { arr4!(|i| vcleq_f32(self.0[i], b.0[i])) }
    }
    #[inline(always)]
    fn not_lt(self, b: Self) -> Self::Mask {
        // SAFETY: as in `each!`. NOT(ordered less): true when either lane is NaN.
        unsafe { arr4!(|i| vmvnq_u32(vcltq_f32(self.0[i], b.0[i]))) }
    }
    #[inline(always)]
    fn eq(self, b: Self) -> Self::Mask {
        // SAFETY: as in `each!`.
        unsafe { arr4!(|i| vceqq_f32(self.0[i], b.0[i])) }
    }
    #[inline(always)]
    fn ne(self, b: Self) -> Self::Mask {
        // SAFETY: as in `each!`. NOT(ordered equal): true when either lane is NaN.
        unsafe { arr4!(|i| vmvnq_u32(vceqq_f32(self.0[i], b.0[i]))) }
    }
    #[inline(always)]
    fn eq_i32(self, b: Self) -> Self::Mask {
        // SAFETY: as in `each!`.
        unsafe {
            arr4!(|i| {
                vceqq_u32(
                    vreinterpretq_u32_f32(self.0[i]),
                    vreinterpretq_u32_f32(b.0[i]),
                )
            })
        }
    }
    #[inline(always)]
    fn select(m: Self::Mask, a: Self, b: Self) -> Self {
        // SAFETY: as in `each!`.
        unsafe { Neon(arr4!(|i| vbslq_f32(m[i], a.0[i], b.0[i]))) }
    }
    #[inline(always)]
    fn count_lanes(acc: Self, m: Self::Mask) -> Self {
        // A set lane of the mask is all ones: −1 as an integer.
        // SAFETY: as in `each!`.
        let minus_one = unsafe { Neon(arr4!(|i| vreinterpretq_f32_u32(m[i]))) };
        acc.sub_i32(minus_one)
    }
    #[inline(always)]
    fn mask_and(a: Self::Mask, b: Self::Mask) -> Self::Mask {
        // SAFETY: as in `each!`.
        unsafe { arr4!(|i| vandq_u32(a[i], b[i])) }
    }
    #[inline(always)]
    fn mask_or(a: Self::Mask, b: Self::Mask) -> Self::Mask {
        // SAFETY: as in `each!`.
        unsafe { arr4!(|i| vorrq_u32(a[i], b[i])) }
    }
    #[inline(always)]
    fn mask_andnot(a: Self::Mask, b: Self::Mask) -> Self::Mask {
        // SAFETY: as in `each!`. vbicq(b, a) = b & !a.
        unsafe { arr4!(|i| vbicq_u32(b[i], a[i])) }
    }
    #[inline(always)]
    fn mask_none() -> Self::Mask {
        // SAFETY: as in `each!`.
        unsafe { [vdupq_n_u32(0); 4] }
    }
    #[inline(always)]
    fn mask_any(m: Self::Mask) -> bool {
        // SAFETY: as in `each!`.
        unsafe { vmaxvq_u32(vorrq_u32(vorrq_u32(m[0], m[1]), vorrq_u32(m[2], m[3]))) != 0 }
    }
}

/// x86 conversion semantics: lanes whose input is NaN or outside [−2³¹, 2³¹) become `i32::MIN`.
#[inline(always)]
fn patch_out_of_range(x: Neon, r: Neon) -> Neon {
    let lo = Neon::splat(-2147483648.0);
    let hi = Neon::splat(2147483648.0);
    let ok = Neon::mask_and(x.ge(lo), x.lt(hi));
    Neon::select(ok, r, Neon::from_bits(i32::MIN as u32))
}

/// Exact f16 → f32 widening of the low 16 bits of each lane.
///
/// Finite values: the exponent and mantissa moved to f32's positions, times 2¹¹² (the bias
/// difference): exact for normals and subnormals. Inf/NaN: exponent forced to all ones, with
/// NaNs made quiet as `vcvtph2ps` and half's fallback do.
///
/// # Safety
/// The CPU must support NEON.
#[inline(always)]
unsafe fn f16_to_f32(h: uint32x4_t) -> float32x4_t {
    // SAFETY: the caller guarantees NEON.
    unsafe {
        let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
        let em = vandq_u32(h, vdupq_n_u32(0x7fff));
        let shifted = vshlq_n_u32::<13>(em);
        let finite = vmulq_f32(
            vreinterpretq_f32_u32(shifted),
            vdupq_n_f32(f32::from_bits(0x7780_0000)), // 2^112
        );
        let is_inf_nan = vcgeq_u32(em, vdupq_n_u32(0x7c00));
        let is_nan = vcgtq_u32(em, vdupq_n_u32(0x7c00));
        let special = vorrq_u32(
            vorrq_u32(shifted, vdupq_n_u32(0x7f80_0000)),
            vandq_u32(is_nan, vdupq_n_u32(0x0040_0000)),
        );
        let mag = vbslq_u32(is_inf_nan, special, vreinterpretq_u32_f32(finite));
        vreinterpretq_f32_u32(vorrq_u32(mag, sign))
    }
}
