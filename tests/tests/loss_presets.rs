//! Hand-computed values for every preset difference of the losses and aggregations, extreme
//! inputs (|lp − old| up to 1000, garbage in padding, A = 0 with an overflowing ratio), and
//! bad input (Err with every output untouched).

use grpo_core::aggregate::{AggConfig, AggMode, Denominator, SeqCount, aggregate};
use grpo_core::divergence::RatioBounds;
use grpo_core::loss::*;
use grpo_core::{Error, Preset, Tokens};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * (1.0 + a.abs().max(b.abs()))
}

/// One padded row from (lp, old, adv).
struct Row {
    lp: Vec<f64>,
    old: Vec<f64>,
    adv: Vec<f64>,
}

impl Row {
    fn new(lp: &[f64], old: &[f64], adv: &[f64]) -> Row {
        Row {
            lp: lp.to_vec(),
            old: old.to_vec(),
            adv: adv.to_vec(),
        }
    }
    /// lp = x, old = 0.
    fn from_x(x: &[f64], adv: &[f64]) -> Row {
        Row::new(x, &vec![0.0; x.len()], adv)
    }
    fn inp(&self) -> PolicyInputs<'_, f64> {
        PolicyInputs {
            lp: &self.lp,
            old: &self.old,
            adv: &self.adv,
            tokens: Tokens::padded(1, self.lp.len(), None),
        }
    }
}

type LossFn<'a> = dyn Fn(&PolicyInputs<'_, f64>, &mut [f64], &mut [f64]) -> grpo_core::Result<LossDiagnostics<f64>>
    + 'a;

fn eval(r: &Row, f: &LossFn<'_>) -> (Vec<f64>, Vec<f64>, LossDiagnostics<f64>) {
    let n = r.lp.len();
    let (mut v, mut g) = (vec![0.0; n], vec![0.0; n]);
    let d = f(&r.inp(), &mut v, &mut g).unwrap();
    (v, g, d)
}

// ---------------- preset differences ----------------

#[test]
fn cispo_trl_cap_is_absolute() {
    // ρ = 1.5 (x = ln 1.5), A = 2, lp = −1 (old = −1 − ln 1.5).
    let r = Row::new(&[-1.0], &[-1.0 - 1.5f64.ln()], &[2.0]);
    // verl: w = clamp(1.5, 0.8, 1.2) = 1.2 → L = −1.2·2·(−1) = 2.4, ∂L/∂lp = −1.2·2 = −2.4.
    let cfg = CispoConfig::from_preset(Preset::Verl);
    let (v, g, d) = eval(&r, &move |i, v, g| cispo(&cfg, i, v, g));
    assert!(close(v[0], 2.4) && close(g[0], -2.4));
    assert_eq!(d.clipped_high, 1);
    // TRL default: epsilon_high unset → cap ε = 0.2 *absolute*: w = min(1.5, 0.2) = 0.2 →
    // L = −0.2·2·(−1) = 0.4, ∂L/∂lp = −0.4.
    let cfg = CispoConfig::from_preset(Preset::Trl);
    let (v, g, _) = eval(&r, &move |i, v, g| cispo(&cfg, i, v, g));
    assert!(close(v[0], 0.4) && close(g[0], -0.4));
    // TRL with epsilon_high = 5: w = min(1.5, 5) = 1.5 → L = 3, ∂L/∂lp = −3.
    let cfg = CispoConfig::trl(0.2, Some(5.0));
    let (v, g, d) = eval(&r, &move |i, v, g| cispo(&cfg, i, v, g));
    assert!(close(v[0], 3.0) && close(g[0], -3.0));
    assert_eq!(d.clipped_high, 0);
}

#[test]
fn verl_dual_clip_is_always_on() {
    // x = 2 → ρ = e² ≈ 7.389056, A = −1.
    let r = Row::from_x(&[2.0], &[-1.0]);
    // verl: min(−c·A, max(−ρA, −clip(ρ)A)) = min(3, max(7.389, 1.2)) = 3, gradient 0.
    let cfg = PpoClipConfig::from_preset(Preset::Verl);
    let (v, g, d) = eval(&r, &move |i, v, g| ppo_clip(&cfg, i, v, g));
    assert_eq!((v[0], g[0], d.dual_clipped), (3.0, 0.0, 1));
    // Paper / OpenRLHF (no dual-clip): L = −min(ρA, 1.2A) = ρ = e², ∂L/∂lp = −A·ρ = e².
    for p in [Preset::Paper, Preset::OpenRlhf] {
        let cfg = PpoClipConfig::from_preset(p);
        let (v, g, d) = eval(&r, &move |i, v, g| ppo_clip(&cfg, i, v, g));
        assert!(close(v[0], 2f64.exp()) && close(g[0], 2f64.exp()));
        assert_eq!(d.dual_clipped, 0);
    }
}

#[test]
fn trl_has_no_log_ratio_clamp() {
    // x = 25, A = −1 (unclipped branch wins for A < 0 above hi).
    let r = Row::from_x(&[25.0], &[-1.0]);
    // Paper (clamp 20): ρ = e^20 = 485165195.40979…, L = ρ, gradient 0 (clamped).
    let cfg = PpoClipConfig::from_preset(Preset::Paper);
    let (v, g, d) = eval(&r, &move |i, v, g| ppo_clip(&cfg, i, v, g));
    assert!(close(v[0], 485165195.4097903) && g[0] == 0.0);
    assert_eq!(d.clamped, 1);
    // TRL: ρ = e^25 = 72004899337.38588, L = ρ, ∂L/∂lp = −A·ρ = ρ.
    let cfg = PpoClipConfig::from_preset(Preset::Trl);
    let (v, g, d) = eval(&r, &move |i, v, g| ppo_clip(&cfg, i, v, g));
    assert!(close(v[0], 72004899337.38588) && close(g[0], 72004899337.38588));
    assert_eq!(d.clamped, 0);
}

