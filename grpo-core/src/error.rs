//! The single error type of grpo-core.
//!
//! Every fallible operation validates *all* of its inputs before it writes a single output
//! element: when an `Err` comes back, every caller buffer is exactly as it was. Variants carry
//! the index (sample, token, group, row) that failed so a caller can point at the bad datum.

use core::fmt;

/// Result alias used by every fallible grpo-core operation.
pub type Result<T> = core::result::Result<T, Error>;

/// Why an operation refused its input.
///
/// The enum is `#[non_exhaustive]`: later operations add variants without a breaking change.
/// `what` fields name the argument (`"rewards"`, `"out"`, `"mask"`…) so messages are specific.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// A slice has the wrong length.
    LengthMismatch {
        /// The argument whose length is wrong.
        what: &'static str,
        /// The length the other arguments imply.
        expected: usize,
        /// The length that was passed.
        found: usize,
    },
    /// A caller-provided scratch buffer is too short (see the operation's `scratch_len`).
    ScratchTooSmall {
        /// Elements needed.
        needed: usize,
        /// Elements provided.
        found: usize,
    },
    /// A value that must be finite is NaN or ±∞ (or NaN where the NaN policy forbids it).
    NonFinite {
        /// The argument holding the value.
        what: &'static str,
        /// Its index in that argument.
        index: usize,
    },
    /// A group has no member (or no member left after excluding unscorable samples where a
    /// statistic needs at least one).
    EmptyGroup {
        /// The group's index.
        group: usize,
    },
    /// A group is smaller than the estimator needs (GOPO and pass@k need two samples).
    GroupTooSmall {
        /// The group's index.
        group: usize,
        /// Members needed.
        needed: usize,
        /// Members present.
        found: usize,
    },
    /// CSR offsets are not valid: they must start at 0, never decrease, and end at the number of
    /// elements. `index` is the first offset that breaks the rule.
    InvalidOffsets {
        /// Index into the offsets slice.
        index: usize,
    },
    /// A per-sample group id is not below the number of groups.
    GroupIdOutOfRange {
        /// The sample's index.
        index: usize,
        /// The id found there.
        id: usize,
        /// The number of groups.
        groups: usize,
    },
    /// A token id is not below the vocabulary size.
    TokenOutOfRange {
        /// The row (or token position) whose target is bad.
        index: usize,
        /// The token id found.
        token: usize,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A sequence or row has no valid element where the operation needs one (an all-masked
    /// segment under a mean, a logit row that is entirely −∞).
    EmptySegment {
        /// The segment's (sequence's, row's) index.
        segment: usize,
    },
    /// No valid token in the whole batch where a mean over tokens is required.
    NoValidTokens,
    /// A parameter is outside its domain.
    InvalidParam {
        /// The parameter's name as it appears in the config struct.
        name: &'static str,
        /// The rule it breaks, e.g. `"must be > 0"`.
        reason: &'static str,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Error::LengthMismatch {
                what,
                expected,
                found,
            } => write!(
                f,
                "length mismatch: `{what}` has {found} elements, expected {expected}"
            ),
            Error::ScratchTooSmall { needed, found } => write!(
                f,
                "scratch buffer too small: {found} elements given, {needed} needed"
            ),
            Error::NonFinite { what, index } => {
                write!(f, "non-finite value in `{what}` at index {index}")
            }
            Error::EmptyGroup { group } => write!(f, "group {group} has no member"),
            Error::GroupTooSmall {
                group,
                needed,
                found,
            } => write!(
                f,
                "group {group} has only {found} member(s), this estimator needs at least {needed}"
            ),
            Error::InvalidOffsets { index } => write!(
                f,
                "invalid offsets at index {index}: offsets must start at 0, never decrease and end at the element count"
            ),
            Error::GroupIdOutOfRange { index, id, groups } => write!(
                f,
                "group id {id} of sample {index} is out of range (there are {groups} groups)"
            ),
            Error::TokenOutOfRange {
                index,
                token,
                vocab,
            } => write!(
                f,
                "token id {token} at index {index} is out of range for a vocabulary of {vocab}"
            ),
            Error::EmptySegment { segment } => {
                write!(f, "segment {segment} has no valid element")
            }
            Error::NoValidTokens => write!(f, "the batch has no valid (unmasked) token"),
            Error::InvalidParam { name, reason } => {
                write!(f, "invalid parameter `{name}`: {reason}")
            }
        }
    }
}

impl core::error::Error for Error {}

/// Returns `Err(LengthMismatch)` unless `found == expected`.
#[inline]
pub(crate) fn check_len(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            what,
            expected,
            found,
        })
    }
}

/// Returns `Err(InvalidParam)` unless `ok`.
#[inline]
pub(crate) fn ensure(ok: bool, name: &'static str, reason: &'static str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidParam { name, reason })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_the_argument_and_index() {
        extern crate std;
        use std::string::ToString;
        let e = Error::LengthMismatch {
            what: "out",
            expected: 4,
            found: 3,
        };
        assert_eq!(
            e.to_string(),
            "length mismatch: `out` has 3 elements, expected 4"
        );
        let e = Error::NonFinite {
            what: "rewards",
            index: 7,
        };
        assert_eq!(e.to_string(), "non-finite value in `rewards` at index 7");
    }

    #[test]
    fn helpers_return_the_right_variant() {
        assert_eq!(check_len("x", 2, 2), Ok(()));
        assert_eq!(
            check_len("x", 2, 3),
            Err(Error::LengthMismatch {
                what: "x",
                expected: 2,
                found: 3
            })
        );
        assert_eq!(
            ensure(false, "eps", "must be >= 0"),
            Err(Error::InvalidParam {
                name: "eps",
                reason: "must be >= 0"
            })
        );
    }
}
