//! [`LossKernel`]: per-token policy losses with ∂L/∂lp and KL-to-reference penalties
//! (MATH.md §3–4) on the GPU, the same per-element f32 operations as grpo-core
//! (`shaders/loss.wgsl`), configured by grpo-core's own config structs.
//!
//! Validation runs on the host in grpo-core's order with its error variants; after readback the
//! outputs are checked for finiteness as grpo-core's driver does (`"loss value"`,
//! `"loss gradient"`), and the diagnostics are assembled in grpo-core's token order (the
//! ratio statistics and approximate KL from the same f32 formulas grpo-core uses).
//!
//! The rollout-correction masks ([`LossKernel::rejection_mask`],
//! [`LossKernel::off_policy_sequence_mask`]) reduce each sequence on the GPU in grpo-core's token
//! order and finish the O(sequences) comparisons on the host, where a mean is divided exactly as
//! grpo-core divides it.

use bytemuck::{Pod, Zeroable};
use grpo_core::aggregate::{AggConfig, Denominator, sequence_weights};
use grpo_core::divergence::measures::TokenDiagnostics;
use grpo_core::divergence::{KlEstimator, KlPenaltyConfig, RatioBounds};
use grpo_core::is_correction::{
    IS_NORMALIZE_MIN_MEAN, IsConfig, IsDiagnostics, IsFilter, IsLevel, RejectLevel, RejectStat,
    RejectionCriterion, RejectionDiagnostics,
};
use grpo_core::loss::{
    CispoConfig, CispoWeight, EssStats, GspoConfig, GspoTokenConfig, LossDiagnostics, LossLevel,
    P3oConfig, PolicyInputs, PpoClipConfig, SapoConfig,
};
use grpo_core::vocab::canon::CanonicalSum;
use grpo_core::{Error, Real, Tokens};

use crate::context::{Arg, GpuContext, Resident};
use crate::error::{Result, check_len};
use crate::shaders::ShaderId;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable, Default)]
struct LossParams {
    n: u32,
    kind: u32,
    flags: u32,
    /// Number of sequences (reductions).
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

// The WGSL `LossParams` has the same twelve 4-byte fields in the same order (48 bytes, a multiple
// of 16 as a uniform needs); tests/tests/wgpu_shaders.rs checks the WGSL side.
const _: () = assert!(size_of::<LossParams>() == 48);

const KIND_PPO: u32 = 0;
const KIND_CISPO_CLAMP: u32 = 1;
const KIND_CISPO_CAP: u32 = 2;
const KIND_SAPO: u32 = 3;
const KIND_REINFORCE: u32 = 4;
const KIND_GSPO: u32 = 5;
const KIND_GSPO_TOKEN: u32 = 6;
const KIND_P3O: u32 = 7;
const KIND_IS_TOKEN: u32 = 12;
const KIND_IS_SEQ: u32 = 13;
const KIND_K1: u32 = 8;
const KIND_ABS: u32 = 9;
const KIND_K2: u32 = 10;
const KIND_K3: u32 = 11;
const KIND_K3_IS: u32 = 14;
const KIND_K1_ST: u32 = 15;
const KIND_K3_ST: u32 = 16;
const KIND_IS_GEO: u32 = 17;
const FLAG_CLAMP_LOG_RATIO: u32 = 1;
const FLAG_DUAL_CLIP: u32 = 2;
const FLAG_DELTA_CAP: u32 = 4;
const FLAG_KL_OUT_CLAMP: u32 = 8;
const FLAG_WEIGHTS: u32 = 16;
const FLAG_IS_TRUNCATE: u32 = 32;
const FLAG_IS_MASK: u32 = 64;
const FLAG_IS_GEO_MASK: u32 = 128;
/// divergence::measures::exp_guard in f32 (ln(f32::MAX)/2 − 1), as loss.wgsl's EXP_GUARD_BITS.
const EXP_GUARD_BITS: u32 = 0x422d7218;
const EV_CLAMPED: u32 = 1;
const EV_CLIP_LOW: u32 = 2;
const EV_CLIP_HIGH: u32 = 4;
const EV_DUAL: u32 = 8;
const EV_CAPPED: u32 = 16;
const EV_OUT_CLAMPED: u32 = 32;

/// The loss kernels (`shaders/loss.wgsl`) on one [`GpuContext`].
///
/// Every operation returns grpo-core's error for an invalid input; besides those, a batch beyond
/// the device's limits is [`crate::GpuError::TooLarge`] (a buffer over the storage-binding
/// limit) or [`crate::GpuError::TooManyWorkgroups`] (more workgroups than one 2-D dispatch
/// holds), and a device failure [`crate::GpuError::Device`]. Outputs are untouched on `Err`.
#[derive(Debug, Clone, Copy)]
pub struct LossKernel<'c> {
    ctx: &'c GpuContext,
}

/// An empty batch: grpo-core's loss functions validate their config before their inputs, so
/// calling them on it returns exactly grpo-core's config error (or `Ok` with nothing computed).
/// This keeps config validation identical to grpo-core's by construction.
const EMPTY_CU: [usize; 1] = [0];

fn empty_inputs() -> PolicyInputs<'static, f32> {
    PolicyInputs {
        lp: &[],
        old: &[],
        adv: &[],
        tokens: Tokens::packed(&EMPTY_CU, None),
    }
}

fn for_each_valid(tokens: &Tokens<'_>, mut f: impl FnMut(usize) -> Result<()>) -> Result<()> {
    for i in 0..tokens.num_sequences() {
        for t in tokens.valid_positions(i) {
            f(t)?;
        }
    }
    Ok(())
}

/// loss::validate_inputs.
fn validate_inputs(inp: &PolicyInputs<'_, f32>, value_len: usize, grad_len: usize) -> Result<()> {
    let n = inp.lp.len();
    inp.tokens.validate(n)?;
    check_len("old", n, inp.old.len())?;
    check_len("adv", n, inp.adv.len())?;
    check_len("value", n, value_len)?;
    check_len("grad", n, grad_len)?;
    for_each_valid(&inp.tokens, |t| {
        let bad = |what| Err(Error::NonFinite { what, index: t }.into());
        if !inp.lp[t].is_finite() {
            return bad("lp");
        }
        if !inp.old[t].is_finite() {
            return bad("old");
        }
        if !inp.adv[t].is_finite() {
            return bad("adv");
        }
        if !(inp.lp[t] - inp.old[t]).is_finite() {
            return bad("lp - old");
        }
        Ok(())
    })
}

/// loss::validate_aux.
fn validate_aux(tokens: &Tokens<'_>, what: &'static str, n: usize, v: &[f32]) -> Result<()> {
    check_len(what, n, v.len())?;
    for_each_valid(tokens, |t| {
        if v[t].is_finite() {
            Ok(())
        } else {
            Err(Error::NonFinite { what, index: t }.into())
        }
    })
}

fn clamp_flag(c: Option<f32>) -> (u32, f32) {
    c.map_or((0, 0.0), |c| (FLAG_CLAMP_LOG_RATIO, c))
}

struct Outputs {
    value: Vec<f32>,
    grad: Vec<f32>,
    events: Vec<u32>,
}

impl<'c> LossKernel<'c> {
    /// The kernels on `ctx`.
    pub fn new(ctx: &'c GpuContext) -> Self {
        LossKernel { ctx }
    }

    fn dispatch(
        &self,
        lp: &[f32],
        b: &[f32],
        adv: &[f32],
        tokens: &Tokens<'_>,
        params: LossParams,
    ) -> Result<Outputs> {
        let n = lp.len();
        self.ctx.check_items("tokens", n)?;
        let mask: Vec<u32> = (0..n).map(|t| tokens.is_valid(t) as u32).collect();
        let res = self.ctx.run(
            ShaderId::Loss,
            &[
                (0, Arg::In(bytemuck::cast_slice(lp))),
                (1, Arg::In(bytemuck::cast_slice(b))),
                (2, Arg::In(bytemuck::cast_slice(adv))),
                (3, Arg::InOut(bytemuck::cast_slice(&mask))),
                (4, Arg::Uniform(bytemuck::bytes_of(&params))),
                (5, Arg::Out((n * 4) as u64)),
                (6, Arg::Out((n * 4) as u64)),
            ],
            &[("per_token", self.ctx.grid(n, 256)?)],
        )?;
        let flags: &[u32] = bytemuck::cast_slice(&res[0]);
        let value: &[f32] = bytemuck::cast_slice(&res[1]);
        let grad: &[f32] = bytemuck::cast_slice(&res[2]);
        Ok(Outputs {
            value: value[..n].to_vec(),
            grad: grad[..n].to_vec(),
            events: flags[..n].iter().map(|f| f >> 1).collect(),
        })
    }

