//! Importance-sampling corrections for rollout-engine / trainer mismatch (MATH.md §4).
//!
//! The rollout engine (vLLM, SGLang) samples with log-probs `roll`; the trainer recomputes
//! `old` for the same tokens. They differ (precision, kernels, staleness), so the samples are
//! slightly off-policy. The corrections here produce **detached multipliers** of the per-token
//! loss (weights, constants with respect to lp) or **keep-masks**, from the per-token log-ratio
//!
//! r_t = old_t − roll_t  (= ln π_old/π_roll).
//!
//! - [`is_weights`]: token weights w_t = e^{r_t}, sequence weights e^{Σ_t r_t}, or geometric
//!   weights e^{mean_t r_t}, then truncated (clamped to [min, max]) or masked (0 outside
//!   [lo, hi]) or geometric-mean filtered, optionally batch-normalised (÷ their mean). Covers
//!   \[TRL\] `vllm_importance_sampling_mode` (`token_truncate`, `token_mask`,
//!   `sequence_truncate`, `sequence_mask`), \[OpenRLHF\] `tis` / `icepop` / `seq-mask-tis`, and
//!   \[verl\] rollout-correction IS weights (`token` / `sequence`, `rollout_is_batch_normalize`).
//! - [`rejection_mask`]: \[verl\] rollout rejection sampling: per-token statistics k1 = −r,
//!   k2 = r²/2, k3 = e^r − 1 − r, at token level or aggregated per sequence (sum, mean, max),
//!   several criteria combined with AND.
//! - [`off_policy_sequence_mask`]: \[TRL\] off-policy sequence masking (OPSM).
//!
//! **Exp overflow.** Before any exponential the log-weight is clamped to ±`log_clamp`
//! (default ±20, verl's safety bound [e^{−20}, e^{20}] ≈ [2e−9, 4.9e8]); with `None` (TRL) the
//! overflow guard [`crate::divergence::measures::exp_guard`] (±43.4 in f32, ±354 in
//! f64) still applies, so no weight is ever ∞ or NaN.

use crate::divergence::measures::{
    check_clamp, check_token_inputs, exp_guard, expm1_minus_x, limit,
};
use crate::error::{Error, Result, check_len, ensure};
use crate::layout::Tokens;
use crate::real::Real;

/// At which level the importance weight is formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IsLevel {
    /// w_t = e^{r_t} per token. Default.
    #[default]
    Token,
    /// One weight per sequence, e^{Σ_t r_t} (the product of token ratios), on all its tokens
    /// (\[TRL\] sequence modes, \[verl\] `sequence`).
    Sequence,
    /// One weight per sequence, e^{mean_t r_t} (the geometric mean of token ratios).
    GeometricMean,
}

/// What is done to the weight after it is formed.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum IsFilter<T> {
    /// Keep the raw (log-clamped) weight.
    #[default]
    None,
    /// Clamp to [min, max] (`min = 0` gives the plain cap min(w, max)).
    Truncate {
        /// Lower clamp (≥ 0).
        min: T,
        /// Upper clamp (> min).
        max: T,
    },
    /// w ← 0 where w ∉ [lo, hi], unchanged inside (\[TRL\] `*_mask`, \[OpenRLHF\] `icepop`).
    Mask {
        /// Lower bound (≥ 0).
        lo: T,
        /// Upper bound (> lo).
        hi: T,
    },
    /// \[OpenRLHF\] `seq-mask-tis`: a whole sequence gets weight 0 when its geometric-mean ratio
    /// e^{mean_t r_t} ∉ [lo, hi]; otherwise its token weights e^{r_t} are kept **unclamped**
    /// (use with [`IsLevel::Token`]).
    GeometricMask {
        /// Lower bound of the geometric mean (≥ 0).
        lo: T,
        /// Upper bound of the geometric mean (> lo).
        hi: T,
    },
}

/// The smallest weight mean [`IsConfig::batch_normalize`] divides by: verl's
/// `if w_mean > 1e-8` (`compute_rollout_correction_weights`); below it the weights stay as
/// they are, instead of being blown up by the reciprocal of a vanishing mean.
pub const IS_NORMALIZE_MIN_MEAN: f64 = 1e-8;

/// Settings of [`is_weights`].
///
/// Named constructors reproduce the peers: [`IsConfig::tis`], [`IsConfig::icepop`],
/// [`IsConfig::seq_mask_tis`] (OpenRLHF, bounds [0.5, 5]), [`IsConfig::token_truncate`] /
/// [`IsConfig::sequence_truncate`] (TRL `vllm_importance_sampling_cap`, verl
/// `rollout_is_threshold`: plain cap), [`IsConfig::token_mask`] / [`IsConfig::sequence_mask`].
/// Every constructor keeps the default log clamp ±20, verl's `SAFETY_BOUND`; TRL takes `exp`
/// of the log-ratio (or of its sum) unclamped, so for TRL's numbers set `log_clamp: None`
/// (e.g. `IsConfig { log_clamp: None, ..IsConfig::sequence_mask(lo, hi) }`): they differ
/// where a token's r, or a sequence's Σr, leaves ±20. Without a clamp the overflow guard
/// (±43.36 in f32) still limits the log-weight, on both sides.
/// `Default`: token level, no filter, log clamp ±20, no batch normalisation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IsConfig<T> {
    /// Weight level.
    pub level: IsLevel,
    /// Post-processing.
    pub filter: IsFilter<T>,
    /// Clamp c of the log-weight to [−c, c] before `exp` (finite, > 0); `None` = none (TRL;
    /// the overflow guard still applies). Default `Some(20)`.
    pub log_clamp: Option<T>,
    /// Divide the weights by their mean (verl `rollout_is_batch_normalize`): over the valid
    /// tokens at token level, over the sequences with a valid token (each counted once) at
    /// sequence/geometric level — zero weights (a mask filter's) included, as verl's
    /// `masked_mean` counts them. Left unchanged unless that mean exceeds 1e-8 (verl's
    /// `if w_mean > 1e-8`), [`IS_NORMALIZE_MIN_MEAN`].
    pub batch_normalize: bool,
}

