//! Row operations: log-sum-exp, token log-probability, entropy, KL, JSD and the fused backward,
//! for one row and for a batch of rows `[rows, V]` (MATH.md §5).

use super::canon::{self, GradCoef, KlGrad, LseState, PairState};
use super::exp_ln::max_r;
use super::saved::JsdState;
#[cfg(doc)]
use super::saved::{backward_rows_saved, jsd_backward_rows_saved};
use crate::error::{Error, Result, check_len};

/// A token id: `u32`, `u64`, `usize`, `i32` or `i64` (negative ids are out of range).
///
/// ```
/// use grpo_core::vocab::TokenId;
/// assert_eq!(7u32.index(), 7);
/// assert_eq!((-1i64).index(), usize::MAX);
/// ```
pub trait TokenId: Copy {
    /// The id as an index; negative or unrepresentable ids map to `usize::MAX`.
    fn index(self) -> usize;
}

macro_rules! token_id {
    ($($t:ty),*) => {$(
        impl TokenId for $t {
            #[inline]
            fn index(self) -> usize {
                usize::try_from(self).unwrap_or(usize::MAX)
            }
        }
    )*};
}
token_id!(u32, u64, usize, i32, i64);

/// Direction of a KL divergence between the student distribution p (from `student` logits)
/// and the teacher distribution q (from `teacher` logits), named by its arguments in order.
///
/// The names "forward" and "reverse" are not used because the fields disagree on them. In
/// distillation (GKD 2306.13649, MiniLLM, on-policy distillation, TRL's `beta`) the *forward*
/// KL is KL(teacher‖student), the mean-seeking one of supervised distillation, and the
/// *reverse* KL is KL(student‖teacher), the mode-seeking one; TRL's generalized JSD is
/// [`TeacherStudent`](KlDirection::TeacherStudent)'s KL in the limit `beta → 0` and
/// [`StudentTeacher`](KlDirection::StudentTeacher)'s in the limit `beta → 1` (after dividing
/// by `beta` or `1 − beta`; see [`jsd_rows`]), which its code computes directly at
/// `beta = 0` and `beta = 1`.
///
/// ```
/// use grpo_core::vocab::{kl_rows, KlDirection};
/// // p = [½, ½] (student), q = [¼, ¾] (teacher).
/// let (z, w) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
/// let mut kl = [0.0f32];
/// kl_rows(&z, &w, 2, 1.0, KlDirection::StudentTeacher, &mut kl).unwrap();
/// assert!((kl[0] - 0.1438410).abs() < 1e-6); // ½ ln 2 + ½ ln (2/3): the reverse KL of GKD
/// kl_rows(&z, &w, 2, 1.0, KlDirection::TeacherStudent, &mut kl).unwrap();
/// assert!((kl[0] - 0.1308120).abs() < 1e-6); // ¼ ln ½ + ¾ ln (3/2): GKD's forward KL
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlDirection {
    /// KL(p‖q) = KL(student‖teacher) = Σ p (log p − log q): the mode-seeking KL, which the
    /// distillation literature and TRL call the *reverse* KL (TRL GKD `beta = 1`).
    StudentTeacher,
    /// KL(q‖p) = KL(teacher‖student) = Σ q (log q − log p): the mean-seeking KL of supervised
    /// distillation, which the distillation literature and TRL call the *forward* KL (TRL GKD
    /// `beta = 0`).
    TeacherStudent,
}

impl From<KlDirection> for KlGrad {
    /// The gradient of the KL in this direction.
    ///
    /// ```
    /// use grpo_core::vocab::{canon::KlGrad, KlDirection};
    /// assert_eq!(KlGrad::from(KlDirection::TeacherStudent), KlGrad::TeacherStudent);
    /// ```
    fn from(d: KlDirection) -> KlGrad {
        match d {
            KlDirection::StudentTeacher => KlGrad::StudentTeacher,
            KlDirection::TeacherStudent => KlGrad::TeacherStudent,
        }
    }
}

/// Validates a temperature and returns τ = 1/T (one IEEE division): the factor every kernel
/// multiplies logits by.
///
/// # Errors
/// `InvalidParam{name: "temperature"}` unless `T` is finite, `> 0` and `1/T` is finite, i.e.
/// `T > 2^-128` (a subnormal: the smallest valid `T` is the next float above it).
///
/// ```
/// use grpo_core::vocab::validate::inverse_temperature;
/// assert_eq!(inverse_temperature(0.5), Ok(2.0));
/// assert!(inverse_temperature(0.0).is_err() && inverse_temperature(f32::NAN).is_err());
/// let two_pow_m128 = f32::from_bits(1 << 21); // 2^-149 · 2^21
/// assert!(inverse_temperature(two_pow_m128).is_err());
/// assert!(inverse_temperature(two_pow_m128.next_up()).is_ok());
/// ```
pub fn inverse_temperature(temperature: f32) -> Result<f32> {
    let ok = temperature > 0.0 && temperature.is_finite();
    crate::error::ensure(ok, "temperature", "must be finite and > 0")?;
    let tau = 1.0 / temperature;
    crate::error::ensure(
        tau.is_finite(),
        "temperature",
        "must be above 2^-128 ≈ 2.9e-39 (1/T must be finite)",
    )?;
    Ok(tau)
}

/// Number of rows of a `[rows, vocab]` slice, checking `vocab > 0` and the length.
pub(super) fn rows_of(what: &'static str, len: usize, vocab: usize, rows: usize) -> Result<()> {
    crate::error::ensure(vocab > 0, "vocab", "must be > 0")?;
    let expected = rows.checked_mul(vocab).ok_or(Error::InvalidParam {
        name: "vocab",
        reason: "rows · vocab overflows usize",
    })?;
    check_len(what, expected, len)
}

/// Validates one logit row and returns its raw maximum (the checks, in this order, that every
/// backend reproduces).
///
/// # Errors
/// `NonFinite{what, index: base + v}` for the first NaN or +∞ at `v`; `EmptySegment{segment}`
/// when every logit is −∞; `NonFinite{what: "<what> / temperature", index: base + v}` when the
/// maximum (first found at `v`) times τ overflows — `"logits / temperature"`, `"student /
/// temperature"` or `"teacher / temperature"` after the names grpo-core's operations pass
/// (any other `what` is reported as `"logits / temperature"`).
///
/// ```
/// use grpo_core::Error;
/// use grpo_core::vocab::validate::row;
/// assert_eq!(row(&[1.0f32, -2.0], "logits", 0, 0, 1.0), Ok(1.0));
/// assert!(row(&[f32::NEG_INFINITY; 3], "logits", 0, 5, 1.0).is_err());
/// assert_eq!(
///     row(&[0.5f32, 3e38], "teacher", 10, 5, 2.0),
///     Err(Error::NonFinite { what: "teacher / temperature", index: 11 })
/// );
/// ```
pub fn row<S: super::Logit>(
    row: &[S],
    what: &'static str,
    base: usize,
    segment: usize,
    tau: f32,
) -> Result<f32> {
    let mut m = f32::NEG_INFINITY;
    for (v, &x) in row.iter().enumerate() {
        let x = x.to_f32();
        if x.is_nan() || x == f32::INFINITY {
            return Err(Error::NonFinite {
                what,
                index: base + v,
            });
        }
        m = max_r(m, x);
    }
    if m == f32::NEG_INFINITY {
        return Err(Error::EmptySegment { segment });
    }
    if !(m * tau).is_finite() {
        // The largest logit overflows once divided by T: report where it is.
        let v = row.iter().position(|x| x.to_f32() == m).unwrap_or(0);
        let what = match what {
            "student" => "student / temperature",
            "teacher" => "teacher / temperature",
            _ => "logits / temperature",
        };
        return Err(Error::NonFinite {
            what,
            index: base + v,
        });
    }
    Ok(m)
}

/// Validates the target `y` of a row already validated by [`row`] (whose raw maximum is
/// `raw_max`).
///
/// # Errors
/// `TokenOutOfRange{index, token: y, vocab}` when `y ≥ V`; `NonFinite{what: "logits[target]",
/// index: base + y}` when `(z_y − max)·τ` is not finite: a −∞ target logit, or a finite one so
/// far below the maximum that its log-probability overflows f32 (e.g. `z = [3e38, −3e38]`,
/// `y = 1`, `T = 1`: log p = −6e38).
///
/// ```
/// use grpo_core::vocab::validate::target;
/// let z = [0.0f32, f32::NEG_INFINITY];
/// assert!(target(&z, 0, 0.0, 1.0, 0, 0).is_ok());
/// assert!(target(&z, 1, 0.0, 1.0, 0, 0).is_err() && target(&z, 2, 0.0, 1.0, 0, 0).is_err());
/// // finite, but log p = −6e38 does not fit in f32
/// assert!(target(&[3e38f32, -3e38], 1, 3e38, 1.0, 0, 0).is_err());
/// ```
pub fn target<S: super::Logit>(
    row: &[S],
    y: usize,
    raw_max: f32,
    tau: f32,
    base: usize,
    index: usize,
) -> Result<()> {
    let zy = match row.get(y) {
        Some(z) => z.to_f32(),
        None => {
            return Err(Error::TokenOutOfRange {
                index,
                token: y,
                vocab: row.len(),
            });
        }
    };
    if !((zy - raw_max) * tau).is_finite() {
        return Err(Error::NonFinite {
            what: "logits[target]",
            index: base + y,
        });
    }
    Ok(())
}

