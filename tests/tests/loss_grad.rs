//! Central finite-difference checks (f64) of every policy loss × clip mode × aggregation mode:
//! the gradient of the aggregated scalar `Σ_t w_t L_t` computed analytically (loss gradient
//! scaled by `scale_gradients`) must equal the central difference of the scalar, at random
//! points (proptest) and next to — not on — every kink (clip bounds, dual-clip, δ cap, clamp).
//!
//! Losses with stop-gradients (CISPO, REINFORCE, P3O, GSPO-token) are differenced on their
//! surrogate with the detached factors frozen at the base point, written out here from the
//! formula; the implementation's values are checked against that surrogate at the base point.

use grpo_core::aggregate::{AggConfig, AggMode, Denominator, SeqCount, aggregate, scale_gradients};
use grpo_core::divergence::RatioBounds;
use grpo_core::loss::*;
use grpo_core::{Preset, Tokens};
use proptest::prelude::*;

const H: f64 = 1e-6;

/// A batch: padded `[rows, cols]` or packed, with an optional mask. Invalid positions hold
/// garbage (NaN / ±inf) to prove they are never read.
#[derive(Debug, Clone)]
struct Case {
    lp: Vec<f64>,
    old: Vec<f64>,
    adv: Vec<f64>,
    mask: Option<Vec<bool>>,
    cu: Option<Vec<usize>>,
    rows: usize,
    cols: usize,
}

impl Case {
    fn tokens(&self) -> Tokens<'_> {
        match &self.cu {
            Some(cu) => Tokens::packed(cu, self.mask.as_deref()),
            None => Tokens::padded(self.rows, self.cols, self.mask.as_deref()),
        }
    }
    fn inputs<'a>(&'a self, lp: &'a [f64]) -> PolicyInputs<'a, f64> {
        PolicyInputs {
            lp,
            old: &self.old,
            adv: &self.adv,
            tokens: self.tokens(),
        }
    }
    fn valid(&self) -> Vec<usize> {
        let t = self.tokens();
        (0..t.num_sequences())
            .flat_map(|i| t.valid_positions(i).collect::<Vec<_>>())
            .collect()
    }
    /// Single padded row, no mask, from log-ratios and advantages (old = −1, lp = old + x).
    fn row(x: &[f64], adv: &[f64]) -> Case {
        let old = vec![-1.0; x.len()];
        Case {
            lp: x.iter().map(|x| x - 1.0).collect(),
            old,
            adv: adv.to_vec(),
            mask: None,
            cu: None,
            rows: 1,
            cols: x.len(),
        }
    }
}

type Out = (Vec<f64>, Vec<f64>, LossDiagnostics<f64>);
type LossFn = dyn Fn(
    &PolicyInputs<'_, f64>,
    &mut [f64],
    &mut [f64],
) -> grpo_core::Result<LossDiagnostics<f64>>;

fn run(c: &Case, lp: &[f64], f: &LossFn) -> Out {
    let n = lp.len();
    let (mut v, mut g) = (vec![f64::NAN; n], vec![f64::NAN; n]);
    let d = f(&c.inputs(lp), &mut v, &mut g).expect("loss failed");
    (v, g, d)
}

fn close(a: f64, b: f64, rel: f64, abs: f64) -> bool {
    (a - b).abs() <= abs + rel * a.abs().max(b.abs())
}

fn agg_modes() -> Vec<AggConfig<f64>> {
    let modes = [
        AggMode::TokenMean {
            global_tokens: None,
        },
        AggMode::TokenMean {
            global_tokens: Some(17),
        },
        AggMode::SeqMeanTokenMean,
        AggMode::SeqMeanTokenSum,
        AggMode::SeqMeanTokenSumNorm {
            max_len: None,
            divide_by_batch: true,
        },
        AggMode::SeqMeanTokenSumNorm {
            max_len: Some(9),
            divide_by_batch: false,
        },
        AggMode::Bnpo,
        AggMode::Dapo {
            global_tokens: 40,
            processes: 4,
        },
        AggMode::Luspo,
    ];
    modes
        .iter()
        .map(|&mode| AggConfig {
            mode,
            denominator: Denominator::ClampOne,
            sequences: SeqCount::All,
        })
        .collect()
}

