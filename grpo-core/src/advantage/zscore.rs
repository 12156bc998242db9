//! The GRPO z-score and its configurations: the std dial, Dr. GRPO, batch scaling, 2-GRPO
//! (MATH.md §0, §2, §6).

use super::group_scan::{
    Emit, GroupStats, check_nonneg, check_then_write, check_values, dial, ratio, scorable,
    std_floored, validate_groups,
};
use super::{Diagnostics, NanPolicy, SingletonRule};
use crate::error::{Error, Result, check_len, ensure};
use crate::layout::Groups;
use crate::presets::Preset;
use crate::real::Real;
use crate::stats::{Bessel, Moments};

/// What the centered score `s − μ_g` is divided by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scale {
    /// The group's own standard deviation σ_g (GRPO). Default.
    #[default]
    Group,
    /// The standard deviation of every scorable score in the batch, while the mean subtracted
    /// is still the group's (TRL `scale_rewards="batch"`). Computed by merging the groups'
    /// [`Moments`] in group order (Chan), the same merge a data-parallel all-reduce performs.
    Batch,
    /// No division: `A = s − μ_g` (Dr. GRPO [2503.20783], TRL `scale_rewards="none"`).
    None,
}

/// Configuration of [`zscore`]: `A = (s − μ_g) / (σ + ε)^γ`.
///
/// | field | Paper (default) | Verl | VerlVectorized | Trl | OpenRlhf |
/// |---|---|---|---|---|---|
/// | `eps` | 1e-6 | 1e-6 | 1e-6 | 1e-4 | 1e-9 |
/// | `bessel` | unbiased | unbiased | unbiased | unbiased | unbiased |
/// | `var_floor` | none | none | 1e-6 | none | none |
/// | `singleton` | `Zero` | `VerlLoop` | `VerlLoop` | `Zero` | `Reject` |
/// | `nan` | `Reject` | `Reject` | `Reject` | `Exclude` | `Reject` |
/// | `gamma`, `scale` | 1, `Group` | 1, `Group` | 1, `Group` | 1, `Group` | 1, `Group` |
///
/// Sources (MATH.md §6): verl b178a3cd `compute_grpo_outcome_advantage` (loop: ε = 1e-6,
/// `torch.std`, a singleton group gets μ = 0, σ = 1) and its vectorized variant
/// `compute_grpo_vectorized_outcome_advantage` (σ = sqrt(max(var_unb, 1e-6)); its statistics
/// come from `verl.utils.groupwise.group_mean_std`, which also gives a singleton group μ = 0,
/// σ = 1, so a singleton's advantage is `s/(1 + ε)` as in the loop — MATH.md §0 says 0 for the
/// vectorized variant, which no verl version we read does); TRL f2cd577 (ε = 1e-4, `std` unbiased,
/// NaN rewards unscorable, singleton → 0; `scale_rewards` maps to [`Scale`]); OpenRLHF 3c3be62
/// `group_norm` (ε = 1e-9, unbiased std; a singleton group divides 0 by 0 there and yields NaN,
/// which we never produce: the preset refuses such a batch, set `singleton = Zero` to get 0).
/// The GRPO paper [2402.03300] leaves ε open; the default follows verl, the reference trainer.
/// Presets reproduce semantics, not rounding: statistics are Welford in every preset, so
/// identical rewards give exactly 0 where a one-pass fp32 variance would leave residue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ZScoreConfig {
    /// ε added to the standard deviation before the division (≥ 0).
    pub eps: f64,
    /// Variance divisor of σ (group and batch).
    pub bessel: Bessel,
    /// The std dial γ ∈ [0, 1] of [2607.00152]: the divisor is `(σ + ε)^γ`; γ = 1 is GRPO,
    /// γ = 0 is Dr. GRPO.
    pub gamma: f64,
    /// Optional variance floor f: σ = sqrt(max(var, f)) (verl vectorized uses f = ε = 1e-6).
    pub var_floor: Option<f64>,
    /// Which standard deviation divides the centered score.
    pub scale: Scale,
    /// What a group with exactly one scorable sample gets.
    pub singleton: SingletonRule,
    /// What a NaN score means.
    pub nan: NanPolicy,
}

