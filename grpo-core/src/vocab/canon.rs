//! The canonical reduction order and per-element steps of the vocabulary kernels \[ours\].
//!
//! Every vocabulary operation of this crate is a function of the *exact* sequence of IEEE
//! operations written here. A backend (grpo-cpu's AVX-512, AVX2+FMA and NEON code) that performs
//! the same operations in the same order gets the same bits; it only has to replace
//! [`lse_block`] / [`pair_block`] (the per-block work) by a vectorised equivalent and call the
//! shared scalar code ([`fold_blocks`], the `merge` methods, the `finish` functions of the
//! operations) for everything else.
//!
//! # Row → blocks → lanes
//!
//! A row of `V` logits is cut into blocks of [`BLOCK`] = 2048 elements: block `j` covers
//! `[j·BLOCK, min((j+1)·BLOCK, V))`; only the last block may be shorter. Each block is reduced
//! on its own (below) to a small state; the block states are then merged by
//! [`fold_blocks`] in a fixed **pairwise** order: `reduce(b[0..n]) = b[0]` if `n = 1`, else
//! `merge(reduce(b[0..h]), reduce(b[h..n]))` with `h` the largest power of two `< n`. This is the
//! blocked two-level summation the accuracy contract needs: at most 128 sequential additions per
//! lane plus a merge tree of depth ⌈log2(V/2048)⌉ (7 at V = 262144), instead of ~9500
//! sequential additions per lane at V = 151936.
//!
//! # Inside a block of length `n` (`n16 = n − n mod 16`)
//!
//! 1. **Block max** `m = max over the block of z_i` (converted to f32). Max is exact, so any
//!    order gives the same value except for the sign of a zero, which step 2 removes: a backend
//!    may compute it in any order with `max_r` (NaN and +∞ are validation errors, so they never
//!    reach an `Ok` result).
//! 2. **Reference and offset** ([`block_reference`]). With `P` the *running maximum* of the
//!    row's earlier blocks (the `max_r` of their raw maxima, −∞ before the first block):
//!    the block's reference is `r = P + 0.0` if `P > −∞` and `(m − P)·τ ≤ OFFSET_SLACK` (= 8),
//!    else `r = m + 0.0` (`+ 0.0` turns −0 into +0). The offset is `c = select(r == −∞, 0, r)`
//!    (an all-masked first block uses `c = 0`, so its elements give `d = −∞`, never NaN) and
//!    the state keeps `r`. τ = 1/T (rounded once) is applied to differences only, so every `d`
//!    is ≤ `OFFSET_SLACK` by construction and its accuracy does not depend on the logits'
//!    magnitude. Whichever block holds the row maximum `M` has `r ≥ M − OFFSET_SLACK/τ`, so a
//!    row's merged reference lies within `OFFSET_SLACK/τ` below `M` and its `sum ≥ 1`.
//! 3. **Lanes.** 16 accumulators (one per lane, all starting at +0). Element `i < n16` of the
//!    block goes to lane `i mod 16`, in increasing `i`; each lane applies the element step
//!    ([`lse_step`] / [`pair_step`]).
//! 4. **Tree.** For `h` in 8, 4, 2, 1: `acc[l] = acc[l] + acc[l + h]` for `l < h` (each
//!    accumulator field separately). AVX-512 holds the 16 lanes in one register (the tree is
//!    "add high 256 to low 256", then 128, 64, 32), AVX2 in two (first step: `r0 + r1`), NEON
//!    in four (first step: `r0 + r2`, `r1 + r3`; second: `(r0+r2) + (r1+r3)`).
//! 5. **Tail.** Elements `n16..n` (only in a row's last block) apply the element step to
//!    `acc[0]` in increasing index order.
//!
//! # The element steps (what a SIMD lane computes; see `exp_ln` for `exp_nonpos_clamped`)
//!
//! [`lse_step`] — state `(s, t)`, `s = Σ e^d`, `t = Σ e^d·d`:
//! ```text
//! d  = (z − c)·τ              // ≤ 0; two roundings (the ·τ is exact and skippable at τ = 1)
//! dc = max_r(D_MIN, d)         // D_MIN = −88; −∞ → −88
//! e  = exp_nonpos_clamped(dc)  // 0 for dc < −87.36
//! s  = s + e
//! t  = fma(e, dc, t)
//! ```
//! [`pair_step`] (student logit `z` with block offset `cz`, teacher logit `w` with `cw`) —
//! state `(sz, tz, sw, tw, u, v)`:
//! ```text
//! dz = (z − cz)·τ; dzc = max_r(D_MIN, dz); ez = exp_nonpos_clamped(dzc)
//! dw = (w − cw)·τ; dwc = max_r(D_MIN, dw); ew = exp_nonpos_clamped(dwc)
//! g  = max_r(LOG_RATIO_FLOOR, dz) − max_r(LOG_RATIO_FLOOR, dw)   // finite even for −∞ pairs
//! sz = sz + ez; tz = fma(ez, dzc, tz)
//! sw = sw + ew; tw = fma(ew, dwc, tw)
//! u  = fma(ez, g, u)           // Σ e^{dz}·(dz − dw)
//! v  = fma(ew, −g, v)          // Σ e^{dw}·(dw − dz)
//! ```
//! A backend may skip the multiplication by τ when τ = 1 (it is exact then) and the inner
//! clamp of `exp_nonpos` (the argument is already clamped).
//!
//! # Merging two states (shared scalar code, [`LseState::merge`], [`PairState::merge`])
//!
//! With raw maxima `m = max_r(ma, mb)`, `δa = (ma − m)·τ`, `δb = (mb − m)·τ` (one of them is
//! 0, the other ≤ 0 — the same arithmetic as an element's `d`), the clamped
//! `δc = max_r(D_MIN, δ)` and `a = exp_nonpos_clamped(δc)`:
//! `s = fma(sa, aa, sb·ab)`, `t = fma(fma(δca, sa, ta), aa, fma(δcb, sb, tb)·ab)`
//! (because `Σ e^{d+δ}(d+δ) = e^δ (t + δ s)`); if `m = −∞` the sums are simply added.
//!
//! # Row results and backward
//!
//! From the merged row state (reference `m`, within `OFFSET_SLACK/τ` below the row's raw
//! maximum, see [`LseState::max`]): `L = ln(s)`, `lse = m·τ + L`, `H = L − t/s`,
//! `logp(y) = fma(z_y − m, τ, −L)` ([`finish_lse`], [`logp_of`]); for a pair
//! `KL(p‖q) = (ln sw − ln sz) + u/sz`, `KL(q‖p) = (ln sz − ln sw) + v/sw` ([`finish_kl`]).
//! The backward has no reduction: each element is
//! computed independently by [`grad_step`] from per-row coefficients ([`GradCoef`]).
//!
//! The JSD's second pass (after the pair state gave both lse) sums [`jsd_step`] with
//! [`canonical_sum`]: the same blocks, lanes, tree and tail, block sums merged pairwise by `+`.
//! Its gradient sums [`jsd_student_step`] the same way, then computes each element by
//! [`jsd_grad_step`].
//!
//! # What a backend mirrors, and what it calls
//!
//! Mirror (vectorise) exactly: [`block_max`] (any order), [`lse_block`], [`pair_block`],
//! [`grad_step`] (with [`log_prob`]), [`jsd_step`] / [`jsd_student_step`] /
//! [`canonical_sum`]'s block part and [`jsd_grad_step`]. Call
//! the scalar code of this
//! crate for everything else: [`block_reference`] (with the running maximum carried from
//! block to block in index order, as [`lse_row`] / [`pair_row`] do), [`fold_blocks`] with
//! [`LseState::merge`] / [`PairState::merge`],
//! [`finish_lse`], [`LogSoftmax::of`], [`finish_kl`], [`GradCoef::from_lse`] /
//! [`GradCoef::from_pair`], and `vocab::validate` for the input checks (same errors in the
//! same order). Rows are independent, so distributing whole rows over threads never changes a
//! bit.
//!
//! # Why this structure (speed)
//!
//! The kernels must stream logits near memory bandwidth, so the per-element work is kept to
//! one subtraction and one multiplication for the shift (the multiplication vanishes at
//! T = 1), one clamp, the exponential (reduction: FMA, sub, 2 FMA; table read: one permute;
//! degree-3 polynomial and table factor: 3 FMA and a multiply; scaling: integer sub, shift,
//! integer max, shift, multiply) and two accumulations (`add`, `FMA`), plus one `max` for
//! the block maximum: about 21 vector operations per 16 logits (20 at T = 1) for
//! log-sum-exp + entropy, with no division and no data-dependent branch. There is no
//! per-element running-max compare/blend and no rescaling inside a block; the only rescaling
//! happens once per 2048-element block in the scalar merge (two exponentials). A 2048-element
//! block keeps the merge overhead near 1 % and a block (KL: two, 16 KiB) in L1.
//!
//! Why the running-maximum reference (step 2): with the block's own maximum as the offset, a
//! backend must read each block twice — the maximum first, then the exponentials — and the
//! extra pass over cache lines it has to prefetch in software cost about a fifth of the
//! streaming rate on the build machine (single-thread fused kernel, 1024 × 32768 f32: 10.8 →
//! 8.9 ms median with one pass, same arithmetic). With the reference known before the block
//! is read, a backend computes the exponentials *and* the block maximum in one pass of plain
//! sequential loads and only redoes a block, from L1, when the rule picks `m` (the first
//! block, or a maximum more than `OFFSET_SLACK/τ` above every earlier block's: a few blocks
//! per row). The slack bounds the terms by e^8 ≈ 2981, far from overflow, and costs at most
//! ~8 units of cancellation in `H = L − t/s` (≈ 1e-6, against the 1e-5 contract).
//!
//! # Storage
//!
//! Logits are read through [`Logit`] (f32, `half::bf16`, `half::f16`), converted exactly to f32;
//! all arithmetic is f32.

