//! KL-to-reference penalty estimators (MATH.md §3): per-token value and exact ∂/∂lp of an
//! estimate of KL(π_θ‖π_ref) from the sampled token's log-probs, `d = lp − ref`.
//!
//! | [`KlEstimator`] | value | ∂/∂lp |
//! |---|---|---|
//! | `K1` | d | 1 |
//! | `Abs` | \|d\| | sgn d (0 at d = 0) |
//! | `K2` | d²/2 | d |
//! | `K3` | e^{−d} + d − 1 | 1 − e^{−d} |
//! | `K3Is` | k3·ρ, ρ = e^{lp − old} | ρ·(1 − e^{−d} + k3) = ρ·d |
//! | `K1StraightThrough` (`k1+`) | d | d |
//! | `K3StraightThrough` (`k3+`) | e^{−d} + d − 1 | d |
//!
//! Sources: k1/k2/k3 are Schulman's estimators ("Approximating KL divergence", 2020) as used by
//! \[verl\] (`kl_penalty`: `kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`), \[OpenRLHF\]
//! (`compute_approx_kl`) and \[TRL\] (k3, `beta`). `K3Is` is TRL's `use_bias_correction_kl`: the k3
//! term multiplied by the (token-level) importance ratio ρ = π_θ/π_old, with the gradient
//! flowing through ρ as well (TRL does not detach it). The straight-through forms `k1+`/`k3+`
//! report the estimator's value but train with the gradient of k2 — the unbiased-gradient
//! construction `k2 − sg(k2) + sg(k)`. verl (b178a3cd) accepts the names but raises at run time;
//! we offer the documented behaviour instead (MATH.md §6).
//!
//! **Clamps** ([`KlPenaltyConfig`]): an *input clamp* limits d to [−c, c] before the estimator
//! (verl's k3: ±20, which keeps e^{−d} finite) and an *output clamp* limits the value to
//! [−c, c] (verl's k3: ±10; OpenRLHF: every estimator ±10). Where a clamp is active the
//! gradient is 0 — what autograd of `clamp` gives — except for the straight-through forms,
//! whose gradient comes from the separate, unclamped k2 term (clamps there act on the reported
//! value only, as in `k2 − sg(k2) + sg(clamp(k))`). `K3Is` applies the input clamp to both
//! d and lp − old.
//!
//! **Overflow guard.** Without an input clamp (TRL), d (and lp − old) is still limited to
//! ±[`exp_guard`] (43.36 in f32, 353.9 in f64) for the exponential estimators and to ±√T::MAX
//! for the polynomial ones, gradient 0 where that acts: beyond it TRL's value is ≥ 5e18 or
//! `inf`, and ours stays finite.

use super::measures::{
    TokenDiagnostics, ValueGrad, check_clamp, check_token_inputs, exp_guard, expm1_minus_x, limit,
    poly_guard,
};
use crate::error::{Error, Result};
use crate::layout::Tokens;
use crate::presets::Preset;
use crate::real::Real;

/// Which KL-to-reference estimator (see the [module table](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum KlEstimator {
    /// k1 = d (verl `kl`/`k1`, OpenRLHF `k1`).
    K1,
    /// |d| (verl `abs`).
    Abs,
    /// k2 = d²/2 (verl `mse`/`k2`, OpenRLHF `k2`).
    K2,
    /// k3 = e^{−d} + d − 1 (verl `low_var_kl`/`k3`, OpenRLHF `k3`, TRL). Default.
    #[default]
    K3,
    /// k3·ρ with ρ = e^{lp − old}, gradient through ρ too (TRL `use_bias_correction_kl`).
    /// Needs `old`.
    K3Is,
    /// `k1+`: value of k1, gradient of k2 (straight-through).
    K1StraightThrough,
    /// `k3+`: value of k3, gradient of k2 (straight-through).
    K3StraightThrough,
}