impl Default for ZScoreConfig {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl ZScoreConfig {
    /// The configuration a peer uses (see the table on [`ZScoreConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        let paper = ZScoreConfig {
            eps: 1e-6,
            bessel: Bessel::Unbiased,
            gamma: 1.0,
            var_floor: None,
            scale: Scale::Group,
            singleton: SingletonRule::Zero,
            nan: NanPolicy::Reject,
        };
        match preset {
            Preset::Verl => ZScoreConfig {
                singleton: SingletonRule::VerlLoop,
                ..paper
            },
            Preset::VerlVectorized => ZScoreConfig {
                var_floor: Some(1e-6),
                singleton: SingletonRule::VerlLoop,
                ..paper
            },
            Preset::Trl => ZScoreConfig {
                eps: 1e-4,
                nan: NanPolicy::Exclude,
                ..paper
            },
            Preset::OpenRlhf => ZScoreConfig {
                eps: 1e-9,
                singleton: SingletonRule::Reject,
                ..paper
            },
            _ => paper,
        }
    }

    /// Dr. GRPO [2503.20783]: `A = s − μ_g` (no division; singleton → 0).
    ///
    /// The same code path as GRPO with [`Scale::None`]; equivalently γ = 0.
    pub fn dr_grpo() -> Self {
        ZScoreConfig {
            scale: Scale::None,
            ..Self::default()
        }
    }

    /// 2-GRPO [2510.00977]: GRPO on groups of two (use `Groups::Uniform(2)`). With two scorable
    /// samples the advantages are exactly `±c` (or both 0 when the scores tie), where
    /// `c = (|s₂ − s₁|/2)/(σ + ε)` and σ = |s₂ − s₁|/√2 (unbiased): `c → 1/√2` as the gap grows.
    pub fn two_grpo() -> Self {
        Self::default()
    }

    /// This configuration with the std dial set to `gamma` ([2607.00152]).
    pub fn with_gamma(self, gamma: f64) -> Self {
        ZScoreConfig { gamma, ..self }
    }

    /// This configuration with another [`Scale`].
    pub fn with_scale(self, scale: Scale) -> Self {
        ZScoreConfig { scale, ..self }
    }

    /// Checks the parameters.
    ///
    /// # Errors
    /// [`Error::InvalidParam`] if `eps` or `var_floor` is negative or not finite, or `gamma` is
    /// outside [0, 1] (NaN included).
    pub fn validate(&self) -> Result<()> {
        check_nonneg("eps", self.eps)?;
        ensure(
            self.gamma >= 0.0 && self.gamma <= 1.0,
            "gamma",
            "must be in [0, 1]",
        )?;
        if let Some(f) = self.var_floor {
            check_nonneg("var_floor", f)?;
        }
        Ok(())
    }
}