use super::exp_ln::{D_MIN, clamp_grad_arg, exp_nonpos_clamped, fma, ln, max_r};

/// Number of accumulator lanes (element `i` of a block goes to lane `i mod LANES`).
pub const LANES: usize = 16;
/// Block length of the two-level summation (a multiple of [`LANES`]).
pub const BLOCK: usize = 2048;

/// Floor of a scaled logit difference where it enters a log-ratio (KL terms): −2^64
/// (0xdf800000) = −1.8446744e19. It makes `−∞ − (−∞)` a finite 0 and bounds every KL term, so
/// sums of up to 2^32 terms times any accepted weight stay finite; no real logit row has
/// differences anywhere near it.
pub const LOG_RATIO_FLOOR: f32 = f32::from_bits(0xdf80_0000);

/// Storage type of a logit (or of a gradient written in place): exactly convertible to `f32`.
///
/// Implemented for `f32`, `half::bf16` and `half::f16`. `to_f32` is exact for all three;
/// `from_f32` rounds to nearest even (identity for `f32`).
///
/// ```
/// use grpo_core::vocab::Logit;
/// let b = half::bf16::from_f32(1.5);
/// assert_eq!(Logit::to_f32(b), 1.5);
/// assert_eq!(<half::f16 as Logit>::from_f32(0.25).to_f32(), 0.25);
/// ```
pub trait Logit: Copy + Send + Sync + 'static {
    /// The exact f32 value.
    fn to_f32(self) -> f32;
    /// The nearest representable value (ties to even).
    fn from_f32(x: f32) -> Self;
}

impl Logit for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Logit for half::bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}

impl Logit for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}

/// Online softmax statistics of a block or row: the reference point, and sums in the
/// temperature-scaled domain.
///
/// `max` is the reference `r` the sums are taken against ([`block_reference`]: the block's raw
/// maximum, or the running maximum of the row's earlier blocks, at most `OFFSET_SLACK/τ`
/// below the block's maximum; −∞ for an all-masked first block), `sum = Σ_v e^{d_v}` and
/// `dot = Σ_v e^{d_v}·d_v` with `d_v = (z_v − r)·τ` as computed by [`lse_step`]. Hence
/// `lse = r·τ + ln(sum)` and `H = ln(sum) − dot/sum` for any reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LseState {
    /// Reference `r` (the logits' own scale, before τ): a block's or earlier blocks' raw
    /// maximum; after merging a row, within `OFFSET_SLACK/τ` below the row maximum.
    pub max: f32,
    /// `s = Σ e^{d}`.
    pub sum: f32,
    /// `t = Σ e^{d}·d`.
    pub dot: f32,
}

/// The rescaling factor and clamped shift of a state whose raw maximum `m` is merged into
/// `top`: `δc = max_r(D_MIN, (m − top)·τ)`, `a = exp_nonpos_clamped(δc)`.
#[inline(always)]
fn rescale(m: f32, top: f32, tau: f32) -> (f32, f32) {
    let dc = max_r(D_MIN, (m - top) * tau);
    (dc, exp_nonpos_clamped(dc))
}

impl LseState {
    /// The state of an empty block: `(−∞, 0, 0)`.
    pub const EMPTY: LseState = LseState {
        max: f32::NEG_INFINITY,
        sum: 0.0,
        dot: 0.0,
    };

    /// Merges `self` (the left, lower-index part) with `right`, rescaling both to the larger
    /// maximum (formula in the [module documentation](self)).
    ///
    /// ```
    /// use grpo_core::vocab::canon::LseState;
    /// // two blocks each holding one logit: 0 and ln 3 (τ = 1, so sum = 1, dot = 0 each)
    /// let a = LseState { max: 0.0, sum: 1.0, dot: 0.0 };
    /// let b = LseState { max: 3f32.ln(), sum: 1.0, dot: 0.0 };
    /// let m = a.merge(b, 1.0);
    /// assert_eq!(m.max, 3f32.ln());
    /// // sum = 1 + e^{−ln 3} = 4/3
    /// assert!((m.sum - 4.0 / 3.0).abs() < 1e-6);
    /// ```
    #[inline]
    pub fn merge(self, right: LseState, tau: f32) -> LseState {
        let top = max_r(self.max, right.max);
        if top == f32::NEG_INFINITY {
            return LseState {
                max: top,
                sum: self.sum + right.sum,
                dot: self.dot + right.dot,
            };
        }
        let (da, aa) = rescale(self.max, top, tau);
        let (db, ab) = rescale(right.max, top, tau);
        LseState {
            max: top,
            sum: fma(self.sum, aa, right.sum * ab),
            dot: fma(
                fma(da, self.sum, self.dot),
                aa,
                fma(db, right.sum, right.dot) * ab,
            ),
        }
    }
}

/// Block offset `c = r`, or 0 for an all-masked first block (`r = −∞`, so its elements give
/// `d = −∞`).
#[inline(always)]
pub fn offset(reference: f32) -> f32 {
    if reference == f32::NEG_INFINITY {
        0.0
    } else {
        reference
    }
}

/// How far (in τ-scaled units) a block's maximum may lie above the running maximum of the
/// earlier blocks for that running maximum to stay the block's reference: 8 \[ours\].
pub const OFFSET_SLACK: f32 = 8.0;

/// The reference `r` of a block with raw maximum `raw_max` (as [`block_max`] returns it) after
/// earlier blocks whose running maximum is `prior` (−∞ for the first block of a row):
/// `prior + 0.0` if `prior > −∞` and `(raw_max − prior)·τ ≤ OFFSET_SLACK`, else `raw_max`
/// (module documentation, step 2). A NaN `raw_max` (invalid input) gives NaN.
///
/// ```
/// use grpo_core::vocab::canon::block_reference;
/// let ninf = f32::NEG_INFINITY;
/// assert_eq!(block_reference(ninf, 3.0, 1.0), 3.0); // first block: its own maximum
/// assert_eq!(block_reference(5.0, 3.0, 1.0), 5.0); // below the running maximum
/// assert_eq!(block_reference(5.0, 12.0, 1.0), 5.0); // 7 above it: within the slack
/// assert_eq!(block_reference(5.0, 14.0, 1.0), 14.0); // 9 above it: its own maximum
/// assert_eq!(block_reference(5.0, 14.0, 0.5), 5.0); // at T = 2 that is 4.5 above
/// assert_eq!(block_reference(5.0, ninf, 1.0), 5.0); // an all-masked later block
/// ```
#[inline(always)]
pub fn block_reference(prior: f32, raw_max: f32, tau: f32) -> f32 {
    if prior > f32::NEG_INFINITY && (raw_max - prior) * tau <= OFFSET_SLACK {
        prior + 0.0
    } else {
        raw_max
    }
}

