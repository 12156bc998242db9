//! [`LossKernel`]: per-token policy losses with ∂L/∂lp, KL-to-reference penalties and IS
//! weights (MATH.md §3–4) on the GPU, the same per-element f32 formulas as grpo-core
//! (`shaders/loss.wgsl`).

use bytemuck::{Pod, Zeroable};
use grpo_core::divergence::RatioBounds;
use grpo_core::{Error, Tokens};

use crate::context::{Arg, GpuContext};
use crate::error::{Result, check_len, ensure};
use crate::shaders::ShaderId;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Default)]
struct LossParams {
    n: u32,
    kind: u32,
    flags: u32,
    seqs: u32,
    lo: f32,
    hi: f32,
    clamp: f32,
    dual_c: f32,
    delta: f32,
    tau_pos: f32,
    tau_neg: f32,
    out_clamp: f32,
}

const FLAG_CLAMP_LOG_RATIO: u32 = 1;
const FLAG_DUAL_CLIP: u32 = 2;
const FLAG_DELTA_CAP: u32 = 4;
const FLAG_KL_OUT_CLAMP: u32 = 8;

/// A per-token policy loss (MATH.md §4). `x = lp − old`, `ρ = e^x` (after the log-ratio clamp).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum PolicyLoss {
    /// PPO-clip / GRPO / DAPO / ATR-GRPO: `L = −min(ρA, clip(ρ)A)` with `bounds` (symmetric,
    /// asymmetric or KL3 from [`RatioBounds`]); optional dual-clip `c` (for A < 0:
    /// `min(L, −cA)`) and two-sided δ cap (`ρ ← min(ρ, δ)`).
    PpoClip {
        /// Clip region.
        bounds: RatioBounds<f32>,
        /// Dual-clip constant c > 1 [verl, OpenRLHF].
        dual_clip: Option<f32>,
        /// δ cap [TRL delta, INTELLECT-2].
        delta_cap: Option<f32>,
    },
    /// CISPO, verl: `L = −sg(clamp(ρ, lo, hi))·A·lp`.
    CispoVerl {
        /// The clamp interval.
        bounds: RatioBounds<f32>,
    },
    /// CISPO, TRL: `L = −sg(min(ρ, ε_max))·A·lp`.
    CispoTrl {
        /// The absolute cap ε_max.
        eps_max: f32,
    },
    /// SAPO: `L = −σ(τ(ρ − 1))·(4/τ)·A`, τ = τ_pos if A > 0 else τ_neg (1.0 / 1.05).
    Sapo {
        /// τ for A > 0.
        tau_pos: f32,
        /// τ for A ≤ 0.
        tau_neg: f32,
    },
    /// REINFORCE / GPG / RGRA: `L = −A·lp`.
    Reinforce,
    /// P3O / ESS-adaptive [2605.12380]: `ESS = (Σρ)²/(n(Σρ² + 1e-8))` over all valid tokens,
    /// `L = −sg(min(ρ, ESS))·A·lp + (1 − ESS)·(e^{−x} − 1 + x)`; ESS = 1 with no token.
    P3o,
    /// GSPO-token [verl]: `log r_t = lp − sg(lp) + sg(mean_t x)` capped at 10, token-level clip.
    GspoToken {
        /// Clip region.
        bounds: RatioBounds<f32>,
    },
    /// GSPO (sequence) [TRL, OpenRLHF]: `s_i = exp(mean_t x)`, `L = −min(s_i A, clip(s_i)A)`
    /// reported on every valid token of the sequence; the gradient flows through the mean
    /// (`∂s_i/∂lp_t = s_i/|y_i|`).
    Gspo {
        /// Clip region.
        bounds: RatioBounds<f32>,
    },
}

/// A KL-to-reference penalty estimator (MATH.md §3), `d = lp − ref`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlEstimator {
    /// `k1 = d`.
    K1,
    /// `|d|`.
    Abs,
    /// `k2 = d²/2`.
    K2,
    /// `k3 = e^{−d} + d − 1` (input clamped to ±C when a log-ratio clamp is set).
    K3,
}