#[test]
fn trl_delta_cap() {
    // δ = 2, ρ = 3 (x = ln 3), A = −1: TRL: −min(min(3, 2)·(−1), 1.2·(−1)) = 2, gradient 0;
    // without the cap: L = 3, ∂L/∂lp = 3.
    let r = Row::from_x(&[3f64.ln()], &[-1.0]);
    let cfg = PpoClipConfig {
        delta_cap: Some(2.0),
        ..PpoClipConfig::from_preset(Preset::Trl)
    };
    let (v, g, d) = eval(&r, &move |i, v, g| ppo_clip(&cfg, i, v, g));
    assert!(close(v[0], 2.0) && g[0] == 0.0 && d.delta_capped == 1);
    let cfg = PpoClipConfig::from_preset(Preset::Trl);
    let (v, g, _) = eval(&r, &move |i, v, g| ppo_clip(&cfg, i, v, g));
    assert!(close(v[0], 3.0) && close(g[0], 3.0));
}

#[test]
fn atr_grpo_kl3_bounds() {
    // KL3 δ = 0.05 bounds [0.71619, 1.35040]: ρ = 1.3 is inside (symmetric ε = 0.2 would clip).
    // A = 1: KL3: L = −1.3, ∂L/∂lp = −1.3; symmetric: L = −1.2, gradient 0.
    let r = Row::from_x(&[1.3f64.ln()], &[1.0]);
    let kl3 = PpoClipConfig {
        bounds: RatioBounds::new(0.71619, 1.35040).unwrap(),
        ..Default::default()
    };
    let (v, g, _) = eval(&r, &move |i, v, g| ppo_clip(&kl3, i, v, g));
    assert!(close(v[0], -1.3) && close(g[0], -1.3));
    let sym = PpoClipConfig::default();
    let (v, g, _) = eval(&r, &move |i, v, g| ppo_clip(&sym, i, v, g));
    assert!(close(v[0], -1.2) && g[0] == 0.0);
    // ρ = 0.75, A = −1: inside KL3 (≥ 0.71619) → L = 0.75, ∂ = 0.75; symmetric clips at 0.8 →
    // L = 0.8, gradient 0.
    let r = Row::from_x(&[0.75f64.ln()], &[-1.0]);
    let (v, g, _) = eval(&r, &move |i, v, g| ppo_clip(&kl3, i, v, g));
    assert!(close(v[0], 0.75) && close(g[0], 0.75));
    let (v, g, d) = eval(&r, &move |i, v, g| ppo_clip(&sym, i, v, g));
    assert!(close(v[0], 0.8) && g[0] == 0.0 && d.clipped_low == 1);
}

#[test]
fn dapo_clip_higher() {
    // ρ = 1.25, A = 1: DAPO [0.8, 1.28] keeps it (L = −1.25, ∂ = −1.25).
    let r = Row::from_x(&[1.25f64.ln()], &[1.0]);
    let cfg = PpoClipConfig::dapo();
    let (v, g, _) = eval(&r, &move |i, v, g| ppo_clip(&cfg, i, v, g));
    assert!(close(v[0], -1.25) && close(g[0], -1.25));
}

#[test]
fn gspo_token_clamps_at_10() {
    // Mean log-ratio (14 + 10)/2 = 12 > 10: verl r = e^10 = 22026.465794806718 for both tokens,
    // A = −1 → L = r, gradient 0 (the clamp); without the cap r = e^12 = 162754.79141900392,
    // ∂L/∂lp_t = −A·r = e^12.
    let r = Row::from_x(&[14.0, 10.0], &[-1.0, -1.0]);
    let cfg = GspoTokenConfig::from_preset(Preset::Verl);
    let (v, g, d) = eval(&r, &move |i, v, g| gspo_token(&cfg, i, v, g));
    assert!(close(v[0], 22026.465794806718) && close(v[1], 22026.465794806718));
    assert_eq!((g[0], g[1], d.clamped), (0.0, 0.0, 2));
    let cfg = GspoTokenConfig {
        seq_log_ratio_max: None,
        ..cfg
    };
    let (v, g, _) = eval(&r, &move |i, v, g| gspo_token(&cfg, i, v, g));
    assert!(close(v[1], 162754.79141900392) && close(g[1], 162754.79141900392));
}

#[test]
fn gspo_sequence_trl_vs_default_clamp() {
    // Mean log-ratio 25 (one token), A = −1, GSPO bounds [1 − 3e-4, 1 + 4e-4]:
    // default clamps the mean to 20 → L = e^20, gradient 0; TRL → L = e^25, ∂ = e^25/1.
    let r = Row::from_x(&[25.0], &[-1.0]);
    let cfg = GspoConfig::from_preset(Preset::Paper);
    let (v, g, d) = eval(&r, &move |i, v, g| gspo(&cfg, i, v, g));
    assert!(close(v[0], 485165195.4097903) && g[0] == 0.0 && d.clamped == 1);
    let cfg = GspoConfig::from_preset(Preset::Trl);
    let (v, g, _) = eval(&r, &move |i, v, g| gspo(&cfg, i, v, g));
    assert!(close(v[0], 72004899337.38588) && close(g[0], 72004899337.38588));
}

