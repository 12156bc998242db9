//! Property tests of grpo-core's divergences (MATH.md §3): exact gradients against central
//! finite differences in f64, KL3 clip bounds, Lambert W, KL-penalty presets, IS corrections,
//! the top-entropy mask, and the "Err ⇒ outputs untouched" contract.

use grpo_core::Preset;
use grpo_core::divergence::kl_penalty::kl_penalty;
use grpo_core::divergence::lambert_w::{lambert_w0, lambert_wm1};
use grpo_core::divergence::measures::{MeasureConfig, measure_tokens};
use grpo_core::divergence::{
    DeltaCap, DualClip, ElasticTrustRegion, KlEstimator, KlPenaltyConfig, Measure, RatioBounds,
};
use grpo_core::is_correction::{IsConfig, IsLevel, is_weights};
use grpo_core::selection::top_entropy_mask;
use grpo_core::{Error, Groups, Tokens};
use proptest::prelude::*;

const MEASURES: [Measure; 6] = [
    Measure::Ratio,
    Measure::K1,
    Measure::Abs,
    Measure::K2,
    Measure::K3,
    Measure::ChiSquared,
];

const ESTIMATORS: [KlEstimator; 7] = [
    KlEstimator::K1,
    KlEstimator::Abs,
    KlEstimator::K2,
    KlEstimator::K3,
    KlEstimator::K3Is,
    KlEstimator::K1StraightThrough,
    KlEstimator::K3StraightThrough,
];

const PRESETS: [Preset; 5] = [
    Preset::Paper,
    Preset::Verl,
    Preset::VerlVectorized,
    Preset::Trl,
    Preset::OpenRlhf,
];

/// Central difference (f(x+h) − f(x−h)) / 2h.
fn central(f: impl Fn(f64) -> f64, x: f64) -> f64 {
    let h = 1e-6 * x.abs().max(1.0);
    (f(x + h) - f(x - h)) / (2.0 * h)
}

fn grad_close(analytic: f64, numeric: f64) -> bool {
    (analytic - numeric).abs() <= 1e-6 * analytic.abs().max(1.0)
}

/// KL3(ρ) = ρ − 1 − ln ρ by its alternating Taylor series in h = ρ − 1 (independent of the
/// library's atanh-based evaluation), exact to f64 rounding for |h| < 0.6.
fn kl3_reference(rho: f64) -> f64 {
    let h = rho - 1.0;
    if h.abs() >= 0.6 {
        return h - h.ln_1p();
    }
    let (mut sum, mut p, mut sign) = (0.0, h * h, 1.0);
    for k in 2..200 {
        sum += sign * p / k as f64;
        p *= h;
        sign = -sign;
    }
    sum
}

fn ulps32(a: f32, b: f32) -> u32 {
    // Both positive here, so the bit patterns are ordered like the values.
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
}

/// δ log-uniform in [1e-6, 10].
fn delta_strategy() -> impl Strategy<Value = f64> {
    (-6.0f64..1.0).prop_map(|e| 10f64.powf(e))
}

