//! Aggregation of per-token losses into the scalar that is differentiated (MATH.md §4).
//!
//! Every mode is linear in the per-token values: [`aggregate`] returns the scalar and writes the
//! per-token weight `w_t` with `loss = Σ_t w_t·L_t` (invalid positions get `w_t = 0`), so the
//! gradient of the scalar with respect to `lp_t` is `w_t·∂L_t/∂lp_t` for a token-level loss and
//! `(Σ_{s∈seq(t)} w_s)·∂L_i/∂lp_t` for a sequence-level one — [`scale_gradients`] applies either
//! in place.
//!
//! Notation: `m` = validity, `n_i` = valid tokens of sequence `i`, `N = Σ n_i`, `B` = number of
//! sequences that count in a mean over sequences ([`SeqCount`]): every row of a padded batch
//! or segment of a packed one, empty ones included, as `torch.mean` over rows does (TRL,
//! OpenRLHF; [`SeqCount::All`]), or only the non-empty ones, as verl's `agg_loss` does
//! (`seq_mask = loss_mask.sum(-1) > 0`, `global_batch_size = seq_mask.sum()`;
//! [`SeqCount::NonEmpty`], the Verl presets).
//!
//! | mode | loss | `w_t` | source |
//! |---|---|---|---|
//! | `TokenMean { global_tokens }` | `Σ L m / N'` | `1/N'` | verl `token-mean` (one process); `N' = global_tokens` or the local N |
//! | `SeqMeanTokenMean` | `(1/B) Σ_i Σ_t L m / n_i` | `1/(B·n_i)` | verl `seq-mean-token-mean`, TRL `grpo` |
//! | `SeqMeanTokenSum` | `(1/B) Σ_i Σ_t L m` | `1/B` | verl `seq-mean-token-sum` |
//! | `SeqMeanTokenSumNorm { max_len, divide_by_batch: true }` | `Σ L m / (B·L_max)` | `1/(B·L_max)` | Dr. GRPO 2503.20783, TRL `dr_grpo` |
//! | `SeqMeanTokenSumNorm { max_len, divide_by_batch: false }` | `Σ L m / L_max` | `1/L_max` | verl's `seq-mean-token-sum-norm` (no ÷B) |
//! | `Bnpo` | `Σ L m / N` | `1/N` | TRL `bnpo` |
//! | `Dapo { global_tokens, processes }` | `Σ L m / (N_global / P)` | `P/N_global` | TRL `dapo` |
//! | `Luspo` | `(1/B) Σ_i Σ_t L m` | `1/B` | LUSPO 2602.05261, TRL `luspo` |
//!
//! verl's data-parallel token mean, `Σ L m / batch_num_tokens · dp_size` (the all-reduced
//! count and the number of ranks), is `Dapo { global_tokens: batch_num_tokens, processes:
//! dp_size }`. Its sequence means take a `global_batch_size` the same way; here `B` is the
//! local count, so a data-parallel caller multiplies the scalar and the weights by
//! `B / global_batch_size · dp_size`.
//!
//! `L_max` is `max_len` if given, else the padded width (padded layout) or the longest segment
//! (packed layout). TRL's `dr_grpo` divides by its configured `max_completion_length`, not by
//! the padded width (TRL pads a batch to its longest completion): pass
//! `max_len: Some(max_completion_length)` to reproduce it (verl's default is the padded width
//! of the loss mask).
//!
//! **LUSPO** scales each sequence's loss by its length and averages over sequences. For a
//! sequence-level loss written on each of its `n_i` tokens (GSPO), `Σ_t L m = n_i·L_i`, so the
//! loss is `(1/B) Σ_i n_i·L_i` — TRL's `(per_token_loss * mask.sum(-1)).mean()` on `[B, 1]`
//! losses and TRL ≥ 1.10's `(loss * mask).sum(-1).mean()`. As weights this is exactly
//! `seq-mean-token-sum`; it is kept as its own mode for the name. (Older TRL applied the
//! `[B, 1]` formula to `[B, T]` token losses, multiplying padded positions too; that reads
//! padding and is not reproduced.)
//!
//! **Zero denominators** follow [`Denominator`]: `Strict` (default, verl semantics without the
//! NaN) → [`Error::NoValidTokens`] for a batch-level count/size of 0 and
//! [`Error::EmptySegment`] for an empty sequence under a per-sequence mean of all sequences
//! (with [`SeqCount::NonEmpty`] an empty sequence is left out instead, as verl leaves it out);
//! `ClampOne` (TRL: every denominator `max(·, 1)`, so the loss is 0 instead); `PlusEps(ε)`
//! (verl `masked_mean`: token-count denominators `+ ε`; batch sizes and `L_max` stay strict).