/// Raw maximum of a block, `+ 0.0` (a `max_r` fold; any order gives the same value because
/// the `+ 0.0` removes the only order dependence, the sign of a zero maximum).
///
/// ```
/// use grpo_core::vocab::canon::block_max;
/// assert_eq!(block_max(&[1.5f32, f32::NEG_INFINITY, -3.0]), 1.5);
/// // A maximum of −0 comes out as +0, whichever zero comes first.
/// assert_eq!(block_max(&[-0.0f32, -1.0]).to_bits(), 0.0f32.to_bits());
/// // An empty or fully masked block: −∞.
/// assert_eq!(block_max::<f32>(&[]), f32::NEG_INFINITY);
/// ```
#[inline]
pub fn block_max<S: Logit>(z: &[S]) -> f32 {
    let mut m = f32::NEG_INFINITY;
    for &v in z {
        m = max_r(m, v.to_f32());
    }
    m + 0.0
}

/// The per-element step of the log-sum-exp/entropy reduction (see the module documentation):
/// returns the updated `(s, t)`.
///
/// ```
/// use grpo_core::vocab::canon::lse_step;
/// // z = c (d = 0): s += 1, t += 0; a masked logit adds nothing.
/// assert_eq!(lse_step(2.0, 1.0, 2.0, 0.0, 0.0), (1.0, 0.0));
/// assert_eq!(lse_step(f32::NEG_INFINITY, 1.0, 2.0, 1.0, 0.0), (1.0, 0.0));
/// ```
#[inline(always)]
pub fn lse_step(z: f32, tau: f32, c: f32, s: f32, t: f32) -> (f32, f32) {
    let d = (z - c) * tau;
    let dc = max_r(D_MIN, d);
    let e = exp_nonpos_clamped(dc);
    (s + e, fma(e, dc, t))
}

/// Reduces one block to its [`LseState`] in the canonical order (max, reference, 16 strided
/// lanes, tree, tail) after earlier blocks whose running maximum is `prior` (−∞ for a row's
/// first block), and returns the running maximum after this block, `max_r(prior, m)`. This
/// is the scalar reference a SIMD backend replaces; [`lse_row`] folds a whole row.
///
/// ```
/// use grpo_core::vocab::canon::lse_block;
/// let ninf = f32::NEG_INFINITY;
/// // logits [0, 0] as a first block: r = 0, s = e^0 + e^0 = 2, t = 0
/// let (st, run) = lse_block(&[0.0f32, 0.0], 1.0, ninf);
/// assert_eq!((st.max, st.sum, st.dot, run), (0.0, 2.0, 0.0, 0.0));
/// // after a block whose maximum was 1: the reference stays 1, each d = −1
/// let (st, run) = lse_block(&[0.0f32, 0.0], 1.0, 1.0);
/// assert_eq!((st.max, run), (1.0, 1.0));
/// assert_eq!(st.sum, 2.0 * grpo_core::vocab::exp_ln::exp(-1.0));
/// ```
pub fn lse_block<S: Logit>(z: &[S], tau: f32, prior: f32) -> (LseState, f32) {
    let m = block_max(z);
    let r = block_reference(prior, m, tau);
    let c = offset(r);
    let mut s = [0.0f32; LANES];
    let mut t = [0.0f32; LANES];
    let mut chunks = z.chunks_exact(LANES);
    for chunk in &mut chunks {
        for l in 0..LANES {
            (s[l], t[l]) = lse_step(chunk[l].to_f32(), tau, c, s[l], t[l]);
        }
    }
    tree(&mut s);
    tree(&mut t);
    let (mut s0, mut t0) = (s[0], t[0]);
    for &v in chunks.remainder() {
        (s0, t0) = lse_step(v.to_f32(), tau, c, s0, t0);
    }
    let st = LseState {
        max: r,
        sum: s0,
        dot: t0,
    };
    (st, max_r(prior, m))
}

/// The merged [`LseState`] of a whole row: [`lse_block`] over its blocks in index order, each
/// after the running maximum of the ones before, merged by [`fold_blocks`] (`EMPTY` for an
/// empty row).
///
/// ```
/// use grpo_core::vocab::canon::{lse_row, BLOCK};
/// // two blocks; the second's maximum (1) is within the slack of the first's (0)
/// let mut z = vec![0.0f32; 2 * BLOCK];
/// z[BLOCK] = 1.0;
/// let st = lse_row(&z, 1.0);
/// assert_eq!(st.max, 0.0);
/// assert!((st.sum - (2.0 * BLOCK as f32 - 1.0 + 1f32.exp())).abs() < 2e-3);
/// ```
pub fn lse_row<S: Logit>(z: &[S], tau: f32) -> LseState {
    let mut prior = f32::NEG_INFINITY;
    fold_blocks(
        z.len(),
        |a: LseState, b| a.merge(b, tau),
        |a, b| {
            let st;
            (st, prior) = lse_block(&z[a..b], tau, prior);
            st
        },
    )
    .unwrap_or(LseState::EMPTY)
}

/// The fixed pairwise tree over the 16 lanes: for `h` in 8, 4, 2, 1, `a[l] += a[l + h]`
/// (the result is in `a[0]`). Generic so the per-token losses' sums (f32 or f64) use the same
/// order as the vocabulary kernels.
///
/// ```
/// use grpo_core::vocab::canon::tree;
/// // Lane 0 = 1, lanes 1..16 = 2⁻²⁴. h = 8: a0 = 1 + 2⁻²⁴ rounds to 1 (a tie, to even), a1..a8
/// // = 2⁻²³; h = 4: a0 = 1 + 2⁻²³, a1..a4 = 2⁻²²; h = 2: a0 = 1 + 3·2⁻²³, a1 = 2⁻²¹; h = 1:
/// // a0 = 1 + 7·2⁻²³, all exact. (A left-to-right sum loses every 2⁻²⁴ and ends at 1.)
/// let mut a = [2f32.powi(-24); 16];
/// a[0] = 1.0;
/// tree(&mut a);
/// assert_eq!(a[0], 1.0 + 7.0 * 2f32.powi(-23));
/// assert_eq!([2f32.powi(-24); 15].iter().fold(1.0f32, |s, &x| s + x), 1.0);
/// ```
#[inline(always)]
pub fn tree<T: crate::Real>(a: &mut [T; LANES]) {
    let mut h = LANES / 2;
    while h > 0 {
        for l in 0..h {
            a[l] += a[l + h];
        }
        h /= 2;
    }
}

/// Statistics of a student row `z` and a teacher row `w` reduced together.
///
/// `zmax`/`wmax` are the references (as [`LseState::max`]), `sz, tz` and `sw, tw` the
/// [`LseState`] sums of each row,
/// `u = Σ e^{dz}·(dz − dw)` and `v = Σ e^{dw}·(dw − dz)` (see [`pair_step`]), so that
/// `KL(p‖q) = ln sw − ln sz + u/sz` and `KL(q‖p) = ln sz − ln sw + v/sw`. A state saved by a
/// KL(q‖p) forward holds `u = +∞` where KL(p‖q) is infinite (the teacher −∞ where the
/// student is not; [`SavedState::check_kl_term`](super::SavedState::check_kl_term)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairState {
    /// Reference of the student row ([`LseState::max`]).
    pub zmax: f32,
    /// Σ e^{dz}.
    pub sz: f32,
    /// Σ e^{dz}·dz.
    pub tz: f32,
    /// Reference of the teacher row ([`LseState::max`]).
    pub wmax: f32,
    /// Σ e^{dw}.
    pub sw: f32,
    /// Σ e^{dw}·dw.
    pub tw: f32,
    /// Σ e^{dz}·(dz − dw) (+∞ in a saved state whose KL(p‖q) is infinite).
    pub u: f32,
    /// Σ e^{dw}·(dw − dz).
    pub v: f32,
}

impl PairState {
    /// The state of an empty row pair: both references −∞, every sum 0.
    pub const EMPTY: PairState = PairState {
        zmax: f32::NEG_INFINITY,
        sz: 0.0,
        tz: 0.0,
        wmax: f32::NEG_INFINITY,
        sw: 0.0,
        tw: 0.0,
        u: 0.0,
        v: 0.0,
    };