/// Checks that the KL in `dir` is finite: no element where the distribution the expectation
/// is taken under is positive and the other is 0 (−∞ logit). `None` checks nothing (JSD).
///
/// # Errors
/// `NonFinite{what: "teacher …" | "student …", index: base + v}` at the first such `v`.
///
/// ```
/// use grpo_core::vocab::{validate::support, KlDirection};
/// let (z, w) = ([0.0f32, 0.0], [0.0f32, f32::NEG_INFINITY]);
/// assert!(support(&z, &w, Some(KlDirection::StudentTeacher), 0).is_err());
/// assert!(support(&z, &w, Some(KlDirection::TeacherStudent), 0).is_ok());
/// ```
pub fn support<S: super::Logit, U: super::Logit>(
    z: &[S],
    w: &[U],
    dir: Option<KlDirection>,
    base: usize,
) -> Result<()> {
    let Some(dir) = dir else { return Ok(()) };
    for (v, (&a, &b)) in z.iter().zip(w).enumerate() {
        let (a, b) = (a.to_f32(), b.to_f32());
        let bad = match dir {
            KlDirection::StudentTeacher => b == f32::NEG_INFINITY && a > f32::NEG_INFINITY,
            KlDirection::TeacherStudent => a == f32::NEG_INFINITY && b > f32::NEG_INFINITY,
        };
        if bad {
            let what = match dir {
                KlDirection::StudentTeacher => {
                    "teacher (−∞ where the student is not: KL(p‖q) = +∞)"
                }
                KlDirection::TeacherStudent => {
                    "student (−∞ where the teacher is not: KL(q‖p) = +∞)"
                }
            };
            return Err(Error::NonFinite {
                what,
                index: base + v,
            });
        }
    }
    Ok(())
}

/// Softmax statistics of one row: what the forward operations return.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowStats {
    /// `lse = log Σ_v exp(z_v/T)`.
    pub lse: f32,
    /// Entropy `H = lse − Σ_v p_v z_v/T` (nats).
    pub entropy: f32,
}

/// Log-sum-exp and entropy of one row at temperature `T`, in one pass \[ours\].
///
/// Formula: `lse = log Σ_v exp(z_v/T)`, `H = −Σ_v p_v log p_v = lse − Σ_v p_v z_v/T` with
/// `p = softmax(z/T)`, computed by the online `(M, s, t)` reduction of [`canon`] in its
/// canonical order (MATH.md §5). −∞ logits are masked entries (p = 0).
///
/// # Errors
/// `InvalidParam` (T not finite and > 0), `InvalidParam{name: "vocab"}` for an empty row,
/// `NonFinite{what: "logits", index}` for the first NaN or +∞, `EmptySegment{segment: 0}` when
/// every logit is −∞, `NonFinite{what: "logits / temperature"}` when `max z / T` overflows.
///
/// ```
/// use grpo_core::vocab::row_stats;
/// // logits [0, ln 3] → p = [¼, ¾]; lse = ln 4; H = −(¼ ln ¼ + ¾ ln ¾) = 0.5623351446
/// let st = row_stats(&[0.0f32, 3f32.ln()], 1.0).unwrap();
/// assert!((st.lse - 4f32.ln()).abs() < 1e-6);
/// assert!((st.entropy - 0.5623351446).abs() < 1e-6);
/// ```
pub fn row_stats<S: super::Logit>(logits: &[S], temperature: f32) -> Result<RowStats> {
    let tau = inverse_temperature(temperature)?;
    crate::error::ensure(!logits.is_empty(), "vocab", "must be > 0")?;
    row(logits, "logits", 0, 0, tau)?;
    let (lse, _, entropy) = canon::finish_lse(&canon::lse_row(logits, tau), tau);
    Ok(RowStats { lse, entropy })
}

/// `log Σ_v exp(z_v/T)` of one row \[ours\] (see [`row_stats`] for the method and errors).
///
/// ```
/// use grpo_core::vocab::log_sum_exp;
/// // log(e^1 + e^1) = 1 + ln 2
/// let l = log_sum_exp(&[1.0f32, 1.0], 1.0).unwrap();
/// assert!((l - (1.0 + 2f32.ln())).abs() < 1e-6);
/// ```
pub fn log_sum_exp<S: super::Logit>(logits: &[S], temperature: f32) -> Result<f32> {
    row_stats(logits, temperature).map(|s| s.lse)
}

/// Entropy `H = −Σ p log p` of `softmax(z/T)` for one row \[ours\] (method and errors: see
/// [`row_stats`]).
///
/// ```
/// use grpo_core::vocab::entropy;
/// // four equal logits: H = ln 4 = 1.3862944
/// let h = entropy(&[2.0f32; 4], 0.5).unwrap();
/// assert!((h - 4f32.ln()).abs() < 1e-6);
/// ```
pub fn entropy<S: super::Logit>(logits: &[S], temperature: f32) -> Result<f32> {
    row_stats(logits, temperature).map(|s| s.entropy)
}

/// Token log-probability and entropy of one row in one pass \[ours\].
///
/// Formula: `logp(y) = z_y/T − lse`, computed as `fma(z_y − m, τ, −ln s)` from the same row
/// state (`m` = row max), and `H` as in [`row_stats`].
///
/// # Errors
/// Those of [`row_stats`], plus `TokenOutOfRange{index: 0, ..}` when `target ≥ V` and
/// `NonFinite{what: "logits[target]", index: target}` when the target's log-probability is not
/// finite in f32 ([`validate::target`](super::validate::target)): its logit is −∞, or lies so
/// far below the maximum that `(z_y − max)/T` overflows.
///
/// ```
/// use grpo_core::vocab::logprob_entropy;
/// // logits [0, ln 3]: logp(1) = ln ¾ = −0.2876821; H = 0.5623351
/// let (lp, h) = logprob_entropy(&[0.0f32, 3f32.ln()], 1usize, 1.0).unwrap();
/// assert!((lp - 0.75f32.ln()).abs() < 1e-6 && (h - 0.5623351).abs() < 1e-6);
/// ```
pub fn logprob_entropy<S: super::Logit, I: TokenId>(
    logits: &[S],
    token: I,
    temperature: f32,
) -> Result<(f32, f32)> {
    let tau = inverse_temperature(temperature)?;
    crate::error::ensure(!logits.is_empty(), "vocab", "must be > 0")?;
    let y = token.index();
    if y >= logits.len() {
        return Err(Error::TokenOutOfRange {
            index: 0,
            token: y,
            vocab: logits.len(),
        });
    }
    let m = row(logits, "logits", 0, 0, tau)?;
    target(logits, y, m, tau, 0, 0)?;
    let st = canon::lse_row(logits, tau);
    let (_, _, h) = canon::finish_lse(&st, tau);
    Ok((canon::logp_of(logits[y].to_f32(), tau, &st), h))
}

/// Log-probability `logp(y) = z_y/T − log Σ_v exp(z_v/T)` of one token \[ours\]
/// (method and errors: [`logprob_entropy`]).
///
/// ```
/// use grpo_core::vocab::token_logprob;
/// // logits [0, 0, 0, 0]: logp = −ln 4
/// let lp = token_logprob(&[0.0f32; 4], 2u32, 1.0).unwrap();
/// assert!((lp + 4f32.ln()).abs() < 1e-6);
/// ```
pub fn token_logprob<S: super::Logit, I: TokenId>(
    logits: &[S],
    token: I,
    temperature: f32,
) -> Result<f32> {
    logprob_entropy(logits, token, temperature).map(|r| r.0)
}

/// Validates a student/teacher row pair.
fn scan_pair<S: super::Logit, U: super::Logit>(
    z: &[S],
    w: &[U],
    tau: f32,
    dir: Option<KlDirection>,
    base: usize,
    segment: usize,
) -> Result<()> {
    row(z, "student", base, segment, tau)?;
    row(w, "teacher", base, segment, tau)?;
    support(z, w, dir, base)
}