use crate::error::{Error, Result, check_len, ensure};
use crate::layout::{Segments, Tokens};
use crate::loss::LossLevel;
use crate::presets::Preset;
use crate::real::Real;

/// The aggregation formula (see the [module table](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AggMode {
    /// Mean over valid tokens; `global_tokens` replaces the local count (data-parallel runs that
    /// normalise by the all-reduced token count).
    TokenMean {
        /// All-reduced token count, if any.
        global_tokens: Option<usize>,
    },
    /// Mean over sequences of the per-sequence token mean.
    SeqMeanTokenMean,
    /// Mean over sequences of the per-sequence token sum.
    SeqMeanTokenSum,
    /// Dr. GRPO: token sum over the batch divided by `B·L_max` (or by `L_max` alone: verl).
    SeqMeanTokenSumNorm {
        /// Normaliser length; `None` = padded width / longest packed segment (TRL's `dr_grpo`
        /// needs `Some(max_completion_length)`: see the [module docs](self)).
        max_len: Option<usize>,
        /// `true`: ÷(B·L_max) (Dr. GRPO, TRL); `false`: ÷L_max (verl).
        divide_by_batch: bool,
    },
    /// TRL `bnpo`: mean over the local batch's valid tokens.
    Bnpo,
    /// TRL `dapo`: token sum divided by `global_tokens / processes`.
    Dapo {
        /// The all-reduced token count the peer divides by. To reproduce TRL pass its
        /// `num_items_in_batch`: the completion tokens of the whole generation batch (every
        /// process, every gradient-accumulation micro-batch), counted before
        /// `mask_truncated_completions` and tool masks — not necessarily the tokens valid
        /// here. TRL's `cispo` and `vespo` use this normaliser too (its `sapo`, `grpo`'s). TRL
        /// also divides `grpo`/`bnpo`/`dr_grpo`/`luspo` by the accumulation steps and `dapo`
        /// not; the scalars here are per micro-batch, before that division.
        global_tokens: usize,
        /// Number of data-parallel processes (≥ 1).
        processes: usize,
    },
    /// LUSPO: mean over sequences of the token sums (length-scaled sequence losses).
    Luspo,
}

/// What a zero denominator does (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Denominator<T> {
    /// A zero denominator is an error (verl computes NaN there). Which sequences count in a
    /// mean over sequences is [`SeqCount`]'s: with `NonEmpty` an empty sequence is left out,
    /// not an error.
    #[default]
    Strict,
    /// Every denominator is `max(d, 1)` (TRL): empty parts contribute 0.
    ClampOne,
    /// Token-count denominators get `+ ε` (verl `masked_mean`, ε = 1e-8); others strict.
    PlusEps(T),
}

/// Which sequences a mean over sequences counts (`B` in the [module table](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SeqCount {
    /// Every sequence, empty ones included: `torch.mean` over the rows (TRL, OpenRLHF, the
    /// papers).
    #[default]
    All,
    /// Only the sequences with at least one valid token: verl's `agg_loss`, whose sequence
    /// means divide by `seq_mask.sum()` with `seq_mask = loss_mask.sum(-1) > 0` (the version
    /// MATH.md §6 describes: token-mean without ε, `seq-mean-token-sum-norm` without ÷B). An
    /// empty sequence then adds nothing and is no error under `SeqMeanTokenMean` (verl's
    /// `Σ/(n_i + 1e-8)` is 0 there and masked out); a batch without any is
    /// [`Error::NoValidTokens`] under `Strict` or `PlusEps` (verl: 0/0 = NaN).
    NonEmpty,
}

