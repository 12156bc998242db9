//! Property tests of the rank estimators (GOPO, G²RPO), masked whitening, REINFORCE++ returns,
//! REINFORCE++-baseline, GAE, ReMax, group filters and overlong shaping, against naive f64
//! references written from the formulas (explicit sums, not the library's recurrences).

use grpo_core::Error;
use grpo_core::Preset;
use grpo_core::advantage::baseline::{BaselineConfig, reinforce_pp_baseline};
use grpo_core::advantage::filter::{
    DynamicSamplingConfig, RangeFilterConfig, dynamic_sampling_keep, dynamic_sampling_keep_correct,
    range_filter_keep,
};
use grpo_core::advantage::gae::{GaeConfig, gae};
use grpo_core::advantage::overlong::{OverlongConfig, overlong_penalty};
use grpo_core::advantage::rank::{G2rpoConfig, GopoConfig, g2rpo, gopo, rank_scratch_len};
use grpo_core::advantage::returns::{MaskedTokens, ReturnsConfig, reinforce_pp_returns, remax};
use grpo_core::advantage::whiten::{
    WhitenConfig, apply_whitening, apply_whitening_in_place, whiten, whiten_moments,
};
use grpo_core::advantage::{NanPolicy, SingletonRule};
use grpo_core::layout::{Groups, Tokens};
use grpo_core::stats::{Bessel, TiePolicy, norm_quantile};
use grpo_tests::close;
use proptest::prelude::*;

// ---------------------------------------------------------------- batches of token sequences

/// A batch of sequences: per-sequence token values and validity, with garbage (NaN, ±∞) in
/// every masked slot.
#[derive(Debug, Clone)]
struct Batch {
    seqs: Vec<Vec<(f64, bool)>>,
}

impl Batch {
    fn packed(&self) -> (Vec<usize>, Vec<bool>, Vec<f64>) {
        let mut cu = vec![0];
        let (mut mask, mut vals) = (vec![], vec![]);
        for s in &self.seqs {
            for &(v, m) in s {
                mask.push(m);
                vals.push(v);
            }
            cu.push(mask.len());
        }
        (cu, mask, vals)
    }

    /// Padded to the longest sequence (+1 so padding always exists); padding holds NaN.
    fn padded(&self) -> (usize, Vec<bool>, Vec<f64>) {
        let cols = self.seqs.iter().map(Vec::len).max().unwrap_or(0) + 1;
        let (mut mask, mut vals) = (vec![], vec![]);
        for s in &self.seqs {
            for j in 0..cols {
                let (v, m) = s.get(j).copied().unwrap_or((f64::NAN, false));
                mask.push(m);
                vals.push(v);
            }
        }
        (cols, mask, vals)
    }

    fn valid_values(&self) -> Vec<f64> {
        self.seqs
            .iter()
            .flatten()
            .filter(|(_, m)| *m)
            .map(|(v, _)| *v)
            .collect()
    }
}

fn token() -> impl Strategy<Value = (f64, bool)> {
    prop_oneof![
        4 => (-10.0f64..10.0).prop_map(|v| (v, true)),
        1 => prop_oneof![Just(f64::NAN), Just(f64::INFINITY), Just(-1e308)].prop_map(|v| (v, false)),
    ]
}

fn batch() -> impl Strategy<Value = Batch> {
    prop::collection::vec(prop::collection::vec(token(), 0..8), 1..6)
        .prop_map(|seqs| Batch { seqs })
}

/// Two-pass mean and variance of a slice (f64 reference).
fn mean_var(xs: &[f64], bessel: Bessel) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let m2: f64 = xs.iter().map(|x| (x - mean) * (x - mean)).sum();
    let d = match bessel {
        Bessel::Unbiased => n - 1.0,
        Bessel::Population => n,
    };
    (mean, if d > 0.0 { m2 / d } else { 0.0 })
}

fn reference_whiten(raw: &[f64], valid: &[bool], cfg: &WhitenConfig<f64>) -> Vec<f64> {
    let vals: Vec<f64> = raw
        .iter()
        .zip(valid)
        .filter(|p| *p.1)
        .map(|p| *p.0)
        .collect();
    let (mean, var) = mean_var(&vals, cfg.bessel);
    let denom = match cfg.eps_placement {
        grpo_core::advantage::whiten::EpsPlacement::Add => var + cfg.eps,
        grpo_core::advantage::whiten::EpsPlacement::Floor => var.max(cfg.eps),
    };
    raw.iter()
        .zip(valid)
        .map(|(&x, &m)| if m { (x - mean) / denom.sqrt() } else { 0.0 })
        .collect()
}

// ---------------------------------------------------------------- whitening

