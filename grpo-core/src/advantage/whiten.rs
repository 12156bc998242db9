//! Masked whitening over the valid tokens of a batch (MATH.md §2, §6): the normalisation shared by
//! REINFORCE++, REINFORCE++-baseline and GAE.
//!
//! `w = (v − μ) / sqrt(var + ε)` (verl) or `w = (v − μ) / sqrt(max(var, ε))` (OpenRLHF), with μ
//! and var taken over the valid tokens only. The statistics are [`Moments`], so data-parallel ranks
//! can whiten a global batch: each rank calls [`whiten_moments`] on its shard, the moments are
//! all-reduced with [`Moments::merge`], and each rank applies the merged moments with
//! [`apply_whitening`] (or [`apply_whitening_in_place`]). The token-level estimators of this module
//! family return the raw moments they whitened with, and accept `whiten: None` to leave the
//! values raw, so the same two-step protocol works for them.

use crate::error::{Error, Result, check_len, ensure};
use crate::layout::Tokens;
use crate::presets::Preset;
use crate::real::Real;
use crate::stats::{Bessel, Moments};

use super::Diagnostics;

/// Where the whitening ε enters the denominator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EpsPlacement {
    /// `1/sqrt(var + ε)` (verl `masked_whiten`). Default.
    #[default]
    Add,
    /// `1/sqrt(max(var, ε))` (OpenRLHF's global advantage whitening, `var.clamp(min=ε).rsqrt()`).
    Floor,
}

/// How to whiten: divisor of the variance, ε and its placement, and whether the mean stays
/// subtracted.
///
/// | preset | `bessel` | `eps` | `eps_placement` | `shift_mean` |
/// |---|---|---|---|---|
/// | `Paper` (= `Default`), `Verl`, `VerlVectorized`, `Trl` | `Unbiased` | 1e-8 | `Add` | `true` |
/// | `OpenRlhf` | `Population` | 1e-8 | `Floor` | `true` |
///
/// Sources: verl (b178a3cd) `masked_whiten` = `(v − masked_mean) · rsqrt(masked_var_unb + 1e-8)`;
/// OpenRLHF (3c3be62) `compute_advantages_and_returns`: population variance over all action
/// tokens, `rsqrt(max(var, 1e-8))`. TRL has no token whitening; its preset maps to verl's.
///
/// verl's `masked_mean` divides by `Σm + 1e-8`; that 1e-8 is absorbed by rounding in f32 for any
/// count ≥ 1 and is not reproduced (a defect, not a semantic). verl raises on a batch with one
/// valid token under the unbiased variance; we use variance 0 there (the single centered value is
/// exactly 0, so the result is 0, or μ with `shift_mean == false`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WhitenConfig<T> {
    /// Variance divisor (n − 1 or n).
    pub bessel: Bessel,
    /// ε of the denominator; must be finite and > 0 (so an all-equal batch gives exactly 0).
    pub eps: T,
    /// Whether ε is added to the variance or floors it.
    pub eps_placement: EpsPlacement,
    /// `true`: write `(v − μ)/σ`. `false`: write `(v − μ)/σ + μ` — verl's `shift_mean=False`,
    /// which rescales the spread but keeps the mean.
    pub shift_mean: bool,
}

impl<T: Real> Default for WhitenConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> WhitenConfig<T> {
    /// The configuration a peer uses (see the table in the type's docs).
    pub fn from_preset(preset: Preset) -> Self {
        match preset {
            Preset::OpenRlhf => WhitenConfig {
                bessel: Bessel::Population,
                eps: T::from_f64(1e-8),
                eps_placement: EpsPlacement::Floor,
                shift_mean: true,
            },
            _ => WhitenConfig {
                bessel: Bessel::Unbiased,
                eps: T::from_f64(1e-8),
                eps_placement: EpsPlacement::Add,
                shift_mean: true,
            },
        }
    }

    /// Checks `eps` (finite and > 0).
    ///
    /// # Errors
    /// [`Error::InvalidParam`] naming `eps`.
    pub fn validate(&self) -> Result<()> {
        ensure(
            self.eps.is_finite() && self.eps > T::ZERO,
            "eps",
            "must be finite and > 0",
        )
    }
}

/// What a whitened token-level estimator reports.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WhitenReport<T> {
    /// Moments of the raw (pre-whitening) values over the valid tokens that entered the
    /// statistics: the shard statistics to all-reduce for data-parallel whitening.
    pub raw_moments: Moments<T>,
    /// Counters and min/max/mean of the advantages written at valid tokens.
    pub diagnostics: Diagnostics<T>,
}

