//! grpo-core's vocabulary row operations (`grpo_core::vocab`), fast: SIMD lanes and whole rows
//! per thread, with the same results bit for bit and the same errors.
//!
//! Validation is fused into the computation: the kernels' streaming pass also checks every
//! logit (NaN/+∞, masked rows, overflow of `max/T`, KL support), so the data is read once.
//! Results go to a small per-row buffer first; only when every row passed are the caller's
//! outputs written. When anything is wrong, the call is handed to grpo-core's own function,
//! which reports exactly the error grpo-core reports (and leaves the outputs untouched).

use grpo_core::Result;
use grpo_core::vocab::canon::{self, GradCoef, JsdParams, KlGrad, LseState, PairState, finish_kl};
use grpo_core::vocab::validate::jsd_backward_saved;
use grpo_core::vocab::{
    GradTerms, JsdState, KlDirection, MAX_GRAD_WEIGHT, MIN_GRAD_TEMPERATURE, SavedState, TokenId,
};
use rayon::prelude::*;

use crate::arch;
use crate::backend::Pass;
use crate::cpu::Cpu;
use crate::kernels::vocab::{
    GradRows, GradRowsInPlace, JsdGradRows, JsdGradRowsInPlace, JsdRows, JsdSavedDest,
    JsdSavedGradRows, Load, LseRows, PairFlags, PairNeed, PairRows, lse_ok, pair_ok,
};

thread_local! {
    static FALLBACKS: core::cell::Cell<usize> = const { core::cell::Cell::new(0) };
}

/// How many calls on this thread were handed to grpo-core (because validation found
/// something wrong). For tests: valid input must take the fast path.
#[doc(hidden)]
pub fn fallbacks_on_this_thread() -> usize {
    FALLBACKS.with(|c| c.get())
}

fn note_fallback() {
    FALLBACKS.with(|c| c.set(c.get() + 1));
}

/// Counts the hand-over to grpo-core, then returns the closure that performs it.
fn fallback<F>(core: F) -> F {
    note_fallback();
    core
}

/// `τ = 1/T` when grpo-core accepts `T`.
fn tau_of(temperature: f32) -> Option<f32> {
    grpo_core::vocab::validate::inverse_temperature(temperature).ok()
}

/// `rows · vocab == len` with `vocab > 0` and no overflow.
fn shape_ok(len: usize, vocab: usize, rows: usize) -> bool {
    vocab > 0 && rows.checked_mul(vocab) == Some(len)
}

/// The shapes of a row-pair forward: both rows hold `rows · vocab` elements (as [`shape_ok`])
/// and `saved_out`, when the forward saves states (`saved_len`), one per row.
fn pair_shapes_ok(n: usize, m: usize, vocab: usize, rows: usize, saved_len: Option<usize>) -> bool {
    shape_ok(n, vocab, rows) && shape_ok(m, vocab, rows) && saved_len.is_none_or(|s| s == rows)
}

/// grpo-core's weight check: finite and |g| ≤ MAX_GRAD_WEIGHT.
fn weights_ok(g: &[f32], rows: usize) -> bool {
    g.len() == rows && g.iter().all(|x| x.abs() <= MAX_GRAD_WEIGHT)
}

/// grpo-core's target check on a validated row: `(z_y − max)·τ` finite.
fn target_ok(zy: f32, tau: f32, st: &LseState) -> bool {
    ((zy - st.max) * tau).is_finite()
}

/// grpo-core's backward checks that read no logit (`check_backward_args`): `(τ, rows)` when
/// they pass.
fn backward_args_ok<I: TokenId, U: Load>(
    logits: usize,
    vocab: usize,
    temperature: f32,
    terms: &GradTerms<'_, I, U>,
) -> Option<(f32, usize)> {
    let tau = tau_of(temperature)?;
    // `tau_of` passed, so `temperature` is finite and > 0 here (no NaN to compare).
    if vocab == 0 || temperature < MIN_GRAD_TEMPERATURE {
        return None;
    }
    let rows = logits / vocab;
    if !shape_ok(logits, vocab, rows) {
        return None;
    }
    if let Some((t, g)) = terms.logp
        && (t.len() != rows || !weights_ok(g, rows) || t.iter().any(|t| t.index() >= vocab))
    {
        return None;
    }
    if let Some(g) = terms.entropy
        && !weights_ok(g, rows)
    {
        return None;
    }
    if let Some(k) = &terms.kl
        && (!shape_ok(k.teacher.len(), vocab, rows) || !weights_ok(k.grad, rows))
    {
        return None;
    }
    Some((tau, rows))
}

/// Each row's `(JsdParams, K, c)` from its validated saved state and weight.
fn jsd_saved_params(saved: &[JsdState], grad: &[f32], tau: f32) -> Vec<(JsdParams, f32, f32)> {
    saved
        .iter()
        .zip(grad)
        .map(|(st, &g)| st.grad_params(tau, g))
        .collect()
}

impl Cpu {
    /// Splits `out` (one element per row) into tasks of whole rows: `run(first_row, chunk)`.
    fn par_rows<T: Send>(&self, out: &mut [T], run: impl Fn(usize, &mut [T]) + Sync) {
        let per = self.rows_per_task(out.len());
        self.install(|| {
            out.par_chunks_mut(per)
                .enumerate()
                .for_each(|(i, c)| run(i * per, c))
        })
    }

    /// Splits `data` (`vocab > 0` elements per row) into tasks of whole rows:
    /// `run(first_row, rows, chunk)`.
    fn par_row_data<T: Send>(
        &self,
        data: &mut [T],
        vocab: usize,
        run: impl Fn(usize, usize, &mut [T]) + Sync,
    ) {
        let per = self.rows_per_task(data.len() / vocab) * vocab;
        self.install(|| {
            data.par_chunks_mut(per)
                .enumerate()
                .for_each(|(i, c)| run(i * per / vocab, c.len() / vocab, c))
        })
    }

    /// Row states of a validated-shape batch; their `dot` (the entropy's sum) only if `dot`
    /// (otherwise unspecified, see `LseRows`).
    fn lse_states<S: Load>(&self, z: &[S], vocab: usize, tau: f32, dot: bool) -> Vec<LseState> {
        let mut st = vec![LseState::EMPTY; z.len() / vocab];
        let target = self.target(Pass::General);
        self.par_rows(&mut st, |r0, out| {
            arch::run(
                target,
                LseRows {
                    z: &z[r0 * vocab..(r0 + out.len()) * vocab],
                    vocab,
                    tau,
                    dot,
                    out,
                },
            )
        });
        st
    }

    /// Pair states and validation flags of validated-shape batches, with the sums `need`
    /// asks for (the others are unspecified), computed as `pass` prefetches.
    fn pair_states<S: Load, U: Load>(
        &self,
        z: &[S],
        w: &[U],
        vocab: usize,
        tau: f32,
        need: PairNeed,
        pass: Pass,
    ) -> Vec<(PairState, PairFlags)> {
        let mut st = vec![(PairState::EMPTY, PairFlags::default()); z.len() / vocab];
        let target = self.target(pass);
        self.par_rows(&mut st, |r0, out| {
            PairRows {
                z: &z[r0 * vocab..(r0 + out.len()) * vocab],
                w: &w[r0 * vocab..(r0 + out.len()) * vocab],
                vocab,
                tau,
                need,
                out,
            }
            .run_on(target)
        });
        st
    }

    /// [`grpo_core::vocab::stats_rows`]: log-sum-exp and entropy of every row of `logits`
    /// (`[rows, vocab]`, `rows = lse_out.len()`), `lse = log Σ_v exp(z_v/T)`,
    /// `H = lse − Σ_v p_v z_v/T` \[ours\]. Same bits, same errors; on `Err` nothing is written.
    ///
    /// ```
    /// let cpu = grpo_cpu::Cpu::detect();
    /// // row 0: [0, 0] → lse = H = ln 2; row 1: [5, −∞] → lse = 5, H = 0
    /// let z = [0.0f32, 0.0, 5.0, f32::NEG_INFINITY];
    /// let (mut lse, mut h) = ([0.0f32; 2], [0.0f32; 2]);
    /// cpu.stats_rows(&z, 2, 1.0, &mut lse, &mut h).unwrap();
    /// assert!((lse[0] - 2f32.ln()).abs() < 1e-6 && (h[0] - 2f32.ln()).abs() < 1e-6);
    /// assert_eq!((lse[1], h[1]), (5.0, 0.0));
    /// ```
    pub fn stats_rows<S: Load>(
        &self,
        logits: &[S],
        vocab: usize,
        temperature: f32,
        lse_out: &mut [f32],
        entropy_out: &mut [f32],
    ) -> Result<()> {
        let core = |lse_out: &mut [f32], entropy_out: &mut [f32]| {
            grpo_core::vocab::stats_rows(logits, vocab, temperature, lse_out, entropy_out)
        };
        let rows = lse_out.len();
        let Some(tau) = tau_of(temperature) else {
            return fallback(core)(lse_out, entropy_out);
        };
        if !shape_ok(logits.len(), vocab, rows) || entropy_out.len() != rows {
            return fallback(core)(lse_out, entropy_out);
        }
        let st = self.lse_states(logits, vocab, tau, true);
        if !st.iter().all(|s| lse_ok(s, tau)) {
            return fallback(core)(lse_out, entropy_out);
        }
        for (s, (l, h)) in st.iter().zip(lse_out.iter_mut().zip(entropy_out)) {
            let (lse, _, ent) = canon::finish_lse(s, tau);
            (*l, *h) = (lse, ent);
        }
        Ok(())
    }