/// KL divergence between the student `p = softmax(z/T)` and the teacher `q = softmax(w/T)`
/// of one row, in one pass \[ours; the distillation losses of arXiv 2306.13649\].
///
/// Formula: `KL(p‖q) = Σ p (log p − log q)` (`StudentTeacher`) or `KL(q‖p) = Σ q (log q −
/// log p)` (`TeacherStudent`), computed as `(ln s_w − ln s_z) + u/s_z` from the pair reduction of [`canon`]
/// (the row maxima cancel exactly). Elements where both logits are −∞ contribute 0. Log-ratios
/// are floored at −2^64 ([`canon::LOG_RATIO_FLOOR`]) before they are weighted, so the result
/// is finite for finite input.
///
/// # Errors
/// `InvalidParam` (temperature, empty rows), `LengthMismatch{what: "teacher"}`,
/// `NonFinite{what: "student" | "teacher", index}` for NaN/+∞, `EmptySegment{segment: 0}` for an
/// all-−∞ row, `NonFinite{what: "student / temperature" | "teacher / temperature"}` when a
/// row's maximum overflows once divided by T, and `NonFinite` when the expectation's
/// distribution is positive where the other is 0 (the KL is +∞): `StudentTeacher` needs
/// `w_v = −∞ ⇒ z_v = −∞`, `TeacherStudent` the converse.
///
/// ```
/// use grpo_core::vocab::{kl_divergence, KlDirection};
/// // p = [½, ½] (z = [0, 0]), q = [¼, ¾] (w = [0, ln 3]):
/// // KL(p‖q) = ½ ln(½/¼) + ½ ln(½/¾) = ½ ln 2 + ½ ln(2/3) = 0.1438410
/// // KL(q‖p) = ¼ ln(¼/½) + ¾ ln(¾/½) = −0.1732868 + 0.3040988 = 0.1308120
/// let (z, w) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
/// let f = kl_divergence(&z, &w, 1.0, KlDirection::StudentTeacher).unwrap();
/// let r = kl_divergence(&z, &w, 1.0, KlDirection::TeacherStudent).unwrap();
/// assert!((f - 0.1438410).abs() < 1e-6 && (r - 0.1308120).abs() < 1e-6);
/// ```
pub fn kl_divergence<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    temperature: f32,
    direction: KlDirection,
) -> Result<f32> {
    let tau = inverse_temperature(temperature)?;
    crate::error::ensure(!student.is_empty(), "vocab", "must be > 0")?;
    check_len("teacher", student.len(), teacher.len())?;
    scan_pair(student, teacher, tau, Some(direction), 0, 0)?;
    let (f, r) = canon::finish_kl(&canon::pair_row(student, teacher, tau));
    Ok(match direction {
        KlDirection::StudentTeacher => f,
        KlDirection::TeacherStudent => r,
    })
}

/// Checks `0 < β < 1` and returns `(β, 1 − β)`.
fn beta_of(beta: f32) -> Result<(f32, f32)> {
    crate::error::ensure(
        beta > 0.0 && beta < 1.0,
        "beta",
        "must be in (0, 1) (use kl_divergence for the endpoints)",
    )?;
    Ok((beta, 1.0 - beta))
}

/// Generalised Jensen–Shannon divergence of one student/teacher row pair \[arXiv 2306.13649\].
///
/// Formula: with `p = softmax(z/T)` (student), `q = softmax(w/T)` (teacher) and the mixture
/// `m = β q + (1 − β) p`: `JSD_β = β KL(q‖m) + (1 − β) KL(p‖m)` for `0 < β < 1` (TRL's GKD
/// loss uses the same definition). `JSD_β` itself tends to 0 at both ends; TRL's code
/// computes its limits after division instead — at `β = 0` KL(teacher‖student)
/// (`JSD_β/β → KL(q‖p)`, [`KlDirection::TeacherStudent`]) and at `β = 1`
/// KL(student‖teacher) (`JSD_β/(1 − β) → KL(p‖q)`, [`KlDirection::StudentTeacher`]): for
/// those endpoints use [`kl_divergence`] / [`kl_rows`]. Two passes: the pair statistics, then `Σ_v β q_v (log q_v − log m_v) +
/// (1−β) p_v (log p_v − log m_v)` in the canonical order with `log p_v = z_v/T − lse_z`.
/// Masked entries (−∞ in either row) are allowed: JSD is always finite.
///
/// # Errors
/// As [`kl_divergence`] (without the support condition), plus `InvalidParam{name: "beta"}`.
///
/// ```
/// use grpo_core::vocab::jsd;
/// // p = [1, 0]-like and q = [0, 1]-like rows that are disjoint (masked): JSD_½ = ln 2
/// let ninf = f32::NEG_INFINITY;
/// let j = jsd(&[0.0f32, ninf], &[ninf, 0.0f32], 0.5, 1.0).unwrap();
/// assert!((j - 2f32.ln()).abs() < 1e-6);
/// // identical rows: 0
/// assert!(jsd(&[1.0f32, 2.0], &[1.0f32, 2.0], 0.3, 1.0).unwrap().abs() < 1e-7);
/// ```
pub fn jsd<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    beta: f32,
    temperature: f32,
) -> Result<f32> {
    let tau = inverse_temperature(temperature)?;
    let (beta, _) = beta_of(beta)?;
    crate::error::ensure(!student.is_empty(), "vocab", "must be > 0")?;
    check_len("teacher", student.len(), teacher.len())?;
    scan_pair(student, teacher, tau, None, 0, 0)?;
    Ok(jsd_row(student, teacher, tau, beta))
}

fn jsd_row<S: super::Logit, U: super::Logit>(z: &[S], w: &[U], tau: f32, beta: f32) -> f32 {
    let j = canon::JsdParams::of(&canon::pair_row(z, w, tau), tau, beta);
    jsd_of(z, w, &j)
}

/// The JSD of a validated row pair from its [`canon::JsdParams`]: the canonical sum of
/// [`canon::jsd_step`], floored at 0.
fn jsd_of<S: super::Logit, U: super::Logit>(z: &[S], w: &[U], j: &canon::JsdParams) -> f32 {
    let s = canon::canonical_sum(z.len(), |i| {
        canon::jsd_step(z[i].to_f32(), w[i].to_f32(), j)
    });
    max_r(0.0, s)
}

/// `K = KL(p‖m)` of a validated row pair, unclamped: the canonical sum of
/// [`canon::jsd_student_step`].
fn jsd_kl_pm<S: super::Logit, U: super::Logit>(z: &[S], w: &[U], j: &canon::JsdParams) -> f32 {
    canon::canonical_sum(z.len(), |i| {
        canon::jsd_student_step(z[i].to_f32(), w[i].to_f32(), j)
    })
}

// ---------------------------------------------------------------------------------------------
// Batched rows.

/// Validates `[rows, V]` logits and returns τ.
fn check_rows<S: super::Logit>(
    logits: &[S],
    vocab: usize,
    rows: usize,
    temperature: f32,
) -> Result<f32> {
    let tau = inverse_temperature(temperature)?;
    rows_of("logits", logits.len(), vocab, rows)?;
    Ok(tau)
}

/// Row `r` of a validated `[rows, vocab]` slice.
#[inline]
pub(super) fn row_of<T>(x: &[T], vocab: usize, r: usize) -> &[T] {
    &x[r * vocab..(r + 1) * vocab]
}

/// Checks every target is below `vocab`.
fn check_targets<I: TokenId>(targets: &[I], vocab: usize) -> Result<()> {
    for (r, &t) in targets.iter().enumerate() {
        let y = t.index();
        if y >= vocab {
            return Err(Error::TokenOutOfRange {
                index: r,
                token: y,
                vocab,
            });
        }
    }
    Ok(())
}

/// Log-sum-exp and entropy of every row of `logits` (`[rows, vocab]`, row-major) \[ours\].
///
/// Formula per row: as [`row_stats`]. `lse_out` and `entropy_out` have one element per row
/// (`rows = lse_out.len()`).
///
/// # Errors
/// `InvalidParam` (temperature, `vocab = 0`), `LengthMismatch` (`logits`, `entropy_out`), then
/// per row in order: `NonFinite{what: "logits", index: r·V + v}`, `EmptySegment{segment: r}`,
/// `NonFinite{what: "logits / temperature", index: r·V + v}` when the row maximum (first at
/// `v`) over T overflows ([`validate::row`](super::validate::row)). On `Err` no output is
/// written.
///
/// ```
/// use grpo_core::vocab::stats_rows;
/// // row 0: [0, 0] → lse = ln 2, H = ln 2; row 1: [5, −∞] → lse = 5, H = 0
/// let z = [0.0f32, 0.0, 5.0, f32::NEG_INFINITY];
/// let (mut lse, mut h) = ([0.0f32; 2], [0.0f32; 2]);
/// stats_rows(&z, 2, 1.0, &mut lse, &mut h).unwrap();
/// assert!((lse[0] - 2f32.ln()).abs() < 1e-6 && (h[0] - 2f32.ln()).abs() < 1e-6);
/// assert_eq!((lse[1], h[1]), (5.0, 0.0));
/// ```
pub fn stats_rows<S: super::Logit>(
    logits: &[S],
    vocab: usize,
    temperature: f32,
    lse_out: &mut [f32],
    entropy_out: &mut [f32],
) -> Result<()> {
    let rows = lse_out.len();
    let tau = check_rows(logits, vocab, rows, temperature)?;
    check_len("entropy_out", rows, entropy_out.len())?;
    for r in 0..rows {
        row(row_of(logits, vocab, r), "logits", r * vocab, r, tau)?;
    }
    for r in 0..rows {
        let (lse, _, h) = canon::finish_lse(&canon::lse_row(row_of(logits, vocab, r), tau), tau);
        lse_out[r] = lse;
        entropy_out[r] = h;
    }
    Ok(())
}

