//! Token selection: the top-entropy-quantile mask \[TRL\] (after "Beyond the 80/20 rule",
//! arXiv 2506.01939: train only on the highest-entropy "forking" tokens).

use crate::error::{Error, Result, check_len, ensure};
use crate::layout::Tokens;

/// Scratch elements [`top_entropy_mask`] needs for per-token arrays of length `n`: `n`
/// (at most one per valid token).
pub const fn top_entropy_scratch_len(n: usize) -> usize {
    n
}

/// `torch.quantile(v, q)` with the default `interpolation="linear"`, in f32, over `values`
/// (reordered in place; must be non-empty and NaN-free).
///
/// torch's rule: rank = q·(n − 1) (in f32), below = ⌊rank⌋, above = ⌈rank⌉,
/// w = rank − below, result = lerp(v_below, v_above, w) with torch's two-sided lerp
/// (`a + w·(b − a)` for w < 0.5, `b − (b − a)·(1 − w)` otherwise), on the sorted values.
fn quantile_linear(values: &mut [f32], q: f32) -> f32 {
    let n = values.len();
    let rank = q * (n - 1) as f32;
    // rank ∈ [0, n − 1] for q ∈ [0, 1]; the `min` guards the cast against rounding.
    let below = (rank as usize).min(n - 1);
    let above = (libm::ceilf(rank) as usize).min(n - 1);
    let w = rank - below as f32;
    let (_, v_below, rest) = values.select_nth_unstable_by(below, f32::total_cmp);
    let v_below = *v_below;
    let v_above = if above > below {
        // The (below+1)-th smallest is the minimum of the part after `below`.
        rest.iter()
            .copied()
            .fold(f32::INFINITY, |m, x| if x < m { x } else { m })
    } else {
        v_below
    };
    if w < 0.5 {
        v_below + w * (v_above - v_below)
    } else {
        v_above - (v_above - v_below) * (1.0 - w)
    }
}

