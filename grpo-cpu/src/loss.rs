//! Multi-threaded per-token policy losses, bit-identical to grpo-core's.
//!
//! `f32` PPO-clip runs a SIMD kernel (`kernels::loss`, grpo-core's operations lane by lane) over
//! spans of the batch on the [`Cpu`]'s threads; `f64` runs grpo-core's own `ppo_clip` per block
//! of [`LOSS_BLOCK`] positions on the threads.

use grpo_core::loss::{LossDiagnostics, LossLevel, PolicyInputs, PpoClipConfig, ppo_clip};
use grpo_core::vocab::canon::{BLOCK, PairwiseFold};
use grpo_core::{Real, Result, Tokens};
use std::ops::Range;

use rayon::prelude::*;

use crate::arch;
use crate::backend::Pass;
use crate::cpu::Cpu;
use crate::kernels::loss::{PpoParams, PpoSpan, SpanDiag};

/// Token positions per parallel task of the `f64` path: two of grpo-core's canonical
/// 2048-position blocks, so the tasks' `kl_sum`s fold into grpo-core's exact association; a
/// block's inputs and outputs (5 × 4096 × 8 B = 160 KiB) stay in L2 between grpo-core's check
/// pass and write pass.
pub const LOSS_BLOCK: usize = 2 * BLOCK;

/// Token positions per parallel task of the `f32` SIMD path: 8 canonical blocks (a power of two,
/// so the spans' `kl_sum`s fold exactly like grpo-core's blocks), 192 KiB of inputs — large
/// enough that the task overhead is negligible, small enough that 2 threads share the load
/// evenly and a thread slowed by a neighbour process does not hold up the batch.
const SPAN: usize = 8 * BLOCK;

