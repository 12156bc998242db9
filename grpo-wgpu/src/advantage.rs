//! [`AdvantageKernel`]: group-relative advantages (MATH.md §2) on the GPU, the same per-element
//! f32 formulas as grpo-core (`shaders/advantage.wgsl`).
//!
//! The scores are small (one per sample), so every data-dependent check runs on the host first
//! with grpo-core's error variants; the shaders then see only valid input. Groups of any
//! [`Groups`] layout are gathered contiguously on the host (a no-op for uniform and CSR layouts)
//! and scattered back.

use bytemuck::{Pod, Zeroable};
use grpo_core::advantage::{Diagnostics, NanPolicy, SingletonRule};
use grpo_core::stats::{Bessel, TiePolicy};
use grpo_core::{Error, Groups};

use crate::context::{Arg, GpuContext};
use crate::error::{Result, check_len, ensure};
use crate::shaders::ShaderId;

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct AdvParams {
    groups: u32,
    n: u32,
    kind: u32,
    flags: u32,
    eps: f32,
    gamma: f32,
    singleton: u32,
    k: u32,
}

const KIND_ZSCORE: u32 = 0;
const KIND_RLOO: u32 = 1;
const KIND_BATCH_SCALED: u32 = 2;
const KIND_GOPO: u32 = 3;
const KIND_G2RPO: u32 = 4;
const KIND_GDPO: u32 = 5;
const FLAG_UNBIASED: u32 = 1;
const FLAG_STD_FLOOR: u32 = 2;
const FLAG_NAN_EXCLUDE: u32 = 4;
const FLAG_TIE_AVERAGE: u32 = 8;

/// Configuration of the z-score family: `A = (s − μ_g)/(σ_g + ε)^γ` (MATH.md §2).
///
/// `Default`: ε = 1e-6, unbiased σ, no std floor, γ = 1 (GRPO), singleton groups get 0, NaN
/// scores are an error.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ZScoreConfig {
    /// ε added to σ (verl 1e-6, TRL 1e-4, OpenRLHF 1e-9).
    pub eps: f32,
    /// Bessel's correction of σ.
    pub bessel: Bessel,
    /// verl vectorized: σ = sqrt(max(var, ε)) before adding ε.
    pub std_floor: bool,
    /// The std-identity dial [2607.00152]: γ = 1 GRPO, γ = 0 Dr.GRPO [2503.20783].
    pub gamma: f32,
    /// What a group of one gets.
    pub singleton: SingletonRule,
    /// What a NaN score means.
    pub nan: NanPolicy,
}

impl Default for ZScoreConfig {
    fn default() -> Self {
        ZScoreConfig {
            eps: 1e-6,
            bessel: Bessel::Unbiased,
            std_floor: false,
            gamma: 1.0,
            singleton: SingletonRule::Zero,
            nan: NanPolicy::Reject,
        }
    }
}

/// The advantage estimators (`shaders/advantage.wgsl`) on one [`GpuContext`].
#[derive(Debug, Clone, Copy)]
pub struct AdvantageKernel<'c> {
    ctx: &'c GpuContext,
}

/// Samples of each group made contiguous: `order[j]` is the caller index at gathered position j.
struct Gathered {
    groups: usize,
    offsets: Vec<u32>,
    order: Option<Vec<usize>>,
}

impl<'c> AdvantageKernel<'c> {
    /// The estimators on `ctx`.
    pub fn new(ctx: &'c GpuContext) -> Self {
        AdvantageKernel { ctx }
    }

    fn gather(groups: &Groups<'_>, n: usize) -> Result<Gathered> {
        let g = groups.validate(n)?;
        let mut offsets = Vec::with_capacity(g + 1);
        offsets.push(0u32);
        let mut order = Vec::new();
        let permuted = matches!(groups, Groups::Permuted(_));
        for k in 0..g {
            if permuted {
                order.extend(groups.members(k));
                offsets.push(order.len() as u32);
            } else {
                let last = *offsets.last().unwrap_or(&0);
                offsets.push(last + groups.size(k) as u32);
            }
        }
        Ok(Gathered {
            groups: g,
            offsets,
            order: permuted.then_some(order),
        })
    }

