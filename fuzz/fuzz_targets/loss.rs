//! Every policy loss on untrusted sizes, layouts, parameters and values: never panic, and an
//! `Ok` result has finite values and gradients (and zeros at invalid positions).
#![no_main]

use grpo_core::divergence::RatioBounds;
use grpo_core::loss::*;
use grpo_core::{Preset, Tokens};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    rows: u8,
    cols: u8,
    packed: bool,
    cu: Vec<u8>,
    mask: Vec<bool>,
    lp: Vec<f32>,
    old: Vec<f32>,
    adv: Vec<f32>,
    preset: u8,
    lo: f32,
    hi: f32,
    dual: Option<f32>,
    cap: Option<f32>,
    clamp: Option<f32>,
    ess: f32,
    ratio: f32,
    seed: u64,
    extra_out: u8,
}

fn check(
    name: &str,
    res: grpo_core::Result<LossDiagnostics<f32>>,
    v: &[f32],
    g: &[f32],
    tokens: &Tokens<'_>,
) {
    if res.is_ok() {
        for t in 0..v.len() {
            assert!(
                v[t].is_finite() && g[t].is_finite(),
                "{name}: non-finite at {t}"
            );
            if !tokens
                .mask
                .is_none_or(|m| m.get(t).copied().unwrap_or(true))
            {
                assert!(
                    v[t] == 0.0 && g[t] == 0.0,
                    "{name}: invalid position {t} written"
                );
            }
        }
    }
}

fuzz_target!(|inp: Input| {
    let n = (inp.rows as usize % 8) * (inp.cols as usize % 16);
    let fit =
        |v: &[f32]| -> Vec<f32> { (0..n).map(|i| v.get(i).copied().unwrap_or(0.5)).collect() };
    let (lp, old, adv) = (fit(&inp.lp), fit(&inp.old), fit(&inp.adv));
    let mask = (!inp.mask.is_empty()).then(|| {
        (0..n)
            .map(|i| inp.mask[i % inp.mask.len()])
            .collect::<Vec<_>>()
    });
    let cu: Vec<usize> = inp.cu.iter().map(|&c| c as usize).collect();
    let tokens = if inp.packed {
        Tokens::packed(&cu, mask.as_deref())
    } else {
        Tokens::padded(
            inp.rows as usize % 8,
            inp.cols as usize % 16,
            mask.as_deref(),
        )
    };
    let preset =
        [Preset::Paper, Preset::Verl, Preset::Trl, Preset::OpenRlhf][inp.preset as usize % 4];
    let pi = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &adv,
        tokens,
    };
    let m = n + (inp.extra_out as usize % 2);
    let mut v = vec![0.0f32; m];
    let mut g = vec![0.0f32; m];

    let ppo = PpoClipConfig {
        bounds: RatioBounds {
            lo: inp.lo,
            hi: inp.hi,
        },
        dual_clip: inp.dual,
        delta_cap: inp.cap,
        log_ratio_clamp: inp.clamp,
    };
    check("ppo", ppo_clip(&ppo, &pi, &mut v, &mut g), &v, &g, &tokens);
    check(
        "ppo preset",
        ppo_clip(&PpoClipConfig::from_preset(preset), &pi, &mut v, &mut g),
        &v,
        &g,
        &tokens,
    );
    let gs = GspoConfig {
        bounds: ppo.bounds,
        dual_clip: inp.dual,
        delta_cap: inp.cap,
        log_ratio_clamp: inp.clamp,
    };
    check("gspo", gspo(&gs, &pi, &mut v, &mut g), &v, &g, &tokens);
    let gt = GspoTokenConfig {
        bounds: ppo.bounds,
        seq_log_ratio_max: inp.clamp,
    };
    check(
        "gspo_token",
        gspo_token(&gt, &pi, &mut v, &mut g),
        &v,
        &g,
        &tokens,
    );
    let gm = GmpoConfig {
        eps_low: inp.lo,
        eps_high: inp.hi,
        log_ratio_clamp: inp.clamp,
        mean_eps: inp.ess,
    };
    check("gmpo", gmpo(&gm, &pi, &mut v, &mut g), &v, &g, &tokens);
    check(
        "gmpo preset",
        gmpo(&GmpoConfig::from_preset(preset), &pi, &mut v, &mut g),
        &v,
        &g,
        &tokens,
    );
    check(
        "cispo",
        cispo(&CispoConfig::from_preset(preset), &pi, &mut v, &mut g),
        &v,
        &g,
        &tokens,
    );
    let ci = CispoConfig {
        weight: CispoWeight::Cap(inp.hi),
        log_ratio_clamp: inp.clamp,
    };
    check(
        "cispo cap",
        cispo(&ci, &pi, &mut v, &mut g),
        &v,
        &g,
        &tokens,
    );
    let sa = SapoConfig {
        tau_pos: inp.lo,
        tau_neg: inp.hi,
        log_ratio_clamp: inp.clamp,
    };
    check("sapo", sapo(&sa, &pi, &mut v, &mut g), &v, &g, &tokens);
    let p3 = P3oConfig {
        log_ratio_clamp: inp.clamp,
    };
    if let Ok(s) = ess_stats(&p3, &pi) {
        let e = s.ess();
        assert!((0.0..=1.0).contains(&e), "ess {e}");
        check("p3o", p3o(&p3, &pi, e, &mut v, &mut g), &v, &g, &tokens);
    }
    check(
        "p3o raw",
        p3o(&p3, &pi, inp.ess, &mut v, &mut g),
        &v,
        &g,
        &tokens,
    );
    let cc = ClipCovConfig {
        bounds: ppo.bounds,
        ratio: inp.ratio,
        cov_lb: inp.lo,
        cov_ub: inp.hi,
        log_ratio_clamp: inp.clamp,
        seed: inp.seed,
    };
    check(
        "clip_cov",
        clip_cov(&cc, &pi, &mut v, &mut g),
        &v,
        &g,
        &tokens,
    );
    let kc = KlCovConfig {
        ratio: inp.ratio,
        coef: inp.ess,
        log_ratio_clamp: inp.clamp,
    };
    let mut s = vec![0.0f32; n];
    check(
        "kl_cov",
        kl_cov(&kc, &pi, &mut s, &mut v, &mut g),
        &v,
        &g,
        &tokens,
    );
    check(
        "reinforce",
        reinforce(&lp, &adv, Some(&old), tokens, &mut v, &mut g),
        &v,
        &g,
        &tokens,
    );
    check(
        "entropy",
        entropy_bonus(inp.ess, &old, tokens, &mut v, &mut g),
        &v,
        &g,
        &tokens,
    );
});
