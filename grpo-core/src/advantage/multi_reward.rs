//! Several rewards per sample: GDPO (normalise each reward, then sum), reward combination
//! (sum, then normalise) and DVAO (one shared variance scale) (MATH.md §2).
//!
//! Rewards come as a row-major `[n, K]` slice: sample i's K rewards are
//! `rewards[i*K..(i+1)*K]`. Statistics are Welford per reward and group, so identical rewards
//! give exactly 0.

use super::group_scan::{
    check_matrix, check_nonneg, check_scratch, check_then_write, ratio, std_floored,
    validate_groups,
};
use super::zscore::{ZScoreConfig, zscore_core};
use super::{Diagnostics, NanPolicy, SingletonRule};
use crate::error::{Error, Result, check_len};
use crate::layout::Groups;
use crate::presets::Preset;
use crate::real::Real;
use crate::stats::{Bessel, Moments};

/// Checks the `[n, K]` rewards: ±∞ always fails, NaN fails under [`NanPolicy::Reject`].
fn check_rewards<T: Real>(rewards: &[T], nan: NanPolicy) -> Result<()> {
    super::group_scan::check_values("rewards", rewards, nan).map(|_| ())
}

/// Checks that every weight is finite.
fn check_weights<T: Real>(weights: &[T], num_rewards: usize) -> Result<()> {
    check_len("weights", num_rewards, weights.len())?;
    match weights.iter().position(|w| !w.is_finite()) {
        Some(index) => Err(Error::NonFinite {
            what: "weights",
            index,
        }),
        None => Ok(()),
    }
}

/// Reward r of sample i with NaN read as 0 (DVAO's NaN policy).
#[inline]
fn reward0<T: Real>(rewards: &[T], num_rewards: usize, i: usize, r: usize) -> T {
    reward(rewards, num_rewards, i, r).unwrap_or(T::ZERO)
}

/// Reward r of sample i, `None` for NaN (GDPO's NaN policy).
#[inline]
fn reward<T: Real>(rewards: &[T], num_rewards: usize, i: usize, r: usize) -> Option<T> {
    rewards
        .get(i * num_rewards + r)
        .copied()
        .filter(|v| !v.is_nan())
}

/// Counts NaN rewards of group k's samples.
fn count_nan<T: Real>(rewards: &[T], num_rewards: usize, groups: &Groups<'_>, k: usize) -> usize {
    groups
        .members(k)
        .map(|i| {
            rewards
                .get(i * num_rewards..(i + 1) * num_rewards)
                .map_or(0, |row| row.iter().filter(|v| v.is_nan()).count())
        })
        .sum()
}

/// Scratch elements [`gdpo`] needs for `num_rewards` rewards: two per reward.
pub const fn gdpo_scratch_len(num_rewards: usize) -> usize {
    num_rewards.saturating_mul(2)
}

/// Configuration of [`gdpo`].
///
/// Every preset uses ε = 1e-4 in both normalisations and the unbiased std (GDPO [2601.05242];
/// TRL f2cd577 `multi_objective_aggregation="normalize_then_sum"`, where a one-sample group's
/// per-reward std is 0 and its z is 0). `Trl` additionally excludes NaN rewards as TRL's
/// `nanmean`/`nanstd`/`nansum` do (see [`gdpo`]); the others reject NaN.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GdpoConfig {
    /// ε of the per-reward, per-group normalisation `(r − μ)/(σ + ε)` (≥ 0).
    pub reward_eps: f64,
    /// ε of the final batch normalisation (≥ 0).
    pub batch_eps: f64,
    /// Variance divisor of both normalisations.
    pub bessel: Bessel,
    /// What a one-sample group's z gets: `Zero` → 0; `VerlLoop` → μ = 0, σ = 1, so
    /// `z_k = r_k/(1 + ε)`; `Reject` → error.
    pub singleton: SingletonRule,
    /// NaN rewards: `Reject` → error; `Exclude` → the reward is left out of its statistics and
    /// adds nothing to `S` (TRL), counted in [`Diagnostics::nan_excluded`] (one count per NaN
    /// reward); a sample whose rewards are all NaN is unscorable: left out of the batch
    /// statistics, advantage 0.
    pub nan: NanPolicy,
}

