//! The backward from the row states a forward saved: [`logprob_entropy_rows_saved`] saves one
//! [`LseState`] per row, [`kl_rows_saved`] one [`PairState`] per student/teacher row pair, and
//! [`backward_rows_saved`] / [`backward_rows_in_place_saved`] take either ([`SavedState`])
//! instead of a first pass over the logits that recomputes them.
//!
//! [`logprob_entropy_rows_saved`]: super::logprob_entropy_rows_saved
//! [`kl_rows_saved`]: super::kl_rows_saved

use super::canon::{self, GradCoef, JsdParams, LogSoftmax, LseState, PairState};
use super::ops::{
    GradTerms, KlDirection, TokenId, check_backward_args, grad_row_into, grad_row_over,
    gradient_temperature, row_of, rows_of, target, weights, weights_of,
};
#[cfg(doc)]
use super::ops::{
    MAX_GRAD_WEIGHT, backward_rows, backward_rows_in_place, jsd_backward_rows,
    jsd_backward_rows_in_place, jsd_rows, jsd_rows_saved, kl_rows_saved,
    logprob_entropy_rows_saved,
};
use crate::error::{Error, Result, check_len};

/// Largest entropy magnitude a saved state may imply ([`validate::saved`](saved)): a row's
/// entropy lies in `[0, ln V]` up to rounding, and `ln V < 45` for every `V` an index can
/// hold; 133 = 88 + 45 is the entropy bound [`MAX_GRAD_WEIGHT`]'s finiteness argument uses.
pub const MAX_SAVED_ENTROPY: f32 = 133.0;

/// Largest KL(p‖q) magnitude a saved [`PairState`] may imply ([`validate::saved`](saved)):
/// 2^65. A forward's KL is `(ln s_w − ln s_z) + u/s_z`, where `u/s_z` is a p-weighted mean of
/// log-ratios floored at −2^64 ([`canon::LOG_RATIO_FLOOR`]), so `|KL| ≤ 2^64 + 2·133` (or
/// +∞, which a KL(q‖p) forward records where KL(p‖q) is infinite); 2^65 is the KL bound
/// [`MAX_GRAD_WEIGHT`]'s finiteness argument uses.
pub const MAX_SAVED_KL: f32 = 3.6893488e19;

mod sealed {
    /// Only grpo-core's state types are saved states: their checks are part of the contract.
    pub trait Sealed {}
    impl Sealed for super::LseState {}
    impl Sealed for super::PairState {}
}

/// A row state a forward saved for [`backward_rows_saved`] \[ours\]:
///
/// | state | saved by | serves the terms |
/// |---|---|---|
/// | [`LseState`] (student row) | [`logprob_entropy_rows_saved`] | log-probability, entropy |
/// | [`PairState`] (student and teacher rows) | [`kl_rows_saved`] | log-probability, entropy, KL (either direction; KL(p‖q) refused where the state records it as +∞) |
///
/// Sealed: implemented by these two types only.
///
/// ```
/// use grpo_core::vocab::{LseState, PairState, SavedState};
/// use grpo_core::vocab::canon::{lse_row, pair_row};
/// let (z, w) = ([0.5f32, -1.0, 2.0], [0.0f32, 1.0, 1.0]);
/// let pair = pair_row(&z, &w, 1.0);
/// assert!(PairState::HAS_TEACHER && !LseState::HAS_TEACHER);
/// // the pair state's student half is the student row's own state, bit for bit
/// assert_eq!(SavedState::student(&pair), lse_row(&z, 1.0));
/// ```
pub trait SavedState: sealed::Sealed + Copy {
    /// Whether the state holds the teacher row's statistics, which a KL term needs.
    const HAS_TEACHER: bool;

    /// The student row's state.
    fn student(&self) -> LseState;

    /// The checks of [`validate::saved`](saved).
    ///
    /// # Errors
    /// As [`validate::saved`](saved).
    fn check(&self, tau: f32, index: usize) -> Result<()>;

    /// The row's backward coefficients for the weights `g_lp`, `g_h` and `g_kl` (read only
    /// with a teacher): [`GradCoef::from_lse`] or [`GradCoef::from_pair`].
    fn coef(&self, tau: f32, g_lp: f32, g_h: f32, g_kl: f32) -> GradCoef;

    /// Whether the state may serve a KL term in `direction` (after [`check`](Self::check)):
    /// a [`PairState`] whose KL(p‖q) is +∞ (`u = +∞`, which a
    /// [`KlDirection::TeacherStudent`] forward writes where the teacher is −∞ and the student
    /// is not) cannot serve a KL(p‖q) term, whose gradient is infinite there.
    ///
    /// # Errors
    /// `NonFinite{what: "saved KL(p‖q)", index}` in that case.
    fn check_kl_term(&self, direction: KlDirection, index: usize) -> Result<()> {
        let _ = (direction, index);
        Ok(())
    }
}

