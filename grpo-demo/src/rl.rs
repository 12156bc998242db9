//! The demo's only contact with the GRPO math: every formula below is a call into `grpo-core`
//! (advantages, group filters, per-token policy losses, aggregation weights) or `grpo-cpu`
//! (fused vocabulary kernels). This module only adapts buffers: it broadcasts per-sample
//! advantages to tokens and multiplies the library's per-token dL/dlp by the library's
//! aggregation weight.

use std::fmt;

use grpo_core::advantage::filter::{DynamicSamplingConfig, dynamic_sampling_keep};
use grpo_core::advantage::zscore::{ZScoreConfig, zscore};
use grpo_core::aggregate::{AggConfig, AggMode, aggregate, scale_gradients};
use grpo_core::divergence::RatioBounds;
use grpo_core::loss::{
    CispoConfig, CispoWeight, GspoConfig, PolicyInputs, PpoClipConfig, cispo, gspo, ppo_clip,
};
use grpo_core::vocab::{GradTerms, LseState};
use grpo_core::{Groups, Preset, Tokens};
use grpo_cpu::Cpu;

/// The `--loss` recipes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LossKind {
    /// GRPO: z-score advantages, symmetric clip ε = 0.2, seq-mean-token-mean, all groups.
    Grpo,
    /// DAPO: z-score advantages, clip-higher [0.8, 1.28], token-mean, dynamic sampling.
    Dapo,
    /// Dr.GRPO: A = s − μ (no std), symmetric clip 0.2, seq-mean-token-sum-norm, dynamic
    /// sampling (without it, at the low success rates after warm-up most groups carry no signal
    /// and 150 steps improved held-out accuracy far less; seed 0 on the Intel host of README's
    /// first table: 7.8 % → 11.0 %, against 25.0 %).
    DrGrpo,
    /// ATR-GRPO: z-score, PPO-clip with the KL3 trust region ρ − 1 − ln ρ ≤ δ (δ = 0.05),
    /// token-mean, dynamic sampling.
    AtrKl3,
    /// GSPO: sequence-level geometric-mean ratio, clip [1 − 3e-4, 1 + 4e-4], seq-mean, dynamic sampling.
    Gspo,
    /// CISPO: −sg(clamp(ρ, 0.8, 1.28))·A·lp (verl form), token-mean, dynamic sampling.
    Cispo,
}

impl fmt::Display for LossKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            LossKind::Grpo => "grpo",
            LossKind::Dapo => "dapo",
            LossKind::DrGrpo => "dr-grpo",
            LossKind::AtrKl3 => "atr-kl3",
            LossKind::Gspo => "gspo",
            LossKind::Cispo => "cispo",
        };
        f.write_str(s)
    }
}

impl LossKind {
    /// Whether the recipe drops groups whose rewards are all equal and samples more (DAPO
    /// dynamic sampling): every recipe but plain `grpo`.
    pub fn dynamic_sampling(self) -> bool {
        !matches!(self, LossKind::Grpo)
    }
}

/// Errors of the library calls (invalid shapes or non-finite values would be demo bugs).
pub type Result<T> = std::result::Result<T, grpo_core::Error>;

/// Per-sample advantages for uniform groups of `group_size`: grpo-core's z-score
/// (`(s − μ_g)/(σ_g + 1e-6)`, unbiased σ) or, for Dr.GRPO, its `Scale::None` form `s − μ_g`.
pub fn advantages(
    kind: LossKind,
    scores: &[f32],
    group_size: usize,
    out: &mut [f32],
) -> Result<()> {
    let cfg = match kind {
        LossKind::DrGrpo => ZScoreConfig::dr_grpo(),
        _ => ZScoreConfig::default(),
    };
    zscore(scores, Groups::Uniform(group_size), &cfg, out)?;
    Ok(())
}

/// DAPO dynamic-sampling keep mask per group (grpo-core: keep iff the group's rewards differ).
pub fn keep_groups(scores: &[f32], group_size: usize, keep: &mut [bool]) -> Result<usize> {
    dynamic_sampling_keep(
        scores,
        Groups::Uniform(group_size),
        &DynamicSamplingConfig::default(),
        keep,
    )
}

/// What one policy-loss evaluation reports.
#[derive(Debug, Clone, Copy, Default)]
pub struct LossStats {
    /// Aggregated loss value.
    pub loss: f64,
    /// Fraction of valid tokens whose gradient the clip removed (for CISPO: whose weight the
    /// clamp changed; for GSPO: tokens of clipped sequences).
    pub clip_frac: f64,
}

