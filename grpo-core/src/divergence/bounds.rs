//! Clip bounds from divergence constraints (MATH.md §3, the unified clipping framework
//! [2602.05494]), the dual-clip and δ-cap parameters, and the elastic trust region.
//!
//! Every constraint "D(ρ) ≤ δ" on a divergence D that decreases to 0 at ρ = 1 and increases
//! after it has an interval [l, u] ∋ 1 as its feasible set; the loss only needs the endpoints,
//! so they are computed once per δ ([`RatioBounds::from_divergence`]) and the per-token path is
//! the plain ratio comparison of [`RatioBounds`].

use super::RatioBounds;
use super::measures::{Measure, expm1_minus_x};
use crate::error::{Error, Result, check_len, ensure};
use crate::layout::Groups;
use crate::real::Real;
use crate::stats::{Bessel, Moments};

/// Lower and upper root y = ln ρ of e^y − 1 − y = δ, in f64.
///
/// Safeguarded Newton on g(y) = (e^y − 1 − y) − δ, g'(y) = e^y − 1 (g is convex with its
/// minimum −δ at y = 0). Brackets: for y ≤ 0, e^y − 1 − y ≤ y²/2 and −y = δ + 1 − e^y ∈ [δ, δ + 1],
/// so the lower root lies in [−1 − δ, −max(√(2δ), δ)]; for y ≥ 0, e^y − 1 − y ≥ y²/2,
/// e^y = 1 + δ + y ≥ 1 + δ, and g(ln 2 + ln(1 + δ)) = 1 + δ − ln(2 + 2δ) > 0, so the upper root
/// lies in [ln(1 + δ), min(√(2δ), ln 2 + ln(1 + δ))].
/// The start is the inverted series y ≈ s − s²/6 + s³/36, s = ±√(2δ) (so ρ = e^y ≈ 1 + s + s²/3:
/// 1 − l ≈ √(2δ) − 2δ/3, u − 1 ≈ √(2δ) + 2δ/3). g is evaluated without cancellation
/// ([`expm1_minus_x`]), so the roots are accurate to a few ULP even for δ = 1e−12, where the
/// Lambert-W form −W(−e^{−(1+δ)}) has an argument within 1e−13 of the branch point and loses
/// half its digits.
fn kl3_log_roots(delta: f64) -> (f64, f64) {
    let s = libm::sqrt(2.0 * delta);
    let series = |s: f64| s - s * s / 6.0 + s * s * s / 36.0;
    let lower = newton_bracketed(delta, -1.0 - delta, -s.max(delta), series(-s));
    let l1p = libm::log1p(delta);
    let upper = newton_bracketed(delta, l1p, s.min(core::f64::consts::LN_2 + l1p), series(s));
    (lower, upper)
}

/// Root of g(y) = expm1_minus_x(y) − δ in the bracket [a, b] (g(a), g(b) of opposite signs or
/// zero), starting from `guess`; Newton steps that leave the bracket are replaced by bisection.
fn newton_bracketed(delta: f64, a: f64, b: f64, guess: f64) -> f64 {
    let g = |y: f64| expm1_minus_x(y) - delta;
    let (mut lo, mut hi) = if a < b { (a, b) } else { (b, a) };
    let (g_lo, g_hi) = (g(lo), g(hi));
    if g_lo == 0.0 {
        return lo;
    }
    if g_hi == 0.0 {
        return hi;
    }
    let g_lo_positive = g_lo > 0.0;
    let mut y = if guess > lo && guess < hi {
        guess
    } else {
        0.5 * (lo + hi)
    };
    for _ in 0..200 {
        let gy = g(y);
        if gy == 0.0 {
            return y;
        }
        if (gy > 0.0) == g_lo_positive {
            lo = y;
        } else {
            hi = y;
        }
        let slope = libm::expm1(y);
        let mut next = if slope != 0.0 { y - gy / slope } else { y };
        if !(next > lo && next < hi) {
            next = 0.5 * (lo + hi);
        }
        if next == y || (next - y).abs() <= 1e-17 * y.abs() {
            return next;
        }
        y = next;
    }
    y
}