/// An importance-sampling correction (rollout engine ≠ trainer): `w = e^{old − roll}`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum IsCorrection {
    /// `min(w, cap)`.
    Truncate {
        /// The cap.
        cap: f32,
    },
    /// `w` inside `[lo, hi]`, 0 outside.
    Mask {
        /// Lower bound.
        lo: f32,
        /// Upper bound.
        hi: f32,
    },
}

/// What a policy-loss dispatch reports besides values and gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LossDiagnostics {
    /// Valid tokens.
    pub valid: usize,
    /// Tokens whose clipped branch won with ρ below the lower bound.
    pub clipped_low: usize,
    /// Tokens whose clipped branch won with ρ above the upper bound.
    pub clipped_high: usize,
    /// Tokens where the dual-clip bound won.
    pub dual_clipped: usize,
}

/// The loss kernels (`shaders/loss.wgsl`) on one [`GpuContext`].
#[derive(Debug, Clone, Copy)]
pub struct LossKernel<'c> {
    ctx: &'c GpuContext,
}

struct Layout {
    seqs: usize,
    offsets: Vec<u32>,
    mask: Vec<u32>,
    valid: usize,
}

impl<'c> LossKernel<'c> {
    /// The kernels on `ctx`.
    pub fn new(ctx: &'c GpuContext) -> Self {
        LossKernel { ctx }
    }

    fn layout(tokens: &Tokens<'_>, n: usize) -> Result<Layout> {
        let seqs = tokens.validate(n)?;
        let mut offsets = Vec::with_capacity(seqs + 1);
        offsets.push(0u32);
        for i in 0..seqs {
            offsets.push(tokens.span(i).end as u32);
        }
        let mask: Vec<u32> = (0..n).map(|t| tokens.is_valid(t) as u32).collect();
        let valid = mask.iter().filter(|&&m| m != 0).count();
        Ok(Layout {
            seqs,
            offsets,
            mask,
            valid,
        })
    }

    fn check_finite(tokens: &Tokens<'_>, what: &'static str, v: &[f32]) -> Result<()> {
        match tokens.first_non_finite(v) {
            Some(index) => Err(Error::NonFinite { what, index }.into()),
            None => Ok(()),
        }
    }

