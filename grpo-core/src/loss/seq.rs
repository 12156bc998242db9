//! Sequence-ratio losses: GSPO (sequence and token form) and GMPO.

use super::{
    LossDiagnostics, LossLevel, PolicyInputs, TokenOut, check_clamp, check_dual_clip,
    clamp_log_ratio, drive, mul0, ppo::ppo_core, seq_sum, validate_inputs,
};
use crate::divergence::RatioBounds;
use crate::error::{Result, ensure};
use crate::presets::Preset;
use crate::real::Real;

/// Configuration of [`gspo`] (GSPO 2507.18071, sequence-level ratio).
///
/// | field | Paper | Trl | OpenRlhf | Verl |
/// |---|---|---|---|---|
/// | `bounds` | `[1 − 3e-4, 1 + 4e-4]` | same (TRL's recommended GSPO ε) | same | same |
/// | `dual_clip` | `None` | `None` | `None` (`--dual_clip`, optional there) | `None` |
/// | `delta_cap` | `None` | `None` | `None` | `None` |
/// | `log_ratio_clamp` | `Some(20)` | `None` | `None` | `Some(20)` |
///
/// verl's GSPO is the token form ([`gspo_token`]); its preset here keeps our defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GspoConfig<T> {
    /// Clip interval of the sequence ratio `s_i`.
    pub bounds: RatioBounds<T>,
    /// Dual-clip constant `c > 1` applied to the sequence ratio's term: for `A < 0` the term is
    /// at most `−c·A` \[OpenRLHF: its `PolicyLoss` applies `--dual_clip` after the sequence
    /// ratio of `gspo` as after the token ratio of `ppo`\].
    pub dual_clip: Option<T>,
    /// TRL's `delta` applied to the sequence ratio of the unclipped branch (`δ > 1`).
    pub delta_cap: Option<T>,
    /// Clamp `c` of the *mean* log-ratio before `exp` (`None` = TRL/OpenRLHF).
    pub log_ratio_clamp: Option<T>,
}

fn gspo_bounds<T: Real>() -> RatioBounds<T> {
    RatioBounds {
        lo: T::ONE - T::from_f64(3e-4),
        hi: T::ONE + T::from_f64(4e-4),
    }
}

impl<T: Real> Default for GspoConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> GspoConfig<T> {
    /// The preset's configuration (see the table on [`GspoConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        let clamp = match preset {
            Preset::Trl | Preset::OpenRlhf => None,
            _ => Some(T::from_f64(super::DEFAULT_LOG_RATIO_CLAMP)),
        };
        GspoConfig {
            bounds: gspo_bounds(),
            dual_clip: None,
            delta_cap: None,
            log_ratio_clamp: clamp,
        }
    }

    fn validate(&self) -> Result<()> {
        RatioBounds::new(self.bounds.lo, self.bounds.hi)?;
        check_dual_clip(self.dual_clip)?;
        if let Some(d) = self.delta_cap {
            ensure(d > T::ONE, "delta_cap", "must be > 1")?;
        }
        check_clamp(self.log_ratio_clamp, "log_ratio_clamp")
    }
}