    fn gather_values(g: &Gathered, values: &[f32], stride: usize) -> Vec<f32> {
        match &g.order {
            None => values.to_vec(),
            Some(order) => order
                .iter()
                .flat_map(|&i| values[i * stride..(i + 1) * stride].iter().copied())
                .collect(),
        }
    }

    /// Host validation of per-sample scores under a NaN policy; returns the NaN count.
    fn check_scores(scores: &[f32], nan: NanPolicy) -> Result<usize> {
        let mut excluded = 0;
        for (index, &s) in scores.iter().enumerate() {
            if s.is_nan() && nan == NanPolicy::Exclude {
                excluded += 1;
            } else if !s.is_finite() {
                return Err(Error::NonFinite {
                    what: "scores",
                    index,
                }
                .into());
            }
        }
        Ok(excluded)
    }

    /// Scorable members per group; rejects empty groups and applies the singleton rule.
    fn check_groups(
        g: &Gathered,
        scores_gathered: &[f32],
        singleton: SingletonRule,
        needed: usize,
    ) -> Result<(usize, usize)> {
        let mut singles = 0;
        let mut zero_var = 0;
        for k in 0..g.groups {
            let span = &scores_gathered[g.offsets[k] as usize..g.offsets[k + 1] as usize];
            let valid = span.iter().filter(|s| !s.is_nan()).count();
            if valid == 0 {
                return Err(Error::EmptyGroup { group: k }.into());
            }
            if valid < needed || (valid == 1 && singleton == SingletonRule::Reject) {
                return Err(Error::GroupTooSmall {
                    group: k,
                    needed: needed.max(2),
                    found: valid,
                }
                .into());
            }
            if valid == 1 {
                singles += 1;
            } else {
                let first = span.iter().find(|s| !s.is_nan());
                if span.iter().filter(|s| !s.is_nan()).all(|s| Some(s) == first) {
                    zero_var += 1;
                }
            }
        }
        Ok((singles, zero_var))
    }