#[test]
fn gmpo_verl_mean_eps() {
    // x = (0.1, 0.3), A = (1, 1); verl: S = 0.4/(2 + 1e-8), Ā = 2/(2 + 1e-8),
    // L = −Ā·e^S, ∂L/∂lp_t = L/(2 + 1e-8). Paper: S = 0.2, Ā = 1, L = −e^{0.2}.
    let r = Row::from_x(&[0.1, 0.3], &[1.0, 1.0]);
    let den = 2.0f64 + 1e-8;
    let want = -(2.0 / den) * (0.4 / den).exp();
    let cfg = GmpoConfig::from_preset(Preset::Verl);
    let (v, g, _) = eval(&r, &move |i, v, g| gmpo(&cfg, i, v, g));
    assert!(close(v[0], want) && close(g[1], want / den));
    let cfg = GmpoConfig::from_preset(Preset::Paper);
    let (v, g, _) = eval(&r, &move |i, v, g| gmpo(&cfg, i, v, g));
    assert!(close(v[0], -(0.2f64.exp())) && close(g[0], -(0.2f64.exp()) / 2.0));
}

#[test]
fn sapo_temperatures() {
    // ρ = 1.5, A = −1 → τ_neg = 1.05: z = 1.05·0.5 = 0.525, σ = 1/(1 + e^{−0.525}),
    // L = −σ·(4/1.05)·(−1) = σ·3.8095238…, ∂ = −4·A·σ(1−σ)·ρ = 6·σ(1−σ).
    // A = +1 → τ_pos = 1: z = 0.5, L = −4σ(0.5), ∂ = −4·σ(1−σ)·1.5.
    let r = Row::from_x(&[1.5f64.ln(), 1.5f64.ln()], &[-1.0, 1.0]);
    let cfg = SapoConfig::from_preset(Preset::Trl);
    let (v, g, _) = eval(&r, &move |i, v, g| sapo(&cfg, i, v, g));
    let s1 = 1.0 / (1.0 + (-0.525f64).exp());
    let s2 = 1.0 / (1.0 + (-0.5f64).exp());
    assert!(close(v[0], s1 * 4.0 / 1.05) && close(g[0], 6.0 * s1 * (1.0 - s1)));
    assert!(close(v[1], -4.0 * s2) && close(g[1], -6.0 * s2 * (1.0 - s2)));
}

#[test]
fn gspo_takes_each_tokens_advantage_as_openrlhf() {
    // One sequence, x = (0.5, 0.5): s = e^0.5 ≈ 1.6487, above hi = 1 + 4e-4. A = (1, −1):
    // token 0's term −min(s, hi) = −hi (clipped, no gradient), token 1's −min(−s, −hi) = s
    // (∂/∂x̄ = s). L = (s − hi)/2 ≈ 0.3242, ∂L/∂lp_t = (s/2)/2 ≈ 0.412 on both tokens
    // (OpenRLHF's PolicyLoss). The mean advantage (0) would give 0 and 0.
    let r = Row::from_x(&[0.5, 0.5], &[1.0, -1.0]);
    let cfg = GspoConfig::from_preset(Preset::OpenRlhf);
    let (v, g, d) = eval(&r, &move |i, v, g| gspo(&cfg, i, v, g));
    let (s, hi) = (0.5f64.exp(), 1.0 + 4e-4);
    for t in 0..2 {
        assert!(close(v[t], (s - hi) / 2.0), "{v:?}");
        assert!(close(g[t], s / 4.0), "{g:?}");
    }
    // Token 0's own term is clipped (A > 0 above hi); token 1's is not.
    assert_eq!((d.clipped_high, d.clipped_low), (1, 0));
    // A shared advantage gives the term itself: A = (−1, −1), L = s, ∂ = s/2.
    let r = Row::from_x(&[0.5, 0.5], &[-1.0, -1.0]);
    let (v, g, _) = eval(&r, &move |i, v, g| gspo(&cfg, i, v, g));
    assert!(close(v[0], s) && v[0] == v[1], "{v:?}");
    assert!(close(g[0], s / 2.0) && g[0] == g[1]);
}

#[test]
fn gspo_dual_clip_as_openrlhf() {
    // OpenRLHF's PolicyLoss applies --dual_clip after GSPO's sequence ratio: for A < 0 the
    // term −min(s·A, clip(s)·A) is at most −c·A. One sequence, x = (ln 4, ln 4): s = 4 above
    // hi = 1 + 4e-4 and above c = 3. A = (−2, −2): −min(−8, −2·hi) = 8 > −c·A = 6, so L = 6
    // with no gradient on both tokens; without dual-clip L = 8 and ∂L/∂lp_t = (−A·s)/2 = 4.
    let x = [4f64.ln(), 4f64.ln()];
    let dual = GspoConfig {
        dual_clip: Some(3.0),
        ..GspoConfig::from_preset(Preset::OpenRlhf)
    };
    let plain = GspoConfig::from_preset(Preset::OpenRlhf);
    let r = Row::from_x(&x, &[-2.0, -2.0]);
    let (v, g, d) = eval(&r, &move |i, v, g| gspo(&dual, i, v, g));
    assert_eq!((v, g), (vec![6.0, 6.0], vec![0.0, 0.0]));
    assert_eq!(d.dual_clipped, 2);
    let (v, g, d) = eval(&r, &move |i, v, g| gspo(&plain, i, v, g));
    assert!(close(v[0], 8.0) && close(v[1], 8.0), "{v:?}");
    assert!(close(g[0], 4.0) && close(g[1], 4.0), "{g:?}");
    assert_eq!(d.dual_clipped, 0);
    // Per-token advantages A = (−2, 0.5): token 0's term is the bound 6, token 1's the
    // clipped −0.5·hi (A > 0 above hi); L = (6 − 0.5·hi)/2, no gradient.
    let hi = 1.0 + 4e-4;
    let r = Row::from_x(&x, &[-2.0, 0.5]);
    let (v, g, d) = eval(&r, &move |i, v, g| gspo(&dual, i, v, g));
    assert!(close(v[0], (6.0 - 0.5 * hi) / 2.0) && v[0] == v[1], "{v:?}");
    assert_eq!(g, vec![0.0, 0.0]);
    assert_eq!((d.dual_clipped, d.clipped_high), (1, 1));
    // s = 2.5 < c: the bound −c·A = 6 lies above −s·A = 5, inactive: L = 5, ∂ = 5/2.
    let r = Row::from_x(&[2.5f64.ln(), 2.5f64.ln()], &[-2.0, -2.0]);
    let (v, g, d) = eval(&r, &move |i, v, g| gspo(&dual, i, v, g));
    assert!(close(v[0], 5.0) && close(g[0], 2.5), "{v:?} {g:?}");
    assert_eq!(d.dual_clipped, 0);
}