/// FD check of one loss evaluation under every aggregation mode. `surrogate(lp')` gives the
/// per-token values at `lp'` (for losses without stop-gradients: the implementation itself).
fn fd_check(c: &Case, base: &Out, surrogate: &dyn Fn(&[f64]) -> Vec<f64>) -> Result<(), String> {
    let (v0, g0, d) = base;
    let tokens = c.tokens();
    let valid = c.valid();
    let s0 = surrogate(&c.lp);
    for &t in &valid {
        if !close(v0[t], s0[t], 1e-12, 1e-12) {
            return Err(format!(
                "value mismatch at {t}: impl {} surrogate {}",
                v0[t], s0[t]
            ));
        }
    }
    for agg in agg_modes() {
        let mut w = vec![0.0; c.lp.len()];
        aggregate(&agg, tokens, v0, &mut w).map_err(|e| format!("{e}"))?;
        let mut g = g0.clone();
        scale_gradients(tokens, &w, d.level, &mut g).map_err(|e| format!("{e}"))?;
        // Σ_s w_s (L_s(lp+) − L_s(lp−)): terms the perturbation does not touch cancel exactly,
        // so huge unrelated values (ratios near e^20) add no rounding noise.
        let diff = |p: &[f64], m: &[f64]| -> f64 {
            let (vp, vm) = (surrogate(p), surrogate(m));
            valid.iter().map(|&s| w[s] * (vp[s] - vm[s])).sum()
        };
        for &t in &valid {
            let mut p = c.lp.clone();
            p[t] += H;
            let mut m = c.lp.clone();
            m[t] -= H;
            let fd = diff(&p, &m) / (2.0 * H);
            if !close(g[t], fd, 1e-6, 1e-7) {
                return Err(format!(
                    "{:?}: grad mismatch at {t}: analytic {} fd {} (x = {}, A = {})",
                    agg.mode,
                    g[t],
                    fd,
                    c.lp[t] - c.old[t],
                    c.adv[t]
                ));
            }
        }
        for t in 0..g.len() {
            if !valid.contains(&t) && g[t] != 0.0 {
                return Err(format!("invalid position {t} got gradient {}", g[t]));
            }
        }
    }
    for t in 0..v0.len() {
        if !valid.contains(&t) && (v0[t] != 0.0 || g0[t] != 0.0) {
            return Err(format!("invalid position {t} not zeroed"));
        }
    }
    Ok(())
}

/// Self-surrogate: the implementation's own values (no stop-gradient in the loss).
fn check_plain(c: &Case, f: &LossFn) -> Result<(), String> {
    let base = run(c, &c.lp, f);
    fd_check(c, &base, &|lp| run(c, lp, f).0)
}

// ---------- the clip modes ----------

fn kl3_bounds() -> RatioBounds<f64> {
    // KL3 δ = 0.05 (MATH.md §3 check values).
    RatioBounds::new(0.71619, 1.35040).unwrap()
}

fn ppo_modes() -> Vec<(&'static str, PpoClipConfig<f64>)> {
    let sym = PpoClipConfig::default();
    let asym = PpoClipConfig::<f64> {
        bounds: RatioBounds::asymmetric(0.2, 0.28).unwrap(),
        ..sym
    };
    let kl3 = PpoClipConfig::<f64> {
        bounds: kl3_bounds(),
        ..sym
    };
    let dual = PpoClipConfig::<f64>::from_preset(Preset::Verl);
    let cap = PpoClipConfig::<f64> {
        delta_cap: Some(1.5),
        ..PpoClipConfig::from_preset(Preset::Trl)
    };
    let all = PpoClipConfig::<f64> {
        bounds: RatioBounds::asymmetric(0.2, 0.28).unwrap(),
        dual_clip: Some(3.0),
        delta_cap: Some(2.0),
        log_ratio_clamp: Some(20.0),
    };
    vec![
        ("symmetric", sym),
        ("asymmetric", asym),
        ("kl3", kl3),
        ("dual", dual),
        ("cap", cap),
        ("all", all),
    ]
}

