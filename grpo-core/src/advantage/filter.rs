//! Group filters: which groups to keep for training (MATH.md §2). They write one `bool` per
//! group into a caller mask and return the number kept; they never reorder or drop anything
//! themselves.

use crate::error::{Error, Result, check_len, ensure};
use crate::layout::Groups;
use crate::presets::Preset;
use crate::real::Real;
use crate::stats::Moments;

fn validate_groups(n: usize, groups: &Groups<'_>, keep: &[bool]) -> Result<usize> {
    let num_groups = groups.validate(n)?;
    check_len("keep", num_groups, keep.len())?;
    if let Some(group) = (0..num_groups).find(|&k| groups.size(k) == 0) {
        return Err(Error::EmptyGroup { group });
    }
    Ok(num_groups)
}

/// Configuration of [`dynamic_sampling_keep_correct`] and [`dynamic_sampling_keep`].
///
/// | preset | `keep_singletons` |
/// |---|---|
/// | `Paper` (= `Default`), `Trl`, `OpenRlhf` | `false` |
/// | `Verl`, `VerlVectorized` | `true` |
///
/// A group of one sample never satisfies `0 < #correct < 1` (DAPO [2503.14476]), but verl
/// (b178a3cd) `filter_groups` keeps it (`std > 0 or len == 1`): its loop GRPO gives such a
/// sample the nonzero advantage `s/(1 + ε)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DynamicSamplingConfig {
    /// Keep groups of exactly one sample.
    pub keep_singletons: bool,
}

impl Default for DynamicSamplingConfig {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl DynamicSamplingConfig {
    /// The configuration a peer uses (see the table in the type's docs).
    pub fn from_preset(preset: Preset) -> Self {
        DynamicSamplingConfig {
            keep_singletons: matches!(preset, Preset::Verl | Preset::VerlVectorized),
        }
    }
}

fn write_keep(
    num_groups: usize,
    keep: &mut [bool],
    mut decide: impl FnMut(usize) -> bool,
) -> usize {
    let mut kept = 0;
    for k in 0..num_groups {
        keep[k] = decide(k);
        kept += usize::from(keep[k]);
    }
    kept
}

/// DAPO dynamic sampling on correctness flags: keep group `k` iff `0 < #correct < G`, i.e. the
/// group has both a correct and an incorrect answer (all-correct and all-wrong groups give zero
/// advantage under every group-relative estimator). A group of one is kept only with
/// [`DynamicSamplingConfig::keep_singletons`].
///
/// Source: DAPO \[2503.14476\] dynamic sampling; \[verl\] `filter_groups` with the `acc` metric.
///
/// # Errors
/// Layout errors of [`Groups::validate`]; [`Error::LengthMismatch`] (`keep`) unless there is one
/// flag per group; [`Error::EmptyGroup`]. On error `keep` is untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::filter::{dynamic_sampling_keep_correct, DynamicSamplingConfig};
/// use grpo_core::layout::Groups;
/// use grpo_core::Preset;
/// let correct = [true, false, true, true, false, false, true];
/// let groups = Groups::Offsets(&[0, 2, 4, 6, 7]);
/// let mut keep = [false; 4];
/// let cfg = DynamicSamplingConfig::default();
/// let kept = dynamic_sampling_keep_correct(&correct, groups, &cfg, &mut keep).unwrap();
/// assert_eq!((kept, keep), (1, [true, false, false, false]));
/// // verl keeps the group of one.
/// let cfg = DynamicSamplingConfig::from_preset(Preset::Verl);
/// dynamic_sampling_keep_correct(&correct, groups, &cfg, &mut keep).unwrap();
/// assert_eq!(keep, [true, false, false, true]);
/// ```
pub fn dynamic_sampling_keep_correct(
    correct: &[bool],
    groups: Groups<'_>,
    cfg: &DynamicSamplingConfig,
    keep: &mut [bool],
) -> Result<usize> {
    let num_groups = validate_groups(correct.len(), &groups, keep)?;
    Ok(write_keep(num_groups, keep, |k| {
        if cfg.keep_singletons && groups.size(k) == 1 {
            return true;
        }
        let hits = groups.members(k).filter(|&i| correct[i]).count();
        hits > 0 && hits < groups.size(k)
    }))
}

/// DAPO dynamic sampling on a scalar metric: keep group `k` iff the metric has spread, σ > 0,
/// decided as `max > min` over the group (exact, where a computed σ of two values closer than
/// ~1e-154 would underflow to 0, and verl's `np.std` would drop the group). The other way
/// round, `np.std` of identical non-dyadic values can be a rounding residue above 0 (1.4e-17
/// for [0.1, 0.1, 0.1]), and verl keeps such a group; here it has no spread and is dropped
/// (MATH.md §0: presets reproduce semantics, not rounding defects). With 0/1 correctness as
/// the metric this is [`dynamic_sampling_keep_correct`]; singletons as there.
///
/// Source: DAPO \[2503.14476\]; \[verl\] `filter_groups` (`np.std(metric) > 0`).
///
/// # Errors
/// As [`dynamic_sampling_keep_correct`], and [`Error::NonFinite`] (`metric`) for NaN or ±∞.
/// On error `keep` is untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::filter::{dynamic_sampling_keep, DynamicSamplingConfig};
/// use grpo_core::layout::Groups;
/// let metric = [0.5f64, 0.5, 0.2, 0.9];
/// let mut keep = [true; 2];
/// let cfg = DynamicSamplingConfig::default();
/// assert_eq!(dynamic_sampling_keep(&metric, Groups::Uniform(2), &cfg, &mut keep).unwrap(), 1);
/// assert_eq!(keep, [false, true]);
/// ```
pub fn dynamic_sampling_keep<T: Real>(
    metric: &[T],
    groups: Groups<'_>,
    cfg: &DynamicSamplingConfig,
    keep: &mut [bool],
) -> Result<usize> {
    let num_groups = validate_groups(metric.len(), &groups, keep)?;
    if let Some(index) = metric.iter().position(|m| !m.is_finite()) {
        return Err(Error::NonFinite {
            what: "metric",
            index,
        });
    }
    Ok(write_keep(num_groups, keep, |k| {
        if cfg.keep_singletons && groups.size(k) == 1 {
            return true;
        }
        let (mut lo, mut hi) = (T::INFINITY, T::NEG_INFINITY);
        for i in groups.members(k) {
            lo = lo.min(metric[i]);
            hi = hi.max(metric[i]);
        }
        hi > lo
    }))
}

/// Configuration of [`range_filter_keep`]: keep iff `lo < mean < hi` (both bounds exclusive).
///
/// | preset | `lo` | `hi` |
/// |---|---|---|
/// | every preset (= `Default`) | 0 | 1 |
///
/// Source: OpenRLHF (3c3be62) `--dynamic_filtering_reward_range` (default (0, 1)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RangeFilterConfig<T> {
    /// Exclusive lower bound of the group mean.
    pub lo: T,
    /// Exclusive upper bound of the group mean.
    pub hi: T,
}

