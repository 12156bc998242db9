//! GPG: group policy gradient advantages (MATH.md §2; \[verl\] `gpg`).

use super::group_scan::{GroupStats, check_then_write, check_values, scorable, validate_groups};
use super::{Diagnostics, NanPolicy, SingletonRule};
use crate::error::{Error, Result, check_len, ensure};
use crate::layout::Groups;
use crate::presets::Preset;
use crate::real::Real;

/// Configuration of [`gpg`].
///
/// | field | Paper (default) | Verl / VerlVectorized | Trl | OpenRlhf |
/// |---|---|---|---|---|
/// | `f_norm` | 1 | 1 | 1 | 1 |
/// | `singleton` | `Zero` | `VerlLoop` (μ = 0: A = α s/f_norm) | `Zero` | `Zero` |
/// | `nan` | `Reject` | `Reject` | `Exclude` | `Reject` |
///
/// Source: verl b178a3cd `compute_gpg_outcome_advantage` (`f_norm` defaults to 1.0; a
/// one-sample group's mean is taken as 0); GPG [2504.02546]. verl has no vectorized GPG, so
/// `VerlVectorized` equals `Verl`; TRL and OpenRLHF have none and get the defaults (with TRL's
/// NaN policy).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpgConfig {
    /// The normaliser `f_norm` that divides every advantage (> 0, finite). verl's default is 1;
    /// the GPG paper's F_norm is either 1 or the group std — for the latter, use
    /// [`zscore`](super::zscore::zscore) and multiply by α.
    pub f_norm: f64,
    /// What a group with one scorable sample gets: `Zero` → 0, `VerlLoop` → μ = 0
    /// (`A = α s/f_norm`), `Reject` → error.
    pub singleton: SingletonRule,
    /// What a NaN score means (unscorable: left out of B, #nonzero and μ; advantage 0).
    pub nan: NanPolicy,
}

impl Default for GpgConfig {
    fn default() -> Self {
        GpgConfig {
            f_norm: 1.0,
            singleton: SingletonRule::Zero,
            nan: NanPolicy::Reject,
        }
    }
}

impl GpgConfig {
    /// The configuration a peer uses (see [`GpgConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        match preset {
            Preset::Verl | Preset::VerlVectorized => GpgConfig {
                singleton: SingletonRule::VerlLoop,
                ..Self::default()
            },
            Preset::Trl => GpgConfig {
                nan: NanPolicy::Exclude,
                ..Self::default()
            },
            _ => Self::default(),
        }
    }
}