impl SavedState for LseState {
    const HAS_TEACHER: bool = false;

    fn student(&self) -> LseState {
        *self
    }

    fn check(&self, tau: f32, index: usize) -> Result<()> {
        let (lse, _, h) = canon::finish_lse(self, tau);
        let finite = [self.max, self.max * tau, self.sum, self.dot, lse, h];
        if !finite.iter().all(|x| x.is_finite()) {
            return Err(Error::NonFinite {
                what: "saved",
                index,
            });
        }
        crate::error::ensure(
            self.sum >= 0.5 && h.abs() <= MAX_SAVED_ENTROPY,
            "saved",
            "not a forward's row state: sum < 0.5 or |entropy| > 133",
        )
    }

    fn coef(&self, tau: f32, g_lp: f32, g_h: f32, _g_kl: f32) -> GradCoef {
        GradCoef::from_lse(self, tau, g_lp, g_h)
    }
}

impl SavedState for PairState {
    const HAS_TEACHER: bool = true;

    fn student(&self) -> LseState {
        PairState::student(self)
    }

    fn check(&self, tau: f32, index: usize) -> Result<()> {
        self.student().check(tau, index)?;
        self.teacher().check(tau, index)?;
        // KL(p‖q) = +∞ is a state's record that the teacher is −∞ where the student is not
        // (`check_kl_term` refuses it for a KL(p‖q) term; nothing else reads it).
        let (pq, qp) = canon::finish_kl(self);
        if !((pq.is_finite() || pq == f32::INFINITY) && qp.is_finite()) {
            return Err(Error::NonFinite {
                what: "saved",
                index,
            });
        }
        crate::error::ensure(
            pq == f32::INFINITY || pq.abs() <= MAX_SAVED_KL,
            "saved",
            "not a forward's pair state: |KL(p‖q)| > 2^65",
        )
    }

    fn coef(&self, tau: f32, g_lp: f32, g_h: f32, g_kl: f32) -> GradCoef {
        GradCoef::from_pair(self, tau, g_lp, g_h, g_kl)
    }

    fn check_kl_term(&self, direction: KlDirection, index: usize) -> Result<()> {
        if direction == KlDirection::StudentTeacher && canon::finish_kl(self).0 == f32::INFINITY {
            return Err(Error::NonFinite {
                what: "saved KL(p‖q)",
                index,
            });
        }
        Ok(())
    }
}

/// Validates the saved forward state of row `index` for a backward at `τ` = `tau`: the
/// checks that make every coefficient [`SavedState::coef`] derives from it finite and
/// bounded, so that the gradient of the row it was saved from is finite (as
/// [`backward_rows`]'s, see [`MAX_GRAD_WEIGHT`]).
///
/// A forward's row state has `sum ≥ 1` up to rounding (the row's largest logit contributes
/// `e^{(z_max − max)/T} ≥ 1`) and an entropy in `[0, ln V]`; the checks are looser than that
/// by a wide margin, and reject what cannot be such a state.
///
/// # Errors
/// For an [`LseState`]: `NonFinite{what: "saved", index}` when `max`, `max·τ`, `sum`, `dot`,
/// or the log-sum-exp or entropy they imply, is not finite; `InvalidParam{name: "saved"}`
/// when `sum < 0.5` or `|H| >` [`MAX_SAVED_ENTROPY`]. For a [`PairState`]: those checks of
/// the student's half, then of the teacher's, then `NonFinite{what: "saved", index}` when
/// KL(q‖p) ([`canon::finish_kl`]) is not finite or KL(p‖q) is NaN or −∞, and
/// `InvalidParam{name: "saved"}` when `|KL(p‖q)| >` [`MAX_SAVED_KL`] but finite. KL(p‖q) =
/// +∞ is a valid state: the record a KL(q‖p) forward leaves where the teacher is −∞ and the
/// student is not ([`kl_rows_saved`]); [`SavedState::check_kl_term`] refuses it for a
/// KL(p‖q) term.
///
/// ```
/// use grpo_core::vocab::{validate::saved, LseState, PairState};
/// assert!(saved(&LseState { max: 0.0, sum: 2.0, dot: 0.0 }, 1.0, 0).is_ok());
/// assert!(saved(&LseState { max: f32::NEG_INFINITY, sum: 2.0, dot: 0.0 }, 1.0, 0).is_err());
/// assert!(saved(&LseState { max: 0.0, sum: 0.0, dot: 0.0 }, 1.0, 0).is_err());
/// // two rows of two equal logits 0: both halves valid, KL = 0
/// let pair = PairState { zmax: 0.0, sz: 2.0, tz: 0.0, wmax: 0.0, sw: 2.0, tw: 0.0, u: 0.0, v: 0.0 };
/// assert!(saved(&pair, 1.0, 0).is_ok());
/// assert!(saved(&PairState { sw: 0.25, ..pair }, 1.0, 0).is_err());
/// ```
pub fn saved<St: SavedState>(st: &St, tau: f32, index: usize) -> Result<()> {
    st.check(tau, index)
}

