//! grpo-wgpu's per-token losses and KL penalties against grpo-core in f32 (same config structs),
//! within the tolerance table; identical errors with outputs untouched. Skips without an adapter
//! unless `GRPO_REQUIRE_GPU=1`.

use grpo_core::divergence::kl_penalty::kl_penalty;
use grpo_core::divergence::measures::TokenDiagnostics;
use grpo_core::divergence::{KlEstimator, KlPenaltyConfig, RatioBounds};
use grpo_core::is_correction::{IS_NORMALIZE_MIN_MEAN, IsConfig, IsFilter, IsLevel, is_weights};
use grpo_core::loss::{
    CispoConfig, GspoConfig, GspoTokenConfig, P3oConfig, PolicyInputs, PpoClipConfig, SapoConfig,
    cispo, ess_stats, gspo, gspo_token, p3o, ppo_clip, reinforce, sapo,
};
use grpo_core::{Error, Preset, Real, Tokens};
use grpo_tests::gpu;
use grpo_tests::tolerance::{Dtype, Op, Tol, exp_ulps, flush_subnormal, tolerance, ulp_distance};
use grpo_wgpu::{GpuError, LossKernel};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Batch {
    lp: Vec<f32>,
    old: Vec<f32>,
    adv: Vec<f32>,
    cu: Vec<usize>,
    mask: Vec<bool>,
}

impl Batch {
    fn tokens(&self) -> Tokens<'_> {
        Tokens::packed(&self.cu, Some(&self.mask))
    }
    fn inputs(&self) -> PolicyInputs<'_, f32> {
        PolicyInputs {
            lp: &self.lp,
            old: &self.old,
            adv: &self.adv,
            tokens: self.tokens(),
        }
    }
}

/// Log-probs near typical values, log-ratios from tiny to ±80 (past the ±20 clamp), advantages
/// including 0, and NaN garbage in masked positions.
fn batch() -> impl Strategy<Value = Batch> {
    prop::collection::vec(0usize..40, 1..6)
        .prop_flat_map(|lens| {
            let n: usize = lens.iter().sum();
            let log_ratio = prop_oneof![
                4 => -0.5f32..0.5,
                2 => -3.0f32..3.0,
                1 => -80.0f32..80.0,
                1 => Just(0.0f32),
            ];
            let adv = prop_oneof![
                3 => -3.0f32..3.0,
                1 => Just(0.0f32),
                1 => Just(1.0f32),
                1 => Just(-1.0f32),
            ];
            (
                Just(lens),
                prop::collection::vec(-12.0f32..0.0, n),
                prop::collection::vec(log_ratio, n),
                prop::collection::vec(adv, n),
                prop::collection::vec(prop::bool::weighted(0.85), n),
            )
        })
        .prop_map(|(lens, lp, x, adv, mask)| {
            let mut cu = vec![0];
            for l in lens {
                cu.push(cu.last().unwrap() + l);
            }
            let old: Vec<f32> = lp.iter().zip(&x).map(|(l, x)| l - x).collect();
            let mut b = Batch {
                lp,
                old,
                adv,
                cu,
                mask,
            };
            for t in 0..b.lp.len() {
                if !b.mask[t] {
                    b.lp[t] = f32::NAN;
                    b.adv[t] = f32::INFINITY;
                }
            }
            b
        })
}

/// Whether ρ = e^{clamp(x)} is within 64 ULP of a branch point, where an exp that differs in the
/// last bits may pick the other branch (the gradient jumps there; both are correct).
fn near_branch(b: &Batch, t: usize, clamp: Option<f32>, points: &[f32]) -> bool {
    let mut x = b.lp[t] - b.old[t];
    if let Some(c) = clamp {
        x = x.clamp(-c, c);
    }
    let rho = Real::exp(x);
    points.iter().any(|&p| ulp_distance(rho, p) <= 64)
}

/// The clamped log-ratio of token t (the argument of the formula's exp).
fn log_ratio(b: &Batch, t: usize, clamp: Option<f32>) -> f64 {
    let x = b.lp[t] - b.old[t];
    clamp.map_or(x, |c| x.clamp(-c, c)) as f64
}

/// Largest ULP distance (value or gradient) seen by `compare` in this process.
static MAX_ULP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn compare(
    b: &Batch,
    (gv, gg): (&[f32], &[f32]),
    (cv, cg): (&[f32], &[f32]),
    tol: Tol,
    skip: &dyn Fn(usize) -> bool,
    exp_args: &dyn Fn(usize) -> Vec<f64>,
    flush_scale: &dyn Fn(usize) -> f64,
) -> Result<(), TestCaseError> {
    for t in 0..b.lp.len() {
        if !b.mask[t] {
            prop_assert_eq!((gv[t], gg[t]), (0.0, 0.0));
            continue;
        }
        if skip(t) {
            continue;
        }
        // A subnormal intermediate may be flushed to 0 and then scaled by `flush_scale(t)`.
        // (Values that a flushed subnormal intermediate can zero are left out of the statistic.)
        for (g, c) in [(gv[t], cv[t]), (gg[t], cg[t])] {
            if c != 0.0 && c.abs() < 1e-28 {
                continue;
            }
            MAX_ULP.fetch_max(ulp_distance(g, c), std::sync::atomic::Ordering::Relaxed);
        }
        let tol = tol.plus_ulp(exp_ulps(&exp_args(t)));
        let tol = tol.with_abs(tol.abs * flush_scale(t).max(1.0));
        prop_assert!(
            tol.accepts(gv[t], cv[t] as f64),
            "value[{t}] gpu {} core {} ({} ulp)",
            gv[t],
            cv[t],
            ulp_distance(gv[t], cv[t])
        );
        prop_assert!(
            tol.accepts(gg[t], cg[t] as f64),
            "grad[{t}] gpu {} core {} ({} ulp)",
            gg[t],
            cg[t],
            ulp_distance(gg[t], cg[t])
        );
    }
    Ok(())
}

fn ppo_configs() -> Vec<PpoClipConfig<f32>> {
    let mut v: Vec<PpoClipConfig<f32>> =
        [Preset::Paper, Preset::Verl, Preset::Trl, Preset::OpenRlhf]
            .into_iter()
            .map(PpoClipConfig::from_preset)
            .collect();
    v.push(PpoClipConfig::dapo());
    v.push(PpoClipConfig {
        bounds: RatioBounds::kl3(0.05).unwrap(),
        ..PpoClipConfig::default()
    });
    v.push(PpoClipConfig {
        delta_cap: Some(1.5),
        dual_clip: Some(3.0),
        ..PpoClipConfig::default()
    });
    v
}