/// GSPO, sequence form [2507.18071; TRL `importance_sampling_level="sequence"`, OpenRLHF `gspo`]:
///
/// ```text
/// x̄_i = (1/n_i) Σ_{t∈i} (lp_t − old_t)      (masked mean; clamp to [−c, c] optional)
/// s_i = exp(x̄_i)
/// ℓ(A) = −min(min(s_i, δ)·A, clip(s_i, lo, hi)·A)
///         then min(ℓ(A), −c_d·A) for A < 0     (dual-clip, optional)
/// L_i = (1/n_i) Σ_{t∈i} ℓ(A_t)                (= ℓ(A_i) when the tokens share A_i)
/// ```
///
/// With one advantage per sequence broadcast over its tokens (the paper, TRL, GRPO-style
/// advantages) `L_i = ℓ(A_i)`, computed as such. With per-token advantages (OpenRLHF's
/// token-level returns) each token's term takes the min with its own `A_t` and `L_i` is their
/// mean, as OpenRLHF's `PolicyLoss` does (`−min(s·A_t, clip(s)·A_t)` per token, averaged over
/// the sequence); taking the min once with the mean advantage instead would, for advantages
/// of both signs, lose every term where the two branches differ.
///
/// The gradient flows through the mean: `∂L_i/∂lp_t = (1/n_i) Σ_{t'} (∂ℓ(A_{t'})/∂s_i)·s_i/n_i`,
/// each term zero where its branch is clipped (the unified rule applied to `s_i` and `A_{t'}`),
/// all zero when the mean log-ratio is clamped. [`LossLevel::Sequence`]: `L_i` and
/// `∂L_i/∂lp_t` are written on every valid token of sequence `i`. A sequence with no valid
/// token has nothing to write and is skipped. Clip counts in the diagnostics count the tokens
/// whose own term is clipped; the ratio range is over `s_i`.
///
/// # Errors
/// As [`ppo_clip`](super::ppo_clip).
///
/// # Example
/// ```
/// use grpo_core::loss::{GspoConfig, LossLevel, PolicyInputs, gspo};
/// use grpo_core::Tokens;
/// // One sequence of 2 tokens, x = (0.0002, 0.0), mean 0.0001 → s = e^0.0001 inside the clip:
/// // L = −s·A = −e^0.0001 with A = 1, ∂L/∂lp_t = −A·s/2.
/// let lp = [0.0002, 0.0];
/// let old = [0.0, 0.0];
/// let adv = [1.0, 1.0];
/// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::padded(1, 2, None) };
/// let (mut v, mut g) = ([0.0; 2], [0.0; 2]);
/// let d = gspo(&GspoConfig::default(), &inp, &mut v, &mut g).unwrap();
/// let s = 0.0001f64.exp();
/// assert_eq!(d.level, LossLevel::Sequence);
/// assert!((v[0] + s).abs() < 1e-15 && (v[1] + s).abs() < 1e-15);
/// assert!((g[0] + s / 2.0).abs() < 1e-15);
/// ```
pub fn gspo<T: Real>(
    cfg: &GspoConfig<T>,
    inp: &PolicyInputs<'_, T>,
    value: &mut [T],
    grad: &mut [T],
) -> Result<LossDiagnostics<T>> {
    cfg.validate()?;
    validate_inputs(inp, value.len(), grad.len())?;
    let c = *cfg;
    let tokens = inp.tokens;
    drive(&tokens, LossLevel::Sequence, value, grad, || {
        // Per-sequence (s, ∂s/∂x̄, clamped, L_i, ∂L_i/∂lp_t, shared advantage), recomputed when
        // the sequence index changes.
        let mut cur: Option<(usize, GspoSeq<T>)> = None;
        move |i, t| {
            let q = match cur {
                Some((j, q)) if j == i => q,
                _ => {
                    let q = gspo_sequence(&c, inp, i);
                    cur = Some((i, q));
                    q
                }
            };
            // The token's own term decides its clip flags (all the sequence's when shared).
            let a = q.shared.unwrap_or(inp.adv[t]);
            let mut out = ppo_core(
                q.s,
                q.ds,
                a,
                c.bounds.lo,
                c.bounds.hi,
                c.dual_clip,
                c.delta_cap,
            );
            out.value = q.value;
            out.grad = q.grad;
            out.clamped = q.clamped;
            out.log_ratio = inp.lp[t] - inp.old[t];
            out
        }
    })
}

/// One GSPO sequence: its ratio and the loss and per-token gradient written on its tokens.
#[derive(Clone, Copy)]
struct GspoSeq<T> {
    s: T,
    ds: T,
    clamped: bool,
    value: T,
    grad: T,
    /// The advantage every valid token shares, if they do.
    shared: Option<T>,
}

