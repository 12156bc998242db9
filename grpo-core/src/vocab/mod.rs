//! Vocabulary-wide reductions over logit rows (MATH.md §5).
//!
//! Not implemented yet: arrives with the vocabulary-kernels issue.