proptest! {
    #[test]
    fn measures_match_their_formulas_in_x_and_in_the_ratio(x in -5.0f64..5.0) {
        // The module table: ρ = e^x; k1 = −x; |x|; k2 = x²/2; k3 = e^x − 1 − x; χ² = (e^x − 1)²;
        // `of_ratio(e^x)` gives the same value as `eval(x)`.
        let rho = x.exp();
        for (m, want) in [
            (Measure::Ratio, rho),
            (Measure::K1, -x),
            (Measure::Abs, x.abs()),
            (Measure::K2, x * x / 2.0),
            (Measure::K3, rho - 1.0 - x),
            (Measure::ChiSquared, (rho - 1.0) * (rho - 1.0)),
        ] {
            let tol = 1e-13 * (1.0 + want.abs());
            let v = m.eval(x).value;
            prop_assert!((v - want).abs() <= tol, "{m:?} eval({x}) = {v}, want {want}");
            let r = m.of_ratio(rho);
            prop_assert!((r - want).abs() <= tol, "{m:?} of_ratio({rho}) = {r}, want {want}");
        }
    }

    #[test]
    fn measure_gradients_match_finite_differences(x in -5.0f64..5.0) {
        for m in MEASURES {
            // |x| has a kink at 0: stay away from it.
            if m == Measure::Abs && x.abs() < 1e-3 {
                continue;
            }
            let g = m.eval(x).grad;
            let fd = central(|x| m.eval(x).value, x);
            prop_assert!(grad_close(g, fd), "{m:?} at {x}: {g} vs {fd}");
        }
    }

    #[test]
    fn measure_tokens_gradients_match_finite_differences(
        lp in prop::collection::vec(-8.0f64..0.0, 1..20),
        shift in prop::collection::vec(-3.0f64..3.0, 20),
    ) {
        let n = lp.len();
        let old: Vec<f64> = lp.iter().zip(&shift).map(|(l, s)| l - s).collect();
        let t = Tokens::padded(1, n, None);
        for m in MEASURES {
            let cfg = MeasureConfig { measure: m, log_ratio_clamp: Some(20.0) };
            let (mut v, mut g) = (vec![0.0; n], vec![0.0; n]);
            measure_tokens(&cfg, &lp, &old, &t, &mut v, &mut g).unwrap();
            for i in 0..n {
                if m == Measure::Abs && (lp[i] - old[i]).abs() < 1e-3 {
                    continue;
                }
                let fd = central(|x| m.eval(x - old[i]).value, lp[i]);
                prop_assert!(grad_close(g[i], fd), "{m:?} token {i}");
            }
        }
    }

    #[test]
    fn kl_penalty_gradients_match_finite_differences(
        lp in -6.0f64..0.0,
        d in -2.0f64..2.0,
        x in -1.5f64..1.5,
    ) {
        let reference = lp - d;
        let old = lp - x;
        // |d| ≤ 2 keeps every preset's clamps inactive (k3(−2) = e² − 3 ≈ 4.39 < 10, k2 ≤ 2).
        for p in PRESETS {
            for e in ESTIMATORS {
                let cfg = KlPenaltyConfig::<f64>::from_preset(p, e);
                if e == KlEstimator::Abs && d.abs() < 1e-3 {
                    continue;
                }
                let got = cfg.eval(lp, reference, old).grad;
                let fd = match e {
                    // Straight-through: the gradient is that of k2 = d²/2.
                    KlEstimator::K1StraightThrough | KlEstimator::K3StraightThrough => {
                        let k2 = KlPenaltyConfig::<f64>::from_preset(Preset::Trl, KlEstimator::K2);
                        central(|l| k2.eval(l, reference, old).value, lp)
                    }
                    _ => central(|l| cfg.eval(l, reference, old).value, lp),
                };
                prop_assert!(grad_close(got, fd), "{p:?} {e:?}: {got} vs {fd}");
            }
        }
    }

    #[test]
    fn k3_and_divergences_are_nonnegative(d in -700.0f64..700.0) {
        for p in PRESETS {
            let v = KlPenaltyConfig::<f64>::from_preset(p, KlEstimator::K3).eval(d, 0.0, 0.0);
            prop_assert!(v.value >= 0.0 && v.value.is_finite() && v.grad.is_finite());
        }
        for m in [Measure::Abs, Measure::K2, Measure::K3, Measure::ChiSquared] {
            prop_assert!(m.eval(d).value >= 0.0);
        }
    }

    #[test]
    fn kl3_bounds_sit_on_the_constraint(delta in delta_strategy()) {
        let b = RatioBounds::kl3(delta).unwrap();
        prop_assert!(b.lo > 0.0 && b.lo < 1.0 && b.hi > 1.0);
        prop_assert!(((kl3_reference(b.lo) - delta) / delta).abs() < 1e-12, "lo {delta}");
        prop_assert!(((kl3_reference(b.hi) - delta) / delta).abs() < 1e-12, "hi {delta}");
        prop_assert_eq!(RatioBounds::from_divergence(Measure::K3, delta).unwrap(), b);
    }

    #[test]
    fn kl3_bounds_agree_with_lambert_w(delta in 0.01f64..10.0) {
        // Away from the branch point the Lambert-W form is well conditioned.
        let a = -(-(1.0 + delta)).exp();
        let b = RatioBounds::kl3(delta).unwrap();
        let lo = -lambert_w0(a).unwrap();
        let hi = -lambert_wm1(a).unwrap();
        prop_assert!((b.lo - lo).abs() < 1e-12 * lo.max(1e-3) / (1.0 - lo), "{delta}");
        prop_assert!((b.hi - hi).abs() < 1e-12 * hi / (hi - 1.0), "{delta}");
    }

    #[test]
    fn kl3_small_delta_expansion(e in -10.0f64..-4.0) {
        // ρ = e^y, y = s − s²/6 + s³/36 + O(s⁴) with s = ±√(2δ), so
        // ρ = 1 + s + s²/3 + s³/36 + O(s⁴): the remainder after √(2δ) ∓ 2δ/3 is
        // (2δ)^{3/2}/36 ≈ 0.0786·δ^{3/2}.
        let delta = 10f64.powf(e);
        let b = RatioBounds::kl3(delta).unwrap();
        let s = (2.0 * delta).sqrt();
        let bound = 0.1 * delta.powf(1.5) + 4e-16;
        prop_assert!(((1.0 - b.lo) - (s - 2.0 * delta / 3.0)).abs() < bound);
        prop_assert!(((b.hi - 1.0) - (s + 2.0 * delta / 3.0)).abs() < bound);
        // Asymmetric: wider upward.
        prop_assert!(b.hi - 1.0 > 1.0 - b.lo);
    }

    #[test]
    fn kl3_f32_within_two_ulp_of_f64(delta in delta_strategy()) {
        let d32 = delta as f32;
        let b32 = RatioBounds::kl3(d32).unwrap();
        let b64 = RatioBounds::kl3(d32 as f64).unwrap();
        prop_assert!(ulps32(b32.lo, b64.lo as f32) <= 2);
        prop_assert!(ulps32(b32.hi, b64.hi as f32) <= 2);
    }

    #[test]
    fn lambert_w_identities(x in -0.36787944f64..1e6, y in -30.0f64..-1.05, z in -1.0f64..30.0) {
        let w = lambert_w0(x).unwrap();
        prop_assert!(w >= -1.0);
        let tol = 1e-15f64.max(4e-16 * (1.0 + w.abs()));
        // Near the branch point |w e^w − x| is bounded by the rounding of x itself (~ε/e).
        prop_assert!((w * w.exp() - x).abs() <= tol * x.abs().max(0.37), "W0 {x}");
        // W inverts w ↦ w e^w on each branch (condition number |1/(1+w)| away from −1).
        let wy = lambert_wm1(y * y.exp()).unwrap();
        prop_assert!((wy - y).abs() <= 1e-13 * y.abs() / (1.0 + y).abs(), "W-1 {y}");
        if z > -0.95 {
            let wz = lambert_w0(z * z.exp()).unwrap();
            prop_assert!((wz - z).abs() <= 1e-13 * z.abs().max(1.0) / (1.0 + z), "W0 {z}");
        }
    }

    #[test]
    fn extreme_inputs_and_padding_garbage_give_finite_outputs(
        diffs in prop::collection::vec(-1000.0f64..1000.0, 1..40),
        garbage in prop::sample::select(vec![f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e308]),
    ) {
        let n = diffs.len();
        // Every third position is padding holding garbage.
        let mask: Vec<bool> = (0..n).map(|i| i % 3 != 2).collect();
        let lp: Vec<f64> = (0..n).map(|i| if mask[i] { diffs[i] } else { garbage }).collect();
        let zeros = vec![0.0; n];
        let cu = [0, n];
        let t = Tokens::packed(&cu, Some(&mask));
        let (mut v, mut g) = (vec![0.0; n], vec![0.0; n]);
        for m in MEASURES {
            for clamp in [Some(20.0), None] {
                let cfg = MeasureConfig { measure: m, log_ratio_clamp: clamp };
                measure_tokens(&cfg, &lp, &zeros, &t, &mut v, &mut g).unwrap();
                prop_assert!(v.iter().chain(&g).all(|x| x.is_finite()), "{m:?}");
            }
        }
        for p in PRESETS {
            for e in ESTIMATORS {
                let cfg = KlPenaltyConfig::from_preset(p, e);
                kl_penalty(&cfg, &lp, &zeros, Some(&zeros), &t, &mut v, &mut g).unwrap();
                prop_assert!(v.iter().chain(&g).all(|x| x.is_finite()), "{p:?} {e:?}");
            }
        }
        let lp32: Vec<f32> = lp.iter().map(|&x| x as f32).collect();
        let z32 = vec![0.0f32; n];
        let mut w = vec![0.0f32; n];
        for cfg in [
            IsConfig::default(),
            IsConfig { log_clamp: None, ..IsConfig::default() },
            IsConfig { level: IsLevel::Sequence, log_clamp: None, batch_normalize: true, ..IsConfig::default() },
            IsConfig::seq_mask_tis(),
        ] {
            is_weights(&cfg, &lp32, &z32, &t, &mut w).unwrap();
            prop_assert!(w.iter().all(|x| x.is_finite()));
        }
    }

    #[test]
    fn is_weights_respect_their_filters(
        r in prop::collection::vec(-3.0f64..3.0, 2..30),
        cap in 1.0f64..5.0,
    ) {
        let n = r.len();
        let zeros = vec![0.0; n];
        let half = n / 2;
        let cu = [0, half, n];
        let t = Tokens::packed(&cu, None);
        let mut w = vec![0.0; n];
        is_weights(&IsConfig::token_truncate(cap), &r, &zeros, &t, &mut w).unwrap();
        for i in 0..n {
            prop_assert!((w[i] - r[i].exp().min(cap)).abs() <= 1e-12 * cap);
        }
        let seq = IsConfig::sequence_truncate(cap);
        is_weights(&seq, &r, &zeros, &t, &mut w).unwrap();
        // The sequence's log-weight is limited to ±log_clamp (20) before the exponential: eight
        // tokens near −2.5 reach it (a case proptest found).
        let c = seq.log_clamp.unwrap();
        let s0: f64 = r[..half].iter().sum::<f64>().clamp(-c, c);
        for i in 0..half {
            prop_assert!((w[i] - s0.exp().min(cap)).abs() <= 1e-12 * cap);
        }
        let cfg = IsConfig { batch_normalize: true, ..IsConfig::default() };
        is_weights(&cfg, &r, &zeros, &t, &mut w).unwrap();
        let mean: f64 = w.iter().sum::<f64>() / n as f64;
        prop_assert!((mean - 1.0).abs() < 1e-12);
    }

    #[test]
    fn top_entropy_mask_matches_a_sorting_reference(
        h in prop::collection::vec(0.0f32..5.0, 1..50),
        rho in 0.0f32..=1.0,
    ) {
        let n = h.len();
        let mask: Vec<bool> = (0..n).map(|i| i % 4 != 3).collect();
        let t = Tokens::padded(1, n, Some(&mask));
        let mut scratch = vec![0.0f32; n];
        let mut keep = vec![false; n];
        let thr = top_entropy_mask(&h, &t, rho, &mut scratch, &mut keep).unwrap();
        let mut valid: Vec<f32> = (0..n).filter(|&i| mask[i]).map(|i| h[i]).collect();
        valid.sort_by(f32::total_cmp);
        // torch.quantile, linear: rank = q(n−1), lerp between the neighbours (torch's two-sided lerp).
        let q = (1.0 - rho as f64) as f32;
        let rank = q * (valid.len() - 1) as f32;
        let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
        let w = rank - lo as f32;
        let (a, b) = (valid[lo], valid[hi.min(valid.len() - 1)]);
        let expect = if w < 0.5 { a + w * (b - a) } else { b - (b - a) * (1.0 - w) };
        prop_assert_eq!(thr, expect);
        for i in 0..n {
            prop_assert_eq!(keep[i], mask[i] && h[i] >= expect);
        }
        // At least the largest valid entropy survives.
        prop_assert!(keep.iter().any(|&k| k));
    }

    #[test]
    fn etr_bounds_contain_one_and_grow_with_the_advantage(
        a in prop::collection::vec(-3.0f64..3.0, 4),
        rewards in prop::collection::vec(prop::sample::select(vec![0.0f64, 1.0]), 4),
    ) {
        let etr = ElasticTrustRegion { eps0: 0.1, alpha: 0.5, eps_max: 0.25, beta: 1.0 };
        let mut out = [RatioBounds::symmetric(0.2).unwrap(); 4];
        etr.sample_bounds(&a, &rewards, Groups::Uniform(4), &mut out).unwrap();
        for i in 0..4 {
            prop_assert!(out[i].lo > 0.0 && out[i].lo < 1.0 && out[i].hi > 1.0);
            for j in 0..4 {
                if a[i].abs() <= a[j].abs() {
                    prop_assert!(out[i].hi <= out[j].hi + 1e-15);
                }
            }
        }
    }

    #[test]
    fn etr_bounds_match_their_formula(
        g in 1usize..6, k in 1usize..4,
        a in prop::collection::vec(-3.0f64..3.0, 15),
        r in prop::collection::vec(prop_oneof![3 => prop::sample::select(vec![0.0f64, 1.0]), 1 => -1.0f64..2.0], 15),
        eps0 in 0.05f64..0.2, alpha in 0.0f64..1.0, extra in 0.0f64..0.1, beta in 0.0f64..1.0,
    ) {
        // ε_i = min(ε₀(1 + α|A_i|), ε_max)·(1 + β·4σ_g²), 4σ_g² = 4p(1 − p) for a group of
        // 0/1 rewards (p its success rate) and 0 otherwise; bounds [1 − ε_i, 1 + ε_i].
        let n = g * k;
        let (a, r) = (&a[..n], &r[..n]);
        // ε_max·(1 + β) ≤ 0.3·2 < 1: every configuration is valid.
        let eps_max = eps0 + extra;
        let etr = ElasticTrustRegion { eps0, alpha, eps_max, beta };
        let mut out = vec![RatioBounds::symmetric(0.2).unwrap(); n];
        etr.sample_bounds(a, r, Groups::Uniform(g), &mut out).unwrap();
        for i in 0..n {
            let grp = &r[i / g * g..(i / g + 1) * g];
            let binary = grp.iter().all(|&x| x == 0.0 || x == 1.0);
            let p = grp.iter().sum::<f64>() / g as f64;
            let var4 = if binary { 4.0 * p * (1.0 - p) } else { 0.0 };
            let eps = (eps0 * (1.0 + alpha * a[i].abs())).min(eps_max) * (1.0 + beta * var4);
            prop_assert!((out[i].lo - (1.0 - eps)).abs() < 1e-12, "{}: {:?} vs ε {}", i, out[i], eps);
            prop_assert!((out[i].hi - (1.0 + eps)).abs() < 1e-12, "{}: {:?} vs ε {}", i, out[i], eps);
        }
    }
}

