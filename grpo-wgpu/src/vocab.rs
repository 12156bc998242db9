//! [`VocabKernel`]: log-sum-exp, token log-probability, entropy, KL between rows and the fused
//! backward over logit rows (MATH.md §5), for f32, f16 and bf16 storage with f32 accumulation.

use bytemuck::{Pod, Zeroable};
use grpo_core::Error;

use crate::context::{Arg, GpuContext, Resident};
use crate::error::{GpuError, Result, check_len, ensure};
use crate::shaders::{LogitDtype, ShaderId};

/// A logit storage type the shaders read: `f32`, `half::f16`, `half::bf16`.
pub trait LogitStorage: Pod + sealed::Sealed {
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
}

const FLAG_EMPTY_ROW: u32 = 1;
const FLAG_TARGET_NEG_INF: u32 = 2;
const FLAG_KL_INFINITE: u32 = 4;
const NO_INDEX: u32 = u32::MAX;

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

struct RowChunk {
    first: usize,
    rows: usize,
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
        ensure(vocab > 0, "vocab", "must be > 0")?;
        let expected = rows.checked_mul(vocab).ok_or(Error::InvalidParam {
            name: "vocab",
            reason: "rows · vocab overflows usize",
        })?;
        check_len("logits", expected, logits.len())?;
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
        Ok(tau)
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
    /// first NaN/+∞ (`NonFinite{"logits"}`), all −∞ (`EmptySegment`), z/T overflow
    /// (`NonFinite{"logits / temperature"}` at the first maximum, found on the host as grpo-core
    /// does), then, when `targets` is given, a −∞ target logit (`NonFinite{"logits[target]"}`).
    fn check_status<L: LogitStorage>(
        status: &[u32],
        first_row: usize,
        vocab: usize,
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
            if w[1] & FLAG_EMPTY_ROW != 0 {
                return Err(Error::EmptySegment { segment: row }.into());
            }
            if w[2] != NO_INDEX {
                let zs = &logits[row * vocab..(row + 1) * vocab];
                let m = zs
                    .iter()
                    .map(|z| z.widen())
                    .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
                let v = zs.iter().position(|z| z.widen() == m).unwrap_or(0);
                return Err(Error::NonFinite {
                    what: "logits / temperature",
                    index: row * vocab + v,
                }
                .into());
            }
            if let Some(t) = targets
                && w[1] & FLAG_TARGET_NEG_INF != 0
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

    /// Benchmark hook: the fused forward (`backward = false`: lse, log-prob, entropy) or the
    /// fused backward (f32 gradient out, upstream gradients 1 and 0.5) over `rows × vocab`
    /// logits uploaded once, as one dispatch over every row; each [`Resident::run`] times only
    /// the kernel (no upload, no readback, no status check). Targets are 0.
    ///
    /// # Errors
    /// As [`VocabKernel::forward`]; [`GpuError::TooLarge`] when the logits or the gradient do
    /// not fit one binding, or the rows one dispatch dimension (the benchmark runs one chunk).
    #[doc(hidden)]
    pub fn resident<L: LogitStorage>(
        &self,
        logits: &[L],
        vocab: usize,
        backward: bool,
    ) -> Result<Resident<'c>> {
        let rows = logits.len() / vocab.max(1);
        self.validate(logits, vocab, rows, 1.0)?;
        if rows > self.ctx.max_groups() as usize {
            return Err(GpuError::TooLarge {
                what: "rows in one dispatch",
                bytes: (rows * vocab * L::DTYPE.size()) as u64,
                limit: u64::from(self.ctx.max_groups()) * (vocab * L::DTYPE.size()) as u64,
            });
        }
        let targets = vec![0u32; rows];
        let upstream: Vec<f32> = (0..rows).flat_map(|_| [1.0f32, 0.5]).collect();
        let params = VocabParams {
            rows: rows as u32,
            vocab: vocab as u32,
            base: 0,
            inv_temp: 1.0,
        };
        let mut args = vec![
            (0, Arg::In(bytemuck::cast_slice(logits))),
            (1, Arg::In(bytemuck::cast_slice(&targets))),
            (2, Arg::Out((rows * 16) as u64)),
            (3, Arg::Out((rows * 16) as u64)),
            (4, Arg::Uniform(bytemuck::bytes_of(&params))),
        ];
        if backward {
            args.push((6, Arg::Out((rows * vocab * 4) as u64)));
            args.push((7, Arg::In(bytemuck::cast_slice(&upstream))));
        }
        let entry = if backward { "backward" } else { "forward" };
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
        pollster::block_on(self.forward_async(logits, vocab, targets, temperature, out))
    }

