//! Token-level discounted returns: REINFORCE++ (whitened returns) and ReMax (returns minus the
//! greedy sample's reward) (MATH.md §2, §6).

use crate::error::{Error, Result, check_len, ensure};
use crate::layout::Tokens;
use crate::presets::Preset;
use crate::real::Real;

use super::Diagnostics;
use super::whiten::{Acc, Summary, WhitenConfig, WhitenReport, prepare};

/// How a backward recurrence (returns, GAE) treats a masked position *inside* a sequence
/// (observation tokens of a multi-turn rollout, padding). Masked rewards and values are never
/// read in any mode; outputs at masked positions are 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MaskedTokens {
    /// A masked position ends the trajectory that follows it: a valid token right before it
    /// bootstraps from nothing (next return / next value / next GAE term = 0). This is verl's
    /// `compute_reinforce_plus_plus_outcome_advantage` (the running return is multiplied by the
    /// mask after each step, "reset after EOS"). Default for returns.
    #[default]
    Reset,
    /// Masked positions are skipped: a valid token's successor is the next *valid* token of the
    /// same sequence (0 past the last one), with one factor γ (γλ) per valid step. This is verl's
    /// `compute_gae_advantage_return` ("skip values and TD-error on observation tokens").
    Skip,
    /// Masked positions act as tokens with reward 0 and value 0: the recurrence runs through them
    /// and each one costs a factor γ (γλ). This is OpenRLHF (rewards and values multiplied by
    /// the action mask before `get_cumulative_returns` / `get_advantages_and_returns`).
    ZeroFill,
}

/// Configuration of [`reinforce_pp_returns`].
///
/// | preset | `gamma` | `masked` | `whiten` |
/// |---|---|---|---|
/// | `Paper` (= `Default`), `Verl`, `VerlVectorized`, `Trl` | 1 | `Reset` | verl (unbiased, `+1e-8`) |
/// | `OpenRlhf` | 1 | `ZeroFill` | OpenRLHF (population, `max(·, 1e-8)`) |
///
/// Sources: verl (b178a3cd) `compute_reinforce_plus_plus_outcome_advantage` (γ from
/// `algorithm.gamma`, default 1.0); OpenRLHF (3c3be62) `get_cumulative_returns` + global
/// whitening (`--gamma`, default 1). Trained right-padded batches (no interior mask gaps) give
/// the same returns under all three [`MaskedTokens`] modes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReturnsConfig<T> {
    /// Discount γ ∈ [0, 1].
    pub gamma: T,
    /// Masked-position rule of the recurrence.
    pub masked: MaskedTokens,
    /// Whitening of the returns; `None` writes the raw returns as advantages (then whiten with
    /// all-reduced moments, see [`whiten`](mod@super::whiten)).
    pub whiten: Option<WhitenConfig<T>>,
}

impl<T: Real> Default for ReturnsConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> ReturnsConfig<T> {
    /// The configuration a peer uses (see the table in the type's docs).
    pub fn from_preset(preset: Preset) -> Self {
        ReturnsConfig {
            gamma: T::ONE,
            masked: if preset == Preset::OpenRlhf {
                MaskedTokens::ZeroFill
            } else {
                MaskedTokens::Reset
            },
            whiten: Some(WhitenConfig::from_preset(preset)),
        }
    }
}

pub(crate) fn check_unit(x: impl Real, name: &'static str) -> Result<()> {
    ensure(x >= Real::ZERO && x <= Real::ONE, name, "must be in [0, 1]")
}

/// Backward discounted returns of every sequence; calls `f(t, Some(G_t))` at valid positions
/// and `f(t, None)` at masked ones, in reverse position order within each sequence.
fn for_each_return<T: Real>(
    rewards: &[T],
    tokens: &Tokens<'_>,
    gamma: T,
    masked: MaskedTokens,
    mut f: impl FnMut(usize, Option<T>),
) {
    for i in 0..tokens.num_sequences() {
        let mut next = T::ZERO;
        for t in tokens.span(i).rev() {
            if tokens.is_valid(t) {
                next = rewards[t] + gamma * next;
                f(t, Some(next));
            } else {
                match masked {
                    MaskedTokens::Reset => next = T::ZERO,
                    MaskedTokens::Skip => {}
                    MaskedTokens::ZeroFill => next *= gamma,
                }
                f(t, None);
            }
        }
    }
}