#[test]
fn kl3_check_values_from_math_md() {
    for (d, l, u) in [
        (0.01f64, 0.86517f64, 1.14817f64),
        (0.05, 0.71619, 1.35040),
        (0.1, 0.61682, 1.51622),
    ] {
        let b = RatioBounds::kl3(d).unwrap();
        assert!(
            (b.lo - l).abs() < 5e-6 && (b.hi - u).abs() < 5e-6,
            "{d}: {b:?}"
        );
        let b32 = RatioBounds::kl3(d as f32).unwrap();
        assert!((b32.lo as f64 - l).abs() < 6e-6 && (b32.hi as f64 - u).abs() < 6e-6);
    }
}

#[test]
fn lambert_w_known_values() {
    // Ω = W₀(1); W₀(e) = 1; W₋₁(−0.1); W₋₁(−1/e) = −1.
    assert!((lambert_w0(1.0f64).unwrap() - 0.5671432904097838).abs() < 2.5e-16);
    assert!((lambert_w0(std::f64::consts::E).unwrap() - 1.0).abs() < 2.5e-16);
    assert!((lambert_wm1(-0.1f64).unwrap() + 3.577152063957297).abs() < 1e-15);
    assert_eq!(lambert_wm1(-(-1.0f64).exp()).unwrap(), -1.0);
    assert!((lambert_w0(1.0f32).unwrap() - 0.56714329).abs() < 1.2e-7);
}

