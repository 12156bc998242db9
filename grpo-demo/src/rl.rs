//! The demo's only contact with the GRPO math: every formula below is a call into `grpo-core`
//! (advantages, group filters, per-token policy losses, aggregation weights) or `grpo-cpu`
//! (fused vocabulary kernels). This module only adapts buffers: it broadcasts per-sample
//! advantages to tokens and multiplies the library's per-token dL/dlp by the library's
//! aggregation weight.

use std::fmt;

/// The `--loss` recipes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LossKind {
    /// GRPO: z-score advantages, symmetric clip ε = 0.2, seq-mean-token-mean, all groups.
    Grpo,
    /// DAPO: z-score advantages, clip-higher [0.8, 1.28], token-mean, dynamic sampling.
    Dapo,
    /// Dr.GRPO: A = s − μ (no std), symmetric clip 0.2, seq-mean-token-sum-norm, all groups.
    DrGrpo,
    /// ATR-GRPO: z-score, KL3 trust region ρ − 1 − ln ρ ≤ δ (δ = 0.05), token-mean, dynamic sampling.
    AtrKl3,
    /// GSPO: sequence-level geometric-mean ratio, clip [1 − 3e-4, 1 + 4e-4], seq-mean, dynamic sampling.
    Gspo,
    /// CISPO: −sg(clamp(ρ, 0, 1 + 0.28))·A·lp (verl form, ε_low = 1 i.e. no lower clip is not
    /// allowed by the bounds type, so ε_low = 0.999), token-mean, dynamic sampling.
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
    /// Whether the recipe drops groups whose rewards are all equal (DAPO dynamic sampling).
    pub fn dynamic_sampling(self) -> bool {
        !matches!(self, LossKind::Grpo | LossKind::DrGrpo)
    }
}

/// Per-sample advantages for uniform groups of `group_size` (library estimator per recipe).
pub fn advantages(kind: LossKind, scores: &[f32], group_size: usize, out: &mut [f32]) {
    // TEMP(adv-a): replaced by grpo_core::advantage calls when the branch lands.
    for (s, a) in scores.chunks(group_size).zip(out.chunks_mut(group_size)) {
        let n = s.len() as f32;
        let mu = s.iter().sum::<f32>() / n;
        let var = s.iter().map(|x| (x - mu) * (x - mu)).sum::<f32>() / (n - 1.0).max(1.0);
        for (x, y) in s.iter().zip(a.iter_mut()) {
            *y = match kind {
                LossKind::DrGrpo => x - mu,
                _ => (x - mu) / (var.sqrt() + 1e-6),
            };
        }
    }
}

/// DAPO dynamic-sampling keep mask per group (keep iff the group's rewards are not all equal).
pub fn keep_groups(scores: &[f32], group_size: usize, keep: &mut [bool]) {
    // TEMP(adv-b): replaced by the grpo_core filter when the branch lands.
    for (s, k) in scores.chunks(group_size).zip(keep.iter_mut()) {
        *k = s.iter().any(|&x| x != s[0]);
    }
}

/// What one policy-loss evaluation reports.
#[derive(Debug, Clone, Copy, Default)]
pub struct LossStats {
    /// Aggregated loss value.
    pub loss: f64,
    /// Fraction of valid tokens (or sequences, for GSPO) whose gradient the clip removed.
    pub clip_frac: f64,
}