/// GRPO group z-score: `A_i = (s_i − μ_g) / (σ + ε)^γ`, written to `out`.
///
/// * μ_g is the mean of the scorable scores of sample i's group (Welford, so a group of equal
///   scores, e.g. 0.1 × 16, gets exactly 0);
/// * σ is, by [`Scale`], the group's std, the batch's std (TRL `scale_rewards="batch"`), or 1
///   (Dr. GRPO); with the chosen Bessel divisor and optional floor `sqrt(max(var, f))`;
/// * a group of two scorable samples gets exactly `±c` (2-GRPO [2510.00977]);
/// * a singleton group follows `cfg.singleton`: `Zero` → 0; `VerlLoop` → μ = 0, σ = 1, so
///   `A = s/(1 + ε)^γ` (and `A = s` for [`Scale::None`]); `Reject` → error;
/// * a NaN score under [`NanPolicy::Exclude`] is left out of every statistic and gets 0; a group
///   with no scorable sample gets 0 everywhere.
///
/// Sources: GRPO [2402.03300], the dial [2607.00152], Dr. GRPO [2503.20783], \[verl\], \[TRL\],
/// \[OpenRLHF\] (see [`ZScoreConfig`] for the presets).
///
/// # Errors
/// Nothing is written on error. [`Error::LengthMismatch`] if `out.len() != scores.len()`;
/// [`Error::InvalidParam`] for a bad config or layout; [`Error::InvalidOffsets`],
/// [`Error::EmptyGroup`] for bad groups; [`Error::NonFinite`] for ±∞ (or NaN under
/// [`NanPolicy::Reject`]) in `scores`, or `what = "advantages"` if an advantage overflows;
/// [`Error::GroupTooSmall`] for a singleton under [`SingletonRule::Reject`].
///
/// # Example
/// ```
/// use grpo_core::advantage::zscore::{zscore, ZScoreConfig};
/// use grpo_core::{Groups, Preset};
/// // Two groups of 2: (1, 0) and (0.5, 0.5).
/// let scores = [1.0f64, 0.0, 0.5, 0.5];
/// let mut adv = [0.0; 4];
/// let cfg = ZScoreConfig { eps: 0.0, ..ZScoreConfig::default() };
/// let diag = zscore(&scores, Groups::Uniform(2), &cfg, &mut adv).unwrap();
/// // Group 0: μ = 0.5, σ_unb = sqrt(0.5) → ±0.5/0.70710678… = ±0.70710678…
/// assert!((adv[0] - 0.5f64.sqrt()).abs() < 1e-15 && adv[1] == -adv[0]);
/// assert_eq!(&adv[2..], &[0.0, 0.0]);
/// assert_eq!(diag.zero_variance_groups, 1);
/// // Dr. GRPO: A = s − μ.
/// zscore(&scores, Groups::Uniform(2), &ZScoreConfig::dr_grpo(), &mut adv).unwrap();
/// assert_eq!(adv, [0.5, -0.5, 0.0, 0.0]);
/// // verl's loop treats a singleton group as μ = 0, σ = 1: A = s / (1 + 1e-6).
/// zscore(&[2.0], Groups::Uniform(1), &ZScoreConfig::from_preset(Preset::Verl), &mut adv[..1])
///     .unwrap();
/// assert_eq!(adv[0], 2.0 / (1.0 + 1e-6));
/// ```
pub fn zscore<T: Real>(
    scores: &[T],
    groups: Groups<'_>,
    cfg: &ZScoreConfig,
    out: &mut [T],
) -> Result<Diagnostics<T>> {
    let n = scores.len();
    check_len("out", n, out.len())?;
    cfg.validate()?;
    let num_groups = validate_groups(&groups, n)?;
    check_values("scores", scores, cfg.nan)?;
    let value = |i: usize| scores.get(i).copied().and_then(scorable);
    check_then_write(out, |emit| {
        zscore_core(cfg, &groups, num_groups, &value, emit)
    })
}

