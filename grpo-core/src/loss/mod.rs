//! Per-token policy losses with exact gradients (MATH.md §3 unified clipped objective, §4).
//!
//! Every loss reads per-token arrays laid out by a [`Tokens`] view — `lp` = log π_θ, `old` =
//! log π_old, `adv` = the advantage of each token (sequence advantages broadcast by the caller) —
//! validates them, and writes, for every position `t`,
//! - `value[t]` = the per-token loss `L_t`, and
//! - `grad[t]` = `∂L_t/∂lp_t` (computed analytically with the named method's stop-gradients),
//!
//! and returns [`LossDiagnostics`]. Invalid positions (outside the mask) may hold any garbage,
//! NaN included: they are never read into a result and get value 0 and gradient 0.
//!
//! **Aggregation is separate** ([`crate::aggregate`]): it turns `value` into a scalar and gives
//! the per-token weight `w_t` with `loss = Σ_t w_t L_t`, so the gradient of the scalar is
//! `w_t · grad[t]` ([`crate::aggregate::scale_gradients`]).
//!
//! **Sequence-level losses** (GSPO, GMPO; [`LossLevel::Sequence`]) write their sequence loss
//! `L_i` on every valid token of sequence `i` and `grad[t] = ∂L_i/∂lp_t`; the aggregated gradient
//! of token `t` is then `(Σ_{s∈i} w_s) · grad[t]`, which `scale_gradients` applies when told the
//! level.
//!
//! **Log-ratio clamp.** Before any `exp` of a log-ratio the library clamps it to `[−c, c]`
//! (default `c = 20`, verl and OpenRLHF); `None` reproduces TRL (no clamp). A clamped log-ratio is
//! a constant: its token gets no gradient through the ratio (PyTorch's `clamp` has zero gradient
//! outside its range). Products with the advantage treat `0 · ∞` as 0, so `A = 0` never yields
//! NaN even when the ratio overflows. If, without a clamp, the ratio overflows where the loss uses
//! it unclipped, the loss value itself is ±∞: the operation then returns
//! [`Error::NonFinite`] (`what = "loss value"`) and writes nothing — `Ok` results are always finite.
//!
//! **Validation.** Lengths, layout, parameters, and finiteness of every *valid* input (and of
//! `lp − old`, which can overflow for |values| near the type's maximum) are checked before any
//! output is written; on `Err` the outputs are untouched. Because a loss value can still overflow
//! (no clamp), every loss evaluates its kernel twice: once to check finiteness and gather the
//! diagnostics, once to write — the reference favours the guarantee over speed.

use crate::error::{Error, Result, check_len};
use crate::layout::Tokens;
use crate::real::Real;
use crate::vocab::canon::CanonicalSum;

mod cov;
mod pg;
mod ppo;
mod seq;

pub use cov::{ClipCovConfig, KlCovConfig, SplitMix64, clip_cov, kl_cov, kl_cov_scratch_len};
pub use pg::{
    CispoConfig, CispoWeight, EssStats, P3oConfig, SapoConfig, cispo, entropy_bonus, ess_stats,
    p3o, reinforce, sapo,
};
pub use ppo::{PpoClipConfig, ppo_clip};
pub use seq::{GmpoConfig, GspoConfig, GspoTokenConfig, gmpo, gspo, gspo_token};

/// Default log-ratio clamp `c` (verl, OpenRLHF): log-ratios are clamped to `[−20, 20]` before
/// `exp`.
pub const DEFAULT_LOG_RATIO_CLAMP: f64 = 20.0;

/// The per-token inputs every ratio-based loss reads.
///
/// All slices have the same length `n` (the token arrays of the layout).
#[derive(Debug, Clone, Copy)]
pub struct PolicyInputs<'a, T> {
    /// log π_θ(token), the differentiable input.
    pub lp: &'a [T],
    /// log π_old(token) (detached).
    pub old: &'a [T],
    /// Per-token advantage (detached; broadcast the sequence advantage for outcome rewards).
    pub adv: &'a [T],
    /// Sequence boundaries and validity mask.
    pub tokens: Tokens<'a>,
}

