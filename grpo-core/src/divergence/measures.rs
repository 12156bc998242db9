//! Per-token divergence measures of the new policy from the old one (MATH.md §3).
//!
//! Every measure is a function of the log-ratio `x = lp − old` (equivalently of the ratio
//! `ρ = e^x`) and comes with its exact derivative with respect to `lp` (`old` is a constant):
//!
//! | [`Measure`] | value | ∂/∂lp | as a function of ρ |
//! |---|---|---|---|
//! | `Ratio` | ρ = e^x | ρ | ρ |
//! | `K1` | −x | −1 | −ln ρ |
//! | `Abs` | \|x\| | sgn x (0 at x = 0) | \|ln ρ\| |
//! | `K2` | x²/2 | x | (ln ρ)²/2 |
//! | `K3` | e^x − 1 − x | e^x − 1 | ρ − 1 − ln ρ |
//! | `ChiSquared` | (e^x − 1)² | 2(ρ − 1)ρ | (ρ − 1)² |
//!
//! `K1` is the one-sample estimate of KL(old‖new) (`E_old[−x]`); `K3` is the form the ATR
//! trust region constrains (ρ − 1 − ln ρ ≥ 0, minimum 0 at ρ = 1) [2602.05494]; `ChiSquared` is
//! the χ² divergence whose bound δ gives the symmetric clip |ρ − 1| ≤ √δ.
//!
//! **Accuracy.** `K3` is evaluated as a Taylor series for |x| < 1/2 (e^x − 1 − x cancels badly
//! there: at x = 1e−8 the naive form keeps only 8 digits) and as `expm1(x) − x` beyond.
//! `ChiSquared` uses `expm1` so that it is exact to a few ULP near ρ = 1.
//!
//! **Overflow guard.** e^x overflows for x ≳ 88 (f32) or 709 (f64) and the χ² gradient even
//! earlier. The scalar [`Measure::eval`] and the token function [`measure_tokens`] therefore
//! limit `x` to ±[`exp_guard`] (= ln(T::MAX)/2 − 1: 43.36 in f32, 353.9 in f64) for the
//! exponential measures and to ±√T::MAX for `K1`, `Abs` and `K2`, treating the limit like a clamp (gradient 0
//! where it is active). With the default log-ratio clamp (±20, verl/OpenRLHF) the guard never
//! triggers; it only matters for the unclamped (TRL) configuration, where the peer itself would
//! return `inf`/NaN.

use crate::error::{Result, check_len};
use crate::layout::Tokens;
use crate::real::Real;

/// Value of a per-token quantity and its derivative with respect to the current log-prob `lp`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ValueGrad<T> {
    /// The value.
    pub value: T,
    /// Its exact derivative ∂value/∂lp.
    pub grad: T,
}

/// A divergence measure of `x = lp − old` (see the [module table](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Measure {
    /// ρ = e^x (not a divergence: it has no minimum at ρ = 1; used for ratio diagnostics).
    Ratio,
    /// k1 = −x = −ln ρ, the sample estimate of KL(old‖new) (Schulman's k1).
    K1,
    /// |x| = |ln ρ|.
    Abs,
    /// k2 = x²/2 = (ln ρ)²/2 (Schulman's k2).
    K2,
    /// k3 = e^x − 1 − x = ρ − 1 − ln ρ (the ATR-GRPO constraint form [2602.05494]).
    K3,
    /// χ² = (ρ − 1)².
    ChiSquared,
}

/// The largest |x| the exponential measures accept before the overflow guard acts:
/// `ln(T::MAX)/2 − 1` (43.36 for f32, 353.9 for f64). At that point e^{2x}·2 is still finite, so
/// every value and gradient of this module (χ²'s gradient 2(ρ−1)ρ is the largest) is finite.
///
/// # Example
/// ```
/// use grpo_core::divergence::measures::exp_guard;
/// let g: f32 = exp_guard();
/// assert!((g - 43.361).abs() < 1e-3); // ln(3.4028235e38)/2 − 1 = 88.7228/2 − 1
/// ```
#[inline]
pub fn exp_guard<T: Real>() -> T {
    T::MAX.ln() * T::HALF - T::ONE
}

