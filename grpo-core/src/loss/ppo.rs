//! PPO-clip (GRPO, DAPO, ATR-GRPO) with dual-clip and the δ cap: the unified clipped objective.

use super::{
    LossDiagnostics, LossLevel, PolicyInputs, TokenOut, check_clamp, check_dual_clip,
    clamp_log_ratio, drive, mul0, validate_inputs,
};
use crate::divergence::RatioBounds;
use crate::error::{Result, ensure};
use crate::presets::Preset;
use crate::real::Real;

/// Configuration of [`ppo_clip`].
///
/// | field | Paper (GRPO 2402.03300) | Verl | Trl | OpenRlhf |
/// |---|---|---|---|---|
/// | `bounds` | `[0.8, 1.2]` | `[0.8, 1.2]` | `[0.8, 1.2]` | `[0.8, 1.2]` |
/// | `dual_clip` | `None` | `Some(3.0)` (always on in `vanilla`) | `None` | `None` (optional there) |
/// | `delta_cap` | `None` | `None` | `None` (`delta`, INTELLECT-2) | `None` |
/// | `log_ratio_clamp` | `Some(20)` | `Some(20)` | `None` | `Some(20)` |
///
/// `VerlVectorized` is `Verl`. DAPO's clip-higher is [`PpoClipConfig::dapo`]; ATR-GRPO is
/// `PpoClipConfig { bounds: RatioBounds::kl3(δ)?, ..Default::default() }` (the KL3 bounds
/// come from the divergence module).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PpoClipConfig<T> {
    /// The clip interval `[lo, hi]` of the ratio (symmetric, clip-higher, KL3, …).
    pub bounds: RatioBounds<T>,
    /// Dual-clip constant `c > 1` [verl, OpenRLHF]: for `A < 0` the loss is at most `−c·A`.
    pub dual_clip: Option<T>,
    /// TRL's `delta` (INTELLECT-2): the unclipped branch uses `min(ρ, δ)`, `δ > 1`.
    pub delta_cap: Option<T>,
    /// Log-ratio clamp `c`: `x` is clamped to `[−c, c]` before `exp` (`None` = TRL).
    pub log_ratio_clamp: Option<T>,
}

impl<T: Real> Default for PpoClipConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> PpoClipConfig<T> {
    /// The preset's configuration (see the table on [`PpoClipConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        let bounds = RatioBounds {
            lo: T::from_f64(0.8),
            hi: T::from_f64(1.2),
        };
        let clamp = Some(T::from_f64(super::DEFAULT_LOG_RATIO_CLAMP));
        match preset {
            Preset::Verl | Preset::VerlVectorized => PpoClipConfig {
                bounds,
                dual_clip: Some(T::from_f64(3.0)),
                delta_cap: None,
                log_ratio_clamp: clamp,
            },
            Preset::Trl => PpoClipConfig {
                bounds,
                dual_clip: None,
                delta_cap: None,
                log_ratio_clamp: None,
            },
            _ => PpoClipConfig {
                bounds,
                dual_clip: None,
                delta_cap: None,
                log_ratio_clamp: clamp,
            },
        }
    }

    /// DAPO (2503.14476) clip-higher `[1 − 0.2, 1 + 0.28]`, otherwise the default.
    pub fn dapo() -> Self {
        PpoClipConfig {
            bounds: RatioBounds {
                lo: T::from_f64(0.8),
                hi: T::from_f64(1.28),
            },
            ..Self::default()
        }
    }

    /// ATR-GRPO [2602.05494]: PPO-clip whose trust region is the KL3 constraint
    /// `ρ − 1 − ln ρ ≤ δ`, i.e. the asymmetric ratio interval [`RatioBounds::kl3`]`(δ)`
    /// (δ = 0.05 → [0.71619, 1.35040]); everything else as the default.
    ///
    /// # Errors
    /// [`Error::InvalidParam`](crate::Error::InvalidParam) unless `δ > 0` and finite.
    ///
    /// # Example
    /// ```
    /// use grpo_core::loss::PpoClipConfig;
    /// let cfg = PpoClipConfig::<f64>::atr_kl3(0.05).unwrap();
    /// assert!((cfg.bounds.lo - 0.71619).abs() < 1e-5 && (cfg.bounds.hi - 1.35040).abs() < 1e-5);
    /// ```
    pub fn atr_kl3(delta: T) -> Result<Self> {
        Ok(PpoClipConfig {
            bounds: RatioBounds::kl3(delta)?,
            ..Self::default()
        })
    }

    /// Checks the configuration the way [`ppo_clip`] does first (so a backend can reject a bad
    /// configuration with the same error before touching any data).
    ///
    /// # Errors
    /// [`Error::InvalidParam`](crate::Error::InvalidParam) for bounds that do not contain 1,
    /// `dual_clip ≤ 1` or non-finite, `delta_cap ≤ 1`, a log-ratio clamp that is not finite and
    /// `> 0`.
    ///
    /// ```
    /// use grpo_core::loss::PpoClipConfig;
    /// assert!(PpoClipConfig::<f32>::default().validate().is_ok());
    /// let bad = PpoClipConfig { dual_clip: Some(0.5f32), ..Default::default() };
    /// assert!(bad.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<()> {
        RatioBounds::new(self.bounds.lo, self.bounds.hi)?;
        check_dual_clip(self.dual_clip)?;
        if let Some(d) = self.delta_cap {
            ensure(d > T::ONE, "delta_cap", "must be > 1")?;
        }
        check_clamp(self.log_ratio_clamp, "log_ratio_clamp")
    }
}