proptest! {
    #[test]
    fn whitening_mean_zero_unit_variance_ignores_garbage(b in batch(), openrlhf in any::<bool>()) {
        let valid = b.valid_values();
        if valid.len() < 2 {
            return Ok(());
        }
        let (_, var) = mean_var(&valid, Bessel::Population);
        if var <= 1e-3 {
            return Ok(());
        }
        let preset = if openrlhf { Preset::OpenRlhf } else { Preset::Verl };
        let cfg = WhitenConfig::<f64>::from_preset(preset);
        let (cu, mask, vals) = b.packed();
        let (cols, pmask, pvals) = b.padded();
        let mut out_p = vec![f64::NAN; vals.len()];
        let mut out_d = vec![f64::NAN; pvals.len()];
        whiten(&vals, &Tokens::packed(&cu, Some(&mask)), &cfg, &mut out_p).unwrap();
        whiten(&pvals, &Tokens::padded(b.seqs.len(), cols, Some(&pmask)), &cfg, &mut out_d).unwrap();
        let w: Vec<f64> = out_p.iter().zip(&mask).filter(|p| *p.1).map(|p| *p.0).collect();
        let wd: Vec<f64> = out_d.iter().zip(&pmask).filter(|p| *p.1).map(|p| *p.0).collect();
        // Same valid tokens in the same order: the two layouts agree bit for bit.
        prop_assert_eq!(&w, &wd);
        let (m, v) = mean_var(&w, cfg.bessel);
        prop_assert!(m.abs() < 1e-9, "mean {}", m);
        // var/(var + 1e-8) or var/max(var, 1e-8): 1 within 1e-5 since var > 1e-3.
        prop_assert!((v - 1.0).abs() < 1e-5, "var {}", v);
        prop_assert!(out_p.iter().all(|x| x.is_finite()));
        prop_assert!(out_p.iter().zip(&mask).all(|(x, m)| *m || *x == 0.0));
        let want = reference_whiten(&vals, &mask, &cfg);
        for (x, y) in out_p.iter().zip(&want) {
            prop_assert!(close(*x, *y, 1e-10, 1e-10), "{} vs {}", x, y);
        }
    }

    #[test]
    fn merged_shard_moments_whiten_like_one_batch(b in batch(), split in 0usize..6) {
        let (cu, mask, vals) = b.packed();
        let tokens = Tokens::packed(&cu, Some(&mask));
        if b.valid_values().len() < 2 {
            return Ok(());
        }
        let cfg = WhitenConfig::<f64>::default();
        let mut whole = vec![0.0; vals.len()];
        whiten(&vals, &tokens, &cfg, &mut whole).unwrap();
        // Shards: sequences [0, split) and [split, B).
        let split = split.min(b.seqs.len());
        let cut = cu[split];
        let (cu_a, cu_b): (Vec<usize>, Vec<usize>) =
            (cu[..=split].to_vec(), cu[split..].iter().map(|c| c - cut).collect());
        let ta = Tokens::packed(&cu_a, Some(&mask[..cut]));
        let tb = Tokens::packed(&cu_b, Some(&mask[cut..]));
        let global = whiten_moments(&vals[..cut], &ta)
            .unwrap()
            .merge(whiten_moments(&vals[cut..], &tb).unwrap());
        let mut sharded = vec![0.0; vals.len()];
        apply_whitening(&vals[..cut], &ta, &global, &cfg, &mut sharded[..cut]).unwrap();
        let mut in_place = vals[cut..].to_vec();
        apply_whitening_in_place(&mut in_place, &tb, &global, &cfg).unwrap();
        sharded[cut..].copy_from_slice(&in_place);
        for (x, y) in whole.iter().zip(&sharded) {
            prop_assert!(close(*x, *y, 1e-12, 1e-12), "{} vs {}", x, y);
        }
    }

    #[test]
    fn whitening_f32_matches_f64(b in batch()) {
        let (cu, mask, vals) = b.packed();
        if b.valid_values().len() < 2 {
            return Ok(());
        }
        let (_, var) = mean_var(&b.valid_values(), Bessel::Unbiased);
        if var <= 1e-2 {
            return Ok(());
        }
        let v32: Vec<f32> = vals.iter().map(|&v| v as f32).collect();
        let t = Tokens::packed(&cu, Some(&mask));
        let mut o32 = vec![0.0f32; vals.len()];
        whiten(&v32, &t, &WhitenConfig::default(), &mut o32).unwrap();
        let v64: Vec<f64> = v32.iter().map(|&v| v as f64).collect();
        let want = reference_whiten(&v64, &mask, &WhitenConfig::default());
        for (x, y) in o32.iter().zip(&want) {
            prop_assert!(close(*x as f64, *y, 1e-4, 1e-4), "{} vs {}", x, y);
        }
    }
}

// ---------------------------------------------------------------- returns and GAE

