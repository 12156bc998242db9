//! DAPO overlong reward shaping (MATH.md §2): a soft length penalty to add to the rewards.

use crate::error::{Result, check_len, ensure};
use crate::presets::Preset;
use crate::real::Real;

/// Configuration of [`overlong_penalty`].
///
/// | preset | `max_len` | `cache_len` | `factor` |
/// |---|---|---|---|
/// | every preset (= `Default`) | 20480 | 4096 | 1 |
///
/// The defaults are DAPO's \[2503.14476\] (expected length 16384 + a 4096-token soft cache).
/// verl (b178a3cd) `DAPORewardManager` has the same middle branch (`overlong_buffer.len`,
/// `penalty_factor`) but computes `min(−(|y| − L_exp)/L_cache · factor, 0)` without the `−factor`
/// floor beyond `L_max` (its responses cannot exceed `L_max`); we follow the paper's piecewise
/// definition, which agrees with verl for every `|y| ≤ L_max`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlongConfig<T> {
    /// `L_max`: the hard length limit.
    pub max_len: usize,
    /// `L_cache`: the soft-penalty interval before `L_max`; must be `≤ max_len`.
    pub cache_len: usize,
    /// Penalty at `L_max` and beyond; must be finite and `≥ 0`.
    pub factor: T,
}

impl<T: Real> Default for OverlongConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> OverlongConfig<T> {
    /// The configuration a preset uses (all the same; see the type's docs).
    pub fn from_preset(_preset: Preset) -> Self {
        OverlongConfig {
            max_len: 20480,
            cache_len: 4096,
            factor: T::ONE,
        }
    }
}

/// DAPO overlong penalty per response length: with `L_exp = L_max − L_cache`,
/// `R = 0` if `|y| ≤ L_exp`; `R = (L_exp − |y|)/L_cache · factor` if `L_exp < |y| ≤ L_max`
/// (linear from 0 to −factor); `R = −factor` beyond `L_max`. The caller adds `R` to the reward.
/// `cache_len == 0` is a hard cut-off at `L_max` (the middle interval is empty).
///
/// Source: DAPO \[2503.14476\] (soft overlong punishment); \[verl\] `DAPORewardManager`.
///
/// # Errors
/// [`Error::InvalidParam`](crate::Error::InvalidParam) for `cache_len > max_len` or a factor
/// that is negative or not finite; [`Error::LengthMismatch`](crate::Error::LengthMismatch) for
/// `out`. On error `out` is untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::overlong::{overlong_penalty, OverlongConfig};
/// let cfg = OverlongConfig { max_len: 100, cache_len: 20, factor: 0.5 };
/// let mut r = [9.0f64; 4];
/// overlong_penalty(&[80, 90, 100, 150], &cfg, &mut r).unwrap();
/// // 80 ≤ 80 → 0; 90 → (80 − 90)/20 · 0.5 = −0.25; 100 → −0.5; beyond → −0.5.
/// assert_eq!(r, [0.0, -0.25, -0.5, -0.5]);
/// ```
pub fn overlong_penalty<T: Real>(
    lengths: &[usize],
    cfg: &OverlongConfig<T>,
    out: &mut [T],
) -> Result<()> {
    ensure(
        cfg.cache_len <= cfg.max_len,
        "cache_len",
        "must be <= max_len",
    )?;
    ensure(
        cfg.factor.is_finite() && cfg.factor >= T::ZERO,
        "factor",
        "must be finite and >= 0",
    )?;
    check_len("out", lengths.len(), out.len())?;
    let expected = cfg.max_len - cfg.cache_len;
    for (o, &len) in out.iter_mut().zip(lengths) {
        *o = if len <= expected {
            T::ZERO
        } else if len <= cfg.max_len {
            // Here cache_len ≥ len − expected ≥ 1, so the division is safe.
            -(T::from_usize(len - expected) / T::from_usize(cfg.cache_len)) * cfg.factor
        } else {
            -cfg.factor
        };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn dapo_defaults_hand_computed() {
        // L_exp = 20480 − 4096 = 16384.
        // 16384 → 0; 16385 → −1/4096; 18432 → −2048/4096 = −0.5; 20480 → −1; 30000 → −1.
        let mut r = [9.0f32; 6];
        overlong_penalty(
            &[0, 16384, 16385, 18432, 20480, 30000],
            &OverlongConfig::default(),
            &mut r,
        )
        .unwrap();
        assert_eq!(r, [0.0, 0.0, -1.0 / 4096.0, -0.5, -1.0, -1.0]);
    }

    #[test]
    fn zero_cache_is_a_hard_cut() {
        let cfg = OverlongConfig {
            max_len: 10,
            cache_len: 0,
            factor: 2.0f64,
        };
        let mut r = [9.0; 3];
        overlong_penalty(&[9, 10, 11], &cfg, &mut r).unwrap();
        assert_eq!(r, [0.0, 0.0, -2.0]);
    }

    #[test]
    fn errors_leave_out_untouched() {
        let mut r = [7.0f64; 2];
        let bad = OverlongConfig {
            max_len: 10,
            cache_len: 11,
            factor: 1.0,
        };
        assert!(matches!(
            overlong_penalty(&[1, 2], &bad, &mut r),
            Err(Error::InvalidParam {
                name: "cache_len",
                ..
            })
        ));
        for f in [-1.0, f64::NAN, f64::INFINITY] {
            let bad = OverlongConfig {
                max_len: 10,
                cache_len: 5,
                factor: f,
            };
            assert!(matches!(
                overlong_penalty(&[1, 2], &bad, &mut r),
                Err(Error::InvalidParam { name: "factor", .. })
            ));
        }
        assert!(matches!(
            overlong_penalty(&[1, 2, 3], &OverlongConfig::default(), &mut r),
            Err(Error::LengthMismatch { what: "out", .. })
        ));
        assert_eq!(r, [7.0; 2]);
    }
}