/// [`gspo`]'s per-sequence work (the formula on [`gspo`]).
fn gspo_sequence<T: Real>(c: &GspoConfig<T>, inp: &PolicyInputs<'_, T>, i: usize) -> GspoSeq<T> {
    let tokens = inp.tokens;
    let (sx, n) = seq_sum(&tokens, i, |t| inp.lp[t] - inp.old[t]);
    let nt = T::from_usize(n);
    let (x, clamped) = clamp_log_ratio(sx / nt, c.log_ratio_clamp);
    let s = x.exp();
    let ds = if clamped { T::ZERO } else { s };
    let term = |a: T| ppo_core(s, ds, a, c.bounds.lo, c.bounds.hi, c.dual_clip, c.delta_cap);
    let mut valid = tokens.valid_positions(i);
    let first = valid.next().map(|t| inp.adv[t]);
    let shared = first.filter(|&a0| valid.all(|t| inp.adv[t] == a0));
    // ℓ(A_i) itself when the advantage is shared (the mean of equal terms), else the mean of
    // the per-token terms; either way ∂L_i/∂lp_t = (∂L_i/∂x̄)/n.
    let (value, dx) = match shared {
        Some(a) => {
            let o = term(a);
            (o.value, o.grad)
        }
        None => {
            // One evaluation of each token's term, both sums in token order.
            let (mut sv, mut sg) = (T::ZERO, T::ZERO);
            for t in tokens.valid_positions(i) {
                let o = term(inp.adv[t]);
                sv += o.value;
                sg += o.grad;
            }
            (sv / nt, sg / nt)
        }
    };
    GspoSeq {
        s,
        ds,
        clamped,
        value,
        grad: dx / nt,
        shared,
    }
}

/// Configuration of [`gspo_token`] (verl `gspo`).
///
/// | field | Paper / Verl / others |
/// |---|---|
/// | `bounds` | `[1 − 3e-4, 1 + 4e-4]` (verl takes `clip_ratio_low/high`; the GSPO paper's values) |
/// | `seq_log_ratio_max` | `Some(10)` (verl) |
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GspoTokenConfig<T> {
    /// Token-level clip interval of `r_t`.
    pub bounds: RatioBounds<T>,
    /// Upper clamp of the combined log-ratio `log r_t` (verl: 10). No lower clamp: a very
    /// negative mean only makes `r_t` tiny.
    pub seq_log_ratio_max: Option<T>,
}

impl<T: Real> Default for GspoTokenConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> GspoTokenConfig<T> {
    /// The preset's configuration (identical for every preset; see the table).
    pub fn from_preset(_preset: Preset) -> Self {
        GspoTokenConfig {
            bounds: gspo_bounds(),
            seq_log_ratio_max: Some(T::from_f64(10.0)),
        }
    }
}

/// GSPO-token [2507.18071; verl `gspo`]: every token carries the sequence ratio's value but its
/// own gradient path,
///
/// ```text
/// log r_t = lp_t − sg(lp_t) + sg(x̄_i),  clamped to ≤ 10;   r_t = exp(log r_t)
/// L_t = −min(r_t·A_t, clip(r_t, lo, hi)·A_t)
/// ∂r_t/∂lp_t = r_t  (0 when x̄_i > 10)
/// ```
///
/// A token-level loss ([`LossLevel::Token`]). verl aggregates it with `seq-mean-token-mean`
/// ([`AggMode::SeqMeanTokenMean`](crate::aggregate::AggMode::SeqMeanTokenMean)).
///
/// # Errors
/// Bounds not containing 1, `seq_log_ratio_max ≤ 0`; otherwise as [`ppo_clip`](super::ppo_clip).
///
/// # Example
/// ```
/// use grpo_core::loss::{GspoTokenConfig, PolicyInputs, gspo_token};
/// use grpo_core::Tokens;
/// // Mean log-ratio 12 > 10: r = e^10 for both tokens, constant; A = −1 (ratio above hi,
/// // unclipped branch wins): L = e^10, gradient 0 because of the clamp.
/// let lp = [24.0, 0.0];
/// let old = [0.0, 0.0];
/// let adv = [-1.0, -1.0];
/// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::padded(1, 2, None) };
/// let (mut v, mut g) = ([0.0; 2], [0.0; 2]);
/// let d = gspo_token(&GspoTokenConfig::default(), &inp, &mut v, &mut g).unwrap();
/// assert!((v[0] - 10f64.exp()).abs() < 1e-9 && g == [0.0, 0.0]);
/// assert_eq!(d.clamped, 2);
/// ```
pub fn gspo_token<T: Real>(
    cfg: &GspoTokenConfig<T>,
    inp: &PolicyInputs<'_, T>,
    value: &mut [T],
    grad: &mut [T],
) -> Result<LossDiagnostics<T>> {
    RatioBounds::new(cfg.bounds.lo, cfg.bounds.hi)?;
    check_clamp(cfg.seq_log_ratio_max, "seq_log_ratio_max")?;
    validate_inputs(inp, value.len(), grad.len())?;
    let c = *cfg;
    let tokens = inp.tokens;
    drive(&tokens, LossLevel::Token, value, grad, || {
        let mut cur: Option<(usize, T)> = None;
        move |i, t| {
            let xbar = match cur {
                Some((j, m)) if j == i => m,
                _ => {
                    let (sx, n) = seq_sum(&tokens, i, |t| inp.lp[t] - inp.old[t]);
                    let m = sx / T::from_usize(n);
                    cur = Some((i, m));
                    m
                }
            };
            let (lr, clamped) = match c.seq_log_ratio_max {
                Some(m) if xbar > m => (m, true),
                _ => (xbar, false),
            };
            let r = lr.exp();
            let dr = if clamped { T::ZERO } else { r };
            let mut o = ppo_core(r, dr, inp.adv[t], c.bounds.lo, c.bounds.hi, None, None);
            o.clamped = clamped;
            o.log_ratio = inp.lp[t] - inp.old[t];
            o
        }
    })
}