/// REINFORCE++ token returns, whitened over the batch.
///
/// `G_t = r_t + γ·G_{t+1}` backwards within each sequence (`G` past the end = 0), with masked
/// positions handled by [`MaskedTokens`] (`Reset`: a masked position sets the running return to
/// 0, so the valid token before it gets `G = r`); then `A = whiten(G)` over the valid tokens
/// (see [`WhitenConfig`]). `returns` receives `G` at valid tokens; both outputs are 0 at masked
/// positions (verl leaves the running sum there; nobody reads it).
///
/// Source: REINFORCE++ \[2501.03262\]; \[verl\] `compute_reinforce_plus_plus_outcome_advantage`;
/// \[OpenRLHF\] `get_cumulative_returns` + global whitening. Token-level KL penalties are the
/// caller's: add them to `rewards` first.
///
/// Returns the raw moments of `G` over the valid tokens (accumulated in reverse position
/// order within each sequence) and the min/max/mean of the written advantages.
///
/// # Errors
/// Layout errors of [`Tokens::validate`]; [`Error::LengthMismatch`] for `advantages`/`returns`;
/// [`Error::InvalidParam`] for γ ∉ [0, 1] or a bad whitening ε, or when the returns overflow;
/// [`Error::NonFinite`] (`rewards`) for a non-finite valid reward; [`Error::NoValidTokens`]
/// when whitening a batch without valid tokens. On error both outputs are untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::returns::{reinforce_pp_returns, ReturnsConfig};
/// use grpo_core::layout::Tokens;
/// // One sequence of 3 tokens, reward 1 on the last, γ = 0.5, no whitening:
/// // G = [0.25, 0.5, 1].
/// let cfg = ReturnsConfig { gamma: 0.5, whiten: None, ..ReturnsConfig::default() };
/// let (mut adv, mut ret) = ([0.0f64; 3], [0.0f64; 3]);
/// reinforce_pp_returns(&[0.0, 0.0, 1.0], &Tokens::padded(1, 3, None), &cfg, &mut adv, &mut ret)
///     .unwrap();
/// assert_eq!(ret, [0.25, 0.5, 1.0]);
/// assert_eq!(adv, ret);
/// ```
pub fn reinforce_pp_returns<T: Real>(
    rewards: &[T],
    tokens: &Tokens<'_>,
    cfg: &ReturnsConfig<T>,
    advantages: &mut [T],
    returns: &mut [T],
) -> Result<WhitenReport<T>> {
    check_unit(cfg.gamma, "gamma")?;
    if let Some(w) = &cfg.whiten {
        w.validate()?;
    }
    tokens.validate(rewards.len())?;
    check_len("advantages", rewards.len(), advantages.len())?;
    check_len("returns", rewards.len(), returns.len())?;
    if let Some(index) = tokens.first_non_finite(rewards) {
        return Err(Error::NonFinite {
            what: "rewards",
            index,
        });
    }
    let mut acc = Acc::new();
    for_each_return(rewards, tokens, cfg.gamma, cfg.masked, |_, g| {
        if let Some(g) = g {
            acc.push(g);
        }
    });
    if !acc.finite {
        return Err(Error::InvalidParam {
            name: "rewards",
            reason: "the returns overflow the floating-point range",
        });
    }
    let whitener = prepare(&acc, cfg.whiten.as_ref())?;
    let mut summary = Summary::new();
    for_each_return(rewards, tokens, cfg.gamma, cfg.masked, |t, g| match g {
        Some(g) => {
            let a = whitener.as_ref().map_or(g, |w| w.apply(g));
            summary.push(a);
            returns[t] = g;
            advantages[t] = a;
        }
        None => {
            returns[t] = T::ZERO;
            advantages[t] = T::ZERO;
        }
    });
    Ok(WhitenReport {
        raw_moments: acc.moments,
        diagnostics: summary.finish(Diagnostics::default()),
    })
}