    fn dispatch(
        &self,
        g: &Gathered,
        values: &[f32],
        params: AdvParams,
        weights: &[f32],
        passes: &[(&'static str, [u32; 3])],
        out: &mut [f32],
    ) -> Result<()> {
        let n = out.len();
        let diag_len = (2 * g.groups).max(1) * 4;
        let res = self.ctx.run(
            ShaderId::Advantage,
            &[
                (0, Arg::In(bytemuck::cast_slice(values))),
                (1, Arg::In(bytemuck::cast_slice(&g.offsets))),
                (2, Arg::Out((n * 4) as u64)),
                (3, Arg::Out(16)),
                (4, Arg::Uniform(bytemuck::bytes_of(&params))),
                (5, Arg::In(bytemuck::cast_slice(weights))),
                (6, Arg::Out(diag_len as u64)),
            ],
            passes,
        )?;
        let a: &[f32] = bytemuck::cast_slice(&res[0]);
        match &g.order {
            None => out.copy_from_slice(&a[..n]),
            Some(order) => {
                for (j, &i) in order.iter().enumerate() {
                    out[i] = a[j];
                }
            }
        }
        Ok(())
    }

    fn groups_x(&self, g: usize) -> [u32; 3] {
        [(g as u32).div_ceil(64), 1, 1]
    }

    fn zscore_like(
        &self,
        kind: u32,
        scores: &[f32],
        groups: &Groups<'_>,
        cfg: &ZScoreConfig,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        check_len("out", scores.len(), out.len())?;
        ensure(cfg.eps.is_finite() && cfg.eps >= 0.0, "eps", "must be finite and >= 0")?;
        ensure(cfg.gamma.is_finite() && cfg.gamma >= 0.0, "gamma", "must be finite and >= 0")?;
        let g = Self::gather(groups, scores.len())?;
        let nan_excluded = Self::check_scores(scores, cfg.nan)?;
        let gathered = Self::gather_values(&g, scores, 1);
        let (singles, zero_var) = Self::check_groups(&g, &gathered, cfg.singleton, 1)?;
        let mut flags = 0;
        if cfg.bessel == Bessel::Unbiased {
            flags |= FLAG_UNBIASED;
        }
        if cfg.std_floor {
            flags |= FLAG_STD_FLOOR;
        }
        if cfg.nan == NanPolicy::Exclude {
            flags |= FLAG_NAN_EXCLUDE;
        }
        let params = AdvParams {
            groups: g.groups as u32,
            n: scores.len() as u32,
            kind,
            flags,
            eps: cfg.eps,
            gamma: cfg.gamma,
            singleton: (cfg.singleton == SingletonRule::VerlLoop) as u32,
            k: 1,
        };
        let mut passes = vec![];
        if kind == KIND_BATCH_SCALED {
            passes.push(("batch_moments", [1, 1, 1]));
        }
        passes.push(("group_stats", self.groups_x(g.groups)));
        let mut tmp = vec![0f32; out.len()];
        self.dispatch(&g, &gathered, params, &[0.0], &passes, &mut tmp)?;
        out.copy_from_slice(&tmp);
        Ok(Diagnostics {
            groups: g.groups,
            zero_variance_groups: zero_var,
            singleton_groups: singles,
            nan_excluded,
            ..Default::default()
        }
        .summarize(out))
    }

    /// GRPO z-score family `A = (s − μ_g)/(σ_g + ε)^γ` (Dr.GRPO with γ = 0) [2402.03300,
    /// 2607.00152, 2503.20783].
    ///
    /// # Errors
    /// grpo-core's: bad layout, non-finite score (or NaN under `NanPolicy::Reject`), a group with
    /// no scorable member, a singleton under `SingletonRule::Reject`, ε or γ out of domain.
    pub fn zscore(
        &self,
        scores: &[f32],
        groups: &Groups<'_>,
        cfg: &ZScoreConfig,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        self.zscore_like(KIND_ZSCORE, scores, groups, cfg, out)
    }

    /// RLOO: `A_i = s_i − mean_{j≠i} s_j = (n/(n−1))(s_i − μ_g)`; singleton per `cfg.singleton`
    /// (verl loop: `A = s`). Only `singleton` and `nan` of `cfg` are used.
    ///
    /// # Errors
    /// As [`AdvantageKernel::zscore`].
    pub fn rloo(
        &self,
        scores: &[f32],
        groups: &Groups<'_>,
        cfg: &ZScoreConfig,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        self.zscore_like(KIND_RLOO, scores, groups, cfg, out)
    }

    /// Batch-scaled [TRL scale_rewards="batch"]: `A = (s − μ_g)/(σ_batch + ε)`, σ over every
    /// scorable score of the batch (Welford in batch order).
    ///
    /// # Errors
    /// As [`AdvantageKernel::zscore`].
    pub fn batch_scaled(
        &self,
        scores: &[f32],
        groups: &Groups<'_>,
        cfg: &ZScoreConfig,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        ensure(
            !matches!(groups, Groups::Permuted(_)),
            "groups",
            "batch statistics on the GPU need a uniform or CSR layout (batch order)",
        )?;
        self.zscore_like(KIND_BATCH_SCALED, scores, groups, cfg, out)
    }

    fn rank_like(
        &self,
        kind: u32,
        scores: &[f32],
        groups: &Groups<'_>,
        ties: TiePolicy,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        check_len("out", scores.len(), out.len())?;
        let g = Self::gather(groups, scores.len())?;
        Self::check_scores(scores, NanPolicy::Reject)?;
        let gathered = Self::gather_values(&g, scores, 1);
        let needed = if kind == KIND_GOPO { 2 } else { 1 };
        let (singles, zero_var) = Self::check_groups(&g, &gathered, SingletonRule::Zero, needed)?;
        let params = AdvParams {
            groups: g.groups as u32,
            n: scores.len() as u32,
            kind,
            flags: if ties == TiePolicy::Average { FLAG_TIE_AVERAGE } else { 0 },
            eps: 0.0,
            gamma: 1.0,
            singleton: 0,
            k: 1,
        };
        let mut tmp = vec![0f32; out.len()];
        self.dispatch(&g, &gathered, params, &[0.0], &[("group_rank", self.groups_x(g.groups))], &mut tmp)?;
        out.copy_from_slice(&tmp);
        Ok(Diagnostics {
            groups: g.groups,
            zero_variance_groups: zero_var,
            singleton_groups: singles,
            ..Default::default()
        }
        .summarize(out))
    }

    /// GOPO [2602.03876]: `A = 2 − 4(rank − 1)/(G − 1)`, rank 1 = best; ties per `ties`
    /// (`Ordinal`: earlier index ranks first; `Average`: an all-tie group gets 0).
    ///
    /// # Errors
    /// grpo-core's; a group of fewer than 2 samples is `GroupTooSmall`.
    pub fn gopo(
        &self,
        scores: &[f32],
        groups: &Groups<'_>,
        ties: TiePolicy,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        self.rank_like(KIND_GOPO, scores, groups, ties, out)
    }

    /// G²RPO [2604.08539] (our mapping): `A = Φ⁻¹((rank_asc − ½)/G)`, ties share the average
    /// mid-rank, all-equal group → 0, group mean exactly 0. Φ⁻¹ is evaluated in f32.
    ///
    /// # Errors
    /// grpo-core's validation errors.
    pub fn g2rpo(
        &self,
        scores: &[f32],
        groups: &Groups<'_>,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        self.rank_like(KIND_G2RPO, scores, groups, TiePolicy::Average, out)
    }

    /// GDPO [2601.05242] (TRL "normalize_then_sum"): `rewards` is `n × k` sample-major; per
    /// reward `z_k = (r_k − μ_{k,g})/(σ_{k,g} + ε)` (NaN → 0 first; σ unbiased; a group of one
    /// has z = 0), `S = Σ_k w_k z_k`, `A = (S − μ_batch)/(σ_batch + ε)` (σ unbiased). ε = 1e-4
    /// in the paper.
    ///
    /// # Errors
    /// grpo-core's; `weights.len() != k`, `rewards.len() != n·k`, ±∞ rewards, non-finite weights.
    pub fn gdpo(
        &self,
        rewards: &[f32],
        k: usize,
        weights: &[f32],
        groups: &Groups<'_>,
        eps: f32,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        let n = out.len();
        ensure(k > 0, "k", "must be > 0")?;
        check_len("weights", k, weights.len())?;
        check_len("rewards", n * k, rewards.len())?;
        ensure(eps.is_finite() && eps >= 0.0, "eps", "must be finite and >= 0")?;
        if let Some(index) = weights.iter().position(|w| !w.is_finite()) {
            return Err(Error::NonFinite { what: "weights", index }.into());
        }
        if let Some(index) = rewards.iter().position(|r| r.is_infinite()) {
            return Err(Error::NonFinite { what: "rewards", index }.into());
        }
        ensure(
            !matches!(groups, Groups::Permuted(_)),
            "groups",
            "batch statistics on the GPU need a uniform or CSR layout (batch order)",
        )?;
        let g = Self::gather(groups, n)?;
        for kk in 0..g.groups {
            if g.offsets[kk] == g.offsets[kk + 1] {
                return Err(Error::EmptyGroup { group: kk }.into());
            }
        }
        let params = AdvParams {
            groups: g.groups as u32,
            n: n as u32,
            kind: KIND_GDPO,
            flags: FLAG_UNBIASED,
            eps,
            gamma: 1.0,
            singleton: 0,
            k: k as u32,
        };
        let mut tmp = vec![0f32; n];
        self.dispatch(
            &g,
            rewards,
            params,
            weights,
            &[
                ("gdpo_sum", self.groups_x(g.groups)),
                ("batch_moments", [1, 1, 1]),
                ("finish", [(n as u32).div_ceil(64), 1, 1]),
            ],
            &mut tmp,
        )?;
        out.copy_from_slice(&tmp);
        Ok(Diagnostics {
            groups: g.groups,
            nan_excluded: rewards.iter().filter(|r| r.is_nan()).count(),
            ..Default::default()
        }
        .summarize(out))
    }
}