impl KlEstimator {
    fn uses_exp(self) -> bool {
        matches!(
            self,
            KlEstimator::K3 | KlEstimator::K3Is | KlEstimator::K3StraightThrough
        )
    }
    fn straight_through(self) -> bool {
        matches!(
            self,
            KlEstimator::K1StraightThrough | KlEstimator::K3StraightThrough
        )
    }
}

/// Settings of [`kl_penalty`]: the estimator and its clamps.
///
/// Presets ([`KlPenaltyConfig::from_preset`]):
///
/// | preset | input clamp of d | output clamp |
/// |---|---|---|
/// | `Paper` (default) | ±20 for k3-family estimators (MATH.md §0: clamp before any exp), none otherwise | none |
/// | `Verl`, `VerlVectorized` | ±20 for k3-family estimators, none otherwise | ±10 for k3-family, none otherwise |
/// | `OpenRlhf` | none | ±10 for every estimator (k1 included) |
/// | `Trl` | none | none |
///
/// (verl b178a3cd `kl_penalty_forward`: only `low_var_kl` clamps; OpenRLHF 3c3be62
/// `compute_approx_kl`: `clamp(-10, 10)` after every estimator, computed in f32; TRL f2cd577:
/// plain k3.) "k3-family" = `K3`, `K3Is`, `K3StraightThrough`: the estimators that take an
/// `exp`. The others (k1, abs, k2 and k1+) have no exponential to protect, and a clamp would
/// only stop their gradient beyond ±20, so `Paper` leaves them unclamped, as every peer does
/// (the overflow guard of the [module docs](self) still applies).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlPenaltyConfig<T> {
    /// The estimator.
    pub estimator: KlEstimator,
    /// Clamp c of d = lp − ref to [−c, c] before the estimator; `None` = none. Finite, > 0.
    pub input_clamp: Option<T>,
    /// Clamp c of the value to [−c, c]; `None` = none. Finite, > 0.
    pub output_clamp: Option<T>,
}

impl<T: Real> Default for KlPenaltyConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper, KlEstimator::K3)
    }
}

impl<T: Real> KlPenaltyConfig<T> {
    /// The preset's clamps for `estimator` (table on the type).
    ///
    /// # Example
    /// ```
    /// use grpo_core::Preset;
    /// use grpo_core::divergence::{KlEstimator, KlPenaltyConfig};
    /// let v = KlPenaltyConfig::<f32>::from_preset(Preset::Verl, KlEstimator::K3);
    /// assert_eq!((v.input_clamp, v.output_clamp), (Some(20.0), Some(10.0)));
    /// let o = KlPenaltyConfig::<f32>::from_preset(Preset::OpenRlhf, KlEstimator::K1);
    /// assert_eq!((o.input_clamp, o.output_clamp), (None, Some(10.0)));
    /// let t = KlPenaltyConfig::<f32>::from_preset(Preset::Trl, KlEstimator::K3);
    /// assert_eq!((t.input_clamp, t.output_clamp), (None, None));
    /// ```
    pub fn from_preset(preset: Preset, estimator: KlEstimator) -> Self {
        let twenty = Some(T::from_f64(20.0));
        let ten = Some(T::from_f64(10.0));
        let (input_clamp, output_clamp) = match preset {
            Preset::Verl | Preset::VerlVectorized if estimator.uses_exp() => (twenty, ten),
            Preset::Verl | Preset::VerlVectorized => (None, None),
            Preset::OpenRlhf => (None, ten),
            Preset::Trl => (None, None),
            Preset::Paper if estimator.uses_exp() => (twenty, None),
            Preset::Paper => (None, None),
        };
        KlPenaltyConfig {
            estimator,
            input_clamp,
            output_clamp,
        }
    }

    fn validate(&self) -> Result<()> {
        check_clamp(self.input_clamp, "input_clamp")?;
        check_clamp(self.output_clamp, "output_clamp")
    }

