//! Coefficient controllers updated once per training step: the adaptive KL-penalty
//! coefficient and an adaptive entropy-bonus coefficient.

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
    /// [`Error::NonFinite`](crate::Error::NonFinite) for a NaN/±∞ KL, or the validation errors
    /// of [`AdaptiveKlController::new`] if the fields were set to invalid values; the state is
    /// unchanged on `Err`.
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
        self.value = (self.value * mult).max(T::ZERO);
        Ok(self.value)
    }
}

/// Adaptive entropy-bonus coefficient, **our definition** (a projected dual-ascent step on
/// the constraint H ≥ H_target):
///
/// c ← clamp(c + lr·(H_target − H), c_min, c_max)
///
/// so the bonus grows while the measured mean token entropy H is below the target and decays
/// above it. TRL (f2cd577) is cited for an adaptive entropy coefficient, but its exact update
/// rule could not be verified from the sources available to us; this controller is therefore
/// documented as ours rather than as a TRL preset.
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
    /// a NaN/±∞ entropy. The state is unchanged on `Err`.
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
        ensure(
            self.min.is_finite() && self.max.is_finite() && self.min <= self.max,
            "min",
            "need finite min <= max",
        )?;
        ensure(self.coef.is_finite(), "coef", "must be finite")?;
        if !entropy.is_finite() {
            return Err(crate::Error::NonFinite {
                what: "entropy",
                index: 0,
            });
        }
        self.coef = (self.coef + self.lr * (self.target - entropy)).clamp(self.min, self.max);
        Ok(self.coef)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

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
}
