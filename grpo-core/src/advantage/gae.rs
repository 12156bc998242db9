//! Generalized advantage estimation for critic users (MATH.md §2, §6).

use crate::error::{Error, Result, check_len};
use crate::layout::Tokens;
use crate::presets::Preset;
use crate::real::Real;

use super::Diagnostics;
use super::returns::{MaskedTokens, check_unit};
use super::whiten::{Acc, Summary, WhitenConfig, WhitenReport, prepare};

/// Configuration of [`gae`].
///
/// | preset | `gamma` | `lambda` | `masked` | `whiten` |
/// |---|---|---|---|---|
/// | `Paper` (= `Default`), `Verl`, `VerlVectorized`, `Trl` | 1 | 1 | `Skip` | verl (unbiased, `+1e-8`) |
/// | `OpenRlhf` | 1 | 1 | `ZeroFill` | OpenRLHF (population, `max(·, 1e-8)`) |
///
/// Sources: verl (b178a3cd) `compute_gae_advantage_return` (`algorithm.gamma` = `lam` = 1.0 by
/// default; masked positions skipped); OpenRLHF (3c3be62) `get_advantages_and_returns`
/// (`--gamma 1`, `--lambd 1`: the default of every OpenRLHF version with the dual-clip and
/// `icepop` options the other presets reproduce; older versions, with `--value_clip 0.2`, had
/// `--lambd 0.95`; values and rewards multiplied by the action mask) followed by global
/// whitening. TRL's GRPO trainer has no critic, so `Trl` gives the default (TRL's
/// experimental PPO trainer, λ = 0.95 over its own padding layout, is not reproduced). The
/// GAE paper \[1506.02438\] has no masks; its recurrence is what every mode computes on a fully
/// valid sequence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GaeConfig<T> {
    /// Discount γ ∈ [0, 1].
    pub gamma: T,
    /// GAE λ ∈ [0, 1].
    pub lambda: T,
    /// Masked-position rule of the recurrence.
    pub masked: MaskedTokens,
    /// Whitening of the advantages; `None` writes the raw ℓ.
    pub whiten: Option<WhitenConfig<T>>,
}

impl<T: Real> Default for GaeConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> GaeConfig<T> {
    /// The configuration a peer uses (see the table in the type's docs).
    pub fn from_preset(preset: Preset) -> Self {
        if preset == Preset::OpenRlhf {
            GaeConfig {
                gamma: T::ONE,
                lambda: T::ONE,
                masked: MaskedTokens::ZeroFill,
                whiten: Some(WhitenConfig::from_preset(preset)),
            }
        } else {
            GaeConfig {
                gamma: T::ONE,
                lambda: T::ONE,
                masked: MaskedTokens::Skip,
                whiten: Some(WhitenConfig::from_preset(preset)),
            }
        }
    }
}

/// Backward GAE recurrence; calls `f(t, Some((ℓ_t, ℓ_t + V_t)))` at valid positions and
/// `f(t, None)` at masked ones, in reverse position order within each sequence.
fn for_each_gae<T: Real>(
    rewards: &[T],
    values: &[T],
    tokens: &Tokens<'_>,
    cfg: &GaeConfig<T>,
    mut f: impl FnMut(usize, Option<(T, T)>),
) {
    let gl = cfg.gamma * cfg.lambda;
    for i in 0..tokens.num_sequences() {
        // Value and GAE term of the successor (0 past the end: no bootstrap after the last token).
        let (mut next_v, mut next_l) = (T::ZERO, T::ZERO);
        for t in tokens.span(i).rev() {
            if tokens.is_valid(t) {
                let v = values[t];
                let delta = rewards[t] + cfg.gamma * next_v - v;
                let l = delta + gl * next_l;
                f(t, Some((l, l + v)));
                next_v = v;
                next_l = l;
            } else {
                match cfg.masked {
                    MaskedTokens::Reset => {
                        next_v = T::ZERO;
                        next_l = T::ZERO;
                    }
                    MaskedTokens::Skip => {}
                    MaskedTokens::ZeroFill => {
                        // r = V = 0 here: δ = γ·V_next, ℓ = δ + γλ·ℓ_next.
                        next_l = cfg.gamma * next_v + gl * next_l;
                        next_v = T::ZERO;
                    }
                }
                f(t, None);
            }
        }
    }
}