/// Configuration of [`aggregate`].
///
/// `from_preset(preset, mode)` sets the zero-denominator rule, the sequences a mean over
/// sequences counts and verl's Dr. GRPO variant:
///
/// | preset | `denominator` | `sequences` | `SeqMeanTokenSumNorm::divide_by_batch` |
/// |---|---|---|---|
/// | Paper | `Strict` | `All` | as given |
/// | Verl, VerlVectorized | `Strict` | `NonEmpty` | forced `false` (verl divides the batch sum by L_max only) |
/// | Trl | `ClampOne` | `All` | forced `true` |
/// | OpenRlhf | `Strict` | `All` | as given |
///
/// `PlusEps(1e-8)` is never a preset's aggregation (verl's `agg_loss` token-mean divides by the
/// exact count, MATH.md §6, and its `n_i + 1e-8` in seq-mean-token-mean is `n_i` in f32 for
/// every `n_i ≥ 1`, empty sequences being masked out); it reproduces verl's `masked_mean`
/// helper where a caller wants that.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AggConfig<T> {
    /// The formula.
    pub mode: AggMode,
    /// The zero-denominator rule.
    pub denominator: Denominator<T>,
    /// The sequences a mean over sequences counts.
    pub sequences: SeqCount,
}

impl<T: Real> Default for AggConfig<T> {
    /// Token mean over local tokens, strict.
    fn default() -> Self {
        AggConfig {
            mode: AggMode::TokenMean {
                global_tokens: None,
            },
            denominator: Denominator::Strict,
            sequences: SeqCount::All,
        }
    }
}

impl<T: Real> AggConfig<T> {
    /// `mode` with the preset's semantics (see the table on [`AggConfig`]).
    pub fn from_preset(preset: Preset, mode: AggMode) -> Self {
        let force = |div: bool| match mode {
            AggMode::SeqMeanTokenSumNorm { max_len, .. } => AggMode::SeqMeanTokenSumNorm {
                max_len,
                divide_by_batch: div,
            },
            m => m,
        };
        match preset {
            Preset::Verl | Preset::VerlVectorized => AggConfig {
                mode: force(false),
                denominator: Denominator::Strict,
                sequences: SeqCount::NonEmpty,
            },
            Preset::Trl => AggConfig {
                mode: force(true),
                denominator: Denominator::ClampOne,
                sequences: SeqCount::All,
            },
            _ => AggConfig {
                mode,
                denominator: Denominator::Strict,
                sequences: SeqCount::All,
            },
        }
    }
}

/// `1/d` for a token-count denominator under the rule; `err` if strict and zero.
fn inv_count<T: Real>(d: usize, rule: Denominator<T>, err: Error) -> Result<T> {
    match rule {
        Denominator::Strict if d == 0 => Err(err),
        Denominator::Strict => Ok(T::ONE / T::from_usize(d)),
        Denominator::ClampOne => Ok(T::ONE / T::from_usize(d.max(1))),
        Denominator::PlusEps(e) => Ok(T::ONE / (T::from_usize(d) + e)),
    }
}

/// `1/d` for a batch-size / length denominator (never `+ε`).
fn inv_size<T: Real>(d: usize, rule: Denominator<T>, err: Error) -> Result<T> {
    match rule {
        Denominator::ClampOne => Ok(T::ONE / T::from_usize(d.max(1))),
        _ if d == 0 => Err(err),
        _ => Ok(T::ONE / T::from_usize(d)),
    }
}

/// The default `L_max`: padded width, or the longest packed segment.
fn default_max_len(tokens: &Tokens<'_>) -> usize {
    match tokens.segments {
        Segments::Padded { cols, .. } => cols,
        Segments::Packed(_) => (0..tokens.num_sequences())
            .map(|i| tokens.span(i).len())
            .max()
            .unwrap_or(0),
    }
}

/// How each sequence is weighted: `w_t = a_i` for every valid token of sequence `i`.
#[derive(Clone, Copy)]
enum SeqWeights<T> {
    /// One weight for every valid token of every counted sequence.
    Uniform(T),
    /// `scale / n_i` per sequence (empty sequences: weight irrelevant).
    PerSequence { scale: T },
}

/// The per-sequence rule of a configuration whose `PlusEps` passed [`check_eps`]: checks the
/// other parameters and the zero denominators and returns how each sequence is weighted.
/// The `PlusEps` rule's check (before the values are read).
fn check_eps<T: Real>(cfg: &AggConfig<T>) -> Result<()> {
    match cfg.denominator {
        Denominator::PlusEps(e) => ensure(
            e > T::ZERO && e.is_finite(),
            "denominator eps",
            "must be finite and > 0",
        ),
        _ => Ok(()),
    }
}