/// Configuration of [`gmpo`] (GMPO 2507.20673, verl `geo_mean`).
///
/// | field | Paper | Verl | others |
/// |---|---|---|---|
/// | `eps_low`, `eps_high` (log space) | 0.4, 0.4 | 0.4, 0.4 (the GMPO recipe) | 0.4, 0.4 |
/// | `log_ratio_clamp` (of the mean) | `Some(20)` | `None` (no clamp in verl) | `Some(20)` |
/// | `mean_eps` | 0 | 1e-8 (`Σm + 1e-8` denominators) | 0 |
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GmpoConfig<T> {
    /// Lower clip of the token log-ratio: `x ≥ −eps_low` (> 0).
    pub eps_low: T,
    /// Upper clip of the token log-ratio: `x ≤ eps_high` (> 0).
    pub eps_high: T,
    /// Clamp `c` of the sequence mean of clipped log-ratios before `exp`.
    pub log_ratio_clamp: Option<T>,
    /// ε added to the token count in both sequence means (verl 1e-8), ≥ 0.
    pub mean_eps: T,
}

impl<T: Real> Default for GmpoConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> GmpoConfig<T> {
    /// The preset's configuration (see the table on [`GmpoConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        let verl = matches!(preset, Preset::Verl | Preset::VerlVectorized);
        GmpoConfig {
            eps_low: T::from_f64(0.4),
            eps_high: T::from_f64(0.4),
            log_ratio_clamp: if verl {
                None
            } else {
                Some(T::from_f64(super::DEFAULT_LOG_RATIO_CLAMP))
            },
            mean_eps: if verl { T::from_f64(1e-8) } else { T::ZERO },
        }
    }

    fn validate(&self) -> Result<()> {
        ensure(
            self.eps_low > T::ZERO && self.eps_low.is_finite(),
            "eps_low",
            "must be finite and > 0",
        )?;
        ensure(
            self.eps_high > T::ZERO && self.eps_high.is_finite(),
            "eps_high",
            "must be finite and > 0",
        )?;
        ensure(
            self.mean_eps >= T::ZERO && self.mean_eps.is_finite(),
            "mean_eps",
            "must be finite and >= 0",
        )?;
        check_clamp(self.log_ratio_clamp, "log_ratio_clamp")
    }
}

/// The GMPO token transform: `x' = sgn(A)·min(sgn(A)·x, sgn(A)·clip(x, −ε_lo, ε_hi))` and its
/// derivative; returns `(x', dx'/dx, clip_low, clip_high)`.
#[inline]
fn gmpo_token<T: Real>(x: T, a: T, lo: T, hi: T) -> (T, T, bool, bool) {
    if a > T::ZERO {
        // min(x, clip(x)): x above ε_hi is replaced by ε_hi (no gradient).
        if x > hi {
            (hi, T::ZERO, false, true)
        } else {
            (x, T::ONE, false, false)
        }
    } else if a < T::ZERO {
        // max(x, clip(x)): x below −ε_lo is replaced by −ε_lo.
        if x < -lo {
            (-lo, T::ZERO, true, false)
        } else {
            (x, T::ONE, false, false)
        }
    } else {
        (T::ZERO, T::ZERO, false, false)
    }
}

