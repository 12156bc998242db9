//! grpo-wgpu's rollout-correction masks — \[verl\] rollout rejection sampling
//! (`LossKernel::rejection_mask`) and \[TRL\] off-policy sequence masking
//! (`LossKernel::off_policy_sequence_mask`) — against grpo-core in f32: the same keep masks and
//! diagnostics, the same errors with `keep` untouched.
//!
//! k1 and k2 statistics are the same correctly rounded operations, summed in grpo-core's order,
//! and every comparison with a bound is exact, so those decisions must be grpo-core's — except
//! where a value touches the subnormal range (WGSL may flush it to zero): such tokens are
//! counted apart. k3 goes through `exp`: a token whose k3 statistic (or its sequence's aggregate)
//! lies within the `RejectionK3` band of a bound is borderline, counted and left out. Skips
//! without an adapter unless `GRPO_REQUIRE_GPU=1`.

use std::cell::Cell;

use grpo_core::divergence::{KlEstimator, KlPenaltyConfig, Measure};
use grpo_core::is_correction::{
    RejectLevel, RejectStat, RejectionCriterion, RejectionDiagnostics, off_policy_sequence_mask,
    rejection_mask,
};
use grpo_core::{Error, Real, Tokens};
use grpo_tests::gpu;
use grpo_tests::tolerance::{Dtype, Op, exp_ulps, tolerance, ulp_distance};
use grpo_wgpu::{GpuError, LossKernel};
use proptest::prelude::*;

use RejectLevel::{SeqMax, SeqMean, SeqSum, Token};
use RejectStat::{K1, K2, K3};

#[derive(Debug, Clone)]
enum Layout {
    Packed(Vec<usize>),
    Padded { rows: usize, cols: usize },
}

/// Per-token pairs `(a, b)` over a layout with a mask; masked positions hold NaN / ∞ garbage.
/// Rejection reads them as (old, roll), OPSM as (roll, lp): either way the statistic's log-ratio
/// is `a − b`.
#[derive(Debug, Clone)]
struct Batch {
    a: Vec<f32>,
    b: Vec<f32>,
    layout: Layout,
    mask: Vec<bool>,
}

impl Batch {
    fn tokens(&self) -> Tokens<'_> {
        match &self.layout {
            Layout::Packed(cu) => Tokens::packed(cu, Some(&self.mask)),
            &Layout::Padded { rows, cols } => Tokens::padded(rows, cols, Some(&self.mask)),
        }
    }
}

/// One token's pair: a log-ratio from tiny to ±80, or one of `specials` (values that put a
/// statistic on or next to a bound), on top of a log-prob (often 0, which keeps the log-ratio
/// exact), or an edge pair: ±0, equal values, differences that overflow f32 (log-ratio ±∞:
/// k1 = ∓∞, k2 = ∞) or whose square does; with `subnormals`, also subnormal inputs and
/// log-ratios whose k1 or k2 is subnormal.
fn pair(specials: Vec<f32>, subnormals: bool) -> impl Strategy<Value = (f32, f32)> {
    let r = prop_oneof![
        4 => -0.5f32..0.5,
        2 => -3.0f32..3.0,
        1 => -80.0f32..80.0,
        1 => Just(0.0f32),
    ];
    let base = || prop_oneof![3 => -12.0f32..0.0, 2 => Just(0.0f32)];
    let edge = prop::sample::select(vec![
        (0.0f32, 0.0f32),
        (-0.0, 0.0),
        (0.0, -0.0),
        (3e38, -3e38),
        (-3e38, 3e38),
        (1e30, -1e30),
        (-7.5, -7.5),
    ]);
    let tiny = prop::sample::select(if subnormals {
        vec![
            (1e-39f32, 0.0f32),
            (0.0, 1e-39),
            (-3e-39, 2e-39),
            (1e-20, 0.0),
            (-5e-21, 0.0),
        ]
    } else {
        vec![(0.0, 0.0)]
    });
    prop_oneof![
        12 => (base(), r).prop_map(|(b, r)| (b + r, b)),
        6 => (base(), prop::sample::select(specials)).prop_map(|(b, r)| (b + r, b)),
        1 => edge,
        1 => tiny,
    ]
}

/// A packed (sequences of 0..20 tokens, empty ones included) or padded (rows of 0..16, rows
/// that are all masked included) batch of `pair(specials, _)`, one batch in four with subnormal
/// pairs.
fn batch(specials: Vec<f32>) -> impl Strategy<Value = Batch> {
    let packed = prop::collection::vec(0usize..20, 1..7).prop_map(|lens| {
        let mut cu = vec![0];
        for l in lens {
            cu.push(cu.last().unwrap() + l);
        }
        Layout::Packed(cu)
    });
    let padded = (1usize..6, 0usize..16).prop_map(|(rows, cols)| Layout::Padded { rows, cols });
    (prop_oneof![packed, padded], prop::bool::weighted(0.25))
        .prop_flat_map(move |(layout, subnormals)| {
            let n = match &layout {
                Layout::Packed(cu) => *cu.last().unwrap(),
                Layout::Padded { rows, cols } => rows * cols,
            };
            (
                Just(layout),
                prop::collection::vec(pair(specials.clone(), subnormals), n),
                prop::collection::vec(prop::bool::weighted(0.85), n),
            )
        })
        .prop_map(|(layout, pairs, mask)| {
            let (mut a, mut b): (Vec<f32>, Vec<f32>) = pairs.into_iter().unzip();
            for t in 0..a.len() {
                if !mask[t] {
                    a[t] = f32::NAN;
                    b[t] = f32::INFINITY;
                }
            }
            Batch { a, b, layout, mask }
        })
}

