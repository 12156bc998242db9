//! Policy-gradient losses with detached weights (CISPO, REINFORCE/GPG/RGRA, P3O), SAPO's soft
//! gate, and the entropy bonus.

use super::{
    LossDiagnostics, LossLevel, PolicyInputs, TokenOut, check_clamp, clamp_log_ratio, drive,
    for_each_valid, mul0, validate_aux, validate_inputs,
};
use crate::divergence::RatioBounds;
use crate::divergence::measures::expm1_minus_x;
use crate::error::{Error, Result, check_len, ensure};
use crate::layout::Tokens;
use crate::presets::Preset;
use crate::real::Real;

/// How CISPO truncates its detached importance weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CispoWeight<T> {
    /// verl: `w = clamp(ρ, lo, hi)` with `lo = 1 − ε_low`, `hi = 1 + ε_high`.
    Clamp(RatioBounds<T>),
    /// TRL: `w = min(ρ, ε_max)` — `ε_max` is an *absolute* cap (TRL passes `epsilon_high`,
    /// falling back to `epsilon`), not `1 + ε`.
    Cap(T),
}

/// Configuration of [`cispo`] (CISPO, MiniMax-M1 2506.13585).
///
/// | field | Paper / Verl / OpenRlhf | Trl |
/// |---|---|---|
/// | `weight` | `Clamp([0.8, 1.2])` | `Cap(0.2)`: TRL's `epsilon_high` unset falls back to `epsilon = 0.2`, used as an absolute cap — set it explicitly ([`CispoConfig::trl`]) |
/// | `log_ratio_clamp` | `Some(20)` | `None` |
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CispoConfig<T> {
    /// The weight truncation.
    pub weight: CispoWeight<T>,
    /// Log-ratio clamp `c` before `exp` (`None` = TRL).
    pub log_ratio_clamp: Option<T>,
}

impl<T: Real> Default for CispoConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> CispoConfig<T> {
    /// The preset's configuration (see the table on [`CispoConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        match preset {
            Preset::Trl => Self::trl(T::from_f64(0.2), None),
            _ => CispoConfig {
                weight: CispoWeight::Clamp(RatioBounds {
                    lo: T::from_f64(0.8),
                    hi: T::from_f64(1.2),
                }),
                log_ratio_clamp: Some(T::from_f64(super::DEFAULT_LOG_RATIO_CLAMP)),
            },
        }
    }

    /// TRL's semantics: cap `epsilon_high`, or `epsilon` when it is unset; no log-ratio clamp.
    pub fn trl(epsilon: T, epsilon_high: Option<T>) -> Self {
        CispoConfig {
            weight: CispoWeight::Cap(epsilon_high.unwrap_or(epsilon)),
            log_ratio_clamp: None,
        }
    }

    fn validate(&self) -> Result<()> {
        match self.weight {
            CispoWeight::Clamp(b) => {
                RatioBounds::new(b.lo, b.hi)?;
            }
            CispoWeight::Cap(c) => ensure(
                c > T::ZERO && c.is_finite(),
                "eps_max",
                "must be finite and > 0",
            )?,
        }
        check_clamp(self.log_ratio_clamp, "log_ratio_clamp")
    }
}