#[test]
fn kl_penalty_preset_differences_hand_computed() {
    // lp − ref = d for three tokens: d = −20, 12, 0.5.
    let lp = [-20.0f64, 12.0, 0.5];
    let reference = [0.0; 3];
    let t = Tokens::padded(1, 3, None);
    let run = |p, e| {
        let (mut v, mut g) = ([0.0; 3], [0.0; 3]);
        kl_penalty(
            &KlPenaltyConfig::from_preset(p, e),
            &lp,
            &reference,
            None,
            &t,
            &mut v,
            &mut g,
        )
        .unwrap();
        (v, g)
    };
    // verl k3: d = −20 is inside the ±20 input clamp; e^{20} − 20 − 1 = 4.85e8 → output 10,
    // gradient 0. d = 12: e^{−12} + 11 = 11.000006 → 10. d = 0.5: e^{−0.5} − 0.5 = 0.1065306597.
    let (v, g) = run(Preset::Verl, KlEstimator::K3);
    assert_eq!((v[0], g[0], v[1], g[1]), (10.0, 0.0, 10.0, 0.0));
    assert!((v[2] - 0.10653065971263342).abs() < 1e-15);
    assert!((g[2] - 0.3934693402873666).abs() < 1e-15); // 1 − e^{−0.5}
    // OpenRLHF k3: same output clamp, no input clamp (identical here).
    let (vo, _) = run(Preset::OpenRlhf, KlEstimator::K3);
    assert_eq!((vo[0], vo[1]), (10.0, 10.0));
    // OpenRLHF k1: clamped to ±10: [−10, 10, 0.5], gradients [0, 0, 1].
    let (v, g) = run(Preset::OpenRlhf, KlEstimator::K1);
    assert_eq!(v, [-10.0, 10.0, 0.5]);
    assert_eq!(g, [0.0, 0.0, 1.0]);
    // verl k1: unclamped.
    let (v, g) = run(Preset::Verl, KlEstimator::K1);
    assert_eq!(v, [-20.0, 12.0, 0.5]);
    assert_eq!(g, [1.0; 3]);
    // TRL k3: unclamped: e^{20} − 21 = 485165174.40979…, gradient 1 − e^{20}.
    let (v, g) = run(Preset::Trl, KlEstimator::K3);
    assert!((v[0] - 485165174.4097903).abs() < 1e-5);
    assert!((g[0] - (1.0 - 485165195.4097903)).abs() < 1e-5);
    assert!((v[1] - (11.0 + (-12.0f64).exp())).abs() < 1e-14);
}