/// The z-score over validated inputs: `value(i)` is sample i's score (`None` = unscorable).
/// Shared with the reward combination, which feeds it weighted sums.
pub(crate) fn zscore_core<T: Real>(
    cfg: &ZScoreConfig,
    groups: &Groups<'_>,
    num_groups: usize,
    value: &dyn Fn(usize) -> Option<T>,
    emit: Emit<'_, T>,
) -> Result<Diagnostics<T>> {
    let eps = T::from_f64(cfg.eps);
    let batch_den = match cfg.scale {
        Scale::Batch => {
            let mut all = Moments::new();
            for k in 0..num_groups {
                all = all.merge(GroupStats::of(groups.members(k), value).moments);
            }
            // Fewer than two scorable samples in the batch: no group has two, so this
            // divisor is never applied to a nonzero numerator; any value would do.
            let sigma = std_floored(&all, cfg.bessel, cfg.var_floor).unwrap_or(T::ZERO);
            dial(sigma + eps, cfg.gamma)
        }
        Scale::Group | Scale::None => T::ONE,
    };
    let mut diag = Diagnostics {
        groups: num_groups,
        ..Diagnostics::default()
    };
    for k in 0..num_groups {
        let st = GroupStats::of(groups.members(k), value);
        diag.nan_excluded += groups.size(k) - st.n();
        if st.n() == 1 {
            diag.singleton_groups += 1;
            match cfg.singleton {
                SingletonRule::Reject => {
                    return Err(Error::GroupTooSmall {
                        group: k,
                        needed: 2,
                        found: 1,
                    });
                }
                SingletonRule::Zero => {}
                SingletonRule::VerlLoop => {
                    // μ = 0, σ = 1: the score itself over (1 + ε)^γ.
                    let den = match cfg.scale {
                        Scale::None => T::ONE,
                        Scale::Group | Scale::Batch => dial(T::ONE + eps, cfg.gamma),
                    };
                    for i in groups.members(k) {
                        emit(i, value(i).map_or(T::ZERO, |s| ratio(s, den)));
                    }
                    continue;
                }
            }
            for i in groups.members(k) {
                emit(i, T::ZERO);
            }
            continue;
        }
        if st.n() >= 2 && st.zero_spread() {
            diag.zero_variance_groups += 1;
        }
        let den = match cfg.scale {
            Scale::Group => {
                // n ≥ 2 here (n = 0 centers nothing), so the std is defined; 0 is a safe
                // fallback that `ratio` turns into advantage 0.
                let sigma = st.std_floored(cfg.bessel, cfg.var_floor).unwrap_or(T::ZERO);
                dial(sigma + eps, cfg.gamma)
            }
            Scale::Batch => batch_den,
            Scale::None => T::ONE,
        };
        for i in groups.members(k) {
            emit(i, value(i).map_or(T::ZERO, |s| ratio(st.centered(s), den)));
        }
    }
    Ok(diag)
}

#[cfg(test)]
mod tests {
    use super::*;
    extern crate std;
    use std::vec;
    use std::vec::Vec;

    fn run(scores: &[f64], groups: Groups<'_>, cfg: &ZScoreConfig) -> (Vec<f64>, Diagnostics<f64>) {
        let mut out = vec![0.0; scores.len()];
        let d = zscore(scores, groups, cfg, &mut out).unwrap();
        (out, d)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * (1.0 + b.abs())
    }

    #[test]
    fn hand_computed_group_of_four() {
        // s = 3, 1, 0, 0: μ = 1, deviations 2, 0, −1, −1, Σd² = 6,
        // var_unb = 2, σ = √2 = 1.41421356…; ε = 1e-6 (Paper):
        // A = (2, 0, −1, −1)/(√2 + 1e-6).
        let (a, d) = run(
            &[3.0, 1.0, 0.0, 0.0],
            Groups::Uniform(4),
            &ZScoreConfig::default(),
        );
        let den = 2f64.sqrt() + 1e-6;
        let want = [2.0 / den, 0.0, -1.0 / den, -1.0 / den];
        for (x, w) in a.iter().zip(want) {
            assert!(close(*x, w), "{x} vs {w}");
        }
        assert_eq!(d.groups, 1);
        assert_eq!(d.zero_variance_groups, 0);
        assert!(close(d.max, 2.0 / den) && close(d.min, -1.0 / den));
    }