/// Running moments plus the extreme values seen, so the finiteness of every whitened output can
/// be decided before anything is written (whitening is monotone, so the extremes bound it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Acc<T> {
    pub(crate) moments: Moments<T>,
    pub(crate) lo: T,
    pub(crate) hi: T,
    /// Every pushed value was finite (a NaN can hide from `lo`/`hi` under the max/min NaN rule).
    pub(crate) finite: bool,
}

impl<T: Real> Acc<T> {
    pub(crate) fn new() -> Self {
        Acc {
            moments: Moments::new(),
            lo: T::INFINITY,
            hi: T::NEG_INFINITY,
            finite: true,
        }
    }

    #[inline]
    pub(crate) fn push(&mut self, x: T) {
        self.finite &= x.is_finite();
        self.moments.push(x);
        self.lo = self.lo.min(x);
        self.hi = self.hi.max(x);
    }

    /// Adds `count` copies of `x` at once (Chan merge of a zero-spread sample).
    #[inline]
    pub(crate) fn push_repeated(&mut self, x: T, count: usize) {
        if count == 0 {
            return;
        }
        self.finite &= x.is_finite();
        self.moments = self.moments.merge(Moments {
            n: count,
            mean: x,
            m2: T::ZERO,
        });
        self.lo = self.lo.min(x);
        self.hi = self.hi.max(x);
    }
}

/// The affine map of a whitening, built from validated moments.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Whitener<T> {
    mean: T,
    scale: T,
    shift_mean: bool,
}

const STATS_OVERFLOW: Error = Error::InvalidParam {
    name: "values",
    reason: "the mean or variance of the valid values is not finite (overflow)",
};

const OUTPUT_OVERFLOW: Error = Error::InvalidParam {
    name: "values",
    reason: "the result overflows the floating-point range",
};

impl<T: Real> Whitener<T> {
    /// `cfg` must have been validated.
    pub(crate) fn new(m: &Moments<T>, cfg: &WhitenConfig<T>) -> Result<Self> {
        if m.n == 0 {
            return Err(Error::NoValidTokens);
        }
        if !(m.mean.is_finite() && m.m2.is_finite() && m.m2 >= T::ZERO) {
            return Err(STATS_OVERFLOW);
        }
        // One valid token under Bessel: the variance is undefined; 0 makes the result exactly 0.
        let var = m.variance(cfg.bessel).unwrap_or(T::ZERO);
        let denom = match cfg.eps_placement {
            EpsPlacement::Add => var + cfg.eps,
            EpsPlacement::Floor => var.max(cfg.eps),
        };
        let scale = T::ONE / denom.sqrt();
        if !(scale.is_finite() && scale > T::ZERO) {
            return Err(STATS_OVERFLOW);
        }
        Ok(Whitener {
            mean: m.mean,
            scale,
            shift_mean: cfg.shift_mean,
        })
    }

    #[inline]
    pub(crate) fn apply(&self, x: T) -> T {
        let w = (x - self.mean) * self.scale;
        if self.shift_mean { w } else { w + self.mean }
    }

    /// Whether every value in `[lo, hi]` whitens to a finite number. The map is non-decreasing
    /// (also after rounding: each step is a correctly rounded monotone operation), so checking
    /// the two extremes suffices. An empty range (`lo > hi`) is fine.
    pub(crate) fn check_range(&self, lo: T, hi: T) -> Result<()> {
        if lo > hi || (self.apply(lo).is_finite() && self.apply(hi).is_finite()) {
            Ok(())
        } else {
            Err(OUTPUT_OVERFLOW)
        }
    }
}

/// Optional whitening of values summarised in `acc`: the map to apply (identity when `cfg` is
/// `None`) after checking that every output is finite.
pub(crate) fn prepare<T: Real>(
    acc: &Acc<T>,
    cfg: Option<&WhitenConfig<T>>,
) -> Result<Option<Whitener<T>>> {
    match cfg {
        None => Ok(None),
        Some(cfg) => {
            let w = Whitener::new(&acc.moments, cfg)?;
            w.check_range(acc.lo, acc.hi)?;
            Ok(Some(w))
        }
    }
}

/// Tracks min/max/sum of the advantages written at valid tokens, for [`Diagnostics`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Summary<T> {
    lo: T,
    hi: T,
    sum: T,
    n: usize,
}