/// The (reward, value) chain a position bootstraps from, per masked-token mode, as an explicit
/// list: Reset = the run of valid tokens starting at t; Skip = every later valid token;
/// ZeroFill = every later position, masked ones as (0, 0).
fn chain(seq: &[(f64, f64, bool)], t: usize, mode: MaskedTokens) -> Vec<(f64, f64)> {
    let mut c = vec![];
    for &(r, v, m) in &seq[t..] {
        match (mode, m) {
            (_, true) => c.push((r, v)),
            (MaskedTokens::Reset, false) => break,
            (MaskedTokens::Skip, false) => {}
            (MaskedTokens::ZeroFill, false) => c.push((0.0, 0.0)),
        }
    }
    c
}

/// G_t = Σ_k γ^k r_k over the chain.
fn ref_return(c: &[(f64, f64)], gamma: f64) -> f64 {
    c.iter()
        .enumerate()
        .map(|(k, (r, _))| gamma.powi(k as i32) * r)
        .sum()
}

/// ℓ_t = Σ_k (γλ)^k (r_k + γ V_{k+1} − V_k), V past the chain = 0.
fn ref_gae(c: &[(f64, f64)], gamma: f64, lambda: f64) -> f64 {
    (0..c.len())
        .map(|k| {
            let next_v = c.get(k + 1).map_or(0.0, |p| p.1);
            (gamma * lambda).powi(k as i32) * (c[k].0 + gamma * next_v - c[k].1)
        })
        .sum()
}

fn rv_batch() -> impl Strategy<Value = Vec<Vec<(f64, f64, bool)>>> {
    let tok = prop_oneof![
        4 => (-5.0f64..5.0, -5.0f64..5.0).prop_map(|(r, v)| (r, v, true)),
        1 => Just((f64::NAN, f64::INFINITY, false)),
    ];
    prop::collection::vec(prop::collection::vec(tok, 0..7), 1..5)
}

fn mode() -> impl Strategy<Value = MaskedTokens> {
    prop_oneof![
        Just(MaskedTokens::Reset),
        Just(MaskedTokens::Skip),
        Just(MaskedTokens::ZeroFill)
    ]
}

fn flatten(seqs: &[Vec<(f64, f64, bool)>]) -> (Vec<usize>, Vec<f64>, Vec<f64>, Vec<bool>) {
    let mut cu = vec![0];
    let (mut r, mut v, mut m) = (vec![], vec![], vec![]);
    for s in seqs {
        for &(a, b, c) in s {
            r.push(a);
            v.push(b);
            m.push(c);
        }
        cu.push(r.len());
    }
    (cu, r, v, m)
}

proptest! {
    #[test]
    fn returns_match_explicit_sums(seqs in rv_batch(), gamma in 0.0f64..=1.0, md in mode(), w in any::<bool>()) {
        let (cu, r, _, m) = flatten(&seqs);
        let tokens = Tokens::packed(&cu, Some(&m));
        let cfg = ReturnsConfig { gamma, masked: md, whiten: None };
        let (mut a, mut g) = (vec![f64::NAN; r.len()], vec![f64::NAN; r.len()]);
        reinforce_pp_returns(&r, &tokens, &cfg, &mut a, &mut g).unwrap();
        let mut want = vec![];
        for s in &seqs {
            for t in 0..s.len() {
                want.push(if s[t].2 { ref_return(&chain(s, t, md), gamma) } else { 0.0 });
            }
        }
        for (x, y) in g.iter().zip(&want) {
            prop_assert!(close(*x, *y, 1e-12, 1e-12), "{} vs {}", x, y);
        }
        prop_assert_eq!(&a, &g);
        // Whitened: the reference whitening of the reference returns.
        if w && m.iter().filter(|x| **x).count() >= 1 {
            let cfg = ReturnsConfig { whiten: Some(WhitenConfig::default()), ..cfg };
            reinforce_pp_returns(&r, &tokens, &cfg, &mut a, &mut g).unwrap();
            let ww = reference_whiten(&want, &m, &WhitenConfig::default());
            for (x, y) in a.iter().zip(&ww) {
                prop_assert!(close(*x, *y, 1e-7, 1e-7), "{} vs {}", x, y);
            }
        }
    }

    #[test]
    fn gae_matches_explicit_sums(seqs in rv_batch(), gamma in 0.0f64..=1.0, lambda in 0.0f64..=1.0, md in mode()) {
        let (cu, r, v, m) = flatten(&seqs);
        let tokens = Tokens::packed(&cu, Some(&m));
        let cfg = GaeConfig { gamma, lambda, masked: md, whiten: None };
        let (mut a, mut g) = (vec![f64::NAN; r.len()], vec![f64::NAN; r.len()]);
        gae(&r, &v, &tokens, &cfg, &mut a, &mut g).unwrap();
        let mut j = 0;
        for s in &seqs {
            for t in 0..s.len() {
                let (want_a, want_g) = if s[t].2 {
                    let l = ref_gae(&chain(s, t, md), gamma, lambda);
                    (l, l + s[t].1)
                } else {
                    (0.0, 0.0)
                };
                prop_assert!(close(a[j], want_a, 1e-11, 1e-11), "{} vs {}", a[j], want_a);
                prop_assert!(close(g[j], want_g, 1e-11, 1e-11), "{} vs {}", g[j], want_g);
                j += 1;
            }
        }
    }

    #[test]
    fn gae_telescopes_at_gamma_lambda_one(seqs in rv_batch()) {
        // γ = λ = 1, Skip: ℓ_t = Σ_{valid t' ≥ t} r_{t'} − V_t (the value terms telescope).
        let (cu, r, v, m) = flatten(&seqs);
        let tokens = Tokens::packed(&cu, Some(&m));
        let cfg = GaeConfig { gamma: 1.0, lambda: 1.0, masked: MaskedTokens::Skip, whiten: None };
        let (mut a, mut g) = (vec![0.0; r.len()], vec![0.0; r.len()]);
        gae(&r, &v, &tokens, &cfg, &mut a, &mut g).unwrap();
        let mut j = 0;
        for s in &seqs {
            for t in 0..s.len() {
                if s[t].2 {
                    let to_go: f64 = s[t..].iter().filter(|x| x.2).map(|x| x.0).sum();
                    prop_assert!(close(a[j], to_go - s[t].1, 1e-11, 1e-11));
                    prop_assert!(close(g[j], to_go, 1e-11, 1e-11));
                }
                j += 1;
            }
        }
    }

    #[test]
    fn remax_is_reward_to_go_minus_baseline(seqs in rv_batch(), base in -3.0f64..3.0) {
        let (cu, r, _, m) = flatten(&seqs);
        let tokens = Tokens::packed(&cu, Some(&m));
        let baselines = vec![base; seqs.len()];
        let (mut a, mut g) = (vec![f64::NAN; r.len()], vec![f64::NAN; r.len()]);
        remax(&r, &tokens, &baselines, &mut a, &mut g).unwrap();
        let mut j = 0;
        for s in &seqs {
            for t in 0..s.len() {
                let to_go: f64 = s[t..].iter().filter(|x| x.2).map(|x| x.0).sum();
                let (wa, wg) = if s[t].2 { (to_go - base, to_go) } else { (0.0, 0.0) };
                prop_assert!(close(a[j], wa, 1e-12, 1e-12) && close(g[j], wg, 1e-12, 1e-12));
                j += 1;
            }
        }
    }
}