/// TRL's high-entropy token mask: threshold = quantile(H over valid tokens, 1 − ρ) with
/// torch's linear interpolation (see below), computed in f32; `keep[t] = true` iff t is valid
/// and H_t ≥ threshold. Returns the threshold.
///
/// ρ is TRL's `top_entropy_quantile` (the fraction of tokens to keep: ρ = 1 keeps every valid
/// token, ρ = 0.2 the top 20 %). q = 1 − ρ is formed in f64 and rounded to f32, as TRL passes a
/// Python float that torch turns into an f32 scalar. torch.quantile, `linear`: with the n valid
/// entropies sorted ascending, rank = q·(n − 1), result = lerp(v_⌊rank⌋, v_⌈rank⌉,
/// rank − ⌊rank⌋). Ties at the threshold are kept (`>=`), so more than ρ·n tokens can survive.
/// With no valid token nothing is kept and the threshold is +∞ (torch would fail on an empty
/// tensor). `scratch` needs [`top_entropy_scratch_len`]`(n)` elements; its contents on return
/// are unspecified.
///
/// # Errors
/// [`Error::LengthMismatch`] for `keep`, layout errors, [`Error::ScratchTooSmall`],
/// [`Error::NonFinite`] for a NaN/±∞ entropy at a valid position, [`Error::InvalidParam`]
/// unless 0 ≤ ρ ≤ 1. On `Err`, `keep` is untouched.
///
/// # Example
/// ```
/// use grpo_core::Tokens;
/// use grpo_core::selection::{top_entropy_mask, top_entropy_scratch_len};
/// let h = [0.1f32, 2.0, 0.5, f32::NAN, 1.0];
/// let mask = [true, true, true, false, true];
/// let mut scratch = [0.0f32; top_entropy_scratch_len(5)];
/// let mut keep = [false; 5];
/// // Valid sorted: [0.1, 0.5, 1.0, 2.0]; ρ = 0.5 → q = 0.5, rank = 1.5 → 0.5 + 0.5·(1.0 − 0.5)
/// // (lerp's second form: 1.0 − 0.5·0.5) = 0.75.
/// let thr = top_entropy_mask(&h, &Tokens::padded(1, 5, Some(&mask)), 0.5, &mut scratch, &mut keep).unwrap();
/// assert_eq!(thr, 0.75);
/// assert_eq!(keep, [false, true, false, false, true]);
/// ```
pub fn top_entropy_mask(
    entropies: &[f32],
    tokens: &Tokens<'_>,
    rho: f32,
    scratch: &mut [f32],
    keep: &mut [bool],
) -> Result<f32> {
    ensure(
        (0.0..=1.0).contains(&rho),
        "top_entropy_quantile",
        "must be in [0, 1]",
    )?;
    let n = entropies.len();
    check_len("keep", n, keep.len())?;
    tokens.validate(n)?;
    let needed = top_entropy_scratch_len(n);
    if scratch.len() < needed {
        return Err(Error::ScratchTooSmall {
            needed,
            found: scratch.len(),
        });
    }
    if let Some(index) = tokens.first_non_finite(entropies) {
        return Err(Error::NonFinite {
            what: "entropies",
            index,
        });
    }
    let mut count = 0;
    for s in 0..tokens.num_sequences() {
        for t in tokens.valid_positions(s) {
            scratch[count] = entropies[t];
            count += 1;
        }
    }
    keep.fill(false);
    if count == 0 {
        return Ok(f32::INFINITY);
    }
    let q = (1.0 - f64::from(rho)) as f32;
    let threshold = quantile_linear(&mut scratch[..count], q);
    for s in 0..tokens.num_sequences() {
        for t in tokens.valid_positions(s) {
            keep[t] = entropies[t] >= threshold;
        }
    }
    Ok(threshold)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_matches_torch_rule() {
        // [1, 2, 3, 4, 5]: q = 0.3 → rank 1.2 → 2 + 0.2·(3 − 2) = 2.2 (first lerp form).
        let mut v = [5.0f32, 3.0, 1.0, 4.0, 2.0];
        assert!((quantile_linear(&mut v, 0.3) - 2.2).abs() < 1e-6);
        // q = 0 → min, q = 1 → max, single element → itself.
        let mut v = [5.0f32, 3.0, 1.0, 4.0, 2.0];
        assert_eq!(quantile_linear(&mut v, 0.0), 1.0);
        assert_eq!(quantile_linear(&mut v, 1.0), 5.0);
        assert_eq!(quantile_linear(&mut [7.0f32], 0.4), 7.0);
    }

    #[test]
    fn rho_one_keeps_everything_rho_zero_keeps_the_max() {
        let h = [0.3f32, 0.1, 0.9, 0.9];
        let t = Tokens::padded(2, 2, None);
        let mut s = [0.0f32; 4];
        let mut keep = [false; 4];
        assert_eq!(
            top_entropy_mask(&h, &t, 1.0, &mut s, &mut keep).unwrap(),
            0.1
        );
        assert_eq!(keep, [true; 4]);
        assert_eq!(
            top_entropy_mask(&h, &t, 0.0, &mut s, &mut keep).unwrap(),
            0.9
        );
        assert_eq!(keep, [false, false, true, true]);
    }

    #[test]
    fn errors_and_empty() {
        let t = Tokens::padded(1, 2, Some(&[false, false]));
        let mut s = [0.0f32; 2];
        let mut keep = [true; 2];
        assert_eq!(
            top_entropy_mask(&[f32::NAN, 1.0], &t, 0.5, &mut s, &mut keep).unwrap(),
            f32::INFINITY
        );
        assert_eq!(keep, [false; 2]);
        let all = Tokens::padded(1, 2, None);
        // Both sentinels: whatever a call would write, one of them shows it.
        for sentinel in [true, false] {
            let (mut s, mut keep) = ([7.0f32; 2], [sentinel; 2]);
            assert!(top_entropy_mask(&[f32::NAN, 1.0], &all, 0.5, &mut s, &mut keep).is_err());
            assert!(top_entropy_mask(&[0.0, 1.0], &all, 1.5, &mut s, &mut keep).is_err());
            assert!(top_entropy_mask(&[0.0, 1.0], &all, 0.5, &mut s[..1], &mut keep).is_err());
            assert!(top_entropy_mask(&[0.0, 1.0], &all, 0.5, &mut s, &mut keep[..1]).is_err());
            assert_eq!((s, keep), ([7.0; 2], [sentinel; 2]));
        }
    }
}