/// GMPO, geometric-mean policy optimization [2507.20673; verl `geo_mean`]:
///
/// ```text
/// x'_t = sgn(A_t)·min(sgn(A_t)·x_t, sgn(A_t)·clip(x_t, −ε_lo, ε_hi))   (x_t = lp_t − old_t)
/// r_i  = exp( Σ_t x'_t / (n_i + ε) ),   Ā_i = Σ_t A_t / (n_i + ε)
/// L_i  = −Ā_i·r_i,     ∂L_i/∂lp_t = −Ā_i·r_i·(∂x'_t/∂x_t)/(n_i + ε)
/// ```
///
/// (`ε = mean_eps`; the optional clamp of the mean before `exp` makes its gradient 0.) A token
/// with `A_t = 0` contributes `x' = 0` and no gradient. [`LossLevel::Sequence`]; verl averages
/// `L_i` over every row, an empty one counting as 0 (`torch.mean(pg_losses)` in `geo_mean`):
/// `AggConfig { mode: SeqMeanTokenMean, denominator: ClampOne, sequences: SeqCount::All }`
/// gives exactly that for a sequence-level loss; the Verl aggregation preset, which counts the
/// non-empty sequences as verl's `agg_loss` does, differs when a row is empty (see
/// [`crate::aggregate`]). `clipped_high`/`clipped_low` count tokens whose
/// log-ratio the transform replaced (A > 0 above ε_hi / A < 0 below −ε_lo); the ratio range is
/// over `r_i`.
///
/// # Errors
/// `eps_low`/`eps_high` not finite and > 0, `mean_eps < 0`, clamp ≤ 0; otherwise as
/// [`ppo_clip`](super::ppo_clip).
///
/// # Example
/// ```
/// use grpo_core::loss::{GmpoConfig, PolicyInputs, gmpo};
/// use grpo_core::Tokens;
/// // A = 1, x = (1.0, 0.2): x' = (0.4, 0.2), r = e^{0.3}, L = −e^{0.3};
/// // only token 1 has gradient: −e^{0.3}/2.
/// let lp = [1.0, 0.2];
/// let old = [0.0, 0.0];
/// let adv = [1.0, 1.0];
/// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::padded(1, 2, None) };
/// let (mut v, mut g) = ([0.0; 2], [0.0; 2]);
/// let d = gmpo(&GmpoConfig::default(), &inp, &mut v, &mut g).unwrap();
/// let r = 0.3f64.exp();
/// assert!((v[0] + r).abs() < 1e-12 && g[0] == 0.0 && (g[1] + r / 2.0).abs() < 1e-12);
/// assert_eq!(d.clipped_high, 1);
/// ```
pub fn gmpo<T: Real>(
    cfg: &GmpoConfig<T>,
    inp: &PolicyInputs<'_, T>,
    value: &mut [T],
    grad: &mut [T],
) -> Result<LossDiagnostics<T>> {
    cfg.validate()?;
    validate_inputs(inp, value.len(), grad.len())?;
    let c = *cfg;
    let tokens = inp.tokens;
    drive(&tokens, LossLevel::Sequence, value, grad, || {
        // (sequence, value L_i, −Ā_i·r_i/(n+ε) (gradient factor), r_i, clamped)
        let mut cur: Option<(usize, T, T, T, bool)> = None;
        move |i, t| {
            let (v, gf, r, clamped) = match cur {
                Some((j, v, gf, r, cl)) if j == i => (v, gf, r, cl),
                _ => {
                    let (sx, n) = seq_sum(&tokens, i, |t| {
                        gmpo_token(inp.lp[t] - inp.old[t], inp.adv[t], c.eps_low, c.eps_high).0
                    });
                    let (sa, _) = seq_sum(&tokens, i, |t| inp.adv[t]);
                    let den = T::from_usize(n) + c.mean_eps;
                    let (m, clamped) = clamp_log_ratio(sx / den, c.log_ratio_clamp);
                    let r = m.exp();
                    let abar = sa / den;
                    let v = -mul0(abar, r);
                    let gf = if clamped {
                        T::ZERO
                    } else {
                        -mul0(abar, r) / den
                    };
                    cur = Some((i, v, gf, r, clamped));
                    (v, gf, r, clamped)
                }
            };
            let x = inp.lp[t] - inp.old[t];
            let (_, dx, lo, hi) = gmpo_token(x, inp.adv[t], c.eps_low, c.eps_high);
            TokenOut {
                value: v,
                grad: mul0(gf, dx),
                ratio: r,
                log_ratio: x,
                clamped,
                clip_low: lo,
                clip_high: hi,
                ..TokenOut::default()
            }
        }
    })
}
