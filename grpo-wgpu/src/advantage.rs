//! [`AdvantageKernel`]: group-relative advantages (MATH.md §2) on the GPU, the same per-element
//! f32 operations as grpo-core (`shaders/advantage.wgsl`), configured by grpo-core's own config
//! structs so presets mean the same thing on both.
//!
//! The scores are small (one per sample), so every check grpo-core makes runs on the host first,
//! in grpo-core's order and with its error variants; the shaders then see only valid input.
//! Groups of any [`Groups`] layout are gathered contiguously on the host (a no-op for uniform and
//! CSR layouts) and scattered back. Like grpo-core, a non-finite advantage (overflow) is
//! `NonFinite { what: "advantages" }` and leaves `out` untouched.

use bytemuck::{Pod, Zeroable};
use grpo_core::advantage::rank::{G2rpoConfig, GopoConfig};
use grpo_core::advantage::{
    Diagnostics, GdpoConfig, NanPolicy, RlooConfig, Scale, SingletonRule, ZScoreConfig,
};
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
    var_floor: f32,
    batch_eps: f32,
    scale: u32,
    _pad: u32,
}

const KIND_ZSCORE: u32 = 0;
const KIND_RLOO: u32 = 1;
const KIND_GOPO: u32 = 3;
const KIND_G2RPO: u32 = 4;
const KIND_GDPO: u32 = 5;
const FLAG_UNBIASED: u32 = 1;
const FLAG_VAR_FLOOR: u32 = 2;
const FLAG_TIE_AVERAGE: u32 = 8;
const SCALE_GROUP: u32 = 0;
const SCALE_BATCH: u32 = 1;
const SCALE_NONE: u32 = 2;

/// The advantage estimators (`shaders/advantage.wgsl`) on one [`GpuContext`].
///
/// Every operation returns grpo-core's error for an invalid input; besides those, a batch beyond
/// the device's limits is [`crate::GpuError::TooLarge`] or [`crate::GpuError::TooManyWorkgroups`]
/// (more groups than one 2-D dispatch holds), and a device failure [`crate::GpuError::Device`].
#[derive(Debug, Clone, Copy)]
pub struct AdvantageKernel<'c> {
    ctx: &'c GpuContext,
}

/// Samples of each group made contiguous: `order[j]` is the caller index at gathered position j
/// (`None`: the identity).
struct Gathered {
    groups: usize,
    offsets: Vec<u32>,
    order: Option<Vec<usize>>,
}

impl Gathered {
    fn new(groups: &Groups<'_>, num_groups: usize) -> Self {
        let mut offsets = Vec::with_capacity(num_groups + 1);
        offsets.push(0u32);
        let permuted = matches!(groups, Groups::Permuted(_));
        let mut order = Vec::new();
        let mut end = 0usize;
        for k in 0..num_groups {
            if permuted {
                order.extend(groups.members(k));
                end = order.len();
            } else {
                end += groups.size(k);
            }
            offsets.push(end as u32);
        }
        Gathered {
            groups: num_groups,
            offsets,
            order: permuted.then_some(order),
        }
    }

    fn values(&self, values: &[f32], stride: usize) -> Vec<f32> {
        match &self.order {
            None => values.to_vec(),
            Some(order) => order
                .iter()
                .flat_map(|&i| values[i * stride..(i + 1) * stride].iter().copied())
                .collect(),
        }
    }

    fn span(&self, k: usize) -> core::ops::Range<usize> {
        self.offsets[k] as usize..self.offsets[k + 1] as usize
    }

    /// Caller index of gathered position j.
    fn caller(&self, j: usize) -> usize {
        self.order.as_ref().map_or(j, |o| o[j])
    }
}

/// group_scan::validate_groups: layout, then the first empty group.
fn validate_groups(groups: &Groups<'_>, n: usize) -> Result<usize> {
    let num_groups = groups.validate(n)?;
    if let Some(group) = (0..num_groups).find(|&k| groups.size(k) == 0) {
        return Err(Error::EmptyGroup { group }.into());
    }
    Ok(num_groups)
}