/// Per-token gradient of the aggregated policy loss w.r.t. lp, for `n_seq` sequences of
/// `seq_len` tokens each (all valid). `adv` is per sequence.
pub fn policy_loss_grad(
    kind: LossKind,
    lp: &[f32],
    old: &[f32],
    adv: &[f32],
    seq_len: usize,
    g_lp: &mut [f32],
) -> LossStats {
    // TEMP(loss, div): replaced by grpo_core::loss / aggregate calls when the branches land.
    let n_tok = lp.len();
    let (lo, hi) = match kind {
        LossKind::Grpo | LossKind::DrGrpo => (0.8f32, 1.2f32),
        LossKind::Dapo => (0.8, 1.28),
        LossKind::AtrKl3 => (0.71619, 1.35040),
        LossKind::Gspo => (1.0 - 3e-4, 1.0 + 4e-4),
        LossKind::Cispo => (0.001, 1.28),
    };
    let mut loss = 0.0f64;
    let mut clipped = 0usize;
    let w = 1.0 / n_tok as f32; // all sequences have the same length: every mode is token-mean
    if kind == LossKind::Gspo {
        for (i, a) in adv.iter().enumerate() {
            let r = i * seq_len..(i + 1) * seq_len;
            let mx: f32 = r.clone().map(|t| lp[t] - old[t]).sum::<f32>() / seq_len as f32;
            let s = mx.exp();
            let off = (*a > 0.0 && s > hi) || (*a < 0.0 && s < lo);
            let cs = s.clamp(lo, hi);
            loss -= ((s * a).min(cs * a) / adv.len() as f32) as f64;
            clipped += usize::from(off);
            for t in r {
                g_lp[t] = if off { 0.0 } else { -a * s / seq_len as f32 / adv.len() as f32 };
            }
        }
        return LossStats {
            loss,
            clip_frac: clipped as f64 / adv.len() as f64,
        };
    }
    for t in 0..n_tok {
        let a = adv[t / seq_len];
        let rho = (lp[t] - old[t]).clamp(-20.0, 20.0).exp();
        let off = (a > 0.0 && rho > hi) || (a < 0.0 && rho < lo);
        clipped += usize::from(off);
        if kind == LossKind::Cispo {
            let c = rho.clamp(lo, hi);
            loss -= (c * a * lp[t] * w) as f64;
            g_lp[t] = -c * a * w;
        } else {
            loss -= ((rho * a).min(rho.clamp(lo, hi) * a) * w) as f64;
            g_lp[t] = if off { 0.0 } else { -a * rho * w };
        }
    }
    LossStats {
        loss,
        clip_frac: clipped as f64 / n_tok as f64,
    }
}

/// Fused vocabulary forward over `rows` logit rows of width `vocab`: log-prob of each target
/// and entropy of each row.
pub fn vocab_forward(logits: &[f32], vocab: usize, targets: &[u32], lp: &mut [f32], ent: &mut [f32]) {
    // TEMP(vocab, vocab-cpu): replaced by the fused kernels when the branches land.
    for (r, z) in logits.chunks(vocab).enumerate() {
        let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let s: f32 = z.iter().map(|v| (v - m).exp()).sum();
        let lse = m + s.ln();
        lp[r] = z[targets[r] as usize] - lse;
        ent[r] = lse - z.iter().map(|v| (v - lse).exp() * v).sum::<f32>();
    }
}

/// Fused vocabulary backward: `dlogits = g_lp·∂lp/∂z + g_h·∂H/∂z` per row.
pub fn vocab_backward(
    logits: &[f32],
    vocab: usize,
    targets: &[u32],
    g_lp: &[f32],
    g_h: &[f32],
    dlogits: &mut [f32],
) {
    // TEMP(vocab, vocab-cpu): replaced by the fused kernels when the branches land.
    for (r, (z, d)) in logits.chunks(vocab).zip(dlogits.chunks_mut(vocab)).enumerate() {
        let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let s: f32 = z.iter().map(|v| (v - m).exp()).sum();
        let lse = m + s.ln();
        let h = lse - z.iter().map(|v| (v - lse).exp() * v).sum::<f32>();
        for (v, (zv, dv)) in z.iter().zip(d.iter_mut()).enumerate() {
            let lpv = zv - lse;
            let p = lpv.exp();
            let onehot = if v == targets[r] as usize { 1.0 } else { 0.0 };
            *dv = g_lp[r] * (onehot - p) - g_h[r] * p * (lpv + h);
        }
    }
}
