//! The per-token losses of grpo-core in f64 against references written here from their
//! formulas (MATH.md §4 and each function's rustdoc), value and gradient at every valid token
//! of random padded batches: PPO-clip (bounds, dual-clip, δ cap, log-ratio clamp), GSPO and
//! GSPO-token, GMPO, SAPO, CISPO in both weightings, and REINFORCE. The finite-difference tests
//! (`loss_grad`) check each gradient against its own value; these check the values.

use grpo_core::Tokens;
use grpo_core::divergence::RatioBounds;
use grpo_core::loss::{
    CispoConfig, CispoWeight, GmpoConfig, GspoConfig, GspoTokenConfig, PolicyInputs, PpoClipConfig,
    SapoConfig, cispo, gmpo, gspo, gspo_token, ppo_clip, reinforce, sapo,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Batch {
    rows: usize,
    cols: usize,
    lp: Vec<f64>,
    old: Vec<f64>,
    adv: Vec<f64>,
    mask: Vec<bool>,
}

impl Batch {
    fn tokens(&self) -> Tokens<'_> {
        Tokens::padded(self.rows, self.cols, Some(&self.mask))
    }
    fn inputs(&self) -> PolicyInputs<'_, f64> {
        PolicyInputs {
            lp: &self.lp,
            old: &self.old,
            adv: &self.adv,
            tokens: self.tokens(),
        }
    }
    fn valid(&self, i: usize) -> Vec<usize> {
        (i * self.cols..(i + 1) * self.cols)
            .filter(|&t| self.mask[t])
            .collect()
    }
    fn x(&self, t: usize) -> f64 {
        self.lp[t] - self.old[t]
    }
}

/// Log-ratios mostly within ±1.5 (around every clip bound in use), sometimes ±25 (past the
/// ±20 clamp); advantages of both signs, some 0; in one case of three the sequence's tokens
/// share one advantage (the GRPO case).
fn batch() -> impl Strategy<Value = Batch> {
    (1usize..4, 1usize..6).prop_flat_map(|(rows, cols)| {
        let n = rows * cols;
        let x = prop_oneof![6 => -1.5f64..1.5, 1 => -25.0f64..25.0];
        let a = prop_oneof![4 => -2.0f64..2.0, 1 => Just(0.0)];
        (
            prop::collection::vec(-4.0f64..0.0, n),
            prop::collection::vec(x, n),
            prop::collection::vec(a, n),
            prop::collection::vec(prop::bool::weighted(0.8), n),
            any::<bool>(),
        )
            .prop_map(move |(lp, x, mut adv, mask, shared)| {
                if shared {
                    for t in 0..n {
                        adv[t] = adv[t / cols * cols];
                    }
                }
                let old = lp.iter().zip(&x).map(|(l, x)| l - x).collect();
                Batch {
                    rows,
                    cols,
                    lp,
                    old,
                    adv,
                    mask,
                }
            })
    })
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * (1.0 + a.abs().max(b.abs()))
}

/// Every valid token's (value, gradient) against the reference's.
fn compare(
    b: &Batch,
    got: (&[f64], &[f64]),
    want: &dyn Fn(usize, usize) -> (f64, f64),
) -> Result<(), TestCaseError> {
    for i in 0..b.rows {
        for t in b.valid(i) {
            let (v, g) = want(i, t);
            prop_assert!(close(got.0[t], v), "value at {}: {} vs {}", t, got.0[t], v);
            prop_assert!(
                close(got.1[t], g),
                "gradient at {}: {} vs {}",
                t,
                got.1[t],
                g
            );
        }
    }
    Ok(())
}

/// `x` limited to `[−c, c]`, and whether it was outside.
fn clamp(x: f64, c: Option<f64>) -> (f64, bool) {
    match c {
        Some(c) if x.abs() > c => (x.clamp(-c, c), true),
        _ => (x, false),
    }
}

/// The clipped objective of one token at ratio `rho` with `∂ρ/∂lp = drho`: `L = −min(ρ'A,
/// clip(ρ)A)` (`ρ' = min(ρ, δ)`), at most `−cA` for `A < 0` under dual-clip; `(L, ∂L/∂lp)`.
fn clipped(
    rho: f64,
    drho: f64,
    a: f64,
    b: RatioBounds<f64>,
    dual: Option<f64>,
    cap: Option<f64>,
) -> (f64, f64) {
    if a == 0.0 {
        return (0.0, 0.0);
    }
    let (r1, d1) = match cap {
        Some(d) if rho > d => (d, 0.0),
        _ => (rho, drho),
    };
    let (r2, d2) = if rho < b.lo || rho > b.hi {
        (rho.clamp(b.lo, b.hi), 0.0)
    } else {
        (rho, drho)
    };
    // −min(r1·A, r2·A) is the larger of −r1·A and −r2·A.
    let (mut v, mut g) = if -r2 * a > -r1 * a {
        (-r2 * a, -a * d2)
    } else {
        (-r1 * a, -a * d1)
    };
    if let Some(c) = dual
        && a < 0.0
        && -c * a < v
    {
        (v, g) = (-c * a, 0.0);
    }
    (v, g)
}