    /// The student half as an [`LseState`].
    #[inline]
    pub fn student(&self) -> LseState {
        LseState {
            max: self.zmax,
            sum: self.sz,
            dot: self.tz,
        }
    }

    /// The teacher half as an [`LseState`].
    #[inline]
    pub fn teacher(&self) -> LseState {
        LseState {
            max: self.wmax,
            sum: self.sw,
            dot: self.tw,
        }
    }

    /// Merges `self` (left) with `right`: each half as [`LseState::merge`]; the cross sums as
    /// `u = fma(fma(gzl − gwl, szl, ul), azl, fma(gzr − gwr, szr, ur)·azr)` and
    /// `v = fma(fma(gwl − gzl, swl, vl), awl, fma(gwr − gzr, swr, vr)·awr)`, where
    /// `g = max_r(LOG_RATIO_FLOOR, (part max − merged max)·τ)` (0 if the merged max is −∞)
    /// and `a` is the exponential factor of [`LseState::merge`] (1 if the merged max is −∞).
    /// The shifts are floored at LOG_RATIO_FLOOR = −2^64, not
    /// at D_MIN, because they enter a log-ratio, not an exponential.
    ///
    /// ```
    /// use grpo_core::vocab::canon::{finish_kl, pair_block, PairState};
    /// let (z, w) = ([0.0f32, 1.0], [1.0f32, 0.0]);
    /// let first = [f32::NEG_INFINITY; 2];
    /// let (whole, _) = pair_block(&z, &w, 1.0, first);
    /// let (left, run) = pair_block(&z[..1], &w[..1], 1.0, first);
    /// let (right, _) = pair_block(&z[1..], &w[1..], 1.0, run);
    /// let split = left.merge(right, 1.0);
    /// // The split keeps the first block's student reference (0, within the slack of the
    /// // second block's maximum 1), the whole block uses 1; the KL values agree.
    /// assert_eq!((whole.zmax, split.zmax), (1.0, 0.0));
    /// let (a, b) = (finish_kl(&whole), finish_kl(&split));
    /// assert!((a.0 - b.0).abs() < 1e-6 && (a.1 - b.1).abs() < 1e-6);
    /// ```
    #[inline]
    pub fn merge(self, right: PairState, tau: f32) -> PairState {
        let z = self.student().merge(right.student(), tau);
        let w = self.teacher().merge(right.teacher(), tau);
        // Shift of a part's maximum to the merged one, floored at LOG_RATIO_FLOOR (it enters a
        // log-ratio); 0 when the merged maximum is −∞ (then every sum is 0 and stays 0).
        let shift = |m: f32, top: f32| {
            if top == f32::NEG_INFINITY {
                0.0
            } else {
                max_r(LOG_RATIO_FLOOR, (m - top) * tau)
            }
        };
        let factor = |m: f32, top: f32| {
            if top == f32::NEG_INFINITY {
                1.0
            } else {
                rescale(m, top, tau).1
            }
        };
        let part = |p: &PairState| {
            let gz = shift(p.zmax, z.max);
            let gw = shift(p.wmax, w.max);
            (
                fma(gz - gw, p.sz, p.u),
                factor(p.zmax, z.max),
                fma(gw - gz, p.sw, p.v),
                factor(p.wmax, w.max),
            )
        };
        let (ul, azl, vl, awl) = part(&self);
        let (ur, azr, vr, awr) = part(&right);
        PairState {
            zmax: z.max,
            sz: z.sum,
            tz: z.dot,
            wmax: w.max,
            sw: w.sum,
            tw: w.dot,
            u: fma(ul, azl, ur * azr),
            v: fma(vl, awl, vr * awr),
        }
    }
}

/// The per-element step of the student/teacher pair reduction (module documentation).
/// `acc` is `[sz, tz, sw, tw, u, v]`.
///
/// ```
/// use grpo_core::vocab::canon::pair_step;
/// // z at its max (dz = 0), w one unit below its max (dw = −1):
/// let a = pair_step(3.0, 1.0, 3.0, 4.0, 5.0, [0.0; 6]);
/// assert_eq!(a[0], 1.0); // sz += e^0
/// assert_eq!(a[4], 1.0); // u += e^0 · (0 − (−1))
/// ```
#[inline(always)]
pub fn pair_step(z: f32, tau: f32, cz: f32, w: f32, cw: f32, acc: [f32; 6]) -> [f32; 6] {
    let [sz, tz, sw, tw, u, v] = acc;
    let dz = (z - cz) * tau;
    let dzc = max_r(D_MIN, dz);
    let ez = exp_nonpos_clamped(dzc);
    let dw = (w - cw) * tau;
    let dwc = max_r(D_MIN, dw);
    let ew = exp_nonpos_clamped(dwc);
    let g = max_r(LOG_RATIO_FLOOR, dz) - max_r(LOG_RATIO_FLOOR, dw);
    [
        sz + ez,
        fma(ez, dzc, tz),
        sw + ew,
        fma(ew, dwc, tw),
        fma(ez, g, u),
        fma(ew, -g, v),
    ]
}

/// Reduces one block of a student row `z` and a teacher row `w` (same length) to a
/// [`PairState`] in the canonical order, after earlier blocks whose running maxima are
/// `prior = [student, teacher]` (each row takes its reference by [`block_reference`] on its
/// own), and returns the running maxima after this block. The scalar reference a SIMD
/// backend replaces; [`pair_row`] folds a whole row pair.
///
/// ```
/// use grpo_core::vocab::canon::pair_block;
/// let ninf = f32::NEG_INFINITY;
/// // identical rows: u = v = 0 exactly
/// let (st, run) = pair_block(&[0.5f32, -1.0, 2.0], &[0.5f32, -1.0, 2.0], 1.0, [ninf; 2]);
/// assert_eq!((st.u, st.v, run), (0.0, 0.0, [2.0, 2.0]));
/// ```
pub fn pair_block<S: Logit, U: Logit>(
    z: &[S],
    w: &[U],
    tau: f32,
    prior: [f32; 2],
) -> (PairState, [f32; 2]) {
    let (zm, wm) = (block_max(z), block_max(w));
    let zmax = block_reference(prior[0], zm, tau);
    let wmax = block_reference(prior[1], wm, tau);
    let (cz, cw) = (offset(zmax), offset(wmax));
    let mut acc = [[0.0f32; LANES]; 6];
    let n = z.len().min(w.len());
    let n16 = n - n % LANES;
    let mut g = 0;
    while g < n16 {
        for l in 0..LANES {
            let a = [
                acc[0][l], acc[1][l], acc[2][l], acc[3][l], acc[4][l], acc[5][l],
            ];
            let r = pair_step(z[g + l].to_f32(), tau, cz, w[g + l].to_f32(), cw, a);
            for k in 0..6 {
                acc[k][l] = r[k];
            }
        }
        g += LANES;
    }
    for a in acc.iter_mut() {
        tree(a);
    }
    let mut a0 = [
        acc[0][0], acc[1][0], acc[2][0], acc[3][0], acc[4][0], acc[5][0],
    ];
    for i in n16..n {
        a0 = pair_step(z[i].to_f32(), tau, cz, w[i].to_f32(), cw, a0);
    }
    let st = PairState {
        zmax,
        sz: a0[0],
        tz: a0[1],
        wmax,
        sw: a0[2],
        tw: a0[3],
        u: a0[4],
        v: a0[5],
    };
    (st, [max_r(prior[0], zm), max_r(prior[1], wm)])
}

/// The merged [`PairState`] of a whole row pair of equal length: [`pair_block`] over its
/// blocks in index order with the running maxima, merged by [`fold_blocks`]
/// ([`PairState::EMPTY`] for empty rows).
///
/// ```
/// use grpo_core::vocab::canon::pair_row;
/// // identical rows: KL terms vanish exactly
/// let z = [0.5f32, -1.0, 2.0];
/// let st = pair_row(&z, &z, 1.0);
/// assert_eq!((st.zmax, st.wmax, st.u, st.v), (2.0, 2.0, 0.0, 0.0));
/// ```
pub fn pair_row<S: Logit, U: Logit>(z: &[S], w: &[U], tau: f32) -> PairState {
    let mut prior = [f32::NEG_INFINITY; 2];
    fold_blocks(
        z.len().min(w.len()),
        |a: PairState, b| a.merge(b, tau),
        |a, b| {
            let st;
            (st, prior) = pair_block(&z[a..b], &w[a..b], tau, prior);
            st
        },
    )
    .unwrap_or(PairState::EMPTY)
}