    /// [`grpo_core::vocab::logprob_entropy_rows`]: `logp_out[r] = z[r, y_r]/T − lse_r` and
    /// optionally `entropy_out[r] = H_r`, in one pass over each row \[ours\]. Same bits, same
    /// errors; on `Err` nothing is written.
    ///
    /// ```
    /// let cpu = grpo_cpu::Cpu::detect();
    /// // row 0: [0, ln 3, 0, 0], target 1 → logp = ln(3/6) = −ln 2;
    /// // row 1: [1, 1, 1, 1], target 0 → logp = −ln 4, H = ln 4
    /// let z = [0.0f32, 3f32.ln(), 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
    /// let (mut lp, mut h) = ([0.0f32; 2], [0.0f32; 2]);
    /// cpu.logprob_entropy_rows(&z, 4, &[1u32, 0], 1.0, &mut lp, Some(&mut h)).unwrap();
    /// assert!((lp[0] + 2f32.ln()).abs() < 1e-6);
    /// assert!((lp[1] + 4f32.ln()).abs() < 1e-6 && (h[1] - 4f32.ln()).abs() < 1e-6);
    /// ```
    pub fn logprob_entropy_rows<S: Load, I: TokenId>(
        &self,
        logits: &[S],
        vocab: usize,
        targets: &[I],
        temperature: f32,
        logp_out: &mut [f32],
        entropy_out: Option<&mut [f32]>,
    ) -> Result<()> {
        self.logprob_entropy_rows_to(
            logits,
            vocab,
            targets,
            temperature,
            logp_out,
            entropy_out,
            None,
        )
    }

    /// [`grpo_core::vocab::logprob_entropy_rows_saved`]:
    /// [`logprob_entropy_rows`](Cpu::logprob_entropy_rows) that also saves each row's softmax
    /// state for [`backward_rows_saved`](Cpu::backward_rows_saved) \[ours\]. The same pass
    /// (it computes the states anyway, with the entropy's sum even when `entropy_out` is
    /// `None`); same bits, same errors; on `Err` nothing is written.
    ///
    /// ```
    /// use grpo_core::vocab::LseState;
    /// let cpu = grpo_cpu::Cpu::detect();
    /// // one row [0, ln 3], target 1 → logp = ln ¾; the state: max = ln 3, sum = 1 + ⅓
    /// let z = [0.0f32, 3f32.ln()];
    /// let (mut lp, mut saved) = ([0.0f32; 1], [LseState::EMPTY; 1]);
    /// cpu.logprob_entropy_rows_saved(&z, 2, &[1u32], 1.0, &mut lp, None, &mut saved).unwrap();
    /// assert!((lp[0] - 0.75f32.ln()).abs() < 1e-6);
    /// assert!((saved[0].sum - 4.0 / 3.0).abs() < 1e-6);
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn logprob_entropy_rows_saved<S: Load, I: TokenId>(
        &self,
        logits: &[S],
        vocab: usize,
        targets: &[I],
        temperature: f32,
        logp_out: &mut [f32],
        entropy_out: Option<&mut [f32]>,
        saved_out: &mut [LseState],
    ) -> Result<()> {
        self.logprob_entropy_rows_to(
            logits,
            vocab,
            targets,
            temperature,
            logp_out,
            entropy_out,
            Some(saved_out),
        )
    }

    /// [`logprob_entropy_rows`](Cpu::logprob_entropy_rows), saving the row states in
    /// `saved_out` if given.
    #[allow(clippy::too_many_arguments)]
    fn logprob_entropy_rows_to<S: Load, I: TokenId>(
        &self,
        logits: &[S],
        vocab: usize,
        targets: &[I],
        temperature: f32,
        logp_out: &mut [f32],
        mut entropy_out: Option<&mut [f32]>,
        saved_out: Option<&mut [LseState]>,
    ) -> Result<()> {
        let core = |logp_out: &mut [f32],
                    entropy_out: Option<&mut [f32]>,
                    saved_out: Option<&mut [LseState]>| {
            let (z, t) = (logits, targets);
            match saved_out {
                Some(st) => grpo_core::vocab::logprob_entropy_rows_saved(
                    z,
                    vocab,
                    t,
                    temperature,
                    logp_out,
                    entropy_out,
                    st,
                ),
                None => grpo_core::vocab::logprob_entropy_rows(
                    z,
                    vocab,
                    t,
                    temperature,
                    logp_out,
                    entropy_out,
                ),
            }
        };
        let rows = targets.len();
        let Some(tau) = tau_of(temperature) else {
            return fallback(core)(logp_out, entropy_out, saved_out);
        };
        let shapes = shape_ok(logits.len(), vocab, rows)
            && logp_out.len() == rows
            && entropy_out.as_deref().is_none_or(|h| h.len() == rows)
            && saved_out.as_deref().is_none_or(|st| st.len() == rows)
            && targets.iter().all(|t| t.index() < vocab);
        if !shapes {
            return fallback(core)(logp_out, entropy_out, saved_out);
        }
        // Without entropies (or states to save) the step leaves out the entropy's sum
        // (`LseRows::dot`).
        let dot = entropy_out.is_some() || saved_out.is_some();
        let st = self.lse_states(logits, vocab, tau, dot);
        let zy = |r: usize| logits[r * vocab + targets[r].index()].to_f32();
        let ok = st
            .iter()
            .enumerate()
            .all(|(r, s)| lse_ok(s, tau) && target_ok(zy(r), tau, s));
        if !ok {
            return fallback(core)(logp_out, entropy_out, saved_out);
        }
        for (r, s) in st.iter().enumerate() {
            logp_out[r] = canon::logp_of(zy(r), tau, s);
            if let Some(h) = entropy_out.as_deref_mut() {
                h[r] = canon::finish_lse(s, tau).2;
            }
        }
        if let Some(saved) = saved_out {
            saved.copy_from_slice(&st);
        }
        Ok(())
    }

    /// [`grpo_core::vocab::kl_rows`]: `KL(p‖q) = Σ p (log p − log q)` (or KL(q‖p)) of every
    /// student/teacher row pair, `p = softmax(z/T)`, `q = softmax(w/T)`, one pass over both rows
    /// \[ours; arXiv 2306.13649\]. Same bits, same errors; on `Err` nothing is written.
    ///
    /// ```
    /// use grpo_core::vocab::KlDirection;
    /// let cpu = grpo_cpu::Cpu::detect();
    /// // row 0 identical → 0; row 1: p = [½, ½], q = [¼, ¾] → KL(p‖q) = ½ ln 2 + ½ ln ⅔ = 0.1438410
    /// let z = [1.0f32, 2.0, 0.0, 0.0];
    /// let w = [1.0f32, 2.0, 0.0, 3f32.ln()];
    /// let mut out = [9.0f32; 2];
    /// cpu.kl_rows(&z, &w, 2, 1.0, KlDirection::StudentTeacher, &mut out).unwrap();
    /// assert!(out[0].abs() < 1e-7 && (out[1] - 0.1438410).abs() < 1e-6);
    /// ```
    pub fn kl_rows<S: Load, U: Load>(
        &self,
        student: &[S],
        teacher: &[U],
        vocab: usize,
        temperature: f32,
        direction: KlDirection,
        out: &mut [f32],
    ) -> Result<()> {
        self.kl_rows_to(student, teacher, vocab, temperature, direction, out, None)
    }