// ---------------------------------------------------------------- REINFORCE++-baseline

proptest! {
    #[test]
    fn baseline_is_whitened_broadcast_of_centered_scores(
        g in 1usize..5, k in 1usize..4, lens in prop::collection::vec(0usize..5, 16),
        // Scores up to ±30 in one case of five, so that OpenRLHF's ±10 clamp of the centred
        // scores engages.
        scores in prop::collection::vec(prop_oneof![4 => -5.0f64..5.0, 1 => -30.0f64..30.0], 16),
        openrlhf in any::<bool>(),
    ) {
        let n = g * k;
        let scores = &scores[..n];
        let lens = &lens[..n];
        if lens.iter().sum::<usize>() < 2 {
            return Ok(());
        }
        let mut cu = vec![0];
        for l in lens {
            cu.push(cu.last().unwrap() + l);
        }
        let tokens = Tokens::packed(&cu, None);
        let cfg = BaselineConfig::<f64>::from_preset(if openrlhf { Preset::OpenRlhf } else { Preset::Verl });
        let mut out = vec![f64::NAN; cu[n]];
        let rep = reinforce_pp_baseline(scores, Groups::Uniform(g), &tokens, &cfg, &mut out).unwrap();
        // Reference: group mean (a group of one: verl baseline 0, OpenRLHF centered 0).
        let mut raw = vec![];
        for i in 0..n {
            let grp = &scores[i / g * g..(i / g + 1) * g];
            let c = if g == 1 {
                if openrlhf { 0.0 } else { scores[i] }
            } else {
                scores[i] - grp.iter().sum::<f64>() / g as f64
            };
            let c = if openrlhf { c.clamp(-10.0, 10.0) } else { c };
            raw.extend(std::iter::repeat_n(c, lens[i]));
        }
        let want = reference_whiten(&raw, &vec![true; raw.len()], &cfg.whiten.unwrap());
        for (x, y) in out.iter().zip(&want) {
            prop_assert!(close(*x, *y, 1e-7, 1e-7), "{} vs {}", x, y);
        }
        prop_assert_eq!(rep.raw_moments.n, raw.len());
        prop_assert_eq!(rep.diagnostics.singleton_groups, if g == 1 { k } else { 0 });
    }
}

// ---------------------------------------------------------------- GOPO and G²RPO

fn grouped_scores() -> impl Strategy<Value = (usize, Vec<f64>)> {
    // Few distinct values so that ties are common.
    (1usize..7, 1usize..4).prop_flat_map(|(g, k)| {
        (
            Just(g),
            prop::collection::vec(
                prop_oneof![(0i32..4).prop_map(f64::from), -3.0f64..3.0],
                g * k,
            ),
        )
    })
}