impl<T: Real> Default for IsConfig<T> {
    fn default() -> Self {
        IsConfig {
            level: IsLevel::Token,
            filter: IsFilter::None,
            log_clamp: Some(T::from_f64(20.0)),
            batch_normalize: false,
        }
    }
}

impl<T: Real> IsConfig<T> {
    fn with(level: IsLevel, filter: IsFilter<T>) -> Self {
        IsConfig {
            level,
            filter,
            ..Self::default()
        }
    }
    /// Token truncated IS: w_t = min(e^{r_t}, cap) \[TRL `token_truncate`, verl `token`\].
    pub fn token_truncate(cap: T) -> Self {
        Self::with(
            IsLevel::Token,
            IsFilter::Truncate {
                min: T::ZERO,
                max: cap,
            },
        )
    }
    /// Sequence truncated IS: w = min(e^{Σ r_t}, cap) \[TRL `sequence_truncate`, verl `sequence`\].
    pub fn sequence_truncate(cap: T) -> Self {
        Self::with(
            IsLevel::Sequence,
            IsFilter::Truncate {
                min: T::ZERO,
                max: cap,
            },
        )
    }
    /// Token masked IS: w_t = e^{r_t} inside [lo, hi], 0 outside \[TRL `token_mask`\].
    pub fn token_mask(lo: T, hi: T) -> Self {
        Self::with(IsLevel::Token, IsFilter::Mask { lo, hi })
    }
    /// Sequence masked IS: e^{Σ r_t} inside [lo, hi], 0 outside \[TRL `sequence_mask`\].
    pub fn sequence_mask(lo: T, hi: T) -> Self {
        Self::with(IsLevel::Sequence, IsFilter::Mask { lo, hi })
    }
    /// \[OpenRLHF\] `tis`: token weights clamped to [0.5, 5].
    pub fn tis() -> Self {
        Self::with(
            IsLevel::Token,
            IsFilter::Truncate {
                min: T::HALF,
                max: T::from_f64(5.0),
            },
        )
    }
    /// \[OpenRLHF\] `icepop`: token weights zeroed outside [0.5, 5].
    pub fn icepop() -> Self {
        Self::token_mask(T::HALF, T::from_f64(5.0))
    }
    /// \[OpenRLHF\] `seq-mask-tis`: sequences whose geometric-mean ratio leaves [0.5, 5] are
    /// zeroed; the others keep unclamped token weights.
    pub fn seq_mask_tis() -> Self {
        Self::with(
            IsLevel::Token,
            IsFilter::GeometricMask {
                lo: T::HALF,
                hi: T::from_f64(5.0),
            },
        )
    }

    fn validate(&self) -> Result<()> {
        check_clamp(self.log_clamp, "log_clamp")?;
        let (lo, hi, name) = match self.filter {
            IsFilter::None => return Ok(()),
            IsFilter::Truncate { min, max } => (min, max, "truncate bounds"),
            IsFilter::Mask { lo, hi } => (lo, hi, "mask bounds"),
            IsFilter::GeometricMask { lo, hi } => (lo, hi, "geometric mask bounds"),
        };
        ensure(
            lo >= T::ZERO && hi > lo && hi.is_finite(),
            name,
            "need 0 <= lower < upper < inf",
        )
    }
}

/// What [`is_weights`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct IsDiagnostics<T> {
    /// Valid tokens written.
    pub tokens: usize,
    /// Valid tokens whose weight the filter changed (truncated) or zeroed (masked).
    pub filtered: usize,
    /// Valid tokens whose log-weight hit the log clamp or the overflow guard.
    pub log_clamped: usize,
    /// Mean final weight over valid tokens (0 without valid tokens).
    pub mean: T,
    /// Smallest and largest final weight over valid tokens (0 without valid tokens).
    pub min: T,
    /// See `min`.
    pub max: T,
}