/// The checks of [`backward_rows_saved`] (with `out = Some(out.len())`) and
/// [`backward_rows_in_place_saved`] (`out = None`), in their order, with their errors: the
/// arguments, then row by row the saved state ([`saved`], then
/// [`SavedState::check_kl_term`] with a KL term) and the target logit ([`target`],
/// against the student state's reference maximum). Returns `(τ, rows)`. Public so that other
/// backends (grpo-wgpu) reject exactly what these functions reject.
///
/// # Errors
/// As [`backward_rows_saved`].
///
/// ```
/// use grpo_core::vocab::{validate::backward_saved, GradTerms, LseState};
/// let saved = [LseState { max: 0.0, sum: 2.0, dot: 0.0 }];
/// let terms: GradTerms<'_, u32> = GradTerms { logp: Some((&[1], &[1.0])), entropy: None, kl: None };
/// assert_eq!(backward_saved(&[0.0f32, 0.0], 2, 0.5, &saved, &terms, Some(2)), Ok((2.0, 1)));
/// // the gradient has one element per logit
/// assert!(backward_saved(&[0.0f32, 0.0], 2, 0.5, &saved, &terms, Some(3)).is_err());
/// ```
pub fn backward_saved<S: super::Logit, I: TokenId, U: super::Logit, St: SavedState>(
    logits: &[S],
    vocab: usize,
    temperature: f32,
    saved_states: &[St],
    terms: &GradTerms<'_, I, U>,
    out: Option<usize>,
) -> Result<(f32, usize)> {
    let n = Some((saved_states.len(), St::HAS_TEACHER));
    let (tau, rows) = check_backward_args(logits.len(), vocab, temperature, terms, out, n)?;
    for (r, st) in saved_states.iter().enumerate() {
        saved(st, tau, r)?;
        if let Some(k) = &terms.kl {
            st.check_kl_term(k.direction, r)?;
        }
        if let Some((t, _)) = terms.logp {
            let z = row_of(logits, vocab, r);
            target(z, t[r].index(), st.student().max, tau, r * vocab, r)?;
        }
    }
    Ok((tau, rows))
}

/// The coefficients of row `r` from its saved state, and its target index (or `usize::MAX`).
fn coef_of_saved<I: TokenId, U, St: SavedState>(
    st: &St,
    tau: f32,
    terms: &GradTerms<'_, I, U>,
    r: usize,
) -> (GradCoef, usize) {
    let (g_lp, g_h, y) = weights_of(terms, r);
    let g_kl = terms.kl.as_ref().map_or(0.0, |k| k.grad[r]);
    (st.coef(tau, g_lp, g_h, g_kl), y)
}