/// GPG advantage: `A_i = α (s_i − μ_g) / f_norm` with the batch factor
/// `α = B / max(#{j : s_j ≠ 0}, 1)`.
///
/// B is the number of (scorable) samples in the batch and the count runs over the whole batch,
/// as in verl (`bsz / count_nonzero(scores).clamp(min=1)`): with binary rewards α is the
/// inverse fraction of successful samples, which rescales the gradient of a batch with few
/// successes. `f_norm` is a constant normaliser from the config (verl default 1). μ_g is the
/// Welford mean (equal scores → exactly 0; two samples → exactly ±c).
///
/// Source: GPG [2504.02546] as implemented by \[verl\] (the paper counts the samples of
/// non-degenerate groups instead; MATH.md fixes verl's count).
///
/// # Errors
/// Nothing is written on error. [`Error::InvalidParam`] unless `f_norm` is finite and > 0;
/// [`Error::LengthMismatch`], layout errors, [`Error::NonFinite`] for ±∞ or rejected NaN scores
/// (or an overflowing advantage); [`Error::GroupTooSmall`] for a singleton under
/// [`SingletonRule::Reject`].
///
/// # Example
/// ```
/// use grpo_core::advantage::gpg::{gpg, GpgConfig};
/// use grpo_core::Groups;
/// // Groups (1, 0) and (0, 0): B = 4, one nonzero score → α = 4.
/// // Group 0: μ = 0.5 → A = 4·(±0.5) = ±2; group 1: 0.
/// let mut adv = [0.0f64; 4];
/// gpg(&[1.0, 0.0, 0.0, 0.0], Groups::Uniform(2), &GpgConfig::default(), &mut adv).unwrap();
/// assert_eq!(adv, [2.0, -2.0, 0.0, 0.0]);
/// ```
pub fn gpg<T: Real>(
    scores: &[T],
    groups: Groups<'_>,
    cfg: &GpgConfig,
    out: &mut [T],
) -> Result<Diagnostics<T>> {
    let n = scores.len();
    check_len("out", n, out.len())?;
    ensure(
        cfg.f_norm.is_finite() && cfg.f_norm > 0.0,
        "f_norm",
        "must be finite and > 0",
    )?;
    let num_groups = validate_groups(&groups, n)?;
    let nans = check_values("scores", scores, cfg.nan)?;
    let value = |i: usize| scores.get(i).copied().and_then(scorable);
    let batch = n - nans;
    let nonzero = scores
        .iter()
        .filter(|&&s| s != T::ZERO && !s.is_nan())
        .count();
    let alpha = T::from_usize(batch) / T::from_usize(nonzero.max(1));
    let f_norm = T::from_f64(cfg.f_norm);
    ensure(
        f_norm > T::ZERO && f_norm.is_finite(),
        "f_norm",
        "must be representable (finite and nonzero) in the scalar type",
    )?;
    check_then_write(out, |emit| {
        let mut diag = Diagnostics {
            groups: num_groups,
            ..Diagnostics::default()
        };
        for k in 0..num_groups {
            let st = GroupStats::of(groups.members(k), &value);
            diag.nan_excluded += groups.size(k) - st.n();
            let verl_singleton = match st.n() {
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
                        SingletonRule::VerlLoop => true,
                        SingletonRule::Zero => {
                            for i in groups.members(k) {
                                emit(i, T::ZERO);
                            }
                            continue;
                        }
                    }
                }
                m => {
                    if m >= 2 && st.zero_spread() {
                        diag.zero_variance_groups += 1;
                    }
                    false
                }
            };
            for i in groups.members(k) {
                let a = value(i).map_or(T::ZERO, |s| {
                    let c = if verl_singleton { s } else { st.centered(s) };
                    alpha * c / f_norm
                });
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
    fn hand_computed_alpha_and_f_norm() {
        // Batch (3, 0, 0 | 1, 1, 4), f_norm = 2: B = 6, nonzero = 4 → α = 1.5.
        // Group 0: μ = 1 → (2, −1, −1)·1.5/2 = (1.5, −0.75, −0.75).
        // Group 1: μ = 2 → (−1, −1, 2)·0.75 = (−0.75, −0.75, 1.5).
        let cfg = GpgConfig {
            f_norm: 2.0,
            ..GpgConfig::default()
        };
        let mut a = [0.0f64; 6];
        gpg(
            &[3.0, 0.0, 0.0, 1.0, 1.0, 4.0],
            Groups::Uniform(3),
            &cfg,
            &mut a,
        )
        .unwrap();
        assert_eq!(a, [1.5, -0.75, -0.75, -0.75, -0.75, 1.5]);
        // All zero: α = B/1, every advantage 0.
        gpg(&[0.0; 6], Groups::Uniform(3), &cfg, &mut a).unwrap();
        assert_eq!(a, [0.0; 6]);
    }

    #[test]
    fn singletons_and_params() {
        // (2 | 1, 0): B = 3, nonzero 2 → α = 1.5. verl: singleton μ = 0 → 1.5·2 = 3;
        // pair μ = 0.5 → ±0.75.
        let s = [2.0f64, 1.0, 0.0];
        let g = Groups::Offsets(&[0, 1, 3]);
        let mut a = [0.0; 3];
        let d = gpg(&s, g, &GpgConfig::from_preset(Preset::Verl), &mut a).unwrap();
        assert_eq!(a, [3.0, 0.75, -0.75]);
        assert_eq!(d.singleton_groups, 1);
        gpg(&s, g, &GpgConfig::default(), &mut a).unwrap();
        assert_eq!(a, [0.0, 0.75, -0.75]);
        let mut b = [6.0f64; 3];
        for f in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let cfg = GpgConfig {
                f_norm: f,
                ..GpgConfig::default()
            };
            assert!(matches!(
                gpg(&s, g, &cfg, &mut b),
                Err(Error::InvalidParam { name: "f_norm", .. })
            ));
        }
        assert_eq!(b, [6.0; 3]);
    }

    #[test]
    fn nan_policy() {
        // TRL: (NaN, 1, 0, 0): B = 3 scorable, nonzero 1 → α = 3; group (1, 0, 0) after
        // exclusion: μ = 1/3 → A = 3·(2/3, −1/3, −1/3) = (2, −1, −1).
        let mut a = [0.0f64; 4];
        let d = gpg(
            &[f64::NAN, 1.0, 0.0, 0.0],
            Groups::Uniform(4),
            &GpgConfig::from_preset(Preset::Trl),
            &mut a,
        )
        .unwrap();
        assert_eq!(a[0], 0.0);
        for (x, w) in a[1..].iter().zip([2.0, -1.0, -1.0]) {
            assert!((x - w).abs() < 1e-15);
        }
        assert_eq!(d.nan_excluded, 1);
    }
}