/// group_scan::check_values: NaN per policy, ±∞ always; returns the NaN count.
fn check_values(what: &'static str, values: &[f32], nan: NanPolicy) -> Result<usize> {
    let mut nans = 0;
    for (index, &v) in values.iter().enumerate() {
        if v.is_nan() {
            if nan == NanPolicy::Reject {
                return Err(Error::NonFinite { what, index }.into());
            }
            nans += 1;
        } else if !v.is_finite() {
            return Err(Error::NonFinite { what, index }.into());
        }
    }
    Ok(nans)
}

/// rank.rs::normal_score in f64 (grpo-core's `norm_quantile`), mirrored so opposite ranks are
/// exact negatives.
fn normal_score(r: usize, g: usize) -> f64 {
    let mirror = g + 1 - r;
    if 2 * r == g + 1 {
        0.0
    } else if r > mirror {
        -normal_score(mirror, g)
    } else {
        grpo_core::stats::norm_quantile((2 * r - 1) as f64 / (2 * g) as f64).unwrap_or(0.0)
    }
}

/// One table of normal scores (rounded to f32) per distinct scorable group size, and each
/// group's offset into it.
fn normal_score_tables(g: &Gathered, gathered: &[f32]) -> (Vec<f32>, Vec<u32>) {
    let mut table = vec![0.0f32];
    let mut base_of: std::collections::HashMap<usize, u32> = std::collections::HashMap::new();
    let mut bases = Vec::with_capacity(g.groups);
    for k in 0..g.groups {
        let count = gathered[g.span(k)].iter().filter(|s| !s.is_nan()).count();
        let base = *base_of.entry(count).or_insert_with(|| {
            let b = table.len() as u32;
            table.extend((1..=count).map(|r| normal_score(r, count) as f32));
            b
        });
        bases.push(base);
    }
    (table, bases)
}

fn nonneg(name: &'static str, v: f64) -> Result<()> {
    ensure(v.is_finite() && v >= 0.0, name, "must be finite and >= 0")
}

impl<'c> AdvantageKernel<'c> {
    /// The estimators on `ctx`.
    pub fn new(ctx: &'c GpuContext) -> Self {
        AdvantageKernel { ctx }
    }