    /// loss::drive's second half: finiteness in token order, diagnostics, then the writes.
    fn finish(
        o: Outputs,
        level: LossLevel,
        tokens: &Tokens<'_>,
        ratio_of: Option<&dyn Fn(usize) -> (f32, f32)>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics<f32>> {
        let mut d = LossDiagnostics::empty(level);
        // grpo-core's association of `kl_sum` (valid positions pushed in increasing order).
        let mut kl = CanonicalSum::new(o.value.len());
        for_each_valid(tokens, |t| {
            if !o.value[t].is_finite() {
                return Err(Error::NonFinite {
                    what: "loss value",
                    index: t,
                }
                .into());
            }
            if !o.grad[t].is_finite() {
                return Err(Error::NonFinite {
                    what: "loss gradient",
                    index: t,
                }
                .into());
            }
            let ev = o.events[t];
            d.tokens += 1;
            d.clipped_low += (ev & EV_CLIP_LOW != 0) as usize;
            d.clipped_high += (ev & EV_CLIP_HIGH != 0) as usize;
            d.dual_clipped += (ev & EV_DUAL != 0) as usize;
            d.delta_capped += (ev & EV_CAPPED != 0) as usize;
            d.clamped += (ev & EV_CLAMPED != 0) as usize;
            if let Some(f) = ratio_of {
                let (x, rho) = f(t);
                kl.push(t, -x);
                d.ratio_min = Real::min(d.ratio_min, rho);
                d.ratio_max = Real::max(d.ratio_max, rho);
            }
            Ok(())
        })?;
        d.kl_sum = kl.finish();
        value.copy_from_slice(&o.value);
        grad.copy_from_slice(&o.grad);
        Ok(d)
    }

    fn ratio_loss(
        &self,
        p: LossParams,
        clamp: Option<f32>,
        inp: &PolicyInputs<'_, f32>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics<f32>> {
        let o = self.dispatch(inp.lp, inp.old, inp.adv, &inp.tokens, p)?;
        // x after the clamp and ρ = e^x exactly as grpo-core computes them (its diagnostics).
        let ratio = |t: usize| {
            let mut x = inp.lp[t] - inp.old[t];
            if let Some(c) = clamp {
                if x > c {
                    x = c;
                } else if x < -c {
                    x = -c;
                }
            }
            (x, Real::exp(x))
        };
        Self::finish(o, LossLevel::Token, &inp.tokens, Some(&ratio), value, grad)
    }

    /// PPO-clip (GRPO, DAPO clip-higher, ATR-GRPO with `RatioBounds::kl3`, dual-clip, δ cap),
    /// grpo-core's [`grpo_core::loss::ppo_clip`]: `L = −min(ρA, clip(ρ)A)`.
    ///
    /// ```
    /// use grpo_core::loss::{PolicyInputs, PpoClipConfig};
    /// use grpo_core::{Preset, Tokens};
    /// use grpo_wgpu::{GpuContext, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // x = lp − old, A, bounds [0.8, 1.2]:
    /// // x = 0.5, A = 1: ρ = e^{0.5} = 1.6487213 > 1.2 → L = −1.2, gradient 0 (clipped high);
    /// // x = 0.1, A = 1: ρ = e^{0.1} = 1.1051709 inside → L = ∂L/∂lp = −A·ρ = −1.1051709;
    /// // x = −0.5, A = −2: ρ = 0.6065307 < 0.8 → L = −min(−2ρ, −2·0.8) = 1.6, gradient 0
    /// // (clipped low);
    /// // x = 2, A = −1: ρ = e² = 7.3890561 > 1.2 but A < 0: L = −min(−ρ, −1.2) = ρ,
    /// // ∂L/∂lp = −A·ρ = ρ.
    /// let lp = [0.5f32, 0.1, -0.5, 2.0];
    /// let old = [0.0f32; 4];
    /// let adv = [1.0f32, 1.0, -2.0, -1.0];
    /// let tokens = Tokens::padded(1, 4, None);
    /// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens };
    /// let (mut v, mut g) = ([0.0f32; 4], [0.0f32; 4]);
    /// let d = k.ppo_clip(&PpoClipConfig::default(), &inp, &mut v, &mut g)?;
    /// assert!((v[0] + 1.2).abs() < 1e-6 && g[0] == 0.0);
    /// assert!((v[1] + 1.1051709).abs() < 1e-6 && (g[1] + 1.1051709).abs() < 1e-6);
    /// assert!((v[2] - 1.6).abs() < 1e-6 && g[2] == 0.0);
    /// assert!((v[3] - 7.3890561).abs() < 1e-5 && (g[3] - 7.3890561).abs() < 1e-5);
    /// assert_eq!((d.clipped_high, d.clipped_low, d.dual_clipped), (1, 1, 0));
    /// // verl adds dual-clip c = 3: the last token's L = min(ρ, −c·A) = 3, gradient 0.
    /// let verl = PpoClipConfig::from_preset(Preset::Verl);
    /// let d = k.ppo_clip(&verl, &inp, &mut v, &mut g)?;
    /// assert_eq!((v[3], g[3], d.dual_clipped), (3.0, 0.0, 1));
    /// // A dual-clip constant ≤ 1 is grpo-core's error; nothing is written.
    /// let bad = PpoClipConfig { dual_clip: Some(1.0), ..verl };
    /// assert!(k.ppo_clip(&bad, &inp, &mut v, &mut g).is_err());
    /// assert_eq!((v[3], g[3]), (3.0, 0.0));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input.
    pub fn ppo_clip(
        &self,
        cfg: &PpoClipConfig<f32>,
        inp: &PolicyInputs<'_, f32>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics<f32>> {
        grpo_core::loss::ppo_clip(cfg, &empty_inputs(), &mut [], &mut [])?;
        validate_inputs(inp, value.len(), grad.len())?;
        let p = Self::ppo_params(cfg, inp.lp.len());
        self.ratio_loss(p, cfg.log_ratio_clamp, inp, value, grad)
    }

    fn ppo_params(cfg: &PpoClipConfig<f32>, n: usize) -> LossParams {
        Self::clip_params(
            KIND_PPO,
            n,
            cfg.bounds,
            cfg.dual_clip,
            cfg.delta_cap,
            cfg.log_ratio_clamp,
        )
    }

    /// The parameters of the shader's `ppo_core` (bounds, dual-clip, δ cap) and the log-ratio
    /// clamp, for PPO-clip (`KIND_PPO`) and GSPO (`KIND_GSPO`, the clamp on the mean).
    fn clip_params(
        kind: u32,
        n: usize,
        bounds: RatioBounds<f32>,
        dual_clip: Option<f32>,
        delta_cap: Option<f32>,
        log_ratio_clamp: Option<f32>,
    ) -> LossParams {
        let (mut flags, clamp) = clamp_flag(log_ratio_clamp);
        let mut p = LossParams {
            n: n as u32,
            kind,
            lo: bounds.lo,
            hi: bounds.hi,
            clamp,
            ..Default::default()
        };
        if let Some(c) = dual_clip {
            flags |= FLAG_DUAL_CLIP;
            p.dual_c = c;
        }
        if let Some(d) = delta_cap {
            flags |= FLAG_DELTA_CAP;
            p.delta = d;
        }
        p.flags = flags;
        p
    }

    /// Benchmark hook: [`LossKernel::ppo_clip`]'s per-token dispatch (value, gradient and event
    /// flags of every token) over inputs uploaded once; each [`Resident::run`] times only the
    /// kernel (no upload, readback, finiteness check or diagnostics). The kernel reads lp, old,
    /// adv and the mask word and writes value, gradient and the flags word of every token.
    ///
    /// # Errors
    /// grpo-core's for the same input; [`crate::GpuError::TooLarge`] or
    /// [`crate::GpuError::TooManyWorkgroups`] over the device limits.
    #[doc(hidden)]
    pub fn resident_ppo_clip(
        &self,
        cfg: &PpoClipConfig<f32>,
        inp: &PolicyInputs<'_, f32>,
    ) -> Result<Resident<'c>> {
        grpo_core::loss::ppo_clip(cfg, &empty_inputs(), &mut [], &mut [])?;
        let n = inp.lp.len();
        validate_inputs(inp, n, n)?;
        self.ctx.check_items("tokens", n)?;
        let p = Self::ppo_params(cfg, n);
        let mask: Vec<u32> = (0..n).map(|t| inp.tokens.is_valid(t) as u32).collect();
        self.ctx.resident(
            ShaderId::Loss,
            &[
                (0, Arg::In(bytemuck::cast_slice(inp.lp))),
                (1, Arg::In(bytemuck::cast_slice(inp.old))),
                (2, Arg::In(bytemuck::cast_slice(inp.adv))),
                (3, Arg::InOut(bytemuck::cast_slice(&mask))),
                (4, Arg::Uniform(bytemuck::bytes_of(&p))),
                (5, Arg::Out((n * 4) as u64)),
                (6, Arg::Out((n * 4) as u64)),
            ],
            &[("per_token", self.ctx.grid(n, 256)?)],
        )
    }

    /// CISPO, grpo-core's [`grpo_core::loss::cispo`]: `L = −sg(w)·A·lp` with
    /// `w = clamp(ρ, lo, hi)` (verl) or `min(ρ, ε_max)` (TRL).
    ///
    /// ```
    /// use grpo_core::loss::{CispoConfig, CispoWeight, PolicyInputs};
    /// use grpo_core::Tokens;
    /// use grpo_wgpu::{GpuContext, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // verl's w = clamp(ρ, 0.8, 1.2); every token keeps its gradient −w·A:
    /// // x = 0.5, A = 1: ρ = 1.6487213 → w = 1.2, L = −1.2·(−0.5) = 0.6, ∂L/∂lp = −1.2;
    /// // x = −0.1, A = 2: w = ρ = e^{−0.1} = 0.9048374, L = −2w·(−1) = 1.8096748,
    /// // ∂L/∂lp = −1.8096748;
    /// // x = −1, A = −1: ρ = 0.3678794 → w = 0.8, L = −0.8·(−1)·(−2) = −1.6, ∂L/∂lp = 0.8.
    /// let lp = [-0.5f32, -1.0, -2.0];
    /// let old = [-1.0f32, -0.9, -1.0];
    /// let adv = [1.0f32, 2.0, -1.0];
    /// let tokens = Tokens::padded(1, 3, None);
    /// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens };
    /// let (mut v, mut g) = ([0.0f32; 3], [0.0f32; 3]);
    /// let d = k.cispo(&CispoConfig::default(), &inp, &mut v, &mut g)?;
    /// let want = ([0.6f32, 1.8096748, -1.6], [-1.2f32, -1.8096748, 0.8]);
    /// assert!((0..3).all(|t| (v[t] - want.0[t]).abs() < 1e-6 && (g[t] - want.1[t]).abs() < 1e-6));
    /// assert_eq!((d.clipped_high, d.clipped_low), (1, 1));
    /// // TRL's absolute cap ε_max = 1: w = min(ρ, 1) = (1, 0.9048374, 0.3678794), ∂L/∂lp = −w·A.
    /// let trl = CispoConfig { weight: CispoWeight::Cap(1.0), log_ratio_clamp: None };
    /// k.cispo(&trl, &inp, &mut v, &mut g)?;
    /// let want = [-1.0f32, -1.8096748, 0.3678794];
    /// assert!((0..3).all(|t| (g[t] - want[t]).abs() < 1e-6));
    /// // A cap that is not > 0 is grpo-core's error; nothing is written.
    /// let bad = CispoConfig { weight: CispoWeight::Cap(0.0), log_ratio_clamp: None };
    /// assert!(k.cispo(&bad, &inp, &mut v, &mut g).is_err());
    /// assert!((g[2] - 0.3678794).abs() < 1e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input.
    pub fn cispo(
        &self,
        cfg: &CispoConfig<f32>,
        inp: &PolicyInputs<'_, f32>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics<f32>> {
        grpo_core::loss::cispo(cfg, &empty_inputs(), &mut [], &mut [])?;
        let (kind, lo, hi) = match cfg.weight {
            CispoWeight::Clamp(b) => (KIND_CISPO_CLAMP, b.lo, b.hi),
            CispoWeight::Cap(c) => (KIND_CISPO_CAP, 0.0, c),
        };
        validate_inputs(inp, value.len(), grad.len())?;
        let (flags, clamp) = clamp_flag(cfg.log_ratio_clamp);
        let p = LossParams {
            n: inp.lp.len() as u32,
            kind,
            flags,
            lo,
            hi,
            clamp,
            ..Default::default()
        };
        self.ratio_loss(p, cfg.log_ratio_clamp, inp, value, grad)
    }