/// Token log-probabilities (and optionally entropies) of every row, fused in one pass \[ours\].
///
/// Formula per row `r`: `logp_out[r] = z[r, y_r]/T − lse_r` and `entropy_out[r] = H_r` as in
/// [`logprob_entropy`]; `rows = targets.len()`. `entropy_out = None` skips nothing in the
/// arithmetic (the pass computes both) but writes only the log-probabilities.
///
/// # Errors
/// `InvalidParam` (temperature, `vocab = 0`), `LengthMismatch` (`logits`, `logp_out`,
/// `entropy_out`), `TokenOutOfRange{index: r, ..}` for the first bad target, then per row in
/// order: `NonFinite{what: "logits", index: r·V + v}`, `EmptySegment{segment: r}`,
/// `NonFinite{what: "logits / temperature", index: r·V + v}` when the row maximum (first at
/// `v`) over T overflows ([`validate::row`](super::validate::row)), `NonFinite{what:
/// "logits[target]", index: r·V +
/// y}` (target log-probability not finite in f32: see
/// [`validate::target`](super::validate::target)). Token ids are [`TokenId`]s: a negative id
/// (TRL's and verl's ignore label −100 included) is `TokenOutOfRange` with `token:
/// usize::MAX` — rows to ignore are left out of the batch, or given any valid id and a zero
/// weight in the backward. On `Err` no output is written.
///
/// ```
/// use grpo_core::vocab::logprob_entropy_rows;
/// // row 0: [0, ln 3], target 1 → logp = ln ¾; row 1: [1, 1, 1, 1], target 0 → −ln 4, H = ln 4
/// let z = [0.0f32, 3f32.ln(), 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
/// let (mut lp, mut h) = ([0.0f32; 2], [0.0f32; 2]);
/// // 7 logits do not make two rows of 4
/// assert!(logprob_entropy_rows(&z[..7], 4, &[1u32, 0], 1.0, &mut lp, Some(&mut h)).is_err());
/// logprob_entropy_rows(&z, 4, &[1u32, 0], 1.0, &mut lp, Some(&mut h)).unwrap();
/// // row 0 is [0, ln 3, 0, 0]: logp(1) = ln(3/6) = −ln 2
/// assert!((lp[0] + 2f32.ln()).abs() < 1e-6);
/// assert!((lp[1] + 4f32.ln()).abs() < 1e-6 && (h[1] - 4f32.ln()).abs() < 1e-6);
/// ```
pub fn logprob_entropy_rows<S: super::Logit, I: TokenId>(
    logits: &[S],
    vocab: usize,
    targets: &[I],
    temperature: f32,
    logp_out: &mut [f32],
    entropy_out: Option<&mut [f32]>,
) -> Result<()> {
    logprob_entropy_rows_to(
        logits,
        vocab,
        targets,
        temperature,
        logp_out,
        entropy_out,
        None,
    )
}

/// [`logprob_entropy_rows`] that also saves each row's softmax state for
/// [`backward_rows_saved`] \[ours\]: `saved_out[r]` is the merged [`canon::LseState`] of row
/// `r` — its reference `max` (within 8·T below the row's maximum), `sum = Σ_v e^{(z_v −
/// max)/T}` and `dot = Σ_v e^{(z_v − max)/T}·(z_v − max)/T` — from which `lse = max/T +
/// ln(sum)`, `H = ln(sum) − dot/sum` and every `log p_v` follow. Saving costs nothing: the
/// pass computes the state anyway (three `f32` per row). The log-probabilities and entropies
/// are those of [`logprob_entropy_rows`], bit for bit.
///
/// The state is what a backward would otherwise recompute with a second pass over the
/// logits: [`backward_rows_saved`] reads each logit once and writes its gradient, where
/// [`backward_rows`] reads the logits twice (the flash-attention and Liger-kernel
/// cross-entropy backward likewise keep the forward's log-sum-exp).
///
/// # Errors
/// As [`logprob_entropy_rows`], plus `LengthMismatch{what: "saved_out"}` (after the other
/// outputs' lengths). On `Err` no output is written.
///
/// ```
/// use grpo_core::vocab::{logprob_entropy_rows_saved, LseState};
/// // one row [0, ln 3], target 1 → logp = ln ¾; the state: max = ln 3, sum = 1 + ⅓
/// let z = [0.0f32, 3f32.ln()];
/// let (mut lp, mut saved) = ([0.0f32; 1], [LseState::EMPTY; 1]);
/// logprob_entropy_rows_saved(&z, 2, &[1u32], 1.0, &mut lp, None, &mut saved).unwrap();
/// assert!((lp[0] - 0.75f32.ln()).abs() < 1e-6);
/// assert_eq!(saved[0].max, 3f32.ln());
/// assert!((saved[0].sum - 4.0 / 3.0).abs() < 1e-6);
/// ```
pub fn logprob_entropy_rows_saved<S: super::Logit, I: TokenId>(
    logits: &[S],
    vocab: usize,
    targets: &[I],
    temperature: f32,
    logp_out: &mut [f32],
    entropy_out: Option<&mut [f32]>,
    saved_out: &mut [LseState],
) -> Result<()> {
    let saved_out = Some(saved_out);
    logprob_entropy_rows_to(
        logits,
        vocab,
        targets,
        temperature,
        logp_out,
        entropy_out,
        saved_out,
    )
}

/// [`logprob_entropy_rows`], saving the row states in `saved_out` if given.
fn logprob_entropy_rows_to<S: super::Logit, I: TokenId>(
    logits: &[S],
    vocab: usize,
    targets: &[I],
    temperature: f32,
    logp_out: &mut [f32],
    mut entropy_out: Option<&mut [f32]>,
    mut saved_out: Option<&mut [LseState]>,
) -> Result<()> {
    let rows = targets.len();
    let tau = check_rows(logits, vocab, rows, temperature)?;
    check_len("logp_out", rows, logp_out.len())?;
    if let Some(h) = entropy_out.as_deref() {
        check_len("entropy_out", rows, h.len())?;
    }
    if let Some(st) = saved_out.as_deref() {
        check_len("saved_out", rows, st.len())?;
    }
    check_targets(targets, vocab)?;
    for (r, &t) in targets.iter().enumerate() {
        let z = row_of(logits, vocab, r);
        let m = row(z, "logits", r * vocab, r, tau)?;
        target(z, t.index(), m, tau, r * vocab, r)?;
    }
    for (r, &t) in targets.iter().enumerate() {
        let z = row_of(logits, vocab, r);
        let st = canon::lse_row(z, tau);
        logp_out[r] = canon::logp_of(z[t.index()].to_f32(), tau, &st);
        if let Some(h) = entropy_out.as_deref_mut() {
            h[r] = canon::finish_lse(&st, tau).2;
        }
        if let Some(saved) = saved_out.as_deref_mut() {
            saved[r] = st;
        }
    }
    Ok(())
}

/// KL divergence of every student/teacher row pair (`[rows, vocab]` each) \[ours\].
///
/// Formula per row: as [`kl_divergence`]; `rows = out.len()`.
///
/// # Errors
/// As [`kl_divergence`], with indices `r·V + v` and `segment: r`; rows are checked in order.
/// On `Err` no output is written.
///
/// ```
/// use grpo_core::vocab::{kl_rows, KlDirection};
/// // row 0 identical → 0; row 1: p = [½, ½], q = [¼, ¾] → KL(p‖q) = 0.1438410
/// let z = [1.0f32, 2.0, 0.0, 0.0];
/// let w = [1.0f32, 2.0, 0.0, 3f32.ln()];
/// let mut out = [9.0f32; 2];
/// kl_rows(&z, &w, 2, 1.0, KlDirection::StudentTeacher, &mut out).unwrap();
/// assert!(out[0].abs() < 1e-7 && (out[1] - 0.1438410).abs() < 1e-6);
/// ```
pub fn kl_rows<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    vocab: usize,
    temperature: f32,
    direction: KlDirection,
    out: &mut [f32],
) -> Result<()> {
    kl_rows_to(student, teacher, vocab, temperature, direction, out, None)
}