impl Default for GdpoConfig {
    fn default() -> Self {
        GdpoConfig {
            reward_eps: 1e-4,
            batch_eps: 1e-4,
            bessel: Bessel::Unbiased,
            singleton: SingletonRule::Zero,
            nan: NanPolicy::Reject,
        }
    }
}

impl GdpoConfig {
    /// The configuration a peer uses (see [`GdpoConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        match preset {
            Preset::Trl => GdpoConfig {
                nan: NanPolicy::Exclude,
                ..Self::default()
            },
            _ => Self::default(),
        }
    }
}

/// GDPO (group reward-decoupled normalisation): per reward k and group g
/// `z_k = (r_k − μ_{k,g})/(σ_{k,g} + ε_r)`, then `S = Σ_k w_k z_k` and
/// `A = (S − μ_batch)/(σ_batch + ε_b)` over the whole batch.
///
/// Normalising each reward before summing keeps reward combinations apart that a plain sum
/// merges (e.g. (1, 0) and (0, 1) in one group), and keeps a high-variance reward from
/// drowning the others. The batch statistics of S are the group moments merged in group order.
///
/// NaN rewards under [`NanPolicy::Exclude`] (TRL's `normalize_then_sum`): μ_{k,g} and σ_{k,g}
/// are taken over the group's non-NaN rewards k (`nanmean`, `nanstd`), a NaN reward adds
/// nothing to `S` (`nansum`), and a reward with a single non-NaN value in its group adds 0
/// there (its σ is undefined; TRL's `nanstd` gives NaN, which `nansum` drops). A sample whose
/// rewards are all NaN is unscorable: it is left out of the batch statistics and gets 0 (TRL
/// marks it NaN before its batch `nanmean`/`nanstd` and zeroes its advantage). Reading NaN as 0
/// instead would pull every statistic towards 0 — MATH.md §2's "NaN reward → 0 first" for
/// GDPO, which TRL's code does not do; this follows TRL and §0's unscorable rule.
///
/// `scratch` needs [`gdpo_scratch_len`]`(num_rewards)` elements (one group's μ_k and σ_k + ε).
///
/// Sources: GDPO [2601.05242]; \[TRL\] `normalize_then_sum`.
///
/// # Errors
/// Nothing is written on error. [`Error::InvalidParam`] for `num_rewards == 0`, a negative or
/// NaN ε, or a bad layout; [`Error::LengthMismatch`] if `rewards.len() != out.len()·K` or
/// `weights.len() != K`; [`Error::ScratchTooSmall`]; layout errors; [`Error::NonFinite`] for
/// ±∞ (or rejected NaN) rewards, non-finite weights, or an overflowing advantage;
/// [`Error::GroupTooSmall`] for a singleton under [`SingletonRule::Reject`].
///
/// # Example
/// ```
/// use grpo_core::advantage::multi_reward::{gdpo, gdpo_scratch_len, GdpoConfig};
/// use grpo_core::Groups;
/// // One group of 2, rewards (1, 1) and (0, 0), weights (1, 1): per reward μ = 0.5,
/// // σ_unb = √0.5, z = ±0.5/(√0.5 + 1e-4); S = ±2z; batch μ = 0, σ_unb = √2·|S|,
/// // so A = ±|S|/(√2·|S| + 1e-4) ≈ ±0.70704.
/// let rewards = [1.0f64, 1.0, 0.0, 0.0];
/// let mut scratch = [0.0; gdpo_scratch_len(2)];
/// let mut adv = [0.0; 2];
/// gdpo(&rewards, 2, &[1.0, 1.0], Groups::Uniform(2), &GdpoConfig::default(), &mut scratch, &mut adv)
///     .unwrap();
/// let s = 2.0 * 0.5 / (0.5f64.sqrt() + 1e-4);
/// assert!((adv[0] - s / (2f64.sqrt() * s + 1e-4)).abs() < 1e-12);
/// assert_eq!(adv[1], -adv[0]);
/// ```
pub fn gdpo<T: Real>(
    rewards: &[T],
    num_rewards: usize,
    weights: &[T],
    groups: Groups<'_>,
    cfg: &GdpoConfig,
    scratch: &mut [T],
    out: &mut [T],
) -> Result<Diagnostics<T>> {
    let n = out.len();
    let kk = num_rewards;
    check_matrix(n, kk, rewards.len())?;
    check_weights(weights, kk)?;
    check_nonneg("reward_eps", cfg.reward_eps)?;
    check_nonneg("batch_eps", cfg.batch_eps)?;
    check_scratch(gdpo_scratch_len(kk), scratch.len())?;
    let num_groups = validate_groups(&groups, n)?;
    check_rewards(rewards, cfg.nan)?;
    let reward_eps = T::from_f64(cfg.reward_eps);
    let batch_eps = T::from_f64(cfg.batch_eps);
    let (means, dens) = scratch.split_at_mut(kk);
    let dens = &mut dens[..kk];

    // Fills `means`/`dens` for group k; returns (Some(zero_spread)) or an error for a rejected
    // singleton.
    let group_stats = |k: usize, means: &mut [T], dens: &mut [T]| -> Result<bool> {
        let size = groups.size(k);
        if size == 1 && cfg.singleton == SingletonRule::Reject {
            return Err(Error::GroupTooSmall {
                group: k,
                needed: 2,
                found: 1,
            });
        }
        let mut flat = true;
        for r in 0..kk {
            let m = Moments::from_iter(groups.members(k).filter_map(|i| reward(rewards, kk, i, r)));
            flat &= m.m2 == T::ZERO;
            let (mu, den) = if size == 1 && cfg.singleton == SingletonRule::VerlLoop {
                (T::ZERO, T::ONE + reward_eps)
            } else {
                // Undefined std (one value, unbiased) → 0: that value's numerator is 0.
                let sigma = std_floored(&m, cfg.bessel, None).unwrap_or(T::ZERO);
                (m.mean, sigma + reward_eps)
            };
            means[r] = mu;
            dens[r] = den;
        }
        Ok(flat)
    };
    // S of sample i; `None` when every reward is NaN (unscorable).
    let combined = |i: usize, means: &[T], dens: &[T]| -> Option<T> {
        let mut s = None;
        for r in 0..kk {
            if let Some(v) = reward(rewards, kk, i, r) {
                let z = ratio(v - means[r], dens[r]);
                s = Some(s.unwrap_or(T::ZERO) + weights[r] * z);
            }
        }
        s
    };

    check_then_write(out, |emit| {
        // Pass 1: batch moments of S (group moments merged in group order).
        let mut batch = Moments::new();
        for k in 0..num_groups {
            group_stats(k, means, dens)?;
            let g = Moments::from_iter(groups.members(k).filter_map(|i| combined(i, means, dens)));
            batch = batch.merge(g);
        }
        let den = std_floored(&batch, cfg.bessel, None).unwrap_or(T::ZERO) + batch_eps;
        // Pass 2: advantages.
        let mut diag = Diagnostics {
            groups: num_groups,
            ..Diagnostics::default()
        };
        for k in 0..num_groups {
            let flat = group_stats(k, means, dens)?;
            let size = groups.size(k);
            if size == 1 {
                diag.singleton_groups += 1;
            } else if flat {
                diag.zero_variance_groups += 1;
            }
            diag.nan_excluded += count_nan(rewards, kk, &groups, k);
            for i in groups.members(k) {
                let a = combined(i, means, dens).map_or(T::ZERO, |s| ratio(s - batch.mean, den));
                emit(i, a);
            }
        }
        Ok(diag)
    })
}