/// The r > 0 (`positive`) or r < 0 solution of e^r − 1 − r = h (h > 0), by bisection in f64.
fn k3_inverse(h: f64, positive: bool) -> f32 {
    let k3 = |r: f64| r.exp_m1() - r;
    let (mut lo, mut hi) = if positive {
        (0.0, 50.0)
    } else {
        (-(h + 2.0), 0.0)
    };
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        // k3 decreases on r < 0 and increases on r > 0.
        if (k3(mid) < h) == positive {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (0.5 * (lo + hi)) as f32
}

/// Token log-ratios that put a statistic of `criteria` on or next to a bound (and halves and
/// thirds of them, so that sums of two or three such tokens land there too).
fn specials(criteria: &[RejectionCriterion<f32>]) -> Vec<f32> {
    let mut v = vec![0.0f32];
    for c in criteria {
        for bound in [c.lo, c.hi] {
            if !bound.is_finite() {
                continue;
            }
            let targets = match c.stat {
                // k1 = −r.
                K1 => vec![-bound],
                // k2 = r²/2.
                K2 if bound > 0.0 => {
                    let s = (2.0 * bound as f64).sqrt() as f32;
                    vec![s, -s]
                }
                K3 if bound > 0.0 => vec![
                    k3_inverse(bound as f64, true),
                    k3_inverse(bound as f64, false),
                ],
                _ => vec![],
            };
            for t in targets {
                v.extend([t, t.next_up(), t.next_down(), t / 2.0, t / 3.0]);
            }
        }
    }
    v
}

/// A criterion of `stat` at `level`: k1 from verl's ratio bounds (1 included: a bound at
/// k1 = 0), k2/k3 from an upper threshold, or with explicit bounds (a finite lower bound, a
/// single point, an infinite upper bound).
fn criterion_of(stat: RejectStat, level: RejectLevel) -> BoxedStrategy<RejectionCriterion<f32>> {
    match stat {
        K1 => {
            let lower = prop_oneof![
                Just(1.0f32),
                Just(0.999),
                Just(0.9),
                Just(0.5),
                0.01f32..1.0
            ];
            let upper = prop_oneof![
                Just(1.0f32),
                Just(1.001),
                Just(1.1),
                Just(2.0),
                1.0f32..100.0
            ];
            (lower, upper)
                .prop_map(move |(l, u)| RejectionCriterion::k1(level, l, u).unwrap())
                .boxed()
        }
        _ => {
            let upper = prop_oneof![
                Just(1e-6f32),
                Just(1e-3),
                Just(0.01),
                Just(0.1),
                Just(1.0),
                Just(10.0),
                Just(1e3),
                1e-4f32..5.0
            ]
            .prop_map(move |u| RejectionCriterion::upper(stat, level, u).unwrap());
            let explicit = (
                1e-4f32..1.0,
                prop::sample::select(vec![0.0f32, 1.0, f32::INFINITY]),
            )
                .prop_map(move |(lo, width)| RejectionCriterion {
                    stat,
                    level,
                    lo,
                    hi: lo + width,
                });
            prop_oneof![3 => upper, 1 => explicit].boxed()
        }
    }
}

/// Any valid criterion (k1 has no `SeqMax`).
fn criterion() -> impl Strategy<Value = RejectionCriterion<f32>> {
    (
        prop::sample::select(vec![K1, K2, K3]),
        prop::sample::select(vec![Token, SeqSum, SeqMean, SeqMax]),
    )
        .prop_flat_map(|(stat, level)| {
            let level = if stat == K1 && level == SeqMax {
                SeqMean
            } else {
                level
            };
            criterion_of(stat, level)
        })
}

/// Criteria and a batch with log-ratios near their bounds.
fn rejection_case(
    criteria: impl Strategy<Value = Vec<RejectionCriterion<f32>>>,
) -> impl Strategy<Value = (Vec<RejectionCriterion<f32>>, Batch)> {
    criteria.prop_flat_map(|cs| {
        let sp = specials(&cs);
        (Just(cs), batch(sp))
    })
}

/// The figures the comparisons observe (printed at the end of each test).
#[derive(Default)]
struct Stats {
    cases: Cell<u64>,
    /// Valid tokens whose decision was compared with grpo-core's exactly.
    exact: Cell<u64>,
    /// Valid tokens left out: a k3 statistic within the `RejectionK3` band of a bound …
    k3_border: Cell<u64>,
    /// … of which grpo-core and the GPU decided differently.
    k3_differ: Cell<u64>,
    /// Largest distance in ULP between a bound and the k3 statistic of a decision that differed.
    k3_differ_ulp: Cell<u64>,
    /// Largest fraction of its band at which such a statistic lay from the bound.
    k3_differ_band: Cell<f64>,
    /// Valid tokens left out: a k1/k2 statistic (or its inputs, or a partial sum) subnormal …
    flush: Cell<u64>,
    /// … of which decided differently.
    flush_differ: Cell<u64>,
    /// Cases whose diagnostics were compared exactly (no token left out).
    diag_exact: Cell<u64>,
}

impl Stats {
    fn add(c: &Cell<u64>, v: u64) {
        c.set(c.get() + v);
    }
    fn max(c: &Cell<u64>, v: u64) {
        c.set(c.get().max(v));
    }
    fn report(&self, what: &str) {
        eprintln!(
            "{what}: {} cases; {} valid tokens compared exactly, diagnostics exact in {} cases; \
             k3 borderline {} tokens ({} decided differently, those at most {} ULP = {:.3} of \
             the band from the bound); subnormal k1/k2 {} tokens ({} decided differently)",
            self.cases.get(),
            self.exact.get(),
            self.diag_exact.get(),
            self.k3_border.get(),
            self.k3_differ.get(),
            self.k3_differ_ulp.get(),
            self.k3_differ_band.get(),
            self.flush.get(),
            self.flush_differ.get()
        );
    }
}

/// grpo-core's token statistic: r clamped to ±20 (verl's SAFETY_BOUND), then k1, k2 or k3
/// (`Measure::K3` is its k3; its overflow guard does not act within ±20).
fn stat(c: &RejectionCriterion<f32>, r: f32) -> f32 {
    let r = r.clamp(-20.0, 20.0);
    match c.stat {
        K1 => -r,
        K2 => r * r * 0.5,
        K3 => Measure::K3.eval(r).value,
    }
}

fn keeps(c: &RejectionCriterion<f32>, v: f32) -> bool {
    v >= c.lo && v <= c.hi
}

/// Whether a k1/k2 evaluation at these inputs passes through the subnormal range, where WGSL may
/// flush to zero (k1: the inputs and r; k2: also r², r²/2).
fn touches_subnormal(stat: RejectStat, old: f32, roll: f32, r: f32) -> bool {
    let k2 = if stat == K2 { r * r } else { 0.0 };
    [old, roll, r, k2, k2 * 0.5]
        .iter()
        .any(|x| x.is_subnormal())
}

/// The `RejectionK3` band of a k3 token value `v` at log-ratio `r` (absolute).
fn k3_band(r: f32, v: f32) -> f64 {
    let tol = tolerance(Op::RejectionK3, Dtype::F32);
    let x = (r as f64).clamp(-20.0, 20.0);
    let ulps = tol.ulp
        + if x.abs() >= 2.0 {
            2 * exp_ulps(&[x])
        } else {
            0
        };
    ulps as f64 * (v.abs().next_up() - v.abs()) as f64 + tol.abs
}

/// For a k3 statistic `v` with band `band`: `Some((ulp distance, fraction of the band))` to the
/// nearest finite bound within the band, `None` when no bound is that close.
fn k3_border(c: &RejectionCriterion<f32>, v: f32, band: f64) -> Option<(u64, f64)> {
    [c.lo, c.hi]
        .into_iter()
        .filter(|b| b.is_finite())
        .map(|b| {
            let d = (v as f64 - b as f64).abs();
            (ulp_distance(v, b), d / band)
        })
        .filter(|&(_, frac)| frac <= 1.0)
        .min_by(|x, y| x.1.total_cmp(&y.1))
}

/// grpo-core's aggregate of sequence-level criterion `c` over sequence `i` (its operations, its
/// order), with its k3 band and whether it touches the subnormal range.
fn aggregate(
    c: &RejectionCriterion<f32>,
    old: &[f32],
    roll: &[f32],
    tokens: &Tokens<'_>,
    i: usize,
) -> (f32, f64, bool) {
    let count = tokens.valid_count(i);
    let mut agg = if c.level == SeqMax {
        f32::NEG_INFINITY
    } else {
        0.0
    };
    let (mut band_sum, mut band_max, mut abs_sum, mut touch) = (0.0f64, 0.0f64, 0.0f64, false);
    for t in tokens.valid_positions(i) {
        let r = old[t] - roll[t];
        let v = stat(c, r);
        touch |= touches_subnormal(c.stat, old[t], roll[t], r);
        agg = if c.level == SeqMax {
            Real::max(agg, v)
        } else {
            agg + v
        };
        touch |= agg.is_subnormal();
        if c.stat == K3 {
            let b = k3_band(r, v);
            band_sum += b;
            band_max = band_max.max(b);
            abs_sum += v as f64;
        }
    }
    // Both sums round each addition (≤ ½ ULP of the partial sum, ≤ 2⁻²⁴ of the final sum of
    // non-negative k3 values): twice count·2⁻²⁴·Σ on top of the token bands.
    let sum_band = band_sum + 2.0 * count as f64 * abs_sum * 2f64.powi(-24);
    let band = match c.level {
        SeqMax => band_max,
        SeqSum => sum_band,
        _ => {
            agg /= count as f32;
            sum_band / count as f64 + 2.0 * (agg.abs().next_up() - agg.abs()) as f64
        }
    };
    (agg, band, touch)
}

/// A keep buffer that no correct result equals: every entry the opposite of a valid result's
/// invalid-position `false` pattern would give, alternating.
fn pattern(n: usize) -> Vec<bool> {
    (0..n).map(|t| t % 3 != 1).collect()
}

/// One comparison of `LossKernel::rejection_mask` with grpo-core's `rejection_mask`.
fn check_rejection(
    k: &LossKernel<'_>,
    criteria: &[RejectionCriterion<f32>],
    old: &[f32],
    roll: &[f32],
    tokens: &Tokens<'_>,
    st: &Stats,
) -> Result<RejectionDiagnostics, TestCaseError> {
    let n = old.len();
    let mut kc = pattern(n);
    let dc = rejection_mask(criteria, old, roll, tokens, &mut kc).unwrap();
    let mut kg = pattern(n);
    let dg = k
        .rejection_mask(criteria, old, roll, tokens, &mut kg)
        .unwrap();
    Stats::add(&st.cases, 1);
    for t in 0..n {
        if !tokens.is_valid(t) {
            prop_assert!(!kg[t] && !kc[t], "invalid position {t} kept");
        }
    }
    let mut left_out = false;
    for i in 0..tokens.num_sequences() {
        if tokens.valid_count(i) == 0 {
            continue;
        }
        // Sequence-level criteria: grpo-core's decision, whether it is borderline (k3) or
        // touches the subnormal range (k1/k2).
        let (mut seq_ok, mut seq_border, mut seq_flush) = (true, None::<(u64, f64)>, false);
        for c in criteria.iter().filter(|c| c.level != Token) {
            let (v, band, touch) = aggregate(c, old, roll, tokens, i);
            seq_ok &= keeps(c, v);
            if c.stat == K3 {
                if let Some(b) = k3_border(c, v, band) {
                    seq_border = Some(seq_border.map_or(b, |s| if b.1 < s.1 { b } else { s }));
                }
            } else {
                seq_flush |= touch;
            }
        }
        for t in tokens.valid_positions(i) {
            let r = old[t] - roll[t];
            let (mut ok, mut border, mut flush) = (seq_ok, seq_border, seq_flush);
            for c in criteria.iter().filter(|c| c.level == Token) {
                let v = stat(c, r);
                ok &= keeps(c, v);
                if c.stat == K3 {
                    if let Some(b) = k3_border(c, v, k3_band(r, v)) {
                        border = Some(border.map_or(b, |s| if b.1 < s.1 { b } else { s }));
                    }
                } else {
                    flush |= touches_subnormal(c.stat, old[t], roll[t], r);
                }
            }
            // The replica of grpo-core's rule that the borderline analysis uses is grpo-core's.
            prop_assert_eq!(ok, kc[t], "replica of grpo-core at token {}", t);
            let differ = kg[t] != kc[t];
            if let Some((ulp, frac)) = border {
                left_out = true;
                Stats::add(&st.k3_border, 1);
                if differ {
                    Stats::add(&st.k3_differ, 1);
                    Stats::max(&st.k3_differ_ulp, ulp);
                    st.k3_differ_band.set(st.k3_differ_band.get().max(frac));
                }
                continue;
            }
            if flush {
                left_out = true;
                Stats::add(&st.flush, 1);
                Stats::add(&st.flush_differ, differ as u64);
                continue;
            }
            Stats::add(&st.exact, 1);
            prop_assert_eq!(
                kg[t],
                kc[t],
                "token {} (sequence {}), r = {}: gpu {} core {}",
                t,
                i,
                r,
                kg[t],
                kc[t]
            );
        }
    }
    prop_assert_eq!(dg.tokens, dc.tokens);
    if !left_out {
        Stats::add(&st.diag_exact, 1);
        prop_assert_eq!(dg, dc);
    }
    Ok(dg)
}

const COMBOS: [(RejectStat, RejectLevel); 11] = [
    (K1, Token),
    (K1, SeqSum),
    (K1, SeqMean),
    (K2, Token),
    (K2, SeqSum),
    (K2, SeqMean),
    (K2, SeqMax),
    (K3, Token),
    (K3, SeqSum),
    (K3, SeqMean),
    (K3, SeqMax),
];

/// Every statistic × level on its own, then 0–4 random criteria together, then none, over
/// packed and padded batches with masked NaN garbage, empty and all-masked sequences, edge pairs
/// and log-ratios on and next to the bounds.
#[test]
fn rejection_masks_match_grpo_core() {
    let Some(ctx) = gpu::context("rejection_masks_match_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let st = Stats::default();
    for (stat, level) in COMBOS {
        let one = criterion_of(stat, level).prop_map(|c| vec![c]);
        gpu::runner()
            .run(&rejection_case(one), |(cs, b)| {
                check_rejection(&k, &cs, &b.a, &b.b, &b.tokens(), &st).map(|_| ())
            })
            .unwrap();
    }
    let several = prop::collection::vec(criterion(), 0..=4);
    gpu::runner()
        .run(&rejection_case(several), |(cs, b)| {
            check_rejection(&k, &cs, &b.a, &b.b, &b.tokens(), &st).map(|_| ())
        })
        .unwrap();
    // No criterion: every valid token is kept.
    gpu::runner()
        .run(&batch(vec![0.0]), |b| {
            let tokens = b.tokens();
            let d = check_rejection(&k, &[], &b.a, &b.b, &tokens, &st)?;
            prop_assert_eq!(d.rejected_tokens, 0);
            prop_assert_eq!(d.tokens, tokens.total_valid());
            Ok(())
        })
        .unwrap();
    st.report("rejection_mask");
    // Exact decisions dominate: the borderline bands stay narrow.
    assert!(st.exact.get() > st.k3_border.get() + st.flush.get());
}

/// One comparison of `LossKernel::off_policy_sequence_mask` with grpo-core's.
fn check_opsm(
    k: &LossKernel<'_>,
    adv: &[f32],
    lp: &[f32],
    roll: &[f32],
    tokens: &Tokens<'_>,
    delta: f32,
    st: &Stats,
) -> Result<usize, TestCaseError> {
    let b = adv.len();
    let mut kc = pattern(b);
    let dc = off_policy_sequence_mask(adv, lp, roll, tokens, delta, &mut kc).unwrap();
    let mut kg = pattern(b);
    let dg = k
        .off_policy_sequence_mask(adv, lp, roll, tokens, delta, &mut kg)
        .unwrap();
    Stats::add(&st.cases, 1);
    let mut left_out = false;
    for i in 0..b {
        let count = tokens.valid_count(i);
        // grpo-core's rule, and whether its sum passes through the subnormal range.
        let (mut sum, mut flush) = (0f32, false);
        for t in tokens.valid_positions(i) {
            let d = roll[t] - lp[t];
            sum += d;
            flush |= [lp[t], roll[t], d, sum].iter().any(|x| x.is_subnormal());
        }
        let drop = count > 0 && adv[i] < 0.0 && sum / count as f32 > delta;
        prop_assert_eq!(!drop, kc[i], "replica of grpo-core at sequence {}", i);
        if flush && count > 0 && adv[i] < 0.0 {
            left_out = true;
            Stats::add(&st.flush, 1);
            Stats::add(&st.flush_differ, (kg[i] != kc[i]) as u64);
            continue;
        }
        Stats::add(&st.exact, 1);
        prop_assert_eq!(
            kg[i],
            kc[i],
            "sequence {}: sum {} count {} δ {}",
            i,
            sum,
            count,
            delta
        );
    }
    if !left_out {
        Stats::add(&st.diag_exact, 1);
        prop_assert_eq!(dg, dc);
    }
    Ok(dg)
}

/// δ (0 included) and a batch whose mean log-ratios sit on, next to and around δ, with
/// advantages of both signs, ±0 and tiny ones.
fn opsm_case() -> impl Strategy<Value = (f32, Batch, Vec<f32>)> {
    prop_oneof![
        Just(0.0f32),
        Just(1e-6),
        Just(0.01),
        Just(0.1),
        Just(1.0),
        0.0f32..2.0
    ]
    .prop_flat_map(|delta| {
        let sp = vec![
            delta,
            delta.next_up(),
            delta.next_down().max(0.0),
            2.0 * delta,
            delta / 2.0,
            -delta,
        ];
        (Just(delta), batch(sp))
    })
    .prop_flat_map(|(delta, b)| {
        let seqs = b.tokens().num_sequences();
        let adv = prop_oneof![
            2 => Just(-1.0f32),
            1 => Just(1.0f32),
            1 => Just(0.0f32),
            1 => Just(-0.0f32),
            1 => Just(-1e-30f32),
            2 => -3.0f32..3.0,
        ];
        (Just(delta), Just(b), prop::collection::vec(adv, seqs))
    })
}

#[test]
fn off_policy_sequence_masks_match_grpo_core() {
    let Some(ctx) = gpu::context("off_policy_sequence_masks_match_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let st = Stats::default();
    // One configuration: four times the default case count.
    gpu::runner_with_cases(4 * gpu::cases())
        .run(&opsm_case(), |(delta, b, adv)| {
            // `a` = b + r plays roll, `b` plays lp: roll − lp = r.
            check_opsm(&k, &adv, &b.b, &b.a, &b.tokens(), delta, &st).map(|_| ())
        })
        .unwrap();
    eprintln!(
        "off_policy_sequence_mask: {} cases; {} sequences compared exactly, dropped count exact \
         in {} cases; {} negative-advantage sequences with subnormal values ({} decided \
         differently)",
        st.cases.get(),
        st.exact.get(),
        st.diag_exact.get(),
        st.flush.get(),
        st.flush_differ.get()
    );
}

/// Hand-computed masks: grpo-core's examples, inclusive bounds at exact values (−0 vs +0), an
/// infinite upper bound, and the ±∞ log-ratio of an overflowing difference.
#[test]
fn hand_computed_masks() {
    let Some(ctx) = gpu::context("hand_computed_masks") else {
        return;
    };
    let k = LossKernel::new(ctx);
    // r = [0.1, −0.2 | 0.5, 0.0].
    let old = [0.1f32, -0.2, 0.5, 0.0];
    let roll = [0.0f32; 4];
    let tok = Tokens::padded(2, 2, None);
    let mut keep = [false; 4];
    let k2 = |level, u| RejectionCriterion::upper(K2, level, u).unwrap();
    let k3 = |level, u| RejectionCriterion::upper(K3, level, u).unwrap();
    // token_k2 ≤ 0.01 keeps |r| ≤ 0.1414: tokens 0 and 3.
    let d = k
        .rejection_mask(&[k2(Token, 0.01)], &old, &roll, &tok, &mut keep)
        .unwrap();
    assert_eq!(keep, [true, false, false, true]);
    assert_eq!(
        d,
        RejectionDiagnostics {
            tokens: 4,
            rejected_tokens: 2,
            rejected_sequences: 0
        }
    );
    // seq_mean_k1 in ratio [e^−0.1, e^0.1]: means −0.05 (kept) and 0.25 (rejected).
    let c = RejectionCriterion::k1(SeqMean, (-0.1f32).exp(), 0.1f32.exp()).unwrap();
    let d = k
        .rejection_mask(&[c], &old, &roll, &tok, &mut keep)
        .unwrap();
    assert_eq!(keep, [true, true, false, false]);
    assert_eq!((d.rejected_tokens, d.rejected_sequences), (2, 1));
    // Both together (AND): token 1 goes too; sequence 1 is rejected whole.
    k.rejection_mask(&[c, k2(Token, 0.01)], &old, &roll, &tok, &mut keep)
        .unwrap();
    assert_eq!(keep, [true, false, false, false]);
    // grpo-core's seq_max_k3 / seq_sum_k1 example: r = [0, 1 | 0.1, 0.1].
    let old2 = [0.0f32, 1.0, 0.1, 0.1];
    k.rejection_mask(&[k3(SeqMax, 0.5)], &old2, &roll, &tok, &mut keep)
        .unwrap();
    assert_eq!(keep, [false, false, true, true]);
    let c = RejectionCriterion::k1(SeqSum, 0.5, 2.0).unwrap();
    k.rejection_mask(&[c], &old2, &roll, &tok, &mut keep)
        .unwrap();
    assert_eq!(keep, [false, false, true, true]);
    // Ratio bounds [1, 1]: k1 ∈ [ln 1, ln 1] = [0, 0], i.e. r = ±0 exactly. −0 − 0 = −0 (k1 = +0) is kept
    // like +0 (the masked token 3 holds garbage); r = 2 is not. (grpo-core rejects the
    // smallest subnormal r = 1e-45 too, which WGSL may flush to 0: not asserted.)
    let c = RejectionCriterion::k1(Token, 1.0, 1.0).unwrap();
    let old3 = [0.0f32, -0.0, 1.0, f32::NAN];
    let roll3 = [0.0f32, 0.0, 1.0, 0.0];
    let mask = [true, true, true, false];
    let t1 = Tokens::padded(1, 4, Some(&mask));
    let d = k
        .rejection_mask(&[c], &old3, &roll3, &t1, &mut keep)
        .unwrap();
    assert_eq!(keep, [true, true, true, false]);
    assert_eq!(d.tokens, 3);
    let old4 = [0.0f32, 1e-45, -0.0, 2.0];
    let d = k
        .rejection_mask(
            &[c],
            &old4,
            &[0.0; 4],
            &Tokens::padded(2, 2, None),
            &mut keep,
        )
        .unwrap();
    assert_eq!(keep[2..], [true, false]);
    assert!(keep[0]);
    assert_eq!(d.tokens, 4);
    // An explicit k2 window [0.005, ∞) (no upper bound): keeps |r| ≥ 0.1.
    let c = RejectionCriterion {
        stat: K2,
        level: Token,
        lo: 0.005,
        hi: f32::INFINITY,
    };
    k.rejection_mask(&[c], &old, &roll, &tok, &mut keep)
        .unwrap();
    assert_eq!(keep, [true, true, true, false]);
    // An overflowing difference r = +∞, clamped to 20 first (verl's SAFETY_BOUND): k1 = −20
    // (below ln ½), k2 = 200 (in the window), k3 = e^20 − 21 ≈ 4.85e8.
    let big = [3e38f32, 0.0];
    let neg = [-3e38f32, 0.0];
    let t2 = Tokens::padded(1, 2, None);
    let c1 = RejectionCriterion::k1(Token, 0.5, 2.0).unwrap();
    k.rejection_mask(&[c1], &big, &neg, &t2, &mut keep[..2])
        .unwrap();
    assert_eq!(keep[..2], [false, true]);
    k.rejection_mask(&[c], &big, &neg, &t2, &mut keep[..2])
        .unwrap();
    assert_eq!(keep[..2], [true, false]);
    k.rejection_mask(&[k3(Token, 4e8)], &big, &neg, &t2, &mut keep[..2])
        .unwrap();
    assert_eq!(keep[..2], [false, true]);
    k.rejection_mask(&[k3(Token, 5e8)], &big, &neg, &t2, &mut keep[..2])
        .unwrap();
    assert_eq!(keep[..2], [true, true]);
    // No criterion: every valid token kept, nothing rejected.
    let d = k
        .rejection_mask(&[], &old3, &roll3, &t1, &mut keep)
        .unwrap();
    assert_eq!(keep, [true, true, true, false]);
    assert_eq!(
        (d.tokens, d.rejected_tokens, d.rejected_sequences),
        (3, 0, 0)
    );

    // OPSM, grpo-core's example: mean(roll − lp) = [0.5, 0.5, 0], δ = 0.1.
    let lp = [-1.0f32; 6];
    let roll = [-0.5f32, -0.5, -0.5, -0.5, -1.0, -1.0];
    let mut keep = [true; 3];
    let tok3 = Tokens::padded(3, 2, None);
    let dropped = k
        .off_policy_sequence_mask(&[-1.0, 1.0, -1.0], &lp, &roll, &tok3, 0.1, &mut keep)
        .unwrap();
    assert_eq!((keep, dropped), ([false, true, true], 1));
    // δ equal to the mean keeps (strictly greater drops); an empty (all-masked) sequence with a
    // negative advantage is kept; δ = 0 drops any positive mean.
    let mask = [true, true, false, false, true, true];
    let tokm = Tokens::padded(3, 2, Some(&mask));
    let dropped = k
        .off_policy_sequence_mask(&[-1.0, -1.0, -1.0], &lp, &roll, &tokm, 0.5, &mut keep)
        .unwrap();
    assert_eq!((keep, dropped), ([true, true, true], 0));
    let dropped = k
        .off_policy_sequence_mask(&[-1.0, -1.0, -0.0], &lp, &roll, &tokm, 0.0, &mut keep)
        .unwrap();
    assert_eq!((keep, dropped), ([false, true, true], 1));
}

/// grpo-core's error for every kind of bad input, in grpo-core's order, and `keep` untouched.
#[test]
fn mask_errors_match_grpo_core_and_leave_keep_untouched() {
    let Some(ctx) = gpu::context("mask_errors_match_grpo_core_and_leave_keep_untouched") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let ok = RejectionCriterion::upper(K2, Token, 0.1).unwrap();
    let c = |stat, level, lo, hi| RejectionCriterion {
        stat,
        level,
        lo,
        hi,
    };
    let mask = [true, true, false, true];
    let cu = [0usize, 1, 4];
    let good: Tokens<'_> = Tokens::packed(&cu, Some(&mask));
    let bad_cu = [0usize, 3, 2, 4];
    let v = [0.1f32, 0.2, f32::NAN, 0.3];
    let nan_at = |i: usize| {
        let mut x = [0.1f32, 0.2, 0.0, 0.3];
        x[i] = f32::NAN;
        x
    };
    let inf_at = |i: usize| {
        let mut x = [0.1f32, 0.2, 0.0, 0.3];
        x[i] = f32::NEG_INFINITY;
        x
    };
    type Rej<'a> = (
        Vec<RejectionCriterion<f32>>,
        Vec<f32>,
        Vec<f32>,
        Tokens<'a>,
        usize,
    );
    let cases: Vec<Rej<'_>> = vec![
        // Criteria first, the first bad one: lo > hi, NaN bound, k1 at SeqMax.
        (
            vec![ok, c(K2, Token, 1.0, 0.5)],
            v.to_vec(),
            v.to_vec(),
            good,
            4,
        ),
        (
            vec![c(K3, SeqSum, f32::NAN, 1.0), c(K1, SeqMax, -1.0, 1.0)],
            v.to_vec(),
            vec![],
            good,
            3,
        ),
        (
            vec![ok, c(K1, SeqMax, -1.0, 1.0)],
            v.to_vec(),
            v.to_vec(),
            good,
            4,
        ),
        (
            vec![c(K2, SeqMean, 0.0, f32::NAN)],
            v.to_vec(),
            v.to_vec(),
            good,
            4,
        ),
        // Then lengths (roll, keep), the layout, the values (old before roll).
        (vec![ok], v.to_vec(), v[..3].to_vec(), good, 4),
        (vec![ok], v.to_vec(), v.to_vec(), good, 3),
        (
            vec![],
            v.to_vec(),
            v.to_vec(),
            Tokens::packed(&bad_cu, None),
            4,
        ),
        (
            vec![ok],
            v.to_vec(),
            v.to_vec(),
            Tokens::padded(3, 2, None),
            4,
        ),
        (
            vec![ok],
            v.to_vec(),
            v.to_vec(),
            Tokens::packed(&cu, Some(&mask[..3])),
            4,
        ),
        (vec![ok], nan_at(3).to_vec(), nan_at(1).to_vec(), good, 4),
        (vec![ok], v.to_vec(), inf_at(0).to_vec(), good, 4),
        (vec![], v.to_vec(), nan_at(3).to_vec(), good, 4),
    ];
    for (criteria, old, roll, tokens, len) in &cases {
        let mut kc = pattern(*len);
        let e = rejection_mask(criteria, old, roll, tokens, &mut kc).unwrap_err();
        let mut kg = pattern(*len);
        assert_eq!(
            k.rejection_mask(criteria, old, roll, tokens, &mut kg),
            Err(GpuError::Core(e)),
            "{criteria:?}"
        );
        assert_eq!(kg, pattern(*len));
        assert_eq!(kc, pattern(*len));
    }
    // Garbage only at the masked position is not an error.
    let mut kg = pattern(4);
    k.rejection_mask(&[ok], &v, &v, &good, &mut kg).unwrap();
    assert!(!kg[2]);
    assert_eq!(
        rejection_mask(&cases[0].0, &v, &v, &good, &mut pattern(4)),
        Err(Error::InvalidParam {
            name: "rejection bounds",
            reason: "need lo <= hi (no NaN)"
        })
    );

    // OPSM: δ, then roll's length, the layout, lp, roll, then advantages and keep, then a
    // non-finite advantage (even of an empty sequence).
    let adv = [-1.0f32, -1.0];
    type Opsm<'a> = (Vec<f32>, Vec<f32>, Vec<f32>, Tokens<'a>, f32, usize);
    let cases: Vec<Opsm<'_>> = vec![
        (adv.to_vec(), v.to_vec(), v.to_vec(), good, -1.0, 2),
        (adv.to_vec(), v.to_vec(), v.to_vec(), good, f32::NAN, 2),
        (adv.to_vec(), v.to_vec(), v.to_vec(), good, f32::INFINITY, 1),
        (vec![], v.to_vec(), v[..2].to_vec(), good, 0.1, 2),
        (
            adv.to_vec(),
            v.to_vec(),
            v.to_vec(),
            Tokens::packed(&bad_cu, None),
            0.1,
            2,
        ),
        (
            adv.to_vec(),
            nan_at(0).to_vec(),
            inf_at(0).to_vec(),
            good,
            0.1,
            2,
        ),
        (adv.to_vec(), v.to_vec(), inf_at(3).to_vec(), good, 0.1, 2),
        (vec![-1.0], v.to_vec(), v.to_vec(), good, 0.1, 2),
        (adv.to_vec(), v.to_vec(), v.to_vec(), good, 0.1, 3),
        (vec![-1.0, f32::NAN], v.to_vec(), v.to_vec(), good, 0.1, 2),
        (
            vec![f32::INFINITY, 0.0, 0.0],
            vec![],
            vec![],
            Tokens::packed(&[0, 0, 0, 0], None),
            0.1,
            3,
        ),
    ];
    for (adv, lp, roll, tokens, delta, len) in &cases {
        let mut kc = pattern(*len);
        let e = off_policy_sequence_mask(adv, lp, roll, tokens, *delta, &mut kc).unwrap_err();
        let mut kg = pattern(*len);
        assert_eq!(
            k.off_policy_sequence_mask(adv, lp, roll, tokens, *delta, &mut kg),
            Err(GpuError::Core(e)),
            "{adv:?} δ {delta}"
        );
        assert_eq!(kg, pattern(*len));
        assert_eq!(kc, pattern(*len));
    }
}

