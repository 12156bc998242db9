//! [`VocabKernel`]: log-sum-exp, token log-probability, entropy, KL and JSD_β between rows and
//! the fused backward over logit rows (MATH.md §5) — recomputing the row statistics, or from the
//! states a forward saved — for f32, f16 and bf16 storage with f32 accumulation.

use bytemuck::{Pod, Zeroable};
use grpo_core::Error;
use grpo_core::vocab::canon::LogSoftmax;
use grpo_core::vocab::{GradTerms, JsdState, KlDirection, KlTerm, LseState, PairState, SavedState};

use crate::context::{Arg, GpuContext, Readback, Resident, Uploaded};
use crate::error::{GpuError, Result, check_len, ensure};
use crate::shaders::{LogitDtype, ShaderId};

/// A logit storage type the shaders read: `f32`, `half::f16`, `half::bf16`.
pub trait LogitStorage: Pod + grpo_core::vocab::Logit + sealed::Sealed {
    /// Which shader prelude reads it.
    const DTYPE: LogitDtype;
    /// Exact widening to f32 (what the shaders do).
    fn widen(self) -> f32;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

impl LogitStorage for f32 {
    const DTYPE: LogitDtype = LogitDtype::F32;
    fn widen(self) -> f32 {
        self
    }
}
impl LogitStorage for half::f16 {
    const DTYPE: LogitDtype = LogitDtype::F16;
    fn widen(self) -> f32 {
        self.to_f32()
    }
}
impl LogitStorage for half::bf16 {
    const DTYPE: LogitDtype = LogitDtype::Bf16;
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct VocabParams {
    rows: u32,
    vocab: u32,
    base: u32,
    inv_temp: f32,
    /// JSD_β only (zero elsewhere): β, 1 − β, −ln β, −ln(1 − β).
    beta: f32,
    one_minus_beta: f32,
    neg_ln_beta: f32,
    neg_ln_one_minus_beta: f32,
}

// `VocabParams` in shaders/vocab.wgsl: eight 4-byte scalars, no padding (the WGSL struct has the
// same fields in the same order; tests/tests/wgpu_shaders.rs checks its size there).
const _: () = assert!(size_of::<VocabParams>() == 32);

impl VocabParams {
    /// Parameters of every entry point (the JSD's add [`VocabParams::with_beta`]).
    fn new(rows: usize, vocab: usize, base: u32, inv_temp: f32) -> Self {
        VocabParams {
            rows: rows as u32,
            vocab: vocab as u32,
            base,
            inv_temp,
            ..Zeroable::zeroed()
        }
    }

    /// With the JSD entry points' β fields: β and 1 − β as grpo-core rounds them, and −ln β,
    /// −ln(1 − β) from the host (the other entry points ignore them).
    fn with_beta(self, beta: f32) -> Self {
        let omb = 1.0 - beta;
        VocabParams {
            beta,
            one_minus_beta: omb,
            neg_ln_beta: -beta.ln(),
            neg_ln_one_minus_beta: -omb.ln(),
            ..self
        }
    }
}

/// What [`VocabKernel::resident`] runs (a benchmark hook).
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub enum ResidentVocab<'a, L> {
    /// The fused forward: lse, log-prob and entropy.
    Forward,
    /// The fused backward: f32 gradient out, upstream gradients 1 (log-prob) and 0.5 (entropy).
    Backward,
    /// KL(p‖q) of every row pair, the student being the logits.
    Kl {
        /// The teacher rows (as many as the logits).
        teacher: &'a [L],
    },
    /// [`VocabKernel::backward_saved`] from softmax states (computed by grpo-core when the
    /// work is built): upstream gradients 1 (log-prob) and 0.5 (entropy).
    BackwardSaved,
    /// [`VocabKernel::backward_saved_in_place`] of `BackwardSaved`: the gradient in the
    /// logits' storage type, to binding 8.
    BackwardSavedInPlace,
    /// [`VocabKernel::backward_saved`] from pair states with a KL(p‖q) (student‖teacher) term (weight 1)
    /// besides the log-prob and entropy terms of `BackwardSaved`.
    BackwardKlSaved {
        /// The teacher rows (as many as the logits).
        teacher: &'a [L],
    },
    /// [`VocabKernel::jsd_backward`] with β = ½ and weight ½ per row.
    JsdBackward {
        /// The teacher rows (as many as the logits).
        teacher: &'a [L],
    },
    /// [`VocabKernel::jsd_backward_saved`] of `JsdBackward`, from grpo-core's states of these
    /// rows (computed when the work is built).
    JsdBackwardSaved {
        /// The teacher rows (as many as the logits).
        teacher: &'a [L],
    },
}

/// What [`VocabKernel::dispatch_rows`] runs: an entry point over `logits` (`vocab` per row)
/// with one target per row (`checked`: the targets the status check validates, if any).
struct RowDispatch<'a, L> {
    entry: &'static str,
    logits: &'a [L],
    targets: &'a [u32],
    checked: Option<&'a [u32]>,
    vocab: usize,
    tau: f32,
}

const FLAG_EMPTY_ROW: u32 = 1;
const FLAG_TARGET_NON_FINITE: u32 = 2;
const FLAG_KL_INFINITE: u32 = 4;
const FLAG_TEACHER_EMPTY: u32 = 8;
const FLAG_SCALE_OVERFLOW: u32 = 16;
const FLAG_KL_TEACHER_STUDENT_INFINITE: u32 = 32;
const NO_INDEX: u32 = u32::MAX;
/// Floats per row of `backward_saved`'s coefficients (`SAVED_COEF` in shaders/vocab.wgsl).
const SAVED_COEF: usize = 12;

/// Per-row results of the fused forward pass; each output is optional (`None` skips it; the
/// pass costs the same). Every present slice has one element per row.
#[derive(Debug, Default)]
pub struct ForwardOut<'a> {
    /// `lse = log Σ_v exp(z_v/T)`.
    pub lse: Option<&'a mut [f32]>,
    /// `logp(y) = z_y/T − lse` (a −∞ target logit is `NonFinite { what: "logits[target]" }`).
    pub logp: Option<&'a mut [f32]>,
    /// `H = lse − Σ_v p_v z_v/T`.
    pub entropy: Option<&'a mut [f32]>,
}

/// The vocabulary kernels (`shaders/vocab.wgsl`) on one [`GpuContext`].
///
/// Semantics are grpo-core's (MATH.md §5): rows of length `vocab` laid out row-major; `−∞`
/// logits are masked entries and contribute nothing; NaN or `+∞` logits are an error
/// ([`Error::NonFinite`] with the flat index of the first one, as a sequential scan finds it);
/// a row with no finite logit is [`Error::EmptySegment`]; a target `≥ vocab` is
/// [`Error::TokenOutOfRange`]; `temperature` must be finite and `> 0`. Accuracy: within the
/// contract of MATH.md §5 against an f64 reference (see the tolerance table of the test suite).
#[derive(Debug, Clone, Copy)]
pub struct VocabKernel<'c> {
    ctx: &'c GpuContext,
}

/// What a row-pair dispatch ([`VocabKernel::pair_rows`]) writes to binding 6 besides its
/// stats and status words.
#[derive(Clone, Copy)]
enum PairOut<'a> {
    /// Nothing.
    Stats,
    /// This many floats per row (the saved pair states).
    Saved(usize),
    /// Each row's gradient (`vocab` floats), from the rows' weights (one per row of the batch),
    /// bound at 7.
    Grad(&'a [f32]),
}

/// What a pass of a backward from saved states ([`VocabKernel::saved_pass`]) runs: the entry
/// point, each row's coefficients (the shader's `SAVED_COEF` floats per row) and target
/// (`NO_INDEX` without a log-probability term), and whether it writes over the logits.
struct SavedPass<'a> {
    entry: &'static str,
    coef: &'a [f32],
    targets: &'a [u32],
    in_place: bool,
}

/// Floats per row of the saved JSD state the `jsd_saved` entry point writes (the shader's
/// `JSD_STATE`): both rows' raw maxima and `−ln Σ`, and `K = KL(p‖m)`.
const JSD_STATE: usize = 5;

/// The status flags of the JSD entry points that send a row to grpo-core's checks on the host.
const JSD_FLAGGED: u32 = FLAG_EMPTY_ROW | FLAG_TEACHER_EMPTY | FLAG_SCALE_OVERFLOW;

struct RowChunk {
    first: usize,
    rows: usize,
}

/// How an operation waits for its readbacks: the blocking methods wait on the device
/// ([`Readback::wait`]: `device.poll` until the submission is done, then at most a brief yield
/// loop until its map callbacks have run); their `_async`
/// twins await the [`Readback`] future, which any executor can drive. Everything else — the
/// validation, the dispatches, the host checks and what is written — is the same code, so the
/// two give the same bits and the same errors.
#[derive(Debug, Clone, Copy)]
enum Wait {
    Block,
    Await,
}

impl Wait {
    async fn readback(self, rb: Readback<'_>) -> Result<Vec<Vec<u8>>> {
        match self {
            Wait::Block => rb.wait(),
            Wait::Await => rb.await,
        }
    }
}

/// The inputs an operation uploaded once for several submissions ([`Uploaded`]): where a
/// dispatch would upload the very same host bytes, it binds the uploaded buffer instead. Empty
/// ([`Kept::NONE`]) for the public operations, which upload what each submission reads.
#[derive(Clone, Copy)]
struct Kept<'a>(&'a [Uploaded<'a>]);

impl<'a> Kept<'a> {
    const NONE: Kept<'static> = Kept(&[]);

    /// The argument that gives a dispatch `bytes`: their upload if this holds it, else the
    /// bytes themselves.
    fn arg<'b>(self, bytes: &'b [u8]) -> Arg<'b>
    where
        'a: 'b,
    {
        match self.0.iter().find(|u| u.holds(bytes)) {
            Some(u) => Arg::Uploaded(u),
            None => Arg::In(bytes),
        }
    }
}

impl<'c> VocabKernel<'c> {
    /// The kernels on `ctx` (pipelines are compiled on first use and cached in `ctx`).
    pub fn new(ctx: &'c GpuContext) -> Self {
        VocabKernel { ctx }
    }

