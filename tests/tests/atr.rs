//! ATR-GRPO [2602.05494]: the KL3-constrained clipped objective is PPO-clip with the Lambert-W
//! ratio bounds. The reference below applies the unified framework literally — a token's
//! feasibility is the KL3 test `ρ − 1 − ln ρ ≤ δ`, never the interval — and the library's
//! PPO-clip with `RatioBounds::kl3(δ)` must give the same per-token gradient.

use grpo_core::Tokens;
use grpo_core::loss::{PolicyInputs, PpoClipConfig, ppo_clip};
use proptest::prelude::*;

/// ∂/∂lp of −min(ρA, clip_C(ρ)A), clip_C(ρ) = ρ if feasible else sg(ρ): the token keeps A·ρ
/// unless it is infeasible on the side where the objective would still improve
/// (A > 0 with ρ > 1, or A < 0 with ρ < 1).
fn unified_grad(x: f64, a: f64, delta: f64) -> f64 {
    let rho = x.exp();
    let feasible = rho - 1.0 - x <= delta;
    let improving_side = (a > 0.0 && rho > 1.0) || (a < 0.0 && rho < 1.0);
    if !feasible && improving_side {
        0.0
    } else {
        -a * rho
    }
}

proptest! {
    #[test]
    fn kl3_constrained_gradient_equals_ppo_clip_with_lambert_bounds(
        delta in 1e-3f64..2.0,
        toks in prop::collection::vec((-3.0f64..3.0, -2.0f64..2.0), 1..64),
    ) {
        let cfg = PpoClipConfig::atr_kl3(delta).unwrap();
        let (lo, hi) = (cfg.bounds.lo, cfg.bounds.hi);
        // Stay off the kinks (exactly on a boundary both one-sided derivatives are valid).
        let toks: Vec<(f64, f64)> = toks
            .into_iter()
            .filter(|&(x, _)| (x.exp() - lo).abs() > 1e-9 && (x.exp() - hi).abs() > 1e-9)
            .collect();
        let n = toks.len();
        let lp: Vec<f64> = toks.iter().map(|t| t.0 - 0.5).collect();
        let old = vec![-0.5; n];
        let adv: Vec<f64> = toks.iter().map(|t| t.1).collect();
        let cu = [0, n];
        let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::packed(&cu, None) };
        let (mut value, mut grad) = (vec![0.0; n], vec![0.0; n]);
        ppo_clip(&cfg, &inp, &mut value, &mut grad).unwrap();
        for t in 0..n {
            let x = lp[t] - old[t];
            let want = unified_grad(x, adv[t], delta);
            prop_assert!((grad[t] - want).abs() <= 1e-12 * want.abs().max(1.0),
                "x={x} A={} grad={} want={want} bounds=[{lo}, {hi}]", adv[t], grad[t]);
        }
    }
}

/// The check values of MATH.md §3 through the loss config.
#[test]
fn atr_bounds_check_values() {
    for (delta, lo, hi) in [
        (0.01, 0.86517, 1.14817),
        (0.05, 0.71619, 1.35040),
        (0.1, 0.61682, 1.51622),
    ] {
        let b = PpoClipConfig::<f64>::atr_kl3(delta).unwrap().bounds;
        assert!(
            (b.lo - lo).abs() < 5e-6 && (b.hi - hi).abs() < 5e-6,
            "{delta}: {b:?}"
        );
    }
    assert!(PpoClipConfig::<f64>::atr_kl3(0.0).is_err());
    assert!(PpoClipConfig::<f32>::atr_kl3(f32::NAN).is_err());
}