/// The scalar types [`Cpu::ppo_clip`] accepts (sealed): `f32` runs the SIMD kernel, `f64` runs
/// grpo-core's scalar code per block on the threads. Both give grpo-core's bits.
pub trait LossFloat: Real + Send + Sync + sealed::Sealed {
    #[doc(hidden)]
    fn ppo_clip_on(
        cpu: &Cpu,
        cfg: &PpoClipConfig<Self>,
        inp: &PolicyInputs<'_, Self>,
        value: &mut [Self],
        grad: &mut [Self],
    ) -> Result<LossDiagnostics<Self>>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

impl LossFloat for f32 {
    fn ppo_clip_on(
        cpu: &Cpu,
        cfg: &PpoClipConfig<f32>,
        inp: &PolicyInputs<'_, f32>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics<f32>> {
        cpu.ppo_clip_simd(cfg, inp, value, grad)
    }
}

impl LossFloat for f64 {
    fn ppo_clip_on(
        cpu: &Cpu,
        cfg: &PpoClipConfig<f64>,
        inp: &PolicyInputs<'_, f64>,
        value: &mut [f64],
        grad: &mut [f64],
    ) -> Result<LossDiagnostics<f64>> {
        cpu.ppo_clip_blocks(cfg, inp, value, grad, LOSS_BLOCK)
    }
}

impl Cpu {
    /// [`grpo_core::loss::ppo_clip`] on this executor's threads: the same per-token values,
    /// gradients and diagnostics bit for bit, the same errors, outputs untouched on `Err`.
    ///
    /// Formula (MATH.md §3–§4, \[2602.05494\] unified clipped objective; GRPO
    /// \[arXiv:2402.03300\], DAPO \[arXiv:2503.14476\], ATR-GRPO's KL3 bounds via
    /// [`PpoClipConfig::atr_kl3`]): with `ρ_t = exp(clamp(lp_t − old_t))`,
    /// `L_t = −min(ρ̃_t A_t, clip(ρ_t, lo, hi) A_t)` (`ρ̃_t = min(ρ_t, δ)` under the δ cap),
    /// optionally dual-clipped at `−c·A_t` for `A_t < 0`; `grad[t] = ∂L_t/∂lp_t`. See grpo-core's
    /// rustdoc for every detail.
    ///
    /// How it runs \[ours\]: PPO-clip is a token-level loss (token `t`'s value and gradient read
    /// only `lp[t]`, `old[t]`, `adv[t]`), so the batch is cut into spans of positions regardless
    /// of sequence boundaries (only the mask decides validity: every position of a valid layout
    /// lies in some sequence). Two parallel passes, because outputs must stay untouched on `Err`:
    /// the first checks every span without writing and sums its `−x` for `kl_sum`; the second —
    /// only if every span passed — writes each span's values and gradients and gathers the
    /// other diagnostics (spans in reverse order, so it starts on inputs the first pass left in
    /// the last-level cache). If anything
    /// fails, grpo-core is called on the whole batch, which returns its own error and writes
    /// nothing, so the error value is exactly grpo-core's. The `f32` check is conservative and
    /// needs no exponential: finite `lp − old` and finite `A·M`, where `M = max(R, hi, c_dual)`
    /// and `R` bounds every ratio (`e^c` under a log-ratio clamp `c ≤ 80`; otherwise `e^80`,
    /// and the check also requires `lp − old ≤ 80`), which bounds every value and gradient.
    /// The rare batch it rejects although grpo-core accepts it — an `|A|` near `f32::MAX / M`,
    /// or a log-ratio above 80 without such a clamp — also goes to grpo-core, and gets
    /// grpo-core's result.
    ///
    /// - `f32`: a SIMD kernel on the [`Cpu`]'s backend repeats grpo-core's operations lane by
    ///   lane (its `exp` for `f32` is the canonical one every backend reproduces), spans of
    ///   16384 positions, one loop per combination of the configuration's options. Where
    ///   `lp`, `old`, `adv`, `value` and `grad` lie equally far from a 64-byte boundary, the
    ///   second pass reads and writes in aligned chunks, with streaming stores on AVX-512;
    ///   otherwise through the cache (the bits are the same either way). `grpo-bench loss`
    ///   measures it against the same-run read + write roofline: 0.53–0.76 of it over 18 runs
    ///   on a 2-core AVX-512 (Zen 4) build machine, 0.5–0.6 on an Intel one, 0.44–0.64 over 15
    ///   runs on the noisy 2-core AVX2 (Zen 3) one, before the aligned chunks (README; the
    ///   check pass reads the inputs a second time, at about the memory's pace).
    /// - `f64`: grpo-core's scalar `ppo_clip` per block of [`LOSS_BLOCK`] positions (each
    ///   block evaluated twice by grpo-core itself, and twice by the two passes).
    ///
    /// `kl_sum` is grpo-core's canonical sum: the spans are power-of-two multiples of its
    /// 2048-position blocks and are folded pairwise, which is exactly grpo-core's association.
    /// The spans depend only on the batch length, so every result is the same for every backend
    /// and every pool.
    ///
    /// # Errors
    /// Exactly those of [`grpo_core::loss::ppo_clip`].
    ///
    /// # Example
    /// ```
    /// use grpo_core::Tokens;
    /// use grpo_core::loss::{PolicyInputs, PpoClipConfig};
    /// use grpo_cpu::{Backend, Cpu};
    ///
    /// let cpu = Cpu::detect().with_threads(2).unwrap();
    /// // Two padded sequences of 2 tokens; the last position is padding (garbage allowed).
    /// let mask = [true, true, true, false];
    /// let inp = PolicyInputs {
    ///     lp: &[0.0f32, 0.5f32.ln(), 0.0, f32::NAN],
    ///     old: &[0.0, 0.0, 0.0, 0.0],
    ///     adv: &[1.0, -1.0, 0.0, 0.0],
    ///     tokens: Tokens::padded(2, 2, Some(&mask)),
    /// };
    /// let (mut value, mut grad) = ([9.0; 4], [9.0; 4]);
    /// let d = cpu.ppo_clip(&PpoClipConfig::default(), &inp, &mut value, &mut grad).unwrap();
    /// // t=0: ρ = 1, A = 1: L = −1, ∂L/∂lp = −A·ρ = −1.
    /// // t=1: ρ = 0.5 < 0.8, A = −1: −min(−0.5, −0.8) = 0.8 (clipped, no gradient).
    /// // t=2: A = 0: L = 0, grad 0; t=3 is padding: 0, 0.
    /// assert_eq!(value, [-1.0, 0.8, 0.0, 0.0]);
    /// assert_eq!(grad, [-1.0, 0.0, 0.0, 0.0]);
    /// assert_eq!((d.tokens, d.clipped_low), (3, 1));
    /// // The same bits as grpo-core:
    /// let (mut v2, mut g2) = ([0.0f32; 4], [0.0f32; 4]);
    /// let d2 = grpo_core::loss::ppo_clip(&PpoClipConfig::default(), &inp, &mut v2, &mut g2).unwrap();
    /// assert_eq!((value.map(f32::to_bits), grad.map(f32::to_bits)), (v2.map(f32::to_bits), g2.map(f32::to_bits)));
    /// assert_eq!(d, d2);
    /// ```
    pub fn ppo_clip<T: LossFloat>(
        &self,
        cfg: &PpoClipConfig<T>,
        inp: &PolicyInputs<'_, T>,
        value: &mut [T],
        grad: &mut [T],
    ) -> Result<LossDiagnostics<T>> {
        T::ppo_clip_on(self, cfg, inp, value, grad)
    }