    #[test]
    fn preset_epsilons() {
        // Group (1, 0): μ = 0.5, σ_unb = sqrt(0.5) = 0.7071067811865476.
        let s = [1.0, 0.0];
        let sig = 0.5f64.sqrt();
        for (p, eps) in [
            (Preset::Paper, 1e-6),
            (Preset::Verl, 1e-6),
            (Preset::Trl, 1e-4),
            (Preset::OpenRlhf, 1e-9),
        ] {
            let (a, _) = run(&s, Groups::Uniform(2), &ZScoreConfig::from_preset(p));
            assert!(close(a[0], 0.5 / (sig + eps)), "{p:?}");
            assert_eq!(a[1], -a[0]);
        }
        // verl vectorized: var = 0.5 > floor 1e-6, so σ = sqrt(0.5) and the result is verl's.
        let (a, _) = run(
            &s,
            Groups::Uniform(2),
            &ZScoreConfig::from_preset(Preset::VerlVectorized),
        );
        assert!(close(a[0], 0.5 / (sig + 1e-6)));
    }

    #[test]
    fn verl_vectorized_floor_binds_on_tiny_variance() {
        // (1e-4, 0): μ = 5e-5, deviations ±5e-5, var_unb = 2·(5e-5)²/1 = 5e-9 < 1e-6,
        // so σ = sqrt(1e-6) = 1e-3 and A = ±5e-5/(1e-3 + 1e-6) = ±0.04995004995…
        let (a, _) = run(
            &[1e-4, 0.0],
            Groups::Uniform(2),
            &ZScoreConfig::from_preset(Preset::VerlVectorized),
        );
        assert!(close(a[0], 5e-5 / (1e-3 + 1e-6)), "{}", a[0]);
        assert_eq!(a[1], -a[0]);
        // The loop version has no floor: σ = sqrt(5e-9) = 7.0710678e-5,
        // A = 5e-5/(7.0710678e-5 + 1e-6) = 0.69721…
        let (b, _) = run(
            &[1e-4, 0.0],
            Groups::Uniform(2),
            &ZScoreConfig::from_preset(Preset::Verl),
        );
        assert!(close(b[0], 5e-5 / (5e-9f64.sqrt() + 1e-6)));
    }

    #[test]
    fn singleton_rules_per_preset() {
        // Groups: [2, 4] and the singleton [3].
        let offs = [0, 2, 3];
        let s = [2.0, 4.0, 3.0];
        // verl, loop and vectorized (`group_mean_std`): singleton μ = 0, σ = 1 → 3/(1 + 1e-6).
        for p in [Preset::Verl, Preset::VerlVectorized] {
            let (a, d) = run(&s, Groups::Offsets(&offs), &ZScoreConfig::from_preset(p));
            assert_eq!(a[2], 3.0 / (1.0 + 1e-6), "{p:?}");
            assert_eq!(d.singleton_groups, 1);
        }
        // TRL and the default: 0.
        for p in [Preset::Trl, Preset::Paper] {
            let (a, d) = run(&s, Groups::Offsets(&offs), &ZScoreConfig::from_preset(p));
            assert_eq!(a[2], 0.0);
            assert_eq!(d.singleton_groups, 1);
        }
        // OpenRLHF refuses (it would produce NaN) and writes nothing.
        let mut out = [7.0; 3];
        assert_eq!(
            zscore(
                &s,
                Groups::Offsets(&offs),
                &ZScoreConfig::from_preset(Preset::OpenRlhf),
                &mut out
            ),
            Err(Error::GroupTooSmall {
                group: 1,
                needed: 2,
                found: 1
            })
        );
        assert_eq!(out, [7.0; 3]);
        // verl loop without std division: A = s.
        let cfg = ZScoreConfig::from_preset(Preset::Verl).with_scale(Scale::None);
        assert_eq!(run(&s, Groups::Offsets(&offs), &cfg).0[2], 3.0);
    }