/// Whether a loss is a sum of independent per-token terms or one term per sequence broadcast to
/// the sequence's tokens (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossLevel {
    /// `L_t` depends on token `t` only: the aggregated gradient of token `t` is `w_t · grad[t]`.
    #[default]
    Token,
    /// `L_t = L_i` for every valid token of sequence `i`, and `grad[t] = ∂L_i/∂lp_t`: the
    /// aggregated gradient of token `t` is `(Σ_{s∈i} w_s) · grad[t]`.
    Sequence,
}

/// What a loss reports besides values and gradients. Counts are over valid tokens; all fields
/// are sums, counts, minima or maxima, so diagnostics of several ranks or micro-batches combine
/// exactly with [`LossDiagnostics::merge`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossDiagnostics<T> {
    /// Token-level or sequence-level loss (how to scale its gradients).
    pub level: LossLevel,
    /// Number of valid tokens.
    pub tokens: usize,
    /// Tokens whose gradient the *lower* bound cut (A < 0 and ratio below `lo`). For losses
    /// whose clip only reweights (CISPO), tokens whose weight was raised to the lower bound.
    pub clipped_low: usize,
    /// Tokens whose gradient the *upper* bound cut (A > 0 and ratio above `hi`). For CISPO,
    /// tokens whose weight was truncated.
    pub clipped_high: usize,
    /// Tokens where the dual-clip bound `−c·A` was the loss (A < 0).
    pub dual_clipped: usize,
    /// Tokens where the δ cap (TRL `delta`) replaced the ratio of the unclipped branch.
    pub delta_capped: usize,
    /// Tokens whose log-ratio was clamped before `exp` (they get no gradient through the ratio).
    pub clamped: usize,
    /// Tokens selected by clip-cov / kl-cov.
    pub selected: usize,
    /// Σ (old − lp) over valid tokens after the log-ratio clamp (verl's `ppo_kl` numerator),
    /// summed in the canonical order over positions ([`CanonicalSum`]: blocks of 2048
    /// positions, 16 strided lanes, a fixed pairwise tree, blocks merged pairwise), so every
    /// backend that splits the batch reproduces it bit for bit. [`merge`](Self::merge) adds two
    /// batches' sums.
    pub kl_sum: T,
    /// Smallest ratio used (token ratio, or sequence ratio for sequence-level losses); `+∞`
    /// when no ratio was computed (the identity of `min`, so merging works).
    pub ratio_min: T,
    /// Largest ratio used; `−∞` when none was computed.
    pub ratio_max: T,
}

impl<T: Real> LossDiagnostics<T> {
    /// Diagnostics of an empty batch (the identity of [`LossDiagnostics::merge`]).
    pub fn empty(level: LossLevel) -> Self {
        LossDiagnostics {
            level,
            tokens: 0,
            clipped_low: 0,
            clipped_high: 0,
            dual_clipped: 0,
            delta_capped: 0,
            clamped: 0,
            selected: 0,
            kl_sum: T::ZERO,
            ratio_min: T::INFINITY,
            ratio_max: T::NEG_INFINITY,
        }
    }

    /// Combines the diagnostics of two disjoint batches (ranks, micro-batches).
    pub fn merge(self, o: Self) -> Self {
        LossDiagnostics {
            level: self.level,
            tokens: self.tokens + o.tokens,
            clipped_low: self.clipped_low + o.clipped_low,
            clipped_high: self.clipped_high + o.clipped_high,
            dual_clipped: self.dual_clipped + o.dual_clipped,
            delta_capped: self.delta_capped + o.delta_capped,
            clamped: self.clamped + o.clamped,
            selected: self.selected + o.selected,
            kl_sum: self.kl_sum + o.kl_sum,
            ratio_min: self.ratio_min.min(o.ratio_min),
            ratio_max: self.ratio_max.max(o.ratio_max),
        }
    }

    fn frac(&self, count: usize) -> T {
        if self.tokens == 0 {
            T::ZERO
        } else {
            T::from_usize(count) / T::from_usize(self.tokens)
        }
    }

    /// Fraction of valid tokens cut by the lower bound (0 with no token).
    pub fn clip_frac_low(&self) -> T {
        self.frac(self.clipped_low)
    }

    /// Fraction of valid tokens cut by the upper bound (0 with no token).
    pub fn clip_frac_high(&self) -> T {
        self.frac(self.clipped_high)
    }

    /// Fraction of valid tokens cut by either bound (verl's `pg_clipfrac`).
    pub fn clip_frac(&self) -> T {
        self.frac(self.clipped_low + self.clipped_high)
    }

