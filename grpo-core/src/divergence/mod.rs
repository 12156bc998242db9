//! Divergence measures between policies and the unified clipping framework (MATH.md §3).

pub mod bounds;
pub mod kl_penalty;
pub mod lambert_w;
pub mod measures;

pub use bounds::{DeltaCap, DualClip, ElasticTrustRegion};
pub use kl_penalty::{KlEstimator, KlPenaltyConfig};
pub use measures::{Measure, ValueGrad};

use crate::error::{Error, Result};
use crate::real::Real;

/// A feasible interval of the likelihood ratio ρ = π_θ/π_old: the clip region of every
/// ratio-clipped objective. Produced once per bound (symmetric ε, clip-higher, KL3 δ, …) and
/// reused for every token. Invariant: `0 ≤ lo ≤ 1 ≤ hi` (`hi` may be +∞ for "no upper clip").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RatioBounds<T> {
    /// Lower ratio bound l (a token with A < 0 and ρ < l gets no gradient).
    pub lo: T,
    /// Upper ratio bound u (a token with A > 0 and ρ > u gets no gradient).
    pub hi: T,
}

impl<T: Real> RatioBounds<T> {
    /// `[lo, hi]` after checking `0 ≤ lo ≤ 1 ≤ hi` (NaN rejected).
    ///
    /// # Errors
    /// [`Error::InvalidParam`] when the interval does not contain 1 or `lo < 0`.
    pub fn new(lo: T, hi: T) -> Result<Self> {
        if !(lo >= T::ZERO && lo <= T::ONE) {
            return Err(Error::InvalidParam {
                name: "lo",
                reason: "ratio lower bound must be in [0, 1]",
            });
        }
        // NaN fails this test too.
        if hi.is_nan() || hi < T::ONE {
            return Err(Error::InvalidParam {
                name: "hi",
                reason: "ratio upper bound must be >= 1",
            });
        }
        Ok(RatioBounds { lo, hi })
    }

    /// PPO/GRPO symmetric clip `[1 − ε, 1 + ε]`, `0 < ε < 1`.
    ///
    /// # Errors
    /// [`Error::InvalidParam`] unless `0 < ε < 1`.
    pub fn symmetric(eps: T) -> Result<Self> {
        Self::asymmetric(eps, eps)
    }

    /// DAPO clip-higher `[1 − ε_low, 1 + ε_high]`, `0 < ε_low < 1`, `ε_high > 0`.
    ///
    /// # Errors
    /// [`Error::InvalidParam`] unless `0 < ε_low < 1` and `0 < ε_high < ∞`.
    pub fn asymmetric(eps_low: T, eps_high: T) -> Result<Self> {
        if !(eps_low > T::ZERO && eps_low < T::ONE) {
            return Err(Error::InvalidParam {
                name: "eps_low",
                reason: "must be in (0, 1)",
            });
        }
        if !(eps_high > T::ZERO && eps_high.is_finite()) {
            return Err(Error::InvalidParam {
                name: "eps_high",
                reason: "must be finite and > 0",
            });
        }
        Ok(RatioBounds {
            lo: T::ONE - eps_low,
            hi: T::ONE + eps_high,
        })
    }
}
