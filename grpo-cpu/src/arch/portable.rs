//! The portable backend: 16 lanes in an array, every operation written out per lane.
//!
//! This is the oracle of the SIMD backends (BLAKE3's `portable.rs` role) and the path for CPUs
//! without FMA: fused multiply-add is `libm::fmaf`, correctly rounded in software, exactly what
//! grpo-core's scalar reference uses.

use crate::kernels::Kernel;
use crate::lanes::F32x16;

/// Runs `k` on the portable lanes: this backend's entry function, out of line and in this
/// module so that its instantiations form a codegen unit of their own (see [`super`]).
#[inline(never)]
pub(crate) fn entry<K: Kernel>(k: K) -> K::Output {
    k.run::<Portable>()
}

/// 16 `f32` lanes in an array.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Portable([f32; 16]);

#[inline(always)]
fn map(a: [f32; 16], f: impl Fn(f32) -> f32) -> Portable {
    Portable(core::array::from_fn(|i| f(a[i])))
}

#[inline(always)]
fn zip(a: [f32; 16], b: [f32; 16], f: impl Fn(f32, f32) -> f32) -> Portable {
    Portable(core::array::from_fn(|i| f(a[i], b[i])))
}

#[inline(always)]
fn zip_bits(a: [f32; 16], b: [f32; 16], f: impl Fn(u32, u32) -> u32) -> Portable {
    Portable(core::array::from_fn(|i| {
        f32::from_bits(f(a[i].to_bits(), b[i].to_bits()))
    }))
}

#[inline(always)]
fn map_bits(a: [f32; 16], f: impl Fn(u32) -> u32) -> Portable {
    Portable(core::array::from_fn(|i| f32::from_bits(f(a[i].to_bits()))))
}

/// x86's conversion semantics: out of range or NaN gives `i32::MIN`.
#[inline(always)]
fn to_i32_or_indefinite(x: f32) -> u32 {
    if x.is_nan() || !(-2147483648.0..2147483648.0).contains(&x) {
        i32::MIN as u32
    } else {
        x as i32 as u32
    }
}

#[inline(always)]
fn mask(a: [f32; 16], b: [f32; 16], f: impl Fn(f32, f32) -> bool) -> [bool; 16] {
    core::array::from_fn(|i| f(a[i], b[i]))
}

impl F32x16 for Portable {
    type Mask = [bool; 16];
    /// The lanes live in arrays; the kernels keep the layout measured on AVX-512.
    const REGISTERS: usize = 32;
    const SPECIALIZED_LOOPS: bool = false;