#[test]
fn p3o_ess_and_loss() {
    // w = (1, 3): ESS = 16/(2·(10 + 1e-8)) = 0.79999999992. Token 1 (ρ = 3, A = 1, lp = ln 3):
    // KL3 = 1/3 − 1 + ln 3, L = −ESS·ln 3 + (1 − ESS)·(ln 3 − 2/3), ∂ = −ESS + (1 − ESS)·2/3.
    let r = Row::from_x(&[0.0, 3f64.ln()], &[1.0, 1.0]);
    let cfg = P3oConfig::default();
    let s = ess_stats(&cfg, &r.inp()).unwrap();
    let ess = 16.0 / (2.0 * (10.0 + 1e-8));
    assert!(close(s.ess(), ess));
    // All-reduce: two halves merged give the same statistic.
    let a = Row::from_x(&[0.0], &[1.0]);
    let b = Row::from_x(&[3f64.ln()], &[1.0]);
    let m = ess_stats(&cfg, &a.inp())
        .unwrap()
        .merge(ess_stats(&cfg, &b.inp()).unwrap());
    assert!(close(m.ess(), ess));
    let e = s.ess();
    let (v, g, _) = eval(&r, &move |i, v, g| p3o(&cfg, i, e, v, g));
    let l3 = 3f64.ln();
    assert!(close(v[1], -ess * l3 + (1.0 - ess) * (l3 - 2.0 / 3.0)));
    assert!(close(g[1], -ess + (1.0 - ess) * 2.0 / 3.0));
    // Token 0 (ρ = 1 > ESS → w = ESS, lp = 0, KL3 = 0): L = 0, ∂ = −ESS.
    assert!(close(v[0], 0.0) && close(g[0], -ess));
    // Below the old policy (ρ = ½, lp = −ln 2, A = 1, ESS = 0.8): w = ½, KL3 = 2 − 1 − ln 2;
    // ∂ = −½ + 0.2·(1 − 2) = −0.7. (KL(old‖θ)'s k3, ρ − 1 − ln ρ, would give −½ + 0.2·(−½).)
    let low = Row::from_x(&[-(2f64.ln())], &[1.0]);
    let (lv, lg, _) = eval(&low, &move |i, v, g| p3o(&cfg, i, 0.8, v, g));
    let l2 = 2f64.ln();
    assert!(close(lv[0], 0.5 * l2 + 0.2 * (1.0 - l2)), "{lv:?}");
    assert!(close(lg[0], -0.7), "{lg:?}");
    // No tokens: ESS = 1.
    let none = [false, false];
    let inp = PolicyInputs {
        tokens: Tokens::padded(1, 2, Some(&none)),
        ..r.inp()
    };
    assert_eq!(ess_stats(&cfg, &inp).unwrap().ess(), 1.0);
}

#[test]
fn seq_mean_token_sum_norm_verl_without_batch_division() {
    // B = 2, width 4; valid values row 0: 1, 2; row 1: 3. Σ = 6.
    // Dr. GRPO / TRL: 6/(2·4) = 0.75, w = 1/8; verl: 6/4 = 1.5, w = 1/4.
    let v = [
        1.0,
        2.0,
        f64::NAN,
        f64::INFINITY,
        3.0,
        f64::NAN,
        f64::NAN,
        f64::NAN,
    ];
    let m = [true, true, false, false, true, false, false, false];
    let tok = Tokens::padded(2, 4, Some(&m));
    let mode = AggMode::SeqMeanTokenSumNorm {
        max_len: None,
        divide_by_batch: true,
    };
    let mut w = [0.0; 8];
    for p in [Preset::Paper, Preset::Trl] {
        assert_eq!(
            aggregate(&AggConfig::from_preset(p, mode), tok, &v, &mut w),
            Ok(0.75)
        );
        assert_eq!(w, [0.125, 0.125, 0.0, 0.0, 0.125, 0.0, 0.0, 0.0]);
    }
    assert_eq!(
        aggregate(&AggConfig::from_preset(Preset::Verl, mode), tok, &v, &mut w),
        Ok(1.5)
    );
    assert_eq!(w, [0.25, 0.25, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0]);
}

