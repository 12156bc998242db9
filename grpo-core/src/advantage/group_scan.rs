//! Shared machinery of the group-statistic estimators (z-score family): input validation,
//! per-group moments with an exact two-sample path, and the check-then-write driver that keeps
//! outputs untouched on any error.

use super::{Diagnostics, NanPolicy};
use crate::error::{Error, Result, ensure};
use crate::layout::{Groups, Members};
use crate::real::Real;
use crate::stats::{Bessel, Moments};

/// Validates the layout for `n` samples and rejects empty groups; returns the group count.
pub(crate) fn validate_groups(groups: &Groups<'_>, n: usize) -> Result<usize> {
    let num_groups = groups.validate(n)?;
    if let Some(group) = (0..num_groups).find(|&k| groups.size(k) == 0) {
        return Err(Error::EmptyGroup { group });
    }
    Ok(num_groups)
}

/// Checks every value: ±∞ is always an error, NaN is one under [`NanPolicy::Reject`].
/// Returns the number of NaN values (all tolerated under [`NanPolicy::Exclude`]).
pub(crate) fn check_values<T: Real>(
    what: &'static str,
    values: &[T],
    nan: NanPolicy,
) -> Result<usize> {
    let mut nans = 0;
    for (index, &v) in values.iter().enumerate() {
        if v.is_nan() {
            if nan == NanPolicy::Reject {
                return Err(Error::NonFinite { what, index });
            }
            nans += 1;
        } else if !v.is_finite() {
            return Err(Error::NonFinite { what, index });
        }
    }
    Ok(nans)
}

/// `Err(InvalidParam)` unless `v` is finite and `>= 0` (NaN fails).
pub(crate) fn check_nonneg(name: &'static str, v: f64) -> Result<()> {
    ensure(v.is_finite() && v >= 0.0, name, "must be finite and >= 0")
}

/// A sample's score, or `None` when it is unscorable (NaN; only reachable under
/// [`NanPolicy::Exclude`], since validation rejects NaN otherwise).
#[inline]
pub(crate) fn scorable<T: Real>(x: T) -> Option<T> {
    if x.is_nan() { None } else { Some(x) }
}

/// `num / den`, except that a zero numerator or a zero denominator gives exactly 0.
///
/// A zero numerator means the sample sits on the baseline (always the case in a group of equal
/// scores, whose Welford mean is exact); a zero denominator only occurs with ε = 0 when the
/// measured spread is 0, where every numerator is 0 up to underflow. Both give 0, never NaN.
#[inline]
pub(crate) fn ratio<T: Real>(num: T, den: T) -> T {
    if num == T::ZERO || den == T::ZERO {
        T::ZERO
    } else {
        num / den
    }
}

/// `x^γ` for `x ≥ 0` and γ ∈ [0, 1], with γ = 1 and γ = 0 exact (no `powf` rounding).
#[inline]
pub(crate) fn dial<T: Real>(x: T, gamma: f64) -> T {
    if gamma == 1.0 {
        x
    } else if gamma == 0.0 {
        T::ONE
    } else {
        x.powf(T::from_f64(gamma))
    }
}

/// Moments of the scorable members of one group, plus the data of the exact two-sample path.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupStats<T> {
    /// Welford moments of the scorable scores, in member order.
    pub moments: Moments<T>,
    /// First scorable score (two-sample path).
    first: T,
    /// (second − first)/2 (two-sample path).
    half_gap: T,
}

impl<T: Real> GroupStats<T> {
    /// Statistics of the scorable values `value(i)` over `members`.
    pub(crate) fn of(members: Members<'_>, value: &dyn Fn(usize) -> Option<T>) -> Self {
        let mut moments = Moments::new();
        let (mut first, mut second) = (T::ZERO, T::ZERO);
        for i in members {
            if let Some(s) = value(i) {
                match moments.n {
                    0 => first = s,
                    1 => second = s,
                    _ => {}
                }
                moments.push(s);
            }
        }
        GroupStats {
            moments,
            first,
            half_gap: (second - first) * T::HALF,
        }
    }

    /// Number of scorable members.
    #[inline]
    pub(crate) fn n(&self) -> usize {
        self.moments.n
    }

    /// Whether all scorable members have the same score (meaningful for `n ≥ 2`).
    #[inline]
    pub(crate) fn zero_spread(&self) -> bool {
        self.moments.m2 == T::ZERO
    }

    /// `s − μ` for a scorable member's score `s`.
    ///
    /// Two scorable members get exactly `∓(s₂ − s₁)/2` (first, second): the pair is symmetric
    /// bit for bit, which `s − μ` with a rounded μ does not guarantee (2-GRPO, [2510.00977]).
    /// Larger groups use the Welford mean, which equals every member exactly when all scores
    /// are equal, so such a group centers to exact zeros.
    #[inline]
    pub(crate) fn centered(&self, s: T) -> T {
        if self.moments.n == 2 {
            if self.half_gap == T::ZERO {
                T::ZERO
            } else if s == self.first {
                -self.half_gap
            } else {
                self.half_gap
            }
        } else {
            s - self.moments.mean
        }
    }