/// Generalized advantage estimation.
///
/// Backwards within each sequence: `δ_t = r_t + γ·V_{t+1} − V_t`, `ℓ_t = δ_t + γλ·ℓ_{t+1}`,
/// with `V` and `ℓ` past the last token equal to 0 (no bootstrap) and masked positions handled
/// by [`MaskedTokens`] (verl's `Skip`: the successor of a valid token is the next valid one).
/// `returns = ℓ + V` (raw ℓ, the critic's target) and `A = whiten(ℓ)` over the valid tokens;
/// both outputs are 0 at masked positions. Rewards and values at masked positions are never read.
///
/// Source: GAE \[1506.02438\]; \[verl\] `compute_gae_advantage_return`; \[OpenRLHF\]
/// `get_advantages_and_returns`. With γ = λ = 1, `ℓ_t = Σ_{t'≥t} r_{t'} − V_t` (telescoping).
///
/// Returns the raw moments of ℓ over the valid tokens (accumulated in reverse position order
/// within each sequence) and the min/max/mean of the written advantages.
///
/// # Errors
/// [`Error::InvalidParam`] for γ or λ outside [0, 1] (or NaN), a bad whitening ε, or results
/// that overflow; layout errors; [`Error::LengthMismatch`] for `values`, `advantages`,
/// `returns`; [`Error::NonFinite`] for a non-finite valid reward (`rewards`) or value
/// (`values`); [`Error::NoValidTokens`] when whitening without valid tokens. On error both
/// outputs are untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::gae::{gae, GaeConfig};
/// use grpo_core::layout::Tokens;
/// // 2 tokens, r = [0, 1], V = [0.5, 0.5], γ = 1, λ = 0.5, no whitening.
/// // t=1: δ = 1 + 0 − 0.5 = 0.5, ℓ = 0.5.  t=0: δ = 0 + 0.5 − 0.5 = 0, ℓ = 0 + 0.5·0.5 = 0.25.
/// let cfg = GaeConfig { lambda: 0.5, whiten: None, ..GaeConfig::default() };
/// let (mut adv, mut ret) = ([0.0f64; 2], [0.0f64; 2]);
/// gae(&[0.0, 1.0], &[0.5, 0.5], &Tokens::padded(1, 2, None), &cfg, &mut adv, &mut ret).unwrap();
/// assert_eq!(adv, [0.25, 0.5]);
/// assert_eq!(ret, [0.75, 1.0]);
/// ```
pub fn gae<T: Real>(
    rewards: &[T],
    values: &[T],
    tokens: &Tokens<'_>,
    cfg: &GaeConfig<T>,
    advantages: &mut [T],
    returns: &mut [T],
) -> Result<WhitenReport<T>> {
    check_unit(cfg.gamma, "gamma")?;
    check_unit(cfg.lambda, "lambda")?;
    if let Some(w) = &cfg.whiten {
        w.validate()?;
    }
    tokens.validate(rewards.len())?;
    check_len("values", rewards.len(), values.len())?;
    check_len("advantages", rewards.len(), advantages.len())?;
    check_len("returns", rewards.len(), returns.len())?;
    if let Some(index) = tokens.first_non_finite(rewards) {
        return Err(Error::NonFinite {
            what: "rewards",
            index,
        });
    }
    if let Some(index) = tokens.first_non_finite(values) {
        return Err(Error::NonFinite {
            what: "values",
            index,
        });
    }
    let mut acc = Acc::new();
    let mut returns_finite = true;
    for_each_gae(rewards, values, tokens, cfg, |_, x| {
        if let Some((l, ret)) = x {
            acc.push(l);
            returns_finite &= ret.is_finite();
        }
    });
    if !(acc.finite && returns_finite) {
        return Err(Error::InvalidParam {
            name: "rewards",
            reason: "the advantages or returns overflow the floating-point range",
        });
    }
    let whitener = prepare(&acc, cfg.whiten.as_ref())?;
    let mut summary = Summary::new();
    for_each_gae(rewards, values, tokens, cfg, |t, x| match x {
        Some((l, ret)) => {
            let a = whitener.as_ref().map_or(l, |w| w.apply(l));
            summary.push(a);
            advantages[t] = a;
            returns[t] = ret;
        }
        None => {
            advantages[t] = T::ZERO;
            returns[t] = T::ZERO;
        }
    });
    Ok(WhitenReport {
        raw_moments: acc.moments,
        diagnostics: summary.finish(Diagnostics::default()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(gamma: f64, lambda: f64, masked: MaskedTokens) -> GaeConfig<f64> {
        GaeConfig {
            gamma,
            lambda,
            masked,
            whiten: None,
        }
    }

    #[test]
    fn four_tokens_hand_computed() {
        // r = [0, 0, 0, 1], V = [0.2, 0.4, 0.6, 0.8], γ = 0.5, λ = 0.5 (γλ = 0.25).
        // t=3: δ = 1 + 0.5·0 − 0.8 = 0.2;          ℓ3 = 0.2
        // t=2: δ = 0 + 0.5·0.8 − 0.6 = −0.2;       ℓ2 = −0.2 + 0.25·0.2 = −0.15
        // t=1: δ = 0 + 0.5·0.6 − 0.4 = −0.1;       ℓ1 = −0.1 + 0.25·(−0.15) = −0.1375
        // t=0: δ = 0 + 0.5·0.4 − 0.2 = 0;          ℓ0 = 0 + 0.25·(−0.1375) = −0.034375
        // returns = ℓ + V = [0.165625, 0.2625, 0.45, 1.0].
        let r = [0.0, 0.0, 0.0, 1.0];
        let v = [0.2, 0.4, 0.6, 0.8];
        let (mut a, mut g) = ([0.0f64; 4], [0.0f64; 4]);
        gae(
            &r,
            &v,
            &Tokens::padded(1, 4, None),
            &raw(0.5, 0.5, MaskedTokens::Skip),
            &mut a,
            &mut g,
        )
        .unwrap();
        let want = [-0.034375, -0.1375, -0.15, 0.2];
        let want_ret = [0.165625, 0.2625, 0.45, 1.0];
        for j in 0..4 {
            assert!((a[j] - want[j]).abs() < 1e-15, "{a:?}");
            assert!((g[j] - want_ret[j]).abs() < 1e-15, "{g:?}");
        }
    }

    #[test]
    fn mask_modes_hand_computed() {
        // r = [0, (masked), 1], V = [0.5, (masked, NaN), 0.25], γ = 0.5, λ = 1.
        // t=2 (all modes): δ = 1 − 0.25 = 0.75, ℓ2 = 0.75.
        // Skip:     t=0 sees t=2: δ = 0 + 0.5·0.25 − 0.5 = −0.375; ℓ0 = −0.375 + 0.5·0.75 = 0.
        // Reset:    t=0 sees 0:   δ = −0.5; ℓ0 = −0.5.
        // ZeroFill: t=1: ℓ1 = 0.5·0.25 + 0.5·0.75 = 0.5, V1 = 0;
        //           t=0: δ = 0 + 0.5·0 − 0.5 = −0.5; ℓ0 = −0.5 + 0.5·0.5 = −0.25.
        let r = [0.0, f64::NAN, 1.0];
        let v = [0.5, f64::NAN, 0.25];
        let mask = [true, false, true];
        let t = Tokens::packed(&[0, 3], Some(&mask));
        for (mode, l0) in [
            (MaskedTokens::Skip, 0.0),
            (MaskedTokens::Reset, -0.5),
            (MaskedTokens::ZeroFill, -0.25),
        ] {
            let (mut a, mut g) = ([9.0f64; 3], [9.0f64; 3]);
            gae(&r, &v, &t, &raw(0.5, 1.0, mode), &mut a, &mut g).unwrap();
            assert_eq!(a, [l0, 0.0, 0.75], "{mode:?}");
            assert_eq!(g, [l0 + 0.5, 0.0, 1.0], "{mode:?}");
        }
    }

    #[test]
    fn whitened_presets_hand_computed() {
        // γ = λ = 1, V = 0: ℓ = reward-to-go. r = [1, 1] → ℓ = [2, 1]: mean 1.5, M2 = 0.5.
        let r = [1.0f64, 1.0];
        let v = [0.0f64, 0.0];
        let t = Tokens::padded(1, 2, None);
        let (mut a, mut g) = ([0.0; 2], [0.0; 2]);
        // verl: var_unb = 0.5 → A = ±0.5/sqrt(0.5 + 1e-8).
        gae(
            &r,
            &v,
            &t,
            &GaeConfig::from_preset(Preset::Verl),
            &mut a,
            &mut g,
        )
        .unwrap();
        let d = (0.5f64 + 1e-8).sqrt();
        assert!((a[0] - 0.5 / d).abs() < 1e-15 && (a[1] + 0.5 / d).abs() < 1e-15);
        assert_eq!(g, [2.0, 1.0]);
        // OpenRLHF (λ = 1): ℓ = (2, 1): mean 1.5, var_pop = 0.25 → A = ±0.5/0.5 = ±1.
        gae(
            &r,
            &v,
            &t,
            &GaeConfig::from_preset(Preset::OpenRlhf),
            &mut a,
            &mut g,
        )
        .unwrap();
        assert!(
            (a[0] - 1.0).abs() < 1e-12 && (a[1] + 1.0).abs() < 1e-12,
            "{a:?}"
        );
        assert_eq!(g, [2.0, 1.0]);
        // With λ = 0.95 (older OpenRLHF): ℓ0 = 1 + 0.95·1 = 1.95, returns (1.95, 1).
        let older = GaeConfig {
            lambda: 0.95,
            ..GaeConfig::from_preset(Preset::OpenRlhf)
        };
        gae(&r, &v, &t, &older, &mut a, &mut g).unwrap();
        assert!((g[0] - 1.95).abs() < 1e-15 && g[1] == 1.0);
    }

    #[test]
    fn errors_leave_outputs_untouched() {
        let t = Tokens::padded(1, 2, None);
        let (mut a, mut g) = ([7.0f64; 2], [7.0f64; 2]);
        for (gamma, lambda, name) in [
            (1.1, 0.5, "gamma"),
            (-0.1, 0.5, "gamma"),
            (0.5, 1.5, "lambda"),
            (0.5, f64::NAN, "lambda"),
        ] {
            assert_eq!(
                gae(
                    &[1.0; 2],
                    &[0.0; 2],
                    &t,
                    &raw(gamma, lambda, MaskedTokens::Skip),
                    &mut a,
                    &mut g
                ),
                Err(Error::InvalidParam {
                    name,
                    reason: "must be in [0, 1]"
                })
            );
        }
        assert!(matches!(
            gae(
                &[1.0; 2],
                &[0.0; 3],
                &t,
                &GaeConfig::default(),
                &mut a,
                &mut g
            ),
            Err(Error::LengthMismatch { what: "values", .. })
        ));
        assert_eq!(
            gae(
                &[1.0; 2],
                &[0.0, f64::INFINITY],
                &t,
                &GaeConfig::default(),
                &mut a,
                &mut g
            ),
            Err(Error::NonFinite {
                what: "values",
                index: 1
            })
        );
        assert_eq!((a, g), ([7.0; 2], [7.0; 2]));
    }
}