#[test]
fn aggregation_denominator_presets() {
    // Row 0: values 1, 3; row 1: empty.
    let v = [1.0, 3.0, f64::NAN, f64::NAN];
    let m = [true, true, false, false];
    let tok = Tokens::padded(2, 2, Some(&m));
    let mut w = [9.0; 4];
    // A mean over every row (torch.mean, strict) refuses the empty row, weights untouched.
    let paper = AggConfig::from_preset(Preset::Paper, AggMode::SeqMeanTokenMean);
    assert_eq!(
        aggregate(&paper, tok, &v, &mut w),
        Err(Error::EmptySegment { segment: 1 })
    );
    assert_eq!(w, [9.0; 4]);
    // verl's agg_loss leaves it out: Σ/(n + 1e-8) = 4/2 on row 0 (the ε is below f32's
    // resolution at 2), seq_mask.sum() = 1 sequence: 2.
    let verl = AggConfig::from_preset(Preset::Verl, AggMode::SeqMeanTokenMean);
    assert_eq!(aggregate(&verl, tok, &v, &mut w), Ok(2.0));
    assert_eq!(w, [0.5, 0.5, 0.0, 0.0]);
    // and its seq-mean-token-sum divides the token sum 4 by that one sequence.
    let verl = AggConfig::from_preset(Preset::Verl, AggMode::SeqMeanTokenSum);
    assert_eq!(aggregate(&verl, tok, &v, &mut w), Ok(4.0));
    // TRL grpo: ((1 + 3)/max(2, 1) + 0/max(0, 1))/2 = 1.
    let trl = AggConfig::from_preset(Preset::Trl, AggMode::SeqMeanTokenMean);
    assert_eq!(aggregate(&trl, tok, &v, &mut w), Ok(1.0));
    assert_eq!(w, [0.25, 0.25, 0.0, 0.0]);
    // verl's masked_mean helper: 4/(2 + 1e-8).
    let orl = AggConfig {
        mode: AggMode::TokenMean {
            global_tokens: None,
        },
        denominator: Denominator::PlusEps(1e-8),
        sequences: SeqCount::All,
    };
    let loss = aggregate(&orl, tok, &v, &mut w).unwrap();
    assert!(close(loss, 4.0 / (2.0 + 1e-8)));
    // token-mean with a global count of 8: 4/8.
    let g = AggConfig {
        mode: AggMode::TokenMean {
            global_tokens: Some(8),
        },
        denominator: Denominator::Strict,
        sequences: SeqCount::All,
    };
    assert_eq!(aggregate(&g, tok, &v, &mut w), Ok(0.5));
}

#[test]
fn luspo_scales_sequence_losses_by_length() {
    // GSPO losses broadcast to tokens: sequence 0 (2 tokens) L = 0.5, sequence 1 (1 token)
    // L = −2: LUSPO = (2·0.5 + 1·(−2))/2 = −0.5; weights 1/B = 0.5, sequence mass n_i/B.
    let v = [0.5, 0.5, -2.0, f64::NAN];
    let m = [true, true, true, false];
    let tok = Tokens::padded(2, 2, Some(&m));
    let mut w = [0.0; 4];
    let cfg = AggConfig::from_preset(Preset::Trl, AggMode::Luspo);
    assert_eq!(aggregate(&cfg, tok, &v, &mut w), Ok(-0.5));
    assert_eq!(w, [0.5, 0.5, 0.5, 0.0]);
}

// ---------------- extreme inputs ----------------

type Runner = Box<
    dyn Fn(
        &PolicyInputs<'_, f64>,
        &mut [f64],
        &mut [f64],
    ) -> grpo_core::Result<LossDiagnostics<f64>>,
>;

fn all_losses(p: Preset) -> Vec<(&'static str, Runner)> {
    let ppo = PpoClipConfig::from_preset(p);
    let gs = GspoConfig::from_preset(p);
    let gt = GspoTokenConfig::from_preset(p);
    let gm = GmpoConfig::from_preset(p);
    let ci = CispoConfig::from_preset(p);
    let sa = SapoConfig::from_preset(p);
    let p3 = P3oConfig::from_preset(p);
    let cc = ClipCovConfig::from_preset(p);
    let kc = KlCovConfig::from_preset(p);
    vec![
        ("ppo", Box::new(move |i, v, g| ppo_clip(&ppo, i, v, g))),
        ("gspo", Box::new(move |i, v, g| gspo(&gs, i, v, g))),
        (
            "gspo_token",
            Box::new(move |i, v, g| gspo_token(&gt, i, v, g)),
        ),
        ("gmpo", Box::new(move |i, v, g| gmpo(&gm, i, v, g))),
        ("cispo", Box::new(move |i, v, g| cispo(&ci, i, v, g))),
        ("sapo", Box::new(move |i, v, g| sapo(&sa, i, v, g))),
        ("p3o", Box::new(move |i, v, g| p3o(&p3, i, 0.5, v, g))),
        ("clip_cov", Box::new(move |i, v, g| clip_cov(&cc, i, v, g))),
        (
            "kl_cov",
            Box::new(
                move |i: &PolicyInputs<'_, f64>, v: &mut [f64], g: &mut [f64]| {
                    let mut s = vec![0.0; i.lp.len()];
                    kl_cov(&kc, i, &mut s, v, g)
                },
            ),
        ),
    ]
}