    /// SAPO, grpo-core's [`grpo_core::loss::sapo`]: `L = −σ(τ(ρ − 1))·(4/τ)·A`.
    ///
    /// ```
    /// use grpo_core::loss::{PolicyInputs, SapoConfig};
    /// use grpo_core::Tokens;
    /// use grpo_wgpu::{GpuContext, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // τ = 1 for A > 0, 1.05 otherwise; z = τ(ρ − 1), ∂L/∂lp = −4A·σ(z)(1 − σ(z))·ρ:
    /// // ρ = 1, A = 1: σ(0) = ½ → L = −2, ∂L/∂lp = −4·¼ = −1 (the unclipped objective's −A);
    /// // ρ = 2, A = 1: σ(1) = 0.7310586 → L = −4σ = −2.9242343, ∂L/∂lp = −8σ(1 − σ) = −1.5728955;
    /// // ρ = 2, A = −1: σ(1.05) = 0.7407749 → L = σ·4/1.05 = 2.8219996,
    /// // ∂L/∂lp = 8σ(1 − σ) = 1.5362196.
    /// let lp = [0.0f32, 2f32.ln(), 2f32.ln()];
    /// let old = [0.0f32; 3];
    /// let adv = [1.0f32, 1.0, -1.0];
    /// let tokens = Tokens::padded(1, 3, None);
    /// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens };
    /// let (mut v, mut g) = ([0.0f32; 3], [0.0f32; 3]);
    /// k.sapo(&SapoConfig::default(), &inp, &mut v, &mut g)?;
    /// let want = ([-2.0f32, -2.9242343, 2.8219996], [-1.0f32, -1.5728955, 1.5362196]);
    /// assert!((0..3).all(|t| (v[t] - want.0[t]).abs() < 2e-6 && (g[t] - want.1[t]).abs() < 2e-6));
    /// // A temperature that is not > 0 is grpo-core's error; nothing is written.
    /// let bad = SapoConfig { tau_neg: 0.0, ..SapoConfig::default() };
    /// assert!(k.sapo(&bad, &inp, &mut v, &mut g).is_err());
    /// assert!((v[0] + 2.0).abs() < 2e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input.
    pub fn sapo(
        &self,
        cfg: &SapoConfig<f32>,
        inp: &PolicyInputs<'_, f32>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics<f32>> {
        grpo_core::loss::sapo(cfg, &empty_inputs(), &mut [], &mut [])?;
        validate_inputs(inp, value.len(), grad.len())?;
        let (flags, clamp) = clamp_flag(cfg.log_ratio_clamp);
        let p = LossParams {
            n: inp.lp.len() as u32,
            kind: KIND_SAPO,
            flags,
            clamp,
            tau_pos: cfg.tau_pos,
            tau_neg: cfg.tau_neg,
            ..Default::default()
        };
        self.ratio_loss(p, cfg.log_ratio_clamp, inp, value, grad)
    }

    /// REINFORCE / GPG / RGRA, grpo-core's [`grpo_core::loss::reinforce`]:
    /// `L = −sg(w)·A·lp` (`w = 1` without weights).
    ///
    /// ```
    /// use grpo_core::{Error, Tokens};
    /// use grpo_wgpu::{GpuContext, GpuError, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // w = 1: L = −A·lp = (−2·(−0.5), −(−1)·(−2)) = (1, −2), ∂L/∂lp = −A = (−2, 1); the masked
    /// // position (any value, NaN included) gets 0.
    /// let lp = [-0.5f32, -2.0, f32::NAN];
    /// let adv = [2.0f32, -1.0, 2.0];
    /// let mask = [true, true, false];
    /// let tokens = Tokens::padded(1, 3, Some(&mask));
    /// let (mut v, mut g) = ([9.0f32; 3], [9.0f32; 3]);
    /// k.reinforce(&lp, &adv, None, tokens, &mut v, &mut g)?;
    /// assert_eq!((v, g), ([1.0, -2.0, 0.0], [-2.0, 1.0, 0.0]));
    /// // Detached weights w = (0.5, 1.5): L = (0.5, −3), ∂L/∂lp = −w·A = (−1, 1.5).
    /// let w = [0.5f32, 1.5, f32::NAN];
    /// k.reinforce(&lp, &adv, Some(&w), tokens, &mut v, &mut g)?;
    /// assert_eq!((v, g), ([0.5, -3.0, 0.0], [-1.0, 1.5, 0.0]));
    /// // A NaN weight at a valid position is grpo-core's error; nothing is written.
    /// let bad = [f32::NAN, 1.0, 1.0];
    /// let e = k.reinforce(&lp, &adv, Some(&bad), tokens, &mut v, &mut g);
    /// assert_eq!(e.unwrap_err(), GpuError::Core(Error::NonFinite { what: "weights", index: 0 }));
    /// assert_eq!(v, [0.5, -3.0, 0.0]);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input.
    pub fn reinforce(
        &self,
        lp: &[f32],
        adv: &[f32],
        weights: Option<&[f32]>,
        tokens: Tokens<'_>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics<f32>> {
        let n = lp.len();
        tokens.validate(n)?;
        validate_aux(&tokens, "lp", n, lp)?;
        validate_aux(&tokens, "adv", n, adv)?;
        if let Some(w) = weights {
            validate_aux(&tokens, "weights", n, w)?;
        }
        check_len("value", n, value.len())?;
        check_len("grad", n, grad.len())?;
        let p = LossParams {
            n: n as u32,
            kind: KIND_REINFORCE,
            flags: if weights.is_some() { FLAG_WEIGHTS } else { 0 },
            ..Default::default()
        };
        let o = self.dispatch(lp, weights.unwrap_or(lp), adv, &tokens, p)?;
        Self::finish(o, LossLevel::Token, &tokens, None, value, grad)
    }

