//! grpo-wgpu's advantage estimators against grpo-core in f32, within the tolerance table
//! (`grpo_tests::tolerance`): same config structs, same layouts, random and edge inputs, and
//! identical errors with `out` untouched. Skips without an adapter unless `GRPO_REQUIRE_GPU=1`.

use grpo_core::Groups;
use grpo_core::advantage::rank::{G2rpoConfig, GopoConfig, g2rpo, gopo, rank_scratch_len};
use grpo_core::advantage::{
    GdpoConfig, NanPolicy, RlooConfig, Scale, SingletonRule, ZScoreConfig, gdpo, gdpo_scratch_len,
    rloo, zscore,
};
use grpo_core::stats::{Bessel, TiePolicy};
use grpo_core::{Error, Preset};
use grpo_tests::gpu;
use grpo_tests::tolerance::{Dtype, Op, Tol, tolerance, ulp_distance};
use grpo_wgpu::{AdvantageKernel, GpuError};
use proptest::prelude::*;

/// Scores of one batch: binary, small integers, continuous, huge, or all equal.
fn score() -> impl Strategy<Value = f32> {
    prop_oneof![
        3 => prop_oneof![Just(0.0f32), Just(1.0f32)],
        2 => (-3i32..4).prop_map(|x| x as f32),
        3 => -10.0f32..10.0,
        1 => -1e6f32..1e6,
        1 => Just(0.1f32),
        1 => Just(-0.0f32),
    ]
}

#[derive(Debug, Clone)]
struct Batch {
    scores: Vec<f32>,
    /// Group boundaries (CSR).
    offsets: Vec<usize>,
    /// Uniform size when the batch is uniform.
    uniform: Option<usize>,
}

impl Batch {
    fn groups(&self) -> Groups<'_> {
        match self.uniform {
            Some(g) => Groups::Uniform(g),
            None => Groups::Offsets(&self.offsets),
        }
    }
}

fn batch(min_group: usize, nan: bool) -> impl Strategy<Value = Batch> {
    let sizes = prop::collection::vec(min_group..10usize, 1..12);
    (sizes, any::<bool>(), any::<u64>())
        .prop_flat_map(move |(sizes, uniform, seed)| {
            let sizes = if uniform {
                vec![sizes[0]; sizes.len()]
            } else {
                sizes
            };
            let n: usize = sizes.iter().sum();
            let s = if nan {
                prop::collection::vec(prop_oneof![9 => score(), 1 => Just(f32::NAN)], n).boxed()
            } else {
                prop::collection::vec(score(), n).boxed()
            };
            (s, Just(sizes), Just(uniform), Just(seed))
        })
        .prop_map(|(mut scores, sizes, uniform, seed)| {
            let mut offsets = vec![0];
            for s in &sizes {
                offsets.push(offsets.last().unwrap() + s);
            }
            // Sometimes make a group all-equal (the zero-variance path).
            if seed % 3 == 0 {
                let (a, b) = (offsets[0], offsets[1]);
                let v = scores[a];
                scores[a..b].fill(v);
            }
            Batch {
                scores,
                offsets,
                uniform: uniform.then_some(sizes[0]),
            }
        })
}

/// The per-element tolerance of a z-score-like result: table ULPs, plus the cancellation slack
/// of a last-bit difference in μ (ulp(max|s|)/(σ + ε) of the group, in f64).
/// Largest ULP distance seen by `check_close` in this process (reported by the tests).
static MAX_ULP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn check_close(got: &[f32], want: &[f32], tol: Tol, slack: &[f64]) -> Result<(), TestCaseError> {
    for i in 0..got.len() {
        MAX_ULP.fetch_max(
            ulp_distance(got[i], want[i]),
            std::sync::atomic::Ordering::Relaxed,
        );
        let ok = tol
            .with_abs(tol.abs + slack[i])
            .accepts(got[i], want[i] as f64);
        prop_assert!(
            ok,
            "index {i}: gpu {} vs core {} ({} ulp)",
            got[i],
            want[i],
            ulp_distance(got[i], want[i])
        );
    }
    Ok(())
}