#[test]
fn ppo_clip_matches_grpo_core() {
    let Some(ctx) = gpu::context("ppo_clip_matches_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let configs = ppo_configs();
    for cfg in &configs {
        gpu::runner()
            .run(&batch(), |b| {
                let n = b.lp.len();
                let (mut cv, mut cg) = (vec![0f32; n], vec![0f32; n]);
                let dc = ppo_clip(cfg, &b.inputs(), &mut cv, &mut cg);
                let (mut gv, mut gg) = (vec![0f32; n], vec![0f32; n]);
                let dg = k.ppo_clip(cfg, &b.inputs(), &mut gv, &mut gg);
                let (dc, dg) = match (dc, dg) {
                    (Ok(a), Ok(b)) => (a, b),
                    (Err(e), g) => {
                        prop_assert_eq!(g.map(|_| ()), Err(GpuError::Core(e)));
                        return Ok(());
                    }
                    (Ok(_), Err(e)) => return Err(TestCaseError::fail(e.to_string())),
                };
                let mut points = vec![cfg.bounds.lo, cfg.bounds.hi];
                points.extend(cfg.delta_cap);
                let skip = |t: usize| near_branch(&b, t, cfg.log_ratio_clamp, &points);
                let args = |t: usize| vec![log_ratio(&b, t, cfg.log_ratio_clamp)];
                compare(
                    &b,
                    (&gv, &gg),
                    (&cv, &cg),
                    tolerance(Op::LossExp, Dtype::F32),
                    &skip,
                    &args,
                    &|_| 1.0,
                )?;
                if !(0..n).any(|t| b.mask[t] && skip(t)) {
                    prop_assert_eq!(dc, dg);
                }
                Ok(())
            })
            .unwrap();
    }
    eprintln!(
        "ppo_clip: {} configs × {} cases",
        configs.len(),
        gpu::cases()
    );
    eprintln!(
        "ppo_clip: {} cases per config; max distance to grpo-core so far: {} ULP",
        gpu::cases(),
        MAX_ULP.load(std::sync::atomic::Ordering::Relaxed)
    );
}

#[test]
fn cispo_and_sapo_match_grpo_core() {
    let Some(ctx) = gpu::context("cispo_and_sapo_match_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    for cfg in [
        CispoConfig::from_preset(Preset::Verl),
        CispoConfig::from_preset(Preset::Trl),
    ] {
        gpu::runner()
            .run(&batch(), |b| {
                let n = b.lp.len();
                let (mut cv, mut cg) = (vec![0f32; n], vec![0f32; n]);
                cispo(&cfg, &b.inputs(), &mut cv, &mut cg).unwrap();
                let (mut gv, mut gg) = (vec![0f32; n], vec![0f32; n]);
                k.cispo(&cfg, &b.inputs(), &mut gv, &mut gg).unwrap();
                let points = match cfg.weight {
                    grpo_core::loss::CispoWeight::Clamp(r) => vec![r.lo, r.hi],
                    grpo_core::loss::CispoWeight::Cap(c) => vec![c],
                };
                let skip = |t: usize| near_branch(&b, t, cfg.log_ratio_clamp, &points);
                let args = |t: usize| vec![log_ratio(&b, t, cfg.log_ratio_clamp)];
                compare(
                    &b,
                    (&gv, &gg),
                    (&cv, &cg),
                    tolerance(Op::LossExp, Dtype::F32),
                    &skip,
                    &args,
                    &|_| 1.0,
                )
            })
            .unwrap();
    }
    for cfg in [
        SapoConfig::from_preset(Preset::Paper),
        SapoConfig::from_preset(Preset::Trl),
    ] {
        gpu::runner()
            .run(&batch(), |b| {
                let n = b.lp.len();
                let (mut cv, mut cg) = (vec![0f32; n], vec![0f32; n]);
                let c = sapo(&cfg, &b.inputs(), &mut cv, &mut cg);
                let (mut gv, mut gg) = (vec![0f32; n], vec![0f32; n]);
                let g = k.sapo(&cfg, &b.inputs(), &mut gv, &mut gg);
                match (c, g) {
                    (Ok(_), Ok(_)) => {}
                    (Err(e), g) => {
                        prop_assert_eq!(g.map(|_| ()), Err(GpuError::Core(e)));
                        return Ok(());
                    }
                    (Ok(_), Err(e)) => return Err(TestCaseError::fail(e.to_string())),
                }
                // SAPO evaluates e^x (ρ) and e^{−|z|} with z = τ(ρ − 1) (sigmoid and its slope).
                let args = |t: usize| {
                    let x = log_ratio(&b, t, cfg.log_ratio_clamp);
                    let tau = if b.adv[t] > 0.0 {
                        cfg.tau_pos
                    } else {
                        cfg.tau_neg
                    } as f64;
                    // ρ's error (3 + 2|x| ULP) is amplified |τρ| times in e^{−|z|}; pass it as an
                    // exp argument a with 2|a| = |τρ|·(3 + 2|x|).
                    let z = tau * (x.exp() - 1.0);
                    let propagated = (tau * x.exp()).abs() * (3.0 + 2.0 * x.abs()) / 2.0;
                    vec![x, x, z, propagated]
                };
                // The slope σ'(z) may flush to 0 before it is multiplied by 4|A|ρ.
                let flush = |t: usize| {
                    4.0 * (b.adv[t] as f64).abs() * log_ratio(&b, t, cfg.log_ratio_clamp).exp()
                };
                compare(
                    &b,
                    (&gv, &gg),
                    (&cv, &cg),
                    tolerance(Op::LossExp, Dtype::F32),
                    &|_| false,
                    &args,
                    &flush,
                )
            })
            .unwrap();
    }
    eprintln!(
        "cispo+sapo: {} cases per config; max distance to grpo-core so far: {} ULP",
        gpu::cases(),
        MAX_ULP.load(std::sync::atomic::Ordering::Relaxed)
    );
}

#[test]
fn reinforce_matches_grpo_core() {
    let Some(ctx) = gpu::context("reinforce_matches_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    gpu::runner()
        .run(&(batch(), any::<bool>()), |(b, weighted)| {
            let n = b.lp.len();
            let w: Vec<f32> = (0..n).map(|t| 0.5 + (t % 3) as f32 * 0.25).collect();
            let w = weighted.then_some(&w[..]);
            let (mut cv, mut cg) = (vec![0f32; n], vec![0f32; n]);
            reinforce(&b.lp, &b.adv, w, b.tokens(), &mut cv, &mut cg).unwrap();
            let (mut gv, mut gg) = (vec![0f32; n], vec![0f32; n]);
            k.reinforce(&b.lp, &b.adv, w, b.tokens(), &mut gv, &mut gg)
                .unwrap();
            compare(
                &b,
                (&gv, &gg),
                (&cv, &cg),
                tolerance(Op::LossAlgebraic, Dtype::F32),
                &|_| false,
                &|_| vec![],
                &|_| 1.0,
            )
        })
        .unwrap();
    eprintln!(
        "reinforce: {} cases per config; max distance to grpo-core so far: {} ULP",
        gpu::cases(),
        MAX_ULP.load(std::sync::atomic::Ordering::Relaxed)
    );
}

/// k1, abs, k2 and k3 against grpo-core under every preset's clamps and a custom pair, on
/// [`kl_batch`]'s inputs (log-ratios from subnormal and tiny to ±80, the clamp and guard edges,
/// a token at ±3e38): values and gradients within the table's `LossAlgebraic` (k1, abs, k2: the
/// same f32 operations) or `LossExp` (k3: plus exp's allowance) entry, and every diagnostic the
/// API returns — token and input-clamp counts equal, the output-clamp count equal up to tokens
/// whose value sits on the clamp within the tolerance, the mean bit-identical when every value
/// is, else within the values' largest distance plus the running mean's roundings.
#[test]
fn kl_penalties_match_grpo_core() {
    let Some(ctx) = gpu::context("kl_penalties_match_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let eps = f32::EPSILON as f64;
    let subnormal_tokens = std::cell::Cell::new(0usize);
    // Tokens matched by grpo-core on the inputs with subnormals flushed (`kl_reference`).
    let flushed_tokens = std::cell::Cell::new(0usize);
    // Largest ULP distance of k1/abs/k2 (values and gradients), and of k3's minus exp's allowance.
    let (max_alg, max_exp) = (std::cell::Cell::new(0u64), std::cell::Cell::new(i64::MIN));
    let seen = |t: &Tol, args: &[f64], g: f32, c: f32| {
        let u = ulp_distance(g, c);
        MAX_ULP.fetch_max(u, std::sync::atomic::Ordering::Relaxed);
        if args.is_empty() {
            max_alg.set(max_alg.get().max(u));
        } else if c.abs() >= 1e-28 {
            max_exp.set(
                max_exp
                    .get()
                    .max(u as i64 - (t.ulp + exp_ulps(args)) as i64),
            );
        }
    };
    for est in [
        KlEstimator::K1,
        KlEstimator::Abs,
        KlEstimator::K2,
        KlEstimator::K3,
    ] {
        let mut configs: Vec<KlPenaltyConfig<f32>> =
            [Preset::Paper, Preset::Verl, Preset::Trl, Preset::OpenRlhf]
                .into_iter()
                .map(|p| KlPenaltyConfig::from_preset(p, est))
                .collect();
        configs.push(KlPenaltyConfig {
            estimator: est,
            input_clamp: Some(3.0),
            output_clamp: Some(0.5),
        });
        let (base, guard) = if est == KlEstimator::K3 {
            (tolerance(Op::LossExp, Dtype::F32), 43.36f32)
        } else {
            (tolerance(Op::LossAlgebraic, Dtype::F32), f32::MAX.sqrt())
        };
        for cfg in configs {
            let lim = cfg.input_clamp.map_or(guard, |c| c.min(guard));
            gpu::runner()
                .run(&kl_batch(), |b| {
                    let n = b.lp.len();
                    // Sometimes `old`, which these estimators ignore (its length is checked).
                    let old = (n % 2 == 1).then_some(&b.old[..]);
                    let run = run_kl(&k, &cfg, &b, old);
                    let flushed = kl_flushed(&cfg, &b, old.is_some());
                    let KlRun {
                        cv,
                        cg,
                        dc,
                        gv,
                        gg,
                        dg,
                    } = &run;
                    let mut borderline = 0;
                    let mut max_dv = 0f64;
                    for t in 0..n {
                        if !b.mask[t] {
                            prop_assert_eq!((gv[t], gg[t]), (0.0, 0.0));
                            prop_assert_eq!((cv[t], cg[t]), (0.0, 0.0));
                            continue;
                        }
                        let d = b.lp[t] - b.reference[t];
                        if d != 0.0 && d.abs() < f32::MIN_POSITIVE {
                            subnormal_tokens.set(subnormal_tokens.get() + 1);
                        }
                        // k3 evaluates e^{−d} with d after the input clamp (or the guard).
                        let args = if est == KlEstimator::K3 {
                            vec![(d as f64).clamp(-lim as f64, lim as f64)]
                        } else {
                            vec![]
                        };
                        let allowance = base.ulp + exp_ulps(&args);
                        let tol = base.plus_ulp(exp_ulps(&args));
                        // The mean's slack: the distance to grpo-core's own values.
                        max_dv = max_dv.max((gv[t] as f64 - cv[t] as f64).abs());
                        let ((want_v, want_g), took) =
                            kl_reference(&b, t, &run, flushed.as_ref(), &tol);
                        flushed_tokens.set(flushed_tokens.get() + took as usize);
                        // A subnormal input may be flushed (`kl_reference`): no ULP statistic.
                        let stat = !b.subnormal_input(t);
                        if stat {
                            seen(&base, &args, gv[t], want_v);
                        }
                        prop_assert!(
                            tol.accepts(gv[t], want_v as f64),
                            "{:?} {:?} value[{}] gpu {} core {} ({} ulp; d {:e})",
                            est,
                            cfg,
                            t,
                            gv[t],
                            want_v,
                            ulp_distance(gv[t], want_v),
                            d
                        );
                        // Where the value sits at the output clamp within the tolerance, the
                        // two sides may take different branches (gradient 0 or not): both are
                        // correct.
                        if let Some(c) = cfg.output_clamp
                            && ulp_distance(want_v.abs(), c) <= allowance as u64
                        {
                            borderline += 1;
                            continue;
                        }
                        if stat {
                            seen(&base, &args, gg[t], want_g);
                        }
                        prop_assert!(
                            tol.accepts(gg[t], want_g as f64),
                            "{:?} {:?} grad[{}] gpu {} core {} ({} ulp; d {:e}){}",
                            est,
                            cfg,
                            t,
                            gg[t],
                            want_g,
                            ulp_distance(gg[t], want_g),
                            d,
                            if b.subnormal_input(t) {
                                " (a subnormal input: neither grpo-core's result on it nor on \
                                 it flushed to 0 is within the tolerance)"
                            } else {
                                ""
                            }
                        );
                    }
                    prop_assert_eq!(dc.tokens, dg.tokens);
                    prop_assert_eq!(dc.tokens, (0..n).filter(|&t| b.mask[t]).count());
                    prop_assert_eq!(dc.input_clamped, dg.input_clamped);
                    prop_assert!(
                        dc.output_clamped.abs_diff(dg.output_clamped) <= borderline,
                        "output_clamped gpu {} core {} ({} borderline)",
                        dg.output_clamped,
                        dc.output_clamped,
                        borderline
                    );
                    if bits(gv) == bits(cv) {
                        // The same values in the same running mean: the same bits.
                        prop_assert_eq!(dg.mean.to_bits(), dc.mean.to_bits());
                    } else {
                        mean_within(dc, dg, cv, max_dv, eps)?;
                    }
                    Ok(())
                })
                .unwrap();
        }
    }
    // The edge strategy must actually reach subnormal log-ratios.
    let subnormal_tokens = subnormal_tokens.get();
    assert!(subnormal_tokens > 0, "no subnormal d was generated");
    eprintln!(
        "kl k1/abs/k2/k3: {} cases per config; {} valid tokens with a subnormal d, {} matched \
         only grpo-core on flushed subnormal inputs; max distance to grpo-core: k1/abs/k2 {} \
         ULP, k3 (max ULP − exp's allowance) {}",
        gpu::cases(),
        subnormal_tokens,
        flushed_tokens.get(),
        max_alg.get(),
        max_exp.get()
    );
}

/// grpo-core's and the GPU's KL penalty of one batch (outputs pre-filled with 7).
struct KlRun {
    cv: Vec<f32>,
    cg: Vec<f32>,
    dc: TokenDiagnostics<f32>,
    gv: Vec<f32>,
    gg: Vec<f32>,
    dg: TokenDiagnostics<f32>,
}

fn run_kl(
    k: &LossKernel<'_>,
    cfg: &KlPenaltyConfig<f32>,
    b: &KlBatch,
    old: Option<&[f32]>,
) -> KlRun {
    let n = b.lp.len();
    let (mut cv, mut cg) = (vec![7f32; n], vec![7f32; n]);
    let dc = kl_penalty(cfg, &b.lp, &b.reference, old, &b.tokens(), &mut cv, &mut cg).unwrap();
    let (mut gv, mut gg) = (vec![7f32; n], vec![7f32; n]);
    let dg = k
        .kl_penalty(cfg, &b.lp, &b.reference, old, &b.tokens(), &mut gv, &mut gg)
        .unwrap();
    KlRun {
        cv,
        cg,
        dc,
        gv,
        gg,
        dg,
    }
}

/// The GPU's running mean of KL values each within `max_dv` of grpo-core's: within `max_dv`
/// plus one rounding (`eps`) per update at the scale of the largest value.
fn mean_within(
    dc: &TokenDiagnostics<f32>,
    dg: &TokenDiagnostics<f32>,
    cv: &[f32],
    max_dv: f64,
    eps: f64,
) -> Result<(), TestCaseError> {
    let vmax = cv.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
    let slack = max_dv + 4.0 * eps * vmax * dc.tokens as f64;
    prop_assert!(
        (dg.mean as f64 - dc.mean as f64).abs() <= slack,
        "mean gpu {} core {} (slack {})",
        dg.mean,
        dc.mean,
        slack
    );
    Ok(())
}

/// Inputs of a KL penalty: lp, the reference and the old log-probs, NaN garbage in masked
/// positions of all three.
#[derive(Debug, Clone)]
struct KlBatch {
    lp: Vec<f32>,
    reference: Vec<f32>,
    old: Vec<f32>,
    cu: Vec<usize>,
    mask: Vec<bool>,
}

impl KlBatch {
    fn tokens(&self) -> Tokens<'_> {
        Tokens::packed(&self.cu, Some(&self.mask))
    }

    /// Whether token `t` has a subnormal input (lp, reference or old).
    fn subnormal_input(&self, t: usize) -> bool {
        [self.lp[t], self.reference[t], self.old[t]]
            .iter()
            .any(|x| x.is_subnormal())
    }

    /// The batch with every subnormal input flushed to zero (`flush_subnormal`), `None` when
    /// no valid token has one.
    fn flushed(&self) -> Option<KlBatch> {
        if !(0..self.lp.len()).any(|t| self.mask[t] && self.subnormal_input(t)) {
            return None;
        }
        let f = |v: &[f32]| v.iter().map(|&x| flush_subnormal(x)).collect();
        Some(KlBatch {
            lp: f(&self.lp),
            reference: f(&self.reference),
            old: f(&self.old),
            cu: self.cu.clone(),
            mask: self.mask.clone(),
        })
    }
}

/// grpo-core's (value, gradient) of token `t` to compare the GPU's with: `run`'s, unless the
/// token has a subnormal input, `run`'s pair is not within `tol` of the GPU's, and grpo-core's on
/// the flushed inputs (`flushed`, from `KlBatch::flushed`) is. WGSL lets an implementation flush
/// subnormal inputs to zero; NVIDIA's Vulkan driver does (measured on NVIDIA H200: reference
/// −1e-45 with lp = 0 gave Abs's gradient sign(0) = 0, grpo-core's 1; the largest subnormal
/// reference, −1.1754942e-38, gave K3Is's gradient ρ·0 instead of ρ·d = 8e-20, just beyond the
/// tolerance's ρ·f32::MIN_POSITIVE). The second element says whether the flushed reference was
/// taken.
fn kl_reference(
    b: &KlBatch,
    t: usize,
    run: &KlRun,
    flushed: Option<&(Vec<f32>, Vec<f32>)>,
    tol: &Tol,
) -> ((f32, f32), bool) {
    let (gv, gg) = (run.gv[t], run.gg[t]);
    let own = (run.cv[t], run.cg[t]);
    let within = |(v, g): (f32, f32)| tol.accepts(gv, v as f64) && tol.accepts(gg, g as f64);
    match flushed {
        Some((fv, fg)) if b.subnormal_input(t) && !within(own) && within((fv[t], fg[t])) => {
            ((fv[t], fg[t]), true)
        }
        _ => (own, false),
    }
}

/// grpo-core's values and gradients of the KL penalty on `b` with its subnormal inputs flushed
/// (`None` when it has none); `old` is passed when `with_old`.
fn kl_flushed(
    cfg: &KlPenaltyConfig<f32>,
    b: &KlBatch,
    with_old: bool,
) -> Option<(Vec<f32>, Vec<f32>)> {
    let f = b.flushed()?;
    let n = f.lp.len();
    let (mut v, mut g) = (vec![7f32; n], vec![7f32; n]);
    let old = with_old.then_some(&f.old[..]);
    kl_penalty(cfg, &f.lp, &f.reference, old, &f.tokens(), &mut v, &mut g).unwrap();
    Some((v, g))
}

/// A log-ratio (d = lp − ref or x = lp − old) from tiny to ±80, with edges: ±0, subnormal (the
/// smallest, 1e-40, and the largest), the smallest normal, tiny normals, the ±20 input clamp,
/// the ±43.36 overflow guard, the k3 values around verl's ±10 output clamp (d ≈ −2.53), ±1e30.
fn kl_log_ratio() -> impl Strategy<Value = f32> {
    let largest_subnormal = f32::from_bits(0x007f_ffff);
    let smallest_subnormal = f32::from_bits(1);
    prop_oneof![
        4 => -0.5f32..0.5,
        3 => -3.0f32..3.0,
        2 => -80.0f32..80.0,
        1 => -1e-6f32..1e-6,
        1 => prop::sample::select(vec![
            0.0f32, -0.0, 1e-40, -1e-40, 1e-20, -1e-20, 20.0, -20.0, 20.5, -20.5, 43.36, -43.36,
            44.0, -44.0, 2.0, -2.0, -2.5, -2.6, 1e30, -1e30,
        ]),
        1 => prop::sample::select(vec![
            smallest_subnormal, -smallest_subnormal, largest_subnormal, -largest_subnormal,
            f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 1e-30, -1e-30, 1e-10, -1e-10, 1e-7, -1e-7,
        ]),
    ]
}

/// lp near typical values or exactly 0 (so a subnormal d stays subnormal), ref = lp − d and
/// old = lp − x; one batch in eight holds a token whose inputs are ±3e38 (lp − ref overflows).
fn kl_batch() -> impl Strategy<Value = KlBatch> {
    prop::collection::vec(0usize..40, 1..6)
        .prop_flat_map(|lens| {
            let n: usize = lens.iter().sum();
            let lp = prop_oneof![4 => -12.0f32..0.0, 1 => Just(0.0f32), 1 => Just(-0.0f32)];
            (
                Just(lens),
                prop::collection::vec(lp, n),
                prop::collection::vec(kl_log_ratio(), n),
                prop::collection::vec(kl_log_ratio(), n),
                prop::collection::vec(prop::bool::weighted(0.85), n),
                prop::option::weighted(0.125, (any::<prop::sample::Index>(), 0usize..4)),
            )
        })
        .prop_map(|(lens, lp, d, x, mask, extreme)| {
            let mut cu = vec![0];
            for l in lens {
                cu.push(cu.last().unwrap() + l);
            }
            let reference = lp.iter().zip(&d).map(|(l, d)| l - d).collect();
            let old = lp.iter().zip(&x).map(|(l, x)| l - x).collect();
            let mut b = KlBatch {
                lp,
                reference,
                old,
                cu,
                mask,
            };
            if let Some((at, which)) = extreme
                && !b.lp.is_empty()
            {
                let t = at.index(b.lp.len());
                let (l, r, o) = [
                    (3e38, -3e38, 3e38),
                    (-3e38, 3e38, -3e38),
                    (3e38, 3e38, -3e38),
                    (-3e38, -3e38, 3e38),
                ][which];
                (b.lp[t], b.reference[t], b.old[t]) = (l, r, o);
            }
            for t in 0..b.lp.len() {
                if !b.mask[t] {
                    b.lp[t] = f32::NAN;
                    b.reference[t] = f32::NAN;
                    b.old[t] = f32::NAN;
                }
            }
            b
        })
}

/// Largest distances of the importance-corrected and straight-through KL estimators (the
/// measured figures of the tolerance table): [ULP of the results without exp (k1+, the
/// straight-through gradients), ULP of the exp-based values (K3Is, k3+), the same minus exp's
/// allowance, K3Is gradient ULP distance, the same minus the allowance].
static KL_MAX: [std::sync::atomic::AtomicI64; 5] =
    [const { std::sync::atomic::AtomicI64::new(i64::MIN) }; 5];

fn record(slot: usize, v: i64) {
    KL_MAX[slot].fetch_max(v, std::sync::atomic::Ordering::Relaxed);
}

/// K3Is, k1+ and k3+ against grpo-core: values, gradients and diagnostics over random and edge
/// inputs, under every preset's clamps and with custom ones.
#[test]
fn kl_penalty_is_and_straight_through_match_grpo_core() {
    let Some(ctx) = gpu::context("kl_penalty_is_and_straight_through_match_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let base = tolerance(Op::KlIsStraightThrough, Dtype::F32);
    let eps = f32::EPSILON as f64;
    // Tokens matched by grpo-core on the inputs with subnormals flushed (`kl_reference`).
    let flushed_tokens = std::cell::Cell::new(0usize);
    for est in [
        KlEstimator::K3Is,
        KlEstimator::K1StraightThrough,
        KlEstimator::K3StraightThrough,
    ] {
        let mut configs: Vec<KlPenaltyConfig<f32>> =
            [Preset::Paper, Preset::Verl, Preset::Trl, Preset::OpenRlhf]
                .into_iter()
                .map(|p| KlPenaltyConfig::from_preset(p, est))
                .collect();
        configs.push(KlPenaltyConfig {
            estimator: est,
            input_clamp: Some(3.0),
            output_clamp: Some(0.5),
        });
        for cfg in configs {
            let exp_guard = if est == KlEstimator::K1StraightThrough {
                f32::MAX.sqrt()
            } else {
                43.36
            };
            let lim = cfg.input_clamp.map_or(exp_guard, |c| c.min(exp_guard));
            gpu::runner()
                .run(&kl_batch(), |b| {
                    let n = b.lp.len();
                    // Sometimes `old` for the estimators that ignore it (its values unread).
                    let old = (est == KlEstimator::K3Is || n % 2 == 1).then_some(&b.old[..]);
                    let run = run_kl(&k, &cfg, &b, old);
                    let flushed = kl_flushed(&cfg, &b, old.is_some());
                    let KlRun {
                        cv,
                        cg,
                        dc,
                        gv,
                        gg,
                        dg,
                    } = &run;
                    let mut borderline = 0;
                    let mut max_dv = 0f64;
                    for t in 0..n {
                        if !b.mask[t] {
                            prop_assert_eq!((gv[t], gg[t]), (0.0, 0.0));
                            prop_assert_eq!((cv[t], cg[t]), (0.0, 0.0));
                            continue;
                        }
                        // The (limited) arguments of the formula's exps, in f64.
                        let d = ((b.lp[t] - b.reference[t]) as f64).clamp(-lim as f64, lim as f64);
                        let x = ((b.lp[t] - b.old[t]) as f64).clamp(-lim as f64, lim as f64);
                        let (args, rho) = match est {
                            KlEstimator::K3Is => (vec![d, x], x.exp()),
                            KlEstimator::K3StraightThrough => (vec![d], 1.0),
                            _ => (vec![], 1.0),
                        };
                        let allowance = base.ulp + exp_ulps(&args);
                        // A subnormal k3 (or d) may be flushed to 0, then multiplied by ρ.
                        let tol = base
                            .plus_ulp(exp_ulps(&args))
                            .with_abs(base.abs * rho.max(1.0));
                        // The mean's slack: the distance to grpo-core's own values.
                        max_dv = max_dv.max((gv[t] as f64 - cv[t] as f64).abs());
                        let ((want_v, want_g), took) =
                            kl_reference(&b, t, &run, flushed.as_ref(), &tol);
                        flushed_tokens.set(flushed_tokens.get() + took as usize);
                        let ulp_v = ulp_distance(gv[t], want_v);
                        // A subnormal input may be flushed (`kl_reference`), a subnormal k3 or d
                        // flushed and scaled by ρ: no ULP statistic for either.
                        let stat = !b.subnormal_input(t);
                        if stat && want_v.abs() >= 1e-28 {
                            if args.is_empty() {
                                record(0, ulp_v as i64);
                            } else {
                                record(1, ulp_v as i64);
                                record(2, ulp_v as i64 - exp_ulps(&args) as i64);
                            }
                        }
                        prop_assert!(
                            tol.accepts(gv[t], want_v as f64),
                            "{:?} {:?} value[{}] gpu {} core {} ({} ulp, allowance {})",
                            est,
                            cfg,
                            t,
                            gv[t],
                            want_v,
                            ulp_v,
                            allowance
                        );
                        // Where the value sits at the output clamp within the tolerance, the
                        // two sides may take different branches (gradient 0 or not): both are
                        // correct.
                        if let Some(c) = cfg.output_clamp
                            && ulp_distance(want_v.abs(), c) <= allowance as u64
                        {
                            borderline += 1;
                            continue;
                        }
                        let ulp_g = ulp_distance(gg[t], want_g);
                        let flush_note = if b.subnormal_input(t) {
                            " (a subnormal input: neither grpo-core's result on it nor on it \
                             flushed to 0 is within the tolerance)"
                        } else {
                            ""
                        };
                        if est == KlEstimator::K3Is {
                            // ρ·d (or ρ·∂k3, ρ·k3 where one input was limited): one product
                            // with ρ, so the value's tolerance (exp's allowance included).
                            if stat && want_g.abs() >= 1e-28 {
                                record(3, ulp_g as i64);
                                record(4, ulp_g as i64 - exp_ulps(&args) as i64);
                            }
                            prop_assert!(
                                tol.accepts(gg[t], want_g as f64),
                                "{:?} {:?} grad[{}] gpu {} core {} ({} ulp; d {} x {}){}",
                                est,
                                cfg,
                                t,
                                gg[t],
                                want_g,
                                ulp_g,
                                d,
                                x,
                                flush_note
                            );
                        } else {
                            // k2's gradient d: the same f32 subtraction and comparisons.
                            if stat && want_g.abs() >= 1e-28 {
                                record(0, ulp_g as i64);
                            }
                            prop_assert!(
                                base.accepts(gg[t], want_g as f64),
                                "{:?} {:?} grad[{}] gpu {} core {} ({} ulp){}",
                                est,
                                cfg,
                                t,
                                gg[t],
                                want_g,
                                ulp_g,
                                flush_note
                            );
                        }
                    }
                    prop_assert_eq!(dc.tokens, dg.tokens);
                    prop_assert_eq!(dc.input_clamped, dg.input_clamped);
                    prop_assert!(dc.output_clamped.abs_diff(dg.output_clamped) <= borderline);
                    mean_within(dc, dg, cv, max_dv, eps)?;
                    Ok(())
                })
                .unwrap();
        }
    }
    let load = |i: usize| KL_MAX[i].load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "kl K3Is/k1+/k3+: {} cases per config; max distance to grpo-core: {} ULP without exp \
         (k1+, straight-through gradients); {} ULP for exp-based values (max ULP − exp's \
         allowance: {}); K3Is gradients {} ULP (max minus the allowance: {}); {} tokens matched \
         only grpo-core on flushed subnormal inputs",
        gpu::cases(),
        load(0),
        load(1),
        load(2),
        load(3),
        load(4),
        flushed_tokens.get()
    );
}

/// KL-penalty errors in grpo-core's order, outputs untouched: K3Is without `old`, `old`'s
/// length (checked for every estimator when given, first for those that ignore it), non-finite
/// inputs (`old` only for K3Is), a bad clamp before the missing `old`.
#[test]
fn kl_penalty_errors_match_grpo_core_and_leave_outputs_untouched() {
    let Some(ctx) = gpu::context("kl_penalty_errors_match_grpo_core_and_leave_outputs_untouched")
    else {
        return;
    };
    let k = LossKernel::new(ctx);
    let cu = [0usize, 3];
    let mask = [true, true, false];
    let tokens = Tokens::packed(&cu, Some(&mask));
    let cfg = |e| KlPenaltyConfig::<f32>::from_preset(Preset::Verl, e);
    let ok = [-1.0f32, -2.0, -3.0];
    let nan1 = [-1.0f32, f32::NAN, -3.0];
    let inf0 = [f32::INFINITY, -2.0, -3.0];
    let nan_masked = [-1.0f32, -2.0, f32::NAN];
    let short = [-1.0f32, -2.0];
    let bad_clamp = KlPenaltyConfig {
        input_clamp: Some(-1.0),
        ..cfg(KlEstimator::K3Is)
    };
    type Case<'a> = (
        KlPenaltyConfig<f32>,
        &'a [f32],
        &'a [f32],
        Option<&'a [f32]>,
        usize,
    );
    let cases: Vec<(Case<'_>, Option<Error>)> = vec![
        (
            (cfg(KlEstimator::K3Is), &ok, &ok, None, 3),
            Some(Error::InvalidParam {
                name: "old",
                reason: "the importance-corrected k3 (K3Is) needs the old log-probs",
            }),
        ),
        ((bad_clamp, &ok, &ok, None, 3), None),
        // Missing `old` is reported before any length or value.
        ((cfg(KlEstimator::K3Is), &nan1, &short, None, 2), None),
        ((cfg(KlEstimator::K1), &ok, &ok, Some(&short), 3), None),
        // `old`'s length first for the estimators that ignore it, after `reference` for K3Is.
        (
            (
                cfg(KlEstimator::K1StraightThrough),
                &ok,
                &short,
                Some(&short),
                3,
            ),
            None,
        ),
        (
            (
                cfg(KlEstimator::K3StraightThrough),
                &ok,
                &short,
                Some(&short),
                3,
            ),
            None,
        ),
        ((cfg(KlEstimator::K3Is), &ok, &short, Some(&short), 3), None),
        ((cfg(KlEstimator::K3Is), &ok, &ok, Some(&short), 3), None),
        ((cfg(KlEstimator::K3Is), &ok, &ok, Some(&ok), 2), None),
        // Non-finite values: lp, then reference, then old (K3Is only).
        ((cfg(KlEstimator::K3Is), &ok, &ok, Some(&nan1), 3), None),
        ((cfg(KlEstimator::K3Is), &ok, &inf0, Some(&nan1), 3), None),
        ((cfg(KlEstimator::K3Is), &nan1, &inf0, Some(&nan1), 3), None),
        (
            (
                cfg(KlEstimator::K1StraightThrough),
                &ok,
                &inf0,
                Some(&ok),
                3,
            ),
            None,
        ),
        (
            (cfg(KlEstimator::K3StraightThrough), &nan1, &ok, None, 3),
            None,
        ),
    ];
    for ((cfg, lp, reference, old, out_len), want) in cases {
        let (mut cv, mut cg) = (vec![9f32; out_len], [9f32; 3]);
        let e = kl_penalty(&cfg, lp, reference, old, &tokens, &mut cv, &mut cg).unwrap_err();
        if let Some(w) = want {
            assert_eq!(e, w);
        }
        let (mut gv, mut gg) = (vec![9f32; out_len], [9f32; 3]);
        assert_eq!(
            k.kl_penalty(&cfg, lp, reference, old, &tokens, &mut gv, &mut gg),
            Err(GpuError::Core(e)),
            "{cfg:?} {lp:?} {reference:?} {old:?}"
        );
        assert!(gv.iter().chain(&gg).all(|&v| v == 9.0), "{cfg:?}: written");
        eprintln!("kl error: {e}");
    }
    // What is accepted: `old` with NaN for an estimator that ignores it, NaN `old` in a masked
    // position for K3Is; both sides agree and write.
    for (est, old) in [
        (KlEstimator::K1StraightThrough, &nan1),
        (KlEstimator::K3StraightThrough, &nan1),
        (KlEstimator::K3Is, &nan_masked),
    ] {
        let (mut cv, mut cg) = ([9f32; 3], [9f32; 3]);
        let dc = kl_penalty(&cfg(est), &ok, &ok, Some(old), &tokens, &mut cv, &mut cg).unwrap();
        let (mut gv, mut gg) = ([9f32; 3], [9f32; 3]);
        let dg = k
            .kl_penalty(&cfg(est), &ok, &ok, Some(old), &tokens, &mut gv, &mut gg)
            .unwrap();
        assert_eq!((gv, gg), (cv, cg), "{est:?}");
        assert_eq!((gv, gg), ([0.0; 3], [0.0; 3]), "{est:?}: d = 0 everywhere");
        assert_eq!(dc, dg);
    }
}

#[test]
fn hand_computed_ppo_tokens() {
    let Some(ctx) = gpu::context("hand_computed_ppo_tokens") else {
        return;
    };
    let k = LossKernel::new(ctx);
    // x = ln 1.5 (ρ = 1.5 > 1.2) with A = 1: clipped, L = −1.2, grad 0.
    // x = 0 (ρ = 1) with A = −2: L = 2, grad = −A·ρ = 2.
    // x = ln 0.5 (ρ = 0.5 < 0.8) with A = −1, verl dual-clip c = 3: clipped L = 0.8 < 3, grad 0.
    let lp = [1.5f32.ln(), 0.0, 0.5f32.ln()];
    let old = [0.0f32; 3];
    let adv = [1.0f32, -2.0, -1.0];
    let cu = [0usize, 3];
    let inp = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &adv,
        tokens: Tokens::packed(&cu, None),
    };
    let (mut v, mut g) = ([0f32; 3], [0f32; 3]);
    let d = k
        .ppo_clip(
            &PpoClipConfig::from_preset(Preset::Verl),
            &inp,
            &mut v,
            &mut g,
        )
        .unwrap();
    assert!((v[0] + 1.2).abs() < 1e-6 && g[0] == 0.0, "{v:?} {g:?}");
    assert!((v[1] - 2.0).abs() < 1e-6 && (g[1] - 2.0).abs() < 1e-6);
    assert!((v[2] - 0.8).abs() < 1e-6 && g[2] == 0.0);
    assert_eq!((d.clipped_high, d.clipped_low, d.tokens), (1, 1, 3));
}