    /// [`grpo_core::vocab::kl_rows_saved`]: [`kl_rows`](Cpu::kl_rows) that also saves each row
    /// pair's whole state (both rows' softmax statistics and both KL sums) for
    /// [`backward_rows_saved`](Cpu::backward_rows_saved) with a KL term \[ours\]. The same
    /// pass, computing every sum of the state (up to three more FMAs per element pair than
    /// `kl_rows`); the same KL bits, the states' bits grpo-core's (`canon::pair_row`'s, with
    /// `u = +∞` where a `TeacherStudent` call meets an infinite KL(p‖q)), the same errors; on
    /// `Err` nothing is written.
    ///
    /// ```
    /// use grpo_core::vocab::{KlDirection, PairState};
    /// use grpo_core::vocab::canon::finish_kl;
    /// let cpu = grpo_cpu::Cpu::detect();
    /// // p = [½, ½], q = [¼, ¾] → KL(p‖q) = 0.1438410, and KL(q‖p) from the same state
    /// let (z, w) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
    /// let (mut kl, mut saved) = ([0.0f32; 1], [PairState::EMPTY; 1]);
    /// cpu.kl_rows_saved(&z, &w, 2, 1.0, KlDirection::StudentTeacher, &mut kl, &mut saved).unwrap();
    /// assert!((kl[0] - 0.1438410).abs() < 1e-6);
    /// assert!((finish_kl(&saved[0]).1 - 0.1308120).abs() < 1e-6);
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn kl_rows_saved<S: Load, U: Load>(
        &self,
        student: &[S],
        teacher: &[U],
        vocab: usize,
        temperature: f32,
        direction: KlDirection,
        out: &mut [f32],
        saved_out: &mut [PairState],
    ) -> Result<()> {
        let saved_out = Some(saved_out);
        self.kl_rows_to(
            student,
            teacher,
            vocab,
            temperature,
            direction,
            out,
            saved_out,
        )
    }

    /// [`kl_rows`](Cpu::kl_rows), saving the pair states in `saved_out` if given.
    #[allow(clippy::too_many_arguments)]
    fn kl_rows_to<S: Load, U: Load>(
        &self,
        student: &[S],
        teacher: &[U],
        vocab: usize,
        temperature: f32,
        direction: KlDirection,
        out: &mut [f32],
        saved_out: Option<&mut [PairState]>,
    ) -> Result<()> {
        let core = |out: &mut [f32], saved_out: Option<&mut [PairState]>| {
            let (z, w, t, d) = (student, teacher, temperature, direction);
            match saved_out {
                Some(st) => grpo_core::vocab::kl_rows_saved(z, w, vocab, t, d, out, st),
                None => grpo_core::vocab::kl_rows(z, w, vocab, t, d, out),
            }
        };
        let rows = out.len();
        let Some(tau) = tau_of(temperature) else {
            return fallback(core)(out, saved_out);
        };
        let saved_len = saved_out.as_deref().map(<[_]>::len);
        if !pair_shapes_ok(student.len(), teacher.len(), vocab, rows, saved_len) {
            return fallback(core)(out, saved_out);
        }
        let need = match (direction, saved_out.is_some()) {
            (_, true) => PairNeed::Saved,
            (KlDirection::StudentTeacher, false) => PairNeed::KlStudentTeacher,
            (KlDirection::TeacherStudent, false) => PairNeed::KlTeacherStudent,
        };
        let st = self.pair_states(student, teacher, vocab, tau, need, Pass::kl::<S, U>());
        let ok = st.iter().all(|(s, f)| {
            let support = match direction {
                KlDirection::StudentTeacher => !f.pq_infinite,
                KlDirection::TeacherStudent => !f.qp_infinite,
            };
            support && pair_ok(s, tau)
        });
        if !ok {
            return fallback(core)(out, saved_out);
        }
        for ((s, _), o) in st.iter().zip(out.iter_mut()) {
            let (f, r) = finish_kl(s);
            *o = match direction {
                KlDirection::StudentTeacher => f,
                KlDirection::TeacherStudent => r,
            };
        }
        if let Some(saved) = saved_out {
            // grpo-core records an infinite KL(p‖q), which a KL(q‖p) forward accepts, as
            // `u = +∞` (its `kl_rows_saved`).
            for (d, (s, f)) in saved.iter_mut().zip(&st) {
                *d = if direction == KlDirection::TeacherStudent && f.pq_infinite {
                    PairState {
                        u: f32::INFINITY,
                        ..*s
                    }
                } else {
                    *s
                };
            }
        }
        Ok(())
    }

    /// [`grpo_core::vocab::jsd_rows`]: generalised JSD_β of every student/teacher row pair,
    /// `JSD_β = β KL(q‖m) + (1 − β) KL(p‖m)` with `m = β q + (1 − β) p` \[arXiv 2306.13649\]; two
    /// passes per row (the second from cache). Same bits, same errors.
    ///
    /// ```
    /// let cpu = grpo_cpu::Cpu::detect();
    /// // disjoint (masked) rows: JSD_½ = ln 2; identical rows: 0
    /// let ninf = f32::NEG_INFINITY;
    /// let (z, w) = ([0.0f32, ninf, 1.0, 2.0], [ninf, 0.0f32, 1.0, 2.0]);
    /// let mut out = [9.0f32; 2];
    /// cpu.jsd_rows(&z, &w, 2, 0.5, 1.0, &mut out).unwrap();
    /// assert!((out[0] - 2f32.ln()).abs() < 1e-6 && out[1].abs() < 1e-7);
    /// ```
    pub fn jsd_rows<S: Load, U: Load>(
        &self,
        student: &[S],
        teacher: &[U],
        vocab: usize,
        beta: f32,
        temperature: f32,
        out: &mut [f32],
    ) -> Result<()> {
        self.jsd_rows_to(student, teacher, vocab, beta, temperature, out, None)
    }

    /// [`grpo_core::vocab::jsd_rows_saved`]: [`jsd_rows`](Cpu::jsd_rows) that also saves each
    /// row pair's [`JsdState`] (both rows' log-softmax constants, β and `K = KL(p‖m)`) for
    /// [`jsd_backward_rows_saved`](Cpu::jsd_backward_rows_saved) \[ours\]. The same two passes
    /// per row, the second computing `K` beside the JSD (one more multiply and add per element
    /// pair); the same JSD bits, the states' bits grpo-core's, the same errors; on `Err`
    /// nothing is written.
    ///
    /// ```
    /// use grpo_core::vocab::JsdState;
    /// let cpu = grpo_cpu::Cpu::detect();
    /// let (z, w) = ([0.5f32, -1.0, 2.0], [1.0f32, 0.0, -0.5]);
    /// let (mut j, mut saved) = ([0.0f32; 1], [JsdState::EMPTY; 1]);
    /// cpu.jsd_rows_saved(&z, &w, 3, 0.5, 1.0, &mut j, &mut saved).unwrap();
    /// let (mut j_core, mut saved_core) = ([0.0f32; 1], [JsdState::EMPTY; 1]);
    /// grpo_core::vocab::jsd_rows_saved(&z, &w, 3, 0.5, 1.0, &mut j_core, &mut saved_core)
    ///     .unwrap();
    /// assert_eq!((j, saved), (j_core, saved_core));
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn jsd_rows_saved<S: Load, U: Load>(
        &self,
        student: &[S],
        teacher: &[U],
        vocab: usize,
        beta: f32,
        temperature: f32,
        out: &mut [f32],
        saved_out: &mut [JsdState],
    ) -> Result<()> {
        let saved_out = Some(saved_out);
        self.jsd_rows_to(student, teacher, vocab, beta, temperature, out, saved_out)
    }

    /// [`jsd_rows`](Cpu::jsd_rows), saving the row pairs' states in `saved_out` if given.
    #[allow(clippy::too_many_arguments)]
    fn jsd_rows_to<S: Load, U: Load>(
        &self,
        student: &[S],
        teacher: &[U],
        vocab: usize,
        beta: f32,
        temperature: f32,
        out: &mut [f32],
        saved_out: Option<&mut [JsdState]>,
    ) -> Result<()> {
        let core = |out: &mut [f32], saved_out: Option<&mut [JsdState]>| {
            let (z, w, t) = (student, teacher, temperature);
            match saved_out {
                Some(st) => grpo_core::vocab::jsd_rows_saved(z, w, vocab, beta, t, out, st),
                None => grpo_core::vocab::jsd_rows(z, w, vocab, beta, t, out),
            }
        };
        let rows = out.len();
        let Some(tau) = tau_of(temperature) else {
            return fallback(core)(out, saved_out);
        };
        let saved_len = saved_out.as_deref().map(<[_]>::len);
        let beta_ok = beta > 0.0 && beta < 1.0;
        if !(beta_ok && pair_shapes_ok(student.len(), teacher.len(), vocab, rows, saved_len)) {
            return fallback(core)(out, saved_out);
        }
        let mut res = vec![(f32::NAN, PairFlags::default(), JsdState::EMPTY); rows];
        let target = self.target(Pass::General);
        self.par_rows(&mut res, |r0, out| {
            let span = r0 * vocab..(r0 + out.len()) * vocab;
            let (z, w) = (&student[span.clone()], &teacher[span]);
            arch::run(
                target,
                JsdRows {
                    z,
                    w,
                    vocab,
                    tau,
                    beta,
                    out,
                },
            )
        });
        if res.iter().any(|(v, _, _)| v.is_nan()) {
            return fallback(core)(out, saved_out);
        }
        for ((v, _, _), o) in res.iter().zip(out.iter_mut()) {
            *o = *v;
        }
        if let Some(saved) = saved_out {
            for (d, (_, _, st)) in saved.iter_mut().zip(&res) {
                *d = *st;
            }
        }
        Ok(())
    }

