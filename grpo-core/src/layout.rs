//! Batch layouts: how samples form groups, and how tokens form sequences.
//!
//! **Groups.** A *group* is the G rollouts of one prompt. Trainers store them three ways, all
//! accepted through [`Groups`]:
//! - [`Groups::Uniform`]`(g)`: consecutive runs of `g` samples (TRL, OpenRLHF, verl after
//!   `repeat_interleave`);
//! - [`Groups::Offsets`]: CSR offsets, group `k` = samples `offsets[k]..offsets[k+1]`
//!   (variable group sizes, e.g. after filtering);
//! - [`Groups::from_group_ids`]: verl's per-sample `index` array, in any (shuffled) order,
//!   turned into CSR form in caller scratch by a stable counting sort.
//!
//! **Tokens.** Per-token data is either *packed* (sequences back to back, delimited by
//! `cu_seqlens`-style offsets) or *padded* (`[B, T]` row-major); both may carry a mask
//! (`true` = trained token). Positions outside a sequence or with a `false` mask may hold
//! garbage — even NaN — and no operation ever reads them into a result (verl gets the same
//! guarantee with `where(mask, v, 0)`).

use crate::error::{Error, Result, check_len};
use core::ops::Range;

/// How a batch of samples is partitioned into groups. See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Groups<'a> {
    /// Consecutive groups of this many samples; the sample count must be a multiple of it.
    Uniform(usize),
    /// CSR offsets: `offsets[0] == 0`, non-decreasing, last element == sample count; group `k`
    /// is `offsets[k]..offsets[k+1]`. Empty groups are rejected by the estimators.
    Offsets(&'a [usize]),
    /// Groups whose members are scattered: group `k` is `order[offsets[k]..offsets[k+1]]`.
    /// Built by [`Groups::from_group_ids`].
    Permuted(Permuted<'a>),
}

/// Scattered groups in CSR form over a permutation (see [`Groups::from_group_ids`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permuted<'a> {
    offsets: &'a [usize],
    order: &'a [usize],
}

impl<'a> Groups<'a> {
    /// Scratch elements [`Groups::from_group_ids`] needs for `n` samples in `num_groups` groups.
    pub const fn group_ids_scratch_len(n: usize, num_groups: usize) -> usize {
        n + num_groups + 1
    }