/// [`backward_rows`] from the row states a forward saved instead of a pass over the logits to
/// recompute them \[ours\]: one read of each logit (and teacher logit) and one write of its
/// gradient. The same formulas and, for states saved from these logits at this temperature,
/// the same bits as [`backward_rows`] (whose first pass computes exactly those states): each
/// element is [`canon::grad_step`] with [`SavedState::coef`] of `saved[r]`.
///
/// `saved` holds [`LseState`]s ([`logprob_entropy_rows_saved`]: log-probability and entropy
/// terms) or [`PairState`]s ([`kl_rows_saved`]: any terms, a KL term in either direction
/// included — a KL(p‖q) term is refused on a state whose KL(p‖q) is +∞; the teacher logits of
/// the KL term are read again for `log q_v`). `U` is the
/// teacher storage type of `terms`' KL term: with `LseState`s it must be absent, and `U`
/// lets one `GradTerms` value serve this function and [`backward_rows`].
///
/// **The logits are not validated**: they (and the teacher's) must be the ones the states
/// were saved from, unchanged, and `temperature` the forward's. Only the target logits are
/// read before the gradient is written (the check of `logits[target]`); the KL support is
/// not read from the logits: the saving forward checked its direction's and records an
/// infinite KL(p‖q) in the state, so that a KL(p‖q) term is refused where [`backward_rows`]
/// refuses it ([`SavedState::check_kl_term`]; KL(q‖p)'s gradient `(p_v − q_v)/T` is finite
/// whatever the support). For other logits the result is
/// meaningless, and a NaN or +∞ logit gives a NaN, infinite or huge gradient, not an error
/// (never a panic); a log-probability above 88 enters the exponential as 88
/// ([`clamp_grad_arg`](super::exp_ln::clamp_grad_arg)), so every backend gives these bits.
///
/// # Errors
/// In this order: `InvalidParam{name: "temperature"}` (as [`backward_rows`]),
/// `InvalidParam{name: "vocab"}`, `LengthMismatch{what: "logits" | "out" | "saved"}`,
/// `InvalidParam{name: "kl"}` when `terms.kl` is given with `LseState`s (the KL term needs
/// the teacher's state), `LengthMismatch{what: "targets" | "grad_logp" | "grad_entropy" |
/// "teacher" | "grad_kl"}`, the weights' `NonFinite` / `InvalidParam`, `TokenOutOfRange`,
/// then row by row the state ([`validate::saved`](saved)), `NonFinite{what: "saved KL(p‖q)",
/// index: r}` for a KL(p‖q) term on a state whose KL(p‖q) is +∞
/// ([`SavedState::check_kl_term`]) and `NonFinite{what: "logits[target]", index: r·V + y}`
/// when `(z_y − max)·τ` is not finite. On `Err`, `out` is untouched.
///
/// ```
/// use grpo_core::vocab::{backward_rows, backward_rows_saved, logprob_entropy_rows_saved};
/// use grpo_core::vocab::{GradTerms, LseState};
/// let z = [0.5f32, -1.0, 2.0, /* row 1 */ 0.0, 0.0, f32::NEG_INFINITY];
/// let (mut lp, mut h, mut saved) = ([0.0f32; 2], [0.0f32; 2], [LseState::EMPTY; 2]);
/// logprob_entropy_rows_saved(&z, 3, &[2u32, 0], 1.0, &mut lp, Some(&mut h), &mut saved)
///     .unwrap();
/// // loss = Σ_r (−logp_r − 0.01·H_r)
/// let terms: GradTerms<'_, u32> =
///     GradTerms { logp: Some((&[2, 0], &[-1.0, -1.0])), entropy: Some(&[-0.01; 2]), kl: None };
/// let (mut g, mut g_again) = ([0.0f32; 6], [0.0f32; 6]);
/// backward_rows_saved(&z, 3, 1.0, &saved, &terms, &mut g).unwrap();
/// backward_rows(&z, 3, 1.0, &terms, &mut g_again).unwrap();
/// assert_eq!(g, g_again);
/// // row 1: p = (½, ½, 0), H = ln 2: ∂/∂z_0 = −(1 − ½) − 0.01·(−½)(ln ½ + ln 2) = −½
/// assert_eq!((g[3], g[4], g[5]), (-0.5, 0.5, 0.0));
/// ```
///
/// Distillation, from the pair states of the KL forward:
///
/// ```
/// use grpo_core::vocab::{backward_rows, backward_rows_saved, kl_rows_saved};
/// use grpo_core::vocab::{GradTerms, KlDirection, KlTerm, PairState};
/// let z = [0.5f32, -1.0, 2.0, /* row 1 */ 0.0, 0.0, 1.0];
/// let w = [0.0f32, -1.0, 2.5, /* row 1 */ 1.0, 0.0, 0.0];
/// let (mut kl, mut saved) = ([0.0f32; 2], [PairState::EMPTY; 2]);
/// kl_rows_saved(&z, &w, 3, 1.0, KlDirection::TeacherStudent, &mut kl, &mut saved).unwrap();
/// // loss = Σ_r KL_r(q‖p)
/// let kl_term = KlTerm { teacher: &w[..], grad: &[1.0, 1.0], direction: KlDirection::TeacherStudent };
/// let terms: GradTerms<'_, u32> = GradTerms { logp: None, entropy: None, kl: Some(kl_term) };
/// let (mut g, mut g_again) = ([0.0f32; 6], [0.0f32; 6]);
/// backward_rows_saved(&z, 3, 1.0, &saved, &terms, &mut g).unwrap();
/// backward_rows(&z, 3, 1.0, &terms, &mut g_again).unwrap();
/// assert_eq!(g, g_again);
/// // ∂KL(q‖p)/∂z_v = p_v − q_v: each row's gradient sums to 0
/// assert!((g[3] + g[4] + g[5]).abs() < 1e-6);
/// ```
pub fn backward_rows_saved<S: super::Logit, I: TokenId, U: super::Logit, St: SavedState>(
    logits: &[S],
    vocab: usize,
    temperature: f32,
    saved: &[St],
    terms: &GradTerms<'_, I, U>,
    out: &mut [f32],
) -> Result<()> {
    let (tau, rows) = backward_saved(logits, vocab, temperature, saved, terms, Some(out.len()))?;
    let kg = terms.kl_grad();
    for r in 0..rows {
        let (c, y) = coef_of_saved(&saved[r], tau, terms, r);
        let w = terms.kl.as_ref().map(|k| row_of(k.teacher, vocab, r));
        let o = &mut out[r * vocab..(r + 1) * vocab];
        grad_row_into(row_of(logits, vocab, r), w, &c, y, kg, o);
    }
    Ok(())
}