    /// Mean of `old − lp` over valid tokens (k1 estimate of KL(old‖θ); verl's `ppo_kl`);
    /// 0 with no token.
    pub fn approx_kl(&self) -> T {
        if self.tokens == 0 {
            T::ZERO
        } else {
            self.kl_sum / T::from_usize(self.tokens)
        }
    }

    fn push_ratio(&mut self, r: T) {
        self.ratio_min = self.ratio_min.min(r);
        self.ratio_max = self.ratio_max.max(r);
    }
}

/// One token's result from a loss kernel: value, gradient and what happened.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TokenOut<T> {
    pub value: T,
    pub grad: T,
    pub ratio: T,
    /// Log-ratio after the clamp (for `kl_sum`).
    pub log_ratio: T,
    pub clamped: bool,
    pub clip_low: bool,
    pub clip_high: bool,
    pub dual: bool,
    pub capped: bool,
    pub selected: bool,
    /// The loss computes no ratio (REINFORCE, entropy): `ratio` is not recorded.
    pub no_ratio: bool,
}

/// `a · b` with `0 · ±∞ = 0` (an advantage of 0 times an overflowing ratio contributes nothing).
#[inline]
pub(crate) fn mul0<T: Real>(a: T, b: T) -> T {
    if a == T::ZERO || b == T::ZERO {
        T::ZERO
    } else {
        a * b
    }
}

// One validation rule for every optional clamp in the crate (finite and > 0).
pub(crate) use crate::divergence::measures::check_clamp;

/// The dual-clip constant's rule, shared by [`ppo_clip`] and [`gspo`]: finite and `> 1` (at
/// `c ≤ 1` the bound `−c·A` would cut into the clipped objective itself).
pub(crate) fn check_dual_clip<T: Real>(c: Option<T>) -> Result<()> {
    match c {
        Some(c) => crate::error::ensure(
            c > T::ONE && c.is_finite(),
            "dual_clip",
            "must be finite and > 1",
        ),
        None => Ok(()),
    }
}

/// Clamps a log-ratio to `[−c, c]`; returns it and whether it was outside (then constant).
#[inline]
pub(crate) fn clamp_log_ratio<T: Real>(x: T, c: Option<T>) -> (T, bool) {
    match c {
        Some(c) if x > c => (c, true),
        Some(c) if x < -c => (-c, true),
        _ => (x, false),
    }
}

/// Validates lengths, layout and finiteness of the valid inputs; returns the sequence count.
pub(crate) fn validate_inputs<T: Real>(
    inp: &PolicyInputs<'_, T>,
    value_len: usize,
    grad_len: usize,
) -> Result<usize> {
    let n = inp.lp.len();
    let seqs = inp.tokens.validate(n)?;
    check_len("old", n, inp.old.len())?;
    check_len("adv", n, inp.adv.len())?;
    check_len("value", n, value_len)?;
    check_len("grad", n, grad_len)?;
    for_each_valid(&inp.tokens, |t| {
        if !inp.lp[t].is_finite() {
            return Err(Error::NonFinite {
                what: "lp",
                index: t,
            });
        }
        if !inp.old[t].is_finite() {
            return Err(Error::NonFinite {
                what: "old",
                index: t,
            });
        }
        if !inp.adv[t].is_finite() {
            return Err(Error::NonFinite {
                what: "adv",
                index: t,
            });
        }
        if !(inp.lp[t] - inp.old[t]).is_finite() {
            return Err(Error::NonFinite {
                what: "lp - old",
                index: t,
            });
        }
        Ok(())
    })?;
    Ok(seqs)
}

/// Checks an optional per-token slice (`what`) for length and finiteness of valid positions.
pub(crate) fn validate_aux<T: Real>(
    tokens: &Tokens<'_>,
    what: &'static str,
    n: usize,
    v: &[T],
) -> Result<()> {
    check_len(what, n, v.len())?;
    for_each_valid(tokens, |t| {
        if v[t].is_finite() {
            Ok(())
        } else {
            Err(Error::NonFinite { what, index: t })
        }
    })
}

/// Calls `f` on every valid position, in sequence order (valid layout), stopping at the first
/// error.
pub(crate) fn for_each_valid(
    tokens: &Tokens<'_>,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<()> {
    for i in 0..tokens.num_sequences() {
        for t in tokens.valid_positions(i) {
            f(t)?;
        }
    }
    Ok(())
}