    /// Builds groups from verl's per-sample group-id array (`ids[i]` = group of sample `i`, in
    /// any order) with a stable counting sort into `scratch`, so that within a group the samples
    /// keep their batch order (this fixes tie orders, e.g. GOPO's `ordinal` ranks).
    ///
    /// `scratch` needs [`Groups::group_ids_scratch_len`]`(ids.len(), num_groups)` elements.
    ///
    /// # Errors
    /// [`Error::GroupIdOutOfRange`] if an id is `>= num_groups`, [`Error::EmptyGroup`] if some
    /// id below `num_groups` has no sample, [`Error::ScratchTooSmall`].
    ///
    /// # Example
    /// ```
    /// use grpo_core::layout::Groups;
    /// let ids = [1, 0, 1, 0, 1];
    /// let mut scratch = [0usize; Groups::group_ids_scratch_len(5, 2)];
    /// let groups = Groups::from_group_ids(&ids, 2, &mut scratch).unwrap();
    /// assert_eq!(groups.validate(5).unwrap(), 2);
    /// assert!(groups.members(0).eq([1, 3]));
    /// assert!(groups.members(1).eq([0, 2, 4]));
    /// ```
    pub fn from_group_ids(
        ids: &[usize],
        num_groups: usize,
        scratch: &'a mut [usize],
    ) -> Result<Groups<'a>> {
        let needed = Self::group_ids_scratch_len(ids.len(), num_groups);
        if scratch.len() < needed {
            return Err(Error::ScratchTooSmall {
                needed,
                found: scratch.len(),
            });
        }
        if let Some((index, &id)) = ids.iter().enumerate().find(|(_, id)| **id >= num_groups) {
            return Err(Error::GroupIdOutOfRange {
                index,
                id,
                groups: num_groups,
            });
        }
        let (offsets, rest) = scratch.split_at_mut(num_groups + 1);
        let order = &mut rest[..ids.len()];
        offsets.fill(0);
        for &id in ids {
            offsets[id + 1] += 1;
        }
        if let Some(group) = offsets[1..].iter().position(|&c| c == 0) {
            return Err(Error::EmptyGroup { group });
        }
        for k in 0..num_groups {
            offsets[k + 1] += offsets[k];
        }
        // Scatter with a moving cursor per group; `offsets[k]` is used as group k's cursor and
        // then restored by shifting, so the sort needs no scratch beyond offsets + order.
        for (i, &id) in ids.iter().enumerate() {
            order[offsets[id]] = i;
            offsets[id] += 1;
        }
        for k in (1..=num_groups).rev() {
            offsets[k] = offsets[k - 1];
        }
        offsets[0] = 0;
        Ok(Groups::Permuted(Permuted {
            offsets: &*offsets,
            order: &*order,
        }))
    }

    /// Checks the layout against `n` samples and returns the number of groups.
    ///
    /// # Errors
    /// `Uniform(0)` or `n` not a multiple of the size → [`Error::InvalidParam`];
    /// bad offsets → [`Error::InvalidOffsets`]; a permuted layout built for another `n` →
    /// [`Error::LengthMismatch`]. Empty groups are *not* an error here (estimators decide).
    pub fn validate(&self, n: usize) -> Result<usize> {
        match *self {
            Groups::Uniform(0) => Err(Error::InvalidParam {
                name: "group_size",
                reason: "must be > 0",
            }),
            Groups::Uniform(g) => {
                if n.is_multiple_of(g) {
                    Ok(n / g)
                } else {
                    Err(Error::InvalidParam {
                        name: "group_size",
                        reason: "the sample count must be a multiple of the group size",
                    })
                }
            }
            Groups::Offsets(offsets) => validate_offsets(offsets, n),
            Groups::Permuted(p) => {
                check_len("group ids", p.order.len(), n)?;
                Ok(p.offsets.len() - 1)
            }
        }
    }

    /// Number of groups. Call [`Groups::validate`] first: for an invalid layout this is only a
    /// best effort (it never panics).
    pub fn len(&self, n: usize) -> usize {
        match *self {
            Groups::Uniform(0) => 0,
            Groups::Uniform(g) => n / g,
            Groups::Offsets(o) => o.len().saturating_sub(1),
            Groups::Permuted(p) => p.offsets.len().saturating_sub(1),
        }
    }

    /// Whether there is no group at all.
    pub fn is_empty(&self, n: usize) -> bool {
        self.len(n) == 0
    }

    /// Number of members of group `k` (valid layout, `k < len`).
    pub fn size(&self, k: usize) -> usize {
        match *self {
            Groups::Uniform(g) => g,
            Groups::Offsets(o) => o[k + 1] - o[k],
            Groups::Permuted(p) => p.offsets[k + 1] - p.offsets[k],
        }
    }

    /// The sample indices of group `k`, in batch order (valid layout, `k < len`).
    pub fn members(&self, k: usize) -> Members<'a> {
        match *self {
            Groups::Uniform(g) => Members::Range(k * g..(k + 1) * g),
            Groups::Offsets(o) => Members::Range(o[k]..o[k + 1]),
            Groups::Permuted(p) => Members::List(p.order[p.offsets[k]..p.offsets[k + 1]].iter()),
        }
    }
}

/// Iterator over the sample indices of one group.
#[derive(Debug, Clone)]
pub enum Members<'a> {
    /// Contiguous samples.
    Range(Range<usize>),
    /// Scattered samples.
    List(core::slice::Iter<'a, usize>),
}

impl Iterator for Members<'_> {
    type Item = usize;
    #[inline]
    fn next(&mut self) -> Option<usize> {
        match self {
            Members::Range(r) => r.next(),
            Members::List(l) => l.next().copied(),
        }
    }
    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        match self {
            Members::Range(r) => r.size_hint(),
            Members::List(l) => l.size_hint(),
        }
    }
}

impl ExactSizeIterator for Members<'_> {}

/// Checks CSR offsets over `n` elements; returns the segment count.
pub(crate) fn validate_offsets(offsets: &[usize], n: usize) -> Result<usize> {
    match offsets.first() {
        None => return Err(Error::InvalidOffsets { index: 0 }),
        Some(&first) if first != 0 => return Err(Error::InvalidOffsets { index: 0 }),
        _ => {}
    }
    if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::InvalidOffsets { index: i + 1 });
    }
    if offsets[offsets.len() - 1] != n {
        return Err(Error::InvalidOffsets {
            index: offsets.len() - 1,
        });
    }
    Ok(offsets.len() - 1)
}