/// Detached importance weights of the rollout-engine/trainer mismatch over a [`Tokens`]
/// layout (formulas and sources in the [module docs](self) and on [`IsConfig`]).
///
/// Writes `weights[t]` at every valid position and 0 elsewhere. A sequence without valid
/// tokens has no weight (nothing is written for it beyond the zeros).
///
/// # Errors
/// [`Error::LengthMismatch`], layout errors of [`Tokens::validate`], [`Error::NonFinite`] for a
/// NaN/±∞ `old` or `roll` at a valid position, [`Error::InvalidParam`] for bad bounds (need
/// 0 ≤ lower < upper < ∞) or log clamp (finite, > 0). On `Err`, `weights` is untouched.
///
/// # Example
/// ```
/// use grpo_core::Tokens;
/// use grpo_core::is_correction::{is_weights, IsConfig};
/// // Two sequences of two tokens. r = old − roll = [ln 2, ln 4 | 0, −ln 2].
/// let ln2 = core::f64::consts::LN_2;
/// let old = [ln2, 2.0 * ln2, 0.0, -ln2];
/// let roll = [0.0; 4];
/// let t = Tokens::padded(2, 2, None);
/// let mut w = [0.0; 4];
/// // Token cap 3: [min(2,3), min(4,3), 1, 0.5].
/// is_weights(&IsConfig::token_truncate(3.0), &old, &roll, &t, &mut w).unwrap();
/// assert!((w[0] - 2.0).abs() < 1e-12 && w[1] == 3.0 && w[2] == 1.0 && (w[3] - 0.5).abs() < 1e-12);
/// // Sequence level: e^{ln 2 + ln 4} = 8 → cap 3; e^{−ln 2} = 0.5.
/// is_weights(&IsConfig::sequence_truncate(3.0), &old, &roll, &t, &mut w).unwrap();
/// assert_eq!(w[0], 3.0);
/// assert!((w[3] - 0.5).abs() < 1e-12);
/// ```
pub fn is_weights<T: Real>(
    cfg: &IsConfig<T>,
    old: &[T],
    roll: &[T],
    tokens: &Tokens<'_>,
    weights: &mut [T],
) -> Result<IsDiagnostics<T>> {
    cfg.validate()?;
    let n = old.len();
    check_token_inputs(
        tokens,
        n,
        &[("old", old), ("roll", roll)],
        &[("weights", weights.len())],
    )?;
    let lim = match cfg.log_clamp {
        Some(c) => c.min(exp_guard()),
        None => exp_guard(),
    };
    weights.fill(T::ZERO);
    let mut diag = IsDiagnostics::default();
    // Batch-normalisation mean of the weights (per valid token or per sequence depending on
    // the level, zeros included), as a running mean: weights may be as large as the
    // truncation bounds allow (up to T::MAX), where a plain sum would overflow.
    let mut norm = RunningMean::default();
    for s in 0..tokens.num_sequences() {
        let count = tokens.valid_count(s);
        if count == 0 {
            continue;
        }
        // Σ r_t in the order of positions (sequence and geometric levels, geometric filter).
        let mut sum = T::ZERO;
        for t in tokens.valid_positions(s) {
            sum += old[t] - roll[t];
        }
        let mean = sum / T::from_usize(count);
        // Sequence-level weight (if any), and whether the geometric filter zeroes the sequence.
        let seq_log = match cfg.level {
            IsLevel::Token => None,
            IsLevel::Sequence => Some(sum),
            IsLevel::GeometricMean => Some(mean),
        };
        let geo_reject = match cfg.filter {
            IsFilter::GeometricMask { lo, hi } => {
                let (m, _) = limit(mean, lim);
                let g = m.exp();
                !(g >= lo && g <= hi)
            }
            _ => false,
        };
        let seq_weight = seq_log.map(|l| {
            let (l, hit) = limit(l, lim);
            let (w, changed) = apply_filter(cfg.filter, l.exp());
            (w, hit, changed)
        });
        for t in tokens.valid_positions(s) {
            let (w, hit, changed) = match seq_weight {
                Some(sw) => sw,
                None => {
                    let (l, hit) = limit(old[t] - roll[t], lim);
                    let (w, changed) = apply_filter(cfg.filter, l.exp());
                    (w, hit, changed)
                }
            };
            let (w, changed) = if geo_reject {
                (T::ZERO, true)
            } else {
                (w, changed)
            };
            weights[t] = w;
            diag.tokens += 1;
            diag.log_clamped += usize::from(hit);
            diag.filtered += usize::from(changed);
            if seq_weight.is_none() {
                norm.push(w);
            }
        }
        if let Some((w, _, _)) = seq_weight {
            norm.push(if geo_reject { T::ZERO } else { w });
        }
    }
    if cfg.batch_normalize && norm.count > 0 && norm.mean > T::from_f64(IS_NORMALIZE_MIN_MEAN) {
        let mean = norm.mean;
        for s in 0..tokens.num_sequences() {
            for t in tokens.valid_positions(s) {
                weights[t] /= mean;
            }
        }
    }
    if diag.tokens > 0 {
        let (mut avg, mut lo, mut hi) = (RunningMean::default(), T::INFINITY, T::NEG_INFINITY);
        for s in 0..tokens.num_sequences() {
            for t in tokens.valid_positions(s) {
                avg.push(weights[t]);
                lo = lo.min(weights[t]);
                hi = hi.max(weights[t]);
            }
        }
        diag.mean = avg.mean;
        diag.min = lo;
        diag.max = hi;
    }
    Ok(diag)
}

/// Mean of non-negative values without overflow: m ← m + (w − m)/k (|w − m| ≤ max(w, m)).
#[derive(Default)]
struct RunningMean<T> {
    mean: T,
    count: usize,
}

