//! Coefficient controllers updated once per training step: the adaptive KL-penalty
//! coefficient and two adaptive entropy-bonus coefficients (TRL's fixed-step rule and our
//! proportional one).

use crate::error::{Result, ensure};
use crate::real::Real;

/// Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
/// Preferences", arXiv 1909.08593) as in \[verl\] `AdaptiveKLController` and \[OpenRLHF\]
/// `AdaptiveKLController`:
///
/// e = clip(KL/target − 1, −0.2, 0.2),  β ← β·(1 + e·n_steps/horizon).
///
/// `Default`: β₀ = 0.001, target 0.1, horizon 10000 (verl's `algorithm.kl_ctrl` defaults).
///
/// # Example
/// ```
/// use grpo_core::control::AdaptiveKlController;
/// let mut c = AdaptiveKlController::new(0.1f64, 0.05, 1000.0).unwrap();
/// // KL = 0.06: e = 0.06/0.05 − 1 = 0.2; β = 0.1·(1 + 0.2·256/1000) = 0.10512.
/// let b = c.update(0.06, 256).unwrap();
/// assert!((b - 0.10512).abs() < 1e-15);
/// // KL = 1.0: e clipped to 0.2 again; KL = 0: e = −1 → −0.2.
/// let b = c.update(0.0, 1000).unwrap();
/// assert!((b - 0.10512 * 0.8).abs() < 1e-15);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveKlController<T> {
    /// Current coefficient β.
    pub value: T,
    /// Target KL.
    pub target: T,
    /// Horizon (in samples/steps, the unit of `n_steps`).
    pub horizon: T,
}

impl<T: Real> Default for AdaptiveKlController<T> {
    fn default() -> Self {
        AdaptiveKlController {
            value: T::from_f64(0.001),
            target: T::from_f64(0.1),
            horizon: T::from_f64(10000.0),
        }
    }
}

impl<T: Real> AdaptiveKlController<T> {
    /// A validated controller.
    ///
    /// # Errors
    /// [`Error::InvalidParam`](crate::Error::InvalidParam) unless `init` is finite and ≥ 0 and
    /// `target`, `horizon` are finite and > 0.
    pub fn new(init: T, target: T, horizon: T) -> Result<Self> {
        let c = AdaptiveKlController {
            value: init,
            target,
            horizon,
        };
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        ensure(
            self.value >= T::ZERO && self.value.is_finite(),
            "init_kl_coef",
            "must be finite and >= 0",
        )?;
        ensure(
            self.target > T::ZERO && self.target.is_finite(),
            "target_kl",
            "must be finite and > 0",
        )?;
        ensure(
            self.horizon > T::ZERO && self.horizon.is_finite(),
            "horizon",
            "must be finite and > 0",
        )
    }

    /// One update with the measured `current_kl` over `n_steps` steps; returns the new β.
    ///
    /// # Errors
    /// [`Error::NonFinite`](crate::Error::NonFinite) for a NaN/±∞ KL or a β that would
    /// overflow (`what = "kl coefficient"`: `n_steps/horizon` beyond `T::MAX`), or the
    /// validation errors of [`AdaptiveKlController::new`] if the fields were set to invalid
    /// values; the state is unchanged on `Err`.
    pub fn update(&mut self, current_kl: T, n_steps: usize) -> Result<T> {
        self.validate()?;
        if !current_kl.is_finite() {
            return Err(crate::Error::NonFinite {
                what: "current_kl",
                index: 0,
            });
        }
        let lim = T::from_f64(0.2);
        let err = (current_kl / self.target - T::ONE).clamp(-lim, lim);
        let mult = T::ONE + err * T::from_usize(n_steps) / self.horizon;
        // With n_steps > horizon/0.2 the factor would turn negative: keep β ≥ 0.
        let value = (self.value * mult).max(T::ZERO);
        // n_steps/horizon past T::MAX (a tiny horizon) overflows the factor.
        if !value.is_finite() {
            return Err(crate::Error::NonFinite {
                what: "kl coefficient",
                index: 0,
            });
        }
        self.value = value;
        Ok(self.value)
    }
}