    /// Async [`VocabKernel::forward`]: awaits the readback instead of blocking.
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
        let ForwardOut { lse, logp, entropy } = out;
        let rows = [lse.as_deref(), logp.as_deref(), entropy.as_deref()]
            .iter()
            .flatten()
            .map(|s| s.len())
            .next()
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
        for c in self.chunks(rows, vocab, L::DTYPE.size(), 0)? {
            let (bytes, base) = Self::upload(logits, &c, vocab);
            let params = VocabParams {
                rows: c.rows as u32,
                vocab: vocab as u32,
                base,
                inv_temp: tau,
            };
            let res = self
                .ctx
                .submit(
                    ShaderId::Vocab(L::DTYPE),
                    &[
                        (0, Arg::In(bytes)),
                        (
                            1,
                            Arg::In(bytemuck::cast_slice(&targets[c.first..c.first + c.rows])),
                        ),
                        (2, Arg::Out((c.rows * 16) as u64)),
                        (3, Arg::Out((c.rows * 16) as u64)),
                        (4, Arg::Uniform(bytemuck::bytes_of(&params))),
                    ],
                    &[("forward", [c.rows as u32, 1, 1])],
                )?
                .await?;
            let status: &[u32] = bytemuck::cast_slice(&res[1]);
            let t = logp.is_some().then_some(targets);
            Self::check_status(&status[..c.rows * 4], c.first, vocab, logits, t)?;
            let st: &[f32] = bytemuck::cast_slice(&res[0]);
            stats[c.first * 4..(c.first + c.rows) * 4].copy_from_slice(&st[..c.rows * 4]);
        }
        // Everything validated: now write the caller's buffers.
        for (k, dst) in [lse, logp, entropy].into_iter().enumerate() {
            if let Some(dst) = dst {
                for (r, d) in dst.iter_mut().enumerate() {
                    *d = stats[r * 4 + k];
                }
            }
        }
        Ok(())
    }

    /// `lse[r] = log Σ_v exp(z[r, v]/T)`.
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

    /// `KL(p‖q)` per row with `p = softmax(student/T)`, `q = softmax(teacher/T)`:
    /// `Σ_v p_v (log p_v − log q_v)`. (Reverse KL: swap the arguments.) `+∞` where the
    /// teacher is `−∞` at a column where the student has mass.
    ///
    /// # Errors
    /// As [`VocabKernel::forward`]; NaN/+∞ in either row is `NonFinite { what: "logits" }`;
    /// a row where either side is entirely −∞ is `EmptySegment`.
    pub fn kl<L: LogitStorage>(
        &self,
        student: &[L],
        teacher: &[L],
        vocab: usize,
        temperature: f32,
        kl: &mut [f32],
    ) -> Result<()> {
        let rows = kl.len();
        let tau = self.validate(student, vocab, rows, temperature)?;
        check_len("teacher", rows * vocab, teacher.len())?;
        let mut vals = vec![0f32; rows];
        for c in self.chunks(rows, vocab, L::DTYPE.size(), 0)? {
            let (bytes, base) = Self::upload(student, &c, vocab);
            let (tbytes, _) = Self::upload(teacher, &c, vocab);
            let params = VocabParams {
                rows: c.rows as u32,
                vocab: vocab as u32,
                base,
                inv_temp: tau,
            };
            let res = self.ctx.run(
                ShaderId::Vocab(L::DTYPE),
                &[
                    (0, Arg::In(bytes)),
                    (5, Arg::In(tbytes)),
                    (2, Arg::Out((c.rows * 16) as u64)),
                    (3, Arg::Out((c.rows * 16) as u64)),
                    (4, Arg::Uniform(bytemuck::bytes_of(&params))),
                ],
                &[("kl", [c.rows as u32, 1, 1])],
            )?;
            let status: &[u32] = bytemuck::cast_slice(&res[1]);
            Self::check_status(&status[..c.rows * 4], c.first, vocab, student, None)?;
            let st: &[f32] = bytemuck::cast_slice(&res[0]);
            for r in 0..c.rows {
                vals[c.first + r] = if status[r * 4 + 1] & FLAG_KL_INFINITE != 0 {
                    f32::INFINITY
                } else {
                    st[r * 4 + 3]
                };
            }
        }
        kl.copy_from_slice(&vals);
        Ok(())
    }

    /// Fused backward: for every row, `grad[r, v] = ∂/∂z[r, v] (g_logp[r]·logp(y_r) +
    /// g_entropy[r]·H[r])`, i.e. `(g_logp·(1[v=y] − p_v) − g_entropy·p_v(log p_v + H))/T`
    /// (MATH.md §5), written to `grad` (f32, same shape as `logits`). Recomputes the row
    /// statistics in the same dispatch (two reads of each row, one write).
    ///
    /// # Errors
    /// As [`VocabKernel::forward`]; `g_logp`, `g_entropy` and `targets` have one element per
    /// row, `grad` as many as `logits`; upstream gradients must be finite
    /// (`NonFinite { what: "g_logp" | "g_entropy" }`).
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
        let rows = targets.len();
        let tau = self.validate(logits, vocab, rows, temperature)?;
        check_len("g_logp", rows, g_logp.len())?;
        check_len("g_entropy", rows, g_entropy.len())?;
        check_len("grad", rows * vocab, grad.len())?;
        Self::check_targets(targets, vocab)?;
        for (what, g) in [("g_logp", g_logp), ("g_entropy", g_entropy)] {
            if let Some(index) = g.iter().position(|x| !x.is_finite()) {
                return Err(Error::NonFinite { what, index }.into());
            }
        }
        let upstream: Vec<f32> = g_logp
            .iter()
            .zip(g_entropy)
            .flat_map(|(&a, &b)| [a, b])
            .collect();
        let mut chunks_out: Vec<(usize, Vec<u8>)> = Vec::new();
        for c in self.chunks(rows, vocab, L::DTYPE.size(), 4)? {
            let (bytes, base) = Self::upload(logits, &c, vocab);
            let params = VocabParams {
                rows: c.rows as u32,
                vocab: vocab as u32,
                base,
                inv_temp: tau,
            };
            let mut res = self.ctx.run(
                ShaderId::Vocab(L::DTYPE),
                &[
                    (0, Arg::In(bytes)),
                    (
                        1,
                        Arg::In(bytemuck::cast_slice(&targets[c.first..c.first + c.rows])),
                    ),
                    (2, Arg::Out((c.rows * 16) as u64)),
                    (3, Arg::Out((c.rows * 16) as u64)),
                    (4, Arg::Uniform(bytemuck::bytes_of(&params))),
                    (6, Arg::Out((c.rows * vocab * 4) as u64)),
                    (
                        7,
                        Arg::In(bytemuck::cast_slice(
                            &upstream[c.first * 2..(c.first + c.rows) * 2],
                        )),
                    ),
                ],
                &[("backward", [c.rows as u32, 1, 1])],
            )?;
            let status: &[u32] = bytemuck::cast_slice(&res[1]);
            Self::check_status(&status[..c.rows * 4], c.first, vocab, logits, Some(targets))?;
            chunks_out.push((c.first * vocab, std::mem::take(&mut res[2])));
        }
        for (start, bytes) in chunks_out {
            let g: &[f32] = bytemuck::cast_slice(&bytes);
            let n = g.len().min(grad.len() - start);
            grad[start..start + n].copy_from_slice(&g[..n]);
        }
        Ok(())
    }
}
