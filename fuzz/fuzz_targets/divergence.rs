//! Divergence bounds (the elastic trust region's per-sample bounds included), KL penalties, IS
//! weights, rejection masks, the top-entropy mask and the coefficient controllers from
//! untrusted sizes and values: never panic, every Ok result is finite, and an Err leaves the
//! outputs (or the controller's state) untouched.
#![no_main]

use grpo_core::Tokens;
use grpo_core::control::{AdaptiveEntropyController, AdaptiveKlController, TrlEntropyController};
use grpo_core::divergence::kl_penalty::kl_penalty;
use grpo_core::divergence::lambert_w::{lambert_w0, lambert_wm1};
use grpo_core::divergence::measures::{MeasureConfig, measure_tokens};
use grpo_core::divergence::{
    ElasticTrustRegion, KlEstimator, KlPenaltyConfig, Measure, RatioBounds,
};
use grpo_core::is_correction::{
    IsConfig, IsFilter, IsLevel, RejectLevel, RejectStat, RejectionCriterion, is_weights,
    off_policy_sequence_mask, rejection_mask,
};
use grpo_core::selection::top_entropy_mask;
use grpo_core::{Groups, Preset};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    delta: f64,
    delta32: f32,
    w_arg: f64,
    measure: u8,
    estimator: u8,
    preset: u8,
    clamp_in: Option<f32>,
    clamp_out: Option<f32>,
    level: u8,
    filter: u8,
    bound_a: f32,
    bound_b: f32,
    normalize: bool,
    rows: u8,
    cols: u8,
    lp: Vec<f32>,
    other: Vec<f32>,
    third: Vec<f32>,
    mask: Vec<bool>,
    rho: f32,
}

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

fn check_bounds<T: grpo_core::Real>(b: RatioBounds<T>) {
    assert!(b.lo >= T::ZERO && b.lo <= T::ONE && b.hi >= T::ONE, "{b:?}");
}