/// Adaptive entropy-bonus coefficient, **our definition** (a projected dual-ascent step on
/// the constraint H ≥ H_target):
///
/// c ← clamp(c + lr·(H_target − H), c_min, c_max)
///
/// so the bonus grows while the measured mean token entropy H is below the target and decays
/// above it, in proportion to the gap. TRL's own rule (a fixed step and a gated bonus) is
/// [`TrlEntropyController`].
///
/// `Default`: c = 0, target 0.2 nats, lr 1e-3, range [0, 0.01] (ours, conservative).
///
/// # Example
/// ```
/// use grpo_core::control::AdaptiveEntropyController;
/// let mut c = AdaptiveEntropyController { coef: 0.001f64, target: 0.5, lr: 0.01, min: 0.0, max: 0.01 };
/// // H = 0.3 below target: c = 0.001 + 0.01·0.2 = 0.003.
/// assert!((c.update(0.3).unwrap() - 0.003).abs() < 1e-15);
/// // H = 2.5 far above: c = 0.003 − 0.02 → clamped to 0.
/// assert_eq!(c.update(2.5).unwrap(), 0.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveEntropyController<T> {
    /// Current coefficient c (default 0).
    pub coef: T,
    /// Target mean token entropy H_target in nats (default 0.2).
    pub target: T,
    /// Step size (default 1e-3).
    pub lr: T,
    /// Lower clamp c_min (default 0).
    pub min: T,
    /// Upper clamp c_max (default 0.01).
    pub max: T,
}

impl<T: Real> Default for AdaptiveEntropyController<T> {
    fn default() -> Self {
        AdaptiveEntropyController {
            coef: T::ZERO,
            target: T::from_f64(0.2),
            lr: T::from_f64(1e-3),
            min: T::ZERO,
            max: T::from_f64(0.01),
        }
    }
}

impl<T: Real> AdaptiveEntropyController<T> {
    /// One update with the measured mean entropy; returns the new coefficient.
    ///
    /// # Errors
    /// [`Error::InvalidParam`](crate::Error::InvalidParam) unless `lr` ≥ 0, `target` ≥ 0,
    /// `min ≤ max` and all fields are finite; [`Error::NonFinite`](crate::Error::NonFinite) for
    /// a NaN/±∞ entropy, or for a step that is not a number (`what = "entropy coefficient"`:
    /// `lr = 0` times an overflowing `target − H`). The state is unchanged on `Err`.
    pub fn update(&mut self, entropy: T) -> Result<T> {
        ensure(
            self.lr >= T::ZERO && self.lr.is_finite(),
            "lr",
            "must be finite and >= 0",
        )?;
        ensure(
            self.target >= T::ZERO && self.target.is_finite(),
            "target",
            "must be finite and >= 0",
        )?;
        check_entropy_step(self.coef, self.min, self.max, entropy)?;
        // lr = 0 times an overflowing target − H is NaN, which the clamp (max/min, which
        // return their other argument for NaN) would turn into `min`: refused before it. An
        // infinite step (lr > 0) saturates at the range's end.
        let step = self.coef + self.lr * (self.target - entropy);
        if step.is_nan() {
            return Err(crate::Error::NonFinite {
                what: "entropy coefficient",
                index: 0,
            });
        }
        self.coef = step.clamp(self.min, self.max);
        Ok(self.coef)
    }
}

/// The checks both entropy controllers make before a step: a finite range `min ≤ max`, a
/// finite coefficient and a finite measured entropy.
fn check_entropy_step<T: Real>(coef: T, min: T, max: T, entropy: T) -> Result<()> {
    ensure(
        min.is_finite() && max.is_finite() && min <= max,
        "min",
        "need finite min <= max",
    )?;
    ensure(coef.is_finite(), "coef", "must be finite")?;
    if !entropy.is_finite() {
        return Err(crate::Error::NonFinite {
            what: "entropy",
            index: 0,
        });
    }
    Ok(())
}

/// TRL's adaptive entropy-bonus coefficient (`GRPOConfig.use_adaptive_entropy`) \[TRL\]:
/// after each optimizer step, with H the step's mean token entropy (token-weighted over the
/// accumulation window and every rank: the caller's all-reduced Σ H_t / Σ m_t),
///
/// ```text
/// c ← min(c + δ, c_max)   if H ≤ H_target
/// c ← max(c − δ, c_min)   otherwise
/// ```
///
/// and the next step's loss subtracts `applied()·H`, where `applied()` is c when that last H
/// was ≤ H_target and 0 otherwise: the bonus acts only while the entropy is at or below the
/// target, and the coefficient ramps by δ per step meanwhile. Source: TRL's `_compute_loss`
/// (the `use_adaptive_entropy` branch: `apply_coef = entropy_coef if _last_world_entropy <=
/// entropy_target else 0`, then the ±`entropy_coef_delta` update at the optimizer-step
/// boundary). Before the first update no entropy has been measured; `applied()` is then c
/// (TRL's initial gate state is not pinned by the sources read, and with its default c = 0
/// it makes no difference).
///
/// A coefficient set outside [c_min, c_max] moves by δ towards the range and is clamped only
/// at the end it moves towards, as in TRL.
///
/// `Default` = TRL's defaults: c = 0 (`entropy_coef`), H_target = 0.2 nats, δ = 0.005,
/// range [0, 1].
///
/// # Example
/// ```
/// use grpo_core::control::TrlEntropyController;
/// let mut c = TrlEntropyController::<f64>::default();
/// // H = 0.1 ≤ 0.2: c = 0.005, and the next step applies it.
/// assert_eq!(c.update(0.1).unwrap(), 0.005);
/// assert_eq!(c.applied(), 0.005);
/// // H = 0.5 > 0.2: c steps back to 0.0, and the bonus is off.
/// assert_eq!(c.update(0.5).unwrap(), 0.0);
/// assert_eq!(c.applied(), 0.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrlEntropyController<T> {
    /// Current coefficient c (TRL `entropy_coef`, default 0).
    pub coef: T,
    /// Target mean token entropy H_target in nats (`entropy_target`, default 0.2).
    pub target: T,
    /// Step δ (`entropy_coef_delta`, default 0.005).
    pub delta: T,
    /// Lower clamp c_min (`entropy_coef_min`, default 0).
    pub min: T,
    /// Upper clamp c_max (`entropy_coef_max`, default 1).
    pub max: T,
    /// The entropy of the last update (`None` before the first).
    pub last_entropy: Option<T>,
}