    /// KL-to-reference penalty and its gradient w.r.t. lp, grpo-core's
    /// [`grpo_core::divergence::kl_penalty::kl_penalty`] for every [`KlEstimator`]: the same
    /// arguments (`old` in the same position), formulas, clamps, diagnostics and errors.
    ///
    /// With `d = lp − ref` after the input clamp (and `x = lp − old`, likewise, for `K3Is`):
    ///
    /// | [`KlEstimator`] | value | ∂/∂lp |
    /// |---|---|---|
    /// | `K1` | d | 1 |
    /// | `Abs` | \|d\| | sgn d (0 at d = 0) |
    /// | `K2` | d²/2 | d |
    /// | `K3` | k3 = e^{−d} + d − 1 | 1 − e^{−d} |
    /// | `K3Is` | k3·ρ, ρ = e^x | ρ·(1 − e^{−d} + k3) = ρ·d (a limited input drops its term) |
    /// | `K1StraightThrough` (`k1+`) | d | d (unclamped) |
    /// | `K3StraightThrough` (`k3+`) | k3 | d (unclamped) |
    ///
    /// Sources, as grpo-core cites them: k1/k2/k3 are Schulman's estimators ("Approximating KL
    /// divergence", 2020) as used by \[verl\] (`kl_penalty`), \[OpenRLHF\]
    /// (`compute_approx_kl`) and \[TRL\]; `K3Is` is TRL's `use_bias_correction_kl` (k3 times the
    /// token importance ratio π_θ/π_old, the gradient flowing through ρ too); `k1+`/`k3+` report
    /// the estimator's value and train with k2's gradient (`k2 − sg(k2) + sg(k)`), the
    /// documented behaviour of the names verl accepts (MATH.md §3, §6).
    ///
    /// Clamps ([`KlPenaltyConfig`]): the input clamp limits d (and, for `K3Is`, x) to [−c, c],
    /// the output clamp limits the value; the gradient is 0 where a clamp acts, except that
    /// `K3Is` zeroes only the term of the limited input and the straight-through forms keep
    /// their k2 gradient (clamps act on the reported value only). Without an input clamp, d and
    /// x are still limited by grpo-core's overflow guard (±43.36 for the exponential estimators,
    /// ±√f32::MAX for the others), which counts as an input clamp in the diagnostics.
    ///
    /// `old` is read only by `K3Is` (the shader gets it as the third per-token input); for the
    /// other estimators its length is still checked, and its values are ignored. Every valid
    /// position is written, 0 at every other position.
    ///
    /// ```
    /// use grpo_core::divergence::{KlEstimator, KlPenaltyConfig};
    /// use grpo_core::{Preset, Tokens};
    /// use grpo_wgpu::{GpuContext, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// let tokens = Tokens::padded(1, 1, None);
    /// let (mut v, mut g) = ([0.0f32], [0.0f32]);
    /// // d = lp − ref = 0.5, x = lp − old = ln 2: ρ = 2, k3 = e^{−0.5} − 0.5 = 0.1065307,
    /// // value 2·k3, gradient 2·(1 − e^{−0.5} + k3) = 2·0.5 = 1.
    /// let cfg = KlPenaltyConfig::<f32>::from_preset(Preset::Trl, KlEstimator::K3Is);
    /// let old = [-2f32.ln()];
    /// k.kl_penalty(&cfg, &[0.0], &[-0.5], Some(&old), &tokens, &mut v, &mut g)?;
    /// assert!((v[0] - 0.2130613).abs() < 1e-6 && (g[0] - 1.0).abs() < 1e-6);
    /// // k3+ under verl's clamps at d = −25: value clamped to 10, gradient d = −25 all the same.
    /// let cfg = KlPenaltyConfig::<f32>::from_preset(Preset::Verl, KlEstimator::K3StraightThrough);
    /// let d = k.kl_penalty(&cfg, &[-25.0], &[0.0], None, &tokens, &mut v, &mut g)?;
    /// assert_eq!((v[0], g[0]), (10.0, -25.0));
    /// assert_eq!((d.input_clamped, d.output_clamped), (1, 1));
    /// // K3Is without `old` is grpo-core's error; nothing is written.
    /// let cfg = KlPenaltyConfig::<f32>::from_preset(Preset::Trl, KlEstimator::K3Is);
    /// assert!(k.kl_penalty(&cfg, &[0.0], &[0.0], None, &tokens, &mut v, &mut g).is_err());
    /// assert_eq!((v[0], g[0]), (10.0, -25.0));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// grpo-core's, in its order (on `Err` no output is written): `InvalidParam { name:
    /// "input_clamp" | "output_clamp" }` for a clamp that is not finite and > 0; `InvalidParam
    /// { name: "old" }` for `K3Is` without `old`; `LengthMismatch { what: "old" }` when `old` is
    /// given to another estimator with a length other than `lp.len()`; `LengthMismatch` for
    /// `reference` (then `old` with `K3Is`), `value`, `grad`; layout errors of
    /// [`Tokens::validate`]; `NonFinite { what: "lp" | "reference" | "old" }` at the first
    /// NaN/±∞ valid position of each in that order (`old` only with `K3Is`).
    /// [`crate::GpuError::TooLarge`] or [`crate::GpuError::TooManyWorkgroups`] beyond the
    /// device's limits.
    pub fn kl_penalty(
        &self,
        cfg: &KlPenaltyConfig<f32>,
        lp: &[f32],
        reference: &[f32],
        old: Option<&[f32]>,
        tokens: &Tokens<'_>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<TokenDiagnostics<f32>> {
        // grpo-core on an empty batch: its clamp checks, then K3Is's missing `old`, exactly.
        grpo_core::divergence::kl_penalty::kl_penalty(
            cfg,
            &[],
            &[],
            old.map(|_| &[][..]),
            &Tokens::packed(&EMPTY_CU, None),
            &mut [],
            &mut [],
        )?;
        let kind = match cfg.estimator {
            KlEstimator::K1 => KIND_K1,
            KlEstimator::Abs => KIND_ABS,
            KlEstimator::K2 => KIND_K2,
            KlEstimator::K3 => KIND_K3,
            KlEstimator::K3Is => KIND_K3_IS,
            KlEstimator::K1StraightThrough => KIND_K1_ST,
            KlEstimator::K3StraightThrough => KIND_K3_ST,
            // `KlEstimator` is non-exhaustive: a future estimator is not on the GPU until the
            // shader has it.
            _ => {
                return Err(Error::InvalidParam {
                    name: "estimator",
                    reason: "not implemented by grpo-wgpu",
                }
                .into());
            }
        };
        let n = lp.len();
        // divergence::kl_penalty's checks in its order (check_token_inputs after `old`'s length
        // for the estimators that ignore it).
        let is_old = match (cfg.estimator, old) {
            (KlEstimator::K3Is, Some(old)) => Some(old),
            (_, Some(old)) => {
                check_len("old", n, old.len())?;
                None
            }
            (_, None) => None,
        };
        check_len("reference", n, reference.len())?;
        if let Some(old) = is_old {
            check_len("old", n, old.len())?;
        }
        check_len("value", n, value.len())?;
        check_len("grad", n, grad.len())?;
        tokens.validate(n)?;
        let inputs = [("lp", lp), ("reference", reference)];
        for (what, s) in inputs.into_iter().chain(is_old.map(|o| ("old", o))) {
            if let Some(index) = tokens.first_non_finite(s) {
                return Err(Error::NonFinite { what, index }.into());
            }
        }
        // grpo-core ignores a clamp that is not finite and > 0 (validated above: > 0).
        let mut flags = 0;
        let mut p = LossParams {
            n: n as u32,
            kind,
            ..Default::default()
        };
        if let Some(c) = cfg.input_clamp.filter(|c| c.is_finite()) {
            flags |= FLAG_CLAMP_LOG_RATIO;
            p.clamp = c;
        }
        if let Some(c) = cfg.output_clamp.filter(|c| c.is_finite()) {
            flags |= FLAG_KL_OUT_CLAMP;
            p.out_clamp = c;
        }
        p.flags = flags;
        // `old` goes to the third per-token binding; the shader reads it only for K3Is (any
        // slice of length n fills the binding otherwise).
        let o = self.dispatch(lp, reference, is_old.unwrap_or(reference), tokens, p)?;
        let mut d = TokenDiagnostics::default();
        for_each_valid(tokens, |t| {
            d.tokens += 1;
            d.input_clamped += (o.events[t] & EV_CLAMPED != 0) as usize;
            d.output_clamped += (o.events[t] & EV_OUT_CLAMPED != 0) as usize;
            d.mean += (o.value[t] - d.mean) / d.tokens as f32;
            Ok(())
        })?;
        value.copy_from_slice(&o.value);
        grad.copy_from_slice(&o.grad);
        Ok(d)
    }

    /// Aggregation of per-token losses into the scalar that is differentiated, grpo-core's
    /// [`grpo_core::aggregate::aggregate`] (every
    /// [`AggMode`](grpo_core::aggregate::AggMode): token-mean, seq-mean-token-mean,
    /// seq-mean-token-sum, seq-mean-token-sum-norm in Dr. GRPO's and verl's variants, BNPO,
    /// DAPO, LUSPO): `loss = Σ_i w_i·Σ_{t∈i} m_t·L_t` and `weights[t] = w_i·m_t`.
    ///
    /// The per-sequence weights `w_i` are functions of counts and are computed on the host by
    /// grpo-core itself ([`grpo_core::aggregate::sequence_weights`]). The reduction runs in
    /// grpo-core's order: one invocation per sequence sums its valid values in token order and
    /// multiplies by `w_i` (`agg_seq`, which also writes the per-token weights), then one
    /// invocation adds the B products in sequence order (`agg_total`). WGSL rounds `+` and `×`
    /// correctly and the product is stored before it is added (no fused multiply-add is
    /// possible), so the scalar is bit-identical to grpo-core's; the parallelism is over
    /// sequences.
    ///
    /// ```
    /// use grpo_core::aggregate::{AggConfig, AggMode};
    /// use grpo_core::{Preset, Tokens};
    /// use grpo_wgpu::{GpuContext, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // Two rows of width 2: row 0 holds the valid values (1, 3), row 1 holds 5 and padding.
    /// let v = [1.0f32, 3.0, 5.0, f32::NAN];
    /// let mask = [true, true, true, false];
    /// let tokens = Tokens::padded(2, 2, Some(&mask));
    /// let mut w = [9.0f32; 4];
    /// // token-mean: (1 + 3 + 5)/3 = 3, w_t = 1/3 (0 at the padding).
    /// let loss = k.aggregate(&AggConfig::default(), tokens, &v, &mut w)?;
    /// assert!((loss - 3.0).abs() < 1e-6);
    /// assert_eq!(w, [1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0, 0.0]);
    /// // verl's seq-mean-token-mean: ((1 + 3)/2 + 5/1)/2 = 3.5, w = (¼, ¼, ½, 0), exact in f32.
    /// let cfg = AggConfig::from_preset(Preset::Verl, AggMode::SeqMeanTokenMean);
    /// assert_eq!(k.aggregate(&cfg, tokens, &v, &mut w)?, 3.5);
    /// assert_eq!(w, [0.25, 0.25, 0.5, 0.0]);
    /// // Dr. GRPO: Σ/(B·L_max) = 9/(2·2) = 2.25, w_t = ¼.
    /// let dr = AggMode::SeqMeanTokenSumNorm { max_len: None, divide_by_batch: true };
    /// let cfg_dr = AggConfig::from_preset(Preset::Paper, dr);
    /// assert_eq!(k.aggregate(&cfg_dr, tokens, &v, &mut w)?, 2.25);
    /// // A NaN value at a valid position is grpo-core's error; `w` keeps Dr. GRPO's weights.
    /// let bad = [1.0f32, f32::NAN, 5.0, 0.0];
    /// assert!(k.aggregate(&cfg, tokens, &bad, &mut w).is_err());
    /// assert_eq!(w, [0.25, 0.25, 0.25, 0.0]);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input (including `NonFinite { what: "aggregated loss" }`
    /// when the scalar overflows); `weights` is untouched on `Err`.
    pub fn aggregate(
        &self,
        cfg: &AggConfig<f32>,
        tokens: Tokens<'_>,
        values: &[f32],
        weights: &mut [f32],
    ) -> Result<f32> {
        let n = values.len();
        let b = tokens.validate(n)?;
        check_len("weights", n, weights.len())?;
        if let Denominator::PlusEps(e) = cfg.denominator
            && !(e > 0.0 && e.is_finite())
        {
            return Err(Error::InvalidParam {
                name: "denominator eps",
                reason: "must be finite and > 0",
            }
            .into());
        }
        if let Some(index) = tokens.first_non_finite(values) {
            return Err(Error::NonFinite {
                what: "values",
                index,
            }
            .into());
        }
        // grpo-core's own per-sequence weights (its rules, its f32 operations, its errors).
        let mut w = vec![0f32; b];
        sequence_weights(cfg, tokens, n, &mut w)?;
        // Bindings: values in `lp`, w_i in `old`, the mask then the B spans in `flags`, the
        // per-token weights in `value`, the B products then the scalar in `grad`.
        self.ctx
            .check_items("tokens and sequence spans", n + 2 * b)?;
        let words = mask_and_spans(&tokens, n);
        let p = LossParams {
            n: n as u32,
            seqs: b as u32,
            ..Default::default()
        };
        let res = self.ctx.run(
            ShaderId::Loss,
            &[
                (0, Arg::In(bytemuck::cast_slice(values))),
                (1, Arg::In(bytemuck::cast_slice(&w))),
                (3, Arg::In(bytemuck::cast_slice(&words))),
                (4, Arg::Uniform(bytemuck::bytes_of(&p))),
                (5, Arg::Out((n * 4) as u64)),
                (6, Arg::Out(((b + 1) * 4) as u64)),
            ],
            &[
                ("agg_seq", self.ctx.grid(b, 256)?),
                ("agg_total", [1, 1, 1]),
            ],
        )?;
        let out_w: &[f32] = bytemuck::cast_slice(&res[0]);
        let sums: &[f32] = bytemuck::cast_slice(&res[1]);
        let loss = sums[b];
        if !loss.is_finite() {
            return Err(Error::NonFinite {
                what: "aggregated loss",
                index: 0,
            }
            .into());
        }
        weights.copy_from_slice(&out_w[..n]);
        Ok(loss)
    }