fn check_delta<T: Real>(delta: T) -> Result<f64> {
    ensure(
        delta > T::ZERO && delta.is_finite(),
        "delta",
        "must be finite and > 0",
    )?;
    Ok(delta.to_f64())
}

impl<T: Real> RatioBounds<T> {
    /// ATR-GRPO's KL3 trust region [2602.05494]: ρ − 1 − ln ρ ≤ δ ⇔ ρ ∈ [l_δ, u_δ] with
    /// l_δ = −W₀(−e^{−(1+δ)}), u_δ = −W₋₁(−e^{−(1+δ)}).
    ///
    /// Computed by safeguarded Newton in y = ln ρ (not through Lambert W, which is
    /// ill-conditioned at small δ; see the [module docs](self)), always in f64 and then rounded
    /// to `T`: KL3(l) = KL3(u) = δ to ~1e−13 relative for δ ∈ [1e−6, 10], and the f32 bounds
    /// are the f64 ones correctly rounded. Small δ: 1 − l ≈ √(2δ) − 2δ/3,
    /// u − 1 ≈ √(2δ) + 2δ/3 (wider upward).
    ///
    /// # Errors
    /// [`Error::InvalidParam`] (`"delta"`) unless δ is finite and > 0.
    ///
    /// # Example
    /// ```
    /// use grpo_core::divergence::RatioBounds;
    /// // MATH.md check value: δ = 0.05 → [0.71619, 1.35040].
    /// let b = RatioBounds::kl3(0.05f64).unwrap();
    /// assert!((b.lo - 0.71619).abs() < 5e-6 && (b.hi - 1.35040).abs() < 5e-6);
    /// // Both endpoints sit on the constraint: ρ − 1 − ln ρ = δ.
    /// assert!((b.hi - 1.0 - b.hi.ln() - 0.05).abs() < 1e-15);
    /// ```
    pub fn kl3(delta: T) -> Result<Self> {
        let d = check_delta(delta)?;
        let (yl, yu) = kl3_log_roots(d);
        Ok(RatioBounds {
            lo: T::from_f64(libm::exp(yl)),
            hi: T::from_f64(libm::exp(yu)),
        })
    }

    /// The feasible ratio interval {ρ : D(ρ) ≤ δ} of a divergence measure (the unified clipping
    /// framework [2602.05494]; the measures are functions of ρ as in
    /// [`Measure::of_ratio`]):
    ///
    /// | measure | interval |
    /// |---|---|
    /// | `K1` (−ln ρ ≤ δ) | [e^{−δ}, +∞) — one-sided: k1 is negative for ρ > 1 |
    /// | `Abs` (\|ln ρ\| ≤ δ) | [e^{−δ}, e^{δ}] |
    /// | `K2` ((ln ρ)²/2 ≤ δ) | [e^{−√(2δ)}, e^{√(2δ)}] |
    /// | `K3` (ρ − 1 − ln ρ ≤ δ) | [`RatioBounds::kl3`] |
    /// | `ChiSquared` ((ρ − 1)² ≤ δ) | [max(0, 1 − √δ), 1 + √δ] |
    ///
    /// Endpoints are computed in f64 and rounded to `T` (an upper endpoint beyond `T::MAX`
    /// becomes +∞, i.e. no upper clip).
    ///
    /// # Errors
    /// [`Error::InvalidParam`]: `"delta"` unless finite and > 0; `"measure"` for
    /// [`Measure::Ratio`] (not a divergence: no minimum at ρ = 1).
    ///
    /// # Example
    /// ```
    /// use grpo_core::divergence::{Measure, RatioBounds};
    /// // χ² with δ = 0.04 is the symmetric PPO clip with ε = √0.04 = 0.2.
    /// let b = RatioBounds::from_divergence(Measure::ChiSquared, 0.04f64).unwrap();
    /// assert!((b.lo - 0.8).abs() < 1e-15 && (b.hi - 1.2).abs() < 1e-15);
    /// // |ln ρ| ≤ ln 2 gives [1/2, 2].
    /// let a = RatioBounds::from_divergence(Measure::Abs, core::f64::consts::LN_2).unwrap();
    /// assert!((a.lo - 0.5).abs() < 1e-15 && (a.hi - 2.0).abs() < 1e-15);
    /// ```
    pub fn from_divergence(measure: Measure, delta: T) -> Result<Self> {
        let d = check_delta(delta)?;
        let (lo, hi) = match measure {
            Measure::Ratio => {
                return Err(Error::InvalidParam {
                    name: "measure",
                    reason: "the ratio is not a divergence (no minimum 0 at rho = 1)",
                });
            }
            Measure::K1 => (libm::exp(-d), f64::INFINITY),
            Measure::Abs => (libm::exp(-d), libm::exp(d)),
            Measure::K2 => {
                let r = libm::sqrt(2.0 * d);
                (libm::exp(-r), libm::exp(r))
            }
            Measure::K3 => return Self::kl3(delta),
            Measure::ChiSquared => {
                let r = libm::sqrt(d);
                ((1.0 - r).max(0.0), 1.0 + r)
            }
        };
        Ok(RatioBounds {
            lo: T::from_f64(lo),
            hi: T::from_f64(hi),
        })
    }