// ------------------------------------------------------------------ the references

/// A reference: (value, gradient) of valid token `t` of sequence `i` of a batch.
type Reference<'a> = Box<dyn Fn(&Batch, usize, usize) -> (f64, f64) + 'a>;

fn ppo_ref(cfg: PpoClipConfig<f64>) -> Reference<'static> {
    Box::new(move |b, _, t| {
        let (x, clamped) = clamp(b.x(t), cfg.log_ratio_clamp);
        let rho = x.exp();
        let drho = if clamped { 0.0 } else { rho };
        clipped(
            rho,
            drho,
            b.adv[t],
            cfg.bounds,
            cfg.dual_clip,
            cfg.delta_cap,
        )
    })
}

fn gspo_ref(cfg: GspoConfig<f64>) -> Reference<'static> {
    Box::new(move |b, i, _| {
        // s = exp(mean x); L_i = mean over the tokens of the term with their own A_t;
        // ∂L_i/∂lp_t = (∂L_i/∂x̄)/n.
        let toks = b.valid(i);
        let n = toks.len() as f64;
        let sum = toks.iter().map(|&t| b.x(t)).sum::<f64>();
        let (xbar, clamped) = clamp(sum / n, cfg.log_ratio_clamp);
        let s = xbar.exp();
        let ds = if clamped { 0.0 } else { s };
        let terms: Vec<(f64, f64)> = toks
            .iter()
            .map(|&t| clipped(s, ds, b.adv[t], cfg.bounds, cfg.dual_clip, cfg.delta_cap))
            .collect();
        let value = terms.iter().map(|p| p.0).sum::<f64>() / n;
        let dx = terms.iter().map(|p| p.1).sum::<f64>() / n;
        (value, dx / n)
    })
}

fn gspo_token_ref(cfg: GspoTokenConfig<f64>) -> Reference<'static> {
    Box::new(move |b, i, t| {
        // r_t = exp(min(x̄_i, max)) with the token's own gradient path (∂r_t/∂lp_t = r_t).
        let toks = b.valid(i);
        let xbar = toks.iter().map(|&t| b.x(t)).sum::<f64>() / toks.len() as f64;
        let capped = cfg.seq_log_ratio_max.is_some_and(|m| xbar > m);
        let r = cfg.seq_log_ratio_max.map_or(xbar, |m| xbar.min(m)).exp();
        clipped(
            r,
            if capped { 0.0 } else { r },
            b.adv[t],
            cfg.bounds,
            None,
            None,
        )
    })
}

fn gmpo_ref(cfg: GmpoConfig<f64>) -> Reference<'static> {
    Box::new(move |b, i, t| {
        // x'_t = sgn(A)·min(sgn(A)·x, sgn(A)·clip(x, −ε_lo, ε_hi)) (0 for A = 0);
        // r_i = exp(Σx'/(n + ε)), Ā_i = ΣA/(n + ε), L_i = −Ā_i·r_i.
        let transformed = |t: usize| {
            let (x, a) = (b.x(t), b.adv[t]);
            let c = x.clamp(-cfg.eps_low, cfg.eps_high);
            if a > 0.0 {
                (x.min(c), f64::from(u8::from(x <= c)))
            } else if a < 0.0 {
                (x.max(c), f64::from(u8::from(x >= c)))
            } else {
                (0.0, 0.0)
            }
        };
        let toks = b.valid(i);
        let den = toks.len() as f64 + cfg.mean_eps;
        let sum = toks.iter().map(|&t| transformed(t).0).sum::<f64>();
        let (m, clamped) = clamp(sum / den, cfg.log_ratio_clamp);
        let r = m.exp();
        let abar = toks.iter().map(|&t| b.adv[t]).sum::<f64>() / den;
        let grad = if clamped {
            0.0
        } else {
            -abar * r * transformed(t).1 / den
        };
        (-abar * r, grad)
    })
}