    /// Whether the lengths and layout are valid (else grpo-core names the error).
    fn loss_layout_ok<T>(inp: &PolicyInputs<'_, T>, value: &[T], grad: &[T]) -> bool {
        let n = inp.lp.len();
        inp.tokens.validate(n).is_ok()
            && [inp.old.len(), inp.adv.len(), value.len(), grad.len()]
                .iter()
                .all(|&len| len == n)
    }

    /// The `f32` path of [`Cpu::ppo_clip`]: the SIMD kernel over spans.
    fn ppo_clip_simd(
        &self,
        cfg: &PpoClipConfig<f32>,
        inp: &PolicyInputs<'_, f32>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics<f32>> {
        if cfg.validate().is_err() || !Self::loss_layout_ok(inp, value, grad) {
            return ppo_clip(cfg, inp, value, grad);
        }
        let p = PpoParams::new(cfg);
        let n = inp.lp.len();
        let target = self.target(Pass::General);
        let span = |k: usize| k * SPAN..((k + 1) * SPAN).min(n);
        let kernel = |r: Range<usize>, out| PpoSpan {
            p,
            lp: &inp.lp[r.clone()],
            old: &inp.old[r.clone()],
            adv: &inp.adv[r.clone()],
            mask: inp.tokens.mask.map(|m| &m[r]),
            out,
        };
        // Pass 1: check every span (no writes) and sum its `−x` (collected in span order: the
        // spans' `kl` fold in that order).
        let checked: Vec<SpanDiag> = self.install(|| {
            (0..n.div_ceil(SPAN))
                .into_par_iter()
                .map(|k| arch::run(target, kernel(span(k), None)))
                .collect()
        });
        if !checked.iter().all(|s| s.ok) {
            return ppo_clip(cfg, inp, value, grad);
        }
        // Pass 2: every span is known to succeed; write each into its own slices and gather
        // its diagnostics.
        let spans: Vec<SpanDiag> = self.install(|| {
            value
                .par_chunks_mut(SPAN)
                .zip(grad.par_chunks_mut(SPAN))
                .enumerate()
                .rev()
                .map(|(k, (v, g))| arch::run(target, kernel(span(k), Some((v, g)))))
                .collect()
        });
        let mut d = LossDiagnostics::<f32>::empty(LossLevel::Token);
        for s in &spans {
            d.tokens += s.tokens;
            d.clipped_low += s.clipped_low;
            d.clipped_high += s.clipped_high;
            d.dual_clipped += s.dual_clipped;
            d.delta_capped += s.delta_capped;
            d.clamped += s.clamped;
            d.ratio_min = Real::min(d.ratio_min, s.ratio_min);
            d.ratio_max = Real::max(d.ratio_max, s.ratio_max);
        }
        let mut kl = PairwiseFold::new();
        for s in &checked {
            kl.push(s.kl, |a, b| a + b);
        }
        d.kl_sum = kl.finish(|a, b| a + b).unwrap_or(0.0);
        Ok(d)
    }