/// Ratios a few ULP around the clip bounds and the dual constant, with advantages for which
/// `−A·ρ` and `−A·bound` round alike while the ratios differ: the shader decides the branches on
/// the ratios, as grpo-core does, so every token it counts as clipped (or dual-clipped) has no
/// gradient and every other token has one. (Its exponential may differ from grpo-core's in the
/// last bits, so the test checks the shader against its own counts, not against grpo-core.)
#[test]
fn clipped_tokens_have_no_gradient_at_rounding_ties() {
    let Some(ctx) = gpu::context("clipped_tokens_have_no_gradient_at_rounding_ties") else {
        return;
    };
    let k = LossKernel::new(ctx);
    for cfg in [
        PpoClipConfig::<f32>::from_preset(Preset::Verl),
        PpoClipConfig::dapo(),
    ] {
        let mut points = vec![cfg.bounds.lo, cfg.bounds.hi];
        points.extend(cfg.dual_clip);
        let (lp, adv) = grpo_tests::bound_tie_grid(&points);
        let n = lp.len();
        let old = vec![0.0f32; n];
        let cu = [0usize, n];
        let inp = PolicyInputs {
            lp: &lp,
            old: &old,
            adv: &adv,
            tokens: Tokens::packed(&cu, None),
        };
        let (mut v, mut g) = (vec![0f32; n], vec![0f32; n]);
        let d = k.ppo_clip(&cfg, &inp, &mut v, &mut g).unwrap();
        let zero = |pos: bool| {
            (0..n)
                .filter(|&t| (adv[t] > 0.0) == pos && g[t] == 0.0)
                .count()
        };
        assert_eq!(zero(true), d.clipped_high, "{cfg:?}");
        assert_eq!(zero(false), d.clipped_low + d.dual_clipped, "{cfg:?}");
        // The grid crosses every bound: some tokens on each side of each.
        assert!(d.clipped_high > 0 && d.clipped_low > 0, "{d:?}");
        assert!(cfg.dual_clip.is_none() || d.dual_clipped > 0, "{d:?}");
    }
}