    /// [`grpo_core::vocab::jsd_backward_rows`]: `out[r, v] = g[r]·∂JSD_β,r/∂z[r, v]`, the
    /// gradient of the generalised JSD with respect to the student logits,
    /// `(1 − β)·p_v·(log p_v − log m_v − KL(p‖m))/T` \[arXiv 2306.13649; derivation in
    /// grpo-core\]. Every row pair is reduced and validated first; then, per row, `KL(p‖m)` (a
    /// second pass over the pair, which leaves each element's `log p_v − log m_v` in `out`) and
    /// the gradient from those (a third pass, over the student row and `out` only: one
    /// exponential per element, no logarithm; streaming stores on AVX-512). Same bits, same
    /// errors; on `Err`, `out` is untouched.
    ///
    /// ```
    /// let cpu = grpo_cpu::Cpu::detect();
    /// // identical rows: m = p, the JSD is at its minimum and its gradient is 0
    /// let z = [0.5f32, -1.0, 2.0];
    /// let mut g = [9.0f32; 3];
    /// cpu.jsd_backward_rows(&z, &z, 3, 0.5, 1.0, &[1.0], &mut g).unwrap();
    /// assert!(g.iter().all(|&x| x.abs() < 1e-7));
    /// // the bits of grpo-core
    /// let w = [1.0f32, 0.0, -0.5];
    /// let (mut a, mut b) = ([0.0f32; 3], [0.0f32; 3]);
    /// cpu.jsd_backward_rows(&z, &w, 3, 0.3, 0.7, &[2.0], &mut a).unwrap();
    /// grpo_core::vocab::jsd_backward_rows(&z, &w, 3, 0.3, 0.7, &[2.0], &mut b).unwrap();
    /// assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits));
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn jsd_backward_rows<S: Load, U: Load>(
        &self,
        student: &[S],
        teacher: &[U],
        vocab: usize,
        beta: f32,
        temperature: f32,
        grad: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let core = |out: &mut [f32]| {
            grpo_core::vocab::jsd_backward_rows(
                student,
                teacher,
                vocab,
                beta,
                temperature,
                grad,
                out,
            )
        };
        let valid = out.len() == student.len();
        let args = (student, teacher, vocab, beta, temperature, grad);
        let Some(params) = valid.then(|| self.jsd_grad_params(args)).flatten() else {
            return fallback(core)(out);
        };
        let target = self.target(Pass::General);
        self.par_row_data(out, vocab, |r0, n, o| {
            arch::run(
                target,
                JsdGradRows {
                    z: &student[r0 * vocab..(r0 + n) * vocab],
                    w: &teacher[r0 * vocab..(r0 + n) * vocab],
                    vocab,
                    params: &params[r0..r0 + n],
                    grad: &grad[r0..r0 + n],
                    out: o,
                },
            )
        });
        Ok(())
    }

    /// [`grpo_core::vocab::jsd_backward_rows_in_place`]:
    /// [`jsd_backward_rows`](Cpu::jsd_backward_rows) writing the gradient over the student
    /// logits, rounded to their storage type (ties to even); one row of `f32` scratch per task
    /// holds the log-ratios between the passes. Same bits, same errors; on `Err` the logits are
    /// untouched.
    ///
    /// ```
    /// let cpu = grpo_cpu::Cpu::detect();
    /// // bf16 logits, an f32 teacher: the bits of grpo-core
    /// let w = [1.0f32, 0.0, -0.5];
    /// let mut z = [0.5f32, -1.0, 2.0].map(half::bf16::from_f32);
    /// let mut want = z;
    /// cpu.jsd_backward_rows_in_place(&mut z, &w, 3, 0.3, 0.7, &[2.0]).unwrap();
    /// grpo_core::vocab::jsd_backward_rows_in_place(&mut want, &w, 3, 0.3, 0.7, &[2.0]).unwrap();
    /// assert_eq!(z, want);
    /// // β = 1 is an error, and the logits are untouched
    /// let before = z;
    /// assert!(cpu.jsd_backward_rows_in_place(&mut z, &w, 3, 1.0, 0.7, &[2.0]).is_err());
    /// assert_eq!(z, before);
    /// ```
    pub fn jsd_backward_rows_in_place<S: Load, U: Load>(
        &self,
        student: &mut [S],
        teacher: &[U],
        vocab: usize,
        beta: f32,
        temperature: f32,
        grad: &[f32],
    ) -> Result<()> {
        let args = (&*student, teacher, vocab, beta, temperature, grad);
        let Some(params) = self.jsd_grad_params(args) else {
            note_fallback();
            return grpo_core::vocab::jsd_backward_rows_in_place(
                student,
                teacher,
                vocab,
                beta,
                temperature,
                grad,
            );
        };
        let target = self.target(Pass::General);
        self.par_row_data(student, vocab, |r0, n, z| {
            arch::run(
                target,
                JsdGradRowsInPlace {
                    z,
                    w: &teacher[r0 * vocab..(r0 + n) * vocab],
                    vocab,
                    params: &params[r0..r0 + n],
                    grad: &grad[r0..r0 + n],
                },
            )
        });
        Ok(())
    }

    /// [`grpo_core::vocab::jsd_backward_rows_saved`]: the JSD's gradient `out[r, v] =
    /// g[r]·(1 − β)·p_v·(log p_v − log m_v − K)/T` from the states
    /// [`jsd_rows_saved`](Cpu::jsd_rows_saved) saved (β and `K = KL(p‖m)` from the state) —
    /// one pass over each row pair, where [`jsd_backward_rows`](Cpu::jsd_backward_rows) makes
    /// three (streaming stores on AVX-512) \[ours\]. For states saved from these rows at this
    /// temperature, the bits of `jsd_backward_rows`. The same errors as grpo-core (the
    /// arguments and states, checked by
    /// [`validate::jsd_backward_saved`](grpo_core::vocab::validate::jsd_backward_saved)) and
    /// its bits; the logits are not validated, as in grpo-core, and other logits than the
    /// states' give grpo-core's (meaningless) bits too: NaN where a logit is NaN, and where a
    /// log-probability exceeds 88 the exponential of 88, as in
    /// [`backward_rows_saved`](Cpu::backward_rows_saved). On `Err`, `out` is untouched.
    ///
    /// ```
    /// use grpo_core::vocab::JsdState;
    /// let cpu = grpo_cpu::Cpu::detect();
    /// let (z, w) = ([0.5f32, -1.0, 2.0], [1.0f32, 0.0, -0.5]);
    /// let (mut j, mut saved) = ([0.0f32; 1], [JsdState::EMPTY; 1]);
    /// cpu.jsd_rows_saved(&z, &w, 3, 0.3, 0.7, &mut j, &mut saved).unwrap();
    /// let (mut a, mut b) = ([0.0f32; 3], [0.0f32; 3]);
    /// cpu.jsd_backward_rows_saved(&z, &w, 3, 0.7, &saved, &[2.0], &mut a).unwrap();
    /// cpu.jsd_backward_rows(&z, &w, 3, 0.3, 0.7, &[2.0], &mut b).unwrap();
    /// assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits));
    /// // a state that no forward saved is an error, and `out` is untouched
    /// assert!(cpu.jsd_backward_rows_saved(&z, &w, 3, 0.7, &[JsdState::EMPTY], &[2.0], &mut a).is_err());
    /// assert_eq!(a, b);
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn jsd_backward_rows_saved<S: Load, U: Load>(
        &self,
        student: &[S],
        teacher: &[U],
        vocab: usize,
        temperature: f32,
        saved: &[JsdState],
        grad: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let core = |out: &mut [f32]| {
            let (z, w, t) = (student, teacher, temperature);
            grpo_core::vocab::jsd_backward_rows_saved(z, w, vocab, t, saved, grad, out)
        };
        let (n, m) = (student.len(), teacher.len());
        let Ok((tau, _)) = jsd_backward_saved(n, m, vocab, temperature, saved, grad, out.len())
        else {
            return fallback(core)(out);
        };
        let params = jsd_saved_params(saved, grad, tau);
        let target = self.target(Pass::General);
        self.par_row_data(out, vocab, |r0, rows, out| {
            let span = r0 * vocab..(r0 + rows) * vocab;
            let z = &student[span.clone()];
            arch::run(
                target,
                JsdSavedGradRows {
                    dest: JsdSavedDest::Into { z, out },
                    w: &teacher[span],
                    vocab,
                    params: &params[r0..r0 + rows],
                },
            )
        });
        Ok(())
    }

