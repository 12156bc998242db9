//! Properties of the z-score family of group advantage estimators (grpo_core::advantage::{zscore,
//! rloo, passk, opo, gpg, multi_reward}): invariants, exactness, layout independence, references
//! written from the formulas, and error behaviour (outputs untouched).

use grpo_core::advantage::gpg::{GpgConfig, gpg};
use grpo_core::advantage::multi_reward::{
    DvaoConfig, GdpoConfig, dvao, dvao_scratch_len, gdpo, gdpo_scratch_len, reward_combination,
};
use grpo_core::advantage::opo::{OpoConfig, opo};
use grpo_core::advantage::passk::{PassKConfig, pass_at_k};
use grpo_core::advantage::rloo::{RlooConfig, rloo};
use grpo_core::advantage::zscore::{Scale, ZScoreConfig, zscore};
use grpo_core::advantage::{Diagnostics, NanPolicy, SingletonRule};
use grpo_core::stats::Bessel;
use grpo_core::{Error, Groups, Preset};
use grpo_tests::{binary_reward, edge_f64};
use proptest::prelude::*;

const PRESETS: [Preset; 5] = [
    Preset::Paper,
    Preset::Verl,
    Preset::VerlVectorized,
    Preset::Trl,
    Preset::OpenRlhf,
];
const SCALES: [Scale; 3] = [Scale::Group, Scale::Batch, Scale::None];

/// CSR offsets of consecutive groups with these sizes.
fn offsets_of(sizes: &[usize]) -> Vec<usize> {
    let mut o = vec![0];
    for s in sizes {
        o.push(o.last().unwrap() + s);
    }
    o
}