/// [`kl_rows`] that also saves each row pair's merged state for [`backward_rows_saved`]
/// \[ours\]: `saved_out[r]` is [`canon::pair_row`] of the student and teacher rows `r` — both
/// references and sums of exponentials, both entropies' sums (`tz`, `tw`) and both KL sums
/// (`u`, `v`) — from which both log-softmaxes, both entropies and both KL directions follow
/// ([`canon::finish_lse`], [`canon::finish_kl`]), except that a `TeacherStudent` call records
/// `u = +∞` where the teacher is −∞ and the student is not (below). The KL values are those of
/// [`kl_rows`], bit for bit. The other direction's KL from a state is exact where it is finite;
/// where KL(q‖p) is +∞ (the student −∞ where the teacher is not), a `StudentTeacher` state
/// gives a huge finite value from the −2^64 floor of the log-ratios, not +∞ (its gradient
/// `(p_v − q_v)/T` is finite, so the backward needs no marker there).
///
/// The student half of a state (`PairState::student`) is the student row's own
/// [`LseState`], so the student's log-probabilities and entropies follow from it with the
/// bits of [`logprob_entropy_rows`]: `canon::logp_of(z[y], τ, &st.student())` and
/// `canon::finish_lse(&st.student(), τ).2` (τ = 1/T rounded once). A distillation forward
/// that needs them as well as the KL reads the student rows once.
///
/// A distillation backward from these states ([`backward_rows_saved`] with a KL term) reads
/// the student and teacher rows once, where [`backward_rows`] reads both twice. Computing all
/// the sums costs up to three more FMAs per element pair than [`kl_rows`]' one (a
/// compute-bound loop in 16-bit storage), nothing in memory traffic: eight `f32` per row.
///
/// The state does not depend on `direction`, except where KL(p‖q) is +∞ (the teacher is −∞
/// where the student is not, which a `TeacherStudent` call accepts): there the state records
/// it as `u = +∞`, so `finish_kl` gives KL(p‖q) = +∞ and [`backward_rows_saved`] refuses a
/// KL(p‖q) term on it as [`backward_rows`] does (`NonFinite{what: "saved KL(p‖q)"}`); the
/// other sums keep their bits. A state saved by a `StudentTeacher` call may serve a
/// `TeacherStudent` KL term's gradient (finite: `(p_v − q_v)/T`) even where KL(q‖p) itself is
/// +∞.
///
/// # Errors
/// As [`kl_rows`], plus `LengthMismatch{what: "saved_out"}` (after the rows' lengths). On
/// `Err` no output is written.
///
/// ```
/// use grpo_core::vocab::{kl_rows_saved, KlDirection, PairState};
/// use grpo_core::vocab::canon::finish_kl;
/// // p = [½, ½], q = [¼, ¾] → KL(p‖q) = 0.1438410; the state also gives KL(q‖p)
/// let (z, w) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
/// let (mut kl, mut saved) = ([0.0f32; 1], [PairState::EMPTY; 1]);
/// kl_rows_saved(&z, &w, 2, 1.0, KlDirection::StudentTeacher, &mut kl, &mut saved).unwrap();
/// assert!((kl[0] - 0.1438410).abs() < 1e-6);
/// let (pq, qp) = finish_kl(&saved[0]);
/// assert_eq!(pq, kl[0]);
/// assert!((qp - 0.1308120).abs() < 1e-6); // ¼ ln ½ + ¾ ln (3/2)
/// ```
pub fn kl_rows_saved<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    vocab: usize,
    temperature: f32,
    direction: KlDirection,
    out: &mut [f32],
    saved_out: &mut [PairState],
) -> Result<()> {
    let saved_out = Some(saved_out);
    kl_rows_to(
        student,
        teacher,
        vocab,
        temperature,
        direction,
        out,
        saved_out,
    )
}

/// [`kl_rows`], saving the pair states in `saved_out` if given.
fn kl_rows_to<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    vocab: usize,
    temperature: f32,
    direction: KlDirection,
    out: &mut [f32],
    mut saved_out: Option<&mut [PairState]>,
) -> Result<()> {
    let rows = out.len();
    let tau = inverse_temperature(temperature)?;
    let saved_len = saved_out.as_deref().map(<[_]>::len);
    check_pair_rows(
        student,
        teacher,
        vocab,
        rows,
        tau,
        Some(direction),
        saved_len,
    )?;
    for (r, o) in out.iter_mut().enumerate() {
        let st = canon::pair_row(row_of(student, vocab, r), row_of(teacher, vocab, r), tau);
        let (f, rev) = canon::finish_kl(&st);
        *o = match direction {
            KlDirection::StudentTeacher => f,
            KlDirection::TeacherStudent => rev,
        };
        if let Some(saved) = saved_out.as_deref_mut() {
            saved[r] = mark_student_teacher_support(
                st,
                direction,
                row_of(student, vocab, r),
                row_of(teacher, vocab, r),
            );
        }
    }
    Ok(())
}

/// A saved pair state with `u = +∞` where KL(p‖q) is +∞ (the teacher is −∞ where the student
/// is not): a [`KlDirection::TeacherStudent`] forward accepts such rows, and the state must
/// not serve a KL(p‖q) term's gradient ([`SavedState::check_kl_term`](super::SavedState::check_kl_term)). A
/// [`KlDirection::StudentTeacher`] forward has refused them already.
fn mark_student_teacher_support<S: super::Logit, U: super::Logit>(
    st: PairState,
    direction: KlDirection,
    z: &[S],
    w: &[U],
) -> PairState {
    let refused = direction == KlDirection::TeacherStudent
        && support(z, w, Some(KlDirection::StudentTeacher), 0).is_err();
    if refused {
        PairState {
            u: f32::INFINITY,
            ..st
        }
    } else {
        st
    }
}

/// The checks the row-pair forwards ([`kl_rows`], [`jsd_rows`] and their saving forms) make
/// after their parameters', in order: both rows' lengths, `saved_out`'s length (`saved_len`,
/// when the forward saves states), then every row pair ([`scan_pair`], with the KL support
/// of `direction` if given).
fn check_pair_rows<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    vocab: usize,
    rows: usize,
    tau: f32,
    direction: Option<KlDirection>,
    saved_len: Option<usize>,
) -> Result<()> {
    rows_of("student", student.len(), vocab, rows)?;
    rows_of("teacher", teacher.len(), vocab, rows)?;
    if let Some(n) = saved_len {
        check_len("saved_out", rows, n)?;
    }
    scan_pairs(student, teacher, vocab, rows, tau, direction)
}

/// [`scan_pair`] of every row pair, in order (indices `r·V + v`, segment `r`).
fn scan_pairs<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    vocab: usize,
    rows: usize,
    tau: f32,
    direction: Option<KlDirection>,
) -> Result<()> {
    for r in 0..rows {
        let (z, w) = (row_of(student, vocab, r), row_of(teacher, vocab, r));
        scan_pair(z, w, tau, direction, r * vocab, r)?;
    }
    Ok(())
}

/// Generalised JSD_β of every student/teacher row pair \[arXiv 2306.13649\] (formula and
/// errors: [`jsd`], indices `r·V + v`); `rows = out.len()`. On `Err` no output is written.
///
/// ```
/// use grpo_core::vocab::jsd_rows;
/// let z = [0.0f32, 0.0, 1.0, 1.0];
/// let mut out = [9.0f32; 2];
/// jsd_rows(&z, &z, 2, 0.5, 1.0, &mut out).unwrap();
/// assert!(out[0].abs() < 1e-7 && out[1].abs() < 1e-7);
/// ```
pub fn jsd_rows<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    vocab: usize,
    beta: f32,
    temperature: f32,
    out: &mut [f32],
) -> Result<()> {
    jsd_rows_to(student, teacher, vocab, beta, temperature, out, None)
}

/// [`jsd_rows`] that also saves each row pair's [`JsdState`] for
/// [`jsd_backward_rows_saved`] \[ours\]: `saved_out[r]` holds both rows' log-softmax constants
/// ([`canon::LogSoftmax`] of [`canon::pair_row`]'s halves), β, and `K = KL(p‖m)` — the row
/// constants of the JSD's gradient, which [`jsd_backward_rows`] recomputes in two passes over
/// both rows before its third. The
/// JSD values are those of [`jsd_rows`], bit for bit, and `K` is the one
/// [`jsd_backward_rows`] computes (the [`canonical_sum`](canon::canonical_sum) of
/// [`canon::jsd_student_step`], unclamped), so the backward from these states gives the bits
/// of [`jsd_backward_rows`] with one pass over the rows instead of three.
///
/// `K` shares every per-element quantity with the JSD's term: saving it costs one more
/// multiply and add per element pair, and six `f32` per row.
///
/// # Errors
/// As [`jsd_rows`], plus `LengthMismatch{what: "saved_out"}` (after the rows' lengths). On
/// `Err` no output is written.
///
/// ```
/// use grpo_core::vocab::{jsd_rows, jsd_rows_saved, JsdState};
/// // p = [½, ½], q = [1, 0]-like (the teacher's second entry masked), β = ½
/// let (z, w) = ([0.0f32, 0.0], [0.0f32, f32::NEG_INFINITY]);
/// let (mut j, mut saved) = ([0.0f32; 1], [JsdState::EMPTY; 1]);
/// jsd_rows_saved(&z, &w, 2, 0.5, 1.0, &mut j, &mut saved).unwrap();
/// let mut again = [0.0f32; 1];
/// jsd_rows(&z, &w, 2, 0.5, 1.0, &mut again).unwrap();
/// assert_eq!(j, again);
/// // m = [¾, ¼]: K = KL(p‖m) = ½ ln(½/¾) + ½ ln(½/¼) = ½ ln(4/3)
/// assert!((saved[0].kl_pm - 0.5 * (4.0f32 / 3.0).ln()).abs() < 1e-6);
/// assert_eq!(saved[0].beta, 0.5);
/// ```
pub fn jsd_rows_saved<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    vocab: usize,
    beta: f32,
    temperature: f32,
    out: &mut [f32],
    saved_out: &mut [JsdState],
) -> Result<()> {
    let saved_out = Some(saved_out);
    jsd_rows_to(student, teacher, vocab, beta, temperature, out, saved_out)
}