    /// [`grpo_core::vocab::jsd_backward_rows_in_place_saved`]:
    /// [`jsd_backward_rows_saved`](Cpu::jsd_backward_rows_saved) writing the gradient over the
    /// student logits, rounded to their storage type (ties to even); no scratch. Same bits,
    /// same errors; on `Err` the logits are untouched.
    ///
    /// ```
    /// use grpo_core::vocab::JsdState;
    /// let cpu = grpo_cpu::Cpu::detect();
    /// let w = [1.0f32, 0.0, -0.5];
    /// let z = [0.5f32, -1.0, 2.0].map(half::bf16::from_f32);
    /// let (mut j, mut saved) = ([0.0f32; 1], [JsdState::EMPTY; 1]);
    /// cpu.jsd_rows_saved(&z, &w, 3, 0.3, 0.7, &mut j, &mut saved).unwrap();
    /// let (mut a, mut b) = (z, z);
    /// cpu.jsd_backward_rows_in_place_saved(&mut a, &w, 3, 0.7, &saved, &[2.0]).unwrap();
    /// cpu.jsd_backward_rows_in_place(&mut b, &w, 3, 0.3, 0.7, &[2.0]).unwrap();
    /// assert_eq!(a, b);
    /// ```
    pub fn jsd_backward_rows_in_place_saved<S: Load, U: Load>(
        &self,
        student: &mut [S],
        teacher: &[U],
        vocab: usize,
        temperature: f32,
        saved: &[JsdState],
        grad: &[f32],
    ) -> Result<()> {
        let (n, m) = (student.len(), teacher.len());
        let Ok((tau, _)) = jsd_backward_saved(n, m, vocab, temperature, saved, grad, n) else {
            note_fallback();
            let t = temperature;
            return grpo_core::vocab::jsd_backward_rows_in_place_saved(
                student, teacher, vocab, t, saved, grad,
            );
        };
        let params = jsd_saved_params(saved, grad, tau);
        let target = self.target(Pass::General);
        self.par_row_data(student, vocab, |r0, rows, z| {
            arch::run(
                target,
                JsdSavedGradRows {
                    dest: JsdSavedDest::Over(z),
                    w: &teacher[r0 * vocab..(r0 + rows) * vocab],
                    vocab,
                    params: &params[r0..r0 + rows],
                },
            )
        });
        Ok(())
    }

    /// Every row pair's [`JsdParams`] for the JSD's gradient, or `None` where grpo-core would
    /// report an error (its checks that read no logit, then the rows' in one pair pass).
    #[allow(clippy::type_complexity)]
    fn jsd_grad_params<S: Load, U: Load>(
        &self,
        (student, teacher, vocab, beta, temperature, grad): (&[S], &[U], usize, f32, f32, &[f32]),
    ) -> Option<Vec<JsdParams>> {
        let tau = tau_of(temperature)?;
        let rows = student.len().checked_div(vocab).unwrap_or(0);
        let args = temperature >= MIN_GRAD_TEMPERATURE
            && beta > 0.0
            && beta < 1.0
            && pair_shapes_ok(student.len(), teacher.len(), vocab, rows, None)
            && weights_ok(grad, rows);
        if !args {
            return None;
        }
        let st = self.pair_states(student, teacher, vocab, tau, PairNeed::Jsd, Pass::General);
        st.iter()
            .map(|(s, _)| pair_ok(s, tau).then(|| JsdParams::of(s, tau, beta)))
            .collect()
    }

    /// Per-row backward coefficients, or `None` where grpo-core would report an error.
    fn backward_coefs<S: Load, I: TokenId, U: Load>(
        &self,
        logits: &[S],
        vocab: usize,
        temperature: f32,
        terms: &GradTerms<'_, I, U>,
    ) -> Option<(Vec<GradCoef>, Vec<usize>, KlGrad)> {
        let (tau, rows) = backward_args_ok(logits.len(), vocab, temperature, terms)?;
        // Forward statistics of every row (validating them) before anything is written.
        let g_h = |r: usize| terms.entropy.map_or(0.0, |g| g[r]);
        let g_lp = |r: usize| terms.logp.map_or(0.0, |(_, g)| g[r]);
        let (st, kl_grad): (Vec<(LseState, GradCoef)>, KlGrad) = match &terms.kl {
            Some(k) => {
                let need = match k.direction {
                    KlDirection::StudentTeacher => PairNeed::GradStudentTeacher,
                    KlDirection::TeacherStudent => PairNeed::GradTeacherStudent,
                };
                let st = self.pair_states(logits, k.teacher, vocab, tau, need, Pass::General);
                let mut v = Vec::with_capacity(rows);
                for (r, (s, f)) in st.iter().enumerate() {
                    let support = match k.direction {
                        KlDirection::StudentTeacher => !f.pq_infinite,
                        KlDirection::TeacherStudent => !f.qp_infinite,
                    };
                    if !support || !pair_ok(s, tau) {
                        return None;
                    }
                    let c = GradCoef::from_pair(s, tau, g_lp(r), g_h(r), k.grad[r]);
                    v.push((s.student(), c));
                }
                (v, terms.kl_grad())
            }
            None => {
                // The entropy's sum even without an entropy term: the coefficient
                // `fma(g_h, log p + H, g_lp)` at `g_h = 0` is `g_lp` only up to the sign of
                // a zero `g_lp`, which follows the sign of `log p + H`.
                let st = self.lse_states(logits, vocab, tau, true);
                let mut v = Vec::with_capacity(rows);
                for (r, s) in st.iter().enumerate() {
                    if !lse_ok(s, tau) {
                        return None;
                    }
                    v.push((*s, GradCoef::from_lse(s, tau, g_lp(r), g_h(r))));
                }
                (v, KlGrad::None)
            }
        };
        let mut coefs = Vec::with_capacity(rows);
        let mut ys = Vec::with_capacity(rows);
        for (r, (s, c)) in st.into_iter().enumerate() {
            let y = match terms.logp {
                Some((t, _)) => {
                    let y = t[r].index();
                    if !target_ok(logits[r * vocab + y].to_f32(), tau, &s) {
                        return None;
                    }
                    y
                }
                None => usize::MAX,
            };
            coefs.push(c);
            ys.push(y);
        }
        Some((coefs, ys, kl_grad))
    }

    /// [`grpo_core::vocab::backward_rows`]: `out[r, v] = ∂loss_r/∂z[r, v]` for
    /// `loss_r = g_lp[r]·logp_r(y_r) + g_H[r]·H_r + g_KL[r]·KL_r` \[ours\], e.g.
    /// `∂logp(y)/∂z_v = (1[v=y] − p_v)/T`, `∂H/∂z_v = −p_v (log p_v + H)/T`. Every row is reduced
    /// and validated first, then the gradient is written (streaming stores on AVX-512). Same
    /// bits, same errors; on `Err`, `out` is untouched.
    ///
    /// ```
    /// use grpo_core::vocab::GradTerms;
    /// let cpu = grpo_cpu::Cpu::detect();
    /// // one row [0, 0], target 0, ∂loss/∂logp = 1, T = 1: grad = (1 − ½, −½)
    /// let mut g = [0.0f32; 2];
    /// let terms: GradTerms<'_, u32> = GradTerms { logp: Some((&[0], &[1.0])), entropy: None, kl: None };
    /// cpu.backward_rows(&[0.0f32, 0.0], 2, 1.0, &terms, &mut g).unwrap();
    /// assert!((g[0] - 0.5).abs() < 1e-7 && (g[1] + 0.5).abs() < 1e-7);
    /// ```
    pub fn backward_rows<S: Load, I: TokenId + Sync, U: Load>(
        &self,
        logits: &[S],
        vocab: usize,
        temperature: f32,
        terms: &GradTerms<'_, I, U>,
        out: &mut [f32],
    ) -> Result<()> {
        let core = |out: &mut [f32]| {
            grpo_core::vocab::backward_rows(logits, vocab, temperature, terms, out)
        };
        if out.len() != logits.len() {
            return fallback(core)(out);
        }
        let Some((coefs, ys, kl)) = self.backward_coefs(logits, vocab, temperature, terms) else {
            return fallback(core)(out);
        };
        let w: &[U] = terms.kl.as_ref().map_or(&[], |k| k.teacher);
        let ys = terms.logp.is_some().then_some(&ys[..]);
        self.grads_into(logits, w, ys, &coefs, kl, vocab, out);
        Ok(())
    }