    /// Runs `passes`, then checks the advantages (in grpo-core's emission order: groups, then
    /// members) and scatters them into `out`. Returns the per-group (zero-spread, count) words.
    fn dispatch(
        &self,
        g: &Gathered,
        values: &[f32],
        params: AdvParams,
        weights: &[f32],
        table_base: &[u32],
        passes: &[(&'static str, [u32; 3])],
        out: &mut [f32],
    ) -> Result<Vec<u32>> {
        let n = out.len();
        self.ctx
            .check_items("scores", values.len().max(g.offsets.len()))?;
        let res = self.ctx.run(
            ShaderId::Advantage,
            &[
                (0, Arg::In(bytemuck::cast_slice(values))),
                (1, Arg::In(bytemuck::cast_slice(&g.offsets))),
                (2, Arg::Out((n * 4) as u64)),
                (3, Arg::Out(16)),
                (4, Arg::Uniform(bytemuck::bytes_of(&params))),
                (5, Arg::In(bytemuck::cast_slice(weights))),
                (6, Arg::Out((2 * g.groups * 4) as u64)),
                (7, Arg::In(bytemuck::cast_slice(table_base))),
            ],
            passes,
        )?;
        let a: &[f32] = bytemuck::cast_slice(&res[0]);
        for k in 0..g.groups {
            for j in g.span(k) {
                if !a[j].is_finite() {
                    return Err(Error::NonFinite {
                        what: "advantages",
                        index: g.caller(j),
                    }
                    .into());
                }
            }
        }
        for j in 0..n {
            out[g.caller(j)] = a[j];
        }
        Ok(bytemuck::cast_slice::<u8, u32>(&res[2])[..2 * g.groups].to_vec())
    }

    /// One invocation per group (2-D beyond the per-dimension workgroup limit).
    fn groups_x(&self, g: usize) -> Result<[u32; 3]> {
        self.ctx.grid(g, 64)
    }

    /// The first group with exactly one scorable member when singletons are rejected.
    fn reject_singletons(g: &Gathered, gathered: &[f32], rule: SingletonRule) -> Result<()> {
        if rule != SingletonRule::Reject {
            return Ok(());
        }
        for k in 0..g.groups {
            if gathered[g.span(k)].iter().filter(|s| !s.is_nan()).count() == 1 {
                return Err(Error::GroupTooSmall {
                    group: k,
                    needed: 2,
                    found: 1,
                }
                .into());
            }
        }
        Ok(())
    }

    fn diagnostics(
        words: &[u32],
        g: &Gathered,
        nan_excluded: usize,
        out: &[f32],
    ) -> Diagnostics<f32> {
        let mut d = Diagnostics {
            groups: g.groups,
            nan_excluded,
            ..Diagnostics::default()
        };
        for w in words.chunks_exact(2) {
            d.zero_variance_groups += w[0] as usize;
            d.singleton_groups += (w[1] == 1) as usize;
        }
        d.summarize(out)
    }

    /// GRPO z-score family, grpo-core's [`grpo_core::advantage::zscore()`]:
    /// `A = (s − μ_g)/(σ + ε)^γ` with σ of the group (`Scale::Group`), of the batch
    /// (`Scale::Batch`, TRL scale_rewards="batch"), or no division (`Scale::None`, Dr.GRPO);
    /// singleton rule, NaN policy, Bessel choice and variance floor as configured.
    ///
    /// ```
    /// use grpo_core::advantage::ZScoreConfig;
    /// use grpo_core::{Error, Groups, Preset};
    /// use grpo_wgpu::{AdvantageKernel, GpuContext, GpuError};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = AdvantageKernel::new(&ctx);
    /// // Groups [3, 1, 0, 0] and [0.5, 0.5]; default ε = 1e-6, σ unbiased. Group 0: μ = 1,
    /// // var = (4 + 0 + 1 + 1)/3 = 2: A = (2, 0, −1, −1)/(√2 + 1e-6) = (1.4142126, 0, −0.7071063,
    /// // −0.7071063). Group 1 has no spread: exactly 0.
    /// let (scores, groups) = ([3.0f32, 1.0, 0.0, 0.0, 0.5, 0.5], Groups::Offsets(&[0, 4, 6]));
    /// let mut adv = [9.0f32; 6];
    /// let d = k.zscore(&scores, groups, &ZScoreConfig::default(), &mut adv)?;
    /// let want = [1.4142126, 0.0, -0.7071063, -0.7071063, 0.0, 0.0];
    /// assert!(adv.iter().zip(want).all(|(a, w)| (a - w).abs() < 1e-6));
    /// assert_eq!((adv[4], adv[5], d.zero_variance_groups), (0.0, 0.0, 1));
    /// // Dr. GRPO (no division): A = s − μ = (2, 0, −1, −1, 0, 0), μ within rounding (Welford).
    /// k.zscore(&scores, groups, &ZScoreConfig::dr_grpo(), &mut adv)?;
    /// let want = [2.0, 0.0, -1.0, -1.0, 0.0, 0.0];
    /// assert!(adv.iter().zip(want).all(|(a, w)| (a - w).abs() < 1e-6));
    /// // OpenRLHF refuses a singleton group (its n − 1 = 0 would give NaN); `adv` is untouched.
    /// let cfg = ZScoreConfig::from_preset(Preset::OpenRlhf);
    /// let e = k.zscore(&[1.0, 0.0, 2.0], Groups::Offsets(&[0, 2, 3]), &cfg, &mut adv[..3]);
    /// assert_eq!(e, Err(GpuError::Core(Error::GroupTooSmall { group: 1, needed: 2, found: 1 })));
    /// assert!(adv.iter().zip(want).all(|(a, w)| (a - w).abs() < 1e-6));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input.
    pub fn zscore(
        &self,
        scores: &[f32],
        groups: Groups<'_>,
        cfg: &ZScoreConfig,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        let n = scores.len();
        check_len("out", n, out.len())?;
        cfg.validate()?;
        let num_groups = validate_groups(&groups, n)?;
        let nans = check_values("scores", scores, cfg.nan)?;
        let g = Gathered::new(&groups, num_groups);
        let gathered = g.values(scores, 1);
        Self::reject_singletons(&g, &gathered, cfg.singleton)?;
        let mut flags = 0;
        if cfg.bessel == Bessel::Unbiased {
            flags |= FLAG_UNBIASED;
        }
        if cfg.var_floor.is_some() {
            flags |= FLAG_VAR_FLOOR;
        }
        let scale = match cfg.scale {
            Scale::Group => SCALE_GROUP,
            Scale::Batch => SCALE_BATCH,
            Scale::None => SCALE_NONE,
        };
        let params = AdvParams {
            groups: num_groups as u32,
            n: n as u32,
            kind: KIND_ZSCORE,
            flags,
            eps: cfg.eps as f32,
            gamma: cfg.gamma as f32,
            singleton: (cfg.singleton == SingletonRule::VerlLoop) as u32,
            k: 1,
            var_floor: cfg.var_floor.unwrap_or(0.0) as f32,
            batch_eps: 0.0,
            scale,
            _pad: 0,
        };
        let mut passes = vec![];
        if cfg.scale == Scale::Batch {
            passes.push(("batch_moments", [1, 1, 1]));
        }
        passes.push(("group_stats", self.groups_x(num_groups)?));
        let mut tmp = vec![0f32; n];
        let words = self.dispatch(&g, &gathered, params, &[0.0], &[0], &passes, &mut tmp)?;
        out.copy_from_slice(&tmp);
        Ok(Self::diagnostics(&words, &g, nans, out))
    }

    /// RLOO, grpo-core's [`grpo_core::advantage::rloo()`]:
    /// `A_i = s_i − mean_{j≠i} s_j = (s_i − μ)·n/(n − 1)`; singleton per the config (verl loop:
    /// `A = s`).
    ///
    /// ```
    /// use grpo_core::advantage::RlooConfig;
    /// use grpo_core::{Error, Groups, Preset};
    /// use grpo_wgpu::{AdvantageKernel, GpuContext, GpuError};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = AdvantageKernel::new(&ctx);
    /// // Group [3, 1, 2]: 3 − (1 + 2)/2 = 1.5, 1 − (3 + 2)/2 = −1.5, 2 − (3 + 1)/2 = 0
    /// // (= (s − 2)·3/2); the singleton [5] gets 0 by default.
    /// let (scores, groups) = ([3.0f32, 1.0, 2.0, 5.0], Groups::Offsets(&[0, 3, 4]));
    /// let mut adv = [9.0f32; 4];
    /// let d = k.rloo(&scores, groups, &RlooConfig::default(), &mut adv)?;
    /// assert_eq!((adv, d.singleton_groups), ([1.5, -1.5, 0.0, 0.0], 1));
    /// // verl's loop keeps a singleton's score (baseline 0).
    /// k.rloo(&scores, groups, &RlooConfig::from_preset(Preset::Verl), &mut adv)?;
    /// assert_eq!(adv, [1.5, -1.5, 0.0, 5.0]);
    /// // OpenRLHF refuses the singleton (it would divide by n − 1 = 0); `adv` is untouched.
    /// let e = k.rloo(&scores, groups, &RlooConfig::from_preset(Preset::OpenRlhf), &mut adv);
    /// assert_eq!(e, Err(GpuError::Core(Error::GroupTooSmall { group: 1, needed: 2, found: 1 })));
    /// assert_eq!(adv, [1.5, -1.5, 0.0, 5.0]);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input.
    pub fn rloo(
        &self,
        scores: &[f32],
        groups: Groups<'_>,
        cfg: &RlooConfig,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        let n = scores.len();
        check_len("out", n, out.len())?;
        let num_groups = validate_groups(&groups, n)?;
        let nans = check_values("scores", scores, cfg.nan)?;
        let g = Gathered::new(&groups, num_groups);
        let gathered = g.values(scores, 1);
        Self::reject_singletons(&g, &gathered, cfg.singleton)?;
        let params = AdvParams {
            groups: num_groups as u32,
            n: n as u32,
            kind: KIND_RLOO,
            singleton: (cfg.singleton == SingletonRule::VerlLoop) as u32,
            k: 1,
            gamma: 1.0,
            ..Zeroable::zeroed()
        };
        let mut tmp = vec![0f32; n];
        let words = self.dispatch(
            &g,
            &gathered,
            params,
            &[0.0],
            &[0],
            &[("group_stats", self.groups_x(num_groups)?)],
            &mut tmp,
        )?;
        out.copy_from_slice(&tmp);
        Ok(Self::diagnostics(&words, &g, nans, out))
    }

    /// rank.rs::validate: layout, `out` length, finiteness (NaN per policy), then empty and
    /// too-small groups (by member count) in group order.
    fn rank_validate(
        scores: &[f32],
        groups: &Groups<'_>,
        nan: NanPolicy,
        out: &[f32],
        min_group: usize,
    ) -> Result<usize> {
        let n = scores.len();
        let num_groups = groups.validate(n)?;
        check_len("out", n, out.len())?;
        for (index, s) in scores.iter().enumerate() {
            let excluded_nan = nan == NanPolicy::Exclude && s.is_nan();
            if !s.is_finite() && !excluded_nan {
                return Err(Error::NonFinite {
                    what: "scores",
                    index,
                }
                .into());
            }
        }
        for k in 0..num_groups {
            let size = groups.size(k);
            if size == 0 {
                return Err(Error::EmptyGroup { group: k }.into());
            }
            if size < min_group {
                return Err(Error::GroupTooSmall {
                    group: k,
                    needed: min_group,
                    found: size,
                }
                .into());
            }
        }
        Ok(num_groups)
    }

    fn rank_like(
        &self,
        kind: u32,
        ties: TiePolicy,
        scores: &[f32],
        groups: Groups<'_>,
        num_groups: usize,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        let n = scores.len();
        let g = Gathered::new(&groups, num_groups);
        let gathered = g.values(scores, 1);
        let params = AdvParams {
            groups: num_groups as u32,
            n: n as u32,
            kind,
            flags: if ties == TiePolicy::Average {
                FLAG_TIE_AVERAGE
            } else {
                0
            },
            gamma: 1.0,
            k: 1,
            ..Zeroable::zeroed()
        };
        let (table, bases) = if kind == KIND_G2RPO {
            normal_score_tables(&g, &gathered)
        } else {
            (vec![0.0], vec![0])
        };
        let mut tmp = vec![0f32; n];
        let words = self.dispatch(
            &g,
            &gathered,
            params,
            &table,
            &bases,
            &[("group_rank", self.groups_x(num_groups)?)],
            &mut tmp,
        )?;
        out.copy_from_slice(&tmp);
        let nans = scores.iter().filter(|s| s.is_nan()).count();
        Ok(Self::diagnostics(&words, &g, nans, out))
    }

    /// GOPO [2602.03876], grpo-core's [`grpo_core::advantage::rank::gopo`]:
    /// `A = 2 − 4(rank − 1)/(G − 1)`, rank 1 = best, among the scorable members; ties per config.
    ///
    /// ```
    /// use grpo_core::advantage::rank::GopoConfig;
    /// use grpo_core::stats::TiePolicy;
    /// use grpo_core::{Error, Groups};
    /// use grpo_wgpu::{AdvantageKernel, GpuContext, GpuError};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = AdvantageKernel::new(&ctx);
    /// // Average ties. [0.1, 0.9, 0.5]: ranks 3, 1, 2, A = 2 − 2(rank − 1) = −2, 2, 0.
    /// // [1, 3, 3, 0]: ranks 3, 1.5, 1.5, 4, A = 2 − (4/3)(rank − 1) = −2/3, 4/3, 4/3, −2.
    /// let cfg = GopoConfig { ties: TiePolicy::Average, ..GopoConfig::default() };
    /// let scores = [0.1f32, 0.9, 0.5, 1.0, 3.0, 3.0, 0.0];
    /// let mut adv = [9.0f32; 7];
    /// k.gopo(&scores, Groups::Offsets(&[0, 3, 7]), &cfg, &mut adv)?;
    /// let want = [-2.0, 2.0, 0.0, -2.0 / 3.0, 4.0 / 3.0, 4.0 / 3.0, -2.0];
    /// assert!(adv.iter().zip(want).all(|(a, w)| (a - w).abs() < 1e-6));
    /// // A group of one has nothing to rank against: an error, and `adv` is untouched.
    /// let e = k.gopo(&scores, Groups::Offsets(&[0, 1, 7]), &cfg, &mut adv);
    /// assert_eq!(e, Err(GpuError::Core(Error::GroupTooSmall { group: 0, needed: 2, found: 1 })));
    /// assert!(adv.iter().zip(want).all(|(a, w)| (a - w).abs() < 1e-6));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's (a group of fewer than 2 members is `GroupTooSmall`).
    pub fn gopo(
        &self,
        scores: &[f32],
        groups: Groups<'_>,
        cfg: &GopoConfig,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        let num_groups = Self::rank_validate(scores, &groups, cfg.nan, out, 2)?;
        self.rank_like(KIND_GOPO, cfg.ties, scores, groups, num_groups, out)
    }

    /// G²RPO [2604.08539], grpo-core's [`grpo_core::advantage::rank::g2rpo`]: normal scores
    /// `Φ⁻¹((2r − 1)/(2G))` of the ascending ranks, averaged over tie blocks; mean exactly 0.
    /// The normal scores come from the host (grpo-core's f64 Φ⁻¹ rounded to f32); the GPU
    /// ranks, averages the scores of tie blocks in f32 and writes them (see the tolerance table).
    ///
    /// ```
    /// use grpo_core::advantage::rank::G2rpoConfig;
    /// use grpo_core::{Error, Groups};
    /// use grpo_wgpu::{AdvantageKernel, GpuContext, GpuError};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = AdvantageKernel::new(&ctx);
    /// // [0.5, 0, 0.9, 0.2]: ascending ranks 3, 1, 4, 2, A = Φ⁻¹((2r − 1)/8) with
    /// // Φ⁻¹(1/8) = −1.1503494, Φ⁻¹(3/8) = −0.3186394. [0, 0, 1]: ranks 1–2 tie and share
    /// // (Φ⁻¹(1/6) + Φ⁻¹(1/2))/2 = −0.9674216/2 = −0.4837108; rank 3 gets Φ⁻¹(5/6) = 0.9674216.
    /// let scores = [0.5f32, 0.0, 0.9, 0.2, 0.0, 0.0, 1.0];
    /// let mut adv = [9.0f32; 7];
    /// k.g2rpo(&scores, Groups::Offsets(&[0, 4, 7]), &G2rpoConfig::default(), &mut adv)?;
    /// let (q1, q3, t) = (1.1503494, 0.3186394, 0.9674216);
    /// let want = [q3, -q1, q1, -q3, -t / 2.0, -t / 2.0, t];
    /// assert!(adv.iter().zip(want).all(|(a, w)| (a - w).abs() < 2e-6));
    /// // NaN is rejected by default (at its index); `adv` is untouched.
    /// let cfg = G2rpoConfig::default();
    /// let e = k.g2rpo(&[0.5, f32::NAN], Groups::Uniform(2), &cfg, &mut adv[..2]);
    /// assert_eq!(e, Err(GpuError::Core(Error::NonFinite { what: "scores", index: 1 })));
    /// assert!((adv[0] - q3).abs() < 2e-6 && (adv[1] + q1).abs() < 2e-6);
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input.
    pub fn g2rpo(
        &self,
        scores: &[f32],
        groups: Groups<'_>,
        cfg: &G2rpoConfig,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        let num_groups = Self::rank_validate(scores, &groups, cfg.nan, out, 1)?;
        self.rank_like(
            KIND_G2RPO,
            TiePolicy::Average,
            scores,
            groups,
            num_groups,
            out,
        )
    }

    /// GDPO [2601.05242], grpo-core's [`grpo_core::advantage::gdpo()`]: `rewards` is `n × k`
    /// sample-major; per reward `z_k = (r_k − μ_{k,g})/(σ_{k,g} + ε_r)`, `S = Σ_k w_k z_k`,
    /// `A = (S − μ_batch)/(σ_batch + ε_b)`; under [`NanPolicy::Exclude`] a NaN reward is left
    /// out of its statistics and of `S`, and a sample of NaN rewards only gets 0, as in
    /// grpo-core.
    ///
    /// ```
    /// use grpo_core::advantage::GdpoConfig;
    /// use grpo_core::{Error, Groups};
    /// use grpo_wgpu::{AdvantageKernel, GpuContext, GpuError};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// let k = AdvantageKernel::new(&ctx);
    /// // Two rewards per sample, weights (1, 0.5), ε_r = ε_b = 1e-4, σ unbiased. A pair (1, 0)
    /// // has μ = 0.5, σ = √0.5: z = ±c, c = 0.5/(√0.5 + 1e-4) = 0.7070068; a tied pair z = 0.
    /// // Group 0, (1, 0) and (0, 1): S = ±(c − c/2) = ±c/2. Group 1, (1, 1) and (1, 0): reward 0
    /// // ties, S = ±c/2 from reward 1. Batch: μ = 0, σ = c/√3: A = ±(c/2)/(c/√3 + 1e-4)
    /// // = ±0.8658133.
    /// let rewards = [1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0];
    /// let (weights, cfg) = ([1.0f32, 0.5], GdpoConfig::default());
    /// let mut adv = [9.0f32; 4];
    /// k.gdpo(&rewards, 2, &weights, Groups::Uniform(2), &cfg, &mut adv)?;
    /// let want = [0.8658133, -0.8658133, 0.8658133, -0.8658133];
    /// assert!(adv.iter().zip(want).all(|(a, w)| (a - w).abs() < 1e-6));
    /// // One weight per reward: a third is a length mismatch, and `adv` is untouched.
    /// let e = k.gdpo(&rewards, 2, &[1.0, 0.5, 1.0], Groups::Uniform(2), &cfg, &mut adv);
    /// let mismatch = Error::LengthMismatch { what: "weights", expected: 2, found: 3 };
    /// assert_eq!(e, Err(GpuError::Core(mismatch)));
    /// assert!(adv.iter().zip(want).all(|(a, w)| (a - w).abs() < 1e-6));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// Exactly grpo-core's for the same input (no scratch is needed here).
    pub fn gdpo(
        &self,
        rewards: &[f32],
        num_rewards: usize,
        weights: &[f32],
        groups: Groups<'_>,
        cfg: &GdpoConfig,
        out: &mut [f32],
    ) -> Result<Diagnostics<f32>> {
        let n = out.len();
        let kk = num_rewards;
        ensure(kk > 0, "num_rewards", "must be > 0")?;
        let total = n.checked_mul(kk).ok_or(Error::InvalidParam {
            name: "num_rewards",
            reason: "samples × rewards overflows usize",
        })?;
        check_len("rewards", total, rewards.len())?;
        check_len("weights", kk, weights.len())?;
        if let Some(index) = weights.iter().position(|w| !w.is_finite()) {
            return Err(Error::NonFinite {
                what: "weights",
                index,
            }
            .into());
        }
        nonneg("reward_eps", cfg.reward_eps)?;
        nonneg("batch_eps", cfg.batch_eps)?;
        let num_groups = validate_groups(&groups, n)?;
        let nans = check_values("rewards", rewards, cfg.nan)?;
        if cfg.singleton == SingletonRule::Reject
            && let Some(group) = (0..num_groups).find(|&k| groups.size(k) == 1)
        {
            return Err(Error::GroupTooSmall {
                group,
                needed: 2,
                found: 1,
            }
            .into());
        }
        let g = Gathered::new(&groups, num_groups);
        let gathered = g.values(rewards, kk);
        let params = AdvParams {
            groups: num_groups as u32,
            n: n as u32,
            kind: KIND_GDPO,
            flags: if cfg.bessel == Bessel::Unbiased {
                FLAG_UNBIASED
            } else {
                0
            },
            eps: cfg.reward_eps as f32,
            gamma: 1.0,
            singleton: (cfg.singleton == SingletonRule::VerlLoop) as u32,
            k: kk as u32,
            var_floor: 0.0,
            batch_eps: cfg.batch_eps as f32,
            scale: SCALE_GROUP,
            _pad: 0,
        };
        let mut tmp = vec![0f32; n];
        let words = self.dispatch(
            &g,
            &gathered,
            params,
            weights,
            &[0],
            &[
                ("gdpo_sum", self.groups_x(num_groups)?),
                ("batch_moments", [1, 1, 1]),
                ("finish", self.ctx.grid(n, 64)?),
            ],
            &mut tmp,
        )?;
        out.copy_from_slice(&tmp);
        Ok(Self::diagnostics(&words, &g, nans, out))
    }
}
