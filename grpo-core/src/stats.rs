//! Statistics: mergeable moments, ranks with explicit tie policies, and the normal quantile.
//!
//! [`Moments`] uses Welford's update and Chan's parallel merge (Chan, Golub & LeVeque 1979), never
//! `E[x²] − E[x]²`: the one-pass form leaves ~1e-4 of variance on identical non-dyadic rewards,
//! which a z-score then blows up ~4000× (MATH.md §0). With Welford, identical values give a mean
//! equal to that value and `M2 == 0` *exactly*, so a zero-variance group yields advantage 0.

use crate::error::{Error, Result};
use crate::real::Real;

/// Which variance divisor to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Bessel {
    /// Divide by n − 1 (`torch.std` default; verl, TRL and OpenRLHF group statistics).
    #[default]
    Unbiased,
    /// Divide by n (population).
    Population,
}

/// Count, mean and sum of squared deviations `M2 = Σ (x − mean)²` of a sample, mergeable.
///
/// Merging is how batch statistics are all-reduced over data-parallel ranks: each rank computes
/// its `Moments`, they are combined with [`Moments::merge`] (in any fixed order), and the result
/// equals the single-machine one up to rounding.
///
/// # Example
/// ```
/// use grpo_core::stats::{Bessel, Moments};
/// let a = Moments::<f64>::from_slice(&[1.0, 2.0]);
/// let b = Moments::<f64>::from_slice(&[3.0, 4.0, 5.0]);
/// let all = a.merge(b);
/// assert_eq!(all.n, 5);
/// assert_eq!(all.mean, 3.0);
/// assert_eq!(all.m2, 10.0);
/// assert_eq!(all.variance(Bessel::Unbiased), Some(2.5));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Moments<T> {
    /// Number of values.
    pub n: usize,
    /// Their mean (0 when `n == 0`).
    pub mean: T,
    /// Σ (x − mean)².
    pub m2: T,
}

impl<T: Real> Moments<T> {
    /// No values.
    pub const fn new() -> Self {
        Moments {
            n: 0,
            mean: T::ZERO,
            m2: T::ZERO,
        }
    }

    /// Welford's update with one value.
    #[inline]
    pub fn push(&mut self, x: T) {
        self.n += 1;
        let delta = x - self.mean;
        self.mean += delta / T::from_usize(self.n);
        self.m2 += delta * (x - self.mean);
    }

    /// Moments of a slice (Welford, in index order).
    ///
    /// ```
    /// use grpo_core::stats::{Bessel, Moments};
    /// // [2, 4, 6]: mean 4, Σ(x − 4)² = 8, so variance 8/3 (population) or 8/2 = 4 (unbiased).
    /// let m = Moments::<f64>::from_slice(&[2.0, 4.0, 6.0]);
    /// assert_eq!((m.n, m.mean, m.m2), (3, 4.0, 8.0));
    /// assert_eq!(m.std(Bessel::Unbiased), Some(2.0));
    /// assert_eq!(Moments::<f64>::from_slice(&[7.0]).variance(Bessel::Unbiased), None);
    /// ```
    pub fn from_slice(xs: &[T]) -> Self {
        Self::from_iter(xs.iter().copied())
    }

    /// Moments of the values of an iterator (Welford, in iteration order).
    #[allow(clippy::should_implement_trait)]
    pub fn from_iter(xs: impl IntoIterator<Item = T>) -> Self {
        let mut m = Self::new();
        for x in xs {
            m.push(x);
        }
        m
    }

    /// Chan's parallel merge: the moments of the union of both samples.
    #[must_use]
    pub fn merge(self, other: Self) -> Self {
        if other.n == 0 {
            return self;
        }
        if self.n == 0 {
            return other;
        }
        let n = self.n + other.n;
        let (na, nb, nn) = (
            T::from_usize(self.n),
            T::from_usize(other.n),
            T::from_usize(n),
        );
        let delta = other.mean - self.mean;
        Moments {
            n,
            mean: self.mean + delta * (nb / nn),
            m2: self.m2 + other.m2 + delta * delta * (na * (nb / nn)),
        }
    }

    /// Variance with the chosen divisor; `None` when undefined (`n == 0`, or `n == 1` unbiased).
    pub fn variance(&self, bessel: Bessel) -> Option<T> {
        let d = match bessel {
            Bessel::Unbiased => self.n.checked_sub(1)?,
            Bessel::Population => self.n,
        };
        if d == 0 {
            return None;
        }
        // M2 ≥ 0 mathematically; max guards the sign of rounding residue.
        Some((self.m2 / T::from_usize(d)).max(T::ZERO))
    }