    /// The sequence-ratio dispatch: per-token inputs, the mask then the spans in `flags`.
    fn dispatch_seq(
        &self,
        entry: &'static str,
        inp: &PolicyInputs<'_, f32>,
        params: LossParams,
    ) -> Result<Outputs> {
        let (n, tokens) = (inp.lp.len(), &inp.tokens);
        let b = tokens.num_sequences();
        self.ctx
            .check_items("tokens and sequence spans", n + 2 * b)?;
        let words = mask_and_spans(tokens, n);
        let p = LossParams {
            seqs: b as u32,
            ..params
        };
        let res = self.ctx.run(
            ShaderId::Loss,
            &[
                (0, Arg::In(bytemuck::cast_slice(inp.lp))),
                (1, Arg::In(bytemuck::cast_slice(inp.old))),
                (2, Arg::In(bytemuck::cast_slice(inp.adv))),
                (3, Arg::InOut(bytemuck::cast_slice(&words))),
                (4, Arg::Uniform(bytemuck::bytes_of(&p))),
                (5, Arg::Out((n * 4) as u64)),
                (6, Arg::Out((n * 4) as u64)),
            ],
            &[(entry, self.ctx.grid(b, 256)?)],
        )?;
        let flags: &[u32] = bytemuck::cast_slice(&res[0]);
        let value: &[f32] = bytemuck::cast_slice(&res[1]);
        let grad: &[f32] = bytemuck::cast_slice(&res[2]);
        Ok(Outputs {
            value: value[..n].to_vec(),
            grad: grad[..n].to_vec(),
            events: flags[..n].iter().map(|f| f >> 1).collect(),
        })
    }

    /// Every valid token's (x_t, sequence ratio) for the diagnostics, with grpo-core's f32
    /// operations: x̄_i = Σ(lp − old)/n_i in token order, then `ratio(x̄_i)`.
    fn seq_ratios(inp: &PolicyInputs<'_, f32>, ratio: impl Fn(f32) -> f32) -> Vec<(f32, f32)> {
        let tokens = &inp.tokens;
        let mut out = vec![(0.0, 0.0); inp.lp.len()];
        for i in 0..tokens.num_sequences() {
            let (mut sx, mut c) = (0.0f32, 0usize);
            for t in tokens.valid_positions(i) {
                sx += inp.lp[t] - inp.old[t];
                c += 1;
            }
            let r = ratio(sx / c.max(1) as f32);
            for t in tokens.valid_positions(i) {
                out[t] = (inp.lp[t] - inp.old[t], r);
            }
        }
        out
    }

    /// GSPO, sequence form, grpo-core's [`grpo_core::loss::gspo`]:
    /// `s_i = exp(clamp(x̄_i))`, `L_i = −min(min(s_i, δ)·A_i, clip(s_i)·A_i)` (then at most
    /// `−c·A_i` for `A_i < 0` under dual-clip) on every valid
    /// token of sequence `i` when its tokens share the advantage `A_i`, else the mean of that
    /// term over its tokens' own `A_t` (OpenRLHF); `∂L_i/∂lp_t = (∂L_i/∂s_i)·s_i/n_i`. One
    /// invocation per sequence (sums in token order, as grpo-core); [`LossLevel::Sequence`]
    /// diagnostics.
    ///
    /// ```
    /// use grpo_core::loss::{GspoConfig, LossLevel, PolicyInputs};
    /// use grpo_core::Tokens;
    /// use grpo_wgpu::{GpuContext, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // Two sequences of 2 tokens, A = 1, bounds [1 − 3e-4, 1 + 4e-4]:
    /// // x = (0.0002, 0): x̄ = 0.0001, s = e^{0.0001} = 1.0001000 inside → L = −s = −1.0001000
    /// // on both tokens, ∂L/∂lp_t = −A·s/n = −0.5000500;
    /// // x = (0.002, 0): x̄ = 0.001, s = e^{0.001} = 1.0010005 > 1.0004 → L = −1.0004, gradient 0.
    /// let lp = [0.0002f32, 0.0, 0.002, 0.0];
    /// let old = [0.0f32; 4];
    /// let adv = [1.0f32; 4];
    /// let tokens = Tokens::padded(2, 2, None);
    /// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens };
    /// let (mut v, mut g) = ([0.0f32; 4], [0.0f32; 4]);
    /// let d = k.gspo(&GspoConfig::default(), &inp, &mut v, &mut g)?;
    /// assert_eq!(d.level, LossLevel::Sequence);
    /// let want = ([-1.0001f32, -1.0001, -1.0004, -1.0004], [-0.500050f32, -0.500050, 0.0, 0.0]);
    /// assert!((0..4).all(|t| (v[t] - want.0[t]).abs() < 2e-6 && (g[t] - want.1[t]).abs() < 1e-6));
    /// assert_eq!(d.clipped_high, 2);
    /// // A dual-clip constant ≤ 1 is grpo-core's error; nothing is written.
    /// let bad = GspoConfig { dual_clip: Some(1.0), ..GspoConfig::default() };
    /// assert!(k.gspo(&bad, &inp, &mut v, &mut g).is_err());
    /// assert!((v[0] + 1.0001).abs() < 2e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input.
    pub fn gspo(
        &self,
        cfg: &GspoConfig<f32>,
        inp: &PolicyInputs<'_, f32>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics<f32>> {
        grpo_core::loss::gspo(cfg, &empty_inputs(), &mut [], &mut [])?;
        validate_inputs(inp, value.len(), grad.len())?;
        let p = Self::clip_params(
            KIND_GSPO,
            inp.lp.len(),
            cfg.bounds,
            cfg.dual_clip,
            cfg.delta_cap,
            cfg.log_ratio_clamp,
        );
        let o = self.dispatch_seq("seq_ratio", inp, p)?;
        let c = cfg.log_ratio_clamp;
        let ratios = Self::seq_ratios(inp, |x| {
            let x = match c {
                Some(c) if x > c => c,
                Some(c) if x < -c => -c,
                _ => x,
            };
            Real::exp(x)
        });
        let ratio = |t: usize| ratios[t];
        Self::finish(
            o,
            LossLevel::Sequence,
            &inp.tokens,
            Some(&ratio),
            value,
            grad,
        )
    }

    /// GSPO-token (verl `gspo`), grpo-core's [`grpo_core::loss::gspo_token`]:
    /// `r_t = exp(min(x̄_i, max))` with the token's own gradient path (`∂r_t/∂lp_t = r_t`, 0 when
    /// clamped), `L_t = −min(r_t·A_t, clip(r_t)·A_t)`. One invocation per sequence.
    ///
    /// ```
    /// use grpo_core::loss::{GspoTokenConfig, LossLevel, PolicyInputs};
    /// use grpo_core::Tokens;
    /// use grpo_wgpu::{GpuContext, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // x = (0.0004, −0.0002), A = (1, 1): x̄ = 0.0001, r = e^{0.0001} = 1.0001000 inside the
    /// // clip: L = −r and ∂L/∂lp = −A·r = −1.0001000 on both tokens (GSPO's sequence form has
    /// // −s/n); x = (0.002, 0), A = (1, −1): x̄ = 0.001, r = e^{0.001} = 1.0010005 > 1.0004:
    /// // A = 1 is clipped (L = −1.0004, gradient 0); A = −1 keeps the unclipped branch,
    /// // L = −min(−r, −1.0004) = r, ∂L/∂lp = −A·r = r.
    /// let lp = [0.0004f32, -0.0002, 0.002, 0.0];
    /// let old = [0.0f32; 4];
    /// let adv = [1.0f32, 1.0, 1.0, -1.0];
    /// let tokens = Tokens::padded(2, 2, None);
    /// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens };
    /// let (mut v, mut g) = ([0.0f32; 4], [0.0f32; 4]);
    /// let d = k.gspo_token(&GspoTokenConfig::default(), &inp, &mut v, &mut g)?;
    /// assert_eq!(d.level, LossLevel::Token);
    /// let (r0, r1) = (1.0001f32, 1.0010005f32);
    /// let want = ([-r0, -r0, -1.0004, r1], [-r0, -r0, 0.0, r1]);
    /// assert!((0..4).all(|t| (v[t] - want.0[t]).abs() < 2e-6 && (g[t] - want.1[t]).abs() < 2e-6));
    /// assert_eq!((d.clipped_high, d.clamped), (1, 0));
    /// // A log-ratio maximum that is not > 0 is grpo-core's error; nothing is written.
    /// let bad = GspoTokenConfig { seq_log_ratio_max: Some(0.0), ..GspoTokenConfig::default() };
    /// assert!(k.gspo_token(&bad, &inp, &mut v, &mut g).is_err());
    /// assert!((v[3] - 1.0010005).abs() < 2e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input.
    pub fn gspo_token(
        &self,
        cfg: &GspoTokenConfig<f32>,
        inp: &PolicyInputs<'_, f32>,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics<f32>> {
        grpo_core::loss::gspo_token(cfg, &empty_inputs(), &mut [], &mut [])?;
        validate_inputs(inp, value.len(), grad.len())?;
        let (flags, clamp) = clamp_flag(cfg.seq_log_ratio_max);
        let p = LossParams {
            n: inp.lp.len() as u32,
            kind: KIND_GSPO_TOKEN,
            flags,
            lo: cfg.bounds.lo,
            hi: cfg.bounds.hi,
            clamp,
            ..Default::default()
        };
        let o = self.dispatch_seq("seq_ratio", inp, p)?;
        let m = cfg.seq_log_ratio_max;
        let ratios = Self::seq_ratios(inp, |x| {
            let x = match m {
                Some(m) if x > m => m,
                _ => x,
            };
            Real::exp(x)
        });
        let ratio = |t: usize| ratios[t];
        Self::finish(o, LossLevel::Token, &inp.tokens, Some(&ratio), value, grad)
    }