    /// grpo-core's `check_rows` order: temperature (grpo-core's own `inverse_temperature`, which
    /// also gives τ = 1/T), `vocab > 0`, then the logits' length; then this backend's limits.
    fn validate<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        rows: usize,
        temperature: f32,
    ) -> Result<f32> {
        let tau = grpo_core::vocab::validate::inverse_temperature(temperature)?;
        Self::check_shape("logits", logits.len(), vocab, rows)?;
        self.check_limits::<L>(vocab)?;
        Ok(tau)
    }

    /// grpo-core's `rows_of`: `vocab > 0`, `rows · vocab` representable, then the length of the
    /// slice named `what`.
    fn check_shape(what: &'static str, len: usize, vocab: usize, rows: usize) -> Result<()> {
        ensure(vocab > 0, "vocab", "must be > 0")?;
        let expected = rows.checked_mul(vocab).ok_or(Error::InvalidParam {
            name: "vocab",
            reason: "rows · vocab overflows usize",
        })?;
        check_len(what, expected, len)
    }

    /// This backend's own limits (after grpo-core's checks): row length and the f16 feature.
    fn check_limits<L: LogitStorage>(&self, vocab: usize) -> Result<()> {
        if vocab > u32::MAX as usize / 2 {
            return Err(GpuError::TooLarge {
                what: "vocab",
                bytes: (vocab * L::DTYPE.size()) as u64,
                limit: u32::MAX as u64 / 2,
            });
        }
        if L::DTYPE == LogitDtype::F16 && !self.ctx.supports_f16() {
            return Err(GpuError::MissingFeature {
                feature: "SHADER_F16",
            });
        }
        Ok(())
    }

    /// Splits the rows so each chunk's logits (and gradient, `bytes_per_out_elem` per logit)
    /// fit one binding and one dispatch dimension.
    fn chunks(
        &self,
        rows: usize,
        vocab: usize,
        elem: usize,
        out_elem: usize,
    ) -> Result<Vec<RowChunk>> {
        let limit = self.ctx.max_binding();
        // +4: a bf16 chunk starting mid-word uploads one extra element.
        let row_bytes = (vocab * elem.max(out_elem)) as u64 + 4;
        if row_bytes > limit {
            return Err(GpuError::TooLarge {
                what: "logits row",
                bytes: row_bytes,
                limit,
            });
        }
        let per = ((limit - 4) / row_bytes.max(1))
            .min(self.ctx.max_groups() as u64)
            .min((u32::MAX / 4) as u64)
            .max(1) as usize;
        let mut out = Vec::new();
        let mut first = 0;
        while first < rows {
            let n = per.min(rows - first);
            out.push(RowChunk { first, rows: n });
            first += n;
        }
        Ok(out)
    }

    fn check_targets(targets: &[u32], vocab: usize) -> Result<()> {
        for (index, &t) in targets.iter().enumerate() {
            if t as usize >= vocab {
                return Err(Error::TokenOutOfRange {
                    index,
                    token: t as usize,
                    vocab,
                }
                .into());
            }
        }
        Ok(())
    }

    /// Turns the per-row status words into grpo-core's error, in grpo-core's order: row by row,
    /// first NaN/+∞ (`NonFinite{"logits"}`), then for a row the shader found empty or
    /// overflowing, grpo-core's own row check on the host (`EmptySegment`, or
    /// `NonFinite{"logits / temperature"}` at the first maximum), then, when `targets` is given,
    /// a target whose shift `(z_y − max z)/T` is not finite — a −∞ target logit, or one so far
    /// below the maximum that the shift overflows (`NonFinite{"logits[target]"}`, grpo-core's
    /// `validate::target`).
    fn check_status<L: LogitStorage>(
        status: &[u32],
        first_row: usize,
        vocab: usize,
        tau: f32,
        logits: &[L],
        targets: Option<&[u32]>,
    ) -> Result<()> {
        for (r, w) in status.chunks_exact(4).enumerate() {
            let row = first_row + r;
            if w[0] != NO_INDEX {
                return Err(Error::NonFinite {
                    what: "logits",
                    index: row * vocab + w[0] as usize,
                }
                .into());
            }
            if w[1] & FLAG_EMPTY_ROW != 0 || w[2] != NO_INDEX {
                // No usable logit, or z/T overflows: grpo-core's row check on the host names
                // it exactly (a maximum whose z/T overflows to −∞ leaves the shader with an
                // empty row, but grpo-core reports the overflow).
                let wide: Vec<f32> = logits[row * vocab..(row + 1) * vocab]
                    .iter()
                    .map(|z| z.widen())
                    .collect();
                grpo_core::vocab::validate::row(&wide, "logits", row * vocab, row, tau)?;
                return Err(Error::EmptySegment { segment: row }.into());
            }
            if let Some(t) = targets
                && w[1] & FLAG_TARGET_NON_FINITE != 0
            {
                return Err(Error::NonFinite {
                    what: "logits[target]",
                    index: row * vocab + t[row] as usize,
                }
                .into());
            }
        }
        Ok(())
    }

    fn upload<'a, L: LogitStorage>(logits: &'a [L], c: &RowChunk, vocab: usize) -> (&'a [u8], u32) {
        let start = c.first * vocab;
        let end = start + c.rows * vocab;
        // bf16 is read as u32 words: start the upload on an even element.
        let (lo, base) = if L::DTYPE == LogitDtype::F32 {
            (start, 0)
        } else {
            (start & !1, (start & 1) as u32)
        };
        (bytemuck::cast_slice(&logits[lo..end]), base)
    }

    /// Benchmark hook: `what` over `rows × vocab` logits uploaded once (T = 1), as one dispatch
    /// over every row; each [`Resident::run`] times only the kernel (no upload, no readback, no
    /// status check). Targets are 0.
    ///
    /// ```
    /// use grpo_wgpu::{GpuContext, ResidentVocab, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // Row [0, ln 3], target 0, T = 1: lse = ln 4, logp(0) = ln ¼,
    /// // H = −(¼ ln ¼ + ¾ ln ¾) = 0.5623351.
    /// let mut z = [0.0f32, 3f32.ln()];
    /// let work = VocabKernel::new(&ctx).resident(&z, 2, ResidentVocab::Forward)?;
    /// // Uploaded once: the runs a benchmark times do not see the host's logits change.
    /// z[1] = 0.0;
    /// work.run()?;
    /// work.run()?;
    /// // Binding 2 holds (lse, logp, H, 0) per row.
    /// let s: Vec<f32> = work.read(2)?.chunks_exact(4)
    ///     .map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    /// assert!((s[0] - 4f32.ln()).abs() < 2e-6 && (s[1] - 0.25f32.ln()).abs() < 2e-6);
    /// assert!((s[2] - 0.5623351).abs() < 2e-6 && s[3] == 0.0);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::forward`] (and [`VocabKernel::kl`] for a teacher of another length);
    /// [`GpuError::TooLarge`] when the logits or the gradient do not fit one binding,
    /// [`GpuError::TooManyWorkgroups`] when the rows (one workgroup each) do not fit one
    /// dispatch dimension (the benchmark runs one chunk).
    #[doc(hidden)]
    pub fn resident<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        what: ResidentVocab<'_, L>,
    ) -> Result<Resident<'c>> {
        let rows = logits.len() / vocab.max(1);
        match what {
            ResidentVocab::Kl { teacher }
            | ResidentVocab::BackwardKlSaved { teacher }
            | ResidentVocab::JsdBackward { teacher }
            | ResidentVocab::JsdBackwardSaved { teacher } => {
                self.validate_pair(logits, teacher, vocab, rows, 1.0, None)?
            }
            _ => self.validate(logits, vocab, rows, 1.0)?,
        };
        let per_dimension = self.ctx.max_groups();
        if rows > per_dimension as usize {
            return Err(GpuError::TooManyWorkgroups {
                needed: rows as u64,
                limit: u64::from(per_dimension),
                per_dimension,
            });
        }
        let targets = vec![0u32; rows];
        // β = ½ for `JsdBackward`; the other entry points ignore it.
        let params = VocabParams::new(rows, vocab, 0, 1.0).with_beta(0.5);
        let (ones, halves) = (vec![1.0f32; rows], vec![0.5f32; rows]);
        let terms = GradTerms {
            logp: Some((&targets[..], &ones[..])),
            entropy: Some(&halves[..]),
            kl: None,
        };
        // Binding 7: `backward`'s (g_lp, g_H) per row, or the saved backwards' coefficients
        // (from grpo-core's states of these rows) with their entry point.
        let (upstream, saved_entry) = match what {
            ResidentVocab::BackwardSaved | ResidentVocab::BackwardSavedInPlace => {
                let (mut lp, mut saved) = (vec![0f32; rows], vec![LseState::EMPTY; rows]);
                grpo_core::vocab::logprob_entropy_rows_saved(
                    logits, vocab, &targets, 1.0, &mut lp, None, &mut saved,
                )?;
                let in_place = matches!(what, ResidentVocab::BackwardSavedInPlace);
                let (coef, _, entry) = Self::saved_coefs(&saved, 1.0, &terms, in_place);
                (coef, entry)
            }
            ResidentVocab::BackwardKlSaved { teacher } => {
                let (mut kl, mut saved) = (vec![0f32; rows], vec![PairState::EMPTY; rows]);
                let pq = KlDirection::StudentTeacher;
                grpo_core::vocab::kl_rows_saved(
                    logits, teacher, vocab, 1.0, pq, &mut kl, &mut saved,
                )?;
                let kl_term = KlTerm {
                    teacher,
                    grad: &ones,
                    direction: pq,
                };
                let terms = GradTerms {
                    kl: Some(kl_term),
                    ..terms
                };
                let (coef, _, entry) = Self::saved_coefs(&saved, 1.0, &terms, false);
                (coef, entry)
            }
            ResidentVocab::JsdBackwardSaved { teacher } => {
                let (mut jsd, mut saved) = (vec![0f32; rows], vec![JsdState::EMPTY; rows]);
                grpo_core::vocab::jsd_rows_saved(
                    logits, teacher, vocab, 0.5, 1.0, &mut jsd, &mut saved,
                )?;
                (
                    Self::jsd_saved_coefs(&saved, &halves, 1.0),
                    "jsd_backward_saved",
                )
            }
            _ => ((0..rows).flat_map(|_| [1.0f32, 0.5]).collect(), ""),
        };
        let mut args = vec![
            (0, Arg::In(bytemuck::cast_slice(logits))),
            (1, Arg::In(bytemuck::cast_slice(&targets))),
            (2, Arg::Out((rows * 16) as u64)),
            (3, Arg::Out((rows * 16) as u64)),
            (4, Arg::Uniform(bytemuck::bytes_of(&params))),
        ];
        let entry = match what {
            ResidentVocab::Forward => "forward",
            ResidentVocab::Backward => {
                args.push((6, Arg::Out((rows * vocab * 4) as u64)));
                args.push((7, Arg::In(bytemuck::cast_slice(&upstream))));
                "backward"
            }
            ResidentVocab::Kl { teacher } => {
                // As `kl`: the teacher in binding 5 (the targets binding stays, unused).
                args.push((5, Arg::In(bytemuck::cast_slice(teacher))));
                "kl"
            }
            ResidentVocab::BackwardSaved
            | ResidentVocab::BackwardKlSaved { .. }
            | ResidentVocab::JsdBackwardSaved { .. } => {
                // As `backward_saved`: the coefficients in binding 7 (stats and status stay,
                // unused).
                args.push((6, Arg::Out((rows * vocab * 4) as u64)));
                args.push((7, Arg::In(bytemuck::cast_slice(&upstream))));
                if let ResidentVocab::BackwardKlSaved { teacher }
                | ResidentVocab::JsdBackwardSaved { teacher } = what
                {
                    args.push((5, Arg::In(bytemuck::cast_slice(teacher))));
                }
                saved_entry
            }
            ResidentVocab::BackwardSavedInPlace => {
                // As `backward_saved_in_place`: the gradient in the storage type, binding 8.
                let bytes = (rows * vocab * L::DTYPE.size()).next_multiple_of(4);
                args.push((8, Arg::Out(bytes as u64)));
                args.push((7, Arg::In(bytemuck::cast_slice(&upstream))));
                saved_entry
            }
            ResidentVocab::JsdBackward { teacher } => {
                // As `jsd_backward`: the teacher in binding 5, the gradient out of 6, the
                // rows' weights in 7.
                args.push((5, Arg::In(bytemuck::cast_slice(teacher))));
                args.push((6, Arg::Out((rows * vocab * 4) as u64)));
                args.push((7, Arg::In(bytemuck::cast_slice(&halves))));
                "jsd_backward"
            }
        };
        self.ctx.resident(
            ShaderId::Vocab(L::DTYPE),
            &args,
            &[(entry, [rows as u32, 1, 1])],
        )
    }

    /// Fused forward: lse, logp(target) and entropy of every row in one pass.
    ///
    /// `targets` has one token id per row (ignored, and may be empty, when `out.logp` is
    /// `None`). The number of rows is the length of the present outputs (they must agree).
    ///
    /// ```
    /// use grpo_core::Error;
    /// use grpo_wgpu::{ForwardOut, GpuContext, GpuError, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // T = 2. Row [0, ln 9] is z/T = [0, ln 3], p = [¼, ¾]: lse = ln 4, logp(1) = ln ¾,
    /// // H = −(¼ ln ¼ + ¾ ln ¾) = 0.5623351. Row [2, 2] is [1, 1]: lse = 1 + ln 2,
    /// // logp(0) = −ln 2, H = ln 2.
    /// let z = [0.0f32, 9f32.ln(), 2.0, 2.0];
    /// let (mut lse, mut lp, mut h) = ([0.0f32; 2], [0.0f32; 2], [0.0f32; 2]);
    /// let out = ForwardOut { lse: Some(&mut lse), logp: Some(&mut lp), entropy: Some(&mut h) };
    /// let k = VocabKernel::new(&ctx);
    /// k.forward(&z, 2, &[1, 0], 2.0, out)?;
    /// let close = |a: [f32; 2], b: [f32; 2]| a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 2e-6);
    /// assert!(close(lse, [4f32.ln(), 1.0 + 2f32.ln()]) && close(lp, [0.75f32.ln(), -2f32.ln()]));
    /// assert!(close(h, [0.5623351, 2f32.ln()]));
    /// // A −∞ target logit has no log-probability: grpo-core's error, `lp` untouched.
    /// let (z, before) = ([0.0f32, f32::NEG_INFINITY, 2.0, 2.0], lp);
    /// let out = ForwardOut { logp: Some(&mut lp), ..Default::default() };
    /// let e = k.forward(&z, 2, &[1, 0], 2.0, out);
    /// assert_eq!(e, Err(GpuError::Core(Error::NonFinite { what: "logits[target]", index: 1 })));
    /// assert_eq!(lp, before);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// See [`VocabKernel`]; plus [`GpuError::MissingFeature`] for f16 without `SHADER_F16`.
    pub fn forward<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        targets: &[u32],
        temperature: f32,
        out: ForwardOut<'_>,
    ) -> Result<()> {
        let f = self.forward_with(
            logits,
            vocab,
            targets,
            temperature,
            out,
            None,
            Wait::Block,
            Kept::NONE,
        );
        pollster::block_on(f)
    }

    /// Async [`VocabKernel::forward`]: awaits the readback instead of blocking (same results,
    /// same errors; outputs untouched on `Err`).
    ///
    /// ```
    /// use grpo_wgpu::{ForwardOut, GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // Row [0, ln 3]: lse = ln 4, logp(1) = ln ¾, H = 0.5623351.
    /// let (mut lse, mut lp, mut h) = ([0.0f32], [0.0f32], [0.0f32]);
    /// let out = ForwardOut { lse: Some(&mut lse), logp: Some(&mut lp), entropy: Some(&mut h) };
    /// let (k, z) = (VocabKernel::new(&ctx), [0.0f32, 3f32.ln()]);
    /// let fut = k.forward_async(&z, 2, &[1], 1.0, out);
    /// // Any executor drives the future; pollster blocks on it here.
    /// pollster::block_on(fut)?;
    /// assert!((lse[0] - 4f32.ln()).abs() < 2e-6 && (lp[0] - 0.75f32.ln()).abs() < 2e-6);
    /// assert!((h[0] - 0.5623351).abs() < 2e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::forward`].
    pub async fn forward_async<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        targets: &[u32],
        temperature: f32,
        out: ForwardOut<'_>,
    ) -> Result<()> {
        self.forward_with(
            logits,
            vocab,
            targets,
            temperature,
            out,
            None,
            Wait::Await,
            Kept::NONE,
        )
        .await
    }

    /// [`VocabKernel::forward`] that also saves each row's softmax state for
    /// [`VocabKernel::backward_saved`], grpo-core's
    /// [`logprob_entropy_rows_saved`](grpo_core::vocab::logprob_entropy_rows_saved) on the GPU
    /// \[ours\]: the same pass over the logits, which writes `saved[r]` as well.
    ///
    /// The state is grpo-core's [`LseState`]: the reference is the row's largest logit `m`,
    /// `sum = Σ_v e^{(z_v − m)/T}` and `dot = Σ_v e^{(z_v − m)/T}·(z_v − m)/T`, summed by the
    /// shader (within the tolerance of the forward outputs, not grpo-core's bits). Any backend's
    /// backward takes it: grpo-core's and grpo-cpu's `backward_rows_saved` as well as this
    /// one. The number of rows is `saved.len()` (the present outputs must agree).
    ///
    /// ```
    /// use grpo_core::vocab::{GradTerms, LseState};
    /// use grpo_wgpu::{ForwardOut, GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = VocabKernel::new(&ctx);
    /// // Row [0, ln 3]: logp(1) = ln ¾; the state: max = ln 3, sum = 1 + ⅓.
    /// let z = [0.0f32, 3f32.ln()];
    /// let (mut lp, mut saved) = ([0.0f32], [LseState::EMPTY]);
    /// let out = ForwardOut { logp: Some(&mut lp), ..Default::default() };
    /// k.forward_saved(&z, 2, &[1], 1.0, out, &mut saved)?;
    /// assert!((lp[0] - 0.75f32.ln()).abs() < 2e-6);
    /// assert!(saved[0].max == 3f32.ln() && (saved[0].sum - 4.0 / 3.0).abs() < 1e-6);
    /// // The backward from the saved state: ∂logp(1)/∂z = 1[v = 1] − p = (−¼, ¼).
    /// let terms: GradTerms<'_, u32, f32> =
    ///     GradTerms { logp: Some((&[1], &[1.0])), entropy: None, kl: None };
    /// let mut grad = [0.0f32; 2];
    /// k.backward_saved(&z, 2, 1.0, &saved, &terms, &mut grad)?;
    /// assert!((grad[0] + 0.25).abs() < 1e-6 && (grad[1] - 0.25).abs() < 1e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::forward`], plus `LengthMismatch { what: "saved_out" }` (after the
    /// other outputs' lengths, as grpo-core). On `Err` nothing is written.
    pub fn forward_saved<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        targets: &[u32],
        temperature: f32,
        out: ForwardOut<'_>,
        saved: &mut [LseState],
    ) -> Result<()> {
        let saved = Some(saved);
        let f = self.forward_with(
            logits,
            vocab,
            targets,
            temperature,
            out,
            saved,
            Wait::Block,
            Kept::NONE,
        );
        pollster::block_on(f)
    }

    /// Async [`VocabKernel::forward_saved`]: awaits the readback instead of blocking (same
    /// results, same errors; nothing written on `Err`).
    ///
    /// # Errors
    /// As [`VocabKernel::forward_saved`].
    pub async fn forward_saved_async<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        targets: &[u32],
        temperature: f32,
        out: ForwardOut<'_>,
        saved: &mut [LseState],
    ) -> Result<()> {
        let saved = Some(saved);
        self.forward_with(
            logits,
            vocab,
            targets,
            temperature,
            out,
            saved,
            Wait::Await,
            Kept::NONE,
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn forward_with<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        targets: &[u32],
        temperature: f32,
        out: ForwardOut<'_>,
        saved: Option<&mut [LseState]>,
        wait: Wait,
        kept: Kept<'_>,
    ) -> Result<()> {
        let ForwardOut { lse, logp, entropy } = out;
        let rows = [lse.as_deref(), logp.as_deref(), entropy.as_deref()]
            .iter()
            .flatten()
            .map(|s| s.len())
            .next()
            .or(saved.as_deref().map(<[LseState]>::len))
            .unwrap_or(0);
        if let Some(s) = &lse {
            check_len("lse", rows, s.len())?;
        }
        if let Some(s) = &logp {
            check_len("logp", rows, s.len())?;
        }
        if let Some(s) = &entropy {
            check_len("entropy", rows, s.len())?;
        }
        if let Some(s) = &saved {
            check_len("saved_out", rows, s.len())?;
        }
        let tau = self.validate(logits, vocab, rows, temperature)?;
        let zeros;
        let targets = if logp.is_some() {
            check_len("targets", rows, targets.len())?;
            Self::check_targets(targets, vocab)?;
            targets
        } else {
            zeros = vec![0u32; rows];
            &zeros[..]
        };
        let mut stats = vec![0f32; rows * 4];
        // `forward_saved` also writes each row's state (4 floats) to binding 6.
        let mut states = vec![0f32; if saved.is_some() { rows * 4 } else { 0 }];
        let dispatch = RowDispatch {
            entry: if saved.is_some() {
                "forward_saved"
            } else {
                "forward"
            },
            logits,
            targets,
            checked: logp.is_some().then_some(targets),
            vocab,
            tau,
        };
        for c in self.chunks(rows, vocab, L::DTYPE.size(), 0)? {
            let extra = [(6, Arg::Out((c.rows * 16) as u64))];
            let extra = if saved.is_some() { &extra[..] } else { &[] };
            let res = self.dispatch_rows(&dispatch, &c, extra, wait, kept).await?;
            let st: &[f32] = bytemuck::cast_slice(&res[0]);
            stats[c.first * 4..(c.first + c.rows) * 4].copy_from_slice(&st[..c.rows * 4]);
            if saved.is_some() {
                let sv: &[f32] = bytemuck::cast_slice(&res[2]);
                states[c.first * 4..(c.first + c.rows) * 4].copy_from_slice(&sv[..c.rows * 4]);
            }
        }
        // Everything validated: now write the caller's buffers.
        for (k, dst) in [lse, logp, entropy].into_iter().enumerate() {
            if let Some(dst) = dst {
                for (r, d) in dst.iter_mut().enumerate() {
                    *d = stats[r * 4 + k];
                }
            }
        }
        if let Some(saved) = saved {
            for (d, st) in saved.iter_mut().zip(states.chunks_exact(4)) {
                *d = LseState {
                    max: st[0],
                    sum: st[1],
                    dot: st[2],
                };
            }
        }
        Ok(())
    }

    /// `lse[r] = log Σ_v exp(z[r, v]/T)`.
    ///
    /// ```
    /// use grpo_core::Error;
    /// use grpo_wgpu::{GpuContext, GpuError, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // T = ½: row [0, ln 3] is z/T = [0, ln 9], lse = ln(1 + 9) = ln 10;
    /// // row [2, 2] is [4, 4], lse = 4 + ln 2.
    /// let z = [0.0f32, 3f32.ln(), 2.0, 2.0];
    /// let (k, mut lse) = (VocabKernel::new(&ctx), [0.0f32; 2]);
    /// k.log_sum_exp(&z, 2, 0.5, &mut lse)?;
    /// assert!((lse[0] - 10f32.ln()).abs() < 2e-6 && (lse[1] - (4.0 + 2f32.ln())).abs() < 2e-6);
    /// // T ≤ 0 is grpo-core's error; `lse` is untouched.
    /// let before = lse;
    /// let e = k.log_sum_exp(&z, 2, 0.0, &mut lse);
    /// assert!(matches!(e, Err(GpuError::Core(Error::InvalidParam { name: "temperature", .. }))));
    /// assert_eq!(lse, before);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::forward`].
    pub fn log_sum_exp<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        temperature: f32,
        lse: &mut [f32],
    ) -> Result<()> {
        let out = ForwardOut {
            lse: Some(lse),
            ..Default::default()
        };
        self.forward(logits, vocab, &[], temperature, out)
    }

    /// `logp[r] = z[r, y_r]/T − lse[r]`.
    ///
    /// ```
    /// use grpo_core::Error;
    /// use grpo_wgpu::{GpuContext, GpuError, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // T = 1; −∞ is a masked entry. Row [0, ln 3, −∞]: p = [¼, ¾, 0], logp(1) = ln ¾;
    /// // row [1, 1, 1]: logp(2) = −ln 3.
    /// let z = [0.0f32, 3f32.ln(), f32::NEG_INFINITY, 1.0, 1.0, 1.0];
    /// let (k, mut lp) = (VocabKernel::new(&ctx), [0.0f32; 2]);
    /// k.token_logprob(&z, 3, &[1, 2], 1.0, &mut lp)?;
    /// assert!((lp[0] - 0.75f32.ln()).abs() < 2e-6 && (lp[1] + 3f32.ln()).abs() < 2e-6);
    /// // A token id ≥ vocab is grpo-core's error; `lp` is untouched.
    /// let before = lp;
    /// let e = k.token_logprob(&z, 3, &[1, 3], 1.0, &mut lp);
    /// assert_eq!(e, Err(GpuError::Core(Error::TokenOutOfRange { index: 1, token: 3, vocab: 3 })));
    /// assert_eq!(lp, before);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::forward`].
    pub fn token_logprob<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        targets: &[u32],
        temperature: f32,
        logp: &mut [f32],
    ) -> Result<()> {
        let out = ForwardOut {
            logp: Some(logp),
            ..Default::default()
        };
        self.forward(logits, vocab, targets, temperature, out)
    }

    /// `H[r] = lse[r] − Σ_v p_v z[r, v]/T`.
    ///
    /// ```
    /// use grpo_core::Error;
    /// use grpo_wgpu::{GpuContext, GpuError, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // T = ½: row [0, ½ ln 3] is z/T = [0, ln 3], p = [¼, ¾],
    /// // H = −(¼ ln ¼ + ¾ ln ¾) = 0.5623351; row [5, 5] is uniform, H = ln 2.
    /// let z = [0.0f32, 3f32.ln() / 2.0, 5.0, 5.0];
    /// let (k, mut h) = (VocabKernel::new(&ctx), [0.0f32; 2]);
    /// k.entropy(&z, 2, 0.5, &mut h)?;
    /// assert!((h[0] - 0.5623351).abs() < 2e-6 && (h[1] - 2f32.ln()).abs() < 2e-6);
    /// // A NaN logit is grpo-core's error at its flat index; `h` is untouched.
    /// let (z, before) = ([0.0f32, 1.0, 5.0, f32::NAN], h);
    /// let e = k.entropy(&z, 2, 0.5, &mut h);
    /// assert_eq!(e, Err(GpuError::Core(Error::NonFinite { what: "logits", index: 3 })));
    /// assert_eq!(h, before);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::forward`].
    pub fn entropy<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        temperature: f32,
        entropy: &mut [f32],
    ) -> Result<()> {
        let out = ForwardOut {
            entropy: Some(entropy),
            ..Default::default()
        };
        self.forward(logits, vocab, &[], temperature, out)
    }

    /// KL divergence of every student/teacher row pair, grpo-core's
    /// [`grpo_core::vocab::kl_rows`] on the GPU \[ours; the distillation losses of arXiv
    /// 2306.13649\].
    ///
    /// With `p = softmax(student/T)` and `q = softmax(teacher/T)`: `out[r] = KL(p‖q) =
    /// Σ_v p_v (log p_v − log q_v)` for [`KlDirection::StudentTeacher`], `KL(q‖p)` for
    /// [`KlDirection::TeacherStudent`] (the shader computes KL(first‖second) with the rows' roles
    /// swapped). `rows = out.len()`; both slices `[rows, vocab]`, row-major, the same storage
    /// type. −∞ logits (masked entries) are allowed; columns where both rows are −∞ contribute 0.
    /// One dispatch, two reads of each row: the online max/sum of both rows, then grpo-core's
    /// `KL = (ln S_q − ln S_p) + Σ_v e^{dp_v}(dp_v − dq_v)/S_p` with every shift `d = x − max x`
    /// taken to the row's final maximum and floored at grpo-core's `LOG_RATIO_FLOOR` (−2^64), so
    /// rows of logits near ±f32::MAX (whose shifts overflow) give grpo-core's value and the row
    /// maxima never cancel in the sum.
    ///
    /// Rows the shader flags (a NaN or +∞, an empty row, a support violation, a finite logit
    /// whose `z/T` overflows, a non-finite result) are handed to grpo-core on the host: it
    /// returns the exact error, or — for the one anomaly grpo-core accepts, a non-maximal logit
    /// whose `z/T` overflows to −∞ (probability 0) — the row's value, computed by grpo-core.
    ///
    /// ```
    /// use grpo_core::vocab::KlDirection;
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // p = [½, ½] (z = [0, 0]), q = [¼, ¾] (w = [0, ln 3]):
    /// // KL(p‖q) = ½ ln 2 + ½ ln(2/3) = 0.1438410, KL(q‖p) = 0.1308120.
    /// let (z, w) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
    /// let k = VocabKernel::new(&ctx);
    /// let (mut f, mut r) = ([0.0f32], [0.0f32]);
    /// k.kl(&z, &w, 2, 1.0, KlDirection::StudentTeacher, &mut f)?;
    /// k.kl(&z, &w, 2, 1.0, KlDirection::TeacherStudent, &mut r)?;
    /// assert!((f[0] - 0.1438410).abs() < 3e-6 && (r[0] - 0.1308120).abs() < 3e-6);
    /// // The teacher is −∞ where the student has mass: KL(p‖q) = +∞ is an error, as in grpo-core.
    /// let w = [0.0f32, f32::NEG_INFINITY];
    /// assert!(k.kl(&z, &w, 2, 1.0, KlDirection::StudentTeacher, &mut f).is_err());
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// grpo-core's, in its order (on `Err` no output is written): `InvalidParam { name:
    /// "temperature" }` unless `T` is finite and `> 0` with a finite `1/T`; `InvalidParam {
    /// name: "vocab" }` for `vocab = 0`; `LengthMismatch { what: "student" | "teacher" }`; then
    /// row by row, student before teacher: `NonFinite { what: "student" | "teacher", index:
    /// r·vocab + v }` for the first NaN or +∞, `EmptySegment { segment: r }` for a row of only
    /// −∞, `NonFinite { what: "student / temperature" | "teacher / temperature" }` when a
    /// row's maximum overflows once divided by `T`, and `NonFinite` when the expectation's
    /// distribution has mass where the other's is 0 (the KL is +∞). Plus this backend's
    /// [`GpuError::TooLarge`] and, for f16, [`GpuError::MissingFeature`].
    pub fn kl<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        temperature: f32,
        direction: KlDirection,
        out: &mut [f32],
    ) -> Result<()> {
        let f = self.kl_with(
            student,
            teacher,
            vocab,
            temperature,
            direction,
            out,
            None,
            Wait::Block,
            Kept::NONE,
        );
        pollster::block_on(f)
    }

    /// Async [`VocabKernel::kl`]: awaits the readbacks instead of blocking (same results, same
    /// errors; `out` untouched on `Err`).
    ///
    /// ```
    /// use grpo_core::vocab::KlDirection;
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // p = [½, ½], q = [¼, ¾]: KL(p‖q) = 0.1438410.
    /// let (z, w) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
    /// let mut f = [0.0f32];
    /// let k = VocabKernel::new(&ctx);
    /// let fut = k.kl_async(&z, &w, 2, 1.0, KlDirection::StudentTeacher, &mut f);
    /// // Any executor drives the future; pollster blocks on it here.
    /// pollster::block_on(fut)?;
    /// assert!((f[0] - 0.1438410).abs() < 3e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::kl`].
    pub async fn kl_async<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        temperature: f32,
        direction: KlDirection,
        out: &mut [f32],
    ) -> Result<()> {
        self.kl_with(
            student,
            teacher,
            vocab,
            temperature,
            direction,
            out,
            None,
            Wait::Await,
            Kept::NONE,
        )
        .await
    }

    /// [`VocabKernel::kl`] that also saves each row pair's state for
    /// [`VocabKernel::backward_saved`], grpo-core's
    /// [`kl_rows_saved`](grpo_core::vocab::kl_rows_saved) on the GPU \[ours\]: the same two
    /// passes over both rows, which also sum the teacher's entropy term and the other
    /// direction's log-ratio term and write `saved[r]`.
    ///
    /// The state is grpo-core's [`PairState`] (references = the rows' largest logits, then
    /// `sz, tz, sw, tw, u, v` as grpo-core defines them), summed by the shader: within the
    /// tolerance of the KL, not grpo-core's bits. It does not depend on `direction` (the
    /// support check does), except where KL(p‖q) is +∞ under `TeacherStudent`: `u = +∞`
    /// there, as grpo-core records it; [`canon::finish_kl`](grpo_core::vocab::canon::finish_kl)
    /// gives both directions from it (KL(q‖p) from a `StudentTeacher` state where it is +∞
    /// comes out huge but finite, from the −2^64 floor, as in grpo-core). Rows the shader flags
    /// are computed by grpo-core on the host, as in [`VocabKernel::kl`], their states included
    /// — except a `TeacherStudent` call's rows of infinite KL(p‖q), marked here. Any backend's backward takes the
    /// states: grpo-core's and grpo-cpu's `backward_rows_saved` as well as this one.
    ///
    /// ```
    /// use grpo_core::vocab::{GradTerms, KlDirection, KlTerm, PairState};
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = VocabKernel::new(&ctx);
    /// // p = [½, ½], q = [¼, ¾]: KL(q‖p) = 0.1308120.
    /// let (z, w) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
    /// let (mut kl, mut saved) = ([0.0f32], [PairState::EMPTY]);
    /// k.kl_saved(&z, &w, 2, 1.0, KlDirection::TeacherStudent, &mut kl, &mut saved)?;
    /// assert!((kl[0] - 0.1308120).abs() < 3e-6);
    /// // Its gradient from the saved state: ∂KL(q‖p)/∂z = p − q = (¼, −¼).
    /// let kl_term = KlTerm { teacher: &w[..], grad: &[1.0], direction: KlDirection::TeacherStudent };
    /// let terms: GradTerms<'_, u32, f32> = GradTerms { logp: None, entropy: None, kl: Some(kl_term) };
    /// let mut grad = [0.0f32; 2];
    /// k.backward_saved(&z, 2, 1.0, &saved, &terms, &mut grad)?;
    /// assert!((grad[0] - 0.25).abs() < 1e-6 && (grad[1] + 0.25).abs() < 1e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::kl`], plus `LengthMismatch { what: "saved_out" }` after the rows'
    /// lengths (grpo-core's order). On `Err` nothing is written.
    #[allow(clippy::too_many_arguments)]
    pub fn kl_saved<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        temperature: f32,
        direction: KlDirection,
        out: &mut [f32],
        saved: &mut [PairState],
    ) -> Result<()> {
        let saved = Some(saved);
        let (t, d) = (temperature, direction);
        let f = self.kl_with(
            student,
            teacher,
            vocab,
            t,
            d,
            out,
            saved,
            Wait::Block,
            Kept::NONE,
        );
        pollster::block_on(f)
    }

    /// Async [`VocabKernel::kl_saved`]: awaits the readbacks instead of blocking (same results,
    /// same errors; nothing written on `Err`).
    ///
    /// # Errors
    /// As [`VocabKernel::kl_saved`].
    #[allow(clippy::too_many_arguments)]
    pub async fn kl_saved_async<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        temperature: f32,
        direction: KlDirection,
        out: &mut [f32],
        saved: &mut [PairState],
    ) -> Result<()> {
        let saved = Some(saved);
        let (t, d) = (temperature, direction);
        self.kl_with(
            student,
            teacher,
            vocab,
            t,
            d,
            out,
            saved,
            Wait::Await,
            Kept::NONE,
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn kl_with<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        temperature: f32,
        direction: KlDirection,
        out: &mut [f32],
        saved: Option<&mut [PairState]>,
        wait: Wait,
        kept: Kept<'_>,
    ) -> Result<()> {
        let rows = out.len();
        let saved_len = saved.as_deref().map(<[_]>::len);
        let tau = self.validate_pair(student, teacher, vocab, rows, temperature, saved_len)?;
        let params = VocabParams::new(0, vocab, 0, tau);
        let mut flagged = FLAG_EMPTY_ROW | FLAG_SCALE_OVERFLOW;
        let host = |row| Self::kl_on_host(student, teacher, vocab, row, temperature, direction);
        let Some(saved) = saved else {
            // `kl` computes KL(first‖second).
            let (first, second) = match direction {
                KlDirection::StudentTeacher => (student, teacher),
                KlDirection::TeacherStudent => (teacher, student),
            };
            flagged |= FLAG_KL_INFINITE;
            let vals = self
                .pair_rows(
                    "kl",
                    first,
                    second,
                    vocab,
                    rows,
                    params,
                    PairOut::Stats,
                    wait,
                    kept,
                    |row, w, st, _| {
                        if w[0] != NO_INDEX || w[1] & flagged != 0 || !st[3].is_finite() {
                            Ok(host(row)?.0)
                        } else {
                            Ok(st[3])
                        }
                    },
                )
                .await?;
            out.copy_from_slice(&vals);
            return Ok(());
        };
        // `kl_saved` takes the student first whatever the direction, and gives both.
        let slot = match direction {
            KlDirection::StudentTeacher => {
                flagged |= FLAG_KL_INFINITE;
                3
            }
            KlDirection::TeacherStudent => {
                flagged |= FLAG_KL_TEACHER_STUDENT_INFINITE;
                2
            }
        };
        let vals = self
            .pair_rows(
                "kl_saved",
                student,
                teacher,
                vocab,
                rows,
                params,
                PairOut::Saved(8),
                wait,
                kept,
                |row, w, st, sv| {
                    let state = PairState {
                        zmax: sv[0],
                        sz: sv[1],
                        tz: sv[2],
                        wmax: sv[3],
                        sw: sv[4],
                        tw: sv[5],
                        u: sv[6],
                        v: sv[7],
                    };
                    let finite = sv.iter().all(|x| x.is_finite()) && st[slot].is_finite();
                    if w[0] != NO_INDEX || w[1] & flagged != 0 || !finite {
                        host(row)
                    } else if w[1] & FLAG_KL_INFINITE != 0 {
                        // An infinite KL(p‖q), which the KL(q‖p) direction accepts: recorded
                        // as `u = +∞`, as grpo-core's `kl_rows_saved` does.
                        let u = f32::INFINITY;
                        Ok((st[slot], PairState { u, ..state }))
                    } else {
                        Ok((st[slot], state))
                    }
                },
            )
            .await?;
        for ((o, s), (value, state)) in out.iter_mut().zip(saved.iter_mut()).zip(vals) {
            (*o, *s) = (value, state);
        }
        Ok(())
    }

    /// grpo-core's `kl_rows_saved` on row `row` alone (widened exactly to f32): the row's KL
    /// and pair state, or its error re-based to the whole batch (`index` and `segment` of row
    /// `row`).
    fn kl_on_host<L: LogitStorage>(
        student: &[L],
        teacher: &[L],
        vocab: usize,
        row: usize,
        temperature: f32,
        direction: KlDirection,
    ) -> Result<(f32, PairState)> {
        let range = row * vocab..(row + 1) * vocab;
        let widen = |x: &[L]| -> Vec<f32> { x[range.clone()].iter().map(|z| z.widen()).collect() };
        let (z, w) = (widen(student), widen(teacher));
        let (mut v, mut st) = ([0f32], [PairState::EMPTY]);
        match grpo_core::vocab::kl_rows_saved(
            &z,
            &w,
            vocab,
            temperature,
            direction,
            &mut v,
            &mut st,
        ) {
            Ok(()) => Ok((v[0], st[0])),
            Err(Error::NonFinite { what, index }) => Err(Error::NonFinite {
                what,
                index: row * vocab + index,
            }
            .into()),
            Err(Error::EmptySegment { .. }) => Err(Error::EmptySegment { segment: row }.into()),
            Err(e) => Err(e.into()),
        }
    }

    /// Generalised Jensen–Shannon divergence `JSD_β` of every student/teacher row pair
    /// \[arXiv 2306.13649; MATH.md §5\], grpo-core's `vocab::jsd_rows` on the GPU.
    ///
    /// With `p = softmax(student/T)`, `q = softmax(teacher/T)` and the mixture
    /// `m = β q + (1 − β) p`, `out[r] = JSD_β = β KL(q‖m) + (1 − β) KL(p‖m)`
    /// `= Σ_v β q_v (log q_v − log m_v) + (1 − β) p_v (log p_v − log m_v)` for `0 < β < 1`
    /// (TRL's GKD loss uses the same definition; `JSD_β` tends to 0 at both ends, and TRL's
    /// code computes at β = 0 and β = 1 the limits of `JSD_β/β` and `JSD_β/(1 − β)`, KL(q‖p)
    /// and KL(p‖q): use [`VocabKernel::kl`] for those). `rows = out.len()`; both slices are `[rows,
    /// vocab]`, row-major. −∞ logits (masked entries) are allowed in either row, so the result is
    /// always finite, in `[0, −β ln β − (1 − β) ln(1 − β)]`; grpo-core clamps the sum at 0 and so
    /// does this kernel. One dispatch, two reads of each row (the row statistics, then the terms).
    ///
    /// ```
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let ninf = f32::NEG_INFINITY;
    /// // Row 0: p = [½, ½], q = [¼, ¾], m = [3/8, 5/8]: JSD_½ = ½ (KL(q‖m) + KL(p‖m)) = 0.0338221.
    /// // Row 1: disjoint (masked) supports: JSD_½ = ln 2.
    /// let student = [0.0f32, 0.0, 0.0, ninf];
    /// let teacher = [0.0f32, 3f32.ln(), ninf, 0.0];
    /// let mut out = [0.0f32; 2];
    /// VocabKernel::new(&ctx).jsd(&student, &teacher, 2, 0.5, 1.0, &mut out)?;
    /// assert!((out[0] - 0.0338221).abs() < 2e-6 && (out[1] - 2f32.ln()).abs() < 2e-6);
    /// // β must lie strictly inside (0, 1); nothing is written on error.
    /// assert!(VocabKernel::new(&ctx).jsd(&student, &teacher, 2, 1.0, 1.0, &mut out).is_err());
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// grpo-core's, in its order (on `Err` no output is written):
    /// `InvalidParam { name: "temperature" }` unless `T` is finite and `> 0` with a finite `1/T`;
    /// `InvalidParam { name: "beta" }` unless `0 < β < 1`; `InvalidParam { name: "vocab" }` for
    /// `vocab = 0`; `LengthMismatch { what: "student" | "teacher" }`; then row by row, student
    /// before teacher: `NonFinite { what: "student" | "teacher", index: r·vocab + v }` for the
    /// first NaN or +∞, `EmptySegment { segment: r }` for a row of only −∞, and
    /// `NonFinite { what: "student / temperature" | "teacher / temperature" }` when a row's
    /// maximum overflows once divided by `T`. Plus this backend's [`GpuError::TooLarge`] and,
    /// for f16, [`GpuError::MissingFeature`].
    pub fn jsd<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        beta: f32,
        temperature: f32,
        out: &mut [f32],
    ) -> Result<()> {
        let f = self.jsd_with(
            student,
            teacher,
            vocab,
            beta,
            temperature,
            out,
            None,
            Wait::Block,
        );
        pollster::block_on(f)
    }

    /// Async [`VocabKernel::jsd`]: awaits the readbacks instead of blocking (same results, same
    /// errors; `out` untouched on `Err`).
    ///
    /// ```
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // p = [½, ½], q = [¼, ¾], m = [3/8, 5/8]: JSD_½ = 0.0338221.
    /// let (z, w) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
    /// let mut out = [0.0f32];
    /// let k = VocabKernel::new(&ctx);
    /// let fut = k.jsd_async(&z, &w, 2, 0.5, 1.0, &mut out);
    /// // Any executor drives the future; pollster blocks on it here.
    /// pollster::block_on(fut)?;
    /// assert!((out[0] - 0.0338221).abs() < 2e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::jsd`].
    pub async fn jsd_async<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        beta: f32,
        temperature: f32,
        out: &mut [f32],
    ) -> Result<()> {
        let (t, none) = (temperature, None);
        self.jsd_with(student, teacher, vocab, beta, t, out, none, Wait::Await)
            .await
    }

    /// [`VocabKernel::jsd`] that also saves each row pair's [`JsdState`] for
    /// [`VocabKernel::jsd_backward_saved`] (or grpo-core's and grpo-cpu's
    /// `jsd_backward_rows_saved`) \[ours; grpo-core's `vocab::jsd_rows_saved`\]: both rows' raw
    /// maxima and `−ln Σ` (the log-softmax constants, from the row statistics), β, and
    /// `K = KL(p‖m)`, a second sum beside the JSD's in the same pass. The JSD values are
    /// [`VocabKernel::jsd`]'s, bit for bit. A state's reference is the row's raw maximum, where
    /// grpo-core's may lie below it (`LseState::max`), so `−ln Σ` differs by the same shift;
    /// the log-sum-exp the two imply (`max/T − (−ln Σ)`) is grpo-core's within the row
    /// statistics' tolerance, and `K` within the JSD's (times `1 + K`), so the gradient from
    /// either state is within the JSD gradient's tolerance of grpo-core's. Rows the shader
    /// flags go through grpo-core's row checks on the host, as in [`VocabKernel::jsd`]: its
    /// error, or an anomaly it accepts (a logit whose z/T overflows to −∞, left out of the
    /// row as there).
    ///
    /// ```
    /// use grpo_core::vocab::JsdState;
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = VocabKernel::new(&ctx);
    /// // p = [½, ½], q = [1, 0] (the teacher's second entry masked), β = ½: m = [¾, ¼],
    /// // K = KL(p‖m) = ½ ln(4/3).
    /// let (z, w) = ([0.0f32, 0.0], [0.0f32, f32::NEG_INFINITY]);
    /// let (mut jsd, mut saved) = ([0.0f32], [JsdState::EMPTY]);
    /// k.jsd_saved(&z, &w, 2, 0.5, 1.0, &mut jsd, &mut saved)?;
    /// assert!((saved[0].kl_pm - 0.5 * (4.0f32 / 3.0).ln()).abs() < 1e-6);
    /// assert_eq!((saved[0].student.max, saved[0].beta), (0.0, 0.5));
    /// // Its gradient from the saved state, against grpo-core's recomputing one.
    /// let (mut grad, mut want) = ([0.0f32; 2], [0.0f32; 2]);
    /// k.jsd_backward_saved(&z, &w, 2, 1.0, &saved, &[1.0], &mut grad)?;
    /// grpo_core::vocab::jsd_backward_rows(&z, &w, 2, 0.5, 1.0, &[1.0], &mut want)?;
    /// assert!(grad.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-6));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::jsd`], plus `LengthMismatch { what: "saved_out" }` after the rows'
    /// lengths (grpo-core's order). On `Err` nothing is written.
    #[allow(clippy::too_many_arguments)]
    pub fn jsd_saved<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        beta: f32,
        temperature: f32,
        out: &mut [f32],
        saved: &mut [JsdState],
    ) -> Result<()> {
        let (t, s) = (temperature, Some(saved));
        pollster::block_on(self.jsd_with(student, teacher, vocab, beta, t, out, s, Wait::Block))
    }

    /// Async [`VocabKernel::jsd_saved`]: awaits the readbacks instead of blocking (same
    /// results, same errors; nothing written on `Err`).
    ///
    /// # Errors
    /// As [`VocabKernel::jsd_saved`].
    #[allow(clippy::too_many_arguments)]
    pub async fn jsd_saved_async<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        beta: f32,
        temperature: f32,
        out: &mut [f32],
        saved: &mut [JsdState],
    ) -> Result<()> {
        let (t, s) = (temperature, Some(saved));
        self.jsd_with(student, teacher, vocab, beta, t, out, s, Wait::Await)
            .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn jsd_with<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        beta: f32,
        temperature: f32,
        out: &mut [f32],
        saved: Option<&mut [JsdState]>,
        wait: Wait,
    ) -> Result<()> {
        let rows = out.len();
        // grpo-core's own checks of T and β, in its order and with its messages: its batched JSD
        // on an empty batch validates exactly those (and a vocab of 1 with no rows) and nothing
        // else.
        grpo_core::vocab::jsd_rows::<f32, f32>(&[], &[], 1, beta, temperature, &mut [])?;
        let saved_len = saved.as_deref().map(<[_]>::len);
        let tau = self.validate_pair(student, teacher, vocab, rows, temperature, saved_len)?;
        let params = VocabParams::new(0, vocab, 0, tau).with_beta(beta);
        let (entry, out_kind) = match saved {
            Some(_) => ("jsd_saved", PairOut::Saved(JSD_STATE)),
            None => ("jsd", PairOut::Stats),
        };
        let vals = self
            .pair_rows(
                entry,
                student,
                teacher,
                vocab,
                rows,
                params,
                out_kind,
                wait,
                Kept::NONE,
                |row, w, st, sv| {
                    // A flagged row is grpo-core's error, or has an anomaly grpo-core accepts (a
                    // logit whose z/T overflows to −∞: probability 0, and left out of the row's
                    // raw maximum, as it is there).
                    if w[0] != NO_INDEX || w[2] != NO_INDEX || w[1] & JSD_FLAGGED != 0 {
                        Self::check_pair(student, teacher, vocab, row, tau)?;
                    }
                    let state = match sv {
                        &[zmax, z_nls, wmax, w_nls, kl_pm] => JsdState {
                            student: LogSoftmax {
                                max: zmax,
                                neg_ln_sum: z_nls,
                            },
                            teacher: LogSoftmax {
                                max: wmax,
                                neg_ln_sum: w_nls,
                            },
                            beta,
                            kl_pm,
                        },
                        _ => JsdState::EMPTY,
                    };
                    Ok((st[3], state))
                },
            )
            .await?;
        for (o, (value, _)) in out.iter_mut().zip(&vals) {
            *o = *value;
        }
        if let Some(saved) = saved {
            for (s, (_, state)) in saved.iter_mut().zip(vals) {
                *s = state;
            }
        }
        Ok(())
    }

    /// The gradient of the generalised JSD with respect to the student logits, grpo-core's
    /// `vocab::jsd_backward_rows` on the GPU: `grad[r, v] = g[r]·∂JSD_β,r/∂z[r, v]`
    /// `= g[r]·(1 − β)·p_v·(log p_v − log m_v − KL(p‖m))/T` with `p = softmax(student/T)`,
    /// `q = softmax(teacher/T)`, `m = β q + (1 − β) p` (the teacher is a constant; derivation in
    /// grpo-core). One dispatch per chunk of rows, three reads of each row pair (the row
    /// statistics, `KL(p‖m)`, the gradient) and one write. `log p_v − log m_v` is taken
    /// relative to `max(log p_v, log q_v)` as in [`VocabKernel::jsd`], so the gradient is
    /// within the tolerance of the other GPU gradients, not grpo-core's bits. A masked student
    /// entry gets 0; a masked teacher entry `(1 − β)·p_v·(−ln(1 − β) − KL(p‖m))/T`.
    ///
    /// ```
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // Identical rows: m = p, the JSD is at its minimum and its gradient is 0.
    /// let z = [0.5f32, -1.0, 2.0];
    /// let mut grad = [9.0f32; 3];
    /// let k = VocabKernel::new(&ctx);
    /// k.jsd_backward(&z, &z, 3, 0.5, 1.0, &[1.0], &mut grad)?;
    /// assert!(grad.iter().all(|g| g.abs() < 1e-6));
    /// // Against grpo-core.
    /// let w = [1.0f32, 0.0, -0.5];
    /// let mut want = [0.0f32; 3];
    /// grpo_core::vocab::jsd_backward_rows(&z, &w, 3, 0.3, 0.7, &[2.0], &mut want)?;
    /// k.jsd_backward(&z, &w, 3, 0.3, 0.7, &[2.0], &mut grad)?;
    /// assert!(grad.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-6));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// grpo-core's ([`jsd_backward_args`](grpo_core::vocab::validate::jsd_backward_args)
    /// first), in its order, with its names (`out` is `grad` here, `grad_jsd` is `g`):
    /// `InvalidParam { name: "temperature" }` (also for `T < 1e-6`), `InvalidParam { name:
    /// "beta" }` unless `0 < β < 1`, `InvalidParam { name: "vocab" }`, `LengthMismatch { what:
    /// "student" | "teacher" | "out" | "grad_jsd" }`, a weight that is not finite or above 1e9,
    /// then row by row the checks of [`VocabKernel::jsd`]. Then this backend's
    /// [`GpuError::TooLarge`] and, for f16, [`GpuError::MissingFeature`]. On `Err`, `grad` is
    /// untouched.
    #[allow(clippy::too_many_arguments)]
    pub fn jsd_backward<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        beta: f32,
        temperature: f32,
        g: &[f32],
        grad: &mut [f32],
    ) -> Result<()> {
        let f = self.jsd_backward_with(
            student,
            teacher,
            vocab,
            beta,
            temperature,
            g,
            grad,
            Wait::Block,
        );
        pollster::block_on(f)
    }

    /// Async [`VocabKernel::jsd_backward`]: awaits the readbacks instead of blocking (same
    /// results, same errors; `grad` untouched on `Err`).
    ///
    /// ```
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // p = [½, ½], q = [¼, ¾], β = ½: m = [3/8, 5/8], KL(p‖m) = ½ ln(4/3) + ½ ln(4/5),
    /// // ∂JSD/∂z_0 = ½·½·(ln(4/3) − KL(p‖m)).
    /// let (z, w) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
    /// let mut grad = [0.0f32; 2];
    /// let k = VocabKernel::new(&ctx);
    /// let fut = k.jsd_backward_async(&z, &w, 2, 0.5, 1.0, &[1.0], &mut grad);
    /// // Any executor drives the future; pollster blocks on it here.
    /// pollster::block_on(fut)?;
    /// let kl = 0.5 * (4.0f32 / 3.0).ln() + 0.5 * (4.0f32 / 5.0).ln();
    /// let want = 0.25 * ((4.0f32 / 3.0).ln() - kl);
    /// assert!((grad[0] - want).abs() < 1e-6 && (grad[0] + grad[1]).abs() < 1e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::jsd_backward`].
    #[allow(clippy::too_many_arguments)]
    pub async fn jsd_backward_async<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        beta: f32,
        temperature: f32,
        g: &[f32],
        grad: &mut [f32],
    ) -> Result<()> {
        self.jsd_backward_with(
            student,
            teacher,
            vocab,
            beta,
            temperature,
            g,
            grad,
            Wait::Await,
        )
        .await
    }

    /// [`VocabKernel::jsd_backward`] writing the gradient over the student logits, rounded to
    /// their storage type by `half`'s `from_f32` (ties to even): grpo-core's
    /// `vocab::jsd_backward_rows_in_place` on the GPU. The shader's `f32` gradient is rounded
    /// on the host (4 bytes per logit read back), so the result is [`VocabKernel::jsd_backward`]'s
    /// rounded, bit for bit.
    ///
    /// ```
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = VocabKernel::new(&ctx);
    /// let w = [1.0f32, 0.0, -0.5].map(half::bf16::from_f32);
    /// let z = [0.5f32, -1.0, 2.0].map(half::bf16::from_f32);
    /// let mut grad = [0.0f32; 3];
    /// k.jsd_backward(&z, &w, 3, 0.3, 0.7, &[2.0], &mut grad)?;
    /// let mut over = z;
    /// k.jsd_backward_in_place(&mut over, &w, 3, 0.3, 0.7, &[2.0])?;
    /// assert_eq!(over, grad.map(half::bf16::from_f32));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::jsd_backward`] (without `out`); on `Err` the logits are untouched.
    pub fn jsd_backward_in_place<L: LogitStorage>(
        &self,
        student: &mut [L],
        teacher: &[L],
        vocab: usize,
        beta: f32,
        temperature: f32,
        g: &[f32],
    ) -> Result<()> {
        let f = self.jsd_backward_over(student, teacher, vocab, beta, temperature, g, Wait::Block);
        pollster::block_on(f)
    }

    /// Async [`VocabKernel::jsd_backward_in_place`] (same bits, same errors).
    ///
    /// ```
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // Identical rows: the gradient is 0.
    /// let mut z = [0.5f32, -1.0, 2.0];
    /// let w = z;
    /// let k = VocabKernel::new(&ctx);
    /// pollster::block_on(k.jsd_backward_in_place_async(&mut z, &w, 3, 0.5, 1.0, &[1.0]))?;
    /// assert!(z.iter().all(|g| g.abs() < 1e-6));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::jsd_backward_in_place`].
    pub async fn jsd_backward_in_place_async<L: LogitStorage>(
        &self,
        student: &mut [L],
        teacher: &[L],
        vocab: usize,
        beta: f32,
        temperature: f32,
        g: &[f32],
    ) -> Result<()> {
        self.jsd_backward_over(student, teacher, vocab, beta, temperature, g, Wait::Await)
            .await
    }

    /// The in-place JSD gradients' shared body: [`VocabKernel::jsd_backward`]'s gradient,
    /// rounded over the logits.
    #[allow(clippy::too_many_arguments)]
    async fn jsd_backward_over<L: LogitStorage>(
        &self,
        student: &mut [L],
        teacher: &[L],
        vocab: usize,
        beta: f32,
        temperature: f32,
        g: &[f32],
        wait: Wait,
    ) -> Result<()> {
        let mut grad = vec![0f32; student.len()];
        let f = self.jsd_backward_with(
            student,
            teacher,
            vocab,
            beta,
            temperature,
            g,
            &mut grad,
            wait,
        );
        f.await?;
        for (z, &x) in student.iter_mut().zip(&grad) {
            *z = L::from_f32(x);
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn jsd_backward_with<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        beta: f32,
        temperature: f32,
        g: &[f32],
        grad: &mut [f32],
        wait: Wait,
    ) -> Result<()> {
        let (tau, rows) = grpo_core::vocab::validate::jsd_backward_args(
            student.len(),
            teacher.len(),
            vocab,
            beta,
            temperature,
            g,
            grad.len(),
        )?;
        self.check_limits::<L>(vocab)?;
        let params = VocabParams::new(0, vocab, 0, tau).with_beta(beta);
        // Each row's gradient goes to `staged` as the rows pass their checks: `grad` is written
        // only when every row has.
        let mut staged = vec![0.0f32; rows * vocab];
        self.pair_rows(
            "jsd_backward",
            student,
            teacher,
            vocab,
            rows,
            params,
            PairOut::Grad(g),
            wait,
            Kept::NONE,
            |row, w, _, row_grad| {
                if w[0] != NO_INDEX || w[2] != NO_INDEX || w[1] & JSD_FLAGGED != 0 {
                    Self::check_pair(student, teacher, vocab, row, tau)?;
                }
                staged[row * vocab..(row + 1) * vocab].copy_from_slice(row_grad);
                Ok(())
            },
        )
        .await?;
        grad.copy_from_slice(&staged);
        Ok(())
    }

    /// The JSD's gradient from the states [`VocabKernel::jsd_saved`] (or grpo-core's or
    /// grpo-cpu's `jsd_rows_saved`) saved, grpo-core's `vocab::jsd_backward_rows_saved` on the
    /// GPU \[ours\]: `grad[r, v] = g[r]·(1 − β)·p_v·(log p_v − log m_v − K)/T` with β and
    /// `K = KL(p‖m)` from `saved[r]`. One dispatch per chunk of rows, one read of each row pair
    /// and one write, where [`VocabKernel::jsd_backward`] reads each row pair three times; the
    /// log-ratio is taken relative to `max(log p_v, log q_v)` as there, so the gradient is
    /// within the same tolerance of grpo-core's.
    ///
    /// **The logits are not validated** (grpo-core's precondition): they must be the ones the
    /// states were saved from and `temperature` the forward's; other logits give a
    /// meaningless gradient, never a panic.
    ///
    /// ```
    /// use grpo_core::vocab::JsdState;
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = VocabKernel::new(&ctx);
    /// // States from grpo-core's saving forward serve the GPU's backward too.
    /// let (z, w) = ([0.5f32, -1.0, 2.0], [1.0f32, 0.0, -0.5]);
    /// let (mut jsd, mut saved) = ([0.0f32], [JsdState::EMPTY]);
    /// grpo_core::vocab::jsd_rows_saved(&z, &w, 3, 0.3, 0.7, &mut jsd, &mut saved)?;
    /// let (mut grad, mut want) = ([0.0f32; 3], [0.0f32; 3]);
    /// k.jsd_backward_saved(&z, &w, 3, 0.7, &saved, &[2.0], &mut grad)?;
    /// grpo_core::vocab::jsd_backward_rows_saved(&z, &w, 3, 0.7, &saved, &[2.0], &mut want)?;
    /// assert!(grad.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-6));
    /// // A state no forward saved is grpo-core's error; `grad` is untouched.
    /// let before = grad;
    /// assert!(k.jsd_backward_saved(&z, &w, 3, 0.7, &[JsdState::EMPTY], &[2.0], &mut grad).is_err());
    /// assert_eq!(grad, before);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// grpo-core's ([`validate::jsd_backward_saved`](grpo_core::vocab::validate::jsd_backward_saved)),
    /// in its order, with its names (`out` is `grad` here, `grad_jsd` is `g`): the
    /// temperature (`T ≥ 1e-6`), `vocab`, the lengths of `student`, `teacher`, `out`, `saved`
    /// and `grad_jsd`, the weights, then row by row the state. Then this backend's
    /// [`GpuError::TooLarge`] and, for f16, [`GpuError::MissingFeature`]. On `Err`, `grad` is
    /// untouched.
    #[allow(clippy::too_many_arguments)]
    pub fn jsd_backward_saved<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        temperature: f32,
        saved: &[JsdState],
        g: &[f32],
        grad: &mut [f32],
    ) -> Result<()> {
        let (t, out) = (temperature, Some(grad.len()));
        let f =
            self.jsd_backward_saved_with(student, teacher, vocab, t, saved, g, out, Wait::Block);
        write_bytes(grad, &pollster::block_on(f)?);
        Ok(())
    }

    /// Async [`VocabKernel::jsd_backward_saved`]: awaits the readbacks instead of blocking
    /// (same bits, same errors; `grad` untouched on `Err`).
    ///
    /// # Errors
    /// As [`VocabKernel::jsd_backward_saved`].
    #[allow(clippy::too_many_arguments)]
    pub async fn jsd_backward_saved_async<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        temperature: f32,
        saved: &[JsdState],
        g: &[f32],
        grad: &mut [f32],
    ) -> Result<()> {
        let (t, out) = (temperature, Some(grad.len()));
        let f =
            self.jsd_backward_saved_with(student, teacher, vocab, t, saved, g, out, Wait::Await);
        write_bytes(grad, &f.await?);
        Ok(())
    }

    /// [`VocabKernel::jsd_backward_saved`] writing the gradient over the student logits in
    /// their storage type, grpo-core's `vocab::jsd_backward_rows_in_place_saved` on the GPU:
    /// the shader rounds each element's f32 gradient as `half`'s `from_f32` does (ties to even)
    /// and packs it, so the result is [`VocabKernel::jsd_backward_saved`]'s rounded, bit for
    /// bit, and only the storage type's bytes are read back.
    ///
    /// ```
    /// use grpo_core::vocab::JsdState;
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = VocabKernel::new(&ctx);
    /// let w = [1.0f32, 0.0, -0.5].map(half::bf16::from_f32);
    /// let z = [0.5f32, -1.0, 2.0].map(half::bf16::from_f32);
    /// let (mut jsd, mut saved) = ([0.0f32], [JsdState::EMPTY]);
    /// k.jsd_saved(&z, &w, 3, 0.3, 0.7, &mut jsd, &mut saved)?;
    /// let mut grad = [0.0f32; 3];
    /// k.jsd_backward_saved(&z, &w, 3, 0.7, &saved, &[2.0], &mut grad)?;
    /// let mut over = z;
    /// k.jsd_backward_saved_in_place(&mut over, &w, 3, 0.7, &saved, &[2.0])?;
    /// assert_eq!(over, grad.map(half::bf16::from_f32));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::jsd_backward_saved`] (without `out`); on `Err` the logits are
    /// untouched.
    pub fn jsd_backward_saved_in_place<L: LogitStorage>(
        &self,
        student: &mut [L],
        teacher: &[L],
        vocab: usize,
        temperature: f32,
        saved: &[JsdState],
        g: &[f32],
    ) -> Result<()> {
        let t = temperature;
        let f =
            self.jsd_backward_saved_with(&*student, teacher, vocab, t, saved, g, None, Wait::Block);
        let bytes = pollster::block_on(f)?;
        write_bytes(student, &bytes);
        Ok(())
    }

    /// Async [`VocabKernel::jsd_backward_saved_in_place`] (same bits, same errors).
    ///
    /// # Errors
    /// As [`VocabKernel::jsd_backward_saved_in_place`].
    pub async fn jsd_backward_saved_in_place_async<L: LogitStorage>(
        &self,
        student: &mut [L],
        teacher: &[L],
        vocab: usize,
        temperature: f32,
        saved: &[JsdState],
        g: &[f32],
    ) -> Result<()> {
        let t = temperature;
        let f =
            self.jsd_backward_saved_with(&*student, teacher, vocab, t, saved, g, None, Wait::Await);
        let bytes = f.await?;
        write_bytes(student, &bytes);
        Ok(())
    }

    /// The JSD gradient's bytes from saved states: f32 for `out = Some(len)`, the storage type
    /// for `out = None` (in place). Validates everything first.
    #[allow(clippy::too_many_arguments)]
    async fn jsd_backward_saved_with<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        temperature: f32,
        saved: &[JsdState],
        g: &[f32],
        out: Option<usize>,
        wait: Wait,
    ) -> Result<Vec<u8>> {
        let (n, m) = (student.len(), teacher.len());
        let (tau, rows) = grpo_core::vocab::validate::jsd_backward_saved(
            n,
            m,
            vocab,
            temperature,
            saved,
            g,
            out.unwrap_or(n),
        )?;
        self.check_limits::<L>(vocab)?;
        let coef = Self::jsd_saved_coefs(saved, g, tau);
        let in_place = out.is_none();
        let pass = SavedPass {
            entry: if in_place {
                "jsd_backward_saved_in_place"
            } else {
                "jsd_backward_saved"
            },
            coef: &coef,
            targets: &vec![NO_INDEX; rows],
            in_place,
        };
        let w = Some(teacher);
        self.saved_pass(student, w, vocab, tau, rows, &pass, wait, Kept::NONE)
            .await
    }

    /// One dispatch of a per-row entry point (`forward`, `backward`) over chunk `c`: the
    /// chunk's logits in binding 0, its targets in 1, stats and status out in 2 and 3, the
    /// parameters in 4, then `extra`. The status words are checked ([`Self::check_status`],
    /// with `checked` targets) before the read-back buffers are returned.
    async fn dispatch_rows<L: LogitStorage>(
        &self,
        d: &RowDispatch<'_, L>,
        c: &RowChunk,
        extra: &[(u32, Arg<'_>)],
        wait: Wait,
        kept: Kept<'_>,
    ) -> Result<Vec<Vec<u8>>> {
        let (bytes, base) = Self::upload(d.logits, c, d.vocab);
        let params = VocabParams::new(c.rows, d.vocab, base, d.tau);
        let targets = &d.targets[c.first..c.first + c.rows];
        let mut args = vec![
            (0, kept.arg(bytes)),
            (1, Arg::In(bytemuck::cast_slice(targets))),
            (2, Arg::Out((c.rows * 16) as u64)),
            (3, Arg::Out((c.rows * 16) as u64)),
            (4, Arg::Uniform(bytemuck::bytes_of(&params))),
        ];
        args.extend_from_slice(extra);
        let rb = self.ctx.submit(
            ShaderId::Vocab(L::DTYPE),
            &args,
            &[(d.entry, [c.rows as u32, 1, 1])],
        )?;
        let res = wait.readback(rb).await?;
        let status: &[u32] = bytemuck::cast_slice(&res[1]);
        Self::check_status(
            &status[..c.rows * 4],
            c.first,
            d.vocab,
            d.tau,
            d.logits,
            d.checked,
        )?;
        Ok(res)
    }

    /// The host checks of a row-pair call (grpo-core's order): T, both shapes, the length of
    /// `saved_out` (`saved_len`, for a forward that saves states), then this backend's limits.
    /// Returns τ.
    fn validate_pair<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        rows: usize,
        temperature: f32,
        saved_len: Option<usize>,
    ) -> Result<f32> {
        let tau = grpo_core::vocab::validate::inverse_temperature(temperature)?;
        Self::check_shape("student", student.len(), vocab, rows)?;
        Self::check_shape("teacher", teacher.len(), vocab, rows)?;
        if let Some(n) = saved_len {
            check_len("saved_out", rows, n)?;
        }
        self.check_limits::<L>(vocab)?;
        Ok(tau)
    }

    /// A row-pair entry point (`kl`, `kl_saved`, `jsd`, `jsd_backward`) over every row, one
    /// dispatch per chunk: `first`'s rows in binding 0, `second`'s in binding 5, `params` with
    /// `rows` and `base` set per chunk, and what `out` asks for out of binding 6 (with, for a
    /// gradient, the rows' weights in binding 7). `finish(row, status words, stats, out)` turns
    /// each row's shader results (its 4 status words, its 4 stats and its floats of binding 6)
    /// into the row's output or grpo-core's error.
    #[allow(clippy::too_many_arguments)]
    async fn pair_rows<L: LogitStorage, T>(
        &self,
        entry: &'static str,
        first: &[L],
        second: &[L],
        vocab: usize,
        rows: usize,
        params: VocabParams,
        out: PairOut<'_>,
        wait: Wait,
        kept: Kept<'_>,
        mut finish: impl FnMut(usize, &[u32], &[f32], &[f32]) -> Result<T>,
    ) -> Result<Vec<T>> {
        let (saved, out_elem) = match out {
            PairOut::Stats => (0, 0),
            PairOut::Saved(n) => (n, 0),
            PairOut::Grad(_) => (vocab, 4),
        };
        let mut vals = Vec::with_capacity(rows);
        for c in self.chunks(rows, vocab, L::DTYPE.size(), out_elem)? {
            let (bytes, base) = Self::upload(first, &c, vocab);
            let (tbytes, _) = Self::upload(second, &c, vocab);
            let params = VocabParams {
                rows: c.rows as u32,
                base,
                ..params
            };
            let mut args = vec![
                (0, kept.arg(bytes)),
                (5, kept.arg(tbytes)),
                (2, Arg::Out((c.rows * 16) as u64)),
                (3, Arg::Out((c.rows * 16) as u64)),
                (4, Arg::Uniform(bytemuck::bytes_of(&params))),
            ];
            if saved > 0 {
                args.push((6, Arg::Out((c.rows * saved * 4) as u64)));
            }
            if let PairOut::Grad(g) = out {
                let g = &g[c.first..c.first + c.rows];
                args.push((7, Arg::In(bytemuck::cast_slice(g))));
            }
            let rb = self.ctx.submit(
                ShaderId::Vocab(L::DTYPE),
                &args,
                &[(entry, [c.rows as u32, 1, 1])],
            )?;
            let res = wait.readback(rb).await?;
            let st: &[f32] = bytemuck::cast_slice(&res[0]);
            let status: &[u32] = bytemuck::cast_slice(&res[1]);
            let sv: &[f32] = if saved > 0 {
                bytemuck::cast_slice(&res[2])
            } else {
                &[]
            };
            for r in 0..c.rows {
                let row_saved = sv.get(r * saved..(r + 1) * saved).unwrap_or(&[]);
                let w = &status[r * 4..r * 4 + 4];
                vals.push(finish(c.first + r, w, &st[r * 4..r * 4 + 4], row_saved)?);
            }
        }
        Ok(vals)
    }

    /// grpo-core's row checks (`validate::row`, student then teacher) of a row pair the shader
    /// flagged: they give the exact error, or accept the row when its only anomaly is a
    /// non-maximal logit whose z/T overflows to −∞ (probability 0 on both sides). Rows widen
    /// exactly to f32, so the checks see the stored values.
    fn check_pair<L: LogitStorage>(
        student: &[L],
        teacher: &[L],
        vocab: usize,
        row: usize,
        tau: f32,
    ) -> Result<()> {
        let range = row * vocab..(row + 1) * vocab;
        for (what, x) in [("student", student), ("teacher", teacher)] {
            let wide: Vec<f32> = x[range.clone()].iter().map(|z| z.widen()).collect();
            grpo_core::vocab::validate::row(&wide, what, row * vocab, row, tau)?;
        }
        Ok(())
    }

    /// Fused backward: for every row, `grad[r, v] = ∂/∂z[r, v] (g_logp[r]·logp(y_r) +
    /// g_entropy[r]·H[r])`, i.e. `(g_logp·(1[v=y] − p_v) − g_entropy·p_v(log p_v + H))/T`
    /// (MATH.md §5), written to `grad` (f32, same shape as `logits`). Recomputes the row
    /// statistics in the same dispatch (two reads of each row, one write).
    ///
    /// ```
    /// use grpo_core::Error;
    /// use grpo_wgpu::{GpuContext, GpuError, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // T = ½: row [0, ½ ln 3] has p = [¼, ¾], H = 0.5623351; target 1, g_logp = g_entropy = 1:
    /// // grad_0 = (0 − ¼ − ¼(ln ¼ + H))/T = −0.0880204,
    /// // grad_1 = (1 − ¾ − ¾(ln ¾ + H))/T = −grad_0.
    /// let z = [0.0f32, 3f32.ln() / 2.0];
    /// let (k, mut grad) = (VocabKernel::new(&ctx), [0.0f32; 2]);
    /// k.backward(&z, 2, &[1], 0.5, &[1.0], &[1.0], &mut grad)?;
    /// assert!((grad[0] + 0.0880204).abs() < 2e-6 && (grad[1] - 0.0880204).abs() < 2e-6);
    /// // A NaN upstream gradient is grpo-core's error; `grad` is untouched.
    /// let before = grad;
    /// let e = k.backward(&z, 2, &[1], 0.5, &[f32::NAN], &[1.0], &mut grad);
    /// assert!(matches!(e, Err(GpuError::Core(Error::NonFinite { what: "g_logp", .. }))));
    /// assert_eq!(grad, before);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::forward`]; `temperature ≥ 1e-6` (grpo-core's
    /// `MIN_GRAD_TEMPERATURE`: gradients scale with 1/T); `g_logp`, `g_entropy` and `targets`
    /// have one element per row, `grad` as many as `logits`; upstream gradients must be finite
    /// (`NonFinite { what: "g_logp" | "g_entropy" }`) and at most 1e9 in magnitude
    /// (`InvalidParam`) — grpo-core's `backward_rows` checks, with the weights named after
    /// this method's parameters rather than grpo-core's `grad_logp`/`grad_entropy`.
    pub fn backward<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        targets: &[u32],
        temperature: f32,
        g_logp: &[f32],
        g_entropy: &[f32],
        grad: &mut [f32],
    ) -> Result<()> {
        pollster::block_on(self.backward_with(
            logits,
            vocab,
            targets,
            temperature,
            g_logp,
            g_entropy,
            grad,
            Wait::Block,
        ))
    }

    /// Async [`VocabKernel::backward`]: awaits the readbacks instead of blocking (same gradient
    /// bits, same errors; `grad` untouched on `Err`).
    ///
    /// ```
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // Row [0, 0] (p = [½, ½]), target 0, ∂loss/∂logp = 1, no entropy term, T = 1:
    /// // grad = (1 − ½, −½).
    /// let mut grad = [0.0f32; 2];
    /// let k = VocabKernel::new(&ctx);
    /// let fut = k.backward_async(&[0.0f32, 0.0], 2, &[0], 1.0, &[1.0], &[0.0], &mut grad);
    /// // Any executor drives the future; pollster blocks on it here.
    /// pollster::block_on(fut)?;
    /// assert!((grad[0] - 0.5).abs() < 1e-6 && (grad[1] + 0.5).abs() < 1e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::backward`].
    pub async fn backward_async<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        targets: &[u32],
        temperature: f32,
        g_logp: &[f32],
        g_entropy: &[f32],
        grad: &mut [f32],
    ) -> Result<()> {
        self.backward_with(
            logits,
            vocab,
            targets,
            temperature,
            g_logp,
            g_entropy,
            grad,
            Wait::Await,
        )
        .await
    }

    async fn backward_with<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        targets: &[u32],
        temperature: f32,
        g_logp: &[f32],
        g_entropy: &[f32],
        grad: &mut [f32],
        wait: Wait,
    ) -> Result<()> {
        let rows = targets.len();
        // grpo-core's `backward_rows` checks, in its order (the slices named after this
        // method's parameters): the temperature, also against the gradients' minimum (they
        // scale with 1/T); every length; the weights (finite, ≤ 1e9); the target ids. Then
        // this backend's own limits, and the rows on the device.
        let tau = grpo_core::vocab::validate::gradient_temperature(temperature)?;
        Self::check_shape("logits", logits.len(), vocab, rows)?;
        check_len("grad", rows * vocab, grad.len())?;
        check_len("g_logp", rows, g_logp.len())?;
        check_len("g_entropy", rows, g_entropy.len())?;
        grpo_core::vocab::validate::weights("g_logp", g_logp, rows)?;
        grpo_core::vocab::validate::weights("g_entropy", g_entropy, rows)?;
        Self::check_targets(targets, vocab)?;
        self.check_limits::<L>(vocab)?;
        let upstream: Vec<f32> = g_logp
            .iter()
            .zip(g_entropy)
            .flat_map(|(&a, &b)| [a, b])
            .collect();
        let mut chunks_out: Vec<(usize, Vec<u8>)> = Vec::new();
        let dispatch = RowDispatch {
            entry: "backward",
            logits,
            targets,
            checked: Some(targets),
            vocab,
            tau,
        };
        for c in self.chunks(rows, vocab, L::DTYPE.size(), 4)? {
            let upstream = &upstream[c.first * 2..(c.first + c.rows) * 2];
            let extra = [
                (6, Arg::Out((c.rows * vocab * 4) as u64)),
                (7, Arg::In(bytemuck::cast_slice(upstream))),
            ];
            let mut res = self
                .dispatch_rows(&dispatch, &c, &extra, wait, Kept::NONE)
                .await?;
            chunks_out.push((c.first * vocab, std::mem::take(&mut res[2])));
        }
        for (start, bytes) in chunks_out {
            let g: &[f32] = bytemuck::cast_slice(&bytes);
            let n = g.len().min(grad.len() - start);
            grad[start..start + n].copy_from_slice(&g[..n]);
        }
        Ok(())
    }

    /// The fused backward from the row states a forward saved, grpo-core's
    /// [`backward_rows_saved`](grpo_core::vocab::backward_rows_saved) on the GPU \[ours\]:
    /// `grad[r, v] = ∂/∂z[r, v] (g_lp[r]·logp_r(y_r) + g_H[r]·H_r + g_KL[r]·KL_r)`, one read of
    /// each logit (and, with a KL term, teacher logit) and one write of its gradient, instead of
    /// [`VocabKernel::backward`]'s second pass over the logits to recompute the row statistics.
    ///
    /// `saved` holds grpo-core [`LseState`]s (from [`VocabKernel::forward_saved`], or any
    /// backend's `logprob_entropy_rows_saved`: log-probability and entropy terms) or
    /// [`PairState`]s (from [`VocabKernel::kl_saved`] or any backend's `kl_rows_saved`: any
    /// terms, a KL term in either direction included — a KL(p‖q) term is refused on a state
    /// whose KL(p‖q) is +∞). `terms` is grpo-core's [`GradTerms`], the
    /// teacher of its KL term in the logits' storage type. The host validates everything with
    /// grpo-core's own checks and turns each state into grpo-core's per-row coefficients
    /// ([`SavedState::coef`]); the shader then evaluates grpo-core's per-element step
    /// ([`canon::grad_step`](grpo_core::vocab::canon::grad_step)) with WGSL's `exp`: within
    /// the tolerance of [`VocabKernel::backward`], not grpo-core's bits.
    ///
    /// **The logits are not validated** (as in grpo-core): they, and the teacher's, must be the
    /// ones the states were saved from, and `temperature` the forward's. Only the target logits
    /// are read (on the host) before the gradient is written. For other logits the result is
    /// meaningless, and a NaN or +∞ logit gives a meaningless finite or NaN gradient, not an error.
    ///
    /// ```
    /// use grpo_core::vocab::{GradTerms, KlDirection, KlTerm, PairState};
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = VocabKernel::new(&ctx);
    /// // Distillation with KL(p‖q) (student‖teacher), p = [½, ½], q = [¼, ¾]:
    /// // ∂KL(p‖q)/∂z_v = p_v (log p_v − log q_v − KL).
    /// let (z, w) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
    /// let (mut kl, mut saved) = ([0.0f32], [PairState::EMPTY]);
    /// k.kl_saved(&z, &w, 2, 1.0, KlDirection::StudentTeacher, &mut kl, &mut saved)?;
    /// let kl_term = KlTerm { teacher: &w[..], grad: &[1.0], direction: KlDirection::StudentTeacher };
    /// let terms: GradTerms<'_, u32, f32> = GradTerms { logp: None, entropy: None, kl: Some(kl_term) };
    /// let mut grad = [0.0f32; 2];
    /// k.backward_saved(&z, 2, 1.0, &saved, &terms, &mut grad)?;
    /// let want0 = 0.5 * (2f64.ln() - kl[0] as f64);
    /// assert!((grad[0] as f64 - want0).abs() < 1e-6 && (grad[0] + grad[1]).abs() < 1e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// grpo-core's ([`validate::backward_saved`](grpo_core::vocab::validate::backward_saved)),
    /// in its order, with its names (`out` is `grad` here): the temperature, `vocab`, the
    /// lengths of `logits`, `out` and `saved`, `InvalidParam { name: "kl" }` for a KL term with
    /// `LseState`s, the lengths of the terms, their weights, the targets, then row by row the
    /// saved state, `NonFinite { what: "saved KL(p‖q)" }` for a KL(p‖q) term on a state whose
    /// KL(p‖q) is +∞ (`SavedState::check_kl_term`), and the target logit. Then this backend's [`GpuError::TooLarge`] and, for
    /// f16, [`GpuError::MissingFeature`]. On `Err`, `grad` is untouched.
    pub fn backward_saved<L: LogitStorage, St: SavedState>(
        &self,
        logits: &[L],
        vocab: usize,
        temperature: f32,
        saved: &[St],
        terms: &GradTerms<'_, u32, L>,
        grad: &mut [f32],
    ) -> Result<()> {
        let out = Some(grad.len());
        let f = self.backward_saved_with(
            logits,
            vocab,
            temperature,
            saved,
            terms,
            out,
            Wait::Block,
            Kept::NONE,
        );
        write_bytes(grad, &pollster::block_on(f)?);
        Ok(())
    }

    /// Async [`VocabKernel::backward_saved`]: awaits the readbacks instead of blocking (same
    /// gradient bits, same errors; `grad` untouched on `Err`).
    ///
    /// # Errors
    /// As [`VocabKernel::backward_saved`].
    pub async fn backward_saved_async<L: LogitStorage, St: SavedState>(
        &self,
        logits: &[L],
        vocab: usize,
        temperature: f32,
        saved: &[St],
        terms: &GradTerms<'_, u32, L>,
        grad: &mut [f32],
    ) -> Result<()> {
        let out = Some(grad.len());
        let bytes = self
            .backward_saved_with(
                logits,
                vocab,
                temperature,
                saved,
                terms,
                out,
                Wait::Await,
                Kept::NONE,
            )
            .await?;
        write_bytes(grad, &bytes);
        Ok(())
    }

    /// The saved backward's gradient bytes: `out = Some(len)` gives it in f32 (`grad`, `len`
    /// floats), `out = None` in the logits' storage type (written over them; grpo-core's
    /// convention for the in-place checks). Validates everything first.
    #[allow(clippy::too_many_arguments)]
    async fn backward_saved_with<L: LogitStorage, St: SavedState>(
        &self,
        logits: &[L],
        vocab: usize,
        temperature: f32,
        saved: &[St],
        terms: &GradTerms<'_, u32, L>,
        out: Option<usize>,
        wait: Wait,
        kept: Kept<'_>,
    ) -> Result<Vec<u8>> {
        let (tau, rows) = grpo_core::vocab::validate::backward_saved(
            logits,
            vocab,
            temperature,
            saved,
            terms,
            out,
        )?;
        self.check_limits::<L>(vocab)?;
        let in_place = out.is_none();
        let (coef, targets, entry) = Self::saved_coefs(saved, tau, terms, in_place);
        let teacher = terms.kl.as_ref().map(|k| k.teacher);
        let pass = SavedPass {
            entry,
            coef: &coef,
            targets: &targets,
            in_place,
        };
        self.saved_pass(logits, teacher, vocab, tau, rows, &pass, wait, kept)
            .await
    }

    /// One pass of a backward from saved states (`backward_saved*`, `jsd_backward_saved*`)
    /// over every row, one dispatch per chunk: the logits in binding 0, the targets in 1, the
    /// rows' coefficients in 7 and, with a teacher, its rows in 5; returns the gradient's
    /// bytes, f32 out of binding 6 or, `in_place`, the storage type packed in binding 8
    /// (`grad_words`).
    #[allow(clippy::too_many_arguments)]
    async fn saved_pass<L: LogitStorage>(
        &self,
        logits: &[L],
        teacher: Option<&[L]>,
        vocab: usize,
        tau: f32,
        rows: usize,
        pass: &SavedPass<'_>,
        wait: Wait,
        kept: Kept<'_>,
    ) -> Result<Vec<u8>> {
        let (binding, elem) = if pass.in_place {
            (8, L::DTYPE.size())
        } else {
            (6, 4)
        };
        let mut bytes = vec![0u8; rows * vocab * elem];
        for c in self.chunks(rows, vocab, L::DTYPE.size(), 4)? {
            let (z, base) = Self::upload(logits, &c, vocab);
            let params = VocabParams::new(c.rows, vocab, base, tau);
            let coef = &pass.coef[c.first * SAVED_COEF..(c.first + c.rows) * SAVED_COEF];
            let chunk = c.first * vocab * elem..(c.first + c.rows) * vocab * elem;
            let targets = &pass.targets[c.first..c.first + c.rows];
            let mut args = vec![
                (0, kept.arg(z)),
                (1, Arg::In(bytemuck::cast_slice(targets))),
                (4, Arg::Uniform(bytemuck::bytes_of(&params))),
                (binding, Arg::Out(chunk.len().next_multiple_of(4) as u64)),
                (7, Arg::In(bytemuck::cast_slice(coef))),
            ];
            if let Some(w) = teacher {
                args.push((5, kept.arg(Self::upload(w, &c, vocab).0)));
            }
            let rb = self.ctx.submit(
                ShaderId::Vocab(L::DTYPE),
                &args,
                &[(pass.entry, [c.rows as u32, 1, 1])],
            )?;
            let res = wait.readback(rb).await?;
            let len = chunk.len();
            bytes[chunk].copy_from_slice(&res[0][..len]);
        }
        Ok(bytes)
    }

    /// The fused backward of any term set, grpo-core's
    /// [`backward_rows`](grpo_core::vocab::backward_rows) on the GPU \[ours\]: `grad[r, v] =
    /// ∂/∂z[r, v] (g_lp[r]·logp_r(y_r) + g_H[r]·H_r + g_KL[r]·KL_r)`, where the KL term
    /// (distillation: KL(p‖q) or KL(q‖p) against the teacher rows of `terms.kl`, the logits'
    /// storage type) and the log-probability term are optional, unlike
    /// [`VocabKernel::backward`]'s fixed log-probability and entropy terms.
    ///
    /// Two dispatches per chunk of rows: the saving forward of the terms — [`forward_saved`]
    /// (one read of each row), or [`kl_saved`] in the KL term's direction (two reads of each
    /// row pair) — then [`backward_saved`] from those states (one read, one write). They run in
    /// two submissions (the host turns the states into grpo-core's coefficients between them)
    /// that read one upload of the chunk's logits and teacher logits: the inputs cross to the
    /// device once, where calling the two methods uploads them twice. A trainer that ran the
    /// saving forward for its loss calls [`backward_saved`] directly and saves the first
    /// dispatch. Accuracy: [`backward_saved`]'s.
    ///
    /// [`forward_saved`]: VocabKernel::forward_saved
    /// [`kl_saved`]: VocabKernel::kl_saved
    /// [`backward_saved`]: VocabKernel::backward_saved
    ///
    /// ```
    /// use grpo_core::vocab::{GradTerms, KlDirection, KlTerm};
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // KL(q‖p) (teacher‖student) against the teacher q = [¼, ¾] (p = [½, ½]): ∂KL(q‖p)/∂z = p − q.
    /// let (z, w) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
    /// let kl_term = KlTerm { teacher: &w[..], grad: &[1.0], direction: KlDirection::TeacherStudent };
    /// let terms: GradTerms<'_, u32, f32> = GradTerms { logp: None, entropy: None, kl: Some(kl_term) };
    /// let mut grad = [0.0f32; 2];
    /// VocabKernel::new(&ctx).backward_rows(&z, 2, 1.0, &terms, &mut grad)?;
    /// assert!((grad[0] - 0.25).abs() < 1e-6 && (grad[1] + 0.25).abs() < 1e-6);
    /// // A teacher of −∞ where the student has mass: KL(p‖q) = +∞, grpo-core's error.
    /// let w = [0.0f32, f32::NEG_INFINITY];
    /// let kl_term = KlTerm { teacher: &w[..], grad: &[1.0], direction: KlDirection::StudentTeacher };
    /// let terms: GradTerms<'_, u32, f32> = GradTerms { logp: None, entropy: None, kl: Some(kl_term) };
    /// assert!(VocabKernel::new(&ctx).backward_rows(&z, 2, 1.0, &terms, &mut grad).is_err());
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// grpo-core's ([`validate::backward`](grpo_core::vocab::validate::backward)), in its
    /// order, with its names (`out` is `grad` here): the temperature, `vocab`, every length,
    /// the weights, the target ids, then row by row the logits (`NonFinite { what: "logits" }`,
    /// `EmptySegment`), the teacher, the KL's support and the target logit. Then this
    /// backend's [`GpuError::TooLarge`] and, for f16, [`GpuError::MissingFeature`]. On `Err`,
    /// `grad` is untouched.
    pub fn backward_rows<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        temperature: f32,
        terms: &GradTerms<'_, u32, L>,
        grad: &mut [f32],
    ) -> Result<()> {
        let out = Some(grad.len());
        let f = self.backward_rows_with(logits, vocab, temperature, terms, out, Wait::Block);
        write_bytes(grad, &pollster::block_on(f)?);
        Ok(())
    }

    /// Async [`VocabKernel::backward_rows`]: awaits the readbacks instead of blocking (same
    /// gradient bits, same errors; `grad` untouched on `Err`).
    ///
    /// # Errors
    /// As [`VocabKernel::backward_rows`].
    pub async fn backward_rows_async<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        temperature: f32,
        terms: &GradTerms<'_, u32, L>,
        grad: &mut [f32],
    ) -> Result<()> {
        let out = Some(grad.len());
        let f = self.backward_rows_with(logits, vocab, temperature, terms, out, Wait::Await);
        write_bytes(grad, &f.await?);
        Ok(())
    }

    /// [`VocabKernel::backward_rows`] writing the gradient over the logits themselves, rounded
    /// to their storage type (f32, or bf16 / f16 as `half`'s `from_f32` rounds: to nearest,
    /// ties to even): grpo-core's
    /// [`backward_rows_in_place`](grpo_core::vocab::backward_rows_in_place) on the GPU
    /// \[ours\]. `logits[r, v] ← ∂/∂z[r, v] (g_lp[r]·logp_r(y_r) + g_H[r]·H_r + g_KL[r]·KL_r)`.
    ///
    /// The same two dispatches per chunk as [`VocabKernel::backward_rows`], whose `f32`
    /// gradient this rounds, bit for bit (the rounding is integer arithmetic in the shader, so
    /// every device gives `half`'s bits for the gradient it computed). For 16-bit logits the
    /// shader writes 2 bytes per logit instead of 4, and half as many bytes come back to the
    /// host; no separate gradient buffer on the host either. Accuracy:
    /// [`VocabKernel::backward_saved`]'s before the rounding.
    ///
    /// ```
    /// use grpo_core::vocab::GradTerms;
    /// use grpo_wgpu::{GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // Row [0, 0] (p = [½, ½]), target 0, ∂loss/∂logp = 1: the gradient (½, −½) replaces the
    /// // logits, here bf16 (both values exact in bf16).
    /// let mut z = [half::bf16::ZERO; 2];
    /// let terms: GradTerms<'_, u32, half::bf16> =
    ///     GradTerms { logp: Some((&[0], &[1.0])), entropy: None, kl: None };
    /// VocabKernel::new(&ctx).backward_rows_in_place(&mut z, 2, 1.0, &terms)?;
    /// assert_eq!(z.map(f32::from), [0.5, -0.5]);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::backward_rows`] (grpo-core's checks with `out = None`: there is no
    /// `grad` length to check). On `Err`, the logits are untouched.
    pub fn backward_rows_in_place<L: LogitStorage>(
        &self,
        logits: &mut [L],
        vocab: usize,
        temperature: f32,
        terms: &GradTerms<'_, u32, L>,
    ) -> Result<()> {
        let f = self.backward_rows_over(logits, vocab, temperature, terms, Wait::Block);
        pollster::block_on(f)
    }

    /// Async [`VocabKernel::backward_rows_in_place`]: awaits the readbacks instead of blocking
    /// (same bits, same errors; the logits untouched on `Err`).
    ///
    /// # Errors
    /// As [`VocabKernel::backward_rows_in_place`].
    pub async fn backward_rows_in_place_async<L: LogitStorage>(
        &self,
        logits: &mut [L],
        vocab: usize,
        temperature: f32,
        terms: &GradTerms<'_, u32, L>,
    ) -> Result<()> {
        self.backward_rows_over(logits, vocab, temperature, terms, Wait::Await)
            .await
    }

    /// [`VocabKernel::backward_rows_in_place`]'s work: the gradient in the storage type, then
    /// written over the logits (nothing written on `Err`).
    async fn backward_rows_over<L: LogitStorage>(
        &self,
        logits: &mut [L],
        vocab: usize,
        temperature: f32,
        terms: &GradTerms<'_, u32, L>,
        wait: Wait,
    ) -> Result<()> {
        let f = self.backward_rows_with(logits, vocab, temperature, terms, None, wait);
        let bytes = f.await?;
        write_bytes(logits, &bytes);
        Ok(())
    }

    /// [`VocabKernel::backward_saved`] writing the gradient over the logits themselves, rounded
    /// to their storage type as [`VocabKernel::backward_rows_in_place`] rounds it: grpo-core's
    /// [`backward_rows_in_place_saved`](grpo_core::vocab::backward_rows_in_place_saved) on the
    /// GPU \[ours\]. One read of each logit (and teacher logit) and one write of its gradient
    /// in the storage type; [`VocabKernel::backward_saved`]'s `f32` gradient rounded, bit for
    /// bit.
    ///
    /// **The logits are not validated** beyond the target logits, as in
    /// [`VocabKernel::backward_saved`]: they must be the ones the states were saved from.
    ///
    /// ```
    /// use grpo_core::vocab::{GradTerms, LseState};
    /// use grpo_wgpu::{ForwardOut, GpuContext, VocabKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = VocabKernel::new(&ctx);
    /// // [0, 0], target 0: the forward saves the row's state, the backward (∂loss/∂logp = 1)
    /// // writes (½, −½) over the logits.
    /// let mut z = [0.0f32, 0.0];
    /// let mut saved = [LseState::EMPTY];
    /// k.forward_saved(&z, 2, &[0], 1.0, ForwardOut::default(), &mut saved)?;
    /// let terms: GradTerms<'_, u32> = GradTerms { logp: Some((&[0], &[1.0])), entropy: None, kl: None };
    /// k.backward_saved_in_place(&mut z, 2, 1.0, &saved, &terms)?;
    /// assert!((z[0] - 0.5).abs() < 1e-6 && (z[1] + 0.5).abs() < 1e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As [`VocabKernel::backward_saved`] (grpo-core's checks with `out = None`). On `Err`,
    /// the logits are untouched.
    pub fn backward_saved_in_place<L: LogitStorage, St: SavedState>(
        &self,
        logits: &mut [L],
        vocab: usize,
        temperature: f32,
        saved: &[St],
        terms: &GradTerms<'_, u32, L>,
    ) -> Result<()> {
        let t = temperature;
        pollster::block_on(self.backward_saved_over(logits, vocab, t, saved, terms, Wait::Block))
    }

    /// Async [`VocabKernel::backward_saved_in_place`]: awaits the readbacks instead of blocking
    /// (same bits, same errors; the logits untouched on `Err`).
    ///
    /// # Errors
    /// As [`VocabKernel::backward_saved_in_place`].
    pub async fn backward_saved_in_place_async<L: LogitStorage, St: SavedState>(
        &self,
        logits: &mut [L],
        vocab: usize,
        temperature: f32,
        saved: &[St],
        terms: &GradTerms<'_, u32, L>,
    ) -> Result<()> {
        let t = temperature;
        self.backward_saved_over(logits, vocab, t, saved, terms, Wait::Await)
            .await
    }

    /// [`VocabKernel::backward_saved_in_place`]'s work: the gradient in the storage type, then
    /// written over the logits (nothing written on `Err`).
    async fn backward_saved_over<L: LogitStorage, St: SavedState>(
        &self,
        logits: &mut [L],
        vocab: usize,
        temperature: f32,
        saved: &[St],
        terms: &GradTerms<'_, u32, L>,
        wait: Wait,
    ) -> Result<()> {
        let (t, none) = (temperature, Kept::NONE);
        let f = self.backward_saved_with(logits, vocab, t, saved, terms, None, wait, none);
        let bytes = f.await?;
        write_bytes(logits, &bytes);
        Ok(())
    }

    async fn backward_rows_with<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        temperature: f32,
        terms: &GradTerms<'_, u32, L>,
        out: Option<usize>,
        wait: Wait,
    ) -> Result<Vec<u8>> {
        let (_, rows) = grpo_core::vocab::validate::backward_args(
            logits.len(),
            vocab,
            temperature,
            terms,
            out,
        )?;
        self.check_limits::<L>(vocab)?;
        // The saving forward checks the rows (the KL's support in its direction included) as
        // grpo-core does, but names the student rows after its own parameters and runs before
        // the target checks of `backward_saved`: on its error, grpo-core's own checks of the
        // whole call give grpo-core's first error.
        let exact = |e: GpuError| match grpo_core::vocab::validate::backward(
            logits,
            vocab,
            temperature,
            terms,
            out,
        ) {
            Err(core) => GpuError::from(core),
            Ok(_) => e,
        };
        // Chunk by chunk (the backward's chunks, which the forward's hold whole): the chunk's
        // logits, and the teacher's, are uploaded once and read by both submissions — the
        // saving forward and, after the host turned its states into coefficients, the
        // backward. The two calls below see the chunk as the whole input, so each makes one
        // dispatch whose upload is the kept one (`Kept::arg`).
        let t = temperature;
        let elem = if out.is_some() { 4 } else { L::DTYPE.size() };
        let mut bytes = vec![0u8; rows * vocab * elem];
        for c in self.chunks(rows, vocab, L::DTYPE.size(), 4)? {
            let (r0, r1) = (c.first, c.first + c.rows);
            let elems = r0 * vocab..r1 * vocab;
            let z = &logits[elems.clone()];
            let chunk_terms = GradTerms {
                logp: terms.logp.map(|(y, g)| (&y[r0..r1], &g[r0..r1])),
                entropy: terms.entropy.map(|g| &g[r0..r1]),
                kl: terms.kl.map(|k| KlTerm {
                    teacher: &k.teacher[elems.clone()],
                    grad: &k.grad[r0..r1],
                    ..k
                }),
            };
            let mut uploads = vec![self.ctx.upload(bytemuck::cast_slice(z))?];
            if let Some(k) = &chunk_terms.kl {
                uploads.push(self.ctx.upload(bytemuck::cast_slice(k.teacher))?);
            }
            let kept = Kept(&uploads);
            let chunk_out = out.map(|_| c.rows * vocab);
            // Errors name rows of the chunk: grpo-core's checks of the whole call give its own.
            let grad = match chunk_terms.kl {
                None => {
                    let mut saved = vec![LseState::EMPTY; c.rows];
                    let none = ForwardOut::default();
                    self.forward_with(z, vocab, &[], t, none, Some(&mut saved), wait, kept)
                        .await
                        .map_err(exact)?;
                    let terms = &chunk_terms;
                    self.backward_saved_with(z, vocab, t, &saved, terms, chunk_out, wait, kept)
                        .await
                        .map_err(exact)?
                }
                Some(k) => {
                    let mut kl = vec![0f32; c.rows];
                    let mut saved = vec![PairState::EMPTY; c.rows];
                    let (w, d, s) = (k.teacher, k.direction, Some(&mut saved[..]));
                    self.kl_with(z, w, vocab, t, d, &mut kl, s, wait, kept)
                        .await
                        .map_err(exact)?;
                    let terms = &chunk_terms;
                    self.backward_saved_with(z, vocab, t, &saved, terms, chunk_out, wait, kept)
                        .await
                        .map_err(exact)?
                }
            };
            bytes[elems.start * elem..elems.end * elem].copy_from_slice(&grad);
        }
        Ok(bytes)
    }

    /// The coefficients of the `jsd_backward_saved*` entry points (the shader's `SavedCoef` of
    /// its KL_JSD term) from validated states and weights: the log-softmaxes, K in the KL's
    /// slot, `c = (g·(1 − β))·τ` in g_KL's, then β, 1 − β and −ln(1 − β) (as
    /// `VocabParams::with_beta` computes it).
    fn jsd_saved_coefs(saved: &[JsdState], g: &[f32], tau: f32) -> Vec<f32> {
        let mut coef = Vec::with_capacity(saved.len() * SAVED_COEF);
        for (st, &g) in saved.iter().zip(g) {
            let (j, k, c) = st.grad_params(tau, g);
            coef.extend_from_slice(&[
                j.lz.max,
                j.lz.neg_ln_sum,
                0.0,
                0.0,
                0.0,
                c,
                j.lw.max,
                j.lw.neg_ln_sum,
                k,
                j.beta,
                j.omb,
                -j.omb.ln(),
            ]);
        }
        coef
    }

    /// The input of a `backward_saved*` entry point: each row's coefficients (the shader's
    /// `SAVED_COEF` = 12 floats: grpo-core's [`SavedState::coef`] of the row's state and
    /// weights, in `SavedCoef`'s order) and target (`NO_INDEX` without a log-probability term),
    /// and the entry point of the KL term's direction (its `_in_place` twin, which writes the
    /// gradient in the logits' storage type, for `in_place`). The states and terms are
    /// validated.
    fn saved_coefs<L, St: SavedState>(
        saved: &[St],
        tau: f32,
        terms: &GradTerms<'_, u32, L>,
        in_place: bool,
    ) -> (Vec<f32>, Vec<u32>, &'static str) {
        let rows = saved.len();
        let mut coef = Vec::with_capacity(rows * SAVED_COEF);
        let mut targets = vec![NO_INDEX; rows];
        for (r, st) in saved.iter().enumerate() {
            let g_h = terms.entropy.map_or(0.0, |g| g[r]);
            let g_kl = terms.kl.as_ref().map_or(0.0, |k| k.grad[r]);
            let g_lp = terms.logp.map_or(0.0, |(t, g)| {
                targets[r] = t[r];
                g[r]
            });
            let c = st.coef(tau, g_lp, g_h, g_kl);
            // The shader reads `kl` only for a KL(p‖q) term, which `check_kl_term` refused on
            // a state whose KL(p‖q) is +∞: no infinity is uploaded (WGSL may assume none).
            let pq_term = matches!(
                terms.kl.as_ref().map(|k| k.direction),
                Some(KlDirection::StudentTeacher)
            );
            let kl = if pq_term { c.kl } else { 0.0 };
            coef.extend_from_slice(&[
                c.p.max,
                c.p.neg_ln_sum,
                c.h,
                c.g_lp,
                c.g_h,
                c.g_kl,
                c.q.max,
                c.q.neg_ln_sum,
                kl,
                0.0,
                0.0,
                0.0,
            ]);
        }
        let entry = match (terms.kl.as_ref().map(|k| k.direction), in_place) {
            (None, false) => "backward_saved",
            (Some(KlDirection::StudentTeacher), false) => "backward_saved_kl_student_teacher",
            (Some(KlDirection::TeacherStudent), false) => "backward_saved_kl_teacher_student",
            (None, true) => "backward_saved_in_place",
            (Some(KlDirection::StudentTeacher), true) => {
                "backward_saved_in_place_kl_student_teacher"
            }
            (Some(KlDirection::TeacherStudent), true) => {
                "backward_saved_in_place_kl_teacher_student"
            }
        };
        (coef, targets, entry)
    }
}

/// Writes a backward's gradient bytes (as the device wrote them, little-endian) over `dst`: the
/// f32 gradient, or the logits of an in-place backward.
fn write_bytes<T: Pod>(dst: &mut [T], bytes: &[u8]) {
    bytemuck::cast_slice_mut::<T, u8>(dst).copy_from_slice(bytes);
}