#[test]
fn errors_match_grpo_core_and_leave_outputs_untouched() {
    let Some(ctx) = gpu::context("errors_match_grpo_core_and_leave_outputs_untouched") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let cu = [0usize, 3];
    let mask = [true, true, false];
    let old = [0.0f32; 3];
    let adv = [1.0f32; 3];
    for (lp, cfg) in [
        ([0.0f32, f32::NAN, 0.0], PpoClipConfig::default()),
        (
            [0.0f32, 1.0, f32::NAN],
            PpoClipConfig {
                dual_clip: Some(0.5),
                ..PpoClipConfig::default()
            },
        ),
        (
            [0.0f32, 1.0, 0.0],
            PpoClipConfig {
                log_ratio_clamp: Some(-1.0),
                ..PpoClipConfig::default()
            },
        ),
    ] {
        let inp = PolicyInputs {
            lp: &lp,
            old: &old,
            adv: &adv,
            tokens: Tokens::packed(&cu, Some(&mask)),
        };
        let (mut cv, mut cg) = ([9f32; 3], [9f32; 3]);
        let e = ppo_clip(&cfg, &inp, &mut cv, &mut cg).unwrap_err();
        let (mut gv, mut gg) = ([9f32; 3], [9f32; 3]);
        assert_eq!(
            k.ppo_clip(&cfg, &inp, &mut gv, &mut gg),
            Err(GpuError::Core(e))
        );
        assert_eq!((gv, gg), ([9f32; 3], [9f32; 3]));
    }
    let (mut v, mut g) = ([9f32; 2], [9f32; 3]);
    let lp = [0.0f32; 3];
    let inp = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &adv,
        tokens: Tokens::packed(&cu, None),
    };
    assert_eq!(
        k.ppo_clip(&PpoClipConfig::default(), &inp, &mut v, &mut g),
        Err(GpuError::Core(Error::LengthMismatch {
            what: "value",
            expected: 3,
            found: 2
        }))
    );
}

/// For each valid token of a sequence whose valid tokens do not share one advantage, the
/// magnitude of GSPO's terms there, `(1/n) Σ_t max(e^x̄, hi)·|A_t|` (0 elsewhere): `L_i` is
/// then the mean of terms of both signs, which may cancel, so its error is relative to them.
fn gspo_mixed_magnitudes(b: &Batch, hi: f32, xbar: &[f32]) -> Vec<f64> {
    let mut out = vec![0f64; b.lp.len()];
    for w in b.cu.windows(2) {
        let valid: Vec<usize> = (w[0]..w[1]).filter(|&t| b.mask[t]).collect();
        let Some(&first) = valid.first() else {
            continue;
        };
        if valid.iter().all(|&t| b.adv[t] == b.adv[first]) {
            continue;
        }
        let s = (xbar[first] as f64).exp().max(hi as f64);
        let mag = valid
            .iter()
            .map(|&t| s * (b.adv[t] as f64).abs())
            .sum::<f64>()
            / valid.len() as f64;
        for &t in &valid {
            out[t] = mag;
        }
    }
    out
}

/// Each valid token's sequence mean log-ratio x̄ (grpo-core's f32 order).
fn seq_means(b: &Batch) -> Vec<f32> {
    let mut out = vec![0f32; b.lp.len()];
    for w in b.cu.windows(2) {
        let valid: Vec<usize> = (w[0]..w[1]).filter(|&t| b.mask[t]).collect();
        let sx: f32 = valid.iter().fold(0.0, |s, &t| s + (b.lp[t] - b.old[t]));
        for &t in &valid {
            out[t] = sx / valid.len() as f32;
        }
    }
    out
}