/// 1-based rank with 1 = best: ordinal breaks ties by index, average shares the mean.
fn ref_rank_desc(s: &[f64], i: usize, ties: TiePolicy) -> f64 {
    let better = s.iter().filter(|&&x| x > s[i]).count() as f64;
    match ties {
        TiePolicy::Ordinal => 1.0 + better + (0..i).filter(|&j| s[j] == s[i]).count() as f64,
        TiePolicy::Average => {
            1.0 + better + (s.iter().filter(|&&x| x == s[i]).count() as f64 - 1.0) / 2.0
        }
    }
}

proptest! {
    #[test]
    fn gopo_matches_rank_formula((g, s) in grouped_scores(), average in any::<bool>()) {
        if g < 2 {
            return Ok(());
        }
        let ties = if average { TiePolicy::Average } else { TiePolicy::Ordinal };
        let cfg = GopoConfig { ties, nan: NanPolicy::Reject };
        let mut scratch = vec![0; rank_scratch_len(s.len())];
        let mut out = vec![f64::NAN; s.len()];
        gopo(&s, Groups::Uniform(g), &cfg, &mut scratch, &mut out).unwrap();
        for (grp, a) in s.chunks(g).zip(out.chunks(g)) {
            for i in 0..g {
                let want = 2.0 - 4.0 * (ref_rank_desc(grp, i, ties) - 1.0) / (g as f64 - 1.0);
                prop_assert!((a[i] - want).abs() < 1e-14, "{} vs {}", a[i], want);
                for j in 0..g {
                    if grp[i] > grp[j] {
                        prop_assert!(a[i] > a[j]);
                    }
                    if average && grp[i] == grp[j] {
                        prop_assert_eq!(a[i], a[j]);
                    }
                }
            }
            prop_assert!(a.iter().sum::<f64>().abs() < 1e-12);
        }
    }

    #[test]
    fn g2rpo_mean_zero_ties_share_f64((g, s) in grouped_scores()) {
        let mut scratch = vec![0; rank_scratch_len(s.len())];
        let mut out = vec![f64::NAN; s.len()];
        g2rpo(&s, Groups::Uniform(g), &G2rpoConfig::default(), &mut scratch, &mut out).unwrap();
        for (grp, a) in s.chunks(g).zip(out.chunks(g)) {
            check_g2rpo_group(grp, a, 1e-13)?;
        }
    }

    #[test]
    fn g2rpo_mean_zero_ties_share_f32((g, s) in grouped_scores()) {
        let s32: Vec<f32> = s.iter().map(|&x| x as f32).collect();
        let mut scratch = vec![0; rank_scratch_len(s.len())];
        let mut out = vec![f32::NAN; s.len()];
        g2rpo(&s32, Groups::Uniform(g), &G2rpoConfig::default(), &mut scratch, &mut out).unwrap();
        for (grp, a) in s32.chunks(g).zip(out.chunks(g)) {
            let grp: Vec<f64> = grp.iter().map(|&x| x as f64).collect();
            let a: Vec<f64> = a.iter().map(|&x| x as f64).collect();
            check_g2rpo_group(&grp, &a, 1e-7)?;
        }
    }
}