    /// Importance weights of the rollout/trainer mismatch, grpo-core's
    /// [`grpo_core::is_correction::is_weights`] for every [`IsConfig`], with
    /// `r_t = old_t − roll_t` (`ln π_old/π_roll`) over a sequence's valid tokens:
    ///
    /// - [`IsLevel::Token`]: `w_t = e^{r_t}` (\[TRL\] `token_*`, \[verl\] `token`);
    /// - [`IsLevel::Sequence`]: `w = e^{Σ_t r_t}` on every valid token of the sequence
    ///   (\[TRL\] `sequence_*`, \[verl\] `sequence`);
    /// - [`IsLevel::GeometricMean`]: `w = e^{r̄}`, `r̄ = (Σ_t r_t)/n` (the geometric mean of the
    ///   token ratios), on every valid token.
    ///
    /// The log-weight is limited to ±`log_clamp` (and the overflow guard ±43.36) before `exp`,
    /// then filtered: [`IsFilter::Truncate`] clamps `w` to `[min, max]`, [`IsFilter::Mask`]
    /// sets `w = 0` outside `[lo, hi]` (\[TRL\] `*_mask`, \[OpenRLHF\] `icepop`),
    /// [`IsFilter::GeometricMask`] (\[OpenRLHF\] `seq-mask-tis`) sets the whole sequence to 0
    /// when `e^{limit(r̄)} ∉ [lo, hi]` and keeps its level's weights unclamped otherwise.
    /// `batch_normalize` (\[verl\] `rollout_is_batch_normalize`) divides every valid weight by
    /// the mean of the weights, zeros included (per valid token at token level, one per
    /// sequence otherwise), unless that mean is at most 1e-8.
    ///
    /// One invocation per sequence: `Σ_t r_t` in token order (grpo-core's f32 order, so the
    /// sum has its bits), `r̄` by one WGSL division (≤ 2.5 ULP, grpo-core's is correctly
    /// rounded), one `exp` per weight (WGSL: 3 + 2|l| ULP). The batch-normalisation mean is
    /// grpo-core's running mean `m ← m + (w − m)/k` over the GPU's weights in grpo-core's
    /// order, and the division by it is done on the host (correctly rounded, as grpo-core);
    /// the diagnostics' mean/min/max likewise. Near a mask bound the GPU and grpo-core may
    /// keep/zero a weight (or a sequence) differently when `e^l` is within exp's error of it.
    ///
    /// ```
    /// use grpo_core::Tokens;
    /// use grpo_core::is_correction::{IsConfig, IsLevel};
    /// use grpo_wgpu::{GpuContext, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // One sequence, r = [ln 0.25, ln 2, ln 10]: geometric mean 5^{1/3} ≈ 1.71 ∈ [0.5, 5],
    /// // so seq-mask-tis keeps the token weights unclamped, ≈ [0.25, 2, 10].
    /// let old = [0.25f32.ln(), 2f32.ln(), 10f32.ln()];
    /// let tokens = Tokens::padded(1, 3, None);
    /// let mut w = [0.0f32; 3];
    /// let d = k.is_weights(&IsConfig::seq_mask_tis(), &old, &[0.0; 3], &tokens, &mut w)?;
    /// assert!((w[0] - 0.25).abs() < 1e-5 && (w[2] - 10.0).abs() < 1e-4);
    /// assert_eq!(d.filtered, 0);
    /// // Geometric-mean level: e^{r̄} ≈ 1.71 on every token.
    /// let cfg = IsConfig { level: IsLevel::GeometricMean, ..IsConfig::default() };
    /// k.is_weights(&cfg, &old, &[0.0; 3], &tokens, &mut w)?;
    /// assert!(w.iter().all(|&x| (x - 5f32.cbrt()).abs() < 1e-5));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// grpo-core's for the same input ([`Error::LengthMismatch`], layout errors,
    /// [`Error::NonFinite`], [`Error::InvalidParam`] for bad bounds or log clamp);
    /// [`GpuError`](crate::GpuError) for a device failure or a batch beyond the device's
    /// limits. On `Err`, `weights` is untouched.
    pub fn is_weights(
        &self,
        cfg: &IsConfig<f32>,
        old: &[f32],
        roll: &[f32],
        tokens: &Tokens<'_>,
        weights: &mut [f32],
    ) -> Result<IsDiagnostics<f32>> {
        grpo_core::is_correction::is_weights(
            cfg,
            &[],
            &[],
            &Tokens::packed(&EMPTY_CU, None),
            &mut [],
        )?;
        let kind = match cfg.level {
            IsLevel::Token => KIND_IS_TOKEN,
            IsLevel::Sequence => KIND_IS_SEQ,
            IsLevel::GeometricMean => KIND_IS_GEO,
        };
        let (flags, lo, hi) = match cfg.filter {
            IsFilter::None => (0, 0.0, 0.0),
            IsFilter::Truncate { min, max } => (FLAG_IS_TRUNCATE, min, max),
            IsFilter::Mask { lo, hi } => (FLAG_IS_MASK, lo, hi),
            IsFilter::GeometricMask { lo, hi } => (FLAG_IS_GEO_MASK, lo, hi),
        };
        // divergence::measures::check_token_inputs.
        let n = old.len();
        check_len("old", n, old.len())?;
        check_len("roll", n, roll.len())?;
        check_len("weights", n, weights.len())?;
        tokens.validate(n)?;
        for (what, s) in [("old", old), ("roll", roll)] {
            if let Some(index) = tokens.first_non_finite(s) {
                return Err(Error::NonFinite { what, index }.into());
            }
        }
        let guard = f32::from_bits(EXP_GUARD_BITS);
        let lim = cfg.log_clamp.map_or(guard, |c| Real::min(c, guard));
        let p = LossParams {
            n: n as u32,
            kind,
            flags,
            lo,
            hi,
            clamp: lim,
            ..Default::default()
        };
        let inp = PolicyInputs {
            lp: old,
            old: roll,
            adv: old,
            tokens: *tokens,
        };
        let o = self.dispatch_seq("is_weights", &inp, p)?;
        let mut w = o.value;
        if cfg.batch_normalize {
            // is_correction's RunningMean over the weights, zeros included: every valid
            // token's at token level, each sequence's once (its first valid token's) otherwise.
            let (mut mean, mut count) = (0.0f32, 0usize);
            for i in 0..tokens.num_sequences() {
                for (j, t) in tokens.valid_positions(i).enumerate() {
                    if cfg.level == IsLevel::Token || j == 0 {
                        count += 1;
                        mean += (w[t] - mean) / count as f32;
                    }
                }
            }
            if count > 0 && mean > IS_NORMALIZE_MIN_MEAN as f32 {
                for_each_valid(tokens, |t| {
                    w[t] /= mean;
                    Ok(())
                })?;
            }
        }
        let mut d = IsDiagnostics::default();
        let (mut mean, mut count) = (0.0f32, 0usize);
        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
        for_each_valid(tokens, |t| {
            let w = w[t];
            d.tokens += 1;
            d.log_clamped += (o.events[t] & EV_CLAMPED != 0) as usize;
            d.filtered += (o.events[t] & EV_CLIP_LOW != 0) as usize;
            // is_correction's RunningMean.
            count += 1;
            mean += (w - mean) / count as f32;
            lo = Real::min(lo, w);
            hi = Real::max(hi, w);
            Ok(())
        })?;
        if d.tokens > 0 {
            (d.mean, d.min, d.max) = (mean, lo, hi);
        }
        weights.copy_from_slice(&w);
        Ok(d)
    }

    /// The local effective-sample-size sums of P3O, grpo-core's
    /// [`grpo_core::loss::ess_stats`]: `Σw`, `Σw²` with `w = exp(clamp(lp − old))` over the
    /// valid tokens. A two-level reduction: one invocation per sequence sums its tokens in token
    /// order (`ess_seq`), one invocation adds the per-sequence sums in sequence order
    /// (`ess_total`). grpo-core adds all tokens into one accumulator, so the rounding differs:
    /// both orders are within `(n − 1)·2⁻²⁴` relative of the exact sum of positive terms, on top
    /// of WGSL's exp (tolerance table, `EssSums`).
    ///
    /// ```
    /// use grpo_core::loss::{P3oConfig, PolicyInputs};
    /// use grpo_core::{Error, Tokens};
    /// use grpo_wgpu::{GpuContext, GpuError, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // Two rows of width 2, the last position padding (its NaN is never read).
    /// // x = lp − old = (0, ln 3, −ln 2): w = (1, 3, ½), Σw = 4.5, Σw² = 10.25,
    /// // so ESS = 4.5²/(3·10.25) = 0.6585366.
    /// let lp = [0.0f32, 3f32.ln(), -(2f32.ln()), f32::NAN];
    /// let (old, adv) = ([0.0f32; 4], [1.0f32; 4]);
    /// let mask = [true, true, true, false];
    /// let tokens = Tokens::padded(2, 2, Some(&mask));
    /// let cfg = P3oConfig::default();
    /// let s = k.ess_stats(&cfg, &PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens })?;
    /// assert_eq!(s.n, 3);
    /// assert!((s.sum_w - 4.5).abs() < 1e-5 && (s.sum_w2 - 10.25).abs() < 1e-5);
    /// assert!((s.ess() - 0.6585366).abs() < 1e-6);
    /// // The same NaN at a valid position is grpo-core's error.
    /// let all = Tokens::padded(2, 2, None);
    /// let e = k.ess_stats(&cfg, &PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: all });
    /// assert!(matches!(e, Err(GpuError::Core(Error::NonFinite { index: 3, .. }))));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input (`NonFinite { what: "ess sums" }` on overflow).
    pub fn ess_stats(
        &self,
        cfg: &P3oConfig<f32>,
        inp: &PolicyInputs<'_, f32>,
    ) -> Result<EssStats<f32>> {
        grpo_core::loss::ess_stats(cfg, &empty_inputs())?;
        let n = inp.lp.len();
        validate_inputs(inp, n, n)?;
        let tokens = &inp.tokens;
        let b = tokens.num_sequences();
        self.ctx
            .check_items("tokens and sequence spans", n + 2 * b)?;
        let words = mask_and_spans(tokens, n);
        let (flags, clamp) = clamp_flag(cfg.log_ratio_clamp);
        let p = LossParams {
            n: n as u32,
            seqs: b as u32,
            flags,
            clamp,
            ..Default::default()
        };
        let res = self.ctx.run(
            ShaderId::Loss,
            &[
                (0, Arg::In(bytemuck::cast_slice(inp.lp))),
                (1, Arg::In(bytemuck::cast_slice(inp.old))),
                (3, Arg::In(bytemuck::cast_slice(&words))),
                (4, Arg::Uniform(bytemuck::bytes_of(&p))),
                (6, Arg::Out(((2 * b + 2) * 4) as u64)),
            ],
            &[
                ("ess_seq", self.ctx.grid(b, 256)?),
                ("ess_total", [1, 1, 1]),
            ],
        )?;
        let sums: &[f32] = bytemuck::cast_slice(&res[0]);
        let s = EssStats {
            n: tokens.total_valid(),
            sum_w: sums[2 * b],
            sum_w2: sums[2 * b + 1],
        };
        if !(s.sum_w.is_finite() && s.sum_w2.is_finite()) {
            return Err(Error::NonFinite {
                what: "ess sums",
                index: 0,
            }
            .into());
        }
        Ok(s)
    }