#[test]
fn gspo_and_gspo_token_match_grpo_core() {
    let Some(ctx) = gpu::context("gspo_and_gspo_token_match_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let tol = tolerance(Op::LossSeqRatio, Dtype::F32);
    let gspo_cfgs = [
        GspoConfig::from_preset(Preset::Paper),
        GspoConfig::from_preset(Preset::Trl),
        GspoConfig {
            delta_cap: Some(1.5),
            bounds: RatioBounds::new(0.8, 1.2).unwrap(),
            ..GspoConfig::default()
        },
        GspoConfig {
            dual_clip: Some(1.3),
            bounds: RatioBounds::new(0.8, 1.2).unwrap(),
            ..GspoConfig::from_preset(Preset::OpenRlhf)
        },
    ];
    for cfg in &gspo_cfgs {
        gpu::runner()
            .run(&batch(), |b| {
                let n = b.lp.len();
                let (mut cv, mut cg) = (vec![0f32; n], vec![0f32; n]);
                let dc = gspo(cfg, &b.inputs(), &mut cv, &mut cg);
                let (mut gv, mut gg) = (vec![0f32; n], vec![0f32; n]);
                let dg = k.gspo(cfg, &b.inputs(), &mut gv, &mut gg);
                let (dc, dg) = match (dc, dg) {
                    (Ok(a), Ok(b)) => (a, b),
                    (Err(e), g) => {
                        prop_assert_eq!(g.map(|_| ()), Err(GpuError::Core(e)));
                        return Ok(());
                    }
                    (Ok(_), Err(e)) => return Err(TestCaseError::fail(e.to_string())),
                };
                let xbar = seq_means(&b);
                let clamp = cfg.log_ratio_clamp;
                let x = |t: usize| clamp.map_or(xbar[t], |c| xbar[t].clamp(-c, c));
                let mut points = vec![cfg.bounds.lo, cfg.bounds.hi];
                points.extend(cfg.delta_cap);
                let skip = |t: usize| {
                    let near_clamp = clamp.is_some_and(|c| ulp_distance(xbar[t].abs(), c) <= 8);
                    near_clamp
                        || points
                            .iter()
                            .any(|&p| ulp_distance(Real::exp(x(t)), p) <= 64)
                };
                let args = |t: usize| vec![x(t) as f64, 1.25 * x(t) as f64];
                // Mixed advantages: the ULP budget applied to the terms' magnitude, as an
                // absolute slack in units of `tol.abs` (`compare` scales it so).
                let mixed = gspo_mixed_magnitudes(&b, cfg.bounds.hi, &xbar);
                let slack = |t: usize| {
                    let ulps = (tol.ulp + exp_ulps(&args(t))) as f64;
                    ulps * f32::EPSILON as f64 * mixed[t] / tol.abs
                };
                compare(&b, (&gv, &gg), (&cv, &cg), tol, &skip, &args, &slack)?;
                if !(0..n).any(|t| b.mask[t] && skip(t)) {
                    prop_assert_eq!(dc, dg);
                }
                Ok(())
            })
            .unwrap();
    }
    let cfg = GspoTokenConfig::from_preset(Preset::Verl);
    gpu::runner()
        .run(&batch(), |b| {
            let n = b.lp.len();
            let (mut cv, mut cg) = (vec![0f32; n], vec![0f32; n]);
            let dc = gspo_token(&cfg, &b.inputs(), &mut cv, &mut cg);
            let (mut gv, mut gg) = (vec![0f32; n], vec![0f32; n]);
            let dg = k.gspo_token(&cfg, &b.inputs(), &mut gv, &mut gg);
            let (dc, dg) = match (dc, dg) {
                (Ok(a), Ok(b)) => (a, b),
                (Err(e), g) => {
                    prop_assert_eq!(g.map(|_| ()), Err(GpuError::Core(e)));
                    return Ok(());
                }
                (Ok(_), Err(e)) => return Err(TestCaseError::fail(e.to_string())),
            };
            let xbar = seq_means(&b);
            let m = cfg.seq_log_ratio_max.unwrap();
            let x = |t: usize| if xbar[t] > m { m } else { xbar[t] };
            let points = [cfg.bounds.lo, cfg.bounds.hi];
            let skip = |t: usize| {
                ulp_distance(xbar[t], m) <= 8
                    || points
                        .iter()
                        .any(|&p| ulp_distance(Real::exp(x(t)), p) <= 64)
            };
            let args = |t: usize| vec![x(t) as f64, 1.25 * x(t) as f64];
            compare(&b, (&gv, &gg), (&cv, &cg), tol, &skip, &args, &|_| 1.0)?;
            if !(0..n).any(|t| b.mask[t] && skip(t)) {
                prop_assert_eq!(dc, dg);
            }
            Ok(())
        })
        .unwrap();
    eprintln!(
        "gspo+gspo_token: {} cases per config; max distance to grpo-core so far: {} ULP",
        gpu::cases(),
        MAX_ULP.load(std::sync::atomic::Ordering::Relaxed)
    );
}

#[test]
fn hand_computed_gspo() {
    let Some(ctx) = gpu::context("hand_computed_gspo") else {
        return;
    };
    let k = LossKernel::new(ctx);
    // One sequence, x = (0.0002, 0, masked NaN): x̄ = 0.0001, s = e^0.0001 inside
    // [1 − 3e-4, 1 + 4e-4]; A = 1: L = −s, ∂L/∂lp_t = −A·s/2.
    let lp = [0.0002f32, 0.0, f32::NAN];
    let old = [0.0f32; 3];
    let adv = [1.0f32, 1.0, 1.0];
    let cu = [0usize, 3];
    let mask = [true, true, false];
    let inp = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &adv,
        tokens: Tokens::packed(&cu, Some(&mask)),
    };
    let (mut v, mut g) = ([9f32; 3], [9f32; 3]);
    let d = k
        .gspo(&GspoConfig::default(), &inp, &mut v, &mut g)
        .unwrap();
    let s = 0.0001f32.exp();
    assert!((v[0] + s).abs() < 1e-6 && (v[1] + s).abs() < 1e-6, "{v:?}");
    assert!(
        (g[0] + s / 2.0).abs() < 1e-6 && (g[1] + s / 2.0).abs() < 1e-6,
        "{g:?}"
    );
    assert_eq!((v[2], g[2]), (0.0, 0.0));
    assert_eq!(d.level, grpo_core::loss::LossLevel::Sequence);
    // GSPO-token with x̄ = 12 > 10: r = e^10 on both tokens, A = −1 → L = e^10, gradient 0.
    let lp = [24.0f32, 0.0, 0.0];
    let adv = [-1.0f32; 3];
    let inp = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &adv,
        tokens: Tokens::packed(&cu, Some(&mask)),
    };
    let d = k
        .gspo_token(&GspoTokenConfig::default(), &inp, &mut v, &mut g)
        .unwrap();
    let e10 = 10f32.exp();
    assert!(
        (v[0] - e10).abs() < 1e-2 * 2.0 && (v[1] - e10).abs() < 2e-2,
        "{v:?}"
    );
    assert_eq!(g, [0.0; 3]);
    assert_eq!(d.clamped, 2);
}

/// Each valid token's sequence sum of log-ratios (grpo-core's f32 order).
fn seq_sums(b: &Batch) -> Vec<f32> {
    let mut out = vec![0f32; b.lp.len()];
    for w in b.cu.windows(2) {
        let valid: Vec<usize> = (w[0]..w[1]).filter(|&t| b.mask[t]).collect();
        let sx: f32 = valid.iter().fold(0.0, |s, &t| s + (b.lp[t] - b.old[t]));
        for &t in &valid {
            out[t] = sx;
        }
    }
    out
}