/// The k3 statistic of the WGSL module (`expm1_minus_x`, reached through
/// `LossKernel::kl_penalty` without clamps: value = k3 at r with `lp = 0`, `ref = r`) stays within
/// the `RejectionK3` tolerance of grpo-core's over a dense sweep of r ∈ [−50, 50] (past the
/// ±43.36 guard) and random r: the figures behind the band of the rejection tests.
#[test]
fn k3_statistic_stays_within_its_tolerance() {
    let Some(ctx) = gpu::context("k3_statistic_stays_within_its_tolerance") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let tol = tolerance(Op::RejectionK3, Dtype::F32);
    let cfg = KlPenaltyConfig::<f32> {
        estimator: KlEstimator::K3,
        input_clamp: None,
        output_clamp: None,
    };
    let mut r: Vec<f32> = (0..=200_000).map(|i| -50.0 + i as f32 * 5e-4).collect();
    let mut next = grpo_tests::uniform_f32(0x5eed_0fc0_ffee);
    r.extend((0..50_000).map(|_| {
        let u = next();
        let s = next();
        // Log-uniform magnitudes from 1e-12 to 50, both signs.
        let m = 1e-12f32 * (50e12f32).powf(u);
        if s < 0.5 { -m } else { m }
    }));
    r.extend([
        0.0, -0.0, 0.5, -0.5, 2.0, -2.0, 43.36, -43.36, 1e-20, -1e-20,
    ]);
    let n = r.len();
    let lp = vec![0f32; n];
    let tokens = Tokens::padded(1, n, None);
    let (mut v, mut g) = (vec![0f32; n], vec![0f32; n]);
    k.kl_penalty(&cfg, &lp, &r, None, &tokens, &mut v, &mut g)
        .unwrap();
    // Largest distance in three ranges of |r| (< ½, < 2, ≥ 2), and beyond exp's doubled allowance.
    let (mut small, mut mid, mut large, mut excess) = (0u64, 0u64, 0u64, i64::MIN);
    for (t, &x) in r.iter().enumerate() {
        let want = Measure::K3.eval(x).value;
        let xc = (x as f64).clamp(-43.36, 43.36);
        let extra = if xc.abs() >= 2.0 {
            2 * exp_ulps(&[xc])
        } else {
            0
        };
        let d = ulp_distance(v[t], want);
        if want.is_subnormal() || v[t].is_subnormal() {
            // A flushed subnormal: within `abs`, and no ULP statistic.
            assert!(tol.plus_ulp(extra).accepts(v[t], want as f64), "r = {x}");
            continue;
        }
        match xc.abs() {
            a if a < 0.5 => small = small.max(d),
            a if a < 2.0 => mid = mid.max(d),
            _ => {
                large = large.max(d);
                excess = excess.max(d as i64 - extra as i64);
            }
        }
        assert!(
            tol.plus_ulp(extra).accepts(v[t], want as f64),
            "k3({x}): gpu {} core {want} ({d} ULP, allowed {})",
            v[t],
            tol.ulp + extra
        );
    }
    eprintln!(
        "k3 statistic: {n} values; max distance to grpo-core {small} ULP for |r| < 0.5, {mid} ULP \
         for 0.5 ≤ |r| < 2, {large} ULP for |r| ≥ 2 ({excess} beyond twice exp's allowance)"
    );
}