    /// Standard deviation with the chosen divisor; `None` when undefined.
    pub fn std(&self, bessel: Bessel) -> Option<T> {
        self.variance(bessel).map(Real::sqrt)
    }
}

/// How tied values are ranked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TiePolicy {
    /// Tied values share the mean of the ranks they span (so an all-tied group gets the
    /// middle rank everywhere; `scipy.stats.rankdata(method="average")`).
    #[default]
    Average,
    /// Every value gets a distinct rank; among ties the earlier index gets the better (smaller)
    /// rank. Deterministic: a stable order replaces "whatever the sort did".
    Ordinal,
}

/// Sort direction of ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RankOrder {
    /// Rank 1 is the smallest value.
    #[default]
    Ascending,
    /// Rank 1 is the largest value (GOPO: rank 1 = best).
    Descending,
}

/// 1-based ranks of `values`, written to `out`, using `scratch` (one `usize` per value).
///
/// # Errors
/// [`Error::LengthMismatch`] for `out`, [`Error::ScratchTooSmall`], [`Error::NonFinite`] for a
/// NaN value (±∞ are ordered normally). Nothing is written on error.
///
/// # Example
/// ```
/// use grpo_core::stats::{ranks, RankOrder, TiePolicy};
/// let v = [0.5f64, 0.1, 0.5, 0.9];
/// let mut scratch = [0usize; 4];
/// let mut out = [0.0f64; 4];
/// ranks(&v, TiePolicy::Average, RankOrder::Ascending, &mut scratch, &mut out).unwrap();
/// assert_eq!(out, [2.5, 1.0, 2.5, 4.0]);
/// ranks(&v, TiePolicy::Ordinal, RankOrder::Descending, &mut scratch, &mut out).unwrap();
/// assert_eq!(out, [2.0, 4.0, 3.0, 1.0]);
/// ```
pub fn ranks<T: Real>(
    values: &[T],
    ties: TiePolicy,
    order: RankOrder,
    scratch: &mut [usize],
    out: &mut [T],
) -> Result<()> {
    crate::error::check_len("out", values.len(), out.len())?;
    if scratch.len() < values.len() {
        return Err(Error::ScratchTooSmall {
            needed: values.len(),
            found: scratch.len(),
        });
    }
    if let Some(index) = values.iter().position(|v| v.is_nan()) {
        return Err(Error::NonFinite {
            what: "values",
            index,
        });
    }
    let idx = &mut scratch[..values.len()];
    for (i, slot) in idx.iter_mut().enumerate() {
        *slot = i;
    }
    rank_indices(values, idx, ties, order, out);
    Ok(())
}