impl<T: Real> Default for TrlEntropyController<T> {
    fn default() -> Self {
        TrlEntropyController {
            coef: T::ZERO,
            target: T::from_f64(0.2),
            delta: T::from_f64(0.005),
            min: T::ZERO,
            max: T::ONE,
            last_entropy: None,
        }
    }
}

impl<T: Real> TrlEntropyController<T> {
    /// One update with the step's mean token entropy; returns the new coefficient.
    ///
    /// # Errors
    /// [`Error::InvalidParam`](crate::Error::InvalidParam) unless `delta` ≥ 0, `min ≤ max`
    /// and `coef`, `target`, `delta`, `min`, `max` are finite;
    /// [`Error::NonFinite`](crate::Error::NonFinite) for a NaN/±∞ entropy. The state is
    /// unchanged on `Err`.
    pub fn update(&mut self, entropy: T) -> Result<T> {
        ensure(
            self.delta >= T::ZERO && self.delta.is_finite(),
            "delta",
            "must be finite and >= 0",
        )?;
        ensure(self.target.is_finite(), "target", "must be finite")?;
        check_entropy_step(self.coef, self.min, self.max, entropy)?;
        self.coef = if entropy <= self.target {
            (self.coef + self.delta).min(self.max)
        } else {
            (self.coef - self.delta).max(self.min)
        };
        self.last_entropy = Some(entropy);
        Ok(self.coef)
    }