#[test]
fn bad_input_is_rejected_and_outputs_stay_untouched() {
    // Parameters.
    assert!(RatioBounds::kl3(0.0f64).is_err());
    assert!(RatioBounds::kl3(-1.0f32).is_err());
    assert!(RatioBounds::from_divergence(Measure::K2, 0.0f64).is_err());
    assert!(RatioBounds::symmetric(0.0f64).is_err());
    assert!(RatioBounds::asymmetric(1.0f64, 0.2).is_err());
    assert!(RatioBounds::asymmetric(0.2f64, 0.0).is_err());
    assert!(DualClip::new(1.0f64).is_err());
    assert!(DualClip::new(0.5f32).is_err());
    assert!(DeltaCap::new(1.0f64).is_err());
    assert!(
        ElasticTrustRegion {
            eps0: 0.0f64,
            ..Default::default()
        }
        .validate()
        .is_err()
    );

    // Token functions: mismatched lengths, NaN at valid positions, bad clamps.
    let t = Tokens::padded(1, 3, None);
    let lp = [0.0f64, -1.0, -2.0];
    let sentinel = [42.0f64; 3];
    let (mut v, mut g) = (sentinel, sentinel);
    let cfg = MeasureConfig::default();
    assert!(matches!(
        measure_tokens(&cfg, &lp, &lp[..2], &t, &mut v, &mut g),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        measure_tokens(&cfg, &lp, &lp, &t, &mut v, &mut g[..2]),
        Err(Error::LengthMismatch { .. })
    ));
    let kcfg = KlPenaltyConfig::<f64> {
        output_clamp: Some(-1.0),
        ..Default::default()
    };
    assert!(kl_penalty(&kcfg, &lp, &lp, None, &t, &mut v, &mut g).is_err());
    assert!(
        kl_penalty(
            &KlPenaltyConfig::default(),
            &lp,
            &[0.0, f64::NAN, 0.0],
            None,
            &t,
            &mut v,
            &mut g
        )
        .is_err()
    );
    assert!(
        kl_penalty(
            &KlPenaltyConfig::default(),
            &lp,
            &lp,
            Some(&lp[..1]),
            &t,
            &mut v,
            &mut g
        )
        .is_err()
    );
    assert_eq!((v, g), (sentinel, sentinel));
    let mut w = sentinel;
    assert!(is_weights(&IsConfig::token_truncate(-1.0), &lp, &lp, &t, &mut w).is_err());
    assert!(
        is_weights(
            &IsConfig::default(),
            &lp,
            &lp,
            &Tokens::padded(2, 2, None),
            &mut w
        )
        .is_err()
    );
    assert_eq!(w, sentinel);
}

/// proptest's find, kept: a sequence whose log-weight sum (−20.02) passes the default log clamp
/// (20) gets e^{−20}, not e^{−20.02}.
#[test]
fn sequence_weight_is_taken_at_the_clamped_log_sum() {
    let r = [
        -2.6508308034029167,
        -2.2268442629697516,
        -2.323477517263289,
        -2.6663301613074153,
        -2.516577279607039,
        -2.5391501721166603,
        -2.3237807864482147,
        -2.776422726945295,
    ];
    let zeros = [0.0; 8];
    let cu = [0, 8];
    let mut w = [0.0; 8];
    let d = is_weights(
        &IsConfig::sequence_truncate(1.0),
        &r,
        &zeros,
        &Tokens::packed(&cu, None),
        &mut w,
    )
    .unwrap();
    assert!(r.iter().sum::<f64>() < -20.02);
    for x in w {
        assert!((x - (-20.0f64).exp()).abs() <= 1e-12 * x, "{x}");
    }
    assert_eq!(d.log_clamped, 8);
}