/// ReMax advantages: `A_t = G_t − b_i` at the valid tokens of sequence `i`, where
/// `G_t = Σ_{t' ≥ t, valid} r_{t'}` (undiscounted reward-to-go; masked rewards count as 0) and
/// `b_i` is the reward of the greedy (argmax-decoded) response to the same prompt. No
/// whitening. `returns` receives `G`; both outputs are 0 at masked positions (verl writes the
/// running sum there).
///
/// Source: ReMax \[2310.10505\]; \[verl\] `compute_remax_outcome_advantage`.
///
/// # Errors
/// Layout errors; [`Error::LengthMismatch`] for `baselines` (one per sequence), `advantages`,
/// `returns`; [`Error::NonFinite`] for a non-finite valid reward or baseline;
/// [`Error::InvalidParam`] (`rewards`) if a result overflows. On error the outputs are untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::returns::remax;
/// use grpo_core::layout::Tokens;
/// // Two sequences of 2 tokens; the second has one masked slot holding garbage.
/// let r = [0.0f64, 1.0, 0.5, f64::NAN];
/// let mask = [true, true, true, false];
/// let (mut adv, mut ret) = ([9.0; 4], [9.0; 4]);
/// remax(&r, &Tokens::padded(2, 2, Some(&mask)), &[0.25, 1.0], &mut adv, &mut ret).unwrap();
/// assert_eq!(ret, [1.0, 1.0, 0.5, 0.0]);
/// assert_eq!(adv, [0.75, 0.75, -0.5, 0.0]);
/// ```
pub fn remax<T: Real>(
    rewards: &[T],
    tokens: &Tokens<'_>,
    baselines: &[T],
    advantages: &mut [T],
    returns: &mut [T],
) -> Result<Diagnostics<T>> {
    let seqs = tokens.validate(rewards.len())?;
    check_len("baselines", seqs, baselines.len())?;
    check_len("advantages", rewards.len(), advantages.len())?;
    check_len("returns", rewards.len(), returns.len())?;
    if let Some(index) = tokens.first_non_finite(rewards) {
        return Err(Error::NonFinite {
            what: "rewards",
            index,
        });
    }
    if let Some(index) = baselines.iter().position(|b| !b.is_finite()) {
        return Err(Error::NonFinite {
            what: "baselines",
            index,
        });
    }
    let overflow = Error::InvalidParam {
        name: "rewards",
        reason: "the returns overflow the floating-point range",
    };
    for i in 0..seqs {
        let b = baselines[i];
        let mut g = T::ZERO;
        for t in tokens.span(i).rev() {
            if tokens.is_valid(t) {
                g += rewards[t];
                if !(g.is_finite() && (g - b).is_finite()) {
                    return Err(overflow);
                }
            }
        }
    }
    let mut summary = Summary::new();
    for i in 0..seqs {
        let b = baselines[i];
        let mut g = T::ZERO;
        for t in tokens.span(i).rev() {
            if tokens.is_valid(t) {
                g += rewards[t];
                returns[t] = g;
                advantages[t] = g - b;
                summary.push(g - b);
            } else {
                returns[t] = T::ZERO;
                advantages[t] = T::ZERO;
            }
        }
    }
    Ok(summary.finish(Diagnostics::default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(gamma: f64, masked: MaskedTokens) -> ReturnsConfig<f64> {
        ReturnsConfig {
            gamma,
            masked,
            whiten: None,
        }
    }

    #[test]
    fn returns_hand_computed_with_mask_modes() {
        // Sequence of 4: r = [1, 2, (masked, NaN), 4], γ = 0.5.
        // Reset:    G3 = 4; position 2 resets to 0; G1 = 2 + 0.5·0 = 2; G0 = 1 + 0.5·2 = 2.
        // Skip:     G3 = 4; G1 = 2 + 0.5·4 = 4; G0 = 1 + 0.5·4 = 3.
        // ZeroFill: G3 = 4; pos 2 carries 0.5·4 = 2; G1 = 2 + 0.5·2 = 3; G0 = 1 + 0.5·3 = 2.5.
        let r = [1.0, 2.0, f64::NAN, 4.0];
        let mask = [true, true, false, true];
        let t = Tokens::padded(1, 4, Some(&mask));
        for (mode, want) in [
            (MaskedTokens::Reset, [2.0, 2.0, 0.0, 4.0]),
            (MaskedTokens::Skip, [3.0, 4.0, 0.0, 4.0]),
            (MaskedTokens::ZeroFill, [2.5, 3.0, 0.0, 4.0]),
        ] {
            let (mut a, mut g) = ([9.0; 4], [9.0; 4]);
            reinforce_pp_returns(&r, &t, &raw(0.5, mode), &mut a, &mut g).unwrap();
            assert_eq!(g, want, "{mode:?}");
            assert_eq!(a, want, "{mode:?}");
        }
    }

    #[test]
    fn whitened_returns_hand_computed() {
        // Packed: seq0 = [0, 1] (γ = 1 → G = [1, 1]), seq1 = [2] → G = [2].
        // Valid G = 1, 1, 2: mean 4/3, M2 = 1/9 + 1/9 + 4/9 = 2/3, var_unb = 1/3.
        let cu = [0, 2, 3];
        let t = Tokens::packed(&cu, None);
        let (mut a, mut g) = ([0.0f64; 3], [0.0f64; 3]);
        let rep = reinforce_pp_returns(
            &[0.0, 1.0, 2.0],
            &t,
            &ReturnsConfig::from_preset(Preset::Verl),
            &mut a,
            &mut g,
        )
        .unwrap();
        assert_eq!(g, [1.0, 1.0, 2.0]);
        assert_eq!(rep.raw_moments.n, 3);
        let s = (1.0f64 / 3.0 + 1e-8).sqrt();
        let want = [-1.0 / 3.0 / s, -1.0 / 3.0 / s, 2.0 / 3.0 / s];
        for (x, w) in a.iter().zip(want) {
            assert!((x - w).abs() < 1e-12, "{x} vs {w}");
        }
        // OpenRLHF: var_pop = 2/9.
        reinforce_pp_returns(
            &[0.0, 1.0, 2.0],
            &t,
            &ReturnsConfig::from_preset(Preset::OpenRlhf),
            &mut a,
            &mut g,
        )
        .unwrap();
        let s = (2.0f64 / 9.0).sqrt();
        let want = [-1.0 / 3.0 / s, -1.0 / 3.0 / s, 2.0 / 3.0 / s];
        for (x, w) in a.iter().zip(want) {
            assert!((x - w).abs() < 1e-12, "{x} vs {w}");
        }
    }

    #[test]
    fn returns_errors_leave_outputs_untouched() {
        let t = Tokens::padded(1, 3, None);
        let (mut a, mut g) = ([7.0f64; 3], [7.0f64; 3]);
        for gamma in [-0.1, 1.5, f64::NAN] {
            assert!(matches!(
                reinforce_pp_returns(
                    &[1.0; 3],
                    &t,
                    &raw(gamma, MaskedTokens::Reset),
                    &mut a,
                    &mut g
                ),
                Err(Error::InvalidParam { name: "gamma", .. })
            ));
        }
        assert_eq!(
            reinforce_pp_returns(
                &[1.0, f64::NAN, 1.0],
                &t,
                &ReturnsConfig::default(),
                &mut a,
                &mut g
            ),
            Err(Error::NonFinite {
                what: "rewards",
                index: 1
            })
        );
        assert!(matches!(
            reinforce_pp_returns(
                &[1.0; 3],
                &t,
                &ReturnsConfig::default(),
                &mut a[..2],
                &mut g
            ),
            Err(Error::LengthMismatch {
                what: "advantages",
                ..
            })
        ));
        assert!(matches!(
            reinforce_pp_returns(
                &[1e308; 3],
                &t,
                &raw(1.0, MaskedTokens::Reset),
                &mut a,
                &mut g
            ),
            Err(Error::InvalidParam {
                name: "rewards",
                ..
            })
        ));
        assert_eq!((a, g), ([7.0; 3], [7.0; 3]));
    }

    #[test]
    fn remax_hand_computed_and_errors() {
        // r = [1, 2, 3] in one sequence, b = 2: G = [6, 5, 3], A = [4, 3, 1].
        let t = Tokens::padded(1, 3, None);
        let (mut a, mut g) = ([0.0f64; 3], [0.0f64; 3]);
        let d = remax(&[1.0, 2.0, 3.0], &t, &[2.0], &mut a, &mut g).unwrap();
        assert_eq!(g, [6.0, 5.0, 3.0]);
        assert_eq!(a, [4.0, 3.0, 1.0]);
        assert_eq!((d.min, d.max, d.mean), (1.0, 4.0, 8.0 / 3.0));
        let (mut a, mut g) = ([7.0f64; 3], [7.0f64; 3]);
        assert!(matches!(
            remax(&[1.0; 3], &t, &[0.0, 0.0], &mut a, &mut g),
            Err(Error::LengthMismatch {
                what: "baselines",
                ..
            })
        ));
        assert_eq!(
            remax(&[1.0; 3], &t, &[f64::NAN], &mut a, &mut g),
            Err(Error::NonFinite {
                what: "baselines",
                index: 0
            })
        );
        assert_eq!((a, g), ([7.0; 3], [7.0; 3]));
    }
}