    /// Value and ∂/∂lp of the penalty for one token (`old` is read only by
    /// [`KlEstimator::K3Is`]). Assumes a config with valid clamps (finite, > 0; an invalid one
    /// is treated as absent) and finite inputs.
    ///
    /// # Example
    /// ```
    /// use grpo_core::Preset;
    /// use grpo_core::divergence::{KlEstimator, KlPenaltyConfig};
    /// // d = lp − ref = −1: k3 = e¹ − 1 − 1 = 0.71828…, ∂/∂lp = 1 − e¹ = −1.71828…
    /// let cfg = KlPenaltyConfig::<f64>::from_preset(Preset::Trl, KlEstimator::K3);
    /// let v = cfg.eval(-2.0, -1.0, 0.0);
    /// assert!((v.value - (core::f64::consts::E - 2.0)).abs() < 1e-15);
    /// assert!((v.grad - (1.0 - core::f64::consts::E)).abs() < 1e-15);
    /// ```
    pub fn eval(&self, lp: T, reference: T, old: T) -> ValueGrad<T> {
        self.eval_flagged(lp - reference, lp - old).0
    }

    /// Value, gradient, input-limited flag, output-clamped flag, at d = lp − ref, x = lp − old.
    fn eval_flagged(&self, d_raw: T, x_raw: T) -> (ValueGrad<T>, bool, bool) {
        let est = self.estimator;
        let valid_clamp = |c: Option<T>| c.filter(|c| *c > T::ZERO && c.is_finite());
        let input_clamp = valid_clamp(self.input_clamp);
        let guard = if est.uses_exp() {
            exp_guard()
        } else {
            poly_guard()
        };
        let lim = match input_clamp {
            Some(c) => c.min(guard),
            None => guard,
        };
        let (d, d_hit) = limit(d_raw, lim);
        let (mut vg, in_hit) = match est {
            KlEstimator::K1 => (
                ValueGrad {
                    value: d,
                    grad: T::ONE,
                },
                d_hit,
            ),
            KlEstimator::Abs => (
                ValueGrad {
                    value: d.abs(),
                    grad: d.signum0(),
                },
                d_hit,
            ),
            KlEstimator::K2 | KlEstimator::K1StraightThrough => (
                ValueGrad {
                    value: if est == KlEstimator::K2 {
                        d * d * T::HALF
                    } else {
                        d
                    },
                    grad: d,
                },
                d_hit,
            ),
            KlEstimator::K3 | KlEstimator::K3StraightThrough => (
                ValueGrad {
                    value: expm1_minus_x(-d),
                    grad: -(-d).exp_m1(),
                },
                d_hit,
            ),
            KlEstimator::K3Is => {
                let (x, x_hit) = limit(x_raw, lim);
                let k3 = expm1_minus_x(-d);
                let rho = x.exp();
                // ∂(k3·ρ)/∂lp = ρ·(∂k3 + k3), each term 0 where its own input was limited.
                // Unlimited, ∂k3 + k3 = (1 − e^{−d}) + (e^{−d} + d − 1) = d exactly: computing
                // the sum instead loses every bit to cancellation once e^{−d} ≫ |d| (in f32 the
                // gradient is 60% off at d = −20 and exactly 0 at d = −30).
                let grad = match (d_hit, x_hit) {
                    (false, false) => rho * d,
                    (false, true) => rho * -(-d).exp_m1(),
                    (true, false) => rho * k3,
                    (true, true) => T::ZERO,
                };
                (
                    ValueGrad {
                        value: k3 * rho,
                        grad,
                    },
                    d_hit || x_hit,
                )
            }
        };
        if est.straight_through() {
            // Gradient of the separate k2 term: d itself, unclamped (only the guard limits it).
            let (g, _) = limit(d_raw, poly_guard());
            vg.grad = g;
        } else if in_hit && est != KlEstimator::K3Is {
            vg.grad = T::ZERO;
        }
        let mut out_hit = false;
        if let Some(c) = valid_clamp(self.output_clamp) {
            let (v, hit) = limit(vg.value, c);
            out_hit = hit;
            vg.value = v;
            if hit && !est.straight_through() {
                vg.grad = T::ZERO;
            }
        }
        (vg, in_hit, out_hit)
    }
}