    /// The gradient of every row from its coefficients into `out` (the arguments validated):
    /// `w` the teacher rows (empty without a KL term), `ys` the targets if there is a
    /// log-probability term.
    #[allow(clippy::too_many_arguments)]
    fn grads_into<S: Load, U: Load>(
        &self,
        logits: &[S],
        w: &[U],
        ys: Option<&[usize]>,
        coefs: &[GradCoef],
        kl: KlGrad,
        vocab: usize,
        out: &mut [f32],
    ) {
        let target = self.target(Pass::General);
        self.par_row_data(out, vocab, |r0, n, o| {
            arch::run(
                target,
                GradRows {
                    z: &logits[r0 * vocab..(r0 + n) * vocab],
                    w: w.get(r0 * vocab..(r0 + n) * vocab).unwrap_or(&[]),
                    y: ys.map(|y| &y[r0..r0 + n]),
                    coef: &coefs[r0..r0 + n],
                    kl,
                    vocab,
                    out: o,
                },
            )
        });
    }

    /// [`grads_into`](Cpu::grads_into) over the logits themselves.
    fn grads_over<S: Load, U: Load>(
        &self,
        logits: &mut [S],
        w: &[U],
        ys: Option<&[usize]>,
        coefs: &[GradCoef],
        kl: KlGrad,
        vocab: usize,
    ) {
        let target = self.target(Pass::General);
        self.par_row_data(logits, vocab, |r0, n, z| {
            arch::run(
                target,
                GradRowsInPlace {
                    z,
                    w: w.get(r0 * vocab..(r0 + n) * vocab).unwrap_or(&[]),
                    y: ys.map(|y| &y[r0..r0 + n]),
                    coef: &coefs[r0..r0 + n],
                    kl,
                    vocab,
                },
            )
        });
    }

    /// [`grpo_core::vocab::backward_rows_in_place`]: [`backward_rows`](Cpu::backward_rows)
    /// writing the gradient over the logits, rounded to their storage type (ties to even).
    /// Same bits, same errors; on `Err` the logits are untouched.
    ///
    /// ```
    /// use grpo_core::vocab::GradTerms;
    /// let cpu = grpo_cpu::Cpu::detect();
    /// // the entropy of [0, 0] is maximal: ∂H/∂z_v = −½(−ln 2 + ln 2) = 0
    /// let mut z = [0.0f32, 0.0];
    /// let terms: GradTerms<'_, u32> = GradTerms { logp: None, entropy: Some(&[1.0]), kl: None };
    /// cpu.backward_rows_in_place(&mut z, 2, 1.0, &terms).unwrap();
    /// assert!(z[0].abs() < 1e-7 && z[1].abs() < 1e-7);
    /// ```
    pub fn backward_rows_in_place<S: Load, I: TokenId + Sync, U: Load>(
        &self,
        logits: &mut [S],
        vocab: usize,
        temperature: f32,
        terms: &GradTerms<'_, I, U>,
    ) -> Result<()> {
        let Some((coefs, ys, kl)) = self.backward_coefs(logits, vocab, temperature, terms) else {
            note_fallback();
            return grpo_core::vocab::backward_rows_in_place(logits, vocab, temperature, terms);
        };
        let w: &[U] = terms.kl.as_ref().map_or(&[], |k| k.teacher);
        let ys = terms.logp.is_some().then_some(&ys[..]);
        self.grads_over(logits, w, ys, &coefs, kl, vocab);
        Ok(())
    }

    /// The backward's coefficients from saved row states, or `None` where grpo-core would
    /// report an error (its checks in `backward_rows_saved`, which read only the targets'
    /// logits).
    fn saved_coefs<S: Load, I: TokenId, U: Load, St: SavedState>(
        &self,
        logits: &[S],
        vocab: usize,
        temperature: f32,
        saved: &[St],
        terms: &GradTerms<'_, I, U>,
    ) -> Option<(Vec<GradCoef>, Vec<usize>)> {
        let (tau, rows) = backward_args_ok(logits.len(), vocab, temperature, terms)?;
        if saved.len() != rows || (terms.kl.is_some() && !St::HAS_TEACHER) {
            return None;
        }
        let mut coefs = Vec::with_capacity(rows);
        let mut ys = Vec::with_capacity(if terms.logp.is_some() { rows } else { 0 });
        for (r, st) in saved.iter().enumerate() {
            grpo_core::vocab::validate::saved(st, tau, r).ok()?;
            if let Some(k) = &terms.kl {
                st.check_kl_term(k.direction, r).ok()?;
            }
            let g_lp = match terms.logp {
                Some((t, g)) => {
                    let y = t[r].index();
                    if !target_ok(logits[r * vocab + y].to_f32(), tau, &st.student()) {
                        return None;
                    }
                    ys.push(y);
                    g[r]
                }
                None => 0.0,
            };
            let g_h = terms.entropy.map_or(0.0, |g| g[r]);
            let g_kl = terms.kl.as_ref().map_or(0.0, |k| k.grad[r]);
            coefs.push(st.coef(tau, g_lp, g_h, g_kl));
        }
        Some((coefs, ys))
    }

    /// [`grpo_core::vocab::backward_rows_saved`]: [`backward_rows`](Cpu::backward_rows) from
    /// the row states a forward saved \[ours\] — [`LseState`]s
    /// ([`logprob_entropy_rows_saved`](Cpu::logprob_entropy_rows_saved): log-probability and
    /// entropy terms) or [`PairState`]s ([`kl_rows_saved`](Cpu::kl_rows_saved): any terms, a
    /// KL term included). One read of the logits (and teacher logits) and one write of the
    /// gradient (streaming stores on AVX-512), where `backward_rows` reads them twice. For
    /// states saved from these logits at this temperature, the bits of `backward_rows`.
    ///
    /// The gradient kernels are those of `backward_rows` with the same `GradTerms` type (`U`
    /// is the teacher storage type of its KL term, absent or not), so no new instantiation is
    /// compiled.
    ///
    /// **The logits are not validated** (only the targets' are read before the gradient is
    /// written): they (and the teacher's) must be those the states were saved from, and
    /// `temperature` the forward's; otherwise the result is meaningless, never a panic. Same
    /// errors as grpo-core, and its bits — for other logits too: NaN where a logit is NaN, and
    /// where a log-probability exceeds 88 (+∞, or a logit more than 88·T above its row's
    /// reference) grpo-core's clamp of the exponential's argument at 88
    /// ([`clamp_grad_arg`](grpo_core::vocab::exp_ln::clamp_grad_arg)), which keeps every
    /// backend's scaling exact. On `Err`, `out` is untouched.
    ///
    /// ```
    /// use grpo_core::vocab::{GradTerms, LseState};
    /// let cpu = grpo_cpu::Cpu::detect();
    /// let z = [0.0f32, 0.0];
    /// let (mut lp, mut saved) = ([0.0f32; 1], [LseState::EMPTY; 1]);
    /// cpu.logprob_entropy_rows_saved(&z, 2, &[0u32], 1.0, &mut lp, None, &mut saved).unwrap();
    /// // target 0, ∂loss/∂logp = 1, T = 1: grad = (1 − ½, −½)
    /// let terms: GradTerms<'_, u32> = GradTerms { logp: Some((&[0], &[1.0])), entropy: None, kl: None };
    /// let mut g = [0.0f32; 2];
    /// cpu.backward_rows_saved(&z, 2, 1.0, &saved, &terms, &mut g).unwrap();
    /// assert_eq!(g, [0.5, -0.5]);
    /// ```
    ///
    /// Distillation (KL(p‖q), student‖teacher), from the states of the KL forward:
    ///
    /// ```
    /// use grpo_core::vocab::{GradTerms, KlDirection, KlTerm, PairState};
    /// let cpu = grpo_cpu::Cpu::detect();
    /// // identical rows: KL = 0 and its gradient p_v (log p_v − log q_v − KL)/T is 0
    /// let (z, w) = ([0.5f32, -1.0, 2.0], [0.5f32, -1.0, 2.0]);
    /// let (mut kl, mut saved) = ([0.0f32; 1], [PairState::EMPTY; 1]);
    /// cpu.kl_rows_saved(&z, &w, 3, 1.0, KlDirection::StudentTeacher, &mut kl, &mut saved).unwrap();
    /// let kl_term = KlTerm { teacher: &w[..], grad: &[1.0], direction: KlDirection::StudentTeacher };
    /// let terms: GradTerms<'_, u32> = GradTerms { logp: None, entropy: None, kl: Some(kl_term) };
    /// let mut g = [9.0f32; 3];
    /// cpu.backward_rows_saved(&z, 3, 1.0, &saved, &terms, &mut g).unwrap();
    /// assert_eq!((kl[0], g), (0.0, [0.0; 3]));
    /// ```
    pub fn backward_rows_saved<S: Load, I: TokenId + Sync, U: Load, St: SavedState>(
        &self,
        logits: &[S],
        vocab: usize,
        temperature: f32,
        saved: &[St],
        terms: &GradTerms<'_, I, U>,
        out: &mut [f32],
    ) -> Result<()> {
        let core = |out: &mut [f32]| {
            grpo_core::vocab::backward_rows_saved(logits, vocab, temperature, saved, terms, out)
        };
        if out.len() != logits.len() {
            return fallback(core)(out);
        }
        let Some((coefs, ys)) = self.saved_coefs(logits, vocab, temperature, saved, terms) else {
            return fallback(core)(out);
        };
        let w: &[U] = terms.kl.as_ref().map_or(&[], |k| k.teacher);
        let ys = terms.logp.is_some().then_some(&ys[..]);
        let kl = terms.kl_grad();
        self.grads_into(logits, w, ys, &coefs, kl, vocab, out);
        Ok(())
    }