/// [`jsd_rows`], saving the row pairs' states in `saved_out` if given.
fn jsd_rows_to<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    vocab: usize,
    beta: f32,
    temperature: f32,
    out: &mut [f32],
    mut saved_out: Option<&mut [JsdState]>,
) -> Result<()> {
    let rows = out.len();
    let tau = inverse_temperature(temperature)?;
    let (beta, _) = beta_of(beta)?;
    let saved_len = saved_out.as_deref().map(<[_]>::len);
    check_pair_rows(student, teacher, vocab, rows, tau, None, saved_len)?;
    for (r, o) in out.iter_mut().enumerate() {
        let (z, w) = (row_of(student, vocab, r), row_of(teacher, vocab, r));
        let j = canon::JsdParams::of(&canon::pair_row(z, w, tau), tau, beta);
        let Some(saved) = saved_out.as_deref_mut() else {
            *o = jsd_of(z, w, &j);
            continue;
        };
        // Both canonical sums in one pass over the pair (the bits of `jsd_of` and
        // `jsd_kl_pm`).
        let (mut jsd, mut kl_pm) = (
            canon::CanonicalSum::new(z.len()),
            canon::CanonicalSum::new(z.len()),
        );
        for (i, (a, b)) in z.iter().zip(w).enumerate() {
            let (term, student) = canon::jsd_steps(a.to_f32(), b.to_f32(), &j);
            jsd.push(i, term);
            kl_pm.push(i, student);
        }
        *o = max_r(0.0, jsd.finish());
        saved[r] = JsdState::of(&j, kl_pm.finish());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Backward.

/// Largest accepted magnitude of an upstream gradient weight. With [`MIN_GRAD_TEMPERATURE`]
/// it keeps every gradient finite: per element `|∂loss/∂z| ≤ τ·|w|·(4 + 2·133 + 2·2^65)`
/// (entropy term ≤ 88 + ln V, log-ratios floored at 2^64), i.e. ≤ 1e6·1e9·7.4e19 < f32::MAX.
pub const MAX_GRAD_WEIGHT: f32 = 1.0e9;

/// Smallest temperature the backward accepts: the gradient scales with 1/T, and below this
/// bound it could overflow f32 (see [`MAX_GRAD_WEIGHT`]). The forward operations accept any
/// `T > 0` with a finite `1/T`.
pub const MIN_GRAD_TEMPERATURE: f32 = 1.0e-6;

/// The KL term of a fused backward: teacher logits, per-row weights `∂loss/∂KL_r`, direction.
#[derive(Debug, Clone, Copy)]
pub struct KlTerm<'a, U> {
    /// Teacher logits, same shape as the student's.
    pub teacher: &'a [U],
    /// One weight per row.
    pub grad: &'a [f32],
    /// Which KL.
    pub direction: KlDirection,
}

/// The terms of a fused backward over rows: `loss_r = g_lp[r]·logp_r(y_r) + g_H[r]·H_r +
/// g_KL[r]·KL_r`. Absent terms have weight 0.
#[derive(Debug, Clone, Copy)]
pub struct GradTerms<'a, I, U = f32> {
    /// `(targets, ∂loss/∂logp)` per row.
    pub logp: Option<(&'a [I], &'a [f32])>,
    /// `∂loss/∂H` per row.
    pub entropy: Option<&'a [f32]>,
    /// The KL term.
    pub kl: Option<KlTerm<'a, U>>,
}

impl<I, U> GradTerms<'_, I, U> {
    /// Which KL gradient the terms ask for: [`KlGrad::None`] without a KL term.
    ///
    /// ```
    /// use grpo_core::vocab::{canon::KlGrad, GradTerms};
    /// let terms: GradTerms<'_, u32> = GradTerms { logp: None, entropy: Some(&[1.0]), kl: None };
    /// assert_eq!(terms.kl_grad(), KlGrad::None);
    /// ```
    pub fn kl_grad(&self) -> KlGrad {
        self.kl
            .as_ref()
            .map_or(KlGrad::None, |k| k.direction.into())
    }
}

/// Validates per-row backward weights: length `rows`, finite, `|g| ≤` [`MAX_GRAD_WEIGHT`].
///
/// # Errors
/// `LengthMismatch{what}`, `NonFinite{what, index: r}`, `InvalidParam{name: what}`.
///
/// ```
/// use grpo_core::vocab::validate::weights;
/// assert!(weights("grad_logp", &[1.0, -2.0], 2).is_ok());
/// assert!(weights("grad_logp", &[f32::NAN, 0.0], 2).is_err());
/// ```
pub fn weights(what: &'static str, g: &[f32], rows: usize) -> Result<()> {
    check_len(what, rows, g.len())?;
    for (i, &x) in g.iter().enumerate() {
        if x.is_nan() || x.abs() > MAX_GRAD_WEIGHT {
            return Err(if x.is_finite() {
                Error::InvalidParam {
                    name: what,
                    reason: "|weight| must be ≤ 1e9",
                }
            } else {
                Error::NonFinite { what, index: i }
            });
        }
    }
    Ok(())
}

/// The checks of [`backward_rows`] (with `out = Some(out.len())`) and
/// [`backward_rows_in_place`] (`out = None`), in their order, with their errors — the
/// temperature (with the gradients' minimum), `vocab > 0`, every slice length, the weights,
/// the target ids, then row by row the student row, the teacher row and the KL's support, and
/// the target logit — and returns `(τ, rows)`. Public so that other backends (grpo-wgpu)
/// reject exactly what these functions reject.
///
/// # Errors
/// As [`backward_rows`].
///
/// ```
/// use grpo_core::vocab::{validate::backward, GradTerms, KlDirection, KlTerm};
/// let z = [0.0f32, 1.0, /* row 1 */ 0.5, f32::NAN];
/// let terms: GradTerms<'_, u32> = GradTerms { logp: None, entropy: Some(&[1.0, 1.0]), kl: None };
/// assert!(backward(&z[..2], 2, 1.0, &terms, Some(2)).is_err()); // two weights, one row
/// // the NaN at flat index 3 is the first error
/// let nan = grpo_core::Error::NonFinite { what: "logits", index: 3 };
/// assert_eq!(backward(&z, 2, 1.0, &terms, Some(4)), Err(nan));
/// ```
pub fn backward<S: super::Logit, I: TokenId, U: super::Logit>(
    logits: &[S],
    vocab: usize,
    temperature: f32,
    terms: &GradTerms<'_, I, U>,
    out: Option<usize>,
) -> Result<(f32, usize)> {
    let (tau, rows) = check_backward_args(logits.len(), vocab, temperature, terms, out, None)?;
    for r in 0..rows {
        let z = row_of(logits, vocab, r);
        let m = row(z, "logits", r * vocab, r, tau)?;
        if let Some(k) = &terms.kl {
            let w = row_of(k.teacher, vocab, r);
            row(w, "teacher", r * vocab, r, tau)?;
            support(z, w, Some(k.direction), r * vocab)?;
        }
        if let Some((t, _)) = terms.logp {
            target(z, t[r].index(), m, tau, r * vocab, r)?;
        }
    }
    Ok((tau, rows))
}

/// The checks of [`backward`] that read no logit (its first ones, in its order): the
/// temperature (with the gradients' minimum), `vocab > 0`, every slice length (`logits` is the
/// logits' length, `out` the out-of-place gradient's, if any), the weights and the target ids.
/// Returns `(τ, rows)`. Public so that a backend can check its arguments before it reads the
/// rows on a device.
///
/// # Errors
/// As [`backward`], but no row check.
///
/// ```
/// use grpo_core::vocab::{validate::backward_args, GradTerms};
/// let terms: GradTerms<'_, u32> = GradTerms { logp: Some((&[1, 0], &[1.0; 2])), entropy: None, kl: None };
/// assert_eq!(backward_args(6, 3, 0.5, &terms, Some(6)), Ok((2.0, 2)));
/// // token 3 of a vocabulary of 3
/// let terms: GradTerms<'_, u32> = GradTerms { logp: Some((&[1, 3], &[1.0; 2])), ..terms };
/// assert!(backward_args(6, 3, 0.5, &terms, Some(6)).is_err());
/// ```
pub fn backward_args<I: TokenId, U: super::Logit>(
    logits: usize,
    vocab: usize,
    temperature: f32,
    terms: &GradTerms<'_, I, U>,
    out: Option<usize>,
) -> Result<(f32, usize)> {
    check_backward_args(logits, vocab, temperature, terms, out, None)
}

/// τ = 1/T for a gradient: [`inverse_temperature`]'s checks, then `T ≥`
/// [`MIN_GRAD_TEMPERATURE`] (gradients scale with 1/T), the first check of every backward.
///
/// # Errors
/// `InvalidParam{name: "temperature"}`.
///
/// ```
/// use grpo_core::vocab::validate::gradient_temperature;
/// assert_eq!(gradient_temperature(0.5), Ok(2.0));
/// assert!(gradient_temperature(1e-7).is_err()); // a valid forward temperature
/// ```
pub fn gradient_temperature(temperature: f32) -> Result<f32> {
    let tau = inverse_temperature(temperature)?;
    crate::error::ensure(
        temperature >= MIN_GRAD_TEMPERATURE,
        "temperature",
        "must be >= 1e-6 for gradients (they scale with 1/T)",
    )?;
    Ok(tau)
}