/// Log-ratios where a PPO-family loss has a kink, for near-boundary tests.
fn kinks(cfg: &PpoClipConfig<f64>) -> Vec<f64> {
    let mut k = vec![cfg.bounds.lo.ln(), cfg.bounds.hi.ln()];
    if let Some(c) = cfg.dual_clip {
        k.push(c.ln());
    }
    if let Some(d) = cfg.delta_cap {
        k.push(d.ln());
    }
    if let Some(c) = cfg.log_ratio_clamp {
        k.push(c);
        k.push(-c);
    }
    k
}

fn near_kink_case(kinks: &[f64]) -> Case {
    let mut x = Vec::new();
    let mut a = Vec::new();
    for &k in kinks {
        for off in [-1e-3, 1e-3] {
            for adv in [-1.3, 0.7] {
                x.push(k + off);
                a.push(adv);
            }
        }
    }
    Case::row(&x, &a)
}

#[test]
fn ppo_clip_fd_next_to_every_kink() {
    for (name, cfg) in ppo_modes() {
        let c = near_kink_case(&kinks(&cfg));
        let f =
            move |i: &PolicyInputs<'_, f64>, v: &mut [f64], g: &mut [f64]| ppo_clip(&cfg, i, v, g);
        check_plain(&c, &f).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn sapo_fd_at_fixed_points() {
    let c = Case::row(
        &[-3.0, -0.5, 0.0, 0.3, 2.0, 19.999, 20.001],
        &[1.0, -1.0, 2.0, -0.5, 1.5, -1.0, 1.0],
    );
    let cfg = SapoConfig::default();
    check_plain(&c, &move |i, v, g| sapo(&cfg, i, v, g)).unwrap();
}

#[test]
fn gmpo_fd_next_to_log_space_clip() {
    let cfg = GmpoConfig::<f64>::default();
    // Tokens just inside/outside ±0.4 with both signs of A, in two sequences.
    let x = [0.399, 0.401, -0.399, -0.401, 0.401, -0.401, 0.2, -1.0];
    let adv = [1.0, 1.0, 1.0, 1.0, -2.0, -2.0, -2.0, -2.0];
    let mut c = Case::row(&x, &adv);
    c.rows = 2;
    c.cols = 4;
    check_plain(&c, &move |i, v, g| gmpo(&cfg, i, v, g)).unwrap();
    let verl = GmpoConfig::<f64>::from_preset(Preset::Verl);
    check_plain(&c, &move |i, v, g| gmpo(&verl, i, v, g)).unwrap();
}

#[test]
fn gspo_fd_next_to_sequence_bounds() {
    // Sequence means just inside / outside the bounds [0.8, 1.2] (log space) for A = ±1.
    for (lo_hi, a) in [(0.8f64, 1.0), (0.8, -1.0), (1.2, 1.0), (1.2, -1.0)] {
        for off in [-1e-3, 1e-3] {
            let m = lo_hi.ln() + off;
            let x = [m + 0.3, m - 0.3, m];
            let c = Case::row(&x, &[a; 3]);
            let cfg = GspoConfig::<f64> {
                bounds: RatioBounds::symmetric(0.2).unwrap(),
                ..GspoConfig::default()
            };
            check_plain(&c, &move |i, v, g| gspo(&cfg, i, v, g)).unwrap();
            let capped = GspoConfig::<f64> {
                delta_cap: Some(1.1),
                ..cfg
            };
            check_plain(&c, &move |i, v, g| gspo(&capped, i, v, g)).unwrap();
        }
    }
    // Next to the dual-clip bound: s = 3·e^{±1e-3} with A = −1 (dual-clip c = 3).
    for off in [-1e-3, 1e-3] {
        let m = 3f64.ln() + off;
        let c = Case::row(&[m + 0.3, m - 0.3, m], &[-1.0; 3]);
        let cfg = GspoConfig::<f64> {
            dual_clip: Some(3.0),
            ..GspoConfig::default()
        };
        check_plain(&c, &move |i, v, g| gspo(&cfg, i, v, g)).unwrap();
    }
}

/// GSPO-token surrogate: r_t = exp(min(lp'_t − lp_t + x̄_i, cap)) with x̄_i frozen.
fn gspo_token_surrogate(c: &Case, cfg: &GspoTokenConfig<f64>, lp: &[f64]) -> Vec<f64> {
    let tokens = c.tokens();
    let mut out = vec![0.0; lp.len()];
    for i in 0..tokens.num_sequences() {
        let pos: Vec<usize> = tokens.valid_positions(i).collect();
        if pos.is_empty() {
            continue;
        }
        let xbar: f64 = pos.iter().map(|&t| c.lp[t] - c.old[t]).sum::<f64>() / pos.len() as f64;
        for &t in &pos {
            let raw = lp[t] - c.lp[t] + xbar;
            // The clamp is decided at the base point (x̄ > cap → constant).
            let lr = match cfg.seq_log_ratio_max {
                Some(m) if xbar > m => m,
                _ => raw,
            };
            let r = lr.exp();
            let a = c.adv[t];
            let clipped = r.clamp(cfg.bounds.lo, cfg.bounds.hi);
            out[t] = -(r * a).min(clipped * a);
        }
    }
    out
}

#[test]
fn gspo_token_fd_next_to_bounds_and_cap() {
    let cfg = GspoTokenConfig::<f64> {
        bounds: RatioBounds::asymmetric(0.2, 0.28).unwrap(),
        ..Default::default()
    };
    for m in [
        0.8f64.ln() - 1e-3,
        0.8f64.ln() + 1e-3,
        1.28f64.ln() - 1e-3,
        1.28f64.ln() + 1e-3,
        10.5,
        9.5,
    ] {
        for a in [1.0, -1.0] {
            let c = Case::row(&[m + 0.1, m - 0.1], &[a, a]);
            let base = run(&c, &c.lp, &move |i, v, g| gspo_token(&cfg, i, v, g));
            fd_check(&c, &base, &|lp| gspo_token_surrogate(&c, &cfg, lp)).unwrap();
        }
    }
}

fn cispo_surrogate(c: &Case, cfg: &CispoConfig<f64>, lp: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; lp.len()];
    for t in c.valid() {
        let mut x = c.lp[t] - c.old[t];
        if let Some(cl) = cfg.log_ratio_clamp {
            x = x.clamp(-cl, cl);
        }
        let rho = x.exp();
        let w = match cfg.weight {
            CispoWeight::Clamp(b) => rho.clamp(b.lo, b.hi),
            CispoWeight::Cap(m) => rho.min(m),
        };
        out[t] = -w * c.adv[t] * lp[t];
    }
    out
}

fn p3o_surrogate(c: &Case, cfg: &P3oConfig<f64>, ess: f64, lp: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; lp.len()];
    for t in c.valid() {
        let cl = cfg.log_ratio_clamp.unwrap_or(f64::INFINITY);
        let x0 = (c.lp[t] - c.old[t]).clamp(-cl, cl);
        let w = x0.exp().min(ess);
        // KL3 at lp' (constant if clamped at the base point).
        let raw = lp[t] - c.old[t];
        let x = if (c.lp[t] - c.old[t]).abs() > cl {
            x0
        } else {
            raw
        };
        // k3 of KL(θ‖old): e^{−x} − 1 + x.
        out[t] = -w * c.adv[t] * lp[t] + (1.0 - ess) * ((-x).exp() - 1.0 + x);
    }
    out
}

