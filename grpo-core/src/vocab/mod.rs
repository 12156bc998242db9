//! Vocabulary-wide reductions over logit rows (MATH.md §5): log-sum-exp, token
//! log-probabilities, entropy, KL and JSD between a student and a teacher row, the fused
//! backward and the JSD's gradient ([`jsd_backward_rows`]) — for one row or a batch of rows
//! `[rows, V]`. The backward either recomputes each
//! row's statistics ([`backward_rows`]) or takes the row states a forward saved
//! ([`logprob_entropy_rows_saved`] or, for distillation, [`kl_rows_saved`] →
//! [`backward_rows_saved`]: one pass over the logits instead of two, the same bits; for the
//! JSD, [`jsd_rows_saved`] → [`jsd_backward_rows_saved`]: one pass instead of three).
//!
//! Logits are stored as `f32`, `half::bf16` or `half::f16` ([`Logit`]) and accumulated in f32.
//! A temperature `T > 0` divides every logit (as a multiplication by τ = 1/T rounded once).
//! −∞ logits are masked vocabulary entries (probability 0); NaN and +∞ are errors.
//!
//! Every result is a function of an exactly specified sequence of IEEE operations:
//! [`exp_ln`] defines the exponential and logarithm (branch-free polynomials with FMA), and
//! [`canon`] the reduction order (blocks of 2048, 16 strided lanes, a fixed pairwise tree, the
//! tail in index order, blocks merged pairwise) and the per-element steps. The SIMD backends of
//! `grpo-cpu` reproduce them bit for bit.
//!
//! Accuracy (tested against an f64 reference at V = 151936 and 262144, logits N(0, 3²) with
//! spikes and masked entries, T ∈ {1, 0.7}): |logp error| ≤ 2e-6 + 1e-6·|logp| (worst measured:
//! 0.1 of that bound), |H error| ≤ 1e-5 (measured ≤ 1.8e-7), KL error ≤ 1e-5 + 1e-6·KL
//! (measured ≤ 2.4e-6), JSD (measured ≤ 4e-7).
//!
//! Errors are checked before anything is written, in a fixed order that every backend
//! reproduces with [`validate`]: temperature (and β), `vocab > 0`, slice lengths, per-row
//! weights and target ids (all rows), then row by row: the student row ([`validate::row`]:
//! NaN/+∞, all −∞ → `EmptySegment`, `max/T` overflow), the teacher row (same), the KL support
//! ([`validate::support`]) and the target ([`validate::target`]). The first failing check
//! is returned. The backwards from saved states check the states ([`validate::saved`], and
//! [`SavedState::check_kl_term`] for a KL term) instead of the rows, which they do not read before writing (see [`backward_rows_saved`]).
//!
//! ```
//! use grpo_core::vocab::{logprob_entropy_rows, row_stats};
//! let logits = [0.5f32, -1.0, 2.0, 0.0, /* row 1 */ 1.0, 1.0, f32::NEG_INFINITY, 1.0];
//! let (mut logp, mut h) = ([0.0f32; 2], [0.0f32; 2]);
//! logprob_entropy_rows(&logits, 4, &[2u32, 0], 1.0, &mut logp, Some(&mut h)).unwrap();
//! // row 1 has three equal unmasked logits: logp = −ln 3, H = ln 3
//! assert!((logp[1] + 3f32.ln()).abs() < 1e-6 && (h[1] - 3f32.ln()).abs() < 1e-6);
//! assert_eq!(row_stats(&logits[..4], 1.0).unwrap().entropy, h[0]);
//! ```

pub mod canon;
pub mod exp_ln;
mod ops;
mod saved;

/// The input checks of the vocabulary operations, public so that other backends reject
/// exactly the same inputs with exactly the same errors (same order: temperature, lengths,
/// targets, then row by row).
pub mod validate {
    pub use super::ops::{
        backward, backward_args, gradient_temperature, inverse_temperature, jsd_backward_args, row,
        support, target, weights,
    };
    pub use super::saved::{backward_saved, jsd_backward_saved, jsd_saved, saved};
}

pub use canon::{Logit, LseState, PairState};
pub use ops::{
    GradTerms, KlDirection, KlTerm, MAX_GRAD_WEIGHT, MIN_GRAD_TEMPERATURE, RowStats, TokenId,
    backward_rows, backward_rows_in_place, entropy, jsd, jsd_backward_rows,
    jsd_backward_rows_in_place, jsd_rows, jsd_rows_saved, kl_divergence, kl_rows, kl_rows_saved,
    log_sum_exp, logprob_entropy, logprob_entropy_rows, logprob_entropy_rows_saved, row_stats,
    stats_rows, token_logprob,
};
pub use saved::{
    JsdState, MAX_SAVED_ENTROPY, MAX_SAVED_KL, SavedState, backward_rows_in_place_saved,
    backward_rows_saved, jsd_backward_rows_in_place_saved, jsd_backward_rows_saved,
};

#[cfg(test)]
mod tests;