/// `tol`: the relative tolerance of the values (f64: the tie averages' rounding; f32: one
/// rounding of each value).
fn check_g2rpo_group(grp: &[f64], a: &[f64], tol: f64) -> Result<(), TestCaseError> {
    let g = grp.len();
    let sum: f64 = a.iter().sum();
    prop_assert!(sum.abs() <= 1e-6 * g as f64, "sum {}", sum);
    for i in 0..g {
        prop_assert!(a[i].is_finite());
        for j in 0..g {
            if grp[i] == grp[j] {
                prop_assert_eq!(a[i], a[j]);
            }
            if grp[i] > grp[j] {
                prop_assert!(a[i] > a[j]);
            }
        }
    }
    // The values: a tie block spanning ascending ranks lo..=hi shares the mean of
    // Φ⁻¹((r − ½)/G) over those ranks (Φ⁻¹ is grpo-core's norm_quantile, tested on its own
    // against Python's NormalDist).
    for i in 0..g {
        let lo = 1 + (0..g).filter(|&j| grp[j] < grp[i]).count();
        let hi = (0..g).filter(|&j| grp[j] <= grp[i]).count();
        let want = (lo..=hi)
            .map(|r| norm_quantile((r as f64 - 0.5) / g as f64).unwrap())
            .sum::<f64>()
            / (hi - lo + 1) as f64;
        prop_assert!(
            (a[i] - want).abs() <= tol * (1.0 + want.abs()),
            "rank {}..={}: {} vs {}",
            lo,
            hi,
            a[i],
            want
        );
    }
    let distinct = (0..g).all(|i| (0..g).all(|j| i == j || grp[i] != grp[j]));
    let mut sorted = a.to_vec();
    sorted.sort_by(f64::total_cmp);
    if distinct || grp.iter().all(|&x| x == grp[0]) {
        // Without ties (or all tied) the values are exactly antisymmetric: the exact sum is 0.
        for i in 0..g {
            prop_assert_eq!(sorted[i], -sorted[g - 1 - i]);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- filters and shaping

proptest! {
    #[test]
    fn filters_agree_on_binary_rewards(g in 1usize..6, flags in prop::collection::vec(any::<bool>(), 18)) {
        let n = g * (18 / g);
        let flags = &flags[..n];
        let metric: Vec<f64> = flags.iter().map(|&c| f64::from(u8::from(c))).collect();
        let k = n / g;
        let (mut a, mut b, mut c) = (vec![false; k], vec![false; k], vec![false; k]);
        let ds = DynamicSamplingConfig::default();
        let na = dynamic_sampling_keep_correct(flags, Groups::Uniform(g), &ds, &mut a).unwrap();
        let nb = dynamic_sampling_keep(&metric, Groups::Uniform(g), &ds, &mut b).unwrap();
        let nc = range_filter_keep(&metric, Groups::Uniform(g), &RangeFilterConfig::default(), &mut c).unwrap();
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(&a, &c);
        prop_assert_eq!((na, nb), (nc, na));
        for (kk, keep) in a.iter().enumerate() {
            let hits = flags[kk * g..(kk + 1) * g].iter().filter(|x| **x).count();
            prop_assert_eq!(*keep, hits > 0 && hits < g);
        }
        // verl keeps groups of one as well.
        let verl = DynamicSamplingConfig::from_preset(Preset::Verl);
        dynamic_sampling_keep(&metric, Groups::Uniform(g), &verl, &mut b).unwrap();
        for (kk, keep) in b.iter().enumerate() {
            prop_assert_eq!(*keep, a[kk] || g == 1);
        }
    }

    #[test]
    fn overlong_is_monotone_and_bounded(max_len in 0usize..200, cache in 0usize..200, factor in 0.0f64..3.0,
                                        lens in prop::collection::vec(0usize..400, 0..20)) {
        let cfg = OverlongConfig { max_len, cache_len: cache.min(max_len), factor };
        let mut out = vec![f64::NAN; lens.len()];
        overlong_penalty(&lens, &cfg, &mut out).unwrap();
        let exp = max_len - cfg.cache_len;
        for (&l, &r) in lens.iter().zip(&out) {
            prop_assert!(r <= 0.0 && r >= -factor);
            if l <= exp { prop_assert_eq!(r, 0.0); }
            if l >= max_len && max_len > exp { prop_assert!((r + factor).abs() < 1e-12); }
            if l > max_len { prop_assert_eq!(r, -factor); }
            if l > exp && l <= max_len {
                let want = (exp as f64 - l as f64) / cfg.cache_len as f64 * factor;
                prop_assert!((r - want).abs() < 1e-12);
            }
        }
    }
}

// ---------------------------------------------------------------- bad input: Err, outputs untouched

#[test]
fn bad_input_errors_leave_outputs_untouched() {
    const S: f64 = 1234.5;
    let mask = [true, true, false];
    let short_mask = [true, true];
    let t = Tokens::padded(1, 3, Some(&mask));
    let (mut a, mut g) = ([S; 3], [S; 3]);

    // Mask length mismatch.
    let bad_mask = Tokens::padded(1, 3, Some(&short_mask));
    assert!(matches!(
        gae(
            &[1.0; 3],
            &[0.0; 3],
            &bad_mask,
            &GaeConfig::default(),
            &mut a,
            &mut g
        ),
        Err(Error::LengthMismatch { what: "mask", .. })
    ));
    assert!(matches!(
        reinforce_pp_returns(
            &[1.0; 3],
            &bad_mask,
            &ReturnsConfig::default(),
            &mut a,
            &mut g
        ),
        Err(Error::LengthMismatch { what: "mask", .. })
    ));
    // GAE γ, λ outside [0, 1].
    for (gamma, lambda) in [
        (1.01, 1.0),
        (1.0, -0.01),
        (f64::NAN, 1.0),
        (1.0, f64::INFINITY),
    ] {
        let cfg = GaeConfig {
            gamma,
            lambda,
            ..GaeConfig::default()
        };
        assert!(matches!(
            gae(&[1.0; 3], &[0.0; 3], &t, &cfg, &mut a, &mut g),
            Err(Error::InvalidParam { .. })
        ));
    }
    // NaN reward at a valid position under the default policy (garbage at the masked one is fine).
    assert_eq!(
        gae(
            &[f64::NAN, 1.0, 0.0],
            &[0.0; 3],
            &t,
            &GaeConfig::default(),
            &mut a,
            &mut g
        ),
        Err(Error::NonFinite {
            what: "rewards",
            index: 0
        })
    );
    // Length mismatch of an output.
    assert!(matches!(
        gae(
            &[1.0; 3],
            &[0.0; 3],
            &t,
            &GaeConfig::default(),
            &mut a,
            &mut g[..2]
        ),
        Err(Error::LengthMismatch {
            what: "returns",
            ..
        })
    ));
    assert_eq!((a, g), ([S; 3], [S; 3]));

    let mut out = [S; 4];
    let mut scratch = [0usize; 4];
    // GOPO with G = 1, empty group, NaN score.
    assert!(matches!(
        gopo(
            &[1.0; 4],
            Groups::Uniform(1),
            &GopoConfig::default(),
            &mut scratch,
            &mut out
        ),
        Err(Error::GroupTooSmall { needed: 2, .. })
    ));
    assert_eq!(
        g2rpo(
            &[1.0; 4],
            Groups::Offsets(&[0, 2, 2, 4]),
            &G2rpoConfig::default(),
            &mut scratch,
            &mut out
        ),
        Err(Error::EmptyGroup { group: 1 })
    );
    assert!(matches!(
        g2rpo(
            &[1.0, 2.0, f64::NAN, 0.0],
            Groups::Uniform(2),
            &G2rpoConfig::default(),
            &mut scratch,
            &mut out
        ),
        Err(Error::NonFinite {
            what: "scores",
            index: 2
        })
    ));
    let rej = BaselineConfig {
        singleton: SingletonRule::Reject,
        ..BaselineConfig::default()
    };
    assert!(matches!(
        reinforce_pp_baseline(
            &[1.0, 2.0, 3.0, 4.0],
            Groups::Offsets(&[0, 3, 4]),
            &Tokens::padded(4, 1, None),
            &rej,
            &mut out
        ),
        Err(Error::GroupTooSmall { group: 1, .. })
    ));
    assert!(matches!(
        whiten(
            &[1.0, 2.0, 3.0],
            &Tokens::padded(1, 3, None),
            &WhitenConfig::default(),
            &mut out
        ),
        Err(Error::LengthMismatch { what: "out", .. })
    ));
    assert_eq!(out, [S; 4]);
}

proptest! {
    #[test]
    fn rank_estimators_follow_scattered_groups((g, s) in grouped_scores(), seed in any::<u64>()) {
        // Scatter the samples: position p holds original sample perm[p], of group perm[p] / g.
        let n = s.len();
        let k = n / g;
        let mut perm: Vec<usize> = (0..n).collect();
        perm.sort_by_key(|&i| (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let shuffled: Vec<f64> = perm.iter().map(|&i| s[i]).collect();
        let ids: Vec<usize> = perm.iter().map(|&i| i / g).collect();
        let mut gs = vec![0; Groups::group_ids_scratch_len(n, k)];
        let scattered = Groups::from_group_ids(&ids, k, &mut gs).unwrap();
        let mut scratch = vec![0; rank_scratch_len(n)];
        let (mut a, mut b) = (vec![f64::NAN; n], vec![f64::NAN; n]);
        g2rpo(&s, Groups::Uniform(g), &G2rpoConfig::default(), &mut scratch, &mut a).unwrap();
        g2rpo(&shuffled, scattered, &G2rpoConfig::default(), &mut scratch, &mut b).unwrap();
        for p in 0..n {
            prop_assert_eq!(b[p], a[perm[p]]);
        }
        if g >= 2 {
            // Average ties do not depend on the order of the members.
            let cfg = GopoConfig { ties: TiePolicy::Average, nan: NanPolicy::Reject };
            gopo(&s, Groups::Uniform(g), &cfg, &mut scratch, &mut a).unwrap();
            gopo(&shuffled, scattered, &cfg, &mut scratch, &mut b).unwrap();
            for p in 0..n {
                prop_assert_eq!(b[p], a[perm[p]]);
            }
        }
    }

    #[test]
    fn nan_exclusion_equals_dropping_the_sample((g, s) in grouped_scores(), drop in 0usize..18) {
        // Under NanPolicy::Exclude a NaN sample gets 0 and the rest rank as if it were absent.
        if g < 3 {
            return Ok(());
        }
        let drop = drop % g; // in group 0
        let mut with_nan = s[..g].to_vec();
        with_nan[drop] = f64::NAN;
        let kept: Vec<f64> = (0..g).filter(|&i| i != drop).map(|i| s[i]).collect();
        let mut scratch = vec![0; g];
        let (mut a, mut b) = (vec![0.0; g], vec![0.0; g - 1]);
        let cfg = G2rpoConfig { nan: NanPolicy::Exclude };
        let d = g2rpo(&with_nan, Groups::Uniform(g), &cfg, &mut scratch, &mut a).unwrap();
        g2rpo(&kept, Groups::Uniform(g - 1), &cfg, &mut scratch, &mut b).unwrap();
        prop_assert_eq!(d.nan_excluded, 1);
        prop_assert_eq!(a[drop], 0.0);
        let rest: Vec<f64> = (0..g).filter(|&i| i != drop).map(|i| a[i]).collect();
        prop_assert_eq!(&rest, &b);
        let cfg = GopoConfig { ties: TiePolicy::Ordinal, nan: NanPolicy::Exclude };
        gopo(&with_nan, Groups::Uniform(g), &cfg, &mut scratch, &mut a).unwrap();
        gopo(&kept, Groups::Uniform(g - 1), &cfg, &mut scratch, &mut b).unwrap();
        let rest: Vec<f64> = (0..g).filter(|&i| i != drop).map(|i| a[i]).collect();
        prop_assert_eq!(&rest, &b);
    }
}

proptest! {
    #[test]
    fn data_parallel_protocol_matches_one_batch(seqs in rv_batch(), split in 0usize..5, lambda in 0.0f64..=1.0) {
        // Each rank runs GAE without whitening, the raw moments are merged, and each rank
        // whitens its shard with the merged moments: same as whitening the whole batch.
        let (cu, r, v, m) = flatten(&seqs);
        if m.iter().filter(|x| **x).count() < 2 {
            return Ok(());
        }
        let cfg = GaeConfig { gamma: 0.9, lambda, masked: MaskedTokens::Skip, whiten: Some(WhitenConfig::default()) };
        let n = r.len();
        let (mut whole, mut ret) = (vec![0.0; n], vec![0.0; n]);
        gae(&r, &v, &Tokens::packed(&cu, Some(&m)), &cfg, &mut whole, &mut ret).unwrap();
        let split = split.min(seqs.len());
        let cut = cu[split];
        let cu_a = cu[..=split].to_vec();
        let cu_b: Vec<usize> = cu[split..].iter().map(|c| c - cut).collect();
        let ta = Tokens::packed(&cu_a, Some(&m[..cut]));
        let tb = Tokens::packed(&cu_b, Some(&m[cut..]));
        let raw = GaeConfig { whiten: None, ..cfg };
        let (mut adv, mut ret2) = (vec![0.0; n], vec![0.0; n]);
        let ra = gae(&r[..cut], &v[..cut], &ta, &raw, &mut adv[..cut], &mut ret2[..cut]).unwrap();
        let rb = gae(&r[cut..], &v[cut..], &tb, &raw, &mut adv[cut..], &mut ret2[cut..]).unwrap();
        let global = ra.raw_moments.merge(rb.raw_moments);
        apply_whitening_in_place(&mut adv[..cut], &ta, &global, &WhitenConfig::default()).unwrap();
        apply_whitening_in_place(&mut adv[cut..], &tb, &global, &WhitenConfig::default()).unwrap();
        prop_assert_eq!(&ret, &ret2);
        for (x, y) in whole.iter().zip(&adv) {
            prop_assert!(close(*x, *y, 1e-9, 1e-9), "{} vs {}", x, y);
        }
    }

    #[test]
    fn gae_and_returns_f32_close_to_f64_reference(seqs in rv_batch(), gamma in 0.0f64..=1.0, lambda in 0.0f64..=1.0, md in mode()) {
        let (cu, r, v, m) = flatten(&seqs);
        let r32: Vec<f32> = r.iter().map(|&x| x as f32).collect();
        let v32: Vec<f32> = v.iter().map(|&x| x as f32).collect();
        let tokens = Tokens::packed(&cu, Some(&m));
        let (g32, l32) = (gamma as f32, lambda as f32);
        let cfg = GaeConfig { gamma: g32, lambda: l32, masked: md, whiten: None };
        let (mut a, mut g) = (vec![0.0f32; r.len()], vec![0.0f32; r.len()]);
        gae(&r32, &v32, &tokens, &cfg, &mut a, &mut g).unwrap();
        let rcfg = ReturnsConfig { gamma: g32, masked: md, whiten: None };
        let (mut ra, mut rg) = (vec![0.0f32; r.len()], vec![0.0f32; r.len()]);
        reinforce_pp_returns(&r32, &tokens, &rcfg, &mut ra, &mut rg).unwrap();
        // Reference in f64 from the f32-rounded inputs.
        let seqs64: Vec<Vec<(f64, f64, bool)>> = seqs
            .iter()
            .map(|s| s.iter().map(|&(x, y, b)| ((x as f32) as f64, (y as f32) as f64, b)).collect())
            .collect();
        let mut j = 0;
        for s in &seqs64 {
            for t in 0..s.len() {
                if s[t].2 {
                    let c = chain(s, t, md);
                    let l = ref_gae(&c, g32 as f64, l32 as f64);
                    prop_assert!(close(a[j] as f64, l, 1e-5, 1e-5), "{} vs {}", a[j], l);
                    let ret = ref_return(&c, g32 as f64);
                    prop_assert!(close(rg[j] as f64, ret, 1e-5, 1e-5), "{} vs {}", rg[j], ret);
                } else {
                    prop_assert_eq!((a[j], g[j], ra[j], rg[j]), (0.0, 0.0, 0.0, 0.0));
                }
                j += 1;
            }
        }
    }
}