/// Row results from a merged [`LseState`] (shared scalar code, not mirrored by SIMD):
/// `(lse, L, H)`.
///
/// `L = ln(s)`; `lse = m·τ + L`; `H = L − t/s` (one IEEE division). Requires a non-empty row
/// (`max > −∞`).
///
/// ```
/// use grpo_core::vocab::canon::{finish_lse, LseState};
/// // two equal logits 0: s = 2, t = 0 → lse = ln 2, H = ln 2
/// let (lse, ln_s, h) = finish_lse(&LseState { max: 0.0, sum: 2.0, dot: 0.0 }, 1.0);
/// assert_eq!(lse, ln_s);
/// assert!((h - core::f32::consts::LN_2).abs() < 1e-7);
/// ```
#[inline]
pub fn finish_lse(st: &LseState, tau: f32) -> (f32, f32, f32) {
    let l = ln(st.sum);
    (st.max * tau + l, l, l - st.dot / st.sum)
}

/// The two numbers that turn a logit of a reduced row into its log-probability:
/// `log p_v = fma(z_v − max, τ, neg_ln_sum)` ([`log_prob`]), with `max` the merged state's
/// reference ([`LseState::max`]: up to `OFFSET_SLACK/τ` below the row's raw maximum, so
/// `(z_v − max)·τ` can reach +8) and `neg_ln_sum = −ln(s)`. The result is ≤ 0 up to rounding:
/// `s` includes `e^{(z_v − max)·τ}` for every `v`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogSoftmax {
    /// The merged state's reference `m` ([`LseState::max`]).
    pub max: f32,
    /// `−ln(s)`.
    pub neg_ln_sum: f32,
}

impl LogSoftmax {
    /// From a merged row state.
    ///
    /// ```
    /// use grpo_core::vocab::canon::{LogSoftmax, LseState};
    /// let ls = LogSoftmax::of(&LseState { max: 3.0, sum: 1.0, dot: 0.0 });
    /// assert_eq!((ls.max, ls.neg_ln_sum), (3.0, 0.0));
    /// ```
    #[inline]
    pub fn of(st: &LseState) -> LogSoftmax {
        LogSoftmax {
            max: st.max,
            neg_ln_sum: -ln(st.sum),
        }
    }
}

/// `log p_v = fma(z − max, τ, neg_ln_sum)` (see [`LogSoftmax`]).
///
/// ```
/// use grpo_core::vocab::canon::{log_prob, LogSoftmax};
/// let ls = LogSoftmax { max: 1.0, neg_ln_sum: -core::f32::consts::LN_2 };
/// assert_eq!(log_prob(1.0, 1.0, &ls), -core::f32::consts::LN_2);
/// ```
#[inline(always)]
pub fn log_prob(z: f32, tau: f32, ls: &LogSoftmax) -> f32 {
    fma(z - ls.max, tau, ls.neg_ln_sum)
}

/// Log-probability of the target from the merged row state: [`log_prob`] of
/// [`LogSoftmax::of`].
///
/// ```
/// use grpo_core::vocab::canon::{logp_of, LseState};
/// // logits [0, 0]: logp = 0 − ln 2
/// let st = LseState { max: 0.0, sum: 2.0, dot: 0.0 };
/// assert!((logp_of(0.0, 1.0, &st) + core::f32::consts::LN_2).abs() < 1e-7);
/// ```
#[inline]
pub fn logp_of(z_y: f32, tau: f32, st: &LseState) -> f32 {
    log_prob(z_y, tau, &LogSoftmax::of(st))
}

/// Per-row coefficients of the fused backward ([`grad_step`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradCoef {
    /// τ = 1/T.
    pub tau: f32,
    /// Log-softmax of the student row.
    pub p: LogSoftmax,
    /// Entropy H of the student row.
    pub h: f32,
    /// Weight of logp(y).
    pub g_lp: f32,
    /// Weight of H.
    pub g_h: f32,
    /// Weight of the KL term (0 when there is none).
    pub g_kl: f32,
    /// Log-softmax of the teacher row (unused without a KL term).
    pub q: LogSoftmax,
    /// KL(p‖q) of the row (used by the KL(p‖q) direction only).
    pub kl: f32,
}

impl GradCoef {
    /// Coefficients without a KL term, from the merged student row state.
    ///
    /// ```
    /// use grpo_core::vocab::canon::{GradCoef, LseState};
    /// let c = GradCoef::from_lse(&LseState { max: 0.0, sum: 2.0, dot: 0.0 }, 1.0, 1.0, 0.0);
    /// assert!((c.p.neg_ln_sum + core::f32::consts::LN_2).abs() < 1e-7);
    /// ```
    pub fn from_lse(st: &LseState, tau: f32, g_lp: f32, g_h: f32) -> GradCoef {
        GradCoef {
            tau,
            p: LogSoftmax::of(st),
            h: finish_lse(st, tau).2,
            g_lp,
            g_h,
            g_kl: 0.0,
            q: LogSoftmax {
                max: 0.0,
                neg_ln_sum: 0.0,
            },
            kl: 0.0,
        }
    }

    /// Coefficients with a KL term, from the merged pair state (`kl` = KL(p‖q) of
    /// [`finish_kl`]).
    ///
    /// ```
    /// use grpo_core::vocab::canon::{pair_row, GradCoef};
    /// let st = pair_row(&[0.0f32, 0.0], &[0.0f32, 0.0], 1.0);
    /// let c = GradCoef::from_pair(&st, 1.0, 0.0, 0.0, 1.0);
    /// assert_eq!((c.kl, c.p), (0.0, c.q));
    /// ```
    pub fn from_pair(st: &PairState, tau: f32, g_lp: f32, g_h: f32, g_kl: f32) -> GradCoef {
        GradCoef {
            tau,
            p: LogSoftmax::of(&st.student()),
            h: finish_lse(&st.student(), tau).2,
            g_lp,
            g_h,
            g_kl,
            q: LogSoftmax::of(&st.teacher()),
            kl: finish_kl(st).0,
        }
    }
}

/// Which KL's gradient the backward adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlGrad {
    /// No KL term.
    None,
    /// KL(p‖q) (student‖teacher): `∂/∂z_v = p_v (log p_v − log q_v − KL)/T`.
    StudentTeacher,
    /// KL(q‖p) (teacher‖student): `∂/∂z_v = (p_v − q_v)/T`.
    TeacherStudent,
}