fn plan<T: Real>(cfg: &AggConfig<T>, tokens: &Tokens<'_>, b: usize) -> Result<SeqWeights<T>> {
    let rule = cfg.denominator;
    let local = tokens.total_valid();
    // `B` of a mean over sequences.
    let seqs = || match cfg.sequences {
        SeqCount::All => b,
        SeqCount::NonEmpty => (0..b).filter(|&i| tokens.valid_count(i) > 0).count(),
    };
    Ok(match cfg.mode {
        AggMode::TokenMean { global_tokens } => SeqWeights::Uniform(inv_count(
            global_tokens.unwrap_or(local),
            rule,
            Error::NoValidTokens,
        )?),
        AggMode::Bnpo => SeqWeights::Uniform(inv_count(local, rule, Error::NoValidTokens)?),
        AggMode::SeqMeanTokenSum | AggMode::Luspo => {
            SeqWeights::Uniform(inv_size(seqs(), rule, Error::NoValidTokens)?)
        }
        AggMode::SeqMeanTokenSumNorm {
            max_len,
            divide_by_batch,
        } => {
            let l = max_len.unwrap_or_else(|| default_max_len(tokens));
            let d = if divide_by_batch {
                seqs().checked_mul(l).ok_or(Error::InvalidParam {
                    name: "max_len",
                    reason: "B * max_len overflows usize",
                })?
            } else {
                l
            };
            SeqWeights::Uniform(inv_size(d, rule, Error::NoValidTokens)?)
        }
        AggMode::Dapo {
            global_tokens,
            processes,
        } => {
            ensure(processes >= 1, "processes", "must be >= 1")?;
            let inv = inv_count::<T>(global_tokens, rule, Error::NoValidTokens)?;
            SeqWeights::Uniform(inv * T::from_usize(processes))
        }
        AggMode::SeqMeanTokenMean => {
            let inv_b = inv_size(seqs(), rule, Error::NoValidTokens)?;
            if let (Denominator::Strict, SeqCount::All) = (rule, cfg.sequences)
                && let Some(segment) = (0..b).find(|&i| tokens.valid_count(i) == 0)
            {
                return Err(Error::EmptySegment { segment });
            }
            SeqWeights::PerSequence { scale: inv_b }
        }
    })
}

impl<T: Real> SeqWeights<T> {
    /// The weight of each valid token of sequence `i`, which has `c` valid tokens; `None` for
    /// a sequence that contributes nothing (an empty one under a per-sequence mean).
    fn of(self, i: usize, c: usize, rule: Denominator<T>) -> Option<T> {
        match self {
            SeqWeights::Uniform(w) => Some(w),
            // c > 0 here, so the count rule cannot fail; Strict rejected empty rows in `plan`
            // unless they are left out (`SeqCount::NonEmpty`).
            SeqWeights::PerSequence { scale } if c > 0 => {
                inv_count(c, rule, Error::EmptySegment { segment: i })
                    .ok()
                    .map(|inv| inv * scale)
            }
            SeqWeights::PerSequence { .. } => None,
        }
    }
}

/// The weight `a_i` that [`aggregate`] gives every valid token of sequence `i`, written to
/// `out[i]` \[ours\]. An empty sequence has no token to weigh: under `SeqMeanTokenMean` its
/// entry is 0, under the other modes the mode's one weight (e.g. verl's seq-mean-token-sum on
/// rows with 2, 0 and 1 valid tokens gives `[0.5, 0.5, 0.5]`). For a backend that
/// applies the weights itself (grpo-wgpu's aggregation), so that it has grpo-core's bits
/// and errors without a second copy of the rules.
///
/// `n` is the length of the per-token arrays `tokens` describes.
///
/// # Errors
/// Layout errors against `n`, `LengthMismatch{what: "sequence weights"}` unless `out.len()`
/// is the number of sequences, then [`aggregate`]'s parameter and zero-denominator errors in
/// its order (the values are not read, so no `NonFinite`). `out` untouched on `Err`.
///
/// ```
/// use grpo_core::aggregate::{AggConfig, AggMode, sequence_weights};
/// use grpo_core::{Preset, Tokens};
/// // Rows with 2, 0 and 1 valid tokens: verl's seq-mean-token-mean counts the two
/// // non-empty rows, B = 2: weights 1/(2·2), 0, 1/(2·1).
/// let m = [true, true, false, false, true, false];
/// let tok = Tokens::padded(3, 2, Some(&m));
/// let cfg = AggConfig::<f64>::from_preset(Preset::Verl, AggMode::SeqMeanTokenMean);
/// let mut w = [0.0; 3];
/// sequence_weights(&cfg, tok, 6, &mut w).unwrap();
/// assert_eq!(w, [0.25, 0.0, 0.5]);
/// ```
pub fn sequence_weights<T: Real>(
    cfg: &AggConfig<T>,
    tokens: Tokens<'_>,
    n: usize,
    out: &mut [T],
) -> Result<()> {
    let b = tokens.validate(n)?;
    check_len("sequence weights", b, out.len())?;
    check_eps(cfg)?;
    let sw = plan(cfg, &tokens, b)?;
    for (i, o) in out.iter_mut().enumerate() {
        *o = sw
            .of(i, tokens.valid_count(i), cfg.denominator)
            .unwrap_or(T::ZERO);
    }
    Ok(())
}