/// CISPO [2506.13585; verl `cispo`, TRL `cispo`]: REINFORCE with a truncated, detached IS weight,
///
/// ```text
/// ρ = exp(clamp(lp − old, −c, c));  w = clamp(ρ, lo, hi) (verl) or min(ρ, ε_max) (TRL)
/// L = −sg(w)·A·lp,   ∂L/∂lp = −w·A
/// ```
///
/// Every token keeps a gradient (truncation only reweights). `clipped_high` counts tokens whose
/// weight was truncated from above, `clipped_low` those raised to `lo`.
///
/// # Errors
/// Bounds not containing 1, `ε_max` not finite and > 0, clamp ≤ 0; otherwise as
/// [`ppo_clip`](super::ppo_clip).
///
/// # Example
/// ```
/// use grpo_core::loss::{CispoConfig, PolicyInputs, cispo};
/// use grpo_core::Tokens;
/// // ρ = 2, A = 1, lp = ln 2: verl clamps w to 1.2 → L = −1.2·ln 2, ∂L/∂lp = −1.2;
/// // TRL with ε_high = 0.28 caps *absolutely*: w = min(2, 0.28) = 0.28 → ∂L/∂lp = −0.28.
/// let lp = [2f64.ln()];
/// let old = [0.0];
/// let adv = [1.0];
/// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::padded(1, 1, None) };
/// let (mut v, mut g) = ([0.0], [0.0]);
/// cispo(&CispoConfig::default(), &inp, &mut v, &mut g).unwrap();
/// assert!((v[0] + 1.2 * 2f64.ln()).abs() < 1e-12 && (g[0] + 1.2).abs() < 1e-12);
/// cispo(&CispoConfig::trl(0.2, Some(0.28)), &inp, &mut v, &mut g).unwrap();
/// assert!((g[0] + 0.28).abs() < 1e-12);
/// ```
pub fn cispo<T: Real>(
    cfg: &CispoConfig<T>,
    inp: &PolicyInputs<'_, T>,
    value: &mut [T],
    grad: &mut [T],
) -> Result<LossDiagnostics<T>> {
    cfg.validate()?;
    validate_inputs(inp, value.len(), grad.len())?;
    let c = *cfg;
    drive(&inp.tokens, LossLevel::Token, value, grad, || {
        move |_i, t| {
            let (x, clamped) = clamp_log_ratio(inp.lp[t] - inp.old[t], c.log_ratio_clamp);
            let rho = x.exp();
            let (w, low, high) = match c.weight {
                CispoWeight::Clamp(b) => {
                    if rho < b.lo {
                        (b.lo, true, false)
                    } else if rho > b.hi {
                        (b.hi, false, true)
                    } else {
                        (rho, false, false)
                    }
                }
                CispoWeight::Cap(m) => {
                    if rho > m {
                        (m, false, true)
                    } else {
                        (rho, false, false)
                    }
                }
            };
            let wa = mul0(w, inp.adv[t]);
            TokenOut {
                value: -mul0(wa, inp.lp[t]),
                grad: -wa,
                ratio: rho,
                log_ratio: x,
                clamped,
                clip_low: low,
                clip_high: high,
                ..TokenOut::default()
            }
        }
    })
}

/// Configuration of [`sapo`] (SAPO 2511.20347).
///
/// | field | every preset (TRL, paper) |
/// |---|---|
/// | `tau_pos` | 1.0 |
/// | `tau_neg` | 1.05 |
/// | `log_ratio_clamp` | `Some(20)`; `Trl`: `None` |
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SapoConfig<T> {
    /// Temperature for `A > 0` (> 0).
    pub tau_pos: T,
    /// Temperature for `A ≤ 0` (> 0).
    pub tau_neg: T,
    /// Log-ratio clamp `c` before `exp` (`None` = TRL).
    pub log_ratio_clamp: Option<T>,
}

impl<T: Real> Default for SapoConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> SapoConfig<T> {
    /// The preset's configuration (see the table on [`SapoConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        SapoConfig {
            tau_pos: T::ONE,
            tau_neg: T::from_f64(1.05),
            log_ratio_clamp: match preset {
                Preset::Trl => None,
                _ => Some(T::from_f64(super::DEFAULT_LOG_RATIO_CLAMP)),
            },
        }
    }
}

/// `σ(z)·(1 − σ(z))` without cancellation or overflow: `e^{−|z|}/(1 + e^{−|z|})²`.
#[inline]
fn sigmoid_slope<T: Real>(z: T) -> T {
    let e = (-z.abs()).exp();
    let d = T::ONE + e;
    e / (d * d)
}

