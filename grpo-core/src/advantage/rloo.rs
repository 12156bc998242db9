//! RLOO: the leave-one-out baseline (MATH.md §2, §6).

use super::group_scan::{GroupStats, check_then_write, check_values, scorable, validate_groups};
use super::{Diagnostics, NanPolicy, SingletonRule};
use crate::error::{Error, Result, check_len};
use crate::layout::Groups;
use crate::presets::Preset;
use crate::real::Real;

/// Configuration of [`rloo`].
///
/// | field | Paper (default) | Verl | VerlVectorized | Trl | OpenRlhf |
/// |---|---|---|---|---|---|
/// | `singleton` | `Zero` | `VerlLoop` (A = s) | `Zero` | `Zero` | `Reject` |
/// | `nan` | `Reject` | `Reject` | `Reject` | `Exclude` | `Reject` |
///
/// Sources (MATH.md §6): verl b178a3cd `compute_rloo_outcome_advantage` (a one-sample group
/// keeps its score: baseline 0) and its vectorized variant (one-sample group → 0); OpenRLHF
/// 3c3be62 `rloo` divides by n − 1 = 0 for a singleton and gets NaN, which we refuse instead;
/// TRL's unscorable-NaN policy. RLOO [2402.14740] itself assumes n ≥ 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RlooConfig {
    /// What a group with one scorable sample gets: `Zero` → 0, `VerlLoop` → `A = s`
    /// (baseline 0), `Reject` → error.
    pub singleton: SingletonRule,
    /// What a NaN score means.
    pub nan: NanPolicy,
}

impl RlooConfig {
    /// The configuration a peer uses (see the table on [`RlooConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        match preset {
            Preset::Verl => RlooConfig {
                singleton: SingletonRule::VerlLoop,
                nan: NanPolicy::Reject,
            },
            Preset::Trl => RlooConfig {
                singleton: SingletonRule::Zero,
                nan: NanPolicy::Exclude,
            },
            Preset::OpenRlhf => RlooConfig {
                singleton: SingletonRule::Reject,
                nan: NanPolicy::Reject,
            },
            _ => RlooConfig::default(),
        }
    }
}