/// The largest |x| for which x²/2 (and x) are finite: √T::MAX.
#[inline]
pub(crate) fn poly_guard<T: Real>() -> T {
    T::MAX.sqrt()
}

/// `x` limited to `[−lim, lim]`, and whether the limit was active (a NaN `x` maps to `lim`,
/// flagged as limited; validated inputs never produce one).
#[inline]
pub(crate) fn limit<T: Real>(x: T, lim: T) -> (T, bool) {
    if x > lim {
        (lim, true)
    } else if x < -lim {
        (-lim, true)
    } else if x.is_nan() {
        (lim, true)
    } else {
        (x, false)
    }
}

/// 1/k! for k = 2..=17: the Taylor coefficients of e^x − 1 − x. With |x| < 1/2 the first omitted
/// term is below 2^{-16}/18! ≈ 2.4e-21 of x²/2, far under f64's half ULP.
const EXPM1_MINUS_X: [f64; 16] = [
    0.5,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5040.0,
    1.0 / 40320.0,
    1.0 / 362880.0,
    1.0 / 3628800.0,
    1.0 / 39916800.0,
    1.0 / 479001600.0,
    1.0 / 6227020800.0,
    1.0 / 87178291200.0,
    1.0 / 1307674368000.0,
    1.0 / 20922789888000.0,
    1.0 / 355687428096000.0,
];

/// e^x − 1 − x without cancellation: Taylor series (Horner) for |x| < 1/2, `expm1(x) − x`
/// beyond (where the subtraction loses at most ~3 bits). Always ≥ 0 for finite x.
#[inline]
pub(crate) fn expm1_minus_x<T: Real>(x: T) -> T {
    if x.abs() < T::HALF {
        let mut acc = T::ZERO;
        for &c in EXPM1_MINUS_X.iter().rev() {
            acc = acc * x + T::from_f64(c);
        }
        acc * x * x
    } else {
        x.exp_m1() - x
    }
}

impl Measure {
    /// Value and ∂/∂lp of the measure at the log-ratio `x = lp − old`, with the overflow guard
    /// of the [module docs](self) (gradient 0 where it acts).
    ///
    /// Source: k1/k2/k3 are Schulman's KL estimators as used by \[verl\]/\[OpenRLHF\]/\[TRL\]; the
    /// ρ-forms and χ² follow the unified clipping framework [2602.05494].
    ///
    /// # Example
    /// ```
    /// use grpo_core::divergence::Measure;
    /// // x = ln 2: ρ = 2, k3 = 2 − 1 − ln 2 = 0.30685…, ∂k3/∂lp = ρ − 1 = 1.
    /// let v = Measure::K3.eval(core::f64::consts::LN_2);
    /// assert!((v.value - (1.0 - core::f64::consts::LN_2)).abs() < 1e-15);
    /// assert!((v.grad - 1.0).abs() < 1e-15);
    /// // χ² at ρ = 2: (2 − 1)² = 1, gradient 2·(2 − 1)·2 = 4.
    /// let c = Measure::ChiSquared.eval(core::f64::consts::LN_2);
    /// assert!((c.value - 1.0).abs() < 1e-15 && (c.grad - 4.0).abs() < 1e-14);
    /// ```
    pub fn eval<T: Real>(self, x: T) -> ValueGrad<T> {
        self.eval_flagged(x).0
    }