/// [`backward_rows_saved`] writing the gradient over the logits themselves, rounded to their
/// storage type `S` by `S::from_f32` (ties to even) \[ours\]: for states saved from these
/// logits, the bits of [`backward_rows_in_place`].
///
/// The same precondition (the logits the states were saved from, the forward's temperature)
/// and the same errors, in the same order, as [`backward_rows_saved`]; on `Err` the logits
/// are untouched.
///
/// ```
/// use grpo_core::vocab::{backward_rows_in_place_saved, logprob_entropy_rows_saved};
/// use grpo_core::vocab::{GradTerms, LseState};
/// // [0, 0], target 0, ∂loss/∂logp = 1: the gradient (½, −½) replaces the logits
/// let mut z = [0.0f32, 0.0];
/// let (mut lp, mut saved) = ([0.0f32; 1], [LseState::EMPTY; 1]);
/// logprob_entropy_rows_saved(&z, 2, &[0u32], 1.0, &mut lp, None, &mut saved).unwrap();
/// let terms: GradTerms<'_, u32> = GradTerms { logp: Some((&[0], &[1.0])), entropy: None, kl: None };
/// backward_rows_in_place_saved(&mut z, 2, 1.0, &saved, &terms).unwrap();
/// assert_eq!(z, [0.5, -0.5]);
/// ```
pub fn backward_rows_in_place_saved<
    S: super::Logit,
    I: TokenId,
    U: super::Logit,
    St: SavedState,