    /// Whether `rho` lies in `[lo, hi]` (NaN: no).
    ///
    /// # Example
    /// ```
    /// use grpo_core::divergence::RatioBounds;
    /// let b = RatioBounds::symmetric(0.2f32).unwrap();
    /// assert!(b.contains(1.1) && !b.contains(1.3) && !b.contains(f32::NAN));
    /// ```
    #[inline]
    pub fn contains(&self, rho: T) -> bool {
        rho >= self.lo && rho <= self.hi
    }
}

/// Dual-clip constant c > 1 \[verl vanilla, OpenRLHF\] (Ye et al. 2020, arXiv 1912.09729).
///
/// The loss helper owns its use: for A < 0 the PPO loss becomes
/// `min(−c·A, max(−ρA, −clip(ρ)A))`, i.e. the loss of a negative-advantage token is capped at
/// −c·A (= c·|A|) however large ρ grows. verl always applies it with c = 3 (the
/// [`Default`]); OpenRLHF applies it when configured.
///
/// # Example
/// ```
/// use grpo_core::divergence::DualClip;
/// assert_eq!(DualClip::<f32>::default().c(), 3.0);
/// assert_eq!(DualClip::new(2.5f64).unwrap().c(), 2.5);
/// assert!(DualClip::new(1.0f64).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DualClip<T> {
    c: T,
}

impl<T: Real> DualClip<T> {
    /// Validated dual-clip constant.
    ///
    /// # Errors
    /// [`Error::InvalidParam`] (`"dual_clip_c"`) unless c is finite and > 1.
    pub fn new(c: T) -> Result<Self> {
        ensure(
            c > T::ONE && c.is_finite(),
            "dual_clip_c",
            "must be finite and > 1",
        )?;
        Ok(DualClip { c })
    }

    /// The constant c.
    #[inline]
    pub fn c(&self) -> T {
        self.c
    }
}

impl<T: Real> Default for DualClip<T> {
    /// c = 3, verl's `clip_ratio_c` default.
    fn default() -> Self {
        DualClip {
            c: T::from_f64(3.0),
        }
    }
}

/// TRL's two-sided-GRPO upper ratio cap δ > 1 \[TRL `delta`, INTELLECT-2 (arXiv 2505.07291)\].
///
/// The loss helper owns its use: the ratio in the *unclipped* branch is replaced by
/// `min(ρ, δ)` before the `min(ρA, clip(ρ)A)`, so a negative-advantage token's loss cannot grow
/// without bound as ρ → ∞. TRL recommends δ > 1 + ε_high; we only require δ > 1.
///
/// # Example
/// ```
/// use grpo_core::divergence::DeltaCap;
/// assert_eq!(DeltaCap::new(4.0f32).unwrap().delta(), 4.0);
/// assert!(DeltaCap::new(0.5f32).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeltaCap<T> {
    delta: T,
}

impl<T: Real> DeltaCap<T> {
    /// Validated cap.
    ///
    /// # Errors
    /// [`Error::InvalidParam`] (`"delta"`) unless δ is finite and > 1.
    pub fn new(delta: T) -> Result<Self> {
        ensure(
            delta > T::ONE && delta.is_finite(),
            "delta",
            "must be finite and > 1",
        )?;
        Ok(DeltaCap { delta })
    }