/// Reward combination (TRL `multi_objective_aggregation="sum_then_normalize"`, its default):
/// `S_i = Σ_k w_k r_{i,k}`, then the GRPO z-score of S with `cfg` (see
/// [`zscore`](super::zscore::zscore); every [`ZScoreConfig`] option applies, including
/// [`Scale::Batch`](super::zscore::Scale::Batch)).
///
/// NaN rewards: under [`NanPolicy::Reject`] (`cfg.nan`) an error; under
/// [`NanPolicy::Exclude`] the sum skips them (TRL `nansum`). A sample whose rewards are *all*
/// NaN is unscorable (excluded from the statistics, advantage 0) — TRL's `nansum` would give
/// it S = 0 and let it pull the group mean; our choice makes K = 1 identical to `zscore`.
///
/// Sources: \[TRL\] `sum_then_normalize`; GRPO z-score as in [`zscore`](super::zscore::zscore).
///
/// # Errors
/// As [`zscore`](super::zscore::zscore), plus [`Error::InvalidParam`] for `num_rewards == 0`,
/// [`Error::LengthMismatch`] for `rewards` (`out.len()·K`) or `weights` (K), and
/// [`Error::NonFinite`] with `what = "rewards"` (flat index) or `"weights"`.
///
/// # Example
/// ```
/// use grpo_core::advantage::multi_reward::reward_combination;
/// use grpo_core::advantage::zscore::ZScoreConfig;
/// use grpo_core::Groups;
/// // Rewards (1, 0) and (0, 1) with weights (1, 1) both sum to 1: the plain sum cannot tell
/// // them apart and the group gets 0 (compare `gdpo`).
/// let mut adv = [9.0f64; 2];
/// let d = reward_combination(&[1.0, 0.0, 0.0, 1.0], 2, &[1.0, 1.0], Groups::Uniform(2),
///     &ZScoreConfig::default(), &mut adv).unwrap();
/// assert_eq!(adv, [0.0, 0.0]);
/// assert_eq!(d.zero_variance_groups, 1);
/// ```
pub fn reward_combination<T: Real>(
    rewards: &[T],
    num_rewards: usize,
    weights: &[T],
    groups: Groups<'_>,
    cfg: &ZScoreConfig,
    out: &mut [T],
) -> Result<Diagnostics<T>> {
    let n = out.len();
    let kk = num_rewards;
    check_matrix(n, kk, rewards.len())?;
    check_weights(weights, kk)?;
    cfg.validate()?;
    let num_groups = validate_groups(&groups, n)?;
    check_rewards(rewards, cfg.nan)?;
    let value = |i: usize| -> Option<T> {
        let row = rewards.get(i * kk..(i + 1) * kk)?;
        let mut any = false;
        let mut s = T::ZERO;
        for (&r, &w) in row.iter().zip(weights) {
            if !r.is_nan() {
                any = true;
                s += w * r;
            }
        }
        any.then_some(s)
    };
    check_then_write(out, |emit| {
        zscore_core(cfg, &groups, num_groups, &value, emit)
    })
}