    /// The coefficient the next step's loss applies: `coef` while the last measured entropy is
    /// at or below the target (or before any measurement), 0 above it.
    ///
    /// ```
    /// use grpo_core::control::TrlEntropyController;
    /// let mut c = TrlEntropyController { coef: 0.5f32, delta: 0.125, ..Default::default() };
    /// assert_eq!(c.applied(), 0.5); // nothing measured yet
    /// c.update(0.9).unwrap(); // above the 0.2 target: 0.375, gated off
    /// assert_eq!((c.coef, c.applied()), (0.375, 0.0));
    /// c.update(0.1).unwrap(); // at or below: 0.5 again, applied
    /// assert_eq!(c.applied(), 0.5);
    /// ```
    pub fn applied(&self) -> T {
        match self.last_entropy {
            Some(h) if h > self.target => T::ZERO,
            _ => self.coef,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn kl_controller_refuses_an_overflowing_step() {
        // horizon 1e-37 with 1000 steps: the factor 1 + 0.2·1000/1e-37 overflows f32.
        let mut c = AdaptiveKlController::new(0.1f32, 0.1, 1e-37).unwrap();
        let before = c;
        assert_eq!(
            c.update(1.0, 1000),
            Err(Error::NonFinite {
                what: "kl coefficient",
                index: 0
            })
        );
        assert_eq!(c, before);
    }

    #[test]
    fn trl_entropy_controller_steps_and_gates() {
        let mut c = TrlEntropyController::<f64> {
            coef: 0.25,
            target: 2.0,
            delta: 0.01,
            max: 0.27,
            ..TrlEntropyController::default()
        };
        // No measurement yet: the configured coefficient applies.
        assert_eq!(c.applied(), 0.25);
        // H = 2.0 = target (≤): up by δ, applied.
        assert_eq!(c.update(2.0).unwrap(), 0.26);
        assert_eq!(c.applied(), 0.26);
        // Up again, then capped at 0.27.
        assert_eq!(c.update(1.0).unwrap(), 0.27);
        assert_eq!(c.update(0.0).unwrap(), 0.27);
        // Above the target: down by δ and gated off.
        assert_eq!(c.update(2.5).unwrap(), 0.26);
        assert_eq!(c.applied(), 0.0);
        // Down to the floor 0.
        let mut d = TrlEntropyController::<f32> {
            coef: 0.004,
            ..TrlEntropyController::default()
        };
        assert_eq!(d.update(1.0).unwrap(), 0.0);
        // Invalid settings or a NaN entropy: Err, state unchanged.
        let before = d;
        assert!(d.update(f32::NAN).is_err());
        d.delta = -1.0;
        assert!(d.update(0.1).is_err());
        d.delta = 0.005;
        d.min = 2.0;
        assert!(d.update(0.1).is_err());
        d.min = 0.0;
        assert_eq!(d, before);
    }

    #[test]
    fn kl_controller_hand_computed() {
        let mut c = AdaptiveKlController::new(0.2f64, 0.1, 100.0).unwrap();
        // KL = 0.11: e = 0.1 (inside the clip); β = 0.2·(1 + 0.1·10/100) = 0.202.
        assert!((c.update(0.11, 10).unwrap() - 0.202).abs() < 1e-15);
        // n_steps = 0 leaves β unchanged.
        assert!((c.update(5.0, 0).unwrap() - 0.202).abs() < 1e-15);
        // A huge step count would flip the sign: β floors at 0.
        assert_eq!(c.update(0.0, 10_000).unwrap(), 0.0);
        let before = c;
        assert_eq!(
            c.update(f64::NAN, 1),
            Err(Error::NonFinite {
                what: "current_kl",
                index: 0
            })
        );
        assert_eq!(c, before);
        assert!(AdaptiveKlController::new(0.1f64, 0.0, 1.0).is_err());
        assert!(AdaptiveKlController::new(-0.1f64, 0.1, 1.0).is_err());
        assert!(AdaptiveKlController::new(0.1f64, 0.1, 0.0).is_err());
    }

    #[test]
    fn entropy_controller_validates() {
        let mut c = AdaptiveEntropyController::<f32>::default();
        assert!(c.update(f32::NAN).is_err());
        c.min = 1.0;
        assert!(c.update(0.1).is_err());
        let mut d = AdaptiveEntropyController::<f64>::default();
        // H = 0.1 < 0.2: 0 + 1e-3·0.1 = 1e-4.
        assert!((d.update(0.1).unwrap() - 1e-4).abs() < 1e-18);
    }

    #[test]
    fn entropy_controller_errors_leave_the_state_unchanged() {
        let base = AdaptiveEntropyController::<f64> {
            coef: 0.004,
            target: 0.5,
            lr: 0.01,
            min: 0.0,
            max: 0.01,
        };
        let bad = [
            (AdaptiveEntropyController { lr: -1.0, ..base }, 0.3, "lr"),
            (
                AdaptiveEntropyController {
                    lr: f64::NAN,
                    ..base
                },
                0.3,
                "lr",
            ),
            (
                AdaptiveEntropyController {
                    target: -0.1,
                    ..base
                },
                0.3,
                "target",
            ),
            (
                AdaptiveEntropyController {
                    target: f64::INFINITY,
                    ..base
                },
                0.3,
                "target",
            ),
            (AdaptiveEntropyController { min: 0.02, ..base }, 0.3, "min"),
            (
                AdaptiveEntropyController {
                    max: f64::NAN,
                    ..base
                },
                0.3,
                "min",
            ),
            (
                AdaptiveEntropyController {
                    coef: f64::NAN,
                    ..base
                },
                0.3,
                "coef",
            ),
        ];
        for (c, h, name) in bad {
            let mut d = c;
            match d.update(h) {
                Err(Error::InvalidParam { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}: {other:?}"),
            }
            // NaN fields compare through their bits.
            let bits = |c: &AdaptiveEntropyController<f64>| {
                [c.coef, c.target, c.lr, c.min, c.max].map(f64::to_bits)
            };
            assert_eq!(bits(&d), bits(&c), "{name}");
        }
        // A non-finite entropy, and lr = 0 times an overflowing target − H (NaN): NonFinite.
        for (c, h, what) in [
            (base, f64::NAN, "entropy"),
            (base, f64::NEG_INFINITY, "entropy"),
            (
                AdaptiveEntropyController {
                    lr: 0.0,
                    target: f64::MAX,
                    ..base
                },
                -f64::MAX,
                "entropy coefficient",
            ),
        ] {
            let mut d = c;
            assert_eq!(d.update(h), Err(Error::NonFinite { what, index: 0 }));
            assert_eq!(d, c);
        }
        // The valid step: 0.004 + 0.01·(0.5 − 0.3) = 0.006.
        let mut d = base;
        assert!((d.update(0.3).unwrap() - 0.006).abs() < 1e-17);
        let before = d.coef;
        assert_eq!(d.update(0.5).unwrap(), before); // H at the target: no step
    }
}
