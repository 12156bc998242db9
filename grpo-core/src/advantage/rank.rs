//! Rank-based group advantages: GOPO (linear in the rank) and G²RPO (normal scores of the rank)
//! (MATH.md §2).
//!
//! Both rank the scorable members of each group among themselves, so they work for every
//! [`Groups`] layout, scattered (`Permuted`) members included: the member indices are gathered
//! into caller scratch of [`rank_scratch_len`] elements and sorted there. Ties are broken or
//! shared as documented per estimator; the order among ties is the batch order (stable), so
//! results never depend on a sort algorithm.

use crate::error::{Error, Result, check_len};
use crate::layout::Groups;
use crate::presets::Preset;
use crate::real::Real;
use crate::stats::{RankOrder, TiePolicy, norm_quantile, rank_indices};

use super::{Diagnostics, NanPolicy};

/// Scratch (`usize` elements) that [`gopo`] and [`g2rpo`] need for a batch of `n` samples.
pub const fn rank_scratch_len(n: usize) -> usize {
    n
}

/// Configuration of [`gopo`].
///
/// | preset | `ties` | `nan` |
/// |---|---|---|
/// | `Paper` (= `Default`) and every other preset | `Ordinal` | `Reject` |
///
/// GOPO exists only in its paper's code \[2602.03876\], which sorts scores and assigns distinct
/// ranks in whatever order the sort leaves ties; `Ordinal` reproduces it with a defined order
/// (earlier batch index = better rank). `Average` gives tied samples the same advantage, and an
/// all-tied group advantage 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GopoConfig {
    /// Tie policy of the ranks.
    pub ties: TiePolicy,
    /// NaN scores: error (default) or excluded from the ranking (advantage 0).
    pub nan: NanPolicy,
}

impl Default for GopoConfig {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl GopoConfig {
    /// The configuration a preset uses (all presets are the paper's; see the type's docs).
    pub fn from_preset(_preset: Preset) -> Self {
        GopoConfig {
            ties: TiePolicy::Ordinal,
            nan: NanPolicy::Reject,
        }
    }
}

/// Configuration of [`g2rpo`].
///
/// | preset | `nan` |
/// |---|---|
/// | `Paper` (= `Default`) and every other preset | `Reject` |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct G2rpoConfig {
    /// NaN scores: error (default) or excluded from the ranking (advantage 0).
    pub nan: NanPolicy,
}