    /// The cap δ.
    #[inline]
    pub fn delta(&self) -> T {
        self.delta
    }
}

/// Elastic trust region (ETR) [2601.03723], **our definition** (MATH.md §3): a per-sample
/// symmetric clip width
///
/// ε_i = min(ε₀·(1 + α·|A_i|), ε_max) · (1 + β·4σ_g²)
///
/// where the first factor is the *micro* (advantage-elastic) part, capped at ε_max, and the
/// second the *macro* (group-difficulty) part: σ_g² = p(1 − p) is the population variance of a
/// **binary** group's rewards (p its success rate), so 4σ_g² ∈ [0, 1] peaks for p = 1/2; a
/// group whose rewards are not all 0 or 1 gets macro factor 1. The bounds are
/// `[1 − ε_i, 1 + ε_i]`.
///
/// Invariants checked by [`ElasticTrustRegion::validate`]: 0 < ε₀ ≤ ε_max, α ≥ 0, β ≥ 0, all
/// finite, and ε_max·(1 + β) < 1 (so every lower bound stays > 0).
///
/// `Default` is neutral (α = β = 0, ε₀ = ε_max = 0.2): the PPO clip, for every sample. The
/// presets of the other peers do not implement ETR.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ElasticTrustRegion<T> {
    /// Base width ε₀.
    pub eps0: T,
    /// Advantage elasticity α.
    pub alpha: T,
    /// Cap ε_max of the micro width.
    pub eps_max: T,
    /// Macro (binary-group variance) gain β.
    pub beta: T,
}

impl<T: Real> Default for ElasticTrustRegion<T> {
    fn default() -> Self {
        let eps = T::from_f64(0.2);
        ElasticTrustRegion {
            eps0: eps,
            alpha: T::ZERO,
            eps_max: eps,
            beta: T::ZERO,
        }
    }
}

impl<T: Real> ElasticTrustRegion<T> {
    /// Checks the invariants listed on the type.
    ///
    /// # Errors
    /// [`Error::InvalidParam`] naming the first offending field.
    pub fn validate(&self) -> Result<()> {
        ensure(
            self.eps0 > T::ZERO && self.eps0.is_finite(),
            "eps0",
            "must be finite and > 0",
        )?;
        ensure(
            self.eps_max >= self.eps0 && self.eps_max.is_finite(),
            "eps_max",
            "must be finite and >= eps0",
        )?;
        ensure(
            self.alpha >= T::ZERO && self.alpha.is_finite(),
            "alpha",
            "must be finite and >= 0",
        )?;
        ensure(
            self.beta >= T::ZERO && self.beta.is_finite(),
            "beta",
            "must be finite and >= 0",
        )?;
        ensure(
            self.eps_max * (T::ONE + self.beta) < T::ONE,
            "eps_max",
            "eps_max * (1 + beta) must be < 1 so the lower bound stays > 0",
        )
    }

    /// ε_i for one sample: `advantage` A_i and `macro_var4` = 4σ_g² of its binary group (0 for
    /// a non-binary group). Assumes a validated config and finite inputs.
    #[inline]
    pub fn epsilon(&self, advantage: T, macro_var4: T) -> T {
        let micro = (self.eps0 * (T::ONE + self.alpha * advantage.abs())).min(self.eps_max);
        micro * (T::ONE + self.beta * macro_var4)
    }