#[test]
fn is_weights_match_grpo_core() {
    let Some(ctx) = gpu::context("is_weights_match_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let tol = tolerance(Op::IsWeights, Dtype::F32);
    let max_ulp = std::cell::Cell::new(0u64);
    let configs = [
        IsConfig::token_truncate(2.0),
        IsConfig::sequence_truncate(2.0),
        IsConfig::token_mask(0.5, 2.0),
        IsConfig::sequence_mask(0.5, 2.0),
        IsConfig::tis(),
        IsConfig::icepop(),
        IsConfig {
            log_clamp: None,
            ..IsConfig::sequence_truncate(3.0)
        },
        IsConfig::default(),
    ];
    for cfg in &configs {
        gpu::runner()
            .run(&batch(), |b| {
                // lp plays old (trainer), old plays roll (rollout engine): r = lp − old.
                let n = b.lp.len();
                let mut cw = vec![7f32; n];
                let dc = is_weights(cfg, &b.lp, &b.old, &b.tokens(), &mut cw).unwrap();
                let mut gw = vec![7f32; n];
                let dg = k
                    .is_weights(cfg, &b.lp, &b.old, &b.tokens(), &mut gw)
                    .unwrap();
                let sums = seq_sums(&b);
                let lim = cfg.log_clamp.unwrap_or(43.36).min(43.36);
                let l = |t: usize| {
                    let l = match cfg.level {
                        IsLevel::Sequence => sums[t],
                        _ => b.lp[t] - b.old[t],
                    };
                    l.clamp(-lim, lim)
                };
                let points: Vec<f32> = match cfg.filter {
                    IsFilter::Truncate { min, max } => vec![min, max],
                    IsFilter::Mask { lo, hi } => vec![lo, hi],
                    _ => vec![],
                };
                let skip = |t: usize| {
                    points
                        .iter()
                        .any(|&p| ulp_distance(Real::exp(l(t)), p) <= 64)
                };
                for t in 0..n {
                    if !b.mask[t] {
                        prop_assert_eq!(gw[t], 0.0);
                        continue;
                    }
                    if skip(t) {
                        continue;
                    }
                    max_ulp.set(max_ulp.get().max(ulp_distance(gw[t], cw[t])));
                    let tol = tol.plus_ulp(exp_ulps(&[l(t) as f64]));
                    prop_assert!(
                        tol.accepts(gw[t], cw[t] as f64),
                        "w[{t}] gpu {} core {} ({} ulp)",
                        gw[t],
                        cw[t],
                        ulp_distance(gw[t], cw[t])
                    );
                }
                prop_assert_eq!(dc.tokens, dg.tokens);
                prop_assert_eq!(dc.log_clamped, dg.log_clamped);
                if !(0..n).any(|t| b.mask[t] && skip(t)) {
                    prop_assert_eq!(dc.filtered, dg.filtered);
                    prop_assert_eq!(dc.min == 0.0, dg.min == 0.0);
                    // The mean of weights that each carry ≤ 8 + 3 + 2·43.4 ULP (≈ 1.2e-5).
                    let scale = dc.mean.abs().max(f32::MIN_POSITIVE);
                    prop_assert!(
                        (dc.mean - dg.mean).abs() <= 2e-5 * scale,
                        "mean {} vs {}",
                        dc.mean,
                        dg.mean
                    );
                }
                Ok(())
            })
            .unwrap();
    }
    eprintln!(
        "is_weights: {} configs × {} cases; max distance to grpo-core: {} ULP",
        configs.len(),
        gpu::cases(),
        max_ulp.get()
    );
}

#[test]
fn hand_computed_is_weights_and_errors() {
    let Some(ctx) = gpu::context("hand_computed_is_weights_and_errors") else {
        return;
    };
    let k = LossKernel::new(ctx);
    // r = old − roll = [ln 2, ln 4 | 0, −ln 2] in two rows of two.
    let ln2 = std::f32::consts::LN_2;
    let old = [ln2, 2.0 * ln2, 0.0, -ln2];
    let roll = [0.0f32; 4];
    let tok = Tokens::padded(2, 2, None);
    let mut w = [0f32; 4];
    // Token cap 3: [min(2, 3), min(4, 3), 1, 0.5]; one token truncated.
    let d = k
        .is_weights(&IsConfig::token_truncate(3.0), &old, &roll, &tok, &mut w)
        .unwrap();
    assert!(
        (w[0] - 2.0).abs() < 1e-5 && w[1] == 3.0 && w[2] == 1.0,
        "{w:?}"
    );
    assert!((w[3] - 0.5).abs() < 1e-6);
    assert_eq!((d.tokens, d.filtered), (4, 1));
    // Sequence mask [0.5, 5]: e^{ln 2 + ln 4} = 8 → 0 (both tokens); e^{−ln 2} = 0.5 kept.
    let d = k
        .is_weights(
            &IsConfig::sequence_mask(0.5, 5.0),
            &old,
            &roll,
            &tok,
            &mut w,
        )
        .unwrap();
    assert_eq!((w[0], w[1]), (0.0, 0.0));
    assert!(
        (w[2] - 0.5).abs() < 1e-6 && (w[3] - 0.5).abs() < 1e-6,
        "{w:?}"
    );
    assert_eq!(d.filtered, 2);
    // Errors: grpo-core's, weights untouched.
    let bad = IsConfig::token_mask(2.0, 1.0);
    let mut cw = [9f32; 4];
    let e = is_weights(&bad, &old, &roll, &tok, &mut cw).unwrap_err();
    let mut gw = [9f32; 4];
    assert_eq!(
        k.is_weights(&bad, &old, &roll, &tok, &mut gw),
        Err(GpuError::Core(e))
    );
    let nan_roll = [0.0, f32::NAN, 0.0, 0.0];
    let e = is_weights(&IsConfig::tis(), &old, &nan_roll, &tok, &mut cw).unwrap_err();
    assert_eq!(
        k.is_weights(&IsConfig::tis(), &old, &nan_roll, &tok, &mut gw),
        Err(GpuError::Core(e))
    );
    assert_eq!(gw, [9f32; 4]);
}

#[test]
fn p3o_and_ess_match_grpo_core() {
    let Some(ctx) = gpu::context("p3o_and_ess_match_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let ess_tol = tolerance(Op::EssSums, Dtype::F32);
    let ess_rel = std::cell::Cell::new(0f64);
    for cfg in [
        P3oConfig::from_preset(Preset::Paper),
        P3oConfig::from_preset(Preset::Trl),
    ] {
        gpu::runner()
            .run(&batch(), |b| {
                let n = b.lp.len();
                let sc = ess_stats(&cfg, &b.inputs());
                let sg = k.ess_stats(&cfg, &b.inputs());
                let (sc, sg) = match (sc, sg) {
                    (Ok(a), Ok(b)) => (a, b),
                    (Err(e), g) => {
                        prop_assert_eq!(g, Err(GpuError::Core(e)));
                        return Ok(());
                    }
                    (Ok(_), Err(e)) => return Err(TestCaseError::fail(e.to_string())),
                };
                prop_assert_eq!(sc.n, sg.n);
                for (g, c) in [(sg.sum_w, sc.sum_w), (sg.sum_w2, sc.sum_w2)] {
                    let rel = (g as f64 - c as f64).abs() / (c as f64).abs().max(1e-30);
                    ess_rel.set(ess_rel.get().max(rel));
                }
                prop_assert!(ess_tol.accepts(sg.sum_w, sc.sum_w as f64), "{sc:?} {sg:?}");
                prop_assert!(
                    ess_tol.accepts(sg.sum_w2, sc.sum_w2 as f64),
                    "{sc:?} {sg:?}"
                );
                // The loss itself with grpo-core's ESS (so both see the same constant).
                let ess = sc.ess();
                let (mut cv, mut cg) = (vec![0f32; n], vec![0f32; n]);
                let dc = p3o(&cfg, &b.inputs(), ess, &mut cv, &mut cg);
                let (mut gv, mut gg) = (vec![0f32; n], vec![0f32; n]);
                let dg = k.p3o(&cfg, &b.inputs(), ess, &mut gv, &mut gg);
                let (dc, dg) = match (dc, dg) {
                    (Ok(a), Ok(b)) => (a, b),
                    (Err(e), g) => {
                        prop_assert_eq!(g.map(|_| ()), Err(GpuError::Core(e)));
                        return Ok(());
                    }
                    (Ok(_), Err(e)) => return Err(TestCaseError::fail(e.to_string())),
                };
                let skip = |t: usize| near_branch(&b, t, cfg.log_ratio_clamp, &[ess]);
                // ρ = e^x and the k3 term (e^{−x} − 1 + x: the series below |x| = 2, exp above).
                let args = |t: usize| {
                    let x = log_ratio(&b, t, cfg.log_ratio_clamp);
                    vec![x, x]
                };
                // Two cancellations the ULP budget cannot see: 1 − e^{−x} in the gradient (the
                // exp's error is absolute, (3 + 2|x|)·ulp(e^{−x}), however small 1 − e^{−x} is)
                // and the sum of the two terms of L and ∂L. Allowed as absolute slack:
                // (11 + 2|x|) ULP of the terms' magnitudes, passed to `compare` in units of its
                // base `abs`.
                let pen = 1.0 - ess as f64;
                let slack = |t: usize| {
                    let x = log_ratio(&b, t, cfg.log_ratio_clamp);
                    let inv = (-x).exp();
                    let wa = (x.exp().min(ess as f64) * b.adv[t] as f64).abs();
                    let k3 = inv - 1.0 + x;
                    let terms = pen * inv + wa * (1.0 + (b.lp[t] as f64).abs()) + pen * k3.abs();
                    f32::EPSILON as f64 * (11.0 + 2.0 * x.abs()) * terms / f32::MIN_POSITIVE as f64
                };
                // Checked here rather than by `compare`, whose ULP statistic the cancellations
                // would make meaningless.
                for t in 0..n {
                    if !b.mask[t] {
                        prop_assert_eq!((gv[t], gg[t]), (0.0, 0.0));
                        continue;
                    }
                    if skip(t) {
                        continue;
                    }
                    let tol = tolerance(Op::LossExp, Dtype::F32).plus_ulp(exp_ulps(&args(t)));
                    let tol = tol.with_abs(tol.abs * slack(t).max(1.0));
                    for (what, g, c) in [("value", gv[t], cv[t]), ("grad", gg[t], cg[t])] {
                        prop_assert!(
                            tol.accepts(g, c as f64),
                            "{what}[{t}] gpu {g} core {c} ({} ulp)",
                            ulp_distance(g, c)
                        );
                    }
                }
                if !(0..n).any(|t| b.mask[t] && skip(t)) {
                    prop_assert_eq!(dc.tokens, dg.tokens);
                    prop_assert_eq!(dc.clipped_high, dg.clipped_high);
                    prop_assert_eq!(dc.clamped, dg.clamped);
                    prop_assert_eq!((dc.ratio_min, dc.ratio_max), (dg.ratio_min, dg.ratio_max));
                }
                Ok(())
            })
            .unwrap();
    }
    // (ULP distances of P3O are not meaningful where its two terms cancel: not reported.)
    eprintln!(
        "p3o: {} cases per config; ESS sums max relative distance to grpo-core: {:e}",
        gpu::cases(),
        ess_rel.get()
    );
}

#[test]
fn hand_computed_p3o() {
    let Some(ctx) = gpu::context("hand_computed_p3o") else {
        return;
    };
    let k = LossKernel::new(ctx);
    // w = (1, 3): Σw = 4, Σw² = 10, ESS = 16/(2·10) = 0.8.
    let lp = [0.0f32, 3f32.ln()];
    let old = [0.0f32; 2];
    let adv = [1.0f32; 2];
    let cu = [0usize, 2];
    let inp = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &adv,
        tokens: Tokens::packed(&cu, None),
    };
    let s = k.ess_stats(&P3oConfig::default(), &inp).unwrap();
    assert_eq!(s.n, 2);
    assert!(
        (s.sum_w - 4.0).abs() < 1e-5 && (s.sum_w2 - 10.0).abs() < 1e-4,
        "{s:?}"
    );
    assert!((s.ess() - 0.8).abs() < 1e-5);
    // ρ = 2, A = 1, lp = ln 2, ESS = 0.5: KL3 = ½ − 1 + ln 2, L = −0.5·ln 2 + 0.5·(ln 2 − ½)
    // = −¼, ∂L/∂lp = −0.5 + 0.5·(1 − ½) = −¼.
    let lp = [2f32.ln()];
    let inp = PolicyInputs {
        lp: &lp,
        old: &[0.0],
        adv: &[1.0],
        tokens: Tokens::packed(&[0, 1], None),
    };
    let (mut v, mut g) = ([9f32], [9f32]);
    k.p3o(&P3oConfig::default(), &inp, 0.5, &mut v, &mut g)
        .unwrap();
    assert!((v[0] + 0.25).abs() < 1e-6, "{v:?}");
    assert!((g[0] + 0.25).abs() < 1e-6, "{g:?}");
    // ESS outside [0, 1]: grpo-core's error, outputs untouched.
    let (mut v, mut g) = ([9f32], [9f32]);
    let e = p3o(&P3oConfig::default(), &inp, 1.5, &mut v, &mut g).unwrap_err();
    assert_eq!(
        k.p3o(&P3oConfig::default(), &inp, 1.5, &mut v, &mut g),
        Err(GpuError::Core(e))
    );
    assert_eq!((v, g), ([9f32], [9f32]));
}

/// A deterministic batch of `seqs` short sequences (0..=8 tokens each, a few masked tokens with
/// NaN garbage), log-ratios in ±1.5 with one token in 50 at ±30 (past the clamp), advantages
/// with zeros.
fn many_sequences(seqs: usize) -> Batch {
    let mut next = grpo_tests::uniform_f32(0x9e37_79b9_7f4a_7c15u64);
    let mut cu = vec![0];
    for i in 0..seqs {
        cu.push(cu[i] + (i * 7) % 9);
    }
    let n = cu[seqs];
    let (mut lp, mut old, mut adv, mut mask) = (vec![], vec![], vec![], vec![]);
    for t in 0..n {
        let l = -6.0 * next();
        let x = if t % 50 == 3 {
            30.0 * (2.0 * next() - 1.0)
        } else {
            3.0 * next() - 1.5
        };
        let valid = t % 13 != 5;
        lp.push(if valid { l } else { f32::NAN });
        old.push(l - x);
        adv.push(if t % 11 == 0 { 0.0 } else { 4.0 * next() - 2.0 });
        mask.push(valid);
    }
    Batch {
        lp,
        old,
        adv,
        cu,
        mask,
    }
}

/// Task of the 2-D dispatch: a batch beyond `max_compute_workgroups_per_dimension × 256` tokens
/// (16.7 M on most devices) must run, not fail. A context whose per-dimension limit is forced
/// down to 6 workgroups makes 8 k tokens take the same path (a [6, 6, 1] grid for 32 workgroups,
/// the shaders linearising the index and guarding the 4 extra ones): every per-token and per-sequence entry point gives the
/// uncapped context's bits, and PPO-clip stays within the tolerance of grpo-core. Then the
/// limits themselves: a grid that cannot fit is `TooManyWorkgroups`, a binding over the (forced)
/// storage limit `TooLarge`, and outputs that fit one binding each but not one staging buffer are read back
/// through several.
#[test]
fn batches_beyond_the_workgroup_limit_use_a_2d_dispatch() {
    let Some(ctx) = gpu::context("batches_beyond_the_workgroup_limit_use_a_2d_dispatch") else {
        return;
    };
    // Its own context: the caps below must not reach the tests running in parallel.
    let capped = grpo_wgpu::GpuContext::new().unwrap();
    capped.set_max_workgroups_per_dimension(6);
    let b = many_sequences(2000);
    let n = b.lp.len();
    let seqs = b.cu.len() - 1;
    // per_token needs ⌈7999/256⌉ = 32 workgroups ([6, 6, 1]), the per-sequence kernels
    // ⌈2000/256⌉ = 8 ([6, 2, 1]).
    assert_eq!((n, n.div_ceil(256), seqs.div_ceil(256)), (7999, 32, 8));
    let (whole, split) = (LossKernel::new(ctx), LossKernel::new(&capped));

    let cfg = PpoClipConfig::<f32>::default();
    let run = |k: &LossKernel<'_>| {
        let (mut v, mut g) = (vec![0f32; n], vec![0f32; n]);
        let d = k.ppo_clip(&cfg, &b.inputs(), &mut v, &mut g).unwrap();
        (v, g, d)
    };
    let (gv, gg, dg) = run(&split);
    let (wv, wg, dw) = run(&whole);
    assert_eq!(bits(&gv), bits(&wv));
    assert_eq!(bits(&gg), bits(&wg));
    assert_eq!(dg, dw);
    let (mut cv, mut cg) = (vec![0f32; n], vec![0f32; n]);
    let dc = ppo_clip(&cfg, &b.inputs(), &mut cv, &mut cg).unwrap();
    let points = [cfg.bounds.lo, cfg.bounds.hi];
    let skip = |t: usize| near_branch(&b, t, cfg.log_ratio_clamp, &points);
    let args = |t: usize| vec![log_ratio(&b, t, cfg.log_ratio_clamp)];
    compare(
        &b,
        (&gv, &gg),
        (&cv, &cg),
        tolerance(Op::LossExp, Dtype::F32),
        &skip,
        &args,
        &|_| 1.0,
    )
    .unwrap();
    assert_eq!(dg.tokens, dc.tokens);
    assert_eq!(dg.tokens, b.mask.iter().filter(|&&m| m).count());
    assert!(dg.clipped_low + dg.clipped_high > 0, "{dg:?}");

    // One invocation per sequence: GSPO (seq_ratio), the IS weights, the ESS sums and the
    // aggregation (agg_seq) — capped and uncapped agree bit for bit.
    let gspo_cfg = GspoConfig::<f32>::default();
    let gspo_run = |k: &LossKernel<'_>| {
        let (mut v, mut g) = (vec![0f32; n], vec![0f32; n]);
        k.gspo(&gspo_cfg, &b.inputs(), &mut v, &mut g).unwrap();
        (bits(&v), bits(&g))
    };
    assert_eq!(gspo_run(&split), gspo_run(&whole));
    let is_cfg = IsConfig {
        level: IsLevel::Sequence,
        filter: IsFilter::Truncate { min: 0.0, max: 2.0 },
        ..IsConfig::default()
    };
    let is_run = |k: &LossKernel<'_>| {
        let mut w = vec![0f32; n];
        k.is_weights(&is_cfg, &b.old, &b.lp, &b.tokens(), &mut w)
            .unwrap();
        bits(&w)
    };
    assert_eq!(is_run(&split), is_run(&whole));
    let p3o_cfg = P3oConfig::<f32>::default();
    let ess = |k: &LossKernel<'_>| k.ess_stats(&p3o_cfg, &b.inputs()).unwrap();
    let (es, ew) = (ess(&split), ess(&whole));
    assert_eq!(
        (es.n, es.sum_w.to_bits(), es.sum_w2.to_bits()),
        (ew.n, ew.sum_w.to_bits(), ew.sum_w2.to_bits())
    );
    let agg = grpo_core::aggregate::AggConfig::from_preset(
        Preset::Paper,
        grpo_core::aggregate::AggMode::SeqMeanTokenSum,
    );
    let values: Vec<f32> = (0..n)
        .map(|t| if b.mask[t] { wv[t] } else { f32::NAN })
        .collect();
    let agg_run = |k: &LossKernel<'_>| {
        let mut w = vec![0f32; n];
        let l = k.aggregate(&agg, b.tokens(), &values, &mut w).unwrap();
        (l.to_bits(), bits(&w))
    };
    let (ls, ws) = agg_run(&split);
    assert_eq!((ls, ws.clone()), agg_run(&whole));
    let mut cw = vec![0f32; n];
    let lc = grpo_core::aggregate::aggregate(&agg, b.tokens(), &values, &mut cw).unwrap();
    assert_eq!((ls, ws), (lc.to_bits(), bits(&cw)));

    // A limit of 1 workgroup per dimension cannot hold 32 workgroups in a 2-D grid.
    capped.set_max_workgroups_per_dimension(1);
    let (mut v, mut g) = (vec![7f32; n], vec![7f32; n]);
    let e = split.ppo_clip(&cfg, &b.inputs(), &mut v, &mut g);
    assert_eq!(
        e,
        Err(GpuError::TooManyWorkgroups {
            needed: 32,
            limit: 1,
            per_dimension: 1
        })
    );
    assert!(v.iter().chain(&g).all(|&x| x == 7.0));
    capped.set_max_workgroups_per_dimension(u32::MAX);

    // Bindings of exactly n words fit; the 3·n words read back go through three staging buffers.
    let words = (n * 4) as u64;
    capped.set_binding_cap(words);
    let (v3, g3, d3) = run(&split);
    assert_eq!((bits(&v3), bits(&g3), d3), (bits(&wv), bits(&wg), dw));
    // One word less: a clear TooLarge naming the limit, outputs untouched.
    capped.set_binding_cap(words - 4);
    let e = split.ppo_clip(&cfg, &b.inputs(), &mut v, &mut g);
    assert_eq!(
        e,
        Err(GpuError::TooLarge {
            what: "buffer binding",
            bytes: words,
            limit: words - 4
        })
    );
    assert!(v.iter().chain(&g).all(|&x| x == 7.0));
    eprintln!(
        "2-D dispatch: {n} tokens, {seqs} sequences, at most 6 workgroups per dimension: \
         identical to one dimension"
    );
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Observed figures of the geometric / batch-normalised IS tests (printed at the end).
#[derive(Default)]
struct IsStats {
    cases: std::cell::Cell<u64>,
    /// Max ULP distance of an unnormalised weight whose exp argument is the geometric mean.
    geo_ulp: std::cell::Cell<u64>,
    /// Max ULP distance of any other unnormalised weight.
    other_ulp: std::cell::Cell<u64>,
    /// Max ULP distance of a batch-normalised weight.
    norm_ulp: std::cell::Cell<u64>,
    /// Max ULP distance beyond the weight's own allowance (exp and division, without the base):
    /// geometric-mean weights, batch-normalised weights (beyond their own and the largest).
    geo_excess: std::cell::Cell<i64>,
    norm_excess: std::cell::Cell<i64>,
    /// Sequences whose geometric-mean ratio (or weight) sat within the tolerance of a bound.
    borderline: std::cell::Cell<u64>,
}