/// A deterministic batch of `seqs` short sequences (0..=8 tokens, a few masked with garbage),
/// log-ratios in ±1.5 with one token in 50 at ±30.
fn many_sequences(seqs: usize) -> (Vec<f32>, Vec<f32>, Vec<usize>, Vec<bool>) {
    let mut next = grpo_tests::uniform_f32(0x9e37_79b9_7f4a_7c15u64);
    let mut cu = vec![0];
    for i in 0..seqs {
        cu.push(cu[i] + (i * 7) % 9);
    }
    let n = cu[seqs];
    let (mut old, mut roll, mut mask) = (vec![], vec![], vec![]);
    for t in 0..n {
        let base = -6.0 * next();
        let x = if t % 50 == 3 {
            30.0 * (2.0 * next() - 1.0)
        } else {
            3.0 * next() - 1.5
        };
        let valid = t % 13 != 5;
        old.push(if valid { base + x } else { f32::NAN });
        roll.push(base);
        mask.push(valid);
    }
    (old, roll, cu, mask)
}

/// The masks' per-sequence dispatches past the workgroup limit: with the per-dimension limit
/// forced down to 6 workgroups, 2000 sequences take a [6, 2, 1] grid; the results are the
/// uncapped context's and grpo-core's. A limit of 1 cannot hold the grid: `TooManyWorkgroups`, `keep`
/// untouched.
#[test]
fn masks_beyond_the_workgroup_limit_use_a_2d_dispatch() {
    let Some(ctx) = gpu::context("masks_beyond_the_workgroup_limit_use_a_2d_dispatch") else {
        return;
    };
    // Its own context: the caps must not reach the tests running in parallel.
    let capped = grpo_wgpu::GpuContext::new().unwrap();
    capped.set_max_workgroups_per_dimension(6);
    let (old, roll, cu, mask) = many_sequences(2000);
    let n = old.len();
    let seqs = cu.len() - 1;
    assert_eq!((n, seqs.div_ceil(256)), (7999, 8));
    let tokens = Tokens::packed(&cu, Some(&mask));
    let (whole, split) = (LossKernel::new(ctx), LossKernel::new(&capped));
    let criteria = [
        RejectionCriterion::k1(SeqMean, 0.7, 1.4).unwrap(),
        RejectionCriterion::upper(K2, Token, 2.0).unwrap(),
        RejectionCriterion::upper(K3, SeqMax, 1.5).unwrap(),
        RejectionCriterion::upper(K2, SeqSum, 3.0).unwrap(),
    ];
    let rej = |k: &LossKernel<'_>| {
        let mut keep = vec![false; n];
        let d = k
            .rejection_mask(&criteria, &old, &roll, &tokens, &mut keep)
            .unwrap();
        (keep, d)
    };
    let (ks, ds) = rej(&split);
    assert_eq!((ks.clone(), ds), rej(&whole));
    let st = Stats::default();
    // Against grpo-core (a second run of the capped context).
    let again = check_rejection(&split, &criteria, &old, &roll, &tokens, &st).unwrap();
    assert_eq!(again, ds);
    assert!(
        ds.rejected_tokens > 0 && ds.rejected_sequences > 0,
        "{ds:?}"
    );
    assert!(ds.rejected_tokens < ds.tokens, "{ds:?}");

    // OPSM: `old` plays roll and `roll` plays lp (mean log-ratios around 0), advantages ±.
    let adv: Vec<f32> = (0..seqs)
        .map(|i| if i % 3 == 0 { 1.0 } else { -1.0 })
        .collect();
    let opsm = |k: &LossKernel<'_>| {
        let mut keep = vec![true; seqs];
        let d = k
            .off_policy_sequence_mask(&adv, &roll, &old, &tokens, 0.2, &mut keep)
            .unwrap();
        (keep, d)
    };
    let (ko, dropped) = opsm(&split);
    assert_eq!((ko, dropped), opsm(&whole));
    assert_eq!(
        check_opsm(&split, &adv, &roll, &old, &tokens, 0.2, &st).unwrap(),
        dropped
    );
    assert!(dropped > 0 && dropped < seqs);

    // A limit of 1 workgroup per dimension cannot hold 8 workgroups in a 2-D grid.
    capped.set_max_workgroups_per_dimension(1);
    let mut keep = vec![true; n];
    let e = split.rejection_mask(&criteria, &old, &roll, &tokens, &mut keep);
    assert!(
        matches!(
            e,
            Err(GpuError::TooManyWorkgroups {
                needed: 8,
                limit: 1,
                per_dimension: 1
            })
        ),
        "{e:?}"
    );
    assert!(keep.iter().all(|&x| x));
    let mut keep = vec![false; seqs];
    let e = split.off_policy_sequence_mask(&adv, &roll, &old, &tokens, 0.2, &mut keep);
    assert!(
        matches!(
            e,
            Err(GpuError::TooManyWorkgroups {
                needed: 8,
                limit: 1,
                per_dimension: 1
            })
        ),
        "{e:?}"
    );
    assert!(keep.iter().all(|&x| !x));
    st.report("2-D dispatch (2000 sequences, ≤ 6 workgroups per dimension)");
}