/// SAPO, soft adaptive policy optimization [2511.20347; TRL `sapo`]: a smooth gate replaces the
/// hard clip,
///
/// ```text
/// τ = τ_pos if A > 0 else τ_neg;   ρ = exp(clamp(lp − old, −c, c))
/// L = −σ(τ(ρ − 1))·(4/τ)·A
/// ∂L/∂lp = −4·A·σ(τ(ρ−1))·(1 − σ(τ(ρ−1)))·ρ      (0 if clamped)
/// ```
///
/// At `ρ = 1` the gradient is `−A`, as for the unclipped objective. `σ(1−σ)` is evaluated as
/// `e^{−|z|}/(1+e^{−|z|})²`, so a huge ratio gives gradient 0, never NaN.
///
/// # Errors
/// `tau_pos`/`tau_neg` not finite and > 0, clamp ≤ 0; otherwise as [`ppo_clip`](super::ppo_clip).
///
/// # Example
/// ```
/// use grpo_core::loss::{PolicyInputs, SapoConfig, sapo};
/// use grpo_core::Tokens;
/// // ρ = 1: σ(0) = 1/2 → L = −(1/2)·4·A = −2 for A = 1; ∂L/∂lp = −4·(1/4)·1 = −1.
/// let lp = [0.0];
/// let old = [0.0];
/// let adv = [1.0];
/// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::padded(1, 1, None) };
/// let (mut v, mut g) = ([0.0], [0.0]);
/// sapo(&SapoConfig::default(), &inp, &mut v, &mut g).unwrap();
/// assert_eq!((v[0], g[0]), (-2.0, -1.0));
/// ```
pub fn sapo<T: Real>(
    cfg: &SapoConfig<T>,
    inp: &PolicyInputs<'_, T>,
    value: &mut [T],
    grad: &mut [T],
) -> Result<LossDiagnostics<T>> {
    ensure(
        cfg.tau_pos > T::ZERO && cfg.tau_pos.is_finite(),
        "tau_pos",
        "must be finite and > 0",
    )?;
    ensure(
        cfg.tau_neg > T::ZERO && cfg.tau_neg.is_finite(),
        "tau_neg",
        "must be finite and > 0",
    )?;
    check_clamp(cfg.log_ratio_clamp, "log_ratio_clamp")?;
    validate_inputs(inp, value.len(), grad.len())?;
    let c = *cfg;
    drive(&inp.tokens, LossLevel::Token, value, grad, || {
        move |_i, t| {
            let a = inp.adv[t];
            let (x, clamped) = clamp_log_ratio(inp.lp[t] - inp.old[t], c.log_ratio_clamp);
            let rho = x.exp();
            let tau = if a > T::ZERO { c.tau_pos } else { c.tau_neg };
            let z = tau * (rho - T::ONE);
            let s = z.sigmoid();
            let four = T::from_f64(4.0);
            let value = -mul0(s * four / tau, a);
            let grad = if clamped {
                T::ZERO
            } else {
                -mul0(four * a, mul0(sigmoid_slope(z), rho))
            };
            TokenOut {
                value,
                grad,
                ratio: rho,
                log_ratio: x,
                clamped,
                ..TokenOut::default()
            }
        }
    })
}

/// REINFORCE / GPG (2504.02546) / RGRA: the plain policy gradient, optionally reweighted by a
/// detached per-token importance weight (e.g. a truncated rollout-correction weight computed by
/// the caller),
///
/// ```text
/// L = −sg(w)·A·lp,   ∂L/∂lp = −w·A          (w = 1 without weights)
/// ```
///
/// No ratio, so no clamp and no ratio diagnostics. Weights must be finite at valid positions.
///
/// # Errors
/// Length/layout mismatches; non-finite `lp`, `adv` or `weights` at a valid position.
///
/// # Example
/// ```
/// use grpo_core::loss::reinforce;
/// use grpo_core::Tokens;
/// // L = −A·lp = −2·(−0.5) = 1, gradient −A = −2; the masked position gets 0.
/// let lp = [-0.5, f64::NAN];
/// let adv = [2.0, 2.0];
/// let mask = [true, false];
/// let (mut v, mut g) = ([9.0; 2], [9.0; 2]);
/// reinforce(&lp, &adv, None, Tokens::padded(1, 2, Some(&mask)), &mut v, &mut g).unwrap();
/// assert_eq!((v, g), ([1.0, 0.0], [-2.0, 0.0]));
/// ```
pub fn reinforce<T: Real>(
    lp: &[T],
    adv: &[T],
    weights: Option<&[T]>,
    tokens: Tokens<'_>,
    value: &mut [T],
    grad: &mut [T],
) -> Result<LossDiagnostics<T>> {
    let n = lp.len();
    tokens.validate(n)?;
    validate_aux(&tokens, "lp", n, lp)?;
    validate_aux(&tokens, "adv", n, adv)?;
    if let Some(w) = weights {
        validate_aux(&tokens, "weights", n, w)?;
    }
    check_len("value", n, value.len())?;
    check_len("grad", n, grad.len())?;
    drive(&tokens, LossLevel::Token, value, grad, || {
        move |_i, t| {
            let w = weights.map_or(T::ONE, |w| w[t]);
            let wa = mul0(w, adv[t]);
            TokenOut {
                value: -mul0(wa, lp[t]),
                grad: -wa,
                no_ratio: true,
                ..TokenOut::default()
            }
        }
    })
}

