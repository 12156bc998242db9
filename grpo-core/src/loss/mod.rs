//! Per-token policy losses with exact gradients (MATH.md §4).
//!
//! Not implemented yet: arrives with the divergences-and-losses issue.