/// Ranks the subset `idx` of `values` among themselves: sorts `idx` and writes the 1-based rank
/// of `values[idx[j]]` to `out[idx[j]]`. Entries of `out` not in `idx` are untouched. This is the
/// mechanism behind [`ranks`] and the per-group rank estimators (whose members may be scattered).
///
/// Preconditions (checked by the public callers): every index is in bounds for both slices and
/// no selected value is NaN. Out-of-bounds indices would panic; NaN would give arbitrary ranks.
pub(crate) fn rank_indices<T: Real>(
    values: &[T],
    idx: &mut [usize],
    ties: TiePolicy,
    order: RankOrder,
    out: &mut [T],
) {
    // Key: value in the requested direction, then index ascending — a total order, so the
    // unstable sort (the only one in `core`) is deterministic.
    idx.sort_unstable_by(|&a, &b| {
        let (va, vb) = (values[a], values[b]);
        let by_value = match order {
            RankOrder::Ascending => va.partial_cmp(&vb),
            RankOrder::Descending => vb.partial_cmp(&va),
        };
        by_value
            .unwrap_or(core::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    match ties {
        TiePolicy::Ordinal => {
            for (r, &i) in idx.iter().enumerate() {
                out[i] = T::from_usize(r + 1);
            }
        }
        TiePolicy::Average => {
            let mut start = 0;
            while start < idx.len() {
                let v = values[idx[start]];
                let mut end = start + 1;
                while end < idx.len() && values[idx[end]] == v {
                    end += 1;
                }
                // Ranks start+1 ..= end share their mean (start + 1 + end) / 2.
                let shared = T::from_usize(start + 1 + end) * T::HALF;
                for &i in &idx[start..end] {
                    out[i] = shared;
                }
                start = end;
            }
        }
    }
}

/// The standard normal quantile Φ⁻¹(u) for u ∈ (0, 1).
///
/// Acklam's rational approximation (relative error ≤ 1.15e-9), refined by one Halley step
/// on `Φ(x) − u` with `Φ(x) = erfc(−x/√2)/2` computed by `libm`, in f64 whatever `T` is; the
/// result is within a few 1e-15 relative of the true quantile over (1e-300, 1 − 1e-16) — well
/// inside MATH.md's 1e-7 bound. Below about 1e-308 (subnormal `u`, where the Halley step's
/// `e^{x²/2}` overflows) it is Acklam's value alone: finite for every `u` down to the smallest
/// subnormal, within 2e-9 relative (1.8e-9 measured at 5e-324). `Φ⁻¹(0.5) == 0` exactly and `Φ⁻¹(1 − u) == −Φ⁻¹(u)` (the lower
/// half is computed from the upper one so the symmetry is exact).
///
/// # Errors
/// [`Error::InvalidParam`] unless `0 < u < 1`.
///
/// # Example
/// ```
/// use grpo_core::stats::norm_quantile;
/// let z = norm_quantile(0.975f64).unwrap();
/// assert!((z - 1.959963984540054).abs() < 1e-14);
/// assert_eq!(norm_quantile(0.5f32).unwrap(), 0.0);
/// assert!(norm_quantile(1.0f64).is_err());
/// ```
pub fn norm_quantile<T: Real>(u: T) -> Result<T> {
    let p = u.to_f64();
    if !(p > 0.0 && p < 1.0) {
        return Err(Error::InvalidParam {
            name: "u",
            reason: "the normal quantile needs 0 < u < 1",
        });
    }
    Ok(T::from_f64(norm_quantile_f64(p)))
}

/// Φ⁻¹ in f64 for p ∈ (0, 1) (see [`norm_quantile`]).
fn norm_quantile_f64(p: f64) -> f64 {
    if p == 0.5 {
        return 0.0;
    }
    if p > 0.5 {
        // Symmetry: Φ⁻¹(p) = −Φ⁻¹(1 − p). For p > 0.5, 1 − p is exact (Sterbenz), so the
        // upper half costs no accuracy and the two halves agree bit for bit.
        return -norm_quantile_f64(1.0 - p);
    }
    // Acklam (2003), coefficients of the central and tail rational functions.
    const A: [f64; 6] = [
        -3.969683028665376e+01,
        2.209460984245205e+02,
        -2.759285104469687e+02,
        1.383577518672690e+02,
        -3.066479806614716e+01,
        2.506628277459239e+00,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e+01,
        1.615858368580409e+02,
        -1.556989798598866e+02,
        6.680131188771972e+01,
        -1.328068155288572e+01,
    ];
    const C: [f64; 6] = [
        -7.784894002334708e-03,
        -3.223964580411365e-01,
        -2.400758277161838e+00,
        -2.549732539343734e+00,
        4.374664141464968e+00,
        2.938163982698783e+00,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-03,
        3.224671290700398e-01,
        2.445134137142996e+00,
        3.754408661907416e+00,
    ];
    const P_LOW: f64 = 0.02425;
    let x = if p < P_LOW {
        let q = libm::sqrt(-2.0 * libm::log(p));
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    };
    // One Halley step on f(x) = Φ(x) − p; f'(x) = φ(x), f''/f' = −x. Below p ≈ 1e-308
    // (|x| > 37.7) 1/φ(x) = √(2π)·e^{x²/2} overflows and the step would give NaN: there the
    // rational approximation stands alone (relative error ≤ 2e-9).
    let e = 0.5 * libm::erfc(-x / core::f64::consts::SQRT_2) - p;
    let u = e * libm::sqrt(2.0 * core::f64::consts::PI) * libm::exp(0.5 * x * x);
    let refined = x - u / (1.0 + 0.5 * x * u);
    if refined.is_finite() { refined } else { x }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn phi(x: f64) -> f64 {
        0.5 * libm::erfc(-x / core::f64::consts::SQRT_2)
    }

    #[test]
    fn welford_of_identical_non_dyadic_values_is_exact() {
        for &v in &[0.1f32, 1e4 + 0.3, -7.77, 1.0 / 3.0] {
            let xs = [v; 16];
            let m = Moments::from_slice(&xs);
            assert_eq!(m.mean, v);
            assert_eq!(m.m2, 0.0);
        }
        let m = Moments::<f64>::from_slice(&[0.1; 16]).merge(Moments::from_slice(&[0.1; 5]));
        assert_eq!((m.n, m.mean, m.m2), (21, 0.1, 0.0));
    }

    #[test]
    fn moments_of_known_data() {
        // 2,4,4,4,5,5,7,9: mean 5, Σ(x−5)² = 32, pop var 4, unbiased 32/7.
        let m = Moments::<f64>::from_slice(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(m.mean, 5.0);
        assert!((m.m2 - 32.0).abs() < 1e-12);
        assert_eq!(m.std(Bessel::Population), Some(2.0));
        assert!((m.variance(Bessel::Unbiased).unwrap() - 32.0 / 7.0).abs() < 1e-12);
        assert_eq!(
            Moments::<f64>::from_slice(&[3.0]).variance(Bessel::Unbiased),
            None
        );
        assert_eq!(
            Moments::<f64>::from_slice(&[3.0]).variance(Bessel::Population),
            Some(0.0)
        );
        assert_eq!(Moments::<f64>::new().variance(Bessel::Population), None);
    }

    #[test]
    fn ranks_average_and_ordinal() {
        let v = [3.0f64, 1.0, 3.0, 3.0, 2.0];
        let mut s = [0usize; 5];
        let mut out = [0.0; 5];
        ranks(
            &v,
            TiePolicy::Average,
            RankOrder::Ascending,
            &mut s,
            &mut out,
        )
        .unwrap();
        // sorted: 1.0 (r1), 2.0 (r2), 3.0×3 (r3,4,5 → 4).
        assert_eq!(out, [4.0, 1.0, 4.0, 4.0, 2.0]);
        ranks(
            &v,
            TiePolicy::Ordinal,
            RankOrder::Ascending,
            &mut s,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [3.0, 1.0, 4.0, 5.0, 2.0]);
        ranks(
            &v,
            TiePolicy::Ordinal,
            RankOrder::Descending,
            &mut s,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [1.0, 5.0, 2.0, 3.0, 4.0]);
        ranks(
            &v,
            TiePolicy::Average,
            RankOrder::Descending,
            &mut s,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [2.0, 5.0, 2.0, 2.0, 4.0]);
    }

    #[test]
    fn ranks_reject_bad_input_without_writing() {
        let mut out = [9.0f32; 3];
        let mut s = [0usize; 3];
        assert_eq!(
            ranks(
                &[1.0, f32::NAN, 2.0],
                TiePolicy::Average,
                RankOrder::Ascending,
                &mut s,
                &mut out
            ),
            Err(Error::NonFinite {
                what: "values",
                index: 1
            })
        );
        assert_eq!(out, [9.0; 3]);
        let mut small = [0usize; 2];
        assert!(matches!(
            ranks(
                &[1.0, 2.0, 3.0],
                TiePolicy::Average,
                RankOrder::Ascending,
                &mut small,
                &mut out
            ),
            Err(Error::ScratchTooSmall { .. })
        ));
        assert_eq!(out, [9.0; 3]);
    }

    #[test]
    fn norm_quantile_known_values() {
        // Tabulated quantiles (Abramowitz & Stegun 26.2; Wichura AS241 test values).
        let cases = [
            (0.975, 1.959963984540054),
            (0.995, 2.575829303548901),
            (0.9, 1.281551565544601),
            (0.25, -0.6744897501960817),
            (1e-10, -6.361340902404056),
        ];
        for (p, z) in cases {
            let got: f64 = norm_quantile(p).unwrap();
            assert!((got - z).abs() <= 1e-13 * z.abs(), "p={p}: {got} vs {z}");
        }
        assert_eq!(norm_quantile(0.5f64).unwrap(), 0.0);
        assert!(norm_quantile(0.0f64).is_err());
        assert!(norm_quantile(f64::NAN).is_err());
        assert!(norm_quantile(-0.1f32).is_err());
    }

    #[test]
    fn norm_quantile_is_finite_down_to_the_smallest_subnormal() {
        // Reference: Python's statistics.NormalDist().inv_cdf (Wichura's AS241, ~1e-16).
        // Found by fuzzing: u = 1.627e-314 gave NaN (the Halley step's e^{x²/2} overflowed).
        let cases = [
            (1e-300, -37.0470962993612, 1e-13),
            (1e-308, -37.54067492154595, 1e-13),
            (1e-310, -37.66306033194952, 1.15e-9),
            (1.62710194e-314, -37.89381208474939, 1.15e-9),
            (5e-324, -38.46740561714434, 2e-9),
        ];
        for (p, z, rel) in cases {
            let got: f64 = norm_quantile(p).unwrap();
            assert!((got - z).abs() <= rel * z.abs(), "p={p:e}: {got} vs {z}");
        }
    }

    #[test]
    fn norm_quantile_inverts_phi_and_is_odd() {
        let mut p = 1e-12f64;
        while p < 1.0 {
            let x = norm_quantile_f64(p);
            let back = phi(x);
            assert!(
                (back - p).abs() <= 1e-13 * p.min(1.0 - p).max(1e-3) + 1e-16,
                "p={p}"
            );
            if 1.0 - (1.0 - p) == p {
                // 1 − p is exact here, so the symmetry must hold bit for bit.
                assert_eq!(norm_quantile_f64(1.0 - p), -x, "p={p}");
            }
            p *= 1.7;
        }
    }
}