/// `2·ulp(max|s| of the group)/(σ_g + ε)^γ` per sample (σ in f64, population or unbiased):
/// the divisor is the one the estimator divides by, the dial γ included (with γ < 1 and
/// σ + ε > 1 it is far below σ + ε, and a last-bit difference in μ weighs that much more).
fn zscore_slack(b: &Batch, eps: f64, scale: Scale, gamma: f64) -> Vec<f64> {
    let mut slack = vec![0.0; b.scores.len()];
    let all: Vec<f64> = b
        .scores
        .iter()
        .filter(|s| !s.is_nan())
        .map(|&s| s as f64)
        .collect();
    let sd = |v: &[f64]| {
        if v.len() < 2 {
            return 0.0;
        }
        let m = v.iter().sum::<f64>() / v.len() as f64;
        (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
    };
    let batch_sd = sd(&all);
    for k in 0..b.offsets.len() - 1 {
        let r = b.offsets[k]..b.offsets[k + 1];
        let v: Vec<f64> = b.scores[r.clone()]
            .iter()
            .filter(|s| !s.is_nan())
            .map(|&s| s as f64)
            .collect();
        let max = v.iter().fold(0.0f64, |a, x| a.max(x.abs()));
        let den = match scale {
            Scale::Group => (sd(&v) + eps).powf(gamma),
            Scale::Batch => (batch_sd + eps).powf(gamma),
            Scale::None => 1.0,
        };
        for i in r {
            slack[i] = grpo_tests::tolerance::zscore_abs(max, den.max(f64::MIN_POSITIVE)) * 2.0;
        }
    }
    slack
}

fn zscore_configs() -> Vec<ZScoreConfig> {
    let mut v = vec![];
    for p in [
        Preset::Paper,
        Preset::Verl,
        Preset::VerlVectorized,
        Preset::Trl,
        Preset::OpenRlhf,
    ] {
        v.push(ZScoreConfig::from_preset(p));
    }
    v.push(ZScoreConfig::dr_grpo());
    v.push(ZScoreConfig::default().with_scale(Scale::Batch));
    v.push(ZScoreConfig::from_preset(Preset::Trl).with_scale(Scale::Batch));
    v.push(ZScoreConfig {
        bessel: Bessel::Population,
        ..ZScoreConfig::default()
    });
    v
}

#[test]
fn zscore_family_matches_grpo_core() {
    let Some(ctx) = gpu::context("zscore_family_matches_grpo_core") else {
        return;
    };
    let k = AdvantageKernel::new(ctx);
    for cfg in zscore_configs() {
        let nan = cfg.nan == NanPolicy::Exclude;
        let min = if cfg.singleton == SingletonRule::Reject {
            2
        } else {
            1
        };
        gpu::runner()
            .run(&batch(min, nan), |b| {
                let mut want = vec![0f32; b.scores.len()];
                let core = zscore(&b.scores, b.groups(), &cfg, &mut want);
                let mut got = vec![7f32; b.scores.len()];
                let gpu = k.zscore(&b.scores, b.groups(), &cfg, &mut got);
                match (core, gpu) {
                    (Ok(dc), Ok(dg)) => {
                        let slack = zscore_slack(&b, cfg.eps, cfg.scale, cfg.gamma);
                        check_close(&got, &want, tolerance(Op::AdvZscore, Dtype::F32), &slack)?;
                        prop_assert_eq!(dc.zero_variance_groups, dg.zero_variance_groups);
                        prop_assert_eq!(dc.singleton_groups, dg.singleton_groups);
                        prop_assert_eq!(dc.nan_excluded, dg.nan_excluded);
                    }
                    (Err(e), g) => prop_assert_eq!(g.map(|_| ()), Err(GpuError::Core(e))),
                    (Ok(_), Err(e)) => prop_assert!(false, "gpu failed: {e}"),
                }
                Ok(())
            })
            .unwrap();
    }
    eprintln!(
        "zscore family: {} configs × {} cases; max distance to grpo-core so far: {} ULP",
        zscore_configs().len(),
        gpu::cases(),
        MAX_ULP.load(std::sync::atomic::Ordering::Relaxed)
    );
}

#[test]
fn dial_gamma_matches_grpo_core() {
    let Some(ctx) = gpu::context("dial_gamma_matches_grpo_core") else {
        return;
    };
    let k = AdvantageKernel::new(ctx);
    gpu::runner()
        .run(&(batch(1, false), 0.0f64..=1.0), |(b, gamma)| {
            let cfg = ZScoreConfig::default().with_gamma(gamma);
            let mut want = vec![0f32; b.scores.len()];
            zscore(&b.scores, b.groups(), &cfg, &mut want).unwrap();
            let mut got = vec![0f32; b.scores.len()];
            k.zscore(&b.scores, b.groups(), &cfg, &mut got).unwrap();
            let slack = zscore_slack(&b, cfg.eps, Scale::Group, gamma);
            check_close(&got, &want, tolerance(Op::AdvDialPow, Dtype::F32), &slack)
        })
        .unwrap();
    eprintln!(
        "dial γ: {} cases; max distance to grpo-core so far: {} ULP",
        gpu::cases(),
        MAX_ULP.load(std::sync::atomic::Ordering::Relaxed)
    );
}

#[test]
fn rloo_matches_grpo_core() {
    let Some(ctx) = gpu::context("rloo_matches_grpo_core") else {
        return;
    };
    let k = AdvantageKernel::new(ctx);
    for p in [Preset::Paper, Preset::Verl, Preset::Trl, Preset::OpenRlhf] {
        let cfg = RlooConfig::from_preset(p);
        gpu::runner()
            .run(&batch(1, cfg.nan == NanPolicy::Exclude), |b| {
                let mut want = vec![0f32; b.scores.len()];
                let core = rloo(&b.scores, b.groups(), &cfg, &mut want);
                let mut got = vec![7f32; b.scores.len()];
                let gpu = k.rloo(&b.scores, b.groups(), &cfg, &mut got);
                match (core, gpu) {
                    (Ok(_), Ok(_)) => {
                        let slack = zscore_slack(&b, 0.0, Scale::None, 1.0);
                        check_close(&got, &want, tolerance(Op::AdvZscore, Dtype::F32), &slack)?;
                    }
                    (Err(e), g) => {
                        prop_assert_eq!(g.map(|_| ()), Err(GpuError::Core(e)));
                        prop_assert!(got.iter().all(|&x| x == 7.0));
                    }
                    (Ok(_), Err(e)) => prop_assert!(false, "gpu failed: {e}"),
                }
                Ok(())
            })
            .unwrap();
    }
    eprintln!(
        "rloo: {} cases; max distance to grpo-core so far: {} ULP",
        gpu::cases(),
        MAX_ULP.load(std::sync::atomic::Ordering::Relaxed)
    );
}

#[test]
fn gopo_and_g2rpo_match_grpo_core() {
    let Some(ctx) = gpu::context("gopo_and_g2rpo_match_grpo_core") else {
        return;
    };
    let k = AdvantageKernel::new(ctx);
    for ties in [TiePolicy::Ordinal, TiePolicy::Average] {
        let cfg = GopoConfig {
            ties,
            nan: NanPolicy::Exclude,
        };
        gpu::runner()
            .run(&batch(2, true), |b| {
                let n = b.scores.len();
                let mut want = vec![0f32; n];
                let mut scratch = vec![0usize; rank_scratch_len(n)];
                gopo(&b.scores, b.groups(), &cfg, &mut scratch, &mut want).unwrap();
                let mut got = vec![0f32; n];
                k.gopo(&b.scores, b.groups(), &cfg, &mut got).unwrap();
                check_close(
                    &got,
                    &want,
                    tolerance(Op::AdvGopo, Dtype::F32),
                    &vec![0.0; n],
                )
            })
            .unwrap();
    }
    let cfg = G2rpoConfig {
        nan: NanPolicy::Exclude,
    };
    gpu::runner()
        .run(&batch(1, true), |b| {
            let n = b.scores.len();
            let mut want = vec![0f32; n];
            let mut scratch = vec![0usize; rank_scratch_len(n)];
            g2rpo(&b.scores, b.groups(), &cfg, &mut scratch, &mut want).unwrap();
            let mut got = vec![0f32; n];
            k.g2rpo(&b.scores, b.groups(), &cfg, &mut got).unwrap();
            check_close(
                &got,
                &want,
                tolerance(Op::AdvG2rpo, Dtype::F32),
                &vec![0.0; n],
            )?;
            // Mean 0 per group (mirrored normal scores cancel; tie blocks average them).
            for w in b.offsets.windows(2) {
                let sum: f64 = got[w[0]..w[1]].iter().map(|&x| x as f64).sum();
                prop_assert!(sum.abs() <= 1e-5 * (w[1] - w[0]) as f64, "group sum {sum}");
            }
            Ok(())
        })
        .unwrap();
    eprintln!(
        "gopo+g2rpo: {} cases; max distance to grpo-core so far: {} ULP",
        gpu::cases(),
        MAX_ULP.load(std::sync::atomic::Ordering::Relaxed)
    );
}

#[test]
fn gdpo_matches_grpo_core() {
    let Some(ctx) = gpu::context("gdpo_matches_grpo_core") else {
        return;
    };
    let k = AdvantageKernel::new(ctx);
    let strat = (batch(1, false), 1usize..4).prop_flat_map(|(b, kk)| {
        let n = b.scores.len();
        (
            Just(b),
            Just(kk),
            prop::collection::vec(prop_oneof![9 => score(), 1 => Just(f32::NAN)], n * kk),
            prop::collection::vec(0.0f32..2.0, kk),
        )
    });
    let cfg = GdpoConfig::from_preset(Preset::Trl);
    gpu::runner()
        .run(&strat, |(b, kk, rewards, weights)| {
            let n = b.scores.len();
            let mut want = vec![0f32; n];
            let mut scratch = vec![0f32; gdpo_scratch_len(kk)];
            let core = gdpo(
                &rewards,
                kk,
                &weights,
                b.groups(),
                &cfg,
                &mut scratch,
                &mut want,
            );
            let mut got = vec![0f32; n];
            let gpu = k.gdpo(&rewards, kk, &weights, b.groups(), &cfg, &mut got);
            match (core, gpu) {
                (Ok(_), Ok(_)) => {
                    // Two z-score stages: the first stage's cancellation slack, relative to the
                    // batch σ of S, is bounded by 2^-20 of the largest |A| (measured ≤ 2^-22).
                    let amax = want.iter().fold(0f32, |a, x| a.max(x.abs())) as f64;
                    let slack = vec![amax * 2f64.powi(-20); n];
                    check_close(&got, &want, tolerance(Op::AdvGdpo, Dtype::F32), &slack)?;
                }
                (Err(e), g) => prop_assert_eq!(g.map(|_| ()), Err(GpuError::Core(e))),
                (Ok(_), Err(e)) => prop_assert!(false, "gpu failed: {e}"),
            }
            Ok(())
        })
        .unwrap();
    eprintln!(
        "gdpo: {} cases; max distance to grpo-core so far: {} ULP",
        gpu::cases(),
        MAX_ULP.load(std::sync::atomic::Ordering::Relaxed)
    );
}

#[test]
fn hand_computed_and_invariants() {
    let Some(ctx) = gpu::context("hand_computed_and_invariants") else {
        return;
    };
    let k = AdvantageKernel::new(ctx);
    // s = 3, 1, 0, 0: μ = 1, var_unb = 6/3 = 2, A = (2, 0, −1, −1)/(√2 + 1e-6).
    let mut a = [0f32; 4];
    k.zscore(
        &[3.0, 1.0, 0.0, 0.0],
        Groups::Uniform(4),
        &ZScoreConfig::default(),
        &mut a,
    )
    .unwrap();
    let den = 2f32.sqrt() + 1e-6;
    // (Welford's f32 mean of 3, 1, 0, 0 is 1 − 2^-24·…, so the middle one is ~4e-8, not 0.)
    for (x, w) in a.iter().zip([2.0 / den, 0.0, -1.0 / den, -1.0 / den]) {
        assert!(
            (x - w).abs() <= 2.0 * f32::EPSILON * w.abs() + 1e-7,
            "{x} vs {w}"
        );
    }
    // 2-GRPO: a pair gives exactly ±c.
    let mut a = [0f32; 2];
    k.zscore(
        &[0.1, 0.7],
        Groups::Uniform(2),
        &ZScoreConfig::default(),
        &mut a,
    )
    .unwrap();
    assert_eq!(a[0], -a[1]);
    // Identical non-dyadic rewards give exactly 0 (Welford, never E[x²] − E[x]²).
    let mut a = [1f32; 5];
    let d = k
        .zscore(
            &[0.1; 5],
            Groups::Uniform(5),
            &ZScoreConfig::default(),
            &mut a,
        )
        .unwrap();
    assert_eq!(a, [0.0; 5]);
    assert_eq!(d.zero_variance_groups, 1);
    // GOPO, ordinal: (5, 3, 3, 1) → ranks 1, 2, 3, 4 → 2, 2/3, −2/3, −2: the ends exact,
    // mirrored ranks exact negatives (2(G + 1 − 2·rank)/(G − 1) in the shader), the middle ones
    // within AdvGopo of grpo-core's 2 − 4/3 (whose quotient is rounded first).
    let mut a = [0f32; 4];
    k.gopo(
        &[5.0, 3.0, 3.0, 1.0],
        Groups::Uniform(4),
        &GopoConfig::default(),
        &mut a,
    )
    .unwrap();
    assert_eq!((a[0], a[3], a[1]), (2.0, -2.0, -a[2]), "{a:?}");
    assert!(
        tolerance(Op::AdvGopo, Dtype::F32).accepts(a[1], (2.0f32 - 4.0 / 3.0) as f64),
        "{a:?}"
    );
    // The middle rank gets exactly 0 (a driver fusing the division into 2 − q gave −6e-8 for
    // grpo-core's literal form on the H200's ordinal ranks of [0, 0, 0, 0, 3, 0, 1], index 1),
    // and so does an all-tied group under average ties.
    let avg = GopoConfig {
        ties: TiePolicy::Average,
        ..GopoConfig::default()
    };
    let mut a = [1f32; 7];
    k.gopo(&[0.7; 7], Groups::Uniform(7), &avg, &mut a).unwrap();
    assert_eq!(a, [0.0; 7]);
    let mut a = [1f32; 7];
    k.gopo(
        &[0.0, 0.0, 0.0, 0.0, 3.0, 0.0, 1.0],
        Groups::Uniform(7),
        &GopoConfig::default(),
        &mut a,
    )
    .unwrap();
    assert_eq!(a[1], 0.0, "{a:?}");
    // Distinct scores: the middle one 0, mirrored ranks exact negatives (the group sums to 0).
    let mut a = [1f32; 7];
    k.gopo(
        &[4.0, 1.0, 2.0, 3.0, 5.0, 6.0, 0.0],
        Groups::Uniform(7),
        &GopoConfig::default(),
        &mut a,
    )
    .unwrap();
    assert_eq!(a[3], 0.0, "{a:?}");
    let mut sorted = a;
    sorted.sort_by(f32::total_cmp);
    for (x, y) in sorted.iter().zip(sorted.iter().rev()) {
        assert_eq!(*x, -*y, "{a:?}");
    }
    // RLOO: (1, 0, 0): μ = 1/3, A_0 = 1 − 0 = 1, A_1 = 0 − 1/2 = −0.5.
    let mut a = [0f32; 3];
    k.rloo(
        &[1.0, 0.0, 0.0],
        Groups::Uniform(3),
        &RlooConfig::default(),
        &mut a,
    )
    .unwrap();
    assert!(
        (a[0] - 1.0).abs() < 1e-6 && (a[1] + 0.5).abs() < 1e-6,
        "{a:?}"
    );
}

#[test]
fn errors_match_grpo_core_and_leave_out_untouched() {
    let Some(ctx) = gpu::context("errors_match_grpo_core_and_leave_out_untouched") else {
        return;
    };
    let k = AdvantageKernel::new(ctx);
    let cases: Vec<(Vec<f32>, Vec<usize>, ZScoreConfig)> = vec![
        (
            vec![1.0, f32::NAN, 0.0, 1.0],
            vec![0, 2, 4],
            ZScoreConfig::default(),
        ),
        (
            vec![1.0, f32::INFINITY, 0.0, 1.0],
            vec![0, 2, 4],
            ZScoreConfig::from_preset(Preset::Trl),
        ),
        (
            vec![1.0, 0.0, 0.0],
            vec![0, 2, 2, 3],
            ZScoreConfig::default(),
        ),
        (
            vec![1.0, 0.0, 0.0],
            vec![0, 2, 3],
            ZScoreConfig::from_preset(Preset::OpenRlhf),
        ),
        (
            vec![1.0, 0.0, 0.0],
            vec![0, 2, 3],
            ZScoreConfig::default().with_gamma(2.0),
        ),
        (vec![1.0, 0.0, 0.0], vec![0, 2, 4], ZScoreConfig::default()),
        (vec![3e38, -3e38, 0.0], vec![0, 3], ZScoreConfig::dr_grpo()),
    ];
    for (scores, offsets, cfg) in cases {
        let mut want = vec![5f32; scores.len()];
        let e = zscore(&scores, Groups::Offsets(&offsets), &cfg, &mut want).unwrap_err();
        let mut got = vec![5f32; scores.len()];
        assert_eq!(
            k.zscore(&scores, Groups::Offsets(&offsets), &cfg, &mut got),
            Err(GpuError::Core(e))
        );
        assert!(got.iter().all(|&x| x == 5.0));
    }
    let mut out = [5f32; 2];
    assert_eq!(
        k.zscore(
            &[1.0, 2.0, 3.0],
            Groups::Uniform(3),
            &ZScoreConfig::default(),
            &mut out
        ),
        Err(GpuError::Core(Error::LengthMismatch {
            what: "out",
            expected: 3,
            found: 2
        }))
    );
}

/// More groups (and samples) than one dispatch dimension holds: with the context's
/// per-dimension workgroup limit forced down to 8, 1100 groups of 3 (18 workgroups of 64) need
/// a [8, 3, 1] grid for the per-group entry points (`group_stats`, `group_rank`, `gdpo_sum`) and
/// 3300 samples (52 workgroups) a [8, 7, 1] grid for GDPO's `finish`. Results are the uncapped context's bits, and the z-score
/// matches grpo-core within the tolerance table.
#[test]
fn groups_beyond_the_workgroup_limit_use_a_2d_dispatch() {
    let Some(ctx) = gpu::context("groups_beyond_the_workgroup_limit_use_a_2d_dispatch") else {
        return;
    };
    // Its own context: the cap must not reach the tests running in parallel.
    let capped = grpo_wgpu::GpuContext::new().unwrap();
    capped.set_max_workgroups_per_dimension(8);
    let (whole, split) = (AdvantageKernel::new(ctx), AdvantageKernel::new(&capped));
    let (groups, size) = (1100usize, 3usize);
    let n = groups * size;
    let scores: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 13) as f32 * 0.25 - 1.0)
        .collect();
    let g = Groups::Uniform(size);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    type Run<'a> = dyn Fn(&AdvantageKernel<'_>, &mut [f32]) + 'a;
    let zcfg = ZScoreConfig::default();
    let runs: Vec<(&str, Box<Run<'_>>)> = vec![
        (
            "zscore",
            Box::new(|k, out| {
                k.zscore(&scores, g, &zcfg, out).unwrap();
            }),
        ),
        (
            "rloo",
            Box::new(|k, out| {
                k.rloo(&scores, g, &RlooConfig::default(), out).unwrap();
            }),
        ),
        (
            "gopo",
            Box::new(|k, out| {
                k.gopo(&scores, g, &GopoConfig::default(), out).unwrap();
            }),
        ),
        (
            "gdpo",
            Box::new(|k, out| {
                let cfg = GdpoConfig::from_preset(Preset::Trl);
                k.gdpo(&scores, 1, &[1.0], g, &cfg, out).unwrap();
            }),
        ),
    ];
    for (name, run) in &runs {
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        run(&split, &mut a);
        run(&whole, &mut b);
        assert_eq!(bits(&a), bits(&b), "{name}");
        assert!(a.iter().any(|&x| x != 0.0), "{name}");
    }
    let mut got = vec![0f32; n];
    split.zscore(&scores, g, &zcfg, &mut got).unwrap();
    let mut want = vec![0f32; n];
    zscore(&scores, g, &zcfg, &mut want).unwrap();
    // The proptests' cancellation slack: a score equal to the mean (−0.5, 0, 0.5) got −1.5e-8
    // on NVIDIA H200, whose Welford mean was 7.45e-9 (the ÷ fused into the update).
    let b = Batch {
        scores: scores.clone(),
        offsets: (0..=groups).map(|k| k * size).collect(),
        uniform: Some(size),
    };
    let slack = zscore_slack(&b, zcfg.eps, zcfg.scale, zcfg.gamma);
    check_close(&got, &want, tolerance(Op::AdvZscore, Dtype::F32), &slack).unwrap();
}