    /// [`Measure::eval`] plus whether the overflow guard acted.
    pub(crate) fn eval_flagged<T: Real>(self, x: T) -> (ValueGrad<T>, bool) {
        match self {
            Measure::K1 | Measure::Abs => {
                // Limited to ±√T::MAX like k2 (an infinite x from an overflowed lp − old
                // included), so sums of values in diagnostics cannot overflow either.
                let (x, hit) = limit(x, poly_guard());
                let vg = if self == Measure::K1 {
                    ValueGrad {
                        value: -x,
                        grad: -T::ONE,
                    }
                } else {
                    // Subgradient 0 at x = 0 (what autograd of |x| gives, sign(0) = 0).
                    ValueGrad {
                        value: x.abs(),
                        grad: x.signum0(),
                    }
                };
                (zero_grad_if(vg, hit), hit)
            }
            Measure::K2 => {
                let (x, hit) = limit(x, poly_guard());
                let vg = ValueGrad {
                    value: x * x * T::HALF,
                    grad: x,
                };
                (zero_grad_if(vg, hit), hit)
            }
            Measure::Ratio | Measure::K3 | Measure::ChiSquared => {
                let (x, hit) = limit(x, exp_guard());
                let vg = match self {
                    Measure::Ratio => {
                        let r = x.exp();
                        ValueGrad { value: r, grad: r }
                    }
                    Measure::K3 => ValueGrad {
                        value: expm1_minus_x(x),
                        grad: x.exp_m1(),
                    },
                    _ => {
                        let h = x.exp_m1();
                        ValueGrad {
                            value: h * h,
                            grad: T::TWO * h * (h + T::ONE),
                        }
                    }
                };
                (zero_grad_if(vg, hit), hit)
            }
        }
    }

    /// The measure as a function of the ratio ρ > 0 (the right column of the
    /// [module table](self)); used to define clip bounds. `ρ − 1 − ln ρ` is evaluated without
    /// cancellation near ρ = 1.
    ///
    /// # Example
    /// ```
    /// use grpo_core::divergence::Measure;
    /// // ρ = 1.5: (1.5 − 1)² = 0.25 and 1.5 − 1 − ln 1.5 = 0.0945348918918356…
    /// assert_eq!(Measure::ChiSquared.of_ratio(1.5f64), 0.25);
    /// assert!((Measure::K3.of_ratio(1.5f64) - 0.0945348918918356).abs() < 1e-15);
    /// ```
    pub fn of_ratio<T: Real>(self, rho: T) -> T {
        match self {
            Measure::Ratio => rho,
            Measure::K1 => -rho.ln(),
            Measure::Abs => rho.ln().abs(),
            Measure::K2 => {
                let y = rho.ln();
                y * y * T::HALF
            }
            Measure::K3 => h_minus_ln1p_h(rho - T::ONE),
            Measure::ChiSquared => {
                let h = rho - T::ONE;
                h * h
            }
        }
    }
}

/// h − ln(1 + h) for h > −1 without cancellation near h = 0: with u = h/(2 + h),
/// ln(1 + h) = 2·atanh(u) = 2(u + u³/3 + u⁵/5 + …) and h − 2u = h·u, so
/// h − ln(1 + h) = h·u − 2(u³/3 + u⁵/5 + …) for |h| ≤ 1/2 (|u| ≤ 1/3: 20 terms reach 1e-20);
/// `h − ln_1p(h)` beyond.
pub(crate) fn h_minus_ln1p_h<T: Real>(h: T) -> T {
    if h.abs() <= T::HALF {
        let u = h / (T::TWO + h);
        let u2 = u * u;
        // Σ_{k≥1} u^{2k}/(2k+1), Horner from the smallest term.
        let mut acc = T::ZERO;
        let mut k = 20usize;
        while k >= 1 {
            acc = acc * u2 + T::ONE / T::from_usize(2 * k + 1);
            k -= 1;
        }
        h * u - T::TWO * u * u2 * acc
    } else {
        h - h.ln_1p()
    }
}

#[inline]
fn zero_grad_if<T: Real>(vg: ValueGrad<T>, hit: bool) -> ValueGrad<T> {
    if hit {
        ValueGrad {
            value: vg.value,
            grad: T::ZERO,
        }
    } else {
        vg
    }
}