/// Interleaves groups (sizes, values in consecutive layout) into a scattered batch that keeps
/// each group's internal order: returns (group ids, batch position of each consecutive sample).
fn scatter(sizes: &[usize], seed: u64) -> (Vec<usize>, Vec<usize>) {
    let mut labels: Vec<usize> = sizes
        .iter()
        .enumerate()
        .flat_map(|(k, &s)| std::iter::repeat_n(k, s))
        .collect();
    let mut x = seed | 1;
    for i in (1..labels.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        labels.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let offs = offsets_of(sizes);
    let mut next = offs.clone();
    let mut pos = vec![0; labels.len()];
    for (p, &k) in labels.iter().enumerate() {
        pos[next[k]] = p;
        next[k] += 1;
    }
    (labels, pos)
}

/// Groups of 1..=max members with values from `v`.
fn grouped<S: Strategy<Value = f64>>(
    v: S,
    min: usize,
    max: usize,
) -> impl Strategy<Value = (Vec<usize>, Vec<f64>)> {
    prop::collection::vec(prop::collection::vec(v, min..=max), 1..=6).prop_map(|gs| {
        let sizes = gs.iter().map(Vec::len).collect();
        (sizes, gs.into_iter().flatten().collect())
    })
}

fn zs(scores: &[f64], g: Groups<'_>, cfg: &ZScoreConfig) -> Vec<f64> {
    let mut out = vec![f64::NAN; scores.len()];
    zscore(scores, g, cfg, &mut out).unwrap();
    out
}

/// Every estimator of this family on one score vector, as (name, advantages).
fn all_estimators(scores: &[f64], g: Groups<'_>) -> Vec<(&'static str, Vec<f64>)> {
    let n = scores.len();
    let mut res = Vec::new();
    for p in PRESETS {
        for scale in SCALES {
            let cfg = ZScoreConfig {
                singleton: SingletonRule::VerlLoop,
                ..ZScoreConfig::from_preset(p)
            }
            .with_scale(scale);
            res.push(("zscore", zs(scores, g, &cfg)));
        }
        let mut o = vec![0.0; n];
        rloo(scores, g, &RlooConfig::from_preset(p).with_verl(), &mut o).unwrap();
        res.push(("rloo", o.clone()));
        gpg(scores, g, &GpgConfig::from_preset(Preset::Verl), &mut o).unwrap();
        res.push(("gpg", o.clone()));
    }
    // Lengths follow the sample (derived from its score), so scattered layouts see the same.
    let lengths: Vec<usize> = scores
        .iter()
        .map(|s| 1 + (s.to_bits() % 5) as usize)
        .collect();
    let mut o = vec![0.0; n];
    opo(
        scores,
        &lengths,
        g,
        &OpoConfig::from_preset(Preset::Verl),
        &mut o,
    )
    .unwrap();
    res.push(("opo", o.clone()));
    if pass_at_k(scores, g, &PassKConfig::default(), &mut o).is_ok() {
        res.push(("passk", o.clone()));
    }
    // Two rewards per sample: the score and its square.
    let rw: Vec<f64> = scores.iter().flat_map(|&s| [s, s * s]).collect();
    let mut scratch = vec![0.0; gdpo_scratch_len(2)];
    gdpo(
        &rw,
        2,
        &[1.0, 0.5],
        g,
        &GdpoConfig::default(),
        &mut scratch,
        &mut o,
    )
    .unwrap();
    res.push(("gdpo", o.clone()));
    dvao(&rw, 2, g, &DvaoConfig::default(), &mut scratch, &mut o).unwrap();
    res.push(("dvao", o.clone()));
    reward_combination(&rw, 2, &[1.0, 0.5], g, &ZScoreConfig::default(), &mut o).unwrap();
    res.push(("combination", o.clone()));
    res
}

trait WithVerl {
    fn with_verl(self) -> Self;
}
impl WithVerl for RlooConfig {
    fn with_verl(self) -> Self {
        RlooConfig {
            singleton: SingletonRule::VerlLoop,
            ..self
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// z-score (all presets, all scales) and RLOO groups have mean 0; so does each GDPO batch.
    #[test]
    fn groups_have_mean_zero((sizes, s) in grouped(-10.0f64..10.0, 2, 17)) {
        let offs = offsets_of(&sizes);
        let g = Groups::Offsets(&offs);
        for p in PRESETS {
            for scale in SCALES {
                let a = zs(&s, g, &ZScoreConfig::from_preset(p).with_scale(scale));
                for w in offs.windows(2) {
                    let sum: f64 = a[w[0]..w[1]].iter().sum();
                    prop_assert!(sum.abs() <= 1e-12 * (w[1] - w[0]) as f64 * 20.0, "{p:?} {scale:?} {sum}");
                }
                // f32: same property, looser tolerance.
                let s32: Vec<f32> = s.iter().map(|&x| x as f32).collect();
                let mut a32 = vec![0.0f32; s.len()];
                zscore(&s32, g, &ZScoreConfig::from_preset(p).with_scale(scale), &mut a32).unwrap();
                for w in offs.windows(2) {
                    let sum: f32 = a32[w[0]..w[1]].iter().sum();
                    prop_assert!(sum.abs() <= 2e-5 * (w[1] - w[0]) as f32 * 20.0, "f32 {p:?} {scale:?} {sum}");
                }
            }
        }
        let mut a = vec![0.0; s.len()];
        rloo(&s, g, &RlooConfig::default(), &mut a).unwrap();
        for w in offs.windows(2) {
            let sum: f64 = a[w[0]..w[1]].iter().sum();
            prop_assert!(sum.abs() <= 1e-11 * (w[1] - w[0]) as f64 * 20.0);
        }
    }

    /// GRPO is invariant under s → s + c and (with ε = 0) under s → k·s, k > 0.
    #[test]
    fn grpo_shift_and_scale_invariant(
        (sizes, s) in grouped((-20i32..20).prop_map(|v| v as f64 / 4.0), 2, 12),
        c in -100.0f64..100.0,
        k in 0.01f64..100.0,
    ) {
        let offs = offsets_of(&sizes);
        let g = Groups::Offsets(&offs);
        for p in PRESETS {
            let cfg = ZScoreConfig::from_preset(p);
            let base = zs(&s, g, &cfg);
            let shifted: Vec<f64> = s.iter().map(|x| x + c).collect();
            for (x, y) in base.iter().zip(zs(&shifted, g, &cfg)) {
                prop_assert!((x - y).abs() <= 1e-9, "{p:?}: shift {x} vs {y}");
            }
            let exact = ZScoreConfig { eps: 0.0, ..cfg };
            let base = zs(&s, g, &exact);
            let scaled: Vec<f64> = s.iter().map(|x| x * k).collect();
            for (x, y) in base.iter().zip(zs(&scaled, g, &exact)) {
                prop_assert!((x - y).abs() <= 1e-12 * 8.0, "{p:?}: scale {x} vs {y}");
            }
        }
    }

    /// Binary rewards: RMS(s − μ) = σ_pop = sqrt(p(1 − p)) [2607.00152]; with the population
    /// std and ε = 0 a success gets sqrt((1 − p)/p).
    #[test]
    fn binary_std_identity((sizes, s) in grouped(binary_reward(), 2, 16)) {
        let offs = offsets_of(&sizes);
        let g = Groups::Offsets(&offs);
        let dr = zs(&s, g, &ZScoreConfig::dr_grpo());
        let pop = zs(&s, g, &ZScoreConfig { eps: 0.0, bessel: Bessel::Population, ..ZScoreConfig::default() });
        for w in offs.windows(2) {
            let n = (w[1] - w[0]) as f64;
            let p = s[w[0]..w[1]].iter().sum::<f64>() / n;
            let rms = (dr[w[0]..w[1]].iter().map(|a| a * a).sum::<f64>() / n).sqrt();
            prop_assert!((rms - (p * (1.0 - p)).sqrt()).abs() <= 1e-14);
            for i in w[0]..w[1] {
                let want = if p == 0.0 || p == 1.0 { 0.0 }
                    else if s[i] == 1.0 { ((1.0 - p) / p).sqrt() }
                    else { -(p / (1.0 - p)).sqrt() };
                prop_assert!((pop[i] - want).abs() <= 1e-14 * 8.0, "{} vs {want}", pop[i]);
            }
        }
    }

    /// G = 2 (2-GRPO [2510.00977]): advantages are exactly ±c, or both 0 on a tie — every preset,
    /// scale and dial, f64 and f32; RLOO and GPG pairs are exactly antisymmetric too.
    #[test]
    fn two_grpo_is_plus_minus_c(pairs in prop::collection::vec((-10.0f64..10.0, -10.0f64..10.0, any::<bool>()), 1..20), gamma in 0.0f64..=1.0) {
        let s: Vec<f64> = pairs.iter().flat_map(|&(a, b, tie)| [a, if tie { a } else { b }]).collect();
        let s32: Vec<f32> = s.iter().map(|&x| x as f32).collect();
        let g = Groups::Uniform(2);
        let check = |a: &[f64], s: &[f64]| -> Result<(), TestCaseError> {
            for (x, v) in a.chunks(2).zip(s.chunks(2)) {
                prop_assert_eq!(x[0], -x[1]);
                if v[0] == v[1] { prop_assert_eq!((x[0], x[1]), (0.0, 0.0)); }
                else { prop_assert!(x[0] != 0.0 && (x[0] > 0.0) == (v[0] > v[1])); }
            }
            Ok(())
        };
        for p in PRESETS {
            for scale in SCALES {
                let cfg = ZScoreConfig::from_preset(p).with_scale(scale).with_gamma(gamma);
                check(&zs(&s, g, &cfg), &s)?;
                let mut a32 = vec![0.0f32; s.len()];
                zscore(&s32, g, &cfg, &mut a32).unwrap();
                let a32: Vec<f64> = a32.iter().map(|&x| x as f64).collect();
                let s32w: Vec<f64> = s32.iter().map(|&x| x as f64).collect();
                check(&a32, &s32w)?;
            }
        }
        // With σ_unb = |gap|/√2 and ε = 0 the magnitude is 1/√2 up to the rounding of the mean
        // and σ: an ulp of the scores' magnitude relative to the gap (cancellation), a few times.
        let a = zs(&s, g, &ZScoreConfig { eps: 0.0, ..ZScoreConfig::two_grpo() });
        for (x, v) in a.chunks(2).zip(s.chunks(2)) {
            if x[0] == 0.0 { continue; }
            let gap = (v[0] - v[1]).abs();
            let tol = 8.0 * f64::EPSILON * (1.0 + v[0].abs().max(v[1].abs()) / gap);
            prop_assert!((x[0].abs() - std::f64::consts::FRAC_1_SQRT_2).abs() <= tol, "{x:?} {v:?}");
        }
        let mut o = vec![0.0; s.len()];
        rloo(&s, g, &RlooConfig::default(), &mut o).unwrap();
        check(&o, &s)?;
        gpg(&s, g, &GpgConfig::default(), &mut o).unwrap();
        for x in o.chunks(2) { prop_assert_eq!(x[0], -x[1]); }
    }

    /// Identical rewards give exactly 0 for every estimator, any value (f64 and f32).
    #[test]
    fn identical_rewards_exact_zero(v in edge_f64().prop_filter("moderate", |v| v.abs() < 1e20), g in 2usize..20, groups in 1usize..4) {
        let s = vec![v; g * groups];
        for (name, a) in all_estimators(&s, Groups::Uniform(g)) {
            prop_assert!(a.iter().all(|&x| x == 0.0), "{name}: {a:?}");
        }
        let s32 = vec![v as f32; g * groups];
        for p in PRESETS {
            for scale in SCALES {
                let mut a = vec![1.0f32; s32.len()];
                zscore(&s32, Groups::Uniform(g), &ZScoreConfig::from_preset(p).with_scale(scale), &mut a).unwrap();
                prop_assert!(a.iter().all(|&x| x == 0.0));
            }
        }
    }

    /// Uniform, Offsets and scattered (from_group_ids) layouts give bit-identical advantages.
    #[test]
    fn layouts_agree_bit_for_bit(g in 1usize..6, groups in 1usize..6, vals in prop::collection::vec(-5.0f64..5.0, 36), seed in any::<u64>()) {
        let n = g * groups;
        let s = &vals[..n];
        let sizes = vec![g; groups];
        let offs = offsets_of(&sizes);
        let (ids, pos) = scatter(&sizes, seed);
        let mut scattered = vec![0.0; n];
        for (j, &p) in pos.iter().enumerate() { scattered[p] = s[j]; }
        let mut scratch = vec![0usize; Groups::group_ids_scratch_len(n, groups)];
        let perm = Groups::from_group_ids(&ids, groups, &mut scratch).unwrap();
        let u = all_estimators(s, Groups::Uniform(g));
        let o = all_estimators(s, Groups::Offsets(&offs));
        let p = all_estimators(&scattered, perm);
        prop_assert_eq!(u.len(), o.len());
        prop_assert_eq!(u.len(), p.len());
        for ((a, b), c) in u.iter().zip(&o).zip(&p) {
            prop_assert_eq!(&a.1, &b.1, "{}", a.0);
            for (j, &q) in pos.iter().enumerate() {
                prop_assert_eq!(a.1[j].to_bits(), c.1[q].to_bits(), "{} sample {}", a.0, j);
            }
        }
    }

    /// References written from the formulas (naive, O(n²)) for RLOO, pass@k, OPO and GPG.
    #[test]
    fn naive_references((sizes, s) in grouped(-10.0f64..10.0, 2, 9), lens in prop::collection::vec(0usize..50, 60), f_norm in 0.1f64..10.0) {
        let offs = offsets_of(&sizes);
        let g = Groups::Offsets(&offs);
        let n = s.len();
        let lens = &lens[..n];
        let (mut r, mut pk, mut op, mut gp) = (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        rloo(&s, g, &RlooConfig::default(), &mut r).unwrap();
        pass_at_k(&s, g, &PassKConfig { normalize: false, ..PassKConfig::default() }, &mut pk).unwrap();
        opo(&s, lens, g, &OpoConfig::default(), &mut op).unwrap();
        gpg(&s, g, &GpgConfig { f_norm, ..GpgConfig::default() }, &mut gp).unwrap();
        let nonzero = s.iter().filter(|&&x| x != 0.0).count().max(1);
        let alpha = n as f64 / nonzero as f64;
        for w in offs.windows(2) {
            let grp = &s[w[0]..w[1]];
            let m = grp.len() as f64;
            let mean = grp.iter().sum::<f64>() / m;
            let wsum: usize = lens[w[0]..w[1]].iter().sum();
            let base = if wsum == 0 { f64::NAN } else {
                grp.iter().zip(&lens[w[0]..w[1]]).map(|(x, &l)| x * l as f64).sum::<f64>() / wsum as f64
            };
            let top = grp.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let arg = grp.iter().position(|&x| x == top).unwrap();
            let second = grp.iter().enumerate().filter(|(j, _)| *j != arg).map(|(_, &x)| x).fold(f64::NEG_INFINITY, f64::max);
            for (j, &x) in grp.iter().enumerate() {
                let i = w[0] + j;
                let loo = (grp.iter().sum::<f64>() - x) / (m - 1.0);
                prop_assert!((r[i] - (x - loo)).abs() <= 1e-12 * 20.0, "rloo");
                let want = if j == arg { top - second } else { 0.0 };
                prop_assert!((pk[i] - want).abs() <= 1e-12 * 20.0, "passk");
                let want = if wsum == 0 { 0.0 } else { x - base };
                prop_assert!((op[i] - want).abs() <= 1e-12 * 20.0, "opo {} vs {}", op[i], want);
                prop_assert!((gp[i] - alpha * (x - mean) / f_norm).abs() <= 1e-11 * alpha * 20.0 / f_norm, "gpg");
            }
        }
    }

    /// DVAO: the group mean of A² is at most K.
    #[test]
    fn dvao_is_bounded(g in 2usize..10, groups in 1usize..5, k in 1usize..5, vals in prop::collection::vec(prop_oneof![binary_reward(), -10.0f64..10.0], 200), eps in prop_oneof![Just(0.0), 0.0f64..1.0]) {
        let n = g * groups;
        let rw = &vals[..n * k];
        for bessel in [Bessel::Population, Bessel::Unbiased] {
            let cfg = DvaoConfig { eps, bessel, ..DvaoConfig::default() };
            let mut scratch = vec![0.0; dvao_scratch_len(k)];
            let mut a = vec![0.0; n];
            dvao(rw, k, Groups::Uniform(g), &cfg, &mut scratch, &mut a).unwrap();
            for grp in a.chunks(g) {
                let ms = grp.iter().map(|x| x * x).sum::<f64>() / g as f64;
                prop_assert!(ms <= k as f64 * (1.0 + 1e-12), "{ms} > {k}");
            }
        }
    }

    /// GDPO: the final batch normalisation gives mean 0 over the batch; with K = 1 and a single
    /// group it is the z-score of the z-score.
    #[test]
    fn gdpo_batch_mean_zero(g in 2usize..8, groups in 1usize..5, k in 1usize..4, vals in prop::collection::vec(-3.0f64..3.0, 100), w in prop::collection::vec(0.1f64..2.0, 3)) {
        let n = g * groups;
        let mut a = vec![0.0; n];
        let mut scratch = vec![0.0; gdpo_scratch_len(k)];
        gdpo(&vals[..n * k], k, &w[..k], Groups::Uniform(g), &GdpoConfig::default(), &mut scratch, &mut a).unwrap();
        prop_assert!(a.iter().sum::<f64>().abs() <= 1e-10 * n as f64);
    }

    /// Any finite input: Ok ⇒ every advantage finite (edge values: ±1e30, subnormals, ±0).
    #[test]
    fn ok_means_finite((sizes, s) in grouped(edge_f64(), 1, 9)) {
        let offs = offsets_of(&sizes);
        let g = Groups::Offsets(&offs);
        let n = s.len();
        let mut o = vec![0.0; n];
        for p in PRESETS {
            for scale in SCALES {
                if zscore(&s, g, &ZScoreConfig::from_preset(p).with_scale(scale), &mut o).is_ok() {
                    prop_assert!(o.iter().all(|x| x.is_finite()));
                }
            }
        }
        if rloo(&s, g, &RlooConfig::default(), &mut o).is_ok() { prop_assert!(o.iter().all(|x| x.is_finite())); }
        if gpg(&s, g, &GpgConfig::default(), &mut o).is_ok() { prop_assert!(o.iter().all(|x| x.is_finite())); }
        if pass_at_k(&s, g, &PassKConfig::default(), &mut o).is_ok() { prop_assert!(o.iter().all(|x| x.is_finite())); }
        let lens = vec![3usize; n];
        if opo(&s, &lens, g, &OpoConfig::default(), &mut o).is_ok() { prop_assert!(o.iter().all(|x| x.is_finite())); }
        let mut scratch = vec![0.0; 2];
        if gdpo(&s, 1, &[1.0], g, &GdpoConfig::default(), &mut scratch, &mut o).is_ok() { prop_assert!(o.iter().all(|x| x.is_finite())); }
        if dvao(&s, 1, g, &DvaoConfig::default(), &mut scratch, &mut o).is_ok() { prop_assert!(o.iter().all(|x| x.is_finite())); }
    }
}

/// Calls `f` on a sentinel-filled output and checks it fails with `want` and writes nothing.
fn refuses(n: usize, want: Error, f: impl FnOnce(&mut [f64]) -> Result<Diagnostics<f64>, Error>) {
    let mut out = vec![-12345.0; n];
    assert_eq!(f(&mut out), Err(want));
    assert!(
        out.iter().all(|&x| x == -12345.0),
        "output written on {want:?}"
    );
}

type Runner = fn(&[f64], Groups<'_>, &mut [f64]) -> Result<Diagnostics<f64>, Error>;

/// Every single-score estimator behind one signature (default configs).
fn runners() -> Vec<(&'static str, Runner)> {
    vec![
        ("zscore", |s, g, o| {
            zscore(s, g, &ZScoreConfig::default(), o)
        }),
        ("rloo", |s, g, o| rloo(s, g, &RlooConfig::default(), o)),
        ("passk", |s, g, o| {
            pass_at_k(s, g, &PassKConfig::default(), o)
        }),
        ("opo", |s, g, o| {
            opo(s, &vec![2; s.len()], g, &OpoConfig::default(), o)
        }),
        ("gpg", |s, g, o| gpg(s, g, &GpgConfig::default(), o)),
        ("gdpo", |s, g, o| {
            gdpo(s, 1, &[1.0], g, &GdpoConfig::default(), &mut [0.0; 2], o)
        }),
        ("dvao", |s, g, o| {
            dvao(s, 1, g, &DvaoConfig::default(), &mut [0.0; 1], o)
        }),
        ("combination", |s, g, o| {
            reward_combination(s, 1, &[1.0], g, &ZScoreConfig::default(), o)
        }),
    ]
}

#[test]
fn bad_layouts_and_values_are_refused_untouched() {
    let s = [1.0, 0.0, 0.5, 2.0];
    for (name, run) in runners() {
        eprintln!("{name}");
        refuses(4, Error::EmptyGroup { group: 1 }, |o| {
            run(&s, Groups::Offsets(&[0, 2, 2, 4]), o)
        });
        refuses(4, Error::InvalidOffsets { index: 2 }, |o| {
            run(&s, Groups::Offsets(&[0, 3, 2, 4]), o)
        });
        refuses(4, Error::InvalidOffsets { index: 2 }, |o| {
            run(&s, Groups::Offsets(&[0, 2, 5]), o)
        });
        refuses(
            4,
            Error::InvalidParam {
                name: "group_size",
                reason: "the sample count must be a multiple of the group size",
            },
            |o| run(&s, Groups::Uniform(3), o),
        );
        // Ids: out of range (the layout fails before any estimator runs) and a layout built for
        // another batch size.
        refuses(
            4,
            Error::GroupIdOutOfRange {
                index: 2,
                id: 2,
                groups: 2,
            },
            |o| {
                let mut scratch = [0usize; 7];
                let g = Groups::from_group_ids(&[0, 1, 2, 0], 2, &mut scratch)?;
                run(&s, g, o)
            },
        );
        refuses(
            4,
            Error::LengthMismatch {
                what: "group ids",
                expected: 3,
                found: 4,
            },
            |o| {
                let mut scratch = [0usize; 6];
                let g = Groups::from_group_ids(&[0, 1, 0], 2, &mut scratch)?;
                run(&s, g, o)
            },
        );
        let what = if matches!(name, "gdpo" | "dvao" | "combination") {
            "rewards"
        } else {
            "scores"
        };
        refuses(4, Error::NonFinite { what, index: 1 }, |o| {
            run(&[1.0, f64::NAN, 0.5, 2.0], Groups::Uniform(2), o)
        });
        for bad in [f64::INFINITY, f64::NEG_INFINITY] {
            refuses(4, Error::NonFinite { what, index: 3 }, |o| {
                run(&[1.0, 0.0, 0.5, bad], Groups::Uniform(2), o)
            });
        }
    }
}

#[test]
fn length_mismatches_name_the_argument() {
    let s = [1.0, 0.0, 0.5, 2.0];
    let g = Groups::Uniform(2);
    for (name, run) in runners() {
        let mut out = vec![7.0; 3];
        let e = run(&s, g, &mut out).unwrap_err();
        assert!(matches!(e, Error::LengthMismatch { .. }), "{name}: {e:?}");
        assert_eq!(out, [7.0; 3]);
    }
    refuses(
        4,
        Error::LengthMismatch {
            what: "lengths",
            expected: 4,
            found: 3,
        },
        |o| opo(&s, &[1, 2, 3], g, &OpoConfig::default(), o),
    );
    refuses(
        2,
        Error::LengthMismatch {
            what: "weights",
            expected: 2,
            found: 1,
        },
        |o| gdpo(&s, 2, &[1.0], g, &GdpoConfig::default(), &mut [0.0; 4], o),
    );
    refuses(
        2,
        Error::LengthMismatch {
            what: "rewards",
            expected: 6,
            found: 4,
        },
        |o| {
            dvao(
                &s,
                3,
                Groups::Uniform(1),
                &DvaoConfig::default(),
                &mut [0.0; 3],
                o,
            )
        },
    );
    refuses(
        2,
        Error::ScratchTooSmall {
            needed: 2,
            found: 1,
        },
        |o| {
            dvao(
                &s,
                2,
                Groups::Uniform(2),
                &DvaoConfig::default(),
                &mut [0.0; 1],
                o,
            )
        },
    );
}

#[test]
fn bad_parameters_are_refused_untouched() {
    let s = [1.0, 0.0, 0.5, 2.0];
    let g = Groups::Uniform(2);
    let eps = |name| Error::InvalidParam {
        name,
        reason: "must be finite and >= 0",
    };
    for e in [-1e-6, f64::NAN, f64::INFINITY] {
        refuses(4, eps("eps"), |o| {
            zscore(
                &s,
                g,
                &ZScoreConfig {
                    eps: e,
                    ..ZScoreConfig::default()
                },
                o,
            )
        });
        refuses(4, eps("eps"), |o| {
            pass_at_k(
                &s,
                g,
                &PassKConfig {
                    eps: e,
                    ..PassKConfig::default()
                },
                o,
            )
        });
        refuses(4, eps("reward_eps"), |o| {
            gdpo(
                &s,
                1,
                &[1.0],
                g,
                &GdpoConfig {
                    reward_eps: e,
                    ..GdpoConfig::default()
                },
                &mut [0.0; 2],
                o,
            )
        });
        refuses(4, eps("batch_eps"), |o| {
            gdpo(
                &s,
                1,
                &[1.0],
                g,
                &GdpoConfig {
                    batch_eps: e,
                    ..GdpoConfig::default()
                },
                &mut [0.0; 2],
                o,
            )
        });
        refuses(4, eps("eps"), |o| {
            dvao(
                &s,
                1,
                g,
                &DvaoConfig {
                    eps: e,
                    ..DvaoConfig::default()
                },
                &mut [0.0; 1],
                o,
            )
        });
        refuses(4, eps("eps"), |o| {
            reward_combination(
                &s,
                1,
                &[1.0],
                g,
                &ZScoreConfig {
                    eps: e,
                    ..ZScoreConfig::default()
                },
                o,
            )
        });
        refuses(4, eps("var_floor"), |o| {
            zscore(
                &s,
                g,
                &ZScoreConfig {
                    var_floor: Some(e),
                    ..ZScoreConfig::default()
                },
                o,
            )
        });
    }
    refuses(
        4,
        Error::InvalidParam {
            name: "gamma",
            reason: "must be in [0, 1]",
        },
        |o| zscore(&s, g, &ZScoreConfig::default().with_gamma(1.01), o),
    );
    refuses(
        4,
        Error::InvalidParam {
            name: "f_norm",
            reason: "must be finite and > 0",
        },
        |o| {
            gpg(
                &s,
                g,
                &GpgConfig {
                    f_norm: 0.0,
                    ..GpgConfig::default()
                },
                o,
            )
        },
    );
    refuses(
        4,
        Error::NonFinite {
            what: "weights",
            index: 0,
        },
        |o| reward_combination(&s, 1, &[f64::INFINITY], g, &ZScoreConfig::default(), o),
    );
    // Singletons: Reject presets refuse, pass@k always needs two.
    let offs = Groups::Offsets(&[0, 3, 4]);
    let tiny = Error::GroupTooSmall {
        group: 1,
        needed: 2,
        found: 1,
    };
    refuses(4, tiny, |o| {
        zscore(&s, offs, &ZScoreConfig::from_preset(Preset::OpenRlhf), o)
    });
    refuses(4, tiny, |o| {
        rloo(&s, offs, &RlooConfig::from_preset(Preset::OpenRlhf), o)
    });
    refuses(4, tiny, |o| pass_at_k(&s, offs, &PassKConfig::default(), o));
    let reject = SingletonRule::Reject;
    refuses(4, tiny, |o| {
        opo(
            &s,
            &[1; 4],
            offs,
            &OpoConfig {
                singleton: reject,
                ..OpoConfig::default()
            },
            o,
        )
    });
    refuses(4, tiny, |o| {
        gpg(
            &s,
            offs,
            &GpgConfig {
                singleton: reject,
                ..GpgConfig::default()
            },
            o,
        )
    });
    refuses(4, tiny, |o| {
        gdpo(
            &s,
            1,
            &[1.0],
            offs,
            &GdpoConfig {
                singleton: reject,
                ..GdpoConfig::default()
            },
            &mut [0.0; 2],
            o,
        )
    });
    refuses(4, tiny, |o| {
        dvao(
            &s,
            1,
            offs,
            &DvaoConfig {
                singleton: reject,
                ..DvaoConfig::default()
            },
            &mut [0.0; 1],
            o,
        )
    });
    // NaN: an error by default, tolerated under the TRL policy.
    let nan = [1.0, f64::NAN, 0.5, 2.0];
    let mut o = [0.0; 4];
    let d = zscore(
        &nan,
        g,
        &ZScoreConfig {
            nan: NanPolicy::Exclude,
            ..ZScoreConfig::default()
        },
        &mut o,
    )
    .unwrap();
    assert_eq!(
        (o[0], o[1], d.nan_excluded, d.singleton_groups),
        (0.0, 0.0, 1, 1)
    );
}

#[test]
fn preset_differences_hand_computed() {
    // One group (0.1 × 16): exactly 0 under every preset, f32 and f64.
    for p in PRESETS {
        let mut a = [1.0f32; 16];
        zscore(
            &[0.1f32; 16],
            Groups::Uniform(16),
            &ZScoreConfig::from_preset(p),
            &mut a,
        )
        .unwrap();
        assert_eq!(a, [0.0; 16]);
        let mut b = [1.0f64; 8];
        zscore(
            &[1e4 + 0.3; 8],
            Groups::Uniform(8),
            &ZScoreConfig::from_preset(p),
            &mut b,
        )
        .unwrap();
        assert_eq!(b, [0.0; 8]);
    }
    // Group (2, 0, 1): μ = 1, deviations (1, −1, 0), Σd² = 2, var_unb = 1, σ = 1.
    //   Paper/Verl/VerlVectorized: ±1/(1 + 1e-6); TRL: ±1/(1 + 1e-4); OpenRLHF: ±1/(1 + 1e-9).
    // Singleton (5): verl, loop and vectorized, 5/(1 + 1e-6); the others 0 (OpenRLHF refuses;
    // see below).
    let s = [2.0, 0.0, 1.0, 5.0];
    let g = Groups::Offsets(&[0, 3, 4]);
    for (p, eps, single) in [
        (Preset::Paper, 1e-6, 0.0),
        (Preset::Verl, 1e-6, 5.0 / (1.0 + 1e-6)),
        (Preset::VerlVectorized, 1e-6, 5.0 / (1.0 + 1e-6)),
        (Preset::Trl, 1e-4, 0.0),
    ] {
        let a = zs(&s, g, &ZScoreConfig::from_preset(p));
        assert_eq!(
            a,
            [1.0 / (1.0 + eps), -1.0 / (1.0 + eps), 0.0, single],
            "{p:?}"
        );
    }
    let cfg = ZScoreConfig {
        singleton: SingletonRule::Zero,
        ..ZScoreConfig::from_preset(Preset::OpenRlhf)
    };
    assert_eq!(
        zs(&s, g, &cfg),
        [1.0 / (1.0 + 1e-9), -1.0 / (1.0 + 1e-9), 0.0, 0.0]
    );
    // verl vectorized floor: (0.001, 0, 0.002): μ = 0.001, Σd² = 2e-6, var_unb = 1e-6 → exactly
    // the floor; (0.0005, 0): var_unb = 1.25e-7 < 1e-6 → σ = 1e-3, A = ±2.5e-4/(1e-3 + 1e-6).
    let a = zs(
        &[0.0005, 0.0],
        Groups::Uniform(2),
        &ZScoreConfig::from_preset(Preset::VerlVectorized),
    );
    assert!((a[0] - 2.5e-4 / (1e-3 + 1e-6)).abs() < 1e-15);
    // TRL batch scaling: groups (4, 0) and (1, 1): batch mean 1.5, Σd² = 6.25 + 2.25 + 0.25·2 = 9,
    // var_unb = 3, σ = √3; group 0: ±2/(√3 + 1e-4); group 1: 0.
    let a = zs(
        &[4.0, 0.0, 1.0, 1.0],
        Groups::Uniform(2),
        &ZScoreConfig::from_preset(Preset::Trl).with_scale(Scale::Batch),
    );
    assert!((a[0] - 2.0 / (3f64.sqrt() + 1e-4)).abs() < 1e-15 && a[1] == -a[0]);
    assert_eq!(&a[2..], &[0.0, 0.0]);
    // TRL NaN → 0: (NaN, 3, 1): scorable (3, 1): μ = 2, σ_unb = √2 → ±1/(√2 + 1e-4).
    let a = zs(
        &[f64::NAN, 3.0, 1.0],
        Groups::Uniform(3),
        &ZScoreConfig::from_preset(Preset::Trl),
    );
    assert_eq!(a[0], 0.0);
    assert!((a[1] - 1.0 / (2f64.sqrt() + 1e-4)).abs() < 1e-15 && a[2] == -a[1]);
    // RLOO singletons: verl loop A = s = 5, vectorized 0.
    let mut o = [0.0; 4];
    rloo(&s, g, &RlooConfig::from_preset(Preset::Verl), &mut o).unwrap();
    // Group (2, 0, 1): 2 − 0.5 = 1.5, 0 − 1.5 = −1.5, 1 − 1 = 0.
    assert_eq!(o, [1.5, -1.5, 0.0, 5.0]);
    rloo(
        &s,
        g,
        &RlooConfig::from_preset(Preset::VerlVectorized),
        &mut o,
    )
    .unwrap();
    assert_eq!(o, [1.5, -1.5, 0.0, 0.0]);
    // pass@k on (2, 0, 1 | 5, 4): group 0 argmax 0, gap 1, σ_unb = 1 → 1/(1 + 1e-6);
    // group 1: gap 1, σ_unb = 1/√2 → 1/(1/√2 + 1e-6).
    let mut o = [0.0; 5];
    pass_at_k(
        &[2.0, 0.0, 1.0, 5.0, 4.0],
        Groups::Offsets(&[0, 3, 5]),
        &PassKConfig::default(),
        &mut o,
    )
    .unwrap();
    assert_eq!(&o[..3], &[1.0 / (1.0 + 1e-6), 0.0, 0.0]);
    assert!((o[3] - 1.0 / (0.5f64.sqrt() + 1e-6)).abs() < 1e-15 && o[4] == 0.0);
    // OPO (2, 0, 1) lengths (2, 1, 1): b = (4 + 0 + 1)/4 = 1.25 → (0.75, −1.25, −0.25);
    // singleton (5): verl baseline 0 → 5.
    let mut o = [0.0; 4];
    opo(
        &s,
        &[2, 1, 1, 9],
        g,
        &OpoConfig::from_preset(Preset::Verl),
        &mut o,
    )
    .unwrap();
    assert_eq!(o, [0.75, -1.25, -0.25, 5.0]);
    // GPG: B = 4, nonzero = 3 → α = 4/3; group (2, 0, 1): μ = 1 → (4/3, −4/3, 0); singleton
    // under verl: μ = 0 → 4/3·5 = 20/3.
    gpg(&s, g, &GpgConfig::from_preset(Preset::Verl), &mut o).unwrap();
    let want = [4.0 / 3.0, -4.0 / 3.0, 0.0, 20.0 / 3.0];
    for (x, w) in o.iter().zip(want) {
        assert!((x - w).abs() < 1e-14, "{x} vs {w}");
    }
}

#[test]
fn gdpo_keeps_apart_what_reward_combination_merges() {
    // Two groups of 2. Group A: (1, 1) and (0, 0); group B: (1, 0) and (0, 0).
    // Sum then normalise: sums (2, 0) and (1, 0) → both groups ±0.5·gap/(σ + ε) with
    // σ_unb = gap/√2: ±(1/√2)·(gap/(gap + √2·1e-6))… nearly identical ±0.7071.
    // GDPO: group A: z0 = z1 = ±0.5/(√0.5 + 1e-4) = ±z → S = ±2z; group B: S = ±z
    // (reward 1 flat). Batch S = (2z, −2z, z, −z): μ = 0, Σd² = 10z², σ_unb = z·√(10/3)
    // → A = (2, −2, 1, −1)·z/(z√(10/3) + 1e-4).
    let rw = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0];
    let mut sum = [0.0; 4];
    reward_combination(
        &rw,
        2,
        &[1.0, 1.0],
        Groups::Uniform(2),
        &ZScoreConfig {
            eps: 0.0,
            ..ZScoreConfig::default()
        },
        &mut sum,
    )
    .unwrap();
    assert_eq!(sum[0], sum[2]);
    let mut a = [0.0; 4];
    gdpo(
        &rw,
        2,
        &[1.0, 1.0],
        Groups::Uniform(2),
        &GdpoConfig::default(),
        &mut [0.0; 4],
        &mut a,
    )
    .unwrap();
    let z = 0.5 / (0.5f64.sqrt() + 1e-4);
    let den = z * (10.0f64 / 3.0).sqrt() + 1e-4;
    for (x, w) in a
        .iter()
        .zip([2.0 * z / den, -2.0 * z / den, z / den, -z / den])
    {
        assert!((x - w).abs() < 1e-12, "{x} vs {w}");
    }
    assert!(a[0] > a[2]);
    // In one group: (1, 0), (0, 1), (0, 1), (0, 0) — the sum ties samples 0..3, GDPO does not
    // (hand values in the unit test of multi_reward).
    let rw = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0];
    let mut sum = [0.0; 4];
    reward_combination(
        &rw,
        2,
        &[1.0, 1.0],
        Groups::Uniform(4),
        &ZScoreConfig::default(),
        &mut sum,
    )
    .unwrap();
    assert_eq!(sum[0], sum[1]);
    gdpo(
        &rw,
        2,
        &[1.0, 1.0],
        Groups::Uniform(4),
        &GdpoConfig::default(),
        &mut [0.0; 4],
        &mut a,
    )
    .unwrap();
    assert!(a[0] != a[1] && a[1] == a[2]);
}

/// Two-pass reference of the z-score, written from the formula (no Welford, no pair path).
fn zscore_reference(s: &[f64], offs: &[usize], cfg: &ZScoreConfig) -> Vec<f64> {
    let var = |xs: &[f64]| -> Option<f64> {
        let n = xs.len() as f64;
        let d = match cfg.bessel {
            Bessel::Unbiased => n - 1.0,
            Bessel::Population => n,
        };
        if d <= 0.0 {
            return None;
        }
        let m = xs.iter().sum::<f64>() / n;
        Some(xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / d)
    };
    let sigma = |v: f64| match cfg.var_floor {
        Some(f) => v.max(f).sqrt(),
        None => v.sqrt(),
    };
    let batch_sigma = var(s).map_or(0.0, sigma);
    let mut out = vec![0.0; s.len()];
    for w in offs.windows(2) {
        let grp = &s[w[0]..w[1]];
        let n = grp.len();
        if n == 1 {
            out[w[0]] = match (cfg.singleton, cfg.scale) {
                (SingletonRule::VerlLoop, Scale::None) => grp[0],
                (SingletonRule::VerlLoop, _) => grp[0] / (1.0 + cfg.eps).powf(cfg.gamma),
                _ => 0.0,
            };
            continue;
        }
        let mean = grp.iter().sum::<f64>() / n as f64;
        let den = match cfg.scale {
            Scale::Group => (sigma(var(grp).unwrap()) + cfg.eps).powf(cfg.gamma),
            Scale::Batch => (batch_sigma + cfg.eps).powf(cfg.gamma),
            Scale::None => 1.0,
        };
        for (j, &x) in grp.iter().enumerate() {
            out[w[0] + j] = if den == 0.0 { 0.0 } else { (x - mean) / den };
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every z-score option against the two-pass reference.
    #[test]
    fn zscore_matches_reference(
        (sizes, s) in grouped((-40i32..40).prop_map(|v| v as f64 / 8.0), 1, 10),
        preset in 0usize..5, scale in 0usize..3, gamma in prop_oneof![Just(0.0), Just(1.0), 0.0f64..1.0],
        pop in any::<bool>(), floor in prop_oneof![Just(None), Just(Some(1e-6)), (0.0f64..2.0).prop_map(Some)],
        eps in prop_oneof![Just(0.0), Just(1e-6), 0.0f64..0.5],
    ) {
        let offs = offsets_of(&sizes);
        let cfg = ZScoreConfig {
            eps,
            gamma,
            var_floor: floor,
            bessel: if pop { Bessel::Population } else { Bessel::Unbiased },
            singleton: if preset == 1 { SingletonRule::VerlLoop } else { SingletonRule::Zero },
            ..ZScoreConfig::from_preset(PRESETS[preset])
        }
        .with_scale(SCALES[scale]);
        let got = zs(&s, Groups::Offsets(&offs), &cfg);
        let want = zscore_reference(&s, &offs, &cfg);
        for (g, w) in got.iter().zip(&want) {
            prop_assert!((g - w).abs() <= 1e-9 * (1.0 + w.abs()), "{cfg:?}: {g} vs {w}");
        }
    }

    /// Diagnostics count groups, zero-variance groups and singletons, and summarise the output.
    #[test]
    fn diagnostics_are_consistent((sizes, s) in grouped((0i32..3).prop_map(f64::from), 1, 6)) {
        let offs = offsets_of(&sizes);
        let mut a = vec![0.0; s.len()];
        let d = zscore(&s, Groups::Offsets(&offs), &ZScoreConfig::default(), &mut a).unwrap();
        let flat = offs.windows(2).filter(|w| w[1] - w[0] >= 2 && s[w[0]..w[1]].iter().all(|&x| x == s[w[0]])).count();
        let single = sizes.iter().filter(|&&n| n == 1).count();
        prop_assert_eq!((d.groups, d.zero_variance_groups, d.singleton_groups, d.nan_excluded), (sizes.len(), flat, single, 0));
        prop_assert_eq!(d.max, a.iter().cloned().fold(f64::NEG_INFINITY, f64::max));
        prop_assert_eq!(d.min, a.iter().cloned().fold(f64::INFINITY, f64::min));
        prop_assert!((d.mean - a.iter().sum::<f64>() / a.len() as f64).abs() < 1e-12);
    }

    /// f32: scattered and consecutive layouts agree bit for bit as well.
    #[test]
    fn layouts_agree_f32(g in 1usize..6, groups in 1usize..6, vals in prop::collection::vec(-5.0f32..5.0, 36), seed in any::<u64>()) {
        let n = g * groups;
        let s = &vals[..n];
        let (ids, pos) = scatter(&vec![g; groups], seed);
        let mut scattered = vec![0.0f32; n];
        for (j, &p) in pos.iter().enumerate() { scattered[p] = s[j]; }
        let mut scratch = vec![0usize; Groups::group_ids_scratch_len(n, groups)];
        let perm = Groups::from_group_ids(&ids, groups, &mut scratch).unwrap();
        for p in PRESETS {
            for scale in SCALES {
                let cfg = ZScoreConfig { singleton: SingletonRule::Zero, ..ZScoreConfig::from_preset(p) }.with_scale(scale);
                let (mut a, mut b) = (vec![0.0f32; n], vec![0.0f32; n]);
                zscore(s, Groups::Uniform(g), &cfg, &mut a).unwrap();
                zscore(&scattered, perm, &cfg, &mut b).unwrap();
                for (j, &q) in pos.iter().enumerate() {
                    prop_assert_eq!(a[j].to_bits(), b[q].to_bits());
                }
            }
        }
    }
}