/// Scratch elements [`dvao`] needs for `num_rewards` rewards: one per reward.
pub const fn dvao_scratch_len(num_rewards: usize) -> usize {
    num_rewards
}

/// Configuration of [`dvao`] (our definition of DVAO [2605.25604], MATH.md §2).
///
/// No peer implements DVAO: every preset gives the defaults (ε = 1e-8 inside the square root,
/// population variance, singleton → 0, NaN rejected), except `Trl`, which reads NaN rewards
/// as 0 (our definition: [`gdpo`] leaves them out of its statistics instead, as TRL does).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DvaoConfig {
    /// ε inside the square root: `sqrt(Σ_l σ_l² + ε)` (≥ 0).
    pub eps: f64,
    /// Variance divisor of σ_k² (population by default: then mean A² ≤ K holds per group
    /// with room only for rounding; the unbiased divisor makes the bound looser).
    pub bessel: Bessel,
    /// What a one-sample group gets: `Zero` → 0; `VerlLoop` → μ_k = 0, σ_k = 1, so
    /// `A = Σ_k r_k / sqrt(K + ε)`; `Reject` → error.
    pub singleton: SingletonRule,
    /// NaN rewards: `Reject` → error; `Exclude` → read as 0 (counted in the diagnostics).
    pub nan: NanPolicy,
}

