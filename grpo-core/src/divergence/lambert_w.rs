//! The Lambert W function for real arguments: principal branch W₀ and lower branch W₋₁.
//!
//! W is the inverse of w ↦ w·e^w. On the reals it has two branches meeting at the branch point
//! (x, w) = (−1/e, −1): W₀ maps [−1/e, ∞) onto [−1, ∞) and W₋₁ maps [−1/e, 0) onto (−∞, −1].
//! ATR-GRPO's KL3 clip bounds are l_δ = −W₀(−e^{−(1+δ)}) and u_δ = −W₋₁(−e^{−(1+δ)})
//! [2602.05494] (the library computes those bounds by a better-conditioned route, see
//! [`RatioBounds::kl3`](crate::divergence::RatioBounds::kl3); these functions are exposed for
//! users and serve as a cross-check in tests).
//!
//! **Method** (Corless, Gonnet, Hare, Jeffrey & Knuth 1996, "On the Lambert W function"):
//! - distance to the branch point r = 1 + e·x is formed with 1/e split into two doubles, so that
//!   p = ±√(2r) is accurate even when x is within a few ULP of −1/e;
//! - near the branch point (x < −1/4) the initial guess is the branch-point series
//!   W = −1 + p − p²/3 + 11p³/72 − 43p⁴/540 + … (p > 0 for W₀, p < 0 for W₋₁); for |p| < 0.01 the
//!   ten-term series is already exact to ~1e-23 and is returned directly (Halley's iteration is
//!   ill-conditioned there because W'(x) → ∞);
//! - elsewhere W₀ starts from Winitzki's approximation L(1 − ln(1 + L)/(2 + L)), L = ln(1 + x),
//!   and W₋₁ from the asymptotic expansion L₁ − L₂ + L₂/L₁, L₁ = ln(−x), L₂ = ln(−L₁);
//! - then Halley's iteration on f(w) = w·e^w − x, written with t = f·e^{−w} = w − x·e^{−w}
//!   (x·e^{−w} formed as ±e^{ln|x| − w} when e^{−w} would overflow) so it works over the whole
//!   range of the type: w ← w − t / ((w + 1) − (w + 2)·t / (2(w + 1))).
//!
//! Accuracy in f64: W·e^W = x to ≲ 1e-15 relative away from the branch point (tested), |W|
//! to a few ULP; in f32 to a few f32 ULP.
//!
//! **Domain.** Arguments below −1/e are accepted if they are within 4 ULP of −1/e in the type
//! (rounding the constant −1/e into `T` may land just below it) and then return −1.

use crate::error::{Error, Result};
use crate::real::Real;

/// fl₆₄(1/e).
const INV_E: f64 = 0.36787944117144233;
/// 1/e − fl₆₄(1/e) (the low part of the double-double 1/e).
const INV_E_LO: f64 = -1.2428753672788363e-17;
/// e.
const E: f64 = core::f64::consts::E;

/// Branch-point series coefficients c_k of W = Σ c_k p^k, p = ±√(2(1 + e·x)) (Corless et al.
/// 1996, eq. 4.22).
const BRANCH_SERIES: [f64; 10] = [
    -1.0,
    1.0,
    -1.0 / 3.0,
    11.0 / 72.0,
    -43.0 / 540.0,
    769.0 / 17280.0,
    -221.0 / 8505.0,
    680863.0 / 43545600.0,
    -1963.0 / 204120.0,
    226287557.0 / 37623398400.0,
];

/// Which real branch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Branch {
    Principal,
    Lower,
}

/// Principal branch W₀(x) for x ≥ −1/e: the solution w ≥ −1 of w·e^w = x.
///
/// # Errors
/// [`Error::InvalidParam`] (`name: "x"`) for NaN, ±∞ or x < −1/e.
///
/// # Example
/// ```
/// use grpo_core::divergence::lambert_w::lambert_w0;
/// let w = lambert_w0(1.0f64).unwrap(); // the omega constant
/// assert!((w - 0.5671432904097838).abs() < 2.5e-16);
/// assert!((lambert_w0(core::f64::consts::E).unwrap() - 1.0).abs() < 1e-15);
/// assert!(lambert_w0(-1.0f64).is_err());
/// ```
pub fn lambert_w0<T: Real>(x: T) -> Result<T> {
    lambert_w(x, Branch::Principal)
}

