//! pass@k advantages: only each group's best sample learns (MATH.md §2; \[verl\] `grpo_passk`).

use super::group_scan::{
    GroupStats, check_nonneg, check_then_write, check_values, ratio, scorable, validate_groups,
};
use super::{Diagnostics, NanPolicy};
use crate::error::{Error, Result, check_len};
use crate::layout::Groups;
use crate::presets::Preset;
use crate::real::Real;
use crate::stats::Bessel;

/// Configuration of [`pass_at_k`].
///
/// Every preset gives the verl values (verl b178a3cd `compute_grpo_passk_outcome_advantage`:
/// `norm_adv_by_std_in_grpo = True`, ε = 1e-6, `torch.std` unbiased), except `Trl`, which sets
/// the TRL NaN policy (TRL and OpenRLHF have no pass@k estimator). The method is from
/// [2503.19595].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PassKConfig {
    /// Divide the gap by `σ_g + ε` (verl `norm_adv_by_std_in_grpo`).
    pub normalize: bool,
    /// ε of the division (≥ 0).
    pub eps: f64,
    /// Variance divisor of σ_g.
    pub bessel: Bessel,
    /// What a NaN score means (an unscorable sample is never the argmax and gets 0).
    pub nan: NanPolicy,
}

impl Default for PassKConfig {
    fn default() -> Self {
        PassKConfig {
            normalize: true,
            eps: 1e-6,
            bessel: Bessel::Unbiased,
            nan: NanPolicy::Reject,
        }
    }
}

impl PassKConfig {
    /// The configuration a peer uses (see [`PassKConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        match preset {
            Preset::Trl => PassKConfig {
                nan: NanPolicy::Exclude,
                ..Self::default()
            },
            _ => Self::default(),
        }
    }
}