impl<T: Real> Default for RangeFilterConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> RangeFilterConfig<T> {
    /// The configuration a preset uses (all the same; see the type's docs).
    pub fn from_preset(_preset: Preset) -> Self {
        RangeFilterConfig {
            lo: T::ZERO,
            hi: T::ONE,
        }
    }
}

/// OpenRLHF range filter: keep group `k` iff `lo < mean_k(score) < hi`. With binary rewards and
/// the default (0, 1) this drops all-wrong and all-correct groups, like DAPO.
///
/// The mean is Welford's, so a group of identical scores has exactly that score as its mean (a
/// sum-then-divide mean of identical non-dyadic values can land one ulp off and cross a bound).
///
/// Source: \[OpenRLHF\] dynamic filtering.
///
/// # Errors
/// As [`dynamic_sampling_keep`] (`scores`), and [`Error::InvalidParam`] unless `lo <= hi` (NaN
/// rejected; ±∞ allowed). On error `keep` is untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::filter::{range_filter_keep, RangeFilterConfig};
/// use grpo_core::layout::Groups;
/// let scores = [1.0f64, 1.0, 0.0, 1.0, 0.0, 0.0];
/// let mut keep = [false; 3];
/// let n = range_filter_keep(&scores, Groups::Uniform(2), &RangeFilterConfig::default(), &mut keep)
///     .unwrap();
/// assert_eq!((n, keep), (1, [false, true, false]));
/// ```
pub fn range_filter_keep<T: Real>(
    scores: &[T],
    groups: Groups<'_>,
    cfg: &RangeFilterConfig<T>,
    keep: &mut [bool],
) -> Result<usize> {
    ensure(
        !cfg.lo.is_nan() && !cfg.hi.is_nan() && cfg.lo <= cfg.hi,
        "lo, hi",
        "needs lo <= hi (no NaN)",
    )?;
    let num_groups = validate_groups(scores.len(), &groups, keep)?;
    if let Some(index) = scores.iter().position(|m| !m.is_finite()) {
        return Err(Error::NonFinite {
            what: "scores",
            index,
        });
    }
    Ok(write_keep(num_groups, keep, |k| {
        let m = Moments::from_iter(groups.members(k).map(|i| scores[i]));
        cfg.lo < m.mean && m.mean < cfg.hi
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DS: DynamicSamplingConfig = DynamicSamplingConfig {
        keep_singletons: false,
    };

    #[test]
    fn dynamic_sampling_both_forms_agree_on_binary() {
        // Groups of 3: [1,1,1] drop, [0,0,0] drop, [1,0,0] keep, [0,1,1] keep.
        let c = [
            true, true, true, false, false, false, true, false, false, false, true, true,
        ];
        let m: [f64; 12] = core::array::from_fn(|i| if c[i] { 1.0 } else { 0.0 });
        let (mut k1, mut k2) = ([false; 4], [false; 4]);
        assert_eq!(
            dynamic_sampling_keep_correct(&c, Groups::Uniform(3), &DS, &mut k1),
            Ok(2)
        );
        assert_eq!(
            dynamic_sampling_keep(&m, Groups::Uniform(3), &DS, &mut k2),
            Ok(2)
        );
        assert_eq!(k1, [false, false, true, true]);
        assert_eq!(k1, k2);
    }

    #[test]
    fn tiny_spread_is_kept_and_singletons_dropped() {
        let m = [0.0f64, 1e-300, 5.0];
        let mut keep = [false; 2];
        dynamic_sampling_keep(&m, Groups::Offsets(&[0, 2, 3]), &DS, &mut keep).unwrap();
        assert_eq!(keep, [true, false]);
        let verl = DynamicSamplingConfig::from_preset(Preset::Verl);
        dynamic_sampling_keep(&m, Groups::Offsets(&[0, 2, 3]), &verl, &mut keep).unwrap();
        assert_eq!(keep, [true, true]);
    }

    #[test]
    fn range_filter_bounds_are_exclusive() {
        // Means: 0.1 (identical non-dyadic, Welford exact) vs hi = 0.1 → dropped; 0.5 kept.
        let s = [0.1f64, 0.1, 0.1, 0.0, 1.0, 0.5];
        let cfg = RangeFilterConfig { lo: 0.0, hi: 0.1 };
        let mut keep = [true; 2];
        assert_eq!(
            range_filter_keep(&s, Groups::Uniform(3), &cfg, &mut keep),
            Ok(0)
        );
        assert_eq!(keep, [false, false]);
        let cfg = RangeFilterConfig { lo: 0.0, hi: 0.6 };
        assert_eq!(
            range_filter_keep(&s, Groups::Uniform(3), &cfg, &mut keep),
            Ok(2)
        );
    }

    #[test]
    fn errors_leave_keep_untouched() {
        let mut keep = [true; 2];
        assert!(matches!(
            dynamic_sampling_keep_correct(&[true; 4], Groups::Uniform(2), &DS, &mut keep[..1]),
            Err(Error::LengthMismatch { what: "keep", .. })
        ));
        assert_eq!(
            dynamic_sampling_keep(&[1.0, f64::NAN], Groups::Uniform(1), &DS, &mut keep),
            Err(Error::NonFinite {
                what: "metric",
                index: 1
            })
        );
        assert_eq!(
            dynamic_sampling_keep_correct(&[true; 2], Groups::Offsets(&[0, 0, 2]), &DS, &mut keep),
            Err(Error::EmptyGroup { group: 0 })
        );
        let bad = RangeFilterConfig { lo: 1.0, hi: 0.0 };
        assert!(matches!(
            range_filter_keep(&[0.5f64; 2], Groups::Uniform(1), &bad, &mut keep),
            Err(Error::InvalidParam { .. })
        ));
        let mut keep = [true; 2];
        assert!(matches!(
            range_filter_keep(
                &[0.5f64; 3],
                Groups::Uniform(2),
                &RangeFilterConfig::default(),
                &mut keep
            ),
            Err(Error::InvalidParam {
                name: "group_size",
                ..
            })
        ));
        assert_eq!(keep, [true; 2]);
    }
}