/// Aggregates per-token losses into a scalar and writes the per-token weights (see the
/// [module table](self)): `loss = Σ_t w_t·values[t]` (computed in the formula's own nesting:
/// per-sequence sums first), `weights[t] = 0` at invalid positions.
///
/// # Errors
/// Length/layout mismatches; [`Error::NonFinite`] for a non-finite value at a valid position;
/// [`Error::InvalidParam`] for `processes == 0`, a non-finite or non-positive `PlusEps`;
/// zero denominators as the [`Denominator`] rule says, with the sequences [`SeqCount`] counts;
/// [`Error::NonFinite`]
/// (`what = "aggregated loss"`) if the scalar overflows. `weights` untouched on `Err`.
///
/// # Example
/// ```
/// use grpo_core::aggregate::{AggConfig, AggMode, aggregate};
/// use grpo_core::{Preset, Tokens};
/// // Two rows of width 3: row 0 has 2 valid tokens (1, 3), row 1 has 1 valid token (5).
/// let v = [1.0, 3.0, f64::NAN, 5.0, f64::NAN, f64::NAN];
/// let m = [true, true, false, true, false, false];
/// let tok = Tokens::padded(2, 3, Some(&m));
/// let mut w = [0.0; 6];
/// // token-mean: (1 + 3 + 5)/3 = 3.
/// assert_eq!(aggregate(&AggConfig::default(), tok, &v, &mut w).unwrap(), 3.0);
/// assert_eq!(w, [1.0 / 3.0, 1.0 / 3.0, 0.0, 1.0 / 3.0, 0.0, 0.0]);
/// // seq-mean-token-mean: ((1 + 3)/2 + 5/1)/2 = 3.5.
/// let cfg = AggConfig::from_preset(Preset::Verl, AggMode::SeqMeanTokenMean);
/// assert_eq!(aggregate(&cfg, tok, &v, &mut w).unwrap(), 3.5);
/// // Dr. GRPO: 9/(2·3) = 1.5; verl's variant: 9/3 = 3.
/// let dr = AggMode::SeqMeanTokenSumNorm { max_len: None, divide_by_batch: true };
/// assert_eq!(aggregate(&AggConfig::from_preset(Preset::Paper, dr), tok, &v, &mut w).unwrap(), 1.5);
/// assert_eq!(aggregate(&AggConfig::from_preset(Preset::Verl, dr), tok, &v, &mut w).unwrap(), 3.0);
/// // A third, empty row: verl's seq-mean-token-sum divides by the 2 non-empty rows (4.5),
/// // TRL's by all 3 rows (3).
/// let m3 = [true, true, false, true, false, false, false, false, false];
/// let v3 = [1.0, 3.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0];
/// let tok3 = Tokens::padded(3, 3, Some(&m3));
/// let mut w3 = [0.0; 9];
/// let sum = AggMode::SeqMeanTokenSum;
/// assert_eq!(aggregate(&AggConfig::from_preset(Preset::Verl, sum), tok3, &v3, &mut w3), Ok(4.5));
/// assert_eq!(aggregate(&AggConfig::from_preset(Preset::Trl, sum), tok3, &v3, &mut w3), Ok(3.0));
/// ```
pub fn aggregate<T: Real>(
    cfg: &AggConfig<T>,
    tokens: Tokens<'_>,
    values: &[T],
    weights: &mut [T],
) -> Result<T> {
    let n = values.len();
    let b = tokens.validate(n)?;
    check_len("weights", n, weights.len())?;
    check_eps(cfg)?;
    if let Some(index) = tokens.first_non_finite(values) {
        return Err(Error::NonFinite {
            what: "values",
            index,
        });
    }
    let sw = plan(cfg, &tokens, b)?;
    let rule = cfg.denominator;
    // Pass 1: the scalar (refused if it overflows); pass 2: the weights.
    let mut loss = T::ZERO;
    for i in 0..b {
        let mut s = T::ZERO;
        let mut c = 0usize;
        for t in tokens.valid_positions(i) {
            s += values[t];
            c += 1;
        }
        if let Some(w) = sw.of(i, c, rule) {
            loss += s * w;
        }
    }
    if !loss.is_finite() {
        return Err(Error::NonFinite {
            what: "aggregated loss",
            index: 0,
        });
    }
    weights.fill(T::ZERO);
    for i in 0..b {
        if let Some(w) = sw.of(i, tokens.valid_count(i), rule) {
            for t in tokens.valid_positions(i) {
                weights[t] = w;
            }
        }
    }
    Ok(loss)
}

