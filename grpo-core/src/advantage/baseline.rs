//! REINFORCE++-baseline: group-mean baseline per sample, whitened over the batch's valid tokens
//! (MATH.md §2, §6).

use crate::error::{Error, Result, check_len, ensure};
use crate::layout::{Groups, Tokens};
use crate::presets::Preset;
use crate::real::Real;
use crate::stats::Moments;

use super::whiten::{Acc, Summary, WhitenConfig, WhitenReport, prepare};
use super::{Diagnostics, NanPolicy, SingletonRule};

/// Configuration of [`reinforce_pp_baseline`].
///
/// | preset | `singleton` | `reward_clip` | `whiten` |
/// |---|---|---|---|
/// | `Paper` (= `Default`), `Trl` | `Zero` | `None` | verl (unbiased, `+1e-8`) |
/// | `Verl`, `VerlVectorized` | `VerlLoop` (baseline 0: `s` itself is whitened) | `None` | verl |
/// | `OpenRlhf` | `Zero` (its group mean of one sample is the sample) | `Some((−10, 10))` | OpenRLHF (population, `max(·, 1e-8)`) |
///
/// `nan` is [`NanPolicy::Reject`] in every preset. Sources: verl (b178a3cd)
/// `compute_reinforce_plus_plus_baseline_outcome_advantage` (a group of one gets mean 0);
/// OpenRLHF (3c3be62) `reinforce_baseline`: `s − mean_g(s)`, then `reward_clip_range`
/// (default (−10, 10)) in `compute_reward`, then global whitening. OpenRLHF also turns the
/// clipped score into token returns with its KL penalty and γ (default 1): with γ = 1 and no KL
/// every valid token gets the clipped score, which is what this function whitens; add KL terms
/// separately.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BaselineConfig<T> {
    /// NaN scores: error (default) or excluded (the sample gets advantage 0 and its tokens stay
    /// out of the group mean and the whitening statistics).
    pub nan: NanPolicy,
    /// What a group with one scorable sample gets before whitening.
    pub singleton: SingletonRule,
    /// Clamp `(lo, hi)` of the centered score, applied after the baseline (OpenRLHF).
    pub reward_clip: Option<(T, T)>,
    /// Whitening over the valid tokens; `None` writes the centered (clipped) scores.
    pub whiten: Option<WhitenConfig<T>>,
}

impl<T: Real> Default for BaselineConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> BaselineConfig<T> {
    /// The configuration a peer uses (see the table in the type's docs).
    pub fn from_preset(preset: Preset) -> Self {
        let (singleton, reward_clip) = match preset {
            Preset::Verl | Preset::VerlVectorized => (SingletonRule::VerlLoop, None),
            Preset::OpenRlhf => (
                SingletonRule::Zero,
                Some((T::from_f64(-10.0), T::from_f64(10.0))),
            ),
            _ => (SingletonRule::Zero, None),
        };
        BaselineConfig {
            nan: NanPolicy::Reject,
            singleton,
            reward_clip,
            whiten: Some(WhitenConfig::from_preset(preset)),
        }
    }
}

/// Per-group state of the baseline, computed once in the validation pass and again in the
/// writing pass (no scratch needed).
struct GroupMean<T> {
    moments: Moments<T>,
}

impl<T: Real> GroupMean<T> {
    fn of(scores: &[T], groups: &Groups<'_>, k: usize) -> Self {
        let mut moments = Moments::new();
        for i in groups.members(k) {
            let s = scores[i];
            if !s.is_nan() {
                moments.push(s);
            }
        }
        GroupMean { moments }
    }

    /// Centered, clipped score of a scorable member; `None` for an excluded (NaN) one.
    fn centered(&self, s: T, cfg: &BaselineConfig<T>) -> Option<T> {
        if s.is_nan() {
            return None;
        }
        let c = if self.moments.n == 1 {
            match cfg.singleton {
                SingletonRule::VerlLoop => s,
                // Reject was refused during validation.
                SingletonRule::Zero | SingletonRule::Reject => T::ZERO,
            }
        } else {
            s - self.moments.mean
        };
        Some(match cfg.reward_clip {
            Some((lo, hi)) => c.clamp(lo, hi),
            None => c,
        })
    }
}

