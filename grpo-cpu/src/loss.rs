//! Multi-threaded per-token policy losses: grpo-core's own loss functions run on blocks of the
//! token batch on the [`Cpu`]'s threads.

use grpo_core::loss::{LossDiagnostics, PolicyInputs, PpoClipConfig, ppo_clip};
use grpo_core::{Real, Result, Tokens};
use std::ops::Range;

use rayon::prelude::*;

use crate::cpu::Cpu;

/// Token positions per parallel task: a block's inputs and outputs (5 × 4096 × 4 B = 80 KiB in
/// f32) stay in L2 between grpo-core's check pass and write pass, and the blocks are small
/// enough that a thread slowed by a neighbour process does not hold up the batch.
pub const LOSS_BLOCK: usize = 4096;

impl Cpu {
    /// [`grpo_core::loss::ppo_clip`] on this executor's threads: the same per-token values and
    /// gradients bit for bit, the same errors, outputs untouched on `Err`.
    ///
    /// Formula (MATH.md §3–§4, \[2602.05494\] unified clipped objective; GRPO
    /// \[arXiv:2402.03300\], DAPO \[arXiv:2503.14476\], ATR-GRPO's KL3 bounds via
    /// [`PpoClipConfig::atr_kl3`]): with `ρ_t = exp(clamp(lp_t − old_t))`,
    /// `L_t = −min(ρ̃_t A_t, clip(ρ_t, lo, hi) A_t)` (`ρ̃_t = min(ρ_t, δ)` under the δ cap),
    /// optionally dual-clipped at `−c·A_t` for `A_t < 0`; `grad[t] = ∂L_t/∂lp_t`. See grpo-core's
    /// rustdoc for every detail: this function does no math of its own.
    ///
    /// How it runs \[ours\]: PPO-clip is a token-level loss (token `t`'s value and gradient read
    /// only `lp[t]`, `old[t]`, `adv[t]`), so the batch is cut into blocks of [`LOSS_BLOCK`]
    /// positions regardless of sequence boundaries, and each block is handed to grpo-core's
    /// `ppo_clip` as a one-segment packed layout over its slice of the mask. Two parallel passes:
    /// the first runs every block into thread-local scratch (it only validates), the second — only
    /// if every block succeeded — runs every block into its own disjoint slice of `value` and
    /// `grad`. If anything fails, grpo-core is called on the whole batch, which returns its own
    /// error and writes nothing, so the error value is exactly grpo-core's.
    ///
    /// Cost: grpo-core itself evaluates each token twice (check, then write), so each token is
    /// evaluated four times here, in grpo-core's scalar code; the speed-up over grpo-core is at
    /// most half the thread count. `grpo-bench loss` measures it against the memory roofline.
    ///
    /// Diagnostics are merged with [`LossDiagnostics::merge`] in block order. All counts and
    /// `ratio_min`/`ratio_max` equal grpo-core's exactly; `kl_sum` is the same sum associated
    /// per block (block sums added left to right), so it may differ from grpo-core's in the last
    /// bits for batches longer than one block. The blocks depend only on the batch length, never
    /// on the thread count, so every result is the same for every pool.
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
    /// let cpu = Cpu::new(Backend::Portable).unwrap().with_threads(2).unwrap();
    /// // Two padded sequences of 2 tokens; the last position is padding (garbage allowed).
    /// let mask = [true, true, true, false];
    /// let inp = PolicyInputs {
    ///     lp: &[0.0f64, 0.5f64.ln(), 0.0, f64::NAN],
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
    /// ```
    pub fn ppo_clip<T: Real + Send + Sync>(
        &self,
        cfg: &PpoClipConfig<T>,
        inp: &PolicyInputs<'_, T>,
        value: &mut [T],
        grad: &mut [T],
    ) -> Result<LossDiagnostics<T>> {
        self.ppo_clip_blocks(cfg, inp, value, grad, LOSS_BLOCK)
    }

    /// [`Cpu::ppo_clip`] with `block` positions per task (`0` is taken as 1), so tests can cut
    /// small batches into many blocks. Not part of the stable API.
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
        let layout_ok = inp.tokens.validate(n).is_ok()
            && [inp.old.len(), inp.adv.len(), value.len(), grad.len()]
                .iter()
                .all(|&len| len == n);
        if !layout_ok || n <= block {
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
        let mut merged: Option<LossDiagnostics<T>> = None;
        for d in diags {
            let d = d?;
            merged = Some(match merged {
                None => d,
                Some(m) => m.merge(d),
            });
        }
        match merged {
            Some(m) => Ok(m),
            // Unreachable (n > block ≥ 1 gives at least one block); grpo-core answers anyway.
            None => ppo_clip(cfg, inp, value, grad),
        }
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