fn sapo_ref(cfg: SapoConfig<f64>) -> Reference<'static> {
    Box::new(move |b, _, t| {
        // L = −σ(τ(ρ − 1))·(4/τ)·A, ∂L/∂lp = −4·A·σ(1 − σ)·ρ.
        let a = b.adv[t];
        let tau = if a > 0.0 { cfg.tau_pos } else { cfg.tau_neg };
        let (x, clamped) = clamp(b.x(t), cfg.log_ratio_clamp);
        let rho = x.exp();
        let sig = 1.0 / (1.0 + (-tau * (rho - 1.0)).exp());
        let grad = if clamped {
            0.0
        } else {
            -4.0 * a * sig * (1.0 - sig) * rho
        };
        (-sig * 4.0 / tau * a, grad)
    })
}

fn cispo_ref(cfg: CispoConfig<f64>) -> Reference<'static> {
    Box::new(move |b, _, t| {
        // L = −sg(w)·A·lp with w = clamp(ρ, lo, hi) (verl) or min(ρ, ε_max) (TRL).
        let rho = clamp(b.x(t), cfg.log_ratio_clamp).0.exp();
        let w = match cfg.weight {
            CispoWeight::Clamp(bounds) => rho.clamp(bounds.lo, bounds.hi),
            CispoWeight::Cap(m) => rho.min(m),
        };
        (-w * b.adv[t] * b.lp[t], -w * b.adv[t])
    })
}

fn sym(e: f64) -> RatioBounds<f64> {
    RatioBounds::symmetric(e).unwrap()
}

fn ppo_cfgs() -> [PpoClipConfig<f64>; 4] {
    [
        PpoClipConfig::default(),
        PpoClipConfig {
            bounds: RatioBounds::asymmetric(0.2, 0.28).unwrap(),
            ..Default::default()
        },
        PpoClipConfig {
            dual_clip: Some(1.5),
            ..Default::default()
        },
        PpoClipConfig {
            delta_cap: Some(1.3),
            log_ratio_clamp: None,
            ..Default::default()
        },
    ]
}

fn gspo_cfgs() -> [GspoConfig<f64>; 3] {
    [
        GspoConfig::default(),
        GspoConfig {
            bounds: sym(0.2),
            dual_clip: Some(1.5),
            ..GspoConfig::default()
        },
        GspoConfig {
            bounds: sym(0.2),
            delta_cap: Some(1.3),
            log_ratio_clamp: None,
            ..GspoConfig::default()
        },
    ]
}

fn gspo_token_cfgs() -> [GspoTokenConfig<f64>; 2] {
    [
        GspoTokenConfig::default(),
        GspoTokenConfig {
            bounds: sym(0.2),
            seq_log_ratio_max: Some(0.5),
        },
    ]
}

fn gmpo_cfgs() -> [GmpoConfig<f64>; 2] {
    [
        GmpoConfig::default(),
        GmpoConfig {
            mean_eps: 1e-8,
            log_ratio_clamp: Some(0.3),
            ..GmpoConfig::default()
        },
    ]
}

fn sapo_cfgs() -> [SapoConfig<f64>; 2] {
    [
        SapoConfig::default(),
        SapoConfig {
            tau_pos: 0.5,
            tau_neg: 2.0,
            log_ratio_clamp: None,
        },
    ]
}

fn cispo_cfgs() -> [CispoConfig<f64>; 2] {
    [CispoConfig::default(), CispoConfig::trl(0.2, Some(1.28))]
}

/// Every loss and configuration: a name, the f64 reference, and the loss run in f64 and in
/// f32 (configurations converted field by field) on a batch.
type Run64 = Box<dyn Fn(&Batch, &mut [f64], &mut [f64])>;
type Run32 = Box<dyn Fn(&Batch32, &mut [f32], &mut [f32])>;

struct Batch32 {
    lp: Vec<f32>,
    old: Vec<f32>,
    adv: Vec<f32>,
    rows: usize,
    cols: usize,
    mask: Vec<bool>,
}

impl Batch32 {
    fn inputs(&self) -> PolicyInputs<'_, f32> {
        PolicyInputs {
            lp: &self.lp,
            old: &self.old,
            adv: &self.adv,
            tokens: Tokens::padded(self.rows, self.cols, Some(&self.mask)),
        }
    }
}

fn b32(b: RatioBounds<f64>) -> RatioBounds<f32> {
    RatioBounds {
        lo: b.lo as f32,
        hi: b.hi as f32,
    }
}

fn o32(x: Option<f64>) -> Option<f32> {
    x.map(|x| x as f32)
}

/// A loss signature: configuration, inputs, value and gradient out.
type LossFn<C, T> = fn(
    &C,
    &PolicyInputs<'_, T>,
    &mut [T],
    &mut [T],
) -> grpo_core::Result<grpo_core::loss::LossDiagnostics<T>>;