/// The per-element step of the fused backward: `∂(g_lp·logp(y) + g_H·H + g_KL·KL)/∂z_v`.
///
/// No reduction is involved, so every element is independent; the exact sequence is
/// ```text
/// lp  = fma(z − p.max, τ, p.neg_ln_sum)    // log p_v ≤ 0 (log_prob)
/// lpc = clamp_grad_arg(lp);  p = exp_nonpos_clamped(lpc)   // min_r(D_MAX, max_r(D_MIN, lp))
/// k   = fma(g_h, lpc + h, g_lp)
/// o   = select(v == y, g_lp, 0)
/// KL(p‖q): lq = fma(w − q.max, τ, q.neg_ln_sum)
///          k  = fma(−g_kl, (max_r(LOG_RATIO_FLOOR, lp) − max_r(LOG_RATIO_FLOOR, lq)) − kl, k)
/// KL(q‖p): lq = fma(w − q.max, τ, q.neg_ln_sum);  q = exp_nonpos_clamped(clamp_grad_arg(lq))
///          k  = k − g_kl;  o = fma(−g_kl, q, o)
/// grad = fma(−p, k, o) · τ
/// ```
/// (`w` is ignored without a KL term.) The upper clamp of [`clamp_grad_arg`] changes nothing
/// for the logits the coefficients came from; it keeps other logits' bits (the backward from
/// saved states does not validate them) the same on every backend.
///
/// ```
/// use grpo_core::vocab::canon::{grad_step, GradCoef, KlGrad};
/// // two equal logits 0 (p = ½ each), T = 1, target 0, g_lp = 1: grad = 1 − ½ and −½
/// use grpo_core::vocab::canon::LogSoftmax;
/// let p = LogSoftmax { max: 0.0, neg_ln_sum: -core::f32::consts::LN_2 };
/// let c = GradCoef { tau: 1.0, p, h: 0.0, g_lp: 1.0, g_h: 0.0, g_kl: 0.0, q: p, kl: 0.0 };
/// assert!((grad_step(0.0, 0.0, true, &c, KlGrad::None) - 0.5).abs() < 1e-7);
/// assert!((grad_step(0.0, 0.0, false, &c, KlGrad::None) + 0.5).abs() < 1e-7);
/// ```
#[inline(always)]
pub fn grad_step(z: f32, w: f32, is_target: bool, c: &GradCoef, kl: KlGrad) -> f32 {
    let lp = log_prob(z, c.tau, &c.p);
    let lpc = clamp_grad_arg(lp);
    let p = exp_nonpos_clamped(lpc);
    let mut k = fma(c.g_h, lpc + c.h, c.g_lp);
    let mut o = if is_target { c.g_lp } else { 0.0 };
    match kl {
        KlGrad::None => {}
        KlGrad::StudentTeacher => {
            let lq = log_prob(w, c.tau, &c.q);
            let g = max_r(LOG_RATIO_FLOOR, lp) - max_r(LOG_RATIO_FLOOR, lq);
            k = fma(-c.g_kl, g - c.kl, k);
        }
        KlGrad::TeacherStudent => {
            let lq = log_prob(w, c.tau, &c.q);
            let q = exp_nonpos_clamped(clamp_grad_arg(lq));
            k -= c.g_kl;
            o = fma(-c.g_kl, q, o);
        }
    }
    fma(-p, k, o) * c.tau
}

/// Both KL directions from a merged pair state: `(KL(p‖q), KL(q‖p))` =
/// `((ln sw − ln sz) + u/sz, (ln sz − ln sw) + v/sw)` (shared scalar code).
///
/// ```
/// use grpo_core::vocab::canon::{finish_kl, pair_row};
/// let st = pair_row(&[0.0f32, 0.0], &[0.0f32, 0.0], 1.0);
/// assert_eq!(finish_kl(&st), (0.0, 0.0));
/// ```
#[inline]
pub fn finish_kl(st: &PairState) -> (f32, f32) {
    let (lz, lw) = (ln(st.sz), ln(st.sw));
    ((lw - lz) + st.u / st.sz, (lz - lw) + st.v / st.sw)
}

/// Floor of `ln(mixture)` in the JSD: below ln of the smallest subnormal (−103.28), so it only
/// replaces `ln 0 = −∞`.
pub const LN_FLOOR: f32 = -104.0;

/// The per-row constants of the JSD's per-element steps: τ, both rows' [`LogSoftmax`], β and
/// `omb` = 1 − β rounded once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JsdParams {
    /// τ = 1/T.
    pub tau: f32,
    /// The student row's log-softmax.
    pub lz: LogSoftmax,
    /// The teacher row's log-softmax.
    pub lw: LogSoftmax,
    /// β, the teacher's weight in the mixture.
    pub beta: f32,
    /// 1 − β (one rounding).
    pub omb: f32,
}

impl JsdParams {
    /// From a merged pair state, τ and β.
    ///
    /// ```
    /// use grpo_core::vocab::canon::{pair_row, JsdParams};
    /// let p = JsdParams::of(&pair_row(&[0.0f32, 0.0], &[1.0f32, 1.0], 1.0), 1.0, 0.25);
    /// assert_eq!((p.lz.max, p.lw.max, p.omb), (0.0, 1.0, 0.75));
    /// ```
    #[inline]
    pub fn of(st: &PairState, tau: f32, beta: f32) -> JsdParams {
        JsdParams {
            tau,
            lz: LogSoftmax::of(&st.student()),
            lw: LogSoftmax::of(&st.teacher()),
            beta,
            omb: 1.0 - beta,
        }
    }
}

/// The JSD's per-element quantities `(lp, lq, p, q, lm)` (specified in [`jsd_step`]).
#[inline(always)]
fn jsd_parts(z: f32, w: f32, j: &JsdParams) -> (f32, f32, f32, f32, f32) {
    let lp = clamp_grad_arg(log_prob(z, j.tau, &j.lz));
    let lq = clamp_grad_arg(log_prob(w, j.tau, &j.lw));
    let p = exp_nonpos_clamped(lp);
    let q = exp_nonpos_clamped(lq);
    let lm = max_r(LN_FLOOR, ln(fma(j.beta, q, j.omb * p)));
    (lp, lq, p, q, lm)
}

/// The per-element term of the JSD's second pass (`lz`, `lw` = [`LogSoftmax`] of each row,
/// `omb` = 1 − β rounded once, all in [`JsdParams`]):
/// ```text
/// lp = clamp_grad_arg(log_prob(z, τ, lz));  lq = clamp_grad_arg(log_prob(w, τ, lw))
/// p  = exp_nonpos_clamped(lp);        q  = exp_nonpos_clamped(lq)
/// lm = max_r(LN_FLOOR, ln(fma(β, q, omb·p)))
/// term = fma(β·q, lq − lm, (omb·p)·(lp − lm))
/// ```
///
/// ```
/// use grpo_core::vocab::canon::{jsd_step, JsdParams, LogSoftmax};
/// // p_v = q_v: the term is 0
/// let l = LogSoftmax { max: 1.0, neg_ln_sum: 0.0 };
/// let j = JsdParams { tau: 1.0, lz: l, lw: l, beta: 0.5, omb: 0.5 };
/// assert_eq!(jsd_step(0.0, 0.0, &j), 0.0);
/// ```
#[inline(always)]
pub fn jsd_step(z: f32, w: f32, j: &JsdParams) -> f32 {
    let (lp, lq, p, q, lm) = jsd_parts(z, w, j);
    fma(j.beta * q, lq - lm, (j.omb * p) * (lp - lm))
}

/// The per-element term of `KL(p‖m)` (the student's half of the JSD, unweighted), which the
/// JSD's gradient subtracts: `p·(lp − lm)` with the quantities of [`jsd_step`]. Its
/// [`canonical_sum`] is the `K` of [`jsd_grad_step`].
///
/// ```
/// use grpo_core::vocab::canon::{jsd_student_step, JsdParams, LogSoftmax};
/// // two classes, p = [½, ½], q = [1, 0]-like: m_0 = β + ½(1 − β) at the first class
/// let j = JsdParams {
///     tau: 1.0,
///     lz: LogSoftmax { max: 0.0, neg_ln_sum: -core::f32::consts::LN_2 },
///     lw: LogSoftmax { max: 0.0, neg_ln_sum: 0.0 },
///     beta: 0.5,
///     omb: 0.5,
/// };
/// let t = jsd_student_step(0.0, 0.0, &j); // ½·ln(½ / ¾)
/// assert!((t - 0.5 * (2.0f32 / 3.0).ln()).abs() < 1e-7);
/// ```
#[inline(always)]
pub fn jsd_student_step(z: f32, w: f32, j: &JsdParams) -> f32 {
    let (lp, _, p, _, lm) = jsd_parts(z, w, j);
    p * (lp - lm)
}

/// [`jsd_step`] and [`jsd_student_step`] of one element pair from one evaluation of their
/// shared quantities (the same bits as the two calls): the saving JSD sums both.
///
/// ```
/// use grpo_core::vocab::canon::{jsd_step, jsd_student_step, jsd_steps, JsdParams, LogSoftmax};
/// let j = JsdParams {
///     tau: 1.0,
///     lz: LogSoftmax { max: 0.0, neg_ln_sum: -core::f32::consts::LN_2 },
///     lw: LogSoftmax { max: 0.0, neg_ln_sum: 0.0 },
///     beta: 0.3,
///     omb: 0.7,
/// };
/// assert_eq!(jsd_steps(0.0, 0.0, &j), (jsd_step(0.0, 0.0, &j), jsd_student_step(0.0, 0.0, &j)));
/// ```
#[inline(always)]
pub fn jsd_steps(z: f32, w: f32, j: &JsdParams) -> (f32, f32) {
    let (lp, lq, p, q, lm) = jsd_parts(z, w, j);
    let term = fma(j.beta * q, lq - lm, (j.omb * p) * (lp - lm));
    (term, p * (lp - lm))
}