/// Multiplies per-token loss gradients in place by the aggregation weights, giving the gradient
/// of the aggregated scalar: `grad[t] *= w_t` for [`LossLevel::Token`], `grad[t] *= Σ_{s∈i} w_s`
/// (the weight mass of the token's sequence) for [`LossLevel::Sequence`]. Invalid positions are
/// set to 0 (their gradients are not read).
///
/// The sequence mass is summed in index order over the sequence's valid positions. Finite
/// weights can have an infinite mass, and a finite factor times a finite gradient can overflow:
/// [`aggregate`] with `Denominator::PlusEps(ε)` and a zero token count writes weights `1/ε`,
/// about `5.6e307` for `ε = 1.8e-308`, and four of them sum to `+∞`. The result is therefore
/// checked before anything is written.
///
/// # Errors
/// Length/layout mismatches; [`Error::NonFinite`] (`what = "scaled gradient"`, `index` = the
/// first position in index order) if a valid position's result `grad[t]·factor` is not finite,
/// which also covers a non-finite input gradient or a non-finite weight or mass at a valid
/// position. `grad` untouched on `Err`.
///
/// # Example
/// ```
/// use grpo_core::aggregate::scale_gradients;
/// use grpo_core::loss::LossLevel;
/// use grpo_core::Tokens;
/// let tok = Tokens::padded(1, 2, None);
/// let w = [0.25, 0.25];
/// let mut g = [2.0, 4.0];
/// scale_gradients(tok, &w, LossLevel::Token, &mut g).unwrap();
/// assert_eq!(g, [0.5, 1.0]);
/// let mut g = [2.0, 4.0];
/// scale_gradients(tok, &w, LossLevel::Sequence, &mut g).unwrap();
/// assert_eq!(g, [1.0, 2.0]); // × (0.25 + 0.25)
/// ```
pub fn scale_gradients<T: Real>(
    tokens: Tokens<'_>,
    weights: &[T],
    level: LossLevel,
    grad: &mut [T],
) -> Result<()> {
    let n = grad.len();
    let b = tokens.validate(n)?;
    check_len("weights", n, weights.len())?;
    // Sequence-level: the weight mass of sequence i; token-level: None (each token's own weight).
    let mass = |i: usize| match level {
        LossLevel::Token => None,
        LossLevel::Sequence => {
            let mut s = T::ZERO;
            for t in tokens.valid_positions(i) {
                s += weights[t];
            }
            Some(s)
        }
    };
    // Pass 1 checks every result (no allocation in this crate, so pass 2 recomputes the masses
    // in the same order and gets the same bits); pass 2 writes.
    for i in 0..b {
        let m = mass(i);
        for t in tokens.valid_positions(i) {
            if !(grad[t] * m.unwrap_or(weights[t])).is_finite() {
                return Err(Error::NonFinite {
                    what: "scaled gradient",
                    index: t,
                });
            }
        }
    }
    for i in 0..b {
        let m = mass(i);
        for t in tokens.span(i) {
            grad[t] = if tokens.is_valid(t) {
                grad[t] * m.unwrap_or(weights[t])
            } else {
                T::ZERO
            };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_masked_batch() {
        let v = [f64::NAN; 4];
        let m = [false; 4];
        let tok = Tokens::padded(2, 2, Some(&m));
        let mut w = [7.0; 4];
        assert_eq!(
            aggregate(&AggConfig::default(), tok, &v, &mut w),
            Err(Error::NoValidTokens)
        );
        assert_eq!(w, [7.0; 4]);
        let trl = AggConfig::from_preset(Preset::Trl, AggMode::Bnpo);
        assert_eq!(aggregate(&trl, tok, &v, &mut w), Ok(0.0));
        assert_eq!(w, [0.0; 4]);
        let smtm = AggConfig::from_preset(Preset::Paper, AggMode::SeqMeanTokenMean);
        let mut w = [7.0; 4];
        assert_eq!(
            aggregate(&smtm, tok, &v, &mut w),
            Err(Error::EmptySegment { segment: 0 })
        );
        assert_eq!(w, [7.0; 4]);
        // verl counts the non-empty sequences: none, 0/0 in verl, NoValidTokens here, for
        // every mean over sequences (an all-masked batch is no error under `All`, where
        // B = 2 rows of token sums 0 give 0, as torch.mean over the rows does).
        for mode in [
            AggMode::SeqMeanTokenMean,
            AggMode::SeqMeanTokenSum,
            AggMode::Luspo,
        ] {
            let verl = AggConfig::from_preset(Preset::Verl, mode);
            assert_eq!(aggregate(&verl, tok, &v, &mut w), Err(Error::NoValidTokens));
            assert_eq!(w, [7.0; 4]);
            let mut ws = [7.0; 2];
            assert_eq!(
                sequence_weights(&verl, tok, 4, &mut ws),
                Err(Error::NoValidTokens)
            );
            assert_eq!(ws, [7.0; 2]);
        }
        let all = AggConfig::from_preset(Preset::Paper, AggMode::SeqMeanTokenSum);
        assert_eq!(aggregate(&all, tok, &v, &mut w), Ok(0.0));
    }

    #[test]
    fn verl_counts_the_non_empty_sequences() {
        // Rows (1, 3), (), (5, 7): verl's agg_loss masks the empty row out of its sequence
        // means (seq_mask.sum() = 2), torch.mean over the rows does not (B = 3).
        let v = [1.0f64, 3.0, 0.0, 0.0, 5.0, 7.0];
        let m = [true, true, false, false, true, true];
        let tok = Tokens::padded(3, 2, Some(&m));
        let mut w = [0.0; 6];
        let cases = [
            // seq-mean-token-sum: (4 + 12)/2 = 8 (verl), /3 (all rows).
            (AggMode::SeqMeanTokenSum, 8.0, 16.0 / 3.0),
            // seq-mean-token-mean: (2 + 6)/2 = 4 (verl), /3; the Paper preset is strict on
            // the empty row, so `All` is checked with ClampOne (TRL's grpo).
            (AggMode::SeqMeanTokenMean, 4.0, 8.0 / 3.0),
            (AggMode::Luspo, 8.0, 16.0 / 3.0),
            // Dr. GRPO ÷(B·L) with B the non-empty rows (SeqCount applies wherever B does;
            // the Verl preset itself forces verl's ÷L without B).
            (
                AggMode::SeqMeanTokenSumNorm {
                    max_len: Some(4),
                    divide_by_batch: true,
                },
                2.0,
                16.0 / 12.0,
            ),
        ];
        for (mode, verl, all) in cases {
            let non_empty = AggConfig {
                mode,
                denominator: Denominator::Strict,
                sequences: SeqCount::NonEmpty,
            };
            assert_eq!(aggregate(&non_empty, tok, &v, &mut w), Ok(verl), "{mode:?}");
            assert_eq!((w[2], w[3]), (0.0, 0.0));
            let every = AggConfig {
                mode,
                denominator: Denominator::ClampOne,
                sequences: SeqCount::All,
            };
            let got = aggregate(&every, tok, &v, &mut w).unwrap();
            assert!((got - all).abs() < 1e-15, "{mode:?}: {got}");
        }
        // The Verl preset is NonEmpty.
        let cfg = AggConfig::from_preset(Preset::Verl, AggMode::SeqMeanTokenMean);
        assert_eq!(cfg.sequences, SeqCount::NonEmpty);
        assert_eq!(aggregate(&cfg, tok, &v, &mut w), Ok(4.0));
        assert_eq!(w, [0.25, 0.25, 0.0, 0.0, 0.25, 0.25]);
        let mut ws = [9.0; 3];
        sequence_weights(&cfg, tok, 6, &mut ws).unwrap();
        assert_eq!(ws, [0.25, 0.0, 0.25]);
        // sequence_weights checks the layout and its own length first.
        let mut short = [9.0; 2];
        assert!(sequence_weights(&cfg, tok, 6, &mut short).is_err());
        assert!(sequence_weights(&cfg, tok, 5, &mut ws).is_err());
        assert_eq!((short, ws), ([9.0; 2], [0.25, 0.0, 0.25]));
    }

    #[test]
    fn overflowing_scalar_is_refused() {
        // 1e308 + 1e308 overflows f64 under token-sum modes: Err, weights untouched.
        let v = [1e308f64, 1e308];
        let mut w = [7.0; 2];
        let cfg = AggConfig::<f64> {
            mode: AggMode::SeqMeanTokenSum,
            denominator: Denominator::Strict,
            sequences: SeqCount::All,
        };
        assert_eq!(
            aggregate(&cfg, Tokens::padded(1, 2, None), &v, &mut w),
            Err(Error::NonFinite {
                what: "aggregated loss",
                index: 0
            })
        );
        assert_eq!(w, [7.0; 2]);
    }

    #[test]
    fn overflowing_sequence_mass_is_refused() {
        // The aggregate fuzz target's find: a global token count of 0 under PlusEps(1.8e-308)
        // gives finite weights 1/ε ≈ 5.56e307 and a finite loss ≈ 1.67e308, but the sequence's
        // mass 4/ε overflows.
        let v = [9e-44f64, 1.0, 1.0, 1.0];
        let tok = Tokens::padded(1, 4, None);
        let cfg = AggConfig {
            mode: AggMode::TokenMean {
                global_tokens: Some(0),
            },
            denominator: Denominator::PlusEps(1.8e-308),
            sequences: SeqCount::All,
        };
        let mut w = [0.0; 4];
        let loss = aggregate(&cfg, tok, &v, &mut w).unwrap();
        let inv_eps = 1.0 / 1.8e-308;
        assert_eq!(w, [inv_eps; 4]);
        assert!(loss.is_finite() && loss > 1.6e308);
        let mut g = [1.0f64; 4];
        assert_eq!(
            scale_gradients(tok, &w, LossLevel::Sequence, &mut g),
            Err(Error::NonFinite {
                what: "scaled gradient",
                index: 0,
            })
        );
        assert_eq!(g, [1.0; 4]);
        // Token level: each factor is one finite weight.
        scale_gradients(tok, &w, LossLevel::Token, &mut g).unwrap();
        assert_eq!(g, [inv_eps; 4]);
    }

    #[test]
    fn overflowing_or_non_finite_gradient_is_refused_where_valid() {
        let m = [true, false, true, true];
        let tok = Tokens::padded(2, 2, Some(&m));
        let w = [1e10f64, 0.0, 1e10, 1e10];
        // 1e300 · 1e10 overflows at position 3 (the first valid position with that result).
        let mut g = [1.0, f64::NAN, 2.0, 1e300];
        assert_eq!(
            scale_gradients(tok, &w, LossLevel::Token, &mut g),
            Err(Error::NonFinite {
                what: "scaled gradient",
                index: 3,
            })
        );
        assert_eq!([g[0], g[2], g[3]], [1.0, 2.0, 1e300]);
        assert!(g[1].is_nan());
        // A NaN input gradient at a valid position is refused too.
        let mut g = [1.0, 0.0, f64::NAN, 1.0];
        assert_eq!(
            scale_gradients(tok, &w, LossLevel::Sequence, &mut g),
            Err(Error::NonFinite {
                what: "scaled gradient",
                index: 2,
            })
        );
        // The invalid position's NaN is not read: it becomes 0.
        let mut g = [1.0, f64::NAN, 2.0, 3.0];
        scale_gradients(tok, &w, LossLevel::Sequence, &mut g).unwrap();
        assert_eq!(g, [1e10, 0.0, 4e10, 6e10]);
    }

    #[test]
    fn dapo_uses_global_count_per_process() {
        // Σ = 6 over local tokens, global 12 tokens over 2 processes → 6 / (12/2) = 1.
        let v = [1.0f64, 2.0, 3.0];
        let tok = Tokens::padded(1, 3, None);
        let mut w = [0.0; 3];
        let cfg = AggConfig::from_preset(
            Preset::Trl,
            AggMode::Dapo {
                global_tokens: 12,
                processes: 2,
            },
        );
        assert_eq!(aggregate(&cfg, tok, &v, &mut w), Ok(1.0));
        assert_eq!(w, [1.0 / 6.0; 3]);
    }
}