    /// Standard deviation with a variance floor: `sqrt(max(var, floor))`; `None` if undefined.
    #[inline]
    pub(crate) fn std_floored(&self, bessel: Bessel, floor: Option<f64>) -> Option<T> {
        std_floored(&self.moments, bessel, floor)
    }
}

/// `sqrt(max(var, floor))` of `m` (verl's vectorized std floor when `floor` is set).
#[inline]
pub(crate) fn std_floored<T: Real>(
    m: &Moments<T>,
    bessel: Bessel,
    floor: Option<f64>,
) -> Option<T> {
    let var = m.variance(bessel)?;
    Some(match floor {
        Some(f) => var.max(T::from_f64(f)).sqrt(),
        None => var.sqrt(),
    })
}

/// A computation that emits `(sample index, advantage)` pairs and returns its counters.
pub(crate) type Emit<'e, T> = &'e mut dyn FnMut(usize, T);

/// Runs `compute` once to check that it succeeds and that every advantage is finite, then a
/// second time writing into `out` (same arithmetic, same bits). Any error, including an
/// overflow that makes an advantage non-finite, is returned before `out` is touched.
///
/// # Errors
/// Whatever `compute` returns; [`Error::NonFinite`] with `what = "advantages"` and the sample's
/// index when an advantage overflows (only possible for scores near the type's range).
pub(crate) fn check_then_write<T: Real>(
    out: &mut [T],
    mut compute: impl FnMut(Emit<'_, T>) -> Result<Diagnostics<T>>,
) -> Result<Diagnostics<T>> {
    let mut bad: Option<usize> = None;
    compute(&mut |i, a| {
        if bad.is_none() && !a.is_finite() {
            bad = Some(i);
        }
    })?;
    if let Some(index) = bad {
        return Err(Error::NonFinite {
            what: "advantages",
            index,
        });
    }
    let diagnostics = compute(&mut |i, a| {
        if let Some(o) = out.get_mut(i) {
            *o = a;
        }
    })?;
    Ok(diagnostics.summarize(out))
}

/// Checks the `[n, K]` row-major reward matrix's shape; returns `n·K`.
pub(crate) fn check_matrix(n: usize, num_rewards: usize, len: usize) -> Result<usize> {
    ensure(num_rewards > 0, "num_rewards", "must be > 0")?;
    let total = n.checked_mul(num_rewards).ok_or(Error::InvalidParam {
        name: "num_rewards",
        reason: "samples × rewards overflows usize",
    })?;
    crate::error::check_len("rewards", total, len)?;
    Ok(total)
}

/// `Err(ScratchTooSmall)` unless `found >= needed`.
pub(crate) fn check_scratch(needed: usize, found: usize) -> Result<()> {
    if found >= needed {
        Ok(())
    } else {
        Err(Error::ScratchTooSmall { needed, found })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_centering_is_exactly_symmetric() {
        // 0.1 and 0.7: (0.7 − 0.1)/2 rounded once, then negated: the two are exact negatives.
        let v = [0.1f64, 0.7];
        let st = GroupStats::of(Groups::Uniform(2).members(0), &|i| Some(v[i]));
        assert_eq!(st.centered(0.1), -st.centered(0.7));
        assert_eq!(st.centered(0.7), (0.7 - 0.1) * 0.5);
        let same = [0.3f32, 0.3];
        let st = GroupStats::of(Groups::Uniform(2).members(0), &|i| Some(same[i]));
        assert_eq!(st.centered(0.3), 0.0);
    }

    #[test]
    fn ratio_and_dial_edge_cases() {
        assert_eq!(ratio(0.0f64, 0.0), 0.0);
        assert_eq!(ratio(1e-320f64, 0.0), 0.0);
        assert_eq!(ratio(3.0f64, 2.0), 1.5);
        assert_eq!(dial(4.0f64, 1.0), 4.0);
        assert_eq!(dial(4.0f64, 0.0), 1.0);
        assert_eq!(dial(4.0f64, 0.5), 2.0);
    }

    #[test]
    fn values_check_policy() {
        assert_eq!(
            check_values("r", &[1.0f64, f64::NAN], NanPolicy::Exclude),
            Ok(1)
        );
        assert_eq!(
            check_values("r", &[1.0f64, f64::NAN], NanPolicy::Reject),
            Err(Error::NonFinite {
                what: "r",
                index: 1
            })
        );
        assert_eq!(
            check_values("r", &[f64::NEG_INFINITY], NanPolicy::Exclude),
            Err(Error::NonFinite {
                what: "r",
                index: 0
            })
        );
    }
}