    fn clamp_flags(clamp: Option<f32>) -> Result<(u32, f32)> {
        match clamp {
            Some(c) => {
                ensure(c.is_finite() && c > 0.0, "log_ratio_clamp", "must be finite and > 0")?;
                Ok((FLAG_CLAMP_LOG_RATIO, c))
            }
            None => Ok((0, 0.0)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &self,
        a: &[f32],
        b: &[f32],
        adv: &[f32],
        lay: &Layout,
        params: LossParams,
        passes: &[(&'static str, [u32; 3])],
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics> {
        let n = a.len();
        let counters = (6 + 2 * lay.seqs) * 4;
        let res = self.ctx.run(
            ShaderId::Loss,
            &[
                (0, Arg::In(bytemuck::cast_slice(a))),
                (1, Arg::In(bytemuck::cast_slice(b))),
                (2, Arg::In(bytemuck::cast_slice(adv))),
                (3, Arg::In(bytemuck::cast_slice(&lay.mask))),
                (4, Arg::Uniform(bytemuck::bytes_of(&params))),
                (5, Arg::Out((n * 4) as u64)),
                (6, Arg::Out((n * 4) as u64)),
                (7, Arg::Out(counters as u64)),
                (8, Arg::In(bytemuck::cast_slice(&lay.offsets))),
            ],
            passes,
        )?;
        let v: &[f32] = bytemuck::cast_slice(&res[0]);
        let g: &[f32] = bytemuck::cast_slice(&res[1]);
        let c: &[u32] = bytemuck::cast_slice(&res[2]);
        value.copy_from_slice(&v[..n]);
        grad.copy_from_slice(&g[..n]);
        Ok(LossDiagnostics {
            valid: c[3] as usize,
            clipped_low: c[0] as usize,
            clipped_high: c[1] as usize,
            dual_clipped: c[2] as usize,
        })
    }

    fn per_token_groups(n: usize) -> [u32; 3] {
        [(n as u32).div_ceil(256), 1, 1]
    }

    /// Per-token value and ∂L/∂lp of a policy loss. Masked tokens get 0 and 0 (and may hold
    /// garbage). `log_ratio_clamp`: `Some(20.0)` for verl/OpenRLHF, `None` for TRL.
    ///
    /// # Errors
    /// grpo-core's: lengths, layout, non-finite valid `lp`/`old`/`adv`, bad parameters.
    #[allow(clippy::too_many_arguments)]
    pub fn policy(
        &self,
        loss: &PolicyLoss,
        log_ratio_clamp: Option<f32>,
        lp: &[f32],
        old: &[f32],
        adv: &[f32],
        tokens: &Tokens<'_>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics> {
        let n = lp.len();
        check_len("old", n, old.len())?;
        check_len("adv", n, adv.len())?;
        check_len("value", n, value.len())?;
        check_len("grad", n, grad.len())?;
        let lay = Self::layout(tokens, n)?;
        Self::check_finite(tokens, "lp", lp)?;
        Self::check_finite(tokens, "old", old)?;
        Self::check_finite(tokens, "adv", adv)?;
        let (flags, clamp) = Self::clamp_flags(log_ratio_clamp)?;
        let mut p = LossParams {
            n: n as u32,
            flags,
            clamp,
            seqs: lay.seqs as u32,
            ..Default::default()
        };
        let mut passes: Vec<(&'static str, [u32; 3])> = Vec::new();
        match *loss {
            PolicyLoss::PpoClip {
                bounds,
                dual_clip,
                delta_cap,
            } => {
                p.kind = 0;
                (p.lo, p.hi) = (bounds.lo, bounds.hi);
                if let Some(c) = dual_clip {
                    ensure(c > 1.0 && c.is_finite(), "dual_clip", "must be finite and > 1")?;
                    p.flags |= FLAG_DUAL_CLIP;
                    p.dual_c = c;
                }
                if let Some(d) = delta_cap {
                    ensure(d > 1.0 && d.is_finite(), "delta_cap", "must be finite and > 1")?;
                    p.flags |= FLAG_DELTA_CAP;
                    p.delta = d;
                }
            }
            PolicyLoss::CispoVerl { bounds } => {
                p.kind = 1;
                (p.lo, p.hi) = (bounds.lo, bounds.hi);
            }
            PolicyLoss::CispoTrl { eps_max } => {
                ensure(eps_max.is_finite() && eps_max > 0.0, "eps_max", "must be finite and > 0")?;
                p.kind = 2;
                p.hi = eps_max;
            }
            PolicyLoss::Sapo { tau_pos, tau_neg } => {
                ensure(tau_pos.is_finite() && tau_pos > 0.0, "tau_pos", "must be finite and > 0")?;
                ensure(tau_neg.is_finite() && tau_neg > 0.0, "tau_neg", "must be finite and > 0")?;
                p.kind = 3;
                p.tau_pos = tau_pos;
                p.tau_neg = tau_neg;
            }
            PolicyLoss::Reinforce => p.kind = 4,
            PolicyLoss::P3o => {
                p.kind = 5;
                p.seqs = lay.valid as u32;
                passes.push(("reduce", [1, 1, 1]));
            }
            PolicyLoss::GspoToken { bounds } => {
                p.kind = 6;
                (p.lo, p.hi) = (bounds.lo, bounds.hi);
                p.out_clamp = 10.0;
                passes.push(("seq_mean", [(lay.seqs as u32).div_ceil(64), 1, 1]));
            }
            PolicyLoss::Gspo { bounds } => {
                p.kind = 7;
                (p.lo, p.hi) = (bounds.lo, bounds.hi);
                for i in 0..lay.seqs {
                    if tokens.valid_count(i) == 0 {
                        return Err(Error::EmptySegment { segment: i }.into());
                    }
                }
                passes.push(("seq_mean", [(lay.seqs as u32).div_ceil(64), 1, 1]));
            }
        }
        passes.push(("per_token", Self::per_token_groups(n)));
        let (mut v, mut g) = (vec![0f32; n], vec![0f32; n]);
        let d = self.dispatch(lp, old, adv, &lay, p, &passes, &mut v, &mut g)?;
        value.copy_from_slice(&v);
        grad.copy_from_slice(&g);
        Ok(d)
    }

    /// Per-token KL-to-reference penalty and its gradient w.r.t. lp (MATH.md §3).
    /// `input_clamp` (±20 in verl) applies to k3's exponent; `output_clamp` (±10 in
    /// verl/OpenRLHF) clamps the value (gradient 0 where it binds).
    ///
    /// # Errors
    /// grpo-core's: lengths, layout, non-finite valid `lp`/`reference`, bad clamps.
    #[allow(clippy::too_many_arguments)]
    pub fn kl_penalty(
        &self,
        estimator: KlEstimator,
        input_clamp: Option<f32>,
        output_clamp: Option<f32>,
        lp: &[f32],
        reference: &[f32],
        tokens: &Tokens<'_>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<()> {
        let n = lp.len();
        check_len("reference", n, reference.len())?;
        check_len("value", n, value.len())?;
        check_len("grad", n, grad.len())?;
        let lay = Self::layout(tokens, n)?;
        Self::check_finite(tokens, "lp", lp)?;
        Self::check_finite(tokens, "reference", reference)?;
        let (mut flags, clamp) = Self::clamp_flags(input_clamp)?;
        let mut out_clamp = 0.0;
        if let Some(c) = output_clamp {
            ensure(c.is_finite() && c > 0.0, "output_clamp", "must be finite and > 0")?;
            flags |= FLAG_KL_OUT_CLAMP;
            out_clamp = c;
        }
        let p = LossParams {
            n: n as u32,
            kind: match estimator {
                KlEstimator::K1 => 8,
                KlEstimator::Abs => 9,
                KlEstimator::K2 => 10,
                KlEstimator::K3 => 11,
            },
            flags,
            clamp,
            out_clamp,
            seqs: lay.seqs as u32,
            ..Default::default()
        };
        let zeros = vec![0f32; n];
        let (mut v, mut g) = (vec![0f32; n], vec![0f32; n]);
        self.dispatch(lp, reference, &zeros, &lay, p, &[("per_token", Self::per_token_groups(n))], &mut v, &mut g)?;
        value.copy_from_slice(&v);
        grad.copy_from_slice(&g);
        Ok(())
    }

    /// Token-level IS weights `w = e^{old − roll}` (log-ratio clamp applied first when given),
    /// truncated or masked (MATH.md §4). Masked tokens get 0.
    ///
    /// # Errors
    /// grpo-core's: lengths, layout, non-finite valid inputs, bad bounds.
    pub fn is_weights(
        &self,
        correction: IsCorrection,
        log_ratio_clamp: Option<f32>,
        old: &[f32],
        roll: &[f32],
        tokens: &Tokens<'_>,
        weights: &mut [f32],
    ) -> Result<()> {
        let n = old.len();
        check_len("roll", n, roll.len())?;
        check_len("weights", n, weights.len())?;
        let lay = Self::layout(tokens, n)?;
        Self::check_finite(tokens, "old", old)?;
        Self::check_finite(tokens, "roll", roll)?;
        let (flags, clamp) = Self::clamp_flags(log_ratio_clamp)?;
        let mut p = LossParams {
            n: n as u32,
            flags,
            clamp,
            seqs: lay.seqs as u32,
            ..Default::default()
        };
        match correction {
            IsCorrection::Truncate { cap } => {
                ensure(cap.is_finite() && cap > 0.0, "cap", "must be finite and > 0")?;
                p.kind = 12;
                p.hi = cap;
            }
            IsCorrection::Mask { lo, hi } => {
                ensure(lo.is_finite() && hi.is_finite() && lo >= 0.0 && lo <= hi, "lo", "need 0 <= lo <= hi, finite")?;
                p.kind = 13;
                p.lo = lo;
                p.hi = hi;
            }
        }
        let zeros = vec![0f32; n];
        let (mut v, mut g) = (vec![0f32; n], vec![0f32; n]);
        self.dispatch(old, roll, &zeros, &lay, p, &[("per_token", Self::per_token_groups(n))], &mut v, &mut g)?;
        weights.copy_from_slice(&v);
        Ok(())
    }
}