fn bump(c: &std::cell::Cell<u64>, v: u64) {
    c.set(c.get().max(v));
}

/// grpo-core's f32 Σ r_t (token order) and r̄ = Σ/n of sequence i, r_t = old_t − roll_t.
fn sum_mean(old: &[f32], roll: &[f32], tokens: &Tokens<'_>, i: usize) -> (f32, f32) {
    let s = tokens
        .valid_positions(i)
        .fold(0f32, |s, t| s + (old[t] - roll[t]));
    (s, s / tokens.valid_count(i).max(1) as f32)
}

/// One comparison of `LossKernel::is_weights` with grpo-core's `is_weights` (weights and every
/// diagnostic), borderline sequences (a ratio compared with a bound within the tolerance of
/// that bound) excluded from the exact comparisons and counted.
fn check_is_case(
    k: &LossKernel<'_>,
    cfg: &IsConfig<f32>,
    old: &[f32],
    roll: &[f32],
    tokens: &Tokens<'_>,
    st: &IsStats,
) -> Result<(), TestCaseError> {
    let n = old.len();
    let mut cw = vec![7f32; n];
    let dc = is_weights(cfg, old, roll, tokens, &mut cw).unwrap();
    let mut gw = vec![7f32; n];
    let dg = k.is_weights(cfg, old, roll, tokens, &mut gw).unwrap();
    st.cases.set(st.cases.get() + 1);
    let lim = cfg.log_clamp.unwrap_or(43.36).min(43.36);
    let base = tolerance(Op::IsWeights, Dtype::F32);
    let div = tolerance(Op::IsWeightsGeometric, Dtype::F32);
    // Per valid token: (exp argument of its weight, its tolerance, borderline?).
    let mut info = vec![(0f32, base, false); n];
    let mut any_border = false;
    for i in 0..tokens.num_sequences() {
        let (sum, mean) = sum_mean(old, roll, tokens, i);
        let mean_l = mean.clamp(-lim, lim);
        // exp's allowance at r̄ plus the WGSL division's 2.5 ULP of r̄ (1.25·|r̄| as an exp
        // argument: 2.5|r̄| ULP of e^{r̄}).
        let mean_tol = div.plus_ulp(exp_ulps(&[mean_l as f64, 1.25 * mean as f64]));
        let geo_border = match cfg.filter {
            IsFilter::GeometricMask { lo, hi } => {
                let g = Real::exp(mean_l);
                [lo, hi]
                    .iter()
                    .any(|&p| ulp_distance(g, p) <= mean_tol.ulp.max(64) as u64)
            }
            _ => false,
        };
        for t in tokens.valid_positions(i) {
            let (l, tol) = match cfg.level {
                IsLevel::Token => {
                    let l = (old[t] - roll[t]).clamp(-lim, lim);
                    (l, base.plus_ulp(exp_ulps(&[l as f64])))
                }
                IsLevel::Sequence => {
                    let l = sum.clamp(-lim, lim);
                    (l, base.plus_ulp(exp_ulps(&[l as f64])))
                }
                IsLevel::GeometricMean => (mean_l, mean_tol),
            };
            let w = Real::exp(l);
            let border = geo_border
                || match cfg.filter {
                    IsFilter::Truncate { min: a, max: b } | IsFilter::Mask { lo: a, hi: b } => {
                        [a, b]
                            .iter()
                            .any(|&p| ulp_distance(w, p) <= tol.ulp.max(64) as u64)
                    }
                    _ => false,
                };
            any_border |= border;
            info[t] = (l, tol, border);
        }
        st.borderline.set(st.borderline.get() + geo_border as u64);
    }
    // The batch-normalised weights share one divisor, itself a mean of GPU weights: each weight
    // may carry its own exp error and, through the divisor, up to the largest one in the batch.
    let max_tol = info.iter().map(|x| x.1.ulp).max().unwrap_or(0);
    let norm_extra = tolerance(Op::IsBatchNormalize, Dtype::F32).ulp + max_tol;
    // verl's threshold: the weights are divided only by a mean above 1e-8. A mean within the
    // weights' tolerance of it may be divided on one backend and not on the other (a sequence
    // weight 0.1⁸ sits right there).
    if cfg.batch_normalize {
        let raw_cfg = IsConfig {
            batch_normalize: false,
            ..*cfg
        };
        let mut raw = vec![0f32; n];
        is_weights(&raw_cfg, old, roll, tokens, &mut raw).unwrap();
        let (mut sum, mut count) = (0f64, 0usize);
        for i in 0..tokens.num_sequences() {
            for (j, t) in tokens.valid_positions(i).enumerate() {
                if cfg.level == IsLevel::Token || j == 0 {
                    sum += raw[t] as f64;
                    count += 1;
                }
            }
        }
        let th = IS_NORMALIZE_MIN_MEAN;
        let slack = th * (max_tol + 8) as f64 * f32::EPSILON as f64;
        if count > 0 && (sum / count as f64 - th).abs() <= slack {
            any_border = true;
            st.borderline.set(st.borderline.get() + 1);
        }
    }
    for i in 0..tokens.num_sequences() {
        for t in tokens.valid_positions(i) {
            let (_, tol, border) = info[t];
            if border || (cfg.batch_normalize && any_border) {
                continue;
            }
            let d = ulp_distance(gw[t], cw[t]);
            let own = (tol.ulp - base.ulp) as i64;
            let tol = if cfg.batch_normalize {
                bump(&st.norm_ulp, d);
                let e = d as i64 - own - (max_tol - base.ulp) as i64;
                st.norm_excess.set(st.norm_excess.get().max(e));
                tol.plus_ulp(norm_extra)
            } else {
                if cfg.level == IsLevel::GeometricMean {
                    bump(&st.geo_ulp, d);
                    st.geo_excess.set(st.geo_excess.get().max(d as i64 - own));
                } else {
                    bump(&st.other_ulp, d);
                }
                tol
            };
            prop_assert!(
                tol.accepts(gw[t], cw[t] as f64),
                "w[{t}] gpu {} core {} ({d} ulp, allowed {})",
                gw[t],
                cw[t],
                tol.ulp
            );
        }
    }
    for t in 0..n {
        if !tokens.is_valid(t) {
            prop_assert_eq!(gw[t], 0.0);
        }
    }
    prop_assert_eq!(dc.tokens, dg.tokens);
    prop_assert_eq!(dc.log_clamped, dg.log_clamped);
    if !any_border {
        prop_assert_eq!(dc.filtered, dg.filtered);
        prop_assert_eq!(dc.min == 0.0, dg.min == 0.0);
        // Each statistic is one of the weights (min, max) or their running mean: within the
        // largest weight tolerance of the batch (normalised: plus the divisor's).
        let extra = if cfg.batch_normalize { norm_extra } else { 0 };
        let tol = Tol {
            ulp: max_tol + extra,
            abs: f32::MIN_POSITIVE as f64,
            rel: 0.0,
        };
        for (name, c, g) in [
            ("min", dc.min, dg.min),
            ("max", dc.max, dg.max),
            ("mean", dc.mean, dg.mean),
        ] {
            let d = ulp_distance(g, c);
            // The running mean adds up to one rounding per step on top of its inputs'.
            let tol = if name == "mean" {
                tol.plus_ulp(dc.tokens as u32)
            } else {
                tol
            };
            prop_assert!(
                tol.accepts(g, c as f64),
                "{name}: gpu {g} core {c} ({d} ulp, allowed {})",
                tol.ulp
            );
        }
    }
    Ok(())
}