/// One element of the JSD's gradient with respect to the student logits: with `K` the row's
/// `KL(p‖m)` (the [`canonical_sum`] of [`jsd_student_step`]) and `c = (g·omb)·τ` (the row's
/// weight `g = ∂loss/∂JSD`, two roundings),
/// ```text
/// grad = (p·((lp − lm) − K))·c
/// ```
/// with the quantities of [`jsd_step`]: `∂JSD_β/∂z_v = (1 − β)·p_v·(log p_v − log m_v −
/// KL(p‖m))/T` (see `vocab::jsd_backward_rows`).
///
/// ```
/// use grpo_core::vocab::canon::{jsd_grad_step, JsdParams, LogSoftmax};
/// // identical rows: m = p, so lp − lm = 0 and K = 0: no gradient
/// let l = LogSoftmax { max: 0.0, neg_ln_sum: -core::f32::consts::LN_2 };
/// let j = JsdParams { tau: 1.0, lz: l, lw: l, beta: 0.5, omb: 0.5 };
/// assert_eq!(jsd_grad_step(0.0, 0.0, &j, 0.0, 0.5), 0.0);
/// ```
#[inline(always)]
pub fn jsd_grad_step(z: f32, w: f32, j: &JsdParams, k: f32, c: f32) -> f32 {
    let (lp, _, p, _, lm) = jsd_parts(z, w, j);
    (p * ((lp - lm) - k)) * c
}

/// Canonical sum of `f(i)` over `0..len`: per block, 16 strided lane sums, the tree, the tail in
/// index order; block sums merged pairwise by addition ([`fold_blocks`]). Used by the JSD's
/// second pass; [`CanonicalSum`] is the same sum fed one position at a time.
///
/// ```
/// use grpo_core::vocab::canon::canonical_sum;
/// assert_eq!(canonical_sum(100, |i| i as f32), 4950.0);
/// ```
pub fn canonical_sum<T: crate::Real>(len: usize, f: impl Fn(usize) -> T) -> T {
    fold_blocks(
        len,
        |a: T, b: T| a + b,
        |start, end| {
            let n16 = start + (end - start) / LANES * LANES;
            let mut acc = [T::ZERO; LANES];
            let mut i = start;
            while i < n16 {
                for (l, a) in acc.iter_mut().enumerate() {
                    *a += f(i + l);
                }
                i += LANES;
            }
            tree(&mut acc);
            let mut s = acc[0];
            for j in n16..end {
                s += f(j);
            }
            s
        },
    )
    .unwrap_or(T::ZERO)
}

/// [`canonical_sum`] over positions `0..len`, fed one `(position, value)` at a time in
/// increasing position order; positions never pushed count as `+0`. This is how the per-token
/// losses accumulate `kl_sum` over their valid tokens (MATH.md's losses visit valid tokens in
/// position order), so a backend that computes the block sums in parallel and merges them with
/// [`PairwiseFold`] reproduces it bit for bit.
///
/// Skipping a position is exactly adding `+0`: every accumulator starts at `+0` and a
/// round-to-nearest sum is `−0` only when both operands are `−0`, so no accumulator is ever
/// `−0`, and `a + (+0) = a` for every other `a`.
///
/// ```
/// use grpo_core::vocab::canon::{canonical_sum, CanonicalSum};
/// let f = |i: usize| if i % 3 == 0 { 0.0 } else { (i as f64).sqrt() };
/// let mut s = CanonicalSum::new(5000);
/// for i in (0..5000).filter(|i| i % 3 != 0) {
///     s.push(i, f(i));
/// }
/// assert_eq!(s.finish(), canonical_sum(5000, f));
/// ```
#[derive(Debug, Clone)]
pub struct CanonicalSum<T> {
    len: usize,
    /// Start of the current block (`≥ len` once every block is closed).
    start: usize,
    acc: [T; LANES],
    /// Whether the current block's tree has been applied (its tail has started).
    in_tail: bool,
    /// Smallest position the next push may use.
    next: usize,
    fold: PairwiseFold<T>,
}

impl<T: crate::Real> CanonicalSum<T> {
    /// An empty sum over positions `0..len`.
    pub fn new(len: usize) -> Self {
        CanonicalSum {
            len,
            start: 0,
            acc: [T::ZERO; LANES],
            in_tail: false,
            next: 0,
            fold: PairwiseFold::new(),
        }
    }

    fn block_end(&self) -> usize {
        if self.len - self.start > BLOCK {
            self.start + BLOCK
        } else {
            self.len
        }
    }

    fn close_block(&mut self) {
        if !self.in_tail {
            tree(&mut self.acc);
        }
        self.fold.push(self.acc[0], |a, b| a + b);
        self.acc = [T::ZERO; LANES];
        self.in_tail = false;
        self.start = self.block_end();
    }

    /// Adds `v` at position `t`. Positions must increase from push to push and be `< len`;
    /// a position out of order or range is ignored (this type never panics).
    pub fn push(&mut self, t: usize, v: T) {
        if t >= self.len || t < self.next {
            return;
        }
        self.next = t + 1;
        while t >= self.block_end() {
            self.close_block();
        }
        let end = self.block_end();
        let n16 = self.start + (end - self.start) / LANES * LANES;
        if t < n16 {
            self.acc[(t - self.start) % LANES] += v;
        } else {
            if !self.in_tail {
                tree(&mut self.acc);
                self.in_tail = true;
            }
            self.acc[0] += v;
        }
    }

    /// The sum (`+0` for `len = 0`).
    pub fn finish(mut self) -> T {
        while self.start < self.len {
            self.close_block();
        }
        self.fold.finish(|a, b| a + b).unwrap_or(T::ZERO)
    }
}

/// Number of levels of the pairwise merge stack: enough for any `usize` block count.
const LEVELS: usize = usize::BITS as usize;

/// The canonical pairwise merge of a sequence of block states, fed one state at a time: the
/// states `b[0..n]` are reduced as `reduce(b[0..n]) = b[0]` if `n = 1`, else
/// `merge(reduce(b[0..h]), reduce(b[h..n]))` with `h` the largest power of two `< n`. A binary
/// counter of completed subtrees (no allocation) keeps at most one state per level.
///
/// Because the split points are powers of two, merging *groups* of `2^k` consecutive blocks
/// first and then folding the group results with a `PairwiseFold` gives exactly the same
/// association as folding all blocks: this is how parallel backends split a batch.
///
/// ```
/// use grpo_core::vocab::canon::PairwiseFold;
/// let mut f = PairwiseFold::new();
/// for b in ["0", "1", "2", "3", "4"] {
///     f.push(b.to_string(), |a, b| format!("({a} {b})"));
/// }
/// assert_eq!(f.finish(|a, b| format!("({a} {b})")).unwrap(), "(((0 1) (2 3)) 4)");
/// ```
#[derive(Debug, Clone)]
pub struct PairwiseFold<St> {
    stack: [Option<St>; LEVELS],
    count: usize,
}

impl<St> Default for PairwiseFold<St> {
    fn default() -> Self {
        Self::new()
    }
}

impl<St> PairwiseFold<St> {
    /// No state yet.
    pub fn new() -> Self {
        PairwiseFold {
            stack: core::array::from_fn(|_| None),
            count: 0,
        }
    }

    /// Appends the next block's state.
    pub fn push(&mut self, mut cur: St, merge: impl Fn(St, St) -> St) {
        let mut level = 0;
        // Merge with the completed subtrees that the binary counter carries into.
        while level < LEVELS && (self.count >> level) & 1 == 1 {
            if let Some(left) = self.stack[level].take() {
                cur = merge(left, cur);
            }
            level += 1;
        }
        if level < LEVELS {
            self.stack[level] = Some(cur);
        }
        self.count = self.count.wrapping_add(1);
    }

    /// The merged state of everything pushed (`None` if nothing was).
    pub fn finish(mut self, merge: impl Fn(St, St) -> St) -> Option<St> {
        // Remaining subtrees: higher levels hold lower indices, so they go on the left.
        let mut acc: Option<St> = None;
        for slot in self.stack.iter_mut() {
            if let Some(left) = slot.take() {
                acc = Some(match acc {
                    None => left,
                    Some(right) => merge(left, right),
                });
            }
        }
        acc
    }
}