// ---------- proptest strategies ----------

/// A random batch: padded or packed, random mask, garbage at invalid positions, log-ratios in
/// [−1.5, 1.5] nudged at least 1e-4 away from `avoid` (kinks).
fn case(avoid: Vec<f64>) -> impl Strategy<Value = Case> {
    (1usize..4, 1usize..6, any::<bool>(), any::<u64>()).prop_flat_map(
        move |(rows, cols, packed, seed)| {
            let n = rows * cols;
            let avoid = avoid.clone();
            (
                proptest::collection::vec(-1.5f64..1.5, n),
                proptest::collection::vec(-2.0f64..2.0, n),
                proptest::collection::vec(-3.0f64..-0.01, n),
                proptest::collection::vec(prop::bool::weighted(0.8), n),
                any::<bool>(),
            )
                .prop_map(move |(mut x, adv, old, mask, use_mask)| {
                    for xi in x.iter_mut() {
                        for &k in &avoid {
                            if (*xi - k).abs() < 1e-4 {
                                *xi = k + 2e-4;
                            }
                        }
                    }
                    let mut c = Case {
                        lp: x.iter().zip(&old).map(|(x, o)| o + x).collect(),
                        old,
                        adv,
                        mask: use_mask.then_some(mask),
                        cu: None,
                        rows,
                        cols,
                    };
                    if packed {
                        // Cut the n positions into `rows` segments at seeded points (some may be empty).
                        let mut cu = vec![0usize];
                        let mut s = seed;
                        for _ in 1..rows {
                            s = s
                                .wrapping_mul(6364136223846793005)
                                .wrapping_add(1442695040888963407);
                            let last = *cu.last().unwrap();
                            cu.push(last + ((s >> 33) as usize % (n - last + 1)));
                        }
                        cu.push(n);
                        c.cu = Some(cu);
                    }
                    // Garbage where invalid.
                    if let Some(m) = &c.mask {
                        for t in 0..n {
                            if !m[t] {
                                c.lp[t] = f64::NAN;
                                c.old[t] = f64::INFINITY;
                                c.adv[t] = f64::NEG_INFINITY;
                            }
                        }
                    }
                    c
                })
        },
    )
}