/// The aggregation each recipe uses.
fn agg_config(kind: LossKind, seq_len: usize) -> AggConfig<f32> {
    let mode = match kind {
        LossKind::Grpo | LossKind::Gspo => AggMode::SeqMeanTokenMean,
        LossKind::DrGrpo => AggMode::SeqMeanTokenSumNorm {
            max_len: Some(seq_len),
            divide_by_batch: true,
        },
        LossKind::Dapo | LossKind::AtrKl3 | LossKind::Cispo => AggMode::TokenMean {
            global_tokens: None,
        },
    };
    AggConfig::from_preset(Preset::Paper, mode)
}

/// Per-token policy loss of the recipe (grpo-core), then its aggregation (grpo-core): writes
/// `g_lp[t] = ∂(aggregated loss)/∂lp_t` for `lp.len() / seq_len` sequences of `seq_len` valid
/// tokens, and the aggregation's per-token weights to `agg_weights` (so that other per-token
/// terms, the entropy bonus, are aggregated the same way). `adv` is per sequence; it is
/// broadcast to the sequence's tokens here.
pub fn policy_loss_grad(
    kind: LossKind,
    lp: &[f32],
    old: &[f32],
    adv: &[f32],
    seq_len: usize,
    g_lp: &mut [f32],
    agg_weights: &mut [f32],
) -> Result<LossStats> {
    let n = lp.len();
    let tokens = Tokens::padded(n / seq_len, seq_len, None);
    let adv_tok: Vec<f32> = adv
        .iter()
        .flat_map(|&a| std::iter::repeat_n(a, seq_len))
        .collect();
    let inp = PolicyInputs {
        lp,
        old,
        adv: &adv_tok,
        tokens,
    };
    let mut value = vec![0f32; n];
    let diag = match kind {
        LossKind::Grpo | LossKind::DrGrpo => {
            ppo_clip(&PpoClipConfig::default(), &inp, &mut value, g_lp)?
        }
        LossKind::Dapo => ppo_clip(&PpoClipConfig::dapo(), &inp, &mut value, g_lp)?,
        LossKind::AtrKl3 => ppo_clip(&PpoClipConfig::atr_kl3(ATR_DELTA)?, &inp, &mut value, g_lp)?,
        LossKind::Gspo => gspo(&GspoConfig::default(), &inp, &mut value, g_lp)?,
        LossKind::Cispo => {
            let cfg = CispoConfig {
                weight: CispoWeight::Clamp(RatioBounds::asymmetric(0.2, 0.28)?),
                ..CispoConfig::default()
            };
            cispo(&cfg, &inp, &mut value, g_lp)?
        }
    };
    let loss = aggregate(&agg_config(kind, seq_len), tokens, &value, agg_weights)?;
    scale_gradients(tokens, agg_weights, diag.level, g_lp)?;
    Ok(LossStats {
        loss: loss as f64,
        clip_frac: (diag.clipped_low + diag.clipped_high) as f64 / diag.tokens.max(1) as f64,
    })
}

/// ATR-GRPO's KL3 trust-region bound δ: ρ − 1 − ln ρ ≤ δ ⇔ ρ ∈ [0.71619, 1.35040].
pub const ATR_DELTA: f32 = 0.05;

/// Fused vocabulary forward (grpo-cpu: SIMD + rayon rows, bit-identical to grpo-core's
/// `logprob_entropy_rows_saved` for every backend and thread count) over `targets.len()` logit
/// rows of width `vocab`: `lp[r] = log softmax(z_r)[y_r]` and `ent[r] = H(softmax(z_r))`,
/// temperature 1, and each row's softmax state in `saved` for [`vocab_backward`].
pub fn vocab_forward(
    cpu: &Cpu,
    logits: &[f32],
    vocab: usize,
    targets: &[u32],
    lp: &mut [f32],
    ent: &mut [f32],
    saved: &mut [LseState],
) -> Result<()> {
    cpu.logprob_entropy_rows_saved(logits, vocab, targets, 1.0, lp, Some(ent), saved)
}