impl Default for G2rpoConfig {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl G2rpoConfig {
    /// The configuration a preset uses (no peer implements G²RPO; all presets are ours).
    pub fn from_preset(_preset: Preset) -> Self {
        G2rpoConfig {
            nan: NanPolicy::Reject,
        }
    }
}

/// Shared validation: layout, lengths, scratch, scores; returns the group count.
fn validate<T: Real>(
    scores: &[T],
    groups: &Groups<'_>,
    nan: NanPolicy,
    scratch: &[usize],
    out: &[T],
    min_group: usize,
) -> Result<usize> {
    let n = scores.len();
    let num_groups = groups.validate(n)?;
    check_len("out", n, out.len())?;
    if scratch.len() < rank_scratch_len(n) {
        return Err(Error::ScratchTooSmall {
            needed: rank_scratch_len(n),
            found: scratch.len(),
        });
    }
    for (index, s) in scores.iter().enumerate() {
        let excluded_nan = nan == NanPolicy::Exclude && s.is_nan();
        if !s.is_finite() && !excluded_nan {
            return Err(Error::NonFinite {
                what: "scores",
                index,
            });
        }
    }
    for k in 0..num_groups {
        let size = groups.size(k);
        if size == 0 {
            return Err(Error::EmptyGroup { group: k });
        }
        if size < min_group {
            return Err(Error::GroupTooSmall {
                group: k,
                needed: min_group,
                found: size,
            });
        }
    }
    Ok(num_groups)
}

/// The loop every rank estimator shares: validates, then for each group gathers its scorable
/// members into `scratch`, counts NaN exclusions, singletons and all-tied groups, and hands the
/// member indices to `per_group`, which writes their advantages into `out`.
fn for_each_ranked_group<T: Real>(
    scores: &[T],
    groups: &Groups<'_>,
    nan: NanPolicy,
    scratch: &mut [usize],
    out: &mut [T],
    min_group: usize,
    mut per_group: impl FnMut(&mut [usize], &mut [T]),
) -> Result<Diagnostics<T>> {
    let num_groups = validate(scores, groups, nan, scratch, out, min_group)?;
    let mut diag = Diagnostics {
        groups: num_groups,
        ..Diagnostics::default()
    };
    for k in 0..num_groups {
        let g = gather(scores, groups, k, scratch, out);
        diag.nan_excluded += groups.size(k) - g;
        let idx = &mut scratch[..g];
        if g == 1 {
            diag.singleton_groups += 1;
        } else if all_equal(scores, idx) {
            diag.zero_variance_groups += 1;
        }
        per_group(idx, out);
    }
    Ok(diag.summarize(out))
}

/// Gathers group `k`'s scorable members into `scratch` (batch order) and writes 0 for the
/// excluded ones. Returns the scorable count.
fn gather<T: Real>(
    scores: &[T],
    groups: &Groups<'_>,
    k: usize,
    scratch: &mut [usize],
    out: &mut [T],
) -> usize {
    let mut g = 0;
    for i in groups.members(k) {
        if scores[i].is_nan() {
            out[i] = T::ZERO;
        } else {
            scratch[g] = i;
            g += 1;
        }
    }
    g
}

/// Whether the scorable members of a group (gathered in `idx`) are all equal.
fn all_equal<T: Real>(scores: &[T], idx: &[usize]) -> bool {
    match idx.first() {
        Some(&f) => idx.iter().all(|&i| scores[i] == scores[f]),
        None => false,
    }
}

/// GOPO advantages: `A = 2 − 4(rank − 1)/(G − 1)`, rank 1 = the best (highest) score of the
/// group, so advantages run linearly from +2 (best) to −2 (worst) and sum to 0 per group.
///
/// Source: GOPO \[2602.03876\]. Ties per [`GopoConfig::ties`]: `Ordinal` gives distinct ranks,
/// the earlier batch index first (the paper's code, with its arbitrary tie order made stable);
/// `Average` gives tied samples the mean of their ranks (an all-tied group gets 0).
/// Under [`NanPolicy::Exclude`] NaN samples get 0 and `G` is the number of scorable members; a
/// group left with fewer than two scorable members gets 0 (counted in
/// [`Diagnostics::singleton_groups`] when exactly one remains). All-equal groups are counted in
/// [`Diagnostics::zero_variance_groups`]; note that under `Ordinal` they still get the full
/// +2…−2 spread (the paper's behaviour), under `Average` they get 0.
///
/// # Errors
/// Layout errors of [`Groups::validate`]; [`Error::LengthMismatch`] for `out`;
/// [`Error::ScratchTooSmall`] (see [`rank_scratch_len`]); [`Error::EmptyGroup`];
/// [`Error::GroupTooSmall`] for a group of one sample; [`Error::NonFinite`] (`scores`) for
/// ±∞, and for NaN under [`NanPolicy::Reject`]. On error `out` is untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::rank::{gopo, rank_scratch_len, GopoConfig};
/// use grpo_core::layout::Groups;
/// use grpo_core::stats::TiePolicy;
/// // G = 3: ranks (best first) of [0.1, 0.9, 0.5] are [3, 1, 2] → A = 2 − 2(rank − 1).
/// let mut scratch = [0usize; rank_scratch_len(3)];
/// let mut out = [0.0f64; 3];
/// gopo(&[0.1, 0.9, 0.5], Groups::Uniform(3), &GopoConfig::default(), &mut scratch, &mut out)
///     .unwrap();
/// assert_eq!(out, [-2.0, 2.0, 0.0]);
/// let avg = GopoConfig { ties: TiePolicy::Average, ..GopoConfig::default() };
/// gopo(&[1.0, 1.0, 1.0], Groups::Uniform(3), &avg, &mut scratch, &mut out).unwrap();
/// assert_eq!(out, [0.0, 0.0, 0.0]);
/// ```
pub fn gopo<T: Real>(
    scores: &[T],
    groups: Groups<'_>,
    cfg: &GopoConfig,
    scratch: &mut [usize],
    out: &mut [T],
) -> Result<Diagnostics<T>> {
    for_each_ranked_group(scores, &groups, cfg.nan, scratch, out, 2, |idx, out| {
        let g = idx.len();
        if g < 2 {
            // Only a singleton left after excluding NaN samples: nothing to rank against.
            for &i in idx.iter() {
                out[i] = T::ZERO;
            }
            return;
        }
        // Ranks go to `out` first, then are mapped in place.
        rank_indices(scores, idx, cfg.ties, RankOrder::Descending, out);
        let span = T::from_usize(g - 1);
        let four = T::TWO + T::TWO;
        for &i in idx.iter() {
            out[i] = T::TWO - four * (out[i] - T::ONE) / span;
        }
    })
}

/// Normal score of ascending rank `r` (1-based) among `g`: `Φ⁻¹((r − ½)/g)`, in f64, made
/// exactly antisymmetric: ranks above the centre are the negated scores of their mirror ranks.
fn normal_score(r: usize, g: usize) -> f64 {
    let mirror = g + 1 - r;
    if 2 * r == g + 1 {
        0.0
    } else if r > mirror {
        -normal_score(mirror, g)
    } else {
        // 0 < (2r − 1)/(2g) < ½ here, so the quantile is defined; the fallback is unreachable.
        norm_quantile((2 * r - 1) as f64 / (2 * g) as f64).unwrap_or(0.0)
    }
}

/// G²RPO advantages (our definition of the mapping): the normal score of each sample's
/// ascending rank in its group, `A = Φ⁻¹((rank − ½)/G)`.
///
/// Source: G²RPO \[2604.08539\]; the exact mapping and the tie rule are ours. Ties: a block of
/// tied samples spanning ranks `a..=b` shares the *mean of the normal scores* of those ranks,
/// `(1/(b−a+1)) Σ_{r=a..b} Φ⁻¹((r − ½)/G)` (the "average scores" rule of rank statistics).
/// (Φ⁻¹ of the average mid-rank, read literally, would not have mean 0: scores [0, 0, 1] give
/// mid-ranks 1.5, 1.5, 3 and `2Φ⁻¹(1/3) + Φ⁻¹(5/6) ≠ 0`.) Consequences:
/// - ties share one value; an all-equal group (one block spanning every rank) gets exactly 0,
///   and so does any tie block centred on the middle rank; a group of one gets Φ⁻¹(½) = 0;
/// - mean 0: mathematically for every group. In floating point the scores of mirror ranks
///   `r` and `G + 1 − r` are exact negatives (the upper one is computed as the negated lower
///   one, and rounding to `T` is symmetric), so without ties the written values form a
///   multiset closed under negation — their exact sum is 0. Tie blocks not centred on the
///   middle are averaged in f64 and rounded once, so there the mean is 0 up to that rounding.
///
/// Quantiles are evaluated in f64 (see [`norm_quantile`]) and rounded to `T` once. Under
/// [`NanPolicy::Exclude`] NaN samples get 0 and `G` counts the scorable members only.
///
/// # Errors
/// Layout errors of [`Groups::validate`]; [`Error::LengthMismatch`] for `out`;
/// [`Error::ScratchTooSmall`] (see [`rank_scratch_len`]); [`Error::EmptyGroup`];
/// [`Error::NonFinite`] (`scores`) for ±∞, and for NaN under [`NanPolicy::Reject`].
/// On error `out` is untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::rank::{g2rpo, rank_scratch_len, G2rpoConfig};
/// use grpo_core::layout::Groups;
/// use grpo_core::stats::norm_quantile;
/// // G = 4, no ties: ranks [3, 1, 4, 2] → Φ⁻¹(5/8), Φ⁻¹(1/8), Φ⁻¹(7/8), Φ⁻¹(3/8).
/// let mut scratch = [0usize; rank_scratch_len(4)];
/// let mut out = [0.0f64; 4];
/// g2rpo(&[0.5, 0.0, 0.9, 0.2], Groups::Uniform(4), &G2rpoConfig::default(), &mut scratch,
///     &mut out).unwrap();
/// let (q1, q3) = (norm_quantile(0.125f64).unwrap(), norm_quantile(0.375f64).unwrap());
/// assert_eq!(out, [-q3, q1, -q1, q3]);
/// assert!((q1 + 1.1503493803760079).abs() < 1e-12);
/// ```
pub fn g2rpo<T: Real>(
    scores: &[T],
    groups: Groups<'_>,
    cfg: &G2rpoConfig,
    scratch: &mut [usize],
    out: &mut [T],
) -> Result<Diagnostics<T>> {
    for_each_ranked_group(scores, &groups, cfg.nan, scratch, out, 1, |idx, out| {
        let g = idx.len();
        // Sorts `idx` ascending (ties in batch order); the ordinal ranks it writes to `out`
        // are overwritten below.
        rank_indices(scores, idx, TiePolicy::Ordinal, RankOrder::Ascending, out);
        let mut start = 0;
        while start < g {
            let v = scores[idx[start]];
            let mut end = start + 1;
            while end < g && scores[idx[end]] == v {
                end += 1;
            }
            // The block holds ranks start+1 ..= end.
            let shared = if start + 1 + end == g + 1 {
                // Centred on the middle rank: the scores cancel pairwise, exactly.
                0.0
            } else {
                let sum: f64 = (start + 1..=end).map(|r| normal_score(r, g)).sum();
                sum / (end - start) as f64
            };
            let shared = T::from_f64(shared);
            for &i in &idx[start..end] {
                out[i] = shared;
            }
            start = end;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_gopo(scores: &[f64], ties: TiePolicy) -> [f64; 4] {
        let mut out = [9.0; 4];
        let mut s = [0usize; 4];
        gopo(
            scores,
            Groups::Uniform(scores.len()),
            &GopoConfig {
                ties,
                nan: NanPolicy::Reject,
            },
            &mut s,
            &mut out[..scores.len()],
        )
        .unwrap();
        out
    }

    #[test]
    fn gopo_hand_computed_g3_g4() {
        // G = 3: A = 2 − 2(rank − 1) ∈ {2, 0, −2}.
        // [5, 5, 1] ordinal: ranks 1, 2, 3 → [2, 0, −2]; average: 1.5, 1.5, 3 → [1, 1, −2].
        assert_eq!(
            run_gopo(&[5.0, 5.0, 1.0], TiePolicy::Ordinal)[..3],
            [2.0, 0.0, -2.0]
        );
        assert_eq!(
            run_gopo(&[5.0, 5.0, 1.0], TiePolicy::Average)[..3],
            [1.0, 1.0, -2.0]
        );
        // G = 4: A = 2 − (4/3)(rank − 1) ∈ {2, 2/3, −2/3, −2}.
        // [1, 3, 3, 0] ordinal: ranks 3, 1, 2, 4 → [−2/3, 2, 2/3, −2];
        // average: 3, 1.5, 1.5, 4 → [−2/3, 2 − 2/3 = 4/3, 4/3, −2].
        let o = run_gopo(&[1.0, 3.0, 3.0, 0.0], TiePolicy::Ordinal);
        let want = [-2.0 / 3.0, 2.0, 2.0 / 3.0, -2.0];
        assert!(
            o.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-15),
            "{o:?}"
        );
        let a = run_gopo(&[1.0, 3.0, 3.0, 0.0], TiePolicy::Average);
        let want = [-2.0 / 3.0, 4.0 / 3.0, 4.0 / 3.0, -2.0];
        assert!(
            a.iter().zip(want).all(|(x, y)| (x - y).abs() < 1e-15),
            "{a:?}"
        );
        // All tied, G = 4: ordinal keeps index order → [2, 2/3, −2/3, −2]; average → 0.
        let o = run_gopo(&[0.3; 4], TiePolicy::Ordinal);
        let want = [2.0, 2.0 / 3.0, -2.0 / 3.0, -2.0];
        assert!(
            o.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-15),
            "{o:?}"
        );
        assert_eq!(run_gopo(&[0.3; 4], TiePolicy::Average), [0.0; 4]);
    }

    #[test]
    fn gopo_scattered_groups_and_nan_exclusion() {
        // ids [0, 1, 0, 1, 0]: group 0 = samples 0, 2, 4; group 1 = samples 1, 3.
        let ids = [0, 1, 0, 1, 0];
        let mut gs = [0usize; Groups::group_ids_scratch_len(5, 2)];
        let groups = Groups::from_group_ids(&ids, 2, &mut gs).unwrap();
        let scores = [1.0f64, 7.0, 3.0, f64::NAN, 2.0];
        let cfg = GopoConfig {
            nan: NanPolicy::Exclude,
            ..GopoConfig::default()
        };
        let mut s = [0usize; 5];
        let mut out = [9.0f64; 5];
        let d = gopo(&scores, groups, &cfg, &mut s, &mut out).unwrap();
        // Group 0: 1, 3, 2 → ranks 3, 1, 2 → −2, 2, 0. Group 1: 7 alone scorable → 0.
        assert_eq!(out, [-2.0, 0.0, 2.0, 0.0, 0.0]);
        assert_eq!((d.nan_excluded, d.singleton_groups), (1, 1));
    }

    #[test]
    fn gopo_errors_leave_out_untouched() {
        let mut s = [0usize; 4];
        let mut out = [7.0f64; 4];
        let cfg = GopoConfig::default();
        assert_eq!(
            gopo(
                &[1.0, 2.0, 3.0, 4.0],
                Groups::Offsets(&[0, 1, 4]),
                &cfg,
                &mut s,
                &mut out
            ),
            Err(Error::GroupTooSmall {
                group: 0,
                needed: 2,
                found: 1
            })
        );
        assert_eq!(
            gopo(
                &[1.0, 2.0, 3.0, 4.0],
                Groups::Offsets(&[0, 4, 4]),
                &cfg,
                &mut s,
                &mut out
            ),
            Err(Error::EmptyGroup { group: 1 })
        );
        assert_eq!(
            gopo(
                &[1.0, f64::NAN, 3.0, 4.0],
                Groups::Uniform(2),
                &cfg,
                &mut s,
                &mut out
            ),
            Err(Error::NonFinite {
                what: "scores",
                index: 1
            })
        );
        assert!(matches!(
            gopo(&[1.0; 4], Groups::Uniform(2), &cfg, &mut s[..3], &mut out),
            Err(Error::ScratchTooSmall {
                needed: 4,
                found: 3
            })
        ));
        assert!(matches!(
            gopo(&[1.0; 3], Groups::Uniform(3), &cfg, &mut s, &mut out),
            Err(Error::LengthMismatch { what: "out", .. })
        ));
        assert_eq!(out, [7.0; 4]);
    }

    #[test]
    fn g2rpo_ties_hand_computed() {
        // [0, 0, 1]: ranks 1, 2 tie → mean(Φ⁻¹(1/6), Φ⁻¹(1/2)) = Φ⁻¹(1/6)/2; rank 3 → Φ⁻¹(5/6).
        let q = norm_quantile(1.0f64 / 6.0).unwrap();
        let mut s = [0usize; 3];
        let mut out = [9.0f64; 3];
        let d = g2rpo(
            &[0.0, 0.0, 1.0],
            Groups::Uniform(3),
            &G2rpoConfig::default(),
            &mut s,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [q / 2.0, q / 2.0, -q]);
        assert_eq!(out[0] + out[1] + out[2], 0.0);
        assert_eq!(d.zero_variance_groups, 0);
        // All equal → exactly 0; a group of one → 0.
        let d = g2rpo(
            &[0.7, 0.7, 0.7],
            Groups::Uniform(3),
            &G2rpoConfig::default(),
            &mut s,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [0.0; 3]);
        assert_eq!(d.zero_variance_groups, 1);
        let d = g2rpo(
            &[0.7, 0.1, 0.2],
            Groups::Uniform(1),
            &G2rpoConfig::default(),
            &mut s,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [0.0; 3]);
        assert_eq!(d.singleton_groups, 3);
    }

    #[test]
    fn g2rpo_errors_leave_out_untouched() {
        let mut s = [0usize; 3];
        let mut out = [7.0f32; 3];
        let cfg = G2rpoConfig::default();
        assert_eq!(
            g2rpo(
                &[1.0, f32::INFINITY, 0.0],
                Groups::Uniform(3),
                &cfg,
                &mut s,
                &mut out
            ),
            Err(Error::NonFinite {
                what: "scores",
                index: 1
            })
        );
        assert_eq!(
            g2rpo(
                &[1.0, 2.0, 0.0],
                Groups::Offsets(&[0, 0, 3]),
                &cfg,
                &mut s,
                &mut out
            ),
            Err(Error::EmptyGroup { group: 0 })
        );
        assert_eq!(out, [7.0; 3]);
    }
}