#[test]
fn extreme_log_ratios_are_finite_with_default_clamps() {
    // |lp − old| up to 1000 with every sign of A, padded garbage, default (clamped) presets.
    let x = [
        1000.0,
        -1000.0,
        1000.0,
        -1000.0,
        1000.0,
        -1000.0,
        300.0,
        f64::NAN,
    ];
    let adv = [1.0, 1.0, -1.0, -1.0, 0.0, 0.0, -3.0, f64::INFINITY];
    let m = [true, true, true, true, true, true, true, false];
    let old = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, f64::NEG_INFINITY];
    for p in [Preset::Paper, Preset::Verl, Preset::OpenRlhf] {
        for (name, f) in all_losses(p) {
            // Verl's gmpo/clip-cov/kl-cov have no clamp (as verl): with x = ±1000 they overflow
            // where A ≠ 0 uses the ratio unclipped — the call must then be an Err, never NaN.
            let inp = PolicyInputs {
                lp: &x,
                old: &old,
                adv: &adv,
                tokens: Tokens::padded(2, 4, Some(&m)),
            };
            let (mut v, mut g) = ([7.0; 8], [7.0; 8]);
            match f(&inp, &mut v, &mut g) {
                Ok(_) => {
                    assert!(
                        v.iter().chain(&g).all(|z| z.is_finite()),
                        "{p:?} {name}: {v:?} {g:?}"
                    );
                    assert_eq!((v[7], g[7]), (0.0, 0.0));
                }
                Err(e) => {
                    assert!(matches!(e, Error::NonFinite { .. }), "{p:?} {name}: {e}");
                    assert_eq!(
                        (v, g),
                        ([7.0; 8], [7.0; 8]),
                        "{p:?} {name}: outputs touched"
                    );
                }
            }
        }
    }
    // The clamped presets never fail on these inputs.
    for (name, f) in all_losses(Preset::Paper) {
        let inp = PolicyInputs {
            lp: &x,
            old: &old,
            adv: &adv,
            tokens: Tokens::padded(2, 4, Some(&m)),
        };
        let (mut v, mut g) = ([0.0; 8], [0.0; 8]);
        f(&inp, &mut v, &mut g).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn zero_advantage_with_overflowing_ratio_is_zero_not_nan() {
    // TRL (no clamp): x = 1000 → ρ = inf in f64; A = 0 must give L = 0, ∂ = 0 (0·inf guarded).
    let r = Row::from_x(&[1000.0, 1000.0], &[0.0, 0.0]);
    for (name, f) in all_losses(Preset::Trl) {
        let (mut v, mut g) = ([7.0; 2], [7.0; 2]);
        let res = f(&r.inp(), &mut v, &mut g);
        match name {
            // kl-cov penalises |x| = 1000 on its selected token: finite, not 0.
            "kl_cov" => assert!(res.is_ok() && v.iter().chain(&g).all(|z| z.is_finite())),
            // P3O's KL3 term (e^{−x} − 1 + x = 999 here) does not vanish with A: with ESS =
            // ½, L = 499.5 and ∂L/∂lp = ½·(1 − e^{−1000}) = ½.
            "p3o" => {
                res.unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!((v, g), ([499.5; 2], [0.5; 2]), "{name}");
            }
            _ => {
                res.unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!((v, g), ([0.0; 2], [0.0; 2]), "{name}");
            }
        }
    }
    // f32 overflows already at x = 100.
    let (lp, old, adv) = ([100.0f32], [0.0f32], [0.0f32]);
    let inp = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &adv,
        tokens: Tokens::padded(1, 1, None),
    };
    let (mut v, mut g) = ([7.0f32], [7.0f32]);
    ppo_clip(
        &PpoClipConfig::from_preset(Preset::Trl),
        &inp,
        &mut v,
        &mut g,
    )
    .unwrap();
    assert_eq!((v[0], g[0]), (0.0, 0.0));
    sapo(&SapoConfig::from_preset(Preset::Trl), &inp, &mut v, &mut g).unwrap();
    assert_eq!((v[0], g[0]), (0.0, 0.0));
}

#[test]
fn overflowing_unclipped_ratio_without_clamp_is_an_error() {
    // TRL, x = 1000, A = −1: −min(ρA, 1.2A) = ρ = inf → Err, outputs untouched.
    // A = +1 is fine: the clipped branch −1.2 wins.
    let r = Row::from_x(&[1000.0], &[-1.0]);
    let cfg = PpoClipConfig::from_preset(Preset::Trl);
    let (mut v, mut g) = ([7.0], [7.0]);
    assert_eq!(
        ppo_clip(&cfg, &r.inp(), &mut v, &mut g),
        Err(Error::NonFinite {
            what: "loss value",
            index: 0
        })
    );
    assert_eq!((v, g), ([7.0], [7.0]));
    let r = Row::from_x(&[1000.0], &[1.0]);
    ppo_clip(&cfg, &r.inp(), &mut v, &mut g).unwrap();
    assert_eq!((v[0], g[0]), (-1.2, 0.0));
    // Even TRL's dual-free loss is bounded for A < 0 by the δ cap: L = δ·1.
    let capped = PpoClipConfig {
        delta_cap: Some(4.0),
        ..cfg
    };
    let r = Row::from_x(&[1000.0], &[-1.0]);
    ppo_clip(&capped, &r.inp(), &mut v, &mut g).unwrap();
    assert_eq!((v[0], g[0]), (4.0, 0.0));
}

#[test]
fn huge_inputs_whose_difference_overflows_are_rejected() {
    let (lp, old, adv) = ([f64::MAX], [-f64::MAX], [1.0]);
    let inp = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &adv,
        tokens: Tokens::padded(1, 1, None),
    };
    let (mut v, mut g) = ([7.0], [7.0]);
    assert_eq!(
        ppo_clip(&PpoClipConfig::default(), &inp, &mut v, &mut g),
        Err(Error::NonFinite {
            what: "lp - old",
            index: 0
        })
    );
    assert_eq!((v, g), ([7.0], [7.0]));
}

// ---------------- bad input ----------------

fn assert_untouched(
    res: grpo_core::Result<LossDiagnostics<f64>>,
    v: &[f64],
    g: &[f64],
    what: &str,
) {
    assert!(res.is_err(), "{what}: expected Err");
    assert!(
        v.iter().chain(g).all(|&z| z == 7.0),
        "{what}: outputs touched"
    );
}