    #[inline(always)]
    fn splat(x: f32) -> Self {
        Portable([x; 16])
    }
    #[inline(always)]
    fn from_array(a: [f32; 16]) -> Self {
        Portable(a)
    }
    #[inline(always)]
    fn to_array(self) -> [f32; 16] {
        self.0
    }
    #[inline(always)]
    fn load(src: &[f32; 16]) -> Self {
        Portable(*src)
    }
    #[inline(always)]
    fn load_bf16(src: &[half::bf16; 16]) -> Self {
        // bf16 is the upper half of an f32: widening is a 16-bit shift, exact for every value.
        Portable(core::array::from_fn(|i| {
            f32::from_bits(u32::from(src[i].to_bits()) << 16)
        }))
    }
    #[inline(always)]
    fn load_f16(src: &[half::f16; 16]) -> Self {
        Portable(core::array::from_fn(|i| src[i].to_f32()))
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32; 16]) {
        *dst = self.0;
    }
    #[inline(always)]
    fn store_stream(self, dst: &mut [f32; 16]) {
        *dst = self.0;
    }
    #[inline(always)]
    fn store_bf16_bits(self, dst: &mut [half::bf16; 16]) {
        for (d, x) in dst.iter_mut().zip(self.0) {
            // Truncation to the low 16 bits, as the SIMD narrowing stores do.
            *d = half::bf16::from_bits(x.to_bits() as u16);
        }
    }
    #[inline(always)]
    fn prefetch(_p: *const u8) {}
    #[inline(always)]
    fn prefetch_l2(_p: *const u8) {}

    #[inline(always)]
    fn add(self, b: Self) -> Self {
        zip(self.0, b.0, |a, b| a + b)
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        zip(self.0, b.0, |a, b| a - b)
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        zip(self.0, b.0, |a, b| a * b)
    }
    #[inline(always)]
    fn div(self, b: Self) -> Self {
        zip(self.0, b.0, |a, b| a / b)
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        Portable(core::array::from_fn(|i| {
            libm::fmaf(self.0[i], b.0[i], c.0[i])
        }))
    }
    #[inline(always)]
    fn max(self, b: Self) -> Self {
        zip(self.0, b.0, |a, b| if a > b { a } else { b })
    }
    #[inline(always)]
    fn min(self, b: Self) -> Self {
        zip(self.0, b.0, |a, b| if a < b { a } else { b })
    }

    #[inline(always)]
    fn and(self, b: Self) -> Self {
        zip_bits(self.0, b.0, |a, b| a & b)
    }
    #[inline(always)]
    fn or(self, b: Self) -> Self {
        zip_bits(self.0, b.0, |a, b| a | b)
    }
    #[inline(always)]
    fn xor(self, b: Self) -> Self {
        zip_bits(self.0, b.0, |a, b| a ^ b)
    }
    #[inline(always)]
    fn andnot(self, b: Self) -> Self {
        zip_bits(self.0, b.0, |a, b| !a & b)
    }
    #[inline(always)]
    fn add_i32(self, b: Self) -> Self {
        zip_bits(self.0, b.0, u32::wrapping_add)
    }
    #[inline(always)]
    fn sub_i32(self, b: Self) -> Self {
        zip_bits(self.0, b.0, u32::wrapping_sub)
    }
    #[inline(always)]
    fn max_i32(self, b: Self) -> Self {
        zip_bits(self.0, b.0, |a, b| (a as i32).max(b as i32) as u32)
    }
    #[inline(always)]
    fn shl<const N: u32>(self) -> Self {
        map_bits(self.0, |a| a << N)
    }
    #[inline(always)]
    fn shr_logical<const N: u32>(self) -> Self {
        map_bits(self.0, |a| a >> N)
    }
    #[inline(always)]
    fn shr_arith<const N: u32>(self) -> Self {
        map_bits(self.0, |a| ((a as i32) >> N) as u32)
    }
    #[inline(always)]
    fn i32_to_f32(self) -> Self {
        map(self.0, |a| a.to_bits() as i32 as f32)
    }
    #[inline(always)]
    fn f32_to_i32_round(self) -> Self {
        map_bits(self.0, |a| {
            to_i32_or_indefinite(f32::from_bits(a).round_ties_even())
        })
    }
    #[inline(always)]
    fn f32_to_i32_trunc(self) -> Self {
        map_bits(self.0, |a| to_i32_or_indefinite(f32::from_bits(a).trunc()))
    }

    #[inline(always)]
    fn gt(self, b: Self) -> [bool; 16] {
        mask(self.0, b.0, |a, b| a > b)
    }
    #[inline(always)]
    fn ge(self, b: Self) -> [bool; 16] {
        mask(self.0, b.0, |a, b| a >= b)
    }
    #[inline(always)]
    fn lt(self, b: Self) -> [bool; 16] {
        mask(self.0, b.0, |a, b| a < b)
    }
    #[inline(always)]
    fn le(self, b: Self) -> [bool; 16] {
        mask(self.0, b.0, |a, b| a <= b)
    }
    #[inline(always)]
    fn not_lt(self, b: Self) -> [bool; 16] {
        mask(self.0, b.0, |a, b| {
            a.partial_cmp(&b) != Some(core::cmp::Ordering::Less)
        })
    }
    #[inline(always)]
    fn eq(self, b: Self) -> [bool; 16] {
        mask(self.0, b.0, |a, b| a == b)
    }
    #[inline(always)]
    fn ne(self, b: Self) -> [bool; 16] {
        mask(self.0, b.0, |a, b| a != b)
    }
    #[inline(always)]
    fn eq_i32(self, b: Self) -> [bool; 16] {
        mask(self.0, b.0, |a, b| a.to_bits() == b.to_bits())
    }
    #[inline(always)]
    fn select(m: [bool; 16], a: Self, b: Self) -> Self {
        Portable(core::array::from_fn(|i| if m[i] { a.0[i] } else { b.0[i] }))
    }
    #[inline(always)]
    fn mask_and(a: [bool; 16], b: [bool; 16]) -> [bool; 16] {
        core::array::from_fn(|i| a[i] & b[i])
    }
    #[inline(always)]
    fn mask_or(a: [bool; 16], b: [bool; 16]) -> [bool; 16] {
        core::array::from_fn(|i| a[i] | b[i])
    }
    #[inline(always)]
    fn mask_andnot(a: [bool; 16], b: [bool; 16]) -> [bool; 16] {
        core::array::from_fn(|i| !a[i] & b[i])
    }
    #[inline(always)]
    fn mask_none() -> [bool; 16] {
        [false; 16]
    }
    #[inline(always)]
    fn mask_any(m: [bool; 16]) -> bool {
        m.iter().any(|&b| b)
    }
}