    /// [`grpo_core::vocab::backward_rows_in_place_saved`]:
    /// [`backward_rows_saved`](Cpu::backward_rows_saved) writing the gradient over the logits,
    /// rounded to their storage type (ties to even) \[ours\]. The same precondition (the
    /// logits the states were saved from); same bits, same errors; on `Err` the logits are
    /// untouched.
    ///
    /// ```
    /// use grpo_core::vocab::{GradTerms, LseState};
    /// let cpu = grpo_cpu::Cpu::detect();
    /// let mut z = [0.0f32, 0.0];
    /// let (mut lp, mut saved) = ([0.0f32; 1], [LseState::EMPTY; 1]);
    /// cpu.logprob_entropy_rows_saved(&z, 2, &[0u32], 1.0, &mut lp, None, &mut saved).unwrap();
    /// let terms: GradTerms<'_, u32> = GradTerms { logp: Some((&[0], &[1.0])), entropy: None, kl: None };
    /// cpu.backward_rows_in_place_saved(&mut z, 2, 1.0, &saved, &terms).unwrap();
    /// assert_eq!(z, [0.5, -0.5]);
    /// ```
    pub fn backward_rows_in_place_saved<S: Load, I: TokenId + Sync, U: Load, St: SavedState>(
        &self,
        logits: &mut [S],
        vocab: usize,
        temperature: f32,
        saved: &[St],
        terms: &GradTerms<'_, I, U>,
    ) -> Result<()> {
        let Some((coefs, ys)) = self.saved_coefs(logits, vocab, temperature, saved, terms) else {
            note_fallback();
            return grpo_core::vocab::backward_rows_in_place_saved(
                logits,
                vocab,
                temperature,
                saved,
                terms,
            );
        };
        let w: &[U] = terms.kl.as_ref().map_or(&[], |k| k.teacher);
        let ys = terms.logp.is_some().then_some(&ys[..]);
        self.grads_over(logits, w, ys, &coefs, terms.kl_grad(), vocab);
        Ok(())
    }
}

/// The public row operations on every backend this CPU has, in every storage type, against
/// grpo-core — the whole path (validation, threads, the f32/bf16/f16 row kernels, the output
/// writes) in one place inside this crate, so that it also runs where CI runs only this crate's
/// tests: NEON under qemu.
///
/// Not compiled on x86-64, where the workspace's `tests/vocab_cpu.rs` runs all of it — every
/// operation, storage type and mixed pair, on every backend, thread count and prefetch setting
/// — and far more cases. Its instantiations of every row kernel for every storage type were
/// most of this crate's test build there: `cargo test -p grpo-cpu --no-run` (lib and tests,
/// dependencies built) took 342 CPU-seconds, 179 s on 2 cores, with it and 120, 63 s without;
/// in CI's workspace build that unit ran last, 244 s, on the critical path (Zen 4, `cargo
/// build --timings`).
#[cfg(all(test, not(target_arch = "x86_64")))]
mod tests {
    use crate::{Backend, Cpu, Storage};
    use grpo_core::Result;
    use grpo_core::vocab::canon::Logit;
    use grpo_core::vocab::{
        self as core, GradTerms, JsdState, KlDirection, KlTerm, LseState, PairState, SavedState,
    };

    /// Rows of pseudo-random logits in [−8, 8), masked (−∞) at every index `≡ 7 (mod 41)` — the
    /// same indices in the student and the teacher, so that the KL and JSD have support.
    fn logits<S: Logit>(seed: u64, n: usize) -> Vec<S> {
        let mut next = crate::test_data::uniform_f32(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        (0..n)
            .map(|i| {
                let u = next();
                S::from_f32(if i % 41 == 7 {
                    f32::NEG_INFINITY
                } else {
                    16.0 * u - 8.0
                })
            })
            .collect()
    }

    /// `(result, output bits)` of one call; the outputs start as NaN.
    fn call(len: usize, f: impl FnOnce(&mut [f32]) -> Result<()>) -> (Result<()>, Vec<u32>) {
        let mut out = vec![f32::NAN; len];
        let r = f(&mut out);
        (r, out.iter().map(|x| x.to_bits()).collect())
    }

    fn bits<S: Logit>(x: &[S]) -> Vec<u32> {
        x.iter().map(|v| v.to_f32().to_bits()).collect()
    }

    /// One call of an operation: grpo-core's (`None`) or a `Cpu`'s.
    type Call<'a> = Box<dyn Fn(Option<&Cpu>) -> (Result<()>, Vec<u32>) + 'a>;

    /// The backwards from saved states `st` (either kind) with the terms `tm`, out of place
    /// and in place.
    fn from_saved<'a, S: Storage, U: Storage, St: SavedState>(
        z: &'a [S],
        vocab: usize,
        t: f32,
        st: &'a [St],
        tm: &'a GradTerms<'a, u32, U>,
    ) -> [(&'static str, Call<'a>); 2] {
        [
            (
                "backward_rows_saved",
                Box::new(move |cpu| {
                    call(z.len(), |o| match cpu {
                        Some(c) => c.backward_rows_saved(z, vocab, t, st, tm, o),
                        None => core::backward_rows_saved(z, vocab, t, st, tm, o),
                    })
                }),
            ),
            (
                "backward_rows_in_place_saved",
                Box::new(move |cpu| {
                    let mut zi = z.to_vec();
                    let r = match cpu {
                        Some(c) => c.backward_rows_in_place_saved(&mut zi, vocab, t, st, tm),
                        None => core::backward_rows_in_place_saved(&mut zi, vocab, t, st, tm),
                    };
                    (r, bits(&zi))
                }),
            ),
        ]
    }