/// How per-token arrays are laid out. See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segments<'a> {
    /// Sequences back to back: sequence `i` is `cu_seqlens[i]..cu_seqlens[i+1]`.
    Packed(&'a [usize]),
    /// Row-major `[rows, cols]`; sequence `i` is `i*cols..(i+1)*cols`.
    Padded {
        /// Batch size B.
        rows: usize,
        /// Padded length T.
        cols: usize,
    },
}

/// Per-token layout: segments plus an optional mask (`true` = trained token).
///
/// Without a mask every position inside a segment is valid.
///
/// # Example
/// ```
/// use grpo_core::layout::{Segments, Tokens};
/// let mask = [true, true, false, true, false, false];
/// let tokens = Tokens::padded(2, 3, Some(&mask));
/// assert_eq!(tokens.validate(6).unwrap(), 2);
/// assert!(tokens.valid_positions(0).eq([0, 1]));
/// assert!(tokens.valid_positions(1).eq([3]));
/// assert_eq!(tokens.valid_count(1), 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tokens<'a> {
    /// The sequence boundaries.
    pub segments: Segments<'a>,
    /// Optional validity mask over all positions (same length as the token arrays).
    pub mask: Option<&'a [bool]>,
}

impl<'a> Tokens<'a> {
    /// Packed sequences with `cu_seqlens` offsets.
    pub const fn packed(cu_seqlens: &'a [usize], mask: Option<&'a [bool]>) -> Self {
        Tokens {
            segments: Segments::Packed(cu_seqlens),
            mask,
        }
    }

    /// Padded `[rows, cols]` batch.
    pub const fn padded(rows: usize, cols: usize, mask: Option<&'a [bool]>) -> Self {
        Tokens {
            segments: Segments::Padded { rows, cols },
            mask,
        }
    }

    /// Checks the layout against per-token arrays of length `n`; returns the sequence count.
    ///
    /// # Errors
    /// [`Error::InvalidOffsets`] for bad `cu_seqlens`; [`Error::LengthMismatch`] if
    /// `rows * cols != n` or the mask length differs from `n`.
    pub fn validate(&self, n: usize) -> Result<usize> {
        let seqs = match self.segments {
            Segments::Packed(cu) => validate_offsets(cu, n)?,
            Segments::Padded { rows, cols } => {
                let total = rows.checked_mul(cols).ok_or(Error::InvalidParam {
                    name: "rows * cols",
                    reason: "overflows usize",
                })?;
                check_len("token arrays", total, n)?;
                rows
            }
        };
        if let Some(mask) = self.mask {
            check_len("mask", n, mask.len())?;
        }
        Ok(seqs)
    }

    /// Number of sequences (valid layout).
    pub fn num_sequences(&self) -> usize {
        match self.segments {
            Segments::Packed(cu) => cu.len().saturating_sub(1),
            Segments::Padded { rows, .. } => rows,
        }
    }

    /// Positions of sequence `i` (valid layout, `i < num_sequences`), masked ones included.
    #[inline]
    pub fn span(&self, i: usize) -> Range<usize> {
        match self.segments {
            Segments::Packed(cu) => cu[i]..cu[i + 1],
            Segments::Padded { cols, .. } => i * cols..(i + 1) * cols,
        }
    }

    /// Whether position `t` is a trained token (ignores segment boundaries).
    #[inline]
    pub fn is_valid(&self, t: usize) -> bool {
        self.mask.is_none_or(|m| m[t])
    }