/// What a token-level divergence or penalty pass reports besides its outputs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TokenDiagnostics<T> {
    /// Number of valid (written) tokens.
    pub tokens: usize,
    /// Valid tokens whose input (log-ratio) clamp or overflow guard was active.
    pub input_clamped: usize,
    /// Valid tokens whose output clamp was active.
    pub output_clamped: usize,
    /// Mean of the values over valid tokens (0 without valid tokens), accumulated as a running
    /// mean m ← m + (v − m)/k so that it cannot overflow.
    pub mean: T,
}

/// Settings of [`measure_tokens`].
///
/// Presets ([`MeasureConfig::from_preset`]): `Paper`, `Verl`, `VerlVectorized`, `OpenRlhf`
/// clamp the log-ratio to ±20 before anything else (verl `compute_policy_loss`, OpenRLHF
/// `PolicyLoss`: `clamp(log_ratio, -20, 20)`, MATH.md §0); `Trl` has no clamp (TRL computes
/// `exp(lp − old)` directly; our overflow guard still keeps the results finite).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasureConfig<T> {
    /// Which measure to compute. Default [`Measure::K3`].
    pub measure: Measure,
    /// Symmetric clamp c of `x` to `[−c, c]` before the measure (gradient 0 where active);
    /// `None` = no clamp. Default `Some(20)`. Must be finite and > 0.
    pub log_ratio_clamp: Option<T>,
}

impl<T: Real> Default for MeasureConfig<T> {
    fn default() -> Self {
        MeasureConfig {
            measure: Measure::K3,
            log_ratio_clamp: Some(T::from_f64(20.0)),
        }
    }
}

impl<T: Real> MeasureConfig<T> {
    /// The preset's log-ratio clamp (see the type's docs) for `measure`.
    ///
    /// # Example
    /// ```
    /// use grpo_core::Preset;
    /// use grpo_core::divergence::{Measure, measures::MeasureConfig};
    /// assert_eq!(MeasureConfig::<f32>::from_preset(Preset::Trl, Measure::K3).log_ratio_clamp, None);
    /// assert_eq!(MeasureConfig::<f32>::from_preset(Preset::Verl, Measure::K3).log_ratio_clamp, Some(20.0));
    /// ```
    pub fn from_preset(preset: crate::Preset, measure: Measure) -> Self {
        let log_ratio_clamp = match preset {
            crate::Preset::Trl => None,
            _ => Some(T::from_f64(20.0)),
        };
        MeasureConfig {
            measure,
            log_ratio_clamp,
        }
    }
}

/// Checks an optional symmetric clamp parameter: finite and > 0.
pub(crate) fn check_clamp<T: Real>(c: Option<T>, name: &'static str) -> Result<()> {
    match c {
        None => Ok(()),
        Some(c) => {
            crate::error::ensure(c > T::ZERO && c.is_finite(), name, "must be finite and > 0")
        }
    }
}