impl<T: Real> RunningMean<T> {
    #[inline]
    fn push(&mut self, w: T) {
        self.count += 1;
        self.mean += (w - self.mean) / T::from_usize(self.count);
    }
}

/// The filtered weight and whether the filter changed it (GeometricMask acts elsewhere).
#[inline]
fn apply_filter<T: Real>(filter: IsFilter<T>, w: T) -> (T, bool) {
    match filter {
        IsFilter::None | IsFilter::GeometricMask { .. } => (w, false),
        IsFilter::Truncate { min, max } => {
            let c = w.clamp(min, max);
            (c, c != w)
        }
        IsFilter::Mask { lo, hi } => {
            if w >= lo && w <= hi {
                (w, false)
            } else {
                (T::ZERO, true)
            }
        }
    }
}

/// The clamp of r = old − roll before every rejection statistic: verl's `SAFETY_BOUND` (20),
/// `log_ratio_safe = clamp(log_ratio, −20, 20)` in `compute_rollout_rejection_mask`. A token's
/// k1 and k2 are therefore at most 20 and 200 in magnitude, its k3 at most e^20 − 21.
pub const REJECT_LOG_CLAMP: f64 = 20.0;

/// A per-token statistic of r = old − roll (clamped to ±[`REJECT_LOG_CLAMP`] first, as verl
/// does) for \[verl\] rejection sampling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectStat {
    /// k1 = −r (bounds are given as ratio bounds, see [`RejectionCriterion::k1`]).
    K1,
    /// k2 = r²/2.
    K2,
    /// k3 = e^r − 1 − r (≥ 0; its expectation under π_roll is KL(π_roll‖π_old)).
    K3,
}

/// Where a rejection statistic is evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectLevel {
    /// Each token on its own (`token_k*`): rejecting a token masks only that token.
    Token,
    /// Sum over the sequence's valid tokens (`seq_sum_k*`): rejects the whole sequence.
    SeqSum,
    /// Mean over the sequence's valid tokens (`seq_mean_k*`; with k1 this is the geometric-mean
    /// ratio test).
    SeqMean,
    /// Maximum over the sequence's valid tokens (`seq_max_k2`, `seq_max_k3`; not k1).
    SeqMax,
}

/// One \[verl\] rejection criterion (`rollout_rs` option + threshold): keep iff the aggregated
/// statistic lies in `[lo, hi]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RejectionCriterion<T> {
    /// The statistic.
    pub stat: RejectStat,
    /// Its aggregation level.
    pub level: RejectLevel,
    /// Lower bound on the (aggregated) statistic (−∞ allowed: k2/k3 have none).
    pub lo: T,
    /// Upper bound on the (aggregated) statistic.
    pub hi: T,
}

impl<T: Real> RejectionCriterion<T> {
    /// k1 criterion from verl's `"lower_upper"` threshold: keep iff the aggregated k1 = −r
    /// (Σ over the sequence, its mean, or the token's) lies in [ln lower, ln upper] — verl's
    /// `lower_log <= k1 <= upper_log` (`compute_rollout_rejection_mask`), i.e. the aggregated
    /// r = ln π_old/π_roll in [−ln upper, −ln lower]. verl's single-float form `"u"` is
    /// `k1(level, 1/u, u)`.
    ///
    /// # Errors
    /// [`Error::InvalidParam`] unless 0 < lower ≤ upper < ∞ (verl accepts any positive pair;
    /// lower > upper would reject everything), or for `SeqMax` (verl has no `seq_max_k1`).
    pub fn k1(level: RejectLevel, lower: T, upper: T) -> Result<Self> {
        ensure(
            level != RejectLevel::SeqMax,
            "level",
            "k1 has no max aggregation",
        )?;
        ensure(
            lower > T::ZERO && lower <= upper && upper.is_finite(),
            "k1 ratio bounds",
            "need 0 < lower <= upper < inf",
        )?;
        Ok(RejectionCriterion {
            stat: RejectStat::K1,
            level,
            lo: lower.ln(),
            hi: upper.ln(),
        })
    }

    /// k2 or k3 criterion with an upper bound (keep iff the aggregate ≤ `upper`).
    ///
    /// # Errors
    /// [`Error::InvalidParam`] for `stat == K1` (use [`RejectionCriterion::k1`]) or unless
    /// `upper` is finite and > 0.
    pub fn upper(stat: RejectStat, level: RejectLevel, upper: T) -> Result<Self> {
        ensure(
            stat != RejectStat::K1,
            "stat",
            "use RejectionCriterion::k1 for k1",
        )?;
        ensure(
            upper > T::ZERO && upper.is_finite(),
            "upper",
            "must be finite and > 0",
        )?;
        Ok(RejectionCriterion {
            stat,
            level,
            lo: T::NEG_INFINITY,
            hi: upper,
        })
    }

    fn validate(&self) -> Result<()> {
        ensure(
            !(self.stat == RejectStat::K1 && self.level == RejectLevel::SeqMax),
            "level",
            "k1 has no max aggregation",
        )?;
        ensure(
            !self.lo.is_nan() && !self.hi.is_nan() && self.lo <= self.hi,
            "rejection bounds",
            "need lo <= hi (no NaN)",
        )
    }