impl<T: Real> Summary<T> {
    pub(crate) fn new() -> Self {
        Summary {
            lo: T::INFINITY,
            hi: T::NEG_INFINITY,
            sum: T::ZERO,
            n: 0,
        }
    }
    #[inline]
    pub(crate) fn push(&mut self, x: T) {
        self.lo = self.lo.min(x);
        self.hi = self.hi.max(x);
        self.sum += x;
        self.n += 1;
    }
    pub(crate) fn finish(&self, mut d: Diagnostics<T>) -> Diagnostics<T> {
        if self.n == 0 {
            d.min = T::ZERO;
            d.max = T::ZERO;
            d.mean = T::ZERO;
        } else {
            d.min = self.lo;
            d.max = self.hi;
            d.mean = self.sum / T::from_usize(self.n);
        }
        d
    }
}

/// Moments of `values` over the valid tokens of `tokens` (Welford in position order): one
/// shard's contribution to a data-parallel whitening. Masked positions are never read.
///
/// # Errors
/// Layout errors of [`Tokens::validate`] (`mask` length, offsets, `rows·cols`);
/// [`Error::NonFinite`] (`what: "values"`) for a NaN/±∞ at a valid position.
///
/// # Example
/// ```
/// use grpo_core::advantage::whiten::whiten_moments;
/// use grpo_core::layout::Tokens;
/// let v = [1.0f64, f64::NAN, 3.0, 5.0];
/// let mask = [true, false, true, true];
/// let m = whiten_moments(&v, &Tokens::padded(2, 2, Some(&mask))).unwrap();
/// // Valid values 1, 3, 5: mean 3, M2 = 4 + 0 + 4 = 8.
/// assert_eq!((m.n, m.mean, m.m2), (3, 3.0, 8.0));
/// ```
pub fn whiten_moments<T: Real>(values: &[T], tokens: &Tokens<'_>) -> Result<Moments<T>> {
    tokens.validate(values.len())?;
    if let Some(index) = tokens.first_non_finite(values) {
        return Err(Error::NonFinite {
            what: "values",
            index,
        });
    }
    let mut m = Moments::new();
    for (t, &v) in values.iter().enumerate() {
        if tokens.is_valid(t) {
            m.push(v);
        }
    }
    Ok(m)
}

