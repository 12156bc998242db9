//! The most useful thing grpo-core does today, end to end on a small batch:
//! group-relative advantages under every peer's preset, then one clipped policy-loss step
//! (DAPO clip-higher vs ATR-GRPO's KL3 bounds) with token-mean aggregation.
//!
//! Run: `cargo run --release -p grpo-core --example advantages`

use grpo_core::advantage::{
    G2rpoConfig, GopoConfig, RlooConfig, SingletonRule, ZScoreConfig, g2rpo, gopo,
    rank_scratch_len, rloo, zscore,
};
use grpo_core::aggregate::{AggConfig, aggregate, scale_gradients};
use grpo_core::loss::{LossLevel, PolicyInputs, PpoClipConfig, ppo_clip};
use grpo_core::{Groups, Preset, Tokens};

fn row(name: &str, values: &[f64]) {
    print!("{name:<34}");
    for v in values {
        print!("{v:>9.4}");
    }
    println!();
}

fn main() -> Result<(), grpo_core::Error> {
    // Four prompts: a binary-reward group, a zero-variance group of non-dyadic rewards (the
    // one-pass-variance bug turns these into ±4000 in some trainers), a graded group and a
    // singleton. Variable group sizes go through CSR offsets.
    let rewards = [
        1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.1, 0.2, 0.9, 0.5, 0.7, 0.8,
    ];
    let offsets = [0, 4, 8, 12, 13];
    let groups = Groups::Offsets(&offsets);
    let mut adv = [0.0f64; 13];

    println!("rewards and advantages (13 samples in groups of 4, 4, 4, 1)\n");
    row("reward", &rewards);
    for (name, preset) in [
        ("GRPO verl (loop)", Preset::Verl),
        ("GRPO verl (vectorized)", Preset::VerlVectorized),
        ("GRPO TRL", Preset::Trl),
        ("GRPO default", Preset::Paper),
    ] {
        let d = zscore(
            &rewards,
            groups,
            &ZScoreConfig::from_preset(preset),
            &mut adv,
        )?;
        row(name, &adv);
        debug_assert_eq!(d.zero_variance_groups, 1);
    }
    // OpenRLHF divides 0/0 on singletons; its preset refuses them, 0 is an explicit choice.
    let openrlhf = ZScoreConfig {
        singleton: SingletonRule::Zero,
        ..ZScoreConfig::from_preset(Preset::OpenRlhf)
    };
    zscore(&rewards, groups, &openrlhf, &mut adv)?;
    row("GRPO OpenRLHF (singleton → 0)", &adv);
    zscore(&rewards, groups, &ZScoreConfig::dr_grpo(), &mut adv)?;
    row("Dr. GRPO", &adv);
    zscore(
        &rewards,
        groups,
        &ZScoreConfig::default().with_gamma(0.5),
        &mut adv,
    )?;
    row("std dial γ = 0.5", &adv);
    rloo(
        &rewards,
        groups,
        &RlooConfig::from_preset(Preset::Verl),
        &mut adv,
    )?;
    row("RLOO verl (loop)", &adv);
    // Rank estimators need two samples per group: the singleton is refused with a clear error
    // (and `adv` is left as it was), so rank the first three groups only.
    let mut scratch = vec![0usize; rank_scratch_len(rewards.len())];
    if let Err(e) = gopo(
        &rewards,
        groups,
        &GopoConfig::default(),
        &mut scratch,
        &mut adv,
    ) {
        println!("{:<34}refused: {e}", "GOPO on the whole batch");
    }
    let ranked = Groups::Uniform(4);
    let mut adv12 = [0.0f64; 12];
    gopo(
        &rewards[..12],
        ranked,
        &GopoConfig::default(),
        &mut scratch,
        &mut adv12,
    )?;
    row("GOPO (ordinal ties)", &adv12);
    let d = g2rpo(
        &rewards[..12],
        ranked,
        &G2rpoConfig::default(),
        &mut scratch,
        &mut adv12,
    )?;
    row("G²RPO", &adv12);
    println!(
        "\nG²RPO diagnostics: {} groups, {} zero-variance, {} singleton, advantages in [{:.4}, {:.4}]",
        d.groups, d.zero_variance_groups, d.singleton_groups, d.min, d.max
    );

    // One policy-loss step on the graded group: 4 responses of 5 tokens, padded + masked.
    zscore(&rewards, groups, &ZScoreConfig::default(), &mut adv)?;
    let (b, t) = (4, 5);
    let lengths = [5, 3, 4, 2];
    let mask: Vec<bool> = (0..b * t).map(|i| i % t < lengths[i / t]).collect();
    let tokens = Tokens::padded(b, t, Some(&mask));
    let token_adv: Vec<f64> = (0..b * t).map(|i| adv[8 + i / t]).collect();
    let old: Vec<f64> = (0..b * t).map(|i| -1.0 - 0.1 * (i % 7) as f64).collect();
    // The policy moved: log-ratios from −0.45 to +0.45. Padding holds garbage on purpose.
    let lp: Vec<f64> = (0..b * t)
        .map(|i| {
            if mask[i] {
                old[i] + 0.45 * ((i * 7 % 11) as f64 / 5.0 - 1.0)
            } else {
                f64::NAN
            }
        })
        .collect();
    let inp = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &token_adv,
        tokens,
    };
    println!("\none clipped step on group 3 (token-mean aggregation)\n");
    for (name, cfg) in [
        ("DAPO clip-higher [0.8, 1.28]", PpoClipConfig::dapo()),
        ("ATR-GRPO KL3 δ = 0.05", PpoClipConfig::atr_kl3(0.05)?),
    ] {
        let (mut value, mut grad, mut weight) =
            (vec![0.0; b * t], vec![0.0; b * t], vec![0.0; b * t]);
        let diag = ppo_clip(&cfg, &inp, &mut value, &mut grad)?;
        let loss = aggregate(&AggConfig::default(), tokens, &value, &mut weight)?;
        scale_gradients(tokens, &weight, LossLevel::Token, &mut grad)?;
        let gnorm = grad.iter().map(|g| g * g).sum::<f64>().sqrt();
        println!(
            "{name:<30} bounds [{:.5}, {:.5}]  loss {loss:+.5}  |∇lp| {gnorm:.5}  clipped low {:.3} high {:.3}",
            cfg.bounds.lo,
            cfg.bounds.hi,
            diag.clip_frac_low(),
            diag.clip_frac_high()
        );
    }
    Ok(())
}