/// The clip part of the unified objective as a function of a ratio `rho` whose derivative with
/// respect to the token's log-prob is `drho`: returns `L = −min(ρ'A, clip(ρ)A)` with
/// `ρ' = min(ρ, δ)`, then `min(L, −cA)` for `A < 0` under dual-clip, and `∂L/∂lp`.
///
/// Which branch wins is decided on the ratios, exactly — the clipped branch where
/// `A·(ρ' − clip(ρ)) > 0`, the dual bound where `c < r` for the winning ratio `r` — not by
/// comparing the rounded products `−A·r`. Rounding can make those products equal while the
/// ratios differ (ρ one ULP above `hi`, or just above `c`), and a comparison of them would then
/// let the gradient of a token the rule clips flow while the token is counted as clipped. The
/// values are the same bits either way: rounding is monotone, so the winner's rounded product is
/// the larger (the smaller for the dual bound) or equal. Where the ratios themselves are equal
/// (`ρ` inside `[lo, hi]`) the branches agree; at `ρ = c` exactly the dual bound is not counted
/// and the gradient flows, as at a bound of the closed clip interval.
#[inline]
pub(crate) fn ppo_core<T: Real>(
    rho: T,
    drho: T,
    a: T,
    lo: T,
    hi: T,
    dual: Option<T>,
    cap: Option<T>,
) -> TokenOut<T> {
    let mut o = TokenOut {
        ratio: rho,
        ..TokenOut::default()
    };
    if a == T::ZERO {
        return o;
    }
    // Unclipped branch, ratio optionally capped at δ (constant above δ).
    let (r1, dr1, capped) = match cap {
        Some(d) if rho > d => (d, T::ZERO, true),
        _ => (rho, drho, false),
    };
    let v1 = -(a * r1);
    let g1 = -mul0(a, dr1);
    // Clipped branch: gradient only inside [lo, hi] (inclusive, as torch.clamp).
    let (r2, dr2) = if rho < lo {
        (lo, T::ZERO)
    } else if rho > hi {
        (hi, T::ZERO)
    } else {
        (rho, drho)
    };
    let v2 = -(a * r2);
    let g2 = -mul0(a, dr2);
    // −A·r2 > −A·r1 exactly (see above): decided on the ratios, not on the rounded products.
    let clipped_wins = (a > T::ZERO && r1 > r2) || (a < T::ZERO && r1 < r2);
    let (r, mut v, mut g) = if clipped_wins {
        (r2, v2, g2)
    } else {
        (r1, v1, g1)
    };
    o.capped = capped && a < T::ZERO && !clipped_wins;
    o.clip_high = a > T::ZERO && rho > hi;
    o.clip_low = a < T::ZERO && rho < lo;
    if let Some(c) = dual
        && a < T::ZERO
    {
        let v3 = -(c * a);
        // −c·A < −r·A exactly for A < 0.
        if c < r {
            v = v3;
            g = T::ZERO;
            o.dual = true;
        }
    }
    o.value = v;
    o.grad = g;
    o
}