    /// P3O, grpo-core's [`grpo_core::loss::p3o`]:
    /// `L = −sg(min(ρ, ESS))·A·lp + (1 − ESS)·(1/ρ − 1 + ln ρ)` (the k3 estimator of
    /// KL(θ‖old)), `∂L/∂lp = −min(ρ, ESS)·A + (1 − ESS)·(1 − 1/ρ)`, with `ess` from
    /// [`Self::ess_stats`] (possibly all-reduced, then [`EssStats::ess`]).
    ///
    /// ```
    /// use grpo_core::loss::{P3oConfig, PolicyInputs};
    /// use grpo_core::Tokens;
    /// use grpo_wgpu::{GpuContext, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // x = lp − old = (−ln 2, ln 2), A = 1: w = ρ = (½, 2), Σw = 2.5, Σw² = 4.25,
    /// // ESS = (Σw)²/(n·(Σw² + 1e-8)) = 6.25/8.5 = 25/34 = 0.7352941.
    /// let lp = [-(2f32.ln()), 2f32.ln()];
    /// let old = [0.0f32; 2];
    /// let adv = [1.0f32; 2];
    /// let tokens = Tokens::padded(1, 2, None);
    /// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens };
    /// let cfg = P3oConfig::default();
    /// let s = k.ess_stats(&cfg, &inp)?;
    /// assert_eq!(s.n, 2);
    /// assert!((s.sum_w - 2.5).abs() < 1e-5 && (s.sum_w2 - 4.25).abs() < 1e-5);
    /// let ess = s.ess();
    /// assert!((ess - 25.0 / 34.0).abs() < 1e-6);
    /// // KL3 = e^{−x} − 1 + x = (1 − ln 2, ln 2 − ½) = (0.3068528, 0.1931472), 1 − ESS = 9/34:
    /// // ρ = ½ < ESS: L = ½·ln 2 + (9/34)·0.3068528 = 0.4277993,
    /// // ∂L/∂lp = −½ + (9/34)(1 − 2) = −13/17;
    /// // ρ = 2 capped at ESS: L = −(25/34)·ln 2 + (9/34)·0.1931472 = −0.4585398,
    /// // ∂L/∂lp = −25/34 + (9/34)(1 − ½) = −41/68.
    /// let (mut v, mut g) = ([0.0f32; 2], [0.0f32; 2]);
    /// let d = k.p3o(&cfg, &inp, ess, &mut v, &mut g)?;
    /// assert!((v[0] - 0.4277993).abs() < 1e-6 && (g[0] + 13.0 / 17.0).abs() < 1e-6);
    /// assert!((v[1] + 0.4585398).abs() < 1e-6 && (g[1] + 41.0 / 68.0).abs() < 1e-6);
    /// assert_eq!(d.clipped_high, 1);
    /// // An ESS outside [0, 1] is grpo-core's error; nothing is written.
    /// assert!(k.p3o(&cfg, &inp, 1.5, &mut v, &mut g).is_err());
    /// assert!((v[0] - 0.4277993).abs() < 1e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input.
    pub fn p3o(
        &self,
        cfg: &P3oConfig<f32>,
        inp: &PolicyInputs<'_, f32>,
        ess: f32,
        value: &mut [f32],
        grad: &mut [f32],
    ) -> Result<LossDiagnostics<f32>> {
        grpo_core::loss::p3o(cfg, &empty_inputs(), ess, &mut [], &mut [])?;
        validate_inputs(inp, value.len(), grad.len())?;
        let (flags, clamp) = clamp_flag(cfg.log_ratio_clamp);
        let p = LossParams {
            n: inp.lp.len() as u32,
            kind: KIND_P3O,
            flags,
            lo: 1.0 - ess,
            hi: ess,
            clamp,
            ..Default::default()
        };
        self.ratio_loss(p, cfg.log_ratio_clamp, inp, value, grad)
    }
}

/// is_correction::RejectStat as loss.wgsl's `rejection` reads it.
const STAT_K1: u32 = 0;
const STAT_K2: u32 = 1;
const STAT_K3: u32 = 2;
/// is_correction::RejectLevel as loss.wgsl's `rejection` reads it.
const LEVEL_TOKEN: u32 = 0;
const LEVEL_SEQ_SUM: u32 = 1;
const LEVEL_SEQ_MEAN: u32 = 2;
const LEVEL_SEQ_MAX: u32 = 3;
/// Event bit of a valid token that a token-level rejection criterion rejects (loss.wgsl).
const EV_REJECTED: u32 = 64;