    /// The statistic of one token's r, after verl's clamp of r to ±[`REJECT_LOG_CLAMP`].
    fn token_stat(&self, r: T) -> T {
        let (r, _) = limit(r, T::from_f64(REJECT_LOG_CLAMP));
        match self.stat {
            RejectStat::K1 => -r,
            RejectStat::K2 => r * r * T::HALF,
            RejectStat::K3 => expm1_minus_x(r),
        }
    }

    fn keeps(&self, v: T) -> bool {
        v >= self.lo && v <= self.hi
    }
}

/// What [`rejection_mask`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RejectionDiagnostics {
    /// Valid tokens examined.
    pub tokens: usize,
    /// Valid tokens rejected (by any criterion).
    pub rejected_tokens: usize,
    /// Sequences with at least one valid token, all of whose valid tokens were rejected.
    pub rejected_sequences: usize,
}

/// \[verl\] rollout rejection sampling: `keep[t] = true` iff position t is valid and every
/// criterion accepts it (token criteria judge the token, sequence criteria its whole
/// sequence). Invalid positions get `false`. An empty `criteria` keeps every valid token.
///
/// # Errors
/// As [`is_weights`] for the inputs; [`Error::InvalidParam`] for an inconsistent criterion.
/// On `Err`, `keep` is untouched.
///
/// # Example
/// ```
/// use grpo_core::Tokens;
/// use grpo_core::is_correction::*;
/// // r = old − roll = [0.1, −0.2 | 0.5, 0.0]. token_k2 ≤ 0.01 keeps |r| ≤ √0.02 = 0.1414…:
/// // tokens 0 and 3. seq_mean_k1 in ratio [e^{−0.1}, e^{0.1}] keeps sequence 0 (mean −0.05),
/// // rejects sequence 1 (mean 0.25).
/// let old = [0.1f64, -0.2, 0.5, 0.0];
/// let roll = [0.0; 4];
/// let t = Tokens::padded(2, 2, None);
/// let mut keep = [true; 4];
/// let c = [RejectionCriterion::upper(RejectStat::K2, RejectLevel::Token, 0.01).unwrap()];
/// rejection_mask(&c, &old, &roll, &t, &mut keep).unwrap();
/// assert_eq!(keep, [true, false, false, true]);
/// let c = [RejectionCriterion::k1(RejectLevel::SeqMean, (-0.1f64).exp(), 0.1f64.exp()).unwrap()];
/// let d = rejection_mask(&c, &old, &roll, &t, &mut keep).unwrap();
/// assert_eq!(keep, [true, true, false, false]);
/// assert_eq!(d.rejected_sequences, 1);
/// ```
pub fn rejection_mask<T: Real>(
    criteria: &[RejectionCriterion<T>],
    old: &[T],
    roll: &[T],
    tokens: &Tokens<'_>,
    keep: &mut [bool],
) -> Result<RejectionDiagnostics> {
    for c in criteria {
        c.validate()?;
    }
    let n = old.len();
    check_token_inputs(
        tokens,
        n,
        &[("old", old), ("roll", roll)],
        &[("keep", keep.len())],
    )?;
    keep.fill(false);
    let mut diag = RejectionDiagnostics::default();
    for s in 0..tokens.num_sequences() {
        let count = tokens.valid_count(s);
        if count == 0 {
            continue;
        }
        let mut seq_ok = true;
        for c in criteria.iter().filter(|c| c.level != RejectLevel::Token) {
            let mut agg = match c.level {
                RejectLevel::SeqMax => T::NEG_INFINITY,
                _ => T::ZERO,
            };
            for t in tokens.valid_positions(s) {
                let v = c.token_stat(old[t] - roll[t]);
                agg = match c.level {
                    RejectLevel::SeqMax => agg.max(v),
                    _ => agg + v,
                };
            }
            if c.level == RejectLevel::SeqMean {
                agg /= T::from_usize(count);
            }
            seq_ok &= c.keeps(agg);
        }
        let mut kept = 0usize;
        for t in tokens.valid_positions(s) {
            let r = old[t] - roll[t];
            let ok = seq_ok
                && criteria
                    .iter()
                    .filter(|c| c.level == RejectLevel::Token)
                    .all(|c| c.keeps(c.token_stat(r)));
            keep[t] = ok;
            kept += usize::from(ok);
        }
        diag.tokens += count;
        diag.rejected_tokens += count - kept;
        diag.rejected_sequences += usize::from(kept == 0);
    }
    Ok(diag)
}