>(
    logits: &mut [S],
    vocab: usize,
    temperature: f32,
    saved: &[St],
    terms: &GradTerms<'_, I, U>,
) -> Result<()> {
    let (tau, rows) = backward_saved(logits, vocab, temperature, saved, terms, None)?;
    let kg = terms.kl_grad();
    for r in 0..rows {
        let (c, y) = coef_of_saved(&saved[r], tau, terms, r);
        let w = terms.kl.as_ref().map(|k| row_of(k.teacher, vocab, r));
        grad_row_over(&mut logits[r * vocab..(r + 1) * vocab], w, &c, y, kg);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The JSD's gradient from saved states.

/// What [`jsd_rows_saved`] saves per student/teacher row pair for [`jsd_backward_rows_saved`]
/// \[ours\]: the row constants of the JSD's gradient (see [`jsd_backward_rows`]).
///
/// The gradient `(1 − β)·p_v·(log p_v − log m_v − K)/T` needs both rows' log-softmax
/// constants, β and `K = KL(p‖m)`, a sum over the whole row pair: with them saved, the
/// backward is one pass over the rows. β is saved because `K` depends on it: the backward
/// takes β from the state, so it cannot be given another one than the forward's. (The state
/// holds no other sums of the pair: computing the entropies' and KLs' sums too, as
/// [`kl_rows_saved`]' [`PairState`] does, measured 10–40 % slower in the JSD's first pass.)
///
/// ```
/// use grpo_core::vocab::{jsd_rows_saved, JsdState};
/// let (z, w) = ([1.0f32, 2.0], [1.0f32, 2.0]);
/// let (mut j, mut saved) = ([0.0f32; 1], [JsdState::EMPTY; 1]);
/// jsd_rows_saved(&z, &w, 2, 0.25, 1.0, &mut j, &mut saved).unwrap();
/// // identical rows: m = p, so the JSD and K are 0
/// assert_eq!((j[0], saved[0].kl_pm, saved[0].beta), (0.0, 0.0, 0.25));
/// assert_eq!(saved[0].student, saved[0].teacher);
/// assert_eq!(saved[0].student.max, 2.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JsdState {
    /// The student row's log-softmax constants: its reference `r` ([`LseState::max`]: the
    /// row's raw maximum, or up to [`OFFSET_SLACK`](canon::OFFSET_SLACK)`/τ` below it) and
    /// `−ln s`, `s = Σ_v e^{(z_v − r)/T}`, so that `log p_v = (z_v − r)/T − ln s`.
    pub student: LogSoftmax,
    /// The teacher row's.
    pub teacher: LogSoftmax,
    /// β, the teacher's weight in the mixture `m = βq + (1 − β)p`.
    pub beta: f32,
    /// `K = KL(p‖m)`, unclamped (the [`canonical_sum`](canon::canonical_sum) of
    /// [`canon::jsd_student_step`]).
    pub kl_pm: f32,
}

impl JsdState {
    /// A placeholder for output buffers: both maxima −∞, β = 0, K = 0 (not a forward's
    /// state: [`validate::jsd_saved`](jsd_saved) rejects it).
    pub const EMPTY: JsdState = JsdState {
        student: LogSoftmax {
            max: f32::NEG_INFINITY,
            neg_ln_sum: 0.0,
        },
        teacher: LogSoftmax {
            max: f32::NEG_INFINITY,
            neg_ln_sum: 0.0,
        },
        beta: 0.0,
        kl_pm: 0.0,
    };

    /// The state of a row pair from its [`JsdParams`] (the forward's second pass) and `K`.
    ///
    /// ```
    /// use grpo_core::vocab::canon::{pair_row, JsdParams};
    /// use grpo_core::vocab::JsdState;
    /// let j = JsdParams::of(&pair_row(&[0.0f32, 1.0], &[1.0f32, 0.0], 1.0), 1.0, 0.5);
    /// let st = JsdState::of(&j, 0.125);
    /// assert_eq!((st.student, st.teacher, st.beta, st.kl_pm), (j.lz, j.lw, 0.5, 0.125));
    /// ```
    #[inline]
    pub fn of(j: &JsdParams, kl_pm: f32) -> JsdState {
        JsdState {
            student: j.lz,
            teacher: j.lw,
            beta: j.beta,
            kl_pm,
        }
    }

    /// The per-row constants of the gradient's elements ([`canon::jsd_grad_step`]) for the
    /// row weight `g = ∂loss/∂JSD` at `τ` = `tau`: the row's [`JsdParams`] (`1 − β` rounded
    /// once), `K`, and `c = (g·(1 − β))·τ` (two roundings).
    ///
    /// ```
    /// use grpo_core::vocab::JsdState;
    /// let st = JsdState { beta: 0.25, kl_pm: 0.5, ..JsdState::EMPTY };
    /// let (j, k, c) = st.grad_params(2.0, 4.0);
    /// assert_eq!((j.omb, k, c), (0.75, 0.5, 6.0));
    /// ```
    #[inline]
    pub fn grad_params(&self, tau: f32, g: f32) -> (JsdParams, f32, f32) {
        let omb = 1.0 - self.beta;
        let j = JsdParams {
            tau,
            lz: self.student,
            lw: self.teacher,
            beta: self.beta,
            omb,
        };
        (j, self.kl_pm, (g * omb) * tau)
    }
}

/// The bounds of a forward's `−ln s`: `s = Σ_v e^{(z_v − r)/T}` relative to the row's
/// reference `r` is at least 1 (the maximum's term, up to rounding) and at most
/// `V·e^{OFFSET_SLACK}` (`r` lies at most `OFFSET_SLACK/τ` below the maximum, and `V < 2^64`):
/// `[−53, ln 2]`, as loose as [`validate::saved`](saved)'s `s ≥ ½`.
const NEG_LN_SUM_RANGE: (f32, f32) = (-53.0, core::f32::consts::LN_2);

/// Validates the saved [`JsdState`] of row pair `index` for a backward at `τ` = `tau`: the
/// checks that keep the gradient it implies finite (as [`jsd_backward_rows`]'s; see
/// [`MAX_GRAD_WEIGHT`]: with `|K| ≤ 133`, `|log p_v − log m_v| ≤ 88 + 104` and `c ≤ 10^15`
/// every element is below 4·10^17) and reject what no forward saves.
///
/// A forward's state has each row's `−ln s` in `[−ln V − 8, 0]` and `0 ≤ K ≤ −ln(1 − β)` up to
/// rounding (`m_v ≥ (1 − β)p_v`), at most 16.7 for an f32 β below 1: the bounds below are
/// loose by far.
///
/// # Errors
/// In this order: for the student's constants, then the teacher's, `NonFinite{what: "saved",
/// index}` when `max`, `max·τ` or `neg_ln_sum` is not finite and `InvalidParam{name:
/// "saved"}` when `neg_ln_sum` is outside `[−53, ln 2]`; then `InvalidParam{name: "saved"}`
/// unless `0 < β < 1`, `NonFinite{what: "saved", index}` for a `K` that is not finite and
/// `InvalidParam{name: "saved"}` for `|K| >` [`MAX_SAVED_ENTROPY`] (133).
///
/// ```
/// use grpo_core::vocab::{validate::jsd_saved, JsdState};
/// use grpo_core::vocab::canon::LogSoftmax;
/// let half = LogSoftmax { max: 0.0, neg_ln_sum: -core::f32::consts::LN_2 };
/// let st = JsdState { student: half, teacher: half, beta: 0.5, kl_pm: 0.0 };
/// assert!(jsd_saved(&st, 1.0, 0).is_ok());
/// assert!(jsd_saved(&JsdState { beta: 1.0, ..st }, 1.0, 0).is_err());
/// assert!(jsd_saved(&JsdState { kl_pm: f32::NAN, ..st }, 1.0, 0).is_err());
/// assert!(jsd_saved(&JsdState::EMPTY, 1.0, 0).is_err());
/// ```
pub fn jsd_saved(st: &JsdState, tau: f32, index: usize) -> Result<()> {
    for ls in [&st.student, &st.teacher] {
        if !(ls.max.is_finite() && (ls.max * tau).is_finite() && ls.neg_ln_sum.is_finite()) {
            return Err(Error::NonFinite {
                what: "saved",
                index,
            });
        }
        let (lo, hi) = NEG_LN_SUM_RANGE;
        crate::error::ensure(
            (lo..=hi).contains(&ls.neg_ln_sum),
            "saved",
            "not a JSD forward's state: −ln s outside [−53, ln 2]",
        )?;
    }
    crate::error::ensure(
        st.beta > 0.0 && st.beta < 1.0,
        "saved",
        "not a JSD forward's state: β outside (0, 1)",
    )?;
    if !st.kl_pm.is_finite() {
        return Err(Error::NonFinite {
            what: "saved",
            index,
        });
    }
    crate::error::ensure(
        st.kl_pm.abs() <= MAX_SAVED_ENTROPY,
        "saved",
        "not a JSD forward's state: |KL(p‖m)| > 133",
    )
}

/// The checks of [`jsd_backward_rows_saved`] (`out` = its length) and
/// [`jsd_backward_rows_in_place_saved`] (`out` = the student's length), in their order, with
/// their errors; the slices by their lengths, the weights and states themselves (these
/// backwards read no logit before they write). Returns `(τ, rows)`. Public so that other
/// backends (grpo-wgpu) reject exactly what these functions reject.
///
/// # Errors
/// As [`jsd_backward_rows_saved`].
///
/// ```
/// use grpo_core::vocab::{validate::jsd_backward_saved, JsdState};
/// use grpo_core::vocab::canon::LogSoftmax;
/// let half = LogSoftmax { max: 0.0, neg_ln_sum: -core::f32::consts::LN_2 };
/// let saved = [JsdState { student: half, teacher: half, beta: 0.5, kl_pm: 0.0 }];
/// assert_eq!(jsd_backward_saved(2, 2, 2, 0.5, &saved, &[1.0], 2), Ok((2.0, 1)));
/// // one state per row pair
/// assert!(jsd_backward_saved(4, 4, 2, 0.5, &saved, &[1.0; 2], 4).is_err());
/// ```
pub fn jsd_backward_saved(
    student: usize,
    teacher: usize,
    vocab: usize,
    temperature: f32,
    saved_states: &[JsdState],
    grad: &[f32],
    out: usize,
) -> Result<(f32, usize)> {
    let tau = gradient_temperature(temperature)?;
    crate::error::ensure(vocab > 0, "vocab", "must be > 0")?;
    let rows = student / vocab;
    rows_of("student", student, vocab, rows)?;
    rows_of("teacher", teacher, vocab, rows)?;
    check_len("out", student, out)?;
    check_len("saved", rows, saved_states.len())?;
    check_len("grad_jsd", rows, grad.len())?;
    weights("grad_jsd", grad, rows)?;
    for (r, st) in saved_states.iter().enumerate() {
        jsd_saved(st, tau, r)?;
    }
    Ok((tau, rows))
}

/// [`jsd_backward_rows`] from the states [`jsd_rows_saved`] saved instead of two passes over
/// the rows that recompute them \[ours\]: one read of each student and teacher logit and one
/// write of its gradient, `out[r, v] = g[r]·∂JSD_β,r/∂z[r, v]` with β from `saved[r]`. Each
/// element is [`canon::jsd_grad_step`] with [`JsdState::grad_params`], so for states saved
/// from these rows at this temperature the bits are those of [`jsd_backward_rows`] with the
/// forward's β.
///
/// **The logits are not validated**: they must be the ones the states were saved from,
/// unchanged, and `temperature` the forward's (the states do not record it). For other
/// logits the result is meaningless, and a NaN or +∞ logit gives a NaN, infinite or huge
/// gradient, not an error (never a panic); a log-probability above 88 enters the exponential
/// as 88 ([`clamp_grad_arg`](super::exp_ln::clamp_grad_arg)), so every backend gives these
/// bits.
///
/// # Errors
/// In this order: `InvalidParam{name: "temperature"}` (as [`jsd_backward_rows`]: `T ≥`
/// [`MIN_GRAD_TEMPERATURE`](super::MIN_GRAD_TEMPERATURE)), `InvalidParam{name: "vocab"}` for
/// `V = 0`, `LengthMismatch{what: "student" | "teacher" | "out" | "saved" | "grad_jsd"}`
/// (`rows = student.len() / V`), the weights' `NonFinite{what: "grad_jsd"}` /
/// `InvalidParam{name: "grad_jsd"}` (as [`jsd_backward_rows`]), then row by row the state
/// ([`validate::jsd_saved`](jsd_saved)). On `Err`, `out` is untouched.
///
/// ```
/// use grpo_core::vocab::{jsd_backward_rows, jsd_backward_rows_saved, jsd_rows_saved, JsdState};
/// let z = [0.5f32, -1.0, 2.0, /* row 1 */ 0.0, 0.0, f32::NEG_INFINITY];
/// let w = [1.0f32, 0.0, -0.5, /* row 1 */ f32::NEG_INFINITY, 0.0, 0.0];
/// let (mut jsd, mut saved) = ([0.0f32; 2], [JsdState::EMPTY; 2]);
/// jsd_rows_saved(&z, &w, 3, 0.5, 1.0, &mut jsd, &mut saved).unwrap();
/// // loss = Σ_r JSD_r
/// let (mut g, mut g_again) = ([0.0f32; 6], [0.0f32; 6]);
/// jsd_backward_rows_saved(&z, &w, 3, 1.0, &saved, &[1.0; 2], &mut g).unwrap();
/// jsd_backward_rows(&z, &w, 3, 0.5, 1.0, &[1.0; 2], &mut g_again).unwrap();
/// assert_eq!(g, g_again);
/// // a masked student entry gets no gradient; each row's gradient sums to 0
/// assert_eq!(g[5], 0.0);
/// assert!((g[3] + g[4]).abs() < 1e-7);
/// ```
pub fn jsd_backward_rows_saved<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    vocab: usize,
    temperature: f32,
    saved: &[JsdState],
    grad: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let (n, m) = (student.len(), teacher.len());
    let (tau, rows) = jsd_backward_saved(n, m, vocab, temperature, saved, grad, out.len())?;
    for r in 0..rows {
        let (j, k, c) = saved[r].grad_params(tau, grad[r]);
        let (z, w) = (row_of(student, vocab, r), row_of(teacher, vocab, r));
        let o = &mut out[r * vocab..(r + 1) * vocab];
        for ((o, z), w) in o.iter_mut().zip(z).zip(w) {
            *o = canon::jsd_grad_step(z.to_f32(), w.to_f32(), &j, k, c);
        }
    }
    Ok(())
}