fn check_apply<T: Real>(
    values: &[T],
    tokens: &Tokens<'_>,
    moments: &Moments<T>,
    cfg: &WhitenConfig<T>,
) -> Result<Whitener<T>> {
    cfg.validate()?;
    tokens.validate(values.len())?;
    if let Some(index) = tokens.first_non_finite(values) {
        return Err(Error::NonFinite {
            what: "values",
            index,
        });
    }
    let w = Whitener::new(moments, cfg)?;
    let (mut lo, mut hi) = (T::INFINITY, T::NEG_INFINITY);
    for (t, &v) in values.iter().enumerate() {
        if tokens.is_valid(t) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    w.check_range(lo, hi)?;
    Ok(w)
}

/// Whitens `values` with given (e.g. all-reduced) moments: at every valid token
/// `out = (v − μ)/sqrt(var + ε)` (or `max(var, ε)`, see [`WhitenConfig`]), plus μ again when
/// `shift_mean` is false; every masked position gets 0 (verl multiplies by the mask; masked
/// garbage is never read).
///
/// Source: \[verl\] `masked_whiten`, \[OpenRLHF\] global advantage whitening (MATH.md §2, §6).
///
/// # Errors
/// [`WhitenConfig::validate`]; layout errors; [`Error::LengthMismatch`] for `out`;
/// [`Error::NonFinite`] for a non-finite valid value; [`Error::NoValidTokens`] if
/// `moments.n == 0`; [`Error::InvalidParam`] (`values`) if the moments are not finite or a
/// result would overflow. On error `out` is untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::whiten::{apply_whitening, whiten_moments, WhitenConfig};
/// use grpo_core::layout::Tokens;
/// use grpo_core::Preset;
/// // Two data-parallel shards; the merged moments whiten each shard as one batch would.
/// let (a, b) = ([1.0f64, 2.0], [3.0f64, 4.0, 5.0]);
/// let (ta, tb) = (Tokens::padded(1, 2, None), Tokens::padded(1, 3, None));
/// let global = whiten_moments(&a, &ta).unwrap().merge(whiten_moments(&b, &tb).unwrap());
/// // Population variance of 1..5 is 2 (OpenRLHF preset), so out = (v − 3)/sqrt(2).
/// let cfg = WhitenConfig::from_preset(Preset::OpenRlhf);
/// let mut out = [0.0; 3];
/// apply_whitening(&b, &tb, &global, &cfg, &mut out).unwrap();
/// let s = 2f64.sqrt();
/// assert!((out[0] - 0.0).abs() < 1e-12 && (out[2] - 2.0 / s).abs() < 1e-7);
/// ```
pub fn apply_whitening<T: Real>(
    values: &[T],
    tokens: &Tokens<'_>,
    moments: &Moments<T>,
    cfg: &WhitenConfig<T>,
    out: &mut [T],
) -> Result<()> {
    check_len("out", values.len(), out.len())?;
    let w = check_apply(values, tokens, moments, cfg)?;
    for (t, (o, &v)) in out.iter_mut().zip(values).enumerate() {
        *o = if tokens.is_valid(t) {
            w.apply(v)
        } else {
            T::ZERO
        };
    }
    Ok(())
}

/// [`apply_whitening`] in place: `values` is overwritten with its whitened form (masked
/// positions become 0). On error `values` is untouched.
///
/// # Errors
/// As [`apply_whitening`].
///
/// # Example
/// ```
/// use grpo_core::advantage::whiten::{apply_whitening_in_place, whiten_moments, WhitenConfig};
/// use grpo_core::layout::Tokens;
/// let mut v = [1.0f64, 3.0, f64::NAN];
/// let mask = [true, true, false];
/// let tokens = Tokens::packed(&[0, 3], Some(&mask));
/// let m = whiten_moments(&v, &tokens).unwrap();
/// // mean 2, unbiased var 2, out = (v − 2)/sqrt(2 + 1e-8).
/// apply_whitening_in_place(&mut v, &tokens, &m, &WhitenConfig::default()).unwrap();
/// let d = (2.0f64 + 1e-8).sqrt();
/// assert_eq!(v, [-1.0 / d, 1.0 / d, 0.0]);
/// ```
pub fn apply_whitening_in_place<T: Real>(
    values: &mut [T],
    tokens: &Tokens<'_>,
    moments: &Moments<T>,
    cfg: &WhitenConfig<T>,
) -> Result<()> {
    let w = check_apply(values, tokens, moments, cfg)?;
    for (t, v) in values.iter_mut().enumerate() {
        *v = if tokens.is_valid(t) {
            w.apply(*v)
        } else {
            T::ZERO
        };
    }
    Ok(())
}

/// Whitens `values` over the valid tokens of one batch ([`whiten_moments`] then
/// [`apply_whitening`]) and returns the moments used.
///
/// Formula: `out_t = (v_t − μ)/sqrt(var + ε)` \[verl\] or `/sqrt(max(var, ε))` \[OpenRLHF\] at valid
/// tokens, 0 at masked ones; μ and var over valid tokens only (see [`WhitenConfig`]).
///
/// # Errors
/// As [`whiten_moments`] and [`apply_whitening`]; [`Error::NoValidTokens`] if no token is
/// valid. On error `out` is untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::whiten::{whiten, WhitenConfig};
/// use grpo_core::layout::Tokens;
/// // Padded 2×3 with garbage in the masked slots.
/// let v = [1.0f64, 2.0, f64::NAN, 3.0, f64::INFINITY, f64::NAN];
/// let mask = [true, true, false, true, false, false];
/// let mut out = [9.0; 6];
/// let m = whiten(&v, &Tokens::padded(2, 3, Some(&mask)), &WhitenConfig::default(), &mut out).unwrap();
/// // Valid 1, 2, 3: mean 2, unbiased var 1, so out = (v − 2)/sqrt(1 + 1e-8).
/// let d = (1.0f64 + 1e-8).sqrt();
/// assert_eq!(m.n, 3);
/// assert_eq!(out, [-1.0 / d, 0.0, 0.0, 1.0 / d, 0.0, 0.0]);
/// ```
pub fn whiten<T: Real>(
    values: &[T],
    tokens: &Tokens<'_>,
    cfg: &WhitenConfig<T>,
    out: &mut [T],
) -> Result<Moments<T>> {
    cfg.validate()?;
    check_len("out", values.len(), out.len())?;
    let m = whiten_moments(values, tokens)?;
    apply_whitening(values, tokens, &m, cfg, out)?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_table() {
        for p in [
            Preset::Paper,
            Preset::Verl,
            Preset::VerlVectorized,
            Preset::Trl,
        ] {
            let c = WhitenConfig::<f64>::from_preset(p);
            assert_eq!(
                (c.bessel, c.eps, c.eps_placement, c.shift_mean),
                (Bessel::Unbiased, 1e-8, EpsPlacement::Add, true)
            );
        }
        let c = WhitenConfig::<f32>::from_preset(Preset::OpenRlhf);
        assert_eq!(
            (c.bessel, c.eps, c.eps_placement, c.shift_mean),
            (Bessel::Population, 1e-8f32, EpsPlacement::Floor, true)
        );
        assert_eq!(
            WhitenConfig::<f64>::default(),
            WhitenConfig::from_preset(Preset::Verl)
        );
    }

    #[test]
    fn verl_preset_hand_computed() {
        // Valid 1, 2, 4, 5: mean 3, M2 = 4+1+1+4 = 10, var_unb = 10/3.
        let v = [1.0f64, 2.0, 4.0, 5.0];
        let mut out = [0.0; 4];
        let m = whiten(
            &v,
            &Tokens::padded(1, 4, None),
            &WhitenConfig::from_preset(Preset::Verl),
            &mut out,
        )
        .unwrap();
        assert_eq!((m.n, m.mean), (4, 3.0));
        let s = (10.0f64 / 3.0 + 1e-8).sqrt();
        for (o, x) in out.iter().zip([-2.0, -1.0, 1.0, 2.0]) {
            assert!((o - x / s).abs() < 1e-15, "{o} vs {}", x / s);
        }
    }

    #[test]
    fn openrlhf_preset_hand_computed() {
        // Same values: var_pop = 10/4 = 2.5; max(2.5, 1e-8) = 2.5.
        let v = [1.0f64, 2.0, 4.0, 5.0];
        let mut out = [0.0; 4];
        whiten(
            &v,
            &Tokens::padded(1, 4, None),
            &WhitenConfig::from_preset(Preset::OpenRlhf),
            &mut out,
        )
        .unwrap();
        let s = 2.5f64.sqrt();
        for (o, x) in out.iter().zip([-2.0, -1.0, 1.0, 2.0]) {
            assert!((o - x / s).abs() < 1e-15);
        }
        // Tiny spread: values 0 and 2e-5: var_pop = 1e-10 < 1e-8, so the floor gives
        // (v − 1e-5)/1e-4 = ±0.1, while verl's add gives ±1e-5/sqrt(1e-10·2 + 1e-8).
        let v = [0.0f64, 2e-5];
        whiten(
            &v,
            &Tokens::padded(1, 2, None),
            &WhitenConfig::from_preset(Preset::OpenRlhf),
            &mut out[..2],
        )
        .unwrap();
        assert!((out[0] + 0.1).abs() < 1e-12 && (out[1] - 0.1).abs() < 1e-12);
        whiten(
            &v,
            &Tokens::padded(1, 2, None),
            &WhitenConfig::from_preset(Preset::Verl),
            &mut out[..2],
        )
        .unwrap();
        let d = (2e-10f64 + 1e-8).sqrt();
        assert!((out[1] - 1e-5 / d).abs() < 1e-12);
    }

    #[test]
    fn shift_mean_false_keeps_the_mean() {
        // 2, 4: mean 3, var_unb 2; out = (v − 3)/sqrt(2 + 1e-8) + 3.
        let v = [2.0f64, 4.0];
        let cfg = WhitenConfig {
            shift_mean: false,
            ..WhitenConfig::default()
        };
        let mut out = [0.0; 2];
        whiten(&v, &Tokens::padded(1, 2, None), &cfg, &mut out).unwrap();
        let d = (2.0f64 + 1e-8).sqrt();
        assert_eq!(out, [-1.0 / d + 3.0, 1.0 / d + 3.0]);
    }

    #[test]
    fn all_equal_and_single_token_give_zero() {
        let v = [0.1f32; 5];
        let mut out = [9.0f32; 5];
        whiten(
            &v,
            &Tokens::padded(1, 5, None),
            &WhitenConfig::default(),
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [0.0; 5]);
        let mask = [false, true, false];
        let mut out = [9.0f64; 3];
        whiten(
            &[f64::NAN, 7.0, 1.0],
            &Tokens::padded(1, 3, Some(&mask)),
            &WhitenConfig::default(),
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [0.0; 3]);
    }

    #[test]
    fn errors_leave_out_untouched() {
        let cfg = WhitenConfig::<f64>::default();
        let mut out = [7.0f64; 3];
        let t = Tokens::padded(1, 3, None);
        assert!(matches!(
            whiten(&[1.0, 2.0], &t, &cfg, &mut out),
            Err(Error::LengthMismatch { .. })
        ));
        assert_eq!(
            whiten(&[1.0, f64::NAN, 2.0], &t, &cfg, &mut out),
            Err(Error::NonFinite {
                what: "values",
                index: 1
            })
        );
        let none = [false; 3];
        assert_eq!(
            whiten(
                &[1.0, 2.0, 3.0],
                &Tokens::padded(1, 3, Some(&none)),
                &cfg,
                &mut out
            ),
            Err(Error::NoValidTokens)
        );
        let short = [true; 2];
        assert!(matches!(
            whiten(
                &[1.0, 2.0, 3.0],
                &Tokens::padded(1, 3, Some(&short)),
                &cfg,
                &mut out
            ),
            Err(Error::LengthMismatch { what: "mask", .. })
        ));
        let bad = WhitenConfig { eps: 0.0, ..cfg };
        assert!(matches!(
            whiten(&[1.0, 2.0, 3.0], &t, &bad, &mut out),
            Err(Error::InvalidParam { name: "eps", .. })
        ));
        // Overflowing statistics.
        assert!(matches!(
            whiten(&[1e300, -1e300, 1e300], &t, &cfg, &mut out),
            Err(Error::InvalidParam { name: "values", .. })
        ));
        assert_eq!(out, [7.0; 3]);
    }

    #[test]
    fn applying_moments_refuses_bad_inputs_and_leaves_values_untouched() {
        let cfg = WhitenConfig::<f64>::default();
        let t = Tokens::padded(1, 3, None);
        let v = [1.0, 2.0, 3.0];
        let good = whiten_moments(&v, &t).unwrap();
        let empty = Moments {
            n: 0,
            mean: 0.0,
            m2: 0.0,
        };
        let nan = Moments {
            mean: f64::NAN,
            ..good
        };
        // (values, moments, configuration, length of `out`, the error)
        type Case<'a> = (&'a [f64], Moments<f64>, WhitenConfig<f64>, usize, Error);
        let cases: [Case<'_>; 5] = [
            (&v, empty, cfg, 3, Error::NoValidTokens),
            (
                &v,
                nan,
                cfg,
                3,
                Error::InvalidParam {
                    name: "values",
                    reason: "",
                },
            ),
            (
                &[1.0, f64::INFINITY, 3.0],
                good,
                cfg,
                3,
                Error::NonFinite {
                    what: "values",
                    index: 1,
                },
            ),
            (
                &v,
                good,
                WhitenConfig { eps: -1.0, ..cfg },
                3,
                Error::InvalidParam {
                    name: "eps",
                    reason: "",
                },
            ),
            (
                &v,
                good,
                cfg,
                2,
                Error::LengthMismatch {
                    what: "out",
                    expected: 3,
                    found: 2,
                },
            ),
        ];
        // Errors compare by kind and name (the reasons are prose).
        let same = |a: &Error, b: &Error| match (a, b) {
            (Error::InvalidParam { name: x, .. }, Error::InvalidParam { name: y, .. }) => x == y,
            _ => a == b,
        };
        for (k, (vals, m, c, n_out, want)) in cases.into_iter().enumerate() {
            let mut out = [7.0; 3];
            let got = apply_whitening(vals, &t, &m, &c, &mut out[..n_out]).unwrap_err();
            assert!(same(&got, &want), "case {k}: {got:?}");
            assert_eq!(out, [7.0; 3], "case {k}");
            if n_out == 3 {
                let mut inplace = [vals[0], vals[1], vals[2]];
                let got = apply_whitening_in_place(&mut inplace, &t, &m, &c).unwrap_err();
                assert!(same(&got, &want), "in place, case {k}: {got:?}");
                assert_eq!(
                    inplace.map(f64::to_bits),
                    [vals[0], vals[1], vals[2]].map(f64::to_bits),
                    "in place, case {k}"
                );
            }
        }
        // whiten_moments: a NaN at a valid position, a mask of the wrong length.
        assert_eq!(
            whiten_moments(&[1.0, f64::NAN, 3.0], &t),
            Err(Error::NonFinite {
                what: "values",
                index: 1
            })
        );
        let short = [true; 2];
        assert!(whiten_moments(&v, &Tokens::padded(1, 3, Some(&short))).is_err());
    }
}