/// REINFORCE leave-one-out: `A_i = s_i − mean_{j≠i} s_j = (n/(n−1))·(s_i − μ_g)`.
///
/// n is the number of scorable samples of the group. The right-hand form is used (with the
/// Welford mean, so a group of equal scores gets exactly 0; with two samples `A = ±(s₂ − s₁)`
/// exactly). Singletons follow `cfg.singleton`; unscorable samples (NaN under
/// [`NanPolicy::Exclude`]) get 0 and are left out of the baseline.
///
/// Source: RLOO [2402.14740], \[verl\], \[OpenRLHF\] (see [`RlooConfig`]).
///
/// # Errors
/// Nothing is written on error. [`Error::LengthMismatch`], [`Error::InvalidParam`] /
/// [`Error::InvalidOffsets`] / [`Error::EmptyGroup`] for the layout, [`Error::NonFinite`] for
/// ±∞ or rejected NaN scores (or an overflowing advantage), [`Error::GroupTooSmall`] for a
/// singleton under [`SingletonRule::Reject`].
///
/// # Example
/// ```
/// use grpo_core::advantage::rloo::{rloo, RlooConfig};
/// use grpo_core::{Groups, Preset};
/// // Group (1, 0, 0, 1): μ = 0.5, n/(n−1) = 4/3 → ±2/3; e.g. 1 − (0 + 0 + 1)/3 = 2/3.
/// let mut adv = [0.0f64; 5];
/// rloo(&[1.0, 0.0, 0.0, 1.0, 5.0], Groups::Offsets(&[0, 4, 5]), &RlooConfig::default(), &mut adv)
///     .unwrap();
/// assert!((adv[0] - 2.0 / 3.0).abs() < 1e-15 && (adv[1] + 2.0 / 3.0).abs() < 1e-15);
/// assert_eq!(adv[4], 0.0); // singleton → 0 (verl vectorized, TRL)
/// let verl = RlooConfig::from_preset(Preset::Verl);
/// rloo(&[1.0, 0.0, 0.0, 1.0, 5.0], Groups::Offsets(&[0, 4, 5]), &verl, &mut adv).unwrap();
/// assert_eq!(adv[4], 5.0); // verl loop: singleton keeps its score
/// ```
pub fn rloo<T: Real>(
    scores: &[T],
    groups: Groups<'_>,
    cfg: &RlooConfig,
    out: &mut [T],
) -> Result<Diagnostics<T>> {
    let n = scores.len();
    check_len("out", n, out.len())?;
    let num_groups = validate_groups(&groups, n)?;
    check_values("scores", scores, cfg.nan)?;
    let value = |i: usize| scores.get(i).copied().and_then(scorable);
    check_then_write(out, |emit| {
        let mut diag = Diagnostics {
            groups: num_groups,
            ..Diagnostics::default()
        };
        for k in 0..num_groups {
            let st = GroupStats::of(groups.members(k), &value);
            diag.nan_excluded += groups.size(k) - st.n();
            let factor = match st.n() {
                0 => T::ZERO,
                1 => {
                    diag.singleton_groups += 1;
                    match cfg.singleton {
                        SingletonRule::Reject => {
                            return Err(Error::GroupTooSmall {
                                group: k,
                                needed: 2,
                                found: 1,
                            });
                        }
                        SingletonRule::VerlLoop => {
                            for i in groups.members(k) {
                                emit(i, value(i).unwrap_or(T::ZERO));
                            }
                            continue;
                        }
                        SingletonRule::Zero => T::ZERO,
                    }
                }
                m => {
                    if st.zero_spread() {
                        diag.zero_variance_groups += 1;
                    }
                    T::from_usize(m) / T::from_usize(m - 1)
                }
            };
            for i in groups.members(k) {
                let a = value(i).map_or(T::ZERO, |s| st.centered(s) * factor);
                emit(i, a);
            }
        }
        Ok(diag)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_leave_one_out() {
        // (3, 1, 2): sample 0: 3 − (1+2)/2 = 1.5; sample 1: 1 − (3+2)/2 = −1.5; sample 2:
        // 2 − (3+1)/2 = 0.
        let mut a = [0.0f64; 3];
        rloo(
            &[3.0, 1.0, 2.0],
            Groups::Uniform(3),
            &RlooConfig::default(),
            &mut a,
        )
        .unwrap();
        assert_eq!(a, [1.5, -1.5, 0.0]);
        // Pair (0.1, 0.4): ±(0.4 − 0.1) exactly symmetric.
        let mut b = [0.0f64; 2];
        rloo(
            &[0.1, 0.4],
            Groups::Uniform(2),
            &RlooConfig::default(),
            &mut b,
        )
        .unwrap();
        assert_eq!(b[0], -b[1]);
        assert!((b[1] - 0.3).abs() < 1e-15);
    }

    #[test]
    fn singleton_rules() {
        let s = [1.0f64, 3.0, -2.0];
        let g = Groups::Offsets(&[0, 2, 3]);
        let mut a = [0.0; 3];
        // Vectorized: 0. Loop: A = s = −2.
        let d = rloo(
            &s,
            g,
            &RlooConfig::from_preset(Preset::VerlVectorized),
            &mut a,
        )
        .unwrap();
        assert_eq!(a, [-2.0, 2.0, 0.0]);
        assert_eq!(d.singleton_groups, 1);
        rloo(&s, g, &RlooConfig::from_preset(Preset::Verl), &mut a).unwrap();
        assert_eq!(a, [-2.0, 2.0, -2.0]);
        let mut untouched = [4.0; 3];
        assert_eq!(
            rloo(
                &s,
                g,
                &RlooConfig::from_preset(Preset::OpenRlhf),
                &mut untouched
            ),
            Err(Error::GroupTooSmall {
                group: 1,
                needed: 2,
                found: 1
            })
        );
        assert_eq!(untouched, [4.0; 3]);
    }

    #[test]
    fn nan_exclusion_and_rejection() {
        // (2, NaN, 0, 1): scorable 2, 0, 1 → μ = 1, factor 3/2 → 1.5, 0, −1.5, 0.
        let s = [2.0f64, f64::NAN, 0.0, 1.0];
        let mut a = [9.0; 4];
        assert_eq!(
            rloo(&s, Groups::Uniform(4), &RlooConfig::default(), &mut a),
            Err(Error::NonFinite {
                what: "scores",
                index: 1
            })
        );
        assert_eq!(a, [9.0; 4]);
        let d = rloo(
            &s,
            Groups::Uniform(4),
            &RlooConfig::from_preset(Preset::Trl),
            &mut a,
        )
        .unwrap();
        assert_eq!(a, [1.5, 0.0, -1.5, 0.0]);
        assert_eq!(d.nan_excluded, 1);
    }
}