#[test]
fn bad_parameters_are_rejected_and_outputs_untouched() {
    assert!(RatioBounds::<f64>::symmetric(0.0).is_err()); // ε ≤ 0
    assert!(RatioBounds::<f64>::symmetric(-0.1).is_err());
    assert!(RatioBounds::<f64>::asymmetric(1.0, 0.2).is_err()); // ε_low ≥ 1
    let r = Row::from_x(&[0.1, 0.2], &[1.0, -1.0]);
    let base = PpoClipConfig::<f64>::default();
    let bad_ppo = [
        (
            "lo > 1",
            PpoClipConfig {
                bounds: RatioBounds { lo: 1.1, hi: 1.2 },
                ..base
            },
        ),
        (
            "hi < 1",
            PpoClipConfig {
                bounds: RatioBounds { lo: 0.8, hi: 0.9 },
                ..base
            },
        ),
        (
            "NaN bound",
            PpoClipConfig {
                bounds: RatioBounds {
                    lo: f64::NAN,
                    hi: 1.2,
                },
                ..base
            },
        ),
        (
            "dual c = 1",
            PpoClipConfig {
                dual_clip: Some(1.0),
                ..base
            },
        ),
        (
            "dual c = 0.5",
            PpoClipConfig {
                dual_clip: Some(0.5),
                ..base
            },
        ),
        (
            "delta = 1",
            PpoClipConfig {
                delta_cap: Some(1.0),
                ..base
            },
        ),
        (
            "delta = 0.9",
            PpoClipConfig {
                delta_cap: Some(0.9),
                ..base
            },
        ),
        (
            "clamp 0",
            PpoClipConfig {
                log_ratio_clamp: Some(0.0),
                ..base
            },
        ),
        (
            "clamp NaN",
            PpoClipConfig {
                log_ratio_clamp: Some(f64::NAN),
                ..base
            },
        ),
    ];
    for (what, cfg) in bad_ppo {
        let (mut v, mut g) = ([7.0; 2], [7.0; 2]);
        assert_untouched(ppo_clip(&cfg, &r.inp(), &mut v, &mut g), &v, &g, what);
    }
    let (mut v, mut g) = ([7.0; 2], [7.0; 2]);
    let gs = GspoConfig {
        delta_cap: Some(1.0),
        ..GspoConfig::default()
    };
    assert_untouched(gspo(&gs, &r.inp(), &mut v, &mut g), &v, &g, "gspo delta");
    for c in [1.0, f64::INFINITY, f64::NAN] {
        let gs = GspoConfig {
            dual_clip: Some(c),
            ..GspoConfig::default()
        };
        assert_untouched(gspo(&gs, &r.inp(), &mut v, &mut g), &v, &g, "gspo dual");
    }
    let gt = GspoTokenConfig {
        seq_log_ratio_max: Some(-1.0),
        ..GspoTokenConfig::default()
    };
    assert_untouched(
        gspo_token(&gt, &r.inp(), &mut v, &mut g),
        &v,
        &g,
        "gspo_token cap",
    );
    let gm = GmpoConfig {
        eps_low: 0.0,
        ..GmpoConfig::default()
    };
    assert_untouched(gmpo(&gm, &r.inp(), &mut v, &mut g), &v, &g, "gmpo eps");
    let gm = GmpoConfig {
        mean_eps: -1.0,
        ..GmpoConfig::default()
    };
    assert_untouched(gmpo(&gm, &r.inp(), &mut v, &mut g), &v, &g, "gmpo mean_eps");
    let ci = CispoConfig::trl(0.2, Some(0.0));
    assert_untouched(cispo(&ci, &r.inp(), &mut v, &mut g), &v, &g, "cispo cap 0");
    let ci = CispoConfig {
        weight: CispoWeight::Clamp(RatioBounds { lo: 1.5, hi: 2.0 }),
        ..CispoConfig::default()
    };
    assert_untouched(cispo(&ci, &r.inp(), &mut v, &mut g), &v, &g, "cispo bounds");
    let sa = SapoConfig {
        tau_neg: 0.0,
        ..SapoConfig::default()
    };
    assert_untouched(sapo(&sa, &r.inp(), &mut v, &mut g), &v, &g, "sapo tau");
    let p3 = P3oConfig::default();
    assert_untouched(
        p3o(&p3, &r.inp(), 1.5, &mut v, &mut g),
        &v,
        &g,
        "p3o ess > 1",
    );
    assert_untouched(
        p3o(&p3, &r.inp(), f64::NAN, &mut v, &mut g),
        &v,
        &g,
        "p3o ess NaN",
    );
    let cc = ClipCovConfig {
        ratio: 0.0,
        ..ClipCovConfig::default()
    };
    assert_untouched(
        clip_cov(&cc, &r.inp(), &mut v, &mut g),
        &v,
        &g,
        "clip_cov ratio",
    );
    let cc = ClipCovConfig {
        cov_lb: 5.0,
        cov_ub: 1.0,
        ..ClipCovConfig::default()
    };
    assert_untouched(
        clip_cov(&cc, &r.inp(), &mut v, &mut g),
        &v,
        &g,
        "clip_cov bounds",
    );
    let kc = KlCovConfig::default();
    let mut small = [0.0; 1];
    assert!(matches!(
        kl_cov(&kc, &r.inp(), &mut small, &mut v, &mut g),
        Err(Error::ScratchTooSmall {
            needed: 2,
            found: 1
        })
    ));
    assert!(v.iter().chain(&g).all(|&z| z == 7.0));
    let mut ge = [7.0; 2];
    assert!(
        entropy_bonus(
            f64::NAN,
            &[1.0, 2.0],
            Tokens::padded(1, 2, None),
            &mut v,
            &mut ge
        )
        .is_err()
    );
    assert_eq!((v, ge), ([7.0; 2], [7.0; 2]));
}