/// Lower branch W₋₁(x) for −1/e ≤ x < 0: the solution w ≤ −1 of w·e^w = x.
///
/// # Errors
/// [`Error::InvalidParam`] (`name: "x"`) for NaN, x < −1/e or x ≥ 0 (W₋₁(0⁻) = −∞).
///
/// # Example
/// ```
/// use grpo_core::divergence::lambert_w::lambert_wm1;
/// let w = lambert_wm1(-0.1f64).unwrap();
/// assert!((w - -3.577152063957297).abs() < 1e-14);
/// assert!(lambert_wm1(0.0f64).is_err());
/// ```
pub fn lambert_wm1<T: Real>(x: T) -> Result<T> {
    lambert_w(x, Branch::Lower)
}

fn lambert_w<T: Real>(x: T, branch: Branch) -> Result<T> {
    if !x.is_finite() {
        return Err(Error::InvalidParam {
            name: "x",
            reason: "Lambert W needs a finite argument",
        });
    }
    // (x is finite here, so `>=` is the exact complement of `<`.)
    if branch == Branch::Lower && x >= T::ZERO {
        return Err(Error::InvalidParam {
            name: "x",
            reason: "the lower branch W-1 is defined on [-1/e, 0)",
        });
    }
    // r = 1 + e·x = e·(x + 1/e), with 1/e as hi + lo so the sum is accurate near −1/e.
    let hi = T::from_f64(INV_E);
    let lo = T::from_f64((INV_E - hi.to_f64()) + INV_E_LO);
    let dx = (x + hi) + lo;
    // Rounding −1/e into T can land a few ULP below the true value: accept that, reject the rest.
    let tol = T::from_f64(4.0 * INV_E) * T::EPSILON;
    if dx < -tol {
        return Err(Error::InvalidParam {
            name: "x",
            reason: "Lambert W is real only for x >= -1/e",
        });
    }
    if dx <= T::ZERO {
        return Ok(-T::ONE);
    }
    if branch == Branch::Principal {
        if x == T::ZERO {
            return Ok(x);
        }
        // W₀(x) = x − x² + …: for |x| < ε, x itself is correctly rounded to within an ULP.
        if x.abs() < T::EPSILON {
            return Ok(x);
        }
    }
    let r = T::from_f64(E) * dx;
    let sqrt_2r = (T::TWO * r).sqrt();
    let p = match branch {
        Branch::Principal => sqrt_2r,
        Branch::Lower => -sqrt_2r,
    };
    let near_branch_point = x < T::from_f64(-0.25);
    let mut w = if near_branch_point {
        let mut acc = T::ZERO;
        for &c in BRANCH_SERIES.iter().rev() {
            acc = acc * p + T::from_f64(c);
        }
        if p.abs() < T::from_f64(0.01) {
            return Ok(acc);
        }
        acc
    } else {
        match branch {
            Branch::Principal => {
                let l = x.ln_1p();
                l * (T::ONE - (T::ONE + l).ln() / (T::TWO + l))
            }
            Branch::Lower => {
                let l1 = (-x).ln();
                let l2 = (-l1).ln();
                l1 - l2 + l2 / l1
            }
        }
    };
    let big = T::MAX.ln() - T::ONE;
    for _ in 0..12 {
        // x·e^{−w}, without overflowing e^{−w} when |w| is large (then x ≠ 0 and x, w share
        // their sign, so ln|x| − w is moderate).
        let x_exp_mw = if w.abs() < big {
            x * (-w).exp()
        } else if x > T::ZERO {
            (x.ln() - w).exp()
        } else {
            -((-x).ln() - w).exp()
        };
        let t = w - x_exp_mw;
        let w1 = w + T::ONE;
        if w1 == T::ZERO {
            break;
        }
        let step = t / (w1 - (w + T::TWO) * t / (T::TWO * w1));
        if !step.is_finite() {
            break;
        }
        let next = w - step;
        // Stay on the requested branch (a step across −1 would converge to the other one).
        let next = match branch {
            Branch::Principal => next.max(-T::ONE),
            Branch::Lower => next.min(-T::ONE),
        };
        let done = (next - w).abs() <= T::TWO * T::EPSILON * next.abs();
        w = next;
        if done {
            break;
        }
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: f64, b: f64) -> f64 {
        (a - b).abs() / b.abs()
    }

    #[test]
    fn known_values() {
        // Omega constant Ω e^Ω = 1; W₀(e) = 1 since 1·e¹ = e; W₋₁(−1/e) = −1.
        assert!(rel(lambert_w0(1.0f64).unwrap(), 0.5671432904097838) < 2e-16);
        assert!(rel(lambert_w0(core::f64::consts::E).unwrap(), 1.0) < 2e-16);
        assert!((lambert_wm1(-0.1f64).unwrap() + 3.577152063957297).abs() < 2e-15);
        assert_eq!(lambert_wm1(-INV_E).unwrap(), -1.0);
        assert_eq!(lambert_w0(-INV_E).unwrap(), -1.0);
        assert_eq!(lambert_w0(0.0f64).unwrap(), 0.0);
        // W₀(−ln 2 / 2) = −ln 2: (−ln 2)·e^{−ln 2} = −ln 2 / 2. W₋₁(−ln2/2) = −2 ln 2 (= ln ¼):
        // (ln ¼)·e^{ln ¼} = ln(¼)/4 = −ln 2 / 2.
        let ln2 = core::f64::consts::LN_2;
        assert!(rel(lambert_w0(-ln2 / 2.0).unwrap(), -ln2) < 4e-16);
        assert!(rel(lambert_wm1(-ln2 / 2.0).unwrap(), -2.0 * ln2) < 4e-16);
    }

    #[test]
    fn identity_over_the_range() {
        let mut x = -0.3678f64;
        while x < 1e300 {
            let w = lambert_w0(x).unwrap();
            // Rounding w to a double perturbs e^w by |w|·ε relative: that is the identity's floor.
            let tol = 1e-15f64.max(4e-16 * (1.0 + w.abs()));
            assert!(rel(w * w.exp(), x) < tol, "W0 {x}: {w}");
            x = if x < 0.0 { x + 0.01 } else { x * 3.7 + 1e-3 };
        }
        let mut x = -0.3678f64;
        while x < -1e-300 {
            let w = lambert_wm1(x).unwrap();
            assert!(w <= -1.0);
            let back = if w > -700.0 {
                w * w.exp()
            } else {
                -((-w).ln() + w).exp()
            };
            let tol = 1e-15f64.max(4e-16 * (1.0 + w.abs()));
            assert!(rel(back, x) < tol, "W-1 {x}: {w}");
            x *= 0.77;
        }
    }

    #[test]
    fn domain_errors() {
        assert!(lambert_w0(-0.37f64).is_err());
        assert!(lambert_wm1(-0.37f64).is_err());
        assert!(lambert_wm1(0.5f64).is_err());
        assert!(lambert_w0(f64::NAN).is_err());
        assert!(lambert_w0(f32::INFINITY).is_err());
    }

    #[test]
    fn f32_agrees_with_f64() {
        for x in [-0.36f32, -0.2, -0.01, 0.5, 1.0, 10.0, 1e10, 1e30] {
            let w32 = lambert_w0(x).unwrap() as f64;
            let w64 = lambert_w0(x as f64).unwrap();
            assert!(rel(w32, w64) < 4.0 * f32::EPSILON as f64, "{x}");
        }
        for x in [-0.36f32, -0.2, -0.01, -1e-10, -1e-30] {
            let w32 = lambert_wm1(x).unwrap() as f64;
            let w64 = lambert_wm1(x as f64).unwrap();
            assert!(rel(w32, w64) < 4.0 * f32::EPSILON as f64, "{x}");
        }
    }
}