/// pass@k advantage: in each group only the best sample gets `r_max − r_2nd`
/// (divided by `σ_g + ε` when `cfg.normalize`); every other sample gets 0.
///
/// `r_2nd` is the largest score among the *other* scorable samples, so a tie for the maximum
/// gives 0 everywhere. **Tie policy**: the argmax is the first maximal sample in the group's
/// member order (batch order; for [`Groups::from_group_ids`] the stable order it builds),
/// a deterministic replacement for `torch.topk`'s unspecified choice. Since a tie for the
/// maximum makes the gap 0, the policy never changes a value; it only makes the result
/// independent of sort internals.
/// Zero-variance groups (all scores equal) are counted in [`Diagnostics`].
///
/// Source: [2503.19595] as implemented by \[verl\] `grpo_passk`.
///
/// # Errors
/// Nothing is written on error. [`Error::GroupTooSmall`] for a group with fewer than two
/// scorable samples; [`Error::LengthMismatch`], layout errors, [`Error::InvalidParam`] for a
/// negative or NaN `eps`, [`Error::NonFinite`] for ±∞ or rejected NaN scores.
///
/// # Example
/// ```
/// use grpo_core::advantage::passk::{pass_at_k, PassKConfig};
/// use grpo_core::Groups;
/// // Group (0, 1, 0.5): argmax 1, gap 1 − 0.5 = 0.5.
/// let cfg = PassKConfig { normalize: false, ..PassKConfig::default() };
/// let mut adv = [9.0f64; 3];
/// pass_at_k(&[0.0, 1.0, 0.5], Groups::Uniform(3), &cfg, &mut adv).unwrap();
/// assert_eq!(adv, [0.0, 0.5, 0.0]);
/// // Normalised: σ_unb of (0, 1, 0.5) = 0.5, so 0.5 / (0.5 + 1e-6).
/// pass_at_k(&[0.0, 1.0, 0.5], Groups::Uniform(3), &PassKConfig::default(), &mut adv).unwrap();
/// assert_eq!(adv[1], 0.5 / (0.5 + 1e-6));
/// ```
pub fn pass_at_k<T: Real>(
    scores: &[T],
    groups: Groups<'_>,
    cfg: &PassKConfig,
    out: &mut [T],
) -> Result<Diagnostics<T>> {
    let n = scores.len();
    check_len("out", n, out.len())?;
    check_nonneg("eps", cfg.eps)?;
    let num_groups = validate_groups(&groups, n)?;
    check_values("scores", scores, cfg.nan)?;
    let value = |i: usize| scores.get(i).copied().and_then(scorable);
    let eps = T::from_f64(cfg.eps);
    check_then_write(out, |emit| {
        let mut diag = Diagnostics {
            groups: num_groups,
            ..Diagnostics::default()
        };
        for k in 0..num_groups {
            let st = GroupStats::of(groups.members(k), &value);
            diag.nan_excluded += groups.size(k) - st.n();
            if st.n() < 2 {
                return Err(Error::GroupTooSmall {
                    group: k,
                    needed: 2,
                    found: st.n(),
                });
            }
            if st.zero_spread() {
                diag.zero_variance_groups += 1;
            }
            // First maximal member (strict `>` keeps the earliest), then the best of the rest.
            let mut best: Option<(usize, T)> = None;
            for i in groups.members(k) {
                if let Some(s) = value(i)
                    && best.is_none_or(|(_, b)| s > b)
                {
                    best = Some((i, s));
                }
            }
            let Some((arg, top)) = best else {
                continue;
            };
            let mut second = T::NEG_INFINITY;
            for i in groups.members(k) {
                if i != arg
                    && let Some(s) = value(i)
                {
                    second = second.max(s);
                }
            }
            let gap = top - second;
            let den = if cfg.normalize {
                st.std_floored(cfg.bessel, None).unwrap_or(T::ZERO) + eps
            } else {
                T::ONE
            };
            for i in groups.members(k) {
                emit(i, if i == arg { ratio(gap, den) } else { T::ZERO });
            }
        }
        Ok(diag)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_first_index_and_zero_gap() {
        // (1, 0, 1): two maxima → argmax is index 0, r_2nd = 1 → gap 0 → all 0.
        let mut a = [9.0f64; 3];
        pass_at_k(
            &[1.0, 0.0, 1.0],
            Groups::Uniform(3),
            &PassKConfig::default(),
            &mut a,
        )
        .unwrap();
        assert_eq!(a, [0.0; 3]);
        // (0.2, 0.9, 0.4, 0.9 | 3, 1): group 0 ties at 0.9 → 0; group 1 argmax 4, gap 2, σ_unb = sqrt(2), ε = 1e-6.
        let s = [0.2, 0.9, 0.4, 0.9, 3.0, 1.0];
        let mut b = [9.0f64; 6];
        pass_at_k(
            &s,
            Groups::Offsets(&[0, 4, 6]),
            &PassKConfig::default(),
            &mut b,
        )
        .unwrap();
        assert_eq!(&b[..4], &[0.0; 4]);
        assert!((b[4] - 2.0 / (2f64.sqrt() + 1e-6)).abs() < 1e-15);
        assert_eq!(b[5], 0.0);
    }

    #[test]
    fn negative_scores_and_nan() {
        // (−3, −1, −2) unnormalised: argmax 1, gap −1 − (−2) = 1.
        let cfg = PassKConfig {
            normalize: false,
            ..PassKConfig::default()
        };
        let mut a = [0.0f64; 3];
        pass_at_k(&[-3.0, -1.0, -2.0], Groups::Uniform(3), &cfg, &mut a).unwrap();
        assert_eq!(a, [0.0, 1.0, 0.0]);
        // TRL NaN policy: (NaN, 2, 1.5) → argmax 1, gap 0.5, NaN gets 0.
        let cfg = PassKConfig {
            nan: NanPolicy::Exclude,
            ..cfg
        };
        let d = pass_at_k(&[f64::NAN, 2.0, 1.5], Groups::Uniform(3), &cfg, &mut a).unwrap();
        assert_eq!(a, [0.0, 0.5, 0.0]);
        assert_eq!(d.nan_excluded, 1);
    }

    #[test]
    fn small_groups_are_refused() {
        let mut a = [7.0f64; 3];
        assert_eq!(
            pass_at_k(
                &[1.0, 2.0, 3.0],
                Groups::Offsets(&[0, 2, 3]),
                &PassKConfig::default(),
                &mut a
            ),
            Err(Error::GroupTooSmall {
                group: 1,
                needed: 2,
                found: 1
            })
        );
        let cfg = PassKConfig {
            nan: NanPolicy::Exclude,
            ..PassKConfig::default()
        };
        assert_eq!(
            pass_at_k(
                &[1.0, f64::NAN, 3.0],
                Groups::Offsets(&[0, 2, 3]),
                &cfg,
                &mut a
            ),
            Err(Error::GroupTooSmall {
                group: 0,
                needed: 2,
                found: 1
            })
        );
        let bad = PassKConfig {
            eps: -1.0,
            ..PassKConfig::default()
        };
        assert!(pass_at_k(&[1.0, 2.0], Groups::Uniform(2), &bad, &mut a[..2]).is_err());
        assert_eq!(a, [7.0; 3]);
    }
}