impl Default for DvaoConfig {
    fn default() -> Self {
        DvaoConfig {
            eps: 1e-8,
            bessel: Bessel::Population,
            singleton: SingletonRule::Zero,
            nan: NanPolicy::Reject,
        }
    }
}

impl DvaoConfig {
    /// The configuration a preset gives (see [`DvaoConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        match preset {
            Preset::Trl => DvaoConfig {
                nan: NanPolicy::Exclude,
                ..Self::default()
            },
            _ => Self::default(),
        }
    }
}

/// DVAO (our definition, [2605.25604]): `A_i = Σ_k (r_{i,k} − μ_k) / sqrt(Σ_l σ_l² + ε)` with
/// μ_k, σ_k the group's per-reward mean and std.
///
/// Equivalently `A = Σ_k w_k z_k` with `z_k = (r_k − μ_k)/σ_k` and variance-aware weights
/// `w_k = σ_k / sqrt(Σ_l σ_l² + ε)`: a reward with more spread in the group weighs more, and
/// the shared scale bounds the result — by Cauchy–Schwarz, the group mean of A² is at most K
/// in every group of two or more samples.
/// A group with no spread in any reward gets exactly 0.
///
/// `scratch` needs [`dvao_scratch_len`]`(num_rewards)` elements.
///
/// # Errors
/// As [`gdpo`], without the weights.
///
/// # Example
/// ```
/// use grpo_core::advantage::multi_reward::{dvao, dvao_scratch_len, DvaoConfig};
/// use grpo_core::Groups;
/// // Group of 2, rewards (1, 0) and (0, 0): μ = (0.5, 0), σ²_pop = (0.25, 0);
/// // ε = 0 → A = ±0.5/sqrt(0.25) = ±1.
/// let cfg = DvaoConfig { eps: 0.0, ..DvaoConfig::default() };
/// let mut scratch = [0.0; dvao_scratch_len(2)];
/// let mut adv = [0.0f64; 2];
/// dvao(&[1.0, 0.0, 0.0, 0.0], 2, Groups::Uniform(2), &cfg, &mut scratch, &mut adv).unwrap();
/// assert_eq!(adv, [1.0, -1.0]);
/// ```
pub fn dvao<T: Real>(
    rewards: &[T],
    num_rewards: usize,
    groups: Groups<'_>,
    cfg: &DvaoConfig,
    scratch: &mut [T],
    out: &mut [T],
) -> Result<Diagnostics<T>> {
    let n = out.len();
    let kk = num_rewards;
    check_matrix(n, kk, rewards.len())?;
    check_nonneg("eps", cfg.eps)?;
    check_scratch(dvao_scratch_len(kk), scratch.len())?;
    let num_groups = validate_groups(&groups, n)?;
    check_rewards(rewards, cfg.nan)?;
    let eps = T::from_f64(cfg.eps);
    let means = &mut scratch[..kk];
    check_then_write(out, |emit| {
        let mut diag = Diagnostics {
            groups: num_groups,
            ..Diagnostics::default()
        };
        for k in 0..num_groups {
            let size = groups.size(k);
            diag.nan_excluded += count_nan(rewards, kk, &groups, k);
            let verl_singleton = size == 1 && cfg.singleton == SingletonRule::VerlLoop;
            if size == 1 {
                diag.singleton_groups += 1;
                if cfg.singleton == SingletonRule::Reject {
                    return Err(Error::GroupTooSmall {
                        group: k,
                        needed: 2,
                        found: 1,
                    });
                }
            }
            let mut total_var = T::ZERO;
            for r in 0..kk {
                let m = Moments::from_iter(groups.members(k).map(|i| reward0(rewards, kk, i, r)));
                if verl_singleton {
                    means[r] = T::ZERO;
                    total_var += T::ONE;
                } else {
                    means[r] = m.mean;
                    total_var += m.variance(cfg.bessel).unwrap_or(T::ZERO);
                }
            }
            if size >= 2 && total_var == T::ZERO {
                diag.zero_variance_groups += 1;
            }
            let den = (total_var + eps).sqrt();
            for i in groups.members(k) {
                let mut num = T::ZERO;
                for r in 0..kk {
                    num += reward0(rewards, kk, i, r) - means[r];
                }
                emit(i, ratio(num, den));
            }
        }
        Ok(diag)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantage::zscore::{Scale, zscore};

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * (1.0 + b.abs())
    }

    #[test]
    fn gdpo_separates_what_the_sum_merges() {
        // One group of 4, rewards (1,0), (0,1), (0,1), (0,0); weights (1, 1).
        // Sum: (1, 1, 1, 0) → samples 0 and 1 tie.
        // GDPO: reward 0 = (1,0,0,0): μ = 0.25, Σd² = 0.5625 + 3·0.0625 = 0.75, σ_unb = 0.5
        //   → z0 = (0.75, −0.25, −0.25, −0.25)/(0.5 + 1e-4);
        // reward 1 = (0,1,1,0): μ = 0.5, Σd² = 1, σ_unb = sqrt(1/3)
        //   → z1 = (−0.5, 0.5, 0.5, −0.5)/(sqrt(1/3) + 1e-4).
        let rw = [1.0f64, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0];
        let mut sum = [0.0; 4];
        reward_combination(
            &rw,
            2,
            &[1.0, 1.0],
            Groups::Uniform(4),
            &ZScoreConfig::default(),
            &mut sum,
        )
        .unwrap();
        assert_eq!(sum[0], sum[1]);
        let mut a = [0.0; 4];
        let mut scratch = [0.0; 4];
        gdpo(
            &rw,
            2,
            &[1.0, 1.0],
            Groups::Uniform(4),
            &GdpoConfig::default(),
            &mut scratch,
            &mut a,
        )
        .unwrap();
        let (d0, d1) = (0.5 + 1e-4, (1.0f64 / 3.0).sqrt() + 1e-4);
        let s = [
            0.75 / d0 - 0.5 / d1,
            -0.25 / d0 + 0.5 / d1,
            -0.25 / d0 + 0.5 / d1,
            -0.25 / d0 - 0.5 / d1,
        ];
        let mu = s.iter().sum::<f64>() / 4.0;
        let var = s.iter().map(|x| (x - mu) * (x - mu)).sum::<f64>() / 3.0;
        for (x, si) in a.iter().zip(s) {
            assert!(close(*x, (si - mu) / (var.sqrt() + 1e-4)), "{x}");
        }
        assert!(a[0] != a[1]);
    }

    #[test]
    fn gdpo_nan_and_weights() {
        // TRL (nanmean, nanstd, nansum): rewards (NaN, 2), (1, 2), (3, 2), weights (2, 5).
        // Reward 0 over its non-NaN values (1, 3): μ = 2, σ_unb = √2, z = ∓z1 for samples 1
        // and 2, z1 = 1/(√2 + 1e-4); sample 0's NaN adds nothing. Reward 1 is flat (z = 0).
        // S = (0, −2z1, 2z1): μ = 0, σ_unb = 2z1 → A = (0, ∓2z1/(2z1 + 1e-4)).
        // (Reading NaN as 0 would give reward 0 the values (0, 1, 3) and μ = 4/3.)
        let rw = [f64::NAN, 2.0, 1.0, 2.0, 3.0, 2.0];
        let mut scratch = [0.0; 4];
        let mut a = [9.0; 3];
        let trl = GdpoConfig::from_preset(Preset::Trl);
        let d = gdpo(
            &rw,
            2,
            &[2.0, 5.0],
            Groups::Uniform(3),
            &trl,
            &mut scratch,
            &mut a,
        )
        .unwrap();
        let z1 = 1.0 / (2f64.sqrt() + 1e-4);
        // (The batch mean of S is 0 up to Welford's rounding.)
        assert!(close(a[0], 0.0), "{a:?}");
        assert!(close(a[2], 2.0 * z1 / (2.0 * z1 + 1e-4)), "{a:?}");
        assert!(close(a[1], -a[2]), "{a:?}");
        assert_eq!(d.nan_excluded, 1);
        // A sample whose rewards are all NaN is unscorable: K = 1, rewards (1, NaN, 0): the
        // statistics are those of (1, 0) alone, z = ±z0 = ±0.5/(√0.5 + 1e-4); the batch of the
        // two scorable S: μ = 0, σ_unb = √2·z0, A = ±z0/(√2 z0 + 1e-4) ≈ ±0.7071, the NaN
        // sample 0.
        let mut a = [9.0; 3];
        let d = gdpo(
            &[1.0, f64::NAN, 0.0],
            1,
            &[1.0],
            Groups::Uniform(3),
            &trl,
            &mut scratch,
            &mut a,
        )
        .unwrap();
        let z0 = 0.5 / (0.5f64.sqrt() + 1e-4);
        assert!(close(a[0], z0 / (2f64.sqrt() * z0 + 1e-4)), "{a:?}");
        assert_eq!(a[1], 0.0);
        assert!(close(a[2], -a[0]), "{a:?}");
        assert!((a[0] - core::f64::consts::FRAC_1_SQRT_2).abs() < 1e-4);
        assert_eq!(d.nan_excluded, 1);
        // A reward with one non-NaN value in its group adds 0 there: rewards (NaN, 1), (4, 3),
        // one group; reward 0's only value gives z = 0, reward 1: z = ∓1/(√2 + 1e-4).
        let mut a = [9.0; 2];
        gdpo(
            &[f64::NAN, 1.0, 4.0, 3.0],
            2,
            &[1.0, 1.0],
            Groups::Uniform(2),
            &trl,
            &mut scratch,
            &mut a,
        )
        .unwrap();
        let s = 1.0 / (2f64.sqrt() + 1e-4);
        assert!(close(a[1], s / (2f64.sqrt() * s + 1e-4)), "{a:?}");
        assert!(close(a[0], -a[1]), "{a:?}");
        let rw = [f64::NAN, 2.0, 1.0, 2.0];
        let mut untouched = [3.0; 2];
        assert_eq!(
            gdpo(
                &rw,
                2,
                &[2.0, 5.0],
                Groups::Uniform(2),
                &GdpoConfig::default(),
                &mut scratch,
                &mut untouched
            ),
            Err(Error::NonFinite {
                what: "rewards",
                index: 0
            })
        );
        assert_eq!(
            gdpo(
                &[1.0, 2.0, 3.0, 4.0],
                2,
                &[f64::NAN, 1.0],
                Groups::Uniform(2),
                &GdpoConfig::default(),
                &mut scratch,
                &mut untouched
            ),
            Err(Error::NonFinite {
                what: "weights",
                index: 0
            })
        );
        assert!(matches!(
            gdpo(
                &[1.0, 2.0, 3.0, 4.0],
                2,
                &[1.0, 1.0],
                Groups::Uniform(2),
                &GdpoConfig::default(),
                &mut scratch[..3],
                &mut untouched
            ),
            Err(Error::ScratchTooSmall {
                needed: 4,
                found: 3
            })
        ));
        assert!(matches!(
            gdpo(
                &[1.0, 2.0, 3.0],
                2,
                &[1.0, 1.0],
                Groups::Uniform(2),
                &GdpoConfig::default(),
                &mut scratch,
                &mut untouched
            ),
            Err(Error::LengthMismatch {
                what: "rewards",
                ..
            })
        ));
        assert!(matches!(
            gdpo(
                &[1.0, 2.0],
                0,
                &[],
                Groups::Uniform(2),
                &GdpoConfig::default(),
                &mut scratch,
                &mut untouched
            ),
            Err(Error::InvalidParam {
                name: "num_rewards",
                ..
            })
        ));
        assert_eq!(untouched, [3.0; 2]);
    }

    #[test]
    fn combination_is_weighted_nansum_then_zscore() {
        // Rewards (1, NaN), (NaN, NaN), (0, 2), (3, 0) with weights (1, 0.5), TRL:
        // S = 1, unscorable, 1, 3. Scorable (1, 1, 3): μ = 5/3, Σd² = 2·4/9 + 16/9 = 24/9,
        // var_unb = 4/3, σ = 1.1547005; A = (−2/3, 0, −2/3, 4/3)/(σ + 1e-4).
        let rw = [1.0f64, f64::NAN, f64::NAN, f64::NAN, 0.0, 2.0, 3.0, 0.0];
        let mut a = [0.0; 4];
        let d = reward_combination(
            &rw,
            2,
            &[1.0, 0.5],
            Groups::Uniform(4),
            &ZScoreConfig::from_preset(Preset::Trl),
            &mut a,
        )
        .unwrap();
        let den = (4.0f64 / 3.0).sqrt() + 1e-4;
        for (x, w) in a
            .iter()
            .zip([-2.0 / 3.0 / den, 0.0, -2.0 / 3.0 / den, 4.0 / 3.0 / den])
        {
            assert!(close(*x, w), "{x} vs {w}");
        }
        assert_eq!(d.nan_excluded, 1);
        // K = 1 equals zscore bit for bit (with batch scaling too).
        let s = [0.3f64, 0.1, 0.8, 0.8, 0.2, 0.5];
        let cfg = ZScoreConfig::default().with_scale(Scale::Batch);
        let (mut x, mut y) = ([0.0; 6], [0.0; 6]);
        reward_combination(&s, 1, &[1.0], Groups::Uniform(3), &cfg, &mut x).unwrap();
        zscore(&s, Groups::Uniform(3), &cfg, &mut y).unwrap();
        assert_eq!(x, y);
    }

    #[test]
    fn dvao_hand_computed_and_bounded() {
        // Group of 3, K = 2: rewards (1, 2), (0, 2), (2, 5).
        // Reward 0: μ = 1, σ²_pop = 2/3; reward 1: μ = 3, Σd² = 1 + 1 + 4 = 6, σ²_pop = 2.
        // D = sqrt(8/3 + 1e-8); numerators (0 − 1, −1 − 1, 1 + 2) = (−1, −2, 3).
        let rw = [1.0f64, 2.0, 0.0, 2.0, 2.0, 5.0];
        let mut scratch = [0.0; 2];
        let mut a = [0.0; 3];
        dvao(
            &rw,
            2,
            Groups::Uniform(3),
            &DvaoConfig::default(),
            &mut scratch,
            &mut a,
        )
        .unwrap();
        let den = (8.0f64 / 3.0 + 1e-8).sqrt();
        for (x, w) in a.iter().zip([-1.0 / den, -2.0 / den, 3.0 / den]) {
            assert!(close(*x, w));
        }
        let ms = a.iter().map(|x| x * x).sum::<f64>() / 3.0;
        assert!(ms <= 2.0);
        // Flat group → exactly 0; singleton → 0 (or Σr/sqrt(K + ε) for VerlLoop).
        let mut b = [9.0; 3];
        let d = dvao(
            &[0.1, 0.7, 0.1, 0.7, 4.0, 1.0],
            2,
            Groups::Offsets(&[0, 2, 3]),
            &DvaoConfig::default(),
            &mut scratch,
            &mut b,
        )
        .unwrap();
        assert_eq!(b, [0.0; 3]);
        assert_eq!((d.zero_variance_groups, d.singleton_groups), (1, 1));
        let verl = DvaoConfig {
            singleton: SingletonRule::VerlLoop,
            ..DvaoConfig::default()
        };
        dvao(
            &[0.1, 0.7, 0.1, 0.7, 4.0, 1.0],
            2,
            Groups::Offsets(&[0, 2, 3]),
            &verl,
            &mut scratch,
            &mut b,
        )
        .unwrap();
        assert!(close(b[2], 5.0 / (2.0f64 + 1e-8).sqrt()));
    }
}