fuzz_target!(|inp: Input| {
    // Bounds from arbitrary δ, both precisions.
    if let Ok(b) = RatioBounds::kl3(inp.delta) {
        check_bounds(b);
    }
    if let Ok(b) = RatioBounds::kl3(inp.delta32) {
        check_bounds(b);
    }
    let m = MEASURES[inp.measure as usize % MEASURES.len()];
    if let Ok(b) = RatioBounds::from_divergence(m, inp.delta32) {
        check_bounds(b);
    }
    if let Ok(w) = lambert_w0(inp.w_arg) {
        assert!(w.is_finite() && w >= -1.0);
    }
    if let Ok(w) = lambert_wm1(inp.w_arg) {
        assert!(w.is_finite() && w <= -1.0);
    }

    // Token layouts of arbitrary size; the value arrays are truncated/padded to fit.
    let n = inp.rows as usize * inp.cols as usize;
    let fit =
        |v: &[f32]| -> Vec<f32> { (0..n).map(|i| v.get(i).copied().unwrap_or(0.0)).collect() };
    let (lp, other, third) = (fit(&inp.lp), fit(&inp.other), fit(&inp.third));
    let mask: Vec<bool> = (0..n)
        .map(|i| inp.mask.get(i).copied().unwrap_or(true))
        .collect();
    let use_mask = !inp.mask.is_empty();
    let tokens = Tokens::padded(
        inp.rows as usize,
        inp.cols as usize,
        use_mask.then_some(&mask[..]),
    );
    // Every operation below: Ok ⇒ finite outputs; Err ⇒ its outputs still hold the sentinel.
    const SENTINEL: f32 = 4242.0;
    let untouched = |x: &[f32]| x.iter().all(|&v| v == SENTINEL);
    let (mut v, mut g) = (vec![SENTINEL; n], vec![SENTINEL; n]);

    let mcfg = MeasureConfig {
        measure: m,
        log_ratio_clamp: inp.clamp_in,
    };
    match measure_tokens(&mcfg, &lp, &other, &tokens, &mut v, &mut g) {
        Ok(d) => {
            assert!(v.iter().chain(&g).all(|x| x.is_finite()));
            assert!(d.mean.is_finite());
        }
        Err(_) => assert!(untouched(&v) && untouched(&g)),
    }

    let mut kcfg = KlPenaltyConfig::from_preset(
        PRESETS[inp.preset as usize % PRESETS.len()],
        ESTIMATORS[inp.estimator as usize % ESTIMATORS.len()],
    );
    if inp.clamp_in.is_some() {
        kcfg.input_clamp = inp.clamp_in;
    }
    if inp.clamp_out.is_some() {
        kcfg.output_clamp = inp.clamp_out;
    }
    let (mut v, mut g) = (vec![SENTINEL; n], vec![SENTINEL; n]);
    match kl_penalty(&kcfg, &lp, &other, Some(&third), &tokens, &mut v, &mut g) {
        Ok(d) => {
            assert!(v.iter().chain(&g).all(|x| x.is_finite()));
            assert!(d.mean.is_finite());
        }
        Err(_) => assert!(untouched(&v) && untouched(&g)),
    }

    let level = [IsLevel::Token, IsLevel::Sequence, IsLevel::GeometricMean][inp.level as usize % 3];
    let (a, b) = (inp.bound_a, inp.bound_b);
    let filter = match inp.filter % 4 {
        0 => IsFilter::None,
        1 => IsFilter::Truncate { min: a, max: b },
        2 => IsFilter::Mask { lo: a, hi: b },
        _ => IsFilter::GeometricMask { lo: a, hi: b },
    };
    let icfg = IsConfig {
        level,
        filter,
        log_clamp: inp.clamp_in,
        batch_normalize: inp.normalize,
    };
    let mut w = vec![SENTINEL; n];
    match is_weights(&icfg, &other, &third, &tokens, &mut w) {
        Ok(d) => {
            assert!(w.iter().all(|x| x.is_finite()));
            assert!(d.mean.is_finite());
        }
        Err(_) => assert!(untouched(&w)),
    }

    let mut keep = vec![false; n];
    let stat = [RejectStat::K1, RejectStat::K2, RejectStat::K3][inp.level as usize % 3];
    let rlevel = [
        RejectLevel::Token,
        RejectLevel::SeqSum,
        RejectLevel::SeqMean,
        RejectLevel::SeqMax,
    ][inp.filter as usize % 4];
    let crit = if stat == RejectStat::K1 {
        RejectionCriterion::k1(rlevel, a, b)
    } else {
        RejectionCriterion::upper(stat, rlevel, b)
    };
    // Boolean outputs: filled with the pattern t % 3 == 0, which an Err must leave.
    let pattern: Vec<bool> = (0..n).map(|t| t % 3 == 0).collect();
    if let Ok(c) = crit {
        keep.copy_from_slice(&pattern);
        match rejection_mask(&[c], &other, &third, &tokens, &mut keep) {
            Ok(d) => assert!(d.rejected_tokens <= d.tokens),
            Err(_) => assert_eq!(keep, pattern),
        }
    }
    let seqs = inp.rows as usize;
    let adv: Vec<f32> = (0..seqs)
        .map(|i| inp.third.get(i).copied().unwrap_or(-1.0))
        .collect();
    let seq_pattern: Vec<bool> = (0..seqs).map(|i| i % 3 == 0).collect();
    let mut seq_keep = seq_pattern.clone();
    if off_policy_sequence_mask(&adv, &lp, &other, &tokens, inp.bound_a, &mut seq_keep).is_err() {
        assert_eq!(seq_keep, seq_pattern);
    }

    let mut scratch = vec![0.0f32; n];
    keep.copy_from_slice(&pattern);
    match top_entropy_mask(&lp, &tokens, inp.rho, &mut scratch, &mut keep) {
        Ok(t) => assert!(t.is_finite() || keep.iter().all(|k| !k)),
        Err(_) => assert_eq!(keep, pattern),
    }

    // The elastic trust region's bounds: `rows` groups of `cols` samples, advantages `lp`,
    // rewards from the mask (binary groups) or `other`; Ok ⇒ every bound a valid interval
    // with a lower end > 0, within ε_max·(1 + β) of 1 up to the rounding of 1 + ε (one ulp of
    // 1), Err ⇒ `out` untouched.
    let etr = ElasticTrustRegion {
        eps0: inp.bound_a,
        alpha: inp.rho,
        eps_max: inp.bound_b,
        beta: inp.delta32,
    };
    let rewards: Vec<f32> = if inp.normalize {
        mask.iter().map(|&m| f32::from(u8::from(m))).collect()
    } else {
        other.clone()
    };
    let sentinel = RatioBounds { lo: 0.5, hi: 4.0 };
    let mut out = vec![sentinel; n];
    let groups = Groups::Uniform(inp.cols as usize);
    match etr.sample_bounds(&lp, &rewards, groups, &mut out) {
        Ok(()) => {
            let widest = etr.eps_max * (1.0 + etr.beta);
            for b in &out {
                check_bounds(*b);
                assert!(
                    b.lo > 0.0 && b.hi - 1.0 <= widest * (1.0 + 1e-6) + f32::EPSILON,
                    "{b:?} {etr:?}"
                );
            }
        }
        Err(_) => assert!(out.iter().all(|b| *b == sentinel)),
    }

    // The coefficient controllers, settings and measurements from the input: Ok ⇒ a finite
    // coefficient (≥ 0 for the KL's, within [min, max] for our entropy one), Err ⇒ the state
    // unchanged (compared through `Debug`, so that a NaN field equals itself).
    let steps = inp.rows as usize * 97 + inp.cols as usize;
    if let Ok(mut kl) = AdaptiveKlController::new(inp.bound_a.abs(), inp.bound_b, inp.rho) {
        let before = kl;
        match kl.update(inp.delta32, steps) {
            Ok(b) => assert!(b.is_finite() && b >= 0.0 && b == kl.value, "{kl:?}"),
            Err(_) => assert_eq!(format!("{kl:?}"), format!("{before:?}")),
        }
    }
    let measured = inp.lp.first().copied().unwrap_or(0.0);
    let mut ent = AdaptiveEntropyController {
        coef: inp.bound_a,
        target: inp.bound_b,
        lr: inp.rho,
        min: inp.delta32.min(0.0),
        max: inp.delta32.max(0.0),
    };
    let before = ent;
    match ent.update(measured) {
        Ok(c) => assert!(c.is_finite() && c >= ent.min && c <= ent.max, "{ent:?}"),
        Err(_) => assert_eq!(format!("{ent:?}"), format!("{before:?}")),
    }
    let mut trl = TrlEntropyController {
        coef: inp.bound_a,
        target: inp.bound_b,
        delta: inp.rho,
        min: inp.delta32.min(0.0),
        max: inp.delta32.max(0.0),
        last_entropy: None,
    };
    let before = trl;
    match trl.update(measured) {
        Ok(c) => {
            // TRL's rule moves c by δ towards the range and clamps only at the end it moves
            // towards: a coefficient that starts outside [min, max] may stay outside.
            let (lo, hi) = (trl.min.min(before.coef), trl.max.max(before.coef));
            assert!(c.is_finite() && c >= lo && c <= hi, "{trl:?}");
            let a = trl.applied();
            assert!(a == c || a == 0.0);
        }
        Err(_) => assert_eq!(format!("{trl:?}"), format!("{before:?}")),
    }
});