/// A padded batch: `rows × len` with a mask (rows may be all-masked), NaN in masked positions.
#[derive(Debug, Clone)]
struct PaddedIs {
    rows: usize,
    len: usize,
    old: Vec<f32>,
    roll: Vec<f32>,
    mask: Vec<bool>,
}

fn padded_is() -> impl Strategy<Value = PaddedIs> {
    (1usize..6, 0usize..24)
        .prop_flat_map(|(rows, len)| {
            let n = rows * len;
            let r = prop_oneof![
                4 => -0.5f32..0.5,
                2 => -3.0f32..3.0,
                1 => -80.0f32..80.0,
                1 => Just(0.0f32),
            ];
            (
                Just((rows, len)),
                prop::collection::vec(-12.0f32..0.0, n),
                prop::collection::vec(r, n),
                prop::collection::vec(prop::bool::weighted(0.8), n),
            )
        })
        .prop_map(|((rows, len), roll, r, mask)| {
            let mut old: Vec<f32> = roll.iter().zip(&r).map(|(a, r)| a + r).collect();
            let mut roll = roll;
            for t in 0..old.len() {
                if !mask[t] {
                    old[t] = f32::NAN;
                    roll[t] = f32::INFINITY;
                }
            }
            PaddedIs {
                rows,
                len,
                old,
                roll,
                mask,
            }
        })
}

/// Packed sequences whose mean log-ratio sits at ln(bound)·(1 + tiny) for one of `bounds`
/// (a token pattern ±d around it), or anywhere: geometric means on and near the mask bounds.
fn near_bounds(bounds: Vec<f32>) -> impl Strategy<Value = (Vec<f32>, Vec<f32>, Vec<usize>)> {
    let seq = (
        1usize..12,
        prop::sample::select(bounds),
        prop_oneof![Just(0.0f32), -1e-6f32..1e-6, -1e-3f32..1e-3],
        0.0f32..2.0,
        -5.0f32..0.0,
    );
    prop::collection::vec(seq, 1..6).prop_map(|seqs| {
        let (mut old, mut roll, mut cu) = (vec![], vec![], vec![0]);
        for (len, bound, rel, d, base) in seqs {
            let target = bound.ln() * (1.0 + rel) + rel;
            for j in 0..len {
                // Pairs ±d cancel; an odd last token carries the target alone.
                let dev = if len % 2 == 1 && j == len - 1 {
                    0.0
                } else if j % 2 == 0 {
                    d
                } else {
                    -d
                };
                roll.push(base);
                old.push(base + target + dev);
            }
            cu.push(old.len());
        }
        (old, roll, cu)
    })
}

fn geometric_configs() -> Vec<IsConfig<f32>> {
    let geo = |filter| IsConfig {
        level: IsLevel::GeometricMean,
        filter,
        ..IsConfig::default()
    };
    let norm = |c: IsConfig<f32>| IsConfig {
        batch_normalize: true,
        ..c
    };
    vec![
        geo(IsFilter::None),
        geo(IsFilter::Truncate { min: 0.0, max: 2.0 }),
        geo(IsFilter::Truncate { min: 0.5, max: 5.0 }),
        geo(IsFilter::Mask { lo: 0.5, hi: 2.0 }),
        IsConfig {
            log_clamp: None,
            ..geo(IsFilter::Mask { lo: 0.1, hi: 10.0 })
        },
        geo(IsFilter::GeometricMask { lo: 0.8, hi: 1.25 }),
        IsConfig::seq_mask_tis(),
        IsConfig {
            filter: IsFilter::GeometricMask { lo: 0.9, hi: 1.1 },
            ..IsConfig::default()
        },
        IsConfig {
            log_clamp: None,
            ..IsConfig::seq_mask_tis()
        },
        IsConfig {
            level: IsLevel::Sequence,
            filter: IsFilter::GeometricMask { lo: 0.5, hi: 2.0 },
            ..IsConfig::default()
        },
        norm(IsConfig::default()),
        norm(IsConfig::tis()),
        norm(IsConfig::icepop()),
        norm(IsConfig::sequence_truncate(3.0)),
        norm(IsConfig::sequence_mask(0.5, 2.0)),
        norm(geo(IsFilter::None)),
        norm(geo(IsFilter::Truncate { min: 0.0, max: 2.0 })),
        norm(IsConfig::seq_mask_tis()),
        norm(IsConfig {
            log_clamp: None,
            ..IsConfig::default()
        }),
    ]
}

#[test]
fn geometric_and_normalised_is_weights_match_grpo_core() {
    let Some(ctx) = gpu::context("geometric_and_normalised_is_weights_match_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let st = IsStats::default();
    st.geo_excess.set(i64::MIN);
    st.norm_excess.set(i64::MIN);
    let configs = geometric_configs();
    for cfg in &configs {
        // Packed (with empty and all-masked sequences): lp plays old, old plays roll.
        gpu::runner()
            .run(&batch(), |b| {
                check_is_case(&k, cfg, &b.lp, &b.old, &b.tokens(), &st)
            })
            .unwrap();
        // Padded rows.
        gpu::runner()
            .run(&padded_is(), |p| {
                let tok = Tokens::padded(p.rows, p.len, Some(&p.mask));
                check_is_case(&k, cfg, &p.old, &p.roll, &tok, &st)
            })
            .unwrap();
        // Geometric means on and near the mask bounds (and the truncation points).
        let bounds = match cfg.filter {
            IsFilter::Truncate { min, max } => vec![min.max(0.1), max],
            IsFilter::Mask { lo, hi } | IsFilter::GeometricMask { lo, hi } => vec![lo, hi],
            IsFilter::None => vec![0.5, 1.0, 2.0],
        };
        gpu::runner()
            .run(&near_bounds(bounds), |(old, roll, cu)| {
                check_is_case(&k, cfg, &old, &roll, &Tokens::packed(&cu, None), &st)
            })
            .unwrap();
    }
    eprintln!(
        "geometric/normalised is_weights: {} configs, {} cases; max distance to grpo-core: \
         geometric-mean weights {} ULP ({} beyond exp + ÷ allowance), other weights {} ULP, \
         batch-normalised {} ULP ({} beyond the allowances of the weight and of the largest); \
         {} borderline sequences",
        configs.len(),
        st.cases.get(),
        st.geo_ulp.get(),
        st.geo_excess.get(),
        st.other_ulp.get(),
        st.norm_ulp.get(),
        st.norm_excess.get(),
        st.borderline.get()
    );
}

#[test]
fn geometric_is_weights_hand_computed_and_errors() {
    let Some(ctx) = gpu::context("geometric_is_weights_hand_computed_and_errors") else {
        return;
    };
    let k = LossKernel::new(ctx);
    // One row r = [ln 0.25, ln 2, ln 10], one row r = [ln 10, ln 10, (masked)].
    let l = |x: f32| x.ln();
    let old = [l(0.25), l(2.0), l(10.0), l(10.0), l(10.0), f32::NAN];
    let roll = [0f32; 6];
    let mask = [true, true, true, true, true, false];
    let tok = Tokens::padded(2, 3, Some(&mask));
    let mut w = [0f32; 6];
    // seq-mask-tis: row 0's geometric mean 5^{1/3} is kept with unclamped token weights; row 1's
    // is 10 > 5: zeroed, its two valid tokens counted as filtered.
    let d = k
        .is_weights(&IsConfig::seq_mask_tis(), &old, &roll, &tok, &mut w)
        .unwrap();
    assert!(
        (w[0] - 0.25).abs() < 1e-6 && (w[1] - 2.0).abs() < 1e-5,
        "{w:?}"
    );
    assert!((w[2] - 10.0).abs() < 1e-4, "{w:?}");
    assert_eq!(&w[3..], &[0.0; 3]);
    assert_eq!((d.tokens, d.filtered, d.min), (5, 2, 0.0));
    // Geometric level, cap 2: [5^{1/3} ≈ 1.71 ×3 | min(10, 2) ×2].
    let cfg = IsConfig {
        level: IsLevel::GeometricMean,
        filter: IsFilter::Truncate { min: 0.0, max: 2.0 },
        ..IsConfig::default()
    };
    let d = k.is_weights(&cfg, &old, &roll, &tok, &mut w).unwrap();
    let g = 5f32.cbrt();
    assert!(w[..3].iter().all(|&x| (x - g).abs() < 1e-5), "{w:?}");
    assert_eq!((w[3], w[4], w[5]), (2.0, 2.0, 0.0));
    assert_eq!(d.filtered, 2);
    // Batch-normalised: divided by the mean over the two sequences (g + 2)/2.
    let cfg = IsConfig {
        batch_normalize: true,
        ..cfg
    };
    let d = k.is_weights(&cfg, &old, &roll, &tok, &mut w).unwrap();
    let m = (g + 2.0) / 2.0;
    assert!(
        (w[0] - g / m).abs() < 1e-5 && (w[4] - 2.0 / m).abs() < 1e-5,
        "{w:?}"
    );
    assert!((d.mean - (3.0 * g + 4.0) / 5.0 / m).abs() < 1e-5);
    // Errors: grpo-core's, weights untouched.
    let errs = [
        (
            IsConfig {
                filter: IsFilter::GeometricMask { lo: 2.0, hi: 1.0 },
                ..IsConfig::default()
            },
            roll.to_vec(),
        ),
        (
            IsConfig {
                filter: IsFilter::GeometricMask {
                    lo: 0.5,
                    hi: f32::INFINITY,
                },
                ..IsConfig::default()
            },
            roll.to_vec(),
        ),
        (
            IsConfig {
                filter: IsFilter::GeometricMask { lo: -1.0, hi: 1.0 },
                ..IsConfig::default()
            },
            roll.to_vec(),
        ),
        (
            IsConfig {
                level: IsLevel::GeometricMean,
                log_clamp: Some(0.0),
                batch_normalize: true,
                ..IsConfig::default()
            },
            roll.to_vec(),
        ),
        (
            IsConfig {
                level: IsLevel::GeometricMean,
                batch_normalize: true,
                ..IsConfig::default()
            },
            vec![0.0, 0.0, 0.0, f32::INFINITY, 0.0, 0.0],
        ),
        (IsConfig::seq_mask_tis(), vec![0.0; 5]),
    ];
    for (cfg, roll) in &errs {
        let mut cw = [9f32; 6];
        let e = is_weights(cfg, &old, roll, &tok, &mut cw).unwrap_err();
        let mut gw = [9f32; 6];
        assert_eq!(
            k.is_weights(cfg, &old, roll, &tok, &mut gw),
            Err(GpuError::Core(e))
        );
        assert_eq!((cw, gw), ([9f32; 6], [9f32; 6]));
    }
}

/// The benchmark hook `LossKernel::resident_ppo_clip` computes what `LossKernel::ppo_clip`
/// computes: value (binding 5) and gradient (binding 6) read back after one run are the public
/// operation's bits, masked tokens included.
#[test]
fn resident_ppo_clip_computes_the_public_operation() {
    let Some(ctx) = gpu::context("resident_ppo_clip_computes_the_public_operation") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let (rows, len) = (3usize, 70usize);
    let n = rows * len;
    // Log-ratios in [−0.6, 0.6): inside and outside the clip range [0.8, 1.2].
    let lp: Vec<f32> = (0..n).map(|i| -1.0 - (i % 13) as f32 * 0.05).collect();
    let old: Vec<f32> = (0..n)
        .map(|i| lp[i] - ((i * 7 % 24) as f32 * 0.05 - 0.6))
        .collect();
    let adv: Vec<f32> = (0..n).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect();
    let mask: Vec<bool> = (0..n).map(|i| i % 11 != 3).collect();
    let inp = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &adv,
        tokens: Tokens::padded(rows, len, Some(&mask)),
    };
    let cfg = PpoClipConfig::default();
    let (mut value, mut grad) = (vec![0f32; n], vec![0f32; n]);
    k.ppo_clip(&cfg, &inp, &mut value, &mut grad).unwrap();
    let work = k.resident_ppo_clip(&cfg, &inp).unwrap();
    work.run().unwrap();
    let floats = |bytes: Vec<u8>| gpu::f32_bits(&bytes, n);
    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(floats(work.read(5).unwrap()), bits(&value), "value");
    assert_eq!(floats(work.read(6).unwrap()), bits(&grad), "gradient");
    // The clip range was left on both sides and some tokens are masked: the check has teeth.
    assert!(grad.iter().zip(&mask).any(|(g, m)| *m && *g == 0.0));
    assert!(grad.iter().zip(&mask).any(|(g, m)| *m && *g != 0.0));
}
