//! OPO: the length-weighted baseline (MATH.md §2; \[verl\] `opo`).

use super::group_scan::{check_then_write, check_values, scorable, validate_groups};
use super::{Diagnostics, NanPolicy, SingletonRule};
use crate::error::{Error, Result, check_len};
use crate::layout::Groups;
use crate::presets::Preset;
use crate::real::Real;

/// Configuration of [`opo`].
///
/// | field | Paper (default) | Verl / VerlVectorized | Trl | OpenRlhf |
/// |---|---|---|---|---|
/// | `singleton` | `Zero` | `VerlLoop` (baseline 0: A = s) | `Zero` | `Zero` |
/// | `nan` | `Reject` | `Reject` | `Exclude` | `Reject` |
///
/// Source: verl b178a3cd `compute_opo_outcome_advantage` (a one-sample group's baseline is 0);
/// OPO [2505.23585]. verl has no vectorized OPO, so `VerlVectorized` equals `Verl`; TRL and
/// OpenRLHF have no OPO and get the defaults (with TRL's NaN policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpoConfig {
    /// What a group with one scorable sample gets: `Zero` → 0, `VerlLoop` → `A = s`,
    /// `Reject` → error.
    pub singleton: SingletonRule,
    /// What a NaN score means (an unscorable sample is left out of the baseline and gets 0).
    pub nan: NanPolicy,
}

impl OpoConfig {
    /// The configuration a peer uses (see [`OpoConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        match preset {
            Preset::Verl | Preset::VerlVectorized => OpoConfig {
                singleton: SingletonRule::VerlLoop,
                nan: NanPolicy::Reject,
            },
            Preset::Trl => OpoConfig {
                singleton: SingletonRule::Zero,
                nan: NanPolicy::Exclude,
            },
            _ => OpoConfig::default(),
        }
    }
}