/// The entropy bonus `L_t = −c·H_t` (H per token, e.g. from the vocabulary kernels). Writes the
/// value and `∂L_t/∂H_t = −c` (the gradient with respect to the entropy input; chain it through
/// the entropy's backward).
///
/// # Errors
/// `coef` not finite; length/layout mismatches; a non-finite entropy at a valid position.
///
/// # Example
/// ```
/// use grpo_core::loss::entropy_bonus;
/// use grpo_core::Tokens;
/// let h = [2.0f32, 0.5];
/// let (mut v, mut g) = ([0.0f32; 2], [0.0f32; 2]);
/// entropy_bonus(0.01, &h, Tokens::padded(1, 2, None), &mut v, &mut g).unwrap();
/// assert_eq!(v, [-0.02, -0.005]);
/// assert_eq!(g, [-0.01, -0.01]);
/// ```
pub fn entropy_bonus<T: Real>(
    coef: T,
    entropy: &[T],
    tokens: Tokens<'_>,
    value: &mut [T],
    grad_entropy: &mut [T],
) -> Result<LossDiagnostics<T>> {
    ensure(coef.is_finite(), "coef", "must be finite")?;
    let n = entropy.len();
    tokens.validate(n)?;
    validate_aux(&tokens, "entropy", n, entropy)?;
    check_len("value", n, value.len())?;
    check_len("grad", n, grad_entropy.len())?;
    drive(&tokens, LossLevel::Token, value, grad_entropy, || {
        move |_i, t| TokenOut {
            value: -mul0(coef, entropy[t]),
            grad: -coef,
            no_ratio: true,
            ..TokenOut::default()
        }
    })
}

/// Effective-sample-size statistic of the IS weights `w_t = exp(clamp(lp_t − old_t))`, as sums
/// that data-parallel ranks add up ([`EssStats::merge`]) before taking [`EssStats::ess`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EssStats<T> {
    /// Number of valid tokens.
    pub n: usize,
    /// Σ w.
    pub sum_w: T,
    /// Σ w².
    pub sum_w2: T,
}

impl<T: Real> EssStats<T> {
    /// Sums of two disjoint batches.
    pub fn merge(self, o: Self) -> Self {
        EssStats {
            n: self.n + o.n,
            sum_w: self.sum_w + o.sum_w,
            sum_w2: self.sum_w2 + o.sum_w2,
        }
    }

    /// `ESS = (Σw)² / (n·(Σw² + 1e-8))` [2605.12380], at most 1 (Cauchy–Schwarz; the result is
    /// capped at 1 against rounding); 1 with no token.
    ///
    /// ```
    /// use grpo_core::loss::EssStats;
    /// // Weights (1, 3): (4)² / (2·(10 + 1e-8)) = 0.8 (up to the 1e-8).
    /// let s = EssStats { n: 2, sum_w: 4.0f64, sum_w2: 10.0 };
    /// assert!((s.ess() - 0.8).abs() < 1e-9);
    /// assert_eq!(EssStats::<f64>::default().ess(), 1.0);
    /// ```
    pub fn ess(&self) -> T {
        if self.n == 0 {
            return T::ONE;
        }
        // Evaluated as Σw·(Σw/(Σw² + 1e-8))/n so that (Σw)² cannot overflow.
        let q = self.sum_w / (self.sum_w2 + T::from_f64(1e-8));
        let e = self.sum_w * q / T::from_usize(self.n);
        e.min(T::ONE)
    }
}