/// Fused vocabulary backward (grpo-cpu, bit-identical to grpo-core's `backward_rows_saved`,
/// and so to `backward_rows`): `dlogits[r, v] = g_lp[r]·∂lp_r/∂z_{r,v} + g_h[r]·∂H_r/∂z_{r,v}`,
/// the chain rule from per-row loss gradients to the logits, from the row states
/// [`vocab_forward`] saved for these logits (one pass over them instead of two).
pub fn vocab_backward(
    cpu: &Cpu,
    logits: &[f32],
    vocab: usize,
    saved: &[LseState],
    targets: &[u32],
    g_lp: &[f32],
    g_h: &[f32],
    dlogits: &mut [f32],
) -> Result<()> {
    let terms: GradTerms<'_, u32> = GradTerms {
        logp: Some((targets, g_lp)),
        entropy: Some(g_h),
        kl: None,
    };
    cpu.backward_rows_saved(logits, vocab, 1.0, saved, &terms, dlogits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advantages_and_filter_match_hand_values() {
        // Group (1, 0, 0, 0): μ = 0.25, σ_unb = sqrt((0.75² + 3·0.25²)/3) = sqrt(0.25) = 0.5,
        // so z = 0.75/(0.5 + 1e-6) and −0.25/(0.5 + 1e-6); Dr.GRPO: 0.75, −0.25.
        // Group (1, 1, 1, 1): all equal → 0 and dropped by dynamic sampling.
        let scores = [1.0f32, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let mut adv = [9.0f32; 8];
        advantages(LossKind::Dapo, &scores, 4, &mut adv).unwrap();
        assert!((adv[0] - 0.75 / 0.500001).abs() < 1e-6 && (adv[1] + 0.25 / 0.500001).abs() < 1e-6);
        assert_eq!(&adv[4..], &[0.0; 4]);
        advantages(LossKind::DrGrpo, &scores, 4, &mut adv).unwrap();
        // (f32 Welford mean: within an ulp of the exact values)
        assert!((adv[0] - 0.75).abs() < 1e-6 && (adv[1] + 0.25).abs() < 1e-6);
        let mut keep = [false; 2];
        assert_eq!(keep_groups(&scores, 4, &mut keep).unwrap(), 1);
        assert_eq!(keep, [true, false]);
    }

    #[test]
    fn on_policy_gradient_is_minus_advantage_times_aggregation_weight() {
        // lp = old ⇒ ρ = 1 inside every clip: ∂L_t/∂lp_t = −A (PPO-clip and CISPO alike, and for
        // GSPO ∂L_i/∂lp_t = −A·s/n with s = 1 at sequence level). Two sequences of 2 tokens,
        // A = (1, −2):
        // - token-mean (dapo, atr-kl3, cispo): w = 1/4 → g = (−1/4, −1/4, 1/2, 1/2);
        // - seq-mean-token-mean (grpo): w = 1/(2·2) = 1/4 → the same;
        // - seq-mean-token-sum-norm with L = 2 (dr-grpo): w = 1/(2·2) → the same;
        // - gspo: grad −A/2 per token × sequence weight mass 1/2 → the same.
        let lp = [-0.5f32, -1.0, -2.0, -0.1];
        let adv = [1.0f32, -2.0];
        for kind in [
            LossKind::Grpo,
            LossKind::Dapo,
            LossKind::DrGrpo,
            LossKind::AtrKl3,
            LossKind::Gspo,
            LossKind::Cispo,
        ] {
            let (mut g, mut w) = ([0f32; 4], [0f32; 4]);
            let st = policy_loss_grad(kind, &lp, &lp, &adv, 2, &mut g, &mut w).unwrap();
            assert_eq!(g, [-0.25, -0.25, 0.5, 0.5], "{kind}");
            // The aggregation weights: 1/4 per token in every recipe here.
            assert_eq!(w, [0.25; 4], "{kind}");
            assert_eq!(st.clip_frac, 0.0, "{kind}");
        }
        // Off-policy, DAPO clip-higher: ρ = e^{0.5} ≈ 1.65 > 1.28 with A > 0 → no gradient,
        // counted as clipped; the A < 0 tokens stay on-policy.
        let old = [-1.0f32, -1.5, -2.0, -0.1];
        let (mut g, mut w) = ([0f32; 4], [0f32; 4]);
        let st = policy_loss_grad(LossKind::Dapo, &lp, &old, &adv, 2, &mut g, &mut w).unwrap();
        assert_eq!(g, [0.0, 0.0, 0.5, 0.5]);
        assert_eq!(st.clip_frac, 0.5);
    }

    #[test]
    fn vocab_kernels_on_a_uniform_row() {
        // Row of 4 equal logits: lp = −ln 4, H = ln 4; ∂lp(y)/∂z_v = 1[v = y] − 1/4, ∂H/∂z = 0.
        let cpu = Cpu::detect();
        let z = [0.5f32; 4];
        let (mut lp, mut h, mut saved) = ([0f32], [0f32], [LseState::EMPTY]);
        vocab_forward(&cpu, &z, 4, &[2], &mut lp, &mut h, &mut saved).unwrap();
        assert!((lp[0] + 4f32.ln()).abs() < 1e-6 && (h[0] - 4f32.ln()).abs() < 1e-6);
        let mut d = [0f32; 4];
        vocab_backward(&cpu, &z, 4, &saved, &[2], &[2.0], &[1.0], &mut d).unwrap();
        for (v, dv) in d.iter().enumerate() {
            let want = 2.0 * (if v == 2 { 0.75 } else { -0.25 });
            assert!((dv - want).abs() < 1e-6, "{v}: {dv}");
        }
    }
}