/// The two-pass driver of every loss: pass 1 runs the kernel on every valid token, checks that
/// value and gradient are finite and gathers diagnostics; pass 2 (only if pass 1 succeeded)
/// zeroes the outputs and writes the kernel results. `make` builds a fresh kernel per pass, so
/// kernels with sequential state (random selection) see the same state twice. The kernel gets the
/// sequence index and the position.
pub(crate) fn drive<T: Real, K: FnMut(usize, usize) -> TokenOut<T>>(
    tokens: &Tokens<'_>,
    level: LossLevel,
    value: &mut [T],
    grad: &mut [T],
    make: impl Fn() -> K,
) -> Result<LossDiagnostics<T>> {
    let mut d = LossDiagnostics::empty(level);
    let mut kl = CanonicalSum::new(value.len());
    let mut kernel = make();
    for i in 0..tokens.num_sequences() {
        for t in tokens.valid_positions(i) {
            let o = kernel(i, t);
            if !o.value.is_finite() {
                return Err(Error::NonFinite {
                    what: "loss value",
                    index: t,
                });
            }
            if !o.grad.is_finite() {
                return Err(Error::NonFinite {
                    what: "loss gradient",
                    index: t,
                });
            }
            d.tokens += 1;
            d.clipped_low += o.clip_low as usize;
            d.clipped_high += o.clip_high as usize;
            d.dual_clipped += o.dual as usize;
            d.delta_capped += o.capped as usize;
            d.clamped += o.clamped as usize;
            d.selected += o.selected as usize;
            kl.push(t, -o.log_ratio);
            if !o.no_ratio {
                d.push_ratio(o.ratio);
            }
        }
    }
    d.kl_sum = kl.finish();
    value.fill(T::ZERO);
    grad.fill(T::ZERO);
    let mut kernel = make();
    for i in 0..tokens.num_sequences() {
        for t in tokens.valid_positions(i) {
            let o = kernel(i, t);
            value[t] = o.value;
            grad[t] = o.grad;
        }
    }
    Ok(d)
}

/// Sum over the valid tokens of sequence `i` of `f(t)`, and their count.
#[inline]
pub(crate) fn seq_sum<T: Real>(
    tokens: &Tokens<'_>,
    i: usize,
    f: impl Fn(usize) -> T,
) -> (T, usize) {
    let mut s = T::ZERO;
    let mut n = 0usize;
    for t in tokens.valid_positions(i) {
        s += f(t);
        n += 1;
    }
    (s, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mul0_kills_inf_times_zero() {
        assert_eq!(mul0(0.0f64, f64::INFINITY), 0.0);
        assert_eq!(mul0(f64::INFINITY, 0.0), 0.0);
        assert_eq!(mul0(2.0f64, 3.0), 6.0);
    }

    #[test]
    fn clamp_is_inclusive_at_the_bound() {
        assert_eq!(clamp_log_ratio(20.0f64, Some(20.0)), (20.0, false));
        assert_eq!(clamp_log_ratio(20.5f64, Some(20.0)), (20.0, true));
        assert_eq!(clamp_log_ratio(-25.0f64, Some(20.0)), (-20.0, true));
        assert_eq!(clamp_log_ratio(1000.0f64, None), (1000.0, false));
    }

    #[test]
    fn diagnostics_merge_and_fractions() {
        let mut a = LossDiagnostics::<f64>::empty(LossLevel::Token);
        assert_eq!(a.clip_frac(), 0.0);
        assert_eq!(a.approx_kl(), 0.0);
        a.tokens = 4;
        a.clipped_low = 1;
        a.kl_sum = 0.4;
        a.push_ratio(0.5);
        let mut b = LossDiagnostics::<f64>::empty(LossLevel::Token);
        b.tokens = 4;
        b.clipped_high = 2;
        b.push_ratio(2.0);
        let m = a.merge(b);
        // 3 clipped of 8 tokens; kl 0.4 / 8 = 0.05.
        assert_eq!(m.clip_frac(), 3.0 / 8.0);
        assert_eq!(m.clip_frac_low(), 1.0 / 8.0);
        assert_eq!(m.clip_frac_high(), 2.0 / 8.0);
        assert!((m.approx_kl() - 0.05).abs() < 1e-15);
        assert_eq!((m.ratio_min, m.ratio_max), (0.5, 2.0));
    }
}