/// \[TRL\] off-policy sequence masking (OPSM): sequence i is dropped (`keep[i] = false`) iff
/// A_i < 0 **and** mean_t(roll_t − lp_t) > δ over its valid tokens — a negative-advantage
/// sample that the current policy already finds much less likely than the sampler did. A
/// sequence without valid tokens is kept (it contributes nothing anyway). `lp` is read as a
/// constant (sg).
///
/// # Errors
/// [`Error::LengthMismatch`] (`advantages`/`keep` must have one entry per sequence, `roll`
/// one per token), layout errors, [`Error::NonFinite`] for a NaN/±∞ advantage or valid-token
/// log-prob, [`Error::InvalidParam`] unless δ is finite and ≥ 0. On `Err`, `keep` is untouched.
///
/// # Example
/// ```
/// use grpo_core::Tokens;
/// use grpo_core::is_correction::off_policy_sequence_mask;
/// // mean(roll − lp): seq 0 = 0.5, seq 1 = 0.5, seq 2 = 0.0. δ = 0.1.
/// let lp = [-1.0f64, -1.0, -1.0, -1.0, -1.0, -1.0];
/// let roll = [-0.5, -0.5, -0.5, -0.5, -1.0, -1.0];
/// let adv = [-1.0, 1.0, -1.0];
/// let mut keep = [true; 3];
/// off_policy_sequence_mask(&adv, &lp, &roll, &Tokens::padded(3, 2, None), 0.1, &mut keep).unwrap();
/// assert_eq!(keep, [false, true, true]);
/// ```
pub fn off_policy_sequence_mask<T: Real>(
    advantages: &[T],
    lp: &[T],
    roll: &[T],
    tokens: &Tokens<'_>,
    delta: T,
    keep: &mut [bool],
) -> Result<usize> {
    ensure(
        delta >= T::ZERO && delta.is_finite(),
        "delta",
        "must be finite and >= 0",
    )?;
    let n = lp.len();
    check_token_inputs(tokens, n, &[("lp", lp), ("roll", roll)], &[])?;
    let seqs = tokens.num_sequences();
    check_len("advantages", seqs, advantages.len())?;
    check_len("keep", seqs, keep.len())?;
    if let Some(index) = advantages.iter().position(|a| !a.is_finite()) {
        return Err(Error::NonFinite {
            what: "advantages",
            index,
        });
    }
    let mut dropped = 0;
    for s in 0..seqs {
        let count = tokens.valid_count(s);
        let mut drop = false;
        if count > 0 && advantages[s] < T::ZERO {
            let mut sum = T::ZERO;
            for t in tokens.valid_positions(s) {
                sum += roll[t] - lp[t];
            }
            drop = sum / T::from_usize(count) > delta;
        }
        keep[s] = !drop;
        dropped += usize::from(drop);
    }
    Ok(dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openrlhf_modes_hand_computed() {
        // r = [ln 0.25, ln 2, ln 10] in one sequence.
        let old = [0.25f64.ln(), 2f64.ln(), 10f64.ln()];
        let roll = [0.0; 3];
        let t = Tokens::padded(1, 3, None);
        let mut w = [0.0; 3];
        // tis: clamp to [0.5, 5] → [0.5, 2, 5].
        is_weights(&IsConfig::tis(), &old, &roll, &t, &mut w).unwrap();
        assert_eq!(w[0], 0.5);
        assert!((w[1] - 2.0).abs() < 1e-14);
        assert_eq!(w[2], 5.0);
        // icepop: zero outside [0.5, 5] → [0, 2, 0].
        let d = is_weights(&IsConfig::icepop(), &old, &roll, &t, &mut w).unwrap();
        assert_eq!((w[0], w[2]), (0.0, 0.0));
        assert_eq!(d.filtered, 2);
        // seq-mask-tis: geometric mean (0.25·2·10)^{1/3} = 5^{1/3} = 1.71 ∈ [0.5, 5] → the token
        // weights stay unclamped [0.25, 2, 10].
        is_weights(&IsConfig::seq_mask_tis(), &old, &roll, &t, &mut w).unwrap();
        assert!((w[0] - 0.25).abs() < 1e-14 && (w[2] - 10.0).abs() < 1e-13);
        // With r = [ln 10, ln 10]: geometric mean 10 > 5 → the sequence is zeroed.
        let old2 = [10f64.ln(), 10f64.ln(), 0.0];
        is_weights(
            &IsConfig::seq_mask_tis(),
            &old2,
            &roll,
            &Tokens::padded(1, 3, Some(&[true, true, false])),
            &mut w,
        )
        .unwrap();
        assert_eq!(w, [0.0, 0.0, 0.0]);
    }

    #[test]
    fn batch_normalisation_divides_by_the_mean() {
        // Token weights [2, 4, 1, 1] (r = ln w): mean 2 → [1, 2, 0.5, 0.5].
        let old = [2f64.ln(), 4f64.ln(), 0.0, 0.0];
        let cfg = IsConfig {
            batch_normalize: true,
            ..IsConfig::default()
        };
        let mut w = [0.0; 4];
        let d = is_weights(&cfg, &old, &[0.0; 4], &Tokens::padded(2, 2, None), &mut w).unwrap();
        for (a, b) in w.iter().zip([1.0, 2.0, 0.5, 0.5]) {
            assert!((a - b).abs() < 1e-14);
        }
        assert!((d.mean - 1.0).abs() < 1e-14);
        // Sequence level: weights e^{ln 8} = 8 and e^0 = 1 → mean over sequences 4.5.
        let cfg = IsConfig {
            level: IsLevel::Sequence,
            ..cfg
        };
        is_weights(&cfg, &old, &[0.0; 4], &Tokens::padded(2, 2, None), &mut w).unwrap();
        assert!((w[0] - 8.0 / 4.5).abs() < 1e-14 && (w[3] - 1.0 / 4.5).abs() < 1e-14);
    }

    #[test]
    fn batch_normalisation_counts_zero_weights_and_skips_a_vanishing_mean() {
        // As verl's masked_mean: a mask filter's zero counts. Weights [2, 0 (4 ∉ [0.5, 3]),
        // 1, 1]: mean 1, so they stay (without the zero the mean would be 4/3).
        let cfg = IsConfig {
            batch_normalize: true,
            ..IsConfig::token_mask(0.5, 3.0)
        };
        let old = [2f64.ln(), 4f64.ln(), 0.0, 0.0];
        let mut w = [9.0; 4];
        is_weights(&cfg, &old, &[0.0; 4], &Tokens::padded(2, 2, None), &mut w).unwrap();
        for (a, b) in w.iter().zip([2.0, 0.0, 1.0, 1.0]) {
            assert!((a - b).abs() < 1e-14, "{w:?}");
        }
        // Sequence level: sequence 1's weight 16 is masked to 0 and still counts: the mean of
        // (2, 0) is 1.
        let cfg = IsConfig {
            level: IsLevel::Sequence,
            ..cfg
        };
        let old = [2f64.ln(), 0.0, 4f64.ln(), 0.0];
        is_weights(&cfg, &old, &[0.0; 4], &Tokens::padded(2, 2, None), &mut w).unwrap();
        assert_eq!(w, [2.0, 2.0, 0.0, 0.0]);
        // verl divides only by a mean above 1e-8: every r = −19 gives e^{−19} = 5.6e-9, left
        // as it is (not blown up to 1).
        let cfg = IsConfig {
            batch_normalize: true,
            ..IsConfig::default()
        };
        let mut w = [0.0; 4];
        is_weights(
            &cfg,
            &[-19.0; 4],
            &[0.0; 4],
            &Tokens::padded(2, 2, None),
            &mut w,
        )
        .unwrap();
        let e19 = (-19f64).exp();
        assert!(w.iter().all(|&x| (x - e19).abs() <= 1e-15 * e19), "{w:?}");
    }

    #[test]
    fn extreme_and_garbage_inputs_stay_finite() {
        let old = [1000.0f32, -1000.0, f32::NAN, 0.0];
        let roll = [0.0f32, 0.0, 0.0, f32::INFINITY];
        let mask = [true, true, false, false];
        let t = Tokens::padded(1, 4, Some(&mask));
        let mut w = [9.0f32; 4];
        for cfg in [
            IsConfig::default(),
            IsConfig {
                log_clamp: None,
                ..IsConfig::default()
            },
            IsConfig {
                level: IsLevel::Sequence,
                log_clamp: None,
                ..IsConfig::default()
            },
        ] {
            is_weights(&cfg, &old, &roll, &t, &mut w).unwrap();
            assert!(w.iter().all(|x| x.is_finite()));
            assert_eq!(&w[2..], &[0.0, 0.0]);
        }
    }

    #[test]
    fn errors_leave_outputs_untouched() {
        let mut w = [7.0f64; 2];
        let t = Tokens::padded(1, 2, None);
        let bad = IsConfig::token_mask(2.0, 1.0);
        assert!(matches!(
            is_weights(&bad, &[0.0; 2], &[0.0; 2], &t, &mut w),
            Err(Error::InvalidParam { .. })
        ));
        assert!(matches!(
            is_weights(
                &IsConfig::default(),
                &[0.0; 2],
                &[0.0, f64::NAN],
                &t,
                &mut w
            ),
            Err(Error::NonFinite {
                what: "roll",
                index: 1
            })
        ));
        assert_eq!(w, [7.0; 2]);
        assert!(RejectionCriterion::<f64>::k1(RejectLevel::SeqMax, 0.5, 2.0).is_err());
        assert!(RejectionCriterion::<f64>::upper(RejectStat::K3, RejectLevel::Token, 0.0).is_err());
        let c = [RejectionCriterion {
            stat: RejectStat::K2,
            level: RejectLevel::Token,
            lo: 1.0,
            hi: 0.0,
        }];
        // Both sentinels: whatever a call would write, one of them shows it.
        for sentinel in [true, false] {
            let mut keep = [sentinel; 2];
            assert!(rejection_mask(&c, &[0.0; 2], &[0.0; 2], &t, &mut keep).is_err());
            assert!(
                off_policy_sequence_mask(&[0.0], &[0.0; 2], &[0.0; 2], &t, -1.0, &mut keep[..1])
                    .is_err()
            );
            assert!(
                off_policy_sequence_mask(
                    &[0.0, 0.0],
                    &[0.0; 2],
                    &[0.0; 2],
                    &t,
                    1.0,
                    &mut keep[..1]
                )
                .is_err()
            );
            assert_eq!(keep, [sentinel; 2]);
        }
        // The same inputs with a valid δ and length: the sequence (A = 0) is kept, so the
        // `false` sentinel above would have shown a write.
        let mut keep = [false; 1];
        off_policy_sequence_mask(&[0.0], &[0.0; 2], &[0.0; 2], &t, 1.0, &mut keep).unwrap();
        assert_eq!(keep, [true]);
    }

    #[test]
    fn huge_truncation_bounds_do_not_overflow_the_means() {
        // Regression (fuzz): every weight clamped up to 3e38; 16 of them sum past f32::MAX.
        let cfg = IsConfig {
            filter: IsFilter::Truncate {
                min: 3e38f32,
                max: 3.1e38,
            },
            batch_normalize: true,
            ..IsConfig::default()
        };
        let mut w = [0.0f32; 16];
        let d = is_weights(
            &cfg,
            &[0.0; 16],
            &[0.0; 16],
            &Tokens::padded(4, 4, None),
            &mut w,
        )
        .unwrap();
        // All weights equal 3e38, so their mean is 3e38 and the normalised weights are 1.
        assert!(w.iter().all(|&x| x == 1.0));
        assert_eq!(d.mean, 1.0);
    }

    #[test]
    fn seq_max_k3_and_seq_sum() {
        // r = [0, 1 | 0.1, 0.1]: k3 = e^r − 1 − r = [0, e − 2 = 0.718…| 0.00517…, 0.00517…].
        let old = [0.0f64, 1.0, 0.1, 0.1];
        let t = Tokens::padded(2, 2, None);
        let mut keep = [false; 4];
        let c = [RejectionCriterion::upper(RejectStat::K3, RejectLevel::SeqMax, 0.5).unwrap()];
        rejection_mask(&c, &old, &[0.0; 4], &t, &mut keep).unwrap();
        assert_eq!(keep, [false, false, true, true]);
        // seq_sum_k1 with ratio bounds [0.5, 2]: Σk1 = −Σr = −1 < ln ½ (reject), −0.2 (keep).
        let c = [RejectionCriterion::k1(RejectLevel::SeqSum, 0.5, 2.0).unwrap()];
        rejection_mask(&c, &old, &[0.0; 4], &t, &mut keep).unwrap();
        assert_eq!(keep, [false, false, true, true]);
    }

    #[test]
    fn k1_bounds_the_statistic_as_verl_does() {
        // verl's "0.5_1.2": keep iff ln 0.5 ≤ k1 = −r ≤ ln 1.2, i.e. r ∈ [−0.1823, 0.6931].
        // r = [0.5, −0.5, 0.6, −0.1]: keep, reject, keep, keep. (Bounding r itself by
        // [ln 0.5, ln 1.2] would keep −0.5 and reject 0.5 and 0.6.)
        let old = [0.5f64, -0.5, 0.6, -0.1];
        let t = Tokens::padded(1, 4, None);
        let mut keep = [false; 4];
        let c = [RejectionCriterion::k1(RejectLevel::Token, 0.5, 1.2).unwrap()];
        rejection_mask(&c, &old, &[0.0; 4], &t, &mut keep).unwrap();
        assert_eq!(keep, [true, false, true, true]);
        // verl accepts a pair above 1 ("1.1_1.5": ln 1.1 ≤ −r ≤ ln 1.5).
        let c = [RejectionCriterion::k1(RejectLevel::Token, 1.1, 1.5).unwrap()];
        let old = [-0.2f64, 0.2, 0.0, -0.5];
        rejection_mask(&c, &old, &[0.0; 4], &t, &mut keep).unwrap();
        assert_eq!(keep, [true, false, false, false]);
        assert!(RejectionCriterion::<f64>::k1(RejectLevel::Token, 2.0, 1.5).is_err());
        assert!(RejectionCriterion::<f64>::k1(RejectLevel::Token, 0.0, 1.5).is_err());
    }

    #[test]
    fn rejection_statistics_clamp_r_at_20_as_verl_does() {
        // token_k2 ≤ 250 at r = 25: verl's k2 is ½·20² = 200 (kept), not 312.5.
        let t = Tokens::padded(1, 1, None);
        let mut keep = [false];
        let c = [RejectionCriterion::upper(RejectStat::K2, RejectLevel::Token, 250.0).unwrap()];
        rejection_mask(&c, &[25.0f64], &[0.0], &t, &mut keep).unwrap();
        assert_eq!(keep, [true]);
        // seq_sum_k1 in [½, 2] over r = [30, −25]: clamped, Σk1 = −(20 − 20) = 0 (kept);
        // unclamped it would be −5 (rejected).
        let t = Tokens::padded(1, 2, None);
        let mut keep = [false; 2];
        let c = [RejectionCriterion::k1(RejectLevel::SeqSum, 0.5, 2.0).unwrap()];
        rejection_mask(&c, &[30.0f64, -25.0], &[0.0; 2], &t, &mut keep).unwrap();
        assert_eq!(keep, [true, true]);
        // k3 at r = 1000: e^20 − 21.
        let c = [RejectionCriterion::upper(RejectStat::K3, RejectLevel::SeqMax, 4.9e8).unwrap()];
        rejection_mask(&c, &[1000.0f64, 0.0], &[0.0; 2], &t, &mut keep).unwrap();
        assert_eq!(keep, [true, true]);
        let c = [RejectionCriterion::upper(RejectStat::K3, RejectLevel::SeqMax, 4.8e8).unwrap()];
        rejection_mask(&c, &[1000.0f64, 0.0], &[0.0; 2], &t, &mut keep).unwrap();
        assert_eq!(keep, [false, false]);
    }
}