/// The checks of a backward call that read no logit, in the module's order: the temperature
/// (with the gradients' minimum), `vocab > 0`, every slice length (`out`: the out-of-place
/// gradient's, if any; `saved`: the number of saved states and whether they hold the
/// teacher's, if any — without it, no KL term), the weights and the target ids. Returns
/// `(τ, rows)`.
pub(super) fn check_backward_args<I: TokenId, U: super::Logit>(
    logits: usize,
    vocab: usize,
    temperature: f32,
    terms: &GradTerms<'_, I, U>,
    out: Option<usize>,
    saved: Option<(usize, bool)>,
) -> Result<(f32, usize)> {
    let tau = gradient_temperature(temperature)?;
    crate::error::ensure(vocab > 0, "vocab", "must be > 0")?;
    let rows = logits / vocab;
    rows_of("logits", logits, vocab, rows)?;
    if let Some(n) = out {
        check_len("out", logits, n)?;
    }
    if let Some((n, has_teacher)) = saved {
        check_len("saved", rows, n)?;
        crate::error::ensure(
            terms.kl.is_none() || has_teacher,
            "kl",
            "a KL term needs the teacher's saved state (PairState, from kl_rows_saved)",
        )?;
    }
    if let Some((t, g)) = terms.logp {
        check_len("targets", rows, t.len())?;
        check_len("grad_logp", rows, g.len())?;
    }
    if let Some(g) = terms.entropy {
        check_len("grad_entropy", rows, g.len())?;
    }
    if let Some(k) = &terms.kl {
        rows_of("teacher", k.teacher.len(), vocab, rows)?;
        check_len("grad_kl", rows, k.grad.len())?;
    }
    if let Some((_, g)) = terms.logp {
        weights("grad_logp", g, rows)?;
    }
    if let Some(g) = terms.entropy {
        weights("grad_entropy", g, rows)?;
    }
    if let Some(k) = &terms.kl {
        weights("grad_kl", k.grad, rows)?;
    }
    if let Some((t, _)) = terms.logp {
        check_targets(t, vocab)?;
    }
    Ok((tau, rows))
}

/// The weights `(g_lp, g_H)` of row `r` and its target index (`usize::MAX` without a
/// log-probability term).
pub(super) fn weights_of<I: TokenId, U>(
    terms: &GradTerms<'_, I, U>,
    r: usize,
) -> (f32, f32, usize) {
    let (g_lp, y) = match terms.logp {
        Some((t, g)) => (g[r], t[r].index()),
        None => (0.0, usize::MAX),
    };
    (g_lp, terms.entropy.map_or(0.0, |g| g[r]), y)
}

/// The per-row coefficients of the backward, and the target index (or usize::MAX).
fn coef_of<S: super::Logit, I: TokenId, U: super::Logit>(
    z: &[S],
    vocab: usize,
    r: usize,
    tau: f32,
    terms: &GradTerms<'_, I, U>,
) -> (GradCoef, usize, KlGrad) {
    let (g_lp, g_h, y) = weights_of(terms, r);
    match &terms.kl {
        Some(k) => {
            let st = canon::pair_row(z, row_of(k.teacher, vocab, r), tau);
            let c = GradCoef::from_pair(&st, tau, g_lp, g_h, k.grad[r]);
            (c, y, terms.kl_grad())
        }
        None => (
            GradCoef::from_lse(&canon::lse_row(z, tau), tau, g_lp, g_h),
            y,
            KlGrad::None,
        ),
    }
}

/// [`canon::grad_step`] for every element of the row `z` (teacher row `w` when `kg` has a KL
/// term) into `o`.
pub(super) fn grad_row_into<S: super::Logit, U: super::Logit>(
    z: &[S],
    w: Option<&[U]>,
    c: &GradCoef,
    y: usize,
    kg: KlGrad,
    o: &mut [f32],
) {
    match w {
        Some(w) => {
            for v in 0..z.len() {
                o[v] = canon::grad_step(z[v].to_f32(), w[v].to_f32(), v == y, c, kg);
            }
        }
        None => {
            for v in 0..z.len() {
                o[v] = canon::grad_step(z[v].to_f32(), 0.0, v == y, c, KlGrad::None);
            }
        }
    }
}

/// [`grad_row_into`] over the row itself, each gradient rounded by `S::from_f32`.
pub(super) fn grad_row_over<S: super::Logit, U: super::Logit>(
    z: &mut [S],
    w: Option<&[U]>,
    c: &GradCoef,
    y: usize,
    kg: KlGrad,
) {
    for v in 0..z.len() {
        let wv = w.map_or(0.0, |w| w[v].to_f32());
        z[v] = S::from_f32(canon::grad_step(z[v].to_f32(), wv, v == y, c, kg));
    }
}

/// Fused backward over rows: `out[r, v] = ∂loss_r/∂z[r, v]` for
/// `loss_r = g_lp[r]·logp_r(y_r) + g_H[r]·H_r + g_KL[r]·KL_r` \[ours\].
///
/// Formulas (p = softmax(z/T), q = softmax(w/T)):
/// `∂logp(y)/∂z_v = (1[v=y] − p_v)/T`; `∂H/∂z_v = −p_v (log p_v + H)/T`;
/// `∂KL(p‖q)/∂z_v = p_v (log p_v − log q_v − KL(p‖q))/T`; `∂KL(q‖p)/∂z_v = (p_v − q_v)/T`
/// (gradients with respect to the student logits only; the teacher is a constant). Each row
/// is first reduced (forward statistics), then every element is written by
/// [`canon::grad_step`]. Masked (−∞) logits get gradient 0.
///
/// # Errors
/// As [`logprob_entropy_rows`] and [`kl_rows`] for the terms present, plus
/// `LengthMismatch{what: "out" | "targets" | "grad_logp" | "grad_entropy" | "grad_kl"}`,
/// `NonFinite{what: "grad_*", index: r}` for a non-finite weight, `InvalidParam` for
/// |weight| > [`MAX_GRAD_WEIGHT`] and for `T <` [`MIN_GRAD_TEMPERATURE`]. On `Err`, `out` is untouched.
///
/// ```
/// use grpo_core::vocab::{backward_rows, GradTerms};
/// // one row [0, 0], target 0, ∂loss/∂logp = 1, T = 1: grad = (1 − ½, −½)
/// let mut g = [0.0f32; 2];
/// let terms: GradTerms<'_, u32> =
///     GradTerms { logp: Some((&[0], &[1.0])), entropy: None, kl: None };
/// backward_rows(&[0.0f32, 0.0], 2, 1.0, &terms, &mut g).unwrap();
/// assert!((g[0] - 0.5).abs() < 1e-7 && (g[1] + 0.5).abs() < 1e-7);
/// ```
pub fn backward_rows<S: super::Logit, I: TokenId, U: super::Logit>(
    logits: &[S],
    vocab: usize,
    temperature: f32,
    terms: &GradTerms<'_, I, U>,
    out: &mut [f32],
) -> Result<()> {
    let (tau, rows) = backward(logits, vocab, temperature, terms, Some(out.len()))?;
    for r in 0..rows {
        let z = row_of(logits, vocab, r);
        let (c, y, kg) = coef_of(z, vocab, r, tau, terms);
        let w = terms.kl.as_ref().map(|k| row_of(k.teacher, vocab, r));
        grad_row_into(z, w, &c, y, kg, &mut out[r * vocab..(r + 1) * vocab]);
    }
    Ok(())
}

/// [`backward_rows`] writing the gradient over the logits themselves (rounded to the storage
/// type `S` by `S::from_f32`, ties to even) \[ours\]. Each row's statistics are computed before
/// the row is overwritten, so the result equals the out-of-place one rounded to `S`.
///
/// # Errors
/// As [`backward_rows`]; on `Err` the logits are untouched.
///
/// ```
/// use grpo_core::vocab::{backward_rows_in_place, GradTerms, KlDirection, KlTerm};
/// // entropy of [0, 0] is maximal: its gradient is 0 (∂H/∂z_v = −½(−ln 2 + ln 2) = 0)
/// let mut z = [0.0f32, 0.0];
/// let terms: GradTerms<'_, u32> = GradTerms { logp: None, entropy: Some(&[1.0]), kl: None };
/// backward_rows_in_place(&mut z, 2, 1.0, &terms).unwrap();
/// assert!(z[0].abs() < 1e-7 && z[1].abs() < 1e-7);
/// ```
pub fn backward_rows_in_place<S: super::Logit, I: TokenId, U: super::Logit>(
    logits: &mut [S],
    vocab: usize,
    temperature: f32,
    terms: &GradTerms<'_, I, U>,
) -> Result<()> {
    let (tau, rows) = backward(logits, vocab, temperature, terms, None)?;
    for r in 0..rows {
        let (c, y, kg) = coef_of(row_of(logits, vocab, r), vocab, r, tau, terms);
        let w = terms.kl.as_ref().map(|k| row_of(k.teacher, vocab, r));
        grad_row_over(&mut logits[r * vocab..(r + 1) * vocab], w, &c, y, kg);
    }
    Ok(())
}