/// OPO advantage: `A_i = s_i − b_g` with the length-weighted baseline
/// `b_g = Σ_j |y_j| s_j / Σ_j |y_j|` over the group's scorable samples.
///
/// `lengths[i]` is sample i's response length |y_i| in tokens (verl: `response_mask.sum(-1)`).
/// The weighted mean is accumulated incrementally (West's update `b += (w/W)(s − b)`), so a
/// group of equal scores gets exactly 0. Choices where verl is silent or divides by zero:
/// a group whose scorable responses all have length 0 gets 0 (its advantage multiplies no
/// token); unscorable samples get 0.
///
/// Source: OPO [2505.23585] as implemented by \[verl\].
///
/// # Errors
/// Nothing is written on error. [`Error::LengthMismatch`] if `lengths` or `out` differ in
/// length from `scores`; layout errors; [`Error::NonFinite`] for ±∞ or rejected NaN scores
/// (or an overflowing advantage); [`Error::GroupTooSmall`] for a singleton under
/// [`SingletonRule::Reject`].
///
/// # Example
/// ```
/// use grpo_core::advantage::opo::{opo, OpoConfig};
/// use grpo_core::Groups;
/// // Scores (1, 0) with lengths (1, 3): b = (1·1 + 3·0)/4 = 0.25 → A = (0.75, −0.25).
/// let mut adv = [0.0f64; 2];
/// opo(&[1.0, 0.0], &[1, 3], Groups::Uniform(2), &OpoConfig::default(), &mut adv).unwrap();
/// assert_eq!(adv, [0.75, -0.25]);
/// ```
pub fn opo<T: Real>(
    scores: &[T],
    lengths: &[usize],
    groups: Groups<'_>,
    cfg: &OpoConfig,
    out: &mut [T],
) -> Result<Diagnostics<T>> {
    let n = scores.len();
    check_len("lengths", n, lengths.len())?;
    check_len("out", n, out.len())?;
    let num_groups = validate_groups(&groups, n)?;
    check_values("scores", scores, cfg.nan)?;
    let value = |i: usize| scores.get(i).copied().and_then(scorable);
    let weight = |i: usize| T::from_usize(lengths.get(i).copied().unwrap_or(0));
    check_then_write(out, |emit| {
        let mut diag = Diagnostics {
            groups: num_groups,
            ..Diagnostics::default()
        };
        for k in 0..num_groups {
            let (mut count, mut total, mut base) = (0usize, T::ZERO, T::ZERO);
            let (mut first, mut equal) = (None, true);
            for i in groups.members(k) {
                if let Some(s) = value(i) {
                    count += 1;
                    equal &= first.is_none_or(|f| f == s);
                    first.get_or_insert(s);
                    let w = weight(i);
                    if w > T::ZERO {
                        total += w;
                        base += (w / total) * (s - base);
                    }
                }
            }
            diag.nan_excluded += groups.size(k) - count;
            if count == 1 {
                diag.singleton_groups += 1;
                match cfg.singleton {
                    SingletonRule::Reject => {
                        return Err(Error::GroupTooSmall {
                            group: k,
                            needed: 2,
                            found: 1,
                        });
                    }
                    SingletonRule::VerlLoop => base = T::ZERO,
                    SingletonRule::Zero => {
                        for i in groups.members(k) {
                            emit(i, T::ZERO);
                        }
                        continue;
                    }
                }
            } else if count >= 2 {
                if equal {
                    diag.zero_variance_groups += 1;
                }
                if total == T::ZERO {
                    for i in groups.members(k) {
                        emit(i, T::ZERO);
                    }
                    continue;
                }
            }
            for i in groups.members(k) {
                emit(i, value(i).map_or(T::ZERO, |s| s - base));
            }
        }
        Ok(diag)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_baselines() {
        // Group 0: scores (2, 1, 0), lengths (1, 2, 5): b = (2 + 2 + 0)/8 = 0.5 →
        // A = (1.5, 0.5, −0.5). Group 1: (0.1, 0.1) any lengths → exactly 0.
        let mut a = [9.0f64; 5];
        let d = opo(
            &[2.0, 1.0, 0.0, 0.1, 0.1],
            &[1, 2, 5, 7, 3],
            Groups::Offsets(&[0, 3, 5]),
            &OpoConfig::default(),
            &mut a,
        )
        .unwrap();
        assert_eq!(a, [1.5, 0.5, -0.5, 0.0, 0.0]);
        assert_eq!(d.zero_variance_groups, 1);
        // Zero-length responses do not weigh: (4, 2) with lengths (0, 3): b = 2 → (2, 0).
        opo(
            &[4.0, 2.0],
            &[0, 3],
            Groups::Uniform(2),
            &OpoConfig::default(),
            &mut a[..2],
        )
        .unwrap();
        assert_eq!(&a[..2], &[2.0, 0.0]);
        // All lengths 0: 0.
        opo(
            &[4.0, 2.0],
            &[0, 0],
            Groups::Uniform(2),
            &OpoConfig::default(),
            &mut a[..2],
        )
        .unwrap();
        assert_eq!(&a[..2], &[0.0, 0.0]);
    }

    #[test]
    fn singletons_and_errors() {
        let mut a = [0.0f64; 1];
        opo(
            &[3.0],
            &[4],
            Groups::Uniform(1),
            &OpoConfig::from_preset(Preset::Verl),
            &mut a,
        )
        .unwrap();
        assert_eq!(a, [3.0]);
        opo(
            &[3.0],
            &[4],
            Groups::Uniform(1),
            &OpoConfig::default(),
            &mut a,
        )
        .unwrap();
        assert_eq!(a, [0.0]);
        let mut b = [8.0f64; 2];
        assert!(matches!(
            opo(
                &[1.0, 2.0],
                &[1],
                Groups::Uniform(2),
                &OpoConfig::default(),
                &mut b
            ),
            Err(Error::LengthMismatch {
                what: "lengths",
                ..
            })
        ));
        assert_eq!(
            opo(
                &[1.0, f64::NAN],
                &[1, 1],
                Groups::Uniform(2),
                &OpoConfig::default(),
                &mut b
            ),
            Err(Error::NonFinite {
                what: "scores",
                index: 1
            })
        );
        assert_eq!(b, [8.0; 2]);
        // TRL NaN policy: (NaN, 5, 1) lengths (9, 1, 3): b = (5 + 3)/4 = 2 → (0, 3, −1).
        let mut c = [0.0f64; 3];
        opo(
            &[f64::NAN, 5.0, 1.0],
            &[9, 1, 3],
            Groups::Uniform(3),
            &OpoConfig::from_preset(Preset::Trl),
            &mut c,
        )
        .unwrap();
        assert_eq!(c, [0.0, 3.0, -1.0]);
    }
}