/// One entry of [`losses`]: the loss in f64 with `c` and in f32 with `c32`.
fn entry<C: std::fmt::Debug + 'static, D: 'static>(
    name: &str,
    c: C,
    c32: D,
    reference: Reference<'static>,
    f64_loss: LossFn<C, f64>,
    f32_loss: LossFn<D, f32>,
) -> (String, Reference<'static>, Run64, Run32) {
    (
        format!("{name} {c:?}"),
        reference,
        Box::new(move |b, v, g| {
            f64_loss(&c, &b.inputs(), v, g).unwrap();
        }),
        Box::new(move |b, v, g| {
            f32_loss(&c32, &b.inputs(), v, g).unwrap();
        }),
    )
}

fn losses() -> Vec<(String, Reference<'static>, Run64, Run32)> {
    let mut v: Vec<(String, Reference<'static>, Run64, Run32)> = Vec::new();
    for c in ppo_cfgs() {
        let c32 = PpoClipConfig {
            bounds: b32(c.bounds),
            dual_clip: o32(c.dual_clip),
            delta_cap: o32(c.delta_cap),
            log_ratio_clamp: o32(c.log_ratio_clamp),
        };
        v.push(entry("ppo_clip", c, c32, ppo_ref(c), ppo_clip, ppo_clip));
    }
    for c in gspo_cfgs() {
        let c32 = GspoConfig {
            bounds: b32(c.bounds),
            dual_clip: o32(c.dual_clip),
            delta_cap: o32(c.delta_cap),
            log_ratio_clamp: o32(c.log_ratio_clamp),
        };
        v.push(entry("gspo", c, c32, gspo_ref(c), gspo, gspo));
    }
    for c in gspo_token_cfgs() {
        let c32 = GspoTokenConfig {
            bounds: b32(c.bounds),
            seq_log_ratio_max: o32(c.seq_log_ratio_max),
        };
        v.push(entry(
            "gspo_token",
            c,
            c32,
            gspo_token_ref(c),
            gspo_token,
            gspo_token,
        ));
    }
    for c in gmpo_cfgs() {
        let c32 = GmpoConfig {
            eps_low: c.eps_low as f32,
            eps_high: c.eps_high as f32,
            log_ratio_clamp: o32(c.log_ratio_clamp),
            mean_eps: c.mean_eps as f32,
        };
        v.push(entry("gmpo", c, c32, gmpo_ref(c), gmpo, gmpo));
    }
    for c in sapo_cfgs() {
        let c32 = SapoConfig {
            tau_pos: c.tau_pos as f32,
            tau_neg: c.tau_neg as f32,
            log_ratio_clamp: o32(c.log_ratio_clamp),
        };
        v.push(entry("sapo", c, c32, sapo_ref(c), sapo, sapo));
    }
    for c in cispo_cfgs() {
        let c32 = CispoConfig {
            weight: match c.weight {
                CispoWeight::Clamp(b) => CispoWeight::Clamp(b32(b)),
                CispoWeight::Cap(m) => CispoWeight::Cap(m as f32),
            },
            log_ratio_clamp: o32(c.log_ratio_clamp),
        };
        v.push(entry("cispo", c, c32, cispo_ref(c), cispo, cispo));
    }
    v
}

/// The batch with every input rounded to f32, in both precisions.
fn rounded(b: &Batch) -> (Batch, Batch32) {
    let r = |v: &[f64]| -> Vec<f32> { v.iter().map(|&x| x as f32).collect() };
    let w = |v: &[f32]| -> Vec<f64> { v.iter().map(|&x| f64::from(x)).collect() };
    let (lp, old, adv) = (r(&b.lp), r(&b.old), r(&b.adv));
    let b64 = Batch {
        lp: w(&lp),
        old: w(&old),
        adv: w(&adv),
        ..b.clone()
    };
    let b32 = Batch32 {
        lp,
        old,
        adv,
        rows: b.rows,
        cols: b.cols,
        mask: b.mask.clone(),
    };
    (b64, b32)
}

/// The batch with every current log-prob moved by `h` (so every log-ratio and mean by `h`).
fn shifted(b: &Batch, h: f64) -> Batch {
    Batch {
        lp: b.lp.iter().map(|l| l + h).collect(),
        ..b.clone()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn losses_match_their_formulas(b in batch()) {
        let n = b.lp.len();
        for (name, reference, run, _) in losses() {
            let (mut v, mut g) = (vec![0.0; n], vec![0.0; n]);
            run(&b, &mut v, &mut g);
            compare(&b, (&v, &g), &|i, t| reference(&b, i, t)).map_err(|e| TestCaseError::fail(format!("{name}: {e}")))?;
        }
    }

    #[test]
    fn f32_losses_match_the_f64_formulas(b in batch()) {
        // The f32 losses on f32-rounded inputs against the f64 reference on the same inputs:
        // values within 4e-6 relative (a few roundings of e^x and the products, and the sums
        // of a sequence's terms); gradients too, except next to a kink (a clip bound, the δ
        // cap, a clamp), where an f32 rounding may put the token on the other branch: a token
        // whose reference gradient changes when every log-ratio moves by ±1e-4 is skipped.
        let (b64, b32) = rounded(&b);
        let n = b.lp.len();
        let (lo, hi) = (shifted(&b64, -1e-4), shifted(&b64, 1e-4));
        for (name, reference, _, run) in losses() {
            let (mut v, mut g) = (vec![0f32; n], vec![0f32; n]);
            run(&b32, &mut v, &mut g);
            for i in 0..b.rows {
                for t in b64.valid(i) {
                    let (want_v, want_g) = reference(&b64, i, t);
                    let tol = |w: f64| 4e-6 * (1.0 + w.abs());
                    let (v, g) = (f64::from(v[t]), f64::from(g[t]));
                    prop_assert!((v - want_v).abs() <= tol(want_v), "{}: value at {}: {} vs {}", name, t, v, want_v);
                    let smooth = [&lo, &hi].iter().all(|s| {
                        let gs = reference(s, i, t).1;
                        (gs - want_g).abs() <= 1e-3 * (1.0 + want_g.abs())
                    });
                    if smooth {
                        prop_assert!((g - want_g).abs() <= tol(want_g), "{}: gradient at {}: {} vs {}", name, t, g, want_g);
                    }
                }
            }
        }
    }

    #[test]
    fn reinforce_matches_its_formula(b in batch()) {
        let n = b.lp.len();
        let (mut v, mut g) = (vec![0.0; n], vec![0.0; n]);
        let weights: Vec<f64> = (0..n).map(|t| 0.5 + (t % 3) as f64 * 0.25).collect();
        reinforce(&b.lp, &b.adv, Some(&weights), b.tokens(), &mut v, &mut g).unwrap();
        compare(&b, (&v, &g), &|_, t| (-weights[t] * b.adv[t] * b.lp[t], -weights[t] * b.adv[t]))?;
    }
}

#[test]
fn entropy_bonus_values_masks_and_errors() {
    use grpo_core::Error;
    use grpo_core::loss::entropy_bonus;
    // Row 0: H = (2, NaN masked), row 1: H = (0.5, 1): L = −c·H, ∂L/∂H = −c, 0 where masked
    // (a masked NaN is not read).
    let h = [2.0f64, f64::NAN, 0.5, 1.0];
    let m = [true, false, true, true];
    let tok = Tokens::padded(2, 2, Some(&m));
    let (mut v, mut g) = ([9.0; 4], [9.0; 4]);
    let d = entropy_bonus(0.01, &h, tok, &mut v, &mut g).unwrap();
    assert_eq!(v, [-0.02, 0.0, -0.005, -0.01]);
    assert_eq!(g, [-0.01, 0.0, -0.01, -0.01]);
    assert_eq!(d.tokens, 3);
    // Errors leave both outputs untouched: a NaN entropy at a valid position, a non-finite
    // coefficient, mismatched lengths, a mask of the wrong length.
    let nan_valid = [2.0f64, 1.0, f64::NAN, 1.0];
    let short_mask = [true; 3];
    let cases: [(f64, &[f64], Tokens<'_>, usize, usize); 5] = [
        (0.01, &nan_valid, tok, 4, 4),
        (f64::NAN, &h, tok, 4, 4),
        (0.01, &h, tok, 3, 4),
        (0.01, &h, tok, 4, 5),
        (0.01, &h, Tokens::padded(2, 2, Some(&short_mask)), 4, 4),
    ];
    for (k, (c, h, tok, nv, ng)) in cases.into_iter().enumerate() {
        let (mut v, mut g) = (vec![9.0; nv], vec![9.0; ng]);
        let r = entropy_bonus(c, h, tok, &mut v, &mut g);
        assert!(r.is_err(), "case {k}");
        assert!(v.iter().chain(&g).all(|&x| x == 9.0), "case {k} wrote");
    }
    let (mut v, mut g) = ([9.0; 4], [9.0; 4]);
    assert_eq!(
        entropy_bonus(0.01, &nan_valid, tok, &mut v, &mut g),
        Err(Error::NonFinite {
            what: "entropy",
            index: 2
        })
    );
}