/// Reduces the blocks of a row of length `len` in the canonical pairwise order.
///
/// `block(start, end)` reduces elements `start..end` (one block, see [`BLOCK`]); `merge(left,
/// right)` combines the states of two adjacent ranges. The merge order is the recursive split
/// at the largest power of two below the block count (module documentation), computed by a
/// [`PairwiseFold`]. Returns `None` when `len = 0`.
///
/// ```
/// use grpo_core::vocab::canon::{fold_blocks, BLOCK};
/// // 5 blocks: ((b0 b1)(b2 b3)) b4 — counted here as nested sums of block lengths
/// let total = fold_blocks(4 * BLOCK + 10, |a: usize, b: usize| a + b, |s, e| e - s);
/// assert_eq!(total, Some(4 * BLOCK + 10));
/// ```
pub fn fold_blocks<St>(
    len: usize,
    merge: impl Fn(St, St) -> St,
    mut block: impl FnMut(usize, usize) -> St,
) -> Option<St> {
    let mut fold = PairwiseFold::new();
    let mut start = 0usize;
    while start < len {
        let end = if len - start > BLOCK {
            start + BLOCK
        } else {
            len
        };
        fold.push(block(start, end), &merge);
        start = end;
    }
    fold.finish(merge)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::format;
    use std::string::String;

    #[test]
    fn fold_order_is_the_recursive_power_of_two_split() {
        fn recursive(b: &[String]) -> String {
            if b.len() == 1 {
                return b[0].clone();
            }
            let mut h = 1;
            while h * 2 < b.len() {
                h *= 2;
            }
            format!("({} {})", recursive(&b[..h]), recursive(&b[h..]))
        }
        for nblocks in 1..=40usize {
            let len = (nblocks - 1) * BLOCK + 7;
            let got = fold_blocks(
                len,
                |a: String, b: String| format!("({a} {b})"),
                |s, _| format!("{}", s / BLOCK),
            );
            let names: std::vec::Vec<String> = (0..nblocks).map(|i| format!("{i}")).collect();
            assert_eq!(got.unwrap(), recursive(&names), "{nblocks} blocks");
        }
        assert_eq!(fold_blocks(0, |a: u8, _| a, |_, _| 0), None);
    }

    #[test]
    fn streamed_sum_equals_canonical_sum_and_groups_of_power_of_two_blocks_fold_alike() {
        // Values with many magnitudes so that association shows in the bits.
        let f = |i: usize| {
            let x = ((i.wrapping_mul(2654435761) % 1000) as f32 - 500.0) * 1.37e-3;
            if i % 7 == 3 {
                0.0
            } else {
                x * (1.0 + (i % 13) as f32 * 1e3)
            }
        };
        for len in [
            0usize,
            1,
            15,
            16,
            17,
            2047,
            2048,
            2049,
            4096 + 33,
            5 * BLOCK + 1,
            9 * BLOCK,
        ] {
            let want = canonical_sum(len, f);
            let mut s = CanonicalSum::new(len);
            for i in (0..len).filter(|i| i % 7 != 3) {
                s.push(i, f(i));
            }
            assert_eq!(s.finish().to_bits(), want.to_bits(), "len {len}");
            // Groups of 2 and 4 blocks summed on their own, then folded: same bits.
            for group in [2 * BLOCK, 4 * BLOCK] {
                let mut fold = PairwiseFold::new();
                let mut start = 0;
                while start < len {
                    let end = (start + group).min(len);
                    let part = canonical_sum(end - start, |i| f(start + i));
                    fold.push(part, |a, b| a + b);
                    start = end;
                }
                let got = fold.finish(|a, b| a + b).unwrap_or(0.0);
                assert_eq!(got.to_bits(), want.to_bits(), "len {len}, group {group}");
            }
        }
        // Out-of-order and out-of-range pushes are ignored, never a panic.
        let mut s = CanonicalSum::new(40);
        s.push(20, 1.0f64);
        s.push(3, 100.0);
        s.push(40, 100.0);
        s.push(39, 2.0);
        assert_eq!(s.finish(), 3.0);
    }

    #[test]
    fn lse_block_follows_lanes_tree_tail() {
        // 35 elements: lanes get 2 each (32), tail 3. Compare with a hand-written order.
        let z: std::vec::Vec<f32> = (0..35)
            .map(|i| ((i * 7) % 11) as f32 * 0.37 - 1.5)
            .collect();
        let tau = 1.0 / 0.7f32;
        let mut m = f32::NEG_INFINITY;
        for &v in &z {
            m = max_r(m, v);
        }
        let mm = m + 0.0;
        // (running maximum before the block, the reference it must pick): the block's own
        // maximum first and when it lies more than 8/τ = 5.6 above; else the running one.
        let ninf = f32::NEG_INFINITY;
        let cases = [
            (ninf, mm),
            (mm + 1.0, mm + 1.0),
            (mm - 2.0, mm - 2.0),
            (mm - 10.0, mm),
        ];
        for (prior, r) in cases {
            let (st, run) = lse_block(&z, tau, prior);
            let mut s = [0.0f32; 16];
            let mut t = [0.0f32; 16];
            for i in 0..32 {
                let d = (z[i] - r) * tau;
                let e = crate::vocab::exp_ln::exp(d);
                s[i % 16] += e;
                t[i % 16] = fma(e, d, t[i % 16]);
            }
            for h in [8, 4, 2, 1] {
                for l in 0..h {
                    s[l] += s[l + h];
                    t[l] += t[l + h];
                }
            }
            for i in 32..35 {
                let d = (z[i] - r) * tau;
                let e = crate::vocab::exp_ln::exp(d);
                s[0] += e;
                t[0] = fma(e, d, t[0]);
            }
            assert_eq!(st.max.to_bits(), r.to_bits(), "prior {prior}");
            assert_eq!(st.sum.to_bits(), s[0].to_bits(), "prior {prior}");
            assert_eq!(st.dot.to_bits(), t[0].to_bits(), "prior {prior}");
            assert_eq!(run, if prior > mm { prior } else { mm });
        }
    }

    #[test]
    fn merge_matches_single_block_in_exact_cases() {
        // Two one-element blocks z = 0 and z = 0 (τ = 1): merged s = 2, t = 0 exactly.
        let ninf = f32::NEG_INFINITY;
        let a = lse_block(&[0.0f32], 1.0, ninf).0;
        let m = a.merge(a, 1.0);
        assert_eq!((m.max, m.sum, m.dot), (0.0, 2.0, 0.0));
        // Empty with non-empty: identity.
        let b = lse_block(&[1.0f32, 2.0], 1.0, ninf).0;
        assert_eq!(LseState::EMPTY.merge(b, 1.0), b);
        assert_eq!(b.merge(LseState::EMPTY, 1.0), b);
        let e = LseState::EMPTY.merge(LseState::EMPTY, 1.0);
        assert_eq!((e.max, e.sum, e.dot), (f32::NEG_INFINITY, 0.0, 0.0));
    }

    #[test]
    fn masked_block_is_empty_state() {
        let ninf = f32::NEG_INFINITY;
        let z = [ninf; 37];
        let (st, run) = lse_block(&z, 2.0, ninf);
        assert_eq!((st.max, st.sum, st.dot, run), (ninf, 0.0, 0.0, ninf));
        let (p, run) = pair_block(&z, &z, 2.0, [ninf; 2]);
        assert_eq!((p.sz, p.sw, p.u, p.v, run), (0.0, 0.0, 0.0, 0.0, [ninf; 2]));
        // After a finite block the reference is the running maximum; the sums stay 0.
        let (st, run) = lse_block(&z, 2.0, 1.5);
        assert_eq!((st.max, st.sum, st.dot, run), (1.5, 0.0, 0.0, 1.5));
        let (p, _) = pair_block(&z, &z, 2.0, [1.5, -3.0]);
        assert_eq!((p.zmax, p.wmax), (1.5, -3.0));
        assert_eq!((p.sz, p.tz, p.sw, p.u, p.v), (0.0, 0.0, 0.0, 0.0, 0.0));
    }
}