/// [`jsd_backward_rows_saved`] writing the gradient over the student logits themselves,
/// rounded to their storage type `S` by `S::from_f32` (ties to even) \[ours\]: for states
/// saved from these rows, the bits of [`jsd_backward_rows_in_place`].
///
/// The same precondition (the rows the states were saved from, the forward's temperature) and
/// the same errors, in the same order, as [`jsd_backward_rows_saved`] (without `out`); on
/// `Err` the logits are untouched.
///
/// ```
/// use grpo_core::vocab::{jsd_backward_rows_in_place_saved, jsd_backward_rows_saved};
/// use grpo_core::vocab::{jsd_rows_saved, JsdState};
/// let (z, w) = ([0.5f32, -1.0, 2.0], [1.0f32, 0.0, -0.5]);
/// let (mut jsd, mut saved) = ([0.0f32; 1], [JsdState::EMPTY; 1]);
/// jsd_rows_saved(&z, &w, 3, 0.5, 1.0, &mut jsd, &mut saved).unwrap();
/// let mut g = [0.0f32; 3];
/// jsd_backward_rows_saved(&z, &w, 3, 1.0, &saved, &[1.0], &mut g).unwrap();
/// let mut zb = z.map(half::bf16::from_f32);
/// jsd_backward_rows_in_place_saved(&mut zb, &w, 3, 1.0, &saved, &[1.0]).unwrap();
/// assert_eq!(zb, g.map(half::bf16::from_f32));
/// ```
pub fn jsd_backward_rows_in_place_saved<S: super::Logit, U: super::Logit>(
    student: &mut [S],
    teacher: &[U],
    vocab: usize,
    temperature: f32,
    saved: &[JsdState],
    grad: &[f32],
) -> Result<()> {
    let (n, m) = (student.len(), teacher.len());
    let (tau, rows) = jsd_backward_saved(n, m, vocab, temperature, saved, grad, n)?;
    for r in 0..rows {
        let (j, k, c) = saved[r].grad_params(tau, grad[r]);
        let span = r * vocab..(r + 1) * vocab;
        for (z, w) in student[span.clone()].iter_mut().zip(&teacher[span]) {
            *z = S::from_f32(canon::jsd_grad_step(z.to_f32(), w.to_f32(), &j, k, c));
        }
    }
    Ok(())
}