/// Gradient of the generalised JSD with respect to the student logits, every row pair:
/// `out[r, v] = g[r]·∂JSD_β,r/∂z[r, v]` \[arXiv 2306.13649; derivation ours\].
///
/// Formula (p = softmax(z/T) the student, q = softmax(w/T) the teacher, m = β q + (1 − β) p,
/// `JSD_β = β KL(q‖m) + (1 − β) KL(p‖m)` as in [`jsd`]): `∂JSD_β/∂p_v = (1 − β)(log p_v −
/// log m_v)` (the terms through m cancel: `Σ_u (β q_u + (1 − β) p_u)/m_u · ∂m_u/∂p_v = 1 − β`),
/// so through the softmax
/// ```text
/// ∂JSD_β/∂z_v = (1 − β) · p_v · (log p_v − log m_v − KL(p‖m)) / T
/// ```
/// It is finite everywhere (a masked student logit gets 0, a masked teacher one
/// `(1 − β)·p_v·(−ln(1 − β) − KL(p‖m))/T`); the teacher is a constant (the gradient is for
/// the student only). Per row: the pair statistics, then `K = KL(p‖m)` as the
/// [`canonical_sum`](canon::canonical_sum) of [`canon::jsd_student_step`] (unclamped), then
/// each element by [`canon::jsd_grad_step`] with `c = (g·(1 − β))·τ` — three passes over the
/// row pair. This is the gradient of TRL's GKD loss (`generalized_jsd_loss`, which reports
/// the same JSD_β) with respect to the student logits.
///
/// # Errors
/// In this order: `InvalidParam{name: "temperature"}` (as [`backward_rows`]: `T ≥`
/// [`MIN_GRAD_TEMPERATURE`]), `InvalidParam{name: "beta"}` unless `0 < β < 1`,
/// `InvalidParam{name: "vocab"}` for `V = 0`, `LengthMismatch{what: "student" | "teacher" |
/// "out" | "grad_jsd"}` (`rows = student.len() / V`), `NonFinite{what: "grad_jsd", index: r}`
/// or `InvalidParam{name: "grad_jsd"}` for a weight that is not finite or above
/// [`MAX_GRAD_WEIGHT`], then per row the checks of [`jsd_rows`] (`NonFinite` for NaN/+∞ at
/// `r·V + v`, `EmptySegment{segment: r}` for an all-−∞ row, `NonFinite{what: "student /
/// temperature" | "teacher / temperature"}` when a row maximum over T overflows). On `Err`,
/// `out` is untouched.
///
/// ```
/// use grpo_core::vocab::{jsd_backward_rows, jsd_rows};
/// // one row pair; the gradient against a central difference of jsd_rows
/// let (z, w) = ([0.5f32, -1.0, 2.0], [1.0f32, 0.0, -0.5]);
/// let mut g = [0.0f32; 3];
/// jsd_backward_rows(&z, &w, 3, 0.5, 1.0, &[1.0], &mut g).unwrap();
/// let jsd_at = |z: [f32; 3]| {
///     let mut o = [0.0f32];
///     jsd_rows(&z, &w, 3, 0.5, 1.0, &mut o).unwrap();
///     o[0]
/// };
/// let h = 1e-2;
/// let fd = (jsd_at([0.5 + h, -1.0, 2.0]) - jsd_at([0.5 - h, -1.0, 2.0])) / (2.0 * h);
/// assert!((g[0] - fd).abs() < 1e-4, "{} vs {fd}", g[0]);
/// // softmax is shift-invariant: the gradient sums to 0
/// assert!((g[0] + g[1] + g[2]).abs() < 1e-6);
/// ```
pub fn jsd_backward_rows<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    vocab: usize,
    beta: f32,
    temperature: f32,
    grad: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let (tau, rows) =
        check_jsd_backward(student, teacher, vocab, beta, temperature, grad, out.len())?;
    for r in 0..rows {
        jsd_grad_row(
            row_of(student, vocab, r),
            row_of(teacher, vocab, r),
            tau,
            beta,
            grad[r],
            &mut out[r * vocab..(r + 1) * vocab],
        );
    }
    Ok(())
}

/// The checks of [`jsd_backward_rows`], in its order; returns `(τ, rows)`.
fn check_jsd_backward<S: super::Logit, U: super::Logit>(
    student: &[S],
    teacher: &[U],
    vocab: usize,
    beta: f32,
    temperature: f32,
    grad: &[f32],
    out: usize,
) -> Result<(f32, usize)> {
    let (tau, rows) = jsd_backward_args(
        student.len(),
        teacher.len(),
        vocab,
        beta,
        temperature,
        grad,
        out,
    )?;
    scan_pairs(student, teacher, vocab, rows, tau, None)?;
    Ok((tau, rows))
}

/// The checks of [`jsd_backward_rows`] that read no logit (its first ones, in its order; the
/// slices by their lengths, the weights themselves): the temperature (with the gradients'
/// minimum), β, `vocab > 0`, the lengths of `student`, `teacher`, `out` and `grad_jsd`, the
/// weights. Returns `(τ, rows)`. Public so that a backend can check its arguments before it
/// reads the rows on a device.
///
/// # Errors
/// As [`jsd_backward_rows`], but no row check.
///
/// ```
/// use grpo_core::vocab::validate::jsd_backward_args;
/// assert_eq!(jsd_backward_args(6, 6, 3, 0.5, 0.5, &[1.0; 2], 6), Ok((2.0, 2)));
/// // β = 1 is a KL divergence, not a JSD
/// assert!(jsd_backward_args(6, 6, 3, 1.0, 0.5, &[1.0; 2], 6).is_err());
/// // one weight per row
/// assert!(jsd_backward_args(6, 6, 3, 0.5, 0.5, &[1.0; 3], 6).is_err());
/// ```
pub fn jsd_backward_args(
    student: usize,
    teacher: usize,
    vocab: usize,
    beta: f32,
    temperature: f32,
    grad: &[f32],
    out: usize,
) -> Result<(f32, usize)> {
    let tau = gradient_temperature(temperature)?;
    beta_of(beta)?;
    crate::error::ensure(vocab > 0, "vocab", "must be > 0")?;
    let rows = student / vocab;
    rows_of("student", student, vocab, rows)?;
    rows_of("teacher", teacher, vocab, rows)?;
    check_len("out", student, out)?;
    check_len("grad_jsd", rows, grad.len())?;
    weights("grad_jsd", grad, rows)?;
    Ok((tau, rows))
}

/// [`jsd_backward_rows`] of one validated row pair into `o`.
fn jsd_grad_row<S: super::Logit, U: super::Logit>(
    z: &[S],
    w: &[U],
    tau: f32,
    beta: f32,
    g: f32,
    o: &mut [f32],
) {
    let (j, k, c) = jsd_grad_coefs(z, w, tau, beta, g);
    for (v, o) in o.iter_mut().enumerate() {
        *o = canon::jsd_grad_step(z[v].to_f32(), w[v].to_f32(), &j, k, c);
    }
}

/// The per-row constants of the JSD's gradient: the row's [`canon::JsdParams`], `K =
/// KL(p‖m)` (unclamped) and `c = (g·(1 − β))·τ`.
fn jsd_grad_coefs<S: super::Logit, U: super::Logit>(
    z: &[S],
    w: &[U],
    tau: f32,
    beta: f32,
    g: f32,
) -> (canon::JsdParams, f32, f32) {
    let j = canon::JsdParams::of(&canon::pair_row(z, w, tau), tau, beta);
    JsdState::of(&j, jsd_kl_pm(z, w, &j)).grad_params(tau, g)
}

/// [`jsd_backward_rows`] writing the gradient over the student logits themselves, rounded to
/// their storage type `S` by `S::from_f32` (ties to even) \[ours\]. Each row's constants
/// (its statistics and `KL(p‖m)`) are computed before the row is overwritten, and every
/// element's gradient needs only its own logit, so the result equals the out-of-place one
/// rounded to `S`.
///
/// # Errors
/// As [`jsd_backward_rows`] (without `out`); on `Err` the logits are untouched.
///
/// ```
/// use grpo_core::vocab::{jsd_backward_rows, jsd_backward_rows_in_place};
/// let (z, w) = ([0.5f32, -1.0, 2.0], [1.0f32, 0.0, -0.5]);
/// let mut g = [0.0f32; 3];
/// jsd_backward_rows(&z, &w, 3, 0.5, 1.0, &[1.0], &mut g).unwrap();
/// let mut zb = z.map(half::bf16::from_f32);
/// jsd_backward_rows_in_place(&mut zb, &w, 3, 0.5, 1.0, &[1.0]).unwrap();
/// assert_eq!(zb, g.map(half::bf16::from_f32));
/// ```
pub fn jsd_backward_rows_in_place<S: super::Logit, U: super::Logit>(
    student: &mut [S],
    teacher: &[U],
    vocab: usize,
    beta: f32,
    temperature: f32,
    grad: &[f32],
) -> Result<()> {
    let n = student.len();
    let (tau, rows) = check_jsd_backward(student, teacher, vocab, beta, temperature, grad, n)?;
    for r in 0..rows {
        let span = r * vocab..(r + 1) * vocab;
        let w = &teacher[span.clone()];
        let (j, k, c) = jsd_grad_coefs(&student[span.clone()], w, tau, beta, grad[r]);
        for (z, w) in student[span].iter_mut().zip(w) {
            *z = S::from_f32(canon::jsd_grad_step(z.to_f32(), w.to_f32(), &j, k, c));
        }
    }
    Ok(())
}