/// Configuration of [`p3o`] and [`ess_stats`] (P3O / ESS-adaptive, 2605.12380).
///
/// | field | every preset |
/// |---|---|
/// | `log_ratio_clamp` | `Some(20)` (`Trl`: `None`) |
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct P3oConfig<T> {
    /// Log-ratio clamp `c` before `exp` (`None` = no clamp).
    pub log_ratio_clamp: Option<T>,
}

impl<T: Real> Default for P3oConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> P3oConfig<T> {
    /// The preset's configuration (see the table on [`P3oConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        P3oConfig {
            log_ratio_clamp: match preset {
                Preset::Trl => None,
                _ => Some(T::from_f64(super::DEFAULT_LOG_RATIO_CLAMP)),
            },
        }
    }
}

/// The local [`EssStats`] of a batch: sums of `w = exp(clamp(lp − old))` and `w²` over valid
/// tokens. All-reduce (merge) them across ranks, then pass `ess()` to [`p3o`].
///
/// # Errors
/// Layout/length errors, non-finite valid inputs, clamp ≤ 0; [`Error::NonFinite`]
/// (`what = "ess sums"`) if a sum overflows (possible only without a clamp).
///
/// # Example
/// ```
/// use grpo_core::loss::{P3oConfig, PolicyInputs, ess_stats};
/// use grpo_core::Tokens;
/// let lp = [0.0, 3f64.ln()];
/// let old = [0.0, 0.0];
/// let adv = [1.0, 1.0];
/// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::padded(1, 2, None) };
/// let s = ess_stats(&P3oConfig::default(), &inp).unwrap();
/// // w = (1, 3): Σw = 4, Σw² = 10.
/// assert_eq!(s.n, 2);
/// assert!((s.sum_w - 4.0).abs() < 1e-12 && (s.sum_w2 - 10.0).abs() < 1e-12);
/// ```
pub fn ess_stats<T: Real>(cfg: &P3oConfig<T>, inp: &PolicyInputs<'_, T>) -> Result<EssStats<T>> {
    check_clamp(cfg.log_ratio_clamp, "log_ratio_clamp")?;
    let n = inp.lp.len();
    validate_inputs(inp, n, n)?;
    let mut s: EssStats<T> = EssStats::default();
    for_each_valid(&inp.tokens, |t| {
        let w = clamp_log_ratio(inp.lp[t] - inp.old[t], cfg.log_ratio_clamp)
            .0
            .exp();
        s.n += 1;
        s.sum_w += w;
        s.sum_w2 += w * w;
        Ok(())
    })?;
    if !(s.sum_w.is_finite() && s.sum_w2.is_finite()) {
        return Err(Error::NonFinite {
            what: "ess sums",
            index: 0,
        });
    }
    Ok(s)
}