/// Per-token KL-to-reference penalty, value and ∂/∂lp, over a [`Tokens`] layout (formulas,
/// sources and clamp semantics in the [module docs](self)).
///
/// `old` (π_old log-probs) is required by [`KlEstimator::K3Is`] and ignored by the others
/// (its length is still checked when given). Writes every valid position and 0 at every other
/// position.
///
/// # Errors
/// [`Error::LengthMismatch`] when a slice's length differs from `lp.len()`; layout errors of
/// [`Tokens::validate`]; [`Error::NonFinite`] for NaN/±∞ `lp`, `reference` (or `old` with
/// `K3Is`) at a valid position; [`Error::InvalidParam`] for a clamp that is not finite and > 0,
/// or `old` missing with `K3Is`. On `Err` the outputs are untouched.
///
/// # Example
/// ```
/// use grpo_core::{Preset, Tokens};
/// use grpo_core::divergence::{KlEstimator, KlPenaltyConfig, kl_penalty::kl_penalty};
/// // verl k3 at d = lp − ref = −30: input clamp → d = −20, e^20 − 20 − 1 ≈ 4.85e8, output
/// // clamp → 10, gradient 0. At d = 0.5: e^{−0.5} + 0.5 − 1 = 0.10653…, ∂ = 1 − e^{−0.5}.
/// let cfg = KlPenaltyConfig::<f64>::from_preset(Preset::Verl, KlEstimator::K3);
/// let lp = [-31.0, -1.0];
/// let reference = [-1.0, -1.5];
/// let (mut v, mut g) = ([0.0; 2], [0.0; 2]);
/// let d = kl_penalty(&cfg, &lp, &reference, None, &Tokens::padded(1, 2, None), &mut v, &mut g).unwrap();
/// assert_eq!((v[0], g[0]), (10.0, 0.0));
/// assert!((v[1] - ((-0.5f64).exp() - 0.5)).abs() < 1e-15);
/// assert!((g[1] - (1.0 - (-0.5f64).exp())).abs() < 1e-15);
/// assert_eq!((d.input_clamped, d.output_clamped), (1, 1));
/// ```
pub fn kl_penalty<T: Real>(
    cfg: &KlPenaltyConfig<T>,
    lp: &[T],
    reference: &[T],
    old: Option<&[T]>,
    tokens: &Tokens<'_>,
    value: &mut [T],
    grad: &mut [T],
) -> Result<TokenDiagnostics<T>> {
    cfg.validate()?;
    let n = lp.len();
    let outputs = [("value", value.len()), ("grad", grad.len())];
    match (cfg.estimator, old) {
        (KlEstimator::K3Is, None) => {
            return Err(Error::InvalidParam {
                name: "old",
                reason: "the importance-corrected k3 (K3Is) needs the old log-probs",
            });
        }
        (KlEstimator::K3Is, Some(old)) => check_token_inputs(
            tokens,
            n,
            &[("lp", lp), ("reference", reference), ("old", old)],
            &outputs,
        )?,
        (_, Some(old)) => {
            crate::error::check_len("old", n, old.len())?;
            check_token_inputs(tokens, n, &[("lp", lp), ("reference", reference)], &outputs)?
        }
        (_, None) => {
            check_token_inputs(tokens, n, &[("lp", lp), ("reference", reference)], &outputs)?
        }
    }
    value.fill(T::ZERO);
    grad.fill(T::ZERO);
    let mut diag = TokenDiagnostics::default();
    for s in 0..tokens.num_sequences() {
        for t in tokens.valid_positions(s) {
            let x = match (cfg.estimator, old) {
                (KlEstimator::K3Is, Some(old)) => lp[t] - old[t],
                _ => T::ZERO,
            };
            let (vg, in_hit, out_hit) = cfg.eval_flagged(lp[t] - reference[t], x);
            value[t] = vg.value;
            grad[t] = vg.grad;
            diag.tokens += 1;
            diag.input_clamped += usize::from(in_hit);
            diag.output_clamped += usize::from(out_hit);
            diag.mean += (vg.value - diag.mean) / T::from_usize(diag.tokens);
        }
    }
    Ok(diag)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(p: Preset, e: KlEstimator) -> KlPenaltyConfig<f64> {
        KlPenaltyConfig::from_preset(p, e)
    }

    #[test]
    fn preset_differences_hand_computed() {
        // d = −20 (lp − ref): verl k3 = e^{20} − 20 − 1 = 485165174.4 → output clamp 10, grad 0.
        let v = cfg(Preset::Verl, KlEstimator::K3).eval(-20.0, 0.0, 0.0);
        assert_eq!((v.value, v.grad), (10.0, 0.0));
        // TRL: unclamped, value e^{20} − 21, gradient 1 − e^{20}.
        let t = cfg(Preset::Trl, KlEstimator::K3).eval(-20.0, 0.0, 0.0);
        assert!((t.value - (20f64.exp() - 21.0)).abs() < 1e-6);
        assert!((t.grad - (1.0 - 20f64.exp())).abs() < 1e-6);
        // OpenRLHF k1 at d = 12: clamped to 10, grad 0; at d = −3: −3, grad 1.
        let o = cfg(Preset::OpenRlhf, KlEstimator::K1);
        assert_eq!(
            o.eval(12.0, 0.0, 0.0),
            ValueGrad {
                value: 10.0,
                grad: 0.0
            }
        );
        assert_eq!(
            o.eval(-3.0, 0.0, 0.0),
            ValueGrad {
                value: -3.0,
                grad: 1.0
            }
        );
        // verl k1 is unclamped: d = 12 → 12, grad 1.
        assert_eq!(
            cfg(Preset::Verl, KlEstimator::K1).eval(12.0, 0.0, 0.0),
            ValueGrad {
                value: 12.0,
                grad: 1.0
            }
        );
        // OpenRLHF k2 at d = 5: 12.5 → 10, grad 0.
        assert_eq!(
            cfg(Preset::OpenRlhf, KlEstimator::K2).eval(5.0, 0.0, 0.0),
            ValueGrad {
                value: 10.0,
                grad: 0.0
            }
        );
    }

    #[test]
    fn the_default_clamps_only_the_estimators_that_take_an_exp() {
        // d = −25, past the ±20 clamp: the estimators without an exponential keep their value
        // and gradient (k1: −25, 1; |d|: 25, −1; k2: 312.5, −25; k1+: −25, −25).
        let d = -25.0;
        let want = [
            (KlEstimator::K1, d, 1.0),
            (KlEstimator::Abs, 25.0, -1.0),
            (KlEstimator::K2, 312.5, d),
            (KlEstimator::K1StraightThrough, d, d),
        ];
        for (e, value, grad) in want {
            let c = KlPenaltyConfig::<f64>::from_preset(Preset::Paper, e);
            assert_eq!((c.input_clamp, c.output_clamp), (None, None), "{e:?}");
            assert_eq!(c.eval(d, 0.0, 0.0), ValueGrad { value, grad }, "{e:?}");
        }
        // k3 keeps the clamp: e^{20} − 21 at d = −25, no gradient through the clamp.
        let k3 = KlPenaltyConfig::<f64>::default();
        assert_eq!(k3.input_clamp, Some(20.0));
        let v = k3.eval(d, 0.0, 0.0);
        assert!(
            (v.value - (20f64.exp() - 21.0)).abs() < 1e-6 && v.grad == 0.0,
            "{v:?}"
        );
    }

    #[test]
    fn straight_through_reports_the_estimator_trains_k2() {
        // d = 0.3: k3 = e^{−0.3} + 0.3 − 1 = 0.040818…, gradient d = 0.3.
        let v = cfg(Preset::Trl, KlEstimator::K3StraightThrough).eval(0.3, 0.0, 0.0);
        assert!((v.value - ((-0.3f64).exp() - 0.7)).abs() < 1e-16);
        assert_eq!(v.grad, 0.3);
        // verl k3+ at d = −25: value clamped to 10, gradient still d = −25.
        let c = cfg(Preset::Verl, KlEstimator::K3StraightThrough).eval(-25.0, 0.0, 0.0);
        assert_eq!((c.value, c.grad), (10.0, -25.0));
        let k1 = cfg(Preset::Trl, KlEstimator::K1StraightThrough).eval(-0.7, 0.0, 0.0);
        assert_eq!((k1.value, k1.grad), (-0.7, -0.7));
    }

    /// The K3Is gradient in f32 against f64 where ∂k3 + k3 would cancel: d = −20 and −30 with
    /// ρ = e^{0.5}, no clamps. The exact gradient is ρ·d.
    #[test]
    fn importance_corrected_k3_gradient_keeps_its_bits_for_large_negative_d() {
        fn unclamped<T: Real>() -> KlPenaltyConfig<T> {
            KlPenaltyConfig {
                estimator: KlEstimator::K3Is,
                input_clamp: None,
                output_clamp: None,
            }
        }
        for d in [-20.0f32, -30.0, -43.0, 0.25, 40.0] {
            let g32 = unclamped::<f32>().eval(d, 0.0, d - 0.5).grad;
            let g64 = unclamped::<f64>().eval(d as f64, 0.0, d as f64 - 0.5).grad;
            let want = 0.5f64.exp() * d as f64;
            assert!((g64 - want).abs() <= 1e-14 * want.abs(), "{d}: {g64}");
            let rel = (g32 as f64 - want).abs() / want.abs();
            assert!(
                rel < 3e-7,
                "d = {d}: f32 gradient {g32}, exact {want} (rel {rel:e})"
            );
        }
    }

    #[test]
    fn importance_corrected_k3() {
        // d = 0.5, x = lp − old = ln 2: ρ = 2, k3 = e^{−0.5} − 0.5 = 0.106530…,
        // value 2·k3, gradient 2·(1 − e^{−0.5} + k3) = 2·(0.5) = 1 exactly (the e^{−0.5} cancel).
        let c = cfg(Preset::Trl, KlEstimator::K3Is);
        let ln2 = core::f64::consts::LN_2;
        let v = c.eval(0.0, -0.5, -ln2);
        assert!((v.value - 2.0 * ((-0.5f64).exp() - 0.5)).abs() < 1e-15);
        assert!((v.grad - 1.0).abs() < 1e-15);
        let mut out = [5.0f64; 1];
        let mut g = [5.0f64; 1];
        assert_eq!(
            kl_penalty(
                &c,
                &[0.0],
                &[0.0],
                None,
                &Tokens::padded(1, 1, None),
                &mut out,
                &mut g
            ),
            Err(Error::InvalidParam {
                name: "old",
                reason: "the importance-corrected k3 (K3Is) needs the old log-probs"
            })
        );
        assert_eq!((out, g), ([5.0], [5.0]));
    }

    #[test]
    fn k3_is_nonnegative_and_extremes_are_finite() {
        for p in [Preset::Trl, Preset::Verl, Preset::OpenRlhf, Preset::Paper] {
            for e in [
                KlEstimator::K1,
                KlEstimator::Abs,
                KlEstimator::K2,
                KlEstimator::K3,
                KlEstimator::K3Is,
                KlEstimator::K1StraightThrough,
                KlEstimator::K3StraightThrough,
            ] {
                for (lp, r, o) in [
                    (-1000.0f32, 0.0, 0.0),
                    (0.0, -1000.0, 1000.0),
                    (3e38, -3e38, 0.0),
                ] {
                    let v = KlPenaltyConfig::<f32>::from_preset(p, e).eval(lp, r, o);
                    assert!(
                        v.value.is_finite() && v.grad.is_finite(),
                        "{p:?} {e:?} {lp}"
                    );
                }
            }
            for d in [-5.0f64, -1e-9, 0.0, 1e-9, 7.0] {
                assert!(cfg(p, KlEstimator::K3).eval(d, 0.0, 0.0).value >= 0.0);
            }
        }
    }
}
