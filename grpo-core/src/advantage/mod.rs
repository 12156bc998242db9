//! Group-relative advantage estimators (MATH.md §2).
//!
//! Every estimator reads per-sample scores (or per-token rewards), a [`Groups`](crate::layout::Groups)
//! layout, and a config struct with `Default` and named presets; it validates everything, then
//! writes one advantage per sample (or per token) into a caller buffer and returns
//! [`Diagnostics`]. On `Err` the output buffer is untouched.

use crate::real::Real;

/// What to do with a NaN reward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NanPolicy {
    /// A NaN reward is an error ([`Error::NonFinite`](crate::Error::NonFinite)). Default.
    #[default]
    Reject,
    /// TRL's policy: a NaN reward marks the sample *unscorable*: it is excluded from its group's
    /// (and the batch's) statistics and gets advantage 0. ±∞ is still an error.
    Exclude,
}

/// What a group of one sample gets (its mean equals its score; its unbiased std is undefined).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SingletonRule {
    /// Advantage 0 (TRL; verl's vectorized RLOO). Default; counted in
    /// [`Diagnostics::singleton_groups`].
    #[default]
    Zero,
    /// verl's loop implementations and its vectorized GRPO (`group_mean_std`): μ = 0, σ = 1, so
    /// the z-score is `s / (1 + ε)` (and RLOO's baseline is 0, so `A = s`).
    VerlLoop,
    /// Refuse the batch with [`Error::GroupTooSmall`](crate::Error::GroupTooSmall) (OpenRLHF
    /// divides 0 by 0 there and gets NaN; we never produce that).
    Reject,
}

/// What an estimator reports about the batch besides the advantages.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Diagnostics<T> {
    /// Number of groups.
    pub groups: usize,
    /// Groups whose statistic had zero spread (all scores equal): their advantages are 0.
    pub zero_variance_groups: usize,
    /// Groups with exactly one (scorable) sample.
    pub singleton_groups: usize,
    /// Samples whose NaN reward was excluded under [`NanPolicy::Exclude`].
    pub nan_excluded: usize,
    /// Smallest advantage written (0 for an empty batch).
    pub min: T,
    /// Largest advantage written (0 for an empty batch).
    pub max: T,
    /// Mean advantage written (0 for an empty batch).
    pub mean: T,
}

impl<T: Real> Diagnostics<T> {
    /// Fills `min`, `max`, `mean` from the written advantages (the counters are left as they are).
    ///
    /// ```
    /// use grpo_core::advantage::Diagnostics;
    /// let d = Diagnostics { groups: 2, ..Diagnostics::default() };
    /// // mean (−1 + 0.5 + 2)/3 = 0.5; the group count stays 2.
    /// let d = d.summarize(&[-1.0f32, 0.5, 2.0]);
    /// assert_eq!((d.min, d.max, d.mean, d.groups), (-1.0, 2.0, 0.5, 2));
    /// // No advantages: all three are 0.
    /// let e = d.summarize(&[]);
    /// assert_eq!((e.min, e.max, e.mean), (0.0, 0.0, 0.0));
    /// ```
    pub fn summarize(mut self, advantages: &[T]) -> Self {
        if advantages.is_empty() {
            self.min = T::ZERO;
            self.max = T::ZERO;
            self.mean = T::ZERO;
            return self;
        }
        let (mut lo, mut hi, mut sum) = (T::INFINITY, T::NEG_INFINITY, T::ZERO);
        for &a in advantages {
            lo = lo.min(a);
            hi = hi.max(a);
            sum += a;
        }
        self.min = lo;
        self.max = hi;
        self.mean = sum / T::from_usize(advantages.len());
        self
    }
}

// One module per estimator family (MATH.md §2). The z-score family: GRPO and its
// configurations, RLOO, pass@k, OPO, GPG and the multi-reward estimators (GDPO, reward
// combination, DVAO).
pub mod gpg;
mod group_scan;
pub mod multi_reward;
pub mod opo;
pub mod passk;
pub mod rloo;
pub mod zscore;
// Token-level estimators over whitened returns, rank estimators, filters and shaping.
pub mod baseline;
pub mod filter;
pub mod gae;
pub mod overlong;
pub mod rank;
pub mod returns;
pub mod whiten;

pub use baseline::{BaselineConfig, reinforce_pp_baseline};
pub use filter::{
    DynamicSamplingConfig, RangeFilterConfig, dynamic_sampling_keep, dynamic_sampling_keep_correct,
    range_filter_keep,
};
pub use gae::{GaeConfig, gae};
pub use gpg::{GpgConfig, gpg};
pub use multi_reward::{
    DvaoConfig, GdpoConfig, dvao, dvao_scratch_len, gdpo, gdpo_scratch_len, reward_combination,
};
pub use opo::{OpoConfig, opo};
pub use overlong::{OverlongConfig, overlong_penalty};
pub use passk::{PassKConfig, pass_at_k};
pub use rank::{G2rpoConfig, GopoConfig, g2rpo, gopo, rank_scratch_len};
pub use returns::{MaskedTokens, ReturnsConfig, reinforce_pp_returns, remax};
pub use rloo::{RlooConfig, rloo};
pub use whiten::{
    EpsPlacement, WhitenConfig, WhitenReport, apply_whitening, apply_whitening_in_place, whiten,
    whiten_moments,
};
pub use zscore::{Scale, ZScoreConfig, zscore};