/// Sequence means of the log-ratio (for skipping cases whose mean sits on a kink).
fn seq_means(c: &Case) -> Vec<f64> {
    let t = c.tokens();
    (0..t.num_sequences())
        .filter_map(|i| {
            let p: Vec<usize> = t.valid_positions(i).collect();
            (!p.is_empty())
                .then(|| p.iter().map(|&s| c.lp[s] - c.old[s]).sum::<f64>() / p.len() as f64)
        })
        .collect()
}

fn all_ppo_kinks() -> Vec<f64> {
    ppo_modes()
        .iter()
        .flat_map(|(_, c)| kinks(c))
        .chain([0.4, -0.4])
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn ppo_clip_fd_random(c in case(all_ppo_kinks())) {
        for (name, cfg) in ppo_modes() {
            let f = move |i: &PolicyInputs<'_, f64>, v: &mut [f64], g: &mut [f64]| ppo_clip(&cfg, i, v, g);
            if let Err(e) = check_plain(&c, &f) {
                return Err(TestCaseError::fail(format!("{name}: {e}")));
            }
        }
    }

    #[test]
    fn sapo_fd_random(c in case(vec![])) {
        for p in [Preset::Paper, Preset::Trl] {
            let cfg = SapoConfig::from_preset(p);
            check_plain(&c, &move |i, v, g| sapo(&cfg, i, v, g)).map_err(TestCaseError::fail)?;
        }
    }

    #[test]
    fn gmpo_fd_random(c in case(vec![0.4, -0.4])) {
        let cfg = GmpoConfig::<f64>::default();
        check_plain(&c, &move |i, v, g| gmpo(&cfg, i, v, g)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn gspo_fd_random(c in case(vec![])) {
        // Symmetric, clip-higher and KL3 (δ = 0.05) bounds; δ cap 1.5 without clamp (TRL).
        let bounds = [
            RatioBounds::symmetric(0.2).unwrap(),
            RatioBounds::asymmetric(0.2, 0.28).unwrap(),
            kl3_bounds(),
        ];
        // and dual-clip c = 1.3 (OpenRLHF).
        let ks: Vec<f64> = bounds.iter().flat_map(|b| [b.lo.ln(), b.hi.ln()]).chain([1.5f64.ln(), 1.3f64.ln()]).collect();
        prop_assume!(seq_means(&c).iter().all(|m| ks.iter().all(|k| (m - k).abs() > 1e-4)));
        for b in bounds {
            let cfg = GspoConfig::<f64> { bounds: b, ..GspoConfig::default() };
            check_plain(&c, &move |i, v, g| gspo(&cfg, i, v, g)).map_err(TestCaseError::fail)?;
            let capped = GspoConfig::<f64> { delta_cap: Some(1.5), log_ratio_clamp: None, ..cfg };
            check_plain(&c, &move |i, v, g| gspo(&capped, i, v, g)).map_err(TestCaseError::fail)?;
            let dual = GspoConfig::<f64> { dual_clip: Some(1.3), ..cfg };
            check_plain(&c, &move |i, v, g| gspo(&dual, i, v, g)).map_err(TestCaseError::fail)?;
        }
    }

    #[test]
    fn gspo_token_fd_random(c in case(vec![])) {
        let ks = [0.8f64.ln(), 1.28f64.ln()];
        prop_assume!(seq_means(&c).iter().all(|m| ks.iter().all(|k| (m - k).abs() > 1e-4)));
        let cfg = GspoTokenConfig::<f64> { bounds: RatioBounds::asymmetric(0.2, 0.28).unwrap(), ..Default::default() };
        let base = run(&c, &c.lp, &move |i, v, g| gspo_token(&cfg, i, v, g));
        fd_check(&c, &base, &|lp| gspo_token_surrogate(&c, &cfg, lp)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn cispo_fd_random(c in case(vec![0.8f64.ln(), 1.2f64.ln(), 0.2f64.ln(), 1.28f64.ln()])) {
        for cfg in [CispoConfig::<f64>::default(), CispoConfig::trl(0.2, Some(1.28)), CispoConfig::from_preset(Preset::Trl)] {
            let base = run(&c, &c.lp, &move |i, v, g| cispo(&cfg, i, v, g));
            fd_check(&c, &base, &|lp| cispo_surrogate(&c, &cfg, lp)).map_err(TestCaseError::fail)?;
        }
    }

    #[test]
    fn reinforce_fd_random(c in case(vec![]), w in proptest::collection::vec(0.0f64..3.0, 15)) {
        let n = c.lp.len();
        let weights = &w[..n];
        for ws in [None, Some(weights)] {
            let f = |lp: &[f64]| {
                let (mut v, mut g) = (vec![0.0; n], vec![0.0; n]);
                let d = reinforce(lp, &c.adv, ws, c.tokens(), &mut v, &mut g).unwrap();
                (v, g, d)
            };
            let base = f(&c.lp);
            let sur = |lp: &[f64]| {
                let mut out = vec![0.0; n];
                for t in c.valid() {
                    out[t] = -ws.map_or(1.0, |w| w[t]) * c.adv[t] * lp[t];
                }
                out
            };
            fd_check(&c, &base, &sur).map_err(TestCaseError::fail)?;
        }
    }

    #[test]
    fn p3o_fd_random(c in case(vec![]), ess in 0.05f64..1.0) {
        let cfg = P3oConfig::<f64>::default();
        let stats = ess_stats(&cfg, &c.inputs(&c.lp)).unwrap();
        for e in [ess, stats.ess()] {
            let base = run(&c, &c.lp, &move |i, v, g| p3o(&cfg, i, e, v, g));
            fd_check(&c, &base, &|lp| p3o_surrogate(&c, &cfg, e, lp)).map_err(TestCaseError::fail)?;
        }
    }

    #[test]
    fn kl_cov_fd_random(c in case(vec![]), ratio in 0.01f64..0.6) {
        let cfg = KlCovConfig::<f64> { ratio, coef: 0.7, log_ratio_clamp: Some(20.0) };
        let n = c.lp.len();
        let f = |lp: &[f64]| {
            let (mut v, mut g, mut s) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            let d = kl_cov(&cfg, &PolicyInputs { lp, old: &c.old, adv: &c.adv, tokens: c.tokens() }, &mut s, &mut v, &mut g).unwrap();
            (v, g, d)
        };
        let base = f(&c.lp);
        // The selection is frozen at the base point (verl selects on detached values): the k
        // valid tokens of largest cov = (A − Ā)(lp − mean lp), ties by position, computed here
        // from the formula, and the penalised tokens must be exactly those.
        let valid = c.valid();
        let nv = valid.len() as f64;
        let a_bar = valid.iter().map(|&t| c.adv[t]).sum::<f64>() / nv;
        let lp_bar = valid.iter().map(|&t| c.lp[t]).sum::<f64>() / nv;
        let cov = |t: usize| (c.adv[t] - a_bar) * (c.lp[t] - lp_bar);
        let k = ((ratio * nv).floor() as usize).max(1).min(valid.len());
        let mut order = valid.clone();
        order.sort_by(|&a, &b| cov(b).total_cmp(&cov(a)).then(a.cmp(&b)));
        let mut selected = vec![false; n];
        for &t in &order[..k] {
            selected[t] = true;
        }
        // Away from ties at the threshold (rounding of the two means could order them apart).
        if k < order.len() {
            prop_assume!((cov(order[k - 1]) - cov(order[k])).abs() > 1e-9);
        }
        let penalised: Vec<bool> = (0..n)
            .map(|t| (base.0[t] + c.adv[t] * (c.lp[t] - c.old[t]).exp()).abs() > 1e-9)
            .collect();
        prop_assert_eq!(&penalised, &selected);
        let sur = |lp: &[f64]| {
            let mut out = vec![0.0; n];
            for t in c.valid() {
                let x = lp[t] - c.old[t];
                out[t] = -c.adv[t] * x.exp() + if selected[t] { 0.7 * x.abs() } else { 0.0 };
            }
            out
        };
        prop_assume!(c.valid().iter().all(|&t| (c.lp[t] - c.old[t]).abs() > 1e-4));
        fd_check(&c, &base, &sur).map_err(TestCaseError::fail)?;
        prop_assert!(base.2.selected >= 1 || c.valid().is_empty());
    }

    #[test]
    fn clip_cov_fd_random(c in case(vec![0.8f64.ln(), 1.2f64.ln()]), seed in any::<u64>()) {
        // Wide covariance window and a large ratio so the selection is exercised.
        let cfg = ClipCovConfig::<f64> { ratio: 0.3, cov_lb: -0.5, cov_ub: 5.0, seed, ..Default::default() };
        let f = move |i: &PolicyInputs<'_, f64>, v: &mut [f64], g: &mut [f64]| clip_cov(&cfg, i, v, g);
        let base = run(&c, &c.lp, &f);
        let selected: Vec<bool> = (0..c.lp.len()).map(|t| base.0[t] == 0.0 && base.1[t] == 0.0).collect();
        // The detached tokens must be k = min(max(⌊0.3·N⌋, 1), #candidates) of the
        // candidates, computed here from the formula: valid, not clipped (−A·clip(ρ) ≤ −A·ρ),
        // cov_lb < (A − Ā)(lp − mean lp) < cov_ub. (Which k is the seed's draw.) A token with
        // A = 0 has value and gradient 0 without being detached, so it is left out.
        let valid = c.valid();
        let nv = valid.len() as f64;
        if !valid.is_empty() {
            let a_bar = valid.iter().map(|&t| c.adv[t]).sum::<f64>() / nv;
            let lp_bar = valid.iter().map(|&t| c.lp[t]).sum::<f64>() / nv;
            let candidate = |t: usize| {
                let rho = (c.lp[t] - c.old[t]).exp();
                let clipped = rho.clamp(cfg.bounds.lo, cfg.bounds.hi);
                let cov = (c.adv[t] - a_bar) * (c.lp[t] - lp_bar);
                -c.adv[t] * clipped <= -c.adv[t] * rho && cfg.cov_lb < cov && cov < cfg.cov_ub
            };
            // Away from the window's ends (the means' rounding could put a token either side).
            prop_assume!(valid.iter().all(|&t| {
                let cov = (c.adv[t] - a_bar) * (c.lp[t] - lp_bar);
                (cov - cfg.cov_lb).abs() > 1e-9 && (cov - cfg.cov_ub).abs() > 1e-9
            }));
            let candidates: Vec<usize> = valid.iter().copied().filter(|&t| candidate(t)).collect();
            let k = ((0.3 * nv).floor() as usize).max(1).min(candidates.len());
            let detached: Vec<usize> = valid.iter().copied().filter(|&t| selected[t] && c.adv[t] != 0.0).collect();
            prop_assert!(detached.iter().all(|t| candidates.contains(t)), "{:?} ⊄ {:?}", detached, candidates);
            let zero_adv = candidates.iter().filter(|&&t| c.adv[t] == 0.0).count();
            prop_assert!(detached.len() <= k && detached.len() + zero_adv >= k, "{} of {:?}, k = {}", detached.len(), candidates, k);
        }
        let ppo = PpoClipConfig::<f64> { bounds: cfg.bounds, dual_clip: None, delta_cap: None, log_ratio_clamp: Some(20.0) };
        let sur = |lp: &[f64]| {
            let (v, _, _) = run(&c, lp, &move |i, v, g| ppo_clip(&ppo, i, v, g));
            v.iter().zip(&selected).map(|(v, s)| if *s { 0.0 } else { *v }).collect::<Vec<_>>()
        };
        fd_check(&c, &base, &sur).map_err(TestCaseError::fail)?;
    }
}