    #[test]
    fn trl_nan_is_unscorable() {
        // Group (1, NaN, 0, 0.5): scorable 1, 0, 0.5 → μ = 0.5, deviations 0.5, −0.5, 0,
        // var_unb = 0.5/2 = 0.25, σ = 0.5; ε = 1e-4 → A = ±0.5/0.5001; NaN → 0.
        let (a, d) = run(
            &[1.0, f64::NAN, 0.0, 0.5],
            Groups::Uniform(4),
            &ZScoreConfig::from_preset(Preset::Trl),
        );
        assert!(close(a[0], 0.5 / 0.5001));
        assert_eq!(a[1], 0.0);
        assert!(close(a[2], -0.5 / 0.5001));
        assert_eq!(a[3], 0.0);
        assert_eq!(d.nan_excluded, 1);
        // One NaN in a pair leaves a singleton: 0 under TRL.
        let (a, d) = run(
            &[f64::NAN, 4.0],
            Groups::Uniform(2),
            &ZScoreConfig::from_preset(Preset::Trl),
        );
        assert_eq!(a, [0.0, 0.0]);
        assert_eq!((d.singleton_groups, d.nan_excluded), (1, 1));
    }

    #[test]
    fn batch_scale_keeps_group_mean() {
        // Groups (1, 0) and (3, 3). Group means 0.5 and 3. Batch values 1, 0, 3, 3:
        // mean 7/4 = 1.75, deviations −0.75, −1.75, 1.25, 1.25, Σd² = 0.5625 + 3.0625 +
        // 2·1.5625 = 6.75, var_unb = 2.25, σ = 1.5; TRL ε = 1e-4:
        // A = (±0.5)/1.5001 for group 0, 0 for group 1.
        let cfg = ZScoreConfig::from_preset(Preset::Trl).with_scale(Scale::Batch);
        let (a, d) = run(&[1.0, 0.0, 3.0, 3.0], Groups::Uniform(2), &cfg);
        assert!(close(a[0], 0.5 / 1.5001) && a[1] == -a[0]);
        assert_eq!(&a[2..], &[0.0, 0.0]);
        assert_eq!(d.zero_variance_groups, 1);
    }

    #[test]
    fn dial_interpolates() {
        // (1, 0): σ_unb = sqrt(0.5); ε = 0; γ = 0.5 → A = 0.5 / 0.5^{1/4} = 0.5^{3/4}.
        let cfg = ZScoreConfig {
            eps: 0.0,
            ..ZScoreConfig::default()
        }
        .with_gamma(0.5);
        let (a, _) = run(&[1.0, 0.0], Groups::Uniform(2), &cfg);
        assert!(close(a[0], 0.5f64.powf(0.75)));
        let (b, _) = run(&[1.0, 0.0], Groups::Uniform(2), &cfg.with_gamma(0.0));
        assert_eq!(b, [0.5, -0.5]);
    }

    #[test]
    fn identical_non_dyadic_rewards_give_exact_zero() {
        for p in [
            Preset::Paper,
            Preset::Verl,
            Preset::VerlVectorized,
            Preset::Trl,
            Preset::OpenRlhf,
        ] {
            let cfg = ZScoreConfig {
                eps: 0.0,
                ..ZScoreConfig::from_preset(p)
            };
            for scale in [Scale::Group, Scale::Batch, Scale::None] {
                let cfg = cfg.with_scale(scale);
                let mut o32 = [1.0f32; 16];
                zscore(&[0.1f32; 16], Groups::Uniform(16), &cfg, &mut o32).unwrap();
                assert_eq!(o32, [0.0; 16]);
                let mut o64 = [1.0f64; 8];
                let d = zscore(&[1e4 + 0.3; 8], Groups::Uniform(8), &cfg, &mut o64).unwrap();
                assert_eq!(o64, [0.0; 8]);
                assert_eq!(d.zero_variance_groups, 1);
                let mut o32 = [1.0f32; 8];
                zscore(&[1e4f32 + 0.3; 8], Groups::Uniform(8), &cfg, &mut o32).unwrap();
                assert_eq!(o32, [0.0; 8]);
            }
        }
    }