/// PPO-clip, the unified clipped objective of MATH.md §3 [2602.05494] (GRPO 2402.03300, DAPO
/// 2503.14476, ATR-GRPO with KL3 bounds; dual-clip [verl, OpenRLHF]; δ cap \[TRL\]):
///
/// ```text
/// x = clamp(lp − old, −c, c)          (optional; None = TRL)
/// ρ = eˣ,   ρ' = min(ρ, δ)             (δ cap optional)
/// L = −min(ρ'·A, clip(ρ, lo, hi)·A)
/// A < 0 and dual-clip c_d:  L = min(L, −c_d·A)
/// ```
///
/// Gradient (the unified rule): a token contributes `−A·∂ρ/∂lp = −A·ρ` unless `A > 0` and
/// `ρ > hi`, `A < 0` and `ρ < lo`, the dual-clip bound is active (the winning branch's ratio
/// above `c`), the δ cap is active in the winning branch, or the log-ratio was clamped. Exactly
/// at a bound the gradient flows (the clip interval is closed, as PyTorch's `clamp`). The
/// branches are chosen by comparing the ratios, not the rounded products `−A·ρ`, so the rule
/// holds where rounding makes the two products equal (ρ one ULP past a bound): a token counted
/// as clipped never contributes a gradient. (PyTorch's `maximum`/`minimum`, which the peers'
/// code uses, split the gradient equally between the two sides of such a tie.)
///
/// # Errors
/// [`Error::InvalidParam`](crate::Error::InvalidParam) for bounds that do not contain 1,
/// `dual_clip ≤ 1` or non-finite, `delta_cap ≤ 1`, a clamp `≤ 0` or non-finite; length, layout
/// and finiteness errors as in
/// the [module docs](super); [`Error::NonFinite`](crate::Error::NonFinite) if an unclamped ratio
/// overflows into the loss. Outputs untouched on `Err`.
///
/// # Example
/// ```
/// use grpo_core::loss::{PolicyInputs, PpoClipConfig, ppo_clip};
/// use grpo_core::{Preset, Tokens};
/// // ρ = e^{ln 1.5} = 1.5 with A = +1: clipped at 1.2, no gradient;
/// // ρ = 0.5 with A = −2: clipped at 0.8 → L = −min(−1, −1.6) = 1.6, no gradient;
/// // ρ = 1.1 with A = 1: L = −1.1, ∂L/∂lp = −A·ρ = −1.1.
/// let lp = [1.5f64.ln(), 0.5f64.ln(), 1.1f64.ln()];
/// let old = [0.0; 3];
/// let adv = [1.0, -2.0, 1.0];
/// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::padded(1, 3, None) };
/// let (mut v, mut g) = ([0.0; 3], [0.0; 3]);
/// let d = ppo_clip(&PpoClipConfig::default(), &inp, &mut v, &mut g).unwrap();
/// assert!((v[0] + 1.2).abs() < 1e-12 && g[0] == 0.0);
/// assert!((v[1] - 1.6).abs() < 1e-12 && g[1] == 0.0);
/// assert!((v[2] + 1.1).abs() < 1e-12 && (g[2] + 1.1).abs() < 1e-12);
/// assert_eq!((d.clipped_high, d.clipped_low), (1, 1));
/// // verl adds dual-clip c = 3: for the A = −2 token the bound −c·A = 6 exceeds 1.6, inactive.
/// let d = ppo_clip(&PpoClipConfig::from_preset(Preset::Verl), &inp, &mut v, &mut g).unwrap();
/// assert_eq!(d.dual_clipped, 0);
/// ```
pub fn ppo_clip<T: Real>(
    cfg: &PpoClipConfig<T>,
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
            let drho = if clamped { T::ZERO } else { rho };
            let mut o = ppo_core(
                rho,
                drho,
                inp.adv[t],
                c.bounds.lo,
                c.bounds.hi,
                c.dual_clip,
                c.delta_cap,
            );
            o.log_ratio = x;
            o.clamped = clamped;
            o
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Tokens;

    fn run(cfg: &PpoClipConfig<f64>, x: f64, a: f64) -> (f64, f64) {
        let lp = [x];
        let old = [0.0];
        let adv = [a];
        let inp = PolicyInputs {
            lp: &lp,
            old: &old,
            adv: &adv,
            tokens: Tokens::padded(1, 1, None),
        };
        let (mut v, mut g) = ([0.0], [0.0]);
        ppo_clip(cfg, &inp, &mut v, &mut g).unwrap();
        (v[0], g[0])
    }

    #[test]
    fn dual_clip_caps_negative_advantages() {
        let cfg = PpoClipConfig::<f64>::from_preset(Preset::Verl);
        // ρ = e^2 ≈ 7.389 > c = 3 with A = −1: min(−c·A, −ρA) = min(3, 7.389) = 3, grad 0.
        let (v, g) = run(&cfg, 2.0, -1.0);
        assert_eq!((v, g), (3.0, 0.0));
        // ρ = 2 < 3: L = −A·ρ = 2, grad −A·ρ = 2.
        let (v, g) = run(&cfg, 2f64.ln(), -1.0);
        assert!((v - 2.0).abs() < 1e-14 && (g - 2.0).abs() < 1e-14);
    }

    #[test]
    fn delta_cap_bounds_the_unclipped_branch() {
        let mut cfg = PpoClipConfig::<f64>::from_preset(Preset::Trl);
        cfg.delta_cap = Some(1.5);
        // ρ = 2, A = −1: −min(min(2, 1.5)·(−1), 1.2·(−1)) = −min(−1.5, −1.2) = 1.5, grad 0.
        let (v, g) = run(&cfg, 2f64.ln(), -1.0);
        assert!((v - 1.5).abs() < 1e-14);
        assert_eq!(g, 0.0);
        // ρ = 1.4 < δ, A = −1: L = 1.4, grad −A·ρ = 1.4.
        let (v, g) = run(&cfg, 1.4f64.ln(), -1.0);
        assert!((v - 1.4).abs() < 1e-14 && (g - 1.4).abs() < 1e-14);
    }

    /// MATH.md §3's rule evaluated exactly: every product of two f32 is exact in f64, so the
    /// branches are compared without rounding and only the result is rounded to f32.
    fn rule_exact(rho: f32, a: f32, lo: f32, hi: f32, dual: Option<f32>) -> (f32, f32) {
        let (rho64, a64) = (rho as f64, a as f64);
        let v1 = -(a64 * rho64);
        let v2 = -(a64 * (rho.clamp(lo, hi) as f64));
        let inside = (lo..=hi).contains(&rho);
        let (mut v, mut g) = if v2 > v1 {
            (v2, if inside { v1 } else { 0.0 })
        } else {
            (v1, v1)
        };
        if let Some(c) = dual.filter(|_| a < 0.0) {
            let v3 = -(c as f64 * a64);
            if v3 < v {
                (v, g) = (v3, 0.0);
            }
        }
        (v as f32, g as f32)
    }

    /// Ratios a few ULP around `lo`, `hi` and the dual constant, with advantages whose products
    /// with neighbouring ratios round to the same f32 (ties), give the exact rule's value and
    /// gradient: a ratio one ULP past a bound is clipped although `−A·ρ` and `−A·hi` round
    /// alike, and the diagnostics count exactly the tokens without a gradient.
    #[test]
    fn rounding_ties_follow_the_exact_rule() {
        let (lo, hi, c) = (0.8f32, 1.2f32, 3.0f32);
        let near = |b: f32| (0..9).map(move |k| f32::from_bits(b.to_bits() + k - 4));
        let (mut ties, mut checked) = (0, 0);
        for rho in near(lo).chain(near(hi)).chain(near(c)) {
            for k in 1..600 {
                for a in [0.5 + k as f32 * 0.00137, -(0.5 + k as f32 * 0.00137)] {
                    let o = ppo_core(rho, rho, a, lo, hi, Some(c), None);
                    let (v, g) = rule_exact(rho, a, lo, hi, Some(c));
                    // (The sign of a zero gradient is the implementation's: compared by value.)
                    assert_eq!(
                        (o.value.to_bits(), o.grad),
                        (v.to_bits(), g),
                        "rho {rho:e}, a {a}"
                    );
                    let counted = o.clip_high || o.clip_low || o.dual;
                    assert_eq!(counted, g == 0.0, "rho {rho:e}, a {a}");
                    let r2 = rho.clamp(lo, hi);
                    let r = if (a > 0.0) == (rho > r2) { r2 } else { rho };
                    ties += ((rho != r2 && a * rho == a * r2)
                        || (a < 0.0 && r != c && a * r == a * c))
                        as usize;
                    checked += 1;
                }
            }
        }
        // The grid must contain the ties it is about (the rule above fails on them when the
        // branches are chosen by comparing the rounded products).
        assert!(ties > 100, "{ties} ties in {checked} tokens");
    }

    #[test]
    fn bad_params_are_rejected() {
        let d = PpoClipConfig::<f64>::default();
        for cfg in [
            PpoClipConfig {
                dual_clip: Some(1.0),
                ..d
            },
            PpoClipConfig {
                delta_cap: Some(1.0),
                ..d
            },
            PpoClipConfig {
                log_ratio_clamp: Some(0.0),
                ..d
            },
            PpoClipConfig {
                bounds: RatioBounds { lo: 1.1, hi: 1.2 },
                ..d
            },
        ] {
            assert!(cfg.validate().is_err());
        }
        assert!(d.validate().is_ok());
    }
}