/// REINFORCE++-baseline advantages, one per token.
///
/// `c_i = s_i − mean_{j ∈ g(i)} s_j` (clamped to `reward_clip` if set), broadcast to the valid
/// tokens of sequence `i`, then `A = whiten(c)` over all valid tokens of the batch (see
/// [`WhitenConfig`]); masked positions get 0. Sequence `i` of `tokens` is sample `i`.
///
/// Source: \[verl\] `compute_reinforce_plus_plus_baseline_outcome_advantage`, \[OpenRLHF\]
/// `reinforce_baseline` (REINFORCE++ \[2501.03262\]). Groups of one follow
/// [`BaselineConfig::singleton`]. The whitening statistics are accumulated per sequence (each
/// sequence contributes `valid_count` copies of `c_i`, merged in group order); the returned
/// `raw_moments` are this shard's, for all-reduce.
///
/// # Errors
/// Layout errors of [`Groups::validate`] / [`Tokens::validate`] (`out` is the per-token array);
/// [`Error::LengthMismatch`] (`scores`) unless there is one score per sequence;
/// [`Error::EmptyGroup`]; [`Error::NonFinite`] (`scores`) for NaN under
/// [`NanPolicy::Reject`], for ±∞ always, and for a centered score that overflows;
/// [`Error::GroupTooSmall`] for a one-sample group under [`SingletonRule::Reject`];
/// [`Error::InvalidParam`] for a bad clip range (`lo > hi` or NaN) or whitening ε;
/// [`Error::NoValidTokens`] when whitening without valid tokens. On error `out` is untouched.
///
/// # Example
/// ```
/// use grpo_core::advantage::baseline::{reinforce_pp_baseline, BaselineConfig};
/// use grpo_core::layout::{Groups, Tokens};
/// // One group of 2 samples with scores 1 and 0, each a sequence of 2 tokens.
/// // Centered: +0.5, −0.5 → tokens [0.5, 0.5, −0.5, −0.5]: mean 0, M2 = 1, var_unb = 1/3.
/// let mut out = [0.0f64; 4];
/// let rep = reinforce_pp_baseline(&[1.0, 0.0], Groups::Uniform(2), &Tokens::padded(2, 2, None),
///     &BaselineConfig::default(), &mut out).unwrap();
/// let a = 0.5 / (1.0f64 / 3.0 + 1e-8).sqrt();
/// assert!(out.iter().zip([a, a, -a, -a]).all(|(x, y)| (x - y).abs() < 1e-12));
/// assert_eq!(rep.raw_moments.n, 4);
/// ```
pub fn reinforce_pp_baseline<T: Real>(
    scores: &[T],
    groups: Groups<'_>,
    tokens: &Tokens<'_>,
    cfg: &BaselineConfig<T>,
    out: &mut [T],
) -> Result<WhitenReport<T>> {
    if let Some((lo, hi)) = cfg.reward_clip {
        ensure(
            !lo.is_nan() && !hi.is_nan() && lo <= hi,
            "reward_clip",
            "needs lo <= hi (no NaN)",
        )?;
    }
    if let Some(w) = &cfg.whiten {
        w.validate()?;
    }
    let n = scores.len();
    let num_groups = groups.validate(n)?;
    let seqs = tokens.validate(out.len())?;
    check_len("scores", seqs, n)?;
    for (index, s) in scores.iter().enumerate() {
        let allowed_nan = cfg.nan == NanPolicy::Exclude && s.is_nan();
        if !s.is_finite() && !allowed_nan {
            return Err(Error::NonFinite {
                what: "scores",
                index,
            });
        }
    }
    let mut diag = Diagnostics {
        groups: num_groups,
        ..Diagnostics::default()
    };
    let mut acc = Acc::new();
    for k in 0..num_groups {
        let size = groups.size(k);
        if size == 0 {
            return Err(Error::EmptyGroup { group: k });
        }
        let gm = GroupMean::of(scores, &groups, k);
        diag.nan_excluded += size - gm.moments.n;
        if gm.moments.n == 1 {
            if cfg.singleton == SingletonRule::Reject {
                return Err(Error::GroupTooSmall {
                    group: k,
                    needed: 2,
                    found: 1,
                });
            }
            diag.singleton_groups += 1;
        } else if gm.moments.n >= 2 && gm.moments.m2 == T::ZERO {
            diag.zero_variance_groups += 1;
        }
        for i in groups.members(k) {
            if let Some(c) = gm.centered(scores[i], cfg) {
                if !c.is_finite() {
                    return Err(Error::NonFinite {
                        what: "scores",
                        index: i,
                    });
                }
                acc.push_repeated(c, tokens.valid_count(i));
            }
        }
    }
    let whitener = prepare(&acc, cfg.whiten.as_ref())?;
    let mut summary = Summary::new();
    for k in 0..num_groups {
        let gm = GroupMean::of(scores, &groups, k);
        for i in groups.members(k) {
            let a = gm
                .centered(scores[i], cfg)
                .map_or(T::ZERO, |c| whitener.as_ref().map_or(c, |w| w.apply(c)));
            for t in tokens.span(i) {
                if tokens.is_valid(t) {
                    out[t] = a;
                    summary.push(a);
                } else {
                    out[t] = T::ZERO;
                }
            }
        }
    }
    Ok(WhitenReport {
        raw_moments: acc.moments,
        diagnostics: summary.finish(diag),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
    }

    #[test]
    fn verl_and_openrlhf_presets_hand_computed() {
        // Group 0 (G=2): scores 3, 1 → centered +1, −1. Group 1 (G=1): score 30.
        // Each sample is one sequence of 1 token (padded 3×1).
        // verl: singleton baseline 0 → c = [1, −1, 30]: mean 10, M2 = 81+121+400 = 602,
        //   var_unb = 301, A = (c − 10)/sqrt(301 + 1e-8).
        let t = Tokens::padded(3, 1, None);
        let scores = [3.0f64, 1.0, 30.0];
        let g = Groups::Offsets(&[0, 2, 3]);
        let mut out = [0.0; 3];
        let rep = reinforce_pp_baseline(
            &scores,
            g,
            &t,
            &BaselineConfig::from_preset(Preset::Verl),
            &mut out,
        )
        .unwrap();
        let d = (301.0f64 + 1e-8).sqrt();
        assert!(close(&out, &[-9.0 / d, -11.0 / d, 20.0 / d]), "{out:?}");
        assert_eq!(rep.diagnostics.singleton_groups, 1);
        // OpenRLHF: singleton → 0, clip (−10, 10) no-op here → c = [1, −1, 0]: mean 0,
        //   var_pop = 2/3, A = c/sqrt(2/3).
        reinforce_pp_baseline(
            &scores,
            g,
            &t,
            &BaselineConfig::from_preset(Preset::OpenRlhf),
            &mut out,
        )
        .unwrap();
        let d = (2.0f64 / 3.0).sqrt();
        assert!(close(&out, &[1.0 / d, -1.0 / d, 0.0]), "{out:?}");
        // The clip: scores 30, 0 → centered ±15 → clipped ±10; population var 100 → ±1.
        reinforce_pp_baseline(
            &[30.0, 0.0],
            Groups::Uniform(2),
            &Tokens::padded(2, 1, None),
            &BaselineConfig::from_preset(Preset::OpenRlhf),
            &mut out[..2],
        )
        .unwrap();
        assert!(close(&out[..2], &[1.0, -1.0]));
        // Without whitening the clipped centered scores come out raw.
        let raw = BaselineConfig {
            whiten: None,
            ..BaselineConfig::from_preset(Preset::OpenRlhf)
        };
        reinforce_pp_baseline(
            &[30.0, 0.0],
            Groups::Uniform(2),
            &Tokens::padded(2, 1, None),
            &raw,
            &mut out[..2],
        )
        .unwrap();
        assert_eq!(out[..2], [10.0, -10.0]);
    }

    #[test]
    fn masked_tokens_and_nan_exclusion() {
        // Padded 3×2, group of 3; sample 2 has a NaN score (excluded), sample 1 one valid token.
        // Scorable: 2, 0 → mean 1 → c = +1 (2 tokens), −1 (1 token).
        // Valid tokens: 1, 1, −1 (sample 2's tokens excluded): mean 1/3,
        // M2 = 4/9 + 4/9 + 16/9 = 24/9, var_unb = 4/3.
        let mask = [true, true, true, false, true, true];
        let t = Tokens::padded(3, 2, Some(&mask));
        let cfg = BaselineConfig {
            nan: NanPolicy::Exclude,
            ..BaselineConfig::default()
        };
        let mut out = [9.0f64; 6];
        let rep = reinforce_pp_baseline(
            &[2.0, 0.0, f64::NAN],
            Groups::Uniform(3),
            &t,
            &cfg,
            &mut out,
        )
        .unwrap();
        let d = (4.0f64 / 3.0 + 1e-8).sqrt();
        let (p, m) = ((2.0 / 3.0) / d, (-4.0 / 3.0) / d);
        assert!(close(&out, &[p, p, m, 0.0, 0.0, 0.0]), "{out:?}");
        assert_eq!(rep.diagnostics.nan_excluded, 1);
        assert_eq!(rep.raw_moments.n, 3);
    }

    #[test]
    fn errors_leave_out_untouched() {
        let t = Tokens::padded(2, 1, None);
        let mut out = [7.0f64; 2];
        let cfg = BaselineConfig::default();
        assert_eq!(
            reinforce_pp_baseline(&[1.0, f64::NAN], Groups::Uniform(2), &t, &cfg, &mut out),
            Err(Error::NonFinite {
                what: "scores",
                index: 1
            })
        );
        assert!(matches!(
            reinforce_pp_baseline(&[1.0], Groups::Uniform(1), &t, &cfg, &mut out),
            Err(Error::LengthMismatch { what: "scores", .. })
        ));
        assert_eq!(
            reinforce_pp_baseline(&[1.0, 2.0], Groups::Offsets(&[0, 0, 2]), &t, &cfg, &mut out),
            Err(Error::EmptyGroup { group: 0 })
        );
        let rej = BaselineConfig {
            singleton: SingletonRule::Reject,
            ..cfg
        };
        assert!(matches!(
            reinforce_pp_baseline(&[1.0, 2.0], Groups::Uniform(1), &t, &rej, &mut out),
            Err(Error::GroupTooSmall { group: 0, .. })
        ));
        let bad = BaselineConfig {
            reward_clip: Some((1.0, -1.0)),
            ..cfg
        };
        assert!(matches!(
            reinforce_pp_baseline(&[1.0, 2.0], Groups::Uniform(2), &t, &bad, &mut out),
            Err(Error::InvalidParam {
                name: "reward_clip",
                ..
            })
        ));
        assert!(matches!(
            reinforce_pp_baseline(&[1.0, 2.0], Groups::Uniform(2), &t, &cfg, &mut out[..1]),
            Err(Error::LengthMismatch { .. })
        ));
        assert_eq!(out, [7.0; 2]);
    }
}
