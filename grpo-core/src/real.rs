//! [`Real`]: the scalar type the group- and token-level math is generic over.
//!
//! Advantages and losses are scalar formulas, so they are written once for `f32` (what trainers
//! store) and `f64` (what tests use as the reference). Transcendentals come from `libm`, which is
//! `no_std` and gives the same results on every target — except `exp` and `ln` of `f32`, which
//! are the project's canonical branch-free functions ([`crate::vocab::exp_ln`]: at most 1 ULP
//! from the correctly rounded result over all inputs, built only from exactly specified IEEE
//! operations). They are what makes grpo-cpu's SIMD losses bit-identical to this crate: a
//! vector backend can repeat their operation sequence lane by lane, which it cannot do for
//! libm's table-driven `expf`/`logf`. (`f64` keeps libm's `exp`/`log`: no f64 SIMD path exists.)

use core::fmt::{Debug, Display};
use core::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

/// A floating-point scalar: implemented for `f32` and `f64`.
///
/// `max`/`min` follow the project-wide NaN rule `if a > b { a } else { b }` (so a NaN in `a`
/// yields `b`), which is what every backend implements; `clamp` is `min(max(x, lo), hi)` with
/// that rule.
pub trait Real:
    Copy
    + Default
    + Debug
    + Display
    + PartialEq
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + Send
    + Sync
    + 'static
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// 2.
    const TWO: Self;
    /// 0.5.
    const HALF: Self;
    /// +∞.
    const INFINITY: Self;
    /// −∞.
    const NEG_INFINITY: Self;
    /// The largest finite value.
    const MAX: Self;
    /// Machine epsilon.
    const EPSILON: Self;

    /// Nearest representable value of an `f64` (round to nearest even).
    fn from_f64(x: f64) -> Self;
    /// Exact widening (f32) or identity (f64).
    fn to_f64(self) -> f64;
    /// `n` as this type (rounded to nearest for `n > 2^24` in f32).
    fn from_usize(n: usize) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// e^x (`f32`: [`crate::vocab::exp_ln::exp`]; `f64`: `libm::exp`).
    fn exp(self) -> Self;
    /// Natural logarithm (`f32`: [`crate::vocab::exp_ln::ln`]; `f64`: `libm::log`).
    fn ln(self) -> Self;
    /// ln(1 + x), accurate for small x.
    fn ln_1p(self) -> Self;
    /// e^x − 1, accurate for small x.
    fn exp_m1(self) -> Self;
    /// x^y.
    fn powf(self, y: Self) -> Self;
    /// |x|.
    fn abs(self) -> Self;
    /// Neither NaN nor ±∞.
    fn is_finite(self) -> bool;
    /// NaN.
    fn is_nan(self) -> bool;
    /// Correctly rounded x·y + z (one rounding).
    fn mul_add(self, y: Self, z: Self) -> Self;
    /// Complementary error function.
    fn erfc(self) -> Self;

    /// `if self > other { self } else { other }` (the project-wide NaN rule).
    #[inline]
    fn max(self, other: Self) -> Self {
        if self > other { self } else { other }
    }
    /// `if self < other { self } else { other }`.
    #[inline]
    fn min(self, other: Self) -> Self {
        if self < other { self } else { other }
    }
    /// `min(max(self, lo), hi)`.
    #[inline]
    fn clamp(self, lo: Self, hi: Self) -> Self {
        self.max(lo).min(hi)
    }
    /// The logistic function 1/(1 + e^{−x}), evaluated without overflow for either sign.
    #[inline]
    fn sigmoid(self) -> Self {
        if self >= Self::ZERO {
            Self::ONE / (Self::ONE + (-self).exp())
        } else {
            let e = self.exp();
            e / (Self::ONE + e)
        }
    }
    /// −1, 0 or +1 (0 for ±0 and NaN).
    #[inline]
    fn signum0(self) -> Self {
        if self > Self::ZERO {
            Self::ONE
        } else if self < Self::ZERO {
            -Self::ONE
        } else {
            Self::ZERO
        }
    }
}

macro_rules! impl_real {
    ($t:ty, $sqrt:path, $exp:path, $ln:path, $ln1p:path, $expm1:path, $pow:path, $fma:path, $erfc:path) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const TWO: Self = 2.0;
            const HALF: Self = 0.5;
            const INFINITY: Self = <$t>::INFINITY;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            const MAX: Self = <$t>::MAX;
            const EPSILON: Self = <$t>::EPSILON;

            #[inline]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn from_usize(n: usize) -> Self {
                n as $t
            }
            #[inline]
            fn sqrt(self) -> Self {
                $sqrt(self)
            }
            #[inline]
            fn exp(self) -> Self {
                $exp(self)
            }
            #[inline]
            fn ln(self) -> Self {
                $ln(self)
            }
            #[inline]
            fn ln_1p(self) -> Self {
                $ln1p(self)
            }
            #[inline]
            fn exp_m1(self) -> Self {
                $expm1(self)
            }
            #[inline]
            fn powf(self, y: Self) -> Self {
                $pow(self, y)
            }
            #[inline]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
            #[inline]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline]
            fn mul_add(self, y: Self, z: Self) -> Self {
                $fma(self, y, z)
            }
            #[inline]
            fn erfc(self) -> Self {
                $erfc(self)
            }
        }
    };
}

impl_real!(
    f32,
    libm::sqrtf,
    crate::vocab::exp_ln::exp,
    crate::vocab::exp_ln::ln,
    libm::log1pf,
    libm::expm1f,
    libm::powf,
    libm::fmaf,
    libm::erfcf
);
impl_real!(
    f64,
    libm::sqrt,
    libm::exp,
    libm::log,
    libm::log1p,
    libm::expm1,
    libm::pow,
    libm::fma,
    libm::erfc
);

#[cfg(test)]
mod tests {
    use super::Real;

    #[test]
    fn max_min_follow_the_nan_rule() {
        assert_eq!(Real::max(f32::NAN, 1.0), 1.0);
        assert!(Real::max(1.0f32, f32::NAN).is_nan());
        assert_eq!(Real::min(f64::NAN, -2.0), -2.0);
        assert_eq!(Real::clamp(5.0f64, -1.0, 1.0), 1.0);
        assert_eq!(Real::clamp(-5.0f64, -1.0, 1.0), -1.0);
    }

    #[test]
    fn sigmoid_is_stable_at_the_extremes() {
        assert_eq!(Real::sigmoid(1000.0f64), 1.0);
        assert_eq!(Real::sigmoid(-1000.0f64), 0.0);
        assert_eq!(Real::sigmoid(0.0f32), 0.5);
        let x = 0.3f64;
        assert!((Real::sigmoid(x) - 1.0 / (1.0 + (-x).exp())).abs() < 1e-16);
    }

    #[test]
    fn fma_rounds_once() {
        // (1 + 2^-23)(1 - 2^-23) - 1 = -2^-46 exactly; unfused f32 arithmetic gives 0.
        let a = 1.0f32 + f32::EPSILON;
        let b = 1.0f32 - f32::EPSILON;
        assert_eq!(Real::mul_add(a, b, -1.0), -(2.0f32).powi(-46));
    }
}