/// P3O / ESS-adaptive policy optimization [2605.12380]:
///
/// ```text
/// x = clamp(lp − old, −c, c),   ρ = exp(x)
/// L = −sg(min(ρ, ESS))·A·lp + (1 − ESS)·KL3,   KL3 = e^{−x} − 1 + x = 1/ρ − 1 + log ρ
/// ∂L/∂lp = −min(ρ, ESS)·A + (1 − ESS)·(1 − 1/ρ)      (KL3 term 0 if clamped)
/// ```
///
/// KL3 is the k3 estimator of KL(θ‖old) at a token (MATH.md §3's KL(new‖ref) form with `old`
/// for `ref`, as MATH.md §4 writes the penalty): the same estimator as the paper's code
/// (FeynRL `compute_kl_distance(logprobs, old_logprobs)`: `log_ratio + exp(old − lp) − 1`). It
/// is evaluated without cancellation near x = 0 (series below |x| = ½, `expm1` above), and its
/// gradient as `−expm1(−x)`. The paper's code clamps only the exponent, at ±10, and keeps the
/// log-ratio's own gradient there; here the log-ratio clamp `c` (MATH.md §0, ±20 by default)
/// limits ρ and KL3 alike and, where it acts, the KL3 term has no gradient, as every clamped
/// term of this library. For |x| ≤ 10 the two agree.
///
/// `ess` is the batch statistic from [`ess_stats`] (possibly all-reduced); it is a constant
/// (detached) here. With ESS = 1 (on-policy batch) the penalty vanishes. `clipped_high` counts
/// tokens whose weight `ρ` was capped at ESS.
///
/// # Errors
/// `ess` outside `[0, 1]` or NaN → [`Error::InvalidParam`]; otherwise as
/// [`ppo_clip`](super::ppo_clip) (without a clamp, a log-ratio far below 0 makes KL3 = e^{−x}
/// overflow: `NonFinite { what: "loss value" }`).
///
/// # Example
/// ```
/// use grpo_core::loss::{P3oConfig, PolicyInputs, p3o};
/// use grpo_core::Tokens;
/// // ρ = 2, A = 1, lp = ln 2, ESS = 0.5: w = min(2, 0.5) = 0.5, KL3 = ½ − 1 + ln 2;
/// // L = −0.5·ln 2 + 0.5·(ln 2 − ½) = −¼, ∂L/∂lp = −0.5 + 0.5·(1 − ½) = −¼.
/// let lp = [2f64.ln()];
/// let old = [0.0];
/// let adv = [1.0];
/// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::padded(1, 1, None) };
/// let (mut v, mut g) = ([0.0], [0.0]);
/// p3o(&P3oConfig::default(), &inp, 0.5, &mut v, &mut g).unwrap();
/// assert!((v[0] + 0.25).abs() < 1e-12);
/// assert!((g[0] + 0.25).abs() < 1e-12);
/// ```
pub fn p3o<T: Real>(
    cfg: &P3oConfig<T>,
    inp: &PolicyInputs<'_, T>,
    ess: T,
    value: &mut [T],
    grad: &mut [T],
) -> Result<LossDiagnostics<T>> {
    check_clamp(cfg.log_ratio_clamp, "log_ratio_clamp")?;
    ensure(ess >= T::ZERO && ess <= T::ONE, "ess", "must be in [0, 1]")?;
    validate_inputs(inp, value.len(), grad.len())?;
    let c = *cfg;
    let pen = T::ONE - ess;
    drive(&inp.tokens, LossLevel::Token, value, grad, || {
        move |_i, t| {
            let a = inp.adv[t];
            let (x, clamped) = clamp_log_ratio(inp.lp[t] - inp.old[t], c.log_ratio_clamp);
            let rho = x.exp();
            let (w, capped) = if rho > ess { (ess, true) } else { (rho, false) };
            let wa = mul0(w, a);
            // k3 of KL(θ‖old) = e^{−x} − 1 + x, without cancellation near x = 0; its
            // derivative 1 − e^{−x} = −expm1(−x).
            let k3 = expm1_minus_x(-x);
            let value = -mul0(wa, inp.lp[t]) + mul0(pen, k3);
            let dk3 = if clamped { T::ZERO } else { -(-x).exp_m1() };
            TokenOut {
                value,
                grad: -wa + mul0(pen, dk3),
                ratio: rho,
                log_ratio: x,
                clamped,
                clip_high: capped,
                ..TokenOut::default()
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigmoid_slope_matches_definition() {
        for &z in &[-3.0f64, 0.0, 0.5, 4.0] {
            let s = 1.0 / (1.0 + (-z).exp());
            assert!((sigmoid_slope(z) - s * (1.0 - s)).abs() < 1e-15);
        }
        assert_eq!(sigmoid_slope(f64::INFINITY), 0.0);
    }
}