    #[test]
    fn bad_input_is_rejected_untouched() {
        let cfg = ZScoreConfig::default();
        let mut out = [9.0f64; 4];
        let s = [1.0, 2.0, 3.0, 4.0];
        assert!(matches!(
            zscore(&s, Groups::Uniform(2), &cfg, &mut out[..3]),
            Err(Error::LengthMismatch { what: "out", .. })
        ));
        assert_eq!(
            zscore(&s, Groups::Offsets(&[0, 2, 2, 4]), &cfg, &mut out),
            Err(Error::EmptyGroup { group: 1 })
        );
        assert_eq!(
            zscore(&s, Groups::Offsets(&[0, 3, 2, 4]), &cfg, &mut out),
            Err(Error::InvalidOffsets { index: 2 })
        );
        assert!(matches!(
            zscore(&s, Groups::Uniform(3), &cfg, &mut out),
            Err(Error::InvalidParam { .. })
        ));
        let neg = ZScoreConfig { eps: -1e-6, ..cfg };
        assert!(matches!(
            zscore(&s, Groups::Uniform(2), &neg, &mut out),
            Err(Error::InvalidParam { name: "eps", .. })
        ));
        let nan_eps = ZScoreConfig {
            eps: f64::NAN,
            ..cfg
        };
        assert!(matches!(
            zscore(&s, Groups::Uniform(2), &nan_eps, &mut out),
            Err(Error::InvalidParam { name: "eps", .. })
        ));
        for g in [1.5, -0.1, f64::NAN] {
            assert!(matches!(
                zscore(&s, Groups::Uniform(2), &cfg.with_gamma(g), &mut out),
                Err(Error::InvalidParam { name: "gamma", .. })
            ));
        }
        assert_eq!(
            zscore(
                &[1.0, f64::NAN, 3.0, 4.0],
                Groups::Uniform(2),
                &cfg,
                &mut out
            ),
            Err(Error::NonFinite {
                what: "scores",
                index: 1
            })
        );
        for bad in [f64::INFINITY, f64::NEG_INFINITY] {
            let trl = ZScoreConfig::from_preset(Preset::Trl);
            assert_eq!(
                zscore(&[1.0, 2.0, bad, 4.0], Groups::Uniform(2), &trl, &mut out),
                Err(Error::NonFinite {
                    what: "scores",
                    index: 2
                })
            );
        }
        let mut scratch = [0usize; 8];
        assert!(matches!(
            Groups::from_group_ids(&[0, 1, 5, 0], 2, &mut scratch),
            Err(Error::GroupIdOutOfRange { index: 2, .. })
        ));
        assert_eq!(out, [9.0; 4]);
    }

    #[test]
    fn overflowing_scores_are_an_error_not_inf() {
        // Gap 2·f32::MAX overflows: Err, output untouched.
        let mut out = [5.0f32; 2];
        let r = zscore(
            &[f32::MAX, -f32::MAX],
            Groups::Uniform(2),
            &ZScoreConfig::default(),
            &mut out,
        );
        assert!(matches!(
            r,
            Err(Error::NonFinite {
                what: "advantages",
                ..
            })
        ));
        assert_eq!(out, [5.0; 2]);
    }

    #[test]
    fn layouts_agree() {
        let s = [0.3, 0.9, 0.1, 0.0, 1.0, 0.7];
        let cfg = ZScoreConfig::from_preset(Preset::Trl);
        let (u, _) = run(&s, Groups::Uniform(3), &cfg);
        let (o, _) = run(&s, Groups::Offsets(&[0, 3, 6]), &cfg);
        assert_eq!(u, o);
        // Interleave the two groups: batch position 2j + k holds sample j of group k.
        let inter = [s[0], s[3], s[1], s[4], s[2], s[5]];
        let ids = [0, 1, 0, 1, 0, 1];
        let mut scratch = [0usize; Groups::group_ids_scratch_len(6, 2)];
        let g = Groups::from_group_ids(&ids, 2, &mut scratch).unwrap();
        let (p, _) = run(&inter, g, &cfg);
        assert_eq!(p, [u[0], u[3], u[1], u[4], u[2], u[5]]);
    }
}