    /// Valid positions of sequence `i`, in order.
    #[inline]
    pub fn valid_positions(&self, i: usize) -> impl Iterator<Item = usize> + Clone + 'a {
        let mask = self.mask;
        self.span(i).filter(move |&t| mask.is_none_or(|m| m[t]))
    }

    /// Number of valid tokens of sequence `i`.
    pub fn valid_count(&self, i: usize) -> usize {
        match self.mask {
            None => self.span(i).len(),
            Some(m) => m[self.span(i)].iter().filter(|&&b| b).count(),
        }
    }

    /// Number of valid tokens in the batch.
    pub fn total_valid(&self) -> usize {
        (0..self.num_sequences()).map(|i| self.valid_count(i)).sum()
    }

    /// Index of the first valid position whose value is not finite, if any (garbage in invalid
    /// positions is allowed and never inspected).
    ///
    /// ```
    /// use grpo_core::Tokens;
    /// // Two rows of width 3; row 0's last position is padding.
    /// let mask = [true, true, false, true, true, true];
    /// let t = Tokens::padded(2, 3, Some(&mask));
    /// // The NaN under the padding is never read; the +∞ at position 4 is the first found.
    /// let v = [0.5f32, 1.0, f32::NAN, 2.0, f32::INFINITY, f32::NAN];
    /// assert_eq!(t.first_non_finite(&v), Some(4));
    /// assert_eq!(t.first_non_finite(&[0.0f32, 1.0, f32::NAN, 2.0, 3.0, 4.0]), None);
    /// ```
    pub fn first_non_finite<T: crate::Real>(&self, values: &[T]) -> Option<usize> {
        (0..self.num_sequences())
            .find_map(|i| self.valid_positions(i).find(|&t| !values[t].is_finite()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_groups() {
        let g = Groups::Uniform(3);
        assert_eq!(g.validate(9), Ok(3));
        assert!(g.members(2).eq([6, 7, 8]));
        assert_eq!(g.size(1), 3);
        assert!(matches!(g.validate(10), Err(Error::InvalidParam { .. })));
        assert!(matches!(
            Groups::Uniform(0).validate(0),
            Err(Error::InvalidParam { .. })
        ));
    }

    #[test]
    fn offsets_are_checked() {
        assert_eq!(Groups::Offsets(&[0, 2, 2, 5]).validate(5), Ok(3));
        assert_eq!(
            Groups::Offsets(&[0, 3, 2, 5]).validate(5),
            Err(Error::InvalidOffsets { index: 2 })
        );
        assert_eq!(
            Groups::Offsets(&[1, 5]).validate(5),
            Err(Error::InvalidOffsets { index: 0 })
        );
        assert_eq!(
            Groups::Offsets(&[0, 4]).validate(5),
            Err(Error::InvalidOffsets { index: 1 })
        );
        assert_eq!(
            Groups::Offsets(&[]).validate(0),
            Err(Error::InvalidOffsets { index: 0 })
        );
    }

    #[test]
    fn group_ids_stable_counting_sort() {
        let ids = [2, 0, 2, 1, 0, 2];
        let mut scratch = [usize::MAX; 10];
        let g = Groups::from_group_ids(&ids, 3, &mut scratch).unwrap();
        assert_eq!(g.validate(6), Ok(3));
        assert!(g.members(0).eq([1, 4]));
        assert!(g.members(1).eq([3]));
        assert!(g.members(2).eq([0, 2, 5]));
        assert_eq!(g.size(2), 3);
        assert!(matches!(g.validate(5), Err(Error::LengthMismatch { .. })));
    }

    #[test]
    fn group_ids_errors() {
        let mut scratch = [0usize; 16];
        assert_eq!(
            Groups::from_group_ids(&[0, 3], 2, &mut scratch),
            Err(Error::GroupIdOutOfRange {
                index: 1,
                id: 3,
                groups: 2
            })
        );
        assert_eq!(
            Groups::from_group_ids(&[0, 0, 2], 3, &mut scratch),
            Err(Error::EmptyGroup { group: 1 })
        );
        let mut small = [0usize; 3];
        assert_eq!(
            Groups::from_group_ids(&[0, 0], 1, &mut small),
            Err(Error::ScratchTooSmall {
                needed: 4,
                found: 3
            })
        );
    }

    #[test]
    fn tokens_packed_and_padded() {
        let cu = [0, 2, 2, 5];
        let mask = [true, false, true, true, false];
        let t = Tokens::packed(&cu, Some(&mask));
        assert_eq!(t.validate(5), Ok(3));
        assert!(t.valid_positions(0).eq([0]));
        assert_eq!(t.valid_count(1), 0);
        assert!(t.valid_positions(2).eq([2, 3]));
        assert_eq!(t.total_valid(), 3);
        assert!(matches!(t.validate(6), Err(Error::InvalidOffsets { .. })));

        let p = Tokens::padded(2, 3, None);
        assert_eq!(p.validate(6), Ok(2));
        assert_eq!(p.span(1), 3..6);
        assert!(matches!(p.validate(5), Err(Error::LengthMismatch { .. })));
        let short = [true; 4];
        assert!(matches!(
            Tokens::padded(2, 3, Some(&short)).validate(6),
            Err(Error::LengthMismatch { what: "mask", .. })
        ));
    }

    #[test]
    fn garbage_in_padding_is_not_inspected() {
        let mask = [true, false, true, false];
        let v = [1.0f32, f32::NAN, 2.0, f32::INFINITY];
        let t = Tokens::padded(2, 2, Some(&mask));
        assert_eq!(t.first_non_finite(&v), None);
        let v2 = [1.0f32, 0.0, f32::NAN, 0.0];
        assert_eq!(t.first_non_finite(&v2), Some(2));
    }
}