    /// Every operation on one batch (student `S`, teacher `U`): grpo-cpu on each backend
    /// (two threads) against grpo-core, results and bits; returns how many calls succeeded.
    fn every_op<S: Storage, U: Storage>(rows: usize, vocab: usize, t: f32, seed: u64) -> usize {
        let z: Vec<S> = logits(seed, rows * vocab);
        let w: Vec<U> = logits(seed + 1, rows * vocab);
        let y: Vec<u32> = (0..rows).map(|r| ((r * 7919) % vocab) as u32).collect();
        let g: Vec<f32> = (0..rows).map(|r| 0.5 - 0.25 * r as f32).collect();
        let kl = |direction| KlTerm {
            teacher: &w[..],
            grad: &g[..],
            direction,
        };
        let terms = [
            GradTerms::<u32, U> {
                logp: Some((&y[..], &g[..])),
                entropy: Some(&g[..]),
                kl: None,
            },
            GradTerms {
                logp: Some((&y[..], &g[..])),
                entropy: None,
                kl: Some(kl(KlDirection::StudentTeacher)),
            },
            GradTerms {
                logp: None,
                entropy: Some(&g[..]),
                kl: Some(kl(KlDirection::TeacherStudent)),
            },
        ];
        let mut saved = vec![LseState::EMPTY; rows];
        let _ = core::logprob_entropy_rows_saved(
            &z,
            vocab,
            &y,
            t,
            &mut vec![0.0; rows],
            None,
            &mut saved,
        );
        let saved = &saved[..];
        let mut pairs = vec![PairState::EMPTY; rows];
        let _ = core::kl_rows_saved(
            &z,
            &w,
            vocab,
            t,
            KlDirection::StudentTeacher,
            &mut vec![0.0; rows],
            &mut pairs,
        );
        let pairs = &pairs[..];
        let mut js = vec![JsdState::EMPTY; rows];
        let _ = core::jsd_rows_saved(&z, &w, vocab, 0.3, t, &mut vec![0.0; rows], &mut js);
        let js = &js[..];
        let lse_terms = GradTerms::<u32, U> {
            logp: Some((&y, &g[..])),
            entropy: Some(&g[..]),
            kl: None,
        };
        let lse_terms = &lse_terms;
        let (z, w, y) = (&z[..], &w[..], &y[..]);
        let mut ops: Vec<(&str, Call<'_>)> = vec![
            (
                "stats",
                Box::new(move |cpu| {
                    call(2 * rows, |o| {
                        let (l, h) = o.split_at_mut(rows);
                        match cpu {
                            Some(c) => c.stats_rows(z, vocab, t, l, h),
                            None => core::stats_rows(z, vocab, t, l, h),
                        }
                    })
                }),
            ),
            (
                "logprob_entropy",
                Box::new(move |cpu| {
                    call(2 * rows, |o| {
                        let (l, h) = o.split_at_mut(rows);
                        match cpu {
                            Some(c) => c.logprob_entropy_rows(z, vocab, y, t, l, Some(h)),
                            None => core::logprob_entropy_rows(z, vocab, y, t, l, Some(h)),
                        }
                    })
                }),
            ),
            (
                "jsd",
                Box::new(move |cpu| {
                    call(rows, |o| match cpu {
                        Some(c) => c.jsd_rows(z, w, vocab, 0.3, t, o),
                        None => core::jsd_rows(z, w, vocab, 0.3, t, o),
                    })
                }),
            ),
        ];
        for d in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
            ops.push((
                "kl",
                Box::new(move |cpu| {
                    call(rows, |o| match cpu {
                        Some(c) => c.kl_rows(z, w, vocab, t, d, o),
                        None => core::kl_rows(z, w, vocab, t, d, o),
                    })
                }),
            ));
        }
        for tm in &terms {
            ops.push((
                "backward",
                Box::new(move |cpu| {
                    call(rows * vocab, |o| match cpu {
                        Some(c) => c.backward_rows(z, vocab, t, tm, o),
                        None => core::backward_rows(z, vocab, t, tm, o),
                    })
                }),
            ));
            ops.push((
                "backward_in_place",
                Box::new(move |cpu| {
                    let mut zi = z.to_vec();
                    let r = match cpu {
                        Some(c) => c.backward_rows_in_place(&mut zi, vocab, t, tm),
                        None => core::backward_rows_in_place(&mut zi, vocab, t, tm),
                    };
                    (r, bits(&zi))
                }),
            ));
        }
        // The forward that saves its row states, and the backwards from grpo-core's states
        // (`EMPTY` where its forward failed, which they reject).
        ops.push((
            "logprob_entropy_rows_saved",
            Box::new(move |cpu| {
                let mut st = vec![LseState::EMPTY; rows];
                let (r, mut out) = call(rows, |l| match cpu {
                    Some(c) => c.logprob_entropy_rows_saved(z, vocab, y, t, l, None, &mut st),
                    None => core::logprob_entropy_rows_saved(z, vocab, y, t, l, None, &mut st),
                });
                out.extend(
                    st.iter()
                        .flat_map(|s| [s.max, s.sum, s.dot].map(f32::to_bits)),
                );
                (r, out)
            }),
        ));
        ops.extend(from_saved(z, vocab, t, saved, lse_terms));
        // The KL forward that saves its pair states, and the backwards from grpo-core's states
        // with every term set.
        for d in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
            ops.push((
                "kl_rows_saved",
                Box::new(move |cpu| {
                    let mut st = vec![PairState::EMPTY; rows];
                    let (r, mut out) = call(rows, |o| match cpu {
                        Some(c) => c.kl_rows_saved(z, w, vocab, t, d, o, &mut st),
                        None => core::kl_rows_saved(z, w, vocab, t, d, o, &mut st),
                    });
                    out.extend(st.iter().flat_map(|s| {
                        [s.zmax, s.sz, s.tz, s.wmax, s.sw, s.tw, s.u, s.v].map(f32::to_bits)
                    }));
                    (r, out)
                }),
            ));
        }
        for tm in &terms {
            ops.extend(from_saved(z, vocab, t, pairs, tm));
        }
        // The JSD forward that saves its states, and the JSD's gradient from grpo-core's
        // states, out of place and in place. (Not the recomputing JSD gradient: its kernels
        // for the four storage pairs would add to the build what this module is already most
        // of, see above.)
        let g = &g[..];
        ops.push((
            "jsd_rows_saved",
            Box::new(move |cpu| {
                let mut st = vec![JsdState::EMPTY; rows];
                let (r, mut out) = call(rows, |o| match cpu {
                    Some(c) => c.jsd_rows_saved(z, w, vocab, 0.3, t, o, &mut st),
                    None => core::jsd_rows_saved(z, w, vocab, 0.3, t, o, &mut st),
                });
                out.extend(st.iter().flat_map(jsd_state_bits));
                (r, out)
            }),
        ));
        ops.push((
            "jsd_backward_rows_saved",
            Box::new(move |cpu| {
                call(rows * vocab, |o| match cpu {
                    Some(c) => c.jsd_backward_rows_saved(z, w, vocab, t, js, g, o),
                    None => core::jsd_backward_rows_saved(z, w, vocab, t, js, g, o),
                })
            }),
        ));
        ops.push((
            "jsd_backward_rows_in_place_saved",
            Box::new(move |cpu| {
                let mut zi = z.to_vec();
                let r = match cpu {
                    Some(c) => c.jsd_backward_rows_in_place_saved(&mut zi, w, vocab, t, js, g),
                    None => core::jsd_backward_rows_in_place_saved(&mut zi, w, vocab, t, js, g),
                };
                (r, bits(&zi))
            }),
        ));
        let mut ok = 0;
        for (name, op) in &ops {
            let want = op(None);
            ok += usize::from(want.0.is_ok());
            for b in Backend::available() {
                let cpu = Cpu::new(b).unwrap().with_threads(2).unwrap();
                let before = crate::fallbacks_on_this_thread();
                let got = op(Some(&cpu));
                let what = format!("{name} on {b:?}, {rows} × {vocab}, T = {t}");
                assert_eq!(got.0, want.0, "{what}");
                assert!(got.1 == want.1, "{what}: outputs differ");
                // A valid call must have run the kernels, not grpo-core.
                let fell_back = crate::fallbacks_on_this_thread() > before;
                assert_eq!(fell_back, want.0.is_err(), "{what}: fallback");
            }
        }
        ok
    }

    #[test]
    fn public_ops_match_core_on_every_backend_and_storage() {
        let mut ok = 0;
        for (vocab, rows) in [(1, 9), (17, 5), (2048 + 49, 3)] {
            for t in [1.0f32, 0.7] {
                let seed = (vocab * 31 + rows) as u64;
                ok += every_op::<f32, f32>(rows, vocab, t, seed);
                ok += every_op::<half::bf16, half::bf16>(rows, vocab, t, seed);
                ok += every_op::<half::f16, half::f16>(rows, vocab, t, seed);
                ok += every_op::<half::bf16, f32>(rows, vocab, t, seed);
            }
        }
        // Row 7 of the V = 1 batches is its masked logit alone: every call on those batches
        // fails (grpo-core's error, compared above). Every other call succeeds.
        assert_eq!(ok, 2 * 2 * 4 * 25, "{ok}");
    }

    /// Every field of a JSD state, as bits.
    fn jsd_state_bits(s: &JsdState) -> [u32; 6] {
        let (a, b) = (&s.student, &s.teacher);
        [a.max, a.neg_ln_sum, b.max, b.neg_ln_sum, s.beta, s.kl_pm].map(f32::to_bits)
    }
}