    /// `f64`'s path of [`Cpu::ppo_clip`], with `block` positions per task (`0` is taken as 1):
    /// grpo-core's `ppo_clip` per block. `kl_sum` is grpo-core's exactly when `block` is a
    /// power-of-two multiple of 2048 (the default [`LOSS_BLOCK`]); tests use small blocks to cut
    /// small batches into many. Not part of the stable API.
    #[doc(hidden)]
    pub fn ppo_clip_blocks<T: Real + Send + Sync>(
        &self,
        cfg: &PpoClipConfig<T>,
        inp: &PolicyInputs<'_, T>,
        value: &mut [T],
        grad: &mut [T],
        block: usize,
    ) -> Result<LossDiagnostics<T>> {
        let block = block.max(1);
        let n = inp.lp.len();
        if !Self::loss_layout_ok(inp, value, grad) || n <= block {
            // Bad lengths or layout (grpo-core names the error), or a single block: nothing to
            // share between threads.
            return ppo_clip(cfg, inp, value, grad);
        }
        let blocks = n.div_ceil(block);
        let range = |k: usize| k * block..((k + 1) * block).min(n);
        // Pass 1: validate every block (grpo-core's full check, results into scratch).
        let all_ok = self.install(|| {
            (0..blocks)
                .into_par_iter()
                .map_init(
                    || (vec![T::ZERO; block], vec![T::ZERO; block]),
                    |(v, g), k| {
                        let r = range(k);
                        let cu = [0, r.len()];
                        let len = r.len();
                        ppo_clip(cfg, &block_view(inp, r, &cu), &mut v[..len], &mut g[..len])
                            .is_ok()
                    },
                )
                .all(|ok| ok)
        });
        if !all_ok {
            return ppo_clip(cfg, inp, value, grad);
        }
        // Pass 2: every block is known to succeed; write each into its own slices.
        let diags: Vec<Result<LossDiagnostics<T>>> = self.install(|| {
            value
                .par_chunks_mut(block)
                .zip(grad.par_chunks_mut(block))
                .enumerate()
                .map(|(k, (v, g))| {
                    let r = range(k);
                    let cu = [0, r.len()];
                    ppo_clip(cfg, &block_view(inp, r, &cu), v, g)
                })
                .collect()
        });
        let mut merged = LossDiagnostics::empty(LossLevel::Token);
        let mut kl = PairwiseFold::new();
        for d in diags {
            let d = d?;
            kl.push(d.kl_sum, |a, b| a + b);
            merged = merged.merge(d);
        }
        merged.kl_sum = kl.finish(|a, b| a + b).unwrap_or(T::ZERO);
        Ok(merged)
    }
}

/// Positions `r` of `inp` as a one-segment packed batch (`cu = [0, r.len()]`).
fn block_view<'a, T>(
    inp: &PolicyInputs<'a, T>,
    r: Range<usize>,
    cu: &'a [usize; 2],
) -> PolicyInputs<'a, T> {
    PolicyInputs {
        lp: &inp.lp[r.clone()],
        old: &inp.old[r.clone()],
        adv: &inp.adv[r.clone()],
        tokens: Tokens::packed(cu, inp.tokens.mask.map(|m| &m[r])),
    }
}
