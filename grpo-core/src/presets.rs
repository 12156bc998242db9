//! Named presets: which peer's semantics a config reproduces (MATH.md §6).
//!
//! A preset copies a peer's ε placement, std floor, Bessel choice, singleton rule, clamps and
//! aggregation constants; it does not copy rounding defects (MATH.md §0). Each config struct
//! offers `from_preset(Preset)`, and its rustdoc lists what differs between the presets.

/// Whose semantics to reproduce. Commit hashes are the versions MATH.md §6 was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Preset {
    /// The method's paper (and this library's defaults where the paper is silent).
    #[default]
    Paper,
    /// verl (b178a3cd), loop implementations (`compute_grpo_outcome_advantage` and friends).
    Verl,
    /// verl (b178a3cd), vectorized implementations (`*_vectorized`), where they differ from the
    /// loop ones (std floor, singleton groups).
    VerlVectorized,
    /// TRL (f2cd577).
    Trl,
    /// OpenRLHF (3c3be62).
    OpenRlhf,
}