    /// Per-sample ratio bounds `[1 − ε_i, 1 + ε_i]` for a batch: `advantages[i]` = A_i,
    /// `rewards[i]` the scalar reward that decides whether sample i's group is binary and, if
    /// so, its σ_g² (population variance, [`Moments`] two-pass-stable).
    ///
    /// # Errors
    /// Invalid config ([`ElasticTrustRegion::validate`]), layout errors of
    /// [`Groups::validate`], [`Error::LengthMismatch`] for `rewards`/`out`,
    /// [`Error::NonFinite`] for a NaN/±∞ advantage or reward. `out` is untouched on `Err`.
    ///
    /// # Example
    /// ```
    /// use grpo_core::{Groups, divergence::{ElasticTrustRegion, RatioBounds}};
    /// let etr = ElasticTrustRegion { eps0: 0.2f64, alpha: 0.5, eps_max: 0.3, beta: 0.5 };
    /// let rewards = [1.0, 0.0, 0.5, 0.5];
    /// let adv = [1.0, -1.0, 0.0, 0.0];
    /// let mut out = [RatioBounds::symmetric(0.1).unwrap(); 4];
    /// etr.sample_bounds(&adv, &rewards, Groups::Uniform(2), &mut out).unwrap();
    /// // Group 0 is binary with p = 1/2: 4σ² = 1. micro = min(0.2·1.5, 0.3) = 0.3; ε = 0.3·1.5.
    /// assert!((out[0].hi - 1.45).abs() < 1e-15 && (out[1].lo - 0.55).abs() < 1e-15);
    /// // Group 1 is not binary: macro factor 1, A = 0 → ε = 0.2.
    /// assert!((out[2].hi - 1.2).abs() < 1e-15);
    /// ```
    pub fn sample_bounds(
        &self,
        advantages: &[T],
        rewards: &[T],
        groups: Groups<'_>,
        out: &mut [RatioBounds<T>],
    ) -> Result<()> {
        self.validate()?;
        let n = advantages.len();
        check_len("rewards", n, rewards.len())?;
        check_len("out", n, out.len())?;
        let num_groups = groups.validate(n)?;
        if let Some(index) = advantages.iter().position(|a| !a.is_finite()) {
            return Err(Error::NonFinite {
                what: "advantages",
                index,
            });
        }
        if let Some(index) = rewards.iter().position(|r| !r.is_finite()) {
            return Err(Error::NonFinite {
                what: "rewards",
                index,
            });
        }
        let four = T::from_f64(4.0);
        for k in 0..num_groups {
            let binary = groups
                .members(k)
                .all(|i| rewards[i] == T::ZERO || rewards[i] == T::ONE);
            let var4 = if binary {
                let m = Moments::from_iter(groups.members(k).map(|i| rewards[i]));
                // 4σ² ≤ 1 for rewards in {0, 1}; the min drops the rounding excess of the
                // variance (f32 gives 1.0000001 for four 1s and four 0s), so ε ≤ ε_max·(1 + β)
                // < 1 and every lower bound stays > 0, as `validate` promises.
                (m.variance(Bessel::Population).unwrap_or(T::ZERO) * four).min(T::ONE)
            } else {
                T::ZERO
            };
            for i in groups.members(k) {
                let eps = self.epsilon(advantages[i], var4);
                out[i] = RatioBounds {
                    lo: T::ONE - eps,
                    hi: T::ONE + eps,
                };
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// h − ln(1 + h) by its alternating Taylor series (an implementation independent of the
    /// library's atanh form), for |h| < 0.6.
    fn kl3_ref(rho: f64) -> f64 {
        let h = rho - 1.0;
        if h.abs() >= 0.6 {
            return h - h.ln_1p();
        }
        let mut sum = 0.0;
        let mut p = h * h;
        let mut k = 2.0;
        let mut sign = 1.0;
        while k < 120.0 {
            sum += sign * p / k;
            p *= h;
            k += 1.0;
            sign = -sign;
        }
        sum
    }

    #[test]
    fn kl3_check_values() {
        // MATH.md §3 check values (5 decimals).
        for (d, l, u) in [
            (0.01, 0.86517, 1.14817),
            (0.05, 0.71619, 1.35040),
            (0.1, 0.61682, 1.51622),
        ] {
            let b = RatioBounds::kl3(d).unwrap();
            assert!((b.lo - l).abs() < 5e-6, "{d}: {}", b.lo);
            assert!((b.hi - u).abs() < 5e-6, "{d}: {}", b.hi);
        }
    }

    #[test]
    fn kl3_endpoints_sit_on_the_constraint() {
        let mut d = 1e-6f64;
        while d <= 10.0 {
            let b = RatioBounds::kl3(d).unwrap();
            assert!(((kl3_ref(b.lo) - d) / d).abs() < 1e-12, "lo {d}");
            assert!(((kl3_ref(b.hi) - d) / d).abs() < 1e-12, "hi {d}");
            d *= 1.37;
        }
    }

    #[test]
    fn other_divergences() {
        // K2 with δ = 0.5: √(2·0.5) = 1 → [1/e, e].
        let b = RatioBounds::from_divergence(Measure::K2, 0.5f64).unwrap();
        assert!((b.lo - (-1.0f64).exp()).abs() < 1e-16 && (b.hi - 1f64.exp()).abs() < 1e-15);
        let k1 = RatioBounds::from_divergence(Measure::K1, 1.0f32).unwrap();
        assert_eq!(k1.hi, f32::INFINITY);
        assert!((k1.lo - 0.36787945).abs() < 1e-7);
        // χ² with δ = 4: 1 − 2 < 0 → lo = 0, hi = 3.
        let c = RatioBounds::from_divergence(Measure::ChiSquared, 4.0f64).unwrap();
        assert_eq!((c.lo, c.hi), (0.0, 3.0));
        assert!(RatioBounds::from_divergence(Measure::Ratio, 1.0f64).is_err());
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(RatioBounds::kl3(bad).is_err());
            assert!(RatioBounds::from_divergence(Measure::Abs, bad).is_err());
        }
    }

    #[test]
    fn kl3_extreme_deltas_stay_ordered() {
        for d in [1e-300f64, 1e-20, 1e3, 1e30, 1e300, f64::MAX] {
            let b = RatioBounds::kl3(d).unwrap();
            assert!(b.lo >= 0.0 && b.lo <= 1.0 && b.hi >= 1.0, "{d}: {b:?}");
        }
        let b = RatioBounds::kl3(f32::MAX).unwrap();
        assert!(b.lo >= 0.0 && b.hi >= 1.0);
    }

    #[test]
    fn etr_validation_and_untouched_output() {
        let mut out = [RatioBounds::symmetric(0.1f64).unwrap(); 2];
        let before = out;
        let bad = ElasticTrustRegion {
            eps0: 0.2,
            alpha: 1.0,
            eps_max: 0.6,
            beta: 1.0,
        };
        assert!(matches!(
            bad.sample_bounds(&[0.0, 0.0], &[0.0, 1.0], Groups::Uniform(2), &mut out),
            Err(Error::InvalidParam {
                name: "eps_max",
                ..
            })
        ));
        let ok = ElasticTrustRegion::<f64>::default();
        assert!(matches!(
            ok.sample_bounds(&[0.0, f64::NAN], &[0.0, 1.0], Groups::Uniform(2), &mut out),
            Err(Error::NonFinite {
                what: "advantages",
                index: 1
            })
        ));
        assert!(
            ok.sample_bounds(&[0.0], &[0.0, 1.0], Groups::Uniform(2), &mut out)
                .is_err()
        );
        assert_eq!(out, before);
    }

    #[test]
    fn etr_lower_bound_stays_positive_at_the_edge_of_validation() {
        // ε_max·(1 + β) = ½·(2 − 2⁻²³) = 1 − 2⁻²⁴ < 1 passes validation. The binary group
        // (1, 1, 1, 1, 0, 0, 0, 0) has 4σ² = 1, but f32's Welford variance gives 1.0000001:
        // unclamped, ε = ½·(1 + β·1.0000001) rounded to 1 and the lower bound to 0.
        let etr = ElasticTrustRegion {
            eps0: 0.5f32,
            alpha: 0.0,
            eps_max: 0.5,
            beta: 1.0 - f32::EPSILON,
        };
        etr.validate().unwrap();
        let rewards = [1.0f32, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let m = Moments::from_iter(rewards.iter().copied());
        assert!(
            m.variance(Bessel::Population).unwrap() * 4.0 > 1.0,
            "the case no longer rounds up"
        );
        let mut out = [RatioBounds {
            lo: 0.5f32,
            hi: 2.0,
        }; 8];
        etr.sample_bounds(&[0.0; 8], &rewards, Groups::Uniform(8), &mut out)
            .unwrap();
        for b in out {
            // ε = ½·(1 + β) = 1 − 2⁻²⁴: lo = 2⁻²⁴ exactly, hi = 2 − 2⁻²⁴ rounded to 2.
            assert_eq!((b.lo, b.hi), (1.0 / 16_777_216.0, 2.0), "{b:?}");
        }
    }
}