/// Validates per-token inputs of length `n` over `tokens`: the layout, every slice's length, and
/// finiteness at valid positions only (garbage in masked positions is allowed).
pub(crate) fn check_token_inputs<T: Real>(
    tokens: &Tokens<'_>,
    n: usize,
    inputs: &[(&'static str, &[T])],
    outputs: &[(&'static str, usize)],
) -> Result<()> {
    for &(what, s) in inputs {
        check_len(what, n, s.len())?;
    }
    for &(what, len) in outputs {
        check_len(what, n, len)?;
    }
    tokens.validate(n)?;
    for &(what, s) in inputs {
        if let Some(index) = tokens.first_non_finite(s) {
            return Err(crate::Error::NonFinite { what, index });
        }
    }
    Ok(())
}

/// Per-token divergence of `lp` from `old` ([`MeasureConfig::measure`] at `x = lp − old`, after
/// the optional log-ratio clamp), value and ∂/∂lp, over a [`Tokens`] layout.
///
/// Writes `value[t]`, `grad[t]` at every valid position and 0 at every other position (so the
/// outputs can be summed without a mask). Source: as [`Measure::eval`]; the clamp follows
/// \[verl\]/\[OpenRLHF\] (±20), gradient 0 where it is active (autograd of `clamp`).
///
/// # Errors
/// [`Error::LengthMismatch`](crate::Error::LengthMismatch) if a slice's length differs from
/// `lp.len()`, layout errors of [`Tokens::validate`], [`Error::NonFinite`](crate::Error::NonFinite)
/// for a NaN/±∞ `lp` or `old` at a valid position, [`Error::InvalidParam`](crate::Error::InvalidParam)
/// for a clamp that is not finite and > 0. On `Err` the outputs are untouched.
///
/// # Example
/// ```
/// use grpo_core::Tokens;
/// use grpo_core::divergence::{Measure, measures::{measure_tokens, MeasureConfig}};
/// let lp = [-1.0f64, -2.0, f64::NAN];
/// let old = [-1.5f64, -2.0, 0.0];
/// let mask = [true, true, false];
/// let cfg = MeasureConfig { measure: Measure::K2, log_ratio_clamp: Some(20.0) };
/// let (mut v, mut g) = ([9.0; 3], [9.0; 3]);
/// let d = measure_tokens(&cfg, &lp, &old, &Tokens::padded(1, 3, Some(&mask)), &mut v, &mut g).unwrap();
/// // x = 0.5 → k2 = 0.125, ∂/∂lp = 0.5; x = 0 → 0, 0; the masked slot is zeroed.
/// assert_eq!(v, [0.125, 0.0, 0.0]);
/// assert_eq!(g, [0.5, 0.0, 0.0]);
/// assert_eq!(d.tokens, 2);
/// assert_eq!(d.mean, 0.0625); // (0.125 + 0) / 2
/// ```
pub fn measure_tokens<T: Real>(
    cfg: &MeasureConfig<T>,
    lp: &[T],
    old: &[T],
    tokens: &Tokens<'_>,
    value: &mut [T],
    grad: &mut [T],
) -> Result<TokenDiagnostics<T>> {
    check_clamp(cfg.log_ratio_clamp, "log_ratio_clamp")?;
    let n = lp.len();
    check_token_inputs(
        tokens,
        n,
        &[("lp", lp), ("old", old)],
        &[("value", value.len()), ("grad", grad.len())],
    )?;
    value.fill(T::ZERO);
    grad.fill(T::ZERO);
    let mut diag = TokenDiagnostics::default();
    for s in 0..tokens.num_sequences() {
        for t in tokens.valid_positions(s) {
            let (x, clamped) = match cfg.log_ratio_clamp {
                Some(c) => limit(lp[t] - old[t], c),
                None => (lp[t] - old[t], false),
            };
            let (vg, guarded) = cfg.measure.eval_flagged(x);
            value[t] = vg.value;
            grad[t] = if clamped { T::ZERO } else { vg.grad };
            diag.tokens += 1;
            diag.input_clamped += usize::from(clamped || guarded);
            diag.mean += (vg.value - diag.mean) / T::from_usize(diag.tokens);
        }
    }
    Ok(diag)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn k3_series_matches_naive_away_from_zero_and_is_accurate_near_it() {
        // At x = 1e-8: e^x − 1 − x = x²/2 + x³/6 = 5e-17 + 1.67e-25.
        let v = expm1_minus_x(1e-8f64);
        assert!((v - 5.0000000166666667e-17).abs() < 1e-31);
        // At x = 0.49 both branches should agree with the naive form to ~1e-16 absolute.
        for x in [0.49f64, -0.49, 0.3, -0.1] {
            let naive = x.exp() - 1.0 - x;
            assert!((expm1_minus_x(x) - naive).abs() < 1e-16, "{x}");
        }
    }

    #[test]
    fn h_minus_ln1p_h_is_accurate() {
        // h = 1e-4: h²/2 − h³/3 + h⁴/4 − h⁵/5 = 5e-9 − 3.333…e-13 + 2.5e-17 − 2e-21 (next term
        // 1.7e-25 is below the half ULP of 5e-9, 4e-25).
        let h = 1e-4f64;
        let expect = 5e-9 - 1e-12 / 3.0 + 2.5e-17 - 2e-21;
        assert!((h_minus_ln1p_h(h) - expect).abs() < 2e-15 * expect);
        for h in [0.5f64, -0.5, 0.25, 2.0, -0.9] {
            let naive = h - (1.0 + h).ln();
            assert!((h_minus_ln1p_h(h) - naive).abs() < 1e-15, "{h}");
        }
    }

    #[test]
    fn measures_at_zero_are_zero_except_ratio() {
        for m in [
            Measure::K1,
            Measure::Abs,
            Measure::K2,
            Measure::K3,
            Measure::ChiSquared,
        ] {
            let v = m.eval(0.0f64);
            assert_eq!(v.value, 0.0, "{m:?}");
        }
        assert_eq!(Measure::Ratio.eval(0.0f64).value, 1.0);
        assert_eq!(Measure::K1.eval(0.0f64).grad, -1.0);
        assert_eq!(Measure::Abs.eval(0.0f64).grad, 0.0);
    }

    #[test]
    fn guard_keeps_everything_finite() {
        for x in [1000.0f32, -1000.0, f32::INFINITY, f32::NEG_INFINITY, 3e38] {
            for m in [
                Measure::Ratio,
                Measure::K1,
                Measure::Abs,
                Measure::K2,
                Measure::K3,
                Measure::ChiSquared,
            ] {
                let v = m.eval(x);
                assert!(v.value.is_finite() && v.grad.is_finite(), "{m:?} {x}");
            }
        }
        // Beyond the guard the gradient is 0, like a clamp.
        assert_eq!(Measure::K3.eval(1000.0f64).grad, 0.0);
    }

    #[test]
    fn tokens_errors_leave_outputs_untouched() {
        let lp = [0.0f64, 1.0];
        let old = [0.0f64, f64::NAN];
        let (mut v, mut g) = ([7.0; 2], [7.0; 2]);
        let cfg = MeasureConfig::default();
        let t = Tokens::padded(1, 2, None);
        assert_eq!(
            measure_tokens(&cfg, &lp, &old, &t, &mut v, &mut g),
            Err(Error::NonFinite {
                what: "old",
                index: 1
            })
        );
        assert_eq!(
            measure_tokens(&cfg, &lp, &old[..1], &t, &mut v, &mut g),
            Err(Error::LengthMismatch {
                what: "old",
                expected: 2,
                found: 1
            })
        );
        let bad = MeasureConfig {
            log_ratio_clamp: Some(0.0),
            ..cfg
        };
        assert!(matches!(
            measure_tokens(&bad, &lp, &[0.0, 0.0], &t, &mut v, &mut g),
            Err(Error::InvalidParam { .. })
        ));
        assert_eq!((v, g), ([7.0; 2], [7.0; 2]));
    }

    #[test]
    fn clamp_zeroes_the_gradient() {
        // x = 30 clamped to 20: k3 = e^20 − 21, gradient 0.
        let cfg = MeasureConfig::<f64>::default();
        let (mut v, mut g) = ([0.0; 1], [1.0; 1]);
        let d = measure_tokens(
            &cfg,
            &[30.0],
            &[0.0],
            &Tokens::padded(1, 1, None),
            &mut v,
            &mut g,
        )
        .unwrap();
        assert!((v[0] - (20f64.exp() - 21.0)).abs() < 1e-6);
        assert_eq!(g[0], 0.0);
        assert_eq!(d.input_clamped, 1);
    }
}