#[test]
fn bad_shapes_and_values_are_rejected_and_outputs_untouched() {
    let cfg = PpoClipConfig::<f64>::default();
    let (lp, old, adv) = ([0.1, 0.2, 0.3], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]);
    let tok = Tokens::padded(1, 3, None);
    let cases: Vec<(&str, PolicyInputs<'_, f64>, usize, usize)> = vec![
        (
            "old short",
            PolicyInputs {
                lp: &lp,
                old: &old[..2],
                adv: &adv,
                tokens: tok,
            },
            3,
            3,
        ),
        (
            "adv short",
            PolicyInputs {
                lp: &lp,
                old: &old,
                adv: &adv[..2],
                tokens: tok,
            },
            3,
            3,
        ),
        (
            "value short",
            PolicyInputs {
                lp: &lp,
                old: &old,
                adv: &adv,
                tokens: tok,
            },
            2,
            3,
        ),
        (
            "grad long",
            PolicyInputs {
                lp: &lp,
                old: &old,
                adv: &adv,
                tokens: tok,
            },
            3,
            4,
        ),
        (
            "layout",
            PolicyInputs {
                lp: &lp,
                old: &old,
                adv: &adv,
                tokens: Tokens::padded(2, 2, None),
            },
            3,
            3,
        ),
        (
            "cu_seqlens",
            PolicyInputs {
                lp: &lp,
                old: &old,
                adv: &adv,
                tokens: Tokens::packed(&[0, 2], None),
            },
            3,
            3,
        ),
    ];
    for (what, inp, nv, ng) in cases {
        for (name, f) in all_losses(Preset::Paper) {
            let (mut v, mut g) = (vec![7.0; nv], vec![7.0; ng]);
            assert_untouched(f(&inp, &mut v, &mut g), &v, &g, &format!("{name} {what}"));
        }
    }
    // Non-finite values at valid positions.
    let nan_lp = [0.1, f64::NAN, 0.3];
    let inf_adv = [1.0, 1.0, f64::INFINITY];
    for (what, inp, want) in [
        (
            "lp",
            PolicyInputs {
                lp: &nan_lp,
                old: &old,
                adv: &adv,
                tokens: tok,
            },
            Error::NonFinite {
                what: "lp",
                index: 1,
            },
        ),
        (
            "adv",
            PolicyInputs {
                lp: &lp,
                old: &old,
                adv: &inf_adv,
                tokens: tok,
            },
            Error::NonFinite {
                what: "adv",
                index: 2,
            },
        ),
    ] {
        for (name, f) in all_losses(Preset::Paper) {
            let (mut v, mut g) = ([7.0; 3], [7.0; 3]);
            assert_eq!(f(&inp, &mut v, &mut g).unwrap_err(), want, "{name} {what}");
            assert!(v.iter().chain(&g).all(|&z| z == 7.0));
        }
    }
    let (mut v, mut g) = ([7.0; 3], [7.0; 3]);
    assert!(
        ppo_clip(
            &cfg,
            &PolicyInputs {
                lp: &lp,
                old: &old,
                adv: &adv,
                tokens: tok
            },
            &mut v,
            &mut g
        )
        .is_ok()
    );
    // REINFORCE: weights of the wrong length / non-finite.
    let (mut v, mut g) = ([7.0; 3], [7.0; 3]);
    assert!(reinforce(&lp, &adv, Some(&[1.0, 1.0]), tok, &mut v, &mut g).is_err());
    assert!(reinforce(&lp, &adv, Some(&[1.0, f64::NAN, 1.0]), tok, &mut v, &mut g).is_err());
    assert_eq!((v, g), ([7.0; 3], [7.0; 3]));
    // Aggregation: processes = 0, non-finite valid value, bad eps.
    let mut w = [7.0; 3];
    let d = AggConfig::<f64> {
        mode: AggMode::Dapo {
            global_tokens: 3,
            processes: 0,
        },
        denominator: Denominator::Strict,
        sequences: SeqCount::All,
    };
    assert!(aggregate(&d, tok, &lp, &mut w).is_err());
    assert!(aggregate(&AggConfig::default(), tok, &nan_lp, &mut w).is_err());
    let e = AggConfig::<f64> {
        denominator: Denominator::PlusEps(0.0),
        ..AggConfig::default()
    };
    assert!(aggregate(&e, tok, &lp, &mut w).is_err());
    assert!(aggregate(&AggConfig::default(), tok, &lp, &mut w[..2]).is_err());
    assert_eq!(w, [7.0; 3]);
}

#[test]
fn f32_agrees_with_f64() {
    // The same formulas in f32: values within f32 rounding of the f64 ones.
    let x = [0.3f64, -0.4, 1.1, -2.0, 0.05];
    let a = [1.0f64, -1.0, 0.5, -0.7, 2.0];
    let r = Row::from_x(&x, &a);
    let (lp32, old32, adv32): (Vec<f32>, Vec<f32>, Vec<f32>) = (
        x.iter().map(|&v| v as f32).collect(),
        vec![0.0; 5],
        a.iter().map(|&v| v as f32).collect(),
    );
    let inp32 = PolicyInputs {
        lp: &lp32,
        old: &old32,
        adv: &adv32,
        tokens: Tokens::padded(1, 5, None),
    };
    let (mut v32, mut g32) = ([0.0f32; 5], [0.0f32; 5]);
    ppo_clip(
        &PpoClipConfig::from_preset(Preset::Verl),
        &inp32,
        &mut v32,
        &mut g32,
    )
    .unwrap();
    let cfg = PpoClipConfig::from_preset(Preset::Verl);
    let (v, g, _) = eval(&r, &move |i, v, gr| ppo_clip(&cfg, i, v, gr));
    for t in 0..5 {
        assert!((v32[t] as f64 - v[t]).abs() < 1e-5 * (1.0 + v[t].abs()));
        assert!((g32[t] as f64 - g[t]).abs() < 1e-5 * (1.0 + g[t].abs()));
    }
    gmpo(&GmpoConfig::default(), &inp32, &mut v32, &mut g32).unwrap();
    let (v, g, _) = eval(&r, &|i, v, gr| gmpo(&GmpoConfig::default(), i, v, gr));
    for t in 0..5 {
        assert!((v32[t] as f64 - v[t]).abs() < 1e-5 * (1.0 + v[t].abs()));
        assert!((g32[t] as f64 - g[t]).abs() < 1e-5 * (1.0 + g[t].abs()));
    }
}