/// loss.wgsl's `order_key`: a `u32` whose unsigned order is the numeric order of non-NaN f32
/// values (±∞ included; −0 maps to +0, which compares equal to it), so the shader compares a
/// statistic with a bound exactly without ±∞ in its arithmetic.
fn order_key(x: f32) -> u32 {
    let b = match x.to_bits() {
        0x8000_0000 => 0,
        b => b,
    };
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The `flags` words of the per-sequence entry points: each position's validity (n words), then
/// each sequence's `[start, end)`.
fn mask_and_spans(tokens: &Tokens<'_>, n: usize) -> Vec<u32> {
    let b = tokens.num_sequences();
    let mut words: Vec<u32> = Vec::with_capacity(n + 2 * b);
    words.extend((0..n).map(|t| tokens.is_valid(t) as u32));
    for i in 0..b {
        let s = tokens.span(i);
        words.push(s.start as u32);
        words.push(s.end as u32);
    }
    words
}

/// is_correction::check_token_inputs for the masks: the lengths (`outputs` after the inputs),
/// the layout, then the first non-finite valid value of each input in order.
fn check_mask_inputs(
    tokens: &Tokens<'_>,
    inputs: [(&'static str, &[f32]); 2],
    outputs: &[(&'static str, usize)],
) -> Result<()> {
    let n = inputs[0].1.len();
    for (what, s) in inputs {
        check_len(what, n, s.len())?;
    }
    for &(what, len) in outputs {
        check_len(what, n, len)?;
    }
    tokens.validate(n)?;
    for (what, s) in inputs {
        if let Some(index) = tokens.first_non_finite(s) {
            return Err(Error::NonFinite { what, index }.into());
        }
    }
    Ok(())
}

impl LossKernel<'_> {
    /// \[verl\] rollout rejection sampling (`rollout_rs`), grpo-core's
    /// [`grpo_core::is_correction::rejection_mask`]: `keep[t] = true` iff position `t` is valid
    /// and every criterion accepts it; invalid positions get `false`, and an empty `criteria`
    /// keeps every valid token. The output is a `&mut [bool]` per position, as in grpo-core.
    ///
    /// With `r_t = old_t − roll_t` (`ln π_old/π_roll`), a [`RejectionCriterion`] evaluates the
    /// per-token statistic ([`RejectStat`]) `k1 = −r`, `k2 = r²/2` or `k3 = e^r − 1 − r` (r
    /// clamped to ±20 first, verl's `SAFETY_BOUND`) at a [`RejectLevel`]: `Token` (the token on
    /// its own: `token_k*`), or over a sequence's valid tokens `SeqSum` (Σ_t), `SeqMean`
    /// (Σ_t / n: with k1 the geometric-mean ratio test) or `SeqMax` (k2/k3 only), and accepts iff
    /// the value `v` satisfies `lo ≤ v ≤ hi` (NaN: rejected). A rejected sequence-level
    /// criterion rejects every token of its sequence; all criteria combine with AND.
    /// [`RejectionCriterion::k1`] takes verl's ratio bounds, [`RejectionCriterion::upper`] a
    /// k2/k3 threshold.
    ///
    /// On the GPU, one invocation per sequence adds (or maxes) the statistic of its valid tokens
    /// for each sequence-level criterion in token order — grpo-core's order, with correctly
    /// rounded `+ − ×`, so k1 and k2 sums and maxima have grpo-core's bits — and decides every
    /// token-level criterion, comparing order-preserving integer keys of the value and the
    /// bounds (exact, ±∞ bounds included). The host divides the means by the count and
    /// compares the sequence aggregates with their bounds (O(sequences × criteria), correctly
    /// rounded as grpo-core, where WGSL's division would be 2.5 ULP), then assembles the
    /// diagnostics in grpo-core's order. So every k1 and k2 decision is grpo-core's, except
    /// that WGSL may flush subnormal values to zero (a statistic or sum within a subnormal of a
    /// bound). k3 goes through `exp` (WGSL: 3 + 2|x| ULP, and a Taylor series where grpo-core
    /// uses `expm1`), so a token or sequence whose k3 statistic lies within that error of a
    /// bound may be kept by one and rejected by the other (tolerance table,
    /// `RejectionK3`).
    ///
    /// ```
    /// use grpo_core::Tokens;
    /// use grpo_core::is_correction::{RejectLevel, RejectStat, RejectionCriterion};
    /// use grpo_wgpu::{GpuContext, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // r = old − roll = [0.1, −0.2 | 0.5, 0.0]. token_k2 ≤ 0.01 keeps |r| ≤ √0.02 = 0.1414…:
    /// // tokens 0 and 3.
    /// let old = [0.1f32, -0.2, 0.5, 0.0];
    /// let roll = [0.0f32; 4];
    /// let tokens = Tokens::padded(2, 2, None);
    /// let mut keep = [true; 4];
    /// let c = [RejectionCriterion::upper(RejectStat::K2, RejectLevel::Token, 0.01)?];
    /// let d = k.rejection_mask(&c, &old, &roll, &tokens, &mut keep)?;
    /// assert_eq!(keep, [true, false, false, true]);
    /// assert_eq!((d.tokens, d.rejected_tokens, d.rejected_sequences), (4, 2, 0));
    /// // seq_mean_k1 with ratio bounds [e^−0.1, e^0.1]: sequence 0 (mean r −0.05) is kept,
    /// // sequence 1 (mean r 0.25) rejected as a whole.
    /// let c = [RejectionCriterion::k1(RejectLevel::SeqMean, (-0.1f32).exp(), 0.1f32.exp())?];
    /// let d = k.rejection_mask(&c, &old, &roll, &tokens, &mut keep)?;
    /// assert_eq!(keep, [true, true, false, false]);
    /// assert_eq!(d.rejected_sequences, 1);
    /// // seq_max_k3 ≤ 0.05: sequence 0's largest k3 is k3(−0.2) = e^−0.2 − 0.8 = 0.0187,
    /// // sequence 1's k3(0.5) = e^0.5 − 1.5 = 0.1487: rejected.
    /// let c = [RejectionCriterion::upper(RejectStat::K3, RejectLevel::SeqMax, 0.05)?];
    /// k.rejection_mask(&c, &old, &roll, &tokens, &mut keep)?;
    /// assert_eq!(keep, [true, true, false, false]);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// grpo-core's, in its order: [`Error::InvalidParam`] for the first inconsistent criterion
    /// (`k1` at `SeqMax`, NaN bounds or `lo > hi`), [`Error::LengthMismatch`] (`roll`, `keep`),
    /// layout errors of [`Tokens::validate`], [`Error::NonFinite`] for a NaN/±∞ `old`, then
    /// `roll`, at a valid position; [`GpuError`](crate::GpuError) for a device failure or a
    /// batch beyond the device's limits. On `Err`, `keep` is untouched.
    pub fn rejection_mask(
        &self,
        criteria: &[RejectionCriterion<f32>],
        old: &[f32],
        roll: &[f32],
        tokens: &Tokens<'_>,
        keep: &mut [bool],
    ) -> Result<RejectionDiagnostics> {
        // grpo-core on an empty batch: its criterion checks, in its order, exactly.
        grpo_core::is_correction::rejection_mask(
            criteria,
            &[],
            &[],
            &Tokens::packed(&EMPTY_CU, None),
            &mut [],
        )?;
        let n = old.len();
        check_mask_inputs(
            tokens,
            [("old", old), ("roll", roll)],
            &[("keep", keep.len())],
        )?;
        let b = tokens.num_sequences();
        // Sequence-level criteria first (their aggregates are indexed by their position).
        let (seq, tok): (Vec<&RejectionCriterion<f32>>, Vec<_>) =
            criteria.iter().partition(|c| c.level != RejectLevel::Token);
        let cs = seq.len();
        self.ctx.check_items(
            "tokens, sequence spans and criteria",
            n + 2 * b + 2 + 4 * criteria.len(),
        )?;
        self.ctx
            .check_items("sequence aggregates", b.saturating_mul(cs))?;
        let mut words = mask_and_spans(tokens, n);
        words.push(cs as u32);
        words.push(tok.len() as u32);
        for c in seq.iter().chain(&tok) {
            words.push(match c.stat {
                RejectStat::K1 => STAT_K1,
                RejectStat::K2 => STAT_K2,
                RejectStat::K3 => STAT_K3,
            });
            words.push(match c.level {
                RejectLevel::Token => LEVEL_TOKEN,
                RejectLevel::SeqSum => LEVEL_SEQ_SUM,
                RejectLevel::SeqMean => LEVEL_SEQ_MEAN,
                RejectLevel::SeqMax => LEVEL_SEQ_MAX,
            });
            // Validated above: neither bound is NaN.
            words.push(order_key(c.lo));
            words.push(order_key(c.hi));
        }
        let p = LossParams {
            n: n as u32,
            seqs: b as u32,
            ..Default::default()
        };
        let res = self.ctx.run(
            ShaderId::Loss,
            &[
                (0, Arg::In(bytemuck::cast_slice(old))),
                (1, Arg::In(bytemuck::cast_slice(roll))),
                (3, Arg::InOut(bytemuck::cast_slice(&words))),
                (4, Arg::Uniform(bytemuck::bytes_of(&p))),
                (6, Arg::Out((b * cs * 4) as u64)),
            ],
            &[("rejection", self.ctx.grid(b, 256)?)],
        )?;
        let flags: &[u32] = bytemuck::cast_slice(&res[0]);
        let aggs: &[f32] = bytemuck::cast_slice(&res[1]);
        let mut out = vec![false; n];
        let mut d = RejectionDiagnostics::default();
        for i in 0..b {
            let count = tokens.valid_count(i);
            if count == 0 {
                continue;
            }
            // is_correction's sequence test: the mean as grpo-core divides it, then lo ≤ v ≤ hi.
            let seq_ok = seq.iter().enumerate().all(|(j, c)| {
                let mut v = aggs[i * cs + j];
                if c.level == RejectLevel::SeqMean {
                    v /= count as f32;
                }
                v >= c.lo && v <= c.hi
            });
            let mut kept = 0;
            for t in tokens.valid_positions(i) {
                let ok = seq_ok && (flags[t] >> 1) & EV_REJECTED == 0;
                out[t] = ok;
                kept += usize::from(ok);
            }
            d.tokens += count;
            d.rejected_tokens += count - kept;
            d.rejected_sequences += usize::from(kept == 0);
        }
        keep.copy_from_slice(&out);
        Ok(d)
    }

    /// \[TRL\] off-policy sequence masking (OPSM), grpo-core's
    /// [`grpo_core::is_correction::off_policy_sequence_mask`]: sequence `i` is dropped
    /// (`keep[i] = false`) iff `A_i < 0` **and** `mean_t(roll_t − lp_t) > δ` over its valid
    /// tokens — a negative-advantage sample the current policy already finds much less likely
    /// than the sampler did. A sequence without valid tokens is kept; `lp` is read as a constant
    /// (sg). One `bool` per sequence, as in grpo-core; returns the number dropped.
    ///
    /// On the GPU, one invocation per negative-advantage sequence adds `roll_t − lp_t` over its
    /// valid tokens in token order (grpo-core's order, correctly rounded: the sum has grpo-core's
    /// bits); the host divides by the count and compares with δ as grpo-core does, so every
    /// decision is grpo-core's, except that WGSL may flush subnormal values to zero (a mean
    /// within a subnormal of δ).
    ///
    /// ```
    /// use grpo_core::Tokens;
    /// use grpo_wgpu::{GpuContext, LossKernel};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = LossKernel::new(&ctx);
    /// // mean(roll − lp): sequence 0 = 0.5, sequence 1 = 0.5, sequence 2 = 0. δ = 0.1: only
    /// // sequence 0 has both a negative advantage and a mean above δ.
    /// let lp = [-1.0f32; 6];
    /// let roll = [-0.5f32, -0.5, -0.5, -0.5, -1.0, -1.0];
    /// let adv = [-1.0f32, 1.0, -1.0];
    /// let mut keep = [true; 3];
    /// let tokens = Tokens::padded(3, 2, None);
    /// let dropped = k.off_policy_sequence_mask(&adv, &lp, &roll, &tokens, 0.1, &mut keep)?;
    /// assert_eq!((keep, dropped), ([false, true, true], 1));
    /// // δ < 0 is grpo-core's error; `keep` is untouched.
    /// assert!(k.off_policy_sequence_mask(&adv, &lp, &roll, &tokens, -1.0, &mut keep).is_err());
    /// assert_eq!(keep, [false, true, true]);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// grpo-core's, in its order: [`Error::InvalidParam`] unless δ is finite and ≥ 0,
    /// [`Error::LengthMismatch`] (`roll` per token), layout errors of [`Tokens::validate`],
    /// [`Error::NonFinite`] for a NaN/±∞ `lp`, then `roll`, at a valid position,
    /// [`Error::LengthMismatch`] for `advantages` and `keep` (one per sequence),
    /// [`Error::NonFinite`] for the first NaN/±∞ advantage; [`GpuError`](crate::GpuError) for
    /// a device failure or a batch beyond the device's limits. On `Err`, `keep` is untouched.
    pub fn off_policy_sequence_mask(
        &self,
        advantages: &[f32],
        lp: &[f32],
        roll: &[f32],
        tokens: &Tokens<'_>,
        delta: f32,
        keep: &mut [bool],
    ) -> Result<usize> {
        // grpo-core on an empty batch: its check of δ, exactly.
        grpo_core::is_correction::off_policy_sequence_mask(
            &[],
            &[],
            &[],
            &Tokens::packed(&EMPTY_CU, None),
            delta,
            &mut [],
        )?;
        let n = lp.len();
        check_mask_inputs(tokens, [("lp", lp), ("roll", roll)], &[])?;
        let b = tokens.num_sequences();
        check_len("advantages", b, advantages.len())?;
        check_len("keep", b, keep.len())?;
        if let Some(index) = advantages.iter().position(|a| !a.is_finite()) {
            return Err(Error::NonFinite {
                what: "advantages",
                index,
            }
            .into());
        }
        self.ctx
            .check_items("tokens and sequence spans", n + 2 * b)?;
        let words = mask_and_spans(tokens, n);
        let p = LossParams {
            n: n as u32,
            seqs: b as u32,
            ..Default::default()
        };
        let res = self.ctx.run(
            ShaderId::Loss,
            &[
                (0, Arg::In(bytemuck::cast_slice(lp))),
                (1, Arg::In(bytemuck::cast_slice(roll))),
                (2, Arg::In(bytemuck::cast_slice(advantages))),
                (3, Arg::In(bytemuck::cast_slice(&words))),
                (4, Arg::Uniform(bytemuck::bytes_of(&p))),
                (6, Arg::Out((b * 4) as u64)),
            ],
            &[("opsm", self.ctx.grid(b, 256)?)],
        )?;
        let sums: &[f32] = bytemuck::cast_slice(&res[0]);
        let mut out = vec![true; b];
        let mut dropped = 0;
        for (i, k) in out.iter_mut().enumerate() {
            let count = tokens.valid_count(i);
            // grpo-core's test, with its division.
            let drop = count > 0 && advantages[i] < 0.0 && sums[i] / count as f32 > delta;
            *k = !drop;
            dropped += usize::from(drop);
        }
        keep.copy_from_slice(&out);
        Ok(dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::order_key;

    #[test]
    fn order_keys_sort_like_the_floats() {
        // Increasing f32 values, ±∞ and both zeros included (−0 and +0 share a key).
        let v = [
            f32::NEG_INFINITY,
            f32::MIN,
            -1.0,
            -f32::MIN_POSITIVE,
            -1e-45,
            -0.0,
            0.0,
            1e-45,
            f32::MIN_POSITIVE,
            1.0,
            f32::MAX,
            f32::INFINITY,
        ];
        for a in v {
            for b in v {
                assert_eq!(
                    order_key(a).cmp(&order_key(b)),
                    a.partial_cmp(&b).unwrap(),
                    "{a} vs {b}"
                );
            }
        }
        assert_eq!(order_key(-0.0), order_key(0.0));
    }
}
