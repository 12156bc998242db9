//! Vocabulary-wide reductions over logit rows (MATH.md §5).

pub mod canon;
pub mod exp_ln;

pub use canon::Logit;
